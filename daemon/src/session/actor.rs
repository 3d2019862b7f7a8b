//! The session actor: acquire, release and plan handling, prefetch, and teardown.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};
use weightstream_client::proto as pb;
use weightstream_client::proto::client_message::Msg;
use weightstream_client::proto::server_message::Msg as Out;

use super::arena::{AllocError, BlockState, StagingArena};
use super::events::EventBook;
use super::layout::GroupPlacement;
use super::plan::{CursorMove, GroupId, Plan};
use super::{CloseReason, Control, Outbound, SessionShared, SessionStats};
use crate::backend::{CopyJob, DeviceRegion, EventPool};
use crate::residency::ResidentLease;
use crate::scheduler::{CopyError, CopyOutcome, CopyRequest, CopyScheduler, Priority};
use crate::store::Model;

/// Everything a session actor starts with.
pub struct ActorParts {
    pub shared: Arc<SessionShared>,
    pub model: Arc<Model>,
    pub groups: Arc<Vec<GroupPlacement>>,
    pub staging: Arc<dyn DeviceRegion>,
    pub alignment: u64,
    pub resident: ResidentLease,
    /// Per group: (region index as the client numbers it, offset) when resident.
    pub resident_of: Vec<Option<(u32, u64)>>,
    pub scheduler: Arc<CopyScheduler>,
    pub max_live_tickets: u32,
    pub max_plan_length: u32,
    pub prefetch_depth: usize,
    /// The session's interprocess events (CUDA); None on the host backend.
    pub events: Option<Arc<dyn EventPool>>,
}

struct CopyDone {
    group: GroupId,
    priority: Priority,
    outcome: CopyOutcome,
    /// Event slots whose waits are now queued: free to hand out again.
    returns: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Resident,
    Staging,
}

struct Ticket {
    group: GroupId,
    place: Place,
    staged: bool,
    acquired: Instant,
    free_event: u32,
}

struct Actor {
    p: ActorParts,
    arena: StagingArena,
    plan: Option<Plan>,
    tickets: HashMap<u64, Ticket>,
    /// Tickets waiting for a copy of a group to finish.
    waiting: HashMap<GroupId, Vec<u64>>,
    /// Acquires waiting for staging space, in arrival order.
    pending: VecDeque<(u64, GroupId)>,
    /// Groups whose staged bytes a ticket has already used (a new acquire is then a reuse).
    used: HashSet<GroupId>,
    inflight: usize,
    prefetch_inflight: usize,
    done_tx: mpsc::UnboundedSender<CopyDone>,
    outbox: Vec<pb::ServerMessage>,
    events: Option<EventBook>,
}

/// Starts the actor; `on_finish` runs after teardown, before waiters are told.
pub fn spawn(
    parts: ActorParts,
    control: mpsc::UnboundedReceiver<Control>,
    finished: watch::Sender<bool>,
    on_finish: impl FnOnce() + Send + 'static,
) {
    let (done_tx, done_rx) = mpsc::unbounded_channel();
    let arena = StagingArena::new(parts.staging.size(), parts.alignment);
    let events = parts.events.clone().map(EventBook::new);
    let actor = Actor {
        p: parts,
        arena,
        plan: None,
        tickets: HashMap::new(),
        waiting: HashMap::new(),
        pending: VecDeque::new(),
        used: HashSet::new(),
        inflight: 0,
        prefetch_inflight: 0,
        done_tx,
        outbox: Vec::new(),
        events,
    };
    let span = tracing::info_span!("session", id = %actor.p.shared.id);
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            actor.run(control, done_rx).await;
            on_finish();
            let _ = finished.send(true);
        },
        span,
    ));
}

const EVENTS_EXHAUSTED: &str =
    "acquire: all interprocess events of the session are in use; release tickets first";

fn staged(ticket: u64, region: u32, offset: u64, events: (u32, u32)) -> pb::ServerMessage {
    pb::ServerMessage {
        msg: Some(Out::Staged(pb::Staged {
            ticket,
            region,
            offset,
            ready_event: events.0,
            free_event: events.1,
        })),
    }
}

fn fault(ticket: u64, code: pb::FaultCode, message: String) -> pb::ServerMessage {
    pb::ServerMessage {
        msg: Some(Out::Fault(pb::Fault {
            ticket,
            code: code as i32,
            message,
        })),
    }
}

impl Actor {
    fn stats(&self) -> &SessionStats {
        &self.p.shared.stats
    }

    async fn run(
        mut self,
        mut control: mpsc::UnboundedReceiver<Control>,
        mut done_rx: mpsc::UnboundedReceiver<CopyDone>,
    ) {
        let mut inbound: Option<Box<Streaming<pb::ClientMessage>>> = None;
        let mut outbound: Option<Outbound> = None;
        let reason = loop {
            tokio::select! {
                ctl = control.recv() => match ctl {
                    Some(Control::Attach { inbound: i, outbound: o, reply }) => {
                        if inbound.is_some() {
                            let _ = reply.send(Err(Status::failed_precondition(format!(
                                "session_id '{}' is already attached to a Run stream",
                                self.p.shared.id
                            ))));
                        } else {
                            self.p.shared.attached.store(true, Ordering::Relaxed);
                            self.outbox.push(pb::ServerMessage {
                                msg: Some(Out::Attached(pb::Attached {
                                    session_id: self.p.shared.id.clone(),
                                })),
                            });
                            inbound = Some(i);
                            outbound = Some(o);
                            let _ = reply.send(Ok(()));
                        }
                    }
                    Some(Control::Close(reason)) => break reason,
                    None => break CloseReason::Shutdown,
                },
                msg = next_message(&mut inbound) => match msg {
                    Some(Ok(m)) => self.on_message(m),
                    Some(Err(status)) => {
                        tracing::debug!(%status, "run stream failed");
                        break CloseReason::StreamEnded;
                    }
                    None => break CloseReason::StreamEnded,
                },
                Some(done) = done_rx.recv() => self.on_copy_done(done),
            }
            if !self.flush(&outbound).await {
                break CloseReason::StreamEnded;
            }
        };
        if reason == CloseReason::Shutdown {
            self.outbox.push(fault(
                0,
                pb::FaultCode::FaultShuttingDown,
                "the daemon is stopping: the session is closed".into(),
            ));
            self.flush(&outbound).await;
        }
        tracing::info!(?reason, "session closing");
        self.teardown(done_rx).await;
    }

    async fn flush(&mut self, outbound: &Option<Outbound>) -> bool {
        let Some(out) = outbound else {
            return true;
        };
        for msg in self.outbox.drain(..) {
            if out.send(Ok(msg)).await.is_err() {
                return false;
            }
        }
        true
    }

    /// Queued copies are dropped, running ones finish; only then is memory given back (by
    /// dropping the parts), so no copy ever writes into freed memory.
    async fn teardown(mut self, mut done_rx: mpsc::UnboundedReceiver<CopyDone>) {
        let number = self.p.shared.number;
        self.p
            .scheduler
            .cancel_session(self.p.shared.device, number);
        while self.inflight > 0 {
            match done_rx.recv().await {
                Some(_) => self.inflight -= 1,
                None => break,
            }
        }
        self.p.shared.live_tickets.store(0, Ordering::Relaxed);
    }

    fn on_message(&mut self, msg: pb::ClientMessage) {
        match msg.msg {
            Some(Msg::Acquire(a)) => self.on_acquire(a.group, a.ticket),
            Some(Msg::Release(r)) => self.on_release(r.ticket),
            Some(Msg::Plan(plan)) => self.on_plan(plan.groups),
            Some(Msg::Attach(_)) => self.outbox.push(fault(
                0,
                pb::FaultCode::FaultFailedPrecondition,
                "attach: the stream is already attached".into(),
            )),
            None => self.outbox.push(fault(
                0,
                pb::FaultCode::FaultInvalidArgument,
                "msg: empty client message".into(),
            )),
        }
        self.publish_counts();
    }

    fn publish_counts(&self) {
        let live = (self.tickets.len() + self.pending.len()) as u32;
        self.p.shared.live_tickets.store(live, Ordering::Relaxed);
    }

    fn check_acquire(&self, group: u32, ticket: u64) -> Result<(), (pb::FaultCode, String)> {
        use pb::FaultCode::*;
        let groups = self.p.groups.len();
        if ticket == 0 {
            return Err((FaultInvalidArgument, "acquire.ticket: 0 is reserved".into()));
        }
        if group as usize >= groups {
            let msg =
                format!("acquire.group {group} is out of range: the session has {groups} groups");
            return Err((FaultInvalidArgument, msg));
        }
        if self.tickets.contains_key(&ticket) || self.pending.iter().any(|(t, _)| *t == ticket) {
            return Err((
                FaultInvalidArgument,
                format!("acquire.ticket {ticket} is already live"),
            ));
        }
        let live = self.tickets.len() + self.pending.len();
        if live >= self.p.max_live_tickets as usize {
            let limit = self.p.max_live_tickets;
            let msg =
                format!("acquire: {live} live tickets, the limit is max_live_tickets = {limit}");
            return Err((FaultResourceExhausted, msg));
        }
        Ok(())
    }

    fn on_acquire(&mut self, group: GroupId, ticket: u64) {
        if let Err((code, message)) = self.check_acquire(group, ticket) {
            self.outbox.push(fault(ticket, code, message));
            return;
        }
        let stats = &self.p.shared.stats;
        SessionStats::bump(&stats.acquires, 1);
        if let Some(plan) = &mut self.plan
            && let CursorMove::Resync { .. } = plan.on_acquire(group)
        {
            SessionStats::bump(&stats.resyncs, 1);
        }
        let now = Instant::now();
        if let Some((region, offset)) = self.p.resident_of[group as usize] {
            SessionStats::bump(&stats.hits, 1);
            SessionStats::bump(&stats.resident_hits, 1);
            self.tickets.insert(
                ticket,
                Ticket {
                    group,
                    place: Place::Resident,
                    staged: true,
                    acquired: now,
                    free_event: 0,
                },
            );
            // Resident bytes were copied before the session opened: no events to order.
            self.outbox.push(staged(ticket, region, offset, (0, 0)));
            return;
        }
        self.tickets.insert(
            ticket,
            Ticket {
                group,
                place: Place::Staging,
                staged: false,
                acquired: now,
                free_event: 0,
            },
        );
        if self.arena.get(group).is_some() {
            SessionStats::bump(&stats.hits, 1);
            if !self.used.insert(group) {
                SessionStats::bump(&stats.reuses, 1);
            }
            self.join(ticket, group);
        } else {
            SessionStats::bump(&stats.misses, 1);
            self.pending.push_back((ticket, group));
            self.serve_pending();
        }
        self.prefetch();
    }

    /// Holds the group's block for `ticket`: staged now if valid, else when its copy ends.
    fn join(&mut self, ticket: u64, group: GroupId) {
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

    fn mark_staged(&mut self, ticket: u64, offset: u64) {
        let Some(t) = self.tickets.get_mut(&ticket) else {
            return;
        };
        let events = match &mut self.events {
            None => Ok((0, 0)),
            Some(book) => book.ticket(t.group),
        };
        match events {
            Ok(events) => {
                t.staged = true;
                t.free_event = events.1;
                let stall = t.acquired.elapsed().as_nanos() as u64;
                SessionStats::bump(&self.p.shared.stats.stall_ns, stall);
                self.outbox.push(staged(ticket, 0, offset, events));
            }
            Err(e) => {
                let group = t.group;
                self.tickets.remove(&ticket);
                self.arena.unhold(group);
                let message = format!("acquire: {e}; release tickets first");
                self.outbox.push(fault(
                    ticket,
                    pb::FaultCode::FaultResourceExhausted,
                    message,
                ));
            }
        }
    }

    /// Serves waiting acquires in order while space can be made for them.
    fn serve_pending(&mut self) {
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
                self.tickets.remove(&ticket);
                self.outbox.push(fault(
                    ticket,
                    pb::FaultCode::FaultResourceExhausted,
                    EVENTS_EXHAUSTED.into(),
                ));
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
                        self.tickets.remove(&ticket);
                        self.outbox.push(fault(
                            ticket,
                            pb::FaultCode::FaultResourceExhausted,
                            EVENTS_EXHAUSTED.into(),
                        ));
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
            self.tickets.remove(&ticket);
            let name = &self.p.groups[group as usize].name;
            let message = format!(
                "acquire: group '{name}' cannot be staged ({e}): the staging arena of {capacity} \
                 bytes has {held} bytes held by live tickets; release tickets before acquiring \
                 more, or open the session with a larger staging_bytes"
            );
            self.outbox.push(fault(
                ticket,
                pb::FaultCode::FaultResourceExhausted,
                message,
            ));
        }
    }

    /// Queues the copy of a freshly placed block (after the free events of the blocks it
    /// evicted). False when no event is left for it: the block is dropped again.
    fn submit(
        &mut self,
        group: GroupId,
        offset: u64,
        priority: Priority,
        evicted: &[GroupId],
    ) -> bool {
        let layout = &self.p.groups[group as usize];
        let spans = layout
            .tensors
            .iter()
            .map(|&(t, rel)| (self.p.model.slice(t), offset + rel))
            .collect();
        let mut job = CopyJob::copy(self.p.staging.clone(), spans);
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
                job,
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
    fn prefetch(&mut self) {
        let Some(plan) = &self.plan else { return };
        if !self.pending.is_empty() {
            return;
        }
        let mut chosen = Vec::new();
        // Once the distinct groups needed up to here exceed the arena, no later group can be
        // placed without evicting one needed sooner (which prefetch never does): stop, rather
        // than walk the whole plan on every message.
        let mut window = 0u64;
        let mut seen = HashSet::new();
        for (distance, group) in plan.upcoming(plan.len()) {
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
            if self.p.resident_of[group as usize].is_some() {
                continue;
            }
            let len = self.p.groups[group as usize].nbytes;
            if seen.insert(group) {
                window += len;
                if window > self.arena.capacity() {
                    break;
                }
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

    fn on_copy_done(&mut self, done: CopyDone) {
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
                    self.tickets.remove(&ticket);
                    let message = format!("acquire: copy of group {group} failed: {e}");
                    self.outbox
                        .push(fault(ticket, pb::FaultCode::FaultInternal, message));
                }
            }
        }
    }

    fn on_release(&mut self, ticket: u64) {
        let Some(t) = self.tickets.get(&ticket) else {
            let message = format!("release.ticket {ticket} is not a live ticket");
            self.outbox
                .push(fault(ticket, pb::FaultCode::FaultNotFound, message));
            return;
        };
        if !t.staged {
            let message =
                format!("release.ticket {ticket} was not staged yet: wait for its Staged");
            self.outbox.push(fault(
                ticket,
                pb::FaultCode::FaultFailedPrecondition,
                message,
            ));
            return;
        }
        let (group, place, free) = (t.group, t.place, t.free_event);
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

    fn on_plan(&mut self, groups: Vec<u32>) {
        let n = self.p.groups.len();
        let max = self.p.max_plan_length as usize;
        if groups.len() > max {
            let message = format!(
                "plan.groups: {} entries, the limit is max_plan_length = {max}",
                groups.len()
            );
            self.outbox
                .push(fault(0, pb::FaultCode::FaultInvalidArgument, message));
            return;
        }
        if let Some((i, g)) = groups.iter().enumerate().find(|(_, g)| **g as usize >= n) {
            let message =
                format!("plan.groups[{i}] = {g} is out of range: the session has {n} groups");
            self.outbox
                .push(fault(0, pb::FaultCode::FaultInvalidArgument, message));
            return;
        }
        self.p
            .shared
            .plan_len
            .store(groups.len() as u32, Ordering::Relaxed);
        self.plan = Some(Plan::new(groups));
        self.prefetch();
    }
}

async fn next_message(
    inbound: &mut Option<Box<Streaming<pb::ClientMessage>>>,
) -> Option<Result<pb::ClientMessage, Status>> {
    match inbound {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}
