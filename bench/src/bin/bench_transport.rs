//! Throughput and latency of QuicTransport against raw tokio TCP, both over
//! loopback, in the same run, on the same runtime and threads.
//!
//! ```text
//! cargo run --release -p oar-bench --bin bench_transport -- [options]
//!   --mtu N            fixed UDP payload size on loopback (0: MTU discovery)   [65000]
//!   --gso              UDP segmentation offload on loopback                    [off]
//!   --buffer BYTES     UDP socket buffers                                      [4 MiB]
//!   --stream-window B  per-stream receive window                               [8 MiB]
//!   --conn-window B    per-connection receive window                           [64 MiB]
//!   --send-window B    send window                                             [4 MiB]
//!   --cipher C         aes128 | aes256 | chacha                                [aes128]
//!   --streams K        also split the largest tensor over K concurrent calls   [4]
//!   --reps R           repetitions per large size (median reported)            [5]
//!   --small R          small round trips measured (median reported)            [3000]
//!   --sizes a,b,c      tensor sizes in millions of f32                         [1,16,64]
//!   --threads T        tokio worker threads (0: one per core)                   [0]
//!   --in-task          run both ends' callers in a spawned task, on a worker,
//!                      instead of on block_on's thread                         [off]
//! ```
//!
//! (a) one call carrying N float32 (request payload; a tiny reply), against
//! TCP writing a length prefix and the same bytes and reading a 1-byte ack,
//! the receiver allocating one buffer at the declared size in both cases;
//! (b) the median round trip of a small call (16 bytes of metadata echoed)
//! against a 16-byte TCP echo. Prints both and their ratios.

use oar_bench::transport as common;

use async_trait::async_trait;
use bytes::Bytes;
use common::{tcp_connect, tcp_server};
use oar_transport::{
    join_all, Cipher, Connection, DevCa, Frame, Handler, QuicOptions, QuicTransport, RemoteError, Transport,
};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

struct Sink;

#[async_trait]
impl Handler for Sink {
    async fn handle(&self, request: Frame) -> Result<Frame, RemoteError> {
        // Large calls answer with their size only; small calls echo.
        if request.payload.is_empty() {
            Ok(request)
        } else {
            Frame::new(request.method, &(request.payload.len() as u64), Bytes::new())
                .map_err(RemoteError::internal)
        }
    }
}

struct Args {
    options: QuicOptions,
    cipher: Cipher,
    streams: usize,
    reps: usize,
    small: usize,
    sizes: Vec<usize>,
    threads: usize,
    in_task: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        options: QuicOptions::default(),
        cipher: Cipher::Aes128Gcm,
        streams: 4,
        reps: 5,
        small: 3000,
        sizes: vec![1, 16, 64],
        threads: 0,
        in_task: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--mtu" => {
                let mtu = number(value()?)?;
                args.options.loopback.mtu = if mtu == 0 { None } else { Some(mtu as u16) };
            }
            "--gso" => args.options.loopback.segmentation_offload = true,
            "--buffer" => args.options.socket_buffer = number(value()?)? as usize,
            "--stream-window" => args.options.stream_window = number(value()?)? as u32,
            "--conn-window" => args.options.connection_window = number(value()?)?,
            "--send-window" => args.options.send_window = number(value()?)?,
            "--cipher" => {
                args.cipher = match value()?.as_str() {
                    "aes128" => Cipher::Aes128Gcm,
                    "aes256" => Cipher::Aes256Gcm,
                    "chacha" => Cipher::ChaCha20Poly1305,
                    other => return Err(format!("unknown cipher {other}")),
                }
            }
            "--streams" => args.streams = number(value()?)?.max(1) as usize,
            "--threads" => args.threads = number(value()?)? as usize,
            "--in-task" => args.in_task = true,
            "--reps" => args.reps = number(value()?)?.max(1) as usize,
            "--small" => args.small = number(value()?)?.max(1) as usize,
            "--sizes" => {
                args.sizes = value()?
                    .split(',')
                    .map(|s| s.parse::<usize>().map_err(|e| format!("--sizes: {e}")))
                    .collect::<Result<_, _>>()?
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(args)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gib_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / (1u64 << 30) as f64
}

async fn tcp_bulk(s: &mut TcpStream, payload: &Bytes) -> Duration {
    let t = Instant::now();
    s.write_u64_le(payload.len() as u64).await.unwrap();
    s.write_all(payload).await.unwrap();
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await.unwrap();
    t.elapsed()
}

async fn quic_bulk(conn: &dyn Connection, payload: &Bytes, parts: usize) -> Duration {
    let t = Instant::now();
    if parts == 1 {
        let reply = conn
            .call(Frame { method: 1, meta: Bytes::new(), payload: payload.clone() }, Duration::from_secs(60));
        let got: u64 = reply.await.unwrap().meta().unwrap();
        assert_eq!(got as usize, payload.len());
    } else {
        let step = payload.len().div_ceil(parts);
        let calls = (0..parts).map(|i| {
            let part = payload.slice(i * step..((i + 1) * step).min(payload.len()));
            conn.call(Frame { method: 1, meta: Bytes::new(), payload: part }, Duration::from_secs(60))
        });
        let mut handles = Vec::new();
        for c in calls {
            handles.push(c);
        }
        let mut total = 0u64;
        for r in join_all(handles).await {
            total += r.unwrap().meta::<u64>().unwrap();
        }
        assert_eq!(total as usize, payload.len());
    }
    t.elapsed()
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let ca = DevCa::new()?;
    let server =
        QuicTransport::with_options(ca.tls_config("server")?.with_cipher(args.cipher), args.options.clone())?;
    let client =
        QuicTransport::with_options(ca.tls_config("client")?.with_cipher(args.cipher), args.options.clone())?;
    let listener = server.listen("127.0.0.1:0", Arc::new(Sink)).await?;
    let conn = client.connect(listener.local_addr()).await?;

    let tcp = TcpListener::bind("127.0.0.1:0").await?;
    let tcp_addr = tcp.local_addr()?;
    tokio::spawn(tcp_server(tcp));
    let mut fresh = tcp_connect(tcp_addr, 1).await?;
    let mut reused = tcp_connect(tcp_addr, 2).await?;

    println!(
        "options: loopback mtu {:?}, gso {}, socket buffer {}, stream window {}, connection window {}, send window {}, cipher {:?}",
        args.options.loopback.mtu,
        args.options.loopback.segmentation_offload,
        args.options.socket_buffer,
        args.options.stream_window,
        args.options.connection_window,
        args.options.send_window,
        args.cipher
    );
    println!("(a) one call carrying N float32; median of {} runs", args.reps);
    println!(
        "{:>6} {:>11} {:>13} {:>15} {:>11} {:>11}",
        "N", "QUIC GiB/s", "TCP raw GiB/s", "TCP alloc GiB/s", "QUIC/raw", "QUIC/alloc"
    );
    let largest = args.sizes.iter().copied().max().unwrap_or(1);
    for &millions in &args.sizes {
        let n = millions << 20;
        let payload = Bytes::from(vec![0x3fu8; n * 4]);
        // Warm up every path (connection, windows, allocator).
        quic_bulk(conn.as_ref(), &payload, 1).await;
        tcp_bulk(&mut fresh, &payload).await;
        tcp_bulk(&mut reused, &payload).await;
        let (mut q, mut f, mut r, mut split) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.reps {
            // Interleaved, so that all see the same machine state.
            q.push(quic_bulk(conn.as_ref(), &payload, 1).await);
            r.push(tcp_bulk(&mut reused, &payload).await);
            f.push(tcp_bulk(&mut fresh, &payload).await);
            if millions == largest && args.streams > 1 {
                split.push(quic_bulk(conn.as_ref(), &payload, args.streams).await);
            }
        }
        let rate = |v: Vec<Duration>| gib_per_s(n * 4, median(v));
        let (q, r, f) = (rate(q), rate(r), rate(f));
        println!("{:>5}M {:>11.2} {:>13.2} {:>15.2} {:>11.2} {:>11.2}", millions, q, r, f, q / r, q / f);
        if !split.is_empty() {
            let s = rate(split);
            println!(
                "{:>5}M {:>11.2} {:>13} {:>15} {:>11.2} {:>11.2}  (split over {} concurrent calls)",
                millions,
                s,
                "",
                "",
                s / r,
                s / f,
                args.streams
            );
        }
    }

    println!("(b) small call round trip; median of {}", args.small);
    let mut echo = tcp_connect(tcp_addr, 0).await?;
    let meta = Bytes::from_static(&[7u8; 16]);
    let frame = Frame { method: 2, meta: meta.clone(), payload: Bytes::new() };
    for _ in 0..200 {
        conn.call(frame.clone(), Duration::from_secs(5)).await?;
        let mut b = [7u8; 16];
        echo.write_all(&b).await?;
        echo.read_exact(&mut b).await?;
    }
    let mut q = Vec::with_capacity(args.small);
    let mut t = Vec::with_capacity(args.small);
    for _ in 0..args.small {
        let start = Instant::now();
        let reply = conn.call(frame.clone(), Duration::from_secs(5)).await?;
        q.push(start.elapsed());
        assert_eq!(reply.meta, meta);
        let mut b = [7u8; 16];
        let start = Instant::now();
        echo.write_all(&b).await?;
        echo.read_exact(&mut b).await?;
        t.push(start.elapsed());
    }
    let (q, t) = (median(q), median(t));
    println!("{:>10} {:>12} {:>12} {:>8}", "", "QUIC us", "TCP us", "ratio");
    println!(
        "{:>10} {:>12.1} {:>12.1} {:>8.2}",
        "RTT",
        q.as_secs_f64() * 1e6,
        t.as_secs_f64() * 1e6,
        q.as_secs_f64() / t.as_secs_f64()
    );
    listener.close();
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        builder.worker_threads(args.threads);
    }
    let runtime = builder.enable_all().build().expect("a tokio runtime");
    let result = if args.in_task {
        runtime.block_on(async {
            tokio::spawn(async { run(args).await.map_err(|e| e.to_string()) })
                .await
                .unwrap_or_else(|e| Err(e.to_string()))
        })
    } else {
        runtime.block_on(run(args)).map_err(|e| e.to_string())
    };
    if let Err(e) = result {
        eprintln!("benchmark failed: {e}");
        std::process::exit(1);
    }
}
