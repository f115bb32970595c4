//! Callers that give up half-way (their call's future dropped, whatever it
//! was waiting for) must leave nothing behind that holds up the other
//! callers on the same connection (an open stream, an unread reply): every
//! call that is let run gets its answer.
//!
//! Keep-alives and idle timeouts are set far beyond the calls' deadlines,
//! so that nothing left behind is cleared by a timer or a new connection:
//! a call held up ends in a timeout instead of a late success.

mod common;

use common::*;
use oar_transport::{Connection, DevCa, Error, Frame, Listener, QuicOptions, QuicTransport, Transport};
use std::{sync::Arc, time::Duration};

fn quiet_options() -> QuicOptions {
    QuicOptions {
        keep_alive: Duration::from_secs(600),
        idle_timeout: Duration::from_secs(1200),
        stream_idle_timeout: Duration::from_secs(600),
        ..test_options()
    }
}

/// Many callers on two clients, every fifth of their calls abandoned
/// half-way (its future dropped, whatever it was waiting for): every call
/// that is let run gets its answer. Each connection's 300 abandoned calls
/// are more than the 256 streams it may have open at once: streams they
/// left open would block the later calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_give_up_hold_up_no_other_call() {
    let ca = DevCa::new().unwrap();
    let server_transport =
        QuicTransport::with_options(ca.tls_config("server").unwrap(), quiet_options()).unwrap();
    let service = Arc::new(TestService::default());
    let listener = server_transport.serve("127.0.0.1:0", service.clone()).await.unwrap();
    let addr = listener.local_addr().to_string();
    let mut callers = Vec::new();
    let mut clients = Vec::new();
    for c in 0..2 {
        let client =
            QuicTransport::with_options(ca.tls_config(&format!("c{c}")).unwrap(), quiet_options()).unwrap();
        let conn: Arc<dyn Connection> = client.connect(&addr).await.unwrap();
        for t in 0..6u32 {
            let conn = conn.clone();
            callers.push(tokio::spawn(async move {
                let mut answered = 0u32;
                for i in 0..250u32 {
                    let frame = Frame::new(ECHO, &(t, i), Default::default()).unwrap();
                    if i % 5 == 4 {
                        // Given up at once or after a first poll: dropped with
                        // its stream open, its request sent or not.
                        let _ = tokio::time::timeout(
                            Duration::from_micros(50),
                            conn.call(frame, Duration::from_secs(4)),
                        )
                        .await;
                        continue;
                    }
                    match conn.call(frame, Duration::from_secs(4)).await {
                        Ok(reply) => {
                            assert_eq!(reply.meta::<(u32, u32)>().unwrap(), (t, i));
                            answered += 1;
                        }
                        Err(e @ Error::Timeout { .. }) => {
                            panic!("caller {t}, call {i}: {e}: held up by the calls given up")
                        }
                        Err(e) => panic!("caller {t}, call {i}: {e}"),
                    }
                }
                answered
            }));
        }
        clients.push(client);
    }
    let mut answered = 0;
    for caller in callers {
        answered += caller.await.unwrap();
    }
    assert_eq!(answered, 12 * 200);
}
