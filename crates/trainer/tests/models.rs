//! Checks of the built-in models: gradients against finite differences of an
//! independent f64 reference, training progress, and predictions.

use oar_pserver::rng::SplitMix64;
use oar_pserver::ParamBuf;
use oar_trainer::{
    model::{Example, Model},
    ModelConfig,
};

fn normal(rng: &mut SplitMix64) -> f64 {
    f64::from(rng.next_normal())
}

/// Random sparse examples with labels in `[0, classes)`.
fn random_batch(rng: &mut SplitMix64, n: usize, features: usize, classes: usize) -> Vec<Example> {
    (0..n)
        .map(|_| Example {
            label: (rng.next_u64() % classes as u64) as u32,
            features: (0..features as u32)
                .filter_map(|i| {
                    let keep = rng.next_f32() < 0.7;
                    let v = normal(rng) as f32;
                    keep.then_some((i, v))
                })
                .collect(),
        })
        .collect()
}

fn random_params(model: &dyn Model, rng: &mut SplitMix64, scale: f64) -> ParamBuf {
    let mut p = ParamBuf::zeros(&model.param_specs());
    for v in p.as_mut_slice() {
        *v = (normal(rng) * scale) as f32;
    }
    p
}

/// Sizes of the hidden layer for the reference (None for softmax regression).
fn hidden_of(cfg: &ModelConfig) -> Option<usize> {
    match cfg {
        ModelConfig::Softmax { .. } => None,
        ModelConfig::Mlp { hidden, .. } => Some(*hidden),
        ModelConfig::Ctr(_) => unreachable!("the dense models' tests build no CTR model"),
    }
}

/// Straightforward f64 logits of one example; `p` is the flat parameter buffer.
fn reference_logits(p: &[f64], f: usize, hidden: Option<usize>, c: usize, ex: &Example) -> Vec<f64> {
    let mut x = vec![0.0; f];
    for &(i, v) in &ex.features {
        x[i as usize] += f64::from(v);
    }
    let affine = |input: &[f64], w: &[f64], b: &[f64], out: usize| -> Vec<f64> {
        (0..out)
            .map(|k| b[k] + input.iter().enumerate().map(|(j, xj)| xj * w[j * out + k]).sum::<f64>())
            .collect()
    };
    match hidden {
        None => affine(&x, &p[..f * c], &p[f * c..f * c + c], c),
        Some(h) => {
            let (w1, rest) = p.split_at(f * h);
            let (b1, rest) = rest.split_at(h);
            let (w2, b2) = rest.split_at(h * c);
            let hid: Vec<f64> = affine(&x, w1, b1, h).into_iter().map(|v| v.max(0.0)).collect();
            affine(&hid, w2, b2, c)
        }
    }
}

fn reference_loss(p: &[f64], f: usize, hidden: Option<usize>, c: usize, batch: &[Example]) -> f64 {
    let total: f64 = batch
        .iter()
        .map(|ex| {
            let z = reference_logits(p, f, hidden, c, ex);
            let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
            lse - z[ex.label as usize]
        })
        .sum();
    total / batch.len() as f64
}

fn check_gradient(cfg: ModelConfig, seed: u64) {
    let model = cfg.build().unwrap();
    let (f, c, hidden) = (model.features(), model.classes(), hidden_of(&cfg));
    let mut rng = SplitMix64::new(seed);
    let params = random_params(model.as_ref(), &mut rng, 0.7);
    let batch = random_batch(&mut rng, 5, f, c);
    let mut grads = ParamBuf::zeros(&model.param_specs());
    grads.fill(123.0); // must be overwritten
    let loss = model.loss_and_grad(&params, &batch, &mut grads);

    let mut p: Vec<f64> = params.as_slice().iter().map(|&v| f64::from(v)).collect();
    let ref_loss = reference_loss(&p, f, hidden, c, &batch);
    assert!(
        (f64::from(loss) - ref_loss).abs() < 1e-5 * ref_loss.abs().max(1.0),
        "{cfg:?}: loss {loss} vs reference {ref_loss}"
    );
    let eps = 1e-5;
    let mut checked = 0;
    for (i, &g) in grads.as_slice().iter().enumerate() {
        let orig = p[i];
        p[i] = orig + eps;
        let up = reference_loss(&p, f, hidden, c, &batch);
        p[i] = orig - eps;
        let down = reference_loss(&p, f, hidden, c, &batch);
        p[i] = orig;
        let numeric = (up - down) / (2.0 * eps);
        let g = f64::from(g);
        let err = (g - numeric).abs();
        if numeric.abs() > 1e-4 {
            assert!(err / numeric.abs() < 1e-2, "{cfg:?} coordinate {i}: analytic {g} vs numeric {numeric}");
            checked += 1;
        } else {
            assert!(err < 1e-5, "{cfg:?} coordinate {i}: analytic {g} vs numeric {numeric}");
        }
    }
    assert!(checked > grads.as_slice().len() / 2, "{cfg:?}: only {checked} coordinates checked");
}

#[test]
fn softmax_gradient_matches_finite_differences() {
    for (seed, classes) in [(1, 2), (2, 3), (3, 5)] {
        check_gradient(ModelConfig::Softmax { features: 6, classes }, seed);
    }
}

#[test]
fn mlp_gradient_matches_finite_differences() {
    for (seed, classes) in [(4, 2), (5, 3), (6, 4)] {
        check_gradient(ModelConfig::Mlp { features: 5, hidden: 7, classes }, seed);
    }
}

/// The model's own f32 loss, differenced with a coarser step, agrees too.
#[test]
fn gradient_matches_f32_finite_differences_of_the_model() {
    for cfg in [
        ModelConfig::Softmax { features: 4, classes: 3 },
        ModelConfig::Mlp { features: 4, hidden: 5, classes: 3 },
    ] {
        let model = cfg.build().unwrap();
        let mut rng = SplitMix64::new(99);
        let mut params = random_params(model.as_ref(), &mut rng, 0.5);
        let batch = random_batch(&mut rng, 4, 4, 3);
        let mut grads = ParamBuf::zeros(&model.param_specs());
        let mut scratch = ParamBuf::zeros(&model.param_specs());
        model.loss_and_grad(&params, &batch, &mut grads);
        let eps = 1e-3f32;
        for i in 0..grads.as_slice().len() {
            let orig = params.as_slice()[i];
            params.as_mut_slice()[i] = orig + eps;
            let up = model.loss_and_grad(&params, &batch, &mut scratch);
            params.as_mut_slice()[i] = orig - eps;
            let down = model.loss_and_grad(&params, &batch, &mut scratch);
            params.as_mut_slice()[i] = orig;
            let numeric = (up - down) / (2.0 * eps);
            let g = grads.as_slice()[i];
            assert!(
                (g - numeric).abs() <= 1e-2 * g.abs() + 1e-3,
                "{cfg:?} coordinate {i}: analytic {g} vs numeric {numeric}"
            );
        }
    }
}

/// Two classes split by the sign of x0 - x1, with a margin.
fn separable_set(rng: &mut SplitMix64, n: usize) -> Vec<Example> {
    (0..n)
        .map(|i| {
            let label = (i % 2) as u32;
            let d = 0.5 + rng.next_f32();
            let base = normal(rng) as f32;
            let (a, b) = if label == 1 { (base + d, base) } else { (base, base + d) };
            Example { label, features: vec![(0, a), (1, b), (2, normal(rng) as f32)] }
        })
        .collect()
}

#[test]
fn sgd_decreases_the_loss_on_a_separable_set() {
    for cfg in [
        ModelConfig::Softmax { features: 3, classes: 2 },
        ModelConfig::Mlp { features: 3, hidden: 8, classes: 2 },
    ] {
        let model = cfg.build().unwrap();
        let mut rng = SplitMix64::new(5);
        let data = separable_set(&mut rng, 64);
        let mut params = ParamBuf::init(&model.param_specs(), 17);
        let mut grads = ParamBuf::zeros(&model.param_specs());
        let first = model.loss_and_grad(&params, &data, &mut grads);
        let mut last = first;
        for _ in 0..50 {
            last = model.loss_and_grad(&params, &data, &mut grads);
            for (p, g) in params.as_mut_slice().iter_mut().zip(grads.as_slice()) {
                *p -= 0.5 * g;
            }
        }
        assert!(last < 0.5 * first, "{cfg:?}: loss {first} -> {last}");
        let mut preds = Vec::new();
        model.predict(&params, &data, &mut preds);
        let correct = preds.iter().zip(&data).filter(|(p, e)| **p == e.label).count();
        assert!(correct >= 60, "{cfg:?}: {correct}/64 correct");
    }
}

#[test]
fn predict_is_the_argmax_and_reports_the_same_loss() {
    for cfg in [
        ModelConfig::Softmax { features: 6, classes: 4 },
        ModelConfig::Mlp { features: 6, hidden: 5, classes: 4 },
    ] {
        let model = cfg.build().unwrap();
        let (f, c, hidden) = (6, 4, hidden_of(&cfg));
        let mut rng = SplitMix64::new(8);
        let params = random_params(model.as_ref(), &mut rng, 1.0);
        let batch = random_batch(&mut rng, 20, f, c);
        let mut preds = vec![99; 3]; // must be replaced
        let loss = model.predict(&params, &batch, &mut preds);
        let mut grads = ParamBuf::zeros(&model.param_specs());
        let train_loss = model.loss_and_grad(&params, &batch, &mut grads);
        assert!((loss - train_loss).abs() < 1e-6, "{loss} vs {train_loss}");
        assert_eq!(preds.len(), batch.len());
        let p: Vec<f64> = params.as_slice().iter().map(|&v| f64::from(v)).collect();
        for (ex, &pred) in batch.iter().zip(&preds) {
            let z = reference_logits(&p, f, hidden, c, ex);
            let best = z[pred as usize];
            assert!(z.iter().all(|&v| v <= best + 1e-5), "{cfg:?}: pred {pred} for logits {z:?}");
        }
    }
}

#[test]
fn empty_batch_has_zero_loss_and_gradient() {
    let model = ModelConfig::Mlp { features: 3, hidden: 2, classes: 2 }.build().unwrap();
    let params = ParamBuf::init(&model.param_specs(), 1);
    let mut grads = ParamBuf::zeros(&model.param_specs());
    grads.fill(1.0);
    assert_eq!(model.loss_and_grad(&params, &[], &mut grads), 0.0);
    assert!(grads.as_slice().iter().all(|&g| g == 0.0));
    let mut preds = vec![1];
    assert_eq!(model.predict(&params, &[], &mut preds), 0.0);
    assert!(preds.is_empty());
}
