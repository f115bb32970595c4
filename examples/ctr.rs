//! A click-through-rate model over sparse embedding tables, trained as a
//! whole job in one process: a master, P pservers holding the tables' rows
//! (created on first touch, keyed by the feature id) and T trainers, on the
//! in-memory discovery, talking over QUIC with mutual TLS on 127.0.0.1.
//! Feature indices are ids, so no `--features` is needed: a new id is a new
//! row. Without `--data` it trains on the bundled UCI Adult (`a1a`) and
//! scores on `a1a.t`.
//!
//!     cargo run --release --example ctr
//!     cargo run --release --example ctr -- --model fm --factors 8 --replicas 2 --pservers 2
//!     cargo run --release --example ctr -- --data 'logs/*.csv' --format csv --test-data held-out.csv
//!
//! The data flags are `local`'s (`--data`, `--test-data`, `--format`,
//! `--skip-bad-lines`), as are the job's (`--pservers`, `--replicas`,
//! `--mode`, `--optimizer`, `--lr`, `--passes`, `--batch-size`...).
//! `--model` is `lr` (logistic regression, the default) or `fm` (a
//! factorization machine, `--factors K`), either with `--crosses` (hashed
//! pairwise feature crosses). CSV fields are categorical: each column's
//! text hashes to an id. Unless given, the optimizer is AdaGrad with
//! `--lr 0.1` (a rare id's row gets larger steps than a frequent one's),
//! `--passes` is 10 and `--shards` 8 (see [`CTR_SHARDS`]). Prints one
//! line per pass and ends with one JSON line; exits 1 if the job failed, 2
//! on an error.

#[path = "common/mod.rs"]
mod common;

use clap::{parser::ValueSource, CommandFactory, FromArgMatches, Parser};
use common::{BoxError, JobArgs, ModelArg, OptimizerArg};
use oar::{
    discovery::MemDiscovery,
    job::JobContext,
    transport::{DevCa, QuicTransport, Transport},
};
use std::{process::ExitCode, sync::Arc};

/// Shards unless `--shards` says otherwise. A sparse batch's calls to the
/// shards of one pserver travel in one round trip, but each shard still
/// applies its part on its own: 8 shards run 2.4x the examples per second
/// of the default 64 (BENCHMARKS.md, "CTR end to end").
const CTR_SHARDS: u32 = 8;

/// The bundled training and test data.
const A1A: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/a1a");
const A1A_TEST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/a1a.t");

#[derive(Parser, Debug)]
#[command(
    about = "Train a CTR model over sparse tables with a master, pservers and trainers in one process",
    allow_negative_numbers = true
)]
struct Args {
    #[command(flatten)]
    job: JobArgs,
    /// Trainers.
    #[arg(long, default_value_t = 2)]
    trainers: u32,
    /// Log what the library does (to stderr).
    #[arg(long)]
    verbose: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let matches = Args::command().get_matches();
    let mut args = match Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => e.exit(),
    };
    // The CTR defaults where the shared flags' defaults are the dense models'.
    let defaulted = |id: &str| matches.value_source(id) == Some(ValueSource::DefaultValue);
    if defaulted("optimizer") && defaulted("lr") {
        (args.job.optimizer, args.job.lr) = (OptimizerArg::Adagrad, 0.1);
    }
    if defaulted("passes") {
        args.job.passes = 10;
    }
    // A batch's push reaches every shard with one call each (rows land on
    // all of them): few shards, few calls (BENCHMARKS.md, CTR end to end).
    if defaulted("shards") {
        args.job.shards = CTR_SHARDS;
    }
    common::init_logging(args.verbose, false);
    common::exit_with(run(args).await)
}

async fn run(mut args: Args) -> Result<ExitCode, BoxError> {
    match args.job.model.get_or_insert(ModelArg::Lr) {
        ModelArg::Lr | ModelArg::Fm => {}
        other => return Err(format!("--model {other:?}: ctr trains sparse models, lr or fm").into()),
    }
    if args.job.data.is_none() {
        if args.job.test_data.is_some() {
            return Err("--test-data needs --data".into());
        }
        args.job.data = Some(A1A.into());
        args.job.test_data = Some(A1A_TEST.into());
    }
    let config = args.job.config(None)?;
    // One identity for the whole process, signed by a CA made for this run.
    let tls = DevCa::new()?.tls_config("ctr")?;
    let transport: Arc<dyn Transport> = Arc::new(QuicTransport::new(tls)?);
    let ctx = JobContext::new("ctr", Arc::new(MemDiscovery::new()), transport, "127.0.0.1:0");
    common::run_in_one_process(&ctx, &config, args.trainers).await
}
