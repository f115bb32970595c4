//! Sparse tables through the service, in one process (in-memory discovery;
//! the in-memory transport, and QUIC on 127.0.0.1): rows pushed and pulled
//! through the client, replicated to followers, carried to a new pserver by
//! a catch-up from a snapshot (rows in their own parts, over several arena
//! chunks), and kept exactly when the old replicas die; bad rows on the
//! wire refused by name, harming nothing; the rows of a trainer's next
//! batch asked for with its push, in its round trip and read after it.

use crate::common;

use bytes::Bytes;
use common::{keys, Cluster, Counting};
use oar_discovery::{Discovery, MemDiscovery};
use oar_pserver::client::{RowsAhead, TableGrads};
use oar_pserver::protocol::{BatchCall, BlockSpan, PsReply, PsRequest, ShardRows, TableRows, PSERVER_METHOD};
use oar_pserver::sparse::{init_row, row_shard, TableSpec};
use oar_pserver::{
    CoordinatorOptions, Init, Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement, Pserver, PserverClient,
    PserverClientOptions, PserverOptions, PushResult,
};
use oar_transport::{call, MemNetwork, MemTransport, RemoteErrorKind, RetryPolicy, Transport};
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
    /// The same transport: its servers count the calls they answer.
    counting: Arc<Counting>,
    listen: &'static str,
    cluster: Cluster,
}

impl Env {
    async fn new(replicas: u32, pservers: u32) -> Env {
        let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
        Self::on(transport, "mem:0", replicas, pservers).await
    }

    async fn quic(replicas: u32, pservers: u32) -> Env {
        let ca = oar_transport::DevCa::new().unwrap();
        let transport: Arc<dyn Transport> =
            Arc::new(oar_transport::QuicTransport::new(ca.tls_config("sparse-test").unwrap()).unwrap());
        Self::on(transport, "127.0.0.1:0", replicas, pservers).await
    }

    async fn on(transport: Arc<dyn Transport>, listen: &'static str, replicas: u32, pservers: u32) -> Env {
        let counting = Arc::new(Counting::new(transport));
        let transport: Arc<dyn Transport> = counting.clone();
        let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
        let options = CoordinatorOptions { shards: SHARDS, replicas, pservers, ..Default::default() };
        let cluster = Cluster::start_with(discovery.clone(), transport.clone(), options).await;
        Env { discovery, transport, counting, listen, cluster }
    }

    /// Wait until `pservers` serve the map with both replicas of every
    /// shard (a newcomer joins a replica set once it has caught up).
    async fn wait_replicated(&self, pservers: &[&Pserver]) {
        for _ in 0..2000 {
            let map = self.cluster.wait_serving(pservers).await;
            if (0..SHARDS).all(|s| map.replica_set(s).len() == 2) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the shards never had both their replicas again");
    }

    fn placement(&self) -> Placement {
        Placement::new(&specs(), SHARDS, 4).unwrap().with_tables(vec![table()]).unwrap()
    }

    async fn pserver(&self) -> Pserver {
        self.pserver_in(Mode::Async).await
    }

    async fn pserver_in(&self, mode: Mode) -> Pserver {
        let options = PserverOptions {
            keys: keys(),
            specs: specs(),
            tables: vec![table()],
            shards: SHARDS,
            block_size: 4,
            mode,
            seed: SEED,
            optimizer: OptimizerConfig::Sgd { lr: 1.0 },
            lease_ttl: Duration::from_secs(30),
            replication_timeout: Duration::from_secs(2),
            ..Default::default()
        };
        Pserver::start(self.discovery.clone(), self.transport.clone(), self.listen, options).await.unwrap()
    }

    fn client(&self, trainer: &str) -> PserverClient {
        let placement = self.placement();
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
    // Enough rows that each shard's table spans several arena chunks (of
    // at most 4096 rows), so the catch-up below carries several chunk runs.
    let many: Vec<u64> = (0..40_000u64).map(|i| (i << 20) | 1).collect();
    push(&mut trainer, &many, 0.125).await;
    let mut many_want = initial(&many);
    many_want.iter_mut().for_each(|v| *v -= 0.125);
    assert_eq!(pull(&mut trainer, &many).await, many_want);

    // a dies; a newcomer catches up every shard a held from b's snapshots
    // (rows included); then b dies too: the newcomer alone holds every row.
    env.kill(a).await;
    let c = env.pserver().await;
    env.wait_replicated(&[&b, &c]).await;
    env.kill(b).await;
    let d = env.pserver().await;
    env.wait_replicated(&[&c, &d]).await;
    assert_eq!(pull(&mut trainer, &ids).await, want, "no acknowledged row update lost");
    assert_eq!(pull(&mut trainer, &many).await, many_want, "no row of a large table lost");
    // And the table goes on: one more push lands once.
    push(&mut trainer, &ids, 0.5).await;
    want.iter_mut().for_each(|v| *v -= 0.5);
    assert_eq!(pull(&mut trainer, &ids).await, want);
}

/// A raw request to `ps`, and its answer.
async fn raw(
    env: &Env,
    ps: &Pserver,
    request: &PsRequest,
    payload: Vec<f32>,
) -> Result<PsReply, oar_transport::Error> {
    let conn = env.transport.connect(ps.addr()).await.unwrap();
    let payload = oar_transport::f32s_to_bytes(&payload);
    call(conn.as_ref(), PSERVER_METHOD, request, payload, Duration::from_secs(10))
        .await
        .map(|(r, _): (PsReply, Bytes)| r)
}

fn assert_bad_request(result: Result<PsReply, oar_transport::Error>, words: &[&str]) {
    match result {
        Err(oar_transport::Error::Remote { error, .. }) => {
            assert_eq!(error.kind, RemoteErrorKind::BadRequest, "{error:?}");
            for w in words {
                assert!(error.message.contains(w), "{:?} should contain {w:?}", error.message);
            }
        }
        other => panic!("expected a bad request about {words:?}, got {other:?}"),
    }
}

/// Over QUIC, straight to the pserver (no client checks in the way): a row
/// gradient of the wrong width, a NaN in a row, and a pull of 10M ids are
/// refused with errors that say what was wrong; the table is unchanged, and
/// the pserver goes on serving a well-behaved trainer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_over_quic_are_refused_by_name_and_harm_nothing() {
    let env = Env::quic(1, 1).await;
    let ps = env.pserver().await;
    env.cluster.wait_serving(&[&ps]).await;
    let placement = env.placement();
    let mut trainer = env.client("t1");
    let ids: Vec<u64> = (0..256).map(|i| i * 31 + 5).collect();
    push(&mut trainer, &ids, 0.5).await;
    let before = pull(&mut trainer, &ids).await;

    // One id of a shard, pushed raw to that shard with the dense part of its blocks.
    let shard = placement.row_shard(0, ids[0]).unwrap();
    let blocks = placement.blocks_on(shard).count() as u32;
    let dense: usize = placement.blocks_on(shard).map(|b| b.len).sum();
    let raw_push = |seq: u64, ids: Vec<u64>| PsRequest::Push {
        shard,
        fingerprint: placement.fingerprint(),
        blocks: BlockSpan::new(0, blocks),
        trainer: "stranger".into(),
        seq,
        step: 0,
        weight: 1.0,
        rows: vec![TableRows { table: 0, ids }],
        origin: None,
        epoch: 0,
    };
    // The wrong dim: DIM - 1 values for the row.
    let short = vec![0.0; dense + DIM - 1];
    assert_bad_request(
        raw(&env, &ps, &raw_push(0, vec![ids[0]]), short).await,
        &["1 rows of \"emb\" (dim 4)", "payload has 16 bytes"],
    );
    // A NaN in the row's gradient: named by row and element.
    let mut nan = vec![0.0; dense + DIM];
    nan[dense + 2] = f32::NAN;
    assert_bad_request(raw(&env, &ps, &raw_push(1, vec![ids[0]]), nan).await, &["emb", "non-finite"]);
    // 10M ids in one pull: refused by the pserver, which names the limit.
    let ten_million: Vec<u64> = (0..10_000_000u64).collect();
    let pull_all = PsRequest::PullRows {
        fingerprint: placement.fingerprint(),
        shards: vec![ShardRows {
            shard,
            tables: vec![TableRows { table: 0, ids: ten_million.clone() }],
            min_step: None,
        }],
        max_wait_ms: 0,
    };
    assert_bad_request(raw(&env, &ps, &pull_all, Vec::new()).await, &["10000000 rows", "at most 1048576"]);
    // The client refuses it before sending.
    let mut out = vec![Vec::new()];
    let refused = trainer.pull_rows(&[(0, &ten_million)], &mut out).await.unwrap_err().to_string();
    assert!(refused.contains("10000000 rows in one call, at most 1048576"), "{refused}");

    // Nothing changed, and the pserver serves on.
    assert_eq!(pull(&mut trainer, &ids).await, before, "a refused push changed the table");
    push(&mut trainer, &ids, 0.25).await;
    let mut want = before.clone();
    want.iter_mut().for_each(|v| *v -= 0.25);
    assert_eq!(pull(&mut trainer, &ids).await, want);
}

/// Row pulls are bounded by the bytes they are answered with, not only by
/// the ids they name: 70 pulls in one batch, each naming one row a million
/// times (16 MiB of values each), would have made the pserver build a
/// reply of 1.1 GiB. The batch is refused whole and the pserver serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_pulls_whose_replies_would_be_too_large_are_refused_before_any_row_is_read() {
    let env = Env::new(1, 1).await;
    let ps = env.pserver().await;
    env.cluster.wait_serving(&[&ps]).await;
    let placement = env.placement();
    let id = 5u64;
    let shard = placement.row_shard(0, id).unwrap();
    let big_pull = PsRequest::PullRows {
        fingerprint: placement.fingerprint(),
        shards: vec![ShardRows {
            shard,
            tables: vec![TableRows { table: 0, ids: vec![id; 1 << 20] }],
            min_step: None,
        }],
        max_wait_ms: 0,
    };
    let calls = (0..70).map(|_| BatchCall { request: big_pull.clone(), payload_len: 0 }).collect();
    assert_bad_request(
        raw(&env, &ps, &PsRequest::Batch { calls }, Vec::new()).await,
        &["row pulls whose values take 1174405120 bytes", "at most 1073741824"],
    );
    // One such pull alone is answered.
    match raw(&env, &ps, &big_pull, Vec::new()).await {
        Ok(PsReply::PulledRows { .. }) => {}
        other => panic!("one pull of 16 MiB is answered, got {other:?}"),
    }
    let mut trainer = env.client("t1");
    assert_eq!(pull(&mut trainer, &[id]).await, initial(&[id]));
}

/// A push of `g` to every row of `ids` that asks for the rows of `next` in
/// the same round trip: the push's result, whether the rows came, and
/// their values.
async fn push_asking(
    trainer: &mut PserverClient,
    ids: &[u64],
    g: f32,
    next: &[u64],
) -> (PushResult, bool, Vec<f32>) {
    let mut params = ParamBuf::zeros(&specs());
    trainer.pull(&mut params).await.unwrap();
    let grads = vec![g; ids.len() * DIM];
    let rows = [TableGrads { table: 0, ids, grads: &grads }];
    let mut out = vec![Vec::new()];
    let ahead = RowsAhead { ids: &[(0, next)], out: &mut out };
    let dense = ParamBuf::zeros(&specs());
    let (result, came) = trainer.push_pull_rows_ahead(&dense, &rows, 1.0, &mut params, ahead).await.unwrap();
    (result, came, out.pop().unwrap())
}

/// The rows of a trainer's next batch, asked for with its push, come in
/// the push's round trip (one call to the one pserver holding the 4
/// shards) and are read after the push: its rows come back updated, the
/// others as they were, as a pull just after would read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_asked_with_a_push_come_in_its_round_trip_read_after_it() {
    let env = Env::new(1, 1).await;
    let ps = env.pserver().await;
    env.cluster.wait_serving(&[&ps]).await;
    let mut trainer = env.client("t1");
    let pushed: Vec<u64> = (0..16).collect();
    let next: Vec<u64> = (8..40).collect();
    let mut dense = ParamBuf::zeros(&specs());
    trainer.pull(&mut dense).await.unwrap();

    let before = env.counting.calls();
    let (result, came, rows) = push_asking(&mut trainer, &pushed, 0.25, &next).await;
    // push_asking pulls the dense parameters first: one call for that.
    assert_eq!(env.counting.calls() - before, 2, "a pull, then the push with the next rows: one call each");
    assert_eq!(result, PushResult::Accepted);
    assert!(came, "the next batch's rows came with the push");
    let mut want = initial(&next);
    for (id, row) in next.iter().zip(want.chunks_exact_mut(DIM)) {
        if pushed.contains(id) {
            row.iter_mut().for_each(|v| *v -= 0.25);
        }
    }
    assert_eq!(rows, want);
    assert_eq!(pull(&mut trainer, &next).await, want);
}

/// Sync: the rows asked for with a push are read once the step it went
/// into is complete, so they carry every trainer's gradient of that step:
/// t1's push waits for t2's, and its rows come back with both applied,
/// as a pull after the step reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_sync_mode_rows_asked_with_a_push_are_read_after_its_step() {
    let env = Env::new(1, 1).await;
    let ps = env.pserver_in(Mode::Sync).await;
    env.cluster.wait_serving(&[&ps]).await;
    let (mut t1, mut t2) = (env.client("t1"), env.client("t2"));
    t1.join().await.unwrap();
    t2.join().await.unwrap();
    let ids: Vec<u64> = (0..16).collect();
    let first = {
        let ids = ids.clone();
        tokio::spawn(async move {
            let (result, came, rows) = push_asking(&mut t1, &ids, 1.0, &ids).await;
            (t1, result, came, rows)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!first.is_finished(), "t1's step waits for t2's push");
    let mut dense = ParamBuf::zeros(&specs());
    t2.pull(&mut dense).await.unwrap();
    let grads = vec![3.0; ids.len() * DIM];
    let rows = [TableGrads { table: 0, ids: &ids, grads: &grads }];
    let pushed = t2.push_pull_rows(&ParamBuf::zeros(&specs()), &rows, 1.0, &mut dense).await.unwrap();
    assert_eq!(pushed, PushResult::Accepted);

    let (mut t1, result, came, rows) = first.await.unwrap();
    assert_eq!(result, PushResult::Accepted);
    assert!(came, "the rows came with the push");
    let t1_alone: Vec<f32> = initial(&ids).iter().map(|v| v - 1.0).collect();
    assert_ne!(rows, initial(&ids), "read before the step");
    assert_ne!(rows, t1_alone, "read with t1's gradient only");
    assert_eq!(rows, pull(&mut t1, &ids).await);
}

/// Sync, two replicas: a step of two trainers' rows, each push within the
/// calls' limit, the forward of the step they make together past it. The
/// follower takes the step from a snapshot instead (the primary used to
/// send the forward again for ever, acknowledging nothing, until the
/// trainers gave up), later steps are forwarded again, and the follower,
/// taking over, holds every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_step_too_large_to_forward_reaches_the_follower_by_a_snapshot() {
    const N: usize = 2000;
    // A push of N rows is N * DIM * 4 bytes of values and its ids; the step
    // twice that.
    let limit = (N * DIM * 4 * 3 / 2 + N * 4) as u64;
    let inner: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
    let env = Env::on(Arc::new(common::Limited::new(inner, limit)), "mem:0", 2, 2).await;
    let (a, b) = (env.pserver_in(Mode::Sync).await, env.pserver_in(Mode::Sync).await);
    env.wait_replicated(&[&a, &b]).await;
    let (mut t1, mut t2) = (env.client("t1"), env.client("t2"));
    t1.join().await.unwrap();
    t2.join().await.unwrap();
    // Rows of shard 0 only, so that each push to it is one call of N rows.
    let ids: Vec<u64> = (0..).filter(|&id| row_shard("emb", id, SHARDS) == 0).take(2 * N + 1).collect();
    let (ids1, ids2, last) = (ids[..N].to_vec(), ids[N..2 * N].to_vec(), ids[2 * N]);
    // A sync push: at the step a pull of the dense parameters says.
    async fn push_at_step(trainer: &mut PserverClient, ids: &[u64], g: f32) {
        trainer.pull(&mut ParamBuf::zeros(&specs())).await.unwrap();
        let grads = vec![g; ids.len() * DIM];
        let rows = [TableGrads { table: 0, ids, grads: &grads }];
        let pushed = trainer.push_rows(&ParamBuf::zeros(&specs()), &rows, 1.0).await.unwrap();
        assert_eq!(pushed, PushResult::Accepted);
    }
    let step = |mut t1: PserverClient, mut t2: PserverClient, ids1: Vec<u64>, ids2: Vec<u64>| async move {
        let first = tokio::spawn(async move {
            push_at_step(&mut t1, &ids1, 1.0).await;
            t1
        });
        push_at_step(&mut t2, &ids2, 3.0).await;
        (first.await.unwrap(), t2)
    };
    let within = Duration::from_secs(20);
    let (t1, t2) = tokio::time::timeout(within, step(t1, t2, ids1.clone(), ids2.clone()))
        .await
        .expect("the step too large to forward is acknowledged");
    // A small step after it is forwarded as usual.
    let (mut t1, _t2) = tokio::time::timeout(within, step(t1, t2, vec![last], vec![last]))
        .await
        .expect("the next step is acknowledged");
    // Each row holds the step's mean: half its one trainer's gradient.
    let mut want = initial(&ids);
    for (k, v) in want.iter_mut().enumerate() {
        *v -= match k / DIM {
            i if i < N => 0.5,
            i if i < 2 * N => 1.5,
            _ => 2.0,
        };
    }
    assert_eq!(pull(&mut t1, &ids).await, want);
    let map = env.cluster.map().await.unwrap();
    let (primary, survivor) = if map.primary(0) == Some(a.name()) { (a, b) } else { (b, a) };
    let gone = primary.name().to_string();
    env.kill(primary).await;
    env.cluster.wait_primary(&[&survivor], 0, &gone).await;
    assert_eq!(pull(&mut t1, &ids).await, want, "the follower held every acknowledged row update");
}
