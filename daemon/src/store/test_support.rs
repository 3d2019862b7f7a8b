//! Stores and model files for the store's (and the session layer's) unit tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::quantize::Quantization;
use super::{LoadSource, Model, Owner, Retention, Selection, Store, StoreError, StoreLimits};
use crate::mem::shm::Shm;
use crate::mem::{HostPinner, PinAccess, PinError, PinGuard};
use crate::quota::HostQuota;

/// What the host backend does: nothing to lock.
pub struct NoPin;

impl HostPinner for NoPin {
    fn pin_host(
        &self,
        _chunks: &[(usize, usize)],
        _access: PinAccess,
    ) -> Result<Option<PinGuard>, PinError> {
        Ok(None)
    }
}

pub fn limits(host: HostQuota) -> StoreLimits {
    StoreLimits {
        max_tensors: 100,
        max_upload_bytes: 1 << 30,
        max_name_bytes: 1024,
        max_message_bytes: 16 << 20,
        max_uploads: 1024,
        max_state_regions: 4,
        host,
    }
}

/// A store with these host quotas that pins through `pinner`.
pub fn store_pinned_by(host: HostQuota, pinner: Arc<dyn HostPinner>) -> Store {
    Store::new(Shm::new(), pinner, limits(host))
}

pub fn store_with(host: HostQuota) -> Store {
    store_pinned_by(host, Arc::new(NoPin))
}

/// The files at `paths`, opened as a client would pass them (display name: the path).
pub fn sources(paths: &[PathBuf]) -> Vec<LoadSource> {
    paths
        .iter()
        .map(|p| LoadSource {
            name: p.display().to_string(),
            file: std::fs::File::open(p).unwrap(),
        })
        .collect()
}

/// A cached reference for `uid`, taken by a connection of its own (numbered as the uid).
pub fn me(uid: u32) -> (Owner, Retention) {
    let owner = Owner {
        conn: uid.into(),
        uid,
    };
    (owner, Retention::Cached)
}

/// Loads the files at `paths` for `uid` ([`me`]).
pub fn load_paths(
    store: &Store,
    paths: &[PathBuf],
    uid: u32,
) -> Result<(Arc<Model>, bool), StoreError> {
    let stored = store.load(
        &sources(paths),
        "",
        Quantization::None,
        &Selection::All,
        me(uid),
        &mut |_, _, _| {},
    )?;
    Ok((stored.model, stored.existed))
}

/// A safetensors file holding one u8 tensor `w` of `bytes` bytes.
pub fn model_file(dir: &Path, name: &str, bytes: usize) -> PathBuf {
    let data = vec![7u8; bytes];
    let view = ::safetensors::tensor::TensorView::new(::safetensors::Dtype::U8, vec![bytes], &data)
        .unwrap();
    let path = dir.join(name);
    ::safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
    path
}
