//! `weightstream serve`: the daemon. Under systemd (`Type=notify`) it reports READY=1 once
//! the socket is bound and the backend is up, and STOPPING=1 when a signal starts shutdown.
//! A stop ends within `drain_timeout_secs` + 2 s: exit 0 when everything drained, 1 (with
//! what was abandoned) when the stop had to give up on something stuck.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use bytesize::ByteSize;
use sd_notify::NotifyState;
use tokio::signal::unix::{SignalKind, signal};

use clap::ArgMatches;
use clap::parser::ValueSource;
use weightstream_daemon::config::{ConfigFile, DEFAULT_METRICS_LISTEN, Rate};

use super::{Backend, CliResult};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (every key: deploy/config.example.toml). The flags and
    /// environment variables set here override it; the defaults shown apply where neither
    /// sets a value.
    #[arg(long, env = "WEIGHTSTREAM_CONFIG")]
    config: Option<PathBuf>,
    /// Which backend to run: auto picks CUDA when a driver and a device are present, else host.
    #[arg(long, env = "WEIGHTSTREAM_BACKEND", default_value = "auto")]
    backend: Backend,
    /// Copies a session may have queued ahead of its client (1 to 1024).
    #[arg(long, env = "WEIGHTSTREAM_PREFETCH_DEPTH",
          default_value_t = ConfigFile::default().prefetch_depth)]
    prefetch_depth: u32,
    /// Largest gRPC message accepted, e.g. 16MiB (4 KiB to 1 GiB).
    #[arg(long, env = "WEIGHTSTREAM_MAX_MESSAGE_BYTES", default_value = "16MiB")]
    max_message_bytes: ByteSize,
    /// Host-to-device bytes per second each device's copies may use, e.g. 25GB/s (a PCIe
    /// Gen4 x16 link, emulated), 25GiB/s, or bytes per second; at least 100MB/s. Default: no
    /// limit.
    #[arg(long, env = "WEIGHTSTREAM_COPY_BANDWIDTH_LIMIT", value_parser = parse_rate)]
    copy_bandwidth_limit: Option<Rate>,
    /// Group that owns the socket (name or gid): the trainers' access list. Default: the
    /// daemon's own group.
    #[arg(long, env = "WEIGHTSTREAM_SOCKET_GROUP")]
    socket_group: Option<String>,
    /// On SIGTERM or SIGINT: seconds, counted from the signal, for sessions to close and
    /// connections to finish before they are cut (0 to 3600); 2 s later the daemon gives up on
    /// whatever is still stuck and exits 1, naming it.
    #[arg(long, env = "WEIGHTSTREAM_DRAIN_TIMEOUT_SECS",
          default_value_t = ConfigFile::default().drain_timeout_secs)]
    drain_timeout_secs: u64,
    /// Serve Prometheus metrics at http://ADDRESS:PORT/metrics, the address of
    /// --metrics-listen (`--metrics` alone means true).
    #[arg(long, env = "WEIGHTSTREAM_METRICS", num_args = 0..=1, default_value_t = false,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    metrics: bool,
    /// Address:port of the metrics endpoint; setting it turns metrics on.
    #[arg(long, env = "WEIGHTSTREAM_METRICS_LISTEN", default_value = DEFAULT_METRICS_LISTEN)]
    metrics_listen: String,
    /// Test hook: start a blocking task that never returns (as a load stuck in a read would),
    /// so that tests can see a stop give up on it and exit 1 naming it.
    #[arg(long, hide = true, env = "WEIGHTSTREAM_TEST_STUCK_TASK")]
    test_stuck_task: bool,
}

/// Which of `serve`'s values the user set (a flag or its environment variable) rather than
/// left to clap's defaults: only those override the config file.
pub struct Given<'a>(Option<&'a ArgMatches>);

impl<'a> Given<'a> {
    pub fn new(matches: Option<&'a ArgMatches>) -> Given<'a> {
        Given(matches)
    }

    fn set(&self, id: &str) -> bool {
        let source = self.0.and_then(|m| m.value_source(id));
        matches!(
            source,
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    }
}

/// The config file (or the defaults) with what the user set over it.
fn configure(socket: Option<PathBuf>, args: &ServeArgs, given: &Given) -> CliResult<ConfigFile> {
    let mut config = match &args.config {
        Some(path) => ConfigFile::from_file(path)?,
        None => ConfigFile::default(),
    };
    if let Some(s) = socket {
        config.socket = Some(s);
    }
    if given.set("backend") {
        config.backend = args.backend.into();
    }
    if given.set("prefetch_depth") {
        config.prefetch_depth = args.prefetch_depth;
    }
    if given.set("max_message_bytes") {
        config.limits.max_message_bytes = args.max_message_bytes.as_u64();
    }
    if let Some(r) = args.copy_bandwidth_limit {
        config.copy_bandwidth_limit = Some(r);
    }
    if let Some(g) = &args.socket_group {
        config.socket_group = Some(g.clone());
    }
    if given.set("drain_timeout_secs") {
        config.drain_timeout_secs = args.drain_timeout_secs;
    }
    if given.set("metrics") {
        config.metrics.enabled = args.metrics;
    }
    if given.set("metrics_listen") {
        config.metrics.listen = args.metrics_listen.clone();
        config.metrics.enabled = true;
    }
    Ok(config)
}

pub async fn run(socket: Option<PathBuf>, args: ServeArgs, given: Given<'_>) -> CliResult {
    let config = configure(socket, &args, &given)?.validate()?;
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches, Parser};

    use super::*;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    /// `serve` with `argv`, applied to the config file `toml` as `run` applies it.
    fn configured(argv: &[&str], toml: Option<&str>) -> ConfigFile {
        let dir = tempfile::tempdir().unwrap();
        let mut argv: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
        if let Some(text) = toml {
            let path = dir.path().join("config.toml");
            std::fs::write(&path, text).unwrap();
            argv.extend(["--config".into(), path.display().to_string()]);
        }
        let matches = Serve::command()
            .try_get_matches_from(std::iter::once("serve".to_string()).chain(argv))
            .unwrap();
        let args = Serve::from_arg_matches(&matches).unwrap().args;
        configure(None, &args, &Given::new(Some(&matches))).unwrap()
    }

    #[test]
    fn the_defaults_shown_are_the_config_file_s() {
        // Every value the help shows as a default is the one the daemon runs with.
        assert_eq!(configured(&[], None), ConfigFile::default());
        let matches = Serve::command().try_get_matches_from(["serve"]).unwrap();
        let shown = Serve::from_arg_matches(&matches).unwrap().args;
        let config = ConfigFile::default();
        assert_eq!(
            weightstream_daemon::config::BackendChoice::from(shown.backend),
            config.backend
        );
        assert_eq!(shown.prefetch_depth, config.prefetch_depth);
        assert_eq!(
            shown.max_message_bytes.as_u64(),
            config.limits.max_message_bytes
        );
        assert_eq!(shown.drain_timeout_secs, config.drain_timeout_secs);
        assert_eq!(shown.metrics, config.metrics.enabled);
        assert_eq!(shown.metrics_listen, config.metrics.listen);
    }

    #[test]
    fn defaults_leave_the_config_file_alone_and_flags_override_it() {
        let file = "prefetch_depth = 64\ndrain_timeout_secs = 30\nbackend = \"host\"\n\
                    [limits]\nmax_message_bytes = \"64MiB\"\n[metrics]\nenabled = true\n";
        let kept = configured(&[], Some(file));
        assert_eq!(kept.prefetch_depth, 64);
        assert_eq!(kept.drain_timeout_secs, 30);
        assert_eq!(kept.limits.max_message_bytes, 64 << 20);
        assert!(kept.metrics.enabled);
        let flags = [
            "--prefetch-depth",
            "8",
            "--drain-timeout-secs",
            "5",
            "--max-message-bytes",
            "32MiB",
            "--metrics=false",
        ];
        let overridden = configured(&flags, Some(file));
        assert_eq!(overridden.prefetch_depth, 8);
        assert_eq!(overridden.drain_timeout_secs, 5);
        assert_eq!(overridden.limits.max_message_bytes, 32 << 20);
        assert!(!overridden.metrics.enabled);
        let listen = configured(&["--metrics-listen", "127.0.0.1:9999"], None);
        assert!(listen.metrics.enabled);
        assert_eq!(listen.metrics.listen, "127.0.0.1:9999");
    }
}
