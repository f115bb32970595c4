//! The dense-batch, matrix-product and softmax cross-entropy helpers the
//! built-in models share.

use crate::model::Example;
use crate::{Error, Result};

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
}
