//! Acquire, release and plan: tickets and the staging space they hold.

use std::sync::atomic::Ordering;

use super::{Actor, Place, Ticket};
use crate::scheduler::{Priority, TIMELINE};
use crate::session::arena::{AllocError, BlockState};
use crate::session::plan::{CursorMove, GroupId, Plan};
use crate::session::{Event, FaultKind, PassKind, SessionStats};

pub(super) const EVENTS_EXHAUSTED: &str =
    "acquire: all interprocess events of the session are in use; release tickets first";

impl Actor {
    fn check_acquire(&self, group: u32, ticket: u64) -> Result<(), (FaultKind, String)> {
        use FaultKind::*;
        let groups = self.p.groups.len();
        if ticket == 0 {
            return Err((InvalidArgument, "acquire.ticket: 0 is reserved".into()));
        }
        if group as usize >= groups {
            let msg =
                format!("acquire.group {group} is out of range: the session has {groups} groups");
            return Err((InvalidArgument, msg));
        }
        if self.tickets.contains_key(&ticket) || self.pending.iter().any(|(t, _)| *t == ticket) {
            return Err((
                InvalidArgument,
                format!("acquire.ticket {ticket} is already live"),
            ));
        }
        let live = self.tickets.len() + self.pending.len();
        if live >= self.p.max_live_tickets as usize {
            let limit = self.p.max_live_tickets;
            let msg =
                format!("acquire: {live} live tickets, the limit is max_live_tickets = {limit}");
            return Err((ResourceExhausted, msg));
        }
        Ok(())
    }

    pub(super) fn on_acquire(&mut self, group: GroupId, ticket: u64, kind: Option<PassKind>) {
        if let Err((kind, message)) = self.check_acquire(group, ticket) {
            return self.fault(ticket, kind, message);
        }
        self.kind = kind.unwrap_or(self.kind);
        let stats = &self.p.shared.stats;
        let part = stats.kind(self.kind);
        SessionStats::bump(&part.acquires, 1);
        tracing::debug!(target: TIMELINE, session = self.p.shared.number, group, ticket,
            state = ?self.arena.get(group).map(|b| b.state), "acquire");
        SessionStats::bump(&stats.acquires, 1);
        if let Some(plan) = &mut self.plan
            && let CursorMove::Resync { .. } = plan.on_acquire(group)
        {
            SessionStats::bump(&stats.resyncs, 1);
        }
        if let Some((region, offset)) = self.p.resident_of[group as usize] {
            SessionStats::bump(&stats.hits, 1);
            SessionStats::bump(&part.hits, 1);
            SessionStats::bump(&stats.resident_hits, 1);
            self.tickets.insert(
                ticket,
                Ticket {
                    group,
                    place: Place::Resident,
                    staged: true,
                    free_event: 0,
                },
            );
            // Resident bytes were copied before the session opened: no events to order.
            self.outbox.push(Event::Staged {
                ticket,
                region,
                offset,
                ready_event: 0,
                free_event: 0,
            });
            return;
        }
        self.tickets.insert(
            ticket,
            Ticket {
                group,
                place: Place::Staging,
                staged: false,
                free_event: 0,
            },
        );
        if self.arena.get(group).is_some() {
            SessionStats::bump(&stats.hits, 1);
            SessionStats::bump(&part.hits, 1);
            if !self.used.insert(group) {
                SessionStats::bump(&stats.reuses, 1);
            }
            self.join(ticket, group);
        } else {
            SessionStats::bump(&stats.misses, 1);
            SessionStats::bump(&part.misses, 1);
            self.pending.push_back((ticket, group));
            self.serve_pending();
        }
        if self.tickets.get(&ticket).is_some_and(|t| !t.staged) {
            self.start_waiting(ticket, group);
        }
        self.prefetch();
    }

    /// Holds the group's block for `ticket`: staged now if valid, else when its copy ends.
    pub(super) fn join(&mut self, ticket: u64, group: GroupId) {
        let offset = self.arena.hold(group).expect("caller checked presence");
        let state = self.arena.get(group).map(|b| b.state);
        if state == Some(BlockState::Valid) {
            self.mark_staged(ticket, offset);
        } else {
            self.waiting.entry(group).or_default().push(ticket);
            let shared = &self.p.shared;
            self.p
                .scheduler
                .promote(shared.device, shared.number, group);
        }
    }

    pub(super) fn mark_staged(&mut self, ticket: u64, offset: u64) {
        let Some(t) = self.tickets.get_mut(&ticket) else {
            return;
        };
        let events = match &mut self.events {
            None => Ok((0, 0)),
            Some(book) => book.ticket(t.group),
        };
        match events {
            Ok((ready_event, free_event)) => {
                tracing::debug!(target: TIMELINE, session = self.p.shared.number,
                    group = t.group, ticket, "staged");
                t.staged = true;
                t.free_event = free_event;
                self.stop_waiting(ticket);
                self.outbox.push(Event::Staged {
                    ticket,
                    region: 0,
                    offset,
                    ready_event,
                    free_event,
                });
            }
            Err(e) => {
                let group = t.group;
                self.arena.unhold(group);
                let message = format!("acquire: {e}; release tickets first");
                self.drop_ticket(ticket, FaultKind::ResourceExhausted, message);
            }
        }
    }

    /// Serves waiting acquires in order while space can be made for them.
    pub(super) fn serve_pending(&mut self) {
        while let Some(&(ticket, group)) = self.pending.front() {
            if self.arena.get(group).is_some() {
                self.pending.pop_front();
                self.used.insert(group);
                self.join(ticket, group);
                continue;
            }
            if self.events.as_ref().is_some_and(|b| b.available() == 0) {
                // Placing would evict blocks whose copy could then not be queued: wait for
                // the copies in flight to give event slots back, or tell the client.
                if self.inflight > 0 {
                    return;
                }
                self.pending.pop_front();
                self.drop_ticket(ticket, FaultKind::ResourceExhausted, EVENTS_EXHAUSTED);
                continue;
            }
            let len = self.p.groups[group as usize].nbytes;
            let placed = {
                let plan = &self.plan;
                self.arena.place(
                    group,
                    len,
                    |g| plan.as_ref().and_then(|p| p.next_use(g)),
                    None,
                )
            };
            match placed {
                Ok(placement) => {
                    self.pending.pop_front();
                    self.used.insert(group);
                    SessionStats::bump(
                        &self.p.shared.stats.evictions,
                        placement.evicted.len() as u64,
                    );
                    if self.submit(
                        group,
                        placement.offset,
                        Priority::Demand,
                        &placement.evicted,
                    ) {
                        self.join(ticket, group);
                    } else {
                        self.drop_ticket(ticket, FaultKind::ResourceExhausted, EVENTS_EXHAUSTED);
                    }
                }
                Err(AllocError::NoSpace { .. }) if self.inflight > 0 => return,
                Err(e) => return self.fail_pending(e),
            }
        }
    }

    /// Nothing in flight will free space: the client holds it all. Waiting would deadlock.
    fn fail_pending(&mut self, e: AllocError) {
        let capacity = self.arena.capacity();
        let held = self.arena.held_bytes();
        for (ticket, group) in std::mem::take(&mut self.pending) {
            let name = &self.p.groups[group as usize].name;
            let message = format!(
                "acquire: group '{name}' cannot be staged ({e}): the staging arena of {capacity} \
                 bytes has {held} bytes held by live tickets; release tickets before acquiring \
                 more, or open the session with a larger staging_bytes"
            );
            self.drop_ticket(ticket, FaultKind::ResourceExhausted, message);
        }
    }

    pub(super) fn on_release(&mut self, ticket: u64) {
        let Some(t) = self.tickets.get(&ticket) else {
            let message = format!("release.ticket {ticket} is not a live ticket");
            return self.fault(ticket, FaultKind::NotFound, message);
        };
        if !t.staged {
            let message =
                format!("release.ticket {ticket} was not staged yet: wait for its Staged");
            return self.fault(ticket, FaultKind::FailedPrecondition, message);
        }
        let (group, place, free) = (t.group, t.place, t.free_event);
        tracing::debug!(target: TIMELINE, session = self.p.shared.number, group, ticket, "release");
        self.tickets.remove(&ticket);
        if place == Place::Staging {
            self.arena.unhold(group);
            if let Some(book) = &mut self.events {
                book.release(group, free);
            }
        }
        SessionStats::bump(&self.stats().releases, 1);
        self.serve_pending();
        self.prefetch();
    }

    pub(super) fn on_plan(&mut self, groups: Vec<u32>) {
        let n = self.p.groups.len();
        let max = self.p.max_plan_length as usize;
        if groups.len() > max {
            let message = format!(
                "plan.groups: {} entries, the limit is max_plan_length = {max}",
                groups.len()
            );
            return self.fault(0, FaultKind::InvalidArgument, message);
        }
        if let Some((i, g)) = groups.iter().enumerate().find(|(_, g)| **g as usize >= n) {
            let message =
                format!("plan.groups[{i}] = {g} is out of range: the session has {n} groups");
            return self.fault(0, FaultKind::InvalidArgument, message);
        }
        self.p
            .shared
            .plan_len
            .store(groups.len() as u32, Ordering::Relaxed);
        // Resident groups are never staged: the plan's look-ahead skips them.
        let resident = &self.p.resident_of;
        self.plan = Some(Plan::ignoring(groups, |g| resident[g as usize].is_some()));
        self.prefetch();
    }
}
