//! Sync SGD with K trainers on batches b_1..b_K gives the same parameters as
//! one process training every step on the union of that step's batches.
//!
//! K trainers run concurrently against 2 real pserver services (over the
//! in-process transport); each pushes the mean gradient of its own batch,
//! with batch sizes differing per trainer, so the pservers' combination
//! (weighted by examples, in trainer-id order) is what is under test. The
//! reference applies the same optimizer to the mean gradient of the union.
//!
//! The elastic run does the same while the job changes shape (trainers
//! 1 → 4 → 2, pservers 2 → 3 → 1), over QUIC and a real etcd.

use oar::{
    discovery::{Discovery, MemDiscovery},
    job::keys::JobKeys,
    pserver::{
        Coordinator, CoordinatorOptions, Mode, OptimizerConfig, ParamBuf, Placement, Pserver, PserverClient,
        PserverClientOptions, PserverOptions,
    },
    trainer::{
        model::{Example, Model},
        reader::{read_glob, Format, ReaderOptions},
        ModelConfig,
    },
    transport::{MemNetwork, MemTransport},
};
use std::{sync::Arc, time::Duration};

const K: usize = 3;
const STEPS: usize = 12;
const SEED: u64 = 11;

/// Trainer k's batch at step s: `16 + 8k` consecutive examples.
fn batch(data: &[Example], k: usize, s: usize) -> &[Example] {
    let sizes: Vec<usize> = (0..K).map(|k| 16 + 8 * k).collect();
    let per_step: usize = sizes.iter().sum();
    let start = (s * per_step + sizes[..k].iter().sum::<usize>()) % (data.len() - per_step);
    &data[start..start + sizes[k]]
}

fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    diff / norm.max(1e-12)
}

async fn check(model_config: ModelConfig, optimizer: OptimizerConfig) {
    let features = 123;
    let reader = ReaderOptions { format: Format::Libsvm, features, classes: 2, skip_bad_lines: false };
    let data = read_glob(&format!("{}/testdata/a1a", env!("CARGO_MANIFEST_DIR")), &reader).unwrap();
    let model: Arc<dyn Model> = model_config.build().unwrap().into();
    let specs = model.param_specs();
    let servers = 2;
    // Small blocks so every parameter is split across both servers.
    let block_size = 37;
    let placement = Arc::new(Placement::new(&specs, servers, block_size).unwrap());

    let discovery = Arc::new(MemDiscovery::new());
    let transport = Arc::new(MemTransport::new(MemNetwork::new()));
    let keys = JobKeys::new("equivalence").unwrap();
    // The shard map's writer, as the master runs it.
    let lease = discovery.grant_lease(Duration::from_secs(600)).await.unwrap();
    let fence =
        discovery.lock(&keys.master_lock(), b"test".to_vec(), lease, Duration::from_secs(5)).await.unwrap();
    let coordinator =
        CoordinatorOptions { keys: keys.pserver(), shards: servers, pservers: servers, ..Default::default() };
    let _coordinator =
        Coordinator::start(discovery.clone(), transport.clone(), fence, coordinator).await.unwrap();
    let mut pservers = Vec::new();
    for _ in 0..servers {
        let options = PserverOptions {
            keys: keys.pserver(),
            specs: specs.clone(),
            shards: servers,
            mode: Mode::Sync,
            optimizer: optimizer.clone(),
            block_size,
            seed: SEED,
            ..PserverOptions::default()
        };
        pservers.push(Pserver::start(discovery.clone(), transport.clone(), "mem:0", options).await.unwrap());
    }

    // Every trainer joins before anyone pushes, so every step has all K.
    let mut clients = Vec::new();
    for k in 0..K {
        let options = PserverClientOptions::new(keys.pserver(), format!("trainer-{k}"));
        let mut client = PserverClient::new(discovery.clone(), transport.clone(), placement.clone(), options);
        client.wait_for_servers(Duration::from_secs(5)).await.unwrap();
        client.join().await.unwrap();
        clients.push(client);
    }
    let data = Arc::new(data);
    let mut trainers = Vec::new();
    for (k, mut client) in clients.into_iter().enumerate() {
        let (model, data, specs) = (model.clone(), data.clone(), specs.clone());
        trainers.push(tokio::spawn(async move {
            let mut params = ParamBuf::zeros(&specs);
            let mut grads = ParamBuf::zeros(&specs);
            for s in 0..STEPS {
                client.pull(&mut params).await.unwrap();
                let b = batch(&data, k, s);
                model.loss_and_grad(&params, b, &mut grads);
                client.push(&grads, b.len() as f32).await.unwrap();
            }
            client.pull(&mut params).await.unwrap();
            params
        }));
    }
    let mut results = Vec::new();
    for t in trainers {
        results.push(t.await.unwrap());
    }

    // The reference: one process, each step on the union of the K batches.
    let opt = optimizer.build().unwrap();
    let mut params = ParamBuf::init(&specs, SEED);
    let mut grads = ParamBuf::zeros(&specs);
    let mut states: Vec<_> = (0..specs.len()).map(|i| opt.new_state(params.param(i).len())).collect();
    for s in 0..STEPS {
        let union: Vec<Example> = (0..K).flat_map(|k| batch(&data, k, s).to_vec()).collect();
        model.loss_and_grad(&params, &union, &mut grads);
        for (i, state) in states.iter_mut().enumerate() {
            opt.apply(params.param_mut(i), grads.param(i), state);
        }
    }

    for (k, got) in results.iter().enumerate() {
        let err = relative_error(got.as_slice(), params.as_slice());
        eprintln!("trainer {k}: relative error {err:e}");
        assert!(err < 1e-5, "trainer {k}: relative error {err} against the single-process reference");
    }
    assert!(
        relative_error(ParamBuf::init(&specs, SEED).as_slice(), params.as_slice()) > 1e-3,
        "the parameters must actually have moved for the comparison to mean something"
    );
    for shard in 0..servers {
        let steps: Vec<u64> = pservers.iter().filter_map(|p| p.step(shard)).collect();
        assert_eq!(steps, [STEPS as u64], "one combined update per step on shard {shard}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_softmax_with_momentum_matches_one_process_on_the_union() {
    check(
        ModelConfig::Softmax { features: 123, classes: 2 },
        OptimizerConfig::Momentum { lr: 0.3, momentum: 0.9 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_mlp_with_adam_matches_one_process_on_the_union() {
    check(
        ModelConfig::Mlp { features: 123, hidden: 16, classes: 2 },
        OptimizerConfig::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
    )
    .await;
}

/// Trainer `k`'s batch at step `s` in the elastic run: `12 + 4k` examples.
#[cfg(feature = "etcd")]
fn elastic_batch(data: &[Example], k: usize, s: usize) -> &[Example] {
    let len = 12 + 4 * k;
    let start = (s * 97 + k * 31) % (data.len() - len);
    &data[start..start + len]
}

/// The trainers present at each phase of the elastic run, and its steps.
#[cfg(feature = "etcd")]
const PHASES: [(&[usize], std::ops::Range<usize>); 3] =
    [(&[0], 0..4), (&[0, 1, 2, 3], 4..60), (&[0, 2], 60..150)];

/// Whether trainer `k` takes part in phase `p`'s start: it trains in it,
/// or leaves at it.
#[cfg(feature = "etcd")]
fn involved(p: usize, k: usize) -> bool {
    PHASES[p].0.contains(&k) || (p > 0 && PHASES[p - 1].0.contains(&k))
}

/// Sync mode while the job changes shape: trainers 1 → 4 → 2 (joining and
/// leaving between steps) and pservers 2 → 3 → 1 (shards moving while
/// steps run), over QUIC and a real etcd. The parameters equal one process
/// applying, step by step, the mean gradient over the union of the batches
/// of the trainers present at that step: the combine rule, unchanged by
/// the moves.
#[cfg(feature = "etcd")]
async fn elastic(replicas: u32) {
    use oar::{
        discovery::{EtcdDiscovery, EtcdServer},
        pserver::PushResult,
        transport::{DevCa, QuicTransport, Transport},
    };
    let reader = ReaderOptions { format: Format::Libsvm, features: 123, classes: 2, skip_bad_lines: false };
    let data = read_glob(&format!("{}/testdata/a1a", env!("CARGO_MANIFEST_DIR")), &reader).unwrap();
    let model: Arc<dyn Model> = ModelConfig::Softmax { features: 123, classes: 2 }.build().unwrap().into();
    let optimizer = OptimizerConfig::Adam { lr: 0.05, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
    let specs = model.param_specs();
    let (shards, block_size) = (8, 16);
    let placement = Arc::new(Placement::new(&specs, shards, block_size).unwrap());

    let etcd = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd for the test: {e}"));
    let discovery: Arc<dyn Discovery> = Arc::new(EtcdDiscovery::connect(&[etcd.endpoint()]).await.unwrap());
    let tls = DevCa::new().unwrap().tls_config("elastic").unwrap();
    let transport: Arc<dyn Transport> = Arc::new(QuicTransport::new(tls).unwrap());
    let keys = JobKeys::new("elastic-equivalence").unwrap();
    let lease = discovery.grant_lease(Duration::from_secs(600)).await.unwrap();
    let fence =
        discovery.lock(&keys.master_lock(), b"test".to_vec(), lease, Duration::from_secs(5)).await.unwrap();
    let coordinator =
        CoordinatorOptions { keys: keys.pserver(), shards, replicas, pservers: 2, ..Default::default() };
    let _coordinator =
        Coordinator::start(discovery.clone(), transport.clone(), fence, coordinator).await.unwrap();
    let start_pserver = || {
        let options = PserverOptions {
            keys: keys.pserver(),
            specs: specs.clone(),
            shards,
            mode: Mode::Sync,
            optimizer: optimizer.clone(),
            block_size,
            seed: SEED,
            ..PserverOptions::default()
        };
        Pserver::start(discovery.clone(), transport.clone(), "127.0.0.1:0", options)
    };
    let mut pservers = vec![start_pserver().await.unwrap(), start_pserver().await.unwrap()];

    // One task per trainer; a phase starts once every trainer of the one
    // before has finished it (its last push returned: that step is complete
    // on every shard), so joins and leaves fall between steps.
    let data = Arc::new(data);
    let phase_done: Vec<Arc<tokio::sync::Barrier>> =
        PHASES.iter().map(|(present, _)| Arc::new(tokio::sync::Barrier::new(present.len() + 1))).collect();
    let phase_start: Vec<Arc<tokio::sync::Barrier>> = (0..PHASES.len())
        .map(|p| Arc::new(tokio::sync::Barrier::new((0..4).filter(|&k| involved(p, k)).count() + 1)))
        .collect();
    // The phase whose trainers may join: the one before has finished.
    let (between, between_rx) = tokio::sync::watch::channel(0usize);
    let mut trainers = Vec::new();
    for k in 0..4 {
        let (model, data, specs) = (model.clone(), data.clone(), specs.clone());
        let mut between = between_rx.clone();
        let (phase_done, phase_start) = (phase_done.clone(), phase_start.clone());
        let options = PserverClientOptions::new(keys.pserver(), format!("trainer-{k}"));
        let mut client = PserverClient::new(discovery.clone(), transport.clone(), placement.clone(), options);
        // Registered as a job's trainers are: a new primary keeps only
        // registered trainers in its barrier.
        let (discovery, registration) = (discovery.clone(), keys.trainer(&format!("trainer-{k}")));
        trainers.push(tokio::spawn(async move {
            let mut params = ParamBuf::zeros(&specs);
            let mut grads = ParamBuf::zeros(&specs);
            let mut joined = false;
            for (p, (present, steps)) in PHASES.iter().enumerate() {
                let here = present.contains(&k);
                if !involved(p, k) {
                    continue;
                }
                // A newcomer joins before the phase starts, while no step is
                // under way: it counts from the phase's first step.
                if here && !joined {
                    between.wait_for(|&q| q >= p).await.unwrap();
                    discovery.put(&registration, Vec::new(), None).await.unwrap();
                    client.wait_for_servers(Duration::from_secs(10)).await.unwrap();
                    client.join().await.unwrap();
                    joined = true;
                }
                phase_start[p].wait().await;
                if !here {
                    client.leave().await.unwrap();
                    discovery.delete(&registration).await.unwrap();
                    return None;
                }
                for s in steps.clone() {
                    client.pull(&mut params).await.unwrap();
                    let b = elastic_batch(&data, k, s);
                    model.loss_and_grad(&params, b, &mut grads);
                    let pushed = client
                        .push(&grads, b.len() as f32)
                        .await
                        .unwrap_or_else(|e| panic!("trainer {k}, step {s}: {e}"));
                    assert_eq!(pushed, PushResult::Accepted, "trainer {k}, step {s}");
                }
                phase_done[p].wait().await;
            }
            client.pull(&mut params).await.unwrap();
            Some(params)
        }));
    }
    let ps_keys = keys.pserver();
    let set_pservers = |count| oar::pserver::set_pservers(&*discovery, &ps_keys, count, Default::default());
    for p in 0..PHASES.len() {
        phase_start[p].wait().await;
        match p {
            // Pservers 2 → 3 while phase 1's steps run.
            1 => {
                set_pservers(3).await.unwrap();
                pservers.push(start_pserver().await.unwrap());
            }
            // 3 → 1 while phase 2's steps run, once the scale-out is over.
            2 => {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                while let Err(e) = set_pservers(1).await {
                    assert!(tokio::time::Instant::now() < deadline, "{e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            _ => {}
        }
        phase_done[p].wait().await;
        between.send_replace(p + 1);
    }
    let mut results = Vec::new();
    for t in trainers {
        results.extend(t.await.unwrap());
    }
    let released = pservers.iter().filter(|p| p.released()).count();
    let map = pservers.iter().map(|p| p.map_version()).max().unwrap_or(0);
    eprintln!("R={replicas}: map version {map} at the end, {released} pservers released by then");

    // The reference: one process, each step on the union of the present trainers' batches.
    let opt = optimizer.build().unwrap();
    let mut params = ParamBuf::init(&specs, SEED);
    let mut grads = ParamBuf::zeros(&specs);
    let mut states: Vec<_> = (0..specs.len()).map(|i| opt.new_state(params.param(i).len())).collect();
    for (present, steps) in PHASES.iter() {
        for s in steps.clone() {
            let union: Vec<Example> =
                present.iter().flat_map(|&k| elastic_batch(&data, k, s).to_vec()).collect();
            model.loss_and_grad(&params, &union, &mut grads);
            for (i, state) in states.iter_mut().enumerate() {
                opt.apply(params.param_mut(i), grads.param(i), state);
            }
        }
    }
    assert_eq!(results.len(), 2, "trainers 0 and 2 train to the end");
    for got in &results {
        let err = relative_error(got.as_slice(), params.as_slice());
        eprintln!("R={replicas}: relative error {err:e}");
        assert!(err < 1e-5, "relative error {err} against the single-process reference");
    }
    assert!(relative_error(ParamBuf::init(&specs, SEED).as_slice(), params.as_slice()) > 1e-3);
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_steps_match_one_process_while_trainers_join_and_leave_and_shards_move() {
    elastic(1).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_steps_match_one_process_while_trainers_and_replicated_shards_move() {
    elastic(2).await;
}
