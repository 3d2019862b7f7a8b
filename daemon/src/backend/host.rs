//! Host backend: "device" memory is a memfd the client maps read-only, a copy is a memcpy.
//! It keeps the same messages and ordering as the CUDA backend so that every test of the
//! protocol, the store and the sessions runs on machines without a GPU.

use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{
    Backend, BackendError, BackendKind, CopyJob, CopyTiming, DeviceInfo, DeviceRegion, EventPool,
    RegionExport,
};
use crate::mem::shm::{Memfd, Shm, ShmSegment};
use crate::mem::{HostPinner, PinAccess, PinError, PinGuard};

pub const HOST_DEVICE_UUID: &str = "host-0";
const ALIGNMENT: u64 = 256;

pub struct HostBackend {
    shm: Arc<Shm>,
}

impl HostBackend {
    pub fn new(shm: Arc<Shm>) -> Self {
        HostBackend { shm }
    }
}

/// A staging or resident region in shared memory. The mutex serialises writers; clients read
/// through their own read-only mapping and are ordered by the `Staged`/`Release` messages.
struct HostRegion {
    segment: Mutex<ShmSegment>,
    size: u64,
    memfd: Arc<Memfd>,
}

impl HostRegion {
    /// Writes `src` at `offset` and returns how long the memcpy took. Runs only on the device's
    /// copy thread.
    fn write(&self, offset: u64, src: &[u8]) -> Result<Duration, BackendError> {
        let end = offset.checked_add(src.len() as u64);
        if end.is_none_or(|end| end > self.size) {
            return Err(BackendError::OutOfBounds {
                offset,
                bytes: src.len() as u64,
                size: self.size,
            });
        }
        let mut segment = self
            .segment
            .lock()
            .map_err(|_| BackendError::Copy("region lock poisoned".into()))?;
        let start = offset as usize;
        let bytes = segment
            .bytes_mut()
            .ok_or_else(|| BackendError::Copy("the region is read-only".into()))?;
        let dst = &mut bytes[start..start + src.len()];
        let began = Instant::now();
        dst.copy_from_slice(src);
        Ok(began.elapsed())
    }
}

impl DeviceRegion for HostRegion {
    fn size(&self) -> u64 {
        self.size
    }

    fn export(&self) -> RegionExport {
        RegionExport::Memfd(self.memfd.clone())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        let (total, free) = host_memory();
        vec![DeviceInfo {
            uuid: HOST_DEVICE_UUID.to_string(),
            name: "host memory (no GPU)".to_string(),
            total_memory: total,
            free_memory: free,
            pci_bus_id: String::new(),
        }]
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
        let alloc_error = |e: std::io::Error| BackendError::Alloc {
            device: device.to_string(),
            bytes: size,
            purpose,
            reason: e.to_string(),
        };
        let segment = self.shm.create(purpose, size).map_err(alloc_error)?;
        // Clients get read-only fds; sealed, not even one reopened read-write can write it.
        segment.memfd().forbid_new_writers().map_err(alloc_error)?;
        Ok(Arc::new(HostRegion {
            memfd: segment.memfd().clone(),
            segment: Mutex::new(segment),
            size,
        }))
    }

    /// Copies synchronously and reports the time spent copying (only the memcpy: not the time
    /// the job waited in the queue, nor the lookup and bounds checks).
    fn copy(&self, _device: usize, job: CopyJob) -> Result<CopyTiming, BackendError> {
        let region = job
            .region
            .as_any()
            .downcast_ref::<HostRegion>()
            .ok_or_else(|| BackendError::Copy("not a host region".into()))?;
        job.check_bounds()?;
        let mut busy = Duration::ZERO;
        for (src, dst_offset) in &job.spans {
            busy += region.write(*dst_offset, src.bytes())?;
        }
        // Within the device: not the link's time (a copy thread's memcpy all the same).
        for (src, dst_offset) in &job.from_device {
            let from = (src.region.as_any().downcast_ref::<HostRegion>())
                .ok_or_else(|| BackendError::Copy("not a host region".into()))?;
            if std::ptr::eq(from, region) {
                return Err(BackendError::Copy("a region copied into itself".into()));
            }
            let segment = from
                .segment
                .lock()
                .map_err(|_| BackendError::Copy("region lock poisoned".into()))?;
            let (start, len) = (src.offset as usize, src.len as usize);
            region.write(*dst_offset, &segment.bytes()[start..start + len])?;
        }
        Ok(CopyTiming::Done(busy))
    }

    fn synchronize(&self, _device: usize) -> Result<(), BackendError> {
        Ok(()) // host copies are complete when `copy` returns
    }

    fn event_pool(
        &self,
        _device: usize,
        _count: u32,
    ) -> Result<Option<Arc<dyn EventPool>>, BackendError> {
        Ok(None)
    }
}

impl HostPinner for HostBackend {
    /// Nothing to lock: host copies are memcpys.
    fn pin_host(
        &self,
        _chunks: &[(usize, usize)],
        _access: PinAccess,
    ) -> Result<Option<PinGuard>, PinError> {
        Ok(None)
    }
}

/// (total, available) bytes of host memory from /proc/meminfo; zeros where it is unreadable.
pub fn host_memory() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::DeviceSlice;
    use crate::mem::HostSlice;
    use crate::mem::filled_for_tests;

    const MIB: usize = 1 << 20;

    /// A host backend and a 1 MiB source (the slice keeps its arena).
    pub(crate) fn backend_and_tensor() -> (Arc<HostBackend>, HostSlice) {
        let shm = Shm::new();
        let backend = Arc::new(HostBackend::new(shm.clone()));
        let tensor = filled_for_tests(&shm, &vec![7u8; MIB], backend.as_ref());
        (backend, tensor)
    }

    /// `len` bytes at `at` of a host region.
    pub(crate) fn read_region(region: &Arc<dyn DeviceRegion>, at: u64, len: u64) -> Vec<u8> {
        let host = region.as_any().downcast_ref::<HostRegion>().unwrap();
        let segment = host.segment.lock().unwrap();
        segment.bytes()[at as usize..(at + len) as usize].to_vec()
    }

    /// A copy within the device reads its source region where it says and writes where it
    /// says; a source range past its region, or a region copied into itself, is refused.
    #[test]
    fn a_copy_within_the_device_moves_the_bytes_it_names() {
        let (backend, _) = backend_and_tensor();
        let shm = Shm::new();
        let pattern: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
        let source = filled_for_tests(&shm, &pattern, backend.as_ref());
        let resident = backend.alloc_region(0, MIB as u64, "resident").unwrap();
        backend
            .copy(0, CopyJob::copy(resident.clone(), vec![(source, 0)]))
            .unwrap();
        let staging = backend.alloc_region(0, MIB as u64, "staging").unwrap();
        let from = |offset: u64, len: u64, region: &Arc<dyn DeviceRegion>| DeviceSlice {
            region: region.clone(),
            offset,
            len,
        };
        let job = CopyJob::within(staging.clone(), from(1000, 5000, &resident), 300);
        assert_eq!(job.bytes(), 5000);
        assert_eq!(job.link_bytes(), 0);
        backend.copy(0, job).unwrap();
        assert_eq!(read_region(&staging, 300, 5000), pattern[1000..6000]);
        assert_eq!(read_region(&staging, 0, 300), vec![0; 300]);

        let past = CopyJob::within(staging.clone(), from(MIB as u64 - 10, 20, &resident), 0);
        let e = backend.copy(0, past).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "copy of 20 bytes from offset {} reads past the {MIB}-byte source region",
                MIB - 10
            )
        );
        let itself = CopyJob::within(staging.clone(), from(0, 10, &staging), 100);
        let e = backend.copy(0, itself).unwrap_err().to_string();
        assert_eq!(e, "copy failed: a region copied into itself");
    }

    #[test]
    fn a_copy_reports_the_time_its_memcpy_took() {
        let (backend, tensor) = backend_and_tensor();
        let region = backend.alloc_region(0, MIB as u64, "staging").unwrap();
        let began = Instant::now();
        let timing = backend.copy(0, CopyJob::copy(region, vec![(tensor, 0)]));
        let wall = began.elapsed();
        match timing {
            Ok(CopyTiming::Done(busy)) => {
                assert!(!busy.is_zero() && busy <= wall, "{busy:?} of {wall:?}");
            }
            other => panic!("{other:?}"),
        }
    }
}
