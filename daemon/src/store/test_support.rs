//! Stores and model files for the store's unit tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Store, StoreLimits};
use crate::mem::shm::ShmDir;
use crate::mem::{HostPinner, PinError, PinGuard};
use crate::quota::HostQuota;

/// What the host backend does: nothing to lock.
pub struct NoPin;

impl HostPinner for NoPin {
    fn pin_host(&self, _chunks: &[(usize, usize)]) -> Result<Option<PinGuard>, PinError> {
        Ok(None)
    }
}

/// A store in `dir` with these host quotas that pins through `pinner`.
pub fn store_pinned_by(dir: &Path, host: HostQuota, pinner: Arc<dyn HostPinner>) -> Store {
    let shm = Arc::new(ShmDir::new(dir, "t"));
    let limits = StoreLimits {
        max_tensors: 100,
        max_upload_bytes: 1 << 30,
        max_name_bytes: 1024,
        host,
    };
    Store::new(shm, pinner, limits)
}

pub fn store_in(dir: &Path, host: HostQuota) -> Store {
    store_pinned_by(dir, host, Arc::new(NoPin))
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
