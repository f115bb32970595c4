//! The task-queue state machine: todo, pending and done queues over passes,
//! with deadlines, failure counts and discards. No I/O, no clock: time comes
//! in as `now: Instant` on every call that needs it.
//!
//! Rules, in short:
//! - [`TaskQueue::get_task`] moves the front of todo to pending with the
//!   deadline `now + task_timeout`; tasks are first handed out in id order.
//! - A failure (deadline reached at [`TaskQueue::tick`], a failed report, or
//!   the trainer gone) raises the task's failure count for this pass; at
//!   `max_failures` the task is discarded for the rest of the job, else it
//!   goes to the *end* of todo.
//! - A report names `(task, pass, attempt)`; anything but the current pending
//!   assignment is [`Report::Stale`] and changes nothing. A finish arriving
//!   after the deadline but before `tick` expired the task is still accepted:
//!   the work was done.
//! - A pass ends as soon as todo and pending are both empty: the job fails if
//!   no task finished in that pass, is done after the last pass, and otherwise
//!   the next pass starts with todo = the finished tasks in id order and all
//!   failure counts reset.
//!
//! **Streaming** ([`TaskQueue::streaming`]): the queue starts empty and
//! has no passes; the shell appends tasks as its source yields data
//! ([`TaskQueue::append`]), with the source's mark, which the queue keeps
//! and snapshots. Appended tasks are *staged*: the next
//! [`take_changes`](TaskQueue::take_changes) is a snapshot holding them, and
//! they are handed out only once the shell has stored it
//! ([`TaskQueue::stored`]), so a task id handed to a trainer always names
//! the same chunks, across any master restart. The job ends, done, when the
//! source is closed and every task is finished or discarded. A snapshot of
//! a streaming queue drops its finished and discarded tasks (their counts
//! are kept), so it holds only the open ones however long the stream runs.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::dataset::{Chunk, TaskId, TaskSpec};
use crate::journal::{Changes, Delta};
use crate::snapshot::{Meta, Snapshot, StateView, StreamState, Unpacked};
use crate::state::{JobState, TaskState, TrainerId};
use crate::{Error, Result};

/// The longest task timeout accepted: keeps `now + timeout` far from overflow.
pub const MAX_TASK_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The most passes a job may have. The master keeps statistics for each
/// pass (32 bytes each, in its stored state); a stored state naming a pass
/// beyond this is refused as corrupt instead of sizing a table by it.
pub const MAX_PASSES: u32 = 1 << 20;

/// Longest failure reason kept (reasons come from trainers over the network
/// and end up in the snapshot); longer ones are cut at a char boundary.
pub const MAX_REASON_BYTES: usize = 512;

/// Discards whose full reason a queue keeps (the job's first ones). Each
/// discarded task's reason is in every snapshot, and reasons name a file
/// and a line, so they seldom repeat: 10,000 discards of a 100,000-task job
/// put the stored state past etcd's request limit, and the master could
/// store nothing more. Later discards keep a short reason that names the
/// pass (one string per pass); the event, and so the master's log, carries
/// each full reason.
pub const MAX_DISCARD_REASONS_KEPT: usize = 100;

/// How the queue treats tasks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct QueueConfig {
    /// How long a trainer may hold a task before it counts as failed.
    pub task_timeout: Duration,
    /// Failures of one task within one pass after which it is discarded.
    pub max_failures: u32,
    /// Passes over the dataset.
    pub passes: u32,
}

impl Default for QueueConfig {
    /// Ten minutes per task, three failures, one pass.
    fn default() -> Self {
        QueueConfig { task_timeout: Duration::from_secs(600), max_failures: 3, passes: 1 }
    }
}

impl QueueConfig {
    /// Checks that `1 <= passes <= MAX_PASSES`, `max_failures >= 1` and
    /// `0 < task_timeout <= MAX_TASK_TIMEOUT`.
    pub fn validate(&self) -> Result<()> {
        if self.passes == 0 {
            return Err(Error::BadConfig("passes must be at least 1, got 0".into()));
        }
        if self.passes > MAX_PASSES {
            return Err(Error::BadConfig(format!(
                "passes must be at most {MAX_PASSES}, got {}",
                self.passes
            )));
        }
        if self.max_failures == 0 {
            return Err(Error::BadConfig("max_failures must be at least 1, got 0".into()));
        }
        if self.task_timeout.is_zero() {
            return Err(Error::BadConfig("task_timeout must be positive, got 0".into()));
        }
        if self.task_timeout > MAX_TASK_TIMEOUT {
            return Err(Error::BadConfig(format!(
                "task_timeout must be at most {MAX_TASK_TIMEOUT:?}, got {:?}",
                self.task_timeout
            )));
        }
        Ok(())
    }
}

/// Names one assignment of a task: a report must carry it back, so that a
/// late report (older pass or attempt) is recognised as stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TaskRef {
    /// The task.
    pub task: TaskId,
    /// The pass (0-based) it was assigned in.
    pub pass: u32,
    /// Failures of this task earlier in this pass when it was assigned.
    pub attempt: u32,
}

/// A task handed to a trainer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// What to read.
    pub task: TaskSpec,
    /// What to report back.
    pub task_ref: TaskRef,
    /// When the task times out unless reported.
    pub deadline: Instant,
    /// The lowest id of the pass's tasks still open (todo or pending) when
    /// this one was handed out: every task of the pass below it, and every
    /// task of earlier passes, is finished or discarded, and a discard is
    /// stored ([`TaskQueue::stored_up_to`]). Pservers forget what they kept
    /// of the tasks below it (see `oar_pserver::origin`).
    pub open_from: TaskId,
}

/// The answer to [`TaskQueue::get_task`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetTask {
    /// A task to work on.
    Assigned(Assignment),
    /// Todo is empty but tasks of this pass are still pending: ask again later
    /// (one may fail and come back, or the next pass may start).
    Wait,
    /// The job finished all its passes.
    Done,
    /// The job failed: a pass in which no task finished.
    Failed,
}

/// The answer to a task report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Report {
    /// The report matched the current pending assignment and was applied.
    Accepted,
    /// The report did not match the current pending assignment (late after a
    /// timeout, an old pass, an unknown task, or the job is over): nothing changed.
    Stale,
}

/// Counts for the job-status call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Current pass, 0-based (the last pass once the job is over).
    pub pass: u32,
    /// Passes configured.
    pub passes: u32,
    /// Tasks waiting in this pass.
    pub todo: usize,
    /// Tasks held by trainers.
    pub pending: usize,
    /// Tasks finished in this pass.
    pub done: usize,
    /// Tasks discarded (over the whole job).
    pub discarded: usize,
    /// Timeouts, failed reports and trainers gone, over the whole job.
    pub failures: u64,
    /// Whether the job is over.
    pub state: JobState,
}

/// Something the shell may log or report; drained with [`TaskQueue::drain_events`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueueEvent {
    /// A pending task reached its deadline.
    TaskTimedOut {
        /// The assignment that timed out.
        task_ref: TaskRef,
        /// Who held it.
        trainer: TrainerId,
    },
    /// A trainer reported failure, or left while holding the task.
    TaskFailed {
        /// The assignment that failed.
        task_ref: TaskRef,
        /// Who held it.
        trainer: TrainerId,
        /// The trainer's reason, or `"trainer <id> gone"`.
        reason: String,
    },
    /// A trainer handed a task back unfinished (it is stopping); the task
    /// is at the front of todo, no failure counted.
    TaskReturned {
        /// The assignment handed back.
        task_ref: TaskRef,
        /// Who held it.
        trainer: TrainerId,
    },
    /// A task reached `max_failures` in a pass and is out of the job.
    TaskDiscarded {
        /// The task.
        task: TaskId,
        /// The pass it was discarded in.
        pass: u32,
        /// Why.
        reason: String,
    },
    /// A pass ended (todo and pending empty).
    PassEnded {
        /// The pass that ended.
        pass: u32,
        /// Tasks finished in it.
        done: usize,
        /// Tasks discarded so far in the job (`done + discarded` = all tasks).
        discarded: usize,
    },
    /// The last pass ended.
    JobDone,
    /// The shell ended the job as failed ([`TaskQueue::abort`]).
    JobAborted {
        /// The pass it was in.
        pass: u32,
        /// Why, as every open task's discard reason says it.
        reason: String,
        /// The tasks that were todo or pending, now discarded.
        discarded: Vec<TaskId>,
    },
    /// A pass ended with no finished task.
    JobFailed {
        /// The pass.
        pass: u32,
    },
}

/// A task's state with the deadline the public [`TaskState`] leaves out.
#[derive(Clone, Debug)]
enum Slot {
    Todo,
    Pending { trainer: TrainerId, attempt: u32, deadline: Instant },
    Done,
    Discarded { reason: String },
}

impl Slot {
    /// The public state, without the deadline.
    fn state(&self) -> TaskState {
        match self {
            Slot::Todo => TaskState::Todo,
            Slot::Pending { trainer, attempt, .. } => {
                TaskState::Pending { trainer: trainer.clone(), attempt: *attempt }
            }
            Slot::Done => TaskState::Done,
            Slot::Discarded { reason } => TaskState::Discarded { reason: reason.clone() },
        }
    }
}

/// The task-queue core. See the [module docs](self) for the rules.
#[derive(Clone, Debug)]
pub struct TaskQueue {
    config: QueueConfig,
    /// Sorted by id; a task's index here is its handle everywhere else.
    tasks: Vec<TaskSpec>,
    slots: Vec<Slot>,
    /// Failures of each task in the current pass.
    failures: Vec<u32>,
    todo: VecDeque<usize>,
    /// Pending tasks by (deadline, index), so `tick` finds the expired first.
    pending: BTreeSet<(Instant, usize)>,
    done: usize,
    discarded: usize,
    pass: u32,
    state: JobState,
    failures_total: u64,
    version: u64,
    events: Vec<QueueEvent>,
    /// Positions changed since the last [`take_changes`](Self::take_changes),
    /// in change order, repeats included.
    changed: Vec<usize>,
    /// The next `take_changes` must be a snapshot: nothing was taken yet, a
    /// pass started, or the change log outgrew the queue.
    snapshot_due: bool,
    /// The version at the last `take_changes`.
    taken_version: u64,
    /// A streaming queue's source state; `None` for a batch queue.
    stream: Option<Stream>,
    /// Every task below this position is finished or discarded (see
    /// [`open_from`](Self::open_from)); back to 0 when positions change.
    open_cursor: usize,
    /// Discards not stored yet ([`stored_up_to`](Self::stored_up_to)): the
    /// task, the pass and the version it was discarded in. Until stored, a
    /// discard does not raise [`Assignment::open_from`], and a pass it
    /// ended hands out nothing: a master taking over would restore the task
    /// as todo, and pservers told that every task below the floor is
    /// finished would take its pushes for duplicates, so it would count as
    /// done with none of its examples applied. (A task done but not stored
    /// needs nothing of the kind: its pushes were acknowledged before it
    /// was reported, so they are duplicates when it is trained again.)
    unstored_discards: HashMap<TaskId, (u32, u64)>,
}

/// A streaming queue's state beyond its tasks.
#[derive(Clone, Debug, Default)]
struct Stream {
    /// What [`StreamState`] stores (the counts of compacted tasks included).
    stored: StreamState,
    /// Appended tasks (positions) not handed out yet: held back from todo
    /// until a snapshot holding them is stored.
    staged: VecDeque<usize>,
    /// How many of `staged` the last snapshot taken holds.
    staged_taken: usize,
}

/// Cuts a reason to [`MAX_REASON_BYTES`] at a char boundary.
pub(crate) fn bounded(reason: &str) -> String {
    if reason.len() <= MAX_REASON_BYTES {
        return reason.to_string();
    }
    let mut end = MAX_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &reason[..end])
}

impl TaskQueue {
    /// A queue in pass 0 with every task in todo, in id order.
    ///
    /// Errors if `tasks` is empty, two tasks share an id, a chunk's range is
    /// reversed, or the config is invalid.
    pub fn new(mut tasks: Vec<TaskSpec>, config: QueueConfig) -> Result<Self> {
        config.validate()?;
        if tasks.is_empty() {
            return Err(Error::NoTasks);
        }
        tasks.sort_by_key(|t| t.id);
        for pair in tasks.windows(2) {
            if pair[0].id == pair[1].id {
                return Err(Error::DuplicateTask(pair[0].id.0));
            }
        }
        for chunk in tasks.iter().flat_map(|t| &t.chunks) {
            if chunk.start > chunk.end {
                return Err(Error::BadChunk { path: chunk.path.clone(), start: chunk.start, end: chunk.end });
            }
        }
        Ok(Self::fresh(config, tasks, None))
    }

    /// A queue in pass 0 with every task of `tasks` in todo, in their order.
    fn fresh(config: QueueConfig, tasks: Vec<TaskSpec>, stream: Option<Stream>) -> Self {
        let n = tasks.len();
        TaskQueue {
            config,
            tasks,
            slots: vec![Slot::Todo; n],
            failures: vec![0; n],
            todo: (0..n).collect(),
            pending: BTreeSet::new(),
            done: 0,
            discarded: 0,
            pass: 0,
            state: JobState::Running,
            failures_total: 0,
            version: 0,
            events: Vec::new(),
            changed: Vec::new(),
            snapshot_due: true,
            taken_version: 0,
            stream,
            open_cursor: 0,
            unstored_discards: HashMap::new(),
        }
    }

    /// A stream has no passes.
    fn check_stream_passes(config: &QueueConfig) -> Result<()> {
        match config.passes {
            1 => Ok(()),
            n => Err(Error::BadConfig(format!("a streaming queue has no passes: passes must be 1, got {n}"))),
        }
    }

    /// An empty streaming queue (see [Streaming](self#streaming)): it waits
    /// for [`append`](Self::append). Errors if the config is invalid or has
    /// more than one pass (a stream has none).
    pub fn streaming(config: QueueConfig) -> Result<Self> {
        config.validate()?;
        Self::check_stream_passes(&config)?;
        Ok(Self::fresh(config, Vec::new(), Some(Stream::default())))
    }

    /// Streaming: appends one task per entry of `tasks` (its chunks), with
    /// ids following the last task's, and takes `mark` as the source's
    /// position after them; `closed`: the source has no more. The tasks are
    /// staged until the snapshot holding them is stored (see
    /// [`stored`](Self::stored)). Returns their ids.
    ///
    /// Errors if the queue is not a streaming one, the job is over, the
    /// source was closed before, a task has no chunk, or a chunk's range is
    /// reversed; nothing changes then.
    pub fn append(&mut self, tasks: Vec<Vec<Chunk>>, mark: Vec<u8>, closed: bool) -> Result<Vec<TaskId>> {
        let Some(stream) = &self.stream else {
            return Err(Error::InvalidArgument("append: this is not a streaming queue".into()));
        };
        if self.state != JobState::Running {
            return Err(Error::InvalidArgument(format!("append: the job is over ({:?})", self.state)));
        }
        if stream.stored.closed {
            return Err(Error::InvalidArgument("append: the source was closed".into()));
        }
        for chunks in &tasks {
            if chunks.is_empty() {
                return Err(Error::InvalidArgument("append: a task without chunks".into()));
            }
            if let Some(c) = chunks.iter().find(|c| c.start > c.end) {
                return Err(Error::BadChunk { path: c.path.clone(), start: c.start, end: c.end });
            }
        }
        let mut ids = Vec::with_capacity(tasks.len());
        for chunks in tasks {
            let Some(stream) = &mut self.stream else { break };
            let id = TaskId(stream.stored.next_id);
            stream.stored.next_id += 1;
            stream.staged.push_back(self.tasks.len());
            self.tasks.push(TaskSpec { id, chunks });
            self.slots.push(Slot::Todo);
            self.failures.push(0);
            ids.push(id);
        }
        if let Some(stream) = &mut self.stream {
            stream.stored.mark = mark;
            stream.stored.closed = closed;
        }
        self.version += 1;
        // New tasks (and the mark) go out in a snapshot, never a delta.
        self.snapshot_due = true;
        self.changed.clear();
        self.check_pass_end();
        Ok(ids)
    }

    /// Streaming: the snapshot last taken by
    /// [`take_changes`](Self::take_changes) is stored, so the tasks it holds
    /// that were staged may now be handed out (they join the end of todo).
    /// Call it after each successful store; a no-op for a batch queue.
    pub fn stored(&mut self) {
        let Some(stream) = &mut self.stream else { return };
        let released = stream.staged_taken.min(stream.staged.len());
        stream.staged_taken = 0;
        self.todo.extend(stream.staged.drain(..released));
    }

    /// Every change up to `version` ([`version`](Self::version) when the
    /// changes were taken) is stored: the discards among them may raise
    /// [`Assignment::open_from`], and a pass one of them ended may hand
    /// out tasks. Call it after each successful store.
    pub fn stored_up_to(&mut self, version: u64) {
        self.unstored_discards.retain(|_, &mut (_, at)| at > version);
    }

    /// Streaming: the source's mark covering every task appended, and
    /// whether the source is closed; `None` for a batch queue.
    pub fn source_mark(&self) -> Option<(&[u8], bool)> {
        self.stream.as_ref().map(|s| (s.stored.mark.as_slice(), s.stored.closed))
    }

    /// Streaming: appended tasks waiting for their snapshot to be stored.
    pub fn staged(&self) -> usize {
        self.stream.as_ref().map_or(0, |s| s.staged.len())
    }

    /// Hands the front of todo to `trainer` with the deadline
    /// `now + task_timeout`. Does not expire overdue tasks: call
    /// [`tick`](Self::tick) for that.
    pub fn get_task(&mut self, trainer: &str, now: Instant) -> GetTask {
        match self.state {
            JobState::Done => return GetTask::Done,
            JobState::Failed | JobState::Aborted => return GetTask::Failed,
            JobState::Running => {}
        }
        if self.unstored_discards.values().any(|&(pass, _)| pass < self.pass) {
            // The pass ended by a discard not stored yet (see `unstored_discards`).
            return GetTask::Wait;
        }
        let Some(i) = self.todo.pop_front() else {
            return GetTask::Wait;
        };
        let attempt = self.failures[i];
        let deadline = self.deadline(now);
        self.slots[i] = Slot::Pending { trainer: trainer.to_string(), attempt, deadline };
        self.pending.insert((deadline, i));
        self.version += 1;
        self.mark(i);
        let task = self.tasks[i].clone();
        let task_ref = TaskRef { task: task.id, pass: self.pass, attempt };
        let open_from = self.open_from();
        GetTask::Assigned(Assignment { task, task_ref, deadline, open_from })
    }

    /// The lowest id of a task still open in this pass (see
    /// [`Assignment::open_from`]). Finished tasks stay finished within a
    /// pass, so a cursor past them moves only forward: amortised O(1).
    fn open_from(&mut self) -> TaskId {
        let finished = |i: usize| match self.slots.get(i) {
            Some(Slot::Done) => true,
            Some(Slot::Discarded { .. }) => !self.unstored_discards.contains_key(&self.tasks[i].id),
            _ => false,
        };
        while finished(self.open_cursor) {
            self.open_cursor += 1;
        }
        self.tasks.get(self.open_cursor).map_or(TaskId(u64::MAX), |t| t.id)
    }

    /// `now + task_timeout`; the config caps the timeout so this cannot
    /// overflow in practice, and if it did the task would just expire early.
    fn deadline(&self, now: Instant) -> Instant {
        now.checked_add(self.config.task_timeout).unwrap_or(now)
    }

    /// The index of the task `r` names, if `r` is its current pending assignment.
    fn current(&self, r: TaskRef) -> Option<usize> {
        if self.state != JobState::Running || r.pass != self.pass {
            return None;
        }
        let i = self.index_of(r.task)?;
        match &self.slots[i] {
            Slot::Pending { attempt, .. } if *attempt == r.attempt => Some(i),
            _ => None,
        }
    }

    fn index_of(&self, id: TaskId) -> Option<usize> {
        self.tasks.binary_search_by_key(&id, |t| t.id).ok()
    }

    /// Takes task `i` out of pending; returns who held it.
    fn take_pending(&mut self, i: usize) -> (TrainerId, u32) {
        match std::mem::replace(&mut self.slots[i], Slot::Todo) {
            Slot::Pending { trainer, attempt, deadline } => {
                self.pending.remove(&(deadline, i));
                (trainer, attempt)
            }
            other => {
                // Callers only pass pending tasks; put the slot back unchanged.
                self.slots[i] = other;
                (String::new(), 0)
            }
        }
    }

    /// Marks the assignment `r` finished. `now` is unused: a finish is
    /// accepted until the task is expired by `tick`.
    pub fn task_finished(&mut self, r: TaskRef, _now: Instant) -> Report {
        let Some(i) = self.current(r) else {
            return Report::Stale;
        };
        self.take_pending(i);
        self.slots[i] = Slot::Done;
        self.done += 1;
        self.version += 1;
        self.mark(i);
        self.check_pass_end();
        Report::Accepted
    }

    /// Records that the trainer holding `r` failed it with `reason` (cut to
    /// [`MAX_REASON_BYTES`]).
    pub fn task_failed(&mut self, r: TaskRef, reason: &str, _now: Instant) -> Report {
        let Some(i) = self.current(r) else {
            return Report::Stale;
        };
        let (trainer, _) = self.take_pending(i);
        let reason = bounded(reason);
        let detail = format!("failed on trainer {trainer}: {reason}");
        self.events.push(QueueEvent::TaskFailed { task_ref: r, trainer, reason });
        self.fail(i, detail);
        self.check_pass_end();
        Report::Accepted
    }

    /// Puts the task of assignment `r` back at the *front* of todo without
    /// counting a failure: its trainer is stopping (a graceful shutdown)
    /// before it could finish it, through no fault of the task's.
    pub fn task_returned(&mut self, r: TaskRef, _now: Instant) -> Report {
        let Some(i) = self.current(r) else {
            return Report::Stale;
        };
        let (trainer, _) = self.take_pending(i);
        self.slots[i] = Slot::Todo;
        self.todo.push_front(i);
        self.version += 1;
        self.mark(i);
        // A delta can only say "appended to todo": store a snapshot instead.
        self.snapshot_due = true;
        self.events.push(QueueEvent::TaskReturned { task_ref: r, trainer });
        Report::Accepted
    }

    /// Who holds assignment `r`, if it is the task's current one: a shell
    /// checks that a report comes from the holder.
    pub fn holder(&self, r: TaskRef) -> Option<&str> {
        match &self.slots[self.current(r)?] {
            Slot::Pending { trainer, .. } => Some(trainer),
            _ => None,
        }
    }

    /// Ends the job as failed now, for `reason` (cut to
    /// [`MAX_REASON_BYTES`]): every task still todo or pending in this pass
    /// is discarded with the reason; tasks done stay done. The shell aborts
    /// a job that cannot succeed (its training diverged, say). True if the
    /// job was running.
    pub fn abort(&mut self, reason: &str, _now: Instant) -> bool {
        if self.state != JobState::Running {
            return false;
        }
        let reason = format!("the job was aborted: {}", bounded(reason));
        let mut open: Vec<usize> = self.todo.drain(..).collect();
        if let Some(stream) = &mut self.stream {
            open.extend(stream.staged.drain(..));
            stream.staged_taken = 0;
        }
        open.extend(self.pending.iter().map(|&(_, i)| i));
        self.pending.clear();
        open.sort_unstable();
        for &i in &open {
            self.slots[i] = Slot::Discarded { reason: reason.clone() };
            self.discarded += 1;
        }
        self.state = JobState::Aborted;
        self.version += 1;
        self.snapshot_due = true;
        self.changed.clear();
        let discarded = open.iter().map(|&i| self.tasks[i].id).collect();
        self.events.push(QueueEvent::JobAborted { pass: self.pass, reason, discarded });
        true
    }

    /// Returns every task `trainer` holds to todo as a failure
    /// (`"trainer <id> gone"`); returns how many.
    pub fn trainer_gone(&mut self, trainer: &str, _now: Instant) -> usize {
        if self.state != JobState::Running {
            return 0;
        }
        let mut held: Vec<usize> = self
            .pending
            .iter()
            .filter(|(_, i)| matches!(&self.slots[*i], Slot::Pending { trainer: t, .. } if t == trainer))
            .map(|&(_, i)| i)
            .collect();
        held.sort_unstable();
        let reason = format!("trainer {trainer} gone");
        for &i in &held {
            let (trainer, attempt) = self.take_pending(i);
            let task_ref = TaskRef { task: self.tasks[i].id, pass: self.pass, attempt };
            self.events.push(QueueEvent::TaskFailed { task_ref, trainer, reason: reason.clone() });
            self.fail(i, reason.clone());
            self.check_pass_end();
        }
        held.len()
    }

    /// Fails every pending task whose deadline is at or before `now`
    /// ("timed out after ..."), earliest deadline first; returns how many.
    pub fn tick(&mut self, now: Instant) -> usize {
        if self.state != JobState::Running {
            return 0;
        }
        let expired: Vec<usize> =
            self.pending.iter().take_while(|(d, _)| *d <= now).map(|&(_, i)| i).collect();
        for &i in &expired {
            let (trainer, attempt) = self.take_pending(i);
            let task_ref = TaskRef { task: self.tasks[i].id, pass: self.pass, attempt };
            let detail = format!("timed out after {:?} on trainer {trainer}", self.config.task_timeout);
            self.events.push(QueueEvent::TaskTimedOut { task_ref, trainer });
            self.fail(i, detail);
            self.check_pass_end();
        }
        expired.len()
    }

    /// Counts a failure of task `i` (already out of pending): discard at the
    /// threshold, else back to the end of todo.
    fn fail(&mut self, i: usize, detail: String) {
        self.failures[i] += 1;
        self.failures_total += 1;
        self.version += 1;
        self.mark(i);
        let count = self.failures[i];
        if count >= self.config.max_failures {
            let reason = format!("{count} failure(s) in pass {}, the last: {detail}", self.pass);
            let kept = if self.discarded < MAX_DISCARD_REASONS_KEPT {
                reason.clone()
            } else {
                format!(
                    "{count} failure(s) in pass {} (the reason is in the master's log: \
                     only the first {MAX_DISCARD_REASONS_KEPT} discards' reasons are kept)",
                    self.pass
                )
            };
            self.events.push(QueueEvent::TaskDiscarded { task: self.tasks[i].id, pass: self.pass, reason });
            self.unstored_discards.insert(self.tasks[i].id, (self.pass, self.version));
            self.slots[i] = Slot::Discarded { reason: kept };
            self.discarded += 1;
        } else {
            self.slots[i] = Slot::Todo;
            self.todo.push_back(i);
        }
    }

    /// Ends the pass if todo and pending are both empty.
    fn check_pass_end(&mut self) {
        if self.state != JobState::Running || !self.todo.is_empty() || !self.pending.is_empty() {
            return;
        }
        if let Some(stream) = &self.stream {
            // A stream ends when its source is closed and nothing is open;
            // until then an empty queue waits for data.
            if !stream.stored.closed || !stream.staged.is_empty() {
                return;
            }
            self.events.push(QueueEvent::PassEnded { pass: 0, done: self.done, discarded: self.discarded });
            self.version += 1;
            self.state = JobState::Done;
            self.events.push(QueueEvent::JobDone);
            return;
        }
        self.events.push(QueueEvent::PassEnded {
            pass: self.pass,
            done: self.done,
            discarded: self.discarded,
        });
        self.version += 1;
        if self.done == 0 {
            self.state = JobState::Failed;
            self.events.push(QueueEvent::JobFailed { pass: self.pass });
        } else if self.pass + 1 >= self.config.passes {
            self.state = JobState::Done;
            self.events.push(QueueEvent::JobDone);
        } else {
            self.pass += 1;
            self.open_cursor = 0;
            self.failures.iter_mut().for_each(|f| *f = 0);
            for (i, slot) in self.slots.iter_mut().enumerate() {
                if matches!(slot, Slot::Done) {
                    *slot = Slot::Todo;
                    self.todo.push_back(i);
                }
            }
            self.done = 0;
            // Every task changed: the next record is a snapshot.
            self.snapshot_due = true;
            self.changed.clear();
        }
    }

    /// Notes that task `i` changed, for the next delta.
    fn mark(&mut self, i: usize) {
        if self.snapshot_due {
            return;
        }
        self.changed.push(i);
        // Past one entry per task a delta is no smaller than a snapshot (and
        // a queue whose shell never takes changes must not grow).
        if self.changed.len() > self.tasks.len() {
            self.snapshot_due = true;
            self.changed.clear();
        }
    }

    /// What changed since the last call, for the shell to store: a
    /// [`Delta`] of the changed tasks, or a [`Snapshot`] of the whole queue
    /// when `want_snapshot` is set (say, because the shell's journal grew
    /// long, or its last write failed) or a delta cannot describe the change
    /// (the first call, or a new pass). Each call starts the next delta from
    /// the current version, so the shell must store what it gets, in order,
    /// or ask for a snapshot next time.
    pub fn take_changes(&mut self, want_snapshot: bool) -> Changes {
        let from_version = std::mem::replace(&mut self.taken_version, self.version);
        if want_snapshot || self.snapshot_due {
            self.snapshot_due = false;
            self.changed.clear();
            self.compact();
            if let Some(stream) = &mut self.stream {
                stream.staged_taken = stream.staged.len();
            }
            return Changes::Snapshot(self.snapshot());
        }
        // Each task once, at its last change.
        let mut seen = std::collections::HashSet::with_capacity(self.changed.len());
        let mut last_first: Vec<usize> = self.changed.drain(..).rev().filter(|&i| seen.insert(i)).collect();
        last_first.reverse();
        let changes =
            last_first.into_iter().map(|i| (i as u64, self.failures[i], self.slots[i].state())).collect();
        Changes::Delta(Delta {
            from_version,
            version: self.version,
            pass: self.pass,
            state: self.state,
            failures_total: self.failures_total,
            changes,
        })
    }

    /// The trainers holding pending tasks, sorted, each once.
    pub fn pending_trainers(&self) -> Vec<String> {
        let mut trainers: Vec<String> = self
            .pending
            .iter()
            .filter_map(|&(_, i)| match &self.slots[i] {
                Slot::Pending { trainer, .. } => Some(trainer.clone()),
                _ => None,
            })
            .collect();
        trainers.sort_unstable();
        trainers.dedup();
        trainers
    }

    /// The job's counts.
    pub fn status(&self) -> Status {
        Status {
            pass: self.pass,
            passes: self.config.passes,
            todo: self.todo.len(),
            pending: self.pending.len(),
            done: self.done,
            discarded: self.discarded,
            failures: self.failures_total,
            state: self.state,
        }
    }

    /// Where task `id` stands, or `None` if there is no such task.
    pub fn task_state(&self, id: TaskId) -> Option<TaskState> {
        let i = self.index_of(id)?;
        Some(self.slots[i].state())
    }

    /// The events since the last call, oldest first. The shell should drain
    /// them regularly: they accumulate until it does.
    pub fn drain_events(&mut self) -> Vec<QueueEvent> {
        std::mem::take(&mut self.events)
    }

    /// A counter that increases on every state change (and only then), so the
    /// shell can persist snapshots in batches: write when it moved.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The config the queue runs with.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The tasks, in id order.
    pub fn tasks(&self) -> impl Iterator<Item = &TaskSpec> {
        self.tasks.iter()
    }

    /// Streaming: drops the finished and discarded tasks (their counts are
    /// kept in the stream state), renumbering the positions of the rest.
    fn compact(&mut self) {
        let Some(stream) = &mut self.stream else { return };
        let keep = |slot: &Slot| matches!(slot, Slot::Todo | Slot::Pending { .. });
        if self.slots.iter().all(keep) {
            return;
        }
        let mut new_index = vec![usize::MAX; self.slots.len()];
        let mut next = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            if keep(slot) {
                new_index[i] = next;
                next += 1;
            }
        }
        let kept = |i: &usize| new_index[*i] != usize::MAX;
        self.tasks = std::mem::take(&mut self.tasks)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| kept(i))
            .map(|(_, t)| t)
            .collect();
        self.failures = std::mem::take(&mut self.failures)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| kept(i))
            .map(|(_, f)| f)
            .collect();
        self.slots = std::mem::take(&mut self.slots).into_iter().filter(keep).collect();
        self.todo.iter_mut().for_each(|i| *i = new_index[*i]);
        stream.staged.iter_mut().for_each(|i| *i = new_index[*i]);
        self.open_cursor = 0;
        self.pending =
            std::mem::take(&mut self.pending).into_iter().map(|(d, i)| (d, new_index[i])).collect();
        stream.stored.done_before = self.done as u64;
        stream.stored.discarded_before = self.discarded as u64;
    }

    /// The persistent state (deadlines and undrained events excluded).
    pub fn snapshot(&self) -> Snapshot {
        let states = self.slots.iter().map(|slot| match slot {
            Slot::Todo => StateView::Todo,
            Slot::Pending { trainer, attempt, .. } => StateView::Pending { trainer, attempt: *attempt },
            Slot::Done => StateView::Done,
            Slot::Discarded { reason } => StateView::Discarded { reason },
        });
        // Staged tasks are todo in the snapshot: stored, they may be handed out.
        let staged = self.stream.iter().flat_map(|s| s.staged.iter().copied());
        let stream = self.stream.as_ref().map(|s| {
            let compacted = |n: usize, held: usize| (n - held) as u64;
            let done_here = self.slots.iter().filter(|s| matches!(s, Slot::Done)).count();
            let discarded_here = self.slots.iter().filter(|s| matches!(s, Slot::Discarded { .. })).count();
            StreamState {
                done_before: compacted(self.done, done_here),
                discarded_before: compacted(self.discarded, discarded_here),
                ..s.stored.clone()
            }
        });
        Snapshot::pack(
            &self.tasks,
            states,
            &self.failures,
            self.todo.iter().copied().chain(staged),
            Meta {
                pass: self.pass,
                state: self.state,
                failures_total: self.failures_total,
                version: self.version,
            },
            stream,
        )
    }

    /// Rebuilds a queue from a snapshot. Pending tasks stay pending with the
    /// same trainer and attempt, and a fresh deadline `now + task_timeout`
    /// (the master was away; the trainer gets its full time again). The
    /// version continues from the snapshot's.
    ///
    /// The config may differ from the one the snapshot was taken under;
    /// errors if it is invalid or has fewer passes than the snapshot's pass
    /// needs. A finished job stays finished even if `passes` grew.
    pub fn restore(snapshot: Snapshot, config: QueueConfig, now: Instant) -> Result<Self> {
        config.validate()?;
        let Unpacked { tasks, states, failures, todo, meta, stream } = snapshot.unpack()?;
        let Meta { pass, state, failures_total, version } = meta;
        if stream.is_some() {
            Self::check_stream_passes(&config)?;
        }
        if pass >= config.passes {
            return Err(Error::BadSnapshot(format!(
                "snapshot is in pass {pass} (0-based) but the config has only {} pass(es)",
                config.passes
            )));
        }
        let mut queue = TaskQueue {
            slots: Vec::with_capacity(tasks.len()),
            tasks,
            failures,
            todo: todo.into(),
            pending: BTreeSet::new(),
            done: 0,
            discarded: 0,
            pass,
            state,
            failures_total,
            version,
            events: Vec::new(),
            changed: Vec::new(),
            snapshot_due: true,
            taken_version: version,
            config,
            stream: None,
            open_cursor: 0,
            unstored_discards: HashMap::new(),
        };
        if let Some(stored) = stream {
            queue.done = stored.done_before as usize;
            queue.discarded = stored.discarded_before as usize;
            queue.stream = Some(Stream { stored, staged: VecDeque::new(), staged_taken: 0 });
        }
        let deadline = queue.deadline(now);
        for (i, st) in states.into_iter().enumerate() {
            let slot = match st {
                TaskState::Todo => Slot::Todo,
                TaskState::Pending { trainer, attempt } => {
                    queue.pending.insert((deadline, i));
                    Slot::Pending { trainer, attempt, deadline }
                }
                TaskState::Done => {
                    queue.done += 1;
                    Slot::Done
                }
                TaskState::Discarded { reason } => {
                    queue.discarded += 1;
                    Slot::Discarded { reason }
                }
            };
            queue.slots.push(slot);
        }
        Ok(queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Chunk;

    fn tasks(n: u64) -> Vec<TaskSpec> {
        (0..n)
            .map(|i| TaskSpec {
                id: TaskId(i),
                chunks: vec![Chunk { path: format!("/data/f{i}"), start: 0, end: 10 }],
            })
            .collect()
    }

    fn config(max_failures: u32, passes: u32) -> QueueConfig {
        QueueConfig { task_timeout: Duration::from_secs(10), max_failures, passes }
    }

    fn assigned(g: GetTask) -> Assignment {
        match g {
            GetTask::Assigned(a) => a,
            other => panic!("expected an assignment, got {other:?}"),
        }
    }

    #[test]
    fn new_rejects_bad_input() {
        assert!(matches!(TaskQueue::new(vec![], config(1, 1)), Err(Error::NoTasks)));
        let mut dup = tasks(3);
        dup[2].id = TaskId(1);
        assert!(matches!(TaskQueue::new(dup, config(1, 1)), Err(Error::DuplicateTask(1))));
        for (bad, field) in [(config(1, 0), "passes"), (config(0, 1), "max_failures")] {
            let err = TaskQueue::new(tasks(1), bad).unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
        let zero = QueueConfig { task_timeout: Duration::ZERO, ..config(1, 1) };
        assert!(TaskQueue::new(tasks(1), zero).unwrap_err().to_string().contains("task_timeout"));
        let mut reversed = tasks(1);
        reversed[0].chunks[0].start = 11;
        assert!(matches!(TaskQueue::new(reversed, config(1, 1)), Err(Error::BadChunk { start: 11, .. })));
    }

    #[test]
    fn hands_out_in_id_order_then_waits() {
        let t0 = Instant::now();
        let mut shuffled = tasks(3);
        shuffled.reverse();
        let mut q = TaskQueue::new(shuffled, config(3, 1)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        assert_eq!(a.task_ref, TaskRef { task: TaskId(0), pass: 0, attempt: 0 });
        assert_eq!(a.deadline, t0 + Duration::from_secs(10));
        assert_eq!(q.task_state(TaskId(0)), Some(TaskState::Pending { trainer: "t1".into(), attempt: 0 }));
        assert_eq!(assigned(q.get_task("t2", t0)).task.id, TaskId(1));
        assert_eq!(assigned(q.get_task("t2", t0)).task.id, TaskId(2));
        let v = q.version();
        assert_eq!(q.get_task("t3", t0), GetTask::Wait);
        assert_eq!(q.version(), v, "Wait changes nothing");
        assert_eq!(q.status().pending, 3);
        assert_eq!(q.task_state(TaskId(9)), None);
    }

    #[test]
    fn timeout_returns_task_to_end_of_todo_with_next_attempt() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(2), config(3, 1)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        assert_eq!(q.tick(t0 + Duration::from_secs(9)), 0);
        assert_eq!(q.tick(t0 + Duration::from_secs(10)), 1, "expires at the deadline");
        assert_eq!(q.task_state(TaskId(0)), Some(TaskState::Todo));
        assert_eq!(q.status().failures, 1);
        let events = q.drain_events();
        assert_eq!(events, vec![QueueEvent::TaskTimedOut { task_ref: a.task_ref, trainer: "t1".into() }]);
        // Task 1 was ahead of the timed-out task 0 in todo.
        assert_eq!(assigned(q.get_task("t2", t0)).task.id, TaskId(1));
        let again = assigned(q.get_task("t2", t0));
        assert_eq!(again.task_ref, TaskRef { task: TaskId(0), pass: 0, attempt: 1 });
        // The late report of the first attempt is stale and changes nothing.
        let v = q.version();
        assert_eq!(q.task_finished(a.task_ref, t0), Report::Stale);
        assert_eq!(q.task_failed(a.task_ref, "x", t0), Report::Stale);
        assert_eq!(q.version(), v);
        assert_eq!(q.task_finished(again.task_ref, t0), Report::Accepted);
        assert_eq!(q.task_finished(again.task_ref, t0), Report::Stale, "accepted once");
    }

    #[test]
    fn late_finish_before_tick_is_accepted() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(2), config(3, 1)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        assert_eq!(q.task_finished(a.task_ref, t0 + Duration::from_secs(60)), Report::Accepted);
        assert_eq!(q.tick(t0 + Duration::from_secs(60)), 0);
    }

    #[test]
    fn threshold_discards_with_reason() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(2), config(2, 1)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        assert_eq!(q.task_failed(a.task_ref, "bad line 7", t0), Report::Accepted);
        assert_eq!(q.task_state(TaskId(0)), Some(TaskState::Todo));
        assigned(q.get_task("t1", t0)); // task 1
        let b = assigned(q.get_task("t1", t0));
        assert_eq!(b.task_ref.attempt, 1);
        assert_eq!(q.task_failed(b.task_ref, "bad line 7 again", t0), Report::Accepted);
        match q.task_state(TaskId(0)) {
            Some(TaskState::Discarded { reason }) => {
                assert!(reason.contains("2 failure(s) in pass 0"), "{reason}");
                assert!(reason.contains("bad line 7 again") && reason.contains("t1"), "{reason}");
            }
            other => panic!("expected discarded, got {other:?}"),
        }
        let events = q.drain_events();
        assert!(events.iter().any(|e| matches!(e,
            QueueEvent::TaskDiscarded { task: TaskId(0), pass: 0, reason } if reason.contains("again"))));
        let st = q.status();
        assert_eq!((st.todo, st.pending, st.done, st.discarded, st.failures), (0, 1, 0, 1, 2));
    }

    #[test]
    fn long_reasons_are_cut() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(2), config(1, 1)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        q.task_failed(a.task_ref, &"é".repeat(1000), t0);
        let Some(TaskState::Discarded { reason }) = q.task_state(TaskId(0)) else { panic!("not discarded") };
        assert!(reason.len() < MAX_REASON_BYTES + 200, "{}", reason.len());
    }

    #[test]
    fn trainer_gone_fails_only_its_tasks() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(3), config(3, 1)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        let b = assigned(q.get_task("t2", t0));
        let c = assigned(q.get_task("t1", t0));
        assert_eq!(q.trainer_gone("t1", t0), 2);
        assert_eq!(q.trainer_gone("t1", t0), 0);
        assert_eq!(q.task_state(a.task.id), Some(TaskState::Todo));
        assert_eq!(q.task_state(c.task.id), Some(TaskState::Todo));
        assert_eq!(q.task_state(b.task.id), Some(TaskState::Pending { trainer: "t2".into(), attempt: 0 }));
        let events = q.drain_events();
        assert_eq!(events.len(), 2);
        assert!(events.iter().all(|e| matches!(e,
            QueueEvent::TaskFailed { trainer, reason, .. } if trainer == "t1" && reason == "trainer t1 gone")));
        assert_eq!(q.status().failures, 2);
    }

    /// A discard raises the floor handed out only once it is stored: else
    /// a master taking over from the last write restores the task as todo,
    /// and its pushes, below the floor the pservers were told, would be
    /// taken for duplicates.
    #[test]
    fn a_discard_raises_open_from_only_once_stored() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(3), config(1, 1)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        assert_eq!(a.task.id, TaskId(0));
        q.task_failed(a.task_ref, "bad", t0); // discarded at once
        let b = assigned(q.get_task("t2", t0));
        assert_eq!(b.open_from, TaskId(0), "the discard is not stored: the floor stays");
        q.stored_up_to(q.version());
        let c = assigned(q.get_task("t3", t0));
        assert_eq!(c.open_from, TaskId(1), "stored: the floor passes the discarded task");
        // A later failed write stores nothing: an older version clears nothing newer.
        q.task_failed(b.task_ref, "bad", t0);
        q.stored_up_to(q.version() - 1);
        q.task_finished(c.task_ref, t0);
        assert_eq!(q.status().state, JobState::Done);
    }

    #[test]
    fn pass_rollover_refills_from_done_and_resets_counts() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(3), config(2, 2)).unwrap();
        // Task 0 fails once then finishes; task 1 is discarded; task 2 finishes.
        let a = assigned(q.get_task("t", t0));
        q.task_failed(a.task_ref, "flaky", t0);
        let b = assigned(q.get_task("t", t0));
        q.task_failed(b.task_ref, "bad", t0);
        let c = assigned(q.get_task("t", t0));
        q.task_finished(c.task_ref, t0);
        let a2 = assigned(q.get_task("t", t0));
        assert_eq!(a2.task_ref, TaskRef { task: TaskId(0), pass: 0, attempt: 1 });
        q.task_finished(a2.task_ref, t0);
        let b2 = assigned(q.get_task("t", t0));
        assert_eq!(b2.task.id, TaskId(1));
        q.task_failed(b2.task_ref, "bad", t0); // second failure: discarded, pass ends
        let st = q.status();
        assert_eq!((st.pass, st.todo, st.pending, st.done, st.discarded), (1, 2, 0, 0, 1));
        assert!(q.drain_events().contains(&QueueEvent::PassEnded { pass: 0, done: 2, discarded: 1 }));
        // The discard that ended pass 0 is not stored yet: nothing of pass 1
        // goes out (its floor would pass task 1's pass-0 pushes).
        let v = q.version();
        assert_eq!(q.get_task("t", t0), GetTask::Wait);
        assert_eq!(q.version(), v, "Wait changes nothing");
        q.stored_up_to(v);
        // Pass 1: todo in id order, attempts from 0 again, task 1 stays discarded.
        let x = assigned(q.get_task("t", t0));
        assert_eq!(x.task_ref, TaskRef { task: TaskId(0), pass: 1, attempt: 0 });
        assert_eq!(q.task_finished(a2.task_ref, t0), Report::Stale, "old pass");
        let y = assigned(q.get_task("t", t0));
        assert_eq!(y.task.id, TaskId(2));
        assert_eq!(q.get_task("t", t0), GetTask::Wait);
        q.task_finished(x.task_ref, t0);
        q.task_finished(y.task_ref, t0);
        assert_eq!(q.status().state, JobState::Done);
        assert_eq!(q.status().pass, 1);
        assert_eq!(q.get_task("t", t0), GetTask::Done);
        assert_eq!(q.task_finished(y.task_ref, t0), Report::Stale);
        let events = q.drain_events();
        assert_eq!(
            &events[events.len() - 2..],
            &[QueueEvent::PassEnded { pass: 1, done: 2, discarded: 1 }, QueueEvent::JobDone]
        );
    }

    #[test]
    fn pass_ends_when_last_task_times_out_into_discard() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(2), config(1, 3)).unwrap();
        let a = assigned(q.get_task("t", t0));
        let b = assigned(q.get_task("t", t0));
        q.task_finished(a.task_ref, t0);
        assert_eq!(q.tick(t0 + Duration::from_secs(11)), 1);
        let Some(TaskState::Discarded { reason }) = q.task_state(b.task.id) else { panic!("not discarded") };
        assert!(reason.contains("timed out after 10s on trainer t"), "{reason}");
        assert_eq!(q.status().pass, 1, "the timeout ended pass 0");
        assert_eq!(q.status().todo, 1);
    }

    #[test]
    fn job_fails_when_a_pass_finishes_nothing() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(2), config(1, 2)).unwrap();
        assigned(q.get_task("t", t0));
        assigned(q.get_task("u", t0));
        assert_eq!(q.trainer_gone("t", t0), 1);
        assert_eq!(q.status().state, JobState::Running);
        assert_eq!(q.tick(t0 + Duration::from_secs(10)), 1);
        assert_eq!(q.status().state, JobState::Failed);
        assert_eq!(q.status().discarded, 2);
        assert_eq!(q.get_task("t", t0), GetTask::Failed);
        let events = q.drain_events();
        assert_eq!(events.last(), Some(&QueueEvent::JobFailed { pass: 0 }));
        let v = q.version();
        assert_eq!(q.tick(t0 + Duration::from_secs(100)), 0);
        assert_eq!(q.version(), v);
    }

    #[test]
    fn version_moves_only_on_change() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(2), config(2, 1)).unwrap();
        let v0 = q.version();
        q.tick(t0);
        q.trainer_gone("nobody", t0);
        q.drain_events();
        q.status();
        assert_eq!(q.version(), v0);
        let a = assigned(q.get_task("t", t0));
        let v1 = q.version();
        assert!(v1 > v0);
        q.task_finished(a.task_ref, t0);
        assert!(q.version() > v1);
    }

    #[test]
    fn restore_keeps_pending_with_fresh_deadline() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(3), config(3, 2)).unwrap();
        let a = assigned(q.get_task("t1", t0));
        q.tick(t0 + Duration::from_secs(10));
        let a = {
            let again = assigned(q.get_task("t1", t0));
            assert_eq!(again.task.id, TaskId(1));
            assert_ne!(again.task_ref, a.task_ref);
            again
        };
        let b = assigned(q.get_task("t2", t0));
        q.task_finished(b.task_ref, t0);
        let bytes = q.snapshot().encode();
        let t1 = t0 + Duration::from_secs(100);
        let mut r = TaskQueue::restore(Snapshot::decode(&bytes).unwrap(), config(3, 2), t1).unwrap();
        assert_eq!(r.status(), q.status());
        assert_eq!(r.version(), q.version());
        for id in 0..3 {
            assert_eq!(r.task_state(TaskId(id)), q.task_state(TaskId(id)));
        }
        assert_eq!(r.task_state(TaskId(1)), Some(TaskState::Pending { trainer: "t1".into(), attempt: 0 }));
        // Fresh deadline: nothing expires until t1 + timeout.
        assert_eq!(r.tick(t1 + Duration::from_secs(9)), 0);
        // The trainer's report from before the restart is still current.
        assert_eq!(r.task_finished(a.task_ref, t1), Report::Accepted);
        // Todo order survives: task 0 (back after its timeout) is next.
        let c = assigned(r.get_task("t3", t1));
        assert_eq!(c.task_ref, TaskRef { task: TaskId(0), pass: 0, attempt: 1 });
    }

    #[test]
    fn restore_rejects_config_with_too_few_passes() {
        let t0 = Instant::now();
        let mut q = TaskQueue::new(tasks(1), config(3, 3)).unwrap();
        let a = assigned(q.get_task("t", t0));
        q.task_finished(a.task_ref, t0);
        assert_eq!(q.status().pass, 1);
        let err = TaskQueue::restore(q.snapshot(), config(3, 1), t0).unwrap_err();
        assert!(err.to_string().contains("pass 1"), "{err}");
        assert!(TaskQueue::restore(q.snapshot(), config(0, 3), t0).is_err());
        assert!(TaskQueue::restore(q.snapshot(), config(3, 2), t0).is_ok());
    }
}
