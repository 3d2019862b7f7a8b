//! A session's counters: written by its actor, read by ListSessions and metrics meanwhile.

use std::sync::atomic::{AtomicU64, Ordering};

use super::stall::Stall;

/// Counters of one session, readable while the actor runs.
#[derive(Debug)]
pub struct SessionStats {
    pub acquires: AtomicU64,
    pub hits: AtomicU64,
    pub reuses: AtomicU64,
    pub misses: AtomicU64,
    pub resident_hits: AtomicU64,
    pub bytes_copied: AtomicU64,
    pub copies: AtomicU64,
    pub prefetches: AtomicU64,
    /// Wall-clock time with at least one acquire waiting for its Staged (see `stall`).
    pub stall_ns: AtomicU64,
    pub resyncs: AtomicU64,
    pub releases: AtomicU64,
    pub evictions: AtomicU64,
    /// Plan entries the actor has looked at (cursor moves, look-ahead), a measure of the work
    /// per message that must not grow with the plan's length (see `plan.rs`).
    pub plan_entries_visited: AtomicU64,
    /// `stall_ns` split by group (index = group id); the parts sum to `stall_ns`.
    group_stall_ns: Box<[AtomicU64]>,
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
    /// Counters, all zero, for a session of `groups` groups.
    pub fn new(groups: usize) -> SessionStats {
        let zero = AtomicU64::default;
        SessionStats {
            acquires: zero(),
            hits: zero(),
            reuses: zero(),
            misses: zero(),
            resident_hits: zero(),
            bytes_copied: zero(),
            copies: zero(),
            prefetches: zero(),
            stall_ns: zero(),
            resyncs: zero(),
            releases: zero(),
            evictions: zero(),
            plan_entries_visited: zero(),
            group_stall_ns: (0..groups).map(|_| zero()).collect(),
        }
    }

    pub fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    /// Adds a stretch of stall to the session's total and to its group's.
    pub fn add_stall(&self, stall: Stall) {
        Self::bump(&self.stall_ns, stall.ns);
        if let Some(group) = self.group_stall_ns.get(stall.group as usize) {
            Self::bump(group, stall.ns);
        }
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

    /// Stall per group, by group index.
    pub fn group_stall_ns(&self) -> Vec<u64> {
        self.group_stall_ns
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}
