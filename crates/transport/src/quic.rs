//! The QUIC transport: quinn with mutual TLS, one bidirectional stream per
//! call, one connection per peer address.

use crate::{
    gso,
    tls::TlsConfig,
    wire::{self, Expect, Kind},
    Connection, Error, Frame, FrameParts, Handler, Listener, PayloadSink, RemoteError, Result, Transport,
};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::FutureExt;
use quinn::{crypto::rustls::QuicClientConfig, crypto::rustls::QuicServerConfig, VarInt};
use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError},
    task::Poll,
    time::Duration,
};
use tokio::{
    sync::{mpsc, watch, OnceCell},
    time::{timeout, timeout_at, Instant},
};

/// Stream error code: the caller gave up (timeout) on this call.
const CODE_CANCELLED: u32 = 1;
/// Stream error code: the request frame was malformed; the error reply says why.
const CODE_BAD_FRAME: u32 = 2;
/// Stream error code: the reply could not be written in time.
const CODE_STALLED: u32 = 3;
/// Connection close code: the endpoint is shutting down.
const CODE_SHUTDOWN: u32 = 0;
/// Stream error code: the server retired a kept stream between calls (shutdown, or idle).
const CODE_RETIRED: u32 = 4;

/// How a path is tuned: loopback and real networks want different settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathTuning {
    /// A fixed UDP payload size (no MTU discovery), or `None` to start at
    /// 1200 bytes and discover the path's MTU.
    pub mtu: Option<u16>,
    /// Let the kernel segment batches of datagrams (UDP GSO). One send
    /// holds as many datagrams as fit in 65,507 bytes (seven at 8952, one at
    /// 65000, where GSO gains nothing); quinn alone would batch ten, which
    /// above 6,550 bytes the kernel refused and every large transfer stalled.
    pub segmentation_offload: bool,
}

/// Tuning and limits of a [`QuicTransport`]. The defaults suit a cluster on
/// one LAN; see BENCHMARKS.md for what each setting gave on loopback.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicOptions {
    /// Largest metadata plus payload of one frame, checked before anything
    /// is allocated, on both sides.
    pub max_message: u64,
    /// How long to wait for a QUIC handshake (also bounded by the call's timeout).
    pub connect_timeout: Duration,
    /// A connection with no packet for this long is dead: its calls fail
    /// (transiently) and the caller looks the peer up again. With pings every
    /// `keep_alive`, a live peer is never idle, so this is how soon a killed,
    /// paused or cut-off peer is given up; keep it near the job's lease ttl.
    pub idle_timeout: Duration,
    /// Ping an idle connection this often so it stays open (and a dead peer is noticed).
    pub keep_alive: Duration,
    /// A server drops a request stream that sends nothing for this long,
    /// and a reply the client does not read for this long.
    pub stream_idle_timeout: Duration,
    /// After [`Listener::close`], how long running calls may go on before
    /// the connections are closed anyway.
    pub close_grace: Duration,
    /// Calls in flight per connection; more wait for a free stream.
    pub max_concurrent_streams: u32,
    /// Per-stream receive window, bytes.
    pub stream_window: u32,
    /// Per-connection receive window, bytes.
    pub connection_window: u64,
    /// Unacknowledged bytes a connection may have in flight. A frame is
    /// handed to quinn in pieces of a sixteenth of it (at least 64 KiB), so
    /// the window frees as acknowledgements arrive rather than once a
    /// whole window is acknowledged.
    pub send_window: u64,
    /// Requested UDP socket send and receive buffers (capped by the kernel's
    /// `net.core.rmem_max` / `wmem_max`).
    pub socket_buffer: usize,
    /// Idle receive buffers kept for reuse, at most this many bytes per
    /// transport (its server and client sides share them; see
    /// [`wire::BufferPool`]). A payload of 4 MiB or more
    /// ([`wire::DEFAULT_POOLED_FROM`]) is received into a kept buffer of
    /// up to twice its size when there is one, so a large call does not
    /// fault a fresh buffer in and unmap it again (38% of a 256 MiB call's
    /// CPU). The default, 512 MiB, keeps the buffers of a 256 MiB call and
    /// of the same call split over 4 streams (at most 16 buffers are kept
    /// whatever their sizes); a process that receives no payload of 4 MiB
    /// keeps nothing. 0 turns reuse off.
    pub receive_pool: usize,
    /// glibc only: when the transport is made it frees one block of this
    /// many bytes, which raises glibc's dynamic mmap threshold to it and
    /// its trim threshold to twice it, as the process's first free of
    /// such a block would. Else, with every large buffer kept in the
    /// receive pool, glibc keeps trimming the megabytes of quinn's
    /// per-datagram buffers a large transfer frees, and faulting them in
    /// again (on a VM with dear page faults a fifth of a 256 MiB call's
    /// time). The default, 4 MiB, is the size the pool starts at
    /// ([`wire::DEFAULT_POOLED_FROM`]): smaller buffers are then kept by
    /// glibc, and up to 8 MiB of freed memory per malloc arena stays
    /// mapped. 0 leaves glibc alone; glibc itself ignores it when its
    /// thresholds were set (`mallopt`, `GLIBC_TUNABLES`) or are higher
    /// already, and other allocators never see it. Above 32 MiB, glibc's
    /// cap, it does nothing.
    pub glibc_mmap_threshold: usize,
    /// Tuning when the peer is a loopback address: fixed 65000-byte
    /// datagrams without GSO (MTU discovery never left 1200 bytes there,
    /// a fifth of the throughput).
    pub loopback: PathTuning,
    /// Tuning for every other peer: MTU discovery from 1200 bytes, GSO on
    /// (quinn's defaults). Set a fixed MTU for a network with jumbo frames:
    /// its MTU less 48 bytes (8952 for 9000), keeping GSO on.
    pub network: PathTuning,
}

impl Default for QuicOptions {
    fn default() -> Self {
        QuicOptions {
            max_message: wire::DEFAULT_MAX_MESSAGE,
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(3),
            keep_alive: Duration::from_secs(1),
            stream_idle_timeout: Duration::from_secs(10),
            close_grace: Duration::from_secs(10),
            max_concurrent_streams: 256,
            stream_window: 8 << 20,
            connection_window: 64 << 20,
            send_window: 4 << 20,
            socket_buffer: 4 << 20,
            receive_pool: 512 << 20,
            glibc_mmap_threshold: wire::DEFAULT_POOLED_FROM,
            loopback: PathTuning { mtu: Some(65_000), segmentation_offload: false },
            network: PathTuning { mtu: None, segmentation_offload: true },
        }
    }
}

/// Everything built once from the TLS identity and the options.
struct Config {
    tls: TlsConfig,
    options: QuicOptions,
    /// Where received payloads go, on both sides.
    pool: wire::BufferPool,
    client_loopback: quinn::ClientConfig,
    client_network: quinn::ClientConfig,
    server_loopback: Arc<quinn::ServerConfig>,
    server_network: Arc<quinn::ServerConfig>,
}

fn config_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Tls(format!("{what}: {e}"))
}

impl Config {
    fn new(tls: TlsConfig, options: QuicOptions) -> Result<Config> {
        let client_crypto = Arc::new(
            QuicClientConfig::try_from(tls.rustls_client_config()?)
                .map_err(|e| config_error("QUIC client TLS", e))?,
        );
        let server_crypto = Arc::new(
            QuicServerConfig::try_from(tls.rustls_server_config()?)
                .map_err(|e| config_error("QUIC server TLS", e))?,
        );
        let loopback = Arc::new(transport_config(&options, &options.loopback)?);
        let network = Arc::new(transport_config(&options, &options.network)?);
        let client = |t: &Arc<quinn::TransportConfig>| {
            let mut c = quinn::ClientConfig::new(client_crypto.clone());
            c.transport_config(t.clone());
            c
        };
        let server = |t: &Arc<quinn::TransportConfig>| {
            let mut s = quinn::ServerConfig::with_crypto(server_crypto.clone());
            s.transport_config(t.clone());
            // Peers are on the job's network: skip the address-validation round trip.
            Arc::new(s)
        };
        Ok(Config {
            client_loopback: client(&loopback),
            client_network: client(&network),
            server_loopback: server(&loopback),
            server_network: server(&network),
            tls,
            pool: wire::BufferPool::new(options.receive_pool),
            options,
        })
    }

    /// The endpoint configuration; a server passes its restart secret (see
    /// [`TlsConfig::restart_secret`]) so that its reset tokens and
    /// connection IDs survive a restart.
    fn endpoint_config(&self, restart_secret: Option<[u8; 32]>) -> Result<quinn::EndpointConfig> {
        let mut config = match restart_secret {
            Some(secret) => {
                let mut config = quinn::EndpointConfig::new(Arc::new(ring::hmac::Key::new(
                    ring::hmac::HMAC_SHA256,
                    &secret,
                )));
                let mut cid_key = [0u8; 8];
                cid_key.copy_from_slice(&secret[..8]);
                let cid_key = u64::from_le_bytes(cid_key);
                config.cid_generator(move || {
                    Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
                });
                config
            }
            None => quinn::EndpointConfig::default(),
        };
        let largest = [self.options.loopback.mtu, self.options.network.mtu].into_iter().flatten().max();
        let payload = largest.unwrap_or(1472).clamp(1472, 65_527);
        config.max_udp_payload_size(payload).map_err(|e| config_error("max UDP payload size", e))?;
        Ok(config)
    }

    /// An endpoint on `socket` whose GSO sends fit in one UDP send
    /// ([`gso::BoundedSegments`]): the bound comes from the largest MTU of
    /// the paths that use GSO (1472 bytes where MTU discovery is on: a
    /// safe overestimate, as discovery stops at 1452 by default).
    fn endpoint(
        &self,
        endpoint_config: quinn::EndpointConfig,
        server_config: Option<quinn::ServerConfig>,
        socket: std::net::UdpSocket,
    ) -> std::io::Result<quinn::Endpoint> {
        let runtime = Arc::new(quinn::TokioRuntime);
        let socket = quinn::Runtime::wrap_udp_socket(&*runtime, socket)?;
        let largest_segment = [&self.options.loopback, &self.options.network]
            .into_iter()
            .filter(|path| path.segmentation_offload)
            .map(|path| path.mtu.map_or(1472, usize::from))
            .max()
            .unwrap_or(1472);
        let unit = (endpoint_config.get_max_udp_payload_size() as usize).min(64 << 10);
        let network_datagram = self.options.network.mtu.map_or(1472, usize::from);
        let socket = Arc::new(gso::BoundedSegments::new(socket, largest_segment, unit, network_datagram));
        quinn::Endpoint::new_with_abstract_socket(endpoint_config, server_config, socket, runtime)
    }
}

fn transport_config(options: &QuicOptions, path: &PathTuning) -> Result<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    let idle =
        quinn::IdleTimeout::try_from(options.idle_timeout).map_err(|e| config_error("idle timeout", e))?;
    let window = |what, v: u64| VarInt::from_u64(v).map_err(|e| config_error(what, e));
    t.max_concurrent_bidi_streams(VarInt::from_u32(options.max_concurrent_streams))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(options.keep_alive))
        .stream_receive_window(VarInt::from_u32(options.stream_window))
        .receive_window(window("connection window", options.connection_window)?)
        .send_window(options.send_window)
        .datagram_receive_buffer_size(None)
        .enable_segmentation_offload(path.segmentation_offload);
    if let Some(mtu) = path.mtu {
        let mtu = mtu.clamp(1200, 65_527);
        // Initial datagrams are padded to min_mtu, and a long-header packet's
        // length must stay below 2^14: quinn panics beyond. Short-header
        // (data) packets use the full fixed MTU.
        t.initial_mtu(mtu).min_mtu(mtu.min(16_000)).mtu_discovery_config(None);
        // Cubic's default initial window (14720 bytes) is less than one
        // datagram of a large fixed MTU: the handshake could never start.
        let mut cubic = quinn::congestion::CubicConfig::default();
        cubic.initial_window((10 * u64::from(mtu)).max(14_720));
        t.congestion_controller_factory(Arc::new(cubic));
    }
    Ok(t)
}

/// A UDP socket with the requested buffers, bound to `addr`.
fn udp_socket(addr: SocketAddr, buffer: usize) -> Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let io = |what: &str, source| Error::Io { what: format!("{what} for {addr}"), source };
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| io("open UDP socket", e))?;
    if addr.is_ipv6() {
        // Dual stack where the system allows it; not an error where it does not.
        let _ = socket.set_only_v6(false);
    }
    // Best effort: the kernel caps these at net.core.{r,w}mem_max.
    let _ = socket.set_recv_buffer_size(buffer);
    let _ = socket.set_send_buffer_size(buffer);
    if let Ok(got) = socket.recv_buffer_size() {
        if got < buffer {
            tracing::debug!(asked = buffer, got, "UDP receive buffer capped; raise net.core.rmem_max");
        }
    }
    socket.bind(&addr.into()).map_err(|e| match e.kind() {
        std::io::ErrorKind::AddrInUse => Error::AddrInUse(addr.to_string()),
        _ => io("bind", e),
    })?;
    Ok(socket.into())
}

async fn resolve(addr: &str) -> Result<SocketAddr> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(a);
    }
    let invalid = |reason: String| Error::InvalidAddress { addr: addr.to_string(), reason };
    let mut found =
        tokio::net::lookup_host(addr).await.map_err(|e| invalid(format!("expected HOST:PORT ({e})")))?;
    found.next().ok_or_else(|| invalid("the name resolves to no address".into()))
}

/// Whether a QUIC error code is a TLS alert (certificate refused, no certificate, ...).
fn is_crypto(code: quinn::TransportErrorCode) -> bool {
    (0x100..0x200).contains(&u64::from(code))
}

/// A connection-level failure, typed for the caller.
fn connection_error(addr: &str, e: &quinn::ConnectionError) -> Error {
    use quinn::ConnectionError as E;
    let addr = addr.to_string();
    match e {
        E::ApplicationClosed(_) | E::Reset | E::TimedOut | E::LocallyClosed => Error::Closed { addr },
        E::ConnectionClosed(c) if is_crypto(c.error_code) => Error::Refused { addr, reason: e.to_string() },
        E::TransportError(t) if is_crypto(t.code) => Error::Refused { addr, reason: e.to_string() },
        other => Error::Protocol { addr, reason: other.to_string() },
    }
}

fn read_error(addr: &str, e: quinn::ReadError) -> Error {
    match e {
        quinn::ReadError::ConnectionLost(c) => connection_error(addr, &c),
        other => Error::Protocol { addr: addr.to_string(), reason: format!("reading the stream: {other}") },
    }
}

/// Where a frame read from a stream ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Delimit {
    /// At the stream's end: a one-call stream.
    End,
    /// Where its header's lengths say: a reply on a kept stream.
    Length,
    /// As the header says: at its length for a request with
    /// [`wire::FLAG_KEEP`], else at the stream's end (what a server reads).
    Header,
}

/// How [`read_frame`] reads.
struct Reading<'a> {
    expect: Expect,
    delimit: Delimit,
    config: &'a Config,
    /// A stream that sends nothing for this long fails with [`Error::Stalled`].
    idle: Option<Duration>,
    peer: &'a str,
}

/// A frame read from a stream.
struct Received {
    kind: Kind,
    frame: Frame,
    /// It was a request with [`wire::FLAG_KEEP`]: its stream carries more calls.
    keep: bool,
    /// The frame's bytes on the stream, header included.
    len: u64,
}

/// Read one frame from `recv` (starting with `first`, bytes of it already
/// read), ending where `how.delimit` says. `None`: the stream ended before
/// its first byte. With a `sink`, a response's payload goes to it as it
/// arrives instead of into the frame (an error reply's payload, normally
/// none, is dropped); without, into a buffer from the config's pool.
async fn read_frame(
    recv: &mut quinn::RecvStream,
    how: Reading<'_>,
    mut first: Option<Bytes>,
    mut sink: Option<&mut dyn PayloadSink>,
) -> Result<Option<Received>> {
    let max_message = how.config.options.max_message;
    let mut decoder = match sink {
        None => wire::Decoder::with_pool(how.expect, max_message, how.config.pool.clone()),
        Some(_) => wire::Decoder::streaming(how.expect, max_message),
    };
    let mut started = false;
    let mut any = false;
    loop {
        let chunk = match first.take() {
            Some(bytes) => Some(bytes),
            None => {
                let next = recv.read_chunk(usize::MAX, true);
                let chunk = match how.idle {
                    Some(after) => timeout(after, next)
                        .await
                        .map_err(|_| Error::Stalled { addr: how.peer.to_string(), after })?,
                    None => next.await,
                };
                chunk.map_err(|e| read_error(how.peer, e))?.map(|c| c.bytes)
            }
        };
        let Some(chunk) = chunk else {
            if !any {
                return Ok(None);
            }
            return finished(decoder).map(Some);
        };
        any |= !chunk.is_empty();
        match sink.as_deref_mut() {
            None => decoder.feed(&chunk)?,
            Some(sink) => {
                let payload = decoder.feed_streaming(&chunk)?;
                if let Some(header) = decoder.header() {
                    if header.kind == Kind::Response && !started {
                        sink.start(header.payload_len)?;
                        started = true;
                    }
                }
                if started && !payload.is_empty() {
                    sink.write(payload);
                }
            }
        }
        let ends_here = match how.delimit {
            Delimit::End => false,
            Delimit::Length => true,
            Delimit::Header => decoder.header().is_some_and(|h| h.keep),
        };
        if ends_here && decoder.is_complete() {
            return finished(decoder).map(Some);
        }
    }
}

/// The frame `decoder` has taken in whole (or the error naming what is missing).
fn finished(decoder: wire::Decoder) -> Result<Received> {
    let (keep, len) = decoder
        .header()
        .map_or((false, 0), |h| (h.keep, (wire::HEADER_LEN as u64).saturating_add(h.body_len())));
    let (kind, frame) = decoder.finish()?;
    Ok(Received { kind, frame, keep, len })
}

/// Whether the server stopped reading `send` between calls, so that the
/// request on it was never read: the reply's side ended before its first
/// byte, and the server says why (a retired kept stream, or the bad frame
/// before it) by the code it stopped the stream with. Any other ending (a
/// server that dropped a stream after its handler ran stops it with 0)
/// is not safe to send again.
async fn retired(send: &quinn::SendStream, deadline: Instant) -> bool {
    let code = timeout_at(deadline, send.stopped()).await;
    matches!(code, Ok(Ok(Some(code))) if code == VarInt::from_u32(CODE_RETIRED) || code == VarInt::from_u32(CODE_BAD_FRAME))
}

/// What a stream that ended before its first byte is, where a frame was due.
fn nothing_sent() -> Error {
    Error::Truncated { part: "header", expected: wire::HEADER_LEN as u64, got: 0 }
}

/// Parts of a request up to this many bytes in all are joined into one
/// buffer before sending; larger ones are sent part by part, uncopied.
const JOIN_PARTS_UP_TO: usize = 64 << 10;

/// The largest piece of a frame handed to quinn in one write: a sixteenth
/// of the send window, at least 64 KiB.
///
/// quinn-proto counts a written piece against the send window until the
/// peer has acknowledged all of it (`SendBuffer::buffered` includes the
/// acknowledged front of the oldest piece). A large frame written whole
/// goes in as pieces the size of the free window, so the sender takes no
/// more data until the last packet of the window is acknowledged, and the
/// path drains for a round trip at every window. With pieces a sixteenth
/// of it, the window frees in steps as acknowledgements arrive.
fn piece_len(send_window: u64) -> usize {
    usize::try_from(send_window / 16).unwrap_or(usize::MAX).max(64 << 10)
}

/// `bufs` cut into pieces of at most `piece` bytes (views, no copy), or
/// `None` if none of them is longer.
fn in_pieces(bufs: &[Bytes], piece: usize) -> Option<Vec<Bytes>> {
    if bufs.iter().all(|b| b.len() <= piece) {
        return None;
    }
    let count = bufs.iter().map(|b| b.len().div_ceil(piece)).sum();
    let mut pieces = Vec::with_capacity(count);
    for buf in bufs {
        let mut at = 0;
        while at < buf.len() {
            let end = buf.len().min(at + piece);
            pieces.push(buf.slice(at..end));
            at = end;
        }
    }
    Some(pieces)
}

/// What one call sends, and where its reply's payload goes.
enum Exchange<'a> {
    /// A whole frame's buffers; the reply is kept whole.
    Whole([Bytes; 2]),
    /// The header and metadata, then the payload's parts sent from where
    /// they are; the reply's payload goes to `sink`.
    Parts { head: Bytes, parts: &'a [&'a [u8]], sink: &'a mut dyn PayloadSink },
}

impl Exchange<'_> {
    /// The same exchange again (buffers shared, the sink reborrowed), for a
    /// call that goes again on another stream.
    fn again(&mut self) -> Exchange<'_> {
        match self {
            Exchange::Whole(bufs) => Exchange::Whole(bufs.clone()),
            Exchange::Parts { head, parts, sink } => {
                Exchange::Parts { head: head.clone(), parts, sink: &mut **sink }
            }
        }
    }
}

/// Requests up to this many bytes (metadata and payload) go on kept
/// streams; larger ones on a stream of their own (wire docs, "A kept
/// stream"). A kept stream saves opening, finishing and acknowledging a
/// stream per call, which is a share of a small call's cost and none of a
/// large one's; a large request on a stream of its own keeps its flow
/// control apart from the small calls'.
const KEEP_UP_TO: u64 = 64 << 10;

/// Whether a request of `size` bytes goes on a kept stream.
fn kept(size: u64) -> bool {
    size <= KEEP_UP_TO
}

/// A kept stream that has received this many bytes is retired after its
/// call instead of going back to the pool.
///
/// The receive window of a stream is credited back in steps of an eighth
/// of [`QuicOptions::stream_window`], so a used stream may offer a reply
/// up to that much less than a fresh one: a reply near the window's size
/// (a catch-up's 7.9 MB snapshot part against the default 8 MiB) would
/// then wait a round trip for credit where a fresh stream takes it whole
/// (measured: BENCHMARKS.md, "Kept streams"). A pooled stream has received
/// less than this, so it offers all but this much of the window.
const KEPT_STREAM_BYTES: u64 = 256 << 10;

/// Idle kept streams a client holds per peer at most; a call that finds
/// none opens another, and one that finds the pool full retires its own.
const KEPT_PER_PEER: usize = 16;

/// The pool's bound under a stream limit of `max_concurrent_streams`.
///
/// Each pooled stream counts against the server's limit until the client
/// drops it (a server that retires one stops reading it, but its slot is
/// freed only once the client acts), so the pool takes at most a quarter
/// of the limit and a large call always finds a slot. The server's limit
/// is not known here; the client's own option stands for it, as a job's
/// processes share their options.
fn kept_cap(max_concurrent_streams: u32) -> usize {
    KEPT_PER_PEER.min(max_concurrent_streams as usize / 4).max(1)
}

/// Write all of `bufs`, failing with [`Error::Stalled`] when the peer takes
/// nothing for `idle` (it stopped reading).
async fn write_idle(
    send: &mut quinn::SendStream,
    bufs: &mut [Bytes],
    piece: usize,
    idle: Duration,
    peer: &str,
) -> Result<()> {
    let mut pieces = in_pieces(bufs, piece);
    let mut bufs = match pieces.as_mut() {
        Some(pieces) => pieces.as_mut_slice(),
        None => bufs,
    };
    while !bufs.is_empty() {
        let written = timeout(idle, send.write_chunks(bufs))
            .await
            .map_err(|_| Error::Stalled { addr: peer.to_string(), after: idle })?
            .map_err(|e| Error::Protocol {
                addr: peer.to_string(),
                reason: format!("writing the reply: {e}"),
            })?;
        bufs = &mut bufs[written.chunks..];
    }
    Ok(())
}

/// The transport over QUIC. Cheap to clone; clones share connections.
///
/// Client side: one connection per peer address, opened on the first call
/// and reused; a dead connection (closed by the peer, reset by a restarted
/// peer, idle-timed-out, or silent through a whole call) is dropped and the
/// next call dials again. Calls whose request is at most 64 KiB go on
/// *kept streams* (see [`wire`]): a pool of up to 16 streams per peer (a
/// quarter of [`QuicOptions::max_concurrent_streams`] at most), each
/// carrying one call after another, so that a small call does not open,
/// finish and wait out the acknowledgement of a stream of its own. A
/// stream still carries one call at a time, so a large transfer never
/// holds up a small call, and one that has carried 256 KiB of replies is
/// retired after its call. A call that times out resets its stream, and
/// one that fails other than by the handler's error drops it, so a late
/// reply never answers the next call. A stream the server retired between
/// calls (idle, or closing) sends the call again on a fresh stream, once:
/// safe, because the server stops a stream it retires with a code of its
/// own before reading the request; a stream that ended any other way fails
/// the call. Larger requests get a stream of their own. Server side: see
/// [`QuicTransport::serve`].
#[derive(Clone)]
pub struct QuicTransport {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<Config>,
    client_v4: OnceCell<quinn::Endpoint>,
    client_v6: OnceCell<quinn::Endpoint>,
    peers: Mutex<HashMap<SocketAddr, Arc<Peer>>>,
}

/// A client's stream for calls one after another (wire docs, "A kept stream").
struct KeptStream {
    /// Its connection's `stable_id`.
    conn: usize,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    /// Reply bytes it has carried (0: fresh).
    received: u64,
}

/// The connection to one peer address, shared by every [`Connection`] to it.
struct Peer {
    addr: SocketAddr,
    addr_text: String,
    current: Mutex<Option<quinn::Connection>>,
    dialing: tokio::sync::Mutex<()>,
    /// Idle kept streams.
    kept: Mutex<Vec<KeptStream>>,
    /// At most this many in `kept`.
    kept_cap: usize,
}

impl Peer {
    fn live(&self) -> Option<quinn::Connection> {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.as_ref().filter(|c| c.close_reason().is_none()).cloned()
    }

    /// Drop `conn` from the cache (unless a newer one already replaced it),
    /// and its kept streams.
    fn forget(&self, conn: &quinn::Connection) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.as_ref().is_some_and(|c| c.stable_id() == conn.stable_id()) {
            *current = None;
        }
        drop(current);
        self.kept.lock().unwrap_or_else(PoisonError::into_inner).retain(|k| k.conn != conn.stable_id());
    }

    /// An idle kept stream of `conn` the server has not retired; those of
    /// other (older) connections, and retired ones, are dropped.
    fn take_kept(&self, conn: &quinn::Connection) -> Option<KeptStream> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|k| k.conn == conn.stable_id());
        // Only the streams taken are asked whether they were retired: each
        // question takes the connection's lock.
        while let Some(stream) = kept.pop() {
            if !settled(&stream.send) {
                return Some(stream);
            }
        }
        None
    }

    /// Put a kept stream of `conn` back after a call, or retire it (end our
    /// side at the frame boundary) if the pool is full, `conn` is no longer
    /// the peer's connection, or the stream has received
    /// [`KEPT_STREAM_BYTES`].
    fn keep(&self, conn: &quinn::Connection, mut stream: KeptStream) {
        let current = self.live().is_some_and(|c| c.stable_id() == conn.stable_id());
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if current && stream.received < KEPT_STREAM_BYTES && kept.len() < self.kept_cap {
            kept.push(stream);
        } else {
            drop(kept);
            let _ = stream.send.finish();
        }
    }
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport").field("options", &self.inner.config.options).finish_non_exhaustive()
    }
}

impl QuicTransport {
    /// A transport with identity `tls` and default options.
    pub fn new(tls: TlsConfig) -> Result<QuicTransport> {
        QuicTransport::with_options(tls, QuicOptions::default())
    }

    /// A transport with identity `tls` and `options`.
    pub fn with_options(tls: TlsConfig, options: QuicOptions) -> Result<QuicTransport> {
        crate::malloc::raise_thresholds(options.glibc_mmap_threshold);
        let config = Arc::new(Config::new(tls, options)?);
        Ok(QuicTransport {
            inner: Arc::new(Inner {
                config,
                client_v4: OnceCell::new(),
                client_v6: OnceCell::new(),
                peers: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// How many peers this transport holds a live client connection to.
    pub fn live_connections(&self) -> usize {
        let peers = self.inner.peers.lock().unwrap_or_else(PoisonError::into_inner);
        peers.values().filter(|p| p.live().is_some()).count()
    }

    /// How many idle kept streams (streams that carry one small call after
    /// another, see [`wire`]) this transport's client side holds ready, over
    /// all peers: at most 16 per peer (fewer under a small
    /// [`QuicOptions::max_concurrent_streams`]), and not counting those
    /// the server has retired.
    pub fn idle_kept_streams(&self) -> usize {
        let peers = self.inner.peers.lock().unwrap_or_else(PoisonError::into_inner);
        let usable = |p: &Arc<Peer>| {
            let kept = p.kept.lock().unwrap_or_else(PoisonError::into_inner);
            kept.iter().filter(|k| !settled(&k.send)).count()
        };
        peers.values().map(usable).sum()
    }

    /// The options in force.
    pub fn options(&self) -> &QuicOptions {
        &self.inner.config.options
    }

    /// Serve `handler` at `addr` ("IP:PORT", port 0 for any): the concrete
    /// listener, whose [`QuicListener::wait_closed`] waits for a graceful close.
    ///
    /// Each connection is served by its own task, which runs each call as
    /// far as it goes without waiting and hands a call that has to wait to
    /// a task of its own. A kept stream's calls after its first are served
    /// by a task of the stream's own, which retires the stream once it has
    /// sat idle for [`QuicOptions::stream_idle_timeout`], and at a close.
    /// A request that is malformed, too large or stalls
    /// longer than [`QuicOptions::stream_idle_timeout`] gets an error reply
    /// and costs nothing else. Handler errors go back as [`RemoteError`]s,
    /// and a handler that panics is reported as an internal error.
    pub async fn serve(&self, addr: &str, handler: Arc<dyn Handler>) -> Result<QuicListener> {
        let config = self.inner.config.clone();
        let bind = resolve(addr).await?;
        let socket = udp_socket(bind, config.options.socket_buffer)?;
        let local = socket
            .local_addr()
            .map_err(|source| Error::Io { what: format!("read the address of {addr}"), source })?;
        let local_text = local.to_string();
        let endpoint_config = config.endpoint_config(Some(config.tls.restart_secret(&local_text)))?;
        let endpoint = config
            .endpoint(endpoint_config, Some((*config.server_network).clone()), socket)
            .map_err(|source| Error::Io { what: format!("start a QUIC endpoint at {local}"), source })?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let (done_tx, done_rx) = watch::channel(false);
        tokio::spawn(accept_loop(endpoint, handler, config, shutdown_rx, done_tx));
        tracing::debug!(addr = %local_text, "QUIC listener started");
        Ok(QuicListener { local_addr: local_text, shutdown: shutdown_tx, done: done_rx })
    }

    /// Close every client connection of this transport (calls in flight fail
    /// with [`Error::Closed`]); later calls dial again.
    pub fn close(&self) {
        let peers: Vec<Arc<Peer>> = {
            let peers = self.inner.peers.lock().unwrap_or_else(PoisonError::into_inner);
            peers.values().cloned().collect()
        };
        for peer in peers {
            peer.kept.lock().unwrap_or_else(PoisonError::into_inner).clear();
            if let Some(conn) = peer.current.lock().unwrap_or_else(PoisonError::into_inner).take() {
                conn.close(VarInt::from_u32(CODE_SHUTDOWN), b"client closing");
            }
        }
    }

    /// Close, then wait (at most `limit`) until the peers have been told.
    pub async fn close_and_wait(&self, limit: Duration) {
        self.close();
        let wait = async {
            for cell in [&self.inner.client_v4, &self.inner.client_v6] {
                if let Some(endpoint) = cell.get() {
                    endpoint.wait_idle().await;
                }
            }
        };
        let _ = timeout(limit, wait).await;
    }

    async fn client_endpoint(&self, ipv4: bool) -> Result<quinn::Endpoint> {
        let (cell, bind): (_, SocketAddr) = if ipv4 {
            (&self.inner.client_v4, (std::net::Ipv4Addr::UNSPECIFIED, 0).into())
        } else {
            (&self.inner.client_v6, (std::net::Ipv6Addr::UNSPECIFIED, 0).into())
        };
        let config = &self.inner.config;
        cell.get_or_try_init(|| async {
            let socket = udp_socket(bind, config.options.socket_buffer)?;
            config
                .endpoint(config.endpoint_config(None)?, None, socket)
                .map_err(|source| Error::Io { what: "start the QUIC client endpoint".into(), source })
        })
        .await
        .cloned()
    }

    fn peer(&self, addr: SocketAddr) -> Arc<Peer> {
        let mut peers = self.inner.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if !peers.contains_key(&addr) {
            // A new address: forget those no handle uses any more whose
            // connection is closed (a restarted peer comes back on a new
            // port, so a long job would otherwise keep one per restart,
            // each holding its closed connection's state).
            peers.retain(|_, peer| Arc::strong_count(peer) > 1 || peer.live().is_some());
        }
        peers
            .entry(addr)
            .or_insert_with(|| {
                Arc::new(Peer {
                    addr,
                    addr_text: addr.to_string(),
                    current: Mutex::new(None),
                    dialing: tokio::sync::Mutex::new(()),
                    kept: Mutex::new(Vec::new()),
                    kept_cap: kept_cap(self.inner.config.options.max_concurrent_streams),
                })
            })
            .clone()
    }

    /// The live connection to `peer`, dialing one if needed, by `deadline`.
    async fn connection(&self, peer: &Peer, deadline: Instant) -> Result<quinn::Connection> {
        if let Some(conn) = peer.live() {
            return Ok(conn);
        }
        let unreachable = || Error::Unreachable { addr: peer.addr_text.clone() };
        let _dialing = timeout_at(deadline, peer.dialing.lock()).await.map_err(|_| unreachable())?;
        if let Some(conn) = peer.live() {
            return Ok(conn);
        }
        let config = &self.inner.config;
        let endpoint = self.client_endpoint(peer.addr.is_ipv4()).await?;
        let client_config = if peer.addr.ip().is_loopback() {
            config.client_loopback.clone()
        } else {
            config.client_network.clone()
        };
        let connecting = endpoint
            .connect_with(client_config, peer.addr, config.tls.server_name())
            .map_err(|e| Error::Protocol { addr: peer.addr_text.clone(), reason: e.to_string() })?;
        let limit = deadline.min(crate::deadline_in(config.options.connect_timeout));
        let conn = match timeout_at(limit, connecting).await {
            Err(_) => return Err(unreachable()),
            Ok(Err(e)) => return Err(connection_error(&peer.addr_text, &e)),
            Ok(Ok(conn)) => conn,
        };
        tracing::debug!(peer = %peer.addr_text, "QUIC connection established");
        *peer.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }
}

/// A client's handle on one peer address.
struct QuicConnection {
    transport: QuicTransport,
    peer: Arc<Peer>,
}

impl QuicConnection {
    /// One exchange on `send` and `recv`: on a kept stream (`keep`) the
    /// request is not finished and the reply ends at its length, whose
    /// bytes are added to `received`. `None`: the reply's side ended before
    /// its first byte.
    async fn exchange(
        &self,
        send: &mut quinn::SendStream,
        recv: &mut quinn::RecvStream,
        exchange: Exchange<'_>,
        keep: bool,
        received: &mut u64,
    ) -> Result<Option<Frame>> {
        let addr = &self.peer.addr_text;
        let piece = piece_len(self.transport.inner.config.options.send_window);
        let (sent, sink) = match exchange {
            Exchange::Whole(mut bufs) => {
                let sent = match in_pieces(&bufs, piece) {
                    Some(mut pieces) => send.write_all_chunks(&mut pieces).await,
                    None => send.write_all_chunks(&mut bufs).await,
                };
                (sent, None)
            }
            Exchange::Parts { head, parts, sink } => {
                let total: usize = parts.iter().map(|p| p.len()).sum();
                let sent = if total <= JOIN_PARTS_UP_TO {
                    // Copying a few KiB costs less than handing quinn each
                    // part on its own (a driver wake-up per write).
                    let mut joined = bytes::BytesMut::with_capacity(head.len() + total);
                    joined.extend_from_slice(&head);
                    parts.iter().for_each(|p| joined.extend_from_slice(p));
                    send.write_all_chunks(&mut [joined.freeze()]).await
                } else {
                    let mut sent = send.write_chunk(head).await;
                    for part in parts.iter().flat_map(|part| part.chunks(piece)) {
                        if sent.is_err() {
                            break;
                        }
                        sent = send.write_all(part).await;
                    }
                    sent
                };
                (sent, Some(sink))
            }
        };
        match sent {
            Ok(()) if keep => {}
            Ok(()) => {
                let _ = send.finish();
            }
            // The server stopped reading (it refused the request early, or
            // retired a kept stream): its error reply, if any, is still to
            // be read.
            Err(quinn::WriteError::Stopped(_)) => {}
            Err(quinn::WriteError::ConnectionLost(e)) => return Err(connection_error(addr, &e)),
            Err(e) => {
                return Err(Error::Protocol {
                    addr: addr.clone(),
                    reason: format!("sending the request: {e}"),
                })
            }
        }
        let how = Reading {
            expect: Expect::Reply,
            delimit: if keep { Delimit::Length } else { Delimit::End },
            config: &self.transport.inner.config,
            idle: None,
            peer: addr,
        };
        let Some(Received { kind, frame, len, .. }) = read_frame(recv, how, None, sink).await? else {
            return Ok(None);
        };
        *received = received.saturating_add(len);
        match kind {
            Kind::Response => Ok(Some(frame)),
            Kind::Error => Err(Error::Remote { addr: addr.clone(), error: frame.meta::<RemoteError>()? }),
            Kind::Request => Err(Error::BadKind { expected: "a reply", got: Kind::Request as u8 }),
        }
    }
}

#[async_trait]
impl Connection for QuicConnection {
    async fn call(&self, request: Frame, call_timeout: Duration) -> Result<Frame> {
        self.check_size(request.meta.len(), request.payload.len() as u64)?;
        let keep = kept(request.meta.len() as u64 + request.payload.len() as u64);
        let header = wire::Header { keep, ..wire::Header::of(Kind::Request, &request)? };
        let bufs = wire::encode_with(header, &request);
        self.run(Exchange::Whole(bufs), keep, call_timeout).await
    }

    async fn call_parts(
        &self,
        method: u16,
        meta: Bytes,
        payload: &[&[u8]],
        sink: &mut dyn PayloadSink,
        call_timeout: Duration,
    ) -> Result<Frame> {
        let payload_len = payload.iter().map(|p| p.len() as u64).sum();
        self.check_size(meta.len(), payload_len)?;
        let keep = kept(meta.len() as u64 + payload_len);
        let frame = Frame { method, meta, payload: Bytes::new() };
        let header = wire::Header { payload_len, keep, ..wire::Header::of(Kind::Request, &frame)? };
        let [head, _] = wire::encode_with(header, &frame);
        self.run(Exchange::Parts { head, parts: payload, sink }, keep, call_timeout).await
    }

    fn peer(&self) -> &str {
        &self.peer.addr_text
    }
}

impl QuicConnection {
    /// Refuse a request over the message limit before sending anything.
    fn check_size(&self, meta: usize, payload: u64) -> Result<()> {
        let max = self.transport.inner.config.options.max_message;
        let size = meta as u64 + payload;
        if size > max {
            return Err(Error::TooLarge { meta: meta as u64, payload, claimed: size, max });
        }
        Ok(())
    }

    /// Make one call: take a kept stream (`keep`) or open a stream (dialing
    /// again once if the cached connection is dead), exchange, and clean up
    /// on a timeout.
    async fn run(&self, mut exchange: Exchange<'_>, keep: bool, call_timeout: Duration) -> Result<Frame> {
        // A timeout too long for the clock's range (Duration::MAX) is a
        // deadline decades away, not a panic.
        let deadline = crate::deadline_in(call_timeout);
        let addr = &self.peer.addr_text;
        // A kept stream the server retired while it sat in the pool (it
        // stops reading and ends its side at a frame boundary, before
        // reading a request) fails the call before the request was
        // handled: the call goes again on a fresh stream, once.
        let mut reuse = keep;
        loop {
            let (conn, mut stream) = self.stream(reuse, deadline, call_timeout).await?;
            let reused = stream.received > 0;
            let rx_before = conn.stats().udp_rx.datagrams;
            let started = Instant::now();
            let KeptStream { send, recv, received, .. } = &mut stream;
            let result =
                timeout_at(deadline, self.exchange(send, recv, exchange.again(), keep, received)).await;
            match result {
                Ok(Ok(Some(frame))) => {
                    if keep {
                        self.peer.keep(&conn, stream);
                    }
                    return Ok(frame);
                }
                Ok(Ok(None)) if reused && retired(&stream.send, deadline).await => reuse = false,
                Ok(Ok(None)) => return Err(nothing_sent()),
                // The handler's error (a redirect, a stale shard map): the
                // stream carries on. Were it a bad frame's reply, the server
                // has retired the stream, and its next call goes again.
                Ok(Err(e @ Error::Remote { .. })) => {
                    if keep {
                        self.peer.keep(&conn, stream);
                    }
                    return Err(e);
                }
                Ok(Err(e)) => {
                    if conn.close_reason().is_some() {
                        self.peer.forget(&conn);
                    }
                    return Err(e);
                }
                Err(_) => {
                    let _ = stream.send.reset(VarInt::from_u32(CODE_CANCELLED));
                    let _ = stream.recv.stop(VarInt::from_u32(CODE_CANCELLED));
                    // Nothing at all came back during a whole call (not even an
                    // acknowledgement): the peer is gone, e.g. restarted with
                    // another key. Dial afresh next time instead of waiting for
                    // the idle timeout.
                    let silent = conn.stats().udp_rx.datagrams == rx_before;
                    if silent && started.elapsed() >= Duration::from_millis(200) {
                        tracing::debug!(peer = %addr, "peer silent for a whole call; dropping the connection");
                        self.peer.forget(&conn);
                        conn.close(VarInt::from_u32(CODE_SHUTDOWN), b"peer silent");
                    }
                    return Err(Error::Timeout { addr: addr.clone(), after: call_timeout });
                }
            }
        }
    }

    /// A stream for one call (its `received` is 0 if fresh): with `reuse`,
    /// a kept stream of the live connection if the pool has one, else a
    /// fresh stream. A cached connection found dead when
    /// opening the stream is replaced once: nothing was sent on it, so
    /// dialing again is safe.
    async fn stream(
        &self,
        reuse: bool,
        deadline: Instant,
        call_timeout: Duration,
    ) -> Result<(quinn::Connection, KeptStream)> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let conn = self.transport.connection(&self.peer, deadline).await?;
            if reuse {
                if let Some(stream) = self.peer.take_kept(&conn) {
                    return Ok((conn, stream));
                }
            }
            match timeout_at(deadline, conn.open_bi()).await {
                Err(_) => {
                    return Err(Error::Timeout { addr: self.peer.addr_text.clone(), after: call_timeout })
                }
                Ok(Ok((send, recv))) => {
                    let stream = KeptStream { conn: conn.stable_id(), send, recv, received: 0 };
                    return Ok((conn, stream));
                }
                Ok(Err(e)) => {
                    self.peer.forget(&conn);
                    if attempt >= 2 {
                        return Err(connection_error(&self.peer.addr_text, &e));
                    }
                }
            }
        }
    }
}

#[async_trait]
impl Transport for QuicTransport {
    async fn connect(&self, addr: &str) -> Result<Arc<dyn Connection>> {
        let addr = resolve(addr).await?;
        Ok(Arc::new(QuicConnection { transport: self.clone(), peer: self.peer(addr) }))
    }

    async fn listen(&self, addr: &str, handler: Arc<dyn Handler>) -> Result<Box<dyn Listener>> {
        Ok(Box::new(self.serve(addr, handler).await?))
    }
}

/// A QUIC server endpoint. [`Listener::close`] (or dropping it) stops
/// accepting connections and streams; calls already running finish
/// (for at most [`QuicOptions::close_grace`] after the close), then
/// connections are closed and the port is released.
pub struct QuicListener {
    local_addr: String,
    shutdown: watch::Sender<bool>,
    done: watch::Receiver<bool>,
}

impl std::fmt::Debug for QuicListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicListener").field("local_addr", &self.local_addr).finish_non_exhaustive()
    }
}

impl QuicListener {
    /// Wait until a close has finished: running calls done, peers told, socket released.
    pub async fn wait_closed(&self) {
        let mut done = self.done.clone();
        let _ = done.wait_for(|d| *d).await;
    }
}

impl Listener for QuicListener {
    fn local_addr(&self) -> &str {
        &self.local_addr
    }

    fn close(&self) {
        self.shutdown.send_replace(true);
    }
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        self.close();
    }
}

/// Resolves once shutdown is signalled (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

/// Accept connections until shutdown, then drain and close.
async fn accept_loop(
    endpoint: quinn::Endpoint,
    handler: Arc<dyn Handler>,
    config: Arc<Config>,
    shutdown: watch::Receiver<bool>,
    done: watch::Sender<bool>,
) {
    // Every connection and stream task holds a clone; when all are gone, the drain is over.
    let (tracker, mut drained) = mpsc::channel::<()>(1);
    let mut stop = shutdown.clone();
    loop {
        tokio::select! {
            _ = stopped(&mut stop) => break,
            incoming = endpoint.accept() => match incoming {
                None => break,
                Some(incoming) => {
                    let task = serve_connection(incoming, handler.clone(), config.clone(), shutdown.clone(), tracker.clone());
                    tokio::spawn(task);
                }
            },
        }
    }
    endpoint.set_server_config(None);
    drop(tracker);
    let grace = config.options.close_grace;
    if timeout(grace, drained.recv()).await.is_err() {
        tracing::warn!("calls still running {grace:?} after close; closing anyway");
    }
    endpoint.close(VarInt::from_u32(CODE_SHUTDOWN), b"server closing");
    let _ = timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    drop(endpoint);
    done.send_replace(true);
}

/// Serve one connection's streams until it ends or shutdown, then wait for
/// the replies not yet acknowledged.
///
/// A call whose reply is written in the first poll (most small calls) is
/// served here, in the connection's task, and its stream joins
/// [`Unacked`] until the peer has acknowledged the reply: no task is
/// spawned and no other worker woken per call. A call that has to wait
/// (for more request bytes, a slow handler, flow control) moves to a task
/// of its own, so that it never holds up the connection's other calls.
async fn serve_connection(
    incoming: quinn::Incoming,
    handler: Arc<dyn Handler>,
    config: Arc<Config>,
    mut shutdown: watch::Receiver<bool>,
    tracker: mpsc::Sender<()>,
) {
    let remote = incoming.remote_address();
    let server_config = if remote.ip().is_loopback() {
        config.server_loopback.clone()
    } else {
        config.server_network.clone()
    };
    let connecting = match incoming.accept_with(server_config) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(%remote, "incoming connection failed: {e}");
            return;
        }
    };
    let conn = match timeout(config.options.connect_timeout, connecting).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            // Most often a peer without a certificate from the job's CA.
            tracing::warn!(%remote, "QUIC handshake failed: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!(%remote, "QUIC handshake timed out");
            return;
        }
    };
    let peer: Arc<str> = remote.to_string().into();
    let idle = config.options.stream_idle_timeout;
    let mut unacked = Unacked::new();
    loop {
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            stream = conn.accept_bi() => match stream {
                Ok((send, recv)) => {
                    let mut call = Box::pin(answer(send, recv, None, handler.clone(), config.clone(), peer.clone()));
                    // Made only for a call that leaves this task.
                    let serving = || Serving {
                        handler: handler.clone(),
                        config: config.clone(),
                        peer: peer.clone(),
                        shutdown: shutdown.clone(),
                    };
                    match std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await {
                        Poll::Ready(Answered::Finished(send)) => unacked.push(send),
                        Poll::Ready(Answered::Gone) => {}
                        Poll::Ready(Answered::Kept(send, recv)) => {
                            let (tracker, serving) = (tracker.clone(), serving());
                            tokio::spawn(async move {
                                serving.kept_stream(send, recv).await;
                                drop(tracker);
                            });
                        }
                        Poll::Pending => {
                            let (tracker, serving) = (tracker.clone(), serving());
                            tokio::spawn(async move {
                                match call.await {
                                    Answered::Finished(send) => acknowledged(send, idle).await,
                                    Answered::Kept(send, recv) => serving.kept_stream(send, recv).await,
                                    Answered::Gone => {}
                                }
                                drop(tracker);
                            });
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(%peer, "connection ended: {e}");
                    break;
                }
            },
        }
    }
    // This task holds a tracker, so a graceful close waits for these too
    // (within the idle deadline; at once if the connection is gone).
    unacked.drain(idle).await;
}

/// Replies a connection's task finished whose acknowledgement may still be
/// due, kept so that a graceful close can wait for them.
///
/// They are not waited on one by one: a future per reply woke the
/// connection's task once more per call (and `FuturesUnordered` yielded,
/// waking the other worker). Acknowledged ones are dropped in batches
/// instead, each time the list has doubled since the last batch. Until its
/// reply is acknowledged a stream still counts against the
/// [`QuicOptions::max_concurrent_streams`] the peer may open, so the list
/// holds at most twice that many (or 32).
struct Unacked {
    streams: Vec<quinn::SendStream>,
    /// Drop the acknowledged ones when the list is this long.
    prune_at: usize,
}

impl Unacked {
    /// The shortest list that is pruned.
    const PRUNE_FROM: usize = 32;

    fn new() -> Unacked {
        Unacked { streams: Vec::new(), prune_at: Unacked::PRUNE_FROM }
    }

    fn push(&mut self, send: quinn::SendStream) {
        if self.streams.len() >= self.prune_at {
            self.streams.retain(|s| !settled(s));
            self.prune_at = (2 * self.streams.len()).max(Unacked::PRUNE_FROM);
        }
        self.streams.push(send);
    }

    /// Wait until every reply is acknowledged (or stopped by the peer, or
    /// the connection is gone), at most `limit` in all.
    async fn drain(self, limit: Duration) {
        let _ =
            timeout(limit, futures_util::future::join_all(self.streams.iter().map(|s| s.stopped()))).await;
    }
}

/// Whether `send` needs no more waiting: the peer acknowledged all of it,
/// or stopped it, or the connection is gone. Polls once, never waits.
fn settled(send: &quinn::SendStream) -> bool {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::pin!(send.stopped()).poll(&mut cx).is_ready()
}

/// How a call on a stream ended on the server's side.
enum Answered {
    /// The reply is written and the stream finished: its acknowledgement
    /// may still be due (see [`acknowledged`]).
    Finished(quinn::SendStream),
    /// A call on a kept stream, answered: the stream's next request is
    /// still to be read.
    Kept(quinn::SendStream, quinn::RecvStream),
    /// The reply was abandoned (its stream reset): nothing to wait for.
    Gone,
}

/// Serve one call up to its reply being written (and, but on a kept
/// stream, finished). `first`: bytes of the request already read, on a
/// kept stream (which must not be empty: a kept stream that ends at a
/// frame boundary is [`Serving::kept_stream`]'s to finish).
async fn answer(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    first: Option<Bytes>,
    handler: Arc<dyn Handler>,
    config: Arc<Config>,
    peer: Arc<str>,
) -> Answered {
    let idle = config.options.stream_idle_timeout;
    let how = Reading {
        expect: Expect::Request,
        delimit: Delimit::Header,
        config: &config,
        idle: Some(idle),
        peer: &peer,
    };
    let request = read_frame(&mut recv, how, first, None).await.and_then(|r| r.ok_or_else(nothing_sent));
    let mut keep = false;
    let (kind, reply) = match request {
        Ok(request) => {
            keep = request.keep;
            let method = request.frame.method;
            match std::panic::AssertUnwindSafe(handler.handle_parts(request.frame)).catch_unwind().await {
                Ok(Ok(reply)) => (Kind::Response, reply),
                Ok(Err(error)) => (Kind::Error, error_frame(method, &error).into()),
                Err(_) => {
                    (Kind::Error, error_frame(method, &RemoteError::internal("the handler panicked")).into())
                }
            }
        }
        Err(e) => {
            tracing::debug!(%peer, "bad request: {e}");
            let _ = recv.stop(VarInt::from_u32(CODE_BAD_FRAME));
            (Kind::Error, error_frame(0, &RemoteError::from(e)).into())
        }
    };
    let mut bufs = match encode_parts(kind, reply) {
        Ok(bufs) => bufs,
        Err((method, e)) => {
            let error = RemoteError::internal(format!("cannot encode the reply: {e}"));
            match wire::encode(Kind::Error, &error_frame(method, &error)) {
                Ok(bufs) => bufs.to_vec(),
                Err(_) => {
                    // A reset, not the end a dropped stream sends: the
                    // handler ran, so the client must not send it again.
                    let _ = send.reset(VarInt::from_u32(CODE_STALLED));
                    return Answered::Gone;
                }
            }
        }
    };
    let piece = piece_len(config.options.send_window);
    match write_idle(&mut send, &mut bufs, piece, idle, &peer).await {
        Ok(()) if keep => Answered::Kept(send, recv),
        Ok(()) => {
            let _ = send.finish();
            Answered::Finished(send)
        }
        Err(e) => {
            tracing::debug!(%peer, "reply not delivered: {e}");
            let _ = send.reset(VarInt::from_u32(CODE_STALLED));
            Answered::Gone
        }
    }
}

/// What a task serving a kept stream needs.
struct Serving {
    handler: Arc<dyn Handler>,
    config: Arc<Config>,
    peer: Arc<str>,
    shutdown: watch::Receiver<bool>,
}

impl Serving {
    /// Serve a kept stream's calls, one after another, until the client
    /// ends it or resets it. The stream is retired (reading stopped, our
    /// side finished, both at a frame boundary) at shutdown or once it has
    /// sat idle for [`QuicOptions::stream_idle_timeout`], so that an idle
    /// client holds no task here for long (the stream's slot is freed once
    /// the client takes or drops it); the client then sends its next call
    /// on a fresh stream.
    async fn kept_stream(mut self, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
        let idle = self.config.options.stream_idle_timeout;
        loop {
            // A request already here is served, even at shutdown.
            let next = tokio::select! {
                biased;
                chunk = timeout(idle, recv.read_chunk(usize::MAX, true)) => match chunk {
                    Err(_) => None,
                    Ok(Ok(chunk)) => Some(chunk.map(|c| c.bytes)),
                    // Reset by the client (a call it gave up on), or the connection is gone.
                    Ok(Err(_)) => return,
                },
                _ = stopped(&mut self.shutdown) => None,
            };
            let first = match next {
                None => {
                    let _ = recv.stop(VarInt::from_u32(CODE_RETIRED));
                    let _ = send.finish();
                    return acknowledged(send, idle).await;
                }
                // The client ended the stream between calls.
                Some(None) => {
                    let _ = send.finish();
                    return acknowledged(send, idle).await;
                }
                Some(Some(first)) => first,
            };
            let call =
                answer(send, recv, Some(first), self.handler.clone(), self.config.clone(), self.peer.clone());
            match call.await {
                Answered::Kept(s, r) => (send, recv) = (s, r),
                Answered::Finished(send) => return acknowledged(send, idle).await,
                Answered::Gone => return,
            }
        }
    }
}

/// The buffers to send for `frame` as `kind`: the header and metadata,
/// then the payload's parts as they are. On error, the frame's method too.
fn encode_parts(kind: Kind, frame: FrameParts) -> std::result::Result<Vec<Bytes>, (u16, Error)> {
    let FrameParts { method, meta, payload } = frame;
    let payload_len = payload.iter().map(|p| p.len() as u64).sum();
    let head = Frame { method, meta, payload: Bytes::new() };
    let header = wire::Header::of(kind, &head).map_err(|e| (method, e))?;
    let [head, _] = wire::encode_with(wire::Header { payload_len, ..header }, &head);
    let mut bufs = Vec::with_capacity(1 + payload.len());
    bufs.push(head);
    bufs.extend(payload.into_iter().filter(|p| !p.is_empty()));
    Ok(bufs)
}

/// Wait until the peer has acknowledged the whole reply on `send` (or is
/// gone), at most `idle`. Whoever awaits this holds a tracker, so that a
/// graceful close never cuts a reply short.
async fn acknowledged(send: quinn::SendStream, idle: Duration) {
    let _ = timeout(idle, send.stopped()).await;
}

fn error_frame(method: u16, error: &RemoteError) -> Frame {
    // Encoding a RemoteError cannot fail; an empty metadata would be decoded as an error anyway.
    Frame::new(method, error, Bytes::new()).unwrap_or(Frame {
        method,
        meta: Bytes::new(),
        payload: Bytes::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_pool_takes_at_most_a_quarter_of_the_stream_limit() {
        assert_eq!(kept_cap(256), KEPT_PER_PEER);
        assert_eq!(kept_cap(64), 16);
        assert_eq!(kept_cap(16), 4);
        assert_eq!(kept_cap(3), 1);
        assert_eq!(kept_cap(0), 1);
    }

    #[test]
    fn a_new_peer_address_prunes_those_unused_and_not_connected() {
        let ca = crate::DevCa::new().expect("dev CA");
        let transport = QuicTransport::new(ca.tls_config("client").expect("tls")).expect("transport");
        let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let held = transport.peer(addr(1));
        drop(transport.peer(addr(2)));
        drop(transport.peer(addr(2))); // a known address: nothing is pruned
        let _new = transport.peer(addr(3));
        let mut known: Vec<SocketAddr> =
            transport.inner.peers.lock().unwrap_or_else(PoisonError::into_inner).keys().copied().collect();
        known.sort();
        assert_eq!(known, [addr(1), addr(3)], "the unused, unconnected address 2 is forgotten");
        drop(held);
    }

    #[test]
    fn pieces_are_a_sixteenth_of_the_send_window_and_at_least_64_kib() {
        assert_eq!(piece_len(4 << 20), 256 << 10);
        assert_eq!(piece_len(16 << 20), 1 << 20);
        assert_eq!(piece_len(256 << 10), 64 << 10);
        assert_eq!(piece_len(0), 64 << 10);
    }

    #[test]
    fn frames_are_cut_into_views_in_order_and_short_ones_left_alone() {
        let head = Bytes::from_static(b"0123456789");
        let payload = Bytes::from((0..=255u8).cycle().take(1000).collect::<Vec<u8>>());
        assert!(in_pieces(&[head.clone(), payload.clone()], 1000).is_none());

        let pieces = in_pieces(&[head.clone(), payload.clone(), Bytes::new()], 300).unwrap();
        let lens: Vec<usize> = pieces.iter().map(Bytes::len).collect();
        assert_eq!(lens, [10, 300, 300, 300, 100]);
        assert_eq!(pieces.concat(), [&head[..], &payload[..]].concat());
        // Views of the payload's buffer, not copies.
        assert_eq!(pieces[1].as_ptr(), payload.as_ptr());
        assert_eq!(pieces[4].as_ptr(), payload[900..].as_ptr());
    }
}
