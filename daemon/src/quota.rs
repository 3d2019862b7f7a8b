//! Quotas: what one uid, and the daemon as a whole, may hold (`[quotas]` in the config).
//!
//! Host bytes are counted by the store (models and uploads); sessions and device bytes by the
//! [`SessionLedger`] here. A refusal names the limit and the current use, and nothing is
//! charged for a refused request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::config::Quotas;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error(
        "limits.max_sessions = {limit} reached: the daemon has {open} sessions open or opening"
    )]
    Sessions { limit: u32, open: u32 },
    #[error("quotas.{key} = {limit} reached: uid {uid} has {used} {what}")]
    Count {
        key: &'static str,
        limit: u32,
        uid: u32,
        used: u32,
        what: &'static str,
    },
    #[error(
        "quotas.{key} = {limit} exceeded: {holder} holds {used} {what} and this {item} needs \
         {need} more{held}"
    )]
    Bytes {
        key: &'static str,
        limit: u64,
        holder: String,
        used: u64,
        what: String,
        item: &'static str,
        need: u64,
        /// What of `used` the daemon let go of and clients still hold (boxed: errors stay
        /// small).
        held: Box<HeldByClients>,
    },
}

/// Bytes of shared memory the daemon has let go of (an upload, a session's regions) that
/// clients it handed fds to still hold, and those processes: they stay charged until the
/// kernel frees them. Said after a refusal, since the daemon itself cannot free them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldByClients {
    pub bytes: u64,
    /// Sorted.
    pub pids: Vec<i32>,
}

/// Processes a refusal names, at most.
const PIDS_NAMED: usize = 8;

impl std::fmt::Display for HeldByClients {
    /// Nothing when nothing is held; else "; N of them …".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.bytes == 0 {
            return Ok(());
        }
        let named: Vec<String> = (self.pids.iter().take(PIDS_NAMED))
            .map(i32::to_string)
            .collect();
        let more = self.pids.len().saturating_sub(PIDS_NAMED);
        let (noun, verb) = if self.pids.len() == 1 {
            ("pid", "holds")
        } else {
            ("pids", "hold")
        };
        write!(
            f,
            "; {} of them are shared memory the daemon has let go of and {noun} {}{} still \
             {verb} (an fd or a mapping of it, passed on or inherited included): they are \
             freed once those are closed, when the process exits at the latest",
            self.bytes,
            named.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        )
    }
}

/// Refuses `need` more bytes when `used + need` would pass `limit` (0: no limit); `held` is
/// what of `used` clients hold after the daemon let go of it.
pub fn check_bytes(
    key: &'static str,
    limit: u64,
    (used, held): (u64, &HeldByClients),
    need: u64,
    holder: impl FnOnce() -> (String, String),
    item: &'static str,
) -> Result<(), QuotaError> {
    if limit == 0 || used.saturating_add(need) <= limit {
        return Ok(());
    }
    let (holder, what) = holder();
    Err(QuotaError::Bytes {
        key,
        limit,
        holder,
        used,
        what,
        item,
        need,
        held: Box::new(held.clone()),
    })
}

/// What clients hold of a quota's bytes after the daemon let go of it: of one uid, and in all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    pub uid: HeldByClients,
    pub total: HeldByClients,
}

/// Refuses one more when `used` has reached `limit` (0: no limit).
pub fn check_count(
    key: &'static str,
    limit: u32,
    uid: u32,
    used: u32,
    (one, many): (&'static str, &'static str),
) -> Result<(), QuotaError> {
    if limit == 0 || used < limit {
        return Ok(());
    }
    Err(QuotaError::Count {
        key,
        limit,
        uid,
        used,
        what: if used == 1 { one } else { many },
    })
}

/// The store's limits on host bytes and uploads, resolved at start.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostQuota {
    pub per_uid_bytes: u64,
    pub per_uid_uploads: u32,
    /// The daemon's total; 0 only when it is a percentage of a MemTotal that could not be read
    /// (then no limit: refusing everything would be worse).
    pub max_bytes: u64,
}

impl HostQuota {
    pub fn resolve(quotas: &Quotas, mem_total: u64) -> HostQuota {
        HostQuota {
            per_uid_bytes: quotas.per_uid_host_bytes,
            per_uid_uploads: quotas.per_uid_uploads,
            max_bytes: quotas.max_host_bytes.resolve(mem_total),
        }
    }

    /// Whether `uid` (holding `uid_used`) may add `need` host bytes to the daemon's `total`;
    /// both include what clients `held` after the daemon let go of it.
    pub fn check(
        &self,
        uid: u32,
        (uid_used, total): (u64, u64),
        held: &Held,
        need: u64,
        item: &'static str,
    ) -> Result<(), QuotaError> {
        check_bytes(
            "per_uid_host_bytes",
            self.per_uid_bytes,
            (uid_used, &held.uid),
            need,
            || (format!("uid {uid}"), "host bytes".into()),
            item,
        )?;
        check_bytes(
            "max_host_bytes",
            self.max_bytes,
            (total, &held.total),
            need,
            || ("the daemon".into(), "host bytes".into()),
            item,
        )
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct UidUse {
    sessions: u32,
    device_bytes: u64,
}

#[derive(Debug, Default)]
struct LedgerInner {
    by_uid: HashMap<u32, UidUse>,
    by_device: Vec<u64>,
}

impl LedgerInner {
    /// Sessions charged, all uids together: open ones and those still opening.
    fn sessions(&self) -> u32 {
        self.by_uid.values().map(|u| u.sessions).sum()
    }
}

/// Open sessions and their device bytes (staging plus resident), per uid and per device, and
/// the daemon's session count (`limits.max_sessions`): each checked and charged under one
/// lock, so that sessions opening at once cannot all pass a check made before any counts.
#[derive(Debug)]
pub struct SessionLedger {
    max_sessions: u32,
    per_uid_sessions: u32,
    per_uid_device_bytes: u64,
    /// Per device: (uuid, the daemon's total there).
    devices: Vec<(String, u64)>,
    inner: Mutex<LedgerInner>,
}

/// One session's share of the ledger, given back when it drops (the session has ended, or
/// failed to open).
#[derive(Debug)]
pub struct SessionCharge {
    ledger: Arc<SessionLedger>,
    uid: u32,
    device: usize,
    bytes: u64,
}

impl SessionLedger {
    /// `devices`: each device's uuid and total memory, in the backend's order; `max_sessions`
    /// counts every uid's.
    pub fn new(
        quotas: &Quotas,
        max_sessions: u32,
        devices: &[(String, u64)],
    ) -> Arc<SessionLedger> {
        Arc::new(SessionLedger {
            max_sessions,
            per_uid_sessions: quotas.per_uid_sessions,
            per_uid_device_bytes: quotas.per_uid_device_bytes,
            devices: devices
                .iter()
                .map(|(uuid, total)| (uuid.clone(), quotas.max_device_bytes.resolve(*total)))
                .collect(),
            inner: Mutex::new(LedgerInner {
                by_uid: HashMap::new(),
                by_device: vec![0; devices.len()],
            }),
        })
    }

    fn inner(&self) -> MutexGuard<'_, LedgerInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The daemon's device total on each device, as resolved at start.
    pub fn device_limits(&self) -> Vec<u64> {
        self.devices.iter().map(|(_, max)| *max).collect()
    }

    /// Charges one session of `bytes` on `device` to `uid`, or says which limit it passes.
    /// `held`: device memory of sessions that ended that clients still hold, which counts too
    /// (of `uid` on every device, and of every uid on `device`).
    pub fn charge(
        self: &Arc<Self>,
        uid: u32,
        (device, bytes): (usize, u64),
        held: &Held,
    ) -> Result<SessionCharge, QuotaError> {
        let mut inner = self.inner();
        let open = inner.sessions();
        if open >= self.max_sessions {
            return Err(QuotaError::Sessions {
                limit: self.max_sessions,
                open,
            });
        }
        let mine = inner.by_uid.get(&uid).copied().unwrap_or_default();
        check_count(
            "per_uid_sessions",
            self.per_uid_sessions,
            uid,
            mine.sessions,
            ("open session", "open sessions"),
        )?;
        check_bytes(
            "per_uid_device_bytes",
            self.per_uid_device_bytes,
            (mine.device_bytes + held.uid.bytes, &held.uid),
            bytes,
            || (format!("uid {uid}"), "device bytes".into()),
            "session",
        )?;
        let (uuid, max) = &self.devices[device];
        check_bytes(
            "max_device_bytes",
            *max,
            (inner.by_device[device] + held.total.bytes, &held.total),
            bytes,
            || ("the daemon".into(), format!("device bytes on {uuid}")),
            "session",
        )?;
        let entry = inner.by_uid.entry(uid).or_default();
        entry.sessions += 1;
        entry.device_bytes += bytes;
        inner.by_device[device] += bytes;
        Ok(SessionCharge {
            ledger: Arc::clone(self),
            uid,
            device,
            bytes,
        })
    }

    /// (sessions, device bytes on each device) charged to every uid together now.
    pub fn totals(&self) -> (u32, Vec<u64>) {
        let inner = self.inner();
        (inner.sessions(), inner.by_device.clone())
    }

    /// (sessions, device bytes) charged to `uid` now.
    pub fn usage(&self, uid: u32) -> (u32, u64) {
        let inner = self.inner();
        inner
            .by_uid
            .get(&uid)
            .map_or((0, 0), |u| (u.sessions, u.device_bytes))
    }
}

impl Drop for SessionCharge {
    fn drop(&mut self) {
        let mut inner = self.ledger.inner();
        inner.by_device[self.device] -= self.bytes;
        if let Some(u) = inner.by_uid.get_mut(&self.uid) {
            u.sessions -= 1;
            u.device_bytes -= self.bytes;
            if u.sessions == 0 {
                inner.by_uid.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SizeOrShare;

    #[test]
    fn the_ledger_refuses_each_limit_by_name_and_gives_back_on_drop() {
        let quotas = Quotas {
            per_uid_sessions: 2,
            per_uid_device_bytes: 1000,
            max_device_bytes: SizeOrShare::Percent(50),
            ..Quotas::default()
        };
        let ledger = SessionLedger::new(&quotas, 4, &[("gpu-a".into(), 3000)]);
        assert_eq!(ledger.device_limits(), vec![1500]);
        let a = ledger.charge(7, (0, 600), &Held::default()).unwrap();
        assert_eq!(
            ledger
                .charge(7, (0, 500), &Held::default())
                .unwrap_err()
                .to_string(),
            "quotas.per_uid_device_bytes = 1000 exceeded: uid 7 holds 600 device bytes and \
             this session needs 500 more"
        );
        let b = ledger.charge(7, (0, 400), &Held::default()).unwrap();
        assert_eq!(
            ledger
                .charge(7, (0, 1), &Held::default())
                .unwrap_err()
                .to_string(),
            "quotas.per_uid_sessions = 2 reached: uid 7 has 2 open sessions"
        );
        let c = ledger.charge(8, (0, 500), &Held::default()).unwrap();
        assert_eq!(
            ledger
                .charge(9, (0, 1), &Held::default())
                .unwrap_err()
                .to_string(),
            "quotas.max_device_bytes = 1500 exceeded: the daemon holds 1500 device bytes on \
             gpu-a and this session needs 1 more"
        );
        assert_eq!(ledger.usage(7), (2, 1000));
        drop(a);
        assert_eq!(ledger.usage(7), (1, 400));
        drop((b, c));
        assert_eq!(ledger.usage(7), (0, 0));
        // The whole device total is free again (two uids: each may hold 1000).
        let _d = ledger.charge(9, (0, 1000), &Held::default()).unwrap();
        let _e = ledger.charge(10, (0, 500), &Held::default()).unwrap();
    }

    #[test]
    fn max_sessions_counts_every_uid_and_a_dropped_charge_frees_a_place() {
        let ledger = SessionLedger::new(&Quotas::default(), 2, &[("gpu-a".into(), 3000)]);
        let a = ledger.charge(7, (0, 1), &Held::default()).unwrap();
        let _b = ledger.charge(8, (0, 1), &Held::default()).unwrap();
        assert_eq!(
            ledger
                .charge(9, (0, 1), &Held::default())
                .unwrap_err()
                .to_string(),
            "limits.max_sessions = 2 reached: the daemon has 2 sessions open or opening"
        );
        drop(a);
        let _c = ledger
            .charge(9, (0, 1), &Held::default())
            .expect("a closed session frees its place");
    }

    #[test]
    fn one_session_or_upload_is_said_in_the_singular() {
        assert_eq!(
            check_count("per_uid_uploads", 1, 0, 1, ("upload in progress", "x"))
                .unwrap_err()
                .to_string(),
            "quotas.per_uid_uploads = 1 reached: uid 0 has 1 upload in progress"
        );
        assert!(check_count("per_uid_uploads", 0, 0, 99, ("a", "b")).is_ok());
    }
}
