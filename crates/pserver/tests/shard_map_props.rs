//! Property tests of the shard map over random sequences of changes: what
//! each change must do to the replica sets, and what every map keeps.

use oar_pserver::{Health, Role, ShardMap};
use proptest::prelude::*;

const PSERVERS: usize = 6;

fn id(i: usize) -> String {
    format!("ps-{i}")
}

#[derive(Clone, Debug)]
enum Change {
    /// Pserver `p` dies; replicas report the applied sequences `seed` gives.
    Gone {
        p: usize,
        seed: u64,
    },
    AddFollower {
        shard: u32,
        p: usize,
    },
    MakePrimary {
        shard: u32,
        p: usize,
    },
    DropFollower {
        shard: u32,
        p: usize,
    },
    /// A shard without replicas is given to `p`, from its checkpoint.
    Restore {
        shard: u32,
        p: usize,
    },
}

fn change(shards: u32) -> impl Strategy<Value = Change> {
    let p = 0..PSERVERS;
    prop_oneof![
        (p.clone(), any::<u64>()).prop_map(|(p, seed)| Change::Gone { p, seed }),
        (0..shards, p.clone()).prop_map(|(shard, p)| Change::AddFollower { shard, p }),
        (0..shards, p.clone()).prop_map(|(shard, p)| Change::MakePrimary { shard, p }),
        (0..shards, p.clone()).prop_map(|(shard, p)| Change::DropFollower { shard, p }),
        (0..shards, p).prop_map(|(shard, p)| Change::Restore { shard, p }),
    ]
}

/// The applied sequence a replica reports, from a seed: few distinct values,
/// so that ties happen, and `None` (cannot take over) now and then.
fn applied(seed: u64, shard: u32, p: &str) -> Option<u64> {
    let h = seed ^ u64::from(shard).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (p.len() as u64 * 31);
    let last = p.bytes().last().unwrap_or(0) as u64;
    let v = (h.rotate_left(last as u32 % 64)) % 4;
    (v < 3).then_some(v)
}

fn sorted(set: &[String]) -> Vec<String> {
    let mut v = set.to_vec();
    v.sort();
    v
}

/// What every map keeps, and what its queries agree on.
fn check(map: &ShardMap) -> Result<(), TestCaseError> {
    prop_assert!(map.validate().is_ok(), "{:?}", map.validate());
    for s in 0..map.shard_count() {
        prop_assert!((1..=map.version()).contains(&map.epoch(s)));
        for (r, p) in map.replica_set(s).iter().enumerate() {
            let want = if r == 0 { Role::Primary } else { Role::Follower };
            prop_assert_eq!(map.role(s, p), Some(want));
        }
    }
    prop_assert_eq!(ShardMap::decode(&map.encode()).unwrap(), map.clone());
    let (mut under, mut none) = (Vec::new(), Vec::new());
    for s in 0..map.shard_count() {
        let set = map.replica_set(s);
        prop_assert_eq!(map.primary(s), set.first().map(String::as_str));
        match set.len() {
            0 => none.push(s),
            n if n < map.replicas() as usize => under.push(s),
            _ => {}
        }
    }
    let health = if under.is_empty() && none.is_empty() {
        Health::Ok
    } else {
        Health::Unhealthy { under_replicated: under, unavailable: none }
    };
    prop_assert_eq!(map.health(), health);
    for p in (0..PSERVERS).map(id) {
        for (s, role) in map.shards_of(&p) {
            let at = map.replica_set(s).iter().position(|q| *q == p);
            prop_assert_eq!(at.map(|i| i == 0), Some(role == Role::Primary));
        }
        let holds = (0..map.shard_count()).filter(|&s| map.replica_set(s).contains(&p)).count();
        prop_assert_eq!(map.shards_of(&p).len(), holds);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_change_does_what_it_says_and_keeps_the_rules(
        shards in 1u32..12,
        replicas in 1u32..4,
        changes in prop::collection::vec(change(12), 0..40),
    ) {
        let pservers: Vec<String> = (0..PSERVERS).map(id).collect();
        let mut map = ShardMap::initial(shards, replicas, &pservers).unwrap();
        check(&map)?;
        for c in changes {
            let before = map.clone();
            let next = match c {
                Change::Gone { p, seed } => {
                    let gone = id(p);
                    let next = before.without(&gone, |s, q| applied(seed, s, q));
                    let held = !before.shards_of(&gone).is_empty();
                    prop_assert_eq!(next.is_some(), held, "a change iff it held a shard");
                    if let Some(next) = &next {
                        prop_assert!(next.shards_of(&gone).is_empty());
                        for s in 0..shards {
                            let (old, new) = (before.replica_set(s), next.replica_set(s));
                            let rest: Vec<String> = old.iter().filter(|q| **q != gone).cloned().collect();
                            let emptied = new.is_empty() && before.primary(s) == Some(gone.as_str());
                            if !emptied {
                                prop_assert_eq!(sorted(new), sorted(&rest), "shard {} keeps the others", s);
                            }
                            if before.primary(s) == Some(gone.as_str()) {
                                let best = rest.iter().filter_map(|q| applied(seed, s, q)).max();
                                match next.primary(s) {
                                    Some(new_primary) => {
                                        prop_assert_eq!(applied(seed, s, new_primary), best, "shard {}: the most advanced", s);
                                        let first_best = rest.iter().find(|q| applied(seed, s, q) == best);
                                        prop_assert_eq!(Some(new_primary), first_best.map(String::as_str), "ties: first listed");
                                    }
                                    None => prop_assert!(best.is_none(), "shard {}: a follower could take over", s),
                                }
                            } else {
                                prop_assert_eq!(new, rest.as_slice(), "shard {}: order kept", s);
                            }
                        }
                    }
                    next
                }
                Change::AddFollower { shard, p } => {
                    let added = before.with_follower(shard, &id(p));
                    let refused = shard >= shards
                        || before.replica_set(shard).contains(&id(p))
                        || before.replica_set(shard).is_empty();
                    prop_assert_eq!(added.is_err(), refused);
                    if let Ok(next) = &added {
                        let mut want = before.replica_set(shard).to_vec();
                        want.push(id(p));
                        prop_assert_eq!(next.replica_set(shard), want.as_slice());
                    }
                    added.ok()
                }
                Change::MakePrimary { shard, p } => match before.with_primary(shard, &id(p)) {
                    Err(_) => {
                        prop_assert!(shard >= shards || !before.replica_set(shard).contains(&id(p)));
                        None
                    }
                    Ok(None) => {
                        prop_assert_eq!(before.primary(shard).map(str::to_string), Some(id(p)));
                        None
                    }
                    Ok(Some(next)) => {
                        let old = before.replica_set(shard);
                        let mut want = vec![id(p)];
                        want.extend(old.iter().filter(|q| **q != id(p)).cloned());
                        prop_assert_eq!(next.replica_set(shard), want.as_slice());
                        Some(next)
                    }
                },
                Change::DropFollower { shard, p } => {
                    let dropped = before.without_follower(shard, &id(p));
                    let at = (shard < shards).then(|| before.replica_set(shard).iter().position(|q| *q == id(p))).flatten();
                    prop_assert_eq!(dropped.is_ok(), at.is_some_and(|i| i > 0), "only a follower can be dropped");
                    if let Ok(next) = &dropped {
                        let want: Vec<String> =
                            before.replica_set(shard).iter().filter(|q| **q != id(p)).cloned().collect();
                        prop_assert_eq!(next.replica_set(shard), want.as_slice());
                    }
                    dropped.ok()
                }
                Change::Restore { shard, p } => {
                    let restored = before.with_restored(shard, &id(p));
                    let empty = shard < shards && before.replica_set(shard).is_empty();
                    prop_assert_eq!(restored.is_ok(), empty, "only a shard without replicas is restored");
                    if let Ok(next) = &restored {
                        let want = [id(p)];
                        prop_assert_eq!(next.replica_set(shard), want.as_slice());
                    }
                    restored.ok()
                }
            };
            match next {
                Some(next) => {
                    prop_assert_eq!(next.version(), before.version() + 1, "one version per change");
                    for s in 0..shards {
                        let touched = next.replica_set(s) != before.replica_set(s);
                        // Only a failure touches more than one shard.
                        let target = match c {
                            Change::Gone { .. } => None,
                            Change::AddFollower { shard, .. }
                            | Change::MakePrimary { shard, .. }
                            | Change::DropFollower { shard, .. }
                            | Change::Restore { shard, .. } => Some(shard),
                        };
                        prop_assert!(!touched || target.is_none_or(|t| t == s), "shard {} changed", s);
                        // A new primary gets a new epoch; nothing else does.
                        let (old, new) = (before.primary(s), next.primary(s));
                        if new.is_some() && new != old {
                            prop_assert_eq!(next.epoch(s), next.version(), "shard {}: a new primary's epoch", s);
                        } else {
                            prop_assert_eq!(next.epoch(s), before.epoch(s), "shard {}: same primary, same epoch", s);
                        }
                    }
                    check(&next)?;
                    map = next;
                }
                None => prop_assert_eq!(&map, &before),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Pservers join a balanced map: rebalancing, one change at a time and
    /// with new replicas catching up at random moments, ends balanced
    /// (every live pserver holds S·R/P replicas, ±1), never leaves a shard
    /// with fewer than R replicas or without its primary, and moves
    /// replicas only to the newcomers: as many as they end up holding.
    #[test]
    fn pservers_that_join_get_their_share_and_nothing_else_moves(
        shards in 4u32..48,
        replicas in 1u32..=3,
        old in 1usize..5,
        new in 1usize..3,
        lag in proptest::collection::vec(any::<bool>(), 64),
    ) {
        let old = old.max(replicas as usize);
        let first: Vec<String> = (0..old).map(id).collect();
        let all: Vec<String> = (0..old + new).map(id).collect();
        let start = ShardMap::initial(shards, replicas, &first).unwrap();
        let mut map = start.clone();
        let mut steps = 0usize;
        loop {
            // Some rounds the new replicas have not caught up yet.
            let waiting = lag[steps % lag.len()];
            let next = map.rebalance(&all, |_, _| !waiting).unwrap();
            steps += 1;
            prop_assert!(steps < 20 * (shards * replicas) as usize + 100, "rebalancing does not end");
            match next {
                Some(next) => {
                    next.validate().unwrap();
                    prop_assert_eq!(next.version(), map.version() + 1);
                    for s in 0..shards {
                        prop_assert!(next.replica_set(s).len() >= replicas as usize, "shard {} lost a replica", s);
                    }
                    map = next;
                }
                None if waiting => continue,
                None => break,
            }
        }
        let load = |p: &str| map.shards_of(p).len();
        let loads: Vec<usize> = all.iter().map(|p| load(p)).collect();
        let (low, high) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
        prop_assert!(high <= low + 1, "unbalanced: {:?}", loads);
        let mut moved = 0;
        for s in 0..shards {
            prop_assert_eq!(map.replica_set(s).len(), replicas as usize);
            for p in map.replica_set(s) {
                if !start.replica_set(s).contains(p) {
                    prop_assert!(!first.contains(p), "shard {} moved to {}, which was there before", s, p);
                    moved += 1;
                }
            }
        }
        let newcomers: usize = all[old..].iter().map(|p| load(p)).sum();
        prop_assert_eq!(moved, newcomers);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A job scales to random pserver counts one after another (out and
    /// in): each time, drain-and-balance steps with replicas catching up at
    /// random moments end with every replica on a kept pserver
    /// ([`ShardMap::wanted`]), each shard with `min(R, kept)` replicas,
    /// the kept pservers balanced (±1), and on the way no shard ever below
    /// `min(R, kept)` replicas or without its primary.
    #[test]
    fn scaling_out_and_in_drains_and_balances_without_losing_a_replica(
        shards in 4u32..40,
        replicas in 1u32..=3,
        first in 1usize..5,
        counts in proptest::collection::vec(1usize..7, 1..4),
        lag in proptest::collection::vec(any::<bool>(), 64),
    ) {
        let first = first.max(replicas as usize);
        let all: Vec<String> = (0..8).map(id).collect();
        let mut map = ShardMap::initial(shards, replicas, &all[..first]).unwrap();
        let mut steps = 0usize;
        for &count in &counts {
            let before = map.clone();
            let wanted = map.wanted(&all, count as u32);
            prop_assert_eq!(wanted.len(), count);
            // Holders are kept first: a scale-out keeps every holder.
            if count >= before.pservers().len() {
                for p in before.pservers() {
                    prop_assert!(wanted.iter().any(|w| w == p), "{} holds shards but is not kept", p);
                }
            }
            let floor = (replicas as usize).min(count);
            loop {
                let waiting = lag[steps % lag.len()];
                steps += 1;
                prop_assert!(steps < 60 * (shards * replicas) as usize + 200, "scaling does not end");
                // As the coordinator does: shards short of replicas first
                // (after a scale below R), then one move.
                let replenished = map.replenished(&wanted).unwrap();
                if replenished != map {
                    replenished.validate().unwrap();
                    map = replenished;
                    continue;
                }
                match map.rebalance(&wanted, |_, _| !waiting).unwrap() {
                    Some(next) => {
                        next.validate().unwrap();
                        prop_assert_eq!(next.version(), map.version() + 1);
                        for s in 0..shards {
                            let set = next.replica_set(s);
                            prop_assert!(set.len() >= floor.min(map.replica_set(s).len()), "shard {} lost a replica:\n{}", s, next);
                            prop_assert!(!set.is_empty(), "shard {} has no primary", s);
                        }
                        map = next;
                    }
                    None if waiting => continue,
                    None => break,
                }
            }
            for s in 0..shards {
                let set = map.replica_set(s);
                prop_assert_eq!(set.len(), floor, "shard {}:\n{}", s, map);
                prop_assert!(set.iter().all(|p| wanted.contains(p)), "shard {} left on a drained pserver:\n{}", s, map);
            }
            let loads: Vec<usize> = wanted.iter().map(|p| map.shards_of(p).len()).collect();
            let (low, high) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
            prop_assert!(high <= low + 1, "unbalanced {:?}:\n{}", loads, map);
        }
    }
}
