//! The host weight store: immutable, named models whose tensors live in shared-memory arenas.
//!
//! Sources are safetensors files the daemon reads itself, or uploads that a client writes into a
//! region the daemon hands it. Identical sources dedupe (same file identity, or same content
//! digest) and are reference counted, so one host copy serves every job on the box.
//!
//! One job per module: `registry` (models by id, references, dedup, host charges, sessions),
//! `load` (safetensors files into an arena), `upload` (client-written regions, sealed into an
//! arena), `pin` (page-locking an arena through a `HostPinner`); `safetensors` parses headers,
//! `sources` resolves paths. This file holds the types they share. Memory itself (segments,
//! arenas, slices) lives in `crate::mem`.

mod load;
mod pin;
pub mod quantize;
mod registry;
pub mod safetensors;
mod sources;
#[cfg(test)]
mod test_support;
mod upload;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

pub use self::load::Progress;
use self::registry::Inner;
pub use self::registry::{HostUse, ModelEntry};
use self::safetensors::{DType, HeaderError};
pub use self::sources::{SourceError, resolve_sources};
pub use self::upload::{TensorDecl, UploadTicket};
use crate::mem::shm::ShmDir;
use crate::mem::{HostArena, HostPinner, HostSlice, PinError};
use crate::quota::{HostQuota, QuotaError};

/// Alignment of each tensor in an arena: a page, so that the arena can be page-locked in
/// chunks that end on tensor boundaries (a copy never spans two registrations).
pub const TENSOR_ALIGN: u64 = 4096;

#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    pub max_tensors: u32,
    pub max_upload_bytes: u64,
    pub max_name_bytes: u32,
    pub host: HostQuota,
}

/// Who asks: the connection (which owns uploads) and its uid (which holds model references and
/// is charged host bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub conn: u64,
    pub uid: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("{path}: {source}")]
    Header { path: PathBuf, source: HeaderError },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tensor '{name}' is in both {first} and {second}")]
    DuplicateTensor {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("the model has {count} tensors, more than the limit of {limit}")]
    TooManyTensors { count: u64, limit: u32 },
    #[error("cannot create a shared-memory arena of {bytes} bytes: {source}")]
    Arena { bytes: u64, source: std::io::Error },
    #[error("unknown model_id '{0}'")]
    UnknownModel(String),
    #[error("unknown upload_id '{0}'")]
    UnknownUpload(String),
    #[error("upload_id '{0}' belongs to another connection")]
    NotOwner(String),
    #[error("upload region {path} is {actual} bytes, expected {expected}: it was truncated")]
    UploadTruncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("upload of {bytes} bytes exceeds max_upload_bytes = {limit}")]
    UploadTooLarge { bytes: u64, limit: u64 },
    #[error(
        "uid {uid} holds no reference to model_id '{id}': only a uid that loaded or uploaded \
         it may release it"
    )]
    NotHolder { id: String, uid: u32 },
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error(transparent)]
    Pin(#[from] PinError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Offset in the model's arena.
    pub offset: u64,
    pub nbytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelSource {
    File,
    Upload,
}

#[derive(Debug)]
pub struct Model {
    pub id: String,
    pub name: String,
    pub source: ModelSource,
    pub tensors: Vec<StoredTensor>,
    by_name: HashMap<String, usize>,
    arena: Arc<HostArena>,
    pub total_bytes: u64,
}

impl Model {
    fn new(
        id: String,
        name: String,
        source: ModelSource,
        tensors: Vec<StoredTensor>,
        arena: HostArena,
    ) -> Model {
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let total_bytes = tensors.iter().map(|t| t.nbytes).sum();
        Model {
            id,
            name,
            source,
            tensors,
            by_name,
            arena: Arc::new(arena),
            total_bytes,
        }
    }

    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn slice(&self, index: usize) -> HostSlice {
        let t = &self.tensors[index];
        HostSlice::new(Arc::clone(&self.arena), t.offset, t.nbytes)
    }

    pub fn arena(&self) -> &Arc<HostArena> {
        &self.arena
    }

    /// Host memory the model holds: its arena, padding included.
    pub fn host_bytes(&self) -> u64 {
        self.arena.size()
    }
}

pub struct Store {
    shm: Arc<ShmDir>,
    /// Page-locks filled arenas (the backend; the store knows it only as this).
    pinner: Arc<dyn HostPinner>,
    limits: StoreLimits,
    inner: Mutex<Inner>,
    /// Loads run one at a time, so two loads of the same files make one copy.
    load_lock: Mutex<()>,
}

impl Store {
    pub fn new(shm: Arc<ShmDir>, pinner: Arc<dyn HostPinner>, limits: StoreLimits) -> Store {
        Store {
            shm,
            pinner,
            limits,
            inner: Mutex::new(Inner::default()),
            load_lock: Mutex::new(()),
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain maps behind; their content stays usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}
