//! Parameter specifications, deterministic initialisation and the flat
//! parameter buffer a trainer keeps.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::rng::{hash_str, mix64, SplitMix64};

/// How a parameter's initial values are drawn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// Every element the same value.
    Constant(f32),
    /// Uniform in `[low, high)`.
    Uniform {
        /// Lower bound (inclusive).
        low: f32,
        /// Upper bound.
        high: f32,
    },
    /// Normal with the given mean and standard deviation.
    Normal {
        /// Mean.
        mean: f32,
        /// Standard deviation, `>= 0`.
        std: f32,
    },
}

/// One named parameter (a tensor) of a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Unique, non-empty name; it also seeds the initial values.
    pub name: String,
    /// Dimensions; an empty shape is a scalar.
    pub shape: Vec<usize>,
    /// How the initial values are drawn.
    pub init: Init,
}

impl ParamSpec {
    /// Convenience constructor.
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>, init: Init) -> Self {
        Self { name: name.into(), shape: shape.into(), init }
    }

    /// Number of elements: the product of the shape (1 for a scalar).
    /// Saturates at `usize::MAX` on overflow, which [`validate_specs`] rejects.
    pub fn len(&self) -> usize {
        self.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }

    /// True if the shape has a zero dimension (never for a valid spec).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Check a model's specs: at least one parameter, unique non-empty names, no
/// zero dimension, an element count that fits in `usize`, and initialisers
/// with finite values, `std >= 0` and `low <= high`, whose every draw is a
/// finite `f32` (a normal's `|mean| + 8.6 std` within `f32::MAX`).
pub fn validate_specs(specs: &[ParamSpec]) -> Result<()> {
    if specs.is_empty() {
        return Err(Error::NoParams);
    }
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(specs.len());
    for (i, s) in specs.iter().enumerate() {
        if s.name.is_empty() {
            return Err(Error::EmptyName { index: i });
        }
        if let Some(&first) = seen.get(s.name.as_str()) {
            return Err(Error::DuplicateName { name: s.name.clone(), first, second: i });
        }
        seen.insert(&s.name, i);
        if s.shape.contains(&0) {
            return Err(Error::ZeroDim { name: s.name.clone(), shape: s.shape.clone() });
        }
        if s.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_none() {
            return Err(Error::ShapeOverflow { name: s.name.clone(), shape: s.shape.clone() });
        }
        validate_init(s)?;
    }
    Ok(())
}

/// Above the largest standard normal [`SplitMix64::next_normal`] draws:
/// `sqrt(-2 ln 2^-53)` = 8.57.
const NORMAL_MAX_DRAW: f64 = 8.6;

fn validate_init(s: &ParamSpec) -> Result<()> {
    let bad = |reason: String| Error::BadInit { name: s.name.clone(), reason };
    match s.init {
        Init::Zeros => Ok(()),
        Init::Constant(v) if !v.is_finite() => Err(bad(format!("constant {v} is not finite"))),
        Init::Constant(_) => Ok(()),
        Init::Uniform { low, high } => {
            if !low.is_finite() || !high.is_finite() || !(high - low).is_finite() {
                Err(bad(format!("uniform bounds [{low}, {high}) are not finite")))
            } else if low > high {
                Err(bad(format!("uniform low {low} > high {high}")))
            } else {
                Ok(())
            }
        }
        Init::Normal { mean, std } => {
            if !mean.is_finite() || !std.is_finite() {
                Err(bad(format!("normal mean {mean} / std {std} not finite")))
            } else if std < 0.0 {
                Err(bad(format!("normal std {std} < 0")))
            } else if f64::from(mean).abs() + f64::from(std) * NORMAL_MAX_DRAW > f64::from(f32::MAX) {
                Err(bad(format!(
                    "normal mean {mean} / std {std} can draw values beyond f32's range \
                     (|mean| + {NORMAL_MAX_DRAW} std must stay within {:e})",
                    f32::MAX
                )))
            } else {
                Ok(())
            }
        }
    }
}

/// Fill `out` with the initial values of elements `offset .. offset + out.len()`
/// of `spec`.
///
/// Element `i`'s value depends only on `(seed, spec.name, i)`, never on the
/// placement: each pserver initialises just its own blocks, and the model is
/// the same for any number of servers or block size. Each element gets its
/// own generator seeded from a mix of those three, so any range can be
/// computed without the elements before it.
pub fn init_values(spec: &ParamSpec, seed: u64, offset: usize, out: &mut [f32]) {
    let base = mix64(seed ^ hash_str(&spec.name));
    let rng_at = |j: usize| {
        let i = (offset as u64).wrapping_add(j as u64);
        SplitMix64::new(mix64(base ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    };
    draw(&spec.init, rng_at, out);
}

/// Fill `out` from `init`, element `j` from its own generator `rng_at(j)`:
/// how dense parameters and sparse rows (`sparse::init_row`) alike are drawn.
pub(crate) fn draw(init: &Init, rng_at: impl Fn(usize) -> SplitMix64, out: &mut [f32]) {
    match *init {
        Init::Zeros => out.fill(0.0),
        Init::Constant(v) => out.fill(v),
        Init::Uniform { low, high } => {
            for (j, o) in out.iter_mut().enumerate() {
                let u = rng_at(j).next_f32();
                // Rounding can land on `high`; keep the documented half-open range.
                let v = low + (high - low) * u;
                *o = if v >= high && high > low { next_down(high) } else { v };
            }
        }
        Init::Normal { mean, std } => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = mean + std * rng_at(j).next_normal();
            }
        }
    }
}

/// The largest `f32` below finite `x` (`f32::next_down` is newer than the MSRV).
fn next_down(x: f32) -> f32 {
    if x == 0.0 {
        -f32::from_bits(1)
    } else if x > 0.0 {
        f32::from_bits(x.to_bits() - 1)
    } else {
        f32::from_bits(x.to_bits() + 1)
    }
}

/// All of a model's parameters in one flat `f32` buffer, in spec order.
///
/// This is the trainer's model buffer: the client pulls blocks straight into
/// it and the model reads its parameters as slices of it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamBuf {
    data: Vec<f32>,
    offsets: Vec<usize>,
    lens: Vec<usize>,
}

impl ParamBuf {
    /// A zero buffer laid out for `specs`.
    ///
    /// Specs are the program's own model description; validate them first
    /// ([`validate_specs`]): an overflowing shape would fail to allocate.
    pub fn zeros(specs: &[ParamSpec]) -> Self {
        let lens: Vec<usize> = specs.iter().map(ParamSpec::len).collect();
        let mut offsets = Vec::with_capacity(lens.len());
        let mut total = 0usize;
        for &l in &lens {
            offsets.push(total);
            total = total.saturating_add(l);
        }
        Self { data: vec![0.0; total], offsets, lens }
    }

    /// The buffer holding every parameter's initial values for `seed`: the
    /// same values the pservers start from.
    pub fn init(specs: &[ParamSpec], seed: u64) -> Self {
        let mut buf = Self::zeros(specs);
        for (i, spec) in specs.iter().enumerate() {
            init_values(spec, seed, 0, buf.param_mut(i));
        }
        buf
    }

    /// Parameter `i` (spec order). Panics if `i >= self.params()`, like slice indexing.
    pub fn param(&self, i: usize) -> &[f32] {
        &self.data[self.offsets[i]..][..self.lens[i]]
    }

    /// Parameter `i`, mutable. Panics if `i >= self.params()`.
    pub fn param_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[self.offsets[i]..][..self.lens[i]]
    }

    /// Offset of parameter `i` in the flat buffer, if it exists.
    pub fn offset(&self, i: usize) -> Option<usize> {
        self.offsets.get(i).copied()
    }

    /// The whole buffer.
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    /// The whole buffer, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// Number of parameters.
    pub fn params(&self) -> usize {
        self.lens.len()
    }

    /// Total number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True if the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Set every element to `v` (e.g. zero a gradient buffer).
    pub fn fill(&mut self, v: f32) {
        self.data.fill(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize], init: Init) -> ParamSpec {
        ParamSpec::new(name, shape.to_vec(), init)
    }

    #[test]
    fn len_is_product_and_scalar_is_one() {
        assert_eq!(spec("a", &[3, 4], Init::Zeros).len(), 12);
        assert_eq!(spec("s", &[], Init::Zeros).len(), 1);
        assert_eq!(spec("z", &[3, 0], Init::Zeros).len(), 0);
        assert_eq!(spec("o", &[usize::MAX, 2], Init::Zeros).len(), usize::MAX);
    }

    #[test]
    fn validation_rejects_each_problem() {
        assert!(matches!(validate_specs(&[]), Err(Error::NoParams)));
        let ok = spec("w", &[2], Init::Zeros);
        assert!(validate_specs(std::slice::from_ref(&ok)).is_ok());
        assert!(matches!(validate_specs(&[spec("", &[1], Init::Zeros)]), Err(Error::EmptyName { index: 0 })));
        assert!(matches!(
            validate_specs(&[ok.clone(), spec("b", &[1], Init::Zeros), ok.clone()]),
            Err(Error::DuplicateName { first: 0, second: 2, .. })
        ));
        assert!(matches!(validate_specs(&[spec("w", &[2, 0], Init::Zeros)]), Err(Error::ZeroDim { .. })));
        assert!(matches!(
            validate_specs(&[spec("w", &[usize::MAX, 3], Init::Zeros)]),
            Err(Error::ShapeOverflow { .. })
        ));
        for init in [
            Init::Constant(f32::NAN),
            Init::Uniform { low: 1.0, high: 0.0 },
            Init::Uniform { low: 0.0, high: f32::INFINITY },
            Init::Uniform { low: -3e38, high: 3e38 },
            Init::Normal { mean: 0.0, std: -1.0 },
            Init::Normal { mean: f32::NAN, std: 1.0 },
            Init::Normal { mean: 0.0, std: 4e37 },
            Init::Normal { mean: -3.3e38, std: 1e37 },
        ] {
            let r = validate_specs(&[spec("w", &[2], init.clone())]);
            assert!(matches!(r, Err(Error::BadInit { .. })), "{init:?}: {r:?}");
        }
        let msg = validate_specs(&[spec("layer1.w", &[2], Init::Normal { mean: 0.0, std: -1.0 })])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("layer1.w") && msg.contains("-1"), "{msg}");
        // The widest normal accepted draws only finite values.
        let widest = Init::Normal { mean: 0.0, std: 3.9e37 };
        assert!(validate_specs(&[spec("w", &[2], widest.clone())]).is_ok());
        let mut out = vec![0f32; 100_000];
        init_values(&spec("w", &[100_000], widest), 3, 0, &mut out);
        assert!(out.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn init_depends_only_on_seed_name_index() {
        let s = spec("w", &[100], Init::Normal { mean: 1.0, std: 2.0 });
        let mut full = vec![0.0; 100];
        init_values(&s, 5, 0, &mut full);
        // Any sub-range computed alone matches the full computation.
        let mut part = vec![0.0; 17];
        init_values(&s, 5, 40, &mut part);
        assert_eq!(&full[40..57], &part[..]);
        // Different seed or name gives different values.
        let mut other = vec![0.0; 100];
        init_values(&s, 6, 0, &mut other);
        assert_ne!(full, other);
        init_values(&spec("v", &[100], s.init.clone()), 5, 0, &mut other);
        assert_ne!(full, other);
        // Shape does not matter beyond the index.
        init_values(&spec("w", &[10, 10], s.init.clone()), 5, 0, &mut other);
        assert_eq!(full, other);
        let mean = full.iter().sum::<f32>() / 100.0;
        assert!((mean - 1.0).abs() < 0.7, "mean {mean}");
    }

    #[test]
    fn init_kinds() {
        let mut out = vec![9.0; 50];
        init_values(&spec("a", &[50], Init::Zeros), 1, 0, &mut out);
        assert!(out.iter().all(|&x| x == 0.0));
        init_values(&spec("a", &[50], Init::Constant(0.5)), 1, 0, &mut out);
        assert!(out.iter().all(|&x| x == 0.5));
        init_values(&spec("a", &[50], Init::Uniform { low: -0.1, high: 0.3 }), 1, 0, &mut out);
        assert!(out.iter().all(|&x| (-0.1..0.3).contains(&x)), "{out:?}");
        assert!(out.windows(2).any(|w| w[0] != w[1]));
        init_values(&spec("a", &[50], Init::Uniform { low: 2.0, high: 2.0 }), 1, 0, &mut out);
        assert!(out.iter().all(|&x| x == 2.0));
        init_values(&spec("a", &[50], Init::Normal { mean: 3.0, std: 0.0 }), 1, 0, &mut out);
        assert!(out.iter().all(|&x| x == 3.0));
    }

    #[test]
    fn param_buf_layout() {
        let specs = vec![
            spec("w", &[2, 3], Init::Uniform { low: 0.0, high: 1.0 }),
            spec("b", &[], Init::Constant(7.0)),
            spec("v", &[4], Init::Zeros),
        ];
        let mut buf = ParamBuf::init(&specs, 3);
        assert_eq!(buf.params(), 3);
        assert_eq!(buf.len(), 11);
        assert_eq!(buf.offset(2), Some(7));
        assert_eq!(buf.offset(3), None);
        assert_eq!(buf.param(1), &[7.0]);
        assert_eq!(buf.param(0).len(), 6);
        let mut w = vec![0.0; 6];
        init_values(&specs[0], 3, 0, &mut w);
        assert_eq!(buf.param(0), &w[..]);
        buf.param_mut(2)[3] = 5.0;
        assert_eq!(buf.as_slice()[10], 5.0);
        buf.as_mut_slice()[0] = -1.0;
        assert_eq!(buf.param(0)[0], -1.0);
        buf.fill(0.25);
        assert!(buf.as_slice().iter().all(|&x| x == 0.25));
        assert_eq!(ParamBuf::zeros(&specs).as_slice(), &[0.0; 11]);
    }
}
