//! Message RPC between oar's processes.
//!
//! A call is one request [`Frame`] answered by one response [`Frame`]. A frame
//! carries a method number, typed control metadata (any serde type, encoded
//! with postcard) and a raw tensor payload: little-endian `f32` in a
//! [`bytes::Bytes`], copied in bulk and never serialised element by element.
//!
//! The [`Transport`] trait is the seam: [`MemTransport`] connects endpoints
//! inside one process (tests, single-machine runs); the QUIC transport maps
//! each call onto one bidirectional stream, so a large transfer never blocks a
//! small call. Servers implement [`Handler`]; clients get a [`Connection`].
//! Every call takes a timeout and ends with a typed [`Error`], never a hang.
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

mod error;
mod frame;
mod mem;
mod retry;

pub use error::{Error, RemoteError, RemoteErrorKind, Result};
pub use frame::{bytes_to_f32s, copy_f32s_from_bytes, f32s_to_bytes, put_f32s, Frame};
pub use mem::{MemNetwork, MemTransport};
pub use retry::{RetryPolicy, Transient};

use async_trait::async_trait;
use serde::{de::DeserializeOwned, Serialize};
use std::{sync::Arc, time::Duration};

/// The server side of a call: turns one request into one response.
///
/// Handlers run concurrently, one task per call. A handler that cannot make
/// sense of a request returns a [`RemoteError`]; it never panics.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Answer one request.
    async fn handle(&self, request: Frame) -> std::result::Result<Frame, RemoteError>;
}

/// A client's handle to one peer. Cheap to share; calls may run concurrently.
///
/// A connection to a peer that went away and came back at the same address
/// reconnects on the next call instead of failing forever.
#[async_trait]
pub trait Connection: Send + Sync + 'static {
    /// Send `request` and wait at most `timeout` for the response.
    async fn call(&self, request: Frame, timeout: Duration) -> Result<Frame>;
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
    let frame = Frame::new(method, request, payload)?;
    let response = conn.call(frame, timeout).await?;
    let meta = response.meta()?;
    Ok((meta, response.payload))
}
