//! The edge: the gRPC server on the Unix socket and the handoff socket beside it. `bootstrap`
//! prepares the box, `serve` runs the services, `handoff` passes fds, `drain` stops them in
//! order; `validate` turns requests into typed values, `status` maps every error to a gRPC
//! status, `convert` builds the wire's answers.

pub mod access;
mod bootstrap;
pub mod conn;
mod convert;
mod drain;
mod error;
mod handoff;
mod run;
mod serve;
mod service;
mod status;
pub mod validate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::task::JoinHandle;

pub use self::convert::{dtype_from_pb, dtype_to_pb};
pub use self::error::ServeError;
use crate::config::Config;
use crate::core::Daemon;

/// A running daemon.
pub struct ServerHandle {
    pub daemon: Arc<Daemon>,
    pub socket: PathBuf,
    /// Where `/metrics` is served, when enabled (the bound address: port 0 picks one).
    pub metrics: Option<SocketAddr>,
    stop: Option<drain::Signal>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl ServerHandle {
    /// Stops serving: sessions are closed (clients get a Fault), copies drain, shared memory
    /// is released and the sockets are removed.
    pub async fn stop(mut self) -> Result<(), ServeError> {
        if let Some(stop) = self.stop.take() {
            stop.stop();
        }
        self.wait().await
    }

    /// Waits until the server ends by itself (its stop was requested elsewhere).
    pub async fn wait(self) -> Result<(), ServeError> {
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
    let daemon = Daemon::new(config, boot.backend, boot.shm).map_err(ServeError::Start)?;
    let metrics = match metrics_listen {
        Some(addr) => Some(crate::metrics::serve(addr, daemon.clone()).await?),
        None => None,
    };
    let metrics_addr = metrics.as_ref().map(|m| m.addr);
    let (routes, health) = serve::routes(&daemon).await?;
    let handoff = handoff::serve(boot.handoff, daemon.clone())?;
    let (stop, stopped) = drain::channel();
    let drain = drain::Drain {
        daemon: daemon.clone(),
        health,
        timeout,
        metrics,
        socket: socket.clone(),
        handoff,
    };
    let (listener, d) = (boot.listener, daemon.clone());
    let task = tokio::spawn(drain.run(stopped, move |shutdown| {
        serve::serve(routes, listener, d, shutdown)
    }));
    tracing::info!(socket = %socket.display(), "serving");
    Ok(ServerHandle {
        daemon,
        socket,
        metrics: metrics_addr,
        stop: Some(stop),
        task,
    })
}
