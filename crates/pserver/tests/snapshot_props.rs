//! Property test of the store's copy-on-write snapshots: whatever is
//! applied after a snapshot is taken, the snapshot holds, and a checkpoint
//! written from it records, exactly the store's state at that step; and
//! taking snapshots never changes what the store computes.

use oar_pserver::checkpoint::{load_file, CheckpointDir};
use oar_pserver::{
    BlockId, Error, Grad, Init, Mode, ParamSpec, ParamStore, Placement, Push, SplitMix64, StoreSnapshot,
};
use proptest::prelude::*;

use crate::frozen;
use frozen::Frozen;
use std::path::Path;

const TRAINERS: [&str; 2] = ["a", "b"];

#[derive(Clone, Debug)]
enum Event {
    /// A part of a push: `trainer`'s gradient for a run of blocks (from
    /// `seed`); async pushes start a new seq when `fresh`.
    Push {
        trainer: usize,
        fresh: bool,
        seed: u64,
    },
    Snapshot,
    /// Drop one of the live snapshots (picked by the index).
    Drop(usize),
    /// Write one of the live snapshots as a checkpoint and load it back.
    Write(usize),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (0..TRAINERS.len(), any::<bool>(), any::<u64>())
            .prop_map(|(trainer, fresh, seed)| Event::Push { trainer, fresh, seed }),
        2 => Just(Event::Snapshot),
        1 => any::<usize>().prop_map(Event::Drop),
        1 => any::<usize>().prop_map(Event::Write),
    ]
}

/// What a call did, comparable across two stores.
fn outcome<T: std::fmt::Debug>(r: Result<T, Error>) -> String {
    match r {
        Ok(v) => format!("{v:?}"),
        Err(e) => format!("error: {e}"),
    }
}

/// The store's state as of its last completed step, which is what a
/// snapshot holds: in sync mode a push waiting in the step under way (its
/// seq is the step's, here) is in neither the parameters nor the dedup
/// table, where the trainer's seq of the step before stands (every trainer
/// pushes every step here), or none before the first.
fn at_last_step(store: &ParamStore, mode: Mode) -> Frozen {
    let mut frozen = frozen::whole(store);
    if mode == Mode::Sync {
        let step = store.step();
        frozen.seqs = frozen
            .seqs
            .into_iter()
            .filter_map(|(t, s)| match s == step {
                true => step.checked_sub(1).map(|prev| (t, prev)),
                false => Some((t, s)),
            })
            .collect();
    }
    frozen
}

fn run(mode: Mode, block_size: usize, events: Vec<Event>) -> Result<(), TestCaseError> {
    let specs: Vec<ParamSpec> = [7usize, 5, 3]
        .iter()
        .enumerate()
        .map(|(i, &n)| ParamSpec::new(format!("p{i}"), vec![n], Init::Normal { mean: 0.0, std: 1.0 }))
        .collect();
    let placement = Placement::new(&specs, 1, block_size).unwrap();
    let held: Vec<(BlockId, usize)> = placement.blocks_on(0).map(|b| (b.id, b.len)).collect();
    let mut store = ParamStore::new(&placement, 0, 5, frozen::adam(), mode).unwrap();
    // The same pushes, never snapshotted: the reference for the live store.
    let mut twin = ParamStore::new(&placement, 0, 5, frozen::adam(), mode).unwrap();
    for t in TRAINERS {
        store.join(t);
        twin.join(t);
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 0);
    let mut seqs = [0u64; TRAINERS.len()];
    // Each live snapshot with the store's state when it was taken.
    let mut live: Vec<(StoreSnapshot, Frozen)> = Vec::new();

    for ev in events {
        match ev {
            Event::Push { trainer, fresh, seed } => {
                let mut rng = SplitMix64::new(seed);
                let start = (rng.next_u64() % held.len() as u64) as usize;
                let len = 1 + (rng.next_u64() % (held.len() - start) as u64) as usize;
                let grads: Vec<(BlockId, Grad)> = held[start..start + len]
                    .iter()
                    .map(|&(id, n)| (id, Grad::Floats((0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect())))
                    .collect();
                // Sync: one seq per step; async: parts of one seq until a fresh one.
                let seq = match mode {
                    Mode::Sync => store.step(),
                    Mode::Async => {
                        seqs[trainer] += u64::from(fresh);
                        seqs[trainer]
                    }
                };
                let push = Push {
                    trainer: TRAINERS[trainer].into(),
                    seq,
                    step: store.step(),
                    weight: 1.0,
                    grads,
                    rows: Vec::new(),
                    origin: frozen::origin(&mut rng),
                };
                let got = outcome(store.push(push.clone()));
                prop_assert_eq!(got, outcome(twin.push(push)));
            }
            Event::Snapshot => match store.snapshot() {
                Ok(snap) => {
                    prop_assert!(!store.step_underway());
                    live.push((snap, at_last_step(&store, mode)));
                }
                Err(Error::CheckpointStepUnderway { step }) => {
                    // A sync step underway, or a push in parts half taken.
                    prop_assert!(
                        (mode == Mode::Sync && store.step_underway()) || store.push_in_parts_underway()
                    );
                    prop_assert_eq!(step, store.step());
                }
                Err(e) => return Err(TestCaseError::fail(format!("snapshot failed: {e}"))),
            },
            Event::Drop(pick) if !live.is_empty() => {
                live.remove(pick % live.len());
            }
            Event::Write(pick) if !live.is_empty() => {
                let (snap, frozen) = &live[pick % live.len()];
                let info = dir.save(snap, 2).unwrap();
                prop_assert_eq!(info.step, frozen.step);
                let mut loaded = ParamStore::new(&placement, 0, 99, frozen::adam(), mode).unwrap();
                load_file(Path::new(&info.path), &mut loaded).unwrap();
                prop_assert_eq!(
                    &frozen::whole(&loaded),
                    frozen,
                    "the checkpoint records the snapshot's step"
                );
            }
            Event::Drop(_) | Event::Write(_) => {}
        }
        prop_assert_eq!(
            frozen::whole(&store),
            frozen::whole(&twin),
            "snapshots change nothing the store computes"
        );
        for (snap, frozen) in &live {
            prop_assert_eq!(&frozen::of_snapshot(snap), frozen, "a snapshot keeps the state it was taken at");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn snapshots_keep_their_step_whatever_is_applied_after(
        sync in any::<bool>(),
        block_size in 1usize..6,
        events in prop::collection::vec(event(), 1..60),
    ) {
        run(if sync { Mode::Sync } else { Mode::Async }, block_size, events)?;
    }
}
