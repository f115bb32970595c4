//! The crate's one error type.

use std::time::Duration;

use crate::{LeaseId, Revision};

/// Everything a [`Discovery`](crate::Discovery) operation can fail with.
///
/// It is `Clone` so that one failure can be delivered to several waiters
/// (for instance through a [`WatchStream`](crate::WatchStream)).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lease was never granted, has expired, or was revoked.
    #[error("lease {0} not found (never granted, expired or revoked)")]
    LeaseNotFound(LeaseId),
    /// A fenced write was refused: the lock key is gone or was re-created
    /// by another holder since the fence was taken.
    #[error("fence lost: lock key {key:?} is no longer held at the fenced revision")]
    FenceLost {
        /// The lock key named by the fence.
        key: String,
    },
    /// A watch asked for history that the backend no longer keeps.
    #[error("revision {requested} has been compacted; the oldest revision still available is {oldest}")]
    Compacted {
        /// The revision the watch asked to start from (or had reached).
        requested: Revision,
        /// The oldest revision that can still be watched from.
        oldest: Revision,
    },
    /// Waiting for something (a lock, an event) took longer than allowed.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was being waited for, naming the key.
        what: String,
        /// The time limit that passed.
        after: Duration,
    },
    /// The backend is shut down or a stream it fed has ended.
    #[error("discovery backend closed")]
    Closed,
    /// The backend failed (connection, server error, ...); the message says how.
    #[error("discovery backend error: {0}")]
    Backend(String),
    /// The caller passed something unusable (empty key, zero ttl, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The backend refused the request for a reason that will repeat
    /// (permission denied, unsupported request, ...); the message says which.
    #[error("discovery backend refused the request: {0}")]
    Refused(String),
    /// The backend answered with something this crate cannot use (a key that
    /// is not UTF-8, a response without its header, ...); asking again gives
    /// the same answer.
    #[error("unusable answer from the discovery backend: {0}")]
    Unexpected(String),
    /// The local etcd server that tests run (`EtcdServer`, features `etcd` and `test-support`)
    /// could not be started or controlled; the message says what happened.
    #[error("etcd server: {0}")]
    Server(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Whether trying again later can succeed: the backend was unreachable
    /// or slow, as opposed to a refusal that will repeat.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::Closed | Error::Backend(_))
    }
}
