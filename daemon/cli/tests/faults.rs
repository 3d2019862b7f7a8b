//! Faults on both sides of the socket, with the daemon as its own `weightstream serve` process:
//! - trainer processes SIGKILLed at seeded-random points of a step (mid-upload, mid-acquire,
//!   holding tickets, anywhere in a busy loop), many times over, while a well-behaved trainer
//!   keeps stepping: nothing leaks (sessions, shared-memory files, the daemon's fds and
//!   memory) and the other trainer keeps getting exact bytes;
//! - the daemon killed or stopped under a running trainer: the next acquire fails within
//!   seconds, and `Session::reconnect` resumes the trainer against the restarted daemon.
//!
//! The killed trainers are this test binary run again as a child (`fault_client`, an ignored
//! test that does nothing unless `WS_CHILD_SOCKET` is set).

#[path = "../../e2e/tests/common/mod.rs"]
mod common;
mod served;

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use rand::{Rng, SeedableRng};
use served::*;
use weightstream_client::{Client, ClientError, proto};

/// Bytes of each layer: a multiple of the alignment, so every group is exactly this size and
/// the staging arenas (whole numbers of layers) never fragment.
const LAYER: usize = 64 << 10;
/// Layers of the model every trainer streams (the parent loads it from a file).
const LAYERS: u32 = 8;
/// Layers of the model each child uploads (the same bytes every time: one deduplicated id).
const CHILD_LAYERS: usize = 4;
const CHILD_MODEL_SEED: u64 = 901;
/// Killed children in CI; `WEIGHTSTREAM_FAULT_CLIENTS` asks for more.
const DEFAULT_CHILDREN: usize = 40;
/// How much the daemon's resident memory may grow from its level after warm-up to its level
/// after all the killed clients (measured: see `killed_clients_leak_nothing`).
const RSS_SLACK_KIB: u64 = 4 << 10;
/// The fault: how long a failure may take to reach the client after the daemon goes.
const FAIL_FAST: Duration = Duration::from_secs(5);

fn forward_backward(n: u32) -> Vec<u32> {
    (0..n).chain((0..n).rev()).collect()
}

fn layer_options(
    model_id: &str,
    manifest: &proto::ModelManifest,
    staging: u64,
    budget: u64,
) -> weightstream_client::SessionOptions {
    let layer = LAYER as u64;
    options(
        model_id,
        per_tensor_groups(manifest),
        staging * layer,
        budget * layer,
    )
}

// ---------------------------------------------------------------------------------------------
// The child: a trainer that SIGKILLs itself at checkpoint `WS_CHILD_KILL_AT`, or runs to the
// end (then a busy loop of `WS_CHILD_LOOP` random acquires, for the parent to kill anywhere).

struct Checkpoints {
    next: u32,
    kill_at: Option<u32>,
}

impl Checkpoints {
    /// Announces checkpoint `label` to the parent; dies here if it is the chosen one.
    fn reach(&mut self, label: &str) {
        let mut out = std::io::stdout().lock();
        writeln!(out, "WS cp {} {label}", self.next).unwrap();
        out.flush().unwrap();
        if self.kill_at == Some(self.next) {
            // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            loop {
                std::thread::park();
            }
        }
        self.next += 1;
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the parent"))
}

/// Writes `tensors[range]` into the upload's region (`region`: its fd, from the handoff
/// socket) through a mapping that is gone on return (the daemon seals the region at commit,
/// which it refuses while a writable mapping exists).
fn write_upload_part(
    region: &std::fs::File,
    begun: &proto::BeginUploadResponse,
    tensors: &[Tensor],
    range: std::ops::Range<usize>,
) {
    // SAFETY: the daemon made this memfd for this upload, sealed it against shrinking, and
    // reads it only after the commit.
    let mut map = unsafe { memmap2::MmapMut::map_mut(region) }.expect("map the upload region");
    for i in range {
        let start = begun.tensors[i].offset as usize;
        map[start..start + tensors[i].bytes.len()].copy_from_slice(&tensors[i].bytes);
    }
}

#[test]
#[ignore = "the killed trainer of killed_clients_leak_nothing; runs only as its child"]
fn fault_client() {
    if std::env::var_os("WS_CHILD_SOCKET").is_none() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(child_trainer());
}

async fn child_trainer() {
    let socket = PathBuf::from(env("WS_CHILD_SOCKET"));
    let model_path = PathBuf::from(env("WS_CHILD_MODEL_PATH"));
    let model_id = env("WS_CHILD_MODEL");
    let kill_at = env("WS_CHILD_KILL_AT").parse().ok();
    let loops: u32 = env("WS_CHILD_LOOP").parse().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(env("WS_CHILD_SEED").parse().unwrap());
    let mut cp = Checkpoints { next: 0, kill_at };
    let expected = read_model(&[model_path]);

    let mut client = Client::connect(Some(&socket)).await.unwrap();
    cp.reach("connected");
    // The upload on a connection of its own (the daemon ties an upload to its connection).
    let child_tensors = uniform_model(CHILD_MODEL_SEED, CHILD_LAYERS, LAYER);
    let child_expected: BTreeMap<String, Tensor> = child_tensors
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    let mut raw = raw_client(&socket).await;
    let begin = proto::BeginUploadRequest {
        name: "child".into(),
        tensors: child_tensors
            .iter()
            .map(|t| proto::TensorInfo {
                name: t.name.clone(),
                dtype: pb_dtype(t.dtype) as i32,
                shape: t.dims.clone(),
                nbytes: t.bytes.len() as u64,
                ..Default::default()
            })
            .collect(),
        client_reserves: false,
    };
    let begun = raw.begin_upload(begin).await.unwrap().into_inner();
    let (region, _) = fetch_fd(&socket, &begun.fd_secret).await.unwrap();
    let region = std::fs::File::from(region);
    cp.reach("upload begun");
    write_upload_part(&region, &begun, &child_tensors, 0..CHILD_LAYERS / 2);
    cp.reach("upload half written");
    write_upload_part(
        &region,
        &begun,
        &child_tensors,
        CHILD_LAYERS / 2..CHILD_LAYERS,
    );
    let commit = proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: begun.upload_id.clone(),
        ..Default::default()
    };
    let committed = raw.commit_upload(commit).await.unwrap().into_inner();
    let child_manifest = committed.manifest.unwrap();
    cp.reach("upload committed");

    let manifest = model_listed(&mut client, &model_id)
        .await
        .expect("the parent's model");
    let a = client
        .open_session(layer_options(&model_id, &manifest, 3, 4))
        .await
        .unwrap();
    let b = client
        .open_session(layer_options(
            &child_manifest.model_id,
            &child_manifest,
            3,
            3,
        ))
        .await
        .unwrap();
    cp.reach("sessions open");
    // The sessions keep the uploaded model alive from here.
    client
        .release_model(&child_manifest.model_id)
        .await
        .unwrap();
    cp.reach("child model released");

    for _step in 0..2 {
        let mut held = VecDeque::new();
        for g in forward_backward(LAYERS) {
            let acquired = a.acquire(g).await.unwrap();
            check_acquired(&acquired, &expected);
            held.push_back(acquired);
            if held.len() > 2 {
                held.pop_front();
            }
            cp.reach("holding tickets");
        }
        drop(held);
        a.end_step();
        // Three acquires in flight at once; die when the first is staged.
        let acquires: Vec<_> = (0..3).map(|g| Box::pin(b.acquire(g))).collect();
        let (first, _, rest) = futures::future::select_all(acquires).await;
        let first = first.unwrap();
        cp.reach("mid-acquire");
        check_acquired(&first, &child_expected);
        for acquired in futures::future::join_all(rest).await {
            check_acquired(&acquired.unwrap(), &child_expected);
        }
    }
    cp.reach("steps done");

    // The parent kills us somewhere in here (it counts the lines).
    let mut held = VecDeque::new();
    for i in 0..loops {
        let g = rng.random_range(0..LAYERS);
        let acquired = a.acquire(g).await.unwrap();
        check_acquired(&acquired, &expected);
        held.push_back(acquired);
        if held.len() > rng.random_range(1..=2) {
            held.pop_front();
        }
        if rng.random_bool(0.05) {
            a.send_plan((0..LAYERS).rev().collect());
        }
        println!("WS iter {i}");
    }
    drop(held);
    a.close().await.unwrap();
    b.close().await.unwrap();
    cp.reach("closed");
}

/// How a child ends.
#[derive(Debug, Clone, Copy)]
enum Fate {
    /// Runs to the end.
    Completes,
    /// SIGKILLs itself at this checkpoint.
    KillsItselfAt(u32),
    /// The parent SIGKILLs it once it has printed this iteration of its busy loop.
    KilledAtIteration(u32),
}

/// Runs one child to its fate; returns the labels of the checkpoints it reached.
fn run_child(
    served: &Served,
    model_path: &Path,
    model_id: &str,
    seed: u64,
    fate: Fate,
) -> Vec<String> {
    let (kill_at, loops) = match fate {
        Fate::Completes => ("none".to_string(), 0),
        Fate::KillsItselfAt(n) => (n.to_string(), 0),
        Fate::KilledAtIteration(_) => ("none".to_string(), 10_000),
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "fault_client",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("WS_CHILD_SOCKET", &served.socket)
        .env("WS_CHILD_MODEL_PATH", model_path)
        .env("WS_CHILD_MODEL", model_id)
        .env("WS_CHILD_KILL_AT", kill_at)
        .env("WS_CHILD_LOOP", loops.to_string())
        .env("WS_CHILD_SEED", seed.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child trainer");
    let mut labels = Vec::new();
    let mut killed_by_parent = false;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        // libtest prints `test fault_client ... ` before the test's first line.
        let line = line.find("WS ").map_or("", |at| &line[at..]);
        if let Some(rest) = line.strip_prefix("WS cp ") {
            let (n, label) = rest.split_once(' ').unwrap();
            assert_eq!(n.parse::<usize>().unwrap(), labels.len());
            labels.push(label.to_string());
        } else if let Some(i) = line.strip_prefix("WS iter ")
            && let Fate::KilledAtIteration(k) = fate
            && i.parse::<u32>().unwrap() == k
        {
            child.kill().unwrap();
            killed_by_parent = true;
            break;
        }
    }
    let status = child.wait().unwrap();
    let stderr = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    match fate {
        Fate::Completes => assert!(status.success(), "child failed ({status}):\n{stderr}"),
        Fate::KillsItselfAt(n) => {
            assert_eq!(
                status.signal(),
                Some(libc::SIGKILL),
                "{fate:?}: {status}\n{stderr}"
            );
            assert_eq!(labels.len(), n as usize + 1, "{fate:?}");
        }
        Fate::KilledAtIteration(_) => {
            assert!(killed_by_parent, "{fate:?}: the loop ended first\n{stderr}");
            assert_eq!(
                status.signal(),
                Some(libc::SIGKILL),
                "{fate:?}: {status}\n{stderr}"
            );
        }
    }
    labels
}

async fn session_ids(client: &mut Client) -> Vec<String> {
    let listed = client.list_sessions().await.expect("ListSessions");
    listed.into_iter().map(|s| s.session_id).collect()
}

/// Trainers SIGKILLed at seeded-random checkpoints of a step, and by the parent at random
/// points of a busy loop: afterwards the daemon has exactly the sessions, shared-memory files,
/// models and fds it had after warm-up, its RSS within `RSS_SLACK_KIB`; a trainer running
/// the whole time got exact bytes on every acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_clients_leak_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let served = Served::start(dir.path());
    let model_path = write_model(
        dir.path(),
        "m.safetensors",
        &uniform_model(41, LAYERS as usize, LAYER),
    );
    let expected = read_model(std::slice::from_ref(&model_path));
    let mut client = Client::connect(Some(&served.socket)).await.unwrap();
    let manifest = load(&mut client, std::slice::from_ref(&model_path), &expected).await;
    let model_id = manifest.model_id.clone();

    // The well-behaved trainer, stepping until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let survivor = {
        let (socket, stop, expected) = (served.socket.clone(), stop.clone(), expected.clone());
        let opts = layer_options(&model_id, &manifest, 3, 4);
        tokio::spawn(async move {
            let mut client = Client::connect(Some(&socket)).await.unwrap();
            let session = client.open_session(opts).await.unwrap();
            let step = forward_backward(LAYERS);
            let mut steps = 0u64;
            while !stop.load(Ordering::Relaxed) && steps < 1_000_000 {
                let bytes = run_step(&session, &step, &expected).await;
                assert_eq!(bytes, 2 * model_bytes(&expected));
                steps += 1;
                if steps == 1 {
                    session.end_step();
                }
            }
            session.close().await.unwrap();
            steps
        })
    };

    let children: usize = std::env::var("WEIGHTSTREAM_FAULT_CLIENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CHILDREN);
    let seed: u64 = std::env::var("WEIGHTSTREAM_FAULT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    eprintln!("killed_clients_leak_nothing: {children} children, seed {seed}");

    // Warm-up: children that run to the end (they also name the checkpoints).
    let mut labels = Vec::new();
    for i in 0..3 {
        labels = tokio::task::block_in_place(|| {
            run_child(&served, &model_path, &model_id, i, Fate::Completes)
        });
    }
    let committed = labels.iter().position(|l| l == "upload committed").unwrap() as u32;
    let released = labels
        .iter()
        .position(|l| l == "child model released")
        .unwrap() as u32;
    let total = labels.len() as u32;
    eventually("the warm-up sessions are gone", || {
        let mut client = client.clone();
        async move { session_ids(&mut client).await.len() == 1 }
    })
    .await;
    // And their connections, which the daemon closes after their sessions: of the children's
    // none is left, only this test's and the survivor's (else the base counts one that goes).
    eventually("the warm-up connections are closed", || async {
        served.connections() == 2
    })
    .await;
    let base_memfds = served.memfds();
    let base_fds = served.fds();
    let base_rss = served.rss_kib();
    let base_models = client.list_models().await.unwrap().models;
    assert_eq!(
        base_models.len(),
        1,
        "the child model went with its sessions"
    );
    assert_eq!(served.shm_count("staging"), 1, "{base_memfds:?}");

    // The faults.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut held_refs = 0u32;
    let mut fates = Vec::new();
    let mut mid_rss = 0;
    for i in 0..children {
        let fate = if rng.random_bool(0.75) {
            Fate::KillsItselfAt(rng.random_range(0..total))
        } else {
            Fate::KilledAtIteration(rng.random_range(0..40))
        };
        if let Fate::KillsItselfAt(n) = fate
            && (committed..released).contains(&n)
        {
            // Died between its commit and its release: the model keeps that reference.
            held_refs += 1;
        }
        tokio::task::block_in_place(|| {
            run_child(&served, &model_path, &model_id, 100 + i as u64, fate)
        });
        fates.push(fate);
        if i + 1 == children / 2 {
            mid_rss = served.rss_kib();
        }
    }
    eprintln!("fates: {fates:?}");

    // Everything the children had goes with their connections.
    eventually("the killed children's sessions are gone", || {
        let mut client = client.clone();
        async move { session_ids(&mut client).await.len() == 1 }
    })
    .await;
    // The children's uploads in progress go; what stays of theirs is one committed upload
    // (they all upload the same bytes), if a dead child still holds a reference to it.
    eventually("no upload in progress left", || async {
        served.shm_count("upload") == usize::from(held_refs > 0)
    })
    .await;
    let models = client.list_models().await.unwrap().models;
    let parent = models.iter().find(|m| m.model_id == model_id).unwrap();
    assert_eq!((parent.refcount, parent.sessions), (1, 1));
    let child_id = models
        .iter()
        .find(|m| m.model_id != model_id)
        .map(|m| m.model_id.clone());
    assert_eq!(models.len(), 1 + usize::from(held_refs > 0), "{models:?}");
    if let Some(child_id) = child_id {
        let child = models.iter().find(|m| m.model_id == child_id).unwrap();
        assert_eq!(
            (child.refcount, child.sessions),
            (held_refs, 0),
            "{fates:?}"
        );
        for left in (0..held_refs).rev() {
            assert_eq!(client.release_model(&child_id).await.unwrap(), left);
        }
    }
    eventually("the shared memory of warm-up", || async {
        served.memfds() == base_memfds
    })
    .await;
    eventually("the fd count of warm-up", || async {
        served.fds() == base_fds
    })
    .await;
    let end_rss = served.rss_kib();
    eprintln!(
        "daemon RSS: {base_rss} KiB after warm-up, {mid_rss} KiB after {} children, {end_rss} KiB after {children}; fds {base_fds}",
        children / 2
    );
    assert!(
        end_rss <= base_rss + RSS_SLACK_KIB,
        "RSS grew from {base_rss} KiB to {end_rss} KiB over {children} killed clients"
    );

    stop.store(true, Ordering::Relaxed);
    let steps = within("the survivor's last step", survivor).await.unwrap();
    assert!(steps > 0);
    eprintln!("the survivor ran {steps} exact steps meanwhile");
    eventually("no session left", || {
        let mut client = client.clone();
        async move { session_ids(&mut client).await.is_empty() }
    })
    .await;
    assert_eq!(served.shm_count("staging"), 0);
    assert_eq!(served.shm_count("resident"), 0);
}

// ---------------------------------------------------------------------------------------------
// The daemon restarted under a running trainer

struct Trainer {
    dir: tempfile::TempDir,
    model_path: PathBuf,
    expected: BTreeMap<String, Tensor>,
}

fn trainer_files(seed: u64) -> Trainer {
    let dir = tempfile::tempdir().unwrap();
    let model_path = write_model(dir.path(), "m.safetensors", &uniform_model(seed, 6, LAYER));
    let expected = read_model(std::slice::from_ref(&model_path));
    Trainer {
        dir,
        model_path,
        expected,
    }
}

/// The next acquire after the daemon went fails within `FAIL_FAST`, with an error that says
/// the session or the daemon is gone.
async fn fails_fast(session: &weightstream_client::Session) -> ClientError {
    let started = Instant::now();
    let err = within("acquire after the daemon went", session.acquire(0))
        .await
        .err()
        .expect("an acquire after the daemon went fails");
    assert!(started.elapsed() < FAIL_FAST, "{:?}", started.elapsed());
    assert!(
        matches!(
            err,
            ClientError::SessionEnded(_) | ClientError::Unavailable { .. }
        ),
        "{err:?}"
    );
    err
}

/// SIGKILL of the daemon mid-run: the trainer's next acquire fails at once; reconnecting
/// while no daemon listens gives up at its deadline; once a new daemon is up (the dead one's
/// shared memory went with it: memfds), `reconnect` loads the model again from the file this
/// client loaded it from (same id), re-sends the plan, and the next steps get exact bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_daemon_fails_the_trainer_fast_and_reconnect_resumes_it() {
    let t = trainer_files(51);
    let mut served = Served::start(t.dir.path());
    let mut client = Client::connect(Some(&served.socket)).await.unwrap();
    let manifest = load(
        &mut client,
        std::slice::from_ref(&t.model_path),
        &t.expected,
    )
    .await;
    let mut session = client
        .open_session(layer_options(&manifest.model_id, &manifest, 3, 4))
        .await
        .unwrap();
    let step = forward_backward(6);
    run_step(&session, &step, &t.expected).await;
    session.end_step();
    run_step(&session, &step, &t.expected).await;
    assert!(!served.memfds().is_empty());

    served.kill();
    let err = fails_fast(&session).await;
    assert!(
        err.to_string().contains("session ended") || err.to_string().contains("cannot reach"),
        "{err}"
    );
    // A second acquire fails the same way, at once.
    fails_fast(&session).await;

    let started = Instant::now();
    let err = session
        .reconnect(None, Duration::from_millis(300))
        .await
        .expect_err("no daemon to reconnect to");
    assert!(matches!(err, ClientError::Unavailable { .. }), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    served = Served::start(t.dir.path());
    assert_eq!(
        served.memfds(),
        Vec::<String>::new(),
        "a new daemon holds nothing"
    );
    within(
        "reconnect",
        session.reconnect(None, Duration::from_secs(10)),
    )
    .await
    .expect("reconnect to the restarted daemon");
    assert_eq!(session.model_id(), manifest.model_id);
    client.reconnect(Duration::from_secs(10)).await.unwrap();
    let model = model_listed(&mut client, &manifest.model_id)
        .await
        .expect("loaded again from the same file, under the same id");
    assert_eq!((model.refcount, model.sessions), (1, 1));
    let info = session_info(&mut client, session.id()).await.unwrap();
    assert!(info.attached);
    eventually("the plan is sent again", || {
        let (mut client, id) = (client.clone(), session.id().to_string());
        let len = step.len() as u32;
        async move { session_info(&mut client, &id).await.unwrap().plan_length == len }
    })
    .await;
    for _ in 0..3 {
        let bytes = run_step(&session, &step, &t.expected).await;
        assert_eq!(bytes, 2 * model_bytes(&t.expected));
    }
    let s = stats(&mut client, session.id()).await;
    assert_eq!(s.acquires, 3 * step.len() as u64);
    assert!(s.prefetches > 0, "the plan drives prefetch again: {s:?}");

    session.close().await.unwrap();
    assert_eq!(client.release_model(&manifest.model_id).await.unwrap(), 0);
    assert_eq!(served.memfds(), Vec::<String>::new());
    assert!(served.terminate().success());
    assert!(!served.socket.exists());
}

/// SIGTERM under a trainer streaming an uploaded model: the acquire fails at once saying the
/// daemon is stopping; the restarted daemon does not have the upload, so `reconnect` reports
/// NOT_FOUND with the id until the trainer uploads the same bytes again (same id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_daemon_fails_the_trainer_fast_and_reconnect_takes_a_reupload() {
    let dir = tempfile::tempdir().unwrap();
    let mut served = Served::start(dir.path());
    let tensors = uniform_model(52, 4, LAYER);
    let expected: BTreeMap<String, Tensor> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    let uploads: Vec<_> = tensors.iter().map(Tensor::as_upload).collect();
    let mut client = Client::connect(Some(&served.socket)).await.unwrap();
    let (manifest, _) = client.upload_model("up", &uploads).await.unwrap();
    let mut session = client
        .open_session(layer_options(&manifest.model_id, &manifest, 3, 3))
        .await
        .unwrap();
    let step = forward_backward(4);
    run_step(&session, &step, &expected).await;

    assert!(served.terminate().success());
    match fails_fast(&session).await {
        ClientError::SessionEnded(why) => assert!(why.contains("stopping"), "{why}"),
        other => panic!("expected the stopping fault, got {other:?}"),
    }

    served = Served::start(dir.path());
    let err = session
        .reconnect(None, Duration::from_secs(10))
        .await
        .expect_err("the new daemon has no such model");
    assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err:?}");
    assert!(err.to_string().contains(&manifest.model_id), "{err}");

    client.reconnect(Duration::from_secs(10)).await.unwrap();
    let (again, dedup) = client.upload_model("up", &uploads).await.unwrap();
    assert_eq!(
        (again.model_id.as_str(), dedup),
        (manifest.model_id.as_str(), false)
    );
    session
        .reconnect(Some(&again.model_id), Duration::from_secs(10))
        .await
        .unwrap();
    for _ in 0..2 {
        assert_eq!(
            run_step(&session, &step, &expected).await,
            2 * model_bytes(&expected)
        );
    }
    session.close().await.unwrap();
    assert_eq!(client.release_model(&again.model_id).await.unwrap(), 0);
    assert_eq!(served.memfds(), Vec::<String>::new());
    assert!(served.terminate().success());
    assert!(!served.socket.exists());
}

/// `reconnect` on a session whose daemon is still up moves it to a new connection: the old
/// session is torn down, the new one streams, and nothing of the old one is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_against_a_live_daemon_replaces_the_session() {
    let t = trainer_files(53);
    let mut served = Served::start(t.dir.path());
    let mut client = Client::connect(Some(&served.socket)).await.unwrap();
    let manifest = load(
        &mut client,
        std::slice::from_ref(&t.model_path),
        &t.expected,
    )
    .await;
    let mut session = client
        .open_session(layer_options(&manifest.model_id, &manifest, 3, 3))
        .await
        .unwrap();
    run_step(&session, &[0, 1, 2], &t.expected).await;
    let old = session.id().to_string();
    session
        .reconnect(None, Duration::from_secs(10))
        .await
        .unwrap();
    assert_ne!(session.id(), old);
    eventually("the old session is torn down", || {
        let mut client = client.clone();
        async move { session_ids(&mut client).await.len() == 1 }
    })
    .await;
    assert_eq!(
        session_ids(&mut client).await,
        vec![session.id().to_string()]
    );
    assert_eq!(served.shm_count("staging"), 1);
    run_step(&session, &forward_backward(6), &t.expected).await;
    session.close().await.unwrap();
    assert!(served.terminate().success());
}
