//! QUIC-only (or TCP-only) call loops to profile, with the setup of
//! `bench_transport` (the same `QuicOptions`, `DevCa`, handler and frame
//! shapes), which interleaves TCP with QUIC and so cannot be profiled whole.
//! The measured loop is marked on stderr with `T0`/`T1` CLOCK_MONOTONIC
//! times, to cut it out of a `perf record -k CLOCK_MONOTONIC` with
//! `perf report --time T0,T1` (BENCHMARKS.md, "Profile before changes").
//!
//! ```sh
//! cargo build --release -p oar-bench --bin profile_transport
//! target/release/profile_transport large 64 5      # 5 calls of 64M f32 (256 MiB)
//! target/release/profile_transport small 40000     # 16-byte calls, echoed
//! target/release/profile_transport tcpbulk 64 9    # raw TCP into a reused buffer
//! target/release/profile_transport tcpecho 40000   # TCP_NODELAY echo
//! # options: --threads T (runtime workers) --cipher aes128|aes256|chacha --mtu N --gso
//! #   --in-task: the caller runs in a spawned task (on a worker) instead of on block_on's thread
//! #   --relay (small, tcpecho): the caller hands each call to one long-lived task over a
//! #     channel and waits on a oneshot for its answer (BENCHMARKS.md, "The block_on caller's wake-ups")
//! perf script -i perf.data --time $T0,$T1 | python3 scripts/perf_classify.py
//! ```

use oar_bench::transport as common;

use async_trait::async_trait;
use bytes::Bytes;
use oar_transport::{Cipher, DevCa, Frame, Handler, QuicOptions, QuicTransport, RemoteError, Transport};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

use oar_bench::BoxError;

/// Echoes small calls; answers a large one with its length.
struct Sink;

#[async_trait]
impl Handler for Sink {
    async fn handle(&self, request: Frame) -> Result<Frame, RemoteError> {
        if request.payload.is_empty() {
            return Ok(request);
        }
        Frame::new(request.method, &(request.payload.len() as u64), Bytes::new())
            .map_err(RemoteError::internal)
    }
}

/// What makes one small round trip: a QUIC call, or 16 bytes echoed over TCP.
enum SmallCaller {
    Quic(Arc<dyn oar_transport::Connection>, Frame),
    Echo(tokio::net::TcpStream),
}

impl SmallCaller {
    async fn round_trip(&mut self) -> Result<(), BoxError> {
        match self {
            SmallCaller::Quic(conn, small) => {
                conn.call(small.clone(), Duration::from_secs(5)).await?;
            }
            SmallCaller::Echo(s) => {
                let mut b = [7u8; 16];
                s.write_all(&b).await?;
                s.read_exact(&mut b).await?;
            }
        }
        Ok(())
    }
}

type Answer = tokio::sync::oneshot::Sender<Result<(), BoxError>>;

/// How the measured loop makes its round trips: itself, or through a relay task.
enum CallPath {
    Direct(SmallCaller),
    Relayed(tokio::sync::mpsc::UnboundedSender<Answer>),
}

/// A task that makes one round trip per request, in order, and answers each.
fn spawn_relay(mut caller: SmallCaller) -> tokio::sync::mpsc::UnboundedSender<Answer> {
    let (requests, mut incoming) = tokio::sync::mpsc::unbounded_channel::<Answer>();
    tokio::spawn(async move {
        while let Some(answer) = incoming.recv().await {
            let _ = answer.send(caller.round_trip().await);
        }
    });
    requests
}

/// CLOCK_MONOTONIC in seconds, the clock `perf record -k CLOCK_MONOTONIC` stamps samples with.
fn monotonic() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

struct Args {
    mode: String,
    n: usize,
    reps: usize,
    threads: usize,
    cipher: Cipher,
    options: QuicOptions,
    /// Run the caller in a spawned task rather than on `block_on`'s thread.
    in_task: bool,
    /// Hand each small call to one long-lived task and wait for its answer.
    relay: bool,
}

fn parse() -> Result<Args, BoxError> {
    let usage = "usage: profile_transport large|tcpbulk MILLIONS REPS | small|tcpecho CALLS [--threads T] [--cipher aes128|aes256|chacha] [--mtu N] [--gso] [--in-task] [--relay]";
    let a: Vec<String> = std::env::args().skip(1).collect();
    let (Some(mode), Some(n)) = (a.first(), a.get(1)) else { return Err(usage.into()) };
    let n = n.parse().map_err(|e| format!("{n:?}: {e}; {usage}"))?;
    let mut args = Args {
        mode: mode.clone(),
        n,
        reps: 1,
        threads: 0,
        cipher: Cipher::Aes128Gcm,
        options: QuicOptions::default(),
        in_task: false,
        relay: false,
    };
    let mut i = 2;
    while i < a.len() {
        let value = |i: usize| a.get(i + 1).ok_or_else(|| format!("{} needs a value; {usage}", a[i]));
        match a[i].as_str() {
            "--threads" => {
                args.threads = value(i)?.parse()?;
                i += 1;
            }
            "--cipher" => {
                args.cipher = match value(i)?.as_str() {
                    "aes128" => Cipher::Aes128Gcm,
                    "aes256" => Cipher::Aes256Gcm,
                    "chacha" => Cipher::ChaCha20Poly1305,
                    other => return Err(format!("--cipher {other:?}; {usage}").into()),
                };
                i += 1;
            }
            "--mtu" => {
                args.options.loopback.mtu = Some(value(i)?.parse()?);
                i += 1;
            }
            "--gso" => args.options.loopback.segmentation_offload = true,
            "--in-task" => args.in_task = true,
            "--relay" => args.relay = true,
            reps if i == 2 => args.reps = reps.parse().map_err(|e| format!("{reps:?}: {e}; {usage}"))?,
            other => return Err(format!("unknown option {other:?}; {usage}").into()),
        }
        i += 1;
    }
    Ok(args)
}

fn main() -> Result<(), BoxError> {
    let args = parse()?;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        builder.worker_threads(args.threads);
    }
    let runtime = builder.enable_all().build()?;
    if args.in_task {
        runtime.block_on(async { tokio::spawn(run(args)).await? })
    } else {
        runtime.block_on(run(args))
    }
}

/// The median of `times`, and GiB/s for `bytes` in that time.
fn median_rate(mut times: Vec<Duration>, bytes: usize) -> (Duration, f64) {
    times.sort();
    let median = times.get(times.len() / 2).copied().unwrap_or_default();
    (median, bytes as f64 / median.as_secs_f64() / (1u64 << 30) as f64)
}

async fn run(args: Args) -> Result<(), BoxError> {
    let Args { mode, n, reps, cipher, options, relay, .. } = args;
    let ca = DevCa::new()?;
    let server = QuicTransport::with_options(ca.tls_config("server")?.with_cipher(cipher), options.clone())?;
    let client = QuicTransport::with_options(ca.tls_config("client")?.with_cipher(cipher), options)?;
    let listener = server.listen("127.0.0.1:0", Arc::new(Sink)).await?;
    let conn = client.connect(listener.local_addr()).await?;
    let tcp = TcpListener::bind("127.0.0.1:0").await?;
    let tcp_addr = tcp.local_addr()?;
    tokio::spawn(common::tcp_server(tcp));
    let small = Frame { method: 2, meta: Bytes::from_static(&[7u8; 16]), payload: Bytes::new() };
    for _ in 0..200 {
        conn.call(small.clone(), Duration::from_secs(5)).await?;
    }
    eprintln!("READY {}", std::process::id());
    if std::env::var("OARPROF_WAIT").is_ok() {
        // Time for a tracer to attach.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let bytes = (n << 20) * 4;
    match mode.as_str() {
        "large" => {
            let payload = Bytes::from(vec![0x3fu8; bytes]);
            let large = Frame { method: 1, meta: Bytes::new(), payload };
            conn.call(large.clone(), Duration::from_secs(60)).await?;
            eprintln!("T0 {:.6}", monotonic());
            let mut times = Vec::new();
            for _ in 0..reps {
                let started = Instant::now();
                conn.call(large.clone(), Duration::from_secs(60)).await?;
                times.push(started.elapsed());
            }
            eprintln!("T1 {:.6}", monotonic());
            let (median, rate) = median_rate(times, bytes);
            eprintln!("large {n}M x{reps}: median {median:?} = {rate:.2} GiB/s");
        }
        "tcpbulk" => {
            let payload = vec![0x3fu8; bytes];
            let mut s = common::tcp_connect(tcp_addr, 2).await?;
            let mut times = Vec::new();
            for _ in 0..=reps {
                let started = Instant::now();
                s.write_u64_le(payload.len() as u64).await?;
                s.write_all(&payload).await?;
                s.read_exact(&mut [0u8; 1]).await?;
                times.push(started.elapsed());
            }
            times.remove(0);
            let (median, rate) = median_rate(times, bytes);
            eprintln!("tcpbulk {n}M: median {median:?} = {rate:.2} GiB/s");
        }
        "small" | "tcpecho" => {
            let caller = if mode == "tcpecho" {
                SmallCaller::Echo(common::tcp_connect(tcp_addr, 0).await?)
            } else {
                SmallCaller::Quic(conn.clone(), small.clone())
            };
            let mut path =
                if relay { CallPath::Relayed(spawn_relay(caller)) } else { CallPath::Direct(caller) };
            eprintln!("T0 {:.6}", monotonic());
            let started = Instant::now();
            let mut times = Vec::with_capacity(n);
            for _ in 0..n {
                let call = Instant::now();
                match &mut path {
                    CallPath::Direct(caller) => caller.round_trip().await?,
                    CallPath::Relayed(relay) => {
                        let (answered, answer) = tokio::sync::oneshot::channel();
                        relay.send(answered).map_err(|_| "the relay task ended")?;
                        answer.await??;
                    }
                }
                times.push(call.elapsed());
            }
            let total = started.elapsed();
            eprintln!("T1 {:.6}", monotonic());
            // Medians of 2,000 calls each, in order: a VM's regime can change mid-run.
            let windows: Vec<String> = times
                .chunks(2000)
                .map(|w| format!("{:.0}", median_rate(w.to_vec(), 0).0.as_secs_f64() * 1e6))
                .collect();
            eprintln!("medians per 2000 calls (us): {}", windows.join(" "));
            let (median, _) = median_rate(times, 0);
            let mean = total.as_secs_f64() * 1e6 / n.max(1) as f64;
            eprintln!(
                "{mode} x{n}: total {total:?}, mean {mean:.1} us, median {:.1} us",
                median.as_secs_f64() * 1e6
            );
        }
        other => return Err(format!("unknown mode {other:?}: large, small, tcpbulk or tcpecho").into()),
    }
    eprintln!("DONE");
    listener.close();
    Ok(())
}
