//! oar: distributed-training building blocks in the trainer / parameter-server style.
//!
//! This facade re-exports the crates:
//!
//! - [`transport`]: message RPC with raw tensor payloads ([`transport::Transport`]).
//! - [`discovery`]: leases, watches and fenced locks ([`discovery::Discovery`]).
//! - [`task_queue`]: dataset chunking, the task queue, the master service.
//! - [`pserver`]: placement, optimizers, the parameter store, the pserver service.
//! - [`trainer`]: the `Model` trait, models, readers, the training loop.
//! - [`job`]: the three roles, the job's keys and options, `run_local`, status.
//! - [`metrics`]: the process's Prometheus metrics and a `/metrics` endpoint.
//!
//! A whole job in one process, on generated data:
//!
//! ```
//! use oar::job::{config::JobConfig, local::{run_local, LocalOptions}, JobContext};
//! use oar::trainer::{datagen::write_blobs, ModelConfig};
//! use oar::{discovery::MemDiscovery, transport::{MemNetwork, MemTransport}};
//! use std::sync::Arc;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let dir = tempfile::tempdir().unwrap();
//! let (train, test) = write_blobs(dir.path(), 3, 8, 600, 300, 7).unwrap();
//! let mut config = JobConfig::new(train.to_str().unwrap(), ModelConfig::Softmax { features: 8, classes: 3 });
//! config.test_data = Some(test.display().to_string());
//! config.passes = 3;
//! let discovery = Arc::new(MemDiscovery::new());
//! let transport = Arc::new(MemTransport::new(MemNetwork::new()));
//! let ctx = JobContext::new("demo", discovery, transport, "mem:0");
//! let options = LocalOptions { trainers: 2, ..LocalOptions::default() };
//! let report = run_local(&ctx, &config, &options, |pass| println!("{pass:?}")).await.unwrap();
//! assert!(report.is_done());
//! assert!(report.test_accuracy > 0.9);
//! # });
//! ```
#![warn(missing_docs)]

pub use oar_discovery as discovery;
pub use oar_job as job;
pub use oar_metrics as metrics;
pub use oar_pserver as pserver;
pub use oar_task_queue as task_queue;
pub use oar_trainer as trainer;
pub use oar_transport as transport;
