//! The gRPC server on the Unix socket: start, serve, stop.
#![forbid(unsafe_code)]

pub mod access;
pub mod conn;
mod convert;
mod run;
mod service;
pub mod validate;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use weightstream_client::proto::FILE_DESCRIPTOR_SET;
use weightstream_client::proto::weight_stream_server::WeightStreamServer;

pub use self::convert::{dtype_from_pb, dtype_to_pb};
use crate::backend::Backend;
use crate::backend::cuda::CudaBackend;
use crate::backend::host::HostBackend;
use crate::config::{BackendChoice, Config};
use crate::core::Daemon;
use crate::mem::shm::ShmDir;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{path}: another daemon is serving this socket")]
    SocketInUse { path: PathBuf },
    #[error("{path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("backend: {0}")]
    Backend(String),
    #[error("cannot start: {0}")]
    Start(std::io::Error),
    #[error("server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("socket_group {group:?}: {why}")]
    SocketGroup { group: String, why: String },
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
}

/// A running daemon.
pub struct ServerHandle {
    pub daemon: Arc<Daemon>,
    pub socket: PathBuf,
    /// Where `/metrics` is served, when enabled (the bound address: port 0 picks one).
    pub metrics: Option<std::net::SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl ServerHandle {
    /// Stops serving: sessions are closed (clients get a Fault), copies drain, shared memory
    /// and the socket are removed.
    pub async fn stop(mut self) -> Result<(), ServeError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
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

/// Tells daemons on one box apart in /dev/shm: a hash of the socket path.
pub fn shm_tag(socket: &Path) -> String {
    blake3::hash(socket.as_os_str().as_encoded_bytes()).to_hex()[..8].to_string()
}

fn select_backend(
    choice: BackendChoice,
    shm: &Arc<ShmDir>,
) -> Result<Arc<dyn Backend>, ServeError> {
    match choice {
        BackendChoice::Host => {
            tracing::info!("backend: host (requested)");
            Ok(Arc::new(HostBackend::new(shm.clone())))
        }
        BackendChoice::Auto => match CudaBackend::new() {
            Ok(cuda) => {
                tracing::info!("backend: cuda (driver and device found)");
                Ok(Arc::new(cuda))
            }
            Err(why) => {
                tracing::info!("backend: host (CUDA unavailable: {why})");
                Ok(Arc::new(HostBackend::new(shm.clone())))
            }
        },
        BackendChoice::Cuda => {
            let cuda = CudaBackend::new()
                .map_err(|why| ServeError::Backend(format!("cuda was requested but {why}")))?;
            tracing::info!("backend: cuda (requested)");
            Ok(Arc::new(cuda))
        }
    }
}

/// The gid of `group`: a numeric gid, or a name looked up in /etc/group (the daemon forbids
/// unsafe code, so no getgrnam; groups from NSS-only sources can be given by number).
fn resolve_group(group: &str) -> Result<u32, ServeError> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let err = |why: String| ServeError::SocketGroup {
        group: group.to_string(),
        why,
    };
    let text =
        std::fs::read_to_string("/etc/group").map_err(|e| err(format!("/etc/group: {e}")))?;
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let gid = fields.nth(1)?.parse::<u32>().ok()?;
            (name == group).then_some(gid)
        })
        .next()
        .ok_or_else(|| err("no such group in /etc/group (give a numeric gid instead)".into()))
}

/// Removes a socket file no daemon answers on; refuses one a live daemon serves.
async fn claim_socket(path: &Path) -> Result<(), ServeError> {
    let io = |source| ServeError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).await.is_ok() {
                return Err(ServeError::SocketInUse {
                    path: path.to_path_buf(),
                });
            }
            std::fs::remove_file(path).map_err(io)
        }
        Ok(_) => Err(io(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "exists and is not a socket",
        ))),
        Err(_) => Ok(()),
    }
}

/// Binds the socket and starts serving in a background task.
pub async fn start(config: Config) -> Result<ServerHandle, ServeError> {
    let socket = config.socket.clone();
    claim_socket(&socket).await?;
    let socket_gid = config
        .socket_group
        .as_deref()
        .map(resolve_group)
        .transpose()?;
    // Shared memory belongs to the socket's group: exactly the peers who may connect map it.
    let shm = Arc::new(ShmDir::new(&config.shm_dir, &shm_tag(&socket)).with_group(socket_gid));
    let swept = shm.sweep();
    if swept > 0 {
        tracing::warn!(
            swept,
            prefix = shm.prefix(),
            "removed shared memory left by an earlier daemon"
        );
    }
    let backend = select_backend(config.backend, &shm)?;
    let listener = UnixListener::bind(&socket).map_err(|source| ServeError::Socket {
        path: socket.clone(),
        source,
    })?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o660)).map_err(
        |source| ServeError::Socket {
            path: socket.clone(),
            source,
        },
    )?;
    if let Some(gid) = socket_gid {
        std::os::unix::fs::chown(&socket, None, Some(gid)).map_err(|source| {
            ServeError::Socket {
                path: socket.clone(),
                source,
            }
        })?;
    }
    let drain = Duration::from_secs(config.drain_timeout_secs);
    let metrics_addr = config.metrics.address();
    let max_message = config.limits.max_message_bytes.as_u64() as usize;
    let daemon = Daemon::new(config, backend, shm).map_err(ServeError::Start)?;
    let metrics = match metrics_addr {
        Some(addr) => Some(crate::metrics::serve(addr, daemon.clone()).await?),
        None => None,
    };
    let metrics_bound = metrics.as_ref().map(|m| m.addr);
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<WeightStreamServer<service::Service>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let service = WeightStreamServer::new(service::Service::new(daemon.clone()))
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message);
    // Every call of the service passes the allow-lists first; health and reflection do not
    // (see access.rs).
    let service = tonic::service::interceptor::InterceptedService::new(
        service,
        access::AccessCheck::new(&daemon.config.access),
    );
    let (closed_tx, mut closed_rx) = mpsc::unbounded_channel::<u64>();
    let watcher = daemon.clone();
    tokio::spawn(async move {
        while let Some(conn) = closed_rx.recv().await {
            let d = watcher.clone();
            tokio::spawn(async move { d.connection_closed(conn).await });
        }
    });
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    // Sent once the sessions are closed: the drain deadline counts from then, not from start.
    let (draining_tx, draining_rx) = oneshot::channel::<()>();
    let d = daemon.clone();
    let path = socket.clone();
    let task = tokio::spawn(async move {
        let shutdown = {
            let d = d.clone();
            async move {
                let _ = stop_rx.await;
                tracing::info!("stopping: closing sessions");
                health
                    .set_not_serving::<WeightStreamServer<service::Service>>()
                    .await;
                d.shutdown().await;
                let _ = draining_tx.send(());
            }
        };
        let server = tonic::transport::Server::builder()
            // One span per request; the session actor adds its own per session. At warn level,
            // so that a warning (a refused peer) names its method under WEIGHTSTREAM_LOG=warn too.
            .trace_fn(|req| tracing::warn_span!("request", method = %req.uri().path()))
            .add_service(health_service)
            .add_service(reflection)
            .add_service(service)
            .serve_with_incoming_shutdown(conn::incoming(listener, closed_tx), shutdown);
        let deadline = async move {
            match draining_rx.await {
                Ok(()) => tokio::time::sleep(drain).await,
                // The server ended without a stop request: nothing to bound.
                Err(_) => std::future::pending().await,
            }
        };
        let result = tokio::select! {
            r = server => r.map_err(ServeError::from),
            () = deadline => {
                tracing::warn!(
                    secs = drain.as_secs(),
                    "drain timeout: cutting the connections still open"
                );
                Ok(())
            }
        };
        if let Some(m) = metrics {
            m.stop().await;
        }
        d.store.clear();
        let _ = std::fs::remove_file(&path);
        let left = d.shm.sweep();
        if left > 0 {
            tracing::warn!(left, "removed shared memory still held at exit");
        }
        tracing::info!("stopped");
        result
    });
    tracing::info!(socket = %socket.display(), "serving");
    Ok(ServerHandle {
        daemon,
        socket,
        metrics: metrics_bound,
        stop: Some(stop_tx),
        task,
    })
}
