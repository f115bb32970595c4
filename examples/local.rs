//! A whole training job in one process: a master, P pservers and T trainers
//! on the in-memory discovery, talking over QUIC with mutual TLS on
//! 127.0.0.1 (certificates from a development CA made at start-up). With no
//! `--data` it generates a dataset with a known structure (Gaussian class
//! clusters) and trains on that.
//!
//!     cargo run --release --example local
//!     cargo run --release --example local -- --data testdata/a1a --test-data testdata/a1a.t \
//!         --features 123 --classes 2 --trainers 3 --pservers 2
//!
//! Prints one line per pass (and shows a progress bar when stderr is a
//! terminal) and ends with one JSON line; exits 1 if the job failed, 2 on an
//! error.

#[path = "common/mod.rs"]
mod common;

use clap::{Parser, ValueEnum};
use common::{BoxError, JobArgs};
use oar::{
    discovery::MemDiscovery,
    job::JobContext,
    transport::{DevCa, MemNetwork, MemTransport, QuicTransport, Transport},
};
use std::{process::ExitCode, sync::Arc};

#[derive(Parser, Debug)]
#[command(
    about = "Train a model with a master, pservers and trainers in one process",
    allow_negative_numbers = true
)]
struct Args {
    #[command(flatten)]
    job: JobArgs,
    /// Trainers.
    #[arg(long, default_value_t = 3)]
    trainers: u32,
    /// How the roles talk: QUIC on 127.0.0.1, or in-process calls.
    #[arg(long, value_enum, default_value_t = TransportArg::Quic)]
    transport: TransportArg,
    /// Log what the library does (to stderr).
    #[arg(long)]
    verbose: bool,
    /// Log one JSON object per line.
    #[arg(long)]
    log_json: bool,
    /// Serve Prometheus metrics at this address (http://ADDR/metrics; port 0 picks one).
    #[arg(long)]
    metrics: Option<String>,
    /// Worker threads of the runtime (0: one per core). A small model's
    /// job is bound by round trips and runs fastest on 1.
    #[arg(long, default_value_t = 0)]
    workers: usize,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum TransportArg {
    Quic,
    Mem,
}

fn main() -> ExitCode {
    let args = Args::parse();
    common::init_logging(args.verbose, args.log_json);
    common::run_on(args.workers, run(args))
}

async fn run(args: Args) -> Result<ExitCode, BoxError> {
    // Generated data lives in a temporary directory removed at the end.
    let generated = tempfile::tempdir()?;
    let config = args.job.config(Some(generated.path()))?;
    let _metrics = common::serve_metrics(args.metrics.as_deref()).await?;
    let (transport, listen): (Arc<dyn Transport>, _) = match args.transport {
        TransportArg::Quic => {
            // One identity for the whole process, signed by a CA made for this run.
            let tls = DevCa::new()?.tls_config("local")?;
            (Arc::new(QuicTransport::new(tls)?), "127.0.0.1:0")
        }
        TransportArg::Mem => (Arc::new(MemTransport::new(MemNetwork::new())), "mem:0"),
    };
    let discovery = Arc::new(MemDiscovery::new());
    let ctx = JobContext::new("local", discovery, transport, listen);
    common::run_in_one_process(&ctx, &config, args.trainers).await
}
