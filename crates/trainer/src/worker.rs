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
//!   trainer holds the task it trains, the one fetched ahead, and the
//!   finished ones whose reports are on their way (usually one); one that
//!   dies returns them all when its lease ends, and the finished ones are
//!   trained again. A report that fails ends the trainer a task later with
//!   its error.
//! - **Sync steps**: one round trip each. The push of step s is a
//!   push-pull, answered when the step completes with step s + 1's
//!   parameters ([`PserverClient::push_pull`]), so the next batch trains
//!   at once; a pull comes first only after joining the barrier or a
//!   stale push.
//! - **Exchanges** ([`TrainerOptions::overlap`], async mode, models up to
//!   [`OVERLAP_MAX_BYTES`]): a push (and the pull due with it) travels in
//!   its own task while the next batches train on the parameters at hand;
//!   the parameters it brings back are taken at the next batch. When to
//!   push, pull, wait for the network, re-pull a stale copy and yield is
//!   decided by an I/O-free [`Schedule`] (its docs give the rules); this
//!   loop carries out its actions. Sync mode cannot overlap (each step
//!   waits for every trainer's push by design).
//!
//! # The runtime
//!
//! A trainer with a small model is bound by its round trips, and on a
//! machine with few cores a round trip is cheapest when it stays on one
//! thread: with a worker per core, each packet's arrival wakes the idle
//! worker that waits on the I/O driver, and a wake-up that lands on an
//! idle core pays for waking the core (on the 2-vCPU VM of `BENCHMARKS.md`,
//! ~30 µs, more than a whole round trip on one thread). So a process whose
//! work is mostly small calls (a trainer, or a small job in one process)
//! runs best on a runtime with **one worker thread**
//! (`tokio::runtime::Builder::new_multi_thread().worker_threads(1)`):
//! tasks are read and parsed on the blocking pool, which uses the other
//! cores. The library does not choose: the runtime is the caller's, and a
//! pserver applying large pushes, or a large model's exchanges, want every
//! core. (`bench_end_to_end --workers 1`: one sync trainer at batch 64
//! 0.59–0.61 of a plain loop, against 0.36–0.41 with a worker per core on
//! a VM whose idle vCPUs halt at once, and 0.46–0.47 where they poll for a
//! while first, as KVM guests do by default.)
//!
//! # Sparse models
//!
//! A [`SparseModel`] trains batch by batch, in both modes: the batch's
//! unique ids ([`SparseModel::batch_ids`]) are pulled from their shards in
//! one call per pserver ([`PserverClient::pull_rows`]), the model runs, and
//! its row gradients (summed per id, as the mean over the batch) go out
//! with the dense gradient in one push, exactly once as a dense push
//! does. That push also brings the dense parameters back, and the rows
//! of the task's next batch, read after the push (sync: once its step is
//! complete; [`PserverClient::push_pull_rows_ahead`]), so a batch costs
//! one round trip; a task's first batch pulls its rows first, and so does
//! any batch whose rows did not come (a stale push, a shard that moved, a
//! push too large for one batch per pserver). A sparse model pushes
//! every batch: its rows differ from batch to batch, so there is no
//! accumulated push to overlap, and `push_every`/`pull_every` must be 1
//! (checked at start).
//!
//! # Exactly once
//!
//! Every push names its origin ([`oar_pserver::origin`]): the task (pass
//! and id), the examples of it whose gradient it carries, and the oldest
//! task still open when the master handed this one out. A task's pushes
//! are cut the same way whoever trains it (every `push_every` batches
//! from its start, and at its end), so when a trainer dies in the middle
//! of a task and the task is trained again, the shards drop the pushes of
//! examples they have applied and apply the rest: each example's gradient
//! is applied once. A task handed back at the stop signal drops its
//! gradient not pushed yet, for the same reason (it is trained again
//! whole).
//!
//! Order is kept where it matters: a task is reported only after the
//! exchange that pushes its last gradients has been applied, and before
//! the trainer waits, stops or asks again after a `Wait`, it pushes what it
//! holds and waits for its reports.

use crate::{
    any_model::{AnyModel, Examples},
    eval::{Evaluation, Tally},
    id_reader::IdExample,
    model::{Example, Model},
    reader::ReaderOptions,
    schedule::{Action, Exchange, Schedule, ScheduleConfig, Want},
    sparse_model::{RowBatch, SparseModel},
    Error, Result,
};
use oar_discovery::LeaseGuard;
use oar_pserver::{Mode, Origin, ParamBuf, PserverClient, PushResult, RowsAhead, TableGrads, TaskKey};
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
    /// Notified whenever reports were accepted by the master: a progress
    /// display follows the job from these events.
    pub reported: Option<Arc<tokio::sync::Notify>>,
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
            reported: None,
        }
    }
}

/// The trainer's metrics, registered when a trainer starts (summed over
/// the trainers of a process).
struct Metrics {
    examples: oar_metrics::Counter,
    batches: oar_metrics::Counter,
    tasks: oar_metrics::Counter,
    stale_pulls: oar_metrics::Counter,
    /// Sparse models: row pulls made on their own, not with a push.
    row_pulls: oar_metrics::Counter,
    /// Mean training loss of the last task finished.
    loss: oar_metrics::Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Async: how old the parameters a batch trains on are.
    parameter_age: oar_metrics::Histogram,
    /// A push, pull or both with the pservers, start to end (sync: a step).
    exchange: oar_metrics::Histogram,
}

fn metrics() -> &'static Metrics {
    static METRICS: std::sync::LazyLock<Metrics> = std::sync::LazyLock::new(|| {
        let m = Metrics {
            examples: Default::default(),
            batches: Default::default(),
            tasks: Default::default(),
            stale_pulls: Default::default(),
            row_pulls: Default::default(),
            loss: Default::default(),
            parameter_age: oar_metrics::seconds_histogram(),
            exchange: oar_metrics::seconds_histogram(),
        };
        use oar_metrics::register as r;
        r("oar_trainer_examples", "Examples trained on (their rate: examples/s).", m.examples.clone());
        r("oar_trainer_batches", "Mini-batches trained on.", m.batches.clone());
        r("oar_trainer_tasks_finished", "Tasks trained to their end.", m.tasks.clone());
        r(
            "oar_trainer_stale_pulls",
            "Async: stale parameters pulled again before training on.",
            m.stale_pulls.clone(),
        );
        r(
            "oar_trainer_row_pulls",
            "Sparse models: row pulls on their own (a batch's rows that did not come with the push before).",
            m.row_pulls.clone(),
        );
        r("oar_trainer_loss", "Mean training loss of the last task finished.", m.loss.clone());
        r(
            "oar_trainer_parameter_age_seconds",
            "Async: age of the parameters a batch trains on (staleness).",
            m.parameter_age.clone(),
        );
        r(
            "oar_trainer_exchange_seconds",
            "An exchange with the pservers, start to end (sync: a whole step).",
            m.exchange.clone(),
        );
        m
    });
    &METRICS
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
    /// Pushes the pservers acknowledged. Async: each carries `push_every`
    /// batches, or fewer at a task's end. Sync: one per step this trainer
    /// took part in (a batch redone after a stale step counts once).
    pub pushes: u64,
    /// Async: pulls made (each brings every parameter). Sparse models:
    /// row pulls made on their own, one per batch whose rows did not come
    /// with the push before it (in both modes; usually a task's first).
    pub pulls: u64,
    /// Examples whose gradients were pushed; all of them once the trainer
    /// has stopped well.
    pub pushed_examples: u64,
    /// Sparse models: row gradients in the acknowledged pushes (one per
    /// table row a batch touched).
    pub pushed_rows: u64,
    /// Async with overlap: times the parameters at hand were found stale
    /// and pulled again before training went on (see [`Schedule`]).
    pub stale_pulls: u64,
    /// Sum of per-example losses.
    pub loss_sum: f64,
    /// Bad lines skipped (with `skip_bad_lines`).
    pub skipped_lines: u64,
    /// The trainer stopped at its stop signal, before the job ended.
    pub shut_down: bool,
    /// Pushes, summed over the shards, whose examples a shard had applied
    /// already (a task trained again after its trainer died in it: see
    /// [Exactly once](self#exactly-once)).
    pub applied_before: u64,
    /// Per shard, the pushes it acknowledged as taken
    /// ([`PserverClient::acknowledged`]): sync, a push stale on one shard
    /// may have been taken on another.
    pub shard_pushes: std::collections::BTreeMap<u32, u64>,
}

/// Train on tasks from `master` against `pservers` until the master says
/// the job is over, or `stop` is cancelled: then the task fetched ahead is
/// handed back (once the master named it, its data read or not), the task
/// in hand trains for at most [`TrainerOptions::stop_grace`] more (and is
/// handed back if unfinished), every gradient is pushed and every report
/// waited for, each call bounded by [`STOP_CALLS_FOR`] (the reports of
/// tasks acknowledged before go even when a push cannot) and the whole
/// stop by the grace plus three times that. The caller
/// registers the trainer with the job and holds its lease; `lease` is
/// checked before every step, so a trainer whose lease may have expired
/// (the job has given it up) stops pushing at once.
pub async fn run_trainer(
    master: Arc<MasterClient>,
    pservers: PserverClient,
    model: impl Into<AnyModel>,
    lease: LeaseGuard,
    options: TrainerOptions,
    stop: CancellationToken,
) -> Result<TrainerReport> {
    let model = model.into();
    if options.batch_size == 0 || options.push_every == 0 || options.pull_every == 0 {
        return Err(Error::BadConfig(format!(
            "batch size, push-every and pull-every must be at least 1: {}, {}, {}",
            options.batch_size, options.push_every, options.pull_every
        )));
    }
    let sparse = match &model {
        AnyModel::Sparse(m) if options.push_every != 1 || options.pull_every != 1 => {
            return Err(Error::BadConfig(format!(
                "a sparse model pushes and pulls every batch: push-every and pull-every must be 1, got {} and {}",
                options.push_every, options.pull_every
            )))
        }
        AnyModel::Sparse(m) => {
            let rows = m.new_rows();
            Some(SparseBuffers {
                grads: rows.clone(),
                next: rows.clone(),
                next_pulled: Vec::new(),
                next_ready: false,
                pulled: Vec::new(),
                rows,
            })
        }
        AnyModel::Dense(_) => None,
    };
    metrics(); // Registered from the start, at zero.
    let specs = model.param_specs();
    let model_bytes: usize = specs.iter().map(|s| s.len() * 4).sum();
    let overlap = options.overlap && options.mode == Mode::Async && model_bytes <= OVERLAP_MAX_BYTES;
    let schedule = (options.mode == Mode::Async && sparse.is_none()).then(|| {
        let config =
            ScheduleConfig { push_every: options.push_every, pull_every: options.pull_every, overlap };
        Schedule::new(config, Instant::now())
    });
    let mut state = Loop {
        model,
        options: options.clone(),
        params: ParamBuf::zeros(&specs),
        grads: ParamBuf::zeros(&specs),
        sum: ParamBuf::zeros(&specs),
        pending_weight: 0.0,
        pservers: Arc::new(tokio::sync::Mutex::new(pservers)),
        sparse,
        lease,
        stop,
        stop_by: None,
        joined: false,
        schedule,
        in_flight: None,
        spare: overlap.then(|| (ParamBuf::zeros(&specs), ParamBuf::zeros(&specs))),
        unpushed: Vec::new(),
        ready: Vec::new(),
        reporting: None,
        report: TrainerReport::default(),
        task: None,
        params_fresh: false,
    };
    let result = state.run(&master).await;
    // An exchange still in flight (the stop's grace ran out, or training
    // failed) holds the pserver client while it retries, for up to the
    // client's whole retry window: drop it, so the trainer stops now.
    state.in_flight = None;
    if let Some(schedule) = state.schedule.as_ref().filter(|_| state.sparse.is_none()) {
        state.report.stale_pulls = schedule.counts().stale_pulls;
        state.report.pulls = schedule.counts().pulls;
    }
    if state.joined && (result.is_err() || state.report.shut_down) {
        // Best effort, and brief: the lease's end also takes us out of the
        // barrier. (A job that is over needs no leave: its pservers may
        // already be gone, and retrying them would only delay the exit.)
        let leave = async { state.pservers.lock().await.leave().await };
        let _ = tokio::time::timeout(Duration::from_secs(5), leave).await;
    }
    let pservers = state.pservers.lock().await;
    state.report.shard_pushes = pservers.acknowledged_by_shard();
    state.report.applied_before = pservers.applied_before();
    drop(pservers);
    result.map(|()| state.report)
}

/// At the stop signal, how long the trainer tries to push what it trained,
/// send its reports and hand its tasks back before it gives up and stops.
pub const STOP_CALLS_FOR: Duration = Duration::from_secs(5);

/// Models up to this size overlap their async exchanges with training (see
/// [`TrainerOptions::overlap`]); larger ones exchange in place. Overlapping
/// costs two more copies of the model (the parameters arriving and the
/// gradients travelling), which for a small model is nothing and for a
/// large one would break the trainer's memory bound (1.3x its model).
pub const OVERLAP_MAX_BYTES: usize = 64 << 20;

/// Thirty years: the longest wait, so that a limit past the clock's
/// range (`Duration::MAX`) cannot overflow an `Instant`.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

struct Loop {
    model: AnyModel,
    options: TrainerOptions,
    params: ParamBuf,
    grads: ParamBuf,
    /// Async: weighted gradient sum since the last push.
    sum: ParamBuf,
    /// Async: examples behind `sum`.
    pending_weight: f32,
    /// Behind a lock so that an overlapped exchange can run in its own task.
    pservers: Arc<tokio::sync::Mutex<PserverClient>>,
    /// A sparse model's row buffers.
    sparse: Option<SparseBuffers>,
    /// Checked before every step: a trainer whose lease may have expired
    /// (paused past its ttl) has been given up by the job and must not push.
    lease: LeaseGuard,
    /// Cancelled: stop (see [`run_trainer`]).
    stop: CancellationToken,
    /// Once stopping: when the task in hand must be handed back if unfinished.
    stop_by: Option<Instant>,
    joined: bool,
    /// Async: when to push, pull, wait and yield.
    schedule: Option<Schedule>,
    /// Async with overlap: the exchange in flight.
    in_flight: Option<InFlight>,
    /// Async with overlap: the buffers an exchange borrows (gradient sum
    /// out, parameters in), here while no exchange is in flight.
    spare: Option<(ParamBuf, ParamBuf)>,
    /// Finished tasks whose last gradients are not pushed yet: they go with
    /// the next push.
    unpushed: Vec<(TaskRef, TaskStats)>,
    /// Finished tasks whose reports may go to the master: every gradient
    /// of theirs has been applied.
    ready: Vec<(TaskRef, TaskStats)>,
    /// Reports on their way to the master, at most one batch of them.
    reporting: Option<AbortOnDropHandle<Result<Vec<Reported>>>>,
    report: TrainerReport,
    /// The task in hand, for the origin of its pushes.
    task: Option<TaskOrigin>,
    /// Batch by batch (sync, and sparse models): the dense parameters at
    /// hand came back with the last push (a push-pull), so the next batch
    /// needs no pull. Cleared when the trainer joins or leaves the barrier
    /// and when a push comes back stale.
    params_fresh: bool,
}

/// The task in hand as its pushes name it (see [Exactly once](self#exactly-once)).
#[derive(Clone, Copy, Debug)]
struct TaskOrigin {
    task: TaskKey,
    floor: TaskKey,
    /// Async: the first example whose gradient is not pushed yet.
    next: u32,
    /// Some push of the task was acknowledged (logged once per task).
    pushed: bool,
}

impl TaskOrigin {
    /// The origin of a push of examples `start..end` of this task.
    fn of(&self, start: usize, end: usize) -> Origin {
        let at = |i: usize| u32::try_from(i).unwrap_or(u32::MAX);
        Origin { task: self.task, start: at(start), end: at(end), floor: self.floor }
    }
}

/// What a sparse model's batch works on, reused from batch to batch.
struct SparseBuffers {
    /// The batch's ids and their pulled values.
    rows: RowBatch,
    /// The row gradients, with the same ids.
    grads: RowBatch,
    /// What a row pull writes into, per table.
    pulled: Vec<Vec<f32>>,
    /// The next batch's ids, and their values once they came with this
    /// batch's push ([`PserverClient::push_pull_rows_ahead`]).
    next: RowBatch,
    /// What the rows asked with a push are written into, per table.
    next_pulled: Vec<Vec<f32>>,
    /// `next` holds the rows of the batch after the one last pushed.
    next_ready: bool,
}

/// A task's report and the master's answer.
type Reported = (TaskRef, ReportReply);

/// What a background exchange gives back: the gradient buffer, the
/// parameter buffer, its outcome and when it ended.
type Exchanged = (ParamBuf, ParamBuf, std::result::Result<(), oar_pserver::ServiceError>, Instant);

/// A background exchange and what waits for it.
struct InFlight {
    /// Gives back the buffers, and the exchange's outcome.
    done: AbortOnDropHandle<Exchanged>,
    /// When it started.
    started: Instant,
    /// Whether it brings parameters back.
    pulls: bool,
    /// Tasks whose last gradients it pushes: reported once it is applied.
    reports: Vec<(TaskRef, TaskStats)>,
    /// The origin of its push.
    origin: Option<Origin>,
}

impl Loop {
    /// Train until the job ends or the stop signal. From the stop signal
    /// on, everything is bounded: the task in hand gets its grace and each
    /// stop call its time ([`STOP_CALLS_FOR`]), and past all of those the
    /// trainer stops wherever it is (a call retried against a shard that
    /// is away would otherwise hold it for as long as the client retries).
    async fn run(&mut self, master: &Arc<MasterClient>) -> Result<()> {
        let stop = self.stop.clone();
        let at_most = self.options.stop_grace.saturating_add(3 * STOP_CALLS_FOR);
        let ran = tokio::select! {
            ran = self.run_tasks(master) => Some(ran),
            () = async { stop.cancelled().await; tokio::time::sleep(at_most).await } => None,
        };
        ran.unwrap_or_else(|| {
            tracing::warn!(
                trainer = self.options.id,
                ?at_most,
                "stopping without finishing what was under way"
            );
            self.report.shut_down = true;
            Ok(())
        })
    }

    async fn run_tasks(&mut self, master: &Arc<MasterClient>) -> Result<()> {
        let id = self.options.id.clone();
        // The next task, asked for while the current one trains.
        let mut ahead: Option<Ahead> = None;
        loop {
            lease_held(&self.lease)?;
            if self.stopping() {
                self.report.shut_down = true;
                // Each step bounded and best effort: the job may be stopping
                // too, and what is not acknowledged was never promised (its
                // lease's end returns the tasks anyway). The task fetched
                // ahead goes back first, since that needs the master only;
                // then what was trained goes out, and the reports of tasks
                // acknowledged before go even if the rest cannot.
                if let Some(Ahead { fetch, assigned }) = ahead.take() {
                    // The master's answer is all a hand-back needs: the
                    // task's data, if still being read, is dropped once it
                    // came (not before: a call cut short may have been
                    // assigned a task whose answer is then lost).
                    let answer = tokio::time::timeout(STOP_CALLS_FOR, assigned).await;
                    drop(fetch);
                    if let Ok(Ok(task_ref)) = answer {
                        self.hand_back(master, task_ref).await;
                    }
                }
                let drained = match tokio::time::timeout(STOP_CALLS_FOR, self.drain(master)).await {
                    Ok(Ok(())) => true,
                    Ok(Err(e)) => {
                        tracing::warn!(trainer = id, error = %e, "could not push or report at the stop");
                        false
                    }
                    Err(_) => {
                        tracing::warn!(trainer = id, "gave up pushing and reporting at the stop");
                        false
                    }
                };
                if !drained {
                    match tokio::time::timeout(STOP_CALLS_FOR, self.send_reports(master, true)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::warn!(trainer = id, error = %e, "could not report at the stop")
                        }
                        Err(_) => tracing::warn!(trainer = id, "gave up reporting at the stop"),
                    }
                }
                tracing::info!(trainer = id, "stopped at the stop signal");
                return Ok(());
            }
            let fetched = match ahead.take() {
                Some(Ahead { fetch: next, .. }) => match joined(next).await?? {
                    task @ Fetched::Task { .. } => task,
                    // A Wait, Done or Failed from before the current task
                    // ended is stale: finish what is in flight and ask again.
                    _ => {
                        self.drain(master).await?;
                        fetch(master, &id, &self.model, &self.options.reader, None).await?
                    }
                },
                None => fetch(master, &id, &self.model, &self.options.reader, None).await?,
            };
            match fetched {
                Fetched::Task { task, task_ref, open_from, data } => {
                    let key = |task| TaskKey { pass: task_ref.pass, task };
                    self.task = Some(TaskOrigin {
                        task: key(task.id.0),
                        floor: key(open_from.0),
                        next: 0,
                        pushed: false,
                    });
                    if self.options.prefetch && !self.stopping() {
                        let (master, id, model, reader) =
                            (master.clone(), id.clone(), self.model.clone(), self.options.reader.clone());
                        let span = tracing::Span::current();
                        let (assigning, assigned) = tokio::sync::oneshot::channel();
                        let fetch = spawn(
                            async move { fetch(&master, &id, &model, &reader, Some(assigning)).await }
                                .instrument(span),
                        );
                        ahead = Some(Ahead { fetch, assigned });
                    }
                    let span = tracing::info_span!("task", task = task.id.0, pass = task_ref.pass);
                    match self.do_task(master, task, task_ref, data).instrument(span).await? {
                        Trained::Finished(stats) => self.finished((task_ref, stats)).await?,
                        // do_task reports a diverged task failed.
                        Trained::Failed | Trained::Diverged(_) => {}
                        Trained::Interrupted => {
                            // Its gradients so far are pushed; the task goes back whole.
                            match tokio::time::timeout(STOP_CALLS_FOR, self.drain(master)).await {
                                Ok(drained) => drained?,
                                Err(_) => tracing::warn!(trainer = id, "gave up pushing at the stop"),
                            }
                            self.hand_back(master, task_ref).await;
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
                        self.params_fresh = false;
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
            // A grace beyond the clock's range is as good as no limit.
            self.stop_by = Some(Instant::now() + self.options.stop_grace.min(FAR_FUTURE));
        }
        self.stop_by.is_some()
    }

    /// Give a task back to the master unfinished, best effort and bounded
    /// (the master may be stopping too; the trainer's lease ending returns
    /// the task anyway).
    async fn hand_back(&mut self, master: &MasterClient, task_ref: TaskRef) {
        let (task, pass) = (task_ref.task.0, task_ref.pass);
        match tokio::time::timeout(STOP_CALLS_FOR, master.task_returned(&self.options.id, task_ref)).await {
            Ok(Ok(reply)) => {
                tracing::info!(trainer = self.options.id, task, pass, ?reply, "task handed back");
                if reply == ReportReply::Accepted {
                    self.report.tasks_returned += 1;
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(trainer = self.options.id, task, error = %e, "could not hand a task back")
            }
            Err(_) => tracing::warn!(trainer = self.options.id, task, "gave up handing a task back"),
        }
    }

    /// A task is trained on: its report is ready once its gradients are
    /// applied, which may be after an exchange still to come.
    async fn finished(&mut self, task: (TaskRef, TaskStats)) -> Result<()> {
        let Some(schedule) = &mut self.schedule else {
            // Sync: every step is applied before the next one starts.
            self.ready.push(task);
            return Ok(());
        };
        if schedule.unpushed() > 0 {
            self.unpushed.push(task);
            schedule.task_ended();
            return self.drive(Want::Flush).await;
        }
        match &mut self.in_flight {
            Some(f) => f.reports.push(task),
            None => self.ready.push(task),
        }
        Ok(())
    }

    /// Push every gradient, and wait for every report, before the trainer
    /// waits, stops or asks the master again.
    async fn drain(&mut self, master: &Arc<MasterClient>) -> Result<()> {
        self.drive(Want::Drain).await?;
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

    /// Wait for the reports in flight and count them. Cancel-safe like
    /// [`join`](Self::join): reports cut short stay on their way.
    async fn settle(&mut self) -> Result<()> {
        let Some(reporting) = self.reporting.as_mut() else {
            return Ok(());
        };
        let replies = background(reporting.await);
        self.reporting = None;
        for (task_ref, reply) in replies?? {
            let accepted = reply == ReportReply::Accepted;
            let (id, task, pass) = (&self.options.id, task_ref.task.0, task_ref.pass);
            tracing::info!(trainer = id, task, pass, accepted, "task reported");
            if accepted {
                self.report.tasks_finished += 1;
            }
        }
        if let Some(reported) = &self.options.reported {
            reported.notify_one();
        }
        Ok(())
    }

    /// Train on one task and return what to report, or report its data bad.
    async fn do_task(
        &mut self,
        master: &MasterClient,
        task: TaskSpec,
        task_ref: TaskRef,
        data: Result<(Examples, u64)>,
    ) -> Result<Trained> {
        let id = self.options.id.clone();
        tracing::info!(trainer = id, task = task.id.0, pass = task_ref.pass, "got task");
        if self.options.mode == Mode::Sync && !self.joined {
            lease_held(&self.lease)?;
            self.pservers.lock().await.join().await?;
            self.joined = true;
            self.params_fresh = false;
        }
        let (examples, skipped) = match data {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(trainer = id, task = task.id.0, error = %e, "task data is bad");
                master.task_failed(&id, task_ref, &format!("bad data: {e}")).await?;
                self.report.tasks_failed += 1;
                return Ok(Trained::Failed);
            }
        };
        let trained = self.train(&examples).await?;
        // A task's examples are one allocation each, made by the reading
        // thread: freeing them here would hold up the next task's first
        // step (~130 µs per a1a task of 5,000 examples) while taking the
        // reading thread's allocator lock; the blocking pool frees them.
        tokio::task::spawn_blocking(move || drop(examples));
        let mut stats = match trained {
            Trained::Finished(stats) => stats,
            Trained::Diverged(why) => {
                tracing::warn!(trainer = id, task = task.id.0, reason = %why, "task failed");
                if self.joined {
                    // Nothing of this step will come from us: do not make the others wait.
                    self.pservers.lock().await.leave().await?;
                    self.joined = false;
                    self.params_fresh = false;
                }
                master.task_failed(&id, task_ref, &why).await?;
                self.report.tasks_failed += 1;
                return Ok(Trained::Failed);
            }
            other => return Ok(other),
        };
        self.report.skipped_lines += skipped;
        stats.skipped_lines = skipped;
        tracing::info!(trainer = id, task = task.id.0, pass = task_ref.pass, "reporting task");
        Ok(Trained::Finished(stats))
    }

    /// Train on a task's examples: finished, interrupted (the stop
    /// signal's grace ran out) or diverged (a batch's loss is not finite;
    /// its gradient is not pushed).
    async fn train(&mut self, examples: &Examples) -> Result<Trained> {
        let mut stats = TaskStats::default();
        if let Some(buffers) = self.sparse.as_mut() {
            buffers.next_ready = false; // Rows of another task's batch.
        }
        let (n, size) = (examples.len(), self.options.batch_size);
        for start in (0..n).step_by(size) {
            let batch = start..(start + size).min(n);
            lease_held(&self.lease)?;
            if self.stopping() && self.stop_by.is_some_and(|by| Instant::now() >= by) {
                self.report.examples += stats.examples;
                self.report.loss_sum += stats.loss_sum;
                self.drop_unpushed();
                return Ok(Trained::Interrupted);
            }
            let loss = match (&self.model, examples) {
                (AnyModel::Dense(model), Examples::Dense(e)) => {
                    let model = model.clone();
                    match self.schedule {
                        None => self.sync_step(&*model, &e[batch.clone()], self.origin(&batch)).await?,
                        Some(_) => self.async_step(&*model, &e[batch.clone()]).await?,
                    }
                }
                (AnyModel::Sparse(model), Examples::Ids(e)) => {
                    let next = e.get(batch.end..(batch.end + size).min(n)).filter(|b| !b.is_empty());
                    self.sparse_step(model.clone(), &e[batch.clone()], next, self.origin(&batch)).await?
                }
                _ => {
                    return Err(Error::Panicked(
                        "a task's examples were read for another kind of model".into(),
                    ))
                }
            };
            if !loss.is_finite() {
                self.report.examples += stats.examples;
                self.report.loss_sum += stats.loss_sum;
                // The task fails, and may be tried again whole.
                self.drop_unpushed();
                return Ok(Trained::Diverged(format!(
                    "the loss of batch {} of {} is {loss}: training diverged (is the learning rate too high?)",
                    start / size + 1,
                    n.div_ceil(size)
                )));
            }
            stats.examples += batch.len() as u64;
            stats.loss_sum += loss as f64 * batch.len() as f64;
            // At debug: says where in its task a trainer is (a test stops
            // one where batches are left; an operator sees a slow task move).
            tracing::debug!(batch = start / size + 1, of = n.div_ceil(size), "batch trained");
            self.report.batches += 1;
            let m = metrics();
            m.batches.inc();
            m.examples.inc_by(batch.len() as u64);
        }
        self.report.examples += stats.examples;
        self.report.loss_sum += stats.loss_sum;
        let m = metrics();
        m.tasks.inc();
        if stats.examples > 0 {
            m.loss.set(stats.loss_sum / stats.examples as f64);
        }
        Ok(Trained::Finished(stats))
    }

    /// The origin of a push of the examples `batch` of the task in hand.
    fn origin(&self, batch: &std::ops::Range<usize>) -> Option<Origin> {
        self.task.map(|t| t.of(batch.start, batch.end))
    }

    /// A push from `origin` was acknowledged: the first of the task in
    /// hand is logged (a trainer that dies after it leaves examples of the
    /// task applied, which its rerun finds applied before).
    fn acknowledged(&mut self, origin: Option<Origin>) {
        let Some(t) = self.task.as_mut().filter(|t| !t.pushed && origin.is_some_and(|o| o.task == t.task))
        else {
            return;
        };
        t.pushed = true;
        let (trainer, task, pass) = (&self.options.id, t.task.task, t.task.pass);
        tracing::info!(trainer, task, pass, "first gradients of the task applied");
    }

    /// A task is handed back unfinished: drop the gradient not pushed yet
    /// (see [Exactly once](self#exactly-once)).
    fn drop_unpushed(&mut self) {
        if let Some(schedule) = &mut self.schedule {
            schedule.discard_unpushed();
        }
        self.sum.fill(0.0);
        self.pending_weight = 0.0;
    }

    /// Compute on step s, push for step s and take back step s + 1's
    /// parameters with the answer (one round trip per step: a push-pull
    /// answers when its step completes); pull first only when the
    /// parameters at hand are not the step's. If the pservers moved on
    /// without us (we were taken for gone), join and do it again at the new
    /// step.
    async fn sync_step(
        &mut self,
        model: &dyn Model,
        batch: &[Example],
        origin: Option<Origin>,
    ) -> Result<f32> {
        let mut pservers = self.pservers.lock().await;
        pservers.set_origin(origin);
        loop {
            let started = Instant::now();
            if !self.params_fresh {
                pservers.pull(&mut self.params).await?;
            }
            let loss = model.loss_and_grad(&self.params, batch, &mut self.grads);
            if !loss.is_finite() {
                return Ok(loss);
            }
            let pushed = pservers.push_pull(&self.grads, batch.len() as f32, &mut self.params).await?;
            self.params_fresh = pushed == PushResult::Accepted;
            match pushed {
                PushResult::Accepted => {
                    drop(pservers);
                    metrics().exchange.observe(started.elapsed().as_secs_f64());
                    self.report.pushes += 1;
                    self.report.pushed_examples += batch.len() as u64;
                    self.acknowledged(origin);
                    return Ok(loss);
                }
                PushResult::Stale => {
                    tracing::info!(trainer = self.options.id, "sync step moved on without us; rejoining");
                    // A trainer whose lease ended (paused past it) must
                    // not join again: its departure was handled already.
                    lease_held(&self.lease)?;
                    pservers.rejoin().await?;
                }
            }
        }
    }

    /// A sparse model's batch (see [Sparse models](self#sparse-models)):
    /// pull its rows (unless they came with the last push) and, sync or at
    /// the start, the dense parameters; run the model; push the row and
    /// dense gradients, with the rows of the `next` batch asked for in the
    /// same round trip; sync, again at the new step if the pservers moved
    /// on without us.
    async fn sparse_step(
        &mut self,
        model: Arc<dyn SparseModel>,
        batch: &[IdExample],
        next: Option<&[IdExample]>,
        origin: Option<Origin>,
    ) -> Result<f32> {
        let Some(buffers) = self.sparse.as_mut() else {
            return Err(Error::Panicked("a sparse step without row buffers".into()));
        };
        let sync = self.options.mode == Mode::Sync;
        let weight = batch.len() as f32;
        let mut pservers = self.pservers.lock().await;
        pservers.set_origin(origin);
        loop {
            let started = Instant::now();
            if !self.params_fresh {
                buffers.next_ready = false;
                if !sync {
                    pservers.forget_steps();
                }
                pservers.pull(&mut self.params).await?;
            }
            if std::mem::take(&mut buffers.next_ready) {
                std::mem::swap(&mut buffers.rows, &mut buffers.next);
            } else {
                model.batch_ids(batch, &mut buffers.rows);
                pull_batch_rows(&mut pservers, &mut buffers.rows, &mut buffers.pulled).await?;
                self.report.pulls += 1;
                metrics().row_pulls.inc();
            }
            // The batch's ids, zeroed: a model that adds to its gradients
            // (rather than overwriting them, as the trait asks) still pushes
            // the right ones.
            buffers.grads.clone_from(&buffers.rows);
            buffers.grads.fill(0.0);
            let loss =
                model.loss_and_grad(&self.params, &buffers.rows, batch, &mut self.grads, &mut buffers.grads);
            if !loss.is_finite() {
                return Ok(loss);
            }
            let grads = &buffers.grads;
            let tables: Vec<TableGrads<'_>> = (0..grads.tables())
                .map(|t| TableGrads { table: t as u32, ids: grads.ids(t), grads: grads.values(t) })
                .collect();
            let pushed = match next {
                Some(next) => {
                    model.batch_ids(next, &mut buffers.next);
                    let next_rows = &mut buffers.next;
                    buffers.next_pulled.resize_with(next_rows.tables(), Vec::new);
                    let ids: Vec<(u32, &[u64])> =
                        (0..next_rows.tables()).map(|t| (t as u32, next_rows.ids(t))).collect();
                    let ahead = RowsAhead { ids: &ids, out: &mut buffers.next_pulled };
                    let (pushed, came) = pservers
                        .push_pull_rows_ahead(&self.grads, &tables, weight, &mut self.params, ahead)
                        .await?;
                    if came {
                        for (t, values) in buffers.next_pulled.iter().enumerate() {
                            next_rows.values_mut(t).copy_from_slice(values);
                        }
                    }
                    buffers.next_ready = came;
                    pushed
                }
                None => pservers.push_pull_rows(&self.grads, &tables, weight, &mut self.params).await?,
            };
            self.params_fresh = pushed == PushResult::Accepted;
            if pushed == PushResult::Accepted {
                metrics().exchange.observe(started.elapsed().as_secs_f64());
                self.report.pushed_rows += tables.iter().map(|t| t.ids.len() as u64).sum::<u64>();
                self.report.pushes += 1;
                self.report.pushed_examples += batch.len() as u64;
                drop(pservers);
                self.acknowledged(origin);
                return Ok(loss);
            }
            tracing::info!(trainer = self.options.id, "sync step moved on without us; rejoining");
            lease_held(&self.lease)?;
            pservers.rejoin().await?;
        }
    }

    /// Async: do what the schedule says until it says to train, then
    /// train one batch: its gradient, weighted by the batch's size, is added
    /// to `sum` for the next push.
    async fn async_step(&mut self, model: &dyn Model, batch: &[Example]) -> Result<f32> {
        let stale_before = self.schedule.as_ref().map_or(0, |s| s.counts().stale_pulls);
        self.drive(Want::Batch).await?;
        let started = Instant::now();
        let stale_after = self.schedule.as_ref().map_or(0, |s| s.counts().stale_pulls);
        metrics().stale_pulls.inc_by(stale_after.saturating_sub(stale_before));
        if let Some(age) = self.schedule.as_ref().and_then(|s| s.parameters_age(started)) {
            metrics().parameter_age.observe(age.as_secs_f64());
        }
        let loss = model.loss_and_grad(&self.params, batch, &mut self.grads);
        if !loss.is_finite() {
            return Ok(loss);
        }
        let weight = batch.len() as f32;
        for (s, g) in self.sum.as_mut_slice().iter_mut().zip(self.grads.as_slice()) {
            *s += weight * g;
        }
        self.pending_weight += weight;
        if let Some(schedule) = &mut self.schedule {
            schedule.trained(started.elapsed());
        }
        Ok(loss)
    }

    /// Carry out the schedule's actions for `want` until it says to train
    /// (a batch) or that nothing is left to do (a flush, a drain).
    async fn drive(&mut self, want: Want) -> Result<()> {
        loop {
            let finished = self.in_flight.as_ref().is_some_and(|f| f.done.is_finished());
            let Some(schedule) = &mut self.schedule else { return Ok(()) };
            let now = Instant::now();
            match schedule.next(now, want, finished) {
                Action::Train | Action::Idle => return Ok(()),
                Action::Yield => {
                    tokio::task::yield_now().await;
                    if let Some(schedule) = &mut self.schedule {
                        schedule.yielded(Instant::now());
                    }
                }
                Action::Exchange(exchange) => {
                    schedule.started(now, exchange);
                    self.exchange_in_place(exchange).await?;
                    let ended = Instant::now();
                    metrics().exchange.observe(ended.saturating_duration_since(now).as_secs_f64());
                    if let Some(schedule) = &mut self.schedule {
                        schedule.exchanged(ended);
                    }
                }
                Action::Start(exchange) => {
                    schedule.started(now, exchange);
                    self.start(exchange)?;
                }
                Action::Join => self.join().await?,
            }
        }
    }

    /// The gradient to push: the weighted mean of what `sum` holds, and
    /// the examples behind it. The pushed batches' tasks are then waiting
    /// for this push.
    fn take_push(&mut self) -> (f32, Option<Origin>, Vec<(TaskRef, TaskStats)>) {
        let weight = self.pending_weight;
        let inv = 1.0 / weight;
        self.sum.as_mut_slice().iter_mut().for_each(|s| *s *= inv);
        self.pending_weight = 0.0;
        self.report.pushes += 1;
        self.report.pushed_examples += weight as u64;
        // The examples since the last push of this task.
        let origin = self.task.as_mut().map(|t| {
            let start = t.next as usize;
            let origin = t.of(start, start + weight as usize);
            t.next = origin.end;
            origin
        });
        (weight, origin, std::mem::take(&mut self.unpushed))
    }

    /// An exchange the loop waits for, on its own buffers.
    async fn exchange_in_place(&mut self, exchange: Exchange) -> Result<()> {
        let (weight, origin, reports) =
            if exchange.push { self.take_push() } else { (0.0, None, Vec::new()) };
        let mut pservers = self.pservers.lock().await;
        pservers.set_origin(origin);
        match (exchange.push, exchange.pull) {
            (true, true) => pservers.push_pull(&self.sum, weight, &mut self.params).await.map(drop)?,
            (true, false) => pservers.push(&self.sum, weight).await.map(drop)?,
            (false, true) => async_pull(&mut pservers, &mut self.params).await?,
            (false, false) => {}
        }
        drop(pservers);
        if exchange.push {
            self.sum.fill(0.0);
            self.acknowledged(origin);
        }
        self.ready.extend(reports);
        Ok(())
    }

    /// Start an exchange in its own task, on the spare buffers.
    fn start(&mut self, exchange: Exchange) -> Result<()> {
        let Some((spare_sum, mut params)) = self.spare.take() else {
            return Err(Error::Panicked("an exchange started while another holds the buffers".into()));
        };
        let (weight, origin, reports) =
            if exchange.push { self.take_push() } else { (0.0, None, Vec::new()) };
        // Without a push the spare goes out unused and comes back zeroed.
        let sum = if exchange.push { std::mem::replace(&mut self.sum, spare_sum) } else { spare_sum };
        let pservers = self.pservers.clone();
        let run = async move {
            let mut pservers = pservers.lock().await;
            pservers.set_origin(origin);
            let result = match (exchange.push, exchange.pull) {
                (true, true) => pservers.push_pull(&sum, weight, &mut params).await.map(drop),
                (true, false) => pservers.push(&sum, weight).await.map(drop),
                (false, true) => async_pull(&mut pservers, &mut params).await,
                (false, false) => Ok(()),
            };
            drop(pservers);
            (sum, params, result, Instant::now())
        };
        let done = spawn(run.instrument(tracing::Span::current()));
        self.in_flight =
            Some(InFlight { done, started: Instant::now(), pulls: exchange.pull, reports, origin });
        Ok(())
    }

    /// Take back the exchange in flight, waiting for it: its parameters
    /// become the ones trained on, and the tasks it pushed the last
    /// gradients of become ready to report.
    ///
    /// Cancel-safe: the exchange is awaited where it is and taken only
    /// once it ended, so a join cut short (the stop's bounded drain) leaves
    /// it in flight for the next join, as the schedule has it.
    async fn join(&mut self) -> Result<()> {
        // The schedule and the loop disagree: a bug, not a reason to spin.
        let disagree = || Error::Panicked("the schedule waits for an exchange that is not in flight".into());
        let outcome = match self.in_flight.as_mut() {
            Some(in_flight) => (&mut in_flight.done).await,
            None => return Err(disagree()),
        };
        let Some(InFlight { started, pulls, reports, origin, .. }) = self.in_flight.take() else {
            return Err(disagree());
        };
        let (mut sum, params, result, ended) = background(outcome)?;
        result?;
        metrics().exchange.observe(ended.saturating_duration_since(started).as_secs_f64());
        if let Some(schedule) = &mut self.schedule {
            schedule.exchanged(ended);
        }
        sum.fill(0.0);
        let params = if pulls { std::mem::replace(&mut self.params, params) } else { params };
        self.spare = Some((sum, params));
        self.ready.extend(reports);
        self.acknowledged(origin);
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
    /// A batch's loss is not finite (why): report the task failed.
    Diverged(String),
}

/// The master's answer to a trainer asking for a task, with the task's
/// data read (or why it could not be).
enum Fetched {
    Task {
        task: TaskSpec,
        task_ref: TaskRef,
        open_from: oar_task_queue::TaskId,
        data: Result<(Examples, u64)>,
    },
    Wait {
        retry_after_ms: u64,
    },
    Done,
    Failed,
}

/// The next task, asked for while the current one trains.
struct Ahead {
    /// The master's answer, with the task's data read.
    fetch: AbortOnDropHandle<Result<Fetched>>,
    /// The task assigned, as soon as the master answered (before the
    /// read): what a stop hands back, read or not.
    assigned: tokio::sync::oneshot::Receiver<TaskRef>,
}

/// Ask the master for a task and read its data (on the blocking pool);
/// `assigned` learns the task as soon as the master answers.
async fn fetch(
    master: &MasterClient,
    id: &str,
    model: &AnyModel,
    reader: &ReaderOptions,
    assigned: Option<tokio::sync::oneshot::Sender<TaskRef>>,
) -> Result<Fetched> {
    match master.get_task(id).await? {
        TaskReply::Assigned { task, task_ref, open_from, .. } => {
            if let Some(assigned) = assigned {
                // Nobody listening: the loop took the whole fetch instead.
                let _ = assigned.send(task_ref);
            }
            let data = read_task(&task, model.clone(), reader.clone()).await;
            Ok(Fetched::Task { task, task_ref, open_from, data })
        }
        TaskReply::Wait { retry_after_ms } => Ok(Fetched::Wait { retry_after_ms }),
        TaskReply::Done => Ok(Fetched::Done),
        TaskReply::Failed => Ok(Fetched::Failed),
    }
}

/// A task's examples, and how many bad lines were skipped.
async fn read_task(task: &TaskSpec, model: AnyModel, reader: ReaderOptions) -> Result<(Examples, u64)> {
    let chunks = task.chunks.clone();
    joined(AbortOnDropHandle::new(tokio::task::spawn_blocking(move || {
        model.read_chunks(&chunks, &reader).map(|(examples, skipped)| (examples, skipped as u64))
    })))
    .await?
}

/// Pull the rows of `rows`' ids into it, one call per pserver (`pulled`
/// is scratch space, reused).
async fn pull_batch_rows(
    pservers: &mut PserverClient,
    rows: &mut RowBatch,
    pulled: &mut Vec<Vec<f32>>,
) -> std::result::Result<(), oar_pserver::ServiceError> {
    pulled.resize_with(rows.tables(), Vec::new);
    let ids: Vec<(u32, &[u64])> = (0..rows.tables()).map(|t| (t as u32, rows.ids(t))).collect();
    pservers.pull_rows(&ids, pulled).await?;
    for (t, values) in pulled.iter().enumerate() {
        rows.values_mut(t).copy_from_slice(values);
    }
    Ok(())
}

/// Score a sparse model with dense parameters `dense` on `examples`, each
/// batch's rows pulled from the pservers as a trainer pulls them (one call
/// per pserver, `batch_size` examples at a time).
pub async fn score_sparse(
    pservers: &mut PserverClient,
    model: &dyn SparseModel,
    dense: &ParamBuf,
    examples: &[IdExample],
    batch_size: usize,
) -> std::result::Result<Evaluation, oar_pserver::ServiceError> {
    let (mut tally, mut rows, mut pulled, mut preds) =
        (Tally::default(), model.new_rows(), Vec::new(), Vec::new());
    for batch in examples.chunks(batch_size.max(1)) {
        model.batch_ids(batch, &mut rows);
        pull_batch_rows(pservers, &mut rows, &mut pulled).await?;
        let loss = model.predict(dense, &rows, batch, &mut preds);
        tally.add(loss, &preds, batch.iter().map(|e| e.label));
    }
    Ok(tally.evaluation())
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
    background(task.await)
}

/// A spawned task's output, or why it has none.
fn background<T>(outcome: std::result::Result<T, tokio::task::JoinError>) -> Result<T> {
    outcome.map_err(|e| Error::Panicked(format!("a background task: {e}")))
}

/// [`Error::LeaseLost`] once a trainer's lease may have ended: it must not
/// train, push or join a barrier any more (its departure may have been
/// handled already). A function of the lease alone, so that it can be
/// checked while other fields of the worker are borrowed.
fn lease_held(lease: &LeaseGuard) -> Result<()> {
    match lease.is_valid() {
        true => Ok(()),
        false => Err(Error::LeaseLost),
    }
}
