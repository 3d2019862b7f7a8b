//! Access control and quotas end to end: the `[access]` allow-lists
//! refuse a peer on every call of the service and on the handoff socket, and log it; each
//! `[quotas]` limit is refused with its own message and given back when what it counts is
//! released. (Attacks from a second uid: `security.rs`.)
//!
//! The tests run as one uid, so the allow-lists are tested by listing another uid (refused) or
//! the test's own uid or gid (admitted).
mod common;

use std::path::PathBuf;

use common::*;
use tonic::Code;
use weightstream_client::{ClientError, HandoffError, proto};
use weightstream_daemon::config::{Rate, SizeOrShare};

fn me() -> (u32, u32, u32) {
    (
        rustix::process::getuid().as_raw(),
        rustix::process::getgid().as_raw(),
        std::process::id(),
    )
}

/// This process's supplementary groups, as the daemon reports them (sorted, no repeats).
fn my_groups() -> Vec<u32> {
    let mut groups: Vec<u32> = (rustix::process::getgroups().unwrap().iter())
        .map(|g| g.as_raw())
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

fn rejected(err: ClientError) -> (Code, String) {
    match err {
        ClientError::Rejected { code, message } => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn code_message(status: tonic::Status) -> (Code, String) {
    (status.code(), status.message().to_string())
}

const LAYER: usize = 64 << 10;

/// A model file of four 64 KiB layers: its arena is exactly 256 KiB (tensors are page-aligned).
fn model_file(dir: &std::path::Path, seed: u64) -> PathBuf {
    write_model(
        dir,
        &format!("m{seed}.safetensors"),
        &uniform_model(seed, 4, LAYER),
    )
}

fn upload_request(name: &str, bytes: u64) -> proto::BeginUploadRequest {
    proto::BeginUploadRequest {
        name: name.into(),
        tensors: vec![proto::TensorInfo {
            name: "w".into(),
            dtype: proto::Dtype::U8 as i32,
            shape: vec![bytes],
            nbytes: 0,
            ..Default::default()
        }],
        client_reserves: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_outside_the_allow_lists_is_refused_on_every_call_and_logged() {
    logs();
    let (uid, gid, pid) = me();
    let daemon = start_daemon_with(|c| {
        c.access.allowed_uids = vec![uid + 1];
        c.access.allowed_gids = vec![gid + 1];
    })
    .await;
    let want = (
        Code::PermissionDenied,
        format!(
            "uid {uid} (gid {gid}, groups {:?}, pid {pid}) may not use this daemon: neither \
             in access.allowed_uids [{}] nor in access.allowed_gids [{}]",
            my_groups(),
            uid + 1,
            gid + 1
        ),
    );
    let mut raw = raw_client(&daemon.socket).await;
    let got = raw.get_info(proto::GetInfoRequest {}).await.err().unwrap();
    assert_eq!(code_message(got), want, "GetInfo");
    let got = raw
        .load_model(proto::LoadModelRequest {
            paths: vec!["/nonexistent.safetensors".into()],
            name: String::new(),
            fd_token: "0".repeat(32),
            ..Default::default()
        })
        .await
        .err()
        .unwrap();
    assert_eq!(code_message(got), want, "LoadModel");
    let got = raw
        .begin_upload(upload_request("u", 16))
        .await
        .err()
        .unwrap();
    assert_eq!(code_message(got), want, "BeginUpload");
    let got = raw
        .release_model(proto::ReleaseModelRequest {
            model_id: "m-0".into(),
            all_references: false,
        })
        .await
        .err()
        .unwrap();
    assert_eq!(code_message(got), want, "ReleaseModel");
    let got = raw
        .open_session(proto::OpenSessionRequest {
            model_id: "m-0".into(),
            vram_budget: 1 << 20,
            groups: vec![group("g", &["w"])],
            ..Default::default()
        })
        .await
        .err()
        .unwrap();
    assert_eq!(code_message(got), want, "OpenSession");
    let got = raw
        .list_sessions(proto::ListSessionsRequest::default())
        .await
        .err()
        .unwrap();
    assert_eq!(code_message(got), want, "ListSessions");
    let got = RawRun::attach(&mut raw, "s-1").await.err().unwrap();
    assert_eq!(code_message(got), want, "Run");
    // The Rust client's calls surface the same status as a rejection.
    let mut client = daemon.client().await;
    assert_eq!(
        rejected(client.info().await.err().unwrap()),
        want,
        "Client::info"
    );
    // The handoff socket lets in whom the service lets in: the client's load stops there.
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), 9);
    let got = client
        .load_model(
            &[path],
            "",
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await;
    match got.err().unwrap() {
        ClientError::Handoff(HandoffError::Refused(message)) => {
            assert_eq!(message, want.1, "Client::load_model (PUT)")
        }
        other => panic!("Client::load_model: {other:?}"),
    }
    match fetch_fd(&daemon.socket, &"0".repeat(32)).await {
        Err(HandoffError::Refused(message)) => assert_eq!(message, want.1, "GET"),
        other => panic!("GET: {other:?}"),
    }

    // Each attempt is logged with the peer's uid and pid, and the method in the request span.
    for method in ["GetInfo", "LoadModel", "OpenSession", "Run"] {
        let lines = log_lines_with(&[
            "access denied",
            &format!("WeightStream/{method}"),
            &format!("uid={uid}"),
            &format!("pid={pid}"),
        ]);
        assert!(!lines.is_empty(), "no log line for the refused {method}");
    }

    // Health stays open to every peer that can open the socket (probes), and nothing was made.
    let channel = tonic::transport::Endpoint::from_static("http://weightstream.test")
        .connect_with_connector(tower::service_fn({
            let path = daemon.socket.clone();
            move |_: tonic::transport::Uri| {
                let path = path.clone();
                async move {
                    let s = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            }
        }))
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "weightstream.v1.WeightStream".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    assert_eq!(daemon.shm_total(), 0);
    assert_eq!(daemon.core.fd_drops.waiting(), 0, "no files kept");
}

/// Reflection lists the service in both versions, to a peer the allow-lists refuse as well
/// (it tells no more than the schema): grpcurl and Go's tools speak v1, grpcio-reflection
/// (Python) only v1alpha.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_v1_and_v1alpha_list_the_service_to_any_peer() {
    use tonic_reflection::pb::{v1, v1alpha};
    let (uid, _, _) = me();
    let daemon = start_daemon_with(|c| c.access.allowed_uids = vec![uid + 1]).await;

    let mut alpha = v1alpha::server_reflection_client::ServerReflectionClient::new(
        raw_channel(&daemon.socket).await,
    );
    let ask = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let answer = alpha
        .server_reflection_info(tokio_stream::iter([ask]))
        .await
        .expect("v1alpha reflection is served")
        .into_inner()
        .message()
        .await
        .unwrap()
        .and_then(|r| r.message_response);
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        answer
    else {
        panic!("v1alpha: no service list: {answer:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().any(|n| n == "weightstream.v1.WeightStream"),
        "v1alpha: {names:?}"
    );

    let mut v1 = v1::server_reflection_client::ServerReflectionClient::new(
        raw_channel(&daemon.socket).await,
    );
    let ask = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let answer = v1
        .server_reflection_info(tokio_stream::iter([ask]))
        .await
        .expect("v1 reflection is served")
        .into_inner()
        .message()
        .await
        .unwrap()
        .and_then(|r| r.message_response);
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) = answer
    else {
        panic!("v1: no service list: {answer:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().any(|n| n == "weightstream.v1.WeightStream"),
        "v1: {names:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_in_either_list_is_served() {
    let (uid, gid, _) = me();
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), 1);
    let expected = read_model(std::slice::from_ref(&path));
    for (uids, gids) in [(vec![uid], vec![]), (vec![uid + 1], vec![gid])] {
        let daemon = start_daemon_with(|c| {
            c.access.allowed_uids = uids.clone();
            c.access.allowed_gids = gids.clone();
        })
        .await;
        let mut client = daemon.client().await;
        let manifest = load(&mut client, std::slice::from_ref(&path), &expected).await;
        let groups = per_tensor_groups(&manifest);
        let session = client
            .open_session(options(&manifest.model_id, groups, 0, 1 << 20))
            .await
            .unwrap();
        let bytes = run_step(&session, &[0, 1, 2, 3], &expected).await;
        assert_eq!(bytes, model_bytes(&expected), "uids {uids:?} gids {gids:?}");
        session.close().await.unwrap();
        assert_eq!(client.release_model(&manifest.model_id).await.unwrap(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_uid_sessions_are_limited_and_a_closed_session_gives_its_place_back() {
    let (uid, _, _) = me();
    let daemon = start_daemon_with(|c| c.quotas.per_uid_sessions = 2).await;
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), 4);
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let opts = || options(&manifest.model_id, per_tensor_groups(&manifest), 0, 1 << 20);
    let first = client.open_session(opts()).await.unwrap();
    let _second = client.open_session(opts()).await.unwrap();
    // Per uid, not per connection: another connection of the same uid is refused too.
    let mut other = daemon.client().await;
    let want = (
        Code::ResourceExhausted,
        format!("quotas.per_uid_sessions = 2 reached: uid {uid} has 2 open sessions"),
    );
    assert_eq!(
        rejected(other.open_session(opts()).await.err().unwrap()),
        want
    );
    assert_eq!(
        daemon.shm_count("staging"),
        2,
        "nothing made for the refusal"
    );
    first.close().await.unwrap();
    let third = other.open_session(opts()).await.unwrap();
    run_step(&third, &[3, 2, 1, 0], &expected).await;
}

/// GetInfo says what a refusal would be measured against: the quotas as resolved, what the
/// caller's uid holds, and the daemon's totals; each changes as sessions and uploads come and go.
/// Each device carries the daemon's copy bandwidth limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_info_reports_the_quotas_and_the_caller_s_use() {
    let (uid, _, _) = me();
    let daemon = start_daemon_with(|c| {
        c.quotas.per_uid_sessions = 3;
        c.quotas.per_uid_device_bytes = 1 << 30;
        c.quotas.per_uid_host_bytes = 2 << 30;
        c.quotas.per_uid_uploads = 5;
        c.quotas.max_host_bytes = SizeOrShare::Bytes(4 << 30);
        c.quotas.max_device_bytes = SizeOrShare::Bytes(8 << 30);
        c.limits.max_uploads = 7;
        c.copy_bandwidth_limit = Some(Rate(25_000_000_000));
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), 8);
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let info = client.info().await.unwrap();
    assert_eq!(
        info.quotas,
        Some(proto::Quotas {
            per_uid_sessions: 3,
            per_uid_device_bytes: 1 << 30,
            per_uid_host_bytes: 2 << 30,
            per_uid_uploads: 5,
            max_host_bytes: 4 << 30,
            max_device_bytes: vec![8 << 30],
        })
    );
    assert_eq!(info.limits.unwrap().max_uploads, 7);
    assert_eq!(info.devices[0].copy_bandwidth_limit, 25_000_000_000);
    let idle = proto::QuotaUse {
        uid,
        daemon_device_bytes: vec![0],
        ..Default::default()
    };
    assert_eq!(info.usage, Some(idle.clone()));

    let manifest = load(&mut client, &[path], &expected).await;
    let host = daemon.core.store.host_use(uid).uid_bytes;
    let per_session = 4 * LAYER as u64;
    let session = client
        .open_session(options(
            &manifest.model_id,
            per_tensor_groups(&manifest),
            3 * LAYER as u64,
            per_session,
        ))
        .await
        .unwrap();
    let mut raw = raw_client(&daemon.socket).await;
    let begun = raw.begin_upload(upload_request("u", 16)).await.unwrap();
    let upload = daemon.core.store.host_use(uid).uid_bytes - host;
    let busy = proto::QuotaUse {
        uid,
        sessions: 1,
        device_bytes: per_session,
        host_bytes: host + upload,
        uploads: 1,
        daemon_sessions: 1,
        daemon_host_bytes: host + upload,
        daemon_uploads: 1,
        daemon_device_bytes: vec![per_session],
        state_bytes: 0,
        daemon_state_bytes: 0,
    };
    assert_eq!(client.info().await.unwrap().usage, Some(busy));

    drop((begun, raw));
    session.close().await.unwrap();
    assert_eq!(client.release_model(&manifest.model_id).await.unwrap(), 0);
    eventually("the upload goes with its connection", || {
        let mut client = client.clone();
        let idle = idle.clone();
        async move { client.info().await.unwrap().usage == Some(idle) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_bytes_are_limited_per_uid_and_per_device() {
    let (uid, _, _) = me();
    let dir = tempfile::tempdir().unwrap();
    let path = model_file(dir.path(), 5);
    let expected = read_model(std::slice::from_ref(&path));
    // 3 layers of staging, one resident: 256 KiB of device memory per session.
    let per_session = 4 * LAYER as u64;
    let limit = per_session + per_session / 2;
    let cases = [
        (
            "per uid",
            format!(
                "quotas.per_uid_device_bytes = {limit} exceeded: uid {uid} holds {per_session} \
                 device bytes and this session needs {per_session} more"
            ),
        ),
        (
            "per device",
            format!(
                "quotas.max_device_bytes = {limit} exceeded: the daemon holds {per_session} \
                 device bytes on host-0 and this session needs {per_session} more"
            ),
        ),
    ];
    for (which, message) in cases {
        let daemon = start_daemon_with(|c| match which {
            "per uid" => c.quotas.per_uid_device_bytes = limit,
            _ => c.quotas.max_device_bytes = SizeOrShare::Bytes(limit),
        })
        .await;
        let mut client = daemon.client().await;
        let manifest = load(&mut client, std::slice::from_ref(&path), &expected).await;
        let opts = || {
            options(
                &manifest.model_id,
                per_tensor_groups(&manifest),
                3 * LAYER as u64,
                per_session,
            )
        };
        let first = client.open_session(opts()).await.unwrap();
        let info = session_info(&mut client, first.id()).await.unwrap();
        assert_eq!(info.staging_bytes + info.resident_bytes, per_session);
        let got = rejected(client.open_session(opts()).await.err().unwrap());
        assert_eq!(got, (Code::ResourceExhausted, message), "{which}");
        assert_eq!(daemon.shm_count("staging"), 1, "{which}: nothing made");
        first.close().await.unwrap();
        let again = client.open_session(opts()).await.unwrap();
        run_step(&again, &[0, 1, 2, 3], &expected).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_bytes_are_limited_per_uid_and_in_total_and_shared_copies_count_once() {
    let (uid, _, _) = me();
    let dir = tempfile::tempdir().unwrap();
    let a = model_file(dir.path(), 6);
    let b = model_file(dir.path(), 7);
    let arena = 4 * LAYER as u64;
    // A model's description counts with its arena: per tensor its name, 8 bytes a dimension
    // and 64; and its name ("m6", "m7": the file's stem).
    let model = arena + 4 * ("layers.0.weight".len() as u64 + 2 * 8 + 64) + 2;
    let limit = arena + arena / 4;
    let cases = [
        ("per uid", "per_uid_host_bytes", format!("uid {uid}")),
        ("total", "max_host_bytes", "the daemon".to_string()),
    ];
    for (which, key, holder) in cases {
        let daemon = start_daemon_with(|c| match which {
            "per uid" => c.quotas.per_uid_host_bytes = limit,
            _ => c.quotas.max_host_bytes = SizeOrShare::Bytes(limit),
        })
        .await;
        let mut client = daemon.client().await;
        let first = client
            .load_model(
                std::slice::from_ref(&a),
                "",
                weightstream_client::proto::Quantization::None,
                |_| {},
            )
            .await
            .unwrap();
        // The refusal says what holds the memory, and how to free it.
        let held = format!(
            "held by: {} 'm6' ({}; uid {uid}: a reference of an open connection). \
             `weightstream release MODEL_ID` gives back a reference of the uid that runs it; \
             `weightstream release --all MODEL_ID`, run as root or as the daemon's user, gives \
             back every uid's (the model goes once its sessions end)",
            first.model_id,
            bytesize::ByteSize::b(model).display().iec()
        );
        let message = |used: u64, item: &str, need: u64| {
            (
                Code::ResourceExhausted,
                format!(
                    "quotas.{key} = {limit} exceeded: {holder} holds {used} host bytes and \
                     this {item} needs {need} more; {held}"
                ),
            )
        };
        let got = client
            .load_model(
                std::slice::from_ref(&b),
                "",
                weightstream_client::proto::Quantization::None,
                |_| {},
            )
            .await;
        assert_eq!(
            rejected(got.err().unwrap()),
            message(model, "model", model),
            "{which}"
        );
        assert_eq!(daemon.shm_count("model"), 1, "{which}: nothing made");
        // The same files again are the same copy: not charged twice.
        let again = client
            .load_model(
                std::slice::from_ref(&a),
                "",
                weightstream_client::proto::Quantization::None,
                |_| {},
            )
            .await
            .unwrap();
        assert_eq!(
            (again.model_id.as_str(), again.refcount),
            (first.model_id.as_str(), 2)
        );
        // An upload in progress counts as host bytes.
        let mut raw = raw_client(&daemon.socket).await;
        let got = raw
            .begin_upload(upload_request("u", arena / 2))
            .await
            .err()
            .unwrap();
        let upload = arena / 2 + ("w".len() as u64 + 8 + 64) + "u".len() as u64;
        assert_eq!(
            code_message(got),
            message(model, "upload", upload),
            "{which}"
        );
        assert_eq!(daemon.shm_count("upload"), 0);
        // Released (both references): the bytes are free again.
        assert_eq!(client.release_model(&first.model_id).await.unwrap(), 1);
        assert_eq!(client.release_model(&first.model_id).await.unwrap(), 0);
        let second = client
            .load_model(
                std::slice::from_ref(&b),
                "",
                weightstream_client::proto::Quantization::None,
                |_| {},
            )
            .await
            .unwrap();
        assert_eq!(second.refcount, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_in_progress_are_limited_per_uid_and_a_commit_frees_the_place() {
    let (uid, _, _) = me();
    let daemon = start_daemon_with(|c| c.quotas.per_uid_uploads = 1).await;
    let mut raw = raw_client(&daemon.socket).await;
    let begun = raw
        .begin_upload(upload_request("one", 4096))
        .await
        .unwrap()
        .into_inner();
    let want = (
        Code::ResourceExhausted,
        format!("quotas.per_uid_uploads = 1 reached: uid {uid} has 1 upload in progress"),
    );
    let got = raw.begin_upload(upload_request("two", 4096)).await;
    assert_eq!(code_message(got.err().unwrap()), want);
    // Per uid: another connection of the same uid is refused as well.
    let mut other = raw_client(&daemon.socket).await;
    let got = other.begin_upload(upload_request("two", 4096)).await;
    assert_eq!(code_message(got.err().unwrap()), want);
    assert_eq!(daemon.shm_count("upload"), 1);
    raw.commit_upload(proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: begun.upload_id,
        ..Default::default()
    })
    .await
    .unwrap();
    other
        .begin_upload(upload_request("two", 4096))
        .await
        .unwrap();
    // A closed connection's upload is dropped, and its place with it.
    drop(other);
    eventually("the closed connection's upload dropped", || async {
        daemon.uploads() == 0
    })
    .await;
    raw.begin_upload(upload_request("three", 4096))
        .await
        .unwrap();
}
