//! A whole job in one process: a master, P pservers and T trainers on the
//! context's discovery and transport, run through the same role functions
//! as the separate binaries ([`crate::role`]). This is what
//! `examples/local.rs` runs, and what the integration tests train with.

use crate::{
    config::JobConfig,
    context::JobContext,
    report::{JobReport, Progress},
    role::{self, RoleOptions},
    Error, Result,
};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How [`run_local`] runs a job.
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// Trainers (at least 1).
    pub trainers: u32,
    /// Cancelled, it stops every role gracefully and the run ends with
    /// [`Error::ShutDown`].
    pub shutdown: CancellationToken,
    /// Timing of every role (their ids are set per role).
    pub roles: RoleOptions,
}

impl Default for LocalOptions {
    /// Three trainers; members away for 30 s fail the run (nothing
    /// restarts in one process), the master lingers 5 s for its trainers.
    fn default() -> Self {
        Self {
            trainers: 3,
            shutdown: CancellationToken::new(),
            roles: RoleOptions {
                retry_for: Duration::from_secs(30),
                linger: Duration::from_secs(5),
                ..RoleOptions::new("local")
            },
        }
    }
}

/// Run `config` as one process: `options.trainers` trainers,
/// `config.pservers` pservers and a master, on `ctx`'s discovery and
/// transport, listening at `ctx.listen` addresses of that transport
/// (`"mem:0"`, `"127.0.0.1:0"`). `on_progress` sees the master's progress
/// (see [`role::master`]). A pserver or trainer that fails fails the run
/// with its error.
pub async fn run_local(
    ctx: &JobContext,
    config: &JobConfig,
    options: &LocalOptions,
    on_progress: impl FnMut(Progress<'_>),
) -> Result<JobReport> {
    config.validate()?;
    if options.trainers == 0 {
        return Err(Error::BadConfig("trainers must be at least 1".into()));
    }
    let role = |id: String| RoleOptions { id, ..options.roles.clone() };
    // A stop reaches the trainers first: they push what they trained and
    // hand their tasks back to a master and pservers still serving; then
    // the master and the pservers stop.
    let (trainers_stop, servers_stop) = (CancellationToken::new(), CancellationToken::new());
    let mut servers = tokio::task::JoinSet::new();
    for i in 0..config.pservers {
        let (ctx, options, stop) = (ctx.clone(), role(format!("pserver-{i:03}")), servers_stop.clone());
        servers.spawn(async move { role::pserver(&ctx, &options, stop).await.map(drop) });
    }
    let mut trainers = tokio::task::JoinSet::new();
    for t in 0..options.trainers {
        let (ctx, options, stop) = (ctx.clone(), role(format!("trainer-{t:03}")), trainers_stop.clone());
        trainers.spawn(async move {
            match role::trainer(&ctx, &options, stop).await {
                // A trainer that came after the job ended had nothing to
                // do: the master's report says how the job went.
                Ok(_) | Err(Error::JobOver { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        });
    }
    let master_options = role("master".into());
    let master = role::master(ctx, config, &master_options, servers_stop.clone(), on_progress);
    tokio::pin!(master);
    let failed = |e: tokio::task::JoinError| Error::Panicked(format!("a pserver or trainer: {e}"));
    let report = loop {
        tokio::select! {
            report = &mut master => break report?,
            Some(joined) = servers.join_next() => joined.map_err(failed)??,
            Some(joined) = trainers.join_next() => joined.map_err(failed)??,
            _ = options.shutdown.cancelled(), if !trainers_stop.is_cancelled() => trainers_stop.cancel(),
        }
        if trainers_stop.is_cancelled() && trainers.is_empty() {
            servers_stop.cancel();
        }
    };
    for members in [&mut trainers, &mut servers] {
        while let Some(joined) = members.join_next().await {
            joined.map_err(failed)??;
        }
    }
    report.ok_or(Error::ShutDown)
}
