//! oar's master side: dataset chunking and the task-queue state machine.
//!
//! A dataset is a list of [`Chunk`]s, byte ranges of files that own the lines
//! *starting* inside them ([`chunks_from_glob`], [`read_chunk_lines`]); a
//! [`TaskSpec`] is a few chunks ([`tasks_from_chunks`]): a pointer to data,
//! never the data.
//!
//! [`TaskQueue`] is the core the master service drives: it does no I/O and
//! reads no clock (time is passed in), keeps todo, pending and done queues
//! over passes, expires tasks past their deadline, discards tasks that fail
//! too often, and tells a late report from a current one by its
//! [`TaskRef`] (task, pass, attempt). Its [`Snapshot`] is what the shell
//! persists (in etcd, with the master's fence) and restores on restart; it is
//! compact enough for one etcd value even for 100,000 tasks. Between
//! snapshots the shell stores only what changed, a [`Delta`] per write from
//! [`TaskQueue::take_changes`], and replays them with [`Snapshot::apply`]
//! (the `master` module docs say when it writes which).
//!
//! **Core and shell.** The core (dataset chunking, [`TaskQueue`], its
//! snapshots and journal, [`StoredState`]) does no I/O beyond reading the
//! dataset's files and needs neither tokio nor a network. The master
//! service and its client (modules `master` and `client`, on
//! [`oar_transport`](https://docs.rs/oar-transport) and
//! [`oar_discovery`](https://docs.rs/oar-discovery)) are behind the
//! default feature `service`: with `default-features = false` the crate is
//! the core alone.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use oar_task_queue::{Chunk, GetTask, QueueConfig, Report, TaskId, TaskQueue, TaskSpec};
//!
//! let tasks: Vec<TaskSpec> = (0..3)
//!     .map(|i| TaskSpec {
//!         id: TaskId(i),
//!         chunks: vec![Chunk { path: format!("/data/part-{i}.libsvm"), start: 0, end: 1 << 20 }],
//!     })
//!     .collect();
//! let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 3, passes: 1 };
//! let mut queue = TaskQueue::new(tasks, config)?;
//!
//! let now = Instant::now();
//! let GetTask::Assigned(assignment) = queue.get_task("trainer-a", now) else {
//!     panic!("three tasks are waiting");
//! };
//! assert_eq!(assignment.task.id, TaskId(0));
//! assert_eq!(queue.task_finished(assignment.task_ref, now), Report::Accepted);
//! // A second report of the same assignment changes nothing.
//! assert_eq!(queue.task_finished(assignment.task_ref, now), Report::Stale);
//!
//! let status = queue.status();
//! assert_eq!((status.todo, status.pending, status.done), (2, 0, 1));
//!
//! // What the master persists, and how it comes back after a restart.
//! let bytes = queue.snapshot().encode();
//! let snapshot = oar_task_queue::Snapshot::decode(&bytes)?;
//! let restored = TaskQueue::restore(snapshot, queue.config().clone(), now)?;
//! assert_eq!(restored.status(), status);
//! # Ok::<(), oar_task_queue::Error>(())
//! ```
#![warn(missing_docs)]
// The docs link the shell's items, which exist with the `service` feature only.
#![cfg_attr(not(feature = "service"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(feature = "service")]
pub mod client;
pub mod dataset;
mod error;
pub mod journal;
#[cfg(feature = "service")]
pub mod master;
pub mod protocol;
pub mod queue;
pub mod snapshot;
pub mod source;
pub mod state;
pub mod stored;

#[cfg(feature = "service")]
pub use client::{MasterClient, MasterClientOptions};
pub use dataset::{
    auto_chunk_bytes, chunk_files, chunks_from_glob, for_each_chunk_line, for_each_chunk_line_bytes,
    glob_files, line_number_at, read_chunk_lines, tasks_from_chunks, Chunk, Line, TaskId, TaskSpec,
    AUTO_CHUNK_MAX, AUTO_CHUNK_MIN, AUTO_TASKS_PER_PASS, MAX_LINE_BYTES,
};
pub use error::{Error, Result};
pub use journal::{Changes, Delta};
#[cfg(feature = "service")]
pub use master::{
    Master, MasterKeys, MasterOptions, StreamOptions, JOURNAL_MAX_RECORDS, STATE_WARN_FRACTION,
};
pub use protocol::{
    MasterStatus, PassStats, ReportReply, StreamStatus, TaskReply, TaskStats, MAX_TRAINER_ID_BYTES,
};
pub use queue::{
    Assignment, GetTask, QueueConfig, QueueEvent, Report, Status, TaskQueue, TaskRef,
    MAX_DISCARD_REASONS_KEPT, MAX_PASSES, MAX_REASON_BYTES, MAX_TASK_TIMEOUT,
};
pub use snapshot::{Snapshot, StreamState};
pub use source::{
    DirSource, DirSourceOptions, FileSource, FileSourceOptions, GlobSource, Polled, SourceMark, TaskSource,
    DEFAULT_CLOSED_MARKER,
};
pub use state::{JobState, TaskState, TrainerId};
pub use stored::{JournalRecord, StoredState, MAX_DISCARDS_LISTED};
