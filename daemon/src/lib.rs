//! weightstream daemon: streams frozen model weights from a shared host store into device
//! memory that trainer processes map, just in time for their forward and backward passes.
//!
//! Module map (each knows only those below it; the `weightstream` binary, crate
//! `weightstream-cli`, sits on top): `server` (the gRPC edge: validation, status mapping,
//! start-up, drain) → `core` (shared state) → `session` (actors, staging arenas, plans) →
//! `residency` / `scheduler` → `store` (safetensors, shared memory) → `backend` (host, and
//! CUDA, whose `ffi.rs` holds the FFI).

pub mod backend;
pub mod config;
pub mod core;
pub mod metrics;
pub mod quota;
pub mod residency;
pub mod scheduler;
pub mod server;
pub mod session;
pub mod store;
