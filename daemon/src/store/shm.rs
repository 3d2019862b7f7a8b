//! Shared-memory segments: files in /dev/shm mapped with memmap2.
//!
//! memmap2 over files we create ourselves (rather than the `shared_memory` crate) because we
//! choose each file's mode (clients read staging, write uploads), the maps are `Send + Sync`, and
//! the crate is maintained. Every segment name starts with the daemon's prefix, so a restarted
//! daemon sweeps what a crashed one left behind, and a segment is unlinked when it is dropped.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;

/// Where segments live and how they are named.
#[derive(Debug)]
pub struct ShmDir {
    dir: PathBuf,
    prefix: String,
    next: AtomicU64,
}

impl ShmDir {
    /// `tag` distinguishes daemons on one box (derived from the socket path).
    pub fn new(dir: impl Into<PathBuf>, tag: &str) -> Self {
        ShmDir {
            dir: dir.into(),
            prefix: format!("weightstream-{tag}-"),
            next: AtomicU64::new(1),
        }
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

    /// Creates and maps a new segment of `size` bytes (at least one page) with `mode`.
    pub fn create(&self, kind: &str, size: u64, mode: u32) -> io::Result<ShmSegment> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self
            .dir
            .join(format!("{}{kind}-{}-{n}", self.prefix, std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)?;
        // The umask may have cut bits from `mode`: set it exactly.
        let segment = ShmSegment {
            path,
            map: None,
            size,
        };
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
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
        segment.mapped(&file)
    }
}

/// A mapped segment, unlinked on drop (clients that map it keep their mapping until they unmap).
#[derive(Debug)]
pub struct ShmSegment {
    path: PathBuf,
    map: Option<MmapMut>,
    size: u64,
}

impl ShmSegment {
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
    use super::*;

    #[test]
    fn create_write_sweep_and_drop() {
        let dir = tempfile::tempdir().unwrap();
        let shm = ShmDir::new(dir.path(), "t1");
        let mut seg = shm.create("arena", 10_000, 0o640).unwrap();
        seg.bytes_mut()[9_999] = 7;
        assert_eq!(seg.bytes()[9_999], 7);
        assert_eq!(seg.bytes().len(), 10_000);
        let mode = std::fs::metadata(seg.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o640);
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
