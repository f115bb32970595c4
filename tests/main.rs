//! Every integration test of the crate, as modules of one test binary: a
//! binary per file compiled and linked the stack again (up to 20 s of build each).
//! Run one file's tests with `cargo test --test integration <file>::`.
//!
//! Not here: `a1a.rs`, a binary of its own, because it starts CPU hogs to
//! train under a load it knows; beside the other tests that load would slow
//! them, and theirs would add to it.

mod bad_data;
mod cluster;
mod elastic;
mod etcd_blips;
mod extension_examples;
mod faults;
mod job_checkpoints;
mod kubernetes;
mod local_example;
mod metrics;
mod progress;
mod replication;
mod shutdown;
mod sparse;
mod sparse_training;
mod startup;
mod streaming;
mod streaming_cluster;
mod support;
mod sync_equivalence;
mod trainer_pipeline;
