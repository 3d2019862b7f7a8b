//! Uploads: a memfd the client writes through its own fd (sealed against resizing from the
//! start), sealed against writes at commit and then, as it is, the model's arena: mapped
//! read-only, hashed for dedup, pinned. Uncommitted ones go with their connection.

use std::sync::Arc;

use super::registry::{Pending, Reservation};
use super::safetensors::DType;
use super::{
    Model, ModelSource, Owner, Store, StoreError, StoredTensor, TENSOR_ALIGN, metadata_bytes,
};
use crate::mem::align_up;
use crate::mem::shm::{Memfd, SealError, ShmSegment};

/// A tensor declared for upload: name, dtype, shape, bytes.
pub type TensorDecl = (String, DType, Vec<u64>, u64);

/// A region being written by its client; it counts against the owner's host quota.
pub(super) struct Upload {
    pub(super) owner: Owner,
    name: String,
    tensors: Vec<StoredTensor>,
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
    /// Creates an upload region for the declared tensors, owned by `owner`'s connection.
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
        let size = align_up(offset, TENSOR_ALIGN);
        let metadata = metadata_bytes(name, placed.iter().map(|t| (&*t.name, t.shape.len())));
        let reserved = self.reserve(owner.uid, size + metadata, true, "upload")?;
        let memfd = self
            .shm
            .create_upload(size)
            .map_err(|source| StoreError::Arena {
                bytes: size,
                source,
            })?;
        let mut inner = self.inner();
        inner.next_upload += 1;
        let upload_id = format!("up-{}", inner.next_upload);
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
    pub fn commit_upload(
        &self,
        owner: Owner,
        upload_id: &str,
    ) -> Result<(Arc<Model>, bool), StoreError> {
        let memfd = self.owned_upload(owner, upload_id)?;
        // Outside the lock: sealing may wait for pages pinned by I/O in flight.
        memfd.seal_writes().map_err(|e| match e {
            SealError::MappedWritable => StoreError::UploadMapped(upload_id.to_string()),
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
        let segment = ShmSegment::sealed(upload.memfd).map_err(|source| StoreError::Seal {
            upload_id: upload_id.to_string(),
            source,
        })?;
        let id = content_identity(&upload.tensors, segment.bytes());
        if let Some(model) = self.add_ref(&id, owner.uid) {
            return Ok((model, true));
        }
        let name = if upload.name.is_empty() {
            id.clone()
        } else {
            upload.name
        };
        let arena = self.pin(segment, &upload.tensors)?;
        let model = Model::new(id, name, ModelSource::Upload, upload.tensors, arena);
        let committed = self.insert_or_ref(Arc::new(model), owner.uid);
        drop(reserved);
        Ok(committed)
    }

    /// The region of `upload_id`, if `owner`'s connection began it.
    fn owned_upload(&self, owner: Owner, upload_id: &str) -> Result<Arc<Memfd>, StoreError> {
        match self.inner().uploads.get(upload_id) {
            None => Err(StoreError::UnknownUpload(upload_id.to_string())),
            Some(u) if u.owner.conn != owner.conn => {
                Err(StoreError::NotOwner(upload_id.to_string()))
            }
            Some(u) => Ok(u.memfd.clone()),
        }
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

/// Same tensors (names, dtypes, shapes, bytes) give the same id.
fn content_identity(tensors: &[StoredTensor], arena: &[u8]) -> String {
    let mut hasher = blake3::Hasher::new();
    for t in tensors {
        hasher.update(format!("{}\0{}\0{:?}\0", t.name, t.dtype, t.shape).as_bytes());
        hasher.update(&arena[t.offset as usize..(t.offset + t.nbytes) as usize]);
    }
    format!("u-{}", &hasher.finalize().to_hex()[..16])
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

    fn u8s(name: &str, n: u64) -> TensorDecl {
        (name.to_string(), DType::U8, vec![n], n)
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
        let ticket = store.begin_upload(ME, "m", vec![u8s("w", 5000)]).unwrap();
        let fd = ticket.memfd.share(Access::ReadWrite).unwrap();
        let client = File::from(fd);
        assert_eq!(
            rustix::fs::ftruncate(&client, 10).unwrap_err(),
            rustix::io::Errno::PERM
        );
        let map = client_map(&client, 8192);
        client.write_all_at(&[3u8; 5000], 0).unwrap();
        let err = store.commit_upload(ME, &ticket.upload_id).unwrap_err();
        assert_eq!(
            err.to_string(),
            "upload_id 'up-1': the upload region is still mapped writable by the client: unmap \
             it before CommitUpload"
        );
        assert_eq!(store.upload_count(), 1, "the upload is left as it was");
        drop(map);
        let (model, existed) = store.commit_upload(ME, &ticket.upload_id).unwrap();
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

    /// A tensor's description costs host memory even when it has no bytes: a hundred empty
    /// tensors with long names are refused by a 64 KiB quota.
    #[test]
    fn descriptions_count_toward_the_host_quota() {
        let store = store_with(HostQuota {
            per_uid_bytes: 64 << 10,
            ..HostQuota::default()
        });
        let tensors: Vec<TensorDecl> = (0..100).map(|i| u8s(&format!("{i:0>1000}"), 0)).collect();
        let err = store.begin_upload(ME, "empty", tensors).unwrap_err();
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
        let ticket = store.begin_upload(ME, "", vec![u8s("e", 0)]).unwrap();
        assert_eq!(ticket.size, 0);
        let (model, _) = store.commit_upload(ME, &ticket.upload_id).unwrap();
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
            store.begin_upload(owner, "", vec![u8s("w", 1)]).unwrap();
        }
        let err = store.begin_upload(ME, "", vec![u8s("w", 1)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "limits.max_uploads = 2 reached: the daemon has 2 uploads in progress"
        );
        assert_eq!(store.drop_uploads_of(1), vec!["up-1".to_string()]);
        store.begin_upload(ME, "", vec![u8s("w", 1)]).unwrap();
    }
}
