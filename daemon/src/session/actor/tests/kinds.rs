//! The session's counters per pass kind (`Acquire.kind`): the kind an acquire names stays in
//! force for the acquires, copies and wait reports after it.

use super::*;
use crate::session::{KindSnapshot, PassKind};

#[tokio::test]
async fn counters_go_to_the_kind_in_force() {
    let mut h = Harness::start(Setup::default()).await;
    let acquire = |group, ticket, kind| Command::Acquire {
        group,
        ticket,
        kind,
    };
    // Before any acquire names a kind, the session counts training.
    h.send(acquire(0, 1, None)).await;
    assert_eq!(h.next().await, staged(1, 0));
    h.send(acquire(1, 2, Some(PassKind::Sample))).await;
    assert_eq!(h.next().await, staged(2, BLOCK));
    h.release(2).await;
    // Unnamed: still sampling; the group is still staged (a hit).
    h.send(acquire(1, 3, None)).await;
    assert_eq!(h.next().await, staged(3, BLOCK));
    h.send(Command::GpuWait(GpuWaitReport {
        total_ns: 700,
        waits: 2,
        group_ns: vec![],
    }))
    .await;
    h.send(acquire(0, 4, Some(PassKind::Train))).await;
    assert_eq!(h.next().await, staged(4, 0));
    h.send(Command::GpuWait(GpuWaitReport {
        total_ns: 1_000,
        waits: 3,
        group_ns: vec![],
    }))
    .await;
    assert_eq!(h.settle().await, vec![], "no fault");
    let s = h.stats();
    let train = KindSnapshot {
        acquires: 2,
        hits: 1,
        misses: 1,
        bytes_copied: BLOCK,
        gpu_wait_ns: 300,
        gpu_waits: 1,
    };
    let sample = KindSnapshot {
        acquires: 2,
        hits: 1,
        misses: 1,
        bytes_copied: BLOCK,
        gpu_wait_ns: 700,
        gpu_waits: 2,
    };
    assert_eq!(s.kinds, [train, sample]);
    assert_eq!(
        (s.acquires, s.hits, s.misses, s.gpu_wait_ns),
        (4, 2, 2, 1_000)
    );
}

#[tokio::test]
async fn a_plans_kind_comes_in_force_before_its_prefetches() {
    let mut h = Harness::start(Setup::default()).await;
    h.send(Command::Plan {
        groups: vec![0, 1],
        kind: Some(PassKind::Sample),
    })
    .await;
    for (group, ticket) in [(0, 1), (1, 2)] {
        h.acquire(group, ticket).await;
        assert_eq!(h.next().await, staged(ticket, group as u64 * BLOCK));
    }
    let [train, sample] = h.stats().kinds;
    assert_eq!(train, KindSnapshot::default());
    assert_eq!(
        (sample.acquires, sample.hits, sample.bytes_copied),
        (2, 2, 2 * BLOCK)
    );
}
