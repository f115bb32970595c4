//! A multi-layer perceptron with one hidden ReLU layer:
//! `p = softmax(relu(x·W1 + b1)·W2 + b2)`.

use oar_pserver::{Init, ParamBuf, ParamSpec};

use crate::math::{add_bias, check_product, check_size, column_sums, dense_batch, gemm, softmax_xent, Mat};
use crate::model::{Example, Model};
use crate::Result;

/// One-hidden-layer MLP with parameters `"w1"` `[features, hidden]`, `"b1"`
/// `[hidden]`, `"w2"` `[hidden, classes]`, `"b2"` `[classes]`.
///
/// Weights use He initialisation (normal, mean 0, std `sqrt(2 / fan_in)`),
/// which suits ReLU; biases start at zero.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mlp {
    features: usize,
    hidden: usize,
    classes: usize,
}

/// Activations of one forward pass.
struct Forward {
    /// Dense input, `b x features`.
    x: Vec<f32>,
    /// Hidden activations after ReLU, `b x hidden`.
    h: Vec<f32>,
    /// Logits, `b x classes`.
    z: Vec<f32>,
}

impl Mlp {
    /// A model for `features` inputs, `hidden` hidden units and `classes >= 2` classes.
    pub fn new(features: usize, hidden: usize, classes: usize) -> Result<Self> {
        check_size("features", features, 1)?;
        check_size("hidden", hidden, 1)?;
        check_size("classes", classes, 2)?;
        check_product("w1", features, hidden)?;
        check_product("w2", hidden, classes)?;
        Ok(Mlp { features, hidden, classes })
    }

    fn forward(&self, params: &ParamBuf, batch: &[Example]) -> Forward {
        let (f, hd, c, b) = (self.features, self.hidden, self.classes, batch.len());
        let x = dense_batch(batch, f);
        let mut h = vec![0.0f32; b * hd];
        gemm(Mat::new(&x, b, f), Mat::new(params.param(0), f, hd), 0.0, &mut h);
        add_bias(&mut h, params.param(1));
        for v in &mut h {
            *v = v.max(0.0);
        }
        let mut z = vec![0.0f32; b * c];
        gemm(Mat::new(&h, b, hd), Mat::new(params.param(2), hd, c), 0.0, &mut z);
        add_bias(&mut z, params.param(3));
        Forward { x, h, z }
    }
}

impl Model for Mlp {
    fn param_specs(&self) -> Vec<ParamSpec> {
        let normal = |fan_in: usize| Init::Normal { mean: 0.0, std: (2.0 / fan_in as f32).sqrt() };
        vec![
            ParamSpec {
                name: "w1".into(),
                shape: vec![self.features, self.hidden],
                init: normal(self.features),
            },
            ParamSpec { name: "b1".into(), shape: vec![self.hidden], init: Init::Zeros },
            ParamSpec {
                name: "w2".into(),
                shape: vec![self.hidden, self.classes],
                init: normal(self.hidden),
            },
            ParamSpec { name: "b2".into(), shape: vec![self.classes], init: Init::Zeros },
        ]
    }

    fn features(&self) -> usize {
        self.features
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn loss_and_grad(&self, params: &ParamBuf, batch: &[Example], grads: &mut ParamBuf) -> f32 {
        let (f, hd, c, b) = (self.features, self.hidden, self.classes, batch.len());
        let Forward { x, h, mut z } = self.forward(params, batch);
        let loss = softmax_xent(&mut z, batch, c, true, None);
        let dz = z;
        let (gw1, rest) = grads.as_mut_slice().split_at_mut(f * hd);
        let (gb1, rest) = rest.split_at_mut(hd);
        let (gw2, rest) = rest.split_at_mut(hd * c);
        let gb2 = &mut rest[..c];
        // Output layer: dW2 = Hᵀ·dZ, db2 = column sums of dZ.
        gemm(Mat::new(&h, b, hd).t(), Mat::new(&dz, b, c), 0.0, gw2);
        column_sums(&dz, gb2);
        // Back through W2 and the ReLU: dH = (dZ·W2ᵀ) ⊙ [H > 0].
        let mut dh = vec![0.0f32; b * hd];
        gemm(Mat::new(&dz, b, c), Mat::new(params.param(2), hd, c).t(), 0.0, &mut dh);
        for (d, &a) in dh.iter_mut().zip(&h) {
            if a <= 0.0 {
                *d = 0.0;
            }
        }
        // Hidden layer: dW1 = Xᵀ·dH, db1 = column sums of dH.
        gemm(Mat::new(&x, b, f).t(), Mat::new(&dh, b, hd), 0.0, gw1);
        column_sums(&dh, gb1);
        loss
    }

    fn predict(&self, params: &ParamBuf, batch: &[Example], out: &mut Vec<u32>) -> f32 {
        out.clear();
        let mut fw = self.forward(params, batch);
        softmax_xent(&mut fw.z, batch, self.classes, false, Some(out))
    }
}
