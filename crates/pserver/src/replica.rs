//! Replication's core, without I/O (`docs/DESIGN.md` §6): what a follower
//! does with what its primary forwards, and how a new replica catches up.
//!
//! **Forwarding.** The primary numbers the updates it applies to a shard,
//! 1, 2, 3, ..., and forwards each ([`Forwarded`]) to every follower in that
//! order: in async mode each push as it applied it (so the followers keep
//! the same deduplication table, and a push retried to a new primary is
//! applied once) and each trainer it let go, in sync mode each completed step's combined gradient
//! (replication after aggregation: one message a step, not one a trainer).
//! A [`Follower`] applies update `n` only after `n - 1`: an update it has
//! is a duplicate (no change), a gap, a wrong shard or an older map is an
//! error that names it, and changes nothing. Applying the same updates in
//! the same order with the same optimizer gives the same state, bit for
//! bit, so a follower can become primary at any update it has.
//!
//! **Catching up.** A new or restarted replica ([`CatchUp`]) starts from a
//! snapshot the primary takes at update `upto` (copy-on-write: pushes go on
//! meanwhile), sent in [`SnapshotPart`]s in any order, while the updates
//! after `upto` keep coming and are kept aside. Once every block has come,
//! [`CatchUp::finish`] applies the kept updates in order and the replica is
//! a follower, caught up. The same path moves a shard to another pserver.

use std::collections::{BTreeMap, BTreeSet};

use crate::block::BlockId;
use crate::error::{Error, Result};
use crate::optimizer::OptimizerState;
use crate::store::{CompletedStep, Mode, ParamStore, Push, PushOutcome, StoreSnapshot};

/// One update as a primary forwards it.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    /// Async: a push the primary applied, as it came.
    Push(Push),
    /// Async: a trainer the primary let go. A leave drops the trainer's
    /// half-taken push, which changes how a retry of it is deduplicated.
    Leave(String),
    /// Sync: a step the primary completed.
    Step(CompletedStep),
}

/// Update number `seq` of shard `shard`, under shard map `map_version`.
#[derive(Clone, Debug, PartialEq)]
pub struct Forwarded {
    /// The logical shard.
    pub shard: u32,
    /// The version of the shard map the primary serves under.
    pub map_version: u64,
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

/// A replica kept up to date by its primary.
#[derive(Debug)]
pub struct Follower {
    shard: u32,
    map_version: u64,
    applied: u64,
    store: ParamStore,
}

impl Follower {
    /// A follower of `shard` whose `store` holds updates `1..=applied`.
    pub fn new(shard: u32, map_version: u64, applied: u64, store: ParamStore) -> Follower {
        Follower { shard, map_version, applied, store }
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

    /// The replica's store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The store, to serve as the shard's primary (after an election).
    pub fn into_store(self) -> ParamStore {
        self.store
    }

    /// Apply update `forwarded.seq` if it is the next one; see the
    /// [module docs](self) for the checks. Nothing changes on an error.
    pub fn apply(&mut self, forwarded: Forwarded) -> Result<Applied> {
        let Forwarded { shard, map_version, seq, update } = forwarded;
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
        if seq <= self.applied {
            return Ok(Applied::Duplicate);
        }
        if seq != self.applied + 1 {
            return Err(Error::Replication(format!(
                "update {seq} of shard {shard} leaves a gap: this replica has applied up to {}",
                self.applied
            )));
        }
        match update {
            Update::Push(push) => match self.store.push(push)? {
                PushOutcome::Applied { .. } | PushOutcome::Buffered { .. } => {}
                PushOutcome::Duplicate => {
                    return Err(Error::Replication(format!(
                        "update {seq} of shard {shard} is a push this replica had already taken: \
                         it has drifted from its primary"
                    )))
                }
            },
            Update::Leave(trainer) => {
                if self.store.mode() != Mode::Async {
                    return Err(Error::Replication(format!(
                        "update {seq} of shard {shard} is a leave, forwarded in async mode only"
                    )));
                }
                self.store.leave(&trainer);
            }
            Update::Step(step) => self.store.apply_step(step)?,
        }
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
    /// Some of the shard's blocks: parameters and optimizer state.
    pub blocks: Vec<(BlockId, Vec<f32>, OptimizerState)>,
    /// The deduplication table (trainer, last seq): every part carries it.
    pub last_seqs: Vec<(String, u64)>,
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
        blocks,
        last_seqs: last_seqs.clone(),
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
    store: ParamStore,
    missing: BTreeSet<BlockId>,
    step: Option<u64>,
    kept: BTreeMap<u64, Forwarded>,
}

/// The most updates a catching-up replica keeps aside: past it the
/// snapshot is too far behind, and the catch-up starts again.
pub const MAX_KEPT_UPDATES: usize = 10_000;

impl CatchUp {
    /// Catch up shard `shard` from a snapshot at update `upto` (under map
    /// `map_version`) into `store`, a fresh store of that shard.
    pub fn new(shard: u32, map_version: u64, upto: u64, store: ParamStore) -> CatchUp {
        let missing = store.block_ids().collect();
        CatchUp {
            shard,
            snapshot_map: map_version,
            map_version,
            upto,
            store,
            missing,
            step: None,
            kept: BTreeMap::new(),
        }
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
        let SnapshotPart { shard, map_version, upto, step, blocks, last_seqs } = part;
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
        for (id, params, state) in &blocks {
            if !self.store.block_ids().any(|b| b == *id) {
                return Err(Error::Replication(format!(
                    "snapshot part holds block {id}, not of shard {shard}"
                )));
            }
            let len = self.store.block(*id)?.len();
            let slots = self.store.optimizer().state_slots() * len;
            if params.len() != len || state.slots.len() != slots {
                return Err(Error::Replication(format!(
                    "snapshot part's block {id} has {} values and {} state slots, expected {len} and {slots}",
                    params.len(),
                    state.slots.len()
                )));
            }
        }
        for (id, params, state) in blocks {
            self.store.restore_block(id, params, state)?;
            self.missing.remove(&id);
        }
        for (trainer, seq) in last_seqs {
            self.store.restore_last_seq(&trainer, seq);
        }
        if self.step.is_none() {
            self.store.set_step(step);
            self.step = Some(step);
        }
        Ok(())
    }

    /// An update the primary forwarded meanwhile: kept if it is after the
    /// snapshot, ignored if the snapshot holds it or it is kept already.
    /// Errors, like [`Follower::apply`], for another shard or a map older
    /// than one seen, and past [`MAX_KEPT_UPDATES`] kept.
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
        let CatchUp { shard, map_version, upto, store, kept, .. } = self;
        let mut follower = Follower::new(shard, map_version, upto, store);
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
