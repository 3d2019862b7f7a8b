//! Conversions from the core's types to the wire's (errors: see status.rs).
#![forbid(unsafe_code)]

use weightstream_client::proto as pb;

use crate::backend::RegionHandle;
use crate::core::OpenedSession;
use crate::store::safetensors::DType;
use crate::store::{Model, ModelEntry, ModelSource};

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
