//! Sparse tables in a shard's store: row pushes in async and sync mode
//! (exactly once, the weighted mean of the step's trainers), followers
//! applying the primary's steps, checkpoints carrying rows bit for bit, and
//! bad row input refused by name with the store unchanged.

use oar_pserver::checkpoint::CheckpointDir;
use oar_pserver::replica::{snapshot_parts, CatchUp, History, RowChunk};
use oar_pserver::sparse::{init_row, row_shard, RowPolicy, TableSpec, MAX_ROWS_PER_CALL};
use oar_pserver::{
    AdaGrad, Adam, Error, Grad, Init, Mode, Optimizer, ParamSpec, ParamStore, Placement, Push, PushOutcome,
    RowGrads, Sgd, StoreSnapshot,
};

const SHARDS: u32 = 2;
const SEED: u64 = 9;
const DIM: usize = 3;

fn placement(policy: RowPolicy) -> Placement {
    let specs = vec![ParamSpec::new("bias", vec![1], Init::Zeros)];
    let mut emb = TableSpec::new("emb", DIM, Init::Uniform { low: -0.1, high: 0.1 });
    emb.policy = policy;
    Placement::new(&specs, SHARDS, 16).unwrap().with_tables(vec![emb]).unwrap()
}

/// The first `n` ids whose rows live on `shard`.
fn ids_on(shard: u32, n: usize) -> Vec<u64> {
    (0..).filter(|&id| row_shard("emb", id, SHARDS) == shard).take(n).collect()
}

/// A push to `store` of row gradients `grads` (one row of DIM per id),
/// with the store's blocks' gradients if it holds any.
fn push(store: &ParamStore, trainer: &str, seq: u64, weight: f32, ids: &[u64], grads: Vec<f32>) -> Push {
    let blocks = store.blocks().map(|(id, p, _)| (id, Grad::Floats(vec![0.0; p.len()]))).collect();
    let rows = vec![RowGrads { table: 0, ids: ids.to_vec(), grads: Grad::Floats(grads) }];
    Push { trainer: trainer.into(), seq, step: store.step(), weight, grads: blocks, rows, origin: None }
}

fn pull(store: &ParamStore, ids: &[u64]) -> Vec<f32> {
    let mut out = Vec::new();
    store.pull_rows(0, ids, &mut out).unwrap();
    out
}

fn initial(ids: &[u64]) -> Vec<f32> {
    let spec = TableSpec::new("emb", DIM, Init::Uniform { low: -0.1, high: 0.1 });
    let mut out = vec![0.0; ids.len() * DIM];
    for (id, row) in ids.iter().zip(out.chunks_exact_mut(DIM)) {
        init_row(&spec, SEED, *id, row);
    }
    out
}

fn sgd() -> Box<dyn Optimizer> {
    Box::new(Sgd { lr: 0.5 })
}

/// A row as bits: id, values, optimizer step, slots, count, last seen.
type RowBits = (u64, Vec<u32>, u64, Vec<u32>, u32, u64);

/// Every row of every table, floats as bits: what must survive exactly.
fn rows_of(store: &ParamStore) -> Vec<RowBits> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let snapshot = store.snapshot().unwrap();
    snapshot.tables()[0]
        .records()
        .map(|r| (r.id, bits(r.params), r.step, bits(r.slots), r.count, r.last_seen))
        .collect()
}

#[test]
fn async_row_pushes_apply_once_and_pulls_see_them() {
    let pl = placement(RowPolicy::default());
    let mut store = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Async).unwrap();
    let ids = ids_on(0, 4);
    assert_eq!(pull(&store, &ids), initial(&ids), "untouched rows read as their initial values");
    let grads: Vec<f32> = (0..ids.len() * DIM).map(|i| i as f32).collect();
    let p = push(&store, "t", 1, 1.0, &ids[..2], grads[..2 * DIM].to_vec());
    assert_eq!(store.push(p.clone()).unwrap(), PushOutcome::Applied { step: 1 });
    assert_eq!(store.push(p).unwrap(), PushOutcome::Duplicate);
    let mut want = initial(&ids);
    for (w, g) in want.iter_mut().zip(&grads[..2 * DIM]) {
        *w -= 0.5 * g;
    }
    assert_eq!(pull(&store, &ids), want, "rows 0 and 1 updated once, rows 2 and 3 untouched");
    assert_eq!(store.tables()[0].len(), 2);
}

#[test]
fn sync_rows_combine_the_weighted_mean_of_the_steps_trainers() {
    let pl = placement(RowPolicy::default());
    // Shard 1 holds no block here (one 1-element parameter): its pushes carry rows alone.
    let shard = (0..SHARDS).find(|&s| pl.blocks_on(s).next().is_none()).unwrap();
    let mut store = ParamStore::new(&pl, shard, SEED, sgd(), Mode::Sync).unwrap();
    let ids = ids_on(shard, 3);
    store.join("a");
    store.join("b");
    // a touches rows 0 and 1, b rows 1 and 2, with weights 1 and 3.
    let ga = vec![1.0; 2 * DIM];
    let gb = vec![2.0; 2 * DIM];
    let p = push(&store, "a", 1, 1.0, &ids[..2], ga);
    let first = store.push(p).unwrap();
    assert!(matches!(first, PushOutcome::Buffered { waiting_for: 1, .. }), "{first:?}");
    assert_eq!(pull(&store, &ids), initial(&ids), "nothing applied before the step completes");
    let p = push(&store, "b", 1, 3.0, &ids[1..], gb);
    let second = store.push(p).unwrap();
    assert_eq!(second, PushOutcome::Applied { step: 1 });
    // Mean over 4 examples: row 0: 1*1/4; row 1: (1*1 + 3*2)/4; row 2: 3*2/4.
    let mean = [0.25, 1.75, 1.5];
    let mut want = initial(&ids);
    for (r, m) in mean.iter().enumerate() {
        for v in &mut want[r * DIM..(r + 1) * DIM] {
            *v -= 0.5 * m;
        }
    }
    assert_eq!(pull(&store, &ids), want);
    assert_eq!(store.pushes(), 2);
}

#[test]
fn followers_applying_the_primarys_steps_hold_the_same_rows() {
    let pl = placement(RowPolicy { admit_after: 2, ..RowPolicy::default() });
    let adam = || -> Box<dyn Optimizer> { Box::new(Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8 }) };
    let mut primary = ParamStore::new(&pl, 0, SEED, adam(), Mode::Sync).unwrap();
    let mut follower = ParamStore::new(&pl, 0, SEED, adam(), Mode::Sync).unwrap();
    primary.record_steps();
    let ids = ids_on(0, 5);
    for step in 0..6u64 {
        let n = 2 + (step as usize % 3);
        let grads: Vec<f32> = (0..n * DIM).map(|i| (i as f32 + step as f32) * 0.1 - 0.3).collect();
        let p = push(&primary, "t", step + 1, 2.0, &ids[..n], grads);
        let taken = primary.push(p).unwrap();
        assert_eq!(taken, PushOutcome::Applied { step: step + 1 });
        for completed in primary.take_completed_steps() {
            assert!(!completed.rows.is_empty(), "a step's rows are forwarded");
            follower.apply_step(completed).unwrap();
        }
    }
    assert_eq!(rows_of(&follower), rows_of(&primary));
    assert_eq!(pull(&follower, &ids), pull(&primary, &ids));
    assert!(!rows_of(&primary).is_empty(), "rows seen twice were admitted");
}

/// Each push within the per-call limit, the step they make together past
/// it: the followers take the step the primary applied (they refused it,
/// and caught up from a snapshot after every such step).
#[test]
fn a_sync_step_past_the_per_call_limit_reaches_the_followers() {
    let pl = placement(RowPolicy::default());
    let mut primary = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Sync).unwrap();
    let mut follower = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Sync).unwrap();
    primary.record_steps();
    for store in [&mut primary, &mut follower] {
        store.join("a");
        store.join("b");
    }
    let n = MAX_ROWS_PER_CALL / 2 + 1000;
    let ids = ids_on(0, 2 * n);
    let (a, b) = ids.split_at(n);
    let p = push(&primary, "a", 1, 1.0, a, vec![1.0; n * DIM]);
    assert!(matches!(primary.push(p).unwrap(), PushOutcome::Buffered { .. }));
    let p = push(&primary, "b", 1, 1.0, b, vec![-1.0; n * DIM]);
    assert_eq!(primary.push(p).unwrap(), PushOutcome::Applied { step: 1 });
    let steps = primary.take_completed_steps();
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].rows[0].ids.len(), 2 * n, "one step of more rows than one call may carry");
    for step in steps {
        follower.apply_step(step).unwrap();
    }
    assert_eq!(follower.step(), 1);
    assert_eq!(rows_of(&follower), rows_of(&primary));
    // A push is still held to the limit.
    let many: Vec<u64> = ids_on(0, MAX_ROWS_PER_CALL + 1);
    let p = push(&primary, "a", 2, 1.0, &many, vec![0.0; many.len() * DIM]);
    let e = primary.push(p).unwrap_err();
    assert!(matches!(e, Error::TooManyRows { .. }), "{e}");
}

#[test]
fn checkpoints_carry_rows_and_their_statistics_bit_for_bit() {
    let pl = placement(RowPolicy { admit_after: 2, expire_after: Some(50), ..RowPolicy::default() });
    let adam = || -> Box<dyn Optimizer> { Box::new(Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8 }) };
    let mut store = ParamStore::new(&pl, 0, SEED, adam(), Mode::Async).unwrap();
    let ids = ids_on(0, 6);
    for seq in 1..=5u64 {
        let n = 1 + seq as usize;
        let grads: Vec<f32> = (0..n * DIM).map(|i| (i as f32 - seq as f32) * 0.01).collect();
        let p = push(&store, "t", seq, 1.0, &ids[..n], grads);
        store.push(p).unwrap();
    }
    let before = rows_of(&store);
    assert!(before.len() >= 4, "{before:?}");
    let candidates: Vec<_> = store.snapshot().unwrap().tables()[0].candidates().collect();
    assert!(!candidates.is_empty(), "the last id was sighted once: a candidate");
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointDir::new(dir.path(), 0);
    ckpt.save(&store.snapshot().unwrap(), 2).unwrap();
    let mut restored = ParamStore::new(&pl, 0, SEED, adam(), Mode::Async).unwrap();
    ckpt.load_latest(&mut restored).unwrap().unwrap();
    assert_eq!(rows_of(&restored), before);
    let restored_candidates: Vec<_> = restored.snapshot().unwrap().tables()[0].candidates().collect();
    assert_eq!(restored_candidates, candidates);
    assert_eq!(restored.tables()[0].stats(), store.tables()[0].stats());
    assert_eq!(pull(&restored, &ids), pull(&store, &ids));
}

/// [`placement`] with dense blocks on every shard (blocks of 4 of a 24-value `w`).
fn placement_with_blocks() -> Placement {
    let specs = vec![ParamSpec::new("w", vec![24], Init::Uniform { low: -0.1, high: 0.1 })];
    let emb = TableSpec::new("emb", DIM, Init::Uniform { low: -0.1, high: 0.1 });
    Placement::new(&specs, SHARDS, 4).unwrap().with_tables(vec![emb]).unwrap()
}

/// Every block and row of `store`, floats as bits.
fn held(store: &ParamStore) -> (Vec<Vec<u32>>, Vec<RowBits>) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let blocks = store.blocks().map(|(_, p, s)| [bits(p), bits(&s.slots)].concat()).collect();
    (blocks, rows_of(store))
}

/// A fresh replica of shard 0 caught up from `snapshot` (its blocks in
/// small parts, its table's rows in one), as a follower's catch-up does.
fn caught_up(pl: &Placement, opt: Box<dyn Optimizer>, snapshot: &StoreSnapshot) -> ParamStore {
    let fresh = ParamStore::new_to_restore(pl, 0, SEED, opt, Mode::Async).unwrap();
    let mut catch_up = CatchUp::new(0, 1, 0, History::starting(1, 1), fresh);
    let mut parts = snapshot_parts(snapshot, 0, 1, 0, 4);
    let table = &snapshot.tables()[0];
    let rows = table
        .records()
        .map(|r| (r.id, r.params.to_vec(), r.step, r.slots.to_vec(), r.count, r.last_seen))
        .collect();
    let chunk = RowChunk {
        table: 0,
        index: 0,
        rows,
        candidates: table.candidates().collect(),
        stats: Some(table.stats()),
    };
    let mut row_part = parts[0].clone();
    row_part.blocks.clear();
    row_part.rows = Some(chunk);
    parts.push(row_part);
    for mut part in parts {
        part.row_parts = 1;
        catch_up.part(part).unwrap();
    }
    let (store, ..) = catch_up.finish().unwrap().promote(2);
    store
}

/// Saved, loaded into a fresh store and caught up from: what `store` held,
/// bit for bit, both ways.
fn round_trips(pl: &Placement, opt: &dyn Fn() -> Box<dyn Optimizer>, store: &ParamStore) {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointDir::new(dir.path(), 0);
    ckpt.save(&store.snapshot().unwrap(), 2).unwrap();
    let mut restored = ParamStore::new_to_restore(pl, 0, SEED, opt(), Mode::Async).unwrap();
    let loaded = ckpt.load_latest(&mut restored).unwrap().unwrap();
    assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped);
    assert_eq!(held(&restored), held(store), "the checkpoint holds what the store held");
    let follower = caught_up(pl, opt(), &store.snapshot().unwrap());
    assert_eq!(held(&follower), held(store), "the catch-up carries what the store held");
}

/// The reviewer's case: a finite gradient whose square overflows `f32`
/// (row `[1e20, 1, -3e30]`, a dense 1e25). AdaGrad's and Adam's state stays
/// finite (it became `inf`), and the shard saves, loads and is caught up
/// from as it was (the checkpoint was refused as corrupt, the catch-up
/// failed).
#[test]
fn a_huge_finite_gradient_leaves_the_state_finite_and_the_shard_restorable() {
    let pl = placement_with_blocks();
    let adam = || -> Box<dyn Optimizer> { Box::new(Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 }) };
    let adagrad = || -> Box<dyn Optimizer> { Box::new(AdaGrad { lr: 0.1, eps: 1e-10 }) };
    for opt in [&adam as &dyn Fn() -> Box<dyn Optimizer>, &adagrad] {
        let mut store = ParamStore::new(&pl, 0, SEED, opt(), Mode::Async).unwrap();
        let ids = ids_on(0, 2);
        for seq in 1..=3 {
            let mut p = push(&store, "t", seq, 1.0, &ids, [[1e20, 1.0, -3e30], [0.5; DIM]].concat());
            for (_, g) in &mut p.grads {
                *g = Grad::Floats(vec![1e25; g.len()]);
            }
            store.push(p).unwrap();
        }
        let name = opt().name().to_string();
        let (blocks, rows) = held(&store);
        let finite = |bits: &[u32]| bits.iter().all(|&b| f32::from_bits(b).is_finite());
        assert!(blocks.iter().all(|b| finite(b)), "{name}: a block's state overflowed");
        assert!(
            rows.iter().all(|r| finite(&r.1) && finite(&r.3)),
            "{name}: a row's state overflowed: {rows:?}"
        );
        round_trips(&pl, &opt, &store);
    }
}

/// A model that does diverge (SGD at rate 10: a gradient of 3e38 takes a
/// parameter to -inf, one of -3e38 then to NaN) is checkpointed and caught
/// up from as it was, NaN and infinities included, with every update it
/// acknowledged (the checkpoint was refused as corrupt, the catch-up
/// failed for good). A file whose count of them was altered is refused.
#[test]
fn a_diverged_shard_checkpoints_and_catches_up_as_it_was() {
    let pl = placement_with_blocks();
    let sgd = || -> Box<dyn Optimizer> { Box::new(Sgd { lr: 10.0 }) };
    let mut store = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Async).unwrap();
    let ids = ids_on(0, 2);
    for (seq, g) in [(1, 3e38), (2, -3e38)] {
        let mut p = push(&store, "t", seq, 1.0, &ids, [[g, 1.0, g], [0.5; DIM]].concat());
        for (_, grad) in &mut p.grads {
            *grad = Grad::Floats(vec![g; grad.len()]);
        }
        store.push(p).unwrap();
    }
    let rows = rows_of(&store);
    let row = |i: usize| rows[i].1.iter().map(|&b| f32::from_bits(b)).collect::<Vec<f32>>();
    assert!(row(0)[0].is_nan() && row(0)[1].is_finite() && row(0)[2].is_nan(), "{:?}", row(0));
    assert!(row(1).iter().all(|x| x.is_finite()));
    assert!(store.blocks().count() > 0 && store.blocks().all(|(_, p, _)| p.iter().all(|x| x.is_nan())));
    round_trips(&pl, &sgd, &store);

    // The header records how many such values the file holds: two in the
    // row, every parameter of the blocks.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointDir::new(dir.path(), 0);
    let saved = ckpt.save(&store.snapshot().unwrap(), 2).unwrap();
    let good = std::fs::read(&saved.path).unwrap();
    let name_len = u32::from_le_bytes(good[56..60].try_into().unwrap()) as usize;
    let at = 60 + name_len + 8;
    let recorded = u64::from_le_bytes(good[at..at + 8].try_into().unwrap());
    let blocks: usize = store.blocks().map(|(_, p, _)| p.len()).sum();
    assert_eq!(recorded, (blocks + 2) as u64);
    for (count, words) in [(recorded + 1, "the file holds"), (recorded - 1, "past the")] {
        let mut b = good.clone();
        b[at..at + 8].copy_from_slice(&count.to_le_bytes());
        std::fs::write(&saved.path, with_crc(b)).unwrap();
        let mut restored = ParamStore::new_to_restore(&pl, 0, SEED, sgd(), Mode::Async).unwrap();
        let e = ckpt.load_latest(&mut restored).unwrap_err().to_string();
        assert!(e.contains(words) && e.contains("non-finite"), "{e}");
    }
}

/// Rewrites a checkpoint's trailing CRC so that only an edit is wrong.
fn with_crc(mut b: Vec<u8>) -> Vec<u8> {
    let n = b.len() - 4;
    let crc = crc32fast::hash(&b[..n]);
    b[n..].copy_from_slice(&crc.to_le_bytes());
    b
}

#[test]
fn a_checkpoint_refused_for_a_row_changes_nothing_and_the_older_one_loads_exactly() {
    let pl = placement(RowPolicy { admit_after: 2, ..RowPolicy::default() });
    let mut store = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Async).unwrap();
    let [a, b, c, d, e, f]: [u64; 6] = ids_on(0, 6).try_into().unwrap();
    let mut seq = 0;
    let mut push_ids = |store: &mut ParamStore, ids: &[u64]| {
        seq += 1;
        let grads = (0..ids.len() * DIM).map(|i| i as f32 * 0.1).collect();
        store.push(push(store, "t", seq, 1.0, ids, grads)).unwrap();
    };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointDir::new(dir.path(), 0);
    // Older: rows a, b, c; candidate d.
    push_ids(&mut store, &[a, b, c, d]);
    push_ids(&mut store, &[a, b, c]);
    ckpt.save(&store.snapshot().unwrap(), 5).unwrap();
    let older = rows_of(&store);
    // Newer: rows a, b, c, e; candidates d, f (a row is 40 bytes with SGD,
    // a candidate 20; then the 4-byte CRC).
    push_ids(&mut store, &[e, f]);
    push_ids(&mut store, &[e]);
    let newer = ckpt.save(&store.snapshot().unwrap(), 5).unwrap();
    assert_eq!(rows_of(&store).len(), 4);
    let good = std::fs::read(&newer.path).unwrap();
    let n = good.len() - 4;
    assert_eq!(good[n - 48..n - 40], 2u64.to_le_bytes(), "two candidates end the table");
    let last_row = n - 48 - 40;
    assert_eq!(good[last_row..last_row + 8], e.to_le_bytes(), "row e is the last row");
    let put = |at: usize, bytes: &[u8]| {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        with_crc(b)
    };
    for (bad, words) in [
        (put(last_row + 16, &0u32.to_le_bytes()), format!("row {e} of table \"emb\" has count 0")),
        (put(last_row, &c.to_le_bytes()), format!("row {c} of table \"emb\" follows row {c}")),
        (put(n - 40, &a.to_le_bytes()), format!("candidate {a} of table \"emb\" is also a held row")),
    ] {
        std::fs::write(&newer.path, bad).unwrap();
        let mut restored = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Async).unwrap();
        let loaded = ckpt.load_latest(&mut restored).unwrap().unwrap();
        assert_eq!(loaded.skipped.len(), 1, "{words}");
        assert!(loaded.skipped[0].1.contains(&words), "{:?} should say {words:?}", loaded.skipped[0].1);
        assert_eq!(
            rows_of(&restored),
            older,
            "the older checkpoint, and nothing of the refused one ({words})"
        );
        let candidates: Vec<u64> =
            restored.snapshot().unwrap().tables()[0].candidates().map(|c| c.id).collect();
        assert_eq!(candidates, vec![d]);
    }
}

#[test]
fn bad_rows_are_refused_by_name_and_change_nothing() {
    let pl = placement(RowPolicy::default());
    let mut store = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Async).unwrap();
    let ids = ids_on(0, 3);
    let p = push(&store, "t", 1, 1.0, &ids, vec![1.0; 3 * DIM]);
    store.push(p).unwrap();
    let before = rows_of(&store);
    let refuse = |store: &mut ParamStore, p: Push, words: &str| {
        let e = store.push(p).unwrap_err();
        assert!(e.to_string().contains(words), "{e} should name {words:?}");
    };
    // The wrong dim.
    let p = push(&store, "t", 2, 1.0, &ids, vec![1.0; 3 * DIM - 1]);
    refuse(&mut store, p, "expected 9");
    // A NaN, named by row and index.
    let mut nan = vec![0.0; 3 * DIM];
    nan[DIM + 1] = f32::NAN;
    let p = push(&store, "t", 2, 1.0, &ids, nan);
    refuse(&mut store, p, &format!("row {}", ids[1]));
    // A row of the other shard.
    let other = ids_on(1, 1);
    let p = push(&store, "t", 2, 1.0, &other, vec![0.0; DIM]);
    refuse(&mut store, p, "belongs to shard 1");
    // An id twice in one push.
    let p = push(&store, "t", 2, 1.0, &[ids[0], ids[0]], vec![0.0; 2 * DIM]);
    refuse(&mut store, p, "more than once");
    // A table the model does not have.
    let mut p = push(&store, "t", 2, 1.0, &ids, vec![0.0; 3 * DIM]);
    p.rows[0].table = 7;
    refuse(&mut store, p, "table #7 does not exist");
    // A pull of more rows than one call may carry: a clear limit, not an OOM.
    let many: Vec<u64> = (0..MAX_ROWS_PER_CALL as u64 + 1).collect();
    let e = store.pull_rows(0, &many, &mut Vec::new()).unwrap_err();
    assert!(matches!(e, Error::TooManyRows { .. }), "{e}");
    assert!(e.to_string().contains(&format!("at most {MAX_ROWS_PER_CALL}")), "{e}");
    assert_eq!(rows_of(&store), before, "the table is unharmed");
    // And it still takes a good push.
    let p = push(&store, "t", 2, 1.0, &ids, vec![0.0; 3 * DIM]);
    assert_eq!(store.push(p).unwrap(), PushOutcome::Applied { step: 2 });
}

#[test]
fn rows_travel_in_the_first_part_only() {
    let specs = vec![ParamSpec::new("w", vec![8], Init::Zeros)];
    let pl = Placement::new(&specs, 1, 4)
        .unwrap()
        .with_tables(vec![TableSpec::new("emb", DIM, Init::Zeros)])
        .unwrap();
    let mut store = ParamStore::new(&pl, 0, SEED, sgd(), Mode::Async).unwrap();
    let blocks: Vec<_> = store.block_ids().collect();
    assert_eq!(blocks.len(), 2);
    let rows = |ids: &[u64]| {
        vec![RowGrads { table: 0, ids: ids.to_vec(), grads: Grad::Floats(vec![1.0; ids.len() * DIM]) }]
    };
    let part = |b: usize, rows| Push {
        trainer: "t".into(),
        seq: 1,
        step: 0,
        weight: 1.0,
        grads: vec![(blocks[b], Grad::Floats(vec![0.0; 4]))],
        rows,
        origin: None,
    };
    let e = store.push(part(1, rows(&[5]))).unwrap_err();
    assert!(e.to_string().contains("not its push's first"), "{e}");
    // The second part first, then the first with the rows: whole once both came.
    store.push(part(1, Vec::new())).unwrap();
    assert_eq!(store.step(), 0);
    store.push(part(0, rows(&[5]))).unwrap();
    assert_eq!(store.step(), 1);
    assert_eq!(store.push(part(0, rows(&[5]))).unwrap(), PushOutcome::Duplicate);
    let mut out = Vec::new();
    store.pull_rows(0, &[5], &mut out).unwrap();
    assert_eq!(out, vec![-0.5; DIM], "applied once");
}
