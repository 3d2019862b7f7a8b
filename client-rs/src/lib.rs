//! Rust client of the weightstream daemon.
//!
//! ```no_run
//! # async fn demo() -> Result<(), weightstream_client::ClientError> {
//! use weightstream_client::{Client, SessionOptions};
//! let mut client = Client::connect(None).await?;
//! let none = weightstream_client::proto::Quantization::None;
//! let model = client.load_model(&["/models/flux.safetensors".into()], "flux", none, |_| {}).await?;
//! let groups = SessionOptions::one_group_per_tensor(&model);
//! let session = client
//!     .open_session(SessionOptions::new(&model.model_id, 8 << 30, groups))
//!     .await?;
//! for step in 0..10 {
//!     for g in 0..session.group_count() {
//!         let acquired = session.acquire(g).await?;
//!         let _weights: Option<&[u8]> = acquired.tensor(0); // None in device memory
//!     } // each view's drop releases its ticket
//!     session.end_step(); // the first step's acquisitions become the plan
//! }
//! session.close().await?;
//! # Ok(()) }
//! ```
//!
//! A daemon that stops or dies fails the session's next acquire at once
//! ([`ClientError::SessionEnded`] or [`ClientError::Unavailable`]); [`Session::reconnect`] then
//! opens it again against the daemon that comes back on the same socket, so that a trainer
//! resumes at its next step without restarting.

mod error;
mod replies;
mod session;
mod sources;
pub mod waits;

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

pub use crate::error::ClientError;
pub use crate::handoff::HandoffError;
use crate::proto::weight_stream_client::WeightStreamClient;
pub use crate::replies::{Acquired, Granting, QuantizedView, Submitted};
pub use crate::session::{Session, SessionOptions};
pub use crate::socket::{ResolvedSocket, SOCKET_ENV, SYSTEM_SOCKET, SocketCandidates};
pub use crate::sources::{SourceError, resolve_sources};
pub use crate::waits::WaitTotals;
/// The gRPC status code of a [`ClientError::Rejected`].
pub use tonic::Code;

/// The wire, from the crate both the daemon and its clients build on (`weightstream-proto`):
/// the generated gRPC code, the handoff socket's framing and where the socket is.
pub use weightstream_proto::{handoff, socket, v1 as proto};

/// A tensor to upload: its name, dtype, shape and bytes, and whether it is quantized.
///
/// `quantization` FP8_E4M3_BLOCK64 (or FP8_E4M3_ROW, INT8_ROW) with a float dtype: the daemon
/// quantizes `bytes` at commit; with the format's data dtype ([`proto::Dtype::F8E4m3`], I8 for
/// INT8_ROW): `bytes` are already data, padding and scales (the store's layout, see
/// [`fp8_layout`] and [`row_layout`]) and `scale_shape` says the scales' shape. TORCHAO_FLOAT8_ROWWISE
/// (F8E4m3) and TORCHAO_INT8_ROWWISE (I8): `bytes` are a torchao weight's data, padding and
/// fp32 scales laid out the same way, `scale_shape` [out, 1].
///
/// `format` (empty: none) names the packed format a raw tensor is part of, and `weights` the
/// weights it stands for ([`TensorData::labelled`]).
pub struct TensorData<'a> {
    pub name: &'a str,
    pub dtype: proto::Dtype,
    pub shape: &'a [u64],
    pub bytes: &'a [u8],
    pub quantization: proto::Quantization,
    pub scale_shape: &'a [u64],
    pub format: &'a str,
    pub weights: u64,
}

impl<'a> TensorData<'a> {
    /// A tensor held as it is.
    pub fn new(name: &'a str, dtype: proto::Dtype, shape: &'a [u64], bytes: &'a [u8]) -> Self {
        TensorData {
            name,
            dtype,
            shape,
            bytes,
            quantization: proto::Quantization::None,
            scale_shape: &[],
            format: "",
            weights: 0,
        }
    }

    /// The same tensor, labelled as part of the packed format `format` ("aitk.uint4": a
    /// layer its quantizer packed into raw tensors), standing for `weights` weights (a layer's
    /// out x in on one of its tensors, 0 on the others). The daemon shows each format's bytes
    /// per weight in `ModelManifest.formats`; labels are not part of the model's id.
    pub fn labelled(self, format: &'a str, weights: u64) -> Self {
        TensorData {
            format,
            weights,
            ..self
        }
    }

    /// The same tensor, quantized by the daemon at commit (fp8_e4m3_block64).
    pub fn quantized_at_commit(self) -> Self {
        self.quantized_at_commit_as(proto::Quantization::Fp8E4m3Block64)
    }

    /// The same tensor, quantized by the daemon at commit into `format` (fp8_e4m3_block64,
    /// fp8_e4m3_row or int8_row).
    pub fn quantized_at_commit_as(self, format: proto::Quantization) -> Self {
        TensorData {
            quantization: format,
            ..self
        }
    }

    /// How [`Client::begin_upload`] declares it.
    pub fn info(&self) -> proto::TensorInfo {
        proto::TensorInfo {
            name: self.name.to_string(),
            dtype: self.dtype as i32,
            shape: self.shape.to_vec(),
            nbytes: self.bytes.len() as u64,
            quantization: self.quantization as i32,
            scale_shape: self.scale_shape.to_vec(),
            scale_offset: 0,
            format: self.format.to_string(),
            weights: self.weights,
            coding: 0,
            stored_nbytes: 0,
            coded_lanes: 0,
        }
    }
}

/// The spellings [`parse_quantization`] accepts, for messages and help texts.
pub const QUANTIZATIONS: &str = "none, fp8_e4m3_block64, fp8 (its alias), fp8_e4m3_row, int8_row";

/// Parses a quantization as the CLI and the Python client spell it: "none",
/// "fp8_e4m3_block64", "fp8" (an alias of it), "fp8_e4m3_row" or "int8_row".
pub fn parse_quantization(value: &str) -> Option<proto::Quantization> {
    match value {
        "none" => Some(proto::Quantization::None),
        "fp8" | "fp8_e4m3_block64" => Some(proto::Quantization::Fp8E4m3Block64),
        "fp8_e4m3_row" => Some(proto::Quantization::Fp8E4m3Row),
        "int8_row" => Some(proto::Quantization::Int8Row),
        _ => None,
    }
}

/// The spellings [`parse_coding`] accepts, for messages and help texts.
pub const CODINGS: &str = "none, rans8";

/// A coding by name ("none", "rans8": `proto::Coding`).
pub fn parse_coding(value: &str) -> Option<proto::Coding> {
    match value {
        "none" => Some(proto::Coding::None),
        "rans8" => Some(proto::Coding::Rans8),
        _ => None,
    }
}

/// The formats a client may write pre-quantized into an upload, by the names
/// [`quantization_name`] gives them: "fp8_e4m3_block64", "fp8_e4m3_row", "int8_row",
/// "torchao_float8_rowwise", "torchao_int8_rowwise".
pub fn prequantized_format(name: &str) -> Option<proto::Quantization> {
    match name {
        "fp8_e4m3_block64" => Some(proto::Quantization::Fp8E4m3Block64),
        "fp8_e4m3_row" => Some(proto::Quantization::Fp8E4m3Row),
        "int8_row" => Some(proto::Quantization::Int8Row),
        "torchao_float8_rowwise" => Some(proto::Quantization::TorchaoFloat8Rowwise),
        "torchao_int8_rowwise" => Some(proto::Quantization::TorchaoInt8Rowwise),
        _ => None,
    }
}

/// The lowercase name of a coding ("none", "rans8"); values this client does not know as
/// "unknown(N)".
pub fn coding_name(value: i32) -> String {
    match proto::Coding::try_from(value) {
        Ok(proto::Coding::None) => "none".into(),
        Ok(proto::Coding::Rans8) => "rans8".into(),
        Err(_) => format!("unknown({value})"),
    }
}

/// The lowercase name of a quantization ("none", "fp8_e4m3_block64"); values this client does
/// not know as "unknown(N)".
pub fn quantization_name(value: i32) -> String {
    match proto::Quantization::try_from(value) {
        Ok(proto::Quantization::None) => "none".into(),
        Ok(proto::Quantization::Fp8E4m3Block64) => "fp8_e4m3_block64".into(),
        Ok(proto::Quantization::Fp8E4m3Row) => "fp8_e4m3_row".into(),
        Ok(proto::Quantization::Int8Row) => "int8_row".into(),
        Ok(proto::Quantization::Fp8ScaledMusubi) => "fp8_scaled_musubi".into(),
        Ok(proto::Quantization::Fp8ScaledComfy) => "fp8_scaled_comfy".into(),
        Ok(proto::Quantization::TorchaoFloat8Rowwise) => "torchao_float8_rowwise".into(),
        Ok(proto::Quantization::TorchaoInt8Rowwise) => "torchao_int8_rowwise".into(),
        Err(_) => format!("unknown({value})"),
    }
}

/// The store's layout of an fp8_e4m3_block64 weight of `shape` (rank >= 2): (scale_shape,
/// scale_offset, nbytes): data (one byte per element), zero padding to 16, fp32 scales.
pub fn fp8_layout(shape: &[u64]) -> Option<([u64; 2], u64, u64)> {
    let (&rows, rest) = shape.split_first()?;
    if rest.is_empty() {
        return None;
    }
    let cols = rest.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    let blocks = if cols.is_multiple_of(64) {
        cols / 64
    } else {
        1
    };
    let data = rows.checked_mul(cols)?;
    let scale_offset = data.div_ceil(16).checked_mul(16)?;
    let nbytes = scale_offset.checked_add(rows.checked_mul(blocks)?.checked_mul(4)?)?;
    Some(([rows, blocks], scale_offset, nbytes))
}

/// The store's layout of a weight of `shape` (rank >= 2) in a row format (fp8_e4m3_row,
/// int8_row): (scale_shape [rows, 1], scale_offset, nbytes), laid out as [`fp8_layout`] says.
pub fn row_layout(shape: &[u64]) -> Option<([u64; 2], u64, u64)> {
    let (&rows, rest) = shape.split_first()?;
    if rest.is_empty() {
        return None;
    }
    let cols = rest.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    let blocks = u64::from(cols != 0);
    let data = rows.checked_mul(cols)?;
    let scale_offset = data.div_ceil(16).checked_mul(16)?;
    let nbytes = scale_offset.checked_add(rows.checked_mul(blocks)?.checked_mul(4)?)?;
    Some(([rows, blocks], scale_offset, nbytes))
}

/// What a load of files reads: the files, the format, and which of their tensors (empty:
/// every one). What [`Client::load_model_from`] loads, and [`Client::restore_model`] loads
/// again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedFrom {
    pub paths: Vec<PathBuf>,
    pub quantization: proto::Quantization,
    /// `LoadModelRequest.coding`.
    pub coding: proto::Coding,
    /// Names in the files (`LoadModelRequest.tensors`); their order does not matter.
    pub tensors: Vec<String>,
}

/// How often [`Client::reconnect`] dials again while the daemon is not back.
const RECONNECT_INTERVAL: Duration = Duration::from_millis(50);

/// A connection to the daemon.
#[derive(Clone)]
pub struct Client {
    rpc: WeightStreamClient<Channel>,
    socket: ResolvedSocket,
    /// The paths each model this client (or a clone) loaded was named by, so that a session
    /// can open and load them again into a restarted daemon (same files, same model id).
    loaded: Arc<Mutex<HashMap<String, LoadedFrom>>>,
    /// How long the model references this client takes (LoadModel, CommitUpload) last.
    retention: proto::Retention,
    /// How the daemon holds the models this client loads and commits (`Coding`).
    coding: proto::Coding,
}

impl Client {
    /// The socket to use: `explicit`, else `$WEIGHTSTREAM_SOCKET`, else the system socket if
    /// it exists, else the user's (see [`socket`]).
    pub fn socket_path(explicit: Option<&Path>) -> PathBuf {
        ResolvedSocket::from_env(explicit).path
    }

    /// Connects now, so that a missing daemon is an error here rather than a hang later.
    /// `socket`: as [`Client::socket_path`] says.
    pub async fn connect(socket: Option<&Path>) -> Result<Client, ClientError> {
        Client::connect_to(ResolvedSocket::from_env(socket)).await
    }

    /// [`Client::connect`] to a socket already resolved.
    pub async fn connect_to(socket: ResolvedSocket) -> Result<Client, ClientError> {
        let channel = Client::endpoint()
            .connect_with_connector(Client::dialer(&socket))
            .await
            .map_err(|e| error::unreachable(&socket, &e))?;
        Ok(Client::with_channel(channel, socket))
    }

    /// A client that connects on its first call (a missing daemon is an error there, at once)
    /// and again after the connection is lost. Must be called within a tokio runtime.
    pub fn connect_lazy(socket: Option<&Path>) -> Client {
        Client::connect_lazy_to(ResolvedSocket::from_env(socket))
    }

    /// [`Client::connect_lazy`] to a socket already resolved.
    pub fn connect_lazy_to(socket: ResolvedSocket) -> Client {
        let channel = Client::endpoint().connect_with_connector_lazy(Client::dialer(&socket));
        Client::with_channel(channel, socket)
    }

    fn endpoint() -> Endpoint {
        // The URI is a placeholder: the connector dials the socket.
        Endpoint::from_static("http://weightstream.local").connect_timeout(Duration::from_secs(5))
    }

    /// Connects as [`ResolvedSocket::connect_checked`] says: never through another user's
    /// socket directory, never to another user's daemon.
    fn dialer(
        socket: &ResolvedSocket,
    ) -> impl tower::Service<
        Uri,
        Response = hyper_util::rt::TokioIo<UnixStream>,
        Error = std::io::Error,
        Future = impl Send,
    > + Clone
    + Send
    + 'static {
        let socket = socket.clone();
        tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = socket.connect_checked().await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        })
    }

    fn with_channel(channel: Channel, socket: ResolvedSocket) -> Client {
        Client {
            rpc: WeightStreamClient::new(channel)
                .max_decoding_message_size(1 << 30)
                .max_encoding_message_size(1 << 30),
            socket,
            loaded: Arc::default(),
            retention: proto::Retention::Cached,
            coding: proto::Coding::None,
        }
    }

    /// This client, taking model references (LoadModel, CommitUpload) that last as
    /// `retention` says: `Cached` (the default: kept after this connection closes, as a cache
    /// entry the daemon may evict when it needs the memory), `Connection` (given back when
    /// this connection closes: this process's exit), `Pinned` (kept until released). Clones
    /// share the connection.
    pub fn with_retention(mut self, retention: proto::Retention) -> Client {
        self.retention = retention;
        self
    }

    /// This client, asking the daemon to hold the models it loads ([`Client::load_model`]) and
    /// commits ([`Client::commit_upload`]) coded as `coding` says: `Rans8` codes the 8-bit
    /// tensors losslessly (fewer bytes over the link; the staged bytes of a coded tensor are
    /// then its coded form, `TensorPlacement.coding`, which the caller decodes), `None` (the
    /// default) holds them as they are.
    pub fn with_coding(mut self, coding: proto::Coding) -> Client {
        self.coding = coding;
        self
    }

    /// Dials the socket again until a daemon answers `GetInfo` there (a restarted one), or
    /// `timeout` passes: then the last error ([`ClientError::Unavailable`] while nothing
    /// listens). Sessions keep the connection they were opened on; [`Session::reconnect`]
    /// moves one over.
    pub async fn reconnect(&mut self, timeout: Duration) -> Result<(), ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            let attempt = async {
                let mut fresh = Client::connect_to(self.socket.clone()).await?;
                fresh.info().await?;
                Ok::<_, ClientError>(fresh.rpc)
            };
            let error = match tokio::time::timeout_at(deadline.into(), attempt).await {
                Ok(Ok(rpc)) => {
                    self.rpc = rpc;
                    return Ok(());
                }
                Ok(Err(e)) => e,
                Err(_) => ClientError::Unavailable {
                    socket: self.socket.path.clone(),
                    reason: format!("no answer within {timeout:?}"),
                },
            };
            if Instant::now() + RECONNECT_INTERVAL >= deadline {
                return Err(match error {
                    ClientError::Unavailable { socket, reason } => ClientError::Unavailable {
                        socket,
                        reason: format!("no daemon answered within {timeout:?}: {reason}"),
                    },
                    other => other,
                });
            }
            tokio::time::sleep(RECONNECT_INTERVAL).await;
        }
    }

    /// The files this client loaded `model_id` from, if it did.
    pub(crate) fn loaded_from(&self, model_id: &str) -> Option<LoadedFrom> {
        let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        loaded.get(model_id).cloned()
    }

    pub fn socket(&self) -> &Path {
        &self.socket.path
    }

    pub(crate) fn rpc(&self) -> WeightStreamClient<Channel> {
        self.rpc.clone()
    }

    /// Runs `f` with the path of the daemon's handoff socket on a blocking thread (a handoff
    /// waits on the socket for up to its timeout). A socket that cannot be reached, or an
    /// exchange cut short, is [`ClientError::Unavailable`], as for the gRPC socket.
    pub(crate) async fn handoff<T: Send + 'static>(
        &self,
        f: impl FnOnce(&ResolvedSocket) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, ClientError> {
        let handoff = handoff::handoff_socket(&self.socket);
        let socket = handoff.path.clone();
        let result = tokio::task::spawn_blocking(move || f(&handoff))
            .await
            .map_err(|e| ClientError::Protocol(format!("the handoff task failed: {e}")))?;
        result.map_err(|e| match e {
            ClientError::Handoff(HandoffError::Connect { source, .. }) => {
                ClientError::Unavailable {
                    socket,
                    reason: format!(
                        "{source} (the daemon's handoff socket, next to its gRPC socket: a \
                         daemon as new as this client listens there)"
                    ),
                }
            }
            ClientError::Handoff(HandoffError::Io(source)) => ClientError::Unavailable {
                socket,
                reason: format!("the handoff was cut short: {source}"),
            },
            other => other,
        })
    }

    /// Fetches the fd of a region or upload that the daemon named by `secret` (an `fd_secret`)
    /// from its handoff socket: the fd and the region's size.
    pub async fn fetch_fd(&self, secret: &str) -> Result<(std::os::fd::OwnedFd, u64), ClientError> {
        let secret = secret.to_string();
        self.handoff(move |socket| Ok(handoff::get_fd(socket, &secret)?))
            .await
    }

    /// The error of a call that ended with `status`.
    pub(crate) fn status(&self, status: tonic::Status) -> ClientError {
        ClientError::from_status(&self.socket, status)
    }

    pub async fn info(&mut self) -> Result<proto::GetInfoResponse, ClientError> {
        let r = self.rpc.get_info(proto::GetInfoRequest {}).await;
        Ok(r.map_err(|s| self.status(s))?.into_inner())
    }

    /// Loads safetensors: absolute paths of files, `*.safetensors.index.json` files (their
    /// shards) or directories (their `*.safetensors`). This client opens the files, with its
    /// own rights, and passes them to the daemon (at most 253 files per load); `progress` sees
    /// each update (bytes of the files). With `quantization` FP8_E4M3_BLOCK64 the daemon
    /// quantizes the weights (".weight", rank >= 2, float) as it loads and keeps only that copy.
    pub async fn load_model(
        &mut self,
        paths: &[PathBuf],
        name: &str,
        quantization: proto::Quantization,
        progress: impl FnMut(&proto::LoadProgress),
    ) -> Result<proto::ModelManifest, ClientError> {
        let from = LoadedFrom {
            paths: paths.to_vec(),
            quantization,
            coding: self.coding,
            tensors: Vec::new(),
        };
        self.load_model_from(&from, name, progress).await
    }

    /// [`Client::load_model`] of `from.tensors` only (empty: every tensor): the daemon reads,
    /// holds and charges those alone, and refuses a name none of the files holds. The same
    /// files and names (in any order) give the same model id; other names another.
    pub async fn load_model_from(
        &mut self,
        from: &LoadedFrom,
        name: &str,
        mut progress: impl FnMut(&proto::LoadProgress),
    ) -> Result<proto::ModelManifest, ClientError> {
        let named = from.paths.clone();
        let (files, fd_token) = self
            .handoff(move |socket| {
                let opened = sources::open_sources(&named)?;
                let fds: Vec<BorrowedFd<'_>> = opened.iter().map(|f| f.fd.as_fd()).collect();
                let token = handoff::put_fds(socket, &fds)?;
                Ok((
                    opened.into_iter().map(|f| f.path).collect::<Vec<_>>(),
                    token,
                ))
            })
            .await?;
        let request = proto::LoadModelRequest {
            paths: files.iter().map(|p| p.display().to_string()).collect(),
            name: name.to_string(),
            fd_token,
            quantization: from.quantization as i32,
            retention: self.retention as i32,
            tensors: from.tensors.clone(),
            coding: from.coding as i32,
        };
        let mut events = self
            .rpc
            .load_model(request)
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        while let Some(event) = events.message().await.map_err(|s| self.status(s))? {
            match event.event {
                Some(proto::load_model_event::Event::Progress(p)) => progress(&p),
                Some(proto::load_model_event::Event::Manifest(m)) => {
                    let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
                    loaded.insert(m.model_id.clone(), from.clone());
                    return Ok(m);
                }
                None => {}
            }
        }
        Err(ClientError::Protocol(
            "LoadModel ended without a manifest".into(),
        ))
    }

    /// Uploads tensors through a shared-memory region (its fd comes from the handoff socket;
    /// the mapping is gone before the commit); returns the manifest and whether an identical
    /// model was already in the store.
    pub async fn upload_model(
        &mut self,
        name: &str,
        tensors: &[TensorData<'_>],
    ) -> Result<(proto::ModelManifest, bool), ClientError> {
        let infos = tensors.iter().map(TensorData::info).collect();
        let begun = self.begin_upload(name, infos, false).await?;
        let done = match self.write_upload(&begun, tensors).await {
            Ok(()) => self.commit_upload(&begun.upload_id).await,
            Err(e) => Err(e),
        };
        if done.is_err() {
            self.abort_after_failure(&begun.upload_id).await;
        }
        done
    }

    /// The first step of [`Client::upload_model`]: declares the tensors (name, dtype, shape;
    /// `nbytes` 0 or exact; `quantization` and `scale_shape` as in [`TensorData`]) and gets
    /// the region to write them into. An upload that is not to be committed is dropped with
    /// [`Client::abort_upload`]; the daemon drops one never committed nor aborted when this
    /// client's connection goes. With `client_reserves` the daemon answers at once and the
    /// writer faults the region's pages in itself (`MADV_POPULATE_WRITE` or page-locking
    /// before it writes each part; a plain write into a full tmpfs is a SIGBUS); without it the
    /// daemon reserves every page first.
    pub async fn begin_upload(
        &mut self,
        name: &str,
        tensors: Vec<proto::TensorInfo>,
        client_reserves: bool,
    ) -> Result<proto::BeginUploadResponse, ClientError> {
        let request = proto::BeginUploadRequest {
            name: name.to_string(),
            tensors,
            client_reserves,
        };
        let r = self.rpc.begin_upload(request).await;
        Ok(r.map_err(|s| self.status(s))?.into_inner())
    }

    /// The second step of [`Client::upload_model`]: fetches the region of upload `begun` from
    /// the handoff socket, writes `tensors` (in the order declared) at their offsets, and
    /// unmaps it.
    pub async fn write_upload(
        &mut self,
        begun: &proto::BeginUploadResponse,
        tensors: &[TensorData<'_>],
    ) -> Result<(), ClientError> {
        let secret = begun.fd_secret.clone();
        let (region, _) = self
            .handoff(move |socket| Ok(handoff::get_fd(socket, &secret)?))
            .await?;
        session::write_upload(region, begun, tensors)
    }

    /// Drops upload `upload_id`, begun by this client and not to be committed (writing it
    /// failed): the daemon gives its host bytes back at once rather than when this client's
    /// connection goes; what this process still maps of it stays charged to its uid until
    /// unmapped and closed. An upload already dropped, aborted or committed is NOT_FOUND.
    pub async fn abort_upload(&mut self, upload_id: &str) -> Result<(), ClientError> {
        let request = proto::AbortUploadRequest {
            upload_id: upload_id.to_string(),
        };
        let r = self.rpc.abort_upload(request).await;
        r.map_err(|s| self.status(s))?;
        Ok(())
    }

    /// [`Client::abort_upload`] after a failed write or commit; its own failure (the upload
    /// already gone with a refused commit, the connection lost) is not the caller's error.
    async fn abort_after_failure(&mut self, upload_id: &str) {
        if let Err(e) = self.abort_upload(upload_id).await {
            tracing::debug!(upload = %upload_id, error = %e, "abort after a failed upload");
        }
    }

    /// The last step of [`Client::upload_model`]: turns a filled (and unmapped) upload into a
    /// model; returns the manifest and whether an identical model was already in the store.
    pub async fn commit_upload(
        &mut self,
        upload_id: &str,
    ) -> Result<(proto::ModelManifest, bool), ClientError> {
        let request = proto::CommitUploadRequest {
            upload_id: upload_id.to_string(),
            retention: self.retention as i32,
            coding: self.coding as i32,
        };
        let r = self.rpc.commit_upload(request).await;
        let committed = r.map_err(|s| self.status(s))?.into_inner();
        let manifest = committed
            .manifest
            .ok_or_else(|| ClientError::Protocol("CommitUpload without a manifest".into()))?;
        Ok((manifest, committed.deduplicated))
    }

    pub async fn release_model(&mut self, model_id: &str) -> Result<u32, ClientError> {
        self.release(model_id, false).await
    }

    /// Gives back every uid's references to the model (pins included): for root and the
    /// daemon's own user. The model goes once its sessions end.
    pub async fn release_model_for_all(&mut self, model_id: &str) -> Result<u32, ClientError> {
        self.release(model_id, true).await
    }

    async fn release(&mut self, model_id: &str, all_references: bool) -> Result<u32, ClientError> {
        let request = proto::ReleaseModelRequest {
            model_id: model_id.to_string(),
            all_references,
        };
        let r = self.rpc.release_model(request).await;
        let refcount = r.map_err(|s| self.status(s))?.into_inner().refcount;
        if refcount == 0 {
            let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
            loaded.remove(model_id);
        }
        Ok(refcount)
    }

    /// Every model in the store (all pages; `next_page_token` is empty).
    pub async fn list_models(&mut self) -> Result<proto::ListModelsResponse, ClientError> {
        let mut all = proto::ListModelsResponse::default();
        let mut page_token = String::new();
        for _ in 0..MAX_LIST_PAGES {
            let request = proto::ListModelsRequest {
                page_size: 0,
                page_token: page_token.clone(),
            };
            let r = self.rpc.list_models(request).await;
            let page = r.map_err(|s| self.status(s))?.into_inner();
            all.models.extend(page.models);
            all.store_bytes = page.store_bytes;
            if page.next_page_token.is_empty() {
                return Ok(all);
            }
            repeated_token(&page_token, &page.next_page_token, "ListModels")?;
            page_token = page.next_page_token;
        }
        Err(too_many_pages("ListModels"))
    }

    /// Every session (all pages).
    pub async fn list_sessions(&mut self) -> Result<Vec<proto::SessionInfo>, ClientError> {
        let mut sessions = Vec::new();
        let mut page_token = String::new();
        for _ in 0..MAX_LIST_PAGES {
            let request = proto::ListSessionsRequest {
                page_size: 0,
                page_token: page_token.clone(),
            };
            let r = self.rpc.list_sessions(request).await;
            let page = r.map_err(|s| self.status(s))?.into_inner();
            sessions.extend(page.sessions);
            if page.next_page_token.is_empty() {
                return Ok(sessions);
            }
            repeated_token(&page_token, &page.next_page_token, "ListSessions")?;
            page_token = page.next_page_token;
        }
        Err(too_many_pages("ListSessions"))
    }

    /// Makes sure the daemon has `model_id`: opens and loads again the paths this client loaded
    /// it from when it does not (a restarted daemon starts empty). True when it loaded it
    /// again; false when the daemon has it, or when this client did not load it from files
    /// (then `OpenSession` says NOT_FOUND with the id: upload it again first).
    pub async fn restore_model(&mut self, model_id: &str) -> Result<bool, ClientError> {
        let listed = self.list_models().await?;
        if listed.models.iter().any(|m| m.model_id == model_id) {
            return Ok(false);
        }
        let Some(from) = self.loaded_from(model_id) else {
            return Ok(false);
        };
        let manifest = self.load_model_from(&from, "", |_| {}).await?;
        if manifest.model_id != model_id {
            self.release_model(&manifest.model_id).await?;
            return Err(ClientError::Rejected {
                code: tonic::Code::FailedPrecondition,
                message: format!(
                    "loading {:?} again gave model {}, not {model_id}: the files changed",
                    from.paths, manifest.model_id
                ),
            });
        }
        Ok(true)
    }

    /// The paths of every model this client (or a clone) loaded from files, by model id;
    /// empty if another thread is updating the table right now (a forked child whose parent
    /// was doing so then).
    pub fn loaded_models(&self) -> HashMap<String, LoadedFrom> {
        match self.loaded.try_lock() {
            Ok(loaded) => loaded.clone(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().clone(),
            Err(std::sync::TryLockError::WouldBlock) => HashMap::new(),
        }
    }

    /// Adds to the models this client can load again in [`Client::restore_model`] (e.g. those
    /// of a client of the parent process, after a fork).
    pub fn remember_loaded(&self, models: HashMap<String, LoadedFrom>) {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        loaded.extend(models);
    }

    /// Opens a session and attaches its hot-path stream.
    pub async fn open_session(&mut self, options: SessionOptions) -> Result<Session, ClientError> {
        Session::open(self.clone(), options).await
    }

    /// Asks the daemon for a state region of `bytes` (rounded up to whole pages) that belongs to
    /// session `session_id` (one this client's connection opened): host memory charged to this
    /// uid, freed with the session or by [`Client::free_state_region`]. Returns its id, its size
    /// and its fd, fetched from the handoff socket (read-write, zero-filled, its size sealed):
    /// map it shared to use it. `label` names it in the daemon's log.
    pub async fn alloc_state_region(
        &mut self,
        session_id: &str,
        bytes: u64,
        label: &str,
    ) -> Result<(String, u64, OwnedFd), ClientError> {
        let request = proto::AllocStateRegionRequest {
            session_id: session_id.to_string(),
            bytes,
            label: label.to_string(),
        };
        let r = self.rpc.alloc_state_region(request).await;
        let made = r.map_err(|s| self.status(s))?.into_inner();
        let (fd, size) = self.fetch_fd(&made.fd_secret).await?;
        if size != made.size {
            return Err(ClientError::Protocol(format!(
                "state region {}: the daemon passed {size} bytes for a region of {}",
                made.region_id, made.size
            )));
        }
        Ok((made.region_id, made.size, fd))
    }

    /// Frees state region `region_id` of session `session_id` before the session ends; what
    /// this process still maps of it stays charged to its uid until unmapped and closed.
    pub async fn free_state_region(
        &mut self,
        session_id: &str,
        region_id: &str,
    ) -> Result<(), ClientError> {
        let request = proto::FreeStateRegionRequest {
            session_id: session_id.to_string(),
            region_id: region_id.to_string(),
        };
        let r = self.rpc.free_state_region(request).await;
        r.map_err(|s| self.status(s))?;
        Ok(())
    }
}

/// The most pages a list is read in: 100 000 entries at the daemon's default page size, far
/// past any store or session count; a daemon that keeps giving fresh tokens is not followed
/// forever (nor into all of this process's memory).
pub const MAX_LIST_PAGES: u32 = 1000;

fn too_many_pages(call: &str) -> ClientError {
    ClientError::Protocol(format!(
        "{call} gave a next page after {MAX_LIST_PAGES} pages, the most a client reads: the \
         process at this socket does not behave as a weightstream daemon"
    ))
}

/// A daemon that hands back the page token it was given would be paged forever.
fn repeated_token(asked: &str, next: &str, call: &str) -> Result<(), ClientError> {
    if asked == next {
        return Err(ClientError::Protocol(format!(
            "{call} gave the same page token again"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error names each place the search looked, once, with what to do (not the OS error
    /// repeated by each layer of the transport).
    #[tokio::test]
    async fn connecting_where_no_socket_is_names_every_place_tried() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("run-user");
        let candidates =
            SocketCandidates::new(None, &dir.path().join("system.sock"), Some(&runtime), 1);
        let err = Client::connect_to(candidates.for_client())
            .await
            .err()
            .unwrap();
        let (system, user) = (
            dir.path().join("system.sock"),
            runtime.join("weightstream.sock"),
        );
        assert_eq!(
            err.to_string(),
            format!(
                "cannot reach the weightstream daemon at {user}: no such socket (tried {system}, \
                 {user}). Start the daemon with `weightstream serve`, or pass --socket (or set \
                 WEIGHTSTREAM_SOCKET) to name another socket",
                user = user.display(),
                system = system.display(),
            )
        );
        // A lazy client says the same at its first call.
        let mut lazy = Client::connect_lazy_to(candidates.for_client());
        assert_eq!(lazy.info().await.unwrap_err().to_string(), err.to_string());
    }
}
