//! Grants of the client's own copies (CopyGrant): the LoRA's working weights it copies to the
//! device and its gradients back, paced with the daemon's copies. A grant is at most
//! [`MAX_GRANT_BYTES`] and the device bytes its session is charged for, and a session has at most
//! `max_waiting_grants` waiting. To the device, a grant's pieces take their turns in the copy
//! queue and are charged as a copy's; from the device, they take turns with other sessions' on
//! the link's other direction. The answer goes out once the last piece may go; the session's end
//! drops what is left.

use super::Actor;
use crate::scheduler::{CopyError, CopyRequest, MAX_GRANT_BYTES, NO_GROUP, Priority, Work};
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
        let shared = &self.p.shared;
        let charged = shared.staging_bytes + shared.resident_bytes;
        let most = shared.max_grant_bytes();
        if bytes == 0 || bytes > most {
            let msg = format!(
                "grant.bytes: {bytes} is outside 1 to {most} (the smaller of the daemon's \
                 largest grant, {MAX_GRANT_BYTES}, and the {charged} device bytes the session \
                 is charged for): split the copy into grants of at most {most} bytes"
            );
            return self.fault(id, FaultKind::InvalidArgument, msg);
        }
        let limit = self.p.max_waiting_grants;
        if self.granting.len() >= limit as usize {
            let waiting = self.granting.len();
            let msg = format!(
                "grant: {waiting} grants waiting, the limit is max_waiting_grants = {limit}: \
                 wait for an answer before asking again"
            );
            return self.fault(id, FaultKind::ResourceExhausted, msg);
        }
        if self.tickets.contains_key(&id) || !self.granting.insert(id) {
            let msg = format!("grant.id: {id} is a live ticket or a grant still waiting");
            return self.fault(id, FaultKind::InvalidArgument, msg);
        }
        let tx = self.grants_tx.clone();
        let shared = &self.p.shared;
        let request = CopyRequest {
            session: shared.number,
            tag: NO_GROUP,
            priority: Priority::Prefetch,
            work: Work::grant(bytes),
            done: Box::new(move |outcome| {
                let cancelled = matches!(outcome.result, Err(CopyError::Cancelled));
                let _ = tx.send(GrantDone {
                    id,
                    bytes,
                    direction,
                    cancelled,
                });
            }),
        };
        match direction {
            Direction::ToDevice => self.p.scheduler.submit(shared.device, request),
            Direction::FromDevice => (self.p.scheduler).submit_from_device(shared.device, request),
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
