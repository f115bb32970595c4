//! The trainers' side of the pserver protocol.
//!
//! The client addresses logical shards, not servers: it follows the job's
//! [`ShardMap`](crate::ShardMap) and the pservers' addresses
//! ([`TopologyWatch`]) and calls each shard's primary. A primary that is
//! not (any more) answers `NotPrimary`, and the client looks the shard up
//! in a newer map; a shard that is away (its primary died and no map names
//! another yet) is retried, with the same sequence number (so a push is
//! applied once), until the retry policy's deadline. Calls to all shards
//! run in parallel.
//!
//! No copies on the trainer's side: a push sends each block of the
//! gradient from where it is in the trainer's buffer, and a pull writes
//! each shard's reply into the parameters' blocks as the bytes arrive
//! ([`oar_transport::Connection::call_parts`]), so a trainer needs no
//! message-sized buffer (peak memory 1.03x its parameters and gradients
//! for a 100M-float model; `BENCHMARKS.md`, "Memory").
//!
//! A shard's blocks travel in parts of at most
//! [`PserverClient::set_max_part_bytes`] bytes (8 MiB by default), each a
//! call of its own, at most [`PARTS_IN_FLIGHT`] at a time per shard, so a
//! pserver holds a few parts in flight, not a message as large as its
//! shard, and it applies or copies out one part while the next one
//! travels. A push's parts share its sequence number; each is
//! deduplicated on its own. In the sync barrier a part is answered once its
//! blocks are updated (every member pushed them), so it needs only the
//! other trainers' parts of the same blocks, which are in flight too: the
//! lowest block not yet updated is in every trainer's lowest unanswered
//! part. The step's completion is replicated before the part that completes
//! it is answered; a part answered earlier is not, and if the shard's
//! primary changes while its push travels, every part of the push goes
//! again (see [`MAX_PUSH_RESENDS`]).
//!
//! A shard whose primary changed (a new *epoch* in the map) may be at an
//! earlier sync step than the old primary was (the gradients buffered for
//! the step underway are not replicated: only completed steps are), or,
//! with one replica per shard, restored from its last checkpoint. The
//! client then stops waiting for a step of the old primary: the next pull
//! takes the new one's parameters as they are, and a sync push computed at
//! the parameters of a primary whose updates the new one does not continue
//! comes back `Stale`, whatever its step (a shard restored at step 33 and
//! stepped once by another trainer is at step 34 again, with other
//! parameters than the old primary's 34): each push carries the epoch of
//! the primary whose parameters it was computed at, and a primary that
//! restored the shard takes none from an earlier epoch (a promoted
//! follower or a moved shard goes on from its old primary's updates). A
//! retry of a push taken already is still a duplicate. After a stale push
//! the trainer leaves the barrier of every shard and joins again (pulls
//! and computes again), so that its place in each shard's steps is set
//! afresh. No gradient is applied twice: followers keep the deduplication
//! table of async pushes, and a checkpoint carries it.

use crate::{
    error::{ServiceError as Error, ServiceResult as Result},
    protocol::{BatchCall, BlockSpan, PsReply, PsRequest, PulledShard, ShardRows, TableRows, PSERVER_METHOD},
    topology::{Topology, TopologyWatch},
    Origin, ParamBuf, Placement, PserverKeys, PushOutcome,
};
use oar_discovery::Discovery;
use oar_transport::{Connection, RetryPolicy, Transport};
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

/// How long one pull asks a server to wait for the next sync step.
const PULL_WAIT: Duration = Duration::from_secs(1);

/// The default largest part of a shard's blocks sent or asked for in one call.
pub const DEFAULT_MAX_PART_BYTES: usize = 8 << 20;

/// Calls per shard in flight at once when its blocks go in several parts:
/// two, so the pserver applies (or copies out) one part while the next
/// one travels.
pub const PARTS_IN_FLIGHT: usize = 2;

/// In the sync barrier, how many times a shard's push is sent again, whole,
/// when its primary changed while the push travelled (the parts the old
/// primary answered before its step was complete went with it; a part the
/// new primary has is a duplicate there). After that the push's answer is
/// taken as it is (a new primary's step waiting for a part times out, and
/// the part is retried, as any call).
pub const MAX_PUSH_RESENDS: usize = 8;

/// A trainer's connection to every pserver of a job.
///
/// Each call goes to a shard's primary. A small exchange (a push, pull or
/// push-pull of at most 256 KiB in all, as a small or sparse model's are)
/// goes to each pserver in one call for all the shards it is primary of
/// ([`PsRequest::Batch`]):
/// a job of many shards on few pservers pays a round trip per pserver, not
/// per shard. A shard the batch did not settle (its primary moved, or it
/// answered an error) is called again on its own, with the usual retries.
pub struct PserverClient {
    inner: Arc<Inner>,
    shards: Vec<ShardState>,
    max_part_bytes: usize,
    /// The origin the next pushes carry ([`set_origin`](Self::set_origin)).
    origin: Option<Origin>,
    /// Joined the sync barrier (and not left): a push goes again, whole,
    /// to a shard whose primary changed while it travelled.
    in_barrier: bool,
}

/// How a [`PserverClient`] finds and calls the pservers.
#[derive(Clone, Debug)]
pub struct PserverClientOptions {
    /// Where the shard map and the pservers' registrations are (only
    /// `shard_map` and `pservers` are read).
    pub keys: PserverKeys,
    /// Who calls: the trainer id its pushes carry (for deduplication and
    /// the sync barrier's order).
    pub trainer: String,
    /// Bound of one attempt of a call.
    pub call_timeout: Duration,
    /// How long, and how often, a shard that is away is retried.
    pub retry: RetryPolicy,
    /// The largest part of a shard's blocks sent or asked for in one call
    /// (a larger block goes alone): smaller parts bound what a pserver holds
    /// in flight, larger ones cost fewer calls.
    pub max_part_bytes: usize,
    /// The sequence number of this client's first push to each shard
    /// ([`first_seq_now`] by default). A shard takes a trainer's push
    /// whose seq is below one it took already for a retry, answered
    /// `Duplicate` and not applied, so a trainer restarted under its id
    /// (the trainer role re-registers it; a Kubernetes pod restarted in
    /// place keeps its name) must start above every seq it used before.
    pub first_seq: u64,
}

/// A first sequence number above those of any earlier client of the same
/// trainer: the wall clock in microseconds since the Unix epoch.
///
/// Why it holds: a client pushes to a shard far less than once a
/// microsecond (a push is a round trip, tens of microseconds at least), so
/// its seqs stay below the clock; and a restarted trainer registers its id
/// only once the old process's lease has expired, so a clock set back by
/// less than that lease plus the old process's life still starts above.
/// Seqs only need to grow per trainer: a skewed clock between machines
/// matters only to a trainer moved to one behind by more than that.
pub fn first_seq_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2))
}

impl PserverClientOptions {
    /// Options for `trainer` calling the shards mapped under `keys`:
    /// 10 s calls, the default retry policy, parts of
    /// [`DEFAULT_MAX_PART_BYTES`].
    pub fn new(keys: PserverKeys, trainer: impl Into<String>) -> Self {
        Self {
            keys,
            trainer: trainer.into(),
            call_timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            max_part_bytes: DEFAULT_MAX_PART_BYTES,
            first_seq: first_seq_now(),
        }
    }
}

/// One call of an exchange: shard `index`, its blocks at positions `blocks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Part {
    index: u32,
    blocks: BlockSpan,
}

struct Inner {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    keys: PserverKeys,
    placement: Arc<Placement>,
    trainer: String,
    /// Started on first use.
    topology: tokio::sync::OnceCell<TopologyWatch>,
    /// Connections to the pservers, by name.
    conns: Mutex<HashMap<String, Arc<dyn Connection>>>,
    /// Per shard: the epoch of the primary that last answered, which
    /// changes when another replica takes over.
    epochs: Vec<AtomicU64>,
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
    /// The shard's primary's epoch when it last answered with parameters
    /// (a pull, a push-pull) or took us in (a join): what a sync push
    /// carries, so that a primary of another epoch does not take a
    /// gradient computed at another primary's parameters.
    epoch: u64,
    /// Pushes the shard acknowledged as taken (not stale).
    acknowledged: u64,
    /// Pushes the shard answered [`PushOutcome::AppliedBefore`].
    applied_before: u64,
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
    /// A client of the shards `placement` names, mapped under `options.keys`.
    pub fn new(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        placement: Arc<Placement>,
        options: PserverClientOptions,
    ) -> Self {
        let servers = placement.servers() as usize;
        let inner = Inner {
            discovery,
            transport,
            keys: options.keys,
            placement,
            trainer: options.trainer,
            topology: tokio::sync::OnceCell::new(),
            conns: Mutex::new(HashMap::new()),
            epochs: (0..servers).map(|_| AtomicU64::new(0)).collect(),
            call_timeout: options.call_timeout,
            retry: options.retry,
        };
        Self {
            inner: Arc::new(inner),
            shards: vec![ShardState { seq: options.first_seq, ..ShardState::default() }; servers],
            max_part_bytes: options.max_part_bytes.max(1),
            origin: None,
            in_barrier: false,
        }
    }

    /// Cut each shard's blocks into calls of at most `bytes` (see
    /// [`PserverClientOptions::max_part_bytes`]).
    pub fn set_max_part_bytes(&mut self, bytes: usize) {
        self.max_part_bytes = bytes.max(1);
    }

    fn parts(&self, shards: &[u32]) -> Vec<Part> {
        cut_parts(&self.inner.placement, shards, self.max_part_bytes)
    }

    /// The placement the client splits gradients by.
    pub fn placement(&self) -> &Placement {
        &self.inner.placement
    }

    /// Wait until the shard map gives every shard that holds blocks a
    /// registered primary, at most `timeout`.
    pub async fn wait_for_servers(&self, timeout: Duration) -> Result<()> {
        let topology = self.inner.topology().await?;
        let missing = |now: &Topology| -> Vec<u32> {
            self.inner.shards_in_use().filter(|&s| now.primary_addr(s).is_none()).collect()
        };
        let mut rx = topology.subscribe();
        // `wait_for` fails only once nothing follows the topology, which
        // cannot happen while `topology` is held: not ready is a time-out.
        let ready = tokio::time::timeout(timeout, rx.wait_for(|now| missing(now).is_empty()))
            .await
            .is_ok_and(|seen| seen.is_ok());
        if ready {
            Ok(())
        } else {
            Err(Error::ServersMissing { missing: missing(&topology.current()), waited: timeout })
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
    ///
    /// A shard whose current step is underway (some of its blocks already
    /// updated) counts the trainer from the next step: the next pull waits
    /// for that step.
    pub async fn join(&mut self) -> Result<()> {
        let trainer = self.inner.trainer.clone();
        for (index, reply) in self.on_all(|shard| PsRequest::Join { shard, trainer: trainer.clone() }).await?
        {
            let PsReply::Joined { step } = reply else {
                return Err(Error::Protocol(format!("shard {index} answered a join with {reply:?}")));
            };
            // Pull from the step we count in: the barrier may have moved while we were out.
            let shard = &mut self.shards[index as usize];
            shard.next_step = Some(step);
            shard.epoch = self.inner.epochs[index as usize].load(Ordering::SeqCst);
        }
        self.in_barrier = true;
        Ok(())
    }

    /// After a stale sync push: leave the barrier of every shard and join
    /// again, so that this trainer's place in each shard's steps is set
    /// afresh. Joining again alone would leave it where it was on the
    /// shards that took the push and one step later on those that did not;
    /// two such shifts apart, two trainers each wait for the other's next
    /// push and neither comes.
    pub async fn rejoin(&mut self) -> Result<()> {
        self.leave().await?;
        self.join().await
    }

    /// Leave the sync barrier of every shard (when idle), so others do not wait.
    pub async fn leave(&mut self) -> Result<()> {
        let trainer = self.inner.trainer.clone();
        self.on_all(|shard| PsRequest::Leave { shard, trainer: trainer.clone() }).await?;
        self.in_barrier = false;
        Ok(())
    }

    /// Pull every parameter into `params`. In sync mode after a push, waits
    /// for the step that push belongs to be applied on every shard. Each
    /// shard's reply is written straight into `params` as it arrives.
    pub async fn pull(&mut self, params: &mut ParamBuf) -> Result<()> {
        let fingerprint = self.inner.placement.fingerprint();
        let deadline = oar_transport::deadline_in(self.inner.retry.give_up_after);
        let mut pending: Vec<u32> = self.inner.shards_in_use().collect();
        while !pending.is_empty() {
            for &index in &pending {
                let shard = &mut self.shards[index as usize];
                let now = self.inner.epochs[index as usize].load(Ordering::SeqCst);
                if shard.next_step.is_some() && shard.epoch != now {
                    // A new primary may never reach the old one's step with our gradient.
                    tracing::info!(
                        shard = index,
                        "shard has a new primary; taking its parameters as they are"
                    );
                    shard.next_step = None;
                }
            }
            let parts = self.parts(&pending);
            let calls = parts
                .iter()
                .map(|part| PsRequest::Pull {
                    shard: part.index,
                    fingerprint,
                    blocks: part.blocks,
                    min_step: self.shards[part.index as usize].next_step,
                    max_wait_ms: PULL_WAIT.as_millis() as u64,
                })
                .collect();
            let replies = self
                .exchange(
                    &parts,
                    calls,
                    None,
                    &[],
                    Some(&mut *params),
                    PARTS_IN_FLIGHT,
                    &mut Riders::default(),
                )
                .await?;
            // Per shard: every part ready, at the lowest step any part was at
            // (so a sync push is never for a step some block has not reached).
            let mut pulled: Vec<(u32, Option<u64>)> = Vec::new();
            for (part, reply) in replies {
                let step = match reply {
                    PsReply::Pulled { step, ready: true } => Some(step),
                    PsReply::Pulled { ready: false, .. } => None,
                    other => {
                        return Err(Error::Protocol(format!(
                            "shard {} answered a pull with {other:?}",
                            part.index
                        )))
                    }
                };
                match pulled.last_mut() {
                    Some((index, at)) if *index == part.index => *at = at.zip(step).map(|(a, b)| a.min(b)),
                    _ => pulled.push((part.index, step)),
                }
            }
            let mut waiting = Vec::new();
            for (index, step) in pulled {
                match step {
                    Some(step) => self.pulled(index, step),
                    None => waiting.push(index),
                }
            }
            if !waiting.is_empty() {
                tracing::debug!(?waiting, "pull: shards not at their step yet");
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
    /// the placement's blocks, to every shard at once, each block sent from
    /// where it is in `grads`.
    pub async fn push(&mut self, grads: &ParamBuf, weight: f32) -> Result<PushResult> {
        self.push_rows(grads, &[], weight).await
    }

    /// [`push`](Self::push) with row gradients of the sparse tables: each
    /// row goes to its shard ([`Placement::row_shard`]) in the same push
    /// as the shard's blocks (its first part), so it is applied once, and
    /// in sync mode in the same step.
    pub async fn push_rows(
        &mut self,
        grads: &ParamBuf,
        rows: &[TableGrads<'_>],
        weight: f32,
    ) -> Result<PushResult> {
        let replies = self.send_push(grads, rows, weight, None, &mut Riders::default()).await?;
        // Per shard: stale if any part was; else taken if any part was (the
        // rest were retries of parts already taken); applied before if
        // every part was.
        let mut outcomes: Vec<(u32, Option<u64>, bool, bool)> = Vec::new();
        for (part, reply) in replies {
            let index = part.index;
            let (stale, taken, before) = match reply {
                PsReply::Pushed(PushOutcome::Applied { .. } | PushOutcome::Buffered { .. }) => {
                    (None, true, false)
                }
                PsReply::Pushed(PushOutcome::Duplicate) => (None, false, false),
                PsReply::Pushed(PushOutcome::AppliedBefore) => (None, false, true),
                PsReply::Stale { current } => (Some(current), false, false),
                other => {
                    return Err(Error::Protocol(format!("shard {index} answered a push with {other:?}")))
                }
            };
            match outcomes.last_mut() {
                Some((i, s, t, b)) if *i == index => {
                    *s = s.or(stale);
                    *t |= taken;
                    *b &= before;
                }
                _ => outcomes.push((index, stale, taken, before)),
            }
        }
        let mut result = PushResult::Accepted;
        for (index, stale, taken, before) in outcomes {
            let shard = &mut self.shards[index as usize];
            shard.seq += 1;
            shard.acknowledged += u64::from(stale.is_none());
            shard.applied_before += u64::from(before);
            if let Some(current) = stale {
                tracing::debug!(index, current, "stale sync push");
                shard.next_step = None;
                result = PushResult::Stale;
            } else if taken {
                shard.next_step = Some(shard.pulled_step + 1);
            }
        }
        Ok(result)
    }

    /// Push `grads` (the mean gradient over `weight` examples) and pull
    /// every parameter into `params` in one round trip: each shard applies
    /// the push and answers with its parameters after it.
    /// Sync, a shard answers each part once its blocks are updated, with
    /// their next step's parameters, so the push is answered when its step
    /// completes (one round trip per step, the floor); a shard that
    /// moved on without the push answers stale, and its parameters in
    /// `params` are left as they were: join, pull and compute again. Async
    /// pushes are always [`PushResult::Accepted`].
    pub async fn push_pull(
        &mut self,
        grads: &ParamBuf,
        weight: f32,
        params: &mut ParamBuf,
    ) -> Result<PushResult> {
        self.push_pull_rows(grads, &[], weight, params).await
    }

    /// [`push_pull`](Self::push_pull) with row gradients, as
    /// [`push_rows`](Self::push_rows) sends them (the rows are pushed, the
    /// dense parameters pulled back).
    pub async fn push_pull_rows(
        &mut self,
        grads: &ParamBuf,
        rows: &[TableGrads<'_>],
        weight: f32,
        params: &mut ParamBuf,
    ) -> Result<PushResult> {
        let replies = self.send_push(grads, rows, weight, Some(params), &mut Riders::default()).await?;
        self.pushed_pulled(replies)
    }

    /// [`push_pull_rows`](Self::push_pull_rows), and in the same round
    /// trip the rows of `ahead.ids` (a trainer's next batch) into
    /// `ahead.out`, as [`pull_rows`](Self::pull_rows) would pull them
    /// just after: each pserver reads them once it answered the push (in
    /// sync mode, at the step the push went into). So a sparse batch costs
    /// one round trip, not two. Best effort: `true` only if every row came,
    /// and the push was accepted. The rows do not come, and `ahead.out`
    /// holds nothing of use, when the exchange is too large to travel in
    /// one batch per pserver (more than 256 KiB both ways), when a shard's
    /// primary changed on the way, when the ids are more than
    /// [`pull_rows`](Self::pull_rows) takes, or when the push was stale;
    /// pull them then.
    pub async fn push_pull_rows_ahead(
        &mut self,
        grads: &ParamBuf,
        rows: &[TableGrads<'_>],
        weight: f32,
        params: &mut ParamBuf,
        ahead: RowsAhead<'_, '_>,
    ) -> Result<(PushResult, bool)> {
        let Ok(plan) = self.plan_rows(ahead.ids, ahead.out) else {
            return Ok((self.push_pull_rows(grads, rows, weight, params).await?, false));
        };
        // Sync: the rows of the step after the push's, which the
        // pserver has reached once it answered the push.
        let in_barrier = self.in_barrier;
        let mut riders = Riders {
            asks: plan
                .wanted
                .keys()
                .map(|&shard| {
                    let after = in_barrier.then(|| self.shards[shard as usize].pulled_step + 1);
                    plan.shard_rows(ahead.ids, shard, after)
                })
                .collect(),
            answers: Vec::new(),
        };
        let replies = self.send_push(grads, rows, weight, Some(params), &mut riders).await?;
        let result = self.pushed_pulled(replies)?;
        if result != PushResult::Accepted {
            return Ok((result, false));
        }
        // Every shard's rows, and in sync mode at the step of the
        // parameters its push-pull brought back. (A reply that does not
        // parse leaves the rows to a pull: the push was taken all the same.)
        let mut answered = std::collections::BTreeSet::new();
        let mut complete = true;
        for (shards, reply, payload) in riders.answers {
            let at_step =
                |shard: u32, step: u64| !in_barrier || self.shards[shard as usize].pulled_step == step;
            match plan.take(&shards, reply, &payload, ahead.out, at_step) {
                Ok(waiting) => complete &= waiting.is_empty(),
                Err(e) => {
                    tracing::debug!(error = %e, "rows asked with a push did not come");
                    complete = false;
                }
            }
            answered.extend(shards);
        }
        Ok((result, complete && plan.wanted.keys().all(|shard| answered.contains(shard))))
    }

    /// What a push-pull's replies say, noted per shard.
    fn pushed_pulled(&mut self, replies: Vec<(Part, PsReply)>) -> Result<PushResult> {
        // Per shard: the least step of its parts' parameters (None: stale),
        // and whether every part was applied before.
        let mut steps: Vec<(u32, Option<u64>, bool)> = Vec::new();
        for (part, reply) in replies {
            let (step, before) = match reply {
                PsReply::PushedPulled { step, outcome } => {
                    (Some(step), outcome == PushOutcome::AppliedBefore)
                }
                PsReply::Stale { .. } => (None, false),
                other => {
                    return Err(Error::Protocol(format!(
                        "shard {} answered a push-pull with {other:?}",
                        part.index
                    )))
                }
            };
            match steps.last_mut() {
                Some((index, at, b)) if *index == part.index => {
                    *at = at.zip(step).map(|(a, s)| a.min(s));
                    *b &= before;
                }
                _ => steps.push((part.index, step, before)),
            }
        }
        let mut result = PushResult::Accepted;
        for (index, step, before) in steps {
            let shard = &mut self.shards[index as usize];
            shard.seq += 1;
            shard.next_step = None;
            let Some(step) = step else {
                tracing::debug!(index, "stale sync push-pull");
                result = PushResult::Stale;
                continue;
            };
            shard.acknowledged += 1;
            shard.applied_before += u64::from(before);
            self.pulled(index, step);
        }
        Ok(result)
    }

    /// A push request per part of `parts`, with its rows' descriptions.
    fn push_requests(&self, parts: &[Part], metas: Vec<Vec<TableRows>>, weight: f32) -> Vec<PsRequest> {
        let fingerprint = self.inner.placement.fingerprint();
        parts
            .iter()
            .zip(metas)
            .map(|(part, rows)| {
                let state = self.shards[part.index as usize];
                PsRequest::Push {
                    shard: part.index,
                    fingerprint,
                    blocks: part.blocks,
                    trainer: self.inner.trainer.clone(),
                    seq: state.seq,
                    step: state.pulled_step,
                    weight,
                    rows,
                    origin: self.origin,
                    epoch: state.epoch,
                }
            })
            .collect()
    }

    /// Send a push of `grads` and `rows` to every shard in use, each part
    /// from where it is in `grads` (with `params`, a push-pull whose
    /// replies go into `params`); the replies, a shard's parts together. In
    /// the sync barrier, a shard whose primary changed while its parts
    /// travelled gets every part again, at most [`MAX_PUSH_RESENDS`] times:
    /// a part its old primary answered before the step was complete went
    /// with that primary (not if a part came back stale: the step is lost
    /// anyway, and the trainer joins again).
    async fn send_push(
        &mut self,
        grads: &ParamBuf,
        rows: &[TableGrads<'_>],
        weight: f32,
        mut params: Option<&mut ParamBuf>,
        riders: &mut Riders,
    ) -> Result<Vec<(Part, PsReply)>> {
        let epoch_now = |inner: &Inner, index: u32| inner.epochs[index as usize].load(Ordering::SeqCst);
        let mut shards: Vec<u32> = self.inner.shards_in_use().collect();
        let mut replies: Vec<(Part, PsReply)> = Vec::new();
        for round in 0..=MAX_PUSH_RESENDS {
            let before: Vec<u64> = shards.iter().map(|&i| epoch_now(&self.inner, i)).collect();
            let parts = self.parts(&shards);
            let (metas, extra) = self.route_rows(&parts, rows)?;
            let calls = self
                .push_requests(&parts, metas, weight)
                .into_iter()
                .map(|push| push.with_pull(params.is_some()))
                .collect();
            // Riders go with the first round only: a resent push's rows
            // are pulled afterwards.
            let mut ride = if round == 0 { std::mem::take(riders) } else { Riders::default() };
            let sent = self
                .exchange(
                    &parts,
                    calls,
                    Some(grads),
                    &extra,
                    params.as_deref_mut(),
                    PARTS_IN_FLIGHT,
                    &mut ride,
                )
                .await?;
            if round == 0 {
                riders.answers = ride.answers;
            } else {
                riders.answers.clear();
            }
            replies.retain(|(part, _)| !shards.contains(&part.index));
            let moved: Vec<u32> = shards
                .iter()
                .zip(before)
                .filter(|&(&index, before)| epoch_now(&self.inner, index) != before)
                .map(|(&index, _)| index)
                .filter(|index| {
                    !sent
                        .iter()
                        .any(|(part, reply)| part.index == *index && matches!(reply, PsReply::Stale { .. }))
                })
                .collect();
            replies.extend(sent);
            if !self.in_barrier || moved.is_empty() {
                break;
            }
            if round < MAX_PUSH_RESENDS {
                tracing::info!(shards = ?moved, "a shard's primary changed while a sync push travelled: sending it again");
            }
            shards = moved;
        }
        Ok(replies)
    }

    /// Row gradients sorted to their shards: per part of `parts`, its
    /// request's row descriptions and their values' bytes (only the first
    /// part of each shard carries any, see [`crate::Push`]). Errors for a
    /// table that does not exist or values that do not fit its dim.
    fn route_rows(&self, parts: &[Part], rows: &[TableGrads<'_>]) -> Result<RoutedRows> {
        let placement = &self.inner.placement;
        let mut metas: Vec<Vec<TableRows>> = parts.iter().map(|_| Vec::new()).collect();
        let mut bytes: Vec<Vec<u8>> = parts.iter().map(|_| Vec::new()).collect();
        if rows.is_empty() {
            return Ok((metas, bytes));
        }
        // The first part of each shard.
        let mut first: HashMap<u32, usize> = HashMap::new();
        for (k, part) in parts.iter().enumerate() {
            first.entry(part.index).or_insert(k);
        }
        for r in rows {
            let dim = check_table_rows(placement, r.table, r.ids.len(), r.grads.len())?;
            let mut by_part: HashMap<usize, usize> = HashMap::new();
            for (id, g) in r.ids.iter().zip(r.grads.chunks_exact(dim)) {
                let shard = placement.row_shard(r.table, *id).unwrap_or_default();
                let Some(&k) = first.get(&shard) else { continue };
                let at = *by_part.entry(k).or_insert_with(|| {
                    metas[k].push(TableRows { table: r.table, ids: Vec::new() });
                    metas[k].len() - 1
                });
                metas[k][at].ids.push(*id);
                bytes[k].extend_from_slice(&oar_transport::f32s_as_le_bytes(g));
            }
        }
        Ok((metas, bytes))
    }

    /// Pull rows of the sparse tables: for each `(table, ids)` of `rows`,
    /// the ids' values into `out` (same position, `ids.len() * dim` values,
    /// replaced). One call per pserver for all the shards it is primary
    /// of; a shard that moved is asked again where the map points. In sync
    /// mode after a push, waits for the step that push belongs to, as
    /// [`pull`](Self::pull) does. A row not created yet reads as its
    /// initial value. At most [`MAX_ROWS_PER_CALL`](crate::sparse::MAX_ROWS_PER_CALL)
    /// ids in all: a larger pull is refused here, before anything is sent
    /// (a pserver refuses it too); split the batch.
    pub async fn pull_rows(&mut self, rows: &[(u32, &[u64])], out: &mut [Vec<f32>]) -> Result<()> {
        let plan = self.plan_rows(rows, out)?;
        let fingerprint = self.inner.placement.fingerprint();
        let deadline = oar_transport::deadline_in(self.inner.retry.give_up_after);
        let mut pending: Vec<u32> = plan.wanted.keys().copied().collect();
        while !pending.is_empty() {
            // One call per pserver: group the shards by their primary now.
            let topology = self.inner.topology().await?.current();
            let mut groups: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
            for &shard in &pending {
                let name = topology.primary_addr(shard).map(|(name, _)| name.to_string()).unwrap_or_default();
                groups.entry(name).or_default().push(shard);
            }
            let calls = groups.into_values().map(|shards| {
                let request = PsRequest::PullRows {
                    fingerprint,
                    shards: shards
                        .iter()
                        .map(|&shard| plan.shard_rows(rows, shard, self.shards[shard as usize].next_step))
                        .collect(),
                    max_wait_ms: PULL_WAIT.as_millis() as u64,
                };
                let inner = &self.inner;
                async move {
                    let mut payload = Collected::default();
                    let reply = inner.call(shards[0], &request, &[], &mut payload).await;
                    (shards, reply, payload.0)
                }
            });
            let mut waiting = Vec::new();
            for (shards, reply, payload) in oar_transport::join_all(calls).await {
                waiting.extend(plan.take(&shards, reply?, &payload, out, |_, _| true)?);
            }
            if !waiting.is_empty() {
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::BarrierTimeout {
                        shards: waiting,
                        waited: self.inner.retry.give_up_after,
                    });
                }
                let topology = self.inner.topology().await?;
                topology
                    .newer_than(
                        topology.current().map.as_ref().map_or(0, |m| m.version()),
                        Duration::from_millis(50),
                    )
                    .await;
            }
            pending = waiting;
        }
        Ok(())
    }

    /// A row pull of `rows` checked (see [`pull_rows`](Self::pull_rows))
    /// and planned, `out` sized for it.
    fn plan_rows(&self, rows: &[(u32, &[u64])], out: &mut [Vec<f32>]) -> Result<RowPlan> {
        let placement = &self.inner.placement;
        if out.len() != rows.len() {
            return Err(Error::Protocol(format!("{} outputs for {} tables' rows", out.len(), rows.len())));
        }
        let asked: usize = rows.iter().map(|(_, ids)| ids.len()).sum();
        if asked > crate::sparse::MAX_ROWS_PER_CALL {
            let table = rows.iter().max_by_key(|(_, ids)| ids.len()).map_or(0, |(t, _)| *t);
            return Err(crate::Error::TooManyRows {
                table: table_spec(placement, table)?.name.clone(),
                got: asked,
                max: crate::sparse::MAX_ROWS_PER_CALL,
            }
            .into());
        }
        let mut plan = RowPlan { wanted: Default::default(), dims: Vec::with_capacity(rows.len()) };
        for (k, (table, ids)) in rows.iter().enumerate() {
            let dim = table_spec(placement, *table)?.dim;
            plan.dims.push(dim);
            out[k].clear();
            out[k].resize(ids.len() * dim, 0.0);
            for (i, id) in ids.iter().enumerate() {
                let shard = placement.row_shard(*table, *id).unwrap_or_default();
                let per = plan.wanted.entry(shard).or_default();
                match per.iter_mut().find(|(t, _)| *t == k) {
                    Some((_, at)) => at.push(i),
                    None => per.push((k, vec![i])),
                }
            }
        }
        Ok(plan)
    }

    /// The pushes shard `shard` acknowledged as taken (a sync push that
    /// came back stale there was not, even if other shards took it): what
    /// the shard's [`ParamStore::pushes`](crate::ParamStore::pushes) counts
    /// of this trainer.
    pub fn acknowledged(&self, shard: u32) -> u64 {
        self.shards.get(shard as usize).map_or(0, |s| s.acknowledged)
    }

    /// Pushes, summed over the shards, that a shard answered
    /// [`PushOutcome::AppliedBefore`]: their examples were applied already
    /// (see [`set_origin`](Self::set_origin)).
    pub fn applied_before(&self) -> u64 {
        self.shards.iter().map(|s| s.applied_before).sum()
    }

    /// The origin the pushes from now on carry, until set again: which
    /// examples of which task their gradient comes from. A shard applies
    /// the examples of an origin once, whoever pushes them (see
    /// [`crate::origin`]); a trainer sets it before each push. `None` (the
    /// default): pushes are deduplicated by trainer and seq only.
    pub fn set_origin(&mut self, origin: Option<Origin>) {
        self.origin = origin;
    }

    /// [`acknowledged`](Self::acknowledged) of every shard that took any.
    pub fn acknowledged_by_shard(&self) -> std::collections::BTreeMap<u32, u64> {
        let counts = self.shards.iter().enumerate().map(|(s, st)| (s as u32, st.acknowledged));
        counts.filter(|&(_, n)| n > 0).collect()
    }

    /// In async mode a pull never waits for a step.
    pub fn forget_steps(&mut self) {
        self.shards.iter_mut().for_each(|s| s.next_step = None);
    }

    /// Shard `index` answered with its parameters at `step`.
    fn pulled(&mut self, index: u32, step: u64) {
        let shard = &mut self.shards[index as usize];
        shard.pulled_step = step;
        shard.epoch = self.inner.epochs[index as usize].load(Ordering::SeqCst);
    }

    /// One call without blocks to every shard that holds blocks.
    async fn on_all(&self, make: impl FnMut(u32) -> PsRequest) -> Result<Vec<(u32, PsReply)>> {
        let all: Vec<Part> =
            self.inner.shards_in_use().map(|index| Part { index, blocks: BlockSpan::new(0, 0) }).collect();
        let calls = all.iter().map(|part| part.index).map(make).collect();
        let replies =
            self.exchange(&all, calls, None, &[], None, PARTS_IN_FLIGHT, &mut Riders::default()).await?;
        Ok(replies.into_iter().map(|(part, reply)| (part.index, reply)).collect())
    }

    /// Make each of `parts`' calls with its request (`requests`, same
    /// order), all shards at once and up to `in_flight` per shard,
    /// each call retried on its own. With `grads`, a request's payload is
    /// the part's blocks of it, sent from where they are; with `params`, a
    /// reply's payload is written into the part's blocks of it as it
    /// arrives. Replies come back in the order of `parts`. The `riders`'
    /// row pulls go along in a small exchange's batches (their answers in
    /// `riders.answers`), not in a large one.
    #[allow(clippy::too_many_arguments)]
    async fn exchange(
        &self,
        parts: &[Part],
        requests: Vec<PsRequest>,
        grads: Option<&ParamBuf>,
        extra: &[Vec<u8>],
        params: Option<&mut ParamBuf>,
        in_flight: usize,
        riders: &mut Riders,
    ) -> Result<Vec<(Part, PsReply)>> {
        let placement = &self.inner.placement;
        let mut sinks = match params {
            Some(params) => ShardSink::split(placement, parts, params)?,
            None => parts.iter().map(|_| ShardSink::empty()).collect(),
        };
        let payloads: Vec<Vec<std::borrow::Cow<'_, [u8]>>> = parts
            .iter()
            .enumerate()
            .map(|(k, part)| {
                let mut pieces: Vec<std::borrow::Cow<'_, [u8]>> = match grads {
                    Some(grads) => part_blocks(placement, part)
                        .map(|b| {
                            let param = grads.param(b.id.param as usize);
                            oar_transport::f32s_as_le_bytes(&param[b.offset..b.offset + b.len])
                        })
                        .collect(),
                    None => Vec::new(),
                };
                if let Some(rows) = extra.get(k).filter(|r| !r.is_empty()) {
                    pieces.push(std::borrow::Cow::Borrowed(rows.as_slice()));
                }
                pieces
            })
            .collect();
        let message_bytes: usize = payloads.iter().flatten().map(|p| p.len()).sum::<usize>()
            + sinks.iter().map(|s| s.expected as usize).sum::<usize>();
        let mut outcomes = if message_bytes <= SMALL_CALLS_UP_TO {
            self.exchange_small(parts, requests, &payloads, &mut sinks, riders).await
        } else {
            // Lanes: each runs its calls one after another; a shard's parts
            // are dealt to `in_flight` lanes of their own.
            let mut lanes: Vec<Vec<_>> = Vec::new();
            let mut lane_of: std::collections::HashMap<(u32, usize), usize> = Default::default();
            let mut nth_of_shard: std::collections::HashMap<u32, usize> = Default::default();
            for (at, (((part, request), payload), sink)) in
                parts.iter().zip(requests).zip(payloads.iter()).zip(sinks.iter_mut()).enumerate()
            {
                let nth = nth_of_shard.entry(part.index).or_default();
                let key = (part.index, *nth % in_flight);
                *nth += 1;
                let lane = *lane_of.entry(key).or_insert_with(|| {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                });
                lanes[lane].push((at, *part, request, payload, sink));
            }
            let lanes = lanes.into_iter().map(|calls| {
                let inner = &self.inner;
                async move {
                    let mut done = Vec::with_capacity(calls.len());
                    for (at, part, request, payload, sink) in calls {
                        let pieces: Vec<&[u8]> = payload.iter().map(|p| p.as_ref()).collect();
                        let reply = inner.call(part.index, &request, &pieces, sink).await;
                        let failed = reply.is_err();
                        done.push((at, reply, sink.is_complete()));
                        if failed {
                            break; // The exchange fails anyway.
                        }
                    }
                    done
                }
            });
            oar_transport::join_all(lanes).await.into_iter().flatten().collect()
        };
        outcomes.sort_by_key(|(at, _, _)| *at);
        let mut replies = Vec::with_capacity(parts.len());
        for (at, reply, complete) in outcomes {
            let part = parts[at];
            let reply = reply?;
            let carries_params =
                matches!(reply, PsReply::Pulled { ready: true, .. } | PsReply::PushedPulled { .. });
            if carries_params && !complete {
                return Err(Error::Protocol(format!("shard {} answered without its parameters", part.index)));
            }
            replies.push((part, reply));
        }
        if replies.len() != parts.len() {
            return Err(Error::Protocol(format!("{} of {} calls answered", replies.len(), parts.len())));
        }
        Ok(replies)
    }

    /// [`exchange`](Self::exchange) for small messages: the calls to
    /// shards whose primary is the same pserver go together in one
    /// [`PsRequest::Batch`] (one round trip instead of one per shard), and
    /// the batches, and calls alone, run all at once in the caller's task,
    /// with copies of the payload and of the reply, which is then written
    /// into the sinks. Outcomes are tagged with the call's position in
    /// `parts`.
    async fn exchange_small(
        &self,
        parts: &[Part],
        requests: Vec<PsRequest>,
        payloads: &[Vec<std::borrow::Cow<'_, [u8]>>],
        sinks: &mut [ShardSink<Borrowed<'_>>],
        riders: &mut Riders,
    ) -> Vec<(usize, Result<PsReply>, bool)> {
        // Calls grouped by the pserver their shard's primary is now; a
        // shard that cannot be looked up goes alone (its call says why).
        let mut groups: Vec<(Option<Primary>, Vec<SmallCall>)> = Vec::new();
        // Per shard looked up: its group and its primary's epoch.
        let mut group_of: HashMap<u32, (usize, u64)> = HashMap::new();
        for (at, ((part, request), payload)) in parts.iter().zip(requests).zip(payloads).enumerate() {
            let (primary, epoch) = match self.inner.connection(part.index).await {
                Ok((name, conn, _, epoch)) => (Some((name, conn)), Some(epoch)),
                Err(_) => (None, None),
            };
            let call =
                SmallCall { at, shard: part.index, epoch, request, payload: payload.concat(), rider: false };
            let same = |p: &Option<Primary>| matches!((p, &primary), (Some((a, _)), Some((b, _))) if a == b);
            let group = match groups
                .iter_mut()
                .position(|(p, calls)| same(p) && calls.len() < crate::protocol::MAX_BATCH_CALLS)
            {
                Some(g) => {
                    groups[g].1.push(call);
                    g
                }
                None => {
                    groups.push((primary, vec![call]));
                    groups.len() - 1
                }
            };
            if let Some(epoch) = epoch {
                group_of.insert(part.index, (group, epoch));
            }
        }
        // The riders' rows, one pull per pserver, in the batch going there
        // (a shard whose call could not be looked up is left to a pull).
        let mut rides: Vec<(usize, u64, Vec<ShardRows>)> = Vec::new();
        for ask in std::mem::take(&mut riders.asks) {
            let Some(&(group, epoch)) = group_of.get(&ask.shard) else { continue };
            match rides.iter_mut().find(|(g, _, _)| *g == group) {
                Some((_, _, asks)) => asks.push(ask),
                None => rides.push((group, epoch, vec![ask])),
            }
        }
        let fingerprint = self.inner.placement.fingerprint();
        let mut ridden: Vec<Vec<u32>> = Vec::new();
        for (group, epoch, asks) in rides {
            let calls = &mut groups[group].1;
            if calls.len() >= crate::protocol::MAX_BATCH_CALLS {
                continue;
            }
            let shards: Vec<u32> = asks.iter().map(|a| a.shard).collect();
            calls.push(SmallCall {
                at: parts.len() + ridden.len(),
                shard: shards.first().copied().unwrap_or_default(),
                epoch: Some(epoch),
                payload: Vec::new(),
                rider: true,
                // The pserver answers it after the batch's pushes: no wait.
                request: PsRequest::PullRows { fingerprint, shards: asks, max_wait_ms: 0 },
            });
            ridden.push(shards);
        }
        // Every pserver's group at once, in the caller's task: a spawned
        // task per group would put the first on the other worker's queue
        // (tokio wakes a parked worker for it), a cross-core wake-up per
        // step on a round-trip-bound trainer.
        let groups = groups.into_iter().map(|(primary, calls)| self.inner.call_small(primary, calls));
        let mut outcomes = Vec::with_capacity(parts.len());
        for answered in oar_transport::join_all(groups).await {
            for (at, reply, bytes) in answered {
                if let Some(shards) = at.checked_sub(parts.len()).and_then(|k| ridden.get_mut(k)) {
                    if let Ok(reply) = reply {
                        riders.answers.push((std::mem::take(shards), reply, bytes));
                    }
                    continue;
                }
                let Some(sink) = sinks.get_mut(at) else { continue };
                let reply = reply.and_then(|reply| {
                    oar_transport::PayloadSink::start(sink, bytes.len() as u64)?;
                    oar_transport::PayloadSink::write(sink, &bytes);
                    Ok(reply)
                });
                outcomes.push((at, reply, sink.is_complete()));
            }
        }
        outcomes
    }
}

/// Where the rows of a row pull go: per shard, per table of the pull
/// (its position in the caller's list), the positions of its ids; and
/// each table's dim.
struct RowPlan {
    wanted: std::collections::BTreeMap<u32, Vec<(usize, Vec<usize>)>>,
    dims: Vec<usize>,
}

impl RowPlan {
    /// What the pull asks of `shard`, not before `min_step`.
    fn shard_rows(&self, rows: &[(u32, &[u64])], shard: u32, min_step: Option<u64>) -> ShardRows {
        let tables = self.wanted.get(&shard).map_or(&[][..], Vec::as_slice);
        ShardRows {
            shard,
            min_step,
            tables: tables
                .iter()
                .map(|(k, at)| TableRows {
                    table: rows[*k].0,
                    ids: at.iter().map(|&i| rows[*k].1[i]).collect(),
                })
                .collect(),
        }
    }

    /// The rows a pserver answered for `shards` (asked in that order) put
    /// into `out`, those of a shard `accept`s (by shard and step); the
    /// shards whose rows did not come or were not accepted.
    fn take(
        &self,
        shards: &[u32],
        reply: PsReply,
        payload: &[u8],
        out: &mut [Vec<f32>],
        accept: impl Fn(u32, u64) -> bool,
    ) -> Result<Vec<u32>> {
        let answers = match reply {
            PsReply::PulledRows { shards: answers } if answers.len() == shards.len() => answers,
            other => return Err(Error::Protocol(format!("a row pull was answered with {other:?}"))),
        };
        let mut values = payload.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        let mut waiting = Vec::new();
        for (&shard, answer) in shards.iter().zip(answers) {
            let PulledShard::Rows { step } = answer else {
                waiting.push(shard);
                continue;
            };
            let keep = accept(shard, step);
            if !keep {
                waiting.push(shard);
            }
            for (k, at) in self.wanted.get(&shard).map_or(&[][..], Vec::as_slice) {
                let dim = self.dims[*k];
                for &i in at {
                    for v in &mut out[*k][i * dim..(i + 1) * dim] {
                        let value = values
                            .next()
                            .ok_or_else(|| Error::Protocol(format!("shard {shard}'s rows ended early")))?;
                        if keep {
                            *v = value;
                        }
                    }
                }
            }
        }
        if values.next().is_some() {
            return Err(Error::Protocol("a row pull's payload is longer than its rows".into()));
        }
        Ok(waiting)
    }
}

/// One small call of [`PserverClient::exchange_small`]: its position, its
/// shard (and the shard's epoch in the map it was grouped by), its request
/// and its payload.
struct SmallCall {
    at: usize,
    shard: u32,
    epoch: Option<u64>,
    request: PsRequest,
    payload: Vec<u8>,
    /// A rider's row pull: answered in its batch or not at all.
    rider: bool,
}

/// Row pulls that ride along a push's small exchange
/// ([`PserverClient::push_pull_rows_ahead`]): the rows asked of each
/// shard, and the answers that came, per pserver: its shards (in the
/// order asked), its reply and the reply's payload.
#[derive(Default)]
struct Riders {
    asks: Vec<ShardRows>,
    answers: Vec<(Vec<u32>, PsReply, Vec<u8>)>,
}

/// The rows of a trainer's next batch, asked for with its push
/// ([`PserverClient::push_pull_rows_ahead`]).
#[derive(Debug)]
pub struct RowsAhead<'ids, 'out> {
    /// Per table, the ids, as [`PserverClient::pull_rows`] takes them.
    pub ids: &'ids [(u32, &'ids [u64])],
    /// Where their values go, as in [`PserverClient::pull_rows`].
    pub out: &'out mut [Vec<f32>],
}

/// A shard's primary: its name and a connection to it.
type Primary = (String, Arc<dyn Connection>);

/// Per part of a push: its request's row descriptions, and their values' bytes.
type RoutedRows = (Vec<Vec<TableRows>>, Vec<Vec<u8>>);

/// One sparse table's row gradients for a push: `grads` holds
/// `ids.len() * dim` values, row after row. Ids must be unique (sum a
/// batch's gradients per id first).
#[derive(Clone, Copy, Debug)]
pub struct TableGrads<'a> {
    /// The table's index in [`Placement::tables`].
    pub table: u32,
    /// The rows.
    pub ids: &'a [u64],
    /// Their gradients.
    pub grads: &'a [f32],
}

/// The spec of table `table`, or an error naming it.
fn table_spec(placement: &Placement, table: u32) -> Result<&crate::sparse::TableSpec> {
    let tables = placement.tables();
    Ok(tables.get(table as usize).ok_or(crate::Error::NoSuchTable { table, tables: tables.len() })?)
}

/// Table `table` exists and `values` fit `ids` rows of it: its dim.
fn check_table_rows(placement: &Placement, table: u32, ids: usize, values: usize) -> Result<usize> {
    let t = table_spec(placement, table)?;
    if values != ids * t.dim {
        return Err(crate::Error::RowGradLength {
            table: t.name.clone(),
            expected: ids * t.dim,
            got: values,
        }
        .into());
    }
    Ok(t.dim)
}

/// Each of `shards`' blocks, cut into parts of at most `max_bytes` (a
/// larger block alone), in shard then block order. Shards without blocks
/// have no part, or, in a job with sparse tables, one without blocks (for
/// their rows).
fn cut_parts(placement: &Placement, shards: &[u32], max_bytes: usize) -> Vec<Part> {
    let mut parts = Vec::new();
    for &index in shards {
        let (mut start, mut end, mut bytes) = (0u32, 0u32, 0usize);
        for block in placement.blocks_on(index) {
            let len = block.len * 4;
            if end > start && bytes + len > max_bytes {
                parts.push(Part { index, blocks: BlockSpan::new(start, end) });
                (start, bytes) = (end, 0);
            }
            bytes += len;
            end += 1;
        }
        if end > start || (end == 0 && !placement.tables().is_empty()) {
            parts.push(Part { index, blocks: BlockSpan::new(start, end) });
        }
    }
    parts
}

/// The blocks of `part`, in order.
fn part_blocks<'p>(placement: &'p Placement, part: &Part) -> impl Iterator<Item = &'p crate::BlockInfo> {
    let span = part.blocks.range();
    placement.blocks_on(part.index).skip(span.start).take(span.len())
}

/// Messages (both ways, all shards) up to this many bytes go as copies,
/// a batch per pserver, all at once in the caller's task
/// ([`PserverClient::exchange_small`]); larger ones are sent from and
/// received into the trainer's buffers.
const SMALL_CALLS_UP_TO: usize = 256 << 10;

/// A reply's payload kept in a buffer of its own.
#[derive(Default)]
struct Collected(Vec<u8>);

impl oar_transport::PayloadSink for Collected {
    fn start(&mut self, len: u64) -> oar_transport::Result<()> {
        self.0.clear();
        // The transport bounds `len` by its message limit; reserve no more
        // than a small message anyway.
        self.0.reserve(usize::try_from(len).unwrap_or(0).min(SMALL_CALLS_UP_TO));
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

/// Where one shard's reply payload goes, value by value as the bytes
/// arrive: the shard's blocks of the trainer's parameters ([`Borrowed`]), or
/// a catch-up's fresh blocks ([`Fresh`]). Accepts exactly those blocks'
/// bytes, or none (a pull that is not ready, or a reply that carries no
/// parameters).
pub(crate) struct ShardSink<B> {
    blocks: B,
    expected: u64,
    received: u64,
    /// Bytes of a value split across two writes.
    carry: ([u8; 4], usize),
}

/// The blocks a [`ShardSink`] fills, in order.
pub(crate) trait SinkBlocks {
    /// The values all the blocks take.
    fn values(&self) -> usize;
    /// Start again from the first value of the first block.
    fn restart(&mut self);
    /// Write the values of `bytes` (whole little-endian `f32`s) that fit
    /// in the current block; how many: 0 once every block is full (or for
    /// fewer than 4 bytes).
    fn put(&mut self, bytes: &[u8]) -> usize;
}

/// A sink's blocks as slices of values there already (a pull into the
/// trainer's parameters), overwritten.
pub(crate) struct Borrowed<'a> {
    blocks: Vec<&'a mut [f32]>,
    /// Where the next value goes: block, element.
    at: (usize, usize),
}

impl SinkBlocks for Borrowed<'_> {
    fn values(&self) -> usize {
        self.blocks.iter().map(|b| b.len()).sum()
    }

    fn restart(&mut self) {
        self.at = (0, 0);
    }

    fn put(&mut self, bytes: &[u8]) -> usize {
        while self.at.0 < self.blocks.len() && self.at.1 == self.blocks[self.at.0].len() {
            self.at = (self.at.0 + 1, 0);
        }
        let (at, start) = self.at;
        let Some(block) = self.blocks.get_mut(at) else { return 0 };
        let n = (block.len() - start).min(bytes.len() / 4);
        // Lengths match by construction: `n` values, `4n` bytes.
        let _ = oar_transport::copy_f32s_from_bytes(&mut block[start..start + n], &bytes[..n * 4]);
        self.at.1 += n;
        n
    }
}

/// A sink's blocks as new vectors of the given lengths, filled by
/// appending: nothing is zeroed first, which on a heap whose memory was
/// used before cost a pass over every byte of a catch-up (`calloc` clears
/// recycled memory).
pub(crate) struct Fresh {
    /// Each block and the length it is filled to.
    blocks: Vec<(Vec<f32>, usize)>,
    at: usize,
}

impl Fresh {
    /// Empty blocks of `lens` values each (reserved, not written).
    pub(crate) fn new(lens: impl IntoIterator<Item = usize>) -> Fresh {
        Fresh { blocks: lens.into_iter().map(|len| (Vec::with_capacity(len), len)).collect(), at: 0 }
    }

    /// The blocks, as far as they were filled.
    pub(crate) fn into_blocks(self) -> impl Iterator<Item = Vec<f32>> {
        self.blocks.into_iter().map(|(block, _)| block)
    }
}

impl SinkBlocks for Fresh {
    fn values(&self) -> usize {
        self.blocks.iter().map(|(_, len)| len).sum()
    }

    fn restart(&mut self) {
        self.blocks.iter_mut().for_each(|(block, _)| block.clear());
        self.at = 0;
    }

    fn put(&mut self, bytes: &[u8]) -> usize {
        while self.blocks.get(self.at).is_some_and(|(block, len)| block.len() == *len) {
            self.at += 1;
        }
        let Some((block, len)) = self.blocks.get_mut(self.at) else { return 0 };
        let n = (*len - block.len()).min(bytes.len() / 4);
        block.extend(bytes[..n * 4].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        n
    }
}

impl<'a> ShardSink<Borrowed<'a>> {
    fn empty() -> ShardSink<Borrowed<'a>> {
        ShardSink::over(Borrowed { blocks: Vec::new(), at: (0, 0) })
    }

    /// One sink per part of `parts`, over disjoint pieces of `params`.
    fn split(
        placement: &Placement,
        parts: &[Part],
        params: &'a mut ParamBuf,
    ) -> Result<Vec<ShardSink<Borrowed<'a>>>> {
        // (flat offset, len, position of the part in `parts`), carved in
        // offset order, then handed to each part in its block order.
        let mut ranges = Vec::new();
        for (k, part) in parts.iter().enumerate() {
            for b in part_blocks(placement, part) {
                let offset = params.offset(b.id.param as usize).ok_or_else(|| {
                    Error::Protocol(format!("block {:?} names a parameter the model does not have", b.id))
                })?;
                ranges.push((offset + b.offset, b.len, k));
            }
        }
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&i| ranges[i].0);
        let mut carved: Vec<Option<&'a mut [f32]>> = ranges.iter().map(|_| None).collect();
        let mut rest: &'a mut [f32] = params.as_mut_slice();
        let mut base = 0;
        for i in order {
            let (start, len, _) = ranges[i];
            let skip = start.checked_sub(base).filter(|&s| s + len <= rest.len()).ok_or_else(|| {
                Error::Protocol(format!("blocks overlap or run past the model at element {start}"))
            })?;
            let (block, after) = std::mem::take(&mut rest)[skip..].split_at_mut(len);
            carved[i] = Some(block);
            rest = after;
            base = start + len;
        }
        let mut sinks: Vec<ShardSink<Borrowed<'a>>> = parts.iter().map(|_| ShardSink::empty()).collect();
        for ((_, len, k), block) in ranges.into_iter().zip(carved) {
            let sink = &mut sinks[k];
            sink.expected += len as u64 * 4;
            sink.blocks.blocks.extend(block);
        }
        Ok(sinks)
    }
}

impl<B: SinkBlocks> ShardSink<B> {
    /// A sink that fills `blocks`.
    pub(crate) fn over(blocks: B) -> ShardSink<B> {
        let expected = blocks.values() as u64 * 4;
        ShardSink { blocks, expected, received: 0, carry: ([0; 4], 0) }
    }

    /// The bytes the blocks take.
    pub(crate) fn expected_bytes(&self) -> u64 {
        self.expected
    }

    /// Whether all the expected bytes arrived.
    pub(crate) fn is_complete(&self) -> bool {
        self.received == self.expected
    }

    /// The blocks it filled.
    pub(crate) fn into_inner(self) -> B {
        self.blocks
    }
}

impl<B: SinkBlocks + Send> oar_transport::PayloadSink for ShardSink<B> {
    fn start(&mut self, len: u64) -> oar_transport::Result<()> {
        if len != self.expected && len != 0 {
            return Err(oar_transport::Error::PayloadLength {
                expected: self.expected as usize,
                got: len as usize,
            });
        }
        self.received = 0;
        self.blocks.restart();
        self.carry.1 = 0;
        Ok(())
    }

    fn write(&mut self, mut bytes: &[u8]) {
        self.received += bytes.len() as u64;
        if self.carry.1 > 0 {
            let take = (4 - self.carry.1).min(bytes.len());
            self.carry.0[self.carry.1..self.carry.1 + take].copy_from_slice(&bytes[..take]);
            self.carry.1 += take;
            bytes = &bytes[take..];
            if self.carry.1 < 4 {
                return;
            }
            self.carry.1 = 0;
            let value = self.carry.0;
            self.blocks.put(&value);
        }
        while bytes.len() >= 4 {
            let n = self.blocks.put(bytes);
            if n == 0 {
                return;
            }
            bytes = &bytes[n * 4..];
        }
        self.carry.0[..bytes.len()].copy_from_slice(bytes);
        self.carry.1 = bytes.len();
    }
}

impl Inner {
    async fn topology(&self) -> Result<&TopologyWatch> {
        self.topology.get_or_try_init(|| TopologyWatch::start(self.discovery.clone(), &self.keys)).await
    }

    /// The shards that hold at least one block, or every shard in a job
    /// with sparse tables (the others take no call).
    fn shards_in_use(&self) -> impl Iterator<Item = u32> + '_ {
        let tables = !self.placement.tables().is_empty();
        (0..self.placement.servers()).filter(move |&s| tables || self.placement.blocks_on(s).next().is_some())
    }

    /// A connection to shard `index`'s primary, with its name and the map's
    /// version and the primary's epoch.
    async fn connection(&self, index: u32) -> Result<(String, Arc<dyn Connection>, u64, u64)> {
        let topology = self.topology().await?.current();
        let map = topology.map.as_ref().ok_or_else(|| Error::ShardAway {
            shard: index,
            why: "no shard map yet (is the coordinator, in the master, running?)".into(),
        })?;
        let (name, addr) = topology.primary_addr(index).ok_or_else(|| Error::ShardAway {
            shard: index,
            why: match map.primary(index) {
                None => format!("no replica in shard map version {}", map.version()),
                Some(p) => format!("its primary {p} is not registered (gone?)"),
            },
        })?;
        let (version, epoch) = (map.version(), map.epoch(index));
        let cached = self.conns.lock().unwrap_or_else(PoisonError::into_inner).get(name).cloned();
        let conn = match cached {
            Some(conn) => conn,
            None => {
                let conn = self.transport.connect(addr).await?;
                self.conns
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(name.to_string(), conn.clone());
                conn
            }
        };
        Ok((name.to_string(), conn, version, epoch))
    }

    /// `calls` (to shards whose primary the map named as `primary`; none
    /// if it could not be looked up) answered, each with its reply's
    /// payload: together in one batch when there are several, and any call the batch did not answer
    /// (the batch failed, or that shard's answer was an error or "not its
    /// primary") made again alone, with [`call`](Self::call)'s retries,
    /// all at once. A call made twice is safe: a push carries its seq, and
    /// the shard drops one it applied.
    async fn call_small(
        &self,
        primary: Option<Primary>,
        calls: Vec<SmallCall>,
    ) -> Vec<(usize, Result<PsReply>, Vec<u8>)> {
        let mut answered = Vec::with_capacity(calls.len());
        let mut alone = calls;
        if let Some((name, conn)) = primary.filter(|_| alone.len() > 1) {
            let batch = std::mem::take(&mut alone);
            let mut replies = self.call_batch(&name, conn.as_ref(), &batch).await.map(Vec::into_iter);
            if let Err(e) = &replies {
                tracing::debug!(calls = batch.len(), error = %e, "a batch failed: its calls go again alone");
            }
            for call in batch {
                match replies.as_mut().ok().and_then(Iterator::next).flatten() {
                    Some((reply, bytes)) => answered.push((call.at, Ok(reply), bytes)),
                    None if call.rider => {}
                    None => alone.push(call),
                }
            }
        }
        // All at once, as they would have gone without the batch: a sync
        // part may be answered only once another part of the same step is
        // in.
        let alone = alone.iter().map(|call| async move {
            let mut reply_payload = Collected::default();
            let reply = self.call(call.shard, &call.request, &[&call.payload], &mut reply_payload).await;
            (call.at, reply, reply_payload.0)
        });
        answered.extend(oar_transport::join_all(alone).await);
        answered
    }

    /// One attempt at `calls` in a [`PsRequest::Batch`] to `name`, their
    /// shards' primary when they were grouped: per call, its reply and
    /// payload, or `None` where the batch's answer does not settle it (an
    /// error, or a shard this pserver is not primary of).
    async fn call_batch(
        &self,
        name: &str,
        conn: &dyn Connection,
        calls: &[SmallCall],
    ) -> Result<Vec<Option<(PsReply, Vec<u8>)>>> {
        let first = calls.first().map_or(0, |c| c.shard);
        let request = PsRequest::Batch {
            calls: calls
                .iter()
                .map(|c| BatchCall { request: c.request.clone(), payload_len: c.payload.len() as u64 })
                .collect(),
        };
        let payloads: Vec<&[u8]> = calls.iter().map(|c| c.payload.as_slice()).collect();
        let mut collected = Collected::default();
        let reply = self.attempt(conn, first, name, &request, &payloads, &mut collected).await;
        let answers = match reply {
            Ok(PsReply::Batch { answers }) if answers.len() == calls.len() => answers,
            Ok(other) => {
                return Err(Error::Protocol(format!(
                    "{name} answered a batch of {} calls with {other:?}",
                    calls.len()
                )))
            }
            Err(e) => {
                self.conns.lock().unwrap_or_else(PoisonError::into_inner).remove(name);
                return Err(e);
            }
        };
        let declared = answers.iter().try_fold(0u64, |sum, a| sum.checked_add(a.payload_len));
        if declared != Some(collected.0.len() as u64) {
            return Err(Error::Protocol(format!(
                "{name}'s batch answer declares {declared:?} payload bytes and carries {}",
                collected.0.len()
            )));
        }
        let mut at = 0;
        let mut settled = Vec::with_capacity(calls.len());
        for (answer, call) in answers.into_iter().zip(calls) {
            let len = answer.payload_len as usize;
            let bytes = collected.0[at..at + len].to_vec();
            at += len;
            settled.push(match (answer.reply, call.epoch) {
                (Ok(PsReply::NotPrimary { .. }), _) | (Err(_), _) | (_, None) => None,
                (Ok(reply), Some(epoch)) => {
                    self.follow_epoch(call.shard, name, epoch);
                    Some((reply, bytes))
                }
            });
        }
        Ok(settled)
    }

    /// One attempt of a call to `name`, shard `index`'s primary. A primary
    /// that dies does not answer: the attempt ends as soon as the map
    /// moves the shard off `name`, rather than at the call's timeout. (A
    /// push retried elsewhere is deduplicated by its seq.)
    async fn attempt(
        &self,
        conn: &dyn Connection,
        index: u32,
        name: &str,
        request: &PsRequest,
        parts: &[&[u8]],
        sink: &mut dyn oar_transport::PayloadSink,
    ) -> Result<PsReply> {
        let call = oar_transport::call_parts(conn, PSERVER_METHOD, request, parts, sink, self.call_timeout);
        let topology = self.topology().await?;
        tokio::select! {
            result = call => result.map_err(Error::from),
            () = topology.until_moved(index, name) => Err(Error::ShardAway {
                shard: index,
                why: format!("{name} no longer serves it (gone, or the map moved it)"),
            }),
        }
    }

    /// Note that shard `index`'s primary `name` answered under `epoch`.
    fn follow_epoch(&self, index: u32, name: &str, epoch: u64) {
        let before = self.epochs[index as usize].swap(epoch, Ordering::SeqCst);
        if before != 0 && before != epoch {
            tracing::info!(shard = index, primary = name, epoch, "following the shard's new primary");
        }
    }

    /// One call to shard `index`'s primary, retried while the shard is
    /// away or its primary changes: the request's payload is `parts`
    /// joined; the reply's goes into `sink`.
    async fn call(
        &self,
        index: u32,
        request: &PsRequest,
        parts: &[&[u8]],
        sink: &mut dyn oar_transport::PayloadSink,
    ) -> Result<PsReply> {
        let mut retrying = self.retry.start();
        loop {
            let (name, result, version) = match self.connection(index).await {
                Ok((name, conn, version, epoch)) => {
                    let result = self.attempt(conn.as_ref(), index, &name, request, parts, sink).await;
                    self.follow_epoch(index, &name, epoch);
                    (Some(name), result, version)
                }
                Err(e) => (None, Err(e), 0),
            };
            let failed = match result {
                Ok(PsReply::NotPrimary { map_version, .. }) => {
                    // Its map or ours is behind: wait for a newer one (briefly).
                    let topology = self.topology().await?;
                    topology.newer_than(version, Duration::from_millis(100)).await;
                    Error::ShardAway {
                        shard: index,
                        why: format!(
                            "{} is not its primary (its map: version {map_version})",
                            name.unwrap_or_default()
                        ),
                    }
                }
                Ok(reply) => return Ok(reply),
                Err(e) => {
                    if let Some(name) = &name {
                        self.conns.lock().unwrap_or_else(PoisonError::into_inner).remove(name);
                    }
                    e
                }
            };
            if !retrying.again(&failed).await {
                return Err(failed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Init, ParamSpec};
    use oar_transport::PayloadSink;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the model's layout, however the shards are cut into parts
        /// and however the reply's bytes are cut into writes, each part's
        /// sink puts every value in its place.
        #[test]
        fn shard_sinks_put_every_value_in_place(
            lens in prop::collection::vec(1usize..40, 1..5),
            servers in 1u32..4,
            block_size in 1usize..17,
            cuts in prop::collection::vec(0usize..200, 0..12),
            max_part_bytes in 1usize..100,
        ) {
            let specs: Vec<ParamSpec> =
                lens.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), vec![n], Init::Zeros)).collect();
            let placement = Placement::new(&specs, servers, block_size).unwrap();
            let mut want = ParamBuf::zeros(&specs);
            want.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 + 0.5);
            let mut got = ParamBuf::zeros(&specs);
            let shards: Vec<u32> = (0..servers).rev().collect();
            let parts = cut_parts(&placement, &shards, max_part_bytes);
            for part in &parts {
                let bytes: usize = part_blocks(&placement, part).map(|b| b.len * 4).sum();
                prop_assert!(bytes <= max_part_bytes || part.blocks.range().len() == 1, "{part:?} too large");
            }
            let cover: Vec<(u32, usize)> =
                parts.iter().flat_map(|p| p.blocks.range().map(move |b| (p.index, b))).collect();
            let all: Vec<(u32, usize)> =
                shards.iter().flat_map(|&s| (0..placement.blocks_on(s).count()).map(move |b| (s, b))).collect();
            prop_assert_eq!(cover, all, "the parts cover every block once, in order");
            let mut sinks = ShardSink::split(&placement, &parts, &mut got).unwrap();
            for (sink, part) in sinks.iter_mut().zip(&parts) {
                // What the part's reply carries: its blocks of `want`, in order.
                let mut bytes = Vec::new();
                for b in part_blocks(&placement, part) {
                    let param = want.param(b.id.param as usize);
                    bytes.extend_from_slice(&f32s_as_le(&param[b.offset..b.offset + b.len]));
                }
                prop_assert!(sink.start(bytes.len() as u64 + 4).is_err(), "a wrong length is refused");
                sink.start(bytes.len() as u64).unwrap();
                write_in_cuts(sink, &bytes, &cuts);
                prop_assert!(sink.is_complete());
            }
            drop(sinks);
            prop_assert_eq!(got.as_slice(), want.as_slice());
        }
    }

    proptest! {
        /// A catch-up's fresh blocks take the same bytes, however they are
        /// cut, block after block; a reply that starts again refills them,
        /// and bytes past the blocks are not taken.
        #[test]
        fn fresh_blocks_are_filled_in_order(
            lens in prop::collection::vec(0usize..40, 1..6),
            cuts in prop::collection::vec(0usize..200, 0..12),
            restart_at in 0usize..300,
        ) {
            let total: usize = lens.iter().sum();
            let values: Vec<f32> = (0..total).map(|i| i as f32 * 0.25 - 3.0).collect();
            let bytes = f32s_as_le(&values);
            let mut sink = ShardSink::over(Fresh::new(lens.iter().copied()));
            prop_assert!(sink.start(bytes.len() as u64 + 4).is_err(), "a wrong length is refused");
            // A first attempt cut off somewhere, then the whole reply.
            sink.start(bytes.len() as u64).unwrap();
            sink.write(&f32s_as_le(&vec![9.0; total])[..restart_at.min(bytes.len())]);
            sink.start(bytes.len() as u64).unwrap();
            write_in_cuts(&mut sink, &bytes, &cuts);
            prop_assert!(sink.is_complete());
            sink.write(&[1, 2, 3, 4, 5]);
            let blocks: Vec<Vec<f32>> = sink.into_inner().into_blocks().collect();
            prop_assert_eq!(blocks.iter().map(Vec::len).collect::<Vec<_>>(), lens);
            prop_assert_eq!(blocks.concat(), values);
        }
    }

    /// Write `bytes` into `sink` in writes of the lengths `cuts` (as far as
    /// they go), then the rest.
    fn write_in_cuts(sink: &mut dyn PayloadSink, bytes: &[u8], cuts: &[usize]) {
        let mut at = 0;
        for &cut in cuts {
            let end = (at + cut).min(bytes.len());
            sink.write(&bytes[at..end]);
            at = end;
        }
        sink.write(&bytes[at..]);
    }

    fn f32s_as_le(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}
