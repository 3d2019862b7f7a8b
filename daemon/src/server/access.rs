//! Who may use the `weightstream.v1` service: the `[access]` allow-lists, checked on every call
//! against the peer's credentials (its uid and gid from SO_PEERCRED, its supplementary groups
//! from SO_PEERGROUPS, all as they were when it connected), before the call reaches its
//! handler.
//!
//! The kernel already lets only the socket's owner and group connect (mode 0660); the lists
//! narrow that down. The health and reflection services are not covered: they reveal nothing a
//! peer that can open the socket could not learn otherwise, and probes run as other users.

use std::sync::Arc;

use tonic::service::Interceptor;
use tonic::{Request, Status};

use super::conn::Caller;
use super::error::EdgeError;
use crate::config::AccessConfig;

/// A peer the allow-lists keep out: the message names its uid, its groups and the keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "uid {} (gid {}, groups {:?}, pid {}) may not use this daemon: neither in \
     access.allowed_uids {allowed_uids:?} nor in access.allowed_gids {allowed_gids:?}",
    caller.peer.uid,
    caller.peer.gid,
    caller.groups,
    caller.peer.pid
)]
pub struct AccessDenied {
    pub caller: Caller,
    pub allowed_uids: Vec<u32>,
    pub allowed_gids: Vec<u32>,
}

/// The interceptor that lets allowed peers through and refuses the rest.
#[derive(Debug, Clone)]
pub struct AccessCheck {
    config: Arc<AccessConfig>,
}

impl AccessCheck {
    pub fn new(config: &AccessConfig) -> Self {
        AccessCheck {
            config: Arc::new(config.clone()),
        }
    }

    /// Whether `caller` may call: its uid is listed, or its primary gid or one of its
    /// supplementary groups is; the refusal names them and the keys that keep it out.
    pub fn admit(&self, caller: &Caller) -> Result<(), AccessDenied> {
        let (c, peer) = (&self.config, &caller.peer);
        let in_group = |gid: &u32| *gid == peer.gid || caller.groups.binary_search(gid).is_ok();
        if !c.restricts()
            || c.allowed_uids.contains(&peer.uid)
            || c.allowed_gids.iter().any(in_group)
        {
            return Ok(());
        }
        // Every refused call is logged (a peer that keeps trying shows up as such).
        tracing::warn!(
            uid = peer.uid,
            gid = peer.gid,
            groups = ?caller.groups,
            pid = peer.pid,
            conn = peer.conn,
            "access denied: peer not in access.allowed_uids or access.allowed_gids"
        );
        Err(AccessDenied {
            caller: caller.clone(),
            allowed_uids: c.allowed_uids.clone(),
            allowed_gids: c.allowed_gids.clone(),
        })
    }
}

impl Interceptor for AccessCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let caller = req.extensions().get::<Caller>().ok_or(EdgeError::NoPeer)?;
        self.admit(caller)?;
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Peer;

    fn caller(uid: u32, gid: u32, groups: &[u32]) -> Caller {
        Caller {
            peer: Peer {
                conn: 1,
                uid,
                gid,
                pid: 42,
            },
            groups: groups.into(),
        }
    }

    #[test]
    fn empty_lists_admit_everyone_and_either_list_admits() {
        let open = AccessCheck::new(&AccessConfig::default());
        assert!(open.admit(&caller(12345, 12345, &[])).is_ok());
        let lists = AccessCheck::new(&AccessConfig {
            allowed_uids: vec![1000],
            allowed_gids: vec![2000, 3000],
        });
        let cases = [
            ("listed uid", caller(1000, 1, &[]), true),
            ("listed primary gid", caller(1, 2000, &[]), true),
            (
                "listed supplementary group",
                caller(1, 1, &[5, 3000, 7000]),
                true,
            ),
            ("only unlisted groups", caller(1, 1, &[5, 2001]), false),
            ("nothing listed", caller(1, 1, &[]), false),
        ];
        let wrong: Vec<_> = (cases.iter())
            .filter(|(_, c, want)| lists.admit(c).is_ok() != *want)
            .map(|(name, ..)| *name)
            .collect();
        assert!(wrong.is_empty(), "{wrong:?}");
        let refused = Status::from(lists.admit(&caller(1, 1, &[5, 2001])).unwrap_err());
        assert_eq!(
            (refused.code(), refused.message()),
            (
                tonic::Code::PermissionDenied,
                "uid 1 (gid 1, groups [5, 2001], pid 42) may not use this daemon: neither in \
                 access.allowed_uids [1000] nor in access.allowed_gids [2000, 3000]"
            )
        );
    }
}
