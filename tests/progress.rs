//! `examples/local.rs` shows a progress bar per pass (tasks done of total,
//! examples per second, loss) when attached to a terminal, and only plain
//! lines when its output is piped. The terminal is a pseudo-terminal made by
//! `script(1)` (util-linux, in every Debian).

mod support;

use std::process::Command;

const ARGS: &str = "--passes 3 --trainers 2";

#[test]
fn a_terminal_gets_a_progress_bar() {
    let command = format!("{} {ARGS}", support::example("local").display());
    let out = Command::new("script").args(["-qec", &command, "/dev/null"]).output().expect("script(1) runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    // A bar for some pass: a fast machine can finish pass 1 before the bar starts.
    assert!(text.contains("/3 ["), "no progress bar on a terminal:\n{text}");
    // The generated data (3.2 MB) in tasks sized from it: 32 per pass.
    assert!(text.contains("/32 tasks, ") && text.contains("examples/s, loss"), "{text}");
    assert!(text.contains("pass 3/3: train loss"), "the plain per-pass lines too:\n{text}");
}

#[test]
fn piped_output_gets_plain_lines_only() {
    let out = Command::new(support::example("local")).args(ARGS.split(' ')).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!stderr.contains("tasks, ") && !stderr.contains('\u{1b}'), "a bar or escape codes: {stderr:?}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("pass ")).count(), 3, "{stdout}");
}
