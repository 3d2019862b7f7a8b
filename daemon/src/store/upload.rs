//! Uploads: a memfd the client writes through its own fd (sealed against resizing from the
//! start, its pages reserved by the daemon), sealed against writes at commit and then, as it
//! is, the model's arena: mapped read-only, hashed for dedup (on several threads) while it is
//! pinned. Uncommitted ones go with their connection.
//!
//! The region cannot be page-locked before the commit, by the daemon or anyone: sealing it
//! against writes waits for, then refuses, pages that are still pinned (the kernel cannot tell
//! a daemon's pin from a client's DMA registration that would write on after the seal). The
//! client pins what it writes a window at a time and unpins it before the commit.
//!
//! Tensors declared for quantization at commit are written as declared; the commit quantizes
//! them into a new arena (the upload's memfd is then dropped: only the quantized copy stays).
//! Pre-quantized tensors are written in the store's layout, and their scales checked.

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Instant;

use super::coding::{Coding, coded_id};
use super::formats::{FormatLabel, label_bytes, label_description_bytes};
use super::phases::{Phases, Stored};
use super::quantize::{
    Quantization, StoredLayout, TensorIn, TensorOut, first_non_finite_scale, quantize_all_into,
};
use super::reserve::{Pending, Reservation};
use super::safetensors::DType;
use super::{
    Model, ModelSource, Owner, QuantizedLayout, Retention, Store, StoreError, StoredTensor,
    TENSOR_ALIGN, metadata_bytes,
};
use crate::mem::shm::{Memfd, SealError, ShmSegment, UploadPages};
use crate::mem::{align_up, parallel};

/// A tensor declared for upload: name, dtype, shape, the bytes the client writes, whether it
/// is quantized, and its client's label for the packed format it is part of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDecl {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    pub quant: DeclQuant,
    pub label: Option<FormatLabel>,
}

/// How an uploaded tensor is quantized (layouts checked by the edge).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeclQuant {
    None,
    /// Written as its (float) dtype; quantized at commit into this layout.
    AtCommit(StoredLayout),
    /// Written as data, padding and scales in this layout (its dtype is the data's: F8_E4M3,
    /// or I8 for torchao_int8_rowwise).
    Prequantized(QuantizedLayout),
}

impl TensorDecl {
    /// A tensor held as it is written.
    pub fn plain(name: &str, dtype: DType, shape: Vec<u64>, nbytes: u64) -> TensorDecl {
        TensorDecl {
            name: name.to_string(),
            dtype,
            shape,
            nbytes,
            quant: DeclQuant::None,
            label: None,
        }
    }
}

/// A region being written by its client; it counts against the owner's host quota.
pub(super) struct Upload {
    pub(super) owner: Owner,
    name: String,
    /// Where each tensor is written in the region.
    tensors: Vec<StoredTensor>,
    /// Which of them the commit quantizes (same order).
    at_commit: Vec<Option<StoredLayout>>,
    pub(super) memfd: Arc<Memfd>,
    /// Its description's bytes ([`metadata_bytes`]), charged with the region.
    pub(super) metadata: u64,
}

impl Upload {
    /// Host bytes it is charged: the region and its description.
    pub(super) fn host_bytes(&self) -> u64 {
        self.memfd.size() + self.metadata
    }
}

/// A fresh upload: where each tensor goes, and the region the client writes.
#[derive(Debug, Clone)]
pub struct UploadTicket {
    pub upload_id: String,
    /// The region; its uploader gets it read-write through the handoff socket.
    pub memfd: Arc<Memfd>,
    pub size: u64,
    pub tensors: Vec<StoredTensor>,
}

impl Store {
    /// Creates an upload region for the declared tensors, owned by `owner`'s connection, under
    /// `upload_id` (chosen by the caller: random, so that another uid cannot guess it); `pages`
    /// says who faults its pages in.
    pub fn begin_upload(
        &self,
        owner: Owner,
        upload_id: String,
        name: &str,
        tensors: Vec<TensorDecl>,
        pages: UploadPages,
    ) -> Result<UploadTicket, StoreError> {
        if tensors.len() as u64 > u64::from(self.limits.max_tensors) {
            return Err(StoreError::TooManyTensors {
                count: tensors.len() as u64,
                limit: self.limits.max_tensors,
            });
        }
        let mut offset = 0u64;
        let mut placed = Vec::with_capacity(tensors.len());
        let mut at_commit = Vec::with_capacity(tensors.len());
        for t in tensors {
            offset = align_up(offset, TENSOR_ALIGN);
            let (quantized, later) = match t.quant {
                DeclQuant::None => (None, None),
                DeclQuant::AtCommit(layout) => (None, Some(layout)),
                DeclQuant::Prequantized(layout) => (Some(layout), None),
            };
            placed.push(StoredTensor {
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                offset,
                nbytes: t.nbytes,
                quantized,
                label: t.label,
                coded: None,
            });
            at_commit.push(later);
            offset = offset.saturating_add(t.nbytes);
        }
        if offset > self.limits.max_upload_bytes {
            return Err(StoreError::UploadTooLarge {
                bytes: offset,
                limit: self.limits.max_upload_bytes,
            });
        }
        let size = align_up(offset, TENSOR_ALIGN);
        let described = || placed.iter().map(|t| (&*t.name, t.shape.len()));
        let labels = || placed.iter().map(|t| t.label.as_ref());
        self.check_description(name, described(), label_description_bytes(labels()))?;
        let metadata = metadata_bytes(name, described()) + label_bytes(labels());
        let reserved = self.reserve(owner.uid, size + metadata, true, "upload")?;
        let memfd = self
            .shm
            .create_upload(size, pages)
            .map_err(|source| StoreError::Arena {
                bytes: size,
                source,
            })?;
        let mut inner = self.inner();
        let ticket = UploadTicket {
            upload_id: upload_id.clone(),
            memfd: memfd.clone(),
            size,
            tensors: placed.clone(),
        };
        inner.uploads.insert(
            upload_id,
            Upload {
                owner,
                name: name.to_string(),
                tensors: placed,
                at_commit,
                memfd,
                metadata,
            },
        );
        // The upload counts itself from now on (dropped after the lock: its drop locks).
        drop(inner);
        drop(reserved);
        Ok(ticket)
    }

    /// Turns a filled upload into a model, or into one more reference to an identical one.
    /// Refused, with the upload left as it was, while its client still maps it writable.
    /// Returns the model, whether it was already in the store, and where the time went:
    /// sealing, quantizing, hashing and page-locking (the last two at once).
    pub fn commit_upload(
        &self,
        owner: Owner,
        upload_id: &str,
        retention: Retention,
    ) -> Result<Stored, StoreError> {
        self.commit_upload_coded(owner, upload_id, retention, Coding::None)
    }

    /// [`Store::commit_upload`], the model then coded as `coding` says ([`super::coding`]):
    /// hashed before it is coded (a model stored already is not coded again), then coded into
    /// a new arena, which is pinned.
    pub fn commit_upload_coded(
        &self,
        owner: Owner,
        upload_id: &str,
        retention: Retention,
        coding: Coding,
    ) -> Result<Stored, StoreError> {
        let started = Instant::now();
        let mut phases = Phases::default();
        let memfd = self.owned_upload(owner, upload_id)?;
        // Outside the lock: sealing may wait for pages pinned by I/O in flight.
        phases
            .time(|p| &mut p.seal, || memfd.seal_writes())
            .map_err(|e| match e {
                SealError::MappedWritable => StoreError::UploadMapped(upload_id.to_string()),
                SealError::SealsClosed => StoreError::UploadSealsClosed(upload_id.to_string()),
                SealError::Io(source) => StoreError::Seal {
                    upload_id: upload_id.to_string(),
                    source,
                },
            })?;
        let (upload, reserved) = {
            let mut inner = self.inner();
            // Gone meanwhile: its connection closed, or a concurrent commit took it.
            let upload = (inner.uploads.remove(upload_id))
                .ok_or_else(|| StoreError::UnknownUpload(upload_id.to_string()))?;
            // Its bytes stay charged until the model (the same memory) counts itself.
            let id = inner.add_pending(Pending {
                uid: owner.uid,
                bytes: upload.host_bytes(),
                upload: false,
            });
            (upload, Reservation { store: self, id })
        };
        let segment = phases
            .time(|p| &mut p.seal, || ShmSegment::sealed(upload.memfd))
            .map_err(|source| StoreError::Seal {
                upload_id: upload_id.to_string(),
                source,
            })?;
        phases.input_bytes = upload.tensors.iter().map(|t| t.nbytes).sum();
        check_scales(&upload.tensors, segment.bytes())?;
        // Quantized at commit: a new arena (charged within the upload's bytes, but for what it
        // needs beyond them), and the upload's region dropped.
        let (segment, tensors, _extra) = if upload.at_commit.iter().any(Option::is_some) {
            let (tensors, size) = quantized_placement(&upload.tensors, &upload.at_commit);
            let extra = size.saturating_sub(segment.size());
            let extra = self.reserve(owner.uid, extra, false, "quantized upload")?;
            let arena = phases.time(
                |p| &mut p.quantize,
                || {
                    self.quantize_upload(
                        &segment,
                        &upload.tensors,
                        &upload.at_commit,
                        &tensors,
                        size,
                    )
                },
            )?;
            (arena, tensors, Some(extra))
        } else {
            (segment, upload.tensors, None)
        };
        let (id, segment, tensors, in_place) = if coding == Coding::None {
            // Hashed while it is pinned: a new model (the rule) waits for the longer of the
            // two rather than both; a duplicate (the exception) drops a pin it did not need.
            let (id, in_place) = std::thread::scope(|scope| {
                let pinning = scope.spawn(|| {
                    let started = Instant::now();
                    (self.pin_in_place(&segment, &tensors), started.elapsed())
                });
                let id = phases.time(
                    |p| &mut p.hash,
                    || content_identity(&tensors, segment.bytes()),
                );
                let (in_place, took) = pinning.join().expect("pinning does not panic");
                phases.pin += took;
                (id, in_place)
            });
            (id, segment, tensors, in_place)
        } else {
            let content = phases.time(
                |p| &mut p.hash,
                || content_identity(&tensors, segment.bytes()),
            );
            let id = coded_id(&content, coding);
            if let Some(model) = self.add_ref(&id, owner, retention) {
                phases.total = started.elapsed();
                return Ok(Stored {
                    model,
                    existed: true,
                    phases,
                });
            }
            let (segment, tensors) = phases.time(
                |p| &mut p.code,
                || self.code(owner.uid, segment, tensors, coding),
            )?;
            let pinning = Instant::now();
            let in_place = self.pin_in_place(&segment, &tensors);
            phases.pin += pinning.elapsed();
            (id, segment, tensors, in_place)
        };
        if let Some(model) = self.add_ref(&id, owner, retention) {
            phases.nothing_pinned_unless(matches!(in_place, Ok(Some(_))));
            drop(in_place); // unlocked before the segment is unmapped
            phases.total = started.elapsed();
            return Ok(Stored {
                model,
                existed: true,
                phases,
            });
        }
        let name = if upload.name.is_empty() {
            id.clone()
        } else {
            upload.name
        };
        let arena = phases.time(
            |p| &mut p.pin,
            || self.finish_pin(segment, &tensors, in_place),
        )?;
        phases.nothing_pinned_unless(arena.is_pinned());
        let model = Model::new(id, name, ModelSource::Upload, tensors, arena);
        let (model, existed) = self.insert_or_ref(Arc::new(model), owner, retention);
        drop(reserved);
        phases.total = started.elapsed();
        Ok(Stored {
            model,
            existed,
            phases,
        })
    }

    /// The region of `upload_id`, if `owner`'s connection began it. Another uid's upload is
    /// unknown to `owner`, exactly as one that does not exist: its id tells nothing.
    fn owned_upload(&self, owner: Owner, upload_id: &str) -> Result<Arc<Memfd>, StoreError> {
        let inner = self.inner();
        let upload = owned(inner.uploads.get(upload_id), owner, upload_id)?;
        Ok(upload.memfd.clone())
    }

    /// Drops `owner`'s upload `upload_id`, which its client will not commit (AbortUpload):
    /// its bytes are uncharged once the store lets go of its region, save what a client still
    /// maps or holds an fd of (`mem::held`). Owned as for [`commit_upload`](Self::commit_upload):
    /// another uid's is unknown, another connection's is refused; an upload already dropped,
    /// aborted or committed is unknown.
    pub fn abort_upload(&self, owner: Owner, upload_id: &str) -> Result<(), StoreError> {
        let mut inner = self.inner();
        owned(inner.uploads.get(upload_id), owner, upload_id)?;
        let aborted = inner.uploads.remove(upload_id);
        // Outside the lock: a memfd's drop may start watching what its client still holds.
        drop(inner);
        drop(aborted);
        Ok(())
    }

    /// Drops the uploads a closed connection left uncommitted; returns their ids.
    pub fn drop_uploads_of(&self, owner: u64) -> Vec<String> {
        let mut inner = self.inner();
        let dropped: Vec<String> = (inner.uploads.iter())
            .filter(|(_, u)| u.owner.conn == owner)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &dropped {
            inner.uploads.remove(id);
        }
        dropped
    }

    pub fn upload_count(&self) -> usize {
        self.inner().uploads.len()
    }
}

impl Store {
    /// A new arena holding the upload's tensors at `placed`: the plain ones copied, the others
    /// quantized on every core.
    fn quantize_upload(
        &self,
        sealed: &ShmSegment,
        written: &[StoredTensor],
        at_commit: &[Option<StoredLayout>],
        placed: &[StoredTensor],
        size: u64,
    ) -> Result<ShmSegment, StoreError> {
        let mut segment = (self.shm)
            .create("model", size)
            .map_err(|source| StoreError::Arena {
                bytes: size,
                source,
            })?;
        let arena = segment.bytes_mut().expect("a new segment is writable");
        let src = sealed.bytes();
        let mut rest: &mut [u8] = arena;
        let mut consumed = 0usize;
        let mut work = Vec::new();
        for ((w, layout), p) in written.iter().zip(at_commit).zip(placed) {
            let input = &src[w.offset as usize..(w.offset + w.nbytes) as usize];
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(p.offset as usize - consumed);
            let (slice, tail) = tail.split_at_mut(p.nbytes as usize);
            rest = tail;
            consumed = (p.offset + p.nbytes) as usize;
            match layout {
                None => slice.copy_from_slice(input),
                Some(layout) => {
                    let (data, _pad, scales) = layout.split_mut(slice);
                    let tensor = TensorIn {
                        target: layout.block.target,
                        name: &w.name,
                        dtype: w.dtype,
                        shape: &w.shape,
                        bytes: input,
                    };
                    work.push((tensor, TensorOut { data, scales }));
                }
            }
        }
        let threads = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
        quantize_all_into(work, threads)?;
        Ok(segment)
    }
}

/// `upload` (the one under `upload_id`, if any), if `owner`'s connection began it. Another
/// uid's upload is unknown to `owner`, exactly as one that does not exist: its id tells
/// nothing; another connection of the same uid is refused.
fn owned<'a>(
    upload: Option<&'a Upload>,
    owner: Owner,
    upload_id: &str,
) -> Result<&'a Upload, StoreError> {
    match upload {
        Some(u) if u.owner.uid != owner.uid => {
            Err(StoreError::UnknownUpload(upload_id.to_string()))
        }
        None => Err(StoreError::UnknownUpload(upload_id.to_string())),
        Some(u) if u.owner.conn != owner.conn => Err(StoreError::NotOwner(upload_id.to_string())),
        Some(u) => Ok(u),
    }
}

/// Where the tensors go once those of `at_commit` are quantized, and the arena's size.
fn quantized_placement(
    written: &[StoredTensor],
    at_commit: &[Option<StoredLayout>],
) -> (Vec<StoredTensor>, u64) {
    let mut offset = 0u64;
    let placed = (written.iter().zip(at_commit))
        .map(|(t, layout)| {
            offset = align_up(offset, TENSOR_ALIGN);
            let mut placed = t.clone();
            placed.offset = offset;
            if let Some(layout) = layout {
                placed.dtype = layout.block.target.data_dtype();
                placed.nbytes = layout.nbytes;
                placed.quantized = Some(QuantizedLayout::made(layout));
            }
            offset += placed.nbytes;
            placed
        })
        .collect();
    (placed, align_up(offset, TENSOR_ALIGN))
}

/// Pre-quantized tensors' scales are finite (a NaN scale would make every weight of its block
/// NaN on the device).
fn check_scales(tensors: &[StoredTensor], arena: &[u8]) -> Result<(), StoreError> {
    for t in tensors {
        let Some(q) = &t.quantized else { continue };
        let scales = &arena[(t.offset + q.scale_offset) as usize..(t.offset + t.nbytes) as usize];
        if let Some((index, value)) = first_non_finite_scale(scales) {
            return Err(StoreError::Scale {
                name: t.name.clone(),
                value,
                index,
            });
        }
    }
    Ok(())
}

/// Bytes of a tensor hashed as one piece, on one thread.
const HASH_PIECE: u64 = 64 << 20;
/// Threads that hash at most (one hashes a few GB/s; memory bandwidth is the limit beyond).
const HASHERS: usize = 16;

/// Same tensors (names, dtypes, shapes, formats, bytes) give the same id: a weight quantized
/// at commit and the same weight uploaded pre-quantized are one model. The id hashes each
/// tensor's description and the digests of its bytes in pieces of [`HASH_PIECE`], which are
/// hashed on several threads.
fn content_identity(tensors: &[StoredTensor], arena: &[u8]) -> String {
    let mut pieces: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let (mut at, end) = (t.offset, t.offset + t.nbytes);
        while at < end {
            let n = (end - at).min(HASH_PIECE);
            pieces.push((i, at as usize..(at + n) as usize));
            at += n;
        }
    }
    let mut digests = vec![[0u8; 32]; pieces.len()];
    let work: Vec<(usize, std::ops::Range<usize>)> = (pieces.iter().enumerate())
        .map(|(k, (_, range))| (k, range.clone()))
        .collect();
    let threads = parallel::threads_for(work.len(), HASHERS);
    let hashed = parallel::for_each(
        work,
        threads,
        |(k, range)| Ok::<_, Infallible>((k, *blake3::hash(&arena[range]).as_bytes())),
        |(k, digest)| digests[k] = digest,
    );
    match hashed {
        Ok(()) => {}
        Err(never) => match never {},
    }
    let mut hasher = blake3::Hasher::new();
    let mut next = 0;
    for (i, t) in tensors.iter().enumerate() {
        hasher.update(format!("{}\0{}\0{:?}\0", t.name, t.dtype, t.shape).as_bytes());
        if t.quantization() != Quantization::None {
            hasher.update(format!("{}\0", t.quantization()).as_bytes());
        }
        while next < pieces.len() && pieces[next].0 == i {
            hasher.update(&digests[next]);
            next += 1;
        }
    }
    format!("u-{}", &hasher.finalize().to_hex()[..32])
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::mem::shm::Access;
    use crate::quota::HostQuota;
    use crate::store::StoreLimits;
    use crate::store::test_support::{NoPin, limits, store_with};

    const ME: Owner = Owner { conn: 1, uid: 7 };

    /// `begin_upload` with the region's pages reserved by the daemon (a client without
    /// `client_reserves`).
    fn begin(
        store: &Store,
        owner: Owner,
        upload_id: impl Into<String>,
        name: &str,
        tensors: Vec<TensorDecl>,
    ) -> Result<UploadTicket, StoreError> {
        store.begin_upload(
            owner,
            upload_id.into(),
            name,
            tensors,
            UploadPages::Reserved,
        )
    }

    fn u8s(name: &str, n: u64) -> TensorDecl {
        TensorDecl::plain(name, DType::U8, vec![n], n)
    }

    /// A writable shared mapping, as a client makes one.
    fn client_map(file: &File, len: usize) -> memmap2::MmapRaw {
        memmap2::MmapOptions::new().len(len).map_raw(file).unwrap()
    }

    /// The uploader can never resize its region, cannot commit while it maps it writable (the
    /// upload stays, untouched), and cannot write it once committed: the sealed memfd is the
    /// model's arena as it is, no copy.
    #[test]
    fn an_upload_is_sealed_by_the_daemon_and_becomes_the_arena() {
        let store = store_with(HostQuota::default());
        let ticket = begin(&store, ME, "up-1", "m", vec![u8s("w", 5000)]).unwrap();
        let fd = ticket.memfd.share(Access::ReadWrite).unwrap();
        let client = File::from(fd);
        assert_eq!(
            rustix::fs::ftruncate(&client, 10).unwrap_err(),
            rustix::io::Errno::PERM
        );
        let map = client_map(&client, 8192);
        client.write_all_at(&[3u8; 5000], 0).unwrap();
        let err = store
            .commit_upload(ME, &ticket.upload_id, Retention::Cached)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "upload_id 'up-1': the upload region is still mapped writable by the client: unmap \
             it before CommitUpload"
        );
        assert_eq!(store.upload_count(), 1, "the upload is left as it was");
        drop(map);
        let Stored { model, existed, .. } = store
            .commit_upload(ME, &ticket.upload_id, Retention::Cached)
            .unwrap();
        assert!(!existed);
        assert_eq!(
            client.write_at(b"x", 0).unwrap_err().raw_os_error(),
            Some(1)
        );
        assert!(Arc::ptr_eq(model.arena().segment().memfd(), &ticket.memfd));
        assert!(model.arena().segment().is_read_only());
        assert_eq!(model.slice(0).bytes(), &[3u8; 5000][..]);
        assert_eq!((store.upload_count(), store.shm.total()), (0, 1));
        let charged = 8192 + metadata_bytes("m", [("w", 1)]);
        assert_eq!(store.host_use(7).uid_bytes, charged, "charged once");
    }

    /// An aborted upload is gone at once, its bytes uncharged; only its connection may abort
    /// it (another uid is told it does not exist), and only once; it can no longer be committed.
    #[test]
    fn an_aborted_upload_is_uncharged_and_gone() {
        let store = store_with(HostQuota::default());
        let ticket = begin(&store, ME, "up-1", "m", vec![u8s("w", 5000)]).unwrap();
        drop(ticket);
        let charged = 8192 + metadata_bytes("m", [("w", 1)]);
        assert_eq!(store.host_use(7).uid_bytes, charged);
        let other_conn = Owner { conn: 2, uid: 7 };
        let other_uid = Owner { conn: 1, uid: 8 };
        let refused = |owner| store.abort_upload(owner, "up-1").unwrap_err().to_string();
        assert_eq!(
            refused(other_conn),
            "upload_id 'up-1' belongs to another connection"
        );
        assert_eq!(refused(other_uid), "unknown upload_id 'up-1'");
        assert_eq!(store.upload_count(), 1, "a refused abort leaves the upload");
        store.abort_upload(ME, "up-1").unwrap();
        assert_eq!((store.upload_count(), store.shm.total()), (0, 0));
        assert_eq!(store.host_use(7).uid_bytes, 0);
        assert_eq!(refused(ME), "unknown upload_id 'up-1'");
        let err = store
            .commit_upload(ME, "up-1", Retention::Cached)
            .unwrap_err();
        assert_eq!(err.to_string(), "unknown upload_id 'up-1'");
    }

    /// A tensor's description costs host memory even when it has no bytes: a hundred empty
    /// tensors with long names are refused by a 64 KiB quota.
    #[test]
    fn descriptions_count_toward_the_host_quota() {
        let store = store_with(HostQuota {
            per_uid_bytes: 64 << 10,
            ..HostQuota::default()
        });
        let tensors: Vec<TensorDecl> = (0..100).map(|i| u8s(&format!("{i:0>1000}"), 0)).collect();
        let err = begin(&store, ME, "up-1", "empty", tensors).unwrap_err();
        assert_eq!(
            err.to_string(),
            "quotas.per_uid_host_bytes = 65536 exceeded: uid 7 holds 0 host bytes and this \
             upload needs 107205 more"
        );
        assert_eq!((store.upload_count(), store.shm.total()), (0, 0));
    }

    /// Tensors of no bytes make an empty region: nothing to map, reserve or pin, and it commits.
    #[test]
    fn an_upload_of_empty_tensors_commits() {
        let store = store_with(HostQuota::default());
        let ticket = begin(&store, ME, "up-1", "", vec![u8s("e", 0)]).unwrap();
        assert_eq!(ticket.size, 0);
        let model = store
            .commit_upload(ME, &ticket.upload_id, Retention::Cached)
            .unwrap()
            .model;
        assert_eq!((model.total_bytes, model.slice(0).bytes()), (0, &[][..]));
    }

    #[test]
    fn uploads_in_progress_are_bounded_for_the_whole_daemon() {
        let store = Store::new(
            crate::mem::shm::Shm::new(),
            Arc::new(NoPin),
            StoreLimits {
                max_uploads: 2,
                ..limits(HostQuota::default())
            },
        );
        for uid in [1, 2] {
            let owner = Owner {
                conn: uid.into(),
                uid,
            };
            begin(&store, owner, format!("up-{uid}"), "", vec![u8s("w", 1)]).unwrap();
        }
        let err = begin(&store, ME, "up-3", "", vec![u8s("w", 1)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "limits.max_uploads = 2 reached: the daemon has 2 uploads in progress"
        );
        assert_eq!(store.drop_uploads_of(1), vec!["up-1".to_string()]);
        begin(&store, ME, "up-4", "", vec![u8s("w", 1)]).unwrap();
    }

    /// The id covers every byte of every piece a tensor is hashed in, in order, and each
    /// tensor's description: a byte changed in a later piece, two pieces swapped, or another
    /// name give another id; the same content gives the same id.
    #[test]
    fn the_content_id_covers_every_piece_in_order() {
        let piece = HASH_PIECE as usize;
        let mut arena: Vec<u8> = (0..2 * piece + 4096).map(|i| (i % 251) as u8).collect();
        arena[..piece].fill(1);
        arena[piece..2 * piece].fill(2);
        let t = |name: &str| StoredTensor {
            name: name.into(),
            dtype: DType::U8,
            shape: vec![arena.len() as u64],
            offset: 0,
            nbytes: arena.len() as u64,
            quantized: None,
            label: None,
            coded: None,
        };
        let id = content_identity(&[t("w")], &arena);
        assert_eq!(id, content_identity(&[t("w")], &arena.clone()));
        assert_ne!(id, content_identity(&[t("v")], &arena));
        let mut changed = arena.clone();
        changed[2 * piece + 10] ^= 1;
        assert_ne!(id, content_identity(&[t("w")], &changed));
        let mut swapped = arena.clone();
        swapped[..piece].fill(2);
        swapped[piece..2 * piece].fill(1);
        assert_ne!(id, content_identity(&[t("w")], &swapped));
    }

    /// Labels are metadata: the same bytes uploaded with another label (or none) are the same
    /// model, which keeps the labels of the upload that stored it; the host charge counts them.
    #[test]
    fn uploads_that_differ_only_in_labels_are_one_model() {
        let store = store_with(HostQuota::default());
        let label = |name: &str| {
            Some(FormatLabel {
                name: name.into(),
                weights: 64,
            })
        };
        let upload = |label: Option<FormatLabel>| {
            let w = TensorDecl {
                label,
                ..u8s("w", 32)
            };
            let ticket = begin(&store, ME, "up-1", "m", vec![w]).unwrap();
            let client = File::from(ticket.memfd.share(Access::ReadWrite).unwrap());
            client.write_all_at(&[5u8; 32], 0).unwrap();
            let stored = store.commit_upload(ME, "up-1", Retention::Cached).unwrap();
            (stored.model, stored.existed)
        };
        let (first, existed) = upload(label("aitk.uint4"));
        assert!(!existed);
        for other in [label("aitk.uint2"), None] {
            let (again, existed) = upload(other);
            assert!(existed && Arc::ptr_eq(&again, &first));
            assert_eq!(again.tensors[0].label, label("aitk.uint4"));
        }
        let described = metadata_bytes("m", [("w", 1)]) + "aitk.uint4".len() as u64 + 16;
        assert_eq!(first.metadata_bytes, described);
    }

    /// A commit says where its time went: the bytes the client wrote, and sealing and hashing
    /// within the whole (the host backend pins nothing).
    #[test]
    fn a_commit_is_timed() {
        let store = store_with(HostQuota::default());
        let ticket = begin(&store, ME, "up-1", "m", vec![u8s("w", 5000)]).unwrap();
        let client = File::from(ticket.memfd.share(Access::ReadWrite).unwrap());
        client.write_all_at(&[3u8; 5000], 0).unwrap();
        let stored = store
            .commit_upload(ME, &ticket.upload_id, Retention::Cached)
            .unwrap();
        let p = stored.phases;
        assert!(!stored.existed);
        assert_eq!(p.input_bytes, 5000);
        assert!(!p.seal.is_zero() && !p.hash.is_zero(), "{p:?}");
        assert!(p.total >= p.seal + p.hash, "{p:?}");
        assert!(p.read.is_zero() && p.quantize.is_zero(), "{p:?}");
    }
}
