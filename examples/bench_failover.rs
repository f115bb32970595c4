//! How long a shard is away when its primary is SIGKILLed: replicated (the
//! most advanced follower takes over) beside one replica restored from its
//! checkpoint on another pserver, on real processes around a real etcd,
//! measured in the same run.
//!
//!     cargo build --release --all-features --examples
//!     target/release/examples/bench_failover --rounds 5
//!
//! Each setup runs an async a1a job (`master`, two `trainer`s, `pserver`s
//! with `--lease-ttl 2`). A round SIGKILLs the primary of shard 0, starts a
//! new pserver, and waits until every shard has all its replicas again. The
//! time is from the kill to the first call a trainer had answered by the
//! shard's new primary (from the trainers' logs). Target: at most the lease
//! TTL + 0.5 s. Medians of `--rounds` (default 5).

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use support::{wait_until, ReplicatedJob, LONG};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut rounds = 5usize;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--rounds", Some(v)) => rounds = v.parse().unwrap_or(5).max(1),
            _ => {
                eprintln!("usage: bench_failover [--rounds N]");
                std::process::exit(2);
            }
        }
    }
    println!("SIGKILL of shard 0's primary -> first call answered by its new primary; lease TTL 2 s; {rounds} rounds");
    println!("{:>34} {:>9} {:>9} {:>9}", "setup", "median s", "min s", "max s");
    let setups = [("replicated, R=2, 3 pservers", 2, 3), ("checkpoint restart, R=1, 2 pservers", 1, 2)];
    for (label, replicas, pservers) in setups {
        let mut job = ReplicatedJob::start(&format!("failover-r{replicas}"), "async", replicas, pservers, 2);
        job.checkpoint_interval = 1.0;
        let mut away = Vec::new();
        for _ in 0..rounds {
            let (_, killed_at) = job.kill_primary(0);
            // The trainers log the new primary on their next call.
            let answered = wait_until(LONG, || job.away_since(0, killed_at).is_some());
            assert!(answered, "no trainer reached shard 0's new primary\n{}", job.dump());
            away.extend(job.away_since(0, killed_at));
        }
        let (min, max) =
            (away.iter().copied().fold(f64::MAX, f64::min), away.iter().copied().fold(0.0, f64::max));
        println!("{label:>34} {:>9.2} {min:>9.2} {max:>9.2}", median(&mut away));
    }
    println!("target: replicated <= lease TTL + 0.5 s = 2.5 s");
}
