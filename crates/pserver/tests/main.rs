//! Every integration test of the crate, as modules of one test binary: a
//! binary per file compiled and linked the stack again (up to 20 s of build each).
//! Run one file's tests with `cargo test --test integration <file>::`.

#[cfg(feature = "service")]
mod batch;
mod checkpoint;
#[cfg(feature = "service")]
mod common;
mod frozen;
mod origin_store;
mod placement_props;
mod replica_props;
#[cfg(feature = "service")]
mod replication;
mod replication_props;
#[cfg(feature = "service")]
mod service;
mod shard_map_props;
mod snapshot_props;
mod sparse_props;
#[cfg(feature = "service")]
mod sparse_service;
mod sparse_store;
mod store_props;
