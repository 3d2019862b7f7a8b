//! weightstream daemon: streams frozen model weights from a shared host store into device
//! memory that trainer processes map, just in time for their forward and backward passes.
//!
//! The module map (which module may import which, from `server`, the gRPC edge, down to `mem`)
//! is the table in `tests/check_layers.py`, which checks that every import points down and that
//! no two modules import each other; `daemon/DESIGN.md` says what each module holds. The wire
//! (generated gRPC code, the handoff framing, socket resolution) is the crate
//! `weightstream-proto`, which the clients share.
// Unsafe code lives in four places that allow it explicitly: the CUDA driver layer
// (`backend::cuda::{ffi, safe}`, on their `mod` lines), the shared-memory mapping
// (`mem::shm::map`), and two libc calls of the server: the one socket option rustix lacks
// (`server::sockopt`) and giving freed heap back to the kernel (`server::heap`).
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
