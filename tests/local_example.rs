//! The `local` example as a user runs it: a short job on generated data ends
//! with a JSON line, and bad flags get a clear message and a non-zero exit.

mod support;

use std::{path::PathBuf, process::Command};

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
    let out = Command::new(example()).args(args).output().unwrap();
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
    fails_with(&["--push-every", "3"], "async mode only");
    fails_with(
        &["--data", "/nonexistent/*.libsvm", "--features", "3", "--classes", "2"],
        "/nonexistent/*.libsvm",
    );
    fails_with(&["--data", "x"], "--features and --classes are required with --data");
}
