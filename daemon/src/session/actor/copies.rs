//! Copies into the staging arena: queueing them, prefetch along the plan, and their ends.

use super::{Actor, CopyDone};
use crate::backend::{CopyJob, DeviceSlice};
use crate::scheduler::{CopyError, CopyOutcome, CopyRequest, Priority, TIMELINE, Work};
use crate::session::plan::GroupId;
use crate::session::{FaultKind, SessionStats};

impl Actor {
    /// Queues the copy of a freshly placed block (after the free events of the blocks it
    /// evicted). False when no event is left for it: the block is dropped again.
    pub(super) fn submit(
        &mut self,
        group: GroupId,
        offset: u64,
        priority: Priority,
        evicted: &[GroupId],
    ) -> bool {
        let layout = &self.p.groups[group as usize];
        let shared = &self.p.shared;
        let resident = (self.p.residents).region(&shared.model_id, shared.device, &layout.key);
        let mut job = match resident {
            // Resident for another session: the same bytes in the same layout, on the device.
            Some(region) => {
                let from = DeviceSlice {
                    region,
                    offset: 0,
                    len: layout.nbytes,
                };
                CopyJob::within(self.p.staging.clone(), from, offset)
            }
            None => {
                let spans = (layout.tensors.iter())
                    .map(|&(t, rel)| (self.p.model.slice(t), offset + rel))
                    .collect();
                CopyJob::copy(self.p.staging.clone(), spans)
            }
        };
        if let Some(book) = &mut self.events {
            match book.place(group, evicted) {
                Ok(ev) => {
                    job.events = Some(book.pool().clone());
                    job.record = Some(ev.ready);
                    job.wait = ev.wait;
                }
                Err(_) => {
                    self.arena.remove(group);
                    return false;
                }
            }
        }
        tracing::debug!(target: TIMELINE, session = self.p.shared.number, group, offset,
            ?priority, evicted = ?evicted, "copy submitted");
        if priority == Priority::Prefetch {
            self.prefetch_inflight += 1;
            SessionStats::bump(&self.p.shared.stats.prefetches, 1);
        }
        self.queue(group, priority, job);
        true
    }

    fn queue(&mut self, group: GroupId, priority: Priority, job: CopyJob) {
        let tx = self.done_tx.clone();
        let returns = job.wait.clone();
        self.inflight += 1;
        let shared = &self.p.shared;
        self.p.scheduler.submit(
            shared.device,
            CopyRequest {
                session: shared.number,
                tag: group,
                priority,
                work: Work::Copy(job),
                done: Box::new(move |outcome| {
                    let _ = tx.send(CopyDone {
                        group,
                        priority,
                        outcome,
                        returns,
                    });
                }),
            },
        );
    }

    /// Stages the plan's next groups into free space, never evicting what is needed sooner.
    pub(super) fn prefetch(&mut self) {
        let Some(plan) = &self.plan else { return };
        if !self.pending.is_empty() {
            return;
        }
        let mut chosen = Vec::new();
        // Each upcoming group once, soonest first (resident ones are not in the plan's view).
        // Once the groups needed up to here exceed the arena, no later group can be placed
        // without evicting one needed sooner (which prefetch never does): stop there. So a
        // message costs O(window log n), whatever the plan's length.
        let mut window = 0u64;
        for (distance, group) in plan.upcoming() {
            if self.prefetch_inflight + chosen.len() >= self.p.prefetch_depth {
                break;
            }
            // Each placement needs an event slot for its copy (see serve_pending).
            if self
                .events
                .as_ref()
                .is_some_and(|b| b.available() <= chosen.len())
            {
                break;
            }
            let len = self.p.groups[group as usize].nbytes;
            window += len;
            if window > self.arena.capacity() {
                break;
            }
            if self.arena.get(group).is_some() {
                continue;
            }
            match self
                .arena
                .place(group, len, |g| plan.next_use(g), Some(distance))
            {
                Ok(placement) => {
                    SessionStats::bump(
                        &self.p.shared.stats.evictions,
                        placement.evicted.len() as u64,
                    );
                    self.used.remove(&group);
                    chosen.push((group, placement));
                }
                Err(_) => break,
            }
        }
        let mut chosen = chosen.into_iter();
        for (group, placement) in chosen.by_ref() {
            if !self.submit(
                group,
                placement.offset,
                Priority::Prefetch,
                &placement.evicted,
            ) {
                break;
            }
        }
        // Out of events: blocks placed but not queued must not stay "copying" forever.
        for (group, _) in chosen {
            self.arena.remove(group);
        }
    }

    pub(super) fn on_copy_done(&mut self, done: CopyDone) {
        tracing::debug!(target: TIMELINE, session = self.p.shared.number, group = done.group,
            "copy queued");
        self.inflight -= 1;
        if let Some(book) = &mut self.events {
            book.give_back(&done.returns);
        }
        if done.priority == Priority::Prefetch {
            self.prefetch_inflight -= 1;
        }
        self.on_group_copied(done.group, done.outcome);
        self.serve_pending();
        self.prefetch();
        self.publish_counts();
    }

    fn on_group_copied(&mut self, group: GroupId, outcome: CopyOutcome) {
        let waiters = self.waiting.remove(&group).unwrap_or_default();
        match outcome.result {
            Ok(()) => {
                let stats = self.stats();
                SessionStats::bump(&stats.copies, 1);
                SessionStats::bump(&stats.bytes_copied, outcome.bytes);
                SessionStats::bump(&stats.kind(self.kind).bytes_copied, outcome.bytes);
                SessionStats::bump(&stats.bytes_from_device, outcome.from_device);
                self.arena.mark_valid(group);
                let offset = self.arena.get(group).map_or(0, |b| b.offset);
                for ticket in waiters {
                    self.mark_staged(ticket, offset);
                }
            }
            Err(e) => {
                self.arena.remove(group);
                self.used.remove(&group);
                if let Some(book) = &mut self.events {
                    book.forget(group);
                }
                if !matches!(e, CopyError::Cancelled) {
                    tracing::error!(group, error = %e, "copy failed");
                }
                for ticket in waiters {
                    let message = format!("acquire: copy of group {group} failed: {e}");
                    self.drop_ticket(ticket, FaultKind::Internal, message);
                }
            }
        }
    }
}
