//! CopyGrant end to end: where the device has a copy bandwidth limit, a client asks before each
//! copy of its own (the LoRA's weights to the device, its gradients back), the daemon answers
//! once the bytes may go and counts them in the session's stats; a bad grant is refused naming
//! its field; without a limit the client is told not to ask, and asks nothing.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use tokio::sync::mpsc::UnboundedSender;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use weightstream_client::{ClientError, Session, proto};

const LAYER: usize = 64 << 10;

/// A daemon (with `limit`, bytes per second) holding a 4-layer model, and a session on it.
async fn session_with(limit: Option<u64>) -> (TestDaemon, weightstream_client::Client, Session) {
    let daemon = start_daemon_with(|c| {
        c.copy_bandwidth_limit = limit.map(weightstream_daemon::config::Rate);
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = write_model(dir.path(), "m.safetensors", &uniform_model(3, 4, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, std::slice::from_ref(&path), &expected).await;
    let groups = per_tensor_groups(&manifest);
    let layer = LAYER as u64;
    let opts = options(&manifest.model_id, groups, 4 * layer, 4 * layer);
    let session = client.open_session(opts).await.unwrap();
    (daemon, client, session)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_client_copies_only_once_granted_and_the_daemon_counts_it() {
    let (_daemon, mut client, session) = session_with(Some(1_000_000_000)).await;
    assert!(session.paces_client_copies() && session.layout().paces_client_copies);
    within("grants", async {
        session.grant(100_000, true).await.unwrap();
        session.grant(200_000, false).await.unwrap();
        session.grant(1, true).await.unwrap();
    })
    .await;
    // Counted before the answer went out.
    let st = stats(&mut client, session.id()).await;
    assert_eq!(
        (st.granted_h2d_bytes, st.granted_d2h_bytes),
        (100_001, 200_000)
    );
    let budget = 4 * LAYER as u64;
    assert_eq!(session.layout().max_grant_bytes, budget);
    match session.grant(0, true).await {
        Err(ClientError::Fault { code, message, .. }) => {
            assert_eq!(code, proto::FaultCode::FaultInvalidArgument);
            assert_eq!(
                message,
                format!(
                    "grant.bytes: 0 is outside 1 to {budget} (the smaller of the daemon's \
                     largest grant, 268435456, and the {budget} device bytes the session is \
                     charged for): split the copy into grants of at most {budget} bytes"
                )
            );
        }
        other => panic!("{other:?}"),
    }
    // The client splits a larger copy into grants the daemon takes.
    session.grant(2 * budget + 1, true).await.unwrap();
    let st = stats(&mut client, session.id()).await;
    assert_eq!(st.granted_h2d_bytes, 100_001 + 2 * budget + 1);
    // The session serves on.
    session.grant(budget, false).await.unwrap();
    let st = stats(&mut client, session.id()).await;
    assert_eq!(st.granted_d2h_bytes, 200_000 + budget);
    session.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpaced_client_is_told_not_to_ask() {
    let (_daemon, mut client, session) = session_with(None).await;
    assert!(!session.paces_client_copies());
    session.grant(3 << 20, true).await.unwrap();
    let st = stats(&mut client, session.id()).await;
    assert_eq!((st.granted_h2d_bytes, st.granted_d2h_bytes), (0, 0));
    session.close().await.unwrap();
}

/// A daemon, as `adjust` has it, holding the 4-layer model.
async fn daemon_with_model(
    adjust: impl FnOnce(&mut weightstream_daemon::config::ConfigFile),
) -> (TestDaemon, proto::ModelManifest) {
    let daemon = start_daemon_with(adjust).await;
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = write_model(dir.path(), "m.safetensors", &uniform_model(3, 4, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, std::slice::from_ref(&path), &expected).await;
    (daemon, manifest)
}

/// A session driven through the generated stubs, as any program may: what it sends is not
/// shaped by client-rs.
struct Raw {
    tx: UnboundedSender<proto::ClientMessage>,
    rx: tonic::Streaming<proto::ServerMessage>,
    opened: proto::OpenSessionResponse,
    _rpc: weightstream_client::proto::weight_stream_client::WeightStreamClient<
        tonic::transport::Channel,
    >,
}

impl Raw {
    async fn open(
        daemon: &TestDaemon,
        manifest: &proto::ModelManifest,
        budget: u64,
        staging: u64,
    ) -> Result<Raw, tonic::Status> {
        let mut rpc = raw_client(&daemon.socket).await;
        let opened = rpc
            .open_session(proto::OpenSessionRequest {
                model_id: manifest.model_id.clone(),
                vram_budget: budget,
                staging_bytes: staging,
                groups: per_tensor_groups(manifest),
                ..Default::default()
            })
            .await?
            .into_inner();
        let (tx, inbound) = tokio::sync::mpsc::unbounded_channel();
        let attach = proto::client_message::Msg::Attach(proto::Attach {
            session_id: opened.session_id.clone(),
        });
        tx.send(proto::ClientMessage { msg: Some(attach) }).unwrap();
        let mut rx = rpc
            .run(UnboundedReceiverStream::new(inbound))
            .await?
            .into_inner();
        match within("attached", rx.next()).await {
            Some(Ok(proto::ServerMessage {
                msg: Some(proto::server_message::Msg::Attached(_)),
            })) => {}
            other => panic!("{other:?}"),
        }
        Ok(Raw {
            tx,
            rx,
            opened,
            _rpc: rpc,
        })
    }

    fn grant(&self, id: u64, bytes: u64, to_device: bool) {
        let direction = if to_device {
            proto::CopyDirection::HostToDevice
        } else {
            proto::CopyDirection::DeviceToHost
        };
        let grant = proto::client_message::Msg::Grant(proto::CopyGrant {
            id,
            bytes,
            direction: direction as i32,
        });
        self.tx
            .send(proto::ClientMessage { msg: Some(grant) })
            .unwrap();
    }

    /// The next answer: Ok(id) granted, Err((id, code, message)) refused.
    async fn answer(&mut self) -> Result<u64, (u64, proto::FaultCode, String)> {
        match within("an answer", self.rx.next()).await {
            Some(Ok(proto::ServerMessage {
                msg: Some(proto::server_message::Msg::Granted(g)),
            })) => Ok(g.id),
            Some(Ok(proto::ServerMessage {
                msg: Some(proto::server_message::Msg::Fault(f)),
            })) => Err((f.ticket, f.code(), f.message)),
            other => panic!("{other:?}"),
        }
    }
}

/// A budget past the device's memory is refused, naming it: a session is charged for what its
/// budget lets it do (the budget bounds its grants), and 2^63 bytes are on no device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_past_the_devices_memory_is_refused() {
    let (daemon, manifest) = daemon_with_model(|c| {
        c.copy_bandwidth_limit = Some(weightstream_daemon::config::Rate(100_000_000));
    })
    .await;
    let device = daemon.core.backend.devices()[0].total_memory;
    let status = Raw::open(&daemon, &manifest, 1 << 63, LAYER as u64)
        .await
        .err()
        .expect("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        status.message(),
        format!(
            "vram_budget 9223372036854775808 exceeds the device's memory ({device} bytes): ask \
             for at most that"
        )
    );
}

/// A grant is bounded by what its session is charged for: with a one-layer staging arena and
/// the model resident (5 layers' bytes charged) under a 1 GiB budget, a grant of twice that or
/// of the budget is refused naming the bound; one of the bound is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_bounded_by_what_its_session_is_charged_for() {
    let (daemon, manifest) = daemon_with_model(|c| {
        c.copy_bandwidth_limit = Some(weightstream_daemon::config::Rate(1_000_000_000));
    })
    .await;
    let layer = LAYER as u64;
    let mut raw = Raw::open(&daemon, &manifest, 1 << 30, layer).await.unwrap();
    let charged = raw.opened.staging_bytes + raw.opened.resident_bytes;
    assert_eq!(
        (charged, raw.opened.max_grant_bytes),
        (5 * layer, 5 * layer)
    );
    raw.grant(1, 2 * charged, true);
    raw.grant(2, 1 << 30, false);
    raw.grant(3, charged, true);
    for id in [1, 2] {
        let (ticket, code, message) = raw.answer().await.unwrap_err();
        let bytes = if id == 1 { 2 * charged } else { 1 << 30 };
        assert_eq!((ticket, code), (id, proto::FaultCode::FaultInvalidArgument));
        assert_eq!(
            message,
            format!(
                "grant.bytes: {bytes} is outside 1 to {charged} (the smaller of the daemon's \
                 largest grant, 268435456, and the {charged} device bytes the session is \
                 charged for): split the copy into grants of at most {charged} bytes"
            )
        );
    }
    assert_eq!(raw.answer().await, Ok(3));
}

/// One session's grants, however many, make another session's wait at most a piece of theirs
/// in each direction (100 MB/s: a piece is 8 MiB, 84 ms), not their sum (here 2 × 2 GiB, over
/// 40 s); a session may have only `max_waiting_grants` waiting, the next refused naming the
/// limit; and once the session has closed, nothing of it is queued or charged: another
/// session's grants go at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sessions_grants_cost_another_at_most_a_piece_and_end_with_it() {
    let (daemon, manifest) = daemon_with_model(|c| {
        c.copy_bandwidth_limit = Some(weightstream_daemon::config::Rate(100_000_000));
        c.limits.max_waiting_grants = 64;
    })
    .await;
    let mib = 1 << 20;
    // Staging of 32 MiB: grants of 32 MiB.
    let mut attacker = Raw::open(&daemon, &manifest, 64 * mib, 32 * mib)
        .await
        .unwrap();
    assert_eq!(attacker.opened.max_grant_bytes, 32 * mib + 4 * LAYER as u64);
    for id in 0..64 {
        attacker.grant(id, 32 * mib, id % 2 == 0);
    }
    attacker.grant(64, 1, true);
    // The burst lets some go at once; the rest wait, and the 65th is one too many.
    let refused = loop {
        match attacker.answer().await {
            Ok(_) => continue,
            Err(refused) => break refused,
        }
    };
    assert_eq!(
        refused,
        (
            64,
            proto::FaultCode::FaultResourceExhausted,
            "grant: 64 grants waiting, the limit is max_waiting_grants = 64: wait for an \
             answer before asking again"
                .to_string()
        )
    );
    let mut victim = Raw::open(&daemon, &manifest, 64 * mib, 4 * mib)
        .await
        .unwrap();
    let asked = Instant::now();
    victim.grant(1, mib, true);
    victim.grant(2, mib, false);
    let mut answered: Vec<_> = vec![victim.answer().await, victim.answer().await];
    answered.sort();
    assert_eq!(answered, [Ok(1), Ok(2)]);
    // Two pieces of the attacker's at most (one begun, one taken before the victim's turn).
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(2), "{took:?}");

    drop(attacker);
    eventually("the attacker's session ended", || async {
        daemon.core.scheduler.stats(0).queued == 0 && daemon.core.list_sessions().len() == 1
    })
    .await;
    // Nothing left charged: 16 MiB each way (the burst) go without a wait.
    let asked = Instant::now();
    victim.grant(3, 4 * mib, true);
    victim.grant(4, 4 * mib, false);
    let mut answered: Vec<_> = vec![victim.answer().await, victim.answer().await];
    answered.sort();
    assert_eq!(answered, [Ok(3), Ok(4)]);
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(2), "{took:?}");
}
