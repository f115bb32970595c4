//! The pserver shell: registers under a name of its own, follows the job's
//! [`ShardMap`], and for each logical shard the map gives
//! it holds a replica: as **primary** it serves trainers, applies their
//! updates, forwards them to the followers and checkpoints the shard; as
//! **follower** it applies what its primary forwards; a replica that has
//! nothing yet **catches up** from a snapshot of the primary
//! ([`crate::replica`] is the I/O-free core of all of it). The map itself
//! is written by the [`Coordinator`](crate::Coordinator).
//!
//! **Strong replication.** A primary answers a client only once every
//! follower in the map holds everything the answer depends on: a push's
//! update (and every update before it), the parameters a pull returns. So
//! no acknowledged update is lost while one replica of the shard survives,
//! and no trainer reads a value a failover could take back. With one
//! replica per shard (the default) nothing is forwarded and nothing waits.
//! A follower that does not answer holds the answers back until it does or
//! the coordinator drops it from the map (its lease expired); a reply that
//! waited [`PserverOptions::replication_timeout`] is refused as unavailable
//! and the client retries it (a retried push is applied once).
//!
//! **Fencing.** Every request is refused once the pserver's lease may have
//! expired (checked again just before an answer leaves), and replication
//! calls are taken only under the same map version as the receiver's: a
//! deposed primary's forwards are refused by followers that saw the new
//! map, so it can acknowledge nothing the new primary lacks.
//!
//! **The store's lock** (one per shard, a plain `Mutex`) is held only for
//! short operations: applying one push part, copying one pull part out,
//! taking a [`StoreSnapshot`](crate::StoreSnapshot) (copy-on-write) for a
//! checkpoint or a catch-up. Checkpoints are written from the snapshot with
//! no lock held, so pushes and pulls go on meanwhile.
//!
//! **A panic while updating a store stops the pserver.** An update applies
//! block by block, so a panic midway (in a user's
//! [`Optimizer`](crate::Optimizer), say) leaves some blocks updated and
//! others not. Such a pserver stops serving for good before the lock is
//! released, writes no checkpoint of that state, and revokes its lease so
//! the coordinator replaces it at once (a follower takes over, or the
//! shard's last checkpoint is restored elsewhere).

mod handler;
mod replication;

use crate::{
    checkpoint::{CheckpointDir, CheckpointInfo},
    error::{ServiceError, ServiceResult},
    protocol::{ReplicaRole, ReplicaState},
    replica::{CatchUp, Follower, History, Links, Update},
    topology::TopologyWatch,
    Error, Mode, OptimizerConfig, ParamSpec, ParamStore, Placement, Role, ShardMap,
};
use oar_discovery::{DepartedMembers, Departures, Discovery, LeaseGuard, LeaseId, Session};
use oar_transport::{Connection, Listener, RemoteError, Transport};
use std::{
    collections::{BTreeMap, HashMap},
    panic::AssertUnwindSafe,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError, RwLock,
    },
    time::Duration,
};
use tokio::sync::{watch, Notify};
use tokio_util::task::AbortOnDropHandle;

/// The pserver's metrics, registered on first use (summed over the
/// pservers and shards of a process).
struct Metrics {
    pushes: oar_metrics::Counter,
    push_bytes: oar_metrics::Counter,
    pulls: oar_metrics::Counter,
    pull_bytes: oar_metrics::Counter,
    /// Sync: how long pulls waited for the step their push belongs to.
    barrier_wait: oar_metrics::Histogram,
    /// Taking a push that applied an update (the optimizer's apply included).
    apply: oar_metrics::Histogram,
    /// How long answers waited for the followers.
    replication_wait: oar_metrics::Histogram,
    /// Updates forwarded to followers.
    forwarded: oar_metrics::Counter,
    /// Pushes (and push-pulls) acknowledged to trainers.
    acknowledged: oar_metrics::Counter,
    /// Pushes (a push-pull's push too) received and not yet acknowledged
    /// or refused.
    pushes_in_flight: oar_metrics::Gauge,
    /// Each primary shard's step.
    step: oar_metrics::Family<Vec<(String, String)>, oar_metrics::Gauge>,
    checkpoint: oar_metrics::Histogram,
    checkpoint_time: oar_metrics::Gauge<f64, std::sync::atomic::AtomicU64>,
    catch_up_bytes: oar_metrics::Counter,
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
            replication_wait: oar_metrics::seconds_histogram(),
            forwarded: Default::default(),
            acknowledged: Default::default(),
            pushes_in_flight: Default::default(),
            step: Default::default(),
            checkpoint: oar_metrics::seconds_histogram(),
            checkpoint_time: Default::default(),
            catch_up_bytes: Default::default(),
        };
        use oar_metrics::register as r;
        r("oar_ps_pushes", "Gradient pushes taken.", m.pushes.clone());
        r("oar_ps_push_bytes", "Gradient bytes taken.", m.push_bytes.clone());
        r("oar_ps_pulls", "Parameter pulls answered with parameters.", m.pulls.clone());
        r("oar_ps_pull_bytes", "Parameter bytes sent.", m.pull_bytes.clone());
        r("oar_ps_barrier_wait_seconds", "Sync: time a pull waited for its step.", m.barrier_wait.clone());
        r("oar_ps_apply_seconds", "Time to take a push that applied an update.", m.apply.clone());
        r(
            "oar_ps_replication_wait_seconds",
            "Time an answer waited for the followers to hold what it depends on.",
            m.replication_wait.clone(),
        );
        r(
            "oar_ps_catch_up_bytes",
            "Bytes of shard snapshots received while catching up (what moving replicas here cost).",
            m.catch_up_bytes.clone(),
        );
        r("oar_ps_forwarded_updates", "Updates forwarded to followers.", m.forwarded.clone());
        r(
            "oar_ps_acknowledged_pushes",
            "Pushes acknowledged to trainers (after every follower held them).",
            m.acknowledged.clone(),
        );
        r(
            "oar_ps_pushes_in_flight",
            "Pushes (a push-pull's push too) received and not yet acknowledged or refused: waiting for a step, the followers or a checkpoint.",
            m.pushes_in_flight.clone(),
        );
        r("oar_ps_step", "Updates applied to each shard this pserver is primary of.", m.step.clone());
        r("oar_ps_checkpoint_seconds", "Time to write a checkpoint.", m.checkpoint.clone());
        r(
            "oar_ps_last_checkpoint_timestamp_seconds",
            "Unix time of the last checkpoint (its age: time() minus this).",
            m.checkpoint_time.clone(),
        );
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
    /// A factory calling `build` once per store (each shard a pserver holds).
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

/// The discovery keys of a job's pservers. The caller lays them out
/// (`oar-job` puts them under `/oar/<job>/`); a client needs `pservers` and
/// `shard_map`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PserverKeys {
    /// Prefix of the registrations: pserver `<name>` puts its address at
    /// `<pservers><name>` under its lease.
    pub pservers: String,
    /// The shard map, written by the coordinator through its fence.
    pub shard_map: String,
    /// Prefix of each replica's state, `<replicas><shard>/<name>` (JSON:
    /// role, applied update, epoch, step), under the replica's lease.
    pub replicas: String,
    /// Prefix of each shard's latest checkpoint record, `<checkpoints><shard>`.
    pub checkpoints: String,
    /// The cluster's health (`OK`, `UNHEALTHY` or `UNKNOWN`, with a
    /// reason), written by the coordinator.
    pub cluster_status: String,
    /// Prefix under which trainers register (`<members><id>`, under their
    /// leases): a trainer whose key goes leaves the sync barrier. In sync
    /// mode a client that joins should be registered here: a primary
    /// promoted from a follower takes out of its barrier the members it
    /// inherited that are not registered (they left while it was not
    /// primary). One that joins the new primary afterwards stays, and a
    /// fresh primary (no members yet) takes nobody out.
    pub members: String,
    /// How many pservers the job wants (a decimal number), changed by
    /// [`set_pservers`](crate::set_pservers); the coordinator drains the
    /// others (empty: the coordinator's [`pservers`] option decides).
    ///
    /// [`pservers`]: crate::CoordinatorOptions::pservers
    pub desired: String,
}

impl PserverKeys {
    /// Where pserver `name` registers.
    pub fn pserver(&self, name: &str) -> String {
        format!("{}{name}", self.pservers)
    }

    /// Where shard `shard`'s latest checkpoint is recorded.
    pub fn checkpoint(&self, shard: u32) -> String {
        format!("{}{shard}", self.checkpoints)
    }

    /// Where `name`'s replica of shard `shard` says how it is.
    pub fn replica(&self, shard: u32, name: &str) -> String {
        format!("{}{shard}/{name}", self.replicas)
    }
}

/// How a pserver runs. Every pserver and trainer of a job must agree on
/// `specs`, `shards` and `block_size` (the placement's fingerprint checks
/// it). `keys` and `specs` have no useful default: set them.
#[derive(Clone, Debug)]
pub struct PserverOptions {
    /// Where it registers, and where the map, trainers and checkpoint records are.
    pub keys: PserverKeys,
    /// Its name's stem: it registers as `<name>.<lease>` (hex), so a
    /// restarted process is a new pserver to the map.
    pub name: String,
    /// The model's parameters.
    pub specs: Vec<ParamSpec>,
    /// The model's sparse tables (rows on `hash(table, id) mod shards`).
    pub tables: Vec<crate::sparse::TableSpec>,
    /// Number of logical shards of the job (its placement's servers).
    pub shards: u32,
    /// Largest block, in elements.
    pub block_size: usize,
    /// Seed of the parameters' initial values.
    pub seed: u64,
    /// Sync barrier or apply on arrival.
    pub mode: Mode,
    /// The update rule.
    pub optimizer: OptimizerConfig,
    /// A user-defined update rule that replaces `optimizer` (which then only
    /// names the job's choice in its options). Called once per store.
    pub custom_optimizer: Option<OptimizerFactory>,
    /// The pserver's lease: when it expires the pserver stops serving and
    /// the coordinator gives its shards to others.
    pub lease_ttl: Duration,
    /// Where checkpoints go (`<dir>/shard-<s>/`); none: no checkpoints.
    /// Every pserver of a job must see the same directory: a shard's
    /// checkpoints are written by its primary, whichever pserver that is,
    /// and restored by whichever pserver the coordinator gives it to.
    pub checkpoint_dir: Option<PathBuf>,
    /// How often each primary shard is checkpointed (when something
    /// changed). With one replica per shard, a crash loses at most the
    /// updates of one interval.
    pub checkpoint_interval: Duration,
    /// Checkpoints kept per shard (at least 2, so a corrupt newest one has
    /// a fallback).
    pub checkpoint_keep: usize,
    /// How long an answer may wait for the followers to hold what it
    /// depends on before it is refused as unavailable (the client retries).
    pub replication_timeout: Duration,
    /// Bound of one call to another pserver.
    pub call_timeout: Duration,
}

impl Default for PserverOptions {
    /// An async SGD pserver (lr 0.1) named `pserver` of a 1-shard job with
    /// blocks of 64 Ki floats, seed 1, a 5 s lease, no checkpoints (every
    /// 60 s, 3 kept, once a directory is given), answers that wait up to 5 s
    /// for followers.
    fn default() -> Self {
        Self {
            keys: PserverKeys::default(),
            name: "pserver".into(),
            specs: Vec::new(),
            tables: Vec::new(),
            shards: 1,
            block_size: 1 << 16,
            seed: 1,
            mode: Mode::Async,
            optimizer: OptimizerConfig::Sgd { lr: 0.1 },
            custom_optimizer: None,
            lease_ttl: Duration::from_secs(5),
            checkpoint_dir: None,
            checkpoint_interval: Duration::from_secs(60),
            checkpoint_keep: 3,
            replication_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(10),
        }
    }
}

/// One shard's replica on this pserver.
struct Slot {
    shard: u32,
    /// Its `oar_ps_step` sample, looked up at the first update it applies
    /// (not at every one).
    step_gauge: std::sync::OnceLock<oar_metrics::Gauge>,
    state: Mutex<SlotState>,
    /// Wakes pulls waiting for the next sync step, and checkpoints waiting
    /// for a step or a push in parts to complete: notified after every push.
    stepped: Notify,
    /// Async: how many checkpoints of the slot wait for pushes in parts
    /// half taken ([`CheckpointGate`]); while any does, pushes that would
    /// start a new push wait for it.
    checkpoint_gate: watch::Sender<usize>,
    /// The epoch at which this pserver began serving the shard from a
    /// checkpoint or from the initial values (0: it took the shard over
    /// from another replica). A sync push computed at an older epoch's
    /// parameters is stale here (see `handler::PsHandler::push`).
    restored_epoch: AtomicU64,
    /// What may be acknowledged (see [`Replication`]).
    replication: watch::Sender<Replication>,
    /// Wakes the tasks that forward to followers.
    forward: Notify,
    /// The tasks working for this slot: forwarding (primary) or syncing
    /// (follower). Aborted when the slot goes.
    tasks: Mutex<HashMap<String, AbortOnDropHandle<()>>>,
    /// A sync task is running for it.
    syncing: AtomicBool,
    /// The role last [published](Shared::publish) (a [`ReplicaRole`] as u8).
    role: std::sync::atomic::AtomicU8,
    /// Why the last restore of the shard from its checkpoints failed, while
    /// it is retried (published with the replica's state).
    restore_error: Mutex<Option<String>>,
}

impl Slot {
    /// Publish `step` as the shard's `oar_ps_step`.
    fn set_step_metric(&self, step: u64) {
        let shard = self.shard;
        let gauge = self.step_gauge.get_or_init(|| {
            metrics().step.get_or_create(&vec![("shard".to_string(), shard.to_string())]).clone()
        });
        gauge.set(step as i64);
    }
}

/// Whether the slot is primary, and what every follower holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Replication {
    primary: bool,
    epoch: u64,
    replicated: u64,
}

enum SlotState {
    /// Primary: applies updates; `links` numbers them and tracks the followers.
    Primary { store: ParamStore, links: Links },
    /// Caught up with its primary (unless `must_sync`: it then syncs first).
    Follower { follower: Follower, must_sync: bool },
    /// Catching up from `primary`'s snapshot.
    CatchingUp { catch_up: CatchUp },
    /// Waiting to catch up (or to be restored as primary): holds nothing.
    Syncing,
}

impl SlotState {
    fn role(&self) -> ReplicaRole {
        match self {
            SlotState::Primary { .. } => ReplicaRole::Primary,
            SlotState::Follower { must_sync: false, .. } => ReplicaRole::Follower,
            SlotState::Follower { must_sync: true, .. } => ReplicaRole::DueToSync,
            _ => ReplicaRole::Syncing,
        }
    }

    fn describe(&self, shard: u32) -> ReplicaState {
        let (applied, epoch, step) = match self {
            SlotState::Primary { store, links } => (links.seq(), links.epoch(), store.step()),
            SlotState::Follower { follower, .. } => {
                (follower.applied(), follower.history().last_epoch(), follower.store().step())
            }
            SlotState::CatchingUp { catch_up } => (catch_up.upto(), catch_up.epoch(), 0),
            SlotState::Syncing => (0, 0, 0),
        };
        ReplicaState { shard, role: self.role(), applied, epoch, step }
    }
}

/// A snapshot held for a follower's catch-up: it fetches the parts.
struct HeldSnapshot {
    upto: u64,
    snapshot: crate::StoreSnapshot,
    /// Block positions of each part.
    parts: Vec<std::ops::Range<usize>>,
    /// After them, the row parts: (table, a run of the table's arena
    /// chunks, then of its admission candidates, numbered after the chunks).
    row_parts: Vec<(u32, std::ops::Range<usize>)>,
    taken: std::time::Instant,
}

/// How long a snapshot held for a catch-up is kept without being finished.
const SNAPSHOT_KEEP: Duration = Duration::from_secs(120);

struct Shared {
    name: String,
    options: PserverOptions,
    placement: Arc<Placement>,
    keys: PserverKeys,
    slots: RwLock<BTreeMap<u32, Arc<Slot>>>,
    /// The map this pserver serves under: what it reconciled last.
    map: watch::Sender<Option<Arc<ShardMap>>>,
    topology: TopologyWatch,
    transport: Arc<dyn Transport>,
    discovery: Arc<dyn Discovery>,
    conns: Mutex<HashMap<String, Arc<dyn Connection>>>,
    snapshots: Mutex<HashMap<(u32, String), HeldSnapshot>>,
    stopped: watch::Sender<Option<String>>,
    /// Checked before every request and answer: a pserver whose lease may
    /// have expired (paused or cut off past its ttl) must not take or
    /// acknowledge updates a replacement would not have.
    lease: LeaseGuard,
    lease_id: LeaseId,
    /// Set when a graceful shutdown begins: from then on requests are refused.
    draining: AtomicBool,
    /// Bytes of shard snapshots received while catching up.
    catch_up_bytes: AtomicU64,
    /// Some replica's role changed: publish the states now.
    role_changed: Notify,
    /// Set when the shard map released this pserver (drained of every
    /// replica, not wanted by the job).
    released: AtomicBool,
    /// Held while a checkpoint file is written.
    saving: Mutex<()>,
    /// Buffers for pull replies, kept once the peer has acknowledged them,
    /// so that a reply of several MiB is written into memory already
    /// faulted in (see [`REPLY_POOL_BYTES`]).
    reply_pool: oar_transport::wire::BufferPool,
    /// Trainers whose registration was seen to end (they left every
    /// barrier then), until one of them is seen joining a barrier again
    /// ([`Shared::check_departed`]).
    departed: DepartedMembers,
}

/// The most idle memory a pserver keeps for replies: eight of the
/// client's largest pull parts (8 MiB each); a snapshot part's reply is
/// views of the snapshot's blocks, with no buffer of its own. Replies
/// under the pool's threshold ([`oar_transport::wire::DEFAULT_POOLED_FROM`])
/// are not kept.
const REPLY_POOL_BYTES: usize = 64 << 20;

impl Shared {
    /// `trainer` joined a barrier: if its registration was seen to end,
    /// check in the background whether it came back ([`verify_registration`]).
    fn check_departed(self: &Arc<Self>, trainer: &str) {
        if self.departed.take(trainer) {
            tokio::spawn(verify_registration(self.clone(), trainer.to_string()));
        }
    }

    /// Stop serving for good (the first reason is kept and logged).
    fn stop(&self, why: String) {
        self.halt(why, false);
    }

    /// Stop serving for good; an error unless `graceful` (a shutdown).
    fn halt(&self, why: String, graceful: bool) {
        self.stopped.send_if_modified(|s| {
            if s.is_none() {
                // What it acknowledged until now: nothing after (every answer checks first).
                let acknowledged = metrics().acknowledged.get();
                match graceful {
                    true => tracing::info!(%why, acknowledged, "pserver stops serving"),
                    false => tracing::error!(%why, acknowledged, "pserver stops serving"),
                }
                *s = Some(why);
                true
            } else {
                false
            }
        });
        for slot in self.slots() {
            slot.stepped.notify_waiters();
            slot.replication.send_modify(|r| r.primary = false);
        }
    }

    /// Stop for a fault that may have left a store half-updated: stop
    /// serving, and revoke the lease so the coordinator replaces this
    /// pserver at once (if the revoke fails, the lease expires).
    fn fail(&self, why: String) {
        self.stop(why);
        let (discovery, lease) = (self.discovery.clone(), self.lease_id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                match discovery.revoke_lease(lease).await {
                    Ok(()) => tracing::info!(lease, "lease revoked; the coordinator replaces this pserver"),
                    Err(e) => tracing::warn!(error = %e, lease, "could not revoke the lease; it will expire"),
                }
            });
        }
    }

    fn refusal(why: &str) -> RemoteError {
        RemoteError::unavailable(format!("pserver stopped serving: {why}"))
    }

    /// Refuse once the pserver stopped, began draining, or its lease may
    /// have expired.
    fn check_serving(&self) -> std::result::Result<(), RemoteError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(RemoteError::unavailable("pserver is shutting down"));
        }
        if !self.lease.is_valid() {
            self.stop("the pserver's lease may have expired (no refresh within its ttl)".into());
        }
        if let Some(why) = self.stopped.borrow().as_ref() {
            return Err(Self::refusal(why));
        }
        Ok(())
    }

    fn slots(&self) -> Vec<Arc<Slot>> {
        self.slots.read().unwrap_or_else(PoisonError::into_inner).values().cloned().collect()
    }

    fn slot(&self, shard: u32) -> Option<Arc<Slot>> {
        self.slots.read().unwrap_or_else(PoisonError::into_inner).get(&shard).cloned()
    }

    fn map(&self) -> Option<Arc<ShardMap>> {
        self.map.borrow().clone()
    }

    /// The map now, if it still makes this pserver `shard`'s primary at
    /// `epoch` (a restore serves only then).
    fn map_if_primary(&self, shard: u32, epoch: u64) -> Option<Arc<ShardMap>> {
        self.map().filter(|m| m.role(shard, &self.name) == Some(Role::Primary) && m.epoch(shard) == epoch)
    }

    fn map_version(&self) -> u64 {
        self.map.borrow().as_ref().map_or(0, |m| m.version())
    }

    /// Whether `shard`'s updates are numbered and forwarded: the job has
    /// replicas, or the shard has a follower now (a replica moving in). A
    /// job of one replica pays nothing for replication otherwise.
    fn replicated(&self, shard: u32) -> bool {
        self.map.borrow().as_ref().is_some_and(|m| m.replicas() > 1 || m.replica_set(shard).len() > 1)
    }

    /// A sync store of `shard` keeps its completed steps for the followers
    /// exactly while the shard is [replicated](Self::replicated). (A store
    /// that starts recording mid-step forwards that step incomplete, but a
    /// snapshot waits for any step under way, so a new follower never takes
    /// it.)
    fn set_recording(&self, store: &mut ParamStore, shard: u32) {
        if self.replicated(shard) {
            store.record_steps();
        } else {
            store.stop_recording_steps();
        }
    }

    /// A slot's state, locked. A poisoned lock is fatal: the thread that
    /// panicked holding it may have left an update half-done.
    fn lock<'a>(&self, slot: &'a Slot) -> std::result::Result<MutexGuard<'a, SlotState>, RemoteError> {
        slot.state.lock().map_err(|_| {
            let why = "a store's lock is poisoned: a thread panicked while holding it, \
                       perhaps midway through an update";
            self.fail(why.into());
            Self::refusal(why)
        })
    }

    /// Run `update` on `store`, catching a panic, which is fatal (the
    /// store may be half-updated): the pserver stops before the caller
    /// releases the lock, so no request or checkpoint reads that state.
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

    /// A store of `shard` with its initial values and fresh optimizer
    /// state, or (`to_restore`) one whose blocks hold no values until a
    /// catch-up fills them ([`ParamStore::new_to_restore`]). The initial
    /// values take seconds for a large shard: call it where blocking is
    /// allowed (`spawn_blocking`), not on a runtime worker.
    fn new_store(&self, shard: u32, to_restore: bool) -> ServiceResult<ParamStore> {
        let optimizer = match &self.options.custom_optimizer {
            Some(factory) => factory.build(),
            None => self.options.optimizer.build()?,
        };
        let (placement, mode) = (&self.placement, self.options.mode);
        let mut store = ParamStore::new_to_restore(placement, shard, self.options.seed, optimizer, mode)?;
        if !to_restore {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            initialize(&mut store, placement, self.options.seed, cores)?;
        }
        self.set_recording(&mut store, shard);
        Ok(store)
    }

    /// [`new_store`](Self::new_store) on the blocking pool.
    async fn new_store_blocking(self: &Arc<Self>, shard: u32, to_restore: bool) -> ServiceResult<ParamStore> {
        let shared = self.clone();
        tokio::task::spawn_blocking(move || shared.new_store(shard, to_restore))
            .await
            .map_err(|_| ServiceError::Unfinished(format!("building shard {shard}'s store")))?
    }

    /// A connection to pserver `name` (looked up in the registrations).
    async fn connection(&self, name: &str) -> ServiceResult<Arc<dyn Connection>> {
        if let Some(conn) = self.conns.lock().unwrap_or_else(PoisonError::into_inner).get(name) {
            return Ok(conn.clone());
        }
        let addr = self.topology.current().addrs.get(name).cloned().ok_or_else(|| {
            ServiceError::Protocol(format!("pserver {name} is not registered (gone, or not up yet)"))
        })?;
        let conn = self.transport.connect(&addr).await?;
        self.conns.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_string(), conn.clone());
        Ok(conn)
    }

    fn forget_connection(&self, name: &str) {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner).remove(name);
    }

    /// Tell waiters what `slot` (locked as `state`) may acknowledge now.
    fn publish(&self, slot: &Slot, state: &SlotState) {
        let now = match state {
            SlotState::Primary { links, .. } => {
                Replication { primary: true, epoch: links.epoch(), replicated: links.replicated() }
            }
            _ => Replication::default(),
        };
        slot.replication.send_if_modified(|r| {
            let changed = *r != now;
            *r = now;
            changed
        });
        slot.forward.notify_waiters();
        // A replica that caught up or took over says so at once: the
        // coordinator's next move waits for it.
        let role = state.role() as u8;
        if slot.role.swap(role, Ordering::SeqCst) != role {
            self.role_changed.notify_one();
        }
    }
}

/// A running pserver. Dropping it stops serving.
pub struct Pserver {
    shared: Arc<Shared>,
    listener: Box<dyn Listener>,
    session: Option<Session>,
    background: Vec<AbortOnDropHandle<()>>,
}

impl Pserver {
    /// Register as `<options.name>.<lease>` at `listen_addr`, follow the
    /// shard map and serve what it gives this pserver, and follow the
    /// trainers for the sync barrier. Returns once registered: shards come
    /// as the coordinator maps them.
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        listen_addr: &str,
        options: PserverOptions,
    ) -> ServiceResult<Pserver> {
        let keys = options.keys.clone();
        for (what, key) in [
            ("pservers", &keys.pservers),
            ("shard_map", &keys.shard_map),
            ("replicas", &keys.replicas),
            ("checkpoints", &keys.checkpoints),
            ("members", &keys.members),
        ] {
            if key.is_empty() {
                return Err(ServiceError::Config(format!("pserver keys must name {what}: {keys:?}")));
            }
        }
        if options.name.is_empty() || options.name.contains('/') {
            return Err(ServiceError::Config(format!(
                "pserver name {:?} must be non-empty, without '/'",
                options.name
            )));
        }
        if options.checkpoint_interval.is_zero() {
            return Err(ServiceError::Config(
                "checkpoint_interval must be more than zero (it is how often each shard is checkpointed)"
                    .into(),
            ));
        }
        metrics(); // Registered from the start, at zero.
                   // Checked once here, so a store built later cannot fail on it.
        match &options.custom_optimizer {
            Some(factory) => drop(factory.build()),
            None => drop(options.optimizer.build()?),
        }
        let placement = Arc::new(
            Placement::new(&options.specs, options.shards, options.block_size)?
                .with_tables(options.tables.clone())?,
        );
        let session = Session::start(discovery.clone(), options.lease_ttl).await?;
        let name = format!("{}.{:x}", options.name, session.lease());
        let topology = TopologyWatch::start(discovery.clone(), &keys).await?;
        let shared = Arc::new(Shared {
            name: name.clone(),
            placement,
            keys: keys.clone(),
            slots: RwLock::new(BTreeMap::new()),
            map: watch::channel(None).0,
            topology,
            transport: transport.clone(),
            discovery: discovery.clone(),
            conns: Mutex::new(HashMap::new()),
            snapshots: Mutex::new(HashMap::new()),
            stopped: watch::channel(None).0,
            lease: session.guard(),
            lease_id: session.lease(),
            draining: AtomicBool::new(false),
            released: AtomicBool::new(false),
            catch_up_bytes: AtomicU64::new(0),
            role_changed: Notify::new(),
            saving: Mutex::new(()),
            reply_pool: oar_transport::wire::BufferPool::new(REPLY_POOL_BYTES),
            departed: DepartedMembers::new(&keys.members),
            options,
        });
        let listener =
            transport.listen(listen_addr, Arc::new(handler::PsHandler { shared: shared.clone() })).await?;
        let departures = Departures::watch(discovery.clone(), &keys.members).await?;
        discovery
            .put(&keys.pserver(&name), listener.local_addr().as_bytes().to_vec(), Some(session.lease()))
            .await?;

        let lease_lost = session.lost_signal();
        let guard = shared.clone();
        let mut background = vec![
            AbortOnDropHandle::new(tokio::spawn(reconciler(shared.clone()))),
            AbortOnDropHandle::new(tokio::spawn(trainer_watcher(departures, shared.clone()))),
            AbortOnDropHandle::new(tokio::spawn(status_publisher(shared.clone()))),
            AbortOnDropHandle::new(tokio::spawn(async move {
                lease_lost.await;
                guard.stop("the pserver's lease is lost".into());
            })),
        ];
        if shared.options.checkpoint_dir.is_some() {
            background.push(AbortOnDropHandle::new(tokio::spawn(checkpointer(shared.clone()))));
        }
        tracing::info!(name, addr = listener.local_addr(), mode = ?shared.options.mode, "pserver serving");
        Ok(Pserver { shared, listener, session: Some(session), background })
    }

    /// The name it registered under (`<name>.<lease>`), as the map calls it.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The address trainers call.
    pub fn addr(&self) -> &str {
        self.listener.local_addr()
    }

    /// The version of the shard map it serves under (0: none yet).
    pub fn map_version(&self) -> u64 {
        self.shared.map_version()
    }

    /// What it holds of each shard, in shard order.
    pub fn replicas(&self) -> Vec<ReplicaState> {
        self.shared
            .slots()
            .iter()
            .map(|slot| {
                let state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
                state.describe(slot.shard)
            })
            .collect()
    }

    /// The step of shard `shard`'s store, if it holds one (read even from a
    /// store that a panic stopped).
    pub fn step(&self, shard: u32) -> Option<u64> {
        self.with_store(shard, ParamStore::step)
    }

    /// The pushes shard `shard`'s replica here has applied over the
    /// shard's life ([`ParamStore::pushes`]), if it holds one that serves.
    pub fn pushes(&self, shard: u32) -> Option<u64> {
        self.with_store(shard, ParamStore::pushes)
    }

    fn with_store<T>(&self, shard: u32, f: impl FnOnce(&ParamStore) -> T) -> Option<T> {
        let slot = self.shared.slot(shard)?;
        let state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        match &*state {
            SlotState::Primary { store, .. } => Some(f(store)),
            SlotState::Follower { follower, .. } => Some(f(follower.store())),
            _ => None,
        }
    }

    /// The parameters of block `id` in its shard's store, if this pserver
    /// holds the shard (primary or caught-up follower).
    pub fn block(&self, id: crate::BlockId) -> Option<Vec<f32>> {
        let shard = self.shared.placement.block(id)?.server;
        let slot = self.shared.slot(shard)?;
        let state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        let store = match &*state {
            SlotState::Primary { store, .. } => store,
            SlotState::Follower { follower, .. } => follower.store(),
            _ => return None,
        };
        store.block(id).ok().map(<[f32]>::to_vec)
    }

    /// Bytes of shard snapshots this pserver received while catching up
    /// (parameters and optimizer state of the replicas moved or copied to
    /// it), since it started.
    pub fn catch_up_bytes(&self) -> u64 {
        self.shared.catch_up_bytes.load(Ordering::Relaxed)
    }

    /// Whether the shard map released this pserver: it held nothing and
    /// the job wants fewer pservers ([`crate::set_pservers`]). It stopped
    /// serving; [`shutdown`](Self::shutdown) it to leave.
    pub fn released(&self) -> bool {
        self.shared.released.load(Ordering::SeqCst)
    }

    /// Why the pserver stopped serving, if it did: its lease was lost, a
    /// panic while updating a store, or it was [released](Self::released).
    pub fn stopped(&self) -> Option<String> {
        self.shared.stopped.borrow().clone()
    }

    /// Write a checkpoint of every shard it is primary of now, and record
    /// each (if checkpoints are configured). Pushes and pulls go on
    /// meanwhile. An error once the pserver stopped serving.
    pub async fn checkpoint(&self) -> ServiceResult<Vec<CheckpointInfo>> {
        let mut written = Vec::new();
        for slot in self.shared.slots() {
            if let Some(info) = save_and_record(&self.shared, &slot).await? {
                written.push(info);
            }
        }
        Ok(written)
    }

    /// Stop serving gracefully: refuse every request from now on (an update
    /// applied before is acknowledged once its followers hold it; one that
    /// comes after is refused as unavailable and its trainer retries it on
    /// the shard's next primary), write a last checkpoint of every shard it
    /// is primary of, and release its registration (revoke the lease), so
    /// the coordinator gives its shards to their followers (or, with one
    /// replica, to other pservers, from that checkpoint) at once. Returns
    /// what it held of the shards it was primary of.
    ///
    /// Requests are refused from a moment when no sync step is underway
    /// and no push in parts is half taken on any of its primary shards,
    /// waited for up to [`DRAIN_WAIT`] (serving meanwhile), so that the
    /// last checkpoints hold whole steps and whole pushes.
    pub async fn shutdown(mut self) -> ServiceResult<BTreeMap<u32, PrimaryAtStop>> {
        let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
        loop {
            let whole = self.shared.slots().iter().all(|slot| {
                match &*slot.state.lock().unwrap_or_else(PoisonError::into_inner) {
                    SlotState::Primary { store, .. } => {
                        !store.step_underway() && !store.push_in_parts_underway()
                    }
                    _ => true,
                }
            });
            if whole || tokio::time::Instant::now() >= deadline {
                self.shared.draining.store(true, Ordering::SeqCst);
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let steps: BTreeMap<u32, PrimaryAtStop> = self
            .shared
            .slots()
            .iter()
            .filter_map(|slot| match &*slot.state.lock().unwrap_or_else(PoisonError::into_inner) {
                SlotState::Primary { store, .. } => Some((
                    slot.shard,
                    PrimaryAtStop {
                        step: store.step(),
                        pushes: store.pushes(),
                        row_updates: store.row_updates(),
                        rows: store.rows_held(),
                        last_seqs: store.last_seqs().map(|(t, s)| (t.to_string(), s)).collect(),
                    },
                )),
                _ => None,
            })
            .collect();
        for slot in self.shared.slots() {
            slot.stepped.notify_waiters();
        }
        self.listener.close();
        self.background.clear();
        let serving = self.shared.stopped.borrow().is_none();
        let mut saved = Ok(());
        if serving {
            for slot in self.shared.slots() {
                // Nothing applied: the initial values need no checkpoint.
                if steps.get(&slot.shard).is_none_or(|at| at.step == 0) {
                    continue;
                }
                if let Err(e) = save_and_record(&self.shared, &slot).await {
                    saved = Err(e);
                }
            }
        }
        self.shared.halt("shut down".into(), true);
        if let Some(session) = self.session.take() {
            session.close().await?;
        }
        saved.map(|()| steps)
    }
}

/// What a pserver held of a shard it was primary of when it stopped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrimaryAtStop {
    /// The shard's step: updates applied (async: pushes; sync: steps),
    /// including those before a failover or a restore.
    pub step: u64,
    /// The trainer pushes the shard applied ([`ParamStore::pushes`]),
    /// including those before a failover, a move or a restore.
    pub pushes: u64,
    /// The row updates its sparse tables hold ([`ParamStore::row_updates`]).
    pub row_updates: u64,
    /// The rows its sparse tables hold ([`ParamStore::rows_held`]).
    pub rows: u64,
    /// Each trainer's last push seq the shard took. A client numbers its
    /// pushes to a shard from 0, one at a time, so in async mode trainer
    /// `t` had `seq + 1` pushes applied there, each once.
    pub last_seqs: BTreeMap<String, u64>,
}

impl Drop for Pserver {
    fn drop(&mut self) {
        self.listener.close();
        self.background.clear();
        for slot in self.shared.slots() {
            slot.tasks.lock().unwrap_or_else(PoisonError::into_inner).clear();
        }
    }
}

/// How long a graceful stop keeps serving for a sync step that is underway,
/// or a push in parts, to complete.
pub const DRAIN_WAIT: Duration = Duration::from_secs(5);

/// How long a checkpoint waits for a sync step that is underway (or a push
/// in parts half taken) to complete.
const CHECKPOINT_STEP_WAIT: Duration = Duration::from_secs(30);

/// A waiting checkpoint looks again after this long even if no push woke it.
const CHECKPOINT_RETRY: Duration = Duration::from_millis(10);

/// A checkpoint's gate opens once no push reached the store for this long
/// (see [`save_and_record`]).
const CHECKPOINT_GATE_IDLE: Duration = Duration::from_millis(500);

/// Async: closes `slot`'s checkpoint gate while it lives, so pushes that
/// would start a new push wait (`handler::PsHandler::push`) and the pushes
/// in parts half taken complete, letting a checkpoint's snapshot in (see
/// [`save_and_record`]). Dropped (the snapshot taken, the checkpoint given
/// up, or its future dropped), it opens the gate and wakes them.
struct CheckpointGate<'a>(&'a Slot);

impl<'a> CheckpointGate<'a> {
    fn close(slot: &'a Slot) -> Self {
        slot.checkpoint_gate.send_modify(|closed| *closed += 1);
        CheckpointGate(slot)
    }
}

impl Drop for CheckpointGate<'_> {
    fn drop(&mut self) {
        self.0.checkpoint_gate.send_modify(|closed| *closed -= 1);
    }
}

/// Follow the shard map: each new version changes what this pserver holds.
async fn reconciler(shared: Arc<Shared>) {
    let mut topology = shared.topology.subscribe();
    loop {
        let map = topology.borrow_and_update().map.clone();
        if let Some(map) = map {
            if map.version() > shared.map_version() {
                reconcile(&shared, map).await;
            }
        }
        if topology.changed().await.is_err() {
            return;
        }
    }
}

/// Make what this pserver holds match `map`.
async fn reconcile(shared: &Arc<Shared>, map: Arc<ShardMap>) {
    if shared.stopped.borrow().is_some() {
        return;
    }
    let me = shared.name.clone();
    let version = map.version();
    tracing::debug!(version, "reconciling with the shard map");
    // Drop what the map no longer gives this pserver.
    let held: Vec<u32> = shared.slots().iter().map(|s| s.shard).collect();
    for shard in held {
        if map.role(shard, &me).is_none() {
            let gone = shared.slots.write().unwrap_or_else(PoisonError::into_inner).remove(&shard);
            if let Some(slot) = gone {
                tracing::info!(shard, version, "shard no longer held here");
                let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
                *state = SlotState::Syncing;
                shared.publish(&slot, &state);
                slot.tasks.lock().unwrap_or_else(PoisonError::into_inner).clear();
            }
        }
    }
    shared.map.send_replace(Some(map.clone()));
    if map.is_released(&me) {
        shared.released.store(true, Ordering::SeqCst);
        shared.halt(format!("released by shard map version {version}: the job wants fewer pservers"), true);
        return;
    }
    let mut restore = Vec::new();
    for (shard, role) in map.shards_of(&me) {
        let slot = {
            let mut slots = shared.slots.write().unwrap_or_else(PoisonError::into_inner);
            slots
                .entry(shard)
                .or_insert_with(|| {
                    Arc::new(Slot {
                        shard,
                        step_gauge: std::sync::OnceLock::new(),
                        state: Mutex::new(SlotState::Syncing),
                        stepped: Notify::new(),
                        checkpoint_gate: watch::channel(0).0,
                        restored_epoch: AtomicU64::new(0),
                        replication: watch::channel(Replication::default()).0,
                        forward: Notify::new(),
                        tasks: Mutex::new(HashMap::new()),
                        syncing: AtomicBool::new(false),
                        role: std::sync::atomic::AtomicU8::new(ReplicaRole::Syncing as u8),
                        restore_error: Mutex::new(None),
                    })
                })
                .clone()
        };
        let epoch = map.epoch(shard);
        let followers: Vec<String> = map.replica_set(shard)[1..].to_vec();
        let action = {
            let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
            let current = std::mem::replace(&mut *state, SlotState::Syncing);
            let (next, action) = match (role, current) {
                (Role::Primary, SlotState::Primary { mut store, mut links }) if links.epoch() == epoch => {
                    links.set_followers(followers.iter().map(String::as_str));
                    shared.set_recording(&mut store, shard);
                    (SlotState::Primary { store, links }, Action::Forward)
                }
                // A follower asked to sync again (its link overflowed, or a
                // poke from before it caught up) still holds every update
                // its primary acknowledged (acknowledgements wait for every
                // follower in the map): promoting it loses nothing
                // acknowledged, where restoring the checkpoint would.
                (Role::Primary, SlotState::Follower { follower, must_sync }) => {
                    if must_sync {
                        tracing::warn!(
                            shard,
                            version,
                            "made primary while due to sync again: promoted as it is"
                        );
                    }
                    let (mut store, applied, history) = follower.promote(epoch);
                    shared.set_recording(&mut store, shard);
                    tracing::info!(
                        shard,
                        version,
                        applied,
                        epoch,
                        "this follower is the shard's primary now"
                    );
                    let mut links = Links::new(shard, epoch, applied, history);
                    links.set_followers(followers.iter().map(String::as_str));
                    let members = store.members();
                    (SlotState::Primary { store, links }, Action::Promoted(members))
                }
                (Role::Primary, current) => {
                    if !matches!(current, SlotState::Syncing) {
                        tracing::warn!(shard, version, "made primary without a caught-up replica: restoring");
                    }
                    restore.push((slot.clone(), epoch));
                    (SlotState::Syncing, Action::None)
                }
                (Role::Follower, SlotState::Primary { .. }) => {
                    tracing::info!(shard, version, "deposed: catching up from the new primary");
                    (SlotState::Syncing, Action::Sync)
                }
                (Role::Follower, SlotState::Follower { mut follower, must_sync }) => {
                    follower.saw_map(version);
                    let must_sync = must_sync || follower.history().last_epoch() != epoch;
                    let action = if must_sync { Action::Sync } else { Action::None };
                    (SlotState::Follower { follower, must_sync }, action)
                }
                (Role::Follower, SlotState::CatchingUp { catch_up }) if catch_up.epoch() == epoch => {
                    (SlotState::CatchingUp { catch_up }, Action::None)
                }
                (Role::Follower, _) => (SlotState::Syncing, Action::Sync),
            };
            // A restore's error stands only while the slot waits for it.
            if !(role == Role::Primary && matches!(next, SlotState::Syncing)) {
                *slot.restore_error.lock().unwrap_or_else(PoisonError::into_inner) = None;
            }
            *state = next;
            shared.publish(&slot, &state);
            action
        };
        match action {
            Action::None => {}
            Action::Forward => replication::spawn_forwarders(shared, &slot),
            Action::Promoted(members) => {
                slot.tasks.lock().unwrap_or_else(PoisonError::into_inner).clear();
                replication::spawn_forwarders(shared, &slot);
                spawn_leave_departed(shared, &slot, members);
            }
            Action::Sync => {
                // A primary's forwarders go; the sync task comes.
                if !slot.syncing.load(Ordering::SeqCst) {
                    slot.tasks.lock().unwrap_or_else(PoisonError::into_inner).clear();
                }
                replication::spawn_sync(shared, &slot);
            }
        }
    }
    for (slot, epoch) in restore {
        spawn_restore(shared, &slot, epoch);
    }
}

/// How long after a failed restore of a shard it is tried again, the
/// first time; the pause doubles with each failure, up to
/// [`RESTORE_RETRY_MAX`] (each try reads the shard's checkpoints again).
const RESTORE_RETRY: Duration = Duration::from_secs(5);

/// The longest pause between two tries at a shard's restore.
const RESTORE_RETRY_MAX: Duration = Duration::from_secs(60);

/// The name of the slot task that restores it at `epoch`.
fn restore_task(epoch: u64) -> String {
    format!("restore@{epoch}")
}

/// Record why `slot`'s restore failed, for the replica's published state.
fn restore_failed(shared: &Shared, slot: &Slot, why: String) {
    tracing::error!(shard = slot.shard, %why, "cannot restore the shard; tried again later, its other shards are served meanwhile");
    *slot.restore_error.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
    shared.role_changed.notify_one();
}

/// Restore `slot` as primary of `epoch` in a task of the slot's own, so
/// that a long load (a large checkpoint on a shared volume) does not hold
/// up the maps that come meanwhile: a follower busy restoring another
/// shard still adopts them, and stays eligible to take over its shards.
/// One restore per slot and epoch: a new map that leaves it primary at the
/// same epoch lets the running one go on (the followers it starts with are
/// the map's when it ends). A restore whose checkpoints do not load is
/// tried again after [`RESTORE_RETRY`], doubling to [`RESTORE_RETRY_MAX`],
/// while the map still makes this pserver the primary at `epoch`: a
/// checkpoint directory mended (a bad file removed, a volume back) then
/// serves the shard without a restart, and the pserver's other shards were
/// never stopped. A pserver whose own mount is broken keeps the shard
/// waiting too (the status names the error): restarting it moves the shard.
fn spawn_restore(shared: &Arc<Shared>, slot: &Arc<Slot>, epoch: u64) {
    let name = restore_task(epoch);
    let mut tasks = slot.tasks.lock().unwrap_or_else(PoisonError::into_inner);
    if tasks.get(&name).is_some_and(|t| !t.is_finished()) {
        return;
    }
    tasks.retain(|key, _| !key.starts_with("restore@"));
    let (shared_task, slot_task) = (shared.clone(), slot.clone());
    let task = tokio::spawn(async move {
        let (shared, slot) = (shared_task, slot_task);
        let mut pause = RESTORE_RETRY;
        loop {
            match restore_primary(&shared, &slot, epoch).await {
                Ok(()) => return,
                Err(why) => restore_failed(&shared, &slot, why),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RESTORE_RETRY_MAX);
            let wanted = shared.map_if_primary(slot.shard, epoch).is_some();
            let syncing =
                matches!(*slot.state.lock().unwrap_or_else(PoisonError::into_inner), SlotState::Syncing);
            if !wanted || !syncing || shared.stopped.borrow().is_some() {
                return;
            }
        }
    });
    tasks.insert(name, AbortOnDropHandle::new(task));
}

/// What to start after a slot's state changed.
enum Action {
    None,
    Forward,
    Promoted(Vec<String>),
    Sync,
}

/// Below this many floats a store's initial values are computed on the
/// calling thread: starting threads would cost more than it saves.
const INIT_ON_THREADS_FROM: usize = 1 << 20;

/// Give every block of `store` (made to be restored) its initial values
/// ([`crate::init_values`]) and fresh optimizer state, the same as
/// [`ParamStore::new`] gives them, computed on up to `threads` threads
/// (the machine's cores): on one, a normal initialiser takes 34–47 ns a
/// float (4.1–4.7 s for a 100M-float shard, BENCHMARKS.md "A first start").
fn initialize(store: &mut ParamStore, placement: &Placement, seed: u64, threads: usize) -> ServiceResult<()> {
    let blocks: Vec<_> = placement.blocks_on(store.server()).collect();
    let floats: usize = blocks.iter().map(|b| b.len).sum();
    let threads = match floats >= INIT_ON_THREADS_FROM {
        true => threads.min(blocks.len()).max(1),
        false => 1,
    };
    let (specs, optimizer) = (placement.specs(), store.optimizer());
    let make = |t: usize| {
        blocks
            .iter()
            .skip(t)
            .step_by(threads)
            .map(|b| {
                let (params, state) = crate::store::initial_block(specs, b, seed, optimizer);
                (b.id, params, state)
            })
            .collect::<Vec<_>>()
    };
    let made: Vec<_> = match threads {
        1 => vec![make(0)],
        _ => std::thread::scope(|scope| {
            let running: Vec<_> = (0..threads).map(|t| scope.spawn(move || make(t))).collect();
            running.into_iter().map(|r| r.join()).collect::<Result<Vec<_>, _>>()
        })
        .map_err(|_| ServiceError::Unfinished("computing the initial values".into()))?,
    };
    for (id, params, state) in made.into_iter().flatten() {
        store.restore_block(id, params, state)?;
    }
    Ok(())
}

/// Serve `slot` as primary of `epoch` from its last checkpoint (or from
/// the initial values): no replica that could take over survived. An
/// error when the checkpoints would not load (every one corrupt, another
/// job's, the directory unreadable): serving fresh values would throw the
/// training away, so the shard waits, and the caller tries again. A store
/// that cannot be built stops the pserver (nothing any retry could mend).
async fn restore_primary(shared: &Arc<Shared>, slot: &Arc<Slot>, epoch: u64) -> Result<(), String> {
    let shard = slot.shard;
    let checkpoints = shared.options.checkpoint_dir.clone();
    // With checkpoints, the store's values come from one: it is built
    // without them, and with its initial values only if there is none
    // (computing them on one thread takes 0.34–0.47 s per 10M floats).
    let built = shared.new_store_blocking(shard, checkpoints.is_some()).await;
    let mut store = match built {
        Ok(store) => store,
        Err(e) => {
            shared.fail(format!("cannot build shard {shard}'s store: {e}"));
            return Ok(());
        }
    };
    if let Some(root) = checkpoints {
        let dir = CheckpointDir::new(root, shard);
        let loaded =
            tokio::task::spawn_blocking(move || dir.load_latest(&mut store).map(|l| (l, store))).await;
        match loaded {
            Ok(Ok((Some(loaded), restored))) => {
                store = restored;
                for (path, why) in &loaded.skipped {
                    tracing::warn!(shard, path = %path.display(), %why, "skipped a checkpoint");
                }
                tracing::info!(
                    shard,
                    step = loaded.info.step,
                    path = loaded.info.path,
                    "restored checkpoint"
                );
            }
            Ok(Ok((None, _))) => {
                tracing::info!(shard, "no checkpoint; starting fresh");
                store = match shared.new_store_blocking(shard, false).await {
                    Ok(store) => store,
                    Err(e) => {
                        shared.fail(format!("cannot build shard {shard}'s store: {e}"));
                        return Ok(());
                    }
                };
            }
            // Every checkpoint corrupt: serving fresh values would throw the training away.
            Ok(Err(e)) => return Err(format!("cannot restore shard {shard}: {e}")),
            Err(e) => return Err(format!("cannot restore shard {shard}: {e}")),
        }
    }
    if store.unrestored() > 0 {
        return Err(format!(
            "shard {shard}: the checkpoint left {} blocks without values",
            store.unrestored()
        ));
    }
    // Recording follows the map now, not when the store was built.
    shared.set_recording(&mut store, shard);
    slot.restored_epoch.store(epoch, Ordering::SeqCst);
    let mut links = Links::new(shard, epoch, 0, History::default());
    let members = store.members();
    {
        let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        // The map may have moved on meanwhile: serve only if still primary
        // of this epoch, with the followers the map names now (a map of
        // the same epoch may have changed them while the restore ran).
        let Some(map) = shared.map_if_primary(shard, epoch) else { return Ok(()) };
        if !matches!(*state, SlotState::Syncing) {
            return Ok(());
        }
        links.set_followers(map.replica_set(shard).iter().skip(1).map(String::as_str));
        *slot.restore_error.lock().unwrap_or_else(PoisonError::into_inner) = None;
        *state = SlotState::Primary { store, links };
        shared.publish(slot, &state);
    }
    tracing::info!(shard, epoch, "serving as the shard's primary");
    replication::spawn_forwarders(shared, slot);
    spawn_leave_departed(shared, slot, members);
    Ok(())
}

/// A new primary's store may count trainers that left while it was not
/// primary (their departure went to the old primary): those of `members`,
/// the store's members when it became primary, that are not registered
/// leave now. Only those: a trainer that joined this primary since then
/// joined it alive (its join is checked against the departures this
/// pserver saw, [`Shared::check_departed`]), and a listing read before
/// its registration, or a client that never registers (one used without
/// the trainer role), must not take it out of the barrier again: its
/// pushes would then complete steps without it, one step apart from the
/// others, until every call gave up. The listing is tried again while
/// etcd is away (a trainer left standing in the barrier would hold every
/// sync step up), in a task of the slot's own, so that the map's other
/// shards are not kept waiting; a role change ends it.
fn spawn_leave_departed(shared: &Arc<Shared>, slot: &Arc<Slot>, members: Vec<String>) {
    if members.is_empty() {
        return;
    }
    let task = tokio::spawn(leave_departed(shared.clone(), slot.clone(), members));
    let mut tasks = slot.tasks.lock().unwrap_or_else(PoisonError::into_inner);
    tasks.insert("leave-departed".to_string(), AbortOnDropHandle::new(task));
}

async fn leave_departed(shared: Arc<Shared>, slot: Arc<Slot>, members: Vec<String>) {
    let mut pause = Duration::from_millis(100);
    let listing = loop {
        match shared.discovery.get_prefix(&shared.keys.members).await {
            Ok(listing) => break listing,
            Err(e) if e.is_transient() && shared.check_serving().is_ok() => {
                tracing::warn!(error = %e, shard = slot.shard, "cannot list the trainers; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                tracing::warn!(error = %e, shard = slot.shard, "cannot list the trainers; departed ones stay in the barrier until they leave");
                return;
            }
        }
    };
    let (shared, slot) = (&shared, &*slot);
    let present: std::collections::HashSet<&str> = listing
        .kvs
        .iter()
        .filter_map(|kv| oar_discovery::member_name(&shared.keys.members, &kv.key))
        .collect();
    let Ok(mut state) = shared.lock(slot) else { return };
    let SlotState::Primary { store, .. } = &*state else { return };
    let current = store.members();
    let gone: Vec<String> = members
        .into_iter()
        .filter(|m| !present.contains(m.as_str()) && current.binary_search(m).is_ok())
        .collect();
    for trainer in gone {
        tracing::info!(
            trainer,
            shard = slot.shard,
            "a member of the new primary's store is not registered: it leaves the barrier"
        );
        if let Err(e) = leave(shared, slot, &mut state, &trainer) {
            tracing::warn!(error = %e.message, "cannot take a departed trainer out of the barrier");
        }
    }
}

/// `trainer` leaves `slot`'s barrier (the slot must be primary).
fn leave(
    shared: &Shared,
    slot: &Slot,
    state: &mut SlotState,
    trainer: &str,
) -> std::result::Result<u64, RemoteError> {
    let SlotState::Primary { store, links } = state else { return Ok(0) };
    let version = shared.map_version();
    shared.update(store, |s| s.leave(trainer))?;
    if shared.replicated(slot.shard) {
        for step in store.take_completed_steps() {
            links.record(version, Update::Step(step));
        }
        links.record(version, Update::Leave(trainer.to_string()));
    }
    let seq = links.seq();
    shared.publish(slot, state);
    slot.stepped.notify_waiters();
    Ok(seq)
}

/// A trainer whose registration vanished leaves the sync barrier of every
/// shard this pserver is primary of, so the surviving trainers' step
/// completes instead of hanging.
async fn trainer_watcher(mut departures: Departures, shared: Arc<Shared>) {
    while let Some(departure) = departures.next().await {
        match departure {
            Ok(trainer) => {
                if shared.check_serving().is_err() {
                    return;
                }
                shared.departed.remember(&trainer);
                if !leave_every_barrier(&shared, &trainer) {
                    return;
                }
                tracing::info!(trainer, "trainer gone; it leaves the barrier");
            }
            Err(e) => {
                // Only a failure that will repeat ends up here: a watch that
                // merely broke is followed again by `Departures`.
                tracing::error!(error = %e, "cannot follow the trainers; dead trainers leave only by Leave calls");
                return;
            }
        }
    }
}

/// A trainer whose registration had ended joined a barrier (a `Join`, or a
/// sync push): if its key under the members' prefix is still gone, it
/// leaves every barrier again. Its own lease check may come too late (a
/// trainer paused past its ttl, whose push or join was on its way), and no
/// departure would ever come for it again: every other trainer's step
/// would wait for it until their calls gave up. Reading the key after the
/// join cannot miss a departure: one after the read is seen by the
/// trainer watcher, which takes it out again.
async fn verify_registration(shared: Arc<Shared>, trainer: String) {
    if shared.departed.still_gone(&*shared.discovery, &trainer).await
        && leave_every_barrier(&shared, &trainer)
    {
        tracing::warn!(trainer, "a trainer whose registration ended joined a barrier; it leaves it again");
    }
}

/// `trainer` leaves the barrier of every shard held here; false when that
/// could not be done (the pserver stopped, or a leave failed: logged).
fn leave_every_barrier(shared: &Shared, trainer: &str) -> bool {
    for slot in shared.slots() {
        let Ok(mut state) = shared.lock(&slot) else { return false };
        if let Err(e) = leave(shared, &slot, &mut state, trainer) {
            tracing::warn!(error = %e.message, trainer, "cannot take a trainer out of the barrier");
            return false;
        }
    }
    true
}

/// Publish each replica's state under `<replicas><shard>/<name>` (JSON)
/// when it changed: at once when a role changed (a replica caught up or
/// took over: the coordinator's moves wait for that), else at most every
/// half second (what `oar status` and the coordinator's health show).
async fn status_publisher(shared: Arc<Shared>) {
    let mut published: HashMap<u32, (ReplicaState, Option<String>)> = HashMap::new();
    let mut interval = tokio::time::interval(Duration::from_millis(500));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shared.role_changed.notified() => {}
        }
        if shared.stopped.borrow().is_some() {
            return;
        }
        let now: HashMap<u32, (ReplicaState, Option<String>)> = shared
            .slots()
            .iter()
            .map(|slot| {
                let state = slot.state.lock().unwrap_or_else(PoisonError::into_inner).describe(slot.shard);
                let error = slot.restore_error.lock().unwrap_or_else(PoisonError::into_inner).clone();
                (slot.shard, (state, error))
            })
            .collect();
        for (shard, now_state) in &now {
            if published.get(shard) == Some(now_state) {
                continue;
            }
            let (state, error) = now_state;
            let mut value = serde_json::json!({
                "pserver": shared.name,
                "status": state.role.to_string(),
                "applied": state.applied,
                "epoch": state.epoch,
                "step": state.step,
                "map_version": shared.map_version(),
            });
            if let Some(error) = error {
                value["error"] = serde_json::Value::String(error.clone());
            }
            let key = shared.keys.replica(*shard, &shared.name);
            if shared
                .discovery
                .put(&key, value.to_string().into_bytes(), Some(shared.lease_id))
                .await
                .is_err()
            {
                continue;
            }
            published.insert(*shard, now_state.clone());
        }
        let gone: Vec<u32> = published.keys().filter(|s| !now.contains_key(s)).copied().collect();
        for shard in gone {
            if shared.discovery.delete(&shared.keys.replica(shard, &shared.name)).await.is_ok() {
                published.remove(&shard);
            }
        }
    }
}

/// Checkpoint every shard this pserver is primary of, every interval, when
/// its step moved.
async fn checkpointer(shared: Arc<Shared>) {
    let mut interval = tokio::time::interval(shared.options.checkpoint_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    let mut saved: HashMap<u32, u64> = HashMap::new();
    loop {
        interval.tick().await;
        if shared.check_serving().is_err() {
            // Its shards may be others' now: their checkpoints are not ours to write.
            return;
        }
        for slot in shared.slots() {
            let step = match &*slot.state.lock().unwrap_or_else(PoisonError::into_inner) {
                SlotState::Primary { store, .. } if store.block_ids().next().is_some() => store.step(),
                _ => continue,
            };
            // Nothing applied yet: the initial values need no checkpoint.
            if saved.get(&slot.shard).copied().unwrap_or(0) == step {
                continue;
            }
            match save_and_record(&shared, &slot).await {
                Ok(Some(info)) => {
                    saved.insert(slot.shard, info.step);
                }
                Ok(None) => {}
                Err(e) => tracing::error!(shard = slot.shard, error = %e, "checkpoint failed; will retry"),
            }
        }
    }
}

/// Take a snapshot of `slot`'s store (if it is primary) under its lock and
/// write it with no lock held, off the async threads; then record it under
/// `<checkpoints><shard>`. Refused once the pserver stopped serving.
///
/// A snapshot never holds half a sync step or half a push in parts
/// ([`ParamStore::snapshot`]), so while one is underway the checkpoint
/// waits, up to [`CHECKPOINT_STEP_WAIT`], woken after each push (with a
/// short fallback), and takes its snapshot as soon as it is whole.
///
/// Async, it also closes the slot's [`CheckpointGate`] while it waits:
/// pushes that would start a new push wait (up to a bound, then go ahead),
/// while parts of the pushes half taken pass. Why: with several trainers
/// whose pushes in parts overlap, some push is half taken at almost every
/// moment, and a checkpoint that only waits starves. The gate opens once
/// the snapshot is taken, or once no push reached the store for
/// [`CHECKPOINT_GATE_IDLE`] (the trainers of the pushes half taken are
/// dead or stuck: others do not wait for their leases to end), or when
/// the checkpoint gives up or is dropped. Sync mode has no gate: a step
/// underway needs the pushes that complete it, new ones included.
async fn save_and_record(shared: &Arc<Shared>, slot: &Slot) -> ServiceResult<Option<CheckpointInfo>> {
    let Some(root) = shared.options.checkpoint_dir.clone() else { return Ok(None) };
    let started = std::time::Instant::now();
    // Async: the gate closes at the first wait, at most once.
    let mut may_gate = shared.options.mode == Mode::Async;
    let mut gate: Option<CheckpointGate<'_>> = None;
    // When a push last reached the store while the gate was closed.
    let mut progress = started;
    let (snapshot, epoch) = loop {
        // Registered before looking, so a push completing in between wakes it.
        let stepped = slot.stepped.notified();
        let taken = {
            let state = shared.lock(slot).map_err(|e| ServiceError::Stopped(e.message))?;
            if let Some(why) = shared.stopped.borrow().as_ref() {
                return Err(ServiceError::Stopped(why.clone()));
            }
            match &*state {
                // A shard without blocks has nothing to checkpoint.
                SlotState::Primary { store, links } if store.block_ids().next().is_some() => {
                    store.snapshot().map(|snapshot| (snapshot, links.epoch()))
                }
                _ => return Ok(None),
            }
        };
        match taken {
            Err(Error::CheckpointStepUnderway { .. }) if started.elapsed() < CHECKPOINT_STEP_WAIT => {
                if may_gate {
                    may_gate = false;
                    gate = Some(CheckpointGate::close(slot));
                    progress = std::time::Instant::now();
                }
                match tokio::time::timeout(CHECKPOINT_RETRY, stepped).await {
                    Ok(()) => progress = std::time::Instant::now(),
                    Err(_) if gate.is_some() && progress.elapsed() >= CHECKPOINT_GATE_IDLE => {
                        tracing::debug!(
                            shard = slot.shard,
                            "pushes in parts half taken do not progress: gate opened"
                        );
                        gate = None;
                    }
                    Err(_) => {}
                }
            }
            taken => break taken?,
        }
    };
    // Pushes go on while the snapshot is written.
    drop(gate);
    let dir = CheckpointDir::new(root, slot.shard);
    let keep = shared.options.checkpoint_keep;
    let saver = shared.clone();
    let info = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = saver.saving.lock().unwrap_or_else(PoisonError::into_inner);
        // Paused past its lease while writing (or the map moved on), this
        // pserver may no longer own the shard: its file must not land
        // beside the new primary's.
        let still_owner = || {
            if !saver.lease.is_valid() {
                return Err("the pserver's lease may have expired while it wrote".to_string());
            }
            if let Some(why) = saver.stopped.borrow().as_ref() {
                return Err(format!("the pserver stopped: {why}"));
            }
            // Still the primary of the epoch the snapshot was taken at.
            let slot = saver.slot(snapshot.server());
            let primary = slot.is_some_and(|slot| {
                let state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
                matches!(&*state, SlotState::Primary { links, .. } if links.epoch() == epoch)
            });
            if primary {
                Ok(())
            } else {
                Err(format!("the shard is no longer primary here at epoch {epoch}"))
            }
        };
        dir.save_checked(&snapshot, keep, still_owner)
    })
    .await
    .map_err(|e| ServiceError::Protocol(format!("checkpoint task failed: {e}")))??;
    metrics().checkpoint.observe(started.elapsed().as_secs_f64());
    metrics().checkpoint_time.set(info.unix_time_ms as f64 / 1000.0);
    tracing::debug!(shard = slot.shard, step = info.step, path = info.path, "checkpoint written");
    let key = shared.keys.checkpoint(slot.shard);
    match info.encode() {
        Ok(record) => {
            if let Err(e) = shared.discovery.put(&key, record, None).await {
                tracing::warn!(error = %e, key, "could not record the checkpoint");
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not encode the checkpoint record"),
    }
    Ok(Some(info))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{optimizer::Adam, Init};

    #[test]
    fn a_store_initialized_on_threads_equals_one_made_by_new() {
        // One shard large enough to be computed on threads; blocks of
        // uneven lengths, more blocks than threads.
        let specs = vec![
            ParamSpec::new("w", vec![1000, 1100], Init::Normal { mean: 0.5, std: 2.0 }),
            ParamSpec::new("b", vec![1000], Init::Uniform { low: -1.0, high: 1.0 }),
        ];
        const { assert!(1000 * 1101 >= INIT_ON_THREADS_FROM) };
        let placement = Placement::new(&specs, 1, 70_000).unwrap();
        let adam = || Box::new(Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 });
        let reference = ParamStore::new(&placement, 0, 7, adam(), Mode::Async).unwrap();
        for threads in [0, 1, 3, 100] {
            let mut store = ParamStore::new_to_restore(&placement, 0, 7, adam(), Mode::Async).unwrap();
            assert!(store.unrestored() > 3);
            initialize(&mut store, &placement, 7, threads).unwrap();
            assert_eq!(store.unrestored(), 0);
            assert!(store.blocks().eq(reference.blocks()), "{threads} threads");
        }
    }
}
