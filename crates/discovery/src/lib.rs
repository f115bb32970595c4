//! oar's coordination layer: leases, keys, prefix watches and fenced locks,
//! as one [`Discovery`] trait with etcd-compatible semantics.
//!
//! Every process of a job (master, pservers, trainers) finds the others and
//! survives crashes through this trait. [`MemDiscovery`] is the in-process
//! backend (the embedded default and the reference for tests); an etcd
//! backend implements the same trait and passes the same conformance suite
//! (module `conformance` and the `discovery_conformance!` macro, feature
//! `test-support`).
//!
//! The crate knows nothing of jobs or roles: callers name their keys.
//! [`Departures`] follows the members registered under a prefix (their
//! keys put under their leases) and names each one that leaves.
//!
//! Semantics, shared by every backend (they are etcd's):
//!
//! - One global store **revision**, raised by every write. A key remembers the
//!   revision that created it (`create_revision`, kept across updates) and the
//!   one that last changed it (`mod_revision`). An empty store is at revision
//!   1, so the first write gets revision 2.
//! - A **lease** has a time to live; keys put with it are deleted (one
//!   `Delete` event each) when it expires or is revoked. `keep_alive`
//!   refreshes it. etcd rounds the ttl up to whole seconds and to its minimum
//!   lease ttl (about 2 s with default settings); [`MemDiscovery`] keeps the
//!   `Duration` exactly as given.
//! - A **watch** on a prefix delivers every event whose revision is at least
//!   the starting one, in revision order, so `get_prefix` followed by
//!   `watch_prefix(prefix, listing.revision + 1)` sees every change without a
//!   gap. History that is no longer kept gives [`Error::Compacted`].
//! - A **lock** is a key created only if absent with the holder's lease; its
//!   [`Fence`] is the key plus its `create_revision`. Fenced writes succeed only
//!   while that same incarnation of the key exists, so a holder whose lease
//!   expired cannot write even after someone else re-took the lock.
//!
//! [`Session`] keeps a lease alive in the background and reports when it is
//! lost.
//!
//! # The etcd backend (feature `etcd`)
//!
//! `EtcdDiscovery` implements the trait on a real etcd (3.4 or later) with
//! the `etcd-client` crate. It sits behind the cargo feature `etcd`, off by
//! default, because `etcd-client` needs `protoc` to build
//! (`apt-get install -y protobuf-compiler`). With the `test-support`
//! feature as well, `EtcdServer` runs a throwaway local etcd for tests
//! (Debian's `etcd-server` package). Every etcd request is bounded by
//! a timeout, so a dead or hung etcd gives a transient error
//! ([`Error::is_transient`]) instead of a hang.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use oar_discovery::{Discovery, MemDiscovery};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> oar_discovery::Result<()> {
//! let d = MemDiscovery::new();
//! let lease = d.grant_lease(Duration::from_secs(10)).await?;
//! d.put("/oar/job/trainer/1", b"10.0.0.1:7000".to_vec(), Some(lease)).await?;
//! d.put("/oar/job/trainer/2", b"10.0.0.2:7000".to_vec(), Some(lease)).await?;
//!
//! let trainers = d.get_prefix("/oar/job/trainer/").await?;
//! assert_eq!(trainers.kvs.len(), 2);
//! assert_eq!(trainers.kvs[0].key, "/oar/job/trainer/1");
//!
//! // Become master, then write the job state only while still master.
//! let fence = d
//!     .lock("/oar/job/master/lock", b"master-a".to_vec(), lease, Duration::from_secs(1))
//!     .await?;
//! d.put_fenced(&fence, "/oar/job/master/state", b"snapshot".to_vec()).await?;
//!
//! // Once the lease is gone, the fence no longer holds.
//! d.revoke_lease(lease).await?;
//! let lost = d.put_fenced(&fence, "/oar/job/master/state", b"late".to_vec()).await;
//! assert!(matches!(lost, Err(oar_discovery::Error::FenceLost { .. })));
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;

#[cfg(feature = "test-support")]
pub mod conformance;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(all(feature = "etcd", feature = "test-support"))]
pub mod etcd_server;
mod mem;
mod members;
mod session;

pub use error::{Error, Result};
#[cfg(feature = "etcd")]
pub use etcd::{
    EtcdDiscovery, EtcdOptions, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_TIMEOUT,
    MAX_RESPONSE_BYTES,
};
#[cfg(all(feature = "etcd", feature = "test-support"))]
pub use etcd_server::EtcdServer;
pub use mem::{MemDiscovery, DEFAULT_HISTORY_BYTES, DEFAULT_HISTORY_EVENTS};
pub use members::{member_name, DepartedMembers, Departures};
pub use session::{LeaseGuard, Session};

/// Identifies a lease (etcd's lease id; never 0).
pub type LeaseId = i64;
/// A store revision: raised by one for every write.
pub type Revision = i64;

/// One key with its value and its revisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The full key.
    pub key: String,
    /// The value, uninterpreted.
    pub value: Vec<u8>,
    /// Revision of the write that created this key (kept across updates).
    pub create_revision: Revision,
    /// Revision of the last write to this key.
    pub mod_revision: Revision,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// The keys under a prefix at one revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listing {
    /// The keys, sorted by key.
    pub kvs: Vec<KeyValue>,
    /// The store revision the read saw; watch from `revision + 1` to continue
    /// without a gap.
    pub revision: Revision,
}

/// Proof of holding a lock: writes made with it succeed only while the lock
/// key still exists with this `create_revision`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The lock key.
    pub key: String,
    /// The `create_revision` of the lock key when it was taken.
    pub revision: Revision,
    /// The lease the lock key is attached to.
    pub lease: LeaseId,
}

/// A change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or updated; the `KeyValue` is its new state.
    Put(KeyValue),
    /// A key was deleted (explicitly, or because its lease ended).
    Delete {
        /// The deleted key.
        key: String,
        /// The revision of the deletion.
        mod_revision: Revision,
    },
}

impl WatchEvent {
    /// The key the event is about.
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }

    /// The revision of the write that caused the event.
    pub fn revision(&self) -> Revision {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// The events of one watch, in revision order.
///
/// Dropping it cancels the watch. A backend feeds it through a bounded
/// channel, so a slow reader slows only its own watch; an `Err` item (for
/// instance [`Error::Compacted`] when the reader fell behind the kept history)
/// is the last one.
#[derive(Debug)]
pub struct WatchStream {
    rx: mpsc::Receiver<Result<WatchEvent>>,
}

impl WatchStream {
    /// Wraps the receiving end that a backend's watch task sends into; the
    /// task should stop once the sender reports the channel closed.
    pub fn new(rx: mpsc::Receiver<Result<WatchEvent>>) -> Self {
        WatchStream { rx }
    }

    /// The next event; `None` once the watch has ended (the backend is gone,
    /// or an error was delivered).
    pub async fn next(&mut self) -> Option<Result<WatchEvent>> {
        self.rx.recv().await
    }
}

/// Wakes a polling loop as soon as something under a prefix changes: each
/// [`wait`](Self::wait) returns at the next event or after `max`, whichever
/// comes first. Polling stays the source of truth (the caller reads again
/// after every wait), the watch only makes it prompt; if the watch cannot be
/// set up or ends, waits just sleep.
#[derive(Debug)]
pub struct ChangeSignal {
    watch: Option<WatchStream>,
}

impl ChangeSignal {
    /// Watch `prefix` from the next write. Create it before the first read
    /// that the loop polls, so that no change between the two is missed.
    pub async fn new(discovery: &dyn Discovery, prefix: &str) -> Self {
        ChangeSignal { watch: discovery.watch_prefix(prefix, 0).await.ok() }
    }

    /// Return at the next change under the prefix, or after `max`.
    pub async fn wait(&mut self, max: Duration) {
        let Some(watch) = &mut self.watch else {
            return tokio::time::sleep(max).await;
        };
        match tokio::time::timeout(max, watch.next()).await {
            Ok(Some(Ok(_))) | Err(_) => {}
            Ok(None | Some(Err(_))) => self.watch = None,
        }
    }
}

/// What oar needs from etcd; implemented by [`MemDiscovery`] and the etcd
/// backend, both checked by the conformance suite (feature `test-support`).
#[async_trait]
pub trait Discovery: Send + Sync + 'static {
    /// The largest value one write may carry, if the backend has a limit
    /// (etcd: its request limit less room for the key and the framing);
    /// `None` (the default, and [`MemDiscovery`]'s): no limit. A writer of
    /// a state that grows checks it, so that an oversized write is an error
    /// it can name rather than a refusal it would retry.
    fn max_value_bytes(&self) -> Option<usize> {
        None
    }

    /// Grants a lease that lives `ttl` unless refreshed. A zero ttl is
    /// [`Error::InvalidArgument`]. etcd rounds the ttl up to whole seconds
    /// (and to its minimum ttl); [`MemDiscovery`] keeps it exactly.
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId>;

    /// Refreshes the lease once (its deadline becomes now + ttl).
    /// [`Error::LeaseNotFound`] if it expired or was revoked.
    async fn keep_alive(&self, lease: LeaseId) -> Result<()>;

    /// Ends the lease now and deletes its keys (watchers see a `Delete` for
    /// each). [`Error::LeaseNotFound`] if it is already gone.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()>;

    /// Writes `key`, attached to `lease` (or to none, detaching it from a
    /// previous lease). Returns the write's revision.
    /// [`Error::LeaseNotFound`] if the lease is unknown or expired.
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision>;

    /// Reads one key.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>>;

    /// Reads every key starting with `prefix` (byte-wise; `"a/"` does not
    /// match `"ab"`), sorted, with the revision of the read. An empty prefix
    /// lists everything.
    async fn get_prefix(&self, prefix: &str) -> Result<Listing>;

    /// Deletes `key`; `true` if it existed. Deleting a missing key writes
    /// nothing (the revision does not move).
    async fn delete(&self, key: &str) -> Result<bool>;

    /// Creates `key` only if it does not exist, in one transaction.
    /// `Some(create revision)` if created, `None` if the key existed (the
    /// lease is then not checked, as in an etcd transaction's else branch).
    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Option<Revision>>;

    /// Watches every key under `prefix`, delivering every event with
    /// revision `>= from_revision` in order. `from_revision == 0` means "from
    /// the next write"; a revision older than the kept history is
    /// [`Error::Compacted`].
    async fn watch_prefix(&self, prefix: &str, from_revision: Revision) -> Result<WatchStream>;

    /// Writes `key` (without a lease) in one transaction that succeeds only
    /// if `fence.key` exists with `create_revision == fence.revision`;
    /// otherwise [`Error::FenceLost`].
    async fn put_fenced(&self, fence: &Fence, key: &str, value: Vec<u8>) -> Result<Revision>;

    /// Deletes `key` under the same guard as [`Discovery::put_fenced`];
    /// `true` if it existed.
    async fn delete_fenced(&self, fence: &Fence, key: &str) -> Result<bool>;

    /// Deletes every key `k` with `start <= k < end` (byte-wise) in one
    /// transaction under the same guard as [`Discovery::put_fenced`]. An
    /// empty range (`start >= end`) is [`Error::InvalidArgument`].
    async fn delete_range_fenced(&self, fence: &Fence, start: &str, end: &str) -> Result<()>;

    /// Takes the lock at `key` for `lease`, with `holder` as its value.
    ///
    /// Tries `create_if_absent`; while another lease holds the key, watches
    /// it for its deletion and tries again, for up to `timeout` after the
    /// first try ([`Error::Timeout`] naming the key). If `lease` itself
    /// already holds the key, returns that fence (the lock is re-entrant per
    /// lease, as etcd's own lock is per session). Written once for every
    /// backend.
    async fn lock(&self, key: &str, holder: Vec<u8>, lease: LeaseId, timeout: Duration) -> Result<Fence> {
        // (A "forever" timeout of u64::MAX seconds cannot be added to an instant.)
        let deadline = tokio::time::Instant::now() + timeout.min(Duration::from_secs(30 * 365 * 24 * 3600));
        loop {
            if let Some(revision) = self.create_if_absent(key, holder.clone(), Some(lease)).await? {
                return Ok(Fence { key: key.to_string(), revision, lease });
            }
            // Held: find the current incarnation (it may have changed since),
            // and the store revision of that read.
            let listing = self.get_prefix(key).await?;
            let Some(current) = listing.kvs.into_iter().find(|kv| kv.key == key) else {
                continue;
            };
            if current.lease == Some(lease) {
                return Ok(Fence { key: key.to_string(), revision: current.create_revision, lease });
            }
            let timed_out = || Error::Timeout {
                what: format!(
                    "lock {key:?} (held by lease {})",
                    current.lease.map_or("none".to_string(), |l| l.to_string())
                ),
                after: timeout,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(timed_out());
            }
            // Watching from just after the read cannot miss the deletion, and
            // that revision is as recent as any: the key's own write may be
            // long compacted away (a lock is written once and held for hours),
            // and watching from it failed every time, a loop with no wait.
            let mut watch = match self.watch_prefix(key, listing.revision + 1).await {
                Ok(watch) => watch,
                Err(Error::Compacted { .. }) => {
                    // Compacted between the read and the watch: read again,
                    // after a pause so that a store compacting all the time
                    // is not asked in a tight loop.
                    tokio::time::sleep(LOCK_RETRY_PAUSE).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            loop {
                match tokio::time::timeout_at(deadline, watch.next()).await {
                    Err(_) => return Err(timed_out()),
                    Ok(None) => return Err(Error::Closed),
                    Ok(Some(Err(Error::Compacted { .. }))) => break,
                    Ok(Some(Err(e))) => return Err(e),
                    Ok(Some(Ok(WatchEvent::Delete { key: deleted, .. }))) if deleted == key => break,
                    Ok(Some(Ok(_))) => {}
                }
            }
        }
    }
}

/// How long [`Discovery::lock`] waits before reading the lock again when
/// its watch could not start (the read's revision was compacted at once).
const LOCK_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Rejects the empty key, which no backend can store.
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidArgument("key must not be empty".to_string()));
    }
    Ok(())
}

/// Rejects an empty or reversed key range, which would delete nothing (or,
/// in etcd's encoding of an empty end, everything after `start`).
pub(crate) fn check_range(start: &str, end: &str) -> Result<()> {
    check_key(start)?;
    if start >= end {
        return Err(Error::InvalidArgument(format!("empty key range {start:?}..{end:?}")));
    }
    Ok(())
}
