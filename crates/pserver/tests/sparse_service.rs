//! Sparse tables through the service, in one process (in-memory discovery
//! and transport): rows pushed and pulled through the client, replicated
//! to followers, carried to a new pserver by a catch-up from a snapshot
//! (rows in their own parts), and kept exactly when the old replicas die.

mod common;

use common::{keys, Cluster};
use oar_discovery::{Discovery, MemDiscovery};
use oar_pserver::client::TableGrads;
use oar_pserver::sparse::{init_row, TableSpec};
use oar_pserver::{
    CoordinatorOptions, Init, Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement, Pserver, PserverClient,
    PserverClientOptions, PserverOptions,
};
use oar_transport::{MemNetwork, MemTransport, RetryPolicy, Transport};
use std::{sync::Arc, time::Duration};

const SHARDS: u32 = 4;
const DIM: usize = 4;
const SEED: u64 = 7;

fn specs() -> Vec<ParamSpec> {
    vec![ParamSpec::new("bias", vec![1], Init::Zeros)]
}

fn table() -> TableSpec {
    TableSpec::new("emb", DIM, Init::Uniform { low: -0.5, high: 0.5 })
}

struct Env {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    cluster: Cluster,
}

impl Env {
    async fn new(replicas: u32, pservers: u32) -> Env {
        let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
        let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
        let options = CoordinatorOptions { shards: SHARDS, replicas, pservers, ..Default::default() };
        let cluster = Cluster::start_with(discovery.clone(), transport.clone(), options).await;
        Env { discovery, transport, cluster }
    }

    async fn pserver(&self) -> Pserver {
        let options = PserverOptions {
            keys: keys(),
            specs: specs(),
            tables: vec![table()],
            shards: SHARDS,
            block_size: 4,
            mode: Mode::Async,
            seed: SEED,
            optimizer: OptimizerConfig::Sgd { lr: 1.0 },
            lease_ttl: Duration::from_secs(30),
            replication_timeout: Duration::from_secs(2),
            ..Default::default()
        };
        Pserver::start(self.discovery.clone(), self.transport.clone(), "mem:0", options).await.unwrap()
    }

    fn client(&self, trainer: &str) -> PserverClient {
        let placement = Placement::new(&specs(), SHARDS, 4).unwrap().with_tables(vec![table()]).unwrap();
        let options = PserverClientOptions {
            call_timeout: Duration::from_secs(2),
            retry: RetryPolicy { give_up_after: Duration::from_secs(60), ..RetryPolicy::default() },
            ..PserverClientOptions::new(keys(), trainer)
        };
        PserverClient::new(self.discovery.clone(), self.transport.clone(), Arc::new(placement), options)
    }

    async fn kill(&self, ps: Pserver) {
        let lease = self.discovery.get(&keys().pserver(ps.name())).await.unwrap().unwrap().lease.unwrap();
        self.discovery.revoke_lease(lease).await.unwrap();
        drop(ps);
    }
}

fn initial(ids: &[u64]) -> Vec<f32> {
    let mut out = vec![0.0; ids.len() * DIM];
    for (id, row) in ids.iter().zip(out.chunks_exact_mut(DIM)) {
        init_row(&table(), SEED, *id, row);
    }
    out
}

/// Push a gradient of `g` to every row of `ids` (SGD, lr 1: each row goes down by `g`).
async fn push(trainer: &mut PserverClient, ids: &[u64], g: f32) {
    let dense = ParamBuf::zeros(&specs());
    let grads = vec![g; ids.len() * DIM];
    let rows = [TableGrads { table: 0, ids, grads: &grads }];
    trainer.push_rows(&dense, &rows, 1.0).await.unwrap();
}

async fn pull(trainer: &mut PserverClient, ids: &[u64]) -> Vec<f32> {
    let mut out = vec![Vec::new()];
    trainer.pull_rows(&[(0, ids)], &mut out).await.unwrap();
    out.pop().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_survive_their_replicas_dying_after_a_catch_up() {
    let env = Env::new(2, 2).await;
    let (a, b) = (env.pserver().await, env.pserver().await);
    env.cluster.wait_serving(&[&a, &b]).await;
    let mut trainer = env.client("t1");
    // Ids spread over every shard; the first half is pushed three times, the rest once.
    let ids: Vec<u64> = (0..64).map(|i| i * 7919 + 3).collect();
    assert_eq!(pull(&mut trainer, &ids).await, initial(&ids), "rows read as their initial values");
    for _ in 0..3 {
        push(&mut trainer, &ids[..32], 0.25).await;
    }
    push(&mut trainer, &ids[32..], 1.0).await;
    let mut want = initial(&ids);
    for (k, v) in want.iter_mut().enumerate() {
        *v -= if k < 32 * DIM { 0.75 } else { 1.0 };
    }
    assert_eq!(pull(&mut trainer, &ids).await, want);

    // a dies; a newcomer catches up every shard a held from b's snapshots
    // (rows included); then b dies too: the newcomer alone holds every row.
    env.kill(a).await;
    let c = env.pserver().await;
    env.cluster.wait_serving(&[&b, &c]).await;
    env.kill(b).await;
    let d = env.pserver().await;
    env.cluster.wait_serving(&[&c, &d]).await;
    assert_eq!(pull(&mut trainer, &ids).await, want, "no acknowledged row update lost");
    // And the table goes on: one more push lands once.
    push(&mut trainer, &ids, 0.5).await;
    want.iter_mut().for_each(|v| *v -= 0.5);
    assert_eq!(pull(&mut trainer, &ids).await, want);
}
