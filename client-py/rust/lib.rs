//! `weightstream._native`: the Python client's protocol, as a thin PyO3 layer over
//! `weightstream-client` (client-rs), the one implementation of the wire. Python keeps the
//! torch glue (mapping regions, tensor views, CUDA events); everything that speaks to the
//! daemon is here, on one tokio runtime per process, with the GIL released while it waits.
//!
//! - `runtime`: the process's runtime, made again in a forked child;
//! - `client`, `session`: the classes; `records`: the wire's messages as Python records;
//! - `errors`: `ClientError` to the package's exceptions (one mapping);
//! - `raw`: reading tensor bytes handed over by address;
//! - `adamw8`: an 8-bit AdamW step over tensors handed over by address, in place.
//!
//! `raw` and `adamw8` hold the only unsafe code.
#![deny(unsafe_code)]

mod adamw8;
mod client;
mod errors;
mod raw;
mod records;
mod runtime;
mod session;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `socket`, else `$WEIGHTSTREAM_SOCKET`, else the system socket if it exists, else the user's
/// (`$XDG_RUNTIME_DIR/weightstream.sock` or `/tmp/weightstream-<uid>/weightstream.sock`).
#[pyfunction]
#[pyo3(signature = (socket=None))]
fn socket_path(socket: Option<std::path::PathBuf>) -> std::path::PathBuf {
    weightstream_client::Client::socket_path(socket.as_deref())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<client::Client>()?;
    m.add_class::<session::Session>()?;
    records::register(m)?;
    m.add_function(wrap_pyfunction!(socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(adamw8::adamw8bit_step, m)?)?;
    m.add_function(wrap_pyfunction!(adamw8::adamw8bit_isas, m)?)?;
    m.add("ADAMW8_BLOCK", adamw8::BLOCK)?;
    m.add("SYSTEM_SOCKET", weightstream_client::SYSTEM_SOCKET)?;
    m.add("SOCKET_ENV", weightstream_client::SOCKET_ENV)?;
    let hook = wrap_pyfunction!(runtime::_after_fork_in_child, m)?;
    m.add_function(hook.clone())?;
    // As tokenizers does: a forked child (a DataLoader worker) makes its own runtime and
    // connections on first use instead of using the parent's, whose threads it does not have.
    let kwargs = PyDict::new(py);
    kwargs.set_item("after_in_child", hook)?;
    py.import("os")?
        .getattr("register_at_fork")?
        .call((), Some(&kwargs))?;
    Ok(())
}
