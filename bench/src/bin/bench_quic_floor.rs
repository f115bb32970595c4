//! The CPU floor of a small QUIC call, to tell what any driver over
//! `quinn-proto` could reach against a TCP echo (issue 20's small-call
//! target). Everything runs on one thread, so no figure holds a wake-up:
//!
//! - **proto**: a client and a server `quinn_proto` connection (oar's TLS:
//!   mutual, AES-128-GCM) exchanging datagrams in memory. Each call opens a
//!   bidirectional stream, writes a small request and finishes; the server
//!   accepts it, reads it whole, writes the same bytes back and finishes; the
//!   client reads the reply whole. Packets, ACKs, crypto, stream and flow
//!   control: the work quinn-proto does per call, with no socket and no task.
//! - **udp**: one datagram each way between two loopback UDP sockets
//!   (`send`, `recv`, `send`, `recv`): the fewest syscalls a QUIC round trip
//!   can make.
//! - **tcp**: a TCP_NODELAY echo between two loopback sockets (`write`,
//!   `read`, `write`, `read`): the reference.
//!
//! `floor = (proto + udp) / tcp` is the ratio a QUIC call would reach if its
//! driver added nothing to quinn-proto's work and the UDP syscalls; the real
//! transport's CPU-path ratio is measured by `profile_transport small
//! --in-task` and `bench_transport` (BENCHMARKS.md, "Transport").
//!
//! ```sh
//! cargo run --release -p oar-bench --bin bench_quic_floor -- [--calls N] [--reps R] [--bytes B]
//! ```

use bytes::BytesMut;
use oar_transport::DevCa;
use quinn_proto::{
    crypto::rustls::{QuicClientConfig, QuicServerConfig},
    ClientConfig, Connection, ConnectionHandle, DatagramEvent, Dir, Endpoint, EndpointConfig, ServerConfig,
    StreamId,
};
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::Arc,
    time::{Duration, Instant},
};

use oar_bench::BoxError;

struct Args {
    calls: usize,
    reps: usize,
    bytes: usize,
}

fn parse() -> Result<Args, BoxError> {
    let usage = "usage: bench_quic_floor [--calls N] [--reps R] [--bytes B]";
    let mut args = Args { calls: 20_000, reps: 7, bytes: 32 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value: usize = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value; {usage}"))?
            .parse()
            .map_err(|e| format!("{flag}: {e}; {usage}"))?;
        match flag.as_str() {
            "--calls" => args.calls = value.max(1),
            "--reps" => args.reps = value.max(1),
            "--bytes" => args.bytes = value.max(1),
            other => return Err(format!("unknown option {other:?}; {usage}").into()),
        }
    }
    Ok(args)
}

/// One end of the in-memory pair: its endpoint and (once made) its connection.
struct Side {
    addr: SocketAddr,
    endpoint: Endpoint,
    conn: Option<(ConnectionHandle, Connection)>,
}

impl Side {
    fn conn(&mut self) -> Result<&mut Connection, BoxError> {
        self.conn.as_mut().map(|(_, c)| c).ok_or_else(|| "no connection yet".into())
    }

    /// Runs due timers and hands endpoint events across, as a driver would.
    fn service(&mut self, now: Instant) {
        let Some((handle, conn)) = self.conn.as_mut() else { return };
        if conn.poll_timeout().is_some_and(|t| t <= now) {
            conn.handle_timeout(now);
        }
        while let Some(event) = conn.poll_endpoint_events() {
            if let Some(back) = self.endpoint.handle_event(*handle, event) {
                conn.handle_event(back);
            }
        }
    }
}

/// Moves every datagram `from` has to send into `to`; returns how many.
fn pump(now: Instant, from: &mut Side, to: &mut Side, buf: &mut Vec<u8>) -> Result<usize, BoxError> {
    from.service(now);
    let mut moved = 0;
    let mut response = Vec::new();
    loop {
        buf.clear();
        let Some(transmit) = from.conn()?.poll_transmit(now, 1, buf) else { break };
        moved += 1;
        let data = BytesMut::from(&buf[..transmit.size]);
        match to.endpoint.handle(now, from.addr, None, None, data, &mut response) {
            Some(DatagramEvent::ConnectionEvent(_, event)) => to.conn()?.handle_event(event),
            Some(DatagramEvent::NewConnection(incoming)) => {
                to.conn = Some(to.endpoint.accept(incoming, now, &mut response, None).map_err(|e| e.cause)?)
            }
            Some(DatagramEvent::Response(_)) | None => {}
        }
    }
    to.service(now);
    Ok(moved)
}

/// Reads `id` until its FIN; returns the bytes read, or `None` before the FIN.
fn read_all(conn: &mut Connection, id: StreamId, into: &mut Vec<u8>) -> Result<bool, BoxError> {
    let mut stream = conn.recv_stream(id);
    let mut chunks = stream.read(true)?;
    let finished = loop {
        match chunks.next(usize::MAX) {
            Ok(Some(chunk)) => into.extend_from_slice(&chunk.bytes),
            Ok(None) => break true,
            Err(quinn_proto::ReadError::Blocked) => break false,
            Err(e) => return Err(e.into()),
        }
    };
    let _ = chunks.finalize();
    Ok(finished)
}

/// A connected client/server pair, handshake done.
fn proto_pair() -> Result<(Side, Side), BoxError> {
    let ca = DevCa::new()?;
    let server_tls = ca.tls_config("server")?.rustls_server_config()?;
    let client_tls = ca.tls_config("client")?.rustls_client_config()?;
    let server_config = ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(server_tls)?));
    let client_config = ClientConfig::new(Arc::new(QuicClientConfig::try_from(client_tls)?));
    let endpoint_config = Arc::new(EndpointConfig::default());
    let mut server = Side {
        addr: "127.0.0.1:4433".parse()?,
        endpoint: Endpoint::new(endpoint_config.clone(), Some(Arc::new(server_config)), false, None),
        conn: None,
    };
    let mut client = Side {
        addr: "127.0.0.1:5544".parse()?,
        endpoint: Endpoint::new(endpoint_config, None, false, None),
        conn: None,
    };
    let now = Instant::now();
    client.conn = Some(client.endpoint.connect(now, client_config, server.addr, "oar")?);
    let mut buf = Vec::new();
    for _ in 0..20 {
        let now = Instant::now();
        let moved =
            pump(now, &mut client, &mut server, &mut buf)? + pump(now, &mut server, &mut client, &mut buf)?;
        if moved == 0 {
            break;
        }
    }
    for side in [&mut client, &mut server] {
        while let Some(event) = side.conn()?.poll() {
            if let quinn_proto::Event::ConnectionLost { reason } = event {
                return Err(format!("handshake failed: {reason}").into());
            }
        }
    }
    if client.conn()?.is_handshaking() || server.conn()?.is_handshaking() {
        return Err("handshake did not complete in memory".into());
    }
    Ok((client, server))
}

/// `calls` small calls over the in-memory pair; returns (time, datagrams).
fn proto_calls(
    client: &mut Side,
    server: &mut Side,
    calls: usize,
    bytes: usize,
) -> Result<(Duration, usize), BoxError> {
    let request = vec![7u8; bytes];
    let (mut buf, mut got, mut datagrams) = (Vec::new(), Vec::new(), 0);
    let start = Instant::now();
    for _ in 0..calls {
        let now = Instant::now();
        let conn = client.conn()?;
        let id = conn.streams().open(Dir::Bi).ok_or("no stream credit")?;
        conn.send_stream(id).write(&request)?;
        conn.send_stream(id).finish()?;
        datagrams += pump(now, client, server, &mut buf)?;
        let conn = server.conn()?;
        while conn.poll().is_some() {}
        let sid = conn.streams().accept(Dir::Bi).ok_or("the server saw no stream")?;
        got.clear();
        if !read_all(conn, sid, &mut got)? || got.len() != bytes {
            return Err(format!("the server read {} of {bytes} bytes", got.len()).into());
        }
        conn.send_stream(sid).write(&got)?;
        conn.send_stream(sid).finish()?;
        datagrams += pump(now, server, client, &mut buf)?;
        let conn = client.conn()?;
        while conn.poll().is_some() {}
        got.clear();
        if !read_all(conn, id, &mut got)? || got != request {
            return Err(format!("the client read {} of {bytes} bytes back", got.len()).into());
        }
    }
    Ok((start.elapsed(), datagrams))
}

fn udp_calls(calls: usize, bytes: usize) -> Result<Duration, BoxError> {
    let a = UdpSocket::bind("127.0.0.1:0")?;
    let b = UdpSocket::bind("127.0.0.1:0")?;
    a.connect(b.local_addr()?)?;
    b.connect(a.local_addr()?)?;
    // QUIC's datagram for a small call: the payload plus ~40 bytes of header and tag.
    let (out, mut got) = (vec![7u8; bytes + 40], vec![0u8; 2048]);
    let start = Instant::now();
    for _ in 0..calls {
        a.send(&out)?;
        let n = b.recv(&mut got)?;
        b.send(&got[..n])?;
        if a.recv(&mut got)? != out.len() {
            return Err("short UDP echo".into());
        }
    }
    Ok(start.elapsed())
}

fn tcp_calls(calls: usize, bytes: usize) -> Result<Duration, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut a = TcpStream::connect(listener.local_addr()?)?;
    let (mut b, _) = listener.accept()?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    let (out, mut got) = (vec![7u8; bytes], vec![0u8; bytes]);
    let start = Instant::now();
    for _ in 0..calls {
        a.write_all(&out)?;
        b.read_exact(&mut got)?;
        b.write_all(&got)?;
        a.read_exact(&mut got)?;
    }
    Ok(start.elapsed())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), BoxError> {
    let Args { calls, reps, bytes } = parse()?;
    let (mut client, mut server) = proto_pair()?;
    // Warm up: stream credit, ACK state, the allocator.
    proto_calls(&mut client, &mut server, 1000, bytes)?;
    let us = |d: Duration| d.as_secs_f64() * 1e6 / calls as f64;
    let (mut proto, mut udp, mut tcp, mut floor, mut per_call) = (vec![], vec![], vec![], vec![], 0.0);
    println!("{:>4} {:>10} {:>8} {:>8} {:>7}", "rep", "proto µs", "udp µs", "tcp µs", "floor");
    for rep in 0..reps {
        // Interleaved, so the three see the same machine.
        let (p, datagrams) = proto_calls(&mut client, &mut server, calls, bytes)?;
        let (u, t) = (udp_calls(calls, bytes)?, tcp_calls(calls, bytes)?);
        let (p, u, t) = (us(p), us(u), us(t));
        per_call = datagrams as f64 / calls as f64;
        println!("{rep:>4} {p:>10.2} {u:>8.2} {t:>8.2} {:>7.2}", (p + u) / t);
        proto.push(p);
        udp.push(u);
        tcp.push(t);
        floor.push((p + u) / t);
    }
    println!(
        "median: proto {:.2} µs ({per_call:.2} datagrams a call), udp {:.2} µs, tcp echo {:.2} µs; \
         floor (proto + udp) / tcp = {:.2}x (issue 20 asks <= 1.5x)",
        median(proto),
        median(udp),
        median(tcp),
        median(floor)
    );
    Ok(())
}
