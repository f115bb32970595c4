//! The key layout of one job in the discovery store, written down once:
//! every process of a job derives its keys from [`JobKeys`], and hands each
//! service the keys it uses ([`JobKeys::master`], [`JobKeys::pserver`]).
//!
//! | key | value | lease |
//! | --- | --- | --- |
//! | `master/lock` | holder id | master's |
//! | `master/addr` | address of the master | master's |
//! | `master/state`, `master/journal/<version>` | task-queue snapshot and journal (fenced) | none |
//! | `config` | the job's options, published once by the master | none |
//! | `instance` | this run of the job: a random id the first master creates (names its checkpoint directory) | none |
//! | `result` | the job's report, once it ended (fenced) | none |
//! | `trainer/<id>` | trainer id | trainer's |
//! | `ps_desired` | how many pservers the job wants (decimal; the master writes the first) | none |
//! | `ps/<name>` | pserver `<name>`'s address (`<name>` is its id and lease) | pserver's |
//! | `shard_map` | the shard map: version, each shard's replicas, primary first (fenced) | none |
//! | `pshards/<shard>/<name>` | a replica's state: role, applied update, epoch, step (JSON) | pserver's |
//! | `shard_checkpoint/<shard>` | latest checkpoint: path, step, checksum, time | none |
//! | `pserver_cluster_status` | `OK`, `UNHEALTHY` or `UNKNOWN`, why, the pservers (JSON, fenced) | none |

use oar_pserver::PserverKeys;
use oar_task_queue::MasterKeys;

/// The keys of one job, all under `/oar/<job>/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobKeys {
    prefix: String,
}

impl JobKeys {
    /// Keys of job `job`. A job name is non-empty, has no `/` or
    /// whitespace, and is not `.` or `..` (it names the job's checkpoint
    /// directory too).
    pub fn new(job: &str) -> crate::Result<Self> {
        if job.is_empty()
            || job.contains('/')
            || job.chars().any(char::is_whitespace)
            || job == "."
            || job == ".."
        {
            return Err(crate::Error::BadConfig(format!(
                "job name {job:?} must be non-empty, without '/' or whitespace, and not '.' or '..'"
            )));
        }
        Ok(Self { prefix: format!("/oar/{job}/") })
    }

    /// `/oar/<job>/`: everything of the job.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// The master's lock (value: holder id; under the master's lease).
    pub fn master_lock(&self) -> String {
        format!("{}master/lock", self.prefix)
    }
    /// The serving master's address (under the master's lease).
    pub fn master_addr(&self) -> String {
        format!("{}master/addr", self.prefix)
    }
    /// The task-queue snapshot, written only through the master's fence.
    pub fn master_state(&self) -> String {
        format!("{}master/state", self.prefix)
    }
    /// Prefix of the master's journal: one record per batch of changes
    /// since `master/state`, written through the master's fence.
    pub fn master_journal(&self) -> String {
        format!("{}master/journal/", self.prefix)
    }
    /// The journal record that brings the queue to `version` (zero-padded,
    /// so records list in version order).
    pub fn master_journal_record(&self, version: u64) -> String {
        self.master().journal_record(version)
    }
    /// The job's options, published once by the master.
    pub fn config(&self) -> String {
        format!("{}config", self.prefix)
    }
    /// This run of the job: created once, by the first master, before it
    /// publishes the options (so a process that read the options finds it).
    pub fn instance(&self) -> String {
        format!("{}instance", self.prefix)
    }
    /// The job's final report, written by the master through its fence
    /// when the job ends (done or failed); pservers stop when it appears.
    pub fn result(&self) -> String {
        format!("{}result", self.prefix)
    }
    /// Prefix of the trainers' registrations.
    pub fn trainers(&self) -> String {
        format!("{}trainer/", self.prefix)
    }
    /// Trainer `id`'s registration (under the trainer's lease).
    pub fn trainer(&self, id: &str) -> String {
        format!("{}trainer/{id}", self.prefix)
    }
    /// How many pservers the job wants.
    pub fn ps_desired(&self) -> String {
        format!("{}ps_desired", self.prefix)
    }
    /// Prefix of the pservers' registrations.
    pub fn ps_prefix(&self) -> String {
        format!("{}ps/", self.prefix)
    }
    /// Pserver `name`'s registration (its address, under its lease).
    pub fn ps(&self, name: &str) -> String {
        format!("{}ps/{name}", self.prefix)
    }
    /// A streaming job's close request: once this key exists, the master
    /// closes the source, trains what it holds and ends the job.
    pub fn stream_close(&self) -> String {
        format!("{}stream/close", self.prefix)
    }
    /// A streaming job's source position and lag (JSON of
    /// `oar_task_queue::StreamStatus`), written by the master every window.
    pub fn stream_status(&self) -> String {
        format!("{}stream/status", self.prefix)
    }
    /// The shard map, written by the master's coordinator through its fence.
    pub fn shard_map(&self) -> String {
        format!("{}shard_map", self.prefix)
    }
    /// Prefix of the replicas' states, `pshards/<shard>/<name>`.
    pub fn pshards(&self) -> String {
        format!("{}pshards/", self.prefix)
    }
    /// Prefix of the shards' latest checkpoint records.
    pub fn shard_checkpoints(&self) -> String {
        format!("{}shard_checkpoint/", self.prefix)
    }
    /// The pservers' health, written by the master's coordinator.
    pub fn pserver_cluster_status(&self) -> String {
        format!("{}pserver_cluster_status", self.prefix)
    }
    /// The trainer id in a key under [`JobKeys::trainers`], if it is one.
    pub fn trainer_id<'a>(&self, key: &'a str) -> Option<&'a str> {
        oar_discovery::member_name(&self.trainers(), key)
    }

    /// The keys of the job's master.
    pub fn master(&self) -> MasterKeys {
        MasterKeys {
            lock: self.master_lock(),
            addr: self.master_addr(),
            state: self.master_state(),
            journal: self.master_journal(),
            config: self.config(),
            members: self.trainers(),
        }
    }

    /// The keys of the job's pservers.
    pub fn pserver(&self) -> PserverKeys {
        PserverKeys {
            pservers: self.ps_prefix(),
            shard_map: self.shard_map(),
            replicas: self.pshards(),
            checkpoints: self.shard_checkpoints(),
            cluster_status: self.pserver_cluster_status(),
            members: self.trainers(),
            desired: self.ps_desired(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_design() {
        let k = JobKeys::new("mnist").unwrap();
        assert_eq!(k.master_lock(), "/oar/mnist/master/lock");
        assert_eq!(k.master_state(), "/oar/mnist/master/state");
        assert_eq!(k.master_journal_record(42), "/oar/mnist/master/journal/00000000000000000042");
        assert!(k.master_journal_record(42).starts_with(&k.master_journal()));
        assert_eq!(k.result(), "/oar/mnist/result");
        assert_eq!(k.instance(), "/oar/mnist/instance");
        assert_eq!(k.trainer("t1"), "/oar/mnist/trainer/t1");
        assert_eq!(k.ps("ps-a.1f"), "/oar/mnist/ps/ps-a.1f");
        assert_eq!(k.shard_map(), "/oar/mnist/shard_map");
        assert_eq!(k.ps_desired(), "/oar/mnist/ps_desired");
        assert_eq!(k.pserver_cluster_status(), "/oar/mnist/pserver_cluster_status");
        assert_eq!(k.trainer_id("/oar/mnist/trainer/t1"), Some("t1"));
        assert_eq!(k.trainer_id("/oar/mnist/ps/1"), None);
        let (master, pserver) = (k.master(), k.pserver());
        assert_eq!(master.journal_record(42), k.master_journal_record(42));
        assert_eq!((master.lock, master.members), (k.master_lock(), k.trainers()));
        assert_eq!(pserver.pserver("ps-a.1f"), k.ps("ps-a.1f"));
        assert_eq!(pserver.checkpoint(3), "/oar/mnist/shard_checkpoint/3");
        assert_eq!(pserver.replica(3, "ps-a.1f"), "/oar/mnist/pshards/3/ps-a.1f");
    }

    #[test]
    fn bad_job_names_are_refused_with_the_name() {
        for bad in ["", "a/b", "a b", ".", ".."] {
            let err = JobKeys::new(bad).unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }
}
