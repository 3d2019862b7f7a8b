//! Conversions from the core's types to the wire's (errors: see status.rs).

use weightstream_proto::v1 as pb;

use crate::backend::{BackendKind, RegionHandle};
use crate::core::{Daemon, OpenedSession, Peer};
use crate::session::{PassKind, SessionShared, StatsSnapshot};
use crate::store::coding::Coding;
use crate::store::formats::formats;
use crate::store::quantize::Quantization;
use crate::store::safetensors::DType;
use crate::store::{
    Model, ModelEntry, ModelSource, Phases, Retention, StateUse, Stored, StoredTensor, UploadTicket,
};

pub fn dtype_to_pb(d: DType) -> pb::Dtype {
    use pb::Dtype as P;
    match d {
        DType::Bool => P::Bool,
        DType::U8 => P::U8,
        DType::I8 => P::I8,
        DType::F8E5M2 => P::F8E5m2,
        DType::F8E4M3 => P::F8E4m3,
        DType::I16 => P::I16,
        DType::U16 => P::U16,
        DType::F16 => P::F16,
        DType::BF16 => P::Bf16,
        DType::I32 => P::I32,
        DType::U32 => P::U32,
        DType::F32 => P::F32,
        DType::F64 => P::F64,
        DType::I64 => P::I64,
        DType::U64 => P::U64,
    }
}

pub fn quantization_to_pb(q: Quantization) -> pb::Quantization {
    match q {
        Quantization::None => pb::Quantization::None,
        Quantization::Fp8E4m3Block64 => pb::Quantization::Fp8E4m3Block64,
        Quantization::Fp8E4m3Row => pb::Quantization::Fp8E4m3Row,
        Quantization::Int8Row => pb::Quantization::Int8Row,
        Quantization::Fp8ScaledMusubi => pb::Quantization::Fp8ScaledMusubi,
        Quantization::Fp8ScaledComfy => pb::Quantization::Fp8ScaledComfy,
        Quantization::TorchaoFloat8Rowwise => pb::Quantization::TorchaoFloat8Rowwise,
        Quantization::TorchaoInt8Rowwise => pb::Quantization::TorchaoInt8Rowwise,
    }
}

pub fn quantization_from_pb(value: i32) -> Option<Quantization> {
    match pb::Quantization::try_from(value).ok()? {
        pb::Quantization::None => Some(Quantization::None),
        pb::Quantization::Fp8E4m3Block64 => Some(Quantization::Fp8E4m3Block64),
        pb::Quantization::Fp8E4m3Row => Some(Quantization::Fp8E4m3Row),
        pb::Quantization::Int8Row => Some(Quantization::Int8Row),
        pb::Quantization::Fp8ScaledMusubi => Some(Quantization::Fp8ScaledMusubi),
        pb::Quantization::Fp8ScaledComfy => Some(Quantization::Fp8ScaledComfy),
        pb::Quantization::TorchaoFloat8Rowwise => Some(Quantization::TorchaoFloat8Rowwise),
        pb::Quantization::TorchaoInt8Rowwise => Some(Quantization::TorchaoInt8Rowwise),
    }
}

/// A stored tensor's quantization, scale shape and scale offset, as the wire spells them.
fn quantized_fields(t: &StoredTensor) -> (i32, Vec<u64>, u64) {
    match &t.quantized {
        None => (pb::Quantization::None as i32, Vec::new(), 0),
        Some(q) => (
            quantization_to_pb(q.quantization) as i32,
            q.scale_shape.clone(),
            q.scale_offset,
        ),
    }
}

/// A stored tensor's bytes once decoded, its coding, stored bytes (0: not coded) and coder's
/// lanes, as the wire spells them.
fn coded_fields(t: &StoredTensor) -> (u64, i32, u64, u32) {
    match &t.coded {
        None => (t.nbytes, pb::Coding::None as i32, 0, 0),
        Some(c) => (
            c.decoded_nbytes,
            coding_to_pb(c.coding) as i32,
            t.nbytes,
            c.lanes,
        ),
    }
}

pub fn coding_to_pb(c: Coding) -> pb::Coding {
    match c {
        Coding::None => pb::Coding::None,
        Coding::Rans8 => pb::Coding::Rans8,
    }
}

pub fn coding_from_pb(value: i32) -> Option<Coding> {
    Some(match pb::Coding::try_from(value).ok()? {
        pb::Coding::None => Coding::None,
        pb::Coding::Rans8 => Coding::Rans8,
    })
}

pub fn retention_from_pb(value: i32) -> Option<Retention> {
    Some(match pb::Retention::try_from(value).ok()? {
        pb::Retention::Cached => Retention::Cached,
        pb::Retention::Connection => Retention::Connection,
        pb::Retention::Pinned => Retention::Pinned,
    })
}

pub fn dtype_from_pb(value: i32) -> Option<DType> {
    DType::ALL
        .into_iter()
        .find(|d| dtype_to_pb(*d) as i32 == value)
}

/// GetInfo: the backend, its devices, the limits requests are checked against, and the
/// quotas with what `uid` (the caller) and the daemon hold against them.
pub fn info(d: &Daemon, uid: u32) -> pb::GetInfoResponse {
    let l = &d.config.limits;
    let (q, host) = (&d.config.quotas, d.store.host_quota());
    let host_use = d.store.host_use(uid);
    let (sessions, mut device_bytes) = d.ledger.usage(uid);
    let (daemon_sessions, mut daemon_device_bytes) = d.ledger.totals();
    // Ended sessions' memory that clients still hold is charged too.
    for (device, total) in daemon_device_bytes.iter_mut().enumerate() {
        let held = d.held_device(uid, device);
        *total += held.total.bytes;
        if device == 0 {
            device_bytes += held.uid.bytes;
        }
    }
    pb::GetInfoResponse {
        version: env!("CARGO_PKG_VERSION").to_string(),
        backend: match d.backend.kind() {
            BackendKind::Host => pb::Backend::Host,
            BackendKind::Cuda => pb::Backend::Cuda,
        } as i32,
        devices: d
            .backend
            .devices()
            .into_iter()
            .map(|x| pb::Device {
                uuid: x.uuid,
                name: x.name,
                total_memory: x.total_memory,
                free_memory: x.free_memory,
                pci_bus_id: x.pci_bus_id,
                copy_bandwidth_limit: d.config.copy_bandwidth_limit.map_or(0, |r| r.get()),
            })
            .collect(),
        limits: Some(pb::Limits {
            max_message_bytes: l.max_message_bytes,
            max_tensors_per_model: l.max_tensors_per_model,
            max_groups_per_session: l.max_groups_per_session,
            max_plan_length: l.max_plan_length,
            max_live_tickets: l.max_live_tickets,
            max_waiting_grants: l.max_waiting_grants,
            max_upload_bytes: l.max_upload_bytes,
            max_sessions: l.max_sessions,
            max_name_bytes: l.max_name_bytes,
            max_uploads: l.max_uploads,
            max_state_region_bytes: l.max_state_region_bytes,
            max_state_regions_per_session: l.max_state_regions_per_session,
        }),
        alignment: d.backend.alignment(),
        quotas: Some(pb::Quotas {
            per_uid_sessions: q.per_uid_sessions,
            per_uid_device_bytes: q.per_uid_device_bytes,
            per_uid_host_bytes: host.per_uid_bytes,
            per_uid_uploads: host.per_uid_uploads,
            max_host_bytes: host.max_bytes,
            max_device_bytes: d.ledger.device_limits(),
        }),
        usage: Some(pb::QuotaUse {
            uid,
            sessions,
            device_bytes,
            host_bytes: host_use.uid_bytes,
            uploads: host_use.uid_uploads,
            daemon_sessions,
            daemon_host_bytes: host_use.total_bytes,
            daemon_uploads: host_use.total_uploads,
            daemon_device_bytes,
            state_bytes: host_use.uid_state_bytes,
            daemon_state_bytes: host_use.total_state_bytes,
        }),
    }
}

/// BeginUpload: where each tensor goes, and the secret that fetches the region's fd.
pub fn upload_begun(ticket: UploadTicket, fd_secret: String) -> pb::BeginUploadResponse {
    pb::BeginUploadResponse {
        upload_id: ticket.upload_id,
        fd_secret,
        size: ticket.size,
        tensors: ticket
            .tensors
            .into_iter()
            .map(|t| pb::UploadTensor {
                name: t.name,
                offset: t.offset,
                nbytes: t.nbytes,
            })
            .collect(),
    }
}

pub fn manifest(model: &Model, entry: Option<&ModelEntry>) -> pb::ModelManifest {
    pb::ModelManifest {
        model_id: model.id.clone(),
        name: model.name.clone(),
        tensors: model
            .tensors
            .iter()
            .map(|t| {
                let (quantization, scale_shape, scale_offset) = quantized_fields(t);
                let (nbytes, coding, stored_nbytes, coded_lanes) = coded_fields(t);
                pb::TensorInfo {
                    name: t.name.clone(),
                    dtype: dtype_to_pb(t.dtype) as i32,
                    shape: t.shape.clone(),
                    nbytes,
                    coding,
                    stored_nbytes,
                    coded_lanes,
                    quantization,
                    scale_shape,
                    scale_offset,
                    format: t
                        .label
                        .as_ref()
                        .map_or_else(String::new, |l| l.name.clone()),
                    weights: t.label.as_ref().map_or(0, |l| l.weights),
                }
            })
            .collect(),
        formats: formats(&model.tensors)
            .into_iter()
            .map(|f| pb::FormatUse {
                format: f.name,
                tensors: f.tensors,
                bytes: f.bytes,
                weights: f.weights,
            })
            .collect(),
        total_bytes: model.total_bytes,
        refcount: entry.map_or(0, |e| e.refs),
        sessions: entry.map_or(0, |e| e.sessions),
        pinned: entry.map_or(0, ModelEntry::pinned),
        cached: entry.is_some_and(ModelEntry::cached),
        source: match model.source {
            ModelSource::File => "file",
            ModelSource::Upload => "upload",
        }
        .to_string(),
        phases: None,
    }
}

/// The manifest a load or a commit returns: the model's, with where the call's time went.
pub fn stored_manifest(stored: &Stored, entry: Option<&ModelEntry>) -> pb::ModelManifest {
    pb::ModelManifest {
        phases: Some(phases(&stored.phases)),
        ..manifest(&stored.model, entry)
    }
}

fn phases(p: &Phases) -> pb::StorePhases {
    let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    pb::StorePhases {
        alloc_ns: ns(p.alloc),
        read_ns: ns(p.read),
        seal_ns: ns(p.seal),
        quantize_ns: ns(p.quantize),
        code_ns: ns(p.code),
        hash_ns: ns(p.hash),
        pin_ns: ns(p.pin),
        total_ns: ns(p.total),
        input_bytes: p.input_bytes,
    }
}

pub fn region(index: usize, size: u64, handle: &RegionHandle) -> pb::Region {
    pb::Region {
        index: index as u32,
        size,
        handle: Some(match handle {
            RegionHandle::FdSecret(s) => pb::region::Handle::FdSecret(s.clone()),
            RegionHandle::CudaIpc(h) => pb::region::Handle::CudaIpcHandle(h.clone()),
        }),
    }
}

pub fn opened(o: &OpenedSession) -> pb::OpenSessionResponse {
    pb::OpenSessionResponse {
        session_id: o.shared.id.clone(),
        regions: o
            .regions
            .iter()
            .enumerate()
            .map(|(i, (size, handle))| region(i, *size, handle))
            .collect(),
        groups: o
            .groups
            .iter()
            .zip(&o.resident)
            .enumerate()
            .map(|(i, (g, resident))| pb::GroupLayout {
                group: i as u32,
                name: g.name.clone(),
                nbytes: g.nbytes,
                resident: *resident,
                tensors: g
                    .tensors
                    .iter()
                    .map(|&(t, offset)| {
                        let t = &o.model.tensors[t];
                        let (quantization, scale_shape, scale_offset) = quantized_fields(t);
                        let (nbytes, coding, stored_nbytes, coded_lanes) = coded_fields(t);
                        pb::TensorPlacement {
                            name: t.name.clone(),
                            dtype: dtype_to_pb(t.dtype) as i32,
                            shape: t.shape.clone(),
                            offset,
                            nbytes,
                            coding,
                            stored_nbytes,
                            coded_lanes,
                            quantization,
                            scale_shape,
                            scale_offset,
                        }
                    })
                    .collect(),
            })
            .collect(),
        staging_bytes: o.shared.staging_bytes,
        resident_bytes: o.shared.resident_bytes,
        event_handles: o.event_handles.clone(),
        accepts_gpu_wait: true,
        paces_client_copies: o.paces_client_copies,
        max_grant_bytes: o.shared.max_grant_bytes(),
    }
}

pub fn session_stats(s: &StatsSnapshot) -> pb::SessionStats {
    pb::SessionStats {
        acquires: s.acquires,
        hits: s.hits,
        reuses: s.reuses,
        misses: s.misses,
        resident_hits: s.resident_hits,
        bytes_copied: s.bytes_copied,
        bytes_from_device: s.bytes_from_device,
        copies: s.copies,
        prefetches: s.prefetches,
        acquire_pending_ns: s.acquire_pending_ns,
        resyncs: s.resyncs,
        releases: s.releases,
        evictions: s.evictions,
        gpu_wait_ns: s.gpu_wait_ns,
        gpu_waits: s.gpu_waits,
        gpu_wait_reports: s.gpu_wait_reports,
        granted_h2d_bytes: s.granted_h2d_bytes,
        granted_d2h_bytes: s.granted_d2h_bytes,
        kinds: PassKind::ALL
            .iter()
            .map(|&kind| {
                let k = &s.kinds[kind.index()];
                pb::PassStats {
                    kind: pass_kind(kind) as i32,
                    acquires: k.acquires,
                    hits: k.hits,
                    misses: k.misses,
                    bytes_copied: k.bytes_copied,
                    gpu_wait_ns: k.gpu_wait_ns,
                    gpu_waits: k.gpu_waits,
                }
            })
            .collect(),
    }
}

fn pass_kind(kind: PassKind) -> pb::PassKind {
    match kind {
        PassKind::Train => pb::PassKind::Train,
        PassKind::Sample => pb::PassKind::Sample,
    }
}

pub fn session_info(owner: &Peer, s: &SessionShared, state: StateUse) -> pb::SessionInfo {
    use std::sync::atomic::Ordering::Relaxed;
    pb::SessionInfo {
        session_id: s.id.clone(),
        model_id: s.model_id.clone(),
        device_uuid: s.device_uuid.clone(),
        label: s.label.clone(),
        peer_uid: owner.uid,
        peer_gid: owner.gid,
        peer_pid: owner.pid,
        vram_budget: s.vram_budget,
        staging_bytes: s.staging_bytes,
        resident_bytes: s.resident_bytes,
        attached: s.attached.load(Relaxed),
        plan_length: s.plan_len.load(Relaxed),
        live_tickets: s.live_tickets.load(Relaxed),
        stats: Some(session_stats(&s.stats.snapshot())),
        age_ms: s.created.elapsed().as_millis() as u64,
        group_acquire_pending_ns: s.stats.group_acquire_pending_ns(),
        group_gpu_wait_ns: s.stats.group_gpu_wait_ns(),
        state_bytes: state.bytes,
        state_regions: state.regions,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    use super::*;
    use crate::session::pending::Pending;
    use crate::session::{GpuWaitReport, SessionStats};

    #[test]
    fn session_info_lists_pending_and_gpu_wait_per_group() {
        let (control, _control_rx) = tokio::sync::mpsc::unbounded_channel();
        let (_finished_tx, finished) = tokio::sync::watch::channel(false);
        let shared = SessionShared {
            id: "s-3".into(),
            number: 3,
            model_id: "m".into(),
            device: 0,
            device_uuid: "host-0".into(),
            label: "l".into(),
            vram_budget: 10,
            staging_bytes: 8,
            resident_bytes: 2,
            created: Instant::now(),
            stats: SessionStats::new(3),
            attached: AtomicBool::new(true),
            plan_len: Default::default(),
            live_tickets: Default::default(),
            control,
            finished,
        };
        shared.stats.add_pending(Pending { group: 2, ns: 70 });
        shared.stats.add_pending(Pending { group: 0, ns: 5 });
        shared.stats.record_gpu_wait(
            &GpuWaitReport {
                total_ns: 9,
                waits: 2,
                group_ns: vec![0, 9],
            },
            PassKind::Sample,
        );
        shared.live_tickets.store(4, Ordering::Relaxed);
        let owner = Peer {
            conn: 1,
            uid: 2,
            gid: 3,
            pid: 4,
        };
        let state = StateUse {
            bytes: 8192,
            regions: 2,
        };
        let info = session_info(&owner, &shared, state);
        assert_eq!((info.state_bytes, info.state_regions), (8192, 2));
        assert_eq!(info.group_acquire_pending_ns, vec![5, 0, 70]);
        assert_eq!(info.group_gpu_wait_ns, vec![0, 9, 0]);
        let stats = info.stats.unwrap();
        assert_eq!(stats.acquire_pending_ns, 75);
        assert_eq!(
            (stats.gpu_wait_ns, stats.gpu_waits, stats.gpu_wait_reports),
            (9, 2, 1)
        );
        let kinds: Vec<_> = (stats.kinds.iter())
            .map(|k| (k.kind(), k.gpu_wait_ns, k.gpu_waits))
            .collect();
        assert_eq!(
            kinds,
            vec![(pb::PassKind::Train, 0, 0), (pb::PassKind::Sample, 9, 2)]
        );
        assert_eq!(
            (
                info.peer_uid,
                info.peer_gid,
                info.peer_pid,
                info.live_tickets
            ),
            (2, 3, 4, 4)
        );
    }
}
