//! oar: distributed-training building blocks in the trainer / parameter-server style.
//!
//! This facade re-exports the crates:
//!
//! - [`transport`]: message RPC with raw tensor payloads ([`transport::Transport`]).
//! - [`discovery`]: leases, watches and fenced locks ([`discovery::Discovery`]).
//! - [`task_queue`]: dataset chunking, the task queue, the master service.
//! - [`pserver`]: placement, optimizers, the parameter store, the pserver service.
//! - [`trainer`]: the `Model` trait, models, readers, the training loop.
//! - [`metrics`]: the process's Prometheus metrics and a `/metrics` endpoint.
//!
//! A whole job in one process, on generated data:
//!
//! ```
//! use oar::{discovery::MemDiscovery, trainer::{datagen::write_blobs, job::JobConfig, local::run_local, model::ModelConfig}};
//! use oar::transport::{MemNetwork, MemTransport};
//! use std::sync::Arc;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let dir = tempfile::tempdir().unwrap();
//! let (train, test) = write_blobs(dir.path(), 3, 8, 600, 300, 7).unwrap();
//! let mut config = JobConfig::new(train.to_str().unwrap(), ModelConfig::Softmax { features: 8, classes: 3 });
//! config.test_data = Some(test.display().to_string());
//! config.passes = 3;
//! let report = run_local(
//!     &config,
//!     2,
//!     Arc::new(MemDiscovery::new()),
//!     Arc::new(MemTransport::new(MemNetwork::new())),
//!     "mem:0",
//!     |pass| println!("{pass:?}"),
//! )
//! .await
//! .unwrap();
//! assert_eq!(report.state, "done");
//! assert!(report.test_accuracy > 0.9);
//! # });
//! ```
#![warn(missing_docs)]

pub use oar_discovery as discovery;
pub use oar_metrics as metrics;
pub use oar_pserver as pserver;
pub use oar_task_queue as task_queue;
pub use oar_trainer as trainer;
pub use oar_transport as transport;
