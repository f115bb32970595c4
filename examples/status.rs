//! A job seen from outside: reads etcd and prints the master, the pservers
//! with their last checkpoint, the trainers, the task counts per state and
//! the statistics per pass, and the job's result once it ended.
//!
//!     cargo run --release --features etcd --example status -- --etcd http://127.0.0.1:2379 --job a1a
//!
//! With `--set-pservers N` it scales the job's pservers instead
//! (`oar::pserver::set_pservers`): out, the next pservers to register take
//! their share of the shards; in, the highest-numbered are drained and
//! released. It returns at once; the status shows the moves until the
//! cluster is `OK` again. Refused (exit 2, saying why, nothing changed) for
//! 0, more pservers than shards, or while a move is under way (unless
//! `--force`).
//!
//! With `--close-stream` it closes a streaming job's source
//! (`oar::job::role::close_stream`): the master trains what the source
//! holds and ends the job. Refused (exit 2, saying why, nothing written)
//! unless the job is a streaming job that has not ended. The status of a
//! streaming job shows its source's position, its backlog and the lag from
//! arrival to training.
//!
//! Exits 1 when etcd holds nothing of the job, 2 on an error.

use clap::Parser;
use oar::{
    discovery::EtcdDiscovery,
    job::{keys::JobKeys, status::JobView},
    pserver::{set_pservers, ScaleOptions},
};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(about = "Print the state of an oar job from etcd")]
struct Args {
    /// etcd endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// The job's name.
    #[arg(long)]
    job: String,
    /// Scale the job to this many pservers, then exit.
    #[arg(long)]
    set_pservers: Option<u32>,
    /// With `--set-pservers`: even while a move is under way.
    #[arg(long, requires = "set_pservers")]
    force: bool,
    /// Close a streaming job's source: what it holds is trained, then the
    /// job ends.
    #[arg(long)]
    close_stream: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(count) = args.set_pservers {
        return scale(&args, count).await;
    }
    if args.close_stream {
        let closed = async {
            let discovery = EtcdDiscovery::connect(&args.etcd).await?;
            oar::job::role::close_stream(&discovery, &args.job)
                .await
                .map_err(Box::<dyn std::error::Error>::from)
        };
        return match closed.await {
            Ok(()) => {
                println!(
                    "job {}: the stream is closed; the master trains what it holds, then ends",
                    args.job
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        };
    }
    let view = async {
        let discovery = EtcdDiscovery::connect(&args.etcd).await?;
        JobView::read(&discovery, &args.job).await.map_err(Box::<dyn std::error::Error>::from)
    };
    match view.await {
        Ok(Some(view)) => {
            print!("{view}");
            ExitCode::SUCCESS
        }
        Ok(None) => {
            eprintln!("etcd holds nothing of job {:?}", args.job);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// `--set-pservers`: change the job's wanted pserver count.
async fn scale(args: &Args, count: u32) -> ExitCode {
    let scaled = async {
        let discovery = EtcdDiscovery::connect(&args.etcd).await?;
        let keys = JobKeys::new(&args.job)?.pserver();
        let options = ScaleOptions { force: args.force };
        set_pservers(&discovery, &keys, count, options).await.map_err(Box::<dyn std::error::Error>::from)
    };
    match scaled.await {
        Ok(scaled) => {
            println!(
                "job {}: pservers wanted {} -> {} (shard map version {}); the status shows the moves",
                args.job, scaled.from, scaled.to, scaled.map_version
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
