//! Shared pieces of the QUIC tests: a test service, servers and clients on
//! 127.0.0.1, and raw quinn clients that can send anything.
#![allow(dead_code)]

use async_trait::async_trait;
use bytes::Bytes;
use oar_transport::{
    f32s_to_bytes, Connection, DevCa, Error, Frame, FrameParts, Handler, Listener, QuicListener, QuicOptions,
    QuicTransport, RemoteError, TlsConfig, Transport,
};
use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::sync::{watch, Notify};

pub const ECHO: u16 = 1;
pub const SLEEP_FOREVER: u16 = 2;
pub const FAIL: u16 = 3;
pub const PANIC: u16 = 4;
/// Replies with as many zero floats as the u64 in the metadata.
pub const BIG_REPLY: u16 = 5;
/// Waits for the gate, then echoes.
pub const GATED: u16 = 6;
/// Sleeps 300 ms, then echoes.
pub const SLOW: u16 = 7;
/// Replies with the address of the request's payload (u64): shows whether
/// receive buffers are reused.
pub const ADDRESS: u16 = 8;
/// As BIG_REPLY, and notifies `replied` once the reply is made.
pub const BIG_THEN_NOTIFY: u16 = 9;
/// Echoes the payload as a reply in parts ([`parts_of`]); answered by
/// `handle_parts` only (`handle` refuses it).
pub const PARTS: u16 = 10;

/// `payload` cut into parts of 0, 1, 7 and 4093 bytes, then the rest,
/// then an empty one: views of `payload`, not copies.
pub fn parts_of(payload: &Bytes) -> Vec<Bytes> {
    let mut parts = Vec::new();
    let mut at = 0;
    for len in [0, 1, 7, 4093] {
        let end = (at + len).min(payload.len());
        parts.push(payload.slice(at..end));
        at = end;
    }
    parts.push(payload.slice(at..));
    parts.push(Bytes::new());
    parts
}

/// The test service. Counts the calls it answered.
#[derive(Default)]
pub struct TestService {
    pub entered: AtomicUsize,
    pub answered: AtomicUsize,
    pub gate: Notify,
    pub replied: Notify,
}

#[async_trait]
impl Handler for TestService {
    async fn handle(&self, request: Frame) -> Result<Frame, RemoteError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let reply = match request.method {
            ECHO => Ok(request),
            SLEEP_FOREVER => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(request)
            }
            FAIL => Err(RemoteError::bad_request("method 3 always fails")),
            PANIC => panic!("test handler panics on purpose"),
            BIG_REPLY | BIG_THEN_NOTIFY => {
                let n: u64 = request.meta()?;
                if request.method == BIG_THEN_NOTIFY {
                    self.replied.notify_one();
                }
                Ok(Frame {
                    method: BIG_REPLY,
                    meta: Bytes::new(),
                    payload: Bytes::from(vec![0u8; n as usize * 4]),
                })
            }
            GATED => {
                self.gate.notified().await;
                Ok(request)
            }
            SLOW => {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(request)
            }
            ADDRESS => Frame::new(ADDRESS, &(request.payload.as_ptr() as u64), Bytes::new())
                .map_err(RemoteError::internal),
            PARTS => Err(RemoteError::bad_request("method 10 is answered by handle_parts only")),
            m => Err(RemoteError::bad_request(format!("unknown method {m}"))),
        };
        self.answered.fetch_add(1, Ordering::SeqCst);
        reply
    }

    async fn handle_parts(&self, request: Frame) -> Result<FrameParts, RemoteError> {
        if request.method != PARTS {
            return self.handle(request).await.map(FrameParts::from);
        }
        self.entered.fetch_add(1, Ordering::SeqCst);
        self.answered.fetch_add(1, Ordering::SeqCst);
        Ok(FrameParts { method: PARTS, meta: request.meta, payload: parts_of(&request.payload) })
    }
}

/// Short deadlines so that stalls end quickly in tests.
pub fn test_options() -> QuicOptions {
    QuicOptions {
        stream_idle_timeout: Duration::from_millis(300),
        close_grace: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(5),
        keep_alive: Duration::from_secs(1),
        max_message: 64 << 20,
        ..QuicOptions::default()
    }
}

pub struct Server {
    pub transport: QuicTransport,
    pub listener: QuicListener,
    pub service: Arc<TestService>,
    pub tls: TlsConfig,
}

impl Server {
    pub fn addr(&self) -> String {
        self.listener.local_addr().to_string()
    }
}

pub async fn start_server(ca: &DevCa) -> Server {
    start_server_with(ca.tls_config("server").unwrap(), "127.0.0.1:0").await
}

pub async fn start_server_with(tls: TlsConfig, addr: &str) -> Server {
    let transport = QuicTransport::with_options(tls.clone(), test_options()).unwrap();
    let service = Arc::new(TestService::default());
    let listener = transport.serve(addr, service.clone()).await.unwrap();
    Server { transport, listener, service, tls }
}

pub fn client(ca: &DevCa, name: &str) -> QuicTransport {
    QuicTransport::with_options(ca.tls_config(name).unwrap(), test_options()).unwrap()
}

/// One echo call that must succeed and come back intact.
pub async fn echo_ok(conn: &dyn Connection, i: u32) {
    let payload = f32s_to_bytes(&[i as f32, 0.5, -1.0]);
    let frame = Frame::new(ECHO, &(i, "ping"), payload.clone()).unwrap();
    let reply = conn.call(frame, Duration::from_secs(5)).await.unwrap();
    assert_eq!(reply.meta::<(u32, String)>().unwrap(), (i, "ping".to_string()));
    assert_eq!(reply.payload, payload);
}

/// A well-behaved client calling in a loop until told to stop; every call
/// must succeed. Join it to get the number of calls made.
pub struct GoodClient {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<u32>,
}

impl GoodClient {
    pub async fn start(ca: &DevCa, addr: &str) -> GoodClient {
        let transport = client(ca, "good-client");
        let conn = transport.connect(addr).await.unwrap();
        echo_ok(conn.as_ref(), 0).await;
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let _keep = transport;
            let mut i = 1;
            // At least a few calls, so that they overlap the bad input.
            while i <= 3 || !*stopped.borrow_and_update() {
                echo_ok(conn.as_ref(), i).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // One more after the bad input is over.
            echo_ok(conn.as_ref(), i).await;
            i
        });
        GoodClient { stop, task }
    }

    /// Stop, and check the client made calls throughout.
    pub async fn finish(self) -> u32 {
        self.stop.send_replace(true);
        let calls = self.task.await.expect("the good client's calls all succeed");
        assert!(calls >= 4, "the good client made {calls} calls");
        calls
    }

    /// Stop, and check that the good client's calls (and its first one) are
    /// the only ones that reached `server`'s handler: no bad stream did.
    pub async fn finish_as_the_only_caller_of(self, server: &Server) {
        let calls = self.finish().await;
        assert_eq!(
            server.service.entered.load(std::sync::atomic::Ordering::SeqCst) as u32,
            calls + 1,
            "no bad stream reached the handler"
        );
    }
}

/// A raw quinn client endpoint on 127.0.0.1 with the given TLS settings.
pub fn raw_endpoint(tls: rustls::ClientConfig) -> quinn::Endpoint {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    endpoint
}

/// A raw connection with a valid identity from `ca`.
pub async fn raw_connection(ca: &DevCa, addr: &str) -> (quinn::Endpoint, quinn::Connection) {
    let endpoint = raw_endpoint(ca.tls_config("raw").unwrap().rustls_client_config().unwrap());
    let conn = endpoint.connect(addr.parse().unwrap(), "oar").unwrap().await.unwrap();
    (endpoint, conn)
}

/// Send `bytes` on a fresh stream (finishing it if `finish`), and read what
/// comes back: the server's reply decoded, or the stream error.
pub async fn raw_exchange(
    conn: &quinn::Connection,
    bytes: &[u8],
    finish: bool,
) -> Result<(u8, RemoteError), String> {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    // The server may stop reading early: a failed write is not the end.
    let _ = send.write_all(bytes).await;
    if finish {
        let _ = send.finish();
    }
    let reply = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(1 << 20))
        .await
        .map_err(|_| "no reply within 5 s".to_string())?
        .map_err(|e| e.to_string())?;
    let (kind, frame) = oar_transport::wire::decode(&reply, oar_transport::wire::Expect::Reply, 1 << 20)
        .map_err(|e| format!("undecodable reply: {e}"))?;
    let error = frame.meta::<RemoteError>().map_err(|e| format!("reply is not an error: {e}"))?;
    Ok((kind as u8, error))
}

/// Deterministic pseudo-random bytes.
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Whether `e` is the error of a call refused by TLS or cut off by it.
pub fn is_refusal(e: &Error) -> bool {
    matches!(e, Error::Refused { .. })
}
