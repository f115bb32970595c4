//! A job seen from outside: reads etcd and prints the master, the pservers
//! with their last checkpoint, the trainers, the task counts per state and
//! the statistics per pass, and the job's result once it ended.
//!
//!     cargo run --release --features etcd --example status -- --etcd http://127.0.0.1:2379 --job a1a
//!
//! Exits 1 when etcd holds nothing of the job, 2 on an error.

use clap::Parser;
use oar::{discovery::EtcdDiscovery, job::status::JobView};
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
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
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
