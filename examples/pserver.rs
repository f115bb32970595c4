//! A parameter server of a job: reads the job's options from etcd, claims
//! the lowest free shard index, loads that shard's newest verified
//! checkpoint, serves until the job ends, and checkpoints periodically and
//! at the end.
//!
//!     cargo run --release --features etcd --example pserver -- \
//!         --etcd http://127.0.0.1:2379 --job a1a \
//!         --ca certs/ca.pem --cert certs/ps.pem --key certs/ps.key --checkpoint-dir /var/lib/oar
//!
//! Exits 0 when the job ends, 2 on an error (for example a lost lease: the
//! job has given this pserver up and a replacement may take its index).
//! SIGTERM or ctrl-c stops it gracefully: it stops taking pushes, writes a
//! last checkpoint of everything it applied, releases its index, and exits
//! 0. Prints what it did as one JSON line.

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{BoxError, ConnArgs};
use oar::job::role;
use std::{path::PathBuf, process::ExitCode, time::Duration};

#[derive(Parser, Debug)]
#[command(about = "Run a parameter server of an oar job")]
struct Args {
    #[command(flatten)]
    conn: ConnArgs,
    /// Where checkpoints go (<dir>/ps-<index>/); without it, no checkpoints.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Seconds between checkpoints: a crash loses at most this much training.
    #[arg(long, default_value_t = 60.0)]
    checkpoint_interval: f64,
    /// Serve exactly this shard (waiting for it to be free) instead of the
    /// lowest free one: give each pserver with its own checkpoint volume its
    /// own index (a StatefulSet pod's ordinal).
    #[arg(long)]
    index: Option<u32>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    common::init_logging(args.conn.verbose, args.conn.log_json);
    common::exit_with(run(args).await)
}

async fn run(args: Args) -> Result<ExitCode, BoxError> {
    let interval = Duration::try_from_secs_f64(args.checkpoint_interval)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            format!("--checkpoint-interval {} must be a positive number of seconds", args.checkpoint_interval)
        })?;
    let _metrics = common::serve_metrics(args.conn.metrics.as_deref()).await?;
    let ctx = args.conn.connect().await?;
    let mut options = args.conn.role_options("pserver");
    options.checkpoint_dir = args.checkpoint_dir;
    options.checkpoint_interval = interval;
    options.pserver_index = args.index;
    let shutdown = common::shutdown_on_signals()?;
    let report = role::pserver(&ctx, &options, shutdown).await?;
    common::print_json(&report)?;
    Ok(ExitCode::SUCCESS)
}
