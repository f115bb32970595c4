//! oar's async shell over quinn-proto, the sans-IO QUIC state machine.
//!
//! quinn's own shell runs an endpoint task that reads the socket and hands
//! each datagram over a channel to a task per connection, which decrypts
//! it, wakes the stream's reader, and alone sends: a small call's round
//! trip crossed six task wake-ups where a TCP echo crosses two
//! (BENCHMARKS.md, "The floor under a small call"). This shell keeps one
//! endpoint's whole state (quinn-proto's endpoint and every connection)
//! under one lock, and lets whoever touches it do the I/O:
//!
//! - **Sending** happens in the caller's task, right after it writes,
//!   finishes, stops or reads (a read may owe the peer flow-control credit).
//! - **Receiving** is done by whoever waits. A task that must wait for its
//!   stream (data, a new stream, flow control, a handshake) first reads
//!   whatever the socket holds, feeds it to quinn-proto, and wakes the
//!   tasks whose streams moved; if its own stream still has to wait, it
//!   registers *its own* waker for the socket's readiness and sleeps. The
//!   next datagram then wakes the waiting caller directly, as a TCP
//!   socket's would: two wake-ups per round trip.
//! - **A driver task** per endpoint does the rest: it runs quinn-proto's
//!   timers (loss detection, delayed ACKs, keep-alives, idle timeouts),
//!   waits for the socket to take more when a send would block, and reads
//!   the socket whenever no caller is waiting on it. When the task that
//!   was waiting on the socket stops waiting (its stream moved, or its
//!   future was dropped), the socket's readiness goes back to the driver.
//!
//! Only one waker can wait on a tokio socket's readiness, so at most one
//! task is the socket's *poller* at a time; any other waiting task sleeps
//! on its own stream and is woken by whoever reads the datagram for it.
//! Datagrams are read in batches (GRO and `recvmmsg` through quinn-udp),
//! and a send that carries several datagrams is one GSO `sendmsg` where the
//! path allows it.

use bytes::{Bytes, BytesMut};
use quinn_proto::{
    self as proto, ClientConfig, ConnectionError, ConnectionHandle, DatagramEvent, Dir, ServerConfig,
    StreamEvent, StreamId, VarInt,
};
use std::{
    collections::{HashMap, VecDeque},
    future::{poll_fn, Future},
    io::{self, IoSliceMut},
    mem,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};
use tokio::io::Interest;

pub(crate) use proto::Chunk;

/// Rounds of the driver's work in one poll before it yields (a round
/// reads at most one batch of [`RECV_SLOTS`] messages).
const DRIVER_ROUNDS: usize = 64;
/// Messages per `recvmmsg`.
const RECV_SLOTS: usize = 8;
/// Rounds of reading a waiting task does in one poll before it yields, so
/// that a flood of datagrams for other streams cannot hold it for ever.
const WAIT_ROUNDS: usize = 8;
/// Bytes one flush sends before it leaves the rest to the driver, so that
/// one connection's large write does not hold the endpoint's other
/// connections up for long (twice the default send window).
const FLUSH_BYTES: usize = 8 << 20;

/// Hashes the small integers that name streams and connections (a
/// multiply, where the default SipHash showed in a small call's profile).
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Why a stream operation failed.
#[derive(Clone, Debug)]
pub(crate) enum StreamError {
    /// The connection is gone.
    ConnectionLost(ConnectionError),
    /// The peer reset the stream it was sending (reading).
    Reset(VarInt),
    /// The peer stopped reading the stream (writing).
    Stopped(VarInt),
    /// The stream was already finished, reset or stopped here.
    ClosedStream,
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::ConnectionLost(e) => write!(f, "connection lost: {e}"),
            StreamError::Reset(code) => write!(f, "reset by peer: code {code}"),
            StreamError::Stopped(code) => write!(f, "stopped by peer: code {code}"),
            StreamError::ClosedStream => write!(f, "closed stream"),
        }
    }
}

/// A UDP socket and what quinn-udp knows about it.
struct Io {
    socket: tokio::net::UdpSocket,
    udp: quinn_udp::UdpSocketState,
    /// Datagrams one GSO send may hold (1: no GSO).
    max_segments: usize,
}

impl Io {
    fn send(&self, transmit: &proto::Transmit, buf: &[u8]) -> io::Result<()> {
        let udp = quinn_udp::Transmit {
            destination: transmit.destination,
            ecn: transmit.ecn.and_then(|e| quinn_udp::EcnCodepoint::from_bits(e as u8)),
            contents: &buf[..transmit.size],
            segment_size: transmit.segment_size,
            src_ip: transmit.src_ip,
        };
        self.socket.try_io(Interest::WRITABLE, || self.udp.send((&self.socket).into(), &udp))
    }
}

/// The receive buffers: [`RECV_SLOTS`] slots of `slot` bytes.
struct RecvBuffers {
    bytes: Vec<u8>,
    slot: usize,
    metas: [quinn_udp::RecvMeta; RECV_SLOTS],
}

/// One connection's state and who waits on it.
struct Conn {
    proto: proto::Connection,
    info: Arc<ConnInfo>,
    connected: bool,
    handshake: Option<Waker>,
    readers: IdMap<StreamId, Waker>,
    writers: IdMap<StreamId, Waker>,
    stopped: IdMap<StreamId, Waker>,
    openers: Vec<Waker>,
    acceptors: Vec<Waker>,
    /// A transmit the socket would not take; sent before any other.
    unsent: Option<(proto::Transmit, Vec<u8>)>,
    /// Listed in [`State::dirty`].
    dirty: bool,
}

impl Conn {
    fn wake_all(&mut self, to_wake: &mut Vec<Waker>) {
        to_wake.extend(self.handshake.take());
        to_wake.extend(self.readers.drain().map(|(_, w)| w));
        to_wake.extend(self.writers.drain().map(|(_, w)| w));
        to_wake.extend(self.stopped.drain().map(|(_, w)| w));
        to_wake.append(&mut self.openers);
        to_wake.append(&mut self.acceptors);
    }

    fn lost(&mut self, reason: ConnectionError, to_wake: &mut Vec<Waker>) {
        let _ = self.info.error.set(reason);
        self.wake_all(to_wake);
    }

    fn on_event(&mut self, event: proto::Event, to_wake: &mut Vec<Waker>) {
        use proto::Event;
        match event {
            Event::HandshakeDataReady | Event::DatagramReceived | Event::DatagramsUnblocked => {}
            Event::Connected => {
                self.connected = true;
                to_wake.extend(self.handshake.take());
            }
            Event::ConnectionLost { reason } => self.lost(reason, to_wake),
            Event::Stream(StreamEvent::Opened { .. }) => to_wake.append(&mut self.acceptors),
            Event::Stream(StreamEvent::Available { .. }) => to_wake.append(&mut self.openers),
            Event::Stream(StreamEvent::Readable { id }) => to_wake.extend(self.readers.remove(&id)),
            Event::Stream(StreamEvent::Writable { id }) => to_wake.extend(self.writers.remove(&id)),
            Event::Stream(StreamEvent::Finished { id }) => to_wake.extend(self.stopped.remove(&id)),
            Event::Stream(StreamEvent::Stopped { id, .. }) => {
                to_wake.extend(self.stopped.remove(&id));
                to_wake.extend(self.writers.remove(&id));
            }
        }
    }
}

/// What outlives a connection's state: its identity and why it ended.
struct ConnInfo {
    id: u64,
    error: OnceLock<ConnectionError>,
}

/// Who owns the socket's read readiness.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Poller {
    Driver,
    Waiter(u64),
}

/// Everything behind the endpoint's lock.
struct State {
    proto: proto::Endpoint,
    conns: IdMap<ConnectionHandle, Conn>,
    incoming: VecDeque<proto::Incoming>,
    acceptor: Option<Waker>,
    /// No new connections: closed, or every endpoint handle dropped.
    refusing: bool,
    /// Every [`Endpoint`] handle is gone: the driver ends with the last connection.
    released: bool,
    driver: Option<Waker>,
    /// The deadline the driver's timer is set to.
    driver_deadline: Option<Instant>,
    poller: Poller,
    next_id: u64,
    dirty: Vec<ConnectionHandle>,
    /// Connections with more to send than one flush sends; the driver's.
    deferred: Vec<ConnectionHandle>,
    idle: Vec<Waker>,
    recv: RecvBuffers,
    send_buf: Vec<u8>,
    /// A send would block: the driver waits for the socket to take more.
    send_blocked: bool,
    /// Woken once the lock is released.
    to_wake: Vec<Waker>,
}

struct Shared {
    state: Mutex<State>,
    io: Io,
}

/// The lock on [`State`]; wakes what was queued in `to_wake` after unlocking.
struct Locked<'a> {
    guard: Option<MutexGuard<'a, State>>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.guard.as_deref().unwrap_or_else(|| unreachable!("held until dropped"))
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_deref_mut().unwrap_or_else(|| unreachable!("held until dropped"))
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else { return };
        let wakers = mem::take(&mut guard.to_wake);
        drop(guard);
        wakers.into_iter().for_each(Waker::wake);
    }
}

impl Shared {
    fn lock(&self) -> Locked<'_> {
        Locked { guard: Some(self.state.lock().unwrap_or_else(PoisonError::into_inner)) }
    }

    /// Give the socket's readiness back to the driver, if `id` held it.
    fn release(&self, st: &mut State, id: u64) {
        if st.poller != Poller::Waiter(id) {
            return;
        }
        st.poller = Poller::Driver;
        if let Some(driver) = st.driver.clone() {
            if self.io.socket.poll_recv_ready(&mut Context::from_waker(&driver)).is_ready() {
                st.to_wake.push(driver);
            }
        }
    }

    /// Poll a wait: try `attempt`; if it must wait, read the socket, and if
    /// nothing came that lets it go on, sleep as the socket's poller.
    fn poll_wait<T>(
        &self,
        cx: &mut Context<'_>,
        id: &mut Option<u64>,
        mut attempt: impl FnMut(&mut State, &Io, Instant, &Waker) -> Poll<T>,
    ) -> Poll<T> {
        let mut st = self.lock();
        let mut now = Instant::now();
        for _ in 0..WAIT_ROUNDS {
            let result = attempt(&mut st, &self.io, now, cx.waker());
            st.flush_dirty(&self.io, now);
            if result.is_ready() {
                if let Some(id) = *id {
                    self.release(&mut st, id);
                }
                return result;
            }
            // One batch, then back to the caller's own stream: a reader
            // under a bulk transfer takes its data out batch by batch.
            // (Waking the driver to read on meanwhile lost a third of a
            // large call's rate to the two fighting over the lock.)
            if st.receive(&self.io, now, 1) {
                continue;
            }
            let me = *id.get_or_insert_with(|| {
                st.next_id += 1;
                st.next_id
            });
            st.poller = Poller::Waiter(me);
            if self.io.socket.poll_recv_ready(cx).is_pending() {
                return Poll::Pending;
            }
            now = Instant::now();
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Wait until `attempt` is ready (see [`Shared::poll_wait`]).
    async fn wait<T>(&self, mut attempt: impl FnMut(&mut State, &Io, Instant, &Waker) -> Poll<T>) -> T {
        let mut waiting = Waiting { shared: self, id: None };
        poll_fn(|cx| {
            let Waiting { shared, id } = &mut waiting;
            shared.poll_wait(cx, id, &mut attempt)
        })
        .await
    }
}

/// A wait in progress; dropping it gives the socket back to the driver.
struct Waiting<'a> {
    shared: &'a Shared,
    id: Option<u64>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            let mut st = self.shared.lock();
            self.shared.release(&mut st, id);
        }
    }
}

impl State {
    /// Leave the flush of what is marked to the driver. Drops do this
    /// rather than send: a process tearing its runtime down sends nothing,
    /// as a crash would not.
    fn kick(&mut self) {
        let driver = self.driver.clone();
        self.to_wake.extend(driver);
    }

    fn mark(&mut self, ch: ConnectionHandle) {
        if let Some(conn) = self.conns.get_mut(&ch) {
            if !conn.dirty {
                conn.dirty = true;
                self.dirty.push(ch);
            }
        }
    }

    /// The state of the connection `handle` names, or why it is gone.
    fn conn(&mut self, handle: &ConnHandle) -> Result<&mut Conn, ConnectionError> {
        if let Some(error) = handle.info.error.get() {
            return Err(error.clone());
        }
        match self.conns.get_mut(&handle.ch) {
            Some(conn) if conn.info.id == handle.info.id => Ok(conn),
            _ => Err(handle.info.error.get().cloned().unwrap_or(ConnectionError::LocallyClosed)),
        }
    }

    fn insert(&mut self, ch: ConnectionHandle, proto: proto::Connection) -> Arc<ConnInfo> {
        self.next_id += 1;
        let info = Arc::new(ConnInfo { id: self.next_id, error: OnceLock::new() });
        self.conns.insert(
            ch,
            Conn {
                proto,
                info: info.clone(),
                connected: false,
                handshake: None,
                readers: IdMap::default(),
                writers: IdMap::default(),
                stopped: IdMap::default(),
                openers: Vec::new(),
                acceptors: Vec::new(),
                unsent: None,
                dirty: false,
            },
        );
        self.mark(ch);
        info
    }

    /// Read what the socket holds and feed it to quinn-proto; true if
    /// anything came. Connections that received are flushed after each
    /// batch, so that acknowledgements and flow-control credit go out as
    /// the data comes in, not after a whole round of reading.
    /// Reads at most `batches` batches.
    fn receive(&mut self, io: &Io, now: Instant, batches: usize) -> bool {
        let mut any = false;
        let mut response = Vec::new();
        for _ in 0..batches {
            match self.receive_batch(io, now, &mut response) {
                Ok(0) => {}
                Ok(_) => {
                    any = true;
                    self.flush_dirty(io, now);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // ICMP errors from earlier sends; nothing to do with what is received.
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
                Err(e) => {
                    tracing::debug!("UDP receive failed: {e}");
                    break;
                }
            }
        }
        any
    }

    /// One `recvmmsg`, fed to quinn-proto: how many messages came.
    fn receive_batch(&mut self, io: &Io, now: Instant, response: &mut Vec<u8>) -> io::Result<usize> {
        let State { proto: endpoint, conns, dirty, incoming, acceptor, refusing, recv, to_wake, .. } = self;
        let RecvBuffers { bytes, slot, metas } = recv;
        let mut slots = bytes.chunks_mut(*slot);
        let mut iovs: [IoSliceMut<'_>; RECV_SLOTS] =
            std::array::from_fn(|_| IoSliceMut::new(slots.next().unwrap_or_default()));
        let count =
            io.socket.try_io(Interest::READABLE, || io.udp.recv((&io.socket).into(), &mut iovs, metas))?;
        for (meta, buf) in metas.iter().zip(bytes.chunks(*slot)).take(count) {
            let mut data = &buf[..meta.len.min(buf.len())];
            let ecn = meta.ecn.and_then(|e| proto::EcnCodepoint::from_bits(e as u8));
            while !data.is_empty() {
                let stride = meta.stride.clamp(1, data.len());
                let datagram = BytesMut::from(&data[..stride]);
                data = &data[stride..];
                response.clear();
                match endpoint.handle(now, meta.addr, meta.dst_ip, ecn, datagram, response) {
                    Some(DatagramEvent::ConnectionEvent(ch, event)) => {
                        if let Some(conn) = conns.get_mut(&ch) {
                            conn.proto.handle_event(event);
                            if !conn.dirty {
                                conn.dirty = true;
                                dirty.push(ch);
                            }
                        }
                    }
                    Some(DatagramEvent::NewConnection(new)) => {
                        if *refusing {
                            let transmit = endpoint.refuse(new, response);
                            let _ = io.send(&transmit, response);
                        } else {
                            incoming.push_back(new);
                            to_wake.extend(acceptor.take());
                        }
                    }
                    Some(DatagramEvent::Response(transmit)) => {
                        let _ = io.send(&transmit, response);
                    }
                    None => {}
                }
            }
        }
        Ok(count)
    }

    fn flush_dirty(&mut self, io: &Io, now: Instant) {
        while let Some(ch) = self.dirty.pop() {
            self.flush(io, ch, now);
        }
    }

    /// Bring one connection up to date: endpoint events, application
    /// events (waking who waits), then its datagrams onto the socket (about
    /// [`FLUSH_BYTES`]; the driver sends the rest).
    fn flush(&mut self, io: &Io, ch: ConnectionHandle, now: Instant) {
        let State {
            proto: endpoint,
            conns,
            to_wake,
            send_buf,
            send_blocked,
            driver,
            driver_deadline,
            idle,
            deferred,
            ..
        } = self;
        let Some(conn) = conns.get_mut(&ch) else { return };
        conn.dirty = false;
        let mut drained = false;
        let mut sent = 0;
        let mut more = false;
        loop {
            let mut again = false;
            while let Some(event) = conn.proto.poll_endpoint_events() {
                drained |= event.is_drained();
                if let Some(event) = endpoint.handle_event(ch, event) {
                    conn.proto.handle_event(event);
                    again = true;
                }
            }
            while let Some(event) = conn.proto.poll() {
                conn.on_event(event, to_wake);
            }
            while !*send_blocked {
                let (transmit, buf) = match conn.unsent.take() {
                    Some(unsent) => unsent,
                    None => {
                        send_buf.clear();
                        match conn.proto.poll_transmit(now, io.max_segments, send_buf) {
                            Some(transmit) => (transmit, mem::take(send_buf)),
                            None => break,
                        }
                    }
                };
                if sent >= FLUSH_BYTES {
                    conn.unsent = Some((transmit, buf));
                    more = true;
                    break;
                }
                match io.send(&transmit, &buf) {
                    Ok(()) => {
                        sent += transmit.size;
                        *send_buf = buf;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        conn.unsent = Some((transmit, buf));
                        *send_blocked = true;
                        to_wake.extend(driver.clone());
                    }
                    Err(e) => {
                        // Lost like any datagram; QUIC sends it again.
                        tracing::debug!(to = %transmit.destination, "UDP send failed: {e}");
                        *send_buf = buf;
                    }
                }
            }
            if !again || more {
                break;
            }
        }
        if let Some(deadline) = conn.proto.poll_timeout() {
            if driver_deadline.is_none_or(|d| deadline < d) {
                *driver_deadline = Some(deadline);
                to_wake.extend(driver.clone());
            }
        }
        if drained {
            if let Some(mut conn) = conns.remove(&ch) {
                conn.lost(ConnectionError::LocallyClosed, to_wake);
            }
            if conns.is_empty() {
                to_wake.append(idle);
            }
        } else if more {
            conn.dirty = true;
            deferred.push(ch);
            to_wake.extend(driver.clone());
        }
    }

    fn close_conn(&mut self, ch: ConnectionHandle, now: Instant, code: VarInt, reason: &[u8]) {
        if let Some(conn) = self.conns.get_mut(&ch) {
            conn.proto.close(now, code, Bytes::copy_from_slice(reason));
            conn.lost(ConnectionError::LocallyClosed, &mut self.to_wake);
            self.mark(ch);
        }
    }
}

/// What a connection's handles share; the last one dropped closes it.
struct ConnHandle {
    shared: Arc<Shared>,
    ch: ConnectionHandle,
    info: Arc<ConnInfo>,
}

impl Drop for ConnHandle {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        if st.conn(self).is_ok() {
            st.close_conn(self.ch, Instant::now(), VarInt::from_u32(0), b"");
            st.kick();
        }
    }
}

/// Settings of an [`Endpoint`].
pub(crate) struct EndpointOptions {
    pub(crate) config: proto::EndpointConfig,
    pub(crate) server: Option<Arc<ServerConfig>>,
    /// The largest datagram a GSO send may carry segments of: each send
    /// holds at most as many as fit in one UDP send.
    pub(crate) largest_segment: usize,
}

/// A QUIC endpoint on one UDP socket: connects, and accepts when it has a
/// server configuration. Cheap to clone; the driver task stops once every
/// clone is dropped and every connection is closed.
#[derive(Clone)]
pub(crate) struct Endpoint {
    handle: Arc<EndpointHandle>,
}

struct EndpointHandle {
    shared: Arc<Shared>,
}

impl Drop for EndpointHandle {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.released = true;
        st.refusing = true;
        while let Some(incoming) = st.incoming.pop_front() {
            let mut response = Vec::new();
            let transmit = st.proto.refuse(incoming, &mut response);
            let _ = self.shared.io.send(&transmit, &response);
        }
        let driver = st.driver.clone();
        st.to_wake.extend(driver);
    }
}

/// The largest UDP payload one send may carry (IPv4: 65,535 less the IP and
/// UDP headers; IPv6 allows 20 bytes more, and this is the bound for both).
const MAX_SEND: usize = 65_507;

/// How many datagrams of `segment` bytes fit in one send: at least one
/// (GSO is then simply not used). quinn-udp takes the kernel's `EMSGSIZE`
/// for a failed MTU probe and reports success, so a batch over the limit
/// would be lost without a word: every batch at a fixed 8952-byte MTU was,
/// until sends were bounded.
fn segments_per_send(segment: usize) -> usize {
    (MAX_SEND / segment.max(1)).max(1)
}

impl Endpoint {
    /// An endpoint on `socket`, driven by a task spawned on the current runtime.
    pub(crate) fn new(socket: std::net::UdpSocket, options: EndpointOptions) -> io::Result<Endpoint> {
        socket.set_nonblocking(true)?;
        let udp = quinn_udp::UdpSocketState::new((&socket).into())?;
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        let max_segments = udp.max_gso_segments().min(segments_per_send(options.largest_segment)).max(1);
        let payload =
            usize::try_from(options.config.get_max_udp_payload_size()).unwrap_or(65_535).min(65_535);
        let slot = (payload.max(1500) * udp.gro_segments()).clamp(65_536, 256 << 10);
        let allow_mtud = !udp.may_fragment();
        let proto = proto::Endpoint::new(Arc::new(options.config), options.server, allow_mtud, None);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                proto,
                conns: IdMap::default(),
                incoming: VecDeque::new(),
                acceptor: None,
                refusing: false,
                released: false,
                driver: None,
                driver_deadline: None,
                poller: Poller::Driver,
                next_id: 0,
                dirty: Vec::new(),
                deferred: Vec::new(),
                idle: Vec::new(),
                recv: RecvBuffers {
                    bytes: vec![0; slot * RECV_SLOTS],
                    slot,
                    metas: [quinn_udp::RecvMeta::default(); RECV_SLOTS],
                },
                send_buf: Vec::new(),
                send_blocked: false,
                to_wake: Vec::new(),
            }),
            io: Io { socket, udp, max_segments },
        });
        tokio::spawn(drive(shared.clone()));
        Ok(Endpoint { handle: Arc::new(EndpointHandle { shared }) })
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.handle.shared
    }

    /// Start a handshake with `remote`.
    pub(crate) fn connect(
        &self,
        config: ClientConfig,
        remote: SocketAddr,
        server_name: &str,
    ) -> Result<Connecting, proto::ConnectError> {
        let shared = self.shared();
        let mut st = shared.lock();
        let now = Instant::now();
        let (ch, conn) = st.proto.connect(now, config, remote, server_name)?;
        let info = st.insert(ch, conn);
        st.flush_dirty(&shared.io, now);
        Ok(Connecting { handle: Arc::new(ConnHandle { shared: shared.clone(), ch, info }) })
    }

    /// The next incoming connection; `None` once the endpoint is closed.
    pub(crate) async fn accept(&self) -> Option<Incoming> {
        let shared = self.shared();
        shared
            .wait(|st, _, _, waker| {
                if let Some(incoming) = st.incoming.pop_front() {
                    return Poll::Ready(Some(incoming));
                }
                if st.refusing {
                    return Poll::Ready(None);
                }
                st.acceptor = Some(waker.clone());
                Poll::Pending
            })
            .await
            .map(|incoming| Incoming { shared: shared.clone(), incoming: Some(incoming) })
    }

    /// Accept no more connections (the ones open go on).
    pub(crate) fn stop_accepting(&self) {
        let mut st = self.shared().lock();
        st.proto.set_server_config(None);
        st.refusing = true;
        let acceptor = st.acceptor.take();
        st.to_wake.extend(acceptor);
    }

    /// Close every connection with `code` and `reason`, and accept no more.
    pub(crate) fn close(&self, code: VarInt, reason: &[u8]) {
        let shared = self.shared();
        let mut st = shared.lock();
        let now = Instant::now();
        st.refusing = true;
        let acceptor = st.acceptor.take();
        st.to_wake.extend(acceptor);
        let handles: Vec<_> = st.conns.keys().copied().collect();
        for ch in handles {
            st.close_conn(ch, now, code, reason);
        }
        st.flush_dirty(&shared.io, now);
    }

    /// Wait until every connection has ended (closed and drained).
    pub(crate) async fn wait_idle(&self) {
        self.shared()
            .wait(|st, _, _, waker| {
                if st.conns.is_empty() {
                    return Poll::Ready(());
                }
                st.idle.push(waker.clone());
                Poll::Pending
            })
            .await
    }
}

/// The endpoint's driver: timers, blocked sends, and the socket while no
/// caller waits on it.
async fn drive(shared: Arc<Shared>) {
    let mut timer = Box::pin(tokio::time::sleep(Duration::from_secs(3600)));
    let mut armed: Option<Instant> = None;
    poll_fn(|cx| shared.poll_driver(cx, &mut timer, &mut armed)).await
}

impl Shared {
    fn poll_driver(
        &self,
        cx: &mut Context<'_>,
        timer: &mut Pin<Box<tokio::time::Sleep>>,
        armed: &mut Option<Instant>,
    ) -> Poll<()> {
        for round in 0..DRIVER_ROUNDS {
            // The lock is taken round by round: a reader taking its data
            // out between two batches need not wait for a whole drain.
            let mut st = self.lock();
            if round == 0 && !st.driver.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                st.driver = Some(cx.waker().clone());
            }
            let now = Instant::now();
            let deferred = mem::take(&mut st.deferred);
            st.dirty.extend(deferred);
            let received = st.receive(&self.io, now, 1);
            if st.send_blocked && self.io.socket.poll_send_ready(cx).is_ready() {
                st.send_blocked = false;
                let handles: Vec<_> = st.conns.keys().copied().collect();
                handles.into_iter().for_each(|ch| st.mark(ch));
            }
            let mut next: Option<Instant> = None;
            let handles: Vec<_> = st.conns.keys().copied().collect();
            for ch in handles {
                let Some(conn) = st.conns.get_mut(&ch) else { continue };
                match conn.proto.poll_timeout() {
                    Some(deadline) if deadline <= now => {
                        conn.proto.handle_timeout(now);
                        st.mark(ch);
                    }
                    Some(deadline) => next = Some(next.map_or(deadline, |n| n.min(deadline))),
                    None => {}
                }
            }
            let flushed = !st.dirty.is_empty();
            st.flush_dirty(&self.io, now);
            if st.released && st.conns.is_empty() {
                return Poll::Ready(());
            }
            if received || flushed {
                continue;
            }
            st.driver_deadline = next;
            if *armed != next {
                *armed = next;
                let at = next.unwrap_or_else(|| now + Duration::from_secs(3600));
                timer.as_mut().reset(tokio::time::Instant::from_std(at));
            }
            if next.is_some() && timer.as_mut().poll(cx).is_ready() {
                *armed = None;
                continue;
            }
            if st.poller == Poller::Driver && self.io.socket.poll_recv_ready(cx).is_ready() {
                continue;
            }
            return Poll::Pending;
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// A connection attempt not yet accepted by this endpoint.
pub(crate) struct Incoming {
    shared: Arc<Shared>,
    incoming: Option<proto::Incoming>,
}

impl Incoming {
    /// Where it comes from.
    pub(crate) fn remote_address(&self) -> Option<SocketAddr> {
        self.incoming.as_ref().map(|i| i.remote_address())
    }

    /// Start the handshake with `config`.
    pub(crate) fn accept_with(mut self, config: Arc<ServerConfig>) -> Result<Connecting, ConnectionError> {
        let Some(incoming) = self.incoming.take() else {
            return Err(ConnectionError::LocallyClosed);
        };
        let shared = self.shared.clone();
        let mut st = shared.lock();
        let now = Instant::now();
        let mut response = Vec::new();
        match st.proto.accept(incoming, now, &mut response, Some(config)) {
            Ok((ch, conn)) => {
                let info = st.insert(ch, conn);
                st.flush_dirty(&shared.io, now);
                Ok(Connecting { handle: Arc::new(ConnHandle { shared: shared.clone(), ch, info }) })
            }
            Err(error) => {
                if let Some(transmit) = error.response {
                    let _ = shared.io.send(&transmit, &response);
                }
                Err(error.cause)
            }
        }
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        if let Some(incoming) = self.incoming.take() {
            let mut st = self.shared.lock();
            let mut response = Vec::new();
            let transmit = st.proto.refuse(incoming, &mut response);
            let _ = self.shared.io.send(&transmit, &response);
        }
    }
}

/// A handshake under way.
pub(crate) struct Connecting {
    handle: Arc<ConnHandle>,
}

impl Connecting {
    /// Wait for the handshake to complete.
    pub(crate) async fn established(self) -> Result<Connection, ConnectionError> {
        let handle = &self.handle;
        handle
            .shared
            .wait(|st, _, _, waker| match st.conn(handle) {
                Err(e) => Poll::Ready(Err(e)),
                Ok(conn) if conn.connected => Poll::Ready(Ok(())),
                Ok(conn) => {
                    conn.handshake = Some(waker.clone());
                    Poll::Pending
                }
            })
            .await?;
        Ok(Connection { handle: self.handle })
    }
}

/// An established connection. Cheap to clone; the connection is closed
/// once every clone and every stream on it is dropped.
#[derive(Clone)]
pub(crate) struct Connection {
    handle: Arc<ConnHandle>,
}

impl Connection {
    /// Identifies the connection (unlike its handle, never reused).
    pub(crate) fn stable_id(&self) -> u64 {
        self.handle.info.id
    }

    /// Why the connection ended, or `None` while it is open.
    pub(crate) fn close_reason(&self) -> Option<ConnectionError> {
        self.handle.info.error.get().cloned()
    }

    /// UDP datagrams received on this connection so far.
    pub(crate) fn datagrams_received(&self) -> u64 {
        let mut st = self.handle.shared.lock();
        st.conn(&self.handle).map_or(0, |c| c.proto.stats().udp_rx.datagrams)
    }

    /// Close the connection; calls on it fail at once.
    pub(crate) fn close(&self, code: VarInt, reason: &[u8]) {
        let shared = &self.handle.shared;
        let mut st = shared.lock();
        if st.conn(&self.handle).is_ok() {
            let now = Instant::now();
            st.close_conn(self.handle.ch, now, code, reason);
            st.flush_dirty(&shared.io, now);
        }
    }

    /// Open a bidirectional stream, waiting while the peer allows no more.
    pub(crate) async fn open_bi(&self) -> Result<(SendStream, RecvStream), ConnectionError> {
        let handle = &self.handle;
        let id = handle
            .shared
            .wait(|st, _, _, waker| {
                let conn = match st.conn(handle) {
                    Ok(conn) => conn,
                    Err(e) => return Poll::Ready(Err(e)),
                };
                match conn.proto.streams().open(Dir::Bi) {
                    Some(id) => Poll::Ready(Ok(id)),
                    None => {
                        conn.openers.push(waker.clone());
                        Poll::Pending
                    }
                }
            })
            .await?;
        Ok(self.streams(id))
    }

    /// The next stream the peer opens.
    pub(crate) async fn accept_bi(&self) -> Result<(SendStream, RecvStream), ConnectionError> {
        let handle = &self.handle;
        let id = handle
            .shared
            .wait(|st, _, _, waker| {
                let conn = match st.conn(handle) {
                    Ok(conn) => conn,
                    Err(e) => return Poll::Ready(Err(e)),
                };
                match conn.proto.streams().accept(Dir::Bi) {
                    Some(id) => Poll::Ready(Ok(id)),
                    None => {
                        conn.acceptors.push(waker.clone());
                        Poll::Pending
                    }
                }
            })
            .await?;
        Ok(self.streams(id))
    }

    fn streams(&self, id: StreamId) -> (SendStream, RecvStream) {
        (
            SendStream { handle: self.handle.clone(), id, done: false },
            RecvStream { handle: self.handle.clone(), id, done: false },
        )
    }
}

/// The largest piece handed to quinn-proto in one write. quinn-proto
/// counts a written piece against the send window until all of it is
/// acknowledged: one 4 MiB piece filled the whole default window, and the
/// sender then waited for the acknowledgement of its last packet, which a
/// receiver may delay by 25 ms, at every window (0.3–0.9 GiB/s for a
/// 256 MiB call). In pieces this size the window opens as they are
/// acknowledged.
const WRITE_PIECE: usize = 256 << 10;

/// Write as much of `data` as `stream` takes, in pieces of at most
/// [`WRITE_PIECE`] bytes. `Blocked` only if nothing at all was written.
fn write_in_segments(
    stream: &mut proto::SendStream<'_>,
    data: &mut Data<'_, '_>,
) -> Result<proto::Written, proto::WriteError> {
    use bytes::Buf;
    let mut total = proto::Written { bytes: 0, chunks: 0 };
    loop {
        let step = match data {
            Data::Chunks(bufs) => {
                let Some(first) = bufs.get_mut(total.chunks) else { break };
                if first.is_empty() {
                    total.chunks += 1;
                    continue;
                }
                let mut piece = [first.slice(..first.len().min(WRITE_PIECE))];
                stream.write_chunks(&mut piece).map(|written| {
                    first.advance(written.bytes);
                    if first.is_empty() {
                        total.chunks += 1;
                    }
                    written.bytes
                })
            }
            Data::Slice(slice) => {
                let rest = &slice[total.bytes..];
                if rest.is_empty() {
                    break;
                }
                stream.write(&rest[..rest.len().min(WRITE_PIECE)])
            }
        };
        match step {
            Ok(0) => break,
            Ok(bytes) => total.bytes += bytes,
            Err(proto::WriteError::Blocked) if total.bytes > 0 || total.chunks > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// What a write takes: whole buffers, or a borrowed slice.
enum Data<'a, 'b> {
    Chunks(&'a mut [Bytes]),
    Slice(&'b [u8]),
}

/// The sending half of a stream. Dropped unfinished, it is finished.
pub(crate) struct SendStream {
    handle: Arc<ConnHandle>,
    id: StreamId,
    /// Finished or reset.
    done: bool,
}

impl SendStream {
    /// Write as much of `data` as the stream takes now, waiting until it
    /// takes something; if all of it went and `finish`, finish the stream
    /// too (the last data and the end go in one datagram). `data` is
    /// either whole buffers, consumed as they go (a partly written one is
    /// advanced), or a borrowed slice, copied. Returns the bytes written
    /// and how many whole buffers.
    async fn write_some(
        &mut self,
        mut data: Data<'_, '_>,
        finish: bool,
    ) -> Result<proto::Written, StreamError> {
        let handle = &self.handle;
        let id = self.id;
        let result = handle
            .shared
            .wait(|st, _, _, waker| {
                let conn = match st.conn(handle) {
                    Ok(conn) => conn,
                    Err(e) => return Poll::Ready(Err(StreamError::ConnectionLost(e))),
                };
                let mut stream = conn.proto.send_stream(id);
                let written = match write_in_segments(&mut stream, &mut data) {
                    Ok(written) => written,
                    Err(proto::WriteError::Blocked) => {
                        conn.writers.insert(id, waker.clone());
                        return Poll::Pending;
                    }
                    Err(proto::WriteError::Stopped(code)) => {
                        return Poll::Ready(Err(StreamError::Stopped(code)))
                    }
                    Err(proto::WriteError::ClosedStream) => {
                        return Poll::Ready(Err(StreamError::ClosedStream))
                    }
                };
                let all = match &data {
                    Data::Chunks(bufs) => written.chunks == bufs.len(),
                    Data::Slice(slice) => written.bytes == slice.len(),
                };
                if all && finish {
                    if let Err(e) = stream.finish() {
                        return Poll::Ready(Err(match e {
                            proto::FinishError::Stopped(code) => StreamError::Stopped(code),
                            proto::FinishError::ClosedStream => StreamError::ClosedStream,
                        }));
                    }
                }
                st.mark(handle.ch);
                Poll::Ready(Ok((written, all)))
            })
            .await;
        let (written, all) = result?;
        if all && finish {
            self.done = true;
        }
        Ok(written)
    }

    /// Write all of `bufs`, then finish the stream if `finish`.
    pub(crate) async fn write_chunks(
        &mut self,
        mut bufs: &mut [Bytes],
        finish: bool,
    ) -> Result<(), StreamError> {
        loop {
            let written = self.write_some(Data::Chunks(bufs), finish).await?;
            bufs = &mut bufs[written.chunks..];
            if bufs.is_empty() {
                return Ok(());
            }
        }
    }

    /// Write as much of `bufs` as the stream takes now, waiting until it
    /// takes something, and finish the stream once all of it went if
    /// `finish`. Returns how many whole buffers went.
    pub(crate) async fn write_chunks_some(
        &mut self,
        bufs: &mut [Bytes],
        finish: bool,
    ) -> Result<usize, StreamError> {
        Ok(self.write_some(Data::Chunks(bufs), finish).await?.chunks)
    }

    /// Write all of `data` (copied), then finish the stream if `finish`.
    pub(crate) async fn write_all(&mut self, mut data: &[u8], finish: bool) -> Result<(), StreamError> {
        loop {
            let written = self.write_some(Data::Slice(data), finish).await?;
            data = &data[written.bytes..];
            if data.is_empty() {
                return Ok(());
            }
        }
    }

    /// Abandon the stream: the peer's reads end in [`StreamError::Reset`].
    pub(crate) fn reset(&mut self, code: VarInt) {
        self.done = true;
        let shared = &self.handle.shared;
        let mut st = shared.lock();
        if let Ok(conn) = st.conn(&self.handle) {
            let _ = conn.proto.send_stream(self.id).reset(code);
            st.mark(self.handle.ch);
            st.flush_dirty(&shared.io, Instant::now());
        }
    }

    /// Whether the stream needs no more waiting for: the peer acknowledged
    /// all of it, or stopped it, or the connection is gone.
    fn poll_settled(&self, st: &mut State, waker: &Waker) -> Poll<()> {
        let Ok(conn) = st.conn(&self.handle) else { return Poll::Ready(()) };
        match conn.proto.send_stream(self.id).stopped() {
            Ok(None) => {
                conn.stopped.insert(self.id, waker.clone());
                Poll::Pending
            }
            Ok(Some(_)) | Err(_) => Poll::Ready(()),
        }
    }

    /// [`SendStream::settled`] without waiting.
    pub(crate) fn is_settled(&self) -> bool {
        let mut st = self.handle.shared.lock();
        self.poll_settled(&mut st, Waker::noop()).is_ready()
    }

    /// Wait until the peer has acknowledged all of the stream, or stopped
    /// it, or the connection is gone.
    pub(crate) async fn settled(&self) {
        self.handle.shared.wait(|st, _, _, waker| self.poll_settled(st, waker)).await
    }
}

impl Drop for SendStream {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.handle.shared.lock();
        if let Ok(conn) = st.conn(&self.handle) {
            let _ = conn.proto.send_stream(self.id).finish();
            st.mark(self.handle.ch);
            st.kick();
        }
    }
}

/// The receiving half of a stream. Dropped before its end, it is stopped.
pub(crate) struct RecvStream {
    handle: Arc<ConnHandle>,
    id: StreamId,
    /// Read to its end, reset, or stopped.
    done: bool,
}

impl RecvStream {
    /// The next chunk of data in order, up to `max` bytes; `None` at the end.
    pub(crate) async fn read_chunk(&mut self, max: usize) -> Result<Option<Chunk>, StreamError> {
        let handle = &self.handle;
        let id = self.id;
        let result = handle
            .shared
            .wait(|st, _, _, waker| {
                let conn = match st.conn(handle) {
                    Ok(conn) => conn,
                    Err(e) => return Poll::Ready(Err(StreamError::ConnectionLost(e))),
                };
                let mut stream = conn.proto.recv_stream(id);
                let mut chunks = match stream.read(true) {
                    Ok(chunks) => chunks,
                    Err(_) => return Poll::Ready(Err(StreamError::ClosedStream)),
                };
                let next = chunks.next(max);
                let transmit = chunks.finalize().should_transmit();
                let result = match next {
                    Ok(chunk) => Poll::Ready(Ok(chunk)),
                    Err(proto::ReadError::Reset(code)) => Poll::Ready(Err(StreamError::Reset(code))),
                    Err(proto::ReadError::Blocked) => {
                        conn.readers.insert(id, waker.clone());
                        Poll::Pending
                    }
                };
                if transmit {
                    st.mark(handle.ch);
                }
                result
            })
            .await;
        if !matches!(result, Ok(Some(_))) {
            self.done = true;
        }
        result
    }

    /// Tell the peer to stop sending; reads end.
    pub(crate) fn stop(&mut self, code: VarInt) {
        self.done = true;
        let shared = &self.handle.shared;
        let mut st = shared.lock();
        if let Ok(conn) = st.conn(&self.handle) {
            let _ = conn.proto.recv_stream(self.id).stop(code);
            st.mark(self.handle.ch);
            st.flush_dirty(&shared.io, Instant::now());
        }
    }
}

impl Drop for RecvStream {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.handle.shared.lock();
        if let Ok(conn) = st.conn(&self.handle) {
            let _ = conn.proto.recv_stream(self.id).stop(VarInt::from_u32(0));
            st.mark(self.handle.ch);
            st.kick();
        }
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
