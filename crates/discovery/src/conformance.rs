//! The conformance suite: the behaviour every [`Discovery`] backend must
//! have, written once and run against each backend with
//! [`discovery_conformance!`](crate::discovery_conformance).
//!
//! This is test support code: each check panics (through `assert!`) when the
//! backend misbehaves. A check uses only keys under the `prefix` it is given,
//! so checks may share one server; [`unique_prefix`] makes such a prefix.
//! Waits for lease expiry are deadline loops that end as soon as the key is
//! gone, with room for etcd, which rounds a 1 s ttl up to its minimum
//! (about 2 s) and checks for expiry twice a second. Checks never assert that
//! the global revision stayed put, since other checks may write concurrently.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::{Discovery, Error, Fence, Session, WatchEvent, WatchStream};

/// Longest wait for a lease to expire on any backend.
const EXPIRY_WAIT: Duration = Duration::from_secs(10);
/// Longest wait for a watch event that should come promptly.
const EVENT_WAIT: Duration = Duration::from_secs(10);
/// How often the deadline loops poll.
const POLL: Duration = Duration::from_millis(50);
/// The ttl of leases that should not expire during a check.
const LONG_TTL: Duration = Duration::from_secs(60);
/// The ttl of leases that a check lets expire.
const SHORT_TTL: Duration = Duration::from_secs(1);

/// A key prefix no other check, test process or earlier run uses:
/// `/oar-conformance/<pid>-<nanos>-<n>/<name>/`.
pub fn unique_prefix(name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("/oar-conformance/{}-{nanos}-{n}/{name}/", std::process::id())
}

fn bytes(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// The next event of `watch`, failing the check if none comes in time.
async fn next_event(watch: &mut WatchStream, what: &str) -> WatchEvent {
    match tokio::time::timeout(EVENT_WAIT, watch.next()).await {
        Ok(Some(Ok(event))) => event,
        Ok(Some(Err(e))) => panic!("waiting for {what}: watch failed: {e}"),
        Ok(None) => panic!("waiting for {what}: watch ended"),
        Err(_) => panic!("waiting for {what}: no event within {EVENT_WAIT:?}"),
    }
}

/// Waits until `key` is gone, failing the check after [`EXPIRY_WAIT`].
async fn wait_until_deleted(d: &dyn Discovery, key: &str) {
    let deadline = Instant::now() + EXPIRY_WAIT;
    loop {
        if d.get(key).await.unwrap().is_none() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{key} still present {EXPIRY_WAIT:?} after its lease should have expired"
        );
        tokio::time::sleep(POLL).await;
    }
}

fn assert_put(event: &WatchEvent, key: &str, value: &str) {
    match event {
        WatchEvent::Put(kv) => {
            assert_eq!(kv.key, key, "event {event:?}");
            assert_eq!(kv.value, bytes(value), "event {event:?}");
        }
        WatchEvent::Delete { .. } => panic!("expected Put of {key}, got {event:?}"),
    }
}

fn assert_delete(event: &WatchEvent, key: &str) {
    match event {
        WatchEvent::Delete { key: deleted, .. } => assert_eq!(deleted, key, "event {event:?}"),
        WatchEvent::Put(_) => panic!("expected Delete of {key}, got {event:?}"),
    }
}

/// put, get and delete of one key, and their revisions.
pub async fn put_get_delete(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}k");
    assert_eq!(d.get(&key).await.unwrap(), None);
    let revision = d.put(&key, bytes("v1"), None).await.unwrap();
    let kv = d.get(&key).await.unwrap().unwrap();
    assert_eq!(kv.key, key);
    assert_eq!(kv.value, bytes("v1"));
    assert_eq!(kv.create_revision, revision);
    assert_eq!(kv.mod_revision, revision);
    assert_eq!(kv.lease, None);
    assert!(d.delete(&key).await.unwrap());
    assert_eq!(d.get(&key).await.unwrap(), None);
    assert!(!d.delete(&key).await.unwrap(), "deleting a missing key");
}

/// Revisions grow with every write; `create_revision` survives updates and
/// starts over when a key is deleted and written again.
pub async fn revisions_increase_and_create_revision_kept(d: &dyn Discovery, prefix: &str) {
    let a = format!("{prefix}a");
    let b = format!("{prefix}b");
    let r1 = d.put(&a, bytes("1"), None).await.unwrap();
    let r2 = d.put(&a, bytes("2"), None).await.unwrap();
    let r3 = d.put(&b, bytes("3"), None).await.unwrap();
    assert!(r1 < r2 && r2 < r3, "revisions {r1}, {r2}, {r3}");
    let kv = d.get(&a).await.unwrap().unwrap();
    assert_eq!((kv.create_revision, kv.mod_revision), (r1, r2));
    assert_eq!(kv.value, bytes("2"));
    let listing = d.get_prefix(prefix).await.unwrap();
    assert!(listing.revision >= r3, "listing at {} after write {r3}", listing.revision);
    assert!(d.delete(&a).await.unwrap());
    let r4 = d.put(&a, bytes("4"), None).await.unwrap();
    assert!(r4 > r3);
    let kv = d.get(&a).await.unwrap().unwrap();
    assert_eq!((kv.create_revision, kv.mod_revision), (r4, r4), "a new incarnation");
}

/// `get_prefix` returns exactly the keys under the prefix, sorted.
pub async fn get_prefix_sorted_and_exact(d: &dyn Discovery, prefix: &str) {
    let mut last = 0;
    for name in ["a/2", "a/1", "ab", "a", "a/3", "b/1", "a/1/x"] {
        last = d.put(&format!("{prefix}{name}"), bytes(name), None).await.unwrap();
    }
    let listing = d.get_prefix(&format!("{prefix}a/")).await.unwrap();
    let keys: Vec<String> = listing.kvs.iter().map(|kv| kv.key.clone()).collect();
    let expected: Vec<String> =
        ["a/1", "a/1/x", "a/2", "a/3"].iter().map(|name| format!("{prefix}{name}")).collect();
    assert_eq!(keys, expected);
    for kv in &listing.kvs {
        assert_eq!(kv.value, bytes(&kv.key[prefix.len()..]));
    }
    assert!(listing.revision >= last);
    let empty = d.get_prefix(&format!("{prefix}none/")).await.unwrap();
    assert!(empty.kvs.is_empty());
    assert!(empty.revision >= last);
    assert_eq!(d.get_prefix(prefix).await.unwrap().kvs.len(), 7);
}

/// `create_if_absent` creates once; later calls change nothing until the key
/// is deleted.
pub async fn create_if_absent_only_once(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}claim");
    let created = d.create_if_absent(&key, bytes("first"), None).await.unwrap();
    let Some(r1) = created else {
        panic!("{key} was not created");
    };
    assert_eq!(d.create_if_absent(&key, bytes("second"), None).await.unwrap(), None);
    let kv = d.get(&key).await.unwrap().unwrap();
    assert_eq!(kv.value, bytes("first"));
    assert_eq!((kv.create_revision, kv.mod_revision), (r1, r1));
    assert!(d.delete(&key).await.unwrap());
    let r2 = d.create_if_absent(&key, bytes("third"), None).await.unwrap();
    assert!(matches!(r2, Some(r2) if r2 > r1), "re-created at {r2:?}");
}

/// Keys of a lease that is not refreshed are deleted; other keys stay.
pub async fn lease_expiry_deletes_keys(d: &dyn Discovery, prefix: &str) {
    let lease = d.grant_lease(SHORT_TTL).await.unwrap();
    let a = format!("{prefix}a");
    let b = format!("{prefix}b");
    let kept = format!("{prefix}kept");
    d.put(&a, bytes("a"), Some(lease)).await.unwrap();
    d.put(&b, bytes("b"), Some(lease)).await.unwrap();
    d.put(&kept, bytes("kept"), None).await.unwrap();
    assert_eq!(d.get(&a).await.unwrap().unwrap().lease, Some(lease));
    wait_until_deleted(d, &a).await;
    wait_until_deleted(d, &b).await;
    assert!(d.get(&kept).await.unwrap().is_some());
    assert_eq!(d.keep_alive(lease).await, Err(Error::LeaseNotFound(lease)));
}

/// Refreshing a lease keeps its key well past the lease's ttl.
pub async fn keep_alive_keeps_key_alive(d: &dyn Discovery, prefix: &str) {
    let lease = d.grant_lease(SHORT_TTL).await.unwrap();
    let key = format!("{prefix}alive");
    d.put(&key, bytes("v"), Some(lease)).await.unwrap();
    // Three seconds: past the ttl even as etcd rounds it up.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
        d.keep_alive(lease).await.unwrap();
    }
    let kv = d.get(&key).await.unwrap();
    assert!(kv.is_some(), "{key} gone although its lease was refreshed");
    d.revoke_lease(lease).await.unwrap();
}

/// Revoking a lease deletes its keys at once; the lease is then unknown.
pub async fn revoke_deletes_keys(d: &dyn Discovery, prefix: &str) {
    let lease = d.grant_lease(LONG_TTL).await.unwrap();
    let a = format!("{prefix}a");
    let b = format!("{prefix}b");
    d.put(&a, bytes("a"), Some(lease)).await.unwrap();
    d.put(&b, bytes("b"), Some(lease)).await.unwrap();
    d.revoke_lease(lease).await.unwrap();
    assert_eq!(d.get(&a).await.unwrap(), None);
    assert_eq!(d.get(&b).await.unwrap(), None);
    assert_eq!(d.revoke_lease(lease).await, Err(Error::LeaseNotFound(lease)));
    assert_eq!(d.keep_alive(lease).await, Err(Error::LeaseNotFound(lease)));
}

/// Writes with a lease that never existed, was revoked or expired fail with
/// `LeaseNotFound` and write nothing.
pub async fn unknown_or_expired_lease_rejected(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}k");
    let unknown = 0x3fff_ffff_1234_5678;
    assert_eq!(d.put(&key, bytes("v"), Some(unknown)).await, Err(Error::LeaseNotFound(unknown)));
    assert_eq!(d.keep_alive(unknown).await, Err(Error::LeaseNotFound(unknown)));
    assert_eq!(d.create_if_absent(&key, bytes("v"), Some(unknown)).await, Err(Error::LeaseNotFound(unknown)));

    let revoked = d.grant_lease(LONG_TTL).await.unwrap();
    d.revoke_lease(revoked).await.unwrap();
    assert_eq!(d.put(&key, bytes("v"), Some(revoked)).await, Err(Error::LeaseNotFound(revoked)));

    let expired = d.grant_lease(SHORT_TTL).await.unwrap();
    let marker = format!("{prefix}marker");
    d.put(&marker, bytes("v"), Some(expired)).await.unwrap();
    wait_until_deleted(d, &marker).await;
    assert_eq!(d.put(&key, bytes("v"), Some(expired)).await, Err(Error::LeaseNotFound(expired)));
    assert_eq!(d.get(&key).await.unwrap(), None);
}

/// Empty keys and zero ttls are refused.
pub async fn invalid_arguments_rejected(d: &dyn Discovery, prefix: &str) {
    let _ = prefix;
    assert!(matches!(d.grant_lease(Duration::ZERO).await, Err(Error::InvalidArgument(_))));
    assert!(matches!(d.put("", bytes("v"), None).await, Err(Error::InvalidArgument(_))));
    assert!(matches!(d.get("").await, Err(Error::InvalidArgument(_))));
    assert!(matches!(d.delete("").await, Err(Error::InvalidArgument(_))));
    assert!(matches!(d.create_if_absent("", bytes("v"), None).await, Err(Error::InvalidArgument(_))));
}

/// A watch sees puts, deletes and lease expiry under its prefix, in order,
/// and nothing outside it.
pub async fn watch_sees_put_delete_expiry_in_order(d: &dyn Discovery, prefix: &str) {
    let dir = format!("{prefix}w/");
    let a = format!("{dir}a");
    let b = format!("{dir}b");
    let mut watch = d.watch_prefix(&dir, 0).await.unwrap();
    let lease = d.grant_lease(SHORT_TTL).await.unwrap();
    let r1 = d.put(&a, bytes("a1"), Some(lease)).await.unwrap();
    let r2 = d.put(&b, bytes("b1"), None).await.unwrap();
    d.put(&format!("{prefix}w2"), bytes("outside"), None).await.unwrap();
    let r3 = d.put(&a, bytes("a2"), Some(lease)).await.unwrap();
    assert!(d.delete(&b).await.unwrap());

    let event = next_event(&mut watch, "put a").await;
    assert_put(&event, &a, "a1");
    assert_eq!(event.revision(), r1);
    if let WatchEvent::Put(kv) = &event {
        assert_eq!((kv.create_revision, kv.lease), (r1, Some(lease)));
    }
    let event = next_event(&mut watch, "put b").await;
    assert_put(&event, &b, "b1");
    assert_eq!(event.revision(), r2);
    let event = next_event(&mut watch, "second put a").await;
    assert_put(&event, &a, "a2");
    if let WatchEvent::Put(kv) = &event {
        assert_eq!((kv.create_revision, kv.mod_revision), (r1, r3));
    }
    let event = next_event(&mut watch, "delete b").await;
    assert_delete(&event, &b);
    let r4 = event.revision();
    assert!(r4 > r3);
    // Nothing else is written under the prefix: the next event is the expiry.
    let event = next_event(&mut watch, "expiry of a").await;
    assert_delete(&event, &a);
    assert!(event.revision() > r4);
}

/// A watch from a past revision replays the history from there, and a watch
/// from `listing.revision + 1` continues a listing without gap or overlap.
pub async fn watch_from_old_revision_replays_history(d: &dyn Discovery, prefix: &str) {
    let a = format!("{prefix}a");
    let b = format!("{prefix}b");
    let r1 = d.put(&a, bytes("1"), None).await.unwrap();
    let r2 = d.put(&b, bytes("2"), None).await.unwrap();
    let r3 = d.put(&a, bytes("3"), None).await.unwrap();
    assert!(d.delete(&b).await.unwrap());

    let mut watch = d.watch_prefix(prefix, r1).await.unwrap();
    let event = next_event(&mut watch, "replayed put a").await;
    assert_put(&event, &a, "1");
    assert_eq!(event.revision(), r1);
    let event = next_event(&mut watch, "replayed put b").await;
    assert_put(&event, &b, "2");
    assert_eq!(event.revision(), r2);
    let event = next_event(&mut watch, "replayed second put a").await;
    assert_put(&event, &a, "3");
    if let WatchEvent::Put(kv) = &event {
        assert_eq!((kv.create_revision, kv.mod_revision), (r1, r3));
    }
    let event = next_event(&mut watch, "replayed delete b").await;
    assert_delete(&event, &b);
    assert!(event.revision() > r3);

    let mut from_r3 = d.watch_prefix(prefix, r3).await.unwrap();
    let event = next_event(&mut from_r3, "put a at the start revision").await;
    assert_eq!(event.revision(), r3);

    // Listing, then watching from just after it.
    let listing = d.get_prefix(prefix).await.unwrap();
    assert_eq!(listing.kvs.len(), 1);
    let c = format!("{prefix}c");
    let r5 = d.put(&c, bytes("5"), None).await.unwrap();
    let mut continued = d.watch_prefix(prefix, listing.revision + 1).await.unwrap();
    let event = next_event(&mut continued, "put c after the listing").await;
    assert_put(&event, &c, "5");
    assert_eq!(event.revision(), r5);
}

/// A second holder waits on the lock until the first one's lease is
/// revoked, then gets it with a newer fence; the same lease re-locks at once.
pub async fn lock_excludes_until_revoked(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}lock");
    let l1 = d.grant_lease(LONG_TTL).await.unwrap();
    let l2 = d.grant_lease(LONG_TTL).await.unwrap();
    let f1 = d.lock(&key, bytes("one"), l1, Duration::from_secs(1)).await.unwrap();
    let kv = d.get(&key).await.unwrap().unwrap();
    assert_eq!(f1, Fence { key: key.clone(), revision: kv.create_revision, lease: l1 });
    assert_eq!((kv.value, kv.lease), (bytes("one"), Some(l1)));
    let again = d.lock(&key, bytes("one"), l1, Duration::ZERO).await.unwrap();
    assert_eq!(again, f1, "re-locking with the holding lease");

    let second = d.lock(&key, bytes("two"), l2, Duration::from_secs(10));
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let kv = d.get(&key).await.unwrap().unwrap();
        assert_eq!(kv.value, bytes("one"), "second holder took a held lock");
        d.revoke_lease(l1).await.unwrap();
    };
    let (f2, ()) = tokio::join!(second, release);
    let f2 = f2.unwrap();
    assert_eq!(f2.lease, l2);
    assert!(f2.revision > f1.revision);
    let kv = d.get(&key).await.unwrap().unwrap();
    assert_eq!((kv.value, kv.lease), (bytes("two"), Some(l2)));
    assert_eq!(kv.create_revision, f2.revision);

    // Releasing by deleting the key also lets a waiter in.
    let l3 = d.grant_lease(LONG_TTL).await.unwrap();
    let third = d.lock(&key, bytes("three"), l3, Duration::from_secs(10));
    let release = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(d.delete(&key).await.unwrap());
    };
    let (f3, ()) = tokio::join!(third, release);
    assert!(f3.unwrap().revision > f2.revision);
    d.revoke_lease(l2).await.unwrap();
    d.revoke_lease(l3).await.unwrap();
}

/// A held lock makes another holder time out, naming the key.
pub async fn lock_timeout(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}lock");
    let l1 = d.grant_lease(LONG_TTL).await.unwrap();
    let l2 = d.grant_lease(LONG_TTL).await.unwrap();
    d.lock(&key, bytes("one"), l1, Duration::ZERO).await.unwrap();
    let after = Duration::from_millis(300);
    let started = Instant::now();
    match d.lock(&key, bytes("two"), l2, after).await {
        Err(Error::Timeout { what, after: waited }) => {
            assert!(what.contains(&key), "timeout message {what:?} names no key");
            assert_eq!(waited, after);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(started.elapsed() >= after);
    assert!(matches!(d.lock(&key, bytes("two"), l2, Duration::ZERO).await, Err(Error::Timeout { .. })));
    assert_eq!(d.get(&key).await.unwrap().unwrap().value, bytes("one"));
    d.revoke_lease(l1).await.unwrap();
    d.revoke_lease(l2).await.unwrap();
}

/// Fenced writes succeed while the lock is held, and fail once its key was
/// deleted, and still fail after another holder re-created it.
pub async fn fenced_writes_follow_the_lock(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}lock");
    let state = format!("{prefix}state");
    let other = format!("{prefix}other");
    let l1 = d.grant_lease(LONG_TTL).await.unwrap();
    let l2 = d.grant_lease(LONG_TTL).await.unwrap();
    let f1 = d.lock(&key, bytes("one"), l1, Duration::ZERO).await.unwrap();

    let r = d.put_fenced(&f1, &state, bytes("s1")).await.unwrap();
    let kv = d.get(&state).await.unwrap().unwrap();
    assert_eq!((kv.value, kv.mod_revision, kv.lease), (bytes("s1"), r, None));
    assert!(!d.delete_fenced(&f1, &other).await.unwrap());
    d.put(&other, bytes("x"), None).await.unwrap();
    assert!(d.delete_fenced(&f1, &other).await.unwrap());
    let forged = Fence { revision: f1.revision + 1, ..f1.clone() };
    let lost = Err(Error::FenceLost { key: key.clone() });
    assert_eq!(d.put_fenced(&forged, &state, bytes("forged")).await, lost);

    // The lock key is deleted: the fence is gone.
    assert!(d.delete(&key).await.unwrap());
    assert_eq!(d.put_fenced(&f1, &state, bytes("late")).await, lost);
    d.put(&other, bytes("x"), None).await.unwrap();
    assert_eq!(d.delete_fenced(&f1, &other).await, Err(Error::FenceLost { key: key.clone() }));
    assert!(d.get(&other).await.unwrap().is_some());

    // Another holder re-takes the lock: its fence works, the old one still fails.
    let f2 = d.lock(&key, bytes("two"), l2, Duration::ZERO).await.unwrap();
    d.put_fenced(&f2, &state, bytes("s2")).await.unwrap();
    assert_eq!(d.put_fenced(&f1, &state, bytes("late")).await, lost);
    assert_eq!(d.delete_fenced(&f1, &state).await, Err(Error::FenceLost { key: key.clone() }));
    assert_eq!(d.get(&state).await.unwrap().unwrap().value, bytes("s2"));
    d.revoke_lease(l1).await.unwrap();
    d.revoke_lease(l2).await.unwrap();
}

/// A fenced range delete removes exactly the keys in `[start, end)`, and
/// nothing once the fence is lost.
pub async fn fenced_range_delete(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}lock");
    let lease = d.grant_lease(LONG_TTL).await.unwrap();
    let fence = d.lock(&key, bytes("one"), lease, Duration::ZERO).await.unwrap();
    let journal = |n: u32| format!("{prefix}journal/{n:05}");
    for n in 1..=5 {
        d.put_fenced(&fence, &journal(n), bytes("r")).await.unwrap();
    }
    let empty = d.delete_range_fenced(&fence, &journal(3), &journal(3)).await;
    assert!(matches!(empty, Err(Error::InvalidArgument(_))), "{empty:?}");
    d.delete_range_fenced(&fence, &journal(0), &journal(4)).await.unwrap();
    let left: Vec<String> =
        d.get_prefix(&format!("{prefix}journal/")).await.unwrap().kvs.into_iter().map(|kv| kv.key).collect();
    assert_eq!(left, vec![journal(4), journal(5)]);
    assert!(d.get(&key).await.unwrap().is_some(), "keys outside the range stay");

    d.revoke_lease(lease).await.unwrap();
    let lost = d.delete_range_fenced(&fence, &journal(0), &journal(9)).await;
    assert_eq!(lost, Err(Error::FenceLost { key: key.clone() }));
    assert_eq!(d.get_prefix(&format!("{prefix}journal/")).await.unwrap().kvs.len(), 2);
}

/// A [`ChangeSignal`](crate::ChangeSignal) wakes at a write under its
/// prefix, not at its (here one hour) poll interval; writes elsewhere do
/// not wake it.
pub async fn change_signal_wakes_at_a_write(d: &dyn Discovery, prefix: &str) {
    let watched = format!("{prefix}watched/");
    let mut signal = crate::ChangeSignal::new(d, &watched).await;
    d.put(&format!("{prefix}elsewhere"), bytes("x"), None).await.unwrap();
    let quiet =
        tokio::time::timeout(Duration::from_millis(300), signal.wait(Duration::from_secs(3600))).await;
    assert!(quiet.is_err(), "a write outside the prefix woke it");
    d.put(&format!("{watched}key"), bytes("y"), None).await.unwrap();
    let woke = tokio::time::timeout(Duration::from_secs(20), signal.wait(Duration::from_secs(3600))).await;
    assert!(woke.is_ok(), "a write under the prefix did not wake it");
}

/// A fence dies with the lease of its lock key.
pub async fn fence_lost_after_lease_expiry(d: &dyn Discovery, prefix: &str) {
    let key = format!("{prefix}lock");
    let state = format!("{prefix}state");
    let lease = d.grant_lease(SHORT_TTL).await.unwrap();
    let fence = d.lock(&key, bytes("one"), lease, Duration::ZERO).await.unwrap();
    d.put_fenced(&fence, &state, bytes("s1")).await.unwrap();
    wait_until_deleted(d, &key).await;
    assert_eq!(d.put_fenced(&fence, &state, bytes("late")).await, Err(Error::FenceLost { key: key.clone() }));
    assert_eq!(d.get(&state).await.unwrap().unwrap().value, bytes("s1"));
}

/// A `Session` keeps its lease alive past the ttl, reports the loss when the
/// lease is revoked behind its back, and revokes the lease on close. (Takes
/// an `Arc` because the session's task outlives this call's borrow.)
pub async fn session_keeps_lease_and_reports_loss(d: Arc<dyn Discovery>, prefix: &str) {
    let key = format!("{prefix}member");
    let session = Session::start(d.clone(), SHORT_TTL).await.unwrap();
    d.put(&key, bytes("me"), Some(session.lease())).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(d.get(&key).await.unwrap().is_some(), "session let its lease expire");
    assert!(!session.is_lost());

    let mut lost = session.lost();
    d.revoke_lease(session.lease()).await.unwrap();
    // Keep no `watch::Ref` alive: it would block the session's own updates.
    let reported = tokio::time::timeout(EXPIRY_WAIT, lost.wait_for(|lost| *lost))
        .await
        .map(|seen| seen.map(|lost| *lost));
    assert!(matches!(reported, Ok(Ok(true))), "revoked lease not reported lost: {reported:?}");
    assert!(session.is_lost());
    session.close().await.unwrap();

    let session = Session::start(d.clone(), LONG_TTL).await.unwrap();
    let lease = session.lease();
    d.put(&key, bytes("me again"), Some(lease)).await.unwrap();
    session.close().await.unwrap();
    assert_eq!(d.get(&key).await.unwrap(), None, "close left the lease's key");
    assert_eq!(d.keep_alive(lease).await, Err(Error::LeaseNotFound(lease)));
}

/// Expands to one `#[tokio::test]` (multi-threaded, two workers) per
/// conformance check, each running it against a fresh `$make`.
///
/// `$make` is evaluated inside each async test and must give an
/// `Arc<D>` for some `D: Discovery` (or an `Arc<dyn Discovery>`); it may
/// `.await`. Each check gets its own [`unique_prefix`]. The calling crate
/// needs `tokio` (features `macros`, `rt-multi-thread`) among its
/// (dev-)dependencies.
///
/// ```
/// // tests/mem_conformance.rs: one fresh store per check. A backend that
/// // connects writes e.g. `Arc::new(EtcdDiscovery::connect(..).await.unwrap())`.
/// use std::sync::Arc;
/// use oar_discovery::MemDiscovery;
///
/// oar_discovery::discovery_conformance!(Arc::new(MemDiscovery::new()));
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! discovery_conformance {
    ($make:expr) => {
        $crate::discovery_conformance!(@checks ($make);
            put_get_delete,
            revisions_increase_and_create_revision_kept,
            get_prefix_sorted_and_exact,
            create_if_absent_only_once,
            lease_expiry_deletes_keys,
            keep_alive_keeps_key_alive,
            revoke_deletes_keys,
            unknown_or_expired_lease_rejected,
            invalid_arguments_rejected,
            watch_sees_put_delete_expiry_in_order,
            watch_from_old_revision_replays_history,
            lock_excludes_until_revoked,
            lock_timeout,
            fenced_writes_follow_the_lock,
            fenced_range_delete,
            fence_lost_after_lease_expiry,
            change_signal_wakes_at_a_write,
        );

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn session_keeps_lease_and_reports_loss() {
            let d: ::std::sync::Arc<dyn $crate::Discovery> = $make;
            $crate::conformance::session_keeps_lease_and_reports_loss(
                d,
                &$crate::conformance::unique_prefix("session_keeps_lease_and_reports_loss"),
            )
            .await;
        }
    };
    (@checks ($make:expr); $($check:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let d: ::std::sync::Arc<dyn $crate::Discovery> = $make;
                $crate::conformance::$check(
                    &*d,
                    &$crate::conformance::unique_prefix(::std::stringify!($check)),
                )
                .await;
            }
        )*
    };
}
