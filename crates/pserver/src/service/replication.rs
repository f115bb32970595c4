//! The tasks of replication: a primary's forwarders (one per follower of
//! each shard it is primary of) and a follower's sync (resume, or catch up
//! from a snapshot), with the wire encoding of forwarded updates and
//! snapshot parts.

use super::{metrics, Shared, Slot, SlotState};
use crate::{
    client::{Fresh, ShardSink},
    error::{ServiceError, ServiceResult},
    protocol::{PsReply, PsRequest, RowsPart, TableRows, UpdateKind, UpdateMeta, PSERVER_METHOD},
    replica::{CatchUp, Forwarded, RowChunk, SnapshotPart, Update},
    BlockId, CompletedStep, Grad, OptimizerState, Placement, Push, RowGrads, StoreSnapshot,
};
use bytes::{Bytes, BytesMut};
use std::{
    borrow::Cow,
    ops::Range,
    sync::{atomic::Ordering, Arc, PoisonError},
    time::Duration,
};
use tokio_util::task::AbortOnDropHandle;

/// The most updates one forward carries.
const MAX_BATCH_UPDATES: usize = 64;
/// The most gradient bytes one forward carries (a larger update goes alone).
const MAX_BATCH_BYTES: usize = 8 << 20;
/// The most parameter and state values one snapshot part carries.
const MAX_PART_FLOATS: usize = 2 << 20;
/// The most admission candidates one snapshot part carries: each is an id,
/// a count and a step in the part's metadata, up to 23 bytes (6 MiB).
const MAX_PART_CANDIDATES: usize = 1 << 18;
/// How long a primary waits for a follower that caught up to say so before
/// it asks (an empty forward).
const PROBE_AFTER: Duration = Duration::from_millis(50);

/// How long a catch-up waits for the updates after its snapshot.
const CATCH_UP_WAIT: Duration = Duration::from_secs(30);

/// Start a forwarder for every follower of `slot` (a primary) that has none.
pub(super) fn spawn_forwarders(shared: &Arc<Shared>, slot: &Arc<Slot>) {
    let followers: Vec<String> = match &*slot.state.lock().unwrap_or_else(PoisonError::into_inner) {
        SlotState::Primary { links, .. } => links.followers().map(str::to_string).collect(),
        _ => return,
    };
    let mut tasks = slot.tasks.lock().unwrap_or_else(PoisonError::into_inner);
    tasks.retain(|_, task| !task.is_finished());
    for follower in followers {
        let key = format!("forward:{follower}");
        if tasks.contains_key(&key) {
            continue;
        }
        let task = tokio::spawn(forward(shared.clone(), slot.clone(), follower));
        tasks.insert(key, AbortOnDropHandle::new(task));
    }
}

/// What a forwarder does next.
enum Plan {
    Wait,
    Poke(u64),
    Send {
        batch: Vec<Arc<Forwarded>>,
        version: u64,
        epoch: u64,
    },
    /// An empty forward: the follower answers with what it holds.
    Probe {
        version: u64,
        epoch: u64,
    },
}

/// Forward `slot`'s updates to `follower`, in order, until it is no longer
/// a follower of this primary.
async fn forward(shared: Arc<Shared>, slot: Arc<Slot>, follower: String) {
    let mut backoff = Duration::from_millis(5);
    loop {
        let wake = slot.forward.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        let plan = {
            let state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
            let SlotState::Primary { links, .. } = &*state else { return };
            if !links.followers().any(|f| f == follower) || shared.stopped.borrow().is_some() {
                return;
            }
            if links.needs_sync(&follower) {
                Plan::Poke(shared.map_version())
            } else {
                let mut batch = links.batch(&follower, MAX_BATCH_UPDATES);
                let mut bytes = 0;
                let keep = batch
                    .iter()
                    .position(|f| {
                        bytes += update_bytes(&f.update);
                        bytes > MAX_BATCH_BYTES
                    })
                    .unwrap_or(batch.len())
                    .max(1);
                batch.truncate(keep);
                match (batch.is_empty(), links.unconfirmed(&follower)) {
                    (true, false) => Plan::Wait,
                    (true, true) => Plan::Probe { version: shared.map_version(), epoch: links.epoch() },
                    (false, _) => Plan::Send { batch, version: shared.map_version(), epoch: links.epoch() },
                }
            }
        };
        let plan = match plan {
            Plan::Probe { version, epoch } => {
                // A follower that just caught up says so itself (`Caught`);
                // ask only if it has not, after a moment.
                if tokio::time::timeout(PROBE_AFTER, wake.as_mut()).await.is_ok() {
                    continue;
                }
                Plan::Send { batch: Vec::new(), version, epoch }
            }
            plan => plan,
        };
        match plan {
            Plan::Wait | Plan::Probe { .. } => {
                let _ = tokio::time::timeout(Duration::from_secs(1), wake).await;
            }
            Plan::Poke(map_version) => {
                let request = PsRequest::SyncNeeded { shard: slot.shard, map_version };
                let _ = call(&shared, &follower, &request, &[]).await;
                let _ = tokio::time::timeout(Duration::from_millis(200), wake).await;
            }
            Plan::Send { batch, version, epoch } => {
                let (updates, pieces) = encode(&batch);
                let request =
                    PsRequest::Replicate { shard: slot.shard, map_version: version, epoch, updates };
                let pieces: Vec<&[u8]> = pieces.iter().map(|p| p.as_ref()).collect();
                let answer = call(&shared, &follower, &request, &pieces).await;
                let refused = {
                    let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
                    let SlotState::Primary { links, .. } = &mut *state else { return };
                    match answer {
                        Ok((PsReply::Replicated { taken, applied }, _)) => {
                            links.taken(&follower, taken, applied);
                            metrics().forwarded.inc_by(batch.len() as u64);
                            shared.publish(&slot, &state);
                            None
                        }
                        Err(ServiceError::Transport(e @ oar_transport::Error::TooLarge { .. })) => {
                            // One update (a large update goes alone) past
                            // what a call may carry: sent again, it would be
                            // refused for ever, and the shard acknowledge
                            // nothing. The follower takes it in a snapshot's
                            // parts instead.
                            let seq = batch.first().map_or(0, |f| f.seq);
                            tracing::warn!(
                                shard = slot.shard,
                                follower,
                                seq,
                                error = %e,
                                "an update too large to forward: the follower catches up from a snapshot"
                            );
                            links.resync(&follower);
                            shared.publish(&slot, &state);
                            None
                        }
                        other => {
                            links.rewind(&follower);
                            Some(other)
                        }
                    }
                };
                match refused {
                    None => backoff = Duration::from_millis(5),
                    Some(other) => {
                        match other {
                            Err(e) => {
                                tracing::debug!(shard = slot.shard, follower, error = %e, "forward refused")
                            }
                            Ok((reply, _)) => {
                                tracing::warn!(
                                    shard = slot.shard,
                                    follower,
                                    ?reply,
                                    "odd answer to a forward"
                                )
                            }
                        }
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(250));
                    }
                }
            }
        }
    }
}

/// Call pserver `name`; a transport failure forgets its connection.
async fn call(
    shared: &Shared,
    name: &str,
    request: &PsRequest,
    payload: &[&[u8]],
) -> ServiceResult<(PsReply, Bytes)> {
    let mut sink = Collected::default();
    let reply = call_into(shared, name, request, payload, &mut sink).await?;
    Ok((reply, Bytes::from(sink.0)))
}

/// [`call`] with the reply's payload written into `sink`.
async fn call_into(
    shared: &Shared,
    name: &str,
    request: &PsRequest,
    payload: &[&[u8]],
    sink: &mut dyn oar_transport::PayloadSink,
) -> ServiceResult<PsReply> {
    let conn = shared.connection(name).await?;
    let result = oar_transport::call_parts(
        conn.as_ref(),
        PSERVER_METHOD,
        request,
        payload,
        sink,
        shared.options.call_timeout,
    )
    .await;
    result.map_err(|e| {
        if !matches!(e, oar_transport::Error::Remote { .. }) {
            shared.forget_connection(name);
        }
        e.into()
    })
}

/// A reply's payload, kept.
#[derive(Default)]
struct Collected(Vec<u8>);

impl oar_transport::PayloadSink for Collected {
    fn start(&mut self, len: u64) -> oar_transport::Result<()> {
        self.0.clear();
        self.0.reserve(usize::try_from(len).unwrap_or(0).min(64 << 20));
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

/// Start `slot`'s sync unless one runs.
pub(super) fn spawn_sync(shared: &Arc<Shared>, slot: &Arc<Slot>) {
    if slot.syncing.swap(true, Ordering::SeqCst) {
        return;
    }
    let task = tokio::spawn({
        let (shared, slot) = (shared.clone(), slot.clone());
        async move {
            sync(&shared, &slot).await;
            slot.syncing.store(false, Ordering::SeqCst);
            // A request for another sync may have come while this one ended.
            let again = matches!(
                &*slot.state.lock().unwrap_or_else(PoisonError::into_inner),
                SlotState::Follower { must_sync: true, .. } | SlotState::Syncing
            );
            if again && shared.slot(slot.shard).is_some_and(|s| Arc::ptr_eq(&s, &slot)) {
                spawn_sync(&shared, &slot);
            }
        }
    });
    let mut tasks = slot.tasks.lock().unwrap_or_else(PoisonError::into_inner);
    tasks.retain(|_, task| !task.is_finished());
    tasks.insert("sync".into(), AbortOnDropHandle::new(task));
}

/// Sync `slot` with its primary until it follows it: resume from what it
/// holds, or catch up from a snapshot.
async fn sync(shared: &Arc<Shared>, slot: &Arc<Slot>) {
    let shard = slot.shard;
    let mut backoff = Duration::from_millis(5);
    loop {
        if shared.stopped.borrow().is_some() || shared.slot(shard).is_none_or(|s| !Arc::ptr_eq(&s, slot)) {
            return;
        }
        let (epoch, applied) = {
            let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &*state {
                SlotState::Follower { must_sync: false, .. } | SlotState::Primary { .. } => return,
                SlotState::Follower { follower, .. } => (follower.history().last_epoch(), follower.applied()),
                SlotState::Syncing => (0, 0),
                // A catch-up that did not finish starts again.
                SlotState::CatchingUp { .. } => {
                    *state = SlotState::Syncing;
                    (0, 0)
                }
            }
        };
        let Some(map) = shared.map() else { return };
        let version = map.version();
        let primary = match map.primary(shard) {
            Some(p) if p != shared.name => p.to_string(),
            _ => return, // Primary here, or none: the reconciler decides.
        };
        let request =
            PsRequest::Sync { shard, map_version: version, follower: shared.name.clone(), epoch, applied };
        let outcome = match call(shared, &primary, &request, &[]).await {
            Ok((PsReply::SyncFrom { epoch, resume: true, .. }, _)) => {
                let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
                if let SlotState::Follower { follower, must_sync } = &mut *state {
                    follower.resume(epoch);
                    *must_sync = false;
                    tracing::info!(shard, primary, applied, "follower resumes with its primary");
                }
                shared.publish(slot, &state);
                return;
            }
            Ok((PsReply::SyncFrom { epoch, resume: false, upto, parts, history }, _)) => {
                catch_up(shared, slot, &primary, version, epoch, upto, parts, history).await
            }
            Ok((reply, _)) => {
                Err(ServiceError::Protocol(format!("{primary} answered a sync with {reply:?}")))
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(shard, primary, error = %e, "sync failed; trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// Catch `slot` up from `primary`'s snapshot at update `upto`.
#[allow(clippy::too_many_arguments)]
async fn catch_up(
    shared: &Arc<Shared>,
    slot: &Arc<Slot>,
    primary: &str,
    version: u64,
    epoch: u64,
    upto: u64,
    parts: u32,
    history: Vec<(u64, u64)>,
) -> ServiceResult<()> {
    let shard = slot.shard;
    let history = super::handler::history_from(history).map_err(ServiceError::Protocol)?;
    let store = shared.new_store(shard, true)?;
    let state_slots = store.optimizer().state_slots();
    // The primary cuts its snapshot's blocks into parts by the same rule
    // (`part_ranges`) over the same blocks, so each block part's layout is
    // known before it comes and its values go straight into fresh blocks.
    let layout: Vec<(BlockId, usize)> =
        store.block_ids().map(|id| store.block_len(id).map(|len| (id, len))).collect::<Result<_, _>>()?;
    let block_parts = cut_parts(layout.iter().map(|(_, len)| len * (1 + state_slots)));
    {
        let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = SlotState::CatchingUp { catch_up: CatchUp::new(shard, version, upto, history, store) };
        shared.publish(slot, &state);
    }
    // The next part is fetched while this one is restored. More in flight
    // made a 120 MB catch-up slower on the 2-core development machine
    // (BENCHMARKS.md, "Moving shards"): the copies compete for the cores.
    let fetch = |part: u32| {
        let fetch = PartFetch {
            shared: shared.clone(),
            primary: primary.to_string(),
            shard,
            version,
            upto,
            part,
            state_slots,
            blocks: block_parts.get(part as usize).map(|range| layout[range.clone()].to_vec()),
        };
        AbortOnDropHandle::new(tokio::spawn(fetch.run()))
    };
    let mut next = (parts > 0).then(|| fetch(0));
    for part in 0..parts {
        let Some(fetching) = next.take() else { break };
        let (part_values, bytes) = fetching.await.map_err(|e| {
            ServiceError::Protocol(format!("shard {shard}: fetching snapshot part {part} failed: {e}"))
        })??;
        if part + 1 < parts {
            next = Some(fetch(part + 1));
        }
        shared.catch_up_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        super::metrics().catch_up_bytes.inc_by(bytes);
        let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        let SlotState::CatchingUp { catch_up } = &mut *state else {
            return Err(ServiceError::Protocol(format!("shard {shard}: the catch-up was cancelled")));
        };
        catch_up.part(part_values)?;
    }
    let deadline = tokio::time::Instant::now() + CATCH_UP_WAIT;
    let applied = loop {
        let finished = {
            let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
            let SlotState::CatchingUp { catch_up } = &*state else {
                return Err(ServiceError::Protocol(format!("shard {shard}: the catch-up was cancelled")));
            };
            match catch_up.waiting_for() {
                None => {
                    let SlotState::CatchingUp { catch_up } =
                        std::mem::replace(&mut *state, SlotState::Syncing)
                    else {
                        unreachable!()
                    };
                    let follower = catch_up.finish()?;
                    let applied = follower.applied();
                    *state = SlotState::Follower { follower, must_sync: false };
                    shared.publish(slot, &state);
                    Some(applied)
                }
                Some(what) if tokio::time::Instant::now() >= deadline => {
                    return Err(ServiceError::Protocol(format!(
                        "shard {shard}: the catch-up still waits for {what}"
                    )))
                }
                Some(_) => None,
            }
        };
        match finished {
            Some(applied) => break applied,
            None => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    };
    tracing::info!(shard, primary, upto, applied, "caught up");
    let request =
        PsRequest::Caught { shard, map_version: version, follower: shared.name.clone(), epoch, applied };
    // The primary learns it from the next forward's answer too.
    let _ = call(shared, primary, &request, &[]).await;
    Ok(())
}

/// One snapshot part to fetch from a shard's primary.
struct PartFetch {
    shared: Arc<Shared>,
    primary: String,
    shard: u32,
    version: u64,
    upto: u64,
    part: u32,
    state_slots: usize,
    /// A block part's blocks (id, length), in order; `None` for a row part.
    blocks: Option<Vec<(BlockId, usize)>>,
}

impl PartFetch {
    /// The part and its payload's size. A block part's values are written
    /// straight into fresh blocks as they arrive.
    async fn run(self) -> ServiceResult<(SnapshotPart, u64)> {
        let PartFetch { shared, primary, shard, version, upto, part, state_slots, blocks } = self;
        let request = PsRequest::SnapshotPart { shard, follower: shared.name.clone(), upto, part };
        let Some(blocks) = blocks else {
            let (reply, payload) = call(&shared, &primary, &request, &[]).await?;
            let bytes = payload.len() as u64;
            let part = decode_part(&shared.placement, shard, version, upto, state_slots, reply, payload)?;
            return Ok((part, bytes));
        };
        let mut sink =
            ShardSink::over(Fresh::new(blocks.iter().flat_map(|&(_, len)| [len, len * state_slots])));
        let bytes = sink.expected_bytes();
        let reply = call_into(&shared, &primary, &request, &[], &mut sink).await?;
        if !sink.is_complete() {
            return Err(ServiceError::Protocol(format!(
                "shard {shard}: snapshot part {part} came without its blocks' values"
            )));
        }
        let mut filled = sink.into_inner().into_blocks();
        let blocks: Vec<(BlockId, Vec<f32>, Vec<f32>)> = blocks
            .into_iter()
            .map(|(id, _)| (id, filled.next().unwrap_or_default(), filled.next().unwrap_or_default()))
            .collect();
        Ok((block_part(shard, version, upto, reply, blocks)?, bytes))
    }
}

/// The gradient bytes of an update.
fn update_bytes(update: &Update) -> usize {
    match update {
        Update::Push(push) => {
            push.grads.iter().map(|(_, g)| grad_bytes(g)).sum::<usize>()
                + push.rows.iter().map(|r| grad_bytes(&r.grads)).sum::<usize>()
        }
        Update::Step(step) => {
            step.grads.iter().map(|(_, g)| g.len() * 4).sum::<usize>()
                + step.rows.iter().map(|r| grad_bytes(&r.grads)).sum::<usize>()
        }
        Update::Join(_) | Update::Leave(_) => 0,
    }
}

fn grad_bytes(grad: &Grad) -> usize {
    match grad {
        Grad::Floats(v) => v.len() * 4,
        Grad::Wire(b) => b.len(),
    }
}

/// Forwarded updates as a [`PsRequest::Replicate`]'s updates and payload
/// pieces (sent from where they are).
pub(super) fn encode(batch: &[Arc<Forwarded>]) -> (Vec<UpdateMeta>, Vec<Cow<'_, [u8]>>) {
    let mut metas = Vec::with_capacity(batch.len());
    let mut pieces = Vec::new();
    for forwarded in batch {
        let kind = match &forwarded.update {
            Update::Push(push) => {
                pieces.extend(push.grads.iter().map(|(_, grad)| grad_piece(grad)));
                pieces.extend(push.rows.iter().map(|r| grad_piece(&r.grads)));
                UpdateKind::Push {
                    trainer: push.trainer.clone(),
                    seq: push.seq,
                    step: push.step,
                    weight: push.weight,
                    blocks: push.grads.iter().map(|(id, _)| *id).collect(),
                    rows: table_rows(&push.rows),
                    origin: push.origin,
                }
            }
            Update::Step(step) => {
                pieces.extend(step.grads.iter().map(|(_, g)| oar_transport::f32s_as_le_bytes(g)));
                pieces.extend(step.rows.iter().map(|r| grad_piece(&r.grads)));
                UpdateKind::Step {
                    step: step.step,
                    blocks: step.grads.iter().map(|(id, _)| *id).collect(),
                    seqs: step.seqs.clone(),
                    rows: table_rows(&step.rows),
                    origins: step.origins.clone(),
                }
            }
            Update::Join(trainer) => UpdateKind::Join(trainer.clone()),
            Update::Leave(trainer) => UpdateKind::Leave(trainer.clone()),
        };
        metas.push(UpdateMeta { seq: forwarded.seq, kind });
    }
    (metas, pieces)
}

/// A gradient's bytes as they are.
fn grad_piece(grad: &Grad) -> Cow<'_, [u8]> {
    match grad {
        Grad::Floats(v) => oar_transport::f32s_as_le_bytes(v),
        Grad::Wire(b) => Cow::Borrowed(b.as_ref()),
    }
}

/// Row gradients' descriptions (their values go in the payload).
fn table_rows(rows: &[RowGrads]) -> Vec<TableRows> {
    rows.iter().map(|r| TableRows { table: r.table, ids: r.ids.clone() }).collect()
}

/// The updates of a [`PsRequest::Replicate`] of `shard`, their gradients
/// views into `payload`. Errors name what does not fit.
pub(super) fn decode(
    placement: &Placement,
    shard: u32,
    map_version: u64,
    epoch: u64,
    updates: &[UpdateMeta],
    payload: Bytes,
) -> std::result::Result<Vec<Forwarded>, String> {
    let mut cursor = Cursor { payload: &payload, at: 0 };
    let mut out = Vec::with_capacity(updates.len());
    for meta in updates {
        let seq = meta.seq;
        let update = match &meta.kind {
            UpdateKind::Push { trainer, seq: push_seq, step, weight, blocks, rows, origin } => {
                let grads = blocks
                    .iter()
                    .map(|id| cursor.block(placement, shard, id, seq).map(|b| (*id, Grad::Wire(b))))
                    .collect::<std::result::Result<_, _>>()?;
                let rows = cursor.rows(placement, rows, seq)?;
                Update::Push(Push {
                    trainer: trainer.clone(),
                    seq: *push_seq,
                    step: *step,
                    weight: *weight,
                    grads,
                    rows,
                    origin: *origin,
                })
            }
            UpdateKind::Step { step, blocks, seqs, rows, origins } => {
                let mut grads = Vec::with_capacity(blocks.len());
                for id in blocks {
                    let bytes = cursor.block(placement, shard, id, seq)?;
                    let values = oar_transport::bytes_to_f32s(&bytes).map_err(|e| e.to_string())?;
                    grads.push((*id, values));
                }
                let rows = cursor.rows(placement, rows, seq)?;
                let origins = origins.clone();
                Update::Step(CompletedStep { step: *step, grads, seqs: seqs.clone(), rows, origins })
            }
            UpdateKind::Join(trainer) => Update::Join(trainer.clone()),
            UpdateKind::Leave(trainer) => Update::Leave(trainer.clone()),
        };
        out.push(Forwarded { shard, map_version, epoch, seq, update });
    }
    let at = cursor.at;
    if at != payload.len() {
        return Err(format!("{} bytes of payload after the last update's gradients", payload.len() - at));
    }
    Ok(out)
}

/// Reads a replication payload's pieces in order.
struct Cursor<'a> {
    payload: &'a Bytes,
    at: usize,
}

impl Cursor<'_> {
    /// The next `floats` values' bytes, for update `seq`'s `what`.
    fn take(
        &mut self,
        floats: usize,
        seq: u64,
        what: &dyn Fn() -> String,
    ) -> std::result::Result<Bytes, String> {
        let end = self.at.saturating_add(floats.saturating_mul(4));
        if end > self.payload.len() {
            return Err(format!(
                "update {seq}: the payload ends before {} ({} bytes)",
                what(),
                self.payload.len()
            ));
        }
        let bytes = self.payload.slice(self.at..end);
        self.at = end;
        Ok(bytes)
    }

    /// Block `id` of `shard`.
    fn block(
        &mut self,
        placement: &Placement,
        shard: u32,
        id: &BlockId,
        seq: u64,
    ) -> std::result::Result<Bytes, String> {
        let block = placement
            .block(*id)
            .filter(|b| b.server == shard)
            .ok_or_else(|| format!("update {seq} names block {id}, which is not of shard {shard}"))?;
        self.take(block.len, seq, &|| format!("block {id}"))
    }

    /// The row gradients `rows` describes.
    fn rows(
        &mut self,
        placement: &Placement,
        rows: &[TableRows],
        seq: u64,
    ) -> std::result::Result<Vec<RowGrads>, String> {
        let tables = placement.tables();
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let table = tables
                .get(r.table as usize)
                .ok_or_else(|| format!("update {seq} names table #{}, which does not exist", r.table))?;
            let bytes = self.take(r.ids.len().saturating_mul(table.dim), seq, &|| {
                format!("the rows of table {:?}", table.name)
            })?;
            out.push(RowGrads { table: r.table, ids: r.ids.clone(), grads: Grad::Wire(bytes) });
        }
        Ok(out)
    }
}

/// The block positions of each part of `snapshot`: at most
/// [`MAX_PART_FLOATS`] values (parameters and state) each, a larger block alone.
pub(super) fn part_ranges(snapshot: &StoreSnapshot) -> Vec<Range<usize>> {
    cut_parts(snapshot.blocks().map(|(_, params, state)| params.len() + state.slots.len()))
}

/// Parts of blocks of `sizes` values: runs of at most [`MAX_PART_FLOATS`]
/// (a larger block alone), at least one part. A catch-up predicts the
/// primary's parts with it, so both sides must cut by this one rule.
fn cut_parts(sizes: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let mut parts = Vec::new();
    let (mut start, mut floats, mut end) = (0, 0, 0);
    for (i, size) in sizes.into_iter().enumerate() {
        if i > start && floats + size > MAX_PART_FLOATS {
            parts.push(start..i);
            (start, floats) = (i, 0);
        }
        floats += size;
        end = i + 1;
    }
    if end > start || parts.is_empty() {
        parts.push(start..end);
    }
    parts
}

/// The row parts of `snapshot`, after its block parts: per table, runs
/// of its arena's chunks of at most [`MAX_PART_FLOATS`] values (a larger
/// chunk alone), at least one part per table (the first carries the
/// counters), then runs of at most [`MAX_PART_CANDIDATES`] of its
/// candidates. A table's ranges are of one sequence: its chunks
/// `0..chunks`, then its candidates in id order (candidate `i` at
/// `chunks + i`), a part never both ([`encode_row_part`] reads them so).
/// The candidates went whole in the table's first part: 75M of them were
/// past the 1 GiB a call carries, and every catch-up of the shard failed.
pub(super) fn row_part_ranges(snapshot: &StoreSnapshot) -> Vec<(u32, Range<usize>)> {
    row_part_ranges_of(snapshot, MAX_PART_CANDIDATES)
}

/// [`row_part_ranges`] with at most `max_candidates` candidates a part.
fn row_part_ranges_of(snapshot: &StoreSnapshot, max_candidates: usize) -> Vec<(u32, Range<usize>)> {
    let mut parts = Vec::new();
    for (t, table) in snapshot.tables().iter().enumerate() {
        // A chunk's floats, at most: its rows are not counted one by one.
        let chunk_floats = 4096 * table.row_floats();
        let per_part = (MAX_PART_FLOATS / chunk_floats.max(1)).max(1);
        let chunks = table.chunks();
        let mut start = 0;
        loop {
            let end = (start + per_part).min(chunks);
            parts.push((t as u32, start..end));
            if end >= chunks {
                break;
            }
            start = end;
        }
        let candidates = table.candidate_count();
        let per_part = max_candidates.max(1);
        parts.extend(
            (0..candidates)
                .step_by(per_part)
                .map(|i| (t as u32, chunks + i..chunks + (i + per_part).min(candidates))),
        );
    }
    parts
}

/// Row part `index` of `snapshot`, of [`row_part_ranges`]: the rows of
/// chunks `range` of table `table` (with its counters if it is the
/// table's first), or its candidates `range` less its chunk count.
pub(super) fn encode_row_part(
    snapshot: &StoreSnapshot,
    row_parts: u32,
    index: u32,
    (table, range): (u32, Range<usize>),
) -> (PsReply, Bytes) {
    let t = &snapshot.tables()[table as usize];
    let chunks = t.chunks();
    let mut payload = BytesMut::new();
    let mut rows = Vec::new();
    let mut candidates = Vec::new();
    let mut stats = None;
    if range.start >= chunks && !range.is_empty() {
        let range = range.start - chunks..range.end - chunks;
        candidates = t.candidates_in(range).map(|c| (c.id, c.count, c.last_seen)).collect();
    } else {
        stats = (range.start == 0).then(|| t.stats());
        for r in t.records_in(range) {
            oar_transport::put_f32s(&mut payload, r.params);
            oar_transport::put_f32s(&mut payload, r.slots);
            rows.push((r.id, r.step, r.count, r.last_seen));
        }
    }
    let part = RowsPart { table, index, rows, candidates, stats };
    (part_reply(snapshot, Vec::new(), row_parts, Some(part)), payload.freeze())
}

/// A snapshot part's blocks are sent from where they are (views) from
/// this many bytes on; smaller ones are copied together into one buffer
/// with their small neighbours, because quinn walks its list of buffers
/// not yet acknowledged for every packet: thousands of tiny ones would
/// cost more than the copy.
const SEND_IN_PLACE_FROM: usize = 64 << 10;

/// Part `range` of `snapshot`: per block its parameters then its state's
/// slots, as views of the snapshot's blocks (a payload in parts; only
/// blocks under [`SEND_IN_PLACE_FROM`] are copied). The views keep their
/// blocks alive until the follower has acknowledged them, after the
/// snapshot itself is gone if need be: such a block is then freed rather
/// than kept as the store's spare.
pub(super) fn encode_part(
    snapshot: &StoreSnapshot,
    range: Range<usize>,
    row_parts: u32,
) -> (PsReply, Vec<Bytes>) {
    let shared = snapshot.shared_blocks().skip(range.start).take(range.len());
    let steps = snapshot.blocks().skip(range.start).take(range.len()).map(|(_, _, state)| state.step);
    let mut payload = Vec::with_capacity(2 * range.len());
    let mut small = BytesMut::new();
    let mut named = Vec::with_capacity(range.len());
    for ((id, params, slots), step) in shared.zip(steps) {
        for values in [params, slots] {
            if values.as_ref().len() * 4 < SEND_IN_PLACE_FROM {
                oar_transport::put_f32s(&mut small, values.as_ref());
                continue;
            }
            if !small.is_empty() {
                payload.push(small.split().freeze());
            }
            payload.push(oar_transport::f32s_shared(values));
        }
        named.push((id, step));
    }
    if !small.is_empty() {
        payload.push(small.freeze());
    }
    (part_reply(snapshot, named, row_parts, None), payload)
}

/// A snapshot part's metadata: the store's state in `snapshot`, the
/// part's blocks (id, optimizer step) or rows.
fn part_reply(
    snapshot: &StoreSnapshot,
    blocks: Vec<(BlockId, u64)>,
    row_parts: u32,
    rows: Option<RowsPart>,
) -> PsReply {
    PsReply::SnapshotPart {
        step: snapshot.step(),
        pushes: snapshot.pushes(),
        members: snapshot.members().to_vec(),
        blocks,
        last_seqs: snapshot.last_seqs().map(|(t, s)| (t.to_string(), s)).collect(),
        origins: Box::new(snapshot.origins().clone()),
        row_parts,
        rows,
        half_pushes: snapshot.half_pushes().to_vec(),
    }
}

/// The blocks and rows of a snapshot part, from the blocks (id, state
/// step) and the rows its reply names.
type PartValues = (Vec<(BlockId, Vec<f32>, OptimizerState)>, Option<RowChunk>);

/// A [`SnapshotPart`] from a [`PsReply::SnapshotPart`]'s metadata, with its
/// values from `values`.
fn snapshot_part(
    shard: u32,
    map_version: u64,
    upto: u64,
    reply: PsReply,
    values: impl FnOnce(Vec<(BlockId, u64)>, Option<RowsPart>) -> ServiceResult<PartValues>,
) -> ServiceResult<SnapshotPart> {
    let PsReply::SnapshotPart {
        step,
        pushes,
        members,
        blocks,
        last_seqs,
        origins,
        row_parts,
        rows,
        half_pushes,
    } = reply
    else {
        return Err(ServiceError::Protocol(format!("a snapshot part answered with {reply:?}")));
    };
    let (blocks, rows) = values(blocks, rows)?;
    Ok(SnapshotPart {
        shard,
        map_version,
        upto,
        step,
        pushes,
        members,
        blocks,
        last_seqs,
        origins: *origins,
        row_parts,
        rows,
        half_pushes,
    })
}

/// A block part of a snapshot: the reply's metadata and the blocks its
/// payload was written into, which must be the blocks the reply names.
fn block_part(
    shard: u32,
    map_version: u64,
    upto: u64,
    reply: PsReply,
    fetched: Vec<(BlockId, Vec<f32>, Vec<f32>)>,
) -> ServiceResult<SnapshotPart> {
    snapshot_part(shard, map_version, upto, reply, |blocks, rows| {
        let named: Vec<BlockId> = blocks.iter().map(|(id, _)| *id).collect();
        let expected: Vec<BlockId> = fetched.iter().map(|(id, ..)| *id).collect();
        if named != expected || rows.is_some() {
            return Err(ServiceError::Protocol(format!(
                "shard {shard}: a snapshot part holds blocks {named:?}{}, expected blocks {expected:?} \
                 (do both pservers run the same version?)",
                if rows.is_some() { " and rows" } else { "" }
            )));
        }
        let blocks = blocks
            .into_iter()
            .zip(fetched)
            .map(|((id, step), (_, params, slots))| (id, params, OptimizerState { step, slots }))
            .collect();
        Ok((blocks, None))
    })
}

/// A snapshot part from a [`PsReply::SnapshotPart`] and its payload.
fn decode_part(
    placement: &Placement,
    shard: u32,
    map_version: u64,
    upto: u64,
    state_slots: usize,
    reply: PsReply,
    payload: Bytes,
) -> ServiceResult<SnapshotPart> {
    snapshot_part(shard, map_version, upto, reply, |blocks, rows| {
        let mut at = 0usize;
        let mut floats = |n: usize| -> ServiceResult<Vec<f32>> {
            let end = at + n * 4;
            let bytes = payload.get(at..end).ok_or_else(|| {
                ServiceError::Protocol(format!(
                    "a snapshot part's payload ends at {} bytes, before {end}",
                    payload.len()
                ))
            })?;
            at = end;
            Ok(oar_transport::bytes_to_f32s(bytes)?)
        };
        let mut out = Vec::with_capacity(blocks.len());
        for (id, state_step) in blocks {
            let len = placement.block(id).filter(|b| b.server == shard).map(|b| b.len).ok_or_else(|| {
                ServiceError::Protocol(format!(
                    "a snapshot part names block {id}, which is not of shard {shard}"
                ))
            })?;
            let params = floats(len)?;
            let slots = floats(len * state_slots)?;
            out.push((id, params, OptimizerState { step: state_step, slots }));
        }
        let rows = match rows {
            None => None,
            Some(RowsPart { table, index, rows, candidates, stats }) => {
                let dim = placement.tables().get(table as usize).map(|t| t.dim).ok_or_else(|| {
                    ServiceError::Protocol(format!(
                        "a snapshot part names sparse table #{table}, which does not exist"
                    ))
                })?;
                let mut out = Vec::with_capacity(rows.len());
                for (id, step, count, last_seen) in rows {
                    let params = floats(dim)?;
                    let slots = floats(dim * state_slots)?;
                    out.push((id, params, step, slots, count, last_seen));
                }
                let candidates = candidates
                    .into_iter()
                    .map(|(id, count, last_seen)| crate::sparse::Candidate { id, count, last_seen })
                    .collect();
                Some(RowChunk { table, index, rows: out, candidates, stats })
            }
        };
        if at != payload.len() {
            return Err(ServiceError::Protocol(format!(
                "{} bytes after a snapshot part's last block",
                payload.len() - at
            )));
        }
        Ok((out, rows))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::History;
    use crate::sparse::{RowPolicy, TableSpec};
    use crate::{optimizer::Adam, Init, Mode, Optimizer, ParamSpec, ParamStore, Placement};

    /// A table's candidates come in parts of their own, at most the limit
    /// each (they came whole in the table's first part: 75M of them were
    /// past the 1 GiB a call carries, and every catch-up of the shard
    /// failed); every part encoded, decoded and taken by a catch-up
    /// rebuilds the store's rows, candidates and counters exactly.
    #[test]
    fn a_tables_candidates_come_in_parts_of_their_own() {
        let policy = RowPolicy { admit_after: 2, ..RowPolicy::default() };
        let table = TableSpec { policy, ..TableSpec::new("emb", 2, Init::Uniform { low: -1.0, high: 1.0 }) };
        let specs = vec![ParamSpec::new("b", vec![3], Init::Zeros)];
        let pl = Placement::new(&specs, 1, 4).unwrap().with_tables(vec![table]).unwrap();
        let adam =
            || -> Box<dyn Optimizer> { Box::new(Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 }) };
        let mut store = ParamStore::new(&pl, 0, 1, adam(), Mode::Async).unwrap();
        // 5000 rows (pushed twice: admitted) and 1000 candidates (once).
        let rows: Vec<u64> = (0..5000).collect();
        let candidates: Vec<u64> = (10_000..11_000).collect();
        let opt = adam();
        let t = store.table_mut(0).unwrap();
        for (now, ids) in [(1, &rows), (2, &rows), (3, &candidates)] {
            t.apply(ids, &vec![0.25; ids.len() * 2], now, opt.as_ref());
        }
        let snapshot = store.catch_up_snapshot().unwrap();
        let ranges = row_part_ranges_of(&snapshot, 300);
        assert_eq!(ranges.len(), 1 + 4, "one part of rows, four of candidates: {ranges:?}");
        assert_eq!(row_part_ranges(&snapshot).len(), 2, "under the real limit, one of candidates");

        let fresh = ParamStore::new_to_restore(&pl, 0, 1, adam(), Mode::Async).unwrap();
        let mut catch_up = CatchUp::new(0, 1, 0, History::starting(1, 1), fresh);
        let row_parts = ranges.len() as u32;
        for range in part_ranges(&snapshot) {
            let (reply, payload) = encode_part(&snapshot, range, row_parts);
            let payload = Bytes::from(payload.concat());
            catch_up.part(decode_part(&pl, 0, 1, 0, 2, reply, payload).unwrap()).unwrap();
        }
        for (index, range) in ranges.into_iter().enumerate() {
            let (reply, payload) = encode_row_part(&snapshot, row_parts, index as u32, range);
            let part = decode_part(&pl, 0, 1, 0, 2, reply, payload).unwrap();
            let chunk = part.rows.as_ref().unwrap();
            assert!(chunk.candidates.len() <= 300, "part {index}: {} candidates", chunk.candidates.len());
            assert!(chunk.rows.is_empty() || chunk.candidates.is_empty(), "part {index}: rows or candidates");
            catch_up.part(part).unwrap();
        }
        let follower = catch_up.finish().unwrap();
        let (theirs, ours) = (&follower.store().tables()[0].snapshot(), &snapshot.tables()[0]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let rows = |t: &crate::sparse::TableSnapshot| {
            t.records()
                .map(|r| (r.id, bits(r.params), r.step, bits(r.slots), r.count, r.last_seen))
                .collect::<Vec<_>>()
        };
        assert_eq!(rows(theirs), rows(ours));
        assert_eq!(theirs.candidates().collect::<Vec<_>>(), ours.candidates().collect::<Vec<_>>());
        assert_eq!((theirs.stats(), ours.candidate_count()), (ours.stats(), 1000));
    }

    #[test]
    fn a_snapshot_part_is_views_of_its_large_blocks_and_one_copy_of_the_small_ones() {
        // Blocks of 20,000 floats (80 KB: sent in place) and one of 10 (copied).
        let specs = vec![
            ParamSpec::new("w", vec![40_000], Init::Normal { mean: 0.0, std: 1.0 }),
            ParamSpec::new("b", vec![10], Init::Constant(0.5)),
        ];
        let pl = Placement::new(&specs, 1, 20_000).unwrap();
        let opt = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        let store = ParamStore::new(&pl, 0, 1, Box::new(opt), Mode::Async).unwrap();
        let snapshot = store.snapshot().unwrap();
        let all = 0..snapshot.blocks().len();
        assert_eq!(all.len(), 3);
        let (reply, payload) = encode_part(&snapshot, all, 0);
        let PsReply::SnapshotPart { blocks, .. } = reply else { panic!("{reply:?}") };
        let wanted: Vec<_> = snapshot.blocks().collect();
        assert_eq!(blocks, wanted.iter().map(|(id, _, s)| (*id, s.step)).collect::<Vec<_>>());
        let expected: Vec<u8> = wanted
            .iter()
            .flat_map(|(_, p, s)| [oar_transport::f32s_to_bytes(p), oar_transport::f32s_to_bytes(&s.slots)])
            .flat_map(|b| b.to_vec())
            .collect();
        assert_eq!(payload.concat(), expected, "params then slots, block by block");
        // w's two blocks, params and slots in place; b's both in one buffer.
        let lens: Vec<usize> = payload.iter().map(Bytes::len).collect();
        assert_eq!(lens, vec![80_000, 160_000, 80_000, 160_000, 40 + 80]);
        if cfg!(target_endian = "little") {
            for (i, (_, params, state)) in wanted.iter().take(2).enumerate() {
                assert_eq!(payload[2 * i].as_ptr(), params.as_ptr().cast::<u8>(), "a view, not a copy");
                assert_eq!(payload[2 * i + 1].as_ptr(), state.slots.as_ptr().cast::<u8>());
            }
        }
    }
}
