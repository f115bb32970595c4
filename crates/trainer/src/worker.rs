//! The training loop of one trainer: register, take tasks from the master,
//! train on their mini-batches against the pservers, report, repeat until
//! the master says the job is done.
//!
//! # Pipelining
//!
//! Waiting costs a trainer more than anything else with a small model: a
//! QUIC round trip to the master or the pservers is 50-150 µs of wall time
//! and CPU on both ends, against ~10 µs to train a batch of 64 a1a
//! examples. So the loop keeps its calls in flight while it trains:
//!
//! - **Tasks** ([`TrainerOptions::prefetch`]): while a task trains, the next
//!   one is asked for and its data read and parsed (on the blocking pool).
//!   A finished task's report travels while the next task trains. At most
//!   one task is fetched ahead and one batch of reports is in flight, so a
//!   trainer holds at most two tasks; one that dies returns both when its
//!   lease ends. A report that fails ends the trainer a task later with its
//!   error.
//! - **Exchanges** ([`TrainerOptions::overlap`], async mode, models up to
//!   [`OVERLAP_MAX_BYTES`]): a push (and the pull due with it) travels in
//!   its own task while the next batches train on the parameters at hand;
//!   the parameters it brings back are taken at the next batch. A push due
//!   while one is in flight waits for it, and then carries the mean
//!   gradient of every batch since the last push (one step of a larger
//!   batch), up to [`MAX_PUSHES_DUE`] pushes' worth, after which training
//!   waits for the network. So a batch trains on parameters at most one
//!   exchange older than without overlap, and a slow network makes pushes
//!   carry more batches instead of stalling training. Sync mode cannot
//!   overlap (each step waits for every trainer's push by design).
//!   Training runs on the runtime's threads, so between batches the loop
//!   yields to the exchange and the other tasks once [`YIELD_EVERY`] has
//!   passed since it last did: often enough that an exchange that completes
//!   is taken within half a round trip, rarely enough that small batches are
//!   not slowed by a round of the runtime's queues each. On a busy machine
//!   a trainer can be kept from running for milliseconds while the others
//!   push; parameters pulled longer ago than twice the age the loop's own
//!   pace gives them ([`STALE_AFTER_MIN`]) are pulled again before the
//!   next batch, so no gradient is computed on parameters that far behind
//!   (without this, a1a under load sometimes ended at 77-81% instead of
//!   83-84%).
//!
//! Order is kept where it matters: a task is reported only after the
//! exchange that pushes its last gradients has been applied, and before
//! the trainer waits, stops or asks again after a `Wait`, it pushes what it
//! holds and waits for its reports.

use crate::{
    model::{Example, Model},
    reader::{read_chunks, ReaderOptions},
    Error, Result,
};
use oar_discovery::LeaseGuard;
use oar_pserver::{Mode, ParamBuf, PserverClient, PushResult};
use oar_task_queue::{MasterClient, ReportReply, TaskRef, TaskReply, TaskSpec, TaskStats};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};
use tokio_util::{sync::CancellationToken, task::AbortOnDropHandle};
use tracing::Instrument;

/// How a trainer runs.
#[derive(Clone, Debug)]
pub struct TrainerOptions {
    /// This trainer's id, as the master and the pservers know it (ids
    /// order the sync combination).
    pub id: String,
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
    /// Ask for the next task, and read its data, while the current one
    /// trains; send reports without waiting for them before the next task.
    pub prefetch: bool,
    /// Async mode, models up to [`OVERLAP_MAX_BYTES`]: let each exchange
    /// with the pservers travel while the next batches train, instead of
    /// waiting for it (see [Pipelining](self#pipelining)).
    pub overlap: bool,
    /// At the stop signal, how long the task in hand may still train
    /// before it is handed back unfinished.
    pub stop_grace: Duration,
}

impl TrainerOptions {
    /// Trainer `id` reading data with `reader`: async, batches of 64
    /// pushed and pulled every batch, prefetch and overlap on, 10 s to
    /// finish a task at the stop signal.
    pub fn new(id: impl Into<String>, reader: ReaderOptions) -> Self {
        Self {
            id: id.into(),
            batch_size: 64,
            mode: Mode::Async,
            push_every: 1,
            pull_every: 1,
            reader,
            prefetch: true,
            overlap: true,
            stop_grace: Duration::from_secs(10),
        }
    }
}

/// What one trainer did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TrainerReport {
    /// Tasks reported finished and accepted.
    pub tasks_finished: u64,
    /// Tasks reported failed (bad data).
    pub tasks_failed: u64,
    /// Tasks handed back unfinished at the stop signal.
    pub tasks_returned: u64,
    /// Examples trained on.
    pub examples: u64,
    /// Mini-batches trained on.
    pub batches: u64,
    /// Async: pushes sent (with overlap, a push may carry several batches
    /// that each were due to push; see [`MAX_PUSHES_DUE`]).
    pub pushes: u64,
    /// Async: examples whose gradients were pushed; all of them once the
    /// trainer has stopped well.
    pub pushed_examples: u64,
    /// Async with overlap: times the parameters at hand were found stale
    /// and pulled again before training went on (see [`STALE_AFTER_MIN`]).
    pub stale_pulls: u64,
    /// Sum of per-example losses.
    pub loss_sum: f64,
    /// Bad lines skipped (with `skip_bad_lines`).
    pub skipped_lines: u64,
    /// The trainer stopped at its stop signal, before the job ended.
    pub shut_down: bool,
}

/// Train on tasks from `master` against `pservers` until the master says
/// the job is over, or `stop` is cancelled: then the task fetched ahead is
/// handed back, the task in hand trains for at most
/// [`TrainerOptions::stop_grace`] more (and is handed back if unfinished),
/// every gradient is pushed and every report waited for. The caller
/// registers the trainer with the job and holds its lease; `lease` is
/// checked before every step, so a trainer whose lease may have expired
/// (the job has given it up) stops pushing at once.
pub async fn run_trainer(
    master: Arc<MasterClient>,
    pservers: PserverClient,
    model: Arc<dyn Model>,
    lease: LeaseGuard,
    options: TrainerOptions,
    stop: CancellationToken,
) -> Result<TrainerReport> {
    if options.batch_size == 0 || options.push_every == 0 || options.pull_every == 0 {
        return Err(Error::BadConfig(format!(
            "batch size, push-every and pull-every must be at least 1: {}, {}, {}",
            options.batch_size, options.push_every, options.pull_every
        )));
    }
    let specs = model.param_specs();
    let model_bytes: usize = specs.iter().map(|s| s.len() * 4).sum();
    let overlap = options.overlap && options.mode == Mode::Async && model_bytes <= OVERLAP_MAX_BYTES;
    let mut state = Loop {
        model,
        options: options.clone(),
        params: ParamBuf::zeros(&specs),
        grads: ParamBuf::zeros(&specs),
        sum: ParamBuf::zeros(&specs),
        pending_weight: 0.0,
        pservers: Arc::new(tokio::sync::Mutex::new(pservers)),
        lease,
        stop,
        stop_by: None,
        joined: false,
        pulled_once: false,
        fresh: false,
        overlapped: overlap.then(|| Overlapped {
            in_flight: None,
            spare: Some((ParamBuf::zeros(&specs), ParamBuf::zeros(&specs))),
            unpushed: Vec::new(),
            since_push: 0,
            since_pull: 0,
            last_yield: Instant::now(),
            pulled_at: Instant::now(),
            exchange_time: Duration::ZERO,
            batch_time: Duration::ZERO,
        }),
        ready: Vec::new(),
        reporting: None,
        report: TrainerReport::default(),
    };
    let result = state.run(&master).await;
    if state.joined && (result.is_err() || state.report.shut_down) {
        // Best effort, and brief: the lease's end also takes us out of the
        // barrier. (A job that is over needs no leave: its pservers may
        // already be gone, and retrying them would only delay the exit.)
        let leave = async { state.pservers.lock().await.leave().await };
        let _ = tokio::time::timeout(Duration::from_secs(5), leave).await;
    }
    result.map(|()| state.report)
}

/// Models up to this size overlap their async exchanges with training (see
/// [`TrainerOptions::overlap`]); larger ones exchange in place. Overlapping
/// costs two more copies of the model (the parameters arriving and the
/// gradients travelling), which for a small model is nothing and for a
/// large one would break the trainer's memory bound (1.3x its model).
pub const OVERLAP_MAX_BYTES: usize = 64 << 20;

/// With overlap, a push that waits for the one in flight carries the mean
/// gradient of every batch since the last push: one step of a larger
/// batch. Once this many pushes are due, the trainer waits for the
/// exchange in flight instead, so a push never stands for more than this
/// many batches times `push_every`.
pub const MAX_PUSHES_DUE: u32 = 4;

/// With overlap, the training loop lets the runtime run its other tasks
/// (the exchange in flight, the reports, the other roles of a one-process
/// job) once this much time has passed since it last did. Yielding after
/// every batch instead cost a round of the runtime's queues per ~10 µs
/// batch: one a1a trainer ran at 0.51-0.67 of the plain loop against
/// 0.61-0.86 this way, in paired runs (BENCHMARKS.md, end to end). Half a
/// loopback round trip: an exchange that completes waits at most about
/// that long to be taken.
pub const YIELD_EVERY: Duration = Duration::from_micros(50);

/// With overlap, parameters pulled longer ago than twice the age the
/// loop's own pace gives them (an exchange's typical duration plus the
/// batches trained before the next pull), and at least this long ago, are
/// stale: the trainer waits for a pull before it trains on. An exchange of
/// a small model takes 0.1-0.2 ms on loopback, so only a trainer kept from
/// running (a busy machine, a long wait for the master) reaches this age;
/// larger models and slower batches scale the bound with their own pace.
pub const STALE_AFTER_MIN: Duration = Duration::from_millis(2);

struct Loop {
    model: Arc<dyn Model>,
    options: TrainerOptions,
    params: ParamBuf,
    grads: ParamBuf,
    /// Async: weighted gradient sum since the last push.
    sum: ParamBuf,
    /// Async: examples behind `sum`.
    pending_weight: f32,
    /// Behind a lock so that an overlapped exchange can run in its own task.
    pservers: Arc<tokio::sync::Mutex<PserverClient>>,
    /// Checked before every step: a trainer whose lease may have expired
    /// (paused past its ttl) has been given up by the job and must not push.
    lease: LeaseGuard,
    /// Cancelled: stop (see [`run_trainer`]).
    stop: CancellationToken,
    /// Once stopping: when the task in hand must be handed back if unfinished.
    stop_by: Option<Instant>,
    joined: bool,
    pulled_once: bool,
    /// Async: `params` came back with the last push (a push-pull), so the
    /// pull due at the next batch is already done.
    fresh: bool,
    /// Async exchanges overlap training (small models, `options.overlap`).
    overlapped: Option<Overlapped>,
    /// Finished tasks whose reports may go to the master: every gradient
    /// of theirs has been applied.
    ready: Vec<(TaskRef, TaskStats)>,
    /// Reports on their way to the master, at most one batch of them.
    reporting: Option<AbortOnDropHandle<Result<Vec<Reported>>>>,
    report: TrainerReport,
}

/// An async trainer's state when its exchanges with the pservers overlap
/// its training: at most one exchange travels while the next batches train
/// on the parameters already there, accumulating their gradients for the
/// next push. The parameters a batch trains on are thus at most one
/// exchange older than without overlap; a push is due every `push_every`
/// batches but waits for the one in flight, so a slow network makes pushes
/// carry more batches rather than stall training.
struct Overlapped {
    /// The exchange in flight, if any.
    in_flight: Option<InFlight>,
    /// The buffers an exchange borrows (gradient sum out, parameters in),
    /// here while no exchange is in flight.
    spare: Option<(ParamBuf, ParamBuf)>,
    /// Finished tasks with gradients still in `sum`: reported after the
    /// exchange that pushes them.
    unpushed: Vec<(TaskRef, TaskStats)>,
    /// Batches since the last push and since the last pull.
    since_push: u32,
    since_pull: u32,
    /// When the loop last let the runtime run other tasks.
    last_yield: Instant,
    /// When the parameters at hand were pulled.
    pulled_at: Instant,
    /// How long an exchange takes, start to end, and a batch to train
    /// ([`typical`] of the ones so far).
    exchange_time: Duration,
    batch_time: Duration,
}

/// A task's report and the master's answer.
type Reported = (TaskRef, ReportReply);

/// What an exchange gives back: the gradient buffer, the parameter buffer,
/// its outcome and when it ended.
type Exchanged = (ParamBuf, ParamBuf, std::result::Result<(), oar_pserver::ServiceError>, Instant);

struct InFlight {
    /// Gives back the buffers, and the exchange's outcome.
    done: AbortOnDropHandle<Exchanged>,
    /// When it started.
    started: Instant,
    /// Whether it brings parameters back.
    pulls: bool,
    /// Tasks whose last gradients it pushes.
    reports: Vec<(TaskRef, TaskStats)>,
}

/// A moving average of `sample`s that a stall does not carry away: each
/// counts for an eighth, and for at most 4 times the average so far. (A
/// trainer kept from running mid-batch makes that batch, and the exchange
/// waiting on its thread, look long; averaged in whole, they would raise
/// the staleness bound past the very age they caused.)
fn typical(average: Duration, sample: Duration) -> Duration {
    if average.is_zero() {
        return sample;
    }
    (average.saturating_mul(7).saturating_add(sample.min(average.saturating_mul(4)))) / 8
}

impl Overlapped {
    /// Parameters pulled longer ago than this are stale: twice the age the
    /// loop's own pace gives them (an exchange, plus the batches trained
    /// while pushes are due and until the next pull), at least
    /// [`STALE_AFTER_MIN`].
    fn stale_after(&self, push_every: u32, pull_every: u32) -> Duration {
        let batches = MAX_PUSHES_DUE.saturating_mul(push_every).saturating_add(pull_every);
        let paced = self.exchange_time.saturating_add(self.batch_time.saturating_mul(batches));
        paced.saturating_mul(2).max(STALE_AFTER_MIN)
    }
}

impl Loop {
    async fn run(&mut self, master: &Arc<MasterClient>) -> Result<()> {
        let id = self.options.id.clone();
        // The next task, asked for while the current one trains.
        let mut ahead: Option<AbortOnDropHandle<Result<Fetched>>> = None;
        loop {
            if !self.lease.is_valid() {
                return Err(Error::LeaseLost);
            }
            if self.stopping() {
                if let Some(next) = ahead.take() {
                    if let Fetched::Task { task_ref, .. } = joined(next).await?? {
                        self.hand_back(master, task_ref).await?;
                    }
                }
                self.report.shut_down = true;
                tracing::info!(trainer = id, "stopped at the stop signal");
                return self.drain(master).await;
            }
            let fetched = match ahead.take() {
                Some(next) => match joined(next).await?? {
                    task @ Fetched::Task { .. } => task,
                    // A Wait, Done or Failed from before the current task
                    // ended is stale: finish what is in flight and ask again.
                    _ => {
                        self.drain(master).await?;
                        fetch(master, &id, &self.options.reader).await?
                    }
                },
                None => fetch(master, &id, &self.options.reader).await?,
            };
            match fetched {
                Fetched::Task { task, task_ref, data } => {
                    if self.options.prefetch && !self.stopping() {
                        let (master, id, reader) = (master.clone(), id.clone(), self.options.reader.clone());
                        let span = tracing::Span::current();
                        ahead =
                            Some(spawn(async move { fetch(&master, &id, &reader).await }.instrument(span)));
                    }
                    let span = tracing::info_span!("task", task = task.id.0, pass = task_ref.pass);
                    match self.do_task(master, task, task_ref, data).instrument(span).await? {
                        Trained::Finished(stats) => self.finished((task_ref, stats)),
                        Trained::Failed => {}
                        Trained::Interrupted => {
                            // Its gradients so far are pushed; the task goes back whole.
                            self.drain(master).await?;
                            self.hand_back(master, task_ref).await?;
                        }
                    }
                    self.send_reports(master, !self.options.prefetch).await?;
                }
                Fetched::Wait { retry_after_ms } => {
                    self.drain(master).await?;
                    if self.joined {
                        // Idle trainers leave the barrier so the busy ones do not wait for them.
                        self.pservers.lock().await.leave().await?;
                        self.joined = false;
                    }
                    let wait = tokio::time::sleep(Duration::from_millis(retry_after_ms));
                    tokio::select! {
                        _ = wait => {}
                        _ = self.stop.cancelled() => {}
                    }
                }
                Fetched::Done => return self.drain(master).await,
                Fetched::Failed => {
                    self.drain(master).await?;
                    // The master reports the failure; this trainer's part is over.
                    tracing::error!(trainer = id, "the master says the job failed");
                    return Ok(());
                }
            }
        }
    }

    /// Whether the stop signal came; the first time it is seen, the task in
    /// hand gets [`TrainerOptions::stop_grace`] to finish.
    fn stopping(&mut self) -> bool {
        if self.stop_by.is_none() && self.stop.is_cancelled() {
            self.stop_by = Some(Instant::now() + self.options.stop_grace);
        }
        self.stop_by.is_some()
    }

    /// Give a task back to the master unfinished.
    async fn hand_back(&mut self, master: &MasterClient, task_ref: TaskRef) -> Result<()> {
        let reply = master.task_returned(&self.options.id, task_ref).await?;
        let (task, pass) = (task_ref.task.0, task_ref.pass);
        tracing::info!(trainer = self.options.id, task, pass, ?reply, "task handed back");
        self.report.tasks_returned += 1;
        Ok(())
    }

    /// A task is trained on: its report is ready once its gradients are
    /// applied, which with overlap may be after an exchange still to come.
    fn finished(&mut self, task: (TaskRef, TaskStats)) {
        let pending = self.pending_weight > 0.0;
        match &mut self.overlapped {
            Some(o) if pending => {
                o.unpushed.push(task);
                if o.in_flight.is_none() {
                    self.start_exchange(true);
                }
            }
            Some(Overlapped { in_flight: Some(f), .. }) => f.reports.push(task),
            _ => self.ready.push(task),
        }
    }

    /// Push every gradient, and wait for every report, before the trainer
    /// waits, stops or asks the master again.
    async fn drain(&mut self, master: &Arc<MasterClient>) -> Result<()> {
        if self.overlapped.is_some() {
            self.collect(true).await?;
            if self.pending_weight > 0.0 {
                self.start_exchange(true);
                self.collect(true).await?;
            }
        }
        self.send_reports(master, true).await
    }

    /// Send the ready reports unless some are still on their way (then
    /// later); with `wait`, wait for all of them.
    async fn send_reports(&mut self, master: &Arc<MasterClient>, wait: bool) -> Result<()> {
        if self.reporting.as_ref().is_some_and(|r| r.is_finished()) || (wait && self.reporting.is_some()) {
            self.settle().await?;
        }
        if self.reporting.is_none() && !self.ready.is_empty() {
            let (master, id, ready) =
                (master.clone(), self.options.id.clone(), std::mem::take(&mut self.ready));
            let send = async move {
                let mut replies = Vec::with_capacity(ready.len());
                for (task_ref, stats) in ready {
                    replies.push((task_ref, master.task_finished(&id, task_ref, stats).await?));
                }
                Ok(replies)
            };
            self.reporting = Some(spawn(send.instrument(tracing::Span::current())));
            if wait {
                self.settle().await?;
            }
        }
        Ok(())
    }

    /// Wait for the reports in flight and count them.
    async fn settle(&mut self) -> Result<()> {
        let Some(reporting) = self.reporting.take() else {
            return Ok(());
        };
        for (task_ref, reply) in joined(reporting).await?? {
            let accepted = reply == ReportReply::Accepted;
            let (id, task, pass) = (&self.options.id, task_ref.task.0, task_ref.pass);
            tracing::info!(trainer = id, task, pass, accepted, "task reported");
            if accepted {
                self.report.tasks_finished += 1;
            }
        }
        Ok(())
    }

    /// Train on one task and return what to report, or report its data bad.
    async fn do_task(
        &mut self,
        master: &MasterClient,
        task: TaskSpec,
        task_ref: TaskRef,
        data: Result<(Vec<Example>, u64)>,
    ) -> Result<Trained> {
        let id = self.options.id.clone();
        tracing::info!(trainer = id, task = task.id.0, pass = task_ref.pass, "got task");
        if self.options.mode == Mode::Sync && !self.joined {
            self.pservers.lock().await.join().await?;
            self.joined = true;
        }
        let (examples, skipped) = match data {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(trainer = id, task = task.id.0, error = %e, "task data is bad");
                master.task_failed(&id, task_ref, &e.to_string()).await?;
                self.report.tasks_failed += 1;
                return Ok(Trained::Failed);
            }
        };
        let Some(mut stats) = self.train(&examples).await? else {
            return Ok(Trained::Interrupted);
        };
        self.report.skipped_lines += skipped;
        stats.skipped_lines = skipped;
        tracing::info!(trainer = id, task = task.id.0, pass = task_ref.pass, "reporting task");
        Ok(Trained::Finished(stats))
    }

    /// Train on a task's examples; `None` if the stop signal's grace ran
    /// out first.
    async fn train(&mut self, examples: &[Example]) -> Result<Option<TaskStats>> {
        let mut stats = TaskStats::default();
        for batch in examples.chunks(self.options.batch_size) {
            if !self.lease.is_valid() {
                return Err(Error::LeaseLost);
            }
            if self.stopping() && self.stop_by.is_some_and(|by| Instant::now() >= by) {
                self.report.examples += stats.examples;
                self.report.loss_sum += stats.loss_sum;
                return Ok(None);
            }
            let loss = match (self.options.mode, self.overlapped.is_some()) {
                (Mode::Sync, _) => self.sync_step(batch).await?,
                (Mode::Async, false) => self.async_step(batch).await?,
                (Mode::Async, true) => self.overlapped_step(batch).await?,
            };
            stats.examples += batch.len() as u64;
            stats.loss_sum += loss as f64 * batch.len() as f64;
            self.report.batches += 1;
        }
        if self.options.mode == Mode::Async && self.overlapped.is_none() {
            let pull_next = self.report.batches % self.options.pull_every as u64 == 0;
            self.flush(pull_next).await?;
        }
        self.report.examples += stats.examples;
        self.report.loss_sum += stats.loss_sum;
        Ok(Some(stats))
    }

    /// Pull step s, compute, push for step s; if the pservers moved on
    /// without us (we were taken for gone), do it again at the new step.
    async fn sync_step(&mut self, batch: &[Example]) -> Result<f32> {
        let mut pservers = self.pservers.lock().await;
        loop {
            pservers.pull(&mut self.params).await?;
            let loss = self.model.loss_and_grad(&self.params, batch, &mut self.grads);
            match pservers.push(&self.grads, batch.len() as f32).await? {
                PushResult::Accepted => return Ok(loss),
                PushResult::Stale => {
                    tracing::info!(trainer = self.options.id, "sync step moved on without us; rejoining");
                    pservers.join().await?;
                }
            }
        }
    }

    /// Compute one batch's gradient at `params` and add it, weighted by
    /// the batch's size, to `sum`.
    fn accumulate(&mut self, batch: &[Example]) -> f32 {
        let loss = self.model.loss_and_grad(&self.params, batch, &mut self.grads);
        let weight = batch.len() as f32;
        for (s, g) in self.sum.as_mut_slice().iter_mut().zip(self.grads.as_slice()) {
            *s += weight * g;
        }
        self.pending_weight += weight;
        loss
    }

    /// Turn `sum` into the weighted mean gradient of what it holds.
    fn mean_of_sum(&mut self) {
        let inv = 1.0 / self.pending_weight;
        self.sum.as_mut_slice().iter_mut().for_each(|s| *s *= inv);
    }

    async fn async_step(&mut self, batch: &[Example]) -> Result<f32> {
        let batches = self.report.batches;
        let pull_due = !self.pulled_once || batches % self.options.pull_every as u64 == 0;
        if pull_due && !self.fresh {
            async_pull(&mut *self.pservers.lock().await, &mut self.params).await?;
            self.pulled_once = true;
        }
        self.fresh = false;
        let loss = self.accumulate(batch);
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
        self.mean_of_sum();
        self.report.pushes += 1;
        self.report.pushed_examples += self.pending_weight as u64;
        let mut pservers = self.pservers.lock().await;
        if pull_next {
            pservers.push_pull(&self.sum, self.pending_weight, &mut self.params).await?;
            self.pulled_once = true;
            self.fresh = true;
        } else {
            pservers.push(&self.sum, self.pending_weight).await?;
        }
        self.sum.fill(0.0);
        self.pending_weight = 0.0;
        Ok(())
    }

    /// Async with overlap: train on the parameters at hand, taking newer
    /// ones when an exchange brings them, and start an exchange when one is
    /// due and none is in flight.
    async fn overlapped_step(&mut self, batch: &[Example]) -> Result<f32> {
        // Nothing below waits while an exchange travels: let the runtime run
        // it (and the other roles of a one-process job) between batches.
        if self.overlapped.as_ref().is_some_and(|o| o.last_yield.elapsed() >= YIELD_EVERY) {
            tokio::task::yield_now().await;
            if let Some(o) = &mut self.overlapped {
                o.last_yield = Instant::now();
            }
        }
        self.collect(false).await?;
        if !self.pulled_once {
            async_pull(&mut *self.pservers.lock().await, &mut self.params).await?;
            self.pulled_once = true;
            if let Some(o) = &mut self.overlapped {
                o.pulled_at = Instant::now();
            }
        }
        let (push_every, pull_every) = (self.options.push_every, self.options.pull_every);
        let stale = |o: &Overlapped| o.pulled_at.elapsed() > o.stale_after(push_every, pull_every);
        if self.overlapped.as_ref().is_some_and(stale) {
            // The loop was kept from running (a busy machine) long enough
            // for the parameters at hand to fall behind the other trainers'
            // pushes: take fresh ones before training on, from the exchange
            // in flight if it pulls, else from one more (with a push if one
            // is due).
            self.report.stale_pulls += 1;
            self.collect(true).await?;
            if let Some(o) = self.overlapped.as_mut().filter(|o| stale(o)) {
                o.since_pull = self.options.pull_every;
                self.start_exchange(false);
                self.collect(true).await?;
            }
        }
        let started = Instant::now();
        let loss = self.accumulate(batch);
        let Some(o) = &mut self.overlapped else {
            return Ok(loss);
        };
        o.batch_time = typical(o.batch_time, started.elapsed());
        o.since_push = o.since_push.saturating_add(1);
        o.since_pull = o.since_pull.saturating_add(1);
        if o.since_push >= self.options.push_every.saturating_mul(MAX_PUSHES_DUE) {
            // The network lags too far behind: wait for it rather than
            // let one push stand for ever more batches.
            self.collect(true).await?;
        }
        self.start_exchange(false);
        Ok(loss)
    }

    /// Start an exchange in its own task if one is due (`force_push`: push
    /// whatever is accumulated) and none is in flight.
    fn start_exchange(&mut self, force_push: bool) {
        let Some(o) = &mut self.overlapped else {
            return;
        };
        let push = self.pending_weight > 0.0 && (force_push || o.since_push >= self.options.push_every);
        let pull = o.since_pull >= self.options.pull_every;
        if o.in_flight.is_some() || !(push || pull) {
            return;
        }
        let Some((spare_sum, mut params)) = o.spare.take() else {
            return;
        };
        let reports = if push { std::mem::take(&mut o.unpushed) } else { Vec::new() };
        if push {
            o.since_push = 0;
        }
        if pull {
            o.since_pull = 0;
        }
        let weight = self.pending_weight;
        if push {
            self.mean_of_sum();
            self.pending_weight = 0.0;
            self.report.pushes += 1;
            self.report.pushed_examples += weight as u64;
        }
        // Without a push the spare goes out unused and comes back zeroed.
        let sum = if push { std::mem::replace(&mut self.sum, spare_sum) } else { spare_sum };
        let pservers = self.pservers.clone();
        let exchange = async move {
            let mut pservers = pservers.lock().await;
            let result = match (push, pull) {
                (true, true) => pservers.push_pull(&sum, weight, &mut params).await,
                (true, false) => pservers.push(&sum, weight).await.map(|_| ()),
                (false, _) => async_pull(&mut pservers, &mut params).await,
            };
            drop(pservers);
            (sum, params, result, Instant::now())
        };
        let done = spawn(exchange.instrument(tracing::Span::current()));
        if let Some(o) = &mut self.overlapped {
            o.in_flight = Some(InFlight { done, started: Instant::now(), pulls: pull, reports });
        }
    }

    /// Take back the exchange in flight if it is over (with `wait`, once it
    /// is): its parameters become the ones trained on, and the tasks it
    /// pushed the last gradients of become ready to report.
    async fn collect(&mut self, wait: bool) -> Result<()> {
        let Some(o) = &mut self.overlapped else {
            return Ok(());
        };
        match &o.in_flight {
            Some(f) if wait || f.done.is_finished() => {}
            _ => return Ok(()),
        }
        let Some(InFlight { done, started, pulls, reports }) = o.in_flight.take() else {
            return Ok(());
        };
        let (mut sum, params, result, ended) = joined(done).await?;
        result?;
        o.exchange_time = typical(o.exchange_time, ended.saturating_duration_since(started));
        if pulls {
            o.pulled_at = ended;
        }
        sum.fill(0.0);
        let params = if pulls { std::mem::replace(&mut self.params, params) } else { params };
        o.spare = Some((sum, params));
        self.ready.extend(reports);
        Ok(())
    }
}

/// An async pull: it never waits for a step.
async fn async_pull(
    pservers: &mut PserverClient,
    params: &mut ParamBuf,
) -> std::result::Result<(), oar_pserver::ServiceError> {
    pservers.forget_steps();
    pservers.pull(params).await
}

/// What became of a task.
enum Trained {
    /// Trained on to the end: report it with these statistics.
    Finished(TaskStats),
    /// Its data is bad: reported failed already.
    Failed,
    /// The stop signal's grace ran out before the end: hand it back.
    Interrupted,
}

/// The master's answer to a trainer asking for a task, with the task's
/// data read (or why it could not be).
enum Fetched {
    Task { task: TaskSpec, task_ref: TaskRef, data: Result<(Vec<Example>, u64)> },
    Wait { retry_after_ms: u64 },
    Done,
    Failed,
}

/// Ask the master for a task and read its data (on the blocking pool).
async fn fetch(master: &MasterClient, id: &str, reader: &ReaderOptions) -> Result<Fetched> {
    match master.get_task(id).await? {
        TaskReply::Assigned { task, task_ref, .. } => {
            let data = read_task(&task, reader.clone()).await;
            Ok(Fetched::Task { task, task_ref, data })
        }
        TaskReply::Wait { retry_after_ms } => Ok(Fetched::Wait { retry_after_ms }),
        TaskReply::Done => Ok(Fetched::Done),
        TaskReply::Failed => Ok(Fetched::Failed),
    }
}

/// A task's examples, and how many bad lines were skipped.
async fn read_task(task: &TaskSpec, reader: ReaderOptions) -> Result<(Vec<Example>, u64)> {
    let chunks = task.chunks.clone();
    joined(AbortOnDropHandle::new(tokio::task::spawn_blocking(move || {
        read_chunks(&chunks, &reader).map(|data| (data.examples, data.skipped as u64))
    })))
    .await?
}

/// Spawn `future`, to be aborted if the handle is dropped: a trainer that
/// stops leaves nothing running behind it.
fn spawn<T: Send + 'static>(
    future: impl std::future::Future<Output = T> + Send + 'static,
) -> AbortOnDropHandle<T> {
    AbortOnDropHandle::new(tokio::spawn(future))
}

/// The output of a spawned task, or why it has none.
async fn joined<T>(task: AbortOnDropHandle<T>) -> Result<T> {
    task.await.map_err(|e| Error::Panicked(format!("a background task: {e}")))
}
