//! A parameter server of a job: reads the job's options from etcd,
//! registers, serves the shards the job's shard map gives it (as primary:
//! trainers' pushes and pulls, forwarded to the followers, checkpointed;
//! as follower: its primary's updates) until the job ends.
//!
//!     cargo run --release --features etcd --example pserver -- \
//!         --etcd http://127.0.0.1:2379 --job a1a \
//!         --ca certs/ca.pem --cert certs/ps.pem --key certs/ps.key --checkpoint-dir /var/lib/oar
//!
//! Exits 0 when the job ends, 2 on an error (for example a lost lease: the
//! job has given this pserver up and its shards to others). SIGTERM or
//! ctrl-c stops it gracefully: it stops taking pushes, writes a last
//! checkpoint of the shards it is primary of, releases its registration
//! (their followers, or other pservers, take them over at once), and exits
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
    /// Where checkpoints go (<dir>/<job>/<instance>/shard-<s>/: a run of a
    /// job never loads another's), a directory every pserver of the job
    /// sees (a shared volume); without it, no checkpoints.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Seconds between checkpoints: a crash loses at most this much training.
    #[arg(long, default_value_t = 60.0)]
    checkpoint_interval: f64,
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
    let shutdown = common::shutdown_on_signals()?;
    let report = role::pserver(&ctx, &options, shutdown).await?;
    common::print_json(&report)?;
    Ok(ExitCode::SUCCESS)
}
