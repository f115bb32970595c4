//! Replicated shards end to end, in one process (in-memory discovery and
//! transport): the coordinator's first map, followers catching up, a
//! primary's death (its lease revoked) with not one acknowledged push
//! lost, a follower's death and its replacement, and bad replication
//! calls. `oar-job`'s tests do the same with real processes, etcd and
//! SIGKILL.

use crate::common;

use bytes::Bytes;
use common::{keys, Cluster};
use oar_discovery::{Discovery, MemDiscovery};
use oar_pserver::{
    protocol::{PsReply, PsRequest, ReplicaRole, UpdateKind, UpdateMeta, PSERVER_METHOD},
    set_pservers, BlockId, CoordinatorOptions, Init, Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement,
    Pserver, PserverClient, PserverClientOptions, PserverOptions, PushResult, ScaleOptions, ServiceError,
    ShardMap,
};
use oar_transport::{call, MemNetwork, MemTransport, RemoteErrorKind, RetryPolicy, Transport};
use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

/// One parameter of `len` zeros in blocks of 4: SGD at lr 1 on gradients
/// of ones makes every element minus the number of updates applied.
fn specs(len: usize) -> Vec<ParamSpec> {
    vec![ParamSpec::new("w", vec![len], Init::Zeros)]
}

struct Env {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    cluster: Cluster,
    shards: u32,
    len: usize,
    mode: Mode,
    block_size: usize,
}

impl Env {
    async fn new(shards: u32, replicas: u32, pservers: u32, len: usize, mode: Mode) -> Env {
        Self::with(shards, replicas, pservers, len, mode, false).await
    }

    async fn with(shards: u32, replicas: u32, pservers: u32, len: usize, mode: Mode, rebalance: bool) -> Env {
        Self::over(Arc::new(MemDiscovery::new()), shards, replicas, pservers, len, mode, rebalance).await
    }

    /// An environment whose pservers, coordinator and trainers use `discovery`.
    async fn over(
        discovery: Arc<dyn Discovery>,
        shards: u32,
        replicas: u32,
        pservers: u32,
        len: usize,
        mode: Mode,
        rebalance: bool,
    ) -> Env {
        let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
        let options = CoordinatorOptions { shards, replicas, pservers, rebalance, ..Default::default() };
        let cluster = Cluster::start_with(discovery.clone(), transport.clone(), options).await;
        Env { discovery, transport, cluster, shards, len, mode, block_size: 4 }
    }

    async fn pserver(&self) -> Pserver {
        self.pserver_with(None).await
    }

    /// A pserver whose shards' checkpoints are under `dir`.
    async fn pserver_checkpointing(&self, dir: &std::path::Path) -> Pserver {
        self.pserver_with(Some(dir.to_path_buf())).await
    }

    async fn pserver_with(&self, checkpoint_dir: Option<std::path::PathBuf>) -> Pserver {
        let options = PserverOptions {
            keys: keys(),
            specs: specs(self.len),
            shards: self.shards,
            block_size: self.block_size,
            mode: self.mode,
            optimizer: OptimizerConfig::Sgd { lr: 1.0 },
            lease_ttl: Duration::from_secs(30),
            replication_timeout: Duration::from_secs(2),
            checkpoint_dir,
            ..Default::default()
        };
        Pserver::start(self.discovery.clone(), self.transport.clone(), "mem:0", options).await.unwrap()
    }

    fn placement(&self) -> Arc<Placement> {
        Arc::new(Placement::new(&specs(self.len), self.shards, self.block_size).unwrap())
    }

    fn client(&self, trainer: &str) -> PserverClient {
        let options = PserverClientOptions {
            call_timeout: Duration::from_secs(2),
            retry: RetryPolicy { give_up_after: Duration::from_secs(60), ..RetryPolicy::default() },
            ..PserverClientOptions::new(keys(), trainer)
        };
        PserverClient::new(self.discovery.clone(), self.transport.clone(), self.placement(), options)
    }

    /// A pserver dies: its lease ends (its registration and replica states
    /// go at once) and it stops answering.
    async fn kill(&self, ps: Pserver) {
        let lease = self.discovery.get(&keys().pserver(ps.name())).await.unwrap().unwrap().lease.unwrap();
        self.discovery.revoke_lease(lease).await.unwrap();
        drop(ps);
    }

    async fn wait_status(&self, want: &str) -> serde_json::Value {
        self.wait_status_because(want, "").await
    }

    /// [`wait_status`](Self::wait_status) whose reason contains `because`:
    /// a status passes through others on its way (a dead follower's
    /// replicas are first "not caught up", then gone).
    async fn wait_status_because(&self, want: &str, because: &str) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(kv) = self.discovery.get(&keys().cluster_status).await.unwrap() {
                let status: serde_json::Value = serde_json::from_slice(&kv.value).unwrap();
                if status["status"] == want && status["reason"].as_str().unwrap_or_default().contains(because)
                {
                    return status;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "status {want} ({because:?}) never came: {status}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Each block's values on every replica of its shard, which must agree.
fn assert_replicas_agree(map: &ShardMap, pservers: &[&Pserver], placement: &Placement) {
    for block in placement.blocks() {
        let holders: Vec<(&str, Vec<f32>)> = map
            .replica_set(block.server)
            .iter()
            .map(|name| {
                let ps = pservers.iter().find(|p| p.name() == name).expect("a mapped pserver");
                (ps.name(), ps.block(block.id).expect("a replica holds its shard's blocks"))
            })
            .collect();
        for (name, values) in &holders[1..] {
            assert_eq!(
                values, &holders[0].1,
                "block {} on {name} and on the primary {}",
                block.id, holders[0].0
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_map_spreads_the_replicas_and_every_follower_holds_what_its_primary_holds() {
    let env = Env::new(6, 2, 3, 40, Mode::Async).await;
    let status = env.wait_status("UNKNOWN").await;
    assert!(
        status["reason"].as_str().unwrap().contains("0 of 3 pservers"),
        "no map before the pservers come: {status}"
    );
    let pservers = [env.pserver().await, env.pserver().await, env.pserver().await];
    let all: Vec<&Pserver> = pservers.iter().collect();
    let map = env.cluster.wait_serving(&all).await;
    for ps in &pservers {
        let held = ps.replicas();
        let primaries = held.iter().filter(|r| r.role == ReplicaRole::Primary).count();
        assert_eq!((primaries, held.len()), (2, 4), "{}: 2 of 6 primaries, 4 of 12 replicas", ps.name());
    }
    env.wait_status("OK").await;

    let mut trainer = env.client("t1");
    let mut grads = ParamBuf::zeros(&specs(40));
    grads.fill(1.0);
    for _ in 0..5 {
        assert_eq!(trainer.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
    }
    let mut params = ParamBuf::zeros(&specs(40));
    trainer.pull(&mut params).await.unwrap();
    assert!(params.as_slice().iter().all(|&x| x == -5.0), "{:?}", params.as_slice());
    // Acknowledged means every follower holds it: no waiting needed here.
    assert_replicas_agree(&map, &all, &env.placement());
}

/// Two trainers pushing ones in a loop (pull, push; a stale sync push
/// rejoins), counting the pushes acknowledged and the highest step seen.
struct Pushers {
    acked: Arc<AtomicU64>,
    /// Per shard, the pushes it acknowledged as taken (sync: a push stale
    /// on one shard may be taken on another).
    per_shard: Arc<std::sync::Mutex<Vec<u64>>>,
    seen_step: Arc<AtomicU64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    trainers: Vec<tokio::task::JoinHandle<()>>,
}

impl Pushers {
    /// Registered as the job's trainers are (so a new primary keeps them
    /// in its barrier).
    async fn start(env: &Arc<Env>) -> Pushers {
        let (len, mode) = (env.len, env.mode);
        let lease = env.discovery.grant_lease(Duration::from_secs(600)).await.unwrap();
        for t in 0..2 {
            env.discovery.put(&format!("{}t{t}", keys().members), Vec::new(), Some(lease)).await.unwrap();
        }
        let acked = Arc::new(AtomicU64::new(0));
        let per_shard = Arc::new(std::sync::Mutex::new(vec![0; env.shards as usize]));
        let seen_step = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut trainers = Vec::new();
        for t in 0..2 {
            let (env, acked, seen_step, stop) = (env.clone(), acked.clone(), seen_step.clone(), stop.clone());
            let per_shard = per_shard.clone();
            trainers.push(tokio::spawn(async move {
                let mut client = env.client(&format!("t{t}"));
                let mut grads = ParamBuf::zeros(&specs(len));
                grads.fill(1.0);
                let mut params = ParamBuf::zeros(&specs(len));
                if mode == Mode::Sync {
                    client.join().await.unwrap();
                }
                while !stop.load(Ordering::SeqCst) {
                    client.pull(&mut params).await.unwrap();
                    let _ = seen_step.fetch_max((-params.as_slice()[0]) as u64, Ordering::SeqCst);
                    match client.push(&grads, 1.0).await.unwrap() {
                        PushResult::Accepted => {
                            acked.fetch_add(1, Ordering::SeqCst);
                        }
                        PushResult::Stale => client.join().await.unwrap(),
                    }
                }
                if mode == Mode::Sync {
                    client.leave().await.unwrap();
                }
                let mut per_shard = per_shard.lock().unwrap();
                for (shard, count) in per_shard.iter_mut().enumerate() {
                    *count += client.acknowledged(shard as u32);
                }
            }));
        }
        Pushers { acked, per_shard, seen_step, stop, trainers }
    }

    /// Stop them, then check every shard of `pservers`: async, every
    /// element is minus the pushes acknowledged (each applied once); sync,
    /// minus the shard's steps (each applied once), and the shard of the
    /// first element lost no step a trainer saw. Every follower holds what
    /// its primary holds.
    async fn stop_and_check(self, env: &Env, pservers: &[Pserver]) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.trainers {
            t.await.unwrap();
        }
        let map = env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
        let acked = self.acked.load(Ordering::SeqCst);
        assert!(acked > 0);
        for shard in 0..map.shard_count() {
            let primary = pservers.iter().find(|p| Some(p.name()) == map.primary(shard)).unwrap();
            let step = primary.step(shard).unwrap();
            let block = env.placement().blocks_on(shard).next().unwrap().id;
            let value = primary.block(block).unwrap()[0];
            match env.mode {
                Mode::Async => {
                    assert_eq!(value, -(acked as f32), "shard {shard}: {acked} pushes acknowledged")
                }
                Mode::Sync => {
                    assert_eq!(value, -(step as f32), "shard {shard}: each step applied once");
                    let pushes = primary.pushes(shard).unwrap();
                    let acked = self.per_shard.lock().unwrap()[shard as usize];
                    assert_eq!(pushes, acked, "shard {shard}: {acked} pushes acknowledged, {pushes} applied");
                    // The trainers read the steps off the first element.
                    if env.placement().blocks_on(shard).any(|b| b.offset == 0) {
                        let seen = self.seen_step.load(Ordering::SeqCst);
                        assert!(step >= seen, "shard {shard} lost a step a trainer saw");
                    }
                }
            }
        }
        assert_replicas_agree(&map, &pservers.iter().collect::<Vec<_>>(), &env.placement());
    }
}

/// Trainers push ones in a loop while primaries die one after another
/// (with a fresh pserver started each time); at the end every element is
/// minus the number of pushes the trainers saw acknowledged (async), or
/// minus the number of steps (sync) and no trainer saw a step a shard
/// then lost.
async fn no_acknowledged_push_is_lost(mode: Mode, replicas: u32, kills: usize) {
    let len = 24;
    let env = Arc::new(Env::new(3, replicas, replicas + 1, len, mode).await);
    let mut pservers = Vec::new();
    for _ in 0..=replicas {
        pservers.push(env.pserver().await);
    }
    env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;

    let pushers = Pushers::start(&env).await;
    let mut rng = oar_pserver::SplitMix64::new(7);
    for _ in 0..kills {
        tokio::time::sleep(Duration::from_millis(100 + rng.next_u64() % 200)).await;
        let map = env.cluster.map().await.unwrap();
        // Kill the primary of a random shard.
        let shard = (rng.next_u64() % map.shard_count() as u64) as u32;
        let victim = map.primary(shard).unwrap().to_string();
        let at = pservers.iter().position(|p| p.name() == victim).unwrap();
        env.kill(pservers.remove(at)).await;
        pservers.push(env.pserver().await);
        env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    pushers.stop_and_check(&env, &pservers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_two_replicas_no_acknowledged_push_is_lost_when_primaries_die() {
    no_acknowledged_push_is_lost(Mode::Async, 2, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_three_replicas_no_acknowledged_push_is_lost_when_primaries_die() {
    no_acknowledged_push_is_lost(Mode::Async, 3, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_two_replicas_no_acknowledged_step_is_lost_when_primaries_die() {
    no_acknowledged_push_is_lost(Mode::Sync, 2, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_follower_is_dropped_the_shard_keeps_serving_and_a_new_pserver_catches_up() {
    let env = Env::new(2, 2, 2, 16, Mode::Async).await;
    let (a, b) = (env.pserver().await, env.pserver().await);
    let map = env.cluster.wait_serving(&[&a, &b]).await;
    env.wait_status("OK").await;
    let mut trainer = env.client("t1");
    let mut grads = ParamBuf::zeros(&specs(16));
    grads.fill(1.0);
    trainer.push(&grads, 1.0).await.unwrap();

    // b dies: every shard keeps serving on a alone, and the cluster says so.
    let (survivor, dead) = if map.primary(0) == Some(a.name()) { (a, b) } else { (b, a) };
    env.kill(dead).await;
    // (Until the dead one's lease ends, its replicas are "not caught up".)
    env.wait_status_because("UNHEALTHY", "fewer than 2 replicas").await;
    for _ in 0..3 {
        assert_eq!(trainer.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
    }

    // A new pserver takes the missing replicas: it catches up, and the
    // cluster is OK again once it has.
    let newcomer = env.pserver().await;
    let map = env.cluster.wait_serving(&[&survivor, &newcomer]).await;
    env.wait_status("OK").await;
    trainer.push(&grads, 1.0).await.unwrap();
    let mut params = ParamBuf::zeros(&specs(16));
    trainer.pull(&mut params).await.unwrap();
    assert!(params.as_slice().iter().all(|&x| x == -5.0), "{:?}", params.as_slice());
    assert_replicas_agree(&map, &[&survivor, &newcomer], &env.placement());
}

/// A shard larger than one snapshot part (3M floats, parts of at most 2M
/// values) reaches a newcomer in several parts, each written straight into
/// its blocks: every value arrives, once, in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_in_several_parts_restores_every_block() {
    let len = 3 << 20;
    let mut env = Env::new(1, 2, 2, len, Mode::Async).await;
    env.block_size = 64 << 10;
    let (a, b) = (env.pserver().await, env.pserver().await);
    let map = env.cluster.wait_serving(&[&a, &b]).await;
    env.wait_status("OK").await;
    let mut trainer = env.client("t1");
    // Each element's gradient is its index mod 1000, so a value out of
    // place (a block or part shifted) shows.
    let mut grads = ParamBuf::zeros(&specs(len));
    grads.as_mut_slice().iter_mut().enumerate().for_each(|(i, g)| *g = (i % 1000) as f32);
    trainer.push(&grads, 1.0).await.unwrap();
    let (survivor, dead) = if map.primary(0) == Some(a.name()) { (a, b) } else { (b, a) };
    env.kill(dead).await;
    env.wait_status_because("UNHEALTHY", "fewer than 2 replicas").await;
    trainer.push(&grads, 1.0).await.unwrap();

    let newcomer = env.pserver().await;
    let map = env.cluster.wait_serving(&[&survivor, &newcomer]).await;
    env.wait_status("OK").await;
    assert_eq!(newcomer.catch_up_bytes(), len as u64 * 4, "the shard's parameters, once");
    let mut params = ParamBuf::zeros(&specs(len));
    trainer.pull(&mut params).await.unwrap();
    let wrong = params.as_slice().iter().enumerate().find(|&(i, &x)| x != -2.0 * (i % 1000) as f32);
    assert_eq!(wrong, None, "(index, value) of the first value out of place");
    assert_replicas_agree(&map, &[&survivor, &newcomer], &env.placement());
}

/// Sync with followers: a push that waits in its step (the other trainer
/// has not pushed) is not acknowledged until the step is complete and
/// replicated. Its primary dies meanwhile; the push is retried on the new
/// primary, the other trainer pushes there, and the step takes both pushes,
/// once each: -1 everywhere (the mean of two ones), step 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_waiting_in_its_step_survives_its_primary() {
    let len = 8;
    let env = Arc::new(Env::new(1, 2, 3, len, Mode::Sync).await);
    let mut pservers = vec![env.pserver().await, env.pserver().await, env.pserver().await];
    env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    env.wait_status("OK").await;
    let mut grads = ParamBuf::zeros(&specs(len));
    grads.fill(1.0);
    let mut params = ParamBuf::zeros(&specs(len));
    // Registered as the job's trainers are, so the new primary keeps them
    // as members of its barrier.
    let lease = env.discovery.grant_lease(Duration::from_secs(60)).await.unwrap();
    for t in ["a", "b"] {
        env.discovery.put(&format!("{}{t}", keys().members), Vec::new(), Some(lease)).await.unwrap();
    }
    let (mut a, mut b) = (env.client("a"), env.client("b"));
    for t in [&mut a, &mut b] {
        t.join().await.unwrap();
        t.pull(&mut params).await.unwrap();
    }
    let waiting = {
        let grads = grads.clone();
        tokio::spawn(async move {
            let result = a.push(&grads, 1.0).await;
            (a, result)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "acknowledged before its step was complete");

    let map = env.cluster.map().await.unwrap();
    let victim = map.primary(0).unwrap().to_string();
    let at = pservers.iter().position(|p| p.name() == victim).unwrap();
    env.kill(pservers.remove(at)).await;
    let map = env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    assert_ne!(map.primary(0), Some(victim.as_str()));

    assert_eq!(b.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
    let (_a, pushed) = waiting.await.unwrap();
    assert_eq!(pushed.unwrap(), PushResult::Accepted);
    b.pull(&mut params).await.unwrap();
    assert!(params.as_slice().iter().all(|&x| x == -1.0), "{:?}", params.as_slice());
    let primary = pservers.iter().find(|p| Some(p.name()) == map.primary(0)).unwrap();
    assert_eq!(primary.step(0), Some(1));
    assert_replicas_agree(&map, &pservers.iter().collect::<Vec<_>>(), &env.placement());
}

/// Sync: a fresh primary's members, and trainers that join it, are not
/// taken out of its barrier by a look at the registrations read before
/// they joined. Here the trainers never register (a client used without
/// the trainer role, as `tests/sync_equivalence.rs` does), and the
/// primary's look at the registrations, if it made one, would answer only
/// after both joined: the step still waits for both pushes, and takes
/// them once each (-1 everywhere, step 1). Before the fix, a new primary
/// looked at the registrations whatever its members and took out every
/// member not listed: a's push completed the step alone, and b's came
/// back stale (one step apart, the two waited for each other until their
/// calls gave up, as CI saw once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_primary_keeps_the_trainers_that_joined_it() {
    let len = 8;
    let held = Arc::new(common::HeldListings::new(Arc::new(MemDiscovery::new()), &keys().members));
    // The pserver's first listing (the one its departure watch starts
    // from, before it registers) is answered; any look at promotion is held.
    held.arm_after(1);
    let env = Env::over(held.clone(), 1, 1, 1, len, Mode::Sync, false).await;
    let pserver = env.pserver().await;
    env.cluster.wait_serving(&[&pserver]).await;
    let (mut a, mut b) = (env.client("a"), env.client("b"));
    let mut params = ParamBuf::zeros(&specs(len));
    for t in [&mut a, &mut b] {
        t.join().await.unwrap();
        t.pull(&mut params).await.unwrap();
    }
    held.release();
    // Whatever look was held has been answered, and acted on.
    held.wait_answered().await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    one_step_waits_for_both(a, b, len).await;
    assert_eq!(pserver.step(0), Some(1));
}

/// Sync: a promoted follower takes out of its barrier the members that
/// are not registered (they left while it was not primary), and only
/// those. Its look at the registrations is read before trainer c
/// registers and joins it, and answered after: c stays in the barrier
/// (its push is taken in the same step as a's: -1 everywhere, step 1),
/// and d, a member replicated to the follower whose key is gone (it never
/// registered), leaves (else the step would wait for d's push, which
/// never comes). Before the fix every member not in the listing left, c
/// included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_primary_keeps_a_trainer_that_joined_after_its_look() {
    let len = 8;
    let held = Arc::new(common::HeldListings::new(Arc::new(MemDiscovery::new()), &keys().members));
    let env = Env::over(held.clone(), 1, 2, 2, len, Mode::Sync, false).await;
    let mut pservers = vec![env.pserver().await, env.pserver().await];
    env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    env.wait_status("OK").await;
    let lease = env.discovery.grant_lease(Duration::from_secs(60)).await.unwrap();
    env.discovery.put(&format!("{}a", keys().members), Vec::new(), Some(lease)).await.unwrap();
    let mut params = ParamBuf::zeros(&specs(len));
    let (mut a, mut c, mut d) = (env.client("a"), env.client("c"), env.client("d"));
    for t in [&mut a, &mut d] {
        t.join().await.unwrap();
        t.pull(&mut params).await.unwrap();
    }
    // The joins reached the follower before the primary goes.
    tokio::time::sleep(Duration::from_millis(300)).await;

    held.arm();
    let victim = env.cluster.map().await.unwrap().primary(0).unwrap().to_string();
    let at = pservers.iter().position(|p| p.name() == victim).unwrap();
    env.kill(pservers.remove(at)).await;
    env.cluster.wait_primary(&pservers.iter().collect::<Vec<_>>(), 0, &victim).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while held.held() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the new primary never looked at the registrations");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // c registers and joins the new primary.
    env.discovery.put(&format!("{}c", keys().members), Vec::new(), Some(lease)).await.unwrap();
    c.join().await.unwrap();
    c.pull(&mut params).await.unwrap();
    held.release();
    held.wait_answered().await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    a.pull(&mut params).await.unwrap();
    one_step_waits_for_both(a, c, len).await;
    assert_eq!(pservers[0].step(0), Some(1));
}

/// Sync, from zeros and a learning rate of 1: `first`'s push of ones waits
/// for `second`'s (the barrier counts both), and the step both complete
/// leaves -1 everywhere.
async fn one_step_waits_for_both(mut first: PserverClient, mut second: PserverClient, len: usize) {
    let mut grads = ParamBuf::zeros(&specs(len));
    grads.fill(1.0);
    let waiting = {
        let grads = grads.clone();
        tokio::spawn(async move { first.push(&grads, 1.0).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the first push completed the step without the second's");
    assert_eq!(second.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
    assert_eq!(waiting.await.unwrap().unwrap(), PushResult::Accepted);
    let mut params = ParamBuf::zeros(&specs(len));
    second.pull(&mut params).await.unwrap();
    assert!(params.as_slice().iter().all(|&x| x == -1.0), "{:?}", params.as_slice());
}

/// A pserver joins a running job: with rebalancing on, shards move to it
/// (a replica added there catches up, the primary switches if it must, the
/// old replica goes) until every pserver holds its share, while trainers
/// push ones without pause. Every acknowledged push is applied exactly once
/// (async), or every step once (sync); only the newcomer's share moved.
async fn a_pserver_joins_and_gets_its_share(mode: Mode, replicas: u32, pservers: u32) {
    let (shards, len) = (6, 24);
    let env = Arc::new(Env::with(shards, replicas, pservers, len, mode, true).await);
    let mut running = Vec::new();
    for _ in 0..pservers {
        running.push(env.pserver().await);
    }
    let before = env.cluster.wait_serving(&running.iter().collect::<Vec<_>>()).await;
    let pushers = Pushers::start(&env).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    set_pservers(&*env.discovery, &keys(), pservers + 1, ScaleOptions::default()).await.unwrap();
    let newcomer = env.pserver().await;
    let name = newcomer.name().to_string();
    running.push(newcomer);
    // Balanced: every pserver holds S·R/P replicas (±1), no move under way.
    let share = (shards * replicas) as usize / running.len();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let map = loop {
        let map = env.cluster.wait_serving(&running.iter().collect::<Vec<_>>()).await;
        let settled = (0..shards).all(|s| map.replica_set(s).len() == replicas as usize);
        if settled && map.shards_of(&name).len() >= share {
            break map;
        }
        assert!(tokio::time::Instant::now() < deadline, "never balanced:\n{map}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let moved: usize = (0..shards)
        .map(|s| map.replica_set(s).iter().filter(|p| !before.replica_set(s).contains(p)).count())
        .sum();
    assert_eq!(moved, map.shards_of(&name).len(), "only the newcomer's share moved:\n{before}\n{map}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    pushers.stop_and_check(&env, &running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_one_replica_a_pserver_joins_and_gets_its_share() {
    a_pserver_joins_and_gets_its_share(Mode::Async, 1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_two_replicas_a_pserver_joins_and_gets_its_share() {
    a_pserver_joins_and_gets_its_share(Mode::Async, 2, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_one_replica_a_pserver_joins_and_gets_its_share() {
    a_pserver_joins_and_gets_its_share(Mode::Sync, 1, 2).await;
}

/// Wait (up to 30 s) until the map keeps exactly `kept`, each shard has
/// `min(R, kept)` replicas, each pserver holds its share (±1) and all
/// serve their roles. The map then.
async fn wait_balanced(env: &Env, kept: &[&Pserver], replicas: u32) -> ShardMap {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let map = env.cluster.wait_serving(kept).await;
        let per_shard = (replicas as usize).min(kept.len());
        let loads: Vec<usize> = kept.iter().map(|p| map.shards_of(p.name()).len()).collect();
        let (low, high) = (loads.iter().min().copied(), loads.iter().max().copied());
        let settled = (0..map.shard_count()).all(|s| map.replica_set(s).len() == per_shard)
            && map.pservers().len() == kept.len()
            && high <= low.map(|l| l + 1);
        if settled {
            return map;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never balanced over {} pservers:\n{map}",
            kept.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait (up to 30 s) until `ps` was released.
async fn wait_released(ps: &Pserver) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !ps.released() {
        assert!(tokio::time::Instant::now() < deadline, "{} was never released", ps.name());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ps.replicas().is_empty(), "{} was released holding {:?}", ps.name(), ps.replicas());
}

/// A job scales 2 -> 3 -> 1 pservers while trainers push without pause:
/// the scale-out moves no more than a third of the state plus one shard,
/// all to the newcomer; the scale-in drains two pservers and releases them;
/// every acknowledged push is applied exactly once (async) or every step
/// once (sync), on every replica. Bad scale requests change nothing. A
/// pserver that registers beyond the wanted count stands by.
async fn scale_out_then_in(mode: Mode, replicas: u32) {
    let (shards, len) = (8u32, 256usize);
    let env = Arc::new(Env::with(shards, replicas, 2, len, mode, true).await);
    let mut running = vec![env.pserver().await, env.pserver().await];
    wait_balanced(&env, &running.iter().collect::<Vec<_>>(), replicas).await;
    let pushers = Pushers::start(&env).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let ps_keys = keys();
    let scale = |count| set_pservers(&*env.discovery, &ps_keys, count, ScaleOptions::default());
    for (count, why) in [(0, "at least one pserver, not 0"), (9, "9 pservers for 8 shards")] {
        let err = scale(count).await.unwrap_err();
        assert!(matches!(err, ServiceError::Scale(_)) && err.to_string().contains(why), "{err}");
    }
    let scaled = scale(3).await.unwrap();
    assert_eq!((scaled.from, scaled.to), (2, 3));
    // Refused while the scale-out is under way (its pserver not there yet).
    let err = scale(2).await.unwrap_err().to_string();
    assert!(err.contains("a move is in flight") && err.contains("wants 3 pservers and 2 hold"), "{err}");

    // Out: the newcomer takes its share, and only that moves.
    let before: u64 = running.iter().map(Pserver::catch_up_bytes).sum();
    running.push(env.pserver().await);
    let map = wait_balanced(&env, &running.iter().collect::<Vec<_>>(), replicas).await;
    let moved: u64 = running.iter().map(Pserver::catch_up_bytes).sum::<u64>() - before;
    let replica_bytes = |s: u32| env.placement().blocks_on(s).map(|b| b.len as u64 * 4).sum::<u64>();
    let state: u64 = (0..shards).map(replica_bytes).sum::<u64>() * replicas as u64;
    let largest = (0..shards).map(replica_bytes).max().unwrap();
    assert_eq!(moved, running[2].catch_up_bytes(), "only the newcomer received shards");
    assert!(
        moved > 0 && moved <= state / 3 + largest,
        "moved {moved} bytes of {state} (one shard: {largest})"
    );
    eprintln!("scale-out to 3 moved {moved} of {state} bytes\n{map}");

    // In: two are drained and released; the job goes on with one.
    scale(1).await.unwrap();
    let kept = map.wanted(&running.iter().map(|p| p.name().to_string()).collect::<Vec<_>>(), 1);
    let (keep, drained): (Vec<Pserver>, Vec<Pserver>) =
        running.into_iter().partition(|p| kept.contains(&p.name().to_string()));
    for ps in &drained {
        wait_released(ps).await;
    }
    for ps in drained {
        ps.shutdown().await.unwrap();
    }
    wait_balanced(&env, &keep.iter().collect::<Vec<_>>(), replicas).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // Released pservers that left are forgotten.
    while !env.cluster.map().await.unwrap().released().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "released pservers never forgotten");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // One more, beyond the wanted count: it stands by, given nothing, and
    // the status says so.
    let extra = env.pserver().await;
    let status = loop {
        let status = env.wait_status(if replicas > 1 { "UNHEALTHY" } else { "OK" }).await;
        if status["standby"].as_array().is_some_and(|s| s.iter().any(|p| p == extra.name())) {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(extra.replicas().is_empty() && !extra.released(), "{status}");
    let map = env.cluster.map().await.unwrap();
    assert!(map.shards_of(extra.name()).is_empty(), "{map}");
    extra.shutdown().await.unwrap();

    tokio::time::sleep(Duration::from_millis(100)).await;
    pushers.stop_and_check(&env, &keep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_one_replica_scales_out_and_in_without_losing_a_push() {
    scale_out_then_in(Mode::Async, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_two_replicas_scale_out_and_in_without_losing_a_push() {
    scale_out_then_in(Mode::Async, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_two_replicas_scale_out_and_in_without_losing_a_step() {
    scale_out_then_in(Mode::Sync, 2).await;
}

/// A replication call to `ps`, answered.
async fn replicate(
    env: &Env,
    ps: &Pserver,
    request: &PsRequest,
    payload: Vec<f32>,
) -> Result<PsReply, oar_transport::Error> {
    let conn = env.transport.connect(ps.addr()).await.unwrap();
    let payload = oar_transport::f32s_to_bytes(&payload);
    call(conn.as_ref(), PSERVER_METHOD, request, payload, Duration::from_secs(2))
        .await
        .map(|(r, _): (PsReply, Bytes)| r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_replication_calls_are_refused_by_name_and_change_nothing() {
    let env = Env::new(2, 2, 2, 8, Mode::Async).await;
    let (a, b) = (env.pserver().await, env.pserver().await);
    let map = env.cluster.wait_serving(&[&a, &b]).await;
    let mut trainer = env.client("t1");
    let mut grads = ParamBuf::zeros(&specs(8));
    grads.fill(1.0);
    trainer.push(&grads, 1.0).await.unwrap();
    // The follower of shard 0, and what it holds.
    let follower = if map.primary(0) == Some(a.name()) { &b } else { &a };
    let block = env.placement().blocks_on(0).next().unwrap().clone();
    let state = |ps: &Pserver| (ps.replicas(), ps.block(block.id));
    let before = state(follower);
    let applied = before.0.iter().find(|r| r.shard == 0).unwrap().applied;
    let push = |seq: u64, blocks: Vec<BlockId>| UpdateMeta {
        seq,
        kind: UpdateKind::Push {
            trainer: "t9".into(),
            seq: 1,
            step: 0,
            weight: 1.0,
            blocks,
            rows: Vec::new(),
            origin: None,
        },
    };
    let epoch = map.epoch(0);
    let version = map.version();
    let cases = [
        // A shard that does not exist.
        (
            PsRequest::Replicate {
                shard: 7,
                map_version: version,
                epoch,
                updates: vec![push(applied + 1, vec![block.id])],
            },
            "shard 7 does not exist",
        ),
        // An older map: a deposed primary.
        (
            PsRequest::Replicate {
                shard: 0,
                map_version: version - 1,
                epoch,
                updates: vec![push(applied + 1, vec![block.id])],
            },
            "older than",
        ),
        // A block of another shard.
        (
            PsRequest::Replicate {
                shard: 0,
                map_version: version,
                epoch,
                updates: vec![push(applied + 1, vec![BlockId::new(0, 1)])],
            },
            "not of shard 0",
        ),
        // Another primary's epoch.
        (
            PsRequest::Replicate {
                shard: 0,
                map_version: version,
                epoch: epoch + 5,
                updates: vec![push(applied + 1, vec![block.id])],
            },
            "epoch",
        ),
        // A gap in the sequence (last: the follower then syncs again).
        (
            PsRequest::Replicate {
                shard: 0,
                map_version: version,
                epoch,
                updates: vec![push(applied + 2, vec![block.id])],
            },
            "gap",
        ),
    ];
    for (request, words) in cases {
        // A refusal may have sent the follower to sync again: let it finish.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !follower.replicas().iter().any(|r| r.shard == 0 && r.role == ReplicaRole::Follower) {
            assert!(tokio::time::Instant::now() < deadline, "the follower never synced again");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let result = replicate(&env, follower, &request, vec![1.0; block.len]).await;
        match result {
            Err(oar_transport::Error::Remote { error, .. }) => {
                assert!(error.message.contains(words), "{:?} should say {words:?}", error.message);
                assert_ne!(error.kind, RemoteErrorKind::Internal);
            }
            other => panic!("expected a refusal saying {words:?}, got {other:?}"),
        }
    }
    // Nothing was applied: the follower holds what it held (it may resync
    // after the gap, to the same state), and still agrees with its primary.
    let map = env.cluster.wait_serving(&[&a, &b]).await;
    assert_eq!(state(follower).1, before.1);
    trainer.push(&grads, 1.0).await.unwrap();
    assert_replicas_agree(&map, &[&a, &b], &env.placement());
}

/// Sync: a push computed at the parameters of a primary whose updates this
/// one does not continue (its history began later: with one replica, its
/// predecessor died and it started afresh, as it would from an older
/// checkpoint, where the same step number may hold other parameters) is
/// stale, whatever its step; a retry of a push taken already is still a
/// duplicate, and a push of the primary's own epoch is taken. (A push of
/// the old primary's epoch on a promoted follower is taken too:
/// `a_sync_push_waiting_in_its_step_survives_its_primary`; and on a moved
/// shard: `tests/sync_equivalence.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_of_an_epoch_the_primary_does_not_continue_is_stale() {
    let len = 8;
    let env = Env::new(1, 1, 2, len, Mode::Sync).await;
    let mut pservers = vec![env.pserver().await, env.pserver().await];
    let map = env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    let old = map.epoch(0);
    let victim = map.primary(0).unwrap().to_string();
    let at = pservers.iter().position(|p| p.name() == victim).unwrap();
    env.kill(pservers.remove(at)).await;
    let map = env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    let epoch = map.epoch(0);
    assert!(epoch > old && old > 0, "{old} then {epoch}");
    let ps = &pservers[0];
    let placement = env.placement();
    let push = |seq: u64, step: u64, epoch: u64| PsRequest::Push {
        shard: 0,
        fingerprint: placement.fingerprint(),
        blocks: oar_pserver::protocol::BlockSpan::new(0, placement.blocks_on(0).count() as u32),
        trainer: "t".into(),
        seq,
        step,
        weight: 1.0,
        rows: Vec::new(),
        origin: None,
        epoch,
    };
    let ones = vec![1.0; len];
    let stale = replicate(&env, ps, &push(0, 0, old), ones.clone()).await.unwrap();
    assert!(matches!(stale, PsReply::Stale { current: 0 }), "{stale:?}");
    assert_eq!(ps.step(0), Some(0), "a stale push changes nothing");
    assert_eq!(ps.block(placement.blocks_on(0).next().unwrap().id).unwrap()[0], 0.0);

    // Its own epoch: taken, and (the only member) completes the step.
    let taken = replicate(&env, ps, &push(0, 0, epoch), ones.clone()).await.unwrap();
    assert!(matches!(taken, PsReply::Pushed(oar_pserver::PushOutcome::Applied { step: 1 })), "{taken:?}");
    // Its retry, whatever epoch it names, is the same push: a duplicate.
    let again = replicate(&env, ps, &push(0, 0, old), ones.clone()).await.unwrap();
    assert!(matches!(again, PsReply::Pushed(oar_pserver::PushOutcome::Duplicate)), "{again:?}");
    // Epoch 0 (not known) is not checked.
    let taken = replicate(&env, ps, &push(1, 1, 0), ones).await.unwrap();
    assert!(matches!(taken, PsReply::Pushed(oar_pserver::PushOutcome::Applied { step: 2 })), "{taken:?}");
    assert_eq!(ps.block(placement.blocks_on(0).next().unwrap().id).unwrap()[0], -2.0);
}

/// Sync, a push in parts: a part is answered once its blocks are updated,
/// before the step is complete, and is not replicated until the step is.
/// When the primary dies after answering one part of `a`'s push and before
/// the step completed, `a` sends every part again to the new primary (it
/// sees the shard's new epoch): without that, the new primary would wait
/// for a part it never gets, and `b`'s push with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_whose_primary_dies_between_its_parts_is_sent_again_whole() {
    let len = 16; // 4 blocks of 4
    let env = Arc::new(Env::new(1, 2, 3, len, Mode::Sync).await);
    let mut pservers = vec![env.pserver().await, env.pserver().await, env.pserver().await];
    env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    env.wait_status("OK").await;
    let lease = env.discovery.grant_lease(Duration::from_secs(60)).await.unwrap();
    for t in ["a", "b"] {
        env.discovery.put(&format!("{}{t}", keys().members), Vec::new(), Some(lease)).await.unwrap();
    }
    let mut grads = ParamBuf::zeros(&specs(len));
    grads.fill(1.0);
    let (mut a, mut b) = (env.client("a"), env.client("b"));
    for t in [&mut a, &mut b] {
        t.join().await.unwrap();
        let mut params = ParamBuf::zeros(&specs(len));
        t.pull(&mut params).await.unwrap();
    }
    // Two parts of two blocks each.
    a.set_max_part_bytes(2 * 4 * 4);
    let pushing = {
        let grads = grads.clone();
        tokio::spawn(async move {
            let mut params = ParamBuf::zeros(&specs(len));
            let result = a.push_pull(&grads, 1.0, &mut params).await;
            (a, result, params)
        })
    };
    // `b`'s first part, raw: blocks 0 and 1 are then updated (with `a`'s
    // first part), blocks 2 and 3 wait for `b`.
    let map = env.cluster.map().await.unwrap();
    let victim = map.primary(0).unwrap().to_string();
    let at = pservers.iter().position(|p| p.name() == victim).unwrap();
    let placement = env.placement();
    let first_part = PsRequest::Push {
        shard: 0,
        fingerprint: placement.fingerprint(),
        blocks: oar_pserver::protocol::BlockSpan::new(0, 2),
        trainer: "b".into(),
        seq: 0,
        step: 0,
        weight: 1.0,
        rows: Vec::new(),
        origin: None,
        epoch: map.epoch(0),
    };
    let answered = tokio::time::timeout(
        Duration::from_secs(10),
        replicate(&env, &pservers[at], &first_part, vec![1.0; 8]),
    )
    .await
    .expect("a part is answered once its blocks are updated, before the step completes")
    .unwrap();
    assert!(matches!(answered, PsReply::Pushed(oar_pserver::PushOutcome::Buffered { .. })), "{answered:?}");
    assert_eq!(pservers[at].step(0), Some(0), "the step waits for blocks 2 and 3");
    assert!(!pushing.is_finished(), "a's second part waits for b's");

    env.kill(pservers.remove(at)).await;
    // Only the new primary: a new follower catches up from a snapshot,
    // which waits for the step underway (a's resent push is in it) to
    // complete, and that needs b's push.
    env.cluster.wait_primary(&pservers.iter().collect::<Vec<_>>(), 0, &victim).await;
    // `b` pushes whole to the new primary, which never saw either first part.
    let mut params = ParamBuf::zeros(&specs(len));
    let pushed = tokio::time::timeout(Duration::from_secs(20), b.push_pull(&grads, 1.0, &mut params))
        .await
        .expect("b's push waits for a first part of a's that never comes")
        .unwrap();
    assert_eq!(pushed, PushResult::Accepted);
    let (_a, result, a_params) =
        tokio::time::timeout(Duration::from_secs(20), pushing).await.unwrap().unwrap();
    assert_eq!(result.unwrap(), PushResult::Accepted);
    for got in [&params, &a_params] {
        assert!(got.as_slice().iter().all(|&x| x == -1.0), "{:?}", got.as_slice());
    }
    let map = env.cluster.wait_serving(&pservers.iter().collect::<Vec<_>>()).await;
    assert_ne!(map.primary(0), Some(victim.as_str()));
    let primary = pservers.iter().find(|p| Some(p.name()) == map.primary(0)).unwrap();
    assert_eq!(primary.step(0), Some(1));
    assert_replicas_agree(&map, &pservers.iter().collect::<Vec<_>>(), &env.placement());
}

/// Async, a push in parts half taken when a new follower asks to sync: the
/// snapshot holds the parts that came and says which, so the follower
/// catches up at once and takes the other parts as they are forwarded.
/// (The snapshot used to wait until the push was whole; but a trainer
/// sends a push's later parts only once its first ones are answered, and
/// an answer waits for every follower, the one catching up too: with three
/// parts or more per shard, the shard stalled until the trainer gave up.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_follower_catches_up_while_a_push_in_parts_is_half_taken() {
    let len = 16; // 4 blocks of 4
    let env = Env::new(1, 2, 2, len, Mode::Async).await;
    let (a, b) = (env.pserver().await, env.pserver().await);
    let map = env.cluster.wait_serving(&[&a, &b]).await;
    env.wait_status("OK").await;
    let (primary, follower) = if map.primary(0) == Some(a.name()) { (a, b) } else { (b, a) };
    let fingerprint = env.placement().fingerprint();
    let epoch = map.epoch(0);
    let half = |first: u32| PsRequest::Push {
        shard: 0,
        fingerprint,
        blocks: oar_pserver::protocol::BlockSpan::new(first, first + 2),
        trainer: "t".into(),
        seq: 1,
        step: 0,
        weight: 1.0,
        rows: Vec::new(),
        origin: None,
        epoch,
    };
    let applied =
        |reply: &PsReply| matches!(reply, PsReply::Pushed(oar_pserver::PushOutcome::Applied { .. }));
    let first = replicate(&env, &primary, &half(0), vec![1.0; 8]).await.unwrap();
    assert!(applied(&first), "{first:?}");

    // The follower dies; a new pserver takes its place while the push is
    // half taken.
    env.kill(follower).await;
    let newcomer = env.pserver().await;
    let map = env.cluster.wait_serving(&[&primary, &newcomer]).await;
    env.wait_status("OK").await;
    assert_eq!(newcomer.step(0), Some(0), "the newcomer holds the half push, not a whole one");

    // The second half completes the push on both.
    let second = replicate(&env, &primary, &half(2), vec![1.0; 8]).await.unwrap();
    assert!(applied(&second), "{second:?}");
    let whole = |ps: &Pserver| ps.step(0) == Some(1);
    for _ in 0..200 {
        if whole(&newcomer) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(primary.step(0), Some(1));
    assert_eq!(newcomer.step(0), Some(1), "the forwarded second half completes the push on the newcomer");
    assert_replicas_agree(&map, &[&primary, &newcomer], &env.placement());
    for ps in [&primary, &newcomer] {
        for block in env.placement().blocks_on(0) {
            assert_eq!(ps.block(block.id).unwrap(), vec![-1.0; block.len], "{}", ps.name());
        }
    }
}

/// A shard map that cannot be decoded (a hand edit, a newer format) is not
/// written over: a fresh first map would name primaries of its own while
/// the pservers serving the last good map keep it. The status names the
/// key; once the key is deleted, a first map follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_shard_map_is_not_written_over() {
    let env = Env::new(2, 1, 2, 16, Mode::Async).await;
    env.discovery.put(&keys().shard_map, b"not a shard map".to_vec(), None).await.unwrap();
    let (a, b) = (env.pserver().await, env.pserver().await);
    let status = env.wait_status_because("UNHEALTHY", "unreadable").await;
    let reason = status["reason"].as_str().unwrap_or_default();
    assert!(reason.contains(&keys().shard_map), "the status names the key: {status}");
    // Long enough for several coordinator rounds (one a second at least).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let kv = env.discovery.get(&keys().shard_map).await.unwrap().expect("the key is still there");
    assert_eq!(kv.value, b"not a shard map".to_vec(), "nothing was written over it");
    assert!(a.replicas().is_empty() && b.replicas().is_empty(), "no pserver serves a shard");
    env.discovery.delete(&keys().shard_map).await.unwrap();
    let map = env.cluster.wait_serving(&[&a, &b]).await;
    assert_eq!(map.version(), 1, "a first map once the key is gone: {map}");
}

/// One shard whose checkpoints will not load stops neither the pserver it
/// is given to nor the others (before, each pserver given it stopped in
/// turn, and took its healthy shards down with it): the shard waits, the
/// status says why, and once the directory is mended its restore is tried
/// again and it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_checkpoints_do_not_load_waits_and_harms_no_other() {
    let env = Env::new(2, 1, 2, 16, Mode::Async).await;
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("shard-1").join("ckpt-00000000000000000005.oarckpt");
    std::fs::create_dir_all(bad.parent().unwrap()).unwrap();
    std::fs::write(&bad, vec![7u8; 200]).unwrap();
    let (a, b) = (env.pserver_checkpointing(dir.path()).await, env.pserver_checkpointing(dir.path()).await);
    let status = env.wait_status_because("UNHEALTHY", "cannot restore shard 1").await;
    assert!(status["reason"].as_str().unwrap_or_default().contains("no valid checkpoint"), "{status}");
    let map = env.cluster.map().await.expect("a map");
    // Longer than a retry: the shard's pserver tried again and still stands.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!((a.stopped(), b.stopped()), (None, None), "no pserver stopped");
    assert_eq!(env.cluster.map().await.expect("a map").primary(1), map.primary(1), "the shard stayed put");
    let serving_0 =
        [&a, &b].iter().any(|p| p.replicas().iter().any(|r| r.shard == 0 && r.role == ReplicaRole::Primary));
    assert!(serving_0, "the healthy shard is served");
    // Mended: the bad file goes, and the next try serves the shard.
    std::fs::remove_file(&bad).unwrap();
    env.cluster.wait_serving(&[&a, &b]).await;
    env.wait_status("OK").await;
}

/// Makes shard `shard`'s newest checkpoint under `dir` a FIFO no one
/// writes: its open blocks, as a read from a volume that does not answer.
/// Dropped, the open returns (a writer comes and goes: the file is empty,
/// so refused) and the FIFO goes; however a test ends, so that no thread is
/// left blocked to keep the runtime from shutting down.
struct HungCheckpoint(std::path::PathBuf);

impl HungCheckpoint {
    fn new(dir: &std::path::Path, shard: u32) -> HungCheckpoint {
        use std::os::unix::ffi::OsStrExt;
        let fifo = dir.join(format!("shard-{shard}")).join("ckpt-00000000000000000005.oarckpt");
        std::fs::create_dir_all(fifo.parent().unwrap()).unwrap();
        let path = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only reads it.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0, "mkfifo");
        HungCheckpoint(fifo)
    }
}

impl Drop for HungCheckpoint {
    fn drop(&mut self) {
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::File::options().write(true).custom_flags(libc::O_NONBLOCK).open(&self.0);
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A restore that hangs (its checkpoint on a volume that does not answer)
/// holds up neither the maps that come meanwhile nor the pserver's other
/// shards: when the other pserver dies, the one stuck restoring shard 1
/// adopts the new map and serves shard 0 too. (Restores were awaited inside
/// the reconciler, one map at a time: the second map waited for the first
/// restore for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_that_hangs_holds_up_no_later_map() {
    let env = Env::new(2, 1, 2, 16, Mode::Async).await;
    let dir = tempfile::tempdir().unwrap();
    let hung = HungCheckpoint::new(dir.path(), 1);
    let (a, b) = (env.pserver_checkpointing(dir.path()).await, env.pserver_checkpointing(dir.path()).await);
    let first = env.cluster.wait_primary(&[&a, &b], 0, "").await;
    let stuck_name = first.primary(1).expect("shard 1 has a primary").to_string();
    let (stuck, other) = if a.name() == stuck_name { (a, b) } else { (b, a) };
    let other_name = other.name().to_string();
    env.kill(other).await;
    let map = env.cluster.wait_primary(&[&stuck], 0, &other_name).await;
    assert!(map.version() > first.version());
    // With the FIFO gone, the next try starts the shard afresh.
    drop(hung);
    env.cluster.wait_primary(&[&stuck], 1, "").await;
}

/// A map of the same epoch that changes a shard's followers while its
/// primary restores it reaches the restore: it ends serving the followers
/// the map names then, not those it started with (a dead one, whose
/// acknowledgements never come, and no new one, whose catch-up is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_changed_while_a_restore_runs_are_the_ones_it_serves() {
    let env = Env::new(1, 2, 2, 16, Mode::Async).await;
    let dir = tempfile::tempdir().unwrap();
    let hung = HungCheckpoint::new(dir.path(), 0);
    let (a, b) = (env.pserver_checkpointing(dir.path()).await, env.pserver_checkpointing(dir.path()).await);
    let first = loop {
        if let Some(map) = env.cluster.map().await {
            break map;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let primary = first.primary(0).expect("a primary").to_string();
    let (primary, follower) = if a.name() == primary { (a, b) } else { (b, a) };
    let gone = follower.name().to_string();
    let newcomer = env.pserver_checkpointing(dir.path()).await;
    env.kill(follower).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let map = env.cluster.map().await.expect("a map");
        let set = map.replica_set(0);
        if set.iter().any(|n| n == newcomer.name()) && !set.contains(&gone) {
            assert_eq!(map.epoch(0), first.epoch(0), "the same epoch: the primary did not change");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no map with the newcomer as follower: {map}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(hung);
    env.cluster.wait_serving(&[&primary, &newcomer]).await;
}
