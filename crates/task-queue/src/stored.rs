//! What the master stores (the core of its persistence, without I/O): a
//! [`StoredState`] under its state key, the task queue's [`Snapshot`] and
//! the statistics of each pass, and one [`JournalRecord`] per write since
//! then under its journal prefix. The master shell ([`crate::master`])
//! decides when to write which; [`StoredState::from_listing`] restores
//! them from one listing.

use crate::{
    protocol::{MasterStatus, PassStats},
    snapshot::{decode_framed, encode_framed},
    Delta, Error, QueueConfig, Result, Snapshot, TaskQueue,
};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Discarded tasks listed with their reasons in the status and the stored
/// state; past this many only the count grows, so a dataset that is bad
/// throughout cannot push the state past etcd's request limit.
pub const MAX_DISCARDS_LISTED: usize = 100;

/// What the master stores under `master/state`: the task queue and the
/// statistics of each pass. Read it to see a job from outside
/// ([`StoredState::status`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredState {
    /// The task queue.
    pub queue: Snapshot,
    /// Training statistics per pass, index = pass.
    pub passes: Vec<PassStats>,
    /// Tasks discarded so far, with their reasons (the first
    /// [`MAX_DISCARDS_LISTED`]).
    pub discarded: Vec<(u64, String)>,
}

/// First bytes of an encoded [`StoredState`].
const STATE_MAGIC: &[u8; 4] = b"OARM";
/// The encoding's format number, after the magic.
const STATE_FORMAT: u8 = 1;

impl StoredState {
    /// The bytes to store: magic, format number, postcard body.
    pub fn encode(&self) -> Vec<u8> {
        encode_framed(self, STATE_MAGIC, STATE_FORMAT)
    }

    /// Parses and validates bytes made by [`encode`](Self::encode). A bare
    /// [`Snapshot`] (what masters stored before the statistics were kept) is
    /// read as a state with no statistics.
    pub fn decode(bytes: &[u8]) -> Result<StoredState> {
        if bytes.starts_with(b"OARQ") {
            let queue = Snapshot::decode(bytes)?;
            return Ok(StoredState { queue, passes: Vec::new(), discarded: Vec::new() });
        }
        let stored: StoredState = decode_framed(bytes, STATE_MAGIC, STATE_FORMAT, "not a master state")?;
        stored.queue.unpack()?;
        Ok(stored)
    }

    /// The state after `records` (in version order), skipping those this
    /// state already covers: a restore's replay of the journal. Errors if
    /// the rest do not follow on from this state's version without a gap.
    pub fn replay(self, records: &[JournalRecord]) -> Result<StoredState> {
        let covered = self.queue.version();
        let newer: Vec<&JournalRecord> = records.iter().filter(|r| r.delta.version() > covered).collect();
        if newer.is_empty() {
            return Ok(self);
        }
        let queue = self.queue.apply(newer.iter().map(|r| &r.delta))?;
        let StoredState { mut passes, mut discarded, .. } = self;
        for record in newer {
            if let Some(stats) = &record.pass_stats {
                // Below MAX_PASSES: `apply` checked it is the queue's pass.
                let pass = record.delta.pass() as usize;
                if passes.len() <= pass {
                    passes.resize(pass + 1, PassStats::default());
                }
                passes[pass] = *stats;
            }
            let room = MAX_DISCARDS_LISTED.saturating_sub(discarded.len());
            discarded.extend(record.discarded.iter().take(room).cloned());
        }
        Ok(StoredState { queue, passes, discarded })
    }

    /// The latest state stored, from keys and values read in one consistent
    /// listing: the value of `state_key` with the records under
    /// `journal_prefix` replayed (any other keys are ignored); `None` if no
    /// master stored anything yet. Errors name the key that is bad.
    pub fn from_listing<'a>(
        kvs: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        state_key: &str,
        journal: &str,
    ) -> Result<Option<StoredState>> {
        let mut state = None;
        let mut records = Vec::new();
        for (key, value) in kvs {
            let named = |e: Error| match e {
                Error::BadSnapshot(why) => Error::BadSnapshot(format!("{key}: {why}")),
                other => other,
            };
            if key == state_key {
                state = Some(StoredState::decode(value).map_err(named)?);
            } else if key.starts_with(journal) {
                records.push((key, JournalRecord::decode(value).map_err(named)?));
            }
        }
        records.sort_by(|a, b| a.0.cmp(b.0));
        let records: Vec<JournalRecord> = records.into_iter().map(|(_, r)| r).collect();
        state.map(|s| s.replay(&records)).transpose()
    }

    /// The job's status as the master last stored it.
    pub fn status(&self, config: QueueConfig) -> Result<MasterStatus> {
        let queue = TaskQueue::restore(self.queue.clone(), config, Instant::now())?;
        Ok(MasterStatus {
            queue: queue.status(),
            passes: self.passes.clone(),
            discarded: self.discarded.clone(),
            stream: None,
        })
    }
}

/// One write of the master's journal, under `master/journal/<version>`:
/// the tasks that changed since the write before, the statistics of their
/// pass, and the discards listed since.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournalRecord {
    /// The changed tasks.
    pub delta: Delta,
    /// The statistics of the delta's pass, once the pass has any.
    pub pass_stats: Option<PassStats>,
    /// Discards listed since the previous write.
    pub discarded: Vec<(u64, String)>,
}

/// First bytes of an encoded [`JournalRecord`].
const RECORD_MAGIC: &[u8; 4] = b"OARJ";
/// The encoding's format number, after the magic.
const RECORD_FORMAT: u8 = 1;

impl JournalRecord {
    /// The bytes to store: magic, format number, postcard body.
    pub fn encode(&self) -> Vec<u8> {
        encode_framed(self, RECORD_MAGIC, RECORD_FORMAT)
    }

    /// Parses bytes made by [`encode`](Self::encode). Whether the record fits
    /// the state it is replayed on is checked by [`StoredState::replay`].
    pub fn decode(bytes: &[u8]) -> Result<JournalRecord> {
        decode_framed(bytes, RECORD_MAGIC, RECORD_FORMAT, "not a master journal record")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{chunk_files, tasks_from_chunks, Changes, GetTask, QueueEvent, MAX_REASON_BYTES};
    use std::time::Duration;

    #[test]
    fn stored_state_of_100k_tasks_fits_in_an_etcd_request() {
        // 100,000 tasks of one 1 MiB chunk over 250 files, 100 passes of
        // statistics, and the most discards listed with the longest reasons.
        let files: Vec<(String, u64)> =
            (0..250).map(|i| (format!("/data/part-{i:05}.libsvm"), 400 << 20)).collect();
        let tasks = tasks_from_chunks(chunk_files(&files, 1 << 20).unwrap(), 1).unwrap();
        assert_eq!(tasks.len(), 100_000);
        let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 3, passes: 100 };
        let queue = TaskQueue::new(tasks, config.clone()).unwrap();
        let stats = PassStats { examples: 1 << 40, loss_sum: 1e9, tasks_finished: 100_000, skipped_lines: 7 };
        let reason = "r".repeat(MAX_REASON_BYTES);
        let stored = StoredState {
            queue: queue.snapshot(),
            passes: vec![stats; 100],
            discarded: (0..MAX_DISCARDS_LISTED as u64).map(|t| (t, reason.clone())).collect(),
        };
        let bytes = stored.encode();
        let limit = 3 << 19; // etcd's default 1.5 MiB
        eprintln!("stored master state for 100,000 tasks: {} bytes (limit {limit})", bytes.len());
        assert!(bytes.len() < limit, "{} bytes", bytes.len());
        let back = StoredState::decode(&bytes).unwrap();
        assert_eq!(back, stored);
        assert_eq!(back.status(config).unwrap().passes.len(), 100);
    }

    #[test]
    fn a_state_whose_every_task_was_discarded_still_fits_in_an_etcd_request() {
        // 100,000 tasks, each discarded for a reason of its own (a file and
        // a line, as a reader's errors read): only the first discards keep
        // their reason in the queue, or the state would be ~30 MB.
        let files: Vec<(String, u64)> =
            (0..250).map(|i| (format!("/data/part-{i:05}.libsvm"), 400 << 20)).collect();
        let tasks = tasks_from_chunks(chunk_files(&files, 1 << 20).unwrap(), 1).unwrap();
        let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 1, passes: 100 };
        let mut queue = TaskQueue::new(tasks, config.clone()).unwrap();
        let now = Instant::now();
        let mut discarded = Vec::new();
        while let GetTask::Assigned(a) = queue.get_task("trainer-0", now) {
            let reason = format!(
                "bad data: /data/part-{:05}.libsvm:{}: {}",
                a.task.id.0 % 250,
                a.task.id.0 * 37,
                "x".repeat(300)
            );
            queue.task_failed(a.task_ref, &reason, now);
            for event in queue.drain_events() {
                if let QueueEvent::TaskDiscarded { task, reason, .. } = event {
                    assert!(reason.contains(".libsvm:"), "the event carries the whole reason: {reason}");
                    if discarded.len() < MAX_DISCARDS_LISTED {
                        discarded.push((task.0, reason));
                    }
                }
            }
        }
        assert_eq!(queue.status().discarded, 100_000);
        let kept = |id: u64| match queue.task_state(crate::TaskId(id)) {
            Some(crate::TaskState::Discarded { reason }) => reason,
            other => panic!("task {id}: {other:?}"),
        };
        assert!(kept(0).contains("part-00000.libsvm:0:"), "{}", kept(0));
        assert!(kept(99_999).contains("only the first 100"), "{}", kept(99_999));
        let stored = StoredState { queue: queue.snapshot(), passes: Vec::new(), discarded };
        let bytes = stored.encode();
        let limit = 3 << 19; // etcd's default 1.5 MiB
        assert!(bytes.len() < limit, "{} bytes", bytes.len());
        assert_eq!(StoredState::decode(&bytes).unwrap(), stored);
    }

    /// A state of three tasks and the journal records of finishing two.
    fn state_and_records() -> (StoredState, Vec<JournalRecord>, QueueConfig) {
        let tasks = tasks_from_chunks(
            (0..3).map(|i| crate::Chunk { path: "a".into(), start: i * 10, end: i * 10 + 10 }).collect(),
            1,
        )
        .unwrap();
        let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 3, passes: 1 };
        let mut queue = TaskQueue::new(tasks, config.clone()).unwrap();
        let Changes::Snapshot(snapshot) = queue.take_changes(false) else {
            panic!("first take is a snapshot")
        };
        let state = StoredState { queue: snapshot, passes: Vec::new(), discarded: Vec::new() };
        let now = Instant::now();
        let mut records = Vec::new();
        for n in 1..=2u64 {
            let GetTask::Assigned(a) = queue.get_task("t", now) else { panic!("a task") };
            queue.task_finished(a.task_ref, now);
            let Changes::Delta(delta) = queue.take_changes(false) else { panic!("a delta") };
            let stats =
                PassStats { examples: n, loss_sum: 0.5 * n as f64, tasks_finished: n, skipped_lines: 0 };
            records.push(JournalRecord { delta, pass_stats: Some(stats), discarded: Vec::new() });
        }
        (state, records, config)
    }

    #[test]
    fn replay_applies_newer_records_and_skips_covered_ones() {
        let (state, records, config) = state_and_records();
        let replayed = state.clone().replay(&records).unwrap();
        let status = replayed.status(config.clone()).unwrap();
        assert_eq!((status.queue.done, status.passes[0].tasks_finished), (2, 2));
        // Replaying again over the result skips what it covers.
        assert_eq!(replayed.clone().replay(&records).unwrap(), replayed);
        // A gap in the chain is an error that names the versions.
        let err = state.replay(&records[1..]).unwrap_err().to_string();
        assert!(err.contains("does not follow version"), "{err}");
    }

    #[test]
    fn a_bad_journal_record_is_an_error_naming_its_key() {
        let (state, records, _) = state_and_records();
        let (state_key, journal) = ("/j/master/state", "/j/master/journal/");
        let record_key = |version: u64| format!("{journal}{version:020}");
        let state_bytes = state.encode();
        let first = records[0].encode();
        let listing = [
            (state_key.to_string(), state_bytes.clone()),
            (record_key(records[0].delta.version()), first.clone()),
            (record_key(99), b"OARJ\x01\xff".to_vec()),
        ];
        let err =
            StoredState::from_listing(listing.iter().map(|(k, v)| (k.as_str(), &v[..])), state_key, journal)
                .unwrap_err()
                .to_string();
        assert!(err.contains("/j/master/journal/00000000000000000099") && err.contains("corrupt"), "{err}");
        let good = &listing[..2];
        let stored =
            StoredState::from_listing(good.iter().map(|(k, v)| (k.as_str(), &v[..])), state_key, journal)
                .unwrap();
        assert_eq!(stored.unwrap().passes[0].examples, 1);
        assert!(StoredState::from_listing(std::iter::empty(), state_key, journal).unwrap().is_none());
    }

    #[test]
    fn a_bare_snapshot_reads_as_a_state_without_statistics() {
        let tasks = tasks_from_chunks(vec![crate::Chunk { path: "a".into(), start: 0, end: 9 }], 1).unwrap();
        let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 3, passes: 1 };
        let snapshot = TaskQueue::new(tasks, config).unwrap().snapshot();
        let stored = StoredState::decode(&snapshot.encode()).unwrap();
        assert_eq!(stored.queue, snapshot);
        assert!(stored.passes.is_empty() && stored.discarded.is_empty());
    }

    #[test]
    fn garbage_state_is_an_error_that_says_why() {
        for (bytes, why) in [
            (&b"nope"[..], "expected magic"),
            (&b"OARM"[..], "truncated"),
            (&b"OARM\x09"[..], "unsupported format 9"),
            (&b"OARM\x01\xff\xff"[..], "corrupt body"),
        ] {
            let err = StoredState::decode(bytes).unwrap_err().to_string();
            assert!(err.contains(why), "{err:?} should say {why:?}");
        }
    }
}
