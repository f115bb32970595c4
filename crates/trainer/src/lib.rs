//! oar's trainers: the [`Model`](model::Model) trait, built-in models (softmax
//! regression and a one-hidden-layer MLP, with matrix products through
//! `matrixmultiply`), data readers (libsvm, CSV), a synthetic dataset
//! generator, evaluation, and the training loop ([`worker`]) that trains on
//! a master's tasks against the pservers. Sparse models over embedding tables
//! keyed by `u64` id: the [`SparseModel`] trait, the built-in CTR models
//! ([`CtrModelConfig`]: logistic regression and a factorization machine) and
//! their id readers ([`id_reader`]). Registering with a job and the
//! roles around the loop are `oar-job`'s.
//!
//! ```
//! use oar_pserver::ParamBuf;
//! use oar_trainer::{model::Example, ModelConfig};
//!
//! let model = ModelConfig::Softmax { features: 3, classes: 2 }.build().unwrap();
//! let params = ParamBuf::zeros(&model.param_specs());
//! let mut grads = ParamBuf::zeros(&model.param_specs());
//! let batch = [Example { label: 1, features: vec![(0, 1.0), (2, -0.5)] }];
//! // With all-zero parameters both classes are equally likely: loss = ln 2.
//! let loss = model.loss_and_grad(&params, &batch, &mut grads);
//! assert!((loss - std::f32::consts::LN_2).abs() < 1e-6);
//! ```
#![warn(missing_docs)]
// The docs link the shell's items, which exist with the `worker` feature only.
#![cfg_attr(not(feature = "worker"), allow(rustdoc::broken_intra_doc_links))]

pub mod any_model;
pub mod config;
pub mod ctr;
pub mod datagen;
mod error;
pub mod eval;
pub mod id_reader;
mod math;
pub mod mlp;
pub mod model;
pub mod reader;
pub mod schedule;
pub mod softmax;
pub mod sparse_model;
#[cfg(feature = "worker")]
pub mod worker;

pub use any_model::{AnyModel, Examples};
pub use config::ModelConfig;
pub use ctr::CtrModelConfig;
pub use error::{Error, Result};
pub use id_reader::IdExample;
pub use sparse_model::{RowBatch, SparseModel};
