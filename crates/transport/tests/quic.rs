//! QuicTransport end to end on 127.0.0.1: calls, errors, deadlines,
//! reconnection after a restart, graceful close.

mod common;

use common::*;
use oar_transport::{
    bytes_to_f32s, call, f32s_to_bytes, DevCa, Error, Frame, Listener, PathTuning, QuicOptions,
    QuicTransport, RemoteErrorKind, RetryPolicy, Transport,
};
use std::{sync::atomic::Ordering, sync::Arc, time::Duration};

#[tokio::test]
async fn calls_round_trip_and_share_one_connection() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let addr = server.addr();
    let (ip, port) = addr.rsplit_once(':').unwrap();
    assert_eq!(ip, "127.0.0.1");
    assert_ne!(port.parse::<u16>().unwrap(), 0, "port 0 resolved");

    let client = client(&ca, "trainer-0");
    let a = client.connect(&addr).await.unwrap();
    let b = client.connect(&addr).await.unwrap();
    assert_eq!(a.peer(), addr);
    let (note, payload): (String, _) =
        call(a.as_ref(), ECHO, "hello", f32s_to_bytes(&[1.5, 2.5]), Duration::from_secs(5)).await.unwrap();
    assert_eq!(note, "hello");
    assert_eq!(bytes_to_f32s(&payload).unwrap(), vec![1.5, 2.5]);
    let calls = (0..40).map(|i| {
        let conn = if i % 2 == 0 { a.clone() } else { b.clone() };
        async move { echo_ok(conn.as_ref(), i).await }
    });
    futures_util::future::join_all(calls).await;
    assert_eq!(client.live_connections(), 1, "both handles use one connection");
    assert_eq!(server.service.answered.load(Ordering::SeqCst), 41);
}

#[tokio::test]
async fn a_timeout_past_the_clock_s_range_is_no_limit_not_a_panic() {
    // `Instant::now() + Duration::MAX` panics; a caller that means "no
    // limit" gets a deadline decades away.
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let options = QuicOptions { connect_timeout: Duration::MAX, ..test_options() };
    let client = QuicTransport::with_options(ca.tls_config("c").unwrap(), options).unwrap();
    let conn = client.connect(&server.addr()).await.unwrap();
    let (note, payload): (String, _) =
        call(conn.as_ref(), ECHO, "forever", f32s_to_bytes(&[7.0]), Duration::MAX).await.unwrap();
    assert_eq!(note, "forever");
    assert_eq!(bytes_to_f32s(&payload).unwrap(), vec![7.0]);
}

#[tokio::test]
async fn a_large_payload_arrives_intact() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    let values: Vec<f32> = (0..3_000_000).map(|i| i as f32 * 0.25).collect();
    let reply = conn
        .call(Frame::new(ECHO, &(), f32s_to_bytes(&values)).unwrap(), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(bytes_to_f32s(&reply.payload).unwrap(), values);
}

#[tokio::test]
async fn a_reply_in_parts_arrives_as_one_payload() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    for len in [0usize, 5, 3_000_000] {
        let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let reply = conn
            .call(Frame::new(PARTS, "parts", payload.clone().into()).unwrap(), Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(reply.meta::<String>().unwrap(), "parts");
        assert_eq!(reply.payload.len(), len);
        assert!(reply.payload[..] == payload[..], "the parts arrive in order, whole ({len} bytes)");
    }
}

#[tokio::test]
async fn a_large_fixed_mtu_with_segmentation_offload_moves_large_payloads() {
    // quinn batches up to 10 datagrams per GSO send; at 8952 bytes a batch
    // of 10 is over the 65,507 a UDP send may carry, the kernel refused it
    // and quinn-udp reported success, so every batch was lost and this call
    // stalled until its deadline.
    let ca = DevCa::new().unwrap();
    let path = PathTuning { mtu: Some(8952), segmentation_offload: true };
    let options = QuicOptions { loopback: path, network: path, ..test_options() };
    let server = QuicTransport::with_options(ca.tls_config("server").unwrap(), options.clone()).unwrap();
    let service = Arc::new(TestService::default());
    let listener = server.serve("127.0.0.1:0", service.clone()).await.unwrap();
    let client = QuicTransport::with_options(ca.tls_config("c").unwrap(), options).unwrap();
    let conn = client.connect(listener.local_addr()).await.unwrap();
    let values: Vec<f32> = (0..2_000_000).map(|i| i as f32 - 7.5).collect();
    for _ in 0..2 {
        let request = Frame::new(ECHO, &(), f32s_to_bytes(&values)).unwrap();
        let reply = conn.call(request, Duration::from_secs(20)).await.unwrap();
        assert_eq!(bytes_to_f32s(&reply.payload).unwrap(), values);
    }
    assert_eq!(service.answered.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_small_call_completes_while_a_large_one_is_in_flight() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    let big = {
        let conn = conn.clone();
        tokio::spawn(async move {
            let payload = bytes::Bytes::from(vec![7u8; 8 << 20]);
            conn.call(Frame { method: GATED, meta: Default::default(), payload }, Duration::from_secs(30))
                .await
        })
    };
    // The big call is held open by the gate until the small one has succeeded.
    echo_ok(conn.as_ref(), 1).await;
    assert!(!big.is_finished());
    while !big.is_finished() {
        server.service.gate.notify_waiters();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(big.await.unwrap().unwrap().payload.len(), 8 << 20);
}

#[tokio::test]
async fn large_payloads_are_received_into_reused_buffers() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    // Server side: the handler drops each request before it answers, so
    // the next one lands in the same memory (down to half its size). Only
    // payloads from DEFAULT_POOLED_FROM (4 MiB) up are pooled.
    let address = |len: usize| {
        let conn = conn.clone();
        async move {
            let request = Frame { method: ADDRESS, meta: Default::default(), payload: vec![1u8; len].into() };
            conn.call(request, Duration::from_secs(10)).await.unwrap().meta::<u64>().unwrap()
        }
    };
    let first = address(40 << 20).await;
    assert_eq!(address(40 << 20).await, first);
    assert_eq!(address(32 << 20).await, first);
    // Client side: a large reply kept whole (`call`) lands in the memory
    // of the previous one once the caller has dropped it.
    let big = || {
        conn.call(Frame::new(BIG_REPLY, &(10u64 << 20), Default::default()).unwrap(), Duration::from_secs(10))
    };
    let reply = big().await.unwrap();
    let at = reply.payload.as_ptr();
    drop(reply);
    let again = big().await.unwrap();
    assert_eq!(again.payload.as_ptr(), at);
    assert!(again.payload.iter().all(|b| *b == 0) && again.payload.len() == 40 << 20);
}

#[tokio::test]
async fn a_close_waits_for_a_reply_still_on_its_way() {
    // A 2 MiB reply fits quinn's send window, so the connection's task
    // writes it at once and keeps only its stream, awaiting the peer's
    // acknowledgement; the close comes while most of it is still to be
    // sent, and must wait for it rather than cut it short.
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    echo_ok(conn.as_ref(), 0).await;
    let call = {
        let conn = conn.clone();
        let request = Frame::new(BIG_THEN_NOTIFY, &(512u64 << 10), Default::default()).unwrap();
        tokio::spawn(async move { conn.call(request, Duration::from_secs(10)).await })
    };
    server.service.replied.notified().await;
    server.listener.close();
    let reply = call.await.unwrap().expect("the reply arrives whole despite the close");
    assert_eq!(reply.payload.len(), 2 << 20);
    tokio::time::timeout(Duration::from_secs(10), server.listener.wait_closed()).await.unwrap();
}

#[tokio::test]
async fn a_close_never_cuts_an_answered_reply_short() {
    // Replies finished but not yet acknowledged are awaited by the
    // connection's task: a close must wait for them, not drop them.
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    let callers = (0..32).map(|i| {
        let conn = conn.clone();
        tokio::spawn(async move {
            let mut ok = 0usize;
            while conn
                .call(Frame::new(ECHO, &i, Default::default()).unwrap(), Duration::from_secs(5))
                .await
                .is_ok()
            {
                ok += 1;
            }
            ok
        })
    });
    let callers: Vec<_> = callers.collect();
    while server.service.answered.load(Ordering::SeqCst) < 200 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    server.listener.close();
    let mut received = 0;
    for caller in callers {
        received += caller.await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), server.listener.wait_closed()).await.unwrap();
    assert_eq!(received, server.service.answered.load(Ordering::SeqCst), "every answered call got its reply");
}

#[tokio::test]
async fn handler_errors_and_panics_reach_the_caller_typed() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    match conn.call(Frame { method: FAIL, ..Frame::default() }, Duration::from_secs(5)).await {
        Err(Error::Remote { addr, error }) => {
            assert_eq!(addr, server.addr());
            assert_eq!(error.kind, RemoteErrorKind::BadRequest);
            assert!(error.message.contains("always fails"), "{}", error.message);
        }
        other => panic!("expected a remote error, got {other:?}"),
    }
    match conn.call(Frame { method: PANIC, ..Frame::default() }, Duration::from_secs(5)).await {
        Err(Error::Remote { error, .. }) => {
            assert_eq!(error.kind, RemoteErrorKind::Internal);
            assert!(error.message.contains("panicked"), "{}", error.message);
        }
        other => panic!("expected a remote error, got {other:?}"),
    }
    echo_ok(conn.as_ref(), 3).await;
}

#[tokio::test]
async fn a_call_past_its_deadline_times_out_and_the_next_call_works() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    echo_ok(conn.as_ref(), 0).await;
    let err =
        conn.call(Frame { method: SLEEP_FOREVER, ..Frame::default() }, Duration::from_millis(300)).await;
    assert!(
        matches!(err, Err(Error::Timeout { ref addr, after }) if *addr == server.addr() && after == Duration::from_millis(300)),
        "{err:?}"
    );
    echo_ok(conn.as_ref(), 1).await;
}

#[tokio::test]
async fn nothing_listening_is_unreachable_within_the_timeout() {
    let ca = DevCa::new().unwrap();
    let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let client = client(&ca, "c");
    let conn = client.connect(&format!("127.0.0.1:{port}")).await.unwrap();
    let err = conn.call(Frame::default(), Duration::from_millis(400)).await.unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
}

#[tokio::test]
async fn messages_over_the_maximum_are_refused_before_sending() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    let too_big = bytes::Bytes::from(vec![0u8; (64 << 20) + 1]);
    let err = conn
        .call(Frame { method: ECHO, meta: Default::default(), payload: too_big }, Duration::from_secs(5))
        .await;
    assert!(matches!(err, Err(Error::TooLarge { max, .. }) if max == 64 << 20), "{err:?}");
    assert_eq!(server.service.answered.load(Ordering::SeqCst), 0);
    // A reply larger than the client's maximum is refused by the client.
    let err =
        call::<_, ()>(conn.as_ref(), BIG_REPLY, &(17u64 << 20), Default::default(), Duration::from_secs(20))
            .await;
    assert!(matches!(err, Err(Error::TooLarge { .. })), "{err:?}");
    echo_ok(conn.as_ref(), 1).await;
}

#[tokio::test]
async fn bad_addresses_and_ports_in_use_are_typed_errors() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let t = client(&ca, "c");
    assert!(matches!(t.connect("mem:1").await.err().unwrap(), Error::InvalidAddress { .. }));
    let err = t.listen(&server.addr(), Arc::new(TestService::default())).await.err().unwrap();
    assert!(matches!(err, Error::AddrInUse(ref a) if *a == server.addr()), "{err}");
}

/// Runs a server on a runtime of its own, so that the test can kill it the
/// way a crash would: no goodbye to the clients.
fn server_on_own_runtime(tls: oar_transport::TlsConfig, addr: &str) -> (tokio::runtime::Runtime, Server) {
    let addr = addr.to_string();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let server = rt.block_on(start_server_with(tls, &addr));
        (rt, server)
    })
    .join()
    .unwrap()
}

async fn crash(rt: tokio::runtime::Runtime, server: Server) {
    // Dropping the runtime first drops every task, endpoint driver included:
    // the socket closes and clients are told nothing.
    std::thread::spawn(move || {
        rt.shutdown_background();
        // Its close signal goes nowhere: the accept task died with the runtime.
        drop(server);
    })
    .join()
    .unwrap();
}

async fn rebind(tls: oar_transport::TlsConfig, addr: &str) -> Server {
    for _ in 0..100 {
        let transport = oar_transport::QuicTransport::with_options(tls.clone(), test_options()).unwrap();
        let service = Arc::new(TestService::default());
        match transport.serve(addr, service.clone()).await {
            Ok(listener) => return Server { transport, listener, service, tls },
            Err(Error::AddrInUse(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("{addr} stayed in use");
}

#[tokio::test]
async fn a_peer_restarted_at_the_same_address_with_the_same_identity_is_reached_again() {
    let ca = DevCa::new().unwrap();
    let tls = ca.tls_config("pserver-0").unwrap();
    let (rt, old) = server_on_own_runtime(tls.clone(), "127.0.0.1:0");
    let addr = old.addr();
    let client = client(&ca, "trainer");
    let conn = client.connect(&addr).await.unwrap();
    echo_ok(conn.as_ref(), 0).await;
    crash(rt, old).await;
    let new = rebind(tls, &addr).await;
    // The restarted server answers the old connection with a stateless reset:
    // the first call fails at once (typed, transient: not a timeout), the
    // next dials again.
    // (The call's 3 s deadline is below the 5 s idle timeout: a Closed here
    // comes from the reset, not from the connection timing out.)
    let first = conn.call(Frame::new(ECHO, &6u32, Default::default()).unwrap(), Duration::from_secs(3)).await;
    assert!(matches!(first, Err(Error::Closed { .. })), "{first:?}");
    let policy = RetryPolicy { give_up_after: Duration::from_secs(10), ..RetryPolicy::default() };
    let frame = Frame::new(ECHO, &7u32, Default::default()).unwrap();
    let reply = policy.run(|| conn.call(frame.clone(), Duration::from_secs(2))).await.unwrap();
    assert_eq!(reply.meta::<u32>().unwrap(), 7);
    assert_eq!(new.service.answered.load(Ordering::SeqCst), 1, "the new server answered");
}

#[tokio::test]
async fn a_peer_restarted_with_a_new_identity_is_reached_again_after_a_timed_out_call() {
    let ca = DevCa::new().unwrap();
    let (rt, old) = server_on_own_runtime(ca.tls_config("pserver-0").unwrap(), "127.0.0.1:0");
    let addr = old.addr();
    let client = client(&ca, "trainer");
    let conn = client.connect(&addr).await.unwrap();
    echo_ok(conn.as_ref(), 0).await;
    crash(rt, old).await;
    // New key: no stateless reset is possible; the silent connection is
    // dropped after one timed-out call.
    let new = rebind(ca.tls_config("pserver-0").unwrap(), &addr).await;
    let policy = RetryPolicy { give_up_after: Duration::from_secs(10), ..RetryPolicy::default() };
    let frame = Frame::new(ECHO, &8u32, Default::default()).unwrap();
    let reply = policy.run(|| conn.call(frame.clone(), Duration::from_millis(500))).await.unwrap();
    assert_eq!(reply.meta::<u32>().unwrap(), 8);
    assert_eq!(new.service.answered.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn close_lets_running_calls_finish_then_releases_the_port() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let addr = server.addr();
    let client = client(&ca, "c");
    let conn = client.connect(&addr).await.unwrap();
    echo_ok(conn.as_ref(), 0).await;
    let gated = {
        let conn = conn.clone();
        tokio::spawn(async move {
            conn.call(Frame::new(GATED, &9u32, Default::default()).unwrap(), Duration::from_secs(10)).await
        })
    };
    while server.service.entered.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.listener.close();
    // Closed to new calls, while the running one is still held by the gate.
    let err =
        conn.call(Frame::new(ECHO, &1u32, Default::default()).unwrap(), Duration::from_millis(500)).await;
    assert!(err.is_err(), "a call after close must fail: {err:?}");
    while !gated.is_finished() {
        server.service.gate.notify_waiters();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reply = gated.await.unwrap().unwrap();
    assert_eq!(reply.meta::<u32>().unwrap(), 9, "the running call finished");
    tokio::time::timeout(Duration::from_secs(10), server.listener.wait_closed()).await.unwrap();
    let err =
        conn.call(Frame::new(ECHO, &1u32, Default::default()).unwrap(), Duration::from_millis(500)).await;
    assert!(matches!(err, Err(Error::Closed { .. } | Error::Unreachable { .. })), "{err:?}");
    assert_eq!(server.service.answered.load(Ordering::SeqCst), 2, "nothing served after close");
    drop(server);
    let again = rebind(ca.tls_config("server").unwrap(), &addr).await;
    echo_ok(conn.as_ref(), 2).await;
    assert_eq!(again.service.answered.load(Ordering::SeqCst), 1);
}

/// A sink that keeps what it is given, refusing any length but `want`.
struct Collect {
    want: Option<u64>,
    got: Vec<u8>,
}

impl oar_transport::PayloadSink for Collect {
    fn start(&mut self, len: u64) -> oar_transport::Result<()> {
        match self.want {
            Some(want) if want != len => {
                Err(Error::PayloadLength { expected: want as usize, got: len as usize })
            }
            _ => {
                self.got.clear();
                Ok(())
            }
        }
    }
    fn write(&mut self, bytes: &[u8]) {
        self.got.extend_from_slice(bytes);
    }
}

/// `call_parts` sends the parts as one payload and hands the reply's payload
/// to the sink; a refusing sink fails only that call.
async fn parts_round_trip(conn: &dyn oar_transport::Connection) {
    use oar_transport::call_parts;
    let values = random_bytes(7, 3_000_001);
    let parts: Vec<&[u8]> = vec![&values[..1], &values[1..2_000_000], &[], &values[2_000_000..]];
    let mut sink = Collect { want: None, got: Vec::new() };
    let note: String =
        call_parts(conn, ECHO, "parts", &parts, &mut sink, Duration::from_secs(30)).await.unwrap();
    assert_eq!(note, "parts");
    assert!(sink.got == values, "the reply's payload arrives whole and in order");

    let mut picky = Collect { want: Some(5), got: Vec::new() };
    let err = call_parts::<_, String>(conn, ECHO, "x", &parts, &mut picky, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PayloadLength { expected: 5, got: 3_000_001 }), "{err:?}");
    assert!(picky.got.is_empty());
    let err =
        call_parts::<_, ()>(conn, FAIL, &(), &parts, &mut sink, Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(&err, Error::Remote { error, .. } if error.kind == RemoteErrorKind::BadRequest),
        "{err:?}"
    );
    echo_ok(conn, 1).await;
}

#[tokio::test]
async fn call_parts_sends_parts_and_writes_the_reply_into_the_sink() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    parts_round_trip(client.connect(&server.addr()).await.unwrap().as_ref()).await;

    // The in-memory transport's default implementation behaves the same.
    let mem = oar_transport::MemTransport::new(oar_transport::MemNetwork::new());
    let listener = mem.listen("mem:0", Arc::new(TestService::default())).await.unwrap();
    parts_round_trip(mem.connect(listener.local_addr()).await.unwrap().as_ref()).await;
}
