//! Secrets that fetch a memfd's fd from the handoff socket (`GET <secret>`): minted for one
//! uid, one access and one owner (an upload in progress, a session's host regions, or one of
//! its state regions), and
//! good while that object lives, so a client may fetch again (after a fork, say). The gRPC
//! answer that carries a secret goes only to its owner, and another uid that learns it gets
//! nothing.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, Weak};

use super::drops::random_secret;
use crate::mem::held::{Charge, FdHolder};
use crate::mem::shm::{Access, Memfd};

/// What a secret belongs to: it is revoked with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretOwner {
    Upload(String),
    Session(String),
    /// A session's state region, by region id.
    State(String),
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Unknown, revoked, of a region gone, or of another uid: one answer for all.
    #[error(
        "no such fd_secret for uid {uid}: a secret is only for the uid it was given to, and \
         ends with its upload or session"
    )]
    Unknown { uid: u32 },
    #[error("cannot pass the region's fd: {0}")]
    Io(#[from] std::io::Error),
}

struct Entry {
    uid: u32,
    memfd: Weak<Memfd>,
    access: Access,
    owner: SecretOwner,
    /// What the memory counts against for `uid` once the daemon lets go of it while `uid`
    /// still holds it.
    charge: Charge,
}

#[derive(Default)]
pub struct FdSecrets {
    entries: Mutex<HashMap<String, Entry>>,
}

impl FdSecrets {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new secret that gives `uid` an fd of `memfd` with `access`, until `owner` is revoked
    /// or the memfd is gone; what the fd holds stays charged to `uid` as `charge` until the
    /// kernel frees it.
    pub fn mint(
        &self,
        uid: u32,
        memfd: &Arc<Memfd>,
        (access, charge): (Access, Charge),
        owner: SecretOwner,
    ) -> String {
        let secret = random_secret();
        let mut entries = self.entries();
        // Those of memfds gone without a revoke (a failed open) go here.
        entries.retain(|_, e| e.memfd.strong_count() > 0);
        let memfd = Arc::downgrade(memfd);
        entries.insert(
            secret.clone(),
            Entry {
                uid,
                memfd,
                access,
                owner,
                charge,
            },
        );
        secret
    }

    /// The fd `secret` names and its size, for `uid`'s process `pid` (named when what it holds
    /// refuses a request of `uid`).
    pub fn fetch(&self, secret: &str, uid: u32, pid: i32) -> Result<(OwnedFd, u64), SecretError> {
        let (memfd, access, charge) = {
            let entries = self.entries();
            let entry = entries
                .get(secret)
                .filter(|e| e.uid == uid)
                .ok_or(SecretError::Unknown { uid })?;
            let memfd = entry.memfd.upgrade().ok_or(SecretError::Unknown { uid })?;
            (memfd, entry.access, entry.charge)
        };
        let holder = FdHolder { uid, pid, charge };
        Ok((memfd.hand_out(access, holder)?, memfd.size()))
    }

    /// Ends every secret of `owner`.
    pub fn revoke(&self, owner: &SecretOwner) {
        self.entries().retain(|_, e| e.owner != *owner);
    }

    /// Secrets alive now.
    pub fn len(&self) -> usize {
        self.entries().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::mem::shm::Shm;

    #[test]
    fn a_secret_is_for_its_uid_its_access_and_its_owner_lifetime() {
        let shm = Shm::new();
        let upload = shm
            .create_upload(4096, crate::mem::shm::UploadPages::Reserved)
            .unwrap();
        let staging = shm.create("staging", 4096).unwrap();
        staging.memfd().forbid_new_writers().unwrap();
        let secrets = FdSecrets::default();
        let up = secrets.mint(
            7,
            &upload,
            (Access::ReadWrite, Charge::Host),
            SecretOwner::Upload("up-1".into()),
        );
        let region = SecretOwner::Session("s-1".into());
        let st = secrets.mint(
            7,
            staging.memfd(),
            (Access::ReadOnly, Charge::Device(0)),
            region.clone(),
        );
        let unknown = |r: Result<(OwnedFd, u64), SecretError>| {
            r.map(|(_, size)| size).map_err(|e| e.to_string())
        };
        let refused = Err(
            "no such fd_secret for uid 8: a secret is only for the uid it was \
                           given to, and ends with its upload or session"
                .to_string(),
        );
        assert_eq!(unknown(secrets.fetch(&up, 8, 80)), refused);
        assert_eq!(unknown(secrets.fetch(&st, 8, 80)), refused);
        let (fd, size) = secrets.fetch(&up, 7, 70).unwrap();
        assert_eq!(size, 4096);
        std::fs::File::from(fd).write_all_at(b"w", 0).unwrap();
        let (fd, _) = secrets.fetch(&st, 7, 70).unwrap();
        assert!(std::fs::File::from(fd).write_all_at(b"w", 0).is_err());
        secrets.revoke(&region);
        assert!(secrets.fetch(&st, 7, 70).is_err());
        drop(upload);
        assert!(secrets.fetch(&up, 7, 70).is_err(), "its upload is gone");
        secrets.mint(
            1,
            staging.memfd(),
            (Access::ReadOnly, Charge::Device(0)),
            region,
        );
        assert_eq!(secrets.len(), 1, "the dead one was pruned");
    }
}
