//! Answering calls: trainers' calls to a shard's primary, and the
//! replication calls between pservers.

use super::{metrics, replication, HeldSnapshot, Shared, Slot, SlotState, SNAPSHOT_KEEP};
use crate::{
    protocol::{
        BatchAnswer, BatchCall, BlockSpan, PsReply, PsRequest, PulledShard, ReplicaState, ShardRows,
        TableRows, MAX_BATCH_CALLS, MAX_TRAINER_ID_BYTES, PSERVER_METHOD,
    },
    replica::{History, SyncFrom, Update},
    sparse::MAX_PULL_REPLY_BYTES,
    BlockId, Error, Grad, Mode, ParamStore, Push, PushOutcome, RowGrads,
};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use oar_transport::{Frame, FrameParts, Handler, RemoteError};
use std::{
    sync::{Arc, MutexGuard, PoisonError},
    time::Duration,
};

pub(super) struct PsHandler {
    pub(super) shared: Arc<Shared>,
}

type Reply<T> = std::result::Result<T, RemoteError>;

/// An answer's metadata and payload, encoded into a frame once, by
/// [`PsHandler::handle`] (a batch gathers its calls' answers unencoded).
type Answer = (PsReply, Bytes);

/// The longest a pull may wait on the server for the next sync step.
const MAX_PULL_WAIT: Duration = Duration::from_secs(5);

/// The longest a sync push waits for its step to complete before it is
/// answered `unavailable` (and retried by the client).
const MAX_STEP_WAIT: Duration = Duration::from_secs(5);

/// Async: the longest a push that would start a new push waits at a
/// checkpoint's gate (see [`PsHandler::checkpoint_gate`]) before it goes
/// ahead anyway.
const MAX_GATE_WAIT: Duration = Duration::from_secs(5);

/// Counts a push in `oar_ps_pushes_in_flight` while it is handled, however
/// it ends (answered, refused, or its call dropped).
struct PushInFlight;

impl PushInFlight {
    fn enter() -> PushInFlight {
        metrics().pushes_in_flight.inc();
        PushInFlight
    }
}

impl Drop for PushInFlight {
    fn drop(&mut self) {
        metrics().pushes_in_flight.dec();
    }
}

impl PsHandler {
    fn check_fingerprint(&self, fingerprint: u64) -> Reply<()> {
        let ours = self.shared.placement.fingerprint();
        if fingerprint != ours {
            return Err(RemoteError::bad_request(format!(
                "placement fingerprint {fingerprint:#x} does not match this pserver's {ours:#x}: \
                 client and server disagree on the model's parameters, shard count or block size"
            )));
        }
        Ok(())
    }

    fn check_shard(&self, shard: u32) -> Reply<()> {
        let shards = self.shared.placement.servers();
        if shard >= shards {
            return Err(RemoteError::bad_request(format!(
                "shard {shard} does not exist: the job has {shards}"
            )));
        }
        Ok(())
    }

    /// The shard's slot, if the shard exists; `None` if this pserver holds
    /// no replica of it.
    fn slot(&self, shard: u32) -> Reply<Option<Arc<Slot>>> {
        self.check_shard(shard)?;
        Ok(self.shared.slot(shard))
    }

    fn not_primary(&self, shard: u32) -> PsReply {
        PsReply::NotPrimary { shard, map_version: self.shared.map_version() }
    }

    /// The blocks of `span` among the shard's blocks, or an error naming
    /// the span and how many blocks the shard holds. An empty span only
    /// for a shard without blocks in a job with sparse tables (its pushes
    /// carry rows alone).
    fn span(&self, shard: u32, span: BlockSpan) -> Reply<Vec<&crate::BlockInfo>> {
        self.check_shard(shard)?;
        let held: Vec<&crate::BlockInfo> = self.shared.placement.blocks_on(shard).collect();
        let rows_only = held.is_empty() && !self.shared.placement.tables().is_empty();
        if rows_only && span.start == 0 && span.end == 0 {
            return Ok(Vec::new());
        }
        if span.start >= span.end || span.end as usize > held.len() {
            return Err(RemoteError::bad_request(format!(
                "block span {}..{} is empty or out of range: shard {shard} holds {} blocks",
                span.start,
                span.end,
                held.len()
            )));
        }
        Ok(held[span.range()].to_vec())
    }

    /// Lock `slot`; `None` if it is not primary (answer [`PsReply::NotPrimary`]).
    fn primary<'a>(&self, slot: &'a Slot) -> Reply<Option<MutexGuard<'a, SlotState>>> {
        self.shared.check_serving()?;
        let state = self.shared.lock(slot)?;
        // Looked at again under the lock: a panic stops the pserver while it holds one.
        self.shared.check_serving()?;
        Ok(matches!(*state, SlotState::Primary { .. }).then_some(state))
    }

    /// Wait until every follower holds update `seq` of `slot` (strong
    /// mode), then check the pserver may still answer: its lease is valid
    /// and it is still the primary. Immediate with no follower.
    async fn replicated(&self, slot: &Slot, seq: u64) -> Reply<()> {
        let mut replication = slot.replication.subscribe();
        let started = tokio::time::Instant::now();
        if !replication.borrow().primary || replication.borrow().replicated < seq {
            let timeout = self.shared.options.replication_timeout;
            let wait = replication.wait_for(|r| !r.primary || r.replicated >= seq);
            match tokio::time::timeout(timeout, wait).await {
                Ok(Ok(r)) if r.primary => {}
                Ok(_) => {
                    return Err(RemoteError::unavailable(format!(
                        "shard {}: no longer its primary before its followers held update {seq}",
                        slot.shard
                    )))
                }
                Err(_) => {
                    return Err(RemoteError::unavailable(format!(
                        "shard {}: its followers did not all hold update {seq} within {timeout:?}",
                        slot.shard
                    )))
                }
            }
            metrics().replication_wait.observe(started.elapsed().as_secs_f64());
        }
        // The last check before an answer leaves: a deposed or paused
        // primary acknowledges nothing.
        self.shared.check_serving()
    }

    /// Apply a push (or a part of one) to `shard`. Its gradients are views
    /// into the received `payload`, not copies; the payload is let go
    /// before the wait for a sync step, so a push's parts waiting for their
    /// step hold only what the barrier keeps of them (with one trainer,
    /// nothing: each block is applied as it comes).
    async fn push(&self, request: PsRequest, payload: Bytes) -> Reply<PsReply> {
        let _in_flight = PushInFlight::enter();
        // Timed for the debug log only: no clock read per push without it.
        let received = tracing::enabled!(tracing::Level::DEBUG).then(std::time::Instant::now);
        let PsRequest::Push { shard, fingerprint, blocks, trainer, seq, step, weight, rows, origin, epoch } =
            request
        else {
            return Err(RemoteError::internal("not a push"));
        };
        self.check_fingerprint(fingerprint)?;
        let span = self.span(shard, blocks)?;
        let expected: usize = span.iter().map(|b| b.len).sum::<usize>() + self.rows_floats(&rows)?;
        if payload.len() as u64 != expected as u64 * 4 {
            return Err(RemoteError::bad_request(format!(
                "push from {trainer} to shard {shard}: payload has {} bytes, blocks {}..{}{} need {} ({} floats)",
                payload.len(),
                blocks.start,
                blocks.end,
                self.rows_described(&rows),
                expected as u64 * 4,
                expected
            )));
        }
        let Some(slot) = self.slot(shard)? else { return Ok(self.not_primary(shard)) };
        self.checkpoint_gate(&slot, &trainer, seq).await?;
        let mut grads = Vec::with_capacity(span.len());
        let mut at = 0;
        for block in &span {
            grads.push((block.id, Grad::Wire(payload.slice(at..at + block.len * 4))));
            at += block.len * 4;
        }
        let rows = wire_rows(&self.shared.placement, rows, &payload, at);
        let pusher = trainer.clone();
        let push = Push { trainer, seq, step, weight, grads, rows, origin };
        let (reply, wait, waits_in_step) = {
            let Some(mut state) = self.primary(&slot)? else { return Ok(self.not_primary(shard)) };
            let SlotState::Primary { store, links } = &mut *state else { unreachable!() };
            let started = std::time::Instant::now();
            let replicated = self.shared.replicated(shard);
            // Sync: a gradient computed at the parameters of an epoch
            // before this primary restored the shard from a checkpoint is
            // stale, unless it is a retry of a push taken already: the same
            // step number may hold other parameters here than the old
            // primary's. A promoted follower or a moved shard goes on from
            // its old primary's updates (a trainer only ever saw replicated
            // steps), so no check there: a push waiting in its step
            // survives a failover or a move.
            let restored = slot.restored_epoch.load(std::sync::atomic::Ordering::SeqCst);
            if store.mode() == Mode::Sync && epoch != 0 && epoch < restored && !store.is_retry(&pusher, seq) {
                tracing::debug!(
                    shard,
                    trainer = pusher,
                    seq,
                    epoch,
                    ours = links.epoch(),
                    "push of another epoch"
                );
                return Ok(PsReply::Stale { current: store.step() });
            }
            let forwarded = (replicated && store.mode() == Mode::Async).then(|| push.clone());
            let taken = self.shared.update(store, |s| s.push(push))?;
            let m = metrics();
            m.pushes.inc();
            m.push_bytes.inc_by(payload.len() as u64);
            if let Ok(PushOutcome::Applied { step }) = &taken {
                m.apply.observe(started.elapsed().as_secs_f64());
                slot.set_step_metric(*step);
            }
            let version = self.shared.map_version();
            if replicated {
                if let (
                    Ok(
                        PushOutcome::Applied { .. }
                        | PushOutcome::Buffered { .. }
                        | PushOutcome::AppliedBefore,
                    ),
                    Some(push),
                ) = (&taken, forwarded)
                {
                    links.record(version, Update::Push(push));
                }
                for completed in store.take_completed_steps() {
                    links.record(version, Update::Step(completed));
                }
            }
            let wait = links.seq();
            let reply = match taken {
                Ok(outcome) => PsReply::Pushed(outcome),
                // A step this shard left, or one it never reached (a new
                // primary took over at an earlier step), or one underway
                // without this trainer: join, pull and compute again.
                Err(Error::StaleStep { current, .. } | Error::FutureStep { current, .. }) => {
                    PsReply::Stale { current }
                }
                Err(Error::StepUnderway { step, .. }) => PsReply::Stale { current: step },
                Err(e) => return Err(RemoteError::bad_request(e)),
            };
            // Sync: a part buffered in a step is answered once its blocks
            // are updated (every member pushed them); the part that
            // completes the step, once the step is replicated too. Until the
            // step is complete a primary that goes (it died, or the shard
            // moved) takes the parts along, and the trainer, seeing the
            // shard's new epoch, pushes every part again (a part the new
            // primary has is a duplicate there).
            let waits_in_step = store.waits_in_step(&pusher, seq).then(|| store.step());
            if store.mode() == Mode::Sync {
                tracing::debug!(shard, trainer = pusher, seq, step, at = store.step(), ?reply, "sync push");
                // A push joins a newcomer to the barrier.
                self.shared.check_departed(&pusher);
            }
            self.shared.publish(&slot, &state);
            (reply, wait, waits_in_step)
        };
        slot.stepped.notify_waiters();
        drop(payload);
        let wait = match waits_in_step {
            Some(step) => {
                let blocks: Vec<BlockId> = span.iter().map(|b| b.id).collect();
                self.part_updated(&slot, step, &blocks).await?
            }
            None => wait,
        };
        self.replicated(&slot, wait).await?;
        metrics().acknowledged.inc();
        tracing::debug!(shard, trainer = pusher, seq, after = ?received.map(|r| r.elapsed()), "push acknowledged");
        Ok(reply)
    }

    /// Async: while a checkpoint of `slot` waits for the pushes in parts
    /// half taken to complete, a push that would start a new one waits
    /// (outside the lock) until the checkpoint took its snapshot or opened
    /// its gate, at most [`MAX_GATE_WAIT`], then goes ahead: else, with
    /// several trainers whose pushes in parts overlap, there may never be a
    /// moment with none half taken, and checkpoints starve. A part
    /// continuing a push half taken passes: the checkpoint waits for it.
    /// (See `save_and_record`; sync mode has no gate.)
    async fn checkpoint_gate(&self, slot: &Slot, trainer: &str, seq: u64) -> Reply<()> {
        if *slot.checkpoint_gate.borrow() == 0 {
            return Ok(());
        }
        {
            let Some(state) = self.primary(slot)? else { return Ok(()) };
            let SlotState::Primary { store, .. } = &*state else { unreachable!() };
            if store.mode() != Mode::Async || store.continues_push_in_parts(trainer, seq) {
                return Ok(());
            }
        }
        let mut gate = slot.checkpoint_gate.subscribe();
        // Goes ahead at the deadline: a late snapshot, not a hang.
        let _ = tokio::time::timeout(MAX_GATE_WAIT, gate.wait_for(|&closed| closed == 0)).await;
        Ok(())
    }

    /// Wait until the blocks of a part have left step `step` of `slot`
    /// ([`ParamStore::updated_in_step`]; at most [`MAX_STEP_WAIT`]; the
    /// client retries, as a duplicate that waits again); the update seq to
    /// wait for the replication of (the step's completion, if it is
    /// complete).
    async fn part_updated(&self, slot: &Slot, step: u64, blocks: &[BlockId]) -> Reply<u64> {
        let deadline = tokio::time::Instant::now() + MAX_STEP_WAIT;
        loop {
            // Register for the wake-up before looking, so a step in between is not missed.
            let stepped = slot.stepped.notified();
            {
                let Some(state) = self.primary(slot)? else {
                    return Err(RemoteError::unavailable(format!(
                        "shard {}: no longer its primary before step {step} completed",
                        slot.shard
                    )));
                };
                let SlotState::Primary { store, links } = &*state else { unreachable!() };
                if store.updated_in_step(step, blocks) {
                    return Ok(links.seq());
                }
            }
            if tokio::time::timeout_at(deadline, stepped).await.is_err() {
                let waiting = match self.primary(slot)?.as_deref() {
                    Some(SlotState::Primary { store, .. }) => store.waiting_for().join(", "),
                    _ => String::new(),
                };
                return Err(RemoteError::unavailable(format!(
                    "shard {}: step {step} did not complete within {MAX_STEP_WAIT:?} (waiting for: {waiting})",
                    slot.shard
                )));
            }
        }
    }

    /// The parameters of `span`'s blocks of `store`, concatenated.
    fn params(&self, store: &ParamStore, span: BlockSpan) -> Reply<Bytes> {
        let blocks = self.span(store.server(), span)?;
        let total: usize = blocks.iter().map(|b| b.len).sum();
        let mut payload = self.shared.reply_pool.writer(total * 4).map_err(RemoteError::internal)?;
        for block in blocks {
            let values = store.block(block.id).map_err(RemoteError::internal)?;
            payload.extend_from_slice(&oar_transport::f32s_as_le_bytes(values));
        }
        let m = metrics();
        m.pulls.inc();
        m.pull_bytes.inc_by(payload.len() as u64);
        Ok(payload.freeze())
    }

    /// Apply a push and answer with its blocks' parameters after it (sync:
    /// once they left the push's step, so they are the next step's).
    async fn push_pull(&self, request: PsRequest, payload: Bytes) -> Reply<Answer> {
        let PsRequest::PushPull { shard, blocks, step, .. } = request else {
            return Err(RemoteError::internal("not a push-pull"));
        };
        let push = request.with_pull(false);
        let outcome = match self.push(push, payload).await? {
            PsReply::Pushed(outcome) => outcome,
            reply @ (PsReply::NotPrimary { .. } | PsReply::Stale { .. }) => return Ok((reply, Bytes::new())),
            other => return Err(RemoteError::internal(format!("a push answered {other:?}"))),
        };
        let Some(slot) = self.slot(shard)? else { return Ok((self.not_primary(shard), Bytes::new())) };
        let (params, step, wait) = {
            let Some(state) = self.primary(&slot)? else {
                return Ok((self.not_primary(shard), Bytes::new()));
            };
            let SlotState::Primary { store, links } = &*state else { unreachable!() };
            // Sync: the part's blocks hold step + 1's parameters (the step
            // itself may still wait for other blocks).
            // (A duplicate's step is the peer's word, unchecked: saturate.)
            let at = if store.mode() == Mode::Sync {
                store.step().max(step.saturating_add(1))
            } else {
                store.step()
            };
            (self.params(store, blocks)?, at, links.seq())
        };
        self.replicated(&slot, wait).await?;
        Ok((PsReply::PushedPulled { outcome, step }, params))
    }

    async fn pull(
        &self,
        shard: u32,
        fingerprint: u64,
        blocks: BlockSpan,
        min_step: Option<u64>,
        max_wait: Duration,
    ) -> Reply<Answer> {
        self.check_fingerprint(fingerprint)?;
        self.span(shard, blocks)?;
        let not_primary = || Ok((self.not_primary(shard), Bytes::new()));
        let Some(slot) = self.slot(shard)? else { return not_primary() };
        let started = tokio::time::Instant::now();
        let deadline = started + max_wait;
        loop {
            // Register for the wake-up before looking, so a step in between is not missed.
            let stepped = slot.stepped.notified();
            let ready = {
                let Some(state) = self.primary(&slot)? else { return not_primary() };
                let SlotState::Primary { store, links } = &*state else { unreachable!() };
                if min_step.is_none_or(|m| store.step() >= m) {
                    Some((self.params(store, blocks)?, store.step(), links.seq()))
                } else if tokio::time::Instant::now() >= deadline {
                    return Ok((PsReply::Pulled { step: store.step(), ready: false }, Bytes::new()));
                } else {
                    None
                }
            };
            if let Some((payload, step, wait)) = ready {
                if min_step.is_some() {
                    metrics().barrier_wait.observe(started.elapsed().as_secs_f64());
                }
                self.replicated(&slot, wait).await?;
                return Ok((PsReply::Pulled { step, ready: true }, payload));
            }
            let _ = tokio::time::timeout_at(deadline, stepped).await;
        }
    }

    /// `rows` as a push's payload must hold them: " and N rows of "emb"
    /// (dim 16)" per table.
    fn rows_described(&self, rows: &[TableRows]) -> String {
        let tables = self.shared.placement.tables();
        rows.iter()
            .map(|r| match tables.get(r.table as usize) {
                Some(t) => format!(" and {} rows of {:?} (dim {})", r.ids.len(), t.name, t.dim),
                None => format!(" and {} rows of table {}", r.ids.len(), r.table),
            })
            .collect()
    }

    /// The floats the rows of `rows` take (ids times their table's dim),
    /// or an error naming a table that does not exist.
    fn rows_floats(&self, rows: &[TableRows]) -> Reply<usize> {
        let tables = self.shared.placement.tables();
        let mut floats = 0usize;
        for r in rows {
            let t = tables.get(r.table as usize).ok_or_else(|| {
                RemoteError::bad_request(crate::Error::NoSuchTable { table: r.table, tables: tables.len() })
            })?;
            floats = floats.saturating_add(r.ids.len().saturating_mul(t.dim));
        }
        Ok(floats)
    }

    /// The bytes a pull of `shards`' rows answers with, refused if more
    /// than [`MAX_PULL_REPLY_BYTES`] (it could not be sent anyway): a
    /// request of a few MiB naming one row a million times would
    /// otherwise make the pserver build a reply of many GiB.
    fn pull_reply_bytes(&self, shards: &[ShardRows]) -> Reply<u64> {
        let mut floats = 0usize;
        for s in shards {
            floats = floats.saturating_add(self.rows_floats(&s.tables)?);
        }
        let bytes = (floats as u64).saturating_mul(4);
        if bytes > MAX_PULL_REPLY_BYTES {
            return Err(RemoteError::bad_request(format!(
                "a pull of rows whose values take {bytes} bytes: at most {MAX_PULL_REPLY_BYTES} are answered (split the batch)"
            )));
        }
        Ok(bytes)
    }

    /// Rows of every shard asked for that this pserver is primary of:
    /// shard by shard, each at its own step (after its `min_step`, waiting
    /// up to `max_wait` in all).
    async fn pull_rows(&self, fingerprint: u64, shards: Vec<ShardRows>, max_wait: Duration) -> Reply<Answer> {
        self.check_fingerprint(fingerprint)?;
        self.pull_reply_bytes(&shards)?;
        let asked: usize = shards.iter().flat_map(|s| &s.tables).map(|t| t.ids.len()).sum();
        if asked > crate::sparse::MAX_ROWS_PER_CALL {
            return Err(RemoteError::bad_request(format!(
                "a pull of {asked} rows in one call: at most {} are allowed (split the batch)",
                crate::sparse::MAX_ROWS_PER_CALL
            )));
        }
        let deadline = tokio::time::Instant::now() + max_wait;
        let mut answers = Vec::with_capacity(shards.len());
        let mut payload = BytesMut::new();
        let mut waits = Vec::new();
        let mut values = Vec::new();
        for ShardRows { shard, tables, min_step } in &shards {
            let Some(slot) = self.slot(*shard)? else {
                answers.push(PulledShard::NotPrimary { map_version: self.shared.map_version() });
                continue;
            };
            loop {
                let stepped = slot.stepped.notified();
                let answer = {
                    match self.primary(&slot)? {
                        None => Some(PulledShard::NotPrimary { map_version: self.shared.map_version() }),
                        Some(state) => {
                            let SlotState::Primary { store, links } = &*state else { unreachable!() };
                            if min_step.is_none_or(|m| store.step() >= m) {
                                for t in tables {
                                    store
                                        .pull_rows(t.table, &t.ids, &mut values)
                                        .map_err(RemoteError::bad_request)?;
                                    oar_transport::put_f32s(&mut payload, &values);
                                }
                                waits.push((slot.clone(), links.seq()));
                                Some(PulledShard::Rows { step: store.step() })
                            } else if tokio::time::Instant::now() >= deadline {
                                Some(PulledShard::NotReady { step: store.step() })
                            } else {
                                None
                            }
                        }
                    }
                };
                if let Some(answer) = answer {
                    answers.push(answer);
                    break;
                }
                let _ = tokio::time::timeout_at(deadline, stepped).await;
            }
        }
        // What is answered is held by every follower (strong mode).
        for (slot, seq) in waits {
            self.replicated(&slot, seq).await?;
        }
        let m = metrics();
        m.pulls.inc();
        m.pull_bytes.inc_by(payload.len() as u64);
        Ok((PsReply::PulledRows { shards: answers }, payload.freeze()))
    }

    /// Join or leave the barrier of `shard` (forwarded like any update).
    async fn membership(&self, shard: u32, trainer: String, join: bool) -> Reply<PsReply> {
        let Some(slot) = self.slot(shard)? else { return Ok(self.not_primary(shard)) };
        let (reply, wait) = {
            let Some(mut state) = self.primary(&slot)? else { return Ok(self.not_primary(shard)) };
            if join {
                let SlotState::Primary { store, links } = &mut *state else { unreachable!() };
                let step = store.join(&trainer);
                tracing::debug!(shard, trainer, step, at = store.step(), "joined the barrier");
                self.shared.check_departed(&trainer);
                if self.shared.replicated(shard) {
                    links.record(self.shared.map_version(), Update::Join(trainer));
                }
                let wait = links.seq();
                self.shared.publish(&slot, &state);
                (PsReply::Joined { step }, wait)
            } else {
                tracing::debug!(shard, trainer, "left the barrier");
                (PsReply::Ok, super::leave(&self.shared, &slot, &mut state, &trainer)?)
            }
        };
        self.replicated(&slot, wait).await?;
        Ok(reply)
    }

    /// A replication call must come under the map this pserver serves under.
    fn check_map(&self, shard: u32, map_version: u64) -> Reply<()> {
        self.shared.check_serving()?;
        let ours = self.shared.map_version();
        if map_version < ours {
            return Err(RemoteError::bad_request(format!(
                "shard {shard}: a replication call under shard map version {map_version}, older than this \
                 pserver's {ours} (from a deposed primary?)"
            )));
        }
        if map_version > ours {
            return Err(RemoteError::unavailable(format!(
                "shard {shard}: a replication call under shard map version {map_version}, which this pserver \
                 has not seen yet (it has {ours}); retry"
            )));
        }
        Ok(())
    }

    /// Follower side: updates from the primary.
    fn replicate(&self, request: PsRequest, payload: Bytes) -> Reply<PsReply> {
        let PsRequest::Replicate { shard, map_version, epoch, updates } = request else {
            return Err(RemoteError::internal("not a replicate"));
        };
        self.check_shard(shard)?;
        self.check_map(shard, map_version)?;
        let forwarded =
            replication::decode(&self.shared.placement, shard, map_version, epoch, &updates, payload)
                .map_err(RemoteError::bad_request)?;
        let slot = self.slot(shard)?.ok_or_else(|| {
            RemoteError::bad_request(format!("shard {shard}: this pserver holds no replica of it"))
        })?;
        let mut state = self.shared.lock(&slot)?;
        let reply = match &mut *state {
            SlotState::Follower { follower, must_sync: false } => {
                for update in forwarded {
                    let applied = follower.apply(update);
                    if let Err(e) = applied {
                        // It cannot follow from here: it syncs again.
                        if let SlotState::Follower { must_sync, .. } = &mut *state {
                            *must_sync = true;
                        }
                        drop(state);
                        replication::spawn_sync(&self.shared, &slot);
                        return Err(RemoteError::unavailable(e));
                    }
                }
                let applied = follower.applied();
                PsReply::Replicated { taken: applied, applied: Some(applied) }
            }
            SlotState::CatchingUp { catch_up } => {
                let mut taken = catch_up.upto();
                for update in forwarded {
                    taken = update.seq;
                    catch_up.forwarded(update).map_err(RemoteError::unavailable)?;
                }
                PsReply::Replicated { taken, applied: None }
            }
            SlotState::Follower { must_sync: true, .. } | SlotState::Syncing => {
                return Err(RemoteError::unavailable(format!(
                    "shard {shard}: this replica is not synced yet"
                )))
            }
            SlotState::Primary { .. } => {
                return Err(RemoteError::bad_request(format!(
                    "shard {shard}: this pserver is its primary under map version {map_version}"
                )))
            }
        };
        Ok(reply)
    }

    /// Primary side: a follower asks how to go on.
    fn sync(&self, request: PsRequest) -> Reply<PsReply> {
        let PsRequest::Sync { shard, map_version, follower, epoch, applied } = request else {
            return Err(RemoteError::internal("not a sync"));
        };
        self.check_map(shard, map_version)?;
        let Some(slot) = self.slot(shard)? else { return Ok(self.not_primary(shard)) };
        let Some(mut state) = self.primary(&slot)? else { return Ok(self.not_primary(shard)) };
        let SlotState::Primary { store, links } = &mut *state else { unreachable!() };
        if !links.followers().any(|f| f == follower) {
            return Err(RemoteError::unavailable(format!(
                "shard {shard}: {follower} is not its follower in this primary's map (version {map_version})"
            )));
        }
        // A snapshot only when one is needed; none now leaves the link as it
        // is. A follower that never caught up (epoch 0, nothing applied)
        // resumes only from a store that holds nothing either: updates
        // applied while the shard had no follower (one replica), or before
        // a restore, are not numbered.
        let pristine = store.step() == 0
            && store.pushes() == 0
            && store.members().is_empty()
            && store.last_seqs().next().is_none();
        let fresh = epoch == 0 && applied == 0;
        let resume = links.can_resume(&follower, epoch, applied) && (!fresh || pristine);
        let snapshot = match resume {
            true => None,
            false => match store.catch_up_snapshot() {
                Ok(snapshot) => Some(snapshot),
                Err(Error::CheckpointStepUnderway { step }) => {
                    return Err(RemoteError::unavailable(format!(
                        "shard {shard}: sync step {step} is underway (or a sync push half taken); sync again shortly"
                    )))
                }
                Err(e) => return Err(RemoteError::internal(e)),
            },
        };
        let from = match resume {
            true => links.sync(&follower, epoch, applied),
            false => links.sync_from_snapshot(&follower),
        };
        let from = from.map_err(RemoteError::bad_request)?;
        let reply = match (from, snapshot) {
            (SyncFrom::Resume { applied }, _) => PsReply::SyncFrom {
                epoch: links.epoch(),
                resume: true,
                upto: applied,
                parts: 0,
                history: links.history().epochs().to_vec(),
            },
            (SyncFrom::Snapshot { upto, history }, Some(snapshot)) => {
                let parts = replication::part_ranges(&snapshot);
                let row_parts = replication::row_part_ranges(&snapshot);
                let count = (parts.len() + row_parts.len()) as u32;
                let mut held = self.shared.snapshots.lock().unwrap_or_else(PoisonError::into_inner);
                held.retain(|_, h| h.taken.elapsed() < SNAPSHOT_KEEP);
                held.insert(
                    (shard, follower.clone()),
                    HeldSnapshot { upto, snapshot, parts, row_parts, taken: std::time::Instant::now() },
                );
                tracing::info!(shard, follower, upto, parts = count, "a follower catches up from a snapshot");
                PsReply::SyncFrom {
                    epoch: links.epoch(),
                    resume: false,
                    upto,
                    parts: count,
                    history: history.epochs().to_vec(),
                }
            }
            (SyncFrom::Snapshot { .. }, None) => {
                return Err(RemoteError::internal("the link wants a snapshot it said it would not"))
            }
        };
        self.shared.publish(&slot, &state);
        Ok(reply)
    }

    /// Primary side: part of a held snapshot, its payload in parts (views
    /// of the snapshot's blocks).
    fn snapshot_part(&self, request: PsRequest) -> Reply<(PsReply, Vec<Bytes>)> {
        let PsRequest::SnapshotPart { shard, follower, upto, part } = request else {
            return Err(RemoteError::internal("not a snapshot part"));
        };
        self.shared.check_serving()?;
        let held = self.shared.snapshots.lock().unwrap_or_else(PoisonError::into_inner);
        let snapshot = held.get(&(shard, follower.clone())).filter(|h| h.upto == upto).ok_or_else(|| {
            RemoteError::bad_request(format!(
                "shard {shard}: no snapshot at update {upto} is held for {follower} (sync again)"
            ))
        })?;
        let row_parts = snapshot.row_parts.len() as u32;
        match snapshot.parts.get(part as usize) {
            Some(range) => Ok(replication::encode_part(&snapshot.snapshot, range.clone(), row_parts)),
            None => {
                let index = (part as usize).saturating_sub(snapshot.parts.len());
                let rows = snapshot.row_parts.get(index).cloned().ok_or_else(|| {
                    RemoteError::bad_request(format!(
                        "shard {shard}: the snapshot has {} parts, not a part {part}",
                        snapshot.parts.len() + snapshot.row_parts.len()
                    ))
                })?;
                let (reply, payload) =
                    replication::encode_row_part(&snapshot.snapshot, row_parts, index as u32, rows);
                Ok((reply, vec![payload]))
            }
        }
    }

    /// Primary side: a follower caught up.
    fn caught(&self, request: PsRequest) -> Reply<PsReply> {
        let PsRequest::Caught { shard, map_version, follower, epoch, applied } = request else {
            return Err(RemoteError::internal("not a caught"));
        };
        self.check_map(shard, map_version)?;
        let Some(slot) = self.slot(shard)? else { return Ok(self.not_primary(shard)) };
        let Some(mut state) = self.primary(&slot)? else { return Ok(self.not_primary(shard)) };
        let SlotState::Primary { links, .. } = &mut *state else { unreachable!() };
        if epoch != links.epoch() {
            return Err(RemoteError::bad_request(format!(
                "shard {shard}: {follower} caught up with epoch {epoch}, this primary's is {}",
                links.epoch()
            )));
        }
        links.taken(&follower, applied, Some(applied));
        self.shared
            .snapshots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(shard, follower.clone()));
        tracing::info!(shard, follower, applied, "a follower caught up");
        self.shared.publish(&slot, &state);
        Ok(PsReply::Ok)
    }

    fn status(&self) -> PsReply {
        let shards: Vec<ReplicaState> = self
            .shared
            .slots()
            .iter()
            .map(|slot| slot.state.lock().unwrap_or_else(PoisonError::into_inner).describe(slot.shard))
            .collect();
        PsReply::Status { name: self.shared.name.clone(), map_version: self.shared.map_version(), shards }
    }
}

#[async_trait]
impl Handler for PsHandler {
    async fn handle(&self, request: Frame) -> Reply<Frame> {
        self.handle_parts(request).await.map(FrameParts::join)
    }

    /// A snapshot part's reply is views of the snapshot's blocks, in parts;
    /// every other reply's payload is one buffer.
    async fn handle_parts(&self, request: Frame) -> Reply<FrameParts> {
        if request.method != PSERVER_METHOD {
            return Err(RemoteError::bad_request(format!("unknown pserver method {:#x}", request.method)));
        }
        let one_part = |(reply, payload): Answer| (reply, vec![payload]);
        let (reply, payload) = match request.meta::<PsRequest>()? {
            PsRequest::Batch { calls } => one_part(self.batch(calls, request.payload).await?),
            part @ PsRequest::SnapshotPart { .. } => self.snapshot_part(part)?,
            one => one_part(self.handle_one(one, request.payload).await?),
        };
        let Frame { method, meta, .. } =
            Frame::new(PSERVER_METHOD, &reply, Bytes::new()).map_err(RemoteError::internal)?;
        Ok(FrameParts { method, meta, payload })
    }
}

impl PsHandler {
    /// The calls of a [`PsRequest::Batch`], all at once, each handled as
    /// if it had come alone, except that its row pulls start once the
    /// other calls are answered; answered in call order. A batch whose
    /// payload lengths do not add up, that holds a batch or that is too
    /// long is refused whole, before any call is handled.
    async fn batch(&self, calls: Vec<BatchCall>, payload: Bytes) -> Reply<Answer> {
        if calls.len() > MAX_BATCH_CALLS {
            return Err(RemoteError::bad_request(format!(
                "a batch of {} calls: at most {MAX_BATCH_CALLS} are allowed",
                calls.len()
            )));
        }
        let declared = calls.iter().try_fold(0u64, |sum, c| sum.checked_add(c.payload_len));
        if declared != Some(payload.len() as u64) {
            return Err(RemoteError::bad_request(format!(
                "a batch's calls declare {} payload bytes, the batch carries {}",
                declared.map_or_else(|| "more than 2^64".to_string(), |d| d.to_string()),
                payload.len()
            )));
        }
        if let Some(at) = calls.iter().position(|c| matches!(c.request, PsRequest::Batch { .. })) {
            return Err(RemoteError::bad_request(format!("call {at} of a batch is a batch itself")));
        }
        // Each row pull is bounded alone; their replies together too.
        let mut pulled = 0u64;
        for call in &calls {
            if let PsRequest::PullRows { shards, .. } = &call.request {
                pulled = pulled.saturating_add(self.pull_reply_bytes(shards)?);
            }
        }
        if pulled > MAX_PULL_REPLY_BYTES {
            return Err(RemoteError::bad_request(format!(
                "a batch of row pulls whose values take {pulled} bytes: at most {MAX_PULL_REPLY_BYTES} are answered"
            )));
        }
        // Row pulls go after the other calls: the rows of a trainer's next
        // batch, asked for with its push, are read after that push.
        let (mut first, mut then) = (Vec::new(), Vec::new());
        let mut at = 0;
        for (k, call) in calls.into_iter().enumerate() {
            let len = call.payload_len as usize;
            let part = payload.slice(at..at + len);
            at += len;
            let list =
                if matches!(call.request, PsRequest::PullRows { .. }) { &mut then } else { &mut first };
            list.push((k, call.request, part));
        }
        let mut answered = Vec::with_capacity(first.len() + then.len());
        for round in [first, then] {
            let keys: Vec<usize> = round.iter().map(|(k, _, _)| *k).collect();
            let handled = round.into_iter().map(|(_, request, part)| self.handle_one(request, part));
            answered.extend(keys.into_iter().zip(oar_transport::join_all(handled).await));
        }
        answered.sort_by_key(|(k, _)| *k);
        let total: usize = answered.iter().map(|(_, a)| a.as_ref().map_or(0, |(_, bytes)| bytes.len())).sum();
        let mut payload = BytesMut::with_capacity(total);
        let mut answers = Vec::with_capacity(answered.len());
        for (_, one) in answered {
            let (reply, len) = match one {
                Ok((reply, bytes)) => {
                    payload.extend_from_slice(&bytes);
                    (Ok(reply), bytes.len() as u64)
                }
                Err(e) => (Err(e), 0),
            };
            answers.push(BatchAnswer { reply, payload_len: len });
        }
        Ok((PsReply::Batch { answers }, payload.freeze()))
    }

    /// One call (of a batch, or alone).
    async fn handle_one(&self, request: PsRequest, payload: Bytes) -> Reply<Answer> {
        if let Some(trainer) = request.trainer() {
            if trainer.is_empty() || trainer.len() > MAX_TRAINER_ID_BYTES {
                return Err(RemoteError::bad_request(format!(
                    "a trainer id of {} bytes: ids must be 1 to {MAX_TRAINER_ID_BYTES} bytes",
                    trainer.len()
                )));
            }
        }
        let reply = match request {
            PsRequest::Info { shard } => match self.slot(shard)? {
                None => self.not_primary(shard),
                Some(slot) => match self.primary(&slot)? {
                    None => self.not_primary(shard),
                    Some(state) => {
                        let SlotState::Primary { store, .. } = &*state else { unreachable!() };
                        PsReply::Info {
                            shard,
                            fingerprint: self.shared.placement.fingerprint(),
                            step: store.step(),
                            mode: store.mode(),
                        }
                    }
                },
            },
            PsRequest::Join { shard, trainer } => self.membership(shard, trainer, true).await?,
            PsRequest::Leave { shard, trainer } => self.membership(shard, trainer, false).await?,
            push @ PsRequest::Push { .. } => self.push(push, payload).await?,
            push_pull @ PsRequest::PushPull { .. } => return self.push_pull(push_pull, payload).await,
            PsRequest::Pull { shard, fingerprint, blocks, min_step, max_wait_ms } => {
                let wait = Duration::from_millis(max_wait_ms).min(MAX_PULL_WAIT);
                return self.pull(shard, fingerprint, blocks, min_step, wait).await;
            }
            PsRequest::PullRows { fingerprint, shards, max_wait_ms } => {
                let wait = Duration::from_millis(max_wait_ms).min(MAX_PULL_WAIT);
                return self.pull_rows(fingerprint, shards, wait).await;
            }
            replicate @ PsRequest::Replicate { .. } => self.replicate(replicate, payload)?,
            sync @ PsRequest::Sync { .. } => self.sync(sync)?,
            part @ PsRequest::SnapshotPart { .. } => {
                let (reply, payload) = self.snapshot_part(part)?;
                return Ok((reply, payload.concat().into()));
            }
            caught @ PsRequest::Caught { .. } => self.caught(caught)?,
            PsRequest::SyncNeeded { shard, map_version } => {
                self.check_map(shard, map_version)?;
                if let Some(slot) = self.slot(shard)? {
                    let mut state = self.shared.lock(&slot)?;
                    if let SlotState::Follower { must_sync, .. } = &mut *state {
                        *must_sync = true;
                    }
                    drop(state);
                    replication::spawn_sync(&self.shared, &slot);
                }
                PsReply::Ok
            }
            PsRequest::Status => self.status(),
            PsRequest::Batch { .. } => {
                return Err(RemoteError::bad_request("a batch inside a batch"));
            }
        };
        Ok((reply, Bytes::new()))
    }
}

/// Row gradients as views into `payload` from byte `at` on, table by
/// table in `rows` order (the caller checked the payload's length).
pub(super) fn wire_rows(
    placement: &crate::Placement,
    rows: Vec<TableRows>,
    payload: &Bytes,
    mut at: usize,
) -> Vec<RowGrads> {
    let tables = placement.tables();
    rows.into_iter()
        .map(|TableRows { table, ids }| {
            let dim = tables.get(table as usize).map_or(0, |t| t.dim);
            let end = (at + ids.len() * dim * 4).min(payload.len());
            let grads = Grad::Wire(payload.slice(at..end));
            at = end;
            RowGrads { table, ids, grads }
        })
        .collect()
}

/// A follower's history as the primary sent it, checked.
pub(super) fn history_from(epochs: Vec<(u64, u64)>) -> std::result::Result<History, String> {
    History::from_epochs(epochs).map_err(|e| e.to_string())
}
