//! A user-defined update rule running on the pservers, without any change
//! to oar: SGD with a learning rate that decays with the step and with the
//! gradient clipped to a maximum norm. It implements
//! [`oar::pserver::Optimizer`] and reaches the pservers through
//! [`Plugins::optimizer`](oar::job::Plugins); a cluster's
//! `pserver` binary would pass the same `Plugins` in its `JobContext`.
//!
//!     cargo run --release --example custom_optimizer
//!
//! Trains softmax regression on `testdata/a1a` with 2 pservers and 3
//! trainers in one process, over QUIC on 127.0.0.1, prints one line per pass
//! and how many updates the rule applied, then the report as JSON; exits 1
//! if the job failed or the model does not reach 82% on `a1a.t`.

use oar::{
    discovery::MemDiscovery,
    job::{
        config::JobConfig,
        local::{run_local, LocalOptions},
        report::Progress,
        JobContext, Plugins,
    },
    pserver::{Optimizer, OptimizerConfig, OptimizerFactory, OptimizerState},
    trainer::ModelConfig,
    transport::{DevCa, QuicTransport},
};
use std::{
    process::ExitCode,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

/// `lr_t = lr / (1 + decay * t)` for the block's update count `t`, and the
/// block's gradient scaled down to norm `max_norm` when it is longer.
/// (`apply` sees one block at a time, so the clipping is per block.)
struct ScheduledClippedSgd {
    lr: f32,
    decay: f32,
    max_norm: f32,
    /// Updates applied and gradients clipped, over every pserver of the
    /// process: what shows the rule ran (printed at the end).
    applied: Arc<AtomicU64>,
    clipped: Arc<AtomicU64>,
}

impl Optimizer for ScheduledClippedSgd {
    fn name(&self) -> &str {
        "scheduled-clipped-sgd"
    }

    fn state_slots(&self) -> usize {
        0 // The step count lives in `state.step`; nothing per element.
    }

    fn apply(&self, params: &mut [f32], grad: &[f32], state: &mut OptimizerState) {
        let norm = grad.iter().map(|g| g * g).sum::<f32>().sqrt();
        let clip = if norm > self.max_norm {
            self.clipped.fetch_add(1, Ordering::Relaxed);
            self.max_norm / norm
        } else {
            1.0
        };
        self.applied.fetch_add(1, Ordering::Relaxed);
        let lr = self.lr / (1.0 + self.decay * state.step as f32) * clip;
        for (p, g) in params.iter_mut().zip(grad) {
            *p -= lr * g;
        }
        state.step += 1;
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
    let mut config =
        JobConfig::new(&format!("{root}/testdata/a1a"), ModelConfig::Softmax { features: 123, classes: 2 });
    config.test_data = Some(format!("{root}/testdata/a1a.t"));
    config.passes = 5;
    // Names the job's choice in its options; the plugin below replaces it on the pservers.
    config.optimizer = OptimizerConfig::parse("sgd", 0.5)?;
    let (applied, clipped) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let counters = (applied.clone(), clipped.clone());
    let plugins = Plugins {
        optimizer: Some(OptimizerFactory::new(move || {
            let (applied, clipped) = counters.clone();
            Box::new(ScheduledClippedSgd { lr: 0.5, decay: 0.01, max_norm: 1.0, applied, clipped })
        })),
        ..Plugins::default()
    };
    let transport = Arc::new(QuicTransport::new(DevCa::new()?.tls_config("custom-optimizer")?)?);
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
    let (applied, clipped) = (applied.load(Ordering::Relaxed), clipped.load(Ordering::Relaxed));
    println!("scheduled-clipped-sgd: {applied} block updates applied, {clipped} gradients clipped");
    println!("{}", report.to_json());
    Ok(if report.is_done() && report.test_accuracy >= 0.82 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
