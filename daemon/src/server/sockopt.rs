//! The one socket option neither rustix nor std reads: SO_PEERGROUPS (Linux 4.13+), the
//! supplementary groups the peer had when it connected. SO_PEERCRED carries only the primary
//! gid, and most users reach a shared daemon through a group that is not their primary one.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The groups the kernel caps a process at (NGROUPS_MAX): a larger answer is not a peer's.
const MAX_GROUPS: usize = 65_536;

/// The peer's supplementary groups, as they were at connect time, sorted and without repeats.
pub fn peer_groups(fd: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    // Most users are in a few groups; the kernel says how many it has when they do not fit.
    let mut groups: Vec<libc::gid_t> = vec![0; 32];
    loop {
        let mut len = (groups.len() * size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: `groups` is a live, writable buffer of `len` bytes; the kernel writes at most
        // `len` bytes into it and stores the length it wrote (or needs) in `len`.
        let rc = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n);
            groups.sort_unstable();
            groups.dedup();
            return Ok(groups);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ERANGE) || n <= groups.len() || n > MAX_GROUPS {
            return Err(err);
        }
        groups.resize(n, 0);
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_socket_pair_reports_this_process_s_groups() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut mine: Vec<u32> = rustix::process::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        mine.sort_unstable();
        mine.dedup();
        assert_eq!(peer_groups(a.as_fd()).unwrap(), mine);
    }
}
