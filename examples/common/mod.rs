//! Flags and helpers shared by the example binaries (`local`, `master`,
//! `pserver`, `trainer`, `status`). Copy what you need: each binary uses a
//! part of it. The end-to-end benchmarks (`bench/src/bin/`) include it by
//! path, so that they parse a job's flags as the examples do.
#![allow(dead_code)]
// The flags' doc comments are their `--help` text, where `<job>` and
// `<role>-<hostname>-<pid>` read as placeholders; rustdoc reads them as HTML.
#![allow(rustdoc::invalid_html_tags)]

use clap::{Args, ValueEnum};
use oar::{
    job::{
        config::{JobConfig, StreamConfig, StreamSource},
        report::{JobReport, PassReport, Progress, WindowReport},
    },
    pserver::{Mode, OptimizerConfig},
    trainer::{datagen::write_blobs, reader::Format, CtrModelConfig, ModelConfig},
};
use std::{path::Path, process::ExitCode, time::Duration};
use tokio_util::sync::CancellationToken;

/// A boxed error for `main`: every library error names what was wrong.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The job's options, given to the master (or to `local`) only.
#[derive(Args, Debug)]
pub struct JobArgs {
    /// Training data, a glob of files.
    #[arg(long)]
    pub data: Option<String>,
    /// Held-out data, a glob of files (default: the training data).
    #[arg(long)]
    pub test_data: Option<String>,
    /// Format of the data lines.
    #[arg(long, value_enum, default_value_t = FormatArg::Libsvm)]
    pub format: FormatArg,
    /// Skip and count bad data lines instead of failing their task.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// The model to train: dense (softmax, mlp) or over sparse tables of
    /// feature ids (lr, fm: binary labels, no --features needed) [default:
    /// softmax; ctr: lr].
    #[arg(long, value_enum)]
    pub model: Option<ModelArg>,
    /// Number of classes (dense models).
    #[arg(long)]
    pub classes: Option<usize>,
    /// Number of features (dense models).
    #[arg(long)]
    pub features: Option<usize>,
    /// Hidden units of the MLP.
    #[arg(long, default_value_t = 32)]
    pub hidden: usize,
    /// Width of the factorization machine's factor rows (fm).
    #[arg(long, default_value_t = 8)]
    pub factors: usize,
    /// Add hashed pairwise feature crosses (lr, fm).
    #[arg(long)]
    pub crosses: bool,
    /// Parameter servers (the first shard map waits for this many).
    #[arg(long, default_value_t = 2)]
    pub pservers: u32,
    /// Logical shards the model is cut into (fixed for the job).
    #[arg(long, default_value_t = oar::job::config::DEFAULT_SHARDS)]
    pub shards: u32,
    /// Replicas of each shard on distinct pservers: with 2 or more, a
    /// pserver's death loses no acknowledged update.
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    /// Move shards while the job runs so that a pserver started mid-job
    /// takes its share over (one shard at a time, with no update lost);
    /// `--rebalance false` moves shards only to drain a scale-in.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub rebalance: bool,
    /// Largest parameter block, in floats.
    #[arg(long, default_value_t = 1 << 16)]
    pub block_size: usize,
    /// Passes over the data.
    #[arg(long, default_value_t = 5)]
    pub passes: u32,
    /// Examples per mini-batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// The optimizer, run on the pservers.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    pub optimizer: OptimizerArg,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    pub lr: f32,
    /// Sync barrier per step, or async updates.
    #[arg(long, value_enum, default_value_t = ModeArg::Sync)]
    pub mode: ModeArg,
    /// Async: push every N mini-batches.
    #[arg(long, default_value_t = 1)]
    pub push_every: u32,
    /// Async: pull every M mini-batches.
    #[arg(long, default_value_t = 1)]
    pub pull_every: u32,
    /// Bytes of data per chunk (a task is one chunk); 0 sizes them from the
    /// data: about 32 tasks per pass, 16 KiB to 8 MiB each.
    #[arg(long, default_value_t = 0)]
    pub chunk_bytes: u64,
    /// Seconds a trainer has to finish a task before it goes to another.
    #[arg(long, default_value_t = 60)]
    pub task_timeout: u64,
    /// Seed of the generated data and the initial parameters.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stream the training data from this directory: each file renamed
    /// into it (names starting with `.` or ending in `.tmp` are still being
    /// written) is trained once; `_CLOSED` appearing in it ends the job.
    #[arg(long, conflicts_with_all = ["data", "stream_file"])]
    pub stream_dir: Option<String>,
    /// Stream the training data from this file as lines are appended to it
    /// (whole lines only); `<FILE>.closed` appearing ends the job.
    #[arg(long, conflicts_with_all = ["data", "stream_dir"])]
    pub stream_file: Option<String>,
    /// Streaming: the name of the marker file that closes `--stream-dir`.
    #[arg(long, default_value = "_CLOSED")]
    pub closed_marker: String,
    /// Streaming: report progress, and score the test data, every this many seconds.
    #[arg(long, default_value_t = 10.0)]
    pub window: f64,
    /// Streaming: export the model (dense parameters) to this directory.
    #[arg(long)]
    pub export_dir: Option<String>,
    /// Streaming: seconds between exports.
    #[arg(long, default_value_t = 60.0)]
    pub export_every: f64,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum FormatArg {
    Libsvm,
    Csv,
}
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ModelArg {
    Softmax,
    Mlp,
    Lr,
    Fm,
}

impl ModelArg {
    /// A model over sparse tables of ids.
    pub fn is_sparse(self) -> bool {
        matches!(self, ModelArg::Lr | ModelArg::Fm)
    }
}
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OptimizerArg {
    Sgd,
    Momentum,
    Adagrad,
    Adam,
}
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    Sync,
    Async,
}

impl ModeArg {
    pub fn mode(self) -> Mode {
        match self {
            ModeArg::Sync => Mode::Sync,
            ModeArg::Async => Mode::Async,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ModeArg::Sync => "sync",
            ModeArg::Async => "async",
        }
    }
}

impl JobArgs {
    /// The job's config. Without `--data`, `generate_into` (if given) gets
    /// a generated dataset (Gaussian class clusters) to train on.
    pub fn config(&self, generate_into: Option<&Path>) -> Result<JobConfig, BoxError> {
        let model_arg = self.model.unwrap_or(ModelArg::Softmax);
        let stream = match (&self.stream_dir, &self.stream_file) {
            (Some(dir), _) => {
                Some(StreamSource::Dir { dir: dir.clone(), closed_marker: self.closed_marker.clone() })
            }
            (None, Some(file)) => Some(StreamSource::file(file)),
            (None, None) => None,
        };
        let (data, test_data, features, classes) = match (&self.data, generate_into) {
            _ if stream.is_some() => {
                let (features, classes) = match (self.features, self.classes) {
                    _ if model_arg.is_sparse() => (0, 2),
                    (Some(features), Some(classes)) => (features, classes),
                    _ => return Err("--features and --classes are required with a dense model".into()),
                };
                if let Some(glob) = &self.test_data {
                    oar::task_queue::glob_files(glob).map_err(|e| format!("--test-data: {e}"))?;
                }
                (String::new(), self.test_data.clone(), features, classes)
            }
            (Some(data), _) => {
                let (features, classes) = match (self.features, self.classes) {
                    // Ids are open-ended and CTR labels binary.
                    _ if model_arg.is_sparse() => (0, 2),
                    (Some(features), Some(classes)) => (features, classes),
                    _ => return Err("--features and --classes are required with --data".into()),
                };
                // Name the flag whose files are missing, before anything starts.
                for (flag, glob) in [("--data", Some(data)), ("--test-data", self.test_data.as_ref())] {
                    if let Some(glob) = glob {
                        oar::task_queue::glob_files(glob).map_err(|e| format!("{flag}: {e}"))?;
                    }
                }
                (data.clone(), self.test_data.clone(), features, classes)
            }
            (None, Some(dir)) => {
                let default_classes = if model_arg.is_sparse() { 2 } else { 4 };
                let (features, classes) =
                    (self.features.unwrap_or(16), self.classes.unwrap_or(default_classes));
                let (train, test) = write_blobs(dir, classes, features, 20_000, 5_000, self.seed)?;
                (train.display().to_string(), Some(test.display().to_string()), features, classes)
            }
            (None, None) => return Err("--data is required".into()),
        };
        let model = match model_arg {
            ModelArg::Softmax => ModelConfig::Softmax { features, classes },
            ModelArg::Mlp => ModelConfig::Mlp { features, hidden: self.hidden, classes },
            ModelArg::Lr => ModelConfig::Ctr(CtrModelConfig::Lr { crosses: self.crosses }),
            ModelArg::Fm => {
                ModelConfig::Ctr(CtrModelConfig::Fm { factors: self.factors, crosses: self.crosses })
            }
        };
        let mut config = JobConfig::new(&data, model);
        config.test_data = test_data;
        config.format = match self.format {
            FormatArg::Libsvm => Format::Libsvm,
            FormatArg::Csv => Format::Csv,
        };
        config.skip_bad_lines = self.skip_bad_lines;
        let optimizer = match self.optimizer {
            OptimizerArg::Sgd => "sgd",
            OptimizerArg::Momentum => "momentum",
            OptimizerArg::Adagrad => "adagrad",
            OptimizerArg::Adam => "adam",
        };
        config.optimizer = OptimizerConfig::parse(optimizer, self.lr)?;
        config.mode = self.mode.mode();
        config.passes = self.passes;
        config.batch_size = self.batch_size;
        config.push_every = self.push_every;
        config.pull_every = self.pull_every;
        config.pservers = self.pservers;
        config.shards = self.shards;
        config.replicas = self.replicas;
        config.rebalance = self.rebalance;
        config.block_size = self.block_size;
        config.seed = self.seed;
        config.chunk_bytes = self.chunk_bytes;
        config.task_timeout = Duration::from_secs(self.task_timeout);
        if let Some(source) = stream {
            let seconds = |flag: &str, s: f64| {
                Duration::try_from_secs_f64(s)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or(format!("{flag} must be a positive number of seconds, got {s}"))
            };
            config.passes = 1;
            config.stream = Some(StreamConfig {
                source,
                window: seconds("--window", self.window)?,
                export_dir: self.export_dir.clone(),
                export_every: seconds("--export-every", self.export_every)?,
            });
        }
        config.validate()?;
        Ok(config)
    }
}

/// Log to stderr: warnings, or everything the library does with `verbose`;
/// one JSON object per line with `json` (for a log collector). `OAR_LOG`,
/// when set, says what to log instead, per target
/// (`info,oar_pserver::client=debug`: `tracing_subscriber`'s `Targets`
/// syntax); a value it cannot read is reported and ignored.
pub fn init_logging(verbose: bool, json: bool) {
    use std::io::IsTerminal;
    use tracing_subscriber::{
        filter::LevelFilter, filter::Targets, layer::SubscriberExt, util::SubscriberInitExt,
    };
    let level = if verbose { LevelFilter::INFO } else { LevelFilter::WARN };
    let mut targets = Targets::new().with_default(level);
    let mut unread = None;
    if let Ok(spec) = std::env::var("OAR_LOG") {
        match spec.parse::<Targets>() {
            Ok(t) => targets = t,
            Err(e) => {
                unread = Some(format!("OAR_LOG={spec:?} is not a log filter ({e}); logging at {level}"))
            }
        }
    }
    let logs = tracing_subscriber::fmt().with_writer(std::io::stderr).with_max_level(LevelFilter::TRACE);
    if json {
        logs.json().finish().with(targets).init();
    } else {
        logs.with_ansi(std::io::stderr().is_terminal()).finish().with(targets).init();
    }
    if let Some(message) = unread {
        eprintln!("{message}");
    }
}

/// The job's progress as a user sees it: on a terminal, a bar for the pass
/// under way (tasks done of the pass's tasks, examples per second since the
/// pass began, the pass's loss so far), cleared before each pass's line;
/// piped, the pass lines alone. Driven by events: the master's (a status
/// change, a pass scored) or, in a trainer, its own reports; nothing is
/// sampled, so every pass gets its line however short it is.
pub struct Display {
    bar: Option<indicatif::ProgressBar>,
    passes: u32,
    /// The pass the bar shows, and when it began (the previous one ended).
    pass: u32,
    pass_began: std::time::Instant,
    /// Passes whose line is printed.
    printed: u32,
}

impl Display {
    /// A display of a job of `passes` passes; a bar only if stderr is a terminal.
    pub fn new(passes: u32) -> Display {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let style =
                indicatif::ProgressStyle::with_template("pass {prefix} [{bar:30}] {pos}/{len} tasks, {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                    .progress_chars("=> ");
            // Hidden until the first status says how many tasks there are.
            let bar = indicatif::ProgressBar::hidden().with_style(style);
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
            bar
        });
        Display { bar, passes, pass: 0, pass_began: std::time::Instant::now(), printed: 0 }
    }

    /// The task queue changed.
    pub fn status(&mut self, status: &oar::task_queue::MasterStatus) {
        let q = &status.queue;
        if q.pass != self.pass {
            self.pass = q.pass;
            self.pass_began = std::time::Instant::now();
        }
        let Some(bar) = &self.bar else { return };
        let total = (q.todo + q.pending + q.done) as u64;
        if total == 0 || status.is_finished() {
            return;
        }
        let stats = status.passes.get(q.pass as usize).copied().unwrap_or_default();
        let elapsed = self.pass_began.elapsed().as_secs_f64();
        let rate = match (stats.examples, elapsed > 0.0) {
            (0, _) | (_, false) => "measuring".to_string(),
            (examples, true) => format!("{:.0} examples/s", examples as f64 / elapsed),
        };
        let loss = match stats.examples {
            0 => "no task finished yet".to_string(),
            _ => format!("loss {:.4}", stats.mean_loss()),
        };
        bar.set_prefix(format!("{}/{}", q.pass + 1, q.passes));
        bar.set_length(total);
        bar.set_position(q.done as u64);
        bar.set_message(format!("{rate}, {loss}"));
        // Shown once it has something true to show.
        if bar.is_hidden() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
    }

    /// Print `line` for pass `pass` (0-based), clearing the bar around it.
    fn line(&mut self, pass: u32, line: &str) {
        if pass < self.printed {
            return;
        }
        self.printed = pass + 1;
        match &self.bar {
            Some(bar) => {
                bar.suspend(|| println!("{line}"));
                // The next pass starts afresh: no stale count or loss.
                bar.set_position(0);
                bar.set_message("");
            }
            None => println!("{line}"),
        }
    }

    /// A pass ended and was scored (the master's view).
    pub fn pass_ended(&mut self, p: &PassReport) {
        let train = match p.tasks_done {
            0 => "no task trained".to_string(),
            _ => format!("train loss {:.4}", p.train_loss),
        };
        // No test examples (an empty test file): no score to print, as
        // the report's JSON gives none.
        let test = match p.test_accuracy.is_finite() && p.test_loss.is_finite() {
            true => format!("test loss {:.4}, test accuracy {:.2}%", p.test_loss, p.test_accuracy * 100.0),
            false => "no test score".to_string(),
        };
        let line = format!(
            "pass {}/{}: {train}, {test}, tasks done {}, discarded {}",
            p.pass + 1,
            self.passes,
            p.tasks_done,
            p.tasks_discarded
        );
        self.line(p.pass, &line);
    }

    /// A master's event.
    pub fn progress(&mut self, event: Progress<'_>) {
        match event {
            Progress::Status(status) => self.status(status),
            Progress::PassEnded(pass) => self.pass_ended(pass),
            Progress::WindowEnded(w) => self.window_ended(w),
        }
    }

    /// A streaming job's window ended and was scored.
    pub fn window_ended(&mut self, w: &WindowReport) {
        let test = match w.test_accuracy.is_finite() {
            true => format!(", test loss {:.4}, test accuracy {:.2}%", w.test_loss, w.test_accuracy * 100.0),
            false => String::new(),
        };
        let trained = match w.records {
            0 => "0 records".to_string(),
            n => format!("{n} records, train loss {:.4}", w.train_loss),
        };
        let lag = match w.lag_seconds.is_finite() {
            true => format!(", lag {:.2} s", w.lag_seconds),
            false => String::new(),
        };
        let line = format!(
            "window {}: {trained}{lag}{test}; backlog {} tasks, source at {}; tasks done {}, discarded {}",
            w.window + 1,
            w.backlog,
            w.position,
            w.tasks_done,
            w.tasks_discarded
        );
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }

    /// A trainer's view: the master's status after one of its reports (or
    /// at the end, `finished`): a line for every pass that ended since the
    /// last one printed, from the master's statistics.
    pub fn passes_from(&mut self, status: &oar::task_queue::MasterStatus) {
        self.status(status);
        let q = &status.queue;
        let ended = if status.is_finished() { q.pass + 1 } else { q.pass };
        for pass in self.printed..ended.min(q.passes) {
            let stats = status.passes.get(pass as usize).copied().unwrap_or_default();
            let train = match stats.examples {
                0 => "no task trained".to_string(),
                _ => format!("train loss {:.4}", stats.mean_loss()),
            };
            let line =
                format!("pass {}/{}: tasks done {}, {train}", pass + 1, q.passes, stats.tasks_finished);
            self.line(pass, &line);
        }
    }

    /// The job is over: take the bar away.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Serve Prometheus metrics at `addr` (if given) for as long as the
/// returned value lives; says where on stderr.
pub async fn serve_metrics(addr: Option<&str>) -> Result<Option<oar::metrics::MetricsServer>, BoxError> {
    let Some(addr) = addr else { return Ok(None) };
    let server =
        oar::metrics::serve(addr).await.map_err(|e| format!("--metrics {addr}: cannot listen: {e}"))?;
    eprintln!("metrics at http://{}/metrics", server.addr());
    Ok(Some(server))
}

/// The median of `v`, NaNs left out (NaN if nothing is left): the benches
/// quote medians over repetitions.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| !x.is_nan());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Examples per second, short: "1.23M" or "456.7k".
pub fn fmt_eps(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else {
        format!("{:.1}k", x / 1e3)
    }
}

/// The runtime a binary runs on: `workers` threads (0: tokio's default,
/// one per core). A trainer, or a small job in one process, is bound by
/// its round trips and runs best on one worker on a machine with few
/// cores (see `oar::trainer::worker`, "The runtime").
pub fn runtime(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if workers > 0 {
        builder.worker_threads(workers);
    }
    builder.enable_all().build()
}

/// The cores the benches run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// The load average and how many `rustc` run (the figures mean little while other builds run).
pub fn load() -> String {
    let avg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let avg: Vec<&str> = avg.split_whitespace().take(3).collect();
    let rustc = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == "rustc"))
                .count()
        })
        .unwrap_or(0);
    format!("load average {}, {rustc} rustc running", avg.join(" "))
}

/// Print the job's report as one JSON line; exit 0 if it is done, 1 if it
/// failed (saying why in one line on stderr).
pub fn finish(report: &JobReport) -> Result<ExitCode, BoxError> {
    println!("{}", report.to_json());
    if report.is_done() {
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("error: the job failed: {}", report.reason.as_deref().unwrap_or("no reason recorded"));
    Ok(ExitCode::FAILURE)
}

/// Run `config` as a whole job in this process (`run_local`, `trainers`
/// trainers) on `ctx`, showing progress (a bar on a terminal, a line per
/// pass or window) and ending with the report's JSON line: exit 0 if the
/// job is done, 1 if it failed, 130 after ctrl-c.
pub async fn run_in_one_process(
    ctx: &oar::job::JobContext,
    config: &JobConfig,
    trainers: u32,
) -> Result<ExitCode, BoxError> {
    use oar::job::local::{run_local, LocalOptions};
    let options = LocalOptions { trainers, shutdown: shutdown_on_signals()?, ..LocalOptions::default() };
    let mut display = Display::new(config.passes);
    let ran = run_local(ctx, config, &options, |event| display.progress(event)).await;
    display.finish();
    match ran {
        Ok(report) => finish(&report),
        Err(oar::job::Error::ShutDown) => Ok(ExitCode::from(130)),
        Err(e) => Err(e.into()),
    }
}

/// Print `value` as one JSON line.
pub fn print_json(value: &impl serde::Serialize) -> Result<(), BoxError> {
    println!("{}", serde_json::to_string(value)?);
    Ok(())
}

/// A token cancelled at the first SIGTERM or SIGINT (ctrl-c), which asks
/// the roles to stop gracefully; a second signal exits at once (130).
pub fn shutdown_on_signals() -> Result<CancellationToken, BoxError> {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("stopping gracefully (a second signal exits at once)");
        cancel.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        std::process::exit(130);
    });
    Ok(token)
}

/// Run `main` to its end on a [`runtime`] of `workers` threads, and exit
/// as [`exit_with`] says.
pub fn run_on<F>(workers: usize, main: F) -> ExitCode
where
    F: std::future::Future<Output = Result<ExitCode, BoxError>>,
{
    exit_with(runtime(workers).map_err(BoxError::from).and_then(|runtime| runtime.block_on(main)))
}

/// The exit code of `result`; an error exits 2, with the error on stderr.
pub fn exit_with(result: Result<ExitCode, BoxError>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(feature = "etcd")]
#[allow(unused_imports)] // `local` does not use it.
pub use cluster::*;

#[cfg(feature = "etcd")]
mod cluster {
    use super::BoxError;
    use clap::Args;
    use oar::job::{
        role::{default_id, RoleOptions},
        ConnectOptions, JobContext,
    };
    use oar::transport::{PathTuning, QuicOptions};
    use std::{path::PathBuf, time::Duration};

    /// How every role of a job connects: etcd, the job's name, where to
    /// listen, and the job's certificates.
    #[derive(Args, Debug)]
    pub struct ConnArgs {
        /// etcd endpoints, comma-separated (http://127.0.0.1:2379).
        #[arg(long, value_delimiter = ',', required = true)]
        pub etcd: Vec<String>,
        /// The job's name: its keys live under /oar/<job>/.
        #[arg(long)]
        pub job: String,
        /// Address to serve at; port 0 picks a free one (the address published is the one bound).
        #[arg(long, default_value = "127.0.0.1:0")]
        pub listen: String,
        /// The job's CA certificate (PEM); `certs` writes one.
        #[arg(long)]
        pub ca: PathBuf,
        /// This process's certificate (PEM), signed by the CA.
        #[arg(long)]
        pub cert: PathBuf,
        /// This process's private key (PEM).
        #[arg(long)]
        pub key: PathBuf,
        /// This process's id (default: <role>-<hostname>-<pid>).
        #[arg(long)]
        pub id: Option<String>,
        /// Seconds of this process's lease: how soon the job notices it is gone.
        #[arg(long, default_value_t = 5)]
        pub lease_ttl: u64,
        /// Seconds to wait at start for the job's config, the pservers, a trainer id held by a dead process.
        #[arg(long, default_value_t = 120)]
        pub startup_timeout: u64,
        /// Seconds a master or pserver that is away is retried before giving up.
        #[arg(long, default_value_t = 300)]
        pub retry_for: u64,
        /// Log what the library does (to stderr).
        #[arg(long)]
        pub verbose: bool,
        /// Log one JSON object per line.
        #[arg(long)]
        pub log_json: bool,
        /// Serve Prometheus metrics at this address (http://ADDR/metrics; port 0 picks one).
        #[arg(long)]
        pub metrics: Option<String>,
        /// UDP payload size towards peers off this host, for a network with
        /// jumbo frames: its MTU less 48 (8952 for 9000). Default: MTU discovery from 1200.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1200..=65527))]
        pub mtu: Option<u16>,
    }

    impl ConnArgs {
        /// Connect to etcd and build the QUIC transport.
        pub async fn connect(&self) -> Result<JobContext, BoxError> {
            let options = ConnectOptions {
                etcd: self.etcd.clone(),
                job: self.job.clone(),
                listen: self.listen.clone(),
                ca: self.ca.clone(),
                cert: self.cert.clone(),
                key: self.key.clone(),
                quic: QuicOptions {
                    network: PathTuning { mtu: self.mtu, ..QuicOptions::default().network },
                    ..QuicOptions::default()
                },
            };
            Ok(JobContext::connect(&options).await?)
        }

        /// Timing for role `role`, from the flags.
        pub fn role_options(&self, role: &str) -> RoleOptions {
            RoleOptions {
                lease_ttl: Duration::from_secs(self.lease_ttl),
                startup_timeout: Duration::from_secs(self.startup_timeout),
                retry_for: Duration::from_secs(self.retry_for),
                ..RoleOptions::new(self.id.clone().unwrap_or_else(|| default_id(role)))
            }
        }
    }
}
