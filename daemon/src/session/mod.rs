//! Sessions: one trainer process on one device, its staging arena, its plan and its tickets.
//!
//! Each session is an actor (one tokio task) that owns all of its mutable state; the `Run`
//! stream, copy completions and control requests reach it as messages, so the hot path takes no
//! locks. What other requests need to read (statistics, identity) lives in `SessionShared`.
#![forbid(unsafe_code)]

mod actor;
pub mod arena;
pub mod events;
pub mod layout;
pub mod plan;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Status, Streaming};
use weightstream_client::proto as pb;

pub use self::actor::{ActorParts, spawn};
use crate::server::conn::Peer;

/// Why a session ends, as its client is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    ClientClosed,
    ConnectionClosed,
    StreamEnded,
    Shutdown,
}

pub type Outbound = mpsc::Sender<Result<pb::ServerMessage, Status>>;

pub enum Control {
    Attach {
        inbound: Box<Streaming<pb::ClientMessage>>,
        outbound: Outbound,
        reply: oneshot::Sender<Result<(), Status>>,
    },
    Close(CloseReason),
}

/// Counters of one session, readable by ListSessions while the actor runs.
#[derive(Debug, Default)]
pub struct SessionStats {
    pub acquires: AtomicU64,
    pub hits: AtomicU64,
    pub reuses: AtomicU64,
    pub misses: AtomicU64,
    pub resident_hits: AtomicU64,
    pub bytes_copied: AtomicU64,
    pub copies: AtomicU64,
    pub prefetches: AtomicU64,
    pub stall_ns: AtomicU64,
    pub resyncs: AtomicU64,
    pub releases: AtomicU64,
    pub evictions: AtomicU64,
}

impl SessionStats {
    pub fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> pb::SessionStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        pb::SessionStats {
            acquires: get(&self.acquires),
            hits: get(&self.hits),
            reuses: get(&self.reuses),
            misses: get(&self.misses),
            resident_hits: get(&self.resident_hits),
            bytes_copied: get(&self.bytes_copied),
            copies: get(&self.copies),
            prefetches: get(&self.prefetches),
            stall_ns: get(&self.stall_ns),
            resyncs: get(&self.resyncs),
            releases: get(&self.releases),
            evictions: get(&self.evictions),
        }
    }
}

/// What the rest of the daemon sees of a session.
pub struct SessionShared {
    pub id: String,
    /// Numeric id for the copy scheduler's lanes.
    pub number: u64,
    pub model_id: String,
    pub device: usize,
    pub device_uuid: String,
    pub label: String,
    pub owner: Peer,
    pub vram_budget: u64,
    pub staging_bytes: u64,
    pub resident_bytes: u64,
    pub created: Instant,
    pub stats: SessionStats,
    pub attached: AtomicBool,
    pub plan_len: AtomicU32,
    pub live_tickets: AtomicU32,
    pub control: mpsc::UnboundedSender<Control>,
    pub finished: watch::Receiver<bool>,
}

impl SessionShared {
    pub fn info(&self) -> pb::SessionInfo {
        pb::SessionInfo {
            session_id: self.id.clone(),
            model_id: self.model_id.clone(),
            device_uuid: self.device_uuid.clone(),
            label: self.label.clone(),
            peer_uid: self.owner.uid,
            peer_gid: self.owner.gid,
            peer_pid: self.owner.pid,
            vram_budget: self.vram_budget,
            staging_bytes: self.staging_bytes,
            resident_bytes: self.resident_bytes,
            attached: self.attached.load(Ordering::Relaxed),
            plan_length: self.plan_len.load(Ordering::Relaxed),
            live_tickets: self.live_tickets.load(Ordering::Relaxed),
            stats: Some(self.stats.snapshot()),
            age_ms: self.created.elapsed().as_millis() as u64,
        }
    }

    /// Asks the session to end and waits until its teardown is complete.
    pub async fn close(&self, reason: CloseReason) {
        let _ = self.control.send(Control::Close(reason));
        let mut finished = self.finished.clone();
        let _ = finished.wait_for(|done| *done).await;
    }
}
