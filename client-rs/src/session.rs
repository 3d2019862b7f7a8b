//! A session: its mapped regions, its hot-path stream and plan recording.
//!
//! The stream is read by a background task that routes each `Staged` or `Fault` to the
//! acquire waiting for that ticket, so acquires from several tasks can be in flight at once.
//! Views ([`Acquired`], in `replies.rs`) release their ticket when dropped.
//!
//! When the daemon stops or dies the reader ends every acquire in flight and later ones fail
//! at once; [`Session::reconnect`] re-opens the session (same groups, budget, staging, device,
//! label and plan) against the daemon that comes back on the same socket.
//!
//! The session keeps a [`WaitLedger`] of the time its caller waited for weights (see
//! `waits.rs`) and reports it to the daemon with its releases.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use memmap2::{Mmap, MmapMut, MmapOptions};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ClientError;
use crate::proto::{self, client_message::Msg, server_message::Msg as Reply};
use crate::replies::{Acquired, Granting, Submitted, grant_parts};
use crate::waits::{WaitLedger, WaitTotals};
use crate::{Client, TensorData, handoff};

/// What `OpenSession` asks for.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub model_id: String,
    /// Empty: the daemon's first device.
    pub device_uuid: String,
    pub vram_budget: u64,
    /// 0: chosen by the daemon.
    pub staging_bytes: u64,
    pub groups: Vec<proto::GroupSpec>,
    pub label: String,
    /// This session's share of the device's copy bandwidth, bytes per second (0: none; the
    /// daemon refuses less than 100 MB/s).
    pub copy_bandwidth_limit: u64,
    /// Record the first step's acquisitions and send them as the plan at `end_step`.
    pub record_plan: bool,
    /// Map the host backend's regions into this process, so that views carry their bytes.
    /// Off for a caller that maps them itself from [`Session::region_fd`] (the Python client).
    pub map_host_regions: bool,
}

impl SessionOptions {
    pub fn new(model_id: &str, vram_budget: u64, groups: Vec<proto::GroupSpec>) -> Self {
        SessionOptions {
            model_id: model_id.to_string(),
            device_uuid: String::new(),
            vram_budget,
            staging_bytes: 0,
            groups,
            label: String::new(),
            copy_bandwidth_limit: 0,
            record_plan: true,
            map_host_regions: true,
        }
    }

    /// One group per tensor, in the manifest's order.
    pub fn one_group_per_tensor(manifest: &proto::ModelManifest) -> Vec<proto::GroupSpec> {
        manifest
            .tensors
            .iter()
            .map(|t| proto::GroupSpec {
                name: t.name.clone(),
                tensors: vec![t.name.clone()],
            })
            .collect()
    }
}

type Waiter = oneshot::Sender<Result<proto::Staged, ClientError>>;

#[derive(Default)]
struct Routes {
    waiting: HashMap<u64, Waiter>,
    /// Grants of this client's own copies (CopyGrant) not answered yet, by id (numbered with
    /// the tickets, so that a fault about one names it).
    grants: HashMap<u64, oneshot::Sender<Result<(), ClientError>>>,
    /// Set once the stream has ended: later acquires fail at once with this reason.
    ended: Option<String>,
}

struct Recorder {
    recording: bool,
    groups: Vec<u32>,
}

/// A region as this process sees it: the host backend's shared memory (its fd fetched from the
/// handoff socket, kept open), mapped read-only unless the options say not to, or device memory
/// (CUDA), which this client does not map: its views carry no bytes.
enum MappedRegion {
    Host { file: File, map: Option<Mmap> },
    Device { size: u64 },
}

pub struct Session {
    client: Client,
    /// What it was opened with (the model id is the current one): what `reconnect` re-opens.
    options: SessionOptions,
    id: String,
    opened: proto::OpenSessionResponse,
    regions: Vec<MappedRegion>,
    tx: mpsc::UnboundedSender<proto::ClientMessage>,
    routes: Arc<Mutex<Routes>>,
    next_ticket: AtomicU64,
    /// The pass kind each Acquire names (`proto::PassKind`; [`Session::set_pass_kind`]).
    kind: AtomicI32,
    /// The first ticket number of this opening (those below belong to one before a reconnect).
    first_ticket: u64,
    recorder: Mutex<Recorder>,
    /// The last plan sent, sent again by `reconnect`.
    plan: Mutex<Option<Vec<u32>>>,
    /// The caller's waits for weights in this opening.
    waits: Mutex<WaitLedger>,
    /// The time the caller's thread blocked for replies in this opening (never reported: on
    /// CUDA it is not the device's wait, on the host it is `waits`).
    replies: Mutex<WaitLedger>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn map_region(
    client: &Client,
    region: &proto::Region,
    map: bool,
) -> Result<MappedRegion, ClientError> {
    match &region.handle {
        Some(proto::region::Handle::FdSecret(secret)) => {
            let secret = secret.clone();
            let (fd, size) = client
                .handoff(move |socket| Ok(handoff::get_fd(socket, &secret)?))
                .await?;
            if size < region.size {
                return Err(ClientError::Protocol(format!(
                    "region {}: the daemon passed {size} bytes for a region of {}",
                    region.index, region.size
                )));
            }
            let file = File::from(fd);
            if !map {
                return Ok(MappedRegion::Host { file, map: None });
            }
            // SAFETY: the daemon made this shared memory for this session and never shrinks
            // it while the session lives; we only read bytes it says are staged.
            let map = unsafe { MmapOptions::new().len(region.size as usize).map(&file) }.map_err(
                |source| ClientError::Map {
                    what: format!("region {}", region.index),
                    source,
                },
            )?;
            Ok(MappedRegion::Host {
                file,
                map: Some(map),
            })
        }
        Some(proto::region::Handle::CudaIpcHandle(_)) => {
            Ok(MappedRegion::Device { size: region.size })
        }
        None => Err(ClientError::Protocol(format!(
            "region {} has no handle",
            region.index
        ))),
    }
}

impl Session {
    pub(crate) async fn open(
        client: Client,
        options: SessionOptions,
    ) -> Result<Session, ClientError> {
        let mut rpc = client.rpc();
        let request = proto::OpenSessionRequest {
            model_id: options.model_id.clone(),
            device_uuid: options.device_uuid.clone(),
            vram_budget: options.vram_budget,
            staging_bytes: options.staging_bytes,
            groups: options.groups.clone(),
            label: options.label.clone(),
            copy_bandwidth_limit: options.copy_bandwidth_limit,
        };
        let status = |s| client.status(s);
        let opened = rpc
            .open_session(request)
            .await
            .map_err(status)?
            .into_inner();
        let mut regions = Vec::with_capacity(opened.regions.len());
        for region in &opened.regions {
            regions.push(map_region(&client, region, options.map_host_regions).await?);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let attach = proto::ClientMessage {
            msg: Some(Msg::Attach(proto::Attach {
                session_id: opened.session_id.clone(),
            })),
        };
        tx.send(attach)
            .map_err(|_| ClientError::Protocol("stream closed".into()))?;
        let mut inbound = rpc
            .run(UnboundedReceiverStream::new(rx))
            .await
            .map_err(status)?
            .into_inner();
        match inbound.message().await.map_err(status)?.and_then(|m| m.msg) {
            Some(Reply::Attached(_)) => {}
            other => {
                return Err(ClientError::Protocol(format!(
                    "expected Attached, got {other:?}"
                )));
            }
        }
        let routes = Arc::new(Mutex::new(Routes::default()));
        tokio::spawn(read_replies(inbound, routes.clone()));
        let waits = Mutex::new(WaitLedger::new(opened.groups.len()));
        let replies = Mutex::new(WaitLedger::new(opened.groups.len()));
        Ok(Session {
            id: opened.session_id.clone(),
            client,
            recorder: Mutex::new(Recorder {
                recording: options.record_plan,
                groups: Vec::new(),
            }),
            options,
            opened,
            regions,
            tx,
            routes,
            next_ticket: AtomicU64::new(1),
            kind: AtomicI32::new(proto::PassKind::Unspecified as i32),
            first_ticket: 1,
            plan: Mutex::new(None),
            waits,
            replies,
        })
    }

    /// Opens this session again on a new connection to the socket: for a trainer to resume at
    /// its next step after the daemon was restarted (or the session was lost), without
    /// restarting its process. Waits up to `timeout` for a daemon to answer there.
    ///
    /// The session gets the same groups, budget, staging, device and label, and the plan last
    /// sent (a first step still being recorded is recorded again). Its model is `model_id`,
    /// else the same id as before: a model this client loaded from files that the daemon no
    /// longer has is loaded again from them (unchanged files give the same id); an uploaded
    /// one must be uploaded again first (the same bytes give the same id). Views of the old
    /// session are gone by then (this takes `&mut self`); its tickets are not carried over.
    pub async fn reconnect(
        &mut self,
        model_id: Option<&str>,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        self.disconnect();
        let mut client = self.client.clone();
        client.reconnect(timeout).await?;
        let model_id = model_id.unwrap_or(&self.options.model_id).to_string();
        client.restore_model(&model_id).await?;
        self.reopen(client, &model_id).await
    }

    /// Ends the session's stream (a daemon that is still up tears the session down): acquires
    /// in flight and later ones fail with [`ClientError::SessionEnded`] ("the session was
    /// reconnected") until [`Session::reopen`]. The first half of [`Session::reconnect`], for
    /// a caller that restores the model itself in between.
    pub fn disconnect(&mut self) {
        // The reason first: once the request stream is dropped, the daemon ends the reply
        // stream, and the reader would record its own reason ("the stream ended") first if
        // it got there before this line (seen under load in fake_daemon.rs).
        lock(&self.routes)
            .ended
            .get_or_insert_with(|| "the session was reconnected".into());
        let (dead, _) = mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.tx, dead));
    }

    /// Opens this session again through `client` (one that answers: see
    /// [`Client::reconnect`]) with `model_id`, which the daemon must have: the second half of
    /// [`Session::reconnect`]. The plan last sent is sent again; a first step still being
    /// recorded is recorded again; ticket numbers go on from the old session's. On failure the
    /// session stays disconnected and may be reopened again.
    pub async fn reopen(&mut self, client: Client, model_id: &str) -> Result<(), ClientError> {
        self.disconnect();
        let mut options = self.options.clone();
        options.model_id = model_id.to_string();
        options.record_plan = lock(&self.recorder).recording;
        let plan = lock(&self.plan).clone();
        let next_ticket = self.next_ticket.load(Ordering::Relaxed);
        *self = Session::open(client, options).await?;
        // A stale number is never reused.
        self.next_ticket.store(next_ticket, Ordering::Relaxed);
        self.first_ticket = next_ticket;
        if let Some(plan) = plan {
            self.send_plan(plan);
        }
        Ok(())
    }

    /// The model the session streams.
    pub fn model_id(&self) -> &str {
        &self.options.model_id
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// A state region of this session, on the connection that opened it: its id, size and
    /// read-write fd ([`Client::alloc_state_region`]). It goes with this opening of the session
    /// (a [`Session::reconnect`] opens a new one, without it).
    pub async fn alloc_state_region(
        &self,
        bytes: u64,
        label: &str,
    ) -> Result<(String, u64, OwnedFd), ClientError> {
        (self.client.clone())
            .alloc_state_region(&self.id, bytes, label)
            .await
    }

    pub fn layout(&self) -> &proto::OpenSessionResponse {
        &self.opened
    }

    pub fn group_count(&self) -> u32 {
        self.opened.groups.len() as u32
    }

    pub fn group_index(&self, name: &str) -> Option<u32> {
        self.opened
            .groups
            .iter()
            .position(|g| g.name == name)
            .map(|i| i as u32)
    }

    fn send(&self, msg: Msg) -> Result<(), ClientError> {
        self.tx
            .send(proto::ClientMessage { msg: Some(msg) })
            .map_err(|_| ClientError::SessionEnded("the stream is closed".into()))
    }

    /// Acquires a group; the returned view releases it when dropped. The time it blocks for a
    /// group not yet staged counts as a wait ([`Session::wait`]).
    pub async fn acquire(&self, group: u32) -> Result<Acquired<'_>, ClientError> {
        let submitted = self.submit(group)?;
        let ticket = submitted.ticket;
        let staged = self.wait(submitted).await?;
        let bytes = self.check_staged(group, &staged)?;
        Ok(Acquired {
            session: self,
            ticket,
            layout: &self.opened.groups[group as usize],
            staged,
            bytes,
        })
    }

    /// Waits until the daemon lets this client copy `bytes` of its own (the LoRA's working
    /// weights to the device, `to_device`, or its gradients back): where the session's
    /// `paces_client_copies` is set (a copy bandwidth limit on the device, or a share), the
    /// grant takes its turn with the daemon's copies and is charged as one; elsewhere it
    /// returns at once, with no message. [`Session::submit_grant`] and the returned
    /// [`Granting`], in one call.
    pub async fn grant(&self, bytes: u64, to_device: bool) -> Result<(), ClientError> {
        self.submit_grant(bytes, to_device)?.await
    }

    /// Sends a CopyGrant and returns at once: the answer comes to the returned [`Granting`]
    /// (already granted where the daemon does not pace this client's copies). A copy larger
    /// than the session's `max_grant_bytes` is asked for in several grants, answered together.
    pub fn submit_grant(&self, bytes: u64, to_device: bool) -> Result<Granting, ClientError> {
        if !self.opened.paces_client_copies {
            return Ok(Granting(Vec::new()));
        }
        let mut answers = Vec::new();
        for part in grant_parts(bytes, self.opened.max_grant_bytes) {
            answers.push(self.submit_one_grant(part, to_device)?);
        }
        Ok(Granting(answers))
    }

    fn submit_one_grant(
        &self,
        bytes: u64,
        to_device: bool,
    ) -> Result<oneshot::Receiver<Result<(), ClientError>>, ClientError> {
        let (tx, rx) = oneshot::channel();
        let id = self.number(|routes, id| {
            routes.grants.insert(id, tx);
        })?;
        let direction = if to_device {
            proto::CopyDirection::HostToDevice
        } else {
            proto::CopyDirection::DeviceToHost
        };
        let grant = proto::CopyGrant {
            id,
            bytes,
            direction: direction as i32,
        };
        if let Err(e) = self.send(Msg::Grant(grant)) {
            lock(&self.routes).grants.remove(&id);
            return Err(e);
        }
        Ok(rx)
    }

    /// The next number for a ticket or a grant (one sequence, so that a fault naming it names
    /// one of them), with `register` run on the routes under the same lock; fails once the
    /// stream has ended.
    fn number(&self, register: impl FnOnce(&mut Routes, u64)) -> Result<u64, ClientError> {
        let mut routes = lock(&self.routes);
        if let Some(reason) = &routes.ended {
            return Err(ClientError::SessionEnded(reason.clone()));
        }
        let n = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        register(&mut routes, n);
        Ok(n)
    }

    /// Whether the daemon paces this client's own copies ([`Session::grant`]).
    pub fn paces_client_copies(&self) -> bool {
        self.opened.paces_client_copies
    }

    /// Sends an Acquire for `group` and returns at once (no round trip): the reply comes to
    /// the returned [`Submitted`]. Several may be in flight. The ticket is this caller's to
    /// give back with [`Session::release`] once staged (no view releases it).
    pub fn submit(&self, group: u32) -> Result<Submitted, ClientError> {
        let (tx, rx) = oneshot::channel();
        // Numbered once it can be sent: `submitted` counts acquires sent.
        let ticket = self.number(|routes, ticket| {
            routes.waiting.insert(ticket, tx);
        })?;
        {
            let mut rec = lock(&self.recorder);
            if rec.recording {
                rec.groups.push(group);
            }
        }
        if let Err(e) = self.send(Msg::Acquire(proto::Acquire {
            group,
            ticket,
            kind: self.kind.load(Ordering::Relaxed),
        })) {
            lock(&self.routes).waiting.remove(&ticket);
            return Err(e);
        }
        Ok(Submitted {
            ticket,
            group,
            reply: rx,
        })
    }

    /// Waits for the daemon's reply to an acquire (from [`Session::submit`]). If the reply had
    /// not come, the time this blocks is the caller's wait for weights: added to the session's
    /// waits ([`Session::waits`]) and reported to the daemon as its `gpu_wait_ns` (this client
    /// computes on the host). A ticket already staged costs no wait.
    pub async fn wait(&self, mut submitted: Submitted) -> Result<proto::Staged, ClientError> {
        if let Some(reply) = submitted.try_staged() {
            return reply;
        }
        let group = submitted.group;
        let blocked = Instant::now();
        let reply = (&mut submitted).await;
        let blocked = blocked.elapsed();
        self.add_reply_wait(group, blocked);
        self.add_wait(group, blocked, None);
        reply
    }

    /// Gives a ticket back (from [`Session::submit`]): one message, no round trip. A ticket of
    /// an opening before [`Session::reopen`] is dropped: that session is gone. A report of the
    /// session's waits goes with it when one is due.
    pub fn release(&self, ticket: u64) -> Result<(), ClientError> {
        if ticket < self.first_ticket {
            return Ok(());
        }
        self.send(Msg::Release(proto::Release { ticket }))?;
        self.send_waits(|ledger, now| ledger.report_due(now))
    }

    /// Adds a wait of `elapsed` for `group`, measured by the caller (the Python client times
    /// its CUDA stream), to step `step` (None: the step in progress).
    pub fn add_wait(&self, group: u32, elapsed: Duration, step: Option<u64>) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        lock(&self.waits).add(group, ns, step);
    }

    /// Adds `blocked`, the time the caller's thread waited for `group`'s reply (measured by the
    /// caller where it waits itself: the Python client's `wait`).
    pub fn add_reply_wait(&self, group: u32, blocked: Duration) {
        let ns = u64::try_from(blocked.as_nanos()).unwrap_or(u64::MAX);
        lock(&self.replies).add(group, ns, None);
    }

    /// The time the caller's thread blocked for replies so far (since the session was opened
    /// or reopened): on CUDA the host issues nothing meanwhile, which the device-side wait
    /// misses while earlier work keeps the device busy.
    pub fn reply_waits(&self) -> WaitTotals {
        lock(&self.replies).totals()
    }

    /// Ends a step for the session's waits (the step boundary is the caller's: the Python
    /// client's is its plan's first group); returns the number of the step that starts.
    pub fn mark_step(&self) -> u64 {
        lock(&self.waits).mark_step()
    }

    /// The session's waits so far (since it was opened or reopened).
    pub fn waits(&self) -> WaitTotals {
        lock(&self.waits).totals()
    }

    /// Reports sent to the daemon so far (of this opening).
    pub fn wait_reports(&self) -> u64 {
        lock(&self.waits).reports()
    }

    /// The kind of pass the session's next acquires serve: the daemon counts acquires, copies
    /// and reported waits per kind. At a change the waits so far are reported first, so that
    /// the daemon gives them to the kind that ends.
    pub fn set_pass_kind(&self, kind: proto::PassKind) -> Result<(), ClientError> {
        if self.kind.swap(kind as i32, Ordering::Relaxed) != kind as i32 {
            self.report_waits()?;
        }
        Ok(())
    }

    /// Sends the daemon the session's waits now, unless it has these totals already.
    pub fn report_waits(&self) -> Result<(), ClientError> {
        self.send_waits(|ledger, now| ledger.report_now(now))
    }

    fn send_waits(
        &self,
        take: impl FnOnce(&mut WaitLedger, Instant) -> Option<proto::GpuWait>,
    ) -> Result<(), ClientError> {
        if !self.opened.accepts_gpu_wait {
            return Ok(()); // a daemon that predates the reports
        }
        let report = take(&mut lock(&self.waits), Instant::now());
        match report {
            Some(report) => self.send(Msg::GpuWait(report)),
            None => Ok(()),
        }
    }

    /// Whether the session's regions are device memory (the CUDA backend), where the time a
    /// thread blocks is not the time the device waits.
    pub fn on_device(&self) -> bool {
        self.regions
            .iter()
            .any(|r| matches!(r, MappedRegion::Device { .. }))
    }

    /// Whether `ticket` was numbered by an opening of this session before the current one.
    pub fn is_stale(&self, ticket: u64) -> bool {
        ticket < self.first_ticket
    }

    /// Checks a placement against the layout; the group's bytes where this client maps them.
    pub fn check_staged(
        &self,
        group: u32,
        staged: &proto::Staged,
    ) -> Result<Option<&[u8]>, ClientError> {
        let region = self.regions.get(staged.region as usize).ok_or_else(|| {
            ClientError::Protocol(format!("Staged names region {}", staged.region))
        })?;
        let layout = self.opened.groups.get(group as usize).ok_or_else(|| {
            ClientError::Protocol(format!("Staged for group {group}, which is out of range"))
        })?;
        let start = staged.offset;
        let out_of_range = || ClientError::Protocol(format!("Staged offset {start} out of range"));
        let end = start.checked_add(layout.nbytes).ok_or_else(out_of_range)?;
        match region {
            MappedRegion::Host { map: Some(map), .. } => Ok(Some(
                map.get(start as usize..end as usize)
                    .ok_or_else(out_of_range)?,
            )),
            MappedRegion::Host { file: _, map: None } => {
                if end > self.opened.regions[staged.region as usize].size {
                    return Err(out_of_range());
                }
                Ok(None)
            }
            MappedRegion::Device { size } if end <= *size => Ok(None),
            MappedRegion::Device { .. } => Err(out_of_range()),
        }
    }

    /// The fd of host region `index` (host backend), for a caller that maps it itself.
    pub fn region_fd(&self, index: usize) -> Option<BorrowedFd<'_>> {
        match self.regions.get(index)? {
            MappedRegion::Host { file, .. } => Some(file.as_fd()),
            MappedRegion::Device { .. } => None,
        }
    }

    /// Why the session's stream ended, once it has: later acquires fail with it.
    pub fn ended(&self) -> Option<String> {
        lock(&self.routes).ended.clone()
    }

    /// Acquires sent so far by this session (across reopenings).
    pub fn submitted(&self) -> u64 {
        self.next_ticket.load(Ordering::Relaxed) - 1
    }

    /// The plan last sent (sent again by [`Session::reopen`]).
    pub fn last_plan(&self) -> Option<Vec<u32>> {
        lock(&self.plan).clone()
    }

    /// Ends a training step. After the first (when recording), the step's acquisitions are
    /// sent as the plan, so that later steps are prefetched.
    pub fn end_step(&self) {
        let plan = {
            let mut rec = lock(&self.recorder);
            if !rec.recording {
                return;
            }
            rec.recording = false;
            std::mem::take(&mut rec.groups)
        };
        self.send_plan(plan);
    }

    /// Sends a plan explicitly.
    pub fn send_plan(&self, groups: Vec<u32>) {
        *lock(&self.plan) = Some(groups.clone());
        let kind = self.kind.load(Ordering::Relaxed);
        let _ = self.send(Msg::Plan(proto::Plan { groups, kind }));
    }

    /// Closes the session; its views must be dropped first (the borrow checker sees to it).
    pub async fn close(self) -> Result<(), ClientError> {
        let mut rpc = self.client.rpc();
        let request = proto::CloseSessionRequest {
            session_id: self.id.clone(),
        };
        rpc.close_session(request)
            .await
            .map_err(|s| self.client.status(s))?;
        Ok(())
    }
}

async fn read_replies(
    mut inbound: tonic::Streaming<proto::ServerMessage>,
    routes: Arc<Mutex<Routes>>,
) {
    let reason = loop {
        match inbound.message().await {
            Ok(Some(proto::ServerMessage { msg: Some(reply) })) => route(&routes, reply),
            Ok(Some(_)) => {}
            Ok(None) => break "the daemon closed the session".to_string(),
            Err(status) => {
                break format!(
                    "lost the daemon's stream ({:?}: {})",
                    status.code(),
                    status.message()
                );
            }
        }
    };
    let mut routes = lock(&routes);
    let reason = routes.ended.clone().unwrap_or(reason);
    for (_, waiter) in routes.waiting.drain() {
        let _ = waiter.send(Err(ClientError::SessionEnded(reason.clone())));
    }
    for (_, waiter) in routes.grants.drain() {
        let _ = waiter.send(Err(ClientError::SessionEnded(reason.clone())));
    }
    routes.ended = Some(reason);
}

fn route(routes: &Mutex<Routes>, reply: Reply) {
    let mut routes = lock(routes);
    match reply {
        Reply::Staged(staged) => {
            if let Some(waiter) = routes.waiting.remove(&staged.ticket) {
                let _ = waiter.send(Ok(staged));
            }
        }
        Reply::Fault(fault) => {
            let code = proto::FaultCode::try_from(fault.code)
                .unwrap_or(proto::FaultCode::FaultUnspecified);
            if code == proto::FaultCode::FaultShuttingDown {
                routes.ended = Some(fault.message.clone());
            }
            let error = |message| ClientError::Fault {
                ticket: fault.ticket,
                code,
                message,
            };
            if let Some(waiter) = routes.waiting.remove(&fault.ticket) {
                let _ = waiter.send(Err(error(fault.message)));
            } else if let Some(waiter) = routes.grants.remove(&fault.ticket) {
                let _ = waiter.send(Err(error(fault.message)));
            } else {
                tracing::warn!(ticket = fault.ticket, ?code, message = %fault.message, "session fault");
            }
        }
        Reply::Granted(granted) => {
            if let Some(waiter) = routes.grants.remove(&granted.id) {
                let _ = waiter.send(Ok(()));
            }
        }
        Reply::Attached(_) => {}
    }
}

/// Writes the tensors into the upload region the daemon created (`region`, from the handoff
/// socket). The mapping is dropped on return: the daemon seals the region against writes at
/// commit, which fails while a writable mapping is alive, so a process forked meanwhile (by
/// another thread of this one) does not inherit it (`MADV_DONTFORK`).
pub(crate) fn write_upload(
    region: OwnedFd,
    begun: &proto::BeginUploadResponse,
    tensors: &[TensorData<'_>],
) -> Result<(), ClientError> {
    let err = |source| ClientError::Map {
        what: format!("upload {}", begun.upload_id),
        source,
    };
    let file = File::from(region);
    // SAFETY: the daemon made this region for this upload alone (only our uid can fetch its
    // fd), sealed it against shrinking, and reads it only after commit.
    let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(err)?;
    if !map.is_empty() {
        map.advise(memmap2::Advice::DontFork).map_err(err)?;
    }
    for (slot, t) in begun.tensors.iter().zip(tensors) {
        let start = slot.offset as usize;
        let dst = map.get_mut(start..start + t.bytes.len()).ok_or_else(|| {
            ClientError::Protocol(format!("upload slot of '{}' out of range", t.name))
        })?;
        dst.copy_from_slice(t.bytes);
    }
    drop(map);
    Ok(())
}
