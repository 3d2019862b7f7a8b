//! Grants of the client's own copies (CopyGrant): the LoRA's working weights it copies to the
//! device and its gradients back, paced with the daemon's copies. To the device, a grant takes
//! its turn in the copy queue and is charged as a copy of its size; from the device, it is
//! charged to the link's other direction. The answer goes out once the bytes may go.

use std::time::Duration;

use super::Actor;
use crate::scheduler::{CopyError, CopyRequest, NO_GROUP, Priority, Work};
use crate::session::{Direction, Event, FaultKind, SessionStats};

/// A grant the scheduler (or the pacing of the other direction) has let go.
pub(super) struct GrantDone {
    id: u64,
    bytes: u64,
    direction: Direction,
    /// The session ended before the grant's turn: nothing to answer.
    cancelled: bool,
}

impl Actor {
    pub(super) fn on_grant(&mut self, id: u64, bytes: u64, direction: Direction) {
        let budget = self.p.shared.vram_budget;
        if bytes == 0 || bytes > budget {
            let msg = format!(
                "grant.bytes: {bytes} is outside 1 to the session's vram_budget ({budget})"
            );
            return self.fault(id, FaultKind::InvalidArgument, msg);
        }
        if self.tickets.contains_key(&id) || !self.granting.insert(id) {
            let msg = format!("grant.id: {id} is a live ticket or a grant still waiting");
            return self.fault(id, FaultKind::InvalidArgument, msg);
        }
        let tx = self.grants_tx.clone();
        let shared = &self.p.shared;
        match direction {
            Direction::ToDevice => self.p.scheduler.submit(
                shared.device,
                CopyRequest {
                    session: shared.number,
                    tag: NO_GROUP,
                    priority: Priority::Prefetch,
                    work: Work::Grant(bytes),
                    done: Box::new(move |outcome| {
                        let cancelled = matches!(outcome.result, Err(CopyError::Cancelled));
                        let _ = tx.send(GrantDone {
                            id,
                            bytes,
                            direction,
                            cancelled,
                        });
                    }),
                },
            ),
            Direction::FromDevice => {
                let wait = self.p.scheduler.grant_from_device(shared.device, bytes);
                let done = GrantDone {
                    id,
                    bytes,
                    direction,
                    cancelled: false,
                };
                if wait == Duration::ZERO {
                    self.on_granted(done);
                } else {
                    tokio::spawn(async move {
                        tokio::time::sleep(wait).await;
                        let _ = tx.send(done);
                    });
                }
            }
        }
    }

    pub(super) fn on_granted(&mut self, done: GrantDone) {
        if !self.granting.remove(&done.id) || done.cancelled {
            return;
        }
        let stats = self.stats();
        let counter = match done.direction {
            Direction::ToDevice => &stats.granted_h2d_bytes,
            Direction::FromDevice => &stats.granted_d2h_bytes,
        };
        SessionStats::bump(counter, done.bytes);
        self.outbox.push(Event::Granted { id: done.id });
    }
}
