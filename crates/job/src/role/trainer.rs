//! The trainer role: register with the job, find the master and the
//! pservers, run the training loop, deregister.

use super::{read_config, unless_shut_down, RoleOptions};
use crate::{
    context::JobContext,
    keys::JobKeys,
    report::{read_result, JobEnd},
    Error, Result,
};
use oar_discovery::{ChangeSignal, Discovery, Session};
use oar_pserver::{PserverClient, PserverClientOptions};
use oar_task_queue::{MasterClient, MasterClientOptions};
use oar_trainer::worker::{run_trainer, TrainerOptions, TrainerReport};
use std::{sync::Arc, time::Duration};
use tokio_util::{sync::CancellationToken, task::AbortOnDropHandle};
use tracing::Instrument;

/// Run a trainer of the job: read the job's options, register
/// `trainer/<id>` under its lease, wait for the pservers, train on tasks
/// until the master says the job is over (or `shutdown` is cancelled: see
/// [the module docs](super#shutdown)), deregister.
pub async fn trainer(
    ctx: &JobContext,
    options: &RoleOptions,
    shutdown: CancellationToken,
) -> Result<TrainerReport> {
    let span = tracing::info_span!("trainer", job = %ctx.job, id = %options.id);
    run_trainer_role(ctx, options, shutdown).instrument(span).await
}

async fn run_trainer_role(
    ctx: &JobContext,
    options: &RoleOptions,
    shutdown: CancellationToken,
) -> Result<TrainerReport> {
    let id = &options.id;
    if id.is_empty()
        || id.len() > oar_task_queue::MAX_TRAINER_ID_BYTES
        || id.contains('/')
        || id.chars().any(char::is_whitespace)
    {
        return Err(Error::BadConfig(format!(
            "trainer id {id:?} must be 1 to {} bytes, without '/' or whitespace",
            oar_task_queue::MAX_TRAINER_ID_BYTES
        )));
    }
    let stopped_early = TrainerReport { shut_down: true, ..TrainerReport::default() };
    let config = read_config(&*ctx.discovery, &ctx.job, options.startup_timeout);
    let Some(config) = unless_shut_down(&shutdown, config).await else { return Ok(stopped_early) };
    let config = config?;
    if let Some(report) = read_result(&*ctx.discovery, &ctx.job).await? {
        return Err(Error::JobOver { job: ctx.job.clone(), state: report.state });
    }
    let model = ctx.model(&config)?;
    let placement = Arc::new(config.placement_for(&model)?);
    let keys = JobKeys::new(&ctx.job)?;

    let session = Session::start(ctx.discovery.clone(), options.lease_ttl).await?;
    let key = keys.trainer(id);
    let registered = register(&*ctx.discovery, &key, id, &session, options.startup_timeout);
    let Some(registered) = unless_shut_down(&shutdown, registered).await else {
        session.close().await?;
        return Ok(stopped_early);
    };
    if let Err(e) = registered {
        // Give the lease back now rather than at its expiry.
        if let Err(closing) = session.close().await {
            tracing::warn!(error = %closing, "closing the trainer's session after a failed registration");
        }
        return Err(e);
    }
    let master = MasterClient::new(
        ctx.discovery.clone(),
        ctx.transport.clone(),
        MasterClientOptions {
            call_timeout: options.call_timeout,
            retry: options.retry(),
            ..MasterClientOptions::new(keys.master_addr())
        },
    );
    let client_options = PserverClientOptions {
        call_timeout: options.call_timeout,
        retry: options.retry(),
        ..PserverClientOptions::new(keys.pserver(), id.clone())
    };
    // Above the seqs of any earlier process of this id (see first_seq).
    tracing::info!(trainer = id, first_seq = client_options.first_seq, "pushes numbered from first_seq");
    let pservers =
        PserverClient::new(ctx.discovery.clone(), ctx.transport.clone(), placement, client_options);
    // The pservers come up, or the job ends meanwhile (they never will).
    let up = async {
        tokio::select! {
            up = pservers.wait_for_servers(options.startup_timeout) => up.map_err(Error::from),
            state = job_ended(&*ctx.discovery, &ctx.job) => {
                Err(Error::JobOver { job: ctx.job.clone(), state: state? })
            }
        }
    };
    let result = match unless_shut_down(&shutdown, up).await {
        None => Ok(stopped_early),
        Some(Err(e)) => Err(e),
        Some(Ok(())) => {
            let trainer_options = TrainerOptions {
                batch_size: config.batch_size,
                mode: config.mode,
                push_every: config.push_every,
                pull_every: config.pull_every,
                overlap: config.overlap,
                stop_grace: options.stop_grace,
                reported: options.on_report.clone(),
                ..TrainerOptions::new(id.clone(), config.reader())
            };
            // The loop runs as a task of its own: called from a binary's
            // `main` (`block_on`'s thread), each call's answer would come
            // from another thread and wake it there; a task's calls stay on
            // one worker (BENCHMARKS.md, Transport: a small call 12 µs
            // against 38). Aborted if this future is dropped.
            let training =
                run_trainer(Arc::new(master), pservers, model, session.guard(), trainer_options, shutdown);
            let training = AbortOnDropHandle::new(tokio::spawn(training.in_current_span()));
            // The loop checks the lease before each step, but a call to a
            // master or pserver that is away is retried for `retry_for`:
            // a trainer cut off from etcd stops when its lease is lost,
            // not minutes later, as a master or pserver does.
            tokio::select! {
                trained = training => match trained {
                    Ok(trained) => trained.map_err(Error::from),
                    Err(e) => Err(Error::Panicked(format!("trainer {id}: {e}"))),
                },
                () = session.lost_signal() => Err(Error::from(oar_trainer::Error::LeaseLost)),
            }
        }
    };
    // Deregister: the master and the pservers see this trainer leave now,
    // not a lease ttl later. The trainer's own error, if any, comes first.
    let closed = session.close().await;
    let report = result?;
    closed?;
    Ok(report)
}

/// How the job ended, once its report is written.
async fn job_ended(discovery: &dyn Discovery, job: &str) -> Result<JobEnd> {
    let mut changed = ChangeSignal::new(discovery, &JobKeys::new(job)?.result()).await;
    loop {
        match read_result(discovery, job).await {
            Ok(Some(report)) => return Ok(report.state),
            Ok(None) => {}
            // Discovery away for a moment: waiting for the pservers goes on
            // meanwhile, bounded by its own timeout.
            Err(Error::Discovery(e)) if e.is_transient() => {
                tracing::warn!(job, error = %e, "cannot read the job's result; retrying")
            }
            Err(e) => return Err(e),
        }
        changed.wait(Duration::from_secs(1)).await;
    }
}

/// Claim `key` under the session's lease. A key left by a dead trainer with
/// the same id (a restarted process) goes when its lease expires, so wait
/// for it up to `timeout`.
async fn register(
    discovery: &dyn Discovery,
    key: &str,
    id: &str,
    session: &Session,
    timeout: Duration,
) -> Result<()> {
    let deadline = oar_transport::deadline_in(timeout);
    loop {
        if discovery.create_if_absent(key, id.as_bytes().to_vec(), Some(session.lease())).await?.is_some() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::TrainerIdTaken(id.to_string()));
        }
        tracing::info!(trainer = id, "trainer id still registered (a previous process?); waiting");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
