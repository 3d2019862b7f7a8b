//! The client against a fake daemon in this process: a tonic servicer, and a handoff listener
//! built from `handoff`'s daemon-side primitives that keeps fds as the daemon does. Loads pass the
//! opened files with a token and their display paths, uploads write through the fd and unmap
//! before the commit (the fake seals the memfd against writes there, as the daemon will), host
//! regions are mapped read-only from the fd, lists are read page by page, and paths that do not
//! resolve are refused before anything is sent.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustix::fs::{MemfdFlags, SealFlags};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Code, Request, Response, Status};
use weightstream_client::handoff::{self, Request as Handoff};
use weightstream_client::proto::weight_stream_server::{WeightStream, WeightStreamServer};
use weightstream_client::proto::{self, client_message::Msg, server_message::Msg as Reply};
use weightstream_client::{Client, ClientError, LoadedFrom, SessionOptions, TensorData};

const REGION: &[u8] = b"bytes of a staging region, read-only";

#[derive(Default)]
struct State {
    next: u64,
    /// Token -> the fds a PUT passed.
    drops: HashMap<String, Vec<OwnedFd>>,
    /// Secret -> the memfd a GET passes.
    objects: HashMap<String, Arc<OwnedFd>>,
    /// (display paths, bytes read from the fds) of each load.
    loads: Vec<(Vec<String>, Vec<Vec<u8>>)>,
    /// The tensors each load named.
    selections: Vec<Vec<String>>,
    uploads: HashMap<String, Arc<OwnedFd>>,
    committed: Option<Vec<u8>>,
    /// The upload ids AbortUpload was asked for.
    aborted: Vec<String>,
    /// State regions by id, and those freed.
    state: HashMap<String, Arc<OwnedFd>>,
    freed: Vec<(String, String)>,
    /// ListSessions pages given.
    session_pages: u32,
}

impl State {
    fn mint(&mut self) -> String {
        self.next += 1;
        format!("{:032x}", self.next)
    }
}

type Shared = Arc<Mutex<State>>;

fn memfd(name: &str, bytes: &[u8]) -> OwnedFd {
    let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
    let fd = rustix::fs::memfd_create(name, flags).unwrap();
    rustix::fs::ftruncate(&fd, bytes.len() as u64).unwrap();
    std::fs::File::from(fd.try_clone().unwrap())
        .write_all_at(bytes, 0)
        .unwrap();
    fd
}

/// The daemon's handoff loop, one connection at a time.
fn serve_handoff(listener: std::os::unix::net::UnixListener, state: Shared) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { return };
        let exchange = handoff::Exchange::begin(&stream);
        match exchange.read_request() {
            Ok(Handoff::Put(fds)) => {
                let token = {
                    let mut state = state.lock().unwrap();
                    let token = state.mint();
                    state.drops.insert(token.clone(), fds);
                    token
                };
                exchange.reply_token(&token).unwrap();
            }
            Ok(Handoff::Get(secret)) => {
                let fd = state.lock().unwrap().objects.get(&secret).cloned();
                match fd {
                    Some(fd) => {
                        let size = rustix::fs::fstat(&*fd).unwrap().st_size as u64;
                        exchange.reply_fd(fd.as_fd(), size).unwrap();
                    }
                    None => exchange.reply_error("no such secret").unwrap(),
                }
            }
            Err(e) => exchange.reply_error(&e.to_string()).unwrap(),
        }
    }
}

struct Fake(Shared);

#[tonic::async_trait]
impl WeightStream for Fake {
    async fn get_info(
        &self,
        _: Request<proto::GetInfoRequest>,
    ) -> Result<Response<proto::GetInfoResponse>, Status> {
        Ok(Response::new(proto::GetInfoResponse::default()))
    }

    type LoadModelStream = ReceiverStream<Result<proto::LoadModelEvent, Status>>;

    async fn load_model(
        &self,
        request: Request<proto::LoadModelRequest>,
    ) -> Result<Response<Self::LoadModelStream>, Status> {
        let request = request.into_inner();
        let mut state = self.0.lock().unwrap();
        let fds = (state.drops.remove(&request.fd_token))
            .ok_or_else(|| Status::invalid_argument("fd_token: unknown"))?;
        if fds.len() != request.paths.len() {
            return Err(Status::invalid_argument("fd_token: not one fd per path"));
        }
        let mut contents = Vec::new();
        for fd in fds {
            let mut bytes = Vec::new();
            std::fs::File::from(fd).read_to_end(&mut bytes).unwrap();
            contents.push(bytes);
        }
        state.loads.push((request.paths, contents));
        state.selections.push(request.tensors);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let manifest = proto::ModelManifest {
            model_id: "m-load".into(),
            ..Default::default()
        };
        let event = proto::load_model_event::Event::Manifest(manifest);
        let event = proto::LoadModelEvent { event: Some(event) };
        tx.try_send(Ok(event)).unwrap();
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn begin_upload(
        &self,
        request: Request<proto::BeginUploadRequest>,
    ) -> Result<Response<proto::BeginUploadResponse>, Status> {
        let request = request.into_inner();
        let mut offset = 0;
        let mut slots = Vec::new();
        for t in request.tensors {
            slots.push(proto::UploadTensor {
                name: t.name,
                offset,
                nbytes: t.nbytes,
            });
            offset += t.nbytes;
        }
        // "short": a region a byte shorter than its tensors, which the client cannot fill.
        let size = offset - u64::from(request.name == "short");
        let fd = memfd("ws-test-upload", &vec![0; size as usize]);
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        let fd = Arc::new(fd);
        let mut state = self.0.lock().unwrap();
        let secret = state.mint();
        state.objects.insert(secret.clone(), fd.clone());
        state.uploads.insert("up-1".into(), fd);
        Ok(Response::new(proto::BeginUploadResponse {
            upload_id: "up-1".into(),
            size,
            tensors: slots,
            fd_secret: secret,
        }))
    }

    async fn commit_upload(
        &self,
        request: Request<proto::CommitUploadRequest>,
    ) -> Result<Response<proto::CommitUploadResponse>, Status> {
        let id = request.into_inner().upload_id;
        let mut state = self.0.lock().unwrap();
        let fd = state.uploads.remove(&id).unwrap();
        if rustix::fs::fcntl_add_seals(&*fd, SealFlags::WRITE).is_err() {
            return Err(Status::failed_precondition(format!(
                "upload_id '{id}': the upload region is still mapped writable by the client: \
                 unmap it before CommitUpload"
            )));
        }
        let mut bytes = Vec::new();
        std::fs::File::from(fd.try_clone().unwrap())
            .read_to_end(&mut bytes)
            .unwrap();
        state.committed = Some(bytes);
        Ok(Response::new(proto::CommitUploadResponse {
            manifest: Some(proto::ModelManifest {
                model_id: "m-up".into(),
                ..Default::default()
            }),
            deduplicated: false,
        }))
    }

    async fn abort_upload(
        &self,
        request: Request<proto::AbortUploadRequest>,
    ) -> Result<Response<proto::AbortUploadResponse>, Status> {
        let id = request.into_inner().upload_id;
        let mut state = self.0.lock().unwrap();
        state.aborted.push(id.clone());
        match state.uploads.remove(&id) {
            Some(_) => Ok(Response::new(proto::AbortUploadResponse {})),
            None => Err(Status::not_found(format!("unknown upload_id '{id}'"))),
        }
    }

    async fn release_model(
        &self,
        _: Request<proto::ReleaseModelRequest>,
    ) -> Result<Response<proto::ReleaseModelResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn list_models(
        &self,
        request: Request<proto::ListModelsRequest>,
    ) -> Result<Response<proto::ListModelsResponse>, Status> {
        let start: usize = request.into_inner().page_token.parse().unwrap_or(0);
        let end = (start + 2).min(5);
        let models = (start..end)
            .map(|i| proto::ModelManifest {
                model_id: format!("m-{i}"),
                ..Default::default()
            })
            .collect();
        let next_page_token = if end < 5 {
            end.to_string()
        } else {
            String::new()
        };
        Ok(Response::new(proto::ListModelsResponse {
            models,
            store_bytes: 7,
            next_page_token,
        }))
    }

    async fn open_session(
        &self,
        _: Request<proto::OpenSessionRequest>,
    ) -> Result<Response<proto::OpenSessionResponse>, Status> {
        let n = REGION.len() as u64;
        let mut state = self.0.lock().unwrap();
        let secret = state.mint();
        let fd = Arc::new(memfd("ws-test-region", REGION));
        state.objects.insert(secret.clone(), fd);
        let tensor = proto::TensorPlacement {
            name: "w".into(),
            dtype: proto::Dtype::U8 as i32,
            shape: vec![n],
            offset: 0,
            nbytes: n,
            ..Default::default()
        };
        Ok(Response::new(proto::OpenSessionResponse {
            session_id: "s-1".into(),
            regions: vec![proto::Region {
                index: 0,
                size: n,
                handle: Some(proto::region::Handle::FdSecret(secret)),
            }],
            groups: vec![proto::GroupLayout {
                group: 0,
                name: "w".into(),
                nbytes: n,
                tensors: vec![tensor],
                resident: false,
            }],
            ..Default::default()
        }))
    }

    async fn close_session(
        &self,
        _: Request<proto::CloseSessionRequest>,
    ) -> Result<Response<proto::CloseSessionResponse>, Status> {
        Ok(Response::new(proto::CloseSessionResponse {}))
    }

    /// A hostile list: every page has one session and a fresh token, forever.
    async fn list_sessions(
        &self,
        _: Request<proto::ListSessionsRequest>,
    ) -> Result<Response<proto::ListSessionsResponse>, Status> {
        let token = {
            let mut state = self.0.lock().unwrap();
            state.session_pages += 1;
            state.mint()
        };
        Ok(Response::new(proto::ListSessionsResponse {
            sessions: vec![proto::SessionInfo::default()],
            next_page_token: token,
        }))
    }

    /// A region of `bytes`; a label "lie" answers a size the fd does not have.
    async fn alloc_state_region(
        &self,
        request: Request<proto::AllocStateRegionRequest>,
    ) -> Result<Response<proto::AllocStateRegionResponse>, Status> {
        let request = request.into_inner();
        let fd = Arc::new(memfd("ws-test-state", &vec![0; request.bytes as usize]));
        let mut state = self.0.lock().unwrap();
        let secret = state.mint();
        let region_id = format!("st-{secret}");
        state.objects.insert(secret.clone(), fd.clone());
        state.state.insert(region_id.clone(), fd);
        let lie = if request.label == "lie" { 4096 } else { 0 };
        Ok(Response::new(proto::AllocStateRegionResponse {
            region_id,
            size: request.bytes + lie,
            fd_secret: secret,
        }))
    }

    async fn free_state_region(
        &self,
        request: Request<proto::FreeStateRegionRequest>,
    ) -> Result<Response<proto::FreeStateRegionResponse>, Status> {
        let request = request.into_inner();
        let mut state = self.0.lock().unwrap();
        state.freed.push((request.session_id, request.region_id));
        Ok(Response::new(proto::FreeStateRegionResponse {}))
    }

    type RunStream = ReceiverStream<Result<proto::ServerMessage, Status>>;

    async fn run(
        &self,
        request: Request<tonic::Streaming<proto::ClientMessage>>,
    ) -> Result<Response<Self::RunStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            while let Some(Ok(proto::ClientMessage { msg: Some(msg) })) = inbound.next().await {
                let reply = match msg {
                    Msg::Attach(a) => Reply::Attached(proto::Attached {
                        session_id: a.session_id,
                    }),
                    Msg::Acquire(a) => Reply::Staged(proto::Staged {
                        ticket: a.ticket,
                        ..Default::default()
                    }),
                    _ => continue,
                };
                let reply = proto::ServerMessage { msg: Some(reply) };
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A fake daemon on `<dir>/ws.sock` and its handoff socket; the client connected to it.
async fn start(dir: &Path) -> (Shared, Client) {
    let socket = dir.join("ws.sock");
    let state = Shared::default();
    let listener = std::os::unix::net::UnixListener::bind(handoff::handoff_path(&socket)).unwrap();
    let handoff_state = state.clone();
    std::thread::spawn(move || serve_handoff(listener, handoff_state));
    let incoming = UnixListenerStream::new(tokio::net::UnixListener::bind(&socket).unwrap());
    let service = WeightStreamServer::new(Fake(state.clone()));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming),
    );
    let client = Client::connect(Some(&socket)).await.unwrap();
    (state, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_passes_the_opened_files_and_their_display_paths() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut client) = start(dir.path()).await;
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("b.safetensors"), b"second").unwrap();
    std::fs::write(model.join("a.safetensors"), b"first").unwrap();
    let manifest = client
        .load_model(
            std::slice::from_ref(&model),
            "m",
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await;
    assert_eq!(manifest.unwrap().model_id, "m-load");
    let shown = |f: &str| model.join(f).display().to_string();
    let want = (
        vec![shown("a.safetensors"), shown("b.safetensors")],
        vec![b"first".to_vec(), b"second".to_vec()],
    );
    assert_eq!(state.lock().unwrap().loads, vec![want]);
}

/// A load of some tensors names them in its request, and the client remembers them with the
/// files, so that a restore loads the same selection (the same model id) again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_of_some_tensors_names_them_and_remembers_them() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut client) = start(dir.path()).await;
    let path = dir.path().join("a.safetensors");
    std::fs::write(&path, b"first").unwrap();
    let from = LoadedFrom {
        paths: vec![path],
        quantization: weightstream_client::proto::Quantization::Fp8E4m3Row,
        coding: weightstream_client::proto::Coding::None,
        tensors: vec!["l.weight".into(), "k.weight".into()],
    };
    let manifest = client.load_model_from(&from, "", |_| {}).await.unwrap();
    assert_eq!(manifest.model_id, "m-load");
    assert_eq!(
        state.lock().unwrap().selections,
        vec![vec!["l.weight".to_string(), "k.weight".to_string()]]
    );
    assert_eq!(
        client.loaded_models(),
        HashMap::from([("m-load".to_string(), from)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_that_do_not_resolve_are_refused_before_sending() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut client) = start(dir.path()).await;
    let missing = dir.path().join("nope.safetensors");
    let cases = [
        (
            PathBuf::from("model.safetensors"),
            Code::InvalidArgument,
            "paths: model.safetensors: a relative path (give an absolute one: the model records where its files are)".to_string(),
        ),
        (
            missing.clone(),
            Code::NotFound,
            format!("paths: no such file: {}", missing.display()),
        ),
    ];
    let mut failures = Vec::new();
    for (path, code, message) in cases {
        match client
            .load_model(
                std::slice::from_ref(&path),
                "",
                weightstream_client::proto::Quantization::None,
                |_| {},
            )
            .await
        {
            Err(ClientError::Rejected {
                code: c,
                message: m,
            }) if (c, &m) == (code, &message) => {}
            other => failures.push(format!(
                "{path:?}: want {code:?} {message:?}, got {other:?}"
            )),
        }
    }
    match client
        .load_model(
            &[],
            "",
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await
    {
        Err(e) if e.to_string() == "InvalidArgument: paths: no file given" => {}
        other => failures.push(format!("no paths: got {other:?}")),
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(state.lock().unwrap().drops.is_empty(), "files were put");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_writes_through_the_fd_and_unmaps_before_commit() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut client) = start(dir.path()).await;
    let tensors = [
        TensorData::new("a", proto::Dtype::U8, &[5], b"first"),
        TensorData::new("b", proto::Dtype::U8, &[6], b"second"),
    ];
    let (manifest, _) = client.upload_model("up", &tensors).await.unwrap();
    assert_eq!(manifest.model_id, "m-up");
    let committed = state.lock().unwrap().committed.clone();
    assert_eq!(committed.as_deref(), Some(&b"firstsecond"[..]));
}

/// A write that fails between BeginUpload and CommitUpload aborts the upload and returns the
/// write's error, not the abort's; a commit the daemon refuses aborts too (and an abort the
/// daemon answers NOT_FOUND, the upload being gone with the refusal, hides nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upload_is_aborted_and_its_error_returned() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut client) = start(dir.path()).await;
    let tensors = [
        TensorData::new("a", proto::Dtype::U8, &[5], b"first"),
        TensorData::new("b", proto::Dtype::U8, &[6], b"second"),
    ];
    let err = client.upload_model("short", &tensors).await.unwrap_err();
    assert_eq!(err.to_string(), "protocol: upload slot of 'b' out of range");
    {
        let state = state.lock().unwrap();
        assert_eq!(state.aborted, ["up-1"]);
        assert!(state.uploads.is_empty(), "the abort dropped it");
        assert_eq!(state.committed, None);
    }
    let (manifest, _) = client.upload_model("up", &tensors).await.unwrap();
    assert_eq!(manifest.model_id, "m-up");
    assert_eq!(
        state.lock().unwrap().aborted,
        ["up-1"],
        "a success aborts nothing"
    );
    let err = client.abort_upload("up-1").await.unwrap_err();
    assert_eq!(err.to_string(), "NotFound: unknown upload_id 'up-1'");
}

/// A state region comes with its fd, read-write and of the size the daemon says (a size that
/// disagrees is refused); freeing it names the session and the region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_region_comes_with_its_read_write_fd() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut client) = start(dir.path()).await;
    let (id, size, fd) = client
        .alloc_state_region("s-1", 8192, "adam")
        .await
        .unwrap();
    assert_eq!(size, 8192);
    let file = std::fs::File::from(fd);
    assert_eq!(file.metadata().unwrap().len(), 8192);
    file.write_all_at(b"moments", 4096).unwrap();
    let held = state.lock().unwrap().state[&id].clone();
    let mut read = [0u8; 7];
    std::fs::File::from(held.try_clone().unwrap())
        .read_exact_at(&mut read, 4096)
        .unwrap();
    assert_eq!(&read, b"moments", "the daemon's memory, not a copy");
    let err = client
        .alloc_state_region("s-1", 4096, "lie")
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .ends_with("the daemon passed 4096 bytes for a region of 8192"),
        "{err}"
    );
    client.free_state_region("s-1", &id).await.unwrap();
    assert_eq!(state.lock().unwrap().freed, vec![("s-1".to_string(), id)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_regions_are_mapped_read_only_from_the_fd() {
    let dir = tempfile::tempdir().unwrap();
    let (_state, mut client) = start(dir.path()).await;
    let groups = vec![proto::GroupSpec {
        name: "w".into(),
        tensors: vec!["w".into()],
    }];
    let session = client
        .open_session(SessionOptions::new("m-1", 1 << 20, groups))
        .await
        .unwrap();
    {
        let acquired = session.acquire(0).await.unwrap();
        assert_eq!(acquired.tensor(0), Some(REGION));
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let modes: Vec<&str> = maps
            .lines()
            .filter(|l| l.contains("memfd:ws-test-region"))
            .filter_map(|l| l.split_whitespace().nth(1))
            .collect();
        assert_eq!(modes, ["r--s"], "{maps}");
    }
    session.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_are_read_page_by_page() {
    let dir = tempfile::tempdir().unwrap();
    let (_state, mut client) = start(dir.path()).await;
    let listed = client.list_models().await.unwrap();
    let ids: Vec<&str> = listed.models.iter().map(|m| m.model_id.as_str()).collect();
    assert_eq!(ids, ["m-0", "m-1", "m-2", "m-3", "m-4"]);
    assert_eq!(
        (listed.store_bytes, listed.next_page_token.as_str()),
        (7, "")
    );
}

/// A daemon that gives a fresh page token with every page is followed for
/// `MAX_LIST_PAGES` pages, then the list fails naming the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_pages_are_followed_only_so_far() {
    let dir = tempfile::tempdir().unwrap();
    let (state, mut client) = start(dir.path()).await;
    let listed = tokio::time::timeout(std::time::Duration::from_secs(60), client.list_sessions());
    match listed.await.expect("the list ends") {
        Err(ClientError::Protocol(message)) => assert_eq!(
            message,
            "ListSessions gave a next page after 1000 pages, the most a client reads: the \
             process at this socket does not behave as a weightstream daemon"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        state.lock().unwrap().session_pages,
        weightstream_client::MAX_LIST_PAGES
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_handoff_socket_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let (_state, mut client) = start(dir.path()).await;
    let handoff_socket = handoff::handoff_path(client.socket());
    std::fs::remove_file(&handoff_socket).unwrap();
    let model = dir.path().join("m.safetensors");
    std::fs::write(&model, b"weights").unwrap();
    match client
        .load_model(
            &[model],
            "",
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await
    {
        Err(ClientError::Unavailable { socket, reason }) => {
            assert_eq!(socket, handoff_socket);
            assert!(reason.contains("handoff socket"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitted_tickets_route_out_of_order_and_reopen_goes_on_numbering() {
    let dir = tempfile::tempdir().unwrap();
    let (_state, mut client) = start(dir.path()).await;
    let groups = vec![proto::GroupSpec {
        name: "w".into(),
        tensors: vec!["w".into()],
    }];
    let mut options = SessionOptions::new("m-1", 1 << 20, groups);
    options.map_host_regions = false;
    let mut session = client.open_session(options).await.unwrap();
    // Not mapped here: the region's fd is the caller's to map.
    let fd = session.region_fd(0).expect("a host region");
    let mut bytes = vec![0; REGION.len()];
    std::fs::File::from(fd.try_clone_to_owned().unwrap())
        .read_exact_at(&mut bytes, 0)
        .unwrap();
    assert_eq!(bytes, REGION);
    let submitted: Vec<_> = (0..3).map(|_| session.submit(0).unwrap()).collect();
    assert_eq!(
        submitted.iter().map(|s| s.ticket()).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    for s in submitted.into_iter().rev() {
        let ticket = s.ticket();
        let staged = s.staged().await.unwrap();
        assert_eq!(staged.ticket, ticket);
        assert_eq!(session.check_staged(0, &staged).unwrap(), None);
        session.release(ticket).unwrap();
    }
    session.send_plan(vec![0, 0]);
    session.disconnect();
    match session.submit(0) {
        Err(ClientError::SessionEnded(reason)) => assert!(reason.contains("reconnected")),
        other => panic!("expected SessionEnded, got {:?}", other.map(|s| s.ticket())),
    }
    session.reopen(client.clone(), "m-1").await.unwrap();
    assert!(session.is_stale(3) && !session.is_stale(4));
    session.release(2).unwrap(); // of the old opening: dropped, not sent
    let next = session.submit(0).unwrap();
    assert_eq!((next.ticket(), session.submitted()), (4, 4));
    next.await.unwrap();
    assert_eq!(session.last_plan(), Some(vec![0, 0]));
    assert_eq!(session.ended(), None);
    session.close().await.unwrap();
}
