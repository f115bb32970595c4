//! Update rules run on the pservers: the [`Optimizer`] trait and the built-in
//! SGD, momentum, AdaGrad and Adam.
//!
//! The loops are written over plain slices with `zip`, without indexing, so
//! the compiler vectorises them (packed SSE in the portable build); per-step
//! constants (Adam's bias corrections) are computed once outside the loop.
//! On the 2-core development machine the built-ins run at 1.0-1.7x the bytes
//! per second of a plain `a = b + s*c` pass over the same memory, AdaGrad
//! lowest (its square root and division, at 4 SSE lanes, limit it before memory
//! does); see `examples/bench_optimizer.rs`.
//!
//! [`Optimizer::apply_parallel`] splits one block across threads. It is
//! opt-in: on 64M elements it ran 1.1-1.75x faster than [`Optimizer::apply`]
//! on the 2-core machine, depending on load, and slower (0.8-0.95x) when
//! other processes held the cores.

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
    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState);

    /// Fresh state for a block of `len` elements: step 0, all slots zero.
    fn new_state(&self, len: usize) -> OptimizerState {
        OptimizerState { step: 0, slots: vec![0.0; self.state_slots().saturating_mul(len)] }
    }

    /// [`apply`](Self::apply), with the block split into up to `threads`
    /// contiguous chunks run on scoped threads (the calling thread runs one).
    /// Same results, bit for bit, and same `state.step` as `apply`.
    ///
    /// Opt-in, for a caller that knows cores are free: a split pays only for
    /// large blocks on an otherwise idle machine (chunks are at least
    /// [`MIN_SPLIT_CHUNK`] elements; smaller blocks run on the calling thread),
    /// and loses when other work holds the cores. The built-in rules split;
    /// the default (for user rules) just calls `apply`. If a thread cannot be
    /// started, its chunk runs on the calling thread.
    fn apply_parallel(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState, threads: usize) {
        let _ = threads;
        self.apply(params, grad, state);
    }
}

/// Fewest elements per chunk in [`Optimizer::apply_parallel`] (16 MiB of
/// parameters): starting a thread costs tens of microseconds, and on the
/// development machine a split of 2M elements did not pay for SGD (0.9x)
/// while 64M did (1.1-1.75x, depending on load).
pub const MIN_SPLIT_CHUNK: usize = 1 << 22;

/// The built-in rules' [`Optimizer::apply_parallel`], with the smallest chunk
/// as a parameter so the tests can split small blocks.
trait SplitApply: Optimizer {
    fn apply_split(
        &self,
        params: &mut [f32],
        grad: &[f32],
        state: &mut OptimizerState,
        threads: usize,
        min_chunk: usize,
    );
}

/// Run `kernel` over `p`, `g` and the `K` slot arrays, all cut to their
/// common length, split into up to `threads` chunks of at least `min_chunk`
/// elements on scoped threads. Chunks are multiples of 16 elements (whole
/// cache lines) except the last.
fn run_split<const K: usize, F>(
    threads: usize,
    min_chunk: usize,
    p: &mut [f32],
    g: &[f32],
    slots: [&mut [f32]; K],
    kernel: F,
) where
    F: Fn(&mut [f32], &[f32], [&mut [f32]; K]) + Sync,
{
    let n = slots.iter().map(|s| s.len()).fold(p.len().min(g.len()), usize::min);
    let (p, g) = (&mut p[..n], &g[..n]);
    let slots = slots.map(|s| &mut s[..n]);
    let parts = threads.min(n / min_chunk.max(1)).max(1);
    if parts == 1 {
        return kernel(p, g, slots);
    }
    let chunk = n.div_ceil(parts).next_multiple_of(16);
    let mut slot_chunks = slots.map(|s| s.chunks_mut(chunk));
    let jobs: Vec<_> = p
        .chunks_mut(chunk)
        .zip(g.chunks(chunk))
        .map(|(p, g)| (p, g, slot_chunks.each_mut().map(|c| c.next().unwrap_or_default())))
        .collect();
    // A shared queue rather than one chunk per thread: if a thread cannot be
    // started, the calling thread takes its chunk.
    let queue = std::sync::Mutex::new(jobs);
    let work = || loop {
        // The lock is never held while a kernel runs, so it cannot be poisoned.
        let job = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match job {
            Some((p, g, s)) => kernel(p, g, s),
            None => break,
        }
    };
    std::thread::scope(|sc| {
        for _ in 1..parts {
            if std::thread::Builder::new().spawn_scoped(sc, work).is_err() {
                break;
            }
        }
        work();
    });
}

/// Split the state into slot 0 and slot 1 of `len` elements each (shorter if
/// the state is short).
fn two_slots(slots: &mut [f32], len: usize) -> (&mut [f32], &mut [f32]) {
    let (a, b) = slots.split_at_mut(len.min(slots.len()));
    (a, b)
}

/// Plain stochastic gradient descent: `p -= lr * g`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
}

impl Optimizer for Sgd {
    fn name(&self) -> &str {
        "sgd"
    }
    fn state_slots(&self) -> usize {
        0
    }
    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
        sgd_kernel(self.lr, params, grad);
        state.step += 1;
    }
    fn apply_parallel(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState, threads: usize) {
        self.apply_split(params, grad, state, threads, MIN_SPLIT_CHUNK);
    }
}

impl SplitApply for Sgd {
    fn apply_split(
        &self,
        params: &mut [f32],
        grad: &[f32],
        state: &mut OptimizerState,
        threads: usize,
        min_chunk: usize,
    ) {
        let lr = self.lr;
        run_split(threads, min_chunk, params, grad, [], |p, g, []| sgd_kernel(lr, p, g));
        state.step += 1;
    }
}

fn sgd_kernel(lr: f32, params: &mut [f32], grad: &[f32]) {
    for (p, &g) in params.iter_mut().zip(grad) {
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

impl Optimizer for Momentum {
    fn name(&self) -> &str {
        "momentum"
    }
    fn state_slots(&self) -> usize {
        1
    }
    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
        momentum_kernel(self.lr, self.momentum, params, grad, &mut state.slots);
        state.step += 1;
    }
    fn apply_parallel(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState, threads: usize) {
        self.apply_split(params, grad, state, threads, MIN_SPLIT_CHUNK);
    }
}

impl SplitApply for Momentum {
    fn apply_split(
        &self,
        params: &mut [f32],
        grad: &[f32],
        state: &mut OptimizerState,
        threads: usize,
        min_chunk: usize,
    ) {
        let (lr, mu) = (self.lr, self.momentum);
        run_split(threads, min_chunk, params, grad, [&mut state.slots[..]], |p, g, [v]| {
            momentum_kernel(lr, mu, p, g, v)
        });
        state.step += 1;
    }
}

fn momentum_kernel(lr: f32, mu: f32, params: &mut [f32], grad: &[f32], vel: &mut [f32]) {
    for ((p, &g), v) in params.iter_mut().zip(grad).zip(vel) {
        *v = mu * *v + g;
        *p -= lr * *v;
    }
}

/// AdaGrad: `h += g^2; p -= lr * g / (sqrt(h) + eps)` (slot 0 is `h`).
#[derive(Clone, Debug, PartialEq)]
pub struct AdaGrad {
    /// Learning rate.
    pub lr: f32,
    /// Added to the denominator for stability.
    pub eps: f32,
}

impl Optimizer for AdaGrad {
    fn name(&self) -> &str {
        "adagrad"
    }
    fn state_slots(&self) -> usize {
        1
    }
    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
        adagrad_kernel(self.lr, self.eps, params, grad, &mut state.slots);
        state.step += 1;
    }
    fn apply_parallel(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState, threads: usize) {
        self.apply_split(params, grad, state, threads, MIN_SPLIT_CHUNK);
    }
}

impl SplitApply for AdaGrad {
    fn apply_split(
        &self,
        params: &mut [f32],
        grad: &[f32],
        state: &mut OptimizerState,
        threads: usize,
        min_chunk: usize,
    ) {
        let (lr, eps) = (self.lr, self.eps);
        run_split(threads, min_chunk, params, grad, [&mut state.slots[..]], |p, g, [h]| {
            adagrad_kernel(lr, eps, p, g, h)
        });
        state.step += 1;
    }
}

fn adagrad_kernel(lr: f32, eps: f32, params: &mut [f32], grad: &[f32], hist: &mut [f32]) {
    for ((p, &g), h) in params.iter_mut().zip(grad).zip(hist) {
        *h += g * g;
        *p -= lr * g / (h.sqrt() + eps);
    }
}

/// Adam (Kingma & Ba) with bias correction. At step `t` (1-based):
/// `m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
/// p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`. Slot 0 is `m`, slot 1 is `v`.
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

impl Optimizer for Adam {
    fn name(&self) -> &str {
        "adam"
    }
    fn state_slots(&self) -> usize {
        2
    }
    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
        let t = state.step.saturating_add(1);
        let k = AdamStep::new(self, t);
        let (m, v) = two_slots(&mut state.slots, params.len());
        k.kernel(params, grad, m, v);
        state.step = t;
    }
    fn apply_parallel(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState, threads: usize) {
        self.apply_split(params, grad, state, threads, MIN_SPLIT_CHUNK);
    }
}

impl SplitApply for Adam {
    fn apply_split(
        &self,
        params: &mut [f32],
        grad: &[f32],
        state: &mut OptimizerState,
        threads: usize,
        min_chunk: usize,
    ) {
        let t = state.step.saturating_add(1);
        let k = AdamStep::new(self, t);
        let (m, v) = two_slots(&mut state.slots, params.len());
        run_split(threads, min_chunk, params, grad, [m, v], |p, g, [m, v]| k.kernel(p, g, m, v));
        state.step = t;
    }
}

/// Adam's per-step constants, computed once per apply.
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

impl AdamStep {
    /// The constants for step `t` (1-based).
    fn new(adam: &Adam, t: u64) -> Self {
        // Bias corrections in f64: b^t for large t underflows gracefully to 0.
        let t_exp = t.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - f64::from(adam.beta1).powi(t_exp);
        let bc2 = 1.0 - f64::from(adam.beta2).powi(t_exp);
        let (b1, b2) = (adam.beta1, adam.beta2);
        AdamStep {
            step_size: (f64::from(adam.lr) / bc1) as f32,
            inv_bc2: (1.0 / bc2) as f32,
            b1,
            b2,
            c1: 1.0 - b1,
            c2: 1.0 - b2,
            eps: adam.eps,
        }
    }

    /// Runs in runs of [`ADAM_RUN`] elements, reading a run of `m` and `v`
    /// into locals before writing either back. Why: the two slots are one
    /// array split in halves, so `m[i]` and `v[i]` are `len` floats apart,
    /// often a multiple of 4 KiB (a 64 Ki-float block, or 64 Mi), and a
    /// load of `v[i]` issued after the store to `m[i]` then looks to the
    /// CPU like it may depend on it (4K aliasing). Element by element that
    /// ran 4x slower on this project's AMD EPYC machine (7 GB/s instead of
    /// 20-30). The arithmetic per element is unchanged.
    fn kernel(&self, params: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
        let n = params.len().min(grad.len()).min(m.len()).min(v.len());
        let (params, grad, m, v) = (&mut params[..n], &grad[..n], &mut m[..n], &mut v[..n]);
        let mut p_runs = params.chunks_exact_mut(ADAM_RUN);
        let mut g_runs = grad.chunks_exact(ADAM_RUN);
        let mut m_runs = m.chunks_exact_mut(ADAM_RUN);
        let mut v_runs = v.chunks_exact_mut(ADAM_RUN);
        for (((p, g), m), v) in (&mut p_runs).zip(&mut g_runs).zip(&mut m_runs).zip(&mut v_runs) {
            let (mut m_run, mut v_run) = ([0f32; ADAM_RUN], [0f32; ADAM_RUN]);
            m_run.copy_from_slice(m);
            v_run.copy_from_slice(v);
            self.elements(p, g, &mut m_run, &mut v_run);
            v.copy_from_slice(&v_run);
            m.copy_from_slice(&m_run);
        }
        let (p, g) = (p_runs.into_remainder(), g_runs.remainder());
        self.elements(p, g, m_runs.into_remainder(), v_runs.into_remainder());
    }

    fn elements(&self, params: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
        let AdamStep { step_size, inv_bc2, b1, b2, c1, c2, eps } = *self;
        for (((p, &g), m), v) in params.iter_mut().zip(grad).zip(m).zip(v) {
            *m = b1 * *m + c1 * g;
            *v = b2 * *v + c2 * (g * g);
            *p -= step_size * *m / ((*v * inv_bc2).sqrt() + eps);
        }
    }
}

/// Elements per run of Adam's kernel: the fastest of 8-256 measured.
const ADAM_RUN: usize = 32;

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

    fn builtins() -> Vec<Box<dyn SplitApply>> {
        vec![
            Box::new(Sgd { lr: 0.1 }),
            Box::new(Momentum { lr: 0.1, momentum: 0.9 }),
            Box::new(AdaGrad { lr: 0.1, eps: 1e-10 }),
            Box::new(Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 }),
        ]
    }

    /// Smallest chunk in the split tests, so they run on small blocks.
    const CHUNK: usize = 1000;

    #[test]
    fn adam_runs_match_element_by_element_bit_for_bit() {
        let opt = Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        let step = AdamStep::new(&opt, 3);
        for n in [0, 1, ADAM_RUN - 1, ADAM_RUN, ADAM_RUN + 1, 3 * ADAM_RUN + 5, 1000] {
            let (p0, g) = (random(n, 1), random(n, 2));
            // Slots as the store holds them: one array, m then v.
            let slots0: Vec<f32> = random(2 * n, 3).iter().map(|x| x.abs()).collect();
            let (mut p, mut slots) = (p0.clone(), slots0.clone());
            let (m, v) = two_slots(&mut slots, n);
            step.kernel(&mut p, &g, m, v);
            let (mut want_p, mut want_slots) = (p0, slots0);
            let (m, v) = two_slots(&mut want_slots, n);
            step.elements(&mut want_p, &g, m, v);
            assert!(p == want_p && slots == want_slots, "n = {n}");
        }
    }

    #[test]
    fn parallel_apply_matches_serial_bit_for_bit() {
        // Long enough for three chunks, and not a multiple of 16.
        let n = 3 * CHUNK + 37;
        let p0 = random(n, 1);
        let grads = [random(n, 2), random(n, 3)];
        for opt in builtins() {
            let mut want = p0.clone();
            let mut want_st = opt.new_state(n);
            for g in &grads {
                opt.apply(&mut want, g, &mut want_st);
            }
            for threads in [0, 1, 2, 3, 8] {
                let mut p = p0.clone();
                let mut st = opt.new_state(n);
                for g in &grads {
                    opt.apply_split(&mut p, g, &mut st, threads, CHUNK);
                }
                assert!(p == want, "{} threads {threads}: params differ", opt.name());
                assert!(st == want_st, "{} threads {threads}: state differs", opt.name());
            }
        }
    }

    #[test]
    fn split_covers_every_element_once() {
        for n in [0, 1, 15, 16, 17, 100, 1000] {
            for threads in 1..=5 {
                let mut p = vec![0.0f32; n];
                let g: Vec<f32> = (0..n).map(|i| i as f32).collect();
                let mut s = vec![0.0f32; n + 3];
                run_split(threads, 4, &mut p, &g, [&mut s[..]], |p, g, [s]| {
                    for ((p, &g), s) in p.iter_mut().zip(g).zip(s) {
                        *p += g;
                        *s += 1.0;
                    }
                });
                assert_eq!(p, g, "n {n} threads {threads}");
                assert!(s[..n].iter().all(|&x| x == 1.0) && s[n..].iter().all(|&x| x == 0.0));
            }
        }
    }

    #[test]
    fn parallel_apply_short_state_and_user_default() {
        // A broken length contract updates the same prefix as `apply`.
        let n = 2 * CHUNK + 5;
        let g = random(n, 4);
        for opt in builtins() {
            let short = opt.state_slots() * n - opt.state_slots().min(1) * 7;
            let (mut a, mut b) = (random(n, 5), random(n, 5));
            let mut sa = OptimizerState { step: 3, slots: vec![0.5; short] };
            let mut sb = sa.clone();
            opt.apply(&mut a, &g[..n - 1], &mut sa);
            opt.apply_split(&mut b, &g[..n - 1], &mut sb, 2, CHUNK);
            assert!(a == b && sa == sb, "{}", opt.name());
        }
        // The public entry point: below the real threshold it runs on the
        // calling thread, with the same results.
        for opt in builtins() {
            let (mut a, mut b) = (random(n, 6), random(n, 6));
            let (mut sa, mut sb) = (opt.new_state(n), opt.new_state(n));
            opt.apply(&mut a, &g, &mut sa);
            opt.apply_parallel(&mut b, &g, &mut sb, 2);
            assert!(a == b && sa == sb, "{}", opt.name());
        }
        // A user rule without its own split runs `apply` once.
        struct Count;
        impl Optimizer for Count {
            fn name(&self) -> &str {
                "count"
            }
            fn state_slots(&self) -> usize {
                0
            }
            fn apply(&self, params: &mut [f32], _: &[f32], state: &mut OptimizerState) {
                params.iter_mut().for_each(|p| *p += 1.0);
                state.step += 1;
            }
        }
        let mut p = vec![0.0; 10];
        let mut st = Count.new_state(10);
        Count.apply_parallel(&mut p, &[0.0; 10], &mut st, 4);
        assert_eq!((p, st.step), (vec![1.0; 10], 1));
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
