//! The task queue's persistent state, compact enough for one etcd value.
//!
//! Layout (postcard after a 4-byte magic `OARQ` and a format number):
//! chunk paths are stored once in a path table; chunks are a flat sequence in
//! task order, each coded relative to the one before it: "same file, starts
//! where the previous ended, the most common length" is one byte, so a dataset
//! cut by [`chunk_files`](crate::chunk_files) costs about a byte per chunk.
//! Task ids are stored as gaps (one byte for consecutive ids), trainer ids and
//! discard reasons in a string table, and the todo order as position deltas.
//! 100,000 tasks of two chunks take about 0.6 MB, well under etcd's default
//! 1.5 MiB request limit. Chunks laid out at random (not contiguous) cost up
//! to ~25 bytes each instead.
//!
//! Deadlines are not stored: a restored queue gives pending tasks a fresh
//! deadline. Undrained events are not stored either.
//!
//! A streaming queue's snapshot (format 2) adds its [`StreamState`]: the
//! source's mark, whether the source is closed, the next task id, and the
//! tasks finished and discarded before the last compaction (a streaming
//! queue drops its finished tasks when it takes a snapshot, so the
//! snapshot holds only the tasks still open). Format 1 snapshots (batch
//! jobs, written before streaming existed) still decode.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::dataset::{Chunk, TaskId, TaskSpec};
use crate::state::{JobState, TaskState};
use crate::{Error, Result};

/// First bytes of every encoded snapshot, so that garbage is recognised as such.
const MAGIC: &[u8; 4] = b"OARQ";
/// The encoding's format number, after the magic: 2 adds the stream state.
const FORMAT: u8 = 2;
/// The format before the stream state, still read.
const FORMAT_BATCH_ONLY: u8 = 1;

/// A streaming queue's state beyond its tasks (see the [module docs](self)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamState {
    /// The source's mark covering every task appended so far.
    pub mark: Vec<u8>,
    /// The source is closed: no task will be appended.
    pub closed: bool,
    /// The id the next appended task gets.
    pub next_id: u64,
    /// Tasks finished before the last compaction.
    pub done_before: u64,
    /// Tasks discarded before the last compaction.
    pub discarded_before: u64,
}

/// The persistent state of a [`TaskQueue`](crate::TaskQueue): tasks, their
/// states and failure counts, todo order, pass, job state, failure total and
/// version. Made by [`TaskQueue::snapshot`](crate::TaskQueue::snapshot) or
/// [`Snapshot::decode`], consumed by [`TaskQueue::restore`](crate::TaskQueue::restore).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    version: u64,
    pass: u32,
    state: JobState,
    failures: u64,
    paths: Vec<String>,
    strings: Vec<String>,
    common_len: u64,
    tasks: Vec<SnapTask>,
    chunks: Vec<ChunkCode>,
    /// Todo order: each entry is a task position minus the previous one
    /// (starting from -1), zigzag-coded by postcard.
    todo: Vec<i64>,
    /// A streaming queue's state; `None` for a batch job.
    stream: Option<StreamState>,
}

/// A [`Snapshot`] as format 1 laid it out (no stream state).
#[derive(Deserialize)]
struct SnapshotBatchOnly {
    version: u64,
    pass: u32,
    state: JobState,
    failures: u64,
    paths: Vec<String>,
    strings: Vec<String>,
    common_len: u64,
    tasks: Vec<SnapTask>,
    chunks: Vec<ChunkCode>,
    todo: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct SnapTask {
    /// Id minus the previous task's id minus 1 (the first task: its id).
    id_gap: u64,
    /// How many of the next chunks are this task's.
    chunks: u64,
    /// Failures in the current pass.
    failures: u32,
    state: SnapState,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum SnapState {
    Todo,
    /// `trainer` indexes the string table.
    Pending {
        trainer: u64,
        attempt: u32,
    },
    Done,
    /// `reason` indexes the string table.
    Discarded {
        reason: u64,
    },
}

/// One chunk, relative to the previous chunk in the sequence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum ChunkCode {
    /// Same file, starts at the previous end, `common_len` bytes.
    Next,
    /// Same file, starts at the previous end, this many bytes.
    NextLen(u64),
    /// Starts at byte 0 of file `path` (path-table index).
    Start { path: u64, len: u64 },
    /// Anything else.
    Full { path: u64, start: u64, len: u64 },
}

/// A borrowed task state, for packing.
pub(crate) enum StateView<'a> {
    Todo,
    Pending { trainer: &'a str, attempt: u32 },
    Done,
    Discarded { reason: &'a str },
}

/// The queue-wide fields of a snapshot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Meta {
    pub pass: u32,
    pub state: JobState,
    pub failures_total: u64,
    pub version: u64,
}

/// A validated, decoded snapshot, ready to become a queue.
pub(crate) struct Unpacked {
    /// Sorted by id, unique.
    pub tasks: Vec<TaskSpec>,
    pub states: Vec<TaskState>,
    pub failures: Vec<u32>,
    /// Positions into `tasks`, each a `Todo` task, each once.
    pub todo: Vec<usize>,
    pub meta: Meta,
    pub stream: Option<StreamState>,
}

/// `magic`, `format` and the postcard body of `value`: the framing of every
/// stored value of this crate.
pub(crate) fn encode_framed<T: Serialize>(value: &T, magic: &[u8; 4], format: u8) -> Vec<u8> {
    let mut out = magic.to_vec();
    out.push(format);
    // Serialising to a Vec cannot fail: every field of this crate's stored
    // types has a known length and no custom serialiser can error.
    postcard::to_extend(value, out).unwrap_or_default()
}

/// Decode `magic`, a format number that must be `format`, and a postcard
/// body with nothing after it: the framing of every stored value of this
/// crate. `what` starts the error for a wrong magic.
pub(crate) fn decode_framed<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    magic: &[u8; 4],
    format: u8,
    what: &str,
) -> Result<T> {
    let Some(rest) = bytes.strip_prefix(magic.as_slice()) else {
        let head = &bytes[..bytes.len().min(magic.len())];
        return Err(bad(format!("{what}: expected magic {magic:?}, got {head:?}")));
    };
    let Some((&found, body)) = rest.split_first() else {
        return Err(bad("truncated: no format number after the magic"));
    };
    if found != format {
        return Err(bad(format!("unsupported format {found} (this build reads format {format})")));
    }
    let (value, tail) =
        postcard::take_from_bytes::<T>(body).map_err(|e| bad(format!("corrupt body: {e}")))?;
    if !tail.is_empty() {
        return Err(bad(format!("{} unexpected trailing byte(s) after the body", tail.len())));
    }
    Ok(value)
}

fn bad(msg: impl Into<String>) -> Error {
    Error::BadSnapshot(msg.into())
}

/// Looks up a string-table entry.
fn entry<'a>(table: &'a [String], index: u64, what: &str) -> Result<&'a String> {
    usize::try_from(index).ok().and_then(|i| table.get(i)).ok_or_else(|| {
        bad(format!("{what} refers to table entry {index}, but the table has {} entries", table.len()))
    })
}

/// Interns strings into a table.
#[derive(Default)]
struct Interner<'a> {
    table: Vec<String>,
    index: HashMap<&'a str, u64>,
}

impl<'a> Interner<'a> {
    fn intern(&mut self, s: &'a str) -> u64 {
        *self.index.entry(s).or_insert_with(|| {
            self.table.push(s.to_string());
            self.table.len() as u64 - 1
        })
    }
}

impl Snapshot {
    /// Packs a queue's state. `tasks` are sorted by id; `states` and
    /// `failures` run parallel to them; `todo` holds positions into `tasks`.
    pub(crate) fn pack<'a>(
        tasks: &'a [TaskSpec],
        states: impl Iterator<Item = StateView<'a>>,
        failures: &[u32],
        todo: impl Iterator<Item = usize>,
        meta: Meta,
        stream: Option<StreamState>,
    ) -> Snapshot {
        let mut lens: BTreeMap<u64, usize> = BTreeMap::new();
        for c in tasks.iter().flat_map(|t| &t.chunks) {
            *lens.entry(c.end.saturating_sub(c.start)).or_default() += 1;
        }
        let mut common_len = 0;
        let mut best = 0;
        for (&len, &count) in &lens {
            if count > best {
                best = count;
                common_len = len;
            }
        }

        let mut paths = Interner::default();
        let mut strings = Interner::default();
        let mut chunks = Vec::with_capacity(tasks.iter().map(|t| t.chunks.len()).sum());
        let mut snap_tasks = Vec::with_capacity(tasks.len());
        let mut prev_chunk: Option<(u64, u64)> = None;
        let mut prev_id: Option<u64> = None;
        for ((task, state), &fails) in tasks.iter().zip(states).zip(failures) {
            let id_gap = match prev_id {
                None => task.id.0,
                Some(p) => task.id.0.saturating_sub(p).saturating_sub(1),
            };
            prev_id = Some(task.id.0);
            for c in &task.chunks {
                let path = paths.intern(&c.path);
                let len = c.end.saturating_sub(c.start);
                let code = match prev_chunk {
                    Some((p, end)) if p == path && end == c.start => {
                        if len == common_len {
                            ChunkCode::Next
                        } else {
                            ChunkCode::NextLen(len)
                        }
                    }
                    _ if c.start == 0 => ChunkCode::Start { path, len },
                    _ => ChunkCode::Full { path, start: c.start, len },
                };
                chunks.push(code);
                prev_chunk = Some((path, c.end));
            }
            let state = match state {
                StateView::Todo => SnapState::Todo,
                StateView::Pending { trainer, attempt } => {
                    SnapState::Pending { trainer: strings.intern(trainer), attempt }
                }
                StateView::Done => SnapState::Done,
                StateView::Discarded { reason } => SnapState::Discarded { reason: strings.intern(reason) },
            };
            snap_tasks.push(SnapTask { id_gap, chunks: task.chunks.len() as u64, failures: fails, state });
        }
        let mut prev = -1i64;
        let todo = todo
            .map(|pos| {
                let pos = pos as i64;
                let delta = pos - prev;
                prev = pos;
                delta
            })
            .collect();
        Snapshot {
            version: meta.version,
            pass: meta.pass,
            state: meta.state,
            failures: meta.failures_total,
            paths: paths.table,
            strings: strings.table,
            common_len,
            tasks: snap_tasks,
            chunks,
            todo,
            stream,
        }
    }

    /// The bytes to store: magic, format number, postcard body.
    pub fn encode(&self) -> Vec<u8> {
        encode_framed(self, MAGIC, FORMAT)
    }

    /// Parses and validates bytes made by [`encode`](Self::encode): every task
    /// id in exactly one state, the todo list matching the todo tasks, counts
    /// consistent with the job state. Errors say what was wrong.
    pub fn decode(bytes: &[u8]) -> Result<Snapshot> {
        let snapshot = if bytes.get(MAGIC.len()) == Some(&FORMAT_BATCH_ONLY) && bytes.starts_with(MAGIC) {
            let old: SnapshotBatchOnly =
                decode_framed(bytes, MAGIC, FORMAT_BATCH_ONLY, "not a task-queue snapshot")?;
            Snapshot {
                version: old.version,
                pass: old.pass,
                state: old.state,
                failures: old.failures,
                paths: old.paths,
                strings: old.strings,
                common_len: old.common_len,
                tasks: old.tasks,
                chunks: old.chunks,
                todo: old.todo,
                stream: None,
            }
        } else {
            decode_framed(bytes, MAGIC, FORMAT, "not a task-queue snapshot")?
        };
        snapshot.unpack()?;
        Ok(snapshot)
    }

    /// A streaming queue's state; `None` for a batch job.
    pub fn stream(&self) -> Option<&StreamState> {
        self.stream.as_ref()
    }

    /// The queue's version when the snapshot was taken.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The pass (0-based) when the snapshot was taken.
    pub fn pass(&self) -> u32 {
        self.pass
    }

    /// The job's state when the snapshot was taken.
    pub fn state(&self) -> JobState {
        self.state
    }

    /// How many tasks the snapshot holds.
    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// Validates and expands the snapshot.
    pub(crate) fn unpack(&self) -> Result<Unpacked> {
        if self.pass >= crate::queue::MAX_PASSES {
            // The master sizes its per-pass statistics by it.
            return Err(bad(format!(
                "pass {} (0-based): a job has at most {} passes",
                self.pass,
                crate::queue::MAX_PASSES
            )));
        }
        let n = self.tasks.len();
        if n == 0 && self.stream.is_none() {
            return Err(bad("no tasks"));
        }
        let mut tasks = Vec::with_capacity(n);
        let mut states = Vec::with_capacity(n);
        let mut failures = Vec::with_capacity(n);
        let mut codes = self.chunks.iter();
        let mut prev_chunk: Option<(u64, u64)> = None;
        let mut prev_id: Option<u64> = None;
        let (mut todo_count, mut pending, mut done, mut discarded) = (0usize, 0usize, 0usize, 0usize);
        let mut failure_sum = 0u64;
        for (k, t) in self.tasks.iter().enumerate() {
            let id = match prev_id {
                None => Some(t.id_gap),
                Some(p) => p.checked_add(t.id_gap).and_then(|x| x.checked_add(1)),
            }
            .ok_or_else(|| bad(format!("task #{k}: id overflows u64")))?;
            prev_id = Some(id);
            let mut chunks = Vec::new();
            for j in 0..t.chunks {
                let code = codes.next().ok_or_else(|| {
                    bad(format!(
                        "task {id} claims {} chunks but the chunk list ends at its chunk {j}",
                        t.chunks
                    ))
                })?;
                let (path, start, len) = match *code {
                    ChunkCode::Next | ChunkCode::NextLen(_) => {
                        let (path, end) = prev_chunk.ok_or_else(|| {
                            bad(format!("task {id}: the first chunk is coded relative to a previous one"))
                        })?;
                        let len = if let ChunkCode::NextLen(len) = *code { len } else { self.common_len };
                        (path, end, len)
                    }
                    ChunkCode::Start { path, len } => (path, 0, len),
                    ChunkCode::Full { path, start, len } => (path, start, len),
                };
                let end = start.checked_add(len).ok_or_else(|| {
                    bad(format!("task {id}: chunk {j} end overflows u64 ({start} + {len})"))
                })?;
                let name = entry(&self.paths, path, &format!("task {id} chunk {j} path"))?;
                chunks.push(Chunk { path: name.clone(), start, end });
                prev_chunk = Some((path, end));
            }
            let state = match t.state {
                SnapState::Todo => {
                    todo_count += 1;
                    TaskState::Todo
                }
                SnapState::Pending { trainer, attempt } => {
                    if attempt != t.failures {
                        return Err(bad(format!(
                            "task {id} is pending with attempt {attempt} but has {} failure(s) in this pass",
                            t.failures
                        )));
                    }
                    pending += 1;
                    let trainer = entry(&self.strings, trainer, &format!("task {id} trainer"))?.clone();
                    TaskState::Pending { trainer, attempt }
                }
                SnapState::Done => {
                    done += 1;
                    TaskState::Done
                }
                SnapState::Discarded { reason } => {
                    discarded += 1;
                    let reason = entry(&self.strings, reason, &format!("task {id} discard reason"))?.clone();
                    TaskState::Discarded { reason }
                }
            };
            failure_sum = failure_sum.saturating_add(u64::from(t.failures));
            tasks.push(TaskSpec { id: TaskId(id), chunks });
            states.push(state);
            failures.push(t.failures);
        }
        let extra = codes.count();
        if extra > 0 {
            return Err(bad(format!("{extra} chunk(s) left over after the last task")));
        }

        if self.todo.len() != todo_count {
            return Err(bad(format!(
                "the todo list holds {} task(s) but {todo_count} task(s) are in state todo",
                self.todo.len()
            )));
        }
        let mut seen = vec![false; n];
        let mut todo = Vec::with_capacity(todo_count);
        let mut prev = -1i64;
        for &delta in &self.todo {
            let pos = prev.checked_add(delta).ok_or_else(|| bad("todo position overflows"))?;
            prev = pos;
            let i = usize::try_from(pos).ok().filter(|&i| i < n).ok_or_else(|| {
                bad(format!("todo list names task position {pos}, but there are {n} tasks"))
            })?;
            let id = tasks[i].id;
            if states[i] != TaskState::Todo {
                return Err(bad(format!("task {id} is in the todo list but its state is {:?}", states[i])));
            }
            if std::mem::replace(&mut seen[i], true) {
                return Err(bad(format!("task {id} is in the todo list twice")));
            }
            todo.push(i);
        }

        let open = todo_count + pending;
        // A streaming queue's counts include the tasks compacted away.
        let (done, discarded) = match &self.stream {
            Some(st) => (
                done.saturating_add(usize::try_from(st.done_before).unwrap_or(usize::MAX)),
                discarded.saturating_add(usize::try_from(st.discarded_before).unwrap_or(usize::MAX)),
            ),
            None => (done, discarded),
        };
        if let Some(st) = &self.stream {
            if let Some(last) = prev_id.filter(|&id| id >= st.next_id) {
                return Err(bad(format!("task {last} is at or past the next task id {}", st.next_id)));
            }
            if self.pass != 0 {
                return Err(bad(format!("a streaming queue has no passes but is in pass {}", self.pass)));
            }
            match self.state {
                // An open stream waits for data with nothing to do.
                JobState::Running if open == 0 && st.closed => {
                    return Err(bad("the stream is closed and no task is open, but the job is running"))
                }
                JobState::Done if !st.closed => return Err(bad("the job is done but its stream is open")),
                _ => {}
            }
        }
        match self.state {
            JobState::Running if open == 0 && self.stream.is_none() => {
                return Err(bad(
                    "job is running but no task is todo or pending (the pass should have ended)",
                ));
            }
            JobState::Done | JobState::Failed | JobState::Aborted if open > 0 => {
                return Err(bad(format!(
                    "job is {:?} but {todo_count} task(s) are todo and {pending} pending",
                    self.state
                )));
            }
            JobState::Done if done == 0 && self.stream.is_none() => {
                return Err(bad("job is done but no task finished its last pass"))
            }
            JobState::Failed if done > 0 => {
                return Err(bad(format!("job failed but {done} task(s) finished its last pass")));
            }
            _ => {}
        }
        // An aborted job discards its open tasks without failing them.
        let failed_discards = if self.state == JobState::Aborted { 0 } else { discarded as u64 };
        if self.failures < failure_sum || self.failures < failed_discards {
            return Err(bad(format!(
                "failure total {} is below this pass's failures ({failure_sum}) or the discarded tasks ({discarded})",
                self.failures
            )));
        }
        Ok(Unpacked {
            tasks,
            states,
            failures,
            todo,
            meta: Meta {
                pass: self.pass,
                state: self.state,
                failures_total: self.failures,
                version: self.version,
            },
            stream: self.stream.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{chunk_files, tasks_from_chunks, GetTask, QueueConfig, TaskQueue};
    use proptest::prelude::*;
    use std::time::{Duration, Instant};

    fn config() -> QueueConfig {
        QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 2, passes: 2 }
    }

    /// A small queue with every kind of state: done, pending, todo after a
    /// timeout, discarded.
    fn busy_queue() -> TaskQueue {
        let files: Vec<(String, u64)> = (0..3).map(|i| (format!("/data/part-{i}"), 25)).collect();
        let tasks = tasks_from_chunks(chunk_files(&files, 10).unwrap(), 2).unwrap();
        let mut q = TaskQueue::new(tasks, config()).unwrap();
        let t0 = Instant::now();
        let mut refs = Vec::new();
        for trainer in ["a", "b", "c", "a"] {
            if let GetTask::Assigned(a) = q.get_task(trainer, t0) {
                refs.push(a.task_ref);
            }
        }
        q.task_finished(refs[0], t0);
        q.task_failed(refs[1], "bad line", t0);
        q.trainer_gone("c", t0);
        for _ in 0..2 {
            if let GetTask::Assigned(a) = q.get_task("b", t0) {
                q.task_failed(a.task_ref, "bad line again", t0);
            }
        }
        q
    }

    fn states(q: &TaskQueue) -> Vec<Option<TaskState>> {
        q.tasks().map(|t| q.task_state(t.id)).collect()
    }

    #[test]
    fn a_pass_beyond_the_most_a_job_has_is_refused_on_decode() {
        let mut snap = busy_queue().snapshot();
        snap.pass = u32::MAX;
        let err = Snapshot::decode(&snap.encode()).unwrap_err().to_string();
        assert!(err.contains("pass 4294967295") && err.contains("at most 1048576 passes"), "{err}");
        let stored = crate::StoredState { queue: snap, passes: Vec::new(), discarded: Vec::new() };
        assert!(crate::StoredState::decode(&stored.encode()).is_err());
    }

    #[test]
    fn roundtrip_keeps_everything() {
        let q = busy_queue();
        let st = q.status();
        assert!(st.todo > 0 && st.pending > 0 && st.done > 0 && st.discarded > 0, "{st:?}");
        let snap = q.snapshot();
        let bytes = snap.encode();
        let back = Snapshot::decode(&bytes).unwrap();
        assert_eq!(back, snap);
        assert_eq!(
            (back.version(), back.pass(), back.state(), back.task_count()),
            (q.version(), 0, st.state, 5)
        );
        let r = TaskQueue::restore(back, config(), Instant::now()).unwrap();
        assert_eq!(r.status(), st);
        assert_eq!(states(&r), states(&q));
        assert!(r.tasks().eq(q.tasks()), "chunks survive");
        assert_eq!(r.snapshot(), snap, "todo order and failure counts survive");
    }

    /// A batch job's state stored before streaming existed (format 1: the
    /// same fields, no stream state) still restores.
    #[test]
    fn format_1_snapshots_still_decode() {
        let q = busy_queue();
        let mut old = q.snapshot().encode();
        // Format 2 of a batch snapshot is format 1 plus `None` (one 0 byte) at the end.
        assert_eq!((old[4], old.pop()), (FORMAT, Some(0)));
        old[4] = FORMAT_BATCH_ONLY;
        let back = Snapshot::decode(&old).unwrap();
        assert_eq!(back, q.snapshot());
        assert_eq!(back.stream(), None);
        old[4] = 9;
        let err = Snapshot::decode(&old).unwrap_err().to_string();
        assert!(err.contains("unsupported format 9"), "{err}");
    }

    #[test]
    fn noncontiguous_chunks_roundtrip() {
        let tasks = vec![
            TaskSpec {
                id: TaskId(7),
                chunks: vec![
                    Chunk { path: "b".into(), start: 30, end: 40 },
                    Chunk { path: "a".into(), start: 0, end: 0 },
                    Chunk { path: "a".into(), start: 0, end: 5 },
                ],
            },
            TaskSpec { id: TaskId(u64::MAX), chunks: vec![] },
            TaskSpec { id: TaskId(9), chunks: vec![Chunk { path: "b".into(), start: 40, end: u64::MAX }] },
        ];
        let q = TaskQueue::new(tasks, config()).unwrap();
        let bytes = q.snapshot().encode();
        let r = TaskQueue::restore(Snapshot::decode(&bytes).unwrap(), config(), Instant::now()).unwrap();
        assert!(r.tasks().eq(q.tasks()));
    }

    #[test]
    fn snapshot_of_100k_tasks_fits_in_an_etcd_request() {
        // 500 files, each cut into 400 chunks of 1 MiB (the last one shorter), two chunks a task.
        let files: Vec<(String, u64)> =
            (0..500).map(|i| (format!("/data/part-{i:05}.libsvm"), (400 << 20) - 12_345)).collect();
        let chunks = chunk_files(&files, 1 << 20).unwrap();
        let tasks = tasks_from_chunks(chunks, 2).unwrap();
        assert_eq!(tasks.len(), 100_000);
        let mut q = TaskQueue::new(tasks, config()).unwrap();
        let fresh = q.snapshot().encode().len();

        // Mid-pass: some done, some pending, some timed out (todo out of order).
        let t0 = Instant::now();
        for i in 0..30_000 {
            if let GetTask::Assigned(a) = q.get_task(&format!("trainer-{}", i % 64), t0) {
                if i % 7 != 0 {
                    q.task_finished(a.task_ref, t0);
                }
            }
        }
        q.tick(t0 + Duration::from_secs(61));
        for i in 0..100 {
            q.get_task(&format!("trainer-{i}"), t0 + Duration::from_secs(61));
        }
        let bytes = q.snapshot().encode();
        let limit = 3 << 19; // 1.5 MiB
        eprintln!(
            "snapshot of 100,000 tasks x 2 chunks over 500 files: {fresh} bytes fresh, {} bytes mid-pass \
             (limit {limit})",
            bytes.len()
        );
        assert!(fresh < limit, "fresh snapshot is {fresh} bytes");
        assert!(bytes.len() < limit, "mid-pass snapshot is {} bytes", bytes.len());
        let r = TaskQueue::restore(Snapshot::decode(&bytes).unwrap(), config(), t0).unwrap();
        assert_eq!(r.status(), q.status());
        assert_eq!(r.snapshot(), q.snapshot());
    }

    fn decode_err(bytes: &[u8]) -> String {
        match Snapshot::decode(bytes) {
            Err(e @ Error::BadSnapshot(_)) => e.to_string(),
            other => panic!("expected BadSnapshot, got {other:?}"),
        }
    }

    #[test]
    fn garbage_is_rejected_clearly() {
        assert!(decode_err(b"").contains("expected magic"));
        assert!(decode_err(b"{\"json\": 1}").contains("expected magic"));
        assert!(decode_err(b"OARQ").contains("no format number"));
        assert!(decode_err(b"OARQ\x07").contains("unsupported format 7"));
        let good = busy_queue().snapshot().encode();
        for len in 0..good.len() {
            decode_err(&good[..len]);
        }
        let mut long = good.clone();
        long.push(0);
        assert!(decode_err(&long).contains("1 unexpected trailing byte"));
    }

    /// Encodes a mutated snapshot and checks decode names the problem.
    fn rejects(mutate: impl FnOnce(&mut Snapshot), want: &str) {
        let mut snap = busy_queue().snapshot();
        mutate(&mut snap);
        let err = decode_err(&snap.encode());
        assert!(err.contains(want), "expected {want:?} in {err:?}");
        assert!(TaskQueue::restore(snap, config(), Instant::now()).is_err());
    }

    fn position(snap: &Snapshot, pred: impl Fn(&SnapState) -> bool) -> usize {
        snap.tasks.iter().position(|t| pred(&t.state)).unwrap()
    }

    #[test]
    fn inconsistent_snapshots_are_rejected() {
        rejects(|s| s.tasks.clear(), "no tasks");
        rejects(|s| s.todo.pop().map(drop).unwrap(), "todo list holds");
        rejects(
            |s| {
                let done = position(s, |st| *st == SnapState::Done) as i64;
                s.todo = vec![done + 1];
                let first_todo = position(s, |st| *st == SnapState::Todo);
                for (k, t) in s.tasks.iter_mut().enumerate() {
                    if t.state == SnapState::Todo && k != first_todo {
                        t.state = SnapState::Done;
                    }
                }
            },
            "in the todo list but its state is Done",
        );
        rejects(
            |s| {
                let i = position(s, |st| matches!(st, SnapState::Pending { .. }));
                s.tasks[i].failures += 1;
            },
            "pending with attempt",
        );
        rejects(
            |s| {
                let i = position(s, |st| matches!(st, SnapState::Pending { .. }));
                s.tasks[i].state = SnapState::Pending { trainer: 99, attempt: s.tasks[i].failures };
            },
            "trainer refers to table entry 99",
        );
        rejects(|s| s.paths.clear(), "path refers to table entry 0");
        rejects(|s| s.tasks[4].chunks -= 1, "chunk(s) left over");
        rejects(|s| s.tasks[4].chunks += 1, "the chunk list ends");
        rejects(|s| s.chunks[0] = ChunkCode::Next, "relative to a previous one");
        rejects(|s| s.state = JobState::Done, "job is Done but");
        rejects(|s| s.failures = 0, "failure total 0");
        rejects(|s| s.todo[0] = 1000, "todo list names task position");
        rejects(
            |s| {
                let n = s.todo.len();
                s.todo[n - 1] = 0;
            },
            "twice",
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn random_bytes_never_panic(tail in prop::collection::vec(any::<u8>(), 0..200)) {
            let mut bytes = b"OARQ\x01".to_vec();
            bytes.extend(tail);
            // Either a clean error or a snapshot that restores.
            if let Ok(snap) = Snapshot::decode(&bytes) {
                let cfg = QueueConfig { passes: crate::MAX_PASSES, ..config() };
                prop_assert!(TaskQueue::restore(snap, cfg, Instant::now()).is_ok());
            }
        }

        #[test]
        fn bit_flips_never_panic(bit in 0usize..2000) {
            let mut bytes = busy_queue().snapshot().encode();
            let i = (bit / 8) % bytes.len();
            bytes[i] ^= 1 << (bit % 8);
            if let Ok(snap) = Snapshot::decode(&bytes) {
                let cfg = QueueConfig { passes: crate::MAX_PASSES, ..config() };
                prop_assert!(TaskQueue::restore(snap, cfg, Instant::now()).is_ok());
            }
        }
    }
}
