//! Start-up on the box, before anything is served: claim the socket, sweep shared memory an
//! earlier daemon left, pick the backend, bind the socket (mode 0660, the configured group).
//! The only place in `server/` that knows the shared-memory directory's type.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};

use super::error::ServeError;
use crate::backend::Backend;
use crate::backend::cuda::CudaBackend;
use crate::backend::host::HostBackend;
use crate::config::{BackendChoice, Config};
use crate::mem::shm::ShmDir;

/// What start-up made: the bound socket, the shared-memory directory and the backend.
pub(super) struct Bootstrap {
    pub listener: UnixListener,
    pub shm: Arc<ShmDir>,
    pub backend: Arc<dyn Backend>,
}

pub(super) async fn bootstrap(config: &Config) -> Result<Bootstrap, ServeError> {
    let socket = &config.socket;
    claim_socket(socket).await?;
    // Shared memory belongs to the socket's group: exactly the peers who may connect map it.
    let shm =
        Arc::new(ShmDir::new(&config.shm_dir, &shm_tag(socket)).with_group(config.socket_gid));
    let swept = shm.sweep();
    if swept > 0 {
        tracing::warn!(
            swept,
            prefix = shm.prefix(),
            "removed shared memory left by an earlier daemon"
        );
    }
    let backend = select_backend(config.backend, &shm)?;
    let listener = bind(socket, config.socket_gid)?;
    Ok(Bootstrap {
        listener,
        shm,
        backend,
    })
}

/// Tells daemons on one box apart in /dev/shm: a hash of the socket path.
pub fn shm_tag(socket: &Path) -> String {
    blake3::hash(socket.as_os_str().as_encoded_bytes()).to_hex()[..8].to_string()
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
