//! A trainer of a job: reads the job's options from etcd, registers, waits
//! for the pservers, and trains on tasks from the master (following it when
//! it moves) until the job ends.
//!
//!     cargo run --release --features etcd --example trainer -- \
//!         --etcd http://127.0.0.1:2379 --job a1a \
//!         --ca certs/ca.pem --cert certs/trainer.pem --key certs/trainer.key
//!
//! Shows a progress bar per pass when stderr is a terminal (one line per
//! pass otherwise), and prints what it did as one JSON line; exits 0 when
//! the job ends, 2 on an error. SIGTERM or ctrl-c stops it gracefully: it
//! finishes or hands back its task, deregisters, and exits 0.

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{BoxError, ConnArgs};
use oar::{
    job::{
        keys::JobKeys,
        role::{self, RoleOptions},
        status::JobView,
    },
    task_queue::{MasterClient, MasterClientOptions},
};
use std::{process::ExitCode, sync::Arc};
use tokio::sync::{Mutex, Notify};
use tokio_util::task::AbortOnDropHandle;

#[derive(Parser, Debug)]
#[command(about = "Run a trainer of an oar job")]
struct Args {
    #[command(flatten)]
    conn: ConnArgs,
    /// Seconds the task in hand may still train after SIGTERM or ctrl-c
    /// before it is handed back to the master unfinished.
    #[arg(long, default_value_t = 10.0)]
    stop_grace: f64,
    /// Worker threads of the runtime (0: one per core). A trainer of a
    /// small model is bound by round trips and runs fastest on 1.
    #[arg(long, default_value_t = 0)]
    workers: usize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::init_logging(args.conn.verbose, args.conn.log_json);
    common::run_on(args.workers, run(args))
}

async fn run(args: Args) -> Result<ExitCode, BoxError> {
    let _metrics = common::serve_metrics(args.conn.metrics.as_deref()).await?;
    let ctx = args.conn.connect().await?;
    let stop_grace = std::time::Duration::try_from_secs_f64(args.stop_grace)
        .map_err(|_| format!("--stop-grace {} must be a number of seconds, 0 or more", args.stop_grace))?;
    let options = RoleOptions { stop_grace, ..args.conn.role_options("trainer") };
    // Progress from events: each time the master accepts this trainer's
    // reports, its status says which passes ended.
    let addr_key = JobKeys::new(&ctx.job)?.master_addr();
    let master =
        MasterClient::new(ctx.discovery.clone(), ctx.transport.clone(), MasterClientOptions::new(addr_key));
    let reported = Arc::new(Notify::new());
    let display = Arc::new(Mutex::new(common::Display::new(0)));
    let follow = {
        let (reported, display) = (reported.clone(), display.clone());
        AbortOnDropHandle::new(tokio::spawn(async move {
            loop {
                reported.notified().await;
                if let Ok(status) = master.status().await {
                    display.lock().await.passes_from(&status);
                }
            }
        }))
    };
    let options = RoleOptions { on_report: Some(reported), ..options };
    let shutdown = common::shutdown_on_signals()?;
    let report = role::trainer(&ctx, &options, shutdown).await;
    drop(follow);
    // The passes that ended since the last report, from what the master stored.
    if let Ok(Some(JobView { tasks: Some(status), .. })) = JobView::read(&*ctx.discovery, &ctx.job).await {
        display.lock().await.passes_from(&status);
    }
    display.lock().await.finish();
    let report = report?;
    common::print_json(&Printed { trainer: &options.id, report })?;
    Ok(ExitCode::SUCCESS)
}

/// What the trainer prints at the end: its id and its report, as one object.
#[derive(serde::Serialize)]
struct Printed<'a> {
    trainer: &'a str,
    #[serde(flatten)]
    report: oar::trainer::worker::TrainerReport,
}
