//! Sessions: one trainer process on one device, its staging arena, its plan and its tickets.
//!
//! Each session is an actor (one tokio task) that owns all of its mutable state; the client's
//! commands, copy completions and control requests reach it as messages, so the hot path takes
//! no locks. It speaks `Command` in and `Event` out: the wire is the edge's business
//! (`server::run`). What other requests need to read (statistics, identity) lives in
//! `SessionShared`.

mod actor;
pub mod arena;
pub mod events;
pub mod layout;
mod messages;
pub mod pending;
pub mod plan;
mod stats;

use std::sync::atomic::{AtomicBool, AtomicU32};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, watch};

pub use self::actor::{ActorParts, spawn};
pub use self::messages::{AttachError, Command, Direction, Event, FaultKind};
pub use self::stats::{
    GpuWaitReport, KindSnapshot, KindStats, PassKind, SessionStats, StatsSnapshot,
};

/// Why a session ends, as its client is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    ClientClosed,
    ConnectionClosed,
    StreamEnded,
    /// The client left events unread on its stream for longer than the send timeout.
    ClientStalled,
    Shutdown,
}

/// When the daemon's drain must be over: none while it serves. A session never waits for its
/// client past it (see `actor::send`).
#[derive(Debug, Clone)]
pub struct DrainDeadline(watch::Receiver<Option<tokio::time::Instant>>);

impl DrainDeadline {
    /// The deadline's setter (the daemon's, at stop) and its readers.
    pub fn channel() -> (watch::Sender<Option<tokio::time::Instant>>, DrainDeadline) {
        let (tx, rx) = watch::channel(None);
        (tx, DrainDeadline(rx))
    }

    /// Resolves once a deadline is set and has passed; never when none is ever set.
    pub async fn reached(&mut self) {
        let set = self.0.wait_for(Option::is_some).await.map(|d| *d);
        let Ok(Some(deadline)) = set else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until(deadline).await;
    }
}

pub enum Control {
    /// A client stream: its commands arrive on `inbound` (closed: the stream ended), the
    /// session's events go out on `outbound` (the Attached event first).
    Attach {
        inbound: mpsc::Receiver<Command>,
        outbound: mpsc::Sender<Event>,
        reply: oneshot::Sender<Result<(), AttachError>>,
    },
    Close(CloseReason),
}

/// What the rest of the daemon sees of a session.
pub struct SessionShared {
    pub id: String,
    /// Numeric id for the copy scheduler's lanes.
    pub number: u64,
    pub model_id: String,
    pub device: usize,
    pub device_uuid: String,
    pub label: String,
    pub vram_budget: u64,
    pub staging_bytes: u64,
    pub resident_bytes: u64,
    pub created: Instant,
    pub stats: SessionStats,
    pub attached: AtomicBool,
    pub plan_len: AtomicU32,
    pub live_tickets: AtomicU32,
    pub control: mpsc::UnboundedSender<Control>,
    pub finished: watch::Receiver<bool>,
}

impl SessionShared {
    /// The largest grant (CopyGrant) the session may ask for: the daemon's largest, within the
    /// device bytes the session is charged for (what a grant may cost the others is paid for).
    pub fn max_grant_bytes(&self) -> u64 {
        crate::scheduler::MAX_GRANT_BYTES.min(self.staging_bytes + self.resident_bytes)
    }

    /// Asks the session to end and waits until its teardown is complete.
    pub async fn close(&self, reason: CloseReason) {
        self.request_close(reason);
        let mut finished = self.finished.clone();
        let _ = finished.wait_for(|done| *done).await;
    }

    /// Asks the session to end, without waiting for it.
    pub fn request_close(&self, reason: CloseReason) {
        let _ = self.control.send(Control::Close(reason));
    }
}
