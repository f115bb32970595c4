//! Property tests of the parameter store over random event sequences,
//! against a reference model written independently here.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use oar_pserver::{
    BlockId, Error, Grad, Init, Mode, ParamSpec, ParamStore, Placement, Push, PushOutcome, Sgd, SplitMix64,
};
use proptest::prelude::*;

const LR: f32 = 0.25;
const TRAINERS: [&str; 4] = ["t2", "t10", "a", "t1"];

#[derive(Clone, Debug)]
enum Event {
    Join(usize),
    Leave(usize),
    Push {
        trainer: usize,
        /// 0 next, 1 skip ahead, 2 repeat last (a retry, or another part of it), 3 older.
        seq_kind: u8,
        /// 0..=3 current step, 4 next step (future), 5 previous step (stale).
        step_kind: u8,
        weight: usize,
        /// 0..=4 none, 5 NaN, 6 wrong length, 7 no block at all, 8 foreign block,
        /// 9 duplicate block, 10 bad weight.
        fault: u8,
        /// 0..=1 every held block; 2..=3 a part: a run of them (from `seed`).
        span_kind: u8,
        seed: u64,
    },
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        1 => (0..TRAINERS.len()).prop_map(Event::Join),
        1 => (0..TRAINERS.len()).prop_map(Event::Leave),
        6 => (0..TRAINERS.len(), 0u8..4, 0u8..6, 0usize..4, 0u8..11, 0u8..4, any::<u64>()).prop_map(
            |(trainer, seq_kind, step_kind, weight, fault, span_kind, seed)| Event::Push {
                trainer,
                seq_kind,
                step_kind,
                weight,
                fault,
                span_kind,
                seed,
            }
        ),
    ]
}

/// What the reference model expects of a push.
#[derive(Debug, PartialEq)]
enum Expect {
    Duplicate,
    Reject(&'static str),
    Buffered { step: u64, waiting_for: usize },
    Applied { step: u64 },
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::BadWeight { .. } => "weight",
        Error::NonFiniteGrad { .. } => "nan",
        Error::GradLength { .. } => "length",
        Error::EmptyPush { .. } => "empty",
        Error::PushBlockNotHeld { .. } => "foreign",
        Error::DuplicateBlock { .. } => "dupblock",
        Error::PartOverlap { .. } => "overlap",
        Error::StaleStep { .. } => "stale",
        Error::FutureStep { .. } => "future",
        Error::AlreadyBuffered { .. } => "again",
        Error::StepUnderway { .. } => "underway",
        _ => "other",
    }
}

/// The reference: a straightforward re-statement of the rules, block by
/// block, looking at every block after every event.
struct Model {
    mode: Mode,
    step: u64,
    members: BTreeSet<String>,
    joining: BTreeSet<String>,
    /// Per held block: trainer -> (weight, gradient) for the current step.
    pending: Vec<BTreeMap<String, (f32, Vec<f32>)>>,
    /// Per held block: updated for the current step.
    updated: Vec<bool>,
    /// Seq of each trainer's push for the current step.
    step_seqs: HashMap<String, u64>,
    last_seq: HashMap<String, u64>,
    /// Blocks taken of each trainer's last push, while some are missing.
    partial: HashMap<String, BTreeSet<usize>>,
    params: Vec<Vec<f32>>,
}

impl Model {
    fn sgd(&mut self, block: usize, grad: &[f32]) {
        for (x, y) in self.params[block].iter_mut().zip(grad) {
            *x -= LR * y;
        }
    }

    fn underway(&self) -> bool {
        self.updated.iter().any(|&u| u)
    }

    fn missing(&self, m: &str) -> bool {
        (0..self.params.len()).any(|b| !self.updated[b] && !self.pending[b].contains_key(m))
    }

    fn waiting_for(&self) -> usize {
        self.members.iter().filter(|m| self.missing(m)).count()
    }

    /// Update every block all members pushed; complete the step when every
    /// block is updated, or no member is left and some block was.
    fn settle(&mut self) -> bool {
        for b in 0..self.params.len() {
            if self.updated[b]
                || self.pending[b].is_empty()
                || !self.members.iter().all(|m| self.pending[b].contains_key(m))
            {
                continue;
            }
            // Sum in trainer order of s_k g_k, each push's share s_k of
            // the step's total weight (summed in f64) as an f32.
            let pushed = std::mem::take(&mut self.pending[b]);
            let total: f64 = pushed.values().map(|(w, _)| f64::from(*w)).sum();
            let mut mean: Vec<f32> = Vec::new();
            for (i, (w, g)) in pushed.values().enumerate() {
                let share = (f64::from(*w) / total) as f32;
                if i == 0 {
                    mean = g.iter().map(|x| share * x).collect();
                } else {
                    mean.iter_mut().zip(g).for_each(|(x, y)| *x += share * y);
                }
            }
            self.sgd(b, &mean);
            self.updated[b] = true;
        }
        let complete = self.underway() && (self.updated.iter().all(|&u| u) || self.members.is_empty());
        if complete {
            self.step += 1;
            self.updated.iter_mut().for_each(|u| *u = false);
            self.step_seqs.clear();
            let joining = std::mem::take(&mut self.joining);
            self.members.extend(joining);
        }
        complete
    }

    fn join(&mut self, t: &str) -> u64 {
        if self.members.contains(t) {
            self.step
        } else if self.mode == Mode::Sync && self.underway() {
            self.joining.insert(t.to_string());
            self.step + 1
        } else {
            self.members.insert(t.to_string());
            self.step
        }
    }

    fn leave(&mut self, t: &str) -> Option<u64> {
        self.members.remove(t);
        self.joining.remove(t);
        // A push left half taken is forgotten: its later parts are duplicates.
        self.partial.remove(t);
        (self.mode == Mode::Sync && self.settle()).then_some(self.step)
    }

    /// Blocks `blocks` of push `seq` taken; true when the push is whole.
    fn take(&mut self, t: &str, seq: u64, blocks: &[usize]) -> bool {
        let fresh = self.last_seq.insert(t.to_string(), seq) != Some(seq);
        let taken = self.partial.entry(t.to_string()).or_default();
        if fresh {
            taken.clear();
        }
        taken.extend(blocks.iter().copied());
        let whole = taken.len() == self.params.len();
        if whole {
            self.partial.remove(t);
        }
        whole
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        t: &str,
        seq: u64,
        step: u64,
        weight: f32,
        fault: Option<&'static str>,
        blocks: &[usize],
        grads: Vec<Vec<f32>>,
    ) -> Expect {
        let last = self.last_seq.get(t).copied();
        if last.is_some_and(|l| seq < l) || (last == Some(seq) && !self.partial.contains_key(t)) {
            return Expect::Duplicate;
        }
        if let Some(f) = fault {
            return Expect::Reject(f);
        }
        if last == Some(seq) {
            let again = blocks.iter().filter(|b| self.partial[t].contains(b)).count();
            if again == blocks.len() {
                return Expect::Duplicate;
            }
            if again > 0 {
                return Expect::Reject("overlap");
            }
        }
        match self.mode {
            Mode::Async => {
                for (&b, g) in blocks.iter().zip(&grads) {
                    self.sgd(b, g);
                }
                self.members.insert(t.to_string());
                if self.take(t, seq, blocks) {
                    self.step += 1;
                }
                Expect::Applied { step: self.step }
            }
            Mode::Sync => {
                if step < self.step {
                    return Expect::Reject("stale");
                }
                if step > self.step {
                    return Expect::Reject("future");
                }
                if self.step_seqs.get(t).is_some_and(|&s| s != seq) {
                    return Expect::Reject("again");
                }
                if !self.members.contains(t) && self.underway() {
                    return Expect::Reject("underway");
                }
                self.members.insert(t.to_string());
                self.step_seqs.insert(t.to_string(), seq);
                self.take(t, seq, blocks);
                for (&b, g) in blocks.iter().zip(grads) {
                    self.pending[b].insert(t.to_string(), (weight, g));
                }
                if self.settle() {
                    Expect::Applied { step: self.step }
                } else {
                    Expect::Buffered { step: self.step, waiting_for: self.waiting_for() }
                }
            }
        }
    }
}

fn snapshot(store: &ParamStore) -> Vec<Vec<f32>> {
    store.blocks().map(|(_, p, _)| p.to_vec()).collect()
}

/// Runs the events against the store and the model; returns the final step.
fn run(
    mode: Mode,
    servers: u32,
    server_pick: u32,
    block_size: usize,
    events: Vec<Event>,
) -> Result<u64, TestCaseError> {
    let specs = vec![
        ParamSpec::new("w", vec![3, 4], Init::Normal { mean: 0.0, std: 0.5 }),
        ParamSpec::new("b", vec![5], Init::Uniform { low: -1.0, high: 1.0 }),
    ];
    let placement = Placement::new(&specs, servers, block_size).unwrap();
    let server = server_pick % servers;
    let mut store = ParamStore::new(&placement, server, 3, Box::new(Sgd { lr: LR }), mode).unwrap();
    let held: Vec<(BlockId, usize)> = placement.blocks_on(server).map(|b| (b.id, b.len)).collect();
    let mut model = Model {
        mode,
        step: 0,
        members: BTreeSet::new(),
        joining: BTreeSet::new(),
        pending: held.iter().map(|_| BTreeMap::new()).collect(),
        updated: vec![false; held.len()],
        step_seqs: HashMap::new(),
        last_seq: HashMap::new(),
        partial: HashMap::new(),
        params: snapshot(&store),
    };
    let mut applied = 0;

    for ev in events {
        let before = snapshot(&store);
        let step_before = store.step();
        let waiting_before = store.waiting_for();
        match ev {
            Event::Join(i) => {
                prop_assert_eq!(store.join(TRAINERS[i]), model.join(TRAINERS[i]));
                prop_assert_eq!(store.step(), step_before);
            }
            Event::Leave(i) => {
                let t = TRAINERS[i];
                let something_buffered = model.underway() || model.pending.iter().any(|p| !p.is_empty());
                let got = store.leave(t);
                let want = model.leave(t);
                prop_assert_eq!(got, want);
                if got.is_some() {
                    applied += 1;
                    // It completed only because `t` was the last one missing.
                    prop_assert!(waiting_before.iter().all(|m| m == t), "{:?}", waiting_before);
                } else {
                    prop_assert_eq!(store.step(), step_before);
                }
                // The last missing member leaving completes the barrier.
                if mode == Mode::Sync && something_buffered && waiting_before == [t] {
                    prop_assert!(got.is_some());
                }
            }
            Event::Push { trainer, seq_kind, step_kind, weight, fault, span_kind, seed } => {
                let t = TRAINERS[trainer];
                let last = model.last_seq.get(t).copied();
                let seq = match seq_kind {
                    0 => last.map_or(0, |l| l + 1),
                    1 => last.map_or(4, |l| l + 3),
                    2 => last.unwrap_or(0),
                    _ => last.map_or(0, |l| l.saturating_sub(1)),
                };
                let step = match step_kind {
                    4 => model.step + 1,
                    5 => model.step.saturating_sub(1),
                    _ => model.step,
                };
                let mut weight = [1.0f32, 0.5, 3.0, 17.0][weight];
                let mut rng = SplitMix64::new(seed);
                // The blocks of this push (positions in `held`): all, or a run of them.
                let blocks: Vec<usize> = if span_kind < 2 {
                    (0..held.len()).collect()
                } else {
                    let start = (rng.next_u64() % held.len() as u64) as usize;
                    let len = 1 + (rng.next_u64() % (held.len() - start) as u64) as usize;
                    (start..start + len).collect()
                };
                let grads: Vec<Vec<f32>> = blocks
                    .iter()
                    .map(|&b| (0..held[b].1).map(|_| rng.next_f32() * 2.0 - 1.0).collect())
                    .collect();
                let mut wire: Vec<(BlockId, Vec<f32>)> =
                    blocks.iter().map(|&b| held[b].0).zip(grads.iter().cloned()).collect();
                let i = (rng.next_u64() % wire.len() as u64) as usize;
                let fault = match fault {
                    5 => {
                        let j = (rng.next_u64() % wire[i].1.len() as u64) as usize;
                        wire[i].1[j] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][j % 3];
                        Some("nan")
                    }
                    6 => {
                        if seed % 2 == 0 {
                            wire[i].1.push(0.0)
                        } else {
                            wire[i].1.pop();
                        }
                        Some("length")
                    }
                    7 => {
                        wire.clear();
                        Some("empty")
                    }
                    8 => {
                        let foreign = placement
                            .blocks()
                            .iter()
                            .find(|b| b.server != server)
                            .map_or(BlockId::new(99, 0), |b| b.id);
                        wire.push((foreign, vec![0.0; 4]));
                        Some("foreign")
                    }
                    9 => {
                        let copy = wire[i].clone();
                        wire.push(copy);
                        Some("dupblock")
                    }
                    10 => {
                        weight = [0.0, -1.0, f32::NAN, f32::INFINITY][(seed % 4) as usize];
                        Some("weight")
                    }
                    _ => None,
                };
                // Arrival order of blocks does not matter.
                let rot = (rng.next_u64() % wire.len().max(1) as u64) as usize;
                wire.rotate_left(rot);
                // As a pserver receives them (bytes read in place) or as floats.
                let as_bytes = rng.next_u64() % 2 == 0;
                let pushed = wire
                    .into_iter()
                    .map(|(id, g)| {
                        let g =
                            if as_bytes { Grad::Wire(oar_transport::f32s_to_bytes(&g)) } else { g.into() };
                        (id, g)
                    })
                    .collect();
                let push = Push {
                    trainer: t.to_string(),
                    seq,
                    step,
                    weight,
                    grads: pushed,
                    rows: Vec::new(),
                    origin: None,
                };
                let members_before = store.members();
                let got = match store.push(push) {
                    Ok(PushOutcome::Duplicate) => Expect::Duplicate,
                    Ok(PushOutcome::AppliedBefore) => {
                        return Err(TestCaseError::fail("a push without an origin was 'applied before'"))
                    }
                    Ok(PushOutcome::Applied { step }) => Expect::Applied { step },
                    Ok(PushOutcome::Buffered { step, waiting_for }) => Expect::Buffered { step, waiting_for },
                    Err(e) => {
                        prop_assert!(e.to_string().contains(t), "{}", e);
                        Expect::Reject(kind(&e))
                    }
                };
                let want = model.push(t, seq, step, weight, fault, &blocks, grads);
                prop_assert_eq!(&got, &want);
                match got {
                    Expect::Duplicate | Expect::Reject(_) => {
                        // Harmless: nothing changed.
                        prop_assert_eq!(&snapshot(&store), &before);
                        prop_assert_eq!(store.step(), step_before);
                        prop_assert_eq!(store.members(), members_before);
                        prop_assert_eq!(store.waiting_for(), waiting_before);
                    }
                    Expect::Applied { .. } => {
                        // Async: a part counts a step only when it makes its push whole.
                        applied += store.step() - step_before;
                        if mode == Mode::Sync {
                            // Never completes while another member is missing.
                            prop_assert!(waiting_before.iter().all(|m| m == t), "{:?}", waiting_before);
                        }
                    }
                    Expect::Buffered { waiting_for, .. } => {
                        prop_assert!(waiting_for > 0);
                        prop_assert_eq!(store.waiting_for().len(), waiting_for);
                    }
                }
            }
        }
        prop_assert!(store.step() >= step_before, "step went back");
        let members: Vec<String> = model.members.iter().cloned().collect();
        prop_assert_eq!(store.members(), members);
        prop_assert_eq!(store.step(), model.step);
        prop_assert_eq!(store.step_underway(), mode == Mode::Sync && model.underway());
        prop_assert_eq!(store.waiting_for().len(), model.waiting_for());
        // Same arithmetic in the same order: bit-identical.
        prop_assert_eq!(&snapshot(&store), &model.params);
    }
    prop_assert_eq!(store.step(), applied);
    Ok(store.step())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn sync_store_matches_reference(
        servers in 1u32..4, server in 0u32..4, block_size in 1usize..7,
        events in prop::collection::vec(event(), 1..80),
    ) {
        run(Mode::Sync, servers, server, block_size, events)?;
    }

    #[test]
    fn async_store_matches_reference(
        servers in 1u32..4, server in 0u32..4, block_size in 1usize..7,
        events in prop::collection::vec(event(), 1..60),
    ) {
        run(Mode::Async, servers, server, block_size, events)?;
    }
}

/// The barrier really completes in normal operation: with all trainers
/// pushing every step, every step is applied once.
#[test]
fn sync_lockstep_applies_every_step() {
    let joins = (0..TRAINERS.len()).map(Event::Join);
    let events: Vec<Event> = joins
        .chain((0..5).flat_map(|_| {
            (0..TRAINERS.len()).map(|trainer| Event::Push {
                trainer,
                seq_kind: 0,
                step_kind: 0,
                weight: trainer,
                fault: 0,
                span_kind: 0,
                seed: trainer as u64,
            })
        }))
        .collect();
    assert_eq!(run(Mode::Sync, 2, 1, 3, events).unwrap(), 5);
}
