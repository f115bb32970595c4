//! Graceful shutdown, proven on real processes around a real etcd: SIGTERM
//! stops a pserver, a master and a trainer mid-job, each exits 0, hands
//! over what it held, and the job still finishes with every task done once
//! and every acknowledged push applied exactly once.
#![cfg(feature = "etcd")]

use crate::support;

use std::time::{Duration, Instant};
use support::{a1a_job, assert_each_task_once, dump, exits, is_named, log_field, wait_until, Cluster, Proc};

const LONG: Duration = Duration::from_secs(180);

/// a1a in 4 KiB chunks (29 tasks a pass) over `passes` passes; the task
/// timeout is long, so no task fails by its deadline.
fn job(passes: u32, mode: &str) -> Vec<String> {
    let mut job = a1a_job();
    job.extend(
        ["--chunk-bytes", "4096", "--task-timeout", "600", "--mode", mode, "--passes"].map(String::from),
    );
    job.push(passes.to_string());
    job
}

const TASKS_PER_PASS: u64 = 29;

fn wait_for_pass(master: &mut Proc, pass: u32, others: &[&Proc]) {
    let prefix = format!("pass {pass}/");
    let seen = master.wait_for_line(LONG, |l| l.starts_with(&prefix));
    assert!(seen.is_some(), "{} never reached pass {pass}\n{}{}", master.name, master.dump(), dump(others));
}

/// The last JSON line of a process that exited 0.
fn exited_well(proc: &mut Proc, others: &[&Proc]) -> serde_json::Value {
    assert!(exits(proc, LONG, others), "{} did not exit 0\n{}{}", proc.name, proc.dump(), dump(others));
    proc.last_json()
}

/// An async job loses no acknowledged push when a pserver is stopped, even
/// with one replica per shard: it refuses pushes from the moment it drains,
/// writes a last checkpoint of every shard it is primary of and releases
/// its registration; the other pserver takes its shards over from those
/// checkpoints at once. Periodic checkpoints are too rare to help (60 s):
/// only the final one carries the shard. At the end the shard has applied
/// exactly as many pushes as the trainers had acknowledged.
#[test]
fn a_pserver_stopped_by_sigterm_hands_over_every_acknowledged_push() {
    let cluster = Cluster::start("pserver-term");
    let passes = 60;
    let mut pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 60.0)).collect();
    let mut trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let mut master = cluster.master("master", &job(passes, "async"));
    wait_for_pass(&mut master, 2, &[]);

    // Shard 0 holds the whole (small) model.
    let primary = cluster.primary_of(0);
    let holder = pservers.iter().position(|p| is_named(p, &primary)).expect("a pserver of this test");
    assert!(master.wait(Duration::ZERO).is_none(), "the job ended before the stop\n{}", master.dump());
    pservers[holder].signal("TERM");
    let stopped = exited_well(&mut pservers[holder], &[]);
    assert_eq!(stopped["shut_down"].as_bool(), Some(true), "{stopped}");
    let steps_at_stop = stopped["primaries"]["0"].as_u64().unwrap_or_else(|| panic!("{stopped}"));
    assert!(steps_at_stop > 0, "it applied pushes before it stopped: {stopped}");

    let survivor = 1 - holder;
    let others: Vec<&Proc> = pservers.iter().chain(&trainers).collect();
    let report = exited_well(&mut master, &others);
    assert_eq!(report["state"], "done", "{report}");
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);

    let log = pservers[survivor].stderr();
    let restored =
        log.lines().find(|l| l.contains("restored checkpoint") && log_field(l, "shard") == Some("0"));
    let restored_step = restored.and_then(|l| log_field(l, "step")).and_then(|s| s.parse().ok());
    assert_eq!(
        restored_step,
        Some(steps_at_stop),
        "the survivor restores the stop's checkpoint\n{}",
        pservers[survivor].dump()
    );

    let mut acknowledged = 0;
    for trainer in &mut trainers {
        let out = exited_well(trainer, &[]);
        assert_eq!(out["pushed_examples"], out["examples"], "gradients left unpushed: {out}");
        acknowledged += out["pushes"].as_u64().expect("pushes");
    }
    let out = exited_well(&mut pservers[survivor], &[]);
    assert_eq!(
        out["primaries"]["0"].as_u64(),
        Some(acknowledged),
        "shard 0 applied {} pushes, the trainers had {acknowledged} acknowledged",
        out["primaries"]["0"]
    );
    eprintln!(
        "pserver stopped at step {steps_at_stop}; {acknowledged} pushes acknowledged, all applied once"
    );
}

/// A stopped master stores its state and releases its lock and address at
/// once: a standby serves long before the stopped master's lease could
/// have expired (60 s here), and the job finishes under it.
#[test]
fn a_master_stopped_by_sigterm_hands_over_to_its_standby_at_once() {
    let mut cluster = Cluster::start("master-term");
    cluster.lease_ttl = 60;
    // Long enough to stop it mid-job (a pass takes ~0.1 s).
    let passes = 100;
    let pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let mut first = cluster.master("master-a", &job(passes, "sync"));
    wait_for_pass(&mut first, 1, &[]);
    let mut standby = cluster.master("master-b", &job(passes, "sync"));
    // It cuts the tasks, then waits for the lock.
    let ready = wait_until(LONG, || standby.stderr().contains("tasks cut"));
    assert!(ready, "the standby did not start\n{}", standby.dump());
    std::thread::sleep(Duration::from_millis(200));
    assert!(!standby.stderr().contains("master serving"), "the standby must wait\n{}", standby.dump());

    assert!(first.wait(Duration::ZERO).is_none(), "the job ended before the stop\n{}", first.dump());
    let sent = Instant::now();
    first.signal("TERM");
    let served = wait_until(LONG, || standby.stderr().contains("master serving"));
    let takeover = sent.elapsed();
    assert!(served, "the standby never served\n{}{}", standby.dump(), first.dump());
    eprintln!("standby serving {:.0} ms after SIGTERM (lease ttl 60 s)", takeover.as_secs_f64() * 1e3);
    // Not a timing target: the line between a handover (well under a
    // second idle) and a lease expiry (60 s), halfway, so that a loaded
    // machine's slowness is never taken for the lack of a handover.
    assert!(takeover < Duration::from_secs(30), "took over after {takeover:?}: no handover?");
    let out = exited_well(&mut first, &[]);
    assert_eq!(out["master"], "shut down", "{out}");

    let others: Vec<&Proc> = pservers.iter().chain(&trainers).chain([&first]).collect();
    let report = exited_well(&mut standby, &others);
    assert_eq!(report["state"], "done", "{report}");
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);
}

/// A stopped trainer hands back the task it holds (no grace here: the
/// task in hand goes back unfinished), deregisters and exits 0. A task
/// handed back counts as no failure, and the job finishes with every task
/// done once.
#[test]
fn a_trainer_stopped_by_sigterm_hands_back_its_task_and_the_job_finishes() {
    let cluster = Cluster::start("trainer-term");
    let passes = 30;
    let pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let mut trainers = vec![
        cluster.trainer("trainer-0"),
        cluster.trainer_with_env(
            "trainer-1",
            &["--stop-grace", "0"],
            &[("OAR_LOG", "info,oar_trainer::worker=debug")],
        ),
        cluster.trainer("trainer-2"),
    ];
    // Small batches: a task is many sync steps, so a trainer is often mid-task.
    let mut job = job(passes, "sync");
    job.extend(["--batch-size", "8"].map(String::from));
    let mut master = cluster.master("master", &job);
    wait_for_pass(&mut master, 1, &[]);

    // Catch it in a batch that is not its task's last, so that batches
    // are left (every task is 3 batches or more here: the smallest, the
    // file's last 1.7 KB, holds about 24 examples); caught in its last
    // batch, it would rightly finish the task. Stop it, look, stop it for
    // good.
    trainers[1].stop_mid_task_with_batches_left(LONG);
    assert!(master.wait(Duration::ZERO).is_none(), "the job ended before the stop\n{}", master.dump());
    trainers[1].signal("TERM");
    trainers[1].signal("CONT");
    let stopped = exited_well(&mut trainers[1], &[]);
    assert_eq!(stopped["shut_down"], true, "{stopped}");
    assert!(stopped["tasks_returned"].as_u64() >= Some(1), "it held a task: {stopped}");

    let everyone: Vec<&Proc> = pservers.iter().chain(&trainers).collect();
    let report = exited_well(&mut master, &everyone);
    assert_eq!(report["state"], "done", "{report}");
    assert_eq!(report["tasks_failed"], 0, "a task handed back is no failure: {report}");
    assert!(master.stderr().contains("task handed back"), "{}", master.dump());
    assert_each_task_once(&everyone, &report, passes, TASKS_PER_PASS);
    for t in [0, 2] {
        let out = exited_well(&mut trainers[t], &[]);
        assert_eq!(out["shut_down"], false, "{out}");
    }
}

/// A trainer stopped while its shard is away (its only pserver frozen, so
/// every call is retried, for minutes by default) still stops: its task
/// gets the stop grace and its calls their time, then it gives the task
/// back and exits 0, instead of retrying for `--retry-for`.
#[test]
fn a_trainer_stopped_while_its_shard_is_away_stops_within_its_grace() {
    let cluster = Cluster::start("trainer-term-away");
    let pserver = cluster.pserver("pserver-0", 60.0);
    let mut trainer = cluster.trainer_with("trainer-0", &["--stop-grace", "1"]);
    let mut job = job(1000, "async");
    job.extend(["--pservers", "1"].map(String::from));
    let mut master = cluster.master("master", &job);
    wait_for_pass(&mut master, 1, &[]);

    pserver.stop();
    std::thread::sleep(Duration::from_millis(500));
    let sent = Instant::now();
    trainer.signal("TERM");
    // Grace 1 s, then at most a few 5 s bounded calls; the client would
    // retry for 300 s.
    let status = trainer.wait(Duration::from_secs(60));
    let took = sent.elapsed();
    assert!(status.is_some(), "the trainer did not stop\n{}", trainer.dump());
    let out = trainer.last_json();
    assert!(status.is_some_and(|s| s.success()), "{}", trainer.dump());
    assert_eq!(out["shut_down"], true, "{out}");
    eprintln!("trainer stopped {:.1} s after SIGTERM with its shard away", took.as_secs_f64());
    pserver.signal("CONT");
    master.kill();
}
