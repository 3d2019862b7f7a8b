//! State regions end to end: host memory a session's trainer maps read-write, charged to its
//! uid with the host quotas (`GetInfo`, `ListSessions`), refused up front with the numbers when
//! it does not fit, freed by FreeStateRegion, CloseSession or the connection's end — and, when
//! the client still holds its fd or a mapping, charged until it lets go. Requests are checked
//! at the edge, and another uid can neither fetch a region nor touch a foreign session's.
mod common;

use std::os::unix::fs::FileExt;

use attacker::{attack, attacker, daemon_for, no_forks};
use common::*;
use tonic::Code;
use weightstream_client::{Client, HandoffError, proto};

// Shared with security.rs, whose helpers this file does not all use.
#[allow(dead_code)]
#[path = "security/attacker.rs"]
mod attacker;

const LAYER: usize = 16 << 10;

/// A daemon with a model of two layers loaded through `client`, and the model's manifest.
async fn with_model(daemon: &TestDaemon, seed: u64) -> (Client, proto::ModelManifest) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &uniform_model(seed, 2, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    (client, manifest)
}

fn open_request(manifest: &proto::ModelManifest) -> proto::OpenSessionRequest {
    proto::OpenSessionRequest {
        model_id: manifest.model_id.clone(),
        vram_budget: 2 * LAYER as u64,
        staging_bytes: 2 * LAYER as u64,
        groups: per_tensor_groups(manifest),
        ..Default::default()
    }
}

fn alloc_request(session_id: &str, bytes: u64) -> proto::AllocStateRegionRequest {
    proto::AllocStateRegionRequest {
        session_id: session_id.into(),
        bytes,
        label: "adam".into(),
    }
}

/// The values of `weightstream_session_state_bytes`, one per open session.
fn state_metric(daemon: &TestDaemon) -> Vec<String> {
    let text = weightstream_daemon::metrics::render(&daemon.core);
    (text.lines())
        .filter(|l| l.starts_with("weightstream_session_state_bytes{"))
        .map(|l| l.rsplit(' ').next().unwrap().to_string())
        .collect()
}

fn me() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The status of a call, as `Code: message`.
fn refused<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (Code, String) {
    let status = r.expect_err("refused");
    (status.code(), status.message().to_string())
}

/// A region is its bytes rounded up to whole pages, read-write through its fd; it counts in the
/// uid's and the daemon's host bytes and in its session's listing; FreeStateRegion frees one;
/// CloseSession frees the rest, except what the client still maps, which stays charged until
/// it is unmapped and closed.
#[expect(clippy::await_holding_lock, reason = "see attacker::no_forks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_region_is_charged_with_its_session_until_the_client_lets_go() {
    // Its own last close is to free the region: no fork may hold a copy of it meanwhile.
    let _no_forks = no_forks();
    let daemon = start_daemon().await;
    let (mut client, manifest) = with_model(&daemon, 60).await;
    let uid = me();
    let model = daemon.core.store.host_use(uid).uid_bytes;
    let session = client
        .open_session(options(
            &manifest.model_id,
            per_tensor_groups(&manifest),
            2 * LAYER as u64,
            2 * LAYER as u64,
        ))
        .await
        .unwrap();
    let (id, size, fd) = session.alloc_state_region(10_000, "master").await.unwrap();
    assert_eq!(size, 12288, "rounded up to whole pages");
    assert!(
        id.starts_with("st-") && id.len() == 19,
        "'st-' and 16 hex digits: {id}"
    );
    let file = std::fs::File::from(fd);
    assert_eq!(file.metadata().unwrap().len(), 12288);
    file.write_all_at(b"master weights", 4096).unwrap();
    let mut back = [0u8; 14];
    file.read_exact_at(&mut back, 4096).unwrap();
    assert_eq!(&back, b"master weights");
    assert_eq!(
        rustix::fs::ftruncate(&file, 4096).unwrap_err(),
        rustix::io::Errno::PERM,
        "its size is sealed"
    );
    // A mapping, as a trainer holds one (memmap2's raw map needs no unsafe).
    let map = memmap2::MmapOptions::new()
        .len(12288)
        .map_raw(&file)
        .unwrap();

    let (_, second, _) = session.alloc_state_region(1, "").await.unwrap();
    assert_eq!(second, 4096);
    let usage = client.info().await.unwrap().usage.unwrap();
    assert_eq!(
        (usage.host_bytes, usage.daemon_host_bytes),
        (model + 16384, model + 16384)
    );
    assert_eq!(
        (usage.state_bytes, usage.daemon_state_bytes),
        (16384, 16384)
    );
    let listed = session_info(&mut client, session.id()).await.unwrap();
    assert_eq!((listed.state_bytes, listed.state_regions), (16384, 2));
    assert_eq!(daemon.shm_count("state"), 2);
    assert_eq!(state_metric(&daemon), vec!["16384.0".to_string()]);

    let (second_id, _, second_fd) = session.alloc_state_region(4096, "").await.unwrap();
    drop(second_fd);
    client
        .free_state_region(session.id(), &second_id)
        .await
        .unwrap();
    let again = client.free_state_region(session.id(), &second_id).await;
    assert_eq!(
        again.unwrap_err().to_string(),
        format!("NotFound: unknown region_id '{second_id}' (a state region ends with its session)")
    );
    let listed = session_info(&mut client, session.id()).await.unwrap();
    assert_eq!((listed.state_bytes, listed.state_regions), (16384, 2));

    session.close().await.unwrap();
    assert_eq!(daemon.shm_count("state"), 0, "the daemon holds none");
    assert!(state_metric(&daemon).is_empty(), "no session, no series");
    let usage = client.info().await.unwrap().usage.unwrap();
    assert_eq!((usage.state_bytes, usage.daemon_state_bytes), (0, 0));
    assert_eq!(
        usage.host_bytes,
        model + 12288,
        "what the client maps stays charged"
    );
    drop(map);
    assert_eq!(
        daemon.core.store.host_use(uid).uid_bytes,
        model + 12288,
        "the fd still holds it"
    );
    drop(file);
    assert_eq!(daemon.core.store.host_use(uid).uid_bytes, model);
    assert_eq!(daemon.core.shm.held().count(), 0);
}

/// A connection that ends frees its sessions' state regions: one never fetched goes at once
/// (its secret with it), one whose fd the client kept stays charged until that fd closes.
#[expect(clippy::await_holding_lock, reason = "see attacker::no_forks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_connection_frees_its_sessions_state_regions() {
    // Its own last close is to free the region: no fork may hold a copy of it meanwhile.
    let _no_forks = no_forks();
    let daemon = start_daemon().await;
    let (_client, manifest) = with_model(&daemon, 61).await;
    let uid = me();
    let model = daemon.core.store.host_use(uid).uid_bytes;
    let mut rpc = raw_client(&daemon.socket).await;
    let opened = rpc.open_session(open_request(&manifest)).await.unwrap();
    let session_id = opened.into_inner().session_id;
    let kept = (rpc
        .alloc_state_region(alloc_request(&session_id, 8192))
        .await)
        .unwrap()
        .into_inner();
    let (fd, size) = fetch_fd(&daemon.socket, &kept.fd_secret).await.unwrap();
    assert_eq!(size, 8192);
    let left = (rpc
        .alloc_state_region(alloc_request(&session_id, 4096))
        .await)
        .unwrap()
        .into_inner();
    assert_eq!(
        daemon.core.store.host_use(uid).uid_bytes,
        model + 8192 + 4096
    );

    drop(rpc);
    eventually("the connection's session goes", || {
        let gone = daemon.core.list_sessions().is_empty();
        async move { gone }
    })
    .await;
    assert_eq!(daemon.shm_count("state"), 0);
    let used = daemon.core.store.host_use(uid);
    assert_eq!((used.uid_bytes, used.uid_state_bytes), (model + 8192, 0));
    match fetch_fd(&daemon.socket, &left.fd_secret).await {
        Err(HandoffError::Refused(message)) => assert_eq!(
            message,
            format!(
                "no such fd_secret for uid {uid}: a secret is only for the uid it was given to, \
                 and ends with its upload or session"
            )
        ),
        other => panic!("the freed region's secret still answers: {other:?}"),
    }
    drop(fd);
    assert_eq!(daemon.core.store.host_use(uid).uid_bytes, model);
}

/// A region that does not fit is refused before anything is made, naming the quota, what the
/// uid holds, what the region needs, what holds the memory and what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_over_the_host_quota_is_refused_with_the_numbers() {
    let daemon = start_daemon_with(|c| c.quotas.per_uid_host_bytes = 1 << 20).await;
    let (_client, manifest) = with_model(&daemon, 62).await;
    let uid = me();
    let model = daemon.core.store.host_use(uid).uid_bytes;
    let mut rpc = raw_client(&daemon.socket).await;
    let opened = rpc.open_session(open_request(&manifest)).await.unwrap();
    let session_id = opened.into_inner().session_id;
    rpc.alloc_state_region(alloc_request(&session_id, 8192))
        .await
        .unwrap();
    let got = refused(
        rpc.alloc_state_region(alloc_request(&session_id, 1 << 20))
            .await,
    );
    let entry = daemon.core.store.get(&manifest.model_id).unwrap();
    let shown = bytesize::ByteSize::b(entry.model.host_bytes())
        .display()
        .iec()
        .to_string();
    assert_eq!(
        got,
        (
            Code::ResourceExhausted,
            format!(
                "quotas.per_uid_host_bytes = 1048576 exceeded: uid {uid} holds {held} host bytes \
                 and this state region needs 1048576 more; held by: {id} '{name}' ({shown}; uid \
                 {uid}: a reference of an open connection, 1 session), 1 state region of \
                 sessions (8.0 KiB). `weightstream release MODEL_ID` gives back a reference of \
                 the uid that runs it; `weightstream release --all MODEL_ID`, run as root or as \
                 the daemon's user, gives back every uid's (the model goes once its sessions \
                 end). State regions go with their sessions (CloseSession), or by \
                 FreeStateRegion; a state region is charged whole when it is made: ask for \
                 fewer bytes, free host memory (state regions, sessions, models), or ask the \
                 daemon's administrator for a larger quota",
                held = model + 8192,
                id = manifest.model_id,
                name = entry.model.name,
            )
        )
    );
    assert_eq!(daemon.shm_count("state"), 1, "nothing made");
    assert_eq!(daemon.core.store.host_use(uid).uid_bytes, model + 8192);
}

/// Each bad request names its field and limit: bytes of 0 or over the limit, one region more
/// than a session may hold, a session that is not there, another connection's session, a
/// region that is not the session's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bad_state_request_names_its_field_and_limit() {
    let daemon = start_daemon_with(|c| {
        c.limits.max_state_region_bytes = 1 << 20;
        c.limits.max_state_regions_per_session = 2;
    })
    .await;
    let (mut client, manifest) = with_model(&daemon, 63).await;
    let info = client.info().await.unwrap().limits.unwrap();
    assert_eq!(
        (
            info.max_state_region_bytes,
            info.max_state_regions_per_session
        ),
        (1 << 20, 2)
    );
    let mut rpc = raw_client(&daemon.socket).await;
    let opened = rpc.open_session(open_request(&manifest)).await.unwrap();
    let s = opened.into_inner().session_id;
    let mut other = raw_client(&daemon.socket).await;
    let first = (rpc.alloc_state_region(alloc_request(&s, 1 << 20)).await)
        .unwrap()
        .into_inner();
    rpc.alloc_state_region(alloc_request(&s, 1)).await.unwrap();
    let free = |session_id: &str, region_id: &str| proto::FreeStateRegionRequest {
        session_id: session_id.into(),
        region_id: region_id.into(),
    };
    let cases = [
        (
            refused(rpc.alloc_state_region(alloc_request(&s, 0)).await),
            (Code::InvalidArgument, "bytes: must be more than 0".into()),
        ),
        (
            refused(
                rpc.alloc_state_region(alloc_request(&s, (1 << 20) + 1))
                    .await,
            ),
            (
                Code::InvalidArgument,
                "bytes: 1048577 is more than limits.max_state_region_bytes = 1048576".into(),
            ),
        ),
        (
            refused(rpc.alloc_state_region(alloc_request(&s, 1)).await),
            (
                Code::ResourceExhausted,
                format!(
                    "limits.max_state_regions_per_session = 2 reached: session '{s}' holds 2 \
                     state regions"
                ),
            ),
        ),
        (
            refused(rpc.alloc_state_region(alloc_request("s-99", 1)).await),
            (Code::NotFound, "unknown session_id 's-99'".into()),
        ),
        (
            refused(other.alloc_state_region(alloc_request(&s, 1)).await),
            (
                Code::PermissionDenied,
                format!("session_id '{s}' belongs to another connection"),
            ),
        ),
        (
            refused(other.free_state_region(free(&s, &first.region_id)).await),
            (
                Code::PermissionDenied,
                format!("session_id '{s}' belongs to another connection"),
            ),
        ),
        (
            refused(rpc.free_state_region(free(&s, "st-0000000000000000")).await),
            (
                Code::NotFound,
                "unknown region_id 'st-0000000000000000' (a state region ends with its session)"
                    .into(),
            ),
        ),
        (
            refused(rpc.free_state_region(free(&s, "")).await),
            (Code::InvalidArgument, "region_id: required".into()),
        ),
    ];
    let failed: Vec<String> = (cases.iter())
        .filter(|(got, want)| got != want)
        .map(|(got, want)| format!("want {want:?}, got {got:?}"))
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert_eq!(daemon.shm_count("state"), 2, "the refused made nothing");
}

/// Another uid gets neither a region's fd (its secret is its owner's) nor a region of a
/// session it does not own, nor frees one: the session is unknown to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_uid_can_neither_fetch_nor_touch_a_state_region() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let (_client, manifest) = with_model(&daemon, 64).await;
    let mut rpc = raw_client(&daemon.socket).await;
    let opened = rpc.open_session(open_request(&manifest)).await.unwrap();
    let s = opened.into_inner().session_id;
    let region = (rpc.alloc_state_region(alloc_request(&s, 4096)).await)
        .unwrap()
        .into_inner();
    let socket = &daemon.socket;
    assert_eq!(
        attack(ids, socket, "get", &[&region.fd_secret]).await,
        format!(
            "refused: no such fd_secret for uid {}: a secret is only for the uid it was given \
             to, and ends with its upload or session",
            ids.0
        )
    );
    let free = format!("free {s} {}", region.region_id);
    assert_eq!(
        attack(ids, socket, "touch", &[&format!("state {s}"), &free]).await,
        format!("NotFound: unknown session_id '{s}' | NotFound: unknown session_id '{s}'")
    );
    assert_eq!(daemon.core.store.host_use(ids.0).uid_bytes, 0);
    assert_eq!(daemon.shm_count("state"), 1);
    let (fd, size) = fetch_fd(socket, &region.fd_secret).await.unwrap();
    assert_eq!(size, 4096, "the owner's secret still works");
    drop(fd);
}
