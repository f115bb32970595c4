//! The trainers' side of the pserver protocol.
//!
//! The client addresses shards (indexes), not servers: it reads each
//! shard's address from `ps/<index>` and reads it again after a failure, so
//! it follows a pserver that was replaced. Calls to all shards run in
//! parallel. A shard that is away is retried, with the same sequence number
//! (so a push is applied once), until the retry policy's deadline.
//!
//! A shard whose pserver was replaced (a new claim of `ps/<index>`, seen by
//! its create revision) restarted from its last checkpoint, possibly at an
//! earlier step, and without the gradients buffered for the current sync
//! step. The client then stops waiting for a step of the old pserver: the
//! next pull takes the new one's parameters as they are, and a push for a
//! step that shard is not at comes back `Stale` (the trainer rejoins, pulls
//! and computes again). The replacement's barrier rebuilds its membership
//! from the pushes, so its first step may combine fewer trainers than the
//! others; no gradient is applied twice (the checkpoint carries the
//! deduplication table) and nothing waits for a step that cannot come.

use crate::{
    protocol::{PsReply, PsRequest, PSERVER_METHOD},
    Error, ParamBuf, Placement, PushOutcome, Result,
};
use bytes::{Bytes, BytesMut};
use oar_discovery::{Discovery, JobKeys};
use oar_transport::{Connection, RetryPolicy, Transport};
use std::{
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};
use tokio::task::JoinSet;

/// How long one pull asks a server to wait for the next sync step.
const PULL_WAIT: Duration = Duration::from_secs(1);

/// A trainer's connection to every pserver of a job.
pub struct PserverClient {
    inner: Arc<Inner>,
    shards: Vec<ShardState>,
}

struct Inner {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    keys: JobKeys,
    placement: Arc<Placement>,
    trainer: String,
    conns: Vec<Mutex<Option<Arc<dyn Connection>>>>,
    /// Per shard: the create revision of the `ps/<index>` claim last
    /// connected to, which changes when a replacement pserver claims it.
    incarnations: Vec<AtomicI64>,
    call_timeout: Duration,
    retry: RetryPolicy,
}

#[derive(Clone, Copy, Debug, Default)]
struct ShardState {
    /// Next push's sequence number.
    seq: u64,
    /// Step of the parameters last pulled (what a sync push is computed at).
    pulled_step: u64,
    /// Step a sync pull must wait for (one past the last step pushed to).
    next_step: Option<u64>,
    /// The shard's incarnation when it last answered a pull.
    incarnation: i64,
}

/// What a push did, over all shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushResult {
    /// Every shard took the gradient (applied, buffered, or already had it).
    Accepted,
    /// Sync mode: some shard had already moved past the step the gradient
    /// was computed at; pull and compute again.
    Stale,
}

impl PserverClient {
    /// A client for `trainer` of job `job`. `call_timeout` bounds each
    /// attempt, `retry` each whole call.
    pub fn new(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        job: &str,
        placement: Arc<Placement>,
        trainer: &str,
        call_timeout: Duration,
        retry: RetryPolicy,
    ) -> Result<Self> {
        let servers = placement.servers() as usize;
        let inner = Inner {
            discovery,
            transport,
            keys: JobKeys::new(job)?,
            placement,
            trainer: trainer.to_string(),
            conns: (0..servers).map(|_| Mutex::new(None)).collect(),
            incarnations: (0..servers).map(|_| AtomicI64::new(0)).collect(),
            call_timeout,
            retry,
        };
        Ok(Self { inner: Arc::new(inner), shards: vec![ShardState::default(); servers] })
    }

    /// The placement the client splits gradients by.
    pub fn placement(&self) -> &Placement {
        &self.inner.placement
    }

    /// Wait until every shard has published its address, at most `timeout`.
    pub async fn wait_for_servers(&self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut missing = Vec::new();
            for index in 0..self.inner.placement.servers() {
                if self.inner.discovery.get(&self.inner.keys.ps(index)).await?.is_none() {
                    missing.push(index);
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::ServersMissing { missing, waited: timeout });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Join the sync barrier of every shard.
    ///
    /// Each shard counts steps on its own. A trainer that joins while
    /// others are mid-step may enter shard 0 at step s and shard 1 at s+1
    /// (a step completed between the two joins); its first gradient then
    /// lands in those steps. The equivalence with one process on the union
    /// of the batches holds for every step whose membership was fixed, which
    /// is every step while no trainer joins or leaves.
    pub async fn join(&mut self) -> Result<()> {
        let trainer = self.inner.trainer.clone();
        self.on_all(|_| (PsRequest::Join { trainer: trainer.clone() }, Bytes::new())).await?;
        // Pull the current step afresh: the barrier may have moved while we were out.
        self.shards.iter_mut().for_each(|s| s.next_step = None);
        Ok(())
    }

    /// Leave the sync barrier of every shard (when idle), so others do not wait.
    pub async fn leave(&mut self) -> Result<()> {
        let trainer = self.inner.trainer.clone();
        self.on_all(|_| (PsRequest::Leave { trainer: trainer.clone() }, Bytes::new())).await?;
        Ok(())
    }

    /// Pull every parameter into `params`. In sync mode after a push, waits
    /// for the step that push belongs to be applied on every shard.
    pub async fn pull(&mut self, params: &mut ParamBuf) -> Result<()> {
        let fingerprint = self.inner.placement.fingerprint();
        let deadline = tokio::time::Instant::now() + self.inner.retry.give_up_after;
        let mut pending: Vec<u32> = (0..self.inner.placement.servers()).collect();
        while !pending.is_empty() {
            for &index in &pending {
                let shard = &mut self.shards[index as usize];
                let now = self.inner.incarnations[index as usize].load(Ordering::SeqCst);
                if shard.next_step.is_some() && shard.incarnation != now {
                    // A replacement will never reach the old pserver's step with our gradient.
                    tracing::info!(index, "shard restarted; taking its parameters as they are");
                    shard.next_step = None;
                }
            }
            let shards = self.shards.clone();
            let replies = self
                .on_shards(&pending, |index| {
                    let request = PsRequest::Pull {
                        fingerprint,
                        min_step: shards[index as usize].next_step,
                        max_wait_ms: PULL_WAIT.as_millis() as u64,
                    };
                    (request, Bytes::new())
                })
                .await?;
            let mut waiting = Vec::new();
            for (index, reply, payload) in replies {
                match reply {
                    PsReply::Pulled { step, ready: true } => {
                        self.copy_shard(index, &payload, params)?;
                        let shard = &mut self.shards[index as usize];
                        shard.pulled_step = step;
                        shard.incarnation = self.inner.incarnations[index as usize].load(Ordering::SeqCst);
                    }
                    PsReply::Pulled { ready: false, .. } => waiting.push(index),
                    other => {
                        return Err(Error::Protocol(format!("shard {index} answered a pull with {other:?}")))
                    }
                }
            }
            if !waiting.is_empty() && tokio::time::Instant::now() >= deadline {
                return Err(Error::BarrierTimeout {
                    shards: waiting,
                    waited: self.inner.retry.give_up_after,
                });
            }
            pending = waiting;
        }
        Ok(())
    }

    /// Push `grads` (the mean gradient over `weight` examples), split into
    /// the placement's blocks, to every shard at once.
    pub async fn push(&mut self, grads: &ParamBuf, weight: f32) -> Result<PushResult> {
        let fingerprint = self.inner.placement.fingerprint();
        let trainer = self.inner.trainer.clone();
        let shards = self.shards.clone();
        let placement = self.inner.placement.clone();
        let replies = self
            .on_all(|index| {
                let payload = shard_payload(&placement, index, grads);
                let state = shards[index as usize];
                let request = PsRequest::Push {
                    fingerprint,
                    trainer: trainer.clone(),
                    seq: state.seq,
                    step: state.pulled_step,
                    weight,
                };
                (request, payload)
            })
            .await?;
        let mut result = PushResult::Accepted;
        for (index, reply, _) in replies {
            let shard = &mut self.shards[index as usize];
            shard.seq += 1;
            match reply {
                PsReply::Pushed(PushOutcome::Applied { .. } | PushOutcome::Buffered { .. }) => {
                    shard.next_step = Some(shard.pulled_step + 1);
                }
                PsReply::Pushed(PushOutcome::Duplicate) => {}
                PsReply::Stale { current } => {
                    tracing::debug!(index, current, "stale sync push");
                    shard.next_step = None;
                    result = PushResult::Stale;
                }
                other => {
                    return Err(Error::Protocol(format!("shard {index} answered a push with {other:?}")))
                }
            }
        }
        Ok(result)
    }

    /// Async mode: push `grads` (the mean gradient over `weight` examples)
    /// and pull every parameter into `params` in one round trip per shard:
    /// each shard applies the push and answers with its parameters after it.
    /// Sync pservers refuse it.
    pub async fn push_pull(&mut self, grads: &ParamBuf, weight: f32, params: &mut ParamBuf) -> Result<()> {
        let fingerprint = self.inner.placement.fingerprint();
        let trainer = self.inner.trainer.clone();
        let shards = self.shards.clone();
        let placement = self.inner.placement.clone();
        let replies = self
            .on_all(|index| {
                let request = PsRequest::PushPull {
                    fingerprint,
                    trainer: trainer.clone(),
                    seq: shards[index as usize].seq,
                    weight,
                };
                (request, shard_payload(&placement, index, grads))
            })
            .await?;
        for (index, reply, payload) in replies {
            match reply {
                PsReply::PushedPulled { step, .. } => {
                    self.copy_shard(index, &payload, params)?;
                    let shard = &mut self.shards[index as usize];
                    shard.seq += 1;
                    shard.pulled_step = step;
                    shard.next_step = None;
                    shard.incarnation = self.inner.incarnations[index as usize].load(Ordering::SeqCst);
                }
                other => {
                    return Err(Error::Protocol(format!("shard {index} answered a push-pull with {other:?}")))
                }
            }
        }
        Ok(())
    }

    /// In async mode a pull never waits for a step.
    pub fn forget_steps(&mut self) {
        self.shards.iter_mut().for_each(|s| s.next_step = None);
    }

    fn copy_shard(&self, index: u32, payload: &[u8], params: &mut ParamBuf) -> Result<()> {
        let expected: usize = self.inner.placement.blocks_on(index).map(|b| b.len * 4).sum();
        if payload.len() != expected {
            return Err(Error::Protocol(format!(
                "shard {index} sent {} bytes of parameters, expected {expected}",
                payload.len()
            )));
        }
        let mut at = 0;
        for block in self.inner.placement.blocks_on(index) {
            let dst = &mut params.param_mut(block.id.param as usize)[block.offset..block.offset + block.len];
            oar_transport::copy_f32s_from_bytes(dst, &payload[at..at + block.len * 4])?;
            at += block.len * 4;
        }
        Ok(())
    }

    async fn on_all(
        &self,
        make: impl FnMut(u32) -> (PsRequest, Bytes),
    ) -> Result<Vec<(u32, PsReply, Bytes)>> {
        let all: Vec<u32> = (0..self.inner.placement.servers()).collect();
        self.on_shards(&all, make).await
    }

    /// Send one request to each of `shards` in parallel, each retried on its own.
    async fn on_shards(
        &self,
        shards: &[u32],
        mut make: impl FnMut(u32) -> (PsRequest, Bytes),
    ) -> Result<Vec<(u32, PsReply, Bytes)>> {
        let mut calls = JoinSet::new();
        for &index in shards {
            let (request, payload) = make(index);
            let inner = self.inner.clone();
            calls.spawn(async move {
                let result = inner.call(index, &request, payload).await;
                (index, result)
            });
        }
        let mut replies = Vec::with_capacity(shards.len());
        while let Some(joined) = calls.join_next().await {
            let (index, result) =
                joined.map_err(|e| Error::Protocol(format!("a shard call panicked: {e}")))?;
            let (reply, payload) = result?;
            replies.push((index, reply, payload));
        }
        replies.sort_by_key(|(index, _, _)| *index);
        Ok(replies)
    }
}

/// The blocks of shard `index`, cut from `grads` and concatenated.
fn shard_payload(placement: &Placement, index: u32, grads: &ParamBuf) -> Bytes {
    let mut payload = BytesMut::new();
    for block in placement.blocks_on(index) {
        let param = grads.param(block.id.param as usize);
        oar_transport::put_f32s(&mut payload, &param[block.offset..block.offset + block.len]);
    }
    payload.freeze()
}

impl Inner {
    async fn connection(&self, index: u32) -> Result<Arc<dyn Connection>> {
        let slot = &self.conns[index as usize];
        if let Some(conn) = slot.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(conn);
        }
        let key = self.keys.ps(index);
        let kv =
            self.discovery.get(&key).await?.ok_or_else(|| Error::ShardAway { index, key: key.clone() })?;
        let incarnation = kv.create_revision;
        let addr = String::from_utf8(kv.value).map_err(|_| Error::ShardAway { index, key })?;
        let conn = self.transport.connect(&addr).await?;
        let before = self.incarnations[index as usize].swap(incarnation, Ordering::SeqCst);
        if before != 0 && before != incarnation {
            tracing::info!(index, addr, "following a replaced pserver");
        }
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    async fn call(&self, index: u32, request: &PsRequest, payload: Bytes) -> Result<(PsReply, Bytes)> {
        self.retry
            .run(|| async {
                let conn = self.connection(index).await?;
                let result = oar_transport::call(
                    conn.as_ref(),
                    PSERVER_METHOD,
                    request,
                    payload.clone(),
                    self.call_timeout,
                )
                .await
                .map_err(Error::from);
                if result.is_err() {
                    *self.conns[index as usize].lock().unwrap_or_else(PoisonError::into_inner) = None;
                }
                result
            })
            .await
    }
}
