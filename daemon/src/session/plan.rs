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
//!
//! No message may cost work in proportion to the plan's length (a plan of a
//! million entries that repeats a few groups is legal): the cursor moves by
//! binary search, and [`Plan::upcoming`] yields each upcoming group once, in
//! the order of its next use, in O(log n) per group through a max-tree over
//! the entries (see [`FirstUses`]), so prefetch pays for the groups it looks
//! at, never for the repeats between them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// The work the plan has done for its callers since it was made: how many
/// entries were looked at, and how many max-tree nodes. Tests bound these per
/// message; they are counters, not timings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanWork {
    pub entries: u64,
    pub nodes: u64,
}

/// The cyclic sequence of acquisitions of one step, and where the client is.
#[derive(Debug)]
pub struct Plan {
    groups: Vec<GroupId>,
    /// Sorted positions of each group, for O(log k) distance queries.
    positions: HashMap<GroupId, Vec<usize>>,
    first_uses: FirstUses,
    cursor: Option<usize>,
    entries: AtomicU64,
    nodes: AtomicU64,
}

impl Plan {
    /// Empty plans are allowed (no prefetch).
    pub fn new(groups: Vec<GroupId>) -> Plan {
        Plan::ignoring(groups, |_| false)
    }

    /// A plan whose [`upcoming`](Plan::upcoming) never yields the groups `ignored` says
    /// (resident ones: they are never staged), so that no scan steps over them one by one.
    pub fn ignoring(groups: Vec<GroupId>, ignored: impl Fn(GroupId) -> bool) -> Plan {
        let mut positions: HashMap<GroupId, Vec<usize>> = HashMap::new();
        // Pushing in index order leaves every list sorted.
        for (pos, &group) in groups.iter().enumerate() {
            positions.entry(group).or_default().push(pos);
        }
        let first_uses = FirstUses::new(&groups, &positions, ignored);
        Plan {
            groups,
            positions,
            first_uses,
            cursor: None,
            entries: AtomicU64::new(0),
            nodes: AtomicU64::new(0),
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

    /// What the plan has looked at so far (see [`PlanWork`]).
    pub fn work(&self) -> PlanWork {
        PlanWork {
            entries: self.entries.load(Ordering::Relaxed),
            nodes: self.nodes.load(Ordering::Relaxed),
        }
    }

    /// Advances the cursor past `group` and says whether the client kept to
    /// the plan. One entry is looked at; a resync is a binary search in the
    /// group's positions.
    pub fn on_acquire(&mut self, group: GroupId) -> CursorMove {
        if self.groups.is_empty() {
            return CursorMove::OutOfPlan;
        }
        self.entries.fetch_add(1, Ordering::Relaxed);
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

    /// The groups after the cursor, each once, in the order of their next use, as
    /// (distance, group) with distance = [`next_use`](Plan::next_use): the first
    /// occurrences in the cycle that starts after the cursor. Lazy, O(log len) per
    /// group yielded, never a walk over the repeats in between; ignored groups
    /// (see [`Plan::ignoring`]) are never yielded.
    pub fn upcoming(&self) -> Upcoming<'_> {
        Upcoming {
            plan: self,
            // Before the first acquire the cursor sits just before position 0.
            cursor: self.cursor.map_or(-1, |c| c as i64),
            next: self.cursor.map_or(0, |c| c + 1),
            wrapped: false,
            work: PlanWork::default(),
        }
    }

    /// The plan position `distance` entries after the cursor.
    fn position_at(&self, distance: u64) -> usize {
        let base = self.cursor.map_or(0, |c| c + 1);
        (base + distance as usize - 1) % self.groups.len()
    }
}

/// See [`Plan::upcoming`]. The cycle after cursor `c` is positions `c+1 .. len`, then
/// `0 ..= c`; position `q` is its group's first use in that cycle when the group's previous
/// use (cyclically) lies at or before the cursor.
pub struct Upcoming<'a> {
    plan: &'a Plan,
    cursor: i64,
    next: usize,
    wrapped: bool,
    work: PlanWork,
}

impl Iterator for Upcoming<'_> {
    type Item = (u64, GroupId);

    fn next(&mut self) -> Option<(u64, GroupId)> {
        let plan = self.plan;
        let n = plan.groups.len();
        let c = self.cursor;
        loop {
            // After the cursor, q is new when gap(q) >= q - c; wrapped, when gap(q) >= q + n - c.
            let (end, threshold, shift) = if self.wrapped {
                ((c + 1) as usize, n as i64 - c, n as i64 - c)
            } else {
                (n, -c, -c)
            };
            let found = (self.next < end)
                .then(|| {
                    plan.first_uses
                        .first_at_least(self.next, end, threshold, &mut self.work.nodes)
                })
                .flatten();
            match found {
                Some(q) => {
                    self.next = q + 1;
                    self.work.entries += 1;
                    return Some(((q as i64 + shift) as u64, plan.groups[q]));
                }
                None if !self.wrapped => {
                    self.wrapped = true;
                    self.next = 0;
                }
                None => return None,
            }
        }
    }
}

impl Drop for Upcoming<'_> {
    fn drop(&mut self) {
        let plan = self.plan;
        plan.entries.fetch_add(self.work.entries, Ordering::Relaxed);
        plan.nodes.fetch_add(self.work.nodes, Ordering::Relaxed);
    }
}

/// A max-tree over `gap(q) - q`, where `gap(q)` is the cyclic distance from the previous use
/// of the group at `q` back to `q` (`len` for a group used once): the first position in a
/// range whose key reaches a threshold is found in O(log len). Ignored groups get the lowest
/// key, which no threshold (always above `-len`) reaches.
#[derive(Debug)]
struct FirstUses {
    /// Leaves at `size + q`; node `i` holds the max of `2i` and `2i + 1`.
    tree: Vec<i32>,
    size: usize,
}

impl FirstUses {
    fn new(
        groups: &[GroupId],
        positions: &HashMap<GroupId, Vec<usize>>,
        ignored: impl Fn(GroupId) -> bool,
    ) -> FirstUses {
        let n = groups.len();
        let size = n.next_power_of_two().max(1);
        let mut tree = vec![i32::MIN; 2 * size];
        for (&group, pos) in positions {
            if ignored(group) {
                continue;
            }
            let last = *pos.last().expect("at least one position");
            let mut previous = last as i64 - n as i64;
            for &q in pos {
                let gap = q as i64 - previous;
                // |key| <= len, and a plan fits a gRPC message (1 GiB at most): within i32.
                tree[size + q] = i32::try_from(gap - q as i64).unwrap_or(i32::MAX);
                previous = q as i64;
            }
        }
        for i in (1..size).rev() {
            tree[i] = tree[2 * i].max(tree[2 * i + 1]);
        }
        FirstUses { tree, size }
    }

    /// The first position in `from..to` whose key is at least `threshold`.
    fn first_at_least(
        &self,
        from: usize,
        to: usize,
        threshold: i64,
        nodes: &mut u64,
    ) -> Option<usize> {
        self.descend(1, 0, self.size, from, to, threshold, nodes)
    }

    #[allow(clippy::too_many_arguments)]
    fn descend(
        &self,
        node: usize,
        lo: usize,
        hi: usize,
        from: usize,
        to: usize,
        threshold: i64,
        nodes: &mut u64,
    ) -> Option<usize> {
        *nodes += 1;
        if hi <= from || to <= lo || i64::from(self.tree[node]) < threshold {
            return None;
        }
        if hi - lo == 1 {
            return Some(lo);
        }
        let mid = lo + (hi - lo) / 2;
        self.descend(2 * node, lo, mid, from, to, threshold, nodes)
            .or_else(|| self.descend(2 * node + 1, mid, hi, from, to, threshold, nodes))
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
    fn upcoming_yields_each_group_once_in_order_of_next_use() {
        let mut plan = Plan::new(vec![10, 11, 12, 13]);
        assert_eq!(
            plan.upcoming().collect::<Vec<_>>(),
            vec![(1, 10), (2, 11), (3, 12), (4, 13)]
        );
        acquire_all(&mut plan, &[10, 11, 12]);
        assert_eq!(
            plan.upcoming().collect::<Vec<_>>(),
            vec![(1, 13), (2, 10), (3, 11), (4, 12)]
        );
        let mut mirrored = Plan::new(vec![0, 1, 2, 2, 1, 0]);
        acquire_all(&mut mirrored, &[0]);
        assert_eq!(
            mirrored.upcoming().collect::<Vec<_>>(),
            vec![(1, 1), (2, 2), (5, 0)]
        );
        assert_eq!(mirrored.upcoming().take(1).count(), 1);
    }

    /// The first uses of each group after the cursor, found by walking one whole cycle.
    fn first_uses_by_walking(plan: &Plan) -> Vec<(u64, GroupId)> {
        let n = plan.len();
        let base = plan.cursor().map_or(0, |c| c + 1);
        let mut seen = std::collections::HashSet::new();
        (1..=n as u64)
            .map(|d| (d, plan.groups()[(base + d as usize - 1) % n]))
            .filter(|(_, g)| seen.insert(*g))
            .collect()
    }

    #[test]
    fn upcoming_agrees_with_a_walk_of_the_cycle_at_every_cursor() {
        // Seeded pseudo-random plans over few groups (many repeats), every cursor position.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut failures = Vec::new();
        for len in [1usize, 2, 3, 7, 16, 33] {
            for distinct in [1u64, 2, 5] {
                let groups: Vec<GroupId> = (0..len)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        (state % distinct) as GroupId
                    })
                    .collect();
                let mut plan = Plan::new(groups.clone());
                for step in 0..=len {
                    let want = first_uses_by_walking(&plan);
                    let got: Vec<_> = plan.upcoming().collect();
                    if got != want {
                        failures.push(format!(
                            "{groups:?} cursor {:?}: got {got:?}, want {want:?}",
                            plan.cursor()
                        ));
                    }
                    let next_use: Vec<_> = want
                        .iter()
                        .map(|&(_, g)| (plan.next_use(g).unwrap(), g))
                        .collect();
                    if next_use != want {
                        failures.push(format!("{groups:?}: next_use {next_use:?} != {want:?}"));
                    }
                    plan.on_acquire(groups[step % len]);
                }
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn ignored_groups_are_never_upcoming() {
        let mut plan = Plan::ignoring(vec![0, 1, 2, 1, 0, 3], |g| g == 1 || g == 3);
        assert_eq!(plan.upcoming().collect::<Vec<_>>(), vec![(1, 0), (3, 2)]);
        // The cursor still follows them.
        assert_eq!(plan.on_acquire(1), CursorMove::Resync { skipped: 1 });
        assert_eq!(plan.upcoming().collect::<Vec<_>>(), vec![(1, 2), (3, 0)]);
        assert_eq!(plan.next_use(3), Some(4));
    }

    /// A step that cycles through `distinct` groups, `len` entries long.
    fn cycling(distinct: u32, len: usize) -> Plan {
        Plan::new((0..len).map(|i| i as u32 % distinct).collect())
    }

    #[test]
    fn the_work_of_a_look_ahead_does_not_grow_with_the_plan() {
        // Eight groups, the next three looked at (a window of three blocks), in a plan of a
        // thousand entries and in one of a million.
        let look = |plan: &mut Plan| {
            let before = plan.work();
            plan.on_acquire(0);
            plan.on_acquire(5); // a resync
            let _ = plan.upcoming().take(3).count();
            let after = plan.work();
            (after.entries - before.entries, after.nodes - before.nodes)
        };
        let (small_entries, small_nodes) = look(&mut cycling(8, 1 << 10));
        let (big_entries, big_nodes) = look(&mut cycling(8, 1 << 20));
        assert_eq!(small_entries, big_entries, "entries looked at");
        assert_eq!(big_entries, 2 + 3);
        // Each group found costs one descent of the tree: O(log len) nodes, not O(len).
        let depth = 20 + 1;
        assert!(
            big_nodes <= 3 * 4 * depth,
            "{big_nodes} nodes (small: {small_nodes})"
        );
        // Even all the groups of the plan (a full look-ahead, which must also find that no
        // further group follows) cost the same entries in both, and O(log len) nodes each.
        let all = |plan: &Plan| {
            let before = plan.work();
            assert_eq!(plan.upcoming().count(), 8);
            let after = plan.work();
            (after.entries - before.entries, after.nodes - before.nodes)
        };
        let (small_all, _) = all(&cycling(8, 1 << 10));
        let (big_all, big_all_nodes) = all(&cycling(8, 1 << 20));
        assert_eq!(small_all, big_all);
        assert!(
            big_all_nodes <= (8 + 2) * 4 * depth,
            "{big_all_nodes} nodes"
        );
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
        assert_eq!(plan.upcoming().count(), 0);
    }
}
