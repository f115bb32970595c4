//! The pserver's wire protocol: requests and replies as typed metadata,
//! parameter and gradient values as the raw payload (blocks concatenated in
//! [`crate::Placement`] order).
//!
//! Pushes and pulls name a run of the server's blocks ([`BlockSpan`]), so a
//! client can cut a large shard into messages of bounded size: neither the
//! client nor the pserver then needs a buffer the size of the shard.

use crate::{Mode, PushOutcome};
use serde::{Deserialize, Serialize};

/// The transport method number of every pserver call (the request enum says which).
pub const PSERVER_METHOD: u16 = 0x5000;

/// A run of one server's blocks: positions `start..end` in
/// [`crate::Placement::blocks_on`] of that server.
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
    /// Who are you: index, layout and step.
    Info,
    /// Count `trainer` in the sync barrier from the current step on.
    Join {
        /// The trainer.
        trainer: String,
    },
    /// Stop waiting for `trainer` in the sync barrier.
    Leave {
        /// The trainer.
        trainer: String,
    },
    /// Gradients for the blocks `blocks` of this server, concatenated in
    /// block order in the payload. A push cut in parts sends each part with
    /// the same `seq`.
    Push {
        /// Placement fingerprint.
        fingerprint: u64,
        /// The blocks in the payload.
        blocks: BlockSpan,
        /// The pushing trainer.
        trainer: String,
        /// Per trainer and server, increasing: a retried push carries the same number.
        seq: u64,
        /// Sync mode: the step of the parameters the gradient was computed at.
        step: u64,
        /// Examples behind the gradient (weights the sync combination).
        weight: f32,
    },
    /// The parameters of the blocks `blocks` of this server.
    Pull {
        /// Placement fingerprint.
        fingerprint: u64,
        /// The blocks wanted.
        blocks: BlockSpan,
        /// Wait until the server reached this step (sync mode) before answering.
        min_step: Option<u64>,
        /// How long the server may wait for `min_step` before answering `ready: false`.
        max_wait_ms: u64,
    },
    /// Async mode only: a push, answered with this server's parameters after
    /// it, as a pull would: one round trip where a push and a pull take two.
    PushPull {
        /// Placement fingerprint.
        fingerprint: u64,
        /// The blocks pushed, and pulled back.
        blocks: BlockSpan,
        /// The pushing trainer.
        trainer: String,
        /// As in [`PsRequest::Push`]: a retry carries the same number and is
        /// applied once (its reply still carries the parameters).
        seq: u64,
        /// Examples behind the gradient.
        weight: f32,
    },
}

/// A pserver's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum PsReply {
    /// Answer to [`PsRequest::Info`].
    Info {
        /// The server's index (its shard).
        index: u32,
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
    /// A sync push for a step the server is not at (it moved on, or it
    /// restarted from an earlier checkpoint): pull and compute again.
    Stale {
        /// The server's step now.
        current: u64,
    },
    /// Parameters of the blocks asked for, in the payload, if `ready`.
    Pulled {
        /// The step of the parameters sent.
        step: u64,
        /// False when `min_step` was not reached in time (no payload then).
        ready: bool,
    },
    /// Answer to [`PsRequest::PushPull`]: what happened to the push, and
    /// the parameters after it in the payload.
    PushedPulled {
        /// What happened to the push.
        outcome: PushOutcome,
        /// The step of the parameters sent.
        step: u64,
    },
}
