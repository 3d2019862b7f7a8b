//! The handoff socket, next to the gRPC socket (its path + `.fd`): file descriptors passed
//! with `SCM_RIGHTS`. The wire format is `weightstream_client::handoff`'s, whose daemon half
//! this listener is built from: one request per connection, read and answered on a blocking
//! thread within one 5 s `Exchange`, so a peer that stalls holds nothing else. The peer (its
//! uid and groups, SO_PEERCRED and SO_PEERGROUPS) must pass the same `[access]` allow-lists as
//! the gRPC service; `PUT` keeps the
//! files in the core's `FdDrops` under a token, `GET` hands out what the core's `FdSecrets`
//! gives that uid.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use weightstream_client::handoff::{Exchange, HandoffError, Request, handoff_path};

use super::access::AccessCheck;
use super::conn::{Caller, identify};
use super::error::ServeError;
use crate::core::{Daemon, SecretError};

/// Connections accepted and not yet answered, all peers together (each holds an fd).
const MAX_CONNECTIONS: usize = 512;
/// Exchanges one uid may have in progress at once; its further connections wait their turn. A
/// peer that connects and stalls for the whole 5 s each time holds up only its own uid.
const MAX_EXCHANGES_PER_UID: usize = 16;

/// The socket file this daemon bound, removed when dropped if it is still the one it bound
/// (same device and inode: a file another daemon made there since is left alone).
struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.id => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the handoff socket");
                }
            }
            _ => {}
        }
    }
}

/// The bound handoff socket, not yet served.
pub(super) struct Bound {
    listener: UnixListener,
    file: SocketFile,
}

/// Binds the handoff socket of the gRPC socket `socket`: mode 0660, group `gid` when one is
/// configured, as the gRPC socket. A socket file left there by an earlier daemon is replaced
/// (start-up has claimed the gRPC socket, so none serves it).
pub(super) fn bind(socket: &Path, gid: Option<u32>) -> Result<Bound, ServeError> {
    let path = handoff_path(socket);
    let io = |source| ServeError::Socket {
        path: path.clone(),
        source,
    };
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(&path).map_err(io)?,
        Ok(_) => {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            )));
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(&path).map_err(io)?;
    let meta = std::fs::symlink_metadata(&path).map_err(io)?;
    let file = SocketFile {
        path: path.clone(),
        id: (meta.dev(), meta.ino()),
    };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660)).map_err(io)?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(&path, None, Some(gid)).map_err(io)?;
    }
    listener.set_nonblocking(true).map_err(io)?;
    Ok(Bound { listener, file })
}

/// The handoff socket being served; [`HandoffServer::stop`] (or a drop) stops accepting and
/// removes the socket file.
pub(super) struct HandoffServer {
    task: JoinHandle<()>,
    _file: SocketFile,
}

impl HandoffServer {
    /// Stops accepting and removes the socket file (what dropping it does, said at the call).
    pub(super) fn stop(self) {
        drop(self);
    }
}

impl Drop for HandoffServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `bound` for `daemon` until stopped.
pub(super) fn serve(bound: Bound, daemon: Arc<Daemon>) -> Result<HandoffServer, ServeError> {
    let listener = tokio::net::UnixListener::from_std(bound.listener).map_err(|source| {
        ServeError::Socket {
            path: bound.file.path.clone(),
            source,
        }
    })?;
    let access = AccessCheck::new(&daemon.config.access);
    let task = tokio::spawn(accept(listener, daemon, access));
    Ok(HandoffServer {
        task,
        _file: bound.file,
    })
}

async fn accept(listener: tokio::net::UnixListener, daemon: Arc<Daemon>, access: AccessCheck) {
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_uid = UidTurns::default();
    loop {
        let Ok(connection) = connections.clone().acquire_owned().await else {
            return;
        };
        let (stream, caller) = match listener.accept().await.and_then(|(s, _)| peer_of(s)) {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and the like: wait rather than spin; the peer retries.
                tracing::warn!(error = %e, "handoff socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let turn = per_uid.of(caller.peer.uid);
        let (daemon, access) = (daemon.clone(), access.clone());
        tokio::spawn(async move {
            let Ok(turn) = turn.acquire_owned().await else {
                return;
            };
            let exchanged = tokio::task::spawn_blocking(move || {
                exchange(&stream, &caller, &daemon, &access);
            });
            let _ = exchanged.await;
            drop((turn, connection));
        });
    }
}

/// The accepted stream as a blocking one, and who is at the other end.
fn peer_of(stream: tokio::net::UnixStream) -> std::io::Result<(UnixStream, Caller)> {
    let caller = identify(&stream, 0)?;
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    Ok((stream, caller))
}

/// Each uid's turns at exchanging.
#[derive(Default)]
struct UidTurns(Mutex<HashMap<u32, Arc<Semaphore>>>);

impl UidTurns {
    fn of(&self, uid: u32) -> Arc<Semaphore> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Forget the uids nobody is exchanging for (all permits back, no one else holding it).
        map.retain(|_, s| Arc::strong_count(s) > 1);
        let turns = map
            .entry(uid)
            .or_insert_with(|| Arc::new(Semaphore::new(MAX_EXCHANGES_PER_UID)));
        turns.clone()
    }
}

/// Reads the connection's one request and answers it. A peer the allow-lists refuse is told
/// so after its request is read (answering before would cut its sending short), and whatever
/// fds it passed are closed unused.
fn exchange(stream: &UnixStream, caller: &Caller, daemon: &Daemon, access: &AccessCheck) {
    let exchange = Exchange::begin(stream);
    let request = exchange.read_request();
    let peer = &caller.peer;
    if let Err(denied) = access.admit(caller) {
        drop(request);
        let _ = exchange.reply_error(&denied.to_string());
        return;
    }
    let replied = match request {
        // Cut, reset or silent for 5 s: nobody to answer.
        Err(HandoffError::Io(e)) => {
            tracing::debug!(uid = peer.uid, error = %e, "handoff: exchange cut");
            return;
        }
        Err(refused) => exchange.reply_error(&refused.to_string()),
        Ok(Request::Put(fds)) => match daemon.fd_drops.put(peer.uid, fds) {
            Ok(token) => exchange.reply_token(&token),
            Err(refused) => exchange.reply_error(&refused.to_string()),
        },
        Ok(Request::Get(secret)) => match daemon.secrets.fetch(&secret, peer.uid) {
            Ok((fd, size)) => exchange.reply_fd(fd.as_fd(), size),
            Err(refused) => {
                if matches!(refused, SecretError::Unknown { .. }) {
                    tracing::info!(
                        uid = peer.uid,
                        pid = peer.pid,
                        "handoff: GET of an unknown fd_secret refused"
                    );
                }
                exchange.reply_error(&refused.to_string())
            }
        },
    };
    if let Err(e) = replied {
        tracing::debug!(uid = peer.uid, error = %e, "handoff: the reply did not get through");
    }
}
