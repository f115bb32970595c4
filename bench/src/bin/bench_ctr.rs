//! CTR end to end (issue 18): examples per second of the CTR example's job
//! (what `examples/ctr.rs` runs: `run_local` with a master, P pservers and
//! T trainers in one process, on `MemDiscovery`, over QUIC with mutual TLS on
//! 127.0.0.1, a sparse model whose rows live on the pservers) against the
//! same model trained in one process without oar, measured in the same run,
//! interleaved.
//!
//! ```sh
//! cargo run --release -p oar-bench --bin bench_ctr
//! cargo run --release -p oar-bench --bin bench_ctr -- --models lr --modes async --shapes 1x1 --shards 64 --reps 9
//! # options: --copies N [8] --passes P [5] --reps R [5] --models lr,fm --factors K [8]
//! #   --modes sync,async --shapes 1x1,2x2 (trainers x pservers) --shards 64,2
//! #   --batch-size [64] --lr [0.1] --run-timeout SECONDS [60] --workers W [0 = one per core]
//! ```
//!
//! About 100 s with the defaults on the 2-core development machine.
//!
//! Data: `testdata/a1a` (1605 examples, ids 1..=123) written `--copies`
//! times into one file in a temporary directory (12,840 examples, 0.9 MB by
//! default; writing it is not timed), trained for `--passes` passes (64,200
//! examples in all, as 40 passes over a1a), scored on `testdata/a1a.t`
//! (30,956 examples). The copies keep the master's scoring of a1a.t, which
//! it does at every pass end while the trainers go on, to a handful of times
//! per run, as for a real CTR job with few passes over much data.
//!
//! Per repetition, for each configuration (model x mode x shape x shards):
//! first the reference, then the oar job, so every oar run has a reference
//! measured just before it.
//!
//! - **reference**: one thread, no oar service. The model is
//!   `CtrModelConfig::build()` (LR, or FM with `--factors`, no crosses); the
//!   file is read with `oar::trainer::id_reader::read_glob_ids`, cut into
//!   batches of `--batch-size` in file order, and for each batch:
//!   `SparseModel::batch_ids`, each table's rows gathered from a local
//!   `HashMap<u64, row>` (a row is created with `oar::pserver::init_row` on
//!   first touch, as a pserver creates it), `SparseModel::loss_and_grad`,
//!   then AdaGrad applied in place with the pservers' own optimizer
//!   (`OptimizerConfig::build()`): `apply_row` on each touched row with its
//!   own step and slot (as `SparseTable::apply` does) and `apply` on the
//!   dense bias. The map hashes ids with a multiply-shift mixer, like the
//!   pserver's table and the trainer's `RowBatch`. Examples/s = examples of all passes / wall
//!   seconds of reading the file once and training; the test accuracy
//!   (`evaluate_sparse` on a1a.t, not timed) shows the same model was
//!   trained.
//! - **oar**: `run_local` with `ctr.rs`'s job (`ModelConfig::Ctr`, AdaGrad
//!   lr 0.1 eps 1e-10, batch 64, chunks sized from the data, seed 1), in a
//!   fresh tokio runtime (one worker per core), `--modes` sync and async,
//!   `--shapes` T trainers x P pservers, `--shards` 64 (the examples'
//!   default: the CTR example's figure) and 2 (to show what the calls per
//!   shard cost, below). The figure is the job's own
//!   `JobReport::examples_per_second`: examples of all passes / seconds from
//!   the master's start to the job's end (reading a1a.t, cutting tasks,
//!   start-up, every pass, the scoring after each pass, which runs while the
//!   trainers train the next, and the final scoring; not the shutdown).
//!   "steady" = examples of passes 2..P / time from the end of pass 1 to the
//!   end of pass P (from the `PassEnded` callback). A trainer's batches never
//!   span two of its tasks, so its batches are not exactly the reference's.
//!
//! The ratio is oar / reference, paired with the reference run just before
//! it; the summary quotes medians over repetitions.
//!
//! Where a batch's time goes, from the process's metrics
//! (`oar::metrics::encode()`, read before and after each run):
//!
//! - "oar µs/batch": the mean of the trainers' `oar_trainer_exchange_seconds`,
//!   which times each sparse batch from its first call to its acknowledged
//!   push. That is the model and `push_pull_rows_ahead` (the row and dense
//!   gradients out, the dense bias and the next batch's rows back; sync,
//!   answered when the step completes), and for a task's first batch a
//!   `pull_rows` before (one call per pserver). "call rounds/batch" is 1
//!   plus those row pulls per batch (`oar_trainer_row_pulls`). The
//!   reference's µs per batch beside it is the same work without the calls.
//! - "pserver calls/batch": calls the pservers answered (`oar_ps_pulls`,
//!   where a push-pull counts too) per batch.
//!   The master's scoring adds about 0.2 a batch (its row pulls of a1a.t).
//!   These count shards' calls: a push, a push-pull and a dense pull go to
//!   every shard of a job with tables (`PserverClient::push_rows`), 64 with
//!   the default shards, but the calls to one pserver's shards travel in
//!   one batch (one round trip), as a row pull's do.
//! - "in steps": the share of the trainers' time (T x the job's training
//!   seconds) spent inside those batches; the rest is start-up, task
//!   hand-outs and reports, and waiting at pass ends.

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
    pserver::{init_row, sparse::IdHash, Optimizer, OptimizerConfig, ParamBuf, TableSpec},
    trainer::{
        eval::evaluate_sparse,
        id_reader::{read_glob_ids, IdReaderOptions},
        reader::Format,
        CtrModelConfig, IdExample, ModelConfig, RowBatch, SparseModel,
    },
    transport::{DevCa, QuicTransport, Transport},
};
use std::{
    collections::HashMap,
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio_util::sync::CancellationToken;

use oar_bench::BoxError;

#[derive(Parser, Debug)]
#[command(about = "Examples per second of the CTR example's job against the same model trained without oar")]
struct Args {
    /// Copies of the source file in the training file.
    #[arg(long, default_value_t = 8)]
    copies: usize,
    /// The training source (libsvm ids, binary labels).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/a1a"))]
    source: PathBuf,
    /// Held-out data: the master scores it after each pass, the reference at the end.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/a1a.t"))]
    test_data: PathBuf,
    /// Passes over the training file (at least 2 for the steady figure).
    #[arg(long, default_value_t = 5)]
    passes: u32,
    /// Repetitions; medians are quoted.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Models.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "lr,fm")]
    models: Vec<ModelArg>,
    /// Factors of the factorization machine.
    #[arg(long, default_value_t = 8)]
    factors: usize,
    /// Modes.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sync,async")]
    modes: Vec<ModeArg>,
    /// Trainers x pservers, e.g. 1x1,2x2.
    #[arg(long, value_delimiter = ',', value_parser = parse_shape, default_value = "1x1,2x2")]
    shapes: Vec<(u32, u32)>,
    /// Logical shards of the job: 64 is the job's default, 8 the CTR
    /// example's; 2 shows what each shard's share of a batch costs.
    #[arg(long, value_delimiter = ',', default_value = "64,2")]
    shards: Vec<u32>,
    /// Examples per mini-batch, both sides.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// AdaGrad's learning rate, both sides.
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// Seconds an oar run may take before it is stopped and the benchmark
    /// fails (a run takes 0.3-4 s here).
    #[arg(long, default_value_t = 60)]
    run_timeout: u64,
    /// Worker threads of the job's runtime (0: tokio's default, one per core).
    #[arg(long, default_value_t = 0)]
    workers: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelArg {
    Lr,
    Fm,
}

fn parse_shape(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?}: expected TRAINERSxPSERVERS, e.g. 2x2");
    let (t, p) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    let (t, p): (u32, u32) = (t.parse().map_err(|_| bad())?, p.parse().map_err(|_| bad())?);
    if t == 0 || p == 0 {
        return Err(bad());
    }
    Ok((t, p))
}

/// A measured configuration.
#[derive(Clone, Copy, Debug)]
struct Key {
    model: ModelArg,
    mode: ModeArg,
    trainers: u32,
    pservers: u32,
    shards: u32,
}

impl Key {
    fn ctr(&self, factors: usize) -> CtrModelConfig {
        match self.model {
            ModelArg::Lr => CtrModelConfig::Lr { crosses: false },
            ModelArg::Fm => CtrModelConfig::Fm { factors, crosses: false },
        }
    }
    fn model_name(&self, factors: usize) -> String {
        match self.model {
            ModelArg::Lr => "LR".into(),
            ModelArg::Fm => format!("FM k={factors}"),
        }
    }
    /// For the log lines.
    fn label(&self, factors: usize) -> String {
        format!(
            "{:>7} {:>5} {}x{} {:>2} shards",
            self.model_name(factors),
            self.mode.name(),
            self.trainers,
            self.pservers,
            self.shards
        )
    }
    /// The first cells of a table row.
    fn row(&self, factors: usize) -> String {
        format!(
            "{} | {} | {}x{} | {}",
            self.model_name(factors),
            self.mode.name(),
            self.trainers,
            self.pservers,
            self.shards
        )
    }
}

/// One reference run.
#[derive(Clone, Copy, Debug)]
struct RefRun {
    /// Seconds of reading the file once and training every pass.
    wall: f64,
    read: f64,
    batches: u64,
    test_accuracy: f32,
    last_loss: f64,
}

/// One oar run.
#[derive(Clone, Debug)]
struct OarRun {
    report: JobReport,
    /// Seconds from the `run_local` call to each pass's end (after its scoring).
    pass_ends: Vec<f64>,
    /// Seconds of the whole `run_local` call.
    wall: f64,
    /// Sparse steps timed by the trainers, and their seconds.
    steps: f64,
    step_seconds: f64,
    /// Calls the pservers served (from their `oar_ps_pulls`, where a
    /// push-pull counts too): push-pulls, one per shard; dense pulls, one
    /// per shard; row pulls, one per pserver. The master's scoring adds
    /// about 0.2 a batch (its row pulls of a1a.t, 1024 examples each).
    calls: f64,
    /// Row pulls the trainers made on their own (`oar_trainer_row_pulls`):
    /// a batch whose rows did not come with the push before it.
    row_pulls: f64,
}

#[derive(Default)]
struct Samples {
    reference: Vec<RefRun>,
    oar: Vec<OarRun>,
    ratio: Vec<f64>,
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

fn run(args: Args) -> Result<ExitCode, BoxError> {
    if args.passes < 2
        || args.reps == 0
        || args.copies == 0
        || args.batch_size == 0
        || args.shards.contains(&0)
    {
        return Err(
            "--passes must be at least 2, --reps, --copies, --batch-size and --shards at least 1".into()
        );
    }
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("train.libsvm");
    write_copies(&args.source, &data, args.copies)?;
    let data = data.to_str().ok_or("temporary path is not UTF-8")?.to_string();
    let test = args.test_data.to_str().ok_or("--test-data is not UTF-8")?.to_string();
    let opts = IdReaderOptions::new(Format::Libsvm);
    let examples = read_glob_ids(&data, &opts)?.len();
    let test_set = read_glob_ids(&test, &opts)?;
    if examples == 0 || test_set.is_empty() {
        return Err("the training or the test file holds no example".into());
    }
    let n = examples as f64 * f64::from(args.passes);
    println!(
        "data: {} x {} = {examples} examples, {:.2} MB; {} passes ({n} examples); batch {}; test {} ({} examples); \
         AdaGrad lr {}",
        args.source.display(),
        args.copies,
        std::fs::metadata(&data)?.len() as f64 / 1e6,
        args.passes,
        args.batch_size,
        args.test_data.display(),
        test_set.len(),
        args.lr
    );
    println!("machine: {} cores; {}", common::cores(), common::load());

    let mut keys = Vec::new();
    for &model in &args.models {
        for &mode in &args.modes {
            for &(trainers, pservers) in &args.shapes {
                for &shards in &args.shards {
                    keys.push(Key { model, mode, trainers, pservers, shards });
                }
            }
        }
    }
    let mut samples: Vec<Samples> = keys.iter().map(|_| Samples::default()).collect();
    let started = Instant::now();
    for rep in 1..=args.reps {
        for (key, s) in keys.iter().zip(&mut samples) {
            let config = job_config(&args, &data, &test, key)?;
            let reference = reference_run(&args, key, &data, &test_set, config.seed)?;
            let oar = oar_run(&config, key.trainers, Duration::from_secs(args.run_timeout), args.workers)?;
            let r = &oar.report;
            if !r.is_done() || r.tasks_discarded > 0 {
                return Err(format!("the oar job did not train every task: {}", r.to_json()).into());
            }
            let ref_eps = n / reference.wall;
            let ratio = r.examples_per_second / ref_eps;
            println!(
                "rep {rep} {}: reference {:>7} ex/s (read {:.3} s, loss {:.4}, test acc {:.4}) | \
                 oar {:>7} ex/s, steady {:>7} (loss {:.4}, test acc {:.4}, run_local {:.2} s, {:.0} µs/batch, \
                 {:.1} calls/batch) | ratio {ratio:.3}",
                key.label(args.factors),
                common::fmt_eps(ref_eps),
                reference.read,
                reference.last_loss,
                reference.test_accuracy,
                common::fmt_eps(r.examples_per_second),
                common::fmt_eps(steady_eps(&oar, examples)),
                r.final_loss,
                r.test_accuracy,
                oar.wall,
                oar.step_seconds / oar.steps * 1e6,
                oar.calls / oar.steps,
            );
            s.ratio.push(ratio);
            s.reference.push(reference);
            s.oar.push(oar);
        }
    }
    println!(
        "{} repetitions in {:.0} s; machine after: {}",
        args.reps,
        started.elapsed().as_secs_f64(),
        common::load()
    );

    println!();
    println!(
        "| model | mode | trainers x pservers | shards | reference ex/s | oar ex/s | **oar / reference** | \
         oar steady ex/s | test acc. reference | test acc. oar |"
    );
    println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (key, s) in keys.iter().zip(&samples) {
        let reference = common::median(s.reference.iter().map(|r| n / r.wall).collect());
        let oar = common::median(s.oar.iter().map(|o| o.report.examples_per_second).collect());
        let steady = common::median(s.oar.iter().map(|o| steady_eps(o, examples)).collect());
        let acc_ref = common::median(s.reference.iter().map(|r| f64::from(r.test_accuracy)).collect());
        let (acc_lo, acc_hi) = min_max(s.oar.iter().map(|o| f64::from(o.report.test_accuracy)));
        let acc_oar = if acc_hi - acc_lo < 5e-5 {
            format!("{:.2}%", acc_lo * 100.0)
        } else {
            format!("{:.2}–{:.2}%", acc_lo * 100.0, acc_hi * 100.0)
        };
        println!(
            "| {} | {} | {} | **{:.3}** | {} | {:.2}% | {acc_oar} |",
            key.row(args.factors),
            common::fmt_eps(reference),
            common::fmt_eps(oar),
            common::median(s.ratio.clone()),
            common::fmt_eps(steady),
            acc_ref * 100.0,
        );
    }

    println!();
    println!(
        "| model | mode | trainers x pservers | shards | call rounds/batch | pserver calls/batch | oar µs/batch | \
         reference µs/batch | oar batches | in steps |"
    );
    println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (key, s) in keys.iter().zip(&samples) {
        let step_us = common::median(s.oar.iter().map(|o| o.step_seconds / o.steps * 1e6).collect());
        let calls = common::median(s.oar.iter().map(|o| o.calls / o.steps).collect());
        let rounds = common::median(s.oar.iter().map(|o| 1.0 + o.row_pulls / o.steps).collect());
        let ref_us = common::median(s.reference.iter().map(|r| r.wall / r.batches as f64 * 1e6).collect());
        let batches = common::median(s.oar.iter().map(|o| o.steps).collect());
        let busy = common::median(
            s.oar
                .iter()
                .map(|o| {
                    let training = n / o.report.examples_per_second;
                    o.step_seconds / (training * f64::from(key.trainers))
                })
                .collect(),
        );
        println!(
            "| {} | {rounds:.2} | {calls:.1} | {step_us:.0} | {ref_us:.1} | {batches:.0} | {:.0}% |",
            key.row(args.factors),
            busy * 100.0,
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `ctr.rs`'s job for `key`.
fn job_config(args: &Args, data: &str, test: &str, key: &Key) -> Result<JobConfig, BoxError> {
    let mut config = JobConfig::new(data, ModelConfig::Ctr(key.ctr(args.factors)));
    config.test_data = Some(test.to_string());
    config.optimizer = OptimizerConfig::parse("adagrad", args.lr)?;
    config.mode = key.mode.mode();
    config.passes = args.passes;
    config.batch_size = args.batch_size;
    config.pservers = key.pservers;
    config.shards = key.shards;
    config.validate()?;
    Ok(config)
}

/// Write `copies` copies of `source` into `out`.
fn write_copies(source: &Path, out: &Path, copies: usize) -> Result<(), BoxError> {
    let mut text = std::fs::read(source).map_err(|e| format!("{}: {e}", source.display()))?;
    if !text.ends_with(b"\n") {
        text.push(b'\n');
    }
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    for _ in 0..copies {
        w.write_all(&text)?;
    }
    w.flush()?;
    Ok(())
}

/// A row of a local table: its step, then `dim` values and each optimizer
/// slot's `dim` values (the pserver's layout).
struct Row {
    step: u64,
    floats: Vec<f32>,
}

/// One table of the reference, keyed by id.
struct LocalTable {
    spec: TableSpec,
    rows: HashMap<u64, Row, IdHash>,
}

impl LocalTable {
    /// Copy the rows of `batch`'s table `t` in, creating absent ones at
    /// their initial value with fresh optimizer state.
    fn gather(&mut self, t: usize, batch: &mut RowBatch, seed: u64, slots: usize) {
        let LocalTable { spec, rows } = self;
        let dim = spec.dim;
        for i in 0..batch.rows(t) {
            let id = batch.ids(t)[i];
            let row = rows.entry(id).or_insert_with(|| {
                let mut floats = vec![0.0; dim * (1 + slots)];
                init_row(spec, seed, id, &mut floats[..dim]);
                Row { step: 0, floats }
            });
            batch.values_mut(t)[i * dim..(i + 1) * dim].copy_from_slice(&row.floats[..dim]);
        }
    }

    /// Read-only: the rows of `batch`'s table `t`, absent ones at their initial value.
    fn read(&self, t: usize, batch: &mut RowBatch, seed: u64) {
        let dim = self.spec.dim;
        for i in 0..batch.rows(t) {
            let id = batch.ids(t)[i];
            let out = &mut batch.values_mut(t)[i * dim..(i + 1) * dim];
            match self.rows.get(&id) {
                Some(row) => out.copy_from_slice(&row.floats[..dim]),
                None => init_row(&self.spec, seed, id, out),
            }
        }
    }

    /// The update of every row of `grads`' table `t`, as `SparseTable::apply` does it.
    fn apply(&mut self, t: usize, grads: &RowBatch, opt: &dyn Optimizer) {
        let dim = self.spec.dim;
        for (id, g) in grads.iter(t) {
            if let Some(row) = self.rows.get_mut(&id) {
                let (params, slots) = row.floats.split_at_mut(dim);
                opt.apply_row(params, g, &mut row.step, slots);
            }
        }
    }
}

/// The reference: read the file, train every pass on one thread, then
/// score (not timed).
fn reference_run(
    args: &Args,
    key: &Key,
    data: &str,
    test_set: &[IdExample],
    seed: u64,
) -> Result<RefRun, BoxError> {
    let model: Box<dyn SparseModel> = key.ctr(args.factors).build()?;
    let opt = OptimizerConfig::parse("adagrad", args.lr)?.build()?;
    let slots = opt.state_slots();
    let start = Instant::now();
    let examples = read_glob_ids(data, &IdReaderOptions::new(Format::Libsvm))?;
    let read = start.elapsed().as_secs_f64();
    let specs = model.param_specs();
    let mut dense = ParamBuf::init(&specs, seed);
    let mut dense_grads = ParamBuf::zeros(&specs);
    let mut dense_state = opt.new_state(dense.len());
    let mut tables: Vec<LocalTable> =
        model.table_specs().into_iter().map(|spec| LocalTable { spec, rows: HashMap::default() }).collect();
    let (mut rows, mut row_grads) = (model.new_rows(), model.new_rows());
    let (mut batches, mut last_loss) = (0u64, 0.0);
    for _ in 0..args.passes {
        let mut loss_sum = 0.0f64;
        for batch in examples.chunks(args.batch_size) {
            model.batch_ids(batch, &mut rows);
            for (t, table) in tables.iter_mut().enumerate() {
                table.gather(t, &mut rows, seed, slots);
            }
            row_grads.clone_from(&rows);
            let loss = model.loss_and_grad(&dense, &rows, batch, &mut dense_grads, &mut row_grads);
            if !loss.is_finite() {
                return Err(format!("the reference's loss is {loss}: training diverged").into());
            }
            opt.apply(dense.as_mut_slice(), dense_grads.as_slice(), &mut dense_state);
            for (t, table) in tables.iter_mut().enumerate() {
                table.apply(t, &row_grads, opt.as_ref());
            }
            loss_sum += f64::from(loss) * batch.len() as f64;
            batches += 1;
        }
        last_loss = loss_sum / examples.len().max(1) as f64;
    }
    let wall = start.elapsed().as_secs_f64();
    let eval = evaluate_sparse(model.as_ref(), &dense, test_set, 1024, |batch| {
        for (t, table) in tables.iter().enumerate() {
            table.read(t, batch, seed);
        }
    });
    Ok(RefRun { wall, read, batches, test_accuracy: eval.accuracy, last_loss })
}

/// A whole `run_local` job in a fresh runtime of `workers` threads (0: one
/// per core; dropped after, so nothing of it runs during the next
/// measurement). A run that takes longer than
/// `timeout` is stopped (through its shutdown token) and fails the
/// benchmark, naming the configuration, rather than stalling it.
fn oar_run(config: &JobConfig, trainers: u32, timeout: Duration, workers: usize) -> Result<OarRun, BoxError> {
    let runtime = common::runtime(workers)?;
    let result = runtime.block_on(async {
        let tls = DevCa::new()?.tls_config("bench-ctr")?;
        let transport: Arc<dyn Transport> = Arc::new(QuicTransport::new(tls)?);
        let ctx = JobContext::new("bench-ctr", Arc::new(MemDiscovery::new()), transport, "127.0.0.1:0");
        let shutdown = CancellationToken::new();
        let options = LocalOptions { trainers, shutdown: shutdown.clone(), ..LocalOptions::default() };
        let before = oar::metrics::encode();
        let mut pass_ends = Vec::new();
        let start = Instant::now();
        let report = {
            let run = run_local(&ctx, config, &options, |event| {
                if let Progress::PassEnded(_) = event {
                    pass_ends.push(start.elapsed().as_secs_f64());
                }
            });
            tokio::pin!(run);
            match tokio::time::timeout(timeout, &mut run).await {
                Ok(ran) => ran?,
                Err(_) => {
                    shutdown.cancel();
                    let _ = tokio::time::timeout(Duration::from_secs(10), &mut run).await;
                    return Err(format!(
                        "the oar run ({:?}, {} trainers, {} pservers, {} shards) took more than {timeout:?}; stopped",
                        config.mode, trainers, config.pservers, config.shards
                    )
                    .into());
                }
            }
        };
        let wall = start.elapsed().as_secs_f64();
        let after = oar::metrics::encode();
        let diff = |name: &str| metric(&after, name) - metric(&before, name);
        let (steps, step_seconds) =
            (diff("oar_trainer_exchange_seconds_count"), diff("oar_trainer_exchange_seconds_sum"));
        // A push-pull counts as a push and a pull, and a sparse batch's
        // pushes are all push-pulls (sync too): the pulls count every call.
        let calls = diff("oar_ps_pulls_total");
        let row_pulls = diff("oar_trainer_row_pulls_total");
        Ok::<_, BoxError>(OarRun { report, pass_ends, wall, steps, step_seconds, calls, row_pulls })
    });
    runtime.shutdown_timeout(Duration::from_secs(5));
    result
}

/// The value of the sample `name` (no labels) in a Prometheus text
/// exposition; 0 if it is not there (not registered yet).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            let (k, v) = line.split_once(' ')?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// Examples of passes 2..P / seconds from the end of pass 1 to the end of pass P.
fn steady_eps(o: &OarRun, examples: usize) -> f64 {
    match (o.pass_ends.first(), o.pass_ends.last()) {
        (Some(first), Some(last)) if o.pass_ends.len() >= 2 && last > first => {
            (examples * (o.pass_ends.len() - 1)) as f64 / (last - first)
        }
        _ => f64::NAN,
    }
}

fn min_max(v: impl Iterator<Item = f64>) -> (f64, f64) {
    v.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)))
}
