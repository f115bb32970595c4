//! Update rules run on the pservers: the [`Optimizer`] trait and the built-in
//! SGD, momentum, AdaGrad and Adam.
//!
//! [`Optimizer`] is the plug-in point: a user's rule implements `apply`.
//! The built-ins share one structure instead: each is a `Kernel`, an
//! element-wise update with per-step constants (Adam's bias corrections)
//! computed once per apply, and one driver (`apply_kernel`) runs every
//! kernel's loop over (parameter, gradient, slots). The driver's loops are
//! written over plain slices with `zip`, without indexing, so the compiler
//! vectorises them (packed SSE in the portable build). On the 2-core
//! development machine the built-ins run at 1.0-1.7x the bytes per second of
//! a plain `a = b + s*c` pass over the same memory, AdaGrad lowest (its
//! square root and division, at 4 SSE lanes, limit it before memory does);
//! see `bench/src/bin/bench_optimizer.rs`.
//!
//! Every rule runs on the calling thread: a pserver's other core is busy
//! receiving gradients while it applies them (BENCHMARKS.md, "Optimizer
//! apply").
//!
//! **Large gradients.** A store takes any finite gradient. AdaGrad's sum of
//! squared gradients and Adam's second moment saturate at `f32::MAX`: the
//! square of a finite gradient past about 1.8e19 is infinite in `f32`, and
//! an infinite slot would stay infinite for good (Adam's decay of `inf` is
//! `inf`) while making each later update of the element 0 or NaN. Saturated,
//! the state stays finite and the update of that element is about 0 until
//! the term comes down. Nothing else is clamped: parameters, momentum and
//! Adam's first moment move by what the rule computes, so a model that
//! truly diverges (SGD with a huge rate, say) holds infinities or NaN, and
//! checkpoints and catch-ups carry those values as they are (see the
//! checkpoint codec), rather than refusing the shard's state.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Per-block optimizer state: the number of updates applied and the
/// optimizer's slot arrays (checkpointed with the parameters).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    /// Updates applied to this block so far.
    pub step: u64,
    /// `state_slots() * len` values; slot `k` is `slots[k * len .. (k + 1) * len]`.
    pub slots: Vec<f32>,
}

/// An update rule. The user's own rule implements this and runs on the pservers.
pub trait Optimizer: Send + Sync + 'static {
    /// Short name, for logs and checkpoints.
    fn name(&self) -> &str;

    /// Number of per-element state arrays (0 for SGD, 2 for Adam).
    fn state_slots(&self) -> usize;

    /// Apply one update: `params -= f(grad, state)`. Called once per combined
    /// gradient; increments `state.step`.
    ///
    /// The store guarantees `grad.len() == params.len()` and
    /// `state.slots.len() == state_slots() * params.len()`; the built-in rules
    /// update only the common prefix if that is ever broken, and never panic.
    /// (A rule that panics stops the pserver: see the `service` module.)
    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState);

    /// One row's update (a sparse table's row, see [`crate::sparse`]): like
    /// [`apply`](Self::apply), with the state as a step counter and slot
    /// slices (slot `k` of the row at `slots[k * params.len()..]`), because a
    /// table keeps each row's state inline with its values rather than as an
    /// [`OptimizerState`]. Each row counts its own `step`, so Adam's bias
    /// correction is per row ("lazy Adam").
    ///
    /// The default builds an [`OptimizerState`], calls `apply` and copies the
    /// state back (an allocation per row), so a user's rule that implements
    /// only `apply` works on rows too; the built-ins override it to run on
    /// the slices directly, with the same bits as `apply`.
    fn apply_row(&self, params: &mut [f32], grad: &[f32], step: &mut u64, slots: &mut [f32]) {
        let mut state = OptimizerState { step: *step, slots: slots.to_vec() };
        self.apply(params, grad, &mut state);
        *step = state.step;
        let n = slots.len().min(state.slots.len());
        slots[..n].copy_from_slice(&state.slots[..n]);
    }

    /// Fresh state for a block of `len` elements: step 0, all slots zero.
    fn new_state(&self, len: usize) -> OptimizerState {
        OptimizerState { step: 0, slots: vec![0.0; self.state_slots().saturating_mul(len)] }
    }
}

/// The most slot arrays a built-in rule has (Adam's two).
const MAX_SLOTS: usize = 2;

/// A built-in rule as one element-wise update. [`apply_kernel`] computes
/// the step's constants once and runs [`element`](Self::element) over every
/// (parameter, gradient, slot values) of the block.
trait Kernel {
    /// Per-element state arrays, at most [`MAX_SLOTS`].
    const SLOTS: usize;
    /// What the update needs that does not change within an apply.
    type Step: Copy;

    /// The constants of update `t` (1-based).
    fn step(&self, t: u64) -> Self::Step;

    /// Update one element. `slots[..SLOTS]` are its slot values, read
    /// before and written back after; the rest are unused.
    fn element(k: Self::Step, p: &mut f32, g: f32, slots: &mut [f32; MAX_SLOTS]);
}

/// The built-in rules' [`Optimizer::apply`]: `K`'s update over the common
/// prefix of `params`, `grad` and each slot array (slot `k` is
/// `slots[k * len..]`, cut to `len` and to what exists), then the step
/// counted. [`Optimizer::apply`] passes its [`OptimizerState`]'s fields,
/// [`Optimizer::apply_row`] a table row's slices: one loop for both.
///
/// Two slots go in runs of [`RUN`] elements, each run of both slots read
/// into locals before either is written back. Why: the two slots are one
/// array split in halves, so slot 0 and slot 1 of an element are `len`
/// floats apart, often a multiple of 4 KiB (a 64 Ki-float block, or 64 Mi),
/// and a load of slot 1 issued after the store to slot 0 then looks to the
/// CPU like it may depend on it (4K aliasing). Element by element Adam ran
/// 4x slower on this project's AMD EPYC machine (7 GB/s instead of 20-30).
/// The arithmetic per element is the same either way.
fn apply_kernel<K: Kernel>(rule: &K, params: &mut [f32], grad: &[f32], step: &mut u64, slots: &mut [f32]) {
    let t = step.saturating_add(1);
    let k = rule.step(t);
    let len = params.len();
    let cut = len.min(slots.len());
    let (s0, rest) = slots.split_at_mut(cut);
    let cut = len.min(rest.len());
    let s1 = &mut rest[..cut];
    match K::SLOTS {
        0 => {
            for (p, &g) in params.iter_mut().zip(grad) {
                K::element(k, p, g, &mut [0.0; MAX_SLOTS]);
            }
        }
        1 => {
            for ((p, &g), s) in params.iter_mut().zip(grad).zip(s0) {
                let mut v = [*s, 0.0];
                K::element(k, p, g, &mut v);
                *s = v[0];
            }
        }
        _ => {
            let n = len.min(grad.len()).min(s0.len()).min(s1.len());
            let (params, grad, s0, s1) = (&mut params[..n], &grad[..n], &mut s0[..n], &mut s1[..n]);
            let mut p_runs = params.chunks_exact_mut(RUN);
            let mut g_runs = grad.chunks_exact(RUN);
            let mut a_runs = s0.chunks_exact_mut(RUN);
            let mut b_runs = s1.chunks_exact_mut(RUN);
            for (((p, g), a), b) in (&mut p_runs).zip(&mut g_runs).zip(&mut a_runs).zip(&mut b_runs) {
                let (mut a_run, mut b_run) = ([0f32; RUN], [0f32; RUN]);
                a_run.copy_from_slice(a);
                b_run.copy_from_slice(b);
                two_slots::<K>(k, p, g, &mut a_run, &mut b_run);
                b.copy_from_slice(&b_run);
                a.copy_from_slice(&a_run);
            }
            let (p, g) = (p_runs.into_remainder(), g_runs.remainder());
            two_slots::<K>(k, p, g, a_runs.into_remainder(), b_runs.into_remainder());
        }
    }
    *step = t;
}

/// `K`'s update over elements with two slots, element by element.
fn two_slots<K: Kernel>(k: K::Step, params: &mut [f32], grad: &[f32], s0: &mut [f32], s1: &mut [f32]) {
    for (((p, &g), a), b) in params.iter_mut().zip(grad).zip(s0).zip(s1) {
        let mut v = [*a, *b];
        K::element(k, p, g, &mut v);
        (*a, *b) = (v[0], v[1]);
    }
}

/// Elements per run of a two-slot kernel: the fastest of 8-256 measured.
const RUN: usize = 32;

/// The [`Optimizer`] of a built-in rule: its name, and its [`Kernel`] run
/// by [`apply_kernel`].
macro_rules! builtin {
    ($($rule:ty => $name:literal),* $(,)?) => {$(
        impl Optimizer for $rule {
            fn name(&self) -> &str {
                $name
            }
            fn state_slots(&self) -> usize {
                <$rule as Kernel>::SLOTS
            }
            fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
                apply_kernel(self, params, grad, &mut state.step, &mut state.slots);
            }
            fn apply_row(&self, params: &mut [f32], grad: &[f32], step: &mut u64, slots: &mut [f32]) {
                apply_kernel(self, params, grad, step, slots);
            }
        }
    )*};
}

builtin!(Sgd => "sgd", Momentum => "momentum", AdaGrad => "adagrad", Adam => "adam");

/// Plain stochastic gradient descent: `p -= lr * g`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
}

impl Kernel for Sgd {
    const SLOTS: usize = 0;
    type Step = f32;
    fn step(&self, _: u64) -> f32 {
        self.lr
    }
    fn element(lr: f32, p: &mut f32, g: f32, _: &mut [f32; MAX_SLOTS]) {
        *p -= lr * g;
    }
}

/// SGD with (heavy-ball) momentum: `v = momentum * v + g; p -= lr * v`
/// (the PyTorch formulation; slot 0 is `v`).
#[derive(Clone, Debug, PartialEq)]
pub struct Momentum {
    /// Learning rate.
    pub lr: f32,
    /// Momentum coefficient in `[0, 1)`.
    pub momentum: f32,
}

impl Kernel for Momentum {
    const SLOTS: usize = 1;
    type Step = (f32, f32);
    fn step(&self, _: u64) -> (f32, f32) {
        (self.lr, self.momentum)
    }
    fn element((lr, mu): (f32, f32), p: &mut f32, g: f32, [v, _]: &mut [f32; MAX_SLOTS]) {
        *v = mu * *v + g;
        *p -= lr * *v;
    }
}

/// AdaGrad: `h += g^2; p -= lr * g / (sqrt(h) + eps)` (slot 0 is `h`),
/// `h` saturating at `f32::MAX` (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct AdaGrad {
    /// Learning rate.
    pub lr: f32,
    /// Added to the denominator for stability.
    pub eps: f32,
}

impl Kernel for AdaGrad {
    const SLOTS: usize = 1;
    type Step = (f32, f32);
    fn step(&self, _: u64) -> (f32, f32) {
        (self.lr, self.eps)
    }
    fn element((lr, eps): (f32, f32), p: &mut f32, g: f32, [h, _]: &mut [f32; MAX_SLOTS]) {
        *h = (*h + g * g).min(f32::MAX);
        *p -= lr * g / (h.sqrt() + eps);
    }
}

/// Adam (Kingma & Ba) with bias correction. At step `t` (1-based):
/// `m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
/// p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`. Slot 0 is `m`, slot 1 is `v`,
/// which saturates at `f32::MAX` (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Adam {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first moment, in `[0, 1)`.
    pub beta1: f32,
    /// Decay of the second moment, in `[0, 1)`.
    pub beta2: f32,
    /// Added to the denominator for stability.
    pub eps: f32,
}

/// Adam's per-step constants.
#[derive(Clone, Copy)]
struct AdamStep {
    step_size: f32,
    inv_bc2: f32,
    b1: f32,
    b2: f32,
    c1: f32,
    c2: f32,
    eps: f32,
}

impl Kernel for Adam {
    const SLOTS: usize = 2;
    type Step = AdamStep;

    fn step(&self, t: u64) -> AdamStep {
        // Bias corrections in f64: b^t for large t underflows gracefully to 0.
        let t_exp = t.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - f64::from(self.beta1).powi(t_exp);
        let bc2 = 1.0 - f64::from(self.beta2).powi(t_exp);
        let (b1, b2) = (self.beta1, self.beta2);
        AdamStep {
            step_size: (f64::from(self.lr) / bc1) as f32,
            inv_bc2: (1.0 / bc2) as f32,
            b1,
            b2,
            c1: 1.0 - b1,
            c2: 1.0 - b2,
            eps: self.eps,
        }
    }

    fn element(k: AdamStep, p: &mut f32, g: f32, [m, v]: &mut [f32; MAX_SLOTS]) {
        let AdamStep { step_size, inv_bc2, b1, b2, c1, c2, eps } = k;
        *m = b1 * *m + c1 * g;
        *v = (b2 * *v + c2 * (g * g)).min(f32::MAX);
        *p -= step_size * *m / ((*v * inv_bc2).sqrt() + eps);
    }
}

/// A built-in optimizer and its hyper-parameters, as carried in a job's config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum OptimizerConfig {
    /// [`Sgd`].
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// [`Momentum`].
    Momentum {
        /// Learning rate.
        lr: f32,
        /// Momentum coefficient.
        momentum: f32,
    },
    /// [`AdaGrad`].
    AdaGrad {
        /// Learning rate.
        lr: f32,
        /// Stabiliser.
        eps: f32,
    },
    /// [`Adam`].
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Stabiliser.
        eps: f32,
    },
}

/// Names accepted by [`OptimizerConfig::parse`].
pub const OPTIMIZER_NAMES: &[&str] = &["sgd", "momentum", "adagrad", "adam"];

impl OptimizerConfig {
    /// The optimizer's name, as accepted by [`OptimizerConfig::parse`].
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sgd { .. } => "sgd",
            Self::Momentum { .. } => "momentum",
            Self::AdaGrad { .. } => "adagrad",
            Self::Adam { .. } => "adam",
        }
    }

    /// Check the hyper-parameters: `lr` finite and `> 0`, `momentum` and betas
    /// in `[0, 1)`, `eps` finite and `> 0`.
    pub fn validate(&self) -> Result<()> {
        let optimizer = self.name();
        let bad = |field, value, expected| Error::BadOptimizer { optimizer, field, value, expected };
        let lr_ok = |lr: f32| {
            if lr.is_finite() && lr > 0.0 {
                Ok(())
            } else {
                Err(bad("lr", lr, "finite and > 0"))
            }
        };
        let unit = |field, x: f32| {
            if (0.0..1.0).contains(&x) {
                Ok(())
            } else {
                Err(bad(field, x, "in [0, 1)"))
            }
        };
        let eps_ok = |eps: f32| {
            if eps.is_finite() && eps > 0.0 {
                Ok(())
            } else {
                Err(bad("eps", eps, "finite and > 0"))
            }
        };
        match *self {
            Self::Sgd { lr } => lr_ok(lr),
            Self::Momentum { lr, momentum } => lr_ok(lr).and(unit("momentum", momentum)),
            Self::AdaGrad { lr, eps } => lr_ok(lr).and(eps_ok(eps)),
            Self::Adam { lr, beta1, beta2, eps } => {
                lr_ok(lr).and(unit("beta1", beta1)).and(unit("beta2", beta2)).and(eps_ok(eps))
            }
        }
    }

    /// Validate and build the optimizer.
    pub fn build(&self) -> Result<Box<dyn Optimizer>> {
        self.validate()?;
        Ok(match *self {
            Self::Sgd { lr } => Box::new(Sgd { lr }),
            Self::Momentum { lr, momentum } => Box::new(Momentum { lr, momentum }),
            Self::AdaGrad { lr, eps } => Box::new(AdaGrad { lr, eps }),
            Self::Adam { lr, beta1, beta2, eps } => Box::new(Adam { lr, beta1, beta2, eps }),
        })
    }

    /// A config from a name (`sgd`, `momentum`, `adagrad`, `adam`; case and
    /// surrounding blanks ignored) and a learning rate, with the usual
    /// defaults: momentum 0.9; AdaGrad eps 1e-10; Adam betas 0.9 / 0.999 and
    /// eps 1e-8. Validated.
    pub fn parse(name: &str, lr: f32) -> Result<Self> {
        let cfg = match name.trim().to_ascii_lowercase().as_str() {
            "sgd" => Self::Sgd { lr },
            "momentum" => Self::Momentum { lr, momentum: 0.9 },
            "adagrad" => Self::AdaGrad { lr, eps: 1e-10 },
            "adam" => Self::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
            _ => {
                return Err(Error::UnknownOptimizer {
                    name: name.to_string(),
                    valid: OPTIMIZER_NAMES.join(", "),
                })
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            let tol = 1e-6 * y.abs().max(1.0);
            assert!((f64::from(*x) - y).abs() < tol, "{a:?} vs {b:?}");
        }
    }

    fn run(opt: &dyn Optimizer, p0: &[f32], grads: &[[f32; 2]]) -> (Vec<f32>, OptimizerState) {
        let mut p = p0.to_vec();
        let mut st = opt.new_state(p.len());
        assert_eq!(st.slots.len(), opt.state_slots() * p.len());
        for g in grads {
            opt.apply(&mut p, g, &mut st);
        }
        assert_eq!(st.step, grads.len() as u64);
        (p, st)
    }

    const G: [[f32; 2]; 3] = [[0.5, -1.0], [0.25, 2.0], [-1.0, 0.5]];

    #[test]
    fn sgd_reference() {
        let (p, st) = run(&Sgd { lr: 0.1 }, &[1.0, 2.0], &G);
        // 1 - 0.1*(0.5+0.25-1) = 1.025 ; 2 - 0.1*(-1+2+0.5) = 1.85
        close(&p, &[1.025, 1.85]);
        assert!(st.slots.is_empty());
    }

    #[test]
    fn momentum_reference() {
        let (p, st) = run(&Momentum { lr: 0.1, momentum: 0.9 }, &[1.0, 2.0], &G);
        // elem 0: v = 0.5, 0.7, -0.37 ; p = 1 - 0.05 - 0.07 + 0.037 = 0.917
        // elem 1: v = -1, 1.1, 1.49 ;  p = 2 + 0.1 - 0.11 - 0.149 = 1.841
        close(&p, &[0.917, 1.841]);
        close(&st.slots, &[-0.37, 1.49]);
    }

    #[test]
    fn adagrad_reference() {
        let opt = AdaGrad { lr: 0.1, eps: 1e-10 };
        let (p, st) = run(&opt, &[1.0, 2.0], &G[..2]);
        // elem 0: h = 0.25 -> p -= 0.1*0.5/0.5 = 0.1 ; h = 0.3125 -> p -= 0.1*0.25/sqrt(0.3125)
        let e0 = 1.0 - 0.1 - 0.1 * 0.25 / 0.3125f64.sqrt();
        // elem 1: h = 1 -> p += 0.1 ; h = 5 -> p -= 0.1*2/sqrt(5)
        let e1 = 2.0 + 0.1 - 0.1 * 2.0 / 5f64.sqrt();
        close(&p, &[e0, e1]);
        close(&st.slots, &[0.3125, 5.0]);
    }

    #[test]
    fn adam_reference_with_bias_correction() {
        let (lr, b1, b2, eps) = (0.01f64, 0.9f64, 0.999f64, 1e-8f64);
        let opt = Adam { lr: lr as f32, beta1: b1 as f32, beta2: b2 as f32, eps: eps as f32 };
        let (p, st) = run(&opt, &[1.0, 2.0], &G);
        // Reference in f64, straight from the paper.
        let mut want = [1.0f64, 2.0];
        let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
        for (t, g) in G.iter().enumerate() {
            let t = (t + 1) as i32;
            for i in 0..2 {
                let g = f64::from(g[i]);
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                let mh = m[i] / (1.0 - b1.powi(t));
                let vh = v[i] / (1.0 - b2.powi(t));
                want[i] -= lr * mh / (vh.sqrt() + eps);
            }
        }
        close(&p, &want);
        // The first Adam step moves each element by about lr, whatever the gradient's scale.
        let (p1, _) = run(&opt, &[1.0, 2.0], &G[..1]);
        close(&p1, &[1.0 - lr, 2.0 + lr]);
        close(&st.slots[..2], &m);
        close(&st.slots[2..], &v);
    }

    /// A finite gradient whose square overflows `f32` (the reviewer's
    /// `[1e20, 1.0]`, and the largest finite one): AdaGrad's and Adam's
    /// squared-gradient terms saturate at `f32::MAX`, and every parameter
    /// and slot stays finite, step after step, in blocks and rows alike.
    #[test]
    fn squared_gradient_terms_saturate_and_stay_finite() {
        let adagrad = AdaGrad { lr: 0.1, eps: 1e-10 };
        let adam = Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        for (opt, squares) in [(&adagrad as &dyn Optimizer, 0), (&adam, 1)] {
            for huge in [1e20, -3e30, f32::MAX, f32::MIN] {
                let mut p = vec![1.0, 2.0];
                let mut st = opt.new_state(2);
                let (mut row_p, mut row_step, mut row_slots) = (p.clone(), 0, st.slots.clone());
                for g in [[huge, 1.0], [huge, 1.0], [1.0, -0.5]] {
                    opt.apply(&mut p, &g, &mut st);
                    opt.apply_row(&mut row_p, &g, &mut row_step, &mut row_slots);
                    let name = opt.name();
                    assert!(p.iter().chain(&st.slots).all(|x| x.is_finite()), "{name} {huge}: {p:?} {st:?}");
                    if g[0] == huge {
                        assert_eq!(st.slots[squares * 2], f32::MAX, "{name} {huge}: saturated");
                    }
                    assert!(st.slots[squares * 2 + 1] < 3.0, "{name}: the other element's is as it was");
                    assert_eq!((&row_p, &row_slots), (&p, &st.slots), "{name}: a row as a block");
                }
            }
        }
    }

    #[test]
    fn short_state_never_panics() {
        let mut p = vec![1.0; 4];
        let mut st = OptimizerState { step: 0, slots: vec![0.0; 3] };
        Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 }.apply(&mut p, &[1.0; 4], &mut st);
        Momentum { lr: 0.1, momentum: 0.5 }.apply(&mut p, &[1.0; 4], &mut st);
        assert_eq!(st.step, 2);
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..n).map(|_| r.next_normal()).collect()
    }

    /// The built-ins' loops as they were before the shared [`Kernel`]
    /// (element by element, no runs), to check the driver gives the same
    /// bits.
    fn previous(opt: &str, p: &mut [f32], g: &[f32], st: &mut OptimizerState) {
        let n = p.len();
        match opt {
            "sgd" => {
                for (p, &g) in p.iter_mut().zip(g) {
                    *p -= 0.1 * g;
                }
            }
            "momentum" => {
                for ((p, &g), v) in p.iter_mut().zip(g).zip(&mut st.slots) {
                    *v = 0.9 * *v + g;
                    *p -= 0.1 * *v;
                }
            }
            "adagrad" => {
                for ((p, &g), h) in p.iter_mut().zip(g).zip(&mut st.slots) {
                    *h += g * g;
                    *p -= 0.1 * g / (h.sqrt() + 1e-10);
                }
            }
            _ => {
                let k = Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 }.step(st.step + 1);
                let (m, v) = st.slots.split_at_mut(n);
                for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                    *m = k.b1 * *m + k.c1 * g;
                    *v = k.b2 * *v + k.c2 * (g * g);
                    *p -= k.step_size * *m / ((*v * k.inv_bc2).sqrt() + k.eps);
                }
            }
        }
        st.step += 1;
    }

    fn builtins() -> Vec<Box<dyn Optimizer>> {
        vec![
            Box::new(Sgd { lr: 0.1 }),
            Box::new(Momentum { lr: 0.1, momentum: 0.9 }),
            Box::new(AdaGrad { lr: 0.1, eps: 1e-10 }),
            Box::new(Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 }),
        ]
    }

    #[test]
    fn the_shared_kernel_gives_the_previous_loops_bits() {
        for n in [0, 1, RUN - 1, RUN, RUN + 1, 3 * RUN + 5, 1000] {
            for opt in builtins() {
                let mut p = random(n, 1);
                // Slots as the store holds them: one array; positive, as every slot is.
                let slots: Vec<f32> = random(opt.state_slots() * n, 3).iter().map(|x| x.abs()).collect();
                let mut st = OptimizerState { step: 2, slots };
                let (mut want_p, mut want_st) = (p.clone(), st.clone());
                for step in 0..3 {
                    let g = random(n, 10 + step);
                    opt.apply(&mut p, &g, &mut st);
                    previous(opt.name(), &mut want_p, &g, &mut want_st);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p), bits(&want_p), "{} n = {n}: parameters", opt.name());
                assert_eq!(bits(&st.slots), bits(&want_st.slots), "{} n = {n}: slots", opt.name());
                assert_eq!(st.step, 5);
            }
        }
    }

    /// A user's rule that implements only `apply` (SGD with a step-scaled
    /// rate and a running sum in its one slot).
    struct Decaying;

    impl Optimizer for Decaying {
        fn name(&self) -> &str {
            "decaying"
        }
        fn state_slots(&self) -> usize {
            1
        }
        fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
            state.step += 1;
            let lr = 0.5 / state.step as f32;
            for ((p, &g), s) in params.iter_mut().zip(grad).zip(&mut state.slots) {
                *s += g;
                *p -= lr * g;
            }
        }
    }

    #[test]
    fn apply_row_gives_the_bits_of_apply() {
        for n in [0, 1, RUN - 1, RUN + 1, 3 * RUN + 5, 200] {
            let user: Box<dyn Optimizer> = Box::new(Decaying);
            for opt in builtins().into_iter().chain([user]) {
                let mut p = random(n, 1);
                let slots: Vec<f32> = random(opt.state_slots() * n, 3).iter().map(|x| x.abs()).collect();
                let mut st = OptimizerState { step: 2, slots };
                let (mut row_p, mut row_step, mut row_slots) = (p.clone(), st.step, st.slots.clone());
                for step in 0..3 {
                    let g = random(n, 10 + step);
                    opt.apply(&mut p, &g, &mut st);
                    opt.apply_row(&mut row_p, &g, &mut row_step, &mut row_slots);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p), bits(&row_p), "{} n = {n}: parameters", opt.name());
                assert_eq!(bits(&st.slots), bits(&row_slots), "{} n = {n}: slots", opt.name());
                assert_eq!((st.step, row_step), (5, 5), "{}", opt.name());
            }
        }
    }

    #[test]
    fn short_state_updates_the_common_prefix() {
        let g = random(100, 4);
        for opt in builtins() {
            let slots = opt.state_slots();
            // Adam's second slot cut short: only the elements with both slots move.
            let short = (slots * 100).saturating_sub(40);
            let mut p = random(100, 5);
            let before = p.clone();
            let mut st = OptimizerState { step: 0, slots: vec![0.5; short] };
            opt.apply(&mut p, &g[..90], &mut st);
            let moved = if slots == 0 { 90 } else { 60 };
            assert!(p[..moved].iter().zip(&before).all(|(a, b)| a != b), "{}", opt.name());
            assert_eq!(&p[moved..], &before[moved..], "{}", opt.name());
            assert_eq!(st.step, 1);
        }
    }

    #[test]
    fn config_parse_build_validate() {
        assert_eq!(OptimizerConfig::parse("sgd", 0.1).unwrap(), OptimizerConfig::Sgd { lr: 0.1 });
        assert_eq!(
            OptimizerConfig::parse(" Momentum ", 0.1).unwrap(),
            OptimizerConfig::Momentum { lr: 0.1, momentum: 0.9 }
        );
        assert_eq!(
            OptimizerConfig::parse("adagrad", 0.1).unwrap(),
            OptimizerConfig::AdaGrad { lr: 0.1, eps: 1e-10 }
        );
        assert_eq!(
            OptimizerConfig::parse("ADAM", 0.001).unwrap(),
            OptimizerConfig::Adam { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
        );
        let err = OptimizerConfig::parse("rmsprop", 0.1).unwrap_err().to_string();
        for n in ["rmsprop", "sgd", "momentum", "adagrad", "adam"] {
            assert!(err.contains(n), "{err}");
        }
        for n in OPTIMIZER_NAMES {
            let b = OptimizerConfig::parse(n, 0.5).unwrap().build().unwrap();
            assert_eq!(b.name(), *n);
        }
        for lr in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(
                OptimizerConfig::parse("sgd", lr),
                Err(Error::BadOptimizer { field: "lr", .. })
            ));
        }
        let bad = [
            (OptimizerConfig::Momentum { lr: 0.1, momentum: 1.0 }, "momentum"),
            (OptimizerConfig::AdaGrad { lr: 0.1, eps: 0.0 }, "eps"),
            (OptimizerConfig::Adam { lr: 0.1, beta1: -0.1, beta2: 0.9, eps: 1e-8 }, "beta1"),
            (OptimizerConfig::Adam { lr: 0.1, beta1: 0.9, beta2: 1.0, eps: 1e-8 }, "beta2"),
            (OptimizerConfig::Adam { lr: 0.1, beta1: 0.9, beta2: 0.9, eps: f32::NAN }, "eps"),
        ];
        for (cfg, field) in bad {
            match cfg.build() {
                Err(Error::BadOptimizer { field: f, .. }) => assert_eq!(f, field),
                Err(e) => panic!("{cfg:?}: unexpected error {e}"),
                Ok(_) => panic!("{cfg:?}: accepted"),
            }
        }
    }
}
