//! Checks of the built-in CTR models: loss and gradients (dense and row)
//! against central differences of an independent f64 reference, a
//! hand-computed factorization machine, and data that does not fit the rows.

use std::collections::{BTreeSet, HashMap};

use oar_pserver::rng::SplitMix64;
use oar_pserver::ParamBuf;
use oar_trainer::ctr::{cross_id, CtrModelConfig, MAX_CROSS_IDS};
use oar_trainer::{IdExample, RowBatch, SparseModel};

fn normal(rng: &mut SplitMix64) -> f64 {
    f64::from(rng.next_normal())
}

/// The reference's parameters: the bias, and the rows by (table, id).
#[derive(Clone, Debug)]
struct Params {
    bias: f64,
    rows: HashMap<(usize, u64), Vec<f64>>,
}

/// Straightforward f64 logit, from the documented formulas: linear terms
/// (own ids, then crosses of pairs among the first MAX_CROSS_IDS), plus for
/// an FM `Σ_{i<j} <v_i, v_j> x_i x_j` over the example's positions.
fn ref_logit(fm: bool, crosses: bool, p: &Params, ex: &IdExample) -> f64 {
    let get = |t: usize, id: u64| p.rows.get(&(t, id)).cloned();
    let mut z = p.bias;
    let mut linear: Vec<(u64, f64)> = ex.ids.iter().map(|&(id, x)| (id, f64::from(x))).collect();
    if crosses {
        let head = &ex.ids[..ex.ids.len().min(MAX_CROSS_IDS)];
        for i in 0..head.len() {
            for j in i + 1..head.len() {
                // The model multiplies the values in f32; so does the reference.
                linear.push((cross_id(head[i].0, head[j].0), f64::from(head[i].1 * head[j].1)));
            }
        }
    }
    for (id, x) in linear {
        z += get(0, id).map_or(0.0, |w| w[0]) * x;
    }
    if fm {
        for i in 0..ex.ids.len() {
            for j in i + 1..ex.ids.len() {
                let (a, xa) = ex.ids[i];
                let (b, xb) = ex.ids[j];
                if let (Some(va), Some(vb)) = (get(1, a), get(1, b)) {
                    let dot: f64 = va.iter().zip(&vb).map(|(x, y)| x * y).sum();
                    z += dot * f64::from(xa) * f64::from(xb);
                }
            }
        }
    }
    z
}

fn ref_loss(fm: bool, crosses: bool, p: &Params, batch: &[IdExample]) -> f64 {
    let total: f64 = batch
        .iter()
        .filter(|ex| ex.label <= 1)
        .map(|ex| {
            let z = ref_logit(fm, crosses, p, ex);
            (1.0 + z.exp()).ln() - f64::from(ex.label) * z
        })
        .sum();
    total / batch.len() as f64
}

/// Random examples over a small id range (so examples share ids and some
/// repeat one), a few huge ids, one long example (past the cross cap when
/// `long`) and one example with a label the model ignores.
fn random_batch(rng: &mut SplitMix64, n: usize, long: bool) -> Vec<IdExample> {
    let mut batch: Vec<IdExample> = (0..n)
        .map(|_| {
            let len = 1 + (rng.next_u64() % 6) as usize;
            let ids = (0..len)
                .map(|_| {
                    let id = if rng.next_f32() < 0.1 {
                        u64::MAX - rng.next_u64() % 3
                    } else {
                        1 + rng.next_u64() % 12
                    };
                    (id, normal(rng) as f32)
                })
                .collect();
            IdExample { label: (rng.next_u64() % 2) as u32, ids }
        })
        .collect();
    if long {
        let ids = (0..MAX_CROSS_IDS as u64 + 6).map(|i| (100 + i, 0.5 + 0.01 * i as f32)).collect();
        batch.push(IdExample { label: 1, ids });
    }
    batch.push(IdExample { label: 7, ids: vec![(1, 1.0), (2, 1.0)] });
    batch
}

/// Random rows for every id the model asks for, written into `rows` and
/// into the reference's parameters.
fn random_params(
    model: &dyn SparseModel,
    batch: &[IdExample],
    rng: &mut SplitMix64,
) -> (Params, ParamBuf, RowBatch) {
    let mut rows = model.new_rows();
    model.batch_ids(batch, &mut rows);
    let mut dense = ParamBuf::zeros(&model.param_specs());
    dense.as_mut_slice()[0] = (normal(rng) * 0.3) as f32;
    let mut p = Params { bias: f64::from(dense.as_slice()[0]), rows: HashMap::new() };
    for t in 0..rows.tables() {
        let scale = if t == 0 { 0.3 } else { 0.4 };
        for v in rows.values_mut(t) {
            *v = (normal(rng) * scale) as f32;
        }
        for (id, row) in rows.iter(t) {
            p.rows.insert((t, id), row.iter().map(|&v| f64::from(v)).collect());
        }
    }
    (p, dense, rows)
}

fn assert_close(what: &str, got: f32, want: f64) {
    let tol = 2e-4 + 2e-3 * want.abs();
    assert!((f64::from(got) - want).abs() <= tol, "{what}: model {got}, numerical {want}");
}

fn check_gradients(cfg: CtrModelConfig, long: bool, seed: u64) {
    let (fm, crosses) = match cfg {
        CtrModelConfig::Lr { crosses } => (false, crosses),
        CtrModelConfig::Fm { crosses, .. } => (true, crosses),
    };
    let model = cfg.build().unwrap();
    let mut rng = SplitMix64::new(seed);
    let batch = random_batch(&mut rng, 8, long);
    let (p, dense, rows) = random_params(model.as_ref(), &batch, &mut rng);

    // The ids asked for are exactly those the reference's formula touches.
    let mut linear = BTreeSet::new();
    for ex in &batch {
        linear.extend(ex.ids.iter().map(|&(id, _)| id));
        if crosses {
            let head = &ex.ids[..ex.ids.len().min(MAX_CROSS_IDS)];
            for (i, a) in head.iter().enumerate() {
                linear.extend(head[i + 1..].iter().map(|b| cross_id(a.0, b.0)));
            }
        }
    }
    assert_eq!(rows.ids(0), linear.into_iter().collect::<Vec<_>>().as_slice(), "{cfg:?}");
    if fm {
        let own: BTreeSet<u64> = batch.iter().flat_map(|ex| ex.ids.iter().map(|&(id, _)| id)).collect();
        assert_eq!(rows.ids(1), own.into_iter().collect::<Vec<_>>().as_slice());
    }

    let mut dense_grads = ParamBuf::zeros(&model.param_specs());
    dense_grads.fill(f32::NAN); // overwritten, not accumulated
    let mut row_grads = rows.zeros_like();
    row_grads.fill(f32::NAN);
    let loss = model.loss_and_grad(&dense, &rows, &batch, &mut dense_grads, &mut row_grads);
    let want = ref_loss(fm, crosses, &p, &batch);
    assert_close(&format!("{cfg:?} loss"), loss, want);

    let eps = 1e-5;
    let numerical = |p: &Params, set: &dyn Fn(&mut Params, f64)| {
        let (mut hi, mut lo) = (p.clone(), p.clone());
        set(&mut hi, eps);
        set(&mut lo, -eps);
        (ref_loss(fm, crosses, &hi, &batch) - ref_loss(fm, crosses, &lo, &batch)) / (2.0 * eps)
    };
    let g = numerical(&p, &|q, d| q.bias += d);
    assert_close(&format!("{cfg:?} bias"), dense_grads.as_slice()[0], g);
    for t in 0..rows.tables() {
        for (id, grad) in row_grads.iter(t) {
            for (k, &got) in grad.iter().enumerate() {
                let g = numerical(&p, &|q, d| q.rows.get_mut(&(t, id)).unwrap()[k] += d);
                assert_close(&format!("{cfg:?} table {t} id {id} [{k}]"), got, g);
            }
        }
    }
    // predict agrees on the loss.
    let mut preds = vec![9];
    let predicted_loss = model.predict(&dense, &rows, &batch, &mut preds);
    assert_eq!(preds.len(), batch.len());
    assert!((predicted_loss - loss).abs() < 1e-6);
    for (ex, &pred) in batch.iter().zip(&preds) {
        assert_eq!(pred, u32::from(ref_logit(fm, crosses, &p, ex) > 0.0));
    }
}

#[test]
fn lr_gradients_match_finite_differences() {
    for seed in 0..4 {
        check_gradients(CtrModelConfig::Lr { crosses: false }, seed % 2 == 0, seed);
    }
}

#[test]
fn lr_with_crosses_gradients_match_finite_differences() {
    for seed in 0..3 {
        check_gradients(CtrModelConfig::Lr { crosses: true }, seed == 0, 10 + seed);
    }
}

#[test]
fn fm_gradients_match_finite_differences() {
    for (seed, factors) in [(20, 1), (21, 3), (22, 8)] {
        check_gradients(CtrModelConfig::Fm { factors, crosses: false }, seed == 20, seed);
    }
}

#[test]
fn fm_with_crosses_gradients_match_finite_differences() {
    for (seed, factors) in [(30, 2), (31, 4)] {
        check_gradients(CtrModelConfig::Fm { factors, crosses: true }, seed == 30, seed);
    }
}

#[test]
fn cross_ids_follow_the_documented_formula() {
    // sm(sm(3 ^ "cross_id") ^ 7), computed independently of the crate (Python).
    assert_eq!(cross_id(3, 7), 415_698_408_846_983_383);
    assert_eq!(cross_id(7, 3), cross_id(3, 7));
}

/// Sets the rows the batch asks for from `(table, id) -> row`.
fn set_rows(model: &dyn SparseModel, batch: &[IdExample], values: &[((usize, u64), &[f32])]) -> RowBatch {
    let mut rows = model.new_rows();
    model.batch_ids(batch, &mut rows);
    for &((t, id), row) in values {
        rows.row_mut(t, id).expect("the batch asks for this row").copy_from_slice(row);
    }
    rows
}

#[test]
fn fm_logit_by_hand() {
    // ids 1 (x = 1) and 2 (x = 2); w = (0.5, -0.25); v1 = (1, 2), v2 = (3, -1); b = 0.1.
    // logit = 0.1 + 0.5·1 − 0.25·2 + <v1, v2>·1·2 = 0.1 + 0 + (3 − 2)·2 = 2.1.
    let model = CtrModelConfig::Fm { factors: 2, crosses: false }.build().unwrap();
    let batch = [IdExample { label: 1, ids: vec![(1, 1.0), (2, 2.0)] }];
    let rows = set_rows(
        model.as_ref(),
        &batch,
        &[((0, 1), &[0.5]), ((0, 2), &[-0.25]), ((1, 1), &[1.0, 2.0]), ((1, 2), &[3.0, -1.0])],
    );
    let mut dense = ParamBuf::zeros(&model.param_specs());
    dense.as_mut_slice()[0] = 0.1;
    let mut preds = Vec::new();
    let loss = model.predict(&dense, &rows, &batch, &mut preds);
    let want = (1.0 + (-2.1f64).exp()).ln();
    assert!((f64::from(loss) - want).abs() < 1e-6, "loss {loss}, want {want}");
    assert_eq!(preds, vec![1]);

    // Gradients by hand: g = σ(2.1) − 1; d/dv1 = x1·(s − v1·x1) with s = v1 + 2·v2 = (7, 0).
    let mut dense_grads = ParamBuf::zeros(&model.param_specs());
    let mut row_grads = rows.zeros_like();
    model.loss_and_grad(&dense, &rows, &batch, &mut dense_grads, &mut row_grads);
    let g = 1.0 / (1.0 + (-2.1f64).exp()) - 1.0;
    let close = |got: &[f32], want: &[f64]| {
        assert!(got.iter().zip(want).all(|(a, b)| (f64::from(*a) - b).abs() < 1e-6), "{got:?} vs {want:?}");
    };
    close(dense_grads.as_slice(), &[g]);
    close(row_grads.row(0, 2).unwrap(), &[2.0 * g]);
    close(row_grads.row(1, 1).unwrap(), &[6.0 * g, -2.0 * g]); // (7, 0) − (1, 2)
    close(row_grads.row(1, 2).unwrap(), &[2.0 * g, 4.0 * g]); // 2·((7, 0) − 2·(3, −1))
}

#[test]
fn missing_rows_read_as_zero_and_drop_their_gradients() {
    let batch = [
        IdExample { label: 1, ids: vec![(1, 1.0), (5, 1.0)] },
        IdExample { label: 0, ids: vec![(9, 2.0)] },
        IdExample { label: 3, ids: vec![(1, 1.0)] },
    ];
    for cfg in [CtrModelConfig::Lr { crosses: true }, CtrModelConfig::Fm { factors: 3, crosses: true }] {
        let model = cfg.build().unwrap();
        let dense = ParamBuf::zeros(&model.param_specs());
        // Rows of id 1 only, in every table; gradients for no row at all.
        let mut rows = model.new_rows();
        for t in 0..rows.tables() {
            rows.set_ids(t, vec![1]);
            rows.values_mut(t).fill(0.5);
        }
        let mut dense_grads = ParamBuf::zeros(&model.param_specs());
        let mut row_grads = model.new_rows();
        let loss = model.loss_and_grad(&dense, &rows, &batch, &mut dense_grads, &mut row_grads);
        assert!(loss.is_finite() && loss > 0.0, "{cfg:?}: {loss}");
        let mut preds = Vec::new();
        model.predict(&dense, &rows, &batch, &mut preds);
        // Example 1 has logit 0.5 (w1; its factor pair has no v5), example 2 logit 0.
        assert_eq!(preds, vec![1, 0, 1], "{cfg:?}");
        // The out-of-range label counts in the batch size but not the loss.
        let want = ((1.0 + (-0.5f64).exp()).ln() + 2f64.ln()) / 3.0;
        assert!((f64::from(loss) - want).abs() < 1e-6, "{cfg:?}: {loss} vs {want}");
    }
}

#[test]
fn empty_batch_has_zero_loss_and_gradients() {
    let model = CtrModelConfig::Fm { factors: 2, crosses: true }.build().unwrap();
    let dense = ParamBuf::zeros(&model.param_specs());
    let mut rows = model.new_rows();
    model.batch_ids(&[], &mut rows);
    assert!((0..rows.tables()).all(|t| rows.ids(t).is_empty()));
    let mut dense_grads = ParamBuf::zeros(&model.param_specs());
    dense_grads.fill(1.0);
    let mut row_grads = rows.zeros_like();
    assert_eq!(model.loss_and_grad(&dense, &rows, &[], &mut dense_grads, &mut row_grads), 0.0);
    assert_eq!(dense_grads.as_slice(), &[0.0]);
    let mut preds = vec![1];
    assert_eq!(model.predict(&dense, &rows, &[], &mut preds), 0.0);
    assert!(preds.is_empty());
}

#[test]
fn table_and_param_specs() {
    let lr = CtrModelConfig::Lr { crosses: false }.build().unwrap();
    let names: Vec<(String, usize)> = lr.table_specs().into_iter().map(|t| (t.name, t.dim)).collect();
    assert_eq!(names, vec![("lr_w".to_string(), 1)]);
    assert_eq!(lr.param_specs()[0].name, "lr_b");
    let fm = CtrModelConfig::Fm { factors: 16, crosses: false }.build().unwrap();
    let names: Vec<(String, usize)> = fm.table_specs().into_iter().map(|t| (t.name, t.dim)).collect();
    assert_eq!(names, vec![("fm_w".to_string(), 1), ("fm_v".to_string(), 16)]);
    assert_eq!(fm.param_specs()[0].name, "fm_b");
    assert_eq!(fm.new_rows().tables(), 2);
}
