//! Pushes that name their origin, in a shard's store: whoever pushes the
//! examples of a task, and however often (trainers killed in the middle of
//! a task, the task trained again, retries, parts), each example's
//! gradient is applied once; the origins survive a checkpoint and a
//! follower applying the primary's sync steps.

use oar_pserver::checkpoint::CheckpointDir;
use oar_pserver::{
    BlockId, Error, Grad, Init, Mode, Origin, ParamSpec, ParamStore, Placement, Push, PushOutcome, Sgd,
    TaskKey,
};
use proptest::prelude::*;
use std::collections::BTreeSet;

/// Examples per push, pushes per task.
const CHUNK: u32 = 8;
const CHUNKS: u32 = 4;
const TASKS: u64 = 5;

/// One shard holding two blocks of one float each, so a push may come in
/// two parts.
fn new_store(mode: Mode) -> ParamStore {
    let specs = vec![ParamSpec::new("w", vec![2], Init::Zeros)];
    let placement = Placement::new(&specs, 1, 1).unwrap();
    ParamStore::new(&placement, 0, 1, Box::new(Sgd { lr: 1.0 }), mode).unwrap()
}

fn blocks(store: &ParamStore) -> Vec<BlockId> {
    store.block_ids().collect()
}

fn origin(task: u64, chunk: u32, floor: u64) -> Origin {
    let key = |task| TaskKey { pass: 0, task };
    Origin { task: key(task), start: chunk * CHUNK, end: (chunk + 1) * CHUNK, floor: key(floor) }
}

/// A push of `CHUNK` examples whose gradient is -1 per example (so SGD at
/// lr 1 adds the examples applied to every parameter), of `parts` of the
/// shard's blocks.
fn push(store: &ParamStore, trainer: &str, seq: u64, origin: Origin, parts: &[usize]) -> Push {
    let ids = blocks(store);
    let n = (origin.end - origin.start) as f32;
    // Async applies the gradient as is; sync takes the weighted mean.
    let g = if store.mode() == Mode::Async { -n } else { -1.0 };
    let grads = parts.iter().map(|&b| (ids[b], Grad::Floats(vec![g]))).collect();
    Push {
        trainer: trainer.into(),
        seq,
        step: store.step(),
        weight: n,
        grads,
        rows: Vec::new(),
        origin: Some(origin),
    }
}

fn values(store: &ParamStore) -> Vec<f32> {
    blocks(store).into_iter().map(|id| store.block(id).unwrap()[0]).collect()
}

#[derive(Clone, Debug)]
enum Event {
    /// Trainer `trainer` pushes chunk `chunk` of `task` (a fresh seq), in
    /// one part or two (`split`: the first block, then maybe the second).
    Push { trainer: usize, task: u64, chunk: u32, split: Option<bool> },
    /// The last push of `trainer` again (a retry: same seq, same parts).
    Retry { trainer: usize },
    /// The master's floor moves to the lowest task not wholly applied
    /// (every task below it is finished), as trainers see it on their
    /// next task.
    Finish,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        8 => (0..3usize, 0..TASKS, 0..CHUNKS, proptest::option::of(any::<bool>()))
            .prop_map(|(trainer, task, chunk, split)| Event::Push { trainer, task, chunk, split }),
        2 => (0..3usize).prop_map(|trainer| Event::Retry { trainer }),
        1 => Just(Event::Finish),
    ]
}

proptest! {
    /// Async, against a model that keeps every (task, chunk, block)
    /// applied: every parameter holds exactly the examples applied to it,
    /// each once; a push is taken exactly when its examples are new; a
    /// push of a finished task changes nothing.
    #[test]
    fn each_example_is_applied_once_whoever_pushes_it(events in proptest::collection::vec(event(), 1..150)) {
        let mut store = new_store(Mode::Async);
        let trainers = ["t0", "t1", "t2"];
        let mut seqs = [0u64; 3];
        let mut last: [Option<Push>; 3] = Default::default();
        let mut applied: BTreeSet<(u64, u32, usize)> = BTreeSet::new();
        let mut floor = 0u64;
        for ev in events {
            let pushed = match ev {
                Event::Push { trainer, task, chunk, split } => {
                    seqs[trainer] += 1;
                    let parts: &[usize] = match split { None => &[0, 1], Some(false) => &[0], Some(true) => &[1] };
                    Some(push(&store, trainers[trainer], seqs[trainer], origin(task, chunk, floor), parts))
                }
                Event::Retry { trainer } => last[trainer].clone(),
                Event::Finish => {
                    floor = (0..TASKS)
                        .find(|&t| (0..CHUNKS).any(|c| (0..2).any(|b| !applied.contains(&(t, c, b)))))
                        .unwrap_or(TASKS);
                    None
                }
            };
            let Some(p) = pushed else { continue };
            let trainer = trainers.iter().position(|t| *t == p.trainer).unwrap();
            last[trainer] = Some(p.clone());
            let o = p.origin.unwrap();
            let chunk = o.start / CHUNK;
            let units: Vec<usize> = p.grads.iter().map(|(id, _)| blocks(&store).iter().position(|b| b == id).unwrap()).collect();
            let before = values(&store);
            let got = store.push(p.clone());
            let new: Vec<bool> = units.iter().map(|&b| !applied.contains(&(o.task.task, chunk, b))).collect();
            let finished = o.task.task < o.floor.task.max(floor);
            match got {
                Ok(PushOutcome::Applied { .. }) => {
                    prop_assert!(!finished && new.iter().all(|&n| n), "applied {:?} again", p.origin);
                    for &b in &units {
                        applied.insert((o.task.task, chunk, b));
                    }
                }
                Ok(PushOutcome::AppliedBefore | PushOutcome::Duplicate) => {
                    prop_assert!(finished || new.iter().all(|&n| !n), "dropped new examples {:?}", p.origin);
                    prop_assert_eq!(values(&store), before);
                }
                Ok(other) => return Err(TestCaseError::fail(format!("async answered {other:?}"))),
                Err(Error::OriginPartOverlap { .. }) => {
                    prop_assert!(new.iter().any(|&n| n) && new.iter().any(|&n| !n));
                    prop_assert_eq!(values(&store), before);
                }
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            }
            for (b, v) in values(&store).into_iter().enumerate() {
                let count = applied.iter().filter(|&&(_, _, block)| block == b).count() as f32;
                prop_assert_eq!(v, count * CHUNK as f32, "block {}", b);
            }
        }
    }
}

#[test]
fn a_task_trained_again_adds_only_what_its_first_trainer_did_not_push() {
    let mut store = new_store(Mode::Async);
    // The first trainer pushes two of four chunks, then dies.
    for chunk in 0..2 {
        store.push(push(&store, "dead", chunk as u64 + 1, origin(0, chunk, 0), &[0, 1])).unwrap();
    }
    // The task goes to another trainer, which trains it all.
    let mut outcomes = Vec::new();
    for chunk in 0..CHUNKS {
        outcomes
            .push(store.push(push(&store, "next", chunk as u64 + 1, origin(0, chunk, 0), &[0, 1])).unwrap());
    }
    assert_eq!(outcomes[..2], [PushOutcome::AppliedBefore; 2]);
    assert!(matches!(outcomes[2], PushOutcome::Applied { .. }));
    assert_eq!(values(&store), vec![(CHUNKS * CHUNK) as f32; 2], "32 examples, each once");
    assert_eq!(store.pushes(), 2 + u64::from(CHUNKS), "pushes taken, those applied before included");
    // A range cut differently is refused by name, and changes nothing.
    let mut odd = origin(0, 3, 0);
    odd.end += 8;
    let e = store.push(push(&store, "odd", 1, odd, &[0, 1])).unwrap_err();
    assert!(e.to_string().contains("examples 24..40 of task 0 (pass 0) overlap examples 0..32"), "{e}");
    assert_eq!(values(&store), vec![32.0; 2]);
}

#[test]
fn sync_a_push_applied_before_holds_its_place_in_the_step_with_no_weight() {
    let mut store = new_store(Mode::Sync);
    let mut follower = new_store(Mode::Sync);
    store.record_steps();
    for t in ["a", "b"] {
        store.join(t);
        follower.join(t);
    }
    // Step 0: a and b push chunks 0 and 1 of task 0.
    store.push(push(&store, "a", 1, origin(0, 0, 0), &[0, 1])).unwrap();
    let done = store.push(push(&store, "b", 1, origin(0, 1, 0), &[0, 1])).unwrap();
    assert_eq!(done, PushOutcome::Applied { step: 1 });
    assert_eq!(values(&store), vec![-(-1.0f32); 2], "the mean gradient -1, once");
    // Step 1: b (now on a's task again) pushes chunk 0, applied before; a
    // pushes chunk 2. The step completes with a's gradient alone.
    let first = store.push(push(&store, "b", 2, origin(0, 0, 0), &[0, 1])).unwrap();
    assert!(matches!(first, PushOutcome::Buffered { step: 1, waiting_for: 1 }), "{first:?}");
    let done = store.push(push(&store, "a", 2, origin(0, 2, 0), &[0, 1])).unwrap();
    assert_eq!(done, PushOutcome::Applied { step: 2 });
    assert_eq!(values(&store), vec![2.0; 2]);
    // Step 2: both push what was applied before: the step completes,
    // nothing changes.
    store.push(push(&store, "a", 3, origin(0, 1, 0), &[0, 1])).unwrap();
    let done = store.push(push(&store, "b", 3, origin(0, 2, 0), &[0, 1])).unwrap();
    assert_eq!(done, PushOutcome::Applied { step: 3 });
    assert_eq!(values(&store), vec![2.0; 2]);
    // A follower applying the steps ends with the same origins.
    for step in store.take_completed_steps() {
        follower.apply_step(step).unwrap();
    }
    assert_eq!(values(&follower), values(&store));
    assert_eq!(follower.origins(), store.origins());
    // Chunk 3 is still new on both.
    assert_eq!(follower.origins().tasks(), 1);
}

#[test]
fn origins_survive_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = new_store(Mode::Async);
    store.push(push(&store, "a", 1, origin(2, 0, 1), &[0, 1])).unwrap();
    store.push(push(&store, "a", 2, origin(3, 1, 1), &[0])).unwrap();
    // Its trainer dies before the second part: its lease ends, it leaves.
    store.leave("a");
    let ckpt = CheckpointDir::new(dir.path(), 0);
    ckpt.save(&store.snapshot().unwrap(), 2).unwrap();
    let mut restored = new_store(Mode::Async);
    ckpt.load_latest(&mut restored).unwrap().unwrap();
    assert_eq!(restored.origins(), store.origins());
    assert_eq!(restored.origins().floor(), TaskKey { pass: 0, task: 1 });
    // The retried examples are duplicates on the restored store; the half
    // pushed one takes only its missing part.
    let again = restored.push(push(&restored, "b", 1, origin(2, 0, 1), &[0, 1])).unwrap();
    assert_eq!(again, PushOutcome::AppliedBefore);
    let rest = restored.push(push(&restored, "b", 2, origin(3, 1, 1), &[1])).unwrap();
    assert!(matches!(rest, PushOutcome::Applied { .. }));
    assert_eq!(values(&restored), vec![16.0, 16.0]);
}
