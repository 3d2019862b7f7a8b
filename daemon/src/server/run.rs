//! The `Run` stream: the one place where the wire meets a session. Its first message attaches
//! the stream to a session; after that each client message becomes a session `Command`, and
//! each session `Event` a server message. Problems of the protocol itself (a second attach, an
//! empty message) are answered here, as faults on the stream, and never reach the session.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use weightstream_proto::v1 as pb;
use weightstream_proto::v1::client_message::Msg;
use weightstream_proto::v1::server_message::Msg as Out;

use super::error::EdgeError;
use super::status::{attach_status, status_of};
use crate::core::{Daemon, Peer};
use crate::session::{Command, Control, Direction, Event, FaultKind, GpuWaitReport, PassKind};

/// What the client reads from its `Run` call.
pub type ServerStream = Pin<Box<dyn Stream<Item = Result<pb::ServerMessage, Status>> + Send>>;

/// Events waiting for the client to read them; the session waits when they pile up.
const EVENTS_BUFFERED: usize = 1024;
/// Commands read ahead of the session.
const COMMANDS_BUFFERED: usize = 64;

/// Attaches the stream to the session its first message names (which `peer` must own), then
/// runs the stream until the client or the session ends it.
pub async fn run(
    daemon: &Daemon,
    peer: Peer,
    mut inbound: Streaming<pb::ClientMessage>,
) -> Result<ServerStream, Status> {
    // A stream that never attaches must not hold its handler (and connection) forever.
    let wait = daemon.config.limits.attach_timeout();
    let first = tokio::time::timeout(wait, inbound.message())
        .await
        .map_err(|_| EdgeError::NoAttach {
            secs: wait.as_secs(),
        })??
        .and_then(|m| m.msg);
    let Some(Msg::Attach(attach)) = first else {
        return Err(Status::failed_precondition(
            "Run: the first message must be attach{session_id}",
        ));
    };
    let session = daemon
        .owned_session(&peer, &attach.session_id)
        .map_err(|e| status_of(&e))?;
    let (commands, commands_rx) = mpsc::channel(COMMANDS_BUFFERED);
    let (events, events_rx) = mpsc::channel(EVENTS_BUFFERED);
    let (reply, replied) = oneshot::channel();
    let gone = || Status::not_found(format!("session_id '{}' has ended", attach.session_id));
    session
        .control
        .send(Control::Attach {
            inbound: commands_rx,
            outbound: events.clone(),
            reply,
        })
        .map_err(|_| gone())?;
    replied
        .await
        .map_err(|_| gone())?
        .map_err(|e| attach_status(&e))?;
    let span = tracing::info_span!("session", id = %session.id);
    tokio::spawn(tracing::Instrument::instrument(
        forward(inbound, commands, events),
        span,
    ));
    let outbound = ReceiverStream::new(events_rx).map(|event| Ok(server_message(event)));
    Ok(Box::pin(outbound))
}

/// Reads the client's messages into the session until either side ends. Ending drops
/// `commands` (the session sees its stream end) and `events` (once the session has dropped its
/// own sender too, the client's stream ends).
async fn forward(
    mut inbound: Streaming<pb::ClientMessage>,
    commands: mpsc::Sender<Command>,
    events: mpsc::Sender<Event>,
) {
    loop {
        let message = tokio::select! {
            // The session ended: stop reading, and let go of the client's stream.
            () = commands.closed() => return,
            message = inbound.message() => message,
        };
        let message = match message {
            Ok(Some(message)) => message,
            Ok(None) => return,
            Err(status) => {
                tracing::debug!(%status, "run stream failed");
                return;
            }
        };
        let sent = match command(message) {
            Ok(command) => commands.send(command).await.is_ok(),
            Err(fault) => tokio::select! {
                () = commands.closed() => false,
                sent = events.send(fault) => sent.is_ok(),
            },
        };
        if !sent {
            return;
        }
    }
}

/// A message's pass kind (None: unspecified), or the fault that refuses an unknown one.
fn pass_kind(value: i32, field: &str, ticket: u64) -> Result<Option<PassKind>, Event> {
    match pb::PassKind::try_from(value) {
        Ok(pb::PassKind::Unspecified) => Ok(None),
        Ok(pb::PassKind::Train) => Ok(Some(PassKind::Train)),
        Ok(pb::PassKind::Sample) => Ok(Some(PassKind::Sample)),
        Err(_) => Err(Event::fault(
            ticket,
            FaultKind::InvalidArgument,
            format!("{field}: {value} is not a known pass kind (0 unspecified, 1 train, 2 sample)"),
        )),
    }
}

/// The session command a client message asks for, or the fault that answers a message the
/// protocol does not allow once attached.
fn command(message: pb::ClientMessage) -> Result<Command, Event> {
    match message.msg {
        Some(Msg::Acquire(a)) => Ok(Command::Acquire {
            group: a.group,
            ticket: a.ticket,
            kind: pass_kind(a.kind, "acquire.kind", a.ticket)?,
        }),
        Some(Msg::Release(r)) => Ok(Command::Release { ticket: r.ticket }),
        Some(Msg::Plan(plan)) => Ok(Command::Plan {
            kind: pass_kind(plan.kind, "plan.kind", 0)?,
            groups: plan.groups,
        }),
        // Checked against the session's groups by the session, which knows them.
        Some(Msg::GpuWait(w)) => Ok(Command::GpuWait(GpuWaitReport {
            total_ns: w.total_ns,
            waits: w.waits,
            group_ns: w.group_ns,
        })),
        // Checked against the session's budget and its waiting grants by the session.
        Some(Msg::Grant(g)) => {
            let direction = match pb::CopyDirection::try_from(g.direction) {
                Ok(pb::CopyDirection::HostToDevice) => Direction::ToDevice,
                Ok(pb::CopyDirection::DeviceToHost) => Direction::FromDevice,
                Err(_) => {
                    return Err(Event::fault(
                        0,
                        FaultKind::InvalidArgument,
                        format!(
                            "grant.direction: {} is not a known direction \
                             (COPY_DIRECTION_HOST_TO_DEVICE = 0, COPY_DIRECTION_DEVICE_TO_HOST = 1)",
                            g.direction
                        ),
                    ));
                }
            };
            Ok(Command::Grant {
                id: g.id,
                bytes: g.bytes,
                direction,
            })
        }
        Some(Msg::Attach(_)) => Err(Event::fault(
            0,
            FaultKind::FailedPrecondition,
            "attach: the stream is already attached",
        )),
        None => Err(Event::fault(
            0,
            FaultKind::InvalidArgument,
            "msg: empty client message",
        )),
    }
}

fn server_message(event: Event) -> pb::ServerMessage {
    let msg = match event {
        Event::Attached { session_id } => Out::Attached(pb::Attached { session_id }),
        Event::Staged {
            ticket,
            region,
            offset,
            ready_event,
            free_event,
        } => Out::Staged(pb::Staged {
            ticket,
            region,
            offset,
            ready_event,
            free_event,
        }),
        Event::Granted { id } => Out::Granted(pb::Granted { id }),
        Event::Fault {
            ticket,
            kind,
            message,
        } => Out::Fault(pb::Fault {
            ticket,
            code: fault_code(kind) as i32,
            message,
        }),
    };
    pb::ServerMessage { msg: Some(msg) }
}

fn fault_code(kind: FaultKind) -> pb::FaultCode {
    match kind {
        FaultKind::InvalidArgument => pb::FaultCode::FaultInvalidArgument,
        FaultKind::NotFound => pb::FaultCode::FaultNotFound,
        FaultKind::FailedPrecondition => pb::FaultCode::FaultFailedPrecondition,
        FaultKind::ResourceExhausted => pb::FaultCode::FaultResourceExhausted,
        FaultKind::Internal => pb::FaultCode::FaultInternal,
        FaultKind::ShuttingDown => pb::FaultCode::FaultShuttingDown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(msg: Option<Msg>) -> pb::ClientMessage {
        pb::ClientMessage { msg }
    }

    #[test]
    fn protocol_problems_are_answered_at_the_edge_with_exact_messages() {
        let cases = [
            (
                message(Some(Msg::Attach(pb::Attach {
                    session_id: "s-1".into(),
                }))),
                Event::fault(
                    0,
                    FaultKind::FailedPrecondition,
                    "attach: the stream is already attached",
                ),
            ),
            (
                message(None),
                Event::fault(0, FaultKind::InvalidArgument, "msg: empty client message"),
            ),
            (
                message(Some(Msg::Acquire(pb::Acquire {
                    group: 1,
                    ticket: 9,
                    kind: 7,
                }))),
                Event::fault(
                    9,
                    FaultKind::InvalidArgument,
                    "acquire.kind: 7 is not a known pass kind (0 unspecified, 1 train, 2 sample)",
                ),
            ),
            (
                message(Some(Msg::Plan(pb::Plan {
                    groups: vec![0],
                    kind: -1,
                }))),
                Event::fault(
                    0,
                    FaultKind::InvalidArgument,
                    "plan.kind: -1 is not a known pass kind (0 unspecified, 1 train, 2 sample)",
                ),
            ),
        ];
        let failures: Vec<String> = cases
            .into_iter()
            .filter_map(|(m, want)| {
                let got = command(m.clone());
                (got != Err(want.clone())).then(|| format!("{m:?}: got {got:?}, want {want:?}"))
            })
            .collect();
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn every_fault_kind_has_its_own_code() {
        use FaultKind::*;
        let kinds = [
            InvalidArgument,
            NotFound,
            FailedPrecondition,
            ResourceExhausted,
            Internal,
            ShuttingDown,
        ];
        let mut codes: Vec<i32> = kinds.iter().map(|k| fault_code(*k) as i32).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), kinds.len());
        assert!(!codes.contains(&(pb::FaultCode::FaultUnspecified as i32)));
    }
}
