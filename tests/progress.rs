//! `examples/local.rs` shows a progress bar per pass (tasks done of total,
//! examples per second, loss) when attached to a terminal, and only plain
//! lines when its output is piped. The terminal is a pseudo-terminal made by
//! `script(1)` (util-linux, in every Debian).

use crate::support;

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
    assert!(!text.contains("0/0 tasks"), "the bar shows before it knows the pass's tasks:\n{text}");
    // Every pass's line, once, each starting a line of its own (the bar is
    // cleared before it, not left in front of it).
    for pass in 1..=3 {
        let line = format!("pass {pass}/3: train loss");
        assert_eq!(text.matches(&line).count(), 1, "{line:?} once:\n{text}");
        let at = text.find(&line).unwrap_or(0);
        assert!(starts_a_line(&text[..at]), "{line:?} is glued to what came before:\n{text:?}");
    }
}

/// Whether text written after `before` starts at the beginning of a
/// cleared line: `before` ends with a line break or a terminal control
/// sequence (erase the line, move the cursor), not with printed text.
fn starts_a_line(before: &str) -> bool {
    if before.is_empty() || before.ends_with(['\n', '\r']) {
        return true;
    }
    // `ESC [ digits letter` at the very end.
    before.rsplit_once('\u{1b}').is_some_and(|(_, tail)| {
        tail.strip_prefix('[').is_some_and(|rest| {
            let letter = rest.trim_start_matches(|c: char| c.is_ascii_digit());
            letter.len() == 1 && letter.chars().all(|c| c.is_ascii_alphabetic())
        })
    })
}

#[test]
fn piped_output_gets_plain_lines_only() {
    let out = Command::new(support::example("local")).args(ARGS.split(' ')).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!stderr.contains("tasks, ") && !stderr.contains('\u{1b}'), "a bar or escape codes: {stderr:?}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("pass ")).count(), 3, "{stdout}");
}

/// Passes much shorter than any polling interval each get their line: 30
/// passes of a1a (a few ms each), piped.
#[test]
fn every_short_pass_gets_its_line() {
    let args = ["--data", "testdata/a1a", "--features", "123", "--classes", "2", "--passes", "30"];
    let out = Command::new(support::example("local"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for pass in 1..=30 {
        assert!(
            stdout.contains(&format!("pass {pass}/30: train loss")),
            "pass {pass} has no line:\n{stdout}"
        );
    }
}
