//! Every integration test of the crate, as modules of one test binary: a
//! binary per file compiled and linked the stack again (up to 20 s of build each).
//! Run one file's tests with `cargo test --test integration <file>::`.

#[cfg(feature = "service")]
mod master_service;
#[cfg(feature = "service")]
mod master_stream;
mod queue_props;
mod source;
mod stream_props;
