//! Recovery times: seconds from a SIGKILL to the job making progress again,
//! for a trainer, a pserver (a replacement started at once, as Kubernetes
//! would) and the master (a replacement started at once), on real
//! processes around a real etcd. Figures for `BENCHMARKS.md`.
//!
//!     cargo build --release --features etcd --examples
//!     target/release/examples/recovery [--runs 3] [--ttl 2]
//!
//! A job of 1 master, 2 pservers and 3 trainers trains a1a in 4 KiB tasks
//! (sync mode). After the first pass the named process is killed; the time
//! to recover is until three more tasks are stored as finished in etcd,
//! printed beside the time three tasks take with nothing killed (the
//! reference, measured in the same run just before the kill).

#[path = "../tests/support/mod.rs"]
mod support;

use oar::{discovery::EtcdDiscovery, job::keys::JobKeys};
use std::time::{Duration, Instant};
use support::{a1a_job, Cluster, Proc};

const LONG: Duration = Duration::from_secs(120);

fn main() {
    let mut runs: usize = 3;
    let mut ttl: u64 = 2;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value: Option<u64> = args.next().and_then(|v| v.parse().ok());
        match (flag.as_str(), value) {
            ("--runs", Some(v)) => runs = v as usize,
            ("--ttl", Some(v)) => ttl = v,
            _ => {
                eprintln!("usage: recovery [--runs N] [--ttl SECONDS]");
                std::process::exit(2);
            }
        }
    }
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    println!("lease ttl {ttl} s for every process; median of {runs} runs; progress = 3 more tasks stored as finished");
    println!("{:<8} {:>14} {:>16} {:>10}", "killed", "recovery (s)", "reference (s)", "all runs");
    for role in ["trainer", "pserver", "master"] {
        let mut recoveries = Vec::new();
        let mut references = Vec::new();
        for run in 0..runs {
            let (reference, recovery) = runtime.block_on(measure(role, run, ttl));
            references.push(reference);
            recoveries.push(recovery);
        }
        let all: Vec<String> = recoveries.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "{role:<8} {:>14.2} {:>16.3} {:>10}",
            median(&mut recoveries),
            median(&mut references),
            all.join(" ")
        );
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Tasks stored as finished, over all passes.
async fn finished(etcd: &EtcdDiscovery, keys: &JobKeys) -> u64 {
    match oar::task_queue::master::load(etcd, &keys.master()).await {
        Ok(Some(state)) => state.passes.iter().map(|p| p.tasks_finished).sum(),
        _ => 0,
    }
}

/// Seconds until three more tasks are finished than `from`.
async fn until_three_more(etcd: &EtcdDiscovery, keys: &JobKeys, from: u64) -> f64 {
    let start = Instant::now();
    while finished(etcd, keys).await < from + 3 {
        assert!(start.elapsed() < LONG, "no progress within {LONG:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    start.elapsed().as_secs_f64()
}

async fn measure(role: &str, run: usize, ttl: u64) -> (f64, f64) {
    let mut cluster = Cluster::start(&format!("recovery-{role}-{run}"));
    cluster.lease_ttl = ttl;
    let mut job = a1a_job();
    job.extend(["--chunk-bytes", "4096", "--task-timeout", "600", "--passes", "1000"].map(String::from));
    let mut master = cluster.master("master", &job);
    let mut pservers: Vec<Proc> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let mut trainers: Vec<Proc> = (0..3).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let seen = master.wait_for_line(LONG, |l| l.starts_with("pass 1/"));
    assert!(seen.is_some(), "the job did not start\n{}", master.dump());

    let etcd = EtcdDiscovery::connect(&[cluster.etcd.endpoint()]).await.expect("etcd");
    let keys = JobKeys::new(&cluster.job).expect("job keys");
    let reference = until_three_more(&etcd, &keys, finished(&etcd, &keys).await).await;

    let before = finished(&etcd, &keys).await;
    let _replacement = match role {
        "trainer" => {
            trainers[1].kill();
            None
        }
        "pserver" => {
            pservers[0].kill();
            Some(cluster.pserver("pserver-new", 1.0))
        }
        _ => {
            master.kill();
            Some(cluster.master("master-new", &job))
        }
    };
    // A report in flight at the kill may still land: count from the kill.
    let recovery = until_three_more(&etcd, &keys, before).await;
    (reference, recovery)
}
