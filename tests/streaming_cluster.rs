//! A streaming job as separate processes around a real etcd: a writer adds
//! files (or appends lines) while the cluster trains; the master is
//! SIGKILLed and another started, and a trainer is SIGKILLed in the middle
//! of a task, after some of the task's gradients were applied. At the
//! close every record written was trained exactly once, counted twice,
//! independently:
//!
//! - by the task accounting: the master's count of records trained
//!   (restored across the kill) equals the records written, and no task
//!   was accepted twice;
//! - by the model: each record carries a feature of its own, so the LR
//!   model's table holds one row per record, and a row's optimizer step
//!   counts the times that record's gradient was applied. The pserver ends
//!   holding exactly as many rows as records written, and exactly as many
//!   row updates: every record's gradient applied once, none twice (the
//!   killed trainer's pushes are not applied again by the task's rerun),
//!   none skipped.
#![cfg(feature = "etcd")]

use crate::support;

use std::{path::Path, time::Duration};
use support::{accepted_once, dump, exits, Cluster, Proc};

const LONG: Duration = Duration::from_secs(180);

/// At the kills the writer adds this many parts at once (a burst), so that
/// the trainers are in the middle of tasks.
const BURST: usize = 4;

/// Bursts the writer may add while the test tries to catch a trainer in
/// the middle of a task: trainers take a burst's tasks in milliseconds, so
/// one burst may be trained through before the catch lands.
const MAX_BURSTS: usize = 20;

/// Records in a part of the stream (the burst has `BURST` times as many).
const PART: usize = 1600;

/// Stream options: LR over the records' ids, small tasks, a long task
/// timeout (only a lease expiry takes a dead trainer's task back), windows
/// of 0.3 s.
fn job(source: &[&str]) -> Vec<String> {
    let mut job: Vec<String> = source.iter().map(|s| s.to_string()).collect();
    job.extend(
        [
            "--model",
            "lr",
            "--shards",
            "4",
            "--mode",
            "async",
            "--batch-size",
            "8",
            "--chunk-bytes",
            "2048",
            "--task-timeout",
            "600",
            "--pservers",
            "1",
            "--window",
            "0.3",
        ]
        .map(String::from),
    );
    job
}

/// Records `from..from + n`, each with a feature of its own (its number
/// plus one): LR gives each its own row.
fn records(from: usize, n: usize) -> Vec<String> {
    (from..from + n).map(|i| format!("{} {}:1\n", i % 2, i + 1)).collect()
}

/// Records trained, from the windows the (last) master printed: its first
/// window counts from zero over the state it restored, so the sum is the
/// job's total.
fn records_trained(master: &Proc) -> u64 {
    let out = master.stdout();
    out.lines()
        .filter(|l| l.starts_with("window "))
        .map(|l| {
            let n =
                l.split(": ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse::<u64>().ok());
            n.unwrap_or_else(|| panic!("no record count in {l:?}"))
        })
        .sum()
}

/// The `n`th burst's records (from 0): after the parts' records and the
/// bursts before it, so that every record's feature is its own.
fn burst(n: usize) -> Vec<String> {
    records(PART * (1 + BURST * n), PART * BURST)
}

/// Run the cluster while `write` produces the data, then check every
/// record once. Halfway, the writer calls `kill` once with a closure that
/// writes burst `n` when called with `n`; `kill` writes bursts until a
/// trainer is caught in the middle of a task, and the writer returns the
/// records it wrote.
fn stream_through_kills(
    name: &str,
    source: &[&str],
    write: impl FnOnce(&mut dyn FnMut(&mut dyn FnMut(usize))) -> usize,
) {
    let cluster = Cluster::start(name);
    let mut pserver = cluster.pserver("pserver-0", 1.0);
    let mut trainers: Vec<Proc> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let job = job(source);
    let first = std::cell::RefCell::new(Some(cluster.master("master-a", &job)));
    let mut second = None;
    let mut killed = false;
    let written = write(&mut |write_burst| {
        if killed {
            return;
        }
        killed = true;
        // A trainer, in the middle of a task some of whose gradients are
        // applied: a burst, and another if the trainers train through it
        // before the catch.
        let caught = (0..MAX_BURSTS).any(|n| {
            write_burst(n);
            trainers[1].try_stop_mid_task_pushed(Duration::from_secs(5))
        });
        assert!(caught, "trainer-1 was never caught mid-task in {MAX_BURSTS} bursts\n{}", trainers[1].dump());
        trainers[1].kill();
        trainers.push(cluster.trainer("trainer-2"));
        // The master: SIGKILL, and another takes over once its lease ends.
        let mut master = first.borrow_mut().take().unwrap();
        assert!(master.wait(Duration::ZERO).is_none(), "the job ended before the kill\n{}", master.dump());
        master.kill();
        second = Some(cluster.master("master-b", &job));
    });
    assert!(killed, "the writer never called for the kill");
    let mut master = second.expect("a second master");
    let everyone: Vec<&Proc> = trainers.iter().chain([&pserver]).collect();
    assert!(exits(&mut master, LONG, &everyone), "the job did not end well\n{}", master.dump());
    assert!(exits(&mut pserver, LONG, &[]), "the pserver did not end well\n{}", pserver.dump());
    let report = master.last_json();
    assert_eq!(report["state"], "done", "{report}");
    assert_eq!(report["tasks_discarded"], 0, "{report}");
    assert!(master.stderr().contains("restored the task queue"), "{}", master.dump());
    assert_eq!(records_trained(&master), written as u64, "records trained vs written\n{}", master.stdout());
    // No task accepted twice (the logs of the killed trainer included). A
    // report the master stored just before a trainer died is not in its
    // log, so the logs may show fewer than the master counts.
    let accepted = accepted_once(&trainers.iter().collect::<Vec<_>>());
    assert!(accepted.len() as u64 <= report["tasks_done"].as_u64().unwrap(), "{report}");
    // The model's count: one row per record, each updated once.
    let out = pserver.last_json();
    let sum = |key: &str| -> u64 {
        let per_shard = out[key].as_object().unwrap_or_else(|| panic!("no {key}: {out}"));
        per_shard.values().map(|n| n.as_u64().unwrap()).sum()
    };
    assert_eq!(sum("rows"), written as u64, "rows held vs records written: {out}");
    assert_eq!(sum("row_updates"), written as u64, "record gradients applied vs written: {out}");
    // The killed trainer's task was trained again, and the pservers found
    // the examples it had pushed applied before (the case this counts).
    for t in [0, 2] {
        let trainer = &mut trainers[t];
        assert!(exits(trainer, LONG, &[]), "{} did not end well\n{}", trainer.name, trainer.dump());
    }
    let applied_before: u64 = trainers[..1]
        .iter()
        .chain(&trainers[2..])
        .map(|t| {
            let out = t.last_json();
            out["applied_before"].as_u64().unwrap_or_else(|| panic!("{out}"))
        })
        .sum();
    assert!(
        applied_before > 0,
        "no push of a rerun task was found applied before\n{}",
        dump(&trainers.iter().collect::<Vec<_>>())
    );
    // `status` shows the source, where it stopped, and the lag.
    let status = cluster.status();
    let line = status.lines().find(|l| l.contains("lag from arrival to training"));
    assert!(line.is_some_and(|l| l.contains("closed")), "{status}");
    eprintln!("{name}: {written} records, {} tasks, each accepted once", accepted.len());
}

fn arrive(dir: &Path, name: &str, body: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

#[test]
fn files_arriving_are_trained_once_through_a_master_kill_and_a_trainer_kill() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().display().to_string();
    stream_through_kills("stream-dir-kills", &["--stream-dir", &path], |kill| {
        let lines = records(0, PART);
        let parts: Vec<&[String]> = lines.chunks(100).collect();
        let mut bursts = 0;
        for (i, part) in parts.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(120));
            arrive(dir.path(), &format!("part-{i:02}.libsvm"), &part.concat());
            if i == parts.len() / 2 {
                kill(&mut |n| {
                    arrive(dir.path(), &format!("burst-{n:02}.libsvm"), &burst(n).concat());
                    bursts = n + 1;
                });
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(dir.path().join("_CLOSED"), "").unwrap();
        PART * (1 + BURST * bursts)
    });
}

#[test]
fn an_appended_file_is_trained_once_through_a_master_kill_and_a_trainer_kill() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("events.libsvm");
    let path = file.display().to_string();
    stream_through_kills("stream-file-kills", &["--stream-file", &path], |kill| {
        use std::io::Write;
        let lines = records(0, PART);
        let mut out = std::fs::File::create(&file).unwrap();
        let parts: Vec<&[String]> = lines.chunks(50).collect();
        let mut bursts = 0;
        for (i, part) in parts.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(60));
            out.write_all(part.concat().as_bytes()).unwrap();
            out.flush().unwrap();
            if i == parts.len() / 2 {
                kill(&mut |n| {
                    out.write_all(burst(n).concat().as_bytes()).unwrap();
                    out.flush().unwrap();
                    bursts = n + 1;
                });
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(format!("{path}.closed"), "").unwrap();
        PART * (1 + BURST * bursts)
    });
}
