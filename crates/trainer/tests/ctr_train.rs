//! Trains the CTR models on a1a in-process with plain SGD, the sparse tables
//! held in local hash maps standing in for the pservers (rows created on
//! first touch from their table's `Init`), and scores them on a1a.t.

use std::collections::HashMap;

use oar_pserver::sparse::TableSpec;
use oar_pserver::{hash_str, Init, ParamBuf, SplitMix64};
use oar_trainer::id_reader::{read_glob_ids, IdReaderOptions};
use oar_trainer::{CtrModelConfig, IdExample, RowBatch};

/// The sparse tables of a model, one hash map per table.
struct LocalTables {
    specs: Vec<TableSpec>,
    rows: Vec<HashMap<u64, Vec<f32>>>,
    seed: u64,
}

impl LocalTables {
    fn new(specs: Vec<TableSpec>, seed: u64) -> Self {
        let rows = specs.iter().map(|_| HashMap::new()).collect();
        LocalTables { specs, rows, seed }
    }

    /// A new row's initial value, from (seed, table, id) only.
    fn init_row(spec: &TableSpec, seed: u64, id: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed ^ hash_str(&spec.name) ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (0..spec.dim)
            .map(|_| match spec.init {
                Init::Zeros => 0.0,
                Init::Constant(c) => c,
                Init::Uniform { low, high } => low + (high - low) * rng.next_f32(),
                Init::Normal { mean, std } => mean + std * rng.next_normal(),
            })
            .collect()
    }

    /// Fills `rows` (ids set) with the tables' rows, creating missing ones.
    fn gather(&mut self, rows: &mut RowBatch) {
        for t in 0..rows.tables() {
            let (spec, table) = (&self.specs[t], &mut self.rows[t]);
            let dim = rows.dim(t);
            let ids = rows.ids(t).to_vec();
            let values = rows.values_mut(t);
            for (pos, id) in ids.into_iter().enumerate() {
                let row = table.entry(id).or_insert_with(|| Self::init_row(spec, self.seed, id));
                values[pos * dim..(pos + 1) * dim].copy_from_slice(row);
            }
        }
    }

    /// Plain SGD on the rows of `grads`.
    fn apply(&mut self, grads: &RowBatch, lr: f32) {
        for t in 0..grads.tables() {
            for (id, g) in grads.iter(t) {
                if let Some(row) = self.rows[t].get_mut(&id) {
                    for (w, g) in row.iter_mut().zip(g) {
                        *w -= lr * g;
                    }
                }
            }
        }
    }
}

fn dataset(name: &str) -> Vec<IdExample> {
    let path = format!("{}/../../testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    read_glob_ids(&path, &IdReaderOptions::default()).unwrap()
}

/// Trains `cfg` with SGD (`passes` shuffled passes of mini-batches of
/// `batch`) and returns the accuracy on a1a.t.
fn train_and_score(cfg: CtrModelConfig, passes: usize, batch: usize, lr: f32) -> f64 {
    let train = dataset("a1a");
    let test = dataset("a1a.t");
    let model = cfg.build().unwrap();
    let mut tables = LocalTables::new(model.table_specs(), 42);
    let mut dense = ParamBuf::init(&model.param_specs(), 42);
    let mut dense_grads = ParamBuf::zeros(&model.param_specs());
    let mut rows = model.new_rows();
    let mut rng = SplitMix64::new(7);
    let mut order: Vec<usize> = (0..train.len()).collect();
    let mut examples = Vec::with_capacity(batch);
    let mut last_loss = f32::NAN;
    for _ in 0..passes {
        // Fisher-Yates with the deterministic generator.
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut total = 0.0f64;
        for idx in order.chunks(batch) {
            examples.clear();
            examples.extend(idx.iter().map(|&i| train[i].clone()));
            model.batch_ids(&examples, &mut rows);
            tables.gather(&mut rows);
            let mut row_grads = rows.zeros_like();
            let loss = model.loss_and_grad(&dense, &rows, &examples, &mut dense_grads, &mut row_grads);
            total += f64::from(loss) * examples.len() as f64;
            tables.apply(&row_grads, lr);
            for (p, g) in dense.as_mut_slice().iter_mut().zip(dense_grads.as_slice()) {
                *p -= lr * g;
            }
        }
        last_loss = (total / train.len() as f64) as f32;
    }
    assert!(last_loss.is_finite() && last_loss < 0.45, "{cfg:?}: last pass mean loss {last_loss}");

    let mut correct = 0usize;
    let mut preds = Vec::new();
    for part in test.chunks(4096) {
        model.batch_ids(part, &mut rows);
        tables.gather(&mut rows);
        model.predict(&dense, &rows, part, &mut preds);
        correct += preds.iter().zip(part).filter(|(p, e)| **p == e.label).count();
    }
    let accuracy = correct as f64 / test.len() as f64;
    eprintln!("{cfg:?}: train loss {last_loss:.4}, a1a.t accuracy {accuracy:.4}");
    accuracy
}

#[test]
fn lr_learns_a1a() {
    let accuracy = train_and_score(CtrModelConfig::Lr { crosses: false }, 10, 16, 0.2);
    assert!(accuracy >= 0.82, "LR accuracy {accuracy}");
}

#[test]
fn fm_learns_a1a() {
    let accuracy = train_and_score(CtrModelConfig::Fm { factors: 8, crosses: false }, 10, 16, 0.2);
    assert!(accuracy >= 0.82, "FM accuracy {accuracy}");
}

#[test]
fn lr_with_crosses_learns_a1a() {
    let accuracy = train_and_score(CtrModelConfig::Lr { crosses: true }, 10, 16, 0.2);
    assert!(accuracy >= 0.80, "LR with crosses accuracy {accuracy}");
}

#[test]
fn fm_with_crosses_learns_a1a() {
    let accuracy = train_and_score(CtrModelConfig::Fm { factors: 8, crosses: true }, 10, 16, 0.2);
    assert!(accuracy >= 0.80, "FM with crosses accuracy {accuracy}");
}
