//! The three roles of a job (master, pserver, trainer) as functions a
//! binary calls; `examples/master.rs`, `examples/pserver.rs` and
//! `examples/trainer.rs` are thin wrappers around them, and
//! [`run_local`](crate::local::run_local) runs all three in one process.
//!
//! The job's options ([`JobConfig`]) are given to the master only. It
//! publishes them under `/oar/<job>/config` (through `Master::start`, after
//! taking the lock) and pservers and trainers read them from there
//! ([`read_config`]), so their command lines carry nothing about the model.
//! A master given options that differ from the published ones refuses to
//! start, naming the options that differ.
//!
//! How a job ends: trainers stop when the master answers `Done` (or
//! `Failed`); the master scores the final model, writes the job's report
//! (JSON) under `/oar/<job>/result` through its fence, waits a little for the
//! trainers to deregister ([`RoleOptions::linger`]) and returns; pservers
//! poll `result`, write a last checkpoint and return. A master that starts
//! (or takes over) after the report was written returns that report.
//!
//! Each role runs in a `tracing` span named after it, with the job and the
//! process's id; a trainer's work on a task is in a `task` span (task id,
//! pass), so every log line says where it comes from.
//!
//! The master scores the model on the held-out data at the end of each pass
//! by pulling the parameters like any client. Trainers keep training
//! meanwhile, so the parameters scored at the end of pass p may already
//! include a few updates of pass p+1. The final report's train accuracy is
//! measured on the training data if it holds at most [`TRAIN_SAMPLE_BYTES`],
//! else on an evenly spread sample of that size ([`read_sample`]), so the
//! master's memory does not grow with the dataset.

use crate::{
    eval::{evaluate, Evaluation},
    job::JobConfig,
    model::{Example, Model},
    reader::{read_glob, read_sample, ReaderOptions},
    worker::{run_trainer, Background, TrainerOptions, TrainerReport},
    Error, Result,
};
use oar_discovery::{ChangeSignal, Discovery, JobKeys};
use oar_pserver::{OptimizerFactory, ParamBuf, Placement, Pserver, PserverClient, PserverOptions};
use oar_task_queue::{
    auto_chunk_bytes, chunk_files, glob_files, tasks_from_chunks, JobState, Master, MasterOptions,
    MasterStatus,
};
use oar_transport::{RetryPolicy, Transport};
use serde::{Deserialize, Serialize};
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};
use tracing::Instrument;

/// User-defined parts that replace the built-in ones the job's options
/// name, without any change to oar. Every process of a job must be given the
/// same ones (the model decides the parameters, which the placement's
/// fingerprint checks).
#[derive(Clone, Default)]
pub struct Plugins {
    /// Replaces the model of [`JobConfig::model`] on every role: trainers
    /// train it, pservers hold its parameters, the master scores it.
    /// `JobConfig::model` still gives the data's features and classes to the
    /// readers.
    pub model: Option<Arc<dyn Model>>,
    /// Replaces [`JobConfig::optimizer`] on the pservers.
    pub optimizer: Option<OptimizerFactory>,
}

/// Where a role runs: the job, its discovery, the transport, and the
/// address to listen at (`"127.0.0.1:0"` picks a free port; `"mem:0"` for
/// the in-process transport).
#[derive(Clone)]
pub struct JobContext {
    /// The job's name: its keys live under `/oar/<job>/`.
    pub job: String,
    /// Where the processes of the job find each other.
    pub discovery: Arc<dyn Discovery>,
    /// How they talk.
    pub transport: Arc<dyn Transport>,
    /// The address this role serves at (the master and pservers).
    pub listen: String,
    /// User-defined parts, if any.
    pub plugins: Plugins,
}

impl JobContext {
    /// A context with no plugins.
    pub fn new(
        job: impl Into<String>,
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        listen: impl Into<String>,
    ) -> Self {
        Self { job: job.into(), discovery, transport, listen: listen.into(), plugins: Plugins::default() }
    }

    /// The job's model: the plugin's, or the one `config` names.
    fn model(&self, config: &JobConfig) -> Result<Arc<dyn Model>> {
        match &self.plugins.model {
            Some(model) => Ok(model.clone()),
            None => Ok(config.model.build()?.into()),
        }
    }
}

/// Where each block of `model` lives: the same on every process.
fn placement(model: &dyn Model, config: &JobConfig) -> Result<Arc<Placement>> {
    Ok(Arc::new(Placement::new(&model.param_specs(), config.pservers, config.block_size)?))
}

/// Timing and local options of a role; each role reads the fields it needs.
#[derive(Clone, Debug)]
pub struct RoleOptions {
    /// This process's id: the master's lock holder, or the trainer's
    /// registration `trainer/<id>` (trainer ids also order the sync
    /// combination). Non-empty, without `/` or whitespace.
    pub id: String,
    /// The role's lease: when it expires (the process died or lost etcd)
    /// the job takes back what it held.
    pub lease_ttl: Duration,
    /// Bound of one call to the master or a pserver.
    pub call_timeout: Duration,
    /// How long a master or pserver that is away is retried before the
    /// caller gives up with an error (trainers pause their updates meanwhile).
    pub retry_for: Duration,
    /// How long to wait at start for the job's config, a free pserver
    /// index, a trainer id held by a dead process, or all pservers to be up.
    pub startup_timeout: Duration,
    /// How long a standby master waits for the lock.
    pub standby_timeout: Duration,
    /// Master: how long to wait after the job ends for the trainers to
    /// deregister, so that none is left asking a master that is gone.
    pub linger: Duration,
    /// Pserver: where checkpoints go (`<dir>/ps-<index>/`); none: no checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// Pserver: how often a checkpoint is written. A crash loses at most
    /// the updates of one interval.
    pub checkpoint_interval: Duration,
    /// Pserver: how often it looks whether the job ended.
    pub poll_interval: Duration,
    /// Pserver: claim exactly this shard index instead of the lowest free one
    /// (for pservers with a checkpoint volume each, such as StatefulSet pods).
    pub pserver_index: Option<u32>,
}

impl RoleOptions {
    /// Defaults for a process called `id`: 5 s leases, 10 s calls, members
    /// that are away retried for 5 minutes, 60 s to start, a standby that
    /// waits a day, checkpoints every 60 s when a directory is given.
    pub fn new(id: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            lease_ttl: Duration::from_secs(5),
            call_timeout: Duration::from_secs(10),
            retry_for: Duration::from_secs(300),
            startup_timeout: Duration::from_secs(60),
            standby_timeout: Duration::from_secs(24 * 3600),
            linger: Duration::from_secs(10),
            checkpoint_dir: None,
            checkpoint_interval: Duration::from_secs(60),
            poll_interval: Duration::from_millis(250),
            pserver_index: None,
        }
    }

    fn retry(&self) -> RetryPolicy {
        RetryPolicy { give_up_after: self.retry_for, ..RetryPolicy::default() }
    }
}

/// A default id for a process of role `role` on this machine:
/// `<role>-<hostname>-<pid>`.
pub fn default_id(role: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().replace(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'), "-"))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_string());
    format!("{role}-{host}-{}", std::process::id())
}

/// Progress at the end of one pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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

/// The result of a whole job: the final JSON line of the examples, and the
/// value of `/oar/<job>/result`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobReport {
    /// "done" or "failed".
    pub state: String,
    /// Passes completed.
    pub passes: u32,
    /// Mean training loss of the last pass.
    pub final_loss: f64,
    /// Accuracy of the final model on the training data (on an evenly
    /// spread sample of [`TRAIN_SAMPLE_BYTES`] if the data is larger).
    pub train_accuracy: f32,
    /// Accuracy of the final model on the held-out data.
    pub test_accuracy: f32,
    /// Examples trained on per second, over all trainers, while this master
    /// served (a master that took over counts from its start).
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
    /// Seconds from this master's start to the end.
    pub wall_seconds: f64,
}

impl JobReport {
    /// Whether the job finished well.
    pub fn is_done(&self) -> bool {
        self.state == "done"
    }
}

/// Wait up to `timeout` for the job's options under `/oar/<job>/config`.
pub async fn read_config(discovery: &dyn Discovery, job: &str, timeout: Duration) -> Result<JobConfig> {
    let key = JobKeys::new(job)?.config();
    let deadline = tokio::time::Instant::now() + timeout;
    let mut changed = ChangeSignal::new(discovery, &key).await;
    loop {
        if let Some(kv) = discovery.get(&key).await? {
            return JobConfig::decode(&kv.value);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!("the job's options at {key} (is a master running?)"),
                after: timeout,
            });
        }
        changed.wait(Duration::from_millis(100)).await;
    }
}

/// The most training data the master reads to score the final model's
/// train accuracy (and, without held-out data, each pass): above it, an
/// evenly spread sample of this size.
pub const TRAIN_SAMPLE_BYTES: u64 = 64 << 20;

/// The job's final report, if the master wrote it.
pub async fn read_result(discovery: &dyn Discovery, job: &str) -> Result<Option<JobReport>> {
    let key = JobKeys::new(job)?.result();
    match discovery.get(&key).await? {
        None => Ok(None),
        Some(kv) => serde_json::from_slice(&kv.value)
            .map(Some)
            .map_err(|e| Error::BadConfig(format!("{key} holds no job report: {e}"))),
    }
}

/// Run the master of a job with options `config`: take the lock (waiting as
/// a standby while another master holds it), publish the options, serve the
/// task queue, score the model after each pass (`on_pass`), and when the job
/// ends write and return its report. Errors if the master loses its lock or
/// lease (it stops serving first).
pub async fn master(
    ctx: &JobContext,
    config: &JobConfig,
    options: &RoleOptions,
    on_pass: impl FnMut(&PassReport),
) -> Result<JobReport> {
    let span = tracing::info_span!("master", job = %ctx.job, id = %options.id);
    run_master(ctx, config, options, on_pass).instrument(span).await
}

async fn run_master(
    ctx: &JobContext,
    config: &JobConfig,
    options: &RoleOptions,
    mut on_pass: impl FnMut(&PassReport),
) -> Result<JobReport> {
    config.validate()?;
    let started = Instant::now();
    let keys = JobKeys::new(&ctx.job)?;
    if let Some(kv) = ctx.discovery.get(&keys.config()).await? {
        let published = JobConfig::decode(&kv.value)?;
        let differ = published.differences(config);
        if !differ.is_empty() {
            return Err(Error::BadConfig(format!(
                "job {:?} was started with other options ({}); give the same options, or use a new job name",
                ctx.job,
                differ.join(", ")
            )));
        }
    }
    let model = ctx.model(config)?;
    let placement = placement(&*model, config)?;
    // Scoring skips bad lines; training reports them through its tasks.
    let scoring = ReaderOptions { skip_bad_lines: true, ..config.reader() };
    // The training set is read for the final report's train accuracy only
    // (unless it is also the test set): read it while the job trains, not
    // before the master serves, and a sample of it only if it is large.
    let train_read = Background::from({
        let (data, scoring) = (config.data.clone(), scoring.clone());
        tokio::task::spawn_blocking(move || read_sample(&data, &scoring, TRAIN_SAMPLE_BYTES))
    });
    let (test_set, train_read) = match &config.test_data {
        Some(glob) => (read_glob(glob, &scoring)?, Some(train_read)),
        None => (train_read.join().await??, None),
    };
    let files = glob_files(&config.data)?;
    let chunk_bytes = match config.chunk_bytes {
        0 => auto_chunk_bytes(files.iter().map(|(_, len)| len).sum()),
        bytes => bytes,
    };
    let tasks = tasks_from_chunks(chunk_files(&files, chunk_bytes)?, config.chunks_per_task)?;
    tracing::info!(chunk_bytes, tasks = tasks.len(), "tasks cut");

    let mut master_options = MasterOptions::new(&ctx.job, config.queue());
    master_options.holder = options.id.clone();
    master_options.lease_ttl = options.lease_ttl;
    master_options.lock_timeout = options.standby_timeout;
    master_options.config = Some(config.encode()?);
    let master =
        Master::start(ctx.discovery.clone(), ctx.transport.clone(), &ctx.listen, tasks, master_options)
            .await?;
    ctx.discovery.put(&keys.ps_desired(), config.pservers.to_string().into_bytes(), None).await?;
    if let Some(report) = read_result(&*ctx.discovery, &ctx.job).await? {
        tracing::info!(state = report.state, "the job had ended before this master started");
        master.shutdown().await?;
        return Ok(report);
    }

    let mut evaluator = PserverClient::new(
        ctx.discovery.clone(),
        ctx.transport.clone(),
        &ctx.job,
        placement,
        &format!("{}-evaluator", options.id),
        options.call_timeout,
        options.retry(),
    )?;
    let mut params = ParamBuf::zeros(&model.param_specs());

    // Report each pass as it ends, until the job ends or the master stops.
    let mut status = master.status();
    let mut reported = status.borrow().queue.pass;
    let state = {
        let ended = master.wait();
        tokio::pin!(ended);
        let mut over = false;
        loop {
            let current = status.borrow_and_update().clone();
            let passes_over = if current.is_finished() { current.queue.pass + 1 } else { current.queue.pass };
            while reported < passes_over.min(config.passes) {
                let eval = score(&mut evaluator, &mut params, &*model, &test_set).await?;
                on_pass(&pass_report(reported, &current, &eval));
                reported += 1;
            }
            if over || current.is_finished() {
                // Returns at once now: the end is stored, or the master stopped.
                break master.wait().await?;
            }
            tokio::select! {
                state = &mut ended => {
                    state?;
                    over = true;
                }
                changed = status.changed() => over = changed.is_err(),
            }
        }
    };
    let last = master.status().borrow().clone();
    let training_seconds = started.elapsed().as_secs_f64();

    let test = score(&mut evaluator, &mut params, &*model, &test_set).await?;
    let train = match train_read {
        Some(read) => evaluate(&*model, &params, &read.join().await??, 1024),
        None => evaluate(&*model, &params, &test_set, 1024),
    };
    let report = JobReport {
        state: if state == JobState::Done { "done".into() } else { "failed".into() },
        passes: last.passes.iter().filter(|p| p.tasks_finished > 0).count() as u32,
        final_loss: last.passes.last().map(|p| p.mean_loss()).unwrap_or(f64::NAN),
        train_accuracy: train.accuracy,
        test_accuracy: test.accuracy,
        examples_per_second: last.passes.iter().map(|p| p.examples).sum::<u64>() as f64 / training_seconds,
        tasks_done: last.passes.iter().map(|p| p.tasks_finished).sum(),
        tasks_failed: last.queue.failures,
        tasks_discarded: last.queue.discarded,
        discarded: last.discarded.clone(),
        skipped_lines: last.passes.iter().map(|p| p.skipped_lines).sum(),
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    let json =
        serde_json::to_vec(&report).map_err(|e| Error::Panicked(format!("encoding the job report: {e}")))?;
    master.put_fenced(&keys.result(), json).await?;
    tracing::info!(state = report.state, "job report written");

    // Keep answering `Done` until the trainers are gone, for a while.
    let deadline = tokio::time::Instant::now() + options.linger;
    let mut changed = ChangeSignal::new(&*ctx.discovery, &keys.trainers()).await;
    while tokio::time::Instant::now() < deadline
        && !ctx.discovery.get_prefix(&keys.trainers()).await?.kvs.is_empty()
    {
        changed.wait(Duration::from_millis(100)).await;
    }
    master.shutdown().await?;
    Ok(report)
}

/// What a pserver did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PserverReport {
    /// The shard index it served.
    pub index: u32,
    /// Updates applied to its shard.
    pub steps: u64,
}

/// Run a pserver of the job: read the job's options, claim the lowest free
/// index, load its checkpoint, serve until the job's report appears, write a
/// last checkpoint. Errors if the pserver loses its lease (it stops serving).
pub async fn pserver(ctx: &JobContext, options: &RoleOptions) -> Result<PserverReport> {
    let span = tracing::info_span!("pserver", job = %ctx.job, id = %options.id);
    run_pserver(ctx, options).instrument(span).await
}

async fn run_pserver(ctx: &JobContext, options: &RoleOptions) -> Result<PserverReport> {
    let config = read_config(&*ctx.discovery, &ctx.job, options.startup_timeout).await?;
    let model = ctx.model(&config)?;
    let mut ps_options =
        PserverOptions::new(&ctx.job, model.param_specs(), config.pservers, config.mode, config.optimizer);
    ps_options.custom_optimizer = ctx.plugins.optimizer.clone();
    ps_options.block_size = config.block_size;
    ps_options.seed = config.seed;
    ps_options.lease_ttl = options.lease_ttl;
    ps_options.claim_timeout = options.startup_timeout;
    ps_options.checkpoint_dir = options.checkpoint_dir.clone();
    ps_options.checkpoint_interval = options.checkpoint_interval;
    ps_options.index = options.pserver_index;
    let server =
        Pserver::start(ctx.discovery.clone(), ctx.transport.clone(), &ctx.listen, ps_options).await?;
    let index = server.index();
    let mut changed = ChangeSignal::new(&*ctx.discovery, &JobKeys::new(&ctx.job)?.result()).await;
    loop {
        if let Some(why) = server.stopped() {
            return Err(Error::Stopped(format!("pserver {index}: {why}")));
        }
        match read_result(&*ctx.discovery, &ctx.job).await {
            Ok(Some(report)) => {
                tracing::info!(index, state = report.state, "the job ended");
                break;
            }
            Ok(None) => {}
            // Discovery away: the lease watch decides whether to stop.
            Err(Error::Discovery(e)) if e.is_transient() => {
                tracing::warn!(index, error = %e, "cannot read the job's result; retrying")
            }
            Err(e) => return Err(e),
        }
        changed.wait(options.poll_interval).await;
    }
    let steps = server.step();
    server.shutdown().await?;
    Ok(PserverReport { index, steps })
}

/// Run a trainer of the job: read the job's options, register, wait for
/// the pservers, train on tasks until the master says the job is over.
pub async fn trainer(ctx: &JobContext, options: &RoleOptions) -> Result<TrainerReport> {
    let span = tracing::info_span!("trainer", job = %ctx.job, id = %options.id);
    run_trainer_role(ctx, options).instrument(span).await
}

async fn run_trainer_role(ctx: &JobContext, options: &RoleOptions) -> Result<TrainerReport> {
    let config = read_config(&*ctx.discovery, &ctx.job, options.startup_timeout).await?;
    let model = ctx.model(&config)?;
    let placement = placement(&*model, &config)?;
    let trainer_options = TrainerOptions {
        id: options.id.clone(),
        job: ctx.job.clone(),
        batch_size: config.batch_size,
        mode: config.mode,
        push_every: config.push_every,
        pull_every: config.pull_every,
        reader: config.reader(),
        lease_ttl: options.lease_ttl,
        call_timeout: options.call_timeout,
        retry: options.retry(),
        servers_timeout: options.startup_timeout,
        prefetch: true,
        overlap: true,
    };
    run_trainer(ctx.discovery.clone(), ctx.transport.clone(), model, placement, trainer_options).await
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
