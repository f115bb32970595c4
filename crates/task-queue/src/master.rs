//! The master shell: holds the job's lock, serves the task queue to
//! trainers over a [`Transport`], and keeps the queue durable in
//! [`Discovery`] through the lock's fence.
//!
//! Writes are batched by group commit: a report wakes one writer task, which
//! stores everything that changed since its last write, and a trainer's
//! report is acknowledged only once a write containing it is stored. So a
//! finished task stays finished across a master restart, at the cost of one
//! etcd write per batch of reports, not per report. Handing out a task does
//! not wake the writer and is not waited for: it goes out with the next
//! report's write, or within one tick. A task handed out just before a crash
//! is handed out again, and the first trainer's late report is then stale.
//!
//! What is stored is a journal over a snapshot:
//! - `master/state` holds a [`StoredState`]: the queue's [`Snapshot`](crate::Snapshot) and the
//!   per-pass training statistics, so a master that takes over reports the
//!   passes before it correctly. Its size is the snapshot's plus a few bytes
//!   per pass and per listed discard (at most [`MAX_DISCARDS_LISTED`]): for
//!   100,000 tasks of one chunk, 100 passes of statistics and the most
//!   discards listed with the longest reasons, 660,448 bytes, under etcd's
//!   default 1.5 MiB request limit (test
//!   `stored_state_of_100k_tasks_fits_in_an_etcd_request`). A discarded
//!   task's reason is kept only for the job's first
//!   [`MAX_DISCARD_REASONS_KEPT`](crate::MAX_DISCARD_REASONS_KEPT)
//!   discards, so a job discarding every task stays under it too. A state
//!   or record over [`MasterOptions::max_state_bytes`] (by default the
//!   discovery backend's limit: etcd's) is
//!   [`Error::StateTooLarge`]: the master does not start, or stops. Past
//!   [`STATE_WARN_FRACTION`] of it, the master warns once, in its log and
//!   in a stream's problems: a stream's state grows with the files present
//!   in its directory (about 24 bytes each, so some 60,000 files reach
//!   etcd's default limit), and trained files must be removed.
//! - `master/journal/<version>` holds one [`JournalRecord`] per write since
//!   then: the tasks that changed ([`Delta`](crate::Delta)), the current pass's statistics
//!   and new discards; a few dozen bytes per report.
//!
//! A snapshot replaces the journal when a pass starts (every task changes),
//! when the journal's bytes reach the snapshot's (so a restore reads at most
//! twice the snapshot), after [`JOURNAL_MAX_RECORDS`] records, after a failed
//! write (its delta is lost, so the chain must restart), and when a master
//! starts. The records it covers are then deleted in one fenced range
//! delete; a record left over by a crash in between is skipped on restore,
//! because it is not newer than the snapshot. [`load`] reads
//! the key and the records in one read and replays them.
//!
//! **Streaming** ([`Master::start_stream`]): a poller asks the
//! [`TaskSource`] for new data every [`StreamOptions::poll_every`] (on the
//! blocking pool), from the mark the queue holds, and appends what it finds
//! as tasks with the source's new mark ([`TaskQueue::append`]). The write
//! that follows is a snapshot holding both, and the new tasks are handed
//! out only once it is stored ([`TaskQueue::stored`]): so a master that
//! takes over resumes the source from the stored mark, and the tasks it
//! appends again are the ones no trainer ever saw. The source closes by
//! itself (its marker) or when [`StreamOptions::close_key`] appears in
//! discovery ([`TaskSource::close`]: the same close as the marker's, what
//! it leaves out reported); the job is then done once everything is
//! trained. A close
//! asked while the source fails to poll (its file removed or rotated, its
//! directory gone) closes at the last good poll's mark, with the error
//! listed among the stream's problems: retrying would keep a job whose
//! data is gone open for ever.

use crate::{
    protocol::{
        MasterRequest, MasterStatus, PassStats, ReportReply, StreamStatus, TaskReply, MASTER_METHOD,
        MAX_TRAINER_ID_BYTES,
    },
    source::{Polled, SourceMark, TaskSource},
    Changes, Error, GetTask, JobState, JournalRecord, QueueConfig, QueueEvent, Report, Result, StoredState,
    TaskQueue, TaskSpec, TaskState, MAX_DISCARDS_LISTED,
};
use async_trait::async_trait;
use bytes::Bytes;
use oar_discovery::{DepartedMembers, Departures, Discovery, Fence, LeaseGuard, Session};
use oar_transport::{Frame, Handler, Listener, RemoteError, Transport};
use std::collections::{HashMap, HashSet};
use std::{
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};
use tokio::sync::{watch, Notify};

/// The discovery keys a master uses. The caller lays them out (`oar-job`
/// puts them under `/oar/<job>/`); [`MasterClient`](crate::MasterClient)
/// needs only [`addr`](Self::addr).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MasterKeys {
    /// The lock masters take (value: holder id; under the master's lease).
    pub lock: String,
    /// The serving master's address (under the master's lease).
    pub addr: String,
    /// The task-queue snapshot ([`StoredState`]), written through the fence.
    pub state: String,
    /// Prefix of the journal records written since the snapshot, each at
    /// `<journal><version:020>` so that they list in version order.
    pub journal: String,
    /// The job's options, published once ([`MasterOptions::config`]).
    pub config: String,
    /// Prefix under which trainers register (`<members><id>`, under their
    /// leases): a trainer whose key goes has its tasks taken back.
    pub members: String,
}

impl MasterKeys {
    /// The journal record that brings the queue to `version`.
    pub fn journal_record(&self, version: u64) -> String {
        format!("{}{version:020}", self.journal)
    }

    /// The keys the stored state is read from: the snapshot and the journal.
    fn state_listing_prefix(&self) -> String {
        common_prefix(&self.state, &self.journal)
    }
}

/// The longest common prefix of `a` and `b`, at a char boundary.
fn common_prefix(a: &str, b: &str) -> String {
    a.char_indices().zip(b.chars()).take_while(|((_, x), y)| x == y).map(|((_, x), _)| x).collect()
}

/// How a master runs.
#[derive(Clone, Debug)]
pub struct MasterOptions {
    /// Where its state, lock and address live.
    pub keys: MasterKeys,
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
    /// The job's options, published under `keys.config` if nobody did yet.
    /// A master given options that differ from the published ones refuses
    /// to start ([`Error::ConfigMismatch`]): one job, one set of options.
    pub config: Option<Vec<u8>>,
    /// The largest state (or journal record) the master writes; `None`
    /// (the default): the discovery backend's limit
    /// ([`Discovery::max_value_bytes`]: etcd's request limit, 1.5 MiB by
    /// default, none in memory). A larger one is [`Error::StateTooLarge`]:
    /// at start the master does not start, later it stops, where etcd's
    /// refusal used to be retried for ever and leave every report
    /// unacknowledged. 100,000 tasks take about 0.65 MiB.
    pub max_state_bytes: Option<usize>,
}

impl MasterOptions {
    /// Options with the defaults below for a master whose keys are `keys`.
    pub fn new(keys: MasterKeys, queue: QueueConfig) -> Self {
        Self {
            keys,
            holder: format!("master-{}", std::process::id()),
            queue,
            lease_ttl: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(3600),
            tick_interval: Duration::from_millis(100),
            config: None,
            max_state_bytes: None,
        }
    }
}

/// A streaming master's data (see [Streaming](self#streaming)).
pub struct StreamOptions {
    /// Where the data comes from.
    pub source: Box<dyn TaskSource>,
    /// Chunks per task.
    pub chunks_per_task: usize,
    /// How often the source is polled.
    pub poll_every: Duration,
    /// A discovery key whose appearance closes the source: the job then
    /// trains what the source holds and ends (`None`: only the source's own
    /// marker closes it).
    pub close_key: Option<String>,
}

impl StreamOptions {
    /// `source`, one chunk per task, polled every 100 ms, no close key.
    pub fn new(source: Box<dyn TaskSource>) -> Self {
        Self { source, chunks_per_task: 1, poll_every: Duration::from_millis(100), close_key: None }
    }
}

impl std::fmt::Debug for StreamOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamOptions")
            .field("source", &self.source.describe())
            .field("chunks_per_task", &self.chunks_per_task)
            .field("poll_every", &self.poll_every)
            .field("close_key", &self.close_key)
            .finish()
    }
}

/// What a master starts from when nothing is stored yet.
enum Dataset {
    Tasks(Vec<TaskSpec>),
    Stream(StreamOptions),
}

/// The most problems a [`StreamStatus`] lists.
const MAX_PROBLEMS_LISTED: usize = 20;

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
    snapshot_writes: oar_metrics::Counter,
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
            snapshot_writes: Default::default(),
            state_bytes: Default::default(),
        };
        use oar_metrics::register as r;
        r("oar_tasks", "Tasks of the current pass by state; discarded: over the job.", m.tasks.clone());
        r("oar_pass", "The current pass, 0-based.", m.pass.clone());
        r("oar_tasks_finished", "Tasks finished, by pass.", m.finished.clone());
        r("oar_task_timeouts", "Tasks taken back at their deadline.", m.timeouts.clone());
        r("oar_task_failures", "Task failures: reported bad, timed out, trainer gone.", m.failed.clone());
        r("oar_task_discards", "Tasks discarded after too many failures.", m.discards.clone());
        r(
            "oar_master_state_writes",
            "Fenced writes of the master's state: records and snapshots.",
            m.state_writes.clone(),
        );
        r(
            "oar_master_snapshot_writes",
            "Fenced writes of a whole snapshot of the master's state.",
            m.snapshot_writes.clone(),
        );
        r("oar_master_state_bytes", "Size of the last write of the master's state.", m.state_bytes.clone());
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
    keys: MasterKeys,
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
    /// [`MasterOptions::max_state_bytes`].
    max_state_bytes: usize,
    /// The state passed [`STATE_WARN_FRACTION`] of its limit, and was said so.
    state_size_warned: std::sync::atomic::AtomicBool,
    /// Trainers whose registration was seen to end, until one of them asks
    /// for a task again ([`MasterHandler::check_departed`]).
    departed: DepartedMembers,
}

struct Core {
    queue: TaskQueue,
    passes: Vec<PassStats>,
    discarded: Vec<(u64, String)>,
    /// Streaming: the source's status, and when each open task arrived.
    stream: Option<StreamStatus>,
    arrivals: HashMap<u64, Instant>,
}

impl Core {
    fn status(&self) -> MasterStatus {
        MasterStatus {
            queue: self.queue.status(),
            passes: self.passes.clone(),
            discarded: self.discarded.clone(),
            stream: self.stream.clone(),
        }
    }
}

impl Shared {
    fn core(&self) -> MutexGuard<'_, Core> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A trainer is gone: its pending tasks return to todo (stored soon
    /// if there were any). How many.
    fn take_back(&self, trainer: &str) -> usize {
        let mut core = self.core();
        let returned = core.queue.trainer_gone(trainer, Instant::now());
        if returned > 0 {
            self.changed(&mut core, true);
        }
        returned
    }

    /// Log the core's events, publish the status, and wake the writer if
    /// `store` (a hand-out does not: it goes out with the next write).
    fn changed(&self, core: &mut Core, store: bool) {
        let m = metrics();
        for event in core.queue.drain_events() {
            match &event {
                QueueEvent::TaskDiscarded { task, pass, reason } => {
                    m.discards.inc();
                    core.arrivals.remove(&task.0);
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
                QueueEvent::TaskReturned { task_ref, trainer } => {
                    tracing::info!(task = task_ref.task.0, trainer, "task handed back")
                }
                QueueEvent::PassEnded { pass, done, discarded } => {
                    tracing::info!(pass, done, discarded, "pass ended")
                }
                QueueEvent::JobDone => tracing::info!("job done"),
                QueueEvent::JobAborted { pass, reason, discarded } => {
                    tracing::error!(pass, %reason, discarded = discarded.len(), "job aborted");
                    for task in discarded {
                        if core.discarded.len() < MAX_DISCARDS_LISTED {
                            core.discarded.push((task.0, reason.clone()));
                        }
                    }
                }
                QueueEvent::JobFailed { pass } => tracing::error!(pass, "job failed"),
            }
        }
        let status = core.status();
        let q = &status.queue;
        for (state, n) in
            [("todo", q.todo), ("pending", q.pending), ("done", q.done), ("discarded", q.discarded)]
        {
            m.tasks.get_or_create(&label("state", state)).set(n as i64);
        }
        m.pass.set(q.pass as i64);
        self.status.send_replace(status);
        if store {
            self.dirty.notify_one();
        }
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
        Self::start_with(discovery, transport, listen_addr, Dataset::Tasks(tasks), options).await
    }

    /// [`start`](Self::start) for a streaming job: the queue starts empty
    /// (or restored, with its source's mark) and grows as `stream`'s source
    /// yields data (see [Streaming](self#streaming)). `options.queue.passes`
    /// must be 1. Errors if the stored state is a batch job's.
    pub async fn start_stream(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        listen_addr: &str,
        stream: StreamOptions,
        options: MasterOptions,
    ) -> Result<Master> {
        Self::start_with(discovery, transport, listen_addr, Dataset::Stream(stream), options).await
    }

    async fn start_with(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        listen_addr: &str,
        dataset: Dataset,
        options: MasterOptions,
    ) -> Result<Master> {
        let keys = options.keys.clone();
        metrics(); // Registered from the start, at zero.
        let session = Session::start(discovery.clone(), options.lease_ttl).await?;
        let fence = discovery
            .lock(&keys.lock, options.holder.clone().into_bytes(), session.lease(), options.lock_timeout)
            .await?;
        tracing::info!(holder = %options.holder, revision = fence.revision, "master holds the lock");

        // What this start publishes for the first time, taken back if it
        // cannot serve (below).
        let mut created_config = false;
        if let Some(config) = &options.config {
            if let Some(existing) = discovery.get(&keys.config).await? {
                if existing.value != *config {
                    return Err(Error::ConfigMismatch { key: keys.config.clone() });
                }
            } else {
                created_config =
                    discovery.create_if_absent(&keys.config, config.clone(), None).await?.is_some();
            }
        }

        let now = Instant::now();
        let stored = load(&*discovery, &keys).await?;
        let fresh = stored.is_none();
        let (queue, passes, discarded) = match stored {
            Some(stored) => {
                let queue = TaskQueue::restore(stored.queue, options.queue.clone(), now)?;
                tracing::info!(status = ?queue.status(), "restored the task queue from discovery");
                (queue, stored.passes, stored.discarded)
            }
            None => {
                let queue = match &dataset {
                    Dataset::Tasks(tasks) => TaskQueue::new(tasks.clone(), options.queue.clone())?,
                    Dataset::Stream(_) => TaskQueue::streaming(options.queue.clone())?,
                };
                (queue, Vec::new(), Vec::new())
            }
        };
        let (stream, stream_status) = match dataset {
            Dataset::Stream(stream) => {
                if queue.source_mark().is_none() {
                    return Err(Error::BadConfig(format!(
                        "the state stored under {} is a batch job's, not a stream's",
                        keys.state
                    )));
                }
                let status = StreamStatus { source: stream.source.describe(), ..StreamStatus::default() };
                (Some(stream), Some(status))
            }
            Dataset::Tasks(_) if queue.source_mark().is_some() => {
                return Err(Error::BadConfig(format!(
                    "the state stored under {} is a streaming job's, not a batch job's",
                    keys.state
                )));
            }
            Dataset::Tasks(_) => (None, None),
        };
        // Tasks restored open count as arriving now (their real arrival went with the last master).
        let arrivals = match stream {
            Some(_) => queue
                .tasks()
                .filter(|t| {
                    matches!(queue.task_state(t.id), Some(TaskState::Todo | TaskState::Pending { .. }))
                })
                .map(|t| (t.id.0, now))
                .collect(),
            None => HashMap::new(),
        };
        let core = Core { queue, passes, discarded, stream: stream_status, arrivals };
        let status = core.status();
        let (status_tx, status_rx) = watch::channel(status);
        let shared = Arc::new(Shared {
            queue: Mutex::new(core),
            dirty: Notify::new(),
            persisted: watch::channel(0).0,
            stopped: watch::channel(None).0,
            status: status_tx,
            max_state_bytes: options.max_state_bytes.or(discovery.max_value_bytes()).unwrap_or(usize::MAX),
            state_size_warned: Default::default(),
            departed: DepartedMembers::new(&keys.members),
        });
        // Trainers that left while no master watched (between the last
        // master's end and now) hold restored pending tasks: take them back.
        let departures = Departures::watch(discovery.clone(), &keys.members).await?;
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
            shared.changed(&mut core, true);
        }
        // Store the starting state before serving, so a restore never goes
        // back, and start the journal afresh.
        let mut journal = Journal::default();
        persist(&*discovery, &fence, &keys, &shared, &mut journal, true).await?;

        // A stream's tasks come at its polls: an idle trainer asks again
        // within a quarter of one, not a whole tick later.
        let wait_hint = match &stream {
            Some(stream) => options.tick_interval.min(stream.poll_every / 4),
            None => options.tick_interval,
        };
        let handler = Arc::new(MasterHandler {
            shared: shared.clone(),
            lease: session.guard(),
            ack_timeout: options.lease_ttl,
            wait_hint,
            discovery: discovery.clone(),
        });
        let listener = match transport.listen(listen_addr, handler).await {
            Ok(listener) => listener,
            Err(e) => {
                // A master that never served leaves nothing a later start
                // would trip on: a new job's options and first state go
                // (else the name is taken by a job that never ran: "started
                // with other options"), and the lock at once, not a lease
                // later.
                if fresh {
                    let mut taken_back = vec![&keys.state];
                    taken_back.extend(created_config.then_some(&keys.config));
                    for key in taken_back {
                        if let Err(deleting) = discovery.delete_fenced(&fence, key).await {
                            tracing::warn!(key, error = %deleting, "cannot take back a key of a start that failed");
                        }
                    }
                }
                if let Err(closing) = session.close().await {
                    tracing::warn!(error = %closing, "closing the session of a start that failed");
                }
                return Err(e.into());
            }
        };
        discovery.put(&keys.addr, listener.local_addr().as_bytes().to_vec(), Some(session.lease())).await?;
        tracing::info!(addr = listener.local_addr(), "master serving");

        let lease_lost = session.lost_signal();
        let guard = shared.clone();
        let mut background = vec![
            tokio::spawn(writer(discovery.clone(), fence.clone(), keys.clone(), shared.clone(), journal)),
            tokio::spawn(ticker(shared.clone(), options.tick_interval)),
            tokio::spawn(trainer_watcher(departures, shared.clone())),
            tokio::spawn(async move {
                lease_lost.await;
                guard.stop("the master's lease is lost".into());
            }),
        ];
        if let Some(stream) = stream {
            background.push(tokio::spawn(poller(discovery.clone(), shared.clone(), stream)));
        }
        Ok(Master {
            shared,
            discovery,
            fence,
            keys,
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

    /// End the job as failed now, for `reason` (every open task is
    /// discarded with it; see [`TaskQueue::abort`]); trainers are told the
    /// job failed at their next call, and [`wait`](Self::wait) returns once
    /// that is stored. False if the job had already ended.
    pub fn abort(&self, reason: &str) -> bool {
        let mut core = self.shared.core();
        let aborted = core.queue.abort(reason, Instant::now());
        if aborted {
            self.shared.changed(&mut core, true);
        }
        aborted
    }

    /// The fence of this master's lock: writes made with it fail once
    /// another master holds the lock (for services that run with the
    /// master, such as the pservers' coordinator).
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Write `key` through this master's fence: it fails with
    /// [`oar_discovery::Error::FenceLost`] once another master holds the lock.
    pub async fn put_fenced(&self, key: &str, value: Vec<u8>) -> Result<()> {
        self.discovery.put_fenced(&self.fence, key, value).await?;
        Ok(())
    }

    /// Stop serving, store what is not stored yet (hand-outs since the last
    /// write) as a snapshot, and give up the lock.
    pub async fn shutdown(mut self) -> Result<()> {
        self.listener.close();
        self.background.iter().for_each(|t| t.abort());
        if self.shared.stopped_reason().is_none() {
            // A snapshot, whatever the aborted writer had stored: a record
            // it left in flight is then covered, and skipped on restore.
            let mut journal = Journal::default();
            let last = persist(&*self.discovery, &self.fence, &self.keys, &self.shared, &mut journal, true);
            if let Err(e) = last.await {
                tracing::warn!(error = %e, "storing the task queue at shutdown failed");
            }
        }
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

/// Records written since the last snapshot after which the next write is a
/// snapshot, whatever their size: bounds the keys a restore lists.
pub const JOURNAL_MAX_RECORDS: usize = 1000;

/// The writer's bookkeeping of what is stored.
#[derive(Debug, Default)]
struct Journal {
    /// Records stored since the last snapshot, and their bytes.
    records: usize,
    bytes: usize,
    /// The last snapshot's bytes.
    snapshot_bytes: usize,
    /// The next write must be a snapshot: a write failed, so its delta is
    /// not stored and the chain of deltas is broken.
    snapshot_due: bool,
    /// How many of the core's listed discards are stored.
    discards_stored: usize,
}

impl Journal {
    fn wants_snapshot(&self) -> bool {
        self.snapshot_due || self.records >= JOURNAL_MAX_RECORDS || self.bytes >= self.snapshot_bytes
    }
}

/// Store what changed since the last write through the fence: a journal
/// record, or a snapshot when one is due (`always`: store a snapshot even if
/// nothing changed, as at start-up, when nothing of this master's is stored
/// yet).
async fn persist(
    discovery: &dyn Discovery,
    fence: &Fence,
    keys: &MasterKeys,
    shared: &Shared,
    journal: &mut Journal,
    always: bool,
) -> Result<()> {
    enum Write {
        Snapshot(StoredState),
        Record(JournalRecord),
    }
    let (write, version, discards) = {
        let mut core = shared.core();
        let version = core.queue.version();
        if !always && *shared.persisted.borrow() >= version {
            return Ok(());
        }
        let write = match core.queue.take_changes(always || journal.wants_snapshot()) {
            Changes::Snapshot(queue) => Write::Snapshot(StoredState {
                queue,
                passes: core.passes.clone(),
                discarded: core.discarded.clone(),
            }),
            Changes::Delta(delta) => {
                let pass_stats = core.passes.get(delta.pass() as usize).copied();
                let discarded = core.discarded.get(journal.discards_stored..).unwrap_or_default().to_vec();
                Write::Record(JournalRecord { delta, pass_stats, discarded })
            }
        };
        (write, version, core.discarded.len())
    };
    // Encoded outside the lock: trainers' calls need it meanwhile.
    let (key, bytes) = match &write {
        Write::Snapshot(state) => (keys.state.clone(), state.encode()),
        Write::Record(record) => (keys.journal_record(version), record.encode()),
    };
    let size = bytes.len();
    if size as f64 > shared.max_state_bytes as f64 * STATE_WARN_FRACTION
        && !shared.state_size_warned.swap(true, std::sync::atomic::Ordering::SeqCst)
    {
        let problem = format!(
            "the master's state is {size} bytes, past {:.0}% of its limit of {} bytes: at the limit \
             the master stops. A stream from a directory keeps about 24 bytes in it per file \
             present: remove files once trained (or write fewer, larger ones)",
            STATE_WARN_FRACTION * 100.0,
            shared.max_state_bytes
        );
        tracing::warn!(%problem, "the master's state nears its limit");
        note_problem(shared, problem);
    }
    if size > shared.max_state_bytes {
        journal.snapshot_due = true;
        return Err(Error::StateTooLarge { key, bytes: size, max: shared.max_state_bytes });
    }
    if let Err(e) = discovery.put_fenced(fence, &key, bytes).await {
        journal.snapshot_due = true;
        return Err(e.into());
    }
    let m = metrics();
    m.state_writes.inc();
    m.state_bytes.set(size as i64);
    {
        let mut core = shared.core();
        // The discards this write holds may raise the floor now.
        core.queue.stored_up_to(version);
        // Streaming: the tasks this write holds may be handed out now.
        if core.queue.staged() > 0 {
            core.queue.stored();
            shared.changed(&mut core, false);
        }
    }
    match write {
        Write::Snapshot(_) => {
            m.snapshot_writes.inc();
            *journal = Journal { snapshot_bytes: size, discards_stored: discards, ..Journal::default() };
            // The records up to this version are covered now. A failure
            // here leaves records a restore skips; the next snapshot retries.
            let covered = keys.journal_record(version.saturating_add(1));
            match discovery.delete_range_fenced(fence, &keys.journal, &covered).await {
                Ok(()) => {}
                Err(e @ oar_discovery::Error::FenceLost { .. }) => return Err(e.into()),
                Err(e) => tracing::warn!(error = %e, "deleting covered journal records failed"),
            }
        }
        Write::Record(_) => {
            journal.records += 1;
            journal.bytes += size;
            journal.discards_stored = discards;
        }
    }
    shared.persisted.send_if_modified(|v| {
        let raised = version > *v;
        *v = (*v).max(version);
        raised
    });
    Ok(())
}

/// The one writer: stores what changed whenever a change wants storing.
/// Changes made while a write is in flight go out together in the next one.
async fn writer(
    discovery: Arc<dyn Discovery>,
    fence: Fence,
    keys: MasterKeys,
    shared: Arc<Shared>,
    mut journal: Journal,
) {
    loop {
        shared.dirty.notified().await;
        if let Err(e) = persist(&*discovery, &fence, &keys, &shared, &mut journal, false).await {
            match e {
                Error::Discovery(oar_discovery::Error::FenceLost { .. }) => {
                    shared.stop(format!("lost the master lock: {e}"));
                    return;
                }
                Error::StateTooLarge { .. } => {
                    // Retrying cannot help: the state only grows.
                    tracing::error!(error = %e, "the master cannot store its state; stopping");
                    shared.stop(e.to_string());
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
            shared.changed(&mut core, true);
        } else if core.queue.version() > *shared.persisted.borrow() {
            // Hand-outs since the last write: store them within a tick, so
            // a master taking over knows who holds what.
            shared.dirty.notify_one();
        }
    }
}

/// Streaming: poll the source every `poll_every` from the mark the queue
/// holds and append what it yields, until the source is closed or the
/// master stops. A poll that fails is logged and retried (the operator may
/// fix a file; the status lists the error meanwhile), unless the close was
/// asked: then the stream closes at the last good poll's mark, and the
/// status lists the error as what was left out; a problem the source
/// reports (bad input, naming its file) is logged once and listed in the
/// status; a poll that panics stops the master.
async fn poller(discovery: Arc<dyn Discovery>, shared: Arc<Shared>, stream: StreamOptions) {
    let StreamOptions { source, chunks_per_task, poll_every, close_key } = stream;
    let source = Arc::new(Mutex::new(source));
    let mut interval = tokio::time::interval(poll_every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reported: HashSet<String> = Default::default();
    let mut last_error = None;
    loop {
        interval.tick().await;
        if shared.stopped_reason().is_some() {
            return;
        }
        let mark = {
            let core = shared.core();
            match core.queue.source_mark() {
                Some((_, true)) | None => return,
                Some(_) if core.queue.status().state != JobState::Running => return,
                Some((mark, false)) => SourceMark(mark.to_vec()),
            }
        };
        // Asked to close: this poll is the last, and what it finds is
        // trained; the source closes as its marker would (reporting what it
        // leaves out).
        let close_asked = match &close_key {
            Some(key) => matches!(discovery.get(key).await, Ok(Some(_))),
            None => false,
        };
        let poll = {
            let (source, mark) = (source.clone(), mark.clone());
            tokio::task::spawn_blocking(move || {
                let mut source = source.lock().unwrap_or_else(PoisonError::into_inner);
                if close_asked {
                    source.close(&mark)
                } else {
                    source.poll(&mark)
                }
            })
        };
        let polled = match poll.await {
            Ok(Ok(polled)) => polled,
            Ok(Err(e)) if close_asked => {
                // The operator ends the stream and the source cannot be
                // read (a file removed or rotated may never come back):
                // close where the last good poll left it, and say what that
                // leaves out. Retrying would keep the job open for ever.
                let position = shared.core().stream.as_ref().map(|s| s.position.clone()).unwrap_or_default();
                let problem = format!(
                    "closed while polling the source failed ({e}): nothing after the last good poll \
                     ({position}) is trained"
                );
                tracing::warn!(%problem, "the stream is closed with its source failing");
                note_problem(&shared, problem);
                Polled { mark: mark.clone(), closed: true, position, ..Polled::default() }
            }
            Ok(Err(e)) => {
                let e = e.to_string();
                if last_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "polling the source failed; retrying");
                    note_problem(&shared, e.clone());
                    last_error = Some(e);
                }
                continue;
            }
            Err(e) => {
                // A bug in the source: the stream cannot go on, and a job
                // waiting for it would wait for ever. Stop serving, saying why.
                note_problem(&shared, format!("polling the source panicked: {e}"));
                shared.stop(format!("polling the source ({}) panicked: {e}", describe(&source)));
                return;
            }
        };
        last_error = None;
        for problem in &polled.problems {
            if reported.insert(problem.clone()) {
                tracing::warn!(%problem, "bad input in the source; the job goes on without it");
                note_problem(&shared, problem.clone());
            }
        }
        let closed = polled.closed || close_asked;
        let mut core = shared.core();
        if let Some(status) = &mut core.stream {
            status.position = polled.position.clone();
        }
        let now = Instant::now();
        // Only an append changes what is stored; the rest is status.
        let appended = !polled.chunks.is_empty() || polled.mark != mark || closed;
        if appended {
            let tasks = tasks_of(polled.chunks, chunks_per_task);
            match core.queue.append(tasks, polled.mark.0, closed) {
                Ok(ids) => {
                    if !ids.is_empty() || closed {
                        tracing::info!(tasks = ids.len(), closed, "tasks appended from the source");
                    }
                    for id in ids {
                        core.arrivals.insert(id.0, now);
                    }
                }
                Err(e) => tracing::error!(error = %e, "appending the source's tasks failed"),
            }
        }
        let oldest =
            core.arrivals.values().min().map_or(0.0, |t| now.saturating_duration_since(*t).as_secs_f64());
        let backlog = core.queue.status().todo + core.queue.staged();
        if let Some(status) = &mut core.stream {
            status.closed = closed;
            status.oldest_open_seconds = oldest;
            status.backlog = backlog;
        }
        shared.changed(&mut core, appended);
    }
}

/// A poll's chunks as tasks: at least `chunks_per_task` chunks each, and
/// more while a task holds less than [`auto_chunk_bytes`](crate::auto_chunk_bytes)
/// of the poll's bytes (a 32nd of them, 16 KiB to 8 MiB). A trickle of data
/// keeps small tasks, and its latency; a backlog (a master started on a
/// full directory, or one catching up) gets large ones, as a fixed glob
/// would, instead of a task per small chunk. A task never spans two files,
/// so a bad file fails only its own tasks.
fn tasks_of(chunks: Vec<crate::Chunk>, chunks_per_task: usize) -> Vec<Vec<crate::Chunk>> {
    let len = |c: &crate::Chunk| c.end.saturating_sub(c.start);
    let target = crate::auto_chunk_bytes(chunks.iter().map(len).sum());
    let mut tasks = Vec::new();
    let (mut task, mut bytes) = (Vec::new(), 0u64);
    for chunk in chunks {
        let other_file = task.last().is_some_and(|last: &crate::Chunk| last.path != chunk.path);
        if other_file || (task.len() >= chunks_per_task.max(1) && bytes + len(&chunk) > target) {
            tasks.push(std::mem::take(&mut task));
            bytes = 0;
        }
        bytes += len(&chunk);
        task.push(chunk);
    }
    if !task.is_empty() {
        tasks.push(task);
    }
    tasks
}

/// What the source is, for a message (its lock may be poisoned by a panic).
fn describe(source: &Mutex<Box<dyn TaskSource>>) -> String {
    source.lock().unwrap_or_else(PoisonError::into_inner).describe()
}

/// The share of [`MasterOptions::max_state_bytes`] past which the master
/// warns, once (in its log, and in a stream's problems): a stream's state
/// grows with the files present in its directory, and the master stops
/// when it reaches the limit.
pub const STATE_WARN_FRACTION: f64 = 0.75;

/// List a problem of the source in the status (the last ones).
fn note_problem(shared: &Shared, problem: String) {
    let mut core = shared.core();
    if let Some(status) = &mut core.stream {
        if status.problems.len() >= MAX_PROBLEMS_LISTED {
            status.problems.remove(0);
        }
        status.problems.push(problem);
    }
    shared.changed(&mut core, false);
}

/// A trainer whose registration vanished (lease expired) gets its tasks
/// taken back at once instead of after the task timeout.
async fn trainer_watcher(mut departures: Departures, shared: Arc<Shared>) {
    while let Some(departure) = departures.next().await {
        match departure {
            Ok(trainer) => {
                shared.departed.remember(&trainer);
                let returned = shared.take_back(&trainer);
                tracing::info!(trainer, returned, "trainer gone; its tasks return to todo");
            }
            Err(e) => {
                // Only a failure that will repeat ends up here: a watch that
                // merely broke is followed again by `Departures`.
                tracing::error!(error = %e, "cannot follow the trainers; relying on task timeouts");
                return;
            }
        }
    }
}

struct MasterHandler {
    shared: Arc<Shared>,
    /// Checked before every request, and again under the queue's lock
    /// before a task is handed out: a master whose lease may have expired
    /// (paused past its ttl) must not hand out tasks a standby now owns.
    lease: LeaseGuard,
    ack_timeout: Duration,
    /// How long a trainer told to wait sleeps before it asks again.
    wait_hint: Duration,
    /// Read to check on a departed trainer that asks for a task.
    discovery: Arc<dyn Discovery>,
}

impl MasterHandler {
    fn get_task(&self, trainer: &str) -> std::result::Result<TaskReply, RemoteError> {
        let mut core = self.shared.core();
        // Checked again now that the queue is held: the handler may have
        // waited for it (the writer takes it to start a snapshot) through a
        // pause past the lease, and a task handed out then is one a standby
        // may hand out too.
        if !self.lease.is_valid() {
            drop(core);
            return Err(self.lease_lost());
        }
        let now = Instant::now();
        let reply = match core.queue.get_task(trainer, now) {
            GetTask::Assigned(a) => TaskReply::Assigned {
                timeout_ms: a.deadline.saturating_duration_since(now).as_millis() as u64,
                task: a.task,
                task_ref: a.task_ref,
                open_from: a.open_from,
            },
            GetTask::Wait => TaskReply::Wait { retry_after_ms: self.wait_hint.as_millis().max(10) as u64 },
            GetTask::Done => TaskReply::Done,
            GetTask::Failed => TaskReply::Failed,
        };
        if let TaskReply::Assigned { task_ref, .. } = &reply {
            tracing::info!(trainer, task = task_ref.task.0, pass = task_ref.pass, "task assigned");
            self.shared.changed(&mut core, false);
            drop(core);
            self.check_departed(trainer);
        }
        Ok(reply)
    }

    /// `trainer` was handed a task: if its registration was seen to end
    /// (its request was on the way, or retried, past its lease), read its
    /// key in the background, and if it is still gone take its tasks back,
    /// as its departure did. No departure would come for it again, and its
    /// task would wait for the task timeout. Reading after the hand-out
    /// cannot miss a departure: one after the read is seen by the trainer
    /// watcher.
    fn check_departed(&self, trainer: &str) {
        if !self.shared.departed.take(trainer) {
            return;
        }
        let (shared, discovery, trainer) = (self.shared.clone(), self.discovery.clone(), trainer.to_string());
        tokio::spawn(async move {
            if shared.departed.still_gone(&*discovery, &trainer).await {
                let returned = shared.take_back(&trainer);
                tracing::warn!(
                    trainer,
                    returned,
                    "a trainer whose registration ended was handed a task; it goes back"
                );
            }
        });
    }

    /// Stop serving: the lease may have expired. The error for the caller.
    fn lease_lost(&self) -> RemoteError {
        let why = "the master's lease may have expired (no refresh within its ttl)";
        self.shared.stop(why.into());
        RemoteError::unavailable(format!("master is not serving: {why}"))
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
            self.shared.changed(&mut core, true);
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
            return Err(self.lease_lost());
        }
        if let Some(why) = self.shared.stopped_reason() {
            return Err(RemoteError::unavailable(format!("master is not serving: {why}")));
        }
        if request.method != MASTER_METHOD {
            return Err(RemoteError::bad_request(format!("unknown master method {:#x}", request.method)));
        }
        let request = request.meta::<MasterRequest>()?;
        check_request(&request)?;
        let reply = match request {
            MasterRequest::GetTask { trainer } => {
                Frame::new(MASTER_METHOD, &self.get_task(&trainer)?, Bytes::new())
            }
            MasterRequest::TaskFinished { trainer, task_ref, stats } => {
                let reply = self
                    .report(|core| {
                        if !holds(core, &trainer, task_ref) {
                            return Report::Stale;
                        }
                        let now = Instant::now();
                        let outcome = core.queue.task_finished(task_ref, now);
                        if outcome == Report::Accepted {
                            let (task, pass) = (task_ref.task.0, task_ref.pass);
                            tracing::info!(trainer, task, pass, "task finished");
                            if let Some(arrived) = core.arrivals.remove(&task_ref.task.0) {
                                if let Some(status) = &mut core.stream {
                                    status.lag_count += 1;
                                    status.lag_sum_seconds +=
                                        now.saturating_duration_since(arrived).as_secs_f64();
                                }
                            }
                            let pass = task_ref.pass as usize;
                            if core.passes.len() <= pass {
                                core.passes.resize(pass + 1, PassStats::default());
                            }
                            let p = &mut core.passes[pass];
                            // Counts from the wire: saturate rather than wrap (the loss
                            // was checked finite by `check_request`).
                            p.examples = p.examples.saturating_add(stats.examples);
                            p.loss_sum += stats.loss_sum;
                            p.tasks_finished += 1;
                            p.skipped_lines = p.skipped_lines.saturating_add(stats.skipped_lines);
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
                // Logged cut, as the queue keeps it: a reader quoting a bad
                // token can make a reason of megabytes.
                tracing::info!(trainer, ?task_ref, reason = %crate::queue::bounded(&reason), "trainer reports a failed task");
                let reply = self
                    .report(|core| match holds(core, &trainer, task_ref) {
                        true => core.queue.task_failed(task_ref, &reason, Instant::now()),
                        false => Report::Stale,
                    })
                    .await?;
                Frame::new(MASTER_METHOD, &reply, Bytes::new())
            }
            MasterRequest::TaskReturned { trainer, task_ref } => {
                tracing::info!(trainer, ?task_ref, "trainer hands a task back");
                let reply = self
                    .report(|core| match holds(core, &trainer, task_ref) {
                        true => core.queue.task_returned(task_ref, Instant::now()),
                        false => Report::Stale,
                    })
                    .await?;
                Frame::new(MASTER_METHOD, &reply, Bytes::new())
            }
            MasterRequest::Status => Frame::new(MASTER_METHOD, &*self.shared.status.borrow(), Bytes::new()),
        };
        reply.map_err(RemoteError::internal)
    }
}

/// Refuses, before anything is looked at, a request whose trainer id is
/// empty or longer than [`MAX_TRAINER_ID_BYTES`], or whose finished-task
/// statistics hold a loss that is not a finite number.
fn check_request(request: &MasterRequest) -> std::result::Result<(), RemoteError> {
    let trainer = match request {
        MasterRequest::GetTask { trainer }
        | MasterRequest::TaskFinished { trainer, .. }
        | MasterRequest::TaskFailed { trainer, .. }
        | MasterRequest::TaskReturned { trainer, .. } => trainer,
        MasterRequest::Status => return Ok(()),
    };
    if trainer.is_empty() || trainer.len() > MAX_TRAINER_ID_BYTES {
        return Err(RemoteError::bad_request(format!(
            "a trainer id of {} bytes: ids must be 1 to {MAX_TRAINER_ID_BYTES} bytes",
            trainer.len()
        )));
    }
    if let MasterRequest::TaskFinished { stats, .. } = request {
        if !stats.loss_sum.is_finite() {
            return Err(RemoteError::bad_request(format!(
                "finished-task statistics with a loss sum of {}: it must be a finite number",
                stats.loss_sum
            )));
        }
    }
    Ok(())
}

/// Whether `trainer` holds assignment `task_ref`: a report from anyone else
/// (a trainer that handed the task back, say) is stale.
fn holds(core: &Core, trainer: &str, task_ref: crate::TaskRef) -> bool {
    core.queue.holder(task_ref) == Some(trainer)
}

/// The latest state stored under `keys`: the snapshot with the journal's
/// records replayed, from one consistent read; `None` if no master stored
/// anything yet. Errors name the key that is bad.
pub async fn load(discovery: &dyn Discovery, keys: &MasterKeys) -> Result<Option<StoredState>> {
    let listing = discovery.get_prefix(&keys.state_listing_prefix()).await?;
    StoredState::from_listing(
        listing.kvs.iter().map(|kv| (kv.key.as_str(), kv.value.as_slice())),
        &keys.state,
        &keys.journal,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trickle_keeps_small_tasks_and_a_backlog_gets_large_ones() {
        let chunk = |i: u64| crate::Chunk { path: "/s/f".into(), start: i << 16, end: (i + 1) << 16 };
        // One 64 KiB chunk: one task.
        assert_eq!(tasks_of(vec![chunk(0)], 1), vec![vec![chunk(0)]]);
        // 3 chunks: 3 tasks (a 32nd of 192 KiB is under one chunk).
        assert_eq!(tasks_of((0..3).map(chunk).collect(), 1).len(), 3);
        // 64 MiB of 64 KiB chunks: tasks of 2 MiB (a 32nd), 32 of them.
        let tasks = tasks_of((0..1024).map(chunk).collect(), 1);
        assert_eq!(tasks.len(), 32);
        assert!(tasks.iter().all(|t| t.len() == 32));
        // chunks_per_task is a floor.
        assert!(tasks_of((0..3).map(chunk).collect(), 2).iter().all(|t| !t.is_empty()));
        assert_eq!(tasks_of((0..4).map(chunk).collect(), 2).len(), 2);
        // Never two files in one task.
        let other = crate::Chunk { path: "/s/g".into(), start: 0, end: 10 };
        assert_eq!(tasks_of(vec![chunk(0), other.clone()], 2), vec![vec![chunk(0)], vec![other]]);
        let all: Vec<_> = tasks_of((0..1024).map(chunk).collect(), 1).concat();
        assert_eq!(all, (0..1024).map(chunk).collect::<Vec<_>>(), "every chunk once, in order");
    }

    /// A get_task that passed the handler's lease check and then waited
    /// for the queue (held by the writer) while the lease went hands out
    /// nothing, and the master stops serving.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_is_not_handed_out_once_the_lease_went_while_waiting_for_the_queue() {
        let discovery: Arc<dyn Discovery> = Arc::new(oar_discovery::MemDiscovery::new());
        let session = Session::start(discovery.clone(), Duration::from_secs(30)).await.unwrap();
        let chunk = crate::Chunk { path: "/d/f".into(), start: 0, end: 10 };
        let tasks = crate::tasks_from_chunks(vec![chunk], 1).unwrap();
        let queue = TaskQueue::new(tasks, crate::QueueConfig::default()).unwrap();
        let core =
            Core { queue, passes: Vec::new(), discarded: Vec::new(), stream: None, arrivals: HashMap::new() };
        let status = core.status();
        let shared = Arc::new(Shared {
            queue: Mutex::new(core),
            dirty: Notify::new(),
            persisted: watch::channel(0).0,
            stopped: watch::channel(None).0,
            status: watch::channel(status).0,
            max_state_bytes: usize::MAX,
            state_size_warned: Default::default(),
            departed: DepartedMembers::new("/t/trainer/"),
        });
        let handler = Arc::new(MasterHandler {
            shared: shared.clone(),
            lease: session.guard(),
            ack_timeout: Duration::from_secs(1),
            wait_hint: Duration::from_millis(10),
            discovery: discovery.clone(),
        });
        // The writer holds the queue until told to let go.
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn({
            let shared = shared.clone();
            move || {
                let _held = shared.core();
                locked_tx.send(()).unwrap();
                release_rx.recv().unwrap();
            }
        });
        locked_rx.recv().unwrap();
        let asking = std::thread::spawn({
            let handler = handler.clone();
            move || handler.get_task("trainer-0")
        });
        std::thread::sleep(Duration::from_millis(50));
        session.close().await.unwrap();
        release_tx.send(()).unwrap();
        writer.join().unwrap();
        let reply = asking.join().unwrap();
        assert!(reply.is_err(), "a task was handed out without a lease: {reply:?}");
        assert!(shared.stopped_reason().is_some_and(|why| why.contains("lease")));
        assert_eq!(shared.core().queue.status().todo, 1, "the task is still to do");
    }

    #[test]
    fn the_state_is_listed_from_the_prefix_its_keys_share() {
        let keys = MasterKeys {
            lock: "/j/master/lock".into(),
            addr: "/j/master/addr".into(),
            state: "/j/master/state".into(),
            journal: "/j/master/journal/".into(),
            config: "/j/config".into(),
            members: "/j/trainer/".into(),
        };
        assert_eq!(keys.state_listing_prefix(), "/j/master/");
        assert_eq!(keys.journal_record(42), "/j/master/journal/00000000000000000042");
        assert_eq!(common_prefix("/jé/a", "/jé/b"), "/jé/");
    }
}
