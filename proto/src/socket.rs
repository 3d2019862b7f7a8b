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
}
