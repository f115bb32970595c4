//! A job's checkpoints belong to its run: under the pservers'
//! `--checkpoint-dir` they go to `<job>/<instance>/`, where the instance is
//! a random id the job's first master creates. The same job name run again
//! on fresh keys (here: a new in-memory discovery, as every `run_local`
//! has) starts from its initial values, not from the last run's model.

use crate::support;

use oar::{
    discovery::MemDiscovery,
    job::{
        local::{run_local, LocalOptions},
        JobContext,
    },
    pserver::Mode,
    transport::{MemNetwork, MemTransport},
};
use std::{path::Path, sync::Arc, time::Duration};

/// One sync trainer on a1a for one pass, checkpoints under `root`: the
/// final training loss, which is the same bits from the same start.
async fn run_once(root: &Path) -> f64 {
    let mut config = support::a1a_softmax(Mode::Sync);
    config.passes = 1;
    let transport = Arc::new(MemTransport::new(MemNetwork::new()));
    let ctx = JobContext::new("again", Arc::new(MemDiscovery::new()), transport, "mem:0");
    let mut options = LocalOptions { trainers: 1, ..LocalOptions::default() };
    options.roles.checkpoint_dir = Some(root.to_path_buf());
    options.roles.checkpoint_interval = Duration::from_millis(50);
    let report = run_local(&ctx, &config, &options, |_| {}).await.expect("the job runs");
    assert!(report.is_done(), "{report:?}");
    report.final_loss
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_job_name_run_afresh_does_not_resume_from_the_last_run() {
    let root = tempfile::tempdir().unwrap();
    let first = run_once(root.path()).await;
    let second = run_once(root.path()).await;
    assert_eq!(first.to_bits(), second.to_bits(), "the second run trained from the initial values too");
    let runs: Vec<_> =
        std::fs::read_dir(root.path().join("again")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 2, "one directory per run: {runs:?}");
    for run in &runs {
        let shard = std::fs::read_dir(run).unwrap().next().expect("a shard's directory").unwrap().path();
        let checkpoints = std::fs::read_dir(&shard).unwrap().count();
        assert!(checkpoints > 0, "{} holds checkpoints", shard.display());
    }
}
