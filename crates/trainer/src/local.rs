//! A whole job in one process: a master, P pservers and T trainers on an
//! in-memory discovery, talking over a transport the caller picks. This is
//! what `examples/local.rs` runs, and what the integration tests train with.
//!
//! The final model is scored on the training and held-out data, read whole
//! (bad lines skipped there; training reports them through its tasks).
//! Evaluation happens here, not on a trainer: after each pass the runner
//! pulls the parameters like any client and scores them on the held-out
//! data. Trainers keep training meanwhile, so the parameters scored at the
//! end of pass p may already include a few updates of pass p+1.

use crate::{
    eval::{evaluate, Evaluation},
    job::JobConfig,
    model::{Example, Model},
    reader::{read_glob, ReaderOptions},
    worker::{run_trainer, TrainerOptions, TrainerReport},
    Error, Result,
};
use oar_discovery::{Discovery, JobKeys};
use oar_pserver::{ParamBuf, Pserver, PserverClient, PserverOptions};
use oar_task_queue::{chunks_from_glob, tasks_from_chunks, JobState, Master, MasterOptions, MasterStatus};
use oar_transport::{RetryPolicy, Transport};
use serde::Serialize;
use std::{sync::Arc, time::Duration};

/// Progress at the end of one pass.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PassReport {
    /// The pass that ended (0-based).
    pub pass: u32,
    /// Mean training loss the trainers measured during the pass.
    pub train_loss: f64,
    /// Loss on the held-out data after the pass.
    pub test_loss: f32,
    /// Accuracy on the held-out data after the pass.
    pub test_accuracy: f32,
    /// Tasks finished in the pass.
    pub tasks_done: u64,
    /// Tasks discarded so far.
    pub tasks_discarded: usize,
}

/// The result of a whole job: the final JSON line of `examples/local.rs`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobReport {
    /// "done" or "failed".
    pub state: String,
    /// Passes completed.
    pub passes: u32,
    /// Mean training loss of the last pass.
    pub final_loss: f64,
    /// Accuracy of the final model on the training data.
    pub train_accuracy: f32,
    /// Accuracy of the final model on the held-out data.
    pub test_accuracy: f32,
    /// Examples trained on per second of training, over all trainers.
    pub examples_per_second: f64,
    /// Tasks finished, summed over passes.
    pub tasks_done: u64,
    /// Task failures (timeouts, failed reports, trainers gone).
    pub tasks_failed: u64,
    /// Tasks discarded.
    pub tasks_discarded: usize,
    /// Why each discarded task was discarded: (task id, reason).
    pub discarded: Vec<(u64, String)>,
    /// Bad lines skipped (with `skip_bad_lines`).
    pub skipped_lines: u64,
    /// Wall-clock seconds from start to end.
    pub wall_seconds: f64,
}

/// Run `config` as one process: `trainers` trainers, `config.pservers`
/// pservers and a master on `discovery` and `transport`, listening at
/// `listen` addresses of that transport (`"mem:0"`, `"127.0.0.1:0"`).
/// `on_pass` sees each pass's progress.
pub async fn run_local(
    config: &JobConfig,
    trainers: u32,
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    listen: &str,
    mut on_pass: impl FnMut(&PassReport),
) -> Result<JobReport> {
    config.validate()?;
    if trainers == 0 {
        return Err(Error::BadConfig("trainers must be at least 1".into()));
    }
    let started = std::time::Instant::now();
    let job = "local";
    let keys = JobKeys::new(job)?;
    let model: Arc<dyn Model> = config.model.build()?.into();
    let placement = Arc::new(config.placement()?);
    let reader = config.reader();
    // Scoring skips bad lines; training reports them through its tasks.
    let scoring = ReaderOptions { skip_bad_lines: true, ..reader.clone() };
    let train_set = read_glob(&config.data, &scoring)?;
    let test_set = match &config.test_data {
        Some(glob) => read_glob(glob, &scoring)?,
        None => train_set.clone(),
    };
    let tasks =
        tasks_from_chunks(chunks_from_glob(&config.data, config.chunk_bytes)?, config.chunks_per_task)?;

    discovery.put(&keys.ps_desired(), config.pservers.to_string().into_bytes(), None).await?;
    let mut master_options = MasterOptions::new(job, config.queue());
    master_options.config = Some(config.encode()?);
    let master = Master::start(discovery.clone(), transport.clone(), listen, tasks, master_options).await?;

    let mut pservers = Vec::new();
    for _ in 0..config.pservers {
        let mut options = PserverOptions::new(
            job,
            model.param_specs(),
            config.pservers,
            config.mode,
            config.optimizer.clone(),
        );
        options.block_size = config.block_size;
        options.seed = config.seed;
        pservers.push(Pserver::start(discovery.clone(), transport.clone(), listen, options).await?);
    }

    let retry = RetryPolicy { give_up_after: Duration::from_secs(30), ..RetryPolicy::default() };
    let mut trainer_tasks = tokio::task::JoinSet::new();
    for t in 0..trainers {
        let options = TrainerOptions {
            id: format!("trainer-{t:03}"),
            job: job.to_string(),
            batch_size: config.batch_size,
            mode: config.mode,
            push_every: config.push_every,
            pull_every: config.pull_every,
            reader: reader.clone(),
            lease_ttl: Duration::from_secs(5),
            call_timeout: Duration::from_secs(10),
            retry,
            servers_timeout: Duration::from_secs(30),
        };
        trainer_tasks.spawn(run_trainer(
            discovery.clone(),
            transport.clone(),
            model.clone(),
            placement.clone(),
            options,
        ));
    }

    let mut evaluator = PserverClient::new(
        discovery.clone(),
        transport.clone(),
        job,
        placement.clone(),
        "evaluator",
        Duration::from_secs(10),
        retry,
    )?;
    let mut params = ParamBuf::zeros(&model.param_specs());

    // Report each pass as it ends, until the job ends or a trainer fails.
    let mut status = master.status();
    let mut reported = 0u32;
    let mut trainer_reports = Vec::new();
    let state = loop {
        let current = status.borrow_and_update().clone();
        let ended = if current.is_finished() { current.queue.pass + 1 } else { current.queue.pass };
        while reported < ended.min(config.passes) {
            let eval = score(&mut evaluator, &mut params, &*model, &test_set).await?;
            on_pass(&pass_report(reported, &current, &eval));
            reported += 1;
        }
        if current.is_finished() {
            break master.wait().await?;
        }
        tokio::select! {
            changed = status.changed() => {
                if changed.is_err() {
                    break master.wait().await?;
                }
            }
            Some(joined) = trainer_tasks.join_next() => {
                trainer_reports.push(joined.map_err(|e| Error::Panicked(format!("a trainer: {e}")))??);
            }
        }
    };
    while let Some(joined) = trainer_tasks.join_next().await {
        trainer_reports.push(joined.map_err(|e| Error::Panicked(format!("a trainer: {e}")))??);
    }
    let training_seconds = started.elapsed().as_secs_f64();

    let test = score(&mut evaluator, &mut params, &*model, &test_set).await?;
    let train = evaluate(&*model, &params, &train_set, 1024);
    let last = master.status().borrow().clone();
    let report = JobReport {
        state: if state == JobState::Done { "done".into() } else { "failed".into() },
        passes: last.passes.iter().filter(|p| p.tasks_finished > 0).count() as u32,
        final_loss: last.passes.last().map(|p| p.mean_loss()).unwrap_or(f64::NAN),
        train_accuracy: train.accuracy,
        test_accuracy: test.accuracy,
        examples_per_second: trainer_reports.iter().map(|r: &TrainerReport| r.examples).sum::<u64>() as f64
            / training_seconds,
        tasks_done: last.passes.iter().map(|p| p.tasks_finished).sum(),
        tasks_failed: last.queue.failures,
        tasks_discarded: last.queue.discarded,
        discarded: last.discarded.clone(),
        skipped_lines: trainer_reports.iter().map(|r| r.skipped_lines).sum(),
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    master.shutdown().await?;
    for pserver in pservers {
        pserver.shutdown().await?;
    }
    Ok(report)
}

async fn score(
    client: &mut PserverClient,
    params: &mut ParamBuf,
    model: &dyn Model,
    examples: &[Example],
) -> Result<Evaluation> {
    client.pull(params).await?;
    Ok(evaluate(model, params, examples, 1024))
}

fn pass_report(pass: u32, status: &MasterStatus, eval: &Evaluation) -> PassReport {
    let stats = status.passes.get(pass as usize).copied().unwrap_or_default();
    PassReport {
        pass,
        train_loss: stats.mean_loss(),
        test_loss: eval.loss,
        test_accuracy: eval.accuracy,
        tasks_done: stats.tasks_finished,
        tasks_discarded: status.queue.discarded,
    }
}
