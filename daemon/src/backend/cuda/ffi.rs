//! The result layer over the CUDA driver (cudarc's raw `sys`), as cudarc's `result.rs` is: one
//! thin function per driver call, turning its status into `Result<_, CudaError>`. Nothing here
//! owns anything; the RAII types in `safe` do.
//!
//! Every function that takes a raw handle (context, stream, event, device or host pointer) is
//! an `unsafe fn` whose `# Safety` section says what the handle must be. The others take a
//! [`Driver`], the proof that [`probe`] found libcuda and every symbol we call: cudarc loads
//! libcuda lazily and panics on a missing library or symbol, so no call may come before `probe`
//! (a valid raw handle implies one did). Calls that act on "the current context" fail with
//! `CUDA_ERROR_INVALID_CONTEXT` when none is bound; binding is the `safe` layer's job.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::{CStr, c_char, c_void};

use cudarc::driver::sys;

#[derive(Debug, thiserror::Error)]
#[error("{call} failed: {name} ({code}): {text}")]
pub struct CudaError {
    pub call: &'static str,
    pub code: i32,
    pub name: String,
    pub text: String,
}

impl CudaError {
    /// A bad argument caught before the driver saw it (reported like the driver's own).
    pub fn invalid(call: &'static str, text: String) -> CudaError {
        CudaError {
            call,
            code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i32,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            text,
        }
    }
}

/// Proof that libcuda and every symbol in `SYMBOLS` are present and `cuInit` succeeded: only
/// `probe` makes one, so a function that takes it cannot reach cudarc's panicking loader.
#[derive(Debug, Clone, Copy)]
pub struct Driver(());

/// `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` (= 6), which interprocess events must
/// have; not one enum variant in cudarc, hence the raw value.
pub const EVENT_INTERPROCESS: u32 = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
    | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
/// `CU_EVENT_DEFAULT`: timing enabled, for `event_elapsed_ms`; not shareable between processes.
pub const EVENT_TIMING: u32 = sys::CUevent_flags::CU_EVENT_DEFAULT as u32;
/// `CU_STREAM_NON_BLOCKING`: no implicit ordering with the legacy default stream.
pub const STREAM_NON_BLOCKING: u32 = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
/// `CU_MEMHOSTREGISTER_PORTABLE`: the registration counts for every context.
pub const HOST_REGISTER_PORTABLE: u32 = sys::CU_MEMHOSTREGISTER_PORTABLE;
/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device only reads the range, so a read-only mapping (a
/// sealed memfd) can be registered.
pub const HOST_REGISTER_READ_ONLY: u32 = sys::CU_MEMHOSTREGISTER_READ_ONLY;

/// Every driver symbol we call; `probe` checks that each exists before the first call.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetStreamPriorityRange",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuIpcGetMemHandle",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoH_v2", // tests read back with it
    "cuStreamCreateWithPriority",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventElapsedTime_v2",
    "cuIpcGetEventHandle",
    "cuGetErrorName",
    "cuGetErrorString",
];

fn error_text(r: sys::CUresult) -> (String, String) {
    let mut name: *const c_char = std::ptr::null();
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: only reached after a driver call returned (so the library is loaded); both calls
    // write a pointer to a static string owned by the driver, or leave ours null on an unknown
    // code, and we read them only when non-null.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut text);
    }
    let read = |p: *const c_char| {
        if p.is_null() {
            "unknown".to_string()
        } else {
            // SAFETY: a non-null result is a NUL-terminated static string (see above).
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    (read(name), read(text))
}

fn check(r: sys::CUresult, call: &'static str) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (name, text) = error_text(r);
    Err(CudaError {
        call,
        code: r as i32,
        name,
        text,
    })
}

/// Checks for the driver library and each symbol, then initialises the driver. Returns the
/// proof of it and the number of devices, or why CUDA cannot be used. Never panics.
pub fn probe() -> Result<(Driver, i32), String> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) was not found".into());
    }
    // SAFETY: the library is present (checked above), so culib() loads it without panicking.
    let lib = unsafe { sys::culib() };
    for symbol in SYMBOLS {
        // SAFETY: we only look the symbol up; its type is not used.
        if let Err(e) = unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) } {
            return Err(format!("libcuda has no symbol {symbol}: {e}"));
        }
    }
    // SAFETY: cuInit takes flags 0; all symbols exist (checked above).
    check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| e.to_string())?;
    let mut count = 0;
    // SAFETY: writes the device count into `count`.
    let r = unsafe { sys::cuDeviceGetCount(&mut count) };
    check(r, "cuDeviceGetCount").map_err(|e| e.to_string())?;
    if count == 0 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok((Driver(()), count))
}

pub fn device_get(_: Driver, ordinal: i32) -> Result<sys::CUdevice, CudaError> {
    let mut dev = 0;
    // SAFETY: writes a device handle into `dev`; the driver checks the ordinal.
    let r = unsafe { sys::cuDeviceGet(&mut dev, ordinal) };
    check(r, "cuDeviceGet")?;
    Ok(dev)
}

pub fn device_name(_: Driver, dev: sys::CUdevice) -> Result<String, CudaError> {
    let mut name = [0 as c_char; 256];
    // SAFETY: writes at most 256 bytes, NUL-terminated, into `name`; the driver checks `dev`.
    let r = unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) };
    check(r, "cuDeviceGetName")?;
    // SAFETY: NUL-terminated by the driver within the buffer.
    Ok(unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

pub fn device_pci_bus_id(_: Driver, dev: sys::CUdevice) -> Result<String, CudaError> {
    let mut pci = [0 as c_char; 64];
    // SAFETY: writes at most 64 bytes, NUL-terminated, into `pci`; the driver checks `dev`.
    let r = unsafe { sys::cuDeviceGetPCIBusId(pci.as_mut_ptr(), 64, dev) };
    check(r, "cuDeviceGetPCIBusId")?;
    // SAFETY: NUL-terminated by the driver within the buffer.
    Ok(unsafe { CStr::from_ptr(pci.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

pub fn device_uuid(_: Driver, dev: sys::CUdevice) -> Result<[u8; 16], CudaError> {
    let mut uuid = sys::CUuuid_st { bytes: [0; 16] };
    // SAFETY: writes 16 bytes into `uuid`; the driver checks `dev`.
    let r = unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) };
    check(r, "cuDeviceGetUuid_v2")?;
    Ok(uuid.bytes.map(|b| b as u8))
}

pub fn device_total_mem(_: Driver, dev: sys::CUdevice) -> Result<u64, CudaError> {
    let mut total = 0usize;
    // SAFETY: writes the device's memory size into `total`; the driver checks `dev`.
    let r = unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) };
    check(r, "cuDeviceTotalMem_v2")?;
    Ok(total as u64)
}

/// Retains the device's primary context (creating it on first use). Leaking the reference is
/// harmless; releasing it is `primary_ctx_release`'s job.
pub fn primary_ctx_retain(_: Driver, dev: sys::CUdevice) -> Result<sys::CUcontext, CudaError> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: writes a context handle into `ctx`; the driver checks `dev`.
    let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) };
    check(r, "cuDevicePrimaryCtxRetain")?;
    Ok(ctx)
}

/// # Safety
/// Balances exactly one successful `primary_ctx_retain(dev)` of the caller's, and the caller
/// uses no object of that reference's context afterwards (the last release destroys it).
pub unsafe fn primary_ctx_release(dev: sys::CUdevice) -> Result<(), CudaError> {
    // SAFETY: the caller gives back a reference it holds (see above).
    let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
    check(r, "cuDevicePrimaryCtxRelease_v2")
}

/// Makes `ctx` current on the calling thread.
///
/// # Safety
/// `ctx` is a live context: retained by the caller, not yet released.
pub unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<(), CudaError> {
    // SAFETY: `ctx` is live (see above).
    check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")
}

/// (least, greatest) stream priority of the current context; greatest is the most urgent.
pub fn ctx_stream_priority_range(_: Driver) -> Result<(i32, i32), CudaError> {
    let (mut least, mut greatest) = (0, 0);
    // SAFETY: writes two integers; fails without a current context.
    let r = unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) };
    check(r, "cuCtxGetStreamPriorityRange")?;
    Ok((least, greatest))
}

/// (free, total) bytes of the current context's device.
pub fn mem_get_info(_: Driver) -> Result<(u64, u64), CudaError> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two sizes; fails without a current context.
    let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
    check(r, "cuMemGetInfo_v2")?;
    Ok((free as u64, total as u64))
}

/// Plain `cuMemAlloc` in the current context (IPC cannot export the async pool's memory).
pub fn mem_alloc(_: Driver, bytes: usize) -> Result<sys::CUdeviceptr, CudaError> {
    let mut ptr = 0;
    // SAFETY: writes the new allocation's address; fails without a current context.
    let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) };
    check(r, "cuMemAlloc_v2")?;
    Ok(ptr)
}

/// # Safety
/// `ptr` came from `mem_alloc` and is freed once; its context is current; no queued or running
/// device work reads or writes it any more.
pub unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: see above.
    check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree_v2")
}

/// The IPC handle of an allocation (the same one however often it is asked).
///
/// # Safety
/// `ptr` is the base of a live `mem_alloc` allocation.
pub unsafe fn ipc_get_mem_handle(ptr: sys::CUdeviceptr) -> Result<[u8; 64], CudaError> {
    let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: writes 64 bytes into `handle`; `ptr` is a live cuMemAlloc base (see above).
    let r = unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) };
    check(r, "cuIpcGetMemHandle")?;
    Ok(handle.reserved.map(|b| b as u8))
}

/// A stream of the current context, destroyed by `stream_destroy`.
pub fn stream_create(_: Driver, flags: u32, priority: i32) -> Result<sys::CUstream, CudaError> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: writes the new stream's handle; fails without a current context.
    let r = unsafe { sys::cuStreamCreateWithPriority(&mut stream, flags, priority) };
    check(r, "cuStreamCreateWithPriority")?;
    Ok(stream)
}

/// # Safety
/// `stream` came from `stream_create`, is destroyed once and not used afterwards; its context
/// is current. (Work already queued on it still completes.)
pub unsafe fn stream_destroy(stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: see above.
    check(
        unsafe { sys::cuStreamDestroy_v2(stream) },
        "cuStreamDestroy_v2",
    )
}

/// Blocks until everything queued on `stream` so far has completed.
///
/// # Safety
/// `stream` is live and its context is current.
pub unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: see above.
    check(
        unsafe { sys::cuStreamSynchronize(stream) },
        "cuStreamSynchronize",
    )
}

/// Queues a wait on `stream` for the most recent record of `event` at the time of this call.
///
/// # Safety
/// `stream` and `event` are live, and the stream's context is current.
pub unsafe fn stream_wait_event(
    stream: sys::CUstream,
    event: sys::CUevent,
) -> Result<(), CudaError> {
    // SAFETY: see above.
    let r = unsafe { sys::cuStreamWaitEvent(stream, event, 0) };
    check(r, "cuStreamWaitEvent")
}

/// An event of the current context (`EVENT_INTERPROCESS` or `EVENT_TIMING`), destroyed by
/// `event_destroy`.
pub fn event_create(_: Driver, flags: u32) -> Result<sys::CUevent, CudaError> {
    let mut event = std::ptr::null_mut();
    // SAFETY: writes the new event's handle; fails without a current context.
    let r = unsafe { sys::cuEventCreate(&mut event, flags) };
    check(r, "cuEventCreate")?;
    Ok(event)
}

/// # Safety
/// `event` came from `event_create`, is destroyed once and not used afterwards; its context is
/// current. (A record still pending completes in the driver; waits already queued stand.)
pub unsafe fn event_destroy(event: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: see above.
    check(
        unsafe { sys::cuEventDestroy_v2(event) },
        "cuEventDestroy_v2",
    )
}

/// Queues a record of `event` on `stream`: it completes when the stream reaches it.
///
/// # Safety
/// `event` and `stream` are live, of the same context, which is current.
pub unsafe fn event_record(event: sys::CUevent, stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: see above.
    check(
        unsafe { sys::cuEventRecord(event, stream) },
        "cuEventRecord",
    )
}

/// Ok(true) when the work before the event's latest record is complete (or it was never
/// recorded), Ok(false) while it is pending. Never blocks.
///
/// # Safety
/// `event` is live and its context is current.
pub unsafe fn event_query(event: sys::CUevent) -> Result<bool, CudaError> {
    // SAFETY: see above.
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => check(r, "cuEventQuery").map(|()| false),
    }
}

/// Milliseconds between two completed records (about 0.5 µs resolution).
///
/// # Safety
/// Both events are live, created with `EVENT_TIMING`, of the context that is current.
pub unsafe fn event_elapsed_ms(start: sys::CUevent, end: sys::CUevent) -> Result<f32, CudaError> {
    let mut ms = 0f32;
    // SAFETY: writes one float; the events are live timing events (see above).
    let r = unsafe { sys::cuEventElapsedTime_v2(&mut ms, start, end) };
    check(r, "cuEventElapsedTime_v2")?;
    Ok(ms)
}

/// # Safety
/// `event` is live and was created with `EVENT_INTERPROCESS`.
pub unsafe fn ipc_get_event_handle(event: sys::CUevent) -> Result<[u8; 64], CudaError> {
    let mut handle = sys::CUipcEventHandle_st { reserved: [0; 64] };
    // SAFETY: writes 64 bytes into `handle`; the event is live and interprocess (see above).
    let r = unsafe { sys::cuIpcGetEventHandle(&mut handle, event) };
    check(r, "cuIpcGetEventHandle")?;
    Ok(handle.reserved.map(|b| b as u8))
}

/// Queues a copy of `len` bytes from host `src` to device `dst` on `stream`; returns before
/// the copy runs (from page-locked memory) or once `src` has been read (from pageable memory).
///
/// # Safety
/// `dst..dst + len` lies in a live allocation of the stream's context, which is current and
/// stays allocated until the stream has passed the copy; `src..src + len` is readable host
/// memory that stays mapped and unchanged until the stream has passed the copy.
pub unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: both ranges outlive the copy and the stream is live (see above).
    let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream) };
    check(r, "cuMemcpyHtoDAsync_v2")
}

/// Queues a copy of `len` bytes from device memory at `src` to device memory at `dst` on
/// `stream`.
///
/// # Safety
/// `dst..dst + len` and `src..src + len` lie in live allocations of the stream's context,
/// which is current; both stay allocated until the stream has passed the copy, and nothing
/// writes the source range before then.
pub unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: both ranges outlive the copy and the stream is live (see above).
    let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream) };
    check(r, "cuMemcpyDtoDAsync_v2")
}

/// Page-locks `len` bytes at `ptr` (`flags`: `HOST_REGISTER_PORTABLE`, with
/// `HOST_REGISTER_READ_ONLY` for a read-only mapping). The driver checks that the range is
/// mapped and not registered already.
///
/// # Safety
/// `ptr..ptr + len` is a mapping of this process that stays mapped until `mem_host_unregister`
/// (unmapping first leaves the pages locked until then); a context is current.
pub unsafe fn mem_host_register(ptr: *mut c_void, len: usize, flags: u32) -> Result<(), CudaError> {
    // SAFETY: see above; registration locks the pages and neither reads nor writes their bytes.
    let r = unsafe { sys::cuMemHostRegister_v2(ptr, len, flags) };
    check(r, "cuMemHostRegister_v2")
}

/// # Safety
/// `ptr` is the start of a range registered by `mem_host_register` and not yet unregistered,
/// and no queued copy reads it any more; a context is current.
pub unsafe fn mem_host_unregister(ptr: *mut c_void) -> Result<(), CudaError> {
    // SAFETY: see above.
    check(
        unsafe { sys::cuMemHostUnregister(ptr) },
        "cuMemHostUnregister",
    )
}

/// Copies `len` bytes from device `src` to host `dst`, synchronously (for tests that read
/// back what was copied).
///
/// # Safety
/// `src..src + len` lies in a live allocation whose context is current, with no copy into it
/// still running; `dst` is writable for `len` bytes.
#[cfg(test)]
pub unsafe fn memcpy_dtoh(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    len: usize,
) -> Result<(), CudaError> {
    // SAFETY: see above.
    let r = unsafe { sys::cuMemcpyDtoH_v2(dst as *mut c_void, src, len) };
    check(r, "cuMemcpyDtoH_v2")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_have_the_driver_values() {
        assert_eq!(EVENT_INTERPROCESS, 6);
        assert_eq!(EVENT_TIMING, 0);
        assert_eq!(STREAM_NON_BLOCKING, 1);
        assert_eq!(HOST_REGISTER_PORTABLE, 1);
        assert_eq!(HOST_REGISTER_READ_ONLY, 8);
    }

    #[test]
    fn every_symbol_used_is_probed() {
        let source = include_str!("ffi.rs");
        let code = &source[..source.find("mod tests {").unwrap()];
        let mut rest = code;
        while let Some(at) = rest.find("sys::cu") {
            rest = &rest[at + 5..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.chars().nth(2).is_some_and(|c| c.is_ascii_lowercase()) {
                continue; // `culib`, the loader
            }
            assert!(SYMBOLS.contains(&name.as_str()), "{name} is not in SYMBOLS");
        }
    }
}
