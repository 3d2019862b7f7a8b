//! CopyScheduler: one queue and one copy thread per device, shared by every session.
//!
//! The host-to-device link is one resource (two processes copying at once get half each), so
//! all copies to a device go through one queue: demand fetches (a client is waiting) before
//! prefetches, and round-robin between sessions within each class, so that one session's deep
//! prefetch cannot starve another's demand. The thread is dedicated because the CUDA backend
//! binds its context to it (tokio moves tasks between threads).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, CopyJob, CopyTiming};

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
    pub bytes: u64,
    /// How long the backend's `copy` took: the copy itself on the host, queueing it on CUDA.
    pub elapsed: Duration,
}

pub type CopyDone = Box<dyn FnOnce(CopyOutcome) + Send>;

pub struct CopyRequest {
    pub session: u64,
    /// What the copy is for (a group id), so that a queued prefetch can be promoted.
    pub tag: u32,
    pub priority: Priority,
    pub job: CopyJob,
    pub done: CopyDone,
}

/// Per-device counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCopyStats {
    pub copies: u64,
    pub bytes: u64,
    /// Time the copies kept the device busy, as the backend measures it (CUDA: timing events
    /// around each batch on the copy stream; host: the memcpy), not the time to queue them.
    pub busy_ns: u64,
    pub queued: u64,
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

    /// The next request, one session at a time in turn.
    fn pop(&mut self) -> Option<CopyRequest> {
        self.pop_ready(|_| true)
    }

    /// The next request that `ready` accepts: sessions in turn, and within a session the
    /// oldest ready one (a copy still waiting on its client's reads lets the others pass).
    fn pop_ready(&mut self, ready: impl Fn(&CopyRequest) -> bool) -> Option<CopyRequest> {
        for turn in 0..self.order.len() {
            let session = self.order[turn];
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

    fn len(&self) -> usize {
        self.per_session.values().map(VecDeque::len).sum()
    }
}

#[derive(Default)]
struct QueueState {
    demand: Lanes,
    prefetch: Lanes,
    stopping: bool,
    stats: DeviceCopyStats,
}

struct DeviceQueue {
    state: Mutex<QueueState>,
    wake: Condvar,
}

impl DeviceQueue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct CopyScheduler {
    queues: Vec<Arc<DeviceQueue>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl CopyScheduler {
    /// Starts one copy thread per device.
    pub fn start(backend: Arc<dyn Backend>, devices: usize) -> std::io::Result<Arc<Self>> {
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        for device in 0..devices {
            let queue = Arc::new(DeviceQueue {
                state: Mutex::new(QueueState::default()),
                wake: Condvar::new(),
            });
            let (q, b) = (queue.clone(), backend.clone());
            let thread = std::thread::Builder::new()
                .name(format!("ws-copy-{device}"))
                .spawn(move || copy_loop(device, &q, b.as_ref()))?;
            queues.push(queue);
            threads.push(thread);
        }
        Ok(Arc::new(CopyScheduler {
            queues,
            threads: Mutex::new(threads),
        }))
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

    /// Drops a session's queued copies (each reports `Cancelled`); a copy already running
    /// finishes and reports as usual. Returns how many were dropped.
    pub fn cancel_session(&self, device: usize, session: u64) -> usize {
        let dropped: Vec<CopyRequest> = {
            let mut state = self.queues[device].lock();
            let mut d: Vec<_> = state.demand.take_session(session).into();
            d.extend(state.prefetch.take_session(session));
            d
        };
        let n = dropped.len();
        dropped.into_iter().for_each(cancel);
        n
    }

    pub fn stats(&self, device: usize) -> DeviceCopyStats {
        let state = self.queues[device].lock();
        DeviceCopyStats {
            queued: (state.demand.len() + state.prefetch.len()) as u64,
            ..state.stats
        }
    }

    pub fn devices(&self) -> usize {
        self.queues.len()
    }

    /// Cancels what is queued, lets running copies finish, joins the threads.
    pub fn shutdown(&self) {
        for queue in &self.queues {
            let dropped: Vec<CopyRequest> = {
                let mut state = queue.lock();
                state.stopping = true;
                let mut d = Vec::new();
                while let Some(r) = state.demand.pop().or_else(|| state.prefetch.pop()) {
                    d.push(r);
                }
                d
            };
            dropped.into_iter().for_each(cancel);
            queue.wake.notify_all();
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn cancel(req: CopyRequest) {
    (req.done)(CopyOutcome {
        result: Err(CopyError::Cancelled),
        bytes: 0,
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

fn copy_loop(device: usize, queue: &DeviceQueue, backend: &dyn Backend) {
    loop {
        // Outside the queue's lock: retiring a copy may drop the last reference to a model's
        // arena, which unlocks and unmaps it.
        let polled = backend.poll_copies(device);
        let req = {
            let mut state = queue.lock();
            state.stats.busy_ns += nanos(polled.busy);
            let ready = |r: &CopyRequest| r.job.ready();
            let next = state
                .demand
                .pop_ready(ready)
                .or_else(|| state.prefetch.pop_ready(ready));
            match next {
                Some(r) => r,
                None => {
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
        let bytes = req.job.bytes();
        let started = Instant::now();
        let result = backend.copy(device, req.job);
        let elapsed = started.elapsed();
        {
            let mut state = queue.lock();
            state.stats.copies += 1;
            state.stats.bytes += bytes;
            if let Ok(CopyTiming::Done(busy)) = result {
                state.stats.busy_ns += nanos(busy);
            }
        }
        (req.done)(CopyOutcome {
            result: result.map(|_timing| ()).map_err(CopyError::from),
            bytes,
            elapsed,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    fn req(session: u64, tag: u32) -> CopyRequest {
        CopyRequest {
            session,
            tag,
            priority: Priority::Prefetch,
            job: CopyJob::copy(Arc::new(NullRegion), Vec::new()),
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
        assert_eq!(lanes.pop_ready(not_10).map(|r| r.tag), Some(11));
        assert_eq!(lanes.pop_ready(not_10).map(|r| r.tag), Some(20));
        assert!(lanes.pop_ready(not_10).is_none());
        assert_eq!(lanes.pop().map(|r| r.tag), Some(10));
        assert_eq!(lanes.len(), 0);
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
                job,
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
