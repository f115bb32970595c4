//! Where a push's gradient comes from, and which of those a shard has
//! applied: so that a task trained twice (its trainer killed in the
//! middle, the task handed to another) puts each example's gradient into
//! the model once. No I/O.
//!
//! A trainer names each push's **origin**: the task (pass and id) and the
//! examples of it (`start..end`, positions in the task's examples) whose
//! gradients the push carries, and the **floor**, the oldest task the
//! master still had open when it handed this one out. A shard keeps, per
//! task at or above the highest floor it has seen, the example ranges it
//! has applied ([`AppliedOrigins`]); a push whose examples are already
//! applied, or whose task is below the floor (finished, so every gradient
//! of it is applied: a trainer reports a task only once its last push is
//! acknowledged), is a duplicate and changes nothing. Tasks below the
//! floor are forgotten, so what a shard keeps is bounded by the tasks open
//! at once.
//!
//! Pushes of one task are cut the same way by every trainer (every
//! `push_every` batches from the task's start, and at its end), so a rerun
//! sends the same ranges. A range that overlaps an applied one without
//! being inside it (trainers with different batch sizes on one job) is
//! refused: applying it would count some examples twice, dropping it would
//! lose others.
//!
//! A push too large for one message comes in parts, each with some of the
//! shard's units (blocks, then the rows); an origin is applied once every
//! unit has come under it, and its units already applied are skipped part
//! by part, so a rerun after a trainer died between two parts applies only
//! the parts that were missing.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// A task as the master hands it out in one pass; ordered by pass, then id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TaskKey {
    /// The pass (0 for a stream).
    pub pass: u32,
    /// The task's id.
    pub task: u64,
}

/// Which examples of which task a push's gradient comes from (see the
/// [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Origin {
    /// The task.
    pub task: TaskKey,
    /// First example (position in the task's examples).
    pub start: u32,
    /// One past the last example.
    pub end: u32,
    /// The oldest task still open when this one was handed out: every task
    /// below it is finished.
    pub floor: TaskKey,
}

/// What a shard makes of a push's origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Not applied: apply it.
    New,
    /// Already applied (or its task is finished): a duplicate.
    Applied,
}

/// The origins a shard has applied (see the [module docs](self)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedOrigins {
    /// Every task below it is finished; nothing below it is kept.
    floor: TaskKey,
    /// Per task at or above the floor, the example ranges applied: sorted,
    /// disjoint, adjacent ones merged (a task pushed in order is one range).
    done: BTreeMap<TaskKey, Vec<(u32, u32)>>,
    /// Origins some of whose units are applied, not all: which ones.
    parts: BTreeMap<(TaskKey, u32, u32), Vec<bool>>,
}

impl AppliedOrigins {
    /// The floor: tasks below it are finished.
    pub fn floor(&self) -> TaskKey {
        self.floor
    }

    /// Tasks with applied examples kept (those at or above the floor).
    pub fn tasks(&self) -> usize {
        self.done.len()
    }

    /// Whether nothing is kept and the floor is the lowest.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// What applying `units` (indices below `n_units`) of a push from
    /// `origin` would be. Changes nothing.
    pub fn check(&self, origin: &Origin, units: &[usize]) -> Result<Seen> {
        let Origin { task, start, end, floor } = *origin;
        if start >= end {
            return Err(Error::EmptyOrigin { task, start, end });
        }
        if task < self.floor.max(floor) {
            return Ok(Seen::Applied);
        }
        if let Some(ranges) = self.done.get(&task) {
            // The last range starting before `end` is the only one that can
            // hold the push; any range meeting it at all is an overlap.
            let i = ranges.partition_point(|&(s, _)| s < end);
            if let Some(&(s, e)) = i.checked_sub(1).map(|i| &ranges[i]) {
                if s <= start && end <= e {
                    return Ok(Seen::Applied);
                }
                if e > start {
                    return Err(Error::OriginOverlap { task, start, end, applied_start: s, applied_end: e });
                }
            }
        }
        let Some(taken) = self.parts.get(&(task, start, end)) else { return Ok(Seen::New) };
        let again = units.iter().filter(|&&u| taken.get(u).copied().unwrap_or(false)).count();
        match again {
            0 => Ok(Seen::New),
            n if n == units.len() => Ok(Seen::Applied),
            _ => Err(Error::OriginPartOverlap { task, start, end }),
        }
    }

    /// Record `units` of a push from `origin` as applied, out of `n_units`
    /// (the shard's units): the origin is whole once every unit has come.
    /// The caller has checked it [`Seen::New`].
    pub fn record(&mut self, origin: &Origin, units: impl IntoIterator<Item = usize>, n_units: usize) {
        self.raise_floor(origin.floor);
        let Origin { task, start, end, .. } = *origin;
        if task < self.floor {
            return;
        }
        let key = (task, start, end);
        let taken = self.parts.entry(key).or_insert_with(|| vec![false; n_units]);
        for u in units {
            if let Some(t) = taken.get_mut(u) {
                *t = true;
            }
        }
        if taken.iter().all(|&t| t) {
            self.parts.remove(&key);
            insert_range(self.done.entry(task).or_default(), start, end);
        }
    }

    /// Forget every task below `floor` (they are finished).
    pub fn raise_floor(&mut self, floor: TaskKey) {
        if floor <= self.floor {
            return;
        }
        self.floor = floor;
        self.done = self.done.split_off(&floor);
        self.parts = self.parts.split_off(&(floor, 0, 0));
    }

    /// Take in what another replica applied (a catch-up or a checkpoint):
    /// the higher floor, and every range and part of both.
    pub fn merge(&mut self, other: &AppliedOrigins) {
        self.raise_floor(other.floor);
        for (&task, ranges) in other.done.range(self.floor..) {
            let mine = self.done.entry(task).or_default();
            for &(s, e) in ranges {
                insert_range(mine, s, e);
            }
        }
        for (&key, taken) in other.parts.range((self.floor, 0, 0)..) {
            let mine = self.parts.entry(key).or_insert_with(|| vec![false; taken.len()]);
            for (m, &t) in mine.iter_mut().zip(taken) {
                *m |= t;
            }
        }
    }
}

/// Insert `start..end` into sorted disjoint `ranges`, merging it with the
/// ranges it touches.
fn insert_range(ranges: &mut Vec<(u32, u32)>, start: u32, end: u32) {
    let first = ranges.partition_point(|&(_, e)| e < start);
    let last = ranges.partition_point(|&(s, _)| s <= end);
    let (mut s, mut e) = (start, end);
    if first < last {
        s = s.min(ranges[first].0);
        e = e.max(ranges[last - 1].1);
    }
    ranges.splice(first..last, [(s, e)]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn key(task: u64) -> TaskKey {
        TaskKey { pass: 0, task }
    }

    fn origin(task: u64, start: u32, end: u32, floor: u64) -> Origin {
        Origin { task: key(task), start, end, floor: key(floor) }
    }

    #[test]
    fn a_rerun_applies_only_what_was_missing() {
        let mut a = AppliedOrigins::default();
        for (s, e) in [(0, 64), (64, 128)] {
            assert_eq!(a.check(&origin(7, s, e, 0), &[0]).ok(), Some(Seen::New));
            a.record(&origin(7, s, e, 0), [0], 1);
        }
        assert_eq!(a.done[&key(7)], vec![(0, 128)]);
        assert_eq!(a.check(&origin(7, 0, 64, 0), &[0]).ok(), Some(Seen::Applied));
        assert_eq!(a.check(&origin(7, 64, 128, 0), &[0]).ok(), Some(Seen::Applied));
        assert_eq!(a.check(&origin(7, 128, 150, 0), &[0]).ok(), Some(Seen::New));
        let overlap = a.check(&origin(7, 100, 140, 0), &[0]);
        assert!(matches!(overlap, Err(Error::OriginOverlap { applied_start: 0, applied_end: 128, .. })));
        assert!(overlap.unwrap_err().to_string().contains("examples 100..140 of task 7"));
        assert!(matches!(
            a.check(&origin(7, 5, 5, 0), &[0]),
            Err(Error::EmptyOrigin { start: 5, end: 5, .. })
        ));
    }

    #[test]
    fn parts_are_applied_once_each() {
        let mut a = AppliedOrigins::default();
        let o = origin(3, 0, 10, 0);
        a.record(&o, [0, 1], 4);
        assert!(matches!(a.check(&o, &[0, 1]), Ok(Seen::Applied)));
        assert_eq!(a.check(&o, &[2, 3]).ok(), Some(Seen::New));
        assert!(matches!(a.check(&o, &[1, 2]), Err(Error::OriginPartOverlap { .. })));
        a.record(&o, [2, 3], 4);
        assert!(a.parts.is_empty());
        assert_eq!(a.check(&o, &[2, 3]).ok(), Some(Seen::Applied));
    }

    #[test]
    fn the_floor_forgets_finished_tasks_and_drops_their_pushes() {
        let mut a = AppliedOrigins::default();
        a.record(&origin(1, 0, 8, 0), [0], 1);
        a.record(&origin(2, 0, 8, 0), [0], 2);
        a.record(&origin(5, 0, 8, 3), [0], 1);
        assert_eq!(a.tasks(), 1);
        assert!(a.parts.is_empty(), "task 2's half-applied push is forgotten with it");
        assert_eq!(a.check(&origin(1, 8, 16, 0), &[0]).ok(), Some(Seen::Applied), "below the floor");
        assert_eq!(a.check(&origin(6, 0, 8, 0), &[0]).ok(), Some(Seen::New));
        // A push's own floor counts before it is recorded.
        assert_eq!(a.check(&origin(4, 0, 8, 5), &[0]).ok(), Some(Seen::Applied));
        // Passes order before ids.
        let next_pass = Origin { task: TaskKey { pass: 1, task: 0 }, start: 0, end: 8, floor: key(2) };
        assert_eq!(a.check(&next_pass, &[0]).ok(), Some(Seen::New));
    }

    #[test]
    fn merge_takes_the_union() {
        let (mut a, mut b) = (AppliedOrigins::default(), AppliedOrigins::default());
        a.record(&origin(4, 0, 8, 1), [0], 1);
        b.record(&origin(4, 8, 16, 2), [0], 1);
        b.record(&origin(9, 0, 4, 2), [1], 2);
        a.merge(&b);
        assert_eq!(a.floor(), key(2));
        assert_eq!(a.done[&key(4)], vec![(0, 16)]);
        assert_eq!(a.parts[&(key(9), 0, 4)], vec![false, true]);
    }

    /// One step of a trainer's life against a shard: a push of examples
    /// `start..start+len` of `task`, all units, with `floor`.
    #[derive(Clone, Debug)]
    struct Push {
        task: u64,
        start: u32,
        floor: u64,
    }

    proptest! {
        /// Random pushes of fixed-size ranges (reruns, retries, floors that
        /// move up) against a model that keeps every example ever applied:
        /// a push is new exactly when its examples were never applied and
        /// its task is not below the highest floor seen so far, and every
        /// example is applied at most once.
        #[test]
        fn matches_a_model_that_forgets_nothing(
            pushes in proptest::collection::vec(
                (0u64..6, 0u32..6, 0u64..4).prop_map(|(task, start, floor)| Push { task, start: start * 8, floor }),
                1..200,
            ),
        ) {
            let mut a = AppliedOrigins::default();
            let mut applied: BTreeSet<(u64, u32)> = BTreeSet::new();
            let mut floor = 0;
            for p in pushes {
                let o = origin(p.task, p.start, p.start + 8, p.floor);
                let seen = a.check(&o, &[0]).expect("fixed-size ranges never overlap partially");
                floor = floor.max(p.floor);
                let model_new = p.task >= floor && !applied.contains(&(p.task, p.start));
                prop_assert_eq!(seen == Seen::New, model_new, "{:?}", p);
                if seen == Seen::New {
                    prop_assert!(applied.insert((p.task, p.start)));
                    a.record(&o, [0], 1);
                } else {
                    a.raise_floor(o.floor);
                }
                prop_assert!(a.done.keys().all(|&t| t >= key(floor)));
            }
        }

        /// Ranges inserted in any order end up sorted, disjoint and merged,
        /// covering exactly the examples inserted.
        #[test]
        fn ranges_stay_sorted_and_merged(ranges in proptest::collection::vec((0u32..100, 1u32..10), 0..50)) {
            let mut set = Vec::new();
            let mut covered = BTreeSet::new();
            for (s, len) in ranges {
                insert_range(&mut set, s, s + len);
                covered.extend(s..s + len);
            }
            prop_assert!(set.windows(2).all(|w| w[0].1 < w[1].0));
            let mine: BTreeSet<u32> = set.iter().flat_map(|&(s, e)| s..e).collect();
            prop_assert_eq!(mine, covered);
        }
    }
}
