//! Memory that clients still hold after the daemon has let go of it.
//!
//! A client that fetched a memfd's fd (an upload region, a host-backend staging or resident
//! region) keeps its pages alive for as long as it holds that fd, a mapping of it, or a copy
//! it passed on or inherited across a fork: closing the upload or the session frees nothing
//! then. So when the daemon drops a memfd that it handed out, the memory stays charged to the
//! uids it was handed to until the kernel frees it, which the daemon learns from inotify: a
//! watch on the memfd's inode (added through `/proc/self/fd`, while the daemon's own fd is
//! still open) reports `IN_DELETE_SELF` and `IN_IGNORED` when the last fd or mapping of it,
//! anywhere, is gone and the inode is evicted. The watch does not keep the inode alive, and no
//! client can make events on it (the mask asks for nothing a client can cause), so the queue
//! holds at most two events per region; it is drained whenever the held bytes are asked for.
//! Should it overflow anyway, the inotify fd's `/proc/self/fdinfo` lists the watches still
//! alive.
//!
//! A pidfd of the fetching process was the other way: it misses an fd passed on to another
//! process or inherited by a child that outlives the fetcher, which the inode's eviction
//! does not.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

use rustix::fs::inotify;

/// What the memory counts against once the daemon has let go of it: host bytes (upload
/// regions, model arenas), or device bytes of a device (a host-backend staging or resident
/// region, which stands for device memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Charge {
    Host,
    Device(usize),
}

/// A process that was handed an fd of a memfd: its uid is charged for the memory until the
/// kernel frees it; its pid is named to the uid when that charge refuses a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdHolder {
    pub uid: u32,
    pub pid: i32,
    pub charge: Charge,
}

/// Bytes held by clients, as one quota sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldUse {
    /// Of the regions handed to the uid asked about.
    pub uid_bytes: u64,
    /// Of every region, each counted once.
    pub total_bytes: u64,
    /// The processes of that uid the regions were handed to, sorted.
    pub uid_pids: Vec<i32>,
    /// Every process any region was handed to, sorted.
    pub pids: Vec<i32>,
}

/// A region the daemon let go of and clients still hold.
#[derive(Debug)]
struct Region {
    size: u64,
    holders: Vec<FdHolder>,
}

/// The regions clients still hold, by inotify watch.
#[derive(Debug, Default)]
pub struct HeldMemory {
    /// Made at the first region to watch (most daemons never need one); `None` when inotify
    /// is not to be had (then a region's charge ends with the daemon's hold, as it did).
    inotify: OnceLock<Option<OwnedFd>>,
    regions: Mutex<HashMap<i32, Region>>,
}

impl HeldMemory {
    fn regions(&self) -> MutexGuard<'_, HashMap<i32, Region>> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn inotify(&self) -> Option<&OwnedFd> {
        let made = self.inotify.get_or_init(|| {
            let flags = inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK;
            inotify::init(flags)
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "cannot watch shared memory that clients hold \
                        (inotify_init1): its quota charge ends when the daemon lets go of it")
                })
                .ok()
        });
        made.as_ref()
    }

    /// Makes the inotify instance now rather than at the first region to watch (a daemon
    /// calls it at start: its fd count is then the same before and after any work).
    pub fn start(&self) {
        self.inotify();
    }

    /// The daemon lets go of a memfd (`fd`, `size` bytes) that was handed to `holders`: keeps
    /// it charged to them until the kernel frees it. Call it while `fd` is still open.
    pub(super) fn keep(&self, fd: BorrowedFd<'_>, size: u64, holders: Vec<FdHolder>) {
        let Some(inotify) = self.inotify() else {
            return;
        };
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        match inotify::add_watch(inotify, path, inotify::WatchFlags::DELETE_SELF) {
            Ok(wd) => {
                self.regions().insert(wd, Region { size, holders });
            }
            Err(e) => tracing::warn!(
                error = %e,
                size,
                "cannot watch a shared-memory region that clients may still hold \
                 (inotify_add_watch; see fs.inotify.max_user_watches): its quota charge ends now"
            ),
        }
    }

    /// Forgets the regions the kernel has freed since the last call.
    fn reap(&self, regions: &mut HashMap<i32, Region>) {
        let Some(inotify) = self.inotify.get().and_then(Option::as_ref) else {
            return;
        };
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        let mut events = inotify::Reader::new(inotify, &mut buf);
        let mut overflowed = false;
        loop {
            match events.next() {
                Ok(event) if event.events().contains(inotify::ReadFlags::QUEUE_OVERFLOW) => {
                    overflowed = true;
                }
                Ok(event) if event.events().contains(inotify::ReadFlags::IGNORED) => {
                    regions.remove(&event.wd());
                }
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => {}
                // AGAIN: nothing more queued.
                Err(_) => break,
            }
        }
        if overflowed {
            match live_watches(inotify.as_fd()) {
                Ok(live) => regions.retain(|wd, _| live.contains(wd)),
                Err(e) => tracing::warn!(error = %e, "cannot read the inotify watches back"),
            }
        }
    }

    /// What clients hold of the regions charged as `charge` says, for `uid` and in all.
    pub fn usage(&self, uid: u32, charge: impl Fn(Charge) -> bool) -> HeldUse {
        let mut regions = self.regions();
        self.reap(&mut regions);
        let mut used = HeldUse::default();
        for region in regions.values() {
            let held: Vec<&FdHolder> = (region.holders.iter())
                .filter(|h| charge(h.charge))
                .collect();
            if held.is_empty() {
                continue;
            }
            used.total_bytes += region.size;
            used.pids.extend(held.iter().map(|h| h.pid));
            if held.iter().any(|h| h.uid == uid) {
                used.uid_bytes += region.size;
                let pids = held.iter().filter(|h| h.uid == uid).map(|h| h.pid);
                used.uid_pids.extend(pids);
            }
        }
        for pids in [&mut used.pids, &mut used.uid_pids] {
            pids.sort_unstable();
            pids.dedup();
        }
        used
    }

    /// Regions clients still hold now.
    pub fn count(&self) -> usize {
        let mut regions = self.regions();
        self.reap(&mut regions);
        regions.len()
    }
}

/// The watches of an inotify fd that are still alive: `/proc/self/fdinfo` has a line
/// `inotify wd:<hex> ino:… sdev:… mask:…` for each.
fn live_watches(inotify: BorrowedFd<'_>) -> std::io::Result<Vec<i32>> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", inotify.as_raw_fd()))?;
    Ok(info
        .lines()
        .filter_map(|line| line.strip_prefix("inotify wd:"))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter_map(|wd| i32::from_str_radix(wd, 16).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(size: u64) -> OwnedFd {
        let fd = rustix::fs::memfd_create("held-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, size).unwrap();
        fd
    }

    fn holder(uid: u32, pid: i32, charge: Charge) -> FdHolder {
        FdHolder { uid, pid, charge }
    }

    /// A region stays charged while an fd a client holds (here, a dup standing for it) keeps
    /// it alive, to the uids it was handed to and for the charge it was handed out under; it
    /// goes when that fd closes.
    #[test]
    fn a_region_is_held_until_its_last_fd_closes() {
        let held = HeldMemory::default();
        let daemon = memfd(8192);
        let client = daemon.try_clone().unwrap();
        let (a, b) = (holder(7, 70, Charge::Host), holder(8, 80, Charge::Host));
        held.keep(daemon.as_fd(), 8192, vec![a, b]);
        drop(daemon);
        let host = |uid| held.usage(uid, |c| c == Charge::Host);
        let want = HeldUse {
            uid_bytes: 8192,
            total_bytes: 8192,
            uid_pids: vec![70],
            pids: vec![70, 80],
        };
        assert_eq!(host(7), want);
        assert_eq!(host(9).uid_bytes, 0);
        assert_eq!(host(9).total_bytes, 8192);
        assert_eq!(
            held.usage(7, |c| matches!(c, Charge::Device(_))),
            HeldUse::default()
        );
        drop(client);
        assert_eq!(host(7), HeldUse::default());
        assert_eq!(held.count(), 0);
    }

    /// A region nobody else holds is freed at once when the daemon lets go: no charge stays.
    #[test]
    fn a_region_nobody_holds_goes_with_the_daemons_fd() {
        let held = HeldMemory::default();
        let daemon = memfd(4096);
        held.keep(daemon.as_fd(), 4096, vec![holder(7, 70, Charge::Device(0))]);
        drop(daemon);
        assert_eq!(held.count(), 0);
    }

    /// After an overflowed queue the watches still alive are read back from fdinfo.
    #[test]
    fn live_watches_are_read_from_fdinfo() {
        let held = HeldMemory::default();
        let (kept, gone) = (memfd(4096), memfd(4096));
        let client = kept.try_clone().unwrap();
        held.keep(kept.as_fd(), 4096, vec![holder(7, 70, Charge::Host)]);
        held.keep(gone.as_fd(), 4096, vec![holder(7, 70, Charge::Host)]);
        drop((kept, gone));
        let inotify = held.inotify().unwrap();
        let live = live_watches(inotify.as_fd()).unwrap();
        let regions = held.regions();
        let wds: Vec<i32> = regions.keys().copied().collect();
        assert_eq!(wds.len(), 2);
        assert_eq!(live.len(), 1, "{live:?} of {wds:?}");
        assert!(wds.contains(&live[0]));
        drop(regions);
        drop(client);
    }
}
