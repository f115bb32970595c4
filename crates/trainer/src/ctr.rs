//! Built-in click-through-rate models: binary classifiers (classes 0 and 1,
//! logistic loss) over sparse tables, named by [`CtrModelConfig`].
//!
//! - [`SparseLr`], logistic regression: table `"lr_w"` (dim 1, zeros) and
//!   the dense bias `"lr_b"` (`[1]`, zero);
//!   `logit = b + Σ_i w[id_i]·x_i`.
//! - [`FactorizationMachine`] with `k` factors: table `"fm_w"` (dim 1,
//!   zeros), table `"fm_v"` (dim k, normal with mean 0 and std 0.01: small
//!   and symmetric, so no pair starts out favoured, yet non-zero, since the
//!   gradient of a factor is proportional to the other factors and would stay
//!   zero from an all-zero start), and the dense bias `"fm_b"` (`[1]`, zero);
//!   `logit = b + Σ_i w_i·x_i + ½ Σ_f [(Σ_i v_if·x_i)² − Σ_i v_if²·x_i²]`,
//!   i.e. `Σ_{i<j} <v_i, v_j>·x_i·x_j` for the pairwise part (Rendle 2010).
//!
//! **Hashed crosses** (`crosses: true`): for each pair of positions `i < j`
//! among the first [`MAX_CROSS_IDS`] `(id, value)` pairs of an example, a
//! linear term with id [`cross_id`]`(id_i, id_j)` and value `x_i·x_j` is
//! added to the linear table (LR's `"lr_w"`, FM's `"fm_w"`; FM's factors see
//! only the example's own ids). The cap bounds an example's cost at
//! `64·63/2 = 2016` crosses however long it is; ids past it still count as
//! plain linear terms.
//!
//! The loss is `softplus(z) − y·z` for logit `z` and label `y`, computed as
//! `max(z, 0) − y·z + ln(1 + e^−|z|)` so it never overflows; its derivative
//! is `σ(z) − y`. A model predicts class 1 when `z > 0` (probability above
//! one half).
//!
//! One step of a trainer, without the pservers:
//!
//! ```
//! use oar_pserver::ParamBuf;
//! use oar_trainer::{CtrModelConfig, IdExample};
//!
//! let model = CtrModelConfig::parse("fm", 4, true)?.build()?;
//! let batch = [IdExample { label: 1, ids: vec![(7, 1.0), (1 << 40, 1.0)] }];
//! // The rows to pull: "fm_w" holds both ids and their cross, "fm_v" the ids.
//! let mut rows = model.new_rows();
//! model.batch_ids(&batch, &mut rows);
//! assert_eq!((rows.ids(0).len(), rows.ids(1)), (3, &[7, 1 << 40][..]));
//! // A trainer pulls the rows' values into `rows.values_mut(t)` here; new
//! // rows of "fm_w" are zero, so the logit is 0 whatever "fm_v" holds.
//! let dense = ParamBuf::zeros(&model.param_specs());
//! let (mut dense_grads, mut row_grads) = (dense.clone(), rows.zeros_like());
//! let loss = model.loss_and_grad(&dense, &rows, &batch, &mut dense_grads, &mut row_grads);
//! assert!((loss - std::f32::consts::LN_2).abs() < 1e-6);
//! // d loss / d b = σ(0) − 1; the rows' gradients go back as `row_grads.iter(t)`.
//! assert!((dense_grads.as_slice()[0] + 0.5).abs() < 1e-6);
//! # Ok::<(), oar_trainer::Error>(())
//! ```

use serde::{Deserialize, Serialize};

use oar_pserver::sparse::TableSpec;
use oar_pserver::{Init, ParamBuf, ParamSpec, SplitMix64};

use crate::id_reader::IdExample;
use crate::sparse_model::{RowBatch, SparseModel};
use crate::{Error, Result};

/// How many leading `(id, value)` pairs of an example are crossed with each
/// other (so at most `64·63/2 = 2016` cross ids per example).
pub const MAX_CROSS_IDS: usize = 64;

/// Salt of [`cross_id`], the ASCII bytes of `"cross_id"`, so a cross never
/// shares its first mixing step with anything else hashed from an id.
const CROSS_SALT: u64 = u64::from_be_bytes(*b"cross_id");

/// The id of the cross of `a` and `b`: stable across platforms, processes and
/// releases, and symmetric, so it does not depend on the order the ids come in.
///
/// `cross_id(a, b) = sm(sm(min(a, b) ^ 0x63726f73735f6964) ^ max(a, b))`,
/// where `sm(s)` is the first output of [`SplitMix64::new`]`(s)` and the
/// constant is `"cross_id"` in ASCII.
pub fn cross_id(a: u64, b: u64) -> u64 {
    let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
    let first = SplitMix64::new(lo ^ CROSS_SALT).next_u64();
    SplitMix64::new(first ^ hi).next_u64()
}

/// The valid names of [`CtrModelConfig::parse`].
pub const CTR_MODEL_NAMES: &[&str] = &["lr", "fm"];

/// The largest number of factors [`CtrModelConfig::Fm`] accepts: beyond it a
/// row costs more to move than a CTR model gains.
pub const MAX_FACTORS: usize = 256;

/// Which built-in CTR model to train; serialisable so a master can publish
/// it in the job's config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CtrModelConfig {
    /// Logistic regression over ids ([`SparseLr`]).
    Lr {
        /// Add hashed pairwise crosses as linear terms.
        crosses: bool,
    },
    /// A factorization machine ([`FactorizationMachine`]).
    Fm {
        /// Width of the factor rows, in `1..=MAX_FACTORS`.
        factors: usize,
        /// Add hashed pairwise crosses to the linear part.
        crosses: bool,
    },
}

impl CtrModelConfig {
    /// The model named `name` (`"lr"` or `"fm"`, any case; `factors` is used
    /// by `"fm"` only), validated.
    pub fn parse(name: &str, factors: usize, crosses: bool) -> Result<Self> {
        let cfg = match name.trim().to_ascii_lowercase().as_str() {
            "lr" => CtrModelConfig::Lr { crosses },
            "fm" => CtrModelConfig::Fm { factors, crosses },
            _ => {
                return Err(Error::BadConfig(format!(
                    "unknown CTR model {name:?}; valid names are {}",
                    CTR_MODEL_NAMES.join(", ")
                )))
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The model's name, as [`parse`](Self::parse) accepts it.
    pub fn name(&self) -> &'static str {
        match self {
            CtrModelConfig::Lr { .. } => "lr",
            CtrModelConfig::Fm { .. } => "fm",
        }
    }

    /// Checks that `factors` is in `1..=MAX_FACTORS`.
    pub fn validate(&self) -> Result<()> {
        match *self {
            CtrModelConfig::Lr { .. } => Ok(()),
            CtrModelConfig::Fm { factors, .. } => check_factors(factors),
        }
    }

    /// Builds the model after [`validate`](Self::validate).
    pub fn build(&self) -> Result<Box<dyn SparseModel>> {
        Ok(match *self {
            CtrModelConfig::Lr { crosses } => Box::new(SparseLr::new(crosses)),
            CtrModelConfig::Fm { factors, crosses } => Box::new(FactorizationMachine::new(factors, crosses)?),
        })
    }
}

fn check_factors(factors: usize) -> Result<()> {
    if (1..=MAX_FACTORS).contains(&factors) {
        Ok(())
    } else {
        Err(Error::BadConfig(format!("factors must be in 1..={MAX_FACTORS}, got {factors}")))
    }
}

/// `σ(z) = 1 / (1 + e^−z)`, never computing `e` of a large positive number.
fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// Logistic loss of logit `z` for target `y ∈ {0, 1}`: `softplus(z) − y·z`.
fn logloss(z: f32, y: f32) -> f32 {
    z.max(0.0) - y * z + (-z.abs()).exp().ln_1p()
}

/// The target of a binary label; `None` for a label outside `{0, 1}`.
fn target(label: u32) -> Option<f32> {
    match label {
        0 => Some(0.0),
        1 => Some(1.0),
        _ => None,
    }
}

/// Replaces `out` with the linear terms of `ex`: its own `(id, value)` pairs,
/// then, with `crosses`, the crosses of its first [`MAX_CROSS_IDS`] pairs.
fn linear_terms(ex: &IdExample, crosses: bool, out: &mut Vec<(u64, f32)>) {
    out.clear();
    out.extend_from_slice(&ex.ids);
    if crosses {
        let head = &ex.ids[..ex.ids.len().min(MAX_CROSS_IDS)];
        for (i, &(a, xa)) in head.iter().enumerate() {
            for &(b, xb) in &head[i + 1..] {
                out.push((cross_id(a, b), xa * xb));
            }
        }
    }
}

/// Linear table, dense bias: every model here has both first.
const LINEAR: usize = 0;
const BIAS: usize = 0;

/// `Σ w[id]·x` over `terms` from the linear table of `rows` (missing rows are zero).
fn linear_logit(rows: &RowBatch, terms: &[(u64, f32)]) -> f32 {
    terms.iter().filter_map(|&(id, x)| rows.row(LINEAR, id).map(|w| w[0] * x)).sum()
}

/// Adds `g·x` to the linear gradient of every term's id held by `grads`.
fn add_linear_grads(grads: &mut RowBatch, terms: &[(u64, f32)], g: f32) {
    for &(id, x) in terms {
        if let Some(w) = grads.row_mut(LINEAR, id) {
            w[0] += g * x;
        }
    }
}

/// The unique ids of the linear terms of `batch`, into table [`LINEAR`].
fn set_linear_ids(batch: &[IdExample], crosses: bool, rows: &mut RowBatch) {
    let mut ids = Vec::new();
    let mut terms = Vec::new();
    for ex in batch {
        linear_terms(ex, crosses, &mut terms);
        ids.extend(terms.iter().map(|&(id, _)| id));
    }
    rows.set_ids(LINEAR, ids);
}

fn scalar_bias(name: &str) -> ParamSpec {
    ParamSpec::new(name, vec![1], Init::Zeros)
}

/// `predict`'s bookkeeping, shared by the models: replaces `out` with the
/// class of each example's `logit` and returns the mean loss (valid labels
/// add to it, every example counts in the mean).
fn predict_with(batch: &[IdExample], out: &mut Vec<u32>, mut logit: impl FnMut(&IdExample) -> f32) -> f32 {
    out.clear();
    if batch.is_empty() {
        return 0.0;
    }
    let mut total = 0.0f64;
    for ex in batch {
        let z = logit(ex);
        out.push(u32::from(z > 0.0));
        if let Some(y) = target(ex.label) {
            total += f64::from(logloss(z, y));
        }
    }
    (total / batch.len() as f64) as f32
}

/// Logistic regression over ids (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SparseLr {
    crosses: bool,
}

impl SparseLr {
    /// The model, with or without hashed crosses.
    pub fn new(crosses: bool) -> Self {
        SparseLr { crosses }
    }

    /// Whether the model adds hashed crosses.
    pub fn crosses(&self) -> bool {
        self.crosses
    }
}

impl SparseModel for SparseLr {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![scalar_bias("lr_b")]
    }

    fn table_specs(&self) -> Vec<TableSpec> {
        vec![TableSpec::new("lr_w", 1, Init::Zeros)]
    }

    fn classes(&self) -> usize {
        2
    }

    fn batch_ids(&self, batch: &[IdExample], rows: &mut RowBatch) {
        set_linear_ids(batch, self.crosses, rows);
    }

    fn loss_and_grad(
        &self,
        dense: &ParamBuf,
        rows: &RowBatch,
        batch: &[IdExample],
        dense_grads: &mut ParamBuf,
        row_grads: &mut RowBatch,
    ) -> f32 {
        dense_grads.fill(0.0);
        row_grads.fill(0.0);
        if batch.is_empty() {
            return 0.0;
        }
        let inv_b = 1.0 / batch.len() as f32;
        let bias = dense.param(BIAS)[0];
        let mut terms = Vec::new();
        let mut total = 0.0f64;
        for ex in batch {
            let Some(y) = target(ex.label) else { continue };
            linear_terms(ex, self.crosses, &mut terms);
            let z = bias + linear_logit(rows, &terms);
            total += f64::from(logloss(z, y));
            let g = (sigmoid(z) - y) * inv_b;
            dense_grads.param_mut(BIAS)[0] += g;
            add_linear_grads(row_grads, &terms, g);
        }
        (total / batch.len() as f64) as f32
    }

    fn predict(&self, dense: &ParamBuf, rows: &RowBatch, batch: &[IdExample], out: &mut Vec<u32>) -> f32 {
        let bias = dense.param(BIAS)[0];
        let mut terms = Vec::new();
        predict_with(batch, out, |ex| {
            linear_terms(ex, self.crosses, &mut terms);
            bias + linear_logit(rows, &terms)
        })
    }
}

/// A second-order factorization machine (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FactorizationMachine {
    factors: usize,
    crosses: bool,
}

/// Table `"fm_v"`'s position.
const FACTORS: usize = 1;

impl FactorizationMachine {
    /// The model with `factors` in `1..=MAX_FACTORS`, with or without hashed
    /// crosses.
    pub fn new(factors: usize, crosses: bool) -> Result<Self> {
        check_factors(factors)?;
        Ok(FactorizationMachine { factors, crosses })
    }

    /// Width of the factor rows.
    pub fn factors(&self) -> usize {
        self.factors
    }

    /// Whether the model adds hashed crosses.
    pub fn crosses(&self) -> bool {
        self.crosses
    }

    /// The logit of `ex`, leaving `s_f = Σ_i v_if·x_i` in `sums` (for the
    /// gradient) and the linear terms in `terms`.
    fn logit(
        &self,
        bias: f32,
        rows: &RowBatch,
        ex: &IdExample,
        terms: &mut Vec<(u64, f32)>,
        sums: &mut [f32],
    ) -> f32 {
        linear_terms(ex, self.crosses, terms);
        let mut z = bias + linear_logit(rows, terms);
        sums.fill(0.0);
        let mut squares = 0.0f32;
        for &(id, x) in &ex.ids {
            if let Some(v) = rows.row(FACTORS, id) {
                for (s, &vf) in sums.iter_mut().zip(v) {
                    let t = vf * x;
                    *s += t;
                    squares += t * t;
                }
            }
        }
        z += 0.5 * (sums.iter().map(|s| s * s).sum::<f32>() - squares);
        z
    }
}

impl SparseModel for FactorizationMachine {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![scalar_bias("fm_b")]
    }

    fn table_specs(&self) -> Vec<TableSpec> {
        vec![
            TableSpec::new("fm_w", 1, Init::Zeros),
            TableSpec::new("fm_v", self.factors, Init::Normal { mean: 0.0, std: 0.01 }),
        ]
    }

    fn classes(&self) -> usize {
        2
    }

    fn batch_ids(&self, batch: &[IdExample], rows: &mut RowBatch) {
        set_linear_ids(batch, self.crosses, rows);
        rows.set_ids(FACTORS, batch.iter().flat_map(|ex| ex.ids.iter().map(|&(id, _)| id)).collect());
    }

    fn loss_and_grad(
        &self,
        dense: &ParamBuf,
        rows: &RowBatch,
        batch: &[IdExample],
        dense_grads: &mut ParamBuf,
        row_grads: &mut RowBatch,
    ) -> f32 {
        dense_grads.fill(0.0);
        row_grads.fill(0.0);
        if batch.is_empty() {
            return 0.0;
        }
        let inv_b = 1.0 / batch.len() as f32;
        let bias = dense.param(BIAS)[0];
        let mut terms = Vec::new();
        let mut sums = vec![0.0f32; self.factors];
        let mut total = 0.0f64;
        for ex in batch {
            let Some(y) = target(ex.label) else { continue };
            let z = self.logit(bias, rows, ex, &mut terms, &mut sums);
            total += f64::from(logloss(z, y));
            let g = (sigmoid(z) - y) * inv_b;
            dense_grads.param_mut(BIAS)[0] += g;
            add_linear_grads(row_grads, &terms, g);
            // d logit / d v_if = x_i·s_f − v_if·x_i², summed over the
            // positions where the id occurs.
            for &(id, x) in &ex.ids {
                let (Some(v), Some(gv)) = (rows.row(FACTORS, id), row_grads.row_mut(FACTORS, id)) else {
                    continue;
                };
                for ((gvf, &vf), &s) in gv.iter_mut().zip(v).zip(&sums) {
                    *gvf += g * x * (s - vf * x);
                }
            }
        }
        (total / batch.len() as f64) as f32
    }

    fn predict(&self, dense: &ParamBuf, rows: &RowBatch, batch: &[IdExample], out: &mut Vec<u32>) -> f32 {
        let bias = dense.param(BIAS)[0];
        let mut terms = Vec::new();
        let mut sums = vec![0.0f32; self.factors];
        predict_with(batch, out, |ex| self.logit(bias, rows, ex, &mut terms, &mut sums))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logloss_and_sigmoid_are_stable() {
        assert!((logloss(0.0, 1.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert!(logloss(1000.0, 1.0).abs() < 1e-6);
        assert!((logloss(1000.0, 0.0) - 1000.0).abs() < 1e-3);
        assert!((logloss(-1000.0, 1.0) - 1000.0).abs() < 1e-3);
        assert!(logloss(-1000.0, 0.0).abs() < 1e-6);
        assert_eq!(sigmoid(1000.0), 1.0);
        assert_eq!(sigmoid(-1000.0), 0.0);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
    }

    #[test]
    fn cross_ids_are_symmetric_and_distinct() {
        assert_eq!(cross_id(3, 7), cross_id(7, 3));
        assert_ne!(cross_id(3, 7), cross_id(3, 8));
        assert_ne!(cross_id(3, 7), cross_id(4, 7));
        assert_ne!(cross_id(1, 2), 1);
    }

    #[test]
    fn crosses_are_capped() {
        let ex = IdExample { label: 1, ids: (1..=100).map(|id| (id, 1.0)).collect() };
        let mut terms = Vec::new();
        linear_terms(&ex, false, &mut terms);
        assert_eq!(terms.len(), 100);
        linear_terms(&ex, true, &mut terms);
        assert_eq!(terms.len(), 100 + MAX_CROSS_IDS * (MAX_CROSS_IDS - 1) / 2);
    }

    #[test]
    fn parse_validates_and_lists_names() {
        assert_eq!(CtrModelConfig::parse("LR", 0, true).unwrap(), CtrModelConfig::Lr { crosses: true });
        assert_eq!(
            CtrModelConfig::parse(" fm ", 8, false).unwrap(),
            CtrModelConfig::Fm { factors: 8, crosses: false }
        );
        for factors in [0, MAX_FACTORS + 1] {
            let err = CtrModelConfig::parse("fm", factors, false).unwrap_err().to_string();
            assert!(err.contains("factors") && err.contains(&factors.to_string()), "{err}");
            assert!(CtrModelConfig::Fm { factors, crosses: false }.build().is_err());
        }
        let err = CtrModelConfig::parse("ffm", 8, false).unwrap_err().to_string();
        assert!(err.contains("\"ffm\"") && err.contains("lr, fm"), "{err}");
        let fm = CtrModelConfig::Fm { factors: 4, crosses: false }.build().unwrap();
        let dims: Vec<usize> = fm.table_specs().iter().map(|t| t.dim).collect();
        assert_eq!((fm.classes(), dims), (2, vec![1, 4]));
    }
}
