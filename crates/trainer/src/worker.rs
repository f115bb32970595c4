//! The training loop of one trainer: register, take tasks from the master,
//! train on their mini-batches against the pservers, report, repeat until
//! the master says the job is done.

use crate::{
    model::{Example, Model},
    reader::{read_chunk, ReaderOptions},
    Error, Result,
};
use oar_discovery::{Discovery, JobKeys, LeaseGuard, Session};
use oar_pserver::{Mode, ParamBuf, Placement, PserverClient, PushResult};
use oar_task_queue::{MasterClient, ReportReply, TaskRef, TaskReply, TaskSpec, TaskStats};
use oar_transport::{RetryPolicy, Transport};
use std::{sync::Arc, time::Duration};
use tracing::Instrument;

/// How a trainer runs.
#[derive(Clone, Debug)]
pub struct TrainerOptions {
    /// This trainer's id (its key is `trainer/<id>`; ids order the sync combination).
    pub id: String,
    /// The job's name.
    pub job: String,
    /// Examples per mini-batch.
    pub batch_size: usize,
    /// Sync barrier or async updates (must match the pservers).
    pub mode: Mode,
    /// Async: push every this many mini-batches.
    pub push_every: u32,
    /// Async: pull every this many mini-batches.
    pub pull_every: u32,
    /// How data lines are read.
    pub reader: ReaderOptions,
    /// The trainer's lease: when it expires the master takes its tasks back
    /// and the pservers stop waiting for it.
    pub lease_ttl: Duration,
    /// Bound of one call to the master or a pserver.
    pub call_timeout: Duration,
    /// How long a master or pserver that is away is retried.
    pub retry: RetryPolicy,
    /// How long to wait for every pserver to come up.
    pub servers_timeout: Duration,
}

/// What one trainer did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainerReport {
    /// Tasks reported finished and accepted.
    pub tasks_finished: u64,
    /// Tasks reported failed (bad data).
    pub tasks_failed: u64,
    /// Examples trained on.
    pub examples: u64,
    /// Mini-batches trained on.
    pub batches: u64,
    /// Sum of per-example losses.
    pub loss_sum: f64,
    /// Bad lines skipped (with `skip_bad_lines`).
    pub skipped_lines: u64,
}

/// Run one trainer until the job ends.
pub async fn run_trainer(
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    model: Arc<dyn Model>,
    placement: Arc<Placement>,
    options: TrainerOptions,
) -> Result<TrainerReport> {
    let keys = JobKeys::new(&options.job)?;
    if options.id.is_empty() || options.id.contains('/') || options.id.chars().any(char::is_whitespace) {
        return Err(Error::BadConfig(format!(
            "trainer id {:?} must be non-empty, without '/' or whitespace",
            options.id
        )));
    }
    let session = Session::start(discovery.clone(), options.lease_ttl).await?;
    register(&*discovery, &keys.trainer(&options.id), &options, &session).await?;
    let master = MasterClient::new(
        discovery.clone(),
        transport.clone(),
        &options.job,
        options.call_timeout,
        options.retry,
    )?;
    let pservers = PserverClient::new(
        discovery.clone(),
        transport,
        &options.job,
        placement,
        &options.id,
        options.call_timeout,
        options.retry,
    )?;
    pservers.wait_for_servers(options.servers_timeout).await?;

    let specs = model.param_specs();
    let mut state = Loop {
        model,
        options: options.clone(),
        params: ParamBuf::zeros(&specs),
        grads: ParamBuf::zeros(&specs),
        sum: ParamBuf::zeros(&specs),
        pending_weight: 0.0,
        pservers,
        lease: session.guard(),
        joined: false,
        pulled_once: false,
        fresh: false,
        report: TrainerReport::default(),
    };
    let result = state.run(&master, &session).await;
    if state.joined {
        // Best effort: the lease's end also takes us out of the barrier.
        let _ = state.pservers.leave().await;
    }
    session.close().await?;
    result.map(|()| state.report)
}

/// Claim `trainer/<id>` under the session's lease. A key left by a dead
/// trainer with the same id (a restarted process) goes when its lease
/// expires, so wait for it up to `servers_timeout`.
async fn register(
    discovery: &dyn Discovery,
    key: &str,
    options: &TrainerOptions,
    session: &Session,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + options.servers_timeout;
    loop {
        let value = options.id.clone().into_bytes();
        if discovery.create_if_absent(key, value, Some(session.lease())).await?.is_some() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::TrainerIdTaken(options.id.clone()));
        }
        tracing::info!(trainer = options.id, "trainer id still registered (a previous process?); waiting");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

struct Loop {
    model: Arc<dyn Model>,
    options: TrainerOptions,
    params: ParamBuf,
    grads: ParamBuf,
    /// Async: weighted gradient sum since the last push.
    sum: ParamBuf,
    /// Async: examples behind `sum`.
    pending_weight: f32,
    pservers: PserverClient,
    /// Checked before every step: a trainer whose lease may have expired
    /// (paused past its ttl) has been given up by the job and must not push.
    lease: LeaseGuard,
    joined: bool,
    pulled_once: bool,
    /// Async: `params` came back with the last push (a push-pull), so the
    /// pull due at the next batch is already done.
    fresh: bool,
    report: TrainerReport,
}

impl Loop {
    async fn run(&mut self, master: &MasterClient, session: &Session) -> Result<()> {
        let id = self.options.id.clone();
        loop {
            if session.is_lost() {
                return Err(Error::LeaseLost);
            }
            match master.get_task(&id).await? {
                TaskReply::Assigned { task, task_ref, .. } => {
                    let span = tracing::info_span!("task", task = task.id.0, pass = task_ref.pass);
                    self.do_task(master, task, task_ref).instrument(span).await?;
                }
                TaskReply::Wait { retry_after_ms } => {
                    if self.joined {
                        // Idle trainers leave the barrier so the busy ones do not wait for them.
                        self.pservers.leave().await?;
                        self.joined = false;
                    }
                    tokio::time::sleep(Duration::from_millis(retry_after_ms)).await;
                }
                TaskReply::Done => return Ok(()),
                TaskReply::Failed => {
                    // The master reports the failure; this trainer's part is over.
                    tracing::error!(trainer = id, "the master says the job failed");
                    return Ok(());
                }
            }
        }
    }

    /// Train on one task and report it (or report its data bad).
    async fn do_task(&mut self, master: &MasterClient, task: TaskSpec, task_ref: TaskRef) -> Result<()> {
        let id = self.options.id.clone();
        tracing::info!(trainer = id, task = task.id.0, pass = task_ref.pass, "got task");
        if self.options.mode == Mode::Sync && !self.joined {
            self.pservers.join().await?;
            self.joined = true;
        }
        let (examples, skipped) = match self.read(&task).await {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(trainer = id, task = task.id.0, error = %e, "task data is bad");
                master.task_failed(&id, task_ref, &e.to_string()).await?;
                self.report.tasks_failed += 1;
                return Ok(());
            }
        };
        let mut stats = self.train(&examples).await?;
        stats.skipped_lines = skipped;
        tracing::info!(trainer = id, task = task.id.0, pass = task_ref.pass, "reporting task");
        let reply = master.task_finished(&id, task_ref, stats).await?;
        let accepted = reply == ReportReply::Accepted;
        tracing::info!(trainer = id, task = task.id.0, pass = task_ref.pass, accepted, "task reported");
        if accepted {
            self.report.tasks_finished += 1;
        }
        Ok(())
    }

    /// The task's examples, and how many bad lines were skipped.
    async fn read(&mut self, task: &TaskSpec) -> Result<(Vec<Example>, u64)> {
        let chunks = task.chunks.clone();
        let reader = self.options.reader.clone();
        let data = tokio::task::spawn_blocking(move || -> Result<(Vec<Example>, usize)> {
            let mut examples = Vec::new();
            let mut skipped = 0;
            for chunk in &chunks {
                let data = read_chunk(chunk, &reader)?;
                examples.extend(data.examples);
                skipped += data.skipped;
            }
            Ok((examples, skipped))
        })
        .await
        .map_err(|e| Error::Panicked(format!("reading a task's data: {e}")))??;
        self.report.skipped_lines += data.1 as u64;
        Ok((data.0, data.1 as u64))
    }

    async fn train(&mut self, examples: &[Example]) -> Result<TaskStats> {
        let mut stats = TaskStats::default();
        for batch in examples.chunks(self.options.batch_size) {
            if !self.lease.is_valid() {
                return Err(Error::LeaseLost);
            }
            let loss = match self.options.mode {
                Mode::Sync => self.sync_step(batch).await?,
                Mode::Async => self.async_step(batch).await?,
            };
            stats.examples += batch.len() as u64;
            stats.loss_sum += loss as f64 * batch.len() as f64;
            self.report.batches += 1;
        }
        if self.options.mode == Mode::Async {
            let pull_next = self.report.batches % self.options.pull_every as u64 == 0;
            self.flush(pull_next).await?;
        }
        self.report.examples += stats.examples;
        self.report.loss_sum += stats.loss_sum;
        Ok(stats)
    }

    /// Pull step s, compute, push for step s; if the pservers moved on
    /// without us (we were taken for gone), do it again at the new step.
    async fn sync_step(&mut self, batch: &[Example]) -> Result<f32> {
        loop {
            self.pservers.pull(&mut self.params).await?;
            let loss = self.model.loss_and_grad(&self.params, batch, &mut self.grads);
            match self.pservers.push(&self.grads, batch.len() as f32).await? {
                PushResult::Accepted => return Ok(loss),
                PushResult::Stale => {
                    tracing::info!(trainer = self.options.id, "sync step moved on without us; rejoining");
                    self.pservers.join().await?;
                }
            }
        }
    }

    async fn async_step(&mut self, batch: &[Example]) -> Result<f32> {
        let batches = self.report.batches;
        let pull_due = !self.pulled_once || batches % self.options.pull_every as u64 == 0;
        if pull_due && !self.fresh {
            self.pservers.forget_steps();
            self.pservers.pull(&mut self.params).await?;
            self.pulled_once = true;
        }
        self.fresh = false;
        let loss = self.model.loss_and_grad(&self.params, batch, &mut self.grads);
        let weight = batch.len() as f32;
        for (s, g) in self.sum.as_mut_slice().iter_mut().zip(self.grads.as_slice()) {
            *s += weight * g;
        }
        self.pending_weight += weight;
        if (batches + 1) % self.options.push_every as u64 == 0 {
            self.flush((batches + 1) % self.options.pull_every as u64 == 0).await?;
        }
        Ok(loss)
    }

    /// Async: push the weighted mean of the gradients accumulated since the
    /// last push. If the next batch pulls (`pull_next`), pull with the push
    /// in one round trip.
    async fn flush(&mut self, pull_next: bool) -> Result<()> {
        if self.pending_weight == 0.0 {
            return Ok(());
        }
        let inv = 1.0 / self.pending_weight;
        self.sum.as_mut_slice().iter_mut().for_each(|s| *s *= inv);
        if pull_next {
            self.pservers.push_pull(&self.sum, self.pending_weight, &mut self.params).await?;
            self.pulled_once = true;
            self.fresh = true;
        } else {
            self.pservers.push(&self.sum, self.pending_weight).await?;
        }
        self.sum.fill(0.0);
        self.pending_weight = 0.0;
        Ok(())
    }
}
