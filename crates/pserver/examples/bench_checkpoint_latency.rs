//! The latency of pushes to a pserver while its checkpoints are written,
//! against the same pushes with no checkpoint running.
//!
//!     cargo run --release -p oar-pserver --example bench_checkpoint_latency
//!     cargo run --release -p oar-pserver --example bench_checkpoint_latency -- --params 10 --pushes 500
//!
//! One pserver (async mode, Adam) holds `--params` million float32 (default
//! 100) in blocks of `--block` floats (default 65536, the pserver's
//! default), on a `QuicTransport` with a development CA on 127.0.0.1 and the
//! in-memory discovery (no etcd). One trainer sends raw `PsRequest::Push`
//! calls of one block each (256 KiB with the default block), back to back,
//! each to the next block: the parts of one push of the whole shard, then
//! the next push, as a trainer's large push travels. So a push made during a
//! checkpoint usually updates a block the checkpoint's snapshot still
//! shares, and pays for copying it. Each call's latency is measured.
//!
//! Each round: phase A, `--pushes` pushes (default 2000) with no checkpoint
//! running; phase B, as many pushes while `Pserver::checkpoint()` runs in a
//! loop (every checkpoint the whole shard, with its Adam state, written to
//! a temp dir under `--dir`, default the system's temp dir). Printed per
//! round: p50, p99 and max of each phase and p99(B) / p99(A); then the
//! median of each over `--rounds` (default 3). Target: p99(B) <= 2x p99(A).
//! A warm-up of one push per block and 200 more comes first. Round 1's
//! phase B runs before any checkpoint has handed buffers back to the store
//! for its copies to reuse (see `StoreSnapshot`), so it shows what copies
//! into fresh memory cost; later rounds show the steady state. The running `rustc` count and the
//! load average are printed, since the figures mean little on a busy machine.

#[path = "common/mod.rs"]
mod common;

use bytes::Bytes;
use oar_discovery::MemDiscovery;
use oar_pserver::{
    protocol::{BlockSpan, PsReply, PsRequest, PSERVER_METHOD},
    Init, Mode, OptimizerConfig, ParamSpec, Placement, Pserver, PserverOptions,
};
use oar_transport::{call, Connection, DevCa, QuicTransport, Transport};
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

/// p50, p99 and max of `v`, in ms.
fn percentiles(v: &mut [f64]) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] * 1e3;
    [at(0.5), at(0.99), at(1.0)]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sends one-block pushes, block after block of the shard.
struct Pusher {
    conn: Arc<dyn Connection>,
    fingerprint: u64,
    /// Each block's length, in floats.
    lens: Vec<usize>,
    /// A gradient as long as the longest block; a push sends its block's prefix.
    grad: Bytes,
    /// Parts sent so far: the block is `sent % blocks`, the seq `sent / blocks`.
    sent: u64,
}

impl Pusher {
    /// `n` pushes back to back; the latency of each, in seconds.
    async fn run(&mut self, n: usize) -> Vec<f64> {
        let mut latencies = Vec::with_capacity(n);
        for _ in 0..n {
            let blocks = self.lens.len() as u64;
            let block = (self.sent % blocks) as usize;
            let request = PsRequest::Push {
                shard: 0,
                fingerprint: self.fingerprint,
                blocks: BlockSpan::new(block as u32, block as u32 + 1),
                trainer: "bench".into(),
                seq: self.sent / blocks,
                step: 0,
                weight: 1.0,
                rows: Vec::new(),
                origin: None,
            };
            let t = Instant::now();
            let reply = call(
                self.conn.as_ref(),
                PSERVER_METHOD,
                &request,
                self.grad.slice(..self.lens[block] * 4),
                Duration::from_secs(60),
            )
            .await
            .map(|(r, _): (PsReply, Bytes)| r);
            latencies.push(t.elapsed().as_secs_f64());
            match reply {
                Ok(PsReply::Pushed(_)) => {}
                other => {
                    eprintln!("push {} failed: {other:?}", self.sent);
                    std::process::exit(1);
                }
            }
            self.sent += 1;
        }
        latencies
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: bench_checkpoint_latency [--params MILLIONS (100)] [--block FLOATS (65536)] \
         [--pushes N (2000)] [--rounds R (3)] [--dir PATH]"
    );
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let (mut millions, mut block, mut pushes, mut rounds) = (100.0f64, 1usize << 16, 2000usize, 3usize);
    let mut dir: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--params" => millions = value.parse().unwrap_or_else(|_| usage()),
            "--block" => block = value.parse().unwrap_or_else(|_| usage()),
            "--pushes" => pushes = value.parse().unwrap_or_else(|_| usage()),
            "--rounds" => rounds = value.parse().unwrap_or_else(|_| usage()),
            "--dir" => dir = Some(value.into()),
            _ => usage(),
        }
    }
    let n = (millions * 1e6) as usize;
    if n == 0 || block == 0 || pushes < 100 || rounds == 0 {
        usage();
    }
    let tmp = match &dir {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("temp dir");

    let ca = DevCa::new().expect("CA");
    let transport = Arc::new(QuicTransport::new(ca.tls_config("bench").expect("tls")).expect("quic"));
    let discovery: Arc<dyn oar_discovery::Discovery> = Arc::new(MemDiscovery::new());
    let _coordinator = common::coordinator(discovery.clone(), transport.clone(), 1, 1, 1).await;
    let specs = vec![ParamSpec::new("w", vec![n], Init::Zeros)];
    let options = PserverOptions {
        keys: common::keys(),
        specs: specs.clone(),
        shards: 1,
        mode: Mode::Async,
        optimizer: OptimizerConfig::parse("adam", 1e-3).expect("adam"),
        block_size: block,
        checkpoint_dir: Some(tmp.path().to_path_buf()),
        // Only the checkpoints this bench asks for.
        checkpoint_interval: Duration::from_secs(24 * 3600),
        checkpoint_keep: 2,
        ..Default::default()
    };
    let ps = Pserver::start(discovery, transport.clone(), "127.0.0.1:0", options).await.expect("pserver");
    while ps.step(0).is_none() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let placement = Placement::new(&specs, 1, block).expect("placement");
    let lens: Vec<usize> = placement.blocks_on(0).map(|b| b.len).collect();
    let blocks = lens.len();
    let mut pusher = Pusher {
        conn: transport.connect(ps.addr()).await.expect("connect"),
        fingerprint: placement.fingerprint(),
        grad: oar_transport::f32s_to_bytes(&vec![1e-3; block.min(n)]),
        lens,
        sent: 0,
    };

    println!(
        "bench_checkpoint_latency: {n} float32 with Adam in {blocks} blocks of {block}; \
         one-block pushes ({} KiB) back to back; {pushes} pushes per phase, {rounds} rounds; \
         checkpoints in {}",
        block * 4 / 1024,
        tmp.path().display()
    );
    println!("before: {}", common::machine_load());
    // Every block once (its pages are mapped lazily until first written), then 200 more.
    pusher.run(blocks + 200).await;

    let (mut a_all, mut b_all, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    println!(
        "{:>5} {:>23} {:>23} {:>8} {:>12} {:>13}",
        "round", "A quiet p50/p99/max ms", "B ckpt p50/p99/max ms", "p99 B/A", "checkpoints", "ckpt mean (s)"
    );
    for round in 1..=rounds {
        let a = percentiles(&mut pusher.run(pushes).await);
        // Phase B: checkpoints back to back for as long as the pushes go on
        // (the last one is finished, not cut short).
        let task = tokio::spawn(async move {
            let latencies = pusher.run(pushes).await;
            (pusher, latencies)
        });
        let mut took = Vec::new();
        while !task.is_finished() {
            let t = Instant::now();
            match ps.checkpoint().await {
                Ok(written) if written.len() == 1 => took.push(t.elapsed().as_secs_f64()),
                other => {
                    eprintln!("checkpoint failed: {other:?}");
                    std::process::exit(1);
                }
            }
        }
        let (back, mut b) = task.await.expect("the pusher");
        pusher = back;
        let b = percentiles(&mut b);
        let ratio = b[1] / a[1];
        println!(
            "{round:>5} {:>7.2}/{:>6.2}/{:>8.2} {:>7.2}/{:>6.2}/{:>8.2} {ratio:>8.2} {:>12} {:>13.2}",
            a[0],
            a[1],
            a[2],
            b[0],
            b[1],
            b[2],
            took.len(),
            if took.is_empty() { f64::NAN } else { took.iter().sum::<f64>() / took.len() as f64 }
        );
        a_all.push(a);
        b_all.push(b);
        ratios.push(ratio);
    }
    let med = |v: &[[f64; 3]], k: usize| median(v.iter().map(|x| x[k]).collect());
    println!("after:  {}", common::machine_load());
    println!(
        "median {:>7.2}/{:>6.2}/{:>8.2} {:>7.2}/{:>6.2}/{:>8.2} {:>8.2}",
        med(&a_all, 0),
        med(&a_all, 1),
        med(&a_all, 2),
        med(&b_all, 0),
        med(&b_all, 1),
        med(&b_all, 2),
        median(ratios.clone())
    );
    let ratio = median(ratios);
    println!(
        "target: p99 during checkpoints <= 2x the quiet p99: {}",
        if ratio <= 2.0 { "met" } else { "MISSED" }
    );
    let _ = ps.shutdown().await;
}
