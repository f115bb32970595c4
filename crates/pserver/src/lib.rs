//! oar's parameter servers.
//!
//! A model is a list of named parameters ([`ParamSpec`]). A [`Placement`]
//! cuts each parameter into blocks of at most `block_size` elements and
//! spreads the blocks over S logical shards by size, deterministically, so a
//! client and every server compute the same placement from the same inputs
//! (and compare [`Placement::fingerprint`] to be sure). S is a job option
//! (64 by default), independent of how many pservers there are: a versioned
//! [`ShardMap`] says which pservers hold each shard (its replica set, the
//! primary first), and shards move between pservers by map changes alone.
//!
//! Each replica of a shard is a [`ParamStore`]: the parameters of its
//! blocks, initialised by [`init_values`] (which depends only on the seed, the
//! parameter name and the element index, so the model is the same for any
//! number of shards), and their [`OptimizerState`]. Trainers [`Push`]
//! gradients to each shard's primary; the store applies them with an
//! [`Optimizer`] (SGD, momentum, AdaGrad and Adam built in, see
//! [`OptimizerConfig`]):
//!
//! - [`Mode::Async`]: every push is applied on arrival. A trainer that pulls
//!   right after it pushes sends both as one `PserverClient::push_pull`:
//!   each shard applies the push and answers with its parameters, one round
//!   trip instead of two (a retried push-pull is applied once and still
//!   answered with the parameters).
//! - [`Mode::Sync`]: for step n the store waits for a push from every member
//!   trainer, combines them as a weighted mean summed in trainer-id order
//!   (so K trainers on batches `b_1..b_K` give one update with the mean
//!   gradient of their union, whatever the arrival order), applies it once
//!   and moves to step n+1. A trainer that dies [`leave`](ParamStore::leave)s
//!   the barrier instead of hanging it.
//!
//! A large shard's push and pull travel in parts of bounded size (a run of
//! its blocks each, `protocol::BlockSpan`), and the store takes a push
//! part by part: async applies each part on arrival; sync keeps its barrier
//! block by block, updating a block as soon as every member has pushed it.
//! So a pserver never holds a message the size of its shard: its peak
//! memory stays within a few parts of its parameters and optimizer state.
//!
//! Every push carries `(trainer, seq)`; a retried push is acknowledged as a
//! [`PushOutcome::Duplicate`] and applied once. A bad push (wrong block,
//! wrong length, NaN, bad weight, wrong step) is rejected with an [`Error`]
//! naming what was wrong, before anything changes.
//!
//! **Sparse tables** ([`sparse`]): a model may also declare tables of rows
//! keyed by `u64` id ([`TableSpec`]), created on first push with values
//! that depend only on (seed, table, id), with row-wise optimizer state,
//! admission, expiry and a capped memory with LRU/LFU eviction. Row `id`
//! of a table lives on shard [`sparse::row_shard`], in that shard's store,
//! so it is replicated, checkpointed and moved with the shard. Rows travel
//! in pushes ([`RowGrads`]) and are read with `PserverClient::pull_rows`,
//! one call per pserver.
//!
//! **Core and shell.** This crate's core ([`spec`], [`placement`],
//! [`optimizer`], [`store`], [`sparse`], and the [`checkpoint`] files) reads no clock
//! and needs neither tokio nor a network; the service and its client
//! (modules `service`, `client` and `protocol`, with [`ServiceError`]) are
//! behind the default feature `service`. With `default-features = false`
//! the crate is the core alone, and Cargo, not discipline, keeps it so.
//!
//! **Replication** (module [`replica`], the I/O-free core; `service` and
//! [`coordinator`] run it). With R replicas per shard (a job option, 1 by
//! default) the primary applies each update, forwards it to its followers
//! (async: each push; sync: each completed step, with the `(trainer, seq)`
//! of the pushes it took) and, in **strong mode**, answers the trainer only
//! when every follower in the current map holds it. A sync push that waits
//! in its step is answered part by part, each part once its blocks are
//! updated (every member pushed them) and the part that completes the step
//! once the step is replicated, so the whole push is answered when its step
//! is complete and replicated. A follower keeps the push deduplication
//! table, so a push retried on a new primary is applied once. The
//! [`Coordinator`] (the master runs it, under the master's fence) writes
//! the map: when a primary's registration (its lease) goes, the follower
//! that has applied the most and knows the current map becomes primary in
//! a new epoch (one due to sync again only when no caught-up follower is
//! left: acknowledgements wait for it, so it holds every acknowledged
//! update); a dead follower is dropped, and the
//! cluster status (`pserver_cluster_status`) says UNHEALTHY until a
//! replacement has caught up (a snapshot streamed in parts while pushes go
//! on, then the tail). A primary that is paused or cut off past its lease
//! acknowledges nothing more: before every answer it checks its lease and
//! that it is still primary, and followers refuse a forward of an older
//! epoch or map.
//!
//! What that promises:
//!
//! - **R ≥ 2**: no acknowledged update is lost, and none applied twice, as
//!   long as at most R−1 replicas of a shard fail before a replacement has
//!   caught up (`tests/replication.rs` SIGKILLs primaries and counts every
//!   push). A shard is away for about one lease TTL after its primary
//!   dies; trainers follow the map and retry there.
//! - **R = 1**, or all replicas gone: the shard is restored on another
//!   pserver from its newest verified checkpoint, losing at most the
//!   updates of one checkpoint interval. No update is applied twice: the
//!   checkpoint holds the deduplication table. If none of the shard's
//!   checkpoints loads, the shard waits (never served from scratch): its
//!   pserver tries again every 5 s and serves its other shards meanwhile,
//!   and the cluster status names the error.
//! - There is no bounded-lag mode (acknowledging before the followers
//!   hold an update): strong mode is the only one.
//! - A primary writes its shards' checkpoints (`<dir>/shard-<s>/`, a
//!   directory every pserver can reach), so a whole cluster restart
//!   restores every shard from them.
//!
//! ```
//! use oar_pserver::{
//!     BlockId, Init, Mode, OptimizerConfig, ParamSpec, ParamStore, Placement, Push, PushOutcome,
//! };
//!
//! let specs = vec![
//!     ParamSpec::new("w", vec![4, 3], Init::Uniform { low: -0.1, high: 0.1 }),
//!     ParamSpec::new("b", vec![3], Init::Zeros),
//! ];
//! // Blocks of at most 5 elements over 2 shards: w -> 5+5+2, b -> 3.
//! let placement = Placement::new(&specs, 2, 5)?;
//! assert_eq!(placement.blocks().len(), 4);
//!
//! // The store of shard 1, applying SGD on arrival.
//! let sgd = OptimizerConfig::parse("sgd", 0.5)?.build()?;
//! let mut store = ParamStore::new(&placement, 1, 42, sgd, Mode::Async)?;
//! let held: Vec<BlockId> = store.block_ids().collect();
//! let before: Vec<Vec<f32>> = held.iter().map(|&id| store.block(id).map(<[f32]>::to_vec)).collect::<Result<_, _>>()?;
//!
//! // A trainer pushes a gradient of ones for every block of this shard.
//! let grads = placement.blocks_on(1).map(|b| (b.id, vec![1.0; b.len].into())).collect();
//! let push = Push { trainer: "trainer-0".into(), seq: 1, step: 0, weight: 1.0, grads, rows: Vec::new(), origin: None };
//! assert_eq!(store.push(push.clone())?, PushOutcome::Applied { step: 1 });
//! // A retry of the same push is not applied twice.
//! assert_eq!(store.push(push)?, PushOutcome::Duplicate);
//!
//! for (id, old) in held.iter().zip(&before) {
//!     let now = store.block(*id)?;
//!     assert!(now.iter().zip(old).all(|(n, o)| *n == *o - 0.5));
//! }
//! # Ok::<(), oar_pserver::Error>(())
//! ```
#![warn(missing_docs)]
// The docs link the shell's items, which exist with the `service` feature only.
#![cfg_attr(not(feature = "service"), allow(rustdoc::broken_intra_doc_links))]

pub mod block;
pub mod checkpoint;
#[cfg(feature = "service")]
pub mod client;
#[cfg(feature = "service")]
pub mod coordinator;
pub mod error;
pub mod optimizer;
pub mod origin;
pub mod placement;
#[cfg(feature = "service")]
pub mod protocol;
pub mod replica;
pub mod rng;
#[cfg(feature = "service")]
pub mod service;
pub mod shard_map;
pub mod sparse;
pub mod spec;
pub mod store;
#[cfg(feature = "service")]
pub mod topology;

pub use block::BlockId;
#[cfg(feature = "service")]
pub use client::{PserverClient, PserverClientOptions, PushResult, RowsAhead, TableGrads};
#[cfg(feature = "service")]
pub use coordinator::{set_pservers, Coordinator, CoordinatorOptions, ScaleOptions, Scaled};
pub use error::{Error, Result};
#[cfg(feature = "service")]
pub use error::{ServiceError, ServiceResult};
pub use optimizer::{
    AdaGrad, Adam, Momentum, Optimizer, OptimizerConfig, OptimizerState, Sgd, OPTIMIZER_NAMES,
};
pub use origin::{AppliedOrigins, Origin, TaskKey};
pub use placement::{BlockInfo, Placement, SMALL_BLOCK_DIVISOR};
pub use rng::{hash_str, SplitMix64};
#[cfg(feature = "service")]
pub use service::{OptimizerFactory, PrimaryAtStop, Pserver, PserverKeys, PserverOptions};
pub use shard_map::{Health, PserverId, Role, ShardMap};
pub use sparse::{
    init_row, row_bytes, row_shard, Candidate, Eviction, RowPolicy, RowRecord, SparseTable, TableSnapshot,
    TableSpec, TableStats,
};
pub use spec::{init_values, validate_specs, Init, ParamBuf, ParamSpec};
pub use store::{
    CompletedStep, Grad, Mode, ParamStore, Push, PushOutcome, RowGrads, SharedValues, StoreSnapshot,
};
