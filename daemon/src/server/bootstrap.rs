//! Start-up on the box, before anything is served: claim the socket (an exclusive lock on
//! `<socket>.lock`, held until the daemon has stopped), pick the backend, bind the socket and
//! the handoff socket next to it (mode 0660, the configured group). Shared memory needs no
//! preparing: it is memfds, which leave nothing behind.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::FlockOperation;
use tokio::net::UnixListener;
use weightstream_proto::socket::{check_private_dir, fallback_dir};

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
    pub bound: BoundSocket,
    pub handoff: handoff::Bound,
    pub shm: Arc<Shm>,
    pub backend: Arc<dyn Backend>,
}

pub(super) async fn bootstrap(config: &Config) -> Result<Bootstrap, ServeError> {
    let socket = &config.socket;
    let lock = claim_socket(socket)?;
    let shm = Shm::new();
    // Its one fd, now: the daemon's fds then stay as many as at start once its work is done.
    shm.held().start();
    let backend = select_backend(config.backend, &shm)?;
    let (listener, bound) = bind(socket, config.socket_gid, lock)?;
    let handoff = handoff::bind(socket, config.socket_gid)?;
    Ok(Bootstrap {
        listener,
        bound,
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

/// The lock file beside `socket`: whoever holds it owns the socket.
pub fn lock_path(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Takes `<socket>.lock` (created 0600 if missing) with an exclusive, non-blocking `flock`, and
/// writes this process's pid into it; a daemon that holds it (running, or still draining) makes
/// this fail at once, naming its pid. Holding the lock, removes a socket file an earlier daemon
/// left (no live daemon can own it any more).
fn claim_socket(path: &Path) -> Result<File, ServeError> {
    let io = socket_error(path);
    let uid = rustix::process::getuid().as_raw();
    match path.parent() {
        Some(dir) if dir == fallback_dir(uid) => private_dir(dir, uid)?,
        Some(dir) => std::fs::create_dir_all(dir).map_err(&io)?,
        None => {}
    }
    let lock_path = lock_path(path);
    let lock_io = socket_error(&lock_path);
    let mut lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&lock_path)
        .map_err(&lock_io)?;
    if let Err(e) = rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
        if e != rustix::io::Errno::WOULDBLOCK {
            return Err(lock_io(e.into()));
        }
        let mut text = String::new();
        let _ = lock.read_to_string(&mut text);
        return Err(ServeError::Locked {
            lock: lock_path.clone(),
            pid: text.trim().parse().ok(),
        });
    }
    lock.set_len(0).map_err(&lock_io)?;
    lock.rewind().map_err(&lock_io)?;
    writeln!(lock, "{}", std::process::id()).map_err(&lock_io)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path).map_err(io)?,
        Ok(_) => {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            )));
        }
        Err(_) => {}
    }
    Ok(lock)
}

/// Makes `dir` (a user's socket directory in /tmp, where anyone may create it first) mode 0700,
/// or checks the one there: a directory `uid` owns that no one else may write to. Another
/// user's directory, or one others may write to, could let them replace the socket.
fn private_dir(dir: &Path, uid: u32) -> Result<(), ServeError> {
    let refuse = |why: String| ServeError::SocketDir {
        dir: dir.to_path_buf(),
        why,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(refuse(e.to_string())),
    }
    // The clients hold the directory to the same rule before they connect through it.
    check_private_dir(dir, uid).map_err(refuse)
}

/// The socket file this daemon bound, and the lock that makes it this daemon's.
pub(super) struct BoundSocket {
    path: PathBuf,
    /// The socket file as bound: (device, inode, ctime). The ctime tells a reused inode
    /// number apart.
    identity: (u64, u64, i64, i64),
    lock: File,
}

impl BoundSocket {
    /// Removes the socket file, if it is still the one this daemon bound (never a successor's),
    /// then lets the lock go.
    pub(super) fn release(self) {
        if let Ok(meta) = std::fs::symlink_metadata(&self.path)
            && identity(&meta) == self.identity
        {
            let _ = std::fs::remove_file(&self.path);
        }
        drop(self.lock);
    }
}

/// Binds the socket: mode 0660, owned by `gid` when one is configured.
fn bind(
    path: &Path,
    gid: Option<u32>,
    lock: File,
) -> Result<(UnixListener, BoundSocket), ServeError> {
    let io = socket_error(path);
    let listener = UnixListener::bind(path).map_err(&io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(&io)?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(&io)?;
    }
    // After the chmod and chown, which change the ctime.
    let meta = std::fs::symlink_metadata(path).map_err(&io)?;
    let bound = BoundSocket {
        path: path.to_path_buf(),
        identity: identity(&meta),
        lock,
    };
    Ok((listener, bound))
}

fn identity(meta: &std::fs::Metadata) -> (u64, u64, i64, i64) {
    (meta.dev(), meta.ino(), meta.ctime(), meta.ctime_nsec())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_socket_directory_is_made_0700_and_one_others_could_write_to_is_refused() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("weightstream-1234");
        let uid = rustix::process::getuid().as_raw();
        private_dir(&dir, uid).unwrap();
        let meta = std::fs::symlink_metadata(&dir).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o777, 0o700);
        private_dir(&dir, uid).expect("this user's own 0700 directory is taken again");
        let refused = |dir: &Path, uid: u32| private_dir(dir, uid).unwrap_err().to_string();
        let tail = "refusing it as the socket's directory (remove it, or pass --socket)";
        // Another user's (as this process sees a directory it does not own).
        assert_eq!(
            refused(&dir, uid + 1),
            format!(
                "{}: owned by uid {uid}, not by this user (uid {}): {tail}",
                dir.display(),
                uid + 1
            )
        );
        for mode in [0o777, 0o720, 0o702] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(
                refused(&dir, uid),
                format!(
                    "{0}: mode {mode:04o} lets others write to it (`chmod 700 {0}`): {tail}",
                    dir.display()
                )
            );
        }
        let file = parent.path().join("weightstream-file");
        std::fs::write(&file, "").unwrap();
        assert_eq!(
            refused(&file, uid),
            format!("{}: not a directory: {tail}", file.display())
        );
        let link = parent.path().join("weightstream-link");
        std::os::unix::fs::symlink(parent.path(), &link).unwrap();
        assert_eq!(
            refused(&link, uid),
            format!(
                "{}: a symbolic link, not a directory: {tail}",
                link.display()
            )
        );
    }

    #[test]
    fn a_second_claim_fails_naming_the_holders_pid_and_a_release_frees_it() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ws.sock");
        let first = claim_socket(&socket).unwrap();
        let mode = std::fs::metadata(lock_path(&socket)).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let err = claim_socket(&socket).unwrap_err().to_string();
        let want = format!(
            "another weightstream daemon holds {}.lock (pid {}): it is still running or draining",
            socket.display(),
            std::process::id()
        );
        assert_eq!(err, want);
        drop(first);
        claim_socket(&socket).expect("the lock is free again");
    }

    #[tokio::test]
    async fn release_removes_only_the_socket_this_daemon_bound() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ws.sock");
        let (_listener, bound) = bind(&socket, None, claim_socket(&socket).unwrap()).unwrap();
        // Someone else's socket now sits at the path (as a successor's would).
        let elsewhere = dir.path().join("successor.sock");
        let successor = std::os::unix::net::UnixListener::bind(&elsewhere).unwrap();
        std::fs::rename(&elsewhere, &socket).unwrap();
        let ino = std::fs::symlink_metadata(&socket).unwrap().ino();
        bound.release();
        assert_eq!(
            std::fs::symlink_metadata(&socket).map(|m| m.ino()).ok(),
            Some(ino),
            "a successor's socket was removed"
        );
        drop(successor);
        // Its own socket goes.
        std::fs::remove_file(&socket).unwrap();
        let (_listener, bound) = bind(&socket, None, claim_socket(&socket).unwrap()).unwrap();
        bound.release();
        assert!(!socket.exists(), "its own socket stays behind");
    }
}
