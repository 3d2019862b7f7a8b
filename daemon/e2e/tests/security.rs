//! The daemon's defences, end to end, with the attacker as another uid where it takes one: the
//! daemon reads no file for a peer that cannot (the confused deputy), files that are not
//! regular never reach it and stall nobody, an uploader can neither truncate its region nor
//! change it after commit, shared memory has no name, a peer gets no other uid's fds,
//! descriptions count toward host quotas and lists come in pages, a rewritten file is a new
//! model, and a session holds a reference that takes the host charge.
//!
//! The attacker is this test binary again (`attacker_acts`), run as user `ws-attacker`
//! (tests/run.sh creates it when run as root). Without root or that user the tests that need
//! it are skipped, and fail when WEIGHTSTREAM_REQUIRE_ROOT=1 (tests/run.sh sets it).
mod common;

use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use attacker::{attack, attack_in, attacker, daemon_for, result_of, spawn_attacker};
use common::*;
use rustix::fs::{Mode, OFlags};
use tonic::Code;
use weightstream_client::{HandoffError, proto};

const LAYER: usize = 64 << 10;

#[path = "security/attacker.rs"]
mod attacker;

// ---------------------------------------------------------------------------------------------
// (a) the confused deputy

/// The attacker cannot get the daemon to read a file it may not read itself: it cannot open
/// the file to pass it; LoadModel without a token is refused, and so is the token the owner
/// got for the file (which stays good for its owner); and what the attacker names a load is a
/// name only: the daemon reads the fd it passed, never the path, and shows the file by its own
/// path when the name given is not that file's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_reads_no_file_for_a_peer_that_cannot() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = write_model(
        dir.path(),
        "secret.safetensors",
        &uniform_model(70, 2, LAYER),
    );
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let own = write_model(dir.path(), "own.safetensors", &mixed_model(71));
    std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (socket, shown) = (&daemon.socket, secret.to_str().unwrap());

    assert_eq!(attack(ids, socket, "open", &[shown]).await, "errno 13");
    assert_eq!(
        attack(ids, socket, "load-token", &["", shown]).await,
        "InvalidArgument: fd_token: required — open the files in the client and pass them \
         through the handoff socket (the weightstream clients do)"
    );
    let token = put_files(socket, vec![std::fs::File::open(&secret).unwrap()])
        .await
        .unwrap();
    assert_eq!(
        attack(ids, socket, "load-token", &[&token, shown]).await,
        "InvalidArgument: fd_token: unknown, expired or already used (a token is good for one \
         LoadModel by the uid that passed the files, within 60s)"
    );
    let mut rpc = raw_client(socket).await;
    let loaded = load_with_token(&mut rpc, &[shown], &token).await.unwrap();
    assert_eq!(loaded.tensors.len(), 2, "the owner's token still works");

    let got = attack(ids, socket, "load-own", &[own.to_str().unwrap(), shown]).await;
    let mixed: Vec<String> = read_model(std::slice::from_ref(&own)).into_keys().collect();
    assert!(got.starts_with("loaded m-"), "{got}");
    assert!(
        got.ends_with(&format!("named own with {}", mixed.join(","))),
        "the attacker's own bytes, named by its own file (not the path it claimed): {got}"
    );
    assert_still_serves(&daemon, 72).await;
}

// ---------------------------------------------------------------------------------------------
// (b) files that are not regular, and peers that stall

/// A FIFO, a directory and a symbolic link passed through the handoff socket are refused
/// there, each with its own message; a peer that connects and sends nothing (or half a
/// request) holds only its own exchange: meanwhile others load and commit at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_not_a_regular_file_is_refused_and_stalls_nobody() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fifo = d.join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        Mode::RUSR | Mode::WUSR,
        0,
    )
    .unwrap();
    let model = write_model(d, "m.safetensors", &mixed_model(73));
    std::os::unix::fs::symlink(&model, d.join("link.safetensors")).unwrap();
    let open = |path: &Path, flags: OFlags| -> std::fs::File {
        std::fs::File::from(rustix::fs::open(path, flags | OFlags::CLOEXEC, Mode::empty()).unwrap())
    };
    let cases = [
        (
            open(&fifo, OFlags::RDONLY | OFlags::NONBLOCK),
            "file 0 is a FIFO: only regular files can be passed",
        ),
        (
            open(d, OFlags::RDONLY | OFlags::DIRECTORY),
            "file 0 is a directory: only regular files can be passed",
        ),
        (
            open(&d.join("link.safetensors"), OFlags::PATH | OFlags::NOFOLLOW),
            "file 0 is a symbolic link: only regular files can be passed",
        ),
    ];
    let mut failures = Vec::new();
    for (file, want) in cases {
        match put_files(&daemon.socket, vec![file]).await {
            Err(HandoffError::Refused(m)) if m == want => {}
            other => failures.push(format!("want {want:?}, got {other:?}")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");

    // Stallers: one says nothing, one half a request.
    let silent = std::os::unix::net::UnixStream::connect(daemon.handoff()).unwrap();
    let mut half = std::os::unix::net::UnixStream::connect(daemon.handoff()).unwrap();
    half.write_all(b"GE").unwrap();
    let started = Instant::now();
    let expected = read_model(std::slice::from_ref(&model));
    let mut client = daemon.client().await;
    load(&mut client, std::slice::from_ref(&model), &expected).await;
    let tensors = uniform_model(74, 2, 4096);
    let data: Vec<_> = tensors.iter().map(Tensor::as_upload).collect();
    client.upload_model("meanwhile", &data).await.unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "waited {took:?} behind the stallers"
    );
    drop((silent, half));
    assert_still_serves(&daemon, 75).await;
}

/// One uid's idle connections to the handoff socket keep no other uid out: past
/// `limits.max_connections_per_uid` they are refused at accept (the peer is told why, and the
/// log names its uid), so another uid's load and upload, which pass fds through that socket,
/// go through while they are held; and each one that never sends a request is cut and logged
/// with its uid and pid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_uids_idle_handoff_connections_keep_no_other_uid_out() {
    let Some(ids) = attacker() else { return };
    logs();
    let daemon = daemon_for(ids.1, |_| {}).await;
    let refused = format!(
        "uid {} already holds 64 connections to the handoff socket, the limit is \
         limits.max_connections_per_uid = 64: connection closed",
        ids.0
    );
    // More than the 512 connections all uids once shared.
    let mut child = spawn_attacker(ids, &daemon.socket, "hold-handoff", &["600"]);
    let pid = child.id();
    assert_eq!(
        result_of(&mut child).await,
        format!("holding 600 connections; the last was told: ERR {refused}")
    );

    // This uid's load (a PUT) and upload (a GET) while the attacker holds its connections.
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(dir.path(), "m.safetensors", &mixed_model(85));
    let expected = read_model(std::slice::from_ref(&model));
    let mut client = daemon.client().await;
    load(&mut client, std::slice::from_ref(&model), &expected).await;
    let tensors = uniform_model(86, 2, 4096);
    let data: Vec<_> = tensors.iter().map(Tensor::as_upload).collect();
    client.upload_model("meanwhile", &data).await.unwrap();

    let uid = format!("uid={}", ids.0);
    assert!(
        !log_lines_with(&[&refused, &uid]).is_empty(),
        "no warning for uid {}",
        ids.0
    );
    let stalled = format!(
        "handoff: uid {} (pid {pid}) sent no complete request within 5s of connecting: \
         connection closed",
        ids.0
    );
    eventually("the idle connections are cut and logged", || {
        let found = !log_lines_with(&[&stalled]).is_empty();
        async move { found }
    })
    .await;
    drop(child.stdin.take());
    let status = tokio::task::spawn_blocking(move || child.wait()).await;
    assert!(status.unwrap().unwrap().success());
}

// ---------------------------------------------------------------------------------------------
// (c) uploads sealed by the daemon

/// After BeginUpload the uploader cannot resize its region (EPERM: no SIGBUS for the daemon);
/// a commit while it still maps the region writable is refused with what to do, and leaves the
/// upload as it was; once committed, its fd writes no more (the region is the model's arena)
/// and its secret is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_is_sealed_by_the_daemon() {
    let daemon = start_daemon().await;
    let tensors = uniform_model(76, 1, 4096);
    let mut raw = raw_client(&daemon.socket).await;
    let begun = raw
        .begin_upload(upload_request("sealed", &tensors))
        .await
        .unwrap()
        .into_inner();
    let (fd, size) = fetch_fd(&daemon.socket, &begun.fd_secret).await.unwrap();
    let file = std::fs::File::from(fd);
    for len in [0, 100, size + 4096] {
        let refused = file.set_len(len).unwrap_err();
        assert_eq!(refused.raw_os_error(), Some(1), "set_len({len}): {refused}");
    }
    assert_eq!(file.metadata().unwrap().len(), size);
    let mapped = memmap2::MmapOptions::new()
        .len(size as usize)
        .map_raw(&file)
        .unwrap();
    // SAFETY: the mapping is ours and `size` long; nothing else writes it meanwhile.
    unsafe { std::ptr::copy_nonoverlapping(tensors[0].bytes.as_ptr(), mapped.as_mut_ptr(), 4096) };
    let commit = || proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: begun.upload_id.clone(),
        ..Default::default()
    };
    let status = raw.commit_upload(commit()).await.unwrap_err();
    let mapped_writable = format!(
        "upload_id '{}': the upload region is still mapped writable by the client: unmap it \
         before CommitUpload",
        begun.upload_id
    );
    assert_eq!(
        (status.code(), status.message()),
        (Code::FailedPrecondition, mapped_writable.as_str())
    );
    assert_eq!(daemon.uploads(), 1, "the refused upload stays");
    drop(mapped);
    let committed = raw.commit_upload(commit()).await.unwrap().into_inner();
    let manifest = committed.manifest.unwrap();
    let refused = file.write_at(b"tamper", 0).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(1), "EPERM: {refused}");
    assert!(fetch_fd(&daemon.socket, &begun.fd_secret).await.is_err());
    let expected = tensors
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    let mut client = daemon.client().await;
    let session = client
        .open_session(options(
            &manifest.model_id,
            per_tensor_groups(&manifest),
            0,
            1 << 20,
        ))
        .await
        .unwrap();
    run_step(&session, &[0], &expected).await;
}

/// A client never goes through a socket directory another user made: with no --socket, no
/// XDG_RUNTIME_DIR and no system socket it falls back to `/tmp/weightstream-<uid>`, and refuses
/// it when another user owns it (here root made it and serves a daemon there, as a squatter
/// would), naming the directory, its owner and what to do, before it connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_refuses_a_socket_directory_another_user_made() {
    let Some(ids) = attacker() else { return };
    if std::path::Path::new(weightstream_client::socket::SYSTEM_SOCKET).exists() {
        eprintln!("skipped: a system socket exists, so clients do not fall back");
        return;
    }
    let dir = weightstream_client::socket::fallback_dir(ids.0);
    /// Removes the squatted directory however the test ends.
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    std::fs::create_dir(&dir).unwrap();
    let _gone = Gone(dir.clone());
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = dir.join(weightstream_client::socket::SOCKET_NAME);
    let _daemon = start_daemon_with(|c| {
        c.socket = Some(socket.clone());
        c.socket_group = Some(ids.1.to_string());
    })
    .await;
    let got = attack(ids, &socket, "list-implicit", &[]).await;
    assert_eq!(
        got,
        format!(
            "failed: cannot reach the weightstream daemon at {}: refusing the socket directory \
             {}: owned by \
             uid 0, not by this user (uid {}); a daemon of this user makes it mode 0700: \
             remove it (another user's daemon may be serving there), or pass --socket (or set \
             WEIGHTSTREAM_SOCKET, XDG_RUNTIME_DIR)",
            socket.display(),
            dir.display(),
            ids.0
        )
    );
}

/// An uploader that closes its region's seals (F_SEAL_SEAL) before the commit has the commit
/// refused as its own doing, FAILED_PRECONDITION naming the seal and what to do (not INTERNAL);
/// it aborts and uploads again. The limit on uploads in progress speaks of one in the singular.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploader_that_closes_the_seals_is_told_so() {
    let daemon = start_daemon_with(|c| c.limits.max_uploads = 1).await;
    let tensors = uniform_model(77, 1, 4096);
    let mut raw = raw_client(&daemon.socket).await;
    let begun = raw
        .begin_upload(upload_request("sealed-shut", &tensors))
        .await
        .unwrap()
        .into_inner();
    let second = raw
        .begin_upload(upload_request("second", &tensors))
        .await
        .unwrap_err();
    assert_eq!(
        (second.code(), second.message()),
        (
            Code::ResourceExhausted,
            "limits.max_uploads = 1 reached: the daemon has 1 upload in progress"
        )
    );
    let (fd, _) = fetch_fd(&daemon.socket, &begun.fd_secret).await.unwrap();
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SEAL).unwrap();
    let commit = proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: begun.upload_id.clone(),
        ..Default::default()
    };
    let status = raw.commit_upload(commit).await.unwrap_err();
    let closed = format!(
        "upload_id '{}': the client closed the upload region's seals (F_SEAL_SEAL), so the \
         daemon cannot seal it against writes: abort the upload and upload again without \
         F_SEAL_SEAL",
        begun.upload_id
    );
    assert_eq!(
        (status.code(), status.message()),
        (Code::FailedPrecondition, closed.as_str())
    );
    raw.abort_upload(proto::AbortUploadRequest {
        upload_id: begun.upload_id.clone(),
    })
    .await
    .unwrap();
    assert_eq!(daemon.uploads(), 0);
}

// ---------------------------------------------------------------------------------------------
// (d) no names

/// Names in /dev/shm that this process could have made (the old daemons' names carried their
/// pid); another engineer's old daemon on the box may make its own meanwhile.
fn dev_shm_names_of_this_process() -> Vec<String> {
    let pid = format!("-{}-", std::process::id());
    let mut names: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&pid))
        .collect();
    names.sort();
    names
}

/// Where /proc says an fd points: a memfd reads "/memfd:NAME (deleted)".
fn fd_link(fd: &impl std::os::fd::AsRawFd) -> String {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    link.display().to_string()
}

/// Shared memory has no name: a load, an upload and a session make nothing in /dev/shm (or
/// anywhere: every region the daemon passes is a memfd with no link). Sockets: 0660 and the
/// configured group, the handoff socket too. Host regions come read-only (not even reopened
/// through /proc can they be written), an upload region read-write for its uploader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_has_no_name_and_reaches_clients_as_fds_only() {
    use std::os::unix::fs::FileExt;
    let group = 4321;
    let before = dev_shm_names_of_this_process();
    let daemon = start_daemon_with(|c| c.socket_group = Some(group.to_string())).await;
    for socket in [&daemon.socket, &daemon.handoff()] {
        let m = std::fs::metadata(socket).unwrap();
        assert_eq!((m.mode() & 0o777, m.gid()), (0o660, group), "{socket:?}");
    }
    let passed = |fd: &std::os::fd::OwnedFd, kind: &str| {
        let stat = std::fs::File::from(fd.try_clone().unwrap())
            .metadata()
            .unwrap();
        assert_eq!(stat.nlink(), 0, "{kind}: linked somewhere");
        assert_eq!(fd_link(fd), format!("/memfd:weightstream-{kind} (deleted)"));
    };

    let mut raw = raw_client(&daemon.socket).await;
    let begun = raw
        .begin_upload(upload_request("u", &uniform_model(77, 1, 4096)))
        .await
        .unwrap()
        .into_inner();
    let (fd, size) = fetch_fd(&daemon.socket, &begun.fd_secret).await.unwrap();
    passed(&fd, "upload");
    assert_eq!(size, 4096);
    std::fs::File::from(fd).write_all_at(b"mine", 0).unwrap();
    raw.commit_upload(proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: begun.upload_id,
        ..Default::default()
    })
    .await
    .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &uniform_model(78, 4, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    // Two groups resident, two streamed through staging.
    let session = client
        .open_session(options(
            &manifest.model_id,
            per_tensor_groups(&manifest),
            2 * LAYER as u64,
            4 * LAYER as u64,
        ))
        .await
        .unwrap();
    run_step(&session, &[0, 1, 2, 3], &expected).await;
    let regions = &session.layout().regions;
    assert_eq!(regions.len(), 3, "staging and a region per resident group");
    for (region, kind) in regions.iter().zip(["staging", "resident", "resident"]) {
        let (fd, _) = fetch_fd(&daemon.socket, fd_secret(region)).await.unwrap();
        passed(&fd, kind);
        let file = std::fs::File::from(fd);
        assert!(file.write_at(b"x", 0).is_err(), "{kind}: written");
        let again = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(&file)
            ))
            .unwrap();
        let refused = again.write_at(b"x", 0).unwrap_err();
        assert_eq!(
            refused.raw_os_error(),
            Some(1),
            "{kind} reopened: {refused}"
        );
    }
    assert_eq!(
        (daemon.shm_count("model"), daemon.shm_count("upload")),
        (1, 1)
    );
    assert_eq!(
        dev_shm_names_of_this_process(),
        before,
        "a name in /dev/shm"
    );
    session.close().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// (e) another uid's fds

/// Another uid cannot fetch a session's staging or resident region, nor an upload region, even
/// with their secrets (which it could only have stolen): the owner can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_uid_gets_no_region_and_no_upload() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &uniform_model(79, 4, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let session = client
        .open_session(options(
            &manifest.model_id,
            per_tensor_groups(&manifest),
            2 * LAYER as u64,
            4 * LAYER as u64,
        ))
        .await
        .unwrap();
    let mut raw = raw_client(&daemon.socket).await;
    let begun = raw
        .begin_upload(upload_request("mine", &uniform_model(80, 1, 4096)))
        .await
        .unwrap()
        .into_inner();
    let regions = &session.layout().regions;
    let secrets = [
        fd_secret(&regions[0]),
        fd_secret(&regions[1]),
        begun.fd_secret.as_str(),
    ];
    let refused = format!(
        "refused: no such fd_secret for uid {}: a secret is only for the uid it was given to, \
         and ends with its upload or session",
        ids.0
    );
    assert_eq!(
        attack(ids, &daemon.socket, "get", &secrets).await,
        [refused.as_str(); 3].join(" | ")
    );
    for secret in secrets {
        assert!(
            fetch_fd(&daemon.socket, secret).await.is_ok(),
            "the owner's"
        );
    }
    run_step(&session, &[0, 1, 2, 3], &expected).await;
}

/// `[access]` lets a peer in through one of its supplementary groups (SO_PEERGROUPS), the way
/// the kernel's check of the socket's group does: on the gRPC socket and the handoff socket. A
/// peer none of whose groups is listed stays out of both, and is told its groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supplementary_group_in_allowed_gids_lets_a_peer_in() {
    let Some(ids) = attacker() else { return };
    // Numbers no group of the box needs to have: the kernel takes gids as they are.
    let (team, other) = (47_411, 47_412);
    let unknown = |uid: u32| {
        format!(
            "refused: no such fd_secret for uid {uid}: a secret is only for the uid it was \
             given to, and ends with its upload or session"
        )
    };
    let secret = "0".repeat(32);

    // The socket's group is the team's, and so is the one listed: ws-attacker is in it only
    // as a supplementary group (its primary gid is its own).
    let daemon = daemon_for(team, |c| c.access.allowed_gids = vec![team]).await;
    let socket = &daemon.socket;
    let (_, got) = attack_in(ids, &[team], socket, "info", &[]).await;
    assert_eq!(got, "served");
    let (_, got) = attack_in(ids, &[team], socket, "get", &[&secret]).await;
    assert_eq!(got, unknown(ids.0), "the handoff socket lets it in too");
    drop(daemon);

    // The socket is open to ws-attacker's primary group; the listed group is not one of its.
    let daemon = daemon_for(ids.1, |c| c.access.allowed_gids = vec![team]).await;
    let socket = &daemon.socket;
    let denied = |pid: u32| {
        format!(
            "uid {} (gid {}, groups [{other}], pid {pid}) may not use this daemon: neither in \
             access.allowed_uids [] nor in access.allowed_gids [{team}]",
            ids.0, ids.1
        )
    };
    let (pid, got) = attack_in(ids, &[other], socket, "info", &[]).await;
    assert_eq!(got, format!("PermissionDenied: {}", denied(pid)));
    let (pid, got) = attack_in(ids, &[other], socket, "get", &[&secret]).await;
    assert_eq!(got, format!("refused: {}", denied(pid)));
}

// ---------------------------------------------------------------------------------------------
// (f) descriptions are charged; lists come in pages

/// Tensors of no bytes are not free: their names and shapes are host memory, charged to the
/// uploader's quota. The daemon's uploads in progress are bounded as a whole, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptions_are_charged_and_uploads_in_progress_are_bounded() {
    let daemon = start_daemon_with(|c| {
        c.quotas.per_uid_host_bytes = 64 << 10;
        c.quotas.per_uid_uploads = 0;
        c.limits.max_uploads = 2;
    })
    .await;
    let uid = rustix::process::getuid().as_raw();
    let names: Vec<String> = (0..100).map(|i| format!("{i:0>1000}")).collect();
    let empty: Vec<proto::TensorInfo> = names
        .iter()
        .map(|name| proto::TensorInfo {
            name: name.clone(),
            dtype: proto::Dtype::F32 as i32,
            shape: vec![0],
            nbytes: 0,
            ..Default::default()
        })
        .collect();
    let mut raw = raw_client(&daemon.socket).await;
    let status = raw
        .begin_upload(proto::BeginUploadRequest {
            name: "nothing".into(),
            tensors: empty,
            client_reserves: false,
        })
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message().to_string()),
        (
            Code::ResourceExhausted,
            format!(
                "quotas.per_uid_host_bytes = 65536 exceeded: uid {uid} holds 0 host bytes and \
                 this upload needs 107207 more"
            )
        )
    );
    assert_eq!((daemon.uploads(), daemon.shm_total()), (0, 0));
    let one = uniform_model(81, 1, 4096);
    for _ in 0..2 {
        raw.begin_upload(upload_request("u", &one)).await.unwrap();
    }
    let status = raw
        .begin_upload(upload_request("u", &one))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (
            Code::ResourceExhausted,
            "limits.max_uploads = 2 reached: the daemon has 2 uploads in progress"
        )
    );
}

/// ListModels and ListSessions come in pages: `page_size` entries (100 by default, at most
/// 1000), then a `next_page_token` that is empty on the last page; a token no list gave is
/// refused: one made up from an id (`m-123`, `s-0`, `s-00001`, a listed model's id), or one
/// the other list gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_come_in_pages() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let mut client = daemon.client().await;
    let mut ids = Vec::new();
    for seed in 0..5 {
        let path = write_model(
            dir.path(),
            &format!("{seed}.safetensors"),
            &mixed_model(seed),
        );
        let expected = read_model(std::slice::from_ref(&path));
        ids.push(load(&mut client, &[path], &expected).await.model_id);
    }
    ids.sort();
    let mut raw = raw_client(&daemon.socket).await;
    let mut pages = Vec::new();
    let mut token = String::new();
    let mut models_token = String::new();
    loop {
        let page = raw
            .list_models(proto::ListModelsRequest {
                page_size: 2,
                page_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let listed: Vec<String> = page.models.into_iter().map(|m| m.model_id).collect();
        pages.push(listed);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
        models_token.clone_from(&token);
    }
    assert_eq!(
        pages,
        vec![ids[..2].to_vec(), ids[2..4].to_vec(), ids[4..].to_vec()]
    );
    let all = client.list_models().await.unwrap();
    assert_eq!(all.models.len(), 5, "the client reads every page");
    assert!(all.next_page_token.is_empty());

    let groups = |m: &str| vec![group("g", &[m])];
    let manifest = model_listed(&mut client, &ids[0]).await.unwrap();
    let first = manifest.tensors[0].name.clone();
    let mut sessions = Vec::new();
    for _ in 0..3 {
        let opts = options(&ids[0], groups(&first), 0, 1 << 20);
        sessions.push(client.open_session(opts).await.unwrap());
    }
    let page = raw
        .list_sessions(proto::ListSessionsRequest {
            page_size: 2,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let listed: Vec<&str> = page
        .sessions
        .iter()
        .map(|s| s.session_id.as_str())
        .collect();
    assert_eq!(listed, [sessions[0].id(), sessions[1].id()]);
    assert!(!page.next_page_token.is_empty());
    let rest = raw
        .list_sessions(proto::ListSessionsRequest {
            page_size: 2,
            page_token: page.next_page_token,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.sessions.len(), 1);
    assert!(rest.next_page_token.is_empty());
    assert_eq!(client.list_sessions().await.unwrap().len(), 3);

    let too_big = raw
        .list_models(proto::ListModelsRequest {
            page_size: 1001,
            page_token: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        (too_big.code(), too_big.message()),
        (Code::InvalidArgument, "page_size: 1001, the limit is 1000")
    );
    let session_token = page_token_of_sessions(&mut raw).await;
    let made_up = ["m-123", &ids[0], "s-0", "s-00001", "0", &session_token];
    for token in made_up {
        let refused = raw
            .list_models(proto::ListModelsRequest {
                page_size: 0,
                page_token: token.to_string(),
            })
            .await
            .unwrap_err();
        // Named by its first 64 characters at most.
        let shown: String = token.chars().take(64).collect();
        let want = format!("page_token: '{shown}' is not a token this list gave");
        assert_eq!(
            (refused.code(), refused.message()),
            (Code::InvalidArgument, &*want)
        );
    }
    let made_up = ["m-123", "s-0", "s-00001", sessions[0].id(), &models_token];
    for token in made_up {
        let refused = raw
            .list_sessions(proto::ListSessionsRequest {
                page_size: 0,
                page_token: token.to_string(),
            })
            .await
            .unwrap_err();
        // Named by its first 64 characters at most.
        let shown: String = token.chars().take(64).collect();
        let want = format!("page_token: '{shown}' is not a token this list gave");
        assert_eq!(
            (refused.code(), refused.message()),
            (Code::InvalidArgument, &*want)
        );
    }
}

/// The first page's token of ListSessions at one session a page.
async fn page_token_of_sessions(
    raw: &mut weightstream_client::proto::weight_stream_client::WeightStreamClient<
        tonic::transport::Channel,
    >,
) -> String {
    let page = raw
        .list_sessions(proto::ListSessionsRequest {
            page_size: 1,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    page.next_page_token
}

/// A BeginUpload declaring 200 000 tensors (3.4 MB; the daemon takes up to 16 MiB) is checked on a blocking thread, not on
/// the async threads that serve every peer: with one async thread, and the one blocking thread
/// held, another connection's GetInfo is answered while the big request waits its turn; then
/// the big one is refused, naming the field.
#[test]
fn a_large_begin_upload_is_checked_off_the_async_threads() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let n = 200_000;
        let daemon = start_daemon_with(|c| c.limits.max_tensors_per_model = n as u32).await;
        let uid = rustix::process::getuid().as_raw();
        let mut big_rpc = raw_client(&daemon.socket).await;
        let mut other = raw_client(&daemon.socket).await;
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let held = tokio::task::spawn_blocking(move || gate.recv());
        let mut tensors: Vec<proto::TensorInfo> = (0..n)
            .map(|i| proto::TensorInfo {
                name: format!("t{i}"),
                dtype: proto::Dtype::U8 as i32,
                shape: vec![1],
                ..Default::default()
            })
            .collect();
        tensors[n - 1].name = "t0".into();
        let request = proto::BeginUploadRequest {
            name: "big".into(),
            tensors,
            client_reserves: false,
        };
        let big = tokio::spawn(async move { big_rpc.begin_upload(request).await });
        let listed = format!("BeginUpload of {n} tensors for uid {uid}");
        eventually("the big request waits for a blocking thread", || {
            let waiting = daemon.blocking_running().contains(&listed);
            async move { waiting }
        })
        .await;
        let info = within("GetInfo", other.get_info(proto::GetInfoRequest {})).await;
        assert_eq!(info.unwrap().into_inner().usage.unwrap().uid, uid);
        assert!(!big.is_finished(), "answered without its blocking thread");
        open.send(()).unwrap();
        held.await.unwrap().unwrap();
        let status = within("the big request", big).await.unwrap().unwrap_err();
        assert_eq!(
            (status.code(), status.message()),
            (
                Code::InvalidArgument,
                "tensors[199999].name: 't0' is declared twice"
            )
        );
        assert!(daemon.blocking_running().is_empty());
    });
}

/// Memory handed out as fds stays charged while the fds live (issue 27's hoard, as another
/// uid): an upload region and a session's staging region, each fetched and kept while its
/// connection is dropped, still count against the uid's host and device quotas, so the second
/// round is refused, naming the held bytes and the process that holds them. The charge ends
/// when the memory is freed, not when that process exits: a child it passed the fds to keeps
/// them charged until it too is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_reachable_through_fds_stays_charged_until_freed() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |c| {
        c.quotas.per_uid_host_bytes = 256 << 10;
        c.quotas.per_uid_device_bytes = 256 << 10;
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &uniform_model(87, 1, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let size = 160 << 10;
    let (pid, got) = attack_in(
        ids,
        &[],
        &daemon.socket,
        "hoard",
        &[&manifest.model_id, &size.to_string()],
    )
    .await;
    let uid = ids.0;
    let held = |kind: &str| {
        format!(
            "quotas.per_uid_{kind}_bytes = 262144 exceeded: uid {uid} holds {size} {kind} \
             bytes and this {item} needs {need} more; {size} of them are shared memory the \
             daemon has let go of and pid {pid} still holds (an fd or a mapping of it, passed \
             on or inherited included): they are freed once those are closed, when the process \
             exits at the latest",
            item = if kind == "host" { "upload" } else { "session" },
            // The region and its description: "w", one dimension, and the name "hoard".
            need = if kind == "host" {
                size + 1 + 8 + 64 + 5
            } else {
                size
            },
        )
    };
    let (said, child) = got.rsplit_once(" | passed to pid ").unwrap();
    assert_eq!(
        said,
        [
            format!("after round 1: host {size}, device {size}"),
            format!("ResourceExhausted: {}", held("host")),
            format!("ResourceExhausted: {}", held("device")),
            format!("after round 2: host {size}, device {size}"),
        ]
        .join(" | ")
    );
    // The attacker has exited; its child holds the fds.
    let charged = || {
        let host = daemon.core.store.host_use(uid).uid_bytes;
        let device = daemon.core.held_device(uid, 0).uid.bytes;
        (host, device)
    };
    assert_eq!(charged(), (size, size));
    let child = rustix::process::Pid::from_raw(child.parse().unwrap()).unwrap();
    rustix::process::kill_process(child, rustix::process::Signal::KILL).unwrap();
    eventually("the memory is freed and its charge ends", || {
        let freed = charged() == (0, 0);
        async move { freed }
    })
    .await;
    assert_eq!(daemon.core.shm.held().count(), 0);
    assert_still_serves(&daemon, 88).await;
}

// ---------------------------------------------------------------------------------------------
// (g) a file rewritten in place

/// A file rewritten in place (same size, same inode) with its mtime set back is a new model
/// with the new bytes: its ctime moved, and the ctime is part of a file's identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_rewritten_with_its_mtime_restored_is_a_new_model() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let before = uniform_model(82, 2, 4096);
    let path = write_model(dir.path(), "m.safetensors", &before);
    let mut client = daemon.client().await;
    let old = load(
        &mut client,
        std::slice::from_ref(&path),
        &read_model(std::slice::from_ref(&path)),
    )
    .await;
    let meta = std::fs::metadata(&path).unwrap();
    let (ino, mtime) = (meta.ino(), meta.modified().unwrap());
    // Past the coarse clock's tick, so that the rewrite's ctime differs.
    std::thread::sleep(Duration::from_millis(20));
    let after = uniform_model(83, 2, 4096);
    let rewritten = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(write_model(rewritten.path(), "m.safetensors", &after)).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&bytes, 0).unwrap();
    file.set_modified(mtime).unwrap();
    drop(file);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(
        (meta.ino(), meta.len(), meta.modified().unwrap()),
        (ino, bytes.len() as u64, mtime)
    );
    let expected = read_model(std::slice::from_ref(&path));
    let new = load(&mut client, std::slice::from_ref(&path), &expected).await;
    assert_ne!(new.model_id, old.model_id);
    assert_eq!(new.refcount, 1);
    acquire_every_group(&mut client, &new, &expected).await;
}

async fn acquire_every_group(
    client: &mut weightstream_client::Client,
    manifest: &proto::ModelManifest,
    expected: &std::collections::BTreeMap<String, Tensor>,
) {
    let groups = per_tensor_groups(manifest);
    let order: Vec<u32> = (0..groups.len() as u32).collect();
    let session = client
        .open_session(options(&manifest.model_id, groups, 0, 1 << 20))
        .await
        .unwrap();
    assert_eq!(
        run_step(&session, &order, expected).await,
        model_bytes(expected)
    );
    session.close().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// (h) a session holds a reference

/// A session on another uid's model takes a reference for its own uid: when the owner
/// releases the model, the model stays for the session and its host charge moves to the
/// session's uid (nobody is billed for a copy they let go); it goes with the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_on_another_uids_model_takes_its_charge_when_the_owner_lets_go() {
    let Some(ids) = attacker() else { return };
    let daemon = daemon_for(ids.1, |_| {}).await;
    let me = rustix::process::getuid().as_raw();
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &uniform_model(84, 4, LAYER));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let store = &daemon.core.store;
    let charge = store.get(&manifest.model_id).unwrap().model.host_bytes();
    let charged = |uid| store.host_use(uid).uid_bytes;
    assert_eq!((charged(me), charged(ids.0)), (charge, 0));

    let mut child = spawn_attacker(ids, &daemon.socket, "session", &[&manifest.model_id]);
    let opened = result_of(&mut child).await;
    assert!(opened.starts_with("session s-"), "{opened}");
    assert_eq!(client.release_model(&manifest.model_id).await.unwrap(), 0);
    let listed = model_listed(&mut client, &manifest.model_id).await.unwrap();
    assert_eq!((listed.refcount, listed.sessions), (0, 1));
    assert_eq!(
        (charged(me), charged(ids.0)),
        (0, charge),
        "the charge moved to the session's uid"
    );
    drop(child.stdin.take());
    let status = tokio::task::spawn_blocking(move || child.wait()).await;
    assert!(status.unwrap().unwrap().success());
    eventually("the model goes with the session", || {
        let mut client = client.clone();
        let id = manifest.model_id.clone();
        async move { model_listed(&mut client, &id).await.is_none() }
    })
    .await;
    assert_eq!((charged(me), charged(ids.0)), (0, 0));
    assert_eq!(daemon.shm_total(), 0);
}
