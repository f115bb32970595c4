//! Replication's core, without I/O (`docs/DESIGN.md` §6): what a primary
//! keeps for each follower ([`Links`]), what a follower does with what its
//! primary forwards ([`Follower`]), and how a new replica catches up
//! ([`CatchUp`]).
//!
//! **Forwarding.** The primary numbers the updates it applies to a shard,
//! 1, 2, 3, ..., and forwards each ([`Forwarded`]) to every follower in that
//! order: in async mode each push as it applied it (so the followers keep
//! the same deduplication table, and a push retried to a new primary is
//! applied once), in sync mode each completed step's combined gradient
//! (replication after aggregation: one message a step, not one a trainer),
//! and in both each trainer that joined or left. A [`Follower`] applies
//! update `n` only after `n - 1`: an update it has is a duplicate (no
//! change); a gap, a wrong shard, an older map or another primary's epoch
//! is an error that names it, and changes nothing. Applying the same
//! updates in the same order with the same optimizer gives the same state,
//! bit for bit, so a follower can become primary at any update it has.
//!
//! **Acknowledging.** [`Links::replicated`] is the last update every
//! follower of the map holds; the shell answers a client only once it
//! covers what the answer depends on (strong mode). A follower that has not
//! synced yet holds nothing, so it holds acknowledgements back until it
//! has: a replica set never acknowledges an update one of its members may
//! lack, and so any follower can take over without losing one.
//!
//! **Epochs.** Each primary has an epoch, the shard map version that made
//! it primary. Every replica keeps its [`History`]: the epochs its updates
//! came from, with the first update of each. A follower applies only its
//! own primary's updates, so two replicas that hold updates up to `n` of
//! the same epoch hold the same updates; after a failover the new primary
//! tells from a follower's last epoch and applied count whether it holds a
//! prefix of the new primary's updates ([`Links::sync`]) and can go on from
//! there, or must catch up from a snapshot.
//!
//! **Catching up.** A new, restarted or diverged replica ([`CatchUp`])
//! starts from a snapshot the primary takes at update `upto`
//! (copy-on-write: pushes go on meanwhile), sent in [`SnapshotPart`]s in any
//! order, while the updates after `upto` keep coming and are kept aside.
//! Once every block has come, [`CatchUp::finish`] applies the kept updates
//! in order and the replica is a follower. The same path moves a shard to
//! another pserver.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::block::BlockId;
use crate::error::{Error, Result};
use crate::optimizer::OptimizerState;
use crate::shard_map::PserverId;
use crate::store::{CompletedStep, Mode, ParamStore, Push, PushOutcome, StoreSnapshot};

/// The epochs a replica's updates came from: `(epoch, first update)` pairs,
/// both rising. Update `n` came from the last epoch whose first update is
/// at most `n`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History(Vec<(u64, u64)>);

impl History {
    /// A history whose updates from `first` on come from `epoch`.
    pub fn starting(epoch: u64, first: u64) -> History {
        History(vec![(epoch, first)])
    }

    /// A history from its `(epoch, first update)` pairs, as a primary sent
    /// them; errors unless both rise.
    pub fn from_epochs(epochs: Vec<(u64, u64)>) -> Result<History> {
        if let Some(w) = epochs.windows(2).find(|w| w[1].0 <= w[0].0 || w[1].1 <= w[0].1) {
            return Err(Error::Replication(format!(
                "a history's epochs and first updates must rise: ({}, {}) then ({}, {})",
                w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
        Ok(History(epochs))
    }

    /// The epoch of the primary this replica follows or is (0: none yet).
    pub fn last_epoch(&self) -> u64 {
        self.0.last().map_or(0, |&(epoch, _)| epoch)
    }

    /// The `(epoch, first update)` pairs.
    pub fn epochs(&self) -> &[(u64, u64)] {
        &self.0
    }

    /// From update `first` on, updates come from `epoch` (a newer one).
    /// Entries of later updates (undone by this one) are dropped.
    pub fn begin(&mut self, epoch: u64, first: u64) {
        self.0.retain(|&(_, f)| f < first);
        if self.last_epoch() != epoch {
            self.0.push((epoch, first));
        }
    }

    /// Whether a replica holding updates `1..=applied`, the last of them
    /// from epoch `epoch` (or synced with that epoch's primary), holds a
    /// prefix of the updates `1..=seq` this history describes. Never for a
    /// replica without an epoch: it catches up from a snapshot, whatever
    /// its store holds.
    pub fn holds_prefix(&self, epoch: u64, applied: u64, seq: u64) -> bool {
        let Some(at) = self.0.iter().position(|&(e, _)| e == epoch) else { return false };
        let first = self.0[at].1;
        let end = self.0.get(at + 1).map_or(seq, |&(_, next)| next - 1);
        first.saturating_sub(1) <= applied && applied <= end.min(seq)
    }
}

/// One update as a primary forwards it.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    /// Async: a push the primary applied (or took as applied before, see
    /// [`PushOutcome::AppliedBefore`]), as it came.
    Push(Push),
    /// A trainer joined the barrier.
    Join(String),
    /// A trainer left: sync, the barrier stops waiting for it; async, its
    /// half-taken push is dropped, which changes how a retry of it is
    /// deduplicated.
    Leave(String),
    /// Sync: a step the primary completed.
    Step(CompletedStep),
}

/// Update number `seq` of shard `shard`, from the primary of epoch `epoch`,
/// under shard map `map_version`.
#[derive(Clone, Debug, PartialEq)]
pub struct Forwarded {
    /// The logical shard.
    pub shard: u32,
    /// The version of the shard map the primary serves under.
    pub map_version: u64,
    /// The primary's epoch.
    pub epoch: u64,
    /// The update's number in the shard's sequence, from 1.
    pub seq: u64,
    /// The update.
    pub update: Update,
}

/// What a follower did with a forwarded update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Applied: the follower holds it now.
    Applied,
    /// Held already (a retried forward): nothing changed.
    Duplicate,
}

/// Apply `update` to `store`: what a primary does with a join or leave, and
/// a follower with any update. Errors leave the store unchanged.
pub fn apply_update(store: &mut ParamStore, update: Update) -> Result<()> {
    match update {
        Update::Push(push) => match store.push(push)? {
            // Applied before: the primary found the same (it forwards such
            // pushes so that the replicas record the trainer's seq too).
            PushOutcome::Applied { .. } | PushOutcome::Buffered { .. } | PushOutcome::AppliedBefore => Ok(()),
            PushOutcome::Duplicate => Err(Error::Replication(
                "a forwarded push was one the replica had already taken: it has drifted from its primary"
                    .into(),
            )),
        },
        Update::Join(trainer) => {
            store.join(&trainer);
            Ok(())
        }
        Update::Leave(trainer) => {
            store.leave(&trainer);
            Ok(())
        }
        Update::Step(step) => store.apply_step(step),
    }
}

/// A replica kept up to date by its primary.
#[derive(Debug)]
pub struct Follower {
    shard: u32,
    map_version: u64,
    applied: u64,
    history: History,
    store: ParamStore,
}

impl Follower {
    /// A follower of `shard` whose `store` holds updates `1..=applied`, which
    /// came from the epochs of `history`.
    pub fn new(shard: u32, map_version: u64, applied: u64, history: History, store: ParamStore) -> Follower {
        Follower { shard, map_version, applied, history, store }
    }

    /// The shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The last update applied: what an election compares.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The newest shard map version seen.
    pub fn map_version(&self) -> u64 {
        self.map_version
    }

    /// The epochs its updates came from.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// The replica's store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// A newer shard map was seen: updates under older ones are refused
    /// from now on (a primary that did not see it may have been deposed).
    pub fn saw_map(&mut self, map_version: u64) {
        self.map_version = self.map_version.max(map_version);
    }

    /// The primary of `epoch` found this replica holds a prefix of its
    /// updates ([`Links::sync`]): follow it from the next update on.
    pub fn resume(&mut self, epoch: u64) {
        self.history.begin(epoch, self.applied + 1);
    }

    /// The store and history, to serve as the shard's primary of `epoch`
    /// (after an election): its own updates start after the last applied.
    pub fn promote(mut self, epoch: u64) -> (ParamStore, u64, History) {
        self.history.begin(epoch, self.applied + 1);
        (self.store, self.applied, self.history)
    }

    /// Apply update `forwarded.seq` if it is the next one; see the
    /// [module docs](self) for the checks. Nothing changes on an error.
    pub fn apply(&mut self, forwarded: Forwarded) -> Result<Applied> {
        let Forwarded { shard, map_version, epoch, seq, update } = forwarded;
        if shard != self.shard {
            return Err(Error::Replication(format!(
                "update {seq} is for shard {shard}, this replica holds shard {}",
                self.shard
            )));
        }
        if map_version < self.map_version {
            return Err(Error::Replication(format!(
                "update {seq} of shard {shard} comes under shard map version {map_version}, older than {} \
                 (from a deposed primary?)",
                self.map_version
            )));
        }
        if epoch != self.history.last_epoch() {
            return Err(Error::Replication(format!(
                "update {seq} of shard {shard} comes from the primary of epoch {epoch}, but this replica \
                 follows epoch {}: it must sync with a new primary first",
                self.history.last_epoch()
            )));
        }
        if seq <= self.applied {
            return Ok(Applied::Duplicate);
        }
        check_mode(self.store.mode(), &update)?;
        if seq != self.applied + 1 {
            return Err(Error::Replication(format!(
                "update {seq} of shard {shard} leaves a gap: this replica has applied up to {}",
                self.applied
            )));
        }
        apply_update(&mut self.store, update)
            .map_err(|e| Error::Replication(format!("update {seq} of shard {shard} does not apply: {e}")))?;
        self.applied = seq;
        self.map_version = map_version;
        Ok(Applied::Applied)
    }
}

/// Part of a primary's snapshot of a shard at update `upto`.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotPart {
    /// The logical shard.
    pub shard: u32,
    /// The shard map version the snapshot was taken under.
    pub map_version: u64,
    /// The last update the snapshot holds.
    pub upto: u64,
    /// The store's step in the snapshot.
    pub step: u64,
    /// The pushes the store had applied ([`crate::ParamStore::pushes`]).
    pub pushes: u64,
    /// Sync: the barrier's members ([`crate::StoreSnapshot::members`]).
    pub members: Vec<String>,
    /// Some of the shard's blocks: parameters and optimizer state.
    pub blocks: Vec<(BlockId, Vec<f32>, OptimizerState)>,
    /// The deduplication table (trainer, last seq): every part carries it.
    pub last_seqs: Vec<(String, u64)>,
    /// The origins applied ([`crate::origin`]): every part carries them.
    pub origins: crate::AppliedOrigins,
    /// How many row parts the snapshot has (every part says it).
    pub row_parts: u32,
    /// A row part's rows of one sparse table.
    pub rows: Option<RowChunk>,
    /// Pushes in parts half taken ([`StoreSnapshot::half_pushes`]): every
    /// part carries them.
    pub half_pushes: Vec<(String, Vec<bool>)>,
}

/// A sparse table's row as a snapshot part carries it: (id, values,
/// optimizer step, slots, sightings, last push's step).
pub type OwnedRow = (u64, Vec<f32>, u64, Vec<f32>, u32, u64);

/// Rows of one sparse table in a snapshot part.
#[derive(Clone, Debug, PartialEq)]
pub struct RowChunk {
    /// The table's index.
    pub table: u32,
    /// Which row part, from 0.
    pub index: u32,
    /// The rows.
    pub rows: Vec<OwnedRow>,
    /// Admission candidates (in the table's first part).
    pub candidates: Vec<crate::sparse::Candidate>,
    /// Life counters (in the table's first part).
    pub stats: Option<crate::sparse::TableStats>,
}

/// Cut `snapshot`, taken at update `upto`, into parts of at most
/// `max_floats` parameter and state values each (a larger block alone).
pub fn snapshot_parts(
    snapshot: &StoreSnapshot,
    shard: u32,
    map_version: u64,
    upto: u64,
    max_floats: usize,
) -> Vec<SnapshotPart> {
    let last_seqs: Vec<(String, u64)> = snapshot.last_seqs().map(|(t, s)| (t.to_string(), s)).collect();
    let part = |blocks| SnapshotPart {
        shard,
        map_version,
        upto,
        step: snapshot.step(),
        pushes: snapshot.pushes(),
        members: snapshot.members().to_vec(),
        blocks,
        last_seqs: last_seqs.clone(),
        origins: snapshot.origins().clone(),
        row_parts: 0,
        rows: None,
        half_pushes: snapshot.half_pushes().to_vec(),
    };
    let (mut parts, mut blocks, mut floats) = (Vec::new(), Vec::new(), 0usize);
    for (id, params, state) in snapshot.blocks() {
        let size = params.len() + state.slots.len();
        if !blocks.is_empty() && floats + size > max_floats {
            parts.push(part(std::mem::take(&mut blocks)));
            floats = 0;
        }
        blocks.push((id, params.to_vec(), state.clone()));
        floats += size;
    }
    if !blocks.is_empty() || parts.is_empty() {
        parts.push(part(blocks));
    }
    parts
}

/// A replica catching up (state `syncing`): the snapshot's parts fill a
/// fresh store, the updates after the snapshot are kept aside.
#[derive(Debug)]
pub struct CatchUp {
    shard: u32,
    /// The map the snapshot was taken under.
    snapshot_map: u64,
    /// The newest map seen since.
    map_version: u64,
    upto: u64,
    history: History,
    store: ParamStore,
    missing: BTreeSet<BlockId>,
    /// Row parts: how many the snapshot has (once a part said), and which came.
    row_parts: Option<u32>,
    rows_seen: BTreeSet<u32>,
    step: Option<u64>,
    kept: BTreeMap<u64, Forwarded>,
}

/// The most updates a catching-up replica keeps aside: past it the
/// snapshot is too far behind, and the catch-up starts again.
pub const MAX_KEPT_UPDATES: usize = 10_000;

impl CatchUp {
    /// Catch up shard `shard` from a snapshot at update `upto` (under map
    /// `map_version`) into `store`, a fresh store of that shard; `history`
    /// is the primary's, which the replica takes on.
    pub fn new(shard: u32, map_version: u64, upto: u64, history: History, store: ParamStore) -> CatchUp {
        let missing = store.block_ids().collect();
        CatchUp {
            shard,
            snapshot_map: map_version,
            map_version,
            upto,
            history,
            store,
            missing,
            row_parts: None,
            rows_seen: BTreeSet::new(),
            step: None,
            kept: BTreeMap::new(),
        }
    }

    /// The shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The update the snapshot was taken at.
    pub fn upto(&self) -> u64 {
        self.upto
    }

    /// The epoch of the primary it catches up from.
    pub fn epoch(&self) -> u64 {
        self.history.last_epoch()
    }

    /// Blocks still to come.
    pub fn missing(&self) -> usize {
        self.missing.len()
    }

    /// Take one part of the snapshot (in any order; a part that comes
    /// twice is taken twice, to the same effect). Errors name what does not
    /// fit: the shard, the snapshot (`upto`, map version, step), a block
    /// this store does not hold or of the wrong length.
    pub fn part(&mut self, part: SnapshotPart) -> Result<()> {
        let SnapshotPart {
            shard,
            map_version,
            upto,
            step,
            pushes,
            members,
            blocks,
            last_seqs,
            origins,
            row_parts,
            rows,
            half_pushes,
        } = part;
        if shard != self.shard || upto != self.upto || map_version != self.snapshot_map {
            return Err(Error::Replication(format!(
                "a snapshot part of shard {shard} at update {upto} (map {map_version}) does not belong to \
                 the catch-up of shard {} from update {} (map {})",
                self.shard, self.upto, self.snapshot_map
            )));
        }
        if self.step.is_some_and(|s| s != step) {
            return Err(Error::Replication(format!(
                "snapshot parts of shard {shard} disagree on its step: {step} and {}",
                self.step.unwrap_or_default()
            )));
        }
        // Checked whole before any block is restored.
        let half_pushes = half_pushes
            .into_iter()
            .map(|(trainer, taken)| {
                let seq = last_seqs.iter().find(|(t, _)| *t == trainer).map(|(_, s)| *s);
                match seq {
                    Some(seq) if taken.len() == self.store.units() => Ok((trainer, seq, taken)),
                    _ => Err(Error::Replication(format!(
                        "shard {shard}: a snapshot part's half-taken push of {trainer} has {} flags for {} \
                         units, and seq {seq:?}",
                        taken.len(),
                        self.store.units()
                    ))),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        for (id, params, state) in &blocks {
            if !self.store.block_ids().any(|b| b == *id) {
                return Err(Error::Replication(format!(
                    "snapshot part holds block {id}, not of shard {shard}"
                )));
            }
            let len = self.store.block_len(*id)?;
            let slots = self.store.optimizer().state_slots() * len;
            if params.len() != len || state.slots.len() != slots {
                return Err(Error::Replication(format!(
                    "snapshot part's block {id} has {} values and {} state slots, expected {len} and {slots}",
                    params.len(),
                    state.slots.len()
                )));
            }
        }
        if self.row_parts.is_some_and(|n| n != row_parts) {
            return Err(Error::Replication(format!(
                "snapshot parts of shard {shard} disagree on their row parts"
            )));
        }
        for (id, params, state) in blocks {
            self.store.restore_block(id, params, state)?;
            self.missing.remove(&id);
        }
        self.row_parts = Some(row_parts);
        if let Some(chunk) = rows {
            if chunk.index >= row_parts {
                return Err(Error::Replication(format!(
                    "shard {shard}: row part {} of a snapshot of {row_parts}",
                    chunk.index
                )));
            }
            // A part that comes twice restores the same rows again.
            let table = self.store.table_mut(chunk.table)?;
            for (id, params, step, slots, count, last_seen) in &chunk.rows {
                let row = crate::sparse::RowRecord {
                    id: *id,
                    params,
                    step: *step,
                    slots,
                    count: *count,
                    last_seen: *last_seen,
                };
                table.restore_row(row)?;
            }
            for c in chunk.candidates {
                table.restore_candidate(c)?;
            }
            if let Some(stats) = chunk.stats {
                table.restore_counters(&stats);
            }
            self.rows_seen.insert(chunk.index);
        }
        for (trainer, seq) in &last_seqs {
            self.store.restore_last_seq(trainer, *seq);
        }
        // After the dedup table, which counts a restored seq as whole.
        for (trainer, seq, taken) in half_pushes {
            self.store.restore_half_push(&trainer, seq, taken)?;
        }
        self.store.restore_origins(&origins);
        if self.step.is_none() {
            self.store.set_step(step);
            self.store.set_pushes(pushes);
            for member in &members {
                self.store.join(member);
            }
            self.step = Some(step);
        }
        Ok(())
    }

    /// An update the primary forwarded meanwhile: kept if it is after the
    /// snapshot, ignored if the snapshot holds it or it is kept already.
    /// Errors, like [`Follower::apply`], for another shard, a map older
    /// than one seen or another epoch, and past [`MAX_KEPT_UPDATES`] kept.
    pub fn forwarded(&mut self, update: Forwarded) -> Result<()> {
        if update.shard != self.shard {
            return Err(Error::Replication(format!(
                "update {} is for shard {}, this replica catches up shard {}",
                update.seq, update.shard, self.shard
            )));
        }
        if update.map_version < self.map_version {
            return Err(Error::Replication(format!(
                "update {} of shard {} comes under shard map version {}, older than {} (from a deposed primary?)",
                update.seq, self.shard, update.map_version, self.map_version
            )));
        }
        if update.epoch != self.history.last_epoch() {
            return Err(Error::Replication(format!(
                "update {} of shard {} comes from the primary of epoch {}, but the snapshot is from epoch {}",
                update.seq,
                self.shard,
                update.epoch,
                self.history.last_epoch()
            )));
        }
        self.map_version = update.map_version;
        if update.seq <= self.upto || self.kept.contains_key(&update.seq) {
            return Ok(());
        }
        if self.kept.len() >= MAX_KEPT_UPDATES {
            return Err(Error::Replication(format!(
                "shard {}: more than {MAX_KEPT_UPDATES} updates came during the catch-up; start it again \
                 from a newer snapshot",
                self.shard
            )));
        }
        self.kept.insert(update.seq, update);
        Ok(())
    }

    /// Why the catch-up cannot finish yet (blocks still to come, or an
    /// update after the snapshot not come yet); `None` once it can.
    pub fn waiting_for(&self) -> Option<String> {
        if let Some(id) = self.missing.iter().next() {
            return Some(format!("{} block(s) of shard {}, the first {id}", self.missing.len(), self.shard));
        }
        let tables = !self.store.tables().is_empty();
        match self.row_parts {
            None if tables => return Some(format!("the first snapshot part of shard {}", self.shard)),
            Some(n) if (self.rows_seen.len() as u32) < n => {
                return Some(format!(
                    "{} of {n} row parts of shard {}",
                    n - self.rows_seen.len() as u32,
                    self.shard
                ))
            }
            _ => {}
        }
        let gap = self.kept.keys().zip(self.upto + 1..).find(|(seq, want)| **seq != *want);
        gap.map(|(_, want)| format!("update {want} of shard {}", self.shard))
    }

    /// Every block has come and the kept updates follow the snapshot: apply
    /// them in order and become a follower holding everything up to the
    /// last. Errors if [`waiting_for`](Self::waiting_for) is not `None`, or
    /// if a kept update does not apply: the replica then drifted from its
    /// primary, and the catch-up starts again from a fresh store.
    pub fn finish(self) -> Result<Follower> {
        if let Some(what) = self.waiting_for() {
            return Err(Error::Replication(format!("the catch-up still waits for {what}")));
        }
        let CatchUp { shard, map_version, upto, history, store, kept, .. } = self;
        let mut follower = Follower::new(shard, map_version, upto, history, store);
        // Each was checked against the newest map when it came.
        for (_, update) in kept {
            follower.apply(Forwarded { map_version, ..update }).map_err(|e| {
                Error::Replication(format!(
                    "shard {shard}: an update kept during the catch-up does not apply: {e}"
                ))
            })?;
        }
        Ok(follower)
    }
}

/// How a follower that asked to sync goes on ([`Links::sync`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyncFrom {
    /// It holds a prefix of the primary's updates: the updates after
    /// `applied` follow.
    Resume {
        /// The follower's last update, where forwarding resumes.
        applied: u64,
    },
    /// It must catch up from a snapshot at update `upto` (taken now, by the
    /// caller, under the same lock), whose epochs are `history`.
    Snapshot {
        /// The update the snapshot holds up to.
        upto: u64,
        /// The primary's history, which the replica takes on.
        history: History,
    },
}

/// What a primary keeps for one follower.
#[derive(Debug)]
struct Link {
    /// The follower holds (has applied) every update up to this one; `None`
    /// until it synced: it then holds nothing the primary could count on.
    acked: Option<u64>,
    /// It synced: forwards go to it (kept aside while it catches up).
    synced: bool,
    /// The follower took (applied or kept aside) every update up to this one.
    sent: u64,
    /// Forwards not yet acknowledged: updates `base + 1 ..`.
    queue: VecDeque<Arc<Forwarded>>,
    base: u64,
    /// The queue overflowed: the follower must catch up from a snapshot.
    overflowed: bool,
}

impl Link {
    /// Forwards stop; the follower syncs again, from a snapshot.
    fn must_resync(&mut self) {
        self.queue.clear();
        self.overflowed = true;
    }
}

/// The primary's side of a shard's replication: its sequence, its epochs,
/// and per follower what was sent and what it holds. The shell forwards
/// [`batch`](Self::batch)es, reports the answers ([`taken`](Self::taken)),
/// and answers clients once [`replicated`](Self::replicated) covers them.
#[derive(Debug)]
pub struct Links {
    shard: u32,
    epoch: u64,
    seq: u64,
    history: History,
    links: BTreeMap<PserverId, Link>,
    max_queued: usize,
}

/// The most updates a primary queues for one follower before it gives up
/// on forwarding them: the follower then catches up from a snapshot.
pub const MAX_QUEUED_UPDATES: usize = 4096;

impl Links {
    /// The primary of `shard` for `epoch`, whose store holds updates
    /// `1..=seq` (from the epochs of `history`), with no follower yet.
    pub fn new(shard: u32, epoch: u64, seq: u64, mut history: History) -> Links {
        history.begin(epoch, seq + 1);
        Links { shard, epoch, seq, history, links: BTreeMap::new(), max_queued: MAX_QUEUED_UPDATES }
    }

    /// The same with at most `max_queued` updates queued per follower.
    pub fn with_max_queued(mut self, max_queued: usize) -> Links {
        self.max_queued = max_queued.max(1);
        self
    }

    /// The shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The primary's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The last update applied.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The epochs of the updates `1..=seq`.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// The followers, in order.
    pub fn followers(&self) -> impl Iterator<Item = &str> + '_ {
        self.links.keys().map(String::as_str)
    }

    /// What `follower` holds for sure (`None`: not synced yet).
    pub fn acked(&self, follower: &str) -> Option<u64> {
        self.links.get(follower).and_then(|l| l.acked)
    }

    /// The shard map's followers now: new ones start unsynced (they hold
    /// nothing the primary counts on until they [`sync`](Self::sync)),
    /// and forwarding to ones no longer listed stops.
    pub fn set_followers<'a>(&mut self, followers: impl IntoIterator<Item = &'a str>) {
        let wanted: BTreeSet<&str> = followers.into_iter().collect();
        self.links.retain(|f, _| wanted.contains(f.as_str()));
        for f in wanted {
            self.links.entry(f.to_string()).or_insert_with(|| Link {
                acked: None,
                synced: false,
                sent: self.seq,
                queue: VecDeque::new(),
                base: self.seq,
                overflowed: false,
            });
        }
    }

    /// The primary applied `update` under map `map_version`: it is update
    /// `seq() + 1`, queued for every follower. Returns its number.
    pub fn record(&mut self, map_version: u64, update: Update) -> u64 {
        self.seq += 1;
        let forwarded =
            Arc::new(Forwarded { shard: self.shard, map_version, epoch: self.epoch, seq: self.seq, update });
        for link in self.links.values_mut() {
            if link.overflowed {
                continue;
            }
            if link.queue.len() >= self.max_queued {
                // Too far behind to keep up by forwards: it resyncs.
                link.must_resync();
                continue;
            }
            link.queue.push_back(forwarded.clone());
        }
        self.seq
    }

    /// The last update every follower holds: what may be acknowledged.
    pub fn replicated(&self) -> u64 {
        self.links.values().map(|l| l.acked.unwrap_or(0)).fold(self.seq, u64::min)
    }

    /// Whether `follower`, holding updates `1..=applied`, the last from
    /// epoch `epoch`, can resume from there ([`sync`](Self::sync) would
    /// answer [`SyncFrom::Resume`]). Changes nothing: the shell asks first
    /// so as to take a snapshot only when one is needed, and to leave the
    /// link as it is when none can be taken now.
    pub fn can_resume(&self, follower: &str, epoch: u64, applied: u64) -> bool {
        self.links.get(follower).is_some_and(|link| {
            self.history.holds_prefix(epoch, applied, self.seq) && !link.overflowed && link.base <= applied
        })
    }

    /// `follower` asks to sync, holding updates `1..=applied`, the last
    /// from epoch `epoch`. Errors if it is not a follower of this shard.
    pub fn sync(&mut self, follower: &str, epoch: u64, applied: u64) -> Result<SyncFrom> {
        let resume = self.can_resume(follower, epoch, applied);
        let link = self.links.get_mut(follower).ok_or_else(|| {
            Error::Replication(format!(
                "{follower} is not a follower of shard {} in this primary's map",
                self.shard
            ))
        })?;
        if resume {
            link.queue.retain(|f| f.seq > applied);
            link.base = applied;
            link.acked = Some(applied);
            link.sent = applied;
            link.synced = true;
            return Ok(SyncFrom::Resume { applied });
        }
        self.sync_from_snapshot(follower)
    }

    /// `follower` syncs from a snapshot taken now, even if it could resume:
    /// the shell's choice when the store holds more than the numbered
    /// updates say (a shard of one replica applies updates unnumbered
    /// until a replica moves in; a restored shard starts from its
    /// checkpoint), so that a follower holding nothing never counts as
    /// holding everything. Errors if it is not a follower of this shard.
    pub fn sync_from_snapshot(&mut self, follower: &str) -> Result<SyncFrom> {
        let seq = self.seq;
        let link = self.links.get_mut(follower).ok_or_else(|| {
            Error::Replication(format!(
                "{follower} is not a follower of shard {} in this primary's map",
                self.shard
            ))
        })?;
        link.queue.clear();
        link.base = seq;
        link.sent = seq;
        link.acked = None;
        link.overflowed = false;
        link.synced = true;
        Ok(SyncFrom::Snapshot { upto: seq, history: self.history.clone() })
    }

    /// The next forwards for `follower`: at most `max` of those it has not
    /// taken, in order. Empty if it is up to date, gone, or must resync.
    pub fn batch(&self, follower: &str, max: usize) -> Vec<Arc<Forwarded>> {
        let Some(link) = self.links.get(follower).filter(|l| l.synced && !l.overflowed) else {
            return Vec::new();
        };
        link.queue.iter().filter(|f| f.seq > link.sent).take(max).cloned().collect()
    }

    /// Whether `follower` was sent everything but has not confirmed holding
    /// it all (after a catch-up, until it answers a forward): the shell then
    /// asks it with an empty forward, so that acknowledgements waiting for it
    /// do not wait for the next update, which may never come.
    pub fn unconfirmed(&self, follower: &str) -> bool {
        self.links.get(follower).is_some_and(|l| {
            l.synced && !l.overflowed && l.sent >= self.seq && l.acked.unwrap_or(0) < self.seq
        })
    }

    /// Whether `follower` must sync (again) before anything is forwarded:
    /// it never synced, or fell too far behind.
    pub fn needs_sync(&self, follower: &str) -> bool {
        self.links.get(follower).is_some_and(|l| l.overflowed || !l.synced)
    }

    /// `follower` took every update up to `taken` (kept aside while it
    /// catches up) and holds (applied) every update up to `applied`.
    pub fn taken(&mut self, follower: &str, taken: u64, applied: Option<u64>) {
        let Some(link) = self.links.get_mut(follower) else { return };
        link.sent = link.sent.max(taken.min(self.seq));
        if let Some(applied) = applied.map(|a| a.min(self.seq)) {
            link.acked = Some(link.acked.map_or(applied, |a| a.max(applied)));
            link.queue.retain(|f| f.seq > applied);
            link.base = link.base.max(applied);
        }
    }

    /// `follower` cannot be sent what is queued for it (an update too large
    /// for one call): it catches up from a snapshot, as one that fell too
    /// far behind does ([`needs_sync`](Self::needs_sync)).
    pub fn resync(&mut self, follower: &str) {
        if let Some(link) = self.links.get_mut(follower) {
            link.must_resync();
        }
    }

    /// `follower` refused what was sent: send from its last acknowledged
    /// update again (after it resyncs, if it must).
    pub fn rewind(&mut self, follower: &str) {
        if let Some(link) = self.links.get_mut(follower) {
            link.sent = link.acked.unwrap_or(link.base).max(link.base);
        }
    }
}

/// Check that `mode` matches a forwarded update's kind (a sync store takes
/// steps, an async one pushes).
pub fn check_mode(mode: Mode, update: &Update) -> Result<()> {
    match (mode, update) {
        (Mode::Sync, Update::Push(_)) => {
            Err(Error::Replication("a sync replica takes completed steps, not pushes".into()))
        }
        (Mode::Async, Update::Step(_)) => {
            Err(Error::Replication("an async replica takes pushes, not completed steps".into()))
        }
        _ => Ok(()),
    }
}
