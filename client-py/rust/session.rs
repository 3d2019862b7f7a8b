//! `weightstream._native.Session`: the hot path. `submit` and `release` put one message on the
//! session's stream and return (no round trip); the runtime's reader task routes each `Staged`
//! or `Fault` to its ticket; `wait` blocks in Rust with the GIL released. No Python thread is
//! involved. On the host backend `wait` counts the time it blocks for a ticket not yet staged
//! as the client's wait for weights; on CUDA the Python side times its stream and adds what it
//! measures (`add_gpu_wait`). The native session reports the totals to the daemon. On every
//! backend `wait` also keeps the time it blocked apart (`reply_wait`): on CUDA the host issues
//! nothing meanwhile, which the device-side wait cannot show.

use std::collections::HashMap;
use std::os::fd::IntoRawFd;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use weightstream_client as ws;

use crate::errors::{DaemonUnavailable, IntoPy, WeightstreamError};
use crate::records;
use crate::runtime::{block_on, generation, park_on};

/// What `reopen` needs of the `Client` it is given: that client's connection in this process.
/// The client module makes it from a Python `Client` (`FromPyObject`), so that a session need
/// not know the client that opened it.
pub(crate) struct Connection(pub(crate) ws::Client);

/// Locked only while holding the GIL, never across a call that releases it.
struct State {
    /// The fork generation the session was opened in.
    generation: u32,
    /// None once closed, and while `reopen` runs.
    session: Option<ws::Session>,
    /// Submitted, not yet waited for: ticket -> its reply.
    pending: HashMap<u64, ws::Submitted>,
    /// Replies taken by `settle`, not yet by `wait`: ticket -> (group, reply).
    settled: HashMap<u64, (u32, Result<ws::proto::Staged, ws::ClientError>)>,
    layout: Option<Py<records::OpenSessionResponse>>,
}

impl Drop for State {
    fn drop(&mut self) {
        if self.generation != generation() {
            // A parent's session in a forked child: its stream and tasks are the parent's
            // (dropping them would wake tasks of a runtime that has no threads here).
            std::mem::forget(self.session.take());
            std::mem::forget(std::mem::take(&mut self.pending));
        }
    }
}

#[pyclass(module = "weightstream._native", frozen)]
pub struct Session {
    state: Mutex<State>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Session {
    pub(crate) fn new(py: Python<'_>, session: ws::Session) -> PyResult<Session> {
        let layout = Py::new(py, records::layout(py, session.layout())?)?;
        Ok(Session {
            state: Mutex::new(State {
                generation: generation(),
                session: Some(session),
                pending: HashMap::new(),
                settled: HashMap::new(),
                layout: Some(layout),
            }),
        })
    }

    /// The state, if this process opened the session.
    fn state(&self) -> PyResult<MutexGuard<'_, State>> {
        let state = lock(&self.state);
        if state.generation != generation() {
            return Err(WeightstreamError::new_err(
                "this session was opened by the parent process, before a fork: a session \
                 belongs to the process (the connection) that opened it; open a new one in \
                 this process (the client reconnects by itself)",
            ));
        }
        Ok(state)
    }

    fn with<T>(&self, f: impl FnOnce(&ws::Session) -> PyResult<T>) -> PyResult<T> {
        let state = self.state()?;
        match &state.session {
            Some(s) => f(s),
            None => Err(closed()),
        }
    }

    fn submit_inner(&self, group: u32) -> PyResult<u64> {
        let mut state = self.state()?;
        let submitted = match &state.session {
            Some(s) => s.submit(group).py_err()?,
            None => return Err(closed()),
        };
        let ticket = submitted.ticket();
        state.pending.insert(ticket, submitted);
        Ok(ticket)
    }

    fn wait_inner(&self, py: Python<'_>, ticket: u64) -> PyResult<records::Staged> {
        // One lock for both: a reply kept by `settle`, else the ticket still pending.
        let mut submitted = {
            let mut state = self.state()?;
            if let Some((group, reply)) = state.settled.remove(&ticket) {
                drop(state);
                return self.staged(ticket, group, reply.py_err()?, None);
            }
            (state.pending.remove(&ticket)).ok_or_else(|| PyKeyError::new_err(ticket))?
        };
        let group = submitted.group();
        let (reply, blocked) = match submitted.try_staged() {
            Some(reply) => (reply, None),
            None => {
                let started = Instant::now();
                (park_on(py, &mut submitted)?, Some(started.elapsed()))
            }
        };
        let staged = reply.py_err()?;
        self.staged(ticket, group, staged, blocked)
    }

    /// The placement of `ticket`'s reply, checked; `blocked`: how long the caller's thread
    /// waited for it, a wait for weights where the client computes on the host.
    fn staged(
        &self,
        ticket: u64,
        group: u32,
        staged: ws::proto::Staged,
        blocked: Option<Duration>,
    ) -> PyResult<records::Staged> {
        self.with(|s| {
            if let Some(blocked) = blocked {
                s.add_reply_wait(group, blocked);
                if !s.on_device() {
                    s.add_wait(group, blocked, None);
                }
            }
            if s.is_stale(ticket) {
                return Err(DaemonUnavailable::new_err(format!(
                    "ticket {ticket} was staged by a session since reconnected"
                )));
            }
            s.check_staged(group, &staged).py_err()?;
            Ok(records::staged(group, &staged))
        })
    }

    fn release_inner(&self, ticket: u64) -> PyResult<()> {
        let state = self.state()?;
        if let Some(s) = &state.session {
            // A session whose stream ended has nothing to give back to: its next acquire
            // reports why.
            let _ = s.release(ticket);
        }
        Ok(())
    }
}

fn closed() -> PyErr {
    WeightstreamError::new_err("the session is closed")
}

#[pymethods]
impl Session {
    #[getter]
    fn id(&self) -> PyResult<String> {
        self.with(|s| Ok(s.id().to_string()))
    }

    #[getter]
    fn model_id(&self) -> PyResult<String> {
        self.with(|s| Ok(s.model_id().to_string()))
    }

    /// What `OpenSession` answered (of the current opening).
    #[getter]
    fn layout(&self, py: Python<'_>) -> PyResult<Py<records::OpenSessionResponse>> {
        let state = self.state()?;
        state
            .layout
            .as_ref()
            .map(|l| l.clone_ref(py))
            .ok_or_else(closed)
    }

    /// An fd of host region `index` (the caller owns and closes it; it maps it read-only).
    fn region_fd(&self, index: usize) -> PyResult<i32> {
        self.with(|s| {
            let fd = s.region_fd(index).ok_or_else(|| {
                PyValueError::new_err(format!("region {index} is not a host region"))
            })?;
            let owned = fd
                .try_clone_to_owned()
                .map_err(|e| WeightstreamError::new_err(format!("region {index}: dup: {e}")))?;
            Ok(owned.into_raw_fd())
        })
    }

    /// Sends an Acquire for `group`; returns its ticket for `wait`. No round trip.
    fn submit(&self, group: u32) -> PyResult<u64> {
        self.submit_inner(group)
    }

    /// Waits (GIL released) until `ticket` is staged; its placement.
    fn wait(&self, py: Python<'_>, ticket: u64) -> PyResult<records::Staged> {
        self.wait_inner(py, ticket)
    }

    /// `ticket`'s placement if its reply has come (then the same as `wait`), else None: never
    /// blocks, and the ticket stays for a later `wait`.
    fn try_wait(&self, ticket: u64) -> PyResult<Option<records::Staged>> {
        let (group, reply) = {
            let mut state = self.state()?;
            if let Some(settled) = state.settled.remove(&ticket) {
                drop(state);
                return self
                    .staged(ticket, settled.0, settled.1.py_err()?, None)
                    .map(Some);
            }
            let submitted = state
                .pending
                .get_mut(&ticket)
                .ok_or_else(|| PyKeyError::new_err(ticket))?;
            let group = submitted.group();
            match submitted.try_staged() {
                None => return Ok(None),
                Some(reply) => {
                    state.pending.remove(&ticket);
                    (group, reply)
                }
            }
        };
        self.staged(ticket, group, reply.py_err()?, None).map(Some)
    }

    /// Waits (GIL released) until `ticket`'s reply has come, and keeps it for `wait` (or
    /// `try_wait`), which then returns it at once. The time spent here is not counted as a
    /// wait for weights: a caller settles tickets between steps, on purpose.
    fn settle(&self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        let mut submitted = {
            let mut state = self.state()?;
            if state.settled.contains_key(&ticket) {
                return Ok(());
            }
            (state.pending.remove(&ticket)).ok_or_else(|| PyKeyError::new_err(ticket))?
        };
        let reply = match submitted.try_staged() {
            Some(reply) => reply,
            None => park_on(py, &mut submitted)?,
        };
        let group = submitted.group();
        self.state()?.settled.insert(ticket, (group, reply));
        Ok(())
    }

    /// Adds a wait of `ns` nanoseconds for `group` that the caller measured (on CUDA: on its
    /// compute stream), to step `step` (None: the step in progress).
    #[pyo3(signature = (group, ns, step=None))]
    fn add_gpu_wait(&self, group: u32, ns: u64, step: Option<u64>) -> PyResult<()> {
        self.with(|s| {
            let groups = s.group_count();
            if group >= groups {
                return Err(PyValueError::new_err(format!(
                    "group {group} is out of range: the session has {groups} groups"
                )));
            }
            s.add_wait(group, Duration::from_nanos(ns), step);
            Ok(())
        })
    }

    /// Ends a step for the session's waits; the number of the step that starts.
    fn mark_step(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.mark_step()))
    }

    /// The session's waits for weights so far, as this client measured them.
    fn gpu_wait(&self) -> PyResult<records::WaitTotals> {
        self.with(|s| Ok(records::wait_totals(s.waits())))
    }

    /// The time `wait` blocked for replies in this opening (`total_ns`, `waits`, `by_group`).
    fn reply_wait(&self) -> PyResult<records::WaitTotals> {
        self.with(|s| Ok(records::wait_totals(s.reply_waits())))
    }

    /// Sends the daemon the session's waits now (it has them otherwise within 250 ms of a
    /// release), unless it has these totals already.
    fn report_gpu_wait(&self) -> PyResult<()> {
        self.with(|s| s.report_waits().py_err())
    }

    /// The kind of pass (`"train"` or `"sample"`) the next acquires serve: the daemon counts
    /// its work per kind (`SessionStats.kinds`). At a change the waits so far are reported
    /// first, for the kind that ends.
    fn set_pass_kind(&self, kind: &str) -> PyResult<()> {
        let kind = match kind {
            "train" => ws::proto::PassKind::Train,
            "sample" => ws::proto::PassKind::Sample,
            other => {
                return Err(PyValueError::new_err(format!(
                    "kind: {other:?} is not a pass kind: use \"train\" or \"sample\""
                )));
            }
        };
        self.with(|s| s.set_pass_kind(kind).py_err())
    }

    /// Reports of the waits sent to the daemon (of the current opening).
    #[getter]
    fn gpu_wait_reports(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.wait_reports()))
    }

    /// Waits (the GIL released) until the daemon lets this process copy `nbytes` of its own
    /// to the device (`to_device`) or from it: the LoRA's working weights and gradients, paced
    /// with the daemon's copies under a copy bandwidth limit or a share. Returns at once where
    /// the daemon does not pace them (`paces_client_copies` false).
    fn grant(&self, py: Python<'_>, nbytes: u64, to_device: bool) -> PyResult<()> {
        let mut granting = self.with(|s| s.submit_grant(nbytes, to_device).py_err())?;
        park_on(py, &mut granting)?.py_err()
    }

    /// `submit` then `wait`, in one call.
    fn acquire(&self, py: Python<'_>, group: u32) -> PyResult<records::Staged> {
        let ticket = self.submit_inner(group)?;
        self.wait_inner(py, ticket)
    }

    /// Gives `ticket` back: one message, no round trip. A ticket of an opening before a
    /// reconnect, or of a session whose stream ended, is dropped.
    fn release(&self, ticket: u64) -> PyResult<()> {
        self.release_inner(ticket)
    }

    /// `release(ticket)` then `acquire(group)` in one call: two messages on the wire (Release,
    /// then Acquire), written back to back; one crossing into Rust instead of two.
    fn release_and_acquire(
        &self,
        py: Python<'_>,
        ticket: u64,
        group: u32,
    ) -> PyResult<records::Staged> {
        self.release_inner(ticket)?;
        self.acquire(py, group)
    }

    /// Sends the access plan of one step (sent again by `reopen`).
    fn plan(&self, groups: Vec<u32>) -> PyResult<()> {
        self.with(|s| {
            s.send_plan(groups);
            Ok(())
        })
    }

    #[getter]
    fn last_plan(&self) -> PyResult<Option<Vec<u32>>> {
        self.with(|s| Ok(s.last_plan()))
    }

    /// Acquires sent so far (across reconnects).
    #[getter]
    fn submitted(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.submitted()))
    }

    /// Why the session's stream ended, once it has (else None).
    #[getter]
    fn ended(&self) -> PyResult<Option<String>> {
        let state = self.state()?;
        Ok(match &state.session {
            Some(s) => s.ended(),
            None => Some("the session is closed".into()),
        })
    }

    /// Ends the stream (a daemon that is still up tears the session down); tickets in flight
    /// fail with `DaemonUnavailable` ("reconnected"). The first half of a reconnect.
    fn disconnect(&self) -> PyResult<()> {
        let mut state = self.state()?;
        if let Some(s) = state.session.as_mut() {
            s.disconnect();
        }
        Ok(())
    }

    /// Opens the session again through `client` (same groups, budget, staging, device, label;
    /// the plan last sent is sent again) with `model_id`, which the daemon must have.
    fn reopen(&self, py: Python<'_>, client: Connection, model_id: String) -> PyResult<()> {
        let Connection(c) = client;
        let mut session = {
            let mut state = self.state()?;
            state.layout = None;
            state.session.take().ok_or_else(closed)?
        };
        let (session, result) = block_on(py, async move {
            let result = session.reopen(c, &model_id).await;
            (session, result)
        })?;
        let layout = match &result {
            Ok(()) => Some(Py::new(py, records::layout(py, session.layout())?)?),
            Err(_) => None,
        };
        let mut state = self.state()?;
        state.session = Some(session);
        state.layout = layout;
        result.py_err()
    }

    /// Closes the session (`CloseSession`, unless its stream already ended) and its stream;
    /// safe to call twice. Host regions the caller mapped are its to unmap first.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let session = {
            let mut state = self.state()?;
            state.pending.clear();
            state.settled.clear();
            state.layout = None;
            state.session.take()
        };
        let Some(session) = session else {
            return Ok(());
        };
        if session.ended().is_some() {
            return Ok(());
        }
        block_on(py, session.close())?.py_err()
    }

    #[getter]
    fn closed(&self) -> PyResult<bool> {
        Ok(self.state()?.session.is_none())
    }

    fn __repr__(&self) -> String {
        match self.state() {
            Ok(state) => match &state.session {
                Some(s) => format!("Session(id={:?}, model_id={:?})", s.id(), s.model_id()),
                None => "Session(closed)".into(),
            },
            Err(_) => "Session(of the parent process)".into(),
        }
    }
}
