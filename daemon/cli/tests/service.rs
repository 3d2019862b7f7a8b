//! The `weightstream serve` binary as systemd runs it: READY=1 and STOPPING=1 on a
//! NOTIFY_SOCKET, a clean exit on SIGTERM with a session open (its client told why, no shared
//! memory left), the socket's group, and the metrics endpoint's lifetime.

#[path = "../../e2e/tests/common/mod.rs"]
mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;
use weightstream_client::{Client, ClientError};

const LAYER: usize = 64 << 10;

fn poll<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Served {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Served {
    fn start(dir: &Path, extra: &[&str], env: &[(&str, &Path)]) -> Served {
        let socket = dir.join("ws.sock");
        let log = dir.join("daemon.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_weightstream"));
        cmd.args(["serve", "--backend", "host", "--socket"])
            .arg(&socket)
            .args(extra)
            .env_remove("NOTIFY_SOCKET")
            .env("WEIGHTSTREAM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Served {
            child: cmd.spawn().unwrap(),
            socket,
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }

    fn wait_exit(&mut self) -> ExitStatus {
        poll("the daemon to exit", || self.child.try_wait().unwrap())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn recv(notify: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = notify
        .recv(&mut buf)
        .expect("a notification before the timeout");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_notify_ready_then_stopping_and_a_clean_exit_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut served = Served::start(dir.path(), &[], &[("NOTIFY_SOCKET", notify_path.as_path())]);

    assert_eq!(
        recv(&notify),
        "READY=1\nSTATUS=serving\n",
        "{}",
        served.log()
    );
    // READY means serving: a client connects at once, without polling for the socket.
    let mut client = Client::connect(Some(&served.socket)).await.unwrap();
    let model_dir = tempfile::tempdir().unwrap();
    let path = write_model(
        model_dir.path(),
        "m.safetensors",
        &uniform_model(61, 4, LAYER),
    );
    let expected = read_model(std::slice::from_ref(&path));
    let manifest = load(&mut client, &[path], &expected).await;
    let groups = per_tensor_groups(&manifest);
    let session = client
        .open_session(options(
            &manifest.model_id,
            groups,
            2 * LAYER as u64,
            2 * LAYER as u64,
        ))
        .await
        .unwrap();
    run_step(&session, &[0, 1], &expected).await;
    let memfds = std::fs::read_dir(format!("/proc/{}/fd", served.child.id()))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("/memfd:weightstream-"))
        .count();
    assert_eq!(memfds, 2, "a model and a session's staging live in memfds");
    let handoff = weightstream_client::handoff::handoff_path(&served.socket);
    assert!(handoff.exists());

    served.signal("-TERM");
    assert_eq!(recv(&notify), "STOPPING=1\nSTATUS=draining\n");
    let status = served.wait_exit();
    assert_eq!(status.code(), Some(0), "{}", served.log());
    let err = within("acquire after SIGTERM", session.acquire(2))
        .await
        .err()
        .expect("acquire after SIGTERM fails");
    match &err {
        ClientError::SessionEnded(msg) => assert!(msg.contains("stopping"), "{msg}"),
        ClientError::Unavailable { .. } => {}
        other => panic!("unexpected error after SIGTERM: {other:?}"),
    }
    assert!(!served.socket.exists(), "the socket is removed");
    assert!(!handoff.exists(), "the handoff socket is removed");
    let log = served.log();
    assert!(log.contains("SIGTERM: stopping"), "{log}");
    assert!(log.contains("stopped"), "{log}");
}

#[test]
fn sigint_stops_cleanly_without_a_notify_socket() {
    let dir = tempfile::tempdir().unwrap();
    let mut served = Served::start(dir.path(), &[], &[]);
    poll("the socket", || served.socket.exists().then_some(()));
    served.signal("-INT");
    assert_eq!(served.wait_exit().code(), Some(0), "{}", served.log());
    assert!(served.log().contains("SIGINT: stopping"));
    assert!(!served.socket.exists());
}

#[test]
fn the_socket_belongs_to_socket_group_and_is_0660() {
    let dir = tempfile::tempdir().unwrap();
    // A gid other than ours where the test may chown to it (root in CI); else our own.
    let own = std::fs::metadata(dir.path()).unwrap().gid();
    let gid = if own == 0 { 65534 } else { own };
    let mut served = Served::start(dir.path(), &["--socket-group", &gid.to_string()], &[]);
    let meta = poll("the socket", || std::fs::metadata(&served.socket).ok());
    assert_eq!(meta.gid(), gid);
    assert_eq!(meta.mode() & 0o777, 0o660);
    served.signal("-TERM");
    assert_eq!(served.wait_exit().code(), Some(0));
}

#[test]
fn an_unknown_socket_group_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut served = Served::start(dir.path(), &["--socket-group", "no-such-group-ws"], &[]);
    assert_eq!(served.wait_exit().code(), Some(1));
    let log = served.log();
    assert!(
        log.contains(
            "error: socket_group \"no-such-group-ws\": no such group in /etc/group \
             (give a numeric gid instead)"
        ),
        "{log}"
    );
}

#[test]
fn flags_override_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    // A socket the daemon could not create: the --socket flag (given by `start`) wins.
    std::fs::write(&config, "socket = \"/proc/weightstream/ws.sock\"\n").unwrap();
    let mut served = Served::start(dir.path(), &["--config", config.to_str().unwrap()], &[]);
    poll("the socket", || served.socket.exists().then_some(()));
    served.signal("-TERM");
    assert_eq!(served.wait_exit().code(), Some(0), "{}", served.log());

    let mut bad = Served::start(dir.path(), &["--metrics-listen", "nowhere"], &[]);
    assert_eq!(bad.wait_exit().code(), Some(1));
    assert!(
        bad.log().contains(
            "metrics.listen = \"nowhere\" is invalid: must be address:port, e.g. 127.0.0.1:9464"
        ),
        "{}",
        bad.log()
    );
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut out = String::new();
    stream.read_to_string(&mut out)?;
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_is_opt_in_and_stops_with_the_daemon() {
    let mut off = start_daemon().await;
    assert_eq!(off.metrics(), None);
    off.stop().await.unwrap();

    let mut on = start_daemon_with(|c| {
        c.metrics.enabled = true;
        c.metrics.listen = "127.0.0.1:0".into();
    })
    .await;
    let addr = on.metrics().expect("metrics enabled");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    let page = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
        .await
        .unwrap()
        .unwrap();
    assert!(page.starts_with("HTTP/1.0 200 OK"), "{page}");
    assert!(page.contains("\nweightstream_sessions 0.0\n"), "{page}");
    assert!(
        page.contains("\n# TYPE weightstream_device_streamed_bytes_total counter\n"),
        "{page}"
    );
    on.stop().await.unwrap();
    let after = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
        .await
        .unwrap();
    assert!(after.is_err(), "still serving after stop: {after:?}");
}
