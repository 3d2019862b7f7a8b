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

impl Served {
    /// Starts `weightstream serve` with its socket under `dir` (a restart passes the same
    /// `dir`: same socket) and waits until it accepts. Every client of these tests is one uid:
    /// the per-uid session and upload quotas are off.
    pub fn start(dir: &Path) -> Served {
        let socket = dir.join("ws.sock");
        let log = dir.join("daemon.log");
        let config = dir.join("one-uid.toml");
        std::fs::write(
            &config,
            "[quotas]\nper_uid_sessions = 0\nper_uid_uploads = 0\n",
        )
        .expect("config");
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("daemon log");
        let child = Command::new(env!("CARGO_BIN_EXE_weightstream"))
            .args(["serve", "--backend", "host", "--config"])
            .arg(&config)
            .arg("--socket")
            .arg(&socket)
            .env("WEIGHTSTREAM_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn weightstream serve");
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

    /// Open file descriptors of the daemon process.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("/proc/PID/fd")
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
        let mut kinds: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("/proc/PID/fd")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter_map(|link| {
                let link = link.to_string_lossy().into_owned();
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
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success());
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
