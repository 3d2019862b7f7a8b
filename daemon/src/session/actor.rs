//! The session actor: one task that owns a session's tickets, staging arena, plan and events.
//! Commands come in from the client's stream, copy completions from the copy scheduler, and
//! control requests (attach, close) from the rest of the daemon; events go out to the client.
//! Acquire, release and plan handling live in `tickets`, copies and prefetch in `copies`.

mod copies;
mod grants;
#[cfg(test)]
mod tests;
mod tickets;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, watch};

use super::arena::StagingArena;
use super::events::EventBook;
use super::layout::GroupPlacement;
use super::pending::{Pending, PendingClock};
use super::plan::{GroupId, Plan};
use super::{
    AttachError, CloseReason, Command, Control, DrainDeadline, Event, FaultKind, GpuWaitReport,
    PassKind, SessionShared, SessionStats,
};
use crate::backend::{DeviceRegion, EventPool};
use crate::residency::{ResidencyRegistry, ResidentLease};
use crate::scheduler::{CopyOutcome, CopyScheduler, Priority};
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
    /// Every session's resident groups: a group another session keeps resident on this device
    /// is staged from there, within the device, instead of over the link.
    pub residents: Arc<ResidencyRegistry>,
    pub scheduler: Arc<CopyScheduler>,
    pub max_live_tickets: u32,
    pub max_waiting_grants: u32,
    pub max_plan_length: u32,
    pub prefetch_depth: usize,
    /// The session's interprocess events (CUDA); None on the host backend.
    pub events: Option<Arc<dyn EventPool>>,
    /// How long an event may wait for room on the client's stream before the session gives
    /// up on the client (`limits.client_send_timeout_secs`).
    pub send_timeout: Duration,
    /// During shutdown, sends wait no longer than the drain's deadline.
    pub drain: DrainDeadline,
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
    /// Grants of the client's own copies not answered yet, and where their answers arrive.
    granting: HashSet<u64>,
    grants_tx: mpsc::UnboundedSender<grants::GrantDone>,
    outbox: Vec<Event>,
    events: Option<EventBook>,
    pending_clock: PendingClock,
    /// The pass kind in force: the last one an acquire named.
    kind: PassKind,
}

/// The client's stream, once one is attached.
struct Client {
    inbound: mpsc::Receiver<Command>,
    outbound: mpsc::Sender<Event>,
}

/// Starts the actor; `on_finish` runs after teardown, before waiters are told.
pub fn spawn(
    parts: ActorParts,
    control: mpsc::UnboundedReceiver<Control>,
    finished: watch::Sender<bool>,
    on_finish: impl FnOnce() + Send + 'static,
) {
    let (done_tx, done_rx) = mpsc::unbounded_channel();
    let (grants_tx, grants_rx) = mpsc::unbounded_channel();
    // The largest group that is ever staged: those blocks go at multiples of its size.
    let slot = (parts.groups.iter().zip(&parts.resident_of))
        .filter(|(_, resident)| resident.is_none())
        .map(|(g, _)| g.nbytes)
        .max()
        .unwrap_or(0);
    let arena = StagingArena::new(parts.staging.size(), parts.alignment).with_slot(slot);
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
        granting: HashSet::new(),
        grants_tx,
        outbox: Vec::new(),
        events,
        pending_clock: PendingClock::new(Instant::now()),
        kind: PassKind::default(),
    };
    let span = tracing::info_span!("session", id = %actor.p.shared.id);
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            actor.run(control, done_rx, grants_rx).await;
            on_finish();
            let _ = finished.send(true);
        },
        span,
    ));
}

impl Actor {
    fn stats(&self) -> &SessionStats {
        &self.p.shared.stats
    }

    async fn run(
        mut self,
        mut control: mpsc::UnboundedReceiver<Control>,
        mut done_rx: mpsc::UnboundedReceiver<CopyDone>,
        mut grants_rx: mpsc::UnboundedReceiver<grants::GrantDone>,
    ) {
        // Dropped only after teardown: the client's stream ends once the session is gone.
        let mut client: Option<Client> = None;
        let reason = loop {
            tokio::select! {
                ctl = control.recv() => match ctl {
                    Some(Control::Attach { inbound, outbound, reply }) => {
                        if client.is_some() {
                            let id = self.p.shared.id.clone();
                            let _ = reply.send(Err(AttachError::AlreadyAttached(id)));
                        } else {
                            self.p.shared.attached.store(true, Ordering::Relaxed);
                            // Sent before the reply: whatever the edge puts on the stream once
                            // it has the reply comes after Attached. A new stream has room.
                            let id = self.p.shared.id.clone();
                            let _ = outbound.try_send(Event::Attached { session_id: id });
                            client = Some(Client { inbound, outbound });
                            let _ = reply.send(Ok(()));
                        }
                    }
                    Some(Control::Close(reason)) => break reason,
                    None => break CloseReason::Shutdown,
                },
                command = next_command(&mut client) => match command {
                    Some(command) => self.on_command(command),
                    None => break CloseReason::StreamEnded,
                },
                Some(done) = done_rx.recv() => self.on_copy_done(done),
                Some(granted) = grants_rx.recv() => self.on_granted(granted),
            }
            match self.flush(&client).await {
                Ok(()) => {}
                Err(Unsent::Closed) => break CloseReason::StreamEnded,
                Err(Unsent::Stalled) => {
                    tracing::warn!(
                        timeout_secs = self.p.send_timeout.as_secs(),
                        "client stopped reading its Run stream: the session ends"
                    );
                    break CloseReason::ClientStalled;
                }
                // The stop's deadline passed while the session waited for its client.
                Err(Unsent::Draining) => break CloseReason::Shutdown,
            }
        };
        if reason == CloseReason::Shutdown {
            self.outbox.push(Event::fault(
                0,
                FaultKind::ShuttingDown,
                "the daemon is stopping: the session is closed",
            ));
            let _ = self.flush(&client).await;
        }
        tracing::info!(?reason, "session closing");
        self.teardown(done_rx).await;
    }

    /// Sends what the outbox holds, each event bounded by the send timeout and the drain.
    async fn flush(&mut self, client: &Option<Client>) -> Result<(), Unsent> {
        let Some(client) = client else {
            return Ok(());
        };
        for event in std::mem::take(&mut self.outbox) {
            send(client, event, self.p.send_timeout, &mut self.p.drain).await?;
        }
        Ok(())
    }

    /// Queued copies are dropped, running ones finish; only then is memory given back (by
    /// dropping the parts), so no copy ever writes into freed memory.
    async fn teardown(mut self, mut done_rx: mpsc::UnboundedReceiver<CopyDone>) {
        if let Some(pending) = self.pending_clock.stop_all(Instant::now()) {
            self.stats().add_pending(pending);
        }
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

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Acquire {
                group,
                ticket,
                kind,
            } => self.on_acquire(group, ticket, kind),
            Command::Release { ticket } => self.on_release(ticket),
            Command::Plan { groups, kind } => {
                self.kind = kind.unwrap_or(self.kind);
                self.on_plan(groups)
            }
            Command::GpuWait(report) => self.on_gpu_wait(&report),
            Command::Grant {
                id,
                bytes,
                direction,
            } => self.on_grant(id, bytes, direction),
        }
        self.publish_counts();
    }

    fn publish_counts(&self) {
        let live = (self.tickets.len() + self.pending.len()) as u32;
        self.p.shared.live_tickets.store(live, Ordering::Relaxed);
        if let Some(plan) = &self.plan {
            let visited = &self.p.shared.stats.plan_entries_visited;
            visited.store(plan.work().entries, Ordering::Relaxed);
        }
    }

    fn fault(&mut self, ticket: u64, kind: FaultKind, message: impl Into<String>) {
        self.outbox.push(Event::fault(ticket, kind, message));
    }

    /// A live ticket ends in a fault: it is forgotten and its wait (if any) is over.
    fn drop_ticket(&mut self, ticket: u64, kind: FaultKind, message: impl Into<String>) {
        self.tickets.remove(&ticket);
        self.stop_waiting(ticket);
        self.fault(ticket, kind, message);
    }

    /// The client's report of its own waits; one that names more groups than the session has
    /// is refused whole.
    fn on_gpu_wait(&mut self, report: &GpuWaitReport) {
        let groups = self.stats().groups();
        if report.group_ns.len() > groups {
            let named = report.group_ns.len();
            let msg = format!(
                "gpu_wait.group_ns: {named} entries, more than the session's {groups} groups"
            );
            return self.fault(0, FaultKind::InvalidArgument, msg);
        }
        self.stats().record_gpu_wait(report, self.kind);
    }

    /// `ticket` waits for its Staged from now on.
    fn start_waiting(&mut self, ticket: u64, group: GroupId) {
        let charged = self.pending_clock.start(ticket, group, Instant::now());
        self.charge(charged);
    }

    fn stop_waiting(&mut self, ticket: u64) {
        let charged = self.pending_clock.stop(ticket, Instant::now());
        self.charge(charged);
    }

    fn charge(&self, pending: Option<Pending>) {
        if let Some(pending) = pending {
            self.stats().add_pending(pending);
        }
    }
}

/// Why an event did not reach the client's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unsent {
    /// The stream is gone (the client ended it, or its connection closed).
    Closed,
    /// The stream stayed full for the whole send timeout: the client stopped reading.
    Stalled,
    /// The stream stayed full until the drain's deadline.
    Draining,
}

/// Puts `event` on the client's stream: at once when there is room (the hot path: no timer),
/// else waiting at most `timeout`, and never past the drain's deadline. A session never blocks
/// for good on a client that stops reading.
async fn send(
    client: &Client,
    event: Event,
    timeout: Duration,
    drain: &mut DrainDeadline,
) -> Result<(), Unsent> {
    let event = match client.outbound.try_send(event) {
        Ok(()) => return Ok(()),
        Err(TrySendError::Closed(_)) => return Err(Unsent::Closed),
        Err(TrySendError::Full(event)) => event,
    };
    tokio::select! {
        sent = client.outbound.send(event) => sent.map_err(|_| Unsent::Closed),
        () = tokio::time::sleep(timeout) => Err(Unsent::Stalled),
        () = drain.reached() => Err(Unsent::Draining),
    }
}

async fn next_command(client: &mut Option<Client>) -> Option<Command> {
    match client {
        Some(client) => client.inbound.recv().await,
        None => std::future::pending().await,
    }
}
