//! A session's counters: written by its actor, read by ListSessions and metrics meanwhile.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one session, readable while the actor runs.
#[derive(Debug, Default)]
pub struct SessionStats {
    pub acquires: AtomicU64,
    pub hits: AtomicU64,
    pub reuses: AtomicU64,
    pub misses: AtomicU64,
    pub resident_hits: AtomicU64,
    pub bytes_copied: AtomicU64,
    pub copies: AtomicU64,
    pub prefetches: AtomicU64,
    pub stall_ns: AtomicU64,
    pub resyncs: AtomicU64,
    pub releases: AtomicU64,
    pub evictions: AtomicU64,
}

/// The counters at one instant, as plain numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub acquires: u64,
    pub hits: u64,
    pub reuses: u64,
    pub misses: u64,
    pub resident_hits: u64,
    pub bytes_copied: u64,
    pub copies: u64,
    pub prefetches: u64,
    pub stall_ns: u64,
    pub resyncs: u64,
    pub releases: u64,
    pub evictions: u64,
}

impl SessionStats {
    pub fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            acquires: get(&self.acquires),
            hits: get(&self.hits),
            reuses: get(&self.reuses),
            misses: get(&self.misses),
            resident_hits: get(&self.resident_hits),
            bytes_copied: get(&self.bytes_copied),
            copies: get(&self.copies),
            prefetches: get(&self.prefetches),
            stall_ns: get(&self.stall_ns),
            resyncs: get(&self.resyncs),
            releases: get(&self.releases),
            evictions: get(&self.evictions),
        }
    }
}
