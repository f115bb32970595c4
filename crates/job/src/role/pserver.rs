//! The pserver role: claim a shard, serve it until the job ends.

use super::{read_config, unless_shut_down, RoleOptions};
use crate::{context::JobContext, keys::JobKeys, report::read_result, Error, Result};
use oar_discovery::ChangeSignal;
use oar_pserver::{Pserver, PserverOptions};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// What a pserver did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PserverReport {
    /// The shard index it served (none: it was shut down before it claimed one).
    pub index: Option<u32>,
    /// Updates applied to its shard (including those before a restart from
    /// a checkpoint).
    pub steps: u64,
    /// It stopped at the shutdown signal, not at the job's end.
    pub shut_down: bool,
}

/// Run a pserver of the job: read the job's options, claim the lowest free
/// index, load its checkpoint, serve until the job's report appears or
/// `shutdown` is cancelled, write a last checkpoint and release the index.
/// Errors if the pserver loses its lease (it stops serving).
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
    let stopped_early = PserverReport { index: None, steps: 0, shut_down: true };
    let config = read_config(&*ctx.discovery, &ctx.job, options.startup_timeout);
    let Some(config) = unless_shut_down(&shutdown, config).await else { return Ok(stopped_early) };
    let config = config?;
    let model = ctx.model(&config)?;
    let keys = JobKeys::new(&ctx.job)?;
    let ps_options = PserverOptions {
        keys: keys.pserver(),
        specs: model.param_specs(),
        servers: config.pservers,
        block_size: config.block_size,
        seed: config.seed,
        mode: config.mode,
        optimizer: config.optimizer.clone(),
        custom_optimizer: ctx.plugins.optimizer.clone(),
        lease_ttl: options.lease_ttl,
        claim_timeout: options.startup_timeout,
        checkpoint_dir: options.checkpoint_dir.clone(),
        checkpoint_interval: options.checkpoint_interval,
        index: options.pserver_index,
        ..PserverOptions::default()
    };
    let start = Pserver::start(ctx.discovery.clone(), ctx.transport.clone(), &ctx.listen, ps_options);
    let Some(server) = unless_shut_down(&shutdown, start).await else { return Ok(stopped_early) };
    let server = server?;
    let index = server.index();
    let mut changed = ChangeSignal::new(&*ctx.discovery, &keys.result()).await;
    let shut_down = loop {
        if let Some(why) = server.stopped() {
            return Err(Error::Stopped(format!("pserver {index}: {why}")));
        }
        if shutdown.is_cancelled() {
            tracing::info!(index, "shut down: last checkpoint, then the index is released");
            break true;
        }
        match read_result(&*ctx.discovery, &ctx.job).await {
            Ok(Some(report)) => {
                tracing::info!(index, state = ?report.state, "the job ended");
                break false;
            }
            Ok(None) => {}
            // Discovery away: the lease watch decides whether to stop.
            Err(Error::Discovery(e)) if e.is_transient() => {
                tracing::warn!(index, error = %e, "cannot read the job's result; retrying")
            }
            Err(e) => return Err(e),
        }
        let _ = unless_shut_down(&shutdown, changed.wait(options.checkpoint_interval.min(POLL))).await;
    };
    let steps = server.shutdown().await?;
    Ok(PserverReport { index: Some(index), steps, shut_down })
}

/// How often a pserver looks whether the job ended, at the longest (a
/// watch on the result wakes it at once).
const POLL: std::time::Duration = std::time::Duration::from_millis(250);
