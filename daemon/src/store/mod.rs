//! The host weight store: immutable, named models whose tensors live in shared-memory arenas.
//!
//! Sources are safetensors files that clients open and pass as fds (the daemon reads them with
//! positioned reads and never opens a path), or uploads that a client writes into a memfd the
//! daemon hands it and that becomes the model's arena once sealed. Identical sources dedupe
//! (same file identity, or same content digest) and are reference counted, so one host copy
//! serves every job on the box.
//!
//! One job per module: `registry` (models by id, references, dedup, host charges, sessions),
//! `cache` (evicting models only closed connections hold, to make room; refusals that say
//! what holds the memory),
//! `load` (safetensors files into an arena), `upload` (client-written regions, sealed into
//! arenas), `state` (sessions' state regions: host memory charged like the rest, never shared),
//! `pin` (page-locking an arena through a `HostPinner`); `formats` sums a model's formats for
//! `status`; `safetensors` parses headers; `rans8` codes 8-bit weights losslessly (interleaved
//! rANS, the format of `tests/bench/rans8.py`) and `coding` codes a filled arena with it;
//! `parallel` spreads reading and hashing over threads, `phases` times them.
//! This file holds the types they share. Memory itself (memfds, arenas, slices) lives in
//! `crate::mem`.

mod cache;
pub mod coding;
pub mod formats;
mod load;
mod phases;
mod pin;
pub mod prequantized;
pub mod quantize;
pub mod rans8;
mod registry;
mod reserve;
pub mod safetensors;
mod state;
#[cfg(test)]
pub(crate) mod test_support;
mod upload;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use self::coding::CodedLayout;
use self::formats::FormatLabel;
pub use self::load::{LoadSource, Progress, Selection};
pub use self::phases::{Phases, Stored};
use self::quantize::{NonFinite, Quantization, QuantizeError, StoredLayout};
use self::registry::Inner;
pub use self::registry::{Holder, HostUse, ModelEntry};
use self::safetensors::{DType, HeaderError};
pub use self::state::{STATE_ALIGN, StateTicket, StateUse};
pub use self::upload::{DeclQuant, TensorDecl, UploadTicket};
use crate::mem::held::Charge;
use crate::mem::shm::Shm;
use crate::mem::{HostArena, HostPinner, HostSlice, PinError};
use crate::quota::{Held, HeldByClients, HostQuota, QuotaError};

/// Alignment of each tensor in an arena: a page, so that the arena can be page-locked in
/// chunks that end on tensor boundaries (a copy never spans two registrations).
pub const TENSOR_ALIGN: u64 = 4096;

#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    pub max_tensors: u32,
    pub max_upload_bytes: u64,
    pub max_name_bytes: u32,
    /// `limits.max_message_bytes`: a model whose description could not be sent in one
    /// message (LoadModel's or CommitUpload's answer, a page of ListModels) is refused before
    /// anything is stored ([`description_bytes`]).
    pub max_message_bytes: u64,
    /// Uploads in progress, all uids together (`limits.max_uploads`): each holds a memfd.
    pub max_uploads: u32,
    /// State regions one session may hold (`limits.max_state_regions_per_session`): each
    /// holds a memfd.
    pub max_state_regions: u32,
    pub host: HostQuota,
}

/// Who asks: the connection (which owns uploads) and its uid (which holds model references and
/// is charged host bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub conn: u64,
    pub uid: u32,
}

/// How long a model reference (LoadModel, CommitUpload) lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Retention {
    /// Kept after the connection that took it closes (the command that loaded a model exits,
    /// the model stays for the next job); from then on it holds the model as a cache entry
    /// only: one that no session, no pin and no open connection's reference holds is evicted,
    /// least recently used first, when a load or upload needs its memory.
    #[default]
    Cached,
    /// Given back when the connection that took it closes: when its process is gone.
    Connection,
    /// Kept, never evicted, until released.
    Pinned,
}

/// Every error of the store. Files are named by the display names their clients gave
/// (`LoadModelRequest.paths`): the daemon never opens those paths. No message carries file
/// bytes.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Header { path: String, source: HeaderError },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a regular file: only regular files can be loaded")]
    NotAFile { path: String },
    #[error("tensor '{name}' is in both {first} and {second}")]
    DuplicateTensor {
        name: String,
        first: String,
        second: String,
    },
    #[error("tensors: '{name}' is in none of the files ({files})")]
    NotInFiles { name: String, files: String },
    #[error(
        "tensors: '{name}' is the scale of pre-quantized weight '{weight}', loaded with it: \
         name the weight"
    )]
    SelectedScale { name: String, weight: String },
    #[error("the model has {count} tensors: limits.max_tensors_per_model = {limit}")]
    TooManyTensors { count: u64, limit: u32 },
    #[error(
        "the model's description (its tensors' names and shapes) takes up to {bytes} bytes, \
         more than one message holds with the rest of an answer: limits.max_message_bytes = \
         {limit}"
    )]
    DescriptionTooLarge { bytes: u64, limit: u64 },
    #[error("cannot create a shared-memory arena of {bytes} bytes: {source}")]
    Arena { bytes: u64, source: std::io::Error },
    #[error("unknown model_id '{0}'")]
    UnknownModel(String),
    #[error("unknown upload_id '{0}'")]
    UnknownUpload(String),
    #[error("upload_id '{0}' belongs to another connection")]
    NotOwner(String),
    #[error(
        "upload_id '{0}': the upload region is still mapped writable by the client: unmap it \
         before CommitUpload"
    )]
    UploadMapped(String),
    #[error(
        "upload_id '{0}': the client closed the upload region's seals (F_SEAL_SEAL), so the \
         daemon cannot seal it against writes: abort the upload and upload again without \
         F_SEAL_SEAL"
    )]
    UploadSealsClosed(String),
    #[error("upload_id '{upload_id}': cannot seal the upload region: {source}")]
    Seal {
        upload_id: String,
        source: std::io::Error,
    },
    #[error("upload of {bytes} bytes exceeds max_upload_bytes = {limit}")]
    UploadTooLarge { bytes: u64, limit: u64 },
    #[error(
        "limits.max_uploads = {limit} reached: the daemon has {used} {}",
        uploads_in_progress(u64::from(*used))
    )]
    TooManyUploads { limit: u32, used: u32 },
    #[error(
        "limits.max_state_regions_per_session = {limit} reached: session '{session}' holds \
         {limit} state regions"
    )]
    TooManyStateRegions { session: String, limit: u32 },
    #[error("unknown region_id '{0}' (a state region ends with its session)")]
    UnknownStateRegion(String),
    #[error(
        "uid {uid} holds no reference to model_id '{id}': only a uid that loaded or uploaded \
         it may release it"
    )]
    NotHolder { id: String, uid: u32 },
    /// A weight that cannot be quantized (its rank, dtype, or a non-finite value).
    #[error(transparent)]
    Quantize(#[from] QuantizeError),
    #[error(
        "tensor '{name}': scale {value} at index {index}: the scales of 8-bit data must be finite"
    )]
    Scale {
        name: String,
        value: NonFinite,
        index: u64,
    },
    #[error(transparent)]
    Quota(#[from] QuotaError),
    /// A host quota that evicting cached models would not satisfy: the quota's refusal, then
    /// what holds the memory.
    #[error("{0}")]
    HostFull(String),
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
    /// Of a quantized tensor: data, padding and scales.
    pub nbytes: u64,
    /// How a quantized tensor's slice is laid out; `None`: held as its dtype says.
    pub quantized: Option<QuantizedLayout>,
    /// Its client's name for the packed format it is part of (uploads only): metadata, not
    /// part of the model's id ([`formats`]).
    pub label: Option<FormatLabel>,
    /// Of a coded tensor ([`coding`]): how, and what it decodes to; `nbytes` are then the
    /// coded bytes the arena holds.
    pub coded: Option<CodedLayout>,
}

/// A quantized tensor's format and where its scales are (see [`StoredLayout`]): its dtype is
/// then the data's (F8_E4M3, or I8), its shape the weight's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizedLayout {
    pub quantization: Quantization,
    /// Of a format the daemon makes: [rows, blocks] ([rows, 1] in the row formats); of a
    /// pre-quantized format: the file's.
    pub scale_shape: Vec<u64>,
    /// The scales' offset from the tensor's own start.
    pub scale_offset: u64,
}

impl QuantizedLayout {
    /// The layout of a weight in a format the daemon makes (its target's).
    pub fn made(layout: &StoredLayout) -> QuantizedLayout {
        QuantizedLayout {
            quantization: layout.block.target.quantization(),
            scale_shape: layout.block.scale_shape().to_vec(),
            scale_offset: layout.scale_offset,
        }
    }
}

impl StoredTensor {
    pub fn quantization(&self) -> Quantization {
        (self.quantized.as_ref()).map_or(Quantization::None, |q| q.quantization)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelSource {
    File,
    Upload,
}

/// Host bytes a model's description takes besides its arena, charged to host quotas with it:
/// per tensor its name, 8 bytes per dimension and 64 for the rest of its entry, and the
/// model's name. (A tensor of zero bytes is not free.)
pub fn metadata_bytes<'a>(name: &str, tensors: impl IntoIterator<Item = (&'a str, usize)>) -> u64 {
    let entries: u64 = tensors
        .into_iter()
        .map(|(name, rank)| name.len() as u64 + 8 * rank as u64 + 64)
        .sum();
    entries + name.len() as u64
}

/// Room a message needs besides the models' descriptions it carries (the answer's other
/// fields, the wrapping of each manifest).
pub const MESSAGE_ENVELOPE: u64 = 1024;

/// The most bytes a model's manifest takes on the wire (protobuf): per tensor its name, at most
/// 10 bytes per dimension (a varint) and 84 for its other fields (dtype, size, scales, weights,
/// framing: 64; a coded tensor's coding, stored size and lanes: 20); the model's name, 256 for the manifest's own fields and
/// [`formats::DAEMON_FORMATS_BYTES`] for the formats the daemon names (its client's labels:
/// `labels`, [`formats::label_description_bytes`]).
pub fn description_bytes<'a>(
    name: &str,
    tensors: impl IntoIterator<Item = (&'a str, usize)>,
    labels: u64,
) -> u64 {
    let entries: u64 = tensors
        .into_iter()
        .map(|(name, rank)| name.len() as u64 + 10 * rank as u64 + 84)
        .sum();
    entries + name.len() as u64 + 256 + formats::DAEMON_FORMATS_BYTES + labels
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
    /// What its description takes ([`metadata_bytes`]).
    pub metadata_bytes: u64,
    /// Of a model loaded from files: what the files looked like from outside (their stat),
    /// which says when a load of them is worth checking against this model's bytes.
    pub file_key: Option<String>,
}

impl Model {
    /// The model's format: the quantization of its quantized tensors, or `None`.
    pub fn quantization(&self) -> Quantization {
        (self.tensors.iter())
            .map(StoredTensor::quantization)
            .find(|q| *q != Quantization::None)
            .unwrap_or_default()
    }
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
        let metadata_bytes =
            metadata_bytes(&name, tensors.iter().map(|t| (&*t.name, t.shape.len())))
                + formats::label_bytes(tensors.iter().map(|t| t.label.as_ref()));
        Model {
            id,
            name,
            source,
            tensors,
            by_name,
            arena: Arc::new(arena),
            total_bytes,
            metadata_bytes,
            file_key: None,
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

    /// Host memory the model holds, as quotas count it: its arena (padding included) and its
    /// description.
    pub fn host_bytes(&self) -> u64 {
        self.arena.size() + self.metadata_bytes
    }
}

/// The store. Its one lock guards the registry and is never held across I/O: loads read and
/// pin without it, and concurrent loads of the same files are deduplicated when they insert.
pub struct Store {
    shm: Arc<Shm>,
    /// Page-locks filled arenas (the backend; the store knows it only as this).
    pinner: Arc<dyn HostPinner>,
    limits: StoreLimits,
    inner: Mutex<Inner>,
    /// Whether the copy-instead-of-pinning fallback for sealed uploads was logged (once).
    warned_pin_fallback: AtomicBool,
}

impl Store {
    pub fn new(shm: Arc<Shm>, pinner: Arc<dyn HostPinner>, limits: StoreLimits) -> Store {
        Store {
            shm,
            pinner,
            limits,
            inner: Mutex::new(Inner::default()),
            warned_pin_fallback: AtomicBool::new(false),
        }
    }

    /// Refuses a model whose description could not be sent in one message (`labels`: what
    /// its tensors' labels add, [`formats::label_description_bytes`]).
    fn check_description<'a>(
        &self,
        name: &str,
        tensors: impl IntoIterator<Item = (&'a str, usize)>,
        labels: u64,
    ) -> Result<(), StoreError> {
        let bytes = description_bytes(name, tensors, labels);
        let limit = self.limits.max_message_bytes;
        if bytes.saturating_add(MESSAGE_ENVELOPE) > limit {
            return Err(StoreError::DescriptionTooLarge { bytes, limit });
        }
        Ok(())
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain maps behind; their content stays usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What clients hold, after the daemon let go of it, of memory charged as `of_uid` says (for
/// `uid`) and as `in_all` says (for every uid), as quotas count it.
pub fn held_by_clients(
    shm: &Shm,
    uid: u32,
    of_uid: impl Fn(Charge) -> bool,
    in_all: impl Fn(Charge) -> bool,
) -> Held {
    let mine = shm.held().usage(uid, of_uid);
    let all = shm.held().usage(uid, in_all);
    Held {
        uid: HeldByClients {
            bytes: mine.uid_bytes,
            pids: mine.uid_pids,
        },
        total: HeldByClients {
            bytes: all.total_bytes,
            pids: all.pids,
        },
    }
}

impl Store {
    /// Host memory clients hold after the store let go of it (uploads, models' arenas).
    fn held_host(&self, uid: u32) -> Held {
        let host = |c| c == Charge::Host;
        held_by_clients(&self.shm, uid, host, host)
    }
}

/// "upload in progress" or "uploads in progress", for `n` of them.
pub(crate) fn uploads_in_progress(n: u64) -> &'static str {
    if n == 1 {
        "upload in progress"
    } else {
        "uploads in progress"
    }
}
