//! Where the daemon's socket is: one set of rules for `weightstream serve`, the CLI's commands
//! and both clients (the Python client calls this one).
//!
//! 1. `--socket` or `$WEIGHTSTREAM_SOCKET`, when given: that path and no other;
//! 2. a client: the system socket ([`SYSTEM_SOCKET`], the service's) if it exists; `serve`: the
//!    system socket when it runs as root;
//! 3. else the user's own socket: `$XDG_RUNTIME_DIR/weightstream.sock`, or, without
//!    `XDG_RUNTIME_DIR`, `/tmp/weightstream-<uid>/weightstream.sock` (a directory the daemon
//!    makes 0700 and refuses when another user owns it or others may write to it).
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// The service's socket (`deploy/weightstream.service`).
pub const SYSTEM_SOCKET: &str = "/run/weightstream/weightstream.sock";
/// The environment variable that names the socket (what `--socket` says).
pub const SOCKET_ENV: &str = "WEIGHTSTREAM_SOCKET";
/// The socket's file name in a user's directory.
pub const SOCKET_NAME: &str = "weightstream.sock";

/// The directory of `uid`'s socket when it has no `XDG_RUNTIME_DIR`: `/tmp/weightstream-<uid>`
/// (always `/tmp`, not `$TMPDIR`, so that the daemon and its clients agree).
pub fn fallback_dir(uid: u32) -> PathBuf {
    PathBuf::from(format!("/tmp/weightstream-{uid}"))
}

/// The places one process looks for the daemon's socket, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketCandidates {
    /// `--socket` or `$WEIGHTSTREAM_SOCKET`: when given, the only place.
    pub explicit: Option<PathBuf>,
    /// The service's socket: [`SYSTEM_SOCKET`] (tests put it elsewhere).
    pub system: PathBuf,
    /// The user's own socket, a user daemon's.
    pub user: PathBuf,
}

/// A client's socket, and every place it looked at to choose it (named when no daemon is
/// there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedSocket {
    pub path: PathBuf,
    pub tried: Vec<PathBuf>,
    /// Given by `--socket` or `$WEIGHTSTREAM_SOCKET` rather than found.
    pub explicit: bool,
}

impl ResolvedSocket {
    /// A path the caller chose: the only one tried.
    pub fn explicit(path: impl Into<PathBuf>) -> ResolvedSocket {
        let path = path.into();
        ResolvedSocket {
            tried: vec![path.clone()],
            path,
            explicit: true,
        }
    }

    /// Where this process's client connects: [`SocketCandidates::from_env`] resolved.
    pub fn from_env(explicit: Option<&Path>) -> ResolvedSocket {
        SocketCandidates::from_env(explicit).for_client()
    }

    /// Why a client could not connect to this socket, from the OS error, and what to do.
    pub fn unreachable(&self, error: &std::io::Error) -> String {
        let path = self.path.display();
        let start = if self.explicit {
            format!("Start the daemon there with `weightstream serve --socket {path}`")
        } else {
            "Start the daemon with `weightstream serve`, or pass --socket (or set \
             WEIGHTSTREAM_SOCKET) to name another socket"
                .to_string()
        };
        match error.kind() {
            std::io::ErrorKind::NotFound if self.explicit => {
                format!("no such socket (named by --socket or WEIGHTSTREAM_SOCKET). {start}")
            }
            std::io::ErrorKind::NotFound => {
                let tried: Vec<String> =
                    self.tried.iter().map(|p| p.display().to_string()).collect();
                format!("no such socket (tried {}). {start}", tried.join(", "))
            }
            std::io::ErrorKind::ConnectionRefused => {
                format!("no daemon listens on it (one that stopped left the file). {start}")
            }
            std::io::ErrorKind::PermissionDenied => format!(
                "permission denied: the socket admits its owner and its group (`ls -l {path}` \
                 names them); join the group (`usermod -aG GROUP USER`, then log in again)"
            ),
            _ => format!("{error}. {start}"),
        }
    }
}

impl SocketCandidates {
    /// This process's candidates: `explicit` (a `--socket`), else `$WEIGHTSTREAM_SOCKET` when
    /// set and not empty; `$XDG_RUNTIME_DIR` when set to an absolute path; the real uid.
    pub fn from_env(explicit: Option<&Path>) -> SocketCandidates {
        let set = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let explicit = explicit
            .map(Path::to_path_buf)
            .or_else(|| set(SOCKET_ENV).map(PathBuf::from));
        let runtime_dir = set("XDG_RUNTIME_DIR").map(PathBuf::from);
        SocketCandidates::new(
            explicit,
            Path::new(SYSTEM_SOCKET),
            runtime_dir.as_deref(),
            rustix::process::getuid().as_raw(),
        )
    }

    /// The candidates of a user `uid` whose `XDG_RUNTIME_DIR` is `runtime_dir`, with the system
    /// socket at `system`. A relative `runtime_dir` is ignored, as the XDG specification says.
    pub fn new(
        explicit: Option<PathBuf>,
        system: &Path,
        runtime_dir: Option<&Path>,
        uid: u32,
    ) -> SocketCandidates {
        let dir = match runtime_dir {
            Some(dir) if dir.is_absolute() => dir.to_path_buf(),
            _ => fallback_dir(uid),
        };
        SocketCandidates {
            explicit,
            system: system.to_path_buf(),
            user: dir.join(SOCKET_NAME),
        }
    }

    /// A client's socket: the explicit one; else the system socket if something is there; else
    /// the user's (whether or not it exists: connecting says).
    pub fn for_client(&self) -> ResolvedSocket {
        if let Some(path) = &self.explicit {
            return ResolvedSocket::explicit(path.clone());
        }
        let system_present = std::fs::symlink_metadata(&self.system).is_ok();
        ResolvedSocket {
            path: if system_present {
                self.system.clone()
            } else {
                self.user.clone()
            },
            tried: vec![self.system.clone(), self.user.clone()],
            explicit: false,
        }
    }

    /// `weightstream serve`'s socket: the explicit one; else, as root, the system socket; else
    /// the user's.
    pub fn for_daemon(&self, root: bool) -> PathBuf {
        match &self.explicit {
            Some(path) => path.clone(),
            None if root => self.system.clone(),
            None => self.user.clone(),
        }
    }
}

/// The rule for a user's socket directory, the daemon's and its clients': a directory (not a
/// symlink) that `uid` owns and no one else may write to. Another user's directory, or one
/// others may write to, could let them put their own socket there. Err: why not, to follow
/// the directory's path.
pub fn check_private_dir(dir: &Path, uid: u32) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(dir).map_err(|e| e.to_string())?;
    if meta.file_type().is_symlink() {
        return Err("a symbolic link, not a directory".into());
    }
    if !meta.file_type().is_dir() {
        return Err("not a directory".into());
    }
    if meta.uid() != uid {
        return Err(format!(
            "owned by uid {}, not by this user (uid {uid})",
            meta.uid()
        ));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o022 != 0 {
        return Err(format!(
            "mode {mode:04o} lets others write to it (`chmod 700 {}`)",
            dir.display()
        ));
    }
    Ok(())
}

impl ResolvedSocket {
    /// Whether a client of `uid` may use this socket's directory: the fallback directory
    /// (`/tmp/weightstream-<uid>`, where anyone may make it first) only under
    /// [`check_private_dir`]'s rule, as the daemon makes it; other places are the caller's own
    /// choice or the system's. Err: the refusal, naming the directory, why, and what to do.
    pub fn check_dir(&self, uid: u32) -> Result<(), String> {
        let dir = fallback_dir(uid);
        if self.explicit || self.path.parent() != Some(dir.as_path()) {
            return Ok(());
        }
        check_private_dir(&dir, uid).map_err(|why| {
            format!(
                "refusing the socket directory {}: {why}; a daemon of this user makes it mode \
                 0700: remove it (another user's daemon may be serving there), or pass \
                 --socket (or set WEIGHTSTREAM_SOCKET, XDG_RUNTIME_DIR)",
                dir.display()
            )
        })
    }

    /// Whether the process that answered on this socket may be this client's daemon: its uid
    /// is the caller's, root's, or the system socket's owner's (the service's user); for a
    /// socket the caller named, also the socket file's owner's (a daemon of another user that
    /// the caller chose). Err: the refusal, naming the socket, the peer and what to do.
    pub fn check_peer(&self, peer_uid: u32, caller: u32, system: &Path) -> Result<(), String> {
        use std::os::unix::fs::MetadataExt;
        let owner = |path: &Path| std::fs::symlink_metadata(path).ok().map(|m| m.uid());
        let named = if self.explicit {
            owner(&self.path)
        } else {
            None
        };
        if peer_uid == caller
            || peer_uid == 0
            || owner(system) == Some(peer_uid)
            || named == Some(peer_uid)
        {
            return Ok(());
        }
        Err(format!(
            "refusing the daemon at {}: it runs as uid {peer_uid}, which is neither this user \
             (uid {caller}), root, nor the owner of {}; another user may have put it there: \
             remove the socket or its directory, or pass --socket (or set \
             WEIGHTSTREAM_SOCKET) to name the daemon to use",
            self.path.display(),
            system.display()
        ))
    }
}

/// A socket or daemon the client refused ([`ResolvedSocket::check_dir`],
/// [`ResolvedSocket::check_peer`]), as the error a connection fails with: its message is the
/// whole story.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

impl ResolvedSocket {
    /// Connects to this socket as a client may: its directory under [`Self::check_dir`]'s
    /// rule, the process that answers under [`Self::check_peer`]'s. A refusal is an
    /// `io::Error` carrying [`Refused`].
    pub async fn connect_checked(&self) -> std::io::Result<tokio::net::UnixStream> {
        let caller = rustix::process::getuid().as_raw();
        let refused = |why| std::io::Error::other(Refused(why));
        self.check_dir(caller).map_err(refused)?;
        let stream = tokio::net::UnixStream::connect(&self.path).await?;
        let peer = peer_uid(&stream)?;
        (self.check_peer(peer, caller, Path::new(SYSTEM_SOCKET))).map_err(refused)?;
        Ok(stream)
    }
}

/// The uid of the process at the other end of a connected Unix socket (SO_PEERCRED).
pub fn peer_uid(stream: impl std::os::fd::AsFd) -> std::io::Result<u32> {
    let cred = rustix::net::sockopt::socket_peercred(stream)?;
    Ok(cred.uid.as_raw())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Candidates in a fresh directory: its `system.sock` stands for the system socket.
    fn candidates(
        dir: &Path,
        explicit: Option<&str>,
        runtime_dir: Option<&Path>,
    ) -> SocketCandidates {
        SocketCandidates::new(
            explicit.map(PathBuf::from),
            &dir.join("system.sock"),
            runtime_dir,
            1234,
        )
    }

    fn missing() -> std::io::Error {
        std::io::Error::from(std::io::ErrorKind::NotFound)
    }

    #[test]
    fn an_explicit_socket_is_the_only_place_for_clients_and_the_daemon() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("system.sock"), "").unwrap();
        let c = candidates(dir.path(), Some("/srv/ws.sock"), Some(dir.path()));
        assert_eq!(c.for_client(), ResolvedSocket::explicit("/srv/ws.sock"));
        assert_eq!(c.for_daemon(true), Path::new("/srv/ws.sock"));
        assert_eq!(c.for_daemon(false), Path::new("/srv/ws.sock"));
        assert_eq!(
            c.for_client().unreachable(&missing()),
            "no such socket (named by --socket or WEIGHTSTREAM_SOCKET). Start the daemon there \
             with `weightstream serve --socket /srv/ws.sock`"
        );
    }

    #[test]
    fn a_client_takes_the_system_socket_when_it_exists() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("run-user");
        let c = candidates(dir.path(), None, Some(&runtime));
        let system = dir.path().join("system.sock");
        let user = runtime.join("weightstream.sock");
        let absent = c.for_client();
        assert_eq!(absent.path, user);
        assert_eq!(absent.tried, vec![system.clone(), user.clone()]);
        assert!(!absent.explicit);
        assert_eq!(
            absent.unreachable(&missing()),
            format!(
                "no such socket (tried {}, {}). Start the daemon with `weightstream serve`, or \
                 pass --socket (or set WEIGHTSTREAM_SOCKET) to name another socket",
                system.display(),
                user.display()
            )
        );
        std::fs::write(&system, "").unwrap();
        let present = c.for_client();
        assert_eq!(present.path, system);
        assert_eq!(present.tried, vec![system, user]);
    }

    #[test]
    fn the_user_socket_is_in_xdg_runtime_dir_else_in_a_private_tmp_directory() {
        let dir = tempfile::tempdir().unwrap();
        let cases: &[(Option<&str>, &str)] = &[
            (Some("/run/user/1234"), "/run/user/1234/weightstream.sock"),
            (None, "/tmp/weightstream-1234/weightstream.sock"),
            (
                Some("relative/dir"),
                "/tmp/weightstream-1234/weightstream.sock",
            ),
        ];
        let mut failures = Vec::new();
        for (runtime_dir, want) in cases {
            let c = candidates(dir.path(), None, runtime_dir.map(Path::new));
            let (client, daemon) = (c.for_client().path, c.for_daemon(false));
            if client != Path::new(want) || daemon != Path::new(want) {
                failures.push(format!(
                    "{runtime_dir:?}: {client:?} / {daemon:?}, want {want}"
                ));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn the_daemon_as_root_takes_the_system_socket_whether_or_not_it_exists() {
        let dir = tempfile::tempdir().unwrap();
        let c = candidates(dir.path(), None, Some(Path::new("/run/user/0")));
        assert_eq!(c.for_daemon(true), dir.path().join("system.sock"));
        assert_eq!(
            c.for_daemon(false),
            Path::new("/run/user/0/weightstream.sock")
        );
    }

    #[test]
    fn a_socket_directory_must_be_the_users_own_and_closed_to_others() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let me = rustix::process::getuid().as_raw();
        let private = dir.path().join("private");
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(check_private_dir(&private, me), Ok(()));
        assert_eq!(
            check_private_dir(&private, me + 1),
            Err(format!(
                "owned by uid {me}, not by this user (uid {})",
                me + 1
            ))
        );
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(
            check_private_dir(&private, me),
            Err(format!(
                "mode 0777 lets others write to it (`chmod 700 {}`)",
                private.display()
            ))
        );
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&private, &link).unwrap();
        assert_eq!(
            check_private_dir(&link, me),
            Err("a symbolic link, not a directory".into())
        );
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert_eq!(check_private_dir(&file, me), Err("not a directory".into()));
    }

    /// Only the fallback directory is held to the rule: a named socket, or one elsewhere, is
    /// the caller's or the system's choice.
    #[test]
    fn only_the_fallback_directory_is_checked() {
        // A uid no one has: its fallback directory is made here, open to all.
        let uid = 3_000_000_000 + std::process::id();
        let dir = fallback_dir(uid);
        std::fs::create_dir(&dir).unwrap();
        struct Gone(PathBuf);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        let _gone = Gone(dir.clone());
        let found = ResolvedSocket {
            path: dir.join(SOCKET_NAME),
            tried: Vec::new(),
            explicit: false,
        };
        let me = rustix::process::getuid().as_raw();
        assert_eq!(
            found.check_dir(uid),
            Err(format!(
                "refusing the socket directory {}: owned by uid {me}, not by this user (uid \
                 {uid}); a daemon of this user makes it mode 0700: remove it (another user's \
                 daemon may be serving there), or pass --socket (or set WEIGHTSTREAM_SOCKET, \
                 XDG_RUNTIME_DIR)",
                dir.display()
            ))
        );
        let named = ResolvedSocket::explicit(dir.join(SOCKET_NAME));
        assert_eq!(named.check_dir(uid), Ok(()));
        let elsewhere = ResolvedSocket {
            path: PathBuf::from("/run/user/1000/weightstream.sock"),
            ..found
        };
        assert_eq!(elsewhere.check_dir(uid), Ok(()));
    }

    /// The daemon may be the caller's, root's, or the system socket's owner's; for a socket the
    /// caller named, also its file's owner's. Anyone else is refused, named.
    #[test]
    fn a_daemon_of_another_user_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let system = dir.path().join("system.sock");
        let socket = dir.path().join("ws.sock");
        std::fs::write(&socket, "").unwrap();
        // The files' owner: this user, or, as root (whom the rule trusts), another one.
        let me = rustix::process::getuid().as_raw();
        let owner = if me == 0 { 4242 } else { me };
        let owned = |path: &Path| std::os::unix::fs::chown(path, Some(owner), None).unwrap();
        owned(&socket);
        let found = ResolvedSocket {
            path: socket.clone(),
            tried: Vec::new(),
            explicit: false,
        };
        let (caller, other) = (owner + 1, owner + 2);
        assert_eq!(found.check_peer(caller, caller, &system), Ok(()));
        assert_eq!(found.check_peer(0, caller, &system), Ok(()));
        let refusal = |peer: u32| {
            format!(
                "refusing the daemon at {}: it runs as uid {peer}, which is neither this user \
                 (uid {caller}), root, nor the owner of {}; another user may have put it \
                 there: remove the socket or its directory, or pass --socket (or set \
                 WEIGHTSTREAM_SOCKET) to name the daemon to use",
                socket.display(),
                system.display()
            )
        };
        // The socket file's owner counts only for a socket the caller named.
        assert_eq!(
            found.check_peer(owner, caller, &system),
            Err(refusal(owner))
        );
        let named = ResolvedSocket::explicit(&socket);
        assert_eq!(named.check_peer(owner, caller, &system), Ok(()));
        assert_eq!(
            named.check_peer(other, caller, &system),
            Err(refusal(other))
        );
        std::fs::write(&system, "").unwrap();
        owned(&system);
        assert_eq!(found.check_peer(owner, caller, &system), Ok(()));
    }

    #[test]
    fn the_peer_of_a_socket_is_read_from_the_kernel() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(peer_uid(&a).unwrap(), rustix::process::getuid().as_raw());
    }
}
