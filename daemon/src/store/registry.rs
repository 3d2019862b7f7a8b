//! The registry: models by id, the references each uid holds to them (loads, uploads and open
//! sessions) and how long each lasts, dedup of identical sources, and the host bytes each uid
//! is charged (models, uploads, and what is being made), checked against the quotas before
//! anything is allocated — after evicting, when that makes room, models that only closed
//! connections' references hold (`cache`).

use std::collections::HashMap;
use std::sync::Arc;

use super::reserve::{Pending, Reservation};
use super::state::StateRegion;
use super::upload::Upload;
use super::{Model, Owner, Retention, Store, StoreError};
use crate::quota::{HostQuota, check_count};

/// One load reference: whose, taken by which connection (while it is open), how long it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reference {
    uid: u32,
    conn: Option<u64>,
    retention: Retention,
}

/// What one uid holds of a model: load references (LoadModel, CommitUpload: given back by
/// ReleaseModel) and open sessions (given back when they close).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub uid: u32,
    pub loads: u32,
    pub sessions: u32,
}

/// A model as listed: the model and its reference counts.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    pub model: Arc<Model>,
    /// Load references, all uids.
    pub refs: u32,
    /// Open sessions, all uids.
    pub sessions: u32,
    /// Per uid, in the order the uids took their first reference.
    pub holders: Vec<Holder>,
    /// The uid whose host quota the model counts against: the first holder, then (once it
    /// holds nothing) the next one. A copy shared by many uids counts once.
    pub charged_uid: u32,
    /// The load references one by one (`refs` of them).
    references: Vec<Reference>,
    /// When a reference or a session last came or went (the store's clock): the least
    /// recently used cache entry is evicted first.
    pub(super) last_used: u64,
}

impl ModelEntry {
    fn new(model: Arc<Model>, owner: Owner, retention: Retention, now: u64) -> ModelEntry {
        let mut entry = ModelEntry {
            model,
            refs: 0,
            sessions: 0,
            holders: Vec::new(),
            charged_uid: owner.uid,
            references: Vec::new(),
            last_used: now,
        };
        entry.take(owner, retention, now);
        entry
    }

    /// Pinned references, all uids.
    pub fn pinned(&self) -> u32 {
        let pinned = self
            .references
            .iter()
            .filter(|r| r.retention == Retention::Pinned);
        pinned.count() as u32
    }

    /// Whether the model is only a cache entry: no session, no pin, no reference of an open
    /// connection holds it. The store evicts such a model when a load or upload needs room.
    pub fn cached(&self) -> bool {
        self.sessions == 0
            && (self.references.iter())
                .all(|r| r.conn.is_none() && r.retention == Retention::Cached)
    }

    /// What holds the model, per uid, for people: `uid 1000: pinned, 1 session`.
    pub(super) fn held_by(&self) -> String {
        let per_uid: Vec<String> = (self.holders.iter())
            .map(|h| {
                let mine = || self.references.iter().filter(move |r| r.uid == h.uid);
                let mut what = Vec::new();
                if mine().any(|r| r.retention == Retention::Pinned) {
                    what.push("pinned".to_string());
                }
                if mine().any(|r| r.conn.is_some()) {
                    what.push("a reference of an open connection".to_string());
                }
                match h.sessions {
                    0 => {}
                    1 => what.push("1 session".to_string()),
                    n => what.push(format!("{n} sessions")),
                }
                if what.is_empty() {
                    what.push("cached".to_string());
                }
                format!("uid {}: {}", h.uid, what.join(", "))
            })
            .collect();
        per_uid.join("; ")
    }

    /// One more load reference, taken by `owner`'s connection.
    fn take(&mut self, owner: Owner, retention: Retention, now: u64) {
        self.refs += 1;
        self.holder(owner.uid).loads += 1;
        self.references.push(Reference {
            uid: owner.uid,
            conn: Some(owner.conn),
            retention,
        });
        self.last_used = now;
    }

    /// Gives back the reference at `at`.
    fn give_back(&mut self, at: usize) {
        let r = self.references.remove(at);
        self.refs -= 1;
        self.holder(r.uid).loads -= 1;
        self.drop_if_empty(r.uid);
    }

    /// The reference of `owner`'s uid that ReleaseModel gives back: one its connection took
    /// (the latest), else a cached one, else one of another open connection, else a pin.
    fn to_release(&self, owner: Owner) -> Option<usize> {
        let mine = |r: &Reference| r.uid == owner.uid;
        let rank = |r: &Reference| match (r.conn == Some(owner.conn), r.retention) {
            (true, _) => 0,
            (false, Retention::Cached) => 1,
            (false, Retention::Connection) => 2,
            (false, Retention::Pinned) => 3,
        };
        (self.references.iter().enumerate())
            .filter(|(_, r)| mine(r))
            .min_by_key(|(at, r)| (rank(r), usize::MAX - at))
            .map(|(at, _)| at)
    }

    fn holder(&mut self, uid: u32) -> &mut Holder {
        let at = match self.holders.iter().position(|h| h.uid == uid) {
            Some(at) => at,
            None => {
                self.holders.push(Holder {
                    uid,
                    loads: 0,
                    sessions: 0,
                });
                self.holders.len() - 1
            }
        };
        &mut self.holders[at]
    }

    /// Forgets a uid that holds nothing any more; the charge follows the references: a uid
    /// that let go is not billed for a copy that others keep (with nobody left, the model
    /// goes).
    fn drop_if_empty(&mut self, uid: u32) {
        let Some(at) = self.holders.iter().position(|h| h.uid == uid) else {
            return;
        };
        if self.holders[at].loads > 0 || self.holders[at].sessions > 0 {
            return;
        }
        self.holders.remove(at);
        if self.charged_uid == uid
            && let Some(next) = self.holders.first()
        {
            self.charged_uid = next.uid;
            tracing::info!(model = %self.model.id, from = uid, to = next.uid, "host quota charge moved");
        }
    }
}

/// The store's state, behind its one lock.
#[derive(Default)]
pub(super) struct Inner {
    pub(super) models: HashMap<String, ModelEntry>,
    pub(super) uploads: HashMap<String, Upload>,
    /// Sessions' state regions, by region id.
    pub(super) state: HashMap<String, StateRegion>,
    pending: HashMap<u64, Pending>,
    next_pending: u64,
    /// Counts every reference and session that comes or goes: [`ModelEntry::last_used`].
    clock: u64,
}

/// Host use as quotas count it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostUse {
    /// Bytes charged to the uid: models it is charged for, its uploads (descriptions
    /// included), its sessions' state regions, and the upload regions, arenas and state
    /// regions the store let go of that it still holds.
    pub uid_bytes: u64,
    pub uid_uploads: u32,
    /// Bytes of every model, upload and state region, and of what clients hold.
    pub total_bytes: u64,
    /// Uploads in progress, all uids.
    pub total_uploads: u32,
    /// Of `uid_bytes` and `total_bytes`: the state regions of live sessions.
    pub uid_state_bytes: u64,
    pub total_state_bytes: u64,
}

impl Inner {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub(super) fn host_use(&self, uid: u32) -> HostUse {
        let mut u = HostUse::default();
        for e in self.models.values() {
            let b = e.model.host_bytes();
            u.total_bytes += b;
            if e.charged_uid == uid {
                u.uid_bytes += b;
            }
        }
        for up in self.uploads.values() {
            let b = up.host_bytes();
            u.total_bytes += b;
            u.total_uploads += 1;
            if up.owner.uid == uid {
                u.uid_bytes += b;
                u.uid_uploads += 1;
            }
        }
        for r in self.state.values() {
            let b = r.memfd.size();
            u.total_bytes += b;
            u.total_state_bytes += b;
            if r.uid == uid {
                u.uid_bytes += b;
                u.uid_state_bytes += b;
            }
        }
        for p in self.pending.values() {
            u.total_bytes += p.bytes;
            u.total_uploads += u32::from(p.upload);
            if p.uid == uid {
                u.uid_bytes += p.bytes;
                u.uid_uploads += u32::from(p.upload);
            }
        }
        u
    }

    pub(super) fn add_pending(&mut self, pending: Pending) -> u64 {
        self.next_pending += 1;
        self.pending.insert(self.next_pending, pending);
        self.next_pending
    }

    pub(super) fn remove_pending(&mut self, id: u64) {
        self.pending.remove(&id);
    }

    pub(super) fn collect(&mut self, id: &str) {
        if self
            .models
            .get(id)
            .is_some_and(|e| e.refs == 0 && e.sessions == 0)
        {
            self.models.remove(id);
        }
    }
}

impl Store {
    /// Promises `bytes` of host memory to `uid`, or says which quota or limit that would pass.
    pub(super) fn reserve(
        &self,
        uid: u32,
        bytes: u64,
        upload: bool,
        item: &'static str,
    ) -> Result<Reservation<'_>, StoreError> {
        let quota = &self.limits.host;
        let held = self.held_host(uid);
        // Declared before the lock's guard, so dropped after it: unpinning takes a while.
        let mut evicted = Vec::new();
        let mut inner = self.inner();
        let used = inner.host_use(uid);
        if upload {
            check_count(
                "per_uid_uploads",
                quota.per_uid_uploads,
                uid,
                used.uid_uploads,
                ("upload in progress", "uploads in progress"),
            )?;
            let limit = self.limits.max_uploads;
            if used.total_uploads >= limit {
                return Err(StoreError::TooManyUploads {
                    limit,
                    used: used.total_uploads,
                });
            }
        }
        let used = HostUse {
            uid_bytes: used.uid_bytes + held.uid.bytes,
            total_bytes: used.total_bytes + held.total.bytes,
            ..used
        };
        let both = (used.uid_bytes, used.total_bytes);
        if let Err(refused) = quota.check(uid, both, &held, bytes, item) {
            let room = inner.make_room(quota, uid, used, bytes);
            evicted = room.map_err(|()| match inner.holding(&refused, uid) {
                Some(holding) => StoreError::HostFull(format!("{refused}; {holding}")),
                None => StoreError::Quota(refused),
            })?;
        }
        let id = inner.add_pending(Pending { uid, bytes, upload });
        drop(inner);
        drop(evicted);
        Ok(Reservation { store: self, id })
    }

    /// Host use as the quotas see it, for `uid` and in total.
    pub fn host_use(&self, uid: u32) -> HostUse {
        let held = self.held_host(uid);
        let mut used = self.inner().host_use(uid);
        used.uid_bytes += held.uid.bytes;
        used.total_bytes += held.total.bytes;
        used
    }

    /// The host quotas the store enforces, as resolved at start.
    pub fn host_quota(&self) -> HostQuota {
        self.limits.host
    }

    /// One more load reference for `owner` to a model already in the store (not charged
    /// again).
    pub(super) fn add_ref(
        &self,
        id: &str,
        owner: Owner,
        retention: Retention,
    ) -> Option<Arc<Model>> {
        let mut inner = self.inner();
        let now = inner.tick();
        let entry = inner.models.get_mut(id)?;
        entry.take(owner, retention, now);
        Some(entry.model.clone())
    }

    /// Whether a model loaded from files with this key ([`Model::file_key`]) is stored.
    pub(super) fn has_file_key(&self, key: &str) -> bool {
        let inner = self.inner();
        (inner.models.values()).any(|e| e.model.file_key.as_deref() == Some(key))
    }

    /// Inserts a model just made, charged to `owner`'s uid; if an identical one got in first
    /// (a concurrent load of the same files), takes a reference to that one instead and drops
    /// this one (outside the lock: an arena may take a while to unpin). Returns the model in
    /// the store and whether it was there already.
    pub(super) fn insert_or_ref(
        &self,
        model: Arc<Model>,
        owner: Owner,
        retention: Retention,
    ) -> (Arc<Model>, bool) {
        let mut inner = self.inner();
        let now = inner.tick();
        if let Some(entry) = inner.models.get_mut(&model.id) {
            entry.take(owner, retention, now);
            let existing = entry.model.clone();
            drop(inner);
            drop(model);
            return (existing, true);
        }
        let entry = ModelEntry::new(model.clone(), owner, retention, now);
        inner.models.insert(model.id.clone(), entry);
        (model, false)
    }

    /// Gives back one of `owner`'s uid's load references ([`ModelEntry::to_release`] says
    /// which); returns the load references left (all uids').
    pub fn release(&self, id: &str, owner: Owner) -> Result<u32, StoreError> {
        let mut inner = self.inner();
        // A model the uid holds no reference to, and one that does not exist, answer alike.
        let not_held = || StoreError::NotHolder {
            id: id.to_string(),
            uid: owner.uid,
        };
        let entry = inner.models.get_mut(id).ok_or_else(not_held)?;
        let at = entry.to_release(owner).ok_or_else(not_held)?;
        entry.give_back(at);
        let left = entry.refs;
        inner.collect(id);
        Ok(left)
    }

    /// Gives back every uid's load references (pins included) to model `id`: the model goes
    /// once its sessions end. For the daemon's administrators; returns how many there were.
    pub fn release_all(&self, id: &str) -> Result<u32, StoreError> {
        let mut inner = self.inner();
        let entry =
            (inner.models.get_mut(id)).ok_or_else(|| StoreError::UnknownModel(id.to_string()))?;
        let dropped = entry.refs;
        while !entry.references.is_empty() {
            entry.give_back(entry.references.len() - 1);
        }
        inner.collect(id);
        tracing::info!(model = %id, references = dropped, "every reference released");
        Ok(dropped)
    }

    /// A connection closed: the references it took with [`Retention::Connection`] are given
    /// back, and the others no longer count as held by an open connection (their models may
    /// be evicted from now on). Returns how many references it gave back.
    pub fn connection_closed(&self, conn: u64) -> usize {
        let mut inner = self.inner();
        let mut given_back = 0;
        let mut touched = Vec::new();
        for (id, entry) in inner.models.iter_mut() {
            let before = given_back;
            for at in (0..entry.references.len()).rev() {
                let r = &mut entry.references[at];
                if r.conn != Some(conn) {
                    continue;
                }
                if r.retention == Retention::Connection {
                    entry.give_back(at);
                    given_back += 1;
                } else {
                    r.conn = None;
                }
            }
            if given_back > before {
                touched.push(id.clone());
            }
        }
        for id in &touched {
            inner.collect(id);
        }
        given_back
    }

    /// A session of `uid` starts using the model: it holds a reference for `uid` (the model
    /// stays, and stays charged to a uid that holds it) until [`Store::close_session`]. Only a
    /// model someone holds a load reference to can get new sessions.
    pub fn open_session(&self, id: &str, uid: u32) -> Result<Arc<Model>, StoreError> {
        let mut inner = self.inner();
        let now = inner.tick();
        match inner.models.get_mut(id) {
            Some(entry) if entry.refs > 0 => {
                entry.last_used = now;
                entry.sessions += 1;
                entry.holder(uid).sessions += 1;
                Ok(entry.model.clone())
            }
            _ => Err(StoreError::UnknownModel(id.to_string())),
        }
    }

    pub fn close_session(&self, id: &str, uid: u32) {
        let mut inner = self.inner();
        let now = inner.tick();
        if let Some(entry) = inner.models.get_mut(id) {
            entry.last_used = now;
            let holder = entry.holder(uid);
            if holder.sessions > 0 {
                holder.sessions -= 1;
                entry.sessions -= 1;
            }
            entry.drop_if_empty(uid);
        }
        inner.collect(id);
    }

    /// Models in id order: up to `limit` of those whose id sorts after `after` (all from the
    /// start when it is empty), and whether more follow.
    pub fn models_page(&self, after: &str, limit: usize) -> (Vec<ModelEntry>, bool) {
        let inner = self.inner();
        let mut page: Vec<&ModelEntry> = (inner.models.values())
            .filter(|e| after.is_empty() || e.model.id.as_str() > after)
            .collect();
        page.sort_unstable_by(|a, b| a.model.id.cmp(&b.model.id));
        let more = page.len() > limit;
        (page.into_iter().take(limit).cloned().collect(), more)
    }

    pub fn models(&self) -> Vec<ModelEntry> {
        self.models_page("", usize::MAX).0
    }

    pub fn get(&self, id: &str) -> Option<ModelEntry> {
        self.inner().models.get(id).cloned()
    }

    /// Bytes of the models' tensors and of the upload regions in progress.
    pub fn bytes(&self) -> u64 {
        let inner = self.inner();
        let models: u64 = inner.models.values().map(|e| e.model.total_bytes).sum();
        let uploads: u64 = inner.uploads.values().map(|u| u.memfd.size()).sum();
        models + uploads
    }

    /// Drops every model, upload and state region (at shutdown, once no session is left).
    pub fn clear(&self) {
        let mut inner = self.inner();
        inner.models.clear();
        inner.uploads.clear();
        inner.state.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::HostQuota;
    use crate::store::test_support::{load_paths, me, model_file, store_with};

    /// A one-tensor model file of 8192 bytes named `a` is charged its arena and its
    /// description: "w" + 8 × 1 dimension + 64, and the name "a".
    const CHARGE: u64 = 8192 + 1 + 8 + 64 + 1;

    /// Model references belong to uids: only a holder releases, and the host charge follows
    /// the references (one copy, charged once, to the first holder still holding one).
    #[test]
    fn references_belong_to_uids_and_the_host_charge_follows_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let (model, _) = load_paths(&store, std::slice::from_ref(&path), 1).unwrap();
        let (same, existed) = load_paths(&store, &[path], 2).unwrap();
        assert!(existed && Arc::ptr_eq(&model, &same));
        let usage = |uid| store.host_use(uid);
        assert_eq!((usage(1).uid_bytes, usage(2).uid_bytes), (CHARGE, 0));
        assert_eq!(usage(2).total_bytes, CHARGE);
        let err = store.release(&model.id, me(3).0).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "uid 3 holds no reference to model_id '{}': only a uid that loaded or uploaded \
                 it may release it",
                model.id
            )
        );
        assert_eq!(store.release(&model.id, me(1).0).unwrap(), 1);
        assert_eq!((usage(1).uid_bytes, usage(2).uid_bytes), (0, CHARGE));
        assert!(matches!(
            store.release(&model.id, me(1).0),
            Err(StoreError::NotHolder { uid: 1, .. })
        ));
        assert_eq!(store.release(&model.id, me(2).0).unwrap(), 0);
        assert_eq!(usage(2), HostUse::default());
    }

    /// A session holds a reference for its uid: when the loader lets go while another uid's
    /// session still uses the model, the charge moves to that uid, and goes with the session.
    #[test]
    fn a_session_holds_a_reference_and_takes_the_charge_from_a_loader_that_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let (model, _) = load_paths(&store, &[path], 1).unwrap();
        store.open_session(&model.id, 2).unwrap();
        let entry = store.get(&model.id).unwrap();
        assert_eq!((entry.refs, entry.sessions, entry.charged_uid), (1, 1, 1));
        assert_eq!(
            entry.holders,
            vec![
                Holder {
                    uid: 1,
                    loads: 1,
                    sessions: 0
                },
                Holder {
                    uid: 2,
                    loads: 0,
                    sessions: 1
                }
            ]
        );
        // A session is no load reference: it is given back by closing, not by ReleaseModel.
        assert!(matches!(
            store.release(&model.id, me(2).0),
            Err(StoreError::NotHolder { uid: 2, .. })
        ));
        assert_eq!(store.release(&model.id, me(1).0).unwrap(), 0);
        let usage = |uid| store.host_use(uid).uid_bytes;
        assert_eq!((usage(1), usage(2)), (0, CHARGE), "the charge moved");
        assert!(
            store.get(&model.id).is_some(),
            "the session keeps the model"
        );
        assert!(matches!(
            store.open_session(&model.id, 2),
            Err(StoreError::UnknownModel(_))
        ));
        store.close_session(&model.id, 2);
        assert!(store.get(&model.id).is_none());
        assert_eq!(store.host_use(2), HostUse::default());
    }

    #[test]
    fn a_refused_load_makes_nothing_and_charges_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let quota = HostQuota {
            per_uid_bytes: 12288,
            ..HostQuota::default()
        };
        let store = store_with(quota);
        let a = model_file(dir.path(), "a.safetensors", 8192);
        // Other bytes (the same bytes would be the same model), the same charge.
        let b = model_file(dir.path(), "b.safetensors", 8000);
        let (a, _) = load_paths(&store, &[a], 1).unwrap();
        let err = load_paths(&store, std::slice::from_ref(&b), 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "quotas.per_uid_host_bytes = 12288 exceeded: uid 1 holds {CHARGE} host bytes \
                 and this model needs {CHARGE} more; held by: {} 'a' (8.1 KiB; uid 1: a \
                 reference of an open connection). `weightstream release MODEL_ID` gives back \
                 a reference of the uid that runs it; `weightstream release --all MODEL_ID`, \
                 run as root or as the daemon's user, gives back every uid's (the model goes \
                 once its sessions end)",
                a.id
            )
        );
        assert_eq!(store.host_use(1).total_bytes, CHARGE, "no reservation left");
        assert_eq!(store.shm.total(), 1, "no arena made");
        // Another uid has its own quota.
        load_paths(&store, &[b], 2).unwrap();
        assert_eq!(store.host_use(2).uid_bytes, CHARGE);
    }

    #[test]
    fn models_are_listed_in_pages_in_id_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let mut ids: Vec<String> = (0..5)
            .map(|i| {
                let path = model_file(dir.path(), &format!("{i}.safetensors"), 4096 + i);
                load_paths(&store, &[path], 1).unwrap().0.id.clone()
            })
            .collect();
        ids.sort();
        let page = |after: &str, n| {
            let (entries, more) = store.models_page(after, n);
            let ids: Vec<String> = entries.into_iter().map(|e| e.model.id.clone()).collect();
            (ids, more)
        };
        assert_eq!(page("", 2), (ids[..2].to_vec(), true));
        assert_eq!(page(&ids[1], 2), (ids[2..4].to_vec(), true));
        assert_eq!(page(&ids[3], 2), (ids[4..].to_vec(), false));
        assert_eq!(page("", 5), (ids.clone(), false));
        assert_eq!(page(&ids[4], 5), (vec![], false));
    }
}
