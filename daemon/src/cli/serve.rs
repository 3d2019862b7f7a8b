//! `weightstream serve`: the daemon.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use bytesize::ByteSize;
use tokio::signal::unix::{SignalKind, signal};

use super::CliResult;
use crate::config::{BackendChoice, Config};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (see deploy/config.example.toml); flags override it.
    #[arg(long, env = "WEIGHTSTREAM_CONFIG")]
    config: Option<PathBuf>,
    /// Which backend to run.
    #[arg(long, env = "WEIGHTSTREAM_BACKEND")]
    backend: Option<BackendChoice>,
    /// Directory for shared-memory segments.
    #[arg(long, env = "WEIGHTSTREAM_SHM_DIR")]
    shm_dir: Option<PathBuf>,
    /// Copies a session may have queued ahead of its client.
    #[arg(long, env = "WEIGHTSTREAM_PREFETCH_DEPTH")]
    prefetch_depth: Option<u32>,
    /// Largest gRPC message accepted (e.g. 16MiB).
    #[arg(long, env = "WEIGHTSTREAM_MAX_MESSAGE_BYTES")]
    max_message_bytes: Option<ByteSize>,
}

pub async fn run(socket: Option<PathBuf>, args: ServeArgs) -> CliResult {
    let mut config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    if let Some(s) = socket {
        config.socket = s;
    }
    if let Some(b) = args.backend {
        config.backend = b;
    }
    if let Some(d) = args.shm_dir {
        config.shm_dir = d;
    }
    if let Some(p) = args.prefetch_depth {
        config.prefetch_depth = p;
    }
    if let Some(m) = args.max_message_bytes {
        config.limits.max_message_bytes = m;
    }
    config.validate()?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let handle = crate::server::start(config).await?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
    handle.stop().await?;
    Ok(())
}
