//! Elastic jobs on real processes around a real etcd: while a1a trains,
//! the pservers go 2 → 3 → 1 (`status --set-pservers`) and the trainers
//! 1 → 4 → 2, in sync and async mode, with one and two replicas per shard;
//! with two, a pserver being drained is SIGKILLed mid-drain.
//!
//! What is counted, exactly: every task done once (the master's report);
//! every push a trainer saw a shard take applied there once (each
//! pserver's report of the pushes each shard applied, against the sum of
//! the trainers' per-shard acknowledgements, stopped trainers included);
//! the bytes a scale-out moved (the newcomer's `oar_ps_catch_up_bytes`)
//! at most a third of the state plus one shard; and bad scale requests
//! refused by name, the job unharmed.
#![cfg(feature = "etcd")]

use crate::support;

use std::time::Duration;
use support::{metric_value, metrics_addr, scrape, wait_until, JobShape, ReplicatedJob as Job, LONG};

/// Floats of the a1a model (123 features × 2 classes + 2 biases).
const MODEL_FLOATS: u64 = 248;
/// Largest shard with the model in blocks of 32 floats over 8 shards (a
/// weight block and the bias block together, at most).
const LARGEST_SHARD_FLOATS: u64 = 34;

/// `oar_ps_catch_up_bytes_total` of the live pserver at `index`.
fn catch_up_bytes(job: &Job, index: usize) -> u64 {
    let addr = metrics_addr(&job.pservers[index]).expect("the pserver serves metrics");
    metric_value(&scrape(&addr), "oar_ps_catch_up_bytes_total") as u64
}

/// The pservers the status names as holding shards (`nodes`), as the
/// status line prints them: how many hold a replica of some shard.
fn holders(status: &str) -> usize {
    let mut names: Vec<&str> = status
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with("shard ") && l.contains(':'))
        .flat_map(|l| l.split(':').nth(1).into_iter().flat_map(str::split_whitespace))
        .filter(|w| w.starts_with("pserver-"))
        .collect();
    names.sort();
    names.dedup();
    names.len()
}

fn grow_and_shrink(name: &str, mode: &'static str, replicas: u32) {
    let shape = JobShape {
        mode,
        replicas,
        pservers: 2,
        trainers: 1,
        pserver_flags: vec!["--metrics", "127.0.0.1:0"],
        job_flags: vec!["--optimizer", "adam", "--lr", "0.01"],
        block_size: 32,
        pserver_log: None,
    };
    let mut job = Job::launch(name, shape);

    // Trainers 1 → 4: each newcomer gets tasks and (sync) joins the barrier.
    for _ in 0..3 {
        job.add_trainer();
    }
    for trainer in 1..4 {
        let id = format!("trainer-{trainer}");
        let trains = wait_until(LONG, || job.trainers[trainer].stderr().contains("task "));
        assert!(trains, "{id} never got a task\n{}", job.dump());
    }

    // Bad requests: refused by name, nothing changes.
    for (count, why) in [(0, "at least one pserver, not 0"), (9, "9 pservers for 8 shards")] {
        let err = job.scale(count).expect_err("a bad count is refused");
        assert!(err.contains(why), "--set-pservers {count}: {err}");
    }

    // Pservers 2 → 3.
    let before: u64 = job.live.iter().map(|&i| catch_up_bytes(&job, i)).sum();
    let said = job.scale(3).expect("scale to 3");
    assert!(said.contains("2 -> 3"), "{said}");
    let err = job.scale(2).expect_err("refused while a scale is under way");
    assert!(err.contains("a move is in flight"), "{err}");
    job.add_pserver();
    let newcomer = *job.live.last().unwrap();
    // OK: nothing moves and nothing is left to balance.
    let balanced = wait_until(LONG, || {
        let status = job.cluster.status();
        status.contains("cluster OK") && holders(&status) == 3
    });
    assert!(balanced, "never balanced over 3 pservers\n{}", job.dump());
    let after: u64 = job.live.iter().map(|&i| catch_up_bytes(&job, i)).sum();
    let moved = after - before;
    // Adam: parameters and two slots per float.
    let state = MODEL_FLOATS * 3 * 4 * replicas as u64;
    let one_shard = LARGEST_SHARD_FLOATS * 3 * 4;
    assert_eq!(moved, catch_up_bytes(&job, newcomer), "only the newcomer received shards");
    assert!(moved > 0 && moved <= state / 3 + one_shard, "a scale-out to 3 moved {moved} of {state} bytes");
    eprintln!("{name}: the scale-out to 3 moved {moved} of {state} bytes");

    // Trainers 4 → 2.
    job.stop_trainer(3);
    job.stop_trainer(1);

    // Pservers 3 → 1: the two highest-numbered are drained and released;
    // with two replicas, one of them is SIGKILLed mid-drain.
    job.scale(1).expect("scale to 1");
    let drained: Vec<usize> = job.live[1..].to_vec();
    if replicas > 1 {
        let draining = wait_until(LONG, || job.cluster.status().contains("draining"));
        assert!(draining, "no drain began\n{}", job.dump());
        job.kill(drained[0]);
        eprintln!("{name}: SIGKILLed {} mid-drain", job.pservers[drained[0]].name);
    }
    for &index in &drained[usize::from(replicas > 1)..] {
        job.wait_released(index);
    }
    let shrunk = wait_until(LONG, || {
        let status = job.cluster.status();
        holders(&status) == 1 && !status.contains("draining") && !status.contains("not caught up")
    });
    assert!(shrunk, "never drained to one pserver\n{}", job.dump());
    std::thread::sleep(Duration::from_millis(500));
    job.finish_and_count();
}

#[test]
fn async_one_replica_grows_and_shrinks_without_losing_a_push() {
    grow_and_shrink("elastic-async-1", "async", 1);
}

#[test]
fn async_two_replicas_grow_and_shrink_without_losing_a_push() {
    grow_and_shrink("elastic-async-2", "async", 2);
}

#[test]
fn sync_one_replica_grows_and_shrinks_without_losing_a_push() {
    grow_and_shrink("elastic-sync-1", "sync", 1);
}

#[test]
fn sync_two_replicas_grow_and_shrink_without_losing_a_push() {
    grow_and_shrink("elastic-sync-2", "sync", 2);
}
