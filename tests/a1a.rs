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
