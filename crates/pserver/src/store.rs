//! The parameter store of one pserver shard: its blocks, their optimizer
//! state, push deduplication and the sync barrier. No I/O, no clock.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Error, Result};
use crate::optimizer::{Optimizer, OptimizerState};
use crate::placement::{BlockId, Placement};
use crate::spec::init_values;

/// How pushes become updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Wait for every member trainer's gradient for the step, combine them in
    /// trainer-id order, apply once.
    Sync,
    /// Apply every push on arrival.
    Async,
}

/// One block's gradient as a push carries it.
#[derive(Clone, Debug, PartialEq)]
pub enum Grad {
    /// Floats in memory.
    Floats(Vec<f32>),
    /// Little-endian `f32` bytes as they arrived: a view into the push's
    /// message (`Bytes::slice`), so a pserver applies a push without copying
    /// it first. A length that is not a multiple of 4 is refused by the store.
    Wire(bytes::Bytes),
}

impl From<Vec<f32>> for Grad {
    fn from(floats: Vec<f32>) -> Self {
        Grad::Floats(floats)
    }
}

impl Grad {
    /// Elements (for wire bytes, whole 4-byte values).
    pub fn len(&self) -> usize {
        match self {
            Grad::Floats(v) => v.len(),
            Grad::Wire(b) => b.len() / 4,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whole elements: false for wire bytes with a partial value at the end.
    fn whole(&self) -> bool {
        match self {
            Grad::Floats(_) => true,
            Grad::Wire(b) => b.len() % 4 == 0,
        }
    }

    /// The first value that is NaN or infinite, with its index.
    fn first_non_finite(&self) -> Option<(usize, f32)> {
        match self {
            Grad::Floats(v) => v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i])),
            Grad::Wire(b) => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .enumerate()
                .find(|(_, x)| !x.is_finite()),
        }
    }

    /// The values: borrowed where the bytes can be read in place (aligned,
    /// on a little-endian machine), else decoded into `scratch`.
    fn floats<'a>(&'a self, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        match self {
            Grad::Floats(v) => v,
            Grad::Wire(b) => match oar_transport::f32s_view(b) {
                Some(view) => view,
                None => {
                    let n = b.len() / 4;
                    scratch.resize(n, 0.0);
                    // Lengths match by construction.
                    let _ = oar_transport::copy_f32s_from_bytes(scratch, &b[..n * 4]);
                    scratch
                }
            },
        }
    }
}

/// One trainer's gradients for all the blocks a server holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Push {
    /// Trainer id; also the order in which sync gradients are summed.
    pub trainer: String,
    /// Strictly increasing per trainer over the trainer's whole life; a push
    /// with `seq <=` the last accepted one is a retry and is not applied again.
    /// A restarted trainer must use a new id or continue above its old seqs.
    pub seq: u64,
    /// Sync: the step the gradient was computed at (must equal the store's
    /// step). Async: informational, not checked.
    pub step: u64,
    /// Sync: the weight of this gradient in the weighted mean, normally the
    /// mini-batch size. Async: validated but not used (the gradient is
    /// applied as is).
    pub weight: f32,
    /// One gradient per held block, in any order.
    pub grads: Vec<(BlockId, Grad)>,
}

/// What a push did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PushOutcome {
    /// An update was applied; `step` is the store's step after it.
    Applied {
        /// The new step.
        step: u64,
    },
    /// Sync: buffered for `step`, waiting for `waiting_for` more members.
    Buffered {
        /// The step being gathered.
        step: u64,
        /// Members that have not pushed for it yet.
        waiting_for: usize,
    },
    /// A retry of a push already accepted: nothing changed.
    Duplicate,
}

/// A held block: its parameters and optimizer state.
#[derive(Debug)]
struct Held {
    id: BlockId,
    params: Vec<f32>,
    state: OptimizerState,
}

/// A gradient buffered for the current sync step.
#[derive(Debug)]
struct Pending {
    seq: u64,
    weight: f32,
    /// In held-block order.
    grads: Vec<Grad>,
}

/// The blocks of one shard and the logic that updates them.
///
/// In [`Mode::Sync`] the store keeps a membership (trainers that must push for
/// a step before it is applied). A trainer becomes a member by [`join`](Self::join)
/// or by pushing, and stops by [`leave`](Self::leave) (the shell calls it when
/// the trainer's lease is gone). For each step the store buffers one push per
/// trainer; when every member has pushed, the gradients are combined as
/// `sum_k w_k g_k / sum_k w_k`, summed in trainer-id (byte string) order so the
/// result does not depend on arrival order, and applied once.
///
/// In [`Mode::Async`] every push is applied on arrival; membership is kept
/// only for information.
pub struct ParamStore {
    server: u32,
    mode: Mode,
    optimizer: Box<dyn Optimizer>,
    fingerprint: u64,
    /// In `BlockId` order.
    held: Vec<Held>,
    step: u64,
    members: BTreeSet<String>,
    /// Sync: pushes for the current step, by trainer id (sorted).
    buffer: BTreeMap<String, Pending>,
    /// Last accepted seq per trainer.
    last_seq: HashMap<String, u64>,
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamStore")
            .field("server", &self.server)
            .field("mode", &self.mode)
            .field("optimizer", &self.optimizer.name())
            .field("blocks", &self.held.len())
            .field("step", &self.step)
            .field("members", &self.members)
            .field("buffered", &self.buffer.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl ParamStore {
    /// The store for shard `server`: holds `placement.blocks_on(server)`,
    /// initialised with [`init_values`] for `seed`, fresh optimizer state, step 0.
    pub fn new(
        placement: &Placement,
        server: u32,
        seed: u64,
        optimizer: Box<dyn Optimizer>,
        mode: Mode,
    ) -> Result<Self> {
        if server >= placement.servers() {
            return Err(Error::ServerOutOfRange { server, servers: placement.servers() });
        }
        let specs = placement.specs();
        let held = placement
            .blocks_on(server)
            .map(|b| {
                let mut params = vec![0.0; b.len];
                // Placement only creates blocks of existing parameters.
                if let Some(spec) = specs.get(b.id.param as usize) {
                    init_values(spec, seed, b.offset, &mut params);
                }
                Held { id: b.id, params, state: optimizer.new_state(b.len) }
            })
            .collect();
        Ok(Self {
            server,
            mode,
            optimizer,
            fingerprint: placement.fingerprint(),
            held,
            step: 0,
            members: BTreeSet::new(),
            buffer: BTreeMap::new(),
            last_seq: HashMap::new(),
        })
    }

    /// Sync or async.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// This store's shard index.
    pub fn server(&self) -> u32 {
        self.server
    }

    /// Fingerprint of the placement the store was built from.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The optimizer in use.
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// Number of updates applied (sync: completed barriers; async: pushes applied).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Make `trainer` a member from the current step on: the current step's
    /// barrier now waits for it too. No-op if already a member.
    pub fn join(&mut self, trainer: &str) {
        if !self.members.contains(trainer) {
            self.members.insert(trainer.to_string());
        }
    }

    /// Drop `trainer`'s membership. A gradient it already pushed for the
    /// current step stays in the barrier. Sync: if the barrier is now
    /// complete (every remaining member pushed, or no member left and something
    /// is buffered), it is applied and the new step returned.
    pub fn leave(&mut self, trainer: &str) -> Option<u64> {
        self.members.remove(trainer);
        if self.mode == Mode::Sync && self.barrier_complete() {
            self.apply_barrier();
            Some(self.step)
        } else {
            None
        }
    }

    /// Current members, sorted.
    pub fn members(&self) -> Vec<String> {
        self.members.iter().cloned().collect()
    }

    /// Sync: members that have not pushed for the current step, sorted.
    pub fn waiting_for(&self) -> Vec<String> {
        self.members.iter().filter(|m| !self.buffer.contains_key(*m)).cloned().collect()
    }

    /// Take one push. Order of checks: duplicate (`seq <=` last accepted:
    /// [`PushOutcome::Duplicate`], even for a stale step, so a retried push
    /// whose answer was lost is still acknowledged); then the weight and the
    /// gradients (exactly this server's blocks, each once, right length, all
    /// finite); then, in sync mode, the step and a second push for the same
    /// step. Any error leaves the store unchanged.
    pub fn push(&mut self, push: Push) -> Result<PushOutcome> {
        let Push { trainer, seq, step, weight, grads } = push;
        if self.last_seq.get(&trainer).is_some_and(|&last| seq <= last) {
            return Ok(PushOutcome::Duplicate);
        }
        let grads = self.check_grads(&trainer, weight, grads)?;
        match self.mode {
            Mode::Async => {
                let mut scratch = Vec::new();
                for (h, g) in self.held.iter_mut().zip(&grads) {
                    self.optimizer.apply(&mut h.params, g.floats(&mut scratch), &mut h.state);
                }
                self.step += 1;
                self.join(&trainer);
                self.last_seq.insert(trainer, seq);
                Ok(PushOutcome::Applied { step: self.step })
            }
            Mode::Sync => {
                if step < self.step {
                    return Err(Error::StaleStep { trainer, got: step, current: self.step });
                }
                if step > self.step {
                    return Err(Error::FutureStep { trainer, got: step, current: self.step });
                }
                if let Some(p) = self.buffer.get(&trainer) {
                    return Err(Error::AlreadyBuffered { step, seq, buffered_seq: p.seq, trainer });
                }
                self.join(&trainer);
                self.last_seq.insert(trainer.clone(), seq);
                self.buffer.insert(trainer, Pending { seq, weight, grads });
                if self.barrier_complete() {
                    self.apply_barrier();
                    Ok(PushOutcome::Applied { step: self.step })
                } else {
                    Ok(PushOutcome::Buffered { step: self.step, waiting_for: self.waiting_for_count() })
                }
            }
        }
    }

    /// The parameters of a held block.
    pub fn block(&self, id: BlockId) -> Result<&[f32]> {
        self.index(id)
            .map(|i| self.held[i].params.as_slice())
            .ok_or(Error::BlockNotHeld { block: id, server: self.server })
    }

    /// The held blocks, in [`BlockId`] order.
    pub fn block_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.held.iter().map(|h| h.id)
    }

    /// Every held block with its parameters and optimizer state (for checkpoints).
    pub fn blocks(&self) -> impl Iterator<Item = (BlockId, &[f32], &OptimizerState)> + '_ {
        self.held.iter().map(|h| (h.id, h.params.as_slice(), &h.state))
    }

    /// Replace a held block's parameters and optimizer state (from a
    /// checkpoint). Checks the block is held, the lengths (`len` parameters,
    /// `state_slots() * len` slots) and that every value is finite.
    pub fn restore_block(&mut self, id: BlockId, params: Vec<f32>, state: OptimizerState) -> Result<()> {
        let server = self.server;
        let i = self.index(id).ok_or(Error::BlockNotHeld { block: id, server })?;
        let len = self.held[i].params.len();
        let slots = self.optimizer.state_slots().saturating_mul(len);
        for (what, values, expected) in
            [("parameters", &params, len), ("optimizer slots", &state.slots, slots)]
        {
            if values.len() != expected {
                return Err(Error::RestoreLength { block: id, what, expected, got: values.len() });
            }
            if let Some(index) = values.iter().position(|x| !x.is_finite()) {
                return Err(Error::RestoreNonFinite { block: id, what, index, value: values[index] });
            }
        }
        self.held[i].params = params;
        self.held[i].state = state;
        Ok(())
    }

    /// Set the step (from a checkpoint). Drops gradients buffered for the
    /// old step, since they were computed against other parameters.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
        self.buffer.clear();
    }

    /// The last accepted seq of every trainer seen (for checkpoints, so
    /// retries stay deduplicated across a restart).
    pub fn last_seqs(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.last_seq.iter().map(|(t, &s)| (t.as_str(), s))
    }

    /// Restore a trainer's last accepted seq (from a checkpoint). Keeps the
    /// larger of the current and given values.
    pub fn restore_last_seq(&mut self, trainer: &str, seq: u64) {
        let e = self.last_seq.entry(trainer.to_string()).or_insert(seq);
        *e = (*e).max(seq);
    }

    fn index(&self, id: BlockId) -> Option<usize> {
        self.held.binary_search_by_key(&id, |h| h.id).ok()
    }

    /// Validate a push's weight and gradients; on success return the
    /// gradients in held-block order.
    fn check_grads(&self, trainer: &str, weight: f32, mut grads: Vec<(BlockId, Grad)>) -> Result<Vec<Grad>> {
        if !(weight.is_finite() && weight > 0.0) {
            return Err(Error::BadWeight { trainer: trainer.to_string(), weight });
        }
        grads.sort_unstable_by_key(|(id, _)| *id);
        let mut prev: Option<BlockId> = None;
        for (id, g) in &grads {
            let Some(i) = self.index(*id) else {
                return Err(Error::PushBlockNotHeld {
                    trainer: trainer.to_string(),
                    block: *id,
                    server: self.server,
                });
            };
            if prev == Some(*id) {
                return Err(Error::DuplicateBlock { trainer: trainer.to_string(), block: *id });
            }
            prev = Some(*id);
            let expected = self.held[i].params.len();
            if g.len() != expected || !g.whole() {
                return Err(Error::GradLength {
                    trainer: trainer.to_string(),
                    block: *id,
                    expected,
                    got: g.len(),
                });
            }
            if let Some((index, value)) = g.first_non_finite() {
                return Err(Error::NonFiniteGrad { trainer: trainer.to_string(), block: *id, index, value });
            }
        }
        // Every pushed block is held and distinct, so equal counts mean the
        // sorted push lines up with `held`.
        if grads.len() != self.held.len() {
            let missing = self
                .held
                .iter()
                .map(|h| h.id)
                .find(|id| grads.binary_search_by_key(id, |(g, _)| *g).is_err());
            if let Some(block) = missing {
                return Err(Error::MissingBlock {
                    trainer: trainer.to_string(),
                    block,
                    server: self.server,
                    expected: self.held.len(),
                    got: grads.len(),
                });
            }
        }
        Ok(grads.into_iter().map(|(_, g)| g).collect())
    }

    fn waiting_for_count(&self) -> usize {
        self.members.iter().filter(|m| !self.buffer.contains_key(*m)).count()
    }

    /// Something is buffered and every member has pushed.
    fn barrier_complete(&self) -> bool {
        !self.buffer.is_empty() && self.members.iter().all(|m| self.buffer.contains_key(m))
    }

    /// Combine the buffered gradients (weighted mean, summed in trainer-id
    /// order), apply them once, clear the buffer and advance the step.
    fn apply_barrier(&mut self) {
        let pending: Vec<Pending> = std::mem::take(&mut self.buffer).into_values().collect();
        let Some((first, rest)) = pending.split_first() else {
            return;
        };
        let total = rest.iter().fold(first.weight, |t, p| t + p.weight);
        // Block by block, so the only memory beyond the buffered pushes is
        // one block's sum (wire gradients are read in place).
        let (mut acc, mut scratch) = (Vec::new(), Vec::new());
        for (b, h) in self.held.iter_mut().enumerate() {
            acc.clear();
            acc.extend_from_slice(first.grads[b].floats(&mut scratch));
            if first.weight != 1.0 {
                scale(&mut acc, first.weight);
            }
            for p in rest {
                axpy(&mut acc, p.weight, p.grads[b].floats(&mut scratch));
            }
            if total != 1.0 {
                div(&mut acc, total);
            }
            self.optimizer.apply(&mut h.params, &acc, &mut h.state);
        }
        self.step += 1;
    }
}

fn scale(a: &mut [f32], w: f32) {
    for x in a {
        *x *= w;
    }
}

fn div(a: &mut [f32], d: f32) {
    for x in a {
        *x /= d;
    }
}

/// `a += w * g`.
fn axpy(a: &mut [f32], w: f32, g: &[f32]) {
    for (x, &y) in a.iter_mut().zip(g) {
        *x += w * y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::{Adam, Sgd};
    use crate::spec::{Init, ParamBuf, ParamSpec};

    fn specs() -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("w", vec![3, 3], Init::Normal { mean: 0.0, std: 1.0 }),
            ParamSpec::new("b", vec![3], Init::Constant(0.5)),
        ]
    }

    /// A push carrying all of `store`'s blocks, values from `f(block, index)`.
    fn push_for(
        store: &ParamStore,
        trainer: &str,
        seq: u64,
        step: u64,
        weight: f32,
        f: impl Fn(BlockId, usize) -> f32,
    ) -> Push {
        let grads = store
            .blocks()
            .map(|(id, p, _)| (id, Grad::Floats((0..p.len()).map(|i| f(id, i)).collect())))
            .collect();
        Push { trainer: trainer.into(), seq, step, weight, grads }
    }

    fn snapshot(store: &ParamStore) -> Vec<Vec<f32>> {
        store.blocks().map(|(_, p, _)| p.to_vec()).collect()
    }

    #[test]
    fn stores_hold_their_blocks_initialised_like_param_buf() {
        let specs = specs();
        let pl = Placement::new(&specs, 3, 4).unwrap();
        let buf = ParamBuf::init(&specs, 11);
        let mut seen = 0;
        for s in 0..3 {
            let st = ParamStore::new(&pl, s, 11, Box::new(Sgd { lr: 0.1 }), Mode::Async).unwrap();
            assert_eq!(st.server(), s);
            assert_eq!(st.fingerprint(), pl.fingerprint());
            for b in pl.blocks_on(s) {
                let want = &buf.param(b.id.param as usize)[b.offset..b.offset + b.len];
                assert_eq!(st.block(b.id).unwrap(), want);
                seen += 1;
            }
            assert_eq!(st.block_ids().count(), pl.blocks_on(s).count());
        }
        assert_eq!(seen, pl.blocks().len());
        assert!(matches!(
            ParamStore::new(&pl, 3, 11, Box::new(Sgd { lr: 0.1 }), Mode::Async),
            Err(Error::ServerOutOfRange { server: 3, servers: 3 })
        ));
    }

    #[test]
    fn sync_three_trainers_equal_weighted_mean_gradient() {
        let specs = specs();
        let pl = Placement::new(&specs, 1, 5).unwrap();
        let opt = || Box::new(Sgd { lr: 0.3 });
        let mut store = ParamStore::new(&pl, 0, 1, opt(), Mode::Sync).unwrap();
        let mut reference = ParamStore::new(&pl, 0, 1, opt(), Mode::Async).unwrap();
        let weights = [("t-b", 32.0f32), ("t-a", 10.0), ("t-c", 7.0)];
        let grad = |k: usize, step: u64| {
            move |id: BlockId, i: usize| {
                ((k * 31 + i * 7 + id.block as usize * 3 + step as usize) % 11) as f32 * 0.1 - 0.5
            }
        };
        for (t, _) in &weights {
            store.join(t);
        }
        for step in 0..3u64 {
            for (k, (t, w)) in weights.iter().enumerate() {
                let out = store.push(push_for(&store, t, step, step, *w, grad(k, step))).unwrap();
                if k < 2 {
                    assert_eq!(out, PushOutcome::Buffered { step, waiting_for: 2 - k });
                } else {
                    assert_eq!(out, PushOutcome::Applied { step: step + 1 });
                }
            }
            // Reference: the weighted mean gradient, computed in f64, applied directly.
            let wsum: f64 = weights.iter().map(|(_, w)| f64::from(*w)).sum();
            let mean = push_for(&reference, "ref", step, step, 1.0, |id, i| {
                let s: f64 = weights
                    .iter()
                    .enumerate()
                    .map(|(k, (_, w))| f64::from(*w) * f64::from(grad(k, step)(id, i)))
                    .sum();
                (s / wsum) as f32
            });
            reference.push(mean).unwrap();
        }
        assert_eq!(store.step(), 3);
        // Norm-wise relative error (element-wise would blow up near zero).
        let (got, want) = (snapshot(&store).concat(), snapshot(&reference).concat());
        assert_eq!(got.len(), 12);
        let diff: f64 = got.iter().zip(&want).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let norm: f64 = want.iter().map(|y| f64::from(*y).powi(2)).sum();
        let rel = (diff / norm).sqrt();
        assert!(rel < 1e-6, "relative error {rel}: {got:?} vs {want:?}");
        assert_ne!(got, ParamBuf::init(&specs, 1).as_slice(), "parameters moved");
    }

    #[test]
    fn async_applies_each_push_and_dedups() {
        let pl = Placement::new(&specs(), 1, 100).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Async).unwrap();
        let before = snapshot(&st);
        let p = push_for(&st, "t", 5, 0, 1.0, |_, _| 1.0);
        assert_eq!(st.push(p.clone()).unwrap(), PushOutcome::Applied { step: 1 });
        assert_eq!(st.push(p.clone()).unwrap(), PushOutcome::Duplicate);
        let mut older = p.clone();
        older.seq = 2;
        assert_eq!(st.push(older).unwrap(), PushOutcome::Duplicate);
        assert_eq!(st.step(), 1);
        let after = snapshot(&st);
        for (a, b) in before.iter().flatten().zip(after.iter().flatten()) {
            assert_eq!(*a - 1.0, *b);
        }
        // Async ignores the step field and the weight's value.
        let mut next = push_for(&st, "t", 6, 99, 5.0, |_, _| 1.0);
        next.grads.reverse();
        assert_eq!(st.push(next).unwrap(), PushOutcome::Applied { step: 2 });
        assert_eq!(st.members(), vec!["t".to_string()]);
        assert_eq!(st.leave("t"), None);
        assert_eq!(st.last_seqs().collect::<Vec<_>>(), vec![("t", 6)]);
    }

    #[test]
    fn every_bad_push_is_rejected_and_harmless() {
        let pl = Placement::new(&specs(), 2, 4).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        st.join("a");
        let good = push_for(&st, "t", 1, 0, 1.0, |_, _| 1.0);
        let held: Vec<BlockId> = st.block_ids().collect();
        let foreign = pl.blocks_on(1).next().unwrap().id;
        let before = snapshot(&st);
        let mut cases: Vec<(Push, &str)> = Vec::new();
        fn floats(g: &mut Grad) -> &mut Vec<f32> {
            match g {
                Grad::Floats(v) => v,
                Grad::Wire(_) => panic!("push_for makes floats"),
            }
        }
        let wire = |g: &Grad| match g {
            Grad::Floats(v) => oar_transport::f32s_to_bytes(v),
            Grad::Wire(b) => b.clone(),
        };
        let mut p = good.clone();
        p.grads.push((foreign, vec![0.0; 4].into()));
        cases.push((p, "not held by server 0"));
        let mut p = good.clone();
        floats(&mut p.grads[0].1).pop();
        cases.push((p, "expected"));
        let mut p = good.clone();
        floats(&mut p.grads[1].1)[2] = f32::NAN;
        cases.push((p, "index 2"));
        let mut p = good.clone();
        floats(&mut p.grads[0].1)[0] = f32::INFINITY;
        cases.push((p, "inf"));
        // The same checks on wire bytes: a partial value, and a NaN.
        let mut p = good.clone();
        let mut bytes = wire(&p.grads[0].1).to_vec();
        bytes.push(0);
        p.grads[0].1 = Grad::Wire(bytes.into());
        cases.push((p, "expected"));
        let mut p = good.clone();
        let mut nan = floats(&mut p.grads[1].1).clone();
        nan[1] = f32::NAN;
        p.grads[1].1 = Grad::Wire(oar_transport::f32s_to_bytes(&nan));
        cases.push((p, "index 1"));
        for w in [0.0, -1.0, f32::NAN] {
            let mut p = good.clone();
            p.weight = w;
            cases.push((p, "weight"));
        }
        let mut p = good.clone();
        p.grads.pop();
        cases.push((p, "missing"));
        let mut p = good.clone();
        let dup = p.grads[0].clone();
        p.grads.push(dup);
        cases.push((p, "more than once"));
        let mut p = good.clone();
        p.step = 1;
        cases.push((p, "only at step 0"));
        for (p, needle) in cases {
            let err = st.push(p).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains("\"t\""), "{needle}: {err}");
            assert_eq!(snapshot(&st), before);
            assert_eq!(st.members(), vec!["a".to_string()]);
            assert_eq!(st.step(), 0);
        }
        // None of the rejected pushes consumed the seq: the good one goes through.
        assert_eq!(st.push(good).unwrap(), PushOutcome::Buffered { step: 0, waiting_for: 1 });
        assert!(held.len() >= 2);
        // A second push for the same step is refused.
        let again = push_for(&st, "t", 2, 0, 1.0, |_, _| 1.0);
        assert!(matches!(st.push(again), Err(Error::AlreadyBuffered { buffered_seq: 1, seq: 2, .. })));
        assert_eq!(
            st.push(push_for(&st, "a", 1, 0, 1.0, |_, _| 1.0)).unwrap(),
            PushOutcome::Applied { step: 1 }
        );
        // A late push for step 0 is stale; a retry of an accepted one is a duplicate.
        let stale = push_for(&st, "t", 3, 0, 1.0, |_, _| 1.0);
        assert!(matches!(st.push(stale), Err(Error::StaleStep { got: 0, current: 1, .. })));
        let retry = push_for(&st, "t", 1, 0, 1.0, |_, _| 1.0);
        assert_eq!(st.push(retry).unwrap(), PushOutcome::Duplicate);
    }

    #[test]
    fn leave_completes_barrier_and_keeps_buffered_gradient() {
        let pl = Placement::new(&specs(), 1, 100).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        for t in ["a", "b", "c"] {
            st.join(t);
        }
        st.join("a");
        assert_eq!(st.members().len(), 3);
        let before = snapshot(&st);
        assert!(matches!(
            st.push(push_for(&st, "a", 0, 0, 1.0, |_, _| 2.0)).unwrap(),
            PushOutcome::Buffered { waiting_for: 2, .. }
        ));
        assert!(matches!(
            st.push(push_for(&st, "b", 0, 0, 3.0, |_, _| 6.0)).unwrap(),
            PushOutcome::Buffered { waiting_for: 1, .. }
        ));
        assert_eq!(st.waiting_for(), vec!["c".to_string()]);
        // "b" leaves: its gradient stays; the barrier still waits for "c".
        assert_eq!(st.leave("b"), None);
        assert_eq!(st.step(), 0);
        // The last missing member leaving completes it: (1*2 + 3*6) / 4 = 5.
        assert_eq!(st.leave("c"), Some(1));
        for (a, b) in before.iter().flatten().zip(snapshot(&st).iter().flatten()) {
            assert_eq!(*a - 5.0, *b);
        }
        // The last member leaving with a buffered push applies it.
        st.push(push_for(&st, "a", 1, 1, 1.0, |_, _| 1.0)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(st.step(), 2);
        st.join("z");
        st.push(push_for(&st, "a", 2, 2, 1.0, |_, _| 1.0)).unwrap();
        assert_eq!(st.leave("a"), None);
        assert_eq!(st.leave("z"), Some(3));
        assert!(st.members().is_empty());
        assert_eq!(st.leave("nobody"), None);
    }

    #[test]
    fn restore_and_set_step() {
        let pl = Placement::new(&specs(), 1, 5).unwrap();
        let opt = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(opt), Mode::Sync).unwrap();
        assert_eq!(st.optimizer().name(), "adam");
        let id = BlockId::new(0, 0);
        let state = OptimizerState { step: 7, slots: vec![0.5; 10] };
        st.restore_block(id, vec![1.0; 5], state.clone()).unwrap();
        assert_eq!(st.block(id).unwrap(), &[1.0; 5]);
        assert_eq!(st.blocks().find(|b| b.0 == id).unwrap().2, &state);
        assert!(matches!(
            st.restore_block(id, vec![1.0; 4], state.clone()),
            Err(Error::RestoreLength { what: "parameters", expected: 5, got: 4, .. })
        ));
        let short = OptimizerState { step: 0, slots: vec![0.0; 5] };
        assert!(matches!(
            st.restore_block(id, vec![1.0; 5], short),
            Err(Error::RestoreLength { what: "optimizer slots", expected: 10, got: 5, .. })
        ));
        assert!(matches!(
            st.restore_block(id, vec![1.0, 1.0, f32::NAN, 1.0, 1.0], state.clone()),
            Err(Error::RestoreNonFinite { index: 2, .. })
        ));
        assert!(matches!(
            st.restore_block(BlockId::new(5, 0), vec![], state.clone()),
            Err(Error::BlockNotHeld { .. })
        ));
        assert!(st.block(BlockId::new(0, 9)).is_err());
        st.push(push_for(&st, "a", 0, 0, 1.0, |_, _| 1.0)).unwrap();
        st.join("b");
        st.push(push_for(&st, "a", 1, 1, 1.0, |_, _| 1.0)).unwrap();
        st.set_step(10);
        assert_eq!(st.step(), 10);
        assert_eq!(st.waiting_for().len(), 2, "buffer cleared by set_step");
        st.restore_last_seq("a", 0);
        assert!(st.last_seqs().any(|(t, s)| t == "a" && s == 1));
        st.restore_last_seq("q", 4);
        let p = push_for(&st, "q", 4, 10, 1.0, |_, _| 1.0);
        assert_eq!(st.push(p).unwrap(), PushOutcome::Duplicate);
    }
}
