//! The conformance suite against a real etcd, plus etcd-specific behaviour:
//! outages give transient errors instead of hangs, watches end when the
//! server dies, compaction is reported, dropped watches are cancelled.
//!
//! One etcd process serves the conformance checks of this test binary
//! (started lazily, killed by its watchdog when the binary exits); each
//! `#[tokio::test]` has its own runtime, so each makes its own client. The
//! fault tests start their own servers. If etcd cannot be started the tests
//! fail: `scripts/test.sh` installs it (`apt-get install -y etcd-server`).
#![cfg(feature = "etcd")]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use oar_discovery::conformance::unique_prefix;
use oar_discovery::{Discovery, Error, EtcdDiscovery, EtcdOptions, EtcdServer, WatchEvent};

/// The etcd shared by the conformance checks.
fn shared_server() -> &'static EtcdServer {
    static SERVER: OnceLock<EtcdServer> = OnceLock::new();
    SERVER.get_or_init(|| match EtcdServer::start() {
        Ok(server) => server,
        Err(e) => panic!("cannot start etcd for the tests: {e}"),
    })
}

async fn connect(server: &EtcdServer) -> EtcdDiscovery {
    EtcdDiscovery::connect(&[server.endpoint()]).await.unwrap()
}

oar_discovery::discovery_conformance!(Arc::new(connect(shared_server()).await));

/// Short timeouts, so that the outage tests finish quickly.
fn impatient() -> EtcdOptions {
    EtcdOptions::default()
        .with_connect_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(1))
}

/// Generous bound on anything that must not hang.
const NO_HANG: Duration = Duration::from_secs(30);

async fn bounded<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(NO_HANG, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what} hung for {NO_HANG:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_etcd_gives_a_timeout_not_a_hang() {
    let server = EtcdServer::start().unwrap();
    let d = EtcdDiscovery::connect_with(&[server.endpoint()], impatient()).await.unwrap();
    let prefix = unique_prefix("hung");
    let key = format!("{prefix}k");
    d.put(&key, b"v".to_vec(), None).await.unwrap();

    server.pause().unwrap();
    let got = bounded("get on a paused etcd", d.get(&key)).await;
    match &got {
        Err(Error::Timeout { what, after }) => {
            assert_eq!(*after, Duration::from_secs(1));
            assert!(what.contains(&key) && what.contains(&server.endpoint()), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(got.unwrap_err().is_transient());
    let lease = bounded("grant on a paused etcd", d.grant_lease(Duration::from_secs(5))).await;
    assert!(lease.as_ref().is_err_and(Error::is_transient), "{lease:?}");
    let watch = bounded("watch on a paused etcd", d.watch_prefix(&prefix, 0)).await;
    assert!(watch.as_ref().is_err_and(Error::is_transient), "{watch:?}");

    // Once etcd answers again, the same client works.
    server.resume().unwrap();
    assert_eq!(d.get(&key).await.unwrap().unwrap().value, b"v".to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_etcd_gives_transient_errors_and_recovers_after_restart() {
    let server = EtcdServer::start().unwrap();
    let d = EtcdDiscovery::connect_with(&[server.endpoint()], impatient()).await.unwrap();
    let prefix = unique_prefix("stopped");
    let key = format!("{prefix}k");
    let lease = d.grant_lease(Duration::from_secs(60)).await.unwrap();
    let written = d.put(&key, b"v".to_vec(), Some(lease)).await.unwrap();

    server.stop().unwrap();
    assert!(!server.is_running());
    for result in [
        bounded("put", d.put(&key, b"w".to_vec(), None)).await.map(drop),
        bounded("get", d.get(&key)).await.map(drop),
        bounded("keep alive", d.keep_alive(lease)).await,
        bounded("create if absent", d.create_if_absent(&key, b"w".to_vec(), None)).await.map(drop),
    ] {
        let err = result.unwrap_err();
        assert!(err.is_transient(), "{err:?} is not transient");
        assert!(err.to_string().contains(&server.endpoint()), "{err} names no endpoint");
    }
    let refused = bounded("connect", EtcdDiscovery::connect_with(&[server.endpoint()], impatient())).await;
    match refused {
        Err(e) => assert!(e.is_transient() && e.to_string().contains(&server.endpoint()), "{e}"),
        Ok(_) => panic!("connected to a stopped etcd"),
    }

    // Data and leases survive a restart, and the old client reconnects.
    server.restart().unwrap();
    let kv = bounded("get after restart", d.get(&key)).await.unwrap().unwrap();
    assert_eq!((kv.value, kv.mod_revision, kv.lease), (b"v".to_vec(), written, Some(lease)));
    d.keep_alive(lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_ends_with_an_error_when_etcd_is_killed() {
    let server = EtcdServer::start().unwrap();
    let d = connect(&server).await;
    let prefix = unique_prefix("killed");
    let mut watch = d.watch_prefix(&prefix, 0).await.unwrap();
    d.put(&format!("{prefix}a"), b"1".to_vec(), None).await.unwrap();
    let event = bounded("first event", watch.next()).await;
    assert!(matches!(&event, Some(Ok(WatchEvent::Put(kv))) if kv.value == b"1"), "{event:?}");

    server.kill().unwrap();
    match bounded("watch end", watch.next()).await {
        Some(Err(e)) => {
            assert!(e.is_transient(), "{e:?}");
            assert!(e.to_string().contains(&prefix), "{e} does not name the watched prefix");
        }
        other => panic!("expected an error after the kill, got {other:?}"),
    }
    assert!(bounded("after the error", watch.next()).await.is_none(), "the watch went on after its error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_from_compacted_revision_is_compacted() {
    let server = EtcdServer::start().unwrap();
    let d = connect(&server).await;
    let prefix = unique_prefix("compacted");
    let first = d.put(&format!("{prefix}a"), b"1".to_vec(), None).await.unwrap();
    d.put(&format!("{prefix}a"), b"2".to_vec(), None).await.unwrap();
    let last = d.put(&format!("{prefix}a"), b"3".to_vec(), None).await.unwrap();
    d.compact(last).await.unwrap();

    match d.watch_prefix(&prefix, first).await {
        Err(Error::Compacted { requested, oldest }) => assert_eq!((requested, oldest), (first, last)),
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert!(!Error::Compacted { requested: first, oldest: last }.is_transient());
    // From the compaction revision on, history is still there.
    let mut watch = d.watch_prefix(&prefix, last).await.unwrap();
    let event = bounded("event at the compaction revision", watch.next()).await;
    assert!(matches!(&event, Some(Ok(e)) if e.revision() == last), "{event:?}");
    // Compacting again at the same revision is refused.
    assert!(matches!(d.compact(last).await, Err(Error::InvalidArgument(_))));
    // A future revision is fine to watch from.
    let mut future = d.watch_prefix(&prefix, last + 2).await.unwrap();
    d.put(&format!("{prefix}b"), b"skipped".to_vec(), None).await.unwrap();
    let wanted = d.put(&format!("{prefix}c"), b"seen".to_vec(), None).await.unwrap();
    let event = bounded("event at a future revision", future.next()).await;
    assert!(matches!(&event, Some(Ok(e)) if e.revision() == wanted && e.key().ends_with('c')), "{event:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_watch_cancels_it_on_the_server() {
    const WATCHERS: &str = "etcd_debugging_mvcc_watcher_total";
    let server = EtcdServer::start().unwrap();
    let d = connect(&server).await;
    let prefix = unique_prefix("dropped");
    let before = server.metric(WATCHERS).unwrap().unwrap_or(0.0);
    let mut watches = Vec::new();
    for _ in 0..5 {
        watches.push(d.watch_prefix(&prefix, 0).await.unwrap());
    }
    let during = server.metric(WATCHERS).unwrap().unwrap_or(0.0);
    assert_eq!(during, before + 5.0, "etcd counts {during} watchers, expected {}", before + 5.0);
    drop(watches);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = server.metric(WATCHERS).unwrap().unwrap_or(0.0);
        if now == before {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "etcd still has {now} watchers, expected {before}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ttl_is_rounded_up_to_seconds() {
    let server = shared_server();
    let d = connect(server).await;
    let mut raw = etcd_client::Client::connect([server.endpoint()], None).await.unwrap();
    for (ttl, granted) in
        [(Duration::from_millis(1200), 2), (Duration::from_millis(1), 1), (Duration::from_secs(7), 7)]
    {
        let lease = d.grant_lease(ttl).await.unwrap();
        let live = raw.lease_time_to_live(lease, None).await.unwrap();
        assert_eq!(live.granted_ttl(), granted, "ttl {ttl:?}");
        d.revoke_lease(lease).await.unwrap();
        assert_eq!(d.keep_alive(lease).await, Err(Error::LeaseNotFound(lease)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_utf8_keys_under_a_prefix_are_reported() {
    let server = shared_server();
    let d = connect(server).await;
    let prefix = unique_prefix("bytes");
    let mut raw = etcd_client::Client::connect([server.endpoint()], None).await.unwrap();
    let mut key = prefix.as_bytes().to_vec();
    key.push(0xff);
    raw.put(key, "v", None).await.unwrap();
    let err = d.get_prefix(&prefix).await.unwrap_err();
    assert!(matches!(&err, Error::Unexpected(m) if m.contains("not UTF-8")), "{err:?}");
    assert!(!err.is_transient());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_names_unreachable_endpoints() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let err = bounded("connect", EtcdDiscovery::connect_with(std::slice::from_ref(&endpoint), impatient()))
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    assert!(err.to_string().contains(&endpoint), "{err} does not name {endpoint}");
    assert!(matches!(EtcdDiscovery::connect(&[]).await, Err(Error::InvalidArgument(_))));
}

#[test]
fn server_cleans_up_on_drop() {
    let server = EtcdServer::start().unwrap();
    let dir = server.data_dir().to_path_buf();
    let pid = server.pid().unwrap();
    assert!(dir.exists() && server.is_running());
    assert!(server.http_get("/health").unwrap().contains("true"));
    drop(server);
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "etcd (pid {pid}) still runs");
}

#[test]
fn servers_started_in_parallel_get_distinct_ports() {
    let servers: Vec<EtcdServer> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3).map(|_| scope.spawn(EtcdServer::start)).collect();
        handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    let mut endpoints: Vec<String> = servers.iter().map(EtcdServer::endpoint).collect();
    endpoints.sort();
    endpoints.dedup();
    assert_eq!(endpoints.len(), 3);
}

/// A lock whose write was compacted away: a waiter watches from its own
/// read and gets the lock when the holder's lease is revoked (it used to
/// retry a watch from the compacted write, five requests a loop with no
/// pause, until the lock was free).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_across_a_compaction_is_waited_for() {
    let server = EtcdServer::start().unwrap();
    let d = connect(&server).await;
    let key = format!("{}lock", unique_prefix("lock-compacted"));
    let l1 = d.grant_lease(Duration::from_secs(60)).await.unwrap();
    let l2 = d.grant_lease(Duration::from_secs(60)).await.unwrap();
    let f1 = d.lock(&key, b"one".to_vec(), l1, Duration::ZERO).await.unwrap();
    let mut last = 0;
    for i in 0..3 {
        last = d.put(&format!("{key}/state"), vec![i], None).await.unwrap();
    }
    d.compact(last).await.unwrap();
    assert!(matches!(d.watch_prefix(&key, f1.revision + 1).await, Err(Error::Compacted { .. })));

    let second = d.lock(&key, b"two".to_vec(), l2, Duration::from_secs(10));
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let kv = d.get(&key).await.unwrap().unwrap();
        assert_eq!(kv.lease, Some(l1), "the waiter took a held lock");
        d.revoke_lease(l1).await.unwrap();
    };
    let (f2, ()) = bounded("a lock waiter", async { tokio::join!(second, release) }).await;
    let f2 = f2.unwrap_or_else(|e| panic!("the waiter did not get the released lock: {e}"));
    assert_eq!(f2.lease, l2);
    assert!(f2.revision > f1.revision);
}

/// The value limit etcd's backend reports holds on a real etcd with its
/// default request limit: a fenced write of that many bytes goes through,
/// and one past the request limit is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_of_the_reported_limit_is_written_and_one_past_the_request_limit_is_refused() {
    let d = connect(shared_server()).await;
    let max = d.max_value_bytes().expect("etcd has a limit");
    assert_eq!(max, oar_discovery::DEFAULT_MAX_REQUEST_BYTES - 4096);
    let prefix = unique_prefix("value-limit");
    let lease = d.grant_lease(Duration::from_secs(60)).await.unwrap();
    let fence = d.lock(&format!("{prefix}lock"), b"me".to_vec(), lease, Duration::ZERO).await.unwrap();
    let key = format!("{prefix}a-state-key-of-a-usual-length/master/state");
    d.put_fenced(&fence, &key, vec![7u8; max]).await.unwrap();
    assert_eq!(d.get(&key).await.unwrap().unwrap().value.len(), max);
    let over = d.put_fenced(&fence, &key, vec![7u8; oar_discovery::DEFAULT_MAX_REQUEST_BYTES + 1]).await;
    assert!(over.is_err(), "etcd took a value past its request limit");
    d.revoke_lease(lease).await.unwrap();
}
