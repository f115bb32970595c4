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
//!   primary) is a version of the map, at most the current one.

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
        let map = ShardMap { version: 1, replicas, shards: sets, epochs: vec![1; shards as usize] };
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
        let mut next = self.clone();
        let set = next.set_mut(shard)?;
        let at = set.iter().position(|p| p == pserver).ok_or_else(|| {
            Error::Config(format!("{pserver} holds no replica of shard {shard}: it cannot be its primary"))
        })?;
        if at == 0 {
            return Ok(None);
        }
        let promoted = set.remove(at);
        set.insert(0, promoted);
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

    /// The next change toward a balanced map over the pservers `live`
    /// (each holding `S·R/P` replicas, ±1), or `None` once balanced. One
    /// change per call, each a move step that never leaves a shard with
    /// fewer than its replicas:
    ///
    /// 1. a shard with an extra replica (a move under way) whose replicas
    ///    have all caught up (`caught_up`) drops the one on the most loaded
    ///    pserver, preferring a follower; if that is the primary, the
    ///    newest replica becomes primary first;
    /// 2. else, with no move under way, a shard of the most loaded pserver
    ///    that the least loaded one does not hold gets a replica there (it
    ///    catches up), preferring a shard the loaded one only follows (so
    ///    that no primary has to switch).
    ///
    /// One move at a time: loads are counted on a map with no move half
    /// done, so a replica never moves twice.
    ///
    /// Only replicas on loaded pservers move, and only to pservers below
    /// the mean: adding one pserver to P moves about `S·R/(P+1)` replicas,
    /// all to it. Pservers in the map but not in `live` are left alone
    /// (their shards are the failover's, [`without`](Self::without)).
    pub fn rebalance(
        &self,
        live: &[PserverId],
        caught_up: impl Fn(u32, &str) -> bool,
    ) -> Result<Option<ShardMap>> {
        let replicas = self.replicas as usize;
        let load = |p: &str| self.shards.iter().filter(|set| set.iter().any(|q| q == p)).count();
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
            // The most loaded holder leaves (among equals a follower); if it
            // is the primary, the newest other replica takes over first.
            let leaving = set
                .iter()
                .enumerate()
                .max_by_key(|(at, p)| (load(p), *at > 0, std::cmp::Reverse(*at)))
                .map(|(_, p)| p.clone());
            let Some(leaving) = leaving else { continue };
            if set[0] != leaving {
                return self.without_follower(shard, &leaving).map(Some);
            }
            let Some(next) = set.iter().rev().find(|p| **p != leaving) else { continue };
            return self.with_primary(shard, next);
        }
        if under_way > 0 {
            return Ok(None);
        }
        // 2. Start a move from the most loaded live pserver to the least.
        let mut by_load: Vec<(usize, &PserverId)> = live.iter().map(|p| (load(p), p)).collect();
        by_load.sort();
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

/// First bytes of an encoded [`ShardMap`].
const MAGIC: &[u8; 4] = b"OARS";
/// The encoding's format number, after the magic.
const FORMAT: u8 = 1;

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
    fn bad_bytes_are_errors_that_say_why() {
        let map = ShardMap::initial(3, 1, &ids(2)).unwrap();
        assert_eq!(ShardMap::decode(&map.encode()).unwrap(), map);
        let twice = ShardMap { shards: vec![vec!["a".into(), "a".into()]], epochs: vec![1], ..map.clone() };
        let future = ShardMap { epochs: vec![1, 2, 1], ..map.clone() };
        for (bytes, why) in [
            (b"nope".to_vec(), "expected magic"),
            (b"OARS".to_vec(), "truncated"),
            (b"OARS\x07".to_vec(), "unsupported format 7"),
            (b"OARS\x01\xff".to_vec(), "corrupt body"),
            (twice.encode(), "lists a twice"),
            (future.encode(), "shard 1's primary epoch 2 is not a version from 1 to the map's 1"),
        ] {
            let err = ShardMap::decode(&bytes).unwrap_err().to_string();
            assert!(err.contains(why), "{err:?} should say {why:?}");
        }
    }
}
