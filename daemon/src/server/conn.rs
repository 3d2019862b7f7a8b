//! Connections on the Unix socket: who the peer is (SO_PEERCRED and SO_PEERGROUPS), how many
//! each uid holds, and when one goes away.
//!
//! Each accepted stream gets a connection number. Sessions and uploads belong to the connection
//! that made them, and the stream's drop (the client closed it, or died, or the drain cut it)
//! tells the daemon to tear them down. The accept loop backs off when the process is out of
//! descriptors or memory instead of spinning on a listener that stays readable.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tonic::transport::server::Connected;

// The core owns the peer's identity; the edge reads it off the socket and hands it in (and
// handlers find it in each request's extensions under this name).
use crate::core::Peer;

/// Who is at the other end of a connection, as the kernel saw it at connect time: the core's
/// [`Peer`] and, for the `[access]` lists alone, its supplementary groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub peer: Peer,
    /// Sorted, without repeats; the primary gid is `peer.gid` (and may be here too).
    pub groups: Arc<[u32]>,
}

/// Reads the peer's credentials off an accepted stream; `conn` numbers the connection. A
/// kernel without SO_PEERGROUPS (before 4.13) gives no supplementary groups: only the primary
/// gid counts then (said once in the log).
pub fn identify(stream: &UnixStream, conn: u64) -> io::Result<Caller> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let cred = stream.peer_cred()?;
    let groups = match super::sockopt::peer_groups(stream.as_fd()) {
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOPROTOOPT.raw_os_error()) => {
            WARNED.call_once(|| {
                tracing::warn!(
                    "this kernel has no SO_PEERGROUPS (Linux 4.13+): access.allowed_gids \
                     matches a peer's primary gid only"
                )
            });
            Vec::new()
        }
        groups => groups?,
    };
    Ok(Caller {
        peer: Peer {
            conn,
            uid: cred.uid(),
            gid: cred.gid(),
            pid: cred.pid().unwrap_or(0),
        },
        groups: groups.into(),
    })
}

/// The first wait after accept fails for want of descriptors or memory; it doubles up to
/// [`BACKOFF_MAX`] while accept keeps failing.
const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The open connections of one socket: per uid (for `limits.max_connections_per_uid`, which
/// each socket, gRPC and handoff, applies on its own) and in all (for the drain), and the
/// switch that cuts them all when the drain's deadline passes.
pub struct Connections {
    per_uid: Mutex<HashMap<u32, u32>>,
    limit_per_uid: u32,
    open: watch::Sender<usize>,
    cut: watch::Sender<bool>,
}

impl Connections {
    pub fn new(limit_per_uid: u32) -> Arc<Connections> {
        Arc::new(Connections {
            per_uid: Mutex::new(HashMap::new()),
            limit_per_uid,
            open: watch::Sender::new(0),
            cut: watch::Sender::new(false),
        })
    }

    fn per_uid(&self) -> MutexGuard<'_, HashMap<u32, u32>> {
        self.per_uid.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more connection of `uid`, or how many it already holds (the limit).
    pub(super) fn admit(self: &Arc<Self>, uid: u32) -> Result<Slot, u32> {
        let mut per_uid = self.per_uid();
        let held = per_uid.entry(uid).or_default();
        if *held >= self.limit_per_uid {
            return Err(*held);
        }
        *held += 1;
        drop(per_uid);
        self.open.send_modify(|n| *n += 1);
        Ok(Slot {
            table: self.clone(),
            uid,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        *self.open.borrow()
    }

    /// Ends every open connection: its next read or write fails, so its task ends and its
    /// drop reports it closed. Returns how many were open.
    pub fn cut(&self) -> usize {
        self.cut.send_replace(true);
        self.open()
    }

    /// Resolves once no connection is open.
    pub async fn all_closed(&self) {
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|n| *n == 0).await;
    }
}

/// One admitted connection's place in [`Connections`].
pub(super) struct Slot {
    table: Arc<Connections>,
    uid: u32,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut per_uid = self.table.per_uid();
        if let Some(held) = per_uid.get_mut(&self.uid) {
            *held -= 1;
            if *held == 0 {
                per_uid.remove(&self.uid);
            }
        }
        drop(per_uid);
        self.table.open.send_modify(|n| *n -= 1);
    }
}

/// A peer's stream; its drop reports the connection closed.
pub struct PeerStream {
    inner: UnixStream,
    caller: Caller,
    closed: mpsc::UnboundedSender<u64>,
    _slot: Slot,
    /// Resolves when the drain cuts every connection.
    cut: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl PeerStream {
    /// Fails the caller's I/O once the connections are cut (registering its waker until then).
    fn check_cut(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        match self.cut.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the daemon's drain timed out: connection cut",
            )),
            Poll::Pending => Ok(()),
        }
    }
}

impl Drop for PeerStream {
    fn drop(&mut self) {
        let _ = self.closed.send(self.caller.peer.conn);
    }
}

impl Connected for PeerStream {
    type ConnectInfo = Caller;

    fn connect_info(&self) -> Caller {
        self.caller.clone()
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.check_cut(cx)?;
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check_cut(cx)?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check_cut(cx)?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.check_cut(cx)?;
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Accepted connections as a stream for tonic, each tagged with its peer. A uid over its
/// connection limit has the new connection closed at once; accept failing for want of
/// descriptors or memory (EMFILE, ENFILE, ENOMEM, ENOBUFS) is retried after a back-off, other
/// failures (a peer that left before accept) at once.
pub fn incoming(
    listener: UnixListener,
    closed: mpsc::UnboundedSender<u64>,
    table: Arc<Connections>,
) -> impl Stream<Item = io::Result<PeerStream>> {
    let state = Acceptor {
        listener,
        closed,
        table,
        backoff: BACKOFF_START,
        exhausted_warning: Warning::default(),
        refused_warning: Warning::default(),
    };
    futures::stream::unfold(state, |mut state| async move {
        let stream = state.next().await;
        Some((Ok(stream), state))
    })
}

struct Acceptor {
    listener: UnixListener,
    closed: mpsc::UnboundedSender<u64>,
    table: Arc<Connections>,
    backoff: Duration,
    exhausted_warning: Warning,
    refused_warning: Warning,
}

impl Acceptor {
    /// The next admitted connection (waits through failures and refusals).
    async fn next(&mut self) -> PeerStream {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        loop {
            let stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) if out_of_resources(&e) => {
                    if let Some(suppressed) = self.exhausted_warning.due() {
                        tracing::warn!(error = %e, retry_in_ms = self.backoff.as_millis() as u64,
                            suppressed, "accept failed: out of file descriptors or memory; \
                            backing off");
                    }
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    continue;
                }
            };
            self.backoff = BACKOFF_START;
            let mut caller = match identify(&stream, 0) {
                Ok(caller) => caller,
                Err(e) => {
                    tracing::debug!(error = %e, "no peer credentials: connection closed");
                    continue;
                }
            };
            let slot = match self.table.admit(caller.peer.uid) {
                Ok(slot) => slot,
                Err(held) => {
                    if let Some(suppressed) = self.refused_warning.due() {
                        tracing::warn!(
                            uid = caller.peer.uid,
                            pid = caller.peer.pid,
                            held,
                            suppressed,
                            "uid {} already holds {held} connections, the limit is \
                            limits.max_connections_per_uid = {}: connection closed",
                            caller.peer.uid,
                            self.table.limit_per_uid
                        );
                    }
                    continue;
                }
            };
            caller.peer.conn = NEXT.fetch_add(1, Ordering::Relaxed);
            let peer = caller.peer;
            tracing::debug!(
                conn = peer.conn,
                uid = peer.uid,
                pid = peer.pid,
                groups = ?caller.groups,
                "connected"
            );
            let mut cut = self.table.cut.subscribe();
            return PeerStream {
                inner: stream,
                caller,
                closed: self.closed.clone(),
                _slot: slot,
                cut: Box::pin(async move {
                    let _ = cut.wait_for(|cut| *cut).await;
                }),
            };
        }
    }
}

/// Accept fails this way while the process (or the box) is out of descriptors or memory; the
/// listener stays readable, so retrying at once would spin.
fn out_of_resources(e: &io::Error) -> bool {
    use rustix::io::Errno;
    e.raw_os_error().is_some_and(|code| {
        [Errno::MFILE, Errno::NFILE, Errno::NOMEM, Errno::NOBUFS]
            .iter()
            .any(|errno| errno.raw_os_error() == code)
    })
}

/// A warning logged at most once a second; how many were held back in between.
#[derive(Default)]
pub(super) struct Warning {
    last: Option<Instant>,
    suppressed: u64,
}

impl Warning {
    /// Some(held back since the last one) when the warning may be logged now.
    pub(super) fn due(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < Duration::from_secs(1))
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_resources_is_told_apart_from_a_peer_that_left() {
        let cases = [
            (rustix::io::Errno::MFILE, true),
            (rustix::io::Errno::NFILE, true),
            (rustix::io::Errno::NOMEM, true),
            (rustix::io::Errno::NOBUFS, true),
            (rustix::io::Errno::CONNABORTED, false),
            (rustix::io::Errno::INTR, false),
        ];
        let wrong: Vec<_> = cases
            .iter()
            .filter(|(errno, want)| out_of_resources(&io::Error::from(*errno)) != *want)
            .collect();
        assert!(wrong.is_empty(), "{wrong:?}");
    }

    #[test]
    fn a_warning_is_due_at_most_once_a_second() {
        let mut w = Warning::default();
        assert_eq!(w.due(), Some(0));
        assert_eq!(w.due(), None);
        assert_eq!(w.due(), None);
        w.last = Some(Instant::now() - Duration::from_secs(2));
        assert_eq!(
            w.due(),
            Some(2),
            "the held-back count comes with the next one"
        );
    }

    #[test]
    fn slots_count_per_uid_up_to_the_limit() {
        let table = Connections::new(2);
        let a = table.admit(1000).unwrap();
        let _b = table.admit(1000).unwrap();
        assert_eq!(table.admit(1000).err(), Some(2));
        let _other = table.admit(1001).expect("another uid has its own count");
        assert_eq!(table.open(), 3);
        drop(a);
        let _c = table
            .admit(1000)
            .expect("a closed connection frees its place");
    }
}
