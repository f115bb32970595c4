//! Message RPC between oar's processes.
//!
//! A call is one request [`Frame`] answered by one response [`Frame`]. A frame
//! carries a method number, typed control metadata (any serde type, encoded
//! with postcard) and a raw tensor payload: little-endian `f32` in a
//! [`bytes::Bytes`], copied in bulk and never serialised element by element.
//!
//! The [`Transport`] trait is the seam: [`MemTransport`] connects endpoints
//! inside one process (unit tests); [`QuicTransport`] runs over QUIC (quinn,
//! rustls with ring, TLS 1.3) between processes. Servers implement
//! [`Handler`]; clients get a [`Connection`]. Every call takes a timeout and
//! ends with a typed [`Error`], never a hang.
//!
//! A client that has the payload in pieces, or wants the reply's payload
//! somewhere of its own, uses [`Connection::call_parts`] ([`call_parts`]):
//! the request is sent from borrowed parts and the reply is handed to a
//! [`PayloadSink`] as it arrives, so neither side of the client needs a
//! buffer the size of the message (how a trainer pushes gradients from, and
//! pulls parameters into, its model's buffer).
//!
//! ## QUIC
//!
//! Each call in flight has a bidirectional stream of its own carrying its
//! request frame and its reply frame, so a 400 MB tensor never blocks a
//! small call. A call whose request is at most 64 KiB goes on a *kept
//! stream*, one of a few per peer that carry one call after another: a
//! small call then does not open, finish and wait out the acknowledgement
//! of a stream (see [`QuicTransport`] for how a timeout, an error and a
//! retired stream are handled; the layout is in [`wire`]). A client keeps
//! one connection per peer address (with keep-alive and an idle timeout) and
//! dials again when it died, e.g. because the peer restarted. A server
//! serves each connection in a task of its own, which runs a call as far as
//! it goes without waiting (all of most small calls); a call that has to
//! wait continues in a task of its own. A large payload is received into a
//! reused buffer ([`QuicOptions::receive_pool`]). On glibc a transport
//! also raises malloc's dynamic thresholds once, so that quinn's
//! per-datagram buffers are not given back to the kernel and faulted in
//! again by every large transfer: this touches the whole process's
//! allocator, so [`QuicOptions::glibc_mmap_threshold`] says exactly how,
//! and 0 turns it off. A malformed,
//! oversized or stalled request gets an error reply ([`RemoteErrorKind::BadRequest`])
//! and costs nothing else. The frame layout and its checks are in [`wire`];
//! tuning is in [`QuicOptions`].
//!
//! ## Who gets in
//!
//! Mutual TLS, always: a server requires a client certificate signed by the
//! job's CA, and a client accepts only a server signed by the same CA. Every
//! certificate must carry the DNS name `oar` ([`DEFAULT_SERVER_NAME`]) as a
//! subject alternative name: clients verify that fixed name rather than a
//! host name, so processes can call each other by IP address, and the
//! identity that counts is "signed by this job's CA". Certificates also need
//! the `serverAuth` and `clientAuth` extended key usages (every process is
//! both).
//!
//! For tests and single-machine runs, `DevCa` (feature `dev-ca`, which
//! pulls in `rcgen`; not for production) makes a CA and certificates in
//! memory. For a cluster, make one CA per job and one certificate per
//! process, and give each process `ca.pem`, its `NAME.pem` and `NAME.key`
//! ([`TlsConfig::from_pem_files`]); keep `ca.key` off the cluster. Either
//! write them with `DevCa::write_files` (what `examples/certs.rs DIR NAME...`
//! does), or with openssl:
//!
//! ```text
//! openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
//!     -keyout ca.key -out ca.pem -days 3650 -subj "/CN=oar job CA" \
//!     -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
//! printf 'subjectAltName=DNS:oar\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature\n' > oar.ext
//! for name in master pserver-0 pserver-1 trainer-0 trainer-1; do
//!     openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
//!         -keyout $name.key -out $name.csr -subj "/CN=$name"
//!     openssl x509 -req -in $name.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
//!         -days 365 -extfile oar.ext -out $name.pem
//! done
//! ```
//!
//! A certificate made without the `oar` name can still be used by verifying
//! another name: [`TlsConfig::with_server_name`].
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use async_trait::async_trait;
//! use oar_transport::{DevCa, Frame, Handler, QuicTransport, RemoteError, Transport};
//!
//! struct Echo;
//! #[async_trait]
//! impl Handler for Echo {
//!     async fn handle(&self, request: Frame) -> Result<Frame, RemoteError> {
//!         Ok(request)
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let ca = DevCa::new()?;
//! let server = QuicTransport::new(ca.tls_config("pserver-0")?)?;
//! let listener = server.serve("127.0.0.1:0", Arc::new(Echo)).await?;
//! let client = QuicTransport::new(ca.tls_config("trainer-0")?)?;
//! let conn = client.connect(oar_transport::Listener::local_addr(&listener)).await?;
//! let reply = conn.call(Frame::new(1, "hello", oar_transport::f32s_to_bytes(&[1.0]))?, Duration::from_secs(5)).await?;
//! assert_eq!(reply.meta::<String>()?, "hello");
//! # Ok::<(), oar_transport::Error>(())
//! # }).unwrap();
//! ```
//!
//! Inside one process, over [`MemTransport`]:
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use async_trait::async_trait;
//! use oar_transport::{call, f32s_to_bytes, Frame, Handler, MemNetwork, MemTransport, RemoteError, Transport};
//!
//! /// Doubles every float of the payload.
//! struct Doubler;
//! #[async_trait]
//! impl Handler for Doubler {
//!     async fn handle(&self, request: Frame) -> Result<Frame, RemoteError> {
//!         let mut v = request.payload_f32()?;
//!         v.iter_mut().for_each(|x| *x *= 2.0);
//!         Frame::new(request.method, &"doubled", f32s_to_bytes(&v)).map_err(RemoteError::internal)
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let transport = MemTransport::new(MemNetwork::new());
//! let listener = transport.listen("mem:0", Arc::new(Doubler)).await?;
//! let conn = transport.connect(listener.local_addr()).await?;
//! let (note, payload): (String, _) =
//!     call(conn.as_ref(), 1, &(), f32s_to_bytes(&[1.0, 2.5]), Duration::from_secs(1)).await?;
//! assert_eq!(note, "doubled");
//! assert_eq!(oar_transport::bytes_to_f32s(&payload)?, vec![2.0, 5.0]);
//! # Ok::<(), oar_transport::Error>(())
//! # }).unwrap();
//! ```
#![warn(missing_docs)]

#[cfg(feature = "dev-ca")]
mod dev_ca;
mod error;
mod frame;
mod gso;
mod malloc;
mod mem;
mod pool;
mod quic;
mod retry;
mod tls;
pub mod wire;

#[cfg(feature = "dev-ca")]
pub use dev_ca::{DevCa, Issued};
pub use error::{Error, RemoteError, RemoteErrorKind, Result};
pub use frame::{
    bytes_to_f32s, copy_f32s_from_bytes, f32s_as_le_bytes, f32s_shared, f32s_to_bytes, f32s_view, put_f32s,
    Frame, FrameParts,
};
pub use mem::{MemNetwork, MemTransport};
pub use quic::{PathTuning, QuicListener, QuicOptions, QuicTransport};
pub use retry::{deadline_in, RetryPolicy, Retrying, Transient};
pub use tls::{Cipher, TlsConfig, ALPN, DEFAULT_SERVER_NAME};

use async_trait::async_trait;
use serde::{de::DeserializeOwned, Serialize};
use std::{sync::Arc, time::Duration};

/// The server side of a call: turns one request into one response.
///
/// Handlers run concurrently: a call that has to wait (in the handler, or
/// for its request) runs in a task of its own. A handler that cannot make
/// sense of a request returns a [`RemoteError`]; it never panics.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Answer one request.
    async fn handle(&self, request: Frame) -> std::result::Result<Frame, RemoteError>;

    /// As [`handle`](Self::handle), with the reply's payload in parts that
    /// a transport sends one after another without joining them (the QUIC
    /// transport calls this one). The default answers with `handle`'s
    /// payload as its one part; a handler whose replies are views of data
    /// it holds in several buffers overrides it (and makes `handle` join).
    /// A handler that wraps another forwards both methods.
    async fn handle_parts(&self, request: Frame) -> std::result::Result<FrameParts, RemoteError> {
        self.handle(request).await.map(FrameParts::from)
    }
}

/// Where the payload of a reply goes when a call does not keep it
/// ([`Connection::call_parts`]): written in place as it arrives, e.g. into a
/// model's parameters, instead of into a buffer of its own.
pub trait PayloadSink: Send {
    /// The reply carries `len` bytes of payload. An error refuses them (the
    /// call fails with it). Called once per reply, before any `write`; a
    /// retried call starts again.
    fn start(&mut self, len: u64) -> Result<()>;
    /// The next bytes of the payload, in order, `len` in all.
    fn write(&mut self, bytes: &[u8]);
}

/// A client's handle to one peer. Cheap to share; calls may run concurrently.
///
/// A connection to a peer that went away and came back at the same address
/// reconnects on the next call instead of failing forever.
#[async_trait]
pub trait Connection: Send + Sync + 'static {
    /// Send `request` and wait at most `timeout` for the response.
    async fn call(&self, request: Frame, timeout: Duration) -> Result<Frame>;

    /// A call whose request payload is `payload` joined, sent from where the
    /// parts are (not copied into one buffer first), and whose reply payload
    /// goes into `sink` as it arrives (the returned frame's payload is
    /// empty). The default joins the parts and copies the reply, for
    /// transports that hold whole messages in memory anyway.
    async fn call_parts(
        &self,
        method: u16,
        meta: bytes::Bytes,
        payload: &[&[u8]],
        sink: &mut dyn PayloadSink,
        timeout: Duration,
    ) -> Result<Frame> {
        let mut joined = bytes::BytesMut::with_capacity(payload.iter().map(|p| p.len()).sum());
        payload.iter().for_each(|part| joined.extend_from_slice(part));
        let reply = self.call(Frame { method, meta, payload: joined.freeze() }, timeout).await?;
        sink.start(reply.payload.len() as u64)?;
        sink.write(&reply.payload);
        Ok(Frame { payload: bytes::Bytes::new(), ..reply })
    }
    /// The address this connection talks to.
    fn peer(&self) -> &str;
}

/// A bound server endpoint. Dropping it or calling [`Listener::close`] stops
/// new calls from reaching the handler; calls already running finish.
pub trait Listener: Send + Sync {
    /// The address actually bound (with port 0 resolved), to publish in discovery.
    fn local_addr(&self) -> &str;
    /// Stop accepting calls.
    fn close(&self);
}

/// How endpoints find and call each other.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// A connection to the endpoint listening at `addr`.
    async fn connect(&self, addr: &str) -> Result<Arc<dyn Connection>>;
    /// Serve `handler` at `addr`.
    async fn listen(&self, addr: &str, handler: Arc<dyn Handler>) -> Result<Box<dyn Listener>>;
}

/// Make a typed call: encode `request` as the metadata of method `method`,
/// send it with `payload`, and decode the response's metadata as `Resp`.
pub async fn call<Req, Resp>(
    conn: &dyn Connection,
    method: u16,
    request: &Req,
    payload: bytes::Bytes,
    timeout: Duration,
) -> Result<(Resp, bytes::Bytes)>
where
    Req: Serialize + ?Sized,
    Resp: DeserializeOwned,
{
    counted(
        async {
            let frame = Frame::new(method, request, payload)?;
            let response = conn.call(frame, timeout).await?;
            let meta = response.meta()?;
            Ok((meta, response.payload))
        }
        .await,
    )
}

/// [`call`] through [`Connection::call_parts`]: the request's payload is
/// `payload` joined, sent from where it is, and the response's payload is
/// written into `sink`.
pub async fn call_parts<Req, Resp>(
    conn: &dyn Connection,
    method: u16,
    request: &Req,
    payload: &[&[u8]],
    sink: &mut dyn PayloadSink,
    timeout: Duration,
) -> Result<Resp>
where
    Req: Serialize + ?Sized,
    Resp: DeserializeOwned,
{
    counted(
        async {
            let meta = Frame::new(method, request, bytes::Bytes::new())?.meta;
            conn.call_parts(method, meta, payload, sink, timeout).await?.meta()
        }
        .await,
    )
}

/// Poll every future in `futures` until all are done; they run
/// concurrently on the calling task, so they may borrow from it. Outputs
/// come in the same order. (futures-util's, re-exported for the crates that
/// build on this one.)
pub use futures_util::future::join_all;

/// Counts a failed call in the metrics by the kind of its error.
fn counted<T>(result: Result<T>) -> Result<T> {
    if let Err(e) = &result {
        metrics().errors.get_or_create(&vec![("kind".to_string(), e.kind_name().to_string())]).inc();
    }
    result
}

/// The transport's metrics, registered on first use.
struct Metrics {
    /// Failed calls by kind of error.
    errors: oar_metrics::Family<Vec<(String, String)>, oar_metrics::Counter>,
}

fn metrics() -> &'static Metrics {
    static METRICS: std::sync::LazyLock<Metrics> = std::sync::LazyLock::new(|| {
        let m = Metrics { errors: Default::default() };
        oar_metrics::register("oar_transport_errors", "Failed calls, by kind of error.", m.errors.clone());
        m
    });
    &METRICS
}
