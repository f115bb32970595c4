//! etcd that stops answering for a while (SIGSTOP, shorter than every
//! lease), or restarts: the roles' requests to it time out and their
//! watches break, and each role carries on once it answers again instead
//! of giving up for the rest of the job.
#![cfg(feature = "etcd")]

use oar::discovery::{Discovery, EtcdDiscovery, EtcdOptions, EtcdServer};
use oar::job::keys::JobKeys;
use oar::pserver::{
    protocol::ReplicaRole, Coordinator, CoordinatorOptions, Init, Mode, OptimizerConfig, ParamBuf, ParamSpec,
    Placement, Pserver, PserverClient, PserverClientOptions, PserverKeys, PserverOptions, ShardMap,
};
use oar::transport::{DevCa, QuicTransport, RetryPolicy, Transport};
use std::{sync::Arc, time::Duration};

/// The shard map, once every shard's replicas serve their roles under it
/// and `holds(map)`; waits up to 30 s.
async fn wait_map(
    discovery: &dyn Discovery,
    key: &str,
    pservers: &[&Pserver],
    holds: impl Fn(&ShardMap) -> bool,
) -> ShardMap {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut last = None;
    loop {
        if let Ok(Some(kv)) = discovery.get(key).await {
            let map = ShardMap::decode(&kv.value).expect("a shard map");
            last = Some(map.to_string());
            let serving = (0..map.shard_count()).all(|s| {
                map.replica_set(s).iter().enumerate().all(|(r, name)| {
                    let want = if r == 0 { ReplicaRole::Primary } else { ReplicaRole::Follower };
                    pservers.iter().any(|p| {
                        p.name() == name
                            && p.map_version() == map.version()
                            && p.replicas().iter().any(|st| st.shard == s && st.role == want)
                    })
                })
            });
            if serving && holds(&map) {
                return map;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            let states: Vec<_> =
                pservers.iter().map(|p| (p.name().to_string(), p.map_version(), p.replicas())).collect();
            panic!("no such shard map in time; the last:\n{}\n{states:#?}", last.unwrap_or_default());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A job's etcd (its requests time out after 300 ms), QUIC transport,
/// pserver keys and shard coordinator (2 shards, 1 replica, 1 pserver).
struct Setup {
    etcd: EtcdServer,
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    keys: PserverKeys,
    coordinator: Coordinator,
}

const SHARDS: u32 = 2;

fn specs() -> Vec<ParamSpec> {
    vec![ParamSpec::new("w", vec![64], Init::Zeros)]
}

impl Setup {
    async fn start(job: &str) -> Setup {
        let etcd = EtcdServer::start().expect("etcd starts (scripts/test.sh installs etcd-server)");
        let options = EtcdOptions::default().with_request_timeout(Duration::from_millis(300));
        let discovery: Arc<dyn Discovery> =
            Arc::new(EtcdDiscovery::connect_with(&[etcd.endpoint()], options).await.unwrap());
        let ca = DevCa::new().unwrap();
        let transport: Arc<dyn Transport> =
            Arc::new(QuicTransport::new(ca.tls_config(job).unwrap()).unwrap());
        let keys = JobKeys::new(job).unwrap().pserver();
        let lease = discovery.grant_lease(Duration::from_secs(120)).await.unwrap();
        let lock = format!("/{job}/coordinator");
        let fence = discovery.lock(&lock, b"test".to_vec(), lease, Duration::from_secs(5)).await.unwrap();
        let options = CoordinatorOptions {
            keys: keys.clone(),
            shards: SHARDS,
            replicas: 1,
            pservers: 1,
            ..Default::default()
        };
        let coordinator =
            Coordinator::start(discovery.clone(), transport.clone(), fence, options).await.unwrap();
        Setup { etcd, discovery, transport, keys, coordinator }
    }

    async fn pserver(&self, name: &str, mode: Mode) -> Pserver {
        let options = PserverOptions {
            keys: self.keys.clone(),
            name: name.into(),
            specs: specs(),
            shards: SHARDS,
            block_size: 16,
            mode,
            optimizer: OptimizerConfig::Sgd { lr: 0.1 },
            lease_ttl: Duration::from_secs(30),
            ..Default::default()
        };
        Pserver::start(self.discovery.clone(), self.transport.clone(), "127.0.0.1:0", options).await.unwrap()
    }

    fn client(&self, trainer: &str) -> PserverClient {
        let placement = Arc::new(Placement::new(&specs(), SHARDS, 16).unwrap());
        let options = PserverClientOptions {
            call_timeout: Duration::from_secs(10),
            retry: RetryPolicy { give_up_after: Duration::from_secs(30), ..RetryPolicy::default() },
            ..PserverClientOptions::new(self.keys.clone(), trainer)
        };
        PserverClient::new(self.discovery.clone(), self.transport.clone(), placement, options)
    }

    /// Whether the coordinator is still running.
    async fn coordinating(&mut self) -> bool {
        tokio::time::timeout(Duration::from_millis(10), self.coordinator.stopped()).await.is_err()
    }
}

/// The coordinator's rounds read etcd every second; with etcd frozen for
/// 2 s (each request times out after 300 ms) some fail. It must still be
/// running afterwards, and still do its job: when the job then grows to
/// two pservers, a shard moves to the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_carries_on_after_etcd_stops_answering_for_a_while() {
    let mut job = Setup::start("blips").await;
    let a = job.pserver("a", Mode::Async).await;
    wait_map(&*job.discovery, &job.keys.shard_map, &[&a], |map| map.shards_of(a.name()).len() == 2).await;

    job.etcd.pause().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    job.etcd.resume().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(job.coordinating().await, "the coordinator stopped: {}", job.coordinator.stopped().await);

    let b = job.pserver("b", Mode::Async).await;
    job.discovery.put(&job.keys.desired, b"2".to_vec(), None).await.unwrap();
    wait_map(&*job.discovery, &job.keys.shard_map, &[&a, &b], |map| {
        map.shards_of(a.name()).len() == 1 && map.shards_of(b.name()).len() == 1
    })
    .await;
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// A restarted etcd breaks every watch. The pserver's watch on the
/// trainers must be followed again: a trainer whose lease ends after the
/// restart still leaves the sync barrier, and the other's step completes
/// instead of waiting for a push that never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_gone_after_etcd_restarted_still_leaves_the_sync_barrier() {
    let job = Setup::start("restart").await;
    let ps = job.pserver("a", Mode::Sync).await;
    wait_map(&*job.discovery, &job.keys.shard_map, &[&ps], |map| map.shards_of(ps.name()).len() == 2).await;
    let doomed = job.discovery.grant_lease(Duration::from_secs(60)).await.unwrap();
    job.discovery.put(&format!("{}t2", job.keys.members), b"t2".to_vec(), Some(doomed)).await.unwrap();
    let (mut alive, mut dead) = (job.client("t1"), job.client("t2"));
    alive.join().await.unwrap();
    dead.join().await.unwrap();
    let mut params = ParamBuf::zeros(&specs());
    alive.pull(&mut params).await.unwrap();

    job.etcd.restart().unwrap();
    // t1's push is answered once its step completes; t2's lease ends
    // instead of its push arriving.
    let waiting = tokio::spawn(async move {
        let grads = ParamBuf::zeros(&specs());
        alive.push(&grads, 1.0).await.unwrap();
        alive.pull(&mut params).await.unwrap();
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the step waits for t2");
    assert_eq!(ps.step(0), Some(0));
    job.discovery.revoke_lease(doomed).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the step completes once t2 is gone")
        .unwrap();
    assert_eq!((ps.step(0), ps.step(1)), (Some(1), Some(1)));
    drop(dead);
    ps.shutdown().await.unwrap();
}
