//! What the pserver's service tests share: the keys, and a coordinator
//! with a way to wait until the pservers serve what it mapped.

#![allow(dead_code)]

use async_trait::async_trait;
use oar_discovery::Discovery;
use oar_pserver::{
    protocol::{BlockSpan, PsRequest, ReplicaRole},
    Coordinator, CoordinatorOptions, Pserver, PserverKeys, ShardMap,
};
use oar_transport::{Connection, Frame, FrameParts, Handler, Listener, RemoteError, Transport};
use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

/// The pservers' keys, under `/ps-test/`.
pub fn keys() -> PserverKeys {
    PserverKeys {
        pservers: "/ps-test/ps/".into(),
        shard_map: "/ps-test/shard_map".into(),
        replicas: "/ps-test/pshards/".into(),
        checkpoints: "/ps-test/shard_checkpoint/".into(),
        cluster_status: "/ps-test/pserver_cluster_status".into(),
        members: "/ps-test/trainer/".into(),
        desired: "/ps-test/ps_desired".into(),
    }
}

/// A raw push of `trainer`'s `seq` to `blocks` of shard `shard`: step 0,
/// weight 1, no rows, no origin, epoch 0 (what a fresh trainer sends).
pub fn push_request(shard: u32, fingerprint: u64, blocks: BlockSpan, trainer: &str, seq: u64) -> PsRequest {
    PsRequest::Push {
        shard,
        fingerprint,
        blocks,
        trainer: trainer.into(),
        seq,
        step: 0,
        weight: 1.0,
        rows: Vec::new(),
        origin: None,
        epoch: 0,
    }
}

/// A coordinator of `shards` shards with `replicas` replicas each, whose
/// first map waits for `pservers` pservers; it holds its own lock.
pub struct Cluster {
    pub discovery: Arc<dyn Discovery>,
    pub coordinator: Coordinator,
}

impl Cluster {
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        shards: u32,
        replicas: u32,
        pservers: u32,
    ) -> Cluster {
        let options = CoordinatorOptions { keys: keys(), shards, replicas, pservers, ..Default::default() };
        Self::start_with(discovery, transport, options).await
    }

    /// A coordinator with `options` (its keys are set to [`keys`]).
    pub async fn start_with(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        options: CoordinatorOptions,
    ) -> Cluster {
        let lease = discovery.grant_lease(Duration::from_secs(600)).await.unwrap();
        let fence = discovery
            .lock("/ps-test/coordinator", b"test".to_vec(), lease, Duration::from_secs(5))
            .await
            .unwrap();
        let options = CoordinatorOptions { keys: keys(), ..options };
        let coordinator = Coordinator::start(discovery.clone(), transport, fence, options).await.unwrap();
        Cluster { discovery, coordinator }
    }

    /// The shard map now.
    pub async fn map(&self) -> Option<ShardMap> {
        let kv = self.discovery.get(&keys().shard_map).await.unwrap()?;
        Some(ShardMap::decode(&kv.value).unwrap())
    }

    /// Wait (up to 20 s) until shard `shard`'s primary in the map is one
    /// of `pservers` other than `not`, serving it as primary under that
    /// map (its followers may still be catching up). The map then.
    pub async fn wait_primary(&self, pservers: &[&Pserver], shard: u32, not: &str) -> ShardMap {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(map) = self.map().await {
                let serving = map.primary(shard).filter(|p| *p != not).is_some_and(|p| {
                    pservers.iter().any(|ps| {
                        ps.name() == p
                            && ps.map_version() == map.version()
                            && ps
                                .replicas()
                                .iter()
                                .any(|r| r.shard == shard && r.role == ReplicaRole::Primary)
                    })
                });
                if serving {
                    return map;
                }
            }
            assert!(tokio::time::Instant::now() < deadline, "shard {shard} has no new primary in time");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Wait (up to 20 s) until there is a map, every replica it names is
    /// one of `pservers`, and each serves its role: primaries primary,
    /// followers caught up. The map then.
    pub async fn wait_serving(&self, pservers: &[&Pserver]) -> ShardMap {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(map) = self.map().await {
                let ready = (0..map.shard_count()).all(|s| {
                    let set = map.replica_set(s);
                    !set.is_empty()
                        && set.iter().enumerate().all(|(r, name)| {
                            let want = if r == 0 { ReplicaRole::Primary } else { ReplicaRole::Follower };
                            pservers.iter().any(|ps| {
                                ps.name() == name
                                    && ps.map_version() == map.version()
                                    && ps.replicas().iter().any(|st| st.shard == s && st.role == want)
                            })
                        })
                });
                if ready {
                    return map;
                }
                if tokio::time::Instant::now() >= deadline {
                    let states: Vec<_> =
                        pservers.iter().map(|p| (p.name().to_string(), p.replicas())).collect();
                    panic!("the pservers do not serve the map in time:\n{map}{states:#?}");
                }
            } else if tokio::time::Instant::now() >= deadline {
                panic!("no shard map in time");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A transport whose servers count the calls they answer (a batch is one).
pub struct Counting {
    inner: Arc<dyn Transport>,
    calls: Arc<AtomicU64>,
}

impl Counting {
    pub fn new(inner: Arc<dyn Transport>) -> Counting {
        Counting { inner, calls: Arc::new(AtomicU64::new(0)) }
    }

    /// Calls answered so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

struct CountingHandler {
    inner: Arc<dyn Handler>,
    calls: Arc<AtomicU64>,
}

#[async_trait]
impl Handler for CountingHandler {
    async fn handle(&self, request: Frame) -> Result<Frame, RemoteError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.handle(request).await
    }

    async fn handle_parts(&self, request: Frame) -> Result<FrameParts, RemoteError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.handle_parts(request).await
    }
}

#[async_trait]
impl Transport for Counting {
    async fn connect(&self, addr: &str) -> oar_transport::Result<Arc<dyn Connection>> {
        self.inner.connect(addr).await
    }
    async fn listen(
        &self,
        addr: &str,
        handler: Arc<dyn Handler>,
    ) -> oar_transport::Result<Box<dyn Listener>> {
        let handler = Arc::new(CountingHandler { inner: handler, calls: self.calls.clone() });
        self.inner.listen(addr, handler).await
    }
}

/// A transport whose calls refuse a request of more than `max` bytes
/// (metadata and payload) before sending it, as QUIC's do past their
/// message limit (1 GiB by default): the limit's effects at a test's scale.
pub struct Limited {
    inner: Arc<dyn Transport>,
    max: u64,
}

impl Limited {
    pub fn new(inner: Arc<dyn Transport>, max: u64) -> Limited {
        Limited { inner, max }
    }
}

struct LimitedConnection {
    inner: Arc<dyn Connection>,
    max: u64,
}

impl LimitedConnection {
    fn check(&self, meta: usize, payload: u64) -> oar_transport::Result<()> {
        let claimed = meta as u64 + payload;
        if claimed > self.max {
            return Err(oar_transport::Error::TooLarge {
                meta: meta as u64,
                payload,
                claimed,
                max: self.max,
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Connection for LimitedConnection {
    async fn call(&self, request: Frame, timeout: Duration) -> oar_transport::Result<Frame> {
        self.check(request.meta.len(), request.payload.len() as u64)?;
        self.inner.call(request, timeout).await
    }

    async fn call_parts(
        &self,
        method: u16,
        meta: bytes::Bytes,
        payload: &[&[u8]],
        sink: &mut dyn oar_transport::PayloadSink,
        timeout: Duration,
    ) -> oar_transport::Result<Frame> {
        self.check(meta.len(), payload.iter().map(|p| p.len() as u64).sum())?;
        self.inner.call_parts(method, meta, payload, sink, timeout).await
    }

    fn peer(&self) -> &str {
        self.inner.peer()
    }
}

#[async_trait]
impl Transport for Limited {
    async fn connect(&self, addr: &str) -> oar_transport::Result<Arc<dyn Connection>> {
        let inner = self.inner.connect(addr).await?;
        Ok(Arc::new(LimitedConnection { inner, max: self.max }))
    }
    async fn listen(
        &self,
        addr: &str,
        handler: Arc<dyn Handler>,
    ) -> oar_transport::Result<Box<dyn Listener>> {
        self.inner.listen(addr, handler).await
    }
}

/// A discovery whose listings of one prefix, once [`arm`](Self::arm)ed,
/// are read from the store at once but answered only at
/// [`release`](Self::release): a reader that sees the store as it was
/// some time ago (etcd slow to answer, a task scheduled late).
pub struct HeldListings {
    inner: Arc<dyn Discovery>,
    prefix: String,
    armed: std::sync::atomic::AtomicBool,
    skip: AtomicU64,
    released: tokio::sync::watch::Sender<bool>,
    held: AtomicU64,
    answered: AtomicU64,
}

impl HeldListings {
    pub fn new(inner: Arc<dyn Discovery>, prefix: &str) -> HeldListings {
        HeldListings {
            inner,
            prefix: prefix.to_string(),
            armed: false.into(),
            skip: AtomicU64::new(0),
            released: tokio::sync::watch::channel(false).0,
            held: AtomicU64::new(0),
            answered: AtomicU64::new(0),
        }
    }

    /// Hold the prefix's listings from now on, until [`release`](Self::release).
    pub fn arm(&self) {
        self.arm_after(0);
    }

    /// Answer the next `skip` listings of the prefix at once and hold
    /// those after them, until [`release`](Self::release).
    pub fn arm_after(&self, skip: u64) {
        self.skip.store(skip, Ordering::SeqCst);
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Answer every listing held, and hold no more.
    pub fn release(&self) {
        self.armed.store(false, Ordering::SeqCst);
        self.released.send_replace(true);
    }

    /// Listings held so far (answered or not).
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Held listings answered so far.
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::SeqCst)
    }

    /// Wait (5 s at most) until every listing held so far is answered.
    pub async fn wait_answered(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while self.answered() < self.held() {
            assert!(tokio::time::Instant::now() < deadline, "a held listing was never answered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[async_trait]
impl Discovery for HeldListings {
    async fn grant_lease(&self, ttl: Duration) -> oar_discovery::Result<oar_discovery::LeaseId> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: oar_discovery::LeaseId) -> oar_discovery::Result<()> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: oar_discovery::LeaseId) -> oar_discovery::Result<()> {
        self.inner.revoke_lease(lease).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<oar_discovery::LeaseId>,
    ) -> oar_discovery::Result<oar_discovery::Revision> {
        self.inner.put(key, value, lease).await
    }
    async fn get(&self, key: &str) -> oar_discovery::Result<Option<oar_discovery::KeyValue>> {
        self.inner.get(key).await
    }
    async fn get_prefix(&self, prefix: &str) -> oar_discovery::Result<oar_discovery::Listing> {
        let listing = self.inner.get_prefix(prefix).await;
        if prefix == self.prefix
            && self.armed.load(Ordering::SeqCst)
            && self.skip.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_err()
        {
            self.held.fetch_add(1, Ordering::SeqCst);
            let _ = self.released.subscribe().wait_for(|&released| released).await;
            self.answered.fetch_add(1, Ordering::SeqCst);
        }
        listing
    }
    async fn delete(&self, key: &str) -> oar_discovery::Result<bool> {
        self.inner.delete(key).await
    }
    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<oar_discovery::LeaseId>,
    ) -> oar_discovery::Result<Option<oar_discovery::Revision>> {
        self.inner.create_if_absent(key, value, lease).await
    }
    async fn watch_prefix(
        &self,
        prefix: &str,
        from_revision: oar_discovery::Revision,
    ) -> oar_discovery::Result<oar_discovery::WatchStream> {
        self.inner.watch_prefix(prefix, from_revision).await
    }
    async fn put_fenced(
        &self,
        fence: &oar_discovery::Fence,
        key: &str,
        value: Vec<u8>,
    ) -> oar_discovery::Result<oar_discovery::Revision> {
        self.inner.put_fenced(fence, key, value).await
    }
    async fn delete_fenced(&self, fence: &oar_discovery::Fence, key: &str) -> oar_discovery::Result<bool> {
        self.inner.delete_fenced(fence, key).await
    }
    async fn delete_range_fenced(
        &self,
        fence: &oar_discovery::Fence,
        start: &str,
        end: &str,
    ) -> oar_discovery::Result<()> {
        self.inner.delete_range_fenced(fence, start, end).await
    }
}
