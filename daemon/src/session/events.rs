//! Which interprocess event means what (CUDA backend): each staged block has a *ready* event
//! (recorded by the daemon after its copy), each ticket a *free* event (recorded by the client
//! after its last read, before it sends Release). A copy into reused space first waits on the
//! free events of the blocks it evicts; only then are those events' slots handed out again.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use super::plan::GroupId;
use crate::backend::EventPool;

/// Free events a cached block may collect before they are merged into one.
const MERGE_AT: usize = 3;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("all {0} interprocess events of the session are in use")]
pub struct Exhausted(pub u32);

struct BlockEvents {
    ready: u32,
    frees: Vec<u32>,
}

/// A block's place in the staging arena is about to be written: what the copy needs.
#[derive(Debug, PartialEq, Eq)]
pub struct CopyEvents {
    pub ready: u32,
    /// Free events to wait on; their slots come back once the wait is queued.
    pub wait: Vec<u32>,
}

/// An event-only job: wait on `wait` (off the copy stream), record `into`.
#[derive(Debug, PartialEq, Eq)]
pub struct Merge {
    pub wait: Vec<u32>,
    pub into: u32,
}

pub struct EventBook {
    pool: Arc<dyn EventPool>,
    free: Vec<u32>,
    blocks: HashMap<GroupId, BlockEvents>,
}

impl EventBook {
    pub fn new(pool: Arc<dyn EventPool>) -> EventBook {
        let free = (1..=pool.len()).rev().collect();
        EventBook {
            pool,
            free,
            blocks: HashMap::new(),
        }
    }

    pub fn pool(&self) -> &Arc<dyn EventPool> {
        &self.pool
    }

    fn take(&mut self) -> Result<u32, Exhausted> {
        self.free.pop().ok_or(Exhausted(self.pool.len()))
    }

    /// A new block of `group` replaces the `evicted` ones.
    pub fn place(&mut self, group: GroupId, evicted: &[GroupId]) -> Result<CopyEvents, Exhausted> {
        let mut wait = Vec::new();
        for e in evicted {
            if let Some(b) = self.blocks.remove(e) {
                // Nobody waits on an evicted block's ready event any more: reusable now.
                self.free.push(b.ready);
                wait.extend(b.frees);
            }
        }
        let ready = match self.take() {
            Ok(r) => r,
            Err(e) => {
                self.free.extend(&wait);
                return Err(e);
            }
        };
        self.blocks.insert(
            group,
            BlockEvents {
                ready,
                frees: Vec::new(),
            },
        );
        Ok(CopyEvents { ready, wait })
    }

    /// (ready, free) events for a new ticket on `group`'s block.
    pub fn ticket(&mut self, group: GroupId) -> Result<(u32, u32), Exhausted> {
        let ready = self.blocks.get(&group).map_or(0, |b| b.ready);
        Ok((ready, self.take()?))
    }

    /// A ticket's free event was recorded; returns a merge to queue when the block has
    /// collected enough of them (and no slot is left to merge into, it just keeps them).
    pub fn release(&mut self, group: GroupId, free: u32) -> Option<Merge> {
        let len = self.blocks.get(&group)?.frees.len();
        if len + 1 < MERGE_AT {
            self.blocks.get_mut(&group)?.frees.push(free);
            return None;
        }
        let Ok(into) = self.take() else {
            self.blocks.get_mut(&group)?.frees.push(free);
            return None;
        };
        let block = self.blocks.get_mut(&group)?;
        let mut wait = std::mem::replace(&mut block.frees, vec![into]);
        wait.push(free);
        Some(Merge { wait, into })
    }

    /// A block whose copy failed or was cancelled.
    pub fn forget(&mut self, group: GroupId) {
        if let Some(b) = self.blocks.remove(&group) {
            self.free.push(b.ready);
            self.free.extend(b.frees);
        }
    }

    /// Slots whose waits are queued now.
    pub fn give_back(&mut self, slots: &[u32]) {
        self.free.extend_from_slice(slots);
    }

    pub fn available(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Pool(u32);
    impl EventPool for Pool {
        fn len(&self) -> u32 {
            self.0
        }
        fn handles(&self) -> Vec<Vec<u8>> {
            Vec::new()
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn evicting_a_block_waits_on_its_tickets_free_events() {
        let mut book = EventBook::new(Arc::new(Pool(8)));
        let a = book.place(10, &[]).unwrap();
        assert_eq!(
            a,
            CopyEvents {
                ready: 1,
                wait: vec![]
            }
        );
        let (ready, f1) = book.ticket(10).unwrap();
        assert_eq!((ready, f1), (1, 2));
        let (_, f2) = book.ticket(10).unwrap();
        assert_eq!(book.release(10, f1), None);
        assert_eq!(book.release(10, f2), None);
        // Block 20 takes 10's space: waits on both tickets' free events.
        let b = book.place(20, &[10]).unwrap();
        assert_eq!(b.wait, vec![2, 3]);
        assert_eq!(b.ready, 1, "10's ready slot was free again");
        assert_eq!(book.available(), 5);
        book.give_back(&b.wait);
        assert_eq!(book.available(), 8 - 1);
    }

    #[test]
    fn many_releases_of_a_cached_block_are_merged() {
        let mut book = EventBook::new(Arc::new(Pool(16)));
        book.place(1, &[]).unwrap();
        let frees: Vec<u32> = (0..3).map(|_| book.ticket(1).unwrap().1).collect();
        assert_eq!(book.release(1, frees[0]), None);
        assert_eq!(book.release(1, frees[1]), None);
        let merge = book.release(1, frees[2]).unwrap();
        assert_eq!(merge.wait, frees);
        let evicting = book.place(2, &[1]).unwrap();
        assert_eq!(evicting.wait, vec![merge.into]);
    }

    #[test]
    fn exhaustion_is_an_error_not_a_panic() {
        let mut book = EventBook::new(Arc::new(Pool(2)));
        book.place(1, &[]).unwrap();
        book.ticket(1).unwrap();
        assert_eq!(book.ticket(1), Err(Exhausted(2)));
        assert_eq!(book.place(2, &[]), Err(Exhausted(2)));
    }
}
