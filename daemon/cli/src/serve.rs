//! `weightstream serve`: the daemon. Under systemd (`Type=notify`) it reports READY=1 once
//! the socket is bound and the backend is up, and STOPPING=1 when a signal starts shutdown.
//! A stop ends within `drain_timeout_secs` + 2 s: exit 0 when everything drained, 1 (with
//! what was abandoned) when the stop had to give up on something stuck.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use bytesize::ByteSize;
use sd_notify::NotifyState;
use tokio::signal::unix::{SignalKind, signal};

use weightstream_daemon::config::{ConfigFile, Rate};

use super::{Backend, CliResult};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (see deploy/config.example.toml); flags override it.
    #[arg(long, env = "WEIGHTSTREAM_CONFIG")]
    config: Option<PathBuf>,
    /// Which backend to run.
    #[arg(long, env = "WEIGHTSTREAM_BACKEND")]
    backend: Option<Backend>,
    /// Copies a session may have queued ahead of its client.
    #[arg(long, env = "WEIGHTSTREAM_PREFETCH_DEPTH")]
    prefetch_depth: Option<u32>,
    /// Largest gRPC message accepted (e.g. 16MiB).
    #[arg(long, env = "WEIGHTSTREAM_MAX_MESSAGE_BYTES")]
    max_message_bytes: Option<ByteSize>,
    /// Host-to-device bytes per second each device's copies may use, e.g. 25GB/s (a PCIe
    /// Gen4 x16 link, emulated), 25GiB/s, or bytes per second; at least 100MB/s.
    #[arg(long, env = "WEIGHTSTREAM_COPY_BANDWIDTH_LIMIT", value_parser = parse_rate)]
    copy_bandwidth_limit: Option<Rate>,
    /// Group that owns the socket (name or gid): the trainers' access list.
    #[arg(long, env = "WEIGHTSTREAM_SOCKET_GROUP")]
    socket_group: Option<String>,
    /// Seconds shutdown waits for connections once sessions are closed.
    #[arg(long, env = "WEIGHTSTREAM_DRAIN_TIMEOUT_SECS")]
    drain_timeout_secs: Option<u64>,
    /// Serve Prometheus metrics (on 127.0.0.1:9464 unless --metrics-listen says otherwise).
    #[arg(long, env = "WEIGHTSTREAM_METRICS", num_args = 0..=1, default_missing_value = "true")]
    metrics: Option<bool>,
    /// Address:port for the metrics endpoint; turns metrics on.
    #[arg(long, env = "WEIGHTSTREAM_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Test hook: start a blocking task that never returns (as a load stuck in a read would),
    /// so that tests can see a stop give up on it and exit 1 naming it.
    #[arg(long, hide = true, env = "WEIGHTSTREAM_TEST_STUCK_TASK")]
    test_stuck_task: bool,
}

pub async fn run(socket: Option<PathBuf>, args: ServeArgs) -> CliResult {
    let mut config = match &args.config {
        Some(path) => ConfigFile::from_file(path)?,
        None => ConfigFile::default(),
    };
    if let Some(s) = socket {
        config.socket = s;
    }
    if let Some(b) = args.backend {
        config.backend = b.into();
    }
    if let Some(p) = args.prefetch_depth {
        config.prefetch_depth = p;
    }
    if let Some(m) = args.max_message_bytes {
        config.limits.max_message_bytes = m.as_u64();
    }
    if let Some(r) = args.copy_bandwidth_limit {
        config.copy_bandwidth_limit = Some(r);
    }
    if let Some(g) = args.socket_group {
        config.socket_group = Some(g);
    }
    if let Some(t) = args.drain_timeout_secs {
        config.drain_timeout_secs = t;
    }
    if let Some(on) = args.metrics {
        config.metrics.enabled = on;
    }
    if let Some(listen) = args.metrics_listen {
        config.metrics.listen = listen;
        config.metrics.enabled = true;
    }
    let config = config.validate()?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let handle = weightstream_daemon::server::start(config).await?;
    if args.test_stuck_task {
        handle
            .blocking
            .spawn("test hook: a task that never returns", || {
                loop {
                    std::thread::park();
                }
            });
    }
    notify(&[NotifyState::Ready, NotifyState::Status("serving")]);
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = int.recv() => tracing::info!("SIGINT: stopping"),
    }
    notify(&[NotifyState::Stopping, NotifyState::Status("draining")]);
    let report = handle.stop().await?;
    if report.drained() {
        Ok(())
    } else {
        Err(format!("the stop abandoned work: {}", report.abandoned()).into())
    }
}

fn parse_rate(text: &str) -> Result<Rate, String> {
    text.parse()
}

/// Tells systemd (when `NOTIFY_SOCKET` is set; a no-op otherwise). A failure is logged, not
/// fatal: the daemon serves either way, and systemd reports a unit that never got READY.
fn notify(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}
