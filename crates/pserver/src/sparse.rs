//! Sparse embedding tables, the I/O-free core: rows keyed by `u64` id.
//!
//! A [`SparseTable`] maps an id to `dim` floats plus that row's optimizer
//! state. These are the decisions of record:
//!
//! - **Rows exist on first touch.** An id never pushed reads as its
//!   initial value, [`init_row`], which depends only on (seed, table name,
//!   id): no hashing into a fixed array, so no two ids ever share a row, and
//!   the values do not depend on the number of shards. A row lives on shard
//!   [`row_shard`]`(table, id, shards)`.
//! - **Only pushes change a table.** [`SparseTable::gather`] (a pull) reads;
//!   [`SparseTable::apply`] (a push) counts the sighting, admits, expires,
//!   evicts and updates. Pulls go to a shard's primary alone, so a follower
//!   that applies the same pushes in the same order holds the same table,
//!   bit for bit: nothing depends on which pulls a replica saw, nor on when
//!   [`SparseTable::sweep`] ran.
//! - **Time is the store's step**, passed in as `now` (the core reads no
//!   clock). A row or candidate last seen at step `s` is expired at every
//!   `now >= s + expire_after`: a pull reads its initial value and a push
//!   treats it as absent (a fresh row, fresh optimizer state; a candidate
//!   counts again from zero). Expiry is exact at every call; `sweep` only
//!   reclaims the memory of what has expired.
//! - **Admission.** A push's id is admitted once it has been sighted
//!   `admit_after` times (0 and 1 both mean at once, counting this push);
//!   until then the id is a *candidate*: its count and last-seen step are
//!   kept and its gradient is dropped.
//! - **Eviction.** `max_rows` caps the rows of one table **on one shard**
//!   (the cap is per shard: a table never knows the others). Creating a row
//!   in a full table first drops the expired rows; if it is still full it
//!   evicts, in one pass, the rows with the smallest key down to
//!   `max_rows - max(1, max_rows / 32)` rows: key (last_seen, id) for
//!   [`Eviction::Lru`], (count, last_seen, id) for [`Eviction::Lfu`]. The
//!   keys are unique, so the rows evicted depend on the table's content
//!   alone, never on its layout; the batch makes eviction amortised O(1) per
//!   row created. Candidates are capped at `max_rows` the same way.
//! - **An evicted or expired row forgets its optimizer state with its
//!   values**: if it comes back it starts again from [`init_row`], step 0 and
//!   zero slots. (TorchRec once brought evicted rows back with their stale
//!   state; `tests/sparse_props.rs` checks exactly that case.)
//! - **Per-row optimizer steps.** Each row counts its own updates, and the
//!   update is [`Optimizer::apply_row`]: Adam's bias correction uses the
//!   row's step ("lazy Adam"), since a row is updated only in the steps
//!   whose batches hold its id.
//!
//! **Layout.** Rows live in an arena of chunks of up to 4096 rows, each an
//! `Arc` holding its rows' floats (a row is `dim` parameters then each
//! optimizer slot's `dim` values, the chunk's floats starting on a cache
//! line) and their metadata (id, step, count, last seen: one 32-byte
//! record per row, so a row costs the CPU few cache lines). An index of
//! its own maps id to arena slot: linear probing over 16-byte entries,
//! at most 3/4 full, hashed with the SplitMix64 mixer (two multiplies and
//! three shifts) rather than SipHash, whose resistance to chosen keys is
//! not needed for ids from the job's own trainers. An id's entry is
//! almost always in the cache line its hash names, so a call's lookups
//! prefetch their lines ahead, as they do the rows; a removal shifts its
//! run back, leaving no tombstone. Freed slots are reused. A
//! [`TableSnapshot`] clones the chunk list, no float copied; an update
//! copies a chunk first only while a snapshot still shares it, as
//! `ParamStore` does with its blocks (one copy-on-write check per row
//! written).
//! [`row_bytes`] is the resident size per row this gives, to turn a memory
//! budget into `max_rows`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::optimizer::Optimizer;
use crate::rng::{hash_str, mix64, SplitMix64};
use crate::spec::{validate_specs, Init, ParamSpec};

/// The largest row width a table may have.
pub const MAX_DIM: usize = 1 << 16;

/// The most ids one pull or push may name: a bound on the work and memory
/// of one call, whatever a trainer sends. A sync step's rows, its members'
/// pushes combined, may be more ([`SparseTable::check_step`]).
pub const MAX_ROWS_PER_CALL: usize = 1 << 20;

/// The most bytes of row values one pull of rows (or all the row pulls of
/// one batch) is answered with: the transport's default message limit, so
/// a pull refused by it could not have been sent anyway. Counted from the
/// ids asked for, before any row is read.
pub const MAX_PULL_REPLY_BYTES: u64 = 1 << 30;

/// The most rows (and, apart, candidates) one table may hold, with or
/// without `max_rows`: arena slots are `u32`.
pub const MAX_TABLE_ROWS: usize = u32::MAX as usize;

/// The most optimizer slot arrays a table's rows may carry (the built-ins
/// use at most 2).
pub const MAX_STATE_SLOTS: usize = 8;

/// The fewest steps between two sweeps that [`SparseTable::apply`] runs
/// itself: a sweep reads the whole table, so a short expiry does not make
/// every push pay for one.
pub const SWEEP_EVERY: u64 = 64;

/// Rows per arena chunk, at most (fewer for wide rows, see `CHUNK_FLOATS`).
const CHUNK_ROWS: usize = 4096;

/// A chunk's floats, at most, unless one row is wider: bounds what an
/// update copies while a snapshot shares the chunk (4 MiB).
const CHUNK_FLOATS: usize = 1 << 20;

/// Resident bytes of a row's metadata in its chunk: id, step, last seen
/// (8 each) and count (4), in a record of 32 ([`RowMeta`]).
const META_BYTES: usize = std::mem::size_of::<RowMeta>();

/// Resident bytes of a row's index entry: a 16-byte (id, slot) entry, at
/// between 1.33 and 2.67 entries per row (the index is at most 3/4 full
/// and grows by doubling, or is reserved for `max_rows`); the estimate
/// takes 1.5.
const INDEX_BYTES: usize = 24;

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Which rows a full table evicts first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Eviction {
    /// Least recently pushed: smallest (last_seen, id) first.
    #[default]
    Lru,
    /// Least frequently pushed: smallest (count, last_seen, id) first.
    Lfu,
}

/// A table's admission, expiry and eviction rules (see the module docs).
/// The default admits at the first push, never expires and has no cap.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowPolicy {
    /// Pushes an id needs before it gets a row (0 and 1: the first).
    pub admit_after: u32,
    /// Steps without a push after which a row or candidate is dropped;
    /// `None`: never. At least 1.
    pub expire_after: Option<u64>,
    /// Rows one shard's table holds at most; `None`: no cap (but
    /// [`MAX_TABLE_ROWS`]). Candidates are capped at the same number.
    pub max_rows: Option<usize>,
    /// Which rows go first when the cap is reached.
    pub evict: Eviction,
}

impl RowPolicy {
    /// Whether what was last seen at `last_seen` is expired at `now`.
    fn expired(&self, last_seen: u64, now: u64) -> bool {
        self.expire_after.is_some_and(|t| now >= last_seen.saturating_add(t))
    }

    /// The rows (and candidates) a table holds at most.
    pub(crate) fn cap(&self) -> usize {
        self.max_rows.unwrap_or(MAX_TABLE_ROWS).min(MAX_TABLE_ROWS)
    }
}

/// One sparse table of a model: its name (which also seeds its rows'
/// initial values), row width, initialiser and row policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableSpec {
    /// Unique, non-empty name.
    pub name: String,
    /// Floats per row, in `1..=MAX_DIM`.
    pub dim: usize,
    /// How each row's initial values are drawn (as for a dense parameter).
    pub init: Init,
    /// Admission, expiry and eviction.
    pub policy: RowPolicy,
}

impl TableSpec {
    /// A table with the default [`RowPolicy`]: every pushed id gets a row
    /// at once, kept for ever.
    pub fn new(name: impl Into<String>, dim: usize, init: Init) -> Self {
        Self { name: name.into(), dim, init, policy: RowPolicy::default() }
    }

    /// Check the spec: a non-empty name, `dim` in `1..=MAX_DIM`, an
    /// initialiser with finite values (`std >= 0`, `low <= high`), and a
    /// policy with `expire_after >= 1` and `max_rows` in
    /// `1..=MAX_TABLE_ROWS`.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::BadTable { table: self.name.clone(), reason };
        if self.name.is_empty() {
            return Err(bad("the table name is empty".into()));
        }
        if !(1..=MAX_DIM).contains(&self.dim) {
            return Err(bad(format!("dim {} is not in 1..={MAX_DIM}", self.dim)));
        }
        // The dense parameters' rules for an initialiser, applied to a row.
        let as_param = ParamSpec::new(self.name.clone(), vec![self.dim], self.init.clone());
        match validate_specs(std::slice::from_ref(&as_param)) {
            Ok(()) => {}
            Err(Error::BadInit { reason, .. }) => return Err(bad(format!("bad initialiser: {reason}"))),
            Err(e) => return Err(bad(e.to_string())),
        }
        if self.policy.expire_after == Some(0) {
            return Err(bad("expire_after must be at least 1 step".into()));
        }
        if let Some(max) = self.policy.max_rows {
            if !(1..=MAX_TABLE_ROWS).contains(&max) {
                return Err(bad(format!("max_rows {max} is not in 1..={MAX_TABLE_ROWS}")));
            }
        }
        Ok(())
    }
}

/// Fill `out` with the initial value of row `id` of `spec`'s table.
///
/// Element `j`'s value depends only on `(seed, spec.name, id, j)`, drawn as
/// [`init_values`](crate::spec::init_values) draws a dense parameter's (one
/// generator per element, the same [`Init`] semantics), so every shard and
/// every trainer computes it alone. For a given seed and table, distinct
/// ids get independent generators (the mixer is a bijection).
pub fn init_row(spec: &TableSpec, seed: u64, id: u64, out: &mut [f32]) {
    fill_row(&spec.init, table_base(seed, &spec.name), id, out);
}

/// The seed of a table's rows: as `init_values` seeds a parameter's elements.
fn table_base(seed: u64, name: &str) -> u64 {
    mix64(seed ^ hash_str(name))
}

fn fill_row(init: &Init, base: u64, id: u64, out: &mut [f32]) {
    let row = mix64(base ^ mix64(id));
    let rng_at = |j: usize| SplitMix64::new(mix64(row ^ (j as u64).wrapping_mul(GOLDEN_GAMMA)));
    crate::spec::draw(init, rng_at, out);
}

/// The shard that holds row `id` of `table`, among `shards` (0 if
/// `shards` is 0). Mixed so that consecutive ids spread evenly, and
/// salted by the table so that two tables' hot ids land apart.
pub fn row_shard(table: &str, id: u64, shards: u32) -> u32 {
    row_shard_hashed(hash_str(table), id, shards)
}

/// [`row_shard`] with the table's name hashed once ([`hash_str`]) for many ids.
pub fn row_shard_hashed(table_hash: u64, id: u64, shards: u32) -> u32 {
    if shards == 0 {
        return 0;
    }
    // The remainder is below `shards`, so it fits.
    (mix64(table_hash ^ mix64(id)) % u64::from(shards)) as u32
}

/// Resident bytes per row of a table of `dim` floats per row and
/// `state_slots` optimizer slots: the floats (`4 * dim * (1 + state_slots)`),
/// the row's metadata (32) and its index entry (24: a 16-byte entry, at
/// 1.5 entries per row). Divide a shard's memory budget for a table by it
/// to get `max_rows`.
///
/// Raw, a row is its floats and its 8-byte id, so the estimate is within
/// 1.5x of raw once `dim * (1 + state_slots) >= 21` (e.g. dim 8 with Adam,
/// 16 with AdaGrad, 32 with SGD).
///
/// A table capped at `max_rows` never has more than `max_rows` arena slots
/// (rows, and slots freed by eviction or expiry that new rows reuse), so
/// `max_rows * row_bytes` covers its arena. Not counted in it:
/// - the index's actual size: reserved for `max_rows` up front, with the
///   power-of-two entry count at or above `max_rows * 4 / 3`, so 1.33 to
///   2.67 entries (21 to 43 bytes) per row of the cap, against the 24
///   taken here. Eviction never grows it (a removal leaves no tombstone);
/// - eviction's keys, kept for the next eviction: `2 * max(1, max_rows /
///   32)` of 32 bytes, so 2 bytes per row of the cap; and while a push
///   evicts, 16 bytes per expired row it drops;
/// - candidates: about 40 bytes each, at most `max_rows`;
/// - chunks copied while a snapshot (a checkpoint, a catch-up) shares them:
///   up to the table's floats and metadata again, for as long as it lives;
/// - the allocator's own overhead, and memory it keeps after a free.
///
/// Measured with dim 16 and Adam, a 400,000-row cap under a long Zipf
/// stream (`bench/src/bin/bench_sparse.rs`): resident 1.10x `max_rows *
/// row_bytes`, the index being at the top of its range there (1,048,576
/// entries for 400,000 rows, 42 bytes per row).
pub fn row_bytes(dim: usize, state_slots: usize) -> usize {
    dim.saturating_mul(state_slots.saturating_add(1))
        .saturating_mul(4)
        .saturating_add(META_BYTES + INDEX_BYTES)
}

/// Hashes `u64` ids with the SplitMix64 mixer: fast, and spread well in
/// every bit (the index uses both the low and the high bits). Ids come from
/// the job's own data, so hash flooding is not a concern. Built by [`IdHash`].
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Not used for `u64` keys; correct for anything else.
        for &b in bytes {
            self.0 = mix64(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = mix64(self.0 ^ x);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The [`BuildHasher`] of [`IdHasher`], for maps keyed by row id (the
/// tables' index, a trainer's `RowBatch`).
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHash;

impl BuildHasher for IdHash {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}

type IdMap<V> = HashMap<u64, V, IdHash>;

mod slot_index;
use slot_index::SlotIndex;

/// How many ids ahead [`SparseTable::gather`] and [`SparseTable::apply`]
/// prefetch a row: a row's lines are scattered over the arena, and its
/// reads otherwise wait on memory one row at a time.
const PREFETCH_AHEAD: usize = 8;

/// A hint to the CPU to bring `value`'s cache line in; nothing on targets
/// other than x86_64.
#[inline(always)]
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch has no effect the program can observe and cannot
    // fault (and `value` is a live reference); SSE is in x86_64's baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// Up to `chunk_rows` rows of the arena: row `r`'s floats at `r * stride`
/// in `lines`, its metadata at `meta[r]`. A freed row has count 0 (a held
/// row has been pushed at least once).
///
/// The layout is for the cache: a row's metadata is one 32-byte record
/// (never across two cache lines), and the floats start on a cache line,
/// so a row whose stride is a multiple of 16 floats (dim 16 with Adam, say)
/// spans exactly `stride / 16` lines. A push or pull of a row touches about
/// 4 lines at dim 16 with Adam, where separate vectors per field and an
/// unaligned arena touched 7.
#[derive(Clone, Debug, Default)]
struct Chunk {
    lines: Vec<Line>,
    meta: Vec<RowMeta>,
}

/// 16 floats, one 64-byte cache line: the unit a chunk's floats are held
/// in, so that they start on a line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line([f32; 16]);

// SAFETY: `Line` is `repr(C)` over 16 `f32` (64 bytes) with alignment 64:
// no padding, and any bit pattern (all zeros included) is a valid value.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; `Line` is `Copy` and `'static`.
unsafe impl bytemuck::Pod for Line {}

/// A row's metadata, together in one 32-byte record.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
struct RowMeta {
    id: u64,
    /// The optimizer's updates of the row.
    step: u64,
    /// The store step of its last push.
    seen: u64,
    /// Pushes of its id; 0 for a freed row.
    count: u32,
}

impl Chunk {
    fn with_capacity(rows: usize, stride: usize) -> Self {
        Self {
            lines: Vec::with_capacity(rows.saturating_mul(stride).div_ceil(16)),
            meta: Vec::with_capacity(rows),
        }
    }

    fn rows(&self) -> usize {
        self.meta.len()
    }

    fn floats(&self) -> &[f32] {
        bytemuck::cast_slice(&self.lines)
    }

    /// Row `r`'s `stride` floats.
    fn row(&self, r: usize, stride: usize) -> &[f32] {
        &self.floats()[r * stride..][..stride]
    }

    /// Row `r`'s `stride` floats and its metadata, to update together.
    fn row_mut(&mut self, r: usize, stride: usize) -> (&mut [f32], &mut RowMeta) {
        let floats: &mut [f32] = bytemuck::cast_slice_mut(&mut self.lines);
        (&mut floats[r * stride..][..stride], &mut self.meta[r])
    }

    /// Make row `r` (a freed one, or the next one at the chunk's end) a row
    /// of `id` with this metadata; its `stride` floats are the caller's to
    /// write.
    fn put(&mut self, r: usize, id: u64, stride: usize, step: u64, count: u32, seen: u64) {
        let meta = RowMeta { id, step, seen, count };
        if r == self.rows() {
            let lines = (r + 1).saturating_mul(stride).div_ceil(16);
            self.lines.resize(lines, Line([0.0; 16]));
            self.meta.push(meta);
        } else {
            self.meta[r] = meta;
        }
    }
}

/// What a table holds and has done: its current rows and candidates, and
/// counters over its life (carried by snapshots and checkpoints).
///
/// `admitted` and `evicted` change on pushes only, so replicas agree on
/// them; `expired` and `dropped_candidates` count what was dropped when it
/// was dropped (by a push, a full table or [`SparseTable::sweep`]), so they
/// depend on when sweeps ran, as do `rows` and `candidates`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableStats {
    /// Rows held (including expired ones not yet dropped).
    pub rows: usize,
    /// Ids sighted but not admitted yet (including expired ones not yet dropped).
    pub candidates: usize,
    /// Rows created.
    pub admitted: u64,
    /// Rows evicted by the cap.
    pub evicted: u64,
    /// Rows dropped because they expired.
    pub expired: u64,
    /// Candidates dropped, expired or over the cap.
    pub dropped_candidates: u64,
}

/// A held row as a snapshot (or [`SparseTable::row`]) shows it, and as
/// [`SparseTable::restore_row`] takes it back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowRecord<'a> {
    /// The row's id.
    pub id: u64,
    /// Its `dim` values.
    pub params: &'a [f32],
    /// Its optimizer's updates so far.
    pub step: u64,
    /// Its optimizer slots, `state_slots * dim` values (slot `k` at `k * dim`).
    pub slots: &'a [f32],
    /// Pushes of its id (sightings), including those as a candidate.
    pub count: u32,
    /// The step of its last push.
    pub last_seen: u64,
}

/// An id sighted but not admitted yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The id.
    pub id: u64,
    /// Its sightings so far (at least 1).
    pub count: u32,
    /// The step of its last sighting.
    pub last_seen: u64,
}

/// The rows of one table on one shard, with their optimizer state, and the
/// admission candidates (see the module docs for the semantics).
pub struct SparseTable {
    spec: TableSpec,
    seed: u64,
    /// `table_base(seed, name)`, hashed once.
    base: u64,
    state_slots: usize,
    /// Floats per row: `dim * (1 + state_slots)`.
    stride: usize,
    chunk_rows: usize,
    /// `spec.policy.cap()`.
    cap: usize,
    chunks: Vec<Arc<Chunk>>,
    /// Freed slots, reused before the arena grows.
    free: Vec<u32>,
    /// Rows freed over the table's life: `apply` trusts the slots it
    /// looked up before a push only while this has not moved.
    freed: u64,
    /// id -> arena slot (`chunk * chunk_rows + row`).
    index: SlotIndex,
    /// id -> (count, last_seen).
    candidates: IdMap<(u32, u64)>,
    /// The life counters (`rows` and `candidates` unused).
    counters: TableStats,
    /// The eviction keys of a full table, kept to reuse the buffer: room
    /// for `2 * max(1, cap / 32)` of them (see `make_room_for_row`).
    scratch: Vec<RowKey>,
    /// The step at which `apply` next sweeps expired rows away.
    next_sweep: u64,
}

impl fmt::Debug for SparseTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SparseTable")
            .field("spec", &self.spec)
            .field("seed", &self.seed)
            .field("state_slots", &self.state_slots)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl SparseTable {
    /// An empty table for `spec` (validated), its rows initialised from
    /// `seed`, each with `state_slots` optimizer slots (the optimizer's
    /// [`Optimizer::state_slots`], at most [`MAX_STATE_SLOTS`]). With
    /// `max_rows` set, the index and the arena's chunk list are reserved
    /// for it up front (address space only until rows arrive).
    pub fn new(spec: TableSpec, seed: u64, state_slots: usize) -> Result<Self> {
        spec.validate()?;
        if state_slots > MAX_STATE_SLOTS {
            return Err(Error::BadTable {
                table: spec.name.clone(),
                reason: format!("{state_slots} optimizer slots per row, at most {MAX_STATE_SLOTS}"),
            });
        }
        // dim <= 2^16 and slots <= 8: no overflow.
        let stride = spec.dim * (1 + state_slots);
        let chunk_rows = (CHUNK_FLOATS / stride).clamp(1, CHUNK_ROWS);
        let cap = spec.policy.cap();
        let mut index = SlotIndex::default();
        let mut chunks = Vec::new();
        if spec.policy.max_rows.is_some() {
            // A reservation that fails (address space) only means growing later.
            let _ = index.try_reserve(cap);
            let _ = chunks.try_reserve(cap.div_ceil(chunk_rows));
        }
        Ok(Self {
            base: table_base(seed, &spec.name),
            spec,
            seed,
            state_slots,
            stride,
            chunk_rows,
            cap,
            chunks,
            free: Vec::new(),
            freed: 0,
            index,
            candidates: IdMap::default(),
            counters: TableStats::default(),
            scratch: Vec::new(),
            next_sweep: 0,
        })
    }

    /// The table's spec.
    pub fn spec(&self) -> &TableSpec {
        &self.spec
    }

    /// The seed of its rows' initial values.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Optimizer slots per row.
    pub fn state_slots(&self) -> usize {
        self.state_slots
    }

    /// Rows held: admitted, and not dropped yet. A row that has expired
    /// counts until a push or [`sweep`](Self::sweep) drops it (reads
    /// already treat it as absent).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True if the table holds no row.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Rows and candidates held, and the life counters.
    pub fn stats(&self) -> TableStats {
        TableStats { rows: self.index.len(), candidates: self.candidates.len(), ..self.counters }
    }

    /// Resident bytes per row of this table: [`row_bytes`] of its dim and slots.
    pub fn bytes_per_row(&self) -> usize {
        row_bytes(self.spec.dim, self.state_slots)
    }

    /// Values of `ids` into `out` (`ids.len() * dim` floats, row after
    /// row): a row held and not expired at `now` gives its values, any
    /// other id its initial value. Changes nothing: pulls go to the primary
    /// only, so every change happens on a push and replicas stay identical.
    /// If `out` is not `ids.len() * dim` long, only the rows that fit are
    /// written.
    ///
    /// The ids' slots are looked up first, so the index probes overlap,
    /// and each row is prefetched 8 ids (`PREFETCH_AHEAD`) before it is read.
    pub fn gather(&self, ids: &[u64], now: u64, out: &mut [f32]) {
        let dim = self.spec.dim;
        let slots = self.slots_of(ids);
        for (i, ((&id, out), &slot)) in ids.iter().zip(out.chunks_exact_mut(dim)).zip(&slots).enumerate() {
            if let Some(&Some(ahead)) = slots.get(i + PREFETCH_AHEAD) {
                self.prefetch_row(ahead, dim);
            }
            match slot.and_then(|slot| self.live_at(slot, now)) {
                Some((c, r)) => out.copy_from_slice(&self.chunks[c].row(r, self.stride)[..dim]),
                None => fill_row(&self.spec.init, self.base, id, out),
            }
        }
    }

    /// Row `id` if it is held and not expired at `now`: its values,
    /// optimizer state, count and last push.
    pub fn row(&self, id: u64, now: u64) -> Option<RowRecord<'_>> {
        let (c, r) = self.live(id, now)?;
        Some(record(&self.chunks[c], r, id, self.spec.dim, self.stride))
    }

    /// Check a row gradient for `ids` without changing anything:
    /// at most [`MAX_ROWS_PER_CALL`] ids, `grads.len() == ids.len() * dim`,
    /// every value finite, no id twice. A push is checked whole before any
    /// of it is applied, so a bad one changes nothing.
    pub fn check(&self, ids: &[u64], grads: &[f32]) -> Result<()> {
        if ids.len() > MAX_ROWS_PER_CALL {
            let table = self.spec.name.clone();
            return Err(Error::TooManyRows { table, got: ids.len(), max: MAX_ROWS_PER_CALL });
        }
        self.check_step(ids, grads)
    }

    /// [`check`](Self::check) without the per-call limit, for the rows of a
    /// sync step its primary combined from its members' pushes: each push
    /// is within [`MAX_ROWS_PER_CALL`], their union need not be, and a
    /// follower must take the step the primary applied.
    pub fn check_step(&self, ids: &[u64], grads: &[f32]) -> Result<()> {
        let table = || self.spec.name.clone();
        let expected = ids.len().saturating_mul(self.spec.dim);
        if grads.len() != expected {
            return Err(Error::RowGradLength { table: table(), expected, got: grads.len() });
        }
        for (&id, grad) in ids.iter().zip(grads.chunks_exact(self.spec.dim)) {
            if let Some((index, &value)) = grad.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(Error::RowNonFinite { table: table(), id, index, value });
            }
        }
        let mut seen: HashSet<u64, IdHash> = HashSet::with_capacity_and_hasher(ids.len(), IdHash);
        for &id in ids {
            if !seen.insert(id) {
                return Err(Error::DuplicateRow { table: table(), id });
            }
        }
        Ok(())
    }

    /// Apply one row gradient (already [`check`](Self::check)ed) at store
    /// step `now`: for each id in order, count the sighting, then
    /// - a row held and not expired: its count and last push updated and
    ///   `opt.apply_row` run on it;
    /// - otherwise (an expired row is dropped first) the id is a candidate
    ///   until it has `admit_after` sightings, its gradient dropped; once
    ///   admitted it gets a row at [`init_row`] with fresh state (step 0,
    ///   zero slots), evicting first if the table is full, and the update.
    ///
    /// `opt` should have the table's `state_slots` (a built-in with fewer
    /// updates what it has, see [`Optimizer::apply`]). Rows past the end of
    /// a short `grads` are left alone.
    ///
    /// With expiry, it also [`sweep`](Self::sweep)s every `max(T,`
    /// [`SWEEP_EVERY`]`)` steps, so the memory of rows that expired is
    /// reclaimed without the caller's help (a sweep changes no value read).
    pub fn apply(&mut self, ids: &[u64], grads: &[f32], now: u64, opt: &dyn Optimizer) {
        if let Some(after) = self.spec.policy.expire_after {
            if now >= self.next_sweep {
                self.sweep(now);
                self.next_sweep = now.saturating_add(after.max(SWEEP_EVERY));
            }
        }
        // The slots as they are before this push, looked up once: each id's
        // row is prefetched by them ahead of its update, and updated by
        // them while they still hold. Only freeing a row (an eviction, an
        // expiry) takes an id off its slot, and only admitting one gives an
        // absent id a slot (another id's, unless the ids repeat, which
        // `check` refuses); after either, the kind of lookup it may have
        // made stale is made again.
        let slots = self.slots_of(ids);
        let (freed, admitted) = (self.freed, self.counters.admitted);
        for (i, ((&id, grad), &slot)) in
            ids.iter().zip(grads.chunks_exact(self.spec.dim)).zip(&slots).enumerate()
        {
            if let Some(&Some(ahead)) = slots.get(i + PREFETCH_AHEAD) {
                self.prefetch_row(ahead, self.stride);
            }
            let stale = match slot {
                Some(_) => self.freed != freed,
                None => self.counters.admitted != admitted,
            };
            let slot = if stale { self.index.get(id) } else { slot };
            self.apply_one(id, slot, grad, now, opt);
        }
    }

    /// One id of [`apply`](Self::apply), held at `slot` in the index, or
    /// not held. Each row it writes is written through a single
    /// `Arc::make_mut` of its chunk (a copy-on-write check, an atomic
    /// operation): metadata, values and optimizer state together.
    fn apply_one(&mut self, id: u64, slot: Option<u32>, grad: &[f32], now: u64, opt: &dyn Optimizer) {
        let (dim, stride) = (self.spec.dim, self.stride);
        if let Some(slot) = slot {
            let (c, r) = self.locate(slot);
            if self.spec.policy.expired(self.chunks[c].meta[r].seen, now) {
                // Dropped: the id goes on below as one not held.
                self.free_slot(id, slot);
                self.counters.expired += 1;
            } else {
                let (row, meta) = Arc::make_mut(&mut self.chunks[c]).row_mut(r, stride);
                meta.count = meta.count.saturating_add(1);
                meta.seen = now;
                let (params, slots) = row.split_at_mut(dim);
                opt.apply_row(params, grad, &mut meta.step, slots);
                return;
            }
        }
        let prior = self.candidates.get(&id).copied();
        let live = prior.filter(|&(_, seen)| !self.spec.policy.expired(seen, now));
        let count = live.map_or(1, |(count, _)| count.saturating_add(1));
        if prior.is_some() && live.is_none() {
            self.candidates.remove(&id);
            self.counters.dropped_candidates += 1;
        }
        if count < self.spec.policy.admit_after {
            if live.is_none() && self.candidates.len() >= self.cap {
                self.make_room_for_candidate(now);
            }
            self.candidates.insert(id, (count, now));
            return;
        }
        if live.is_some() {
            self.candidates.remove(&id);
        }
        if self.index.len() >= self.cap {
            self.make_room_for_row(now);
        }
        self.counters.admitted += 1;
        let (c, r) = self.take_slot(id);
        let chunk = Arc::make_mut(&mut self.chunks[c]);
        chunk.put(r, id, stride, 0, count, now);
        let (row, meta) = chunk.row_mut(r, stride);
        let (params, slots) = row.split_at_mut(dim);
        fill_row(&self.spec.init, self.base, id, params);
        slots.fill(0.0);
        opt.apply_row(params, grad, &mut meta.step, slots);
    }

    /// Drop the rows and candidates expired at `now`, for their memory
    /// (their slots are reused; the arena does not shrink). Reads and
    /// pushes already treat them as absent, so when this runs changes no
    /// result, only [`stats`](Self::stats) and [`len`](Self::len).
    pub fn sweep(&mut self, now: u64) {
        if self.spec.policy.expire_after.is_none() {
            return;
        }
        let policy = self.spec.policy.clone();
        let expired: Vec<(u64, u32)> = self
            .live_slots()
            .filter(|&(_, c, r)| policy.expired(self.chunks[c].meta[r].seen, now))
            .map(|(id, c, r)| (id, self.slot_of(c, r)))
            .collect();
        self.counters.expired += expired.len() as u64;
        for (id, slot) in expired {
            self.free_slot(id, slot);
        }
        let before = self.candidates.len();
        self.candidates.retain(|_, &mut (_, seen)| !policy.expired(seen, now));
        self.counters.dropped_candidates += (before - self.candidates.len()) as u64;
    }

    /// A consistent copy of the table, cheap to take: it shares the rows'
    /// chunks (no float is copied) and clones the candidates. The table
    /// copies a chunk when it next updates one a live snapshot shares, so
    /// a snapshot costs at most one more copy of the rows updated while it
    /// lives.
    pub fn snapshot(&self) -> TableSnapshot {
        TableSnapshot {
            spec: self.spec.clone(),
            seed: self.seed,
            state_slots: self.state_slots,
            stride: self.stride,
            chunks: self.chunks.clone(),
            candidates: self.candidates.clone(),
            sorted: Arc::default(),
            stats: self.stats(),
        }
    }

    /// Make this table hold exactly what `snapshot` held (rows, candidates
    /// and counters), keeping this table's policy. The snapshot must be of
    /// a table with the same name, dim, initialiser, seed and optimizer
    /// slots, and fit this policy's cap. All or nothing: on an error the
    /// table is unchanged.
    pub fn restore(&mut self, snapshot: &TableSnapshot) -> Result<()> {
        let theirs = &snapshot.spec;
        if theirs.name != self.spec.name
            || theirs.dim != self.spec.dim
            || theirs.init != self.spec.init
            || snapshot.seed != self.seed
            || snapshot.state_slots != self.state_slots
        {
            return Err(Error::BadTable {
                table: self.spec.name.clone(),
                reason: format!(
                    "snapshot of table {:?} (dim {}, {:?}, seed {}, {} slots) does not fit \
                     this one (dim {}, {:?}, seed {}, {} slots)",
                    theirs.name,
                    theirs.dim,
                    theirs.init,
                    snapshot.seed,
                    snapshot.state_slots,
                    self.spec.dim,
                    self.spec.init,
                    self.seed,
                    self.state_slots
                ),
            });
        }
        let mut fresh = SparseTable::new(self.spec.clone(), self.seed, self.state_slots)?;
        for row in snapshot.records() {
            fresh.restore_row(row)?;
        }
        for candidate in snapshot.candidates() {
            fresh.restore_candidate(candidate)?;
        }
        fresh.restore_counters(&snapshot.stats);
        *self = fresh;
        Ok(())
    }

    /// Put back one held row (a checkpoint's, a catch-up's): its values,
    /// optimizer state, count and last push, replacing any row or
    /// candidate of its id. Checked first (lengths `dim` and
    /// `state_slots * dim`, count at least 1, room under the cap); on an
    /// error nothing changed. The values are taken as they come, NaN and
    /// infinities included, as [`ParamStore::restore_block`] takes a
    /// block's: a row holds what its optimizer computed.
    ///
    /// [`ParamStore::restore_block`]: crate::ParamStore::restore_block
    pub fn restore_row(&mut self, row: RowRecord<'_>) -> Result<()> {
        let (dim, stride) = (self.spec.dim, self.stride);
        let bad = |reason: String| Error::RestoreRow { table: self.spec.name.clone(), id: row.id, reason };
        let want_slots = dim * self.state_slots;
        if row.params.len() != dim {
            return Err(bad(format!("parameters have {} values, expected {dim}", row.params.len())));
        }
        if row.slots.len() != want_slots {
            return Err(bad(format!(
                "optimizer slots have {} values, expected {want_slots}",
                row.slots.len()
            )));
        }
        if row.count == 0 {
            return Err(bad("count 0: a held row has been pushed at least once".into()));
        }
        let (c, r) = match self.index.get(row.id) {
            Some(slot) => self.locate(slot),
            None if self.index.len() >= self.cap => {
                return Err(bad(format!("the table already holds its {} rows", self.cap)));
            }
            None => {
                self.candidates.remove(&row.id);
                self.take_slot(row.id)
            }
        };
        let chunk = Arc::make_mut(&mut self.chunks[c]);
        chunk.put(r, row.id, stride, row.step, row.count, row.last_seen);
        let (params, slots) = chunk.row_mut(r, stride).0.split_at_mut(dim);
        params.copy_from_slice(row.params);
        slots.copy_from_slice(row.slots);
        Ok(())
    }

    /// Put back one candidate. Refused (nothing changed) if its count is
    /// 0, its id is a held row, or the candidates are at the cap.
    pub fn restore_candidate(&mut self, candidate: Candidate) -> Result<()> {
        let bad = |reason: &str| Error::RestoreRow {
            table: self.spec.name.clone(),
            id: candidate.id,
            reason: format!("candidate: {reason}"),
        };
        if candidate.count == 0 {
            return Err(bad("count 0: a candidate has been pushed at least once"));
        }
        if self.index.contains_key(candidate.id) {
            return Err(bad("the id is a held row"));
        }
        if !self.candidates.contains_key(&candidate.id) && self.candidates.len() >= self.cap {
            return Err(bad("the table already holds its most candidates"));
        }
        self.candidates.insert(candidate.id, (candidate.count, candidate.last_seen));
        Ok(())
    }

    /// Put back the life counters of `stats` (`admitted`, `evicted`,
    /// `expired`, `dropped_candidates`; `rows` and `candidates` are what
    /// the table holds and are ignored).
    pub fn restore_counters(&mut self, stats: &TableStats) {
        self.counters = TableStats { rows: 0, candidates: 0, ..*stats };
    }

    fn locate(&self, slot: u32) -> (usize, usize) {
        let slot = slot as usize;
        (slot / self.chunk_rows, slot % self.chunk_rows)
    }

    fn slot_of(&self, c: usize, r: usize) -> u32 {
        // Slots in use never exceed the cap, at most u32::MAX.
        (c * self.chunk_rows + r) as u32
    }

    /// The chunk and row of `id` if held and not expired at `now`.
    fn live(&self, id: u64, now: u64) -> Option<(usize, usize)> {
        self.live_at(self.index.get(id)?, now)
    }

    /// The chunk and row of an indexed `slot` if not expired at `now`.
    fn live_at(&self, slot: u32, now: u64) -> Option<(usize, usize)> {
        let (c, r) = self.locate(slot);
        (!self.spec.policy.expired(self.chunks[c].meta[r].seen, now)).then_some((c, r))
    }

    /// The index's slot of each of `ids`, if held. Probes without a
    /// dependency between them, which the CPU runs side by side, each
    /// id's index line prefetched [`PREFETCH_AHEAD`] ids before its probe.
    fn slots_of(&self, ids: &[u64]) -> Vec<Option<u32>> {
        for &id in ids.iter().take(PREFETCH_AHEAD) {
            self.index.prefetch(id);
        }
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                if let Some(&ahead) = ids.get(i + PREFETCH_AHEAD) {
                    self.index.prefetch(ahead);
                }
                self.index.get(id)
            })
            .collect()
    }

    /// Ask the CPU to fetch the row at `slot`: its metadata and its first
    /// `floats` values. A slot that is no longer in the arena is skipped.
    fn prefetch_row(&self, slot: u32, floats: usize) {
        let (c, r) = self.locate(slot);
        let Some(chunk) = self.chunks.get(c) else { return };
        let Some(meta) = chunk.meta.get(r) else { return };
        prefetch(meta);
        if let Some(row) = chunk.floats().get(r * self.stride..r * self.stride + floats) {
            // One prefetch per 64-byte cache line (16 floats), and the last.
            row.iter().step_by(16).chain(row.last()).for_each(prefetch);
        }
    }

    /// (id, chunk, row) of every held row, in arena order.
    fn live_slots(&self) -> impl Iterator<Item = (u64, usize, usize)> + '_ {
        live_slots(&self.chunks)
    }

    /// A slot for a new row of `id`, indexed: a freed one, else the next
    /// one at the arena's end (a chunk pushed if the last is full). The
    /// caller writes the row with [`Chunk::put`] before taking another.
    fn take_slot(&mut self, id: u64) -> (usize, usize) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let (rows, stride) = (self.chunk_rows, self.stride);
                if self.chunks.last().is_none_or(|c| c.rows() >= rows) {
                    self.chunks.push(Arc::new(Chunk::with_capacity(rows, stride)));
                }
                let c = self.chunks.len() - 1;
                self.slot_of(c, self.chunks[c].rows())
            }
        };
        self.index.insert(id, slot);
        self.locate(slot)
    }

    fn free_slot(&mut self, id: u64, slot: u32) {
        self.freed += 1;
        self.index.remove(id);
        let (c, r) = self.locate(slot);
        Arc::make_mut(&mut self.chunks[c]).meta[r].count = 0;
        self.free.push(slot);
    }

    /// The table is full and a row must be created: drop the expired rows,
    /// then, if it is still full, evict the smallest keys down to
    /// `cap - max(1, cap / 32)` rows.
    ///
    /// The keys are selected in one pass over the arena that keeps only the
    /// `want` smallest seen so far (`want`: the most this call may evict),
    /// in a buffer of at most `2 * want` keys: about 2 bytes per row of the
    /// cap, where a key for every held row took 32.
    fn make_room_for_row(&mut self, now: u64) {
        let policy = self.spec.policy.clone();
        let want = batch_excess(self.index.len(), self.cap);
        let mut keys = std::mem::take(&mut self.scratch);
        let mut expired = Vec::new();
        let chunk_rows = self.chunk_rows;
        let all = live_slots(&self.chunks).filter_map(|(id, c, r)| {
            let chunk = &self.chunks[c];
            let RowMeta { seen, count, .. } = chunk.meta[r];
            // As `slot_of`: held slots fit in a u32.
            let slot = (c * chunk_rows + r) as u32;
            if policy.expired(seen, now) {
                expired.push((id, slot));
                return None;
            }
            // Unique keys (the id is in them): the rows evicted depend on
            // the content alone, not on the arena's order.
            let first = match policy.evict {
                Eviction::Lru => 0,
                Eviction::Lfu => u64::from(count),
            };
            Some((first, seen, id, slot))
        });
        smallest(all, want, &mut keys);
        self.counters.expired += expired.len() as u64;
        for (id, slot) in expired {
            self.free_slot(id, slot);
        }
        // At most `want`, and at most the keys kept: `smallest` keeps all
        // the keys, or `want` of them.
        let excess = batch_excess(self.index.len(), self.cap);
        if excess > 0 {
            keys.select_nth_unstable(excess - 1);
            for &(_, _, id, slot) in &keys[..excess] {
                self.free_slot(id, slot);
            }
            self.counters.evicted += excess as u64;
        }
        keys.clear();
        self.scratch = keys;
    }

    /// As [`make_room_for_row`](Self::make_room_for_row), for candidates.
    fn make_room_for_candidate(&mut self, now: u64) {
        let policy = self.spec.policy.clone();
        let before = self.candidates.len();
        self.candidates.retain(|_, &mut (_, seen)| !policy.expired(seen, now));
        self.counters.dropped_candidates += (before - self.candidates.len()) as u64;
        let excess = batch_excess(self.candidates.len(), self.cap);
        if excess > 0 {
            let all = self.candidates.iter().map(|(&id, &(count, seen))| match policy.evict {
                Eviction::Lru => (0, seen, id),
                Eviction::Lfu => (u64::from(count), seen, id),
            });
            let mut keys = Vec::new();
            smallest(all, excess, &mut keys);
            keys.select_nth_unstable(excess - 1);
            for &(_, _, id) in &keys[..excess] {
                self.candidates.remove(&id);
            }
            self.counters.dropped_candidates += excess as u64;
        }
    }
}

/// An eviction key and its row's slot: (count for LFU else 0, last seen,
/// id, slot). Unique, as the id is in it.
type RowKey = (u64, u64, u64, u32);

/// Leave in `buf` (cleared first) the `want` smallest of `keys`, which are
/// all distinct, among others (all of them if there are at most `want`),
/// in no order: what `select_nth_unstable(want - 1)` of all the keys puts
/// first, holding at most `2 * want` keys instead of all of them. Linear
/// time whatever the order of `keys`: each compaction of `2 * want` keys to
/// `want` takes O(want) and follows `want` pushes.
fn smallest<K: Ord + Copy>(keys: impl Iterator<Item = K>, want: usize, buf: &mut Vec<K>) {
    buf.clear();
    if want == 0 {
        return;
    }
    buf.reserve_exact(want.saturating_mul(2));
    let mut bound: Option<K> = None;
    for key in keys {
        // `want` kept keys are at most `bound`: a key above it is not among
        // the `want` smallest (and none equals it: the keys are distinct).
        if bound.is_some_and(|b| key >= b) {
            continue;
        }
        buf.push(key);
        if buf.len() >= want.saturating_mul(2) {
            buf.select_nth_unstable(want - 1);
            buf.truncate(want);
            bound = Some(buf[want - 1]);
        }
    }
}

/// How many of `held` entries to evict so that one more fits under `cap`:
/// none if there is room, else down to `cap - max(1, cap / 32)`.
fn batch_excess(held: usize, cap: usize) -> usize {
    if held < cap {
        0
    } else {
        held - (cap - (cap / 32).max(1))
    }
}

fn live_slots(chunks: &[Arc<Chunk>]) -> impl Iterator<Item = (u64, usize, usize)> + '_ {
    chunks.iter().enumerate().flat_map(|(c, chunk)| {
        chunk.meta.iter().enumerate().filter(|(_, m)| m.count > 0).map(move |(r, m)| (m.id, c, r))
    })
}

fn record(chunk: &Chunk, r: usize, id: u64, dim: usize, stride: usize) -> RowRecord<'_> {
    let (params, slots) = chunk.row(r, stride).split_at(dim);
    let RowMeta { step, count, seen, .. } = chunk.meta[r];
    RowRecord { id, params, step, slots, count, last_seen: seen }
}

/// A consistent copy of a [`SparseTable`] (see [`SparseTable::snapshot`]):
/// what a checkpoint writes and a catch-up streams, with no lock held.
#[derive(Clone)]
pub struct TableSnapshot {
    spec: TableSpec,
    seed: u64,
    state_slots: usize,
    stride: usize,
    chunks: Vec<Arc<Chunk>>,
    candidates: IdMap<(u32, u64)>,
    /// The candidates in id order, sorted at the first
    /// [`candidates_in`](TableSnapshot::candidates_in) (shared by clones).
    sorted: Arc<OnceLock<Vec<Candidate>>>,
    stats: TableStats,
}

impl fmt::Debug for TableSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TableSnapshot")
            .field("spec", &self.spec)
            .field("seed", &self.seed)
            .field("state_slots", &self.state_slots)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl TableSnapshot {
    /// The table's spec.
    pub fn spec(&self) -> &TableSpec {
        &self.spec
    }

    /// The seed of its rows' initial values.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Optimizer slots per row.
    pub fn state_slots(&self) -> usize {
        self.state_slots
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.stats.rows
    }

    /// The table's stats when the snapshot was taken.
    pub fn stats(&self) -> TableStats {
        self.stats
    }

    /// Every held row (expired ones not yet dropped included), in
    /// ascending id order, so that the same table always gives the same
    /// bytes whatever its layout (sorting costs the snapshot's reader,
    /// not the table).
    pub fn records(&self) -> impl Iterator<Item = RowRecord<'_>> + '_ {
        let mut live: Vec<(u64, usize, usize)> = live_slots(&self.chunks).collect();
        live.sort_unstable_by_key(|&(id, _, _)| id);
        let (dim, stride) = (self.spec.dim, self.stride);
        live.into_iter().map(move |(id, c, r)| record(&self.chunks[c], r, id, dim, stride))
    }

    /// The arena's chunks (each at most 4096 rows and 4 MiB of floats):
    /// what a catch-up cuts its row parts by.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Floats one row takes (values and optimizer slots).
    pub fn row_floats(&self) -> usize {
        self.stride
    }

    /// The held rows of chunks `chunks`, in the arena's order: positional
    /// access without the sort of [`records`](Self::records), for a
    /// catch-up that streams a large table part by part.
    pub fn records_in(&self, chunks: std::ops::Range<usize>) -> impl Iterator<Item = RowRecord<'_>> + '_ {
        let (dim, stride) = (self.spec.dim, self.stride);
        let start = chunks.start.min(self.chunks.len());
        let end = chunks.end.clamp(start, self.chunks.len());
        live_slots(&self.chunks[start..end])
            .map(move |(id, c, r)| record(&self.chunks[start + c], r, id, dim, stride))
    }

    /// The candidates held.
    pub fn candidate_count(&self) -> usize {
        self.candidates.len()
    }

    /// Candidates `range` of the ascending id order: positional access for
    /// a catch-up that streams a table's candidates part by part. They are
    /// sorted once, at the first call, for the snapshot and its clones (not
    /// for every part, as [`candidates`](Self::candidates) would).
    pub fn candidates_in(&self, range: std::ops::Range<usize>) -> impl Iterator<Item = Candidate> + '_ {
        let sorted = self.sorted.get_or_init(|| self.candidates().collect());
        let start = range.start.min(sorted.len());
        let end = range.end.clamp(start, sorted.len());
        sorted[start..end].iter().copied()
    }

    /// Every candidate, in ascending id order.
    pub fn candidates(&self) -> impl Iterator<Item = Candidate> + '_ {
        let mut all: Vec<Candidate> = self
            .candidates
            .iter()
            .map(|(&id, &(count, last_seen))| Candidate { id, count, last_seen })
            .collect();
        all.sort_unstable_by_key(|c| c.id);
        all.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::{Adam, Sgd};

    fn table(policy: RowPolicy) -> SparseTable {
        let spec = TableSpec { policy, ..TableSpec::new("emb", 4, Init::Uniform { low: -1.0, high: 1.0 }) };
        SparseTable::new(spec, 7, 2).unwrap()
    }

    fn row(t: &SparseTable, id: u64, now: u64) -> Vec<f32> {
        let mut out = vec![0.0; t.spec().dim];
        t.gather(&[id], now, &mut out);
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// A row as bits: id, params, step, slots, count, last_seen.
    type RowBits = (u64, Vec<u32>, u64, Vec<u32>, u32, u64);

    /// Everything a table holds, to check that something changed nothing.
    fn everything(t: &SparseTable) -> (TableStats, Vec<RowBits>, Vec<Candidate>) {
        let snap = t.snapshot();
        let rows = snap
            .records()
            .map(|r| (r.id, bits(r.params), r.step, bits(r.slots), r.count, r.last_seen))
            .collect();
        (snap.stats(), rows, snap.candidates().collect())
    }

    #[test]
    fn init_row_depends_only_on_seed_table_and_id() {
        let spec = TableSpec::new("emb", 16, Init::Normal { mean: 0.5, std: 2.0 });
        let mut a = vec![0.0; 16];
        let mut b = vec![0.0; 16];
        init_row(&spec, 3, 42, &mut a);
        init_row(&spec, 3, 42, &mut b);
        assert_eq!(bits(&a), bits(&b));
        // The policy does not matter; the id, the table and the seed do.
        let capped =
            TableSpec { policy: RowPolicy { max_rows: Some(5), ..RowPolicy::default() }, ..spec.clone() };
        init_row(&capped, 3, 42, &mut b);
        assert_eq!(bits(&a), bits(&b));
        init_row(&spec, 3, 43, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        init_row(&TableSpec { name: "emb2".into(), ..spec.clone() }, 3, 42, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        init_row(&spec, 4, 42, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        // The elements of a row are not all equal, and a table's rows are what gather reads.
        assert!(a.windows(2).any(|w| w[0] != w[1]));
        let t = SparseTable::new(spec.clone(), 3, 0).unwrap();
        let mut g = vec![0.0; 32];
        t.gather(&[42, 43], 0, &mut g);
        init_row(&spec, 3, 43, &mut b);
        assert_eq!(bits(&g[..16]), bits(&a));
        assert_eq!(bits(&g[16..]), bits(&b));
        // Uniform rows stay in their half-open range.
        let uni = TableSpec::new("u", 64, Init::Uniform { low: -0.1, high: 0.3 });
        let mut out = vec![0.0; 64];
        for id in 0..50 {
            init_row(&uni, 1, id, &mut out);
            assert!(out.iter().all(|x| (-0.1..0.3).contains(x)), "{out:?}");
        }
        init_row(&TableSpec::new("c", 3, Init::Constant(2.5)), 1, 9, &mut out[..3]);
        assert_eq!(&out[..3], &[2.5; 3]);
    }

    #[test]
    fn row_shard_is_in_range_and_spread() {
        assert_eq!(row_shard("emb", 5, 0), 0);
        assert_eq!(row_shard("emb", 5, 1), 0);
        let shards = 7;
        let mut per = [0usize; 7];
        for id in 0..70_000u64 {
            let s = row_shard("emb", id, shards);
            assert!(s < shards);
            per[s as usize] += 1;
        }
        assert!(per.iter().all(|&n| (9_500..=10_500).contains(&n)), "{per:?}");
        // Another table places the same ids elsewhere.
        let moved = (0..1000u64).filter(|&id| row_shard("emb", id, 64) != row_shard("user", id, 64)).count();
        assert!(moved > 900, "{moved}");
        assert_eq!(row_shard("emb", u64::MAX, u32::MAX), row_shard("emb", u64::MAX, u32::MAX));
    }

    #[test]
    fn check_rejects_bad_pushes_and_changes_nothing() {
        let sgd = Sgd { lr: 0.5 };
        let mut t = table(RowPolicy::default());
        t.apply(&[1, 2], &[1.0; 8], 1, &sgd);
        let before = everything(&t);
        let msg = |r: Result<()>| r.unwrap_err().to_string();

        let e = t.check(&[1, 2, 3], &[0.0; 11]);
        assert!(matches!(e, Err(Error::RowGradLength { expected: 12, got: 11, .. })), "{e:?}");
        let m = msg(e);
        assert!(m.contains("\"emb\"") && m.contains("12") && m.contains("11"), "{m}");

        let mut g = vec![0.0; 12];
        g[6] = f32::NAN;
        let e = t.check(&[1, 9, 3], &g);
        assert!(matches!(e, Err(Error::RowNonFinite { id: 9, index: 2, .. })), "{e:?}");
        let m = msg(e);
        assert!(
            m.contains("\"emb\"") && m.contains("row 9") && m.contains("index 2") && m.contains("NaN"),
            "{m}"
        );
        g[6] = f32::NEG_INFINITY;
        assert!(matches!(t.check(&[1, 9, 3], &g), Err(Error::RowNonFinite { id: 9, index: 2, .. })));

        let e = t.check(&[5, 6, 5], &[0.0; 12]);
        assert!(matches!(e, Err(Error::DuplicateRow { id: 5, .. })), "{e:?}");
        assert!(msg(e).contains("row 5"));

        let many = vec![0u64; MAX_ROWS_PER_CALL + 1];
        let e = t.check(&many, &[]);
        assert!(matches!(e, Err(Error::TooManyRows { max: MAX_ROWS_PER_CALL, .. })), "{e:?}");
        assert!(msg(e).contains(&MAX_ROWS_PER_CALL.to_string()));

        assert!(t.check(&[], &[]).is_ok());
        assert!(t.check(&[4, 1], &[0.5; 8]).is_ok());
        assert_eq!(everything(&t), before);
    }

    #[test]
    fn spec_and_slots_are_validated() {
        let ok = TableSpec::new("emb", 8, Init::Zeros);
        assert!(ok.validate().is_ok());
        let policy = |p: RowPolicy| TableSpec { policy: p, ..ok.clone() };
        let bad = [
            TableSpec { name: String::new(), ..ok.clone() },
            TableSpec { dim: 0, ..ok.clone() },
            TableSpec { dim: MAX_DIM + 1, ..ok.clone() },
            TableSpec { init: Init::Normal { mean: 0.0, std: -1.0 }, ..ok.clone() },
            TableSpec { init: Init::Uniform { low: 0.0, high: f32::NAN }, ..ok.clone() },
            policy(RowPolicy { expire_after: Some(0), ..RowPolicy::default() }),
            policy(RowPolicy { max_rows: Some(0), ..RowPolicy::default() }),
        ];
        for spec in bad {
            let e = SparseTable::new(spec.clone(), 0, 0);
            assert!(matches!(e, Err(Error::BadTable { .. })), "{spec:?}: {e:?}");
        }
        let e = SparseTable::new(ok.clone(), 0, MAX_STATE_SLOTS + 1).unwrap_err().to_string();
        assert!(e.contains("emb") && e.contains("slots"), "{e}");
        let m = TableSpec { dim: 0, ..ok.clone() }.validate().unwrap_err().to_string();
        assert!(m.contains("emb") && m.contains("dim 0"), "{m}");
        assert!(SparseTable::new(TableSpec { dim: MAX_DIM, ..ok }, 0, MAX_STATE_SLOTS).is_ok());
    }

    #[test]
    fn admission_expiry_and_counts() {
        let sgd = Sgd { lr: 1.0 };
        let policy = RowPolicy { admit_after: 2, expire_after: Some(3), ..RowPolicy::default() };
        let mut t = table(policy);
        let init = row(&t, 5, 0);
        // First sighting: a candidate, gradient dropped.
        t.apply(&[5], &[1.0; 4], 1, &sgd);
        assert_eq!((t.len(), t.stats().candidates), (0, 1));
        assert_eq!(bits(&row(&t, 5, 1)), bits(&init));
        // Second: admitted, and updated from its initial value.
        t.apply(&[5], &[1.0; 4], 2, &sgd);
        assert_eq!((t.len(), t.stats().candidates, t.stats().admitted), (1, 0, 1));
        let r = t.row(5, 2).unwrap();
        assert_eq!((r.count, r.last_seen, r.step), (2, 2, 1));
        assert!(r.params.iter().zip(&init).all(|(p, i)| *p == *i - 1.0));
        // Expired at 2 + 3: reads give the initial value, nothing changed.
        assert!(t.row(5, 4).is_some());
        assert_eq!(bits(&row(&t, 5, 5)), bits(&init));
        assert_eq!(t.len(), 1);
        // A push then counts from zero again: a candidate.
        t.apply(&[5], &[1.0; 4], 5, &sgd);
        assert_eq!((t.len(), t.stats().candidates, t.stats().expired), (0, 1, 1));
        // A sweep drops the expired candidate.
        t.sweep(7);
        assert_eq!(t.stats().candidates, 1);
        t.sweep(8);
        assert_eq!((t.stats().candidates, t.stats().dropped_candidates), (0, 1));
    }

    #[test]
    fn apply_sweeps_expired_rows_away_by_itself() {
        let sgd = Sgd { lr: 1.0 };
        let mut t = table(RowPolicy { expire_after: Some(3), ..RowPolicy::default() });
        t.apply(&[1, 2, 3], &[1.0; 12], 1, &sgd);
        assert_eq!(t.len(), 3);
        // Long after they expired, a push of another id reclaims them.
        t.apply(&[9], &[1.0; 4], 1 + 3 + SWEEP_EVERY, &sgd);
        assert_eq!((t.len(), t.stats().expired), (1, 3));
    }

    #[test]
    fn restore_row_checks_before_changing_anything() {
        let adam = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        let mut t = table(RowPolicy { max_rows: Some(2), ..RowPolicy::default() });
        t.apply(&[1, 2], &[0.5; 8], 3, &adam);
        let before = everything(&t);
        let p = [0.0f32; 4];
        let s = [0.0f32; 8];
        let good = RowRecord { id: 9, params: &p, step: 1, slots: &s, count: 1, last_seen: 3 };
        for bad in [
            RowRecord { params: &p[..3], ..good },
            RowRecord { slots: &s[..7], ..good },
            RowRecord { count: 0, ..good },
            good, // over the cap of 2
        ] {
            let e = t.restore_row(bad);
            assert!(matches!(e, Err(Error::RestoreRow { id: 9, .. })), "{bad:?}: {e:?}");
        }
        let c = Candidate { id: 1, count: 1, last_seen: 0 };
        assert!(matches!(t.restore_candidate(c), Err(Error::RestoreRow { id: 1, .. })));
        assert!(t.restore_candidate(Candidate { count: 0, id: 4, ..c }).is_err());
        assert_eq!(everything(&t), before);
        // Replacing a held row is fine.
        assert!(t.restore_row(RowRecord { id: 2, ..good }).is_ok());
        assert_eq!(t.row(2, 3).map(|r| (r.step, r.params.to_vec())), Some((1, p.to_vec())));
        // So is a row of a diverged model: restored as it was.
        let nan = [0.0, f32::NAN, f32::NEG_INFINITY, 0.0];
        let inf = [f32::INFINITY; 8];
        t.restore_row(RowRecord { id: 2, params: &nan, slots: &inf, ..good }).unwrap();
        let row = t.row(2, 3).map(|r| (bits(r.params), bits(r.slots)));
        assert_eq!(row, Some((bits(&nan), bits(&inf))));
        // A snapshot of another table does not fit.
        let other = SparseTable::new(TableSpec::new("other", 4, Init::Zeros), 7, 2).unwrap();
        assert!(matches!(t.restore(&other.snapshot()), Err(Error::BadTable { .. })));
    }

    #[test]
    fn smallest_keeps_what_a_sort_puts_first() {
        let mut rng = SplitMix64::new(5);
        let ascending: Vec<u64> = (0..1000).collect();
        let descending: Vec<u64> = (0..1000).rev().collect();
        let mut shuffled = ascending.clone();
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut buf = vec![7, 7, 7];
        for keys in [&shuffled, &ascending, &descending] {
            for want in [0, 1, 2, 3, 31, 100, 300, 500, 999, 1000, 5000] {
                smallest(keys.iter().copied(), want, &mut buf);
                // The `want` smallest are all kept, in at most `2 * want`.
                assert!(buf.len() < 2 * want.max(1), "want {want}: {} kept", buf.len());
                let mut kept = buf.clone();
                kept.sort_unstable();
                let n = want.min(keys.len());
                assert_eq!(kept[..n], ascending[..n], "want {want}");
                assert!(kept.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }

    /// A capped table under a long stream of new ids: the index keeps the
    /// entries reserved for the cap (never grown), the
    /// eviction keys stay within `2 * max(1, cap / 32)`, and every held row
    /// is found by its id.
    #[test]
    fn eviction_keeps_the_index_and_scratch_small() {
        let sgd = Sgd { lr: 0.5 };
        let cap = 3000;
        for evict in [Eviction::Lru, Eviction::Lfu] {
            let mut t = table(RowPolicy { max_rows: Some(cap), evict, ..RowPolicy::default() });
            let room = t.index.capacity();
            assert!(room >= cap);
            let mut rng = SplitMix64::new(9);
            let mut ids = Vec::new();
            for now in 0..400u64 {
                // 100 new ids, and up to 100 of a hot set of 500 (counts for LFU).
                ids.clear();
                ids.extend((0..100).map(|i| 1_000_000 + now * 100 + i));
                for _ in 0..100 {
                    let hot = rng.next_u64() % 500;
                    if !ids.contains(&hot) {
                        ids.push(hot);
                    }
                }
                t.apply(&ids, &vec![1.0; ids.len() * 4], now, &sgd);
                assert!(t.len() <= cap);
            }
            let stats = t.stats();
            assert!(stats.evicted > 10 * cap as u64, "{stats:?}");
            // The index has the room reserved for the cap, no more.
            assert_eq!(t.index.capacity(), room, "{evict:?}: the index grew");
            assert!(t.scratch.capacity() <= 2 * (cap / 32), "{}", t.scratch.capacity());
            let snap = t.snapshot();
            assert_eq!(snap.records().count(), t.len());
            for r in snap.records() {
                assert_eq!(t.row(r.id, 399).map(|x| x.params), Some(r.params), "row {}", r.id);
            }
        }
    }

    /// `apply` looks a push's slots up once, before the first update. A
    /// row admitted on the way (a repeated id, which `check` refuses but
    /// `apply` takes) or evicted on the way (an id later in the same push,
    /// its slot then given to the new row) must not be updated by its stale
    /// slot: each push gives what its ids applied one call at a time give.
    #[test]
    fn rows_admitted_or_evicted_within_a_push_are_looked_up_again() {
        let sgd = Sgd { lr: 0.5 };
        let capped = RowPolicy { max_rows: Some(4), evict: Eviction::Lru, ..RowPolicy::default() };
        // id 1 is the least recent row; admitting 10 evicts it and reuses its slot.
        let cases: [(RowPolicy, &[u64]); 3] =
            [(RowPolicy::default(), &[4, 4, 5, 4]), (capped.clone(), &[10, 1]), (capped, &[10, 2, 1, 11, 3])];
        for (policy, push) in cases {
            let (mut whole, mut one_by_one) = (table(policy.clone()), table(policy));
            for (now, id) in [(0, 1), (1, 2), (2, 3), (3, 4)] {
                whole.apply(&[id], &[1.0; 4], now, &sgd);
                one_by_one.apply(&[id], &[1.0; 4], now, &sgd);
            }
            let grads: Vec<f32> = (0..push.len() * 4).map(|i| i as f32 * 0.25).collect();
            whole.apply(push, &grads, 9, &sgd);
            for (&id, grad) in push.iter().zip(grads.chunks_exact(4)) {
                one_by_one.apply(&[id], grad, 9, &sgd);
            }
            assert_eq!(everything(&whole), everything(&one_by_one), "push {push:?}");
        }
    }

    /// Rows wide enough that a chunk holds 64 of them: eviction, slot
    /// reuse and snapshots across many chunks.
    #[test]
    fn many_chunks_round_trip() {
        let sgd = Sgd { lr: 0.25 };
        let dim = 1 << 14;
        let spec = TableSpec {
            policy: RowPolicy { max_rows: Some(150), ..RowPolicy::default() },
            ..TableSpec::new("wide", dim, Init::Normal { mean: 0.0, std: 1.0 })
        };
        let mut t = SparseTable::new(spec.clone(), 1, 0).unwrap();
        assert_eq!(t.chunk_rows, 64);
        let mut want: HashMap<u64, (u64, Vec<f32>)> = HashMap::new();
        for now in 0..4u64 {
            let ids: Vec<u64> = (0..60).map(|i| now * 40 + i).collect();
            let grads = vec![1.0; ids.len() * dim];
            t.check(&ids, &grads).unwrap();
            t.apply(&ids, &grads, now, &sgd);
            for &id in &ids {
                let e = want.entry(id).or_insert_with(|| {
                    let mut v = vec![0.0; dim];
                    init_row(&spec, 1, id, &mut v);
                    (now, v)
                });
                e.0 = now;
                e.1.iter_mut().for_each(|p| *p -= 0.25);
            }
            // LRU with batches of max(1, 150/32) = 4 rows.
            while want.len() > 150 {
                let mut keys: Vec<(u64, u64)> = want.iter().map(|(&id, &(seen, _))| (seen, id)).collect();
                keys.sort();
                for (_, id) in keys.into_iter().take(4) {
                    want.remove(&id);
                }
            }
        }
        let snap = t.snapshot();
        let mut back = SparseTable::new(spec, 1, 0).unwrap();
        back.restore(&snap).unwrap();
        assert_eq!(everything(&back), everything(&t));
        assert_eq!(t.len(), want.len());
        let mut out = vec![0.0; dim];
        for id in 0..200u64 {
            back.gather(&[id], 3, &mut out);
            match want.get(&id) {
                Some((_, v)) => assert_eq!(bits(&out), bits(v), "row {id}"),
                None => assert!(t.row(id, 3).is_none(), "row {id}"),
            }
        }
    }
}
