//! oar's jobs: the three roles (master, pserver, trainer) as functions a
//! binary calls, the job's key layout in discovery ([`keys::JobKeys`]), its
//! options ([`config::JobConfig`], published once by the master), a whole
//! job in one process ([`local::run_local`]), and a job seen from outside
//! ([`status::JobView`]).
//!
//! The crates below this one know nothing of jobs: `oar-discovery` is a
//! coordination layer, `oar-task-queue` and `oar-pserver` are services
//! given their keys, `oar-trainer` is the model, the readers and the
//! training loop. This crate composes them.
//!
//! A job trains a dense model or one over sparse tables
//! ([`ModelConfig::Ctr`](oar_trainer::ModelConfig::Ctr), or a
//! [`Plugins::sparse_model`]), on a fixed glob over passes or on a stream
//! ([`config::JobConfig::streaming`]: a directory that grows or an appended
//! file, trained until its source is closed, reported per window; see
//! [`role::master()`] and `oar_task_queue::source`).
//!
//! Every role takes a shutdown signal (a `CancellationToken`); see
//! [`role`](role#shutdown) for what each does when it is cancelled. With the
//! feature `etcd`, [`JobContext::connect`] builds a cluster role's context
//! from etcd endpoints and PEM files.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use oar_discovery::MemDiscovery;
//! use oar_job::{config::JobConfig, local::{run_local, LocalOptions}, JobContext};
//! use oar_trainer::{datagen::write_blobs, ModelConfig};
//! use oar_transport::{MemNetwork, MemTransport};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Two Gaussian classes in 4 dimensions, written as libsvm files.
//! let dir = tempfile::tempdir()?;
//! let (train, test) = write_blobs(dir.path(), 2, 4, 2_000, 500, 7)?;
//! let mut config = JobConfig::new(&train.display().to_string(), ModelConfig::Softmax { features: 4, classes: 2 });
//! config.test_data = Some(test.display().to_string());
//! config.passes = 2;
//!
//! // A master, 2 pservers and 2 trainers in this process, on the in-process transport.
//! let discovery = Arc::new(MemDiscovery::new());
//! let transport = Arc::new(MemTransport::new(MemNetwork::new()));
//! let ctx = JobContext::new("example", discovery, transport, "mem:0");
//! let options = LocalOptions { trainers: 2, ..LocalOptions::default() };
//! let report = run_local(&ctx, &config, &options, |_| {}).await?;
//! assert!(report.is_done() && report.test_accuracy > 0.9, "{report:?}");
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

pub mod config;
pub mod context;
mod error;
pub mod keys;
pub mod local;
pub mod report;
pub mod role;
pub mod status;

#[cfg(feature = "etcd")]
pub use context::ConnectOptions;
pub use context::{JobContext, Plugins};
pub use error::{Error, Result};
