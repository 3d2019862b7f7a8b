//! The access plan of one training step and the client's cursor in it.
//!
//! A trainer acquires the same groups of weights in the same order every step
//! (forward, recompute, backward), so the daemon can look ahead: the plan says
//! what to prefetch next and, through [`Plan::next_use`], how soon a cached
//! group is needed again, which is what the staging arena's eviction rule
//! ranks victims by. Eviction asks `next_use` for many blocks on every copy,
//! so each group keeps its sorted positions and the answer is a binary search
//! rather than a scan of the step.
//!
//! Real steps drift from the plan (a skipped layer, a sampling pass), so the
//! cursor follows what the client actually acquires: it resynchronises to the
//! nearest occurrence instead of failing, and ignores groups outside the plan.

use std::collections::HashMap;

/// Identifies a group of tensors that is staged as one block.
pub type GroupId = u32;

/// How the cursor moved on an acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorMove {
    /// The acquire was the next plan entry.
    InOrder,
    /// The acquire was in the plan but not next: the cursor jumped to its
    /// nearest occurrence after the old cursor (cyclically).
    Resync { skipped: u64 },
    /// The group is not in the plan (e.g. a sampling pass); the cursor did
    /// not move.
    OutOfPlan,
}

/// The cyclic sequence of acquisitions of one step, and where the client is.
#[derive(Debug, Clone)]
pub struct Plan {
    groups: Vec<GroupId>,
    /// Sorted positions of each group, for O(log k) distance queries.
    positions: HashMap<GroupId, Vec<usize>>,
    cursor: Option<usize>,
}

impl Plan {
    /// Empty plans are allowed (no prefetch).
    pub fn new(groups: Vec<GroupId>) -> Plan {
        let mut positions: HashMap<GroupId, Vec<usize>> = HashMap::new();
        // Pushing in index order leaves every list sorted.
        for (pos, &group) in groups.iter().enumerate() {
            positions.entry(group).or_default().push(pos);
        }
        Plan {
            groups,
            positions,
            cursor: None,
        }
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub fn groups(&self) -> &[GroupId] {
        &self.groups
    }

    /// Position of the last matched acquire; None before the first one.
    pub fn cursor(&self) -> Option<usize> {
        self.cursor
    }

    /// Advances the cursor past `group` and says whether the client kept to
    /// the plan.
    pub fn on_acquire(&mut self, group: GroupId) -> CursorMove {
        if self.groups.is_empty() {
            return CursorMove::OutOfPlan;
        }
        let expected = self.cursor.map_or(0, |c| (c + 1) % self.groups.len());
        if self.groups[expected] == group {
            self.cursor = Some(expected);
            return CursorMove::InOrder;
        }
        match self.next_use(group) {
            Some(distance) => {
                self.cursor = Some(self.position_at(distance));
                CursorMove::Resync {
                    skipped: distance - 1,
                }
            }
            None => CursorMove::OutOfPlan,
        }
    }

    /// Distance in plan positions from the cursor to the next occurrence of
    /// `group`: 1 means the very next entry. Before the first acquire the
    /// cursor is "just before position 0", so position p has distance p + 1.
    /// The entry AT the cursor counts as a full cycle away (distance = len),
    /// since it was just used. None if the group is not in the plan.
    pub fn next_use(&self, group: GroupId) -> Option<u64> {
        let positions = self.positions.get(&group)?;
        let first = *positions
            .first()
            .expect("a group is only indexed with at least one position");
        let Some(cursor) = self.cursor else {
            return Some(first as u64 + 1);
        };
        let after = positions.partition_point(|&p| p <= cursor);
        let distance = match positions.get(after) {
            Some(&p) => p - cursor,
            None => first + self.groups.len() - cursor,
        };
        Some(distance as u64)
    }

    /// The next `n` entries after the cursor, wrapping around the step, as
    /// (distance, group), distance starting at 1. At most len() entries.
    pub fn upcoming(&self, n: usize) -> impl Iterator<Item = (u64, GroupId)> + '_ {
        let count = n.min(self.groups.len());
        (1..=count as u64).map(move |distance| (distance, self.groups[self.position_at(distance)]))
    }

    /// The plan position `distance` entries after the cursor.
    fn position_at(&self, distance: u64) -> usize {
        let base = self.cursor.map_or(0, |c| c + 1);
        (base + distance as usize - 1) % self.groups.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acquire_all(plan: &mut Plan, groups: &[GroupId]) {
        for &g in groups {
            plan.on_acquire(g);
        }
    }

    #[test]
    fn in_order_walk_over_several_cycles() {
        let steps = [0, 1, 2, 2, 1, 0];
        let mut plan = Plan::new(steps.to_vec());
        assert_eq!(plan.cursor(), None);
        for i in 0..3 * steps.len() {
            assert_eq!(plan.on_acquire(steps[i % steps.len()]), CursorMove::InOrder);
            assert_eq!(plan.cursor(), Some(i % steps.len()));
        }
    }

    #[test]
    fn first_acquire_off_plan_start_resyncs() {
        let mut plan = Plan::new(vec![0, 1, 2]);
        assert_eq!(plan.on_acquire(2), CursorMove::Resync { skipped: 2 });
        assert_eq!(plan.cursor(), Some(2));
        assert_eq!(plan.on_acquire(0), CursorMove::InOrder);
        assert_eq!(plan.cursor(), Some(0));
    }

    #[test]
    fn resync_forwards_and_wrapping() {
        let mut plan = Plan::new(vec![0, 1, 2, 3, 4]);
        assert_eq!(plan.on_acquire(0), CursorMove::InOrder);
        assert_eq!(plan.on_acquire(3), CursorMove::Resync { skipped: 2 });
        assert_eq!(plan.cursor(), Some(3));
        // 1 lies behind the cursor: reached by wrapping past 4 and 0.
        assert_eq!(plan.on_acquire(1), CursorMove::Resync { skipped: 2 });
        assert_eq!(plan.cursor(), Some(1));
        assert_eq!(plan.on_acquire(2), CursorMove::InOrder);
    }

    #[test]
    fn resync_picks_nearest_occurrence() {
        let mut plan = Plan::new(vec![0, 1, 2, 2, 1, 0]);
        acquire_all(&mut plan, &[0, 1]);
        // 0 is at 0 (distance 5) and 5 (distance 4): the nearer one wins.
        assert_eq!(plan.on_acquire(0), CursorMove::Resync { skipped: 3 });
        assert_eq!(plan.cursor(), Some(5));
        // Expected is 0 (wrapped); 2 is at 2 (distance 3) and 3 (distance 4).
        assert_eq!(plan.on_acquire(2), CursorMove::Resync { skipped: 2 });
        assert_eq!(plan.cursor(), Some(2));
        assert_eq!(plan.on_acquire(2), CursorMove::InOrder);
        assert_eq!(plan.cursor(), Some(3));
    }

    #[test]
    fn reacquiring_the_entry_at_the_cursor_is_a_full_cycle_resync() {
        let mut plan = Plan::new(vec![0, 1, 2]);
        plan.on_acquire(0);
        assert_eq!(plan.on_acquire(0), CursorMove::Resync { skipped: 2 });
        assert_eq!(plan.cursor(), Some(0));
    }

    #[test]
    fn out_of_plan_leaves_the_cursor() {
        let mut plan = Plan::new(vec![0, 1, 2]);
        assert_eq!(plan.on_acquire(99), CursorMove::OutOfPlan);
        assert_eq!(plan.cursor(), None);
        acquire_all(&mut plan, &[0, 1]);
        assert_eq!(plan.on_acquire(99), CursorMove::OutOfPlan);
        assert_eq!(plan.cursor(), Some(1));
        assert_eq!(plan.on_acquire(2), CursorMove::InOrder);
    }

    #[test]
    fn next_use_before_and_after_acquires_mirrored_plan() {
        let mut plan = Plan::new(vec![0, 1, 2, 2, 1, 0]);
        assert_eq!(plan.next_use(0), Some(1));
        assert_eq!(plan.next_use(1), Some(2));
        assert_eq!(plan.next_use(2), Some(3));
        assert_eq!(plan.next_use(99), None);

        plan.on_acquire(0);
        assert_eq!(plan.next_use(0), Some(5));
        assert_eq!(plan.next_use(1), Some(1));
        assert_eq!(plan.next_use(2), Some(2));

        acquire_all(&mut plan, &[1, 2]);
        assert_eq!(plan.cursor(), Some(2));
        assert_eq!(plan.next_use(2), Some(1));
        assert_eq!(plan.next_use(1), Some(2));
        assert_eq!(plan.next_use(0), Some(3));

        acquire_all(&mut plan, &[2, 1, 0]);
        assert_eq!(plan.cursor(), Some(5));
        assert_eq!(plan.next_use(0), Some(1));
        assert_eq!(plan.next_use(1), Some(2));
        assert_eq!(plan.next_use(2), Some(3));
    }

    #[test]
    fn next_use_with_three_uses_per_group() {
        // Forward, then recompute and backward interleaved per layer.
        let mut plan = Plan::new(vec![0, 1, 2, 2, 2, 1, 1, 0, 0]);
        assert_eq!(plan.next_use(0), Some(1));
        assert_eq!(plan.next_use(2), Some(3));

        acquire_all(&mut plan, &[0, 1, 2, 2]);
        assert_eq!(plan.cursor(), Some(3));
        assert_eq!(plan.next_use(2), Some(1));
        assert_eq!(plan.next_use(1), Some(2));
        assert_eq!(plan.next_use(0), Some(4));

        acquire_all(&mut plan, &[2, 1, 1, 0, 0]);
        assert_eq!(plan.cursor(), Some(8));
        assert_eq!(plan.next_use(0), Some(1));
        assert_eq!(plan.next_use(1), Some(2));
        assert_eq!(plan.next_use(2), Some(3));
    }

    #[test]
    fn entry_at_cursor_counts_as_len() {
        let mut plan = Plan::new(vec![5, 6, 7]);
        acquire_all(&mut plan, &[5, 6]);
        assert_eq!(plan.next_use(6), Some(3));
        assert_eq!(plan.next_use(7), Some(1));
        assert_eq!(plan.next_use(5), Some(2));
    }

    #[test]
    fn upcoming_wraps_and_stops_at_len() {
        let mut plan = Plan::new(vec![10, 11, 12, 13]);
        assert_eq!(plan.upcoming(2).collect::<Vec<_>>(), vec![(1, 10), (2, 11)]);
        acquire_all(&mut plan, &[10, 11, 12]);
        assert_eq!(
            plan.upcoming(3).collect::<Vec<_>>(),
            vec![(1, 13), (2, 10), (3, 11)]
        );
        assert_eq!(
            plan.upcoming(10).collect::<Vec<_>>(),
            vec![(1, 13), (2, 10), (3, 11), (4, 12)]
        );
        assert_eq!(plan.upcoming(0).count(), 0);
    }

    #[test]
    fn empty_plan() {
        let mut plan = Plan::new(Vec::new());
        assert!(plan.is_empty());
        assert_eq!(plan.len(), 0);
        assert!(plan.groups().is_empty());
        assert_eq!(plan.on_acquire(0), CursorMove::OutOfPlan);
        assert_eq!(plan.cursor(), None);
        assert_eq!(plan.next_use(0), None);
        assert_eq!(plan.upcoming(5).count(), 0);
    }
}
