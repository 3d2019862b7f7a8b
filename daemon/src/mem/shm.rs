//! Shared memory: anonymous memory files (memfds) mapped with memmap2.
//!
//! Every segment is a memfd (`memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)`): it has no name
//! in any directory (nothing to predict, link or sweep after a crash: `st_nlink` is 0) and is
//! reached only by holding an fd, which the daemon passes to the client it is for through the
//! handoff socket. Pages are reserved at creation, so a full tmpfs or cgroup is an error here,
//! never a SIGBUS on a later write: faulted in writable (`MADV_POPULATE_WRITE`) by several
//! threads at once, which allocates and zeroes them at the speed of many cores (a 60 GiB model
//! arena or upload region is 15 million pages, which `fallocate`, serialised on the file's lock,
//! allocates on one core and leaves its first writer to zero on another); `fallocate` where the
//! kernel predates that advice (Linux 5.14).
//!
//! Seals make the fds others hold harmless:
//! - every segment is sealed `SHRINK | GROW` before anyone else can hold it: no client can
//!   truncate a mapping the daemon reads (the SIGBUS of a shrunk file);
//! - a region the daemon writes and clients read (host staging, resident) is also sealed
//!   `FUTURE_WRITE` once mapped: the daemon's mapping writes on, but no fd (not even one a client
//!   reopens read-write through /proc) can write or map it writable;
//! - an upload region is written by its client through its fd, and sealed `WRITE` at commit,
//!   which the kernel refuses while a writable mapping exists; only then does the daemon map it,
//!   read-only, so its bytes can no longer change under the model they become.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use memmap2::{Advice, Mmap, MmapMut};
use rustix::fs::{FallocateFlags, MemfdFlags, Mode, OFlags, SealFlags, SeekFrom};

use super::held::{FdHolder, HeldMemory};
use super::parallel;

/// Bytes one thread faults in at a time when a segment is reserved.
const POPULATE_PIECE: usize = 64 << 20;
/// Threads that fault a segment in, at most (memory bandwidth is spent long before).
const POPULATE_THREADS: usize = 16;

/// The daemon's shared memory: makes segments, counts the live ones by kind, and keeps
/// those it let go of charged while clients still hold them.
#[derive(Debug, Default)]
pub struct Shm {
    live: Mutex<BTreeMap<&'static str, usize>>,
    held: HeldMemory,
}

impl Shm {
    pub fn new() -> Arc<Shm> {
        Arc::new(Shm::default())
    }

    /// Segments of `kind` ("model", "upload", "staging", "resident", "state") alive now.
    pub fn live(&self, kind: &str) -> usize {
        self.counts().get(kind).copied().unwrap_or(0)
    }

    /// Live segments of every kind.
    pub fn total(&self) -> usize {
        self.counts().values().sum()
    }

    /// Segments the daemon has let go of that clients still hold.
    pub fn held(&self) -> &HeldMemory {
        &self.held
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, usize>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new memfd of `size` bytes, sealed against resizing; not mapped, pages not reserved
    /// yet.
    fn memfd(self: &Arc<Self>, kind: &'static str, size: u64) -> io::Result<Memfd> {
        let memfd = self.memfd_of_any_size(kind, size)?;
        memfd.seal(SealFlags::SHRINK | SealFlags::GROW)?;
        Ok(memfd)
    }

    /// [`Shm::memfd`], not sealed: only [`ShmSegment::shrink_to`] seals it, and nothing hands
    /// out an fd of it before (`Memfd::reopen` refuses).
    fn memfd_of_any_size(self: &Arc<Self>, kind: &'static str, size: u64) -> io::Result<Memfd> {
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        // The name only labels the fd in /proc/PID/fd ("/memfd:weightstream-model (deleted)").
        let fd = rustix::fs::memfd_create(format!("weightstream-{kind}"), flags)?;
        *self.counts().entry(kind).or_default() += 1;
        // From here on, the memfd's drop gives the count back on any error.
        let memfd = Memfd {
            fd,
            size,
            kind,
            shm: Arc::clone(self),
            holders: Mutex::new(Vec::new()),
        };
        rustix::fs::ftruncate(&memfd.fd, size)?;
        Ok(memfd)
    }

    /// A segment the daemon writes (a model arena, a staging or resident region), mapped
    /// read-write; its pages are reserved (faulted in through this mapping) and its size sealed.
    pub fn create(self: &Arc<Self>, kind: &'static str, size: u64) -> io::Result<ShmSegment> {
        let memfd = self.memfd(kind, size)?;
        let map = map(&memfd, Access::ReadWrite)?;
        if let Map::Write(m) = &map {
            memfd.reserve_by(|offset, len| m.advise_range(Advice::PopulateWrite, offset, len))?;
        }
        Ok(ShmSegment {
            memfd: Arc::new(memfd),
            map,
        })
    }

    /// A segment the daemon writes and then shrinks to what it wrote ([`ShmSegment::shrink_to`]),
    /// mapped read-write: a model arena being coded. Not sealed against resizing until then,
    /// and no fd of it is handed out before. With `Pages::Reserved` its pages are reserved
    /// here, as [`Shm::create`] does; with `Pages::AsWritten` its writer reserves each range
    /// before writing it ([`ShmSegment::reserve_range`]), so only what it writes is allocated.
    pub fn create_shrinkable(
        self: &Arc<Self>,
        kind: &'static str,
        size: u64,
        pages: Pages,
    ) -> io::Result<ShmSegment> {
        let memfd = self.memfd_of_any_size(kind, size)?;
        let map = map(&memfd, Access::ReadWrite)?;
        if let (Map::Write(m), Pages::Reserved) = (&map, pages) {
            memfd.reserve_by(|offset, len| m.advise_range(Advice::PopulateWrite, offset, len))?;
        }
        Ok(ShmSegment {
            memfd: Arc::new(memfd),
            map,
        })
    }

    /// A session's state region of `size` bytes: its client writes and reads it through its
    /// own fd and mapping; the daemon never maps it, and does not reserve its pages (the
    /// client's first touch of each allocates it).
    pub fn create_state(self: &Arc<Self>, size: u64) -> io::Result<Arc<Memfd>> {
        Ok(Arc::new(self.memfd("state", size)?))
    }

    /// An upload region of `size` bytes: not mapped by the daemon (its uploader writes it
    /// through its own fd) until [`ShmSegment::sealed`] at commit. With
    /// [`UploadPages::Reserved`] its pages are reserved here (the daemon maps it writable only
    /// to fault them in, and unmaps it before anyone else can hold it); with
    /// [`UploadPages::ByUploader`] the uploader's own writes (or page-locking) fault them in.
    pub fn create_upload(
        self: &Arc<Self>,
        size: u64,
        pages: UploadPages,
    ) -> io::Result<Arc<Memfd>> {
        let memfd = self.memfd("upload", size)?;
        if size > 0 && pages == UploadPages::Reserved {
            let file = File::from(memfd.fd.try_clone()?);
            let map = memmap2::MmapOptions::new()
                .len(size as usize)
                .map_raw(&file)?;
            // A fork of this process (a library's; a test's, whose daemon runs in its own
            // process) would hold a copy of the writable mapping until its exec, and
            // CommitUpload's write seal is refused while any exists.
            map.advise(Advice::DontFork)?;
            memfd.reserve_by(|offset, len| map.advise_range(Advice::PopulateWrite, offset, len))?;
        }
        Ok(Arc::new(memfd))
    }
}

/// When a shrinkable segment's pages are reserved ([`Shm::create_shrinkable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// At creation, all of them.
    Reserved,
    /// By its writer, range by range ([`ShmSegment::reserve_range`]).
    AsWritten,
}

/// Who faults an upload region's pages in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadPages {
    /// The daemon, before the region is handed out (seconds for tens of GB): a full tmpfs or
    /// memory cgroup is the begin's error, never a SIGBUS at the uploader's first write.
    Reserved,
    /// The uploader, as it writes (its `MADV_POPULATE_WRITE` or page-locking of each part):
    /// the reservation overlaps the writes; the pages are charged to the uploader's memory
    /// cgroup.
    ByUploader,
}

/// Runs `populate(offset, len)` over `0..size` in pieces of [`POPULATE_PIECE`] bytes on up to
/// [`POPULATE_THREADS`] threads (the first piece on this one: a kernel without the advice says
/// so there, and `Ok(false)` is returned). Stops at the first error.
fn populate_parallel(
    size: usize,
    populate: &(dyn Fn(usize, usize) -> io::Result<()> + Sync),
) -> io::Result<bool> {
    if size == 0 {
        return Ok(true);
    }
    match populate(0, size.min(POPULATE_PIECE)) {
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
            return Ok(false);
        }
        other => other?,
    }
    let pieces: Vec<usize> = (1..size.div_ceil(POPULATE_PIECE)).collect();
    let threads = parallel::threads_for(pieces.len(), POPULATE_THREADS);
    let piece = |n: usize| {
        let offset = n * POPULATE_PIECE;
        populate(offset, POPULATE_PIECE.min(size - offset))
    };
    parallel::for_each(pieces, threads, piece, |()| {})?;
    Ok(true)
}

/// How a client may use an fd the daemon passes it: a new open file description of the memfd
/// each time (the client shares no file offset or status flags with the daemon).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// An upload region for its uploader, a state region for its session's owner (the
    /// memfd's seals still apply).
    ReadWrite,
    /// A region the client only reads: opened read-only, it can neither write nor map the
    /// memory writable.
    ReadOnly,
}

/// Why a memfd could not be sealed against writes.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// EBUSY: someone still maps the memfd writable.
    #[error("the region is still mapped writable")]
    MappedWritable,
    /// EPERM with F_SEAL_SEAL set: a holder of the fd (the uploader) closed its seals.
    #[error("the region's seals were closed (F_SEAL_SEAL) by a holder of its fd")]
    SealsClosed,
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// A memfd, counted as a live segment of its kind until dropped (the memory goes once every fd
/// and mapping of it, the clients' included, is gone: until then it stays charged to those it
/// was handed to, see [`HeldMemory`]).
#[derive(Debug)]
pub struct Memfd {
    fd: OwnedFd,
    size: u64,
    kind: &'static str,
    shm: Arc<Shm>,
    /// The processes it was handed to ([`Memfd::hand_out`]).
    holders: Mutex<Vec<FdHolder>>,
}

impl Memfd {
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn kind(&self) -> &'static str {
        self.kind
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// An fd to pass to a client (see [`Access`]).
    pub fn share(&self, access: Access) -> io::Result<OwnedFd> {
        self.reopen(access)
    }

    /// An fd to pass to `holder`: the memory stays charged to it, once the daemon lets go of
    /// the memfd, until the kernel frees it.
    pub fn hand_out(&self, access: Access, holder: FdHolder) -> io::Result<OwnedFd> {
        let fd = self.share(access)?;
        let mut holders = self.holders.lock().unwrap_or_else(|p| p.into_inner());
        if !holders.contains(&holder) {
            holders.push(holder);
        }
        Ok(fd)
    }

    /// A new open file description of this memfd (through /proc/self/fd: a memfd has no other
    /// path).
    fn reopen(&self, access: Access) -> io::Result<OwnedFd> {
        use std::os::fd::AsRawFd;
        // A segment still shrinkable would SIGBUS in a holder's mapping once shrunk.
        if !self.seals()?.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(io::Error::other(
                "a segment is shared only once its size is sealed",
            ));
        }
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        let mode = match access {
            Access::ReadWrite => OFlags::RDWR,
            Access::ReadOnly => OFlags::RDONLY,
        };
        Ok(rustix::fs::open(
            path,
            mode | OFlags::CLOEXEC,
            Mode::empty(),
        )?)
    }

    /// Reserves every page of a new memfd through a writable mapping of it:
    /// `populate(offset, len)` faults a range in (`MADV_POPULATE_WRITE`), on several threads;
    /// where the kernel lacks that advice, `fallocate` (one thread). A full tmpfs or cgroup fails
    /// here instead of faulting later.
    fn reserve_by(
        &self,
        populate: impl Fn(usize, usize) -> io::Result<()> + Sync,
    ) -> io::Result<()> {
        self.reserve_range_by(0, self.size, populate)
    }

    /// [`Memfd::reserve_by`] for the pages of `start..start + len` (`start` on a page).
    fn reserve_range_by(
        &self,
        start: u64,
        len: u64,
        populate: impl Fn(usize, usize) -> io::Result<()> + Sync,
    ) -> io::Result<()> {
        let at = |offset: usize, n: usize| populate(start as usize + offset, n);
        match populate_parallel(len as usize, &at) {
            Ok(true) => Ok(()),
            Ok(false) => rustix::fs::fallocate(&self.fd, FallocateFlags::empty(), start, len)
                .map_err(|e| self.reserve_error(e.into(), len)),
            Err(e) => Err(self.reserve_error(e, len)),
        }
    }

    /// Reserves every page with `fallocate`; also fills holes punched since (sealing writes
    /// does not forbid reserving), and costs little then when there are none: it first asks
    /// where the first hole is.
    fn reserve(&self) -> io::Result<()> {
        if self.size == 0 || !self.has_holes()? {
            return Ok(());
        }
        rustix::fs::fallocate(&self.fd, FallocateFlags::empty(), 0, self.size)
            .map_err(|e| self.reserve_error(e.into(), self.size))
    }

    /// Whether a page of the memfd is not allocated (`SEEK_HOLE` finds one before the end).
    fn has_holes(&self) -> io::Result<bool> {
        match rustix::fs::seek(&self.fd, SeekFrom::Hole(0)) {
            Ok(hole) => Ok(hole < self.size),
            // ENXIO: nothing at or past offset 0 (an empty file).
            Err(rustix::io::Errno::NXIO) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn reserve_error(&self, e: io::Error, bytes: u64) -> io::Error {
        io::Error::new(
            e.kind(),
            format!("cannot reserve {bytes} bytes of shared memory: {e}"),
        )
    }

    fn seal(&self, seals: SealFlags) -> io::Result<()> {
        Ok(rustix::fs::fcntl_add_seals(&self.fd, seals)?)
    }

    /// From now on, nothing but the mappings that exist already can write the memory: no
    /// `write`, no new writable mapping, whatever fd is used.
    pub fn forbid_new_writers(&self) -> io::Result<()> {
        self.seal(SealFlags::FUTURE_WRITE)
    }

    /// Seals the memory against every write, for good: refused while a writable mapping of it
    /// exists (the client has not unmapped its upload). Then reserves its pages again, in case
    /// the writer punched holes.
    pub fn seal_writes(&self) -> Result<(), SealError> {
        match rustix::fs::fcntl_add_seals(&self.fd, SealFlags::WRITE) {
            Err(rustix::io::Errno::BUSY) => return Err(SealError::MappedWritable),
            Err(rustix::io::Errno::PERM) if self.seals()?.contains(SealFlags::SEAL) => {
                return Err(SealError::SealsClosed);
            }
            other => other.map_err(io::Error::from)?,
        }
        Ok(self.reserve()?)
    }

    pub fn seals(&self) -> io::Result<SealFlags> {
        Ok(rustix::fs::fcntl_get_seals(&self.fd)?)
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        let holders = std::mem::take(self.holders.get_mut().unwrap_or_else(|p| p.into_inner()));
        if !holders.is_empty() {
            // Before the daemon's fd closes: the watch is added through it.
            self.shm.held.keep(self.fd.as_fd(), self.size, holders);
        }
        let mut counts = self.shm.counts();
        if let Some(n) = counts.get_mut(self.kind) {
            *n -= 1;
            if *n == 0 {
                counts.remove(self.kind);
            }
        }
    }
}

enum Map {
    Write(MmapMut),
    Read(Mmap),
}

/// A mapped memfd: written by the daemon, or sealed and read-only.
pub struct ShmSegment {
    memfd: Arc<Memfd>,
    map: Map,
}

impl std::fmt::Debug for ShmSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmSegment")
            .field("memfd", &self.memfd)
            .field("read_only", &self.is_read_only())
            .finish()
    }
}

/// Maps all of `memfd`. One of the four places in the daemon that allow `unsafe` (`lib.rs`
/// names them).
#[allow(unsafe_code)]
fn map(memfd: &Memfd, access: Access) -> io::Result<Map> {
    let len = memfd.size as usize;
    match access {
        Access::ReadWrite => {
            let file = File::from(memfd.fd.try_clone()?);
            // SAFETY: a memfd this daemon just made, sized and sealed against shrinking (no
            // SIGBUS), or shrinkable, which no fd is handed out of and only
            // `ShmSegment::shrink_to` resizes, after dropping this mapping; nobody else holds an
            // fd of it yet, and the fds handed out later are read-only or come after
            // `forbid_new_writers`, so only this mapping writes it.
            Ok(Map::Write(unsafe {
                memmap2::MmapOptions::new().len(len).map_mut(&file)?
            }))
        }
        Access::ReadOnly => {
            // A read-only file: the mapping cannot even become writable.
            let file = File::from(memfd.reopen(Access::ReadOnly)?);
            // SAFETY: the caller sealed the memfd against writes, shrinking and growing
            // (`ShmSegment::sealed` checks): its bytes can never change again and no access
            // past its end can fault.
            Ok(Map::Read(unsafe {
                memmap2::MmapOptions::new().len(len).map(&file)?
            }))
        }
    }
}

impl ShmSegment {
    /// Maps a memfd sealed against writes (an upload at commit) read-only.
    pub fn sealed(memfd: Arc<Memfd>) -> io::Result<ShmSegment> {
        let all = SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW;
        if !memfd.seals()?.contains(all) {
            return Err(io::Error::other("the memfd is not sealed against writes"));
        }
        let map = map(&memfd, Access::ReadOnly)?;
        Ok(ShmSegment { memfd, map })
    }

    pub fn memfd(&self) -> &Arc<Memfd> {
        &self.memfd
    }

    pub fn size(&self) -> u64 {
        self.memfd.size
    }

    pub fn is_read_only(&self) -> bool {
        matches!(self.map, Map::Read(_))
    }

    /// Whether this is a writable segment not sealed against resizing yet
    /// ([`Shm::create_shrinkable`]).
    pub fn is_shrinkable(&self) -> bool {
        !self.is_read_only()
            && self
                .memfd
                .seals()
                .is_ok_and(|s| !s.contains(SealFlags::SHRINK))
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.map {
            Map::Write(m) => m,
            Map::Read(m) => m,
        }
    }

    /// Reserves the pages of `offset..offset + len` (rounded out to pages) of a segment made
    /// with `Pages::AsWritten`, before they are written: a full tmpfs or cgroup is this error,
    /// never a SIGBUS at the write. Several threads for a large range, as at creation.
    pub fn reserve_range(&self, offset: u64, len: u64) -> io::Result<()> {
        let Map::Write(m) = &self.map else {
            return Err(io::Error::other("a read-only segment is not written"));
        };
        let page = rustix::param::page_size() as u64;
        let start = offset / page * page;
        let end = (offset + len).min(self.size());
        if end <= start {
            return Ok(());
        }
        let populate = |o: usize, l: usize| m.advise_range(Advice::PopulateWrite, o, l);
        self.memfd.reserve_range_by(start, end - start, populate)
    }

    /// The segment cut to its first `len` bytes and sealed against resizing (the rest of its
    /// pages freed): for a segment of [`Shm::create_shrinkable`], whose only holder is this.
    /// Also seals one that keeps its size.
    pub fn shrink_to(self, len: u64) -> io::Result<ShmSegment> {
        let ShmSegment { memfd, map: old } = self;
        if !matches!(old, Map::Write(_)) {
            return Err(io::Error::other("a read-only segment is not resized"));
        }
        let mut memfd = Arc::try_unwrap(memfd)
            .map_err(|_| io::Error::other("a segment held elsewhere is not resized"))?;
        if len > memfd.size {
            return Err(io::Error::other("a segment only shrinks"));
        }
        // Unmapped before the file shrinks: no mapping ever reaches past its end.
        drop(old);
        rustix::fs::ftruncate(&memfd.fd, len)?;
        memfd.size = len;
        memfd.seal(SealFlags::SHRINK | SealFlags::GROW)?;
        let map = map(&memfd, Access::ReadWrite)?;
        Ok(ShmSegment {
            memfd: Arc::new(memfd),
            map,
        })
    }

    /// The bytes to fill; `None` for a sealed, read-only segment.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match &mut self.map {
            Map::Write(m) => Some(m),
            Map::Read(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    use super::*;

    fn link_of(fd: BorrowedFd<'_>) -> String {
        use std::os::fd::AsRawFd;
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        link.display().to_string()
    }

    #[test]
    fn a_segment_is_a_nameless_memfd_counted_while_it_lives() {
        let shm = Shm::new();
        let mut seg = shm.create("model", 10_000).unwrap();
        seg.bytes_mut().unwrap()[9_999] = 7;
        assert_eq!((seg.bytes()[9_999], seg.bytes().len()), (7, 10_000));
        let stat = rustix::fs::fstat(seg.memfd().fd()).unwrap();
        assert_eq!((stat.st_nlink, stat.st_size), (0, 10_000));
        assert!(stat.st_blocks * 512 >= 10_000, "pages reserved");
        assert_eq!(
            link_of(seg.memfd().fd()),
            "/memfd:weightstream-model (deleted)"
        );
        assert_eq!((shm.live("model"), shm.total()), (1, 1));
        drop(seg);
        assert_eq!(shm.total(), 0);
        let empty = shm.create("staging", 0).unwrap();
        assert!(empty.bytes().is_empty());
    }

    #[test]
    fn a_read_only_fd_cannot_write_resize_or_map_writable() {
        let shm = Shm::new();
        let mut seg = shm.create("staging", 4096).unwrap();
        seg.memfd().forbid_new_writers().unwrap();
        seg.bytes_mut().unwrap()[0] = 1; // the daemon's own mapping still writes
        let ro = File::from(seg.memfd().share(Access::ReadOnly).unwrap());
        let mut buf = [0u8; 1];
        ro.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [1]);
        assert!(ro.write_at(b"x", 0).is_err());
        assert_eq!(
            rustix::fs::ftruncate(&ro, 0).unwrap_err(),
            rustix::io::Errno::INVAL
        );
        // Reopened read-write through /proc: the seal still refuses writes and resizes.
        use std::os::fd::AsRawFd;
        let path = format!("/proc/self/fd/{}", ro.as_raw_fd());
        let rw = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        assert_eq!(rw.write_at(b"x", 0).unwrap_err().raw_os_error(), Some(1));
        assert!(rw.set_len(1).is_err());
        assert!(memmap2::MmapOptions::new().len(4096).map_raw(&rw).is_err());
    }

    #[test]
    fn an_upload_is_sealed_against_writes_only_once_unmapped() {
        let shm = Shm::new();
        let memfd = shm.create_upload(8192, UploadPages::Reserved).unwrap();
        let mut client = File::from(memfd.share(Access::ReadWrite).unwrap());
        assert_eq!(
            rustix::fs::ftruncate(&client, 100).unwrap_err(),
            rustix::io::Errno::PERM,
            "sealed against shrinking"
        );
        client.write_all(b"weights").unwrap();
        let mapped = unsafe_free_map(&client);
        assert!(matches!(
            memfd.seal_writes(),
            Err(SealError::MappedWritable)
        ));
        assert!(ShmSegment::sealed(memfd.clone()).is_err(), "not sealed yet");
        drop(mapped);
        memfd.seal_writes().unwrap();
        assert_eq!(
            client.write_at(b"x", 0).unwrap_err().raw_os_error(),
            Some(1)
        );
        let seg = ShmSegment::sealed(memfd).unwrap();
        assert!(seg.is_read_only());
        assert_eq!(&seg.bytes()[..7], b"weights");
    }

    /// A memfd handed out stays charged to its holder after the daemon drops it, until the
    /// holder's fd closes; one never handed out is not charged at all.
    #[test]
    fn a_memfd_handed_out_is_held_after_its_drop_until_the_client_lets_go() {
        use crate::mem::held::{Charge, FdHolder};
        let shm = Shm::new();
        let memfd = shm.create_upload(8192, UploadPages::Reserved).unwrap();
        let holder = FdHolder {
            uid: 7,
            pid: 70,
            charge: Charge::Host,
        };
        let client = memfd.hand_out(Access::ReadWrite, holder).unwrap();
        let never_shared = shm.create_upload(4096, UploadPages::Reserved).unwrap();
        drop((memfd, never_shared));
        assert_eq!(shm.total(), 0, "the daemon holds none");
        let host = || shm.held().usage(7, |c| c == Charge::Host);
        assert_eq!((host().uid_bytes, host().total_bytes), (8192, 8192));
        drop(client);
        assert_eq!((host().uid_bytes, shm.held().count()), (0, 0));
    }

    /// A shrinkable segment: no fd of it is handed out until it is cut and sealed; with
    /// `Pages::AsWritten` only the ranges reserved are allocated; `shrink_to` frees the rest
    /// and the bytes before the cut stay.
    #[test]
    fn a_shrinkable_segment_is_shared_only_once_cut_to_size() {
        let shm = Shm::new();
        let page = rustix::param::page_size() as u64;
        let mut seg = (shm)
            .create_shrinkable("model", 64 * page, Pages::AsWritten)
            .unwrap();
        let blocks = |s: &ShmSegment| rustix::fs::fstat(s.memfd().fd()).unwrap().st_blocks * 512;
        assert_eq!(blocks(&seg), 0, "nothing reserved yet");
        assert!(seg.is_shrinkable());
        let refused = seg.memfd().share(Access::ReadOnly).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "a segment is shared only once its size is sealed"
        );
        seg.reserve_range(page + 1, 2 * page).unwrap();
        assert_eq!(blocks(&seg) as u64, 3 * page, "the pages the range touches");
        seg.bytes_mut().unwrap()[page as usize + 1] = 9;
        let seg = seg.shrink_to(2 * page).unwrap();
        assert_eq!(
            (seg.size(), seg.bytes().len()),
            (2 * page, 2 * page as usize)
        );
        assert_eq!(blocks(&seg) as u64, page, "the pages past the cut are gone");
        assert_eq!(seg.bytes()[page as usize + 1], 9);
        assert!(!seg.is_shrinkable());
        let ro = File::from(seg.memfd().share(Access::ReadOnly).unwrap());
        assert_eq!(
            rustix::fs::ftruncate(&ro, 0).unwrap_err(),
            rustix::io::Errno::INVAL
        );
        assert!(seg.shrink_to(page).is_err(), "sealed");
        assert_eq!(shm.live("model"), 0);
    }

    /// A writable shared mapping, as a client makes one (memmap2's raw map needs no unsafe).
    fn unsafe_free_map(file: &File) -> memmap2::MmapRaw {
        memmap2::MmapOptions::new().len(8192).map_raw(file).unwrap()
    }
}
