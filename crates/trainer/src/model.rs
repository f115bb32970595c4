//! The [`Model`] trait, the [`Example`] type and [`ModelConfig`], plus the
//! dense-batch, matrix-product and softmax cross-entropy helpers the built-in
//! models share.

use oar_pserver::{ParamBuf, ParamSpec};
use serde::{Deserialize, Serialize};

use crate::mlp::Mlp;
use crate::softmax::SoftmaxRegression;
use crate::{Error, Result};

/// One training example: a class label and a sparse feature vector.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    /// Class index in `[0, classes)`.
    pub label: u32,
    /// `(0-based feature index, value)` pairs; absent features are zero.
    /// Indices need not be sorted; a repeated index adds up.
    pub features: Vec<(u32, f32)>,
}

/// A differentiable classifier whose parameters live in a [`ParamBuf`] laid out
/// by [`Model::param_specs`].
///
/// Models hold only their shape, never their parameters, so one model value can
/// be shared by threads while the parameters travel to and from the pservers.
/// The `params` and `grads` buffers must have been built from this model's
/// `param_specs` (a programming error otherwise, which panics).
///
/// Examples whose label is `>= classes()` contribute nothing to the loss and the
/// gradients (though they count in the batch size), and feature indices
/// `>= features()` are ignored; the readers never produce either.
pub trait Model: Send + Sync + 'static {
    /// The parameters, in the order of the flat buffer.
    fn param_specs(&self) -> Vec<ParamSpec>;
    /// Number of input features.
    fn features(&self) -> usize;
    /// Number of classes.
    fn classes(&self) -> usize;
    /// Mean loss over the batch; writes the MEAN gradient over the batch into
    /// `grads` (same layout as params, overwritten). An empty batch has loss 0
    /// and zero gradients.
    fn loss_and_grad(&self, params: &ParamBuf, batch: &[Example], grads: &mut ParamBuf) -> f32;
    /// Predicted class per example (written to `out`, replacing its contents),
    /// and the mean loss.
    fn predict(&self, params: &ParamBuf, batch: &[Example], out: &mut Vec<u32>) -> f32;
}

/// Which built-in model to use, and its shape; serialisable so a master can
/// publish it in the job's config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ModelConfig {
    /// Multinomial logistic regression.
    Softmax {
        /// Number of input features.
        features: usize,
        /// Number of classes (2 for binary classification).
        classes: usize,
    },
    /// One hidden ReLU layer, then softmax.
    Mlp {
        /// Number of input features.
        features: usize,
        /// Width of the hidden layer.
        hidden: usize,
        /// Number of classes (2 for binary classification).
        classes: usize,
    },
}

impl ModelConfig {
    /// Builds the model after checking that every size is positive, there are
    /// at least 2 classes and the parameter sizes fit in memory arithmetic.
    pub fn build(&self) -> Result<Box<dyn Model>> {
        Ok(match *self {
            ModelConfig::Softmax { features, classes } => {
                Box::new(SoftmaxRegression::new(features, classes)?)
            }
            ModelConfig::Mlp { features, hidden, classes } => Box::new(Mlp::new(features, hidden, classes)?),
        })
    }
}

/// Checks a layer size for `ModelConfig::build` and the model constructors.
pub(crate) fn check_size(what: &str, value: usize, min: usize) -> Result<()> {
    if value < min {
        return Err(Error::BadConfig(format!("{what} must be at least {min}, got {value}")));
    }
    Ok(())
}

/// Checks that a `rows x cols` matrix has a representable element count.
pub(crate) fn check_product(what: &str, rows: usize, cols: usize) -> Result<()> {
    match rows.checked_mul(cols) {
        Some(n) if n <= isize::MAX as usize / std::mem::size_of::<f32>() => Ok(()),
        _ => Err(Error::BadConfig(format!("{what} of {rows} x {cols} elements is too large"))),
    }
}

/// Row-major dense `batch.len() x features` matrix of the examples.
pub(crate) fn dense_batch(batch: &[Example], features: usize) -> Vec<f32> {
    let mut x = vec![0.0f32; batch.len() * features];
    for (row, ex) in x.chunks_exact_mut(features).zip(batch) {
        for &(i, v) in &ex.features {
            if let Some(slot) = row.get_mut(i as usize) {
                *slot += v;
            }
        }
    }
    x
}

/// A row-major matrix operand of [`gemm`], optionally transposed.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    /// Elements, row-major as stored.
    pub data: &'a [f32],
    /// Rows as stored.
    pub rows: usize,
    /// Columns as stored.
    pub cols: usize,
    /// Use the transpose of the stored matrix.
    pub t: bool,
}

impl<'a> Mat<'a> {
    pub(crate) fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat { data, rows, cols, t: false }
    }
    pub(crate) fn t(self) -> Self {
        Mat { t: !self.t, ..self }
    }
    /// (rows, cols, row stride, col stride) of the logical matrix.
    fn logical(&self) -> (usize, usize, isize, isize) {
        let (rs, cs) = (self.cols as isize, 1isize);
        if self.t {
            (self.cols, self.rows, cs, rs)
        } else {
            (self.rows, self.cols, rs, cs)
        }
    }
}

/// `C <- A·B + beta·C` with `C` row-major `m x n`, through `matrixmultiply::sgemm`.
///
/// Panics if the shapes disagree (our own bookkeeping, never input data).
pub(crate) fn gemm(a: Mat<'_>, b: Mat<'_>, beta: f32, c: &mut [f32]) {
    let (m, k, rsa, csa) = a.logical();
    let (k2, n, rsb, csb) = b.logical();
    assert_eq!(k, k2, "gemm inner dimensions differ");
    assert_eq!(a.data.len(), a.rows * a.cols, "gemm: A has the wrong length");
    assert_eq!(b.data.len(), b.rows * b.cols, "gemm: B has the wrong length");
    assert_eq!(c.len(), m * n, "gemm: C has the wrong length");
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the asserts above guarantee every index the strides reach lies in
    // the slices (A is m x k, B is k x n, C is m x n, all dense); C is a unique
    // borrow with non-zero strides, so its elements do not alias each other or
    // the inputs.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            rsa,
            csa,
            b.data.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Adds `bias` to every row of the row-major matrix `z`.
pub(crate) fn add_bias(z: &mut [f32], bias: &[f32]) {
    if bias.is_empty() {
        return;
    }
    for row in z.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// Column sums of the row-major matrix `m` (width `out.len()`) into `out`.
pub(crate) fn column_sums(m: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    if out.is_empty() {
        return;
    }
    let width = out.len();
    for row in m.chunks_exact(width) {
        for (o, v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
}

/// Index of the largest value (the first one on ties).
pub(crate) fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Softmax cross-entropy over the logits `z` (`batch.len() x classes`).
///
/// Returns the mean loss. If `grad` is set, `z` is overwritten with
/// `dLoss/dz = (softmax(z) - onehot(label)) / batch.len()`; if `preds` is given,
/// the argmax of each row is pushed to it. Each row's loss is
/// `logsumexp(z) - z[label]`, computed with the row maximum subtracted.
pub(crate) fn softmax_xent(
    z: &mut [f32],
    batch: &[Example],
    classes: usize,
    grad: bool,
    mut preds: Option<&mut Vec<u32>>,
) -> f32 {
    if batch.is_empty() || classes == 0 {
        return 0.0;
    }
    let inv_b = 1.0 / batch.len() as f32;
    let mut total = 0.0f64;
    for (row, ex) in z.chunks_exact_mut(classes).zip(batch) {
        let best = argmax(row);
        if let Some(p) = preds.as_deref_mut() {
            p.push(best as u32);
        }
        let max = row[best];
        let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
        let lse = max + sum.ln();
        let label = ex.label as usize;
        let valid = label < classes;
        if valid {
            total += f64::from(lse - row[label]);
        }
        if grad {
            if valid {
                for v in row.iter_mut() {
                    *v = (*v - lse).exp() * inv_b;
                }
                row[label] -= inv_b;
            } else {
                row.fill(0.0);
            }
        }
    }
    (total / batch.len() as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_matches_naive_with_transposes() {
        // A is 2x3, B is 3x2 as stored.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
        let mut c = [0.0; 4];
        gemm(Mat::new(&a, 2, 3), Mat::new(&b, 3, 2), 0.0, &mut c);
        assert_eq!(c, [58.0, 64.0, 139.0, 154.0]);
        // Aᵀ (3x2) · A (2x3) = 3x3
        let mut d = [0.0; 9];
        gemm(Mat::new(&a, 2, 3).t(), Mat::new(&a, 2, 3), 0.0, &mut d);
        assert_eq!(d, [17.0, 22.0, 27.0, 22.0, 29.0, 36.0, 27.0, 36.0, 45.0]);
        // A · Aᵀ (2x2), accumulated onto ones with beta = 1.
        let mut e = [1.0; 4];
        gemm(Mat::new(&a, 2, 3), Mat::new(&a, 2, 3).t(), 1.0, &mut e);
        assert_eq!(e, [15.0, 33.0, 33.0, 78.0]);
    }

    #[test]
    fn dense_batch_ignores_out_of_range_and_sums_repeats() {
        let batch = [
            Example { label: 0, features: vec![(0, 1.0), (2, 2.0), (2, 0.5), (9, 4.0)] },
            Example { label: 1, features: vec![(1, -1.0)] },
        ];
        assert_eq!(dense_batch(&batch, 3), vec![1.0, 0.0, 2.5, 0.0, -1.0, 0.0]);
    }

    #[test]
    fn softmax_xent_is_stable_for_huge_logits() {
        let batch = [Example { label: 0, features: vec![] }];
        let mut z = [1000.0f32, 0.0];
        let loss = softmax_xent(&mut z, &batch, 2, true, None);
        assert!(loss.abs() < 1e-6, "loss {loss}");
        assert!(z[0].abs() < 1e-6 && z[1].abs() < 1e-6, "{z:?}");
        let mut z = [0.0f32, 1000.0];
        let loss = softmax_xent(&mut z, &batch, 2, true, None);
        assert!((loss - 1000.0).abs() < 1e-3, "loss {loss}");
        assert!((z[0] + 1.0).abs() < 1e-6 && (z[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn build_validates_sizes() {
        let bad = [
            ModelConfig::Softmax { features: 0, classes: 2 },
            ModelConfig::Softmax { features: 3, classes: 1 },
            ModelConfig::Mlp { features: 3, hidden: 0, classes: 2 },
            ModelConfig::Softmax { features: usize::MAX / 2, classes: 4 },
        ];
        for cfg in bad {
            let err = cfg.build().err().expect("should be rejected");
            assert!(matches!(err, Error::BadConfig(_)), "{err}");
        }
        let m = ModelConfig::Mlp { features: 4, hidden: 5, classes: 3 }.build().unwrap();
        assert_eq!((m.features(), m.classes()), (4, 3));
        let shapes: Vec<_> = m.param_specs().into_iter().map(|s| s.shape).collect();
        assert_eq!(shapes, vec![vec![4, 5], vec![5], vec![5, 3], vec![3]]);
    }
}
