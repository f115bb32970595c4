//! What oar's benchmark binaries (`src/bin/`) share. Each binary measures a
//! part of oar against a reference it measures in the same run and prints
//! the ratio; `BENCHMARKS.md` records the figures and the commands.

#![warn(missing_docs)]

pub mod child;
pub mod pserver;
pub mod transport;
