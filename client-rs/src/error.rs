//! The client's one error type.

use std::path::PathBuf;

use crate::handoff::HandoffError;
use crate::proto;
use crate::socket::{self, ResolvedSocket};
use crate::sources::SourceError;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon cannot be reached (not running, wrong socket, or it went away); `reason`
    /// says why and what to do.
    #[error("cannot reach the weightstream daemon at {}: {reason}", socket.display())]
    Unavailable { socket: PathBuf, reason: String },
    /// The daemon refused a request; the message names the field and the limit. Paths that
    /// do not resolve to safetensors files are refused by the client itself, before sending,
    /// with the code and the `paths: …` message the daemon used to give.
    #[error("{code:?}: {message}")]
    Rejected { code: tonic::Code, message: String },
    /// Passing file descriptors through the daemon's handoff socket failed.
    #[error(transparent)]
    Handoff(#[from] HandoffError),
    /// The daemon refused one acquire or release of a session.
    #[error("ticket {ticket}: {code:?}: {message}")]
    Fault {
        ticket: u64,
        code: proto::FaultCode,
        message: String,
    },
    /// The session's stream ended (closed, daemon stopped, or the session was torn down).
    #[error("session ended: {0}")]
    SessionEnded(String),
    /// Mapping a region the daemon passed failed (out of memory or address space).
    #[error("{what}: mmap: {source}")]
    Map {
        what: String,
        source: std::io::Error,
    },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("protocol: {0}")]
    Protocol(String),
}

impl ClientError {
    pub(crate) fn from_status(socket: &ResolvedSocket, status: tonic::Status) -> ClientError {
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unknown if is_transport(&status) => {
                ClientError::Unavailable {
                    socket: socket.path.clone(),
                    reason: match io_cause(&status) {
                        Some(io) => socket.unreachable(io),
                        None => status.message().to_string(),
                    },
                }
            }
            code => ClientError::Rejected {
                code,
                message: status.message().to_string(),
            },
        }
    }

    /// The gRPC code of a rejection, if it was one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Rejected { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<SourceError> for ClientError {
    fn from(e: SourceError) -> ClientError {
        let message = match e {
            SourceError::Empty => e.to_string(),
            _ => format!("paths: {e}"),
        };
        ClientError::Rejected {
            code: e.code(),
            message,
        }
    }
}

/// A transport failure (as opposed to a status the daemon sent on purpose).
fn is_transport(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unknown || std::error::Error::source(status).is_some() || {
        let m = status.message();
        m.contains("transport") || m.contains("connect") || m.contains("broken pipe")
    }
}

/// The error of a connection to `socket` that failed with `e`: from the OS error in its
/// chain when there is one (no such socket, refused, permission denied), said once.
pub(crate) fn unreachable(
    socket: &ResolvedSocket,
    e: &(dyn std::error::Error + 'static),
) -> ClientError {
    ClientError::Unavailable {
        socket: socket.path.clone(),
        reason: match io_cause(e) {
            Some(io) => match io
                .get_ref()
                .and_then(|c| c.downcast_ref::<socket::Refused>())
            {
                Some(refused) => refused.0.clone(),
                None => socket.unreachable(io),
            },
            None => source_chain(e),
        },
    }
}

/// The first OS error among `e` and its sources.
fn io_cause<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a std::io::Error> {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        cause = c.source();
    }
    None
}

/// An error and its sources, each said once: a source whose text its error already holds
/// (transport errors repeat their cause) is left out.
pub(crate) fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let said = s.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that says its source's text itself, as transport errors do, or not.
    #[derive(Debug)]
    struct Wrapping {
        says_source: bool,
        source: std::io::Error,
    }

    impl std::fmt::Display for Wrapping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self.says_source {
                true => write!(f, "connect: {}", self.source),
                false => write!(f, "connect"),
            }
        }
    }

    impl std::error::Error for Wrapping {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    #[test]
    fn a_source_the_error_already_says_is_not_said_again() {
        let chain = |says_source| {
            source_chain(&Wrapping {
                says_source,
                source: std::io::Error::other("broken pipe"),
            })
        };
        assert_eq!(chain(true), "connect: broken pipe");
        assert_eq!(chain(false), "connect: broken pipe");
    }
}
