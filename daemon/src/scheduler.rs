//! CopyScheduler: one queue and one copy thread per device, shared by every session.
//!
//! The host-to-device link is one resource (two processes copying at once get half each), so
//! all copies to a device go through one queue: demand fetches (a client is waiting) before
//! prefetches, and round-robin between sessions within each class, so that one session's deep
//! prefetch cannot starve another's demand. The thread is dedicated because the CUDA backend
//! binds its context to it (tokio moves tasks between threads).
//!
//! Copy bandwidth limits (`pacing`): a device's limit emulates a slower link, so the copy
//! thread itself waits for it: each copy goes in pieces of [`PACED_CHUNK`] bytes, each piece
//! issued once the device's bucket allows it. Pacing is on *issue*, not completion: on CUDA a
//! copy returns once queued, and waiting for completion would leave the link idle between
//! pieces. It holds because the real link is faster than the limit: what is queued ahead of
//! the limit's schedule is at most the burst ([`PACING_BURST`]) plus one piece, so completions
//! trail issues by that much and the completed rate over any window of seconds is the limit's
//! within (burst + piece) / window. The pieces keep the emulation honest at a group's scale: a
//! 150 MB group completes after 150 MB / limit, as on the slower link, not in one burst.
//! The limit is on what crosses the link: a session's `bytes_copied` follows it, while the
//! bytes its client uses run ahead of it by what the staging arena serves again without a copy.
//! A session's share is a policy, not a link: a session in debt with its own bucket is passed
//! over (as a copy waiting on its events is) so that the others use the link meanwhile; it is
//! charged a whole copy when the copy starts. A session its share allows goes before those
//! without a share (its share holds it to its part; the others get the rest), and what its share
//! earns while it waits for another session's copy is kept past the burst, for its next copy.
//! While every ready copy is held back by its session's share the thread sleeps until the first
//! share allows one (a submission, a cancel or a stop wakes it sooner), and a held session is
//! passed over without a look at its queue: the thread's cost is in sessions, not in requests.
//!
//! Clients' own copies (grants, [`Work::Grant`]) go the same way, 8 MiB a turn in each
//! direction (device to host on a thread of its own), so one session's grants cost another at
//! most a piece; a session's end drops them, the piece being let go included.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, CopyJob, CopyTiming};
use crate::config::CopyRate;
use crate::pacing::{Clock, SystemClock, TokenBucket};

/// The target of the debug events that trace each session's acquires, releases and copies
/// (`WEIGHTSTREAM_LOG=weightstream::timeline=debug`): a timeline to set against the client's.
pub const TIMELINE: &str = "weightstream::timeline";

/// The tag of a request that copies no group (a grant, a session's resident groups): no
/// group's prefetch is ever promoted to it, and the timeline names no group for it.
pub const NO_GROUP: u32 = u32::MAX;

/// A request's tag in the timeline: its group, or `-` for `NO_GROUP`.
struct TagLabel(u32);

impl std::fmt::Display for TagLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            NO_GROUP => f.write_str("-"),
            group => write!(f, "{group}"),
        }
    }
}

/// Largest piece of a paced copy (about 0.34 ms at 25 GB/s; 4 MB copies already run at 53 of
/// the H200's 55 GB/s, so pieces cost the link next to nothing).
pub const PACED_CHUNK: u64 = 8 << 20;
/// What a bucket lends after an idle spell: two pieces. It also absorbs the copy thread's late
/// wake-ups (timer slack, the time to queue a piece) without losing rate.
pub const PACING_BURST: u64 = 2 * PACED_CHUNK;

/// How the copy threads pace: the devices' limits (bytes per second; `None`: the link's own
/// speed) and the clock they read and sleep on.
#[derive(Clone)]
pub struct Pacing {
    pub device_limit: Option<CopyRate>,
    pub clock: Arc<dyn Clock>,
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing {
            device_limit: None,
            clock: Arc::new(SystemClock::default()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    Demand,
    Prefetch,
}

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("copy cancelled: its session ended")]
    Cancelled,
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// What the scheduler reports back to whoever submitted a copy.
#[derive(Debug)]
pub struct CopyOutcome {
    pub result: Result<(), CopyError>,
    /// Bytes over the link (a copy's from the store, a grant's).
    pub bytes: u64,
    /// Bytes copied within the device (from a resident region).
    pub from_device: u64,
    /// How long the backend's `copy` took: the copy itself on the host, queueing it on CUDA.
    pub elapsed: Duration,
}

pub type CopyDone = Box<dyn FnOnce(CopyOutcome) + Send>;

pub struct CopyRequest {
    pub session: u64,
    /// What the copy is for (a group id), so that a queued prefetch can be promoted.
    pub tag: u32,
    pub priority: Priority,
    pub work: Work,
    pub done: CopyDone,
}

/// What a request does once it has the link.
pub enum Work {
    /// A copy the copy thread issues.
    Copy(CopyJob),
    /// A client's own copy of `bytes` (a CopyGrant), `left` of them not yet let go: let go
    /// piece by piece, each piece charged to the device's limit (and, to the device, the
    /// session's share) when its turn comes, the session going to the back of the line after
    /// each; answered once the last piece may go. The client issues the copy itself.
    Grant { bytes: u64, left: u64 },
}

impl Work {
    /// A grant of `bytes`, none of them let go yet.
    pub fn grant(bytes: u64) -> Work {
        Work::Grant { bytes, left: bytes }
    }

    fn ready(&self) -> bool {
        match self {
            Work::Copy(job) => job.ready(),
            Work::Grant { .. } => true,
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Work::Copy(job) => job.bytes(),
            Work::Grant { bytes, .. } => *bytes,
        }
    }

    /// What its next turn charges: a whole copy, or a grant's next piece.
    fn turn_bytes(&self) -> u64 {
        match self {
            Work::Copy(job) => job.link_bytes(),
            Work::Grant { left, .. } => (*left).min(PACED_CHUNK),
        }
    }
}

/// The largest grant a client may ask for (CopyGrant.bytes), within the bytes its session is
/// charged for: clients split larger copies into several grants. It bounds what one grant keeps
/// queued, not what it holds the link for: that is one piece ([`PACED_CHUNK`]) per turn.
pub const MAX_GRANT_BYTES: u64 = 256 << 20;

/// Per-device counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCopyStats {
    pub copies: u64,
    pub bytes: u64,
    /// Time the copies kept the device busy, as the backend measures it (CUDA: timing events
    /// around each batch on the copy stream; host: the memcpy), not the time to queue them.
    pub busy_ns: u64,
    pub queued: u64,
    /// Time the copy thread waited for the device's copy bandwidth limit.
    pub throttled_ns: u64,
    /// Time the copy thread waited with copies ready that sessions' shares held back.
    pub share_throttled_ns: u64,
    /// Bytes of clients' own copies granted, host to device and device to host.
    pub granted_h2d_bytes: u64,
    pub granted_d2h_bytes: u64,
}

#[derive(Default)]
struct Lanes {
    per_session: HashMap<u64, VecDeque<CopyRequest>>,
    order: VecDeque<u64>,
}

impl Lanes {
    fn push(&mut self, req: CopyRequest) {
        let queue = self.per_session.entry(req.session).or_default();
        if queue.is_empty() {
            self.order.push_back(req.session);
        }
        queue.push_back(req);
    }

    /// Puts a request back at the head of its session's queue, the session at the back of the
    /// line (a grant's pieces go in turn with the other sessions, in order within its own).
    fn requeue(&mut self, req: CopyRequest) {
        let queue = self.per_session.entry(req.session).or_default();
        if queue.is_empty() {
            self.order.push_back(req.session);
        }
        queue.push_front(req);
    }

    /// The next request, one session at a time in turn.
    fn pop(&mut self) -> Option<CopyRequest> {
        self.pop_ready(|_| true, |_| true)
    }

    /// The next request that `ready` accepts from a session that `session_ok` accepts: sessions
    /// in turn, and within a session the oldest ready one (a copy still waiting on its client's
    /// reads lets the others pass). A session held back is passed over without looking at its
    /// requests: the cost is in sessions, not in what they have queued.
    fn pop_ready(
        &mut self,
        session_ok: impl Fn(u64) -> bool,
        ready: impl Fn(&CopyRequest) -> bool,
    ) -> Option<CopyRequest> {
        for turn in 0..self.order.len() {
            let session = self.order[turn];
            if !session_ok(session) {
                continue;
            }
            let queue = self.per_session.get_mut(&session)?;
            let Some(at) = queue.iter().position(&ready) else {
                continue;
            };
            let req = queue.remove(at);
            self.order.remove(turn);
            if queue.is_empty() {
                self.per_session.remove(&session);
            } else {
                self.order.push_back(session);
            }
            return req;
        }
        None
    }

    fn take(&mut self, session: u64, tag: u32) -> Option<CopyRequest> {
        let queue = self.per_session.get_mut(&session)?;
        let at = queue.iter().position(|r| r.tag == tag)?;
        let req = queue.remove(at);
        if queue.is_empty() {
            self.per_session.remove(&session);
            self.order.retain(|s| *s != session);
        }
        req
    }

    fn take_session(&mut self, session: u64) -> VecDeque<CopyRequest> {
        self.order.retain(|s| *s != session);
        self.per_session.remove(&session).unwrap_or_default()
    }

    /// Whether the session has a request `ready` accepts (looking no further than the first).
    fn has_ready(&self, session: u64, ready: impl Fn(&CopyRequest) -> bool) -> bool {
        self.per_session
            .get(&session)
            .is_some_and(|queue| queue.iter().any(ready))
    }

    fn len(&self) -> usize {
        self.per_session.values().map(VecDeque::len).sum()
    }
}

/// The request a thread is running, by session: a cancel of its session marks it, so that a
/// grant's rest is not put back in the queue.
#[derive(Clone, Copy)]
struct Running {
    session: u64,
    cancelled: bool,
}

impl Running {
    fn mark(running: &mut Option<Running>, session: u64) {
        if let Some(r) = running.as_mut().filter(|r| r.session == session) {
            r.cancelled = true;
        }
    }

    fn cancelled(running: Option<Running>) -> bool {
        running.is_some_and(|r| r.cancelled)
    }
}

#[derive(Default)]
struct QueueState {
    demand: Lanes,
    prefetch: Lanes,
    /// Grants of clients' own copies from the device: the link's other direction, which the
    /// daemon's copies never use, served by its own thread.
    back: Lanes,
    /// What the copy thread and the back thread are running.
    running: Option<Running>,
    running_back: Option<Running>,
    stopping: bool,
    stats: DeviceCopyStats,
    /// Sessions' shares of the device's copy bandwidth, by session.
    shares: HashMap<u64, TokenBucket>,
}

struct DeviceQueue {
    state: Mutex<QueueState>,
    /// Wakes the copy thread: a submission, a cancel, a stop.
    wake: Condvar,
    /// Wakes the back thread likewise.
    back_wake: Condvar,
    limit: Option<CopyRate>,
}

impl DeviceQueue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct CopyScheduler {
    queues: Vec<Arc<DeviceQueue>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Copy threads still running: a stop can wait for them with a deadline (a copy stuck in
    /// the driver must not hold the daemon's exit forever).
    running: Arc<tokio::sync::watch::Sender<usize>>,
    clock: Arc<dyn Clock>,
}

/// Counts its thread out when the thread ends, however it ends.
struct Counted(Arc<tokio::sync::watch::Sender<usize>>);

impl Counted {
    fn new(running: &Arc<tokio::sync::watch::Sender<usize>>) -> Counted {
        running.send_modify(|n| *n += 1);
        Counted(running.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

impl CopyScheduler {
    /// Starts one copy thread per device, unpaced.
    pub fn start(backend: Arc<dyn Backend>, devices: usize) -> std::io::Result<Arc<Self>> {
        Self::start_paced(backend, devices, Pacing::default())
    }

    /// Starts one copy thread per device, each paced to `pacing.device_limit`.
    pub fn start_paced(
        backend: Arc<dyn Backend>,
        devices: usize,
        pacing: Pacing,
    ) -> std::io::Result<Arc<Self>> {
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        let running = Arc::new(tokio::sync::watch::Sender::new(0));
        for device in 0..devices {
            let queue = Arc::new(DeviceQueue {
                state: Mutex::new(QueueState::default()),
                wake: Condvar::new(),
                back_wake: Condvar::new(),
                limit: pacing.device_limit,
            });
            queues.push(queue.clone());
            let (q, b, clock) = (queue.clone(), backend.clone(), pacing.clock.clone());
            let counted = Counted::new(&running);
            let copy = std::thread::Builder::new()
                .name(format!("ws-copy-{device}"))
                .spawn(move || {
                    let _counted = counted;
                    copy_loop(device, &q, b.as_ref(), clock.as_ref());
                });
            // Without a limit a grant from the device is answered at once: no thread.
            let back = pacing.device_limit.map(|rate| {
                let (q, clock) = (queue.clone(), pacing.clock.clone());
                let counted = Counted::new(&running);
                std::thread::Builder::new()
                    .name(format!("ws-grant-back-{device}"))
                    .spawn(move || {
                        let _counted = counted;
                        let bucket = TokenBucket::new(rate, PACING_BURST, clock.now());
                        back_loop(&q, clock.as_ref(), bucket);
                    })
            });
            match (copy, back.transpose()) {
                (Ok(copy), Ok(back)) => threads.extend([Some(copy), back].into_iter().flatten()),
                (copy, back) => {
                    // Threads already started end with the queues they serve.
                    queues.iter().for_each(|q: &Arc<DeviceQueue>| q.stop());
                    let error = copy.as_ref().err().or(back.as_ref().err());
                    let error = error.map_or_else(
                        || std::io::Error::other("a thread failed to start"),
                        |e| std::io::Error::new(e.kind(), e.to_string()),
                    );
                    return Err(error);
                }
            }
        }
        Ok(Arc::new(CopyScheduler {
            queues,
            threads: Mutex::new(threads),
            running,
            clock: pacing.clock,
        }))
    }

    /// The device's copy bandwidth limit, bytes per second.
    pub fn limit(&self, device: usize) -> Option<CopyRate> {
        self.queues[device].limit
    }

    /// Caps a session's copies to the device at `rate` bytes per second (within the device's
    /// own limit), until [`cancel_session`](Self::cancel_session) or the guard's drop.
    pub fn set_share(self: &Arc<Self>, device: usize, session: u64, rate: CopyRate) -> ShareGuard {
        let bucket = TokenBucket::new(rate, PACING_BURST, self.clock.now());
        self.queues[device].lock().shares.insert(session, bucket);
        ShareGuard {
            scheduler: self.clone(),
            device,
            session,
            kept: false,
        }
    }

    /// Queues a grant of a client's own copy from the device (CopyGrant, device to host, in
    /// `req.work`): under the device's limit, its pieces go in turn with other sessions' on the
    /// link's other direction, each charged to that direction's bucket when it goes, and `done`
    /// reports once the last may go; without a limit, at once.
    pub fn submit_from_device(&self, device: usize, req: CopyRequest) {
        let queue = &self.queues[device];
        let mut state = queue.lock();
        if state.stopping {
            drop(state);
            return cancel(req);
        }
        if queue.limit.is_none() {
            let bytes = req.work.bytes();
            state.stats.granted_d2h_bytes += bytes;
            drop(state);
            return (req.done)(CopyOutcome {
                result: Ok(()),
                bytes,
                from_device: 0,
                elapsed: Duration::ZERO,
            });
        }
        state.back.push(req);
        queue.back_wake.notify_one();
    }

    /// The session's share, bytes per second, if it has one.
    pub fn share(&self, device: usize, session: u64) -> Option<CopyRate> {
        let state = self.queues[device].lock();
        state.shares.get(&session).map(TokenBucket::rate)
    }

    pub fn submit(&self, device: usize, req: CopyRequest) {
        let queue = &self.queues[device];
        let mut state = queue.lock();
        if state.stopping {
            drop(state);
            cancel(req);
            return;
        }
        match req.priority {
            Priority::Demand => state.demand.push(req),
            Priority::Prefetch => state.prefetch.push(req),
        }
        queue.wake.notify_one();
    }

    /// A client now waits for a queued prefetch: move it to the demand queue. False when it is
    /// not queued (already copying or done).
    pub fn promote(&self, device: usize, session: u64, tag: u32) -> bool {
        let mut state = self.queues[device].lock();
        match state.prefetch.take(session, tag) {
            Some(mut req) => {
                req.priority = Priority::Demand;
                state.demand.push(req);
                true
            }
            None => false,
        }
    }

    /// Drops a session's queued copies (each reports `Cancelled`) and its share; a copy
    /// already running finishes and reports as usual. Returns how many were dropped.
    /// A grant being let go ends with its current piece.
    pub fn cancel_session(&self, device: usize, session: u64) -> usize {
        let queue = &self.queues[device];
        let dropped: Vec<CopyRequest> = {
            let mut state = queue.lock();
            state.shares.remove(&session);
            Running::mark(&mut state.running, session);
            Running::mark(&mut state.running_back, session);
            let mut d: Vec<_> = state.demand.take_session(session).into();
            d.extend(state.prefetch.take_session(session));
            d.extend(state.back.take_session(session));
            d
        };
        queue.wake.notify_all();
        queue.back_wake.notify_all();
        let n = dropped.len();
        dropped.into_iter().for_each(cancel);
        n
    }

    pub fn stats(&self, device: usize) -> DeviceCopyStats {
        let state = self.queues[device].lock();
        DeviceCopyStats {
            queued: (state.demand.len() + state.prefetch.len() + state.back.len()) as u64,
            ..state.stats
        }
    }

    pub fn devices(&self) -> usize {
        self.queues.len()
    }

    /// Cancels what is queued and tells each copy thread to end once its running copy
    /// returns; does not wait (see [`stopped`](Self::stopped)).
    pub fn stop(&self) {
        self.queues.iter().for_each(|q| q.stop());
    }

    /// Resolves once every copy thread has ended (after [`stop`](Self::stop)).
    pub async fn stopped(&self) {
        let mut running = self.running.subscribe();
        let _ = running.wait_for(|n| *n == 0).await;
    }

    /// Copy threads that have not ended yet.
    pub fn running_threads(&self) -> usize {
        *self.running.borrow()
    }

    /// Stops, then joins the threads (blocking: for tests and synchronous owners).
    pub fn shutdown(&self) {
        self.stop();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

/// Holds a session's share while the session is being opened: dropped, it takes the share
/// back; kept, the share lasts until the session's teardown cancels its copies.
pub struct ShareGuard {
    scheduler: Arc<CopyScheduler>,
    device: usize,
    session: u64,
    kept: bool,
}

impl ShareGuard {
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for ShareGuard {
    fn drop(&mut self) {
        if !self.kept {
            let queue = &self.scheduler.queues[self.device];
            queue.lock().shares.remove(&self.session);
        }
    }
}

impl DeviceQueue {
    fn stop(&self) {
        let dropped: Vec<CopyRequest> = {
            let mut state = self.lock();
            state.stopping = true;
            let mut d = Vec::new();
            while let Some(r) = (state.demand.pop())
                .or_else(|| state.prefetch.pop())
                .or_else(|| state.back.pop())
            {
                d.push(r);
            }
            d
        };
        dropped.into_iter().for_each(cancel);
        self.wake.notify_all();
        self.back_wake.notify_all();
    }
}

fn cancel(req: CopyRequest) {
    (req.done)(CopyOutcome {
        result: Err(CopyError::Cancelled),
        bytes: 0,
        from_device: 0,
        elapsed: Duration::ZERO,
    });
}

/// How often queued copies whose events are pending are looked at again.
const POLL: Duration = Duration::from_micros(50);
/// How often the backend is asked about copies still running on the device while nothing is
/// queued (for their busy time, and so that it can let their sources go).
const DEVICE_POLL: Duration = Duration::from_millis(1);

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn relock<'a, T>(
    waited: std::sync::LockResult<(MutexGuard<'a, T>, std::sync::WaitTimeoutResult)>,
) -> MutexGuard<'a, T> {
    waited.map_or_else(|p| p.into_inner().0, |(guard, _)| guard)
}

/// Waits on `wake` until `clock` reads `until` or `done` holds of the state; returns its guard.
/// On a fake clock the time moves at once (tests see the whole wait, never a real one).
fn wait_until<'a, T>(
    clock: &dyn Clock,
    wake: &Condvar,
    mut state: MutexGuard<'a, T>,
    until: Duration,
    done: impl Fn(&T) -> bool,
) -> MutexGuard<'a, T> {
    loop {
        let now = clock.now();
        if done(&state) || now >= until {
            return state;
        }
        let block = clock.block_for(until - now);
        if !block.is_zero() {
            state = relock(wake.wait_timeout(state, block));
        }
    }
}

fn copy_loop(device: usize, queue: &DeviceQueue, backend: &dyn Backend, clock: &dyn Clock) {
    let mut link = queue
        .limit
        .map(|rate| TokenBucket::new(rate, PACING_BURST, clock.now()));
    loop {
        // Outside the queue's lock: retiring a copy may drop the last reference to a model's
        // arena, which unlocks and unmaps it.
        let polled = backend.poll_copies(device);
        let req = {
            let mut state = queue.lock();
            state.stats.busy_ns += nanos(polled.busy);
            let now = clock.now();
            let QueueState {
                demand,
                prefetch,
                shares,
                ..
            } = &mut *state;
            // A session in debt with its share is passed over whole: what it has queued costs
            // nothing while it waits.
            let allowed = |s: u64| shares.get(&s).is_none_or(|b| b.delay(now).is_zero());
            let ready = |r: &CopyRequest| r.work.ready();
            // Within a class, a session whose share allows a copy goes before those without a
            // share: its share already holds it to its part of the link, and taking turns copy
            // by copy would hold it to the others' copy sizes instead (one 8 MiB copy per
            // 64 MiB of theirs), whatever its share.
            let shared = |s: u64| shares.contains_key(&s) && allowed(s);
            let next = demand
                .pop_ready(shared, ready)
                .or_else(|| demand.pop_ready(allowed, ready))
                .or_else(|| prefetch.pop_ready(shared, ready))
                .or_else(|| prefetch.pop_ready(allowed, ready));
            let has_ready = |s: u64| demand.has_ready(s, ready) || prefetch.has_ready(s, ready);
            match next {
                Some(r) => {
                    tracing::debug!(target: TIMELINE, session = r.session,
                        group = %TagLabel(r.tag),
                        priority = ?r.priority,
                        what = if matches!(r.work, Work::Grant { .. }) { "grant" } else { "copy" },
                        bytes = r.work.turn_bytes(),
                        "copy dispatched");
                    if let Some(share) = shares.get_mut(&r.session) {
                        share.charge(now, r.work.turn_bytes());
                    }
                    // The other sessions with shares and copies ready now wait for the link
                    // (this copy), not for their shares: what their shares earn meanwhile is
                    // theirs, not cut at the burst as if they were idle.
                    for (&session, share) in shares.iter_mut() {
                        if session == r.session {
                            continue;
                        }
                        if has_ready(session) {
                            share.waiting_from(now);
                        } else {
                            share.not_waiting();
                        }
                    }
                    state.running = Some(Running {
                        session: r.session,
                        cancelled: false,
                    });
                    r
                }
                None => {
                    // Copies that could run but for their sessions' shares: sleep until the
                    // first share allows one, or a submission, a cancel or a stop wakes us (on
                    // the clock, so that tests can fake it).
                    let held = (shares.iter())
                        .filter(|(s, _)| has_ready(**s))
                        .map(|(_, b)| b.delay(now))
                        .min();
                    if let Some(wait) = held.filter(|_| !state.stopping) {
                        let block = clock.block_for(wait);
                        if !block.is_zero() {
                            state = relock(queue.wake.wait_timeout(state, block));
                        }
                        let waited = clock.now().saturating_sub(now);
                        state.stats.share_throttled_ns += nanos(waited);
                        continue;
                    }
                    let queued = state.demand.len() + state.prefetch.len();
                    if state.stopping && queued == 0 {
                        return;
                    }
                    // Waiting on clients' free events, or on the device: look again shortly.
                    let look_again = if queued > 0 {
                        Some(POLL)
                    } else {
                        polled.pending.then_some(DEVICE_POLL)
                    };
                    match look_again {
                        Some(after) => drop(queue.wake.wait_timeout(state, after)),
                        None => drop(queue.wake.wait(state)),
                    }
                    continue;
                }
            }
        };
        let (bytes, from_device) = match &req.work {
            Work::Copy(job) => (job.link_bytes(), job.device_bytes()),
            Work::Grant { bytes, .. } => (*bytes, 0),
        };
        let turn = req.work.turn_bytes();
        let CopyRequest {
            session,
            tag,
            priority,
            work,
            done,
        } = req;
        let started = Instant::now();
        let (ran, grant_left) = match (work, &mut link) {
            // A copy within the device does not cross the link: not paced.
            (Work::Copy(job), Some(bucket)) if job.link_bytes() > 0 => {
                let ran = run_paced(device, queue, backend, clock, bucket, job);
                (ran, None)
            }
            (Work::Copy(job), _) => (Ran::once(backend.copy(device, job)), None),
            (Work::Grant { left, .. }, None) => (Ran::nothing(), Some(left - turn)),
            (Work::Grant { left, .. }, Some(bucket)) => {
                let ran = pace_grant_piece(queue, clock, bucket, turn);
                (ran, Some(left - turn))
            }
        };
        let elapsed = started.elapsed();
        let mut state = queue.lock();
        let cancelled = Running::cancelled(state.running.take());
        state.stats.busy_ns += nanos(ran.busy);
        state.stats.throttled_ns += nanos(ran.throttled);
        let mut result = ran.result;
        match grant_left {
            Some(left) => {
                state.stats.granted_h2d_bytes += turn;
                if cancelled || state.stopping {
                    result = Err(CopyError::Cancelled);
                } else if left > 0 && result.is_ok() {
                    let rest = CopyRequest {
                        session,
                        tag,
                        priority,
                        work: Work::Grant { bytes, left },
                        done,
                    };
                    match priority {
                        Priority::Demand => state.demand.requeue(rest),
                        Priority::Prefetch => state.prefetch.requeue(rest),
                    }
                    continue;
                }
            }
            None => {
                state.stats.copies += 1;
                state.stats.bytes += bytes;
            }
        }
        drop(state);
        done(CopyOutcome {
            result,
            bytes,
            from_device,
            elapsed,
        });
    }
}

/// The link's other direction: grants of clients' own copies from the device, a piece at a
/// time, sessions in turn, each piece charged to `bucket` when it goes. A cancel or a stop
/// ends a grant's wait at once.
fn back_loop(queue: &DeviceQueue, clock: &dyn Clock, mut bucket: TokenBucket) {
    let mut state = queue.lock();
    loop {
        if state.stopping {
            return;
        }
        let Some(mut req) = state.back.pop() else {
            state = queue
                .back_wake
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let piece = req.work.turn_bytes();
        state.running_back = Some(Running {
            session: req.session,
            cancelled: false,
        });
        let until = clock.now() + bucket.reserve(clock.now(), piece);
        state = wait_until(clock, &queue.back_wake, state, until, |s| {
            s.stopping || Running::cancelled(s.running_back)
        });
        let cancelled = Running::cancelled(state.running_back.take()) || state.stopping;
        state.stats.granted_d2h_bytes += piece;
        let Work::Grant { left, bytes } = &mut req.work else {
            unreachable!("only grants go from the device");
        };
        *left -= piece;
        let bytes = *bytes;
        if !cancelled && *left > 0 {
            state.back.requeue(req);
            continue;
        }
        drop(state);
        let result = if cancelled {
            Err(CopyError::Cancelled)
        } else {
            Ok(())
        };
        (req.done)(CopyOutcome {
            result,
            bytes,
            from_device: 0,
            elapsed: Duration::ZERO,
        });
        state = queue.lock();
    }
}

/// What running one request came to.
struct Ran {
    result: Result<(), CopyError>,
    /// Device time known by now: `Done` copies' and, for a paced copy, what polls between its
    /// pieces reported.
    busy: Duration,
    /// Time spent waiting for the device's limit.
    throttled: Duration,
}

impl Ran {
    /// Nothing run yet.
    fn nothing() -> Ran {
        Ran {
            result: Ok(()),
            busy: Duration::ZERO,
            throttled: Duration::ZERO,
        }
    }

    fn once(result: Result<CopyTiming, BackendError>) -> Ran {
        let busy = match result {
            Ok(CopyTiming::Done(busy)) => busy,
            _ => Duration::ZERO,
        };
        Ran {
            result: result.map(|_timing| ()).map_err(CopyError::from),
            busy,
            throttled: Duration::ZERO,
        }
    }
}

/// Runs a job in pieces, each issued once the device's bucket allows it. A stop between
/// pieces cancels the rest (a slow limit must not hold the daemon's exit for minutes).
fn run_paced(
    device: usize,
    queue: &DeviceQueue,
    backend: &dyn Backend,
    clock: &dyn Clock,
    bucket: &mut TokenBucket,
    job: CopyJob,
) -> Ran {
    let mut ran = Ran::nothing();
    for piece in split_job(job, PACED_CHUNK) {
        if !let_piece_go(queue, clock, bucket, piece.bytes(), &mut ran, false) {
            break;
        }
        let once = Ran::once(backend.copy(device, piece));
        ran.busy += once.busy + backend.poll_copies(device).busy;
        if once.result.is_err() {
            ran.result = once.result;
            break;
        }
    }
    ran
}

/// One piece of a grant to the device, paced as a copy's piece of that size would be, with
/// nothing issued: the client copies once the whole grant is answered. Its session's end cuts
/// the wait short.
fn pace_grant_piece(
    queue: &DeviceQueue,
    clock: &dyn Clock,
    bucket: &mut TokenBucket,
    bytes: u64,
) -> Ran {
    let mut ran = Ran::nothing();
    let_piece_go(queue, clock, bucket, bytes, &mut ran, true);
    ran
}

/// Waits until the device's bucket lets a piece of `bytes` go, adding the wait to
/// `ran.throttled`; false (and `ran` cancelled) once the queue is stopping, or, for a grant
/// (`grant`), once its session has ended.
fn let_piece_go(
    queue: &DeviceQueue,
    clock: &dyn Clock,
    bucket: &mut TokenBucket,
    bytes: u64,
    ran: &mut Ran,
    grant: bool,
) -> bool {
    let now = clock.now();
    let until = now + bucket.reserve(now, bytes);
    let state = wait_until(clock, &queue.wake, queue.lock(), until, |s| {
        s.stopping || (grant && Running::cancelled(s.running))
    });
    ran.throttled += clock.now().saturating_sub(now).min(until - now);
    if state.stopping || (grant && Running::cancelled(state.running)) {
        ran.result = Err(CopyError::Cancelled);
        return false;
    }
    true
}

/// Cuts a job into jobs of at most `chunk` bytes each, in order (spans are cut where they
/// cross a boundary; small ones share a piece). The first piece waits on the job's events; the
/// last records its event and is synchronous if the job was. Always at least one piece.
fn split_job(job: CopyJob, chunk: u64) -> Vec<CopyJob> {
    let CopyJob {
        region,
        spans,
        mut from_device,
        events,
        wait,
        record,
        synchronous,
    } = job;
    let mut pieces: Vec<Vec<_>> = vec![Vec::new()];
    let mut room = chunk;
    for (src, dst) in spans {
        let len = src.len() as u64;
        let mut at = 0;
        while at < len {
            if room == 0 {
                pieces.push(Vec::new());
                room = chunk;
            }
            let take = room.min(len - at);
            let part = if take == len {
                src.clone()
            } else {
                src.slice(at, take)
            };
            if let Some(last) = pieces.last_mut() {
                last.push((part, dst + at));
            }
            at += take;
            room -= take;
        }
    }
    let n = pieces.len();
    let mut wait = Some(wait);
    pieces
        .into_iter()
        .enumerate()
        .map(|(i, spans)| {
            let last = i + 1 == n;
            CopyJob {
                region: region.clone(),
                spans,
                // Copies within the device go with the first piece, unpaced.
                from_device: std::mem::take(&mut from_device),
                events: events.clone(),
                wait: wait.take().unwrap_or_default(),
                record: if last { record } else { None },
                synchronous: last && synchronous,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn the_timeline_names_no_group_for_a_request_of_none() {
        assert_eq!(TagLabel(NO_GROUP).to_string(), "-");
        assert_eq!(TagLabel(7).to_string(), "7");
    }

    fn req(session: u64, tag: u32) -> CopyRequest {
        CopyRequest {
            session,
            tag,
            priority: Priority::Prefetch,
            work: Work::Copy(CopyJob::copy(Arc::new(NullRegion), Vec::new())),
            done: Box::new(|_| {}),
        }
    }

    struct NullRegion;
    impl crate::backend::DeviceRegion for NullRegion {
        fn size(&self) -> u64 {
            0
        }
        fn export(&self) -> crate::backend::RegionExport {
            crate::backend::RegionExport::CudaIpc(Vec::new())
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn lanes_are_round_robin_between_sessions() {
        let mut lanes = Lanes::default();
        for (s, t) in [(1, 10), (1, 11), (1, 12), (2, 20), (3, 30), (2, 21)] {
            lanes.push(req(s, t));
        }
        let order: Vec<u32> = std::iter::from_fn(|| lanes.pop()).map(|r| r.tag).collect();
        assert_eq!(order, vec![10, 20, 30, 11, 21, 12]);
    }

    #[test]
    fn a_request_that_is_not_ready_lets_others_pass() {
        let mut lanes = Lanes::default();
        for (s, t) in [(1, 10), (1, 11), (2, 20)] {
            lanes.push(req(s, t));
        }
        let not_10 = |r: &CopyRequest| r.tag != 10;
        let any = |_| true;
        assert_eq!(lanes.pop_ready(any, not_10).map(|r| r.tag), Some(11));
        assert_eq!(lanes.pop_ready(any, not_10).map(|r| r.tag), Some(20));
        assert!(lanes.pop_ready(any, not_10).is_none());
        assert_eq!(lanes.pop().map(|r| r.tag), Some(10));
        assert_eq!(lanes.len(), 0);
    }

    /// A session held back is passed over without a look at its requests, and a request put
    /// back goes first in its session but after the other sessions.
    #[test]
    fn a_held_session_is_passed_over_whole_and_a_requeued_request_waits_its_turn() {
        let mut lanes = Lanes::default();
        for (s, t) in [(1, 10), (1, 11), (2, 20), (2, 21)] {
            lanes.push(req(s, t));
        }
        let looked = std::cell::Cell::new(0);
        let counted = |_: &CopyRequest| {
            looked.set(looked.get() + 1);
            true
        };
        assert_eq!(
            lanes.pop_ready(|s| s != 1, counted).map(|r| r.tag),
            Some(20)
        );
        assert_eq!(looked.get(), 1);
        let first = lanes.pop().unwrap();
        assert_eq!(first.tag, 10);
        lanes.requeue(first);
        let order: Vec<u32> = std::iter::from_fn(|| lanes.pop()).map(|r| r.tag).collect();
        assert_eq!(order, vec![21, 10, 11]);
        assert!(!lanes.has_ready(1, |_| true));
    }

    #[test]
    fn take_and_cancel_remove_only_what_they_name() {
        let mut lanes = Lanes::default();
        for (s, t) in [(1, 10), (1, 11), (2, 20)] {
            lanes.push(req(s, t));
        }
        assert_eq!(lanes.take(1, 11).map(|r| r.tag), Some(11));
        assert!(lanes.take(1, 99).is_none());
        assert_eq!(lanes.take_session(2).len(), 1);
        let order: Vec<u32> = std::iter::from_fn(|| lanes.pop()).map(|r| r.tag).collect();
        assert_eq!(order, vec![10]);
        assert_eq!(lanes.len(), 0);
    }

    /// A backend whose `copy` takes `enqueue` to return `reply`, and whose device runs each
    /// `Queued` copy for `device_time`, reported only once `finished` is set.
    struct TimedBackend {
        enqueue: Duration,
        reply: CopyTiming,
        device_time: Duration,
        finished: std::sync::atomic::AtomicBool,
        on_device: std::sync::atomic::AtomicU32,
    }

    impl TimedBackend {
        fn new(enqueue: Duration, reply: CopyTiming, device_time: Duration) -> TimedBackend {
            TimedBackend {
                enqueue,
                reply,
                device_time,
                finished: true.into(),
                on_device: 0.into(),
            }
        }
    }

    impl crate::mem::HostPinner for TimedBackend {
        fn pin_host(
            &self,
            _: &[(usize, usize)],
            _: crate::mem::PinAccess,
        ) -> Result<Option<crate::mem::PinGuard>, crate::mem::PinError> {
            Ok(None)
        }
    }

    impl Backend for TimedBackend {
        fn kind(&self) -> crate::backend::BackendKind {
            crate::backend::BackendKind::Host
        }
        fn devices(&self) -> Vec<crate::backend::DeviceInfo> {
            Vec::new()
        }
        fn alignment(&self) -> u64 {
            1
        }
        fn alloc_region(
            &self,
            _: usize,
            _: u64,
            _: &'static str,
        ) -> Result<Arc<dyn crate::backend::DeviceRegion>, BackendError> {
            Ok(Arc::new(NullRegion))
        }
        fn copy(&self, _: usize, _: CopyJob) -> Result<CopyTiming, BackendError> {
            std::thread::sleep(self.enqueue);
            if self.reply == CopyTiming::Queued {
                self.on_device.fetch_add(1, Ordering::SeqCst);
            }
            Ok(self.reply)
        }
        fn poll_copies(&self, _: usize) -> crate::backend::CopyPoll {
            if !self.finished.load(Ordering::SeqCst) {
                let pending = self.on_device.load(Ordering::SeqCst) > 0;
                return crate::backend::CopyPoll {
                    busy: Duration::ZERO,
                    pending,
                };
            }
            crate::backend::CopyPoll {
                busy: self.device_time * self.on_device.swap(0, Ordering::SeqCst),
                pending: false,
            }
        }
        fn synchronize(&self, _: usize) -> Result<(), BackendError> {
            Ok(())
        }
        fn event_pool(
            &self,
            _: usize,
            _: u32,
        ) -> Result<Option<Arc<dyn crate::backend::EventPool>>, BackendError> {
            Ok(None)
        }
    }

    /// Device 0's stats once they show `copies` copies and `busy_ns`, or after 5 s.
    fn stats_once(s: &CopyScheduler, copies: u64, busy_ns: u64) -> DeviceCopyStats {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let stats = s.stats(0);
            if (stats.copies, stats.busy_ns) == (copies, busy_ns) || Instant::now() > deadline {
                return stats;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Busy time is the sum of what the backend reports, whether with the copy or from a later
    /// poll, and never the (here 20 ms) it takes to queue a copy.
    #[test]
    fn busy_time_is_what_the_backend_reports_not_the_time_to_queue() {
        let five_us = Duration::from_micros(5);
        let cases = [
            ("done", CopyTiming::Done(five_us)),
            ("queued", CopyTiming::Queued),
        ];
        let mut failures = Vec::new();
        for (name, reply) in cases {
            let backend = TimedBackend::new(Duration::from_millis(20), reply, five_us);
            let scheduler = CopyScheduler::start(Arc::new(backend), 1).unwrap();
            scheduler.submit(0, req(1, 10));
            scheduler.submit(0, req(2, 20));
            let stats = stats_once(&scheduler, 2, 10_000);
            scheduler.shutdown();
            if (stats.copies, stats.busy_ns) != (2, 10_000) {
                failures.push(format!("{name}: {stats:?}"));
            }
        }
        assert!(failures.is_empty(), "{failures:?}");
    }

    /// A copy still running on the device when the queue empties is counted when it completes,
    /// with nothing else submitted to wake the copy thread.
    #[test]
    fn device_time_that_comes_after_the_queue_empties_is_counted() {
        let backend = Arc::new(TimedBackend::new(
            Duration::ZERO,
            CopyTiming::Queued,
            Duration::from_micros(7),
        ));
        backend.finished.store(false, Ordering::SeqCst);
        let scheduler = CopyScheduler::start(backend.clone(), 1).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        scheduler.submit(
            0,
            CopyRequest {
                done: Box::new(move |_| tx.send(()).unwrap()),
                ..req(1, 10)
            },
        );
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(scheduler.stats(0).busy_ns, 0);
        backend.finished.store(true, Ordering::SeqCst);
        let stats = stats_once(&scheduler, 1, 7_000);
        scheduler.shutdown();
        assert_eq!((stats.copies, stats.busy_ns), (1, 7_000));
    }

    /// The second copy waits in the queue while the copy thread is held up for 200 ms; the
    /// device's busy time counts the two memcpys only.
    #[test]
    fn busy_time_leaves_out_the_time_a_copy_waits_in_the_queue() {
        let (backend, tensor) = crate::backend::host::tests::backend_and_tensor();
        const MIB: usize = 1 << 20;
        let region = backend.alloc_region(0, MIB as u64, "staging").unwrap();
        let scheduler = CopyScheduler::start(backend, 1).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let hold = Duration::from_millis(200);
        for (tag, busy_after) in [(1, hold), (2, Duration::ZERO)] {
            let tx = tx.clone();
            let job = CopyJob::copy(region.clone(), vec![(tensor.clone(), 0)]);
            let request = CopyRequest {
                session: 1,
                tag,
                priority: Priority::Demand,
                work: Work::Copy(job),
                done: Box::new(move |outcome| {
                    std::thread::sleep(busy_after);
                    tx.send(outcome.result.is_ok()).unwrap();
                }),
            };
            scheduler.submit(0, request);
        }
        for _ in 0..2 {
            assert!(rx.recv_timeout(Duration::from_secs(5)).unwrap());
        }
        let stats = scheduler.stats(0);
        scheduler.shutdown();
        assert_eq!(stats.copies, 2);
        let busy = Duration::from_nanos(stats.busy_ns);
        assert!(!busy.is_zero() && busy < hold / 4, "{busy:?}");
    }
}

#[cfg(test)]
mod pacing_tests {
    use std::sync::mpsc;

    use super::*;
    use crate::backend::host::tests::backend_and_tensor;
    use crate::mem::HostSlice;
    use crate::pacing::FakeClock;

    const MIB: u64 = 1 << 20;

    fn rate(bytes_per_sec: u64) -> Option<CopyRate> {
        CopyRate::new(bytes_per_sec)
    }

    /// A job of `mib` MiB: the 1 MiB tensor copied `mib` times, end to end.
    fn job_of(
        region: &Arc<dyn crate::backend::DeviceRegion>,
        tensor: &HostSlice,
        mib: u64,
    ) -> CopyJob {
        let spans = (0..mib).map(|i| (tensor.clone(), i * MIB)).collect();
        CopyJob::copy(region.clone(), spans)
    }

    #[test]
    fn a_job_is_cut_into_pieces_with_its_events_at_the_ends() {
        let (backend, tensor) = backend_and_tensor();
        let region = backend.alloc_region(0, 4 * MIB, "staging").unwrap();
        let job = CopyJob {
            wait: vec![3, 4],
            record: Some(5),
            synchronous: true,
            ..CopyJob::copy(
                region.clone(),
                vec![(tensor.clone(), 0), (tensor.slice(10, 100), 2 * MIB)],
            )
        };
        let pieces = split_job(job, 300_000);
        let sizes: Vec<u64> = pieces.iter().map(CopyJob::bytes).collect();
        assert_eq!(sizes, [300_000, 300_000, 300_000, 148_676]);
        // Each span's bytes go where the whole span would have put them.
        let spans: Vec<(usize, u64)> = pieces
            .iter()
            .flat_map(|p| p.spans.iter().map(|(s, at)| (s.len(), *at)))
            .collect();
        assert_eq!(
            spans,
            [
                (300_000, 0),
                (300_000, 300_000),
                (300_000, 600_000),
                (148_576, 900_000),
                (100, 2 * MIB)
            ]
        );
        assert_eq!(pieces[3].spans[1].0.bytes(), &tensor.bytes()[10..110]);
        let events: Vec<_> = pieces
            .iter()
            .map(|p| (p.wait.clone(), p.record, p.synchronous))
            .collect();
        assert_eq!(
            events,
            [
                (vec![3, 4], None, false),
                (vec![], None, false),
                (vec![], None, false),
                (vec![], Some(5), true),
            ]
        );
        let empty = split_job(CopyJob::copy(region, Vec::new()), 300_000);
        assert_eq!(empty.len(), 1);
    }

    /// Runs `jobs` (session, MiB) through a scheduler on a fake clock; returns, per job in
    /// submission order, (session, fake time its copy reported done), and the device's stats.
    fn run_on_fake_clock(
        device_limit: Option<CopyRate>,
        shares: &[(u64, u64)],
        jobs: &[(u64, u64)],
    ) -> (Vec<(u64, Duration)>, DeviceCopyStats, Arc<FakeClock>) {
        let (backend, tensor) = backend_and_tensor();
        let region = backend.alloc_region(0, 64 * MIB, "staging").unwrap();
        let clock = Arc::new(FakeClock::default());
        let pacing = Pacing {
            device_limit,
            clock: clock.clone(),
        };
        let scheduler = CopyScheduler::start_paced(backend, 1, pacing).unwrap();
        let guards: Vec<_> = shares
            .iter()
            .map(|&(s, r)| scheduler.set_share(0, s, rate(r).unwrap()))
            .collect();
        let (tx, rx) = mpsc::channel();
        for (i, &(session, mib)) in jobs.iter().enumerate() {
            let (tx, clock) = (tx.clone(), clock.clone());
            scheduler.submit(
                0,
                CopyRequest {
                    session,
                    tag: i as u32,
                    priority: Priority::Demand,
                    work: Work::Copy(job_of(&region, &tensor, mib)),
                    done: Box::new(move |outcome| {
                        assert!(outcome.result.is_ok(), "{:?}", outcome.result);
                        tx.send((i, clock.now())).unwrap();
                    }),
                },
            );
        }
        let mut done = vec![(0, Duration::MAX); jobs.len()];
        for _ in jobs {
            let (i, at) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            done[i] = (jobs[i].0, at);
        }
        let stats = scheduler.stats(0);
        drop(guards);
        scheduler.shutdown();
        (done, stats, clock)
    }

    fn nanos_for(bytes: u64, rate: u64) -> Duration {
        Duration::from_nanos((u128::from(bytes) * 1_000_000_000).div_ceil(u128::from(rate)) as u64)
    }

    /// The device's limit: 40 MiB at 100 MB/s, less the 16 MiB burst, take (24 MiB / 100 MB/s)
    /// of the copy thread's (fake) time, all of it spent throttled; without a limit, none.
    #[test]
    fn a_device_limit_paces_every_copy_to_the_rate() {
        let jobs = [(1, 8), (2, 8), (1, 16), (2, 8)];
        let (done, stats, clock) = run_on_fake_clock(rate(100_000_000), &[], &jobs);
        let want = nanos_for(24 * MIB, 100_000_000);
        // Each piece's wait rounds up to a whole ns.
        assert!(
            clock.now().abs_diff(want) <= Duration::from_nanos(8),
            "{:?}",
            clock.now()
        );
        assert_eq!(Duration::from_nanos(stats.throttled_ns), clock.now());
        assert_eq!(
            (stats.copies, stats.bytes, stats.share_throttled_ns),
            (4, 40 * MIB, 0)
        );
        assert_eq!(done.iter().map(|d| d.1).max(), Some(clock.now()));

        let (_, stats, clock) = run_on_fake_clock(None, &[], &jobs);
        assert_eq!((clock.now(), stats.throttled_ns), (Duration::ZERO, 0));
    }

    /// A copy within the device does not cross the link: under a device limit and a session
    /// share it goes at once, unthrottled and uncharged (the bytes over the link are counted
    /// apart from it), and its bytes land where it says.
    #[test]
    fn a_copy_within_the_device_is_neither_paced_nor_charged() {
        let (backend, tensor) = backend_and_tensor();
        let resident = backend.alloc_region(0, 48 * MIB, "resident").unwrap();
        let staging = backend.alloc_region(0, 48 * MIB, "staging").unwrap();
        let clock = Arc::new(FakeClock::default());
        let pacing = Pacing {
            device_limit: rate(100_000_000),
            clock: clock.clone(),
        };
        let scheduler = CopyScheduler::start_paced(backend.clone(), 1, pacing).unwrap();
        let _share = scheduler.set_share(0, 1, rate(100_000_000).unwrap());
        let (tx, rx) = mpsc::channel();
        let fill = job_of(&resident, &tensor, 48);
        let within = CopyJob::within(
            staging.clone(),
            crate::backend::DeviceSlice {
                region: resident.clone(),
                offset: 10,
                len: 40 * MIB,
            },
            MIB,
        );
        // Filled directly, as a resident region is before any staging copy reads it.
        backend.copy(0, fill).unwrap();
        for (tag, job) in [(0, within), (1, job_of(&staging, &tensor, 8))] {
            let (tx, clock) = (tx.clone(), clock.clone());
            scheduler.submit(
                0,
                CopyRequest {
                    session: 1,
                    tag,
                    priority: Priority::Demand,
                    work: Work::Copy(job),
                    done: Box::new(move |o| {
                        assert!(o.result.is_ok(), "{:?}", o.result);
                        tx.send((tag, o.bytes, o.from_device, clock.now())).unwrap();
                    }),
                },
            );
        }
        let got: Vec<_> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(
            got,
            [
                (0, 0, 40 * MIB, Duration::ZERO),
                (1, 8 * MIB, 0, Duration::ZERO)
            ],
            "the 16 MiB burst holds the 8 MiB over the link; the 40 MiB within take none of it"
        );
        let stats = scheduler.stats(0);
        assert_eq!((stats.bytes, stats.throttled_ns), (8 * MIB, 0));
        scheduler.shutdown();
        let read = |r: &Arc<dyn crate::backend::DeviceRegion>, at: u64, len: u64| {
            crate::backend::host::tests::read_region(r, at, len)
        };
        assert_eq!(
            read(&staging, 8 * MIB, 32 * MIB),
            read(&resident, 10 + 7 * MIB, 32 * MIB),
            "past the 8 MiB copied over it, the bytes within the device are the resident ones"
        );
    }

    /// A grant of `bytes` for `session` that reports (tag, result, fake time) to `tx`.
    fn grant_request(
        session: u64,
        tag: u32,
        bytes: u64,
        tx: &mpsc::Sender<(u32, Result<(), CopyError>, Duration)>,
        clock: &Arc<FakeClock>,
    ) -> CopyRequest {
        let (tx, clock) = (tx.clone(), clock.clone());
        CopyRequest {
            session,
            tag,
            priority: Priority::Prefetch,
            work: Work::grant(bytes),
            done: Box::new(move |outcome| {
                tx.send((tag, outcome.result, clock.now())).unwrap();
            }),
        }
    }

    /// A client's own copy to the device (a grant) takes its turn in the queue and is paced as
    /// a copy of its size: 8 MiB copy, 16 MiB grant, 16 MiB copy at 100 MB/s take the same
    /// (fake) time as 40 MiB of copies, the grant answered in its place, counted apart from the
    /// copies. A grant from the device is charged to the link's other direction (its own
    /// 16 MiB burst) piece by piece as it goes: 8 MiB go at once, 24 MiB more wait for 16 MiB
    /// at the rate.
    #[test]
    fn a_grant_is_paced_in_the_queue_as_a_copy_of_its_size() {
        let (backend, tensor) = backend_and_tensor();
        let region = backend.alloc_region(0, 64 * MIB, "staging").unwrap();
        let clock = Arc::new(FakeClock::default());
        let pacing = Pacing {
            device_limit: rate(100_000_000),
            clock: clock.clone(),
        };
        let scheduler = CopyScheduler::start_paced(backend, 1, pacing).unwrap();
        let (tx, rx) = mpsc::channel();
        let works = [
            Work::Copy(job_of(&region, &tensor, 8)),
            Work::grant(16 * MIB),
            Work::Copy(job_of(&region, &tensor, 16)),
        ];
        for (i, work) in works.into_iter().enumerate() {
            let (tx, clock) = (tx.clone(), clock.clone());
            scheduler.submit(
                0,
                CopyRequest {
                    session: 1,
                    tag: i as u32,
                    priority: Priority::Demand,
                    work,
                    done: Box::new(move |outcome| {
                        assert!(outcome.result.is_ok(), "{:?}", outcome.result);
                        tx.send((i, outcome.bytes, clock.now())).unwrap();
                    }),
                },
            );
        }
        let done: Vec<_> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(
            done.iter().map(|d| (d.0, d.1)).collect::<Vec<_>>(),
            [(0, 8 * MIB), (1, 16 * MIB), (2, 16 * MIB)]
        );
        let want = nanos_for(24 * MIB, 100_000_000);
        assert!(
            clock.now().abs_diff(want) <= Duration::from_nanos(8),
            "{:?}",
            clock.now()
        );
        // The grant was answered once its own pieces had waited: after 8 MiB at the rate.
        let granted_at = nanos_for(8 * MIB, 100_000_000);
        assert!(
            done[1].2.abs_diff(granted_at) <= Duration::from_nanos(8),
            "{:?}",
            done[1].2
        );
        let stats = scheduler.stats(0);
        assert_eq!(Duration::from_nanos(stats.throttled_ns), clock.now());

        let start = clock.now();
        let (tx, rx) = mpsc::channel();
        for (tag, bytes) in [(0, 8 * MIB), (1, 24 * MIB)] {
            scheduler.submit_from_device(0, grant_request(1, tag, bytes, &tx, &clock));
        }
        let done: Vec<_> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!((done[0].0, done[0].1.is_ok(), done[0].2), (0, true, start));
        let (tag, result, at) = &done[1];
        assert_eq!((tag, result.is_ok()), (&1, true));
        let wait = nanos_for(16 * MIB, 100_000_000);
        assert!(
            at.abs_diff(start + wait) <= Duration::from_nanos(2),
            "{at:?}"
        );
        let stats = scheduler.stats(0);
        assert_eq!(
            (
                stats.copies,
                stats.bytes,
                stats.granted_h2d_bytes,
                stats.granted_d2h_bytes,
                stats.queued,
            ),
            (2, 24 * MIB, 16 * MIB, 32 * MIB, 0)
        );
        scheduler.shutdown();

        // Without a limit a grant from the device waits for nothing: answered as it is asked.
        let unpaced = CopyScheduler::start(backend_and_tensor().0, 1).unwrap();
        let (tx, rx) = mpsc::channel();
        unpaced.submit_from_device(0, grant_request(1, 0, 1 << 40, &tx, &clock));
        assert!(rx.try_recv().unwrap().1.is_ok());
        unpaced.shutdown();
    }

    /// A real clock for the tests whose point is what happens while a grant is being let go.
    fn paced_scheduler(limit: u64) -> Arc<CopyScheduler> {
        let pacing = Pacing {
            device_limit: rate(limit),
            clock: Arc::new(SystemClock::default()),
        };
        CopyScheduler::start_paced(backend_and_tensor().0, 1, pacing).unwrap()
    }

    /// Another session's copy asked while a 256 MiB grant is being let go (1 GB/s: about
    /// 270 ms) goes after at most one of its pieces, not after the whole grant: its answer
    /// comes first. The same on the link's other direction, between two sessions' grants.
    #[test]
    fn another_sessions_copy_goes_between_the_pieces_of_a_grant() {
        let (backend, tensor) = backend_and_tensor();
        let region = backend.alloc_region(0, 8 * MIB, "staging").unwrap();
        let scheduler = paced_scheduler(1_000_000_000);
        let (tx, rx) = mpsc::channel();
        let (first_tx, first_rx) = mpsc::channel();
        let big = {
            let tx = tx.clone();
            CopyRequest {
                session: 1,
                tag: 1,
                priority: Priority::Prefetch,
                work: Work::grant(256 * MIB),
                done: Box::new(move |o| tx.send(("grant", o.result.is_ok())).unwrap()),
            }
        };
        scheduler.submit(0, big);
        // A 1 MiB copy of session 3 in the grant's wake: its turn comes after the grant's
        // first piece, so its answer says the grant is being let go.
        let marker = CopyRequest {
            session: 3,
            tag: 3,
            priority: Priority::Prefetch,
            work: Work::Copy(job_of(&region, &tensor, 1)),
            done: Box::new(move |_| first_tx.send(()).unwrap()),
        };
        scheduler.submit(0, marker);
        first_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let copy = CopyRequest {
            session: 2,
            tag: 2,
            priority: Priority::Demand,
            work: Work::Copy(job_of(&region, &tensor, 8)),
            done: Box::new(move |o| tx.send(("copy", o.result.is_ok())).unwrap()),
        };
        scheduler.submit(0, copy);
        let order: Vec<_> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(order, [("copy", true), ("grant", true)]);

        let (tx, rx) = mpsc::channel();
        let clock = Arc::new(FakeClock::default());
        scheduler.submit_from_device(0, grant_request(1, 1, 256 * MIB, &tx, &clock));
        scheduler.submit_from_device(0, grant_request(2, 2, MIB, &tx, &clock));
        let order: Vec<u32> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap().0)
            .collect();
        assert_eq!(order, [2, 1]);
        scheduler.shutdown();
    }

    /// A session's end drops its grants at once, the one being let go included, in both
    /// directions: at 100 MB/s a 256 MiB grant would take 2.5 s more.
    #[test]
    fn a_sessions_end_drops_its_grants_the_one_being_let_go_included() {
        let scheduler = paced_scheduler(100_000_000);
        let clock = Arc::new(FakeClock::default());
        let (tx, rx) = mpsc::channel();
        scheduler.submit(0, grant_request(1, 1, 256 * MIB, &tx, &clock));
        scheduler.submit(0, grant_request(1, 2, MIB, &tx, &clock));
        scheduler.submit_from_device(0, grant_request(1, 3, 256 * MIB, &tx, &clock));
        scheduler.submit_from_device(0, grant_request(1, 4, MIB, &tx, &clock));
        // Past both bursts: both threads are in the midst of a grant's pieces.
        let in_midst = |s: DeviceCopyStats| {
            s.granted_h2d_bytes > PACING_BURST && s.granted_d2h_bytes > PACING_BURST
        };
        let started = Instant::now();
        while !in_midst(scheduler.stats(0)) {
            assert!(started.elapsed() < Duration::from_secs(10));
            std::thread::yield_now();
        }
        let cancelled_at = Instant::now();
        // The two grants queued behind, and either of the others if it was back in the queue
        // between two pieces.
        assert!((2..=4).contains(&scheduler.cancel_session(0, 1)));
        let mut done: Vec<_> = (0..4)
            .map(|_| {
                let (tag, result, _) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
                (tag, matches!(result, Err(CopyError::Cancelled)))
            })
            .collect();
        done.sort();
        assert_eq!(done, [(1, true), (2, true), (3, true), (4, true)]);
        // At most the piece each thread had begun: 8 MiB at 100 MB/s.
        assert!(cancelled_at.elapsed() < Duration::from_millis(500));
        assert_eq!(scheduler.stats(0).queued, 0);
        scheduler.shutdown();
    }

    /// Session 1's share (100 MB/s, 16 MiB burst) lets its first three 8 MiB copies go at once
    /// (the third into debt) and holds the fourth until the debt is paid; session 2, with no
    /// share, is never held back (its copies, queued first, are all done at time 0).
    #[test]
    fn a_session_share_holds_back_only_its_own_session() {
        let jobs = [(2, 8), (2, 8), (2, 8), (1, 8), (1, 8), (1, 8), (1, 8)];
        let (done, stats, clock) = run_on_fake_clock(None, &[(1, 100_000_000)], &jobs);
        let debt = nanos_for(8 * MIB, 100_000_000);
        let times: Vec<Duration> = done.iter().map(|d| d.1).collect();
        let zero = Duration::ZERO;
        assert_eq!(times, [zero, zero, zero, zero, zero, zero, debt]);
        assert_eq!(clock.now(), debt);
        assert_eq!(Duration::from_nanos(stats.share_throttled_ns), debt);
        assert_eq!(stats.throttled_ns, 0);
    }

    /// tests/gpu/link_cap.py's limits, with two sessions taking turns at its group sizes (a
    /// 32nd of them, to fit the test's region): whenever a copy is done at a fake time t > 0,
    /// the bytes of both sessions copied by then are the burst plus rate × t, to within what a
    /// wait rounded up to a whole ns lets through (rate × 1 ns: 25 and 12 bytes). The long-run
    /// rate is the device's limit, whichever session copies.
    #[test]
    fn two_sessions_together_copy_at_exactly_the_device_limit() {
        let sizes_mib = [1, 2, 4, 8, 16, 32];
        let jobs: Vec<(u64, u64)> = (0..2)
            .flat_map(|_| sizes_mib.iter().flat_map(|&m| [(1, m), (2, m)]))
            .collect();
        let mut failures = Vec::new();
        for limit in [25_000_000_000u64, 12_000_000_000] {
            let (done, stats, _) = run_on_fake_clock(rate(limit), &[], &jobs);
            let mut order: Vec<usize> = (0..jobs.len()).collect();
            order.sort_by_key(|&i| done[i].1);
            let (burst, r) = (u128::from(PACING_BURST), u128::from(limit));
            let mut copied = 0u128;
            for i in order {
                copied += u128::from(jobs[i].1 * MIB);
                let t = done[i].1.as_nanos();
                // In nano-bytes: the credit left when the copy's last piece went out.
                let credit =
                    (burst * 1_000_000_000 + r * t) as i128 - (copied * 1_000_000_000) as i128;
                let ok = if t == 0 {
                    credit >= 0
                } else {
                    (0..r as i128).contains(&credit)
                };
                if !ok {
                    failures.push(format!(
                        "{limit} B/s: job {i} done at {t} ns with {copied} bytes copied: \
                         credit {credit} nano-bytes"
                    ));
                }
            }
            let total: u64 = jobs.iter().map(|j| j.1 * MIB).sum();
            if stats.bytes != total {
                failures.push(format!(
                    "{limit} B/s: {} bytes copied of {total}",
                    stats.bytes
                ));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    /// tests/gpu/link_cap.py's share case: session 1 with a 5 GB/s share and session 2 with
    /// none, both always with copies queued, under a 12 GB/s device limit. Until the first of
    /// them runs out of copies, session 1 gets its share (within 5 %) and session 2 the rest.
    /// Session 2's larger copies hold the link for longer than session 1's bucket takes to
    /// refill past its burst: what session 1 earns while it waits for the link is its own.
    #[test]
    fn a_capped_session_gets_its_share_beside_an_uncapped_one() {
        let (limit, share) = (12_000_000_000u64, 5_000_000_000u64);
        let jobs: Vec<(u64, u64)> = (0..24)
            .flat_map(|_| [(1, 8), (2, 64), (1, 16), (2, 32), (1, 32), (2, 64)])
            .collect();
        let (done, _, _) = run_on_fake_clock(rate(limit), &[(1, share)], &jobs);
        let last = |s: u64| done.iter().filter(|d| d.0 == s).map(|d| d.1).max().unwrap();
        let until = last(1).min(last(2));
        let rate_of = |s: u64| {
            let bytes: u64 = (0..jobs.len())
                .filter(|&i| jobs[i].0 == s && done[i].1 <= until)
                .map(|i| jobs[i].1 * MIB)
                .sum();
            bytes as f64 / until.as_secs_f64()
        };
        let (capped, uncapped) = (rate_of(1), rate_of(2));
        assert!(
            (capped / share as f64 - 1.0).abs() < 0.05
                && ((capped + uncapped) / limit as f64 - 1.0).abs() < 0.05,
            "capped {capped:.3e} B/s, uncapped {uncapped:.3e} B/s until {until:?}"
        );
    }

    #[test]
    fn a_share_lasts_until_its_session_is_cancelled_or_its_guard_dropped() {
        let (backend, _) = backend_and_tensor();
        let scheduler = CopyScheduler::start(backend, 1).unwrap();
        let r = rate(200_000_000).unwrap();
        drop(scheduler.set_share(0, 1, r));
        assert_eq!(scheduler.share(0, 1), None);
        scheduler.set_share(0, 1, r).keep();
        assert_eq!(scheduler.share(0, 1), Some(r));
        assert_eq!(scheduler.share(0, 2), None);
        scheduler.cancel_session(0, 1);
        assert_eq!(scheduler.share(0, 1), None);
        assert_eq!(scheduler.limit(0), None);
        scheduler.shutdown();
    }
}
