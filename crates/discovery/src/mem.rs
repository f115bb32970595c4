//! `MemDiscovery`: the in-process backend, with etcd's semantics.
//!
//! The store itself ([`State`]) is a plain struct driven by method calls with
//! the time passed in; [`MemDiscovery`] is the shell that reads the clock,
//! runs the lease-expiry task and the watch tasks.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{
    check_key, Discovery, Error, Fence, KeyValue, LeaseId, Listing, Result, Revision, WatchEvent, WatchStream,
};

/// Default number of past events kept for watches that start in the past.
pub const DEFAULT_HISTORY_EVENTS: usize = 10_000;
/// Default bound on the bytes (keys plus values) of the kept events, so that
/// large values written often (snapshots) cannot pile up.
pub const DEFAULT_HISTORY_BYTES: usize = 64 << 20;
/// Events buffered per watch before its task waits for the reader.
const WATCH_CHANNEL: usize = 64;
/// Events a watch task scans per hold of the store lock.
const WATCH_BATCH: usize = 256;
/// Bytes counted per event on top of its key and value.
const EVENT_OVERHEAD: usize = 64;

/// In-process [`Discovery`] backend: the embedded default and the reference
/// for the conformance suite.
///
/// Clones share one store. Semantics are etcd's: a global revision raised by
/// every write (a lease that ends deletes its keys with one revision each),
/// `create_revision`/`mod_revision`, leases that really expire (a background
/// task, started with the first lease and ending when the last clone is
/// dropped, deletes their keys and notifies watchers; every operation also
/// expires overdue leases first), and a bounded event history for watches
/// that start in the past ([`Error::Compacted`] beyond it, or when a watch
/// reader falls that far behind). Time is `tokio::time`, so tests may pause
/// it. Lease ttls are kept exactly as given (etcd rounds them to seconds).
#[derive(Clone)]
pub struct MemDiscovery {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// The store revision, published after each operation to wake watch tasks.
    revision_tx: watch::Sender<Revision>,
    /// Wakes the expiry task when a deadline may have moved earlier, or when
    /// the store is dropped.
    expiry_wake: Arc<Notify>,
    expiry_task: Mutex<Option<JoinHandle<()>>>,
    /// Live watch tasks (they hold only a `Weak` to the store).
    watchers: Arc<AtomicUsize>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Let a sleeping expiry task see that the store is gone.
        self.expiry_wake.notify_one();
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn publish(&self, revision: Revision) {
        self.revision_tx.send_if_modified(|current| {
            if *current == revision {
                false
            } else {
                *current = revision;
                true
            }
        });
    }
}

impl Default for MemDiscovery {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.inner.state();
        f.debug_struct("MemDiscovery")
            .field("revision", &st.revision)
            .field("keys", &st.kvs.len())
            .field("leases", &st.leases.len())
            .finish()
    }
}

impl MemDiscovery {
    /// An empty store (revision 1) keeping the default history
    /// ([`DEFAULT_HISTORY_EVENTS`] events, [`DEFAULT_HISTORY_BYTES`] bytes).
    pub fn new() -> Self {
        Self::with_history_limit(DEFAULT_HISTORY_EVENTS, DEFAULT_HISTORY_BYTES)
    }

    /// An empty store keeping at most `max_events` past events whose keys and
    /// values total at most about `max_bytes` (the newest event is always
    /// kept). A small history makes watches that start in the past, or
    /// readers that fall behind, fail with [`Error::Compacted`] sooner.
    pub fn with_history_limit(max_events: usize, max_bytes: usize) -> Self {
        let state = State::new(max_events, max_bytes);
        let (revision_tx, _) = watch::channel(state.revision);
        MemDiscovery {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                revision_tx,
                expiry_wake: Arc::new(Notify::new()),
                expiry_task: Mutex::new(None),
                watchers: Arc::new(AtomicUsize::new(0)),
            }),
        }
    }

    /// The current store revision.
    pub fn revision(&self) -> Revision {
        self.with_state(|st, _| st.revision)
    }

    /// Runs `f` on the store after expiring overdue leases, then wakes the
    /// watchers if the revision moved. Never awaits while locked.
    fn with_state<T>(&self, f: impl FnOnce(&mut State, Instant) -> T) -> T {
        let now = Instant::now();
        let (out, revision) = {
            let mut st = self.inner.state();
            st.expire(now);
            let out = f(&mut st, now);
            (out, st.revision)
        };
        self.inner.publish(revision);
        out
    }

    /// Starts the expiry task unless one is running. Without a tokio runtime
    /// there is none, and leases expire lazily only.
    fn ensure_expiry_task(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut slot = self.inner.expiry_task.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|task| !task.is_finished()) {
            return;
        }
        let store = Arc::downgrade(&self.inner);
        let wake = self.inner.expiry_wake.clone();
        *slot = Some(runtime.spawn(expiry_loop(store, wake)));
    }
}

/// Sleeps until the earliest lease deadline, expires what is due, repeats;
/// ends once the store is dropped. Holds the store only while expiring.
async fn expiry_loop(store: Weak<Inner>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(inner) = store.upgrade() else {
                return;
            };
            let (next, revision) = {
                let mut st = inner.state();
                st.expire(Instant::now());
                (st.next_deadline(), st.revision)
            };
            inner.publish(revision);
            next
        };
        match next {
            Some(deadline) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

/// Decrements the live-watcher count when a watch task ends, however it ends.
struct WatcherGuard(Arc<AtomicUsize>);

impl Drop for WatcherGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Feeds one watch from the store's history, at the reader's pace; ends when
/// the reader drops the stream, the store is dropped, or after an error.
async fn watch_task(
    store: Weak<Inner>,
    mut revisions: watch::Receiver<Revision>,
    prefix: String,
    mut next: Revision,
    tx: mpsc::Sender<Result<WatchEvent>>,
    _guard: WatcherGuard,
) {
    loop {
        // Mark the published revision seen before reading, so a write after
        // the read always wakes us below.
        revisions.borrow_and_update();
        let batch = {
            let Some(inner) = store.upgrade() else {
                return;
            };
            let st = inner.state();
            st.events_from(&prefix, next, WATCH_BATCH)
        };
        let caught_up = match batch {
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
            Ok(batch) => {
                next = batch.next;
                for event in batch.events {
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
                batch.caught_up
            }
        };
        if caught_up {
            tokio::select! {
                changed = revisions.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                _ = tx.closed() => return,
            }
        }
    }
}

#[async_trait]
impl Discovery for MemDiscovery {
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let lease = self.with_state(|st, now| st.grant(ttl, now))?;
        self.ensure_expiry_task();
        self.inner.expiry_wake.notify_one();
        Ok(lease)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        self.with_state(|st, now| st.keep_alive(lease, now))
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.with_state(|st, _| st.revoke(lease))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        check_key(key)?;
        self.with_state(|st, _| st.put(key, value, lease))
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        check_key(key)?;
        Ok(self.with_state(|st, _| st.get(key)))
    }

    async fn get_prefix(&self, prefix: &str) -> Result<Listing> {
        Ok(self.with_state(|st, _| st.get_prefix(prefix)))
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        Ok(self.with_state(|st, _| st.delete(key)))
    }

    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Option<Revision>> {
        check_key(key)?;
        self.with_state(|st, _| st.create_if_absent(key, value, lease))
    }

    async fn watch_prefix(&self, prefix: &str, from_revision: Revision) -> Result<WatchStream> {
        if from_revision < 0 {
            return Err(Error::InvalidArgument(format!(
                "watch of {prefix:?} from negative revision {from_revision}"
            )));
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(Error::Backend(format!("watch of {prefix:?} needs a tokio runtime")));
        };
        let revisions = self.inner.revision_tx.subscribe();
        let start = self.with_state(|st, _| {
            let start = if from_revision == 0 { st.revision + 1 } else { from_revision };
            st.check_watch_start(start).map(|()| start)
        })?;
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL);
        self.inner.watchers.fetch_add(1, Ordering::SeqCst);
        let guard = WatcherGuard(self.inner.watchers.clone());
        runtime.spawn(watch_task(
            Arc::downgrade(&self.inner),
            revisions,
            prefix.to_string(),
            start,
            tx,
            guard,
        ));
        Ok(WatchStream::new(rx))
    }

    async fn put_fenced(&self, fence: &Fence, key: &str, value: Vec<u8>) -> Result<Revision> {
        check_key(key)?;
        self.with_state(|st, _| {
            st.check_fence(fence)?;
            st.put(key, value, None)
        })
    }

    async fn delete_range_fenced(&self, fence: &Fence, start: &str, end: &str) -> Result<()> {
        crate::check_range(start, end)?;
        self.with_state(|st, _| {
            st.check_fence(fence)?;
            let doomed: Vec<String> = st
                .kvs
                .range::<str, _>((std::ops::Bound::Included(start), std::ops::Bound::Excluded(end)))
                .map(|(k, _)| k.clone())
                .collect();
            for key in doomed {
                st.delete(&key);
            }
            Ok(())
        })
    }

    async fn delete_fenced(&self, fence: &Fence, key: &str) -> Result<bool> {
        check_key(key)?;
        self.with_state(|st, _| {
            st.check_fence(fence)?;
            Ok(st.delete(key))
        })
    }
}

/// One stored key.
#[derive(Clone, Debug)]
struct Stored {
    value: Vec<u8>,
    create_revision: Revision,
    mod_revision: Revision,
    lease: Option<LeaseId>,
}

/// One live lease.
#[derive(Debug)]
struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

/// Events of one watch read, and where to continue.
#[derive(Debug)]
struct Batch {
    events: Vec<WatchEvent>,
    /// The revision to read from next time.
    next: Revision,
    /// Whether `next` is past the store revision (nothing more to read now).
    caught_up: bool,
}

/// The store: keys, leases and event history, with time passed in.
#[derive(Debug)]
struct State {
    revision: Revision,
    kvs: BTreeMap<String, Stored>,
    leases: HashMap<LeaseId, Lease>,
    /// Lease deadlines in order, for expiry.
    deadlines: BTreeSet<(Instant, LeaseId)>,
    next_lease: LeaseId,
    /// Events of revisions `compacted + 1 ..= revision`, one per revision.
    history: VecDeque<WatchEvent>,
    history_bytes: usize,
    /// The highest revision whose event was dropped from the history.
    compacted: Revision,
    max_events: usize,
    max_bytes: usize,
}

fn event_size(event: &WatchEvent) -> usize {
    match event {
        WatchEvent::Put(kv) => kv.key.len() + kv.value.len() + EVENT_OVERHEAD,
        WatchEvent::Delete { key, .. } => key.len() + EVENT_OVERHEAD,
    }
}

fn lease_deadline(lease: LeaseId, now: Instant, ttl: Duration) -> Result<Instant> {
    now.checked_add(ttl)
        .ok_or_else(|| Error::InvalidArgument(format!("ttl {ttl:?} of lease {lease} is too large")))
}

impl State {
    fn new(max_events: usize, max_bytes: usize) -> Self {
        State {
            revision: 1,
            kvs: BTreeMap::new(),
            leases: HashMap::new(),
            deadlines: BTreeSet::new(),
            next_lease: 1,
            history: VecDeque::new(),
            history_bytes: 0,
            compacted: 1,
            max_events: max_events.max(1),
            max_bytes,
        }
    }

    /// Ends every lease whose deadline is at or before `now`.
    fn expire(&mut self, now: Instant) {
        while let Some(&(deadline, lease)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.end_lease(lease);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(deadline, _)| deadline)
    }

    fn grant(&mut self, ttl: Duration, now: Instant) -> Result<LeaseId> {
        if ttl.is_zero() {
            return Err(Error::InvalidArgument("lease ttl must be greater than zero".to_string()));
        }
        let lease = self.next_lease;
        let deadline = lease_deadline(lease, now, ttl)?;
        self.next_lease += 1;
        self.leases.insert(lease, Lease { ttl, deadline, keys: BTreeSet::new() });
        self.deadlines.insert((deadline, lease));
        Ok(lease)
    }

    fn keep_alive(&mut self, lease: LeaseId, now: Instant) -> Result<()> {
        let entry = self.leases.get_mut(&lease).ok_or(Error::LeaseNotFound(lease))?;
        let deadline = lease_deadline(lease, now, entry.ttl)?;
        self.deadlines.remove(&(entry.deadline, lease));
        entry.deadline = deadline;
        self.deadlines.insert((deadline, lease));
        Ok(())
    }

    fn revoke(&mut self, lease: LeaseId) -> Result<()> {
        if !self.leases.contains_key(&lease) {
            return Err(Error::LeaseNotFound(lease));
        }
        self.end_lease(lease);
        Ok(())
    }

    /// Removes a lease and deletes its keys, one revision each.
    fn end_lease(&mut self, lease: LeaseId) {
        if let Some(ended) = self.leases.remove(&lease) {
            self.deadlines.remove(&(ended.deadline, lease));
            for key in ended.keys {
                self.delete(&key);
            }
        }
    }

    fn put(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        if let Some(lease) = lease {
            if !self.leases.contains_key(&lease) {
                return Err(Error::LeaseNotFound(lease));
            }
        }
        self.revision += 1;
        let revision = self.revision;
        let old = self.kvs.get(key).map(|old| (old.create_revision, old.lease));
        let create_revision = match old {
            Some((create_revision, old_lease)) => {
                if old_lease != lease {
                    self.detach(key, old_lease);
                }
                create_revision
            }
            None => revision,
        };
        if let Some(lease) = lease {
            if let Some(entry) = self.leases.get_mut(&lease) {
                entry.keys.insert(key.to_string());
            }
        }
        let stored = Stored { value, create_revision, mod_revision: revision, lease };
        self.record(WatchEvent::Put(to_kv(key, &stored)));
        self.kvs.insert(key.to_string(), stored);
        Ok(revision)
    }

    fn detach(&mut self, key: &str, lease: Option<LeaseId>) {
        if let Some(entry) = lease.and_then(|lease| self.leases.get_mut(&lease)) {
            entry.keys.remove(key);
        }
    }

    fn get(&self, key: &str) -> Option<KeyValue> {
        self.kvs.get(key).map(|stored| to_kv(key, stored))
    }

    fn get_prefix(&self, prefix: &str) -> Listing {
        let kvs = self
            .kvs
            .range::<str, _>((std::ops::Bound::Included(prefix), std::ops::Bound::Unbounded))
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, stored)| to_kv(key, stored))
            .collect();
        Listing { kvs, revision: self.revision }
    }

    /// Deletes `key`; a missing key writes nothing.
    fn delete(&mut self, key: &str) -> bool {
        let Some(old) = self.kvs.remove(key) else {
            return false;
        };
        self.detach(key, old.lease);
        self.revision += 1;
        self.record(WatchEvent::Delete { key: key.to_string(), mod_revision: self.revision });
        true
    }

    fn create_if_absent(
        &mut self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Option<Revision>> {
        if self.kvs.contains_key(key) {
            return Ok(None);
        }
        self.put(key, value, lease).map(Some)
    }

    fn check_fence(&self, fence: &Fence) -> Result<()> {
        match self.kvs.get(&fence.key) {
            Some(lock) if lock.create_revision == fence.revision => Ok(()),
            _ => Err(Error::FenceLost { key: fence.key.clone() }),
        }
    }

    /// Appends the event of the latest write, dropping the oldest events
    /// beyond the limits (the newest one is always kept).
    fn record(&mut self, event: WatchEvent) {
        self.history_bytes += event_size(&event);
        self.history.push_back(event);
        while self.history.len() > self.max_events
            || (self.history_bytes > self.max_bytes && self.history.len() > 1)
        {
            let Some(dropped) = self.history.pop_front() else {
                break;
            };
            self.history_bytes = self.history_bytes.saturating_sub(event_size(&dropped));
            self.compacted = dropped.revision();
        }
    }

    /// Whether a watch may start at `start` (its events are still kept).
    fn check_watch_start(&self, start: Revision) -> Result<()> {
        if start <= self.compacted && self.compacted > 1 {
            return Err(Error::Compacted { requested: start, oldest: self.compacted + 1 });
        }
        Ok(())
    }

    /// The events under `prefix` from revision `from`, scanning at most
    /// `max_scan` revisions.
    fn events_from(&self, prefix: &str, from: Revision, max_scan: usize) -> Result<Batch> {
        self.check_watch_start(from)?;
        // No event has a revision at or below `compacted` any more (revision 1 never had one).
        let from = from.max(self.compacted + 1);
        if from > self.revision {
            return Ok(Batch { events: Vec::new(), next: from, caught_up: true });
        }
        let skip = usize::try_from(from - (self.compacted + 1)).unwrap_or(usize::MAX);
        let mut next = from;
        let mut events = Vec::new();
        for event in self.history.iter().skip(skip).take(max_scan) {
            next = event.revision() + 1;
            if event.key().starts_with(prefix) {
                events.push(event.clone());
            }
        }
        Ok(Batch { events, next, caught_up: next > self.revision })
    }
}

fn to_kv(key: &str, stored: &Stored) -> KeyValue {
    KeyValue {
        key: key.to_string(),
        value: stored.value.clone(),
        create_revision: stored.create_revision,
        mod_revision: stored.mod_revision,
        lease: stored.lease,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn core_expires_leases_at_their_deadline_only() {
        let t0 = Instant::now();
        let mut st = State::new(100, 1 << 20);
        let short = st.grant(Duration::from_secs(1), t0).unwrap();
        let long = st.grant(Duration::from_secs(5), t0).unwrap();
        st.put("a", value("1"), Some(short)).unwrap();
        st.put("b", value("2"), Some(long)).unwrap();
        st.put("c", value("3"), None).unwrap();
        st.expire(t0 + Duration::from_millis(999));
        assert_eq!(st.kvs.len(), 3);
        st.expire(t0 + Duration::from_secs(1));
        assert!(st.get("a").is_none());
        assert!(st.get("b").is_some());
        assert_eq!(st.keep_alive(short, t0), Err(Error::LeaseNotFound(short)));
        // Refreshing moves the deadline to now + ttl.
        st.keep_alive(long, t0 + Duration::from_secs(4)).unwrap();
        st.expire(t0 + Duration::from_secs(8));
        assert!(st.get("b").is_some());
        st.expire(t0 + Duration::from_secs(9));
        assert!(st.get("b").is_none());
        assert!(st.get("c").is_some());
        assert_eq!(st.next_deadline(), None);
    }

    #[test]
    fn core_revisions_and_lease_detach() {
        let t0 = Instant::now();
        let mut st = State::new(100, 1 << 20);
        assert_eq!(st.revision, 1);
        let lease = st.grant(Duration::from_secs(1), t0).unwrap();
        assert_eq!(st.put("k", value("1"), Some(lease)).unwrap(), 2);
        // Deleting a missing key writes nothing.
        assert!(!st.delete("missing"));
        assert_eq!(st.revision, 2);
        // A put without a lease detaches the key, so the lease no longer deletes it.
        assert_eq!(st.put("k", value("2"), None).unwrap(), 3);
        let kv = st.get("k").unwrap();
        assert_eq!((kv.create_revision, kv.mod_revision, kv.lease), (2, 3, None));
        st.revoke(lease).unwrap();
        assert!(st.get("k").is_some());
        assert_eq!(st.revision, 3);
        // create_if_absent on an existing key does not look at the lease.
        assert_eq!(st.create_if_absent("k", value("x"), Some(999)), Ok(None));
        assert_eq!(st.create_if_absent("new", value("x"), Some(999)), Err(Error::LeaseNotFound(999)));
        assert!(st.grant(Duration::ZERO, t0).is_err());
    }

    #[test]
    fn core_history_is_bounded_by_events_and_bytes() {
        let mut st = State::new(5, 1 << 20);
        for i in 0..10 {
            st.put(&format!("k{i}"), value("v"), None).unwrap();
        }
        // Revisions 2..=11 were written; 7..=11 are kept.
        assert_eq!(st.history.len(), 5);
        assert_eq!(st.events_from("", 6, 100).unwrap_err(), Error::Compacted { requested: 6, oldest: 7 });
        let batch = st.events_from("", 7, 100).unwrap();
        assert_eq!(batch.events.len(), 5);
        assert_eq!(batch.events[0].revision(), 7);
        assert_eq!((batch.next, batch.caught_up), (12, true));
        // Scanning is bounded per batch.
        let batch = st.events_from("", 7, 2).unwrap();
        assert_eq!((batch.events.len(), batch.next, batch.caught_up), (2, 9, false));

        let mut st = State::new(1000, 1000);
        for i in 0..10 {
            st.put(&format!("k{i}"), vec![0; 300], None).unwrap();
        }
        assert!(st.history.len() < 4);
        assert!(st.history_bytes <= 1000);
        assert!(matches!(st.events_from("", 2, 100), Err(Error::Compacted { requested: 2, .. })));
        // The newest event is kept even if it alone is over the byte limit.
        st.put("big", vec![0; 5000], None).unwrap();
        assert_eq!(st.history.len(), 1);
        assert_eq!(st.events_from("", st.revision, 10).unwrap().events.len(), 1);
    }

    /// A lock held since before the history kept: a waiter watches from
    /// its own read, not from the lock's long-compacted write. It used to
    /// retry that watch in a loop with no wait; the store's calls never
    /// wait either, so on one thread the holder's release (or its lease's
    /// refresh) never ran, and the waiter timed out on a free lock.
    #[tokio::test]
    async fn a_lock_waiter_waits_when_the_holder_s_write_is_compacted() {
        let d = MemDiscovery::with_history_limit(5, DEFAULT_HISTORY_BYTES);
        let l1 = d.grant_lease(Duration::from_secs(60)).await.unwrap();
        let l2 = d.grant_lease(Duration::from_secs(60)).await.unwrap();
        let f1 = d.lock("/job/lock", value("one"), l1, Duration::ZERO).await.unwrap();
        for i in 0..10 {
            d.put(&format!("/job/state/{i}"), value("v"), None).await.unwrap();
        }
        assert!(matches!(d.watch_prefix("/job/lock", f1.revision + 1).await, Err(Error::Compacted { .. })));
        let second = d.lock("/job/lock", value("two"), l2, Duration::from_secs(5));
        let release = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            d.revoke_lease(l1).await.unwrap();
        };
        let (f2, ()) = tokio::join!(second, release);
        let f2 = f2.unwrap_or_else(|e| panic!("the waiter did not get the released lock: {e}"));
        assert_eq!(f2.lease, l2);
        assert!(f2.revision > f1.revision);
    }

    #[tokio::test]
    async fn watch_from_compacted_revision_fails_and_recent_replays() {
        let d = MemDiscovery::with_history_limit(5, DEFAULT_HISTORY_BYTES);
        for i in 0..10 {
            d.put(&format!("/h/{i}"), value("v"), None).await.unwrap();
        }
        let err = d.watch_prefix("/h/", 2).await.unwrap_err();
        assert_eq!(err, Error::Compacted { requested: 2, oldest: 7 });
        let mut w = d.watch_prefix("/h/", 7).await.unwrap();
        for revision in 7..=11 {
            let event = w.next().await.unwrap().unwrap();
            assert_eq!(event.revision(), revision);
        }
    }

    #[tokio::test]
    async fn lagging_watch_reader_gets_compacted_then_end() {
        let d = MemDiscovery::with_history_limit(10, DEFAULT_HISTORY_BYTES);
        let mut w = d.watch_prefix("/lag/", 0).await.unwrap();
        // On this single-threaded runtime the watch task cannot run during
        // these writes, so it falls behind the ten kept events.
        for i in 0..100 {
            d.put(&format!("/lag/{i}"), value("v"), None).await.unwrap();
        }
        match w.next().await {
            Some(Err(Error::Compacted { requested, oldest })) => {
                assert_eq!(requested, 2);
                assert_eq!(oldest, 92);
            }
            other => panic!("expected Compacted, got {other:?}"),
        }
        assert!(w.next().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn leases_expire_without_any_operation() {
        let d = MemDiscovery::new();
        let lease = d.grant_lease(Duration::from_millis(1500)).await.unwrap();
        d.put("/e/k", value("v"), Some(lease)).await.unwrap();
        let mut w = d.watch_prefix("/e/", 0).await.unwrap();
        let start = Instant::now();
        let event = tokio::time::timeout(Duration::from_secs(10), w.next()).await.unwrap().unwrap().unwrap();
        assert!(matches!(event, WatchEvent::Delete { ref key, .. } if key == "/e/k"));
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(1500), "expired after {waited:?}");
        assert!(waited < Duration::from_secs(2), "expired after {waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn shorter_lease_granted_later_wakes_the_expiry_task() {
        let d = MemDiscovery::new();
        d.grant_lease(Duration::from_secs(3600)).await.unwrap();
        let short = d.grant_lease(Duration::from_secs(1)).await.unwrap();
        d.put("/s/k", value("v"), Some(short)).await.unwrap();
        let mut w = d.watch_prefix("/s/", 0).await.unwrap();
        let event = tokio::time::timeout(Duration::from_secs(5), w.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(event.key(), "/s/k");
        assert!(matches!(event, WatchEvent::Delete { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_task_ends_after_the_store_is_dropped() {
        let d = MemDiscovery::new();
        let other = d.clone();
        d.grant_lease(Duration::from_secs(3600)).await.unwrap();
        let task = d.inner.expiry_task.lock().unwrap().take().unwrap();
        tokio::task::yield_now().await;
        assert!(!task.is_finished());
        drop(d);
        // A clone still holds the store: the task keeps running.
        tokio::task::yield_now().await;
        assert!(!task.is_finished());
        drop(other);
        // Well before the lease's deadline, the task sees the store is gone.
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("expiry task still running after the store was dropped")
            .unwrap();
    }

    #[tokio::test]
    async fn dropped_watchers_are_removed() {
        let d = MemDiscovery::new();
        let w1 = d.watch_prefix("/w/", 0).await.unwrap();
        let mut w2 = d.watch_prefix("/w/", 0).await.unwrap();
        assert_eq!(d.inner.watchers.load(Ordering::SeqCst), 2);
        drop(w1);
        d.put("/w/a", value("v"), None).await.unwrap();
        assert_eq!(w2.next().await.unwrap().unwrap().key(), "/w/a");
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.inner.watchers.load(Ordering::SeqCst) != 1 {
            assert!(Instant::now() < deadline, "dropped watcher still running");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(w2);
        while d.inner.watchers.load(Ordering::SeqCst) != 0 {
            assert!(Instant::now() < deadline, "dropped watcher still running");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn watch_stream_ends_when_the_store_is_dropped() {
        let d = MemDiscovery::new();
        let mut w = d.watch_prefix("/x/", 0).await.unwrap();
        drop(d);
        let next = tokio::time::timeout(Duration::from_secs(5), w.next()).await.unwrap();
        assert!(next.is_none());
    }

    #[tokio::test]
    async fn watch_arguments_are_checked() {
        let d = MemDiscovery::new();
        assert!(matches!(d.watch_prefix("/a/", -1).await, Err(Error::InvalidArgument(_))));
        // From revision 0: only writes after the watch started.
        d.put("/a/old", value("v"), None).await.unwrap();
        let mut w = d.watch_prefix("/a/", 0).await.unwrap();
        d.put("/a/new", value("v"), None).await.unwrap();
        assert_eq!(w.next().await.unwrap().unwrap().key(), "/a/new");
        // A future revision waits for it.
        let future = d.revision() + 2;
        let mut w = d.watch_prefix("/a/", future).await.unwrap();
        d.put("/a/1", value("v"), None).await.unwrap();
        d.put("/a/2", value("v"), None).await.unwrap();
        let event = w.next().await.unwrap().unwrap();
        assert_eq!((event.key(), event.revision()), ("/a/2", future));
    }

    #[tokio::test]
    async fn works_without_an_expiry_task() {
        // Lazy expiry alone is enough for correctness.
        let d = MemDiscovery::new();
        let lease = d.grant_lease(Duration::from_millis(50)).await.unwrap();
        d.inner.expiry_task.lock().unwrap().take().unwrap().abort();
        d.put("/l/k", value("v"), Some(lease)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(d.get("/l/k").await.unwrap(), None);
        assert_eq!(d.keep_alive(lease).await, Err(Error::LeaseNotFound(lease)));
    }
}
