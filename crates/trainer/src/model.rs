//! The [`Model`] trait and the [`Example`] type: what a user implements to
//! train a model of their own (the built-in ones are named by
//! [`ModelConfig`](crate::ModelConfig)).

use oar_pserver::{ParamBuf, ParamSpec};

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
