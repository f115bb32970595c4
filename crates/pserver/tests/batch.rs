//! A trainer's small calls to shards that share a primary travel in one
//! batch (`PsRequest::Batch`): one call per pserver instead of one per
//! shard, with every shard's answer as if it had come alone. A batch that
//! does not add up is refused whole and harms nothing.

use crate::common;

use bytes::Bytes;
use common::{keys, Cluster, Counting};
use oar_discovery::{Discovery, MemDiscovery};
use oar_pserver::{
    protocol::{BatchCall, BlockSpan, PsReply, PsRequest, PSERVER_METHOD},
    Init, Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement, Pserver, PserverClient,
    PserverClientOptions, PserverOptions, PushOutcome, PushResult,
};
use oar_transport::{call, MemNetwork, MemTransport, RemoteErrorKind, Transport};
use std::{sync::Arc, time::Duration};

const SHARDS: u32 = 8;
const LEN: usize = 64;

fn specs() -> Vec<ParamSpec> {
    vec![ParamSpec { name: "w".into(), shape: vec![LEN], init: Init::Zeros }]
}

/// One pserver holding all `SHARDS` shards of a 64-float model (blocks
/// of 8: one per shard), SGD with lr 1, and a client.
struct Env {
    transport: Arc<Counting>,
    placement: Arc<Placement>,
    pserver: Pserver,
    discovery: Arc<dyn Discovery>,
    _cluster: Cluster,
}

impl Env {
    async fn new(mode: Mode) -> Env {
        let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
        let transport = Arc::new(Counting::new(Arc::new(MemTransport::new(MemNetwork::new()))));
        let cluster = Cluster::start(discovery.clone(), transport.clone(), SHARDS, 1, 1).await;
        let options = PserverOptions {
            keys: keys(),
            specs: specs(),
            shards: SHARDS,
            mode,
            optimizer: OptimizerConfig::Sgd { lr: 1.0 },
            block_size: 8,
            lease_ttl: Duration::from_secs(1),
            ..Default::default()
        };
        let pserver = Pserver::start(discovery.clone(), transport.clone(), "mem:0", options).await.unwrap();
        cluster.wait_serving(&[&pserver]).await;
        let placement = Arc::new(Placement::new(&specs(), SHARDS, 8).unwrap());
        Env { transport, placement, pserver, discovery, _cluster: cluster }
    }

    fn client(&self, trainer: &str) -> PserverClient {
        let options = PserverClientOptions {
            call_timeout: Duration::from_secs(5),
            ..PserverClientOptions::new(keys(), trainer)
        };
        PserverClient::new(self.discovery.clone(), self.transport.clone(), self.placement.clone(), options)
    }

    fn calls(&self) -> u64 {
        self.transport.calls()
    }

    /// A raw batch to the pserver.
    async fn batch(
        &self,
        calls: Vec<BatchCall>,
        payload: Vec<u8>,
    ) -> Result<(PsReply, Bytes), oar_transport::Error> {
        let conn = self.transport.connect(self.pserver.addr()).await.unwrap();
        let request = PsRequest::Batch { calls };
        call(conn.as_ref(), PSERVER_METHOD, &request, payload.into(), Duration::from_secs(5)).await
    }

    /// A push of `value` to every element of shard `shard`'s block, as
    /// trainer "raw" with `seq`.
    fn push(&self, shard: u32, seq: u64, fingerprint: u64) -> PsRequest {
        common::push_request(shard, fingerprint, BlockSpan::new(0, 1), "raw", seq)
    }
}

fn floats(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_calls_to_shards_of_one_pserver_take_one_call_and_land_on_every_shard() {
    let env = Env::new(Mode::Async).await;
    let mut trainer = env.client("t1");
    let mut grads = ParamBuf::zeros(&specs());
    grads.as_mut_slice().iter_mut().enumerate().for_each(|(i, g)| *g = i as f32);
    let mut params = ParamBuf::zeros(&specs());
    trainer.pull(&mut params).await.unwrap();

    let before = env.calls();
    assert_eq!(trainer.push_pull(&grads, 1.0, &mut params).await.unwrap(), PushResult::Accepted);
    assert_eq!(env.calls() - before, 1, "one push-pull to {SHARDS} shards of one pserver: one call");
    // Each shard applied its own block of the push, once, and sent its
    // parameters back into their place.
    let want: Vec<f32> = (0..LEN).map(|i| -(i as f32)).collect();
    assert_eq!(params.as_slice(), want.as_slice());
    for shard in 0..SHARDS {
        assert_eq!(trainer.acknowledged(shard), 1, "shard {shard}");
    }

    let before = env.calls();
    trainer.push(&grads, 1.0).await.unwrap();
    let mut again = ParamBuf::zeros(&specs());
    trainer.pull(&mut again).await.unwrap();
    assert_eq!(env.calls() - before, 2, "a push and a pull: one call each");
    let want: Vec<f32> = (0..LEN).map(|i| -2.0 * i as f32).collect();
    assert_eq!(again.as_slice(), want.as_slice());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_each_call_as_if_it_came_alone() {
    let env = Env::new(Mode::Async).await;
    let fingerprint = env.placement.fingerprint();
    // Shard 0 takes a push; shard 1's names the wrong layout; shard 99
    // does not exist. Each gets its own answer.
    let calls = vec![
        BatchCall { request: env.push(0, 0, fingerprint), payload_len: 32 },
        BatchCall { request: env.push(1, 0, fingerprint ^ 1), payload_len: 32 },
        BatchCall { request: env.push(99, 0, fingerprint), payload_len: 0 },
    ];
    let mut payload = floats(&[1.0; 8]);
    payload.extend(floats(&[2.0; 8]));
    let (reply, _) = env.batch(calls, payload).await.unwrap();
    let PsReply::Batch { answers } = reply else { panic!("{reply:?}") };
    assert_eq!(answers.len(), 3);
    assert!(matches!(answers[0].reply, Ok(PsReply::Pushed(PushOutcome::Applied { .. }))), "{:?}", answers[0]);
    let refused = |i: usize| answers[i].reply.as_ref().expect_err("refused").clone();
    assert_eq!(refused(1).kind, RemoteErrorKind::BadRequest);
    assert!(refused(1).message.contains("fingerprint"), "{}", refused(1).message);
    assert!(answers[2].reply.is_err(), "{:?}", answers[2]);
    assert_eq!(env.pserver.block(env.placement.blocks_on(0).next().unwrap().id).unwrap(), vec![-1.0; 8]);
    assert_eq!(env.pserver.block(env.placement.blocks_on(1).next().unwrap().id).unwrap(), vec![0.0; 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_does_not_add_up_is_refused_whole_and_harms_nothing() {
    let env = Env::new(Mode::Async).await;
    let fingerprint = env.placement.fingerprint();
    let refused = |r: Result<(PsReply, Bytes), oar_transport::Error>| match r {
        Err(oar_transport::Error::Remote { error, .. }) if error.kind == RemoteErrorKind::BadRequest => {
            error.message
        }
        other => panic!("{other:?}"),
    };
    // Lengths that claim more bytes than the batch carries.
    let calls = vec![BatchCall { request: env.push(0, 0, fingerprint), payload_len: 64 }];
    let message = refused(env.batch(calls, floats(&[1.0; 8])).await);
    assert!(message.contains("declare 64 payload bytes") && message.contains("carries 32"), "{message}");
    // Lengths whose sum overflows.
    let calls = vec![
        BatchCall { request: env.push(0, 0, fingerprint), payload_len: u64::MAX },
        BatchCall { request: env.push(1, 0, fingerprint), payload_len: 2 },
    ];
    let message = refused(env.batch(calls, floats(&[1.0; 8])).await);
    assert!(message.contains("more than 2^64"), "{message}");
    // A batch inside a batch.
    let inner = PsRequest::Batch { calls: Vec::new() };
    let calls = vec![
        BatchCall { request: env.push(0, 0, fingerprint), payload_len: 32 },
        BatchCall { request: inner, payload_len: 0 },
    ];
    let message = refused(env.batch(calls, floats(&[1.0; 8])).await);
    assert!(message.contains("call 1 of a batch is a batch"), "{message}");
    // Too many calls.
    let calls = (0..oar_pserver::protocol::MAX_BATCH_CALLS as u64 + 1)
        .map(|seq| BatchCall { request: env.push(0, seq, fingerprint), payload_len: 0 })
        .collect();
    let message = refused(env.batch(calls, Vec::new()).await);
    assert!(message.contains("at most 4096"), "{message}");

    // Nothing of the refused batches was applied (each carried a valid
    // push of shard 0 first), and the pserver serves on.
    let block = env.placement.blocks_on(0).next().unwrap().id;
    assert_eq!(env.pserver.block(block).unwrap(), vec![0.0; 8]);
    let mut trainer = env.client("t1");
    let mut grads = ParamBuf::zeros(&specs());
    grads.fill(1.0);
    assert_eq!(trainer.push(&grads, 1.0).await.unwrap(), PushResult::Accepted);
    assert_eq!(env.pserver.block(block).unwrap(), vec![-1.0; 8]);
}
