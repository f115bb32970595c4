//! Sparse tables on real processes around a real etcd: a CTR model (a
//! factorization machine over a1a's feature ids, its rows spread over all 8
//! shards) trains while pservers are SIGKILLed (R=2) or added (a scale-out
//! that moves shards, rows and all), and not one acknowledged push or row
//! update is lost or applied twice.
//!
//! The count is exact, on two levels. Every push goes to every shard (the
//! rows of a batch land on all of them), so every shard applies exactly one
//! update per acknowledged push (async). And every row gradient a trainer
//! saw acknowledged is one optimizer step of that row on its shard: the
//! steps of every row the final primaries hold add up to the row gradients
//! the trainers pushed (`row_updates` against `pushed_rows`; no cap or
//! expiry, so no row leaves). A shard restored from a checkpoint (written
//! once a minute) instead of failed over, or a row left behind by a move,
//! would come up short.
//!
//! `OAR_SPARSE_SEED` replays a kill schedule.
#![cfg(feature = "etcd")]

use crate::support;

use std::time::Duration;
use support::{seed_from, wait_until, JobShape, Lcg, ReplicatedJob as Job, LONG};

/// The CTR job's options beyond the replicated a1a job's.
const CTR: [&str; 6] = ["--model", "fm", "--factors", "4", "--optimizer", "adagrad"];

/// Every one of the 8 shards holds rows.
const SHARDS: usize = 8;

fn launch(name: &str, replicas: u32, pservers: u32) -> Job {
    let shape = JobShape { replicas, pservers, trainers: 2, job_flags: CTR.to_vec(), ..JobShape::default() };
    let mut job = Job::launch(name, shape);
    job.data_shards = SHARDS;
    job
}

#[test]
fn rows_survive_sigkill_of_their_primaries_with_two_replicas() {
    let seed = seed_from("OAR_SPARSE_SEED");
    eprintln!("OAR_SPARSE_SEED={seed}");
    let mut rng = Lcg(seed);
    let mut job = launch("sparse-kill", 2, 3);
    for round in 0..2 {
        std::thread::sleep(Duration::from_millis(200 + rng.below(1000) as u64));
        let shard = rng.below(SHARDS) as u32;
        let (victim, _) = job.kill_primary(shard);
        eprintln!("round {round}: SIGKILLed {victim}, primary of shard {shard}");
    }
    let rows = row_updates_counted(&mut job);
    assert!(rows > 0, "no row update counted");
}

/// A pserver started after `status --set-pservers 3` takes shards over
/// from the two there (rows carried in the catch-up, the primary switched),
/// while the trainers push: it ends up holding rows, and the count is exact.
#[test]
fn a_scale_out_moves_rows_and_loses_no_row_update() {
    let mut job = launch("sparse-grow", 1, 2);
    std::thread::sleep(Duration::from_millis(300));
    job.scale(3).expect("scale out");
    job.add_pserver();
    let newcomer = job.pservers.len() - 1;
    let name = format!("{}.", job.pservers[newcomer].name);
    let took = wait_until(LONG, || {
        let status = job.cluster.status();
        let held =
            status.lines().filter(|l| l.trim_start().starts_with("shard ") && l.contains(&name)).count();
        held > 0 && status.contains("cluster OK")
    });
    assert!(took, "{name} never took a shard\n{}", job.dump());
    std::thread::sleep(Duration::from_millis(300));
    row_updates_counted(&mut job);
    // Rows reached the newcomer with their history: a moved row that
    // started over there would leave the count above short.
    let out = job.pservers[newcomer].last_json();
    let moved = out["row_updates"].as_object().unwrap_or_else(|| panic!("{out}"));
    assert!(!moved.is_empty(), "the newcomer holds no rows: {out}");
    eprintln!("the newcomer holds rows of {} shards", moved.len());
}

/// Stop everything, check the exact counts, and return the row updates.
fn row_updates_counted(job: &mut Job) -> u64 {
    job.finish_and_count();
    let rows: u64 = job
        .live
        .iter()
        .map(|&i| job.pservers[i].last_json())
        .flat_map(|out| out["row_updates"].as_object().cloned().unwrap_or_default().into_values())
        .map(|n| n.as_u64().unwrap())
        .sum();
    eprintln!("{rows} row updates held, as many as pushed");
    rows
}
