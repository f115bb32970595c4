//! Kept streams on a real QUIC server on 127.0.0.1: small calls reuse a
//! stream one after another (wire docs, "A kept stream"), a call given up
//! on never leaves its late reply to the next, a stream the server retires
//! sends the next call on a fresh stream exactly once, a close does not
//! wait for idle kept streams, and a stranger's bad frame on a kept stream
//! costs that stream only.

mod common;

use common::*;
use oar_transport::{
    wire::{self, Expect, Header, Kind, HEADER_LEN},
    DevCa, Error, Frame, Listener, QuicOptions, QuicTransport, RemoteErrorKind, Transport,
};
use std::{sync::atomic::Ordering, sync::Arc, time::Duration};

#[tokio::test]
async fn small_calls_one_after_another_share_one_kept_stream() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    assert_eq!(client.idle_kept_streams(), 0);
    for i in 0..100 {
        echo_ok(conn.as_ref(), i).await;
        assert_eq!(client.idle_kept_streams(), 1, "call {i} left its stream for the next");
    }
    // A handler's error or panic is an answer like any other: the stream carries on.
    for method in [FAIL, PANIC] {
        let err = conn.call(Frame { method, ..Frame::default() }, Duration::from_secs(5)).await;
        assert!(matches!(err, Err(Error::Remote { .. })), "{err:?}");
        assert_eq!(client.idle_kept_streams(), 1, "method {method}'s error cost its stream");
        echo_ok(conn.as_ref(), method.into()).await;
    }
    // A request over 64 KiB goes on a stream of its own, and leaves the kept one be.
    let big = Frame::new(ECHO, &"big", vec![3u8; 100 << 10].into()).unwrap();
    let reply = conn.call(big.clone(), Duration::from_secs(5)).await.unwrap();
    assert_eq!(reply, big);
    assert_eq!(client.idle_kept_streams(), 1);
    // A stream that carried a large reply is retired after it (a fresh
    // stream offers a large reply the whole receive window).
    let big_reply = Frame::new(BIG_REPLY, &100_000u64, Default::default()).unwrap();
    let reply = conn.call(big_reply, Duration::from_secs(5)).await.unwrap();
    assert_eq!(reply.payload.len(), 400_000);
    assert_eq!(client.idle_kept_streams(), 0, "a stream that received 400 KB went back to the pool");
    echo_ok(conn.as_ref(), 7).await;
    assert_eq!(client.idle_kept_streams(), 1);
    // 100 echoes, FAIL and an echo, PANIC (never answered) and an echo, the
    // big one, the big reply and an echo.
    assert_eq!(server.service.answered.load(Ordering::SeqCst), 106);
}

#[tokio::test]
async fn concurrent_small_calls_each_get_a_stream_of_their_own_and_the_pool_stays_bounded() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn: Arc<dyn oar_transport::Connection> = client.connect(&server.addr()).await.unwrap();
    for round in 0..3u32 {
        // Held at the gate together, so that no two can share a stream.
        let calls: Vec<_> = (0..40u32)
            .map(|i| {
                let conn = conn.clone();
                tokio::spawn(async move {
                    let frame = Frame::new(GATED, &(round, i), Default::default()).unwrap();
                    let reply = conn.call(frame, Duration::from_secs(10)).await.unwrap();
                    assert_eq!(reply.meta::<(u32, u32)>().unwrap(), (round, i));
                })
            })
            .collect();
        let all_in = async {
            while server.service.entered.load(Ordering::SeqCst) < 40 * (round as usize + 1) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), all_in).await.expect("40 calls at the gate");
        for _ in 0..40 {
            server.service.gate.notify_one();
        }
        for call in calls {
            call.await.unwrap();
        }
        let idle = client.idle_kept_streams();
        assert!((1..=16).contains(&idle), "{idle} idle kept streams after 40 concurrent calls");
    }
    assert_eq!(server.service.answered.load(Ordering::SeqCst), 120);
}

#[tokio::test]
async fn a_call_given_up_on_never_leaves_its_late_reply_to_the_next_call() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    echo_ok(conn.as_ref(), 0).await;
    assert_eq!(client.idle_kept_streams(), 1);
    // SLOW answers after 300 ms; this call gives up after 150, on the kept stream.
    let slow = Frame::new(SLOW, &"the slow one", Default::default()).unwrap();
    let err = conn.call(slow, Duration::from_millis(150)).await;
    assert!(matches!(err, Err(Error::Timeout { .. })), "{err:?}");
    assert_eq!(client.idle_kept_streams(), 0, "a call that timed out must not give its stream back");
    // Calls right away, and once the slow reply is due, get their own replies.
    for i in 1..40 {
        echo_ok(conn.as_ref(), i).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.service.entered.load(Ordering::SeqCst), 41);
}

#[tokio::test]
async fn a_kept_stream_the_server_retired_sends_the_next_call_on_a_fresh_stream_exactly_once() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    let idle = server.transport.options().stream_idle_timeout;
    for i in 0..5 {
        echo_ok(conn.as_ref(), i).await;
        assert_eq!(client.idle_kept_streams(), 1);
        // Past the server's idle deadline: it retires the stream, which the
        // client still holds, no longer ready for a call.
        tokio::time::sleep(idle * 2).await;
        assert_eq!(client.idle_kept_streams(), 0, "the server did not retire an idle kept stream");
    }
    echo_ok(conn.as_ref(), 5).await;
    // Each call handled once: none lost to a retired stream, none repeated.
    assert_eq!(server.service.entered.load(Ordering::SeqCst), 6);
    assert_eq!(server.service.answered.load(Ordering::SeqCst), 6);
    assert_eq!(client.live_connections(), 1, "a retired stream is no reason to dial again");
}

#[tokio::test]
async fn a_close_retires_idle_kept_streams_at_once() {
    let ca = DevCa::new().unwrap();
    // Streams would sit idle for a minute, and the close would wait its whole
    // 5 s grace for them, if the close did not retire them.
    let options = QuicOptions { stream_idle_timeout: Duration::from_secs(60), ..test_options() };
    let transport = QuicTransport::with_options(ca.tls_config("server").unwrap(), options.clone()).unwrap();
    let service = Arc::new(TestService::default());
    let listener = transport.serve("127.0.0.1:0", service.clone()).await.unwrap();
    let client = QuicTransport::with_options(ca.tls_config("c").unwrap(), options).unwrap();
    let conn = client.connect(listener.local_addr()).await.unwrap();
    for i in 0..3 {
        echo_ok(conn.as_ref(), i).await;
    }
    assert_eq!(client.idle_kept_streams(), 1);
    listener.close();
    tokio::time::timeout(Duration::from_secs(3), listener.wait_closed())
        .await
        .expect("the close waited for an idle kept stream");
    let err = conn.call(Frame::new(ECHO, &0u32, Default::default()).unwrap(), Duration::from_secs(1)).await;
    assert!(err.is_err(), "a closed server answered: {err:?}");
}

fn kept_request(method: u16, meta: &[u8]) -> Vec<u8> {
    let header =
        Header { kind: Kind::Request, method, meta_len: meta.len() as u32, payload_len: 0, keep: true };
    let mut b = header.to_bytes().to_vec();
    b.extend_from_slice(meta);
    b
}

/// Read exactly one reply frame (by its lengths) from a kept stream.
async fn read_reply(recv: &mut quinn::RecvStream) -> (Kind, Frame) {
    read_one(recv, Expect::Reply).await
}

/// Read exactly one frame (by its lengths) from `recv`, within 5 s.
async fn read_one(recv: &mut quinn::RecvStream, expect: Expect) -> (Kind, Frame) {
    let read = async {
        let mut head = [0u8; HEADER_LEN];
        recv.read_exact(&mut head).await.unwrap();
        let header = Header::parse(&head, expect, 1 << 20).unwrap();
        let mut body = vec![0u8; header.body_len() as usize];
        recv.read_exact(&mut body).await.unwrap();
        wire::decode(&[&head[..], &body].concat(), expect, 1 << 20).unwrap()
    };
    tokio::time::timeout(Duration::from_secs(5), read).await.expect("a frame within 5 s")
}

/// What a raw server does with the second request on its first stream.
#[derive(Clone, Copy)]
enum SecondRequest {
    /// Retires the stream without handling it, as oar's server does:
    /// stop reading with the retired code (4), end its side.
    Retire,
    /// Ends the stream as if its handler had run and the reply were lost:
    /// stop reading with code 0, end its side.
    DropAfterHandling,
}

/// A raw QUIC server that answers kept requests, and on its first
/// stream's second request does `second`. Counts every request it read.
async fn raw_server(ca: &DevCa, second: SecondRequest) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let tls = ca.tls_config("server").unwrap().rustls_server_config().unwrap();
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap();
    let config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = endpoint.local_addr().unwrap().to_string();
    let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = read.clone();
    tokio::spawn(async move {
        let conn = endpoint.accept().await.unwrap().await.unwrap();
        let mut first_stream = true;
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let count = count.clone();
            let first = std::mem::replace(&mut first_stream, false);
            tokio::spawn(async move {
                for nth in 1.. {
                    let (_, request) = read_one(&mut recv, Expect::Request).await;
                    count.fetch_add(1, Ordering::SeqCst);
                    if first && nth == 2 {
                        let code = match second {
                            SecondRequest::Retire => 4u32,
                            SecondRequest::DropAfterHandling => 0,
                        };
                        let _ = recv.stop(code.into());
                        let _ = send.finish();
                        let _ = send.stopped().await;
                        return;
                    }
                    let reply = wire::encode(Kind::Response, &request).unwrap().concat();
                    send.write_all(&reply).await.unwrap();
                }
            });
        }
        drop(endpoint);
    });
    (addr, read)
}

#[tokio::test]
async fn a_call_that_meets_a_stream_retired_under_it_goes_again_on_a_fresh_stream() {
    let ca = DevCa::new().unwrap();
    let (addr, read) = raw_server(&ca, SecondRequest::Retire).await;
    let client = client(&ca, "c");
    let conn = client.connect(&addr).await.unwrap();
    echo_ok(conn.as_ref(), 1).await;
    // Its stream is retired as its request lands: unread, so sent again.
    echo_ok(conn.as_ref(), 2).await;
    echo_ok(conn.as_ref(), 3).await;
    // Read: call 1, call 2 (discarded), call 2 again, call 3.
    assert_eq!(read.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_call_whose_stream_ended_after_its_handler_may_have_run_is_not_sent_again() {
    let ca = DevCa::new().unwrap();
    let (addr, read) = raw_server(&ca, SecondRequest::DropAfterHandling).await;
    let client = client(&ca, "c");
    let conn = client.connect(&addr).await.unwrap();
    echo_ok(conn.as_ref(), 1).await;
    let frame = Frame::new(ECHO, &2u32, Default::default()).unwrap();
    let err = conn.call(frame, Duration::from_secs(5)).await;
    assert!(matches!(err, Err(Error::Truncated { .. })), "{err:?}");
    assert_eq!(read.load(Ordering::SeqCst), 2, "the call was sent again");
    // The next call goes on a fresh stream.
    echo_ok(conn.as_ref(), 3).await;
}

#[tokio::test]
async fn a_bad_frame_on_a_kept_stream_ends_that_stream_only() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    let (_endpoint, conn) = raw_connection(&ca, &server.addr()).await;
    let meta = postcard_u32(7);

    // Two calls on one raw kept stream, then garbage where the third header is due.
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    for _ in 0..2 {
        send.write_all(&kept_request(ECHO, &meta)).await.unwrap();
        let (kind, frame) = read_reply(&mut recv).await;
        assert_eq!((kind, frame.meta::<u32>().unwrap()), (Kind::Response, 7));
    }
    send.write_all(b"XXXX this is not a frame header").await.unwrap();
    let (kind, frame) = read_reply(&mut recv).await;
    assert_eq!(kind, Kind::Error);
    let error = frame.meta::<oar_transport::RemoteError>().unwrap();
    assert_eq!(error.kind, RemoteErrorKind::BadRequest);
    assert!(error.message.contains("not an oar frame"), "{}", error.message);
    // ...and the server ended the stream after that reply.
    let rest =
        tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(1 << 20)).await.unwrap().unwrap();
    assert!(rest.is_empty(), "{} bytes after the error reply", rest.len());

    // A kept request cut off in its header stalls, and is told so after the idle deadline.
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&kept_request(ECHO, &meta)[..10]).await.unwrap();
    let (kind, frame) = read_reply(&mut recv).await;
    assert_eq!(kind, Kind::Error);
    let error = frame.meta::<oar_transport::RemoteError>().unwrap();
    assert!(error.message.contains("nothing for"), "{}", error.message);

    // The keep flag with a reserved bit beside it is refused like any bad flag.
    let mut b = kept_request(ECHO, &meta);
    b[7] = 0x03;
    let reply = raw_exchange(&conn, &b, true).await.unwrap();
    assert_eq!(reply.1.kind, RemoteErrorKind::BadRequest);
    assert!(reply.1.message.contains("flags 0x03"), "{}", reply.1.message);

    // The same raw connection still has kept calls answered.
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&kept_request(ECHO, &meta)).await.unwrap();
    assert_eq!(read_reply(&mut recv).await.0, Kind::Response);
    // The raw client's calls that reached the handler: 2 + 1.
    let raw_calls = 3;
    let calls = good.finish().await;
    assert_eq!(server.service.entered.load(Ordering::SeqCst) as u32, calls + 1 + raw_calls);
}

fn postcard_u32(v: u32) -> Vec<u8> {
    Frame::new(ECHO, &v, Default::default()).unwrap().meta.to_vec()
}
