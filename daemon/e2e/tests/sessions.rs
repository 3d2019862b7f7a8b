//! Sessions end to end: plans and prefetch, resyncs, reuse under gradient checkpointing,
//! concurrent sessions on one host copy, shared resident groups, and teardown when a client
//! closes, vanishes, or the daemon stops.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use common::*;
use weightstream_client::{Client, ClientError, proto};

/// Bytes of each layer of the test models; a multiple of the alignment, so a group is exactly
/// this many bytes.
const LAYER: usize = 64 << 10;

struct Fixture {
    daemon: TestDaemon,
    client: Client,
    manifest: proto::ModelManifest,
    expected: BTreeMap<String, Tensor>,
    _dir: tempfile::TempDir,
    path: PathBuf,
}

/// A daemon with a `layers`-layer model loaded.
async fn fixture(seed: u64, layers: usize) -> Fixture {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(
        dir.path(),
        "layers.safetensors",
        &uniform_model(seed, layers, LAYER),
    );
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, std::slice::from_ref(&path), &expected).await;
    Fixture {
        daemon,
        client,
        manifest,
        expected,
        _dir: dir,
        path,
    }
}

impl Fixture {
    /// One group per layer, staging of `staging_groups` layers and a budget of
    /// `budget_groups` layers.
    fn options(
        &self,
        staging_groups: u64,
        budget_groups: u64,
    ) -> weightstream_client::SessionOptions {
        let groups = per_tensor_groups(&self.manifest);
        let layer = LAYER as u64;
        options(
            &self.manifest.model_id,
            groups,
            staging_groups * layer,
            budget_groups * layer,
        )
    }

    fn group_count(&self) -> u32 {
        self.manifest.tensors.len() as u32
    }
}

/// Forward over every layer, then backward: the access order of one plain training step.
fn forward_backward(n: u32) -> Vec<u32> {
    (0..n).chain((0..n).rev()).collect()
}

/// Forward, then for each block from the last: recompute it, then its backward.
fn checkpointed(n: u32) -> Vec<u32> {
    (0..n).chain((0..n).rev().flat_map(|b| [b, b])).collect()
}

fn delta(after: &proto::SessionStats, before: &proto::SessionStats) -> proto::SessionStats {
    proto::SessionStats {
        acquires: after.acquires - before.acquires,
        hits: after.hits - before.hits,
        reuses: after.reuses - before.reuses,
        misses: after.misses - before.misses,
        resident_hits: after.resident_hits - before.resident_hits,
        bytes_copied: after.bytes_copied - before.bytes_copied,
        copies: after.copies - before.copies,
        prefetches: after.prefetches - before.prefetches,
        acquire_pending_ns: after.acquire_pending_ns - before.acquire_pending_ns,
        resyncs: after.resyncs - before.resyncs,
        releases: after.releases - before.releases,
        evictions: after.evictions - before.evictions,
        gpu_wait_ns: after.gpu_wait_ns - before.gpu_wait_ns,
        gpu_waits: after.gpu_waits - before.gpu_waits,
        gpu_wait_reports: after.gpu_wait_reports - before.gpu_wait_reports,
        ..Default::default()
    }
}

/// Waits until the daemon has taken the plan the client sent at the end of its first step
/// (the plan travels on the Run stream, ListSessions on another call).
async fn plan_taken(client: &Client, session_id: &str, len: u32) {
    eventually("the plan is taken", || {
        let mut client = client.clone();
        async move {
            session_info(&mut client, session_id)
                .await
                .is_some_and(|s| s.plan_length == len)
        }
    })
    .await;
}

/// With a plan, later steps find what they acquire already staged: at least 95 % hits with an
/// arena of four groups out of sixteen and nothing resident.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_turns_later_steps_into_hits() {
    let mut f = fixture(10, 16).await;
    let n = f.group_count();
    let session = f.client.open_session(f.options(4, 4)).await.unwrap();
    assert_eq!(session.layout().resident_bytes, 0);
    assert!(session.layout().groups.iter().all(|g| !g.resident));
    let step = forward_backward(n);
    run_step(&session, &step, &f.expected).await;
    session.end_step();
    plan_taken(&f.client, session.id(), step.len() as u32).await;

    let before = stats(&mut f.client, session.id()).await;
    assert_eq!(before.acquires, step.len() as u64);
    let steps = 5;
    let mut acquired = 0;
    for _ in 0..steps {
        acquired += run_step(&session, &step, &f.expected).await;
    }
    let d = delta(&stats(&mut f.client, session.id()).await, &before);
    assert_eq!(d.acquires, steps * step.len() as u64);
    assert_eq!(d.hits + d.misses, d.acquires, "{d:?}");
    assert_eq!(d.resident_hits, 0, "{d:?}");
    assert!(d.prefetches > 0, "{d:?}");
    assert_eq!(d.resyncs, 0, "the client kept to the plan: {d:?}");
    let rate = d.hits as f64 / d.acquires as f64;
    assert!(rate >= 0.95, "hit rate {rate:.3} after the plan: {d:?}");
    assert!(
        d.bytes_copied < acquired,
        "cached groups were reused: {d:?}"
    );
    session.close().await.unwrap();
}

/// An acquire that leaves the plan is served with the right bytes; skipping ahead resyncs the
/// cursor once, and a group outside the plan leaves it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_plan_acquires_are_served_and_resync() {
    let mut f = fixture(11, 12).await;
    let mut opts = f.options(3, 3);
    opts.record_plan = false;
    let session = f.client.open_session(opts).await.unwrap();
    let plan: Vec<u32> = (0..8).collect();
    session.send_plan(plan.clone());
    plan_taken(&f.client, session.id(), 8).await;
    run_step(&session, &plan, &f.expected).await;
    let before = stats(&mut f.client, session.id()).await;
    assert_eq!((before.acquires, before.resyncs), (8, 0), "{before:?}");

    // 0 is next (the step wraps); 5 skips 1..=4.
    run_step(&session, &[0, 5], &f.expected).await;
    let d = delta(&stats(&mut f.client, session.id()).await, &before);
    assert_eq!((d.acquires, d.resyncs), (2, 1), "{d:?}");
    // 10 is not in the plan: served, no resync; 6 then follows 5 in order.
    run_step(&session, &[10, 6], &f.expected).await;
    let d = delta(&stats(&mut f.client, session.id()).await, &before);
    assert_eq!((d.acquires, d.resyncs), (4, 1), "{d:?}");
    // Going back resyncs again.
    run_step(&session, &[2, 3], &f.expected).await;
    let d = delta(&stats(&mut f.client, session.id()).await, &before);
    assert_eq!((d.acquires, d.resyncs), (6, 2), "{d:?}");
    session.close().await.unwrap();
}

/// Under a gradient-checkpointing plan each block is acquired twice in a row (recompute, then
/// backward): the second acquire reuses the staged bytes without a copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpointing_reacquires_are_reuses_without_copies() {
    let mut f = fixture(12, 6).await;
    let n = f.group_count();
    let session = f.client.open_session(f.options(4, 4)).await.unwrap();
    let step = checkpointed(n);
    assert_eq!(step.len(), 3 * n as usize);
    run_step(&session, &step, &f.expected).await;
    session.end_step();
    plan_taken(&f.client, session.id(), step.len() as u32).await;

    let before = stats(&mut f.client, session.id()).await;
    let steps = 3;
    let mut acquired = 0;
    for _ in 0..steps {
        acquired += run_step(&session, &step, &f.expected).await;
    }
    let d = delta(&stats(&mut f.client, session.id()).await, &before);
    assert_eq!(d.acquires, steps * step.len() as u64);
    // Every backward follows its recompute with no acquire in between.
    assert!(d.reuses >= steps * u64::from(n), "{d:?}");
    assert!(d.reuses <= d.hits, "{d:?}");
    assert!(
        d.bytes_copied < acquired,
        "copied {} of {acquired} bytes acquired: {d:?}",
        d.bytes_copied
    );
    assert!(d.copies < d.acquires, "{d:?}");
    session.close().await.unwrap();
}

/// Eight trainers, each on its own connection, share one host copy of the model and each get
/// the right bytes for three steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_sessions_share_one_copy() {
    let mut f = fixture(13, 8).await;
    let n = f.group_count();
    let tasks = 8;
    let opened = Arc::new(tokio::sync::Barrier::new(tasks + 1));
    let checked = Arc::new(tokio::sync::Barrier::new(tasks + 1));
    let expected = Arc::new(f.expected.clone());
    let mut handles = Vec::new();
    for i in 0..tasks {
        let (socket, path) = (f.daemon.socket.clone(), f.path.clone());
        let (opened, checked, expected) = (opened.clone(), checked.clone(), expected.clone());
        // Staging of 3 layers, 2 more resident (shared by all eight).
        let opts = f.options(3, 5);
        handles.push(tokio::spawn(async move {
            let mut client = Client::connect(Some(&socket)).await.unwrap();
            let manifest = load(&mut client, &[path], &expected).await;
            assert_eq!(manifest.model_id, opts.model_id, "task {i}");
            let session = client.open_session(opts).await.unwrap();
            opened.wait().await;
            checked.wait().await;
            let step = forward_backward(n);
            for _ in 0..3 {
                let bytes = run_step(&session, &step, &expected).await;
                assert_eq!(bytes, 2 * model_bytes(&expected), "task {i}");
                session.end_step();
            }
            let st = stats(&mut client, session.id()).await;
            assert_eq!(st.acquires, 3 * step.len() as u64, "task {i}");
            session.close().await.unwrap();
        }));
    }
    within("all eight sessions open", opened.wait()).await;
    let sessions = f.client.list_sessions().await.unwrap();
    assert_eq!(sessions.len(), tasks, "{sessions:?}");
    assert!(
        sessions
            .iter()
            .all(|s| s.model_id == f.manifest.model_id && s.attached)
    );
    let models = f.client.list_models().await.unwrap();
    assert_eq!(models.models.len(), 1);
    let model = &models.models[0];
    assert_eq!(
        (model.refcount, model.sessions),
        (1 + tasks as u32, tasks as u32)
    );
    assert_eq!(
        models.store_bytes,
        model_bytes(&f.expected),
        "one host copy"
    );
    assert_eq!(f.daemon.shm_count("model"), 1);
    assert_eq!(f.daemon.shm_count("staging"), tasks);
    assert_eq!(
        f.daemon.shm_count("resident"),
        2,
        "a region per resident group"
    );
    within("tasks released", checked.wait()).await;
    for h in handles {
        within("session task", h).await.expect("session task");
    }
    assert_eq!(f.client.list_sessions().await.unwrap(), vec![]);
    let model = model_listed(&mut f.client, &f.manifest.model_id)
        .await
        .unwrap();
    assert_eq!((model.refcount, model.sessions), (1 + tasks as u32, 0));
    assert_eq!(
        f.daemon.shm_count("staging") + f.daemon.shm_count("resident"),
        0
    );
}

/// Two sessions on one model share its resident groups: the second maps the first's regions,
/// one per group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resident_groups_are_shared_between_sessions() {
    let f = fixture(14, 6).await;
    let n = f.group_count();
    let mut first_client = f.daemon.client().await;
    let mut second_client = f.daemon.client().await;
    // Staging of 2 layers and room for all 6 resident.
    let first = first_client.open_session(f.options(2, 8)).await.unwrap();
    let second = second_client.open_session(f.options(2, 8)).await.unwrap();
    for s in [&first, &second] {
        let layout = s.layout();
        assert_eq!(layout.regions.len(), 1 + n as usize, "{:?}", layout.regions);
        assert_eq!(layout.resident_bytes, u64::from(n) * LAYER as u64);
        assert!(layout.groups.iter().all(|g| g.resident));
    }
    let (a, b) = (first.layout(), second.layout());
    let socket = &f.daemon.socket;
    assert_ne!(
        fd_secret(&a.regions[1]),
        fd_secret(&b.regions[1]),
        "a secret per session"
    );
    for i in 1..=n as usize {
        assert_eq!(
            region_inode(socket, &a.regions[i]).await,
            region_inode(socket, &b.regions[i]).await,
            "one region of each resident group"
        );
    }
    assert_ne!(
        region_inode(socket, &a.regions[0]).await,
        region_inode(socket, &b.regions[0]).await,
        "staging is per session"
    );
    assert_eq!(f.daemon.shm_count("resident"), n as usize);

    let step = forward_backward(n);
    for (s, client) in [(&first, &mut first_client), (&second, &mut second_client)] {
        run_step(s, &step, &f.expected).await;
        let st = stats(client, s.id()).await;
        assert_eq!(
            (st.resident_hits, st.misses),
            (step.len() as u64, 0),
            "{st:?}"
        );
    }
    // The region outlives the first session and goes with the last; the first's secrets end
    // with it, the second's still work.
    let (first_secret, second_secret) = (
        fd_secret(&a.regions[1]).to_string(),
        fd_secret(&b.regions[1]).to_string(),
    );
    first.close().await.unwrap();
    assert_eq!(f.daemon.shm_count("resident"), n as usize);
    assert!(fetch_fd(socket, &first_secret).await.is_err());
    assert!(fetch_fd(socket, &second_secret).await.is_ok());
    run_step(&second, &step, &f.expected).await;
    second.close().await.unwrap();
    assert_eq!(f.daemon.shm_count("resident"), 0);
    assert_eq!(f.daemon.shm_count("staging"), 0);
}

/// A session that shares some of another session's resident groups keeps only those on the
/// device once the other ends: a region per group, not the other session's whole set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_group_outlives_its_maker_alone() {
    let f = fixture(15, 6).await;
    let n = f.group_count();
    let mut first_client = f.daemon.client().await;
    let mut second_client = f.daemon.client().await;
    let first = first_client.open_session(f.options(2, 8)).await.unwrap();
    assert!(first.layout().groups.iter().all(|g| g.resident));
    // Staging of 2 layers and room for 1 resident: shared from the first session.
    let second = second_client.open_session(f.options(2, 3)).await.unwrap();
    let layout = second.layout().clone();
    assert_eq!(layout.groups.iter().filter(|g| g.resident).count(), 1);
    let sizes: Vec<u64> = layout.regions.iter().map(|r| r.size).collect();
    assert_eq!(
        sizes,
        [2 * LAYER as u64, LAYER as u64],
        "staging, then the one group"
    );
    let before = stats(&mut second_client, second.id()).await;
    assert_eq!(
        before.bytes_copied, 0,
        "nothing copied to open: the group was resident"
    );
    first.close().await.unwrap();
    assert_eq!(
        f.daemon.shm_count("resident"),
        1,
        "the other {} groups went",
        n - 1
    );
    run_step(&second, &forward_backward(n), &f.expected).await;
    second.close().await.unwrap();
    assert_eq!(f.daemon.shm_count("resident"), 0);
}

/// A group another session keeps resident on the device is staged from its region, within the
/// device: the same bytes, none of them over the link; once that session ends, over the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_copies_come_from_another_sessions_resident_groups() {
    let f = fixture(16, 6).await;
    let n = f.group_count();
    let mut first_client = f.daemon.client().await;
    let mut second_client = f.daemon.client().await;
    let first = first_client.open_session(f.options(2, 8)).await.unwrap();
    assert!(first.layout().groups.iter().all(|g| g.resident));
    // Staging of 2 layers, nothing resident: every group of a step is staged.
    let second = second_client.open_session(f.options(2, 2)).await.unwrap();
    assert!(second.layout().groups.iter().all(|g| !g.resident));
    let step = forward_backward(n);
    run_step(&second, &step, &f.expected).await;
    let st = stats(&mut second_client, second.id()).await;
    assert_eq!(st.bytes_copied, 0, "{st:?}");
    assert_eq!(st.bytes_from_device, st.copies * LAYER as u64, "{st:?}");
    assert!(st.copies >= u64::from(n), "{st:?}");
    first.close().await.unwrap();
    run_step(&second, &step, &f.expected).await;
    let after = stats(&mut second_client, second.id()).await;
    assert_eq!(after.bytes_from_device, st.bytes_from_device, "{after:?}");
    assert_eq!(
        after.bytes_copied,
        (after.copies - st.copies) * LAYER as u64,
        "{after:?}"
    );
    assert!(after.copies > st.copies, "{after:?}");
    second.close().await.unwrap();
}

/// A client process that dies mid-step (its connection drops; no CloseSession, no Release)
/// loses its session and staging memory; another session keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_client_is_torn_down() {
    let mut f = fixture(15, 6).await;
    let n = f.group_count();
    let survivor = f.client.open_session(f.options(3, 3)).await.unwrap();
    run_step(&survivor, &[0, 1], &f.expected).await;

    let (socket, opts) = (f.daemon.socket.clone(), f.options(4, 4));
    let request = proto::OpenSessionRequest {
        model_id: f.manifest.model_id.clone(),
        vram_budget: 2 * LAYER as u64,
        groups: per_tensor_groups(&f.manifest),
        ..Default::default()
    };
    let upload = proto::BeginUploadRequest {
        name: "abandoned".into(),
        tensors: vec![proto::TensorInfo {
            name: "w".into(),
            dtype: proto::Dtype::U8 as i32,
            shape: vec![4096],
            nbytes: 0,
            ..Default::default()
        }],
        client_reserves: false,
    };
    let expected = f.expected.clone();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let result = rt.block_on(async move {
            let mut client = Client::connect(Some(&socket)).await.unwrap();
            let session = client.open_session(opts).await.unwrap();
            for g in 0..3 {
                let acquired = session.acquire(g).await.unwrap();
                check_acquired(&acquired, &expected);
                // Held: the process dies before it releases.
                std::mem::forget(acquired);
            }
            let info = session_info(&mut client, session.id()).await.unwrap();
            // A second connection with a session it never attached and an upload it never
            // committed: only the connection's end can tell the daemon they are abandoned.
            let mut raw = raw_client(&socket).await;
            let unattached = raw.open_session(request).await.unwrap().into_inner();
            raw.begin_upload(upload).await.unwrap();
            let ids = vec![session.id().to_string(), unattached.session_id.clone()];
            let staging = vec![
                fd_secret(&session.layout().regions[0]).to_string(),
                fd_secret(&unattached.regions[0]).to_string(),
            ];
            // Never closed: dropping the runtime below drops both connections under them.
            std::mem::forget(session);
            std::mem::forget(raw);
            (ids, staging, info)
        });
        drop(rt);
        let _ = done_tx.send(result);
    });
    let (ids, staging, info) = within("vanishing client", done_rx).await.unwrap();
    thread.join().unwrap();
    assert_eq!(info.live_tickets, 3, "{info:?}");
    assert!(info.attached);

    eventually("the vanished sessions are torn down", || {
        let mut client = f.client.clone();
        let ids = ids.clone();
        async move {
            let listed = client.list_sessions().await.unwrap();
            !listed.iter().any(|s| ids.contains(&s.session_id))
        }
    })
    .await;
    for secret in &staging {
        assert!(
            fetch_fd(&f.daemon.socket, secret).await.is_err(),
            "{secret} works"
        );
    }
    eventually("the abandoned upload is dropped", || async {
        f.daemon.uploads() == 0 && f.daemon.shm_count("upload") == 0
    })
    .await;
    let sessions = f.client.list_sessions().await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].session_id, survivor.id());
    let model = model_listed(&mut f.client, &f.manifest.model_id)
        .await
        .unwrap();
    assert_eq!((model.refcount, model.sessions), (1, 1));

    let all: Vec<u32> = (0..n).collect();
    assert_eq!(
        run_step(&survivor, &all, &f.expected).await,
        model_bytes(&f.expected)
    );
    survivor.close().await.unwrap();
    assert_eq!(f.daemon.shm_count("staging"), 0);
}

/// Stopping the daemon ends open sessions (the client is told why), removes the socket and
/// leaves no shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_stop_ends_sessions_and_cleans_up() {
    let mut f = fixture(16, 4).await;
    let session = f.client.open_session(f.options(2, 3)).await.unwrap();
    run_step(&session, &[0, 1, 2], &f.expected).await;
    assert!(f.daemon.socket.exists() && f.daemon.handoff().exists());
    assert_ne!(f.daemon.shm_total(), 0);

    f.daemon.stop().await.expect("clean stop");
    let err = within("acquire after stop", session.acquire(3))
        .await
        .err()
        .expect("acquire after stop fails");
    match &err {
        ClientError::SessionEnded(msg) => assert!(msg.contains("stopping"), "{msg}"),
        ClientError::Unavailable { .. } => {}
        other => panic!("unexpected error after stop: {other:?}"),
    }
    assert!(!f.daemon.socket.exists(), "the socket is removed");
    assert!(
        !f.daemon.handoff().exists(),
        "the handoff socket is removed"
    );
    assert_eq!(f.daemon.shm_total(), 0);
    let err = Client::connect(Some(&f.daemon.socket)).await.err().unwrap();
    assert!(matches!(err, ClientError::Unavailable { .. }), "{err:?}");
}

/// CloseSession removes the session and its staging memory at once; the model stays until its
/// last reference is released, and a released model stays while a session uses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_session_frees_staging_and_keeps_the_model() {
    let mut f = fixture(17, 4).await;
    let id = f.manifest.model_id.clone();
    let session = f.client.open_session(f.options(2, 2)).await.unwrap();
    let staging = fd_secret(&session.layout().regions[0]).to_string();
    assert!(fetch_fd(&f.daemon.socket, &staging).await.is_ok());
    let sid = session.id().to_string();
    let model = model_listed(&mut f.client, &id).await.unwrap();
    assert_eq!((model.refcount, model.sessions), (1, 1));
    run_step(&session, &[0, 1, 2, 3], &f.expected).await;

    session.close().await.unwrap();
    assert!(session_info(&mut f.client, &sid).await.is_none());
    assert_eq!(f.daemon.shm_count("staging"), 0, "staging is freed");
    let err = fetch_fd(&f.daemon.socket, &staging).await.unwrap_err();
    assert!(err.to_string().contains("no such fd_secret"), "{err}");
    let model = model_listed(&mut f.client, &id)
        .await
        .expect("the model stays");
    assert_eq!((model.refcount, model.sessions), (1, 0));
    assert_eq!(f.daemon.shm_count("model"), 1);

    // Released while a session uses it: listed (no references, one session) until it closes.
    let session = f.client.open_session(f.options(2, 2)).await.unwrap();
    assert_eq!(f.client.release_model(&id).await.unwrap(), 0);
    let model = model_listed(&mut f.client, &id)
        .await
        .expect("kept for its session");
    assert_eq!((model.refcount, model.sessions), (0, 1));
    run_step(&session, &[3, 2, 1, 0], &f.expected).await;
    // No new session may start on it.
    let err = f.client.open_session(f.options(2, 2)).await.err().unwrap();
    assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err}");
    session.close().await.unwrap();
    assert!(model_listed(&mut f.client, &id).await.is_none());
    assert_eq!(f.daemon.shm_total(), 0);
}

/// A session whose Run stream ends (the client closed it without CloseSession) is torn down,
/// while its connection stays open and usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_stream_end_tears_the_session_down() {
    let mut f = fixture(18, 4).await;
    let mut rpc = raw_client(&f.daemon.socket).await;
    let opened = rpc
        .open_session(proto::OpenSessionRequest {
            model_id: f.manifest.model_id.clone(),
            vram_budget: 4 * LAYER as u64,
            staging_bytes: 2 * LAYER as u64,
            groups: per_tensor_groups(&f.manifest),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let sid = opened.session_id.clone();
    let staging = fd_secret(&opened.regions[0]).to_string();
    let mut run = RawRun::attach(&mut rpc, &sid).await.unwrap();
    run.acquire(0, 1);
    run.staged(1).await;
    // Held when the stream ends.
    drop(run);
    eventually("the session of an ended stream is torn down", || {
        let mut client = f.client.clone();
        let sid = sid.clone();
        async move { session_info(&mut client, &sid).await.is_none() }
    })
    .await;
    assert!(fetch_fd(&f.daemon.socket, &staging).await.is_err());
    assert_eq!(f.daemon.shm_count("staging"), 0);
    let model = model_listed(&mut f.client, &f.manifest.model_id)
        .await
        .unwrap();
    assert_eq!((model.refcount, model.sessions), (1, 0));
    // The connection itself still serves.
    let info = rpc
        .get_info(proto::GetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.backend, proto::Backend::Host as i32);
}

/// Stopping the daemon does not wait past its drain timeout for a client that never finishes
/// a call (here a Run stream that never sends its attach).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_is_bounded_by_the_drain_timeout() {
    let mut daemon = start_daemon_with(|c| c.drain_timeout_secs = 1).await;
    let mut rpc = raw_client(&daemon.socket).await;
    let mut probe = rpc.clone();
    let (_tx, rx) = tokio::sync::mpsc::unbounded_channel::<proto::ClientMessage>();
    let stalled = rpc.run(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
    tokio::pin!(stalled);
    // Polling the stalled call first puts it on the connection before the probe, so the daemon
    // has it in flight once the probe is answered.
    tokio::select! {
        biased;
        r = &mut stalled => panic!("Run answered before its first message: {:?}", r.map(|_| ())),
        r = probe.get_info(proto::GetInfoRequest {}) => { r.unwrap(); }
    }
    daemon.stop().await.expect("stop");
    assert!(!daemon.socket.exists());
    assert_eq!(daemon.shm_total(), 0);
}

/// `limits.max_sessions` holds for sessions that open at once: each open is counted under the
/// quotas' lock before anything is allocated (a count checked first and taken after the
/// awaited resident copies let every one of them in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_sessions_holds_for_sessions_opening_at_once() {
    let daemon = start_daemon_with(|c| c.limits.max_sessions = 2).await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &uniform_model(91, 8, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, std::slice::from_ref(&path), &expected).await;
    // A budget for every group: each open waits for its resident copies.
    let opts = options(
        &manifest.model_id,
        per_tensor_groups(&manifest),
        2 * LAYER as u64,
        16 * LAYER as u64,
    );
    let opens = (0..6).map(|_| {
        let (mut client, opts) = (client.clone(), opts.clone());
        async move { client.open_session(opts).await }
    });
    let results = within("six opens at once", futures::future::join_all(opens)).await;
    let (opened, refused): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    let refusals: Vec<(tonic::Code, String)> = (refused.into_iter())
        .map(|r| match r.err().unwrap() {
            ClientError::Rejected { code, message } => (code, message),
            other => panic!("expected a rejection, got {other:?}"),
        })
        .collect();
    let full = (
        tonic::Code::ResourceExhausted,
        "limits.max_sessions = 2 reached: the daemon has 2 sessions open or opening".to_string(),
    );
    assert_eq!((opened.len(), refusals), (2, vec![full; 4]));
    for session in opened {
        session.unwrap().close().await.unwrap();
    }
    let again = client
        .open_session(opts)
        .await
        .expect("closed sessions free their places");
    again.close().await.unwrap();
}

/// The client's own waits (here: its thread blocked for groups not yet staged) reach the daemon
/// as `gpu_wait_ns`, in total and per group exactly as the client summed them; the daemon's own
/// figure, time with an acquire pending, is split by group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_waits_are_what_the_daemon_shows() {
    let mut f = fixture(12, 4).await;
    let session = f.client.open_session(f.options(4, 4)).await.unwrap();
    assert!(session.layout().accepts_gpu_wait);
    run_step(&session, &forward_backward(4), &f.expected).await;
    let waits = session.waits();
    // Each acquire waits at least for the daemon's reply.
    assert!(waits.waits > 0 && waits.total_ns > 0, "{waits:?}");
    assert_eq!(waits.by_group.iter().sum::<u64>(), waits.total_ns);
    session.report_waits().unwrap();
    let reports = session.wait_reports();
    // The report travels on the Run stream, ListSessions on another call.
    eventually("the report is taken", || {
        let mut client = f.client.clone();
        let id = session.id().to_string();
        async move { stats(&mut client, &id).await.gpu_wait_reports == reports }
    })
    .await;
    let info = session_info(&mut f.client, session.id()).await.unwrap();
    let st = info.stats.unwrap();
    assert_eq!(
        (st.gpu_wait_ns, st.gpu_waits),
        (waits.total_ns, waits.waits)
    );
    assert_eq!(info.group_gpu_wait_ns, waits.by_group);
    assert!(st.acquire_pending_ns > 0, "{st:?}");
    assert_eq!(
        info.group_acquire_pending_ns.iter().sum::<u64>(),
        st.acquire_pending_ns
    );
}
