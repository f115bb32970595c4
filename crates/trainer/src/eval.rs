//! Evaluation of a model on a held-out set.

use oar_pserver::sparse::{init_row, TableSpec};
use oar_pserver::ParamBuf;

use crate::id_reader::IdExample;
use crate::model::{Example, Model};
use crate::sparse_model::{RowBatch, SparseModel};

/// Loss and accuracy of a model on a set of examples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean loss per example (0 for an empty set).
    pub loss: f32,
    /// Fraction of examples whose predicted class is the label (0 for an empty set).
    pub accuracy: f32,
    /// Number of examples evaluated.
    pub examples: usize,
}

/// Evaluates `model` with `params` on `examples`, `batch_size` at a time (a
/// batch size of 0 is treated as 1). The batch size only bounds memory: the
/// result is the same, up to rounding, for any batch size.
pub fn evaluate(model: &dyn Model, params: &ParamBuf, examples: &[Example], batch_size: usize) -> Evaluation {
    let mut tally = Tally::default();
    let mut preds = Vec::new();
    for batch in examples.chunks(batch_size.max(1)) {
        let loss = model.predict(params, batch, &mut preds);
        tally.add(loss, &preds, batch.iter().map(|e| e.label));
    }
    tally.evaluation()
}

/// Evaluates a sparse `model` with dense parameters `dense` on `examples`,
/// `batch_size` at a time: `rows` fills each batch's rows (their ids set by
/// [`SparseModel::batch_ids`]) with their values, from the pservers or, for
/// the initial model, from [`init_rows`].
pub fn evaluate_sparse(
    model: &dyn SparseModel,
    dense: &ParamBuf,
    examples: &[IdExample],
    batch_size: usize,
    mut rows: impl FnMut(&mut RowBatch),
) -> Evaluation {
    let mut tally = Tally::default();
    let (mut batch_rows, mut preds) = (model.new_rows(), Vec::new());
    for batch in examples.chunks(batch_size.max(1)) {
        model.batch_ids(batch, &mut batch_rows);
        rows(&mut batch_rows);
        let loss = model.predict(dense, &batch_rows, batch, &mut preds);
        tally.add(loss, &preds, batch.iter().map(|e| e.label));
    }
    tally.evaluation()
}

/// Sets every row of `rows` to its initial value, as the pservers create
/// it (`specs` are the model's tables, `seed` the job's).
pub fn init_rows(specs: &[TableSpec], seed: u64, rows: &mut RowBatch) {
    for (t, spec) in specs.iter().enumerate() {
        let (dim, ids) = (rows.dim(t), rows.ids(t).to_vec());
        let values = rows.values_mut(t);
        for (i, id) in ids.into_iter().enumerate() {
            init_row(spec, seed, id, &mut values[i * dim..(i + 1) * dim]);
        }
    }
}

/// Loss and accuracy summed batch by batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    loss_sum: f64,
    correct: usize,
    examples: usize,
}

impl Tally {
    /// A batch: its mean loss, its predictions and its labels.
    pub fn add(&mut self, mean_loss: f32, preds: &[u32], labels: impl Iterator<Item = u32>) {
        let n = preds.len();
        self.loss_sum += f64::from(mean_loss) * n as f64;
        self.correct += preds.iter().zip(labels).filter(|(p, l)| **p == *l).count();
        self.examples += n;
    }

    /// The mean loss and accuracy so far (zeros for no example).
    pub fn evaluation(&self) -> Evaluation {
        let n = self.examples;
        if n == 0 {
            return Evaluation { loss: 0.0, accuracy: 0.0, examples: 0 };
        }
        Evaluation {
            loss: (self.loss_sum / n as f64) as f32,
            accuracy: (self.correct as f64 / n as f64) as f32,
            examples: n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datagen::write_blobs;
    use crate::reader::{read_glob, Format, ReaderOptions};
    use crate::ModelConfig;

    /// Plain mini-batch SGD, in file order, for `epochs` passes.
    fn sgd(model: &dyn Model, params: &mut ParamBuf, data: &[Example], batch: usize, lr: f32, epochs: usize) {
        let mut grads = ParamBuf::zeros(&model.param_specs());
        for _ in 0..epochs {
            for b in data.chunks(batch) {
                model.loss_and_grad(params, b, &mut grads);
                for (p, g) in params.as_mut_slice().iter_mut().zip(grads.as_slice()) {
                    *p -= lr * g;
                }
            }
        }
    }

    #[test]
    fn softmax_learns_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let (train, test) = write_blobs(dir.path(), 3, 10, 2000, 1000, 42).unwrap();
        let opts = ReaderOptions { format: Format::Libsvm, features: 10, classes: 3, skip_bad_lines: false };
        let train = read_glob(train.to_str().unwrap(), &opts).unwrap();
        let test = read_glob(test.to_str().unwrap(), &opts).unwrap();
        let model = ModelConfig::Softmax { features: 10, classes: 3 }.build().unwrap();
        let mut params = ParamBuf::zeros(&model.param_specs());
        let before = evaluate(model.as_ref(), &params, &test, 64);
        sgd(model.as_ref(), &mut params, &train, 32, 0.1, 5);
        let after = evaluate(model.as_ref(), &params, &test, 64);
        assert_eq!(after.examples, 1000);
        assert!(after.loss < before.loss, "{before:?} -> {after:?}");
        assert!(after.accuracy >= 0.95, "{after:?}");
        // Honest data: not trivially separable.
        assert!(after.accuracy < 1.0, "{after:?}");
    }

    #[test]
    fn softmax_learns_a1a() {
        let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/");
        let opts = ReaderOptions { format: Format::Libsvm, features: 123, classes: 2, skip_bad_lines: false };
        let train = read_glob(&format!("{data}a1a"), &opts).unwrap();
        let test = read_glob(&format!("{data}a1a.t"), &opts).unwrap();
        let model = ModelConfig::Softmax { features: 123, classes: 2 }.build().unwrap();
        let mut params = ParamBuf::zeros(&model.param_specs());
        sgd(model.as_ref(), &mut params, &train, 32, 0.2, 8);
        let ev = evaluate(model.as_ref(), &params, &test, 256);
        assert_eq!(ev.examples, test.len());
        assert!(ev.accuracy >= 0.82, "{ev:?}");
    }

    #[test]
    fn batch_size_does_not_change_the_result() {
        let model = ModelConfig::Softmax { features: 2, classes: 2 }.build().unwrap();
        let mut params = ParamBuf::zeros(&model.param_specs());
        // weights [[1, -1], [-1, 1]]: class = which feature is larger.
        params.param_mut(0).copy_from_slice(&[1.0, -1.0, -1.0, 1.0]);
        let examples: Vec<Example> = (0..7)
            .map(|i| Example { label: (i % 2) as u32, features: vec![(0, (i % 3) as f32), (1, 1.0)] })
            .collect();
        let a = evaluate(model.as_ref(), &params, &examples, 3);
        let b = evaluate(model.as_ref(), &params, &examples, 0);
        let c = evaluate(model.as_ref(), &params, &examples, 100);
        assert_eq!(a.accuracy, b.accuracy);
        assert_eq!(a.accuracy, c.accuracy);
        assert!((a.loss - c.loss).abs() < 1e-6 && (b.loss - c.loss).abs() < 1e-6);
        // Predicted class 1 when x0 < 1, class 0 when x0 > 1, tie (x0 = 1) -> 0.
        // Labels 0,1,0,1,0,1,0 with x0 = 0,1,2,0,1,2,0 -> preds 1,0,0,1,0,0,1.
        assert!((a.accuracy - 3.0 / 7.0).abs() < 1e-6, "{a:?}");
        let empty = evaluate(model.as_ref(), &params, &[], 8);
        assert_eq!(empty, Evaluation { loss: 0.0, accuracy: 0.0, examples: 0 });
    }
}
