//! Connections on the Unix socket: who the peer is (SO_PEERCRED) and when it goes away.
//!
//! Each accepted stream gets a connection number. Sessions and uploads belong to the connection
//! that made them, and the stream's drop (the client closed it, or died) tells the daemon to tear
//! them down.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tonic::transport::server::Connected;

// The core owns the peer's identity; the edge reads it off the socket and hands it in (and
// handlers find it in each request's extensions under this name).
use crate::core::Peer;

/// A peer's stream; its drop reports the connection closed.
pub struct PeerStream {
    inner: UnixStream,
    peer: Peer,
    closed: mpsc::UnboundedSender<u64>,
}

impl Drop for PeerStream {
    fn drop(&mut self) {
        let _ = self.closed.send(self.peer.conn);
    }
}

impl Connected for PeerStream {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
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
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Accepted connections as a stream for tonic, each tagged with its peer.
pub fn incoming(
    listener: UnixListener,
    closed: mpsc::UnboundedSender<u64>,
) -> impl Stream<Item = io::Result<PeerStream>> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    futures::stream::unfold(listener, move |listener| {
        let closed = closed.clone();
        async move {
            let accepted = listener.accept().await.and_then(|(stream, _)| {
                let cred = stream.peer_cred()?;
                let peer = Peer {
                    conn: NEXT.fetch_add(1, Ordering::Relaxed),
                    uid: cred.uid(),
                    gid: cred.gid(),
                    pid: cred.pid().unwrap_or(0),
                };
                tracing::debug!(
                    conn = peer.conn,
                    uid = peer.uid,
                    pid = peer.pid,
                    "connected"
                );
                Ok(PeerStream {
                    inner: stream,
                    peer,
                    closed,
                })
            });
            Some((accepted, listener))
        }
    })
}
