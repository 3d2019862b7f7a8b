//! The host weight store: immutable, named models whose tensors live in shared-memory arenas.
//!
//! Sources are safetensors files the daemon reads itself, or uploads that a client writes into a
//! region the daemon hands it. Identical sources dedupe (same file identity, or same content
//! digest) and are reference counted, so one host copy serves every job on the box.
// Only `shm` maps memory (memmap2's map is unsafe); the rest of the store is safe code.
#![deny(unsafe_code)]

pub mod safetensors;
pub mod shm;
mod sources;

use std::collections::HashMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use self::safetensors::{DType, HeaderError, TensorEntry};
use self::shm::{ShmDir, ShmSegment, Writer};
pub use self::sources::{SourceError, resolve_sources};
use crate::backend::{Backend, BackendError, PinGuard};
use crate::quota::{HostQuota, QuotaError, check_count};

/// Alignment of each tensor in an arena: a page, so that the arena can be page-locked in
/// chunks that end on tensor boundaries (a copy never spans two registrations).
pub const TENSOR_ALIGN: u64 = 4096;
/// Page-lock chunks are about this large (and never split a tensor).
const PIN_CHUNK: u64 = 1 << 30;
/// Load progress is reported at least this often (in bytes).
const PROGRESS_STEP: u64 = 64 << 20;

pub fn align_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

/// A tensor declared for upload: name, dtype, shape, bytes.
pub type TensorDecl = (String, DType, Vec<u64>, u64);

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
    Pin(#[from] BackendError),
}

/// A shared-memory arena holding one model's tensors; written once, then read-only.
pub struct HostArena {
    /// Declared before `segment`: the memory is unlocked before it is unmapped.
    _pin: Option<PinGuard>,
    segment: ShmSegment,
}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena")
            .field("segment", &self.segment)
            .field("pinned", &self._pin.is_some())
            .finish()
    }
}

impl HostArena {
    pub fn bytes(&self) -> &[u8] {
        self.segment.bytes()
    }

    pub fn path(&self) -> &Path {
        self.segment.path()
    }
}

/// A range of a host arena, kept alive by its `Arc`.
#[derive(Debug, Clone)]
pub struct HostSlice {
    arena: Arc<HostArena>,
    offset: u64,
    len: u64,
}

impl HostSlice {
    pub fn bytes(&self) -> &[u8] {
        &self.arena.bytes()[self.offset as usize..(self.offset + self.len) as usize]
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
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
        HostSlice {
            arena: Arc::clone(&self.arena),
            offset: t.offset,
            len: t.nbytes,
        }
    }

    pub fn arena(&self) -> &Arc<HostArena> {
        &self.arena
    }

    /// Host memory the model holds: its arena, padding included.
    pub fn host_bytes(&self) -> u64 {
        self.arena.segment.size()
    }
}

/// A model as listed: the model and its reference counts.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    pub model: Arc<Model>,
    pub refs: u32,
    pub sessions: u32,
    /// Load references per uid, in the order the uids took their first one.
    pub holders: Vec<(u32, u32)>,
    /// The uid whose host quota the model counts against: the first loader, then (once it has
    /// released its last reference) the next holder. A copy shared by many uids counts once.
    pub charged_uid: u32,
}

struct Upload {
    owner: Owner,
    name: String,
    tensors: Vec<StoredTensor>,
    segment: ShmSegment,
}

/// Where a fresh upload is to be written.
#[derive(Debug, Clone)]
pub struct UploadTicket {
    pub upload_id: String,
    pub path: PathBuf,
    pub size: u64,
    pub tensors: Vec<StoredTensor>,
}

/// Host bytes promised to a load or upload that is being made: counted like the real thing so
/// that two requests at once cannot both pass a quota.
struct Pending {
    uid: u32,
    bytes: u64,
    upload: bool,
}

#[derive(Default)]
struct Inner {
    models: HashMap<String, ModelEntry>,
    uploads: HashMap<String, Upload>,
    next_upload: u64,
    pending: HashMap<u64, Pending>,
    next_pending: u64,
}

/// Host use as quotas count it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostUse {
    /// Bytes charged to the uid: models it is charged for, its uploads.
    pub uid_bytes: u64,
    pub uid_uploads: u32,
    /// Bytes of every model and upload.
    pub total_bytes: u64,
}

impl Inner {
    fn host_use(&self, uid: u32) -> HostUse {
        let mut u = HostUse::default();
        for e in self.models.values() {
            let b = e.model.host_bytes();
            u.total_bytes += b;
            if e.charged_uid == uid {
                u.uid_bytes += b;
            }
        }
        for up in self.uploads.values() {
            let b = up.segment.size();
            u.total_bytes += b;
            if up.owner.uid == uid {
                u.uid_bytes += b;
                u.uid_uploads += 1;
            }
        }
        for p in self.pending.values() {
            u.total_bytes += p.bytes;
            if p.uid == uid {
                u.uid_bytes += p.bytes;
                u.uid_uploads += u32::from(p.upload);
            }
        }
        u
    }

    fn add_pending(&mut self, pending: Pending) -> u64 {
        self.next_pending += 1;
        self.pending.insert(self.next_pending, pending);
        self.next_pending
    }
}

/// A `Pending` entry, removed on drop (the model or upload it stood for now counts itself, or
/// was never made).
struct Reservation<'a> {
    store: &'a Store,
    id: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.store.inner().pending.remove(&self.id);
    }
}

pub struct Store {
    shm: Arc<ShmDir>,
    backend: Arc<dyn Backend>,
    limits: StoreLimits,
    inner: Mutex<Inner>,
    /// Loads run one at a time, so two loads of the same files make one copy.
    load_lock: Mutex<()>,
}

/// Load progress as (bytes done, bytes total, current file).
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64, &Path);

impl Store {
    pub fn new(shm: Arc<ShmDir>, backend: Arc<dyn Backend>, limits: StoreLimits) -> Store {
        Store {
            shm,
            backend,
            limits,
            inner: Mutex::new(Inner::default()),
            load_lock: Mutex::new(()),
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain maps behind; their content stays usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Loads safetensors sources (blocking; run it off the async runtime). Returns the model and
    /// whether it was already in the store.
    pub fn load(
        &self,
        paths: &[PathBuf],
        name: &str,
        uid: u32,
        progress: Progress<'_>,
    ) -> Result<(Arc<Model>, bool), StoreError> {
        let files = resolve_sources(paths)?;
        let _serial = self.load_lock.lock().unwrap_or_else(|p| p.into_inner());
        let id = file_identity(&files)?;
        if let Some(model) = self.add_ref(&id, uid) {
            let total = model.total_bytes;
            progress(total, total, files.last().map_or(Path::new(""), |p| p));
            return Ok((model, true));
        }
        let plan = self.plan_load(&files)?;
        let total: u64 = plan.iter().map(|(_, e, _)| e.nbytes).sum();
        let arena_len = align_up(
            plan.last().map_or(0, |(_, e, off)| off + e.nbytes),
            TENSOR_ALIGN,
        );
        let reserved = self.reserve(uid, arena_len, false, "model")?;
        let mut segment = self
            .shm
            .create("model", arena_len, Writer::Daemon)
            .map_err(|source| StoreError::Arena {
                bytes: arena_len,
                source,
            })?;
        copy_tensors(&plan, &mut segment, total, progress)?;
        let tensors: Vec<StoredTensor> = plan
            .into_iter()
            .map(|(_, e, offset)| StoredTensor {
                name: e.name,
                dtype: e.dtype,
                shape: e.shape,
                offset,
                nbytes: e.nbytes,
            })
            .collect();
        let name = if name.is_empty() {
            default_name(&files)
        } else {
            name.to_string()
        };
        progress(total, total, Path::new("page-locking host memory"));
        let arena = self.pin(segment, &tensors)?;
        let model = Arc::new(Model::new(
            id.clone(),
            name,
            ModelSource::File,
            tensors,
            arena,
        ));
        self.insert(model.clone(), uid);
        drop(reserved);
        Ok((model, false))
    }

    /// Reads every header, rejects duplicates and places each tensor in the future arena.
    fn plan_load(&self, files: &[PathBuf]) -> Result<Vec<(PathBuf, TensorEntry, u64)>, StoreError> {
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        let mut plan = Vec::new();
        let mut offset = 0u64;
        for path in files {
            let io = |source| StoreError::Io {
                path: path.clone(),
                source,
            };
            let mut file = std::fs::File::open(path).map_err(io)?;
            let len = file.metadata().map_err(io)?.len();
            let header =
                safetensors::read_header(&mut file, len).map_err(|source| StoreError::Header {
                    path: path.clone(),
                    source,
                })?;
            let count = (seen.len() + header.tensors.len()) as u64;
            if count > u64::from(self.limits.max_tensors) {
                return Err(StoreError::TooManyTensors {
                    count,
                    limit: self.limits.max_tensors,
                });
            }
            for entry in header.tensors {
                if let Some(first) = seen.insert(entry.name.clone(), path.clone()) {
                    return Err(StoreError::DuplicateTensor {
                        name: entry.name,
                        first,
                        second: path.clone(),
                    });
                }
                offset = align_up(offset, TENSOR_ALIGN);
                let at = offset;
                offset += entry.nbytes;
                plan.push((path.clone(), entry, at));
            }
        }
        Ok(plan)
    }

    /// Promises `bytes` of host memory to `uid`, or says which quota that would pass.
    fn reserve(
        &self,
        uid: u32,
        bytes: u64,
        upload: bool,
        item: &'static str,
    ) -> Result<Reservation<'_>, StoreError> {
        let quota = &self.limits.host;
        let mut inner = self.inner();
        let used = inner.host_use(uid);
        if upload {
            check_count(
                "per_uid_uploads",
                quota.per_uid_uploads,
                uid,
                used.uid_uploads,
                ("upload in progress", "uploads in progress"),
            )?;
        }
        quota.check(uid, used.uid_bytes, used.total_bytes, bytes, item)?;
        let id = inner.add_pending(Pending { uid, bytes, upload });
        Ok(Reservation { store: self, id })
    }

    /// Host use as the quotas see it, for `uid` and in total.
    pub fn host_use(&self, uid: u32) -> HostUse {
        self.inner().host_use(uid)
    }

    /// Creates an upload region for the declared tensors, owned by `owner`'s connection and
    /// writable by its uid alone.
    pub fn begin_upload(
        &self,
        owner: Owner,
        name: &str,
        tensors: Vec<TensorDecl>,
    ) -> Result<UploadTicket, StoreError> {
        if tensors.len() as u64 > u64::from(self.limits.max_tensors) {
            return Err(StoreError::TooManyTensors {
                count: tensors.len() as u64,
                limit: self.limits.max_tensors,
            });
        }
        let mut offset = 0u64;
        let mut placed = Vec::with_capacity(tensors.len());
        for (name, dtype, shape, nbytes) in tensors {
            offset = align_up(offset, TENSOR_ALIGN);
            placed.push(StoredTensor {
                name,
                dtype,
                shape,
                offset,
                nbytes,
            });
            offset = offset.saturating_add(nbytes);
        }
        if offset > self.limits.max_upload_bytes {
            return Err(StoreError::UploadTooLarge {
                bytes: offset,
                limit: self.limits.max_upload_bytes,
            });
        }
        let offset = align_up(offset, TENSOR_ALIGN);
        let reserved = self.reserve(owner.uid, offset, true, "upload")?;
        let segment = self
            .shm
            .create("upload", offset, Writer::Peer(owner.uid))
            .map_err(|source| StoreError::Arena {
                bytes: offset,
                source,
            })?;
        let mut inner = self.inner();
        inner.next_upload += 1;
        let upload_id = format!("up-{}", inner.next_upload);
        let ticket = UploadTicket {
            upload_id: upload_id.clone(),
            path: segment.path().to_path_buf(),
            size: offset,
            tensors: placed.clone(),
        };
        inner.uploads.insert(
            upload_id,
            Upload {
                owner,
                name: name.to_string(),
                tensors: placed,
                segment,
            },
        );
        // The upload counts itself from now on (dropped after the lock: its drop locks).
        drop(inner);
        drop(reserved);
        Ok(ticket)
    }

    /// Turns a filled upload into a model, or into one more reference to an identical one.
    pub fn commit_upload(
        &self,
        owner: Owner,
        upload_id: &str,
    ) -> Result<(Arc<Model>, bool), StoreError> {
        let (upload, reserved) = {
            let mut inner = self.inner();
            match inner.uploads.get(upload_id) {
                None => return Err(StoreError::UnknownUpload(upload_id.to_string())),
                Some(u) if u.owner.conn != owner.conn => {
                    return Err(StoreError::NotOwner(upload_id.to_string()));
                }
                Some(_) => {
                    let upload = inner.uploads.remove(upload_id).expect("present");
                    // Its bytes stay charged while it is sealed (the sealed copy, briefly a
                    // second one, is not counted again).
                    let id = inner.add_pending(Pending {
                        uid: owner.uid,
                        bytes: upload.segment.size(),
                        upload: false,
                    });
                    (upload, Reservation { store: self, id })
                }
            }
        };
        // The client can still write or truncate its upload file: copy the bytes into a
        // segment only the daemon writes, with positioned reads (a truncated file is an error
        // here, never a SIGBUS), and hash that copy.
        let segment = self.seal_upload(&upload)?;
        let id = content_identity(&upload.tensors, segment.bytes());
        let _serial = self.load_lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(model) = self.add_ref(&id, owner.uid) {
            return Ok((model, true));
        }
        let name = if upload.name.is_empty() {
            id.clone()
        } else {
            upload.name
        };
        let arena = self.pin(segment, &upload.tensors)?;
        let model = Arc::new(Model::new(
            id,
            name,
            ModelSource::Upload,
            upload.tensors,
            arena,
        ));
        self.insert(model.clone(), owner.uid);
        drop(reserved);
        Ok((model, false))
    }

    fn seal_upload(&self, upload: &Upload) -> Result<ShmSegment, StoreError> {
        let path = upload.segment.path();
        let io = |source| StoreError::Io {
            path: path.to_path_buf(),
            source,
        };
        let expected = upload.segment.size();
        let file = std::fs::File::open(path).map_err(io)?;
        let truncated = |actual| StoreError::UploadTruncated {
            path: path.to_path_buf(),
            expected,
            actual,
        };
        let actual = file.metadata().map_err(io)?.len();
        if actual < expected {
            return Err(truncated(actual));
        }
        let mut segment = self
            .shm
            .create("model", expected, Writer::Daemon)
            .map_err(|source| StoreError::Arena {
                bytes: expected,
                source,
            })?;
        let bytes = segment.bytes_mut();
        for t in &upload.tensors {
            let dst = &mut bytes[t.offset as usize..(t.offset + t.nbytes) as usize];
            file.read_exact_at(dst, t.offset)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => {
                        truncated(file.metadata().map_or(0, |m| m.len()))
                    }
                    _ => io(e),
                })?;
        }
        Ok(segment)
    }

    /// Drops the uploads a closed connection left uncommitted.
    pub fn drop_uploads_of(&self, owner: u64) -> usize {
        let mut inner = self.inner();
        let before = inner.uploads.len();
        inner.uploads.retain(|_, u| u.owner.conn != owner);
        before - inner.uploads.len()
    }

    /// Page-locks a filled arena (CUDA) in chunks that end on tensor boundaries.
    fn pin(&self, segment: ShmSegment, tensors: &[StoredTensor]) -> Result<HostArena, StoreError> {
        let base = segment.bytes().as_ptr() as usize;
        let chunks = pin_chunks(tensors, segment.size())
            .into_iter()
            .map(|(start, len)| (base + start as usize, len as usize))
            .collect::<Vec<_>>();
        let started = std::time::Instant::now();
        let pin = self.backend.pin_host(&chunks)?;
        if pin.is_some() {
            tracing::info!(
                bytes = segment.size(),
                chunks = chunks.len(),
                secs = started.elapsed().as_secs_f64(),
                "host memory page-locked"
            );
        }
        Ok(HostArena { _pin: pin, segment })
    }

    /// One more reference for `uid` to a model already in the store (not charged again).
    fn add_ref(&self, id: &str, uid: u32) -> Option<Arc<Model>> {
        let mut inner = self.inner();
        let entry = inner.models.get_mut(id)?;
        entry.refs += 1;
        match entry.holders.iter_mut().find(|(u, _)| *u == uid) {
            Some((_, n)) => *n += 1,
            None => entry.holders.push((uid, 1)),
        }
        Some(entry.model.clone())
    }

    fn insert(&self, model: Arc<Model>, uid: u32) {
        let entry = ModelEntry {
            model: model.clone(),
            refs: 1,
            sessions: 0,
            holders: vec![(uid, 1)],
            charged_uid: uid,
        };
        self.inner().models.insert(model.id.clone(), entry);
    }

    /// Drops one of `uid`'s load references; returns the references left (all uids').
    pub fn release(&self, id: &str, uid: u32) -> Result<u32, StoreError> {
        let mut inner = self.inner();
        let entry = inner
            .models
            .get_mut(id)
            .ok_or_else(|| StoreError::UnknownModel(id.to_string()))?;
        if entry.refs == 0 {
            return Err(StoreError::UnknownModel(id.to_string()));
        }
        let Some(at) = entry.holders.iter().position(|(u, _)| *u == uid) else {
            return Err(StoreError::NotHolder {
                id: id.to_string(),
                uid,
            });
        };
        entry.refs -= 1;
        entry.holders[at].1 -= 1;
        if entry.holders[at].1 == 0 {
            entry.holders.remove(at);
            // The charge follows the references: a uid that let go is not billed for a copy
            // that others keep. With none left the model goes once its sessions end, and the
            // charge stays where it was until then.
            if entry.charged_uid == uid
                && let Some(&(next, _)) = entry.holders.first()
            {
                entry.charged_uid = next;
                tracing::info!(model = %id, from = uid, to = next, "host quota charge moved");
            }
        }
        let left = entry.refs;
        Self::collect(&mut inner, id);
        Ok(left)
    }

    /// A session starts using the model; it stays in the store until the session ends.
    pub fn open_session(&self, id: &str) -> Result<Arc<Model>, StoreError> {
        let mut inner = self.inner();
        match inner.models.get_mut(id) {
            Some(entry) if entry.refs > 0 => {
                entry.sessions += 1;
                Ok(entry.model.clone())
            }
            _ => Err(StoreError::UnknownModel(id.to_string())),
        }
    }

    pub fn close_session(&self, id: &str) {
        let mut inner = self.inner();
        if let Some(entry) = inner.models.get_mut(id) {
            entry.sessions = entry.sessions.saturating_sub(1);
        }
        Self::collect(&mut inner, id);
    }

    fn collect(inner: &mut Inner, id: &str) {
        if inner
            .models
            .get(id)
            .is_some_and(|e| e.refs == 0 && e.sessions == 0)
        {
            inner.models.remove(id);
        }
    }

    pub fn models(&self) -> Vec<ModelEntry> {
        let mut list: Vec<ModelEntry> = self.inner().models.values().cloned().collect();
        list.sort_by(|a, b| a.model.id.cmp(&b.model.id));
        list
    }

    pub fn get(&self, id: &str) -> Option<ModelEntry> {
        self.inner().models.get(id).cloned()
    }

    /// Host bytes held by models and pending uploads.
    pub fn bytes(&self) -> u64 {
        let inner = self.inner();
        let models: u64 = inner.models.values().map(|e| e.model.total_bytes).sum();
        let uploads: u64 = inner.uploads.values().map(|u| u.segment.size()).sum();
        models + uploads
    }

    /// Drops every model and upload (at shutdown, once no session is left).
    pub fn clear(&self) {
        let mut inner = self.inner();
        inner.models.clear();
        inner.uploads.clear();
    }

    pub fn upload_count(&self) -> usize {
        self.inner().uploads.len()
    }
}

/// Copies each tensor from its file into the arena with positioned reads: unlike a mapping of
/// the source, a file truncated under us is an error here, not a SIGBUS.
fn copy_tensors(
    plan: &[(PathBuf, TensorEntry, u64)],
    segment: &mut ShmSegment,
    total: u64,
    progress: Progress<'_>,
) -> Result<(), StoreError> {
    let mut done = 0u64;
    let mut reported = 0u64;
    let mut open: Option<(PathBuf, std::fs::File)> = None;
    let arena = segment.bytes_mut();
    for (path, entry, offset) in plan {
        if open.as_ref().is_none_or(|(p, _)| p != path) {
            let file = std::fs::File::open(path).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
            open = Some((path.clone(), file));
        }
        let (_, file) = open.as_ref().expect("opened above");
        let mut at = 0u64;
        while at < entry.nbytes {
            let n = (entry.nbytes - at).min(PROGRESS_STEP);
            let dst = &mut arena[(offset + at) as usize..(offset + at + n) as usize];
            file.read_exact_at(dst, entry.file_offset + at)
                .map_err(|source| StoreError::Io {
                    path: path.clone(),
                    source,
                })?;
            at += n;
            done += n;
            if done - reported >= PROGRESS_STEP {
                reported = done;
                progress(done, total, path);
            }
        }
    }
    if let Some((path, _)) = &open {
        progress(done, total, path);
    }
    Ok(())
}

/// Ranges of about PIN_CHUNK bytes that start on a tensor and end on a page (tensors are
/// page-aligned), covering every tensor; `len` bounds the last.
fn pin_chunks(tensors: &[StoredTensor], len: u64) -> Vec<(u64, u64)> {
    let mut sorted: Vec<(u64, u64)> = tensors.iter().map(|t| (t.offset, t.nbytes)).collect();
    sorted.sort_unstable();
    let mut chunks: Vec<(u64, u64)> = Vec::new();
    for (offset, nbytes) in sorted {
        let end = align_up(offset + nbytes, TENSOR_ALIGN).min(len);
        match chunks.last_mut() {
            Some((start, clen)) if end - *start <= PIN_CHUNK && offset <= *start + *clen => {
                *clen = (*clen).max(end - *start);
            }
            _ if end > offset => chunks.push((offset, end - offset)),
            _ => {}
        }
    }
    chunks
}

/// Same files (device, inode, size, mtime) give the same id.
fn file_identity(files: &[PathBuf]) -> Result<String, StoreError> {
    let mut hasher = blake3::Hasher::new();
    for path in files {
        let meta = std::fs::metadata(path).map_err(|source| StoreError::Io {
            path: path.clone(),
            source,
        })?;
        let key = format!(
            "{}:{}:{}:{}.{}\n",
            meta.dev(),
            meta.ino(),
            meta.len(),
            meta.mtime(),
            meta.mtime_nsec()
        );
        hasher.update(key.as_bytes());
    }
    Ok(format!("m-{}", &hasher.finalize().to_hex()[..16]))
}

/// Same tensors (names, dtypes, shapes, bytes) give the same id.
fn content_identity(tensors: &[StoredTensor], arena: &[u8]) -> String {
    let mut hasher = blake3::Hasher::new();
    for t in tensors {
        hasher.update(format!("{}\0{}\0{:?}\0", t.name, t.dtype, t.shape).as_bytes());
        hasher.update(&arena[t.offset as usize..(t.offset + t.nbytes) as usize]);
    }
    format!("u-{}", &hasher.finalize().to_hex()[..16])
}

fn default_name(files: &[PathBuf]) -> String {
    let first = files.first().map(PathBuf::as_path).unwrap_or(Path::new(""));
    let base = if files.len() > 1 {
        first.parent().unwrap_or(first)
    } else {
        first
    };
    base.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(offset: u64, nbytes: u64) -> StoredTensor {
        StoredTensor {
            name: String::new(),
            dtype: DType::U8,
            shape: vec![nbytes],
            offset,
            nbytes,
        }
    }

    fn store_in(dir: &Path, host: HostQuota) -> Store {
        let shm = Arc::new(ShmDir::new(dir, "t"));
        let backend = Arc::new(crate::backend::host::HostBackend::new(shm.clone()));
        let limits = StoreLimits {
            max_tensors: 100,
            max_upload_bytes: 1 << 30,
            max_name_bytes: 1024,
            host,
        };
        Store::new(shm, backend, limits)
    }

    fn model_file(dir: &Path, name: &str, bytes: usize) -> PathBuf {
        let data = vec![7u8; bytes];
        let view =
            ::safetensors::tensor::TensorView::new(::safetensors::Dtype::U8, vec![bytes], &data)
                .unwrap();
        let path = dir.join(name);
        ::safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
        path
    }

    /// Model references belong to uids: only a holder releases, and the host charge follows
    /// the references (one copy, charged once, to the first holder still holding one).
    #[test]
    fn references_belong_to_uids_and_the_host_charge_follows_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path(), HostQuota::default());
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let (model, _) = store
            .load(std::slice::from_ref(&path), "", 1, &mut |_, _, _| {})
            .unwrap();
        let (same, existed) = store.load(&[path], "", 2, &mut |_, _, _| {}).unwrap();
        assert!(existed && Arc::ptr_eq(&model, &same));
        let usage = |uid| store.host_use(uid);
        assert_eq!((usage(1).uid_bytes, usage(2).uid_bytes), (8192, 0));
        assert_eq!(usage(2).total_bytes, 8192);
        let err = store.release(&model.id, 3).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "uid 3 holds no reference to model_id '{}': only a uid that loaded or uploaded \
                 it may release it",
                model.id
            )
        );
        assert_eq!(store.release(&model.id, 1).unwrap(), 1);
        assert_eq!((usage(1).uid_bytes, usage(2).uid_bytes), (0, 8192));
        assert!(matches!(
            store.release(&model.id, 1),
            Err(StoreError::NotHolder { uid: 1, .. })
        ));
        assert_eq!(store.release(&model.id, 2).unwrap(), 0);
        assert_eq!(usage(2), HostUse::default());
    }

    #[test]
    fn a_refused_load_makes_nothing_and_charges_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let quota = HostQuota {
            per_uid_bytes: 12288,
            ..HostQuota::default()
        };
        let store = store_in(dir.path(), quota);
        let a = model_file(dir.path(), "a.safetensors", 8192);
        let b = model_file(dir.path(), "b.safetensors", 8192);
        store.load(&[a], "", 1, &mut |_, _, _| {}).unwrap();
        let err = store
            .load(std::slice::from_ref(&b), "", 1, &mut |_, _, _| {})
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "quotas.per_uid_host_bytes = 12288 exceeded: uid 1 holds 8192 host bytes and this \
             model needs 8192 more"
        );
        assert_eq!(store.host_use(1).total_bytes, 8192, "no reservation left");
        // Another uid has its own quota.
        store.load(&[b], "", 2, &mut |_, _, _| {}).unwrap();
        assert_eq!(store.host_use(2).uid_bytes, 8192);
    }

    #[test]
    fn pin_chunks_cover_every_tensor_and_never_split_one() {
        let g = 1u64 << 30;
        let mb = 1u64 << 20;
        let tensors = [
            t(0, 100),
            t(4096, 600 * mb),
            t(4096 + 600 * mb, 600 * mb),
            t(2 * g, 0),
        ];
        let len = align_up(4096 + 1200 * mb, 4096);
        let chunks = pin_chunks(&tensors, len);
        assert_eq!(
            chunks,
            vec![(0, 4096 + 600 * mb), (4096 + 600 * mb, 600 * mb)]
        );
        let big = [t(0, 3 * g)];
        assert_eq!(pin_chunks(&big, 3 * g), vec![(0, 3 * g)]);
    }
}
