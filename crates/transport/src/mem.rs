use crate::{Connection, Error, Frame, FrameParts, Handler, Listener, Result, Transport};
use async_trait::async_trait;
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

/// The address book of in-process endpoints. Transports built on the same
/// network can call each other; separate networks are isolated.
#[derive(Clone, Default)]
pub struct MemNetwork {
    inner: Arc<NetworkInner>,
}

#[derive(Default)]
struct NetworkInner {
    endpoints: Mutex<HashMap<String, Arc<dyn Handler>>>,
    next_port: AtomicU64,
}

impl MemNetwork {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    fn handler(&self, addr: &str) -> Option<Arc<dyn Handler>> {
        let endpoints = self.inner.endpoints.lock().unwrap_or_else(PoisonError::into_inner);
        endpoints.get(addr).cloned()
    }
}

/// A transport between endpoints of one process, for tests and
/// single-machine runs.
///
/// Addresses look like `mem:NAME`; `mem:0` picks a fresh name. Each call runs
/// its handler in a task of its own, as a network server would, so a caller
/// that times out does not cancel the handler halfway.
#[derive(Clone)]
pub struct MemTransport {
    network: MemNetwork,
}

impl MemTransport {
    /// A transport on `network`.
    pub fn new(network: MemNetwork) -> Self {
        Self { network }
    }
}

struct MemConnection {
    network: MemNetwork,
    addr: String,
}

#[async_trait]
impl Connection for MemConnection {
    async fn call(&self, request: Frame, timeout: Duration) -> Result<Frame> {
        // Look the handler up on every call: a restarted endpoint is found again.
        let handler =
            self.network.handler(&self.addr).ok_or_else(|| Error::Unreachable { addr: self.addr.clone() })?;
        let task = tokio::spawn(async move { handler.handle_parts(request).await.map(FrameParts::join) });
        match tokio::time::timeout(timeout, task).await {
            Err(_) => Err(Error::Timeout { addr: self.addr.clone(), after: timeout }),
            Ok(Err(_join_error)) => Err(Error::Closed { addr: self.addr.clone() }),
            Ok(Ok(Err(error))) => Err(Error::Remote { addr: self.addr.clone(), error }),
            Ok(Ok(Ok(frame))) => Ok(frame),
        }
    }

    fn peer(&self) -> &str {
        &self.addr
    }
}

struct MemListener {
    network: MemNetwork,
    addr: String,
    handler: Arc<dyn Handler>,
}

impl Listener for MemListener {
    fn local_addr(&self) -> &str {
        &self.addr
    }

    fn close(&self) {
        let mut endpoints = self.network.inner.endpoints.lock().unwrap_or_else(PoisonError::into_inner);
        // Only remove our own registration: a successor may already have the name.
        if endpoints.get(&self.addr).is_some_and(|h| Arc::ptr_eq(h, &self.handler)) {
            endpoints.remove(&self.addr);
        }
    }
}

impl Drop for MemListener {
    fn drop(&mut self) {
        self.close();
    }
}

fn parse_name(addr: &str) -> Result<&str> {
    match addr.strip_prefix("mem:") {
        Some(name) if !name.is_empty() => Ok(name),
        _ => Err(Error::InvalidAddress { addr: addr.to_string(), reason: "expected mem:NAME".into() }),
    }
}

#[async_trait]
impl Transport for MemTransport {
    async fn connect(&self, addr: &str) -> Result<Arc<dyn Connection>> {
        parse_name(addr)?;
        Ok(Arc::new(MemConnection { network: self.network.clone(), addr: addr.to_string() }))
    }

    async fn listen(&self, addr: &str, handler: Arc<dyn Handler>) -> Result<Box<dyn Listener>> {
        let name = parse_name(addr)?;
        let inner = &self.network.inner;
        let mut endpoints = inner.endpoints.lock().unwrap_or_else(PoisonError::into_inner);
        let addr = if name == "0" {
            loop {
                let candidate = format!("mem:{}", inner.next_port.fetch_add(1, Ordering::Relaxed) + 1);
                if !endpoints.contains_key(&candidate) {
                    break candidate;
                }
            }
        } else if endpoints.contains_key(addr) {
            return Err(Error::AddrInUse(addr.to_string()));
        } else {
            addr.to_string()
        };
        endpoints.insert(addr.clone(), handler.clone());
        Ok(Box::new(MemListener { network: self.network.clone(), addr, handler }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{call, RemoteError, RemoteErrorKind};
    use bytes::Bytes;

    struct Echo;
    #[async_trait]
    impl Handler for Echo {
        async fn handle(&self, request: Frame) -> std::result::Result<Frame, RemoteError> {
            match request.method {
                1 => Ok(request),
                2 => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(request)
                }
                m => Err(RemoteError::bad_request(format!("unknown method {m}"))),
            }
        }

        async fn handle_parts(&self, request: Frame) -> std::result::Result<FrameParts, RemoteError> {
            if request.method != 3 {
                return self.handle(request).await.map(FrameParts::from);
            }
            // Method 3: the payload echoed in two parts, the second first.
            let half = request.payload.len() / 2;
            let payload = vec![request.payload.slice(half..), request.payload.slice(..half)];
            Ok(FrameParts { method: 3, meta: request.meta, payload })
        }
    }

    async fn echo_endpoint() -> (MemTransport, Box<dyn Listener>) {
        let t = MemTransport::new(MemNetwork::new());
        let l = t.listen("mem:0", Arc::new(Echo)).await.unwrap();
        (t, l)
    }

    #[tokio::test]
    async fn call_round_trips_meta_and_payload() {
        let (t, l) = echo_endpoint().await;
        let c = t.connect(l.local_addr()).await.unwrap();
        let (meta, payload): (String, Bytes) =
            call(c.as_ref(), 1, "hi", Bytes::from_static(b"abcd"), Duration::from_secs(1)).await.unwrap();
        assert_eq!(meta, "hi");
        assert_eq!(payload.as_ref(), b"abcd");
    }

    #[tokio::test]
    async fn a_reply_in_parts_arrives_joined() {
        let (t, l) = echo_endpoint().await;
        let c = t.connect(l.local_addr()).await.unwrap();
        let (_, payload): ((), Bytes) =
            call(c.as_ref(), 3, &(), Bytes::from_static(b"abcdef"), Duration::from_secs(1)).await.unwrap();
        assert_eq!(payload.as_ref(), b"defabc");
    }

    #[tokio::test]
    async fn handler_errors_reach_the_caller_typed() {
        let (t, l) = echo_endpoint().await;
        let c = t.connect(l.local_addr()).await.unwrap();
        let err = c.call(Frame { method: 9, ..Frame::default() }, Duration::from_secs(1)).await.unwrap_err();
        match err {
            Error::Remote { error, .. } => {
                assert_eq!(error.kind, RemoteErrorKind::BadRequest);
                assert!(error.message.contains("unknown method 9"));
            }
            other => panic!("expected a remote error, got {other}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_never_answers_times_out() {
        let (t, l) = echo_endpoint().await;
        let c = t.connect(l.local_addr()).await.unwrap();
        let err =
            c.call(Frame { method: 2, ..Frame::default() }, Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
    }

    #[tokio::test]
    async fn closed_listener_is_unreachable_and_a_successor_is_found_again() {
        let (t, l) = echo_endpoint().await;
        let addr = l.local_addr().to_string();
        let c = t.connect(&addr).await.unwrap();
        drop(l);
        let err = c.call(Frame { method: 1, ..Frame::default() }, Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, Error::Unreachable { .. }), "{err}");
        let _again = t.listen(&addr, Arc::new(Echo)).await.unwrap();
        c.call(Frame { method: 1, ..Frame::default() }, Duration::from_secs(1)).await.unwrap();
    }

    #[tokio::test]
    async fn names_are_exclusive_and_validated() {
        let (t, l) = echo_endpoint().await;
        let err = t.listen(l.local_addr(), Arc::new(Echo)).await.err().unwrap();
        assert!(matches!(err, Error::AddrInUse(_)));
        assert!(matches!(t.connect("127.0.0.1:80").await.err().unwrap(), Error::InvalidAddress { .. }));
    }
}
