//! The CUDA driver calls weightstream makes, layered raw → Result → RAII as in cudarc.
//!
//! cudarc loads libcuda lazily and panics on a missing library or symbol, so `probe` checks
//! both first and every later call can only fail with a `CudaError`.
#![allow(unsafe_code)]

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
    "cuStreamCreateWithPriority",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuIpcGetEventHandle",
    "cuGetErrorName",
    "cuGetErrorString",
];

fn error_text(r: sys::CUresult) -> (String, String) {
    let mut name: *const c_char = std::ptr::null();
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: both calls write a pointer to a static string owned by the driver, or leave
    // ours null on an unknown code; we read them only when non-null.
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

pub fn check(r: sys::CUresult, call: &'static str) -> Result<(), CudaError> {
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
/// number of devices, or why CUDA cannot be used.
pub fn probe() -> Result<i32, String> {
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
    check(
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    )
    .map_err(|e| e.to_string())?;
    if count == 0 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(count)
}

/// A raw driver handle that may cross threads: CUDA contexts, streams and events are
/// thread-safe objects of the driver, usable from any thread with the context current.
#[derive(Debug, Clone, Copy)]
pub struct Handle<T>(pub T);
// SAFETY: see the type's comment; the handles are opaque pointers owned by the driver.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Handle<T> {}

/// One device: its primary context and the streams of its copy thread.
pub struct Device {
    pub ordinal: i32,
    pub ctx: Handle<sys::CUcontext>,
    pub dev: sys::CUdevice,
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub total_memory: u64,
    /// High-priority stream for copies.
    pub copy: Handle<sys::CUstream>,
}

impl Device {
    pub fn open(ordinal: i32) -> Result<Device, CudaError> {
        let mut dev = 0;
        // SAFETY: writes the device handle for a valid ordinal (< cuDeviceGetCount).
        check(
            unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
            "cuDeviceGet",
        )?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: retains the device's primary context (released in Drop).
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let mut device = Device {
            ordinal,
            ctx: Handle(ctx),
            dev,
            uuid: String::new(),
            name: String::new(),
            pci_bus_id: String::new(),
            total_memory: 0,
            copy: Handle(std::ptr::null_mut()),
        };
        device.bind()?;
        device.describe()?;
        let (mut _least, mut greatest) = (0, 0);
        // SAFETY: writes the priority range of the current context.
        check(
            unsafe { sys::cuCtxGetStreamPriorityRange(&mut _least, &mut greatest) },
            "cuCtxGetStreamPriorityRange",
        )?;
        device.copy = Handle(new_stream(greatest)?);
        Ok(device)
    }

    fn describe(&mut self) -> Result<(), CudaError> {
        let mut name = [0 as c_char; 256];
        // SAFETY: writes at most 256 bytes, NUL-terminated, into `name`.
        check(
            unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, self.dev) },
            "cuDeviceGetName",
        )?;
        // SAFETY: NUL-terminated by the driver within the buffer.
        self.name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut pci = [0 as c_char; 64];
        // SAFETY: as above, 64 bytes.
        check(
            unsafe { sys::cuDeviceGetPCIBusId(pci.as_mut_ptr(), 64, self.dev) },
            "cuDeviceGetPCIBusId",
        )?;
        // SAFETY: NUL-terminated by the driver within the buffer.
        self.pci_bus_id = unsafe { CStr::from_ptr(pci.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut uuid = sys::CUuuid_st { bytes: [0; 16] };
        // SAFETY: writes 16 bytes into `uuid`.
        check(
            unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, self.dev) },
            "cuDeviceGetUuid_v2",
        )?;
        self.uuid = format_uuid(&uuid.bytes.map(|b| b as u8));
        let mut total = 0usize;
        // SAFETY: writes the device's memory size.
        check(
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, self.dev) },
            "cuDeviceTotalMem_v2",
        )?;
        self.total_memory = total as u64;
        Ok(())
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained for the life of `self`.
        check(
            unsafe { sys::cuCtxSetCurrent(self.ctx.0) },
            "cuCtxSetCurrent",
        )
    }

    pub fn free_memory(&self) -> Result<u64, CudaError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes for the current context's device.
        check(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo_v2",
        )?;
        Ok(free as u64)
    }

    pub fn sync_copies(&self) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the stream lives as long as `self`.
        check(
            unsafe { sys::cuStreamSynchronize(self.copy.0) },
            "cuStreamSynchronize",
        )
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: the stream was created in this context and is not used after this.
            unsafe {
                if !self.copy.0.is_null() {
                    sys::cuStreamDestroy_v2(self.copy.0);
                }
                sys::cuDevicePrimaryCtxRelease_v2(self.dev);
            }
        }
    }
}

fn new_stream(priority: i32) -> Result<sys::CUstream, CudaError> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: creates a non-blocking stream in the current context; destroyed in Device::drop.
    check(
        unsafe { sys::cuStreamCreateWithPriority(&mut stream, 1, priority) },
        "cuStreamCreateWithPriority",
    )?;
    Ok(stream)
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

/// Device memory from plain cuMemAlloc (IPC cannot export the async pool's), freed on drop.
pub struct DeviceAlloc {
    pub ptr: sys::CUdeviceptr,
}

impl DeviceAlloc {
    /// `device` must be bound on this thread.
    pub fn new(bytes: usize) -> Result<DeviceAlloc, CudaError> {
        let mut ptr = 0;
        // SAFETY: allocates `bytes` of device memory in the current context.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) },
            "cuMemAlloc_v2",
        )?;
        Ok(DeviceAlloc { ptr })
    }

    pub fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `ptr` is the base of a cuMemAlloc allocation, which IPC can export.
        check(
            unsafe { sys::cuIpcGetMemHandle(&mut handle, self.ptr) },
            "cuIpcGetMemHandle",
        )?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    /// Frees the memory; the caller has bound the context and synchronised the streams that
    /// write it.
    pub fn free(self) -> Result<(), CudaError> {
        let ptr = self.ptr;
        std::mem::forget(self);
        // SAFETY: `ptr` came from cuMemAlloc and is freed once (self is forgotten).
        check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree_v2")
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // Reached only when `free` was not called (an error path before export).
        // SAFETY: `ptr` came from cuMemAlloc and is freed once.
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// An interprocess event (INTERPROCESS | DISABLE_TIMING), destroyed on drop.
pub struct IpcEvent(pub Handle<sys::CUevent>);

impl IpcEvent {
    /// The context must be bound on this thread.
    pub fn new() -> Result<(IpcEvent, [u8; 64]), CudaError> {
        let mut event = std::ptr::null_mut();
        // SAFETY: flags 6 = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING (not one enum
        // variant in cudarc, hence the raw value).
        check(
            unsafe { sys::cuEventCreate(&mut event, 6) },
            "cuEventCreate",
        )?;
        let event = IpcEvent(Handle(event));
        let mut handle = sys::CUipcEventHandle_st { reserved: [0; 64] };
        // SAFETY: the event was created with the interprocess flag.
        check(
            unsafe { sys::cuIpcGetEventHandle(&mut handle, event.0.0) },
            "cuIpcGetEventHandle",
        )?;
        Ok((event, handle.reserved.map(|b| b as u8)))
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once; pending records complete asynchronously in the driver.
        unsafe {
            sys::cuEventDestroy_v2(self.0.0);
        }
    }
}

/// Queues a wait for `event` on `stream`.
pub fn wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: both handles are live (owned by the device and the session's pool).
    check(
        unsafe { sys::cuStreamWaitEvent(stream, event, 0) },
        "cuStreamWaitEvent",
    )
}

/// True when the event is complete (or was never recorded); false while pending or on error
/// (a wait is then queued, which is always correct).
pub fn query_event(event: sys::CUevent) -> bool {
    // SAFETY: the event is live (owned by the session's pool).
    unsafe { sys::cuEventQuery(event) == sys::CUresult::CUDA_SUCCESS }
}

pub fn record_event(stream: sys::CUstream, event: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: as above.
    check(
        unsafe { sys::cuEventRecord(event, stream) },
        "cuEventRecord",
    )
}

/// Queues a host-to-device copy. `src` must stay valid until the copy completes (store
/// arenas outlive the sessions that copy from them).
pub fn copy_h2d(dst: sys::CUdeviceptr, src: &[u8], stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: dst..dst+len lies in a live allocation (checked by the caller); src is valid for
    // len bytes for as long as the copy runs (see above).
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), stream) },
        "cuMemcpyHtoDAsync_v2",
    )
}

pub fn sync_stream(stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: the stream is live.
    check(
        unsafe { sys::cuStreamSynchronize(stream) },
        "cuStreamSynchronize",
    )
}

/// Page-locks `len` bytes at `ptr` (portable: pinned for every context).
pub fn host_register(ptr: usize, len: usize) -> Result<(), CudaError> {
    // SAFETY: the range is a live mapping owned by the store that outlives the registration
    // (the guard unregisters before the mapping is dropped). Flag 1 = PORTABLE.
    check(
        unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, 1) },
        "cuMemHostRegister_v2",
    )
}

pub fn host_unregister(ptr: usize) -> Result<(), CudaError> {
    // SAFETY: `ptr` was registered by host_register and not yet unregistered.
    check(
        unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) },
        "cuMemHostUnregister",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_formatted_like_nvidia_smi() {
        let b: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(format_uuid(&b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
