//! What oar's benchmark binaries (`src/bin/`) share. Each binary measures a
//! part of oar against a reference it measures in the same run and prints
//! the ratio; `BENCHMARKS.md` records the figures and the commands.

#![warn(missing_docs)]

pub mod child;
pub mod pserver;
pub mod transport;

/// What the benchmarks' fallible parts return: they only report errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A benchmark's exit code: success, or 2 after printing `error (what): e`
/// (what: the role of a child process, or the benchmark's name).
pub fn exit_code(result: Result<(), BoxError>, what: impl std::fmt::Debug) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error ({what:?}): {e}");
            std::process::ExitCode::from(2)
        }
    }
}
