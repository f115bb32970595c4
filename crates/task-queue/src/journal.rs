//! Journal deltas: what changed in a [`TaskQueue`](crate::TaskQueue) since
//! the last delta or snapshot, small enough to store once per batch of
//! reports instead of the whole queue.
//!
//! A [`Delta`] lists each changed task once, with its state and failure count
//! after the change, in the order of the tasks' last changes. That order is
//! enough to rebuild the todo order: a task that became todo went to the end
//! of todo, so replaying "became todo" in last-change order appends the tasks
//! where the queue appended them. A task handed back goes to the *front* of
//! todo, which a delta cannot say, so the queue asks for a snapshot after
//! one (hand-backs are rare: a trainer stopping gracefully). A delta never
//! spans a pass boundary (the
//! start of a pass rewrites every task, so the queue asks for a full
//! snapshot instead), and it names the version it starts from, so deltas
//! only apply in an unbroken chain: `snapshot, delta(v0 → v1), delta(v1 → v2)`.

use serde::{Deserialize, Serialize};

use crate::snapshot::{Meta, Snapshot, StateView, Unpacked};
use crate::state::{JobState, TaskState};
use crate::{Error, Result};

/// The changes of a queue between two versions. Made by
/// [`TaskQueue::take_changes`](crate::TaskQueue::take_changes), applied with
/// [`Snapshot::apply`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// The version this delta applies to.
    pub(crate) from_version: u64,
    /// The version after it.
    pub(crate) version: u64,
    pub(crate) pass: u32,
    pub(crate) state: JobState,
    pub(crate) failures_total: u64,
    /// `(task position, failures in this pass, state)`, in the order of each
    /// task's last change.
    pub(crate) changes: Vec<(u64, u32, TaskState)>,
}

impl Delta {
    /// The version this delta applies to.
    pub fn from_version(&self) -> u64 {
        self.from_version
    }

    /// The queue's version after this delta.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The pass the changes happened in.
    pub fn pass(&self) -> u32 {
        self.pass
    }

    /// How many tasks changed.
    pub fn len(&self) -> usize {
        self.changes.len()
    }

    /// Whether no task changed (only the job-wide fields may have).
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }
}

/// What a queue hands its shell to store, from
/// [`TaskQueue::take_changes`](crate::TaskQueue::take_changes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Changes {
    /// Store the whole queue; every earlier delta is covered by it.
    Snapshot(Snapshot),
    /// Store this delta after the ones before it.
    Delta(Delta),
}

fn bad(msg: impl Into<String>) -> Error {
    Error::BadSnapshot(msg.into())
}

impl Snapshot {
    /// The snapshot after `deltas`, applied in order. Errors, naming the
    /// record, if the deltas do not form an unbroken chain from this
    /// snapshot's version, change the pass, name a task that does not exist,
    /// or leave an inconsistent queue.
    pub fn apply<'a>(&self, deltas: impl IntoIterator<Item = &'a Delta>) -> Result<Snapshot> {
        let Unpacked { tasks, mut states, mut failures, todo, mut meta, stream } = self.unpack()?;
        let n = tasks.len();
        // Each todo task's place in the todo order: the snapshot's order
        // first, then every "became todo" in replay order.
        let mut order: Vec<u64> = vec![u64::MAX; n];
        for (k, &i) in todo.iter().enumerate() {
            order[i] = k as u64;
        }
        let mut next = todo.len() as u64;
        for delta in deltas {
            if delta.from_version != meta.version {
                return Err(bad(format!(
                    "journal record {} -> {} does not follow version {}",
                    delta.from_version, delta.version, meta.version
                )));
            }
            if delta.version < delta.from_version {
                return Err(bad(format!(
                    "journal record {} -> {} moves the version backwards",
                    delta.from_version, delta.version
                )));
            }
            if delta.pass != meta.pass {
                return Err(bad(format!(
                    "journal record {} -> {} is in pass {} but the queue is in pass {}",
                    delta.from_version, delta.version, delta.pass, meta.pass
                )));
            }
            for (position, fails, state) in &delta.changes {
                let i = usize::try_from(*position).ok().filter(|&i| i < n).ok_or_else(|| {
                    bad(format!(
                        "journal record {} -> {} names task position {position}, but there are {n} tasks",
                        delta.from_version, delta.version
                    ))
                })?;
                if *state == TaskState::Todo {
                    order[i] = next;
                    next += 1;
                }
                states[i] = state.clone();
                failures[i] = *fails;
            }
            meta = Meta {
                pass: delta.pass,
                state: delta.state,
                failures_total: delta.failures_total,
                version: delta.version,
            };
        }
        let mut todo: Vec<usize> = (0..n).filter(|&i| states[i] == TaskState::Todo).collect();
        todo.sort_by_key(|&i| order[i]);
        let views = states.iter().map(|s| match s {
            TaskState::Todo => StateView::Todo,
            TaskState::Pending { trainer, attempt } => StateView::Pending { trainer, attempt: *attempt },
            TaskState::Done => StateView::Done,
            TaskState::Discarded { reason } => StateView::Discarded { reason },
        });
        // A delta never changes a stream's state: appends and the close are
        // stored as snapshots.
        let snapshot = Snapshot::pack(&tasks, views, &failures, todo.into_iter(), meta, stream);
        // The same checks as a decoded snapshot: counts against the job
        // state, pending attempts against failure counts.
        snapshot.unpack()?;
        Ok(snapshot)
    }
}
