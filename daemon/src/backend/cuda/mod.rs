//! CUDA backend: page-locked shared store, IPC-exported staging and resident memory, and an
//! event-ordered copy pipeline on one high-priority stream per device.
//!
//! Only this module calls FFI (through `ffi`). Copies run on each device's copy thread (the
//! scheduler's), which binds the device's primary context before every job; allocation and
//! teardown bind it on whatever thread they run on.
#![allow(unsafe_code)]

mod ffi;

use std::any::Any;
use std::sync::{Arc, Mutex};

use self::ffi::{CudaError, Device, DeviceAlloc, IpcEvent};
use super::{
    Backend, BackendError, BackendKind, CopyJob, DeviceInfo, DeviceRegion, EventPool, RegionHandle,
};
use crate::mem::{HostPinner, PinError, PinGuard};

/// IPC exports share whole allocations: round every one to 2 MiB.
const ALLOC_ALIGN: u64 = 2 << 20;
/// Offsets inside regions: what tensor views and copy engines like.
const ALIGNMENT: u64 = 256;

pub struct CudaBackend {
    devices: Vec<Arc<Device>>,
}

fn copy_err(e: CudaError) -> BackendError {
    BackendError::Copy(e.to_string())
}

impl CudaBackend {
    /// Opens every device, or says why CUDA cannot be used (never panics).
    pub fn new() -> Result<CudaBackend, String> {
        let count = ffi::probe()?;
        let devices = (0..count)
            .map(|i| Device::open(i).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        for d in &devices {
            tracing::info!(ordinal = d.ordinal, uuid = %d.uuid, name = %d.name,
                pci = %d.pci_bus_id, memory = d.total_memory, "CUDA device");
        }
        Ok(CudaBackend { devices })
    }
}

/// A staging or resident region: a cuMemAlloc allocation exported once by IPC.
struct CudaRegion {
    device: Arc<Device>,
    alloc: Mutex<Option<DeviceAlloc>>,
    ptr: u64,
    size: u64,
    handle: [u8; 64],
}

impl DeviceRegion for CudaRegion {
    fn size(&self) -> u64 {
        self.size
    }

    fn handle(&self) -> RegionHandle {
        RegionHandle::CudaIpc(self.handle.to_vec())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaRegion {
    /// Copies into the region may still be queued on the device's streams: wait for them, then
    /// free. (Clients close their mappings before closing the session; a dead client's
    /// mappings died with it.)
    fn drop(&mut self) {
        let alloc = self.alloc.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(alloc) = alloc else { return };
        let freed = self.device.sync_copies().and_then(|()| alloc.free());
        if let Err(e) = freed {
            tracing::error!(error = %e, "freeing a device region failed");
        }
    }
}

struct CudaEvents {
    device: Arc<Device>,
    events: Vec<IpcEvent>,
    handles: Vec<Vec<u8>>,
}

impl EventPool for CudaEvents {
    fn len(&self) -> u32 {
        self.events.len() as u32
    }

    fn handles(&self) -> Vec<Vec<u8>> {
        self.handles.clone()
    }

    fn is_complete(&self, index: u32) -> bool {
        match self.event(index) {
            Ok(e) => self.device.bind().is_ok() && ffi::query_event(e.0.0),
            Err(_) => true,
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl CudaEvents {
    fn event(&self, index: u32) -> Result<&IpcEvent, BackendError> {
        (index as usize)
            .checked_sub(1)
            .and_then(|i| self.events.get(i))
            .ok_or_else(|| BackendError::Copy(format!("event index {index} out of range")))
    }
}

impl Drop for CudaEvents {
    fn drop(&mut self) {
        if let Err(e) = self.device.bind() {
            tracing::error!(error = %e, "cannot bind the context to destroy events");
        }
        self.events.clear();
    }
}

/// Keeps host chunks registered; unregisters them (before the mapping goes) on drop.
struct Pinned {
    device: Arc<Device>,
    chunks: Vec<usize>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.device.bind();
        for &ptr in &self.chunks {
            if let Err(e) = ffi::host_unregister(ptr) {
                tracing::error!(error = %e, "cuMemHostUnregister failed");
            }
        }
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.devices
            .iter()
            .map(|d| DeviceInfo {
                uuid: d.uuid.clone(),
                name: d.name.clone(),
                total_memory: d.total_memory,
                free_memory: d.free_memory().unwrap_or(0),
                pci_bus_id: d.pci_bus_id.clone(),
            })
            .collect()
    }

    fn alignment(&self) -> u64 {
        ALIGNMENT
    }

    fn alloc_region(
        &self,
        device: usize,
        size: u64,
        purpose: &'static str,
    ) -> Result<Arc<dyn DeviceRegion>, BackendError> {
        let d = &self.devices[device];
        let fail = |e: CudaError| BackendError::Alloc {
            device: d.uuid.clone(),
            bytes: size,
            purpose,
            reason: e.to_string(),
        };
        d.bind().map_err(fail)?;
        let bytes = size.max(1).div_ceil(ALLOC_ALIGN) * ALLOC_ALIGN;
        let alloc = DeviceAlloc::new(bytes as usize).map_err(fail)?;
        let handle = alloc.ipc_handle().map_err(fail)?;
        Ok(Arc::new(CudaRegion {
            device: d.clone(),
            ptr: alloc.ptr,
            alloc: Mutex::new(Some(alloc)),
            size,
            handle,
        }))
    }

    fn copy(&self, device: usize, job: &CopyJob) -> Result<(), BackendError> {
        let d = &self.devices[device];
        d.bind().map_err(copy_err)?;
        let pool = match &job.events {
            Some(p) => p.as_any().downcast_ref::<CudaEvents>(),
            None => None,
        };
        let event = |i: u32| match pool {
            Some(p) => p.event(i).map(|e| e.0.0),
            None => Err(BackendError::Copy(
                "job names events but has no pool".into(),
            )),
        };
        let stream = d.copy.0;
        // The scheduler runs jobs once their events are complete; a wait is queued only for
        // one that is not (it keeps the order correct, at the cost measured in the README).
        for &w in &job.wait {
            if !pool.is_some_and(|p| p.is_complete(w)) {
                ffi::wait_event(stream, event(w)?).map_err(copy_err)?;
            }
        }
        let region = job
            .region
            .as_any()
            .downcast_ref::<CudaRegion>()
            .ok_or_else(|| BackendError::Copy("not a CUDA region".into()))?;
        for (src, offset) in &job.spans {
            let len = src.len() as u64;
            if offset + len > region.size {
                return Err(BackendError::OutOfBounds {
                    offset: *offset,
                    bytes: len,
                    size: region.size,
                });
            }
            ffi::copy_h2d(region.ptr + offset, src.bytes(), stream).map_err(copy_err)?;
        }
        if let Some(r) = job.record {
            ffi::record_event(stream, event(r)?).map_err(copy_err)?;
        }
        if job.synchronous {
            ffi::sync_stream(stream).map_err(copy_err)?;
        }
        Ok(())
    }

    fn synchronize(&self, device: usize) -> Result<(), BackendError> {
        self.devices[device].sync_copies().map_err(copy_err)
    }

    fn event_pool(
        &self,
        device: usize,
        count: u32,
    ) -> Result<Option<Arc<dyn EventPool>>, BackendError> {
        let d = &self.devices[device];
        let fail = |e: CudaError| BackendError::Events {
            count,
            reason: e.to_string(),
        };
        d.bind().map_err(fail)?;
        let mut events = Vec::with_capacity(count as usize);
        let mut handles = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (event, handle) = IpcEvent::new().map_err(fail)?;
            events.push(event);
            handles.push(handle.to_vec());
        }
        Ok(Some(Arc::new(CudaEvents {
            device: d.clone(),
            events,
            handles,
        })))
    }
}

impl HostPinner for CudaBackend {
    /// Registers the chunks in parallel (registration runs at ~2 GB/s per thread).
    fn pin_host(&self, chunks: &[(usize, usize)]) -> Result<Option<PinGuard>, PinError> {
        let d = self.devices[0].clone();
        let total: usize = chunks.iter().map(|c| c.1).sum();
        let results: Vec<Result<usize, CudaError>> = std::thread::scope(|scope| {
            let workers = std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .min(8);
            let per = chunks.len().div_ceil(workers.max(1)).max(1);
            let handles: Vec<_> = chunks
                .chunks(per)
                .map(|part| {
                    let d = d.clone();
                    scope.spawn(move || {
                        part.iter()
                            .map(|&(ptr, len)| {
                                d.bind()?;
                                ffi::host_register(ptr, len).map(|()| ptr)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut pinned = Pinned {
            device: d,
            chunks: Vec::new(),
        };
        let mut failure = None;
        for r in results {
            match r {
                Ok(ptr) => pinned.chunks.push(ptr),
                Err(e) => failure = Some(e),
            }
        }
        if pinned.chunks.len() < chunks.len() && failure.is_none() {
            failure = Some(CudaError {
                call: "cuMemHostRegister_v2",
                code: -1,
                name: "worker".into(),
                text: "a registration thread panicked".into(),
            });
        }
        match failure {
            // Dropping `pinned` unregisters what did succeed.
            Some(e) => Err(PinError {
                bytes: total as u64,
                reason: e.to_string(),
            }),
            None => Ok(Some(Box::new(pinned))),
        }
    }
}
