//! A job's start: what it refuses before anything runs, and the waits that
//! end with an error instead of going on for ever.

use crate::support;

use oar::{
    discovery::MemDiscovery,
    job::{
        config::JobConfig,
        role::{self, RoleOptions},
        JobContext,
    },
    pserver::Mode,
    trainer::ModelConfig,
    transport::{DevCa, MemNetwork, MemTransport, QuicTransport},
};
use std::{sync::Arc, time::Duration};
use tokio_util::sync::CancellationToken;

/// Training data whose files are all empty is refused at the start, naming
/// the data, not with the task queue's own "no tasks".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_training_data_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.svm");
    std::fs::File::create(&path).unwrap();
    let config = JobConfig::new(path.to_str().unwrap(), ModelConfig::Softmax { features: 123, classes: 2 });
    let transport = Arc::new(MemTransport::new(MemNetwork::new()));
    let run = support::run_in_process(&config, 1, transport, "mem:0", |_| {});
    let ran = tokio::time::timeout(Duration::from_secs(60), run).await;
    let err = ran.expect("refused at once, not a hang").unwrap_err().to_string();
    assert!(err.contains("no training data") && err.contains("empty.svm"), "{err}");
}

/// A job's first master whose pservers never come stops after its start-up
/// timeout, saying which shards have none, instead of waiting silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_master_without_pservers_stops_after_its_startup_timeout() {
    let config = support::a1a_softmax(Mode::Async);
    let transport = Arc::new(MemTransport::new(MemNetwork::new()));
    let ctx = JobContext::new("no-pservers", Arc::new(MemDiscovery::new()), transport, "mem:0");
    let options = RoleOptions { startup_timeout: Duration::from_secs(1), ..RoleOptions::new("master") };
    let run = role::master(&ctx, &config, &options, CancellationToken::new(), |_| {});
    let ran = tokio::time::timeout(Duration::from_secs(30), run).await;
    let err = ran.expect("the wait has a deadline").unwrap_err().to_string();
    assert!(err.contains("had no registered primary within 1s"), "{err}");
}

/// A master that cannot listen (its address in use) leaves the job's name
/// free: its options and first state are taken back and its lock released
/// at once, so a start with other options is not refused as "started with
/// other options" by a job that never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_cannot_listen_leaves_the_job_name_free() {
    let busy = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();
    let discovery = Arc::new(MemDiscovery::new());
    let transport =
        Arc::new(QuicTransport::new(DevCa::new().unwrap().tls_config("startup").unwrap()).unwrap());
    let config = support::a1a_softmax(Mode::Async);
    let ctx = JobContext::new("reused", discovery.clone(), transport.clone(), &busy_addr);
    let options = RoleOptions::new("master-1");
    let first = role::master(&ctx, &config, &options, CancellationToken::new(), |_| {});
    let err = first.await.unwrap_err().to_string();
    assert!(err.contains("in use"), "{err}");

    // The same name, other options, a free address: past the options and
    // the lock (a standby would wait for a held one: 1 s here), it stops
    // only for want of pservers.
    let mut other = config.clone();
    other.passes += 1;
    let ctx = JobContext::new("reused", discovery, transport, "127.0.0.1:0");
    let options = RoleOptions {
        standby_timeout: Duration::from_secs(1),
        startup_timeout: Duration::from_secs(1),
        ..RoleOptions::new("master-2")
    };
    let second = role::master(&ctx, &other, &options, CancellationToken::new(), |_| {});
    let ran = tokio::time::timeout(Duration::from_secs(30), second).await;
    let err = ran.expect("no hang").unwrap_err().to_string();
    assert!(err.contains("had no registered primary"), "{err}");
}
