//! Fault tolerance, proven on real processes around a real etcd: SIGKILL of
//! a trainer, a pserver and the master, a master paused past its lease
//! (fencing), and corrupt checkpoints. Each test checks that the job ends
//! well and that every task of every pass was accepted exactly once.
#![cfg(feature = "etcd")]

use crate::support;

use std::time::{Duration, Instant};
use support::{
    a1a_job, assert_each_task_once, dump, exits, is_named, log_field, seed_from, wait_until, Cluster, Lcg,
    Proc,
};

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

/// The step of shard `shard`'s last checkpoint, as `status` prints it.
fn checkpoint_step(status: &str, shard: u32) -> Option<u64> {
    let prefix = format!("shard {shard}:");
    let line = status.lines().map(str::trim_start).find(|l| l.starts_with(&prefix))?;
    line.split("checkpoint at step ").nth(1)?.split(' ').next()?.parse().ok()
}

/// With one replica per shard, a SIGKILLed pserver's shards go to the
/// survivor, which restores each from its last checkpoint: the job loses
/// at most one checkpoint interval of updates on them, and never applies a
/// step twice.
#[test]
fn a_killed_pserver_s_shards_are_restored_elsewhere_and_lose_at_most_one_checkpoint_interval() {
    let cluster = Cluster::start("pserver-kill");
    let passes = 30;
    let mut pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 0.5)).collect();
    let trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    // Blocks of 128 floats: the model's 248 make three, on shards 0, 1 and
    // 2, and the first map puts shards 0 and 1 on different pservers.
    let mut job = job(passes);
    job.extend(["--block-size", "128"].map(String::from));
    let mut master = cluster.master("master", &job);
    wait_for_pass(&mut master, 1, &[]);

    // Checkpoints of shard 0 are written periodically while the job runs.
    let mut steps = Vec::new();
    let advanced = wait_until(LONG, || {
        if let Some(step) = checkpoint_step(&cluster.status(), 0) {
            if steps.last() != Some(&step) {
                steps.push(step);
            }
        }
        steps.len() >= 2
    });
    assert!(advanced, "shard 0's checkpoint record did not advance: {steps:?}\n{}", cluster.status());
    let victim = cluster.primary_of(0);
    let holder = pservers.iter().position(|p| is_named(p, &victim)).expect("a pserver of this test");
    let other = cluster.primary_of(1);
    assert!(is_named(&pservers[1 - holder], &other), "shards 0 and 1 start on different pservers");
    assert_running(&mut master);
    pservers[holder].kill();
    let recorded = checkpoint_step(&cluster.status(), 0).expect("a checkpoint record");

    let others: Vec<&Proc> = pservers.iter().chain(&trainers).collect();
    let report = report_of(&mut master, &others);
    assert!(report["test_accuracy"].as_f64().unwrap() >= 0.8, "{report}");
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);

    let survivor = &mut pservers[1 - holder];
    let log = survivor.stderr();
    let restored =
        log.lines().find(|l| l.contains("restored checkpoint") && log_field(l, "shard") == Some("0"));
    let restored_step: u64 = restored
        .and_then(|l| log_field(l, "step"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the survivor did not restore shard 0\n{}", survivor.dump()));
    assert!(
        restored_step >= recorded,
        "the survivor loaded step {restored_step}, older than the last recorded {recorded}"
    );
    for trainer in &trainers {
        assert!(trainer.stderr().contains("following the shard's new primary"), "{}", trainer.dump());
    }
    // What the crash cost: every push goes to every shard, so shard 0 ends
    // behind shard 1 (which never moved) by the pushes its old primary
    // applied after its last checkpoint. Never ahead: no push is applied
    // twice. (Pushes, not steps: each shard keeps its own barrier, and a
    // trainer that joins while the other pushes can count from step s on
    // one shard and s + 1 on the other, so step numbers may differ by one
    // per such join.)
    assert!(exits(survivor, LONG, &[]), "{}", survivor.dump());
    let out = survivor.last_json();
    let count = |what: &str, shard: &str| {
        out[what][shard].as_u64().unwrap_or_else(|| panic!("{what} of shard {shard}: {out}"))
    };
    let (restarted, kept) = (count("pushes", "0"), count("pushes", "1"));
    assert!(
        restarted <= kept,
        "the restored shard applied {restarted} pushes, the other {kept}\n{}",
        dump(&[&*survivor, &trainers[0], &trainers[1], &master])
    );
    eprintln!(
        "SIGKILL of a pserver (checkpoint interval 0.5 s) lost {} of {kept} pushes on its shard (steps: {} against {})",
        kept - restarted,
        count("primaries", "0"),
        count("primaries", "1")
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
    // its lost lease and exits (a pass takes a fraction of a second; 40 were
    // once all done by then, since a sync step is one round trip).
    let passes = 100;
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
    // Its shards go to the other pserver, restored from their checkpoints.
    assert_running(&mut master);

    let replacement = cluster.pserver("pserver-new", 0.5);
    let others: Vec<&Proc> = trainers.iter().chain([&other, &replacement, &cut_off]).collect();
    let report = report_of(&mut master, &others);
    assert!(report["test_accuracy"].as_f64().unwrap() >= 0.8, "{report}");
    // Its shards went to the pservers still registered, from their checkpoints.
    let restored = |p: &Proc| p.stderr().contains("restored checkpoint");
    assert!(restored(&other) || restored(&replacement), "{}{}", other.dump(), replacement.dump());
    assert_each_task_once(&trainers.iter().collect::<Vec<_>>(), &report, passes, TASKS_PER_PASS);
}

/// A trainer cut off from etcd stops once its lease is lost, as a master
/// or a pserver does. The master is frozen first, so the trainer is inside
/// a call to it (retried for minutes) when its lease goes: the loop's own
/// lease check between steps is not reached.
#[test]
fn a_trainer_cut_off_from_etcd_stops_by_itself() {
    let cluster = Cluster::start("trainer-partition");
    let proxy = support::Proxy::start(cluster.etcd.client_addr());
    let mut master = cluster.master("master", &job(100));
    let pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let mut cut_off = cluster.trainer_via("trainer-cut", &proxy.url());
    wait_for_pass(&mut master, 1, &[]);
    master.stop();
    // Its task ends in well under a second; then it waits on the master.
    std::thread::sleep(Duration::from_secs(2));
    proxy.cut();
    let cut_at = Instant::now();
    // A lease of 2 s: lost within about that, then a moment to stop. The
    // master's calls alone would be retried for 300 s.
    let status = cut_off.wait(Duration::from_secs(30));
    let took = cut_at.elapsed();
    master.signal("CONT");
    let status = status.unwrap_or_else(|| panic!("the cut-off trainer did not stop\n{}", cut_off.dump()));
    assert!(!status.success(), "it must exit with an error\n{}", cut_off.dump());
    assert!(cut_off.stderr().contains("lease"), "it names its lost lease\n{}", cut_off.dump());
    eprintln!("the cut-off trainer stopped {:.1} s after the cut", took.as_secs_f64());
    drop(pservers);
}

/// A pserver that takes a shard over from its checkpoints skips a corrupt
/// newest one (saying which and why) and restores the one before; with
/// every one corrupt it stops, naming them, rather than serve the shard
/// from scratch.
#[test]
fn a_corrupt_newest_checkpoint_falls_back_and_all_corrupt_waits_and_names_the_files() {
    let cluster = Cluster::start("corrupt");
    // One pserver at a time, one replica: each new one restores shard 0.
    let mut job = job(400);
    job.extend(["--pservers", "1"].map(String::from));
    let mut first = cluster.pserver("pserver-0", 0.1);
    let mut trainer = cluster.trainer("trainer-0");
    let mut master = cluster.master("master", &job);
    wait_for_pass(&mut master, 1, &[]);

    let files = || {
        let mut files: Vec<_> = std::fs::read_dir(cluster.checkpoints(0))
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_else(|_| Vec::new());
        files.retain(|p: &std::path::PathBuf| p.extension().is_some_and(|e| e == "oarckpt"));
        files.sort();
        files
    };
    let flip = |path: &std::path::Path, mask: u8| {
        let mut bytes = std::fs::read(path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= mask;
        std::fs::write(path, bytes).unwrap();
    };
    assert!(wait_until(LONG, || files().len() >= 2), "periodic checkpoints\n{}", first.dump());
    // Frozen, it writes no more; then it dies with a corrupt newest checkpoint.
    first.stop();
    let before = files();
    let (newest, previous) = (&before[before.len() - 1], &before[before.len() - 2]);
    flip(newest, 0x40);
    first.kill();

    let mut second = cluster.pserver("pserver-second", 60.0);
    let restore_line =
        |log: &str| log.lines().find(|l| l.contains("restored checkpoint shard=0")).map(str::to_string);
    assert!(wait_until(LONG, || restore_line(&second.stderr()).is_some()), "no restore\n{}", second.dump());
    let log = second.stderr();
    let restored = restore_line(&log).unwrap_or_default();
    let skipped = log.lines().find(|l| l.contains("skipped a checkpoint")).unwrap_or_else(|| panic!("{log}"));
    assert!(skipped.contains(&newest.display().to_string()), "it names the file: {skipped}");
    assert!(skipped.contains("checksum") || skipped.contains("corrupt"), "it says why: {skipped}");
    assert!(restored.contains(&previous.display().to_string()), "it loads the previous one: {restored}");

    // With every checkpoint corrupt the shard waits, the error naming the
    // files, and is tried again; the pserver keeps running (its other
    // shards, had it any, are served), rather than serve fresh values.
    second.stop();
    let all = files();
    // Another bit, so the file corrupted above stays corrupt.
    all.iter().for_each(|p| flip(p, 0x01));
    second.kill();
    let mut third = cluster.pserver("pserver-third", 60.0);
    let tries = |log: &str| log.lines().filter(|l| l.contains("cannot restore the shard")).count();
    assert!(wait_until(LONG, || tries(&third.stderr()) >= 2), "tried twice\n{}", third.dump());
    assert_eq!(third.wait(Duration::from_millis(100)), None, "it keeps running\n{}", third.dump());
    let err = third.stderr();
    let line = err.lines().find(|l| l.contains("cannot restore the shard")).unwrap_or_default();
    assert!(line.contains("no valid checkpoint"), "{line}");
    for path in &all {
        assert!(line.contains(&path.display().to_string()), "the error names {}: {line}", path.display());
    }
    third.kill();
    master.kill();
    trainer.kill();
}

/// Kill a random process of a random role every few seconds, start a new
/// one in its place, and check that the job still ends well: every pass
/// complete, every task finished or discarded with a reason, none accepted
/// twice, a model as good as usual. `OAR_CHAOS_ROUNDS` (default 4) makes it
/// longer, `OAR_CHAOS_SEED` replays a schedule.
///
/// With `replicas` > 1 it also counts pushes exactly: on every shard that
/// holds the model, the updates applied equal the pushes each trainer had
/// applied there (its last push seq + 1, from the final primaries'
/// reports), and for a trainer that finished the job, that is the number of
/// pushes it saw acknowledged. Replication survives one pserver at a time,
/// so a pserver is killed only when every shard has all its replicas.
fn chaos(replicas: u32) {
    let rounds: usize = std::env::var("OAR_CHAOS_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(4);
    let seed = seed_from("OAR_CHAOS_SEED");
    eprintln!("chaos: {rounds} rounds, {replicas} replicas, OAR_CHAOS_SEED={seed}");
    let mut rng = Lcg(seed);
    let cluster = Cluster::start(&format!("chaos-{replicas}"));
    // Replicated, the kills wait for a healthy cluster: a longer job.
    let per_round = if replicas > 1 { 60 } else { 10 };
    let passes = (per_round * rounds as u32).max(per_round);
    let pservers_wanted = replicas + 1;
    let mut job = job(passes);
    let more = ["--replicas", &replicas.to_string(), "--pservers", &pservers_wanted.to_string()];
    job.extend(more.map(String::from));
    if replicas > 1 {
        // The model over three shards, so that primaries of several are killed.
        job.extend(["--shards", "8", "--block-size", "128", "--mode", "async"].map(String::from));
    }

    let mut masters = vec![cluster.master("master-0", &job)];
    let mut pservers: Vec<Proc> =
        (0..pservers_wanted).map(|i| cluster.pserver(&format!("pserver-{i}"), 0.5)).collect();
    let mut trainers: Vec<Proc> = (0..3).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    // The last process of each role is the live one; killed ones stay for their logs.
    let mut live_pservers: Vec<usize> = (0..pservers.len()).collect();
    let mut live_trainers = vec![0, 1, 2];
    wait_for_pass(masters.last_mut().unwrap(), 1, &[]);

    let mut kills = Vec::new();
    for round in 0..rounds {
        std::thread::sleep(Duration::from_millis(1000 + 500 * rng.below(5) as u64));
        if masters.last_mut().unwrap().wait(Duration::ZERO).is_some() {
            break; // The job ended.
        }
        // Replicated, the last round kills a pserver if none died yet.
        let role = match rng.below(3) {
            _ if replicas > 1 && round + 1 == rounds && !kills.contains(&"pserver") => 1,
            role => role,
        };
        match role {
            0 => {
                masters.last_mut().unwrap().kill();
                masters.push(cluster.master(&format!("master-{}", round + 1), &job));
                kills.push("master");
            }
            1 => {
                if replicas > 1 {
                    // Healthy again after the last pserver's death, not
                    // before the map noticed it (its lease outlives it).
                    let dead: Vec<String> = pservers
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| !live_pservers.contains(i))
                        .map(|(_, p)| format!("{}.", p.name))
                        .collect();
                    let healthy = wait_until(LONG, || {
                        let status = cluster.status();
                        status.contains("cluster OK") && dead.iter().all(|d| !status.contains(d.as_str()))
                    });
                    let all: Vec<&Proc> = pservers.iter().chain(&masters).collect();
                    assert!(healthy, "never healthy again\n{}{}", cluster.status(), dump(&all));
                }
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
    if replicas > 1 {
        assert!(kills.contains(&"pserver"), "the job ended before a pserver was killed: {kills:?}");
    }

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
    let accuracy = if replicas > 1 { 0.82 } else { 0.8 };
    assert!(report["test_accuracy"].as_f64().unwrap() >= accuracy, "{report}");

    if replicas > 1 {
        count_pushes(&mut pservers, &live_pservers, &mut trainers, &live_trainers);
    }
}

/// The push accounting of [`chaos`] with replicas: every live process has
/// exited at the job's end.
fn count_pushes(
    pservers: &mut [Proc],
    live_pservers: &[usize],
    trainers: &mut [Proc],
    live_trainers: &[usize],
) {
    let mut shards = 0;
    // Each trainer's first seq, from its log (a killed one's too): its
    // pushes are numbered from there.
    let first_seq = |trainer: &str| -> u64 {
        let proc =
            trainers.iter().find(|t| t.name == trainer).unwrap_or_else(|| panic!("no trainer {trainer}"));
        let log = proc.stderr();
        let line = log.lines().find(|l| l.contains("pushes numbered from first_seq"));
        let first = line.and_then(|l| log_field(l, "first_seq")).and_then(|v| v.parse().ok());
        first.unwrap_or_else(|| panic!("{trainer} logged no first seq\n{}", proc.dump()))
    };
    // Each trainer's pushes applied, per model shard.
    let mut seqs_of: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for &i in live_pservers {
        assert!(exits(&mut pservers[i], LONG, &[]), "{} failed\n{}", pservers[i].name, pservers[i].dump());
        let out = pservers[i].last_json();
        let steps = out["primaries"].as_object().unwrap_or_else(|| panic!("{out}"));
        for (shard, seqs) in out["trainer_seqs"].as_object().unwrap_or_else(|| panic!("{out}")) {
            let step = steps[shard].as_u64().unwrap();
            let mut applied = 0;
            for (trainer, seq) in seqs.as_object().unwrap() {
                let pushes = seq.as_u64().unwrap() + 1 - first_seq(trainer);
                applied += pushes;
                seqs_of.entry(trainer.clone()).or_default().push(pushes);
            }
            assert_eq!(
                step,
                applied,
                "shard {shard} applied {step} updates for {applied} pushes: {out}\n{}",
                dump(&pservers.iter().collect::<Vec<_>>())
            );
            shards += 1;
        }
    }
    assert_eq!(shards, 3, "the model's shards");
    // Every model shard takes every push; a trainer killed mid-push may
    // have reached some shards with its last one.
    for (trainer, counts) in &seqs_of {
        let (low, high) = (counts.iter().min(), counts.iter().max());
        assert!(counts.len() == 3 && high.zip(low).is_some_and(|(h, l)| h - l <= 1), "{trainer}: {counts:?}");
    }
    let mut finished = 0;
    for &i in live_trainers {
        let trainer = &mut trainers[i];
        // A replacement started as the job ended is told it is over (exit 1).
        if !exits(trainer, LONG, &[]) {
            assert!(trainer.stderr().contains("is over"), "{} failed\n{}", trainer.name, trainer.dump());
            continue;
        }
        let out = trainer.last_json();
        let id = trainer.name.clone();
        let pushes = out["pushes"].as_u64().unwrap();
        if pushes > 0 {
            assert_eq!(seqs_of.get(&id), Some(&vec![pushes; 3]), "{id}: {pushes} acknowledged");
            finished += 1;
        }
    }
    assert!(finished > 0, "no trainer finished the job to compare with");
    eprintln!("chaos: pushes per trainer, each applied once on every model shard: {seqs_of:?}");
}

#[test]
fn chaos_kills_and_restarts_random_processes_and_the_job_still_ends_well() {
    chaos(1);
}

/// Issue 16's chaos: the same with two replicas per shard, and every push
/// counted.
#[test]
fn chaos_with_two_replicas_ends_well_and_applies_every_push_once() {
    chaos(2);
}
