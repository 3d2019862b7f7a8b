//! The store against another uid, end to end: files are held to the limits uploads are and no
//! listing outgrows a message; a model is what the daemon read, not what a file's metadata
//! says; the store is a cache that gives memory back when it is needed; names reach no
//! terminal raw; ids say nothing about other uids' things.
//!
//! The attacker is this test binary again (`attacker::attacker_acts`), run as user
//! `ws-attacker` (tests/run.sh creates it when run as root). Without root or that user the
//! tests that need it are skipped, and fail when WEIGHTSTREAM_REQUIRE_ROOT=1 (tests/run.sh
//! sets it).
mod common;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use attacker::{attack, attacker, daemon_for};
use common::*;
use tonic::Code;
use weightstream_client::proto;
use weightstream_daemon::config::SizeOrShare;

#[path = "security/attacker.rs"]
mod attacker;

/// A directory the attacker can read, and write when `writable`.
fn shared_dir(writable: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mode = if writable { 0o777 } else { 0o755 };
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
    dir
}

/// A safetensors file of empty U8 tensors with these names (no data section), readable by all.
fn empty_tensors_file(dir: &Path, file: &str, names: impl Iterator<Item = String>) -> PathBuf {
    let mut header = Vec::from(b"{".as_slice());
    for (i, name) in names.enumerate() {
        if i > 0 {
            header.push(b',');
        }
        write!(
            header,
            r#""{name}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}"#
        )
        .unwrap();
    }
    header.push(b'}');
    let path = dir.join(file);
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    out.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    out.write_all(&header).unwrap();
    out.flush().unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

// ---------------------------------------------------------------------------------------------
// Limits while a header is parsed; listings that fit a message

/// A file is held to the limits an upload is, while its header is parsed: a tensor name of
/// 20 MiB (`limits.max_name_bytes`) or a million empty tensors
/// (`limits.max_tensors_per_model`) loaded by another uid is refused naming the limit, before
/// anything is stored or charged, and listing goes on working for every uid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_held_to_the_limits_of_uploads_and_every_uid_can_still_list() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let socket = &daemon.socket;
    let dir = shared_dir(false);
    let long = empty_tensors_file(
        dir.path(),
        "long.safetensors",
        std::iter::once("n".repeat(20 << 20)),
    );
    let many = empty_tensors_file(
        dir.path(),
        "many.safetensors",
        (0..1_000_000).map(|i| i.to_string()),
    );
    let (long, many) = (long.to_str().unwrap(), many.to_str().unwrap());
    assert_eq!(
        attack(ids, socket, "load-own", &[long, long]).await,
        format!(
            "InvalidArgument: {long}: tensor 0 of the header has a name of 20971520 bytes: \
             limits.max_name_bytes = 1024"
        )
    );
    assert_eq!(
        attack(ids, socket, "load-own", &[many, many]).await,
        format!(
            "InvalidArgument: {many}: the header lists more than 100000 tensors: \
             limits.max_tensors_per_model = 100000"
        )
    );
    let store = &daemon.core.store;
    assert_eq!(
        (daemon.shm_total(), store.host_use(ids.0)),
        (0, Default::default())
    );

    let path = write_model(dir.path(), "fine.safetensors", &mixed_model(90));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let fine = load(&mut client, &[path], &expected).await;
    let listed = client.list_models().await.unwrap().models;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].model_id, fine.model_id);
    assert_eq!(attack(ids, socket, "list", &[]).await, fine.model_id);
}

/// A model whose manifest could not be sent in one message is refused before it is stored,
/// loaded or uploaded; a page of ListModels holds the manifests that fit in a message (fewer
/// than `page_size` when they are large), and the client reads every page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_model_and_no_page_of_models_outgrows_a_message() {
    let daemon = start_daemon_with(|c| c.limits.max_message_bytes = 64 << 10).await;
    let dir = tempfile::tempdir().unwrap();
    // A tensor's manifest entry here is about 110 bytes: 250 make ~27 KB (two to a page of
    // 64 KiB), 400 more than a message may describe.
    let model = |seed: u64, n: usize| -> Vec<Tensor> {
        (0..n)
            .map(|i| {
                let name = format!("{seed}.{i:0>96}");
                Tensor::new(&name, safetensors::Dtype::U8, &[4], vec![seed as u8; 4])
            })
            .collect()
    };
    let mut client = daemon.client().await;
    let mut ids = Vec::new();
    for seed in 0..5 {
        let path = write_model(
            dir.path(),
            &format!("{seed}.safetensors"),
            &model(seed, 250),
        );
        let expected = read_model(std::slice::from_ref(&path));
        ids.push(load(&mut client, &[path], &expected).await.model_id);
    }
    ids.sort();

    let refused = "the model's description (its tensors' names and shapes) takes up to 79875 \
                   bytes, more than one message holds with the rest of an answer: \
                   limits.max_message_bytes = 65536";
    let big = write_model(dir.path(), "big.safetensors", &model(9, 400));
    let mut raw = raw_client(&daemon.socket).await;
    let status = raw_load(
        &mut raw,
        &daemon.socket,
        std::slice::from_ref(&big),
        &[big.to_str().unwrap()],
    )
    .await
    .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, refused)
    );
    let status = raw
        .begin_upload(upload_request("big", &model(9, 400)))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, refused)
    );
    assert_eq!((daemon.uploads(), daemon.shm_count("model")), (0, 5));

    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let page = raw
            .list_models(proto::ListModelsRequest {
                page_size: 100,
                page_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        pages.push(
            page.models
                .iter()
                .map(|m| m.model_id.clone())
                .collect::<Vec<_>>(),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(
        pages,
        vec![ids[..2].to_vec(), ids[2..4].to_vec(), ids[4..].to_vec()]
    );
    let all = client.list_models().await.unwrap().models;
    let all: Vec<String> = all.into_iter().map(|m| m.model_id).collect();
    assert_eq!(all, ids, "the client reads every page");
}

// ---------------------------------------------------------------------------------------------
// Identity from the bytes read

/// A model is the bytes the daemon read, not what a file's stat says: the attacker loads its
/// world-readable file, then rewrites it through a shared writable mapping (the file's inode,
/// size, mtime and ctime stay as they were); another uid loading the file gets another model,
/// with the new bytes, and the attacker's model keeps the bytes it was loaded with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_changed_under_its_stat_is_a_new_model_with_the_new_bytes() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let dir = shared_dir(true);
    let (old, new) = (uniform_model(93, 2, 4096), uniform_model(94, 2, 4096));
    let path = write_model(dir.path(), "m.safetensors", &old);
    let replacement = write_model(dir.path(), "new.safetensors", &new);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        std::fs::metadata(&replacement).unwrap().len()
    );
    std::os::unix::fs::chown(&path, Some(ids.0), Some(ids.1)).unwrap();
    for file in [&path, &replacement] {
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let expected_old = read_model(std::slice::from_ref(&path));

    let args = [path.to_str().unwrap(), replacement.to_str().unwrap()];
    let mut child = attacker::spawn_attacker(ids, &daemon.socket, "rewrite-mapped", &args);
    let got = attacker::result_of(&mut child).await;
    let theirs = (got
        .strip_prefix("loaded ")
        .and_then(|s| s.strip_suffix(" (same stat)")))
    .unwrap_or_else(|| panic!("loaded, then rewritten under the same stat: {got}"));
    let expected_new = read_model(std::slice::from_ref(&path));
    assert_ne!(expected_new, expected_old, "the file's bytes changed");

    let mut client = daemon.client().await;
    let mine = load(&mut client, std::slice::from_ref(&path), &expected_new).await;
    assert_ne!(mine.model_id, theirs);
    assert_eq!(mine.refcount, 1);
    let groups = per_tensor_groups(&mine);
    let session = client
        .open_session(options(&mine.model_id, groups, 0, 1 << 20))
        .await
        .unwrap();
    assert_eq!(
        run_step(&session, &[0, 1], &expected_new).await,
        model_bytes(&expected_new)
    );
    session.close().await.unwrap();
    let stored = daemon.core.store.get(theirs).unwrap().model;
    for (i, t) in stored.tensors.iter().enumerate() {
        assert!(
            stored.slice(i).bytes() == &expected_old[&t.name].bytes[..],
            "{}",
            t.name
        );
    }
    // Loaded again unchanged, the file is found by its bytes: the same model, read, not copied.
    let again = load(&mut client, std::slice::from_ref(&path), &expected_new).await;
    assert_eq!(
        (again.model_id.as_str(), again.refcount),
        (mine.model_id.as_str(), 2)
    );
    assert_eq!(daemon.shm_count("model"), 2);
    drop(child.stdin.take());
    let status = tokio::task::spawn_blocking(move || child.wait()).await;
    assert!(status.unwrap().unwrap().success());
}

// ---------------------------------------------------------------------------------------------
// The store as a cache

const MIB: usize = 1 << 20;

/// A daemon of 3 MiB of host memory (and more than one model of 2 MiB does not fit).
async fn small_daemon(attacker_gid: u32) -> TestDaemon {
    daemon_for(attacker_gid, |c| {
        c.quotas.max_host_bytes = SizeOrShare::Bytes(3 * MIB as u64);
    })
    .await
}

/// Uploads a model of one 2 MiB tensor as this process (seed `seed`).
async fn upload_2mib(
    client: &mut weightstream_client::Client,
    seed: u64,
) -> Result<proto::ModelManifest, weightstream_client::ClientError> {
    let tensors = uniform_model(seed, 1, 2 * MIB);
    let data: Vec<_> = tensors.iter().map(Tensor::as_upload).collect();
    client.upload_model("mine", &data).await.map(|(m, _)| m)
}

/// A job of another uid uploads and exits: its model stays as a cache entry, and the next
/// upload that needs the memory, by this uid, evicts it and succeeds. An upload whose
/// reference lasts as long as its connection goes when the job exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_of_a_job_that_exited_makes_room_for_the_next() {
    let Some(ids) = attacker() else { return };
    let daemon = small_daemon(ids.1).await;
    let socket = &daemon.socket;
    let size = (2 * MIB).to_string();
    let got = attack(ids, socket, "upload", &["cached", &size, "95"]).await;
    let theirs = got
        .strip_prefix("uploaded ")
        .unwrap_or_else(|| panic!("{got}"));
    let mut client = daemon.client().await;
    eventually(
        "the job's connection is gone: its model is a cache entry",
        || {
            let (mut client, id) = (client.clone(), theirs.to_string());
            async move { model_listed(&mut client, &id).await.unwrap().cached }
        },
    )
    .await;
    assert_eq!(
        model_listed(&mut client, theirs).await.unwrap().refcount,
        1,
        "kept"
    );

    let mine = upload_2mib(&mut client, 96).await.unwrap();
    assert!(model_listed(&mut client, theirs).await.is_none(), "evicted");
    let listed = model_listed(&mut client, &mine.model_id).await.unwrap();
    assert_eq!(
        (listed.refcount, listed.cached),
        (1, false),
        "this connection holds it"
    );

    // A job whose upload lasts as long as its connection leaves nothing behind.
    assert_eq!(client.release_model(&mine.model_id).await.unwrap(), 0);
    let got = attack(ids, socket, "upload", &["connection", &size, "97"]).await;
    let theirs = got
        .strip_prefix("uploaded ")
        .unwrap_or_else(|| panic!("{got}"));
    eventually("the exited job's upload is released", || {
        let (mut client, id) = (client.clone(), theirs.to_string());
        async move { model_listed(&mut client, &id).await.is_none() }
    })
    .await;
    assert_eq!(daemon.shm_total(), 0);
}

/// A pinned model is not evicted: the upload that needs its memory is refused with a message
/// that names the model, whose it is and the commands that free it; the attacker cannot give
/// back other uids' references, root can, and the upload then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_model_stays_and_the_refusal_says_who_holds_the_memory() {
    let Some(ids) = attacker() else { return };
    let daemon = small_daemon(ids.1).await;
    let socket = &daemon.socket;
    let size = (2 * MIB).to_string();
    let got = attack(ids, socket, "upload", &["pinned", &size, "98"]).await;
    let theirs = got
        .strip_prefix("uploaded ")
        .unwrap_or_else(|| panic!("{got}"));
    let mut client = daemon.client().await;
    let err = upload_2mib(&mut client, 99).await.unwrap_err();
    let uid = ids.0;
    let held = daemon.core.store.get(theirs).unwrap().model.host_bytes();
    let need = held - "job".len() as u64 + "mine".len() as u64;
    assert_eq!(err.code(), Some(Code::ResourceExhausted), "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "ResourceExhausted: quotas.max_host_bytes = 3145728 exceeded: the daemon holds \
             {held} host bytes and this upload needs {need} more; held by: {theirs} 'job' \
             (2.0 MiB; uid {uid}: pinned). `weightstream release MODEL_ID` gives back a \
             reference of the uid that runs it; `weightstream release --all MODEL_ID`, run as \
             root or as the daemon's user, gives back every uid's (the model goes once its \
             sessions end)"
        )
    );
    assert_eq!(
        attack(ids, socket, "release-all", &[theirs]).await,
        format!(
            "failed: PermissionDenied: all_references: uid {uid} may not give back other uids' \
             references to a model: only root and the daemon's user (uid 0) may"
        )
    );
    assert!(
        model_listed(&mut client, theirs).await.is_some(),
        "pinned, kept"
    );
    assert_eq!(client.release_model_for_all(theirs).await.unwrap(), 0);
    assert!(model_listed(&mut client, theirs).await.is_none());
    upload_2mib(&mut client, 99).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Ids

/// Another uid's upload, session and model answer NOT_FOUND exactly as ids that do not exist:
/// same code, same message. Upload ids are 64 random bits, not a count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_uids_ids_answer_as_ids_that_do_not_exist() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let mut raw = raw_client(&daemon.socket).await;
    let mut uploads = Vec::new();
    for _ in 0..2 {
        let begun = raw
            .begin_upload(upload_request("mine", &uniform_model(91, 1, 4096)))
            .await
            .unwrap()
            .into_inner();
        uploads.push(begun.upload_id);
    }
    for id in &uploads {
        let hex = id.strip_prefix("up-").unwrap();
        assert!(
            hex.len() == 16 && hex.chars().all(|c| c.is_ascii_hexdigit()),
            "{id}"
        );
    }
    assert_ne!(uploads[0], uploads[1]);
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &mixed_model(92));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let session = client
        .open_session(options(
            &manifest.model_id,
            per_tensor_groups(&manifest),
            0,
            1 << 20,
        ))
        .await
        .unwrap();
    let (model, missing_model) = (&manifest.model_id, "m-0123456789abcdef");
    let asks = [
        format!("commit {}", uploads[0]),
        "commit up-0123456789abcdef".to_string(),
        format!("close {}", session.id()),
        "close s-999".to_string(),
        format!("release {model}"),
        format!("release {missing_model}"),
    ];
    let asks: Vec<&str> = asks.iter().map(String::as_str).collect();
    let got = attack(ids, &daemon.socket, "touch", &asks).await;
    let uid = ids.0;
    let no_ref = |id: &str| {
        format!(
            "NotFound: uid {uid} holds no reference to model_id '{id}': only a uid that loaded \
             or uploaded it may release it"
        )
    };
    let want = [
        format!("NotFound: unknown upload_id '{}'", uploads[0]),
        "NotFound: unknown upload_id 'up-0123456789abcdef'".to_string(),
        format!("NotFound: unknown session_id '{}'", session.id()),
        "NotFound: unknown session_id 's-999'".to_string(),
        no_ref(model),
        no_ref(missing_model),
    ];
    assert_eq!(got, want.join(" | "));
    // All of it still the owner's.
    assert_eq!(daemon.uploads(), 2);
    raw.commit_upload(proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: uploads[0].clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    session.close().await.unwrap();
}
