//! What a process knows of a job's pservers: the [`ShardMap`] and every
//! registered pserver's address, followed as they change ([`TopologyWatch`]).
//! Pservers, their clients and the coordinator all look shards up here.
//!
//! Discovery stays the source of truth: the watch only makes the re-reads
//! prompt (a change under the map key or the registrations wakes them), and
//! a re-read happens at least every [`REREAD`] anyway.

use crate::{
    error::{ServiceError, ServiceResult},
    service::PserverKeys,
    PserverId, ShardMap,
};
use oar_discovery::{member_name, ChangeSignal, Discovery};
use std::{collections::HashMap, sync::Arc, time::Duration};
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

/// The longest between two reads of the map and the registrations.
pub const REREAD: Duration = Duration::from_secs(1);

/// The shard map and the pservers' addresses at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Topology {
    /// The shard map, once the coordinator wrote one.
    pub map: Option<Arc<ShardMap>>,
    /// Why the value under the map's key could not be decoded, if it could
    /// not (`map` is then `None`). Not "no map yet": the coordinator must
    /// not write a first map over it, since pservers still serving the
    /// last good map would keep it and two maps would be served at once.
    pub unreadable_map: Option<String>,
    /// Every registered pserver's address, by name.
    pub addrs: HashMap<PserverId, String>,
    /// Each registered pserver's registration revision (its incarnation).
    pub registered: HashMap<PserverId, i64>,
}

impl Topology {
    /// The map's version (0: no map yet).
    pub fn version(&self) -> u64 {
        self.map.as_ref().map_or(0, |m| m.version())
    }

    /// The address of shard `shard`'s primary, if it has one that is registered.
    pub fn primary_addr(&self, shard: u32) -> Option<(&str, &str)> {
        let map = self.map.as_ref()?;
        let name = map.primary(shard)?;
        self.addrs.get(name).map(|addr| (name, addr.as_str()))
    }
}

/// Follows a job's [`Topology`]. Dropping it stops following.
pub struct TopologyWatch {
    rx: watch::Receiver<Arc<Topology>>,
    _task: Arc<AbortOnDropHandle<()>>,
}

impl Clone for TopologyWatch {
    fn clone(&self) -> Self {
        TopologyWatch { rx: self.rx.clone(), _task: self._task.clone() }
    }
}

impl TopologyWatch {
    /// Read the topology under `keys` and follow it.
    pub async fn start(discovery: Arc<dyn Discovery>, keys: &PserverKeys) -> ServiceResult<TopologyWatch> {
        if keys.shard_map.is_empty() || keys.pservers.is_empty() {
            return Err(ServiceError::Config(format!(
                "pserver keys must name the shard map and the pservers: {keys:?}"
            )));
        }
        // Signals first, so that no change between them and the read is missed.
        let map_signal = ChangeSignal::new(&*discovery, &keys.shard_map).await;
        let pservers_signal = ChangeSignal::new(&*discovery, &keys.pservers).await;
        let first = read(&*discovery, keys).await?;
        let (tx, rx) = watch::channel(Arc::new(first));
        let keys = keys.clone();
        let task = tokio::spawn(follow(discovery, keys, tx, map_signal, pservers_signal));
        Ok(TopologyWatch { rx, _task: Arc::new(AbortOnDropHandle::new(task)) })
    }

    /// The topology now.
    pub fn current(&self) -> Arc<Topology> {
        self.rx.borrow().clone()
    }

    /// A receiver that sees every change from now on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Topology>> {
        // A clone has seen what `self.rx` has seen, which is the first
        // topology: without this, its `changed` would return at once.
        let mut rx = self.rx.clone();
        rx.mark_unchanged();
        rx
    }

    /// Wait until `name` no longer serves shard `shard`: its registration
    /// is gone (it died or left), or the map names another primary. A call
    /// under way to it is then abandoned and retried where the map says.
    pub async fn until_moved(&self, shard: u32, name: &str) {
        let mut rx = self.rx.clone();
        let moved = |t: &Arc<Topology>| {
            !t.addrs.contains_key(name) || t.map.as_ref().and_then(|m| m.primary(shard)) != Some(name)
        };
        if rx.wait_for(moved).await.is_err() {
            // No one follows the topology any more: nothing will move.
            std::future::pending::<()>().await
        }
    }

    /// Wait until the map's version is above `version`, at most `max`;
    /// the topology then (or now, on time out).
    pub async fn newer_than(&self, version: u64, max: Duration) -> Arc<Topology> {
        let mut rx = self.rx.clone();
        let wait = async move { rx.wait_for(|t| t.version() > version).await.map(|t| t.clone()) };
        match tokio::time::timeout(max, wait).await {
            Ok(Ok(topology)) => topology,
            _ => self.current(),
        }
    }
}

async fn follow(
    discovery: Arc<dyn Discovery>,
    keys: PserverKeys,
    tx: watch::Sender<Arc<Topology>>,
    mut map_signal: ChangeSignal,
    mut pservers_signal: ChangeSignal,
) {
    loop {
        tokio::select! {
            _ = map_signal.wait(REREAD) => {}
            _ = pservers_signal.wait(REREAD) => {}
        }
        match read(&*discovery, &keys).await {
            Ok(topology) => {
                tx.send_if_modified(|current| {
                    // A map never goes back: an older one read late is ignored.
                    let older = topology.version() < current.version();
                    let changed = !older && **current != topology;
                    if changed {
                        *current = Arc::new(topology);
                    }
                    changed
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the shard map or the pservers; retrying"),
        }
        if tx.is_closed() {
            return;
        }
    }
}

pub(crate) async fn read(discovery: &dyn Discovery, keys: &PserverKeys) -> ServiceResult<Topology> {
    let (map, unreadable_map) = match discovery.get(&keys.shard_map).await? {
        None => (None, None),
        Some(kv) => match ShardMap::decode(&kv.value) {
            Ok(map) => (Some(Arc::new(map)), None),
            Err(e) => {
                tracing::error!(key = keys.shard_map, error = %e, "the shard map is unreadable; ignored");
                (None, Some(e.to_string()))
            }
        },
    };
    let listing = discovery.get_prefix(&keys.pservers).await?;
    let (mut addrs, mut registered) = (HashMap::new(), HashMap::new());
    for kv in listing.kvs {
        let Some(name) = member_name(&keys.pservers, &kv.key) else { continue };
        let Ok(addr) = String::from_utf8(kv.value) else { continue };
        registered.insert(name.to_string(), kv.create_revision);
        addrs.insert(name.to_string(), addr);
    }
    Ok(Topology { map, unreadable_map, addrs, registered })
}
