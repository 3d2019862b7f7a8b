//! What a session hears and says: commands in, events out. The edge (`server::run`) turns the
//! wire's messages into these and back; the session knows nothing of the wire.

use super::plan::GroupId;
use super::stats::{GpuWaitReport, PassKind};

/// A request of the session's client, in the order the client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Place `group` for a new ticket (chosen by the client, unique among its live tickets);
    /// `kind`, when named, comes in force for this acquire and what follows it.
    Acquire {
        group: GroupId,
        ticket: u64,
        kind: Option<PassKind>,
    },
    /// The client is done reading the ticket's bytes.
    Release { ticket: u64 },
    /// The group acquisitions of one step, in order; `kind`, when named, comes in force
    /// before the plan's first prefetch.
    Plan {
        groups: Vec<GroupId>,
        kind: Option<PassKind>,
    },
    /// The client's own measure of its waits for weights (totals since the session opened).
    GpuWait(GpuWaitReport),
    /// The client asks to copy `bytes` of its own in `direction` (answered by `Granted`).
    Grant {
        id: u64,
        bytes: u64,
        direction: Direction,
    },
}

/// Which way a client's own copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    ToDevice,
    FromDevice,
}

/// What the session tells its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Attached {
        session_id: String,
    },
    /// The ticket's bytes are (or, once `ready_event` completes, will be) at `offset` of region
    /// `region` (0: the staging arena; 1 and up: resident regions).
    Staged {
        ticket: u64,
        region: u32,
        offset: u64,
        ready_event: u32,
        free_event: u32,
    },
    /// The client's grant `id` may copy now.
    Granted {
        id: u64,
    },
    /// A request failed; `ticket` is 0 when the fault concerns no ticket.
    Fault {
        ticket: u64,
        kind: FaultKind,
        message: String,
    },
}

/// Why a request failed, as the client is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    InvalidArgument,
    NotFound,
    FailedPrecondition,
    ResourceExhausted,
    Internal,
    ShuttingDown,
}

impl Event {
    pub fn fault(ticket: u64, kind: FaultKind, message: impl Into<String>) -> Event {
        Event::Fault {
            ticket,
            kind,
            message: message.into(),
        }
    }
}

/// Why a stream could not be attached to a session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    #[error("session_id '{0}' is already attached to a Run stream")]
    AlreadyAttached(String),
}
