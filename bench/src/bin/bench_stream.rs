//! Streaming (issue 19): how soon a record that arrives in a streaming
//! job's source is in the model, and how fast a stream trains against the
//! same data given as a fixed glob. Every job is a `run_local` job (what
//! `examples/local.rs` runs: a master, pservers and trainers in one process,
//! on `MemDiscovery`, over QUIC with mutual TLS on 127.0.0.1), in a fresh
//! tokio runtime (one worker per core), async mode, batches of 64, SGD,
//! one pserver, held-out data `testdata/a1a` (a streaming job without any
//! fails at its end: "training diverged in pass 1: the test loss is NaN").
//!
//! ```sh
//! cargo run --release -p oar-bench --bin bench_stream
//! # options: --only latency|throughput  (latency) --records N [2400] --lines N [8]
//! #   --gap-ms MIN,MAX [20,50] --window S [10] --check-window S [1; 0 = skip] --overlap
//! #   (throughput) --copies N [1000] --copies-per-file N [50] --reps R [5] --trainers T [1]
//! #   --target-p99 S [1.0] --target-ratio R [0.9]
//! ```
//!
//! A full run takes about 80 s (3 latency runs of ~11 s, 20 jobs of 2-3 s).
//!
//! **Latency**: from a record's arrival in the source to the end of the first
//! parameter update that includes it; one trainer (so that the push carrying
//! a record is known exactly, see below).
//!
//! - The writer (a thread) makes every line unique: an a1a line with one
//!   more feature, `124:<record number>`. The job reads 124 features
//!   (`ModelConfig::Softmax { features: 124 }` gives the readers the data's
//!   shape) and trains a model plugin (`Plugins::model`) that strips that
//!   feature from each example, notes the instant its gradient was computed
//!   (when `loss_and_grad` returns), and runs the built-in softmax
//!   regression over the 123 a1a features on the rest.
//! - Arrival: every `--gap-ms` (uniform, 20-50 ms) the writer adds `--lines`
//!   records. Mode **dir**: it writes them to `.part-K.tmp` and renames it
//!   to `part-K.libsvm` in the streamed directory; arrival = just after the
//!   rename returns. Mode **file**: it appends them to the streamed file in
//!   one `write` (whole lines); arrival = just after the write returns. A
//!   first batch of records is written and waited for before the measured
//!   ones (start-up is not measured); after the last, the source is closed
//!   (`_CLOSED` / `<file>.closed`) and the job ends.
//! - Update: the transport is wrapped (`Probe`, server side: it wraps the
//!   handlers the master and the pserver listen with) to note when the
//!   pserver begins and ends handling each push (`Push`/`PushPull`), per
//!   shard. The update that includes a record is, on every shard, the first
//!   push the pserver begins handling after the record's gradient was
//!   computed; the latency ends when the last of those has been handled
//!   (applied, reply ready). By default the latency runs train with
//!   `overlap` off, so each push is made, and waited for, by the trainer's
//!   loop before its next batch: the first push after a gradient is the one
//!   that carries it, exactly. (With `--overlap` an exchange runs in its own
//!   task and may send its request after the next batch was computed: then
//!   a record may be matched with the push before its own, one push early,
//!   ~0.1-0.3 ms.)
//! - Where the time goes, per record: **source** = arrival to the task
//!   holding it being released (the master polls the source every 100 ms,
//!   `StreamOptions::poll_every`, appends tasks, and releases them once the
//!   snapshot holding them is stored; taken from the master's status events,
//!   the first whose `todo + pending + done + discarded` passes the task's
//!   id); **wait** = from then to the master handing the task out (a trainer
//!   told `Wait` sleeps `retry_after_ms`, the master's tick interval,
//!   100 ms); **train** = from the hand-out to the record's gradient
//!   (reading and parsing the task, the batches before it); **push** =
//!   gradient to update applied. Each column's percentiles are taken on its
//!   own, so they do not add up. The per-run line also counts the master's
//!   fenced state writes (every poll that finds data stores a snapshot,
//!   which holds the source's mark).
//! - Runs: dir and file with `--window` (10 s), and dir again with
//!   `--check-window` (1 s), to show that the window (how often progress is
//!   reported and the test set scored) plays no part in the latency.
//!
//! **Throughput**: `--copies` copies of `testdata/a1a` (default 1000:
//! 1,605,000 examples, 116 MB) in files of `--copies-per-file` copies (20
//! files), `--trainers` trainers. Per repetition, interleaved:
//!
//! - **A glob**: `JobConfig::new("<dir>/part-*.libsvm")`, 1 pass, chunk size
//!   from the data (`auto_chunk_bytes`: here 40 tasks);
//! - **B stream**: `JobConfig::streaming(StreamSource::dir(<dir>))` over the
//!   same directory, every file and `_CLOSED` already there, so the first
//!   poll takes the whole stream at once (64 KiB chunks, `STREAM_CHUNK_BYTES`:
//!   1780 tasks);
//! - **A64 glob**: A with `chunk_bytes` = 64 KiB, i.e. B's tasks as a batch
//!   job: B against A64 is the cost of streaming itself, A64 against A the
//!   cost of the stream's smaller tasks;
//! - **B+ stream**: B with `chunk_bytes` = A's chunk size (a streaming job
//!   takes `chunk_bytes` when it is not 0), i.e. A's tasks as a stream.
//!
//! Examples/s three ways, the same for every job: **report** = the job
//! report's `examples_per_second` (examples / seconds from the master's
//! start to the job's end, before the final scoring); **wall** = examples /
//! wall seconds of the `run_local` call (start-up, final scoring and
//! shutdown included); **2nd half** = the second half of the examples / the
//! time they took (from the master's status events: from the first report
//! that took the examples trained past half, to the last report), i.e.
//! without the start. A glob job's master also reads and parses its
//! training set (up to `TRAIN_SAMPLE_BYTES`, 64 MiB) during training, in
//! the background, for the final report's train accuracy (a stream has
//! none), and scores it after training: on this 2-core machine that read
//! slows A and A64 in the first half (report and wall), and the final scoring
//! counts in their wall figure. "first task" = the call to the first task
//! handed out; CPU s = the process's CPU time during the job; the master's
//! state writes and the trainer's batches, exchanges and stale pulls are
//! counted from `oar::metrics` (per-run lines). Ratios are per repetition
//! (B over the A or A64 run of the same repetition, B+ over A), medians
//! quoted.

#[path = "../../../examples/common/mod.rs"]
mod common;

use clap::{Parser, ValueEnum};
use oar::{
    discovery::MemDiscovery,
    job::{
        config::{JobConfig, StreamSource, STREAM_CHUNK_BYTES},
        local::{run_local, LocalOptions},
        report::{JobReport, Progress},
        role::TRAIN_SAMPLE_BYTES,
        JobContext, Plugins,
    },
    pserver::{
        protocol::{PsRequest, PSERVER_METHOD},
        Mode, OptimizerConfig, ParamBuf, ParamSpec,
    },
    task_queue::{
        auto_chunk_bytes,
        protocol::{MasterRequest, MASTER_METHOD},
        Chunk, MasterStatus, TaskReply,
    },
    trainer::{
        model::{Example, Model},
        reader::{read_glob, Format, ReaderOptions},
        ModelConfig,
    },
    transport::{
        self as tr, Connection, DevCa, Frame, FrameParts, Handler, Listener, QuicTransport, RemoteError,
    },
};
use std::{
    collections::{BTreeSet, HashMap},
    fs,
    future::Future,
    io::Write,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use oar_bench::BoxError;

/// a1a's features and classes.
const FEATURES: usize = 123;
const CLASSES: usize = 2;
/// The 1-based libsvm index of the feature that carries a record's number.
const MARKER: usize = FEATURES + 1;

#[derive(Parser, Debug)]
#[command(about = "Streaming: arrival-to-update latency, and stream against glob throughput")]
struct Args {
    /// Which parts to run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "latency,throughput")]
    only: Vec<Part>,
    /// The a1a-shaped source (libsvm, 123 features, 2 classes).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/a1a"))]
    source: PathBuf,
    /// Latency: measured records per run (after a warm-up batch).
    #[arg(long, default_value_t = 2400)]
    records: usize,
    /// Latency: records per file (dir) or per append (file).
    #[arg(long, default_value_t = 8)]
    lines: usize,
    /// Latency: the writer's pause between files or appends, uniform in MIN,MAX milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "20,50")]
    gap_ms: Vec<u64>,
    /// Latency: the job's window, seconds.
    #[arg(long, default_value_t = 10.0)]
    window: f64,
    /// Latency: run the dir mode once more with this window (0: skip).
    #[arg(long, default_value_t = 1.0)]
    check_window: f64,
    /// Latency: let exchanges overlap training (the job's default; off here
    /// so that the push carrying a record is known exactly).
    #[arg(long)]
    overlap: bool,
    /// Throughput: copies of the source in the data.
    #[arg(long, default_value_t = 1000)]
    copies: usize,
    /// Throughput: copies per file.
    #[arg(long, default_value_t = 50)]
    copies_per_file: usize,
    /// Throughput: repetitions (each runs A, B, A64, B+); medians are quoted.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Throughput: trainers.
    #[arg(long, default_value_t = 1)]
    trainers: u32,
    /// Latency target: p99, seconds.
    #[arg(long, default_value_t = 1.0)]
    target_p99: f64,
    /// Throughput target: stream / glob examples per second.
    #[arg(long, default_value_t = 0.9)]
    target_ratio: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Part {
    Latency,
    Throughput,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SourceKind {
    Dir,
    File,
}

impl SourceKind {
    fn name(self) -> &'static str {
        match self {
            SourceKind::Dir => "dir",
            SourceKind::File => "file",
        }
    }
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if args.gap_ms.len() != 2 || args.gap_ms[0] > args.gap_ms[1] || args.lines == 0 || args.records == 0 {
        return Err("--gap-ms takes MIN,MAX; --lines and --records at least 1".into());
    }
    if args.records + args.lines >= 1 << 24 {
        return Err("--records: record numbers travel as f32 feature values, exact below 2^24".into());
    }
    if args.reps == 0 || args.copies == 0 || args.copies_per_file == 0 || args.trainers == 0 {
        return Err("--reps, --copies, --copies-per-file and --trainers must be at least 1".into());
    }
    let lines = source_lines(&args.source)?;
    let dir = tempfile::tempdir()?;
    println!("machine: {} cores; {}", common::cores(), common::load());
    if args.only.contains(&Part::Latency) {
        latency(&args, &lines, dir.path())?;
    }
    if args.only.contains(&Part::Throughput) {
        throughput(&args, dir.path())?;
    }
    println!("machine after: {}", common::load());
    Ok(())
}

/// The source's lines, without line ends or trailing blanks.
fn source_lines(path: &Path) -> Result<Vec<String>, BoxError> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let lines: Vec<String> =
        text.lines().map(str::trim_end).filter(|l| !l.is_empty()).map(str::to_string).collect();
    if lines.is_empty() {
        return Err(format!("{}: no lines", path.display()).into());
    }
    Ok(lines)
}

// ---------------------------------------------------------------------------
// Latency

/// The model trained in the latency runs: the built-in softmax regression
/// over a1a's 123 features, fed each example without its marker feature,
/// noting when each record's gradient was computed.
struct Marked {
    inner: Box<dyn Model>,
    /// (record number, when `loss_and_grad` returned), in order.
    seen: Mutex<Vec<(u32, Instant)>>,
}

impl Marked {
    /// The batch without marker features, and the record numbers they held.
    fn strip(batch: &[Example]) -> (Vec<Example>, Vec<u32>) {
        let mut ids = Vec::with_capacity(batch.len());
        let clean = batch
            .iter()
            .map(|e| {
                let mut features = Vec::with_capacity(e.features.len());
                for &(i, v) in &e.features {
                    if i as usize == MARKER - 1 {
                        ids.push(v as u32);
                    } else {
                        features.push((i, v));
                    }
                }
                Example { label: e.label, features }
            })
            .collect();
        (clean, ids)
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Vec<(u32, Instant)>> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Model for Marked {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.inner.param_specs()
    }

    fn features(&self) -> usize {
        self.inner.features()
    }

    fn classes(&self) -> usize {
        self.inner.classes()
    }

    fn loss_and_grad(&self, params: &ParamBuf, batch: &[Example], grads: &mut ParamBuf) -> f32 {
        let (clean, ids) = Self::strip(batch);
        let loss = self.inner.loss_and_grad(params, &clean, grads);
        let now = Instant::now();
        self.seen().extend(ids.into_iter().map(|id| (id, now)));
        loss
    }

    fn predict(&self, params: &ParamBuf, batch: &[Example], out: &mut Vec<u32>) -> f32 {
        self.inner.predict(params, &Self::strip(batch).0, out)
    }
}

/// What the probe saw the master and the pserver handle.
#[derive(Default)]
struct Seen {
    /// Per shard: (begin, end) of every push the pserver handled.
    pushes: HashMap<u32, Vec<(Instant, Instant)>>,
    /// Tasks handed out: when, the task's id, its chunks.
    assigned: Vec<Assigned>,
    /// `Wait` replies to `GetTask`.
    waits: u64,
}

struct Assigned {
    at: Instant,
    task: u64,
    chunks: Vec<Chunk>,
}

/// A transport that forwards everything to `inner` and wraps the handlers
/// it serves in [`ProbeHandler`].
struct Probe {
    inner: Arc<dyn tr::Transport>,
    seen: Arc<Mutex<Seen>>,
}

struct ProbeHandler {
    inner: Arc<dyn Handler>,
    seen: Arc<Mutex<Seen>>,
}

/// What `async_trait` makes of an `async fn` in a trait (this package does
/// not depend on the `async-trait` crate, so the futures are boxed by hand).
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl tr::Transport for Probe {
    fn connect<'a, 'b, 'f>(&'a self, addr: &'b str) -> BoxFuture<'f, tr::Result<Arc<dyn Connection>>>
    where
        'a: 'f,
        'b: 'f,
        Self: 'f,
    {
        self.inner.connect(addr)
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
        let handler = Arc::new(ProbeHandler { inner: handler, seen: self.seen.clone() });
        self.inner.listen(addr, handler)
    }
}

/// The requests the probe notes.
enum Kind {
    Push { shard: u32 },
    GetTask,
    Other,
}

fn kind(request: &Frame) -> Kind {
    match request.method {
        PSERVER_METHOD => match request.meta::<PsRequest>() {
            Ok(PsRequest::Push { shard, .. } | PsRequest::PushPull { shard, .. }) => Kind::Push { shard },
            _ => Kind::Other,
        },
        MASTER_METHOD => match request.meta::<MasterRequest>() {
            Ok(MasterRequest::GetTask { .. }) => Kind::GetTask,
            _ => Kind::Other,
        },
        _ => Kind::Other,
    }
}

impl Handler for ProbeHandler {
    fn handle<'a, 'f>(&'a self, request: Frame) -> BoxFuture<'f, Result<Frame, RemoteError>>
    where
        'a: 'f,
        Self: 'f,
    {
        Box::pin(async move { self.handle_parts(request).await.map(FrameParts::join) })
    }

    fn handle_parts<'a, 'f>(&'a self, request: Frame) -> BoxFuture<'f, Result<FrameParts, RemoteError>>
    where
        'a: 'f,
        Self: 'f,
    {
        Box::pin(async move {
            let kind = kind(&request);
            let begin = Instant::now();
            let reply = self.inner.handle_parts(request).await;
            let end = Instant::now();
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            match (kind, &reply) {
                (Kind::Push { shard }, Ok(_)) => seen.pushes.entry(shard).or_default().push((begin, end)),
                (Kind::GetTask, Ok(parts)) => {
                    match (Frame { meta: parts.meta.clone(), ..Frame::default() }).meta() {
                        Ok(TaskReply::Assigned { task, .. }) => {
                            seen.assigned.push(Assigned { at: end, task: task.id.0, chunks: task.chunks })
                        }
                        Ok(TaskReply::Wait { .. }) => seen.waits += 1,
                        _ => {}
                    }
                }
                _ => {}
            }
            drop(seen);
            reply
        })
    }
}

/// Where and when a record arrived.
#[derive(Clone, Debug)]
struct Arrival {
    at: Instant,
    /// The file's name (not its path).
    file: String,
    /// The record's first byte in the file.
    offset: u64,
}

/// What the writer thread needs.
struct Writer {
    kind: SourceKind,
    /// The streamed directory, or the streamed file.
    path: PathBuf,
    lines: Vec<String>,
    per_write: usize,
    records: usize,
    gap_ms: (u64, u64),
    model: Arc<Marked>,
    stop: Arc<AtomicBool>,
}

impl Writer {
    /// Write a warm-up batch and wait until it is trained, then the
    /// measured records, then close the source. Returns every record's
    /// arrival, by record number (the first `per_write` are the warm-up).
    fn run(self) -> Result<Vec<Arrival>, String> {
        let io = |what: &str, path: &Path, e: std::io::Error| format!("{what} {}: {e}", path.display());
        let mut arrivals = Vec::with_capacity(self.per_write + self.records);
        let mut appended = match self.kind {
            SourceKind::File => Some(
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)
                    .map_err(|e| io("open", &self.path, e))?,
            ),
            SourceKind::Dir => None,
        };
        let mut file_len = 0u64;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let total = self.per_write + self.records;
        let mut write = 0usize;
        while arrivals.len() < total {
            if self.stop.load(Ordering::Relaxed) {
                return Err("the job ended before the writer did".into());
            }
            if write == 1 {
                // The warm-up batch: wait until it is trained (start-up is not measured).
                let deadline = Instant::now() + Duration::from_secs(60);
                while self.model.seen().len() < self.per_write {
                    if Instant::now() > deadline || self.stop.load(Ordering::Relaxed) {
                        return Err("the warm-up records were not trained within 60 s".into());
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            if write > 0 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let (lo, hi) = self.gap_ms;
                std::thread::sleep(Duration::from_millis(lo + rng % (hi - lo + 1)));
            }
            let first = arrivals.len();
            let n = self.per_write.min(total - first);
            let mut text = String::new();
            let mut offsets = Vec::with_capacity(n);
            for id in first..first + n {
                offsets.push(text.len() as u64);
                let line = &self.lines[id % self.lines.len()];
                text.push_str(&format!("{line} {MARKER}:{id}\n"));
            }
            let (at, file, base) = match &mut appended {
                Some(f) => {
                    f.write_all(text.as_bytes()).map_err(|e| io("append to", &self.path, e))?;
                    let at = Instant::now();
                    let name = self.path.file_name().map(|n| n.to_string_lossy().into_owned());
                    let base = file_len;
                    file_len += text.len() as u64;
                    (at, name.unwrap_or_default(), base)
                }
                None => {
                    let tmp = self.path.join(format!(".part-{write:06}.tmp"));
                    let name = format!("part-{write:06}.libsvm");
                    fs::write(&tmp, &text).map_err(|e| io("write", &tmp, e))?;
                    fs::rename(&tmp, self.path.join(&name)).map_err(|e| io("rename", &tmp, e))?;
                    (Instant::now(), name, 0)
                }
            };
            arrivals.extend(offsets.into_iter().map(|o| Arrival {
                at,
                file: file.clone(),
                offset: base + o,
            }));
            write += 1;
        }
        let marker = match self.kind {
            SourceKind::Dir => self.path.join("_CLOSED"),
            SourceKind::File => PathBuf::from(format!("{}.closed", self.path.display())),
        };
        fs::write(&marker, b"").map_err(|e| io("write", &marker, e))?;
        Ok(arrivals)
    }
}

/// One latency run's per-record figures, seconds.
#[derive(Default)]
struct Latencies {
    total: Vec<f64>,
    source: Vec<f64>,
    wait: Vec<f64>,
    train: Vec<f64>,
    push: Vec<f64>,
    /// Files or appends written (measured), tasks trained, `Wait` replies,
    /// pushes handled (all shards), shards pushed to.
    writes: usize,
    tasks: usize,
    waits: u64,
    pushes: usize,
    shards: usize,
    wall: f64,
    /// The master's fenced writes: all, snapshots; the last write's bytes.
    master_writes: f64,
    master_snapshots: f64,
    state_bytes: f64,
}

fn latency(args: &Args, lines: &[String], root: &Path) -> Result<(), BoxError> {
    println!();
    println!(
        "latency: {} measured records per run, {} per file/append, every {}-{} ms; 1 trainer, 1 pserver, \
         async, batch 64, overlap {}",
        args.records,
        args.lines,
        args.gap_ms[0],
        args.gap_ms[1],
        if args.overlap { "on" } else { "off" }
    );
    let mut runs = vec![(SourceKind::Dir, args.window), (SourceKind::File, args.window)];
    if args.check_window > 0.0 {
        runs.push((SourceKind::Dir, args.check_window));
    }
    let mut results = Vec::new();
    for (i, &(kind, window)) in runs.iter().enumerate() {
        let dir = root.join(format!("latency-{i}"));
        fs::create_dir_all(&dir)?;
        let l = latency_run(args, lines, kind, window, &dir)?;
        println!(
            "  {} window {window} s: {} records in {} writes, {} tasks, {} Wait replies, {} pushes to {} shards, \
             {} master writes ({} snapshots, last {:.1} kB), {:.1} s; p50 {:.0} ms, p99 {:.0} ms",
            kind.name(),
            l.total.len(),
            l.writes,
            l.tasks,
            l.waits,
            l.pushes,
            l.shards,
            l.master_writes,
            l.master_snapshots,
            l.state_bytes / 1e3,
            l.wall,
            pct(&l.total, 0.5) * 1e3,
            pct(&l.total, 0.99) * 1e3,
        );
        results.push((kind, window, l));
    }
    println!();
    println!(
        "| source | window | records | p50 ms | p99 ms | max ms | source p50/p99 | wait p50/p99 | train p50/p99 | \
         push p50/p99 | target p99 <= {:.0} ms |",
        args.target_p99 * 1e3
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for (kind, window, l) in &results {
        let ms = |v: &[f64]| format!("{:.0} / {:.0}", pct(v, 0.5) * 1e3, pct(v, 0.99) * 1e3);
        let fine = |v: &[f64]| format!("{:.2} / {:.2}", pct(v, 0.5) * 1e3, pct(v, 0.99) * 1e3);
        println!(
            "| {} | {window} s | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {} |",
            kind.name(),
            l.total.len(),
            pct(&l.total, 0.5) * 1e3,
            pct(&l.total, 0.99) * 1e3,
            pct(&l.total, 1.0) * 1e3,
            ms(&l.source),
            ms(&l.wait),
            fine(&l.train),
            fine(&l.push),
            if pct(&l.total, 0.99) <= args.target_p99 { "met" } else { "**missed**" },
        );
    }
    Ok(())
}

/// Released tasks in a status: every task handed out-able so far (only grows).
fn released(s: &MasterStatus) -> u64 {
    (s.queue.todo + s.queue.pending + s.queue.done + s.queue.discarded) as u64
}

fn latency_run(
    args: &Args,
    lines: &[String],
    kind: SourceKind,
    window: f64,
    dir: &Path,
) -> Result<Latencies, BoxError> {
    let (source, path) = match kind {
        SourceKind::Dir => {
            let data = dir.join("in");
            fs::create_dir_all(&data)?;
            (StreamSource::dir(data.to_str().ok_or("temporary path is not UTF-8")?), data)
        }
        SourceKind::File => {
            let file = dir.join("stream.libsvm");
            (StreamSource::file(file.to_str().ok_or("temporary path is not UTF-8")?), file)
        }
    };
    // The readers see 124 features (the marker too); the model trains on a1a's 123.
    let mut config =
        JobConfig::streaming(source, ModelConfig::Softmax { features: MARKER, classes: CLASSES });
    // Held-out data: without any, a streaming job fails at its end ("the
    // test loss is NaN", see the reply of this benchmark's first run).
    config.test_data = Some(args.source.to_str().ok_or("--source is not UTF-8")?.to_string());
    config.mode = Mode::Async;
    config.pservers = 1;
    config.overlap = args.overlap;
    config.optimizer = OptimizerConfig::Sgd { lr: 0.1 };
    if let Some(stream) = &mut config.stream {
        stream.window = Duration::from_secs_f64(window);
    }
    config.validate()?;
    let model = Arc::new(Marked {
        inner: ModelConfig::Softmax { features: FEATURES, classes: CLASSES }.build()?,
        seen: Mutex::new(Vec::with_capacity(args.records + args.lines)),
    });
    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = Writer {
        kind,
        path,
        lines: lines.to_vec(),
        per_write: args.lines,
        records: args.records,
        gap_ms: (args.gap_ms[0], args.gap_ms[1]),
        model: model.clone(),
        stop: stop.clone(),
    };

    let metrics0 = oar::metrics::encode();
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut events: Vec<(Instant, u64)> = Vec::new();
    let writing = std::thread::spawn(move || writer.run());
    let ran = runtime.block_on(async {
        let quic = Arc::new(QuicTransport::new(DevCa::new()?.tls_config("bench-stream")?)?);
        let transport = Arc::new(Probe { inner: quic, seen: seen.clone() });
        let plugins = Plugins { model: Some(model.clone()), ..Plugins::default() };
        let ctx = JobContext {
            plugins,
            ..JobContext::new("stream", Arc::new(MemDiscovery::new()), transport, "127.0.0.1:0")
        };
        let options = LocalOptions { trainers: 1, ..LocalOptions::default() };
        let report = run_local(&ctx, &config, &options, |event| {
            if let Progress::Status(s) = event {
                events.push((Instant::now(), released(s)));
            }
        })
        .await?;
        Ok::<_, BoxError>(report)
    });
    stop.store(true, Ordering::Relaxed);
    runtime.shutdown_timeout(Duration::from_secs(5));
    let wall = started.elapsed().as_secs_f64();
    let metrics = oar::metrics::encode();
    let delta = |name: &str| metric(&metrics, name) - metric(&metrics0, name);
    let arrivals = writing.join().map_err(|_| "the writer panicked")??;
    let report = ran?;
    if !report.is_done() {
        return Err(format!("the latency job failed: {:?}", report.reason).into());
    }

    // When each record's gradient was first computed.
    let mut grads: HashMap<u32, Instant> = HashMap::new();
    for &(id, at) in model.seen().iter() {
        grads.entry(id).or_insert(at);
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(PoisonError::into_inner));
    let mut pushes = seen.pushes;
    for handled in pushes.values_mut() {
        handled.sort_by_key(|&(begin, _)| begin);
    }
    // Chunks handed out, by file name: (start, end, task, when).
    let mut chunks: HashMap<String, Vec<(u64, u64, u64, Instant)>> = HashMap::new();
    for a in &seen.assigned {
        for c in &a.chunks {
            let name = Path::new(&c.path).file_name().map(|n| n.to_string_lossy().into_owned());
            chunks.entry(name.unwrap_or_default()).or_default().push((c.start, c.end, a.task, a.at));
        }
    }

    let secs = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
    let mut l = Latencies {
        waits: seen.waits,
        pushes: pushes.values().map(Vec::len).sum(),
        shards: pushes.len(),
        wall,
        master_writes: delta("oar_master_state_writes_total"),
        master_snapshots: delta("oar_master_snapshot_writes_total"),
        state_bytes: metric(&metrics, "oar_master_state_bytes"),
        ..Latencies::default()
    };
    let mut tasks = BTreeSet::new();
    let mut writes = BTreeSet::new();
    for (id, arrival) in arrivals.iter().enumerate().skip(args.lines) {
        let grad = *grads.get(&(id as u32)).ok_or_else(|| format!("record {id} was never trained"))?;
        // The update carrying it: on every shard, the first push begun after its gradient.
        let mut update = grad;
        for handled in pushes.values() {
            let i = handled.partition_point(|&(begin, _)| begin < grad);
            let &(_, end) = handled.get(i).ok_or_else(|| format!("no push after record {id}'s gradient"))?;
            update = update.max(end);
        }
        let (task, assigned) = chunks
            .get(&arrival.file)
            .and_then(|cs| cs.iter().find(|c| c.0 <= arrival.offset && arrival.offset < c.1))
            .map(|c| (c.2, c.3))
            .ok_or_else(|| format!("no task handed out holds record {id}"))?;
        let i = events.partition_point(|&(_, released)| released <= task);
        let available = events.get(i).map_or(assigned, |&(at, _)| at.min(assigned));
        tasks.insert(task);
        writes.insert((arrival.file.clone(), arrival.at));
        l.total.push(secs(arrival.at, update));
        l.source.push(secs(arrival.at, available));
        l.wait.push(secs(available, assigned));
        l.train.push(secs(assigned, grad));
        l.push.push(secs(grad, update));
    }
    l.tasks = tasks.len();
    l.writes = writes.len();
    for v in [&mut l.total, &mut l.source, &mut l.wait, &mut l.train, &mut l.push] {
        v.sort_by(f64::total_cmp);
    }
    Ok(l)
}

// ---------------------------------------------------------------------------
// Throughput

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Job {
    Glob,
    Stream,
    Glob64,
    StreamBig,
}

impl Job {
    fn name(self) -> &'static str {
        match self {
            Job::Glob => "A glob",
            Job::Stream => "B stream",
            Job::Glob64 => "A64 glob, 64 KiB chunks",
            Job::StreamBig => "B+ stream, A's chunks",
        }
    }
}

/// One throughput run.
struct Run {
    report: JobReport,
    wall: f64,
    /// Seconds from the call to the first task handed out.
    first_task: f64,
    /// Examples per second over the second half of the examples: from the
    /// first report that took the examples trained past half to the last.
    second_half: f64,
    /// CPU seconds of the process during the run.
    cpu: f64,
    /// The master's fenced writes during the run: all, snapshots; the last write's bytes.
    writes: f64,
    snapshots: f64,
    state_bytes: f64,
    /// The trainer's batches, exchanges (and their seconds), and stale pulls.
    batches: f64,
    exchanges: f64,
    exchange_seconds: f64,
    stale_pulls: f64,
}

fn throughput(args: &Args, root: &Path) -> Result<(), BoxError> {
    let dir = root.join("throughput");
    fs::create_dir_all(&dir)?;
    let mut text = fs::read(&args.source).map_err(|e| format!("{}: {e}", args.source.display()))?;
    if !text.ends_with(b"\n") {
        text.push(b'\n');
    }
    let per_copy = text.split(|&b| b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)).count();
    let (mut files, mut left) = (0, args.copies);
    while left > 0 {
        let n = left.min(args.copies_per_file);
        let mut w = std::io::BufWriter::new(fs::File::create(dir.join(format!("part-{files:05}.libsvm")))?);
        for _ in 0..n {
            w.write_all(&text)?;
        }
        w.flush()?;
        left -= n;
        files += 1;
    }
    fs::write(dir.join("_CLOSED"), b"")?;
    let examples = (per_copy * args.copies) as f64;
    let dir_str = dir.to_str().ok_or("temporary path is not UTF-8")?;
    let glob = format!("{dir_str}/part-*.libsvm");
    let test = args.source.to_str().ok_or("--source is not UTF-8")?;
    let model = ModelConfig::Softmax { features: FEATURES, classes: CLASSES };
    let setup = |mut c: JobConfig| {
        c.test_data = Some(test.to_string());
        c.mode = Mode::Async;
        c.passes = 1;
        c.pservers = 1;
        c.optimizer = OptimizerConfig::Sgd { lr: 0.1 };
        c
    };
    let bytes: u64 = fs::read_dir(&dir)?.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum();
    let stream = setup(JobConfig::streaming(StreamSource::dir(dir_str), model.clone()));
    let configs = [
        (Job::Glob, setup(JobConfig::new(&glob, model.clone()))),
        (Job::Stream, stream.clone()),
        (Job::Glob64, JobConfig { chunk_bytes: STREAM_CHUNK_BYTES, ..setup(JobConfig::new(&glob, model)) }),
        (Job::StreamBig, JobConfig { chunk_bytes: auto_chunk_bytes(bytes), ..stream }),
    ];
    for (_, c) in &configs {
        c.validate()?;
    }
    // What a glob job's master reads and parses for its train accuracy:
    // timed on the first file, scaled.
    let opts =
        ReaderOptions { format: Format::Libsvm, features: FEATURES, classes: CLASSES, skip_bad_lines: false };
    let first = dir.join("part-00000.libsvm");
    let t = Instant::now();
    let read = read_glob(first.to_str().ok_or("temporary path is not UTF-8")?, &opts)?.len();
    let sample = bytes.min(TRAIN_SAMPLE_BYTES);
    let read_s = t.elapsed().as_secs_f64() * sample as f64 / fs::metadata(&first)?.len() as f64;
    if read != per_copy * args.copies_per_file.min(args.copies) {
        return Err(format!(
            "{}: {read} examples, expected {}",
            first.display(),
            per_copy * args.copies_per_file
        )
        .into());
    }
    println!();
    println!(
        "throughput: {} x {} = {examples} examples, {:.1} MB in {files} files; {} trainer(s), 1 pserver, async, \
         batch 64; {} reps of A, B, A64, B+ interleaved",
        args.source.display(),
        args.copies,
        bytes as f64 / 1e6,
        args.trainers,
        args.reps
    );
    println!(
        "a glob job's master reads and parses {:.1} MB of it for the final train accuracy, during training: \
         ~{read_s:.2} s of one core here",
        sample as f64 / 1e6
    );

    let mut runs: Vec<Vec<Run>> = configs.iter().map(|_| Vec::new()).collect();
    for rep in 1..=args.reps {
        for ((job, config), runs) in configs.iter().zip(&mut runs) {
            let run = throughput_run(config, args.trainers)?;
            if !run.report.is_done() {
                return Err(format!("{} failed: {:?}", job.name(), run.report.reason).into());
            }
            println!(
                "  rep {rep} {:<24} {:>4} tasks: report {:>7} ex/s, wall {:>7} ex/s ({:.2} s), second half {:>7} ex/s, \
                 first task {:.0} ms; {:.2} CPU s, {} state writes ({} snapshots, last {:.0} kB); trainer: \
                 {} batches, {} exchanges ({:.0} us each), {} stale pulls",
                job.name(),
                run.report.tasks_done,
                common::fmt_eps(run.report.examples_per_second),
                common::fmt_eps(examples / run.wall),
                run.wall,
                common::fmt_eps(run.second_half),
                run.first_task * 1e3,
                run.cpu,
                run.writes,
                run.snapshots,
                run.state_bytes / 1e3,
                run.batches,
                run.exchanges,
                run.exchange_seconds / run.exchanges * 1e6,
                run.stale_pulls
            );
            runs.push(run);
        }
    }

    let [glob_runs, stream_runs, glob64_runs, big_runs] = &runs[..] else {
        return Err("four jobs expected".into());
    };
    let report = |r: &Run| r.report.examples_per_second;
    let wall = |r: &Run| examples / r.wall;
    let half = |r: &Run| r.second_half;
    let paired = |a: &[Run], b: &[Run], f: &dyn Fn(&Run) -> f64| {
        common::median(a.iter().zip(b).map(|(a, b)| f(b) / f(a)).collect())
    };
    println!();
    println!(
        "| job | tasks | ex/s (report) | ex/s (wall) | ex/s (2nd half) | wall s | first task ms | \
         B / this: report | wall | 2nd half |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for ((job, _), r) in configs.iter().zip(&runs) {
        let ratios = match job {
            Job::Stream => " | | ".to_string(),
            _ => format!(
                "{:.3} | {:.3} | {:.3}",
                paired(r, stream_runs, &report),
                paired(r, stream_runs, &wall),
                paired(r, stream_runs, &half)
            ),
        };
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.0} | {ratios} |",
            job.name(),
            r.first().map_or(0, |r| r.report.tasks_done),
            common::fmt_eps(common::median(r.iter().map(report).collect())),
            common::fmt_eps(common::median(r.iter().map(wall).collect())),
            common::fmt_eps(common::median(r.iter().map(half).collect())),
            common::median(r.iter().map(|r| r.wall).collect()),
            common::median(r.iter().map(|r| r.first_task * 1e3).collect()),
        );
    }
    let verdict = |x: f64| if x >= args.target_ratio { "met" } else { "MISSED" };
    let (by_report, by_half) =
        (paired(glob_runs, stream_runs, &report), paired(glob_runs, stream_runs, &half));
    println!();
    println!(
        "verdict (B / A, medians of {} paired reps, target {}): report ex/s {by_report:.3} {}, wall {:.3}, \
         2nd half {by_half:.3} {}; B / A64 (the same 64 KiB tasks): report {:.3}, 2nd half {:.3}; \
         B+ / A (the same tasks as A): report {:.3}, 2nd half {:.3}",
        args.reps,
        args.target_ratio,
        verdict(by_report),
        paired(glob_runs, stream_runs, &wall),
        verdict(by_half),
        paired(glob64_runs, stream_runs, &report),
        paired(glob64_runs, stream_runs, &half),
        paired(glob_runs, big_runs, &report),
        paired(glob_runs, big_runs, &half)
    );
    Ok(())
}

/// One job in a fresh runtime (dropped after, so nothing of it runs during
/// the next measurement).
fn throughput_run(config: &JobConfig, trainers: u32) -> Result<Run, BoxError> {
    let (cpu0, metrics0) = (cpu_seconds(), oar::metrics::encode());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(async {
        let transport = Arc::new(QuicTransport::new(DevCa::new()?.tls_config("bench-stream")?)?);
        let ctx = JobContext::new("stream", Arc::new(MemDiscovery::new()), transport, "127.0.0.1:0");
        let options = LocalOptions { trainers, ..LocalOptions::default() };
        let start = Instant::now();
        let mut first_task = None;
        // (seconds, examples trained) at each change of the examples trained.
        let mut trained: Vec<(f64, u64)> = Vec::new();
        let report = run_local(&ctx, config, &options, |event| {
            let Progress::Status(s) = event else { return };
            let now = start.elapsed().as_secs_f64();
            if first_task.is_none() && s.queue.pending + s.queue.done > 0 {
                first_task = Some(now);
            }
            let examples = s.passes.iter().map(|p| p.examples).sum();
            if trained.last().is_none_or(|&(_, e)| e != examples) {
                trained.push((now, examples));
            }
        })
        .await?;
        let wall = start.elapsed().as_secs_f64();
        let second_half = match trained.last() {
            Some(&(end, total)) => {
                let i = trained.partition_point(|&(_, e)| e * 2 < total);
                let (from, done) = trained[i.min(trained.len() - 1)];
                (total - done) as f64 / (end - from)
            }
            None => f64::NAN,
        };
        Ok::<_, BoxError>(Run {
            report,
            wall,
            first_task: first_task.unwrap_or(f64::NAN),
            second_half,
            cpu: 0.0,
            writes: 0.0,
            snapshots: 0.0,
            state_bytes: 0.0,
            batches: 0.0,
            exchanges: 0.0,
            exchange_seconds: 0.0,
            stale_pulls: 0.0,
        })
    });
    runtime.shutdown_timeout(Duration::from_secs(5));
    let metrics = oar::metrics::encode();
    let delta = |name: &str| metric(&metrics, name) - metric(&metrics0, name);
    result.map(|run| Run {
        cpu: cpu_seconds() - cpu0,
        writes: delta("oar_master_state_writes_total"),
        snapshots: delta("oar_master_snapshot_writes_total"),
        state_bytes: metric(&metrics, "oar_master_state_bytes"),
        batches: delta("oar_trainer_batches_total"),
        exchanges: delta("oar_trainer_exchange_seconds_count"),
        exchange_seconds: delta("oar_trainer_exchange_seconds_sum"),
        stale_pulls: delta("oar_trainer_stale_pulls_total"),
        ..run
    })
}

/// The value of the unlabelled metric `name` in a Prometheus exposition (0 if absent).
fn metric(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// CPU seconds this process has used (user + system), from `/proc/self/stat`.
fn cpu_seconds() -> f64 {
    let stat = fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is the 3rd field.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15: 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

// ---------------------------------------------------------------------------

/// The `p` quantile of `sorted` (nearest rank); NaN if empty.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}
