//! Push then pull of N float32 between one trainer and P pservers over QUIC
//! on 127.0.0.1, beside raw TCP moving the same bytes, measured in the same
//! run and interleaved call by call.
//!
//!     cargo run --release -p oar-bench --bin bench_push_pull
//!     cargo run --release -p oar-bench --bin bench_push_pull -- --sizes 1,10 --reps 7
//!     cargo run --release -p oar-bench --bin bench_push_pull -- --part-mib 32
//!     cargo run --release -p oar-bench --bin bench_push_pull -- --send-window 1048576 --buffer 4194304
//!
//! `--send-window` and `--buffer` set the transport's `QuicOptions::send_window`
//! and `socket_buffer` (bytes; defaults 4 MiB each).
//!
//! oar: a `PserverClient` (async mode, SGD) pushes a gradient of N floats
//! (split into the placement's blocks, all shards at once) and pulls the N
//! parameters back, through `Pserver`s on a `QuicTransport` with a
//! development CA; N = 1M, 10M, 100M (`--sizes` in millions) and P = 1, 2.
//! Each shard's blocks go in parts of at most `--part-mib` MiB (the client's
//! default, 8 MiB, unless given), two parts in flight per shard.
//! Reference: tokio TCP on loopback, one connection per "pserver", the
//! client writes its share of the 4N bytes (an 8-byte length first), the
//! server reads them into a buffer and writes the same number of bytes back,
//! the client reads them into its buffer: the same bytes each way, no
//! protocol, no optimizer. Both use one tokio runtime with a worker per core
//! and reuse their connections. Medians of `--reps` (default 5).

use oar_bench::pserver as common;

use oar_discovery::MemDiscovery;
use oar_pserver::{
    Init, Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement, Pserver, PserverClient,
    PserverClientOptions, PserverOptions,
};
use oar_transport::{DevCa, QuicTransport, RetryPolicy};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// An echo server: read a length-prefixed message, answer with as many bytes.
async fn tcp_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Ok(len) = stream.read_u64_le().await else { return };
                    buf.resize(len as usize, 0);
                    if stream.read_exact(&mut buf).await.is_err() || stream.write_all(&buf).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// One round trip of `bytes` over each of `streams` at once.
async fn tcp_round_trip(streams: &mut [TcpStream], out: &[Vec<u8>], back: &mut [Vec<u8>]) {
    let calls = streams.iter_mut().zip(out).zip(back.iter_mut()).map(|((s, out), back)| async move {
        s.write_u64_le(out.len() as u64).await.expect("write");
        s.write_all(out).await.expect("write");
        s.read_exact(back).await.expect("read");
    });
    futures_join_all(calls).await;
}

/// Run futures concurrently on this task (without pulling in the futures crate).
async fn futures_join_all<F: std::future::Future<Output = ()>>(futures: impl Iterator<Item = F>) {
    let mut set: Vec<_> = futures.map(|f| Some(Box::pin(f))).collect();
    std::future::poll_fn(|cx| {
        for slot in set.iter_mut() {
            // A finished future is dropped, never polled again.
            if let Some(f) = slot {
                if f.as_mut().poll(cx).is_ready() {
                    *slot = None;
                }
            }
        }
        if set.iter().all(Option::is_none) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

#[tokio::main]
async fn main() {
    let mut sizes: Vec<usize> = vec![1, 10, 100];
    let mut reps = 5usize;
    let mut part_bytes = oar_pserver::client::DEFAULT_MAX_PART_BYTES;
    let mut quic = oar_transport::QuicOptions::default();
    let usage = || -> ! {
        eprintln!(
            "usage: bench_push_pull [--sizes 1,10,100 (millions)] [--reps R] [--part-mib M] \
             [--send-window BYTES] [--buffer BYTES]"
        );
        std::process::exit(2);
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--sizes", Some(v)) => sizes = v.split(',').filter_map(|s| s.parse().ok()).collect(),
            ("--reps", Some(v)) => reps = v.parse().unwrap_or(5).max(3),
            ("--part-mib", Some(v)) => part_bytes = v.parse::<usize>().unwrap_or(8).max(1) << 20,
            ("--send-window", Some(v)) => quic.send_window = v.parse().unwrap_or_else(|_| usage()),
            ("--buffer", Some(v)) => quic.socket_buffer = v.parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
    }
    let ca = DevCa::new().expect("CA");
    let transport =
        Arc::new(QuicTransport::with_options(ca.tls_config("bench").expect("tls"), quic).expect("quic"));
    println!(
        "push then pull of N float32, one trainer; median of {reps}; ratio = oar time / TCP time; \
         push-pull = both in one call per pserver (async mode); parts of {} MiB",
        part_bytes >> 20
    );
    println!(
        "{:>6} {:>3} {:>11} {:>11} {:>7} {:>10} {:>15} {:>7}",
        "N", "P", "oar (ms)", "TCP (ms)", "ratio", "oar GB/s", "push-pull (ms)", "ratio"
    );
    for &millions in &sizes {
        let n = millions * 1_000_000;
        for servers in [1u32, 2] {
            let discovery: Arc<dyn oar_discovery::Discovery> = Arc::new(MemDiscovery::new());
            let specs = vec![ParamSpec::new("w", vec![n], Init::Zeros)];
            let _coordinator =
                common::coordinator(discovery.clone(), transport.clone(), servers, 1, servers).await;
            let mut pservers = Vec::new();
            for _ in 0..servers {
                let o = PserverOptions {
                    keys: common::keys(),
                    specs: specs.clone(),
                    shards: servers,
                    mode: Mode::Async,
                    optimizer: OptimizerConfig::Sgd { lr: 1e-3 },
                    block_size: 1 << 20,
                    ..Default::default()
                };
                pservers.push(
                    Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", o)
                        .await
                        .expect("pserver"),
                );
            }
            let placement = Arc::new(Placement::new(&specs, servers, 1 << 20).expect("placement"));
            let options = PserverClientOptions {
                call_timeout: Duration::from_secs(120),
                retry: RetryPolicy { give_up_after: Duration::from_secs(60), ..RetryPolicy::default() },
                max_part_bytes: part_bytes,
                ..PserverClientOptions::new(common::keys(), "trainer")
            };
            let mut client =
                PserverClient::new(discovery.clone(), transport.clone(), placement.clone(), options);
            let grads = {
                let mut g = ParamBuf::zeros(&specs);
                g.fill(1e-3);
                g
            };
            let mut params = ParamBuf::zeros(&specs);

            // The reference: the same bytes per server each way.
            let share: Vec<usize> =
                (0..servers).map(|i| placement.blocks_on(i).map(|b| b.len * 4).sum()).collect();
            let addr = tcp_server().await;
            let mut streams = Vec::new();
            for _ in 0..servers {
                let s = TcpStream::connect(addr).await.expect("connect");
                s.set_nodelay(true).expect("nodelay");
                streams.push(s);
            }
            let out: Vec<Vec<u8>> = share.iter().map(|&b| vec![7u8; b]).collect();
            let mut back: Vec<Vec<u8>> = share.iter().map(|&b| vec![0u8; b]).collect();

            // Warm up both paths once.
            client.push(&grads, 1.0).await.expect("push");
            client.pull(&mut params).await.expect("pull");
            tcp_round_trip(&mut streams, &out, &mut back).await;

            let (mut oar, mut tcp, mut combined) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..reps {
                let t = Instant::now();
                tcp_round_trip(&mut streams, &out, &mut back).await;
                tcp.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                client.push(&grads, 1.0).await.expect("push");
                client.pull(&mut params).await.expect("pull");
                oar.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                client.push_pull(&grads, 1.0, &mut params).await.expect("push-pull");
                combined.push(t.elapsed().as_secs_f64());
            }
            let (o, r, c) = (median(&mut oar), median(&mut tcp), median(&mut combined));
            let gbs = 2.0 * 4.0 * n as f64 / o / 1e9;
            println!(
                "{:>5}M {servers:>3} {:>11.1} {:>11.1} {:>7.2} {gbs:>10.2} {:>15.1} {:>7.2}",
                millions,
                o * 1e3,
                r * 1e3,
                o / r,
                c * 1e3,
                c / r
            );
            for p in pservers {
                let _ = p.shutdown().await;
            }
        }
    }
    println!("target: the 10M round trip within 2x of raw TCP (ratio <= 2.0)");
}
