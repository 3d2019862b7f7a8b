//! The daemon's shared state and the operations the gRPC service and the handoff socket map
//! onto. `drops` keeps the files clients pass for a LoadModel, `secrets` the fds of uploads,
//! host regions and state regions that their owners fetch.

mod drops;
pub use drops::random_secret;
mod secrets;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::{mpsc, watch};

pub use self::drops::{DropError, FdDrops, FdTokenError, MAX_DROPS_PER_UID, TOKEN_TTL, shown_name};
pub use self::secrets::{FdSecrets, SecretError, SecretOwner};
use crate::backend::{Backend, BackendError, RegionExport, RegionHandle};
use crate::config::{Config, CopyRate};
use crate::mem::held::Charge;
use crate::mem::shm::{Access, Shm, UploadPages};
use crate::quota::{Held, HostQuota, QuotaError, SessionLedger};
use crate::residency::{ResidencyError, ResidencyRegistry, ResidentWant};
use crate::scheduler::{CopyScheduler, Pacing};
use crate::session::layout::{BudgetError, LayoutError, layout_groups, split_budget};
use crate::session::{ActorParts, CloseReason, DrainDeadline, SessionShared, SessionStats};
use crate::store::coding::Coding;
use crate::store::{
    LoadSource, Model, Owner, Retention, StateTicket, Store, StoreError, StoreLimits, Stored,
    TensorDecl, UploadTicket, held_by_clients,
};

/// The identity of the process at the other end of a connection: what sessions and uploads
/// belong to (`conn`) and whose rights and quotas apply (`uid`, `gid`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub conn: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: i32,
}

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Budget(#[from] BudgetError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Residency(#[from] ResidencyError),
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error(transparent)]
    FdToken(#[from] FdTokenError),
    #[error("unknown session_id '{0}'")]
    UnknownSession(String),
    #[error("session_id '{0}' belongs to another connection")]
    NotOwner(String),
    #[error("device_uuid '{0}' is not a device of this daemon")]
    UnknownDevice(String),
    #[error(
        "all_references: uid {uid} may not give back other uids' references to a model: only \
         root and the daemon's user (uid {daemon_uid}) may"
    )]
    NotAdministrator { uid: u32, daemon_uid: u32 },
    #[error("the daemon is stopping")]
    ShuttingDown,
}

/// A new session as its opener sees it.
pub struct OpenedSession {
    pub shared: Arc<SessionShared>,
    pub event_handles: Vec<Vec<u8>>,
    pub regions: Vec<(u64, RegionHandle)>,
    pub groups: Vec<crate::session::layout::GroupPlacement>,
    pub resident: Vec<bool>,
    pub model: Arc<Model>,
    /// Whether the client's own copies should be granted first (CopyGrant): the device has a
    /// copy bandwidth limit or the session a share.
    pub paces_client_copies: bool,
}

/// Interprocess events per session (CUDA): enough for every staged block and live ticket of
/// a training step; clients open each handle the first time a Staged names it.
pub const EVENTS_PER_SESSION: u32 = 1024;

/// OpenSession as the edge validated it (`server::validate`): groups as (name, tensor names),
/// each with at least one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenRequest {
    pub model_id: String,
    /// Empty: the daemon picks the device.
    pub device_uuid: String,
    pub vram_budget: NonZeroU64,
    /// 0: the daemon sizes the staging arena.
    pub staging_bytes: u64,
    pub groups: Vec<(String, Vec<String>)>,
    pub label: String,
    /// The session's share of the device's copy bandwidth.
    pub copy_bandwidth_limit: Option<CopyRate>,
}

/// A live session and the peer whose connection drives it: ownership is the core's business,
/// not the session's (the session layer knows no peers).
#[derive(Clone)]
pub struct LiveSession {
    pub owner: Peer,
    pub shared: Arc<SessionShared>,
}

pub struct Daemon {
    pub config: Config,
    pub backend: Arc<dyn Backend>,
    pub store: Store,
    pub scheduler: Arc<CopyScheduler>,
    pub shm: Arc<Shm>,
    /// Files passed through the handoff socket, waiting for their LoadModel.
    pub fd_drops: FdDrops,
    /// What the handoff socket's `GET` hands out: uploads' and host regions' fds.
    pub secrets: FdSecrets,
    residency: Arc<ResidencyRegistry>,
    /// Sessions and device bytes per uid and per device, for the quotas.
    pub ledger: Arc<SessionLedger>,
    sessions: Mutex<HashMap<String, LiveSession>>,
    /// Per device: the counters of the sessions that ended, so that device totals never go
    /// backwards when a session closes. Changed under the `sessions` lock (see `session_snapshot`).
    retired: Mutex<Vec<SessionTotals>>,
    next_session: AtomicU64,
    stopping: AtomicBool,
    /// How many sessions are open (kept with `sessions`, under its lock): a stop waits on it.
    open_sessions: watch::Sender<usize>,
    /// The drain's deadline, once a stop set it; each session's sends are bounded by it.
    drain: watch::Sender<Option<tokio::time::Instant>>,
    drain_deadline: DrainDeadline,
    pub started: Instant,
    /// The daemon's own (effective) uid: it and root administer the daemon.
    pub uid: u32,
}

impl Daemon {
    pub fn new(
        config: Config,
        backend: Arc<dyn Backend>,
        shm: Arc<Shm>,
    ) -> std::io::Result<Arc<Daemon>> {
        let device_info = backend.devices();
        let pacing = Pacing {
            device_limit: config.copy_bandwidth_limit,
            ..Pacing::default()
        };
        if let Some(limit) = pacing.device_limit {
            tracing::info!(
                bytes_per_sec = limit.get(),
                "copy bandwidth limit, per device"
            );
        }
        let scheduler = CopyScheduler::start_paced(backend.clone(), device_info.len(), pacing)?;
        let host = HostQuota::resolve(&config.quotas, crate::backend::host::host_memory().0);
        let devices: Vec<(String, u64)> = device_info
            .into_iter()
            .map(|d| (d.uuid, d.total_memory))
            .collect();
        let ledger = SessionLedger::new(&config.quotas, config.limits.max_sessions, &devices);
        tracing::info!(
            configured = %config.quotas,
            host_total_bytes = host.max_bytes,
            device_total_bytes = ?ledger.device_limits(),
            "quotas (0: no limit)"
        );
        let limits = StoreLimits {
            max_tensors: config.limits.max_tensors_per_model,
            max_upload_bytes: config.limits.max_upload_bytes,
            max_name_bytes: config.limits.max_name_bytes,
            max_message_bytes: config.limits.max_message_bytes,
            max_uploads: config.limits.max_uploads,
            max_state_regions: config.limits.max_state_regions_per_session,
            host,
        };
        let (drain, drain_deadline) = DrainDeadline::channel();
        Ok(Arc::new(Daemon {
            store: Store::new(shm.clone(), backend.clone(), limits),
            config,
            backend,
            scheduler,
            shm,
            fd_drops: FdDrops::default(),
            secrets: FdSecrets::default(),
            residency: Arc::default(),
            ledger,
            sessions: Mutex::new(HashMap::new()),
            retired: Mutex::new(vec![SessionTotals::default(); devices.len()]),
            next_session: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            open_sessions: watch::Sender::new(0),
            drain,
            drain_deadline,
            started: Instant::now(),
            uid: rustix::process::geteuid().as_raw(),
        }))
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<String, LiveSession>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn retired(&self) -> MutexGuard<'_, Vec<SessionTotals>> {
        self.retired.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn list_sessions(&self) -> Vec<LiveSession> {
        self.sessions_page(0, usize::MAX).0
    }

    /// Sessions in the order they opened: up to `limit` of those opened after session number
    /// `after` (0: from the first), and whether more follow.
    pub fn sessions_page(&self, after: u64, limit: usize) -> (Vec<LiveSession>, bool) {
        let mut page: Vec<_> = (self.sessions().values())
            .filter(|s| s.shared.number > after)
            .cloned()
            .collect();
        page.sort_by_key(|s| s.shared.number);
        let more = page.len() > limit;
        page.truncate(limit);
        (page, more)
    }

    /// The files `peer` passed under `token`, named by `paths` (one per fd, in order; each
    /// name is checked by [`shown_name`] before the load, off the runtime).
    pub fn load_sources(
        &self,
        peer: &Peer,
        token: &str,
        paths: Vec<String>,
    ) -> Result<Vec<LoadSource>, CoreError> {
        let fds = self.fd_drops.take(token, peer.uid, paths.len())?;
        Ok(paths
            .into_iter()
            .zip(fds)
            .map(|(name, fd)| LoadSource {
                name,
                file: std::fs::File::from(fd),
            })
            .collect())
    }

    /// Begins an upload for `peer`'s connection; returns it and the secret that fetches its
    /// region (read-write, for `peer`'s uid only).
    pub fn begin_upload(
        &self,
        peer: &Peer,
        name: &str,
        tensors: Vec<TensorDecl>,
        pages: UploadPages,
    ) -> Result<(UploadTicket, String), CoreError> {
        // 64 random bits: another uid learns nothing from an id, not even that it exists.
        let upload_id = format!("up-{}", &drops::random_secret()[..16]);
        let ticket = (self.store).begin_upload(peer.owner(), upload_id, name, tensors, pages)?;
        let upload = SecretOwner::Upload(ticket.upload_id.clone());
        let access = (Access::ReadWrite, Charge::Host);
        let secret = (self.secrets).mint(peer.uid, &ticket.memfd, access, upload);
        Ok((ticket, secret))
    }

    /// Commits `peer`'s upload (blocking: it hashes the bytes); its secret ends. The
    /// reference it takes lasts as `retention` says.
    pub fn commit_upload(
        &self,
        peer: &Peer,
        upload_id: &str,
        retention: Retention,
        coding: Coding,
    ) -> Result<Stored, CoreError> {
        let committed =
            (self.store).commit_upload_coded(peer.owner(), upload_id, retention, coding)?;
        (self.secrets).revoke(&SecretOwner::Upload(upload_id.to_string()));
        Ok(committed)
    }

    /// Drops `peer`'s upload that its client will not commit; its secret ends. What the
    /// client still maps of it stays charged to its uid until it lets go.
    pub fn abort_upload(&self, peer: &Peer, upload_id: &str) -> Result<(), CoreError> {
        self.store.abort_upload(peer.owner(), upload_id)?;
        (self.secrets).revoke(&SecretOwner::Upload(upload_id.to_string()));
        tracing::info!(upload = %upload_id, uid = peer.uid, pid = peer.pid, "upload aborted");
        Ok(())
    }

    pub fn device_index(&self, uuid: &str) -> Result<(usize, String), CoreError> {
        let devices = self.backend.devices();
        if uuid.is_empty() {
            return Ok((0, devices[0].uuid.clone()));
        }
        devices
            .iter()
            .position(|d| d.uuid == uuid)
            .map(|i| (i, uuid.to_string()))
            .ok_or_else(|| CoreError::UnknownDevice(uuid.to_string()))
    }

    /// Opens a session: layout, budget split, staging arena, resident lease, then the actor.
    pub async fn open_session(
        self: &Arc<Self>,
        owner: Peer,
        req: OpenRequest,
    ) -> Result<OpenedSession, CoreError> {
        if self.stopping.load(Ordering::Relaxed) {
            return Err(CoreError::ShuttingDown);
        }
        let (device, device_uuid) = self.device_index(&req.device_uuid)?;
        // A reference for the session's uid, given back when the session ends.
        let model = self.store.open_session(&req.model_id, owner.uid)?;
        let opened = self
            .build_session(owner, req, model.clone(), device, device_uuid)
            .await;
        if opened.is_err() {
            self.store.close_session(&model.id, owner.uid);
        }
        opened
    }

    async fn build_session(
        self: &Arc<Self>,
        owner: Peer,
        req: OpenRequest,
        model: Arc<Model>,
        device: usize,
        device_uuid: String,
    ) -> Result<OpenedSession, CoreError> {
        let align = self.backend.alignment();
        // What a session may grant is bounded by what it is charged, and what it is charged by
        // the budget: a budget past the device's memory is no budget at all.
        let device_bytes = self.backend.devices()[device].total_memory;
        if req.vram_budget.get() > device_bytes {
            return Err(BudgetError::OverDevice {
                budget: req.vram_budget.get(),
                device: device_bytes,
            }
            .into());
        }
        let groups = layout_groups(&model, &req.groups, align)?;
        let split = split_budget(&groups, req.vram_budget.get(), req.staging_bytes, align)?;
        // Charged before anything is allocated; given back when the session ends (the charge
        // moves into its teardown) or when opening fails below (the charge drops).
        let bytes = split.staging_bytes + split.resident_bytes;
        let charge = (self.ledger).charge(
            owner.uid,
            (device, bytes),
            &self.held_device(owner.uid, device),
        )?;
        let number = self.next_session.fetch_add(1, Ordering::Relaxed);
        // Before the resident copies, which are the session's too.
        let share = req
            .copy_bandwidth_limit
            .map(|rate| self.scheduler.set_share(device, number, rate));
        let staging = self
            .backend
            .alloc_region(device, split.staging_bytes, "staging")?;
        let wanted = groups
            .iter()
            .zip(&split.resident)
            .filter(|(_, r)| **r)
            .map(|(g, _)| ResidentWant {
                key: g.key.clone(),
                nbytes: g.nbytes,
                spans: g
                    .tensors
                    .iter()
                    .map(|&(t, rel)| (model.slice(t), rel))
                    .collect(),
            })
            .collect();
        let lease = self
            .residency
            .lease(
                self.backend.as_ref(),
                &self.scheduler,
                number,
                &model.id,
                device,
                wanted,
            )
            .await?;
        let resident_of = groups
            .iter()
            .map(|g| {
                let region = lease.placements.get(&g.key)?;
                Some((*region as u32 + 1, 0))
            })
            .collect();
        let mut exported = vec![(staging.size(), staging.export())];
        exported.extend(lease.regions.iter().map(|r| (r.size(), r.export())));
        let events = self.backend.event_pool(device, EVENTS_PER_SESSION)?;
        let event_handles = events.as_ref().map_or_else(Vec::new, |p| p.handles());
        let id = format!("s-{number}");
        let regions = self.region_handles(owner.uid, &id, device, exported);
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let (finished_tx, finished_rx) = watch::channel(false);
        let shared = Arc::new(SessionShared {
            id,
            number,
            model_id: model.id.clone(),
            device,
            device_uuid,
            label: req.label,
            vram_budget: req.vram_budget.get(),
            staging_bytes: split.staging_bytes,
            resident_bytes: split.resident_bytes,
            created: Instant::now(),
            stats: SessionStats::new(groups.len()),
            attached: AtomicBool::new(false),
            plan_len: Default::default(),
            live_tickets: Default::default(),
            control: control_tx,
            finished: finished_rx,
        });
        SessionStats::bump(&shared.stats.bytes_copied, lease.copied_bytes);
        let groups_arc = Arc::new(groups.clone());
        let parts = ActorParts {
            shared: shared.clone(),
            model: model.clone(),
            groups: groups_arc,
            staging,
            alignment: align,
            resident: lease,
            resident_of,
            residents: self.residency.clone(),
            scheduler: self.scheduler.clone(),
            max_live_tickets: self.config.limits.max_live_tickets,
            max_waiting_grants: self.config.limits.max_waiting_grants,
            max_plan_length: self.config.limits.max_plan_length,
            prefetch_depth: self.config.prefetch_depth as usize,
            events: events.clone(),
            send_timeout: self.config.limits.client_send_timeout(),
            drain: self.drain_deadline.clone(),
        };
        let live = LiveSession {
            owner,
            shared: shared.clone(),
        };
        let mut sessions = self.sessions();
        sessions.insert(shared.id.clone(), live);
        self.open_sessions.send_replace(sessions.len());
        // Under the lock that `stop_sessions` takes: a session that opens while the daemon
        // stops is either among those it closes or sees `stopping` here.
        let late = self.is_stopping();
        drop(sessions);
        let daemon = Arc::clone(self);
        let (ended, model_id) = (shared.clone(), model.id.clone());
        // From here the session's teardown takes the share back (`cancel_session`).
        if let Some(share) = share {
            share.keep();
        }
        crate::session::spawn(parts, control_rx, finished_tx, move || {
            // Before the session leaves the list: whoever no longer sees it listed sees its
            // model without it too (ListModels' `sessions`, the model's collection).
            daemon.store.close_session(&model_id, owner.uid);
            // Under the sessions lock, so that a scrape sees the session either live or
            // retired, never both or neither (device counters must not jump).
            let mut sessions = daemon.sessions();
            daemon.retired()[ended.device] += SessionTotals::of(&ended.stats);
            sessions.remove(&ended.id);
            daemon.open_sessions.send_replace(sessions.len());
            drop(sessions);
            (daemon.secrets).revoke(&SecretOwner::Session(ended.id.clone()));
            daemon.free_state_of(&ended.id);
            // Before `finished` is sent: a CloseSession reply means the quota is free again.
            drop(charge);
        });
        if late {
            shared.request_close(CloseReason::Shutdown);
        }
        tracing::info!(session = %shared.id, model = %model.id, staging = split.staging_bytes,
            resident = split.resident_bytes, "session opened");
        let paces_client_copies = self.scheduler.limit(shared.device).is_some()
            || self.scheduler.share(shared.device, shared.number).is_some();
        Ok(OpenedSession {
            shared,
            event_handles,
            regions,
            groups,
            resident: split.resident,
            model,
            paces_client_copies,
        })
    }

    /// Makes a state region of `bytes` (rounded up to whole pages) for `peer`'s session
    /// `session_id`; returns it and the secret that fetches it (read-write, for `peer`'s uid
    /// only). `label` is for the log. Blocking: making room may evict models.
    pub fn alloc_state_region(
        &self,
        peer: &Peer,
        session_id: &str,
        bytes: u64,
        label: &str,
    ) -> Result<(StateTicket, String), CoreError> {
        let session = self.owned_session(peer, session_id)?;
        // 64 random bits: another uid learns nothing from an id.
        let region_id = format!("st-{}", &drops::random_secret()[..16]);
        let ticket = (self.store).alloc_state(peer.uid, &session.id, region_id, bytes)?;
        // A session whose teardown ran meanwhile took none of its regions with it: it is gone
        // from the table before its teardown frees them, so this one is freed here.
        if !self.sessions().contains_key(&session.id) {
            let _ = self.store.free_state(&session.id, &ticket.region_id);
            return Err(CoreError::UnknownSession(session.id.clone()));
        }
        let owner = SecretOwner::State(ticket.region_id.clone());
        let access = (Access::ReadWrite, Charge::Host);
        let secret = (self.secrets).mint(peer.uid, &ticket.memfd, access, owner);
        tracing::info!(session = %session.id, region = %ticket.region_id, label = %label,
            bytes = ticket.size, uid = peer.uid, "state region allocated");
        Ok((ticket, secret))
    }

    /// Frees state region `region_id` of `peer`'s session `session_id`; its secret ends. What
    /// the client still maps stays charged to it until it lets go.
    pub fn free_state_region(
        &self,
        peer: &Peer,
        session_id: &str,
        region_id: &str,
    ) -> Result<(), CoreError> {
        let session = self.owned_session(peer, session_id)?;
        self.store.free_state(&session.id, region_id)?;
        (self.secrets).revoke(&SecretOwner::State(region_id.to_string()));
        tracing::info!(session = %session.id, region = %region_id, "state region freed");
        Ok(())
    }

    /// Frees every state region of a session that ended, and ends their secrets.
    fn free_state_of(&self, session_id: &str) {
        for id in self.store.drop_state_of(session_id) {
            (self.secrets).revoke(&SecretOwner::State(id));
        }
    }

    /// Device memory of ended sessions that clients still hold (host-backend regions): of
    /// `uid` on every device, and of every uid on `device`.
    pub fn held_device(&self, uid: u32, device: usize) -> Held {
        let any_device = |c| matches!(c, Charge::Device(_));
        held_by_clients(&self.shm, uid, any_device, |c| c == Charge::Device(device))
    }

    /// How the session's owner reaches each region: a secret for its uid (a read-only fd of
    /// the memfd, which stands for memory of `device`) or the CUDA IPC handle.
    fn region_handles(
        &self,
        uid: u32,
        session: &str,
        device: usize,
        exported: Vec<(u64, RegionExport)>,
    ) -> Vec<(u64, RegionHandle)> {
        let owner = SecretOwner::Session(session.to_string());
        let access = (Access::ReadOnly, Charge::Device(device));
        (exported.into_iter())
            .map(|(size, export)| match export {
                RegionExport::Memfd(memfd) => {
                    let secret = (self.secrets).mint(uid, &memfd, access, owner.clone());
                    (size, RegionHandle::FdSecret(secret))
                }
                RegionExport::CudaIpc(handle) => (size, RegionHandle::CudaIpc(handle)),
            })
            .collect()
    }

    /// Live sessions and, per device, the counters of all sessions ever opened on it (live
    /// ones plus ended ones), read at one instant.
    pub fn session_snapshot(&self) -> (Vec<Arc<SessionShared>>, Vec<SessionTotals>) {
        let sessions = self.sessions();
        let mut totals = self.retired().clone();
        let mut live: Vec<_> = sessions.values().map(|s| s.shared.clone()).collect();
        drop(sessions);
        live.sort_by_key(|s| s.number);
        // Live counters may move on after the lock: they only grow, so totals stay monotonic.
        for s in &live {
            totals[s.device] += SessionTotals::of(&s.stats);
        }
        (live, totals)
    }

    /// The session, if `peer` may drive it. Another uid's session is unknown to `peer`,
    /// exactly as one that does not exist.
    pub fn owned_session(&self, peer: &Peer, id: &str) -> Result<Arc<SessionShared>, CoreError> {
        let session = (self.sessions().get(id).cloned())
            .filter(|s| s.owner.uid == peer.uid)
            .ok_or_else(|| CoreError::UnknownSession(id.to_string()))?;
        if session.owner.conn != peer.conn {
            return Err(CoreError::NotOwner(id.to_string()));
        }
        Ok(session.shared)
    }

    /// Gives back one of `peer`'s references to model `id`, or, with `all`, every uid's (for
    /// root and the daemon's user). Returns the references left.
    pub fn release_model(&self, peer: &Peer, id: &str, all: bool) -> Result<u32, CoreError> {
        if !all {
            return Ok(self.store.release(id, peer.owner())?);
        }
        let daemon_uid = self.uid;
        if !peer.administers(daemon_uid) {
            return Err(CoreError::NotAdministrator {
                uid: peer.uid,
                daemon_uid,
            });
        }
        self.store.release_all(id)?;
        tracing::info!(model = %id, uid = peer.uid, pid = peer.pid, "released for every uid");
        Ok(0)
    }

    /// A connection closed: its sessions and uncommitted uploads go, and so do the model
    /// references it took to last as long as it does.
    pub async fn connection_closed(&self, conn: u64) {
        let released = self.store.connection_closed(conn);
        if released > 0 {
            tracing::info!(
                conn,
                references = released,
                "connection's model references released"
            );
        }
        let dropped = self.store.drop_uploads_of(conn);
        for id in &dropped {
            self.secrets.revoke(&SecretOwner::Upload(id.clone()));
        }
        let dropped = dropped.len();
        let owned: Vec<_> = self
            .sessions()
            .values()
            .filter(|s| s.owner.conn == conn)
            .map(|s| s.shared.clone())
            .collect();
        if dropped > 0 || !owned.is_empty() {
            tracing::info!(
                conn,
                sessions = owned.len(),
                uploads = dropped,
                "connection closed"
            );
        }
        for session in owned {
            session.close(CloseReason::ConnectionClosed).await;
        }
    }

    /// Starts a stop: no session opens from here on, every open one is told to close (its
    /// client gets a Fault saying so), and no session waits for its client past
    /// `drain_deadline`. Returns at once: see [`sessions_closed`](Self::sessions_closed).
    pub fn stop_sessions(&self, drain_deadline: tokio::time::Instant) {
        let sessions = self.sessions();
        self.stopping.store(true, Ordering::Relaxed);
        self.drain.send_replace(Some(drain_deadline));
        let all: Vec<_> = sessions.values().map(|s| s.shared.clone()).collect();
        drop(sessions);
        for session in all {
            session.request_close(CloseReason::Shutdown);
        }
    }

    /// Waits until no session is left, or until `until`; returns the ids of the sessions not
    /// torn down by then (a copy that never returns keeps its session's memory in use).
    pub async fn sessions_closed(&self, until: tokio::time::Instant) -> Vec<String> {
        let mut open = self.open_sessions.subscribe();
        let _ = tokio::time::timeout_at(until, open.wait_for(|n| *n == 0)).await;
        self.list_sessions()
            .into_iter()
            .map(|s| s.shared.id.clone())
            .collect()
    }

    /// Stops the copy threads (what is queued is cancelled); returns how many had not ended
    /// by `until`.
    pub async fn stop_copies(&self, until: tokio::time::Instant) -> usize {
        self.scheduler.stop();
        let _ = tokio::time::timeout_at(until, self.scheduler.stopped()).await;
        self.scheduler.running_threads()
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }
}

impl Peer {
    /// What a peer owns in the store: uploads by its connection, references by its uid (each
    /// taken by its connection).
    pub fn owner(&self) -> Owner {
        Owner {
            conn: self.conn,
            uid: self.uid,
        }
    }

    /// Whether the peer administers the daemon: root, or the daemon's own user.
    fn administers(&self, daemon_uid: u32) -> bool {
        self.uid == 0 || self.uid == daemon_uid
    }
}

/// Session counters summed over a device's sessions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionTotals {
    pub acquires: u64,
    pub hits: u64,
    pub misses: u64,
    pub reuses: u64,
    pub prefetches: u64,
    pub copies: u64,
    pub bytes_copied: u64,
    pub acquire_pending_ns: u64,
    pub gpu_wait_ns: u64,
}

impl SessionTotals {
    /// A session's counters as device totals count them.
    pub fn of(stats: &SessionStats) -> SessionTotals {
        let s = stats.snapshot();
        SessionTotals {
            acquires: s.acquires,
            hits: s.hits,
            misses: s.misses,
            reuses: s.reuses,
            prefetches: s.prefetches,
            copies: s.copies,
            bytes_copied: s.bytes_copied,
            acquire_pending_ns: s.acquire_pending_ns,
            gpu_wait_ns: s.gpu_wait_ns,
        }
    }
}

impl std::ops::AddAssign for SessionTotals {
    fn add_assign(&mut self, o: SessionTotals) {
        self.acquires += o.acquires;
        self.hits += o.hits;
        self.misses += o.misses;
        self.reuses += o.reuses;
        self.prefetches += o.prefetches;
        self.copies += o.copies;
        self.bytes_copied += o.bytes_copied;
        self.acquire_pending_ns += o.acquire_pending_ns;
        self.gpu_wait_ns += o.gpu_wait_ns;
    }
}
