//! The actor against a fake backend and a fake event pool: commands in, events out, one
//! behaviour per test. Copies run on the real `CopyScheduler` (its thread calls the fake
//! backend), so "in flight" means what it means in the daemon: the copy thread is inside
//! `Backend::copy`. Tests wait on channels, never on time; `within` only turns a hang into a
//! failure.

mod fakes;
mod kinds;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use self::fakes::{CopySeen, FakeBackend, FakePool, FakeRegion};
use super::tickets::EVENTS_EXHAUSTED;
use super::{ActorParts, spawn};
use crate::backend::EventPool;
use crate::mem::shm::Shm;
use crate::quota::HostQuota;
use crate::residency::ResidentLease;
use crate::scheduler::CopyScheduler;
use crate::session::layout::layout_groups;
use crate::session::{
    CloseReason, Command, Control, DrainDeadline, Event, FaultKind, GpuWaitReport, SessionShared,
    SessionStats, StatsSnapshot,
};
use crate::store::{Store, test_support};

/// Bytes of each test tensor; with the fake backend's 256-byte alignment, a group's block.
const BLOCK: u64 = 1024;
/// A ticket no test uses: releasing it is answered at once, which marks where the actor is.
const PROBE: u64 = u64::MAX;

/// One session's shape, and whether copies wait until the test opens the backend.
struct Setup {
    groups: usize,
    staging_blocks: u64,
    prefetch_depth: usize,
    max_live_tickets: u32,
    max_waiting_grants: u32,
    events: Option<u32>,
    hold_copies: bool,
    max_plan_length: u32,
    send_timeout: Duration,
    drain: DrainDeadline,
    /// Room on the client's stream (events the client has not read yet).
    stream_room: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            groups: 4,
            staging_blocks: 4,
            prefetch_depth: 2,
            max_live_tickets: 16,
            max_waiting_grants: 16,
            events: None,
            hold_copies: false,
            max_plan_length: 64,
            send_timeout: Duration::from_secs(10),
            drain: DrainDeadline::channel().1,
            stream_room: 1024,
        }
    }
}

/// A session actor with its client's stream attached.
struct Harness {
    commands: mpsc::Sender<Command>,
    events: mpsc::Receiver<Event>,
    shared: Arc<SessionShared>,
    backend: Arc<FakeBackend>,
    copies: mpsc::UnboundedReceiver<CopySeen>,
    pool: Option<Arc<FakePool>>,
    scheduler: Arc<CopyScheduler>,
    finished: watch::Receiver<bool>,
    finish_ran: Arc<AtomicBool>,
    _store: Store,
    _dir: tempfile::TempDir,
}

/// Fails the test instead of hanging it when what it waits for never comes.
async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// A model of `groups` tensors `w{i}` of BLOCK bytes, each filled with its index.
fn model_file(dir: &Path, groups: usize) -> std::path::PathBuf {
    let data: Vec<Vec<u8>> = (0..groups).map(|i| vec![i as u8; BLOCK as usize]).collect();
    let views: Vec<(String, ::safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let view =
                ::safetensors::tensor::TensorView::new(::safetensors::Dtype::U8, vec![d.len()], d)
                    .unwrap();
            (format!("w{i}"), view)
        })
        .collect();
    let path = dir.join("model.safetensors");
    ::safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

impl Harness {
    async fn start(setup: Setup) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let (backend, copies) = FakeBackend::new(setup.hold_copies);
        let limits = test_support::limits(HostQuota::default());
        let store = Store::new(Shm::new(), backend.clone(), limits);
        let path = model_file(dir.path(), setup.groups);
        let (model, _) = test_support::load_paths(&store, &[path], 1).unwrap();
        let specs: Vec<(String, Vec<String>)> = (0..setup.groups)
            .map(|i| (format!("g{i}"), vec![format!("w{i}")]))
            .collect();
        let groups = layout_groups(&model, &specs, 256).unwrap();
        assert!(groups.iter().all(|g| g.nbytes == BLOCK));
        let scheduler = CopyScheduler::start(backend.clone(), 1).unwrap();
        let pool = setup.events.map(FakePool::new);
        let (control, control_rx) = mpsc::unbounded_channel();
        let (finished_tx, finished) = watch::channel(false);
        let staging = setup.staging_blocks * BLOCK;
        let shared = Arc::new(SessionShared {
            id: "s-1".into(),
            number: 1,
            model_id: model.id.clone(),
            device: 0,
            device_uuid: "fake-0".into(),
            label: String::new(),
            vram_budget: staging,
            staging_bytes: staging,
            resident_bytes: 0,
            created: Instant::now(),
            stats: SessionStats::new(setup.groups),
            attached: AtomicBool::new(false),
            plan_len: Default::default(),
            live_tickets: Default::default(),
            control,
            finished: finished.clone(),
        });
        let parts = ActorParts {
            shared: shared.clone(),
            model,
            groups: Arc::new(groups),
            staging: Arc::new(FakeRegion { size: staging }),
            alignment: 256,
            resident: ResidentLease::default(),
            resident_of: vec![None; setup.groups],
            residents: Arc::default(),
            scheduler: scheduler.clone(),
            max_live_tickets: setup.max_live_tickets,
            max_waiting_grants: setup.max_waiting_grants,
            max_plan_length: setup.max_plan_length,
            prefetch_depth: setup.prefetch_depth,
            events: pool.clone().map(|p| p as Arc<dyn EventPool>),
            send_timeout: setup.send_timeout,
            drain: setup.drain.clone(),
        };
        let finish_ran = Arc::new(AtomicBool::new(false));
        let ran = finish_ran.clone();
        spawn(parts, control_rx, finished_tx, move || {
            ran.store(true, Ordering::SeqCst)
        });
        let (commands, inbound) = mpsc::channel(64);
        let (outbound, events) = mpsc::channel(setup.stream_room);
        let (reply, replied) = oneshot::channel();
        let attach = Control::Attach {
            inbound,
            outbound,
            reply,
        };
        assert!(shared.control.send(attach).is_ok());
        within("the attach reply", replied).await.unwrap().unwrap();
        let mut h = Harness {
            commands,
            events,
            shared,
            backend,
            copies,
            pool,
            scheduler,
            finished,
            finish_ran,
            _store: store,
            _dir: dir,
        };
        let attached = Event::Attached {
            session_id: "s-1".into(),
        };
        assert_eq!(h.next().await, attached);
        h
    }

    async fn send(&self, command: Command) {
        self.commands.send(command).await.expect("the actor runs");
    }

    async fn acquire(&self, group: u32, ticket: u64) {
        self.send(Command::Acquire {
            group,
            ticket,
            kind: None,
        })
        .await;
    }

    async fn release(&self, ticket: u64) {
        self.send(Command::Release { ticket }).await;
    }

    async fn next(&mut self) -> Event {
        within("an event", self.events.recv())
            .await
            .expect("the session's stream is open")
    }

    /// Every event the actor has sent for the commands so far (the actor answers commands in
    /// order, so once the probe's fault arrives, those before it are all handled).
    async fn settle(&mut self) -> Vec<Event> {
        self.release(PROBE).await;
        let probe = Event::fault(
            PROBE,
            FaultKind::NotFound,
            format!("release.ticket {PROBE} is not a live ticket"),
        );
        let mut before = Vec::new();
        loop {
            match self.next().await {
                e if e == probe => return before,
                e => before.push(e),
            }
        }
    }

    async fn copy_started(&mut self) -> CopySeen {
        within("a copy to start", self.copies.recv()).await.unwrap()
    }

    fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Nothing may stay blocked in the backend, or the copy thread would never join.
        self.backend.open();
        self.scheduler.shutdown();
    }
}

fn staged(ticket: u64, offset: u64) -> Event {
    Event::Staged {
        ticket,
        region: 0,
        offset,
        ready_event: 0,
        free_event: 0,
    }
}

#[tokio::test]
async fn an_acquire_is_staged_at_its_blocks_offset() {
    let mut h = Harness::start(Setup::default()).await;
    h.acquire(0, 1).await;
    assert_eq!(h.next().await, staged(1, 0));
    h.acquire(1, 2).await;
    assert_eq!(h.next().await, staged(2, BLOCK));
    let copied: Vec<u64> = [h.copy_started().await, h.copy_started().await]
        .iter()
        .map(|c| c.offset)
        .collect();
    assert_eq!(
        copied,
        vec![0, BLOCK],
        "each copy wrote where its Staged points"
    );
    let s = h.stats();
    assert_eq!((s.misses, s.copies, s.bytes_copied), (2, 2, 2 * BLOCK));
}

#[tokio::test]
async fn a_released_group_is_staged_again_without_a_copy() {
    let mut h = Harness::start(Setup::default()).await;
    h.acquire(0, 1).await;
    assert_eq!(h.next().await, staged(1, 0));
    h.release(1).await;
    h.acquire(0, 2).await;
    assert_eq!(h.next().await, staged(2, 0));
    let s = h.stats();
    assert_eq!(
        (s.acquires, s.hits, s.reuses, s.misses, s.copies, s.releases),
        (2, 1, 1, 1, 1, 1)
    );
}

#[tokio::test]
async fn released_space_goes_to_the_next_group() {
    let mut h = Harness::start(Setup {
        staging_blocks: 1,
        ..Setup::default()
    })
    .await;
    h.acquire(0, 1).await;
    assert_eq!(h.next().await, staged(1, 0));
    h.release(1).await;
    h.acquire(1, 2).await;
    assert_eq!(h.next().await, staged(2, 0));
    let s = h.stats();
    assert_eq!((s.evictions, s.copies), (1, 2));
}

#[tokio::test]
async fn bad_requests_get_exact_faults() {
    let mut h = Harness::start(Setup {
        hold_copies: true,
        max_live_tickets: 2,
        ..Setup::default()
    })
    .await;
    // Ticket 5 waits for its copy, which the backend holds; ticket 6 makes two live tickets.
    h.acquire(0, 5).await;
    h.acquire(1, 6).await;
    use FaultKind::*;
    let cases: Vec<(Command, Event)> = vec![
        (
            Command::Acquire {
                group: 4,
                ticket: 7,
                kind: None,
            },
            Event::fault(
                7,
                InvalidArgument,
                "acquire.group 4 is out of range: the session has 4 groups",
            ),
        ),
        (
            Command::Acquire {
                group: 2,
                ticket: 0,
                kind: None,
            },
            Event::fault(0, InvalidArgument, "acquire.ticket: 0 is reserved"),
        ),
        (
            Command::Acquire {
                group: 2,
                ticket: 5,
                kind: None,
            },
            Event::fault(5, InvalidArgument, "acquire.ticket 5 is already live"),
        ),
        (
            Command::Acquire {
                group: 2,
                ticket: 8,
                kind: None,
            },
            Event::fault(
                8,
                ResourceExhausted,
                "acquire: 2 live tickets, the limit is max_live_tickets = 2",
            ),
        ),
        (
            Command::Release { ticket: 77 },
            Event::fault(77, NotFound, "release.ticket 77 is not a live ticket"),
        ),
        (
            Command::Release { ticket: 5 },
            Event::fault(
                5,
                FailedPrecondition,
                "release.ticket 5 was not staged yet: wait for its Staged",
            ),
        ),
        (
            Command::GpuWait(GpuWaitReport {
                total_ns: 5,
                waits: 1,
                group_ns: vec![1, 1, 1, 1, 1],
            }),
            Event::fault(
                0,
                InvalidArgument,
                "gpu_wait.group_ns: 5 entries, more than the session's 4 groups",
            ),
        ),
    ];
    let mut failures = Vec::new();
    for (command, want) in cases {
        h.send(command.clone()).await;
        let got = h.settle().await;
        if got != [want.clone()] {
            failures.push(format!("{command:?}: got {got:?}, want [{want:?}]"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(h.stats().acquires, 2, "faulted acquires are not counted");
    assert_eq!(
        h.stats().gpu_wait_reports,
        0,
        "a refused report is not taken"
    );
}

#[tokio::test]
async fn the_clients_wait_report_is_what_the_session_shows() {
    let mut h = Harness::start(Setup::default()).await;
    let report = GpuWaitReport {
        total_ns: 9_000,
        waits: 3,
        group_ns: vec![0, 2_000, 7_000],
    };
    h.send(Command::GpuWait(report)).await;
    assert_eq!(h.settle().await, [], "a report gets no answer");
    let s = h.stats();
    assert_eq!(
        (s.gpu_wait_ns, s.gpu_waits, s.gpu_wait_reports),
        (9_000, 3, 1)
    );
    assert_eq!(h.shared.stats.group_gpu_wait_ns(), vec![0, 2_000, 7_000, 0]);
    assert_eq!(s.acquire_pending_ns, 0, "the daemon's own figure is apart");
}

#[tokio::test]
async fn an_arena_held_in_full_refuses_naming_its_size() {
    let mut h = Harness::start(Setup {
        staging_blocks: 2,
        ..Setup::default()
    })
    .await;
    h.acquire(0, 1).await;
    h.acquire(1, 2).await;
    assert_eq!(h.next().await, staged(1, 0));
    assert_eq!(h.next().await, staged(2, BLOCK));
    h.acquire(2, 3).await;
    let want = Event::fault(
        3,
        FaultKind::ResourceExhausted,
        "acquire: group 'g2' cannot be staged (no 1024-byte range of the staging arena can be \
         freed now: held, copying or sooner-needed blocks are in the way): the staging arena of \
         2048 bytes has 2048 bytes held by live tickets; release tickets before acquiring more, \
         or open the session with a larger staging_bytes",
    );
    assert_eq!(h.next().await, want);
    assert_eq!(h.shared.live_tickets.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn no_placement_without_an_event_slot() {
    // Two events: group 0's ready event and ticket 1's free event use them both.
    let mut h = Harness::start(Setup {
        staging_blocks: 1,
        events: Some(2),
        ..Setup::default()
    })
    .await;
    h.acquire(0, 1).await;
    let first = Event::Staged {
        ticket: 1,
        region: 0,
        offset: 0,
        ready_event: 1,
        free_event: 2,
    };
    assert_eq!(h.next().await, first);
    h.release(1).await;
    // Group 1 could only be placed by evicting group 0, whose copy then could get no event.
    h.acquire(1, 2).await;
    let want = Event::fault(2, FaultKind::ResourceExhausted, EVENTS_EXHAUSTED);
    assert_eq!(h.next().await, want);
    let s = h.stats();
    assert_eq!((s.evictions, s.copies), (0, 1), "group 0 stays staged");
}

#[tokio::test]
async fn reused_space_is_copied_only_after_the_client_freed_it() {
    let mut h = Harness::start(Setup {
        staging_blocks: 1,
        events: Some(4),
        ..Setup::default()
    })
    .await;
    h.acquire(0, 1).await;
    let Event::Staged { free_event, .. } = h.next().await else {
        panic!("ticket 1 is staged")
    };
    h.copy_started().await;
    // The client still reads group 0 when it releases ticket 1.
    let pool = h.pool.clone().unwrap();
    pool.set_pending(free_event, true);
    h.release(1).await;
    h.acquire(1, 2).await;
    assert_eq!(h.settle().await, vec![], "group 1 waits for its copy");
    assert_eq!(
        h.scheduler.stats(0).queued,
        1,
        "the copy waits for the free event"
    );
    assert!(
        h.copies.try_recv().is_err(),
        "nothing was copied over group 0"
    );
    pool.set_pending(free_event, false);
    assert_eq!(h.copy_started().await.offset, 0);
    assert!(matches!(h.next().await, Event::Staged { ticket: 2, .. }));
}

#[tokio::test]
async fn prefetch_stages_the_plans_next_groups_before_they_are_acquired() {
    let mut h = Harness::start(Setup {
        hold_copies: true,
        prefetch_depth: 2,
        ..Setup::default()
    })
    .await;
    h.send(Command::Plan {
        groups: vec![0, 1, 2, 3],
        kind: None,
    })
    .await;
    h.settle().await;
    assert_eq!(h.stats().prefetches, 2, "prefetch_depth copies ahead");
    h.backend.open();
    let mut copied: Vec<u64> = Vec::new();
    for _ in 0..4 {
        copied.push(h.copy_started().await.offset);
    }
    assert_eq!(copied, vec![0, BLOCK, 2 * BLOCK, 3 * BLOCK]);
    for group in 0..4u32 {
        h.acquire(group, 10 + group as u64).await;
        assert_eq!(
            h.next().await,
            staged(10 + group as u64, group as u64 * BLOCK)
        );
    }
    let s = h.stats();
    assert_eq!(
        (s.prefetches, s.hits, s.misses, s.copies),
        (4, 4, 0, 4),
        "every acquire found its group prefetched"
    );
}

#[tokio::test]
async fn a_client_off_the_plan_resyncs() {
    let mut h = Harness::start(Setup::default()).await;
    h.send(Command::Plan {
        groups: vec![0, 1, 2, 3],
        kind: None,
    })
    .await;
    for (group, ticket) in [(0, 1), (1, 2), (3, 3), (0, 4)] {
        h.acquire(group, ticket).await;
        let event = h.next().await;
        assert!(
            matches!(event, Event::Staged { ticket: t, .. } if t == ticket),
            "{event:?}"
        );
        h.release(ticket).await;
    }
    h.settle().await;
    // 0 → 1 kept to the plan, 1 → 3 skipped 2, 3 → 0 wrapped around as planned.
    assert_eq!(h.stats().resyncs, 1);
}

#[tokio::test]
async fn teardown_waits_for_the_copy_in_flight_and_cancels_queued_ones() {
    let mut h = Harness::start(Setup {
        hold_copies: true,
        ..Setup::default()
    })
    .await;
    h.acquire(0, 1).await;
    assert_eq!(h.copy_started().await.offset, 0, "group 0 is in flight");
    h.acquire(1, 2).await;
    h.settle().await;
    assert_eq!(h.scheduler.stats(0).queued, 1, "group 1 is queued");
    assert!(
        h.shared
            .control
            .send(Control::Close(CloseReason::ClientClosed))
            .is_ok()
    );
    // Teardown begins by cancelling what is queued.
    let scheduler = h.scheduler.clone();
    within("the queued copy to be cancelled", async {
        while scheduler.stats(0).queued > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(!*h.finished.borrow(), "teardown waits for the copy");
    assert!(!h.finish_ran.load(Ordering::SeqCst), "nothing is freed yet");
    h.backend.open();
    let mut finished = h.finished.clone();
    within("teardown", finished.wait_for(|done| *done))
        .await
        .unwrap();
    assert!(h.finish_ran.load(Ordering::SeqCst));
    assert!(h.copies.try_recv().is_err(), "the queued copy never ran");
    assert_eq!(
        h.events.recv().await,
        None,
        "the stream ends with the session"
    );
}

#[tokio::test]
async fn overlapping_waits_are_pending_once_and_the_oldest_group_is_charged() {
    let mut h = Harness::start(Setup {
        hold_copies: true,
        ..Setup::default()
    })
    .await;
    let started = Instant::now();
    h.acquire(0, 1).await;
    h.acquire(1, 2).await;
    h.settle().await;
    // Let wall time pass with both tickets waiting: per-ticket sums would count it twice.
    tokio::time::sleep(Duration::from_millis(50)).await;
    h.backend.open();
    assert_eq!(h.next().await, staged(1, 0));
    assert_eq!(h.next().await, staged(2, BLOCK));
    let wall = started.elapsed().as_nanos() as u64;
    let pending = h.stats().acquire_pending_ns;
    let per_group = h.shared.stats.group_acquire_pending_ns();
    assert!(
        pending >= 50_000_000,
        "pending {pending} ns covers the 50 ms wait"
    );
    assert!(
        pending <= wall,
        "pending {pending} ns exceeds the wall time {wall} ns"
    );
    assert_eq!(per_group.iter().sum::<u64>(), pending);
    assert!(per_group[0] >= 50_000_000, "{per_group:?}");
    assert_eq!(per_group[2..], [0, 0]);
}

/// Plan entries looked at for one step of `len`-entry plan cycling through 8 groups that all
/// fit in the arena (after a warm-up step has staged them all).
async fn plan_entries_per_step(len: usize) -> u64 {
    let mut h = Harness::start(Setup {
        groups: 8,
        staging_blocks: 8,
        prefetch_depth: 4,
        max_plan_length: 1 << 20,
        ..Setup::default()
    })
    .await;
    let groups = (0..len as u32).map(|i| i % 8).collect();
    h.send(Command::Plan { groups, kind: None }).await;
    let mut ticket = 0;
    let mut step = async |h: &mut Harness| {
        for group in 0..8 {
            ticket += 1;
            h.acquire(group, ticket).await;
            assert!(matches!(h.next().await, Event::Staged { ticket: t, .. } if t == ticket));
            h.release(ticket).await;
        }
        h.settle().await;
    };
    step(&mut h).await;
    let visited = |h: &Harness| h.shared.stats.plan_entries_visited.load(Ordering::Relaxed);
    let (before, misses) = (visited(&h), h.stats().misses);
    step(&mut h).await;
    assert_eq!(
        h.stats().misses,
        misses,
        "the second step found every group staged"
    );
    visited(&h) - before
}

#[tokio::test]
async fn the_work_of_a_message_does_not_grow_with_the_plans_length() {
    let small = plan_entries_per_step(1 << 10).await;
    let big = plan_entries_per_step(1 << 20).await;
    assert_eq!(small, big, "plan entries looked at in one step");
    // 16 messages, each looking at most at the cursor's entry and the 8 groups of the window.
    assert!(big <= 16 * (1 + 8), "{big}");
}

/// Faults the client never reads: releases of tickets it never had. Returns once the actor has
/// taken every one of them (it takes the next command only after sending the last one's fault).
async fn flood_unread_faults(h: &Harness, n: u64) {
    for ticket in 1..=n {
        h.release(ticket).await;
    }
    within("the actor to take every command", async {
        while h.commands.capacity() < h.commands.max_capacity() {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_client_that_stops_reading_ends_its_session_after_the_send_timeout() {
    let h = Harness::start(Setup {
        stream_room: 2,
        send_timeout: Duration::from_millis(50),
        ..Setup::default()
    })
    .await;
    // Two faults fill the stream; the third waits for room that never comes.
    flood_unread_faults(&h, 3).await;
    let mut finished = h.finished.clone();
    within("the session to end", finished.wait_for(|done| *done))
        .await
        .unwrap();
    assert!(h.finish_ran.load(Ordering::SeqCst), "torn down");
}

#[tokio::test]
async fn during_a_stop_a_client_that_stops_reading_holds_its_session_only_to_the_drain_deadline() {
    let (deadline, drain) = DrainDeadline::channel();
    let h = Harness::start(Setup {
        stream_room: 2,
        // Longer than any test: only the drain's deadline can end the wait.
        send_timeout: Duration::from_secs(3600),
        drain,
        ..Setup::default()
    })
    .await;
    // The actor now waits for room for the third fault, and reads no control message.
    flood_unread_faults(&h, 3).await;
    deadline.send_replace(Some(
        tokio::time::Instant::now() + Duration::from_millis(50),
    ));
    assert!(
        h.shared
            .control
            .send(Control::Close(CloseReason::Shutdown))
            .is_ok()
    );
    let mut finished = h.finished.clone();
    within("the session to end", finished.wait_for(|done| *done))
        .await
        .unwrap();
}
