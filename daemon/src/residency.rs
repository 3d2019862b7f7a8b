//! ResidentSet: groups kept on the device for a session's whole life, shared read-only between
//! sessions of the same model on the same device.
//!
//! A session asks for the groups its budget lets it keep; those already resident for that
//! (model, device) are shared, the rest are copied, each into a region of its own. A region is
//! freed when the last lease that uses it is dropped (the registry keeps only weak references):
//! a region per group, so that a session keeps alive only the groups it uses (with one region
//! for several groups, a session sharing one of them kept all of them on the device, past its
//! budget, once the session that made the region ended). A session that stages a group another
//! session keeps resident copies it from that region, within the device ([`ResidencyRegistry::region`]).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use tokio::sync::{Mutex, oneshot};

use crate::backend::{Backend, CopyJob, DeviceRegion};
use crate::mem::{HostSlice, align_up};
use crate::scheduler::{CopyError, CopyRequest, CopyScheduler, NO_GROUP, Priority, Work};

/// Identifies a group across sessions: its tensor names in order.
pub type GroupKey = String;

/// A group to keep resident: its key, its size and the bytes to put there.
pub struct ResidentWant {
    pub key: GroupKey,
    pub nbytes: u64,
    /// (source, offset from the group's start)
    pub spans: Vec<(HostSlice, u64)>,
}

/// One session's share of the resident set.
#[derive(Default)]
pub struct ResidentLease {
    /// A region per group, each holding that group alone (at offset 0).
    pub regions: Vec<Arc<dyn DeviceRegion>>,
    /// group key -> index into `regions`
    pub placements: HashMap<GroupKey, usize>,
    /// Bytes this lease copied itself (the rest were already resident).
    pub copied_bytes: u64,
}

/// Live resident regions per model id and device, by group.
type ResidentSets = HashMap<String, HashMap<usize, HashMap<GroupKey, Weak<dyn DeviceRegion>>>>;

#[derive(Default)]
pub struct ResidencyRegistry {
    /// Held only to read or change the map, never across an await.
    sets: std::sync::Mutex<ResidentSets>,
    /// Held across a lease's copies, so that two sessions opening at once share one copy.
    leasing: Mutex<()>,
}

#[derive(Debug, thiserror::Error)]
pub enum ResidencyError {
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error("resident copy failed: {0}")]
    Copy(#[from] CopyError),
    #[error("resident copy abandoned: the copy thread stopped")]
    Abandoned,
}

impl ResidencyRegistry {
    /// Leases `wanted` groups of `model_id` on `device`, copying those not yet resident.
    pub async fn lease(
        &self,
        backend: &dyn Backend,
        scheduler: &CopyScheduler,
        session: u64,
        model_id: &str,
        device: usize,
        wanted: Vec<ResidentWant>,
    ) -> Result<ResidentLease, ResidencyError> {
        let mut lease = ResidentLease::default();
        if wanted.is_empty() {
            return Ok(lease);
        }
        let _leasing = self.leasing.lock().await;
        let mut missing = Vec::new();
        {
            let mut sets = self.sets();
            let live = sets.entry(model_id.to_string()).or_default();
            let live = live.entry(device).or_default();
            live.retain(|_, w| w.strong_count() > 0);
            for want in wanted {
                match live.get(&want.key).and_then(Weak::upgrade) {
                    Some(region) => lease.hold(want.key, region),
                    None => missing.push(want),
                }
            }
        }
        let placed = place_missing(backend, scheduler, session, device, missing).await?;
        let mut sets = self.sets();
        let live = sets.entry(model_id.to_string()).or_default();
        let live = live.entry(device).or_default();
        for (key, region) in placed {
            lease.copied_bytes += region.size();
            live.insert(key.clone(), Arc::downgrade(&region));
            lease.hold(key, region);
        }
        Ok(lease)
    }

    /// The region that holds `key` of `model_id` resident on `device`, if a session keeps one
    /// there now (its bytes are the group's, laid out as in a staging block, from offset 0):
    /// a staging copy can come from it instead of over the link.
    pub fn region(
        &self,
        model_id: &str,
        device: usize,
        key: &str,
    ) -> Option<Arc<dyn DeviceRegion>> {
        let sets = self.sets();
        sets.get(model_id)?.get(&device)?.get(key)?.upgrade()
    }

    fn sets(&self) -> std::sync::MutexGuard<'_, ResidentSets> {
        self.sets.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ResidentLease {
    fn hold(&mut self, key: GroupKey, region: Arc<dyn DeviceRegion>) {
        self.placements.insert(key, self.regions.len());
        self.regions.push(region);
    }
}

/// Copies each missing group into a region of its own; the copies run together, and the
/// regions come back once all have ended.
async fn place_missing(
    backend: &dyn Backend,
    scheduler: &CopyScheduler,
    session: u64,
    device: usize,
    missing: Vec<ResidentWant>,
) -> Result<Vec<(GroupKey, Arc<dyn DeviceRegion>)>, ResidencyError> {
    let align = backend.alignment();
    let mut placed = Vec::with_capacity(missing.len());
    let mut copies = Vec::with_capacity(missing.len());
    for want in missing {
        let region =
            backend.alloc_region(device, align_up(want.nbytes.max(1), align), "resident")?;
        let (tx, rx) = oneshot::channel();
        scheduler.submit(
            device,
            CopyRequest {
                session,
                tag: NO_GROUP,
                priority: Priority::Demand,
                // Resident groups have no ready event: the copy completes before any Staged.
                work: Work::Copy(CopyJob {
                    synchronous: true,
                    ..CopyJob::copy(region.clone(), want.spans)
                }),
                done: Box::new(move |outcome| {
                    let _ = tx.send(outcome);
                }),
            },
        );
        copies.push(rx);
        placed.push((want.key, region));
    }
    for copy in copies {
        copy.await.map_err(|_| ResidencyError::Abandoned)?.result?;
    }
    Ok(placed)
}
