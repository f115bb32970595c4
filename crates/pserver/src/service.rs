//! The pserver shell: claims a shard index in discovery, serves its blocks
//! of the parameter store over a [`Transport`], follows the trainers'
//! registrations for the sync barrier, checkpoints its shard, and stops
//! serving when its lease is lost.
//!
//! **The store's lock** (a plain `Mutex`) is held only for short
//! operations: applying one push part, copying one pull part out, and
//! taking a checkpoint's [`StoreSnapshot`](crate::StoreSnapshot), which
//! shares the blocks copy-on-write instead of copying them. The checkpoint
//! is written from the snapshot with no lock held, so pushes and pulls go on
//! meanwhile (BENCHMARKS.md, "Pushes during a checkpoint").
//!
//! **A panic while updating the store stops the pserver.** An update
//! applies block by block, so a panic midway (in a user's
//! [`Optimizer`](crate::Optimizer), say) leaves some blocks updated and
//! others not, and the state is neither before nor after the push. Such a
//! pserver stops serving for good, before the store's lock is released:
//! every request after it is refused as unavailable with a reason naming
//! the panic ([`Pserver::stopped`] says it too), no checkpoint of the
//! half-updated state is written, and the lease is revoked so a replacement
//! claims the index at once and loads the last checkpoint (a trainer retries
//! its push there). A store whose lock is poisoned (a thread panicked
//! holding it) is treated the same way. Making updates atomic instead would
//! cost a copy of every block an update touches.

use crate::{
    checkpoint::{CheckpointDir, CheckpointInfo},
    error::{ServiceError, ServiceResult},
    protocol::{BlockSpan, PsReply, PsRequest, PSERVER_METHOD},
    Error, Grad, Mode, OptimizerConfig, ParamSpec, ParamStore, Placement, Push,
};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use oar_discovery::{Departures, Discovery, LeaseGuard, LeaseId, Session};
use oar_transport::{Frame, Handler, Listener, RemoteError, Transport};
use std::{
    panic::AssertUnwindSafe,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard, OnceLock, PoisonError,
    },
    time::Duration,
};
use tokio::sync::{watch, Notify};

/// The pserver's metrics, registered on first use (summed over the
/// pservers of a process).
struct Metrics {
    pushes: oar_metrics::Counter,
    push_bytes: oar_metrics::Counter,
    pulls: oar_metrics::Counter,
    pull_bytes: oar_metrics::Counter,
    /// Sync: how long pulls waited for the step their push belongs to.
    barrier_wait: oar_metrics::Histogram,
    /// Taking a push that applied an update (the optimizer's apply included).
    apply: oar_metrics::Histogram,
    checkpoint: oar_metrics::Histogram,
    checkpoint_time: oar_metrics::Gauge<f64, std::sync::atomic::AtomicU64>,
    step: oar_metrics::Gauge,
}

fn metrics() -> &'static Metrics {
    static METRICS: std::sync::LazyLock<Metrics> = std::sync::LazyLock::new(|| {
        let m = Metrics {
            pushes: Default::default(),
            push_bytes: Default::default(),
            pulls: Default::default(),
            pull_bytes: Default::default(),
            barrier_wait: oar_metrics::seconds_histogram(),
            apply: oar_metrics::seconds_histogram(),
            checkpoint: oar_metrics::seconds_histogram(),
            checkpoint_time: Default::default(),
            step: Default::default(),
        };
        use oar_metrics::register as r;
        r("oar_ps_pushes", "Gradient pushes taken.", m.pushes.clone());
        r("oar_ps_push_bytes", "Gradient bytes taken.", m.push_bytes.clone());
        r("oar_ps_pulls", "Parameter pulls answered with parameters.", m.pulls.clone());
        r("oar_ps_pull_bytes", "Parameter bytes sent.", m.pull_bytes.clone());
        r("oar_ps_barrier_wait_seconds", "Sync: time a pull waited for its step.", m.barrier_wait.clone());
        r("oar_ps_apply_seconds", "Time to take a push that applied an update.", m.apply.clone());
        r("oar_ps_checkpoint_seconds", "Time to write a checkpoint.", m.checkpoint.clone());
        r(
            "oar_ps_last_checkpoint_timestamp_seconds",
            "Unix time of the last checkpoint (its age: time() minus this).",
            m.checkpoint_time.clone(),
        );
        r("oar_ps_step", "Updates applied to the shard.", m.step.clone());
        m
    });
    &METRICS
}

/// Builds a user-defined [`Optimizer`](crate::Optimizer) on a pserver: the
/// seam through which a user's update rule runs on the pservers without any
/// change to oar (see `examples/custom_optimizer.rs`).
#[derive(Clone)]
pub struct OptimizerFactory(Arc<dyn Fn() -> Box<dyn crate::Optimizer> + Send + Sync>);

impl OptimizerFactory {
    /// A factory calling `build` once per pserver.
    pub fn new(build: impl Fn() -> Box<dyn crate::Optimizer> + Send + Sync + 'static) -> Self {
        OptimizerFactory(Arc::new(build))
    }

    /// A new optimizer.
    pub fn build(&self) -> Box<dyn crate::Optimizer> {
        (self.0)()
    }
}

impl std::fmt::Debug for OptimizerFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OptimizerFactory").field(&self.build().name()).finish()
    }
}

/// The discovery keys a pserver uses. The caller lays them out (`oar-job`
/// puts them under `/oar/<job>/`); a client needs only
/// [`claims`](Self::claims).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PserverKeys {
    /// Prefix of the shard claims: shard `i` is claimed by creating
    /// `<claims><i>` (value: the pserver's address) under its lease, and its
    /// latest checkpoint is recorded at `<claims><i>/checkpoint`.
    pub claims: String,
    /// The number of pservers the job wants; a pserver configured for
    /// another number refuses to start.
    pub desired: String,
    /// Prefix under which trainers register (`<members><id>`, under their
    /// leases): a trainer whose key goes leaves the sync barrier.
    pub members: String,
}

impl PserverKeys {
    /// Shard `index`'s claim.
    pub fn claim(&self, index: u32) -> String {
        claim_key(&self.claims, index)
    }

    /// Where shard `index`'s latest checkpoint is recorded.
    pub fn checkpoint(&self, index: u32) -> String {
        format!("{}{index}/checkpoint", self.claims)
    }
}

/// Shard `index`'s claim under the claims prefix `claims`.
pub(crate) fn claim_key(claims: &str, index: u32) -> String {
    format!("{claims}{index}")
}

/// How a pserver runs. Every pserver and trainer of a job must agree on
/// `specs`, `servers` and `block_size` (the placement's fingerprint checks
/// it). `keys` and `specs` have no useful default: set them.
#[derive(Clone, Debug)]
pub struct PserverOptions {
    /// Where its claim, checkpoint records and the trainers' registrations live.
    pub keys: PserverKeys,
    /// The model's parameters.
    pub specs: Vec<ParamSpec>,
    /// Number of pservers (shards) of the job.
    pub servers: u32,
    /// Largest block, in elements.
    pub block_size: usize,
    /// Seed of the parameters' initial values.
    pub seed: u64,
    /// Sync barrier or apply on arrival.
    pub mode: Mode,
    /// The update rule.
    pub optimizer: OptimizerConfig,
    /// A user-defined update rule that replaces `optimizer` (which then only
    /// names the job's choice in its options). Called once, at start.
    pub custom_optimizer: Option<OptimizerFactory>,
    /// The pserver's lease: when it expires the pserver stops serving and
    /// its index is free for a replacement.
    pub lease_ttl: Duration,
    /// How long to wait for a free index (a replacement waits for the dead
    /// pserver's lease to expire).
    pub claim_timeout: Duration,
    /// Where checkpoints go (`<dir>/ps-<index>/`); none: no checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// How often a checkpoint is written (when something changed). A
    /// crash loses at most the updates of one interval.
    pub checkpoint_interval: Duration,
    /// Checkpoints kept per pserver (at least 2, so a corrupt newest one
    /// has a fallback).
    pub checkpoint_keep: usize,
    /// Claim exactly this index (waiting for it to be free) instead of the
    /// lowest free one: for pservers whose checkpoints live on a volume of
    /// their own (a Kubernetes StatefulSet pod), so a restarted pod serves
    /// the shard its volume holds.
    pub index: Option<u32>,
}

impl Default for PserverOptions {
    /// One async SGD shard (lr 0.1) of blocks of 64 Ki floats, seed 1, a 5 s
    /// lease, a minute to claim an index, no checkpoints (every 60 s, 3
    /// kept, once a directory is given).
    fn default() -> Self {
        Self {
            keys: PserverKeys::default(),
            specs: Vec::new(),
            servers: 1,
            block_size: 1 << 16,
            seed: 1,
            mode: Mode::Async,
            optimizer: OptimizerConfig::Sgd { lr: 0.1 },
            custom_optimizer: None,
            lease_ttl: Duration::from_secs(5),
            claim_timeout: Duration::from_secs(60),
            checkpoint_dir: None,
            checkpoint_interval: Duration::from_secs(60),
            checkpoint_keep: 3,
            index: None,
        }
    }
}

/// A running pserver. Dropping it stops serving.
pub struct Pserver {
    shared: Arc<Shared>,
    discovery: Arc<dyn Discovery>,
    keys: PserverKeys,
    listener: Box<dyn Listener>,
    session: Option<Session>,
    background: Vec<tokio::task::JoinHandle<()>>,
    index: u32,
    checkpoints: Option<CheckpointDir>,
    keep: usize,
}

struct Shared {
    /// Set once the index is claimed and the store built.
    store: OnceLock<Mutex<ParamStore>>,
    placement: Arc<Placement>,
    /// Wakes pulls waiting for the next sync step.
    stepped: Notify,
    stopped: watch::Sender<Option<String>>,
    index: OnceLock<u32>,
    /// Checked before every request: a pserver whose lease may have expired
    /// (paused or cut off past its ttl) must not take updates a replacement
    /// would not have.
    lease: LeaseGuard,
    /// Set, under the store's lock, when a graceful shutdown begins: from
    /// then on requests are refused, so the last checkpoint holds every
    /// push this pserver acknowledged.
    draining: AtomicBool,
    /// Held while a checkpoint file is written: the periodic checkpointer
    /// and a last checkpoint at shutdown never write at once (they could
    /// share a step, and so a file name).
    saving: Mutex<()>,
    /// To release the index at once after a panic (see [`Shared::fail`]).
    discovery: Arc<dyn Discovery>,
    lease_id: LeaseId,
}

impl Shared {
    /// Stop serving for good (the first reason is kept and logged).
    fn stop(&self, why: String) {
        self.stopped.send_if_modified(|s| {
            if s.is_none() {
                tracing::error!(%why, "pserver stops serving");
                *s = Some(why);
                true
            } else {
                false
            }
        });
    }

    /// Stop for a fault that may have left the store half-updated (see the
    /// module docs): stop serving, and revoke the lease so the index is free
    /// for a replacement at once (if the revoke fails, the lease expires).
    fn fail(&self, why: String) {
        self.stop(why);
        let (discovery, lease) = (self.discovery.clone(), self.lease_id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                match discovery.revoke_lease(lease).await {
                    Ok(()) => tracing::info!(lease, "lease revoked; a replacement can claim the index"),
                    Err(e) => tracing::warn!(error = %e, lease, "could not revoke the lease; it will expire"),
                }
            });
        }
    }

    /// Why the pserver stopped serving, as a refusal.
    fn refusal(why: &str) -> RemoteError {
        RemoteError::unavailable(format!("pserver stopped serving: {why}"))
    }

    /// The store, locked, for a request: refused once the pserver stopped
    /// (looked at again after the lock is taken: a panic stops the pserver
    /// while it holds the lock) or began draining.
    fn store(&self) -> std::result::Result<MutexGuard<'_, ParamStore>, RemoteError> {
        // Shutting down releases the lease on purpose: not a reason to stop.
        if self.draining.load(Ordering::SeqCst) {
            return Err(RemoteError::unavailable("pserver is shutting down"));
        }
        if !self.lease.is_valid() {
            self.stop("the pserver's lease may have expired (no refresh within its ttl)".into());
        }
        let store = self.lock()?;
        if let Some(why) = self.stopped.borrow().as_ref() {
            return Err(Self::refusal(why));
        }
        if self.draining.load(Ordering::SeqCst) {
            return Err(RemoteError::unavailable("pserver is shutting down"));
        }
        Ok(store)
    }

    /// The store's lock. Held only briefly (see the module docs), so a task
    /// on the runtime may wait for it. A poisoned lock is fatal: the thread
    /// that panicked holding it may have left an update half-done.
    fn lock(&self) -> std::result::Result<MutexGuard<'_, ParamStore>, RemoteError> {
        let store = self.store.get().ok_or_else(|| RemoteError::unavailable("pserver is starting"))?;
        store.lock().map_err(|_| {
            let why = "the store's lock is poisoned: a thread panicked while holding it, \
                       perhaps midway through an update";
            self.fail(why.into());
            Self::refusal(why)
        })
    }

    /// Run `update` on the locked `store`, catching a panic. A panic is
    /// fatal (the store may be half-updated): the pserver stops before the
    /// caller releases the lock, so no request or checkpoint reads that state.
    fn update<T>(
        &self,
        store: &mut ParamStore,
        update: impl FnOnce(&mut ParamStore) -> T,
    ) -> std::result::Result<T, RemoteError> {
        std::panic::catch_unwind(AssertUnwindSafe(|| update(store))).map_err(|panic| {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            let why = format!("a panic while updating the store, which may be half-updated: {message}");
            self.fail(why.clone());
            Self::refusal(&why)
        })
    }
}

impl Pserver {
    /// Serve at `listen_addr`, claim the lowest free `ps/<index>` below
    /// `servers` (waiting up to `claim_timeout`), build and initialise the
    /// blocks of that shard, and follow `trainer/` for the sync barrier.
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        listen_addr: &str,
        options: PserverOptions,
    ) -> ServiceResult<Pserver> {
        let keys = options.keys.clone();
        if keys.claims.is_empty() || keys.members.is_empty() {
            return Err(ServiceError::Config(format!(
                "pserver keys must name the claims and members: {keys:?}"
            )));
        }
        metrics(); // Registered from the start, at zero.
        let optimizer = match &options.custom_optimizer {
            Some(factory) => factory.build(),
            None => options.optimizer.build()?,
        };
        let placement = Arc::new(Placement::new(&options.specs, options.servers, options.block_size)?);
        if let Some(kv) = discovery.get(&keys.desired).await? {
            let desired = std::str::from_utf8(&kv.value).ok().and_then(|s| s.trim().parse::<u32>().ok());
            if desired != Some(options.servers) {
                return Err(ServiceError::Config(format!(
                    "{} says {:?} pservers but this pserver was configured for {}",
                    keys.desired,
                    String::from_utf8_lossy(&kv.value),
                    options.servers
                )));
            }
        }
        let session = Session::start(discovery.clone(), options.lease_ttl).await?;
        let shared = Arc::new(Shared {
            store: OnceLock::new(),
            placement: placement.clone(),
            stepped: Notify::new(),
            stopped: watch::channel(None).0,
            index: OnceLock::new(),
            lease: session.guard(),
            draining: AtomicBool::new(false),
            saving: Mutex::new(()),
            discovery: discovery.clone(),
            lease_id: session.lease(),
        });
        let listener = transport.listen(listen_addr, Arc::new(PsHandler { shared: shared.clone() })).await?;

        let index = claim_index(&*discovery, &keys, &options, listener.local_addr(), session.lease()).await?;
        let mut store = ParamStore::new(&placement, index, options.seed, optimizer, options.mode)?;
        let checkpoints = options.checkpoint_dir.as_ref().map(|root| CheckpointDir::new(root, index));
        if let Some(dir) = &checkpoints {
            // The newest verified checkpoint wins; with every one corrupt the pserver refuses to start.
            match dir.load_latest(&mut store)? {
                Some(loaded) => {
                    for (path, why) in &loaded.skipped {
                        tracing::warn!(path = %path.display(), %why, "skipped a checkpoint");
                    }
                    tracing::info!(
                        index,
                        step = loaded.info.step,
                        path = loaded.info.path,
                        "restored checkpoint"
                    );
                }
                None => tracing::info!(index, dir = %dir.path().display(), "no checkpoint; starting fresh"),
            }
        }
        let _ = shared.index.set(index);
        let _ = shared.store.set(Mutex::new(store));

        let departures = Departures::watch(&*discovery, &keys.members).await?;
        let lease_lost = session.lost_signal();
        let guard = shared.clone();
        let mut background = vec![
            tokio::spawn(trainer_watcher(departures, shared.clone())),
            tokio::spawn(async move {
                lease_lost.await;
                tracing::error!("pserver lease lost; it stops serving");
                guard.stop("the pserver's lease is lost".into());
                guard.stepped.notify_waiters();
            }),
        ];
        if let Some(dir) = checkpoints.clone() {
            background.push(tokio::spawn(checkpointer(
                discovery.clone(),
                keys.checkpoint(index),
                dir,
                options.checkpoint_keep,
                options.checkpoint_interval,
                shared.clone(),
            )));
        }
        // Logged once everything is up, the departures watch included.
        tracing::info!(index, addr = listener.local_addr(), mode = ?options.mode, "pserver serving");
        Ok(Pserver {
            shared,
            discovery,
            keys,
            listener,
            session: Some(session),
            background,
            index,
            checkpoints,
            keep: options.checkpoint_keep,
        })
    }

    /// The shard index this pserver claimed.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The address trainers call.
    pub fn addr(&self) -> &str {
        self.listener.local_addr()
    }

    /// Updates applied so far (read even from a store that a panic stopped).
    pub fn step(&self) -> u64 {
        self.shared.store.get().map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).step()).unwrap_or(0)
    }

    /// Why the pserver stopped serving, if it did: its lease was lost, or a
    /// panic while updating the store (see the module docs).
    pub fn stopped(&self) -> Option<String> {
        self.shared.stopped.borrow().clone()
    }

    /// Write a checkpoint now and record it in `ps/<index>/checkpoint` (if
    /// checkpoints are configured). Pushes and pulls go on while it is
    /// written. An error once the pserver stopped serving.
    pub async fn checkpoint(&self) -> ServiceResult<Option<CheckpointInfo>> {
        let Some(dir) = self.checkpoints.clone() else { return Ok(None) };
        let key = self.keys.checkpoint(self.index);
        save_and_record(&*self.discovery, &key, dir, self.keep, self.shared.clone()).await.map(Some)
    }

    /// Stop serving gracefully: refuse every request from now on (a push
    /// applied before is acknowledged; one that comes after is refused as
    /// unavailable, and its trainer retries it on a replacement), write a
    /// last checkpoint of everything applied, and release the index (revoke
    /// the lease), so a replacement claims it at once and loads that
    /// checkpoint. Returns the updates applied to the shard.
    ///
    /// Requests are refused from a moment when no sync step is underway and
    /// no push in parts is half taken, waited for up to [`DRAIN_WAIT`]
    /// (serving meanwhile), so that the last checkpoint holds whole steps
    /// and whole pushes. Past that wait (a trainer that died mid-push) the
    /// checkpoint may fail or hold half a push; the index is released
    /// either way, and the error returned.
    pub async fn shutdown(mut self) -> ServiceResult<u64> {
        let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
        let step = loop {
            match self.shared.lock() {
                Ok(store) => {
                    let whole = !store.step_underway() && !store.push_in_parts_underway();
                    if whole || tokio::time::Instant::now() >= deadline {
                        self.shared.draining.store(true, Ordering::SeqCst);
                        break store.step();
                    }
                }
                // Not started, or stopped by a panic: no last checkpoint below.
                Err(_) => break self.step(),
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        self.shared.stepped.notify_waiters();
        self.listener.close();
        self.background.iter().for_each(|t| t.abort());
        let serving = self.shared.stopped.borrow().is_none();
        let saved = match serving {
            true => self.checkpoint().await.map(drop),
            false => Ok(()),
        };
        if let Some(session) = self.session.take() {
            session.close().await?;
        }
        saved.map(|()| step)
    }
}

impl Drop for Pserver {
    fn drop(&mut self) {
        self.listener.close();
        self.background.iter().for_each(|t| t.abort());
    }
}

/// How long a graceful stop keeps serving for a sync step that is underway,
/// or a push in parts, to complete.
pub const DRAIN_WAIT: Duration = Duration::from_secs(5);

/// How long a checkpoint waits for a sync step that is underway to complete.
const CHECKPOINT_STEP_WAIT: Duration = Duration::from_secs(30);

/// Take a snapshot of the store under its lock and write it with no lock
/// held, off the async threads: the checkpoint is exactly one step's state,
/// and pushes go on while it is written. A sync step that is underway (a
/// push in parts being applied part by part) is waited for, up to
/// [`CHECKPOINT_STEP_WAIT`]. Refused once the pserver stopped serving: a
/// panic may have left the store half-updated, or a replacement may own the
/// index.
async fn save_checkpoint(
    dir: CheckpointDir,
    keep: usize,
    shared: Arc<Shared>,
) -> ServiceResult<CheckpointInfo> {
    let started = std::time::Instant::now();
    let snapshot = loop {
        let taken = {
            let store = shared.lock().map_err(|e| ServiceError::Stopped(e.message))?;
            if let Some(why) = shared.stopped.borrow().as_ref() {
                return Err(ServiceError::Stopped(why.clone()));
            }
            store.snapshot()
        };
        match taken {
            Err(Error::CheckpointStepUnderway { .. }) if started.elapsed() < CHECKPOINT_STEP_WAIT => {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            taken => break taken?,
        }
    };
    let saver = shared.clone();
    let info = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = saver.saving.lock().unwrap_or_else(PoisonError::into_inner);
        dir.save(&snapshot, keep)
    })
    .await
    .map_err(|e| ServiceError::Protocol(format!("checkpoint task failed: {e}")))??;
    metrics().checkpoint.observe(started.elapsed().as_secs_f64());
    metrics().checkpoint_time.set(info.unix_time_ms as f64 / 1000.0);
    Ok(info)
}

/// Write a checkpoint every `every` when the step moved, and record the
/// latest one under `ps/<index>/checkpoint`.
async fn checkpointer(
    discovery: Arc<dyn Discovery>,
    key: String,
    dir: CheckpointDir,
    keep: usize,
    every: Duration,
    shared: Arc<Shared>,
) {
    let mut interval = tokio::time::interval(every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    let mut saved_step = None;
    loop {
        interval.tick().await;
        if !shared.lease.is_valid() {
            shared.stop("the pserver's lease may have expired (no refresh within its ttl)".into());
        }
        if shared.stopped.borrow().is_some() {
            // A replacement may own the index now: its checkpoints are not ours to write.
            return;
        }
        let Ok(step) = shared.lock().map(|s| s.step()) else { return };
        if Some(step) == saved_step {
            continue;
        }
        match save_and_record(&*discovery, &key, dir.clone(), keep, shared.clone()).await {
            Ok(info) => saved_step = Some(info.step),
            Err(e) => tracing::error!(error = %e, "checkpoint failed; will retry"),
        }
    }
}

/// Save a checkpoint and record it under `key` (`ps/<index>/checkpoint`).
/// A record that cannot be written is logged: the file is what counts.
async fn save_and_record(
    discovery: &dyn Discovery,
    key: &str,
    dir: CheckpointDir,
    keep: usize,
    shared: Arc<Shared>,
) -> ServiceResult<CheckpointInfo> {
    let info = save_checkpoint(dir, keep, shared).await?;
    tracing::debug!(step = info.step, path = info.path, "checkpoint written");
    match info.encode() {
        Ok(record) => {
            if let Err(e) = discovery.put(key, record, None).await {
                tracing::warn!(error = %e, key, "could not record the checkpoint");
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not encode the checkpoint record"),
    }
    Ok(info)
}

async fn claim_index(
    discovery: &dyn Discovery,
    keys: &PserverKeys,
    options: &PserverOptions,
    addr: &str,
    lease: oar_discovery::LeaseId,
) -> ServiceResult<u32> {
    if let Some(index) = options.index {
        if index >= options.servers {
            return Err(ServiceError::Config(format!(
                "index {index} is out of range: the job has {} pservers (indexes 0 to {})",
                options.servers,
                options.servers.saturating_sub(1)
            )));
        }
    }
    let wanted = match options.index {
        Some(index) => index..index + 1,
        None => 0..options.servers,
    };
    let deadline = tokio::time::Instant::now() + options.claim_timeout;
    loop {
        for index in wanted.clone() {
            if discovery
                .create_if_absent(&keys.claim(index), addr.as_bytes().to_vec(), Some(lease))
                .await?
                .is_some()
            {
                return Ok(index);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ServiceError::NoFreeIndex {
                servers: options.servers,
                waited: options.claim_timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A trainer whose registration vanished leaves the sync barrier, so the
/// surviving trainers' step completes instead of hanging.
async fn trainer_watcher(mut departures: Departures, shared: Arc<Shared>) {
    while let Some(departure) = departures.next().await {
        match departure {
            Ok(trainer) => {
                // Stopped (or shutting down): the store is no longer ours to change.
                let Ok(mut store) = shared.store() else { return };
                let Ok(stepped) = shared.update(&mut store, |s| s.leave(&trainer)) else { return };
                drop(store);
                tracing::info!(trainer, ?stepped, "trainer gone; it leaves the barrier");
                shared.stepped.notify_waiters();
            }
            Err(e) => {
                tracing::warn!(error = %e, "trainer watch failed; dead trainers leave only by Leave calls");
                return;
            }
        }
    }
}

struct PsHandler {
    shared: Arc<Shared>,
}

impl PsHandler {
    fn check_fingerprint(&self, fingerprint: u64) -> std::result::Result<(), RemoteError> {
        let ours = self.shared.placement.fingerprint();
        if fingerprint != ours {
            return Err(RemoteError::bad_request(format!(
                "placement fingerprint {fingerprint:#x} does not match this pserver's {ours:#x}: \
                 client and server disagree on the model's parameters, pserver count or block size"
            )));
        }
        Ok(())
    }

    /// The blocks of `span` among this server's blocks, or an error naming
    /// the span and how many blocks the server holds.
    fn span(&self, server: u32, span: BlockSpan) -> std::result::Result<Vec<&crate::BlockInfo>, RemoteError> {
        let held: Vec<&crate::BlockInfo> = self.shared.placement.blocks_on(server).collect();
        if span.start >= span.end || span.end as usize > held.len() {
            return Err(RemoteError::bad_request(format!(
                "block span {}..{} is empty or out of range: server {server} holds {} blocks",
                span.start,
                span.end,
                held.len()
            )));
        }
        Ok(held[span.range()].to_vec())
    }

    /// Apply a push (or a part of one). Its gradients are views into the
    /// received `payload`, not copies: a push costs its message, not its
    /// message twice.
    fn push(&self, request: PsRequest, payload: &Bytes) -> std::result::Result<PsReply, RemoteError> {
        let PsRequest::Push { fingerprint, blocks, trainer, seq, step, weight } = request else {
            return Err(RemoteError::internal("not a push"));
        };
        self.check_fingerprint(fingerprint)?;
        let mut store = self.shared.store()?;
        let span = self.span(store.server(), blocks)?;
        let expected: usize = span.iter().map(|b| b.len).sum();
        if payload.len() != expected * 4 {
            return Err(RemoteError::bad_request(format!(
                "push from {trainer}: payload has {} bytes, blocks {}..{} need {} ({} floats)",
                payload.len(),
                blocks.start,
                blocks.end,
                expected * 4,
                expected
            )));
        }
        let mut grads = Vec::with_capacity(span.len());
        let mut at = 0;
        for block in span {
            grads.push((block.id, Grad::Wire(payload.slice(at..at + block.len * 4))));
            at += block.len * 4;
        }
        let push = Push { trainer, seq, step, weight, grads };
        let started = std::time::Instant::now();
        let taken = self.shared.update(&mut store, |s| s.push(push))?;
        let m = metrics();
        m.pushes.inc();
        m.push_bytes.inc_by(payload.len() as u64);
        if let Ok(crate::PushOutcome::Applied { step }) = &taken {
            m.apply.observe(started.elapsed().as_secs_f64());
            m.step.set(*step as i64);
        }
        match taken {
            Ok(outcome) => {
                drop(store);
                self.shared.stepped.notify_waiters();
                Ok(PsReply::Pushed(outcome))
            }
            // A step this shard left, or one it never reached because it
            // restarted from a checkpoint, or one underway without this
            // trainer: either way, join, pull and compute again.
            Err(Error::StaleStep { current, .. } | Error::FutureStep { current, .. }) => {
                Ok(PsReply::Stale { current })
            }
            Err(Error::StepUnderway { step, .. }) => Ok(PsReply::Stale { current: step }),
            Err(e) => Err(RemoteError::bad_request(e)),
        }
    }

    /// The parameters of `span`'s blocks, concatenated, as a pull sends them.
    fn params(&self, store: &ParamStore, span: BlockSpan) -> std::result::Result<Bytes, RemoteError> {
        let blocks = self.span(store.server(), span)?;
        let total: usize = blocks.iter().map(|b| b.len).sum();
        let mut payload = BytesMut::with_capacity(total * 4);
        for block in blocks {
            let values = store.block(block.id).map_err(RemoteError::internal)?;
            oar_transport::put_f32s(&mut payload, values);
        }
        let m = metrics();
        m.pulls.inc();
        m.pull_bytes.inc_by(payload.len() as u64);
        Ok(payload.freeze())
    }

    /// Async mode: apply a push and answer with the parameters after it.
    fn push_pull(&self, request: PsRequest, payload: &Bytes) -> std::result::Result<Frame, RemoteError> {
        let PsRequest::PushPull { fingerprint, blocks, trainer, seq, weight } = request else {
            return Err(RemoteError::internal("not a push-pull"));
        };
        if self.shared.store()?.mode() != Mode::Async {
            return Err(RemoteError::bad_request(format!(
                "push-pull from {trainer}: only async pservers take it (a sync push waits for its step)"
            )));
        }
        let outcome = match self
            .push(PsRequest::Push { fingerprint, blocks, trainer, seq, step: 0, weight }, payload)?
        {
            PsReply::Pushed(outcome) => outcome,
            other => return Err(RemoteError::internal(format!("an async push answered {other:?}"))),
        };
        let store = self.shared.store()?;
        let params = self.params(&store, blocks)?;
        let reply = PsReply::PushedPulled { outcome, step: store.step() };
        Frame::new(PSERVER_METHOD, &reply, params).map_err(RemoteError::internal)
    }

    async fn pull(
        &self,
        fingerprint: u64,
        blocks: BlockSpan,
        min_step: Option<u64>,
        max_wait: Duration,
    ) -> std::result::Result<Frame, RemoteError> {
        self.check_fingerprint(fingerprint)?;
        self.span(self.shared.store()?.server(), blocks)?;
        let started = tokio::time::Instant::now();
        let deadline = started + max_wait;
        loop {
            // Register for the wake-up before looking, so a step in between is not missed.
            let stepped = self.shared.stepped.notified();
            {
                let store = self.shared.store()?;
                if min_step.is_none_or(|m| store.step() >= m) {
                    let payload = self.params(&store, blocks)?;
                    let reply = PsReply::Pulled { step: store.step(), ready: true };
                    if min_step.is_some() {
                        metrics().barrier_wait.observe(started.elapsed().as_secs_f64());
                    }
                    return Frame::new(PSERVER_METHOD, &reply, payload).map_err(RemoteError::internal);
                }
                if tokio::time::Instant::now() >= deadline {
                    let reply = PsReply::Pulled { step: store.step(), ready: false };
                    return Frame::new(PSERVER_METHOD, &reply, Bytes::new()).map_err(RemoteError::internal);
                }
            }
            let _ = tokio::time::timeout_at(deadline, stepped).await;
        }
    }
}

/// The longest a pull may wait on the server for the next sync step.
const MAX_PULL_WAIT: Duration = Duration::from_secs(5);

#[async_trait]
impl Handler for PsHandler {
    async fn handle(&self, request: Frame) -> std::result::Result<Frame, RemoteError> {
        if request.method != PSERVER_METHOD {
            return Err(RemoteError::bad_request(format!("unknown pserver method {:#x}", request.method)));
        }
        let reply = match request.meta::<PsRequest>()? {
            PsRequest::Info => {
                let store = self.shared.store()?;
                PsReply::Info {
                    index: store.server(),
                    fingerprint: self.shared.placement.fingerprint(),
                    step: store.step(),
                    mode: store.mode(),
                }
            }
            PsRequest::Join { trainer } => PsReply::Joined { step: self.shared.store()?.join(&trainer) },
            PsRequest::Leave { trainer } => {
                let mut store = self.shared.store()?;
                self.shared.update(&mut store, |s| s.leave(&trainer))?;
                drop(store);
                self.shared.stepped.notify_waiters();
                PsReply::Ok
            }
            push @ PsRequest::Push { .. } => self.push(push, &request.payload)?,
            push_pull @ PsRequest::PushPull { .. } => return self.push_pull(push_pull, &request.payload),
            PsRequest::Pull { fingerprint, blocks, min_step, max_wait_ms } => {
                let wait = Duration::from_millis(max_wait_ms).min(MAX_PULL_WAIT);
                return self.pull(fingerprint, blocks, min_step, wait).await;
            }
        };
        Frame::new(PSERVER_METHOD, &reply, Bytes::new()).map_err(RemoteError::internal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{optimizer::Sgd, Init};
    use oar_discovery::MemDiscovery;

    /// A store whose lock a thread panicked holding is never served again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_poisoned_store_stops_the_pserver_and_releases_its_lease() {
        let specs = vec![ParamSpec::new("w", vec![4], Init::Constant(0.0))];
        let placement = Arc::new(Placement::new(&specs, 1, 4).unwrap());
        let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
        let session = Session::start(discovery.clone(), Duration::from_secs(30)).await.unwrap();
        discovery.put("claim", b"x".to_vec(), Some(session.lease())).await.unwrap();
        let store = ParamStore::new(&placement, 0, 1, Box::new(Sgd { lr: 0.1 }), Mode::Async).unwrap();
        let shared = Arc::new(Shared {
            store: OnceLock::from(Mutex::new(store)),
            placement,
            stepped: Notify::new(),
            stopped: watch::channel(None).0,
            index: OnceLock::from(0),
            lease: session.guard(),
            draining: AtomicBool::new(false),
            saving: Mutex::new(()),
            discovery: discovery.clone(),
            lease_id: session.lease(),
        });
        assert!(shared.store().is_ok());
        let poisoner = shared.clone();
        let panicked = std::thread::spawn(move || {
            let _held = poisoner.store.get().map(|s| s.lock());
            panic!("midway through an update");
        })
        .join();
        assert!(panicked.is_err());

        let refused = shared.store().expect_err("a poisoned store is refused");
        assert_eq!(refused.kind, oar_transport::RemoteErrorKind::Unavailable);
        assert!(refused.message.contains("poisoned"), "{refused:?}");
        let why = shared.stopped.borrow().clone().expect("stopped");
        assert!(why.contains("poisoned"), "{why}");
        // The lease is revoked, so its keys go and a replacement can claim the index.
        tokio::time::timeout(Duration::from_secs(10), async {
            while discovery.get("claim").await.unwrap().is_some() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the lease is revoked");
    }
}
