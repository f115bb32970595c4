//! Property tests of sparse tables over random operation sequences
//! (pushes, pulls, time passing, sweeps, snapshots, restores), against a
//! naive reference model written independently here: a `HashMap` of rows
//! that sorts every row to evict.

use std::collections::HashMap;

use oar_pserver::sparse::MAX_STATE_SLOTS;
use oar_pserver::{
    init_row, Adam, Candidate, Eviction, Init, Optimizer, OptimizerState, RowPolicy, Sgd, SparseTable,
    TableSnapshot, TableSpec, TableStats,
};
use proptest::prelude::*;

/// Ids 0..IDS: small, so rows repeat, get evicted and come back.
const IDS: u64 = 12;
/// Ids of the tables big enough to evict in batches (caps of 32 and more).
const BIG_IDS: u64 = 120;
/// Ids of the tables that churn: many times their cap, so rows are evicted
/// again and again (up to 10 at once), and the index's runs are shifted
/// back by removal after removal.
const CHURN_IDS: u64 = 2000;
const SEED: u64 = 11;
const MAX_DIM: usize = 4;

fn adam() -> Adam {
    Adam { lr: 0.05, beta1: 0.9, beta2: 0.99, eps: 1e-8 }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// A push at the current step: (id, gradient) pairs, ids made unique.
    Apply(Vec<(u64, [f32; MAX_DIM])>),
    /// A pull of these ids (may repeat): checked against the model.
    Gather(Vec<u64>),
    /// The store's step moves on.
    Advance(u64),
    Sweep,
    /// Take a snapshot and keep it: it must read the same ever after.
    Snapshot,
    /// Snapshot, restore into a fresh table, and go on with that one.
    Restore,
}

/// An operation on ids `0..ids`, pushing up to `per_push` of them at once.
fn op(ids: u64, per_push: usize) -> impl Strategy<Value = Op> {
    let grad = prop::array::uniform4(prop_oneof![4 => -4.0f32..4.0, 1 => Just(0.0f32)]);
    prop_oneof![
        8 => prop::collection::vec((0..ids, grad), 0..per_push).prop_map(Op::Apply),
        2 => prop::collection::vec(0..ids + 3, 0..6).prop_map(Op::Gather),
        3 => (1u64..4).prop_map(Op::Advance),
        1 => Just(Op::Sweep),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Restore),
    ]
}

fn policy(max_rows: std::ops::Range<usize>) -> impl Strategy<Value = RowPolicy> {
    (0u32..4, prop::option::of(1u64..7), prop::option::of(max_rows), any::<bool>()).prop_map(
        |(admit_after, expire_after, max_rows, lfu)| RowPolicy {
            admit_after,
            expire_after,
            max_rows,
            evict: if lfu { Eviction::Lfu } else { Eviction::Lru },
        },
    )
}

#[derive(Clone, Debug)]
struct ModelRow {
    params: Vec<f32>,
    state: OptimizerState,
    count: u32,
    last_seen: u64,
}

/// The semantics of the module docs, naively: expired things are simply
/// absent, and a full table sorts all its rows by the eviction key.
struct Model {
    spec: TableSpec,
    slots: usize,
    rows: HashMap<u64, ModelRow>,
    /// id -> (count, last_seen).
    candidates: HashMap<u64, (u32, u64)>,
    admitted: u64,
    evicted: u64,
}

impl Model {
    fn expired(&self, last_seen: u64, now: u64) -> bool {
        self.spec.policy.expire_after.is_some_and(|t| now >= last_seen + t)
    }

    fn cap(&self) -> usize {
        self.spec.policy.max_rows.unwrap_or(usize::MAX)
    }

    /// How many to drop from `len` entries so that one more fits.
    fn excess(&self, len: usize) -> usize {
        let cap = self.cap();
        if len < cap {
            0
        } else {
            len - (cap - (cap / 32).max(1))
        }
    }

    fn key(&self, id: u64, count: u32, last_seen: u64) -> (u64, u64, u64) {
        match self.spec.policy.evict {
            Eviction::Lru => (0, last_seen, id),
            Eviction::Lfu => (u64::from(count), last_seen, id),
        }
    }

    fn live_row(&self, id: u64, now: u64) -> Option<&ModelRow> {
        self.rows.get(&id).filter(|r| !self.expired(r.last_seen, now))
    }

    fn gather(&self, id: u64, now: u64) -> Vec<f32> {
        match self.live_row(id, now) {
            Some(r) => r.params.clone(),
            None => {
                let mut v = vec![0.0; self.spec.dim];
                init_row(&self.spec, SEED, id, &mut v);
                v
            }
        }
    }

    fn apply(&mut self, id: u64, grad: &[f32], now: u64, opt: &dyn Optimizer) {
        // Whatever expired is absent.
        let rows: Vec<u64> =
            self.rows.iter().filter(|(_, r)| self.expired(r.last_seen, now)).map(|(&id, _)| id).collect();
        for id in rows {
            self.rows.remove(&id);
        }
        let cands: Vec<u64> =
            self.candidates.iter().filter(|(_, c)| self.expired(c.1, now)).map(|(&id, _)| id).collect();
        for id in cands {
            self.candidates.remove(&id);
        }
        if let Some(r) = self.rows.get_mut(&id) {
            r.count += 1;
            r.last_seen = now;
            opt.apply(&mut r.params, grad, &mut r.state);
            return;
        }
        let count = self.candidates.get(&id).map_or(0, |c| c.0) + 1;
        if count < self.spec.policy.admit_after {
            if !self.candidates.contains_key(&id) {
                let excess = self.excess(self.candidates.len());
                let mut keys: Vec<_> =
                    self.candidates.iter().map(|(&id, &(n, s))| self.key(id, n, s)).collect();
                keys.sort();
                for (_, _, id) in keys.into_iter().take(excess) {
                    self.candidates.remove(&id);
                }
            }
            self.candidates.insert(id, (count, now));
            return;
        }
        self.candidates.remove(&id);
        let excess = self.excess(self.rows.len());
        let mut keys: Vec<_> = self.rows.iter().map(|(&id, r)| self.key(id, r.count, r.last_seen)).collect();
        keys.sort();
        for (_, _, id) in keys.into_iter().take(excess) {
            self.rows.remove(&id);
            self.evicted += 1;
        }
        self.admitted += 1;
        let mut params = vec![0.0; self.spec.dim];
        init_row(&self.spec, SEED, id, &mut params);
        let mut state = OptimizerState { step: 0, slots: vec![0.0; self.slots * self.spec.dim] };
        opt.apply(&mut params, grad, &mut state);
        self.rows.insert(id, ModelRow { params, state, count, last_seen: now });
    }
}

/// Everything a snapshot shows, as bits.
type Content = (TableStats, Vec<(u64, Vec<u32>, u64, Vec<u32>, u32, u64)>, Vec<Candidate>);

fn content(snap: &TableSnapshot) -> Content {
    let rows =
        snap.records().map(|r| (r.id, bits(r.params), r.step, bits(r.slots), r.count, r.last_seen)).collect();
    (snap.stats(), rows, snap.candidates().collect())
}

/// The table agrees with the model at `now`: every id's pull, and every
/// live row's values, optimizer state, count and last push.
fn agree(t: &SparseTable, m: &Model, ids: u64, now: u64) -> std::result::Result<(), TestCaseError> {
    let dim = m.spec.dim;
    let ids: Vec<u64> = (0..ids + 3).collect();
    let mut out = vec![f32::NAN; ids.len() * dim];
    t.gather(&ids, now, &mut out);
    for (&id, got) in ids.iter().zip(out.chunks(dim)) {
        prop_assert_eq!(bits(got), bits(&m.gather(id, now)), "pull of row {} at {}", id, now);
        match (t.row(id, now), m.live_row(id, now)) {
            (None, None) => {}
            (Some(r), Some(w)) => {
                prop_assert_eq!(bits(r.params), bits(&w.params), "row {} params", id);
                prop_assert_eq!(bits(r.slots), bits(&w.state.slots), "row {} slots", id);
                prop_assert_eq!(
                    (r.step, r.count, r.last_seen),
                    (w.state.step, w.count, w.last_seen),
                    "row {}",
                    id
                );
            }
            (r, w) => prop_assert!(false, "row {} at {}: table {:?}, model {:?}", id, now, r, w),
        }
    }
    let stats = t.stats();
    prop_assert_eq!((stats.admitted, stats.evicted), (m.admitted, m.evicted));
    prop_assert!(t.len() <= m.cap() && stats.candidates <= m.cap());
    Ok(())
}

fn run(spec: TableSpec, use_adam: bool, ids: u64, ops: Vec<Op>) -> std::result::Result<(), TestCaseError> {
    let opt: Box<dyn Optimizer> = if use_adam { Box::new(adam()) } else { Box::new(Sgd { lr: 0.5 }) };
    let slots = opt.state_slots();
    let dim = spec.dim;
    let mut t = SparseTable::new(spec.clone(), SEED, slots).expect("valid spec");
    let mut m = Model {
        spec: spec.clone(),
        slots,
        rows: HashMap::new(),
        candidates: HashMap::new(),
        admitted: 0,
        evicted: 0,
    };
    let mut kept: Vec<(TableSnapshot, Content)> = Vec::new();
    let mut now = 0u64;
    for op in ops {
        match op {
            Op::Apply(pairs) => {
                let mut ids = Vec::new();
                let mut grads = Vec::new();
                for (id, g) in pairs {
                    if !ids.contains(&id) {
                        ids.push(id);
                        grads.extend_from_slice(&g[..dim]);
                    }
                }
                prop_assert!(t.check(&ids, &grads).is_ok());
                t.apply(&ids, &grads, now, opt.as_ref());
                for (&id, g) in ids.iter().zip(grads.chunks(dim)) {
                    m.apply(id, g, now, opt.as_ref());
                }
            }
            Op::Gather(ids) => {
                let mut out = vec![0.0; ids.len() * dim];
                let before = content(&t.snapshot());
                t.gather(&ids, now, &mut out);
                for (&id, got) in ids.iter().zip(out.chunks(dim)) {
                    prop_assert_eq!(bits(got), bits(&m.gather(id, now)), "row {}", id);
                }
                prop_assert_eq!(content(&t.snapshot()), before, "a pull changed the table");
            }
            Op::Advance(d) => now += d,
            Op::Sweep => {
                t.sweep(now);
                let live_rows = m.rows.values().filter(|r| !m.expired(r.last_seen, now)).count();
                let live_cands = m.candidates.values().filter(|c| !m.expired(c.1, now)).count();
                prop_assert_eq!((t.len(), t.stats().candidates), (live_rows, live_cands));
            }
            Op::Snapshot => {
                let snap = t.snapshot();
                let c = content(&snap);
                kept.push((snap, c));
            }
            Op::Restore => {
                let snap = t.snapshot();
                let mut back = SparseTable::new(spec.clone(), SEED, slots).expect("valid spec");
                back.restore(&snap).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(content(&back.snapshot()), content(&snap));
                // Checkpoint-style: row by row, then candidates and counters.
                let mut rows = SparseTable::new(spec.clone(), SEED, slots).expect("valid spec");
                for r in snap.records() {
                    rows.restore_row(r).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                for c in snap.candidates() {
                    rows.restore_candidate(c).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                rows.restore_counters(&snap.stats());
                prop_assert_eq!(content(&rows.snapshot()), content(&snap));
                t = back;
            }
        }
        agree(&t, &m, ids, now)?;
        for (snap, c) in &kept {
            prop_assert_eq!(&content(snap), c, "a kept snapshot changed");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn table_matches_the_model(
        policy in policy(1..9),
        dim in 1usize..=MAX_DIM,
        use_adam in any::<bool>(),
        normal in any::<bool>(),
        ops in prop::collection::vec(op(IDS, 6), 1..80),
    ) {
        let init = if normal { Init::Normal { mean: 0.0, std: 1.0 } } else { Init::Uniform { low: -1.0, high: 1.0 } };
        run(TableSpec { policy, ..TableSpec::new("emb", dim, init) }, use_adam, IDS, ops)?;
    }

    /// Caps of 32 and more evict `max_rows / 32` rows at once.
    #[test]
    fn big_tables_match_the_model(
        policy in policy(32..80),
        use_adam in any::<bool>(),
        ops in prop::collection::vec(op(BIG_IDS, 30), 1..60),
    ) {
        let spec = TableSpec { policy, ..TableSpec::new("big", 2, Init::Normal { mean: 0.0, std: 1.0 }) };
        run(spec, use_adam, BIG_IDS, ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Long runs of pushes of ids mostly new to a capped table: eviction
    /// after eviction, slots reused, the index rebuilt in place.
    #[test]
    fn churning_tables_match_the_model(
        policy in policy(64..330),
        use_adam in any::<bool>(),
        ops in prop::collection::vec(op(CHURN_IDS, 60), 20..120),
    ) {
        let spec = TableSpec { policy, ..TableSpec::new("churn", 3, Init::Uniform { low: -1.0, high: 1.0 }) };
        run(spec, use_adam, CHURN_IDS, ops)?;
    }
}

/// TorchRec's bug: an evicted row came back with its old optimizer state.
/// Here it comes back as new: its initial value, then one Adam step from
/// zero moments (step 1).
#[test]
fn an_evicted_row_comes_back_with_fresh_state() {
    let opt = adam();
    let spec = TableSpec {
        policy: RowPolicy { max_rows: Some(2), ..RowPolicy::default() },
        ..TableSpec::new("emb", 3, Init::Normal { mean: 0.0, std: 0.1 })
    };
    let mut t = SparseTable::new(spec.clone(), SEED, opt.state_slots()).unwrap();
    let g = [1.0, -2.0, 0.5];
    for now in 0..3 {
        t.apply(&[7], &g, now, &opt);
    }
    let old = t.row(7, 3).unwrap();
    assert_eq!(old.step, 3);
    assert!(old.slots.iter().all(|&s| s != 0.0));
    let (old_params, old_slots) = (old.params.to_vec(), old.slots.to_vec());
    // Two newer rows fill the table of two: 7, the least recent, goes.
    t.apply(&[8], &g, 3, &opt);
    t.apply(&[9], &g, 4, &opt);
    assert!(t.row(7, 4).is_none());
    assert_eq!(t.stats().evicted, 1);

    t.apply(&[7], &g, 5, &opt);
    let back = t.row(7, 5).unwrap();
    let mut want = vec![0.0; 3];
    init_row(&spec, SEED, 7, &mut want);
    let mut fresh = opt.new_state(3);
    opt.apply(&mut want, &g, &mut fresh);
    assert_eq!(back.step, 1);
    assert_eq!(back.count, 1);
    assert_eq!(bits(back.params), bits(&want));
    assert_eq!(bits(back.slots), bits(&fresh.slots));
    // What the stale state would have given is something else.
    let mut stale_params = old_params;
    let mut stale = OptimizerState { step: 3, slots: old_slots };
    opt.apply(&mut stale_params, &g, &mut stale);
    assert_ne!(bits(back.params), bits(&stale_params));
    assert_ne!(bits(back.slots), bits(&stale.slots));
}

/// An expired row, too, starts again from its initial value and fresh state.
#[test]
fn an_expired_row_comes_back_with_fresh_state() {
    let opt = adam();
    let spec = TableSpec {
        policy: RowPolicy { expire_after: Some(2), ..RowPolicy::default() },
        ..TableSpec::new("emb", 2, Init::Uniform { low: -0.5, high: 0.5 })
    };
    let mut t = SparseTable::new(spec.clone(), SEED, opt.state_slots()).unwrap();
    t.apply(&[3], &[1.0, 1.0], 0, &opt);
    t.apply(&[3], &[1.0, 1.0], 1, &opt);
    assert_eq!(t.row(3, 2).map(|r| r.step), Some(2));
    assert!(t.row(3, 3).is_none());
    t.apply(&[3], &[1.0, 1.0], 3, &opt);
    let r = t.row(3, 3).unwrap();
    let mut want = vec![0.0; 2];
    init_row(&spec, SEED, 3, &mut want);
    let mut fresh = opt.new_state(2);
    opt.apply(&mut want, &[1.0, 1.0], &mut fresh);
    assert_eq!((r.step, r.count, r.last_seen), (1, 1, 3));
    assert_eq!(bits(r.params), bits(&want));
    assert_eq!(t.stats().expired, 1);
}

/// A snapshot is copy-on-write: taken before more pushes, it still reads
/// the values it was taken with, and the table the new ones.
#[test]
fn a_snapshot_keeps_the_old_values() {
    let opt = Sgd { lr: 1.0 };
    let mut t = SparseTable::new(TableSpec::new("emb", 2, Init::Zeros), SEED, 0).unwrap();
    t.apply(&[1, 2], &[1.0, 1.0, 2.0, 2.0], 0, &opt);
    let snap = t.snapshot();
    t.apply(&[1, 3], &[1.0, 1.0, 3.0, 3.0], 1, &opt);
    let rows: Vec<(u64, Vec<f32>, u32)> =
        snap.records().map(|r| (r.id, r.params.to_vec(), r.count)).collect();
    assert_eq!(rows, vec![(1, vec![-1.0, -1.0], 1), (2, vec![-2.0, -2.0], 1)]);
    assert_eq!(snap.rows(), 2);
    assert_eq!(t.row(1, 1).map(|r| (r.params.to_vec(), r.count)), Some((vec![-2.0, -2.0], 2)));
    assert_eq!(t.len(), 3);
    // The snapshot restores the table as it was.
    let mut back = SparseTable::new(TableSpec::new("emb", 2, Init::Zeros), SEED, 0).unwrap();
    back.restore(&snap).unwrap();
    assert_eq!(back.row(1, 1).map(|r| r.params.to_vec()), Some(vec![-1.0, -1.0]));
    assert!(back.row(3, 1).is_none());
}

#[test]
fn state_slots_are_bounded() {
    assert!(SparseTable::new(TableSpec::new("emb", 2, Init::Zeros), 0, MAX_STATE_SLOTS + 1).is_err());
}
