//! A bound on how many datagrams one segmentation-offload (GSO) send holds.
//!
//! With GSO on, quinn packs up to 10 datagrams of the path's MTU into one
//! `sendmsg` without checking that the batch fits in one UDP send (65,507
//! bytes of payload), and quinn-udp takes the kernel's `EMSGSIZE` for a
//! failed MTU probe and reports success. With a fixed MTU above 6,550 bytes
//! every full batch was dropped that way, every retransmission too, and a
//! large call stalled until its timeout. [`BoundedSegments`] wraps the
//! endpoint's socket and reports a segment count that keeps each batch
//! within the limit, so a large MTU with GSO is merely fewer datagrams per
//! send, never a silent loss.

use quinn::{
    udp::{RecvMeta, Transmit},
    AsyncUdpSocket, UdpPoller,
};
use std::{
    io::{self, IoSliceMut},
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

/// The largest UDP payload one send may carry (IPv4: 65,535 less the IP and
/// UDP headers; IPv6 allows 20 bytes more, and this is the bound for both).
const MAX_SEND: usize = 65_507;

/// How many datagrams of `segment` bytes fit in one send: at least one
/// (GSO is then simply not used).
fn segments_per_send(segment: usize) -> usize {
    (MAX_SEND / segment.max(1)).max(1)
}

/// An endpoint's socket whose GSO batches hold at most `max_segments`
/// datagrams; everything else is the wrapped socket's.
#[derive(Debug)]
pub(crate) struct BoundedSegments {
    inner: Arc<dyn AsyncUdpSocket>,
    max_segments: usize,
}

impl BoundedSegments {
    /// Wrap `inner` for datagrams of at most `largest_segment` bytes.
    pub(crate) fn new(inner: Arc<dyn AsyncUdpSocket>, largest_segment: usize) -> BoundedSegments {
        BoundedSegments { inner, max_segments: segments_per_send(largest_segment) }
    }
}

impl AsyncUdpSocket for BoundedSegments {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        // Asked before every send: the socket's own count drops to 1 if
        // the kernel turns out not to support GSO after all.
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_of_full_segments_fits_in_one_send() {
        for segment in [1200, 1472, 6_550, 6_551, 8_952, 16_000, 65_000, 65_507, 65_527] {
            let n = segments_per_send(segment);
            assert!(n >= 1, "{segment}");
            assert!(n == 1 || n * segment <= MAX_SEND, "{segment} x {n}");
            assert!((n + 1) * segment > MAX_SEND, "{segment}: {n} leaves room for another");
        }
        assert_eq!(segments_per_send(8_952), 7);
    }
}
