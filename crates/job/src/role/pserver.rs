//! The pserver role: register, serve the shards the job's shard map gives
//! it (as primary or follower), until the job ends.

use super::{job_checkpoint_dir, read_config, read_instance, unless_shut_down, RoleOptions};
use crate::{context::JobContext, keys::JobKeys, report::read_result, Error, Result};
use oar_discovery::ChangeSignal;
use oar_pserver::{Pserver, PserverOptions};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// What a pserver did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PserverReport {
    /// The name it registered under (none: it was shut down before it registered).
    pub name: Option<String>,
    /// The shards it was primary of at the end, with their steps (updates
    /// applied, including those before a failover or a restore).
    pub primaries: std::collections::BTreeMap<u32, u64>,
    /// For each of those shards, the trainer pushes it applied over its
    /// life (async: its step; sync: every push each step combined): the
    /// exact count of acknowledged pushes the tests compare with.
    pub pushes: std::collections::BTreeMap<u32, u64>,
    /// For each of those shards that applied anything, each trainer's last
    /// push seq there: in async mode trainer `t` had `seq + 1` pushes
    /// applied to the shard, each once (see [`oar_pserver::PrimaryAtStop`]),
    /// which is how the tests count pushes of trainers that were killed.
    pub trainer_seqs: std::collections::BTreeMap<u32, std::collections::BTreeMap<String, u64>>,
    /// For each of those shards that holds table rows, the row updates they
    /// hold ([`oar_pserver::ParamStore::row_updates`]): in async mode the
    /// exact count of acknowledged row gradients the shard applied.
    pub row_updates: std::collections::BTreeMap<u32, u64>,
    /// For each of those shards that holds table rows, how many
    /// ([`oar_pserver::ParamStore::rows_held`]).
    pub rows: std::collections::BTreeMap<u32, u64>,
    /// It stopped at the shutdown signal, not at the job's end.
    pub shut_down: bool,
    /// The job released it: drained of its replicas after a scale-in, or
    /// beyond the pservers the job wants (`ps_desired`) when it registered.
    pub released: bool,
}

/// Run a pserver of the job: read the job's options, register, serve what
/// the shard map gives it until the job's report appears or `shutdown` is
/// cancelled, write a last checkpoint of the shards it is primary of and
/// release its registration. Errors if the pserver loses its lease (it
/// stops serving).
pub async fn pserver(
    ctx: &JobContext,
    options: &RoleOptions,
    shutdown: CancellationToken,
) -> Result<PserverReport> {
    let span = tracing::info_span!("pserver", job = %ctx.job, id = %options.id);
    run_pserver(ctx, options, shutdown).instrument(span).await
}

async fn run_pserver(
    ctx: &JobContext,
    options: &RoleOptions,
    shutdown: CancellationToken,
) -> Result<PserverReport> {
    let stopped_early = PserverReport {
        name: None,
        primaries: Default::default(),
        pushes: Default::default(),
        trainer_seqs: Default::default(),
        row_updates: Default::default(),
        rows: Default::default(),
        shut_down: true,
        released: false,
    };
    let config = read_config(&*ctx.discovery, &ctx.job, options.startup_timeout);
    let Some(config) = unless_shut_down(&shutdown, config).await else { return Ok(stopped_early) };
    let config = config?;
    let model = ctx.model(&config)?;
    let keys = JobKeys::new(&ctx.job)?;
    let checkpoint_dir = match &options.checkpoint_dir {
        Some(root) => {
            let instance = read_instance(&*ctx.discovery, &ctx.job).await?;
            if instance.is_none() {
                tracing::warn!(
                    dir = %root.display(),
                    "the job has no run id (a master of an older oar started it): its checkpoints stay in the directory itself"
                );
            }
            Some(job_checkpoint_dir(root, &ctx.job, instance.as_deref()))
        }
        None => None,
    };
    let ps_options = PserverOptions {
        keys: keys.pserver(),
        name: options.id.clone(),
        specs: model.param_specs(),
        tables: model.table_specs(),
        shards: config.shards,
        block_size: config.block_size,
        seed: config.seed,
        mode: config.mode,
        optimizer: config.optimizer.clone(),
        custom_optimizer: ctx.plugins.optimizer.clone(),
        lease_ttl: options.lease_ttl,
        checkpoint_dir,
        checkpoint_interval: options.checkpoint_interval,
        call_timeout: options.call_timeout,
        ..PserverOptions::default()
    };
    let start = Pserver::start(ctx.discovery.clone(), ctx.transport.clone(), &ctx.listen, ps_options);
    let Some(server) = unless_shut_down(&shutdown, start).await else { return Ok(stopped_early) };
    let server = server?;
    let name = server.name().to_string();
    let mut changed = ChangeSignal::new(&*ctx.discovery, &keys.result()).await;
    let (shut_down, released) = loop {
        if server.released() {
            tracing::info!(name, "released by the job: it holds nothing and the job wants fewer pservers");
            break (false, true);
        }
        if let Some(why) = server.stopped() {
            return Err(Error::Stopped(format!("pserver {name}: {why}")));
        }
        if shutdown.is_cancelled() {
            tracing::info!(name, "shut down: last checkpoints, then the registration is released");
            break (true, false);
        }
        match read_result(&*ctx.discovery, &ctx.job).await {
            Ok(Some(report)) => {
                tracing::info!(name, state = ?report.state, "the job ended");
                break (false, false);
            }
            Ok(None) => {}
            // Discovery away: the lease watch decides whether to stop.
            Err(Error::Discovery(e)) if e.is_transient() => {
                tracing::warn!(name, error = %e, "cannot read the job's result; retrying")
            }
            Err(e) => return Err(e),
        }
        let _ = unless_shut_down(&shutdown, changed.wait(options.checkpoint_interval.min(POLL))).await;
    };
    let held = server.shutdown().await?;
    let primaries = held.iter().map(|(&shard, at)| (shard, at.step)).collect();
    let pushes = held.iter().map(|(&shard, at)| (shard, at.pushes)).collect();
    let row_updates = held
        .iter()
        .filter(|(_, at)| at.row_updates > 0)
        .map(|(&shard, at)| (shard, at.row_updates))
        .collect();
    let rows = held.iter().filter(|(_, at)| at.rows > 0).map(|(&shard, at)| (shard, at.rows)).collect();
    let trainer_seqs =
        held.into_iter().filter(|(_, at)| at.step > 0).map(|(shard, at)| (shard, at.last_seqs)).collect();
    Ok(PserverReport {
        name: Some(name),
        primaries,
        pushes,
        trainer_seqs,
        row_updates,
        rows,
        shut_down,
        released,
    })
}

/// How often a pserver looks whether the job ended, at the longest (a
/// watch on the result wakes it at once).
const POLL: std::time::Duration = std::time::Duration::from_millis(250);
