//! Pinning: a filled arena is page-locked (through the `HostPinner` the store was given) in
//! chunks of about a gigabyte that end on tensor boundaries, so no copy spans two registrations.
//! A sealed upload is mapped read-only and registered so; where that fails (a driver that will
//! not lock a read-only mapping), its bytes are copied into a segment the daemon writes, and
//! that is pinned instead.

use std::sync::atomic::Ordering;

use super::{Store, StoreError, StoredTensor, TENSOR_ALIGN};
use crate::mem::shm::ShmSegment;
use crate::mem::{HostArena, PinAccess, PinError, PinGuard, align_up};

/// Page-lock chunks are about this large (and never split a tensor).
const PIN_CHUNK: u64 = 1 << 30;

impl Store {
    /// Page-locks a filled arena (CUDA) in chunks that end on tensor boundaries.
    pub(super) fn pin(
        &self,
        segment: ShmSegment,
        tensors: &[StoredTensor],
    ) -> Result<HostArena, StoreError> {
        let in_place = self.pin_in_place(&segment, tensors);
        self.finish_pin(segment, tensors, in_place)
    }

    /// Page-locks `segment` as it is mapped (read-only for a sealed upload); [`Store::finish_pin`]
    /// makes the arena of the result. Split so that a commit pins while it hashes.
    pub(super) fn pin_in_place(
        &self,
        segment: &ShmSegment,
        tensors: &[StoredTensor],
    ) -> Result<Option<PinGuard>, PinError> {
        let access = if segment.is_read_only() {
            PinAccess::ReadOnly
        } else {
            PinAccess::ReadWrite
        };
        self.pin_segment(segment, tensors, access)
    }

    /// The arena of `segment`, pinned as `in_place` says; a read-only segment that could not
    /// be pinned in place is copied into one the daemon writes, and that is pinned.
    pub(super) fn finish_pin(
        &self,
        segment: ShmSegment,
        tensors: &[StoredTensor],
        in_place: Result<Option<PinGuard>, PinError>,
    ) -> Result<HostArena, StoreError> {
        match in_place {
            Ok(pin) => Ok(HostArena::new(segment, pin)),
            Err(why) if segment.is_read_only() => {
                let copy = self.writable_copy(&segment, why)?;
                drop(segment);
                let pin = self.pin_segment(&copy, tensors, PinAccess::ReadWrite)?;
                Ok(HostArena::new(copy, pin))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn pin_segment(
        &self,
        segment: &ShmSegment,
        tensors: &[StoredTensor],
        access: PinAccess,
    ) -> Result<Option<PinGuard>, PinError> {
        let base = segment.bytes().as_ptr() as usize;
        let chunks = pin_chunks(tensors, segment.size())
            .into_iter()
            .map(|(start, len)| (base + start as usize, len as usize))
            .collect::<Vec<_>>();
        let started = std::time::Instant::now();
        let pin = self.pinner.pin_host(&chunks, access)?;
        if pin.is_some() {
            tracing::info!(
                bytes = segment.size(),
                chunks = chunks.len(),
                ?access,
                secs = started.elapsed().as_secs_f64(),
                "host memory page-locked"
            );
        }
        Ok(pin)
    }

    /// A copy of a sealed segment that the daemon writes (so it can be pinned read-write),
    /// after pinning it in place failed for `why`; said at warn once per daemon.
    fn writable_copy(&self, sealed: &ShmSegment, why: PinError) -> Result<ShmSegment, StoreError> {
        if !self.warned_pin_fallback.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                reason = %why,
                "cannot page-lock a sealed upload in place: copying it (and later ones) into \
                 memory the daemon writes, which costs one host copy at commit"
            );
        }
        let bytes = sealed.size();
        let mut copy = (self.shm)
            .create("model", bytes)
            .map_err(|source| StoreError::Arena { bytes, source })?;
        copy.bytes_mut()
            .expect("a new segment is writable")
            .copy_from_slice(sealed.bytes());
        Ok(copy)
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
    use crate::mem::HostPinner;
    use crate::mem::shm::UploadPages;
    use crate::quota::HostQuota;
    use crate::store::safetensors::DType;
    use crate::store::test_support::{load_paths, model_file, store_pinned_by};
    use crate::store::{HostUse, Owner};

    fn t(offset: u64, nbytes: u64) -> StoredTensor {
        StoredTensor {
            name: String::new(),
            dtype: DType::U8,
            shape: vec![nbytes],
            offset,
            nbytes,
            quantized: None,
            label: None,
            coded: None,
        }
    }

    /// One request: the chunks and how.
    type Asked = (Vec<(usize, usize)>, PinAccess);

    /// Records what it is asked to lock; refuses what `refuse` says.
    #[derive(Default)]
    struct Recorder {
        asked: Mutex<Vec<Asked>>,
        refuse: Vec<PinAccess>,
    }

    impl HostPinner for Recorder {
        fn pin_host(
            &self,
            chunks: &[(usize, usize)],
            access: PinAccess,
        ) -> Result<Option<PinGuard>, PinError> {
            self.asked.lock().unwrap().push((chunks.to_vec(), access));
            if self.refuse.contains(&access) {
                let bytes = chunks.iter().map(|c| c.1 as u64).sum();
                return Err(PinError {
                    bytes,
                    reason: format!("no ({access:?})"),
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
        let store = store_pinned_by(HostQuota::default(), pinner.clone());
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let (model, _) = load_paths(&store, &[path], 1).unwrap();
        let base = model.arena().bytes().as_ptr() as usize;
        let asked = pinner.asked.lock().unwrap().clone();
        assert_eq!(asked, vec![(vec![(base, 8192)], PinAccess::ReadWrite)]);
    }

    #[test]
    fn a_failed_pin_fails_the_load_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let pinner = Arc::new(Recorder {
            refuse: vec![PinAccess::ReadWrite],
            ..Recorder::default()
        });
        let store = store_pinned_by(HostQuota::default(), pinner);
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let err = load_paths(&store, &[path], 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pinning 8192 bytes of host memory failed: no (ReadWrite)"
        );
        assert!(store.models().is_empty());
        assert_eq!(store.host_use(1), HostUse::default());
        assert_eq!(store.shm.total(), 0, "the arena is gone");
    }

    /// A sealed upload is pinned in place, read-only; where that is refused, its bytes are
    /// copied into a segment the daemon writes and that is pinned; where that fails too, the
    /// commit fails and leaves nothing.
    #[test]
    fn a_sealed_upload_that_cannot_be_pinned_read_only_is_copied_and_pinned() {
        let me = Owner { conn: 1, uid: 7 };
        let upload = |store: &Store| {
            let decl = crate::store::TensorDecl::plain("w", DType::U8, vec![100], 100);
            let ticket = store
                .begin_upload(me, "up-1".into(), "m", vec![decl], UploadPages::Reserved)
                .unwrap();
            let fd = ticket
                .memfd
                .share(crate::mem::shm::Access::ReadWrite)
                .unwrap();
            std::os::unix::fs::FileExt::write_all_at(&std::fs::File::from(fd), &[5; 100], 0)
                .unwrap();
            let committed =
                store.commit_upload(me, &ticket.upload_id, crate::store::Retention::Cached);
            (ticket, committed)
        };
        let in_place = Arc::new(Recorder::default());
        let store = store_pinned_by(HostQuota::default(), in_place.clone());
        let (ticket, committed) = upload(&store);
        let model = committed.unwrap().model;
        assert!(Arc::ptr_eq(model.arena().segment().memfd(), &ticket.memfd));
        assert_eq!(in_place.asked.lock().unwrap()[0].1, PinAccess::ReadOnly);

        let refuses_read_only = Arc::new(Recorder {
            refuse: vec![PinAccess::ReadOnly],
            ..Recorder::default()
        });
        let store = store_pinned_by(HostQuota::default(), refuses_read_only.clone());
        let (ticket, committed) = upload(&store);
        let model = committed.unwrap().model;
        let accesses: Vec<PinAccess> = (refuses_read_only.asked.lock().unwrap().iter())
            .map(|(_, a)| *a)
            .collect();
        assert_eq!(accesses, vec![PinAccess::ReadOnly, PinAccess::ReadWrite]);
        assert!(!Arc::ptr_eq(model.arena().segment().memfd(), &ticket.memfd));
        assert!(!model.arena().segment().is_read_only());
        assert_eq!(model.slice(0).bytes(), &[5u8; 100][..]);
        drop(ticket);
        assert_eq!(
            (store.shm.live("model"), store.shm.live("upload")),
            (1, 0),
            "the sealed upload went once copied"
        );
        assert!(store.warned_pin_fallback.load(Ordering::Relaxed));

        let refuses_all = Arc::new(Recorder {
            refuse: vec![PinAccess::ReadOnly, PinAccess::ReadWrite],
            ..Recorder::default()
        });
        let store = store_pinned_by(HostQuota::default(), refuses_all);
        let (ticket, committed) = upload(&store);
        assert_eq!(
            committed.unwrap_err().to_string(),
            "pinning 4096 bytes of host memory failed: no (ReadWrite)"
        );
        drop(ticket);
        assert_eq!((store.models().len(), store.upload_count()), (0, 0));
        assert_eq!(store.shm.total(), 0);
        assert_eq!(store.host_use(7), HostUse::default());
    }
}
