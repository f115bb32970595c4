//! The master's wire protocol: requests and replies as typed metadata.

use crate::{JobState, Status, TaskId, TaskRef, TaskSpec};
use serde::{Deserialize, Serialize};

/// The transport method number of every master call (the request enum says which).
pub const MASTER_METHOD: u16 = 0x4d00;

/// What a trainer measured while training one task, sent with its report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskStats {
    /// Examples trained on.
    pub examples: u64,
    /// Sum of the per-example training loss over those examples.
    pub loss_sum: f64,
    /// Bad data lines skipped (when the job skips bad lines).
    pub skipped_lines: u64,
}

/// The longest trainer id the master takes, in bytes. Ids are stored with
/// each task a trainer holds, in the master's state in etcd: an id of
/// megabytes would make every save too large for etcd and stall them all.
pub const MAX_TRAINER_ID_BYTES: usize = 256;

/// A call to the master.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum MasterRequest {
    /// Ask for a task.
    GetTask {
        /// The asking trainer.
        trainer: String,
    },
    /// A task was trained on completely.
    TaskFinished {
        /// The reporting trainer.
        trainer: String,
        /// The assignment being reported.
        task_ref: TaskRef,
        /// What training it measured.
        stats: TaskStats,
    },
    /// A task could not be trained on (for example, a bad data line).
    TaskFailed {
        /// The reporting trainer.
        trainer: String,
        /// The assignment being reported.
        task_ref: TaskRef,
        /// Why, for the job's report.
        reason: String,
    },
    /// The job's status.
    Status,
    /// A task handed back unfinished by a trainer that is stopping: it goes
    /// to the front of todo without counting as a failure.
    TaskReturned {
        /// The trainer handing it back.
        trainer: String,
        /// The assignment handed back.
        task_ref: TaskRef,
    },
}

/// The master's answer to [`MasterRequest::GetTask`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TaskReply {
    /// Train on this task and report it within `timeout_ms`.
    Assigned {
        /// The task: pointers to data.
        task: TaskSpec,
        /// Its id, pass and attempt, to quote in the report.
        task_ref: TaskRef,
        /// Time the master gives before it hands the task to someone else.
        timeout_ms: u64,
        /// The lowest id of the pass's tasks still open: every task below
        /// it is finished ([`crate::Assignment::open_from`]).
        open_from: TaskId,
    },
    /// Nothing to hand out now (the pass's last tasks are pending); ask again later.
    Wait {
        /// Suggested pause before asking again.
        retry_after_ms: u64,
    },
    /// Every pass is done.
    Done,
    /// The job failed: every task of a pass was discarded.
    Failed,
}

/// The master's answer to a task report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportReply {
    /// The report changed the queue and is durable.
    Accepted,
    /// The report no longer matches an assignment (timed out, reassigned, old pass): ignored.
    Stale,
}

/// Training statistics of one pass, summed from the trainers' reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PassStats {
    /// Examples trained on in the pass.
    pub examples: u64,
    /// Sum of per-example losses.
    pub loss_sum: f64,
    /// Tasks finished.
    pub tasks_finished: u64,
    /// Bad data lines skipped.
    pub skipped_lines: u64,
}

impl PassStats {
    /// Mean training loss of the pass (NaN when nothing was trained).
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.examples as f64
    }
}

/// What the master says about the job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MasterStatus {
    /// The task queue's counts and state.
    pub queue: Status,
    /// Statistics per pass, index = pass. Stored with the queue, so a
    /// master that takes over carries them on.
    pub passes: Vec<PassStats>,
    /// Tasks discarded so far, with their reasons.
    pub discarded: Vec<(u64, String)>,
    /// A streaming job's source, as this master sees it (`None` for a
    /// batch job, and in a state read from discovery).
    pub stream: Option<StreamStatus>,
}

/// Where a streaming job's source is, and how far training lags behind it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamStatus {
    /// What the source is (`directory "/data/in"`).
    pub source: String,
    /// The source's position, as it describes it ("12 files, 3.4 MB taken").
    pub position: String,
    /// The source is closed: the job ends once what it holds is trained.
    pub closed: bool,
    /// Tasks appended and not handed out yet, or not stored yet.
    pub backlog: usize,
    /// How long the oldest task not finished yet has waited since it
    /// arrived, seconds (0 when none is open). Arrival is when this master
    /// took it from the source; tasks restored from a previous master's
    /// state count from this master's start.
    pub oldest_open_seconds: f64,
    /// Tasks finished since this master started, and the sum of their
    /// lags from arrival to the finished report, seconds.
    pub lag_count: u64,
    /// See [`lag_count`](Self::lag_count).
    pub lag_sum_seconds: f64,
    /// The last bad input the source reported (each names its file), at most 20.
    pub problems: Vec<String>,
}
impl MasterStatus {
    /// Whether the job has ended, well or badly.
    pub fn is_finished(&self) -> bool {
        self.queue.state != JobState::Running
    }
}
