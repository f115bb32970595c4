//! [`ModelConfig`]: which built-in model a job trains, and its shape.

use serde::{Deserialize, Serialize};

use crate::any_model::AnyModel;
use crate::ctr::CtrModelConfig;
use crate::mlp::Mlp;
use crate::model::Model;
use crate::softmax::SoftmaxRegression;
use crate::{Error, Result};

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
    /// A click-through-rate model over sparse tables (binary labels; ids
    /// are open-ended, so no feature count).
    Ctr(CtrModelConfig),
}

impl ModelConfig {
    /// Builds the model after checking that every size is positive, there are
    /// at least 2 classes and the parameter sizes fit in memory arithmetic.
    /// A sparse model ([`ModelConfig::Ctr`]) is not a [`Model`]: it is an
    /// error here, and built by [`build_any`](Self::build_any).
    pub fn build(&self) -> Result<Box<dyn Model>> {
        Ok(match *self {
            ModelConfig::Softmax { features, classes } => {
                Box::new(SoftmaxRegression::new(features, classes)?)
            }
            ModelConfig::Mlp { features, hidden, classes } => Box::new(Mlp::new(features, hidden, classes)?),
            ModelConfig::Ctr(ctr) => {
                return Err(Error::BadConfig(format!(
                    "the {} CTR model is a sparse model: build it with ModelConfig::build_any",
                    ctr.name()
                )))
            }
        })
    }

    /// Builds the model of either kind, after the same checks as
    /// [`build`](Self::build) (and [`CtrModelConfig::validate`]).
    pub fn build_any(&self) -> Result<AnyModel> {
        Ok(match self {
            ModelConfig::Ctr(ctr) => AnyModel::Sparse(ctr.build()?.into()),
            _ => AnyModel::Dense(self.build()?.into()),
        })
    }

    /// Number of input features of a dense model; 0 for a sparse one (its
    /// ids are open-ended).
    pub fn features(&self) -> usize {
        match *self {
            ModelConfig::Softmax { features, .. } | ModelConfig::Mlp { features, .. } => features,
            ModelConfig::Ctr(_) => 0,
        }
    }

    /// Number of classes (2 for the CTR models).
    pub fn classes(&self) -> usize {
        match *self {
            ModelConfig::Softmax { classes, .. } | ModelConfig::Mlp { classes, .. } => classes,
            ModelConfig::Ctr(_) => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

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
