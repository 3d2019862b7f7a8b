//! The attacker of `security.rs` and `security_store.rs`: user `ws-attacker` (tests/run.sh
//! creates it when run as root), running the test binary that includes this module again, as
//! its `attacker::attacker_acts`, to do one thing to the daemon and print what it got
//! (`RESULT …`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use weightstream_client::{HandoffError, proto};
use weightstream_daemon::config::ConfigFile;

use super::common::*;

/// Held shared by every fork of this test process (the attacker's), until its child has
/// exec'd (std's `spawn` and `output` return no sooner): a forked child holds a copy of each of
/// the test process's fds and mappings until then, so a region a test closes may outlive that
/// close in another test's child for a moment. A test that checks that its own last close
/// frees a region holds it exclusively from before it takes the region's fd ([`no_forks`]).
static FORKS: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// No test of this binary forks while the guard lives (see [`FORKS`]). A test holds it across
/// its awaits: only the other tests' threads, each running its own runtime, contend for it.
#[allow(
    dead_code,
    reason = "not every binary that includes this module frees regions"
)]
pub fn no_forks() -> std::sync::RwLockWriteGuard<'static, ()> {
    FORKS.write().unwrap_or_else(|p| p.into_inner())
}

fn forking<T>(fork: impl FnOnce() -> T) -> T {
    let _shared = FORKS.read().unwrap_or_else(|p| p.into_inner());
    fork()
}

/// The name of the attacker's test, as the test harness spells it.
const ATTACKER_TEST: &str = "attacker::attacker_acts";

/// The attacker's side: what `WS_ATTACK` says, printing one `RESULT` line. Runs only as the
/// child of a test in the binary that includes this module.
#[test]
#[ignore = "the attacker of the tests in this binary; runs only as their child"]
fn attacker_acts() {
    let Ok(action) = std::env::var("WS_ATTACK") else {
        return;
    };
    let socket = PathBuf::from(std::env::var("WS_SOCKET").unwrap());
    let args: Vec<String> = std::env::var("WS_ARGS")
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let result = rt.block_on(act(&action, &socket, &args));
    println!("RESULT {result}");
}

/// User `ws-attacker`'s uid and gid; `None` (the test is skipped) when this is not root or
/// the user does not exist, unless WEIGHTSTREAM_REQUIRE_ROOT=1, which fails the test instead.
pub fn attacker() -> Option<(u32, u32)> {
    let required = std::env::var("WEIGHTSTREAM_REQUIRE_ROOT").is_ok_and(|v| v == "1");
    let skip = |why: &str| {
        assert!(!required, "WEIGHTSTREAM_REQUIRE_ROOT=1: {why}");
        eprintln!("skipped: {why}");
        None
    };
    if !rustix::process::geteuid().is_root() {
        return skip("the attacker runs as another uid: run the tests as root");
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let found = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 || f[0] != "ws-attacker" {
            return None;
        }
        Some((f[2].parse().ok()?, f[3].parse().ok()?))
    });
    match found {
        Some(ids) => Some(ids),
        None => skip("no user ws-attacker (tests/run.sh creates it)"),
    }
}

/// A daemon the attacker can reach: the socket's group is the attacker's group, and the
/// socket's directory is open to it.
pub async fn daemon_for(attacker_gid: u32, adjust: impl FnOnce(&mut ConfigFile)) -> TestDaemon {
    let daemon = start_daemon_with(|c| {
        c.socket_group = Some(attacker_gid.to_string());
        adjust(c);
    })
    .await;
    let dir = daemon.socket.parent().unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    daemon
}

/// This test binary, where `ws-attacker` may run it: where it is, or (when it lies under a
/// directory closed to others, a home say) a copy in a temporary directory.
fn attacker_exe((uid, gid): (u32, u32)) -> &'static Path {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let mut list = Command::new(&exe);
        list.args(["--list", "--exact", ATTACKER_TEST])
            .current_dir("/")
            .uid(uid)
            .gid(gid);
        let runs = forking(|| list.output()).is_ok_and(|o| o.status.success());
        if runs {
            return exe;
        }
        // One place per test binary, reused by later runs (rewritten: it may be stale).
        let tag = blake3::hash(exe.as_os_str().as_encoded_bytes()).to_hex();
        let dir = std::env::temp_dir().join(format!("ws-attacker-{}", &tag[..16]));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (partial, copy) = (
            dir.join(std::process::id().to_string()),
            dir.join("attacker"),
        );
        std::fs::copy(&exe, &partial).unwrap();
        std::fs::rename(&partial, &copy).unwrap();
        copy
    })
}

/// Runs this test binary's `attacker_acts` as `ws-attacker`, doing `action` with `args`.
pub fn spawn_attacker(ids: (u32, u32), socket: &Path, action: &str, args: &[&str]) -> Child {
    spawn_attacker_in(ids, &[], socket, action, args)
}

/// As [`spawn_attacker`], with `groups` as the attacker's supplementary groups (none: none).
/// std's `Command` sets no supplementary groups on stable Rust; util-linux's `setpriv` does.
pub fn spawn_attacker_in(
    ids: (u32, u32),
    groups: &[u32],
    socket: &Path,
    action: &str,
    args: &[&str],
) -> Child {
    let (uid, gid) = ids;
    let mut command = if groups.is_empty() {
        let mut plain = Command::new(attacker_exe(ids));
        plain.uid(uid).gid(gid);
        plain
    } else {
        let list: Vec<String> = groups.iter().map(u32::to_string).collect();
        let mut setpriv = Command::new("setpriv");
        setpriv
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={gid}"))
            .arg(format!("--groups={}", list.join(",")))
            .arg("--")
            .arg(attacker_exe(ids));
        setpriv
    };
    command
        .args(["--exact", ATTACKER_TEST, "--ignored", "--nocapture"])
        .current_dir("/")
        .env("WS_ATTACK", action)
        .env("WS_SOCKET", socket)
        .env("WS_ARGS", args.join("\n"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    forking(|| command.spawn()).expect("spawn the attacker")
}

/// The attacker's first `RESULT` line (what it got). Its output is read to the end on a
/// thread of its own (a closed pipe would fail the attacker's last words).
pub async fn result_of(child: &mut Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(result) = line.strip_prefix("RESULT ") {
                let _ = tx.send(result.to_string());
            }
        }
    });
    let first = tokio::task::spawn_blocking(move || rx.recv_timeout(DEADLINE));
    within("the attacker's result", first)
        .await
        .unwrap()
        .expect("the attacker printed no RESULT (it panicked: see its output above)")
}

/// Runs the attacker to its end; what it got.
pub async fn attack(ids: (u32, u32), socket: &Path, action: &str, args: &[&str]) -> String {
    attack_in(ids, &[], socket, action, args).await.1
}

/// Runs the attacker in `groups` to its end: its pid, and what it got.
pub async fn attack_in(
    ids: (u32, u32),
    groups: &[u32],
    socket: &Path,
    action: &str,
    args: &[&str],
) -> (u32, String) {
    let mut child = spawn_attacker_in(ids, groups, socket, action, args);
    let pid = child.id();
    drop(child.stdin.take());
    let result = result_of(&mut child).await;
    let status = tokio::task::spawn_blocking(move || child.wait()).await;
    assert!(status.unwrap().unwrap().success(), "the attacker failed");
    (pid, result)
}

/// A shared writable mapping of `len` bytes of `file`.
fn shared_map(file: &std::fs::File, len: usize) -> memmap2::MmapMut {
    // SAFETY: the file is the attacker's own and nothing else truncates it while mapped.
    unsafe { memmap2::MmapOptions::new().len(len).map_mut(file).unwrap() }
}

fn status_line(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

pub async fn act(action: &str, socket: &Path, args: &[String]) -> String {
    let names: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    match action {
        // Open a file, as the attacker.
        "open" => match std::fs::File::open(&args[0]) {
            Ok(_) => "opened".into(),
            Err(e) => format!("errno {}", e.raw_os_error().unwrap_or(0)),
        },
        // LoadModel with a token (args[0]; may be empty) and display paths.
        "load-token" => {
            let mut rpc = raw_client(socket).await;
            match load_with_token(&mut rpc, &names, &args[0]).await {
                Ok(m) => format!("loaded {}", m.model_id),
                Err(s) => status_line(&s),
            }
        }
        // Pass its own file (args[0]) and name it as it likes (args[1..]).
        "load-own" => {
            let mut rpc = raw_client(socket).await;
            match raw_load(&mut rpc, socket, &[PathBuf::from(&args[0])], &names).await {
                Ok(m) => {
                    let mut tensors: Vec<&str> =
                        m.tensors.iter().map(|t| t.name.as_str()).collect();
                    tensors.sort();
                    format!(
                        "loaded {} named {} with {}",
                        m.model_id,
                        m.name,
                        tensors.join(",")
                    )
                }
                Err(s) => status_line(&s),
            }
        }
        // ListModels through the client at the socket it finds itself (no --socket, no
        // XDG_RUNTIME_DIR, no system socket: the fallback directory).
        "list-implicit" => {
            use weightstream_client::socket::{SYSTEM_SOCKET, SocketCandidates};
            let uid = rustix::process::getuid().as_raw();
            let found = SocketCandidates::new(None, Path::new(SYSTEM_SOCKET), None, uid);
            match weightstream_client::Client::connect_to(found.for_client()).await {
                Ok(mut client) => match client.list_models().await {
                    Ok(listed) => format!("listed {} models", listed.models.len()),
                    Err(e) => format!("failed: {e}"),
                },
                Err(e) => format!("failed: {e}"),
            }
        }
        // GetInfo: whether the daemon serves it.
        "info" => match raw_client(socket)
            .await
            .get_info(proto::GetInfoRequest {})
            .await
        {
            Ok(_) => "served".into(),
            Err(s) => status_line(&s),
        },
        // ListModels through the client (every page): the ids, in order.
        "list" => {
            let mut client = weightstream_client::Client::connect(Some(socket))
                .await
                .unwrap();
            match client.list_models().await {
                Ok(listed) => (listed.models.iter())
                    .map(|m| m.model_id.as_str())
                    .collect::<Vec<_>>()
                    .join(","),
                Err(e) => format!("failed: {e}"),
            }
        }
        // Each arg is "commit ID", "abort ID", "close ID", "release ID", "state SESSION" (a
        // state region of 4096 bytes for the session) or "free SESSION REGION": what the daemon
        // answers each.
        "touch" => {
            let mut rpc = raw_client(socket).await;
            let mut got = Vec::new();
            for arg in args {
                let (what, id) = arg.split_once(' ').unwrap();
                let id = id.to_string();
                let answer = match what {
                    "commit" => (rpc.commit_upload(proto::CommitUploadRequest {
                        retention: proto::Retention::Cached as i32,
                        upload_id: id,
                        ..Default::default()
                    }))
                    .await
                    .map(|_| ()),
                    "abort" => (rpc.abort_upload(proto::AbortUploadRequest { upload_id: id }))
                        .await
                        .map(|_| ()),
                    "close" => (rpc.close_session(proto::CloseSessionRequest { session_id: id }))
                        .await
                        .map(|_| ()),
                    "release" => (rpc.release_model(proto::ReleaseModelRequest {
                        model_id: id,
                        ..Default::default()
                    }))
                    .await
                    .map(|_| ()),
                    "state" => (rpc.alloc_state_region(proto::AllocStateRegionRequest {
                        session_id: id,
                        bytes: 4096,
                        label: "theirs".into(),
                    }))
                    .await
                    .map(|_| ()),
                    "free" => {
                        let (session_id, region_id) = id.split_once(' ').unwrap();
                        (rpc.free_state_region(proto::FreeStateRegionRequest {
                            session_id: session_id.into(),
                            region_id: region_id.into(),
                        }))
                        .await
                        .map(|_| ())
                    }
                    other => panic!("unknown touch {other}"),
                };
                got.push(match answer {
                    Ok(()) => "done".to_string(),
                    Err(s) => status_line(&s),
                });
            }
            got.join(" | ")
        }
        // Map its file args[0] shared and writable (its pages written once, so that later
        // writes fault nothing), load it, then write args[1]'s bytes through the mapping:
        // the file changes and its stat does not. Prints the model, keeps the mapping until
        // stdin closes.
        "rewrite-mapped" => {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&args[0])
                .unwrap();
            let len = file.metadata().unwrap().len() as usize;
            let mut map = shared_map(&file, len);
            let original = map.to_vec();
            map.copy_from_slice(&original);
            let stat = || {
                use std::os::unix::fs::MetadataExt;
                let m = file.metadata().unwrap();
                (
                    m.ino(),
                    m.size(),
                    m.mtime(),
                    m.mtime_nsec(),
                    m.ctime(),
                    m.ctime_nsec(),
                )
            };
            let mut rpc = raw_client(socket).await;
            let path = PathBuf::from(&args[0]);
            let at_load = stat();
            let loaded = raw_load(&mut rpc, socket, &[path], &[&args[0]]).await;
            let replacement = std::fs::read(&args[1]).unwrap();
            map.copy_from_slice(&replacement);
            let same = if stat() == at_load { "same" } else { "another" };
            match loaded {
                Ok(m) => println!("RESULT loaded {} ({same} stat)", m.model_id),
                Err(s) => println!("RESULT {}", status_line(&s)),
            }
            std::io::stdout().flush().unwrap();
            tokio::task::spawn_blocking(|| std::io::stdin().lines().count())
                .await
                .unwrap();
            drop(map);
            "unmapped".into()
        }
        // Upload a model of one tensor of args[1] bytes (seed args[2]) whose reference lasts
        // as args[0] says (cached, connection, pinned); print its id, exit.
        "upload" => {
            let retention = match args[0].as_str() {
                "cached" => proto::Retention::Cached,
                "connection" => proto::Retention::Connection,
                "pinned" => proto::Retention::Pinned,
                other => panic!("unknown retention {other}"),
            };
            let client = weightstream_client::Client::connect(Some(socket))
                .await
                .unwrap();
            let mut client = client.with_retention(retention);
            let tensors = uniform_model(args[2].parse().unwrap(), 1, args[1].parse().unwrap());
            let data: Vec<_> = tensors.iter().map(Tensor::as_upload).collect();
            match client.upload_model("job", &data).await {
                Ok((m, _)) => format!("uploaded {}", m.model_id),
                Err(e) => format!("failed: {e}"),
            }
        }
        // ReleaseModel of args[0] for every uid.
        "release-all" => {
            let mut client = weightstream_client::Client::connect(Some(socket))
                .await
                .unwrap();
            match client.release_model_for_all(&args[0]).await {
                Ok(_) => "released".into(),
                Err(e) => format!("failed: {e}"),
            }
        }
        // GET each secret.
        "get" => {
            let mut got = Vec::new();
            for secret in args {
                got.push(match fetch_fd(socket, secret).await {
                    Ok((_, size)) => format!("got {size} bytes"),
                    Err(HandoffError::Refused(m)) => format!("refused: {m}"),
                    Err(e) => format!("failed: {e}"),
                });
            }
            got.join(" | ")
        }
        // Open a session on model args[0] and keep it until stdin closes.
        "session" => {
            let mut client = weightstream_client::Client::connect(Some(socket))
                .await
                .unwrap();
            let manifest = model_listed(&mut client, &args[0]).await.unwrap();
            let groups = per_tensor_groups(&manifest);
            let session = client
                .open_session(options(&args[0], groups, 0, 1 << 20))
                .await
                .unwrap();
            println!("RESULT session {}", session.id());
            std::io::stdout().flush().unwrap();
            tokio::task::spawn_blocking(|| std::io::stdin().lines().count())
                .await
                .unwrap();
            session.close().await.unwrap();
            "closed".into()
        }
        // Open args[0] connections to the handoff socket and send nothing on them; say what
        // the last one was told (within the test's deadline); keep them until stdin closes.
        "hold-handoff" => {
            use std::io::Read;
            let n: usize = args[0].parse().unwrap();
            let path = weightstream_client::handoff::handoff_path(socket);
            let held: Vec<std::os::unix::net::UnixStream> = (0..n)
                .map(|_| std::os::unix::net::UnixStream::connect(&path).unwrap())
                .collect();
            let last = held.last().unwrap();
            last.set_read_timeout(Some(DEADLINE)).unwrap();
            let mut told = String::new();
            let told = match (&*last).read_to_string(&mut told) {
                Ok(_) => told.trim_end().to_string(),
                Err(e) => format!("nothing ({e})"),
            };
            println!("RESULT holding {n} connections; the last was told: {told}");
            std::io::stdout().flush().unwrap();
            tokio::task::spawn_blocking(|| std::io::stdin().lines().count())
                .await
                .unwrap();
            drop(held);
            "closed".into()
        }
        // Issue 27's hoard, twice: BeginUpload of args[1] bytes and OpenSession on model
        // args[0] with args[1] bytes of staging, each region's fd fetched and kept, each
        // connection dropped; then the fds go to a child (`sleep`) that outlives this process.
        "hoard" => {
            let size: u64 = args[1].parse().unwrap();
            let mut kept = Vec::new();
            let mut said = Vec::new();
            for round in 1..=2 {
                let mut rpc = raw_client(socket).await;
                let request = proto::BeginUploadRequest {
                    name: "hoard".into(),
                    tensors: vec![proto::TensorInfo {
                        name: "w".into(),
                        dtype: proto::Dtype::U8 as i32,
                        shape: vec![size],
                        ..Default::default()
                    }],
                    client_reserves: false,
                };
                match rpc.begin_upload(request).await {
                    Ok(begun) => {
                        let secret = begun.into_inner().fd_secret;
                        kept.push(fetch_fd(socket, &secret).await.unwrap().0);
                    }
                    Err(status) => said.push(status_line(&status)),
                }
                let request = proto::OpenSessionRequest {
                    model_id: args[0].clone(),
                    vram_budget: size,
                    staging_bytes: size,
                    groups: vec![group("g", &["layers.0.weight"])],
                    ..Default::default()
                };
                match rpc.open_session(request).await {
                    Ok(opened) => {
                        let regions = opened.into_inner().regions;
                        kept.push(fetch_fd(socket, fd_secret(&regions[0])).await.unwrap().0);
                    }
                    Err(status) => said.push(status_line(&status)),
                }
                drop(rpc);
                // The daemon has dropped this connection's upload and session.
                let mut info = raw_client(socket).await;
                let usage = within("the connection's upload and session go", async {
                    loop {
                        let asked = info.get_info(proto::GetInfoRequest {}).await;
                        let usage = asked.unwrap().into_inner().usage.unwrap();
                        if usage.uploads == 0 && usage.sessions == 0 {
                            break usage;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                })
                .await;
                said.push(format!(
                    "after round {round}: host {}, device {}",
                    usage.host_bytes, usage.device_bytes
                ));
            }
            // Copies without close-on-exec, for the child to inherit.
            let passed: Vec<_> = kept.iter().map(|fd| rustix::io::dup(fd).unwrap()).collect();
            // Left running on purpose: it outlives this process, and the test kills it.
            #[allow(clippy::zombie_processes)]
            let child = Command::new("sleep")
                .arg("60")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            drop(passed);
            said.push(format!("passed to pid {}", child.id()));
            said.join(" | ")
        }
        other => panic!("unknown attack {other}"),
    }
}
