//! Stopping, in order. A [`Signal`] asks for the stop (dropping it asks too: a server whose
//! handle is gone stops); the daemon then stops taking work (health NOT_SERVING, sessions
//! closed, their clients told why), open connections get `drain_timeout` to end before they
//! are cut, and what the daemon made on the box goes (store, sockets, shared memory).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tonic_health::server::HealthReporter;

use super::error::ServeError;
use super::handoff::HandoffServer;
use super::serve::Api;
use crate::core::Daemon;
use crate::metrics::MetricsServer;

/// A stop signal and the watch the server waits on.
pub fn channel() -> (Signal, Watch) {
    let (tx, rx) = watch::channel(false);
    (Signal(tx), Watch(rx))
}

/// Asks the server to stop.
#[derive(Debug)]
pub struct Signal(watch::Sender<bool>);

impl Signal {
    pub fn stop(self) {
        let _ = self.0.send(true);
    }
}

/// Resolves once the stop is asked for.
#[derive(Debug, Clone)]
pub struct Watch(watch::Receiver<bool>);

impl Watch {
    pub async fn stopped(mut self) {
        // An error means the signal was dropped: that asks for the stop as well.
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// Resolves when the server should stop accepting: the sessions are closed by then.
pub(super) type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What the drain needs to stop the daemon and clean up after it.
pub(super) struct Drain {
    pub daemon: Arc<Daemon>,
    pub health: HealthReporter,
    pub timeout: Duration,
    pub metrics: Option<MetricsServer>,
    pub socket: PathBuf,
    pub handoff: HandoffServer,
}

impl Drain {
    /// Runs the server that `serve` makes from its shutdown future until it ends, or until
    /// `timeout` after the sessions closed (counted from then, not from the stop request);
    /// then cleans up.
    pub(super) async fn run<S>(
        self,
        stop: Watch,
        serve: impl FnOnce(Shutdown) -> S,
    ) -> Result<(), ServeError>
    where
        S: Future<Output = Result<(), ServeError>>,
    {
        let (draining_tx, draining_rx) = oneshot::channel::<()>();
        let (daemon, health) = (self.daemon.clone(), self.health.clone());
        let shutdown: Shutdown = Box::pin(async move {
            stop.stopped().await;
            tracing::info!("stopping: closing sessions");
            health.set_not_serving::<Api>().await;
            daemon.shutdown().await;
            let _ = draining_tx.send(());
        });
        let timeout = self.timeout;
        let deadline = async move {
            match draining_rx.await {
                Ok(()) => tokio::time::sleep(timeout).await,
                // The server ended without a stop request: nothing to bound.
                Err(_) => std::future::pending().await,
            }
        };
        let result = tokio::select! {
            r = serve(shutdown) => r,
            () = deadline => {
                tracing::warn!(
                    secs = timeout.as_secs(),
                    "drain timeout: cutting the connections still open"
                );
                Ok(())
            }
        };
        self.cleanup().await;
        result
    }

    async fn cleanup(self) {
        if let Some(m) = self.metrics {
            m.stop().await;
        }
        self.handoff.stop();
        self.daemon.store.clear();
        let _ = std::fs::remove_file(&self.socket);
        // Memfds leave nothing on the box; one still open here goes with the process.
        let left = self.daemon.shm.total();
        if left > 0 {
            tracing::warn!(left, "shared memory still held at exit");
        }
        tracing::info!("stopped");
    }
}
