//! The handoff socket, next to the gRPC socket (its path + `.fd`): file descriptors passed
//! with `SCM_RIGHTS`. The wire format is `weightstream_proto::handoff`'s, whose daemon half
//! this listener is built from: one request per connection, read and answered on a blocking
//! thread within 5 s of the accept (an `Exchange`), so a peer that stalls holds nothing else.
//!
//! Fairness between uids: a uid holds at most `limits.max_connections_per_uid` connections
//! here (counted apart from its gRPC ones); one more is answered `ERR` and closed at accept,
//! with a warning naming the uid, so that a uid's idle connections take no place another uid
//! needs. At most [`MAX_EXCHANGES_PER_UID`] of a uid's connections are read at once, and a
//! peer that sends no complete request within the 5 s is cut and logged with its uid and pid.
//!
//! The peer (its uid and groups, SO_PEERCRED and SO_PEERGROUPS) must pass the same `[access]`
//! allow-lists as the gRPC service; `PUT` keeps the files in the core's `FdDrops` under a
//! token, `GET` hands out what the core's `FdSecrets` gives that uid.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use weightstream_proto::handoff::{Exchange, HandoffError, Request, TIMEOUT, handoff_path};

use super::access::AccessCheck;
use super::conn::{Caller, Connections, Warning, identify};
use super::error::ServeError;
use crate::core::{Daemon, SecretError};

/// Exchanges one uid may have in progress at once; its further connections wait their turn
/// (their 5 s running from the accept). A peer that connects and stalls holds up only its
/// own uid.
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
    let table = Connections::new(daemon.config.limits.max_connections_per_uid);
    let per_uid = UidTurns::default();
    let stalled = Arc::new(Mutex::new(Warning::default()));
    let mut refused = Warning::default();
    loop {
        let (stream, caller) = match listener.accept().await {
            Ok((stream, _)) => match identify(&stream, 0) {
                Ok(caller) => (stream, caller),
                Err(e) => {
                    tracing::debug!(error = %e, "handoff socket: no peer credentials");
                    continue;
                }
            },
            Err(e) => {
                // EMFILE and the like: wait rather than spin; the peer retries.
                tracing::warn!(error = %e, "handoff socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let accepted = Instant::now();
        let peer = caller.peer;
        let slot = match table.admit(peer.uid) {
            Ok(slot) => slot,
            Err(held) => {
                let limit = daemon.config.limits.max_connections_per_uid;
                let message = format!(
                    "uid {} already holds {held} connections to the handoff socket, the limit \
                     is limits.max_connections_per_uid = {limit}: connection closed",
                    peer.uid
                );
                if let Some(suppressed) = refused.due() {
                    tracing::warn!(
                        uid = peer.uid,
                        pid = peer.pid,
                        held,
                        suppressed,
                        "{message}"
                    );
                }
                // Best effort, without waiting: a fresh socket's buffer has room for one line.
                let _ = stream.try_write(format!("ERR {message}\n").as_bytes());
                continue;
            }
        };
        let stream = match stream.into_std().and_then(|s| {
            s.set_nonblocking(false)?;
            Ok(s)
        }) {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "handoff socket: cannot serve the connection");
                continue;
            }
        };
        let turn = per_uid.of(peer.uid);
        let (daemon, access, stalled) = (daemon.clone(), access.clone(), stalled.clone());
        tokio::spawn(async move {
            let Ok(turn) = turn.acquire_owned().await else {
                return;
            };
            let exchanged = tokio::task::spawn_blocking(move || {
                let exchange = Exchange::since(&stream, accepted);
                if let Err(cut) = serve_exchange(&exchange, &caller, &daemon, &access) {
                    log_cut(&caller, &cut, &stalled);
                }
            });
            let _ = exchanged.await;
            drop((turn, slot));
        });
    }
}

/// Says why an exchange ended with nobody to answer: a peer that sent no complete request in
/// time at `warn` (at most once a second, with a count of those held back, so that one uid's
/// stalls cannot flood the log), a peer that went away at `debug`.
fn log_cut(caller: &Caller, cut: &std::io::Error, stalled: &Mutex<Warning>) {
    let peer = &caller.peer;
    if cut.kind() != std::io::ErrorKind::TimedOut {
        tracing::debug!(uid = peer.uid, pid = peer.pid, error = %cut, "handoff: exchange cut");
        return;
    }
    let due = stalled.lock().unwrap_or_else(|p| p.into_inner()).due();
    if let Some(suppressed) = due {
        tracing::warn!(
            uid = peer.uid,
            pid = peer.pid,
            suppressed,
            "handoff: uid {} (pid {}) sent no complete request within {TIMEOUT:?} of \
             connecting: connection closed",
            peer.uid,
            peer.pid
        );
    }
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

/// Reads the connection's one request and answers it; the error that cut the exchange short
/// with nobody to answer. A peer the allow-lists refuse is told so after its request is read
/// (answering before would cut its sending short), and whatever fds it passed are closed
/// unused.
fn serve_exchange(
    exchange: &Exchange<'_>,
    caller: &Caller,
    daemon: &Daemon,
    access: &AccessCheck,
) -> Result<(), std::io::Error> {
    let request = exchange.read_request();
    let peer = &caller.peer;
    if let Err(denied) = access.admit(caller) {
        drop(request);
        let _ = exchange.reply_error(&denied.to_string());
        return Ok(());
    }
    let replied = match request {
        // Cut, reset or silent until the deadline: nobody to answer.
        Err(HandoffError::Io(e)) => return Err(e),
        Err(refused) => exchange.reply_error(&refused.to_string()),
        Ok(Request::Put(fds)) => match daemon.fd_drops.put(peer.uid, fds) {
            Ok(token) => exchange.reply_token(&token),
            Err(refused) => exchange.reply_error(&refused.to_string()),
        },
        Ok(Request::Get(secret)) => match daemon.secrets.fetch(&secret, peer.uid, peer.pid) {
            // The daemon's copy of `fd` closes here, before the connection does: the
            // client's `get_fd` returns at that close, holding the only copies.
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
    Ok(())
}
