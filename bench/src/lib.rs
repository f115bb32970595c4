//! What oar's benchmark binaries (`src/bin/`) share. Each binary measures a
//! part of oar against a reference it measures in the same run and prints
//! the ratio; `BENCHMARKS.md` records the figures and the commands.

#![warn(missing_docs)]

pub mod child;
pub mod pserver;
pub mod transport;

/// What the benchmarks' fallible parts return: they only report errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A child-process benchmark's exit code: success, or 2 after printing
/// `error (role): e`.
pub fn exit_code(result: Result<(), BoxError>, role: impl std::fmt::Debug) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error ({role:?}): {e}");
            std::process::ExitCode::from(2)
        }
    }
}
