//! The parameter store of one pserver shard: its blocks, their optimizer
//! state, push deduplication and the sync barrier, and the copy-on-write
//! [`StoreSnapshot`] a checkpoint is written from. No I/O, no clock.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use crate::block::BlockId;
use crate::error::{Error, Result};
use crate::optimizer::{Optimizer, OptimizerState};
use crate::origin::{AppliedOrigins, Origin, Seen};
use crate::placement::Placement;
use crate::sparse::{row_shard, row_shard_hashed, SparseTable, TableSnapshot, MAX_ROWS_PER_CALL};
use crate::spec::init_values;

/// How pushes become updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Wait for every member trainer's gradient for the step, combine them in
    /// trainer-id order, apply once.
    Sync,
    /// Apply every push on arrival.
    Async,
}

/// One block's gradient as a push carries it.
#[derive(Clone, Debug, PartialEq)]
pub enum Grad {
    /// Floats in memory.
    Floats(Vec<f32>),
    /// Little-endian `f32` bytes as they arrived: a view into the push's
    /// message (`Bytes::slice`), so a pserver applies a push without copying
    /// it first. A length that is not a multiple of 4 is refused by the store.
    Wire(bytes::Bytes),
}

impl From<Vec<f32>> for Grad {
    fn from(floats: Vec<f32>) -> Self {
        Grad::Floats(floats)
    }
}

impl Grad {
    /// Elements (for wire bytes, whole 4-byte values).
    pub fn len(&self) -> usize {
        match self {
            Grad::Floats(v) => v.len(),
            Grad::Wire(b) => b.len() / 4,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whole elements: false for wire bytes with a partial value at the end.
    fn whole(&self) -> bool {
        match self {
            Grad::Floats(_) => true,
            Grad::Wire(b) => b.len() % 4 == 0,
        }
    }

    /// The first value that is NaN or infinite, with its index.
    fn first_non_finite(&self) -> Option<(usize, f32)> {
        match self {
            Grad::Floats(v) => first_non_finite_value(v).map(|i| (i, v[i])),
            Grad::Wire(b) => first_non_finite(b),
        }
    }

    /// The values: borrowed where the bytes can be read in place (aligned,
    /// on a little-endian machine), else decoded into `scratch`.
    fn floats<'a>(&'a self, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        match self {
            Grad::Floats(v) => v,
            Grad::Wire(b) => match bytemuck::try_cast_slice(b) {
                Ok(view) if cfg!(target_endian = "little") => view,
                _ => {
                    scratch.clear();
                    scratch.extend(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
                    scratch
                }
            },
        }
    }
}

/// Values scanned at a time for a NaN or an infinity.
const RUN: usize = 64;
/// An `f32`'s bits without the sign.
const ABS: u32 = 0x7fff_ffff;
/// The smallest of those bits that is not finite.
const INFINITY: u32 = 0x7f80_0000;

/// The index of the first value of `values` that is NaN or infinite, by
/// the same runs as [`first_non_finite`] (a restored block is checked
/// whole, and `position(is_finite)` took a millisecond per 2M values).
fn first_non_finite_value(values: &[f32]) -> Option<usize> {
    for (r, run) in values.chunks(RUN).enumerate() {
        let worst = run.iter().fold(0, |worst, x| worst.max(x.to_bits() & ABS));
        if worst >= INFINITY {
            return run.iter().position(|x| !x.is_finite()).map(|i| r * RUN + i);
        }
    }
    None
}

/// How many values of `values` are NaN or infinite, by the same runs as
/// [`first_non_finite_value`] (a checkpoint counts every value it writes).
pub(crate) fn count_non_finite(values: &[f32]) -> u64 {
    let mut count = 0;
    for run in values.chunks(RUN) {
        let worst = run.iter().fold(0, |worst, x| worst.max(x.to_bits() & ABS));
        if worst >= INFINITY {
            count += run.iter().filter(|x| !x.is_finite()).count() as u64;
        }
    }
    count
}

/// The first of the little-endian `f32` in `bytes` that is NaN or infinite,
/// with its index. Every push is checked before anything is applied, so
/// this reads every gradient once more: it scans runs of 64 values with a
/// branch-free maximum of their exponent and mantissa bits (which the
/// compiler vectorises) and looks at single values only in the run that
/// has one. An element-by-element search took 6-7% of a pserver's CPU in
/// `bench_push_pull`.
fn first_non_finite(bytes: &[u8]) -> Option<(usize, f32)> {
    let value = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    for (r, run) in bytes.chunks(RUN * 4).enumerate() {
        let worst = run.chunks_exact(4).fold(0, |worst, c| worst.max(value(c) & ABS));
        if worst >= INFINITY {
            return run
                .chunks_exact(4)
                .position(|c| value(c) & ABS >= INFINITY)
                .map(|i| (r * RUN + i, f32::from_bits(value(&run[i * 4..]))));
        }
    }
    None
}

/// One sparse table's row gradients in a push: `grads` holds
/// `ids.len() * dim` values, row after row, in `ids` order.
#[derive(Clone, Debug, PartialEq)]
pub struct RowGrads {
    /// The table: its index in [`Placement::tables`].
    pub table: u32,
    /// The rows, each once, all of this shard
    /// ([`Placement::row_shard`]).
    pub ids: Vec<u64>,
    /// Their gradients.
    pub grads: Grad,
}

/// One trainer's gradients for some or all of the blocks a server holds,
/// and for the rows of its sparse tables.
///
/// A large gradient may come in parts (the client cuts a shard's blocks
/// into messages of bounded size, so neither side holds the whole of it
/// at once): each part is a `Push` with the same `seq` and its own blocks.
/// The push is whole once every held block has come under that `seq`.
///
/// In a job with sparse tables, the row gradients travel in the push's
/// **first part**: the one carrying the shard's first block, or the only
/// part of a shard that holds no block. That part carries `rows` even if
/// empty (a trainer that touched no row of the shard), and no other part
/// carries any: so the rows are taken once with their part, and the sync
/// barrier knows when every member's rows are in.
#[derive(Clone, Debug, PartialEq)]
pub struct Push {
    /// Trainer id; also the order in which sync gradients are summed.
    pub trainer: String,
    /// Strictly increasing per trainer over the trainer's whole life; a push
    /// with `seq <` the last accepted one, or a part of the last one whose
    /// blocks were all taken already, is a retry and is not applied again.
    /// A restarted trainer must use a new id or continue above its old seqs.
    pub seq: u64,
    /// Sync: the step the gradient was computed at (must equal the store's
    /// step). Async: informational, not checked.
    pub step: u64,
    /// Sync: the weight of this gradient in the weighted mean, normally the
    /// mini-batch size. Async: validated but not used (the gradient is
    /// applied as is).
    pub weight: f32,
    /// One gradient per block of this part (at least one, unless the
    /// shard holds no block), in any order.
    pub grads: Vec<(BlockId, Grad)>,
    /// Row gradients per sparse table, each table at most once (see above:
    /// only in the first part; empty in a job without tables).
    pub rows: Vec<RowGrads>,
    /// Which examples of which task the gradient comes from, if the trainer
    /// says: a push of examples already applied (by a trainer that died in
    /// the middle of the task, say) is a duplicate, whatever its trainer
    /// and seq ([`crate::origin`]).
    pub origin: Option<Origin>,
}

/// What a push did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PushOutcome {
    /// Taken and applied. Async: `step` counts the whole pushes applied so
    /// far (a part that completes its push counts it). Sync: the part
    /// completed the step; `step` is the new one.
    Applied {
        /// The store's step after it.
        step: u64,
    },
    /// Sync: taken for `step`, which still waits for `waiting_for` members.
    /// (Blocks every member has pushed are already updated.)
    Buffered {
        /// The step being gathered.
        step: u64,
        /// Members that have not pushed every block of it yet.
        waiting_for: usize,
    },
    /// A retry of a push already accepted: nothing changed.
    Duplicate,
    /// Async: the examples its gradient comes from were applied already,
    /// by another push of the same origin (another trainer's, before it
    /// died) or their task is finished ([`crate::origin`]): taken (and
    /// counted, in the step and the pushes, as a push is) but no parameter
    /// changed. Sync, such a push takes its place in the step with no
    /// weight, and is answered as any other.
    AppliedBefore,
}

/// A held block.
#[derive(Debug)]
struct Held {
    id: BlockId,
    /// The block's length (placement's); its data is empty until restored
    /// in a store made by [`ParamStore::new_to_restore`].
    len: usize,
    /// Shared with the snapshots taken since its last update; an update
    /// copies it first if one still holds it (see [`ParamStore::block_mut`]).
    data: Arc<BlockData>,
}

impl Held {
    /// Whether the block has its values: always, but in a store made to be
    /// restored before [`ParamStore::restore_block`] gave them.
    fn restored(&self) -> bool {
        self.data.params.len() == self.len
    }
}

/// Block `b`'s initial values ([`init_values`] for `seed`) and fresh
/// optimizer state: what [`ParamStore::new`] gives each block.
pub(crate) fn initial_block(
    specs: &[crate::ParamSpec],
    b: &crate::BlockInfo,
    seed: u64,
    optimizer: &dyn Optimizer,
) -> (Vec<f32>, OptimizerState) {
    let mut params = vec![0.0; b.len];
    // Placement only creates blocks of existing parameters.
    if let Some(spec) = specs.get(b.id.param as usize) {
        init_values(spec, seed, b.offset, &mut params);
    }
    (params, optimizer.new_state(b.len))
}

/// A snapshot block's parameters or its optimizer slots
/// ([`StoreSnapshot::shared_blocks`]): cheap to clone, and the values stay
/// as they are while any handle lives.
#[derive(Clone, Debug)]
pub struct SharedValues {
    data: Arc<BlockData>,
    /// The optimizer slots, not the parameters.
    slots: bool,
}

impl AsRef<[f32]> for SharedValues {
    fn as_ref(&self) -> &[f32] {
        match self.slots {
            false => &self.data.params,
            true => &self.data.state.slots,
        }
    }
}

/// A block's parameters and optimizer state.
#[derive(Clone, Debug)]
struct BlockData {
    params: Vec<f32>,
    state: OptimizerState,
}

impl BlockData {
    /// Make this a copy of `other`, reusing this one's buffers.
    fn copy_from(&mut self, other: &BlockData) {
        self.params.clone_from(&other.params);
        self.state.step = other.state.step;
        self.state.slots.clone_from(&other.state.slots);
    }
}

/// Block buffers that no snapshot needs any more, kept for the store's
/// next copies (see [`StoreSnapshot`]).
type Spares = Arc<Mutex<Vec<BlockData>>>;

/// A consistent copy of everything a checkpoint records of a
/// [`ParamStore`], taken by [`ParamStore::snapshot`] under the store's lock
/// and written with no lock held, so pushes go on while a checkpoint is
/// written.
///
/// Taking one is cheap (no parameter is copied): the snapshot shares each
/// block's values with the store, copy-on-write. The store copies a block
/// when it updates one that a live snapshot still shares, so while a
/// snapshot lives the store's memory grows by the blocks updated meanwhile
/// (each block's parameters and optimizer state once): at most one more
/// copy of the shard, when every block is updated during the write.
///
/// Dropping the snapshot hands the old values of those blocks back to the
/// store as spare buffers, which its next copies reuse (those still held by
/// a [`SharedValues`] handle, e.g. a reply not yet acknowledged, are freed
/// by their last holder instead). Why: a copy into
/// fresh memory pays its page faults too, 4x the time of a copy into a
/// reused buffer on the development VM, and more beside a checkpoint
/// writing to the page cache (BENCHMARKS.md, "Pushes during a
/// checkpoint"). So the memory a checkpoint's copies took stays with the
/// store until the next checkpoint reuses it; the peak is the same.
#[derive(Clone)]
pub struct StoreSnapshot {
    server: u32,
    fingerprint: u64,
    optimizer: String,
    state_slots: usize,
    step: u64,
    pushes: u64,
    /// Sync: the barrier's members (sorted).
    members: Vec<String>,
    blocks: Vec<(BlockId, Arc<BlockData>)>,
    /// The sparse tables' rows (copy-on-write, like the blocks).
    tables: Vec<TableSnapshot>,
    /// Sorted by trainer, so the same state always gives the same bytes.
    last_seqs: Vec<(String, u64)>,
    /// The origins applied (see [`crate::origin`]).
    origins: AppliedOrigins,
    /// Pushes in parts half taken, with the parts that came (a catch-up
    /// snapshot's only; sorted by trainer).
    half_pushes: Vec<(String, Vec<bool>)>,
    /// Where the blocks only this snapshot holds go when it is dropped.
    spares: Spares,
}

impl Drop for StoreSnapshot {
    fn drop(&mut self) {
        // The blocks the store has replaced since: this is their last holder.
        let mut old: Vec<BlockData> =
            self.blocks.drain(..).filter_map(|(_, data)| Arc::try_unwrap(data).ok()).collect();
        if !old.is_empty() {
            self.spares.lock().unwrap_or_else(PoisonError::into_inner).append(&mut old);
        }
    }
}

impl StoreSnapshot {
    /// The store's shard index.
    pub fn server(&self) -> u32 {
        self.server
    }

    /// Fingerprint of the store's placement.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The name of the store's optimizer.
    pub fn optimizer(&self) -> &str {
        &self.optimizer
    }

    /// The optimizer's state slots per element.
    pub fn state_slots(&self) -> usize {
        self.state_slots
    }

    /// The store's step when the snapshot was taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The pushes the store had applied when the snapshot was taken
    /// ([`ParamStore::pushes`]).
    pub fn pushes(&self) -> u64 {
        self.pushes
    }

    /// Sync: the trainers the barrier waited for when the snapshot was
    /// taken (sorted). A replica made from the snapshot counts them too, so
    /// that, once primary, it does not complete a step without them.
    /// (Checkpoints do not keep them: trainers rejoin a restored shard.)
    pub fn members(&self) -> &[String] {
        &self.members
    }

    /// Every held block with its parameters and optimizer state, in
    /// [`BlockId`] order, as they were when the snapshot was taken.
    pub fn blocks(&self) -> impl ExactSizeIterator<Item = (BlockId, &[f32], &OptimizerState)> + '_ {
        self.blocks.iter().map(|(id, d)| (*id, d.params.as_slice(), &d.state))
    }

    /// As [`blocks`](Self::blocks), each block's parameters and optimizer
    /// slots as handles that share them with the snapshot and outlive it:
    /// for a reply made of views of the values instead of a copy. (While a
    /// handle lives, the store's next update of that block copies it, as
    /// for a live snapshot.)
    pub fn shared_blocks(&self) -> impl ExactSizeIterator<Item = (BlockId, SharedValues, SharedValues)> + '_ {
        self.blocks.iter().map(|(id, d)| {
            (
                *id,
                SharedValues { data: d.clone(), slots: false },
                SharedValues { data: d.clone(), slots: true },
            )
        })
    }

    /// The last accepted seq of every trainer seen, sorted by trainer.
    pub fn last_seqs(&self) -> impl ExactSizeIterator<Item = (&str, u64)> + '_ {
        self.last_seqs.iter().map(|(t, s)| (t.as_str(), *s))
    }

    /// The origins applied, as the parameters hold them.
    pub fn origins(&self) -> &AppliedOrigins {
        &self.origins
    }

    /// The pushes in parts half taken when the snapshot was taken, each
    /// with which of the store's units (blocks, then the rows) came: empty
    /// but for a [`ParamStore::catch_up_snapshot`]. Each is its trainer's
    /// last seq in [`last_seqs`](Self::last_seqs).
    pub fn half_pushes(&self) -> &[(String, Vec<bool>)] {
        &self.half_pushes
    }

    /// The sparse tables' rows and statistics, in [`Placement::tables`] order.
    pub fn tables(&self) -> &[TableSnapshot] {
        &self.tables
    }
}

impl std::fmt::Debug for StoreSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreSnapshot")
            .field("server", &self.server)
            .field("optimizer", &self.optimizer)
            .field("step", &self.step)
            .field("blocks", &self.blocks.len())
            .field("trainers", &self.last_seqs.len())
            .finish()
    }
}

/// The blocks of one shard and the logic that updates them.
///
/// In [`Mode::Sync`] the store keeps a membership (trainers that must push for
/// a step before it is applied). A trainer becomes a member by [`join`](Self::join)
/// or by pushing, and stops by [`leave`](Self::leave) (the shell calls it when
/// the trainer's lease is gone). The barrier is kept block by block: once
/// every member has pushed a block for the step, that block's gradients are
/// combined as `sum_k w_k g_k / sum_k w_k`, summed in trainer-id (byte
/// string) order so the result does not depend on arrival order, applied
/// once, and dropped. The step is complete when every block is updated.
/// So a push that comes in parts is applied part by part, and the store
/// holds only the parts some member is still missing, never a whole push
/// per trainer.
///
/// While a step is underway (some blocks updated, not all) its membership
/// is fixed: a trainer that joins then is a member from the next step on,
/// and its push for the current step is refused ([`Error::StepUnderway`]),
/// so every block of a step combines the same trainers. A member that
/// leaves mid-step keeps the parts it pushed; the blocks it did not push
/// combine the others'.
///
/// Each shard keeps its own barrier: a trainer pushes to every shard, so
/// every shard takes the same pushes, but a trainer that joins while
/// another is pushing may count from step s on one shard and from s + 1 on
/// another (it joined one before that push's step completed and the other
/// after). Shards' step numbers can so differ by one per such join; what
/// they agree on is the pushes ([`pushes`](Self::pushes)).
///
/// In [`Mode::Async`] every push (or part) is applied on arrival; membership
/// is kept only for information.
pub struct ParamStore {
    server: u32,
    /// How many shards the job has (to check a row belongs to this one).
    shards: u32,
    mode: Mode,
    optimizer: Box<dyn Optimizer>,
    fingerprint: u64,
    /// In `BlockId` order.
    held: Vec<Held>,
    /// Blocks of `held` whose values are still to be restored (see
    /// [`ParamStore::new_to_restore`]).
    unrestored: usize,
    /// This shard's rows of each sparse table, in [`Placement::tables`] order.
    tables: Vec<SparseTable>,
    step: u64,
    /// Pushes applied over the store's life (see [`ParamStore::pushes`]).
    pushes: u64,
    members: BTreeSet<String>,
    /// Sync: trainers that joined while the step was underway; members from the next one.
    joining: BTreeSet<String>,
    /// Sync: per held block, the gradients (weight, values) for the current
    /// step by trainer (sorted), until the block is updated.
    pending: Vec<BTreeMap<String, (f32, Grad)>>,
    /// Sync, with tables: the row gradients (weight, rows) for the current
    /// step by trainer, until the rows are updated. The rows count as one
    /// more unit of the barrier after the blocks (see [`Push`]).
    pending_rows: BTreeMap<String, (f32, Vec<RowGrads>)>,
    /// Sync: per unit (held block, then the rows if the shard has tables),
    /// whether it is updated for the current step.
    updated: Vec<bool>,
    /// Sync: how many blocks are updated for the current step.
    updated_count: usize,
    /// Sync: the seq of each trainer's push for the current step.
    step_seqs: HashMap<String, u64>,
    /// Sync: each trainer's last seq before its push for the current step
    /// (`None`: it had none), so a snapshot's dedup table stops at the last
    /// completed step, as its parameters do.
    step_prev_seqs: HashMap<String, Option<u64>>,
    /// Last accepted seq per trainer.
    last_seq: HashMap<String, u64>,
    /// The origins applied (see [`crate::origin`]).
    origins: AppliedOrigins,
    /// Sync: the origins of the pushes taken for the current step, with
    /// their units; applied (and recorded) when the step completes.
    step_origins: Vec<(Origin, Vec<usize>)>,
    /// The units (blocks, then rows) taken so far of a trainer's last push,
    /// while some are missing.
    partial: HashMap<String, Vec<bool>>,
    /// One block's combined gradient (sync), kept between steps.
    scratch: Vec<f32>,
    /// Buffers for copies of blocks that snapshots share.
    spares: Spares,
    /// Sync, on a primary with followers: the combined gradients of the
    /// step underway and of the steps completed but not yet taken.
    recording: Option<Recording>,
}

/// A sync step as a primary forwards it to its followers: replication
/// after aggregation, each block's combined gradient, applied once.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletedStep {
    /// The step it completed (the store's step before it).
    pub step: u64,
    /// Each updated block's combined gradient, in block order. A step
    /// completed by its last members leaving may leave blocks out.
    pub grads: Vec<(BlockId, Vec<f32>)>,
    /// The combined row gradients, per table that had any (ids sorted),
    /// applied in that order.
    pub rows: Vec<RowGrads>,
    /// The (trainer, seq) of every push it took, sorted: a follower
    /// records them, so a push retried on it once it is primary is a
    /// duplicate there too.
    pub seqs: Vec<(String, u64)>,
    /// The origins of the pushes it took, with their units (held block
    /// indices, then the rows): a follower records them too.
    pub origins: Vec<(Origin, Vec<u32>)>,
}

#[derive(Debug, Default)]
struct Recording {
    current: Vec<(usize, Vec<f32>)>,
    current_rows: Vec<RowGrads>,
    completed: Vec<CompletedStep>,
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamStore")
            .field("server", &self.server)
            .field("mode", &self.mode)
            .field("optimizer", &self.optimizer.name())
            .field("blocks", &self.held.len())
            .field("step", &self.step)
            .field("members", &self.members)
            .field("joining", &self.joining)
            .field("updated_blocks", &self.updated_count)
            .finish()
    }
}

impl ParamStore {
    /// The store for shard `server`: holds `placement.blocks_on(server)`,
    /// initialised with [`init_values`] for `seed`, fresh optimizer state, step 0.
    /// The values are computed on the calling thread (a normal initialiser
    /// takes ~34–47 ns a float); the pserver service builds its stores with
    /// [`new_to_restore`](Self::new_to_restore) and computes them on every
    /// core instead.
    pub fn new(
        placement: &Placement,
        server: u32,
        seed: u64,
        optimizer: Box<dyn Optimizer>,
        mode: Mode,
    ) -> Result<Self> {
        Self::build(placement, server, seed, true, optimizer, mode)
    }

    /// [`new`](Self::new) for a replica that restores every block before it
    /// serves (a catch-up from a snapshot): the blocks hold no values until
    /// [`restore_block`](Self::restore_block) gives them theirs. Neither
    /// initial values nor zeros are made, since both would only be
    /// overwritten: for a 10M-float shard with Adam that was 120 MB
    /// written, and faulted in, for nothing. Until every block is restored
    /// ([`unrestored`](Self::unrestored) is 0), a push or step naming an
    /// unrestored block, [`block`](Self::block) of one and
    /// [`snapshot`](Self::snapshot) are refused with
    /// [`Error::BlockNotRestored`]; [`blocks`](Self::blocks) shows an
    /// unrestored block with no values. A checkpoint may be loaded into it
    /// ([`crate::checkpoint::load_file`]): that restores every block.
    /// `seed` still gives the initial values of the sparse tables' rows not
    /// created yet.
    pub fn new_to_restore(
        placement: &Placement,
        server: u32,
        seed: u64,
        optimizer: Box<dyn Optimizer>,
        mode: Mode,
    ) -> Result<Self> {
        Self::build(placement, server, seed, false, optimizer, mode)
    }

    fn build(
        placement: &Placement,
        server: u32,
        seed: u64,
        init: bool,
        optimizer: Box<dyn Optimizer>,
        mode: Mode,
    ) -> Result<Self> {
        if server >= placement.servers() {
            return Err(Error::ServerOutOfRange { server, servers: placement.servers() });
        }
        let specs = placement.specs();
        let held: Vec<Held> = placement
            .blocks_on(server)
            .map(|b| {
                if !init {
                    let empty = BlockData {
                        params: Vec::new(),
                        state: OptimizerState { step: 0, slots: Vec::new() },
                    };
                    return Held { id: b.id, len: b.len, data: Arc::new(empty) };
                }
                let (params, state) = initial_block(specs, b, seed, optimizer.as_ref());
                Held { id: b.id, len: b.len, data: Arc::new(BlockData { params, state }) }
            })
            .collect();
        let tables = placement
            .tables()
            .iter()
            .map(|spec| SparseTable::new(spec.clone(), seed, optimizer.state_slots()))
            .collect::<Result<Vec<_>>>()?;
        let blocks = held.len();
        let unrestored = held.iter().filter(|h| !h.restored()).count();
        let units = blocks + usize::from(!tables.is_empty());
        Ok(Self {
            server,
            shards: placement.servers(),
            mode,
            optimizer,
            fingerprint: placement.fingerprint(),
            held,
            unrestored,
            tables,
            step: 0,
            pushes: 0,
            members: BTreeSet::new(),
            joining: BTreeSet::new(),
            pending: (0..blocks).map(|_| BTreeMap::new()).collect(),
            pending_rows: BTreeMap::new(),
            updated: vec![false; units],
            updated_count: 0,
            step_seqs: HashMap::new(),
            step_prev_seqs: HashMap::new(),
            last_seq: HashMap::new(),
            origins: AppliedOrigins::default(),
            step_origins: Vec::new(),
            partial: HashMap::new(),
            scratch: Vec::new(),
            spares: Spares::default(),
            recording: None,
        })
    }

    /// Sync or async.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// This store's shard index.
    pub fn server(&self) -> u32 {
        self.server
    }

    /// Fingerprint of the placement the store was built from.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The optimizer in use.
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// Number of updates applied (sync: completed steps; async: whole pushes applied).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Number of trainer pushes the store took, over its whole life (across
    /// restores and replicas): async, the same as [`step`](Self::step);
    /// sync, each completed step counts every push it combined. A push of
    /// examples applied before ([`PushOutcome::AppliedBefore`]) counts,
    /// though it changes no parameter. What an exact "every acknowledged
    /// push taken once" count compares with the pushes the trainers saw
    /// acknowledged.
    pub fn pushes(&self) -> u64 {
        self.pushes
    }

    /// Set the pushes applied (from a checkpoint or a snapshot).
    pub fn set_pushes(&mut self, pushes: u64) {
        self.pushes = pushes;
    }

    /// Some trainer's push has come in part (some of its parts taken, not
    /// all): a graceful stop waits for it to complete, since a checkpoint
    /// taken now would hold half of it.
    pub fn push_in_parts_underway(&self) -> bool {
        !self.partial.is_empty()
    }

    /// Whether `trainer`'s push `seq` is one taken already (whole): a retry,
    /// answered [`PushOutcome::Duplicate`].
    pub fn is_retry(&self, trainer: &str, seq: u64) -> bool {
        let last = self.last_seq.get(trainer).copied();
        last.is_some_and(|last| seq < last) || (last == Some(seq) && !self.partial.contains_key(trainer))
    }

    /// Whether a part of `trainer`'s push `seq` continues a push in parts
    /// that is half taken (its last push, some of its parts taken, not
    /// all), rather than starting a new one (or being a retry of a whole
    /// one).
    pub fn continues_push_in_parts(&self, trainer: &str, seq: u64) -> bool {
        self.last_seq.get(trainer) == Some(&seq) && self.partial.contains_key(trainer)
    }

    /// Sync: some blocks are updated for the current step and some are not,
    /// so the parameters mix two steps. A checkpoint waits for this to end
    /// (a restart from a mixed state would apply those blocks' step twice).
    pub fn step_underway(&self) -> bool {
        self.updated_count > 0
    }

    /// What a checkpoint records of the store now: its identity, step,
    /// blocks with their optimizer state, and the last seq of every
    /// trainer. Cheap: see [`StoreSnapshot`] for how the blocks are shared
    /// and what that costs in memory.
    ///
    /// [`Error::CheckpointStepUnderway`] while a sync step is underway (its
    /// parameters mix two steps) or a push in parts is half taken (the
    /// dedup table would call it whole after a restore, and its other
    /// parts would never be applied): the caller waits for it to end. A
    /// trainer that leaves drops its half-taken push, so a dead trainer
    /// cannot hold checkpoints back.
    pub fn snapshot(&self) -> Result<StoreSnapshot> {
        self.snapshot_with(false)
    }

    /// A snapshot for a follower's catch-up: as [`snapshot`](Self::snapshot),
    /// but an async push in parts half taken does not stop it; the snapshot
    /// says which of its parts came ([`StoreSnapshot::half_pushes`]), so a
    /// replica made from it takes the other parts as the primary does.
    /// (Waiting instead could last for ever: a trainer sends a push's later
    /// parts once its first ones are answered, and an answer waits until
    /// every follower holds the part, the one catching up too.) In sync
    /// mode it is [`snapshot`](Self::snapshot): a step underway or a push
    /// half taken refuses it, and ends, since a sync push's parts are
    /// answered before the step is replicated.
    pub fn catch_up_snapshot(&self) -> Result<StoreSnapshot> {
        self.snapshot_with(true)
    }

    fn snapshot_with(&self, half_pushes: bool) -> Result<StoreSnapshot> {
        // The count first: looking costs a pass over the blocks.
        let unrestored = (self.unrestored > 0).then(|| self.held.iter().find(|h| !h.restored())).flatten();
        if let Some(h) = unrestored {
            return Err(Error::BlockNotRestored { block: h.id, server: self.server });
        }
        // Sync pushes wait in their step, so a half-taken one is not in
        // the parameters: only an async one can be carried.
        let half_pushes = half_pushes && self.mode == Mode::Async;
        if self.step_underway() || (!half_pushes && self.push_in_parts_underway()) {
            return Err(Error::CheckpointStepUnderway { step: self.step });
        }
        let mut half: Vec<(String, Vec<bool>)> = match half_pushes {
            true => self.partial.iter().map(|(t, taken)| (t.clone(), taken.clone())).collect(),
            false => Vec::new(),
        };
        half.sort_unstable();
        // Pushes buffered for the current sync step (no block updated yet)
        // are not in the parameters: nor in the dedup table, or a replica
        // or restore from this snapshot would call their retries duplicates.
        let mut last_seqs: Vec<(String, u64)> = self
            .last_seq
            .iter()
            .filter_map(|(t, &s)| match self.step_prev_seqs.get(t) {
                None => Some((t.clone(), s)),
                Some(prev) => prev.map(|p| (t.clone(), p)),
            })
            .collect();
        last_seqs.sort_unstable();
        Ok(StoreSnapshot {
            server: self.server,
            fingerprint: self.fingerprint,
            optimizer: self.optimizer.name().to_string(),
            state_slots: self.optimizer.state_slots(),
            step: self.step,
            pushes: self.pushes,
            members: self.members(),
            blocks: self.held.iter().map(|h| (h.id, h.data.clone())).collect(),
            tables: self.tables.iter().map(SparseTable::snapshot).collect(),
            last_seqs,
            origins: self.origins.clone(),
            half_pushes: half,
            spares: self.spares.clone(),
        })
    }

    /// Make `trainer` a member, from the current step on or, if that step
    /// is underway, from the next one (sync). Returns the first step it
    /// counts in. No-op for a member.
    pub fn join(&mut self, trainer: &str) -> u64 {
        if self.members.contains(trainer) {
            return self.step;
        }
        if self.mode == Mode::Sync && self.step_underway() {
            self.joining.insert(trainer.to_string());
            return self.step + 1;
        }
        self.members.insert(trainer.to_string());
        self.step
    }

    /// Drop `trainer`'s membership. The gradients it already pushed for the
    /// current step stay in the barrier. Sync: blocks every remaining member
    /// has pushed are updated now, and if that completes the step (every
    /// block updated, or no member left and something was pushed) the new
    /// step is returned.
    pub fn leave(&mut self, trainer: &str) -> Option<u64> {
        self.members.remove(trainer);
        self.joining.remove(trainer);
        // A push it left half taken will not be completed: forget which
        // parts came, so that checkpoints need not wait for it.
        self.partial.remove(trainer);
        if self.mode == Mode::Sync && self.settle(0..self.units()) {
            Some(self.step)
        } else {
            None
        }
    }

    /// Sync: whether `trainer`'s push `seq` waits in the current step (taken,
    /// the step not complete yet).
    pub fn waits_in_step(&self, trainer: &str, seq: u64) -> bool {
        self.step_seqs.get(trainer) == Some(&seq)
    }

    /// Sync: whether a push's part of the blocks `blocks` (with the rows,
    /// if it is the first part: see [`Push`]) has left step `step`: the
    /// step is complete, or each of its units is updated in it (every
    /// member pushed it), so they hold the next step's parameters. A part
    /// is answered then, not when the whole step is: a trainer keeps only
    /// a few parts in flight, and each needs only the other members' parts
    /// of the same blocks.
    pub fn updated_in_step(&self, step: u64, blocks: &[BlockId]) -> bool {
        if self.step != step {
            return self.step > step;
        }
        // The first part (the one with the rows) starts at the first block.
        let first = self.held.is_empty() || blocks.first().and_then(|&id| self.index(id)) == Some(0);
        let rows_updated = self.tables.is_empty() || !first || self.updated[self.held.len()];
        rows_updated && blocks.iter().all(|&id| self.index(id).is_some_and(|i| self.updated[i]))
    }

    /// Current members, sorted (not those joining from the next step).
    pub fn members(&self) -> Vec<String> {
        self.members.iter().cloned().collect()
    }

    /// Sync: members that have not pushed every block of the current step, sorted.
    pub fn waiting_for(&self) -> Vec<String> {
        self.members.iter().filter(|m| self.is_missing(m)).cloned().collect()
    }

    /// Take one push (or part of one). Order of checks: duplicate (`seq <`
    /// last accepted, or the last one's blocks all taken:
    /// [`PushOutcome::Duplicate`], even for a stale step, so a retried push
    /// whose answer was lost is still acknowledged); then the weight and the
    /// gradients (blocks of this server, at least one, each once, restored
    /// in a store made to be restored, right length, all finite, none
    /// already taken under this seq); then, in sync
    /// mode, the step, a second push for the same step, and a newcomer
    /// while the step is underway. Any error leaves the store unchanged.
    pub fn push(&mut self, push: Push) -> Result<PushOutcome> {
        let Push { trainer, seq, step, weight, grads, rows, origin } = push;
        if self.is_retry(&trainer, seq) {
            return Ok(PushOutcome::Duplicate);
        }
        let last = self.last_seq.get(&trainer).copied();
        let continues = last == Some(seq);
        let grads = self.check_grads(&trainer, weight, grads)?;
        let rows = self.check_rows(&trainer, &grads, rows)?;
        let rows_unit = self.held.len();
        let units: Vec<usize> =
            grads.iter().map(|(i, _)| *i).chain(rows.as_ref().map(|_| rows_unit)).collect();
        if continues {
            let taken = &self.partial[&trainer];
            let again = units.iter().filter(|&&i| taken[i]).count();
            if again == units.len() {
                return Ok(PushOutcome::Duplicate);
            }
            if again > 0 {
                return Err(Error::PartOverlap { trainer, seq });
            }
        }
        let seen = match &origin {
            Some(o) => self.origin_seen(o, &units)?,
            None => Seen::New,
        };
        match self.mode {
            Mode::Async if seen == Seen::Applied => {
                // Applied already, under another trainer or seq: take it
                // (so its retries are duplicates too) and count it as a push
                // taken, but change no parameter. Forwarded to followers like
                // any push taken.
                if self.take(&trainer, seq, units.into_iter()) {
                    self.step += 1;
                    self.pushes += 1;
                }
                Ok(PushOutcome::AppliedBefore)
            }
            Mode::Async => {
                let mut scratch = Vec::new();
                for (i, g) in &grads {
                    let d = Self::block_mut(&mut self.held, &self.spares, *i);
                    self.optimizer.apply(&mut d.params, g.floats(&mut scratch), &mut d.state);
                }
                for r in rows.iter().flatten() {
                    let table = &mut self.tables[r.table as usize];
                    table.apply(&r.ids, r.grads.floats(&mut scratch), self.step, self.optimizer.as_ref());
                }
                self.join(&trainer);
                if let Some(o) = &origin {
                    let n = self.units();
                    self.origins.record(o, units.iter().copied(), n);
                }
                if self.take(&trainer, seq, units.into_iter()) {
                    self.step += 1;
                    self.pushes += 1;
                }
                Ok(PushOutcome::Applied { step: self.step })
            }
            Mode::Sync => {
                if step < self.step {
                    return Err(Error::StaleStep { trainer, got: step, current: self.step });
                }
                if step > self.step {
                    return Err(Error::FutureStep { trainer, got: step, current: self.step });
                }
                if let Some(&buffered_seq) = self.step_seqs.get(&trainer).filter(|&&s| s != seq) {
                    return Err(Error::AlreadyBuffered { step, seq, buffered_seq, trainer });
                }
                let newcomer = !self.members.contains(&trainer);
                if (newcomer && self.step_underway()) || units.iter().any(|&i| self.updated[i]) {
                    return Err(Error::StepUnderway { trainer, step });
                }
                self.join(&trainer);
                self.step_prev_seqs.entry(trainer.clone()).or_insert(last);
                self.step_seqs.insert(trainer.clone(), seq);
                self.take(&trainer, seq, units.iter().copied());
                // A push of examples applied already still takes its place
                // in the barrier (the others wait for it), with no weight.
                let weight = match (seen, origin) {
                    (Seen::Applied, _) => 0.0,
                    (Seen::New, Some(o)) => {
                        self.step_origins.push((o, units.clone()));
                        weight
                    }
                    (_, None) => weight,
                };
                for (i, g) in grads {
                    let g = if weight == 0.0 { Grad::Floats(vec![0.0; g.len()]) } else { g };
                    self.pending[i].insert(trainer.clone(), (weight, g));
                }
                if let Some(rows) = rows {
                    let rows = if weight == 0.0 { Vec::new() } else { rows };
                    self.pending_rows.insert(trainer.clone(), (weight, rows));
                }
                if self.settle(units) {
                    Ok(PushOutcome::Applied { step: self.step })
                } else {
                    Ok(PushOutcome::Buffered { step: self.step, waiting_for: self.waiting_for_count() })
                }
            }
        }
    }

    /// Sync, on a primary with followers: keep each completed step's
    /// combined gradients ([`take_completed_steps`](Self::take_completed_steps)),
    /// so that the followers apply the step the primary applied, not each
    /// trainer's push. Costs one copy of a shard's gradient while a step is
    /// underway.
    pub fn record_steps(&mut self) {
        self.recording.get_or_insert_with(Recording::default);
    }

    /// Stop keeping completed steps (the shard has no follower left).
    pub fn stop_recording_steps(&mut self) {
        self.recording = None;
    }

    /// The steps completed since the last call, in order (empty unless
    /// [`record_steps`](Self::record_steps) was called).
    pub fn take_completed_steps(&mut self) -> Vec<CompletedStep> {
        self.recording.as_mut().map(|r| std::mem::take(&mut r.completed)).unwrap_or_default()
    }

    /// Sync, on a follower: apply a step its primary completed, block by
    /// block, and move to the next step. The step must be the store's, no
    /// step may be underway, and every gradient must be for a held block
    /// (restored, in a store made to be restored), once, of the right length
    /// and finite; else nothing changes. Its rows may number more than
    /// [`MAX_ROWS_PER_CALL`] per table (the members' pushes combined).
    pub fn apply_step(&mut self, completed: CompletedStep) -> Result<()> {
        let CompletedStep { step, grads, seqs, rows, origins } = completed;
        if self.mode != Mode::Sync {
            return Err(Error::Replication(format!("step {step}: an async store takes pushes, not steps")));
        }
        if step != self.step || self.step_underway() {
            return Err(Error::Replication(format!(
                "step {step} does not follow this replica's step {} (underway: {})",
                self.step,
                self.step_underway()
            )));
        }
        let grads: Vec<(BlockId, Grad)> = grads.into_iter().map(|(id, g)| (id, Grad::Floats(g))).collect();
        // A step of pushes all applied before updates nothing.
        let grads = if grads.is_empty() { Vec::new() } else { self.check_grads("the primary", 1.0, grads)? };
        // A step combines its members' rows: within the per-call limit
        // only push by push.
        self.check_row_grads("the primary", &rows, Rows::Step)?;
        let mut scratch = Vec::new();
        for (i, g) in &grads {
            let d = Self::block_mut(&mut self.held, &self.spares, *i);
            self.optimizer.apply(&mut d.params, g.floats(&mut scratch), &mut d.state);
        }
        for r in &rows {
            let table = &mut self.tables[r.table as usize];
            table.apply(&r.ids, r.grads.floats(&mut scratch), self.step, self.optimizer.as_ref());
        }
        self.pushes += seqs.len() as u64;
        for (trainer, seq) in seqs {
            self.restore_last_seq(&trainer, seq);
        }
        let n = self.units();
        for (o, units) in origins {
            self.origins.record(&o, units.into_iter().map(|u| u as usize), n);
        }
        self.step += 1;
        Ok(())
    }

    /// The parameters of a held block.
    pub fn block(&self, id: BlockId) -> Result<&[f32]> {
        let server = self.server;
        let held = self.index(id).map(|i| &self.held[i]).ok_or(Error::BlockNotHeld { block: id, server })?;
        match held.restored() {
            true => Ok(held.data.params.as_slice()),
            false => Err(Error::BlockNotRestored { block: id, server }),
        }
    }

    /// A held block's length (its values, restored or not).
    pub fn block_len(&self, id: BlockId) -> Result<usize> {
        self.index(id).map(|i| self.held[i].len).ok_or(Error::BlockNotHeld { block: id, server: self.server })
    }

    /// How many blocks of a store made by [`new_to_restore`](Self::new_to_restore)
    /// are still without their values (0 for any other store).
    pub fn unrestored(&self) -> usize {
        self.unrestored
    }

    /// The held blocks, in [`BlockId`] order.
    pub fn block_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.held.iter().map(|h| h.id)
    }

    /// Every held block with its parameters and optimizer state (for
    /// checkpoints); a block still to be restored has neither.
    pub fn blocks(&self) -> impl Iterator<Item = (BlockId, &[f32], &OptimizerState)> + '_ {
        self.held.iter().map(|h| (h.id, h.data.params.as_slice(), &h.data.state))
    }

    /// Replace a held block's parameters and optimizer state (from a
    /// checkpoint, a catch-up's snapshot part, or initial values computed
    /// elsewhere). Checks the block is held and the lengths (`len`
    /// parameters, `state_slots() * len` slots). The values are taken as
    /// they come, NaN and infinities included: a store holds what its
    /// optimizer computed, a diverged model too, and a restore must give
    /// back exactly that (a checkpoint's checksum and the transport vouch
    /// for the bytes).
    pub fn restore_block(&mut self, id: BlockId, params: Vec<f32>, state: OptimizerState) -> Result<()> {
        let server = self.server;
        let i = self.index(id).ok_or(Error::BlockNotHeld { block: id, server })?;
        let len = self.held[i].len;
        let slots = self.optimizer.state_slots().saturating_mul(len);
        for (what, values, expected) in
            [("parameters", &params, len), ("optimizer slots", &state.slots, slots)]
        {
            if values.len() != expected {
                return Err(Error::RestoreLength { block: id, what, expected, got: values.len() });
            }
        }
        self.unrestored -= usize::from(!self.held[i].restored());
        self.held[i].data = Arc::new(BlockData { params, state });
        Ok(())
    }

    /// Set the step (from a checkpoint). Drops what was gathered for the
    /// old step, since it was computed against other parameters.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
        self.pending.iter_mut().for_each(BTreeMap::clear);
        self.pending_rows.clear();
        self.updated.iter_mut().for_each(|u| *u = false);
        self.updated_count = 0;
        self.step_seqs.clear();
        self.step_prev_seqs.clear();
        self.step_origins.clear();
        self.members.append(&mut self.joining);
        if let Some(r) = &mut self.recording {
            r.current.clear();
            r.current_rows.clear();
        }
    }

    /// The origins applied (see [`crate::origin`]).
    pub fn origins(&self) -> &AppliedOrigins {
        &self.origins
    }

    /// Take in the origins a checkpoint or a primary's snapshot applied
    /// (with the parameters restored from it).
    pub fn restore_origins(&mut self, origins: &AppliedOrigins) {
        self.origins.merge(origins);
    }

    /// Whether the examples of a push from `origin` with `units` are applied
    /// already: in the store, or (sync) in a push taken for this step.
    fn origin_seen(&self, origin: &Origin, units: &[usize]) -> Result<Seen> {
        if self.origins.check(origin, units)? == Seen::Applied {
            return Ok(Seen::Applied);
        }
        for (taken, taken_units) in &self.step_origins {
            if taken.task != origin.task || taken.end <= origin.start || origin.end <= taken.start {
                continue;
            }
            let (task, start, end) = (origin.task, origin.start, origin.end);
            if (taken.start, taken.end) != (start, end) {
                let (applied_start, applied_end) = (taken.start, taken.end);
                return Err(Error::OriginOverlap { task, start, end, applied_start, applied_end });
            }
            let again = units.iter().filter(|u| taken_units.contains(u)).count();
            if again == units.len() {
                return Ok(Seen::Applied);
            }
            if again > 0 {
                return Err(Error::OriginPartOverlap { task, start, end });
            }
        }
        Ok(Seen::New)
    }

    /// The last accepted seq of every trainer seen (for checkpoints, so
    /// retries stay deduplicated across a restart).
    pub fn last_seqs(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.last_seq.iter().map(|(t, &s)| (t.as_str(), s))
    }

    /// Restore a trainer's last accepted seq (from a checkpoint). Keeps the
    /// larger of the current and given values. A restored seq counts as
    /// whole: parts of it that had not arrived are dropped as retries (at
    /// most once).
    pub fn restore_last_seq(&mut self, trainer: &str, seq: u64) {
        let e = self.last_seq.entry(trainer.to_string()).or_insert(seq);
        if seq >= *e {
            *e = seq;
            self.partial.remove(trainer);
        }
    }

    /// Restore `trainer`'s push `seq` as half taken, `taken` saying which
    /// units came (from a catch-up snapshot, after its
    /// [`restore_last_seq`](Self::restore_last_seq)): its other parts are
    /// then taken as they come, not dropped as retries. Errors if `seq` is
    /// not the trainer's last seq, or `taken` is not one flag per unit with
    /// some, not all, set.
    pub fn restore_half_push(&mut self, trainer: &str, seq: u64, taken: Vec<bool>) -> Result<()> {
        let whole_or_none = taken.iter().all(|&t| t) || !taken.iter().any(|&t| t);
        if taken.len() != self.units() || whole_or_none {
            return Err(Error::Replication(format!(
                "a half-taken push of {trainer} with {} of {} parts' flags set, for a store of {} units",
                taken.iter().filter(|&&t| t).count(),
                taken.len(),
                self.units()
            )));
        }
        if self.last_seq.get(trainer) != Some(&seq) {
            return Err(Error::Replication(format!(
                "a half-taken push {seq} of {trainer}, whose last seq is {:?}",
                self.last_seq.get(trainer)
            )));
        }
        self.partial.insert(trainer.to_string(), taken);
        Ok(())
    }

    /// Held block `i`'s values, to update. If a snapshot still shares
    /// them they are copied first, into a spare buffer when there is one,
    /// and the snapshot keeps the old ones.
    fn block_mut<'a>(held: &'a mut [Held], spares: &Spares, i: usize) -> &'a mut BlockData {
        let data = &mut held[i].data;
        if Arc::get_mut(data).is_none() {
            let spare = spares.lock().unwrap_or_else(PoisonError::into_inner).pop();
            let copy = match spare {
                Some(mut spare) => {
                    spare.copy_from(data);
                    spare
                }
                None => BlockData::clone(data),
            };
            *data = Arc::new(copy);
        }
        // Not shared now: no copy.
        Arc::make_mut(data)
    }

    fn index(&self, id: BlockId) -> Option<usize> {
        self.held.binary_search_by_key(&id, |h| h.id).ok()
    }

    /// Validate a push's weight and gradients; on success return them with
    /// their held-block indexes, in held-block order.
    fn check_grads(
        &self,
        trainer: &str,
        weight: f32,
        grads: Vec<(BlockId, Grad)>,
    ) -> Result<Vec<(usize, Grad)>> {
        if !(weight.is_finite() && weight > 0.0) {
            return Err(Error::BadWeight { trainer: trainer.to_string(), weight });
        }
        // A shard without blocks (more shards than blocks) takes empty pushes.
        if grads.is_empty() && !self.held.is_empty() {
            return Err(Error::EmptyPush { trainer: trainer.to_string() });
        }
        let mut indexed = Vec::with_capacity(grads.len());
        for (id, g) in grads {
            let Some(i) = self.index(id) else {
                return Err(Error::PushBlockNotHeld {
                    trainer: trainer.to_string(),
                    block: id,
                    server: self.server,
                });
            };
            if !self.held[i].restored() {
                return Err(Error::BlockNotRestored { block: id, server: self.server });
            }
            let expected = self.held[i].len;
            if g.len() != expected || !g.whole() {
                return Err(Error::GradLength {
                    trainer: trainer.to_string(),
                    block: id,
                    expected,
                    got: g.len(),
                });
            }
            if let Some((index, value)) = g.first_non_finite() {
                return Err(Error::NonFiniteGrad { trainer: trainer.to_string(), block: id, index, value });
            }
            indexed.push((i, g));
        }
        indexed.sort_unstable_by_key(|(i, _)| *i);
        if let Some(w) = indexed.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::DuplicateBlock { trainer: trainer.to_string(), block: self.held[w[0].0].id });
        }
        Ok(indexed)
    }

    /// Record `blocks` of `trainer`'s push `seq` as taken; true when that
    /// makes the push whole.
    fn take(&mut self, trainer: &str, seq: u64, blocks: impl ExactSizeIterator<Item = usize>) -> bool {
        let fresh = self.last_seq.insert(trainer.to_string(), seq) != Some(seq);
        let n = self.units();
        if fresh && blocks.len() == n {
            self.partial.remove(trainer);
            return true;
        }
        let taken = self.partial.entry(trainer.to_string()).or_default();
        if fresh {
            taken.clear();
            taken.resize(n, false);
        }
        blocks.for_each(|i| taken[i] = true);
        let whole = taken.iter().all(|&t| t);
        if whole {
            self.partial.remove(trainer);
        }
        whole
    }

    /// Whether member `m` has not pushed some block not yet updated (for a
    /// shard without blocks: has not pushed for the step).
    fn is_missing(&self, m: &str) -> bool {
        if self.units() == 0 {
            return !self.step_seqs.contains_key(m);
        }
        (0..self.units()).any(|i| !self.updated[i] && !self.pushed(i, m))
    }

    /// Sync: whether `m` pushed unit `i` (a block, or the rows) for the step.
    fn pushed(&self, i: usize, m: &str) -> bool {
        match self.pending.get(i) {
            Some(pending) => pending.contains_key(m),
            None => self.pending_rows.contains_key(m),
        }
    }

    /// Units of the sync barrier and of a push: the held blocks, then the
    /// rows if the shard has sparse tables.
    pub(crate) fn units(&self) -> usize {
        self.held.len() + usize::from(!self.tables.is_empty())
    }

    fn waiting_for_count(&self) -> usize {
        self.members.iter().filter(|m| self.is_missing(m)).count()
    }

    /// Sync: update each of `blocks` that every member has pushed; then, if
    /// every block is updated, or no member is left and some block was,
    /// complete the step. True when the step completed.
    fn settle(&mut self, blocks: impl IntoIterator<Item = usize>) -> bool {
        for i in blocks {
            let (empty, all) = match self.pending.get(i) {
                Some(p) => (p.is_empty(), self.members.iter().all(|m| p.contains_key(m))),
                None => (
                    self.pending_rows.is_empty(),
                    self.members.iter().all(|m| self.pending_rows.contains_key(m)),
                ),
            };
            if !self.updated[i] && !empty && all {
                if i < self.held.len() {
                    self.update_block(i);
                } else {
                    self.update_rows(i);
                }
            }
        }
        let units = self.units();
        let complete = if units == 0 {
            !self.step_seqs.is_empty() && !self.members.iter().any(|m| self.is_missing(m))
        } else {
            self.updated_count > 0 && (self.updated_count == units || self.members.is_empty())
        };
        if complete {
            if let Some(r) = &mut self.recording {
                let mut grads: Vec<(usize, Vec<f32>)> = std::mem::take(&mut r.current);
                grads.sort_unstable_by_key(|(i, _)| *i);
                let grads = grads.into_iter().map(|(i, g)| (self.held[i].id, g)).collect();
                let rows = std::mem::take(&mut r.current_rows);
                let mut seqs: Vec<(String, u64)> =
                    self.step_seqs.iter().map(|(t, &s)| (t.clone(), s)).collect();
                seqs.sort_unstable();
                let origins = self
                    .step_origins
                    .iter()
                    .map(|(o, units)| (*o, units.iter().map(|&u| u as u32).collect()))
                    .collect();
                r.completed.push(CompletedStep { step: self.step, grads, seqs, rows, origins });
            }
            let n = self.units();
            for (o, units) in std::mem::take(&mut self.step_origins) {
                self.origins.record(&o, units, n);
            }
            self.step += 1;
            self.pushes += self.step_seqs.len() as u64;
            self.updated.iter_mut().for_each(|u| *u = false);
            self.updated_count = 0;
            self.step_seqs.clear();
            self.step_prev_seqs.clear();
            self.members.append(&mut self.joining);
        }
        complete
    }

    /// Combine block `i`'s gradients (weighted mean, summed in trainer-id
    /// order), apply them once, and drop them.
    fn update_block(&mut self, i: usize) {
        let pushed = std::mem::take(&mut self.pending[i]);
        let mut grads = pushed.values();
        let Some((first_weight, first)) = grads.next() else { return };
        let total = total_weight(pushed.values().map(|(w, _)| *w));
        if total == 0.0 {
            // Every push of it was of examples applied already.
            self.updated[i] = true;
            self.updated_count += 1;
            return;
        }
        let mut decoded = Vec::new();
        let acc = &mut self.scratch;
        acc.clear();
        acc.extend_from_slice(first.floats(&mut decoded));
        let first_share = share(*first_weight, total);
        if first_share != 1.0 {
            scale(acc, first_share);
        }
        for (w, g) in grads {
            axpy(acc, share(*w, total), g.floats(&mut decoded));
        }
        let d = Self::block_mut(&mut self.held, &self.spares, i);
        self.optimizer.apply(&mut d.params, &self.scratch, &mut d.state);
        if let Some(r) = &mut self.recording {
            r.current.push((i, self.scratch.clone()));
        }
        self.updated[i] = true;
        self.updated_count += 1;
    }
}

impl ParamStore {
    /// This shard's rows of each sparse table, in [`Placement::tables`] order.
    pub fn tables(&self) -> &[SparseTable] {
        &self.tables
    }

    /// Row updates this shard's tables hold: the sum of every held row's
    /// optimizer step. Every applied row gradient counts once (a sync step
    /// counts a row once however many trainers pushed it), so with no row
    /// evicted or expired it is the exact count of row updates applied,
    /// before a failover or a move included.
    pub fn row_updates(&self) -> u64 {
        self.tables.iter().map(|t| t.snapshot().records().map(|r| r.step).sum::<u64>()).sum()
    }

    /// Rows this shard's tables hold (rows come to be with their first
    /// update; a pull creates none).
    pub fn rows_held(&self) -> u64 {
        self.tables.iter().map(|t| t.len() as u64).sum()
    }

    /// Table `table`, to restore rows into (from a checkpoint or a snapshot).
    pub fn table_mut(&mut self, table: u32) -> Result<&mut SparseTable> {
        let tables = self.tables.len();
        self.tables.get_mut(table as usize).ok_or(Error::NoSuchTable { table, tables })
    }

    /// The values of rows `ids` of table `table` into `out` (`ids.len() *
    /// dim`, replaced): a row not created yet (or expired) reads as its
    /// initial value. Changes nothing: every change happens on push, so
    /// followers that see only pushes stay identical to their primary.
    ///
    /// Errors: no such table, more ids than [`MAX_ROWS_PER_CALL`], an id of
    /// another shard.
    pub fn pull_rows(&self, table: u32, ids: &[u64], out: &mut Vec<f32>) -> Result<()> {
        let t =
            self.tables.get(table as usize).ok_or(Error::NoSuchTable { table, tables: self.tables.len() })?;
        if ids.len() > MAX_ROWS_PER_CALL {
            return Err(Error::TooManyRows {
                table: t.spec().name.clone(),
                got: ids.len(),
                max: MAX_ROWS_PER_CALL,
            });
        }
        self.check_row_shard("a pull", t, ids)?;
        out.clear();
        out.resize(ids.len() * t.spec().dim, 0.0);
        t.gather(ids, self.step, out);
        Ok(())
    }

    /// Every id of `ids` is one of this shard's rows of `t`.
    fn check_row_shard(&self, who: &str, t: &SparseTable, ids: &[u64]) -> Result<()> {
        let name = &t.spec().name;
        let hashed = crate::hash_str(name);
        if let Some(&id) = ids.iter().find(|&&id| row_shard_hashed(hashed, id, self.shards) != self.server) {
            return Err(Error::RowNotOnShard {
                who: who.to_string(),
                table: name.clone(),
                id,
                shard: self.server,
                owner: row_shard(name, id, self.shards),
            });
        }
        Ok(())
    }

    /// Validate the rows of a push part whose checked blocks are `grads`:
    /// `Some(rows)` if this part is the push's first (it carries the rows
    /// unit, see [`Push`]), `None` otherwise.
    fn check_rows(
        &self,
        trainer: &str,
        grads: &[(usize, Grad)],
        rows: Vec<RowGrads>,
    ) -> Result<Option<Vec<RowGrads>>> {
        if self.tables.is_empty() {
            if let Some(r) = rows.first() {
                return Err(Error::NoSuchTable { table: r.table, tables: 0 });
            }
            return Ok(None);
        }
        let first = self.held.is_empty() || grads.first().is_some_and(|(i, _)| *i == 0);
        if !first {
            if !rows.is_empty() {
                return Err(Error::RowsNotInFirstPart { trainer: trainer.to_string() });
            }
            return Ok(None);
        }
        self.check_row_grads(trainer, &rows, Rows::Push)?;
        Ok(Some(rows))
    }

    /// Row gradients fit their tables: each table once, ids of this shard,
    /// each once, the right length, finite, and a push's within
    /// [`MAX_ROWS_PER_CALL`].
    fn check_row_grads(&self, who: &str, rows: &[RowGrads], kind: Rows) -> Result<()> {
        let mut seen = vec![false; self.tables.len()];
        let mut scratch = Vec::new();
        for r in rows {
            let tables = self.tables.len();
            let t = self.tables.get(r.table as usize).ok_or(Error::NoSuchTable { table: r.table, tables })?;
            if std::mem::replace(&mut seen[r.table as usize], true) {
                return Err(Error::TableTwice { who: who.to_string(), table: t.spec().name.clone() });
            }
            if !r.grads.whole() {
                return Err(Error::RowGradLength {
                    table: t.spec().name.clone(),
                    expected: r.ids.len() * t.spec().dim,
                    got: r.grads.len(),
                });
            }
            self.check_row_shard(who, t, &r.ids)?;
            match kind {
                Rows::Push => t.check(&r.ids, r.grads.floats(&mut scratch))?,
                Rows::Step => t.check_step(&r.ids, r.grads.floats(&mut scratch))?,
            }
        }
        Ok(())
    }

    /// Sync: combine the rows every trainer pushed for the step (weighted
    /// mean over all of them, a trainer that did not touch a row adding
    /// zero to it; summed in trainer-id order), apply them once in id
    /// order, and drop them.
    fn update_rows(&mut self, unit: usize) {
        let pushed = std::mem::take(&mut self.pending_rows);
        let total = total_weight(pushed.values().map(|(w, _)| *w));
        // Per table: each id's position in one flat accumulator.
        let mut combined: Vec<(HashMap<u64, usize>, Vec<f32>)> =
            (0..self.tables.len()).map(|_| Default::default()).collect();
        let mut scratch = Vec::new();
        for (w, rows) in pushed.values() {
            for r in rows {
                let dim = self.tables[r.table as usize].spec().dim;
                let (at, acc) = &mut combined[r.table as usize];
                for (id, g) in r.ids.iter().zip(r.grads.floats(&mut scratch).chunks_exact(dim)) {
                    let row = *at.entry(*id).or_insert_with(|| {
                        acc.resize(acc.len() + dim, 0.0);
                        acc.len() / dim - 1
                    });
                    axpy(&mut acc[row * dim..(row + 1) * dim], share(*w, total), g);
                }
            }
        }
        for (t, (at, acc)) in combined.into_iter().enumerate() {
            if at.is_empty() {
                continue;
            }
            let dim = self.tables[t].spec().dim;
            let mut order: Vec<(u64, usize)> = at.into_iter().collect();
            order.sort_unstable();
            let ids: Vec<u64> = order.iter().map(|&(id, _)| id).collect();
            let mut grads = Vec::with_capacity(acc.len());
            for (_, row) in order {
                grads.extend_from_slice(&acc[row * dim..(row + 1) * dim]);
            }
            self.tables[t].apply(&ids, &grads, self.step, self.optimizer.as_ref());
            if let Some(r) = &mut self.recording {
                r.current_rows.push(RowGrads { table: t as u32, ids, grads: Grad::Floats(grads) });
            }
        }
        self.updated[unit] = true;
        self.updated_count += 1;
    }
}

/// Whose row gradients [`ParamStore::check_row_grads`] checks.
#[derive(Clone, Copy)]
enum Rows {
    /// A trainer's push: at most [`MAX_ROWS_PER_CALL`] ids per table.
    Push,
    /// A sync step a primary completed: its members' pushes combined, up to
    /// their number times the per-call limit.
    Step,
}

/// The sum of a step's push weights, in `f64`: finite whatever the
/// (finite) weights.
fn total_weight(weights: impl Iterator<Item = f32>) -> f64 {
    weights.map(f64::from).sum()
}

/// A push's share of its step's total weight. A step's gradients are each
/// scaled by their share before they are summed: a weighted mean of finite
/// values then stays finite whatever the weights, where scaling by the
/// weight and dividing by the total overflowed at weights near `f32::MAX`.
fn share(weight: f32, total: f64) -> f32 {
    (f64::from(weight) / total) as f32
}

fn scale(a: &mut [f32], w: f32) {
    for x in a {
        *x *= w;
    }
}

/// `a += w * g`.
fn axpy(a: &mut [f32], w: f32, g: &[f32]) {
    for (x, &y) in a.iter_mut().zip(g) {
        *x += w * y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_non_finite_finds_the_first_bad_value_across_runs() {
        let scalar = |v: &[f32]| v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i]));
        for len in [0, 1, 63, 64, 65, 200] {
            let mut v: Vec<f32> = (0..len).map(|i| (i as f32 - 100.0) * 1e30).collect();
            v.iter_mut().step_by(7).for_each(|x| *x = f32::MAX);
            if len > 0 {
                v[len / 2] = -f32::MIN_POSITIVE / 2.0; // subnormal: finite
            }
            assert_eq!(Grad::Floats(v.clone()).first_non_finite(), None, "len {len}");
            for at in [0, 62, 63, 64, 65, 127, 128, 199].into_iter().filter(|&at| at < len) {
                for bad in [f32::INFINITY, f32::NEG_INFINITY] {
                    let mut w = v.clone();
                    w[at] = bad;
                    if at + 3 < len {
                        w[at + 3] = f32::NAN;
                    }
                    let expected = scalar(&w);
                    assert_eq!(expected, Some((at, bad)));
                    assert_eq!(Grad::Floats(w.clone()).first_non_finite(), expected, "len {len} at {at}");
                    let wire = Grad::Wire(wire_bytes(&w));
                    assert_eq!(wire.first_non_finite(), expected, "wire, len {len} at {at}");
                }
                let mut w = v.clone();
                w[at] = f32::NAN;
                let found = Grad::Wire(wire_bytes(&w)).first_non_finite();
                assert!(matches!(found, Some((i, x)) if i == at && x.is_nan()), "{found:?}");
            }
        }
    }
    use crate::optimizer::{Adam, Sgd};

    /// `values` as a push carries them on the wire: little-endian bytes.
    fn wire_bytes(values: &[f32]) -> bytes::Bytes {
        values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into()
    }
    use crate::spec::{Init, ParamBuf, ParamSpec};

    fn specs() -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("w", vec![3, 3], Init::Normal { mean: 0.0, std: 1.0 }),
            ParamSpec::new("b", vec![3], Init::Constant(0.5)),
        ]
    }

    /// A push carrying all of `store`'s blocks, values from `f(block, index)`.
    fn push_for(
        store: &ParamStore,
        trainer: &str,
        seq: u64,
        step: u64,
        weight: f32,
        f: impl Fn(BlockId, usize) -> f32,
    ) -> Push {
        let grads = store
            .blocks()
            .map(|(id, p, _)| (id, Grad::Floats((0..p.len()).map(|i| f(id, i)).collect())))
            .collect();
        Push { trainer: trainer.into(), seq, step, weight, grads, rows: Vec::new(), origin: None }
    }

    fn snapshot(store: &ParamStore) -> Vec<Vec<f32>> {
        store.blocks().map(|(_, p, _)| p.to_vec()).collect()
    }

    #[test]
    fn stores_hold_their_blocks_initialised_like_param_buf() {
        let specs = specs();
        let pl = Placement::new(&specs, 3, 4).unwrap();
        let buf = ParamBuf::init(&specs, 11);
        let mut seen = 0;
        for s in 0..3 {
            let st = ParamStore::new(&pl, s, 11, Box::new(Sgd { lr: 0.1 }), Mode::Async).unwrap();
            assert_eq!(st.server(), s);
            assert_eq!(st.fingerprint(), pl.fingerprint());
            for b in pl.blocks_on(s) {
                let want = &buf.param(b.id.param as usize)[b.offset..b.offset + b.len];
                assert_eq!(st.block(b.id).unwrap(), want);
                seen += 1;
            }
            assert_eq!(st.block_ids().count(), pl.blocks_on(s).count());
        }
        assert_eq!(seen, pl.blocks().len());
        assert!(matches!(
            ParamStore::new(&pl, 3, 11, Box::new(Sgd { lr: 0.1 }), Mode::Async),
            Err(Error::ServerOutOfRange { server: 3, servers: 3 })
        ));
    }

    #[test]
    fn sync_three_trainers_equal_weighted_mean_gradient() {
        let specs = specs();
        let pl = Placement::new(&specs, 1, 5).unwrap();
        let opt = || Box::new(Sgd { lr: 0.3 });
        let mut store = ParamStore::new(&pl, 0, 1, opt(), Mode::Sync).unwrap();
        let mut reference = ParamStore::new(&pl, 0, 1, opt(), Mode::Async).unwrap();
        let weights = [("t-b", 32.0f32), ("t-a", 10.0), ("t-c", 7.0)];
        let grad = |k: usize, step: u64| {
            move |id: BlockId, i: usize| {
                ((k * 31 + i * 7 + id.block as usize * 3 + step as usize) % 11) as f32 * 0.1 - 0.5
            }
        };
        for (t, _) in &weights {
            store.join(t);
        }
        for step in 0..3u64 {
            for (k, (t, w)) in weights.iter().enumerate() {
                let out = store.push(push_for(&store, t, step, step, *w, grad(k, step))).unwrap();
                if k < 2 {
                    assert_eq!(out, PushOutcome::Buffered { step, waiting_for: 2 - k });
                } else {
                    assert_eq!(out, PushOutcome::Applied { step: step + 1 });
                }
            }
            // Reference: the weighted mean gradient, computed in f64, applied directly.
            let wsum: f64 = weights.iter().map(|(_, w)| f64::from(*w)).sum();
            let mean = push_for(&reference, "ref", step, step, 1.0, |id, i| {
                let s: f64 = weights
                    .iter()
                    .enumerate()
                    .map(|(k, (_, w))| f64::from(*w) * f64::from(grad(k, step)(id, i)))
                    .sum();
                (s / wsum) as f32
            });
            reference.push(mean).unwrap();
        }
        assert_eq!(store.step(), 3);
        // Norm-wise relative error (element-wise would blow up near zero).
        let (got, want) = (snapshot(&store).concat(), snapshot(&reference).concat());
        assert_eq!(got.len(), 12);
        let diff: f64 = got.iter().zip(&want).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let norm: f64 = want.iter().map(|y| f64::from(*y).powi(2)).sum();
        let rel = (diff / norm).sqrt();
        assert!(rel < 1e-6, "relative error {rel}: {got:?} vs {want:?}");
        assert_ne!(got, ParamBuf::init(&specs, 1).as_slice(), "parameters moved");
    }

    /// Weights are counts of examples, but any finite positive weight is
    /// taken: two pushes of weight 3e38 (whose sum overflows `f32`) give
    /// the plain mean of their gradients, not infinities.
    #[test]
    fn sync_weights_near_the_largest_float_still_give_the_weighted_mean() {
        let pl = Placement::new(&specs(), 1, 5).unwrap();
        let mut store = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 0.5 }), Mode::Sync).unwrap();
        let before = snapshot(&store).concat();
        store.join("t-a");
        store.join("t-b");
        store.push(push_for(&store, "t-a", 0, 0, 3e38, |_, _| 2.0)).unwrap();
        let out = store.push(push_for(&store, "t-b", 0, 0, 3e38, |_, _| 4.0)).unwrap();
        assert_eq!(out, PushOutcome::Applied { step: 1 });
        let after = snapshot(&store).concat();
        for (b, a) in before.iter().zip(&after) {
            assert!((a - (b - 1.5)).abs() < 1e-5, "lr 0.5 times the mean gradient 3: {b} -> {a}");
        }
    }

    #[test]
    fn async_applies_each_push_and_dedups() {
        let pl = Placement::new(&specs(), 1, 100).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Async).unwrap();
        let before = snapshot(&st);
        let p = push_for(&st, "t", 5, 0, 1.0, |_, _| 1.0);
        assert_eq!(st.push(p.clone()).unwrap(), PushOutcome::Applied { step: 1 });
        assert_eq!(st.push(p.clone()).unwrap(), PushOutcome::Duplicate);
        let mut older = p.clone();
        older.seq = 2;
        assert_eq!(st.push(older).unwrap(), PushOutcome::Duplicate);
        assert_eq!(st.step(), 1);
        let after = snapshot(&st);
        for (a, b) in before.iter().flatten().zip(after.iter().flatten()) {
            assert_eq!(*a - 1.0, *b);
        }
        // Async ignores the step field and the weight's value.
        let mut next = push_for(&st, "t", 6, 99, 5.0, |_, _| 1.0);
        next.grads.reverse();
        assert_eq!(st.push(next).unwrap(), PushOutcome::Applied { step: 2 });
        assert_eq!(st.members(), vec!["t".to_string()]);
        assert_eq!(st.leave("t"), None);
        assert_eq!(st.last_seqs().collect::<Vec<_>>(), vec![("t", 6)]);
    }

    #[test]
    fn every_bad_push_is_rejected_and_harmless() {
        let pl = Placement::new(&specs(), 2, 4).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        st.join("a");
        let good = push_for(&st, "t", 1, 0, 1.0, |_, _| 1.0);
        let held: Vec<BlockId> = st.block_ids().collect();
        let foreign = pl.blocks_on(1).next().unwrap().id;
        let before = snapshot(&st);
        let mut cases: Vec<(Push, &str)> = Vec::new();
        fn floats(g: &mut Grad) -> &mut Vec<f32> {
            match g {
                Grad::Floats(v) => v,
                Grad::Wire(_) => panic!("push_for makes floats"),
            }
        }
        let wire = |g: &Grad| match g {
            Grad::Floats(v) => wire_bytes(v),
            Grad::Wire(b) => b.clone(),
        };
        let mut p = good.clone();
        p.grads.push((foreign, vec![0.0; 4].into()));
        cases.push((p, "not held by server 0"));
        let mut p = good.clone();
        floats(&mut p.grads[0].1).pop();
        cases.push((p, "expected"));
        let mut p = good.clone();
        floats(&mut p.grads[1].1)[2] = f32::NAN;
        cases.push((p, "index 2"));
        let mut p = good.clone();
        floats(&mut p.grads[0].1)[0] = f32::INFINITY;
        cases.push((p, "inf"));
        // The same checks on wire bytes: a partial value, and a NaN.
        let mut p = good.clone();
        let mut bytes = wire(&p.grads[0].1).to_vec();
        bytes.push(0);
        p.grads[0].1 = Grad::Wire(bytes.into());
        cases.push((p, "expected"));
        let mut p = good.clone();
        let mut nan = floats(&mut p.grads[1].1).clone();
        nan[1] = f32::NAN;
        p.grads[1].1 = Grad::Wire(wire_bytes(&nan));
        cases.push((p, "index 1"));
        for w in [0.0, -1.0, f32::NAN] {
            let mut p = good.clone();
            p.weight = w;
            cases.push((p, "weight"));
        }
        let mut p = good.clone();
        p.grads.clear();
        cases.push((p, "carries no blocks"));
        let mut p = good.clone();
        let dup = p.grads[0].clone();
        p.grads.push(dup);
        cases.push((p, "more than once"));
        let mut p = good.clone();
        p.step = 1;
        cases.push((p, "only at step 0"));
        for (p, needle) in cases {
            let err = st.push(p).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains("\"t\""), "{needle}: {err}");
            assert_eq!(snapshot(&st), before);
            assert_eq!(st.members(), vec!["a".to_string()]);
            assert_eq!(st.step(), 0);
        }
        // None of the rejected pushes consumed the seq: the good one goes through.
        assert_eq!(st.push(good).unwrap(), PushOutcome::Buffered { step: 0, waiting_for: 1 });
        assert!(held.len() >= 2);
        // A second push for the same step is refused.
        let again = push_for(&st, "t", 2, 0, 1.0, |_, _| 1.0);
        assert!(matches!(st.push(again), Err(Error::AlreadyBuffered { buffered_seq: 1, seq: 2, .. })));
        assert_eq!(
            st.push(push_for(&st, "a", 1, 0, 1.0, |_, _| 1.0)).unwrap(),
            PushOutcome::Applied { step: 1 }
        );
        // A late push for step 0 is stale; a retry of an accepted one is a duplicate.
        let stale = push_for(&st, "t", 3, 0, 1.0, |_, _| 1.0);
        assert!(matches!(st.push(stale), Err(Error::StaleStep { got: 0, current: 1, .. })));
        let retry = push_for(&st, "t", 1, 0, 1.0, |_, _| 1.0);
        assert_eq!(st.push(retry).unwrap(), PushOutcome::Duplicate);
    }

    #[test]
    fn a_snapshot_stops_at_the_last_completed_step_dedup_table_included() {
        let pl = Placement::new(&specs(), 1, 100).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        st.join("a");
        st.join("b");
        // Step 0 complete: a and b at seq 0; then a's push for step 1 waits for b.
        st.push(push_for(&st, "a", 0, 0, 1.0, |_, _| 1.0)).unwrap();
        st.push(push_for(&st, "b", 0, 0, 1.0, |_, _| 1.0)).unwrap();
        assert_eq!((st.step(), st.pushes()), (1, 2));
        let buffered = st.push(push_for(&st, "a", 1, 1, 1.0, |_, _| 1.0)).unwrap();
        assert!(matches!(buffered, PushOutcome::Buffered { .. }), "{buffered:?}");
        let snap = st.snapshot().unwrap();
        assert_eq!(snap.last_seqs().collect::<Vec<_>>(), [("a", 0), ("b", 0)], "a's seq 1 is not in it");
        assert_eq!((snap.step(), snap.pushes()), (1, 2));
        // A replica from the snapshot takes a's retry: it was never applied there.
        let mut replica = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        for (t, seq) in snap.last_seqs() {
            replica.restore_last_seq(t, seq);
        }
        replica.set_step(snap.step());
        replica.join("a");
        replica.join("b");
        let retried = replica.push(push_for(&replica, "a", 1, 1, 1.0, |_, _| 1.0)).unwrap();
        assert!(matches!(retried, PushOutcome::Buffered { .. }), "{retried:?}");
        // A step of one trainer that had pushed nothing before: not in the table at all.
        let mut solo = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        solo.join("a");
        solo.join("b");
        solo.push(push_for(&solo, "a", 0, 0, 1.0, |_, _| 1.0)).unwrap();
        assert_eq!(solo.snapshot().unwrap().last_seqs().count(), 0);
    }

    #[test]
    fn leave_completes_barrier_and_keeps_buffered_gradient() {
        let pl = Placement::new(&specs(), 1, 100).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        for t in ["a", "b", "c"] {
            st.join(t);
        }
        st.join("a");
        assert_eq!(st.members().len(), 3);
        let before = snapshot(&st);
        assert!(matches!(
            st.push(push_for(&st, "a", 0, 0, 1.0, |_, _| 2.0)).unwrap(),
            PushOutcome::Buffered { waiting_for: 2, .. }
        ));
        assert!(matches!(
            st.push(push_for(&st, "b", 0, 0, 3.0, |_, _| 6.0)).unwrap(),
            PushOutcome::Buffered { waiting_for: 1, .. }
        ));
        assert_eq!(st.waiting_for(), vec!["c".to_string()]);
        // "b" leaves: its gradient stays; the barrier still waits for "c".
        assert_eq!(st.leave("b"), None);
        assert_eq!(st.step(), 0);
        // The last missing member leaving completes it: (1*2 + 3*6) / 4 = 5.
        assert_eq!(st.leave("c"), Some(1));
        for (a, b) in before.iter().flatten().zip(snapshot(&st).iter().flatten()) {
            assert_eq!(*a - 5.0, *b);
        }
        // The last member leaving with a buffered push applies it.
        st.push(push_for(&st, "a", 1, 1, 1.0, |_, _| 1.0)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(st.step(), 2);
        st.join("z");
        st.push(push_for(&st, "a", 2, 2, 1.0, |_, _| 1.0)).unwrap();
        assert_eq!(st.leave("a"), None);
        assert_eq!(st.leave("z"), Some(3));
        assert!(st.members().is_empty());
        assert_eq!(st.leave("nobody"), None);
    }

    /// `push`'s gradients for the held blocks at positions `range` only.
    fn part(mut push: Push, range: std::ops::Range<usize>) -> Push {
        push.grads = push.grads.drain(range).collect();
        push
    }

    #[test]
    fn sync_parts_apply_block_by_block() {
        // 9 + 3 elements in blocks of 2: seven blocks on one server.
        let pl = Placement::new(&specs(), 1, 2).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        let blocks = st.block_ids().count();
        assert_eq!(blocks, 7);
        st.join("a");
        st.join("b");
        let before = snapshot(&st);
        let a = push_for(&st, "a", 0, 0, 1.0, |_, _| 2.0);
        let b = push_for(&st, "b", 0, 0, 3.0, |_, _| 6.0);
        // "a" pushes its first half: nothing is updated, "b" is missing everywhere.
        let got = st.push(part(a.clone(), 0..3)).unwrap();
        assert_eq!(got, PushOutcome::Buffered { step: 0, waiting_for: 2 });
        assert!(!st.step_underway());
        // "b" pushes the same half: those three blocks are updated ((2 + 18) / 4 = 5).
        let got = st.push(part(b.clone(), 0..3)).unwrap();
        assert_eq!(got, PushOutcome::Buffered { step: 0, waiting_for: 2 });
        assert!(st.step_underway());
        let now = snapshot(&st);
        for k in 0..blocks {
            let moved = if k < 3 { 5.0 } else { 0.0 };
            assert!(before[k].iter().zip(&now[k]).all(|(x, y)| x - moved == *y), "block {k}");
        }
        // A retry of a part already taken is a duplicate; an overlapping one is refused.
        assert_eq!(st.push(part(a.clone(), 0..3)).unwrap(), PushOutcome::Duplicate);
        assert_eq!(st.push(part(a.clone(), 1..2)).unwrap(), PushOutcome::Duplicate);
        assert!(matches!(st.push(part(a.clone(), 2..4)), Err(Error::PartOverlap { seq: 0, .. })));
        // A newcomer mid-step is refused, and joins from the next step.
        let c = push_for(&st, "c", 0, 0, 1.0, |_, _| 1.0);
        assert!(matches!(st.push(part(c, 3..7)), Err(Error::StepUnderway { step: 0, .. })));
        assert_eq!(st.join("c"), 1);
        assert_eq!(st.members(), vec!["a".to_string(), "b".to_string()]);
        // A checkpoint would mix two steps now.
        let taken = st.snapshot();
        assert!(matches!(taken, Err(Error::CheckpointStepUnderway { step: 0 })), "{taken:?}");
        // The second halves complete the step; "c" is then a member.
        assert!(matches!(st.push(part(a, 3..7)).unwrap(), PushOutcome::Buffered { waiting_for: 1, .. }));
        assert_eq!(st.waiting_for(), vec!["b".to_string()]);
        assert_eq!(st.push(part(b, 3..7)).unwrap(), PushOutcome::Applied { step: 1 });
        assert!(!st.step_underway());
        for (x, y) in before.iter().flatten().zip(snapshot(&st).iter().flatten()) {
            assert_eq!(x - 5.0, *y);
        }
        assert_eq!(st.members(), vec!["a".to_string(), "b".to_string(), "c".to_string()]);
        assert_eq!(st.join("c"), 1);
    }

    #[test]
    fn a_member_leaving_mid_step_keeps_its_parts() {
        let pl = Placement::new(&specs(), 1, 6).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Sync).unwrap();
        assert_eq!(st.block_ids().count(), 3);
        st.join("a");
        st.join("b");
        let before = snapshot(&st);
        st.push(part(push_for(&st, "a", 0, 0, 1.0, |_, _| 1.0), 0..1)).unwrap();
        st.push(part(push_for(&st, "b", 0, 0, 1.0, |_, _| 3.0), 0..1)).unwrap();
        st.push(part(push_for(&st, "a", 0, 0, 1.0, |_, _| 1.0), 1..3)).unwrap();
        // "b" leaves before its second part: blocks 1 and 2 take "a"'s alone.
        assert_eq!(st.leave("b"), Some(1));
        let after = snapshot(&st);
        assert!(before[0].iter().zip(&after[0]).all(|(x, y)| x - 2.0 == *y));
        for k in 1..3 {
            assert!(before[k].iter().zip(&after[k]).all(|(x, y)| x - 1.0 == *y));
        }
        // Its late part belongs to a push it left half taken, which leaving
        // forgot: it is answered as done and changes nothing.
        let late = part(push_for(&st, "b", 0, 0, 1.0, |_, _| 3.0), 1..3);
        assert_eq!(st.push(late).unwrap(), PushOutcome::Duplicate);
        assert_eq!(snapshot(&st), after, "nothing of the late part applied");
    }

    #[test]
    fn async_parts_count_one_step_per_whole_push() {
        let pl = Placement::new(&specs(), 1, 4).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Async).unwrap();
        assert_eq!(st.block_ids().count(), 4);
        let before = snapshot(&st);
        let p = push_for(&st, "t", 1, 0, 1.0, |_, _| 1.0);
        assert_eq!(st.push(part(p.clone(), 2..4)).unwrap(), PushOutcome::Applied { step: 0 });
        assert_eq!(st.push(part(p.clone(), 0..1)).unwrap(), PushOutcome::Applied { step: 0 });
        assert_eq!(st.push(part(p.clone(), 0..1)).unwrap(), PushOutcome::Duplicate);
        assert_eq!(st.push(part(p.clone(), 1..2)).unwrap(), PushOutcome::Applied { step: 1 });
        assert_eq!(st.push(p.clone()).unwrap(), PushOutcome::Duplicate);
        for (x, y) in before.iter().flatten().zip(snapshot(&st).iter().flatten()) {
            assert_eq!(x - 1.0, *y);
        }
        // A new seq abandons the parts of the last one that never came.
        let q = push_for(&st, "t", 2, 0, 1.0, |_, _| 1.0);
        assert_eq!(st.push(part(q, 0..1)).unwrap(), PushOutcome::Applied { step: 1 });
        let r = push_for(&st, "t", 3, 0, 1.0, |_, _| 1.0);
        assert_eq!(st.push(r).unwrap(), PushOutcome::Applied { step: 2 });
        // After a restore, a restored seq counts as whole.
        let s4 = push_for(&st, "u", 4, 0, 1.0, |_, _| 1.0);
        st.push(part(s4.clone(), 0..1)).unwrap();
        st.restore_last_seq("u", 4);
        assert_eq!(st.push(part(s4, 1..4)).unwrap(), PushOutcome::Duplicate);
    }

    /// A checkpoint never holds half a push: its snapshot waits until the
    /// push is whole, and a trainer that leaves (or dies) mid-push releases
    /// it.
    #[test]
    fn a_snapshot_waits_for_a_push_in_parts_and_a_departure_ends_the_wait() {
        let pl = Placement::new(&specs(), 1, 4).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 1.0 }), Mode::Async).unwrap();
        assert!(st.snapshot().is_ok());
        let p = push_for(&st, "t", 1, 0, 1.0, |_, _| 1.0);
        st.push(part(p.clone(), 0..2)).unwrap();
        assert!(st.push_in_parts_underway());
        assert!(matches!(st.snapshot(), Err(Error::CheckpointStepUnderway { .. })));
        st.push(part(p, 2..4)).unwrap();
        assert_eq!(st.snapshot().unwrap().step(), 1, "whole: the snapshot holds it");
        let q = push_for(&st, "u", 1, 0, 1.0, |_, _| 1.0);
        st.push(part(q, 0..1)).unwrap();
        assert!(st.snapshot().is_err());
        st.leave("u");
        assert!(!st.push_in_parts_underway() && st.snapshot().is_ok(), "u is gone: nothing to wait for");
    }

    /// A store made to be restored holds no values (nothing allocated for
    /// them) and refuses to be read, pushed to or snapshotted until every
    /// block has its values.
    #[test]
    fn a_store_to_restore_serves_nothing_until_every_block_is_restored() {
        let pl = Placement::new(&specs(), 1, 4).unwrap();
        let opt = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        let full = ParamStore::new(&pl, 0, 1, Box::new(opt.clone()), Mode::Async).unwrap();
        let mut st = ParamStore::new_to_restore(&pl, 0, 1, Box::new(opt), Mode::Async).unwrap();
        let ids: Vec<BlockId> = st.block_ids().collect();
        assert!(ids.len() > 1);
        assert_eq!(st.unrestored(), ids.len());
        let nothing = |(_, p, s): (BlockId, &[f32], &OptimizerState)| p.is_empty() && s.slots.capacity() == 0;
        assert!(st.blocks().all(nothing), "no values made");
        assert!(st.held.iter().all(|h| h.data.params.capacity() == 0), "nor room for them");
        for &id in &ids {
            assert_eq!(st.block_len(id).unwrap(), full.block(id).unwrap().len());
            assert!(matches!(st.block(id), Err(Error::BlockNotRestored { block, .. }) if block == id));
        }
        assert!(matches!(st.snapshot(), Err(Error::BlockNotRestored { .. })));
        let pushed = push_for(&full, "t", 0, 0, 1.0, |_, _| 1.0);
        assert!(matches!(st.push(pushed.clone()), Err(Error::BlockNotRestored { .. })));
        assert_eq!(st.step(), 0, "the refused push changed nothing");

        let restore = |st: &mut ParamStore, id: BlockId| {
            let len = st.block_len(id).unwrap();
            st.restore_block(id, vec![2.0; len], OptimizerState { step: 3, slots: vec![0.0; 2 * len] })
        };
        let (last, first) = ids.split_last().unwrap();
        for &id in first {
            restore(&mut st, id).unwrap();
        }
        assert_eq!(st.unrestored(), 1);
        assert!(st.block(first[0]).is_ok() && st.block(*last).is_err());
        let refused = st.push(pushed.clone());
        assert!(matches!(refused, Err(Error::BlockNotRestored { block, .. }) if block == *last));
        // A restored block restored again counts once.
        restore(&mut st, first[0]).unwrap();
        assert_eq!(st.unrestored(), 1);
        // Wrong lengths are refused against the placement's, not the empty values.
        assert!(matches!(
            st.restore_block(*last, Vec::new(), OptimizerState { step: 0, slots: Vec::new() }),
            Err(Error::RestoreLength { what: "parameters", got: 0, .. })
        ));
        restore(&mut st, *last).unwrap();
        assert_eq!(st.unrestored(), 0);
        assert!(st.snapshot().is_ok());
        st.push(pushed).unwrap();
        assert!(ids.iter().all(|&id| st.block(id).unwrap().iter().all(|&v| v < 2.0)), "the push applied");
    }

    /// A sync follower's store made to be restored refuses a completed
    /// step for a block it has no values for, and changes nothing.
    #[test]
    fn a_step_for_an_unrestored_block_is_refused() {
        let pl = Placement::new(&specs(), 1, 4).unwrap();
        let mut st = ParamStore::new_to_restore(&pl, 0, 1, Box::new(Sgd { lr: 0.5 }), Mode::Sync).unwrap();
        let id = st.block_ids().next().unwrap();
        let len = st.block_len(id).unwrap();
        let step = CompletedStep {
            step: 0,
            grads: vec![(id, vec![1.0; len])],
            rows: Vec::new(),
            seqs: vec![("t".into(), 0)],
            origins: Vec::new(),
        };
        assert!(matches!(st.apply_step(step), Err(Error::BlockNotRestored { block, .. }) if block == id));
        assert_eq!((st.step(), st.pushes()), (0, 0));
        assert!(st.last_seqs().next().is_none());
    }

    /// A checkpoint loads into a store made to be restored (its blocks get
    /// their lengths from the placement, not from values it has not got).
    #[test]
    fn a_checkpoint_loads_into_a_store_made_to_be_restored() {
        let pl = Placement::new(&specs(), 1, 4).unwrap();
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(Sgd { lr: 0.5 }), Mode::Async).unwrap();
        st.push(push_for(&st, "t", 0, 0, 1.0, |_, i| i as f32)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let checkpoints = crate::checkpoint::CheckpointDir::new(dir.path(), 0);
        checkpoints.save(&st.snapshot().unwrap(), 2).unwrap();
        let mut restored =
            ParamStore::new_to_restore(&pl, 0, 1, Box::new(Sgd { lr: 0.5 }), Mode::Async).unwrap();
        assert!(checkpoints.load_latest(&mut restored).unwrap().is_some());
        assert_eq!(restored.unrestored(), 0);
        assert_eq!(snapshot(&restored), snapshot(&st));
        assert_eq!(restored.step(), 1);
    }

    #[test]
    fn restore_and_set_step() {
        let pl = Placement::new(&specs(), 1, 5).unwrap();
        let opt = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(opt), Mode::Sync).unwrap();
        assert_eq!(st.optimizer().name(), "adam");
        let id = BlockId::new(0, 0);
        let state = OptimizerState { step: 7, slots: vec![0.5; 10] };
        st.restore_block(id, vec![1.0; 5], state.clone()).unwrap();
        assert_eq!(st.block(id).unwrap(), &[1.0; 5]);
        assert_eq!(st.blocks().find(|b| b.0 == id).unwrap().2, &state);
        assert!(matches!(
            st.restore_block(id, vec![1.0; 4], state.clone()),
            Err(Error::RestoreLength { what: "parameters", expected: 5, got: 4, .. })
        ));
        let short = OptimizerState { step: 0, slots: vec![0.0; 5] };
        assert!(matches!(
            st.restore_block(id, vec![1.0; 5], short),
            Err(Error::RestoreLength { what: "optimizer slots", expected: 10, got: 5, .. })
        ));
        // What a diverged store held is restored as it was.
        let diverged = OptimizerState { step: 8, slots: [[f32::INFINITY; 5], [0.5; 5]].concat() };
        st.restore_block(id, vec![1.0, 1.0, f32::NAN, f32::NEG_INFINITY, 1.0], diverged.clone()).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = [1.0, 1.0, f32::NAN, f32::NEG_INFINITY, 1.0];
        assert_eq!(bits(st.block(id).unwrap()), bits(&want));
        assert_eq!(st.blocks().find(|b| b.0 == id).unwrap().2, &diverged);
        st.restore_block(id, vec![1.0; 5], state.clone()).unwrap();
        assert!(matches!(
            st.restore_block(BlockId::new(5, 0), vec![], state.clone()),
            Err(Error::BlockNotHeld { .. })
        ));
        assert!(st.block(BlockId::new(0, 9)).is_err());
        st.push(push_for(&st, "a", 0, 0, 1.0, |_, _| 1.0)).unwrap();
        st.join("b");
        st.push(push_for(&st, "a", 1, 1, 1.0, |_, _| 1.0)).unwrap();
        st.set_step(10);
        assert_eq!(st.step(), 10);
        assert_eq!(st.waiting_for().len(), 2, "buffer cleared by set_step");
        st.restore_last_seq("a", 0);
        assert!(st.last_seqs().any(|(t, s)| t == "a" && s == 1));
        st.restore_last_seq("q", 4);
        let p = push_for(&st, "q", 4, 10, 1.0, |_, _| 1.0);
        assert_eq!(st.push(p).unwrap(), PushOutcome::Duplicate);
    }

    #[test]
    fn shared_values_outlive_their_snapshot_and_keep_its_values() {
        let pl = Placement::new(&specs(), 1, 4).unwrap();
        let opt = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(opt), Mode::Async).unwrap();
        st.push(push_for(&st, "t", 1, 0, 1.0, |_, i| i as f32)).unwrap();
        let snap = st.snapshot().unwrap();
        let frozen: Vec<(Vec<f32>, Vec<f32>)> =
            snap.blocks().map(|(_, p, s)| (p.to_vec(), s.slots.clone())).collect();
        let shared: Vec<_> = snap.shared_blocks().collect();
        let ids: Vec<BlockId> = shared.iter().map(|(id, _, _)| *id).collect();
        assert_eq!(ids, snap.blocks().map(|(id, _, _)| id).collect::<Vec<_>>());
        // Views of the snapshot's own values, not copies.
        for ((_, params, slots), (_, p, s)) in shared.iter().zip(snap.blocks()) {
            assert_eq!(params.as_ref().as_ptr(), p.as_ptr());
            assert_eq!(slots.as_ref().as_ptr(), s.slots.as_ptr());
        }
        drop(snap);
        // The store updates every block: the handles still hold the old values.
        st.push(push_for(&st, "t", 2, 0, 1.0, |_, _| 1.0)).unwrap();
        let held: Vec<(Vec<f32>, Vec<f32>)> =
            shared.iter().map(|(_, p, s)| (p.as_ref().to_vec(), s.as_ref().to_vec())).collect();
        assert_eq!(held, frozen);
        assert_ne!(st.blocks().next().unwrap().1, frozen[0].0.as_slice());
    }

    #[test]
    fn a_snapshot_shares_blocks_until_the_store_updates_them() {
        // 9 + 3 elements in blocks of 4: blocks of 4, 4, 1 and 3.
        let pl = Placement::new(&specs(), 1, 4).unwrap();
        let opt = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        let mut st = ParamStore::new(&pl, 0, 1, Box::new(opt.clone()), Mode::Async).unwrap();
        st.push(push_for(&st, "t", 1, 0, 1.0, |_, i| i as f32)).unwrap();
        let shared = |st: &ParamStore, snap: &StoreSnapshot| -> Vec<bool> {
            st.held.iter().zip(&snap.blocks).map(|(h, (_, d))| Arc::ptr_eq(&h.data, d)).collect()
        };
        let snap = st.snapshot().unwrap();
        assert_eq!((snap.step(), snap.server(), snap.optimizer(), snap.state_slots()), (1, 0, "adam", 2));
        assert_eq!(snap.last_seqs().collect::<Vec<_>>(), vec![("t", 1)]);
        assert_eq!(shared(&st, &snap), vec![true; 4], "taking a snapshot copies nothing");
        let frozen: Vec<(Vec<f32>, OptimizerState)> =
            snap.blocks().map(|(_, p, s)| (p.to_vec(), s.clone())).collect();
        // Updating block 1 copies block 1 only, and the snapshot keeps the old values.
        st.push(part(push_for(&st, "t", 2, 0, 1.0, |_, _| 1.0), 1..2)).unwrap();
        st.push(part(push_for(&st, "t", 2, 0, 1.0, |_, _| 1.0), 2..4)).unwrap();
        assert_eq!(shared(&st, &snap), vec![true, false, false, false]);
        let now: Vec<(Vec<f32>, OptimizerState)> =
            snap.blocks().map(|(_, p, s)| (p.to_vec(), s.clone())).collect();
        assert_eq!(now, frozen);
        assert_ne!(st.block(BlockId::new(0, 1)).unwrap(), frozen[1].0.as_slice());
        assert_eq!(st.blocks().nth(1).unwrap().2.step, 2);
        assert_eq!(snap.step(), 1);
        // Once the snapshot is gone, updates copy nothing: every block is the store's alone.
        // The three old blocks it held alone are the store's spare buffers now.
        drop(snap);
        assert!(st.held.iter().all(|h| Arc::strong_count(&h.data) == 1));
        assert_eq!(st.spares.lock().unwrap().len(), 3);
        // The next copy reuses one of them, and copies the values exactly.
        // (Push 2 never sent block 0: it is half taken until "t" leaves.)
        assert!(st.snapshot().is_err());
        st.leave("t");
        let snap = st.snapshot().unwrap();
        let before: Vec<(Vec<f32>, OptimizerState)> =
            snap.blocks().map(|(_, p, s)| (p.to_vec(), s.clone())).collect();
        st.push(part(push_for(&st, "t", 3, 0, 1.0, |_, _| 1.0), 0..1)).unwrap();
        assert_eq!(st.spares.lock().unwrap().len(), 2);
        assert_eq!(shared(&st, &snap), vec![false, true, true, true]);
        let mut reference = ParamStore::new(&pl, 0, 1, Box::new(opt.clone()), Mode::Async).unwrap();
        let (params, state) = &before[0];
        reference.restore_block(BlockId::new(0, 0), params.clone(), state.clone()).unwrap();
        reference.push(part(push_for(&reference, "t", 3, 0, 1.0, |_, _| 1.0), 0..1)).unwrap();
        assert_eq!(st.blocks().next(), reference.blocks().next());
        let now: Vec<(Vec<f32>, OptimizerState)> =
            snap.blocks().map(|(_, p, s)| (p.to_vec(), s.clone())).collect();
        assert_eq!(now, before);
    }
}
