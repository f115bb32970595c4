//! A running (or ended) job seen from outside, read from discovery alone:
//! what `examples/status.rs` prints.

use crate::{config::JobConfig, keys::JobKeys, report::JobReport, Result};
use oar_discovery::Discovery;
use oar_pserver::checkpoint::CheckpointInfo;
use oar_task_queue::{MasterStatus, StoredState};
use std::fmt;

/// Everything discovery knows about one job.
#[derive(Clone, Debug)]
pub struct JobView {
    /// The job's name.
    pub job: String,
    /// The job's options, if a master published them.
    pub config: Option<JobConfig>,
    /// The master holding the lock, if any.
    pub master_holder: Option<String>,
    /// Where the master serves, if it does.
    pub master_addr: Option<String>,
    /// Pservers wanted.
    pub pservers_desired: Option<u32>,
    /// Pservers up, by index.
    pub pservers: Vec<PserverView>,
    /// Registered trainers.
    pub trainers: Vec<String>,
    /// The task queue and per-pass statistics as the master last stored them.
    pub tasks: Option<MasterStatus>,
    /// The job's report, once it ended.
    pub result: Option<JobReport>,
}

/// One pserver index: who serves it and its last checkpoint.
#[derive(Clone, Debug)]
pub struct PserverView {
    /// The shard index.
    pub index: u32,
    /// The address of the pserver holding it (none: nobody holds it now).
    pub addr: Option<String>,
    /// The last checkpoint recorded for it.
    pub checkpoint: Option<CheckpointInfo>,
}

impl JobView {
    /// Read job `job`; `None` if discovery holds nothing of it. Values that
    /// do not decode are an error naming the key.
    pub async fn read(discovery: &dyn Discovery, job: &str) -> Result<Option<JobView>> {
        let keys = JobKeys::new(job)?;
        let all = discovery.get_prefix(keys.prefix()).await?;
        if all.kvs.is_empty() {
            return Ok(None);
        }
        let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
        let mut view = JobView {
            job: job.to_string(),
            config: None,
            master_holder: None,
            master_addr: None,
            pservers_desired: None,
            pservers: Vec::new(),
            trainers: Vec::new(),
            tasks: None,
            result: None,
        };
        let listing = all.kvs.iter().map(|kv| (kv.key.as_str(), &kv.value[..]));
        let state = StoredState::from_listing(listing, &keys.master_state(), &keys.master_journal())?;
        let ps_prefix = format!("{}ps/", keys.prefix());
        for kv in &all.kvs {
            let key = kv.key.as_str();
            if key == keys.config() {
                view.config = Some(JobConfig::decode(&kv.value)?);
            } else if key == keys.master_lock() {
                view.master_holder = Some(text(&kv.value));
            } else if key == keys.master_addr() {
                view.master_addr = Some(text(&kv.value));
            } else if key == keys.ps_desired() {
                view.pservers_desired = text(&kv.value).trim().parse().ok();
            } else if key == keys.result() {
                view.result = Some(JobReport::from_json(key, &kv.value)?);
            } else if let Some(id) = keys.trainer_id(key) {
                view.trainers.push(id.to_string());
            } else if let Some(rest) = key.strip_prefix(&ps_prefix) {
                let (index, checkpoint) = match rest.split_once('/') {
                    Some((index, "checkpoint")) => (index, true),
                    _ => (rest, false),
                };
                let Ok(index) = index.parse::<u32>() else { continue };
                let at = match view.pservers.iter().position(|p| p.index == index) {
                    Some(at) => at,
                    None => {
                        view.pservers.push(PserverView { index, addr: None, checkpoint: None });
                        view.pservers.len() - 1
                    }
                };
                if checkpoint {
                    view.pservers[at].checkpoint = Some(CheckpointInfo::decode(&kv.value)?);
                } else {
                    view.pservers[at].addr = Some(text(&kv.value));
                }
            }
        }
        view.pservers.sort_by_key(|p| p.index);
        if let (Some(state), Some(config)) = (state, &view.config) {
            view.tasks = Some(state.status(config.queue())?);
        }
        Ok(Some(view))
    }
}

impl fmt::Display for JobView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "job {}", self.job)?;
        if let Some(c) = &self.config {
            writeln!(
                f,
                "  options: {:?}, {:?}, {:?}, {} passes, batch {}, data {}",
                c.model, c.optimizer, c.mode, c.passes, c.batch_size, c.data
            )?;
        }
        match (&self.master_holder, &self.master_addr) {
            (Some(holder), addr) => {
                writeln!(f, "  master: {holder} at {}", addr.as_deref().unwrap_or("(not serving yet)"))?
            }
            (None, _) => writeln!(f, "  master: none holds the lock")?,
        }
        let desired = self.pservers_desired.map(|d| d.to_string()).unwrap_or_else(|| "?".into());
        writeln!(
            f,
            "  pservers: {} up of {desired}",
            self.pservers.iter().filter(|p| p.addr.is_some()).count()
        )?;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        for p in &self.pservers {
            write!(f, "    ps/{}: {}", p.index, p.addr.as_deref().unwrap_or("down"))?;
            match &p.checkpoint {
                Some(c) => writeln!(
                    f,
                    ", checkpoint at step {} ({:.1} s ago, {} bytes, {})",
                    c.step,
                    now_ms.saturating_sub(c.unix_time_ms) as f64 / 1000.0,
                    c.bytes,
                    c.path
                )?,
                None => writeln!(f, ", no checkpoint")?,
            }
        }
        writeln!(f, "  trainers: {}", self.trainers.len())?;
        for t in &self.trainers {
            writeln!(f, "    {t}")?;
        }
        if let Some(s) = &self.tasks {
            let q = &s.queue;
            writeln!(
                f,
                "  tasks: pass {}/{} {:?}: todo {}, pending {}, done {}, discarded {}, failures {}",
                q.pass + 1,
                q.passes,
                q.state,
                q.todo,
                q.pending,
                q.done,
                q.discarded,
                q.failures
            )?;
            for (pass, p) in s.passes.iter().enumerate() {
                writeln!(
                    f,
                    "    pass {}: {} tasks finished, {} examples, mean loss {:.4}",
                    pass + 1,
                    p.tasks_finished,
                    p.examples,
                    p.mean_loss()
                )?;
            }
            for (task, why) in &s.discarded {
                writeln!(f, "    discarded task {task}: {why}")?;
            }
        }
        if let Some(r) = &self.result {
            writeln!(
                f,
                "  ended: {}, test accuracy {:.2}%, {} tasks done",
                r.state,
                r.test_accuracy * 100.0,
                r.tasks_done
            )?;
        }
        Ok(())
    }
}
