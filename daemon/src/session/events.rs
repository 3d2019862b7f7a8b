//! Which interprocess event means what (CUDA backend): each staged block has a *ready* event
//! (recorded by the daemon after its copy), each ticket a *free* event (recorded by the client
//! after its last read, before it sends Release). A copy into reused space runs only after the
//! free events of the blocks it evicts are complete; only then are their slots handed out
//! again. A cached block drops the free events that are already complete as new ones arrive,
//! so a block reused for many steps holds few slots.

use std::collections::HashMap;
use std::sync::Arc;

use super::plan::GroupId;
use crate::backend::EventPool;

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

    /// A ticket's free event was recorded: the block keeps it, and gives back the slots of
    /// its earlier free events that are complete.
    pub fn release(&mut self, group: GroupId, free: u32) {
        let Some(block) = self.blocks.get_mut(&group) else {
            self.free.push(free);
            return;
        };
        let pool = &self.pool;
        let (done, pending): (Vec<u32>, Vec<u32>) =
            block.frees.drain(..).partition(|&f| pool.is_complete(f));
        block.frees = pending;
        block.frees.push(free);
        self.free.extend(done);
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

    /// A pool whose complete events are listed in the mutex.
    struct Pool(u32, std::sync::Mutex<Vec<u32>>);
    impl EventPool for Pool {
        fn len(&self) -> u32 {
            self.0
        }
        fn handles(&self) -> Vec<Vec<u8>> {
            Vec::new()
        }
        fn is_complete(&self, index: u32) -> bool {
            self.1.lock().unwrap().contains(&index)
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn evicting_a_block_waits_on_its_tickets_free_events() {
        let mut book = EventBook::new(Arc::new(Pool(8, Default::default())));
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
        book.release(10, f1);
        book.release(10, f2);
        // Block 20 takes 10's space: waits on both tickets' free events.
        let b = book.place(20, &[10]).unwrap();
        assert_eq!(b.wait, vec![2, 3]);
        assert_eq!(b.ready, 1, "10's ready slot was free again");
        assert_eq!(book.available(), 5);
        book.give_back(&b.wait);
        assert_eq!(book.available(), 8 - 1);
    }

    #[test]
    fn a_cached_block_keeps_only_pending_free_events() {
        let pool = Arc::new(Pool(16, std::sync::Mutex::new(vec![])));
        let mut book = EventBook::new(pool.clone());
        book.place(1, &[]).unwrap();
        let frees: Vec<u32> = (0..3).map(|_| book.ticket(1).unwrap().1).collect();
        book.release(1, frees[0]);
        book.release(1, frees[1]);
        // The first two reads are done; the third is still running.
        *pool.1.lock().unwrap() = vec![frees[0], frees[1]];
        book.release(1, frees[2]);
        let evicting = book.place(2, &[1]).unwrap();
        assert_eq!(evicting.wait, vec![frees[2]]);
        assert_eq!(book.available(), 16 - 2);
    }

    #[test]
    fn exhaustion_is_an_error_not_a_panic() {
        let mut book = EventBook::new(Arc::new(Pool(2, Default::default())));
        book.place(1, &[]).unwrap();
        book.ticket(1).unwrap();
        assert_eq!(book.ticket(1), Err(Exhausted(2)));
        assert_eq!(book.place(2, &[]), Err(Exhausted(2)));
    }
}
