//! The shard map: which pservers hold each of a job's `S` logical shards,
//! primary first (`docs/DESIGN.md` §6). The model's blocks are placed on
//! the logical shards ([`Placement`](crate::Placement) with `S` servers), so
//! a shard keeps its blocks whatever pservers come and go; the map says
//! where the shard lives now, and its [`version`](ShardMap::version) rises
//! with every change, so anyone holding an older map knows it.
//!
//! This is the I/O-free core: a value with pure operations. Who may change
//! the map (the master, through its fence), how a pserver catches up before
//! it joins a replica set, and how clients follow versions are the shell's.
//!
//! Rules every map keeps ([`ShardMap::validate`]):
//! - a replica set never names a pserver twice;
//! - a shard may have no replica at all (every holder died): it is
//!   unavailable, and [`ShardMap::health`] says so;
//! - the version only rises, by one per change;
//! - each shard's primary epoch (the version that made its primary
//!   primary) is a version of the map, at most the current one;
//! - a [released](ShardMap::released) pserver holds no replica.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::error::{Error, Result};

/// A pserver's id, as it registers with the job.
pub type PserverId = String;

/// What a pserver is for one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Applies updates, forwards them to the followers, answers clients.
    Primary,
    /// Holds a copy kept up to date by the primary.
    Follower,
}

/// The pservers of each logical shard, primary first, at one version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMap {
    version: u64,
    /// Replicas each shard should have.
    replicas: u32,
    /// Per shard: its replica set, primary first.
    shards: Vec<Vec<PserverId>>,
    /// Per shard: the version of the map that made its primary primary
    /// (the primary's *epoch*): updates it numbers carry it, so a replica
    /// can tell whose updates it holds (see [`crate::replica`]).
    epochs: Vec<u64>,
    /// Pservers drained of every replica and let go: each stops when it
    /// sees its name here (sorted).
    released: Vec<PserverId>,
}

/// Whether every shard has all its replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Every shard has its `replicas` replicas.
    Ok,
    /// Some shards have fewer replicas than wanted, or none.
    Unhealthy {
        /// Shards with fewer replicas than wanted (but at least one).
        under_replicated: Vec<u32>,
        /// Shards with no replica at all: nobody can serve them.
        unavailable: Vec<u32>,
    },
}

impl ShardMap {
    /// The first map of a job: `shards` logical shards with `replicas`
    /// replicas each over `pservers` (in the given order), version 1.
    /// Deterministic and balanced: shard `s` has its primary on pserver
    /// `s mod P` and its followers on the next ones round the ring, so each
    /// pserver is primary of `S/P` shards (±1) and holds `S·R/P` (±1).
    pub fn initial(shards: u32, replicas: u32, pservers: &[PserverId]) -> Result<ShardMap> {
        let p = pservers.len();
        if shards == 0 || replicas == 0 {
            return Err(Error::Config(format!(
                "a shard map needs at least one shard and one replica, got {shards} and {replicas}"
            )));
        }
        if (replicas as usize) > p {
            return Err(Error::Config(format!(
                "{replicas} replicas need at least {replicas} pservers, got {p}"
            )));
        }
        let sets = (0..shards as usize)
            .map(|s| (0..replicas as usize).map(|r| pservers[(s + r) % p].clone()).collect())
            .collect();
        let map = ShardMap {
            version: 1,
            replicas,
            shards: sets,
            epochs: vec![1; shards as usize],
            released: Vec::new(),
        };
        map.validate()?;
        Ok(map)
    }

    /// The map's version: every change raises it by one.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The replicas each shard should have.
    pub fn replicas(&self) -> u32 {
        self.replicas
    }

    /// How many logical shards the job has.
    pub fn shard_count(&self) -> u32 {
        self.shards.len() as u32
    }

    /// Shard `shard`'s replica set, primary first (empty: unavailable).
    pub fn replica_set(&self, shard: u32) -> &[PserverId] {
        self.shards.get(shard as usize).map_or(&[], Vec::as_slice)
    }

    /// Shard `shard`'s primary, if it has any replica.
    pub fn primary(&self, shard: u32) -> Option<&str> {
        self.replica_set(shard).first().map(String::as_str)
    }

    /// The epoch of shard `shard`'s primary: the map version that made it
    /// primary (0 for a shard that does not exist).
    pub fn epoch(&self, shard: u32) -> u64 {
        self.epochs.get(shard as usize).copied().unwrap_or(0)
    }

    /// Shard `shard`'s role for `pserver`, if it holds a replica of it.
    pub fn role(&self, shard: u32, pserver: &str) -> Option<Role> {
        let at = self.replica_set(shard).iter().position(|p| p == pserver)?;
        Some(if at == 0 { Role::Primary } else { Role::Follower })
    }

    /// The shards `pserver` holds, with its role in each, in shard order.
    pub fn shards_of(&self, pserver: &str) -> Vec<(u32, Role)> {
        let role = |r: usize| if r == 0 { Role::Primary } else { Role::Follower };
        self.shards
            .iter()
            .enumerate()
            .filter_map(|(s, set)| set.iter().position(|p| p == pserver).map(|r| (s as u32, role(r))))
            .collect()
    }

    /// Every pserver named in the map, sorted, each once.
    pub fn pservers(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self.shards.iter().flatten().map(String::as_str).collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// The pservers the job let go after draining them (sorted): each
    /// stops serving and leaves when it reads its name here.
    pub fn released(&self) -> &[PserverId] {
        &self.released
    }

    /// Whether `pserver` was [released](Self::released).
    pub fn is_released(&self, pserver: &str) -> bool {
        self.released.iter().any(|p| p == pserver)
    }

    /// The map with `pserver`, which holds no replica, released. Errors if
    /// it still holds one; `None` if it already is released.
    pub fn with_released(&self, pserver: &str) -> Result<Option<ShardMap>> {
        if let Some((shard, _)) = self.shards_of(pserver).first() {
            return Err(Error::Config(format!(
                "{pserver} still holds a replica of shard {shard}: drain it before releasing it"
            )));
        }
        if self.is_released(pserver) {
            return Ok(None);
        }
        let mut next = self.clone();
        let at = next.released.binary_search_by(|p| p.as_str().cmp(pserver)).unwrap_or_else(|at| at);
        next.released.insert(at, pserver.to_string());
        Ok(Some(next.bumped()))
    }

    /// The map with the released pservers that are not in `present` (they
    /// left) forgotten, so the list stays short; `None` if none left.
    pub fn without_released_gone(&self, present: impl Fn(&str) -> bool) -> Option<ShardMap> {
        let mut next = self.clone();
        next.released.retain(|p| present(p));
        (next.released.len() < self.released.len()).then(|| next.bumped())
    }

    /// The map with a follower added to every shard that has a replica but
    /// fewer than it should, each on the kept pserver (of `wanted`) holding
    /// the fewest replicas that has none of the shard (ties to the first
    /// listed); a shard that no kept pserver can take stays short.
    pub fn replenished(&self, wanted: &[PserverId]) -> Result<ShardMap> {
        let mut next = self.clone();
        for shard in 0..next.shard_count() {
            let len = next.replica_set(shard).len();
            if len == 0 || len >= next.replicas as usize {
                continue;
            }
            if let Some(to) = next.least_loaded(wanted, shard) {
                next = next.with_follower(shard, &to)?;
            }
        }
        Ok(next)
    }

    /// The map with every shard that has no replica left given to the kept
    /// pserver (of `wanted`) holding the fewest replicas, which restores it
    /// from its last checkpoint ([`with_restored`](Self::with_restored));
    /// the shards so given, in order.
    pub fn restored(&self, wanted: &[PserverId]) -> Result<(ShardMap, Vec<(u32, PserverId)>)> {
        let (mut next, mut given) = (self.clone(), Vec::new());
        for shard in 0..next.shard_count() {
            if !next.replica_set(shard).is_empty() {
                continue;
            }
            if let Some(to) = next.least_loaded(wanted, shard) {
                next = next.with_restored(shard, &to)?;
                given.push((shard, to));
            }
        }
        Ok((next, given))
    }

    /// The pserver of `wanted` holding the fewest replicas that has none of
    /// `shard` (ties to the first listed).
    fn least_loaded(&self, wanted: &[PserverId], shard: u32) -> Option<PserverId> {
        wanted
            .iter()
            .filter(|p| self.role(shard, p).is_none())
            .min_by_key(|p| self.shards_of(p).len())
            .cloned()
    }

    /// The pservers among `live` that a job of `desired` pservers keeps:
    /// those holding a replica in this map first, then the others, each
    /// group in natural name order (`ps-2` before `ps-10`), the first
    /// `desired` of them. Released pservers are never kept. So a scale-in
    /// drains the highest-numbered pservers (a Kubernetes StatefulSet
    /// removes its highest ordinals), and a scale-out or a failover takes
    /// newcomers in name order.
    pub fn wanted(&self, live: &[PserverId], desired: u32) -> Vec<PserverId> {
        let mut ranked: Vec<&PserverId> = live.iter().filter(|p| !self.is_released(p)).collect();
        ranked.sort_by(|a, b| {
            let holds = |p: &str| self.shards.iter().any(|set| set.iter().any(|q| q == p));
            holds(b).cmp(&holds(a)).then_with(|| natural_cmp(a, b))
        });
        ranked.dedup();
        ranked.into_iter().take(desired as usize).cloned().collect()
    }

    /// OK, or which shards lack replicas.
    pub fn health(&self) -> Health {
        let (mut under_replicated, mut unavailable) = (Vec::new(), Vec::new());
        for (s, set) in self.shards.iter().enumerate() {
            match set.len() {
                0 => unavailable.push(s as u32),
                n if n < self.replicas as usize => under_replicated.push(s as u32),
                _ => {}
            }
        }
        if under_replicated.is_empty() && unavailable.is_empty() {
            Health::Ok
        } else {
            Health::Unhealthy { under_replicated, unavailable }
        }
    }

    /// The map after `gone` left (its lease expired): it leaves every
    /// replica set, and where it was primary, the follower with the highest
    /// `applied` sequence (the shard's, as that replica reports it) becomes
    /// primary; ties go to the replica listed first. `applied` is `None`
    /// for a replica that cannot take over (it is still catching up, or did
    /// not answer): where no follower can, the shard is left with no
    /// replica (unavailable, to be [restored](Self::with_restored)), since a
    /// replica that has not caught up holds nothing to serve. `None` if
    /// `gone` held no shard (nothing changes).
    pub fn without(&self, gone: &str, applied: impl Fn(u32, &str) -> Option<u64>) -> Option<ShardMap> {
        let mut next = self.clone();
        let mut changed = false;
        for (s, set) in next.shards.iter_mut().enumerate() {
            let Some(at) = set.iter().position(|p| p == gone) else { continue };
            changed = true;
            set.remove(at);
            if at == 0 {
                // The most advanced follower: a stable max keeps the first of equals.
                let best = (0..set.len())
                    .rev()
                    .filter_map(|i| applied(s as u32, &set[i]).map(|a| (a, i)))
                    .max_by_key(|&(a, _)| a);
                match best {
                    Some((_, best)) => {
                        let promoted = set.remove(best);
                        set.insert(0, promoted);
                        next.epochs[s] = self.version + 1;
                    }
                    None => set.clear(),
                }
            }
        }
        changed.then(|| next.bumped())
    }

    /// The map with `pserver` added to shard `shard`'s replica set as a
    /// follower: it catches up from the primary. Errors if the shard does
    /// not exist, already lists it, or has no primary to catch up from
    /// (see [`with_restored`](Self::with_restored)).
    pub fn with_follower(&self, shard: u32, pserver: &str) -> Result<ShardMap> {
        let mut next = self.clone();
        let set = next.set_mut(shard)?;
        if set.iter().any(|p| p == pserver) {
            return Err(Error::Config(format!("shard {shard} already has a replica on {pserver}")));
        }
        if set.is_empty() {
            return Err(Error::Config(format!(
                "shard {shard} has no replica for a follower on {pserver} to catch up from: restore it"
            )));
        }
        set.push(pserver.to_string());
        Ok(next.bumped())
    }

    /// The map with `pserver` made shard `shard`'s primary (it must hold a
    /// replica); the old primary stays a follower. `None` if it already is.
    pub fn with_primary(&self, shard: u32, pserver: &str) -> Result<Option<ShardMap>> {
        self.promoted(shard, pserver, false)
    }

    /// The map with shard `shard`'s primary dropped and `successor`, one of
    /// its followers, primary in its place, in one change: a planned
    /// failover. The successor must have caught up (the caller checks):
    /// everything the old primary acknowledged, its followers hold, so
    /// nothing acknowledged is lost, and a push the old primary took but
    /// did not acknowledge is retried on the successor. Doing it in one
    /// change spares the old primary a resynchronisation as a follower it
    /// would be dropped from next.
    pub fn handed_over(&self, shard: u32, successor: &str) -> Result<ShardMap> {
        self.promoted(shard, successor, true)?
            .ok_or_else(|| Error::Config(format!("{successor} is shard {shard}'s primary already")))
    }

    /// `pserver` made shard `shard`'s primary, the old primary kept as a
    /// follower or (`drop_old`) dropped; `None` if it is primary already.
    fn promoted(&self, shard: u32, pserver: &str, drop_old: bool) -> Result<Option<ShardMap>> {
        let mut next = self.clone();
        let set = next.set_mut(shard)?;
        let at = set.iter().position(|p| p == pserver).ok_or_else(|| {
            Error::Config(format!("{pserver} holds no replica of shard {shard}: it cannot be its primary"))
        })?;
        if at == 0 {
            return Ok(None);
        }
        let promoted = set.remove(at);
        match drop_old {
            true => set[0] = promoted,
            false => set.insert(0, promoted),
        }
        next.epochs[shard as usize] = self.version + 1;
        Ok(Some(next.bumped()))
    }

    /// The map with shard `shard`, which has no replica left, given to
    /// `pserver` as its primary: it starts from the shard's last checkpoint.
    /// Errors if the shard does not exist or still has a replica.
    pub fn with_restored(&self, shard: u32, pserver: &str) -> Result<ShardMap> {
        let mut next = self.clone();
        let set = next.set_mut(shard)?;
        if let Some(holder) = set.first() {
            return Err(Error::Config(format!(
                "shard {shard} still has a replica on {holder}: only a shard with none is restored"
            )));
        }
        set.push(pserver.to_string());
        next.epochs[shard as usize] = self.version + 1;
        Ok(next.bumped())
    }

    /// The map with `pserver` dropped from shard `shard`'s replica set (a
    /// replica moved away). Errors if it holds no replica there, or is the
    /// primary (switch the primary first: a shard never loses its primary
    /// by a planned change).
    pub fn without_follower(&self, shard: u32, pserver: &str) -> Result<ShardMap> {
        let mut next = self.clone();
        let set = next.set_mut(shard)?;
        match set.iter().position(|p| p == pserver) {
            None => Err(Error::Config(format!("{pserver} holds no replica of shard {shard}"))),
            Some(0) => Err(Error::Config(format!(
                "{pserver} is shard {shard}'s primary: make another replica primary before dropping it"
            ))),
            Some(at) => {
                set.remove(at);
                Ok(next.bumped())
            }
        }
    }

    /// The next change toward a balanced map over the pservers `wanted`
    /// (each holding `S·R/P` replicas, ±1), or `None` once there. Every
    /// other pserver in the map is **drained**: its replicas move to wanted
    /// pservers. (Call it only when every pserver in the map is alive: a
    /// dead one's shards are the failover's, [`without`](Self::without).)
    /// One change per call, each a move step that never leaves a shard with
    /// fewer than its replicas:
    ///
    /// 1. a shard with an extra replica (a move under way) whose replicas
    ///    have all caught up (`caught_up`) drops one: a drained pserver's
    ///    first, else the one on the most loaded pserver, preferring a
    ///    follower; if that is the primary, the newest wanted replica
    ///    takes over from it in the same change ([`handed_over`](Self::handed_over));
    /// 2. else, with no move under way, a shard held by a drained pserver
    ///    gets a replica on the least loaded wanted pserver that has none
    ///    of it; if every wanted pserver has one (fewer wanted pservers
    ///    than R), the drained replica is dropped instead (handed over to a
    ///    wanted caught-up replica if it is primary): the shard has fewer
    ///    replicas than R until pservers are added;
    /// 3. else a shard of the most loaded wanted pserver that the least
    ///    loaded one does not hold gets a replica there (it catches up),
    ///    preferring a shard the loaded one only follows (so that no
    ///    primary has to switch).
    ///
    /// One move at a time: loads are counted on a map with no move half
    /// done, so a replica never moves twice.
    ///
    /// Only replicas on loaded (or drained) pservers move, and only to
    /// wanted pservers below the mean: adding one pserver to P moves about
    /// `S·R/(P+1)` replicas, all to it; draining one moves its replicas and
    /// nothing else.
    pub fn rebalance(
        &self,
        wanted: &[PserverId],
        caught_up: impl Fn(u32, &str) -> bool,
    ) -> Result<Option<ShardMap>> {
        self.next_move(wanted, caught_up, true)
    }

    /// What [`rebalance`](Self::rebalance) does without its step 3: only
    /// the pservers not `wanted` lose replicas (and the moves under way
    /// finish); the others keep what they hold.
    pub fn drain(
        &self,
        wanted: &[PserverId],
        caught_up: impl Fn(u32, &str) -> bool,
    ) -> Result<Option<ShardMap>> {
        self.next_move(wanted, caught_up, false)
    }

    fn next_move(
        &self,
        wanted: &[PserverId],
        caught_up: impl Fn(u32, &str) -> bool,
        balance: bool,
    ) -> Result<Option<ShardMap>> {
        let replicas = self.replicas as usize;
        let load = |p: &str| self.shards.iter().filter(|set| set.iter().any(|q| q == p)).count();
        let is_wanted = |p: &str| wanted.iter().any(|w| w == p);
        // 1. Finish the moves whose new replica has caught up.
        let mut under_way = 0;
        for (shard, set) in self.shards.iter().enumerate() {
            if set.len() <= replicas {
                continue;
            }
            under_way += 1;
            let shard = shard as u32;
            if !set.iter().all(|p| caught_up(shard, p)) {
                continue;
            }
            // A drained holder leaves first, then the most loaded (among
            // equals a follower); if it is the primary, the newest wanted
            // replica takes over first.
            let leaving = set
                .iter()
                .enumerate()
                .max_by_key(|(at, p)| (!is_wanted(p), load(p), *at > 0, std::cmp::Reverse(*at)))
                .map(|(_, p)| p.clone());
            let Some(leaving) = leaving else { continue };
            if set[0] != leaving {
                return self.without_follower(shard, &leaving).map(Some);
            }
            let next = set.iter().rev().find(|p| **p != leaving && is_wanted(p));
            let Some(next) = next.or_else(|| set.iter().rev().find(|p| **p != leaving)) else { continue };
            return self.handed_over(shard, next).map(Some);
        }
        if under_way > 0 {
            return Ok(None);
        }
        let mut by_load: Vec<(usize, &PserverId)> = wanted.iter().map(|p| (load(p), p)).collect();
        by_load.sort();
        // 2. Drain: a replica on a pserver not wanted goes to the least
        // loaded wanted pserver without one of that shard.
        // Where every wanted pserver holds one already (fewer wanted than
        // R), the shard goes on with fewer replicas: the drained one is
        // dropped, once a wanted one serves as primary.
        for (shard, set) in self.shards.iter().enumerate() {
            let Some(drained) = set.iter().find(|p| !is_wanted(p)) else { continue };
            let shard = shard as u32;
            if let Some((_, to)) = by_load.iter().find(|(_, p)| !set.contains(p)) {
                return self.with_follower(shard, to).map(Some);
            }
            if set[0] != *drained {
                return self.without_follower(shard, drained).map(Some);
            }
            let successor = set.iter().rev().find(|p| is_wanted(p) && caught_up(shard, p));
            if let Some(successor) = successor {
                return self.handed_over(shard, successor).map(Some);
            }
        }
        // 3. Balance: a move from the most loaded wanted pserver to the least.
        if !balance {
            return Ok(None);
        }
        let (Some(&(low, to)), Some(&(high, from))) = (by_load.first(), by_load.last()) else {
            return Ok(None);
        };
        if high <= low + 1 {
            return Ok(None);
        }
        let movable = |set: &Vec<PserverId>| {
            set.len() == replicas && set.iter().any(|p| p == from) && !set.iter().any(|p| p == to)
        };
        let pick = self
            .shards
            .iter()
            .enumerate()
            .filter(|(_, set)| movable(set))
            .min_by_key(|(s, set)| (set[0] == *from, *s))
            .map(|(s, _)| s as u32);
        match pick {
            Some(shard) => self.with_follower(shard, to).map(Some),
            None => Ok(None),
        }
    }

    fn set_mut(&mut self, shard: u32) -> Result<&mut Vec<PserverId>> {
        let count = self.shards.len();
        self.shards
            .get_mut(shard as usize)
            .ok_or_else(|| Error::Config(format!("shard {shard} does not exist: the map has {count} shards")))
    }

    fn bumped(mut self) -> ShardMap {
        self.version += 1;
        self
    }

    /// Checks the rules of the [module docs](self), naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.epochs.len() != self.shards.len() {
            return Err(Error::BadShardMap(format!(
                "{} shards but {} primary epochs",
                self.shards.len(),
                self.epochs.len()
            )));
        }
        if let Some(s) =
            (0..self.shards.len()).find(|&s| self.epochs[s] == 0 || self.epochs[s] > self.version)
        {
            return Err(Error::BadShardMap(format!(
                "shard {s}'s primary epoch {} is not a version from 1 to the map's {}",
                self.epochs[s], self.version
            )));
        }
        if self.shards.is_empty() || self.replicas == 0 || self.version == 0 {
            return Err(Error::BadShardMap(format!(
                "{} shards, {} replicas, version {}: each must be at least 1",
                self.shards.len(),
                self.replicas,
                self.version
            )));
        }
        for (s, set) in self.shards.iter().enumerate() {
            if let Some((i, p)) = set.iter().enumerate().find(|(i, p)| set[..*i].contains(p)) {
                return Err(Error::BadShardMap(format!("shard {s} lists {p} twice (replica {i})")));
            }
            if let Some(p) = set.iter().find(|p| p.is_empty()) {
                return Err(Error::BadShardMap(format!("shard {s} lists an empty pserver id {p:?}")));
            }
            if let Some(p) = set.iter().find(|p| self.is_released(p)) {
                return Err(Error::BadShardMap(format!("shard {s} lists {p}, which was released")));
            }
        }
        Ok(())
    }

    /// The bytes stored in discovery: magic `OARS`, a format number, the
    /// map (postcard).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.shards.len() * 16);
        out.extend_from_slice(MAGIC);
        out.push(FORMAT);
        // A map of strings and integers always encodes.
        postcard::to_extend(self, out).unwrap_or_default()
    }

    /// The map in `bytes`, checked ([`validate`](Self::validate)); errors
    /// say what is wrong with them.
    pub fn decode(bytes: &[u8]) -> Result<ShardMap> {
        let bad = |why: String| Error::BadShardMap(why);
        let body = bytes
            .strip_prefix(MAGIC.as_slice())
            .ok_or_else(|| bad(format!("expected magic {MAGIC:?} ({} bytes)", bytes.len())))?;
        match body.split_first() {
            None => Err(bad("truncated after the magic".into())),
            Some((&FORMAT, rest)) => {
                let (map, extra): (ShardMap, _) =
                    postcard::take_from_bytes(rest).map_err(|e| bad(format!("corrupt body: {e}")))?;
                if !extra.is_empty() {
                    return Err(bad(format!("{} bytes after the map", extra.len())));
                }
                map.validate()?;
                Ok(map)
            }
            Some((format, _)) => Err(bad(format!("unsupported format {format} (this build reads {FORMAT})"))),
        }
    }
}

/// Names compared with their runs of digits as numbers: `ps-2` < `ps-10`.
pub(crate) fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let digits = |s: &[u8]| s.iter().take_while(|c| c.is_ascii_digit()).count();
                let (da, db) = (digits(a), digits(b));
                let trim = |s: &[u8]| {
                    let zeros = s.iter().take_while(|&&c| c == b'0').count();
                    s[zeros.min(s.len().saturating_sub(1))..].to_vec()
                };
                let (na, nb) = (trim(&a[..da]), trim(&b[..db]));
                let order = na.len().cmp(&nb.len()).then_with(|| na.cmp(&nb));
                if order != Ordering::Equal {
                    return order;
                }
                (a, b) = (&a[da..], &b[db..]);
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                (a, b) = (&a[1..], &b[1..]);
            }
        }
    }
}

/// First bytes of an encoded [`ShardMap`].
const MAGIC: &[u8; 4] = b"OARS";
/// The encoding's format number, after the magic.
const FORMAT: u8 = 2;

impl fmt::Display for ShardMap {
    /// One line per shard: `shard 3: ps-1 (primary), ps-2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "shard map version {}, {} replicas per shard", self.version, self.replicas)?;
        for (s, set) in self.shards.iter().enumerate() {
            match set.split_first() {
                None => writeln!(f, "  shard {s}: no replica (unavailable)")?,
                Some((primary, followers)) => {
                    write!(f, "  shard {s}: {primary} (primary)")?;
                    for p in followers {
                        write!(f, ", {p}")?;
                    }
                    writeln!(f)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<PserverId> {
        (0..n).map(|i| format!("ps-{i}")).collect()
    }

    #[test]
    fn the_first_map_is_balanced_and_replicas_are_distinct() {
        let map = ShardMap::initial(64, 2, &ids(3)).unwrap();
        assert_eq!((map.version(), map.shard_count(), map.health()), (1, 64, Health::Ok));
        for p in ids(3) {
            let held = map.shards_of(&p);
            let primaries = held.iter().filter(|(_, r)| *r == Role::Primary).count();
            assert!((21..=22).contains(&primaries), "{p} is primary of {primaries} of 64 shards");
            assert!((42..=43).contains(&held.len()), "{p} holds {} of 128 replicas", held.len());
        }
        assert_eq!(map.replica_set(5), ["ps-2", "ps-0"]);
        let err = ShardMap::initial(8, 3, &ids(2)).unwrap_err().to_string();
        assert!(err.contains("3 replicas need at least 3 pservers"), "{err}");
    }

    #[test]
    fn a_dead_primary_is_replaced_by_its_most_advanced_follower() {
        let map = ShardMap::initial(4, 3, &ids(3)).unwrap();
        assert_eq!(map.replica_set(0), ["ps-0", "ps-1", "ps-2"]);
        // ps-2 has applied more of shard 0 than ps-1.
        let next = map.without("ps-0", |_, p| Some(if p == "ps-2" { 9 } else { 7 })).unwrap();
        assert_eq!(next.version(), 2);
        assert_eq!(next.replica_set(0), ["ps-2", "ps-1"]);
        assert!(next.shards_of("ps-0").is_empty());
        assert_eq!(
            next.health(),
            Health::Unhealthy { under_replicated: vec![0, 1, 2, 3], unavailable: vec![] }
        );
        assert!(next.without("ps-0", |_, _| Some(0)).is_none(), "gone already: no change");
        // No follower that can take over: the shard is left unavailable.
        let next = next.without("ps-2", |_, _| None).unwrap();
        assert_eq!(next.replica_set(0), Vec::<String>::new().as_slice());
        assert_eq!(next.replica_set(1), ["ps-1"]);
    }

    #[test]
    fn scale_in_keeps_the_holders_lowest_numbered_first() {
        let live: Vec<String> = ["ps-10.a", "ps-2.b", "ps-1.c", "ps-3.d"].map(String::from).to_vec();
        let map = ShardMap::initial(6, 1, &["ps-10.a".into(), "ps-3.d".into(), "ps-2.b".into()]).unwrap();
        // Holders first (in natural order), then the newcomer ps-1.
        assert_eq!(map.wanted(&live, 4), ["ps-2.b", "ps-3.d", "ps-10.a", "ps-1.c"]);
        assert_eq!(map.wanted(&live, 2), ["ps-2.b", "ps-3.d"]);
        assert_eq!(natural_cmp("ps-02", "ps-10"), std::cmp::Ordering::Less);
        assert_eq!(natural_cmp("ps-9x", "ps-9y"), std::cmp::Ordering::Less);
    }

    #[test]
    fn a_drained_pserver_is_emptied_then_released() {
        let all = ids(3);
        let mut map = ShardMap::initial(6, 2, &all).unwrap();
        let wanted = &all[..2];
        let mut steps = 0;
        while let Some(next) = map.drain(wanted, |_, _| true).unwrap() {
            for s in 0..6 {
                assert!(next.replica_set(s).len() >= 2, "shard {s} lost a replica: {next}");
            }
            map = next;
            steps += 1;
            assert!(steps < 100, "draining does not end");
        }
        assert!(map.shards_of("ps-2").is_empty(), "{map}");
        assert_eq!(map.health(), Health::Ok);
        let err = ShardMap::initial(2, 1, &ids(1)).unwrap().with_released("ps-0").unwrap_err().to_string();
        assert!(err.contains("still holds a replica of shard 0"), "{err}");
        let released = map.with_released("ps-2").unwrap().unwrap();
        assert!(released.is_released("ps-2") && released.version() == map.version() + 1);
        assert!(released.with_released("ps-2").unwrap().is_none());
        assert_eq!(ShardMap::decode(&released.encode()).unwrap(), released);
        let forgotten = released.without_released_gone(|p| p != "ps-2").unwrap();
        assert!(forgotten.released().is_empty());
        // Fewer wanted than replicas: shards go on with fewer replicas.
        let mut map = ShardMap::initial(4, 2, &all[..2]).unwrap();
        while let Some(next) = map.drain(&all[..1], |_, _| true).unwrap() {
            map = next;
        }
        for s in 0..4 {
            assert_eq!(map.replica_set(s), ["ps-0"]);
        }
    }

    #[test]
    fn bad_bytes_are_errors_that_say_why() {
        let map = ShardMap::initial(3, 1, &ids(2)).unwrap();
        assert_eq!(ShardMap::decode(&map.encode()).unwrap(), map);
        let twice = ShardMap { shards: vec![vec!["a".into(), "a".into()]], epochs: vec![1], ..map.clone() };
        let future = ShardMap { epochs: vec![1, 2, 1], ..map.clone() };
        for (bytes, why) in [
            (b"nope".to_vec(), "expected magic"),
            (b"OARS".to_vec(), "truncated"),
            (b"OARS\x07".to_vec(), "unsupported format 7"),
            (b"OARS\x02\xff".to_vec(), "corrupt body"),
            (twice.encode(), "lists a twice"),
            (future.encode(), "shard 1's primary epoch 2 is not a version from 1 to the map's 1"),
        ] {
            let err = ShardMap::decode(&bytes).unwrap_err().to_string();
            assert!(err.contains(why), "{err:?} should say {why:?}");
        }
    }
}
