//! What moving shards between pservers costs (issue 17, elastic jobs):
//! three measurements, each against a reference taken in the same run,
//! medians over `--reps` (default 5), every rep on a fresh cluster.
//!
//!     cargo run --release -p oar-bench --bin bench_move -- --reps 5
//!     cargo run --release -p oar-bench --bin bench_move -- --reps 5 --only 1 --millions 10
//!
//! All pservers, the coordinator and the trainers run in this process, on
//! one QUIC transport over 127.0.0.1 and a `MemDiscovery`. The coordinator
//! runs with `rebalance: true`; the job asks for one pserver more
//! (`set_pservers`) and starts it, and the new pserver gets its share one
//! move at a time (a replica added on it catches up from a snapshot and
//! the updates after it, then takes over as primary while the old replica
//! is dropped). Blocks of 64 Ki floats (the job's default), Adam
//! everywhere, R = 1.
//!
//! 1. **Moving one shard.** A job of 2 logical shards holding `--millions`
//!    (default 10) M floats each, both on one pserver; a few pushes make
//!    Adam's state non-zero; a second pserver starts and one shard moves to
//!    it. Timed from the second pserver's registration until the map names
//!    it alone for the shard and it serves the shard as primary; split into
//!    the catch-up (registration until the new replica says it caught up,
//!    of which the copy: from the map that adds it) and the switch (caught
//!    up until done). Reference: the same bytes (parameters and Adam's two
//!    slots, 12 bytes a float; the calls' metadata adds a few KB) written
//!    over one TCP connection on 127.0.0.1 (`TCP_NODELAY`) into a buffer
//!    the receiver reuses, answered by one byte. Target: at most 2x. Also
//!    shown: the same bytes over QUIC with no pserver in the way, fetched
//!    in calls of one snapshot part (7.9 MB) one after another, as a
//!    catch-up fetches them: what the transport alone costs.
//! 2. **Sync stall during a primary switch.** A sync job of `--small`
//!    (default 1) M floats on 4 shards, 2 trainers stepping (pull, push)
//!    without pause on one pserver; a second pserver joins and 2 shards
//!    move to it, each with a primary switch (R = 1). For each move: the
//!    longest step (a pull and a push, or a rejoin after a stale push)
//!    that started during it (from the end of the move before, or the
//!    registration, to the map that drops the old replica; for a move
//!    quicker than a step, the step it fell within), against the
//!    median step before the join. Median over every move of every rep;
//!    also the longest step of the whole scale-out.
//! 3. **Async throughput during a scale-out.** An async job of `--small` M
//!    floats on 8 shards, 2 trainers push-pulling without pause on one
//!    pserver; a second pserver joins and 4 shards move to it. Push-pulls
//!    per second from its registration until balanced (every shard back to
//!    one replica, the newcomer serving its share as primary), against the
//!    2 s before the join.
//!
//! `--only 1,3` runs some of them. Every wait has a deadline and ends the
//! run with a message.

use oar_bench::pserver as common;

use oar_discovery::{Discovery, MemDiscovery};
use oar_pserver::{
    protocol::ReplicaRole, set_pservers, topology::TopologyWatch, Coordinator, CoordinatorOptions, Init,
    Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement, Pserver, PserverClient, PserverClientOptions,
    PserverOptions, PushResult, ScaleOptions, ShardMap,
};
use oar_transport::{Connection, DevCa, Frame, QuicTransport, RemoteError, RetryPolicy, Transport};
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

/// The job's default block size.
const BLOCK: usize = 1 << 16;

type Res<T> = Result<T, String>;

fn adam() -> OptimizerConfig {
    OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A cluster of pservers under one coordinator that rebalances, on a
/// discovery of its own.
struct Cluster {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    options: PserverOptions,
    placement: Arc<Placement>,
    pservers: Vec<Pserver>,
    watch: TopologyWatch,
    _coordinator: Coordinator,
}

impl Cluster {
    /// `pservers` pservers holding `shards` shards of `specs` (R = 1), once
    /// the cluster says OK.
    async fn start(
        transport: Arc<dyn Transport>,
        specs: &[ParamSpec],
        shards: u32,
        mode: Mode,
        pservers: u32,
    ) -> Res<Cluster> {
        let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
        let lease =
            discovery.grant_lease(Duration::from_secs(3600)).await.map_err(|e| format!("lease: {e}"))?;
        let fence = discovery
            .lock("/bench/coordinator", Vec::new(), lease, Duration::from_secs(5))
            .await
            .map_err(|e| format!("coordinator lock: {e}"))?;
        let options = CoordinatorOptions {
            keys: common::keys(),
            shards,
            replicas: 1,
            pservers,
            rebalance: true,
            ..CoordinatorOptions::default()
        };
        let coordinator = Coordinator::start(discovery.clone(), transport.clone(), fence, options)
            .await
            .map_err(|e| format!("coordinator: {e}"))?;
        let watch = TopologyWatch::start(discovery.clone(), &common::keys())
            .await
            .map_err(|e| format!("topology watch: {e}"))?;
        let options = PserverOptions {
            keys: common::keys(),
            specs: specs.to_vec(),
            shards,
            mode,
            optimizer: adam(),
            block_size: BLOCK,
            ..PserverOptions::default()
        };
        let placement =
            Arc::new(Placement::new(specs, shards, BLOCK).map_err(|e| format!("placement: {e}"))?);
        let mut cluster = Cluster {
            discovery,
            transport,
            options,
            placement,
            pservers: Vec::new(),
            watch,
            _coordinator: coordinator,
        };
        for _ in 0..pservers {
            cluster.add_pserver().await?;
        }
        cluster.wait_ok().await?;
        Ok(cluster)
    }

    /// Start one more pserver: its name, and when it had registered.
    async fn add_pserver(&mut self) -> Res<(String, Instant)> {
        let ps = Pserver::start(
            self.discovery.clone(),
            self.transport.clone(),
            "127.0.0.1:0",
            self.options.clone(),
        )
        .await
        .map_err(|e| format!("pserver: {e}"))?;
        // `start` returns once registered.
        let registered = Instant::now();
        let name = ps.name().to_string();
        self.pservers.push(ps);
        Ok((name, registered))
    }

    /// Ask the coordinator for one pserver more (`set_pservers`: a pserver
    /// beyond the wanted count is released at once), then start it: its
    /// name, and when it had registered.
    async fn scale_out(&mut self) -> Res<(String, Instant)> {
        let count = self.pservers.len() as u32 + 1;
        set_pservers(&*self.discovery, &common::keys(), count, ScaleOptions::default())
            .await
            .map_err(|e| format!("scaling to {count} pservers: {e}"))?;
        self.add_pserver().await
    }

    /// Wait until the coordinator says OK.
    async fn wait_ok(&self) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(kv)) = self.discovery.get(&common::keys().cluster_status).await {
                let status = serde_json::from_slice::<serde_json::Value>(&kv.value).unwrap_or_default();
                if status["status"] == "OK" {
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    return Err(format!("the cluster was not OK within 60 s: {status}"));
                }
            } else if Instant::now() >= deadline {
                return Err("no cluster status within 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn client(&self, trainer: &str) -> PserverClient {
        let options = PserverClientOptions {
            call_timeout: Duration::from_secs(30),
            retry: RetryPolicy { give_up_after: Duration::from_secs(60), ..RetryPolicy::default() },
            ..PserverClientOptions::new(common::keys(), trainer)
        };
        PserverClient::new(self.discovery.clone(), self.transport.clone(), self.placement.clone(), options)
    }

    /// Register trainers `t0..` as a job's trainers are (under a lease), so
    /// that a new primary keeps them in its sync barrier.
    async fn register_trainers(&self, n: usize) -> Res<()> {
        let lease = self.discovery.grant_lease(Duration::from_secs(600)).await.map_err(|e| e.to_string())?;
        for t in 0..n {
            let key = format!("{}t{t}", common::keys().members);
            self.discovery.put(&key, Vec::new(), Some(lease)).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn pserver(&self, name: &str) -> Option<&Pserver> {
        self.pservers.iter().find(|p| p.name() == name)
    }

    /// Wait until the map is balanced over the pservers (every shard back
    /// to one replica, loads within one of each other) and `newcomer`
    /// serves each of its shards as primary; when that was first seen.
    async fn wait_balanced(&self, newcomer: &str, max: Duration) -> Res<Instant> {
        let deadline = Instant::now() + max;
        loop {
            let topology = self.watch.current();
            if let Some(map) = &topology.map {
                let settled = (0..map.shard_count()).all(|s| map.replica_set(s).len() == 1);
                let loads: Vec<usize> = self.pservers.iter().map(|p| map.shards_of(p.name()).len()).collect();
                let even = loads.iter().max().unwrap_or(&0) - loads.iter().min().unwrap_or(&0) <= 1;
                let serving = self.pserver(newcomer).is_some_and(|p| {
                    let held = p.replicas();
                    map.shards_of(newcomer)
                        .iter()
                        .all(|(s, _)| held.iter().any(|r| r.shard == *s && r.role == ReplicaRole::Primary))
                });
                if settled && even && serving {
                    return Ok(Instant::now());
                }
                if Instant::now() >= deadline {
                    return Err(format!("not balanced within {max:?}: loads {loads:?}, map:\n{map}"));
                }
            } else if Instant::now() >= deadline {
                return Err(format!("no shard map within {max:?}"));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Maps with when each was first seen.
type Seen = Arc<Mutex<Vec<(Instant, Arc<ShardMap>)>>>;

/// Every map a [`TopologyWatch`] shows, with when it was first seen.
struct Recorder {
    maps: Seen,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    fn start(watch: &TopologyWatch) -> Recorder {
        let maps: Seen = Arc::default();
        let mut rx = watch.subscribe();
        let seen = maps.clone();
        let task = tokio::spawn(async move {
            loop {
                let topology = rx.borrow_and_update().clone();
                if let Some(map) = &topology.map {
                    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                    if seen.last().is_none_or(|(_, m)| m.version() != map.version()) {
                        seen.push((Instant::now(), map.clone()));
                    }
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Recorder { maps, task }
    }

    /// When a map first satisfied `holds`.
    fn first(&self, holds: impl Fn(&ShardMap) -> bool) -> Option<Instant> {
        let maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        maps.iter().find(|(_, m)| holds(m)).map(|(t, _)| *t)
    }

    /// For each shard that moved to `newcomer`: when a map first added it
    /// there, and when a map first named it alone.
    fn moves(&self, newcomer: &str, shards: u32) -> Vec<(u32, Instant, Instant)> {
        (0..shards)
            .filter_map(|s| {
                let added = self.first(|m| m.role(s, newcomer).is_some())?;
                let done = self.first(|m| m.replica_set(s) == [newcomer.to_string()])?;
                Some((s, added, done))
            })
            .collect()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Receives length-prefixed messages into one reused buffer, each answered
/// by one byte.
async fn tcp_sink(listener: TcpListener) {
    while let Ok((mut s, _)) = listener.accept().await {
        let _ = s.set_nodelay(true);
        tokio::spawn(async move {
            let mut reused = Vec::new();
            loop {
                let Ok(len) = s.read_u64_le().await else { return };
                reused.resize(len as usize, 0u8);
                if s.read_exact(&mut reused).await.is_err() {
                    return;
                }
                std::hint::black_box(&reused);
                if s.write_all(&[1]).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// One copy of `payload` to the sink: until its answer came.
async fn tcp_copy(s: &mut TcpStream, payload: &[u8]) -> Res<Duration> {
    let t = Instant::now();
    let copy = async {
        s.write_u64_le(payload.len() as u64).await?;
        s.write_all(payload).await?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).await?;
        std::io::Result::Ok(())
    };
    match tokio::time::timeout(Duration::from_secs(60), copy).await {
        Ok(Ok(())) => Ok(t.elapsed()),
        Ok(Err(e)) => Err(format!("TCP copy: {e}")),
        Err(_) => Err("TCP copy: no answer within 60 s".into()),
    }
}

/// The snapshot's part size: 10 blocks of 64 Ki floats with Adam's two
/// slots, as many as fit in the 2 Mi values a part carries.
const PART_BYTES: usize = 10 * BLOCK * 3 * 4;

/// Answers a request for bytes `(offset, len)` of its data with them (a
/// slice: no copy on the sending side).
struct Slices(bytes::Bytes);

#[async_trait::async_trait]
impl oar_transport::Handler for Slices {
    async fn handle(&self, request: Frame) -> Result<Frame, RemoteError> {
        let (at, len): (u64, u64) = request.meta().map_err(RemoteError::internal)?;
        let end = (at as usize).saturating_add(len as usize).min(self.0.len());
        let start = (at as usize).min(end);
        Frame::new(request.method, &(), self.0.slice(start..end)).map_err(RemoteError::internal)
    }
}

/// `total` bytes fetched from a [`Slices`] over QUIC in calls of
/// [`PART_BYTES`], one at a time, as a catch-up fetches a snapshot.
async fn quic_parts(conn: &dyn Connection, total: usize) -> Res<Duration> {
    let t = Instant::now();
    for at in (0..total).step_by(PART_BYTES) {
        let len = PART_BYTES.min(total - at);
        let request =
            Frame::new(1, &(at as u64, len as u64), bytes::Bytes::new()).map_err(|e| e.to_string())?;
        let reply =
            conn.call(request, Duration::from_secs(60)).await.map_err(|e| format!("QUIC part: {e}"))?;
        if reply.payload.len() != len {
            return Err(format!("QUIC part: {} bytes instead of {len}", reply.payload.len()));
        }
    }
    Ok(t.elapsed())
}

/// One rep of measurement 1.
struct Moved {
    /// Registration until the new pserver serves the shard alone.
    total: Duration,
    /// Registration until the new replica caught up.
    caught: Duration,
    /// The map that added the new replica until it caught up.
    copy: Duration,
    /// Caught up until done.
    switch: Duration,
    /// The shard's parameters and Adam's two slots, in bytes.
    bytes: usize,
    /// What the new pserver received while catching up.
    received: u64,
}

async fn move_one_shard(transport: &Arc<dyn Transport>, n: usize) -> Res<Moved> {
    // One parameter of 2n floats: n on each of the 2 shards (±1 block).
    let specs = vec![ParamSpec::new("w", vec![2 * n], Init::Uniform { low: -0.1, high: 0.1 })];
    let mut cluster = Cluster::start(transport.clone(), &specs, 2, Mode::Async, 1).await?;
    let mut client = cluster.client("trainer");
    let mut grads = ParamBuf::zeros(&specs);
    grads.fill(1e-3);
    for _ in 0..3 {
        client.push(&grads, 1.0).await.map_err(|e| format!("push: {e}"))?;
    }
    let recorder = Recorder::start(&cluster.watch);
    let (newcomer, registered) = cluster.scale_out().await?;
    let deadline = registered + Duration::from_secs(120);
    let (mut caught, mut serving, mut alone, mut shard) = (None, None, None, None);
    loop {
        let now = Instant::now();
        if let Some(map) = cluster.watch.current().map.clone() {
            if shard.is_none() {
                shard = (0..2).find(|&s| map.role(s, &newcomer).is_some());
            }
            if let Some(s) = shard {
                if alone.is_none() && map.replica_set(s) == [newcomer.clone()] {
                    alone = Some(now);
                }
                let role = cluster
                    .pserver(&newcomer)
                    .and_then(|p| p.replicas().into_iter().find(|r| r.shard == s).map(|r| r.role));
                match role {
                    Some(ReplicaRole::Follower) if caught.is_none() => caught = Some(now),
                    Some(ReplicaRole::Primary) => {
                        caught = caught.or(Some(now));
                        serving = serving.or(Some(now));
                    }
                    _ => {}
                }
            }
        }
        if let (Some(s), Some(caught), Some(serving), Some(alone)) = (shard, caught, serving, alone) {
            let done = serving.max(alone);
            let added = recorder.first(|m| m.role(s, &newcomer).is_some()).unwrap_or(registered);
            let bytes = cluster.placement.load(s) * 3 * 4;
            let received = cluster.pserver(&newcomer).map_or(0, Pserver::catch_up_bytes);
            drop(client);
            drop(cluster);
            return Ok(Moved {
                total: done - registered,
                caught: caught - registered,
                copy: caught.saturating_duration_since(added),
                switch: done - caught,
                bytes,
                received,
            });
        }
        if now >= deadline {
            return Err(format!(
                "measurement 1: the shard did not move within 120 s (shard {shard:?}, caught up {}, serving {}, \
                 alone in the map {})",
                caught.is_some(),
                serving.is_some(),
                alone.is_some()
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Each trainer's steps (or push-pulls) as (start, end), and the stale
/// pushes, shared with the trainer tasks.
#[derive(Default)]
struct Steps {
    spans: Mutex<Vec<(Instant, Instant)>>,
    stale: std::sync::atomic::AtomicU64,
}

impl Steps {
    fn spans(&self) -> Vec<(Instant, Instant)> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn count(&self) -> usize {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Trainers stepping without pause (sync: pull then push; async: push-pull)
/// until `stop`, or for at most 10 minutes.
fn start_trainers(
    cluster: &Cluster,
    specs: &[ParamSpec],
    trainers: usize,
    mode: Mode,
    steps: &Arc<Steps>,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Res<()>>> {
    (0..trainers)
        .map(|t| {
            let mut client = cluster.client(&format!("t{t}"));
            let (steps, stop) = (steps.clone(), stop.clone());
            let mut grads = ParamBuf::zeros(specs);
            grads.fill(1e-3);
            let mut params = ParamBuf::zeros(specs);
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(600);
                if mode == Mode::Sync {
                    client.join().await.map_err(|e| format!("join: {e}"))?;
                }
                while !stop.load(Ordering::SeqCst) {
                    if Instant::now() >= deadline {
                        return Err("a trainer ran for 10 minutes without being stopped".into());
                    }
                    let start = Instant::now();
                    match mode {
                        Mode::Sync => {
                            client.pull(&mut params).await.map_err(|e| format!("pull: {e}"))?;
                            match client.push(&grads, 1.0).await.map_err(|e| format!("push: {e}"))? {
                                PushResult::Accepted => {}
                                PushResult::Stale => {
                                    steps.stale.fetch_add(1, Ordering::SeqCst);
                                    client.join().await.map_err(|e| format!("join: {e}"))?;
                                }
                            }
                        }
                        Mode::Async => {
                            client
                                .push_pull(&grads, 1.0, &mut params)
                                .await
                                .map_err(|e| format!("push-pull: {e}"))?;
                        }
                    }
                    steps.spans.lock().unwrap_or_else(|e| e.into_inner()).push((start, Instant::now()));
                }
                if mode == Mode::Sync {
                    let _ = tokio::time::timeout(Duration::from_secs(10), client.leave()).await;
                }
                Ok(())
            })
        })
        .collect()
}

/// Stop the trainers and collect their outcomes (each within 60 s).
async fn stop_trainers(stop: &AtomicBool, running: Vec<tokio::task::JoinHandle<Res<()>>>) -> Res<()> {
    stop.store(true, Ordering::SeqCst);
    for task in running {
        match tokio::time::timeout(Duration::from_secs(60), task).await {
            Ok(Ok(outcome)) => outcome?,
            Ok(Err(e)) => return Err(format!("a trainer task failed: {e}")),
            Err(_) => return Err("a trainer did not stop within 60 s".into()),
        }
    }
    Ok(())
}

/// Wait until `steps` holds at least `n` spans, at most `max`.
async fn wait_steps(steps: &Steps, n: usize, max: Duration, what: &str) -> Res<()> {
    let deadline = Instant::now() + max;
    while steps.count() < n {
        if Instant::now() >= deadline {
            return Err(format!("{what}: {} of {n} steps within {max:?}", steps.count()));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// One rep of measurement 2.
struct Stall {
    /// The median step before the join (ms).
    baseline: f64,
    /// Per move, the longest step that started during it (ms).
    moves: Vec<f64>,
    /// The longest step that overlapped the scale-out, from the
    /// registration until balanced (ms).
    overall: f64,
    /// Sync pushes refused as stale (the trainer joined again).
    stale: u64,
}

async fn sync_stall(transport: &Arc<dyn Transport>, n: usize) -> Res<Stall> {
    let shards = 4;
    let specs = vec![ParamSpec::new("w", vec![n], Init::Uniform { low: -0.1, high: 0.1 })];
    let mut cluster = Cluster::start(transport.clone(), &specs, shards, Mode::Sync, 1).await?;
    cluster.register_trainers(2).await?;
    let (steps, stop) = (Arc::new(Steps::default()), Arc::new(AtomicBool::new(false)));
    let running = start_trainers(&cluster, &specs, 2, Mode::Sync, &steps, &stop);
    let outcome = async {
        wait_steps(&steps, 20, Duration::from_secs(60), "warm-up").await?;
        let warm = Instant::now();
        wait_steps(&steps, 100, Duration::from_secs(60), "steps before the join").await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let recorder = Recorder::start(&cluster.watch);
        let (newcomer, _) = cluster.scale_out().await?;
        let join = Instant::now();
        let balanced = cluster.wait_balanced(&newcomer, Duration::from_secs(120)).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok::<_, String>((warm, join, balanced, recorder.moves(&newcomer, shards)))
    }
    .await;
    let stopped = stop_trainers(&stop, running).await;
    let (warm, join, balanced, moves) = outcome?;
    stopped?;
    let spans = steps.spans();
    let before: Vec<f64> =
        spans.iter().filter(|(s, e)| *s >= warm && *e <= join).map(|(s, e)| ms(*e - *s)).collect();
    let baseline = median(&before);
    if moves.is_empty() {
        return Err("measurement 2: no shard moved".into());
    }
    // Moves follow one another: the scale-out is cut at the maps that end
    // them, and a step belongs to the move it started in (so a step across
    // the end of one counts once); a move quicker than a step gets the step
    // it fell within. The map that adds a replica may go by unseen when its
    // catch-up is quick: a move starts where the last ended.
    let longest = |during: &dyn Fn(&(Instant, Instant)) -> bool| {
        spans.iter().filter(|span| during(span)).map(|(s, e)| ms(*e - *s)).fold(0.0, f64::max)
    };
    let mut ends: Vec<Instant> = moves.iter().map(|(_, _, done)| *done).collect();
    ends.sort();
    let mut stalls = Vec::new();
    let mut from = join;
    for end in ends {
        let begun = spans.iter().any(|(s, _)| *s > from && *s <= end);
        stalls.push(match begun {
            true => longest(&|(s, _)| *s > from && *s <= end),
            false => longest(&|(s, e)| *s <= end && *e > from),
        });
        from = end;
    }
    let overall = longest(&|(s, e)| *s <= balanced && *e >= join);
    Ok(Stall { baseline, moves: stalls, overall, stale: steps.stale.load(Ordering::SeqCst) })
}

/// One rep of measurement 3: push-pulls per second before the join and
/// during the scale-out, the scale-out's length and its moves.
async fn async_throughput(transport: &Arc<dyn Transport>, n: usize) -> Res<(f64, f64, Duration, usize)> {
    let shards = 8;
    let window = Duration::from_secs(2);
    let specs = vec![ParamSpec::new("w", vec![n], Init::Uniform { low: -0.1, high: 0.1 })];
    let mut cluster = Cluster::start(transport.clone(), &specs, shards, Mode::Async, 1).await?;
    cluster.register_trainers(2).await?;
    let (steps, stop) = (Arc::new(Steps::default()), Arc::new(AtomicBool::new(false)));
    let running = start_trainers(&cluster, &specs, 2, Mode::Async, &steps, &stop);
    let outcome = async {
        wait_steps(&steps, 10, Duration::from_secs(60), "warm-up").await?;
        tokio::time::sleep(Duration::from_millis(300) + window).await;
        let recorder = Recorder::start(&cluster.watch);
        let (newcomer, registered) = cluster.scale_out().await?;
        let balanced = cluster.wait_balanced(&newcomer, Duration::from_secs(120)).await?;
        Ok::<_, String>((registered, balanced, recorder.moves(&newcomer, shards).len()))
    }
    .await;
    let stopped = stop_trainers(&stop, running).await;
    let (registered, balanced, moves) = outcome?;
    stopped?;
    let spans = steps.spans();
    let count = |from: Instant, to: Instant| spans.iter().filter(|(_, e)| *e > from && *e <= to).count();
    let before = count(registered - window, registered) as f64 / window.as_secs_f64();
    let during_for = balanced - registered;
    let during = count(registered, balanced) as f64 / during_for.as_secs_f64();
    Ok((before, during, during_for, moves))
}

async fn run(reps: usize, millions: f64, small: f64, only: &[u32]) -> Res<()> {
    let ca = DevCa::new().map_err(|e| format!("CA: {e}"))?;
    let tls = ca.tls_config("bench").map_err(|e| format!("TLS: {e}"))?;
    let transport: Arc<dyn Transport> = Arc::new(QuicTransport::new(tls).map_err(|e| format!("QUIC: {e}"))?);
    println!("{}", common::machine_load());
    let mut summary = Vec::new();

    if only.contains(&1) {
        let n = (millions * 1e6) as usize;
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("TCP bind: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let sink = tokio::spawn(tcp_sink(listener));
        let mut tcp = TcpStream::connect(addr).await.map_err(|e| format!("TCP connect: {e}"))?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        let mut payload: Vec<u8> = Vec::new();
        let mut quic: Option<(Box<dyn oar_transport::Listener>, Arc<dyn Connection>)> = None;
        let (mut moves, mut catch_ups, mut copies, mut switches, mut tcps, mut quics) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut bytes = 0;
        println!("1. moving one shard of {millions}M floats with Adam to a new pserver, vs raw TCP of the same bytes");
        for rep in 0..reps {
            let moved = move_one_shard(&transport, n).await?;
            bytes = moved.bytes;
            if payload.len() != moved.bytes {
                payload = (0..moved.bytes).map(|i| i as u8).collect();
                let data = bytes::Bytes::from(payload.clone());
                let listener = transport
                    .listen("127.0.0.1:0", Arc::new(Slices(data)))
                    .await
                    .map_err(|e| format!("QUIC listen: {e}"))?;
                let conn = transport
                    .connect(listener.local_addr())
                    .await
                    .map_err(|e| format!("QUIC connect: {e}"))?;
                tcp_copy(&mut tcp, &payload).await?; // warm up
                quic_parts(conn.as_ref(), payload.len()).await?;
                quic = Some((listener, conn));
            }
            let reference = tcp_copy(&mut tcp, &payload).await?;
            let parts = match &quic {
                Some((_, conn)) => quic_parts(conn.as_ref(), payload.len()).await?,
                None => return Err("no QUIC reference".into()),
            };
            println!(
                "   rep {rep}: move {:.1} ms (catch-up {:.1}, of which copy {:.1}; switch {:.1}); \
                 TCP {:.1} ms; {:.1}x; QUIC in parts {:.1} ms; {} bytes received for {} of parameters and state",
                ms(moved.total),
                ms(moved.caught),
                ms(moved.copy),
                ms(moved.switch),
                ms(reference),
                ms(moved.total) / ms(reference),
                ms(parts),
                moved.received,
                moved.bytes,
            );
            moves.push(ms(moved.total));
            catch_ups.push(ms(moved.caught));
            copies.push(ms(moved.copy));
            switches.push(ms(moved.switch));
            tcps.push(ms(reference));
            quics.push(ms(parts));
        }
        drop(quic);
        sink.abort();
        let (m, t) = (median(&moves), median(&tcps));
        summary.push(format!(
            "move one shard: {:.1} MB (params + Adam's 2 slots), median of {reps}: move {m:.0} ms (catch-up {:.0} ms, \
             of which copy {:.0} ms; switch {:.0} ms), raw TCP {t:.1} ms ({:.2} GB/s): ratio {:.1}x \
             (target <= 2x); ratio of the copy alone {:.1}x; the same bytes over QUIC in {:.1} MB calls one at a \
             time (no pserver) {:.0} ms = {:.1}x TCP",
            bytes as f64 / 1e6,
            median(&catch_ups),
            median(&copies),
            median(&switches),
            bytes as f64 / t / 1e6,
            m / t,
            median(&copies) / t,
            PART_BYTES as f64 / 1e6,
            median(&quics),
            median(&quics) / t,
        ));
    }

    if only.contains(&2) {
        let n = (small * 1e6) as usize;
        println!(
            "2. sync: 2 trainers stepping on {small}M floats in 4 shards; a pserver joins, 2 shards move"
        );
        let (mut baselines, mut stalls, mut ratios, mut overalls) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut stale = 0;
        for rep in 0..reps {
            let stall = sync_stall(&transport, n).await?;
            stale += stall.stale;
            let shown: Vec<String> = stall.moves.iter().map(|l| format!("{l:.1}")).collect();
            println!(
                "   rep {rep}: median step before {:.1} ms; longest step per move {} ms; longest during the \
                 scale-out {:.1} ms; stale pushes {}",
                stall.baseline,
                shown.join(", "),
                stall.overall,
                stall.stale
            );
            baselines.push(stall.baseline);
            overalls.push(stall.overall / stall.baseline);
            for l in stall.moves {
                stalls.push(l);
                ratios.push(l / stall.baseline);
            }
        }
        let worst = ratios.iter().copied().fold(0.0, f64::max);
        summary.push(format!(
            "sync stall: median step before the join {:.1} ms; longest step during a move, median of {} moves: \
             {:.1} ms = {:.1}x the median step before (worst {:.1}x; longest of a whole scale-out, median of \
             {reps}: {:.1}x); {stale} stale pushes",
            median(&baselines),
            stalls.len(),
            median(&stalls),
            median(&ratios),
            worst,
            median(&overalls),
        ));
    }

    if only.contains(&3) {
        let n = (small * 1e6) as usize;
        println!(
            "3. async: 2 trainers push-pulling {small}M floats in 8 shards; a pserver joins, 4 shards move"
        );
        let (mut befores, mut durings, mut ratios, mut lengths) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for rep in 0..reps {
            let (before, during, length, moves) = async_throughput(&transport, n).await?;
            println!(
                "   rep {rep}: {before:.1} push-pulls/s before, {during:.1}/s during the scale-out \
                 ({:.0} ms, {moves} moves): {:.2}",
                ms(length),
                during / before
            );
            befores.push(before);
            durings.push(during);
            ratios.push(during / before);
            lengths.push(ms(length));
        }
        summary.push(format!(
            "async scale-out: {:.1} push-pulls/s before, {:.1}/s during the moves ({:.0} ms), median of {reps}: \
             ratio {:.2}",
            median(&befores),
            median(&durings),
            median(&lengths),
            median(&ratios)
        ));
    }

    println!("summary:");
    for line in summary {
        println!("{line}");
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    let mut reps = 5usize;
    let mut millions = 10.0f64;
    let mut small = 1.0f64;
    let mut only = vec![1, 2, 3];
    let mut args = std::env::args().skip(1);
    let usage = || -> ! {
        eprintln!("usage: bench_move [--reps R] [--millions M] [--small M] [--only 1,2,3]");
        std::process::exit(2)
    };
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--reps" => reps = value.parse().unwrap_or_else(|_| usage()),
            "--millions" => millions = value.parse().unwrap_or_else(|_| usage()),
            "--small" => small = value.parse().unwrap_or_else(|_| usage()),
            "--only" => {
                only = value.split(',').map(|v| v.trim().parse().unwrap_or_else(|_| usage())).collect()
            }
            _ => usage(),
        }
    }
    if reps == 0 || millions <= 0.0 || small <= 0.0 {
        usage();
    }
    if let Err(e) = run(reps, millions, small, &only).await {
        eprintln!("bench_move: {e}");
        std::process::exit(1);
    }
}
