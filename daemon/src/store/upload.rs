//! Uploads: a region the client writes (writable by its uid alone), committed by sealing a copy
//! only the daemon writes, hashed for dedup, then pinned; uncommitted ones go with their
//! connection.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use super::registry::{Pending, Reservation};
use super::safetensors::DType;
use super::{Model, ModelSource, Owner, Store, StoreError, StoredTensor, TENSOR_ALIGN};
use crate::mem::align_up;
use crate::mem::shm::{ShmSegment, Writer};

/// A tensor declared for upload: name, dtype, shape, bytes.
pub type TensorDecl = (String, DType, Vec<u64>, u64);

/// A region being written by its client; it counts against the owner's host quota.
pub(super) struct Upload {
    pub(super) owner: Owner,
    name: String,
    tensors: Vec<StoredTensor>,
    pub(super) segment: ShmSegment,
}

/// Where a fresh upload is to be written.
#[derive(Debug, Clone)]
pub struct UploadTicket {
    pub upload_id: String,
    pub path: PathBuf,
    pub size: u64,
    pub tensors: Vec<StoredTensor>,
}

impl Store {
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

    pub fn upload_count(&self) -> usize {
        self.inner().uploads.len()
    }
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
