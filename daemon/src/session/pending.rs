//! Acquire pending: the wall-clock time during which at least one acquire of the session waits
//! for its Staged. Summing each ticket's own wait would count overlapping waits once per ticket
//! (eight tickets in flight through a 2.4 s step read as 19 s); the clock instead charges each
//! stretch of time once, to the group of the oldest ticket waiting in it.
//!
//! This is the daemon's view: an acquire the client sent ahead of need is pending while the
//! trainer still computes, so it is not the time the trainer waited (measured by the client and
//! reported as `gpu_wait_ns`: FLUX.2 at a 24 GiB job read 1.41 s of pending per step where the
//! step was 0.09 s slower than with its weights in place).

use std::collections::VecDeque;
use std::time::Instant;

use super::plan::GroupId;

/// A stretch of pending time to add to the counters, and the group it is charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    pub group: GroupId,
    pub ns: u64,
}

#[derive(Debug)]
pub struct PendingClock {
    /// Waiting tickets in the order they started waiting: the front is the oldest.
    waiting: VecDeque<(u64, GroupId)>,
    /// Up to when pending time has been charged (meaningful while someone waits).
    charged_to: Instant,
}

impl PendingClock {
    pub fn new(now: Instant) -> PendingClock {
        PendingClock {
            waiting: VecDeque::new(),
            charged_to: now,
        }
    }

    /// `ticket` (of `group`) starts waiting for its Staged at `now`.
    pub fn start(&mut self, ticket: u64, group: GroupId, now: Instant) -> Option<Pending> {
        let pending = self.charge(now);
        self.waiting.push_back((ticket, group));
        pending
    }

    /// `ticket` got its answer (Staged or a Fault) at `now`; nothing if it was not waiting.
    pub fn stop(&mut self, ticket: u64, now: Instant) -> Option<Pending> {
        let at = self.waiting.iter().position(|&(t, _)| t == ticket)?;
        let pending = self.charge(now);
        self.waiting.remove(at);
        pending
    }

    /// The session ends at `now`: every wait ends with it.
    pub fn stop_all(&mut self, now: Instant) -> Option<Pending> {
        let pending = self.charge(now);
        self.waiting.clear();
        pending
    }

    pub fn is_waiting(&self, ticket: u64) -> bool {
        self.waiting.iter().any(|&(t, _)| t == ticket)
    }

    /// Charges the time since the last change to the oldest waiting ticket's group.
    fn charge(&mut self, now: Instant) -> Option<Pending> {
        let from = self.charged_to;
        self.charged_to = now.max(from);
        let &(_, group) = self.waiting.front()?;
        let ns = now.saturating_duration_since(from).as_nanos() as u64;
        Some(Pending { group, ns })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    /// Sums what a sequence of clock calls charges, in total and per group.
    fn totals(charges: &[Option<Pending>]) -> (u64, Vec<(GroupId, u64)>) {
        let mut per_group: Vec<(GroupId, u64)> = Vec::new();
        for s in charges.iter().flatten() {
            match per_group.iter_mut().find(|(g, _)| *g == s.group) {
                Some((_, ns)) => *ns += s.ns,
                None => per_group.push((s.group, s.ns)),
            }
        }
        per_group.retain(|(_, ns)| *ns > 0);
        let total = per_group.iter().map(|(_, ns)| ns).sum();
        (total, per_group)
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn two_overlapping_waits_count_once() {
        let t0 = Instant::now();
        let mut clock = PendingClock::new(t0);
        // Ticket 1 waits 0..30 ms, ticket 2 waits 10..40 ms: 40 ms pending, not 60.
        let charges = [
            clock.start(1, 7, at(t0, 0)),
            clock.start(2, 8, at(t0, 10)),
            clock.stop(1, at(t0, 30)),
            clock.stop(2, at(t0, 40)),
        ];
        let (total, per_group) = totals(&charges);
        assert_eq!(total, 40 * MS);
        // 0..30 belongs to the oldest waiter (group 7), 30..40 to group 8.
        assert_eq!(per_group, vec![(7, 30 * MS), (8, 10 * MS)]);
    }

    #[test]
    fn time_with_nobody_waiting_is_not_pending() {
        let t0 = Instant::now();
        let mut clock = PendingClock::new(t0);
        let charges = [
            clock.start(1, 3, at(t0, 5)),
            clock.stop(1, at(t0, 8)),
            clock.start(2, 3, at(t0, 100)),
            clock.stop(2, at(t0, 101)),
        ];
        assert_eq!(totals(&charges), (4 * MS, vec![(3, 4 * MS)]));
    }

    #[test]
    fn a_wait_nested_in_another_is_charged_to_the_older_one() {
        let t0 = Instant::now();
        let mut clock = PendingClock::new(t0);
        let charges = [
            clock.start(1, 1, at(t0, 0)),
            clock.start(2, 2, at(t0, 10)),
            clock.stop(2, at(t0, 20)),
            clock.stop(1, at(t0, 50)),
        ];
        assert_eq!(totals(&charges), (50 * MS, vec![(1, 50 * MS)]));
    }

    #[test]
    fn stopping_a_ticket_that_does_not_wait_changes_nothing() {
        let t0 = Instant::now();
        let mut clock = PendingClock::new(t0);
        clock.start(1, 1, at(t0, 0));
        assert_eq!(clock.stop(9, at(t0, 10)), None);
        assert!(clock.is_waiting(1));
        assert_eq!(
            clock.stop(1, at(t0, 20)),
            Some(Pending {
                group: 1,
                ns: 20 * MS
            })
        );
    }

    #[test]
    fn the_end_of_the_session_ends_every_wait() {
        let t0 = Instant::now();
        let mut clock = PendingClock::new(t0);
        let charges = [
            clock.start(1, 4, at(t0, 0)),
            clock.start(2, 5, at(t0, 1)),
            clock.stop_all(at(t0, 9)),
        ];
        assert_eq!(totals(&charges), (9 * MS, vec![(4, 9 * MS)]));
        assert!(!clock.is_waiting(1) && !clock.is_waiting(2));
        assert_eq!(clock.stop_all(at(t0, 20)), None);
    }
}
