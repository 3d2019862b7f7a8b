//! The one place the extension reads memory it is handed by address: the bytes of a
//! contiguous CPU tensor, given as `(data_ptr, nbytes)` by the package's own Python code (the
//! stable ABI of Python 3.10 has no buffer protocol to borrow them through).
#![allow(unsafe_code)]

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The `len` bytes at `ptr`.
///
/// # Safety
/// `ptr..ptr + len` must be readable memory that stays allocated, and is not written, until
/// the returned slice is dropped: `weightstream.client.Client.upload_model` passes the
/// `data_ptr()` and `nbytes` of a contiguous CPU tensor that it holds a reference to until
/// the call returns.
pub(crate) unsafe fn host_bytes<'a>(ptr: usize, len: usize) -> PyResult<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr == 0 || ptr.checked_add(len).is_none() || len > isize::MAX as usize {
        return Err(PyValueError::new_err(format!(
            "tensor bytes: ({ptr:#x}, {len}) is not a valid address range"
        )));
    }
    // SAFETY: non-null, the range does not wrap and fits isize (checked above); readable,
    // alive and unwritten for 'a by this function's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
}
