//! What the property tests compare stores by: their whole state, floats as
//! bits so that comparisons are exact.

#![allow(dead_code)] // Each test module uses a part.

use oar_pserver::{
    Adam, AppliedOrigins, BlockId, Mode, Origin, ParamStore, SplitMix64, StoreSnapshot, TaskKey,
};

/// A store's (or a snapshot's) state.
#[derive(Clone, Debug, PartialEq)]
pub struct Frozen {
    pub step: u64,
    pub blocks: Vec<(BlockId, Vec<u32>, u64, Vec<u32>)>,
    pub seqs: Vec<(String, u64)>,
    pub origins: AppliedOrigins,
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Everything: the step, every block with its optimizer state, and the
/// deduplication table (what a checkpoint records).
pub fn whole(st: &ParamStore) -> Frozen {
    let mut seqs: Vec<(String, u64)> = st.last_seqs().map(|(t, s)| (t.to_string(), s)).collect();
    seqs.sort();
    Frozen {
        step: st.step(),
        blocks: st.blocks().map(|(id, p, s)| (id, bits(p), s.step, bits(&s.slots))).collect(),
        seqs,
        origins: st.origins().clone(),
    }
}

/// What a replica must equal: in sync mode without the deduplication
/// table, since a primary's holds pushes still waiting in the step
/// underway, which its followers learn only with the completed step.
pub fn replica(st: &ParamStore) -> Frozen {
    let mut frozen = whole(st);
    if st.mode() == Mode::Sync {
        frozen.seqs.clear();
    }
    frozen
}

pub fn of_snapshot(snap: &StoreSnapshot) -> Frozen {
    Frozen {
        step: snap.step(),
        blocks: snap.blocks().map(|(id, p, s)| (id, bits(p), s.step, bits(&s.slots))).collect(),
        seqs: snap.last_seqs().map(|(t, s)| (t.to_string(), s)).collect(),
        origins: snap.origins().clone(),
    }
}

/// A push's origin drawn from a small space, so that pushes of different
/// trainers often name the same examples (a task trained again), and
/// floors move up: `None` a quarter of the time.
pub fn origin(rng: &mut SplitMix64) -> Option<Origin> {
    let mut draw = |n: u64| rng.next_u64() % n;
    if draw(4) == 0 {
        return None;
    }
    let task = TaskKey { pass: 0, task: draw(6) };
    let start = draw(4) as u32 * 8;
    let floor = TaskKey { pass: 0, task: draw(6).saturating_sub(3) };
    Some(Origin { task, start, end: start + 8, floor })
}

/// The optimizer the property tests use: Adam, whose state makes any
/// misapplied update show.
pub fn adam() -> Box<Adam> {
    Box::new(Adam { lr: 0.05, beta1: 0.9, beta2: 0.99, eps: 1e-8 })
}
