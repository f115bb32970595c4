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
    /// The job's options, published once by the master.
    pub fn config(&self) -> String {
        format!("{}config", self.prefix)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_design() {
        let k = JobKeys::new("mnist").unwrap();
        assert_eq!(k.master_lock(), "/oar/mnist/master/lock");
        assert_eq!(k.master_state(), "/oar/mnist/master/state");
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
