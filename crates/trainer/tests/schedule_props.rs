//! Property tests of the exchange schedule (`oar_trainer::schedule`) over
//! random event sequences: a simulated shell with a clock of its own, batches
//! and exchanges of random durations (some of them stalls), tasks of random
//! lengths, drains, all checked against counters the test keeps itself.

use oar_trainer::schedule::{Action, Exchange, Schedule, ScheduleConfig, Want, MAX_PUSHES_DUE};
use proptest::prelude::*;
use std::time::{Duration, Instant};

/// One thing the simulated trainer does.
#[derive(Clone, Debug)]
enum Event {
    /// Train a task of this many batches, each taking `batch_us` (a stall
    /// every `stall_every`-th batch takes `stall_us` instead).
    Task { batches: u32 },
    /// Push everything and take everything back (the trainer waits or stops).
    Drain,
    /// Train this many batches of a task, then hand it back unfinished:
    /// what was not pushed is dropped, and the trainer drains.
    Interrupted { batches: u32 },
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        5 => (1u32..30).prop_map(|batches| Event::Task { batches }),
        1 => Just(Event::Drain),
        1 => (1u32..30).prop_map(|batches| Event::Interrupted { batches }),
    ]
}

/// The shell, simulated: a clock, the exchange in flight and when it ends,
/// and what the test knows independently of the schedule.
struct Sim {
    schedule: Schedule,
    config: ScheduleConfig,
    now: Instant,
    /// The exchange in flight: what it does and when it ends.
    in_flight: Option<(Exchange, Instant)>,
    exchange_us: Vec<u64>,
    batch_us: u64,
    stall_every: u32,
    stall_us: u64,
    /// Counters kept by the test: batches since the last push and pull started.
    since_push: u32,
    since_pull: u32,
    pulled_ever: bool,
    /// When the parameters at hand were pulled.
    pulled_at: Option<Instant>,
    batches: u64,
    pushed_batches: u64,
    /// Batches of interrupted tasks dropped unpushed.
    dropped_batches: u64,
    pushes: u64,
    exchanges: usize,
}

impl Sim {
    fn new(
        config: ScheduleConfig,
        exchange_us: Vec<u64>,
        batch_us: u64,
        stall_every: u32,
        stall_us: u64,
    ) -> Sim {
        let now = Instant::now();
        Sim {
            schedule: Schedule::new(config, now),
            config,
            now,
            in_flight: None,
            exchange_us,
            batch_us,
            stall_every,
            stall_us,
            since_push: 0,
            since_pull: 0,
            pulled_ever: false,
            pulled_at: None,
            batches: 0,
            pushed_batches: 0,
            dropped_batches: 0,
            pushes: 0,
            exchanges: 0,
        }
    }

    fn exchange_duration(&mut self) -> Duration {
        self.exchanges += 1;
        Duration::from_micros(self.exchange_us[self.exchanges % self.exchange_us.len()])
    }

    /// Begin `exchange`, checking what may begin; its end is returned.
    fn begin(&mut self, exchange: Exchange, waited: bool, want: Want) -> Result<Instant, TestCaseError> {
        prop_assert!(self.in_flight.is_none(), "a second exchange while one is in flight");
        prop_assert!(exchange.push || exchange.pull, "an empty exchange");
        if exchange.push {
            prop_assert!(self.since_push >= 1, "a push of nothing");
            prop_assert!(self.since_push <= self.config.push_every, "a push of {} batches", self.since_push);
            if want == Want::Batch {
                // Pushed at the cadence, never earlier.
                prop_assert_eq!(self.since_push, self.config.push_every, "a batch-time push off the cadence");
            }
            self.pushed_batches += u64::from(self.since_push);
            self.pushes += 1;
            self.since_push = 0;
        }
        if exchange.pull {
            // Pulled at the cadence (or the first time, or a stale copy), never earlier.
            let stale = self.config.overlap
                && self.pulled_at.is_some_and(|at| self.now - at > self.schedule.stale_after());
            prop_assert!(
                !self.pulled_ever || self.since_pull >= self.config.pull_every || stale,
                "a pull {} batches after the last, cadence {}",
                self.since_pull,
                self.config.pull_every
            );
            self.since_pull = 0;
            self.pulled_ever = true;
        }
        if !self.config.overlap || !self.pulled_ever {
            prop_assert!(waited, "without overlap (and for the first pull) every exchange is waited for");
        }
        self.schedule.started(self.now, exchange);
        let ends = self.now + self.exchange_duration();
        self.in_flight = Some((exchange, ends));
        Ok(ends)
    }

    /// Take back the exchange in flight, waiting for it if it is not over.
    fn join(&mut self) -> Result<(), TestCaseError> {
        let Some((exchange, ends)) = self.in_flight.take() else {
            return Err(TestCaseError::fail("a join with nothing in flight"));
        };
        self.now = self.now.max(ends);
        if exchange.pull {
            self.pulled_at = Some(ends);
        }
        self.schedule.exchanged(ends);
        Ok(())
    }

    /// Carry out actions for `want` until a batch is trained (Batch) or
    /// nothing is left to do (Flush, Drain).
    fn run(&mut self, want: Want) -> Result<(), TestCaseError> {
        for _ in 0..8 {
            let finished = self.in_flight.is_some_and(|(_, ends)| ends <= self.now);
            match self.schedule.next(self.now, want, finished) {
                Action::Train => {
                    prop_assert_eq!(want, Want::Batch);
                    self.train()?;
                    return Ok(());
                }
                Action::Exchange(exchange) => {
                    self.begin(exchange, true, want)?;
                    self.join()?;
                }
                Action::Start(exchange) => {
                    prop_assert!(self.config.overlap, "a background exchange without overlap");
                    self.begin(exchange, false, want)?;
                }
                Action::Join => self.join()?,
                Action::Yield => {
                    prop_assert!(self.config.overlap, "a yield without overlap");
                    self.now += Duration::from_micros(2);
                    self.schedule.yielded(self.now);
                }
                Action::Idle => {
                    prop_assert_ne!(want, Want::Batch, "idle when a batch was wanted");
                    if want == Want::Drain {
                        prop_assert!(self.in_flight.is_none(), "drained with an exchange in flight");
                        prop_assert_eq!(self.since_push, 0, "drained with gradients unpushed");
                    } else {
                        prop_assert_eq!(self.since_push, 0, "a task's last gradients not pushed at its end");
                    }
                    return Ok(());
                }
            }
        }
        Err(TestCaseError::fail(format!("no progress for {want:?} in 8 actions")))
    }

    /// Train one batch, checking the parameters it trains on.
    fn train(&mut self) -> Result<(), TestCaseError> {
        prop_assert!(self.pulled_ever, "a batch before any pull");
        prop_assert!(self.since_push < self.config.push_every, "{} batches unpushed", self.since_push);
        if self.config.overlap {
            let age = self.now - self.pulled_at.unwrap_or(self.now);
            prop_assert!(age <= self.schedule.stale_after(), "training on parameters {age:?} old");
            let unpushed = self.config.push_every * MAX_PUSHES_DUE;
            prop_assert!(self.since_push < unpushed);
        } else {
            prop_assert!(self.in_flight.is_none(), "without overlap nothing travels while training");
            prop_assert!(
                self.since_pull < self.config.pull_every,
                "{} batches since the pull",
                self.since_pull
            );
        }
        self.batches += 1;
        let took = if self.stall_every > 0 && self.batches % u64::from(self.stall_every) == 0 {
            self.stall_us
        } else {
            self.batch_us
        };
        self.now += Duration::from_micros(took);
        self.since_push += 1;
        self.since_pull += 1;
        self.schedule.trained(Duration::from_micros(took));
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_trainers_keep_the_schedule_s_rules(
        push_every in 1u32..5,
        pull_every in 1u32..5,
        overlap: bool,
        exchange_us in prop::collection::vec(50u64..3_000, 1..6),
        batch_us in 1u64..400,
        stall_every in 0u32..25,
        stall_us in 1_000u64..50_000,
        events in prop::collection::vec(event(), 1..25),
    ) {
        let config = ScheduleConfig { push_every, pull_every, overlap };
        let mut sim = Sim::new(config, exchange_us, batch_us, stall_every, stall_us);
        for event in &events {
            match *event {
                Event::Task { batches } => {
                    for _ in 0..batches {
                        sim.run(Want::Batch)?;
                    }
                    sim.schedule.task_ended();
                    sim.run(Want::Flush)?;
                }
                Event::Drain => sim.run(Want::Drain)?,
                Event::Interrupted { batches } => {
                    for _ in 0..batches {
                        sim.run(Want::Batch)?;
                    }
                    prop_assert_eq!(sim.schedule.unpushed(), sim.since_push);
                    sim.dropped_batches += u64::from(sim.since_push);
                    sim.since_push = 0;
                    sim.schedule.discard_unpushed();
                    sim.run(Want::Drain)?;
                }
            }
        }
        sim.run(Want::Drain)?;
        // Every batch's gradient was pushed once, but those of interrupted
        // tasks not pushed at the interruption.
        prop_assert_eq!(sim.pushed_batches + sim.dropped_batches, sim.batches);
        let counts = sim.schedule.counts();
        prop_assert_eq!((counts.batches, counts.pushes), (sim.batches, sim.pushes));
        prop_assert_eq!(sim.schedule.unpushed(), 0);
        prop_assert!(!sim.schedule.in_flight());
        if !overlap {
            prop_assert_eq!(counts.stale_pulls, 0);
        }
    }
}

/// Without overlap the cadence is exact: one task of 12 batches, push every
/// 3 and pull every 4, pushes after batches 3, 6, 9, 12 and pulls before
/// batches 1, 5, 9 (the one due with a push travels with it).
#[test]
fn without_overlap_push_every_and_pull_every_hold_exactly() {
    let now = Instant::now();
    let mut s = Schedule::new(ScheduleConfig { push_every: 3, pull_every: 4, overlap: false }, now);
    let mut log = Vec::new();
    for batch in 1..=12 {
        loop {
            match s.next(now, Want::Batch, false) {
                Action::Train => break,
                Action::Exchange(e) => {
                    log.push((batch, e.push, e.pull));
                    s.started(now, e);
                    s.exchanged(now);
                }
                other => panic!("{other:?} without overlap"),
            }
        }
        s.trained(Duration::from_micros(10));
    }
    s.task_ended();
    if let Action::Exchange(e) = s.next(now, Want::Flush, false) {
        log.push((13, e.push, e.pull));
        s.started(now, e);
        s.exchanged(now);
    }
    assert_eq!(s.next(now, Want::Flush, false), Action::Idle);
    // (before batch n, push, pull)
    assert_eq!(
        log,
        [
            (1, false, true),
            (4, true, false),
            (5, false, true),
            (7, true, false),
            (9, false, true),
            (10, true, false),
            (13, true, true)
        ]
    );
}

/// The next action that is not a yield (yields are taken at once).
fn past_yields(s: &mut Schedule, now: Instant, want: Want, finished: bool) -> Action {
    loop {
        match s.next(now, want, finished) {
            Action::Yield => s.yielded(now),
            action => return action,
        }
    }
}

/// With overlap, a trainer that stalls past the staleness bound waits for a
/// pull before its next batch, and counts it.
#[test]
fn a_stall_makes_the_next_batch_wait_for_fresh_parameters() {
    let start = Instant::now();
    let config = ScheduleConfig { push_every: 1, pull_every: 1, overlap: true };
    let mut s = Schedule::new(config, start);
    let mut now = start;
    // The first pull is waited for.
    let Action::Exchange(first) = s.next(now, Want::Batch, false) else { panic!("first pull") };
    s.started(now, first);
    now += Duration::from_micros(100);
    s.exchanged(now);
    assert_eq!(past_yields(&mut s, now, Want::Batch, false), Action::Train);
    s.trained(Duration::from_micros(10));
    now += Duration::from_micros(10);
    // A push-pull goes out in the background and comes back quickly.
    let Action::Start(e) = past_yields(&mut s, now, Want::Batch, false) else {
        panic!("a background exchange")
    };
    assert!(e.push && e.pull);
    s.started(now, e);
    assert_eq!(past_yields(&mut s, now, Want::Batch, false), Action::Train, "trains beside the exchange");
    now += Duration::from_micros(100);
    assert_eq!(s.next(now, Want::Batch, true), Action::Join);
    s.exchanged(now);
    // The trainer is kept from running for 50 ms.
    s.trained(Duration::from_micros(10));
    now += Duration::from_millis(50);
    assert!(now - start > s.stale_after());
    let next = s.next(now, Want::Batch, false);
    assert!(matches!(next, Action::Start(Exchange { pull: true, .. })), "{next:?}");
    s.started(now, Exchange { push: true, pull: true });
    assert_eq!(s.next(now, Want::Batch, false), Action::Join, "the stale copy must not be trained on");
    now += Duration::from_micros(100);
    s.exchanged(now);
    assert_eq!(s.counts().stale_pulls, 1);
    assert_eq!(s.next(now, Want::Batch, false), Action::Yield, "50 ms since the last yield");
    s.yielded(now);
    assert_eq!(s.next(now, Want::Batch, false), Action::Train);
}
