//! A user-defined model trained through oar, without any change to oar:
//! binary logistic regression with L2 regularisation, written from scratch
//! against [`oar::trainer::model::Model`] (one weight per feature and a
//! bias; the built-in softmax regression keeps a weight per class). It
//! reaches every role through [`Plugins::model`](oar::job::Plugins):
//! trainers train it, pservers hold its parameters, the master scores it.
//!
//!     cargo run --release --example custom_model
//!
//! Trains on `testdata/a1a` with 2 pservers and 3 trainers in one process,
//! over QUIC on 127.0.0.1, prints one line per pass and the report as JSON;
//! exits 1 if the job failed or the model does not reach 82% on `a1a.t`.

use oar::{
    discovery::MemDiscovery,
    job::{
        config::JobConfig,
        local::{run_local, LocalOptions},
        report::Progress,
        JobContext, Plugins,
    },
    pserver::{Init, ParamBuf, ParamSpec},
    trainer::{
        model::{Example, Model},
        ModelConfig,
    },
    transport::{DevCa, QuicTransport},
};
use std::{
    process::ExitCode,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

/// `p(y = 1 | x) = sigmoid(w·x + b)`, loss = mean log loss + `l2/2 · |w|²`.
struct L2Logistic {
    features: usize,
    l2: f32,
    /// Examples whose gradients this model computed (over every trainer of
    /// the process): what shows it was trained (printed at the end).
    trained: AtomicU64,
}

impl L2Logistic {
    /// `w·x + b` for one example (feature indices past `features` are ignored).
    fn score(&self, params: &ParamBuf, example: &Example) -> f32 {
        let (w, b) = (params.param(0), params.param(1)[0]);
        example.features.iter().filter_map(|&(i, v)| w.get(i as usize).map(|w| w * v)).sum::<f32>() + b
    }

    /// Log loss `ln(1 + e^-m)` of one example with score `z`, where the
    /// margin `m` is `z` for a positive example and `-z` for a negative one
    /// (written to stay finite for any `m`).
    fn log_loss(z: f32, positive: bool) -> f32 {
        let m = if positive { z } else { -z };
        if m >= 0.0 {
            (-m).exp().ln_1p()
        } else {
            -m + m.exp().ln_1p()
        }
    }
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

impl Model for L2Logistic {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec { name: "w".into(), shape: vec![self.features], init: Init::Zeros },
            ParamSpec { name: "b".into(), shape: vec![1], init: Init::Zeros },
        ]
    }

    fn features(&self) -> usize {
        self.features
    }

    fn classes(&self) -> usize {
        2
    }

    fn loss_and_grad(&self, params: &ParamBuf, batch: &[Example], grads: &mut ParamBuf) -> f32 {
        self.trained.fetch_add(batch.len() as u64, Ordering::Relaxed);
        grads.fill(0.0);
        if batch.is_empty() {
            return 0.0;
        }
        let n = batch.len() as f32;
        let mut loss = 0.0;
        for example in batch.iter().filter(|e| e.label < 2) {
            let z = self.score(params, example);
            let positive = example.label == 1;
            loss += Self::log_loss(z, positive);
            // d loss / d z = sigmoid(z) - y, averaged over the batch.
            let dz = (sigmoid(z) - if positive { 1.0 } else { 0.0 }) / n;
            let gw = grads.param_mut(0);
            for &(i, v) in &example.features {
                if let Some(g) = gw.get_mut(i as usize) {
                    *g += dz * v;
                }
            }
            grads.param_mut(1)[0] += dz;
        }
        let w = params.param(0);
        let penalty: f32 = w.iter().map(|w| w * w).sum::<f32>() * self.l2 / 2.0;
        for (g, w) in grads.param_mut(0).iter_mut().zip(w) {
            *g += self.l2 * w;
        }
        loss / n + penalty
    }

    fn predict(&self, params: &ParamBuf, batch: &[Example], out: &mut Vec<u32>) -> f32 {
        out.clear();
        let mut loss = 0.0;
        for example in batch {
            let z = self.score(params, example);
            out.push(u32::from(z > 0.0));
            loss += Self::log_loss(z, example.label == 1);
        }
        if batch.is_empty() {
            0.0
        } else {
            loss / batch.len() as f32
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let root = env!("CARGO_MANIFEST_DIR");
    // `model` here only tells the readers the data's shape: 123 features, 2 classes.
    let mut config =
        JobConfig::new(&format!("{root}/testdata/a1a"), ModelConfig::Softmax { features: 123, classes: 2 });
    config.test_data = Some(format!("{root}/testdata/a1a.t"));
    config.passes = 5;
    config.optimizer = oar::pserver::OptimizerConfig::parse("sgd", 0.5)?;
    let model = Arc::new(L2Logistic { features: 123, l2: 1e-4, trained: AtomicU64::new(0) });
    let plugins = Plugins { model: Some(model.clone()), ..Plugins::default() };
    let transport = Arc::new(QuicTransport::new(DevCa::new()?.tls_config("custom-model")?)?);
    let discovery = Arc::new(MemDiscovery::new());
    let ctx = JobContext { plugins, ..JobContext::new("local", discovery, transport, "127.0.0.1:0") };
    let report = run_local(&ctx, &config, &LocalOptions::default(), |event| {
        let Progress::PassEnded(p) = event else { return };
        println!(
            "pass {}: train loss {:.4}, test accuracy {:.2}%",
            p.pass + 1,
            p.train_loss,
            p.test_accuracy * 100.0
        )
    })
    .await?;
    println!("l2-logistic: gradients of {} examples computed", model.trained.load(Ordering::Relaxed));
    println!("{}", report.to_json());
    Ok(if report.is_done() && report.test_accuracy >= 0.82 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
