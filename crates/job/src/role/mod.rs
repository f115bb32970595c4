//! The three roles of a job (master, pserver, trainer) as functions a
//! binary calls; `examples/master.rs`, `examples/pserver.rs` and
//! `examples/trainer.rs` are thin wrappers around them, and
//! [`run_local`](crate::local::run_local) runs all three in one process.
//!
//! The job's options ([`JobConfig`]) are given to the master only. It
//! publishes them under `/oar/<job>/config` (through `Master::start`, after
//! taking the lock) and pservers and trainers read them from there
//! ([`read_config`]), so their command lines carry nothing about the model.
//! A master given options that differ from the published ones refuses to
//! start, naming the options that differ.
//!
//! How a job ends: trainers stop when the master answers `Done` (or
//! `Failed`); the master scores the final model, writes the job's report
//! (JSON) under `/oar/<job>/result` through its fence, waits a little for the
//! trainers to deregister ([`RoleOptions::linger`]) and returns; pservers
//! watch `result`, write a last checkpoint and return. A master that starts
//! (or takes over) after the report was written returns that report.
//!
//! # Shutdown
//!
//! Every role takes a [`CancellationToken`]; cancelling it (the binaries do
//! on SIGTERM and SIGINT) stops the role gracefully, and it returns `Ok`:
//!
//! - a **pserver** stops taking pushes (they are refused as "unavailable",
//!   so trainers retry them on the shard's next primary), writes a last
//!   checkpoint of every shard it is primary of, and releases its
//!   registration (revokes its lease), so the master's coordinator gives
//!   its shards to their followers, or (one replica per shard) to other
//!   pservers from those checkpoints, at once: no acknowledged push is
//!   lost;
//! - a **master** stores its state, then releases its lock and address, so
//!   a standby takes over at once, not after a lease ttl; a standby that is
//!   stopped stops waiting;
//! - a **trainer** hands back the task it fetched ahead, finishes the task
//!   it is training if that takes at most [`RoleOptions::stop_grace`] (else
//!   hands it back too, after pushing the gradients it computed), waits for
//!   its reports, leaves the sync barrier and deregisters. A task handed
//!   back goes to the front of todo without counting as a failure; like a
//!   trainer's crash, it leaves the examples of the batches it pushed
//!   trained once more by the trainer that redoes the task.
//!
//! Every wait of a role (for the config, the lock, the pservers, a step)
//! also ends at the shutdown signal.
//!
//! Each role runs in a `tracing` span named after it, with the job and the
//! process's id; a trainer's work on a task is in a `task` span (task id,
//! pass), so every log line says where it comes from.

mod master;
mod pserver;
mod trainer;

pub use master::{close_stream, export_model, master, EXPORT_FILE, EXPORT_MAGIC, TRAIN_SAMPLE_BYTES};
pub use pserver::{pserver, PserverReport};
pub use trainer::trainer;

use crate::{config::JobConfig, keys::JobKeys, Error, Result};
use oar_discovery::{ChangeSignal, Discovery};
use oar_transport::RetryPolicy;
use std::{path::PathBuf, time::Duration};
use tokio_util::sync::CancellationToken;

/// Timing and local options of a role; each role reads the fields it needs.
#[derive(Clone, Debug)]
pub struct RoleOptions {
    /// This process's id: the master's lock holder, or the trainer's
    /// registration `trainer/<id>` (trainer ids also order the sync
    /// combination). Non-empty, without `/` or whitespace.
    pub id: String,
    /// The role's lease: when it expires (the process died or lost etcd)
    /// the job takes back what it held.
    pub lease_ttl: Duration,
    /// Bound of one call to the master or a pserver.
    pub call_timeout: Duration,
    /// How long a master or pserver that is away is retried before the
    /// caller gives up with an error (trainers pause their updates meanwhile).
    pub retry_for: Duration,
    /// How long to wait at start for the job's config, a free pserver
    /// index, a trainer id held by a dead process, or all pservers to be up
    /// (a trainer's wait, and a job's first master's: it stops, saying which
    /// shards have no pserver, rather than wait silently).
    pub startup_timeout: Duration,
    /// How long a standby master waits for the lock.
    pub standby_timeout: Duration,
    /// Master: how long to wait after the job ends for the trainers to
    /// deregister, so that none is left asking a master that is gone.
    pub linger: Duration,
    /// Trainer: at shutdown, how long the task in hand may take to finish
    /// before it is handed back instead.
    pub stop_grace: Duration,
    /// Trainer: notified whenever the master accepted its reports (what a
    /// progress display follows).
    pub on_report: Option<std::sync::Arc<tokio::sync::Notify>>,
    /// Pserver: where checkpoints go (`<dir>/<job>/<instance>/shard-<s>/`,
    /// see [`job_checkpoint_dir`]); none: no checkpoints. Every pserver of a job must see the same directory (a
    /// shared volume): a shard's checkpoints are written by its primary,
    /// whichever pserver that is, and restored by whichever pserver the
    /// coordinator gives the shard to.
    pub checkpoint_dir: Option<PathBuf>,
    /// Pserver: how often a checkpoint is written. A crash loses at most
    /// the updates of one interval; a graceful shutdown loses none.
    pub checkpoint_interval: Duration,
}

impl Default for RoleOptions {
    /// A process called [`default_id`]`("oar")`: 5 s leases, 10 s calls,
    /// members that are away retried for 5 minutes, 60 s to start, a standby
    /// that waits a day, 10 s to linger and to finish a task at shutdown,
    /// checkpoints every 60 s when a directory is given.
    fn default() -> Self {
        Self {
            id: default_id("oar"),
            lease_ttl: Duration::from_secs(5),
            call_timeout: Duration::from_secs(10),
            retry_for: Duration::from_secs(300),
            startup_timeout: Duration::from_secs(60),
            standby_timeout: Duration::from_secs(24 * 3600),
            linger: Duration::from_secs(10),
            stop_grace: Duration::from_secs(10),
            on_report: None,
            checkpoint_dir: None,
            checkpoint_interval: Duration::from_secs(60),
        }
    }
}

impl RoleOptions {
    /// The defaults for a process called `id`.
    pub fn new(id: impl Into<String>) -> Self {
        Self { id: id.into(), ..Self::default() }
    }

    fn retry(&self) -> RetryPolicy {
        RetryPolicy { give_up_after: self.retry_for, ..RetryPolicy::default() }
    }
}

/// A default id for a process of role `role` on this machine:
/// `<role>-<hostname>-<pid>`.
pub fn default_id(role: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().replace(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'), "-"))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_string());
    format!("{role}-{host}-{}", std::process::id())
}

/// A new id for a run of a job ([`JobKeys::instance`]): 16 hex digits,
/// random per process and call.
pub(crate) fn new_instance_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{:016x}", RandomState::new().hash_one((now, std::process::id())))
}

/// The id of this run of the job, which its first master created before it
/// published the options (read those first). `None` for a job whose
/// options were published by a master of an oar before run ids: its
/// checkpoints stay where they were, `<root>/shard-<s>`. A value that is
/// not a short run of hex digits is refused: it names a directory.
pub async fn read_instance(discovery: &dyn Discovery, job: &str) -> Result<Option<String>> {
    let key = JobKeys::new(job)?.instance();
    let Some(kv) = discovery.get(&key).await? else { return Ok(None) };
    match String::from_utf8(kv.value) {
        Ok(id) if (1..=32).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(Some(id)),
        _ => Err(Error::BadConfig(format!("the job's instance id at {key} is not 1 to 32 hex digits"))),
    }
}

/// Where a run of a job keeps its checkpoints under the pservers'
/// `--checkpoint-dir`: `<root>/<job>/<instance>/` (a shard's in
/// `shard-<s>/` there). Another job, or the same name run afresh after its
/// keys were deleted, never resumes from this run's checkpoints. A job
/// without a run id (see [`read_instance`]) keeps `<root>` itself.
pub fn job_checkpoint_dir(root: &std::path::Path, job: &str, instance: Option<&str>) -> PathBuf {
    match instance {
        Some(instance) => root.join(job).join(instance),
        None => root.to_path_buf(),
    }
}

/// Wait up to `timeout` for the job's options under `/oar/<job>/config`.
pub async fn read_config(discovery: &dyn Discovery, job: &str, timeout: Duration) -> Result<JobConfig> {
    let key = JobKeys::new(job)?.config();
    let deadline = oar_transport::deadline_in(timeout);
    let mut changed = ChangeSignal::new(discovery, &key).await;
    loop {
        if let Some(kv) = discovery.get(&key).await? {
            return JobConfig::decode(&kv.value);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!("the job's options at {key} (is a master running?)"),
                after: timeout,
            });
        }
        changed.wait(Duration::from_millis(100)).await;
    }
}

/// `future`'s output, or `None` if `shutdown` is cancelled first.
async fn unless_shut_down<T>(
    shutdown: &CancellationToken,
    future: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => None,
        out = future => Some(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oar_discovery::MemDiscovery;
    use std::path::Path;

    #[tokio::test]
    async fn a_run_id_names_the_checkpoint_directory_and_a_job_without_one_keeps_the_root() {
        let discovery = MemDiscovery::new();
        let key = JobKeys::new("j").unwrap().instance();
        // A job an oar before run ids started: no id, the directory as it was.
        assert_eq!(read_instance(&discovery, "j").await.unwrap(), None);
        assert_eq!(job_checkpoint_dir(Path::new("/c"), "j", None), Path::new("/c"));
        discovery.put(&key, new_instance_id().into_bytes(), None).await.unwrap();
        let id = read_instance(&discovery, "j").await.unwrap().expect("an id");
        assert_eq!(id.len(), 16);
        assert_eq!(job_checkpoint_dir(Path::new("/c"), "j", Some(&id)), Path::new("/c/j").join(&id));
        discovery.put(&key, b"../../etc".to_vec(), None).await.unwrap();
        let err = read_instance(&discovery, "j").await.unwrap_err().to_string();
        assert!(err.contains(&key) && err.contains("hex"), "{err}");
    }
}
