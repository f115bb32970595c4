//! Fault tolerance, proven on real processes around a real etcd: SIGKILL of
//! a trainer, a pserver and the master, a master paused past its lease
//! (fencing), and corrupt checkpoints. Each test checks that the job ends
//! well and that every task of every pass was accepted exactly once.
#![cfg(feature = "etcd")]

mod support;

use std::time::Duration;
use support::{a1a_job, assert_each_task_once, dump, exits, log_field, wait_until, Cluster, Proc};

const LONG: Duration = Duration::from_secs(180);

/// a1a in 4 KiB chunks (29 tasks a pass) over `passes` passes. The task
/// timeout is long, so only a lease expiry can take a dead trainer's task back.
fn job(passes: u32) -> Vec<String> {
    let mut job = a1a_job();
    job.extend(["--chunk-bytes", "4096", "--task-timeout", "600", "--passes"].map(String::from));
    job.push(passes.to_string());
    job
}

/// Wait until the master printed the end of pass `pass` (1-based).
fn wait_for_pass(master: &mut Proc, pass: u32, others: &[&Proc]) {
    let prefix = format!("pass {pass}/");
    let seen = master.wait_for_line(LONG, |l| l.starts_with(&prefix));
    assert!(seen.is_some(), "{} never reached pass {pass}\n{}{}", master.name, master.dump(), dump(others));
}

/// The master's report, after it exited well.
fn report_of(master: &mut Proc, others: &[&Proc]) -> serde_json::Value {
    assert!(exits(master, LONG, others), "{} failed\n{}{}", master.name, master.dump(), dump(others));
    let report = master.last_json();
    assert_eq!(report["state"], "done", "{report}");
    report
}

/// a1a in 4 KiB chunks.
const TASKS_PER_PASS: u64 = 29;

/// The fault must land while the job runs, or the test proves nothing.
fn assert_running(master: &mut Proc) {
    assert!(master.wait(Duration::ZERO).is_none(), "the job ended before the fault\n{}", master.dump());
}

#[test]
fn a_trainer_killed_mid_task_has_its_task_done_by_another() {
    let cluster = Cluster::start("trainer-kill");
    // Enough passes that the job is still running after the tries it takes
    // to catch trainer-1 mid-task (a pass takes a fraction of a second).
    let passes = 20;
    let pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let mut trainers: Vec<_> = (0..3).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    // Small batches: a task is several sync steps, so a trainer is often mid-task.
    let mut job = job(passes);
    job.extend(["--batch-size", "8"].map(String::from));
    let mut master = cluster.master("master", &job);
    wait_for_pass(&mut master, 1, &[]);

    // Freeze it to look at it; kill it once it is frozen in the middle of a task.
    trainers[1].stop_mid_task(LONG);
    assert_running(&mut master);
    trainers[1].kill();

    let everyone: Vec<&Proc> = pservers.iter().chain(&trainers).collect();
    let report = report_of(&mut master, &everyone);
    assert_eq!(report["passes"], passes, "{report}");
    assert!(
        report["tasks_failed"].as_u64().unwrap() >= 1,
        "the dead trainer's task failed once: {report}\n{}{}",
        master.dump(),
        trainers[1].dump()
    );
    let gone = master.stderr();
    let line = gone.lines().find(|l| l.contains("trainer gone") && l.contains("trainer-1"));
    // Its task, the next one if it had fetched it ahead, and any whose
    // reports were still on their way (see `oar_trainer::worker`).
    let returned: Option<u64> = line.and_then(|l| log_field(l, "returned")).and_then(|n| n.parse().ok());
    assert!(returned >= Some(1), "its task returned to todo at its lease's end\n{}", master.dump());
    assert_each_task_once(&everyone, &report, passes, TASKS_PER_PASS);
    for trainer in [0, 2] {
        let t = &mut trainers[trainer];
        assert!(exits(t, LONG, &[]), "a surviving trainer failed\n{}", t.dump());
    }
}

#[test]
fn a_killed_pserver_is_replaced_and_loses_at_most_one_checkpoint_interval() {
    let cluster = Cluster::start("pserver-kill");
    let passes = 30;
    let mut pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 0.5)).collect();
    let trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let mut master = cluster.master("master", &job(passes));
    wait_for_pass(&mut master, 1, &[]);

    // Checkpoints of shard 0 are written periodically while the job runs.
    let step_of_0 = |status: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.trim_start().starts_with("ps/0:"))?;
        line.split("checkpoint at step ").nth(1)?.split(' ').next()?.parse().ok()
    };
    let mut steps = Vec::new();
    let advanced = wait_until(LONG, || {
        if let Some(step) = step_of_0(&cluster.status()) {
            if steps.last() != Some(&step) {
                steps.push(step);
            }
        }
        steps.len() >= 2
    });
    assert!(advanced, "shard 0's checkpoint record did not advance: {steps:?}\n{}", cluster.status());
    let holder =
        pservers.iter().position(|p| p.stderr().contains("pserver serving index=0")).unwrap_or_else(|| {
            panic!("no pserver says it serves index 0\n{}", dump(&pservers.iter().collect::<Vec<_>>()))
        });
    assert_running(&mut master);
    pservers[holder].kill();
    let recorded = step_of_0(&cluster.status()).expect("a checkpoint record");

    let mut replacement = cluster.pserver("pserver-new", 0.5);
    let others: Vec<&Proc> = pservers.iter().chain(&trainers).chain([&replacement]).collect();
    let report = report_of(&mut master, &others);
    assert!(report["test_accuracy"].as_f64().unwrap() >= 0.8, "{report}");
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);

    let log = replacement.stderr();
    let restored = log.lines().find(|l| l.contains("restored checkpoint"));
    let restored_step: u64 = restored
        .and_then(|l| log_field(l, "step"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the replacement did not restore a checkpoint\n{}", replacement.dump()));
    assert!(
        restored_step >= recorded,
        "the replacement loaded step {restored_step}, older than the last recorded {recorded}"
    );
    assert!(log_field(restored.unwrap(), "index") == Some("0"), "it took the free index 0\n{log}");
    for trainer in &trainers {
        assert!(trainer.stderr().contains("following a replaced pserver"), "{}", trainer.dump());
    }
    assert!(exits(&mut replacement, LONG, &[]), "{}", replacement.dump());
    // What the crash cost: the sync shards step together, so the one that
    // restarted ends behind the other by the steps its predecessor applied
    // after its last checkpoint (and by any step the other completed while
    // it was away). Never ahead: no step is applied twice.
    let survivor = &mut pservers[1 - holder];
    assert!(exits(survivor, LONG, &[]), "{}", survivor.dump());
    let (kept, restarted) =
        (survivor.last_json()["steps"].as_u64(), replacement.last_json()["steps"].as_u64());
    let (Some(kept), Some(restarted)) = (kept, restarted) else { panic!("both shards report their steps") };
    assert!(restarted <= kept, "the restarted shard applied {restarted} steps, the other {kept}");
    eprintln!(
        "SIGKILL of a pserver (checkpoint interval 0.5 s) lost {} of {kept} sync steps on its shard",
        kept - restarted
    );
}

#[test]
fn a_killed_master_is_restarted_and_finished_tasks_stay_finished() {
    let cluster = Cluster::start("master-kill");
    let passes = 8;
    let pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let mut first = cluster.master("master-a", &job(passes));
    wait_for_pass(&mut first, 2, &[]);
    assert_running(&mut first);
    first.kill();

    let mut second = cluster.master("master-b", &job(passes));
    let everyone: Vec<&Proc> = pservers.iter().chain(&trainers).collect();
    let report = report_of(&mut second, &everyone);
    assert_eq!(report["passes"], passes, "{report}");
    assert!(second.stderr().contains("restored the task queue"), "{}", second.dump());
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);
}

#[test]
fn a_master_paused_past_its_lease_is_fenced_and_stops_by_itself() {
    let cluster = Cluster::start("master-pause");
    let passes = 8;
    let mut first = cluster.master("master-a", &job(passes));
    assert!(wait_until(LONG, || cluster.status().contains("master: master-a at")), "{}", first.dump());
    let pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let mut second = cluster.master("master-b", &job(passes));
    wait_for_pass(&mut first, 1, &[]);
    assert_running(&mut first);
    first.signal("STOP");
    let took_over = wait_until(LONG, || cluster.status().contains("master: master-b at"));
    assert!(took_over, "the standby did not take over\n{}", second.dump());
    // Everything the paused master logged before the pause has been read.
    std::thread::sleep(Duration::from_millis(300));
    let assigned_before = first.stderr().matches("task assigned").count();
    first.signal("CONT");

    let status = first.wait(LONG).expect("the old master stops by itself");
    assert!(!status.success(), "the old master must exit with an error\n{}", first.dump());
    assert!(first.stderr().contains("stops serving"), "{}", first.dump());
    let assigned_after = first.stderr().matches("task assigned").count();
    assert_eq!(
        assigned_before,
        assigned_after,
        "the old master handed out tasks after the pause\n{}",
        first.dump()
    );

    let everyone: Vec<&Proc> = pservers.iter().chain(&trainers).collect();
    let report = report_of(&mut second, &everyone);
    assert_eq!(report["passes"], passes, "{report}");
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);
}

#[test]
fn a_pserver_cut_off_from_etcd_stops_serving_and_is_replaced() {
    let cluster = Cluster::start("partition");
    // Enough passes that the job still runs when the cut-off pserver notices
    // its lost lease and exits (a pass takes a fraction of a second).
    let passes = 40;
    let proxy = support::Proxy::start(cluster.etcd.client_addr());
    let mut master = cluster.master("master", &job(passes));
    let mut cut_off = cluster.pserver_via("pserver-cut", 0.5, &proxy.url());
    assert!(wait_until(LONG, || cut_off.stderr().contains("pserver serving")), "{}", cut_off.dump());
    let other = cluster.pserver("pserver-other", 0.5);
    let trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    wait_for_pass(&mut master, 1, &[]);
    assert_running(&mut master);
    proxy.cut();
    let status = cut_off.wait(LONG).expect("the cut-off pserver stops by itself");
    assert!(!status.success(), "it must exit with an error\n{}", cut_off.dump());
    assert!(cut_off.stderr().contains("stops serving"), "{}", cut_off.dump());
    // Shard 0 is gone now, so the job cannot end before its replacement serves.
    assert_running(&mut master);

    let replacement = cluster.pserver("pserver-new", 0.5);
    let others: Vec<&Proc> = trainers.iter().chain([&other, &replacement, &cut_off]).collect();
    let report = report_of(&mut master, &others);
    assert!(report["test_accuracy"].as_f64().unwrap() >= 0.8, "{report}");
    assert!(replacement.stderr().contains("restored checkpoint"), "{}", replacement.dump());
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);
}

#[test]
fn a_corrupt_newest_checkpoint_falls_back_and_all_corrupt_refuses_to_start() {
    let cluster = Cluster::start("corrupt");
    let pserver = cluster.pserver("pserver-0", 0.1);
    let trainer = cluster.trainer("trainer-0");
    let mut job = job(3);
    job.extend(["--pservers", "1"].map(String::from));
    let mut master = cluster.master("master", &job);
    report_of(&mut master, &[&pserver, &trainer]);
    let mut pserver = pserver;
    assert!(exits(&mut pserver, LONG, &[]), "{}", pserver.dump());

    let files = || {
        let mut files: Vec<_> = std::fs::read_dir(cluster.checkpoints(0))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "oarckpt"))
            .collect();
        files.sort();
        files
    };
    let flip = |path: &std::path::Path, mask: u8| {
        let mut bytes = std::fs::read(path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= mask;
        std::fs::write(path, bytes).unwrap();
    };
    let before = files();
    assert!(before.len() >= 2, "periodic checkpoints plus the last one: {before:?}");
    let (newest, previous) = (&before[before.len() - 1], &before[before.len() - 2]);
    flip(newest, 0x40);

    // A new pserver for shard 0 skips the corrupt newest one, says why, and loads the previous.
    let mut second = cluster.pserver("pserver-second", 60.0);
    assert!(exits(&mut second, LONG, &[]), "{}", second.dump());
    let log = second.stderr();
    let skipped = log.lines().find(|l| l.contains("skipped a checkpoint")).unwrap_or_else(|| panic!("{log}"));
    assert!(skipped.contains(&newest.display().to_string()), "it names the file: {skipped}");
    assert!(skipped.contains("checksum") || skipped.contains("corrupt"), "it says why: {skipped}");
    let restored = log.lines().find(|l| l.contains("restored checkpoint")).unwrap_or_else(|| panic!("{log}"));
    assert!(restored.contains(&previous.display().to_string()), "it loads the previous one: {restored}");

    // With every checkpoint corrupt it refuses to start, naming the files.
    let all = files();
    // Another bit, so the file corrupted above stays corrupt.
    all.iter().for_each(|p| flip(p, 0x01));
    let mut third = cluster.pserver("pserver-third", 60.0);
    let status = third.wait(LONG).expect("it exits");
    assert_eq!(status.code(), Some(2), "{}", third.dump());
    let err = third.stderr();
    assert!(err.contains("no valid checkpoint"), "{err}");
    for path in &all {
        assert!(err.contains(&path.display().to_string()), "the error names {}: {err}", path.display());
    }
}

/// A small deterministic generator for the chaos schedule (seed printed, and
/// settable with `OAR_CHAOS_SEED` to replay a run).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// Kill a random process of a random role every few seconds, start a new
/// one in its place, and check that the job still ends well: every pass
/// complete, every task finished or discarded with a reason, none accepted
/// twice, a model as good as usual. `OAR_CHAOS_ROUNDS` (default 4) makes it longer.
#[test]
fn chaos_kills_and_restarts_random_processes_and_the_job_still_ends_well() {
    let rounds: usize = std::env::var("OAR_CHAOS_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(4);
    let seed = std::env::var("OAR_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    eprintln!("chaos: {rounds} rounds, OAR_CHAOS_SEED={seed}");
    let mut rng = Lcg(seed);
    let cluster = Cluster::start("chaos");
    let passes = (10 * rounds as u32).max(10);
    let job = job(passes);

    let mut masters = vec![cluster.master("master-0", &job)];
    let mut pservers: Vec<Proc> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 0.5)).collect();
    let mut trainers: Vec<Proc> = (0..3).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    // The last process of each role is the live one; killed ones stay for their logs.
    let (mut live_pservers, mut live_trainers) = (vec![0, 1], vec![0, 1, 2]);
    wait_for_pass(masters.last_mut().unwrap(), 1, &[]);

    let mut kills = Vec::new();
    for round in 0..rounds {
        std::thread::sleep(Duration::from_millis(1000 + 500 * rng.below(5) as u64));
        if masters.last_mut().unwrap().wait(Duration::ZERO).is_some() {
            break; // The job ended.
        }
        match rng.below(3) {
            0 => {
                masters.last_mut().unwrap().kill();
                masters.push(cluster.master(&format!("master-{}", round + 1), &job));
                kills.push("master");
            }
            1 => {
                let slot = rng.below(live_pservers.len());
                pservers[live_pservers[slot]].kill();
                pservers.push(cluster.pserver(&format!("pserver-r{round}"), 0.5));
                live_pservers[slot] = pservers.len() - 1;
                kills.push("pserver");
            }
            _ => {
                let slot = rng.below(live_trainers.len());
                trainers[live_trainers[slot]].kill();
                trainers.push(cluster.trainer(&format!("trainer-r{round}")));
                live_trainers[slot] = trainers.len() - 1;
                kills.push("trainer");
            }
        }
    }
    eprintln!("chaos: killed {kills:?}");

    let mut master = masters.pop().unwrap();
    let others: Vec<&Proc> = masters.iter().chain(&pservers).chain(&trainers).collect();
    let report = report_of(&mut master, &others);
    assert_eq!(report["passes"], passes, "{report}");
    let discarded = report["discarded"].as_array().unwrap();
    assert_eq!(discarded.len() as u64, report["tasks_discarded"].as_u64().unwrap(), "{report}");
    for d in discarded {
        assert!(!d[1].as_str().unwrap_or("").is_empty(), "a discard without a reason: {report}");
    }
    let accounted = report["tasks_done"].as_u64().unwrap() + discarded.len() as u64;
    assert_eq!(accounted, TASKS_PER_PASS * passes as u64, "every task of every pass: {report}");
    let mut accepted = support::accepted_reports(&trainers.iter().collect::<Vec<_>>());
    let total = accepted.len();
    accepted.sort();
    accepted.dedup();
    assert_eq!(accepted.len(), total, "a (task, pass) was accepted twice");
    assert!(report["test_accuracy"].as_f64().unwrap() >= 0.8, "{report}");
}
