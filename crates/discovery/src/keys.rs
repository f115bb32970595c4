//! The key layout of one job in the discovery store (DESIGN.md, "Key layout").
//!
//! Every process of a job derives its keys from [`JobKeys`], so the layout is
//! written down once.

/// The keys of one job, all under `/oar/<job>/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobKeys {
    prefix: String,
}

impl JobKeys {
    /// Keys of job `job`. A job name is non-empty and has no `/`.
    pub fn new(job: &str) -> crate::Result<Self> {
        if job.is_empty() || job.contains('/') || job.chars().any(char::is_whitespace) {
            return Err(crate::Error::InvalidArgument(format!(
                "job name {job:?} must be non-empty, without '/' or whitespace"
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
        format!("{}master/journal/{version:020}", self.prefix)
    }
    /// The job's options, published once by the master.
    pub fn config(&self) -> String {
        format!("{}config", self.prefix)
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
    /// The number of pservers the job wants.
    pub fn ps_desired(&self) -> String {
        format!("{}ps_desired", self.prefix)
    }
    /// Every pserver's keys: their addresses and checkpoints.
    pub fn ps_prefix(&self) -> String {
        format!("{}ps/", self.prefix)
    }
    /// Pserver `index`'s address, claimed by create-if-absent under its lease.
    pub fn ps(&self, index: u32) -> String {
        format!("{}ps/{index}", self.prefix)
    }
    /// The latest checkpoint of pserver `index`.
    pub fn ps_checkpoint(&self, index: u32) -> String {
        format!("{}ps/{index}/checkpoint", self.prefix)
    }
    /// The trainer id in a key under [`JobKeys::trainers`], if it is one.
    pub fn trainer_id<'a>(&self, key: &'a str) -> Option<&'a str> {
        key.strip_prefix(&self.trainers()).filter(|id| !id.is_empty() && !id.contains('/'))
    }
}

/// The trainers of a job leaving it: yields the id of each trainer whose
/// registration is deleted (lease expired or revoked, or closed), from the
/// moment it is created on. The master takes such a trainer's tasks back and
/// the pservers drop it from the sync barrier.
pub struct TrainerDepartures {
    keys: JobKeys,
    watch: crate::WatchStream,
    present: Vec<String>,
}

impl TrainerDepartures {
    /// Start following the registrations under [`JobKeys::trainers`].
    pub async fn watch(discovery: &dyn crate::Discovery, keys: &JobKeys) -> crate::Result<Self> {
        let now = discovery.get_prefix(&keys.trainers()).await?;
        let present = now.kvs.iter().filter_map(|kv| keys.trainer_id(&kv.key)).map(str::to_string).collect();
        let watch = discovery.watch_prefix(&keys.trainers(), now.revision + 1).await?;
        Ok(Self { keys: keys.clone(), watch, present })
    }

    /// The trainers registered when the watch started (sorted). Anyone
    /// holding work who is not among them left before the watch began: a
    /// restarted master takes their tasks back with this, with no gap
    /// between the listing and the watch.
    pub fn present(&self) -> &[String] {
        &self.present
    }

    /// The next trainer that left; `None` when the watch ended, an error
    /// when it failed (the caller then relies on timeouts).
    pub async fn next(&mut self) -> Option<crate::Result<String>> {
        loop {
            match self.watch.next().await? {
                Ok(crate::WatchEvent::Delete { key, .. }) => {
                    if let Some(id) = self.keys.trainer_id(&key) {
                        return Some(Ok(id.to_string()));
                    }
                }
                Ok(crate::WatchEvent::Put(_)) => {}
                Err(e) => return Some(Err(e)),
            }
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
        assert_eq!(k.trainer("t1"), "/oar/mnist/trainer/t1");
        assert_eq!(k.ps(3), "/oar/mnist/ps/3");
        assert_eq!(k.ps_checkpoint(3), "/oar/mnist/ps/3/checkpoint");
        assert_eq!(k.trainer_id("/oar/mnist/trainer/t1"), Some("t1"));
        assert_eq!(k.trainer_id("/oar/mnist/ps/1"), None);
    }

    #[test]
    fn bad_job_names_are_refused_with_the_name() {
        for bad in ["", "a/b", "a b"] {
            let err = JobKeys::new(bad).unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }
}

#[cfg(test)]
mod departure_tests {
    use super::*;
    use crate::{Discovery, MemDiscovery};
    use std::time::Duration;

    #[tokio::test]
    async fn departures_name_trainers_whose_lease_ended_and_ignore_other_keys() {
        let d = MemDiscovery::new();
        let keys = JobKeys::new("j").unwrap();
        let lease = d.grant_lease(Duration::from_secs(30)).await.unwrap();
        d.put(&keys.trainer("t1"), vec![], Some(lease)).await.unwrap();
        let mut departures = TrainerDepartures::watch(&d, &keys).await.unwrap();
        d.put(&keys.trainer("t2"), vec![], None).await.unwrap();
        d.put(&keys.ps(0), vec![], None).await.unwrap();
        d.delete(&keys.ps(0)).await.unwrap();
        d.revoke_lease(lease).await.unwrap();
        let id = tokio::time::timeout(Duration::from_secs(2), departures.next()).await.unwrap();
        assert_eq!(id.unwrap().unwrap(), "t1");
    }
}
