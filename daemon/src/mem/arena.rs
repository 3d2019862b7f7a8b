//! Host arenas (one model's tensors in a shared-memory segment, page-locked while it lives) and
//! the slices of them that copies read from.

use std::sync::Arc;

use super::pin::PinGuard;
use super::shm::ShmSegment;

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
    /// A filled segment, and what keeps it page-locked (if anything does).
    pub fn new(segment: ShmSegment, pin: Option<PinGuard>) -> HostArena {
        HostArena { _pin: pin, segment }
    }

    pub fn bytes(&self) -> &[u8] {
        self.segment.bytes()
    }

    /// Whether something keeps it page-locked (not on the host backend).
    pub fn is_pinned(&self) -> bool {
        self._pin.is_some()
    }

    pub fn segment(&self) -> &ShmSegment {
        &self.segment
    }

    /// Bytes of the segment, padding included.
    pub fn size(&self) -> u64 {
        self.segment.size()
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
    pub fn new(arena: Arc<HostArena>, offset: u64, len: u64) -> HostSlice {
        debug_assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= arena.size())
        );
        HostSlice { arena, offset, len }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.arena.bytes()[self.offset as usize..(self.offset + self.len) as usize]
    }

    /// The arena this slice keeps alive.
    pub fn arena(&self) -> &Arc<HostArena> {
        &self.arena
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes of this slice from `offset` (a paced copy sends a tensor in pieces).
    pub fn slice(&self, offset: u64, len: u64) -> HostSlice {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "{offset}+{len} outside a {}-byte slice",
            self.len
        );
        HostSlice::new(self.arena.clone(), self.offset + offset, len)
    }
}

/// A slice over all of `data`, copied into a fresh segment of `shm` and page-locked by `pinner`
/// (for the backends' tests, which need a source without a store above them).
#[cfg(test)]
pub fn filled_for_tests(
    shm: &Arc<super::shm::Shm>,
    data: &[u8],
    pinner: &dyn super::HostPinner,
) -> HostSlice {
    let size = super::align_up(data.len() as u64, 4096);
    let mut segment = shm.create("test", size).unwrap();
    segment.bytes_mut().unwrap()[..data.len()].copy_from_slice(data);
    let base = segment.bytes().as_ptr() as usize;
    let pin = pinner
        .pin_host(&[(base, size as usize)], super::PinAccess::ReadWrite)
        .unwrap();
    HostSlice::new(Arc::new(HostArena::new(segment, pin)), 0, data.len() as u64)
}
