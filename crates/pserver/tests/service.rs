//! The pserver shell end to end on the in-memory discovery and transport
//! (and QUIC), with one replica per shard: bad pushes, retried pushes, a
//! trainer dying inside a sync step, a lost lease, a restart from a
//! checkpoint, and a user optimizer panicking midway through a push.
//! Replication is `tests/replication.rs`'s subject.

use crate::common;

use common::{keys, Cluster};

use bytes::Bytes;
use oar_discovery::{Discovery, MemDiscovery};
use oar_pserver::{
    checkpoint::CheckpointDir,
    protocol::{BlockSpan, PsReply, PsRequest, PSERVER_METHOD},
    Init, Mode, Optimizer, OptimizerConfig, OptimizerFactory, OptimizerState, ParamBuf, ParamSpec, Placement,
    Pserver, PserverClient, PserverClientOptions, PserverOptions, PushOutcome, PushResult, ServiceError, Sgd,
};
use oar_transport::{call, f32s_to_bytes, MemNetwork, MemTransport, RemoteErrorKind, RetryPolicy, Transport};
use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

/// A pserver of a job of `shards` shards applying SGD at `lr` to `specs`.
fn options(specs: Vec<ParamSpec>, shards: u32, mode: Mode, lr: f32) -> PserverOptions {
    PserverOptions {
        keys: keys(),
        specs,
        shards,
        mode,
        optimizer: OptimizerConfig::Sgd { lr },
        ..Default::default()
    }
}

/// A client for `trainer` that gives a shard up after `give_up`.
fn client_options(trainer: &str, give_up: Duration) -> PserverClientOptions {
    PserverClientOptions {
        call_timeout: Duration::from_secs(10),
        retry: RetryPolicy { give_up_after: give_up, ..RetryPolicy::default() },
        ..PserverClientOptions::new(keys(), trainer)
    }
}

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec { name: "w".into(), shape: vec![10, 3], init: Init::Normal { mean: 0.0, std: 0.1 } },
        ParamSpec { name: "b".into(), shape: vec![3], init: Init::Zeros },
    ]
}

/// One shard of `specs()` in blocks of 8, a coordinator wanting one pserver
/// (and one replica).
struct Env {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    placement: Arc<Placement>,
    cluster: Cluster,
}

impl Env {
    async fn new() -> Self {
        let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
        let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
        let cluster = Cluster::start(discovery.clone(), transport.clone(), 1, 1, 1).await;
        Env { discovery, transport, placement: Arc::new(Placement::new(&specs(), 1, 8).unwrap()), cluster }
    }
    /// A pserver, serving shard 0 once the coordinator mapped it.
    async fn pserver(&self, mode: Mode) -> Pserver {
        let mut o = options(specs(), 1, mode, 0.5);
        o.block_size = 8;
        o.lease_ttl = Duration::from_secs(1);
        let ps = Pserver::start(self.discovery.clone(), self.transport.clone(), "mem:0", o).await.unwrap();
        self.cluster.wait_serving(&[&ps]).await;
        ps
    }
    fn client(&self, trainer: &str, give_up: Duration) -> PserverClient {
        let options =
            PserverClientOptions { call_timeout: Duration::from_secs(2), ..client_options(trainer, give_up) };
        PserverClient::new(self.discovery.clone(), self.transport.clone(), self.placement.clone(), options)
    }
}

fn total() -> usize {
    specs().iter().map(|s| s.len()).sum()
}

/// Every block of the one server of `Env`.
fn all_blocks(env: &Env) -> BlockSpan {
    BlockSpan::new(0, env.placement.blocks_on(0).count() as u32)
}

async fn raw_push(
    env: &Env,
    ps: &Pserver,
    seq: u64,
    grad: Vec<f32>,
    fingerprint: u64,
) -> Result<PsReply, oar_transport::Error> {
    raw_push_blocks(env, ps, seq, grad, fingerprint, all_blocks(env)).await
}

async fn raw_push_blocks(
    env: &Env,
    ps: &Pserver,
    seq: u64,
    grad: Vec<f32>,
    fingerprint: u64,
    blocks: BlockSpan,
) -> Result<PsReply, oar_transport::Error> {
    let conn = env.transport.connect(ps.addr()).await.unwrap();
    let request = common::push_request(0, fingerprint, blocks, "t1", seq);
    call(conn.as_ref(), PSERVER_METHOD, &request, f32s_to_bytes(&grad), Duration::from_secs(1))
        .await
        .map(|(r, _): (PsReply, Bytes)| r)
}

fn assert_bad_request(result: Result<PsReply, oar_transport::Error>, words: &str) {
    match result {
        Err(oar_transport::Error::Remote { error, .. }) => {
            assert_eq!(error.kind, RemoteErrorKind::BadRequest);
            assert!(error.message.contains(words), "{:?} should contain {words:?}", error.message);
        }
        other => panic!("expected a bad request about {words}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pushes_are_refused_by_name_and_change_nothing() {
    let env = Env::new().await;
    let ps = env.pserver(Mode::Async).await;
    let fp = env.placement.fingerprint();
    let mut reader = env.client("reader", Duration::from_secs(2));
    let mut before = ParamBuf::zeros(&specs());
    reader.pull(&mut before).await.unwrap();

    assert_bad_request(raw_push(&env, &ps, 0, vec![0.0; total() - 1], fp).await, "payload has");
    assert_bad_request(raw_push(&env, &ps, 1, vec![0.0; total()], fp ^ 1).await, "fingerprint");
    let mut nan = vec![0.0; total()];
    nan[5] = f32::NAN;
    assert_bad_request(raw_push(&env, &ps, 2, nan, fp).await, "non-finite");
    let blocks = all_blocks(&env).end;
    for span in [BlockSpan::new(0, blocks + 1), BlockSpan::new(2, 2), BlockSpan::new(3, 1)] {
        assert_bad_request(raw_push_blocks(&env, &ps, 2, vec![0.0; total()], fp, span).await, "block span");
    }
    let conn = env.transport.connect(ps.addr()).await.unwrap();
    let elsewhere = PsRequest::Push {
        shard: 1,
        fingerprint: fp,
        blocks: all_blocks(&env),
        trainer: "t1".into(),
        seq: 2,
        step: 0,
        weight: 1.0,
        rows: Vec::new(),
        origin: None,
        epoch: 0,
    };
    let payload = f32s_to_bytes(&vec![0.0; total()]);
    let result = call(conn.as_ref(), PSERVER_METHOD, &elsewhere, payload, Duration::from_secs(1))
        .await
        .map(|(r, _): (PsReply, Bytes)| r);
    assert_bad_request(result, "shard 1 does not exist");
    // A trainer id of 1 KiB would be kept in the store, its checkpoints
    // and its followers.
    let long_id = common::push_request(0, fp, all_blocks(&env), &"t".repeat(1024), 2);
    let payload = f32s_to_bytes(&vec![0.0; total()]);
    let result = call(conn.as_ref(), PSERVER_METHOD, &long_id, payload, Duration::from_secs(1))
        .await
        .map(|(r, _): (PsReply, Bytes)| r);
    assert_bad_request(result, "a trainer id of 1024 bytes");
    // A part's payload must match its blocks, not the whole shard's.
    assert_bad_request(
        raw_push_blocks(&env, &ps, 2, vec![0.0; total()], fp, BlockSpan::new(0, 1)).await,
        "blocks 0..1 need",
    );

    let mut after = ParamBuf::zeros(&specs());
    reader.pull(&mut after).await.unwrap();
    assert_eq!(before.as_slice(), after.as_slice(), "refused pushes must not touch the parameters");
    assert_eq!(ps.step(0), Some(0));

    // A good push still works, and the same push retried is applied once.
    let good = vec![1.0; total()];
    assert_eq!(
        raw_push(&env, &ps, 3, good.clone(), fp).await.unwrap(),
        PsReply::Pushed(PushOutcome::Applied { step: 1 })
    );
    assert_eq!(raw_push(&env, &ps, 3, good, fp).await.unwrap(), PsReply::Pushed(PushOutcome::Duplicate));
    reader.pull(&mut after).await.unwrap();
    for (a, b) in after.as_slice().iter().zip(before.as_slice()) {
        assert!((a - (b - 0.5)).abs() < 1e-6, "one SGD step of lr 0.5 on gradient 1: {b} -> {a}");
    }
}

/// A retried sync push-pull is answered from the step it names; a step
/// of `u64::MAX` (no trainer sends one) once overflowed while the shard's
/// lock was held, poisoning it, and the pserver stopped serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_push_pull_naming_the_last_step_harms_nothing() {
    let env = Env::new().await;
    let ps = env.pserver(Mode::Sync).await;
    let fp = env.placement.fingerprint();
    let conn = env.transport.connect(ps.addr()).await.unwrap();
    let push_pull = |step: u64| PsRequest::PushPull {
        shard: 0,
        fingerprint: fp,
        blocks: all_blocks(&env),
        trainer: "t1".into(),
        seq: 1,
        step,
        weight: 1.0,
        rows: Vec::new(),
        origin: None,
        epoch: 0,
    };
    let grads = f32s_to_bytes(&vec![1.0; total()]);
    for step in [0, u64::MAX] {
        let reply =
            call(conn.as_ref(), PSERVER_METHOD, &push_pull(step), grads.clone(), Duration::from_secs(5))
                .await;
        assert!(matches!(reply, Ok((PsReply::PushedPulled { .. }, _))), "step {step}: {reply:?}");
    }
    assert!(ps.stopped().is_none(), "the pserver serves on: {:?}", ps.stopped());
    let mut reader = env.client("reader", Duration::from_secs(2));
    let mut params = ParamBuf::zeros(&specs());
    reader.pull(&mut params).await.unwrap();
    assert_eq!(ps.step(0), Some(1), "the one trainer's push completed step 0, once");
}

/// Then the dead trainer's join arrives after its departure was handled
/// (it was paused past its lease, say): it is taken out of the barrier
/// again, where no departure would come for it a second time and the
/// other trainers' steps would wait for it until their calls gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_that_dies_inside_a_sync_step_does_not_hang_the_others() {
    let env = Env::new().await;
    let ps = env.pserver(Mode::Sync).await;
    let keys = keys();
    let doomed = env.discovery.grant_lease(Duration::from_secs(60)).await.unwrap();
    env.discovery.put(&format!("{}t2", keys.members), b"t2".to_vec(), Some(doomed)).await.unwrap();

    let mut alive = env.client("t1", Duration::from_secs(20));
    let mut dead = env.client("t2", Duration::from_secs(20));
    alive.join().await.unwrap();
    dead.join().await.unwrap();
    let mut params = ParamBuf::zeros(&specs());
    alive.pull(&mut params).await.unwrap();
    // t1's push is answered once its step completes; t2's lease ends
    // instead of its push arriving.
    let waiting = tokio::spawn(async move {
        let grads = ParamBuf::zeros(&specs());
        alive.push(&grads, 4.0).await.unwrap();
        alive.pull(&mut params).await.unwrap();
        (alive, params)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished());
    assert_eq!(ps.step(0), Some(0), "the step waits for t2");
    env.discovery.revoke_lease(doomed).await.unwrap();
    let (mut alive, _) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the pull completes once t2 is gone")
        .unwrap();
    assert_eq!(ps.step(0), Some(1));

    // t2's join arrives now; t1's next step must not wait for t2.
    dead.join().await.unwrap();
    let grads = ParamBuf::zeros(&specs());
    tokio::time::timeout(Duration::from_secs(5), alive.push(&grads, 4.0))
        .await
        .expect("step 1 completes: t2 was taken out of the barrier again")
        .unwrap();
    assert_eq!(ps.step(0), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pserver_that_lost_its_lease_stops_serving() {
    let env = Env::new().await;
    let ps = env.pserver(Mode::Async).await;
    let keys = keys();
    let lease = env.discovery.get(&keys.pserver(ps.name())).await.unwrap().unwrap().lease.unwrap();
    env.discovery.revoke_lease(lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while ps.stopped().is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    let mut client = env.client("t1", Duration::from_millis(200));
    let mut params = ParamBuf::zeros(&specs());
    let err = client.pull(&mut params).await.unwrap_err();
    assert!(err.to_string().contains("away") || err.to_string().contains("stopped"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_only_replica_stopped_is_restored_from_its_checkpoint_elsewhere() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let start = |env: &Env| {
        let mut o = options(specs(), 1, Mode::Async, 0.5);
        o.block_size = 8;
        o.checkpoint_dir = Some(dir.path().to_path_buf());
        o.checkpoint_interval = Duration::from_millis(50);
        Pserver::start(env.discovery.clone(), env.transport.clone(), "mem:0", o)
    };
    let ps = start(&env).await.unwrap();
    env.cluster.wait_serving(&[&ps]).await;
    let fp = env.placement.fingerprint();
    raw_push(&env, &ps, 0, vec![1.0; total()], fp).await.unwrap();
    raw_push(&env, &ps, 1, vec![2.0; total()], fp).await.unwrap();
    let mut reader = env.client("reader", Duration::from_secs(5));
    let mut before = ParamBuf::zeros(&specs());
    reader.pull(&mut before).await.unwrap();

    // The periodic checkpointer records the shard's latest checkpoint in discovery.
    let key = keys().checkpoint(0);
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(kv) = env.discovery.get(&key).await.unwrap() {
                let info = oar_pserver::checkpoint::CheckpointInfo::decode(&kv.value).unwrap();
                if info.step == 2 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a checkpoint of step 2 is recorded under shard_checkpoint/0");

    // The shard has one replica: when it goes, the coordinator gives the
    // shard to another pserver, which restores the checkpoint.
    let steps = ps.shutdown().await.unwrap();
    assert_eq!(steps.get(&0).map(|at| at.step), Some(2));
    let again = start(&env).await.unwrap();
    env.cluster.wait_serving(&[&again]).await;
    assert_eq!(again.step(0), Some(2), "the step comes back from the checkpoint");
    let mut after = ParamBuf::zeros(&specs());
    reader.pull(&mut after).await.unwrap();
    assert_eq!(before.as_slice(), after.as_slice(), "the parameters come back exactly");
    // A push retried across the restart is still recognised as applied.
    assert_eq!(
        raw_push(&env, &again, 1, vec![2.0; total()], fp).await.unwrap(),
        PsReply::Pushed(PushOutcome::Duplicate)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_pull_applies_once_and_answers_the_parameters_after_it() {
    let env = Env::new().await;
    let _ps = env.pserver(Mode::Async).await;
    // Its first push has seq 0, which the retry below names.
    let options = PserverClientOptions {
        call_timeout: Duration::from_secs(2),
        first_seq: 0,
        ..client_options("t1", Duration::from_secs(2))
    };
    let mut trainer =
        PserverClient::new(env.discovery.clone(), env.transport.clone(), env.placement.clone(), options);
    let mut reader = env.client("reader", Duration::from_secs(2));
    let mut before = ParamBuf::zeros(&specs());
    reader.pull(&mut before).await.unwrap();

    let mut grads = ParamBuf::zeros(&specs());
    grads.fill(1.0);
    let mut got = ParamBuf::zeros(&specs());
    trainer.push_pull(&grads, 4.0, &mut got).await.unwrap();
    let mut pulled = ParamBuf::zeros(&specs());
    reader.pull(&mut pulled).await.unwrap();
    assert_eq!(got.as_slice(), pulled.as_slice(), "a push-pull answers what a pull then reads");
    for (a, b) in got.as_slice().iter().zip(before.as_slice()) {
        assert!((a - (b - 0.5)).abs() < 1e-6, "one SGD step of lr 0.5 on gradient 1: {b} -> {a}");
    }

    // The same push-pull sent again (a retry: same trainer and seq) is not
    // applied twice, and still answers the parameters.
    let ps_addr = _ps.addr().to_string();
    let conn = env.transport.connect(&ps_addr).await.unwrap();
    let retry = PsRequest::PushPull {
        shard: 0,
        fingerprint: env.placement.fingerprint(),
        blocks: all_blocks(&env),
        trainer: "t1".into(),
        seq: 0,
        weight: 4.0,
        rows: Vec::new(),
        origin: None,
        epoch: 0,
        step: 0,
    };
    let (reply, payload): (PsReply, Bytes) = call(
        conn.as_ref(),
        PSERVER_METHOD,
        &retry,
        f32s_to_bytes(&vec![1.0; total()]),
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    assert_eq!(reply, PsReply::PushedPulled { outcome: PushOutcome::Duplicate, step: 1 });
    assert_eq!(payload, f32s_to_bytes(got.as_slice()));
}

/// A trainer restarted under its id (a new client, as a restarted process
/// makes) has its pushes applied: its seqs start above the old process's,
/// which a shard would take for retries and answer `Duplicate` without
/// applying them, while the client counted them acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_restarted_under_its_id_has_its_pushes_applied() {
    let env = Env::new().await;
    let _ps = env.pserver(Mode::Async).await;
    let mut reader = env.client("reader", Duration::from_secs(2));
    let mut grads = ParamBuf::zeros(&specs());
    grads.fill(1.0);
    {
        let mut first = env.client("t1", Duration::from_secs(2));
        for _ in 0..3 {
            assert_eq!(first.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
        }
    }
    let mut before = ParamBuf::zeros(&specs());
    reader.pull(&mut before).await.unwrap();

    let mut restarted = env.client("t1", Duration::from_secs(2));
    assert_eq!(restarted.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
    assert_eq!(restarted.acknowledged(0), 1);
    assert_eq!(restarted.applied_before(), 0);
    let mut after = ParamBuf::zeros(&specs());
    reader.pull(&mut after).await.unwrap();
    for (a, b) in after.as_slice().iter().zip(before.as_slice()) {
        assert!(
            (a - (b - 0.5)).abs() < 1e-6,
            "the restarted trainer's push applied once (lr 0.5): {b} -> {a}"
        );
    }
}

/// Sync, a push-pull is one round trip per step: it answers when its step
/// completes, with the new step's parameters (what a pull then reads); a
/// push-pull for a step the shard left answers stale and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_pull_answers_with_the_next_step_s_parameters() {
    let env = Env::new().await;
    let ps = env.pserver(Mode::Sync).await;
    let mut t1 = env.client("t1", Duration::from_secs(20));
    let mut t2 = env.client("t2", Duration::from_secs(20));
    t1.join().await.unwrap();
    t2.join().await.unwrap();
    let mut before = ParamBuf::zeros(&specs());
    t1.pull(&mut before).await.unwrap();
    t2.pull(&mut ParamBuf::zeros(&specs())).await.unwrap();
    let first = tokio::spawn(async move {
        let mut grads = ParamBuf::zeros(&specs());
        grads.fill(1.0);
        let mut got = ParamBuf::zeros(&specs());
        let result = t1.push_pull(&grads, 1.0, &mut got).await.unwrap();
        (t1, result, got)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!first.is_finished(), "answered before the step completed");
    assert_eq!(ps.step(0), Some(0));
    let mut grads = ParamBuf::zeros(&specs());
    grads.fill(3.0);
    let mut got2 = ParamBuf::zeros(&specs());
    assert_eq!(t2.push_pull(&grads, 1.0, &mut got2).await.unwrap(), PushResult::Accepted);
    let (mut t1, result, got1) = first.await.unwrap();
    assert_eq!(result, PushResult::Accepted);
    assert_eq!(ps.step(0), Some(1));
    assert_eq!(got1.as_slice(), got2.as_slice(), "both answered the new step's parameters");
    for (a, b) in got1.as_slice().iter().zip(before.as_slice()) {
        assert!((a - (b - 1.0)).abs() < 1e-6, "one SGD step of lr 0.5 on the mean gradient 2: {b} -> {a}");
    }
    let mut pulled = ParamBuf::zeros(&specs());
    t1.pull(&mut pulled).await.unwrap();
    assert_eq!(pulled.as_slice(), got1.as_slice(), "what a pull of the step reads");

    // t2 leaves; t1 alone goes on, one round trip per step.
    t2.leave().await.unwrap();
    let mut got = ParamBuf::zeros(&specs());
    assert_eq!(t1.push_pull(&grads, 1.0, &mut got).await.unwrap(), PushResult::Accepted);
    assert_eq!(ps.step(0), Some(2));
    // t2 pushes for step 1, which is over: stale, nothing applied, its
    // buffer left as it was.
    let mut stale = ParamBuf::zeros(&specs());
    stale.fill(7.0);
    assert_eq!(t2.push_pull(&grads, 1.0, &mut stale).await.unwrap(), PushResult::Stale);
    assert!(stale.as_slice().iter().all(|&x| x == 7.0));
    assert_eq!(ps.step(0), Some(2));
}

/// Messages above the client's small-message threshold are sent from the
/// gradient buffer and written into the parameters as they arrive; over
/// QUIC, with two pservers, every value lands where it belongs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_pushes_and_pulls_over_quic_put_every_value_in_place() {
    // Each shard whole in one call, then cut in parts of two blocks (four
    // parts per shard, two in flight).
    for max_part_bytes in [oar_pserver::client::DEFAULT_MAX_PART_BYTES, 80_000] {
        quic_round_trips(max_part_bytes).await;
    }
}

async fn quic_round_trips(max_part_bytes: usize) {
    let specs = vec![
        ParamSpec { name: "w".into(), shape: vec![300, 500], init: Init::Normal { mean: 0.0, std: 0.1 } },
        ParamSpec { name: "b".into(), shape: vec![1001], init: Init::Zeros },
    ];
    let ca = oar_transport::DevCa::new().unwrap();
    let transport: Arc<dyn Transport> =
        Arc::new(oar_transport::QuicTransport::new(ca.tls_config("ps-test").unwrap()).unwrap());
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let cluster = Cluster::start(discovery.clone(), transport.clone(), 2, 1, 2).await;
    let mut servers = Vec::new();
    for _ in 0..2 {
        let mut o = options(specs.clone(), 2, Mode::Async, 0.5);
        o.block_size = 10_000;
        servers.push(Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", o).await.unwrap());
    }
    cluster.wait_serving(&servers.iter().collect::<Vec<_>>()).await;
    let placement = Arc::new(Placement::new(&specs, 2, 10_000).unwrap());
    let mut client = PserverClient::new(
        discovery.clone(),
        transport.clone(),
        placement,
        client_options("t1", Duration::from_secs(10)),
    );
    client.set_max_part_bytes(max_part_bytes);
    let initial = ParamBuf::init(&specs, options(specs.clone(), 2, Mode::Async, 0.5).seed);
    let mut params = ParamBuf::zeros(&specs);
    client.pull(&mut params).await.unwrap();
    assert!(params.as_slice() == initial.as_slice(), "a pull brings every initial value");

    // Gradient i at element i: after one SGD step of 0.5, element i is initial - 0.5 i / 1000.
    let mut grads = ParamBuf::zeros(&specs);
    grads.as_mut_slice().iter_mut().enumerate().for_each(|(i, g)| *g = i as f32 / 1000.0);
    client.push(&grads, 1.0).await.unwrap();
    client.pull(&mut params).await.unwrap();
    let stepped = |n: f32| -> Vec<f32> {
        initial.as_slice().iter().enumerate().map(|(i, p)| p - n * 0.5 * (i as f32 / 1000.0)).collect()
    };
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-3 * (1.0 + y.abs()));
    assert!(close(params.as_slice(), &stepped(1.0)), "one push applied where it belongs");
    let mut after = ParamBuf::zeros(&specs);
    client.push_pull(&grads, 1.0, &mut after).await.unwrap();
    assert!(close(after.as_slice(), &stepped(2.0)), "a push-pull answers the parameters after the push");
    for server in servers {
        server.shutdown().await.unwrap();
    }
}

/// A sync step pushed in parts by two trainers over QUIC: each block
/// combines both gradients once, weighted, whatever order the parts come in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_pushes_in_parts_combine_every_block_once() {
    // 16 blocks of 16 KB: parts of 3 blocks (and a last one of 1); a
    // message small enough for a call per part in a task of its own.
    sync_push_in_parts(64_000, 4_000, 50_000).await;
}

/// Above the small-message size, a shard's parts go in lanes: a sync
/// push of many more parts than `PARTS_IN_FLIGHT` must still complete (each
/// part is answered when the step completes, which needs all of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_push_of_many_parts_per_shard_completes() {
    // 25 blocks of 40 KB, a part each: 1 MB a trainer.
    sync_push_in_parts(250_000, 10_000, 50_000).await;
}

/// Two sync trainers push `len` floats in blocks of `block`, parts of at
/// most `part_bytes`: one step, every block combined once.
async fn sync_push_in_parts(len: usize, block: usize, part_bytes: usize) {
    let specs = vec![ParamSpec { name: "w".into(), shape: vec![len], init: Init::Zeros }];
    let ca = oar_transport::DevCa::new().unwrap();
    let transport: Arc<dyn Transport> =
        Arc::new(oar_transport::QuicTransport::new(ca.tls_config("ps-test").unwrap()).unwrap());
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let cluster = Cluster::start(discovery.clone(), transport.clone(), 1, 1, 1).await;
    let mut o = options(specs.clone(), 1, Mode::Sync, 1.0);
    o.block_size = block;
    let server = Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", o).await.unwrap();
    cluster.wait_serving(&[&server]).await;
    let placement = Arc::new(Placement::new(&specs, 1, block).unwrap());
    let client = |name: &str| {
        let options = client_options(name, Duration::from_secs(10));
        let mut c = PserverClient::new(discovery.clone(), transport.clone(), placement.clone(), options);
        c.set_max_part_bytes(part_bytes);
        c
    };
    let (mut a, mut b) = (client("a"), client("b"));
    a.join().await.unwrap();
    b.join().await.unwrap();
    let mut params = ParamBuf::zeros(&specs);
    a.pull(&mut params).await.unwrap();
    b.pull(&mut params).await.unwrap();
    // a: gradient i with weight 1; b: gradient -3i with weight 3. Mean: (i - 9i) / 4 = -2i.
    let mut ga = ParamBuf::zeros(&specs);
    ga.as_mut_slice().iter_mut().enumerate().for_each(|(i, g)| *g = i as f32);
    let mut gb = ParamBuf::zeros(&specs);
    gb.as_mut_slice().iter_mut().enumerate().for_each(|(i, g)| *g = -3.0 * i as f32);
    let (ra, rb) = tokio::join!(a.push(&ga, 1.0), b.push(&gb, 3.0));
    assert_eq!((ra.unwrap(), rb.unwrap()), (PushResult::Accepted, PushResult::Accepted));
    a.pull(&mut params).await.unwrap();
    assert_eq!(server.step(0), Some(1), "one step, applied once");
    for (i, p) in params.as_slice().iter().enumerate() {
        assert!((p - 2.0 * i as f32).abs() <= 1e-3 * (1.0 + 2.0 * i as f32), "element {i}: {p}");
    }
    server.shutdown().await.unwrap();
}

/// SGD (lr 0.5) that panics on its `panic_at`-th apply, counted over every
/// block it updates: a user's optimizer with a bug.
struct Fragile {
    applies: AtomicU64,
    panic_at: u64,
}

impl Optimizer for Fragile {
    fn name(&self) -> &str {
        "fragile-sgd"
    }
    fn state_slots(&self) -> usize {
        0
    }
    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
        let n = self.applies.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.panic_at {
            panic!("fragile-sgd broke on apply {n}");
        }
        Sgd { lr: 0.5 }.apply(params, grad, state);
    }
}

/// A call of `request` that must be refused as unavailable, naming the panic.
async fn assert_refused_naming_the_panic(env: &Env, ps: &Pserver, request: PsRequest, payload: Vec<f32>) {
    let conn = env.transport.connect(ps.addr()).await.unwrap();
    let what = format!("{request:?}");
    let result =
        call(conn.as_ref(), PSERVER_METHOD, &request, f32s_to_bytes(&payload), Duration::from_secs(1))
            .await
            .map(|(r, _): (PsReply, Bytes)| r);
    match result {
        Err(oar_transport::Error::Remote { error, .. }) => {
            assert_eq!(error.kind, RemoteErrorKind::Unavailable, "{what}: {error:?}");
            assert!(error.message.contains("fragile-sgd broke on apply 8"), "{what}: {error:?}");
        }
        other => panic!("{what}: expected a refusal naming the panic, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_midway_through_a_push_stops_the_pserver_and_a_replacement_loads_the_last_checkpoint() {
    let env = Env::new().await;
    let dir = tempfile::tempdir().unwrap();
    let start = |panic_at: u64| {
        let mut o = options(specs(), 1, Mode::Async, 0.5);
        o.block_size = 8;
        o.lease_ttl = Duration::from_secs(30);
        o.checkpoint_dir = Some(dir.path().to_path_buf());
        o.checkpoint_interval = Duration::from_secs(3600);
        o.custom_optimizer =
            Some(OptimizerFactory::new(move || Box::new(Fragile { applies: AtomicU64::new(0), panic_at })));
        Pserver::start(env.discovery.clone(), env.transport.clone(), "mem:0", o)
    };
    // Five blocks: 8 + 8 + 8 + 6 of "w", 3 of "b". The first push applies
    // 1-5; the second updates two blocks and panics on the third (apply 8).
    assert_eq!(all_blocks(&env).end, 5);
    let ps = start(8).await.unwrap();
    env.cluster.wait_serving(&[&ps]).await;
    let fp = env.placement.fingerprint();
    let first = raw_push(&env, &ps, 0, vec![1.0; total()], fp).await.unwrap();
    assert_eq!(first, PsReply::Pushed(PushOutcome::Applied { step: 1 }));
    let saved = ps.checkpoint().await.unwrap();
    assert_eq!(saved.iter().map(|i| i.step).collect::<Vec<_>>(), [1]);
    let files = |d: &CheckpointDir| -> Vec<(String, Vec<u8>)> {
        d.list().unwrap().iter().map(|p| (p.display().to_string(), std::fs::read(p).unwrap())).collect()
    };
    let ckpt_dir = CheckpointDir::new(dir.path(), 0);
    let before_panic = files(&ckpt_dir);
    let mut reader = env.client("reader", Duration::from_secs(5));
    let mut after_first = ParamBuf::zeros(&specs());
    reader.pull(&mut after_first).await.unwrap();

    // The push that panics is refused, and so is everything after it.
    let second = raw_push(&env, &ps, 1, vec![2.0; total()], fp).await;
    match second {
        Err(oar_transport::Error::Remote { error, .. }) => {
            assert_eq!(error.kind, RemoteErrorKind::Unavailable, "{error:?}");
            assert!(error.message.contains("fragile-sgd broke on apply 8"), "{error:?}");
        }
        other => panic!("expected the panicking push to be refused, got {other:?}"),
    }
    let why = ps.stopped().expect("the pserver stopped serving");
    assert!(why.contains("fragile-sgd broke on apply 8") && why.contains("half-updated"), "{why}");
    let blocks = all_blocks(&env);
    let refused = [
        (PsRequest::Info { shard: 0 }, vec![]),
        (PsRequest::Join { shard: 0, trainer: "t9".into() }, vec![]),
        (PsRequest::Leave { shard: 0, trainer: "t9".into() }, vec![]),
        (PsRequest::Pull { shard: 0, fingerprint: fp, blocks, min_step: None, max_wait_ms: 0 }, vec![]),
        (
            PsRequest::Push {
                shard: 0,
                fingerprint: fp,
                blocks,
                trainer: "t1".into(),
                seq: 2,
                step: 0,
                weight: 1.0,
                rows: Vec::new(),
                origin: None,
                epoch: 0,
            },
            vec![1.0; total()],
        ),
        (
            PsRequest::PushPull {
                shard: 0,
                fingerprint: fp,
                blocks,
                trainer: "t1".into(),
                seq: 3,
                weight: 1.0,
                rows: Vec::new(),
                origin: None,
                epoch: 0,
                step: 0,
            },
            vec![1.0; total()],
        ),
    ];
    for (request, payload) in refused {
        assert_refused_naming_the_panic(&env, &ps, request, payload).await;
    }

    // No checkpoint of the half-updated store: asked for, it is refused,
    // and the files are those from before the panic, byte for byte.
    match ps.checkpoint().await {
        Err(ServiceError::Stopped(why)) => assert!(why.contains("fragile-sgd broke on apply 8"), "{why}"),
        other => panic!("expected the checkpoint to be refused, got {other:?}"),
    }
    assert_eq!(files(&ckpt_dir), before_panic);

    // The registration goes at once (the lease revoked): the coordinator
    // gives the shard to a replacement, which loads the checkpoint of step
    // 1 and takes the push again.
    let registration = keys().pserver(ps.name());
    tokio::time::timeout(Duration::from_secs(10), async {
        while env.discovery.get(&registration).await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the stopped pserver's registration goes");
    let replacement = start(u64::MAX).await.unwrap();
    env.cluster.wait_serving(&[&replacement]).await;
    assert_eq!(replacement.step(0), Some(1));
    let mut restored = ParamBuf::zeros(&specs());
    reader.pull(&mut restored).await.unwrap();
    assert_eq!(
        restored.as_slice(),
        after_first.as_slice(),
        "the state of the last checkpoint, not the half-update"
    );
    let again = raw_push(&env, &replacement, 1, vec![2.0; total()], fp).await.unwrap();
    assert_eq!(again, PsReply::Pushed(PushOutcome::Applied { step: 2 }));
    drop(ps);
    replacement.shutdown().await.unwrap();
}

/// Async trainers pushing in parts back to back, with no pause between two
/// pushes, to a pserver over QUIC that writes checkpoints when asked.
struct Pushing {
    server: Pserver,
    transport: Arc<dyn Transport>,
    placement: Arc<Placement>,
    stop: Arc<AtomicBool>,
    /// Each trainer's task: its pushes acknowledged.
    pushers: Vec<tokio::task::JoinHandle<u64>>,
    _cluster: Cluster,
    _dir: tempfile::TempDir,
}

impl Pushing {
    /// Trainers pushing in parts.
    const TRAINERS: usize = 4;
    const BLOCK: usize = 4_000;
    /// A call per block (16 KB): 80 parts a push, two in flight (a push
    /// above the client's small-message size, whose parts all go at once).
    const BLOCKS: usize = 80;

    /// Once every trainer pushes.
    async fn start() -> Pushing {
        let specs =
            vec![ParamSpec { name: "w".into(), shape: vec![Self::BLOCKS * Self::BLOCK], init: Init::Zeros }];
        let ca = oar_transport::DevCa::new().unwrap();
        let transport: Arc<dyn Transport> =
            Arc::new(oar_transport::QuicTransport::new(ca.tls_config("ps-test").unwrap()).unwrap());
        let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
        let cluster = Cluster::start(discovery.clone(), transport.clone(), 1, 1, 1).await;
        let dir = tempfile::tempdir().unwrap();
        let mut o = options(specs.clone(), 1, Mode::Async, 1e-3);
        o.block_size = Self::BLOCK;
        o.checkpoint_dir = Some(dir.path().to_path_buf());
        o.checkpoint_interval = Duration::from_secs(3600);
        let server = Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", o).await.unwrap();
        cluster.wait_serving(&[&server]).await;
        let placement = Arc::new(Placement::new(&specs, 1, Self::BLOCK).unwrap());
        assert_eq!(placement.blocks_on(0).count(), Self::BLOCKS);
        let stop = Arc::new(AtomicBool::new(false));
        let pushers = (0..Self::TRAINERS)
            .map(|t| {
                // Numbered from 0: a trainer's last seq + 1 is its pushes.
                let options = PserverClientOptions {
                    first_seq: 0,
                    ..client_options(&format!("t{t}"), Duration::from_secs(10))
                };
                let mut client =
                    PserverClient::new(discovery.clone(), transport.clone(), placement.clone(), options);
                client.set_max_part_bytes(Self::BLOCK * 4);
                let mut grads = ParamBuf::zeros(&specs);
                grads.fill(0.01);
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut acknowledged = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        assert_eq!(client.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
                        acknowledged += 1;
                    }
                    acknowledged
                })
            })
            .collect();
        let pushing = Pushing { server, transport, placement, stop, pushers, _cluster: cluster, _dir: dir };
        pushing.wait_for_pushes(4 * Self::TRAINERS as u64, Duration::from_secs(20)).await;
        pushing
    }

    /// The pushes the shard applied.
    fn pushes(&self) -> u64 {
        self.server.pushes(0).unwrap()
    }

    /// Wait until the shard applied `n` more pushes, at most `timeout`.
    async fn wait_for_pushes(&self, n: u64, timeout: Duration) {
        let start = self.pushes();
        let waited = tokio::time::timeout(timeout, async {
            while self.pushes() < start + n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        waited
            .await
            .unwrap_or_else(|_| panic!("{n} more pushes within {timeout:?}: {}", self.pushes() - start));
    }

    /// A checkpoint, which must be written; checks that it holds whole
    /// pushes only (each pushing trainer's seqs 0, 1, ... all counted). Its
    /// step.
    async fn checkpoint(&self, what: &str) -> u64 {
        let started = std::time::Instant::now();
        let written = match self.server.checkpoint().await {
            Ok(written) => written,
            Err(e) => panic!("{what} failed after {:?}: {e}", started.elapsed()),
        };
        assert_eq!(written.len(), 1, "{what}: one shard written");
        let info = &written[0];
        let sgd = Box::new(Sgd { lr: 1.0 });
        let mut loaded = oar_pserver::ParamStore::new(&self.placement, 0, 1, sgd, Mode::Async).unwrap();
        oar_pserver::checkpoint::load_file(std::path::Path::new(&info.path), &mut loaded).unwrap();
        let pushers = loaded.last_seqs().filter(|(trainer, _)| trainer.starts_with('t'));
        let seqs: u64 = pushers.map(|(_, seq)| seq + 1).sum();
        assert_eq!((loaded.step(), loaded.pushes()), (info.step, info.step), "{what}");
        assert_eq!(seqs, info.step, "{what}: every push it took is whole");
        info.step
    }

    /// Stop the trainers and the pserver: every push acknowledged was
    /// applied once.
    async fn finish(self) {
        self.stop.store(true, Ordering::SeqCst);
        let mut sent = Vec::new();
        for pusher in self.pushers {
            sent.push(pusher.await.unwrap());
        }
        let total: u64 = sent.iter().sum();
        assert_eq!(self.server.pushes(0), Some(total), "every acknowledged push applied once ({sent:?})");
        let at_stop = self.server.shutdown().await.unwrap();
        let at = &at_stop[&0];
        assert_eq!((at.step, at.pushes), (total, total));
        for (t, n) in sent.iter().enumerate() {
            assert_eq!(at.last_seqs.get(&format!("t{t}")).map(|seq| seq + 1), Some(*n), "trainer t{t}");
        }
    }
}

/// Async, several trainers pushing in parts back to back, while the
/// pserver is asked for checkpoints. A checkpoint never holds half a push,
/// and with the trainers' pushes overlapping some push is half taken at
/// almost every moment: a checkpoint that only waited for a moment with
/// none starved, and failed (`CheckpointStepUnderway`) after its 30 s
/// wait. The pushes that would start a new push wait at its gate while the
/// half-taken ones complete: every checkpoint gets in, holds whole pushes
/// only, the pushes go on between checkpoints, and every push is
/// acknowledged and applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn checkpoints_get_in_between_overlapping_async_pushes_in_parts() {
    let pushing = Pushing::start().await;
    let mut last_step = 0;
    for round in 0..5 {
        let step = pushing.checkpoint(&format!("checkpoint {round}")).await;
        assert!(step > last_step, "checkpoint {round}: step {step} after {last_step}");
        last_step = step;
        // The pushes go on between checkpoints.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pushing.finish().await;
}

/// A push in parts that its trainer left half taken (it died, say, and
/// its lease has not ended yet) holds a checkpoint back, as it must; but
/// not the other trainers: the checkpoint's gate opens once no push
/// progresses, and when the checkpoint is dropped. Once the trainer
/// leaves, the checkpoint gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_held_back_by_a_dead_trainer_s_push_does_not_hold_the_others() {
    let pushing = Pushing::start().await;
    let conn = pushing.transport.connect(pushing.server.addr()).await.unwrap();
    let dead = |request: PsRequest, payload: Vec<f32>| {
        let conn = conn.clone();
        async move {
            let reply = call(
                conn.as_ref(),
                PSERVER_METHOD,
                &request,
                f32s_to_bytes(&payload),
                Duration::from_secs(5),
            );
            reply.await.map(|(r, _): (PsReply, Bytes)| r).unwrap()
        }
    };
    let first_block = PsRequest::Push {
        shard: 0,
        fingerprint: pushing.placement.fingerprint(),
        blocks: BlockSpan::new(0, 1),
        trainer: "dead".into(),
        seq: 0,
        step: 0,
        weight: 1.0,
        rows: Vec::new(),
        origin: None,
        epoch: 0,
    };
    let half = dead(first_block, vec![0.01; Pushing::BLOCK]).await;
    assert!(matches!(half, PsReply::Pushed(PushOutcome::Applied { .. })), "{half:?}");

    // A checkpoint dropped while its gate is closed opens it: the pushes go on.
    let dropped = tokio::time::timeout(Duration::from_millis(200), pushing.server.checkpoint()).await;
    assert!(dropped.is_err(), "a checkpoint waits for the dead trainer's push: {dropped:?}");
    pushing.wait_for_pushes(20, Duration::from_secs(3)).await;
    // A checkpoint that waits opens its gate once no push progresses.
    let before = pushing.pushes();
    let waiting = tokio::time::timeout(Duration::from_secs(3), pushing.server.checkpoint()).await;
    assert!(waiting.is_err(), "a checkpoint waits for the dead trainer's push: {waiting:?}");
    let during = pushing.pushes() - before;
    assert!(during >= 20, "{during} pushes while a checkpoint waited 3 s for the dead trainer");

    let left = dead(PsRequest::Leave { shard: 0, trainer: "dead".into() }, Vec::new()).await;
    assert_eq!(left, PsReply::Ok);
    pushing.checkpoint("the checkpoint after the dead trainer left").await;
    pushing.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_checkpoint_interval_is_refused_by_name() {
    let env = Env::new().await;
    let o = PserverOptions { checkpoint_interval: Duration::ZERO, ..options(specs(), 1, Mode::Async, 0.5) };
    let err = Pserver::start(env.discovery.clone(), env.transport.clone(), "mem:0", o).await.err();
    assert!(
        matches!(&err, Some(ServiceError::Config(why)) if why.contains("checkpoint_interval")),
        "{err:?}"
    );
}
