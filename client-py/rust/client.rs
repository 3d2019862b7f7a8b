//! `weightstream._native.Client`: a connection to the daemon, made lazily in each process.

use std::collections::HashMap;
use std::os::fd::IntoRawFd;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use weightstream_client::{self as ws, SessionOptions, TensorData, proto};

use crate::errors::IntoPy;
use crate::records;
use crate::runtime::{block_on, generation, runtime};
use crate::session::{Connection, Session};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The connection of one process. Locked only while holding the GIL, never across a call
/// that releases it (so no other thread holds it when `os.fork()` runs).
struct Conn {
    /// The fork generation the connection was made in.
    generation: u32,
    client: Option<ws::Client>,
    /// Models a parent process's client loaded from files (for `restore_model` in a child).
    carried: HashMap<String, ws::LoadedFrom>,
}

impl Conn {
    /// In a forked child: lets go of the parent's connection (its tasks ran on the parent's
    /// runtime; it is leaked, never dropped here), keeping what it knew to load again.
    fn follow_fork(&mut self) {
        let now = generation();
        if self.generation == now {
            return;
        }
        if let Some(old) = self.client.take() {
            self.carried.extend(old.loaded_models());
            std::mem::forget(old);
        }
        self.generation = now;
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.generation != generation()
            && let Some(old) = self.client.take()
        {
            std::mem::forget(old);
        }
    }
}

/// A client of the daemon at one socket. It connects on its first call in each process (a
/// client made before `os.fork()` connects again in the child); every call releases the GIL
/// while it waits and fails fast with `DaemonUnavailable` when the daemon is not there.
#[pyclass(module = "weightstream._native", frozen)]
pub struct Client {
    socket: ws::ResolvedSocket,
    conn: Mutex<Conn>,
}

impl Client {
    /// This process's connection (made now if there is none yet; it dials on first use).
    pub(crate) fn client(&self, py: Python<'_>) -> PyResult<ws::Client> {
        let rt = runtime(py)?;
        let mut conn = lock(&self.conn);
        conn.follow_fork();
        if let Some(c) = &conn.client {
            return Ok(c.clone());
        }
        let fresh = {
            let _entered = rt.enter();
            ws::Client::connect_lazy_to(self.socket.clone())
        };
        fresh.remember_loaded(std::mem::take(&mut conn.carried));
        conn.client = Some(fresh.clone());
        Ok(fresh)
    }

    /// Makes `fresh` (a reconnected clone, sharing what it loaded) this process's connection.
    fn replace(&self, fresh: ws::Client) {
        let mut conn = lock(&self.conn);
        conn.follow_fork();
        conn.client = Some(fresh);
    }
}

/// A Python `Client` where a connection is wanted (`Session.reopen(client, …)`): its connection
/// in this process, made now if there is none yet.
impl<'a, 'py> FromPyObject<'a, 'py> for Connection {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Connection> {
        let client = obj.cast::<Client>()?;
        Ok(Connection(client.get().client(obj.py())?))
    }
}

/// A tensor's bytes: `bytes`, or `(data_ptr, nbytes)` of a contiguous CPU tensor.
#[derive(FromPyObject)]
enum Payload<'py> {
    Bytes(Bound<'py, PyBytes>),
    Raw(usize, usize),
}

fn dtype(value: i32) -> PyResult<proto::Dtype> {
    proto::Dtype::try_from(value)
        .ok()
        .filter(|d| *d != proto::Dtype::Unspecified)
        .ok_or_else(|| PyValueError::new_err(format!("dtype {value} is not a wire dtype")))
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (socket=None))]
    fn new(socket: Option<PathBuf>) -> Self {
        Client {
            socket: ws::ResolvedSocket::from_env(socket.as_deref()),
            conn: Mutex::new(Conn {
                generation: generation(),
                client: None,
                carried: HashMap::new(),
            }),
        }
    }

    #[getter]
    fn socket(&self) -> PathBuf {
        self.socket.path.clone()
    }

    /// The daemon's handoff socket, where file descriptors pass (next to its socket).
    #[getter]
    fn handoff_socket(&self) -> PathBuf {
        ws::handoff::handoff_path(&self.socket.path)
    }

    /// The files each model this client loaded was named by, by model id.
    #[getter]
    fn loaded(&self) -> HashMap<String, Vec<PathBuf>> {
        let mut conn = lock(&self.conn);
        conn.follow_fork();
        let loaded = match &conn.client {
            Some(c) => c.loaded_models(),
            None => conn.carried.clone(),
        };
        loaded
            .into_iter()
            .map(|(id, from)| (id, from.paths))
            .collect()
    }

    fn info(&self, py: Python<'_>) -> PyResult<records::GetInfoResponse> {
        let mut c = self.client(py)?;
        let info = block_on(py, async move { c.info().await })?.py_err()?;
        records::info(py, info)
    }

    /// Waits until a daemon answers on the socket (one restarted there), `timeout` seconds at
    /// most; this client's calls go to it from then on.
    fn reconnect(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = Duration::try_from_secs_f64(timeout.max(0.0))
            .map_err(|e| PyValueError::new_err(format!("timeout: {e}")))?;
        let mut c = self.client(py)?;
        let fresh =
            block_on(py, async move { c.reconnect(timeout).await.map(|()| c) })?.py_err()?;
        self.replace(fresh);
        Ok(())
    }

    /// Loads `model_id` again from the files this client loaded it from, if the daemon no
    /// longer has it. True if it loaded it again.
    fn restore_model(&self, py: Python<'_>, model_id: String) -> PyResult<bool> {
        let mut c = self.client(py)?;
        block_on(py, async move { c.restore_model(&model_id).await })?.py_err()
    }

    /// The fd (the caller owns and closes it) and size of what an `fd_secret` names.
    fn fetch_fd(&self, py: Python<'_>, secret: String) -> PyResult<(i32, u64)> {
        let c = self.client(py)?;
        let (fd, size) = block_on(py, async move { c.fetch_fd(&secret).await })?.py_err()?;
        Ok((fd.into_raw_fd(), size))
    }

    /// Loads safetensors files (absolute paths of files, index files or directories), which
    /// this process opens and passes to the daemon; `progress(LoadProgress)` sees each update
    /// (an exception it raises is raised once the load is done). The reference lasts as
    /// `retention` says ("cached", "connection", "pinned"). `tensors` names the tensors to load
    /// (their names in the files); empty: every tensor.
    #[pyo3(signature = (paths, name="", progress=None, quantize=None, retention="cached", tensors=Vec::new(), coding="none"))]
    #[allow(clippy::too_many_arguments)]
    fn load_model(
        &self,
        py: Python<'_>,
        paths: Vec<PathBuf>,
        name: &str,
        progress: Option<Py<PyAny>>,
        quantize: Option<&str>,
        retention: &str,
        tensors: Vec<String>,
        coding: &str,
    ) -> PyResult<records::ModelManifest> {
        let from = ws::LoadedFrom {
            paths,
            quantization: quantization(quantize.unwrap_or("none"))?,
            coding: parse_coding(coding)?,
            tensors,
        };
        let mut c = self.client(py)?.with_retention(parse_retention(retention)?);
        let name = name.to_string();
        let (loaded, failed) = block_on(py, async move {
            let mut failed: Option<PyErr> = None;
            let loaded = c
                .load_model_from(&from, &name, |p| {
                    if let (Some(cb), None) = (&progress, &failed)
                        && let Err(e) = Python::attach(|py| cb.call1(py, (records::progress(p),)))
                    {
                        failed = Some(e);
                    }
                })
                .await;
            (loaded, failed)
        })?;
        let manifest = loaded.py_err()?;
        if let Some(e) = failed {
            return Err(e);
        }
        records::manifest(py, manifest)
    }

    /// Uploads tensors: `(name, dtype, shape, data)` each, `data` being `bytes` or the
    /// `(data_ptr, nbytes)` of a contiguous CPU tensor the caller keeps alive and unchanged
    /// during the call; the daemon quantizes those named in `quantize` (fp8_e4m3_block64) at
    /// commit. Returns the manifest and whether an identical model was stored. The reference
    /// lasts as `retention` says ("cached", "connection", "pinned"). `labels` (name ->
    /// (format, weights)) labels raw tensors as parts of a packed format (`TensorInfo.format`).
    #[pyo3(signature = (name, tensors, quantize=Vec::new(), retention="cached", labels=HashMap::new(), coding="none"))]
    #[allow(clippy::too_many_arguments)]
    fn upload_model(
        &self,
        py: Python<'_>,
        name: String,
        tensors: Vec<(String, i32, Vec<u64>, Payload<'_>)>,
        quantize: Vec<String>,
        retention: &str,
        labels: HashMap<String, (String, u64)>,
        coding: &str,
    ) -> PyResult<(records::ModelManifest, bool)> {
        let retention = parse_retention(retention)?;
        let coding = parse_coding(coding)?;
        let quantize = quantize_set(quantize, tensors.iter().map(|t| t.0.as_str()))?;
        check_labels(&labels, tensors.iter().map(|t| t.0.as_str()))?;
        let mut data = Vec::with_capacity(tensors.len());
        for (tname, dt, shape, payload) in &tensors {
            let bytes: &[u8] = match payload {
                Payload::Bytes(b) => b.as_bytes(),
                // SAFETY: the package's Python code passes a tensor it holds until we return
                // (raw::host_bytes's contract); this call does not outlive `tensors`.
                #[allow(unsafe_code)]
                Payload::Raw(ptr, len) => unsafe { crate::raw::host_bytes(*ptr, *len)? },
            };
            let mut tensor = TensorData::new(tname, dtype(*dt)?, shape, bytes);
            if let Some((format, weights)) = labels.get(tname) {
                tensor = tensor.labelled(format, *weights);
            }
            data.push(if quantize.contains(tname.as_str()) {
                tensor.quantized_at_commit()
            } else {
                tensor
            });
        }
        let mut c = self
            .client(py)?
            .with_retention(retention)
            .with_coding(coding);
        let infos = data.iter().map(TensorData::info).collect();
        let begun = block_on(py, c.begin_upload(&name, infos, false))?.py_err()?;
        // Written and committed in one wait; whatever ends it early (an error, a signal such
        // as KeyboardInterrupt) aborts the upload, and the caller gets that, not the abort's.
        let done = block_on(py, async {
            c.write_upload(&begun, &data).await?;
            c.commit_upload(&begun.upload_id).await
        })
        .and_then(|r| r.py_err());
        match done {
            Ok((manifest, dedup)) => Ok((records::manifest(py, manifest)?, dedup)),
            Err(e) => {
                let _ = block_on(py, c.abort_upload(&begun.upload_id));
                Err(e)
            }
        }
    }

    /// Begins an upload of tensors `(name, dtype, shape)` without writing or committing it:
    /// the region to write (its fd from `fetch_fd(fd_secret)`; unmap it before the commit).
    /// The daemon drops an upload never committed when this process's connection goes.
    /// Tensors named in `quantize` are written as declared and quantized at commit; those in
    /// `prequantized` (name -> (format, scale_shape)) are written pre-quantized in that format
    /// (data, zero padding to 16, fp32 scales; dtype: the data's). With `client_reserves` the
    /// daemon answers without reserving the region's pages: the writer faults them in itself
    /// (`MADV_POPULATE_WRITE` or page-locking before it writes each part). `labels` as in
    /// `upload_model`.
    #[pyo3(signature = (name, tensors, quantize=Vec::new(), prequantized=HashMap::new(), client_reserves=false, labels=HashMap::new()))]
    // Python's keyword arguments, one each.
    #[allow(clippy::too_many_arguments)]
    fn begin_upload(
        &self,
        py: Python<'_>,
        name: String,
        tensors: Vec<(String, i32, Vec<u64>)>,
        quantize: Vec<String>,
        mut prequantized: HashMap<String, (String, Vec<u64>)>,
        client_reserves: bool,
        mut labels: HashMap<String, (String, u64)>,
    ) -> PyResult<records::BeginUploadResponse> {
        let quantize = quantize_set(quantize, tensors.iter().map(|t| t.0.as_str()))?;
        check_labels(&labels, tensors.iter().map(|t| t.0.as_str()))?;
        if let Some(unknown) = (prequantized.keys())
            .find(|n| !tensors.iter().any(|t| &t.0 == *n) || quantize.contains(n.as_str()))
        {
            return Err(PyValueError::new_err(format!(
                "prequantized: {unknown:?} is not one of the uploaded tensors, or is also in \
                 quantize"
            )));
        }
        let mut infos = Vec::with_capacity(tensors.len());
        for (tname, dt, shape) in tensors {
            let (quantization, scale_shape) = match prequantized.remove(&tname) {
                Some((format, scale_shape)) => {
                    let q = ws::prequantized_format(&format).ok_or_else(|| {
                        PyValueError::new_err(format!(
                            "prequantized: tensor {tname:?}: {format:?} is not a format written \
                             pre-quantized (fp8_e4m3_block64, fp8_e4m3_row, int8_row, \
                             torchao_float8_rowwise, torchao_int8_rowwise)"
                        ))
                    })?;
                    (q, scale_shape)
                }
                None if quantize.contains(tname.as_str()) => {
                    (proto::Quantization::Fp8E4m3Block64, Vec::new())
                }
                None => (proto::Quantization::None, Vec::new()),
            };
            let (format, weights) = labels.remove(&tname).unwrap_or_default();
            infos.push(proto::TensorInfo {
                name: tname,
                dtype: dtype(dt)? as i32,
                shape,
                quantization: quantization as i32,
                scale_shape,
                format,
                weights,
                ..Default::default()
            });
        }
        let mut c = self.client(py)?;
        let begun = block_on(py, async move {
            c.begin_upload(&name, infos, client_reserves).await
        })?
        .py_err()?;
        records::begun(py, begun)
    }

    /// Commits a begun (filled, unmapped) upload: the manifest, and whether an identical model
    /// was already stored. The reference lasts as `retention` says.
    #[pyo3(signature = (upload_id, retention="cached", coding="none"))]
    fn commit_upload(
        &self,
        py: Python<'_>,
        upload_id: String,
        retention: &str,
        coding: &str,
    ) -> PyResult<(records::ModelManifest, bool)> {
        let mut c = (self.client(py)?)
            .with_retention(parse_retention(retention)?)
            .with_coding(parse_coding(coding)?);
        let (manifest, dedup) =
            block_on(py, async move { c.commit_upload(&upload_id).await })?.py_err()?;
        Ok((records::manifest(py, manifest)?, dedup))
    }

    /// Drops upload `upload_id`, begun by this client and not to be committed: its host
    /// bytes are given back at once (what this process still maps of it, once unmapped and
    /// closed). NOT_FOUND for an upload already dropped, aborted or committed.
    fn abort_upload(&self, py: Python<'_>, upload_id: String) -> PyResult<()> {
        let mut c = self.client(py)?;
        block_on(py, async move { c.abort_upload(&upload_id).await })?.py_err()
    }

    /// Gives back one of this uid's references to the model, or with `all_references` (root
    /// and the daemon's user only) every uid's. Returns the references left.
    #[pyo3(signature = (model_id, all_references=false))]
    fn release_model(
        &self,
        py: Python<'_>,
        model_id: String,
        all_references: bool,
    ) -> PyResult<u32> {
        let mut c = self.client(py)?;
        block_on(py, async move {
            if all_references {
                c.release_model_for_all(&model_id).await
            } else {
                c.release_model(&model_id).await
            }
        })?
        .py_err()
    }

    /// Every model in the store (all pages).
    fn list_models(&self, py: Python<'_>) -> PyResult<records::ListModelsResponse> {
        let mut c = self.client(py)?;
        let listed = block_on(py, async move { c.list_models().await })?.py_err()?;
        records::models(py, listed)
    }

    /// Every session (all pages).
    fn list_sessions(&self, py: Python<'_>) -> PyResult<Vec<records::SessionInfo>> {
        let mut c = self.client(py)?;
        let sessions = block_on(py, async move { c.list_sessions().await })?.py_err()?;
        sessions
            .into_iter()
            .map(|s| records::session_info(py, s))
            .collect()
    }

    /// Opens a session of `groups` (`(name, [tensor names])` each) and attaches its stream.
    /// Host regions are not mapped here: `Session.region_fd` gives their fds.
    /// `copy_bandwidth_limit`: the session's share of the device's copy bandwidth, bytes per
    /// second (0: none).
    #[pyo3(signature = (model_id, groups, vram_budget, staging_bytes=0, device_uuid="", label="", copy_bandwidth_limit=0))]
    #[allow(clippy::too_many_arguments)]
    fn open_session(
        &self,
        py: Python<'_>,
        model_id: &str,
        groups: Vec<(String, Vec<String>)>,
        vram_budget: u64,
        staging_bytes: u64,
        device_uuid: &str,
        label: &str,
        copy_bandwidth_limit: u64,
    ) -> PyResult<Session> {
        let groups = groups
            .into_iter()
            .map(|(name, tensors)| proto::GroupSpec { name, tensors })
            .collect();
        let mut options = SessionOptions::new(model_id, vram_budget, groups);
        options.staging_bytes = staging_bytes;
        options.device_uuid = device_uuid.to_string();
        options.label = label.to_string();
        options.copy_bandwidth_limit = copy_bandwidth_limit;
        // The Python side sends its plan itself (weightstream.torch records it).
        options.record_plan = false;
        options.map_host_regions = false;
        let mut c = self.client(py)?;
        let session = block_on(py, async move { c.open_session(options).await })?.py_err()?;
        Session::new(py, session)
    }

    /// A state region of `nbytes` (rounded up to whole pages) for session `session_id`, one this
    /// process's connection opened: host memory the daemon holds for the session and charges
    /// to this uid. Returns `(region_id, size, fd)`; the fd (read-write, zero-filled, its size
    /// sealed) is the caller's to map and close.
    #[pyo3(signature = (session_id, nbytes, label=""))]
    fn alloc_state_region(
        &self,
        py: Python<'_>,
        session_id: String,
        nbytes: u64,
        label: &str,
    ) -> PyResult<(String, u64, i32)> {
        let mut c = self.client(py)?;
        let label = label.to_string();
        let (id, size, fd) = block_on(py, async move {
            c.alloc_state_region(&session_id, nbytes, &label).await
        })?
        .py_err()?;
        Ok((id, size, fd.into_raw_fd()))
    }

    /// Frees state region `region_id` of session `session_id` before the session ends.
    fn free_state_region(
        &self,
        py: Python<'_>,
        session_id: String,
        region_id: String,
    ) -> PyResult<()> {
        let mut c = self.client(py)?;
        block_on(py, async move {
            c.free_state_region(&session_id, &region_id).await
        })?
        .py_err()
    }

    fn __repr__(&self) -> String {
        format!(
            "Client(socket={:?})",
            self.socket.path.display().to_string()
        )
    }
}

/// `quantize=` of `load_model`: "none", "fp8_e4m3_block64", "fp8", "fp8_e4m3_row" or
/// "int8_row".
fn quantization(value: &str) -> PyResult<proto::Quantization> {
    ws::parse_quantization(value).ok_or_else(|| {
        PyValueError::new_err(format!(
            "quantize: {value:?} is not supported: the accepted values are None, \"none\", \
             \"fp8_e4m3_block64\", \"fp8\" (its alias), \"fp8_e4m3_row\", \"int8_row\""
        ))
    })
}

/// `coding=`: how the daemon holds the model ("none", "rans8").
fn parse_coding(value: &str) -> PyResult<proto::Coding> {
    ws::parse_coding(value).ok_or_else(|| {
        PyValueError::new_err(format!(
            "coding: {value:?} is not supported: the accepted values are \"none\", \"rans8\""
        ))
    })
}

/// `retention=`: how long a model reference lasts.
fn parse_retention(value: &str) -> PyResult<proto::Retention> {
    match value {
        "cached" => Ok(proto::Retention::Cached),
        "connection" => Ok(proto::Retention::Connection),
        "pinned" => Ok(proto::Retention::Pinned),
        other => Err(PyValueError::new_err(format!(
            "retention: {other:?} is not one of \"cached\", \"connection\", \"pinned\""
        ))),
    }
}

/// `quantize=` of the uploads: names of declared tensors, each once.
fn quantize_set<'a>(
    names: Vec<String>,
    declared: impl Iterator<Item = &'a str>,
) -> PyResult<std::collections::HashSet<String>> {
    let declared: std::collections::HashSet<&str> = declared.collect();
    if let Some(unknown) = names.iter().find(|n| !declared.contains(n.as_str())) {
        return Err(PyValueError::new_err(format!(
            "quantize: {unknown:?} is not one of the uploaded tensors"
        )));
    }
    Ok(names.into_iter().collect())
}

/// Every label names an uploaded tensor (the daemon checks the labels themselves).
fn check_labels<'a>(
    labels: &HashMap<String, (String, u64)>,
    names: impl Iterator<Item = &'a str> + Clone,
) -> PyResult<()> {
    match labels
        .keys()
        .find(|n| !names.clone().any(|t| t == n.as_str()))
    {
        Some(unknown) => Err(PyValueError::new_err(format!(
            "labels: {unknown:?} is not one of the uploaded tensors"
        ))),
        None => Ok(()),
    }
}
