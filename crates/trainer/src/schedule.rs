//! When an async trainer pushes, pulls, waits and yields: the training
//! loop's policy as a state machine without I/O. Time comes in as an
//! argument; the shell ([`worker`](crate::worker)) asks for the next
//! [`Action`], carries it out, and says what happened.
//!
//! # The rules
//!
//! - **Cadence.** A push is due once `push_every` batches were trained
//!   since the last push, or at a task's end (the task's report waits for
//!   its last gradients) with any batch unpushed. A pull is due before a
//!   batch once `pull_every` batches were trained since the last pull; a
//!   pull due with a push travels with it (one round trip). Parameters are
//!   pulled before the very first batch.
//! - **Without overlap** every exchange is waited for where it is due, so
//!   the cadence holds exactly: every push but a task's last carries
//!   exactly `push_every` batches, and every batch trains on parameters
//!   pulled fewer than `pull_every` batches before.
//! - **With overlap** an exchange travels in the background while the next
//!   batches train. At most one is in flight. A push that falls due while
//!   one is in flight waits for it: training stops until that exchange is
//!   back ([`MAX_PUSHES_DUE`]), so a push never carries more than
//!   `push_every` batches. (Merging the batches of several due pushes into
//!   one averaged push, as oar once did, took a small model from ~29 to ~9
//!   updates per pass of a1a and cost it 1-2 points of accuracy; summing
//!   them instead diverged at higher learning rates and with momentum.)
//! - **Staleness.** With overlap, parameters pulled longer ago than twice
//!   the age the loop's own pace gives them ([`Schedule::stale_after`], at
//!   least [`STALE_AFTER_MIN`]) are stale: before the next batch trains, a
//!   pull in flight is waited for, or a new one is made and waited for. A
//!   trainer kept from running (a busy machine) thus never trains on
//!   parameters that far behind the other trainers' pushes.
//! - **Yielding.** With overlap, training runs on the runtime's threads, so
//!   between batches the loop lets the runtime run other tasks once
//!   [`YIELD_EVERY`] has passed since it last did.

use std::time::{Duration, Instant};

/// With overlap, the pushes that may be due while an exchange is in
/// flight before training waits for it. One: a push is never merged with
/// another (see [the rules](self#the-rules)).
pub const MAX_PUSHES_DUE: u32 = 1;

/// With overlap, the loop lets the runtime run its other tasks (the
/// exchange in flight, the reports, the other roles of a one-process job)
/// once this much time has passed since it last did. Yielding after every
/// ~10 µs batch instead cost a round of the runtime's queues per batch: one
/// a1a trainer ran at 0.51-0.67 of the plain loop against 0.61-0.86 this
/// way, in paired runs (BENCHMARKS.md, end to end). Half a loopback round
/// trip: an exchange that completes waits at most about that long to be
/// taken.
pub const YIELD_EVERY: Duration = Duration::from_micros(50);

/// The least age at which parameters count as stale (see
/// [`Schedule::stale_after`]). An exchange of a small model takes 0.1-0.2
/// ms on loopback, so only a trainer kept from running (a busy machine, a
/// long wait for the master) reaches this age; larger models and slower
/// batches scale the bound with their own pace.
pub const STALE_AFTER_MIN: Duration = Duration::from_millis(2);

/// How a trainer exchanges with the pservers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduleConfig {
    /// Push every this many batches (at least 1).
    pub push_every: u32,
    /// Pull every this many batches (at least 1).
    pub pull_every: u32,
    /// Let exchanges travel while the next batches train.
    pub overlap: bool,
}

/// One exchange with the pservers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exchange {
    /// Push the gradient of the batches trained since the last push.
    pub push: bool,
    /// Bring back the parameters (after the push, if any).
    pub pull: bool,
}

/// What the shell does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Train the next batch on the parameters at hand, then call
    /// [`Schedule::trained`].
    Train,
    /// Call [`Schedule::started`], exchange now and wait for it, then call
    /// [`Schedule::exchanged`].
    Exchange(Exchange),
    /// Call [`Schedule::started`], start this exchange in the background
    /// and carry on; call [`Schedule::exchanged`] once it is taken back
    /// (after an [`Action::Join`]).
    Start(Exchange),
    /// Take back the exchange in flight, waiting for it if it is not over,
    /// then call [`Schedule::exchanged`].
    Join,
    /// Let the runtime run other tasks, then call [`Schedule::yielded`].
    Yield,
    /// Nothing more to do for what was wanted.
    Idle,
}

/// What the shell is about to do, for [`Schedule::next`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Train a batch.
    Batch,
    /// Start what is due now (a task's last push, after
    /// [`Schedule::task_ended`]) and no more: its exchange may still be in
    /// flight when this ends in [`Action::Idle`].
    Flush,
    /// Push every gradient and take back every exchange: before the trainer
    /// waits, stops or asks the master again.
    Drain,
}

/// The exchange in flight.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    started: Instant,
    exchange: Exchange,
}

/// The state of one async trainer's exchanges (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct Schedule {
    config: ScheduleConfig,
    /// Batches trained since the last push started, and since the last pull
    /// started.
    since_push: u32,
    since_pull: u32,
    /// A push is due at the next chance whatever `since_push` (a task ended).
    push_now: bool,
    /// Parameters were never pulled.
    never_pulled: bool,
    in_flight: Option<InFlight>,
    /// When the parameters at hand were pulled (their exchange ended).
    pulled_at: Option<Instant>,
    /// The stale parameters were counted and are being refreshed.
    refreshing: bool,
    last_yield: Instant,
    /// [`typical`] durations of an exchange and of a batch.
    exchange_time: Duration,
    batch_time: Duration,
    counts: ScheduleCounts,
}

/// What a [`Schedule`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScheduleCounts {
    /// Batches trained.
    pub batches: u64,
    /// Exchanges that pushed.
    pub pushes: u64,
    /// Exchanges that pulled.
    pub pulls: u64,
    /// Times the parameters at hand were found stale before a batch.
    pub stale_pulls: u64,
}

/// A moving average of `sample`s that a stall does not carry away: each
/// counts for an eighth, and for at most 4 times the average so far. (A
/// trainer kept from running mid-batch makes that batch, and the exchange
/// waiting on its thread, look long; averaged in whole, they would raise
/// the staleness bound past the very age they caused.)
fn typical(average: Duration, sample: Duration) -> Duration {
    if average.is_zero() {
        return sample;
    }
    (average.saturating_mul(7).saturating_add(sample.min(average.saturating_mul(4)))) / 8
}

impl Schedule {
    /// A trainer that has trained nothing yet, at `now`. Cadences of 0 are
    /// taken as 1.
    pub fn new(config: ScheduleConfig, now: Instant) -> Self {
        let config = ScheduleConfig {
            push_every: config.push_every.max(1),
            pull_every: config.pull_every.max(1),
            ..config
        };
        Self {
            config,
            since_push: 0,
            since_pull: 0,
            push_now: false,
            never_pulled: true,
            in_flight: None,
            pulled_at: None,
            refreshing: false,
            last_yield: now,
            exchange_time: Duration::ZERO,
            batch_time: Duration::ZERO,
            counts: ScheduleCounts::default(),
        }
    }

    /// The cadences and overlap in force.
    pub fn config(&self) -> ScheduleConfig {
        self.config
    }

    /// What the schedule has done so far.
    pub fn counts(&self) -> ScheduleCounts {
        self.counts
    }

    /// Batches trained whose gradient has not been pushed (started) yet.
    pub fn unpushed(&self) -> u32 {
        self.since_push
    }

    /// Whether an exchange is in flight.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// How long ago the parameters at hand were pulled (none: never).
    pub fn parameters_age(&self, now: Instant) -> Option<Duration> {
        self.pulled_at.map(|at| now.saturating_duration_since(at))
    }

    /// Parameters pulled longer ago than this are stale: twice the age the
    /// loop's own pace gives them (an exchange, plus the batches trained
    /// while pushes are due and until the next pull), at least
    /// [`STALE_AFTER_MIN`].
    pub fn stale_after(&self) -> Duration {
        let c = self.config;
        let batches = MAX_PUSHES_DUE.saturating_mul(c.push_every).saturating_add(c.pull_every);
        let paced = self.exchange_time.saturating_add(self.batch_time.saturating_mul(batches));
        paced.saturating_mul(2).max(STALE_AFTER_MIN)
    }

    /// A task ended: its last gradients must be pushed before its report,
    /// so a push is due at the next chance (if any batch is unpushed).
    pub fn task_ended(&mut self) {
        self.push_now = self.since_push > 0;
    }

    /// A task was interrupted (handed back unfinished, to be trained again
    /// whole): the gradient of its batches not pushed yet is dropped, not
    /// pushed, so the push boundaries of a task stay every `push_every`
    /// batches from its start, whoever trains it.
    pub fn discard_unpushed(&mut self) {
        self.since_push = 0;
        self.push_now = false;
    }

    /// The next action, at `now`, for what the shell wants; `finished` says
    /// whether the exchange in flight (if any) has completed, so that it is
    /// taken back without waiting.
    pub fn next(&mut self, now: Instant, want: Want, finished: bool) -> Action {
        let c = self.config;
        let stale = want == Want::Batch && self.is_stale(now);
        if stale && !self.refreshing {
            self.refreshing = true;
            self.counts.stale_pulls += 1;
        }
        if self.in_flight.is_some() {
            let push_due = self.push_due();
            let wait = finished
                || want == Want::Drain
                || (push_due
                    && (self.push_now || self.since_push >= c.push_every.saturating_mul(MAX_PUSHES_DUE)))
                || (want == Want::Batch && (self.never_pulled || stale));
            return match (wait, want) {
                (true, _) => Action::Join,
                (false, Want::Batch) => self.yield_or_train(now),
                (false, _) => Action::Idle,
            };
        }
        let push = self.push_due() || (want == Want::Drain && self.since_push > 0);
        let pull = match want {
            Want::Batch => self.never_pulled || self.pull_due() || stale,
            // A pull is for the batches to come: it goes with a push only.
            Want::Flush | Want::Drain => push && self.pull_due(),
        };
        if push || pull {
            let exchange = Exchange { push, pull };
            // The first pull is waited for: the first batch needs it.
            return match c.overlap && !self.never_pulled {
                true => Action::Start(exchange),
                false => Action::Exchange(exchange),
            };
        }
        match want {
            Want::Batch => self.yield_or_train(now),
            Want::Flush | Want::Drain => Action::Idle,
        }
    }

    fn yield_or_train(&self, now: Instant) -> Action {
        if self.config.overlap && now.saturating_duration_since(self.last_yield) >= YIELD_EVERY {
            Action::Yield
        } else {
            Action::Train
        }
    }

    fn push_due(&self) -> bool {
        self.since_push > 0 && (self.since_push >= self.config.push_every || self.push_now)
    }

    fn pull_due(&self) -> bool {
        self.since_pull >= self.config.pull_every
    }

    /// With overlap, whether the parameters at hand are too old to train on.
    fn is_stale(&self, now: Instant) -> bool {
        self.config.overlap
            && self.pulled_at.is_some_and(|at| now.saturating_duration_since(at) > self.stale_after())
    }

    /// The exchange of an [`Action::Exchange`] or [`Action::Start`] begins
    /// at `now`: the gradient it pushes and the pull it makes count from here.
    pub fn started(&mut self, now: Instant, exchange: Exchange) {
        if exchange.push {
            self.since_push = 0;
            self.push_now = false;
            self.counts.pushes += 1;
        }
        if exchange.pull {
            self.since_pull = 0;
            self.counts.pulls += 1;
        }
        self.in_flight = Some(InFlight { started: now, exchange });
    }

    /// The exchange begun by [`started`](Self::started) ended at `ended`
    /// (and was taken back): parameters it pulled are the ones at hand now.
    pub fn exchanged(&mut self, ended: Instant) {
        let Some(InFlight { started, exchange }) = self.in_flight.take() else { return };
        self.exchange_time = typical(self.exchange_time, ended.saturating_duration_since(started));
        if exchange.pull {
            self.pulled_at = Some(ended);
            self.never_pulled = false;
            self.refreshing = false;
        }
    }

    /// A batch was trained, in `took`.
    pub fn trained(&mut self, took: Duration) {
        self.batch_time = typical(self.batch_time, took);
        self.since_push = self.since_push.saturating_add(1);
        self.since_pull = self.since_pull.saturating_add(1);
        self.counts.batches += 1;
    }

    /// The loop let the runtime run other tasks, at `now`.
    pub fn yielded(&mut self, now: Instant) {
        self.last_yield = now;
    }
}
