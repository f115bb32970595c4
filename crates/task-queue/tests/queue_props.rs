//! Property tests of the task queue over random event sequences.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use oar_task_queue::{
    Changes, Chunk, Delta, GetTask, JobState, QueueConfig, QueueEvent, Report, Snapshot, Status, TaskId,
    TaskQueue, TaskRef, TaskSpec, TaskState,
};
use proptest::prelude::*;

const TRAINERS: [&str; 3] = ["t0", "t1", "t2"];
const TIMEOUT_MS: u64 = 1000;

/// What a report says of its task.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Finished,
    Failed,
    Returned,
}

/// How a report's ref is derived from one handed out earlier.
#[derive(Clone, Copy, Debug)]
enum Mutation {
    AsIs,
    AttemptPlus,
    AttemptMinus,
    PassPlus,
    PassMinus,
    OtherTask,
}

#[derive(Clone, Debug)]
enum Op {
    Get(usize),
    /// Finish the k-th currently pending task with its current ref.
    FinishPending(usize),
    FailPending(usize),
    /// Hand the k-th currently pending task back with its current ref.
    ReturnPending(usize),
    /// Report on a ref handed out at some point (current or stale).
    Finish(usize, Mutation),
    Fail(usize, Mutation),
    Return(usize, Mutation),
    Gone(usize),
    /// Abort the job.
    Abort,
    /// Advance the clock by this many ms, then tick.
    Tick(u64),
    /// Snapshot, encode, decode, restore, and carry on with the restored queue.
    Restore,
    /// Take the changes for the journal (asking for a snapshot or not) and
    /// check that the stored snapshot plus deltas equal the queue.
    Take(bool),
    /// Take the changes, then restore from the journal and carry on.
    RestoreFromJournal,
}

fn op() -> impl Strategy<Value = Op> {
    let mutation = prop_oneof![
        3 => Just(Mutation::AsIs),
        1 => Just(Mutation::AttemptPlus),
        1 => Just(Mutation::AttemptMinus),
        1 => Just(Mutation::PassPlus),
        1 => Just(Mutation::PassMinus),
        1 => Just(Mutation::OtherTask),
    ];
    prop_oneof![
        4 => (0..3usize).prop_map(Op::Get),
        3 => any::<usize>().prop_map(Op::FinishPending),
        1 => any::<usize>().prop_map(Op::FailPending),
        1 => any::<usize>().prop_map(Op::ReturnPending),
        2 => (any::<usize>(), mutation.clone()).prop_map(|(k, m)| Op::Finish(k, m)),
        1 => (any::<usize>(), mutation.clone()).prop_map(|(k, m)| Op::Fail(k, m)),
        1 => (any::<usize>(), mutation).prop_map(|(k, m)| Op::Return(k, m)),
        1 => (0..3usize).prop_map(Op::Gone),
        1 => Just(Op::Abort),
        2 => (0..1500u64).prop_map(Op::Tick),
        1 => Just(Op::Restore),
        3 => prop_oneof![5 => Just(Op::Take(false)), 1 => Just(Op::Take(true))],
        1 => Just(Op::RestoreFromJournal),
    ]
}

type Observed = (Status, Vec<Option<TaskState>>);

struct Harness {
    q: TaskQueue,
    config: QueueConfig,
    ids: Vec<TaskId>,
    now: Instant,
    /// Every ref handed out.
    handed: Vec<TaskRef>,
    /// Deadlines of pending tasks as the test knows them.
    deadlines: HashMap<TaskId, Instant>,
    /// Accepted finishes per (task, pass).
    finishes: HashMap<(TaskId, u32), u32>,
    /// The pass each discarded task was discarded in.
    discarded_in: HashMap<TaskId, u32>,
    /// Failures per (task, pass), from the events.
    failures: HashMap<(TaskId, u32), u32>,
    /// The todo queue as the rules say it must be, front first.
    todo: VecDeque<TaskId>,
    saw_job_done: bool,
    saw_job_failed: bool,
    /// The job was aborted (it failed with tasks done).
    aborted: bool,
    /// What a shell would have stored: the last snapshot and the deltas since.
    journal: Option<(Snapshot, Vec<Delta>)>,
    /// Tasks discarded since the last store (a take or a restore), with the
    /// pass they were discarded in.
    unstored: HashMap<TaskId, u32>,
}

fn observe(q: &TaskQueue, ids: &[TaskId]) -> Observed {
    (q.status(), ids.iter().map(|&id| q.task_state(id)).collect())
}

fn roundtrip(q: &TaskQueue, config: &QueueConfig, now: Instant) -> TaskQueue {
    let bytes = q.snapshot().encode();
    let snap = Snapshot::decode(&bytes).unwrap();
    TaskQueue::restore(snap, config.clone(), now).unwrap()
}

fn pending_tasks(obs: &Observed, ids: &[TaskId]) -> Vec<(TaskId, String, u32)> {
    ids.iter()
        .zip(&obs.1)
        .filter_map(|(&id, st)| match st {
            Some(TaskState::Pending { trainer, attempt }) => Some((id, trainer.clone(), *attempt)),
            _ => None,
        })
        .collect()
}

/// Whether `r` is the current pending assignment in the state `obs`.
fn is_current(obs: &Observed, ids: &[TaskId], r: TaskRef) -> bool {
    obs.0.state == JobState::Running
        && r.pass == obs.0.pass
        && ids.iter().position(|&id| id == r.task).is_some_and(
            |i| matches!(&obs.1[i], Some(TaskState::Pending { attempt, .. }) if *attempt == r.attempt),
        )
}

impl Harness {
    fn new(n: usize, max_failures: u32, passes: u32) -> Self {
        // Ids with gaps, given out of order.
        let mut tasks: Vec<TaskSpec> = (0..n as u64)
            .map(|i| TaskSpec {
                id: TaskId(i * 3 + 1),
                chunks: vec![Chunk { path: format!("/d/{}", i % 2), start: i * 10, end: i * 10 + 10 }],
            })
            .collect();
        tasks.reverse();
        let mut ids: Vec<TaskId> = tasks.iter().map(|t| t.id).collect();
        ids.sort();
        let config = QueueConfig { task_timeout: Duration::from_millis(TIMEOUT_MS), max_failures, passes };
        Harness {
            q: TaskQueue::new(tasks, config.clone()).unwrap(),
            config,
            todo: ids.iter().copied().collect(),
            ids,
            now: Instant::now(),
            handed: Vec::new(),
            deadlines: HashMap::new(),
            finishes: HashMap::new(),
            discarded_in: HashMap::new(),
            failures: HashMap::new(),
            saw_job_done: false,
            saw_job_failed: false,
            aborted: false,
            journal: None,
            unstored: HashMap::new(),
        }
    }

    fn mutate(&self, r: TaskRef, m: Mutation) -> TaskRef {
        match m {
            Mutation::AsIs => r,
            Mutation::AttemptPlus => TaskRef { attempt: r.attempt + 1, ..r },
            Mutation::AttemptMinus => TaskRef { attempt: r.attempt.saturating_sub(1), ..r },
            Mutation::PassPlus => TaskRef { pass: r.pass + 1, ..r },
            Mutation::PassMinus => TaskRef { pass: r.pass.saturating_sub(1), ..r },
            Mutation::OtherTask => TaskRef { task: TaskId(r.task.0 + 1), ..r },
        }
    }

    /// Sends a report and checks the answer against the prediction.
    fn report(&mut self, before: &Observed, r: TaskRef, kind: Kind) -> Result<(), TestCaseError> {
        let current = is_current(before, &self.ids, r);
        let holder = pending_tasks(before, &self.ids).into_iter().find(|(id, _, _)| *id == r.task);
        let expected_holder = holder.filter(|_| current).map(|(_, trainer, _)| trainer);
        prop_assert_eq!(self.q.holder(r).map(str::to_string), expected_holder);
        let answer = match kind {
            Kind::Finished => self.q.task_finished(r, self.now),
            Kind::Failed => self.q.task_failed(r, "boom", self.now),
            Kind::Returned => self.q.task_returned(r, self.now),
        };
        prop_assert_eq!(answer == Report::Accepted, current, "report {:?} on {:?}", r, before);
        if answer == Report::Accepted {
            self.deadlines.remove(&r.task);
            if kind == Kind::Finished {
                let count = self.finishes.entry((r.task, r.pass)).or_default();
                *count += 1;
                prop_assert_eq!(*count, 1, "task {} finished twice in pass {}", r.task, r.pass);
            }
        }
        Ok(())
    }

    /// Takes the queue's changes into the journal and checks that replaying
    /// the journal gives the queue's own snapshot, todo order included.
    fn take(&mut self, want_snapshot: bool) -> Result<Snapshot, TestCaseError> {
        match self.q.take_changes(want_snapshot) {
            Changes::Snapshot(snapshot) => self.journal = Some((snapshot, Vec::new())),
            Changes::Delta(delta) => {
                prop_assert!(!want_snapshot, "asked for a snapshot, got a delta");
                let Some((_, deltas)) = self.journal.as_mut() else {
                    return Err(TestCaseError::fail("a delta before any snapshot"));
                };
                prop_assert_eq!(delta.version(), self.q.version());
                deltas.push(delta);
            }
        }
        let (base, deltas) = self.journal.as_ref().unwrap();
        let replayed = base.apply(deltas).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&replayed, &self.q.snapshot(), "journal replay differs from the queue");
        // What was taken is stored, as by a shell's successful write.
        self.q.stored_up_to(self.q.version());
        self.unstored.clear();
        Ok(replayed)
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let before = observe(&self.q, &self.ids);
        let v0 = self.q.version();
        // Failures this step must add to the job's total.
        let mut new_failures = 0u64;
        let mut restored = false;
        match *op {
            Op::Get(t) => match self.q.get_task(TRAINERS[t], self.now) {
                GetTask::Assigned(a) => {
                    let i = self.ids.iter().position(|&id| id == a.task.id).unwrap();
                    prop_assert_eq!(&before.1[i], &Some(TaskState::Todo));
                    prop_assert_eq!(a.task_ref.pass, before.0.pass);
                    prop_assert_eq!(a.task_ref.task, a.task.id);
                    prop_assert_eq!(self.todo.pop_front(), Some(a.task.id), "not the front of todo");
                    let fails = self.failures.get(&(a.task.id, before.0.pass)).copied().unwrap_or(0);
                    prop_assert_eq!(a.task_ref.attempt, fails, "attempt = failures so far in this pass");
                    // Every task below `open_from` is finished in this pass
                    // (a discard only once stored); the one there (if any)
                    // is open (this one, at worst).
                    prop_assert!(
                        !self.unstored.values().any(|&p| p < before.0.pass),
                        "a task of a pass that a discard not stored yet ended went out"
                    );
                    for (k, &id) in self.ids.iter().enumerate() {
                        let finished = match before.1[k] {
                            Some(TaskState::Done) => true,
                            Some(TaskState::Discarded { .. }) => !self.unstored.contains_key(&id),
                            _ => false,
                        };
                        if id < a.open_from {
                            prop_assert!(finished, "task {} below open_from {} is open", id, a.open_from);
                        } else if id == a.open_from {
                            prop_assert!(!finished, "open_from {} is finished", id);
                        }
                    }
                    prop_assert!(a.open_from <= a.task.id);
                    prop_assert_eq!(a.deadline, self.now + self.config.task_timeout);
                    prop_assert_eq!(
                        self.q.task_state(a.task.id),
                        Some(TaskState::Pending { trainer: TRAINERS[t].into(), attempt: a.task_ref.attempt })
                    );
                    self.handed.push(a.task_ref);
                    self.deadlines.insert(a.task.id, a.deadline);
                }
                GetTask::Wait => {
                    prop_assert_eq!(before.0.state, JobState::Running);
                    let pass_ended_unstored = self.unstored.values().any(|&p| p < before.0.pass);
                    prop_assert!(
                        (before.0.todo == 0 && before.0.pending > 0) || pass_ended_unstored,
                        "{:?}",
                        before.0
                    );
                }
                GetTask::Done => prop_assert_eq!(before.0.state, JobState::Done),
                GetTask::Failed => prop_assert!(before.0.state.is_failure()),
            },
            Op::FinishPending(k) | Op::FailPending(k) | Op::ReturnPending(k) => {
                let pending = pending_tasks(&before, &self.ids);
                if !pending.is_empty() {
                    let (task, _, attempt) = pending[k % pending.len()];
                    let r = TaskRef { task, pass: before.0.pass, attempt };
                    let kind = match op {
                        Op::FinishPending(_) => Kind::Finished,
                        Op::FailPending(_) => Kind::Failed,
                        _ => Kind::Returned,
                    };
                    self.report(&before, r, kind)?;
                    new_failures += u64::from(kind == Kind::Failed);
                }
            }
            Op::Finish(k, m) | Op::Fail(k, m) | Op::Return(k, m) => {
                if !self.handed.is_empty() {
                    let r = self.mutate(self.handed[k % self.handed.len()], m);
                    let kind = match op {
                        Op::Finish(..) => Kind::Finished,
                        Op::Fail(..) => Kind::Failed,
                        _ => Kind::Returned,
                    };
                    let current = is_current(&before, &self.ids, r);
                    self.report(&before, r, kind)?;
                    new_failures += u64::from(kind == Kind::Failed && current);
                }
            }
            Op::Gone(t) => {
                let held: Vec<TaskId> = pending_tasks(&before, &self.ids)
                    .into_iter()
                    .filter(|(_, trainer, _)| trainer == TRAINERS[t])
                    .map(|(id, _, _)| id)
                    .collect();
                prop_assert_eq!(self.q.trainer_gone(TRAINERS[t], self.now), held.len());
                for id in &held {
                    self.deadlines.remove(id);
                }
                new_failures += held.len() as u64;
            }
            Op::Abort => {
                let open = before.0.todo + before.0.pending;
                let running = before.0.state == JobState::Running;
                prop_assert_eq!(self.q.abort("diverged", self.now), running);
                if running {
                    self.aborted = true;
                    for (id, _, _) in pending_tasks(&before, &self.ids) {
                        self.deadlines.remove(&id);
                    }
                    let after = self.q.status();
                    prop_assert_eq!(after.discarded, before.0.discarded + open);
                    prop_assert_eq!(after.done, before.0.done, "tasks done stay done");
                }
            }
            Op::Tick(ms) => {
                self.now += Duration::from_millis(ms);
                let expired: Vec<TaskId> = pending_tasks(&before, &self.ids)
                    .into_iter()
                    .map(|(id, _, _)| id)
                    .filter(|id| self.deadlines[id] <= self.now)
                    .collect();
                prop_assert_eq!(self.q.tick(self.now), expired.len());
                for id in &expired {
                    self.deadlines.remove(id);
                }
                new_failures += expired.len() as u64;
            }
            Op::Restore => {
                self.q = roundtrip(&self.q, &self.config, self.now);
                self.unstored.clear();
                prop_assert_eq!(self.q.version(), v0);
                for (id, _, _) in pending_tasks(&before, &self.ids) {
                    self.deadlines.insert(id, self.now + self.config.task_timeout);
                }
                restored = true;
                // A restored queue starts its journal with a snapshot.
                self.journal = None;
            }
            Op::Take(want_snapshot) => {
                self.take(want_snapshot)?;
            }
            Op::RestoreFromJournal => {
                let replayed = self.take(false)?;
                self.q = TaskQueue::restore(replayed, self.config.clone(), self.now).unwrap();
                prop_assert_eq!(self.q.version(), v0);
                for (id, _, _) in pending_tasks(&before, &self.ids) {
                    self.deadlines.insert(id, self.now + self.config.task_timeout);
                }
                restored = true;
                self.journal = None;
            }
        }
        let after = observe(&self.q, &self.ids);
        self.check(&before, &after, v0, new_failures, restored)
    }

    fn check(
        &mut self,
        before: &Observed,
        after: &Observed,
        v0: u64,
        new_failures: u64,
        restored: bool,
    ) -> Result<(), TestCaseError> {
        let (st, states) = after;
        // Version moves iff something observable changed.
        if before != after {
            prop_assert!(self.q.version() > v0, "changed but version stayed {}", v0);
        } else {
            prop_assert_eq!(self.q.version(), v0, "nothing changed but version moved");
        }
        prop_assert!(!restored || before == after, "restore changed the state");
        prop_assert_eq!(st.failures, before.0.failures + new_failures);

        // Each task in exactly one state; counts add up.
        let mut counts = [0usize; 4];
        for s in states {
            match s {
                Some(TaskState::Todo) => counts[0] += 1,
                Some(TaskState::Pending { .. }) => counts[1] += 1,
                Some(TaskState::Done) => counts[2] += 1,
                Some(TaskState::Discarded { .. }) => counts[3] += 1,
                None => prop_assert!(false, "a task has no state"),
            }
        }
        prop_assert_eq!(counts, [st.todo, st.pending, st.done, st.discarded]);
        prop_assert_eq!(counts.iter().sum::<usize>(), self.ids.len());
        prop_assert!(st.pass < self.config.passes && st.passes == self.config.passes, "{:?}", st);
        if st.state == JobState::Running {
            prop_assert!(st.todo + st.pending > 0, "running with nothing open: {:?}", st);
        } else {
            prop_assert_eq!(st.todo + st.pending, 0);
        }
        // `done` counts exactly this pass's accepted finishes.
        let finished_now = self.finishes.iter().filter(|((_, p), _)| *p == st.pass).count();
        prop_assert_eq!(st.done, finished_now);
        prop_assert!(st.pass >= before.0.pass);

        // The persisted form restores to the same thing.
        let r = roundtrip(&self.q, &self.config, self.now);
        prop_assert_eq!(&observe(&r, &self.ids), after);
        prop_assert_eq!(r.version(), self.q.version());

        for event in self.q.drain_events() {
            match event {
                QueueEvent::TaskDiscarded { task, pass, reason } => {
                    prop_assert!(reason.contains("failure(s)"), "{}", reason);
                    self.unstored.insert(task, pass);
                    prop_assert!(self.discarded_in.insert(task, pass).is_none(), "discarded twice");
                    let fails = self.failures.get(&(task, pass)).copied().unwrap_or(0);
                    prop_assert_eq!(fails, self.config.max_failures, "discarded at the threshold");
                    prop_assert_eq!(self.todo.pop_back(), Some(task));
                }
                QueueEvent::PassEnded { pass, done, discarded } => {
                    prop_assert_eq!(done + discarded, self.ids.len(), "pass {} ended", pass);
                    prop_assert!(self.todo.is_empty());
                    // The next pass (if any) refills todo from this pass's finished tasks, in id order.
                    self.todo = self
                        .ids
                        .iter()
                        .copied()
                        .filter(|&id| self.finishes.contains_key(&(id, pass)))
                        .collect();
                }
                QueueEvent::JobDone => {
                    self.saw_job_done = true;
                    self.todo.clear();
                }
                QueueEvent::JobFailed { .. } => {
                    self.saw_job_failed = true;
                    self.todo.clear();
                }
                QueueEvent::JobAborted { pass, reason, discarded } => {
                    prop_assert!(reason.contains("diverged"), "{}", reason);
                    for task in discarded {
                        prop_assert!(self.discarded_in.insert(task, pass).is_none(), "discarded twice");
                    }
                    self.saw_job_failed = true;
                    self.todo.clear();
                }
                QueueEvent::TaskReturned { task_ref, .. } => {
                    // Back at the front, no failure counted: the next get takes it.
                    self.todo.push_front(task_ref.task);
                }
                QueueEvent::TaskTimedOut { task_ref, .. } | QueueEvent::TaskFailed { task_ref, .. } => {
                    *self.failures.entry((task_ref.task, task_ref.pass)).or_default() += 1;
                    self.todo.push_back(task_ref.task);
                }
            }
        }
        let mut model_todo: Vec<TaskId> = self.todo.iter().copied().collect();
        model_todo.sort();
        let todo_now: Vec<TaskId> = self
            .ids
            .iter()
            .zip(states)
            .filter(|(_, s)| **s == Some(TaskState::Todo))
            .map(|(id, _)| *id)
            .collect();
        prop_assert_eq!(model_todo, todo_now, "todo set");
        prop_assert_eq!(self.saw_job_done, st.state == JobState::Done);
        prop_assert_eq!(self.saw_job_failed, st.state.is_failure());
        prop_assert_eq!(self.aborted, st.state == JobState::Aborted);
        prop_assert_eq!(self.discarded_in.len(), st.discarded);

        if st.state == JobState::Done {
            // Every task finished exactly once in each pass it was in.
            for &id in &self.ids {
                let last = self.discarded_in.get(&id).copied().unwrap_or(self.config.passes);
                for pass in 0..self.config.passes {
                    let n = self.finishes.get(&(id, pass)).copied().unwrap_or(0);
                    prop_assert_eq!(n, u32::from(pass < last), "task {} pass {}", id, pass);
                }
            }
        }
        if st.state == JobState::Failed {
            prop_assert_eq!(st.discarded, self.ids.len());
        }
        Ok(())
    }

    /// Drives the job to its end with trainer 0 finishing everything,
    /// storing what changed before each task, and expiring other trainers'
    /// tasks when it has to wait.
    fn finish_job(&mut self) -> Result<(), TestCaseError> {
        let bound =
            self.ids.len() * (self.config.passes as usize + 1) * (self.config.max_failures as usize + 2) * 4;
        for _ in 0..bound {
            let st = self.q.status();
            if st.state != JobState::Running {
                break;
            }
            if st.todo == 0 {
                self.step(&Op::Tick(TIMEOUT_MS))?;
            } else {
                // Stored first, as a shell does within a tick: a pass that
                // a discard ended hands out nothing until it is.
                self.step(&Op::Take(false))?;
                self.step(&Op::Get(0))?;
                self.step(&Op::FinishPending(0))?;
            }
        }
        prop_assert!(self.q.status().state != JobState::Running, "job did not end: {:?}", self.q.status());
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_event_sequences_keep_invariants(
        n in 1usize..8,
        max_failures in 1u32..4,
        passes in 1u32..4,
        ops in prop::collection::vec(op(), 0..120),
    ) {
        let mut h = Harness::new(n, max_failures, passes);
        for op in &ops {
            h.step(op)?;
        }
        h.finish_job()?;
    }
}
