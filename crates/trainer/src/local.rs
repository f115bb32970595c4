//! A whole job in one process: a master, P pservers and T trainers on a
//! discovery and a transport the caller picks, run through the same role
//! functions as the separate binaries ([`crate::role`]). This is what
//! `examples/local.rs` runs, and what the integration tests train with.

pub use crate::role::{JobReport, PassReport};
use crate::{
    job::JobConfig,
    role::{self, JobContext, Plugins, RoleOptions},
    Error, Result,
};
use oar_discovery::Discovery;
use oar_transport::Transport;
use std::{sync::Arc, time::Duration};

/// Run `config` as one process: `trainers` trainers, `config.pservers`
/// pservers and a master on `discovery` and `transport`, listening at
/// `listen` addresses of that transport (`"mem:0"`, `"127.0.0.1:0"`).
/// `on_pass` sees each pass's progress. A pserver or trainer that fails
/// fails the run with its error.
pub async fn run_local(
    config: &JobConfig,
    trainers: u32,
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    listen: &str,
    on_pass: impl FnMut(&PassReport),
) -> Result<JobReport> {
    run_local_with(config, trainers, discovery, transport, listen, Plugins::default(), on_pass).await
}

/// [`run_local`] with user-defined parts (a model, an optimizer).
pub async fn run_local_with(
    config: &JobConfig,
    trainers: u32,
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    listen: &str,
    plugins: Plugins,
    on_pass: impl FnMut(&PassReport),
) -> Result<JobReport> {
    config.validate()?;
    if trainers == 0 {
        return Err(Error::BadConfig("trainers must be at least 1".into()));
    }
    let ctx = JobContext { plugins, ..JobContext::new("local", discovery, transport, listen) };
    let options = |id: String| RoleOptions {
        // Nothing restarts in one process: a member away this long is a bug.
        retry_for: Duration::from_secs(30),
        linger: Duration::from_secs(5),
        ..RoleOptions::new(id)
    };

    let mut members = tokio::task::JoinSet::new();
    for i in 0..config.pservers {
        let (ctx, options) = (ctx.clone(), options(format!("pserver-{i:03}")));
        members.spawn(async move { role::pserver(&ctx, &options).await.map(drop) });
    }
    for t in 0..trainers {
        let (ctx, options) = (ctx.clone(), options(format!("trainer-{t:03}")));
        members.spawn(async move { role::trainer(&ctx, &options).await.map(drop) });
    }
    let master_options = options("master".into());
    let master = role::master(&ctx, config, &master_options, on_pass);
    tokio::pin!(master);
    let report = loop {
        tokio::select! {
            report = &mut master => break report?,
            Some(joined) = members.join_next() => {
                joined.map_err(|e| Error::Panicked(format!("a pserver or trainer: {e}")))??;
            }
        }
    };
    while let Some(joined) = members.join_next().await {
        joined.map_err(|e| Error::Panicked(format!("a pserver or trainer: {e}")))??;
    }
    Ok(report)
}
