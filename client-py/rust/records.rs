//! The wire's messages as Python sees them: read-only records with the protobuf field names
//! (so `manifest.model_id`, `session.stats.hits` read as they did with the generated stubs),
//! a `repr`, and `DESCRIPTOR.fields` (each field's `name`) for code that walks a message's
//! fields. Repeated messages are lists; enums are their numbers (`weightstream.protocol` names
//! them).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use weightstream_client::{coding_name, proto, quantization_name};

/// `Name(field=repr, ...)`.
fn repr(obj: &Bound<'_, PyAny>, name: &str, fields: &[&str]) -> PyResult<String> {
    let mut out = format!("{name}(");
    for (i, field) in fields.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let value = obj.getattr(*field)?.repr()?;
        out.push_str(&format!("{field}={value}"));
    }
    out.push(')');
    Ok(out)
}

/// `types.SimpleNamespace(name=..., fields=[SimpleNamespace(name=field), ...])`.
fn descriptor(py: Python<'_>, name: &str, fields: &[&str]) -> PyResult<Py<PyAny>> {
    let namespace = py.import("types")?.getattr("SimpleNamespace")?;
    let kwargs = |k: &str, v: Bound<'_, PyAny>| -> PyResult<_> {
        let d = pyo3::types::PyDict::new(py);
        d.set_item(k, v)?;
        Ok(d)
    };
    let list = PyList::empty(py);
    for f in fields {
        list.append(namespace.call((), Some(&kwargs("name", f.into_pyobject(py)?.into_any())?))?)?;
    }
    let d = kwargs("fields", list.into_any())?;
    d.set_item("name", name)?;
    Ok(namespace.call((), Some(&d))?.unbind())
}

macro_rules! record {
    ($(#[doc = $doc:literal])* $name:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[doc = $doc])*
        #[pyclass(module = "weightstream._native", frozen, get_all)]
        pub struct $name {
            $(pub $field: $ty,)*
        }

        #[pymethods]
        impl $name {
            fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
                repr(slf.as_any(), stringify!($name), &[$(stringify!($field)),*])
            }

            #[classattr]
            #[allow(non_snake_case)]
            fn DESCRIPTOR(py: Python<'_>) -> PyResult<Py<PyAny>> {
                descriptor(py, stringify!($name), &[$(stringify!($field)),*])
            }
        }
    };
}

fn list<T>(
    py: Python<'_>,
    items: impl IntoIterator<Item = T>,
    f: impl Fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) -> PyResult<Py<PyList>> {
    let out = PyList::empty(py);
    for item in items {
        out.append(f(py, item)?)?;
    }
    Ok(out.unbind())
}

fn bytes(py: Python<'_>, b: &[u8]) -> Py<PyBytes> {
    PyBytes::new(py, b).unbind()
}

record! {
    /// `GetInfo`: version, backend (`BACKEND_*`), devices, limits, alignment, the quotas and
    /// what the caller's uid and the daemon hold against them (`usage`).
    GetInfoResponse {
        version: String,
        backend: i32,
        devices: Py<PyList>,
        limits: Option<Py<Limits>>,
        alignment: u64,
        quotas: Option<Py<Quotas>>,
        usage: Option<Py<QuotaUse>>,
    }
}

record! {
    /// The `[quotas]` as resolved at start (0: no limit); `max_device_bytes` per device.
    Quotas {
        per_uid_sessions: u32,
        per_uid_device_bytes: u64,
        per_uid_host_bytes: u64,
        per_uid_uploads: u32,
        max_host_bytes: u64,
        max_device_bytes: Vec<u64>,
    }
}

record! {
    /// What the caller's uid holds now, and the daemon's totals (`daemon_*`).
    QuotaUse {
        uid: u32,
        sessions: u32,
        device_bytes: u64,
        host_bytes: u64,
        uploads: u32,
        daemon_sessions: u32,
        daemon_host_bytes: u64,
        daemon_uploads: u32,
        daemon_device_bytes: Vec<u64>,
        state_bytes: u64,
        daemon_state_bytes: u64,
    }
}

record! {
    Device {
        uuid: String,
        name: String,
        total_memory: u64,
        free_memory: u64,
        pci_bus_id: String,
        copy_bandwidth_limit: u64,
    }
}

record! {
    Limits {
        max_message_bytes: u64,
        max_tensors_per_model: u32,
        max_groups_per_session: u32,
        max_plan_length: u32,
        max_live_tickets: u32,
        max_upload_bytes: u64,
        max_sessions: u32,
        max_name_bytes: u32,
        max_uploads: u32,
        max_state_region_bytes: u64,
        max_state_regions_per_session: u32,
        max_waiting_grants: u32,
    }
}

record! {
    /// A tensor of a model: name, dtype (`DTYPE_*`), shape, bytes; a quantized one
    /// (`quantization` "fp8_e4m3_block64", else "none") has dtype F8_E4M3 and its bytes are
    /// data, padding and fp32 scales of `scale_shape` at `scale_offset`. `format`: its
    /// uploader's label for the packed format it is part of ("" if none), `weights` the weights
    /// it stands for. `coding` ("none", "rans8"): how the daemon holds it; a coded tensor's
    /// `nbytes` are its decoded bytes, `stored_nbytes` the coded ones, `coded_lanes` its
    /// coder's lanes.
    TensorInfo {
        name: String,
        dtype: i32,
        shape: Vec<u64>,
        nbytes: u64,
        quantization: String,
        scale_shape: Vec<u64>,
        scale_offset: u64,
        format: String,
        weights: u64,
        coding: String,
        stored_nbytes: u64,
        coded_lanes: u32,
    }
}

record! {
    /// One format of a model (`ModelManifest.formats`): an uploader's label, a quantization or
    /// a dtype, with its tensors, bytes and weights; `bits_per_weight` is 8 x bytes / weights
    /// (None where it counts no weights).
    FormatUse {
        format: String,
        tensors: u32,
        bytes: u64,
        weights: u64,
        bits_per_weight: Option<f64>,
    }
}

record! {
    /// A model; `phases` says where the daemon's time went in the `load_model` or
    /// `commit_upload` that returned it (None in `list_models`). `pinned`: pinned references
    /// (all uids); `cached`: only references of closed connections hold it, and the daemon
    /// evicts it when a load or upload needs the memory. `formats`: its formats
    /// (`FormatUse`), the most bytes first.
    ModelManifest {
        model_id: String,
        name: String,
        tensors: Py<PyList>,
        formats: Py<PyList>,
        total_bytes: u64,
        refcount: u32,
        sessions: u32,
        source: String,
        phases: Option<Py<StorePhases>>,
        pinned: u32,
        cached: bool,
    }
}

record! {
    /// A load's or a commit's time in the daemon, phase by phase (nanoseconds; 0: the call did
    /// not go through it): arena allocation, reading, sealing, quantizing, hashing (while
    /// page-locking), page-locking, the whole call, the bytes read or uploaded, and coding.
    StorePhases {
        alloc_ns: u64,
        read_ns: u64,
        seal_ns: u64,
        quantize_ns: u64,
        code_ns: u64,
        hash_ns: u64,
        pin_ns: u64,
        total_ns: u64,
        input_bytes: u64,
    }
}

record! {
    LoadProgress {
        bytes_done: u64,
        bytes_total: u64,
        current_file: String,
    }
}

record! {
    /// Every model in the store (all pages: `next_page_token` is empty).
    ListModelsResponse {
        models: Py<PyList>,
        store_bytes: u64,
        next_page_token: String,
    }
}

record! {
    /// A tensor in a group: as in `TensorInfo`, at `offset` from the group's start (its
    /// scales, when quantized, at `offset + scale_offset`). A coded one (`coding` "rans8")
    /// holds `stored_nbytes` of coded bytes at `offset`, which decode to the `nbytes` the other
    /// fields describe (offsets then from the decoded bytes' start).
    TensorPlacement {
        name: String,
        dtype: i32,
        shape: Vec<u64>,
        offset: u64,
        nbytes: u64,
        quantization: String,
        scale_shape: Vec<u64>,
        scale_offset: u64,
        coding: String,
        stored_nbytes: u64,
        coded_lanes: u32,
    }
}

record! {
    GroupLayout {
        group: u32,
        name: String,
        nbytes: u64,
        tensors: Py<PyList>,
        resident: bool,
    }
}

record! {
    /// A region of a session: `kind` is `"host"` (shared memory: its fd from
    /// `Session.region_fd`; `fd_secret` names it on the handoff socket) or `"cuda"`
    /// (`cuda_ipc_handle`, 64 bytes).
    Region {
        index: u32,
        size: u64,
        kind: String,
        cuda_ipc_handle: Option<Py<PyBytes>>,
        fd_secret: Option<String>,
    }
}

record! {
    UploadTensor {
        name: String,
        offset: u64,
        nbytes: u64,
    }
}

record! {
    /// A begun upload: its region (`size` bytes, its fd from `Client.fetch_fd(fd_secret)`)
    /// and where each tensor goes in it.
    BeginUploadResponse {
        upload_id: String,
        size: u64,
        tensors: Py<PyList>,
        fd_secret: String,
    }
}

record! {
    /// What `OpenSession` answered: the session's regions, group layouts and events.
    OpenSessionResponse {
        session_id: String,
        regions: Py<PyList>,
        groups: Py<PyList>,
        staging_bytes: u64,
        resident_bytes: u64,
        event_handles: Py<PyList>,
        accepts_gpu_wait: bool,
        paces_client_copies: bool,
        max_grant_bytes: u64,
    }
}

record! {
    SessionStats {
        acquires: u64,
        hits: u64,
        reuses: u64,
        misses: u64,
        resident_hits: u64,
        bytes_copied: u64,
        bytes_from_device: u64,
        copies: u64,
        prefetches: u64,
        resyncs: u64,
        releases: u64,
        evictions: u64,
        acquire_pending_ns: u64,
        gpu_wait_ns: u64,
        gpu_waits: u64,
        gpu_wait_reports: u64,
        granted_h2d_bytes: u64,
        granted_d2h_bytes: u64,
        kinds: Py<PyList>,
    }
}

record! {
    /// One pass kind's part of a session's counters (`kind`: `"train"` or `"sample"`).
    PassStats {
        kind: String,
        acquires: u64,
        hits: u64,
        misses: u64,
        bytes_copied: u64,
        gpu_wait_ns: u64,
        gpu_waits: u64,
    }
}

record! {
    SessionInfo {
        session_id: String,
        model_id: String,
        device_uuid: String,
        label: String,
        peer_uid: u32,
        peer_gid: u32,
        peer_pid: i32,
        vram_budget: u64,
        staging_bytes: u64,
        resident_bytes: u64,
        attached: bool,
        plan_length: u32,
        live_tickets: u32,
        stats: Option<Py<SessionStats>>,
        age_ms: u64,
        group_acquire_pending_ns: Vec<u64>,
        group_gpu_wait_ns: Vec<u64>,
        state_bytes: u64,
        state_regions: u32,
    }
}

record! {
    /// The session's waits for weights as this client measured them (since it was opened or
    /// reopened): in total, by group (index = group id), and per step (`per_step`: the last
    /// completed steps, oldest first; `this_step`: the step in progress, number `step`).
    WaitTotals {
        total_ns: u64,
        waits: u64,
        by_group: Vec<u64>,
        per_step: Vec<u64>,
        this_step: u64,
        step: u64,
    }
}

record! {
    /// Where the daemon put a ticket's group (`region`, `offset`) and its events (1-based
    /// indices into the session's event handles; 0: none); `group` is the group acquired.
    Staged {
        ticket: u64,
        group: u32,
        region: u32,
        offset: u64,
        ready_event: u32,
        free_event: u32,
    }
}

fn obj<T: pyo3::PyClass + Into<pyo3::PyClassInitializer<T>>>(
    py: Python<'_>,
    value: T,
) -> PyResult<Py<PyAny>> {
    Ok(Py::new(py, value)?.into_any())
}

pub(crate) fn info(py: Python<'_>, m: proto::GetInfoResponse) -> PyResult<GetInfoResponse> {
    Ok(GetInfoResponse {
        version: m.version,
        backend: m.backend,
        devices: list(py, m.devices, |py, d| {
            obj(
                py,
                Device {
                    uuid: d.uuid,
                    name: d.name,
                    total_memory: d.total_memory,
                    free_memory: d.free_memory,
                    pci_bus_id: d.pci_bus_id,
                    copy_bandwidth_limit: d.copy_bandwidth_limit,
                },
            )
        })?,
        limits: m
            .limits
            .map(|l| {
                Py::new(
                    py,
                    Limits {
                        max_message_bytes: l.max_message_bytes,
                        max_tensors_per_model: l.max_tensors_per_model,
                        max_groups_per_session: l.max_groups_per_session,
                        max_plan_length: l.max_plan_length,
                        max_live_tickets: l.max_live_tickets,
                        max_upload_bytes: l.max_upload_bytes,
                        max_sessions: l.max_sessions,
                        max_name_bytes: l.max_name_bytes,
                        max_uploads: l.max_uploads,
                        max_state_region_bytes: l.max_state_region_bytes,
                        max_state_regions_per_session: l.max_state_regions_per_session,
                        max_waiting_grants: l.max_waiting_grants,
                    },
                )
            })
            .transpose()?,
        alignment: m.alignment,
        quotas: (m.quotas)
            .map(|q| {
                Py::new(
                    py,
                    Quotas {
                        per_uid_sessions: q.per_uid_sessions,
                        per_uid_device_bytes: q.per_uid_device_bytes,
                        per_uid_host_bytes: q.per_uid_host_bytes,
                        per_uid_uploads: q.per_uid_uploads,
                        max_host_bytes: q.max_host_bytes,
                        max_device_bytes: q.max_device_bytes,
                    },
                )
            })
            .transpose()?,
        usage: (m.usage)
            .map(|u| {
                Py::new(
                    py,
                    QuotaUse {
                        uid: u.uid,
                        sessions: u.sessions,
                        device_bytes: u.device_bytes,
                        host_bytes: u.host_bytes,
                        uploads: u.uploads,
                        daemon_sessions: u.daemon_sessions,
                        daemon_host_bytes: u.daemon_host_bytes,
                        daemon_uploads: u.daemon_uploads,
                        daemon_device_bytes: u.daemon_device_bytes,
                        state_bytes: u.state_bytes,
                        daemon_state_bytes: u.daemon_state_bytes,
                    },
                )
            })
            .transpose()?,
    })
}

pub(crate) fn manifest(py: Python<'_>, m: proto::ModelManifest) -> PyResult<ModelManifest> {
    Ok(ModelManifest {
        model_id: m.model_id,
        name: m.name,
        tensors: list(py, m.tensors, |py, t| {
            obj(
                py,
                TensorInfo {
                    quantization: quantization_name(t.quantization),
                    name: t.name,
                    dtype: t.dtype,
                    shape: t.shape,
                    nbytes: t.nbytes,
                    scale_shape: t.scale_shape,
                    scale_offset: t.scale_offset,
                    format: t.format,
                    weights: t.weights,
                    coding: coding_name(t.coding),
                    stored_nbytes: t.stored_nbytes,
                    coded_lanes: t.coded_lanes,
                },
            )
        })?,
        formats: list(py, m.formats, |py, f| {
            obj(
                py,
                FormatUse {
                    bits_per_weight: (f.weights > 0)
                        .then(|| 8.0 * f.bytes as f64 / f.weights as f64),
                    format: f.format,
                    tensors: f.tensors,
                    bytes: f.bytes,
                    weights: f.weights,
                },
            )
        })?,
        total_bytes: m.total_bytes,
        refcount: m.refcount,
        sessions: m.sessions,
        pinned: m.pinned,
        cached: m.cached,
        source: m.source,
        phases: (m.phases)
            .map(|p| {
                let p = StorePhases {
                    alloc_ns: p.alloc_ns,
                    read_ns: p.read_ns,
                    seal_ns: p.seal_ns,
                    quantize_ns: p.quantize_ns,
                    code_ns: p.code_ns,
                    hash_ns: p.hash_ns,
                    pin_ns: p.pin_ns,
                    total_ns: p.total_ns,
                    input_bytes: p.input_bytes,
                };
                Py::new(py, p)
            })
            .transpose()?,
    })
}

pub(crate) fn progress(p: &proto::LoadProgress) -> LoadProgress {
    LoadProgress {
        bytes_done: p.bytes_done,
        bytes_total: p.bytes_total,
        current_file: p.current_file.clone(),
    }
}

pub(crate) fn models(py: Python<'_>, m: proto::ListModelsResponse) -> PyResult<ListModelsResponse> {
    Ok(ListModelsResponse {
        models: list(py, m.models, |py, m| obj(py, manifest(py, m)?))?,
        store_bytes: m.store_bytes,
        next_page_token: m.next_page_token,
    })
}

pub(crate) fn wait_totals(t: weightstream_client::WaitTotals) -> WaitTotals {
    WaitTotals {
        total_ns: t.total_ns,
        waits: t.waits,
        by_group: t.by_group,
        per_step: t.per_step,
        this_step: t.this_step,
        step: t.step,
    }
}

pub(crate) fn session_info(py: Python<'_>, s: proto::SessionInfo) -> PyResult<SessionInfo> {
    Ok(SessionInfo {
        session_id: s.session_id,
        model_id: s.model_id,
        device_uuid: s.device_uuid,
        label: s.label,
        peer_uid: s.peer_uid,
        peer_gid: s.peer_gid,
        peer_pid: s.peer_pid,
        vram_budget: s.vram_budget,
        staging_bytes: s.staging_bytes,
        resident_bytes: s.resident_bytes,
        attached: s.attached,
        plan_length: s.plan_length,
        live_tickets: s.live_tickets,
        stats: s.stats.map(|st| Py::new(py, stats(py, st)?)).transpose()?,
        age_ms: s.age_ms,
        group_acquire_pending_ns: s.group_acquire_pending_ns,
        group_gpu_wait_ns: s.group_gpu_wait_ns,
        state_bytes: s.state_bytes,
        state_regions: s.state_regions,
    })
}

fn stats(py: Python<'_>, s: proto::SessionStats) -> PyResult<SessionStats> {
    let kinds = list(py, s.kinds, |py, k| {
        let kind = match k.kind() {
            proto::PassKind::Train => "train",
            proto::PassKind::Sample => "sample",
            proto::PassKind::Unspecified => "unspecified",
        };
        let record = PassStats {
            kind: kind.into(),
            acquires: k.acquires,
            hits: k.hits,
            misses: k.misses,
            bytes_copied: k.bytes_copied,
            gpu_wait_ns: k.gpu_wait_ns,
            gpu_waits: k.gpu_waits,
        };
        Ok(Py::new(py, record)?.into_any())
    })?;
    Ok(SessionStats {
        acquires: s.acquires,
        hits: s.hits,
        reuses: s.reuses,
        misses: s.misses,
        resident_hits: s.resident_hits,
        bytes_copied: s.bytes_copied,
        bytes_from_device: s.bytes_from_device,
        copies: s.copies,
        prefetches: s.prefetches,
        resyncs: s.resyncs,
        releases: s.releases,
        evictions: s.evictions,
        acquire_pending_ns: s.acquire_pending_ns,
        gpu_wait_ns: s.gpu_wait_ns,
        gpu_waits: s.gpu_waits,
        gpu_wait_reports: s.gpu_wait_reports,
        granted_h2d_bytes: s.granted_h2d_bytes,
        granted_d2h_bytes: s.granted_d2h_bytes,
        kinds,
    })
}

pub(crate) fn layout(
    py: Python<'_>,
    m: &proto::OpenSessionResponse,
) -> PyResult<OpenSessionResponse> {
    Ok(OpenSessionResponse {
        session_id: m.session_id.clone(),
        regions: list(py, &m.regions, |py, r| {
            let (kind, handle, secret) = match &r.handle {
                Some(proto::region::Handle::CudaIpcHandle(h)) => ("cuda", Some(bytes(py, h)), None),
                Some(proto::region::Handle::FdSecret(s)) => ("host", None, Some(s.clone())),
                None => ("none", None, None),
            };
            obj(
                py,
                Region {
                    index: r.index,
                    size: r.size,
                    kind: kind.to_string(),
                    cuda_ipc_handle: handle,
                    fd_secret: secret,
                },
            )
        })?,
        groups: list(py, &m.groups, |py, g| {
            obj(
                py,
                GroupLayout {
                    group: g.group,
                    name: g.name.clone(),
                    nbytes: g.nbytes,
                    tensors: list(py, &g.tensors, |py, t| {
                        obj(
                            py,
                            TensorPlacement {
                                name: t.name.clone(),
                                dtype: t.dtype,
                                shape: t.shape.clone(),
                                offset: t.offset,
                                nbytes: t.nbytes,
                                quantization: quantization_name(t.quantization),
                                scale_shape: t.scale_shape.clone(),
                                scale_offset: t.scale_offset,
                                coding: coding_name(t.coding),
                                stored_nbytes: t.stored_nbytes,
                                coded_lanes: t.coded_lanes,
                            },
                        )
                    })?,
                    resident: g.resident,
                },
            )
        })?,
        staging_bytes: m.staging_bytes,
        resident_bytes: m.resident_bytes,
        event_handles: list(py, &m.event_handles, |py, h| Ok(bytes(py, h).into_any()))?,
        accepts_gpu_wait: m.accepts_gpu_wait,
        paces_client_copies: m.paces_client_copies,
        max_grant_bytes: m.max_grant_bytes,
    })
}

pub(crate) fn begun(
    py: Python<'_>,
    b: proto::BeginUploadResponse,
) -> PyResult<BeginUploadResponse> {
    Ok(BeginUploadResponse {
        upload_id: b.upload_id,
        size: b.size,
        tensors: list(py, b.tensors, |py, t| {
            obj(
                py,
                UploadTensor {
                    name: t.name,
                    offset: t.offset,
                    nbytes: t.nbytes,
                },
            )
        })?,
        fd_secret: b.fd_secret,
    })
}

pub(crate) fn staged(group: u32, s: &proto::Staged) -> Staged {
    Staged {
        ticket: s.ticket,
        group,
        region: s.region,
        offset: s.offset,
        ready_event: s.ready_event,
        free_event: s.free_event,
    }
}

/// Registers the record classes and the wire's enums (`DTYPE_BF16 = 9`, ...; and each enum as
/// a `{name: number}` dict: `DTYPES`, `BACKENDS`, `FAULT_CODES`).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GetInfoResponse>()?;
    m.add_class::<Device>()?;
    m.add_class::<Limits>()?;
    m.add_class::<Quotas>()?;
    m.add_class::<QuotaUse>()?;
    m.add_class::<TensorInfo>()?;
    m.add_class::<ModelManifest>()?;
    m.add_class::<FormatUse>()?;
    m.add_class::<StorePhases>()?;
    m.add_class::<LoadProgress>()?;
    m.add_class::<ListModelsResponse>()?;
    m.add_class::<TensorPlacement>()?;
    m.add_class::<GroupLayout>()?;
    m.add_class::<Region>()?;
    m.add_class::<OpenSessionResponse>()?;
    m.add_class::<SessionStats>()?;
    m.add_class::<SessionInfo>()?;
    m.add_class::<WaitTotals>()?;
    m.add_class::<Staged>()?;
    m.add_class::<UploadTensor>()?;
    m.add_class::<BeginUploadResponse>()?;
    enum_values(m, "DTYPES", |i| {
        proto::Dtype::try_from(i).ok().map(|v| v.as_str_name())
    })?;
    enum_values(m, "BACKENDS", |i| {
        proto::Backend::try_from(i).ok().map(|v| v.as_str_name())
    })?;
    enum_values(m, "FAULT_CODES", |i| {
        proto::FaultCode::try_from(i).ok().map(|v| v.as_str_name())
    })?;
    Ok(())
}

fn enum_values(
    m: &Bound<'_, PyModule>,
    dict: &str,
    name: impl Fn(i32) -> Option<&'static str>,
) -> PyResult<()> {
    let values = pyo3::types::PyDict::new(m.py());
    // prost enums have no list of variants: the proto numbers them densely from 0.
    for i in 0..256 {
        if let Some(name) = name(i) {
            values.set_item(name, i)?;
            m.add(name, i)?;
        }
    }
    m.add(dict, values)
}
