//! Property tests of a streaming task queue over random event sequences:
//! tasks appended as a source yields them, handed out only once stored,
//! restored from what a shell stored (snapshot and deltas) at any point,
//! compacted as they finish; at the end every appended task is finished or
//! discarded exactly once and the job is done.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use oar_task_queue::{
    Changes, Chunk, Delta, GetTask, JobState, QueueConfig, Report, Snapshot, TaskId, TaskQueue, TaskRef,
    TaskState,
};
use proptest::prelude::*;

const TRAINERS: [&str; 3] = ["t0", "t1", "t2"];

#[derive(Clone, Debug)]
enum Op {
    /// Append this many tasks (0: a poll that only moved the mark), closing the source or not.
    Append(usize, bool),
    Get(usize),
    FinishPending(usize),
    FailPending(usize),
    Gone(usize),
    Tick(u64),
    /// Take the changes and store them (true), or lose the write (false).
    Take(bool),
    /// Restore from what was stored, as a new master does.
    Restore,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..4usize, prop::bool::weighted(0.05)).prop_map(|(n, c)| Op::Append(n, c)),
        4 => (0..3usize).prop_map(Op::Get),
        3 => any::<usize>().prop_map(Op::FinishPending),
        1 => any::<usize>().prop_map(Op::FailPending),
        1 => (0..3usize).prop_map(Op::Gone),
        1 => (0..1500u64).prop_map(Op::Tick),
        3 => prop::bool::weighted(0.85).prop_map(Op::Take),
        1 => Just(Op::Restore),
    ]
}

struct Harness {
    q: TaskQueue,
    config: QueueConfig,
    now: Instant,
    /// The source: every task appended so far, by id, and the mark after it.
    appended: BTreeMap<TaskId, Vec<Chunk>>,
    mark: u64,
    closed: bool,
    /// What a shell stored: the last snapshot and the deltas since; a lost
    /// write means the next take must be a snapshot.
    stored: Option<(Snapshot, Vec<Delta>)>,
    must_snapshot: bool,
    /// Pending assignments as the trainers hold them.
    held: Vec<(TaskRef, String)>,
    /// Finishes acknowledged (stored: the master answers a report only
    /// once a write holding it is stored), per task.
    finished: BTreeMap<TaskId, u32>,
    /// Finishes accepted but not stored yet: a restore forgets them.
    unstored: Vec<TaskId>,
}

impl Harness {
    fn new() -> Self {
        let config = QueueConfig { task_timeout: Duration::from_millis(1000), max_failures: 2, passes: 1 };
        Harness {
            q: TaskQueue::streaming(config.clone()).unwrap(),
            config,
            now: Instant::now(),
            appended: BTreeMap::new(),
            mark: 0,
            closed: false,
            stored: None,
            must_snapshot: false,
            held: Vec::new(),
            finished: BTreeMap::new(),
            unstored: Vec::new(),
        }
    }

    /// The state as stored, replayed.
    fn stored_snapshot(&self) -> Option<Snapshot> {
        self.stored.as_ref().map(|(base, deltas)| base.apply(deltas).unwrap())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Append(n, close) => {
                let mut tasks = Vec::new();
                for k in 0..n as u64 {
                    let start = self.mark + k * 10;
                    tasks.push(vec![Chunk { path: "/stream/f".into(), start, end: start + 10 }]);
                }
                let running = self.q.status().state == JobState::Running;
                let result =
                    self.q.append(tasks.clone(), (self.mark + n as u64 * 10).to_le_bytes().to_vec(), close);
                if self.closed || !running {
                    prop_assert!(result.is_err(), "append after the close or the end was taken");
                    return Ok(());
                }
                let ids = result.map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(ids.len(), n);
                for (id, chunks) in ids.into_iter().zip(tasks) {
                    prop_assert!(self.appended.keys().all(|&old| old < id), "ids increase");
                    self.appended.insert(id, chunks);
                }
                self.mark += n as u64 * 10;
                self.closed = close;
            }
            Op::Get(t) => {
                if let GetTask::Assigned(a) = self.q.get_task(TRAINERS[t], self.now) {
                    // Handed out only once stored, under the same id with the same chunks.
                    let stored =
                        self.stored_snapshot().expect("a task handed out before anything was stored");
                    let restored = TaskQueue::restore(stored, self.config.clone(), self.now).unwrap();
                    let same = restored.tasks().find(|task| task.id == a.task.id);
                    prop_assert_eq!(same, Some(&a.task), "task handed out before it was stored");
                    prop_assert_eq!(Some(&a.task.chunks), self.appended.get(&a.task.id));
                    // Every task below `open_from` is finished (or compacted away).
                    prop_assert!(a.open_from <= a.task.id);
                    for &id in self.appended.keys().filter(|&&id| id < a.open_from) {
                        let state = self.q.task_state(id);
                        let open = matches!(state, Some(TaskState::Todo | TaskState::Pending { .. }));
                        prop_assert!(!open, "task {} below open_from {} is {:?}", id, a.open_from, state);
                    }
                    self.held.push((a.task_ref, TRAINERS[t].to_string()));
                }
            }
            Op::FinishPending(k) | Op::FailPending(k) => {
                if self.held.is_empty() {
                    return Ok(());
                }
                let (r, _) = self.held.remove(k % self.held.len());
                let report = if matches!(op, Op::FinishPending(_)) {
                    let report = self.q.task_finished(r, self.now);
                    if report == Report::Accepted {
                        self.unstored.push(r.task);
                    }
                    report
                } else {
                    self.q.task_failed(r, "bad", self.now)
                };
                let _ = report;
            }
            Op::Gone(t) => {
                self.q.trainer_gone(TRAINERS[t], self.now);
                self.held.retain(|(_, who)| who != TRAINERS[t]);
            }
            Op::Tick(ms) => {
                self.now += Duration::from_millis(ms);
                self.q.tick(self.now);
            }
            Op::Take(store) => {
                let changes = self.q.take_changes(self.must_snapshot);
                if !store {
                    self.must_snapshot = true;
                    return Ok(());
                }
                match changes {
                    Changes::Snapshot(s) => {
                        let s =
                            Snapshot::decode(&s.encode()).map_err(|e| TestCaseError::fail(e.to_string()))?;
                        self.stored = Some((s, Vec::new()));
                    }
                    Changes::Delta(d) => {
                        prop_assert!(!self.must_snapshot);
                        let Some((_, deltas)) = self.stored.as_mut() else {
                            return Err(TestCaseError::fail("a delta before any snapshot"));
                        };
                        deltas.push(d);
                    }
                }
                self.must_snapshot = false;
                self.q.stored();
                for id in self.unstored.drain(..) {
                    *self.finished.entry(id).or_default() += 1;
                }
                // What is stored is what the queue holds.
                let replayed = self.stored_snapshot().unwrap();
                prop_assert_eq!(&replayed, &self.q.snapshot());
            }
            Op::Restore => {
                let Some(stored) = self.stored_snapshot() else { return Ok(()) };
                self.q = TaskQueue::restore(stored, self.config.clone(), self.now).unwrap();
                self.must_snapshot = false;
                self.unstored.clear();
                // The source restarts from the stored mark: what came after
                // it is appended again, as new tasks.
                let (mark, closed) = self.q.source_mark().unwrap();
                let mark = if mark.is_empty() { 0 } else { u64::from_le_bytes(mark.try_into().unwrap()) };
                let known: BTreeSet<TaskId> = self.q.tasks().map(|t| t.id).collect();
                self.appended.retain(|id, chunks| {
                    known.contains(id) || chunks[0].end <= mark || self.finished.contains_key(id)
                });
                self.mark = mark;
                self.closed = closed;
                // Trainers still hold their assignments: reports of tasks the
                // restored queue has pending are current.
            }
        }
        self.check()
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let st = self.q.status();
        let open = st.todo + st.pending + self.q.staged();
        prop_assert_eq!(st.pass, 0);
        prop_assert_eq!(
            open,
            self.q
                .tasks()
                .filter(|t| matches!(
                    self.q.task_state(t.id),
                    Some(oar_task_queue::TaskState::Todo | oar_task_queue::TaskState::Pending { .. })
                ))
                .count()
        );
        for (id, n) in &self.finished {
            prop_assert!(*n <= 1, "task {id} finished {n} times");
        }
        if st.state == JobState::Done {
            prop_assert!(self.closed && open == 0);
        }
        Ok(())
    }

    /// Close the source, store, and work every task off.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        if !self.closed && self.q.status().state == JobState::Running {
            self.step(&Op::Append(0, true))?;
        }
        for _ in 0..10_000 {
            if self.q.status().state != JobState::Running {
                break;
            }
            self.step(&Op::Take(true))?;
            match self.q.get_task("closer", self.now) {
                GetTask::Assigned(a) => {
                    if self.q.task_finished(a.task_ref, self.now) == Report::Accepted {
                        self.unstored.push(a.task.id);
                    }
                }
                _ => {
                    self.now += Duration::from_millis(2000);
                    self.q.tick(self.now);
                }
            }
        }
        self.step(&Op::Take(true))?;
        let st = self.q.status();
        prop_assert_eq!(st.state, JobState::Done);
        // Every task appended (and kept by the source) finished or was discarded, once.
        prop_assert_eq!(st.done as u64 + st.discarded as u64, self.appended.len() as u64, "{:?}", st);
        prop_assert!(self.finished.values().all(|&n| n == 1));
        prop_assert_eq!(st.done, self.finished.len());
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn streams_are_trained_once_across_restores(ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new();
        for op in &ops {
            h.step(op)?;
        }
        h.finish()?;
    }
}

#[test]
fn a_streaming_queue_waits_while_open_and_ends_when_closed() {
    let config = QueueConfig { task_timeout: Duration::from_secs(10), max_failures: 2, passes: 1 };
    assert!(
        TaskQueue::streaming(QueueConfig { passes: 2, ..config.clone() }).is_err(),
        "a stream has no passes"
    );
    let mut q = TaskQueue::streaming(config).unwrap();
    let now = Instant::now();
    assert_eq!(q.get_task("t", now), GetTask::Wait);
    let chunk = |s: u64| vec![Chunk { path: "/f".into(), start: s, end: s + 5 }];
    let ids = q.append(vec![chunk(0), chunk(5)], vec![1], false).unwrap();
    assert_eq!(ids, vec![TaskId(0), TaskId(1)]);
    // Staged until stored.
    assert_eq!(q.get_task("t", now), GetTask::Wait);
    assert!(matches!(q.take_changes(false), Changes::Snapshot(_)));
    q.stored();
    let GetTask::Assigned(a) = q.get_task("t", now) else { panic!("stored tasks are handed out") };
    assert_eq!(a.task.id, TaskId(0));
    q.task_finished(a.task_ref, now);
    let GetTask::Assigned(b) = q.get_task("t", now) else { panic!() };
    q.task_finished(b.task_ref, now);
    // Open: nothing to do is a wait, not the end.
    assert_eq!(q.get_task("t", now), GetTask::Wait);
    assert_eq!(q.status().state, JobState::Running);
    // Compaction: the snapshot holds no finished task, the counts stay.
    let Changes::Snapshot(s) = q.take_changes(true) else { panic!() };
    assert_eq!(s.task_count(), 0);
    assert_eq!(q.status().done, 2);
    let restored =
        TaskQueue::restore(Snapshot::decode(&s.encode()).unwrap(), q.config().clone(), now).unwrap();
    assert_eq!(restored.status(), q.status());
    assert_eq!(restored.source_mark(), Some((&[1u8][..], false)));
    // The close ends it.
    q.append(Vec::new(), vec![2], true).unwrap();
    assert_eq!(q.status().state, JobState::Done);
    assert!(q.append(vec![chunk(10)], vec![3], false).is_err(), "closed");
}
