//! Host memory that the store fills and the backends copy from: shared-memory segments
//! (memfds), the arenas models live in and slices of them, and the seam through which an arena
//! is page-locked. It sits below both `store` and `backend` and imports nothing from the daemon.

mod arena;
pub mod held;
pub mod parallel;
mod pin;
pub mod shm;

#[cfg(test)]
pub use self::arena::filled_for_tests;
pub use self::arena::{HostArena, HostSlice};
pub use self::pin::{HostPinner, PinAccess, PinError, PinGuard};

/// `n` rounded up to a multiple of `align`.
pub fn align_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}
