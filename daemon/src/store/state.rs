//! State regions: host memory that belongs to one session, for its trainer's own state (LoRA
//! master weights, optimizer moments) that it keeps on the host and maps read-write.
//!
//! A region is a memfd the daemon makes and never maps: its owner writes and reads it through
//! its own fd and mapping (and page-locks that mapping itself). It is charged to the owner's uid
//! against the same host quotas as models and uploads, counted by the store under its one lock,
//! so a region and a load or upload at the same time cannot both pass a quota; it is refused
//! before anything is made when it does not fit. A region is never shared or deduplicated, and
//! goes with its session (or when freed before): what a client still maps or holds an fd of
//! stays charged to its uid until the kernel frees it (`mem::held`), as for uploads.
//!
//! Its pages are not reserved: the client's first touch of each allocates it (and its
//! page-locking, which faults the pages in, is its own to make).

use std::collections::HashMap;
use std::sync::Arc;

use super::{Store, StoreError};
use crate::mem::align_up;
use crate::mem::shm::Memfd;

/// A state region's size is its asked bytes rounded up to a multiple of this (a page).
pub const STATE_ALIGN: u64 = 4096;

/// A session's state region, as the store keeps it.
pub(super) struct StateRegion {
    pub(super) uid: u32,
    pub(super) session: String,
    pub(super) memfd: Arc<Memfd>,
}

/// A state region just made: its id, size and memfd (its owner gets it read-write through the
/// handoff socket).
#[derive(Debug, Clone)]
pub struct StateTicket {
    pub region_id: String,
    pub size: u64,
    pub memfd: Arc<Memfd>,
}

/// What one session holds in state regions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateUse {
    pub bytes: u64,
    pub regions: u32,
}

/// What to do about a state region a host quota refused, after the refusal.
const STATE_REFUSED_HINT: &str = "a state region is charged whole when it is made: ask for \
    fewer bytes, free host memory (state regions, sessions, models), or ask the daemon's \
    administrator for a larger quota";

impl Store {
    /// Makes a state region of `bytes` (rounded up to [`STATE_ALIGN`]) for `uid`'s session
    /// `session`, under `region_id` (chosen by the caller: random, so that another uid cannot
    /// guess it); refused when the session holds `limits.max_state_regions` already or a host
    /// quota would pass, with nothing made or charged.
    pub fn alloc_state(
        &self,
        uid: u32,
        session: &str,
        region_id: String,
        bytes: u64,
    ) -> Result<StateTicket, StoreError> {
        let size = align_up(bytes, STATE_ALIGN);
        self.check_state_count(session)?;
        let reserved = self
            .reserve(uid, size, false, "state region")
            .map_err(|e| match e {
                StoreError::Quota(refused) => {
                    StoreError::HostFull(format!("{refused}; {STATE_REFUSED_HINT}"))
                }
                StoreError::HostFull(refused) => {
                    StoreError::HostFull(format!("{refused}; {STATE_REFUSED_HINT}"))
                }
                other => other,
            })?;
        let memfd = self
            .shm
            .create_state(size)
            .map_err(|source| StoreError::Arena {
                bytes: size,
                source,
            })?;
        let mut inner = self.inner();
        // Again under the lock: two at once may both have passed the first check.
        if let Err(e) = check_count(&inner.state, session, self.limits.max_state_regions) {
            drop(inner);
            return Err(e);
        }
        let ticket = StateTicket {
            region_id: region_id.clone(),
            size,
            memfd: memfd.clone(),
        };
        inner.state.insert(
            region_id,
            StateRegion {
                uid,
                session: session.to_string(),
                memfd,
            },
        );
        // The region counts itself from now on (dropped after the lock: its drop locks).
        drop(inner);
        drop(reserved);
        Ok(ticket)
    }

    fn check_state_count(&self, session: &str) -> Result<(), StoreError> {
        check_count(&self.inner().state, session, self.limits.max_state_regions)
    }

    /// Frees state region `region_id` of `session`. One of another session is unknown, as
    /// one that does not exist.
    pub fn free_state(&self, session: &str, region_id: &str) -> Result<(), StoreError> {
        let mut inner = self.inner();
        match inner.state.get(region_id) {
            Some(r) if r.session == session => {}
            _ => return Err(StoreError::UnknownStateRegion(region_id.to_string())),
        }
        let freed = inner.state.remove(region_id);
        // Outside the lock: a memfd's drop may start watching what its client still holds.
        drop(inner);
        drop(freed);
        Ok(())
    }

    /// Frees every state region of `session` (it has ended); returns their ids.
    pub fn drop_state_of(&self, session: &str) -> Vec<String> {
        let mut inner = self.inner();
        let ids: Vec<String> = (inner.state.iter())
            .filter(|(_, r)| r.session == session)
            .map(|(id, _)| id.clone())
            .collect();
        let freed: Vec<StateRegion> = (ids.iter())
            .filter_map(|id| inner.state.remove(id))
            .collect();
        drop(inner);
        drop(freed);
        ids
    }

    /// State regions per session: their bytes and how many.
    pub fn state_use(&self) -> HashMap<String, StateUse> {
        let mut by_session: HashMap<String, StateUse> = HashMap::new();
        for r in self.inner().state.values() {
            let u = by_session.entry(r.session.clone()).or_default();
            u.bytes += r.memfd.size();
            u.regions += 1;
        }
        by_session
    }
}

/// Refuses one more region for `session` when it holds `limit` already.
fn check_count(
    state: &HashMap<String, StateRegion>,
    session: &str,
    limit: u32,
) -> Result<(), StoreError> {
    let held = state.values().filter(|r| r.session == session).count() as u64;
    if held >= u64::from(limit) {
        return Err(StoreError::TooManyStateRegions {
            session: session.to_string(),
            limit,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::held::{Charge, FdHolder};
    use crate::mem::shm::Access;
    use crate::quota::HostQuota;
    use crate::store::test_support::store_with;

    /// A region is its bytes rounded up to pages, charged to its uid until freed; a session's
    /// regions go together; each refusal makes and charges nothing.
    #[test]
    fn a_state_region_is_charged_to_its_uid_until_freed_and_refused_up_front() {
        let store = store_with(HostQuota {
            per_uid_bytes: 3 * STATE_ALIGN,
            ..HostQuota::default()
        });
        let a = store.alloc_state(7, "s-1", "st-a".into(), 1).unwrap();
        assert_eq!(
            (a.size, a.memfd.size(), a.memfd.kind()),
            (4096, 4096, "state")
        );
        let b = store.alloc_state(7, "s-1", "st-b".into(), 4097).unwrap();
        assert_eq!(b.size, 8192);
        let used = store.host_use(7);
        assert_eq!((used.uid_bytes, used.uid_state_bytes), (12288, 12288));
        assert_eq!(used.total_state_bytes, 12288);
        assert_eq!(
            store
                .alloc_state(7, "s-2", "st-c".into(), 1)
                .unwrap_err()
                .to_string(),
            format!(
                "quotas.per_uid_host_bytes = 12288 exceeded: uid 7 holds 12288 host bytes and \
                 this state region needs 4096 more; held by: 2 state regions of sessions (12.0 \
                 KiB). State regions go with their sessions (CloseSession), or by \
                 FreeStateRegion; {STATE_REFUSED_HINT}"
            )
        );
        assert_eq!(store.shm.live("state"), 2, "nothing made");
        // Another uid has its own quota.
        store.alloc_state(8, "s-3", "st-d".into(), 4096).unwrap();
        assert_eq!(
            store.state_use()["s-1"],
            StateUse {
                bytes: 12288,
                regions: 2
            }
        );
        assert!(matches!(
            store.free_state("s-3", "st-a"),
            Err(StoreError::UnknownStateRegion(_))
        ));
        drop((a, b));
        store.free_state("s-1", "st-a").unwrap();
        assert_eq!(store.host_use(7).uid_bytes, 8192);
        assert_eq!(store.drop_state_of("s-1"), vec!["st-b".to_string()]);
        assert_eq!(store.host_use(7).uid_bytes, 0);
        assert_eq!(store.host_use(8).uid_bytes, 4096);
        assert_eq!(store.shm.live("state"), 1);
    }

    #[test]
    fn a_session_holds_at_most_max_state_regions() {
        let store = store_with(HostQuota::default());
        let limit = store.limits.max_state_regions;
        for i in 0..limit {
            store.alloc_state(7, "s-1", format!("st-{i}"), 1).unwrap();
        }
        assert_eq!(
            store
                .alloc_state(7, "s-1", "st-x".into(), 1)
                .unwrap_err()
                .to_string(),
            format!(
                "limits.max_state_regions_per_session = {limit} reached: session 's-1' holds \
                 {limit} state regions"
            )
        );
        store.alloc_state(7, "s-2", "st-y".into(), 1).unwrap();
    }

    /// A region whose fd its client holds stays charged after it is freed, until the client
    /// lets go.
    #[test]
    fn a_freed_region_a_client_holds_stays_charged_until_it_lets_go() {
        let store = store_with(HostQuota::default());
        let ticket = store.alloc_state(7, "s-1", "st-a".into(), 8192).unwrap();
        let holder = FdHolder {
            uid: 7,
            pid: 70,
            charge: Charge::Host,
        };
        let client = ticket.memfd.hand_out(Access::ReadWrite, holder).unwrap();
        drop(ticket);
        store.drop_state_of("s-1");
        let used = store.host_use(7);
        assert_eq!((used.uid_bytes, used.uid_state_bytes), (8192, 0));
        drop(client);
        assert_eq!(store.host_use(7).uid_bytes, 0);
    }
}
