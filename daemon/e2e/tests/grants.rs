//! CopyGrant end to end: where the device has a copy bandwidth limit, a client asks before each
//! copy of its own (the LoRA's weights to the device, its gradients back), the daemon answers
//! once the bytes may go and counts them in the session's stats; a bad grant is refused naming
//! its field; without a limit the client is told not to ask, and asks nothing.

mod common;

use std::path::PathBuf;

use common::*;
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
    for (bytes, field) in [(0, 0), (budget + 1, budget + 1)] {
        match session.grant(bytes, true).await {
            Err(ClientError::Fault { code, message, .. }) => {
                assert_eq!(code, proto::FaultCode::FaultInvalidArgument);
                assert_eq!(
                    message,
                    format!(
                        "grant.bytes: {field} is outside 1 to the session's vram_budget \
                         ({budget})"
                    )
                );
            }
            other => panic!("{other:?}"),
        }
    }
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
