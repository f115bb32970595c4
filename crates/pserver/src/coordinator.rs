//! The shard coordinator: the one writer of a job's [`ShardMap`]
//! (`docs/DESIGN.md` §6). It runs where the job's lock holder runs (the
//! master) and writes only through that lock's [`Fence`], so a deposed
//! coordinator changes nothing.
//!
//! What it does, each time the registrations or the replicas' states change
//! (and every second):
//!
//! - **First map.** Once [`CoordinatorOptions::pservers`] pservers are
//!   registered, it writes the first map over them ([`ShardMap::initial`]).
//! - **Failover.** A pserver whose registration went (its lease expired,
//!   or it shut down) leaves every replica set; where it was primary, the
//!   caught-up follower with the highest applied update takes over
//!   ([`ShardMap::without`]). It asks each candidate ([`PsRequest::Status`]),
//!   and only one that answers as a caught-up follower under the current
//!   map can take over: a replica still catching up holds nothing to serve.
//! - **Restore.** A shard left with no replica is given to the live
//!   pserver holding the fewest replicas, which restores it from the
//!   shard's last checkpoint ([`ShardMap::with_restored`]).
//! - **Re-replication.** A shard with fewer replicas than wanted gets a
//!   follower on the live pserver holding the fewest replicas that has
//!   none of it ([`ShardMap::with_follower`]); it catches up from the
//!   primary.
//! - **Scaling.** The job wants `ps_desired` pservers ([`set_pservers`]
//!   changes it; until then [`CoordinatorOptions::pservers`]). It keeps the
//!   live pservers [`ShardMap::wanted`] ranks first and **drains** the
//!   others ([`ShardMap::drain`]): each of their replicas moves to a kept
//!   pserver (a new replica catches up, the primary switches if needed,
//!   the old replica goes), and a pserver left holding nothing is
//!   **released** ([`ShardMap::with_released`]): it stops serving and
//!   leaves. A pserver that registers beyond the wanted count and was never
//!   given a replica **stands by**: it holds nothing until a kept pserver
//!   dies or the count rises, when it is kept in its place (the status
//!   lists it). Restores and new followers go only to kept pservers.
//! - **Balance.** With [`CoordinatorOptions::rebalance`] (the default), it
//!   also moves replicas from the most loaded kept pservers to the least
//!   ([`ShardMap::rebalance`]), so a pserver that joins gets its share:
//!   adding one to `P` moves about `1/(P+1)` of the replicas, all to it.
//! - **Health.** It writes the cluster's status: `OK` when every shard has
//!   all its replicas, every replica has caught up, nothing moves or is
//!   left to balance and the job has the pservers it wants, else `UNHEALTHY` with the reason
//!   (`UNKNOWN` before the first map). A coordinator that has seen no
//!   good map (a master that just took over) never writes a first map over
//!   a map key whose value cannot be decoded (a hand edit, a newer format):
//!   pservers serving the last good map would keep it, and a fresh first
//!   map would name a second primary for its shards. The status is
//!   `UNHEALTHY`, naming the key, until it is mended or deleted. One that
//!   has seen a good map carries on from it (a map read back older is
//!   ignored), and its next map, one version higher, replaces the value.
//!
//! Several changes found at once go out as one new map; moves go one at a
//! time.

use crate::{
    error::{ServiceError, ServiceResult},
    protocol::{PsReply, PsRequest, ReplicaRole, PSERVER_METHOD},
    service::PserverKeys,
    topology::{Topology, TopologyWatch},
    Health, ShardMap,
};
use oar_discovery::{ChangeSignal, Discovery, Fence};
use oar_transport::Transport;
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
    time::Duration,
};
use tokio_util::task::AbortOnDropHandle;

/// How a [`Coordinator`] runs.
#[derive(Clone, Debug)]
pub struct CoordinatorOptions {
    /// The pservers' keys: where they register, the map, the replicas'
    /// states and the cluster's status.
    pub keys: PserverKeys,
    /// Logical shards of the job.
    pub shards: u32,
    /// Replicas per shard.
    pub replicas: u32,
    /// The pservers the job wants until the `ps_desired` key says
    /// otherwise: the first map waits for them (the first in natural name
    /// order, if more registered).
    pub pservers: u32,
    /// How long a candidate has to answer a failover's question.
    pub query_timeout: Duration,
    /// How long a failover keeps asking candidates that have not seen the
    /// current map yet (or did not answer) before it decides without them.
    pub election_wait: Duration,
    /// Move replicas to balance the pservers kept, one shard at a time
    /// ([`ShardMap::rebalance`]): a pserver that joins gets its share. On
    /// by default. Off, only draining moves replicas
    /// ([`ShardMap::drain`]).
    pub rebalance: bool,
}

impl Default for CoordinatorOptions {
    /// One shard, one replica, one pserver; candidates answer within 1 s,
    /// and a failover waits up to 2 s for them; rebalancing on.
    fn default() -> Self {
        Self {
            keys: PserverKeys::default(),
            shards: 1,
            replicas: 1,
            pservers: 1,
            query_timeout: Duration::from_secs(1),
            election_wait: Duration::from_secs(2),
            rebalance: true,
        }
    }
}

/// How [`set_pservers`] decides.
#[derive(Clone, Debug, Default)]
pub struct ScaleOptions {
    /// Change the count even while a move or an earlier scale is under way
    /// (for instance when a pserver asked for never came): the coordinator
    /// plans from wherever the map is.
    pub force: bool,
}

/// What [`set_pservers`] changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scaled {
    /// The wanted pserver count before.
    pub from: u32,
    /// The wanted pserver count now.
    pub to: u32,
    /// The shard map's version when the count changed.
    pub map_version: u64,
}

/// Ask the job's coordinator for `count` pservers. Scaling out, the
/// pservers that register next (up to `count`) get their share of the
/// shards; scaling in, the highest-numbered pservers ([`ShardMap::wanted`])
/// are drained and then released. Returns at once: follow the cluster
/// status (`OK` again once the job has its pservers and every replica has
/// caught up).
///
/// Refused, naming why, and changing nothing: `count` 0 or above the job's
/// shard count; no shard map yet (the job's pservers have not started);
/// and, unless [`ScaleOptions::force`], while a move or an earlier scale is
/// under way. Fewer pservers than replicas per shard is allowed: the shards
/// then have as many replicas as pservers, and the status says so.
pub async fn set_pservers(
    discovery: &dyn Discovery,
    keys: &PserverKeys,
    count: u32,
    options: ScaleOptions,
) -> ServiceResult<Scaled> {
    let refuse = |why: String| ServiceError::Scale(format!("cannot scale to {count} pservers: {why}"));
    let topology = crate::topology::read(discovery, keys).await?;
    let Some(map) = topology.map else {
        return Err(refuse("the job has no shard map yet (its pservers have not all started)".into()));
    };
    check_count(count, map.shard_count()).map_err(refuse)?;
    let holding = map.pservers().len() as u32;
    let from = match discovery.get(&keys.desired).await? {
        Some(kv) => parse_count(&kv.value).unwrap_or(holding),
        None => holding,
    };
    if !options.force {
        let live = sorted(topology.addrs.keys());
        let wanted = map.wanted(&live, from);
        let mut under_way = Vec::new();
        let moving: Vec<u32> =
            (0..map.shard_count()).filter(|&s| map.replica_set(s).len() > map.replicas() as usize).collect();
        if !moving.is_empty() {
            under_way.push(format!("shards {moving:?} are moving"));
        }
        let draining: Vec<&str> =
            map.pservers().into_iter().filter(|p| !wanted.iter().any(|w| w == p)).collect();
        if !draining.is_empty() {
            under_way.push(format!("{} being drained", draining.join(", ")));
        }
        if holding < from.min(map.shard_count() * map.replicas()) {
            under_way.push(format!("the job wants {from} pservers and {holding} hold shards"));
        }
        if !under_way.is_empty() {
            return Err(refuse(format!(
                "a move is in flight ({}): wait until the cluster status is OK, or force it",
                under_way.join("; ")
            )));
        }
    }
    discovery.put(&keys.desired, count.to_string().into_bytes(), None).await?;
    tracing::info!(from, to = count, map_version = map.version(), "wanted pserver count changed");
    Ok(Scaled { from, to: count, map_version: map.version() })
}

/// The pause after a coordinator round failed on a transient error, times
/// the failures in a row (at most 5).
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// A running coordinator. Dropping it stops it.
pub struct Coordinator {
    task: AbortOnDropHandle<ServiceResult<()>>,
}

impl Coordinator {
    /// Coordinate the pservers under `options.keys`, writing through `fence`.
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        fence: Fence,
        options: CoordinatorOptions,
    ) -> ServiceResult<Coordinator> {
        if options.shards == 0 || options.replicas == 0 || options.pservers < options.replicas {
            return Err(ServiceError::Config(format!(
                "{} shards, {} replicas, {} pservers: a job needs at least one shard and one replica, and at \
                 least as many pservers as replicas",
                options.shards, options.replicas, options.pservers
            )));
        }
        if options.keys.cluster_status.is_empty() || options.keys.replicas.is_empty() {
            return Err(ServiceError::Config(format!(
                "coordinator keys must name the cluster status and the replicas: {:?}",
                options.keys
            )));
        }
        if !options.keys.desired.is_empty() {
            // The first wanted count; a standby master finds it there.
            let count = options.pservers.to_string().into_bytes();
            discovery.create_if_absent(&options.keys.desired, count, None).await?;
        }
        let topology = TopologyWatch::start(discovery.clone(), &options.keys).await?;
        let replicas_signal = ChangeSignal::new(&*discovery, &options.keys.replicas).await;
        let desired_signal = ChangeSignal::new(&*discovery, &options.keys.desired).await;
        let desired = Desired { count: options.pservers, problem: None };
        let held = Default::default();
        let run =
            Run { discovery, transport, fence, options, topology, status: String::new(), desired, held };
        let task = tokio::spawn(run.run(replicas_signal, desired_signal));
        Ok(Coordinator { task: AbortOnDropHandle::new(task) })
    }

    /// Stop coordinating and wait until the coordinator's task has ended,
    /// so that it writes nothing after this returns (a dropped coordinator
    /// stops only at its task's next pause, and may write once more: a
    /// job's master that wrote its report must not then map the pservers
    /// leaving as shards without a replica).
    pub async fn stop(mut self) {
        self.task.abort();
        // Cancelled, or ended by itself just before: either way, ended.
        let _ = (&mut self.task).await;
    }

    /// Wait until the coordinator stops: it lost its fence, or met an error
    /// that trying again cannot mend. A transient one (etcd slow or
    /// unreachable for a while, a pserver that does not answer) does not
    /// stop it: the round is tried again, 200 ms to 1 s later.
    pub async fn stopped(&mut self) -> ServiceError {
        match (&mut self.task).await {
            Ok(Ok(())) => ServiceError::Stopped("the coordinator stopped".into()),
            Ok(Err(e)) => e,
            Err(e) => ServiceError::Stopped(format!("the coordinator's task failed: {e}")),
        }
    }
}

struct Run {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    fence: Fence,
    options: CoordinatorOptions,
    topology: TopologyWatch,
    /// The cluster status last written.
    status: String,
    /// How many pservers the job wants, as last read.
    desired: Desired,
    /// Every pserver a map it saw gave a replica: one of them left holding
    /// nothing was drained, and is released; one never given any stands by.
    held: std::collections::HashSet<String>,
}

/// The job's wanted pserver count, and what was wrong with the last value
/// read if it could not be used (the count before it stays).
#[derive(Clone, Debug)]
struct Desired {
    count: u32,
    problem: Option<String>,
}

impl Run {
    async fn run(
        mut self,
        mut replicas_signal: ChangeSignal,
        mut desired_signal: ChangeSignal,
    ) -> ServiceResult<()> {
        let mut changes = self.topology.subscribe();
        let mut failing = 0u32;
        loop {
            let topology = changes.borrow_and_update().clone();
            match self.round(&topology).await {
                // Look again at once, from the map just written.
                Ok(true) => {
                    failing = 0;
                    continue;
                }
                Ok(false) => failing = 0,
                // etcd slow or unreachable for a moment (a request timed
                // out, its leader changed): the next round starts over from
                // what is stored. Only a lost fence or a refusal that will
                // repeat stops the coordinator, and [`Coordinator::stopped`]
                // says which.
                Err(e) if oar_transport::Transient::is_transient(&e) => {
                    failing = failing.saturating_add(1);
                    let pause = RETRY_PAUSE * failing.min(5);
                    tracing::warn!(error = %e, retry_in = ?pause, "coordinator round failed; trying again");
                    tokio::time::sleep(pause).await;
                    continue;
                }
                Err(e) => return Err(e),
            }
            tokio::select! {
                _ = changes.changed() => {}
                _ = replicas_signal.wait(Duration::from_secs(1)) => {}
                _ = desired_signal.wait(Duration::from_secs(1)) => {}
            }
        }
    }

    /// One look at `topology`: write the map it needs, if any, then the
    /// cluster status. `true` when a map was written.
    async fn round(&mut self, topology: &Topology) -> ServiceResult<bool> {
        self.read_desired().await;
        let written = match &topology.map {
            None => self.first_map(topology).await?,
            Some(map) => self.maintain(topology, map).await?,
        };
        match written {
            Some(map) => {
                let seen = self.topology.newer_than(map.version() - 1, Duration::from_secs(1)).await;
                self.write_status(&seen).await?;
                Ok(true)
            }
            None => {
                self.write_status(topology).await?;
                Ok(false)
            }
        }
    }

    /// Read the wanted pserver count. Absent: the option's. A value that is
    /// not a count the map can use is reported in the cluster status and
    /// the last good count stays.
    async fn read_desired(&mut self) {
        let value = match self.discovery.get(&self.options.keys.desired).await {
            Ok(Some(kv)) => kv.value,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the wanted pserver count; keeping {}", self.desired.count);
                return;
            }
        };
        match parse_count(&value) {
            Ok(count) => {
                if count != self.desired.count {
                    tracing::info!(
                        from = self.desired.count,
                        to = count,
                        "the job wants a new pserver count"
                    );
                }
                self.desired = Desired { count, problem: None };
            }
            Err(why) => {
                if self.desired.problem.as_deref() != Some(why.as_str()) {
                    tracing::warn!(%why, keeping = self.desired.count, "bad wanted pserver count");
                }
                self.desired.problem = Some(why);
            }
        }
    }

    async fn write_map(&self, map: &ShardMap) -> ServiceResult<()> {
        self.discovery.put_fenced(&self.fence, &self.options.keys.shard_map, map.encode()).await?;
        tracing::info!(version = map.version(), health = ?map.health(), "shard map written");
        Ok(())
    }

    /// The first map, once enough pservers registered. None over a map
    /// that is there but unreadable: the status says so until someone
    /// mends or deletes it.
    async fn first_map(&self, topology: &Topology) -> ServiceResult<Option<ShardMap>> {
        if topology.unreadable_map.is_some() || (topology.addrs.len() as u32) < self.desired.count {
            return Ok(None);
        }
        let mut names: Vec<String> = topology.addrs.keys().cloned().collect();
        names.sort_by(|a, b| crate::shard_map::natural_cmp(a, b));
        names.truncate(self.desired.count as usize);
        let map = ShardMap::initial(self.options.shards, self.options.replicas, &names)?;
        self.write_map(&map).await?;
        Ok(Some(map))
    }

    /// Failovers, restores and new followers the current map needs.
    async fn maintain(&mut self, topology: &Topology, map: &ShardMap) -> ServiceResult<Option<ShardMap>> {
        self.held.extend(map.pservers().into_iter().map(str::to_string));
        let mut next = map.clone();
        for gone in map.pservers() {
            if topology.addrs.contains_key(gone) {
                continue;
            }
            let applied = self.candidates(topology, map, gone).await;
            if let Some(without) = next.without(gone, |s, q| applied.get(&(s, q.to_string())).copied()) {
                tracing::info!(pserver = gone, "pserver gone: its shards go to their followers");
                next = without;
            }
        }
        let live: Vec<String> = sorted(topology.addrs.keys());
        let wanted = next.wanted(&live, self.desired.count);
        if !wanted.is_empty() {
            let (restored, given) = next.restored(&wanted)?;
            for (shard, pserver) in given {
                tracing::warn!(shard, pserver, "no replica left: restoring the shard from its checkpoint");
            }
            next = restored;
            let replenished = next.replenished(&wanted)?;
            if replenished != next {
                tracing::info!(
                    version = replenished.version(),
                    "adding followers to shards short of replicas"
                );
                next = replenished;
            }
        }
        // Moves, once every pserver in the map is alive (a dead one's
        // shards are the failover's).
        let all_alive = map.pservers().iter().all(|p| topology.addrs.contains_key(*p));
        if next == *map && all_alive && !wanted.is_empty() {
            let caught_up = self.moving_caught_up(topology, map, &wanted).await;
            let caught_up = |s: u32, p: &str| caught_up.contains(&(s, p.to_string()));
            let moved = match self.options.rebalance {
                true => map.rebalance(&wanted, caught_up)?,
                false => map.drain(&wanted, caught_up)?,
            };
            if let Some(moved) = moved {
                tracing::info!(version = moved.version(), "a replica moves");
                next = moved;
            }
        }
        // Release the drained pservers (not wanted, held replicas, hold
        // none now); forget released ones that left.
        if next == *map {
            let drained =
                |p: &&String| !wanted.contains(p) && self.held.contains(*p) && map.shards_of(p).is_empty();
            for p in live.iter().filter(drained) {
                if let Some(released) = next.with_released(p)? {
                    tracing::info!(pserver = %p, wanted = self.desired.count, "pserver released: the job does not need it");
                    next = released;
                }
            }
            if let Some(forgotten) = next.without_released_gone(|p| topology.addrs.contains_key(p)) {
                next = forgotten;
            }
        }
        if next == *map {
            return Ok(None);
        }
        self.write_map(&next).await?;
        Ok(Some(next))
    }

    /// The replicas of shards with a move under way (more replicas than
    /// wanted, or a replica on a pserver not `wanted`) that serve their
    /// role under the current map: primaries primary, the others caught-up
    /// followers (asked, as a failover asks).
    async fn moving_caught_up(
        &self,
        topology: &Topology,
        map: &ShardMap,
        wanted: &[String],
    ) -> Vec<(u32, String)> {
        let moving: Vec<u32> = (0..map.shard_count())
            .filter(|&s| {
                let set = map.replica_set(s);
                set.len() > map.replicas() as usize || set.iter().any(|p| !wanted.contains(p))
            })
            .collect();
        let asked: Vec<String> = moving.iter().flat_map(|&s| map.replica_set(s).to_vec()).collect();
        let (states, _) = self.states_under(topology, map, asked).await;
        let serving = |(p, shard, role, _): &(String, u32, ReplicaRole, u64)| {
            let want = match map.role(*shard, p) {
                Some(crate::Role::Primary) => ReplicaRole::Primary,
                _ => ReplicaRole::Follower,
            };
            moving.contains(shard) && *role == want
        };
        states.into_iter().filter(serving).map(|(p, shard, _, _)| (shard, p)).collect()
    }

    /// The replicas that can take over the shards `gone` was primary of,
    /// with their applied updates: those that answer as followers under the
    /// current map (see [`takeover_candidates`]). Asked again (briefly)
    /// while some have not seen the current map or did not answer.
    async fn candidates(
        &self,
        topology: &Topology,
        map: &ShardMap,
        gone: &str,
    ) -> HashMap<(u32, String), u64> {
        let shards: Vec<u32> = (0..map.shard_count()).filter(|&s| map.primary(s) == Some(gone)).collect();
        let mut asked: Vec<String> = shards.iter().flat_map(|&s| map.replica_set(s)[1..].to_vec()).collect();
        let deadline = oar_transport::deadline_in(self.options.election_wait);
        let mut answered = Vec::new();
        loop {
            let (states, pending) = self.states_under(topology, map, asked).await;
            answered.extend(states.into_iter().filter(|(_, shard, _, _)| shards.contains(shard)));
            if pending.is_empty() || tokio::time::Instant::now() >= deadline {
                if !pending.is_empty() {
                    tracing::warn!(
                        ?pending,
                        gone,
                        "some followers did not answer as such in time: they cannot take over"
                    );
                }
                return takeover_candidates(&answered);
            }
            asked = pending;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Ask the registered pservers among `names` (each once) for their
    /// replicas' states: `(pserver, shard, role, applied)` from those that
    /// serve under `map`'s version, and the names of those that do not yet
    /// (or did not answer).
    async fn states_under(
        &self,
        topology: &Topology,
        map: &ShardMap,
        mut names: Vec<String>,
    ) -> (Vec<(String, u32, ReplicaRole, u64)>, Vec<String>) {
        names.sort();
        names.dedup();
        names.retain(|p| topology.addrs.contains_key(p));
        let answers = oar_transport::join_all(names.iter().map(|p| self.status_of(topology, p))).await;
        let (mut states, mut pending) = (Vec::new(), Vec::new());
        for (p, answer) in names.into_iter().zip(answers) {
            match answer {
                Some((version, replicas)) if version == map.version() => {
                    states.extend(replicas.into_iter().map(|(s, role, at)| (p.clone(), s, role, at)));
                }
                _ => pending.push(p),
            }
        }
        (states, pending)
    }

    /// Pserver `name`'s map version and `(shard, role, applied)` of each replica.
    async fn status_of(
        &self,
        topology: &Topology,
        name: &str,
    ) -> Option<(u64, Vec<(u32, ReplicaRole, u64)>)> {
        let addr = topology.addrs.get(name)?;
        let conn = self.transport.connect(addr).await.ok()?;
        let call = oar_transport::call::<_, PsReply>(
            conn.as_ref(),
            PSERVER_METHOD,
            &PsRequest::Status,
            bytes::Bytes::new(),
            self.options.query_timeout,
        );
        match call.await.ok()?.0 {
            PsReply::Status { map_version, shards, .. } => {
                Some((map_version, shards.into_iter().map(|s| (s.shard, s.role, s.applied)).collect()))
            }
            _ => None,
        }
    }

    /// Write the cluster's status when it changed.
    async fn write_status(&mut self, topology: &Topology) -> ServiceResult<()> {
        let status = match &topology.map {
            None if topology.unreadable_map.is_some() => serde_json::json!({
                "status": "UNHEALTHY",
                "reason": format!(
                    "the shard map under {} is unreadable ({}): nothing is written over it; \
                     mend it, or delete it to start the job's shards afresh",
                    self.options.keys.shard_map,
                    topology.unreadable_map.as_deref().unwrap_or_default()
                ),
                "nodes": sorted(topology.addrs.keys()),
            }),
            None => serde_json::json!({
                "status": "UNKNOWN",
                "reason": format!(
                    "no shard map yet: {} of {} pservers registered",
                    topology.addrs.len(),
                    self.desired.count
                ),
                "nodes": sorted(topology.addrs.keys()),
            }),
            Some(map) => {
                let mut reasons = Vec::new();
                if let Health::Unhealthy { under_replicated, unavailable } = map.health() {
                    if !unavailable.is_empty() {
                        reasons.push(format!("shards without a replica: {unavailable:?}"));
                    }
                    if !under_replicated.is_empty() {
                        reasons.push(format!(
                            "shards with fewer than {} replicas: {under_replicated:?}",
                            map.replicas()
                        ));
                    }
                }
                let moving: Vec<u32> = (0..map.shard_count())
                    .filter(|&s| map.replica_set(s).len() > map.replicas() as usize)
                    .collect();
                if !moving.is_empty() {
                    reasons.push(format!("shards moving: {moving:?}"));
                }
                let syncing = self.syncing(map).await?;
                if !syncing.is_empty() {
                    reasons.push(format!("replicas not caught up: {}", syncing.join(", ")));
                }
                let live = sorted(topology.addrs.keys());
                let wanted = map.wanted(&live, self.desired.count);
                let draining: Vec<&str> =
                    map.pservers().into_iter().filter(|p| !wanted.iter().any(|w| w == p)).collect();
                if !draining.is_empty() {
                    reasons.push(format!("draining {}", draining.join(", ")));
                }
                let standby: Vec<&String> = live
                    .iter()
                    .filter(|p| !wanted.contains(p) && !map.is_released(p) && map.shards_of(p).is_empty())
                    .filter(|p| !self.held.contains(*p))
                    .collect();
                // Balancing moves still to come (rebalance evens loads to ±1).
                let loads: Vec<usize> = wanted.iter().map(|p| map.shards_of(p).len()).collect();
                let uneven = loads.iter().max().zip(loads.iter().min()).is_some_and(|(h, l)| *h > l + 1);
                if self.options.rebalance && uneven && draining.is_empty() {
                    reasons.push(format!("balancing: replicas per pserver {loads:?}"));
                }
                let holding = map.pservers().len();
                let can_hold = self.desired.count.min(map.shard_count() * map.replicas());
                if (holding as u32) < can_hold {
                    reasons.push(format!(
                        "the job wants {} pservers, {holding} hold shards",
                        self.desired.count
                    ));
                }
                if let Some(problem) = &self.desired.problem {
                    reasons.push(problem.clone());
                }
                serde_json::json!({
                    "status": if reasons.is_empty() { "OK" } else { "UNHEALTHY" },
                    "reason": reasons.join("; "),
                    "nodes": map.pservers(),
                    "map_version": map.version(),
                    "desired": self.desired.count,
                    "draining": draining,
                    "standby": standby,
                    "released": map.released(),
                })
            }
        };
        let status = status.to_string();
        if status != self.status {
            self.discovery
                .put_fenced(&self.fence, &self.options.keys.cluster_status, status.clone().into_bytes())
                .await?;
            tracing::info!(status, "cluster status");
            self.status = status;
        }
        Ok(())
    }

    /// The replicas of `map` that do not say they are caught up (as
    /// `shard/name`), from their state keys.
    async fn syncing(&self, map: &ShardMap) -> ServiceResult<Vec<String>> {
        let listing = self.discovery.get_prefix(&self.options.keys.replicas).await?;
        let mut states: BTreeMap<(u32, String), (String, Option<String>)> = BTreeMap::new();
        for kv in listing.kvs {
            let Some(rest) = kv.key.strip_prefix(&self.options.keys.replicas) else { continue };
            let Some((shard, name)) = rest.split_once('/') else { continue };
            let Ok(shard) = shard.parse::<u32>() else { continue };
            let value = serde_json::from_slice::<serde_json::Value>(&kv.value).ok();
            let field = |f: &str| value.as_ref().and_then(|v| v.get(f)?.as_str().map(str::to_string));
            states.insert((shard, name.to_string()), (field("status").unwrap_or_default(), field("error")));
        }
        let mut syncing = Vec::new();
        for shard in 0..map.shard_count() {
            for (r, name) in map.replica_set(shard).iter().enumerate() {
                let want = if r == 0 { "primary" } else { "follower" };
                match states.get(&(shard, name.clone())) {
                    Some((status, _)) if status == want => {}
                    // A restore that failed (and is retried) says why.
                    Some((_, Some(error))) => syncing.push(format!("{shard}/{name} ({error})")),
                    _ => syncing.push(format!("{shard}/{name}")),
                }
            }
        }
        Ok(syncing)
    }
}

/// A wanted pserver count from its stored bytes: a decimal, at least 1.
/// (More pservers than replicas to hold is no harm: the surplus is
/// released; [`set_pservers`] refuses it up front.)
fn parse_count(value: &[u8]) -> Result<u32, String> {
    let text = String::from_utf8_lossy(value);
    match text.trim().parse() {
        Ok(0) => Err("ps_desired is 0: a job needs at least one pserver".into()),
        Ok(count) => Ok(count),
        Err(_) => Err(format!("ps_desired is {text:?}, not a pserver count")),
    }
}

/// A wanted pserver count a job of `shards` shards can use: 1 to `shards`.
fn check_count(count: u32, shards: u32) -> Result<(), String> {
    if count == 0 {
        return Err("a job needs at least one pserver, not 0".into());
    }
    if count > shards {
        return Err(format!(
            "{count} pservers for {shards} shards: a pserver holds whole shards, so at most {shards} can \
             serve (the shard count is fixed when the job starts)"
        ));
    }
    Ok(())
}

fn sorted<'a>(names: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut names: Vec<String> = names.cloned().collect();
    names.sort();
    names
}

/// Which of the replicas that answered (`(pserver, shard, role, applied)`)
/// may take over their shard, with their applied updates: the caught-up
/// followers, and a shard's followers due to sync only when it has no
/// caught-up one. Either holds every update the old primary acknowledged
/// (an acknowledgement waits for every follower in the map, synced or
/// not), so passing over the second kind would restore the shard from its
/// checkpoint and lose what came after it; a caught-up follower is
/// preferred as the one more surely current.
fn takeover_candidates(answered: &[(String, u32, ReplicaRole, u64)]) -> HashMap<(u32, String), u64> {
    let caught_up: HashSet<u32> = answered
        .iter()
        .filter(|(_, _, role, _)| *role == ReplicaRole::Follower)
        .map(|(_, s, _, _)| *s)
        .collect();
    answered
        .iter()
        .filter(|(_, shard, role, _)| match role {
            ReplicaRole::Follower => true,
            ReplicaRole::DueToSync => !caught_up.contains(shard),
            ReplicaRole::Primary | ReplicaRole::Syncing => false,
        })
        .map(|(p, shard, _, at)| ((*shard, p.clone()), *at))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(p: &str, shard: u32, role: ReplicaRole, applied: u64) -> (String, u32, ReplicaRole, u64) {
        (p.to_string(), shard, role, applied)
    }

    #[test]
    fn a_follower_due_to_sync_takes_over_only_a_shard_without_a_caught_up_one() {
        let answered = [
            // Shard 0: one of each; the caught-up follower is the candidate.
            answer("a", 0, ReplicaRole::Follower, 10),
            answer("b", 0, ReplicaRole::DueToSync, 12),
            // Shard 1: only a follower due to sync is left; it holds every
            // acknowledged update and must not be passed over.
            answer("c", 1, ReplicaRole::DueToSync, 7),
            answer("d", 1, ReplicaRole::Syncing, 0),
            // Shard 2: nothing that holds the shard.
            answer("e", 2, ReplicaRole::Syncing, 0),
        ];
        let got = takeover_candidates(&answered);
        let want: HashMap<(u32, String), u64> =
            [((0, "a".to_string()), 10), ((1, "c".to_string()), 7)].into_iter().collect();
        assert_eq!(got, want);
    }
}
