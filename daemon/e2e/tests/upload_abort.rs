//! AbortUpload end to end: an upload its client will not commit is dropped at once, its quota
//! given back (the uid may begin another), its fd secret ended; what the client still holds of
//! its region stays charged until it lets go. Owned as CommitUpload is: another connection of
//! the uid is refused, another uid is told the id does not exist; an upload aborted, committed
//! or never begun is NOT_FOUND, and a commit after an abort too.
mod common;

use std::os::unix::fs::FileExt;

use attacker::{attack, attacker, daemon_for, no_forks};
use common::*;
use tonic::Code;
use weightstream_client::{HandoffError, proto};

// Shared with security.rs, whose helpers this file does not all use.
#[allow(dead_code)]
#[path = "security/attacker.rs"]
mod attacker;

fn me() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The status of a call, as `Code: message`.
fn refused<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (Code, String) {
    let status = r.expect_err("refused");
    (status.code(), status.message().to_string())
}

fn abort(upload_id: &str) -> proto::AbortUploadRequest {
    proto::AbortUploadRequest {
        upload_id: upload_id.into(),
    }
}

fn commit(upload_id: &str) -> proto::CommitUploadRequest {
    proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: upload_id.into(),
        ..Default::default()
    }
}

/// Under `quotas.per_uid_uploads = 1` a second upload is refused while the first is in
/// progress; aborting the first gives back its host bytes and its place at once (the
/// connection stays open), ends its secret, and the second goes through. The aborted upload
/// can be neither committed nor aborted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_upload_gives_its_quota_back_at_once() {
    let daemon = start_daemon_with(|c| c.quotas.per_uid_uploads = 1).await;
    let uid = me();
    let mut rpc = raw_client(&daemon.socket).await;
    let tensors = uniform_model(70, 2, 8192);
    let begun = (rpc.begin_upload(upload_request("job", &tensors)).await)
        .unwrap()
        .into_inner();
    let used = daemon.core.store.host_use(uid);
    assert!(used.uid_bytes > 16384, "charged: {used:?}");
    assert_eq!(
        refused(rpc.begin_upload(upload_request("retry", &tensors)).await),
        (
            Code::ResourceExhausted,
            format!("quotas.per_uid_uploads = 1 reached: uid {uid} has 1 upload in progress")
        )
    );

    rpc.abort_upload(abort(&begun.upload_id)).await.unwrap();
    assert_eq!(daemon.uploads(), 0);
    assert_eq!(daemon.shm_count("upload"), 0, "the daemon holds no region");
    assert_eq!(daemon.core.store.host_use(uid).uid_bytes, 0);
    let usage = (rpc.get_info(proto::GetInfoRequest {}).await)
        .unwrap()
        .into_inner()
        .usage
        .unwrap();
    assert_eq!(
        (usage.uploads, usage.host_bytes, usage.daemon_uploads),
        (0, 0, 0)
    );
    match fetch_fd(&daemon.socket, &begun.fd_secret).await {
        Err(HandoffError::Refused(message)) => assert_eq!(
            message,
            format!(
                "no such fd_secret for uid {uid}: a secret is only for the uid it was given to, \
                 and ends with its upload or session"
            )
        ),
        other => panic!("the aborted upload's secret still answers: {other:?}"),
    }
    let unknown = (
        Code::NotFound,
        format!("unknown upload_id '{}'", begun.upload_id),
    );
    assert_eq!(
        refused(rpc.commit_upload(commit(&begun.upload_id)).await),
        unknown
    );
    assert_eq!(
        refused(rpc.abort_upload(abort(&begun.upload_id)).await),
        unknown
    );

    let again = (rpc.begin_upload(upload_request("retry", &tensors)).await)
        .unwrap()
        .into_inner();
    let (fd, _) = fetch_fd(&daemon.socket, &again.fd_secret).await.unwrap();
    let file = std::fs::File::from(fd);
    for (slot, t) in again.tensors.iter().zip(&tensors) {
        file.write_all_at(t.as_upload().bytes, slot.offset).unwrap();
    }
    let committed = (rpc.commit_upload(commit(&again.upload_id)).await)
        .unwrap()
        .into_inner();
    assert_eq!(committed.manifest.unwrap().name, "retry");
}

/// An upload whose region the client still maps is dropped by the abort, but its bytes stay
/// charged to the uid until the client unmaps and closes it.
#[expect(clippy::await_holding_lock, reason = "see attacker::no_forks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_the_client_still_holds_stays_charged_until_it_lets_go() {
    // Its own last close is to free the region: no fork may hold a copy of it meanwhile.
    let _no_forks = no_forks();
    let daemon = start_daemon().await;
    let uid = me();
    let mut rpc = raw_client(&daemon.socket).await;
    let tensors = uniform_model(71, 1, 3 * 4096);
    let begun = (rpc.begin_upload(upload_request("held", &tensors)).await)
        .unwrap()
        .into_inner();
    let (fd, size) = fetch_fd(&daemon.socket, &begun.fd_secret).await.unwrap();
    assert_eq!(size, 12288);
    let file = std::fs::File::from(fd);
    let map = memmap2::MmapOptions::new()
        .len(12288)
        .map_raw(&file)
        .unwrap();
    file.write_all_at(b"half written", 0).unwrap();

    rpc.abort_upload(abort(&begun.upload_id)).await.unwrap();
    assert_eq!((daemon.uploads(), daemon.shm_count("upload")), (0, 0));
    let used = daemon.core.store.host_use(uid);
    assert_eq!(
        (used.uid_bytes, used.total_bytes),
        (12288, 12288),
        "what the client maps stays charged"
    );
    drop(map);
    assert_eq!(
        daemon.core.store.host_use(uid).uid_bytes,
        12288,
        "the fd still holds it"
    );
    drop(file);
    assert_eq!(daemon.core.store.host_use(uid).uid_bytes, 0);
    assert_eq!(daemon.core.shm.held().count(), 0);
}

/// Another connection of the uid is refused as for a commit, an empty id names its field, an
/// id never begun is NOT_FOUND; a committed upload is NOT_FOUND too and stays a model. None of
/// the refusals touches the upload, which still commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_uploading_connection_aborts_and_only_once() {
    let daemon = start_daemon().await;
    let mut rpc = raw_client(&daemon.socket).await;
    let mut other = raw_client(&daemon.socket).await;
    let tensors = uniform_model(72, 1, 4096);
    let begun = (rpc.begin_upload(upload_request("mine", &tensors)).await)
        .unwrap()
        .into_inner();
    let id = &begun.upload_id;
    let cases = [
        (
            refused(other.abort_upload(abort(id)).await),
            (
                Code::PermissionDenied,
                format!("upload_id '{id}' belongs to another connection"),
            ),
        ),
        (
            refused(other.commit_upload(commit(id)).await),
            (
                Code::PermissionDenied,
                format!("upload_id '{id}' belongs to another connection"),
            ),
        ),
        (
            refused(rpc.abort_upload(abort("")).await),
            (Code::InvalidArgument, "upload_id: required".into()),
        ),
        (
            refused(rpc.abort_upload(abort("up-0123456789abcdef")).await),
            (
                Code::NotFound,
                "unknown upload_id 'up-0123456789abcdef'".into(),
            ),
        ),
    ];
    let failed: Vec<String> = (cases.iter())
        .filter(|(got, want)| got != want)
        .map(|(got, want)| format!("want {want:?}, got {got:?}"))
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert_eq!(daemon.uploads(), 1, "the refusals left the upload");

    let committed = (rpc.commit_upload(commit(id)).await).unwrap().into_inner();
    let model_id = committed.manifest.unwrap().model_id;
    assert_eq!(
        refused(rpc.abort_upload(abort(id)).await),
        (Code::NotFound, format!("unknown upload_id '{id}'"))
    );
    assert!(
        daemon.core.store.get(&model_id).is_some(),
        "the model stays"
    );
}

/// Another uid cannot abort an upload: the id is unknown to it, exactly as one that does not
/// exist, and the upload stays its owner's, who can still commit it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_uid_cannot_abort_an_upload() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let mut rpc = raw_client(&daemon.socket).await;
    let tensors = uniform_model(73, 1, 4096);
    let begun = (rpc.begin_upload(upload_request("mine", &tensors)).await)
        .unwrap()
        .into_inner();
    let id = &begun.upload_id;
    let asks = [
        format!("abort {id}"),
        "abort up-0123456789abcdef".to_string(),
    ];
    let asks: Vec<&str> = asks.iter().map(String::as_str).collect();
    assert_eq!(
        attack(ids, &daemon.socket, "touch", &asks).await,
        format!(
            "NotFound: unknown upload_id '{id}' | NotFound: unknown upload_id \
             'up-0123456789abcdef'"
        )
    );
    assert_eq!(daemon.uploads(), 1);
    rpc.commit_upload(commit(id)).await.unwrap();
}
