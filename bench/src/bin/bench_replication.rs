//! What replication costs: push then pull of N float32 by one trainer with
//! R = 1, 2, 3 replicas per shard, in sync and async mode, over QUIC on
//! 127.0.0.1; and what a follower holds in memory.
//!
//!     cargo run --release -p oar-bench --bin bench_replication
//!     cargo run --release -p oar-bench --bin bench_replication -- --millions 10 --reps 9 --sync-trainers 4
//!
//! Each R is its own cluster of three pservers (3 shards, one primary per
//! pserver, followers on the others; strong mode: a push is answered once
//! every follower holds it), all in this process on one QUIC transport;
//! the clusters are measured interleaved call by call, so noise falls on
//! all of them alike. An R=1 cluster with 64 shards (the job's default)
//! shows what the logical shards cost over one shard per pserver. Sync
//! mode replicates the aggregated step, async each push. Ratios are
//! against R=1 (3 shards) of the same mode, medians of `--reps` (default 7).
//!
//! Memory: a shard of N floats with Adam (parameters + two optimizer
//! slots) on two pservers; the follower dies and a new pserver catches up
//! in its place; the bytes live on the heap (a counting allocator) grow by
//! what the new follower holds and whatever its catch-up left behind,
//! printed against the parameters and optimizer state it must hold.

use oar_bench::pserver as common;

use oar_discovery::{Discovery, MemDiscovery};
use oar_pserver::{
    Init, Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement, Pserver, PserverClient,
    PserverClientOptions, PserverOptions,
};
use oar_transport::{DevCa, QuicTransport, RetryPolicy, Transport};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

const BLOCK: usize = 1 << 20;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The system allocator, counting the bytes live on the heap: what a
/// follower holds is measured exactly, not through the resident set (which
/// the allocator's reuse of freed memory blurs).
struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// The most `LIVE` has been since [`reset_peak`].
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Count `bytes` more live, and the peak.
fn grow(bytes: usize) {
    let now = LIVE.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
}

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        grow(layout.size());
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        LIVE.fetch_sub(layout.size(), std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        grow(new_size);
        LIVE.fetch_sub(layout.size(), std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes live on the heap now.
fn live() -> u64 {
    LIVE.load(std::sync::atomic::Ordering::Relaxed) as u64
}

/// Start a new peak at what is live now.
fn reset_peak() {
    PEAK.store(LIVE.load(std::sync::atomic::Ordering::Relaxed), std::sync::atomic::Ordering::Relaxed);
}

/// The most bytes live since [`reset_peak`].
fn peak() -> u64 {
    PEAK.load(std::sync::atomic::Ordering::Relaxed) as u64
}

/// Wait until the cluster status in `discovery` says OK.
async fn wait_ok(discovery: &dyn Discovery) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(kv)) = discovery.get(&common::keys().cluster_status).await {
            if serde_json::from_slice::<serde_json::Value>(&kv.value).is_ok_and(|v| v["status"] == "OK") {
                return;
            }
        }
        assert!(Instant::now() < deadline, "the cluster never became healthy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Setup {
    label: String,
    /// Each trainer's client and parameters (`None` while a round runs).
    trainers: Vec<Option<(PserverClient, ParamBuf)>>,
    _pservers: Vec<Pserver>,
    _coordinator: oar_pserver::Coordinator,
}

#[allow(clippy::too_many_arguments)]
async fn setup(
    transport: Arc<dyn Transport>,
    specs: &[ParamSpec],
    mode: Mode,
    optimizer: OptimizerConfig,
    shards: u32,
    replicas: u32,
    pservers: u32,
    trainers: usize,
    label: String,
) -> Setup {
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let coordinator =
        common::coordinator(discovery.clone(), transport.clone(), shards, replicas, pservers).await;
    let mut started = Vec::new();
    for _ in 0..pservers {
        let o = PserverOptions {
            keys: common::keys(),
            specs: specs.to_vec(),
            shards,
            mode,
            optimizer: optimizer.clone(),
            block_size: BLOCK,
            ..Default::default()
        };
        started.push(
            Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", o).await.expect("pserver"),
        );
    }
    wait_ok(discovery.as_ref()).await;
    let placement = Arc::new(Placement::new(specs, shards, BLOCK).expect("placement"));
    let mut clients = Vec::new();
    for t in 0..trainers {
        let options = PserverClientOptions {
            call_timeout: Duration::from_secs(120),
            retry: RetryPolicy { give_up_after: Duration::from_secs(60), ..RetryPolicy::default() },
            ..PserverClientOptions::new(common::keys(), format!("trainer-{t}"))
        };
        let mut client = PserverClient::new(discovery.clone(), transport.clone(), placement.clone(), options);
        if mode == Mode::Sync {
            client.join().await.expect("join");
        }
        clients.push(Some((client, ParamBuf::zeros(specs))));
    }
    Setup { label, trainers: clients, _pservers: started, _coordinator: coordinator }
}

/// One pull then push by every trainer at once (sync: one step).
async fn round(setup: &mut Setup, grads: &Arc<ParamBuf>) -> f64 {
    let t = Instant::now();
    let mut running = tokio::task::JoinSet::new();
    for (i, slot) in setup.trainers.iter_mut().enumerate() {
        let (mut client, mut params) = slot.take().expect("a trainer");
        let grads = grads.clone();
        running.spawn(async move {
            client.pull(&mut params).await.expect("pull");
            client.push(&grads, 1.0).await.expect("push");
            (i, client, params)
        });
    }
    while let Some(done) = running.join_next().await {
        let (i, client, params) = done.expect("a trainer task");
        setup.trainers[i] = Some((client, params));
    }
    t.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let mut millions = 10usize;
    let mut reps = 7usize;
    let mut sync_trainers = 4usize;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--millions", Some(v)) => millions = v.parse().unwrap_or(10).max(1),
            ("--reps", Some(v)) => reps = v.parse().unwrap_or(7).max(3),
            ("--sync-trainers", Some(v)) => sync_trainers = v.parse().unwrap_or(4).max(1),
            _ => {
                eprintln!("usage: bench_replication [--millions N] [--reps R] [--sync-trainers K]");
                std::process::exit(2);
            }
        }
    }
    let n = millions * 1_000_000;
    let ca = DevCa::new().expect("CA");
    let transport: Arc<dyn Transport> =
        Arc::new(QuicTransport::new(ca.tls_config("bench").expect("tls")).expect("quic"));
    let specs = vec![ParamSpec::new("w", vec![n], Init::Zeros)];
    let mut grads = ParamBuf::zeros(&specs);
    grads.fill(1e-3);
    let grads = Arc::new(grads);
    println!("{}", common::machine_load());
    println!(
        "pull then push of {millions}M float32 by every trainer at once, 3 pservers; median of {reps}, \
         interleaved; ratio = time / time with R=1 (3 shards)"
    );
    println!("{:>6} {:>8} {:>14} {:>10} {:>7}", "mode", "trainers", "replication", "ms", "ratio");
    // Sync with several trainers, where replicating the aggregated step
    // instead of each push pays; async forwards every push.
    for (mode, trainers) in [(Mode::Sync, sync_trainers), (Mode::Async, 1)] {
        let sgd = OptimizerConfig::Sgd { lr: 1e-3 };
        let mut setups = Vec::new();
        for replicas in 1..=3u32 {
            let label = format!("R={replicas}, S=3");
            let s =
                setup(transport.clone(), &specs, mode, sgd.clone(), 3, replicas, 3, trainers, label).await;
            setups.push(s);
        }
        let label = "R=1, S=64".to_string();
        setups.push(setup(transport.clone(), &specs, mode, sgd.clone(), 64, 1, 3, trainers, label).await);
        for s in &mut setups {
            round(s, &grads).await; // warm up
        }
        let mut times = vec![Vec::new(); setups.len()];
        for _ in 0..reps {
            for (s, t) in setups.iter_mut().zip(&mut times) {
                t.push(round(s, &grads).await);
            }
        }
        let medians: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
        for (s, m) in setups.iter().zip(&medians) {
            let mode = format!("{mode:?}");
            println!("{mode:>6} {trainers:>8} {:>14} {:>10.1} {:>7.2}", s.label, m * 1e3, m / medians[0]);
        }
        drop(setups);
    }
    println!("targets: R=2 <= 1.3x R=1 in sync mode, <= 1.6x in async");

    // Memory of a follower: a shard on two pservers; the follower goes
    // (its lease revoked, as when it dies), and a third pserver catches up
    // in its place while the process's resident set is watched.
    let adam = OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let _coordinator = common::coordinator(discovery.clone(), transport.clone(), 1, 2, 2).await;
    let options = PserverOptions {
        keys: common::keys(),
        specs: specs.clone(),
        shards: 1,
        mode: Mode::Async,
        optimizer: adam,
        block_size: BLOCK,
        ..Default::default()
    };
    let mut pservers = Vec::new();
    for _ in 0..2 {
        let ps = Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", options.clone()).await;
        pservers.push(ps.expect("pserver"));
    }
    wait_ok(discovery.as_ref()).await;
    let placement = Arc::new(Placement::new(&specs, 1, BLOCK).expect("placement"));
    let client_options = PserverClientOptions::new(common::keys(), "trainer");
    let mut client = PserverClient::new(discovery.clone(), transport.clone(), placement, client_options);
    client.push(&grads, 1.0).await.expect("push"); // the optimizer state is written
    let map = discovery.get(&common::keys().shard_map).await.expect("get").expect("a map");
    let map = oar_pserver::ShardMap::decode(&map.value).expect("map");
    let follower = pservers.iter().position(|p| Some(p.name()) != map.primary(0)).expect("a follower");
    let gone = pservers.remove(follower);
    let registration =
        discovery.get(&common::keys().pserver(gone.name())).await.expect("get").expect("registered");
    discovery.revoke_lease(registration.lease.expect("a lease")).await.expect("revoke");
    drop(gone);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // What a pserver costs holding nothing (its QUIC endpoint's buffers:
    // on loopback, with its 64 KiB MTU, quinn's receive buffer is large).
    let idle_discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let before = live();
    let idle = Pserver::start(idle_discovery, transport.clone(), "127.0.0.1:0", options.clone()).await;
    let idle = idle.expect("pserver");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let empty = live().saturating_sub(before);
    drop(idle);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = live();
    reset_peak();
    let newcomer = Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", options).await;
    let newcomer = newcomer.expect("pserver");
    wait_ok(discovery.as_ref()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let grown = live().saturating_sub(before);
    let peaked = peak().saturating_sub(before);
    let held = grown.saturating_sub(empty);
    let must_hold = (n * 4 * 3) as u64; // parameters and Adam's two slots
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "follower memory: a new pserver caught up as follower: heap +{:.1} MiB, of which {:.1} MiB any pserver \
         holding nothing takes; the follower's state: {:.1} MiB for {:.1} MiB of parameters + Adam state: \
         {:.2}x (target <= 1.1x); at most +{:.1} MiB during the catch-up ({:.2}x the state)",
        mib(grown),
        mib(empty),
        mib(held),
        mib(must_hold),
        held as f64 / must_hold as f64,
        mib(peaked),
        peaked as f64 / must_hold as f64
    );
    drop(newcomer);
}
