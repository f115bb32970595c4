//! Softmax (multinomial logistic) regression: `p = softmax(x·W + b)`.

use oar_pserver::{Init, ParamBuf, ParamSpec};

use crate::math::{add_bias, check_product, check_size, column_sums, dense_batch, gemm, softmax_xent, Mat};
use crate::model::{Example, Model};
use crate::Result;

/// Softmax regression with parameters `"weights"` `[features, classes]` and
/// `"bias"` `[classes]`, both initialised to zero (the loss is convex, so zero
/// is as good a start as any and keeps runs reproducible).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftmaxRegression {
    features: usize,
    classes: usize,
}

impl SoftmaxRegression {
    /// A model for `features` inputs and `classes >= 2` classes.
    pub fn new(features: usize, classes: usize) -> Result<Self> {
        check_size("features", features, 1)?;
        check_size("classes", classes, 2)?;
        check_product("weights", features, classes)?;
        Ok(SoftmaxRegression { features, classes })
    }

    /// Logits `x·W + b` (`batch.len() x classes`) and the dense batch.
    fn forward(&self, params: &ParamBuf, batch: &[Example]) -> (Vec<f32>, Vec<f32>) {
        let (f, c, b) = (self.features, self.classes, batch.len());
        let x = dense_batch(batch, f);
        let mut z = vec![0.0f32; b * c];
        gemm(Mat::new(&x, b, f), Mat::new(params.param(0), f, c), 0.0, &mut z);
        add_bias(&mut z, params.param(1));
        (x, z)
    }
}

impl Model for SoftmaxRegression {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec { name: "weights".into(), shape: vec![self.features, self.classes], init: Init::Zeros },
            ParamSpec { name: "bias".into(), shape: vec![self.classes], init: Init::Zeros },
        ]
    }

    fn features(&self) -> usize {
        self.features
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn loss_and_grad(&self, params: &ParamBuf, batch: &[Example], grads: &mut ParamBuf) -> f32 {
        let (f, c, b) = (self.features, self.classes, batch.len());
        let (x, mut dz) = self.forward(params, batch);
        let loss = softmax_xent(&mut dz, batch, c, true, None);
        let (gw, rest) = grads.as_mut_slice().split_at_mut(f * c);
        let gb = &mut rest[..c];
        // dW = Xᵀ·dZ, db = column sums of dZ (dZ already holds the 1/b of the mean).
        gemm(Mat::new(&x, b, f).t(), Mat::new(&dz, b, c), 0.0, gw);
        column_sums(&dz, gb);
        loss
    }

    fn predict(&self, params: &ParamBuf, batch: &[Example], out: &mut Vec<u32>) -> f32 {
        out.clear();
        let (_, mut z) = self.forward(params, batch);
        softmax_xent(&mut z, batch, self.classes, false, Some(out))
    }
}
