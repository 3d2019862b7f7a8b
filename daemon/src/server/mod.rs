//! The edge: the gRPC server on the Unix socket and the handoff socket beside it. `bootstrap`
//! prepares the box, `serve` runs the services, `handoff` passes fds, `drain` stops them in
//! order; `validate` turns requests into typed values, `status` maps every error to a gRPC
//! status, `convert` builds the wire's answers.

pub mod access;
pub mod blocking;
mod bootstrap;
pub mod conn;
mod convert;
mod drain;
mod error;
mod handoff;
// Gives freed heap memory back to the kernel: a libc call, so unsafe is allowed there.
#[allow(unsafe_code)]
mod heap;
mod run;
mod serve;
mod service;
// The one socket option rustix lacks (SO_PEERGROUPS): a libc call, so unsafe is allowed there.
#[allow(unsafe_code)]
mod sockopt;
mod status;
pub mod validate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use self::blocking::BlockingTasks;
pub use self::bootstrap::lock_path;
pub use self::convert::{dtype_from_pb, dtype_to_pb};
pub use self::drain::{HARD_DEADLINE_AFTER_DRAIN, StopReport};
pub use self::error::ServeError;
use crate::config::Config;
use crate::core::Daemon;

/// A running daemon.
pub struct ServerHandle {
    pub daemon: Arc<Daemon>,
    pub socket: PathBuf,
    /// Where `/metrics` is served, when enabled (the bound address: port 0 picks one).
    pub metrics: Option<SocketAddr>,
    /// The server's blocking work (loads, commits), by name.
    pub blocking: BlockingTasks,
    drain_timeout: Duration,
    stop: Option<drain::Signal>,
    task: JoinHandle<Result<StopReport, ServeError>>,
}

impl ServerHandle {
    /// Stops serving: sessions are closed (clients get a Fault), copies drain, shared memory
    /// and the sockets are removed. Returns within `drain_timeout` + 2 s, saying what it had
    /// to give up on.
    pub async fn stop(mut self) -> Result<StopReport, ServeError> {
        if let Some(stop) = self.stop.take() {
            stop.stop();
        }
        let hard = tokio::time::Instant::now() + self.drain_timeout + HARD_DEADLINE_AFTER_DRAIN;
        match tokio::time::timeout_at(hard, &mut self.task).await {
            Ok(ended) => ended.map_err(|e| ServeError::Start(std::io::Error::other(e)))?,
            Err(_) => {
                self.task.abort();
                let report = StopReport {
                    blocking_left: self.blocking.running(),
                    overran: true,
                    ..StopReport::default()
                };
                tracing::warn!(abandoned = %report.abandoned(), "the drain overran its deadline");
                Ok(report)
            }
        }
    }

    /// Waits until the server ends by itself (its stop was requested elsewhere).
    pub async fn wait(self) -> Result<StopReport, ServeError> {
        self.task
            .await
            .map_err(|e| ServeError::Start(std::io::Error::other(e)))?
    }
}

/// Prepares the box, binds the socket and starts serving in a background task.
pub async fn start(config: Config) -> Result<ServerHandle, ServeError> {
    let socket = config.socket.clone();
    let (timeout, metrics_listen) = (config.drain_timeout, config.metrics_listen);
    let boot = bootstrap::bootstrap(&config).await?;
    let connections = conn::Connections::new(config.limits.max_connections_per_uid);
    let daemon = Daemon::new(config, boot.backend, boot.shm).map_err(ServeError::Start)?;
    let metrics = match metrics_listen {
        Some(addr) => Some(crate::metrics::serve(addr, daemon.clone()).await?),
        None => None,
    };
    let metrics_addr = metrics.as_ref().map(|m| m.addr);
    let blocking = BlockingTasks::default();
    let (routes, health) = serve::routes(&daemon, &blocking).await?;
    let handoff = handoff::serve(boot.handoff, daemon.clone())?;
    let (stop, stopped) = drain::channel();
    let drain = drain::Drain {
        daemon: daemon.clone(),
        health,
        timeout,
        metrics,
        socket: boot.bound,
        handoff,
        connections: connections.clone(),
        blocking: blocking.clone(),
    };
    let (listener, d) = (boot.listener, daemon.clone());
    let task = tokio::spawn(drain.run(stopped, move |shutdown| {
        serve::serve(routes, listener, d, connections, shutdown)
    }));
    tracing::info!(socket = %socket.display(), "serving");
    Ok(ServerHandle {
        daemon,
        socket,
        metrics: metrics_addr,
        blocking,
        drain_timeout: timeout,
        stop: Some(stop),
        task,
    })
}
