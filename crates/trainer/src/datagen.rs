//! A synthetic dataset with known structure, for examples, tests and benchmarks.
//!
//! [`write_blobs`] draws one Gaussian "blob" per class: a random center
//! (entries `N(0, 1)`, then all centers scaled by one common factor) plus unit
//! isotropic noise per feature. With equal, isotropic covariances the best
//! possible classifier is linear (nearest center), so a softmax regression can
//! approach it. The scale is chosen so that the expected Bayes error, by the
//! union bound over pairs of classes, is [`TARGET_ERROR`]: a linear model
//! reaches roughly 97-99% accuracy, never a trivial 100%.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use oar_pserver::rng::SplitMix64;

use crate::math::{check_product, check_size};
use crate::{Error, Result};

/// The expected error rate of the best classifier on [`write_blobs`] data.
pub const TARGET_ERROR: f64 = 0.02;

/// Writes `dir/train.libsvm` (`train` examples) and `dir/test.libsvm` (`test`
/// examples) and returns their paths. Labels are `0..classes` (so read them
/// with `classes` classes; with 2 classes they are 0/1), every feature is
/// written (dense), and the output depends only on the arguments.
pub fn write_blobs(
    dir: &Path,
    classes: usize,
    features: usize,
    train: usize,
    test: usize,
    seed: u64,
) -> Result<(PathBuf, PathBuf)> {
    check_size("classes", classes, 2)?;
    check_size("features", features, 1)?;
    check_product("blob centers", classes, features)?;
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.display().to_string(), source })?;
    let mut rng = SplitMix64::new(seed);
    let mut centers: Vec<f64> = (0..classes * features).map(|_| normal(&mut rng)).collect();
    let scale = separation_scale(&centers, classes, features);
    for c in &mut centers {
        *c *= scale;
    }
    let train_path = dir.join("train.libsvm");
    let test_path = dir.join("test.libsvm");
    write_examples(&train_path, &centers, classes, features, train, &mut rng)?;
    write_examples(&test_path, &centers, classes, features, test, &mut rng)?;
    Ok((train_path, test_path))
}

fn normal(rng: &mut SplitMix64) -> f64 {
    f64::from(rng.next_normal())
}

fn write_examples(
    path: &Path,
    centers: &[f64],
    classes: usize,
    features: usize,
    count: usize,
    rng: &mut SplitMix64,
) -> Result<()> {
    let io_err = |source| Error::Io { path: path.display().to_string(), source };
    let mut out = BufWriter::new(File::create(path).map_err(io_err)?);
    let mut line = String::new();
    for _ in 0..count {
        let class = (rng.next_u64() % classes as u64) as usize;
        let center = &centers[class * features..(class + 1) * features];
        line.clear();
        let _ = write!(line, "{class}");
        for (i, c) in center.iter().enumerate() {
            let v = c + normal(rng);
            // Writing to a String cannot fail.
            let _ = write!(line, " {}:{v:.4}", i + 1);
        }
        line.push('\n');
        out.write_all(line.as_bytes()).map_err(io_err)?;
    }
    out.flush().map_err(io_err)?;
    out.into_inner().map_err(|e| io_err(e.into_error()))?.sync_all().map_err(io_err)
}

/// The factor by which to scale `centers` so that the union-bound Bayes error
/// under unit noise equals [`TARGET_ERROR`].
fn separation_scale(centers: &[f64], classes: usize, features: usize) -> f64 {
    let mut dists = Vec::with_capacity(classes * (classes - 1) / 2);
    for i in 0..classes {
        for j in i + 1..classes {
            let a = &centers[i * features..(i + 1) * features];
            let b = &centers[j * features..(j + 1) * features];
            let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
            // Two coincident random centers are (almost) impossible; keep them
            // from breaking the search.
            dists.push(d2.sqrt().max(1e-6));
        }
    }
    // Mean over classes of the sum over the other classes of P(closer to the
    // other center) = Phi(-s d / 2); each pair counts for both of its classes.
    let error = |s: f64| -> f64 {
        2.0 * dists.iter().map(|d| normal_tail(s * d / 2.0)).sum::<f64>() / classes as f64
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while error(hi) > TARGET_ERROR && hi < 1e12 {
        hi *= 2.0;
    }
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if error(mid) > TARGET_ERROR {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

/// `P(Z > x)` for a standard normal `Z` and `x >= 0` (Abramowitz & Stegun
/// 7.1.26, absolute error below 1e-7).
fn normal_tail(x: f64) -> f64 {
    let x = x / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    0.5 * poly * (-x * x).exp()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::{read_glob, Format, ReaderOptions};

    #[test]
    fn normal_tail_matches_known_values() {
        assert!((normal_tail(0.0) - 0.5).abs() < 1e-6);
        assert!((normal_tail(1.0) - 0.158_655).abs() < 1e-5);
        assert!((normal_tail(2.0) - 0.022_750).abs() < 1e-5);
    }

    #[test]
    fn writes_parseable_deterministic_files() {
        let dir = tempfile::tempdir().unwrap();
        let (train, test) = write_blobs(dir.path(), 3, 4, 50, 20, 7).unwrap();
        let opts = ReaderOptions { format: Format::Libsvm, features: 4, classes: 3, skip_bad_lines: false };
        let tr = read_glob(train.to_str().unwrap(), &opts).unwrap();
        let te = read_glob(test.to_str().unwrap(), &opts).unwrap();
        assert_eq!((tr.len(), te.len()), (50, 20));
        assert!(tr.iter().all(|e| e.features.len() == 4 && e.label < 3));
        let text = std::fs::read_to_string(&train).unwrap();
        assert_eq!(text.lines().count(), 50);
        for c in 0..3 {
            assert!(tr.iter().any(|e| e.label == c), "class {c} missing");
        }
        // Same seed, same bytes; another seed, other bytes.
        let dir2 = tempfile::tempdir().unwrap();
        let (train2, _) = write_blobs(dir2.path(), 3, 4, 50, 20, 7).unwrap();
        assert_eq!(text, std::fs::read_to_string(train2).unwrap());
        let (train3, _) = write_blobs(dir2.path(), 3, 4, 50, 20, 8).unwrap();
        assert_ne!(text, std::fs::read_to_string(train3).unwrap());
    }

    #[test]
    fn nearest_center_accuracy_is_high_but_not_perfect() {
        // The Bayes classifier on the generated data scores about 1 - TARGET_ERROR.
        let (classes, features, n) = (3, 10, 20_000);
        let mut rng = SplitMix64::new(11);
        let mut centers: Vec<f64> = (0..classes * features).map(|_| normal(&mut rng)).collect();
        let s = separation_scale(&centers, classes, features);
        centers.iter_mut().for_each(|c| *c *= s);
        let mut correct = 0;
        for i in 0..n {
            let class = i % classes;
            let x: Vec<f64> =
                (0..features).map(|f| centers[class * features + f] + normal(&mut rng)).collect();
            let nearest = (0..classes)
                .min_by(|&a, &b| {
                    let d = |c: usize| -> f64 {
                        (0..features).map(|f| (x[f] - centers[c * features + f]).powi(2)).sum()
                    };
                    d(a).total_cmp(&d(b))
                })
                .unwrap();
            correct += usize::from(nearest == class);
        }
        let acc = correct as f64 / n as f64;
        assert!((0.97..0.995).contains(&acc), "accuracy {acc}");
    }

    #[test]
    fn rejects_bad_arguments() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(write_blobs(dir.path(), 1, 4, 5, 5, 1), Err(Error::BadConfig(_))));
        assert!(matches!(write_blobs(dir.path(), 2, 0, 5, 5, 1), Err(Error::BadConfig(_))));
    }
}
