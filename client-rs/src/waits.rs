//! The client's own measure of how long its compute waited for weights: the figure a trainer
//! can act on, unlike the daemon's `acquire_pending_ns` (time during which some acquire,
//! look-ahead ones included, was pending while the trainer may well have been computing).
//!
//! A wait is measured where the client computes: the Rust client and the Python client on the
//! host backend time how long their thread blocked for a ticket not yet staged; the Python
//! client on CUDA times its compute stream with CUDA events and adds what it harvests here.
//! The ledger sums the waits per session, per group and per step, and says when a report to
//! the daemon (`GpuWait`, totals since the session opened) is due.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::proto;

/// The least time between two reports while the totals change: a trainer's acquires come
/// every few milliseconds, `weightstream top` refreshes every second.
pub const REPORT_INTERVAL: Duration = Duration::from_millis(250);

/// Completed steps whose waits are kept (the oldest go first).
pub const STEPS_KEPT: usize = 1024;

/// What a ledger has summed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WaitTotals {
    /// Nanoseconds waited, all groups.
    pub total_ns: u64,
    /// The waits `total_ns` sums.
    pub waits: u64,
    /// `total_ns` by group (index = group id).
    pub by_group: Vec<u64>,
    /// The waits of the last completed steps (at most [`STEPS_KEPT`]), oldest first.
    pub per_step: Vec<u64>,
    /// The waits of the step in progress.
    pub this_step: u64,
    /// The step in progress, counted from 0 when the session opened.
    pub step: u64,
}

#[derive(Debug)]
pub struct WaitLedger {
    total_ns: u64,
    waits: u64,
    by_group: Vec<u64>,
    /// The waits of steps `first_step ..= step`, the step in progress last.
    steps: VecDeque<u64>,
    first_step: u64,
    step: u64,
    /// Bumped by every wait added: a report is due only when it moved.
    version: u64,
    /// When the last report was taken, and the version it carried.
    reported: Option<(Instant, u64)>,
    reports: u64,
}

impl WaitLedger {
    /// An empty ledger for a session of `groups` groups.
    pub fn new(groups: usize) -> WaitLedger {
        WaitLedger {
            total_ns: 0,
            waits: 0,
            by_group: vec![0; groups],
            steps: VecDeque::from([0]),
            first_step: 0,
            step: 0,
            version: 0,
            reported: None,
            reports: 0,
        }
    }

    /// Adds one wait of `ns` for `group`, charged to step `step` (None: the step in progress;
    /// a later step than that counts as the step in progress, one no longer kept counts in the
    /// totals only). A group out of range counts in the session's total only.
    pub fn add(&mut self, group: u32, ns: u64, step: Option<u64>) {
        self.total_ns = self.total_ns.saturating_add(ns);
        self.waits += 1;
        if let Some(g) = self.by_group.get_mut(group as usize) {
            *g = g.saturating_add(ns);
        }
        let step = step.unwrap_or(self.step).min(self.step);
        if let Some(s) = step
            .checked_sub(self.first_step)
            .and_then(|i| self.steps.get_mut(i as usize))
        {
            *s = s.saturating_add(ns);
        }
        self.version += 1;
    }

    /// Ends the step in progress; returns the number of the step that starts.
    pub fn mark_step(&mut self) -> u64 {
        self.step += 1;
        self.steps.push_back(0);
        // Completed steps kept, plus the one in progress.
        while self.steps.len() > STEPS_KEPT + 1 {
            self.steps.pop_front();
            self.first_step += 1;
        }
        self.step
    }

    /// The step in progress.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn totals(&self) -> WaitTotals {
        let (this_step, completed) = match self.steps.back() {
            Some(&last) => (last, self.steps.len() - 1),
            None => (0, 0),
        };
        WaitTotals {
            total_ns: self.total_ns,
            waits: self.waits,
            by_group: self.by_group.clone(),
            per_step: self.steps.iter().take(completed).copied().collect(),
            this_step,
            step: self.step,
        }
    }

    /// Reports taken so far.
    pub fn reports(&self) -> u64 {
        self.reports
    }

    /// The report to send at `now`, if one is due: the first one at once (even of no wait,
    /// so that the daemon knows the client measures), later ones once the totals moved and
    /// [`REPORT_INTERVAL`] has passed since the last.
    pub fn report_due(&mut self, now: Instant) -> Option<proto::GpuWait> {
        match self.reported {
            Some((at, version))
                if version == self.version
                    || now.saturating_duration_since(at) < REPORT_INTERVAL =>
            {
                None
            }
            _ => Some(self.take_report(now)),
        }
    }

    /// The report to send now whatever the interval, unless the daemon has these totals
    /// already.
    pub fn report_now(&mut self, now: Instant) -> Option<proto::GpuWait> {
        match self.reported {
            Some((_, version)) if version == self.version => None,
            _ => Some(self.take_report(now)),
        }
    }

    fn take_report(&mut self, now: Instant) -> proto::GpuWait {
        self.reported = Some((now, self.version));
        self.reports += 1;
        let used = self
            .by_group
            .iter()
            .rposition(|&ns| ns > 0)
            .map_or(0, |i| i + 1);
        proto::GpuWait {
            total_ns: self.total_ns,
            waits: self.waits,
            group_ns: self.by_group[..used].to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn waits_sum_exactly_per_session_group_and_step() {
        let mut l = WaitLedger::new(3);
        l.add(0, 5 * MS, None);
        l.add(2, 7 * MS, None);
        assert_eq!(l.mark_step(), 1);
        l.add(2, 1, None);
        // Harvested late: charged to the step it happened in.
        l.add(1, 3 * MS, Some(0));
        // Out of range: the session's total only.
        l.add(9, 11, None);
        let t = l.totals();
        assert_eq!(t.total_ns, 15 * MS + 12);
        assert_eq!(t.waits, 5);
        assert_eq!(t.by_group, vec![5 * MS, 3 * MS, 7 * MS + 1]);
        assert_eq!(t.per_step, vec![15 * MS]);
        assert_eq!((t.this_step, t.step), (12, 1));
        assert_eq!(
            t.total_ns,
            t.per_step.iter().sum::<u64>() + t.this_step,
            "every wait is in exactly one step"
        );
    }

    #[test]
    fn a_step_later_than_the_current_one_counts_as_the_current_one() {
        let mut l = WaitLedger::new(1);
        l.add(0, 4, Some(7));
        assert_eq!((l.totals().this_step, l.totals().per_step.len()), (4, 0));
    }

    #[test]
    fn only_the_last_steps_are_kept_and_older_waits_count_in_the_totals() {
        let mut l = WaitLedger::new(1);
        for s in 0..(STEPS_KEPT as u64 + 10) {
            l.add(0, s, None);
            l.mark_step();
        }
        let t = l.totals();
        assert_eq!(t.per_step.len(), STEPS_KEPT);
        assert_eq!(t.per_step[0], 10, "steps 0..10 are dropped");
        assert_eq!(*t.per_step.last().unwrap(), STEPS_KEPT as u64 + 9);
        l.add(0, 1000, Some(3)); // a step no longer kept
        let after = l.totals();
        assert_eq!(after.total_ns, t.total_ns + 1000);
        assert_eq!((after.per_step, after.this_step), (t.per_step, 0));
    }

    #[test]
    fn the_first_report_goes_at_once_later_ones_when_the_totals_moved_and_the_interval_passed() {
        let t0 = Instant::now();
        let mut l = WaitLedger::new(4);
        let first = l.report_due(t0).expect("the first report, of no wait");
        assert_eq!(first, proto::GpuWait::default());
        assert_eq!(
            l.report_due(t0 + 10 * REPORT_INTERVAL),
            None,
            "nothing moved"
        );
        l.add(1, 9, None);
        assert_eq!(l.report_due(t0 + REPORT_INTERVAL / 2), None, "too soon");
        let second = l.report_due(t0 + REPORT_INTERVAL).expect("due");
        // Trailing zero groups are left out.
        assert_eq!(
            second,
            proto::GpuWait {
                total_ns: 9,
                waits: 1,
                group_ns: vec![0, 9],
            }
        );
        l.add(3, 1, None);
        let now = t0 + REPORT_INTERVAL + Duration::from_millis(1);
        assert_eq!(l.report_due(now), None);
        assert_eq!(
            l.report_now(now).map(|r| r.group_ns),
            Some(vec![0, 9, 0, 1])
        );
        assert_eq!(l.report_now(now), None, "the daemon has these totals");
        assert_eq!(l.reports(), 3);
    }
}
