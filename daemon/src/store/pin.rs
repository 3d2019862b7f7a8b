//! Pinning: a filled arena is page-locked (through the `HostPinner` the store was given) in
//! chunks of about a gigabyte that end on tensor boundaries, so no copy spans two registrations.

use super::{Store, StoreError, StoredTensor, TENSOR_ALIGN};
use crate::mem::shm::ShmSegment;
use crate::mem::{HostArena, align_up};

/// Page-lock chunks are about this large (and never split a tensor).
const PIN_CHUNK: u64 = 1 << 30;

impl Store {
    /// Page-locks a filled arena (CUDA) in chunks that end on tensor boundaries.
    pub(super) fn pin(
        &self,
        segment: ShmSegment,
        tensors: &[StoredTensor],
    ) -> Result<HostArena, StoreError> {
        let base = segment.bytes().as_ptr() as usize;
        let chunks = pin_chunks(tensors, segment.size())
            .into_iter()
            .map(|(start, len)| (base + start as usize, len as usize))
            .collect::<Vec<_>>();
        let started = std::time::Instant::now();
        let pin = self.pinner.pin_host(&chunks)?;
        if pin.is_some() {
            tracing::info!(
                bytes = segment.size(),
                chunks = chunks.len(),
                secs = started.elapsed().as_secs_f64(),
                "host memory page-locked"
            );
        }
        Ok(HostArena::new(segment, pin))
    }
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::mem::{HostPinner, PinError, PinGuard};
    use crate::quota::HostQuota;
    use crate::store::safetensors::DType;
    use crate::store::test_support::{model_file, store_pinned_by};

    fn t(offset: u64, nbytes: u64) -> StoredTensor {
        StoredTensor {
            name: String::new(),
            dtype: DType::U8,
            shape: vec![nbytes],
            offset,
            nbytes,
        }
    }

    /// Records what it is asked to lock; fails every request when `fail` is set.
    #[derive(Default)]
    struct Recorder {
        asked: Mutex<Vec<Vec<(usize, usize)>>>,
        fail: bool,
    }

    impl HostPinner for Recorder {
        fn pin_host(&self, chunks: &[(usize, usize)]) -> Result<Option<PinGuard>, PinError> {
            self.asked.lock().unwrap().push(chunks.to_vec());
            if self.fail {
                let bytes = chunks.iter().map(|c| c.1 as u64).sum();
                return Err(PinError {
                    bytes,
                    reason: "no".into(),
                });
            }
            Ok(Some(Box::new(())))
        }
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

    #[test]
    fn the_pinner_is_asked_for_the_arena_by_address() {
        let dir = tempfile::tempdir().unwrap();
        let pinner = Arc::new(Recorder::default());
        let store = store_pinned_by(dir.path(), HostQuota::default(), pinner.clone());
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let (model, _) = store.load(&[path], "", 1, &mut |_, _, _| {}).unwrap();
        let base = model.arena().bytes().as_ptr() as usize;
        assert_eq!(*pinner.asked.lock().unwrap(), vec![vec![(base, 8192)]]);
    }

    #[test]
    fn a_failed_pin_fails_the_load_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let pinner = Arc::new(Recorder {
            fail: true,
            ..Recorder::default()
        });
        let store = store_pinned_by(dir.path(), HostQuota::default(), pinner);
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let err = store.load(&[path], "", 1, &mut |_, _, _| {}).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pinning 8192 bytes of host memory failed: no"
        );
        assert!(store.models().is_empty());
        assert_eq!(store.host_use(1), crate::store::HostUse::default());
        assert!(store.shm.list().is_empty(), "the arena is unlinked");
    }
}
