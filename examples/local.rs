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
//! Prints one line per pass and ends with one JSON line; exits 1 if the job failed.

use clap::{Parser, ValueEnum};
use oar::{
    discovery::MemDiscovery,
    pserver::{Mode, OptimizerConfig},
    trainer::{
        datagen::write_blobs,
        job::JobConfig,
        local::{run_local, PassReport},
        model::ModelConfig,
        reader::Format,
    },
    transport::{DevCa, MemNetwork, MemTransport, QuicTransport, Transport},
};
use std::{process::ExitCode, sync::Arc};

#[derive(Parser, Debug)]
#[command(about = "Train a model with a master, pservers and trainers in one process")]
struct Args {
    /// Training data, a glob of files (default: generate a dataset).
    #[arg(long)]
    data: Option<String>,
    /// Held-out data, a glob of files (default: the generated test split, or the training data).
    #[arg(long)]
    test_data: Option<String>,
    /// Format of the data lines.
    #[arg(long, value_enum, default_value_t = FormatArg::Libsvm)]
    format: FormatArg,
    /// Skip and count bad data lines instead of failing their task.
    #[arg(long)]
    skip_bad_lines: bool,
    /// The model to train.
    #[arg(long, value_enum, default_value_t = ModelArg::Softmax)]
    model: ModelArg,
    /// Number of classes (default 4 for generated data; required with --data).
    #[arg(long)]
    classes: Option<usize>,
    /// Number of features (default 16 for generated data; required with --data).
    #[arg(long)]
    features: Option<usize>,
    /// Hidden units of the MLP.
    #[arg(long, default_value_t = 32)]
    hidden: usize,
    /// Trainers.
    #[arg(long, default_value_t = 3)]
    trainers: u32,
    /// Parameter servers.
    #[arg(long, default_value_t = 2)]
    pservers: u32,
    /// Passes over the data.
    #[arg(long, default_value_t = 5)]
    passes: u32,
    /// Examples per mini-batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// The optimizer, run on the pservers.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    optimizer: OptimizerArg,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// Sync barrier per step, or async updates.
    #[arg(long, value_enum, default_value_t = ModeArg::Sync)]
    mode: ModeArg,
    /// Async: push every N mini-batches.
    #[arg(long, default_value_t = 1)]
    push_every: u32,
    /// Async: pull every M mini-batches.
    #[arg(long, default_value_t = 1)]
    pull_every: u32,
    /// Bytes of data per chunk (a task is one chunk).
    #[arg(long, default_value_t = 16 << 10)]
    chunk_bytes: u64,
    /// Seed of the generated data and the initial parameters.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How the processes talk: QUIC on 127.0.0.1, or in-process calls.
    #[arg(long, value_enum, default_value_t = TransportArg::Quic)]
    transport: TransportArg,
    /// Log what the library does (to stderr).
    #[arg(long)]
    verbose: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FormatArg {
    Libsvm,
    Csv,
}
#[derive(Clone, Copy, Debug, ValueEnum)]
enum ModelArg {
    Softmax,
    Mlp,
}
#[derive(Clone, Copy, Debug, ValueEnum)]
enum OptimizerArg {
    Sgd,
    Momentum,
    Adagrad,
    Adam,
}
#[derive(Clone, Copy, Debug, ValueEnum)]
enum TransportArg {
    Quic,
    Mem,
}
#[derive(Clone, Copy, Debug, ValueEnum)]
enum ModeArg {
    Sync,
    Async,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(if args.verbose {
            tracing_subscriber::filter::LevelFilter::INFO
        } else {
            tracing_subscriber::filter::LevelFilter::WARN
        })
        .init();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<bool, Box<dyn std::error::Error>> {
    // Generated data lives in a temporary directory removed at the end.
    let generated = tempfile::tempdir()?;
    let (data, test_data, features, classes) = match &args.data {
        Some(data) => {
            let (Some(features), Some(classes)) = (args.features, args.classes) else {
                return Err("--features and --classes are required with --data".into());
            };
            (data.clone(), args.test_data.clone(), features, classes)
        }
        None => {
            let (features, classes) = (args.features.unwrap_or(16), args.classes.unwrap_or(4));
            let (train, test) = write_blobs(generated.path(), classes, features, 20_000, 5_000, args.seed)?;
            (train.display().to_string(), Some(test.display().to_string()), features, classes)
        }
    };
    let model = match args.model {
        ModelArg::Softmax => ModelConfig::Softmax { features, classes },
        ModelArg::Mlp => ModelConfig::Mlp { features, hidden: args.hidden, classes },
    };
    let mut config = JobConfig::new(&data, model);
    config.test_data = test_data;
    config.format = match args.format {
        FormatArg::Libsvm => Format::Libsvm,
        FormatArg::Csv => Format::Csv,
    };
    config.skip_bad_lines = args.skip_bad_lines;
    config.optimizer = OptimizerConfig::parse(
        match args.optimizer {
            OptimizerArg::Sgd => "sgd",
            OptimizerArg::Momentum => "momentum",
            OptimizerArg::Adagrad => "adagrad",
            OptimizerArg::Adam => "adam",
        },
        args.lr,
    )?;
    config.mode = match args.mode {
        ModeArg::Sync => Mode::Sync,
        ModeArg::Async => Mode::Async,
    };
    config.passes = args.passes;
    config.batch_size = args.batch_size;
    config.push_every = args.push_every;
    config.pull_every = args.pull_every;
    config.pservers = args.pservers;
    config.seed = args.seed;
    config.chunk_bytes = args.chunk_bytes;

    let discovery = Arc::new(MemDiscovery::new());
    let (transport, listen): (Arc<dyn Transport>, _) = match args.transport {
        TransportArg::Quic => {
            // One identity for the whole process, signed by a CA made for this run.
            let tls = DevCa::new()?.tls_config("local")?;
            (Arc::new(QuicTransport::new(tls)?), "127.0.0.1:0")
        }
        TransportArg::Mem => (Arc::new(MemTransport::new(MemNetwork::new())), "mem:0"),
    };
    let passes = config.passes;
    let report = run_local(&config, args.trainers, discovery, transport, listen, |p: &PassReport| {
        println!(
            "pass {}/{passes}: train loss {:.4}, test loss {:.4}, test accuracy {:.2}%, tasks done {}, discarded {}",
            p.pass + 1,
            p.train_loss,
            p.test_loss,
            p.test_accuracy * 100.0,
            p.tasks_done,
            p.tasks_discarded
        );
    })
    .await?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(report.state == "done")
}
