//! Property test of replication as a whole, without I/O: one shard's
//! primary ([`Links`] over a store), its followers, catch-ups from
//! snapshots, and shard map changes (a pserver dies and the most advanced
//! follower takes over, a follower is added or dropped, the primary is
//! switched), with every pserver learning each new map when the event
//! sequence says, so deposed primaries go on for a while.
//!
//! Whatever happens: an update a primary could acknowledge (its
//! [`Links::replicated`] covered it) is held by every later primary; every
//! follower holds exactly, bit for bit, the state some primary had after
//! the updates it applied; and once everything is delivered, every replica
//! holds what the primary holds.

use std::collections::HashMap;

use oar_pserver::replica::{
    snapshot_parts, CatchUp, Follower, History, Links, SnapshotPart, SyncFrom, Update,
};
use oar_pserver::{
    BlockId, Error, Grad, Init, Mode, ParamSpec, ParamStore, Placement, Push, PushOutcome, ShardMap,
    SplitMix64,
};
use proptest::prelude::*;

use crate::frozen;
use frozen::Frozen;

const TRAINERS: [&str; 2] = ["a", "b"];
const NODES: usize = 4;
const SHARD: u32 = 0;

fn name(n: usize) -> String {
    format!("p{n}")
}

#[derive(Clone, Debug)]
enum Event {
    /// A part of `trainer`'s push to a pserver that believes it is primary.
    Push {
        pick: usize,
        trainer: usize,
        fresh: bool,
        seed: u64,
    },
    Join {
        pick: usize,
        trainer: usize,
    },
    Leave {
        pick: usize,
        trainer: usize,
    },
    /// Pserver `node` learns the next version of the shard map.
    Learn {
        node: usize,
    },
    /// Pserver `node` asks its primary to sync.
    Sync {
        node: usize,
    },
    /// A primary forwards up to `max` updates to follower `node`.
    Deliver {
        node: usize,
        pick: usize,
        max: usize,
    },
    /// A snapshot part reaches catching-up `node`.
    Part {
        node: usize,
        pick: usize,
    },
    /// Catching-up `node` finishes if it can.
    Finish {
        node: usize,
    },
    /// Pserver `node` dies; the most advanced follower takes over.
    Kill {
        node: usize,
    },
    /// A live pserver outside the replica set becomes a follower.
    Add {
        node: usize,
    },
    /// The coordinator makes follower `node` primary.
    Switch {
        node: usize,
    },
    /// The coordinator drops follower `node`.
    Drop {
        node: usize,
    },
}

fn event() -> impl Strategy<Value = Event> {
    let n = 0..NODES;
    let t = 0..TRAINERS.len();
    prop_oneof![
        10 => (any::<usize>(), t.clone(), any::<bool>(), any::<u64>())
            .prop_map(|(pick, trainer, fresh, seed)| Event::Push { pick, trainer, fresh, seed }),
        1 => (any::<usize>(), t.clone()).prop_map(|(pick, trainer)| Event::Join { pick, trainer }),
        1 => (any::<usize>(), t).prop_map(|(pick, trainer)| Event::Leave { pick, trainer }),
        8 => n.clone().prop_map(|node| Event::Learn { node }),
        4 => n.clone().prop_map(|node| Event::Sync { node }),
        12 => (n.clone(), any::<usize>(), 1usize..4).prop_map(|(node, pick, max)| Event::Deliver { node, pick, max }),
        6 => (n.clone(), any::<usize>()).prop_map(|(node, pick)| Event::Part { node, pick }),
        4 => n.clone().prop_map(|node| Event::Finish { node }),
        2 => n.clone().prop_map(|node| Event::Kill { node }),
        1 => n.clone().prop_map(|node| Event::Add { node }),
        1 => n.clone().prop_map(|node| Event::Switch { node }),
        1 => n.prop_map(|node| Event::Drop { node }),
    ]
}

/// The epoch update `n` came from, per `history`; 0 for update 0 (the
/// state before any update, the same for every replica here).
fn epoch_of(history: &History, n: u64) -> u64 {
    history.epochs().iter().rev().find(|&&(_, first)| first <= n).map_or(0, |&(e, _)| e)
}

enum State {
    Empty,
    Primary { store: ParamStore, links: Links },
    Follower(Follower),
    CatchingUp { catch_up: CatchUp, parts: Vec<SnapshotPart> },
}

struct Node {
    state: State,
    /// The newest map version it learned.
    known: u64,
    alive: bool,
}

struct Sim {
    mode: Mode,
    placement: Placement,
    held: Vec<(BlockId, usize)>,
    /// Map version `v` is `maps[v - 1]`.
    maps: Vec<ShardMap>,
    nodes: Vec<Node>,
    /// The state of epoch `e`'s primary after its update `n`, at `(e, n)`.
    states: HashMap<(u64, u64), Frozen>,
    /// Updates a primary could acknowledge: `(epoch, update)`.
    acked: Vec<(u64, u64)>,
    /// Updates applied but not yet covered: `(node, epoch, update)`.
    pending: Vec<(usize, u64, u64)>,
    seqs: [u64; TRAINERS.len()],
}

fn fail(e: Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

impl Sim {
    fn new(mode: Mode, replicas: u32, block_size: usize) -> Sim {
        let specs: Vec<ParamSpec> = [5usize, 3]
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec::new(format!("p{i}"), vec![n], Init::Normal { mean: 0.0, std: 1.0 }))
            .collect();
        let placement = Placement::new(&specs, 1, block_size).unwrap();
        let held = placement.blocks_on(SHARD).map(|b| (b.id, b.len)).collect();
        let names: Vec<String> = (0..replicas as usize).map(name).collect();
        let map = ShardMap::initial(1, replicas, &names).unwrap();
        let mut sim = Sim {
            mode,
            placement,
            held,
            maps: vec![map],
            nodes: (0..NODES).map(|_| Node { state: State::Empty, known: 0, alive: true }).collect(),
            states: HashMap::new(),
            acked: Vec::new(),
            pending: Vec::new(),
            seqs: [0; TRAINERS.len()],
        };
        // The first primary starts fresh at update 0 of epoch 1; everyone
        // knows the first map.
        let store = sim.fresh_store(5);
        sim.states.insert((0, 0), frozen::replica(&store));
        sim.nodes[0].state = State::Primary { store, links: Links::new(SHARD, 1, 0, History::default()) };
        for n in 0..NODES {
            sim.nodes[n].known = 1;
            sim.reconcile(n).unwrap();
        }
        // The first followers catch up before anything happens.
        for n in 1..NODES {
            sim.sync(n).unwrap();
            while let State::CatchingUp { catch_up, parts } = &mut sim.nodes[n].state {
                let Some(part) = parts.pop() else { break };
                catch_up.part(part).unwrap();
            }
            sim.finish(n).unwrap();
        }
        sim
    }

    fn fresh_store(&self, seed: u64) -> ParamStore {
        let mut store = ParamStore::new(&self.placement, SHARD, seed, frozen::adam(), self.mode).unwrap();
        store.record_steps();
        store
    }

    fn latest(&self) -> &ShardMap {
        &self.maps[self.maps.len() - 1]
    }

    fn map_of(&self, node: usize) -> &ShardMap {
        &self.maps[self.nodes[node].known as usize - 1]
    }

    fn push_map(&mut self, map: ShardMap) {
        assert_eq!(map.version(), self.latest().version() + 1);
        self.maps.push(map);
    }

    fn canonical(&self, history: &History, n: u64) -> Result<&frozen::Frozen, TestCaseError> {
        let epoch = epoch_of(history, n);
        self.states
            .get(&(epoch, n))
            .ok_or_else(|| TestCaseError::fail(format!("no primary state for update {n} of epoch {epoch}")))
    }

    /// Node `n` acts on the map it knows now.
    fn reconcile(&mut self, n: usize) -> Result<(), TestCaseError> {
        let me = name(n);
        let map = self.map_of(n).clone();
        let known = self.nodes[n].known;
        let state = std::mem::replace(&mut self.nodes[n].state, State::Empty);
        self.nodes[n].state = match (map.role(SHARD, &me), state) {
            (None, _) => State::Empty,
            (Some(oar_pserver::Role::Primary), State::Follower(f)) => {
                let epoch = map.epoch(SHARD);
                let (store, applied, history) = f.promote(epoch);
                // Every acknowledged update is held by the new primary.
                for &(e, seq) in &self.acked {
                    prop_assert!(
                        applied >= seq && epoch_of(&history, seq) == e,
                        "{} takes over at update {} ({:?}) without acknowledged update {} of epoch {}",
                        me,
                        applied,
                        history,
                        seq,
                        e
                    );
                }
                prop_assert_eq!(&frozen::replica(&store), self.canonical(&history, applied)?);
                let mut links = Links::new(SHARD, epoch, applied, history);
                links.set_followers(map.replica_set(SHARD)[1..].iter().map(String::as_str));
                State::Primary { store, links }
            }
            (Some(oar_pserver::Role::Primary), State::Primary { store, mut links }) => {
                prop_assert_eq!(links.epoch(), map.epoch(SHARD), "{} stays primary in the same epoch", me);
                links.set_followers(map.replica_set(SHARD)[1..].iter().map(String::as_str));
                State::Primary { store, links }
            }
            (Some(oar_pserver::Role::Primary), _) => {
                return Err(TestCaseError::fail(format!("{me} made primary without a caught-up replica")))
            }
            // Deposed: what it applied since the new primary took over (a
            // sync step's blocks updated so far, say) is nobody's: it drops
            // its store and catches up.
            (Some(oar_pserver::Role::Follower), State::Primary { .. }) => State::Empty,
            (Some(oar_pserver::Role::Follower), State::Follower(mut f)) => {
                f.saw_map(known);
                State::Follower(f)
            }
            (Some(oar_pserver::Role::Follower), State::CatchingUp { catch_up, parts }) => {
                // From a primary no longer primary: start again.
                match catch_up.epoch() == map.epoch(SHARD) {
                    true => State::CatchingUp { catch_up, parts },
                    false => State::Empty,
                }
            }
            (Some(oar_pserver::Role::Follower), State::Empty) => State::Empty,
        };
        Ok(())
    }

    /// The live pservers that believe they are primary.
    fn primaries(&self) -> Vec<usize> {
        (0..NODES)
            .filter(|&n| self.nodes[n].alive && matches!(self.nodes[n].state, State::Primary { .. }))
            .collect()
    }

    /// Record what primary `p` applied: update `links.record(..)`.
    fn record(&mut self, p: usize, update: Update) -> Result<(), TestCaseError> {
        let known = self.nodes[p].known;
        let mode = self.mode;
        let State::Primary { store, links } = &mut self.nodes[p].state else { return Ok(()) };
        let sync_membership = mode == Mode::Sync && matches!(update, Update::Join(_) | Update::Leave(_));
        let seq = links.record(known, update);
        let epoch = links.epoch();
        let state = match sync_membership {
            // Sync, a join or leave changes no value the followers hold.
            true => {
                let history = links.history().clone();
                self.canonical(&history, seq - 1)?.clone()
            }
            false => frozen::replica(store),
        };
        self.states.insert((epoch, seq), state);
        self.pending.push((p, epoch, seq));
        Ok(())
    }

    fn record_steps(&mut self, p: usize) -> Result<(), TestCaseError> {
        let State::Primary { store, .. } = &mut self.nodes[p].state else { return Ok(()) };
        for step in store.take_completed_steps() {
            self.record(p, Update::Step(step))?;
        }
        Ok(())
    }

    fn push(&mut self, pick: usize, trainer: usize, fresh: bool, seed: u64) -> Result<(), TestCaseError> {
        let primaries = self.primaries();
        let Some(&p) = primaries.get(pick % primaries.len().max(1)) else { return Ok(()) };
        let State::Primary { store, .. } = &mut self.nodes[p].state else { return Ok(()) };
        let mut rng = SplitMix64::new(seed);
        let start = match rng.next_u64() % 2 {
            0 => 0,
            _ => (rng.next_u64() % self.held.len() as u64) as usize,
        };
        let grads: Vec<(BlockId, Grad)> = self.held[start..]
            .iter()
            .map(|&(id, n)| (id, Grad::Floats((0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect())))
            .collect();
        let step = store.step();
        let seq = match self.mode {
            Mode::Sync => self.seqs[trainer].max(step + 1),
            Mode::Async => self.seqs[trainer] + u64::from(fresh || self.seqs[trainer] == 0),
        };
        self.seqs[trainer] = seq;
        let push = Push {
            trainer: TRAINERS[trainer].into(),
            seq,
            step,
            weight: 1.0,
            grads,
            rows: Vec::new(),
            origin: None,
        };
        let outcome = store.push(push.clone());
        match (self.mode, outcome) {
            (Mode::Async, Ok(PushOutcome::Applied { .. })) => self.record(p, Update::Push(push)),
            (Mode::Sync, _) => self.record_steps(p),
            _ => Ok(()),
        }
    }

    fn membership(&mut self, pick: usize, trainer: usize, join: bool) -> Result<(), TestCaseError> {
        let primaries = self.primaries();
        let Some(&p) = primaries.get(pick % primaries.len().max(1)) else { return Ok(()) };
        let State::Primary { store, .. } = &mut self.nodes[p].state else { return Ok(()) };
        let who = TRAINERS[trainer].to_string();
        if join {
            store.join(&who);
            self.record(p, Update::Join(who))
        } else {
            // A leave may complete a sync step: the step goes first.
            store.leave(&who);
            self.record_steps(p)?;
            self.record(p, Update::Leave(who))
        }
    }

    /// Follower `f` asks the primary of the map it knows to sync.
    fn sync(&mut self, f: usize) -> Result<(), TestCaseError> {
        let me = name(f);
        let map = self.map_of(f).clone();
        if !self.nodes[f].alive || map.role(SHARD, &me) != Some(oar_pserver::Role::Follower) {
            return Ok(());
        }
        let (epoch, applied) = match &self.nodes[f].state {
            State::Follower(fw) if fw.history().last_epoch() == map.epoch(SHARD) => return Ok(()),
            State::Follower(fw) => (fw.history().last_epoch(), fw.applied()),
            State::Empty => (0, 0),
            State::CatchingUp { .. } | State::Primary { .. } => return Ok(()),
        };
        let Some(p) = map.primary(SHARD).and_then(|p| (0..NODES).find(|&n| name(n) == p)) else {
            return Ok(());
        };
        if !self.nodes[p].alive || self.nodes[p].known != self.nodes[f].known {
            return Ok(()); // The primary refuses: it has not seen this map (or is dead).
        }
        let fresh = self.fresh_store(77);
        let known = self.nodes[f].known;
        let State::Primary { store, links } = &mut self.nodes[p].state else { return Ok(()) };
        // A snapshot is taken only when needed, and the link is left as
        // it is when none can be taken now (a sync step underway): the
        // follower asks again. A push in parts half taken is in it, with
        // the parts that came, as the service takes it.
        let snapshot = match links.can_resume(&me, epoch, applied) {
            true => None,
            false => match store.catch_up_snapshot() {
                Ok(snapshot) => Some(snapshot),
                Err(Error::CheckpointStepUnderway { .. }) => return Ok(()),
                Err(e) => return Err(fail(e)),
            },
        };
        let reply = links.sync(&me, epoch, applied).map_err(fail)?;
        let next = match (reply, snapshot) {
            (SyncFrom::Resume { applied: from }, None) => {
                prop_assert_eq!(from, applied);
                let epoch_now = links.epoch();
                let State::Follower(mut fw) = std::mem::replace(&mut self.nodes[f].state, State::Empty)
                else {
                    return Err(TestCaseError::fail("resumed a replica without state"));
                };
                fw.resume(epoch_now);
                State::Follower(fw)
            }
            (SyncFrom::Snapshot { upto, history }, Some(snapshot)) => {
                let parts = snapshot_parts(&snapshot, SHARD, known, upto, 7);
                let catch_up = CatchUp::new(SHARD, known, upto, history, fresh);
                State::CatchingUp { catch_up, parts }
            }
            (reply, _) => {
                return Err(TestCaseError::fail(format!("can_resume disagrees with sync: {reply:?}")))
            }
        };
        self.nodes[f].state = next;
        Ok(())
    }

    /// A primary that has `f` among its links forwards it up to `max`
    /// updates, under the map it knows; `f` takes them only under the
    /// same map version (older: a deposed primary; newer: not seen yet).
    fn deliver(&mut self, f: usize, pick: usize, max: usize) -> Result<(), TestCaseError> {
        let me = name(f);
        let senders: Vec<usize> = self
            .primaries()
            .into_iter()
            .filter(|&p| match &self.nodes[p].state {
                State::Primary { links, .. } => links.followers().any(|x| x == me),
                _ => false,
            })
            .collect();
        let Some(&p) = senders.get(pick % senders.len().max(1)) else { return Ok(()) };
        if !self.nodes[f].alive {
            return Ok(());
        }
        let stamp = self.nodes[p].known;
        let batch = match &self.nodes[p].state {
            State::Primary { links, .. } => links.batch(&me, max),
            _ => return Ok(()),
        };
        let same_map = stamp == self.nodes[f].known;
        let (mut taken, mut applied, mut refused) = (None, None, false);
        for forwarded in batch {
            let forwarded = oar_pserver::replica::Forwarded { map_version: stamp, ..(*forwarded).clone() };
            let seq = forwarded.seq;
            let ok = same_map
                && match &mut self.nodes[f].state {
                    State::Follower(fw) => {
                        let ok = fw.apply(forwarded).is_ok();
                        applied = Some(fw.applied());
                        ok
                    }
                    State::CatchingUp { catch_up, .. } => catch_up.forwarded(forwarded).is_ok(),
                    _ => false,
                };
            if !ok {
                refused = true;
                break;
            }
            taken = Some(seq);
        }
        let State::Primary { links, .. } = &mut self.nodes[p].state else { return Ok(()) };
        if let Some(taken) = taken {
            links.taken(&me, taken, applied);
        }
        if refused {
            links.rewind(&me);
        }
        Ok(())
    }

    fn finish(&mut self, f: usize) -> Result<(), TestCaseError> {
        let State::CatchingUp { catch_up, .. } = &self.nodes[f].state else { return Ok(()) };
        if catch_up.waiting_for().is_some() {
            return Ok(());
        }
        let State::CatchingUp { catch_up, .. } = std::mem::replace(&mut self.nodes[f].state, State::Empty)
        else {
            return Ok(());
        };
        let follower = catch_up.finish().map_err(fail)?;
        let applied = follower.applied();
        let epoch = follower.history().last_epoch();
        self.nodes[f].state = State::Follower(follower);
        // It tells its primary what it holds.
        let me = name(f);
        for p in self.primaries() {
            if let State::Primary { links, .. } = &mut self.nodes[p].state {
                if links.epoch() == epoch {
                    links.taken(&me, applied, Some(applied));
                }
            }
        }
        Ok(())
    }

    /// Pserver `n` dies; the coordinator (which sees every pserver's real
    /// state) replaces it. Only while the shard keeps a caught-up replica.
    fn kill(&mut self, n: usize) -> Result<(), TestCaseError> {
        let me = name(n);
        if !self.nodes[n].alive || self.latest().role(SHARD, &me).is_none() {
            return Ok(());
        }
        // Candidates: caught-up followers that know the current map (so
        // they are followers in it, not of an older one). A follower that
        // has not synced with the current primary yet still holds every
        // update it acknowledged.
        let latest = self.latest().version();
        let applied: HashMap<String, u64> = (0..NODES)
            .filter(|&q| q != n && self.nodes[q].alive && self.nodes[q].known == latest)
            .filter_map(|q| match &self.nodes[q].state {
                State::Follower(fw) => Some((name(q), fw.applied())),
                _ => None,
            })
            .collect();
        let Some(next) = self.latest().without(&me, |_, q| applied.get(q).copied()) else { return Ok(()) };
        if next.replica_set(SHARD).is_empty() {
            return Ok(()); // That would lose the shard: not this test's subject.
        }
        self.nodes[n].alive = false;
        self.push_map(next);
        Ok(())
    }

    fn change(&mut self, ev: &Event) -> Result<(), TestCaseError> {
        let map = self.latest().clone();
        let next = match *ev {
            Event::Add { node } => {
                if !self.nodes[node].alive || map.role(SHARD, &name(node)).is_some() {
                    return Ok(());
                }
                map.with_follower(SHARD, &name(node)).ok()
            }
            Event::Switch { node } => {
                let caught_up = matches!(self.nodes[node].state, State::Follower(_));
                if !self.nodes[node].alive || !caught_up || self.nodes[node].known != map.version() {
                    return Ok(());
                }
                // Only a follower synced with the current primary may take over.
                let State::Follower(fw) = &self.nodes[node].state else { return Ok(()) };
                if fw.history().last_epoch() != map.epoch(SHARD) {
                    return Ok(());
                }
                map.with_primary(SHARD, &name(node)).ok().flatten()
            }
            Event::Drop { node } => map.without_follower(SHARD, &name(node)).ok(),
            _ => None,
        };
        if let Some(next) = next {
            self.push_map(next);
        }
        Ok(())
    }

    fn learn(&mut self, n: usize) -> Result<(), TestCaseError> {
        if !self.nodes[n].alive || self.nodes[n].known == self.latest().version() {
            return Ok(());
        }
        self.nodes[n].known += 1;
        self.reconcile(n)
    }

    /// Acknowledge what is covered; forget what a deposed primary applied.
    fn acknowledge(&mut self) {
        let nodes = &self.nodes;
        let mut acked = Vec::new();
        self.pending.retain(|&(p, epoch, seq)| match &nodes[p].state {
            State::Primary { links, .. } if nodes[p].alive && links.epoch() == epoch => {
                if links.replicated() >= seq {
                    acked.push((epoch, seq));
                    false
                } else {
                    true
                }
            }
            _ => false,
        });
        self.acked.extend(acked);
    }

    fn check(&self) -> Result<(), TestCaseError> {
        for (n, node) in self.nodes.iter().enumerate() {
            if let (true, State::Follower(fw)) = (node.alive, &node.state) {
                let want = self.canonical(fw.history(), fw.applied())?;
                prop_assert_eq!(&frozen::replica(fw.store()), want, "{} holds what a primary held", name(n));
            }
        }
        Ok(())
    }

    fn event(&mut self, ev: Event) -> Result<(), TestCaseError> {
        match ev {
            Event::Push { pick, trainer, fresh, seed } => self.push(pick, trainer, fresh, seed)?,
            Event::Join { pick, trainer } => self.membership(pick, trainer, true)?,
            Event::Leave { pick, trainer } => self.membership(pick, trainer, false)?,
            Event::Learn { node } => self.learn(node)?,
            Event::Sync { node } => self.sync(node)?,
            Event::Deliver { node, pick, max } => self.deliver(node, pick, max)?,
            Event::Part { node, pick } => {
                if let State::CatchingUp { catch_up, parts } = &mut self.nodes[node].state {
                    if !parts.is_empty() {
                        let part = parts.remove(pick % parts.len());
                        catch_up.part(part).map_err(fail)?;
                    }
                }
            }
            Event::Finish { node } => self.finish(node)?,
            Event::Kill { node } => self.kill(node)?,
            ref change @ (Event::Add { .. } | Event::Switch { .. } | Event::Drop { .. }) => {
                self.change(change)?
            }
        }
        self.acknowledge();
        self.check()
    }

    /// Everyone learns the last map and everything is delivered.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        // Everyone learns the last map; then the trainers leave: no sync step
        // stays underway and no push half taken (as when a trainer's
        // registration goes: the primary then sees it leave).
        for n in 0..NODES {
            while self.nodes[n].alive && self.nodes[n].known < self.latest().version() {
                self.event(Event::Learn { node: n })?;
            }
        }
        for pick in 0..NODES {
            for trainer in 0..TRAINERS.len() {
                self.event(Event::Leave { pick, trainer })?;
            }
        }
        for _round in 0..20 {
            for n in 0..NODES {
                while self.nodes[n].alive && self.nodes[n].known < self.latest().version() {
                    self.event(Event::Learn { node: n })?;
                }
            }
            for n in 0..NODES {
                self.event(Event::Sync { node: n })?;
                for pick in 0..8 {
                    self.event(Event::Part { node: n, pick })?;
                }
                self.event(Event::Finish { node: n })?;
                for _ in 0..4 {
                    self.event(Event::Deliver { node: n, pick: 0, max: 64 })?;
                }
            }
        }
        let primaries = self.primaries();
        prop_assert_eq!(primaries.len(), 1, "one primary once everyone knows the map");
        let p = primaries[0];
        let State::Primary { store, links } = &self.nodes[p].state else { unreachable!() };
        let primary = name(p);
        prop_assert_eq!(Some(primary.as_str()), self.latest().primary(SHARD));
        prop_assert_eq!(links.replicated(), links.seq(), "every follower holds every update");
        prop_assert!(self.pending.is_empty(), "unacknowledged: {:?}", self.pending);
        for f in &self.latest().replica_set(SHARD)[1..] {
            let n = (0..NODES).find(|&n| name(n) == *f).unwrap();
            let State::Follower(fw) = &self.nodes[n].state else {
                return Err(TestCaseError::fail(format!("{f} has not caught up")));
            };
            prop_assert_eq!(fw.applied(), links.seq());
            if !store.step_underway() {
                prop_assert_eq!(
                    frozen::replica(fw.store()),
                    frozen::replica(store),
                    "{} holds what the primary holds",
                    f
                );
            }
            // Every trainer has left, so no push waits in a step: a follower
            // knows every push the primary took (sync: from the steps'
            // seqs), and would answer a retry of any of them as a duplicate.
            let seqs = |st: &ParamStore| {
                let mut seqs: Vec<(String, u64)> = st.last_seqs().map(|(t, s)| (t.to_string(), s)).collect();
                seqs.sort();
                seqs
            };
            prop_assert_eq!(seqs(fw.store()), seqs(store), "{} deduplicates as the primary does", f);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn no_acknowledged_update_is_lost_and_replicas_converge(
        sync in any::<bool>(),
        replicas in 2u32..4,
        block_size in 1usize..4,
        events in prop::collection::vec(event(), 1..160),
    ) {
        let mode = if sync { Mode::Sync } else { Mode::Async };
        let mut sim = Sim::new(mode, replicas, block_size);
        for ev in events {
            sim.event(ev)?;
        }
        sim.settle()?;
    }
}
