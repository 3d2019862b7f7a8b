//! A session's counters: written by its actor, read by ListSessions and metrics meanwhile.

use std::sync::atomic::{AtomicU64, Ordering};

use super::pending::Pending;

/// Counters of one session, readable while the actor runs.
#[derive(Debug)]
pub struct SessionStats {
    pub acquires: AtomicU64,
    pub hits: AtomicU64,
    pub reuses: AtomicU64,
    pub misses: AtomicU64,
    pub resident_hits: AtomicU64,
    pub bytes_copied: AtomicU64,
    /// Bytes staged from another session's resident region, within the device (not in
    /// `bytes_copied`, which is what crossed the link).
    pub bytes_from_device: AtomicU64,
    pub copies: AtomicU64,
    pub prefetches: AtomicU64,
    /// Wall-clock time with at least one acquire waiting for its Staged (see `pending`).
    pub acquire_pending_ns: AtomicU64,
    pub resyncs: AtomicU64,
    pub releases: AtomicU64,
    pub evictions: AtomicU64,
    /// Plan entries the actor has looked at (cursor moves, look-ahead), a measure of the work
    /// per message that must not grow with the plan's length (see `plan.rs`).
    pub plan_entries_visited: AtomicU64,
    /// The client's own measure of its waits for weights, as it last reported them.
    pub gpu_wait_ns: AtomicU64,
    pub gpu_waits: AtomicU64,
    pub gpu_wait_reports: AtomicU64,
    /// Bytes of the client's own copies granted (CopyGrant), to and from the device.
    pub granted_h2d_bytes: AtomicU64,
    pub granted_d2h_bytes: AtomicU64,
    /// `acquire_pending_ns` split by group (index = group id); the parts sum to it.
    group_acquire_pending_ns: Box<[AtomicU64]>,
    /// `gpu_wait_ns` split by group, as reported.
    group_gpu_wait_ns: Box<[AtomicU64]>,
    /// Part of the counters per pass kind (index: `PassKind::index`).
    kinds: [KindStats; 2],
}

/// The kind of pass an acquire serves (`Acquire.kind`); the session counts its work per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PassKind {
    /// Forward, recompute and backward of a training step; a session starts in it.
    #[default]
    Train,
    /// A forward under no_grad: a trainer's samples, or inference.
    Sample,
}

impl PassKind {
    pub const ALL: [PassKind; 2] = [PassKind::Train, PassKind::Sample];

    pub fn index(self) -> usize {
        self as usize
    }

    /// The kind's name in `top` and in the metrics' `kind` label.
    pub fn name(self) -> &'static str {
        match self {
            PassKind::Train => "train",
            PassKind::Sample => "sample",
        }
    }
}

/// One pass kind's part of a session's counters.
#[derive(Debug, Default)]
pub struct KindStats {
    pub acquires: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Bytes of copies that ended while the kind was in force.
    pub bytes_copied: AtomicU64,
    /// The growth of the client's reported waits while the kind was in force.
    pub gpu_wait_ns: AtomicU64,
    pub gpu_waits: AtomicU64,
}

/// One pass kind's counters at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KindSnapshot {
    pub acquires: u64,
    pub hits: u64,
    pub misses: u64,
    pub bytes_copied: u64,
    pub gpu_wait_ns: u64,
    pub gpu_waits: u64,
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
    pub bytes_from_device: u64,
    pub copies: u64,
    pub prefetches: u64,
    pub acquire_pending_ns: u64,
    pub resyncs: u64,
    pub releases: u64,
    pub evictions: u64,
    pub gpu_wait_ns: u64,
    pub gpu_waits: u64,
    pub gpu_wait_reports: u64,
    pub granted_h2d_bytes: u64,
    pub granted_d2h_bytes: u64,
    /// Per pass kind (index: `PassKind::index`).
    pub kinds: [KindSnapshot; 2],
}

/// A client's report of its waits for weights: totals since the session opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuWaitReport {
    pub total_ns: u64,
    pub waits: u64,
    /// By group (index = group id); at most the session's groups (checked by the actor).
    pub group_ns: Vec<u64>,
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
            bytes_from_device: zero(),
            copies: zero(),
            prefetches: zero(),
            acquire_pending_ns: zero(),
            resyncs: zero(),
            releases: zero(),
            evictions: zero(),
            plan_entries_visited: zero(),
            gpu_wait_ns: zero(),
            gpu_waits: zero(),
            gpu_wait_reports: zero(),
            granted_h2d_bytes: zero(),
            granted_d2h_bytes: zero(),
            group_acquire_pending_ns: (0..groups).map(|_| zero()).collect(),
            group_gpu_wait_ns: (0..groups).map(|_| zero()).collect(),
            kinds: Default::default(),
        }
    }

    /// The counters of one pass kind.
    pub fn kind(&self, kind: PassKind) -> &KindStats {
        &self.kinds[kind.index()]
    }

    pub fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    /// Adds a stretch of pending time to the session's total and to its group's.
    pub fn add_pending(&self, pending: Pending) {
        Self::bump(&self.acquire_pending_ns, pending.ns);
        if let Some(group) = self.group_acquire_pending_ns.get(pending.group as usize) {
            Self::bump(group, pending.ns);
        }
    }

    /// Takes a client's report. Its totals replace the earlier ones, but a counter never goes
    /// back (Prometheus counters must not): each figure keeps the largest value reported. What
    /// the totals grew by goes to `kind`, the kind in force (only the actor writes, so the
    /// value before each `fetch_max` is the last one kept).
    pub fn record_gpu_wait(&self, report: &GpuWaitReport, kind: PassKind) {
        let ns = self
            .gpu_wait_ns
            .fetch_max(report.total_ns, Ordering::Relaxed);
        let waits = self.gpu_waits.fetch_max(report.waits, Ordering::Relaxed);
        let part = self.kind(kind);
        Self::bump(&part.gpu_wait_ns, report.total_ns.saturating_sub(ns));
        Self::bump(&part.gpu_waits, report.waits.saturating_sub(waits));
        for (counter, &ns) in self.group_gpu_wait_ns.iter().zip(&report.group_ns) {
            counter.fetch_max(ns, Ordering::Relaxed);
        }
        Self::bump(&self.gpu_wait_reports, 1);
    }

    /// The groups a report may name.
    pub fn groups(&self) -> usize {
        self.group_gpu_wait_ns.len()
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
            bytes_from_device: get(&self.bytes_from_device),
            copies: get(&self.copies),
            prefetches: get(&self.prefetches),
            acquire_pending_ns: get(&self.acquire_pending_ns),
            resyncs: get(&self.resyncs),
            releases: get(&self.releases),
            evictions: get(&self.evictions),
            gpu_wait_ns: get(&self.gpu_wait_ns),
            gpu_waits: get(&self.gpu_waits),
            gpu_wait_reports: get(&self.gpu_wait_reports),
            granted_h2d_bytes: get(&self.granted_h2d_bytes),
            granted_d2h_bytes: get(&self.granted_d2h_bytes),
            kinds: PassKind::ALL.map(|k| {
                let c = self.kind(k);
                KindSnapshot {
                    acquires: get(&c.acquires),
                    hits: get(&c.hits),
                    misses: get(&c.misses),
                    bytes_copied: get(&c.bytes_copied),
                    gpu_wait_ns: get(&c.gpu_wait_ns),
                    gpu_waits: get(&c.gpu_waits),
                }
            }),
        }
    }

    /// Acquire pending time per group, by group index.
    pub fn group_acquire_pending_ns(&self) -> Vec<u64> {
        load_all(&self.group_acquire_pending_ns)
    }

    /// The client's reported waits per group, by group index.
    pub fn group_gpu_wait_ns(&self) -> Vec<u64> {
        load_all(&self.group_gpu_wait_ns)
    }
}

fn load_all(counters: &[AtomicU64]) -> Vec<u64> {
    counters.iter().map(|c| c.load(Ordering::Relaxed)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_replaces_the_totals_but_no_counter_goes_back() {
        let stats = SessionStats::new(3);
        stats.record_gpu_wait(
            &GpuWaitReport {
                total_ns: 50,
                waits: 4,
                group_ns: vec![10, 0, 40],
            },
            PassKind::Train,
        );
        stats.record_gpu_wait(
            &GpuWaitReport {
                total_ns: 70,
                waits: 5,
                group_ns: vec![30],
            },
            PassKind::Sample,
        );
        let s = stats.snapshot();
        assert_eq!((s.gpu_wait_ns, s.gpu_waits, s.gpu_wait_reports), (70, 5, 2));
        assert_eq!(stats.group_gpu_wait_ns(), vec![30, 0, 40]);
        // A report with smaller totals (a confused client) moves nothing back.
        stats.record_gpu_wait(&GpuWaitReport::default(), PassKind::Sample);
        let s = stats.snapshot();
        assert_eq!((s.gpu_wait_ns, s.gpu_waits, s.gpu_wait_reports), (70, 5, 3));
        assert_eq!(stats.group_gpu_wait_ns(), vec![30, 0, 40]);
    }

    #[test]
    fn each_kind_takes_what_the_reported_totals_grew_by_while_it_was_in_force() {
        let stats = SessionStats::new(1);
        let report = |total_ns, waits| GpuWaitReport {
            total_ns,
            waits,
            group_ns: vec![],
        };
        stats.record_gpu_wait(&report(50, 4), PassKind::Train);
        stats.record_gpu_wait(&report(70, 5), PassKind::Sample);
        stats.record_gpu_wait(&report(60, 5), PassKind::Sample);
        stats.record_gpu_wait(&report(100, 9), PassKind::Train);
        let [train, sample] = stats.snapshot().kinds;
        assert_eq!((train.gpu_wait_ns, train.gpu_waits), (80, 8));
        assert_eq!((sample.gpu_wait_ns, sample.gpu_waits), (20, 1));
    }
}
