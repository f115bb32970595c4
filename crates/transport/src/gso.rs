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
//!
//! It also bounds the endpoint's receive buffer. quinn allocates, per
//! endpoint, 32 receive slots of `max_udp_payload_size × GRO segments`
//! bytes: with loopback's 65,000-byte datagrams and Linux's 64 GRO
//! segments, 127 MiB, for room that no received message can fill (a GRO
//! batch holds 64 KiB by default; loopback datagrams are never coalesced).
//! [`BoundedSegments`] reports the segment count that makes a slot just
//! hold the largest message the kernel can hand over (see
//! [`receive_segments`]): 4 MiB per endpoint with the defaults.

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

/// The largest GRO batch Linux builds when an administrator raises a
/// device's `gro_max_size` to its maximum (8 × 65,535; 65,536 by default).
const GRO_MAX: usize = 8 * 65_535;

/// The GRO segment count to report so that one of quinn's receive slots
/// (`unit` bytes, the endpoint's maximum UDP payload capped at 64 KiB,
/// times the count) holds the largest message one receive can return: a
/// GRO batch of `gro_segments` datagrams of at most `network_datagram`
/// bytes (the size on paths other than loopback, where GRO coalesces),
/// bounded by [`GRO_MAX`], and at least 64 KiB (a datagram, or a GSO batch
/// delivered whole on loopback or a veth pair). Never more than the
/// socket's own count, never less than one.
pub(crate) fn receive_segments(gro_segments: usize, unit: usize, network_datagram: usize) -> usize {
    let largest = gro_segments.saturating_mul(network_datagram).clamp(64 << 10, GRO_MAX);
    largest.div_ceil(unit.max(1)).clamp(1, gro_segments.max(1))
}

/// An endpoint's socket whose GSO batches hold at most `max_segments`
/// datagrams; everything else is the wrapped socket's.
#[derive(Debug)]
pub(crate) struct BoundedSegments {
    inner: Arc<dyn AsyncUdpSocket>,
    max_segments: usize,
    receive_segments: usize,
}

impl BoundedSegments {
    /// Wrap `inner` for GSO batches of datagrams of at most
    /// `largest_segment` bytes, and for receive slots of `unit` bytes per
    /// segment (see [`receive_segments`]) that must hold GRO batches of
    /// datagrams of `network_datagram` bytes.
    pub(crate) fn new(
        inner: Arc<dyn AsyncUdpSocket>,
        largest_segment: usize,
        unit: usize,
        network_datagram: usize,
    ) -> BoundedSegments {
        let receive_segments = receive_segments(inner.max_receive_segments(), unit, network_datagram);
        BoundedSegments { inner, max_segments: segments_per_send(largest_segment), receive_segments }
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
        // Read by quinn once, to size the endpoint's receive buffer.
        self.receive_segments
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

    #[test]
    fn a_receive_slot_holds_the_largest_message_a_receive_returns() {
        for gro in [1, 16, 64] {
            for unit in [1200, 1472, 8_952, 16_000, 65_000, 65_536] {
                for datagram in [1200, 1472, 8_952] {
                    let n = receive_segments(gro, unit, datagram);
                    assert!((1..=gro).contains(&n), "{gro} {unit} {datagram}: {n}");
                    let slot = n * unit;
                    let largest = (gro * datagram).clamp(64 << 10, GRO_MAX);
                    assert!(slot >= largest || n == gro, "{gro} {unit} {datagram}: {slot} < {largest}");
                    assert!(
                        n == 1 || (n - 1) * unit < largest,
                        "{gro} {unit} {datagram}: {n} is more than needed"
                    );
                }
            }
        }
        // The defaults: loopback's 65,000-byte datagrams, 1472 elsewhere,
        // Linux's 64 GRO segments: 2 in place of 64.
        assert_eq!(receive_segments(64, 65_000, 1472), 2);
        // No loopback tuning: quinn's own count.
        assert_eq!(receive_segments(64, 1472, 1472), 64);
    }
}
