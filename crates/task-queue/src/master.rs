//! The master shell: holds the job's lock, serves the task queue to
//! trainers over a [`Transport`], and keeps the queue durable in
//! [`Discovery`] through the lock's fence.
//!
//! Writes are batched by group commit: every change marks the queue dirty,
//! one writer task stores the latest snapshot, and a trainer's report is
//! acknowledged only once a snapshot containing it is stored. So a finished
//! task stays finished across a master restart, at the cost of one etcd write
//! per batch of reports, not per report. Handing out a task is not waited
//! for: a task handed out just before a crash is handed out again, and the
//! first trainer's late report is then stale.
//!
//! What is stored under `master/state` is a [`StoredState`]: the queue's
//! [`Snapshot`] and the per-pass training statistics, so a master that takes
//! over reports the passes before it correctly. Its size is the snapshot's
//! plus a few bytes per pass and per listed discard (at most
//! [`MAX_DISCARDS_LISTED`]): for 100,000 tasks of one chunk, 100 passes of
//! statistics and the most discards listed with the longest reasons, 660,448
//! bytes, under etcd's default 1.5 MiB request limit (test
//! `stored_state_of_100k_tasks_fits_in_an_etcd_request`).

use crate::{
    protocol::{MasterRequest, MasterStatus, PassStats, ReportReply, TaskReply, MASTER_METHOD},
    Error, GetTask, JobState, QueueConfig, QueueEvent, Report, Result, Snapshot, TaskQueue, TaskSpec,
};
use async_trait::async_trait;
use bytes::Bytes;
use oar_discovery::{Discovery, Fence, JobKeys, LeaseGuard, Session, TrainerDepartures};
use oar_transport::{Frame, Handler, Listener, RemoteError, Transport};
use serde::{Deserialize, Serialize};
use std::{
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};
use tokio::sync::{watch, Notify};

/// How a master runs.
#[derive(Clone, Debug)]
pub struct MasterOptions {
    /// The job's name: its keys live under `/oar/<job>/`.
    pub job: String,
    /// This master's id, stored in the lock key.
    pub holder: String,
    /// Task timeouts, failure threshold and passes.
    pub queue: QueueConfig,
    /// The master's lease: when it expires a standby takes over.
    pub lease_ttl: Duration,
    /// How long to wait for the lock (a standby waits this long).
    pub lock_timeout: Duration,
    /// How often task deadlines are checked.
    pub tick_interval: Duration,
    /// The job's options, published under `config` if nobody did yet. A
    /// master given options that differ from the published ones refuses to
    /// start ([`Error::ConfigMismatch`]): one job, one set of options.
    pub config: Option<Vec<u8>>,
}

impl MasterOptions {
    /// Options with the defaults below for job `job`.
    pub fn new(job: &str, queue: QueueConfig) -> Self {
        Self {
            job: job.to_string(),
            holder: format!("master-{}", std::process::id()),
            queue,
            lease_ttl: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(3600),
            tick_interval: Duration::from_millis(100),
            config: None,
        }
    }
}

/// The master's metrics, registered on first use.
struct Metrics {
    /// Tasks of the current pass per state (todo, pending, done) and discarded over the job.
    tasks: oar_metrics::Family<Vec<(String, String)>, oar_metrics::Gauge>,
    /// The current pass (0-based).
    pass: oar_metrics::Gauge,
    /// Tasks finished, by pass.
    finished: oar_metrics::Family<Vec<(String, String)>, oar_metrics::Counter>,
    timeouts: oar_metrics::Counter,
    failed: oar_metrics::Counter,
    discards: oar_metrics::Counter,
    state_writes: oar_metrics::Counter,
    state_bytes: oar_metrics::Gauge,
}

fn metrics() -> &'static Metrics {
    static METRICS: std::sync::LazyLock<Metrics> = std::sync::LazyLock::new(|| {
        let m = Metrics {
            tasks: Default::default(),
            pass: Default::default(),
            finished: Default::default(),
            timeouts: Default::default(),
            failed: Default::default(),
            discards: Default::default(),
            state_writes: Default::default(),
            state_bytes: Default::default(),
        };
        use oar_metrics::register as r;
        r("oar_tasks", "Tasks of the current pass by state; discarded: over the job.", m.tasks.clone());
        r("oar_pass", "The current pass, 0-based.", m.pass.clone());
        r("oar_tasks_finished", "Tasks finished, by pass.", m.finished.clone());
        r("oar_task_timeouts", "Tasks taken back at their deadline.", m.timeouts.clone());
        r("oar_task_failures", "Task failures: reported bad, timed out, trainer gone.", m.failed.clone());
        r("oar_task_discards", "Tasks discarded after too many failures.", m.discards.clone());
        r("oar_master_state_writes", "Fenced writes of the master's state.", m.state_writes.clone());
        r("oar_master_state_bytes", "Size of the last state written.", m.state_bytes.clone());
        m
    });
    &METRICS
}

fn label(key: &str, value: impl ToString) -> Vec<(String, String)> {
    vec![(key.to_string(), value.to_string())]
}

/// A running master. Dropping it stops serving (the lease then expires).
pub struct Master {
    shared: Arc<Shared>,
    discovery: Arc<dyn Discovery>,
    fence: Fence,
    listener: Box<dyn Listener>,
    session: Option<Session>,
    background: Vec<tokio::task::JoinHandle<()>>,
    status: watch::Receiver<MasterStatus>,
}

struct Shared {
    queue: Mutex<Core>,
    /// Raised whenever the queue changed and needs storing.
    dirty: Notify,
    /// The highest queue version stored in discovery.
    persisted: watch::Sender<u64>,
    /// Why the master stopped serving, once it did.
    stopped: watch::Sender<Option<String>>,
    status: watch::Sender<MasterStatus>,
}

struct Core {
    queue: TaskQueue,
    passes: Vec<PassStats>,
    discarded: Vec<(u64, String)>,
}

impl Shared {
    fn core(&self) -> MutexGuard<'_, Core> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Log the core's events, publish the status, and wake the writer.
    fn changed(&self, core: &mut Core) {
        let m = metrics();
        for event in core.queue.drain_events() {
            match &event {
                QueueEvent::TaskDiscarded { task, pass, reason } => {
                    m.discards.inc();
                    tracing::warn!(task = task.0, pass, %reason, "task discarded");
                    if core.discarded.len() < MAX_DISCARDS_LISTED {
                        core.discarded.push((task.0, reason.clone()));
                    }
                }
                QueueEvent::TaskTimedOut { task_ref, trainer } => {
                    m.timeouts.inc();
                    m.failed.inc();
                    tracing::info!(task = task_ref.task.0, trainer, "task timed out")
                }
                QueueEvent::TaskFailed { task_ref, trainer, reason } => {
                    m.failed.inc();
                    tracing::info!(task = task_ref.task.0, trainer, %reason, "task failed")
                }
                QueueEvent::PassEnded { pass, done, discarded } => {
                    tracing::info!(pass, done, discarded, "pass ended")
                }
                QueueEvent::JobDone => tracing::info!("job done"),
                QueueEvent::JobFailed { pass } => tracing::error!(pass, "job failed"),
            }
        }
        let status = MasterStatus {
            queue: core.queue.status(),
            passes: core.passes.clone(),
            discarded: core.discarded.clone(),
        };
        let q = &status.queue;
        for (state, n) in
            [("todo", q.todo), ("pending", q.pending), ("done", q.done), ("discarded", q.discarded)]
        {
            m.tasks.get_or_create(&label("state", state)).set(n as i64);
        }
        m.pass.set(q.pass as i64);
        self.status.send_replace(status);
        self.dirty.notify_one();
    }

    fn stop(&self, why: String) {
        self.stopped.send_if_modified(|s| {
            if s.is_none() {
                tracing::error!(%why, "master stops serving");
                *s = Some(why);
                true
            } else {
                false
            }
        });
    }

    fn stopped_reason(&self) -> Option<String> {
        self.stopped.borrow().clone()
    }
}

impl Master {
    /// Take the job's lock (waiting as a standby while another master holds
    /// it), restore the queue from `master/state` or start it from `tasks`,
    /// serve at `listen_addr`, and publish `master/addr`.
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        listen_addr: &str,
        tasks: Vec<TaskSpec>,
        options: MasterOptions,
    ) -> Result<Master> {
        let keys = JobKeys::new(&options.job)?;
        metrics(); // Registered from the start, at zero.
        let session = Session::start(discovery.clone(), options.lease_ttl).await?;
        let fence = discovery
            .lock(
                &keys.master_lock(),
                options.holder.clone().into_bytes(),
                session.lease(),
                options.lock_timeout,
            )
            .await?;
        tracing::info!(holder = %options.holder, revision = fence.revision, "master holds the lock");

        if let Some(config) = &options.config {
            if let Some(existing) = discovery.get(&keys.config()).await? {
                if existing.value != *config {
                    return Err(Error::ConfigMismatch { key: keys.config() });
                }
            } else {
                discovery.create_if_absent(&keys.config(), config.clone(), None).await?;
            }
        }

        let now = Instant::now();
        let core = match discovery.get(&keys.master_state()).await? {
            Some(kv) => {
                let stored = StoredState::decode(&kv.value)?;
                let queue = TaskQueue::restore(stored.queue, options.queue.clone(), now)?;
                tracing::info!(status = ?queue.status(), "restored the task queue from discovery");
                Core { queue, passes: stored.passes, discarded: stored.discarded }
            }
            None => Core {
                queue: TaskQueue::new(tasks, options.queue.clone())?,
                passes: Vec::new(),
                discarded: Vec::new(),
            },
        };

        let status = MasterStatus {
            queue: core.queue.status(),
            passes: core.passes.clone(),
            discarded: core.discarded.clone(),
        };
        let (status_tx, status_rx) = watch::channel(status);
        let shared = Arc::new(Shared {
            queue: Mutex::new(core),
            dirty: Notify::new(),
            persisted: watch::channel(0).0,
            stopped: watch::channel(None).0,
            status: status_tx,
        });
        // Trainers that left while no master watched (between the last
        // master's end and now) hold restored pending tasks: take them back.
        let departures = TrainerDepartures::watch(&*discovery, &keys).await?;
        {
            let mut core = shared.core();
            for trainer in core.queue.pending_trainers() {
                if departures.present().binary_search(&trainer).is_err() {
                    let returned = core.queue.trainer_gone(&trainer, now);
                    tracing::info!(
                        trainer,
                        returned,
                        "trainer gone before this master started; its tasks return to todo"
                    );
                }
            }
            shared.changed(&mut core);
        }
        // Store the starting state before serving, so a restore never goes back.
        persist(&*discovery, &fence, &keys, &shared, true).await?;

        let handler = Arc::new(MasterHandler {
            shared: shared.clone(),
            lease: session.guard(),
            ack_timeout: options.lease_ttl,
            tick_interval: options.tick_interval,
        });
        let listener = transport.listen(listen_addr, handler).await?;
        discovery
            .put(&keys.master_addr(), listener.local_addr().as_bytes().to_vec(), Some(session.lease()))
            .await?;
        tracing::info!(addr = listener.local_addr(), "master serving");

        let lease_lost = session.lost_signal();
        let guard = shared.clone();
        let background = vec![
            tokio::spawn(writer(discovery.clone(), fence.clone(), keys, shared.clone())),
            tokio::spawn(ticker(shared.clone(), options.tick_interval)),
            tokio::spawn(trainer_watcher(departures, shared.clone())),
            tokio::spawn(async move {
                lease_lost.await;
                guard.stop("the master's lease is lost".into());
            }),
        ];
        Ok(Master {
            shared,
            discovery,
            fence,
            listener,
            session: Some(session),
            background,
            status: status_rx,
        })
    }

    /// The address trainers call.
    pub fn addr(&self) -> &str {
        self.listener.local_addr()
    }

    /// The job's status, updated on every change.
    pub fn status(&self) -> watch::Receiver<MasterStatus> {
        self.status.clone()
    }

    /// Wait until the job is done or failed and its final state is stored;
    /// an error if the master stopped serving first (lost lease or fence).
    pub async fn wait(&self) -> Result<JobState> {
        // Subscribe before looking, so a change in between is not missed.
        let mut status = self.status.clone();
        let mut persisted = self.shared.persisted.subscribe();
        let mut stopped = self.shared.stopped.subscribe();
        loop {
            status.borrow_and_update();
            let stored = *persisted.borrow_and_update();
            if let Some(why) = stopped.borrow_and_update().clone() {
                return Err(Error::Stopped(why));
            }
            let (state, version) = {
                let core = self.shared.core();
                (core.queue.status().state, core.queue.version())
            };
            if state != JobState::Running && stored >= version {
                return Ok(state);
            }
            tokio::select! {
                _ = status.changed() => {}
                _ = persisted.changed() => {}
                _ = stopped.changed() => {}
            }
        }
    }

    /// Write `key` through this master's fence: it fails with
    /// [`oar_discovery::Error::FenceLost`] once another master holds the lock.
    pub async fn put_fenced(&self, key: &str, value: Vec<u8>) -> Result<()> {
        self.discovery.put_fenced(&self.fence, key, value).await?;
        Ok(())
    }

    /// Stop serving and give up the lock.
    pub async fn shutdown(mut self) -> Result<()> {
        self.listener.close();
        self.background.iter().for_each(|t| t.abort());
        if let Some(session) = self.session.take() {
            session.close().await?;
        }
        Ok(())
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        self.listener.close();
        self.background.iter().for_each(|t| t.abort());
    }
}

/// Store the queue's current snapshot through the fence, unless a snapshot
/// at least as new is already stored (`always`: store it regardless, as at
/// start-up, when nothing of this master's is stored yet).
async fn persist(
    discovery: &dyn Discovery,
    fence: &Fence,
    keys: &JobKeys,
    shared: &Shared,
    always: bool,
) -> Result<()> {
    let (bytes, version) = {
        let core = shared.core();
        let stored = StoredState {
            queue: core.queue.snapshot(),
            passes: core.passes.clone(),
            discarded: core.discarded.clone(),
        };
        (stored.encode(), core.queue.version())
    };
    if !always && *shared.persisted.borrow() >= version {
        return Ok(());
    }
    let size = bytes.len();
    discovery.put_fenced(fence, &keys.master_state(), bytes).await?;
    metrics().state_writes.inc();
    metrics().state_bytes.set(size as i64);
    shared.persisted.send_if_modified(|v| {
        let raised = version > *v;
        *v = (*v).max(version);
        raised
    });
    Ok(())
}

/// The one writer: stores the newest snapshot whenever the queue changed.
/// Changes made while a write is in flight go out together in the next one.
async fn writer(discovery: Arc<dyn Discovery>, fence: Fence, keys: JobKeys, shared: Arc<Shared>) {
    loop {
        shared.dirty.notified().await;
        if let Err(e) = persist(&*discovery, &fence, &keys, &shared, false).await {
            match e {
                Error::Discovery(oar_discovery::Error::FenceLost { .. }) => {
                    shared.stop(format!("lost the master lock: {e}"));
                    return;
                }
                other => {
                    tracing::warn!(error = %other, "storing the task queue failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    shared.dirty.notify_one();
                }
            }
        }
    }
}

async fn ticker(shared: Arc<Shared>, every: Duration) {
    let mut interval = tokio::time::interval(every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let mut core = shared.core();
        if core.queue.tick(Instant::now()) > 0 {
            shared.changed(&mut core);
        }
    }
}

/// A trainer whose registration vanished (lease expired) gets its tasks
/// taken back at once instead of after the task timeout.
async fn trainer_watcher(mut departures: TrainerDepartures, shared: Arc<Shared>) {
    while let Some(departure) = departures.next().await {
        match departure {
            Ok(trainer) => {
                let mut core = shared.core();
                let returned = core.queue.trainer_gone(&trainer, Instant::now());
                tracing::info!(trainer, returned, "trainer gone; its tasks return to todo");
                if returned > 0 {
                    shared.changed(&mut core);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "trainer watch failed; relying on task timeouts");
                return;
            }
        }
    }
}

struct MasterHandler {
    shared: Arc<Shared>,
    /// Checked before every request: a master whose lease may have expired
    /// (paused past its ttl) must not hand out tasks a standby now owns.
    lease: LeaseGuard,
    ack_timeout: Duration,
    tick_interval: Duration,
}

impl MasterHandler {
    fn get_task(&self, trainer: &str) -> TaskReply {
        let mut core = self.shared.core();
        let now = Instant::now();
        let reply = match core.queue.get_task(trainer, now) {
            GetTask::Assigned(a) => TaskReply::Assigned {
                timeout_ms: a.deadline.saturating_duration_since(now).as_millis() as u64,
                task: a.task,
                task_ref: a.task_ref,
            },
            GetTask::Wait => {
                TaskReply::Wait { retry_after_ms: self.tick_interval.as_millis().max(10) as u64 }
            }
            GetTask::Done => TaskReply::Done,
            GetTask::Failed => TaskReply::Failed,
        };
        if let TaskReply::Assigned { task_ref, .. } = &reply {
            tracing::info!(trainer, task = task_ref.task.0, pass = task_ref.pass, "task assigned");
            self.shared.changed(&mut core);
        }
        reply
    }

    /// Apply a report, then wait until it is durable before acknowledging it.
    async fn report(
        &self,
        apply: impl FnOnce(&mut Core) -> Report,
    ) -> std::result::Result<ReportReply, RemoteError> {
        let version = {
            let mut core = self.shared.core();
            if apply(&mut core) == Report::Stale {
                return Ok(ReportReply::Stale);
            }
            self.shared.changed(&mut core);
            core.queue.version()
        };
        let mut persisted = self.shared.persisted.subscribe();
        let mut stopped = self.shared.stopped.subscribe();
        let durable = async {
            loop {
                if *persisted.borrow_and_update() >= version {
                    return Ok(());
                }
                if let Some(why) = stopped.borrow_and_update().clone() {
                    return Err(why);
                }
                tokio::select! {
                    r = persisted.changed() => if r.is_err() { return Err("master stopped".to_string()) },
                    r = stopped.changed() => if r.is_err() { return Err("master stopped".to_string()) },
                }
            }
        };
        match tokio::time::timeout(self.ack_timeout, durable).await {
            Ok(Ok(())) => Ok(ReportReply::Accepted),
            Ok(Err(why)) => Err(RemoteError::unavailable(why)),
            Err(_) => Err(RemoteError::unavailable(format!(
                "the report could not be stored within {:?}",
                self.ack_timeout
            ))),
        }
    }
}

#[async_trait]
impl Handler for MasterHandler {
    async fn handle(&self, request: Frame) -> std::result::Result<Frame, RemoteError> {
        if !self.lease.is_valid() {
            self.shared.stop("the master's lease may have expired (no refresh within its ttl)".into());
        }
        if let Some(why) = self.shared.stopped_reason() {
            return Err(RemoteError::unavailable(format!("master is not serving: {why}")));
        }
        if request.method != MASTER_METHOD {
            return Err(RemoteError::bad_request(format!("unknown master method {:#x}", request.method)));
        }
        let reply = match request.meta::<MasterRequest>()? {
            MasterRequest::GetTask { trainer } => {
                Frame::new(MASTER_METHOD, &self.get_task(&trainer), Bytes::new())
            }
            MasterRequest::TaskFinished { trainer, task_ref, stats } => {
                let reply = self
                    .report(|core| {
                        let outcome = core.queue.task_finished(task_ref, Instant::now());
                        if outcome == Report::Accepted {
                            let pass = task_ref.pass as usize;
                            if core.passes.len() <= pass {
                                core.passes.resize(pass + 1, PassStats::default());
                            }
                            let p = &mut core.passes[pass];
                            p.examples += stats.examples;
                            p.loss_sum += stats.loss_sum;
                            p.tasks_finished += 1;
                            p.skipped_lines += stats.skipped_lines;
                            metrics().finished.get_or_create(&label("pass", pass)).inc();
                        } else {
                            tracing::debug!(trainer, ?task_ref, "stale finished report");
                        }
                        outcome
                    })
                    .await?;
                Frame::new(MASTER_METHOD, &reply, Bytes::new())
            }
            MasterRequest::TaskFailed { trainer, task_ref, reason } => {
                tracing::info!(trainer, ?task_ref, %reason, "trainer reports a failed task");
                let reply =
                    self.report(|core| core.queue.task_failed(task_ref, &reason, Instant::now())).await?;
                Frame::new(MASTER_METHOD, &reply, Bytes::new())
            }
            MasterRequest::Status => Frame::new(MASTER_METHOD, &*self.shared.status.borrow(), Bytes::new()),
        };
        reply.map_err(RemoteError::internal)
    }
}

/// Discarded tasks listed with their reasons in the status and the stored
/// state; past this many only the count grows, so a dataset that is bad
/// throughout cannot push the state past etcd's request limit.
pub const MAX_DISCARDS_LISTED: usize = 100;

/// What the master stores under `master/state`: the task queue and the
/// statistics of each pass. Read it to see a job from outside
/// ([`StoredState::status`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredState {
    /// The task queue.
    pub queue: Snapshot,
    /// Training statistics per pass, index = pass.
    pub passes: Vec<PassStats>,
    /// Tasks discarded so far, with their reasons (the first
    /// [`MAX_DISCARDS_LISTED`]).
    pub discarded: Vec<(u64, String)>,
}

/// First bytes of an encoded [`StoredState`].
const STATE_MAGIC: &[u8; 4] = b"OARM";
/// The encoding's format number, after the magic.
const STATE_FORMAT: u8 = 1;

impl StoredState {
    /// The bytes to store: magic, format number, postcard body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = STATE_MAGIC.to_vec();
        out.push(STATE_FORMAT);
        // Cannot fail: every field has a known length and no custom serialiser errs.
        postcard::to_extend(self, out).unwrap_or_default()
    }

    /// Parses and validates bytes made by [`encode`](Self::encode). A bare
    /// [`Snapshot`] (what masters stored before the statistics were kept) is
    /// read as a state with no statistics.
    pub fn decode(bytes: &[u8]) -> Result<StoredState> {
        if bytes.starts_with(b"OARQ") {
            let queue = Snapshot::decode(bytes)?;
            return Ok(StoredState { queue, passes: Vec::new(), discarded: Vec::new() });
        }
        let stored: StoredState =
            crate::snapshot::decode_framed(bytes, STATE_MAGIC, STATE_FORMAT, "not a master state")?;
        stored.queue.unpack()?;
        Ok(stored)
    }

    /// The job's status as the master last stored it.
    pub fn status(&self, config: QueueConfig) -> Result<MasterStatus> {
        let queue = TaskQueue::restore(self.queue.clone(), config, Instant::now())?;
        Ok(MasterStatus {
            queue: queue.status(),
            passes: self.passes.clone(),
            discarded: self.discarded.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{chunk_files, tasks_from_chunks, MAX_REASON_BYTES};

    #[test]
    fn stored_state_of_100k_tasks_fits_in_an_etcd_request() {
        // 100,000 tasks of one 1 MiB chunk over 250 files, 100 passes of
        // statistics, and the most discards listed with the longest reasons.
        let files: Vec<(String, u64)> =
            (0..250).map(|i| (format!("/data/part-{i:05}.libsvm"), 400 << 20)).collect();
        let tasks = tasks_from_chunks(chunk_files(&files, 1 << 20).unwrap(), 1).unwrap();
        assert_eq!(tasks.len(), 100_000);
        let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 3, passes: 100 };
        let queue = TaskQueue::new(tasks, config.clone()).unwrap();
        let stats = PassStats { examples: 1 << 40, loss_sum: 1e9, tasks_finished: 100_000, skipped_lines: 7 };
        let reason = "r".repeat(MAX_REASON_BYTES);
        let stored = StoredState {
            queue: queue.snapshot(),
            passes: vec![stats; 100],
            discarded: (0..MAX_DISCARDS_LISTED as u64).map(|t| (t, reason.clone())).collect(),
        };
        let bytes = stored.encode();
        let limit = 3 << 19; // etcd's default 1.5 MiB
        eprintln!("stored master state for 100,000 tasks: {} bytes (limit {limit})", bytes.len());
        assert!(bytes.len() < limit, "{} bytes", bytes.len());
        let back = StoredState::decode(&bytes).unwrap();
        assert_eq!(back, stored);
        assert_eq!(back.status(config).unwrap().passes.len(), 100);
    }

    #[test]
    fn a_bare_snapshot_reads_as_a_state_without_statistics() {
        let tasks = tasks_from_chunks(vec![crate::Chunk { path: "a".into(), start: 0, end: 9 }], 1).unwrap();
        let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 3, passes: 1 };
        let snapshot = TaskQueue::new(tasks, config).unwrap().snapshot();
        let stored = StoredState::decode(&snapshot.encode()).unwrap();
        assert_eq!(stored.queue, snapshot);
        assert!(stored.passes.is_empty() && stored.discarded.is_empty());
    }

    #[test]
    fn garbage_state_is_an_error_that_says_why() {
        for (bytes, why) in [
            (&b"nope"[..], "expected magic"),
            (&b"OARM"[..], "truncated"),
            (&b"OARM\x09"[..], "unsupported format 9"),
            (&b"OARM\x01\xff\xff"[..], "corrupt body"),
        ] {
            let err = StoredState::decode(bytes).unwrap_err().to_string();
            assert!(err.contains(why), "{err:?} should say {why:?}");
        }
    }
}
