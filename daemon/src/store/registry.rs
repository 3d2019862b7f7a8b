//! The registry: models by id, their load references per uid and session references, dedup of
//! identical sources, and the host bytes each uid is charged (models, uploads, and what is being
//! made), checked against the quotas before anything is allocated.

use std::collections::HashMap;
use std::sync::Arc;

use super::upload::Upload;
use super::{Model, Store, StoreError};
use crate::quota::check_count;

/// A model as listed: the model and its reference counts.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    pub model: Arc<Model>,
    pub refs: u32,
    pub sessions: u32,
    /// Load references per uid, in the order the uids took their first one.
    pub holders: Vec<(u32, u32)>,
    /// The uid whose host quota the model counts against: the first loader, then (once it has
    /// released its last reference) the next holder. A copy shared by many uids counts once.
    pub charged_uid: u32,
}

/// Host bytes promised to a load or upload that is being made: counted like the real thing so
/// that two requests at once cannot both pass a quota.
pub(super) struct Pending {
    pub(super) uid: u32,
    pub(super) bytes: u64,
    pub(super) upload: bool,
}

/// The store's state, behind its one lock.
#[derive(Default)]
pub(super) struct Inner {
    models: HashMap<String, ModelEntry>,
    pub(super) uploads: HashMap<String, Upload>,
    pub(super) next_upload: u64,
    pending: HashMap<u64, Pending>,
    next_pending: u64,
}

/// Host use as quotas count it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostUse {
    /// Bytes charged to the uid: models it is charged for, its uploads.
    pub uid_bytes: u64,
    pub uid_uploads: u32,
    /// Bytes of every model and upload.
    pub total_bytes: u64,
}

impl Inner {
    fn host_use(&self, uid: u32) -> HostUse {
        let mut u = HostUse::default();
        for e in self.models.values() {
            let b = e.model.host_bytes();
            u.total_bytes += b;
            if e.charged_uid == uid {
                u.uid_bytes += b;
            }
        }
        for up in self.uploads.values() {
            let b = up.segment.size();
            u.total_bytes += b;
            if up.owner.uid == uid {
                u.uid_bytes += b;
                u.uid_uploads += 1;
            }
        }
        for p in self.pending.values() {
            u.total_bytes += p.bytes;
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
}

/// A `Pending` entry, removed on drop (the model or upload it stood for now counts itself, or
/// was never made).
pub(super) struct Reservation<'a> {
    pub(super) store: &'a Store,
    pub(super) id: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.store.inner().pending.remove(&self.id);
    }
}

impl Store {
    /// Promises `bytes` of host memory to `uid`, or says which quota that would pass.
    pub(super) fn reserve(
        &self,
        uid: u32,
        bytes: u64,
        upload: bool,
        item: &'static str,
    ) -> Result<Reservation<'_>, StoreError> {
        let quota = &self.limits.host;
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
        }
        quota.check(uid, used.uid_bytes, used.total_bytes, bytes, item)?;
        let id = inner.add_pending(Pending { uid, bytes, upload });
        Ok(Reservation { store: self, id })
    }

    /// Host use as the quotas see it, for `uid` and in total.
    pub fn host_use(&self, uid: u32) -> HostUse {
        self.inner().host_use(uid)
    }

    /// One more reference for `uid` to a model already in the store (not charged again).
    pub(super) fn add_ref(&self, id: &str, uid: u32) -> Option<Arc<Model>> {
        let mut inner = self.inner();
        let entry = inner.models.get_mut(id)?;
        entry.refs += 1;
        match entry.holders.iter_mut().find(|(u, _)| *u == uid) {
            Some((_, n)) => *n += 1,
            None => entry.holders.push((uid, 1)),
        }
        Some(entry.model.clone())
    }

    pub(super) fn insert(&self, model: Arc<Model>, uid: u32) {
        let entry = ModelEntry {
            model: model.clone(),
            refs: 1,
            sessions: 0,
            holders: vec![(uid, 1)],
            charged_uid: uid,
        };
        self.inner().models.insert(model.id.clone(), entry);
    }

    /// Drops one of `uid`'s load references; returns the references left (all uids').
    pub fn release(&self, id: &str, uid: u32) -> Result<u32, StoreError> {
        let mut inner = self.inner();
        let entry = inner
            .models
            .get_mut(id)
            .ok_or_else(|| StoreError::UnknownModel(id.to_string()))?;
        if entry.refs == 0 {
            return Err(StoreError::UnknownModel(id.to_string()));
        }
        let Some(at) = entry.holders.iter().position(|(u, _)| *u == uid) else {
            return Err(StoreError::NotHolder {
                id: id.to_string(),
                uid,
            });
        };
        entry.refs -= 1;
        entry.holders[at].1 -= 1;
        if entry.holders[at].1 == 0 {
            entry.holders.remove(at);
            // The charge follows the references: a uid that let go is not billed for a copy
            // that others keep. With none left the model goes once its sessions end, and the
            // charge stays where it was until then.
            if entry.charged_uid == uid
                && let Some(&(next, _)) = entry.holders.first()
            {
                entry.charged_uid = next;
                tracing::info!(model = %id, from = uid, to = next, "host quota charge moved");
            }
        }
        let left = entry.refs;
        Self::collect(&mut inner, id);
        Ok(left)
    }

    /// A session starts using the model; it stays in the store until the session ends.
    pub fn open_session(&self, id: &str) -> Result<Arc<Model>, StoreError> {
        let mut inner = self.inner();
        match inner.models.get_mut(id) {
            Some(entry) if entry.refs > 0 => {
                entry.sessions += 1;
                Ok(entry.model.clone())
            }
            _ => Err(StoreError::UnknownModel(id.to_string())),
        }
    }

    pub fn close_session(&self, id: &str) {
        let mut inner = self.inner();
        if let Some(entry) = inner.models.get_mut(id) {
            entry.sessions = entry.sessions.saturating_sub(1);
        }
        Self::collect(&mut inner, id);
    }

    fn collect(inner: &mut Inner, id: &str) {
        if inner
            .models
            .get(id)
            .is_some_and(|e| e.refs == 0 && e.sessions == 0)
        {
            inner.models.remove(id);
        }
    }

    pub fn models(&self) -> Vec<ModelEntry> {
        let mut list: Vec<ModelEntry> = self.inner().models.values().cloned().collect();
        list.sort_by(|a, b| a.model.id.cmp(&b.model.id));
        list
    }

    pub fn get(&self, id: &str) -> Option<ModelEntry> {
        self.inner().models.get(id).cloned()
    }

    /// Host bytes held by models and pending uploads.
    pub fn bytes(&self) -> u64 {
        let inner = self.inner();
        let models: u64 = inner.models.values().map(|e| e.model.total_bytes).sum();
        let uploads: u64 = inner.uploads.values().map(|u| u.segment.size()).sum();
        models + uploads
    }

    /// Drops every model and upload (at shutdown, once no session is left).
    pub fn clear(&self) {
        let mut inner = self.inner();
        inner.models.clear();
        inner.uploads.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::HostQuota;
    use crate::store::test_support::{model_file, store_in};

    /// Model references belong to uids: only a holder releases, and the host charge follows
    /// the references (one copy, charged once, to the first holder still holding one).
    #[test]
    fn references_belong_to_uids_and_the_host_charge_follows_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path(), HostQuota::default());
        let path = model_file(dir.path(), "a.safetensors", 8192);
        let (model, _) = store
            .load(std::slice::from_ref(&path), "", 1, &mut |_, _, _| {})
            .unwrap();
        let (same, existed) = store.load(&[path], "", 2, &mut |_, _, _| {}).unwrap();
        assert!(existed && Arc::ptr_eq(&model, &same));
        let usage = |uid| store.host_use(uid);
        assert_eq!((usage(1).uid_bytes, usage(2).uid_bytes), (8192, 0));
        assert_eq!(usage(2).total_bytes, 8192);
        let err = store.release(&model.id, 3).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "uid 3 holds no reference to model_id '{}': only a uid that loaded or uploaded \
                 it may release it",
                model.id
            )
        );
        assert_eq!(store.release(&model.id, 1).unwrap(), 1);
        assert_eq!((usage(1).uid_bytes, usage(2).uid_bytes), (0, 8192));
        assert!(matches!(
            store.release(&model.id, 1),
            Err(StoreError::NotHolder { uid: 1, .. })
        ));
        assert_eq!(store.release(&model.id, 2).unwrap(), 0);
        assert_eq!(usage(2), HostUse::default());
    }

    #[test]
    fn a_refused_load_makes_nothing_and_charges_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let quota = HostQuota {
            per_uid_bytes: 12288,
            ..HostQuota::default()
        };
        let store = store_in(dir.path(), quota);
        let a = model_file(dir.path(), "a.safetensors", 8192);
        let b = model_file(dir.path(), "b.safetensors", 8192);
        store.load(&[a], "", 1, &mut |_, _, _| {}).unwrap();
        let err = store
            .load(std::slice::from_ref(&b), "", 1, &mut |_, _, _| {})
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "quotas.per_uid_host_bytes = 12288 exceeded: uid 1 holds 8192 host bytes and this \
             model needs 8192 more"
        );
        assert_eq!(store.host_use(1).total_bytes, 8192, "no reservation left");
        // Another uid has its own quota.
        store.load(&[b], "", 2, &mut |_, _, _| {}).unwrap();
        assert_eq!(store.host_use(2).uid_bytes, 8192);
    }
}
