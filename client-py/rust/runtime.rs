//! One tokio runtime per process: made on first use, and made again in a forked child (a
//! DataLoader worker), whose copy of the parent's runtime has no threads behind it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

/// Bumped in the child by the at-fork hook (`os.register_at_fork(after_in_child=...)`, see
/// `lib.rs`). Whatever this module's objects hold was made in the generation they note: in
/// another one it belongs to a parent process, whose runtime ran its tasks.
static FORKS: AtomicU32 = AtomicU32::new(0);

/// How often a blocking call looks for signals (Ctrl-C) while it waits.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// Runtime worker threads (the hot path needs one: it only routes replies).
const THREADS_ENV: &str = "WEIGHTSTREAM_RUNTIME_THREADS";

pub(crate) fn generation() -> u32 {
    FORKS.load(Ordering::Acquire)
}

/// Registered with `os.register_at_fork(after_in_child=...)` when the module is imported.
#[pyfunction]
pub(crate) fn _after_fork_in_child() {
    FORKS.fetch_add(1, Ordering::AcqRel);
}

struct Current {
    generation: u32,
    runtime: &'static Runtime,
}

static RUNTIME: Mutex<Option<Current>> = Mutex::new(None);

/// This process's runtime. The lock is taken only while holding the GIL (hence `py`), so no
/// other thread can hold it when `os.fork()` runs (the forking thread holds the GIL). A parent's
/// runtime is leaked in the child, never dropped: its drop would wait for threads that are not
/// there.
pub(crate) fn runtime(_py: Python<'_>) -> PyResult<&'static Runtime> {
    let mut current = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
    let generation = generation();
    if let Some(c) = &*current
        && c.generation == generation
    {
        return Ok(c.runtime);
    }
    let threads = std::env::var(THREADS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("weightstream-rt")
        .enable_all()
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("weightstream: no tokio runtime: {e}")))?;
    let runtime: &'static Runtime = Box::leak(Box::new(runtime));
    *current = Some(Current {
        generation,
        runtime,
    });
    Ok(runtime)
}

/// Runs `fut` to completion on this thread with the GIL released, looking for signals every
/// 100 ms: a `KeyboardInterrupt` drops the future, which cancels the call.
pub(crate) fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime(py)?;
    let mut fut = std::pin::pin!(fut);
    loop {
        // The timer is made inside `block_on`: it needs the runtime's context.
        let polled =
            py.detach(|| rt.block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut fut).await }));
        match polled {
            Ok(out) => return Ok(out),
            Err(_) => py.check_signals()?,
        }
    }
}

/// Wakes the thread that waits in [`park_on`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// The hot path's wait: polls `fut` on this thread, parked (GIL released) until its waker
/// unparks it, looking for signals every 100 ms. For a future that needs no runtime context
/// (a ticket's reply, routed by the runtime's reader task): no timer is registered, so a wait
/// costs the reader one unpark and this thread one park.
pub(crate) fn park_on<F>(py: Python<'_>, fut: &mut F) -> PyResult<F::Output>
where
    F: Future + Unpin + Send,
    F::Output: Send,
{
    loop {
        let polled = py.detach(|| {
            let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
            let mut cx = Context::from_waker(&waker);
            let deadline = Instant::now() + SIGNAL_CHECK;
            loop {
                if let Poll::Ready(out) = Pin::new(&mut *fut).poll(&mut cx) {
                    return Some(out);
                }
                let now = Instant::now();
                if now >= deadline {
                    return None;
                }
                std::thread::park_timeout(deadline - now);
            }
        });
        match polled {
            Some(out) => return Ok(out),
            None => py.check_signals()?,
        }
    }
}
