//! The store as a cache: when a load or an upload would pass a host quota, the models that
//! only closed connections' cached references hold ([`ModelEntry::cached`]) are evicted, least
//! recently used first, as far as that makes room, and no further; when it cannot, nothing
//! is evicted and the refusal names the models that hold the memory, whose they are, and the
//! commands that free them.

use super::registry::{HostUse, Inner, ModelEntry};
use crate::quota::{HostQuota, QuotaError};
use crate::terminal::Shown;

/// Models a refusal names at most (the largest).
const NAMED: usize = 5;

impl Inner {
    /// Evicts the cache entries, least recently used first, that let `uid` add `need` bytes
    /// (holding `used`) within `quota`: those charged to `uid` count toward its own limit,
    /// any toward the daemon's. Returns them (to be dropped outside the lock), or `Err` with
    /// nothing evicted when all of them would not make room.
    pub(super) fn make_room(
        &mut self,
        quota: &HostQuota,
        uid: u32,
        used: HostUse,
        need: u64,
    ) -> Result<Vec<ModelEntry>, ()> {
        let over = |limit: u64, held: u64| {
            if limit == 0 {
                0
            } else {
                held.saturating_add(need).saturating_sub(limit)
            }
        };
        let mut uid_over = over(quota.per_uid_bytes, used.uid_bytes);
        let mut all_over = over(quota.max_bytes, used.total_bytes);
        let mut candidates: Vec<&ModelEntry> =
            self.models.values().filter(|e| e.cached()).collect();
        candidates.sort_by_key(|e| e.last_used);
        let mut chosen = Vec::new();
        for e in candidates {
            if uid_over == 0 && all_over == 0 {
                break;
            }
            let mine = e.charged_uid == uid;
            if all_over == 0 && !(mine && uid_over > 0) {
                continue;
            }
            let bytes = e.model.host_bytes();
            all_over = all_over.saturating_sub(bytes);
            if mine {
                uid_over = uid_over.saturating_sub(bytes);
            }
            chosen.push(e.model.id.clone());
        }
        if uid_over > 0 || all_over > 0 {
            return Err(());
        }
        let evicted: Vec<ModelEntry> = (chosen.iter())
            .filter_map(|id| self.models.remove(id))
            .collect();
        for e in &evicted {
            tracing::info!(
                model = %e.model.id,
                name = %e.model.name,
                bytes = e.model.host_bytes(),
                charged_uid = e.charged_uid,
                for_uid = uid,
                "cached model evicted to make room"
            );
        }
        Ok(evicted)
    }

    /// What holds the memory a refusal by `quota` is about, for people: the largest models
    /// that cannot be evicted (charged to `uid`, for its own limit), each with its holders,
    /// the uploads in progress, sessions' state regions, and how to free them; `None` when
    /// nothing does.
    pub(super) fn holding(&self, refused: &QuotaError, uid: u32) -> Option<String> {
        let own = matches!(refused, QuotaError::Bytes { key, .. } if *key == "per_uid_host_bytes");
        let mut held: Vec<&ModelEntry> = (self.models.values())
            .filter(|e| !e.cached() && (!own || e.charged_uid == uid))
            .collect();
        held.sort_by_key(|e| std::cmp::Reverse(e.model.host_bytes()));
        let mut parts: Vec<String> = (held.iter().take(NAMED))
            .map(|e| {
                format!(
                    "{} '{}' ({}; {})",
                    e.model.id,
                    Shown(&e.model.name),
                    human(e.model.host_bytes()),
                    e.held_by()
                )
            })
            .collect();
        if held.len() > NAMED {
            parts.push(format!("and {} more", held.len() - NAMED));
        }
        let uploads: Vec<u64> = (self.uploads.values())
            .filter(|u| !own || u.owner.uid == uid)
            .map(|u| u.host_bytes())
            .collect();
        if !uploads.is_empty() {
            let bytes = uploads.iter().sum();
            let n = uploads.len() as u64;
            let what = super::uploads_in_progress(n);
            parts.push(format!("{n} {what} ({})", human(bytes)));
        }
        let state: Vec<u64> = (self.state.values())
            .filter(|r| !own || r.uid == uid)
            .map(|r| r.memfd.size())
            .collect();
        if !state.is_empty() {
            let noun = if state.len() == 1 {
                "state region"
            } else {
                "state regions"
            };
            let bytes = state.iter().sum();
            parts.push(format!(
                "{} {noun} of sessions ({})",
                state.len(),
                human(bytes)
            ));
        }
        if parts.is_empty() {
            return None;
        }
        let what = parts.join(", ");
        let mut text = format!("held by: {what}");
        if !held.is_empty() || !uploads.is_empty() {
            text.push_str(
                ". `weightstream release MODEL_ID` gives back a reference of the uid that runs \
                 it; `weightstream release --all MODEL_ID`, run as root or as the daemon's \
                 user, gives back every uid's (the model goes once its sessions end)",
            );
        }
        if !state.is_empty() {
            text.push_str(
                ". State regions go with their sessions (CloseSession), or by FreeStateRegion",
            );
        }
        Some(text)
    }
}

fn human(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}

#[cfg(test)]
mod tests {
    use crate::quota::HostQuota;
    use crate::store::StoreError;
    use crate::store::test_support::{load_paths, model_file, store_with};

    /// What one of the models below is charged: an arena of 8192 bytes, a tensor "w" of rank
    /// 1, a one-letter name.
    const CHARGE: u64 = 8192 + 1 + 8 + 64 + 1;

    /// Models only closed connections hold are evicted least recently used first, and only as
    /// many as make room; a model a session or an open connection holds is not, and when
    /// nothing else would make room the refusal names what holds the memory.
    #[test]
    fn the_least_recently_used_cache_entry_goes_first_and_only_cache_entries_go() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota {
            max_bytes: 3 * CHARGE - 1,
            ..HostQuota::default()
        });
        // Other bytes in each (the same bytes would be one model).
        let file = |name: &str, n: usize| model_file(dir.path(), name, n);
        let (a, _) = load_paths(&store, &[file("a", 8192)], 1).unwrap();
        let (b, _) = load_paths(&store, &[file("b", 8000)], 1).unwrap();
        assert_eq!(store.connection_closed(1), 0, "cached references stay");
        assert!(store.get(&a.id).unwrap().cached() && store.get(&b.id).unwrap().cached());
        // `a` used again after `b`: `b` is the least recently used.
        store.open_session(&a.id, 2).unwrap();
        store.close_session(&a.id, 2);
        let (c, _) = load_paths(&store, &[file("c", 7900)], 2).unwrap();
        assert!(store.get(&b.id).is_none(), "evicted");
        assert!(store.get(&a.id).is_some(), "one eviction made room");
        assert_eq!(store.host_use(1).total_bytes, 2 * CHARGE);

        store.open_session(&a.id, 3).unwrap();
        let err = load_paths(&store, &[file("d", 7800)], 2).unwrap_err();
        assert!(matches!(err, StoreError::HostFull(_)), "{err}");
        let text = err.to_string();
        for part in [
            format!("{} 'a' (8.1 KiB; uid 1: cached; uid 3: 1 session)", a.id),
            format!(
                "{} 'c' (8.1 KiB; uid 2: a reference of an open connection)",
                c.id
            ),
        ] {
            assert!(text.contains(&part), "{text} lacks {part}");
        }
        assert!(store.get(&a.id).is_some() && store.get(&c.id).is_some());
    }

    /// A uid over its own host quota makes room by evicting its own cache entries (least
    /// recently used first), never another uid's.
    #[test]
    fn a_uid_over_its_quota_evicts_its_own_cache_entries_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota {
            per_uid_bytes: 2 * CHARGE,
            ..HostQuota::default()
        });
        let file = |name: &str, n: usize| model_file(dir.path(), name, n);
        let (other, _) = load_paths(&store, &[file("x", 7700)], 2).unwrap();
        let (a, _) = load_paths(&store, &[file("a", 8192)], 1).unwrap();
        let (b, _) = load_paths(&store, &[file("b", 8000)], 1).unwrap();
        store.connection_closed(1);
        store.connection_closed(2);
        load_paths(&store, &[file("c", 7900)], 1).unwrap();
        assert!(store.get(&a.id).is_none(), "its least recently used");
        assert!(store.get(&b.id).is_some() && store.get(&other.id).is_some());
    }

    /// A reference that lasts as long as its connection is given back when the connection
    /// closes (the model goes with the last one); a pinned one stays and is never evicted,
    /// until every reference is released for all uids.
    #[test]
    fn connection_references_go_with_their_connection_and_pins_stay() {
        use crate::store::test_support::sources;
        use crate::store::{Owner, Retention, Selection, quantize::Quantization};
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota {
            max_bytes: 2 * CHARGE - 1,
            ..HostQuota::default()
        });
        let load = |name: &str, n: usize, conn: u64, retention: Retention| {
            let paths = [model_file(dir.path(), name, n)];
            let owner = Owner { conn, uid: 1 };
            let stored = store.load(
                &sources(&paths),
                "",
                Quantization::None,
                &Selection::All,
                (owner, retention),
                &mut |_, _, _| {},
            );
            stored.map(|s| s.model)
        };
        let job = load("a", 8192, 7, Retention::Connection).unwrap();
        assert_eq!(store.connection_closed(7), 1);
        assert!(
            store.get(&job.id).is_none(),
            "given back with its connection"
        );
        let pinned = load("p", 8000, 8, Retention::Pinned).unwrap();
        store.connection_closed(8);
        let entry = store.get(&pinned.id).unwrap();
        assert_eq!((entry.pinned(), entry.cached()), (1, false));
        let err = load("b", 7900, 9, Retention::Cached).unwrap_err();
        assert!(err.to_string().contains("uid 1: pinned"), "{err}");
        assert_eq!(store.release_all(&pinned.id).unwrap(), 1);
        assert!(store.get(&pinned.id).is_none());
        load("b", 7900, 9, Retention::Cached).unwrap();
    }
}
