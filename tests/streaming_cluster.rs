//! A streaming job as separate processes around a real etcd: a writer adds
//! files (or appends lines) while the cluster trains; the master is
//! SIGKILLed and another started, and a trainer is SIGKILLed in the middle
//! of a task. At the close, every record written was trained in exactly one
//! accepted task: the master's count of records trained (restored across
//! the kill) equals the lines written, and no task was accepted twice.
//!
//! What this does not count: a trainer killed mid-task pushed the
//! gradients of the batches it trained before it died, and the task's
//! rerun pushes them again (as in a batch job). The promise here is that
//! of the task accounting: no record handed out twice after its task was
//! accepted, none skipped.
#![cfg(feature = "etcd")]

mod support;

use std::{path::Path, time::Duration};
use support::{accepted_once, exits, testdata, Cluster, Proc};

const LONG: Duration = Duration::from_secs(180);

/// At the kills the writer adds a1a this many times at once, so that the
/// trainers are in the middle of tasks.
const BURST: usize = 4;

/// Stream options: a1a-sized records, small tasks, a long task timeout (only
/// a lease expiry takes a dead trainer's task back), windows of 0.3 s.
fn job(source: &[&str]) -> Vec<String> {
    let mut job: Vec<String> = source.iter().map(|s| s.to_string()).collect();
    job.extend(
        [
            "--test-data",
            &testdata("a1a.t"),
            "--features",
            "123",
            "--classes",
            "2",
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

fn lines() -> Vec<String> {
    std::fs::read_to_string(testdata("a1a")).unwrap().lines().map(|l| format!("{l}\n")).collect()
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

/// Run the cluster while `write` produces the data (calling `kill` once,
/// halfway), then check every record once.
fn stream_through_kills(name: &str, source: &[&str], write: impl FnOnce(&mut dyn FnMut()) -> usize) {
    let cluster = Cluster::start(name);
    let pserver = cluster.pserver("pserver-0", 1.0);
    let mut trainers: Vec<Proc> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let job = job(source);
    let first = std::cell::RefCell::new(Some(cluster.master("master-a", &job)));
    let mut second = None;
    let mut killed = false;
    let written = write(&mut || {
        if killed {
            return;
        }
        killed = true;
        // A trainer, in the middle of a task (the writer just wrote a burst).
        trainers[1].stop_mid_task(LONG);
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
        let lines = lines();
        let parts: Vec<&[String]> = lines.chunks(100).collect();
        for (i, part) in parts.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(120));
            arrive(dir.path(), &format!("part-{i:02}.libsvm"), &part.concat());
            if i == parts.len() / 2 {
                // A burst, so that the trainers are busy for the kills.
                arrive(dir.path(), "burst.libsvm", &lines.concat().repeat(BURST));
                kill();
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(dir.path().join("_CLOSED"), "").unwrap();
        lines.len() * (1 + BURST)
    });
}

#[test]
fn an_appended_file_is_trained_once_through_a_master_kill_and_a_trainer_kill() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("events.libsvm");
    let path = file.display().to_string();
    stream_through_kills("stream-file-kills", &["--stream-file", &path], |kill| {
        use std::io::Write;
        let lines = lines();
        let mut out = std::fs::File::create(&file).unwrap();
        let parts: Vec<&[String]> = lines.chunks(50).collect();
        for (i, part) in parts.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(60));
            out.write_all(part.concat().as_bytes()).unwrap();
            out.flush().unwrap();
            if i == parts.len() / 2 {
                out.write_all(lines.concat().repeat(BURST).as_bytes()).unwrap();
                out.flush().unwrap();
                kill();
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(format!("{path}.closed"), "").unwrap();
        lines.len() * (1 + BURST)
    });
}
