//! Shared-memory segments: files in /dev/shm mapped with memmap2.
//!
//! memmap2 over files we create ourselves (rather than the `shared_memory` crate) because we
//! choose each file's mode and owner, the maps are `Send + Sync`, and the crate is maintained.
//! Every segment name starts with the daemon's prefix, so a restarted daemon sweeps what a
//! crashed one left behind, and a segment is unlinked when it is dropped.
//!
//! Access: every segment is readable by its owner and its group (the socket's group when
//! `socket_group` is set, so that exactly the peers who may connect can map it) and by nobody
//! else. Only the daemon writes models, staging and resident regions (0640). An upload region
//! is writable by the uploading peer alone: the daemon gives the file to the peer's uid when it
//! runs as root, and otherwise (it cannot chown, and must stay the owner to unlink the file
//! from the sticky /dev/shm) grants that uid write access with a POSIX ACL entry.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;

/// Mode of every segment: owner read-write, group read, others nothing. An upload's writer gets
/// write access through its ownership or an ACL entry, never through the group.
pub const SEGMENT_MODE: u32 = 0o640;

/// Who writes a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// Models, staging and resident regions: the daemon only.
    Daemon,
    /// An upload region: the peer with this uid only.
    Peer(u32),
}

/// Where segments live and how they are named.
#[derive(Debug)]
pub struct ShmDir {
    dir: PathBuf,
    prefix: String,
    next: AtomicU64,
    /// The group segments belong to (the socket's); `None`: the daemon's own.
    group: Option<u32>,
}

impl ShmDir {
    /// `tag` distinguishes daemons on one box (derived from the socket path).
    pub fn new(dir: impl Into<PathBuf>, tag: &str) -> Self {
        ShmDir {
            dir: dir.into(),
            prefix: format!("weightstream-{tag}-"),
            next: AtomicU64::new(1),
            group: None,
        }
    }

    /// Segments will belong to group `gid` (the socket's group), so that exactly the peers who
    /// may connect can read them.
    pub fn with_group(mut self, gid: Option<u32>) -> Self {
        self.group = gid;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Paths of the segments with this daemon's prefix that exist now.
    pub fn list(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with(&self.prefix))
            .map(|e| e.path())
            .collect();
        found.sort();
        found
    }

    /// Removes segments left by an earlier daemon with the same prefix; returns how many.
    pub fn sweep(&self) -> usize {
        self.list()
            .into_iter()
            .filter(|p| std::fs::remove_file(p).is_ok())
            .count()
    }

    /// Creates and maps a new segment of `size` bytes (at least one page) that `writer` may
    /// write and the segment group may read.
    pub fn create(&self, kind: &str, size: u64, writer: Writer) -> io::Result<ShmSegment> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self
            .dir
            .join(format!("{}{kind}-{}-{n}", self.prefix, std::process::id()));
        // Created private: nobody else can open it before its owner and mode are final.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        // From here on, the segment's drop removes the file on any error.
        let segment = ShmSegment {
            path,
            map: None,
            size,
        };
        // Reserve the pages now: a write into a mapping of a full tmpfs is a SIGBUS, an
        // fallocate that cannot reserve them is an error we can report.
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, size.max(1)).map_err(
            |e| {
                io::Error::new(
                    io::Error::from(e).kind(),
                    format!("cannot reserve {size} bytes in {}: {e}", self.dir.display()),
                )
            },
        )?;
        self.set_access(&file, writer).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot set the owner and mode of {}: {e}",
                    segment.path.display()
                ),
            )
        })?;
        segment.mapped(&file)
    }

    fn set_access(&self, file: &File, writer: Writer) -> io::Result<()> {
        use rustix::fs::{Gid, Mode, Uid, fchmod, fchown};
        if let Some(gid) = self.group {
            fchown(file, None, Some(Gid::from_raw_unchecked(gid)))?;
        }
        // Exactly this mode, whatever the umask; before the ACL, which sets the group bits.
        fchmod(file, Mode::from_raw_mode(SEGMENT_MODE))?;
        let me = rustix::process::geteuid();
        match writer {
            Writer::Daemon => {}
            Writer::Peer(uid) if uid == me.as_raw() => {}
            Writer::Peer(uid) if me.is_root() => {
                fchown(file, Some(Uid::from_raw_unchecked(uid)), None)?;
            }
            Writer::Peer(uid) => grant_write_acl(file, uid)?,
        }
        Ok(())
    }
}

/// `system.posix_acl_access` entries (linux/posix_acl_xattr.h): little-endian tag, permission
/// and id after a version header.
const ACL_XATTR_VERSION: u32 = 2;
const ACL_USER_OBJ: u16 = 0x01;
const ACL_USER: u16 = 0x02;
const ACL_GROUP_OBJ: u16 = 0x04;
const ACL_MASK: u16 = 0x10;
const ACL_OTHER: u16 = 0x20;
const ACL_UNDEFINED_ID: u32 = u32::MAX;
const ACL_READ: u16 = 4;
const ACL_WRITE: u16 = 2;

/// The ACL that lets `uid` write: owner rw, `uid` rw, group r, others nothing. The mask (rw)
/// bounds the named entry, not the group's own r, so group members still only read.
pub fn write_acl(uid: u32) -> Vec<u8> {
    let rw = ACL_READ | ACL_WRITE;
    let entries = [
        (ACL_USER_OBJ, rw, ACL_UNDEFINED_ID),
        (ACL_USER, rw, uid),
        (ACL_GROUP_OBJ, ACL_READ, ACL_UNDEFINED_ID),
        (ACL_MASK, rw, ACL_UNDEFINED_ID),
        (ACL_OTHER, 0, ACL_UNDEFINED_ID),
    ];
    let mut acl = ACL_XATTR_VERSION.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&perm.to_le_bytes());
        acl.extend_from_slice(&id.to_le_bytes());
    }
    acl
}

fn grant_write_acl(file: &File, uid: u32) -> io::Result<()> {
    rustix::fs::fsetxattr(
        file,
        "system.posix_acl_access",
        &write_acl(uid),
        rustix::fs::XattrFlags::empty(),
    )
    .map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!(
                "cannot grant uid {uid} write access with a POSIX ACL ({e}); run the daemon as \
                 root, or on a tmpfs with ACL support"
            ),
        )
    })
}

/// A mapped segment, unlinked on drop (clients that map it keep their mapping until they unmap).
#[derive(Debug)]
pub struct ShmSegment {
    path: PathBuf,
    map: Option<MmapMut>,
    size: u64,
}

impl ShmSegment {
    // The one place in the daemon outside the CUDA FFI layer that needs `unsafe`.
    #[allow(unsafe_code)]
    fn mapped(mut self, file: &File) -> io::Result<ShmSegment> {
        // SAFETY: the file is one we just created in our own prefix with create_new, sized and
        // reserved. Clients get write access only to upload files, which the daemon never
        // reads through this mapping (commit copies them with positioned reads), so a client
        // that truncates or rewrites one cannot fault or change what the daemon reads.
        self.map = Some(unsafe { memmap2::MmapOptions::new().map_mut(file)? });
        Ok(self)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.map {
            Some(m) => &m[..self.size as usize],
            None => &[],
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let size = self.size as usize;
        match &mut self.map {
            Some(m) => &mut m[..size],
            None => &mut [],
        }
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot remove shm segment");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn create_write_sweep_and_drop() {
        let dir = tempfile::tempdir().unwrap();
        let shm = ShmDir::new(dir.path(), "t1");
        let mut seg = shm.create("arena", 10_000, Writer::Daemon).unwrap();
        seg.bytes_mut()[9_999] = 7;
        assert_eq!(seg.bytes()[9_999], 7);
        assert_eq!(seg.bytes().len(), 10_000);
        let mode = std::fs::metadata(seg.path()).unwrap().mode();
        assert_eq!(mode & 0o7777, 0o640);
        assert_eq!(shm.list(), vec![seg.path().to_path_buf()]);
        // A stale file of the same prefix is swept; another daemon's is not.
        std::fs::write(dir.path().join("weightstream-t1-stale"), b"x").unwrap();
        std::fs::write(dir.path().join("weightstream-t2-other"), b"x").unwrap();
        drop(seg);
        assert_eq!(shm.sweep(), 1);
        assert!(shm.list().is_empty());
        assert!(dir.path().join("weightstream-t2-other").exists());
    }
}

#[cfg(test)]
mod access_tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn the_write_acl_names_the_peer_and_leaves_the_group_read_only() {
        let acl = write_acl(4242);
        let hex: String = acl.iter().map(|b| format!("{b:02x}")).collect();
        // Version 2, then user::rw-, user:4242:rw-, group::r--, mask::rw-, other::---.
        assert_eq!(
            hex,
            "02000000\
             01000600ffffffff\
             0200060092100000\
             04000400ffffffff\
             10000600ffffffff\
             20000000ffffffff"
        );
    }

    /// The ACL path as a daemon that cannot chown takes it; set here directly (the tests run as
    /// root, which chowns instead). Needs a filesystem with POSIX ACLs: the tmpfs at /dev/shm.
    #[test]
    fn an_acl_grant_lets_the_peer_write_and_shows_in_the_mode() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("upload");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(SEGMENT_MODE)).unwrap();
        grant_write_acl(&file, 4242).unwrap();
        let mut stored = vec![0u8; 64];
        let n = rustix::fs::fgetxattr(&file, "system.posix_acl_access", &mut stored).unwrap();
        assert_eq!(&stored[..n], write_acl(4242).as_slice());
        // The group bits now show the mask (rw); the group's own entry stays r.
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o7777, 0o660);
    }
}
