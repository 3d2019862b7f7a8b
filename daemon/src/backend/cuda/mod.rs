//! CUDA backend: page-locked shared store, IPC-exported staging and resident memory, and an
//! event-ordered copy pipeline on one high-priority stream per device.
//!
//! Layered as cudarc is: `ffi` holds the driver calls as `unsafe fn`s returning `Result`,
//! `safe` the RAII types over them, and this file the `Backend`, in safe code only.
//!
//! Who owns what (every owner holds an `Arc<Context>` and binds it before freeing):
//! - `Device`: the device's primary `Context`, its `CopyStream`, and the copy batches the
//!   stream has not been seen to pass (`InFlight`, owning their `HostSlice` sources) with the
//!   timing events to reuse.
//! - `CudaRegion`: a `DeviceAlloc` (cuMemAlloc, 2 MiB-rounded, exported once by IPC).
//! - `CudaEvents`: a session's `IpcEvent`s (interprocess, exported once).
//! - `Pinned` (the store's `PinGuard`): `HostRegistration`s of an arena's chunks.
//!
//! Threads: each device's copy thread (the scheduler's) binds the device's context in every
//! stream call, event query and poll; allocation, registration workers and teardown bind it on
//! whatever thread they run on (every `safe` call binds first, so no thread relies on what it
//! had bound before).

#[allow(unsafe_code)]
mod ffi;
#[allow(unsafe_code)]
mod safe;

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use self::ffi::CudaError;
use self::safe::{
    Context, CopySource, CopyStream, Description, DeviceAlloc, HostRegistration, InFlight,
    IpcEvent, TimingPair,
};
use super::{
    Backend, BackendError, BackendKind, CopyJob, CopyPoll, CopyTiming, DeviceInfo, DeviceRegion,
    EventPool, RegionExport,
};
use crate::mem::{HostPinner, HostSlice, PinAccess, PinError, PinGuard};

/// IPC exports share whole allocations: round every one to 2 MiB.
const ALLOC_ALIGN: u64 = 2 << 20;
/// Offsets inside regions: what tensor views and copy engines like.
const ALIGNMENT: u64 = 256;

pub struct CudaBackend {
    devices: Vec<Device>,
}

/// One device: its context, its copy stream, and the copies queued on it.
struct Device {
    ctx: Arc<Context>,
    about: Description,
    stream: Arc<CopyStream>,
    copies: Mutex<Copies>,
}

/// Copy batches not yet seen complete, oldest first (one in-order stream, so they complete in
/// this order), and what the device time of completed ones adds up to so far.
///
/// A batch owns its `HostSlice`s, and through them their arena and its page-lock registration,
/// until the stream has passed its end event. The job itself goes as soon as the copy is
/// queued, and the model may be released at that moment (a session torn down, the last
/// reference gone): when the job held the only `HostSlice`s, that unlocked and unmapped the
/// pages while the DMA still read them.
/// `poll_copies` releases batches on the copy thread without blocking; a batch dropped any
/// other way (teardown, an error) waits for the stream first (`safe::Held`).
#[derive(Default)]
struct Copies {
    in_flight: VecDeque<InFlight<HostSlice>>,
    spare: Vec<TimingPair>,
    busy: Duration,
}

impl Copies {
    /// Retires the batches the stream has passed; returns whether any remain.
    fn reap(&mut self) -> bool {
        while let Some(batch) = self.in_flight.front_mut() {
            match batch.poll() {
                Ok(None) => return true,
                Ok(Some(time)) => {
                    self.busy += time;
                    if let Some(batch) = self.in_flight.pop_front() {
                        self.spare.push(batch.into_timing());
                    }
                }
                Err(e) => {
                    // The stream failed for good. Dropping the batch (and its timing events)
                    // waits for whatever the stream still runs before releasing the sources.
                    tracing::error!(error = %e, "polling a copy batch failed");
                    self.in_flight.pop_front();
                }
            }
        }
        false
    }
}

impl CopySource for HostSlice {
    fn bytes(&self) -> &[u8] {
        HostSlice::bytes(self)
    }
}

fn copy_err(e: CudaError) -> BackendError {
    BackendError::Copy(e.to_string())
}

impl CudaBackend {
    /// Opens every device, or says why CUDA cannot be used (never panics).
    pub fn new() -> Result<CudaBackend, String> {
        let (driver, count) = ffi::probe()?;
        let open = |ordinal| -> Result<Device, CudaError> {
            let ctx = Context::retain(driver, ordinal)?;
            Ok(Device {
                about: ctx.describe()?,
                stream: CopyStream::new(&ctx)?,
                ctx,
                copies: Mutex::new(Copies::default()),
            })
        };
        let devices = (0..count)
            .map(open)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        for d in &devices {
            let a = &d.about;
            tracing::info!(ordinal = d.ctx.ordinal(), uuid = %a.uuid, name = %a.name,
                pci = %a.pci_bus_id, memory = a.total_memory, "CUDA device");
        }
        Ok(CudaBackend { devices })
    }
}

impl Device {
    fn copies(&self) -> MutexGuard<'_, Copies> {
        self.copies.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A staging or resident region: a cuMemAlloc allocation exported once by IPC. Dropping it
/// waits for the copy stream, then frees (`DeviceAlloc`).
/// The allocation behind a region of this backend.
fn alloc_of(region: &Arc<dyn DeviceRegion>) -> Result<&DeviceAlloc, BackendError> {
    (region.as_any().downcast_ref::<CudaRegion>())
        .map(|r| &r.alloc)
        .ok_or_else(|| BackendError::Copy("not a CUDA region".into()))
}

struct CudaRegion {
    alloc: DeviceAlloc,
    size: u64,
    handle: [u8; 64],
}

impl DeviceRegion for CudaRegion {
    fn size(&self) -> u64 {
        self.size
    }

    fn export(&self) -> RegionExport {
        RegionExport::CudaIpc(self.handle.to_vec())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A session's interprocess events; each destroys itself (binding its context) on drop.
struct CudaEvents {
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
            Ok(e) => e.is_complete(),
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

/// Keeps an arena's chunks page-locked; each unregisters itself on drop.
struct Pinned(Vec<HostRegistration>);

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.devices
            .iter()
            .map(|d| DeviceInfo {
                uuid: d.about.uuid.clone(),
                name: d.about.name.clone(),
                total_memory: d.about.total_memory,
                free_memory: d.ctx.free_memory().unwrap_or(0),
                pci_bus_id: d.about.pci_bus_id.clone(),
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
            device: d.about.uuid.clone(),
            bytes: size,
            purpose,
            reason: e.to_string(),
        };
        let bytes = size.max(1).div_ceil(ALLOC_ALIGN) * ALLOC_ALIGN;
        let alloc = DeviceAlloc::new(&d.stream, bytes).map_err(fail)?;
        let handle = alloc.ipc_handle().map_err(fail)?;
        Ok(Arc::new(CudaRegion {
            alloc,
            size,
            handle,
        }))
    }

    /// Queues, on the copy stream: waits for the job's pending events, the timing start event,
    /// the copies, the timing end event, then the ready event. The batch (and its sources)
    /// joins the device's in-flight list before the ready event is recorded, so that no error
    /// after the copies are queued can drop a source early.
    fn copy(&self, device: usize, job: CopyJob) -> Result<CopyTiming, BackendError> {
        let d = &self.devices[device];
        job.check_bounds()?;
        let CopyJob {
            region,
            spans,
            from_device,
            events,
            wait,
            record,
            synchronous,
        } = job;
        let region = alloc_of(&region)?;
        let within = (from_device.iter())
            .map(|(src, at)| Ok((alloc_of(&src.region)?, src.offset, src.len, *at)))
            .collect::<Result<Vec<_>, BackendError>>()?;
        let pool = events
            .as_deref()
            .and_then(|p| p.as_any().downcast_ref::<CudaEvents>());
        let event = |i: u32| match pool {
            Some(p) => p.event(i),
            None => Err(BackendError::Copy(
                "job names events but has no pool".into(),
            )),
        };
        // The scheduler runs jobs once their events are complete; a wait is queued only for
        // one that is not (it keeps the order correct, at the cost measured in the README).
        for &w in &wait {
            if !pool.is_some_and(|p| p.is_complete(w)) {
                d.stream.wait(event(w)?).map_err(copy_err)?;
            }
        }
        if !spans.is_empty() {
            let timing = match d.copies().spare.pop() {
                Some(t) => t,
                None => TimingPair::new(&d.ctx).map_err(copy_err)?,
            };
            let batch = d.stream.copy(region, spans, timing).map_err(copy_err)?;
            d.copies().in_flight.push_back(batch);
        }
        // Within the device: untimed (the busy time is the link's).
        for (src, src_offset, len, at) in within {
            (d.stream)
                .copy_within(region, at, src, src_offset, len)
                .map_err(copy_err)?;
        }
        if let Some(r) = record {
            d.stream.record(event(r)?).map_err(copy_err)?;
        }
        if synchronous {
            d.stream.synchronize().map_err(copy_err)?;
        }
        Ok(CopyTiming::Queued)
    }

    fn poll_copies(&self, device: usize) -> CopyPoll {
        let mut copies = self.devices[device].copies();
        let pending = copies.reap();
        CopyPoll {
            busy: std::mem::take(&mut copies.busy),
            pending,
        }
    }

    /// Waits for the copy stream, then retires every batch (their time is reported by the
    /// next `poll_copies`).
    fn synchronize(&self, device: usize) -> Result<(), BackendError> {
        let d = &self.devices[device];
        d.stream.synchronize().map_err(copy_err)?;
        d.copies().reap();
        Ok(())
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
        let mut events = Vec::with_capacity(count as usize);
        let mut handles = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (event, handle) = IpcEvent::new(&d.ctx).map_err(fail)?;
            events.push(event);
            handles.push(handle.to_vec());
        }
        Ok(Some(Arc::new(CudaEvents { events, handles })))
    }
}

impl HostPinner for CudaBackend {
    /// Registers the chunks in parallel (registration runs at ~2 GB/s per thread); a
    /// read-only mapping (a sealed upload) is registered read-only.
    fn pin_host(
        &self,
        chunks: &[(usize, usize)],
        access: PinAccess,
    ) -> Result<Option<PinGuard>, PinError> {
        let ctx = &self.devices[0].ctx;
        let read_only = access == PinAccess::ReadOnly;
        let total: usize = chunks.iter().map(|c| c.1).sum();
        let results: Vec<Result<HostRegistration, CudaError>> = std::thread::scope(|scope| {
            let workers = std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .min(8);
            let per = chunks.len().div_ceil(workers.max(1)).max(1);
            let handles: Vec<_> = chunks
                .chunks(per)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter()
                            .map(|&(ptr, len)| HostRegistration::new(ctx, ptr, len, read_only))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut pinned = Pinned(Vec::with_capacity(chunks.len()));
        let mut failure = None;
        for r in results {
            match r {
                Ok(registration) => pinned.0.push(registration),
                Err(e) => failure = Some(e),
            }
        }
        if pinned.0.len() < chunks.len() && failure.is_none() {
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

#[cfg(test)]
mod tests {
    use std::sync::Weak;
    use std::time::Instant;

    use super::*;
    use crate::backend::DeviceSlice;
    use crate::mem::filled_for_tests;
    use crate::mem::shm::Shm;
    use crate::mem::{HostArena, HostSlice};

    /// Without a driver (this machine) it says why; with one it opens the devices. Either way
    /// it must not panic (cudarc's loader panics on a missing library or symbol).
    #[test]
    fn new_never_panics() {
        if let Err(reason) = CudaBackend::new() {
            assert!(!reason.is_empty());
        }
    }

    /// One page-locked source holding `data` (the slice keeps its arena and registration).
    fn source_with(backend: &CudaBackend, data: &[u8]) -> HostSlice {
        filled_for_tests(&Shm::new(), data, backend)
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn region_bytes(region: &Arc<dyn DeviceRegion>, len: usize) -> Vec<u8> {
        let region = region.as_any().downcast_ref::<CudaRegion>().unwrap();
        region.alloc.read(0, len).unwrap()
    }

    /// On a GPU: a sealed upload (a memfd sealed against writes, mapped read-only: what a
    /// commit makes the model's arena) is page-locked in place with `READ_ONLY`, and copies
    /// from it land; a model arena the daemon wrote (sealed against resizing only) is
    /// page-locked read-write as before. Whether the driver refuses a writable registration of
    /// the read-only mapping (why the flag is passed) is printed.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn on_a_gpu_a_sealed_upload_is_pinned_read_only_in_place() {
        use std::os::unix::fs::FileExt;

        use crate::mem::PinAccess;
        use crate::mem::shm::{Access, ShmSegment};
        let backend = Arc::new(CudaBackend::new().expect("a CUDA device"));
        let shm = Shm::new();
        let n = 64 << 20;
        let data = pattern(n);
        let memfd = shm
            .create_upload(n as u64, crate::mem::shm::UploadPages::Reserved)
            .unwrap();
        let writer = std::fs::File::from(memfd.share(Access::ReadWrite).unwrap());
        writer.write_all_at(&data, 0).unwrap();
        memfd.seal_writes().unwrap();
        let sealed = ShmSegment::sealed(memfd).unwrap();
        let chunk = [(sealed.bytes().as_ptr() as usize, n)];
        match backend.pin_host(&chunk, PinAccess::ReadWrite) {
            Ok(_) => println!("a writable registration of the read-only mapping was accepted"),
            Err(e) => println!("a writable registration of the read-only mapping: {e}"),
        }
        let pin = backend
            .pin_host(&chunk, PinAccess::ReadOnly)
            .expect("READ_ONLY registration of a sealed memfd");
        assert!(pin.is_some());
        let source = HostSlice::new(Arc::new(HostArena::new(sealed, pin)), 0, n as u64);
        let region = backend.alloc_region(0, n as u64, "resident").unwrap();
        let mut job = CopyJob::copy(region.clone(), vec![(source, 0)]);
        job.synchronous = true;
        backend.copy(0, job).unwrap();
        assert!(region_bytes(&region, n) == data, "the bytes differ");

        let written = source_with(&backend, &data);
        let region = backend.alloc_region(0, n as u64, "staging").unwrap();
        let mut job = CopyJob::copy(region.clone(), vec![(written, 0)]);
        job.synchronous = true;
        backend.copy(0, job).unwrap();
        assert!(region_bytes(&region, n) == data, "the bytes differ");
    }

    /// On a GPU: `cargo test -p weightstream-daemon --lib -- --ignored on_a_gpu`. A queued copy
    /// holds its source arena (and its page-lock) after the store and model are gone, until a
    /// poll sees the stream past it; its device time is then reported, and the bytes landed.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn on_a_gpu_a_queued_copy_keeps_its_source_until_polled_complete() {
        let _log =
            tracing::subscriber::set_default(tracing_subscriber::fmt().with_test_writer().finish());
        let backend = Arc::new(CudaBackend::new().expect("a CUDA device"));
        println!("{:?}", backend.devices());
        let n = 512 << 20;
        let data = pattern(n);
        let source = source_with(&backend, &data);
        let region = backend.alloc_region(0, n as u64 + 1, "staging").unwrap();
        match region.export() {
            RegionExport::CudaIpc(h) => assert!(h.len() == 64 && h.iter().any(|&b| b != 0)),
            other => panic!("{other:?}"),
        }
        let events = backend.event_pool(0, 4).unwrap().unwrap();
        assert_eq!(events.handles().len(), 4);
        assert!(events.is_complete(1) && events.is_complete(2));
        let arena: Weak<HostArena> = Arc::downgrade(source.arena());
        let job = CopyJob {
            region: region.clone(),
            spans: vec![(source.clone(), 0)],
            from_device: Vec::new(),
            events: Some(events.clone()),
            wait: vec![2],
            record: Some(1),
            synchronous: false,
        };
        let began = Instant::now();
        assert_eq!(backend.copy(0, job).unwrap(), CopyTiming::Queued);
        let queued_in = began.elapsed();
        drop(source);
        assert!(arena.upgrade().is_some(), "the source went with the job");
        let mut busy = Duration::ZERO;
        let mut polls = 0;
        loop {
            let polled = backend.poll_copies(0);
            busy += polled.busy;
            polls += 1;
            if !polled.pending {
                break;
            }
            assert!(began.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_micros(50));
        }
        let wall = began.elapsed();
        assert!(arena.upgrade().is_none(), "the source outlived its copy");
        assert!(events.is_complete(1));
        let rate = n as f64 / busy.as_secs_f64() / 1e9;
        println!(
            "queued in {queued_in:?}, device busy {busy:?} ({rate:.1} GB/s), \
             complete after {wall:?} and {polls} polls"
        );
        assert!(busy <= wall && (5.0..100.0).contains(&rate), "{busy:?}");
        assert_eq!(backend.poll_copies(0), CopyPoll::default());
        assert!(region_bytes(&region, n) == data, "the bytes differ");
    }

    /// On a GPU: a copy within the device moves the bytes it names, its source region let go
    /// while the copy is queued (the region's Drop waits for the copy stream); a range past
    /// either region, or a region copied into itself, fails before anything is queued.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn on_a_gpu_a_copy_within_the_device_lands_though_its_source_is_let_go() {
        let backend = Arc::new(CudaBackend::new().expect("a CUDA device"));
        let n = 64 << 20;
        let data = pattern(n);
        let source = source_with(&backend, &data);
        let resident = backend.alloc_region(0, n as u64, "resident").unwrap();
        let mut fill = CopyJob::copy(resident.clone(), vec![(source, 0)]);
        fill.synchronous = true;
        backend.copy(0, fill).unwrap();
        backend.poll_copies(0); // the fill's time, reported
        let staging = backend.alloc_region(0, n as u64, "staging").unwrap();
        let from = |region: &Arc<dyn DeviceRegion>, offset: u64, len: u64| DeviceSlice {
            region: region.clone(),
            offset,
            len,
        };
        let half = n as u64 / 2;
        let job = CopyJob::within(staging.clone(), from(&resident, 1000, half), 0);
        assert_eq!(backend.copy(0, job).unwrap(), CopyTiming::Queued);
        drop(resident);
        assert!(region_bytes(&staging, half as usize) == data[1000..1000 + half as usize]);
        let other = backend.alloc_region(0, 4096, "resident").unwrap();
        let past = CopyJob::within(staging.clone(), from(&other, 4000, 200), 0);
        assert!(matches!(
            backend.copy(0, past),
            Err(BackendError::SourceOutOfBounds {
                offset: 4000,
                bytes: 200,
                size: 4096
            })
        ));
        let itself = CopyJob::within(staging.clone(), from(&staging, 0, 10), 100);
        assert!(backend.copy(0, itself).is_err());
        assert_eq!(
            backend.poll_copies(0).busy,
            Duration::ZERO,
            "copies within are untimed"
        );
    }

    /// On a GPU: dropping the backend with copies in flight waits for them before releasing
    /// their sources; a synchronous copy is in place when `copy` returns; bad offsets fail
    /// before anything is queued.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn on_a_gpu_teardown_waits_for_copies_and_sync_copies_land() {
        let _log =
            tracing::subscriber::set_default(tracing_subscriber::fmt().with_test_writer().finish());
        let backend = Arc::new(CudaBackend::new().expect("a CUDA device"));
        let n = 256 << 20;
        let data = pattern(n);
        let source = source_with(&backend, &data);
        let region = backend.alloc_region(0, n as u64, "resident").unwrap();
        let outside = CopyJob::copy(region.clone(), vec![(source.clone(), 1)]);
        assert!(matches!(
            backend.copy(0, outside),
            Err(BackendError::OutOfBounds { offset: 1, .. })
        ));
        let mut job = CopyJob::copy(region.clone(), vec![(source.clone(), 0)]);
        job.synchronous = true;
        backend.copy(0, job).unwrap();
        assert!(region_bytes(&region, n) == data, "the bytes differ");
        backend.synchronize(0).unwrap();
        let polled = backend.poll_copies(0);
        assert!(!polled.pending && !polled.busy.is_zero(), "{polled:?}");
        // Queue two more, let go of everything but the backend, then drop it.
        for _ in 0..2 {
            let job = CopyJob::copy(region.clone(), vec![(source.clone(), 0)]);
            backend.copy(0, job).unwrap();
        }
        let arena: Weak<HostArena> = Arc::downgrade(source.arena());
        drop((source, region));
        assert!(arena.upgrade().is_some(), "the source went with the job");
        drop(backend);
        assert!(arena.upgrade().is_none(), "the backend kept the source");
    }
}
