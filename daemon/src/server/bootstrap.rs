//! Start-up on the box, before anything is served: claim the socket, pick the backend, bind
//! the socket and the handoff socket next to it (mode 0660, the configured group). Shared
//! memory needs no preparing: it is memfds, which leave nothing behind.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};

use super::error::ServeError;
use super::handoff;
use crate::backend::Backend;
use crate::backend::cuda::CudaBackend;
use crate::backend::host::HostBackend;
use crate::config::{BackendChoice, Config};
use crate::mem::shm::Shm;

/// What start-up made: the bound sockets, the daemon's shared memory and the backend.
pub(super) struct Bootstrap {
    pub listener: UnixListener,
    pub handoff: handoff::Bound,
    pub shm: Arc<Shm>,
    pub backend: Arc<dyn Backend>,
}

pub(super) async fn bootstrap(config: &Config) -> Result<Bootstrap, ServeError> {
    let socket = &config.socket;
    claim_socket(socket).await?;
    let shm = Shm::new();
    let backend = select_backend(config.backend, &shm)?;
    let listener = bind(socket, config.socket_gid)?;
    let handoff = handoff::bind(socket, config.socket_gid)?;
    Ok(Bootstrap {
        listener,
        handoff,
        shm,
        backend,
    })
}

fn socket_error(path: &Path) -> impl Fn(std::io::Error) -> ServeError {
    let path = path.to_path_buf();
    move |source| ServeError::Socket {
        path: path.clone(),
        source,
    }
}

/// Removes a socket file no daemon answers on; refuses one a live daemon serves.
async fn claim_socket(path: &Path) -> Result<(), ServeError> {
    let io = socket_error(path);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(&io)?;
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

/// Binds the socket: mode 0660, owned by `gid` when one is configured.
fn bind(path: &Path, gid: Option<u32>) -> Result<UnixListener, ServeError> {
    let io = socket_error(path);
    let listener = UnixListener::bind(path).map_err(&io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(&io)?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(&io)?;
    }
    Ok(listener)
}

fn select_backend(choice: BackendChoice, shm: &Arc<Shm>) -> Result<Arc<dyn Backend>, ServeError> {
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
