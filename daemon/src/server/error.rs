//! The edge's own errors: [`ServeError`] (starting, serving, stopping) and [`EdgeError`] (a
//! request the edge could not handle through no fault of the request). Their gRPC statuses are
//! in status.rs.

use std::path::PathBuf;

/// Why the server could not start, or ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "another weightstream daemon holds {}{}: it is still running or draining",
        lock.display(),
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked { lock: PathBuf, pid: Option<u32> },
    #[error("{path}: {source}{}", socket_hint(source))]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The user's socket directory in /tmp is not this user's alone.
    #[error("{dir}: {why}: refusing it as the socket's directory (remove it, or pass --socket)")]
    SocketDir { dir: PathBuf, why: String },
    #[error("backend: {0}")]
    Backend(String),
    #[error("cannot start: {0}")]
    Start(std::io::Error),
    #[error("server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
}

/// What to do about a socket the daemon cannot make.
fn socket_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::PermissionDenied => {
            " (this user may not write there: name a socket in a directory you may write to, \
             or leave --socket out to listen on your own, $XDG_RUNTIME_DIR/weightstream.sock \
             or /tmp/weightstream-<uid>/weightstream.sock)"
        }
        _ => "",
    }
}

/// Faults of the edge itself, not of the request.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    /// The connection did not come through `conn::incoming`.
    #[error("connection without peer credentials")]
    NoPeer,
    #[error("{what} task failed: {source}")]
    Task {
        what: &'static str,
        source: tokio::task::JoinError,
    },
    /// A `Run` stream's first message (attach) did not come in time.
    #[error("Run: no attach within {secs} s")]
    NoAttach { secs: u64 },
}
