//! The UDP socket under each QUIC endpoint: quinn-udp's system calls on a
//! tokio socket, as quinn's own tokio socket makes them, with three
//! differences.
//!
//! **A bound on how many datagrams one segmentation-offload (GSO) send
//! holds.** With GSO on, quinn packs up to 10 datagrams of the path's MTU
//! into one `sendmsg` without checking that the batch fits in one UDP send
//! (65,507 bytes of payload), and quinn-udp takes the kernel's `EMSGSIZE`
//! for a failed MTU probe and reports success. With a fixed MTU above 6,550
//! bytes every full batch was dropped that way, every retransmission too,
//! and a large call stalled until its timeout. [`EndpointSocket`] reports a
//! segment count that keeps each batch within the limit, so a large MTU
//! with GSO is merely fewer datagrams per send, never a silent loss.
//!
//! **A bound on the endpoint's receive buffer.** quinn allocates, per
//! endpoint, 32 receive slots of `max_udp_payload_size × GRO segments`
//! bytes: with loopback's 65,000-byte datagrams and Linux's 64 GRO
//! segments, 127 MiB, for room that no received message can fill (a GRO
//! batch holds 64 KiB by default; loopback datagrams are never coalesced).
//! [`EndpointSocket`] reports the segment count that makes a slot just
//! hold the largest message the kernel can hand over (see
//! [`receive_segments`]): 4 MiB per endpoint with the defaults.
//!
//! **No receive that is known to find nothing.** quinn's endpoint reads
//! until a receive fails with `EAGAIN`, since tokio's readiness is cleared
//! only then: one wasted system call after every burst, on the path of
//! every small call (on each side, before the endpoint's task lets the
//! connection's task run). A `recvmmsg` on a non-blocking socket that
//! returns fewer messages than it asked for has found the queue empty, so
//! [`EndpointSocket`] clears the readiness itself then. It is race-free:
//! tokio clears it only if no readiness event came since the one the
//! receive started from, and every datagram that arrives afterwards is
//! such an event.

use quinn::{
    udp::{RecvMeta, Transmit, UdpSocketState, BATCH_SIZE},
    AsyncUdpSocket, UdpPoller,
};
use std::{
    io::{self, IoSliceMut},
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{ready, Context, Poll},
};
use tokio::io::Interest;

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

/// An endpoint's UDP socket: GSO batches of at most `max_segments`
/// datagrams, receive slots sized by `receive_segments`, and no receive
/// after one that found the queue empty (see the module's docs).
#[derive(Debug)]
pub(crate) struct EndpointSocket {
    io: tokio::net::UdpSocket,
    state: UdpSocketState,
    max_segments: usize,
    receive_segments: usize,
}

impl EndpointSocket {
    /// `socket` (non-blocking from here on, on the current tokio runtime)
    /// for GSO batches of datagrams of at most `largest_segment` bytes, and
    /// for receive slots of `unit` bytes per segment (see
    /// [`receive_segments`]) that must hold GRO batches of datagrams of
    /// `network_datagram` bytes.
    pub(crate) fn new(
        socket: std::net::UdpSocket,
        largest_segment: usize,
        unit: usize,
        network_datagram: usize,
    ) -> io::Result<EndpointSocket> {
        // quinn-udp sets the socket options it needs (ECN, packet info,
        // no fragmentation) and makes the socket non-blocking.
        let state = UdpSocketState::new((&socket).into())?;
        let io = tokio::net::UdpSocket::from_std(socket)?;
        let receive_segments = receive_segments(state.gro_segments(), unit, network_datagram);
        Ok(EndpointSocket { io, state, max_segments: segments_per_send(largest_segment), receive_segments })
    }
}

/// Waits until an [`EndpointSocket`] may send again.
#[derive(Debug)]
struct Writable(Arc<EndpointSocket>);

impl UdpPoller for Writable {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context) -> Poll<io::Result<()>> {
        self.0.io.poll_send_ready(cx)
    }
}

impl AsyncUdpSocket for EndpointSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(Writable(self))
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.io.try_io(Interest::WRITABLE, || self.state.send((&self.io).into(), transmit))
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let asked = bufs.len().min(BATCH_SIZE);
        loop {
            ready!(self.io.poll_recv_ready(cx))?;
            let mut received = 0;
            let read = self.io.try_io(Interest::READABLE, || {
                received = self.state.recv((&self.io).into(), bufs, meta)?;
                if received < asked {
                    // The queue was empty after the last message: clear
                    // the readiness now rather than after one more call.
                    Err(io::ErrorKind::WouldBlock.into())
                } else {
                    Ok(received)
                }
            });
            match read {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(_) if received > 0 => return Poll::Ready(Ok(received)),
                // Like quinn's own socket, a failed receive (an ICMP error
                // reported on the socket, say) is passed over: the error is
                // consumed, and the next receive reads on.
                Err(_) => continue,
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        // Asked before every send: quinn-udp's count drops to 1 if the
        // kernel turns out not to support GSO after all.
        self.state.max_gso_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        // Read by quinn once, to size the endpoint's receive buffer.
        self.receive_segments
    }

    fn may_fragment(&self) -> bool {
        self.state.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Receive slots for a full batch of small datagrams.
    struct Slots {
        storage: Vec<u8>,
        meta: Vec<RecvMeta>,
    }

    const SLOT: usize = 2048;

    impl Slots {
        fn new() -> Slots {
            Slots { storage: vec![0; BATCH_SIZE * SLOT], meta: vec![RecvMeta::default(); BATCH_SIZE] }
        }

        /// One receive, within a deadline; the payloads it returned.
        async fn receive(&mut self, socket: &EndpointSocket) -> Vec<Vec<u8>> {
            let Slots { storage, meta } = self;
            let mut bufs: Vec<IoSliceMut> = storage.chunks_mut(SLOT).map(IoSliceMut::new).collect();
            let n = tokio::time::timeout(
                Duration::from_secs(10),
                std::future::poll_fn(|cx| socket.poll_recv(cx, &mut bufs, meta)),
            )
            .await
            .expect("a queued datagram is received")
            .expect("the receive succeeds");
            drop(bufs);
            (0..n).map(|i| storage[i * SLOT..i * SLOT + meta[i].len].to_vec()).collect()
        }
    }

    fn bound() -> (EndpointSocket, std::net::UdpSocket) {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let socket = EndpointSocket::new(socket, 1472, 1472, 1472).expect("endpoint socket");
        let peer = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        peer.connect(socket.local_addr().expect("address")).expect("connect");
        (socket, peer)
    }

    /// Whether tokio would run a receive now, i.e. the socket's read
    /// readiness is still set.
    fn readiness_set(socket: &EndpointSocket) -> bool {
        let mut ran = false;
        let _ = socket.io.try_io(Interest::READABLE, || {
            ran = true;
            Err::<(), _>(io::ErrorKind::Other.into())
        });
        ran
    }

    #[tokio::test]
    async fn a_receive_that_empties_the_queue_clears_the_readiness_and_a_later_datagram_wakes_it() {
        let (socket, peer) = bound();
        let mut slots = Slots::new();
        peer.send(b"one").expect("send");
        assert_eq!(slots.receive(&socket).await, [b"one".to_vec()]);
        assert!(!readiness_set(&socket), "a receive of fewer messages than asked leaves the readiness set");
        peer.send(b"two").expect("send");
        assert_eq!(slots.receive(&socket).await, [b"two".to_vec()]);
    }

    #[tokio::test]
    async fn a_full_receive_keeps_the_readiness_so_a_longer_queue_is_read_whole() {
        let (socket, peer) = bound();
        let mut slots = Slots::new();
        for i in 0..=BATCH_SIZE {
            peer.send(&[i as u8]).expect("send");
        }
        // Loopback delivers a send before it returns: the whole queue is there.
        let first = slots.receive(&socket).await;
        assert_eq!(first.len(), BATCH_SIZE);
        assert!(readiness_set(&socket));
        assert_eq!(slots.receive(&socket).await, [vec![BATCH_SIZE as u8]]);
    }

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
