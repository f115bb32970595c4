//! The crate's errors: [`Error`] for the core (specs, placement,
//! optimizers, the store, checkpoints), and `ServiceError` for the service
//! and its client (feature `service`), which wraps it.

use crate::block::BlockId;

/// Everything that can go wrong in the core of `oar-pserver`. Each message
/// names what was wrong (which parameter, block, trainer) and the numbers
/// involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A model must have at least one parameter.
    #[error("the model has no parameters")]
    NoParams,
    /// A parameter name is empty.
    #[error("parameter #{index} has an empty name")]
    EmptyName {
        /// Position of the parameter in the spec list.
        index: usize,
    },
    /// Two parameters share a name.
    #[error("parameter name {name:?} is used twice (#{first} and #{second})")]
    DuplicateName {
        /// The repeated name.
        name: String,
        /// Position of the first use.
        first: usize,
        /// Position of the second use.
        second: usize,
    },
    /// A dimension of a shape is zero.
    #[error("parameter {name:?} has a zero dimension in shape {shape:?}")]
    ZeroDim {
        /// Parameter name.
        name: String,
        /// The offending shape.
        shape: Vec<usize>,
    },
    /// The element count of a shape does not fit in `usize`.
    #[error("parameter {name:?}: shape {shape:?} has more elements than fit in usize")]
    ShapeOverflow {
        /// Parameter name.
        name: String,
        /// The offending shape.
        shape: Vec<usize>,
    },
    /// An initialiser has a bad value (non-finite, negative std, low > high).
    #[error("parameter {name:?}: bad initialiser: {reason}")]
    BadInit {
        /// Parameter name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A placement needs at least one server.
    #[error("a placement needs at least one server, got 0")]
    NoServers,
    /// A placement needs a positive block size.
    #[error("block size must be at least 1, got 0")]
    ZeroBlockSize,
    /// Block or parameter numbers do not fit in a `u32` [`BlockId`].
    #[error("parameter {name:?} needs {blocks} blocks (or the model {params} parameters); at most {max} fit in a block id")]
    TooManyBlocks {
        /// Parameter name.
        name: String,
        /// Number of blocks the parameter would need.
        blocks: usize,
        /// Number of parameters of the model.
        params: usize,
        /// The largest allowed count.
        max: u64,
    },
    /// A server (shard) index outside the placement.
    #[error("server {server} is out of range: the placement has {servers} servers")]
    ServerOutOfRange {
        /// The requested index.
        server: u32,
        /// Number of servers in the placement.
        servers: u32,
    },
    /// An optimizer hyper-parameter is out of range.
    #[error("optimizer {optimizer}: {field} = {value} is invalid: {expected}")]
    BadOptimizer {
        /// Optimizer name.
        optimizer: &'static str,
        /// Which hyper-parameter.
        field: &'static str,
        /// The value given.
        value: f32,
        /// What a valid value looks like.
        expected: &'static str,
    },
    /// An optimizer name that is not built in.
    #[error("unknown optimizer {name:?}; valid names: {valid}")]
    UnknownOptimizer {
        /// The name given.
        name: String,
        /// Comma-separated list of valid names.
        valid: String,
    },
    /// A read or restore of a block this server does not hold.
    #[error("block {block} is not held by server {server}")]
    BlockNotHeld {
        /// The block asked for.
        block: BlockId,
        /// This server's index.
        server: u32,
    },
    /// A read, push or snapshot of a block whose values a store made to be
    /// restored ([`ParamStore::new_to_restore`](crate::ParamStore::new_to_restore))
    /// has not been given yet.
    #[error("block {block} of server {server} has not been restored yet")]
    BlockNotRestored {
        /// The block.
        block: BlockId,
        /// This server's index.
        server: u32,
    },
    /// A push carries a gradient for a block this server does not hold.
    #[error("push from trainer {trainer:?}: block {block} is not held by server {server}")]
    PushBlockNotHeld {
        /// The pushing trainer.
        trainer: String,
        /// The foreign block.
        block: BlockId,
        /// This server's index.
        server: u32,
    },
    /// A push carries the same block twice.
    #[error("push from trainer {trainer:?}: block {block} appears more than once")]
    DuplicateBlock {
        /// The pushing trainer.
        trainer: String,
        /// The repeated block.
        block: BlockId,
    },
    /// A push (or part) carries no gradient at all.
    #[error("push from trainer {trainer:?} carries no blocks")]
    EmptyPush {
        /// The pushing trainer.
        trainer: String,
    },
    /// A part of a push repeats some blocks already taken under its seq
    /// and brings others: not a retry, and not a part of the same push.
    #[error("push from trainer {trainer:?} (seq {seq}) repeats some of the blocks already taken under that seq, but not all")]
    PartOverlap {
        /// The pushing trainer.
        trainer: String,
        /// The push's sequence number.
        seq: u64,
    },
    /// A push's examples overlap examples of its task already applied
    /// without being all applied (see [`crate::origin`]).
    #[error(
        "examples {start}..{end} of task {task} (pass {pass}) overlap examples {applied_start}..{applied_end} already applied: do the job's trainers use different batch sizes or push cadences?",
        task = .task.task, pass = .task.pass
    )]
    OriginOverlap {
        /// The task.
        task: crate::origin::TaskKey,
        /// The push's first example.
        start: u32,
        /// One past its last.
        end: u32,
        /// The applied range it overlaps.
        applied_start: u32,
        /// One past its last example.
        applied_end: u32,
    },
    /// Some of a part's units were applied under its origin and some were
    /// not: the parts are cut differently from the first push's.
    #[error("a part of examples {start}..{end} of task {task} (pass {pass}) is half applied already: its parts are cut differently from the first push's", task = .task.task, pass = .task.pass)]
    OriginPartOverlap {
        /// The task.
        task: crate::origin::TaskKey,
        /// The push's first example.
        start: u32,
        /// One past its last.
        end: u32,
    },
    /// An origin with an empty or reversed range of examples.
    #[error("examples {start}..{end} of task {task} (pass {pass}): an origin names at least one example", task = .task.task, pass = .task.pass)]
    EmptyOrigin {
        /// The task.
        task: crate::origin::TaskKey,
        /// The push's first example.
        start: u32,
        /// One past its last.
        end: u32,
    },
    /// A gradient's length does not match its block.
    #[error(
        "push from trainer {trainer:?}: gradient for block {block} has {got} values, expected {expected}"
    )]
    GradLength {
        /// The pushing trainer.
        trainer: String,
        /// The block.
        block: BlockId,
        /// The block's length.
        expected: usize,
        /// The gradient's length.
        got: usize,
    },
    /// A gradient holds NaN or an infinity.
    #[error("push from trainer {trainer:?}: gradient for block {block} has non-finite value {value} at index {index}")]
    NonFiniteGrad {
        /// The pushing trainer.
        trainer: String,
        /// The block.
        block: BlockId,
        /// Index inside the block.
        index: usize,
        /// The value found.
        value: f32,
    },
    /// A push weight that is not a finite positive number.
    #[error("push from trainer {trainer:?}: weight {weight} must be finite and > 0")]
    BadWeight {
        /// The pushing trainer.
        trainer: String,
        /// The weight given.
        weight: f32,
    },
    /// Sync mode: a push for a step that is already applied.
    #[error("push from trainer {trainer:?} is for step {got}, but the server is at step {current}: pull and recompute")]
    StaleStep {
        /// The pushing trainer.
        trainer: String,
        /// The push's step.
        got: u64,
        /// The server's current step.
        current: u64,
    },
    /// Sync mode: a push for a step the server has not reached.
    #[error("push from trainer {trainer:?} is for step {got}, but the server is only at step {current}")]
    FutureStep {
        /// The pushing trainer.
        trainer: String,
        /// The push's step.
        got: u64,
        /// The server's current step.
        current: u64,
    },
    /// Sync mode: the trainer already has a gradient buffered for this step
    /// under an older sequence number.
    #[error("push from trainer {trainer:?} (seq {seq}): a gradient for step {step} is already buffered (seq {buffered_seq})")]
    AlreadyBuffered {
        /// The pushing trainer.
        trainer: String,
        /// The step.
        step: u64,
        /// The new push's sequence number.
        seq: u64,
        /// Sequence number of the buffered push.
        buffered_seq: u64,
    },
    /// Sync mode: a trainer that is not a member pushed while the step is
    /// underway (some blocks already updated without it). It is a member
    /// from the next step; pull that step and push for it.
    #[error("push from trainer {trainer:?} for step {step}: the step is underway without it (some blocks are updated); join, pull step {next} and push for it", next = step + 1)]
    StepUnderway {
        /// The pushing trainer.
        trainer: String,
        /// The step underway.
        step: u64,
    },
    /// A checkpoint of a sync store while its step is underway (some
    /// blocks updated, not all) would mix two steps; it waits for the step.
    #[error("cannot checkpoint now: step {step} is underway (some blocks updated, not all), or a push in parts is half taken")]
    CheckpointStepUnderway {
        /// The step underway.
        step: u64,
    },
    /// A restored block or optimizer state has the wrong length.
    #[error("restore of block {block}: {what} has {got} values, expected {expected}")]
    RestoreLength {
        /// The block.
        block: BlockId,
        /// `"parameters"` or `"optimizer slots"`.
        what: &'static str,
        /// The expected length.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// The job's configuration is inconsistent.
    #[error("bad configuration: {0}")]
    Config(String),
    /// A checkpoint file or directory operation failed at the OS level.
    #[error("checkpoint I/O failed {action} {}: {source}", .path.display())]
    CheckpointIo {
        /// What was being done, e.g. `"writing"`, `"renaming"`.
        action: &'static str,
        /// The file or directory.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A checkpoint file failed verification (magic, format version, a length
    /// against the file size, the CRC, a non-finite value).
    #[error("corrupt checkpoint {}: {reason}", .path.display())]
    CorruptCheckpoint {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        reason: String,
    },
    /// A checkpoint that verified but belongs to another placement, server or
    /// optimizer.
    #[error("checkpoint {} does not fit this pserver: {reason}", .path.display())]
    CheckpointMismatch {
        /// The file.
        path: std::path::PathBuf,
        /// What differs (file's value vs this store's).
        reason: String,
    },
    /// Checkpoints exist but none of them verifies and fits.
    #[error(
        "no valid checkpoint in {}: {}",
        .dir.display(),
        .tried.iter().map(|(p, why)| format!("{}: {why}", p.display())).collect::<Vec<_>>().join("; ")
    )]
    NoValidCheckpoint {
        /// The checkpoint directory.
        dir: std::path::PathBuf,
        /// Every file tried, newest first, with why it was refused.
        tried: Vec<(std::path::PathBuf, String)>,
    },
    /// A checkpoint written by a pserver that stopped owning the shard
    /// while it wrote (its lease ran out, the map moved on): not put in
    /// place, so it cannot outrank the new owner's.
    #[error("checkpoint of step {step} abandoned before it was put in place: {why}")]
    CheckpointAbandoned {
        /// The step of the snapshot.
        step: u64,
        /// Why the writer no longer owns the shard.
        why: String,
    },
    /// A replication message that does not fit the replica (wrong shard,
    /// old map, a gap in its sequence, a step out of order): nothing applied.
    #[error("replication: {0}")]
    Replication(String),
    /// A stored shard map that does not decode or breaks its rules.
    #[error("bad shard map: {0}")]
    BadShardMap(String),
    /// Two sparse tables of one model share a name.
    #[error("sparse table name {name:?} is used twice")]
    DuplicateTable {
        /// The repeated name.
        name: String,
    },
    /// A push or pull names a sparse table the model does not have.
    #[error("sparse table #{table} does not exist: the model has {tables}")]
    NoSuchTable {
        /// The table index asked for.
        table: u32,
        /// How many tables there are.
        tables: usize,
    },
    /// One push carries two row gradients for one table.
    #[error("{who} pushed rows of sparse table {table:?} twice in one push")]
    TableTwice {
        /// The trainer (or "the primary").
        who: String,
        /// The table.
        table: String,
    },
    /// Rows in a push part that is not the push's first (see `Push`).
    #[error(
        "{trainer} pushed rows in a part that is not its push's first (rows travel with the first block)"
    )]
    RowsNotInFirstPart {
        /// The trainer.
        trainer: String,
    },
    /// A row sent to a shard that does not hold it.
    #[error("{who}: row {id} of table {table:?} belongs to shard {owner}, not shard {shard}")]
    RowNotOnShard {
        /// What carried it ("a pull", a trainer, "the primary").
        who: String,
        /// The table.
        table: String,
        /// The row.
        id: u64,
        /// The shard it was sent to.
        shard: u32,
        /// The shard that holds it.
        owner: u32,
    },
    /// A recorded `CheckpointInfo` (e.g. read back from discovery) did not decode.
    #[error("bad checkpoint record: {0}")]
    BadCheckpointRecord(String),
    /// A sparse table's spec, policy or optimizer slots are invalid, or a
    /// snapshot restored into a table it does not fit.
    #[error("sparse table {table:?}: {reason}")]
    BadTable {
        /// The table's name.
        table: String,
        /// What is wrong.
        reason: String,
    },
    /// A row gradient's length is not the number of ids times the table's dim.
    #[error("sparse table {table:?}: row gradient has {got} values, expected {expected}")]
    RowGradLength {
        /// The table's name.
        table: String,
        /// `ids.len() * dim`.
        expected: usize,
        /// The gradient's length.
        got: usize,
    },
    /// A row gradient holds NaN or an infinity.
    #[error("sparse table {table:?}: gradient of row {id} has non-finite value {value} at index {index}")]
    RowNonFinite {
        /// The table's name.
        table: String,
        /// The row's id.
        id: u64,
        /// Index inside the row.
        index: usize,
        /// The value found.
        value: f32,
    },
    /// A row id appears twice in one pull or push.
    #[error("sparse table {table:?}: row {id} appears more than once in one call")]
    DuplicateRow {
        /// The table's name.
        table: String,
        /// The repeated id.
        id: u64,
    },
    /// A pull or push names more rows than one call may.
    #[error("sparse table {table:?}: {got} rows in one call, at most {max} allowed")]
    TooManyRows {
        /// The table's name.
        table: String,
        /// Rows in the call.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A restored row or candidate is invalid (a length, a non-finite
    /// value, a zero count) or does not fit the table (over its cap).
    #[error("sparse table {table:?}: restore of row {id}: {reason}")]
    RestoreRow {
        /// The table's name.
        table: String,
        /// The row's id.
        id: u64,
        /// What is wrong.
        reason: String,
    },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything the pserver service and its client can fail with: the
/// core's [`Error`] (a bad push, a bad checkpoint, ...) and what comes of
/// talking to other processes. Each message names what was wrong.
#[cfg(feature = "service")]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// From the core: the store, the placement, the optimizer, checkpoints.
    #[error(transparent)]
    Core(#[from] Error),
    /// The service's options do not fit the job.
    #[error("bad configuration: {0}")]
    Config(String),
    /// Some shards have no registered primary.
    #[error("pserver shards {missing:?} had no registered primary within {waited:?}")]
    ServersMissing {
        /// The shards without one.
        missing: Vec<u32>,
        /// How long the client waited.
        waited: std::time::Duration,
    },
    /// A shard cannot be called right now (no primary, or it moved).
    #[error("pserver shard {shard} is away: {why}")]
    ShardAway {
        /// The shard.
        shard: u32,
        /// Why.
        why: String,
    },
    /// Sync mode: a shard did not reach the awaited step in time.
    #[error("shards {shards:?} did not complete the sync step within {waited:?}")]
    BarrierTimeout {
        /// The shards still waiting.
        shards: Vec<u32>,
        /// How long the client waited.
        waited: std::time::Duration,
    },
    /// A scale request was refused ([`crate::set_pservers`]); nothing changed.
    #[error("{0}")]
    Scale(String),
    /// A pserver answered something that makes no sense for the request.
    #[error("pserver protocol error: {0}")]
    Protocol(String),
    /// This pserver stopped serving (its lease was lost, or a panic while
    /// updating its store): it writes no more checkpoints.
    #[error("pserver stopped serving: {0}")]
    Stopped(String),
    /// Work the pserver ran on a thread of its own panicked or was
    /// cancelled (say what it was).
    #[error("{0} did not finish: a panic or a cancelled task")]
    Unfinished(String),
    /// A discovery operation failed.
    #[error(transparent)]
    Discovery(#[from] oar_discovery::Error),
    /// A call failed.
    #[error(transparent)]
    Transport(#[from] oar_transport::Error),
}

/// The service's result type.
#[cfg(feature = "service")]
pub type ServiceResult<T> = std::result::Result<T, ServiceError>;

#[cfg(feature = "service")]
impl oar_transport::Transient for ServiceError {
    fn is_transient(&self) -> bool {
        match self {
            ServiceError::Transport(e) => e.is_transient(),
            ServiceError::ShardAway { .. } => true,
            ServiceError::Discovery(e) => e.is_transient(),
            _ => false,
        }
    }
}
