//! Softmax regression on the UCI Adult data (a1a / a1a.t) through the whole
//! stack: master, 2 pservers and 3 trainers in one process, talking over
//! QUIC with mutual TLS on 127.0.0.1.

mod support;

use oar::{
    job::{config::JobConfig, report::JobReport},
    pserver::{Mode, OptimizerConfig},
    transport::{DevCa, QuicTransport},
};
use std::sync::Arc;

fn a1a_config(mode: Mode) -> JobConfig {
    let mut config = support::a1a_softmax(mode);
    config.passes = 8;
    config.batch_size = 32;
    config.optimizer = OptimizerConfig::Sgd { lr: 0.2 };
    config
}

async fn train(config: JobConfig) -> JobReport {
    let mut passes = Vec::new();
    let transport = Arc::new(QuicTransport::new(DevCa::new().unwrap().tls_config("a1a").unwrap()).unwrap());
    let report = support::run_in_process(&config, 3, transport, "127.0.0.1:0", |p| passes.push(p.clone()))
        .await
        .unwrap();
    eprintln!("{passes:#?}\n{report:#?}");
    assert!(report.is_done());
    assert_eq!(passes.len(), config.passes as usize, "one progress report per pass");
    assert_eq!(report.tasks_discarded, 0);
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn softmax_on_adult_reaches_82_percent_in_sync_mode() {
    let report = train(a1a_config(Mode::Sync)).await;
    assert!(report.test_accuracy >= 0.82, "test accuracy {}", report.test_accuracy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn softmax_on_adult_reaches_82_percent_in_async_mode() {
    let mut config = a1a_config(Mode::Async);
    config.push_every = 2;
    config.pull_every = 2;
    let report = train(config).await;
    assert!(report.test_accuracy >= 0.82, "test accuracy {}", report.test_accuracy);
}

/// CPU hogs: `yes` processes writing to nowhere, killed when dropped.
struct Hogs(Vec<std::process::Child>);

impl Hogs {
    fn start(n: usize) -> Hogs {
        let spawn = || {
            std::process::Command::new("yes")
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("start a `yes` CPU hog")
        };
        Hogs((0..n).map(|_| spawn()).collect())
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for hog in &mut self.0 {
            let _ = hog.kill();
            let _ = hog.wait();
        }
    }
}

/// What a new user runs (`examples/local.rs` on a1a in async mode, every
/// default: 5 passes, batch 64, SGD at 0.1, push and pull every batch, 3
/// trainers, 2 pservers, QUIC) reaches sync mode's accuracy (83.3% on
/// a1a.t) on a quiet machine and with two CPU hogs taking the cores from
/// it: at least half the runs (the lower median) reach 83%, and no run
/// ends below 82.5%.
///
/// Async once lagged sync here (81.1-82.2%) because with overlap most due
/// pushes were merged and averaged into one update: about 9 updates a pass
/// instead of 29. Merging just four (the old limit) still ends at
/// 82.3-82.7%: both fail the median.
///
/// Why a median and not every run: the seed sets only the initial
/// parameters, so quiet runs see one order of the data and land within
/// 83.33-83.41%. Under load the order in which the trainers' batches reach
/// the pservers changes from run to run, and with it the end point: in 100
/// loaded runs of each mode (2026-11-27), async ended at 82.73-83.61%
/// (median 83.37%, 3 runs below 83%) and sync at 83.14-83.44% (median
/// 83.26%; an earlier batch had one at 82.94%). A bar on every one of the
/// 12 runs thus fails about one suite run in five, and it failed CI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_a1a_with_the_default_options_reaches_sync_accuracy_also_under_load() {
    let runs = std::env::var("OAR_A1A_RUNS").ok().and_then(|n| n.parse().ok()).unwrap_or(6u64);
    let mut accuracies = Vec::new();
    for hogged in [false, true] {
        let _hogs = hogged.then(|| Hogs::start(2));
        for seed in 1..=runs {
            let model = oar::trainer::ModelConfig::Softmax { features: 123, classes: 2 };
            let mut config = JobConfig::new(&support::testdata("a1a"), model);
            config.test_data = Some(support::testdata("a1a.t"));
            config.mode = Mode::Async;
            config.seed = seed;
            let transport =
                Arc::new(QuicTransport::new(DevCa::new().unwrap().tls_config("a1a").unwrap()).unwrap());
            let report = support::run_in_process(&config, 3, transport, "127.0.0.1:0", |_| {}).await.unwrap();
            assert!(report.is_done(), "{report:?}");
            accuracies.push((hogged, seed, report.test_accuracy));
        }
    }
    eprintln!("(under load, seed, test accuracy): {accuracies:?}");
    for hogged in [false, true] {
        let condition = if hogged { "under load" } else { "on a quiet machine" };
        let mut runs: Vec<f32> =
            accuracies.iter().filter(|(h, _, _)| *h == hogged).map(|(_, _, accuracy)| *accuracy).collect();
        runs.sort_by(f32::total_cmp);
        let median = runs[(runs.len() - 1) / 2];
        assert!(median >= 0.83, "median {median} of the runs {condition}: {runs:?}");
        assert!(runs[0] >= 0.825, "a run {condition} ended at {}: {runs:?}", runs[0]);
    }
}
