//! A daemon run as its own `weightstream serve` process (host backend), for the tests that
//! kill it, restart it, or read its resources from /proc: open fds, resident memory.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a start or a stop may take before the test fails.
pub const START_DEADLINE: Duration = Duration::from_secs(30);

pub struct Served {
    child: Child,
    pub socket: PathBuf,
    log: PathBuf,
}

/// Polls `done` every 10 ms until it holds; fails the test after `deadline` (a condition, not
/// a delay).
pub fn wait_for(what: &str, deadline: Duration, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !done() {
        assert!(Instant::now() < end, "no {what} within {deadline:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How a test starts its daemon, beyond the defaults (host backend, socket under the test's
/// directory, `WEIGHTSTREAM_LOG=warn`; every client of these tests is one uid, so the per-uid
/// session and upload quotas are off unless `config` says otherwise).
#[derive(Debug, Default, Clone, Copy)]
pub struct Launch<'a> {
    /// TOML for `--config` (written to DIR/config.toml).
    pub config: Option<&'a str>,
    /// A command the daemon runs under, e.g. `["prlimit", "--nofile=64:64", "--"]`.
    pub wrapper: &'a [&'a str],
    /// `WEIGHTSTREAM_LOG` (default `warn`).
    pub log_filter: Option<&'a str>,
    /// The log's file name under DIR (default `daemon.log`): a second daemon needs its own.
    pub log_name: Option<&'a str>,
    /// More environment variables.
    pub env: &'a [(&'a str, &'a str)],
}

/// The default config: one uid runs every client, so its per-uid quotas are off.
const ONE_UID: &str = "[quotas]\nper_uid_sessions = 0\nper_uid_uploads = 0\n";

impl Launch<'_> {
    /// The command, the socket and the log path, for a daemon under `dir`.
    pub fn command(&self, dir: &Path) -> (Command, PathBuf, PathBuf) {
        let socket = dir.join("ws.sock");
        let log = dir.join(self.log_name.unwrap_or("daemon.log"));
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("daemon log");
        let bin = env!("CARGO_BIN_EXE_weightstream");
        let mut cmd = match self.wrapper.split_first() {
            Some((first, rest)) => {
                let mut cmd = Command::new(first);
                cmd.args(rest).arg(bin);
                cmd
            }
            None => Command::new(bin),
        };
        cmd.args(["serve", "--backend", "host", "--socket"])
            .arg(&socket);
        let config = self.config.unwrap_or(ONE_UID);
        let path = dir.join("config.toml");
        std::fs::write(&path, config).expect("write the config");
        cmd.arg("--config").arg(path);
        cmd.env("WEIGHTSTREAM_LOG", self.log_filter.unwrap_or("warn"))
            .env_remove("NOTIFY_SOCKET")
            .envs(self.env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        (cmd, socket, log)
    }
}

impl Served {
    /// Starts `weightstream serve` with its socket under `dir` (a restart passes the same
    /// `dir`: same socket) and waits until it accepts.
    pub fn start(dir: &Path) -> Served {
        Served::start_with(dir, Launch::default())
    }

    /// [`Served::start`] as `launch` says.
    pub fn start_with(dir: &Path, launch: Launch<'_>) -> Served {
        let (mut cmd, socket, log) = launch.command(dir);
        let child = cmd.spawn().expect("spawn weightstream serve");
        let mut served = Served { child, socket, log };
        // A killed daemon's socket file stays until the new one claims it: wait for an
        // accepted connection, not for the file.
        wait_for("daemon accepting", START_DEADLINE, || {
            if let Ok(Some(status)) = served.child.try_wait() {
                panic!("the daemon exited at start ({status}):\n{}", served.log());
            }
            std::os::unix::net::UnixStream::connect(&served.socket).is_ok()
        });
        served
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What each of the daemon's open fds refers to (`/proc/PID/fd`'s link targets: a path,
    /// `socket:[INODE]`, `/memfd:NAME (deleted)` ...).
    fn fd_targets(&self) -> Vec<String> {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("/proc/PID/fd")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .map(|link| link.to_string_lossy().into_owned())
            .collect()
    }

    /// Open file descriptors of the daemon process.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("/proc/PID/fd")
            .count()
    }

    /// Client connections the daemon holds open, gRPC and handoff: its sockets that are
    /// connected (state 03 in `/proc/net/unix`) and carry its listeners' paths (the daemon's
    /// own socket pairs carry none). One goes once the daemon has seen its client close it.
    pub fn connections(&self) -> usize {
        let inodes: std::collections::HashSet<String> = self
            .fd_targets()
            .iter()
            .filter_map(|link| {
                Some(
                    link.strip_prefix("socket:[")?
                        .strip_suffix(']')?
                        .to_string(),
                )
            })
            .collect();
        // Num RefCount Protocol Flags Type St Inode [Path]
        std::fs::read_to_string("/proc/net/unix")
            .expect("/proc/net/unix")
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f.len() == 8 && f[5] == "03" && inodes.contains(f[6]))
            .count()
    }

    /// The daemon's resident memory (VmRSS), in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("/proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// The daemon's shared memory: the kinds of the memfds among its open fds (/proc shows
    /// one as "/memfd:weightstream-KIND (deleted)"), sorted. A committed upload stays an
    /// "upload": it is its model's arena.
    pub fn memfds(&self) -> Vec<String> {
        let mut kinds: Vec<String> = self
            .fd_targets()
            .iter()
            .filter_map(|link| {
                let name = link.strip_prefix("/memfd:")?;
                let name = name.strip_suffix(" (deleted)").unwrap_or(name);
                Some(
                    name.strip_prefix("weightstream-")
                        .unwrap_or(name)
                        .to_string(),
                )
            })
            .collect();
        kinds.sort();
        kinds
    }

    /// How many memfds of one kind ("model", "upload", "staging", "resident") it holds.
    pub fn shm_count(&self, kind: &str) -> usize {
        self.memfds().iter().filter(|k| *k == kind).count()
    }

    /// SIGKILL: no drain, no cleanup; the socket files stay behind (the shared memory goes
    /// with the process: memfds have no name).
    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL the daemon");
        self.child.wait().expect("reap the daemon");
    }

    /// SIGTERM, then waits for the exit (bounded).
    pub fn terminate(&mut self) -> ExitStatus {
        self.send_sigterm();
        self.wait_exit()
    }

    /// SIGTERM, without waiting.
    pub fn send_sigterm(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success());
    }

    /// Waits for the exit, failing the test after [`START_DEADLINE`] (a ceiling, not a
    /// measurement).
    pub fn wait_exit(&mut self) -> ExitStatus {
        let mut exit = None;
        wait_for("daemon exit after SIGTERM", START_DEADLINE, || {
            exit = self.child.try_wait().expect("try_wait");
            exit.is_some()
        });
        exit.unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
