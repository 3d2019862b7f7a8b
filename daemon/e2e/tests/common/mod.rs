//! Helpers shared by the end-to-end tests: an in-process daemon on a temporary socket, real
//! safetensors files with seeded pseudo-random contents, byte checks of acquired groups against
//! those files, a raw gRPC connection for the messages the Rust client never sends, the
//! handoff socket, and a second uid to attack the daemon from (`attacker`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rand::{RngCore, SeedableRng};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use tempfile::TempDir;
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint, Uri};
use weightstream_client::handoff::{self, HandoffError};
use weightstream_client::proto::client_message::Msg;
use weightstream_client::proto::server_message::Msg as Reply;
use weightstream_client::proto::weight_stream_client::WeightStreamClient;
use weightstream_client::{Acquired, Client, ResolvedSocket, Session, proto};
use weightstream_daemon::config::{BackendChoice, ConfigFile};
use weightstream_daemon::core::Daemon;
use weightstream_daemon::server::{self, ServeError, ServerHandle, StopReport};

/// How long any single wait in a test may take before it counts as a hang.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Awaits `fut`, failing the test if it takes longer than [`DEADLINE`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {DEADLINE:?}"),
    }
}

/// Polls `cond` until it holds, failing the test after [`DEADLINE`]. For effects the daemon
/// applies asynchronously (a vanished connection's teardown), never as a delay.
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    within(what, async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// The daemon

/// A child process killed and reaped when dropped: a test that fails early leaves no daemon
/// running (one left behind holds the test's output open, and the run never ends).
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An in-process daemon (host backend) on its own socket.
pub struct TestDaemon {
    handle: Option<ServerHandle>,
    /// The daemon's state (kept after a stop, to check what it let go).
    pub core: Arc<Daemon>,
    pub socket: PathBuf,
    _socket_tmp: TempDir,
}

pub async fn start_daemon() -> TestDaemon {
    start_daemon_with(|_| {}).await
}

/// Starts a daemon after `adjust` has changed the test configuration (e.g. its limits).
pub async fn start_daemon_with(adjust: impl FnOnce(&mut ConfigFile)) -> TestDaemon {
    let socket_tmp = tempfile::tempdir().expect("socket tempdir");
    let socket = socket_tmp.path().join("ws.sock");
    let mut config = ConfigFile {
        socket: Some(socket.clone()),
        backend: BackendChoice::Host,
        ..Default::default()
    };
    adjust(&mut config);
    let config = config.validate().expect("test config is valid");
    let handle = server::start(config).await.expect("daemon starts");
    TestDaemon {
        core: handle.daemon.clone(),
        handle: Some(handle),
        socket,
        _socket_tmp: socket_tmp,
    }
}

impl TestDaemon {
    /// Where the metrics endpoint listens, when the config enabled it.
    pub fn metrics(&self) -> Option<std::net::SocketAddr> {
        self.handle.as_ref().and_then(|h| h.metrics)
    }

    pub async fn client(&self) -> Client {
        Client::connect(Some(&self.socket))
            .await
            .expect("connect to the test daemon")
    }

    /// How many shared-memory segments (memfds) of one kind the daemon holds: "model" (a
    /// loaded model's arena), "upload" (an upload region, in progress or committed: a
    /// committed upload is its model's arena), "staging", "resident".
    pub fn shm_count(&self, kind: &str) -> usize {
        self.core.shm.live(kind)
    }

    /// Shared-memory segments of every kind.
    pub fn shm_total(&self) -> usize {
        self.core.shm.total()
    }

    /// Uploads begun and not committed.
    pub fn uploads(&self) -> usize {
        self.core.store.upload_count()
    }

    /// The server's blocking tasks (loads, commits, uploads) listed now, oldest first.
    pub fn blocking_running(&self) -> Vec<String> {
        (self.handle.as_ref()).map_or_else(Vec::new, |h| h.blocking.running())
    }

    /// The handoff socket, next to the gRPC socket.
    pub fn handoff(&self) -> PathBuf {
        handoff::handoff_path(&self.socket)
    }

    /// Stops the daemon and waits until it has (bounded by [`DEADLINE`]); says what the stop
    /// had to give up on.
    pub async fn stop(&mut self) -> Result<StopReport, ServeError> {
        let handle = self.handle.take().expect("daemon already stopped");
        within("daemon stop", handle.stop()).await
    }
}

// ---------------------------------------------------------------------------------------------
// The daemons' log

/// Everything the daemons of this test binary log at `info` and above (a global subscriber:
/// the server's tasks run on other threads than the test). Call it before starting the daemon
/// whose lines a test looks for.
pub fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || LogSink(sink.clone()))
            .init();
        buf
    })
    .clone()
}

/// Where [`logs`] collects the lines.
pub struct LogSink(Arc<Mutex<Vec<u8>>>);

impl Write for LogSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The lines logged so far that contain every one of `parts`.
pub fn log_lines_with(parts: &[&str]) -> Vec<String> {
    let text = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
    text.lines()
        .filter(|l| parts.iter().all(|p| l.contains(p)))
        .map(str::to_string)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Models

/// A tensor as written to a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// The shape as the protocol spells it.
    pub dims: Vec<u64>,
    pub bytes: Vec<u8>,
}

impl Tensor {
    pub fn new(name: &str, dtype: Dtype, shape: &[usize], bytes: Vec<u8>) -> Tensor {
        Tensor {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            dims: shape.iter().map(|&d| d as u64).collect(),
            bytes,
        }
    }

    /// The tensor as `Client::upload_model` takes it.
    pub fn as_upload(&self) -> weightstream_client::TensorData<'_> {
        weightstream_client::TensorData::new(
            &self.name,
            pb_dtype(self.dtype),
            &self.dims,
            &self.bytes,
        )
    }
}

/// Tensors with `seed`-determined pseudo-random bytes.
pub fn random_tensors(seed: u64, specs: &[(&str, Dtype, &[usize])]) -> Vec<Tensor> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    specs
        .iter()
        .map(|&(name, dtype, shape)| {
            let elems: usize = shape.iter().product();
            let mut bytes = vec![0u8; elems * dtype.bitsize() / 8];
            rng.fill_bytes(&mut bytes);
            Tensor::new(name, dtype, shape, bytes)
        })
        .collect()
}

/// A model with several dtypes (BF16, F32, F16, I64, U8, F8_E4M3) and ranks (scalar, 1-D, 2-D,
/// 3-D), several of odd byte sizes so that the daemon's alignment padding is exercised, and one
/// empty tensor.
pub fn mixed_model(seed: u64) -> Vec<Tensor> {
    random_tensors(
        seed,
        &[
            ("embed.weight", Dtype::BF16, &[64, 48]),
            ("layers.0.attn.q.weight", Dtype::F32, &[32, 32]),
            ("layers.0.attn.q.bias", Dtype::BF16, &[7]),
            ("layers.0.mlp.experts", Dtype::F16, &[4, 16, 8]),
            ("layers.0.norm.weight", Dtype::F32, &[48]),
            ("layers.0.fp8.weight", Dtype::F8_E4M3, &[16, 33]),
            ("position_ids", Dtype::I64, &[2, 17]),
            ("attention_mask", Dtype::U8, &[3, 5, 7]),
            ("logit_scale", Dtype::F32, &[]),
            ("layers.0.empty", Dtype::F32, &[0, 4]),
            ("lm_head.weight", Dtype::BF16, &[48, 40]),
        ],
    )
}

/// `layers` tensors `layers.{i}.weight` of `bytes_each` bytes (BF16, 2-D).
pub fn uniform_model(seed: u64, layers: usize, bytes_each: usize) -> Vec<Tensor> {
    assert_eq!(bytes_each % 256, 0, "bytes_each is a multiple of 256");
    let names: Vec<String> = (0..layers).map(|i| format!("layers.{i}.weight")).collect();
    let shape = [bytes_each / 256, 128];
    let specs: Vec<(&str, Dtype, &[usize])> = names
        .iter()
        .map(|n| (n.as_str(), Dtype::BF16, &shape[..]))
        .collect();
    random_tensors(seed, &specs)
}

/// Writes `tensors` as `dir/name` with the `safetensors` crate; returns the path.
pub fn write_model(dir: &Path, name: &str, tensors: &[Tensor]) -> PathBuf {
    write_model_with(dir, name, tensors, None)
}

/// As [`write_model`], with the header's `__metadata__`.
pub fn write_model_with(
    dir: &Path,
    name: &str,
    tensors: &[Tensor],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> PathBuf {
    let path = dir.join(name);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let view = TensorView::new(t.dtype, t.shape.clone(), &t.bytes).expect("tensor view");
            (t.name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, metadata, &path).expect("write safetensors file");
    path
}

/// Every tensor of the given safetensors files, read back with the `safetensors` crate.
pub fn read_model(files: &[PathBuf]) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for file in files {
        let buffer = std::fs::read(file).expect("read safetensors file");
        let parsed = safetensors::SafeTensors::deserialize(&buffer).expect("valid safetensors");
        for (name, view) in parsed.tensors() {
            let t = Tensor::new(&name, view.dtype(), view.shape(), view.data().to_vec());
            assert!(out.insert(name, t).is_none(), "tensor twice in {files:?}");
        }
    }
    out
}

/// Bytes of the model's tensors (what `ModelManifest.total_bytes` counts).
pub fn model_bytes(model: &BTreeMap<String, Tensor>) -> u64 {
    model.values().map(|t| t.bytes.len() as u64).sum()
}

pub fn pb_dtype(d: Dtype) -> proto::Dtype {
    use proto::Dtype as P;
    match d {
        Dtype::BOOL => P::Bool,
        Dtype::U8 => P::U8,
        Dtype::I8 => P::I8,
        Dtype::F8_E5M2 => P::F8E5m2,
        Dtype::F8_E4M3 => P::F8E4m3,
        Dtype::I16 => P::I16,
        Dtype::U16 => P::U16,
        Dtype::F16 => P::F16,
        Dtype::BF16 => P::Bf16,
        Dtype::I32 => P::I32,
        Dtype::U32 => P::U32,
        Dtype::F32 => P::F32,
        Dtype::F64 => P::F64,
        Dtype::I64 => P::I64,
        Dtype::U64 => P::U64,
        other => panic!("the daemon has no dtype {other:?}"),
    }
}

/// Loads `paths` and checks that the manifest lists exactly `expected`'s tensors.
pub async fn load(
    client: &mut Client,
    paths: &[PathBuf],
    expected: &BTreeMap<String, Tensor>,
) -> proto::ModelManifest {
    let manifest = client
        .load_model(
            paths,
            "",
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await
        .unwrap_or_else(|e| panic!("load {paths:?}: {e}"));
    check_manifest(&manifest, expected);
    manifest
}

pub fn check_manifest(manifest: &proto::ModelManifest, expected: &BTreeMap<String, Tensor>) {
    let listed: BTreeMap<&str, (i32, &[u64], u64)> = manifest
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), (t.dtype, &t.shape[..], t.nbytes)))
        .collect();
    assert_eq!(listed.len(), manifest.tensors.len(), "names are unique");
    let want: BTreeMap<&str, (i32, &[u64], u64)> = expected
        .values()
        .map(|t| {
            let info = (pb_dtype(t.dtype) as i32, &t.dims[..], t.bytes.len() as u64);
            (t.name.as_str(), info)
        })
        .collect();
    assert_eq!(listed, want, "manifest tensors of {}", manifest.model_id);
    assert_eq!(manifest.total_bytes, model_bytes(expected));
}

// ---------------------------------------------------------------------------------------------
// Sessions

/// One group per tensor, in the manifest's order.
pub fn per_tensor_groups(manifest: &proto::ModelManifest) -> Vec<proto::GroupSpec> {
    weightstream_client::SessionOptions::one_group_per_tensor(manifest)
}

pub fn group(name: &str, tensors: &[&str]) -> proto::GroupSpec {
    proto::GroupSpec {
        name: name.to_string(),
        tensors: tensors.iter().map(|t| t.to_string()).collect(),
    }
}

/// Session options with an explicit staging size and budget.
pub fn options(
    model_id: &str,
    groups: Vec<proto::GroupSpec>,
    staging_bytes: u64,
    vram_budget: u64,
) -> weightstream_client::SessionOptions {
    let mut o = weightstream_client::SessionOptions::new(model_id, vram_budget, groups);
    o.staging_bytes = staging_bytes;
    o
}

/// Asserts that every tensor of an acquired group has the file's dtype, shape and bytes, at an
/// offset the daemon's alignment allows; returns the tensor bytes checked.
pub fn check_acquired(acquired: &Acquired<'_>, expected: &BTreeMap<String, Tensor>) -> u64 {
    let layout = acquired.layout();
    assert!(!layout.tensors.is_empty(), "group {} is empty", layout.name);
    let mut checked = 0;
    for (i, placed) in layout.tensors.iter().enumerate() {
        let want = expected
            .get(&placed.name)
            .unwrap_or_else(|| panic!("group {} has unknown tensor {}", layout.name, placed.name));
        assert_eq!(placed.dtype, pb_dtype(want.dtype) as i32, "{}", placed.name);
        assert_eq!(placed.shape, want.dims, "{}", placed.name);
        assert_eq!(placed.nbytes, want.bytes.len() as u64, "{}", placed.name);
        assert_eq!(placed.offset % 256, 0, "{} is not 256-aligned", placed.name);
        assert!(
            placed.offset + placed.nbytes <= layout.nbytes,
            "{}",
            placed.name
        );
        let got = acquired
            .tensor(i)
            .unwrap_or_else(|| panic!("{}: no bytes (the host backend maps them)", placed.name));
        assert_bytes(&placed.name, got, &want.bytes);
        assert_eq!(acquired.tensor_by_name(&placed.name), Some(got));
        checked += placed.nbytes;
    }
    checked
}

/// Compares bytes, reporting the first difference instead of dumping both buffers.
pub fn assert_bytes(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: bytes differ from the file at byte {i} of {}: got {:#04x}, want {:#04x}",
            want.len(),
            got[i],
            want[i]
        );
    }
}

/// Acquires `order`'s groups one after the other like a training step (each released before
/// the next), checking every byte; returns the tensor bytes acquired.
pub async fn run_step(
    session: &Session,
    order: &[u32],
    expected: &BTreeMap<String, Tensor>,
) -> u64 {
    let mut bytes = 0;
    for &g in order {
        let acquired = within("acquire", session.acquire(g))
            .await
            .unwrap_or_else(|e| panic!("acquire group {g}: {e}"));
        bytes += check_acquired(&acquired, expected);
    }
    bytes
}

pub async fn session_info(client: &mut Client, id: &str) -> Option<proto::SessionInfo> {
    let sessions = client.list_sessions().await.expect("ListSessions");
    sessions.into_iter().find(|s| s.session_id == id)
}

pub async fn stats(client: &mut Client, id: &str) -> proto::SessionStats {
    session_info(client, id)
        .await
        .unwrap_or_else(|| panic!("session {id} is not listed"))
        .stats
        .expect("stats")
}

/// The secret that fetches a host region's fd.
pub fn fd_secret(region: &proto::Region) -> &str {
    match &region.handle {
        Some(proto::region::Handle::FdSecret(s)) => s,
        other => panic!("region {} has no fd secret: {other:?}", region.index),
    }
}

/// The handoff socket of the daemon at `socket`, a socket the test named.
fn named_handoff(socket: &Path) -> ResolvedSocket {
    handoff::handoff_socket(&ResolvedSocket::explicit(socket))
}

/// `GET <secret>` on the handoff socket of `socket`, off the runtime (it blocks).
pub async fn fetch_fd(socket: &Path, secret: &str) -> Result<(OwnedFd, u64), HandoffError> {
    let (handoff, secret) = (named_handoff(socket), secret.to_string());
    tokio::task::spawn_blocking(move || handoff::get_fd(&handoff, &secret))
        .await
        .expect("handoff task")
}

/// `PUT` of `files` on the handoff socket of `socket`; the token.
pub async fn put_files(socket: &Path, files: Vec<std::fs::File>) -> Result<String, HandoffError> {
    let handoff = named_handoff(socket);
    tokio::task::spawn_blocking(move || {
        let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
        handoff::put_fds(&handoff, &fds)
    })
    .await
    .expect("handoff task")
}

/// The bytes of a host region, through a read-only fd of it.
pub async fn region_bytes(socket: &Path, region: &proto::Region) -> Vec<u8> {
    use std::io::Read;
    let (fd, size) = fetch_fd(socket, fd_secret(region))
        .await
        .expect("GET region");
    let mut bytes = Vec::new();
    std::fs::File::from(fd).read_to_end(&mut bytes).unwrap();
    assert_eq!(bytes.len() as u64, size);
    bytes
}

/// Which memfd a host region is (its inode): two sessions' secrets of one shared region give
/// the same.
pub async fn region_inode(socket: &Path, region: &proto::Region) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let (fd, _) = fetch_fd(socket, fd_secret(region))
        .await
        .expect("GET region");
    std::fs::File::from(fd).metadata().unwrap().ino()
}

/// LoadModel through the raw protocol: opens `paths` here, passes them, and names them
/// `names` (the display paths; the daemon never opens them).
pub async fn raw_load(
    rpc: &mut WeightStreamClient<Channel>,
    socket: &Path,
    paths: &[PathBuf],
    names: &[&str],
) -> Result<proto::ModelManifest, tonic::Status> {
    let files = paths
        .iter()
        .map(|p| std::fs::File::open(p).unwrap())
        .collect();
    let fd_token = put_files(socket, files).await.expect("PUT");
    load_with_token(rpc, names, &fd_token).await
}

/// LoadModel with a token (or none) as given; the manifest, or the status it ended with.
pub async fn load_with_token(
    rpc: &mut WeightStreamClient<Channel>,
    names: &[&str],
    fd_token: &str,
) -> Result<proto::ModelManifest, tonic::Status> {
    let request = proto::LoadModelRequest {
        paths: names.iter().map(|n| n.to_string()).collect(),
        name: String::new(),
        fd_token: fd_token.to_string(),
        ..Default::default()
    };
    let mut events = rpc.load_model(request).await?.into_inner();
    while let Some(event) = events.message().await? {
        if let Some(proto::load_model_event::Event::Manifest(m)) = event.event {
            return Ok(m);
        }
    }
    Err(tonic::Status::unknown("LoadModel ended without a manifest"))
}

pub async fn model_listed(client: &mut Client, id: &str) -> Option<proto::ModelManifest> {
    let models = client.list_models().await.expect("ListModels");
    models.models.into_iter().find(|m| m.model_id == id)
}

/// A daemon that has refused bad requests still serves a well-behaved client: a new model
/// loads, and every group of it is acquired with the file's bytes.
pub async fn assert_still_serves(daemon: &TestDaemon, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "healthy.safetensors", &mixed_model(seed));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let groups = per_tensor_groups(&manifest);
    let n = groups.len() as u32;
    let session = client
        .open_session(options(&manifest.model_id, groups, 0, 64 << 10))
        .await
        .expect("open a session after bad input");
    let order: Vec<u32> = (0..n).collect();
    let bytes = run_step(&session, &order, &expected).await;
    assert_eq!(bytes, model_bytes(&expected));
    session.close().await.expect("close");
    assert_eq!(client.release_model(&manifest.model_id).await.unwrap(), 0);
}

// ---------------------------------------------------------------------------------------------
// Raw protocol access

/// The generated client over a fresh connection of its own (one connection: the daemon ties
/// sessions to the connection that opened them).
pub async fn raw_client(socket: &Path) -> WeightStreamClient<Channel> {
    WeightStreamClient::new(raw_channel(socket).await)
}

/// A fresh connection to the socket, for any generated client (health, reflection).
pub async fn raw_channel(socket: &Path) -> Channel {
    let path = socket.to_path_buf();
    Endpoint::from_static("http://weightstream.test")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .expect("raw connection")
}

/// Uploads `tensors` through the raw protocol, keeping the region's fd (read-write, as the
/// uploader got it) as a client that holds on to it would; returns the manifest and that fd.
pub async fn upload_keeping_the_fd(
    socket: &Path,
    tensors: &[Tensor],
) -> (proto::ModelManifest, std::fs::File) {
    use std::os::unix::fs::FileExt;
    let mut raw = raw_client(socket).await;
    let begun = raw
        .begin_upload(upload_request("held", tensors))
        .await
        .unwrap()
        .into_inner();
    let (fd, size) = fetch_fd(socket, &begun.fd_secret)
        .await
        .expect("GET upload");
    assert_eq!(size, begun.size);
    let file = std::fs::File::from(fd);
    for (slot, t) in begun.tensors.iter().zip(tensors) {
        file.write_all_at(t.as_upload().bytes, slot.offset).unwrap();
    }
    let committed = raw
        .commit_upload(proto::CommitUploadRequest {
            retention: proto::Retention::Cached as i32,
            upload_id: begun.upload_id,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    (committed.manifest.unwrap(), file)
}

/// A BeginUpload request declaring `tensors`.
pub fn upload_request(name: &str, tensors: &[Tensor]) -> proto::BeginUploadRequest {
    proto::BeginUploadRequest {
        name: name.into(),
        tensors: tensors
            .iter()
            .map(|t| {
                let d = t.as_upload();
                proto::TensorInfo {
                    name: d.name.to_string(),
                    dtype: d.dtype as i32,
                    shape: d.shape.to_vec(),
                    nbytes: 0,
                    ..Default::default()
                }
            })
            .collect(),
        client_reserves: false,
    }
}

/// A `Run` stream driven message by message.
pub struct RawRun {
    tx: mpsc::UnboundedSender<proto::ClientMessage>,
    rx: tonic::Streaming<proto::ServerMessage>,
}

impl RawRun {
    /// Starts `Run` with `first` as its first message; the daemon's answer to it is either an
    /// error status or an open stream.
    pub async fn start(
        rpc: &mut WeightStreamClient<Channel>,
        first: Msg,
    ) -> Result<RawRun, tonic::Status> {
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(proto::ClientMessage { msg: Some(first) }).unwrap();
        let response = within("Run", rpc.run(UnboundedReceiverStream::new(rx))).await?;
        Ok(RawRun {
            tx,
            rx: response.into_inner(),
        })
    }

    /// Attaches to `session_id` and reads the `Attached` reply.
    pub async fn attach(
        rpc: &mut WeightStreamClient<Channel>,
        session_id: &str,
    ) -> Result<RawRun, tonic::Status> {
        let mut run = RawRun::start(
            rpc,
            Msg::Attach(proto::Attach {
                session_id: session_id.to_string(),
            }),
        )
        .await?;
        match run.next().await {
            Reply::Attached(a) => assert_eq!(a.session_id, session_id),
            other => panic!("expected Attached, got {other:?}"),
        }
        Ok(run)
    }

    pub fn send(&self, msg: Msg) {
        self.tx
            .send(proto::ClientMessage { msg: Some(msg) })
            .expect("Run stream open");
    }

    pub fn acquire(&self, group: u32, ticket: u64) {
        self.send(Msg::Acquire(proto::Acquire {
            group,
            ticket,
            ..Default::default()
        }));
    }

    pub fn release(&self, ticket: u64) {
        self.send(Msg::Release(proto::Release { ticket }));
    }

    /// The next server message (failing the test on a status, an end or a hang).
    pub async fn next(&mut self) -> Reply {
        match within("Run reply", self.rx.message()).await {
            Ok(Some(proto::ServerMessage { msg: Some(m) })) => m,
            other => panic!("expected a server message, got {other:?}"),
        }
    }

    /// The next message, which must be a fault.
    pub async fn fault(&mut self) -> proto::Fault {
        match self.next().await {
            Reply::Fault(f) => f,
            other => panic!("expected a Fault, got {other:?}"),
        }
    }

    /// The next message, which must be `Staged` for `ticket`.
    pub async fn staged(&mut self, ticket: u64) -> proto::Staged {
        match self.next().await {
            Reply::Staged(s) => {
                assert_eq!(s.ticket, ticket, "Staged for another ticket");
                s
            }
            other => panic!("expected Staged for ticket {ticket}, got {other:?}"),
        }
    }
}
