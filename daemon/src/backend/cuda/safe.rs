//! RAII types over `ffi`, as cudarc's `safe` layer is over its `result`: each owns one kind of
//! CUDA object, holds an `Arc` of the [`Context`] the object lives in, binds that context
//! before each call and again in `Drop`, then frees the object. The `Arc`s keep the primary
//! context retained until the last object of it is gone, whatever order they drop in. Nothing
//! above this module sees a raw handle or writes `unsafe`.
//!
//! Binding is `cuCtxSetCurrent` on the calling thread, done by every method that calls the
//! driver: nothing relies on what a thread had bound before, so any thread may drop anything.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;

use super::ffi::{self, CudaError, Driver};

fn log_failure(what: &str, r: Result<(), CudaError>) {
    if let Err(e) = r {
        tracing::error!(error = %e, "{what} failed");
    }
}

/// A device's primary context, retained for as long as this lives.
pub struct Context {
    driver: Driver,
    ordinal: i32,
    dev: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext is a driver object that any thread may make current; `Context` only
// binds it and releases its reference once, in Drop.
unsafe impl Send for Context {}
// SAFETY: every method takes &self and makes a driver call, and the driver is thread-safe.
unsafe impl Sync for Context {}

/// What the protocol and the logs say about a device.
#[derive(Debug, Clone)]
pub struct Description {
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub total_memory: u64,
}

impl Context {
    pub fn retain(driver: Driver, ordinal: i32) -> Result<Arc<Context>, CudaError> {
        let dev = ffi::device_get(driver, ordinal)?;
        let raw = ffi::primary_ctx_retain(driver, dev)?;
        Ok(Arc::new(Context {
            driver,
            ordinal,
            dev,
            raw,
        }))
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `raw` stays retained until Drop.
        unsafe { ffi::ctx_set_current(self.raw) }
    }

    pub fn describe(&self) -> Result<Description, CudaError> {
        Ok(Description {
            uuid: format_uuid(&ffi::device_uuid(self.driver, self.dev)?),
            name: ffi::device_name(self.driver, self.dev)?,
            pci_bus_id: ffi::device_pci_bus_id(self.driver, self.dev)?,
            total_memory: ffi::device_total_mem(self.driver, self.dev)?,
        })
    }

    pub fn free_memory(&self) -> Result<u64, CudaError> {
        self.bind()?;
        Ok(ffi::mem_get_info(self.driver)?.0)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Every object of this context holds an `Arc` of it, so none is left to use it.
        // SAFETY: gives back the reference taken in `retain`, once.
        log_failure("cuDevicePrimaryCtxRelease_v2", unsafe {
            ffi::primary_ctx_release(self.dev)
        });
    }
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi writes it.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The device's copy stream: non-blocking, at the context's highest priority.
pub struct CopyStream {
    ctx: Arc<Context>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream is a driver object usable from any thread that binds its context, which
// every method (and Drop) does first.
unsafe impl Send for CopyStream {}
// SAFETY: the methods take &self and only enqueue work or wait; the driver serialises calls on
// one stream from several threads.
unsafe impl Sync for CopyStream {}

impl CopyStream {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CopyStream>, CudaError> {
        ctx.bind()?;
        let (_least, greatest) = ffi::ctx_stream_priority_range(ctx.driver)?;
        let raw = ffi::stream_create(ctx.driver, ffi::STREAM_NON_BLOCKING, greatest)?;
        Ok(Arc::new(CopyStream {
            ctx: ctx.clone(),
            raw,
        }))
    }

    /// Blocks until everything queued so far has completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the stream lives until Drop and its context is bound.
        unsafe { ffi::stream_synchronize(self.raw) }
    }

    /// Queues a wait for `event`'s latest record (an event of any context or process).
    pub fn wait(&self, event: &IpcEvent) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: both live for the call (owned by `self` and borrowed); context bound.
        unsafe { ffi::stream_wait_event(self.raw, event.raw) }
    }

    /// Queues a record of `event`, an event of this stream's context.
    pub fn record(&self, event: &IpcEvent) -> Result<(), CudaError> {
        self.record_raw(&event.ctx, event.raw)
    }

    fn record_raw(&self, ctx: &Arc<Context>, event: sys::CUevent) -> Result<(), CudaError> {
        if !Arc::ptr_eq(ctx, &self.ctx) {
            let text = "the event belongs to another context".into();
            return Err(CudaError::invalid("cuEventRecord", text));
        }
        self.ctx.bind()?;
        // SAFETY: the event is live (its owner is borrowed by the caller), of this context (checked
        // above), which is bound.
        unsafe { ffi::event_record(event, self.raw) }
    }

    /// Queues `timing.start`, a copy of each `(source, offset)` into `dst` at `offset`, and
    /// `timing.end`. The returned batch owns the sources until the stream has passed the copies
    /// (see [`InFlight`]); on an error the copies already queued are waited for before the
    /// sources drop.
    pub fn copy<S: CopySource>(
        self: &Arc<Self>,
        dst: &DeviceAlloc,
        spans: Vec<(S, u64)>,
        timing: TimingPair,
    ) -> Result<InFlight<S>, CudaError> {
        const CALL: &str = "cuMemcpyHtoDAsync_v2";
        if !Arc::ptr_eq(&dst.writer, self) {
            let text = "the allocation is written by another stream".into();
            return Err(CudaError::invalid(CALL, text));
        }
        for (source, offset) in &spans {
            let len = source.bytes().len() as u64;
            if offset.checked_add(len).is_none_or(|end| end > dst.bytes) {
                let text = format!("{len} bytes at {offset} overrun {} bytes", dst.bytes);
                return Err(CudaError::invalid(CALL, text));
            }
        }
        // The batch owns the sources before the first copy is queued, so that an early return
        // below drops the batch, whose Drop waits for the stream, and never the sources alone.
        // They stay where they are from here on: the Vec is moved, its elements never are.
        let held = Held {
            stream: self.clone(),
            spans,
            passed: false,
        };
        self.record_raw(&timing.start.ctx, timing.start.raw)?;
        for (source, offset) in &held.spans {
            let bytes = source.bytes();
            if bytes.is_empty() {
                continue;
            }
            // SAFETY: the context is bound (record_raw). The destination lies in `dst` (checked
            // above), which only this stream writes and whose Drop synchronizes this stream
            // before freeing. The source is owned by `held`, which does not move it and keeps it
            // until the stream has passed the copy (a `CopySource` is 'static, so forgetting the
            // batch leaks the source rather than freeing it under the copy).
            unsafe {
                ffi::memcpy_htod_async(dst.ptr + offset, bytes.as_ptr(), bytes.len(), self.raw)
            }?;
        }
        self.record_raw(&timing.end.ctx, timing.end.raw)?;
        Ok(InFlight { held, timing })
    }
}

impl CopyStream {
    /// Queues a copy of `len` bytes at `src_offset` of `src` into `dst` at `dst_offset`, both
    /// allocations of this stream. Nothing outlives the call: each allocation's Drop waits for
    /// this stream before freeing, so neither is freed under the copy.
    pub fn copy_within(
        &self,
        dst: &DeviceAlloc,
        dst_offset: u64,
        src: &DeviceAlloc,
        src_offset: u64,
        len: u64,
    ) -> Result<(), CudaError> {
        const CALL: &str = "cuMemcpyDtoDAsync_v2";
        let ours = |a: &DeviceAlloc| std::ptr::eq(Arc::as_ptr(&a.writer), self);
        if !ours(dst) || !ours(src) {
            let text = "an allocation is written by another stream".into();
            return Err(CudaError::invalid(CALL, text));
        }
        for (alloc, offset) in [(dst, dst_offset), (src, src_offset)] {
            if offset.checked_add(len).is_none_or(|end| end > alloc.bytes) {
                let text = format!("{len} bytes at {offset} overrun {} bytes", alloc.bytes);
                return Err(CudaError::invalid(CALL, text));
            }
        }
        if std::ptr::eq(dst, src) {
            return Err(CudaError::invalid(
                CALL,
                "an allocation copied into itself".into(),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the context is bound. Both ranges lie in live allocations of this stream
        // (checked above), borrowed for the call; each allocation's Drop synchronizes this
        // stream before freeing, so both outlive the queued copy. The source is a resident
        // region, whose bytes are written once, synchronously, before any copy reads them.
        unsafe {
            ffi::memcpy_dtod_async(
                dst.ptr + dst_offset,
                src.ptr + src_offset,
                len as usize,
                self.raw,
            )
        }
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        // Queued work completes on its own; owners of what it reads hold `Arc`s of this stream
        // and wait for it themselves (`Held`, `DeviceAlloc`).
        if self.ctx.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once, context bound.
            log_failure("cuStreamDestroy_v2", unsafe {
                ffi::stream_destroy(self.raw)
            });
        }
    }
}

/// Host bytes that an asynchronous copy reads after `CopyStream::copy` has returned.
///
/// The batch owns the value until the stream has passed the copy and never moves it after
/// reading `bytes()`, so the slice stays valid for the copy: safe code cannot free or reuse
/// the memory a `&self` borrow points into while the value is alive and unmoved. `'static`
/// makes that hold even if a batch is leaked with `mem::forget` (the source is leaked too).
pub trait CopySource: Send + 'static {
    fn bytes(&self) -> &[u8];
}

/// Plain `cuMemAlloc` device memory (IPC can export it; not the async pool's), written only
/// through one `CopyStream`.
pub struct DeviceAlloc {
    ctx: Arc<Context>,
    writer: Arc<CopyStream>,
    ptr: sys::CUdeviceptr,
    bytes: u64,
}
// Send + Sync from its fields: two `Arc`s of Send + Sync types and an integer device address
// that only the driver dereferences.

impl DeviceAlloc {
    /// `bytes` of device memory in `writer`'s context, to be written only through `writer`.
    pub fn new(writer: &Arc<CopyStream>, bytes: u64) -> Result<DeviceAlloc, CudaError> {
        let ctx = writer.ctx.clone();
        ctx.bind()?;
        let ptr = ffi::mem_alloc(ctx.driver, bytes as usize)?;
        Ok(DeviceAlloc {
            ctx,
            writer: writer.clone(),
            ptr,
            bytes,
        })
    }

    /// The IPC handle of the whole allocation.
    pub fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        self.ctx.bind()?;
        // SAFETY: `ptr` is the base of this live cuMemAlloc allocation.
        unsafe { ffi::ipc_get_mem_handle(self.ptr) }
    }
}

#[cfg(test)]
impl DeviceAlloc {
    /// Reads `len` bytes at `offset` back, once the copies queued so far are done.
    pub fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>, CudaError> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.bytes)
        {
            return Err(CudaError::invalid(
                "cuMemcpyDtoH_v2",
                "out of bounds".into(),
            ));
        }
        self.writer.synchronize()?;
        let mut out = vec![0u8; len];
        // SAFETY: the range lies in this live allocation (checked above), its context is bound
        // (synchronize) and its only writer is idle; `out` holds `len` bytes.
        unsafe { ffi::memcpy_dtoh(out.as_mut_ptr(), self.ptr + offset, len) }?;
        Ok(out)
    }
}

impl Drop for DeviceAlloc {
    /// Copies into the memory may still be queued: only `writer` writes it, so wait for that
    /// stream, then free. (Clients close their mappings before closing the session; a dead
    /// client's mappings died with it.)
    fn drop(&mut self) {
        log_failure(
            "waiting for copies before a free",
            self.writer.synchronize(),
        );
        if let Err(e) = self.ctx.bind() {
            tracing::error!(error = %e, "cannot bind the context: device memory leaked");
            return;
        }
        // SAFETY: from cuMemAlloc in this context (bound), freed once; the only stream that
        // writes it has been synchronized above (or has failed for good, so runs nothing).
        log_failure("cuMemFree_v2", unsafe { ffi::mem_free(self.ptr) });
    }
}

/// An interprocess event (`INTERPROCESS | DISABLE_TIMING`), exported once.
pub struct IpcEvent {
    ctx: Arc<Context>,
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a driver object usable from any thread that binds its context, which
// every method (and Drop) does first.
unsafe impl Send for IpcEvent {}
// SAFETY: the methods take &self and only query the event; the driver is thread-safe.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    /// The event and its IPC handle.
    pub fn new(ctx: &Arc<Context>) -> Result<(IpcEvent, [u8; 64]), CudaError> {
        ctx.bind()?;
        let raw = ffi::event_create(ctx.driver, ffi::EVENT_INTERPROCESS)?;
        // Owned from here: an error below destroys it.
        let event = IpcEvent {
            ctx: ctx.clone(),
            raw,
        };
        // SAFETY: the event is live and was created interprocess.
        let handle = unsafe { ffi::ipc_get_event_handle(event.raw) }?;
        Ok((event, handle))
    }

    /// Whether the work before its latest record is done (a never-recorded event is). False on
    /// an error, so that a wait is queued, which is always correct.
    pub fn is_complete(&self) -> bool {
        // SAFETY: the event is live; its context is bound first.
        self.ctx.bind().is_ok() && matches!(unsafe { ffi::event_query(self.raw) }, Ok(true))
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once, context bound; a pending record
            // completes in the driver, and waits already queued on it stand.
            log_failure("cuEventDestroy_v2", unsafe { ffi::event_destroy(self.raw) });
        }
    }
}

/// An event with timing enabled (not interprocess), for device-side copy times.
struct TimingEvent {
    ctx: Arc<Context>,
    raw: sys::CUevent,
}

// SAFETY: as for `IpcEvent`: a driver object, its context bound before each use and in Drop.
unsafe impl Send for TimingEvent {}
// SAFETY: it has no &self methods; `InFlight::poll` uses it through &mut.
unsafe impl Sync for TimingEvent {}

impl TimingEvent {
    fn new(ctx: &Arc<Context>) -> Result<TimingEvent, CudaError> {
        ctx.bind()?;
        let raw = ffi::event_create(ctx.driver, ffi::EVENT_TIMING)?;
        Ok(TimingEvent {
            ctx: ctx.clone(),
            raw,
        })
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once, context bound.
            log_failure("cuEventDestroy_v2", unsafe { ffi::event_destroy(self.raw) });
        }
    }
}

/// The two timing events recorded around one copy batch; reusable once the batch is passed.
pub struct TimingPair {
    start: TimingEvent,
    end: TimingEvent,
}

impl TimingPair {
    pub fn new(ctx: &Arc<Context>) -> Result<TimingPair, CudaError> {
        Ok(TimingPair {
            start: TimingEvent::new(ctx)?,
            end: TimingEvent::new(ctx)?,
        })
    }
}

/// The sources of a queued copy batch. Unless the stream was seen to pass the batch, dropping
/// them first waits for the stream: whoever drops a batch, its sources outlive its copies.
struct Held<S> {
    stream: Arc<CopyStream>,
    spans: Vec<(S, u64)>,
    passed: bool,
}

impl<S> Drop for Held<S> {
    fn drop(&mut self) {
        if !self.passed {
            // An error path or teardown; the copy thread polls instead and never gets here.
            log_failure("waiting for copies to finish", self.stream.synchronize());
        }
    }
}

/// A copy batch queued on a `CopyStream`, owning the sources it reads until the stream has
/// passed it (see `Held`), with the timing events around it.
pub struct InFlight<S> {
    held: Held<S>,
    timing: TimingPair,
}
// Send + Sync from its fields, as far as `S` is.

impl<S> InFlight<S> {
    /// The device time of the batch once the stream has passed it; None while it has not.
    /// Never blocks.
    pub fn poll(&mut self) -> Result<Option<Duration>, CudaError> {
        self.held.stream.ctx.bind()?;
        if !self.held.passed {
            // SAFETY: the event is live (owned by `self`) and of the bound context.
            if !unsafe { ffi::event_query(self.timing.end.raw) }? {
                return Ok(None);
            }
            // `end` was recorded after every copy of the batch on this in-order stream.
            self.held.passed = true;
        }
        // SAFETY: both are live timing events of the bound context, recorded in order on one
        // stream, and complete (end is, so start is).
        let ms = unsafe { ffi::event_elapsed_ms(self.timing.start.raw, self.timing.end.raw) }?;
        Ok(Some(
            Duration::try_from_secs_f64(f64::from(ms) / 1e3).unwrap_or_default(),
        ))
    }

    /// Releases the sources (waiting for the stream unless `poll` saw it pass) and hands the
    /// timing events back for the next batch.
    pub fn into_timing(self) -> TimingPair {
        self.timing
    }
}

/// Host memory page-locked for every context (`PORTABLE`; `READ_ONLY` too for a read-only
/// mapping), unlocked on drop.
pub struct HostRegistration {
    ctx: Arc<Context>,
    ptr: *mut c_void,
}

// SAFETY: `ptr` is only an address handed back to the driver in Drop, never dereferenced; the
// context is bound before each call.
unsafe impl Send for HostRegistration {}
// SAFETY: no method reads or writes through `ptr`.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Page-locks `len` bytes at address `ptr`, read-only when the mapping is (the device only
    /// reads from it then; a writable registration of a read-only mapping fails). Safe to call
    /// with any range: the driver checks that it is mapped and not registered already, and
    /// locking neither reads nor writes its bytes. Whether a copy may read the range is up to
    /// the copy's `CopySource`.
    pub fn new(
        ctx: &Arc<Context>,
        ptr: usize,
        len: usize,
        read_only: bool,
    ) -> Result<HostRegistration, CudaError> {
        ctx.bind()?;
        let ptr = ptr as *mut c_void;
        // SAFETY: see above; a context is bound.
        unsafe { ffi::mem_host_register(ptr, len, register_flags(read_only)) }?;
        Ok(HostRegistration {
            ctx: ctx.clone(),
            ptr,
        })
    }
}

/// The `cuMemHostRegister` flags of a registration: always `PORTABLE`, because one daemon
/// registers the store's arenas once (in device 0's context) and every device's copy stream
/// DMAs from them; without it the pages count as page-locked for the registering context
/// only, and another device's copies of them fall back to staged (pageable) copies. A
/// read-only mapping (a sealed upload) adds `READ_ONLY`, and stays `PORTABLE`.
fn register_flags(read_only: bool) -> u32 {
    let mut flags = ffi::HOST_REGISTER_PORTABLE;
    if read_only {
        flags |= ffi::HOST_REGISTER_READ_ONLY;
    }
    flags
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: registered in `new`, unregistered once, context bound. Copies from the
            // range hold (through their `CopySource`) whatever holds this registration.
            log_failure("cuMemHostUnregister", unsafe {
                ffi::mem_host_unregister(self.ptr)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_formatted_like_nvidia_smi() {
        let b: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(format_uuid(&b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    /// Every registration, the read-only one of a sealed upload included, is `PORTABLE` (0x01):
    /// one host copy serves the copy streams of every device's context.
    #[test]
    fn host_registrations_are_portable_for_every_device() {
        assert_eq!(register_flags(false), 0x01);
        assert_eq!(register_flags(true), 0x01 | 0x08);
        assert_ne!(register_flags(true) & ffi::HOST_REGISTER_PORTABLE, 0);
    }

    #[test]
    fn owners_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Context>();
        send_sync::<CopyStream>();
        send_sync::<DeviceAlloc>();
        send_sync::<IpcEvent>();
        send_sync::<TimingPair>();
        send_sync::<HostRegistration>();
        send_sync::<InFlight<Vec<u8>>>();
    }
}
