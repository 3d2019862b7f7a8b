//! Who may use the `weightstream.v1` service: the `[access]` allow-lists, checked on every call
//! against the peer's credentials (SO_PEERCRED), before the call reaches its handler.
//!
//! The kernel already lets only the socket's owner and group connect (mode 0660); the lists
//! narrow that down. The health and reflection services are not covered: they reveal nothing a
//! peer that can open the socket could not learn otherwise, and probes run as other users.

use std::sync::Arc;

use tonic::service::Interceptor;
use tonic::{Request, Status};

use super::error::EdgeError;
use crate::config::AccessConfig;
use crate::core::Peer;

/// A peer the allow-lists keep out: the message names its uid and the keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "uid {} (gid {}, pid {}) may not use this daemon: neither in access.allowed_uids {allowed_uids:?} \
     nor in access.allowed_gids {allowed_gids:?}",
    peer.uid,
    peer.gid,
    peer.pid
)]
pub struct AccessDenied {
    pub peer: Peer,
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

    /// Whether `peer` may call; the refusal names its uid and the keys that keep it out.
    pub fn admit(&self, peer: &Peer) -> Result<(), AccessDenied> {
        let c = &self.config;
        if !c.restricts()
            || c.allowed_uids.contains(&peer.uid)
            || c.allowed_gids.contains(&peer.gid)
        {
            return Ok(());
        }
        // Every refused call is logged (a peer that keeps trying shows up as such).
        tracing::warn!(
            uid = peer.uid,
            gid = peer.gid,
            pid = peer.pid,
            conn = peer.conn,
            "access denied: peer not in access.allowed_uids or access.allowed_gids"
        );
        Err(AccessDenied {
            peer: *peer,
            allowed_uids: c.allowed_uids.clone(),
            allowed_gids: c.allowed_gids.clone(),
        })
    }
}

impl Interceptor for AccessCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let peer = req
            .extensions()
            .get::<Peer>()
            .copied()
            .ok_or(EdgeError::NoPeer)?;
        self.admit(&peer)?;
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, gid: u32) -> Peer {
        Peer {
            conn: 1,
            uid,
            gid,
            pid: 42,
        }
    }

    #[test]
    fn empty_lists_admit_everyone_and_either_list_admits() {
        let open = AccessCheck::new(&AccessConfig::default());
        assert!(open.admit(&peer(12345, 12345)).is_ok());
        let lists = AccessCheck::new(&AccessConfig {
            allowed_uids: vec![1000],
            allowed_gids: vec![2000],
        });
        assert!(lists.admit(&peer(1000, 1)).is_ok());
        assert!(lists.admit(&peer(1, 2000)).is_ok());
        let refused = Status::from(lists.admit(&peer(1, 1)).unwrap_err());
        assert_eq!(
            (refused.code(), refused.message()),
            (
                tonic::Code::PermissionDenied,
                "uid 1 (gid 1, pid 42) may not use this daemon: neither in access.allowed_uids \
                 [1000] nor in access.allowed_gids [2000]"
            )
        );
    }
}
