//! The client's one error type.

use std::path::{Path, PathBuf};

use crate::handoff::HandoffError;
use crate::proto;
use crate::sources::SourceError;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon cannot be reached (not running, wrong socket, or it went away).
    #[error(
        "cannot reach the weightstream daemon at {}: {reason} (is `weightstream serve` running? \
         WEIGHTSTREAM_SOCKET names another socket)",
        socket.display()
    )]
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
    pub(crate) fn from_status(socket: &Path, status: tonic::Status) -> ClientError {
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unknown if is_transport(&status) => {
                ClientError::Unavailable {
                    socket: socket.to_path_buf(),
                    reason: status.message().to_string(),
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

pub(crate) fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
