//! The master of a job: holds the job's lock (a second master waits as a
//! standby), publishes the job's options for the pservers and trainers,
//! serves the task queue, scores the model on the test data after each pass,
//! and prints the job's report as one JSON line when it ends.
//!
//!     cargo run --release --features etcd --example master -- \
//!         --etcd http://127.0.0.1:2379 --job a1a \
//!         --ca certs/ca.pem --cert certs/master.pem --key certs/master.key \
//!         --data testdata/a1a --test-data testdata/a1a.t --features 123 --classes 2
//!
//! Exits 0 when the job is done, 1 when it failed, 2 on an error (for
//! example a lost lock: another master took over). SIGTERM or ctrl-c stops
//! it gracefully: it stores its state and hands over to a standby at once,
//! prints `{"master":"shut down"}` and exits 0.

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{BoxError, ConnArgs, JobArgs};
use oar::job::role;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(about = "Run the master of an oar job", allow_negative_numbers = true)]
struct Args {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(flatten)]
    job: JobArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    common::init_logging(args.conn.verbose, args.conn.log_json);
    common::exit_with(run(args).await)
}

async fn run(args: Args) -> Result<ExitCode, BoxError> {
    let config = args.job.config(None)?;
    let _metrics = common::serve_metrics(args.conn.metrics.as_deref()).await?;
    let ctx = args.conn.connect().await?;
    let options = args.conn.role_options("master");
    let shutdown = common::shutdown_on_signals()?;
    let mut display = common::Display::new(config.passes);
    let ran = role::master(&ctx, &config, &options, shutdown, |event| display.progress(event)).await;
    display.finish();
    match ran? {
        Some(report) => common::finish(&report),
        None => {
            common::print_json(&serde_json::json!({ "master": "shut down" }))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
