//! The seam between the daemon's logic and the memory it moves bytes into.
//!
//! A backend owns "device" memory that clients map (staging arenas, resident regions) and runs
//! the copies from the host store into it. The host backend (shared-memory regions and memcpy)
//! runs everywhere; the CUDA backend (IPC-exported `cuMemAlloc` memory and async copies) is the
//! reason the project exists. Everything above this module is backend-agnostic.
#![forbid(unsafe_code)]

pub mod host;

use std::sync::Arc;

use crate::store::HostSlice;

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

/// How a client reaches a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionHandle {
    ShmPath(String),
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
    #[error("copy failed: {0}")]
    Copy(String),
}

/// Device memory that clients map: a staging arena or a resident region. Freed on drop.
pub trait DeviceRegion: Send + Sync {
    fn size(&self) -> u64;
    fn handle(&self) -> RegionHandle;
    /// Writes `src` at `offset`. Runs only on the device's copy thread.
    fn write(&self, offset: u64, src: &[u8]) -> Result<(), BackendError>;
}

/// One group's bytes to move: from store slices to consecutive places in a region.
pub struct CopyJob {
    pub region: Arc<dyn DeviceRegion>,
    /// (source, destination offset in the region).
    pub spans: Vec<(HostSlice, u64)>,
}

impl CopyJob {
    pub fn bytes(&self) -> u64 {
        self.spans.iter().map(|(s, _)| s.len() as u64).sum()
    }
}

pub trait Backend: Send + Sync + 'static {
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
    /// staged (host: the bytes are in place).
    fn copy(&self, device: usize, job: &CopyJob) -> Result<(), BackendError>;
}
