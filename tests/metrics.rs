//! Prometheus metrics of a running job, scraped over HTTP from a master, a
//! pserver and a trainer (separate processes, `--metrics 127.0.0.1:0`): the
//! numbers move while the job trains.
#![cfg(feature = "etcd")]

use crate::support;

use std::time::Duration;
use support::{a1a_job, exits, metric_value as value, metrics_addr, scrape, Cluster, Proc};

const LONG: Duration = Duration::from_secs(120);

#[test]
fn a_scraped_master_pserver_and_trainer_report_numbers_that_move() {
    let cluster = Cluster::start("metrics");
    let mut job = a1a_job();
    let more = ["--chunk-bytes", "4096", "--passes", "60", "--pservers", "1", "--metrics", "127.0.0.1:0"];
    job.extend(more.map(String::from));
    let mut master = cluster.master("master", &job);
    let mut command = std::process::Command::new(support::example("pserver"));
    command.args(cluster.conn("pserver")).args(["--metrics", "127.0.0.1:0", "--checkpoint-dir"]);
    command.arg(cluster.dir.path().join("checkpoints")).args(["--checkpoint-interval", "0.2"]);
    let pserver = Proc::spawn("pserver-0", command);
    let trainers =
        [cluster.trainer_with("trainer-0", &["--metrics", "127.0.0.1:0"]), cluster.trainer("trainer-1")];
    let others: Vec<&Proc> = trainers.iter().chain([&pserver]).collect();

    assert!(master.wait_for_line(LONG, |l| l.starts_with("pass 2/")).is_some(), "{}", master.dump());
    let (m_addr, p_addr) = (metrics_addr(&master).unwrap(), metrics_addr(&pserver).unwrap());
    let t_addr = metrics_addr(&trainers[0]).unwrap();
    let (m1, p1, t1) = (scrape(&m_addr), scrape(&p_addr), scrape(&t_addr));
    let moving = [
        ("oar_master_state_writes_total", 0),
        ("oar_lease_renewals_total", 0),
        ("oar_ps_pushes_total", 1),
        ("oar_ps_push_bytes_total", 1),
        ("oar_ps_pulls_total", 1),
        ("oar_ps_step{shard=\"0\"}", 1),
        ("oar_ps_apply_seconds_count", 1),
        ("oar_ps_barrier_wait_seconds_count", 1),
        ("oar_ps_checkpoint_seconds_count", 1),
        ("oar_trainer_examples_total", 2),
        ("oar_trainer_batches_total", 2),
        ("oar_trainer_tasks_finished_total", 2),
        ("oar_trainer_exchange_seconds_count", 2),
        ("oar_pass", 0),
    ];
    let first = [&m1, &p1, &t1];
    let unmoved = |now: &[String; 3]| -> Vec<String> {
        moving
            .iter()
            .filter(|&&(name, of)| value(&now[of], name) <= value(first[of], name))
            .map(|&(name, of)| format!("{name}: {} -> {}", value(first[of], name), value(&now[of], name)))
            .collect()
    };
    // Scraped again until every number moved (leases renew, checkpoints
    // are written every 0.2 s, a pass ends): how long that takes depends
    // on the machine's load, so no fixed wait.
    let mut now = [m1.clone(), p1.clone(), t1.clone()];
    let moved = support::wait_until(LONG, || {
        assert!(
            master.wait(Duration::ZERO).is_none(),
            "the job ended before every number moved\n{}",
            master.dump()
        );
        now = [scrape(&m_addr), scrape(&p_addr), scrape(&t_addr)];
        unmoved(&now).is_empty()
    });
    assert!(moved, "did not move: {:?}", unmoved(&now));
    let [_, p2, t2] = now;
    assert_eq!(value(&m1, "oar_tasks_finished_total{pass=\"0\"}"), 29.0, "all of pass 1's tasks");
    assert!(value(&p2, "oar_ps_last_checkpoint_timestamp_seconds") > 1.7e9, "{p2}");
    let loss = value(&t2, "oar_trainer_loss");
    assert!(loss > 0.0 && loss < 1.0, "a task's mean log loss on a1a: {loss}");
    // Registered from the start (this job is sync: no staleness to measure).
    assert_eq!(value(&t2, "oar_trainer_parameter_age_seconds_count"), 0.0, "{t2}");
    assert!(exits(&mut master, LONG, &others), "{}", master.dump());
}
