//! Conversions between the core's types and the wire's, and errors to gRPC statuses.
#![forbid(unsafe_code)]

use tonic::Status;
use weightstream_client::proto as pb;

use crate::backend::{BackendError, RegionHandle};
use crate::core::{CoreError, OpenedSession, Peer};
use crate::session::{AttachError, SessionShared, StatsSnapshot};
use crate::store::safetensors::DType;
use crate::store::{Model, ModelEntry, ModelSource, SourceError, StoreError};

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

pub fn dtype_from_pb(value: i32) -> Option<DType> {
    DType::ALL
        .into_iter()
        .find(|d| dtype_to_pb(*d) as i32 == value)
}

pub fn manifest(model: &Model, entry: Option<&ModelEntry>) -> pb::ModelManifest {
    pb::ModelManifest {
        model_id: model.id.clone(),
        name: model.name.clone(),
        tensors: model
            .tensors
            .iter()
            .map(|t| pb::TensorInfo {
                name: t.name.clone(),
                dtype: dtype_to_pb(t.dtype) as i32,
                shape: t.shape.clone(),
                nbytes: t.nbytes,
            })
            .collect(),
        total_bytes: model.total_bytes,
        refcount: entry.map_or(0, |e| e.refs),
        sessions: entry.map_or(0, |e| e.sessions),
        source: match model.source {
            ModelSource::File => "file",
            ModelSource::Upload => "upload",
        }
        .to_string(),
    }
}

pub fn region(index: usize, size: u64, handle: &RegionHandle) -> pb::Region {
    pb::Region {
        index: index as u32,
        size,
        handle: Some(match handle {
            RegionHandle::ShmPath(p) => pb::region::Handle::ShmPath(p.clone()),
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
                        pb::TensorPlacement {
                            name: t.name.clone(),
                            dtype: dtype_to_pb(t.dtype) as i32,
                            shape: t.shape.clone(),
                            offset,
                            nbytes: t.nbytes,
                        }
                    })
                    .collect(),
            })
            .collect(),
        staging_bytes: o.shared.staging_bytes,
        resident_bytes: o.shared.resident_bytes,
        event_handles: o.event_handles.clone(),
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
        copies: s.copies,
        prefetches: s.prefetches,
        stall_ns: s.stall_ns,
        resyncs: s.resyncs,
        releases: s.releases,
        evictions: s.evictions,
    }
}

pub fn session_info(owner: &Peer, s: &SessionShared) -> pb::SessionInfo {
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
        group_stall_ns: s.stats.group_stall_ns(),
    }
}

/// The gRPC status for a refused attach.
pub fn attach_status(e: &AttachError) -> Status {
    match e {
        AttachError::AlreadyAttached(_) => Status::failed_precondition(e.to_string()),
    }
}

/// The gRPC status for a core error: the code says what kind, the message names the field.
pub fn status_of(e: &CoreError) -> Status {
    let msg = e.to_string();
    match e {
        CoreError::Store(s) => match s {
            StoreError::Source(SourceError::NotFound(_)) => {
                Status::not_found(format!("paths: {msg}"))
            }
            StoreError::Source(_) => Status::invalid_argument(format!("paths: {msg}")),
            StoreError::Header { .. }
            | StoreError::DuplicateTensor { .. }
            | StoreError::TooManyTensors { .. } => Status::invalid_argument(msg),
            StoreError::Io { .. } | StoreError::UploadTruncated { .. } => {
                Status::failed_precondition(msg)
            }
            StoreError::Arena { .. } | StoreError::UploadTooLarge { .. } => {
                Status::resource_exhausted(msg)
            }
            StoreError::UnknownModel(_) | StoreError::UnknownUpload(_) => Status::not_found(msg),
            StoreError::NotOwner(_) | StoreError::NotHolder { .. } => {
                Status::permission_denied(msg)
            }
            StoreError::Quota(_) => Status::resource_exhausted(msg),
            StoreError::Pin(_) => Status::resource_exhausted(msg),
        },
        CoreError::Layout(_) | CoreError::Budget(_) => Status::invalid_argument(msg),
        CoreError::Backend(BackendError::Alloc { .. }) => Status::resource_exhausted(msg),
        CoreError::Backend(_) | CoreError::Residency(_) => Status::internal(msg),
        CoreError::UnknownSession(_) | CoreError::UnknownDevice(_) => Status::not_found(msg),
        CoreError::NotOwner(_) => Status::permission_denied(msg),
        CoreError::TooManySessions(_) | CoreError::Quota(_) => Status::resource_exhausted(msg),
        CoreError::ShuttingDown => Status::unavailable(msg),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    use super::*;
    use crate::session::SessionStats;
    use crate::session::stall::Stall;

    #[test]
    fn session_info_lists_stall_per_group() {
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
        shared.stats.add_stall(Stall { group: 2, ns: 70 });
        shared.stats.add_stall(Stall { group: 0, ns: 5 });
        shared.live_tickets.store(4, Ordering::Relaxed);
        let owner = Peer {
            conn: 1,
            uid: 2,
            gid: 3,
            pid: 4,
        };
        let info = session_info(&owner, &shared);
        assert_eq!(info.group_stall_ns, vec![5, 0, 70]);
        assert_eq!(info.stats.map(|s| s.stall_ns), Some(75));
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
