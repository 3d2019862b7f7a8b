//! Page-locking host memory: the store asks, a backend does it (CUDA registers the ranges; the
//! host backend has nothing to lock). A trait here, rather than the backend itself, lets the
//! store pin without knowing about devices.

use std::any::Any;

/// What keeps host memory page-locked; dropping it unlocks the memory.
pub type PinGuard = Box<dyn Any + Send + Sync>;

#[derive(Debug, thiserror::Error)]
#[error("pinning {bytes} bytes of host memory failed: {reason}")]
pub struct PinError {
    pub bytes: u64,
    pub reason: String,
}

/// How the memory to lock is mapped: a sealed upload is mapped read-only, and locking it must
/// not ask for write access (CUDA: `CU_MEMHOSTREGISTER_READ_ONLY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinAccess {
    ReadWrite,
    ReadOnly,
}

pub trait HostPinner: Send + Sync {
    /// Page-locks host ranges `(address, length)` (a store arena, in chunks) for fast device
    /// copies. `None`: nothing needed locking.
    fn pin_host(
        &self,
        chunks: &[(usize, usize)],
        access: PinAccess,
    ) -> Result<Option<PinGuard>, PinError>;
}
