//! Where a task and the job stand: the states the queue core, its
//! snapshots and its journal share.

use serde::{Deserialize, Serialize};

/// A trainer's id, as it registers with the job.
pub type TrainerId = String;

/// The job as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum JobState {
    /// Passes remain.
    Running,
    /// Every pass ended with at least one finished task.
    Done,
    /// A pass ended with no finished task (all discarded).
    Failed,
    /// The shell ended the job as failed (`TaskQueue::abort`): the tasks
    /// open then are discarded with its reason, those done stay done.
    Aborted,
}

impl JobState {
    /// Whether the job ended without success: failed or aborted.
    pub fn is_failure(self) -> bool {
        matches!(self, JobState::Failed | JobState::Aborted)
    }
}

/// Where one task stands.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TaskState {
    /// Waiting to be handed out in the current pass.
    Todo,
    /// Held by a trainer.
    Pending {
        /// Who holds it.
        trainer: TrainerId,
        /// The attempt number in its [`TaskRef`](crate::TaskRef).
        attempt: u32,
    },
    /// Finished in the current pass (or in the last pass, once the job is over).
    Done,
    /// Failed `max_failures` times in one pass; out for the rest of the job.
    Discarded {
        /// Why, naming the failure count and the last failure.
        reason: String,
    },
}
