//! The `local` example as a user runs it: a short job on generated data ends
//! with a JSON line, and bad flags get a clear message and a non-zero exit.

use crate::support;

use std::{path::PathBuf, process::Command};

/// The flags of a job on a1a, scored on a1a.t.
const A1A: [&str; 8] =
    ["--data", "testdata/a1a", "--test-data", "testdata/a1a.t", "--features", "123", "--classes", "2"];

fn example() -> PathBuf {
    support::example("local")
}

#[test]
fn a_short_job_on_generated_data_ends_with_a_json_report() {
    let out = Command::new(example())
        .args(["--passes", "2", "--trainers", "2", "--pservers", "2", "--features", "8", "--classes", "3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.iter().filter(|l| l.starts_with("pass ")).count(), 2, "{stdout}");
    let report: serde_json::Value = serde_json::from_str(lines.last().unwrap()).unwrap();
    assert_eq!(report["state"], "done");
    assert_eq!(report["passes"], 2);
    assert!(report["test_accuracy"].as_f64().unwrap() > 0.9, "{report}");
    for key in [
        "final_loss",
        "train_accuracy",
        "examples_per_second",
        "tasks_done",
        "tasks_failed",
        "tasks_discarded",
        "wall_seconds",
    ] {
        assert!(report.get(key).is_some(), "missing {key} in {report}");
    }
}

fn fails_with(args: &[&str], message: &str) {
    let out = Command::new(example()).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(stderr.contains(message), "{args:?}: stderr {stderr:?} should contain {message:?}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
}

#[test]
fn bad_flags_get_a_clear_message() {
    fails_with(&["--mode", "sideways"], "invalid value 'sideways' for '--mode");
    fails_with(&["--trainers", "many"], "invalid value 'many' for '--trainers");
    fails_with(&["--passes", "0"], "passes must be at least 1");
    fails_with(&["--trainers", "0"], "trainers must be at least 1");
    fails_with(&["--lr=-1"], "lr");
    // A negative value after a space reaches the validation too.
    fails_with(&["--lr", "-1"], "lr = -1 is invalid: finite and > 0");
    fails_with(&["--passes", "-1"], "invalid value '-1' for '--passes");
    fails_with(&["--push-every", "3"], "async mode only");
    fails_with(
        &["--data", "/nonexistent/*.libsvm", "--features", "3", "--classes", "2"],
        "--data: glob pattern \"/nonexistent/*.libsvm\" matches no file",
    );
    fails_with(
        &["--data", "testdata/a1a", "--test-data", "/nonexistent.t", "--features", "3", "--classes", "2"],
        "--test-data: glob pattern \"/nonexistent.t\" matches no file",
    );
    fails_with(&["--data", "x"], "--features and --classes are required with --data");
}

/// A failed job as a user meets it: exit 1 (not 2, the code of an error),
/// one line on stderr naming the cause, and the job's real report as the
/// last stdout line: failed, with its reason and its discarded tasks.
fn fails_as_a_job(args: &[&str], cause: &[&str]) -> serde_json::Value {
    let out = Command::new(example()).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{args:?}\nstdout: {stdout}\nstderr: {stderr}");
    let error = stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {stderr}"));
    assert!(error.starts_with("error: the job failed: "), "{error}");
    for word in cause {
        assert!(error.contains(word), "{error:?} should name {word:?}");
    }
    assert!(!stderr.contains("holds no"), "the report must read back: {stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(report["state"], "failed", "{report}");
    assert!(error.ends_with(report["reason"].as_str().expect("a reason")), "{error} vs {report}");
    report
}

#[test]
fn a_job_of_garbage_lines_fails_naming_the_file_line_and_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.libsvm");
    std::fs::write(&path, "garbage line\nmore junk here\n").unwrap();
    let data = path.display().to_string();
    let report = fails_as_a_job(
        &["--data", &data, "--features", "3", "--classes", "2", "--passes", "2"],
        &["every task of pass 1 was discarded", "garbage.libsvm:1", "--skip-bad-lines"],
    );
    assert_eq!(report["tasks_discarded"], 1, "{report}");
    assert_eq!(report["passes"], 0, "{report}");
    assert!(report["final_loss"].is_null(), "no loss was measured: {report}");
}

#[test]
fn a_wrong_feature_count_discards_every_task_and_says_why() {
    let args = [&A1A[..4], &["--features", "10", "--classes", "2"]].concat();
    let report = fails_as_a_job(&args, &["feature index", "out of range 1..=10"]);
    let discarded = report["discarded"].as_array().unwrap();
    assert!(!discarded.is_empty(), "{report}");
    assert_eq!(
        report["tasks_discarded"].as_u64(),
        Some(discarded.len() as u64),
        "every task, listed: {report}"
    );
    assert_eq!(report["tasks_done"], 0, "{report}");
}

#[test]
fn a_diverging_job_ends_failed_naming_the_learning_rate() {
    for lr in ["1e9", "1e38"] {
        let args = [&A1A[..], &["--lr", lr]].concat();
        // Scoring runs beside training: on data this small the job may have
        // trained to its end before the divergence is seen; it fails anyway.
        fails_as_a_job(&args, &["diverged", "learning rate"]);
    }
}

/// Ctrl-C stops a running job gracefully: the trainers first (they push
/// what they trained and hand their tasks back to a master still serving),
/// then the master and the pservers; `local` exits 130 with no error.
#[test]
fn ctrl_c_stops_a_running_job_gracefully() {
    let mut command = Command::new(example());
    command.current_dir(env!("CARGO_MANIFEST_DIR")).args(A1A).args(["--passes", "100000", "--mode", "async"]);
    let mut local = support::Proc::spawn("local", command);
    let started = local.wait_for_line(std::time::Duration::from_secs(60), |l| l.starts_with("pass 2/"));
    assert!(started.is_some(), "{}", local.dump());
    local.signal("INT");
    let status =
        local.wait(std::time::Duration::from_secs(30)).unwrap_or_else(|| panic!("no exit\n{}", local.dump()));
    assert_eq!(status.code(), Some(130), "{}", local.dump());
    assert!(!local.stderr().contains("error"), "{}", local.dump());
}

/// `examples/ctr` as its header says to run it: no flags, a whole CTR job
/// on a1a (feature indices as ids, no `--features`), scored on a1a.t; and
/// with the data flags `local` takes. A dense model is refused by name.
#[test]
fn the_ctr_example_trains_a1a_with_no_feature_count() {
    let ctr = support::example("ctr");
    // The least test accuracy of each run: LR (sync, the default) scores
    // 84.3%; FM async varies with the trainers' interleaving, 82.8-83.8%
    // over 20 runs (2026-11-26), so it is held to 82%.
    for (least, args) in [
        (0.83, &[][..]),
        (
            0.82,
            &[
                "--data",
                "testdata/a1a",
                "--test-data",
                "testdata/a1a.t",
                "--format",
                "libsvm",
                "--model",
                "fm",
                "--mode",
                "async",
            ][..],
        ),
    ] {
        let out = Command::new(&ctr).args(args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}\nstdout: {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout.lines().filter(|l| l.starts_with("pass ")).count(), 10, "{stdout}");
        let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(report["state"], "done", "{report}");
        assert_eq!(report["tasks_discarded"], 0, "{report}");
        let accuracy = report["test_accuracy"].as_f64().unwrap();
        assert!(accuracy >= least, "{args:?}: {accuracy} on a1a.t\n{report}");
    }
    let out = Command::new(&ctr).args(["--model", "softmax"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ctr trains sparse models, lr or fm"), "{stderr}");
}
