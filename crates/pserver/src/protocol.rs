//! The pserver's wire protocol: requests and replies as typed metadata,
//! parameter and gradient values as the raw payload (blocks concatenated in
//! [`crate::Placement`] order, little-endian `f32`).
//!
//! Client calls name a logical shard and go to its primary (per the
//! [`ShardMap`](crate::ShardMap)); a pserver that is not the shard's primary
//! in its map answers [`PsReply::NotPrimary`] with its map's version, and
//! the client looks the shard up again. Pushes and pulls name a run of the
//! shard's blocks ([`BlockSpan`]), so a client can cut a large shard into
//! messages of bounded size: neither the client nor the pserver then needs
//! a buffer the size of the shard.
//!
//! Replication calls go between pservers: a primary forwards updates to a
//! follower ([`PsRequest::Replicate`]), a follower asks to sync
//! ([`PsRequest::Sync`]), fetches a snapshot's parts
//! ([`PsRequest::SnapshotPart`]) and says when it has caught up
//! ([`PsRequest::Caught`]). Every replication call carries the sender's
//! shard map version: a pserver takes one only under the map it serves
//! under itself, so a deposed primary (an older map) is refused, and one
//! that is ahead is asked to wait until the other sees its map.

use crate::{block::BlockId, AppliedOrigins, Mode, Origin, PushOutcome};
use serde::{Deserialize, Serialize};

/// The transport method number of every pserver call (the request enum says which).
pub const PSERVER_METHOD: u16 = 0x5000;

/// A run of one shard's blocks: positions `start..end` in
/// [`crate::Placement::blocks_on`] of that shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSpan {
    /// First block's position.
    pub start: u32,
    /// One past the last block's position.
    pub end: u32,
}

impl BlockSpan {
    /// Positions `start..end`.
    pub fn new(start: u32, end: u32) -> Self {
        BlockSpan { start, end }
    }

    /// The positions as a range.
    pub fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// A call to a pserver. Requests that touch parameters carry the placement's
/// fingerprint, so a client and a server that disagree on the layout fail
/// loudly instead of mixing up blocks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum PsRequest {
    /// Who holds shard `shard`: its step and mode (primary only).
    Info {
        /// The logical shard.
        shard: u32,
    },
    /// Count `trainer` in the sync barrier of `shard` from its current step on.
    Join {
        /// The logical shard.
        shard: u32,
        /// The trainer.
        trainer: String,
    },
    /// Stop waiting for `trainer` in the sync barrier of `shard`.
    Leave {
        /// The logical shard.
        shard: u32,
        /// The trainer.
        trainer: String,
    },
    /// Gradients for the blocks `blocks` of `shard`, concatenated in block
    /// order in the payload. A push cut in parts sends each part with the
    /// same `seq`.
    Push {
        /// The logical shard.
        shard: u32,
        /// Placement fingerprint.
        fingerprint: u64,
        /// The blocks in the payload.
        blocks: BlockSpan,
        /// The pushing trainer.
        trainer: String,
        /// Per trainer and shard, increasing: a retried push carries the same number.
        seq: u64,
        /// Sync mode: the step of the parameters the gradient was computed at.
        step: u64,
        /// Examples behind the gradient (weights the sync combination).
        weight: f32,
        /// Row gradients of the sparse tables (in the push's first part
        /// only, see [`crate::Push`]); their values follow the blocks' in
        /// the payload.
        rows: Vec<TableRows>,
        /// Which examples of which task the gradient comes from, if known
        /// ([`crate::origin`]).
        origin: Option<Origin>,
        /// Sync mode: the epoch of the primary whose parameters the
        /// gradient was computed at (0: not known, not checked). Another
        /// primary may be at the same step number with other parameters
        /// (restored from an older checkpoint, then stepped again), so a
        /// push that is not a retry of one taken already is answered
        /// [`PsReply::Stale`] by a primary that restored the shard (from a
        /// checkpoint, or its initial values) at a later epoch.
        epoch: u64,
    },
    /// The parameters of the blocks `blocks` of `shard`.
    Pull {
        /// The logical shard.
        shard: u32,
        /// Placement fingerprint.
        fingerprint: u64,
        /// The blocks wanted.
        blocks: BlockSpan,
        /// Wait until the shard reached this step (sync mode) before answering.
        min_step: Option<u64>,
        /// How long the server may wait for `min_step` before answering `ready: false`.
        max_wait_ms: u64,
    },
    /// A push, answered with the shard's parameters after it, as a pull
    /// would: one round trip where a push and a pull take two. Sync, the
    /// answer comes when the part's blocks are updated in the push's step
    /// (every member pushed them), with their parameters of the next step
    /// ([`PsReply::Stale`] if the step moved on without it): one round trip
    /// per step.
    PushPull {
        /// The logical shard.
        shard: u32,
        /// Placement fingerprint.
        fingerprint: u64,
        /// The blocks pushed, and pulled back.
        blocks: BlockSpan,
        /// The pushing trainer.
        trainer: String,
        /// As in [`PsRequest::Push`]: a retry carries the same number and is
        /// applied once (its reply still carries the parameters).
        seq: u64,
        /// Sync mode: the step of the parameters the gradient was computed at.
        step: u64,
        /// Examples behind the gradient.
        weight: f32,
        /// Row gradients, as in [`PsRequest::Push`] (pushed, not pulled back).
        rows: Vec<TableRows>,
        /// As in [`PsRequest::Push`].
        origin: Option<Origin>,
        /// As in [`PsRequest::Push`].
        epoch: u64,
    },
    /// Rows of sparse tables, of every shard named that this pserver is
    /// the primary of: one call per pserver for a batch's rows. Answered
    /// [`PsReply::PulledRows`]; the values, shard by shard and table by
    /// table in request order, in the payload.
    PullRows {
        /// Placement fingerprint.
        fingerprint: u64,
        /// The rows wanted, by shard.
        shards: Vec<ShardRows>,
        /// How long the server may wait for the shards' `min_step`s before
        /// answering a shard [`PulledShard::NotReady`].
        max_wait_ms: u64,
    },
    /// Primary to follower: updates of `shard`, in order, the first numbered
    /// `updates[0].seq`. The payload holds their gradients, one after the
    /// other, each block's values in the order its update names them.
    Replicate {
        /// The logical shard.
        shard: u32,
        /// The shard map version the sender serves under.
        map_version: u64,
        /// The sender's epoch as the shard's primary.
        epoch: u64,
        /// The updates.
        updates: Vec<UpdateMeta>,
    },
    /// Follower to primary: `follower` holds updates `1..=applied` of
    /// `shard`, the last from epoch `epoch` (0: none); how does it go on?
    Sync {
        /// The logical shard.
        shard: u32,
        /// The shard map version the follower serves under.
        map_version: u64,
        /// The follower's name.
        follower: String,
        /// The epoch of its last update.
        epoch: u64,
        /// Its last update.
        applied: u64,
    },
    /// Follower to primary: part `part` of the snapshot at update `upto`
    /// taken for `follower`'s catch-up.
    SnapshotPart {
        /// The logical shard.
        shard: u32,
        /// The follower's name.
        follower: String,
        /// The update the snapshot was taken at.
        upto: u64,
        /// Which part, from 0.
        part: u32,
    },
    /// Follower to primary: `follower` caught up and holds updates
    /// `1..=applied` of the primary's epoch `epoch`.
    Caught {
        /// The logical shard.
        shard: u32,
        /// The shard map version the follower serves under.
        map_version: u64,
        /// The follower's name.
        follower: String,
        /// The epoch it follows.
        epoch: u64,
        /// Its last update.
        applied: u64,
    },
    /// Primary to follower: the primary cannot forward to it until it
    /// syncs (it was added to the replica set, or fell too far behind).
    SyncNeeded {
        /// The logical shard.
        shard: u32,
        /// The shard map version the primary serves under.
        map_version: u64,
    },
    /// What this pserver holds of every shard (for the coordinator's
    /// elections and for `oar status`).
    Status,
    /// Several calls to shards this pserver is primary of, in one round
    /// trip: a trainer's small push, push-pull or pull to every shard
    /// (each shard's call would otherwise be a round trip of its own).
    /// The payload is the calls' payloads one after another. Each call is
    /// handled as if it had come alone, all at once, except row pulls
    /// ([`PsRequest::PullRows`]), which start once the other calls are
    /// answered: the rows of a trainer's next batch, asked for with its
    /// push, are read after that push (its step, in sync mode). Answered
    /// in [`PsReply::Batch`]; a batch holds no batch, and at most
    /// [`MAX_BATCH_CALLS`] calls.
    Batch {
        /// The calls, each with its payload's length in bytes.
        calls: Vec<BatchCall>,
    },
}

/// The most calls one [`PsRequest::Batch`] may carry: a shard's call
/// each, and a job has at most this many shards in practice.
pub const MAX_BATCH_CALLS: usize = 4096;

/// One call of a [`PsRequest::Batch`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchCall {
    /// The call.
    pub request: PsRequest,
    /// The length of its payload in the batch's payload.
    pub payload_len: u64,
}

/// The answer to one call of a [`PsRequest::Batch`], in call order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchAnswer {
    /// The call's reply, or the error it would have been answered with
    /// alone.
    pub reply: std::result::Result<PsReply, oar_transport::RemoteError>,
    /// The length of its payload in the batch reply's payload.
    pub payload_len: u64,
}

/// The longest trainer id a pserver takes, in bytes (the master's limit
/// too): ids are kept per trainer in each shard's store, its checkpoints
/// and its followers.
pub const MAX_TRAINER_ID_BYTES: usize = 256;

impl PsRequest {
    /// The trainer a request names, if it names one.
    pub fn trainer(&self) -> Option<&str> {
        match self {
            PsRequest::Join { trainer, .. }
            | PsRequest::Leave { trainer, .. }
            | PsRequest::Push { trainer, .. }
            | PsRequest::PushPull { trainer, .. } => Some(trainer),
            _ => None,
        }
    }

    /// A push as a push-pull (`pull`) or a push-pull as a push (not
    /// `pull`), with the same fields; any other request unchanged.
    pub fn with_pull(self, pull: bool) -> PsRequest {
        match self {
            PsRequest::Push {
                shard,
                fingerprint,
                blocks,
                trainer,
                seq,
                step,
                weight,
                rows,
                origin,
                epoch,
            }
            | PsRequest::PushPull {
                shard,
                fingerprint,
                blocks,
                trainer,
                seq,
                step,
                weight,
                rows,
                origin,
                epoch,
            } => {
                if pull {
                    PsRequest::PushPull {
                        shard,
                        fingerprint,
                        blocks,
                        trainer,
                        seq,
                        step,
                        weight,
                        rows,
                        origin,
                        epoch,
                    }
                } else {
                    PsRequest::Push {
                        shard,
                        fingerprint,
                        blocks,
                        trainer,
                        seq,
                        step,
                        weight,
                        rows,
                        origin,
                        epoch,
                    }
                }
            }
            other => other,
        }
    }
}

/// Rows of one sparse table in a call: their ids (values, `ids.len() *
/// dim` floats, in the payload).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableRows {
    /// The table's index in [`crate::Placement::tables`].
    pub table: u32,
    /// The rows.
    pub ids: Vec<u64>,
}

/// The rows a [`PsRequest::PullRows`] wants of one shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardRows {
    /// The logical shard.
    pub shard: u32,
    /// Its rows wanted, per table.
    pub tables: Vec<TableRows>,
    /// Sync mode: not before the shard reached this step. Per shard, since
    /// a trainer can count in a shard's barrier a step later than another's
    /// (it joined while that shard's step was underway).
    pub min_step: Option<u64>,
}

/// A snapshot part's rows of one sparse table: per row its values then
/// its optimizer slots in the payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowsPart {
    /// The table's index.
    pub table: u32,
    /// Which row part of the snapshot, from 0.
    pub index: u32,
    /// Each row's id, optimizer step, sightings and last push's step.
    pub rows: Vec<(u64, u64, u32, u64)>,
    /// Admission candidates (id, sightings, last step), in parts of their
    /// own after the table's rows (a primary of an earlier build sent them
    /// all in the table's first part; either way the follower restores
    /// what each part holds).
    pub candidates: Vec<(u64, u32, u64)>,
    /// The first part of each table: its life counters.
    pub stats: Option<crate::sparse::TableStats>,
}

/// How one shard of a [`PsRequest::PullRows`] was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PulledShard {
    /// Its rows are in the payload, as of this step.
    Rows {
        /// The shard's step.
        step: u64,
    },
    /// Not before `min_step` came: no values in the payload.
    NotReady {
        /// The shard's step.
        step: u64,
    },
    /// This pserver is not its primary (under map `map_version`): no
    /// values; look it up again.
    NotPrimary {
        /// The map version this pserver serves under.
        map_version: u64,
    },
}

/// One forwarded update's description; its values are in the payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UpdateMeta {
    /// Its number in the shard's sequence.
    pub seq: u64,
    /// What it is.
    pub kind: UpdateKind,
}

/// The kind of a forwarded update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum UpdateKind {
    /// Async: a trainer's push (or part of one), as the primary applied it;
    /// its blocks' gradients are in the payload.
    Push {
        /// The trainer.
        trainer: String,
        /// The push's sequence number.
        seq: u64,
        /// The step it carried.
        step: u64,
        /// Its weight.
        weight: f32,
        /// Its blocks, in payload order.
        blocks: Vec<BlockId>,
        /// Its row gradients, after the blocks in the payload.
        rows: Vec<TableRows>,
        /// Its origin, if it had one.
        origin: Option<Origin>,
    },
    /// A trainer joined the barrier.
    Join(String),
    /// A trainer left.
    Leave(String),
    /// Sync: step `step` completed with these blocks' combined gradients
    /// (in the payload, in this order).
    Step {
        /// The step it completed.
        step: u64,
        /// The updated blocks, in payload order.
        blocks: Vec<BlockId>,
        /// The combined row gradients, after the blocks in the payload.
        rows: Vec<TableRows>,
        /// The (trainer, seq) of every push the step took, so that the
        /// followers deduplicate a retried push as the primary does.
        seqs: Vec<(String, u64)>,
        /// The origins of the pushes it took, with their units.
        origins: Vec<(Origin, Vec<u32>)>,
    },
}

/// The role a pserver has for a shard, as it reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicaRole {
    /// Applies updates and answers clients.
    Primary,
    /// Caught up: holds its primary's updates as they come.
    Follower,
    /// Catching up (or waiting to): holds nothing to serve yet.
    Syncing,
    /// A follower due to sync again (a new primary was elected, or its
    /// link overflowed) that has not yet: it still holds every update its
    /// primary acknowledged, since acknowledgements wait for every
    /// follower in the map, so it can take over if no caught-up follower
    /// is left.
    DueToSync,
}

impl std::fmt::Display for ReplicaRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReplicaRole::Primary => "primary",
            ReplicaRole::Follower => "follower",
            // Not caught up, as the replica keys' layout says
            // (`primary|follower|syncing`, docs/DESIGN.md): only the
            // coordinator's failover tells the two apart.
            ReplicaRole::Syncing | ReplicaRole::DueToSync => "syncing",
        })
    }
}

/// What a pserver holds of one shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaState {
    /// The logical shard.
    pub shard: u32,
    /// Its role.
    pub role: ReplicaRole,
    /// The last update it holds (a primary: applied; a follower: applied).
    pub applied: u64,
    /// The epoch of its last update (a primary: its own).
    pub epoch: u64,
    /// The store's step (sync steps completed, or async pushes applied).
    pub step: u64,
}

/// A pserver's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum PsReply {
    /// Answer to [`PsRequest::Info`].
    Info {
        /// The logical shard.
        shard: u32,
        /// Placement fingerprint.
        fingerprint: u64,
        /// Updates applied so far.
        step: u64,
        /// Sync or async.
        mode: Mode,
    },
    /// Leave done.
    Ok,
    /// Join done: the trainer counts in the barrier from `step` on (the
    /// next step when the current one is underway).
    Joined {
        /// The first step the trainer counts in.
        step: u64,
    },
    /// What happened to a push.
    Pushed(PushOutcome),
    /// A sync push for a step the shard is not at (it moved on, or a new
    /// primary took over at an earlier step): pull and compute again.
    Stale {
        /// The shard's step now.
        current: u64,
    },
    /// Parameters of the blocks asked for, in the payload, if `ready`.
    Pulled {
        /// The step of the parameters sent.
        step: u64,
        /// False when `min_step` was not reached in time (no payload then).
        ready: bool,
    },
    /// Answer to [`PsRequest::PullRows`], shard by shard in request order.
    PulledRows {
        /// Each shard's answer.
        shards: Vec<PulledShard>,
    },
    /// Answer to [`PsRequest::PushPull`]: what happened to the push, and
    /// the parameters after it in the payload.
    PushedPulled {
        /// What happened to the push.
        outcome: PushOutcome,
        /// The step of the parameters sent.
        step: u64,
    },
    /// This pserver is not the shard's primary in its shard map (version
    /// `map_version`): look the shard up in a newer map.
    NotPrimary {
        /// The logical shard.
        shard: u32,
        /// The version of the map this pserver serves under.
        map_version: u64,
    },
    /// Answer to [`PsRequest::Replicate`]: the follower took (applied or,
    /// catching up, kept aside) every update up to `taken`, and holds
    /// (applied) every update up to `applied`.
    Replicated {
        /// The last update taken.
        taken: u64,
        /// The last update applied, if it is a follower (not catching up).
        applied: Option<u64>,
    },
    /// Answer to [`PsRequest::Sync`].
    SyncFrom {
        /// The primary's epoch.
        epoch: u64,
        /// True: the follower holds a prefix of the primary's updates and
        /// the next ones follow; false: it catches up from the snapshot
        /// at `upto`, in `parts` parts, and takes on `history`.
        resume: bool,
        /// The update the snapshot holds up to (resume: the follower's own).
        upto: u64,
        /// The number of snapshot parts.
        parts: u32,
        /// The primary's epochs: `(epoch, first update)` pairs.
        history: Vec<(u64, u64)>,
    },
    /// Answer to [`PsRequest::SnapshotPart`]: per block, its parameters
    /// then its optimizer state's slots in the payload.
    SnapshotPart {
        /// The store's step in the snapshot.
        step: u64,
        /// The pushes the store had applied.
        pushes: u64,
        /// Sync: the barrier's members.
        members: Vec<String>,
        /// The part's blocks with their optimizer state's step, in payload order.
        blocks: Vec<(BlockId, u64)>,
        /// The deduplication table (trainer, last seq).
        last_seqs: Vec<(String, u64)>,
        /// The origins applied (boxed: most replies are small).
        origins: Box<AppliedOrigins>,
        /// How many parts of the snapshot hold sparse table rows (they
        /// come after the block parts).
        row_parts: u32,
        /// In a row part: its rows (values after any blocks' in the payload).
        rows: Option<RowsPart>,
        /// Pushes in parts half taken: (trainer, which units came).
        half_pushes: Vec<(String, Vec<bool>)>,
    },
    /// Answer to [`PsRequest::Batch`]: each call's answer, in call
    /// order, their payloads one after another in the payload.
    Batch {
        /// The answers.
        answers: Vec<BatchAnswer>,
    },
    /// Answer to [`PsRequest::Status`].
    Status {
        /// The pserver's name.
        name: String,
        /// The shard map version it serves under (0: none yet).
        map_version: u64,
        /// Every shard it holds.
        shards: Vec<ReplicaState>,
    },
}
