//! The daemon under clients that misbehave and under the box's limits, run as its own
//! `weightstream serve` process: a client that stops reading its `Run` stream, a stop that
//! must give up on stuck work, a second daemon on the same socket (while the first runs,
//! while it drains, right after it), a uid opening too many connections, the process running
//! out of file descriptors, a `Run` stream that never attaches, and `weightstream release`.
//!
//! No test measures a duration: they wait for an event (a log line, an exit, a reply) under a
//! generous ceiling, and the CPU check counts clock ticks against wall ticks.

#[path = "../../e2e/tests/common/mod.rs"]
mod common;
mod served;

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use served::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use weightstream_client::{Client, proto};

/// Bytes of each tensor of the test model.
const LAYER: usize = 4096;

type RawClient = proto::weight_stream_client::WeightStreamClient<tonic::transport::Channel>;

/// A raw client on a connection the test can end as a dying client would (closing the
/// socket under the HTTP/2 stack, whatever it still has to send).
async fn killable_client(socket: &Path) -> (RawClient, StdUnixStream) {
    let path = socket.to_path_buf();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let channel = tonic::transport::Endpoint::from_static("http://weightstream.test")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let (path, tx) = (path.clone(), tx.clone());
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?.into_std()?;
                let _ = tx.send(stream.try_clone()?);
                let stream = tokio::net::UnixStream::from_std(stream)?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .expect("raw connection");
    let handle = rx.recv().await.expect("the connection's socket");
    (RawClient::new(channel), handle)
}

/// Loads a two-tensor model through `socket` and opens a session for it on a raw connection
/// of its own (the connection that will drive the session); returns the client, the
/// session's id and the connection's socket.
async fn raw_session(dir: &Path, socket: &Path) -> (RawClient, String, StdUnixStream) {
    let tensors = uniform_model(17, 2, LAYER);
    let path = write_model(dir, "m.safetensors", &tensors);
    let mut client = Client::connect(Some(socket)).await.unwrap();
    let manifest = client
        .load_model(
            &[path],
            "",
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await
        .unwrap();
    let (mut raw, connection) = killable_client(socket).await;
    let opened = raw
        .open_session(proto::OpenSessionRequest {
            model_id: manifest.model_id.clone(),
            vram_budget: 8 * LAYER as u64,
            staging_bytes: 4 * LAYER as u64,
            groups: per_tensor_groups(&manifest),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    (raw, opened.session_id, connection)
}

/// Acquires a group, then sends `n` releases of tickets the session never had: the Staged and
/// each Fault that answers them go unread.
fn flood_unread_faults(run: &RawRun, n: u64) {
    run.acquire(0, u64::MAX);
    for ticket in 1..=n {
        run.release(ticket);
    }
}

/// How often a wait for the daemon's state looks again (a condition, not a delay).
const POLL: Duration = Duration::from_millis(20);

/// A client the daemon serves (it answers GetInfo), trying again while the daemon refuses
/// (a place not yet free, descriptors not yet back); fails the test after [`DEADLINE`].
async fn served_client(socket: &Path) -> Client {
    within("a client the daemon serves", async {
        loop {
            if let Ok(mut client) = Client::connect(Some(socket)).await
                && client.info().await.is_ok()
            {
                return client;
            }
            tokio::time::sleep(POLL).await;
        }
    })
    .await
}

fn wait_for_log(served: &Served, needle: &str) {
    wait_for(&format!("log line {needle:?}"), START_DEADLINE, || {
        served.log().contains(needle)
    });
}

fn process_gone(pid: u32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

// -------------------------------------------------------------------------------------------
// Items 3 and 4: a stop always ends within its deadline

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_loses_its_session_and_cannot_hold_the_stop() {
    let dir = tempfile::tempdir().unwrap();
    let config = "drain_timeout_secs = 1\n[limits]\nclient_send_timeout_secs = 1\n";
    let mut served = Served::start_with(
        dir.path(),
        Launch {
            config: Some(config),
            ..Launch::default()
        },
    );
    let (mut raw, session_id, _connection) = raw_session(dir.path(), &served.socket).await;
    let run = RawRun::attach(&mut raw, &session_id).await.unwrap();
    // Far more Faults than every buffer on the way (the session's queue, HTTP/2 windows, the
    // socket) holds: the session ends up waiting for room, and gives up after the timeout.
    flood_unread_faults(&run, 200_000);
    wait_for_log(&served, "client stopped reading its Run stream");
    let mut observer = Client::connect(Some(&served.socket)).await.unwrap();
    within("the session to be torn down", async {
        while !observer.list_sessions().await.unwrap().is_empty() {
            tokio::time::sleep(POLL).await;
        }
    })
    .await;
    drop(observer);
    // The client still holds its connection, with a stream it will never read to its end: the
    // stop cuts it at the drain deadline and says so.
    let pid = served.pid();
    let exit = served.terminate();
    assert_eq!(exit.code(), Some(1), "{}", served.log());
    assert!(process_gone(pid));
    let log = served.log();
    assert!(
        log.contains("the stop abandoned work: 1 connection(s) still open at the drain deadline"),
        "{log}"
    );
    drop(run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_blocking_task_is_named_and_the_daemon_still_exits_with_status_1() {
    let dir = tempfile::tempdir().unwrap();
    let mut served = Served::start_with(
        dir.path(),
        Launch {
            config: Some("drain_timeout_secs = 1\n"),
            env: &[("WEIGHTSTREAM_TEST_STUCK_TASK", "true")],
            ..Launch::default()
        },
    );
    let pid = served.pid();
    // The task never returns, as a load stuck in a read would not: the runtime must not wait
    // for it at exit.
    let exit = served.terminate();
    assert_eq!(exit.code(), Some(1), "{}", served.log());
    assert!(process_gone(pid));
    let log = served.log();
    assert!(
        log.contains(
            "the stop abandoned work: blocking tasks still running: test hook: a task that \
             never returns"
        ),
        "{log}"
    );
    assert!(
        !served.socket.exists(),
        "the socket is removed all the same"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_that_drains_everything_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let mut served = Served::start(dir.path());
    let (mut raw, session_id, _connection) = raw_session(dir.path(), &served.socket).await;
    let mut run = RawRun::attach(&mut raw, &session_id).await.unwrap();
    served.send_sigterm();
    // A client that reads gets its Fault and the end of its stream.
    let fault = run.fault().await;
    assert_eq!(fault.code, proto::FaultCode::FaultShuttingDown as i32);
    let exit = served.wait_exit();
    assert_eq!(exit.code(), Some(0), "{}", served.log());
}

// -------------------------------------------------------------------------------------------
// Item 5: one daemon per socket

/// Runs a second daemon on `dir`'s socket, which must exit at once; its exit status and log.
fn second_daemon(dir: &Path) -> (std::process::ExitStatus, String) {
    let launch = Launch {
        log_name: Some("second.log"),
        ..Launch::default()
    };
    let (mut cmd, _, log) = launch.command(dir);
    let mut child = cmd.spawn().expect("run the second daemon");
    let deadline = Instant::now() + START_DEADLINE;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the second daemon did not exit: it serves beside the first\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(POLL);
    };
    (status, std::fs::read_to_string(log).unwrap_or_default())
}

fn locked_message(socket: &Path, pid: u32) -> String {
    format!(
        "error: another weightstream daemon holds {}.lock (pid {pid}): it is still running or \
         draining",
        socket.display()
    )
}

#[test]
fn a_second_daemon_on_the_same_socket_fails_at_once_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let first = Served::start(dir.path());
    let (status, stderr) = second_daemon(dir.path());
    assert_eq!(status.code(), Some(1));
    assert!(
        stderr.contains(&locked_message(&first.socket, first.pid())),
        "{stderr}"
    );
    // The first one still serves on its socket.
    StdUnixStream::connect(&first.socket).expect("the first daemon still accepts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_a_daemon_drains_no_other_starts_and_its_exit_leaves_the_next_ones_socket() {
    let dir = tempfile::tempdir().unwrap();
    let config = "drain_timeout_secs = 3600\n[limits]\nclient_send_timeout_secs = 1\n";
    let mut first = Served::start_with(
        dir.path(),
        Launch {
            config: Some(config),
            log_filter: Some("info"),
            ..Launch::default()
        },
    );
    // A client whose stream is stuck full (it stopped reading: the daemon says so) holds its
    // connection open: the drain waits for it, up to its hour.
    let (mut raw, session_id, connection) = raw_session(dir.path(), &first.socket).await;
    let run = RawRun::attach(&mut raw, &session_id).await.unwrap();
    flood_unread_faults(&run, 200_000);
    wait_for_log(&first, "client stopped reading its Run stream");
    first.send_sigterm();
    wait_for_log(&first, "stopping: closing sessions");
    let (status, stderr) = second_daemon(dir.path());
    assert_eq!(status.code(), Some(1));
    assert!(
        stderr.contains(&locked_message(&first.socket, first.pid())),
        "{stderr}"
    );
    // The client dies: the first daemon's drain ends, and it lets its lock go.
    connection.shutdown(std::net::Shutdown::Both).unwrap();
    drop((run, raw));
    let lock = std::fs::File::open(weightstream_daemon::server::lock_path(&first.socket)).unwrap();
    tokio::task::spawn_blocking(move || {
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
        // Dropping the file lets the lock go again, for the next daemon.
    })
    .await
    .unwrap();
    // At once, while the first may still be on its way out.
    let next = Served::start_with(
        dir.path(),
        Launch {
            log_name: Some("next.log"),
            ..Launch::default()
        },
    );
    let bound = std::fs::symlink_metadata(&next.socket).unwrap().ino();
    let exit = first.wait_exit();
    assert_eq!(exit.code(), Some(0), "{}", first.log());
    let now = std::fs::symlink_metadata(&next.socket).map(|m| m.ino());
    assert_eq!(
        now.ok(),
        Some(bound),
        "the first daemon's exit removed the next one's socket"
    );
    served_client(&next.socket).await;
}

// -------------------------------------------------------------------------------------------
// Item 9: the accept loop and idle peers

/// Whether the daemon closed this connection: a read sees the end of the stream (bounded).
fn closed_by_daemon(mut stream: StdUnixStream) -> bool {
    stream
        .set_read_timeout(Some(START_DEADLINE))
        .expect("read timeout");
    let mut buf = [0u8; 64];
    matches!(stream.read(&mut buf), Ok(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uid_over_its_connection_limit_has_the_extra_one_closed_and_the_others_work() {
    let dir = tempfile::tempdir().unwrap();
    let mut served = Served::start_with(
        dir.path(),
        Launch {
            config: Some("[limits]\nmax_connections_per_uid = 3\n"),
            ..Launch::default()
        },
    );
    // A probe's connection (the start-up's own) may still be counted for a moment.
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(served_client(&served.socket).await);
    }
    let extra = StdUnixStream::connect(&served.socket).unwrap();
    assert!(closed_by_daemon(extra), "the fourth connection stays open");
    let uid = rustix::process::getuid().as_raw();
    wait_for_log(
        &served,
        &format!(
            "uid {uid} already holds 3 connections, the limit is \
             limits.max_connections_per_uid = 3: connection closed"
        ),
    );
    for client in &mut clients {
        client.info().await.expect("the others still work");
    }
    // A closed connection gives its place back.
    clients.pop();
    served_client(&served.socket).await;
    drop(clients);
    assert_eq!(served.terminate().code(), Some(0), "{}", served.log());
}

/// utime + stime of a process, in clock ticks (`/proc/PID/stat` fields 14 and 15).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Field 3 (state) is the first after the name: utime is field 14, stime field 15.
    let utime: u64 = fields[14 - 3].parse().unwrap();
    let stime: u64 = fields[15 - 3].parse().unwrap();
    utime + stime
}

/// Clock ticks per second (`getconf CLK_TCK`).
fn ticks_per_second() -> u64 {
    let out = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_the_daemon_backs_off_then_serves_again() {
    const WARNING: &str = "accept failed: out of file descriptors or memory; backing off";
    let dir = tempfile::tempdir().unwrap();
    let mut served = Served::start_with(
        dir.path(),
        Launch {
            config: Some("[limits]\nmax_connections_per_uid = 1000\n"),
            wrapper: &["prlimit", "--nofile=64:64", "--"],
            ..Launch::default()
        },
    );
    // More connections than the daemon has descriptors for: those it cannot accept wait in
    // the listen queue, and accept fails with EMFILE.
    let idle: Vec<StdUnixStream> = (0..100)
        .map(|_| StdUnixStream::connect(&served.socket).unwrap())
        .collect();
    wait_for_log(&served, WARNING);
    let (pid, start_cpu, start_wall) = (served.pid(), cpu_ticks(served.pid()), Instant::now());
    // The warning comes at most once a second while accept keeps failing: two more of them
    // span at least two seconds of it.
    wait_for("two more warnings", START_DEADLINE, || {
        served.log().matches(WARNING).count() >= 3
    });
    let cpu = cpu_ticks(pid) - start_cpu;
    let wall = start_wall.elapsed().as_secs_f64() * ticks_per_second() as f64;
    // A daemon that retried accept at once would burn a whole core meanwhile.
    assert!(
        (cpu as f64) < 0.5 * wall,
        "the daemon used {cpu} clock ticks of CPU in {wall:.0} ticks of wall time"
    );
    // The idle connections go: the daemon gets its descriptors back, and serves again.
    drop(idle);
    served_client(&served.socket).await;
    assert_eq!(served.terminate().code(), Some(0), "{}", served.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stream_that_never_attaches_ends_with_deadline_exceeded() {
    let dir = tempfile::tempdir().unwrap();
    let served = Served::start_with(
        dir.path(),
        Launch {
            config: Some("[limits]\nattach_timeout_secs = 1\n"),
            ..Launch::default()
        },
    );
    let mut raw = raw_client(&served.socket).await;
    let (tx, rx) = mpsc::unbounded_channel::<proto::ClientMessage>();
    let status = within(
        "the Run call's answer",
        raw.run(UnboundedReceiverStream::new(rx)),
    )
    .await
    .expect_err("a Run stream without attach is refused");
    assert_eq!(
        (status.code(), status.message()),
        (tonic::Code::DeadlineExceeded, "Run: no attach within 1 s")
    );
    drop(tx);
    raw.get_info(proto::GetInfoRequest {})
        .await
        .expect("the connection still serves");
}

// -------------------------------------------------------------------------------------------
// Item 14: a model reference belongs to the uid, and `weightstream release` gives it back

fn weightstream(args: &[&str], socket: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_weightstream"))
        .args(args)
        .arg("--socket")
        .arg(socket)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_model_outlives_the_load_command_until_weightstream_release() {
    let dir = tempfile::tempdir().unwrap();
    let served = Served::start(dir.path());
    let path = write_model(dir.path(), "m.safetensors", &uniform_model(3, 2, LAYER));
    let load = weightstream(&["load", path.to_str().unwrap()], &served.socket);
    let loaded = String::from_utf8_lossy(&load.stdout);
    assert!(load.status.success(), "{loaded}");
    let model_id = loaded.split_whitespace().next().unwrap().to_string();
    let mut client = Client::connect(Some(&served.socket)).await.unwrap();
    assert!(
        model_listed(&mut client, &model_id).await.is_some(),
        "the model went with the load command's connection"
    );
    let release = weightstream(&["release", &model_id], &served.socket);
    let released = String::from_utf8_lossy(&release.stdout);
    assert!(release.status.success(), "{released}");
    assert!(
        released.contains(&format!("{model_id}  released  (references left: 0;")),
        "{released}"
    );
    assert!(model_listed(&mut client, &model_id).await.is_none());
    let again = weightstream(&["release", &model_id], &served.socket);
    assert_eq!(again.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        stderr.contains(&format!("holds no reference to model_id '{model_id}'")),
        "{stderr}"
    );
}
