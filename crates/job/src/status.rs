//! A running (or ended) job seen from outside, read from discovery alone:
//! what `examples/status.rs` prints.

use crate::{config::JobConfig, keys::JobKeys, report::JobReport, Result};
use oar_discovery::Discovery;
use oar_pserver::{checkpoint::CheckpointInfo, ShardMap};
use oar_task_queue::{MasterStatus, StoredState, StreamStatus};
use std::{collections::BTreeMap, fmt};

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
    /// Registered pservers: name and address, by name.
    pub pservers: BTreeMap<String, String>,
    /// The shard map, once the master's coordinator wrote one.
    pub shard_map: Option<ShardMap>,
    /// Each replica's state as it published it: `(shard, pserver)` to its
    /// JSON (role, applied update, epoch, step).
    pub replicas: BTreeMap<(u32, String), serde_json::Value>,
    /// Each shard's last checkpoint.
    pub checkpoints: BTreeMap<u32, CheckpointInfo>,
    /// The pservers' health as the coordinator wrote it (JSON).
    pub cluster_status: Option<serde_json::Value>,
    /// Registered trainers.
    pub trainers: Vec<String>,
    /// The task queue and per-pass statistics as the master last stored them.
    pub tasks: Option<MasterStatus>,
    /// The job's report, once it ended.
    pub result: Option<JobReport>,
    /// A streaming job's source position and lag, as the master last
    /// published them (every window).
    pub stream: Option<StreamStatus>,
    /// A streaming job was asked to close.
    pub stream_close_asked: bool,
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
            pservers: BTreeMap::new(),
            shard_map: None,
            replicas: BTreeMap::new(),
            checkpoints: BTreeMap::new(),
            cluster_status: None,
            trainers: Vec::new(),
            tasks: None,
            result: None,
            stream: None,
            stream_close_asked: false,
        };
        let listing = all.kvs.iter().map(|kv| (kv.key.as_str(), &kv.value[..]));
        let state = StoredState::from_listing(listing, &keys.master_state(), &keys.master_journal())?;
        let json = |key: &str, v: &[u8]| {
            serde_json::from_slice::<serde_json::Value>(v)
                .map_err(|e| crate::Error::BadConfig(format!("{key} is not JSON: {e}")))
        };
        for kv in &all.kvs {
            let key = kv.key.as_str();
            if key == keys.config() {
                view.config = Some(JobConfig::decode(&kv.value)?);
            } else if key == keys.master_lock() {
                view.master_holder = Some(text(&kv.value));
            } else if key == keys.master_addr() {
                view.master_addr = Some(text(&kv.value));
            } else if key == keys.result() {
                view.result = Some(JobReport::from_json(key, &kv.value)?);
            } else if key == keys.shard_map() {
                view.shard_map = Some(ShardMap::decode(&kv.value)?);
            } else if key == keys.stream_status() {
                view.stream = Some(
                    serde_json::from_slice(&kv.value)
                        .map_err(|e| crate::Error::BadConfig(format!("{key} does not decode: {e}")))?,
                );
            } else if key == keys.stream_close() {
                view.stream_close_asked = true;
            } else if key == keys.pserver_cluster_status() {
                view.cluster_status = Some(json(key, &kv.value)?);
            } else if let Some(id) = keys.trainer_id(key) {
                view.trainers.push(id.to_string());
            } else if let Some(name) = oar_discovery::member_name(&keys.ps_prefix(), key) {
                view.pservers.insert(name.to_string(), text(&kv.value));
            } else if let Some(shard) = key.strip_prefix(&keys.shard_checkpoints()) {
                let Ok(shard) = shard.parse::<u32>() else { continue };
                view.checkpoints.insert(shard, CheckpointInfo::decode(&kv.value)?);
            } else if let Some(rest) = key.strip_prefix(&keys.pshards()) {
                let Some((shard, name)) = rest.split_once('/') else { continue };
                let Ok(shard) = shard.parse::<u32>() else { continue };
                view.replicas.insert((shard, name.to_string()), json(key, &kv.value)?);
            }
        }
        if let (Some(state), Some(config)) = (state, &view.config) {
            view.tasks = Some(state.status(config.queue())?);
        }
        Ok(Some(view))
    }
}

fn or<'a>(s: &'a str, default: &'a str) -> &'a str {
    if s.is_empty() {
        default
    } else {
        s
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
        let health = self.cluster_status.as_ref();
        let said = |field: &str| health.and_then(|h| h.get(field)).and_then(|v| v.as_str()).unwrap_or("");
        let wanted = health.and_then(|h| h.get("desired")).and_then(|v| v.as_u64());
        writeln!(
            f,
            "  pservers: {} registered, {} wanted; cluster {} {}",
            self.pservers.len(),
            wanted.map_or("?".to_string(), |w| w.to_string()),
            or(said("status"), "UNKNOWN"),
            said("reason")
        )?;
        for (name, addr) in &self.pservers {
            writeln!(f, "    {name} at {addr}")?;
        }
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        match &self.shard_map {
            None => writeln!(f, "  shard map: none yet")?,
            Some(map) => {
                writeln!(
                    f,
                    "  shard map version {}, {} shards, {} replicas each",
                    map.version(),
                    map.shard_count(),
                    map.replicas()
                )?;
                for shard in 0..map.shard_count() {
                    write!(f, "    shard {shard}:")?;
                    let set = map.replica_set(shard);
                    if set.is_empty() {
                        write!(f, " no replica")?;
                    }
                    let primary_applied = set
                        .first()
                        .and_then(|p| self.replicas.get(&(shard, p.clone())))
                        .and_then(|v| v["applied"].as_u64());
                    for name in set {
                        let state = self.replicas.get(&(shard, name.clone()));
                        let status = state.and_then(|v| v["status"].as_str()).unwrap_or("unknown");
                        let applied = state.and_then(|v| v["applied"].as_u64());
                        write!(f, " {name} {status}")?;
                        match (status, applied, primary_applied) {
                            ("follower", Some(a), Some(p)) => write!(f, " (lag {})", p.saturating_sub(a))?,
                            (_, Some(a), _) => write!(f, " (applied {a})")?,
                            _ => {}
                        }
                    }
                    match self.checkpoints.get(&shard) {
                        Some(c) => writeln!(
                            f,
                            "; checkpoint at step {} ({:.1} s ago)",
                            c.step,
                            now_ms.saturating_sub(c.unix_time_ms) as f64 / 1000.0
                        )?,
                        None => writeln!(f)?,
                    }
                }
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
        if let Some(c) = self.config.as_ref().and_then(|c| c.stream.as_ref()) {
            writeln!(
                f,
                "  stream: {:?}{}",
                c.source,
                if self.stream_close_asked { " (close asked)" } else { "" }
            )?;
        }
        if let Some(s) = &self.stream {
            let mean_lag = s.lag_sum_seconds / s.lag_count.max(1) as f64;
            writeln!(
                f,
                "    {}: {}{}; backlog {} tasks, oldest open {:.1} s; lag from arrival to training {:.2} s (mean of {})",
                s.source,
                s.position,
                if s.closed { ", closed" } else { "" },
                s.backlog,
                s.oldest_open_seconds,
                mean_lag,
                s.lag_count
            )?;
            for problem in &s.problems {
                writeln!(f, "    problem: {problem}")?;
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
