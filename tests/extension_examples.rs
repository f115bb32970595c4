//! The extension examples as a user runs them: a user-defined optimizer on
//! the pservers and a user-defined model, each trained through oar on a1a
//! to at least 82% on a1a.t (the examples exit 1 below that).

mod support;

use std::process::Command;

fn runs_and_reaches_82_percent(name: &str) {
    let out = Command::new(support::example(name)).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} failed\nstdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("pass ")).count(), 5, "{stdout}");
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(report["state"], "done", "{report}");
    let accuracy = report["test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.82, "{name}: {accuracy} on a1a.t\n{report}");
}

#[test]
fn a_user_defined_optimizer_trains_a1a() {
    runs_and_reaches_82_percent("custom_optimizer");
}

#[test]
fn a_user_defined_model_trains_a1a() {
    runs_and_reaches_82_percent("custom_model");
}
