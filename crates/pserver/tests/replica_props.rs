//! Property test of replication's core over random event sequences: a
//! primary takes pushes (and, sync, completes steps) and numbers what it
//! applies; followers get those updates late, twice, or through a catch-up
//! from a snapshot whose parts come in any order; bad updates and parts
//! come in between. Whatever the order, a replica that has applied update
//! `n` holds exactly, bit for bit, what the primary held after update `n`,
//! and a bad input is refused and changes nothing.

use oar_pserver::replica::{
    snapshot_parts, Applied, CatchUp, Follower, Forwarded, History, SnapshotPart, Update,
};
use oar_pserver::{
    BlockId, Error, Grad, Init, Mode, ParamSpec, ParamStore, Placement, Push, PushOutcome, SplitMix64,
};
use proptest::prelude::*;

use crate::frozen;

const TRAINERS: [&str; 3] = ["a", "b", "c"];
const REPLICAS: usize = 3;
const SHARD: u32 = 0;
/// The epoch of the one primary here.
const EPOCH: u64 = 1;

#[derive(Clone, Debug)]
enum Event {
    /// A part of `trainer`'s push: a run of blocks (from `seed`); async
    /// pushes start a new seq when `fresh`; `retry` sends the last one again.
    Push {
        trainer: usize,
        fresh: bool,
        retry: bool,
        seed: u64,
    },
    Join(usize),
    Leave(usize),
    /// The primary serves under a newer shard map from now on.
    NewMap,
    /// Replica `r` (absent) starts catching up from a snapshot cut into
    /// parts of at most `max_floats` values.
    CatchUp {
        r: usize,
        max_floats: usize,
    },
    /// One of replica `r`'s snapshot parts arrives (kept for later too if `again`).
    Part {
        r: usize,
        pick: usize,
        again: bool,
    },
    /// The next update forwarded to replica `r` arrives.
    Deliver {
        r: usize,
    },
    /// An update replica `r` was sent already arrives again.
    Redeliver {
        r: usize,
        pick: usize,
    },
    /// Replica `r`'s catch-up is asked if it can finish, and finishes if
    /// so; if not and `force`, it is made to and must fail.
    Finish {
        r: usize,
        force: bool,
    },
    /// Something wrong arrives at replica `r`.
    Bad {
        r: usize,
        kind: u8,
        pick: usize,
    },
}

fn event() -> impl Strategy<Value = Event> {
    let r = 0..REPLICAS;
    prop_oneof![
        8 => (0..TRAINERS.len(), any::<bool>(), prop::bool::weighted(0.15), any::<u64>())
            .prop_map(|(trainer, fresh, retry, seed)| Event::Push { trainer, fresh, retry, seed }),
        1 => (0..TRAINERS.len()).prop_map(Event::Join),
        1 => (0..TRAINERS.len()).prop_map(Event::Leave),
        1 => Just(Event::NewMap),
        2 => (r.clone(), 1usize..40).prop_map(|(r, max_floats)| Event::CatchUp { r, max_floats }),
        4 => (r.clone(), any::<usize>(), prop::bool::weighted(0.2))
            .prop_map(|(r, pick, again)| Event::Part { r, pick, again }),
        8 => r.clone().prop_map(|r| Event::Deliver { r }),
        2 => (r.clone(), any::<usize>()).prop_map(|(r, pick)| Event::Redeliver { r, pick }),
        2 => (r.clone(), prop::bool::weighted(0.2)).prop_map(|(r, force)| Event::Finish { r, force }),
        2 => (r, 0u8..6, any::<usize>()).prop_map(|(r, kind, pick)| Event::Bad { r, kind, pick }),
    ]
}

enum Replica {
    Absent,
    CatchingUp {
        catch_up: CatchUp,
        /// Parts not yet delivered, and parts delivered (to send again, or to spoil).
        parts: Vec<SnapshotPart>,
        delivered: Vec<SnapshotPart>,
        /// Index in the log of the next update to deliver.
        next: usize,
    },
    Following {
        follower: Follower,
        next: usize,
    },
}

struct Job {
    mode: Mode,
    placement: Placement,
    held: Vec<(BlockId, usize)>,
    primary: ParamStore,
    map_version: u64,
    /// Every update the primary applied: update `n` is `log[n - 1]`.
    log: Vec<Forwarded>,
    /// The primary's state after `n` updates is `history[n]`.
    history: Vec<frozen::Frozen>,
    seqs: [u64; TRAINERS.len()],
    last_push: [Option<Push>; TRAINERS.len()],
    /// New pushes carry an origin (most of the time).
    origins: bool,
    /// Sync: the step of each trainer's last part, and the block after it.
    next_block: [(u64, usize); TRAINERS.len()],
    replicas: Vec<Replica>,
}

impl Job {
    fn new(mode: Mode, block_size: usize) -> Job {
        let specs: Vec<ParamSpec> = [7usize, 5, 3]
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec::new(format!("p{i}"), vec![n], Init::Normal { mean: 0.0, std: 1.0 }))
            .collect();
        let placement = Placement::new(&specs, 1, block_size).unwrap();
        let held = placement.blocks_on(SHARD).map(|b| (b.id, b.len)).collect();
        let mut primary = ParamStore::new(&placement, SHARD, 5, frozen::adam(), mode).unwrap();
        primary.record_steps();
        for t in TRAINERS {
            primary.join(t);
        }
        // Replicas that follow from the start begin with the same store.
        let replicas = (0..REPLICAS)
            .map(|r| match r {
                0 => Replica::Following {
                    follower: Follower::new(
                        SHARD,
                        1,
                        0,
                        History::starting(EPOCH, 1),
                        ParamStore::new(&placement, SHARD, 5, frozen::adam(), mode).unwrap(),
                    ),
                    next: 0,
                },
                _ => Replica::Absent,
            })
            .collect();
        let history = vec![frozen::replica(&primary)];
        Job {
            mode,
            placement,
            held,
            primary,
            map_version: 1,
            log: Vec::new(),
            history,
            seqs: [0; TRAINERS.len()],
            last_push: Default::default(),
            origins: true,
            next_block: Default::default(),
            replicas,
        }
    }

    /// Number and keep what the primary did.
    fn record(&mut self, update: Update) {
        let seq = self.log.len() as u64 + 1;
        // Sync, a join or leave changes no value (mid-step, the primary's
        // partly updated blocks are its own until the step completes).
        let state = match (&update, self.mode) {
            (Update::Join(_) | Update::Leave(_), Mode::Sync) => self.history[self.history.len() - 1].clone(),
            _ => frozen::replica(&self.primary),
        };
        self.log.push(Forwarded { shard: SHARD, map_version: self.map_version, epoch: EPOCH, seq, update });
        self.history.push(state);
    }

    fn record_steps(&mut self) -> Result<(), TestCaseError> {
        let steps = self.primary.take_completed_steps();
        prop_assert!(steps.len() <= 1, "one event completes one step at most");
        prop_assert!(self.mode == Mode::Sync || steps.is_empty());
        for step in steps {
            prop_assert_eq!(step.step + 1, self.primary.step());
            self.record(Update::Step(step));
        }
        Ok(())
    }

    fn push(&mut self, trainer: usize, fresh: bool, retry: bool, seed: u64) -> Result<(), TestCaseError> {
        let push = match (&self.last_push[trainer], retry) {
            (Some(last), true) => last.clone(),
            _ => {
                let mut rng = SplitMix64::new(seed);
                let held = &self.held;
                // Sync: the run after the trainer's last part of this
                // step, so that steps complete. Async: half the time from
                // the first block, so that pushes are whole often. Half
                // the time to the last block, half a shorter run.
                let step = self.primary.step();
                let start = match self.next_block[trainer] {
                    (s, next) if self.mode == Mode::Sync && s == step && next < held.len() => next,
                    _ if self.mode == Mode::Async && rng.next_u64() % 2 == 0 => 0,
                    _ => (rng.next_u64() % held.len() as u64) as usize,
                };
                let len = match rng.next_u64() % 2 {
                    0 => held.len() - start,
                    _ => 1 + (rng.next_u64() % (held.len() - start) as u64) as usize,
                };
                self.next_block[trainer] = (step, start + len);
                let grads: Vec<(BlockId, Grad)> = held[start..start + len]
                    .iter()
                    .map(|&(id, n)| (id, Grad::Floats((0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect())))
                    .collect();
                let step = self.primary.step();
                let seq = match self.mode {
                    // Sync: one seq per step.
                    Mode::Sync => step + 1,
                    Mode::Async => {
                        self.seqs[trainer] += u64::from(fresh);
                        self.seqs[trainer].max(1)
                    }
                };
                self.seqs[trainer] = seq;
                Push {
                    trainer: TRAINERS[trainer].into(),
                    seq,
                    step,
                    weight: 1.0 + trainer as f32,
                    grads,
                    rows: Vec::new(),
                    origin: if self.origins { frozen::origin(&mut rng) } else { None },
                }
            }
        };
        self.last_push[trainer] = Some(push.clone());
        let outcome = self.primary.push(push.clone());
        match (self.mode, outcome) {
            (Mode::Async, Ok(PushOutcome::Applied { .. } | PushOutcome::AppliedBefore)) => {
                self.record(Update::Push(push))
            }
            (Mode::Async, Ok(PushOutcome::Buffered { .. })) => {
                return Err(TestCaseError::fail("an async store buffered a push"))
            }
            (Mode::Async, Ok(PushOutcome::Duplicate) | Err(_)) => {
                prop_assert_eq!(self.primary.take_completed_steps(), vec![]);
            }
            (Mode::Sync, _) => self.record_steps()?,
        }
        Ok(())
    }

    /// Deliver update `log[index]` to replica `r`, sent now: under the map
    /// the primary serves under now.
    fn deliver(&mut self, r: usize, index: usize) -> Result<(), TestCaseError> {
        let update = Forwarded { map_version: self.map_version, ..self.log[index].clone() };
        match &mut self.replicas[r] {
            Replica::Absent => {}
            Replica::CatchingUp { catch_up, .. } => catch_up.forwarded(update).map_err(fail)?,
            Replica::Following { follower, .. } => {
                let before = follower.applied();
                let got = follower.apply(update).map_err(fail)?;
                let expect = if (index as u64) < before { Applied::Duplicate } else { Applied::Applied };
                prop_assert_eq!(got, expect);
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        for (r, replica) in self.replicas.iter().enumerate() {
            if let Replica::Following { follower, next } = replica {
                prop_assert_eq!(follower.applied(), *next as u64, "replica {}", r);
                prop_assert_eq!(
                    &frozen::replica(follower.store()),
                    &self.history[*next],
                    "replica {} holds what the primary held after update {}",
                    r,
                    next
                );
            }
        }
        Ok(())
    }

    fn event(&mut self, ev: Event) -> Result<(), TestCaseError> {
        match ev {
            Event::Push { trainer, fresh, retry, seed } => self.push(trainer, fresh, retry, seed)?,
            Event::Join(t) => {
                self.primary.join(TRAINERS[t]);
                self.record(Update::Join(TRAINERS[t].into()));
            }
            Event::Leave(t) => {
                // A leave may complete a sync step: the step goes first.
                self.primary.leave(TRAINERS[t]);
                self.record_steps()?;
                self.record(Update::Leave(TRAINERS[t].into()));
            }
            Event::NewMap => self.map_version += 1,
            Event::CatchUp { r, max_floats } => {
                if !matches!(self.replicas[r], Replica::Absent) {
                    return Ok(());
                }
                // A catch-up snapshot: a push in parts may be half taken
                // (its other parts then come as forwarded updates).
                let snapshot = match self.primary.catch_up_snapshot() {
                    Ok(snapshot) => snapshot,
                    Err(Error::CheckpointStepUnderway { .. }) => return Ok(()),
                    Err(e) => return Err(fail(e)),
                };
                let upto = self.log.len() as u64;
                let parts = snapshot_parts(&snapshot, SHARD, self.map_version, upto, max_floats);
                for p in &parts {
                    let floats: usize = p.blocks.iter().map(|(_, v, s)| v.len() + s.slots.len()).sum();
                    prop_assert!(
                        floats <= max_floats || p.blocks.len() == 1,
                        "a part holds {} floats",
                        floats
                    );
                }
                // A fresh store, initialised differently: what it ends with
                // comes from the snapshot and the updates, not from its seed.
                let store =
                    ParamStore::new(&self.placement, SHARD, 77, frozen::adam(), self.mode).map_err(fail)?;
                let catch_up =
                    CatchUp::new(SHARD, self.map_version, upto, History::starting(EPOCH, 1), store);
                self.replicas[r] =
                    Replica::CatchingUp { catch_up, parts, delivered: Vec::new(), next: upto as usize };
            }
            Event::Part { r, pick, again } => {
                if let Replica::CatchingUp { catch_up, parts, delivered, .. } = &mut self.replicas[r] {
                    if !parts.is_empty() {
                        let part = if again {
                            parts[pick % parts.len()].clone()
                        } else {
                            parts.remove(pick % parts.len())
                        };
                        catch_up.part(part.clone()).map_err(fail)?;
                        delivered.push(part);
                    }
                }
            }
            Event::Deliver { r } => {
                let next = match &mut self.replicas[r] {
                    Replica::CatchingUp { next, .. } | Replica::Following { next, .. }
                        if *next < self.log.len() =>
                    {
                        *next += 1;
                        *next - 1
                    }
                    _ => return Ok(()),
                };
                self.deliver(r, next)?;
            }
            Event::Redeliver { r, pick } => {
                if let Replica::CatchingUp { next, .. } | Replica::Following { next, .. } = self.replicas[r] {
                    if next > 0 {
                        self.deliver(r, pick % next)?;
                    }
                }
            }
            Event::Finish { r, force } => {
                let Replica::CatchingUp { catch_up, .. } = &self.replicas[r] else { return Ok(()) };
                if catch_up.waiting_for().is_some() && !force {
                    return Ok(());
                }
                let Replica::CatchingUp { catch_up, delivered, next, .. } =
                    std::mem::replace(&mut self.replicas[r], Replica::Absent)
                else {
                    return Ok(());
                };
                let came: std::collections::BTreeSet<BlockId> =
                    delivered.iter().flat_map(|p| p.blocks.iter().map(|b| b.0)).collect();
                prop_assert_eq!(catch_up.missing(), self.held.len() - came.len());
                // Updates arrive in order here, so only missing blocks keep it waiting.
                let blocks_missing = catch_up.missing() > 0;
                prop_assert_eq!(blocks_missing, catch_up.waiting_for().is_some());
                if blocks_missing {
                    prop_assert!(catch_up.finish().is_err());
                    // Start again later: the replica is dropped.
                } else {
                    let follower = catch_up.finish().map_err(fail)?;
                    self.replicas[r] = Replica::Following { follower, next };
                }
            }
            Event::Bad { r, kind, pick } => self.bad(r, kind, pick)?,
        }
        self.check()
    }

    /// Something wrong for replica `r`: refused, and nothing changes.
    fn bad(&mut self, r: usize, kind: u8, pick: usize) -> Result<(), TestCaseError> {
        let mode = self.mode;
        let log = &self.log;
        match &mut self.replicas[r] {
            Replica::Absent => {}
            Replica::Following { follower, next } => {
                let before = (frozen::replica(follower.store()), follower.applied(), follower.map_version());
                let Some(good) = log.get(*next).or(log.last()).cloned() else { return Ok(()) };
                let mut bad =
                    Forwarded { seq: *next as u64 + 1, map_version: follower.map_version(), ..good };
                let what = match kind {
                    0 => {
                        bad.shard = SHARD + 1;
                        "shard"
                    }
                    1 if follower.map_version() > 0 => {
                        bad.map_version = follower.map_version() - 1;
                        "older than"
                    }
                    2 => {
                        bad.seq += 1 + (pick % 3) as u64;
                        "gap"
                    }
                    3 => {
                        bad.epoch = EPOCH + 1 + (pick % 2) as u64;
                        "epoch"
                    }
                    _ => {
                        // A gradient of the wrong length for the update due.
                        let (id, len) = self.held[pick % self.held.len()];
                        bad.update = match mode {
                            Mode::Async => Update::Push(Push {
                                trainer: "z".into(),
                                seq: 1,
                                step: 0,
                                weight: 1.0,
                                grads: vec![(id, Grad::Floats(vec![0.5; len + 1]))],
                                rows: Vec::new(),
                                origin: None,
                            }),
                            Mode::Sync => Update::Step(oar_pserver::CompletedStep {
                                step: follower.store().step(),
                                grads: vec![(id, vec![0.5; len + 1])],
                                seqs: Vec::new(),
                                rows: Vec::new(),
                                origins: Vec::new(),
                            }),
                        };
                        "length"
                    }
                };
                let err = match follower.apply(bad) {
                    Err(e) => e.to_string(),
                    Ok(a) => return Err(TestCaseError::fail(format!("a bad update ({what}) was {a:?}"))),
                };
                if what != "length" {
                    prop_assert!(err.contains(what), "{} does not say {}", err, what);
                }
                let after = (frozen::replica(follower.store()), follower.applied(), follower.map_version());
                prop_assert_eq!(before, after, "a refused update changed the replica");
            }
            Replica::CatchingUp { catch_up, delivered, next, .. } => {
                if kind == 5 {
                    // A deposed primary's update (every map is 1 or newer).
                    let Some(good) = log.get(*next).or(log.last()).cloned() else { return Ok(()) };
                    let err = catch_up.forwarded(Forwarded { map_version: 0, ..good });
                    prop_assert!(matches!(&err, Err(e) if e.to_string().contains("older than")), "{:?}", err);
                    return Ok(());
                }
                if delivered.is_empty() {
                    return Ok(());
                }
                let missing = catch_up.missing();
                // Spoil a part already delivered, so that the good one does
                // not come again to repair what a half-taken bad one did.
                let mut part = delivered[pick % delivered.len()].clone();
                let what = match kind % 3 {
                    0 => {
                        part.upto += 1;
                        "does not belong"
                    }
                    1 => {
                        part.step += 1;
                        "disagree"
                    }
                    _ => {
                        for (_, params, _) in &mut part.blocks {
                            params.iter_mut().for_each(|x| *x += 1.0);
                        }
                        let Some((_, params, _)) = part.blocks.last_mut() else { return Ok(()) };
                        params.push(0.0);
                        "values"
                    }
                };
                match catch_up.part(part) {
                    Err(e) => prop_assert!(e.to_string().contains(what), "{} does not say {}", e, what),
                    Ok(()) => return Err(TestCaseError::fail(format!("a bad part ({what}) was taken"))),
                }
                prop_assert_eq!(catch_up.missing(), missing);
            }
        }
        Ok(())
    }

    /// Deliver everything still on its way, finish the catch-ups, and
    /// check every replica holds what the primary holds.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        for r in 0..REPLICAS {
            self.settle_parts(r)?;
            loop {
                match &mut self.replicas[r] {
                    Replica::CatchingUp { next, .. } | Replica::Following { next, .. }
                        if *next < self.log.len() =>
                    {
                        *next += 1;
                        let index = *next - 1;
                        self.deliver(r, index)?;
                    }
                    _ => break,
                }
            }
            if matches!(self.replicas[r], Replica::Absent) {
                self.event(Event::CatchUp { r, max_floats: 7 })?;
                self.settle_parts(r)?;
            }
            self.event(Event::Finish { r, force: true })?;
            if let Replica::Following { follower, .. } = &self.replicas[r] {
                prop_assert_eq!(follower.applied(), self.log.len() as u64);
                prop_assert_eq!(Some(&frozen::replica(follower.store())), self.history.last());
            }
        }
        // Sync, a step underway is the primary's alone until it completes.
        if !self.primary.step_underway() {
            prop_assert_eq!(Some(&frozen::replica(&self.primary)), self.history.last());
        }
        prop_assert!(matches!(self.replicas[0], Replica::Following { .. }), "replica 0 follows throughout");
        Ok(())
    }

    fn settle_parts(&mut self, r: usize) -> Result<(), TestCaseError> {
        if let Replica::CatchingUp { catch_up, parts, delivered, .. } = &mut self.replicas[r] {
            for part in parts.drain(..) {
                catch_up.part(part.clone()).map_err(fail)?;
                delivered.push(part);
            }
        }
        Ok(())
    }

    /// Async: replica 0 becomes primary. A push retried to it is taken
    /// once, and a new one is applied as the old primary would have.
    fn fail_over(mut self) -> Result<(), TestCaseError> {
        let Replica::Following { follower, .. } = std::mem::replace(&mut self.replicas[0], Replica::Absent)
        else {
            return Err(TestCaseError::fail("replica 0 does not follow"));
        };
        let (mut promoted, _, _) = follower.promote(EPOCH + 1);
        // The new pushes below must apply: no origin that may be applied before.
        self.origins = false;
        for t in 0..TRAINERS.len() {
            if let Some(push) = self.last_push[t].clone() {
                let on_old = format!("{:?}", self.primary.push(push.clone()));
                prop_assert_eq!(format!("{:?}", promoted.push(push)), on_old);
            }
            self.push(t, true, false, 1000 + t as u64)?;
            let push = self.last_push[t].clone().unwrap();
            prop_assert_eq!(
                promoted.push(push).map_err(fail)?,
                PushOutcome::Applied { step: self.primary.step() }
            );
            prop_assert_eq!(frozen::replica(&promoted), frozen::replica(&self.primary));
        }
        Ok(())
    }
}

fn fail(e: Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn replicas_hold_what_the_primary_held_whatever_the_order(
        sync in any::<bool>(),
        block_size in 1usize..6,
        events in prop::collection::vec(event(), 1..120),
    ) {
        let mode = if sync { Mode::Sync } else { Mode::Async };
        let mut job = Job::new(mode, block_size);
        for ev in events {
            job.event(ev)?;
        }
        job.settle()?;
        if mode == Mode::Async {
            job.fail_over()?;
        }
    }
}
