//! Bad input against a real QUIC server on 127.0.0.1: each bad stream gets
//! an error for that call only, while a well-behaved client keeps being
//! served concurrently. Plus who gets in: certificates from another CA, or
//! none, are refused.

mod common;

use common::*;
use oar_transport::{
    wire::{self, Decoder, Expect, Header, Kind, HEADER_LEN, PROTOCOL_VERSION},
    DevCa, Error, Frame, QuicTransport, RemoteErrorKind, TlsConfig, Transport,
};
use rustls_pki_types::{pem::PemObject, CertificateDer};
use std::{sync::atomic::Ordering, sync::Arc, time::Duration};

fn request_header(meta_len: u32, payload_len: u64) -> [u8; HEADER_LEN] {
    Header { kind: Kind::Request, method: ECHO, meta_len, payload_len, keep: false }.to_bytes()
}

/// Asserts the raw exchange ended in a BadRequest reply whose message contains `needle`.
fn assert_bad_request(reply: Result<(u8, oar_transport::RemoteError), String>, needle: &str) {
    let (kind, error) = reply.unwrap_or_else(|e| panic!("expected an error reply about {needle:?}, got {e}"));
    assert_eq!(kind, Kind::Error as u8);
    assert_eq!(error.kind, RemoteErrorKind::BadRequest);
    assert!(error.message.contains(needle), "{:?} does not mention {needle:?}", error.message);
}

#[tokio::test]
async fn truncated_frames_get_an_error_naming_the_part() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    let (_endpoint, conn) = raw_connection(&ca, &server.addr()).await;

    let header = request_header(4, 100);
    // Cut in the header, the metadata and the payload, each on its own stream.
    assert_bad_request(raw_exchange(&conn, &header[..9], true).await, "truncated in its header");
    let mut b = header.to_vec();
    b.extend_from_slice(&[1, 2]);
    assert_bad_request(raw_exchange(&conn, &b, true).await, "truncated in its metadata");
    let mut b = header.to_vec();
    b.extend_from_slice(&[0u8; 4 + 60]);
    assert_bad_request(raw_exchange(&conn, &b, true).await, "expected 100 bytes, got 60");
    // Bytes after a complete frame.
    let mut b = request_header(0, 3).to_vec();
    b.extend_from_slice(&[9u8; 10]);
    assert_bad_request(raw_exchange(&conn, &b, true).await, "unexpected bytes after a complete frame");
    good.finish_as_the_only_caller_of(&server).await;
}

#[tokio::test]
async fn a_wrong_version_gets_an_error_stating_both_versions() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    let (_endpoint, conn) = raw_connection(&ca, &server.addr()).await;
    let mut b = request_header(0, 0).to_vec();
    b[4..6].copy_from_slice(&(PROTOCOL_VERSION + 41).to_le_bytes());
    let reply = raw_exchange(&conn, &b, true).await;
    assert_bad_request(reply.clone(), &format!("speaks version {PROTOCOL_VERSION}"));
    assert_bad_request(reply, &format!("sent version {}", PROTOCOL_VERSION + 41));
    // The same connection still serves a good request afterwards.
    let ok =
        wire::encode(Kind::Request, &Frame::new(ECHO, &5u32, Default::default()).unwrap()).unwrap().concat();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&ok).await.unwrap();
    send.finish().unwrap();
    let (kind, frame) =
        wire::decode(&recv.read_to_end(1 << 20).await.unwrap(), Expect::Reply, 1 << 20).unwrap();
    assert_eq!((kind, frame.meta::<u32>().unwrap()), (Kind::Response, 5));
    good.finish().await;
}

#[tokio::test]
async fn a_length_over_the_maximum_is_refused_from_the_header_alone() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    let (_endpoint, conn) = raw_connection(&ca, &server.addr()).await;
    // The server's maximum is 64 MiB; claim one byte more, then petabytes:
    // only the header is sent, the stream is left open, and the refusal comes
    // at once (not after the stream idle deadline: the message says so).
    for claimed in [(64u64 << 20) - 9, u64::MAX - 10] {
        let reply = raw_exchange(&conn, &request_header(10, claimed), false).await;
        assert_bad_request(reply, "more than the maximum of 67108864");
    }
    good.finish_as_the_only_caller_of(&server).await;
}

#[test]
fn the_decoder_refuses_a_huge_claim_before_any_body_byte_or_allocation() {
    // What keeps the server's memory flat whatever a peer claims: the error
    // comes from the 22 header bytes, before a buffer is allocated.
    for payload_len in [1u64 << 30, 1 << 40, u64::MAX] {
        let mut d = Decoder::new(Expect::Request, 1 << 20);
        let err = d.feed(&request_header(0, payload_len)).unwrap_err();
        assert!(
            matches!(err, Error::TooLarge { payload, max: 1_048_576, .. } if payload == payload_len),
            "{err}"
        );
        assert!(d.header().is_none(), "no header accepted, so no buffer sized from it");
    }
}

#[tokio::test]
async fn random_bytes_get_an_error_for_that_stream_only() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    let (_endpoint, conn) = raw_connection(&ca, &server.addr()).await;
    for seed in 0..40u64 {
        let len = (seed as usize * 37) % 300;
        let mut bytes = random_bytes(seed, len);
        if seed % 4 == 0 && bytes.len() >= 4 {
            // Also random bytes behind a valid magic.
            bytes[..4].copy_from_slice(&wire::MAGIC);
        }
        match raw_exchange(&conn, &bytes, true).await {
            Ok((kind, error)) => {
                assert_eq!(kind, Kind::Error as u8, "seed {seed}");
                assert_eq!(error.kind, RemoteErrorKind::BadRequest, "seed {seed}");
            }
            // An empty stream or a reset is also an acceptable end; a success is not.
            Err(e) => assert!(!e.contains("undecodable"), "seed {seed}: {e}"),
        }
    }
    good.finish_as_the_only_caller_of(&server).await;
}

#[tokio::test]
async fn a_stream_that_never_finishes_is_dropped_after_the_idle_deadline() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    let (_endpoint, conn) = raw_connection(&ca, &server.addr()).await;
    let mut b = request_header(0, 1000).to_vec();
    b.extend_from_slice(&[0u8; 100]);
    let reply = raw_exchange(&conn, &b, false).await;
    assert_bad_request(reply, "sent nothing for 300ms");
    good.finish().await;
}

#[tokio::test]
async fn clients_that_connect_and_stall_harm_nobody() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    // A QUIC client that completes the handshake and then does nothing.
    let (_idle_endpoint, idle_conn) = raw_connection(&ca, &server.addr()).await;
    // A client that opens a stream, sends half a header and stops.
    let (_e2, half) = raw_connection(&ca, &server.addr()).await;
    let (mut send, mut recv) = half.open_bi().await.unwrap();
    send.write_all(&request_header(0, 8)[..11]).await.unwrap();
    // A UDP client that sends junk and a truncated Initial-looking datagram.
    let junk = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for seed in 0..20 {
        let mut datagram = random_bytes(seed, 1200);
        if seed % 2 == 0 {
            datagram[0] = 0xc0; // long header, Initial
            datagram.truncate(40);
        }
        junk.send_to(&datagram, server.addr()).await.unwrap();
    }
    // A client that asks for a big reply and never reads it.
    let (_e3, lazy) = raw_connection(&ca, &server.addr()).await;
    let (mut lazy_send, mut lazy_recv) = lazy.open_bi().await.unwrap();
    let ask = wire::encode(Kind::Request, &Frame::new(BIG_REPLY, &(8u64 << 20), Default::default()).unwrap())
        .unwrap()
        .concat();
    lazy_send.write_all(&ask).await.unwrap();
    lazy_send.finish().unwrap();
    // Ten times the server's 300 ms stall deadline: on a loaded machine its
    // timer may fire late, and a read before it would let the reply go on.
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The half header got an error reply once its stream went idle.
    let reply = recv.read_to_end(1 << 20).await.unwrap();
    let (kind, frame) = wire::decode(&reply, Expect::Reply, 1 << 20).unwrap();
    assert_eq!(kind, Kind::Error);
    assert!(frame.meta::<oar_transport::RemoteError>().unwrap().message.contains("sent nothing"));
    // The reply nobody read was abandoned by the server: reading it now
    // ends in a reset, never in a complete 32 MiB frame.
    let mut got = 0usize;
    let end = loop {
        match lazy_recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => got += chunk.bytes.len(),
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    assert!(matches!(end, Err(quinn::ReadError::Reset(_))), "after {got} bytes: {end:?}");
    assert!(got < 32 << 20);
    assert!(idle_conn.close_reason().is_none(), "an idle but live client is not thrown out");
    good.finish().await;
}

#[tokio::test]
async fn a_client_with_a_certificate_from_another_ca_is_refused() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    // It trusts the job's CA (so it accepts the server), but its own
    // certificate was signed by a stranger.
    let stranger = DevCa::new().unwrap().issue("intruder").unwrap();
    let tls = TlsConfig::from_pem(
        ca.ca_pem().as_bytes(),
        stranger.cert_pem.as_bytes(),
        stranger.key_pem.as_bytes(),
    )
    .unwrap();
    let intruder = QuicTransport::with_options(tls, test_options()).unwrap();
    let conn = intruder.connect(&server.addr()).await.unwrap();
    for _ in 0..3 {
        let err =
            conn.call(Frame::new(ECHO, &1u32, Default::default()).unwrap(), Duration::from_secs(5)).await;
        assert!(matches!(err, Err(ref e) if is_refusal(e)), "{err:?}");
    }
    good.finish_as_the_only_caller_of(&server).await;
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    let ca = DevCa::new().unwrap();
    let server = start_server(&ca).await;
    let good = GoodClient::start(&ca, &server.addr()).await;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca.ca_pem().as_bytes()).unwrap()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![oar_transport::ALPN.to_vec()];
    let endpoint = raw_endpoint(tls);
    let reason = match endpoint.connect(server.addr().parse().unwrap(), "oar").unwrap().await {
        // Refused during the handshake.
        Err(e) => e.to_string(),
        // Or the client thinks the handshake is done, and the server's
        // refusal arrives while it calls.
        Ok(conn) => {
            let call = async {
                let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
                let request =
                    wire::encode(Kind::Request, &Frame::new(ECHO, &1u32, Default::default()).unwrap())
                        .unwrap();
                send.write_all(&request.concat()).await.map_err(|e| e.to_string())?;
                let _ = send.finish();
                recv.read_to_end(1 << 20).await.map_err(|e| e.to_string())
            };
            let got = call.await;
            assert!(got.is_err(), "a client without a certificate got a reply");
            tokio::time::timeout(Duration::from_secs(5), conn.closed()).await.unwrap().to_string()
        }
    };
    assert!(reason.contains("certificate"), "{reason}");
    let calls = good.finish().await;
    assert_eq!(server.service.entered.load(Ordering::SeqCst) as u32, calls + 1);
}

#[tokio::test]
async fn a_server_with_a_certificate_from_another_ca_is_refused_by_the_client() {
    let ca = DevCa::new().unwrap();
    let impostor = start_server(&DevCa::new().unwrap()).await;
    let client = client(&ca, "trainer");
    let conn = client.connect(&impostor.addr()).await.unwrap();
    let err = conn.call(Frame::new(ECHO, &1u32, Default::default()).unwrap(), Duration::from_secs(5)).await;
    match err {
        Err(Error::Refused { reason, .. }) => assert!(reason.contains("certificate"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(impostor.service.entered.load(Ordering::SeqCst), 0);
}
