//! The async trainer's pipeline (`oar_trainer::worker`): tasks fetched
//! ahead, reports sent while the next task trains, exchanges with the
//! pservers overlapped with training. A whole job on QUIC over 127.0.0.1
//! (master, 2 pservers, trainers in one process), run through the role
//! functions so that every member's report can be checked against the
//! others': nothing pushed is lost or applied twice, and every task is
//! reported once.

use crate::support;

use oar::pserver::{ParamBuf, ParamSpec};
use oar::{
    discovery::MemDiscovery,
    job::{
        config::JobConfig,
        report::JobReport,
        role::{self, PserverReport, RoleOptions},
        JobContext,
    },
    pserver::{Mode, OptimizerConfig},
    trainer::{
        model::{Example, Model},
        worker::TrainerReport,
    },
    transport::{DevCa, QuicTransport},
};
use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio_util::sync::CancellationToken;

/// a1a in 8 KiB tasks (15 per pass), async.
fn config(push_every: u32) -> JobConfig {
    let mut config = support::a1a_softmax(Mode::Async);
    config.push_every = push_every;
    config.pull_every = push_every;
    config.passes = 4;
    config.batch_size = 16;
    config.optimizer = OptimizerConfig::Sgd { lr: 0.1 };
    config
}

const TASKS_PER_PASS: u64 = 15;

struct Outcome {
    job: JobReport,
    pservers: Vec<PserverReport>,
    trainers: Vec<TrainerReport>,
}

async fn run(config: JobConfig, trainers: usize, model: Option<Arc<dyn Model>>) -> Outcome {
    let transport =
        Arc::new(QuicTransport::new(DevCa::new().unwrap().tls_config("pipeline").unwrap()).unwrap());
    let mut ctx = JobContext::new("pipeline", Arc::new(MemDiscovery::new()), transport, "127.0.0.1:0");
    ctx.plugins.model = model;
    let pservers: Vec<_> = (0..config.pservers)
        .map(|i| {
            let ctx = ctx.clone();
            let options = RoleOptions::new(format!("pserver-{i}"));
            tokio::spawn(async move { role::pserver(&ctx, &options, CancellationToken::new()).await })
        })
        .collect();
    let trainer_tasks: Vec<_> = (0..trainers)
        .map(|i| {
            let ctx = ctx.clone();
            let options = RoleOptions::new(format!("trainer-{i}"));
            tokio::spawn(async move { role::trainer(&ctx, &options, CancellationToken::new()).await })
        })
        .collect();
    let options = RoleOptions::new("master");
    let master = role::master(&ctx, &config, &options, CancellationToken::new(), |_| {});
    let job = master.await.unwrap().expect("the job ends: nothing shuts it down");
    let mut outcome = Outcome { job, pservers: Vec::new(), trainers: Vec::new() };
    for p in pservers {
        outcome.pservers.push(p.await.unwrap().unwrap());
    }
    for t in trainer_tasks {
        outcome.trainers.push(t.await.unwrap().unwrap());
    }
    outcome
}

/// Run the job and check what must hold whatever the timing: the job is
/// done, every task of every pass was reported and accepted once, every
/// example trained on was pushed (the trainers push what they hold before
/// they stop), and every push reached both shards exactly once (an async
/// shard counts a step per whole push).
async fn run_and_check(config: JobConfig, trainers: usize, model: Option<Arc<dyn Model>>) -> Outcome {
    let tasks = u64::from(config.passes) * TASKS_PER_PASS;
    let placement = config.placement().unwrap();
    let o = run(config, trainers, model).await;
    assert!(o.job.is_done());
    assert_eq!(o.job.tasks_done, tasks);
    let finished: u64 = o.trainers.iter().map(|t| t.tasks_finished).sum();
    assert_eq!(finished, tasks, "every task reported and accepted once: {:?}", o.trainers);
    for t in &o.trainers {
        assert_eq!(t.tasks_failed, 0, "{t:?}");
        assert_eq!(t.pushed_examples, t.examples, "gradients left unpushed: {t:?}");
    }
    let pushed: u64 = o.trainers.iter().map(|t| t.pushes).sum();
    assert!(pushed > 0);
    let shards: Vec<u32> =
        (0..placement.servers()).filter(|&s| placement.blocks_on(s).next().is_some()).collect();
    for shard in shards {
        let steps: Vec<u64> = o.pservers.iter().filter_map(|p| p.primaries.get(&shard).copied()).collect();
        assert_eq!(
            steps,
            [pushed],
            "shard {shard}: one primary, which applied every push once: {:?}",
            o.pservers
        );
    }
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trainer_overlaps_its_exchanges_and_loses_no_push() {
    let o = run_and_check(config(1), 1, None).await;
    let t = &o.trainers[0];
    // A push due while one is in flight waits for it: pushes are never
    // merged, so with push-every 1 every batch is a push of its own.
    assert_eq!(t.pushes, t.batches, "{t:?}");
    assert!(o.job.test_accuracy >= 0.8, "it trains: {}", o.job.test_accuracy);
    // Async batches measure the age of the parameters they train on.
    let scrape = oar::metrics::encode();
    let ages = scrape.lines().find_map(|l| l.strip_prefix("oar_trainer_parameter_age_seconds_count "));
    let ages: f64 = ages.and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("{scrape}"));
    assert!(ages >= t.batches as f64, "{ages} ages for {} batches", t.batches);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_trainers_with_push_every_two_lose_no_push() {
    let o = run_and_check(config(2), 3, None).await;
    for t in &o.trainers {
        // Every 2 batches, or fewer at a task's end (its last gradients go
        // before its report): between ceil(batches / 2) and that plus a
        // push per task.
        assert!(t.pushes >= t.batches.div_ceil(2), "{t:?}");
        assert!(t.pushes <= t.batches.div_ceil(2) + t.tasks_finished, "{t:?}");
    }
}

/// Without overlap every exchange is waited for, and the cadences hold
/// exactly: push every 3 batches and pull every 2 (or at a task's end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_overlap_pushes_every_n_and_pulls_every_m() {
    let mut config = config(3);
    config.pull_every = 2;
    config.overlap = false;
    let o = run_and_check(config, 1, None).await;
    let t = &o.trainers[0];
    // A push per 3 batches, plus at most one per task for its remainder.
    assert!(t.pushes >= t.batches.div_ceil(3), "{t:?}");
    assert!(t.pushes <= t.batches / 3 + t.tasks_finished, "{t:?}");
    // A pull before the first batch and then per 2 batches: never more
    // often (a pull due at a task's end travels with its push), never less.
    assert!(t.pulls >= t.batches.div_ceil(2), "{t:?}");
    assert!(t.pulls <= t.batches / 2 + 1, "{t:?}");
    assert_eq!(t.stale_pulls, 0, "no staleness check without overlap: {t:?}");
}

/// The job's softmax model, but every `every`-th gradient blocks its thread
/// for `pause`: a trainer kept from running, as on a busy machine.
struct Stalling {
    inner: Box<dyn Model>,
    calls: AtomicU64,
    every: u64,
    pause: Duration,
}

impl Model for Stalling {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.inner.param_specs()
    }
    fn features(&self) -> usize {
        self.inner.features()
    }
    fn classes(&self) -> usize {
        self.inner.classes()
    }
    fn loss_and_grad(&self, params: &ParamBuf, batch: &[Example], grads: &mut ParamBuf) -> f32 {
        if (self.calls.fetch_add(1, Ordering::Relaxed) + 1) % self.every == 0 {
            std::thread::sleep(self.pause);
        }
        self.inner.loss_and_grad(params, batch, grads)
    }
    fn predict(&self, params: &ParamBuf, batch: &[Example], out: &mut Vec<u32>) -> f32 {
        self.inner.predict(params, batch, out)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_kept_from_running_pulls_before_training_on() {
    let config = config(1);
    let model = Stalling {
        inner: config.model.build().unwrap(),
        calls: AtomicU64::new(0),
        every: 100,
        pause: Duration::from_millis(200),
    };
    let o = run_and_check(config, 1, Some(Arc::new(model))).await;
    let t = &o.trainers[0];
    // About 4 pauses of 200 ms, each far longer than an exchange of this
    // model even on a loaded machine (the staleness bound is measured from
    // the exchanges: twice an exchange and two batches, a few ms idle,
    // tens of ms under load): the parameters pulled before one are stale
    // after it, unless
    // the pause was a task's last batch (the trainer then pushes and pulls
    // what it holds anyway), about one in seven. A trainer that also waits
    // at pass ends may count a few more.
    let pauses = t.batches / 100;
    eprintln!("{} stale pulls for {pauses} pauses of 200 ms in {} batches", t.stale_pulls, t.batches);
    assert!(t.stale_pulls * 2 >= pauses, "{} stale pulls for {pauses} pauses: {t:?}", t.stale_pulls);
    assert!(t.stale_pulls <= t.batches, "{t:?}");
    assert!(o.job.test_accuracy >= 0.8, "it trains: {}", o.job.test_accuracy);
}

/// A sparse model's batch is one round trip: the rows of the next batch
/// of a task come with the batch's push, so a trainer pulls rows on their
/// own only for each task's first batch. Sync and async, one trainer; the
/// pushes are counted on every shard as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_batch_takes_one_round_trip() {
    for mode in [Mode::Async, Mode::Sync] {
        let mut config = config(1);
        config.mode = mode;
        config.passes = 2;
        config.model = oar::trainer::ModelConfig::Ctr(oar::trainer::CtrModelConfig::Lr { crosses: false });
        config.optimizer = OptimizerConfig::AdaGrad { lr: 0.1, eps: 1e-10 };
        let (tasks, shards) = (u64::from(config.passes) * TASKS_PER_PASS, config.shards);
        let o = run(config, 1, None).await;
        assert!(o.job.is_done(), "{mode:?}");
        let t = &o.trainers[0];
        assert_eq!(t.tasks_finished, tasks, "{mode:?}: {t:?}");
        assert_eq!(t.pushes, t.batches, "{mode:?}: a push per batch: {t:?}");
        assert!(t.batches > 2 * tasks, "{mode:?}: several batches per task: {t:?}");
        assert_eq!(t.pulls, t.tasks_finished, "{mode:?}: a row pull per task, not per batch: {t:?}");
        for shard in 0..shards {
            let steps: Vec<u64> =
                o.pservers.iter().filter_map(|p| p.primaries.get(&shard).copied()).collect();
            assert_eq!(steps, [t.pushes], "{mode:?}: shard {shard} applied every push once");
        }
        eprintln!("{mode:?}: {} batches, {} row pulls, accuracy {}", t.batches, t.pulls, o.job.test_accuracy);
    }
}
