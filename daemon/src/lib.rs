//! weightstream daemon: streams frozen model weights from a shared host store into device
//! memory that trainer processes map, just in time for their forward and backward passes.
//!
//! Module map (each knows only those below it; `tests/check_layers.py` checks it; the
//! `weightstream` binary, crate `weightstream-cli`, sits on top): `server` (the gRPC edge and
//! the handoff socket: validation, status mapping, start-up, drain) → `core` (shared state, the
//! fds clients pass and fetch) → `session` (actors, staging arenas, plans) → `residency` /
//! `scheduler` → `store` (registry, load, upload, pin) → `mem` (memfd mappings, host arenas and
//! slices); `backend` (host, CUDA: the only FFI) → `mem`; `pacing` (the copy token bucket and its
//! clock) is a leaf the scheduler reads; `terminal` (escaping names for people's terminals) is a
//! leaf any module may use. The store pins through `mem::HostPinner`, which every
//! backend implements.
// Unsafe code lives in three places that allow it explicitly: the CUDA driver layer
// (`backend::cuda::{ffi, safe}`, on their `mod` lines), the shared-memory mapping
// (`mem::shm::map`) and the one socket option read through libc (`server::sockopt`).
#![deny(unsafe_code)]

pub mod backend;
pub mod config;
pub mod core;
pub mod mem;
pub mod metrics;
pub mod pacing;
pub mod quota;
pub mod residency;
pub mod scheduler;
pub mod server;
pub mod session;
pub mod store;
pub mod terminal;
