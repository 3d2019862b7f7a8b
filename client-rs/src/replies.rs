//! What a session's requests give back: an acquire's reply to come ([`Submitted`]), a grant's
//! answers to come ([`Granting`]), and a staged group's views ([`Acquired`], which release their
//! ticket when dropped).

use tokio::sync::oneshot;

use crate::error::ClientError;
use crate::proto;
use crate::session::Session;

/// An acquire sent by [`Session::submit`], its reply not yet taken.
pub struct Submitted {
    pub(crate) ticket: u64,
    pub(crate) group: u32,
    pub(crate) reply: oneshot::Receiver<Result<proto::Staged, ClientError>>,
}

impl Submitted {
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    pub fn group(&self) -> u32 {
        self.group
    }

    /// Waits for the daemon's reply.
    pub async fn staged(self) -> Result<proto::Staged, ClientError> {
        self.reply
            .await
            .map_err(|_| ClientError::SessionEnded("the stream reader stopped".into()))?
    }

    /// The reply if it has come; `None` while it has not. A caller that blocks on it polls
    /// `&mut` this (it is a future) or calls [`Submitted::staged`].
    pub fn try_staged(&mut self) -> Option<Result<proto::Staged, ClientError>> {
        match self.reply.try_recv() {
            Ok(reply) => Some(reply),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(ClientError::SessionEnded(
                "the stream reader stopped".into(),
            ))),
        }
    }
}

/// A grant sent by [`Session::submit_grant`], its answers not yet taken (none: nothing to wait
/// for): ready once every part is granted, or at the first part refused.
pub struct Granting(pub(crate) Vec<oneshot::Receiver<Result<(), ClientError>>>);

impl std::future::Future for Granting {
    type Output = Result<(), ClientError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        while let Some(rx) = self.0.first_mut() {
            match std::pin::Pin::new(rx).poll(cx) {
                std::task::Poll::Pending => return std::task::Poll::Pending,
                std::task::Poll::Ready(answer) => {
                    self.0.remove(0);
                    let answer = answer.map_err(|_| {
                        ClientError::SessionEnded("the stream reader stopped".into())
                    })?;
                    answer?;
                }
            }
        }
        std::task::Poll::Ready(Ok(()))
    }
}

/// The sizes of the grants a copy of `bytes` is asked for in: parts of at most `most` bytes
/// (0: a daemon that states no bound, one grant).
pub(crate) fn grant_parts(bytes: u64, most: u64) -> impl Iterator<Item = u64> {
    let most = if most == 0 { bytes.max(1) } else { most };
    let whole = bytes / most;
    let rest = bytes % most;
    let parts = std::iter::repeat_n(most, whole as usize);
    // A zero-byte copy is still one grant: the daemon refuses it, naming the field.
    parts.chain((rest > 0 || bytes == 0).then_some(rest))
}

impl std::future::Future for Submitted {
    type Output = Result<proto::Staged, ClientError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.reply).poll(cx).map(|r| {
            r.map_err(|_| ClientError::SessionEnded("the stream reader stopped".into()))?
        })
    }
}

/// A staged group: views of its tensors, valid until dropped (which releases the ticket).
pub struct Acquired<'s> {
    pub(crate) session: &'s Session,
    pub(crate) ticket: u64,
    pub(crate) layout: &'s proto::GroupLayout,
    pub(crate) staged: proto::Staged,
    /// None where the group is in device memory (CUDA backend).
    pub(crate) bytes: Option<&'s [u8]>,
}

impl Acquired<'_> {
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    pub fn layout(&self) -> &proto::GroupLayout {
        self.layout
    }

    /// Where the daemon put the group (region, offset) and its events.
    pub fn staged(&self) -> &proto::Staged {
        &self.staged
    }

    /// The bytes of tensor `i` of the group as staged; None in device memory (CUDA
    /// backend), which this client does not map. A coded tensor's (`coding` CODING_RANS8) are
    /// its `stored_nbytes` of coded bytes, which this client does not decode.
    pub fn tensor(&self, i: usize) -> Option<&[u8]> {
        let t = &self.layout.tensors[i];
        let len = if t.coding == proto::Coding::None as i32 {
            t.nbytes
        } else {
            t.stored_nbytes
        };
        Some(&self.bytes?[t.offset as usize..(t.offset + len) as usize])
    }

    pub fn tensor_by_name(&self, name: &str) -> Option<&[u8]> {
        let i = self.layout.tensors.iter().position(|t| t.name == name)?;
        self.tensor(i)
    }

    /// Tensor `i` of the group split into its data and its scales when it is quantized
    /// (`None` when it is not, or in device memory): e4m3fn bytes in the tensor's shape, and
    /// little-endian fp32 scales of its `scale_shape`. None for a coded tensor too.
    pub fn quantized(&self, i: usize) -> Option<QuantizedView<'_>> {
        let t = &self.layout.tensors[i];
        if t.quantization == proto::Quantization::None as i32
            || t.coding != proto::Coding::None as i32
        {
            return None;
        }
        let bytes = self.tensor(i)?;
        let data_bytes = t.shape.iter().product::<u64>() as usize;
        Some(QuantizedView {
            data: &bytes[..data_bytes],
            scales: &bytes[t.scale_offset as usize..],
            scale_shape: &t.scale_shape,
        })
    }
}

/// A quantized tensor's two parts, as staged (see [`Acquired::quantized`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizedView<'a> {
    pub data: &'a [u8],
    pub scales: &'a [u8],
    pub scale_shape: &'a [u64],
}

impl Drop for Acquired<'_> {
    fn drop(&mut self) {
        let _ = self.session.release(self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::grant_parts;

    #[test]
    fn a_copy_past_the_largest_grant_is_asked_for_in_parts() {
        let parts = |bytes, most| grant_parts(bytes, most).collect::<Vec<u64>>();
        assert_eq!(parts(10, 4), [4, 4, 2]);
        assert_eq!(parts(8, 4), [4, 4]);
        assert_eq!(parts(3, 4), [3]);
        assert_eq!(parts(0, 4), [0]);
        assert_eq!(parts(1 << 40, 0), [1 << 40]);
    }
}
