//! End-to-end training speed (issue 6, item 4): examples per second of a
//! whole `run_local` job (what `examples/local.rs` runs: a master, pservers
//! and T trainers in one process, on `MemDiscovery`, over QUIC on 127.0.0.1
//! or the in-process transport) training softmax regression on a1a-shaped
//! data, against a plain single-threaded loop training the same model on the
//! same file with no oar at all, measured in the same run, interleaved.
//!
//! ```sh
//! cargo run --release -p oar-bench --bin bench_end_to_end
//! cargo run --release -p oar-bench --bin bench_end_to_end -- --modes async --transports quic,mem --batch-sizes 64,1024
//! # options: --copies N [100] --passes P [10] --reps R [3] --trainers 1,2,4 --modes async,sync
//! #   --transports quic|mem,... --batch-sizes 64,... --pservers [2] --chunk-bytes [0 = auto]
//! #   --every N [1] (async push_every = pull_every) --lr [0.1] --test-data PATH [testdata/a1a]
//! #   --target [0.7] --workers W [0 = one per core] (the job's runtime's worker threads)
//! ```
//!
//! Data: `testdata/a1a` (1605 lines, 123 features, 2 classes) written
//! `--copies` times into one file in a temporary directory (160,500 examples,
//! 11.6 MB by default); generating it is not timed.
//!
//! Per repetition and batch size, for each mode, transport and trainer count:
//! first the plain loop, then the oar job, so every oar run has a reference
//! measured just before it.
//!
//! - **plain**: for each pass, stream the file in 1 MiB pieces, each read
//!   and parsed with `oar::trainer::reader::read_chunk` (the trainers' own
//!   reader and parser; 1 MiB pieces parsed faster than one `read_glob` of the
//!   whole file), and for each mini-batch (exact batches, across pieces) call
//!   `SoftmaxRegression::loss_and_grad` and apply SGD in place
//!   (`p -= lr * g`), on the calling thread. Examples/s = examples trained
//!   (passes x examples) / wall seconds of all passes, reading and parsing
//!   included.
//! - **oar**: `run_local` with the job's defaults of `examples/local.rs`
//!   (2 pservers, SGD on the pservers, chunks sized from the data = one task each, held-out
//!   set `--test-data`), in a fresh tokio runtime (one worker per core).
//!   Examples/s "whole" = the same examples / wall seconds of the `run_local`
//!   call: start-up (the master reads and parses the training file once more
//!   to score it), every task's reading and parsing, training, the scoring
//!   after each pass and at the end, and the shutdown. "steady" = examples of
//!   passes 2..P / time between the end of pass 1 and of pass P (from the
//!   `on_pass` callback), i.e. without start-up and shutdown.
//!
//! The ratio is oar / plain, paired with the plain run just before it; the
//! summary quotes medians over repetitions. PASS when one trainer's median
//! "whole" ratio is at least `--target`; the verdict names the cases (mode,
//! transport, batch size) that meet it and those that miss it.
//!
//! Where the time goes (one trainer), per steady pass: the job's transport
//! is wrapped in a timing layer (`Timed`, a `Transport` of this file that
//! forwards every call) which counts, per kind of call (pull, push = a push
//! or an async push-pull, which brings the next batch's parameters back with
//! the push, master =
//! `get_task` / `task_finished`, other = join/leave), the calls and the wall
//! time during which at least one of them was in flight (a pull of 2 shards
//! is 2 concurrent calls, counted once in time; the master's one scoring pull
//! per pass counts too; the layer adds a lock and a metadata decode, about a
//! microsecond, per call). Snapshots at each pass end give the figures of
//! passes 2..P; "pulls/pass" and "pushes/pass" count the exchanges (calls
//! divided by the pservers), "us/pull", "us/push" and "us/task" divide the
//! time in flight by them. A trainer prefetches its next task and, in async
//! mode with a small model, overlaps its exchanges with training (see
//! `oar_trainer::worker`), so these times overlap the trainer's own work and
//! each other. "local" is the pass minus the times in flight: the trainer's
//! work that nothing hid (reading and parsing tasks, compute, scoring at the
//! pass ends, waits); it is near zero, or below, when calls overlap it;
//! the plain loop's parse and compute per pass are shown beside it. Start-up
//! = time to the end of pass 1 minus one steady pass; shutdown = from the end
//! of the last pass to `run_local`'s return.

#[path = "../../../examples/common/mod.rs"]
mod common;
use common::ModeArg;

use clap::{Parser, ValueEnum};
use oar::{
    discovery::MemDiscovery,
    job::{
        config::JobConfig,
        local::{run_local, LocalOptions},
        report::{JobReport, Progress},
        JobContext,
    },
    pserver::{
        protocol::{PsRequest, PSERVER_METHOD},
        OptimizerConfig, ParamBuf,
    },
    task_queue::{auto_chunk_bytes, chunks_from_glob, protocol::MASTER_METHOD},
    trainer::{
        model::{Example, Model},
        reader::{read_chunk, read_glob, Format, ReaderOptions},
        softmax::SoftmaxRegression,
        ModelConfig,
    },
    transport::{
        self as tr, Connection, DevCa, Frame, Handler, Listener, MemNetwork, MemTransport, QuicTransport,
    },
};
use std::{
    future::Future,
    io::Write,
    path::{Path, PathBuf},
    pin::Pin,
    process::ExitCode,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use oar_bench::BoxError;

const FEATURES: usize = 123;
const CLASSES: usize = 2;

#[derive(Parser, Debug)]
#[command(about = "Examples per second of a run_local job against a plain single-threaded loop")]
struct Args {
    /// Copies of the source file in the training file.
    #[arg(long, default_value_t = 100)]
    copies: usize,
    /// The a1a-shaped source (libsvm, 123 features, 2 classes).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/a1a"))]
    source: PathBuf,
    /// Held-out data the master scores after each pass.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/a1a"))]
    test_data: PathBuf,
    /// Passes over the data (at least 2 for the steady figure).
    #[arg(long, default_value_t = 10)]
    passes: u32,
    /// Repetitions; medians are quoted.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Trainer counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    trainers: Vec<u32>,
    /// Modes.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "async,sync")]
    modes: Vec<ModeArg>,
    /// Transports.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "quic")]
    transports: Vec<TransportArg>,
    /// Mini-batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    batch_sizes: Vec<usize>,
    /// Pservers.
    #[arg(long, default_value_t = 2)]
    pservers: u32,
    /// Bytes of data per chunk (one task); 0 = the job's default, sized
    /// from the data (`auto_chunk_bytes`).
    #[arg(long, default_value_t = 0)]
    chunk_bytes: u64,
    /// Async only: push and pull every this many mini-batches (`push_every`, `pull_every`).
    #[arg(long, default_value_t = 1)]
    every: u32,
    /// SGD learning rate, both sides.
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// One trainer's oar / plain ratio to reach.
    #[arg(long, default_value_t = 0.7)]
    target: f64,
    /// Worker threads of the job's runtime (0: tokio's default, one per core).
    #[arg(long, default_value_t = 0)]
    workers: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TransportArg {
    Quic,
    Mem,
}

impl TransportArg {
    fn name(self) -> &'static str {
        match self {
            TransportArg::Quic => "quic",
            TransportArg::Mem => "mem",
        }
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// One plain-loop run.
#[derive(Clone, Copy, Debug)]
struct PlainRun {
    wall: f64,
    parse: f64,
    train: f64,
    last_loss: f64,
}

/// One oar run.
#[derive(Clone, Debug)]
struct OarRun {
    wall: f64,
    /// Seconds from the call to the end of each pass (after its scoring).
    pass_ends: Vec<f64>,
    /// The call counters at each pass end.
    pass_calls: Vec<Calls>,
    report: JobReport,
}

/// A measured configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    batch: usize,
    mode: ModeArg,
    transport: TransportArg,
    trainers: u32,
}

#[derive(Default)]
struct Samples {
    plain: Vec<PlainRun>,
    oar: Vec<OarRun>,
    ratio_whole: Vec<f64>,
    ratio_steady: Vec<f64>,
}

fn run(args: Args) -> Result<ExitCode, BoxError> {
    if args.passes < 2 || args.reps == 0 || args.copies == 0 {
        return Err("--passes must be at least 2, --reps and --copies at least 1".into());
    }
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("train.libsvm");
    let examples = write_copies(&args.source, &data, args.copies)?;
    let data_str = data.to_str().ok_or("temporary path is not UTF-8")?.to_string();
    let test_str = args.test_data.to_str().ok_or("--test-data is not UTF-8")?.to_string();
    let opts =
        ReaderOptions { format: Format::Libsvm, features: FEATURES, classes: CLASSES, skip_bad_lines: false };
    let size = std::fs::metadata(&data)?.len();

    // Examples per task, so the oar side's mini-batches can be counted: a
    // trainer cuts each task into batches, so a batch never spans two tasks.
    let t0 = Instant::now();
    let whole_read = read_glob(&data_str, &opts)?.len();
    let whole_read_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let mut task_sizes = Vec::new();
    let chunk_bytes = match args.chunk_bytes {
        0 => auto_chunk_bytes(size),
        bytes => bytes,
    };
    for chunk in chunks_from_glob(&data_str, chunk_bytes)? {
        task_sizes.push(read_chunk(&chunk, &opts)?.examples.len());
    }
    let chunked_s = t0.elapsed().as_secs_f64();
    let tasks = task_sizes.len();
    if task_sizes.iter().sum::<usize>() != whole_read || whole_read != examples {
        return Err(format!("chunks gave {task_sizes:?} examples, the whole file {whole_read}").into());
    }
    println!(
        "data: {} x {} = {examples} examples, {:.1} MB, {tasks} tasks of {} bytes; {} passes; {} pservers; \
         held-out {}; async push/pull every {}",
        args.source.display(),
        args.copies,
        size as f64 / 1e6,
        chunk_bytes,
        args.passes,
        args.pservers,
        args.test_data.display(),
        args.every
    );
    println!(
        "reading and parsing the file: whole {whole_read_s:.3} s, in {tasks} chunks {chunked_s:.3} s (x{:.2})",
        chunked_s / whole_read_s
    );
    println!("machine: {} cores; {}", common::cores(), common::load());

    let mut keys = Vec::new();
    for &batch in &args.batch_sizes {
        for &mode in &args.modes {
            for &transport in &args.transports {
                for &trainers in &args.trainers {
                    keys.push(Key { batch, mode, transport, trainers });
                }
            }
        }
    }
    let mut samples: Vec<Samples> = keys.iter().map(|_| Samples::default()).collect();
    let model = SoftmaxRegression::new(FEATURES, CLASSES)?;
    let n = (examples as u64 * u64::from(args.passes)) as f64;
    for rep in 1..=args.reps {
        for (key, s) in keys.iter().zip(&mut samples) {
            let plain = plain_run(&model, &data_str, &opts, key.batch, args.passes, args.lr)?;
            let config = job_config(&args, &data_str, &test_str, key)?;
            let oar = oar_run(&config, key.trainers, key.transport, args.workers)?;
            if !oar.report.is_done() || oar.report.tasks_done != (tasks as u64) * u64::from(args.passes) {
                return Err(format!("oar run did not train every task: {:?}", oar.report).into());
            }
            let plain_eps = n / plain.wall;
            let whole = n / oar.wall;
            let steady = steady_eps(&oar, examples);
            s.ratio_whole.push(whole / plain_eps);
            s.ratio_steady.push(steady / plain_eps);
            println!(
                "rep {rep} batch {:>4} {:>5} {:>4} T={}: plain {:>9} ex/s (parse {:.2} s, train {:.2} s, loss {:.4}) | \
                 oar whole {:>9} ex/s, steady {:>9} ex/s (loss {:.4}) | ratio {:.3} whole, {:.3} steady",
                key.batch,
                key.mode.name(),
                key.transport.name(),
                key.trainers,
                common::fmt_eps(plain_eps),
                plain.parse,
                plain.train,
                plain.last_loss,
                common::fmt_eps(whole),
                common::fmt_eps(steady),
                oar.report.final_loss,
                whole / plain_eps,
                steady / plain_eps
            );
            s.plain.push(plain);
            s.oar.push(oar);
        }
    }
    println!("machine after: {}", common::load());

    println!();
    println!(
        "| batch | mode | transport | trainers | plain ex/s | oar ex/s whole | oar ex/s steady | ratio whole | \
         ratio steady | target |"
    );
    println!("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    let (mut met, mut missed) = (Vec::new(), Vec::new());
    for (key, s) in keys.iter().zip(&samples) {
        let plain = common::median(s.plain.iter().map(|p| n / p.wall).collect());
        let whole = common::median(s.oar.iter().map(|o| n / o.wall).collect());
        let steady = common::median(s.oar.iter().map(|o| steady_eps(o, examples)).collect());
        let ratio = common::median(s.ratio_whole.clone());
        let target = if key.trainers == 1 {
            let pass = ratio >= args.target;
            let case = format!("{} {} batch {}", key.mode.name(), key.transport.name(), key.batch);
            if pass {
                met.push(case)
            } else {
                missed.push(case)
            }
            if pass {
                "PASS"
            } else {
                "MISS"
            }
        } else {
            ""
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.3} | {target} |",
            key.batch,
            key.mode.name(),
            key.transport.name(),
            key.trainers,
            common::fmt_eps(plain),
            common::fmt_eps(whole),
            common::fmt_eps(steady),
            ratio,
            common::median(s.ratio_steady.clone())
        );
    }

    // Where one trainer's time goes, per steady pass (medians over repetitions).
    println!();
    println!(
        "| batch | mode | transport | oar batches/pass | oar ms/pass | pulls/pass | pull ms (us/pull) | pushes/pass | \
         push ms (us/push) | master ms (us/task) | other ms | local ms | plain parse ms | plain compute ms | \
         start-up s | shutdown s |"
    );
    println!(
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (key, s) in keys.iter().zip(&samples) {
        if key.trainers != 1 {
            continue;
        }
        let passes = f64::from(args.passes);
        let oar_batches: usize = task_sizes.iter().map(|n| n.div_ceil(key.batch)).sum();
        // Every pull and push calls each pserver once.
        let exchanges = |kind: usize| {
            common::median(s.oar.iter().map(|o| steady_calls(o, kind)).collect()) / f64::from(args.pservers)
        };
        let (pulls, pushes) = (exchanges(PULL), exchanges(PUSH));
        let steady = common::median(s.oar.iter().map(steady_pass_seconds).collect());
        let busy = |kind: usize| common::median(s.oar.iter().map(|o| steady_busy(o, kind)).collect());
        let (pull, push, master, other) = (busy(PULL), busy(PUSH), busy(MASTER), busy(OTHER));
        let local = steady - pull - push - master - other;
        let parse = common::median(s.plain.iter().map(|p| p.parse / passes).collect());
        let compute = common::median(s.plain.iter().map(|p| p.train / passes).collect());
        let startup = common::median(s.oar.iter().map(|o| o.pass_ends[0] - steady_pass_seconds(o)).collect());
        let shutdown = common::median(
            s.oar.iter().map(|o| o.wall - o.pass_ends.last().copied().unwrap_or(o.wall)).collect(),
        );
        let ms = |x: f64| format!("{:.0}", x * 1e3);
        println!(
            "| {} | {} | {} | {oar_batches} | {} | {pulls:.0} | {} ({:.0}) | {pushes:.0} | {} ({:.0}) | {} ({:.0}) | \
             {} | {} | {} | {} | {startup:.2} | {shutdown:.2} |",
            key.batch,
            key.mode.name(),
            key.transport.name(),
            ms(steady),
            ms(pull),
            pull / pulls * 1e6,
            ms(push),
            push / pushes * 1e6,
            ms(master),
            master / tasks as f64 * 1e6,
            ms(other),
            ms(local),
            ms(parse),
            ms(compute),
        );
    }
    println!();
    println!(
        "verdict (1 trainer, whole ratio >= {}): met by [{}]; missed by [{}]",
        args.target,
        met.join(", "),
        missed.join(", ")
    );
    Ok(ExitCode::SUCCESS)
}

/// Write `copies` copies of `source` into `out`; returns the examples written.
fn write_copies(source: &Path, out: &Path, copies: usize) -> Result<usize, BoxError> {
    let mut text = std::fs::read(source).map_err(|e| format!("{}: {e}", source.display()))?;
    if !text.ends_with(b"\n") {
        text.push(b'\n');
    }
    let lines = text.split(|&b| b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)).count();
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    for _ in 0..copies {
        w.write_all(&text)?;
    }
    w.flush()?;
    Ok(lines * copies)
}

fn job_config(args: &Args, data: &str, test: &str, key: &Key) -> Result<JobConfig, BoxError> {
    let mut config = JobConfig::new(data, ModelConfig::Softmax { features: FEATURES, classes: CLASSES });
    config.test_data = Some(test.to_string());
    config.optimizer = OptimizerConfig::Sgd { lr: args.lr };
    config.mode = key.mode.mode();
    config.passes = args.passes;
    config.batch_size = key.batch;
    config.pservers = args.pservers;
    config.chunk_bytes = args.chunk_bytes;
    if key.mode == ModeArg::Async {
        config.push_every = args.every;
        config.pull_every = args.every;
    }
    config.validate()?;
    Ok(config)
}

/// Bytes the plain loop reads and parses at a time: streaming the file in
/// pieces this size parsed faster here than one `read_glob` of the whole file
/// (which holds every line and example of 11.6 MB at once).
const PLAIN_CHUNK: u64 = 1 << 20;

/// The reference: each pass, stream the file in `PLAIN_CHUNK` pieces (read
/// and parse with the trainers' parser), and run SGD over exact mini-batches
/// (a batch may span two pieces), on this thread.
fn plain_run(
    model: &SoftmaxRegression,
    data: &str,
    opts: &ReaderOptions,
    batch: usize,
    passes: u32,
    lr: f32,
) -> Result<PlainRun, BoxError> {
    let specs = model.param_specs();
    let mut params = ParamBuf::zeros(&specs);
    let mut grads = ParamBuf::zeros(&specs);
    let (mut parse, mut train, mut last_loss) = (0.0, 0.0, 0.0);
    let start = Instant::now();
    for _ in 0..passes {
        let (mut loss_sum, mut seen) = (0.0f64, 0usize);
        let mut pending: Vec<Example> = Vec::new();
        let chunks = chunks_from_glob(data, PLAIN_CHUNK)?;
        for (i, chunk) in chunks.iter().enumerate() {
            let t = Instant::now();
            pending.extend(read_chunk(chunk, opts)?.examples);
            parse += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let last = i + 1 == chunks.len();
            let full = if last { pending.len() } else { pending.len() / batch * batch };
            for b in pending[..full].chunks(batch) {
                let loss = model.loss_and_grad(&params, b, &mut grads);
                for (p, g) in params.as_mut_slice().iter_mut().zip(grads.as_slice()) {
                    *p -= lr * g;
                }
                loss_sum += f64::from(loss) * b.len() as f64;
            }
            seen += full;
            pending.drain(..full);
            train += t.elapsed().as_secs_f64();
        }
        last_loss = loss_sum / seen.max(1) as f64;
    }
    Ok(PlainRun { wall: start.elapsed().as_secs_f64(), parse, train, last_loss })
}

/// A whole `run_local` job in a fresh runtime of `workers` threads (0: one
/// per core; dropped after, so nothing of it runs during the next
/// measurement), its transport wrapped in [`Timed`].
fn oar_run(
    config: &JobConfig,
    trainers: u32,
    kind: TransportArg,
    workers: usize,
) -> Result<OarRun, BoxError> {
    let runtime = common::runtime(workers)?;
    let result = runtime.block_on(async {
        let (inner, listen): (Arc<dyn tr::Transport>, _) = match kind {
            TransportArg::Quic => {
                let tls = DevCa::new()?.tls_config("local")?;
                (Arc::new(QuicTransport::new(tls)?), "127.0.0.1:0")
            }
            TransportArg::Mem => (Arc::new(MemTransport::new(MemNetwork::new())), "mem:0"),
        };
        let stats = Arc::new(CallStats::default());
        let transport = Arc::new(Timed { inner, stats: stats.clone() });
        let discovery = Arc::new(MemDiscovery::new());
        let (mut pass_ends, mut pass_calls) = (Vec::new(), Vec::new());
        let start = Instant::now();
        let ctx = JobContext::new("local", discovery, transport, listen);
        let options = LocalOptions { trainers, ..LocalOptions::default() };
        let report = run_local(&ctx, config, &options, |event| {
            let Progress::PassEnded(_) = event else { return };
            pass_ends.push(start.elapsed().as_secs_f64());
            pass_calls.push(stats.snapshot());
        })
        .await?;
        let wall = start.elapsed().as_secs_f64();
        Ok::<_, BoxError>(OarRun { wall, pass_ends, pass_calls, report })
    });
    runtime.shutdown_timeout(Duration::from_secs(5));
    result
}

/// Median seconds of one pass after the first.
fn steady_pass_seconds(o: &OarRun) -> f64 {
    common::median(o.pass_ends.windows(2).map(|w| w[1] - w[0]).collect())
}

fn steady_eps(o: &OarRun, examples: usize) -> f64 {
    match (o.pass_ends.first(), o.pass_ends.last()) {
        (Some(first), Some(last)) if o.pass_ends.len() >= 2 && last > first => {
            (examples * (o.pass_ends.len() - 1)) as f64 / (last - first)
        }
        _ => f64::NAN,
    }
}

/// Seconds per pass with a call of `kind` in flight, passes 2..P.
fn steady_busy(o: &OarRun, kind: usize) -> f64 {
    match (o.pass_calls.first(), o.pass_calls.last()) {
        (Some(first), Some(last)) if o.pass_calls.len() >= 2 => {
            (last[kind].busy - first[kind].busy) / (o.pass_calls.len() - 1) as f64
        }
        _ => f64::NAN,
    }
}

/// Calls of `kind` per pass, passes 2..P.
fn steady_calls(o: &OarRun, kind: usize) -> f64 {
    match (o.pass_calls.first(), o.pass_calls.last()) {
        (Some(first), Some(last)) if o.pass_calls.len() >= 2 => {
            (last[kind].calls - first[kind].calls) as f64 / (o.pass_calls.len() - 1) as f64
        }
        _ => f64::NAN,
    }
}

const PULL: usize = 0;
const PUSH: usize = 1;
const MASTER: usize = 2;
const OTHER: usize = 3;

/// Per kind of call: how many, and the seconds during which at least one was in flight.
#[derive(Clone, Copy, Debug, Default)]
struct KindStats {
    calls: u64,
    busy: f64,
    inflight: u32,
    since: Option<Instant>,
}

type Calls = [KindStats; 4];

#[derive(Default)]
struct CallStats(Mutex<Calls>);

impl CallStats {
    fn begin(&self, kind: usize) {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let k = &mut all[kind];
        if k.inflight == 0 {
            k.since = Some(Instant::now());
        }
        k.inflight += 1;
        k.calls += 1;
    }

    fn end(&self, kind: usize) {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let k = &mut all[kind];
        k.inflight = k.inflight.saturating_sub(1);
        if k.inflight == 0 {
            if let Some(since) = k.since.take() {
                k.busy += since.elapsed().as_secs_f64();
            }
        }
    }

    /// The counters now, with calls in flight counted up to now.
    fn snapshot(&self) -> Calls {
        let mut all = *self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for k in &mut all {
            if let Some(since) = k.since {
                k.busy += since.elapsed().as_secs_f64();
            }
        }
        all
    }
}

/// A transport that forwards everything to `inner` and times the calls
/// made through its connections, by kind.
struct Timed {
    inner: Arc<dyn tr::Transport>,
    stats: Arc<CallStats>,
}

struct TimedConnection {
    inner: Arc<dyn Connection>,
    stats: Arc<CallStats>,
}

/// What `async_trait` makes of an `async fn` in a trait (this package does
/// not depend on the `async-trait` crate, so the futures are boxed by hand).
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl tr::Transport for Timed {
    fn connect<'a, 'b, 'f>(&'a self, addr: &'b str) -> BoxFuture<'f, tr::Result<Arc<dyn Connection>>>
    where
        'a: 'f,
        'b: 'f,
        Self: 'f,
    {
        Box::pin(async move {
            let inner = self.inner.connect(addr).await?;
            Ok(Arc::new(TimedConnection { inner, stats: self.stats.clone() }) as Arc<dyn Connection>)
        })
    }

    fn listen<'a, 'b, 'f>(
        &'a self,
        addr: &'b str,
        handler: Arc<dyn Handler>,
    ) -> BoxFuture<'f, tr::Result<Box<dyn Listener>>>
    where
        'a: 'f,
        'b: 'f,
        Self: 'f,
    {
        self.inner.listen(addr, handler)
    }
}

impl Connection for TimedConnection {
    fn call<'a, 'f>(&'a self, request: Frame, timeout: Duration) -> BoxFuture<'f, tr::Result<Frame>>
    where
        'a: 'f,
        Self: 'f,
    {
        let kind = match request.method {
            MASTER_METHOD => MASTER,
            PSERVER_METHOD => match request.meta::<PsRequest>() {
                Ok(PsRequest::Pull { .. }) => PULL,
                Ok(PsRequest::Push { .. } | PsRequest::PushPull { .. }) => PUSH,
                _ => OTHER,
            },
            _ => OTHER,
        };
        Box::pin(async move {
            self.stats.begin(kind);
            let reply = self.inner.call(request, timeout).await;
            self.stats.end(kind);
            reply
        })
    }

    fn peer(&self) -> &str {
        self.inner.peer()
    }
}
