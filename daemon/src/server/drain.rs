//! Stopping, in order, within a bounded time. A [`Signal`] asks for the stop (dropping it asks
//! too: a server whose handle is gone stops). From the request on: health NOT_SERVING, no new
//! session, every session closed (its client told why) and no session waiting on its client
//! past the drain's deadline (`drain_timeout`); the server stops taking connections once the
//! sessions are gone, and the open ones get until that deadline to end before they are cut.
//! A second after it, the stop gives up on sessions not torn down and copy threads still
//! running; the cleanup (store, sockets, shared memory) is bounded too, and the whole drain by
//! [`HARD_DEADLINE_AFTER_DRAIN`]. What it gave up on is in the [`StopReport`].

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, timeout_at};
use tonic_health::server::HealthReporter;

use super::blocking::BlockingTasks;
use super::bootstrap::BoundSocket;
use super::conn::Connections;
use super::error::ServeError;
use super::handoff::HandoffServer;
use super::serve::Api;
use crate::core::Daemon;
use crate::metrics::MetricsServer;

/// After the drain's deadline: how long sessions, copy threads and cut connections get to end.
const GIVE_UP_AFTER_DRAIN: Duration = Duration::from_secs(1);
/// After the drain's deadline: by then the cleanup is done or abandoned.
const CLEANUP_AFTER_DRAIN: Duration = Duration::from_millis(1500);
/// After the drain's deadline: the stop is over, whatever is still stuck.
pub const HARD_DEADLINE_AFTER_DRAIN: Duration = Duration::from_secs(2);

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

/// What a stop had to give up on; all empty when everything drained.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopReport {
    /// Connections still open at the drain's deadline, cut then.
    pub connections_cut: usize,
    /// Sessions not torn down a second after the deadline (their memory was still in use).
    pub sessions_left: Vec<String>,
    /// Copy threads still inside a copy then.
    pub copy_threads_left: usize,
    /// Blocking tasks (loads, commits, the store's cleanup) still running at the end.
    pub blocking_left: Vec<String>,
    /// The drain itself did not end by its hard deadline.
    pub overran: bool,
}

impl StopReport {
    /// Whether the stop finished everything it had to.
    pub fn drained(&self) -> bool {
        *self == StopReport::default()
    }

    /// What was abandoned, in words ("" when nothing was).
    pub fn abandoned(&self) -> String {
        let mut parts = Vec::new();
        if self.connections_cut > 0 {
            parts.push(format!(
                "{} connection(s) still open at the drain deadline, cut",
                self.connections_cut
            ));
        }
        if !self.sessions_left.is_empty() {
            parts.push(format!(
                "sessions not torn down: {}",
                self.sessions_left.join(", ")
            ));
        }
        if self.copy_threads_left > 0 {
            parts.push(format!(
                "{} copy thread(s) still inside a copy",
                self.copy_threads_left
            ));
        }
        if !self.blocking_left.is_empty() {
            parts.push(format!(
                "blocking tasks still running: {}",
                self.blocking_left.join("; ")
            ));
        }
        if self.overran {
            parts.push("the drain did not end by drain_timeout + 2 s".into());
        }
        parts.join("; ")
    }
}

/// Resolves when the server should stop accepting: the sessions are closed by then (or the
/// drain's deadline passed).
pub(super) type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What the drain needs to stop the daemon and clean up after it.
pub(super) struct Drain {
    pub daemon: Arc<Daemon>,
    pub health: HealthReporter,
    pub timeout: Duration,
    pub metrics: Option<MetricsServer>,
    pub socket: BoundSocket,
    pub handoff: HandoffServer,
    pub connections: Arc<Connections>,
    pub blocking: BlockingTasks,
}

impl Drain {
    /// Runs the server that `serve` makes from its shutdown future until it ends, or until the
    /// drain's deadline (`timeout` after the stop request); then gives up on what is stuck and
    /// cleans up, each step bounded.
    pub(super) async fn run<S>(
        self,
        stop: Watch,
        serve: impl FnOnce(Shutdown) -> S,
    ) -> Result<StopReport, ServeError>
    where
        S: Future<Output = Result<(), ServeError>>,
    {
        let deadline = Arc::new(OnceLock::<Instant>::new());
        let (begun_tx, begun_rx) = oneshot::channel::<Instant>();
        let (daemon, health, timeout) = (self.daemon.clone(), self.health.clone(), self.timeout);
        let set = deadline.clone();
        let shutdown: Shutdown = Box::pin(async move {
            stop.stopped().await;
            let drain_deadline = *set.get_or_init(|| Instant::now() + timeout);
            let _ = begun_tx.send(drain_deadline);
            tracing::info!(
                drain_timeout_secs = timeout.as_secs(),
                "stopping: closing sessions"
            );
            health.set_not_serving::<Api>().await;
            daemon.stop_sessions(drain_deadline);
            // Clients read their session's Fault before the server stops taking requests.
            let _ = daemon.sessions_closed(drain_deadline).await;
        });
        let reached = async move {
            match begun_rx.await {
                Ok(at) => tokio::time::sleep_until(at).await,
                // The server ended without a stop request: nothing to bound.
                Err(_) => std::future::pending().await,
            }
        };
        let mut report = StopReport::default();
        let result = tokio::select! {
            r = serve(shutdown) => r,
            () = reached => {
                report.connections_cut = self.connections.cut();
                tracing::warn!(
                    secs = timeout.as_secs(),
                    connections = report.connections_cut,
                    "drain timeout: cutting the connections still open"
                );
                Ok(())
            }
        };
        let drain_deadline = match deadline.get() {
            Some(at) => *at,
            // The server ended by itself (an error): close the sessions now, no drain.
            None => {
                let now = *deadline.get_or_init(Instant::now);
                self.daemon.stop_sessions(now);
                now
            }
        };
        let give_up = drain_deadline + GIVE_UP_AFTER_DRAIN;
        if report.connections_cut > 0 {
            let _ = timeout_at(give_up, self.connections.all_closed()).await;
        }
        // Sessions of cut connections close now too (their connection's drop closes them).
        report.sessions_left = self.daemon.sessions_closed(give_up).await;
        report.copy_threads_left = self.daemon.stop_copies(give_up).await;
        let blocking = self.blocking.clone();
        self.cleanup(drain_deadline + CLEANUP_AFTER_DRAIN).await;
        report.blocking_left = blocking.running();
        if report.drained() {
            tracing::info!("stopped: everything drained");
        } else {
            tracing::warn!(abandoned = %report.abandoned(), "stopped, giving up on work still stuck");
        }
        result.map(|()| report)
    }

    async fn cleanup(self, until: Instant) {
        if let Some(m) = self.metrics {
            let _ = timeout_at(until, m.stop()).await;
        }
        self.handoff.stop();
        // A load stuck in a read may hold the store's lock: clear it off the async threads,
        // and go on without it when it does not finish in time.
        let daemon = self.daemon.clone();
        let cleared = self
            .blocking
            .spawn("clearing the store", move || daemon.store.clear());
        let _ = timeout_at(until, cleared).await;
        self.socket.release();
        // Memfds leave nothing on the box; one still open here goes with the process.
        let left = self.daemon.shm.total();
        if left > 0 {
            tracing::warn!(left, "shared memory still held at exit");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_names_everything_abandoned_and_nothing_when_drained() {
        assert!(StopReport::default().drained());
        assert_eq!(StopReport::default().abandoned(), "");
        let report = StopReport {
            connections_cut: 2,
            sessions_left: vec!["s-1".into(), "s-4".into()],
            copy_threads_left: 1,
            blocking_left: vec!["LoadModel of /m.safetensors for uid 1000".into()],
            overran: false,
        };
        assert!(!report.drained());
        assert_eq!(
            report.abandoned(),
            "2 connection(s) still open at the drain deadline, cut; sessions not torn down: \
             s-1, s-4; 1 copy thread(s) still inside a copy; blocking tasks still running: \
             LoadModel of /m.safetensors for uid 1000"
        );
    }
}
