//! The seam between the daemon's logic and the memory it moves bytes into.
//!
//! A backend owns "device" memory that clients map (staging arenas, resident regions) and runs
//! the copies from the host store into it. The host backend (shared-memory regions and memcpy)
//! runs everywhere; the CUDA backend (IPC-exported `cuMemAlloc` memory and async copies) is the
//! reason the project exists. Everything above this module is backend-agnostic.

pub mod cuda;
pub mod host;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use crate::mem::shm::Memfd;
use crate::mem::{HostPinner, HostSlice};

/// Which backend the daemon runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Host,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// A device as the protocol names it: by UUID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub uuid: String,
    pub name: String,
    pub total_memory: u64,
    pub free_memory: u64,
    pub pci_bus_id: String,
}

/// How a client reaches a region, as the session's owner is told it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionHandle {
    /// Host memory: the secret that fetches a read-only fd of it from the handoff socket,
    /// minted for the session's owner.
    FdSecret(String),
    CudaIpc(Vec<u8>),
}

/// What a region shares with its clients; the core turns it into a [`RegionHandle`] for each
/// session that maps it (a resident region can serve several sessions of several uids).
#[derive(Debug, Clone)]
pub enum RegionExport {
    /// Host shared memory: clients get a read-only fd of the memfd.
    Memfd(Arc<Memfd>),
    CudaIpc(Vec<u8>),
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("cannot allocate {bytes} bytes of {purpose} memory on device {device}: {reason}")]
    Alloc {
        device: String,
        bytes: u64,
        purpose: &'static str,
        reason: String,
    },
    #[error("copy of {bytes} bytes to offset {offset} does not fit the {size}-byte region")]
    OutOfBounds { offset: u64, bytes: u64, size: u64 },
    #[error("copy of {bytes} bytes from offset {offset} reads past the {size}-byte source region")]
    SourceOutOfBounds { offset: u64, bytes: u64, size: u64 },
    #[error("copy failed: {0}")]
    Copy(String),
    #[error("cannot create {count} interprocess events: {reason}")]
    Events { count: u32, reason: String },
}

/// Device memory that clients map: a staging arena or a resident region. Freed on drop.
pub trait DeviceRegion: Send + Sync {
    fn size(&self) -> u64;
    fn export(&self) -> RegionExport;
    fn as_any(&self) -> &dyn Any;
}

/// A session's interprocess events, exported once; indices are 1-based (0 means "no event").
#[allow(clippy::len_without_is_empty)] // a pool is never empty: it is made with its size
pub trait EventPool: Send + Sync {
    fn len(&self) -> u32;
    /// The exported handles, in index order (index i is `handles()[i - 1]`).
    fn handles(&self) -> Vec<Vec<u8>>;
    /// Whether the work before the event's latest record is done (a never-recorded event is).
    fn is_complete(&self, index: u32) -> bool;
    fn as_any(&self) -> &dyn Any;
}

/// Bytes already on the device: `len` bytes at `offset` of `region` (a resident region of the
/// same device, whose bytes never change once it is made).
#[derive(Clone)]
pub struct DeviceSlice {
    pub region: Arc<dyn DeviceRegion>,
    pub offset: u64,
    pub len: u64,
}

/// One unit of work for a device's copy thread: once the events it waits on are complete,
/// copy store slices (over the link) and device slices (within the device) into a region and
/// record an event.
pub struct CopyJob {
    pub region: Arc<dyn DeviceRegion>,
    /// (source, destination offset in the region).
    pub spans: Vec<(HostSlice, u64)>,
    /// (source, destination offset in the region): copies within the device, which do not
    /// cross the link (not paced, not charged to any share).
    pub from_device: Vec<(DeviceSlice, u64)>,
    pub events: Option<Arc<dyn EventPool>>,
    /// Events to wait on before writing (the free events of the space's previous occupants).
    pub wait: Vec<u32>,
    /// Event to record once the bytes are written (the ready event).
    pub record: Option<u32>,
    /// Return only once the bytes are in place (resident regions have no ready event).
    pub synchronous: bool,
}

impl CopyJob {
    /// A plain copy with no events.
    pub fn copy(region: Arc<dyn DeviceRegion>, spans: Vec<(HostSlice, u64)>) -> CopyJob {
        CopyJob {
            region,
            spans,
            from_device: Vec::new(),
            events: None,
            wait: Vec::new(),
            record: None,
            synchronous: false,
        }
    }

    /// A copy within the device: `from`'s bytes into `region` at `offset`.
    pub fn within(region: Arc<dyn DeviceRegion>, from: DeviceSlice, offset: u64) -> CopyJob {
        CopyJob {
            from_device: vec![(from, offset)],
            ..CopyJob::copy(region, Vec::new())
        }
    }

    /// Bytes the job writes, from wherever they come.
    pub fn bytes(&self) -> u64 {
        self.link_bytes() + self.device_bytes()
    }

    /// Bytes that cross the link (from the store's host memory).
    pub fn link_bytes(&self) -> u64 {
        self.spans.iter().map(|(s, _)| s.len() as u64).sum()
    }

    /// Bytes copied within the device.
    pub fn device_bytes(&self) -> u64 {
        self.from_device.iter().map(|(s, _)| s.len).sum()
    }

    /// Each span's destination range lies in the region, and each device slice in its source:
    /// `OutOfBounds` (or `SourceOutOfBounds`) names the first that does not.
    pub fn check_bounds(&self) -> Result<(), BackendError> {
        let size = self.region.size();
        let fits = |offset: u64, bytes: u64, size: u64| {
            offset.checked_add(bytes).is_some_and(|end| end <= size)
        };
        let into = |offset: u64, bytes: u64| match fits(offset, bytes, size) {
            true => Ok(()),
            false => Err(BackendError::OutOfBounds {
                offset,
                bytes,
                size,
            }),
        };
        for (src, offset) in &self.spans {
            into(*offset, src.len() as u64)?;
        }
        for (src, offset) in &self.from_device {
            let source = src.region.size();
            if !fits(src.offset, src.len, source) {
                return Err(BackendError::SourceOutOfBounds {
                    offset: src.offset,
                    bytes: src.len,
                    size: source,
                });
            }
            into(*offset, src.len)?;
        }
        Ok(())
    }

    /// Whether every event the job waits on is complete, so it can run without a device-side
    /// wait. The scheduler runs only ready jobs: measured on the H200, a copy stream that waits
    /// on another process's event (a client's free event) stalls the copies far beyond the
    /// event's completion (see the README's performance notes).
    pub fn ready(&self) -> bool {
        match &self.events {
            Some(pool) => self.wait.iter().all(|&w| pool.is_complete(w)),
            None => true,
        }
    }
}

/// How long a copy kept the device busy, as far as the backend knows when `copy` returns.
/// The scheduler sums these, and what `poll_copies` reports, into the device's busy time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyTiming {
    /// The bytes are in place and writing them took this long (host: the memcpy's wall time).
    Done(Duration),
    /// The copy is queued on the device: `poll_copies` reports its time once it is complete.
    Queued,
}

/// What `Backend::poll_copies` found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyPoll {
    /// Device time of queued copies seen complete since the previous poll.
    pub busy: Duration,
    /// Whether queued copies remain whose time is still to be reported.
    pub pending: bool,
}

/// Every backend also page-locks host memory for the store (`HostPinner`, the store's view of it).
pub trait Backend: HostPinner + Send + Sync + 'static {
    fn kind(&self) -> BackendKind;
    /// The devices, with free memory read now.
    fn devices(&self) -> Vec<DeviceInfo>;
    /// Alignment of every region offset the daemon hands out.
    fn alignment(&self) -> u64;
    fn alloc_region(
        &self,
        device: usize,
        size: u64,
        purpose: &'static str,
    ) -> Result<Arc<dyn DeviceRegion>, BackendError>;
    /// Runs on the device's copy thread. Returns once the client may be told the bytes are
    /// staged (host: the bytes are in place; CUDA: the copy and its ready event are queued).
    /// Takes the job because an asynchronous copy keeps its sources (`HostSlice`s, which hold
    /// their arena and its page-lock) until the device has read them.
    fn copy(&self, device: usize, job: CopyJob) -> Result<CopyTiming, BackendError>;
    /// Device time of `Queued` copies that completed since the last call. Runs on the device's
    /// copy thread, after each copy and while it waits; never blocks. The default suits a
    /// backend whose copies are all `Done`.
    fn poll_copies(&self, _device: usize) -> CopyPoll {
        CopyPoll::default()
    }
    /// Waits until every copy queued to the device so far has completed.
    fn synchronize(&self, device: usize) -> Result<(), BackendError>;
    /// Interprocess events for one session; None where the backend needs none (host).
    fn event_pool(
        &self,
        device: usize,
        count: u32,
    ) -> Result<Option<Arc<dyn EventPool>>, BackendError>;
}
