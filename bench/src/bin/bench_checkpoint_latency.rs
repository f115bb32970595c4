//! The latency of pushes to a pserver while its checkpoints are written,
//! against the same pushes with no checkpoint running.
//!
//!     cargo run --release -p oar-bench --bin bench_checkpoint_latency -- --pushes 4000 --rounds 5
//!     cargo run --release -p oar-bench --bin bench_checkpoint_latency -- --params 10 --pushes 500
//!
//! One pserver (async mode, Adam) holds `--params` million float32 (default
//! 100) in blocks of `--block` floats (default 65536, the pserver's
//! default), on a `QuicTransport` with a development CA on 127.0.0.1 and the
//! in-memory discovery (no etcd). One trainer sends raw `PsRequest::Push`
//! calls of one block each (256 KiB with the default block), back to back,
//! each to the next block.
//!
//! What is timed, a "push" below, is one such call: one part of a push of
//! the whole shard. The parts of one push share its seq, and a push is
//! whole once it has a part for every block of the shard (1,526 with the
//! defaults); then the next push (the next seq) begins. So the pushes END,
//! and between two of them the trainer pauses for `BETWEEN_PUSHES` (10 ms,
//! untimed, as a trainer computes between two pushes). A checkpoint never
//! holds half a push (`ParamStore::snapshot` refuses while a push in parts
//! is half taken), so it takes its snapshot at the end of a push: while it
//! waits, the pserver holds back new pushes (its checkpoint gate) and lets
//! the parts of the push underway through. (Before the pushes ended, no
//! checkpoint got its snapshot here: each failed after its 30 s wait.)
//!
//! A push made while a checkpoint is written usually updates a block the
//! checkpoint's snapshot still shares, and pays for copying it.
//!
//! Each round: phase A, `--pushes` pushes (default 2000) with no checkpoint
//! running. Phase B: `Pserver::checkpoint()` runs in a loop (every
//! checkpoint the whole shard, with its Adam state, written to a temp dir
//! under `--dir`, default the system's temp dir) while the trainer pushes,
//! until the checkpoints' writes have seen `--pushes` pushes; the last
//! checkpoint is finished, not cut short. Phase B's figures are of the first
//! `--pushes` pushes sent while a checkpoint was being written: from the
//! push after its snapshot (its step says which push that is) until the
//! checkpoint returned. Pushes sent while a checkpoint waited for the end
//! of a push to take its snapshot are not counted (no checkpoint was being
//! written); the column `B sent` says how many pushes phase B sent in all.
//! Printed per round: p50, p99 and max of each phase, p99(B) / p99(A), and
//! the checkpoints completed in phase B (the bench fails if none did); then
//! the median of each over `--rounds` (default 3). Target: p99(B) <= 2x
//! p99(A).
//!
//! A warm-up of one whole push (every block once: its pages are mapped
//! lazily until first written) and 200 more parts comes first. Round 1's
//! phase B runs before any checkpoint has handed buffers back to the store
//! for its copies to reuse (see `StoreSnapshot`), so it shows what copies
//! into fresh memory cost; later rounds show the steady state. The running
//! `rustc` count and the load average are printed, since the figures mean
//! little on a busy machine. At the end the trainer completes the push it
//! is in, so that the pserver's shutdown finds no half-taken push to wait
//! for.
//!
//! Last, a restart: a new pserver on the same checkpoint directory takes
//! the shard (no replica survived) and restores it from the newest
//! checkpoint. Timed from `Pserver::start` until it serves, against
//! reading that file alone (`std::fs::read`, from the page cache as the
//! restore reads it) in the same run. The parameters start from a normal
//! distribution, as a model's do, so a restart that computed the initial
//! values before overwriting them would show it. And the first start's
//! time until serving (no checkpoint: initial values for every block),
//! against `ParamStore::new` building the same store on one thread.

use oar_bench::pserver as common;

use bytes::Bytes;
use oar_discovery::MemDiscovery;
use oar_pserver::{
    checkpoint::CheckpointDir,
    protocol::{BlockSpan, PsReply, PsRequest, PSERVER_METHOD},
    Init, Mode, OptimizerConfig, ParamSpec, ParamStore, Placement, Pserver, PserverOptions,
};
use oar_transport::{call, Connection, DevCa, QuicTransport, Transport};
use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// The trainer's pause after each whole push (untimed): long enough for a
/// waiting checkpoint, woken by each push, to take its snapshot.
const BETWEEN_PUSHES: Duration = Duration::from_millis(10);

/// Phase B gives up (and the bench fails) after this many checkpoints
/// without `--pushes` pushes sent during their writes.
const MAX_CHECKPOINTS_PER_PHASE: usize = 100;

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

fn fail(why: String) -> ! {
    eprintln!("bench_checkpoint_latency FAILED: {why}");
    std::process::exit(1)
}

/// One timed push call.
struct Call {
    /// Its index over the run: block `part % blocks` of push (seq) `part / blocks`.
    part: u64,
    /// When it was sent.
    start: Instant,
    /// How long it took, in seconds.
    secs: f64,
}

/// Sends whole pushes of the shard, one block per call, block after block,
/// with a pause between two pushes.
struct Pusher {
    conn: Arc<dyn Connection>,
    fingerprint: u64,
    /// Each block's length, in floats.
    lens: Vec<usize>,
    /// A gradient as long as the longest block; a call sends its block's prefix.
    grad: Bytes,
    /// Calls answered so far: the next is block `sent % blocks` of seq
    /// `sent / blocks`. Read by phase B's checkpoint loop.
    sent: Arc<AtomicU64>,
}

impl Pusher {
    fn blocks(&self) -> u64 {
        self.lens.len() as u64
    }

    /// The next part; after the last part of a push, the pause between pushes.
    async fn next(&mut self) -> Call {
        let part = self.sent.load(Ordering::SeqCst);
        let blocks = self.blocks();
        let block = (part % blocks) as usize;
        let request = PsRequest::Push {
            shard: 0,
            fingerprint: self.fingerprint,
            blocks: BlockSpan::new(block as u32, block as u32 + 1),
            trainer: "bench".into(),
            seq: part / blocks,
            step: 0,
            weight: 1.0,
            rows: Vec::new(),
            origin: None,
            epoch: 0,
        };
        let start = Instant::now();
        let reply = call(
            self.conn.as_ref(),
            PSERVER_METHOD,
            &request,
            self.grad.slice(..self.lens[block] * 4),
            Duration::from_secs(60),
        )
        .await
        .map(|(r, _): (PsReply, Bytes)| r);
        let secs = start.elapsed().as_secs_f64();
        match reply {
            Ok(PsReply::Pushed(_)) => {}
            other => fail(format!("push call {part} failed: {other:?}")),
        }
        self.sent.store(part + 1, Ordering::SeqCst);
        if (part + 1) % blocks == 0 {
            tokio::time::sleep(BETWEEN_PUSHES).await;
        }
        Call { part, start, secs }
    }

    /// `n` calls.
    async fn run(&mut self, n: usize) -> Vec<Call> {
        let mut calls = Vec::with_capacity(n);
        for _ in 0..n {
            calls.push(self.next().await);
        }
        calls
    }

    /// Calls until `stop` is set.
    async fn run_until(&mut self, stop: &AtomicBool) -> Vec<Call> {
        let mut calls = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            calls.push(self.next().await);
        }
        calls
    }

    /// The rest of the push underway, if one is (untimed).
    async fn finish_push(&mut self) {
        while self.sent.load(Ordering::SeqCst) % self.blocks() != 0 {
            self.next().await;
        }
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
    let specs = vec![ParamSpec::new("w", vec![n], Init::Normal { mean: 0.0, std: 0.01 })];
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
    let started = Instant::now();
    let ps = Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", options.clone())
        .await
        .expect("pserver");
    let step0 = loop {
        match ps.step(0) {
            Some(step) => break step,
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    };
    let first_start = started.elapsed();
    let placement = Placement::new(&specs, 1, block).expect("placement");
    let lens: Vec<usize> = placement.blocks_on(0).map(|b| b.len).collect();
    let blocks = lens.len();
    let mut pusher = Pusher {
        conn: transport.connect(ps.addr()).await.expect("connect"),
        fingerprint: placement.fingerprint(),
        grad: oar_transport::f32s_to_bytes(&vec![1e-3; block.min(n)]),
        lens,
        sent: Arc::new(AtomicU64::new(0)),
    };
    let sent = pusher.sent.clone();

    println!(
        "bench_checkpoint_latency: {n} float32 with Adam in {blocks} blocks of {block}; \
         whole pushes of {blocks} one-block calls ({} KiB), {} ms between pushes; \
         {pushes} timed calls per phase, {rounds} rounds; checkpoints in {}",
        block * 4 / 1024,
        BETWEEN_PUSHES.as_millis(),
        tmp.path().display()
    );
    println!("before: {}", common::machine_load());
    // One whole push (every block once: its pages are mapped lazily until
    // first written), then 200 more calls.
    pusher.run(blocks + 200).await;
    // Each whole push is one step (async): a checkpoint's step says after
    // which push its snapshot was taken.
    let whole = sent.load(Ordering::SeqCst) / blocks as u64;
    if ps.step(0) != Some(step0 + whole) {
        fail(format!("step {:?} after {whole} whole pushes from step {step0}", ps.step(0)));
    }

    let (mut a_all, mut b_all, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    println!(
        "{:>5} {:>23} {:>23} {:>8} {:>12} {:>13} {:>8}",
        "round",
        "A quiet p50/p99/max ms",
        "B ckpt p50/p99/max ms",
        "p99 B/A",
        "checkpoints",
        "ckpt mean (s)",
        "B sent"
    );
    for round in 1..=rounds {
        let mut a: Vec<f64> = pusher.run(pushes).await.iter().map(|c| c.secs).collect();
        let a = percentiles(&mut a);
        // Phase B: checkpoints back to back until their writes have seen
        // `pushes` calls (the last one is finished, not cut short).
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let calls = pusher.run_until(&stop).await;
                (pusher, calls)
            }
        });
        // Per checkpoint: the first call after its snapshot, and when it returned.
        let mut writes: Vec<(u64, Instant)> = Vec::new();
        let mut took = Vec::new();
        let mut during = 0u64;
        while during < pushes as u64 {
            if writes.len() >= MAX_CHECKPOINTS_PER_PHASE {
                fail(format!("{} checkpoints in phase B saw only {during} of {pushes} calls", writes.len()));
            }
            let t = Instant::now();
            let info = match ps.checkpoint().await {
                Ok(mut written) if written.len() == 1 => written.pop().expect("one"),
                other => fail(format!("checkpoint failed: {other:?}")),
            };
            // Read before the clock: every call counted here was sent before `end`.
            let answered = sent.load(Ordering::SeqCst);
            let end = Instant::now();
            took.push(t.elapsed().as_secs_f64());
            let Some(pushes_in) = info.step.checked_sub(step0) else {
                fail(format!("checkpoint at step {} before the first, {step0}", info.step))
            };
            let first = pushes_in * blocks as u64;
            during += answered.saturating_sub(first);
            writes.push((first, end));
        }
        stop.store(true, Ordering::SeqCst);
        let (back, calls) = task.await.expect("the pusher");
        pusher = back;
        if took.is_empty() {
            fail("no checkpoint completed during phase B".into());
        }
        let b_sent = calls.len();
        let mut b: Vec<f64> = calls
            .iter()
            .filter(|c| writes.iter().any(|&(first, end)| c.part >= first && c.start < end))
            .map(|c| c.secs)
            .take(pushes)
            .collect();
        if b.len() < pushes {
            fail(format!("phase B: {} calls during checkpoint writes, expected {pushes}", b.len()));
        }
        let b = percentiles(&mut b);
        let ratio = b[1] / a[1];
        println!(
            "{round:>5} {:>7.2}/{:>6.2}/{:>8.2} {:>7.2}/{:>6.2}/{:>8.2} {ratio:>8.2} {:>12} {:>13.2} {b_sent:>8}",
            a[0],
            a[1],
            a[2],
            b[0],
            b[1],
            b[2],
            took.len(),
            took.iter().sum::<f64>() / took.len() as f64
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
    // No half-taken push for the shutdown's last checkpoint to wait for.
    pusher.finish_push().await;
    let _ = ps.shutdown().await;
    restart(discovery, transport, options.clone(), tmp.path().to_path_buf()).await;
    first_start_against_one_thread(first_start, placement, &options).await;
}

/// The first start's time until serving (no checkpoint yet: every block
/// gets its initial values) against building the same store with
/// `ParamStore::new`, which computes them on one thread.
async fn first_start_against_one_thread(
    first_start: Duration,
    placement: Placement,
    options: &PserverOptions,
) {
    let (seed, optimizer) = (options.seed, options.optimizer.clone());
    let one_thread = tokio::task::spawn_blocking(move || {
        let optimizer = optimizer.build().expect("optimizer");
        let t = Instant::now();
        let store = ParamStore::new(&placement, 0, seed, optimizer, Mode::Async).expect("store");
        let took = t.elapsed();
        drop(store);
        took
    })
    .await
    .expect("ParamStore::new");
    println!(
        "first start (initial values, no checkpoint): serving after {:.0} ms; ParamStore::new on one thread {:.0} ms: {:.2}x",
        first_start.as_secs_f64() * 1e3,
        one_thread.as_secs_f64() * 1e3,
        first_start.as_secs_f64() / one_thread.as_secs_f64()
    );
}

/// A new pserver restores the shard from the newest checkpoint in `dir`:
/// its time until it serves, against reading the file.
async fn restart(
    discovery: Arc<dyn oar_discovery::Discovery>,
    transport: Arc<QuicTransport>,
    options: PserverOptions,
    dir: PathBuf,
) {
    let files = CheckpointDir::new(dir, 0).list().unwrap_or_else(|e| fail(format!("list checkpoints: {e}")));
    let Some(newest) = files.first() else { fail("no checkpoint to restart from".into()) };
    let t = Instant::now();
    let bytes = std::fs::read(newest).unwrap_or_else(|e| fail(format!("read {}: {e}", newest.display())));
    let read = t.elapsed();
    let size = bytes.len();
    drop(bytes);
    let t = Instant::now();
    let ps = Pserver::start(discovery, transport, "127.0.0.1:0", options).await.expect("pserver");
    while ps.step(0).is_none() {
        if t.elapsed() > Duration::from_secs(300) {
            fail("the restarted pserver did not serve within 300 s".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let serving = t.elapsed();
    println!(
        "restart from the newest checkpoint ({:.0} MB): serving after {:.0} ms; reading the file alone {:.0} ms: {:.1}x",
        size as f64 / 1e6,
        serving.as_secs_f64() * 1e3,
        read.as_secs_f64() * 1e3,
        serving.as_secs_f64() / read.as_secs_f64()
    );
    let _ = ps.shutdown().await;
}
