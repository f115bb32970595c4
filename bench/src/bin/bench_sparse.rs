//! Sparse tables (issue 18): row throughput through a real pserver over
//! QUIC, resident memory per row, and a capped table under a long Zipf
//! stream, each against a plain in-memory reference or the raw size.
//!
//! ```sh
//! cargo run --release -p oar-bench --bin bench_sparse
//! cargo run --release -p oar-bench --bin bench_sparse -- --parts throughput --dims 16 --rounds 9 --steps 200
//! # options: --parts throughput,memory,cap --dims 16,64 --batch [4096] --universe [10000000]
//! #   --zipf-s [1.1] --rounds [7] --steps [200] (per round) --warmup [20] --client-threads [1]
//! #   --mem-rows 2000000,500000 (one per --dims) --cap [400000] --cap-dim [16]
//! #   --cap-draws [10000000] --evictions lru,lfu --seed [1] --target-rows [1e6] --target-mem [1.5]
//! ```
//!
//! The ids: a Zipf(s) law over ranks `1..=universe` (rank k drawn with
//! probability proportional to `k^-s`), sampled by rejection-inversion
//! (Hörmann and Derflinger 1996, O(1) per draw, no table) from oar's
//! `SplitMix64`; rank k is id `SplitMix64::new(k).next_u64()` (a bijection,
//! so ids look like hashed features). A batch draws until it holds `--batch`
//! distinct ids. The sampler is checked at start against the exact
//! probabilities of ranks 1, 2 and 10.
//!
//! The example re-executes itself (`--role pserver|memory|cap`), so each
//! figure is one process's own.
//!
//! 1. **Throughput** (`throughput`), per `--dims` value: a child process
//!    runs a real [`Pserver`] (`Pserver::start` on its own `MemDiscovery`,
//!    a `QuicTransport` on 127.0.0.1 with certificates from a `DevCa`,
//!    async mode, one shard, Adam, so every row carries 2 state slots; a
//!    one-float dense parameter, as a model has some) with one table of
//!    that dim. The parent's `PserverClient` (a tokio runtime of
//!    `--client-threads` workers) makes steps: `pull_rows` of one batch,
//!    then `push_rows` of a gradient for the same ids. Every round
//!    (`--rounds`, after `--warmup` steps) first runs the **reference** on
//!    the round's batches: an in-process `std::collections::HashMap<u64,
//!    usize>` (std hasher) into a flat `Vec<f32>`, a gather of the batch's
//!    rows into a buffer (absent ids read zeros) and a scatter of an SGD
//!    update (`row -= lr * grad`, creating absent rows), on one thread;
//!    then the pserver on the same batches. Rows/s counts a row pulled and
//!    pushed once (`batch` per step). The pserver child's CPU time (user +
//!    system, every thread: `getrusage(RUSAGE_SELF)`, which it answers on
//!    its stdin) is read before and after each round: **rows per pserver
//!    CPU-second** is the rate per pserver core, the figure of the target
//!    (`--target-rows`, 1M/s at dim 16). Medians over rounds; the ratio is
//!    paired per round.
//! 2. **Memory per row** (`memory`), per `--dims` value: a child builds a
//!    `SparseTable` (Adam, 2 slots) and pushes `--mem-rows` distinct ids
//!    into it with `SparseTable::apply` in batches of `--batch` (so every
//!    row's params and Adam state are written); resident bytes per row =
//!    (`VmRSS` after - before) / rows, against raw = `4 * dim * 3 + 8`
//!    (params, two slots, the id) and against the table's own estimate
//!    (`bytes_per_row`). MET when resident / raw <= `--target-mem` (1.5).
//! 3. **A capped table** (`cap`), per `--evictions` value: a child feeds a
//!    `SparseTable` of `--cap-dim` floats with `max_rows: Some(--cap)` (a
//!    cap in **rows**, per shard, not bytes) batches from the Zipf stream
//!    until `--cap-draws` ids have been drawn; after every `apply` it
//!    checks `stats().rows <= cap` (violations counted) and samples
//!    `VmRSS`. Reported: peak rows, violations, evictions, resident bytes
//!    (peak and final, over the baseline before the table existed) against
//!    `cap * bytes_per_row`, and the apply rate.

#[path = "../../../examples/common/mod.rs"]
mod common;
use oar_bench::child::ChildProc;

use clap::{Parser, ValueEnum};
use oar::{
    discovery::{Discovery, MemDiscovery},
    job::keys::JobKeys,
    pserver::{
        sparse::{Eviction, RowPolicy, SparseTable, TableSpec, MAX_ROWS_PER_CALL},
        Coordinator, CoordinatorOptions, Init, Mode, OptimizerConfig, ParamBuf, ParamSpec, Placement,
        Pserver, PserverClient, PserverClientOptions, PserverOptions, ShardMap, SplitMix64, TableGrads,
    },
    transport::{DevCa, QuicTransport, RetryPolicy, TlsConfig},
};
use std::{
    collections::{HashMap, HashSet},
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::{Duration, Instant},
};

use oar_bench::BoxError;

const JOB: &str = "sparse";
/// The table's seed and name (one table, index 0).
const SEED: u64 = 1;
const TABLE: &str = "emb";
/// Bound of every wait for a child.
const TIMEOUT: Duration = Duration::from_secs(300);

fn adam() -> OptimizerConfig {
    OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
}

#[derive(Parser, Debug)]
#[command(about = "Sparse tables: row throughput over QUIC, memory per row, a capped table")]
struct Args {
    /// What to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "throughput,memory,cap")]
    parts: Vec<Part>,
    /// Row widths for throughput and memory.
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    dims: Vec<usize>,
    /// Distinct ids per batch (one pull and one push).
    #[arg(long, default_value_t = 4096)]
    batch: usize,
    /// Ids in the Zipf law's support.
    #[arg(long, default_value_t = 10_000_000)]
    universe: u64,
    /// The Zipf exponent.
    #[arg(long, default_value_t = 1.1)]
    zipf_s: f64,
    /// Measured rounds (throughput).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Steps per round (throughput).
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Unmeasured steps before the first round (throughput).
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Worker threads of the client's runtime (the pserver child has one per core).
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Rows for the memory figure, one per `--dims` value.
    #[arg(long, value_delimiter = ',', default_value = "2000000,500000")]
    mem_rows: Vec<usize>,
    /// `max_rows` of the capped table.
    #[arg(long, default_value_t = 400_000)]
    cap: usize,
    /// Row width of the capped table.
    #[arg(long, default_value_t = 16)]
    cap_dim: usize,
    /// Ids drawn through the capped table.
    #[arg(long, default_value_t = 10_000_000)]
    cap_draws: u64,
    /// Eviction rules to run the capped table with.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "lru,lfu")]
    evictions: Vec<Evict>,
    /// Seed of the id streams.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Rows per pserver CPU-second to reach at the first `--dims` value.
    #[arg(long, default_value_t = 1e6)]
    target_rows: f64,
    /// Largest resident / raw bytes per row.
    #[arg(long, default_value_t = 1.5)]
    target_mem: f64,
    /// Internal: the role of a child process.
    #[arg(long, value_enum, hide = true)]
    role: Option<Role>,
    /// Internal: the certificates' directory (pserver child).
    #[arg(long, hide = true)]
    dir: Option<PathBuf>,
    /// Internal: the child's row width.
    #[arg(long, hide = true, default_value_t = 16)]
    dim: usize,
    /// Internal: the memory child's rows.
    #[arg(long, hide = true, default_value_t = 0)]
    rows: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Part {
    Throughput,
    Memory,
    Cap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Evict {
    Lru,
    Lfu,
}

impl Evict {
    fn rule(self) -> Eviction {
        match self {
            Evict::Lru => Eviction::Lru,
            Evict::Lfu => Eviction::Lfu,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Evict::Lru => "lru",
            Evict::Lfu => "lfu",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Role {
    Pserver,
    Memory,
    Cap,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.role {
        None => parent(&args),
        Some(Role::Pserver) => pserver_child(&args),
        Some(Role::Memory) => memory_child(&args),
        Some(Role::Cap) => cap_child(&args),
    };
    oar_bench::exit_code(result, args.role)
}

// ---------------------------------------------------------------- ids

/// Zipf(s) over `1..=n` by rejection-inversion (Hörmann and Derflinger,
/// "Rejection-inversion to generate variates from monotone discrete
/// distributions", 1996; as in Apache Commons RNG): O(1) per draw.
struct Zipf {
    n: f64,
    s: f64,
    h_x1: f64,
    h_n: f64,
    threshold: f64,
}

impl Zipf {
    fn new(n: u64, s: f64) -> Result<Zipf, BoxError> {
        if n == 0 || !(s.is_finite() && s > 0.0) {
            return Err(format!("a Zipf law needs n >= 1 and s > 0, got n {n}, s {s}").into());
        }
        let mut z = Zipf { n: n as f64, s, h_x1: 0.0, h_n: 0.0, threshold: 0.0 };
        z.h_x1 = z.h_integral(1.5) - 1.0;
        z.h_n = z.h_integral(z.n + 0.5);
        z.threshold = 2.0 - z.h_integral_inverse(z.h_integral(2.5) - z.h(2.0));
        Ok(z)
    }

    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    fn h_integral(&self, x: f64) -> f64 {
        let log_x = x.ln();
        expm1_over_x((1.0 - self.s) * log_x) * log_x
    }

    fn h_integral_inverse(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.s)).max(-1.0);
        (ln1p_over_x(t) * x).exp()
    }

    /// A rank in `1..=n`.
    fn sample(&self, rng: &mut SplitMix64) -> u64 {
        loop {
            let uniform = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
            let u = self.h_n + uniform * (self.h_x1 - self.h_n);
            let x = self.h_integral_inverse(u);
            let k = (x + 0.5).floor().clamp(1.0, self.n);
            if k - x <= self.threshold || u >= self.h_integral(k + 0.5) - self.h(k) {
                return k as u64;
            }
        }
    }
}

fn ln1p_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - x * 0.25))
    }
}

fn expm1_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x * (1.0 / 3.0) * (1.0 + x * 0.25))
    }
}

/// The id of Zipf rank `k`: a bijection, so distinct ranks are distinct ids.
fn id_of(rank: u64) -> u64 {
    SplitMix64::new(rank).next_u64()
}

/// A seeded stream of Zipf ids, cut into batches of distinct ids.
struct Stream {
    zipf: Zipf,
    rng: SplitMix64,
    seen: HashSet<u64>,
    draws: u64,
}

impl Stream {
    fn new(universe: u64, s: f64, seed: u64, batch: usize) -> Result<Stream, BoxError> {
        if batch == 0 || batch as u64 > universe || batch > MAX_ROWS_PER_CALL {
            return Err(format!(
                "--batch {batch} must be in 1..={} and at most --universe {universe}",
                MAX_ROWS_PER_CALL
            )
            .into());
        }
        let zipf = Zipf::new(universe, s)?;
        Ok(Stream { zipf, rng: SplitMix64::new(seed), seen: HashSet::with_capacity(batch), draws: 0 })
    }

    /// Draw until `out` holds `batch` distinct ids (in first-drawn order).
    fn batch(&mut self, batch: usize, out: &mut Vec<u64>) {
        out.clear();
        self.seen.clear();
        while out.len() < batch {
            let id = id_of(self.zipf.sample(&mut self.rng));
            self.draws += 1;
            if self.seen.insert(id) {
                out.push(id);
            }
        }
    }
}

/// Check the sampler against the exact law: the frequencies of ranks 1, 2
/// and 10 over 1M draws (relative standard errors 0.3%, 0.4%, 1.7%).
fn check_zipf(universe: u64, s: f64) -> Result<String, BoxError> {
    let zipf = Zipf::new(universe, s)?;
    let norm: f64 = (1..=universe).map(|k| (k as f64).powf(-s)).sum();
    let draws = 1_000_000u64;
    let mut rng = SplitMix64::new(12345);
    let mut counts = [0u64; 3];
    let ranks = [1u64, 2, 10];
    for _ in 0..draws {
        let k = zipf.sample(&mut rng);
        if let Some(i) = ranks.iter().position(|&r| r == k) {
            counts[i] += 1;
        }
    }
    let mut line = String::from("Zipf sampler check (1M draws): ");
    for (i, &k) in ranks.iter().enumerate() {
        let exact = (k as f64).powf(-s) / norm;
        let got = counts[i] as f64 / draws as f64;
        let rel_sd = ((1.0 - exact) / (exact * draws as f64)).sqrt();
        if ((got - exact) / exact).abs() > 5.0 * rel_sd {
            return Err(format!("Zipf sampler off at rank {k}: {got:.5} drawn, {exact:.5} exact").into());
        }
        line += &format!("P({k}) {got:.5} drawn / {exact:.5} exact; ");
    }
    Ok(line.trim_end_matches("; ").to_string())
}

// ---------------------------------------------------------------- processes

/// (peak, current) resident bytes of this process.
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// CPU seconds (user + system, every thread, those ended included) of
/// this process, from `getrusage(RUSAGE_SELF)` (microseconds).
fn cpu_seconds() -> Result<f64, BoxError> {
    // SAFETY: an all-zero `rusage` is a valid value, and getrusage only
    // writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `usage` outlives the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Err(format!("getrusage: {}", std::io::Error::last_os_error()).into());
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Ok(seconds(usage.ru_utime) + seconds(usage.ru_stime))
}

/// The pserver child's CPU seconds so far.
fn child_cpu(child: &mut ChildProc) -> Result<f64, BoxError> {
    child.send("cpu")?;
    Ok(child.expect("cpu ")?.parse()?)
}

/// `key value` pairs of a child's result line.
fn fields(line: &str) -> HashMap<&str, &str> {
    let words: Vec<&str> = line.split_whitespace().collect();
    words.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect()
}

fn get<T: std::str::FromStr>(fields: &HashMap<&str, &str>, key: &str) -> Result<T, BoxError>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    Ok(fields.get(key).ok_or_else(|| format!("no {key} in a child's result"))?.parse()?)
}

// ---------------------------------------------------------------- children

fn dense_specs() -> Vec<ParamSpec> {
    vec![ParamSpec::new("bias", vec![1], Init::Zeros)]
}

fn table_spec(dim: usize, policy: RowPolicy) -> TableSpec {
    TableSpec { policy, ..TableSpec::new(TABLE, dim, Init::Uniform { low: -0.01, high: 0.01 }) }
}

fn tls(dir: &Path, name: &str) -> Result<TlsConfig, BoxError> {
    Ok(TlsConfig::from_pem_files(
        dir.join("ca.pem"),
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    )?)
}

/// A real pserver, one shard, one table of `--dim`; serves until stdin closes.
fn pserver_child(args: &Args) -> Result<(), BoxError> {
    let dir = args.dir.clone().ok_or("--dir is required")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let transport = Arc::new(QuicTransport::new(tls(&dir, "pserver")?)?);
        let discovery = Arc::new(MemDiscovery::new());
        let options = PserverOptions {
            keys: JobKeys::new(JOB)?.pserver(),
            specs: dense_specs(),
            tables: vec![table_spec(args.dim, RowPolicy::default())],
            shards: 1,
            seed: SEED,
            mode: Mode::Async,
            optimizer: adam(),
            lease_ttl: Duration::from_secs(30),
            ..PserverOptions::default()
        };
        // One pserver, one shard: it maps itself (the coordinator runs here).
        let lease = discovery.grant_lease(Duration::from_secs(3600)).await?;
        let fence = discovery.lock("/bench/coordinator", Vec::new(), lease, Duration::from_secs(5)).await?;
        let coordinator = CoordinatorOptions { keys: options.keys.clone(), ..CoordinatorOptions::default() };
        let _coordinator =
            Coordinator::start(discovery.clone(), transport.clone(), fence, coordinator).await?;
        let server = Pserver::start(discovery, transport, "127.0.0.1:0", options).await?;
        println!("addr {}={}", server.name(), server.addr());
        // Serve until the parent closes stdin; answer "cpu" with this process's CPU seconds.
        tokio::task::spawn_blocking(|| -> Result<(), BoxError> {
            let mut line = String::new();
            while std::io::stdin().read_line(&mut line)? > 0 {
                if line.trim() == "cpu" {
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "cpu {}", cpu_seconds()?)?;
                    out.flush()?;
                }
                line.clear();
            }
            Ok(())
        })
        .await??;
        server.shutdown().await?;
        Ok::<_, BoxError>(())
    })?;
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

/// Fill a table with `--rows` distinct ids by Adam pushes; print the resident growth.
fn memory_child(args: &Args) -> Result<(), BoxError> {
    let (dim, rows, batch) = (args.dim, args.rows, args.batch.max(1));
    let optimizer = adam().build()?;
    let mut ids: Vec<u64> = Vec::with_capacity(batch);
    let grads: Vec<f32> = (0..batch * dim).map(|i| 1e-3 * ((i % 7) as f32 - 3.0)).collect();
    let (_, before) = memory();
    let mut table = SparseTable::new(table_spec(dim, RowPolicy::default()), SEED, optimizer.state_slots())?;
    let started = Instant::now();
    let mut step = 0u64;
    let mut next = 0u64;
    while (next as usize) < rows {
        ids.clear();
        let end = (next + batch as u64).min(rows as u64);
        ids.extend((next..end).map(|i| id_of(i + 1)));
        next = end;
        table.apply(&ids, &grads[..ids.len() * dim], step, optimizer.as_ref());
        step += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let (hwm, after) = memory();
    let stats = table.stats();
    println!(
        "mem rows {} before {before} after {after} hwm {hwm} bytes_per_row {} slots {} secs {secs}",
        stats.rows,
        table.bytes_per_row(),
        table.state_slots()
    );
    drop(table);
    Ok(())
}

/// A capped table fed the Zipf stream until `--cap-draws` ids were drawn.
fn cap_child(args: &Args) -> Result<(), BoxError> {
    let evict = args.evictions.first().copied().ok_or("a cap child needs one --evictions")?;
    let (dim, cap, batch) = (args.cap_dim, args.cap, args.batch);
    let optimizer = adam().build()?;
    let mut stream = Stream::new(args.universe, args.zipf_s, args.seed ^ 0xCAB, batch)?;
    let mut ids: Vec<u64> = Vec::with_capacity(batch);
    let grads: Vec<f32> = (0..batch * dim).map(|i| 1e-3 * ((i % 7) as f32 - 3.0)).collect();
    let (_, before) = memory();
    let policy = RowPolicy { max_rows: Some(cap), evict: evict.rule(), ..RowPolicy::default() };
    let mut table = SparseTable::new(table_spec(dim, policy), SEED, optimizer.state_slots())?;
    let (mut peak_rows, mut violations, mut peak_rss, mut step) = (0usize, 0u64, before, 0u64);
    let mut apply_secs = 0.0;
    let mut pushed = 0u64;
    while stream.draws < args.cap_draws {
        stream.batch(batch, &mut ids);
        let started = Instant::now();
        table.apply(&ids, &grads, step, optimizer.as_ref());
        apply_secs += started.elapsed().as_secs_f64();
        step += 1;
        pushed += ids.len() as u64;
        let rows = table.stats().rows;
        peak_rows = peak_rows.max(rows);
        violations += u64::from(rows > cap);
        peak_rss = peak_rss.max(memory().1);
    }
    let (hwm, after) = memory();
    let stats = table.stats();
    println!(
        "cap draws {} batches {step} pushed {pushed} peak_rows {peak_rows} violations {violations} \
         rows {} admitted {} evicted {} before {before} after {after} peak_rss {peak_rss} hwm {hwm} \
         bytes_per_row {} apply_secs {apply_secs}",
        stream.draws,
        stats.rows,
        stats.admitted,
        stats.evicted,
        table.bytes_per_row(),
    );
    Ok(())
}

// ---------------------------------------------------------------- parent

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn millions(x: f64) -> String {
    format!("{:.3}M", x / 1e6)
}

/// The plain in-memory reference: a std `HashMap` id -> offset into one
/// flat `Vec<f32>`, SGD.
struct Reference {
    dim: usize,
    index: HashMap<u64, usize>,
    rows: Vec<f32>,
}

impl Reference {
    /// Gather the batch's rows into `out` (absent ids read zeros), then
    /// scatter `row -= lr * grad` (creating absent rows).
    fn step(&mut self, ids: &[u64], grads: &[f32], out: &mut [f32]) {
        let dim = self.dim;
        for (id, o) in ids.iter().zip(out.chunks_exact_mut(dim)) {
            match self.index.get(id) {
                Some(&at) => o.copy_from_slice(&self.rows[at..at + dim]),
                None => o.fill(0.0),
            }
        }
        std::hint::black_box(&mut *out);
        let Reference { index, rows, .. } = self;
        let lr = 1e-3f32;
        for (id, g) in ids.iter().zip(grads.chunks_exact(dim)) {
            let at = *index.entry(*id).or_insert_with(|| {
                let at = rows.len();
                rows.resize(at + dim, 0.0);
                at
            });
            for (p, g) in rows[at..at + dim].iter_mut().zip(g) {
                *p -= lr * g;
            }
        }
    }
}

/// One dim's throughput figures, medians over rounds.
struct Throughput {
    dim: usize,
    reference: f64,
    wall: f64,
    ratio: f64,
    per_core: f64,
    ps_cores: f64,
    pull_us: f64,
    push_us: f64,
    client_cpu_us: f64,
    draws_per_batch: f64,
    /// Rows the table held at the end (the reference holds the same ids).
    table_rows: usize,
}

fn throughput(args: &Args, dim: usize, dir: &Path) -> Result<Throughput, BoxError> {
    let dir_arg = dir.to_str().ok_or("temporary path is not UTF-8")?.to_string();
    let ps_args: Vec<String> =
        vec!["--role".into(), "pserver".into(), "--dim".into(), dim.to_string(), "--dir".into(), dir_arg];
    let mut ps = ChildProc::spawn(&format!("pserver dim {dim}"), &ps_args, TIMEOUT)?;
    let addr = ps.expect("addr ")?;

    // Every batch of the run, drawn before anything is timed.
    let mut stream = Stream::new(args.universe, args.zipf_s, args.seed, args.batch)?;
    let total = args.warmup + args.rounds * args.steps;
    let mut batches = Vec::with_capacity(total);
    for _ in 0..total {
        let mut ids = Vec::with_capacity(args.batch);
        stream.batch(args.batch, &mut ids);
        batches.push(ids);
    }
    let draws_per_batch = stream.draws as f64 / total as f64;
    let grads: Vec<f32> = (0..args.batch * dim).map(|i| 1e-3 * ((i % 7) as f32 - 3.0)).collect();
    let mut reference = Reference { dim, index: HashMap::new(), rows: Vec::new() };
    let mut ref_out = vec![0.0f32; args.batch * dim];

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads.max(1))
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let transport = Arc::new(QuicTransport::new(tls(dir, "client")?)?);
        let discovery = Arc::new(MemDiscovery::new());
        let keys = JobKeys::new(JOB)?;
        // The pserver's registration and the map it serves under, as in its process.
        let (name, addr) = addr.split_once('=').ok_or("the pserver's addr is name=address")?;
        discovery.put(&keys.ps(name), addr.as_bytes().to_vec(), None).await?;
        discovery.put(&keys.shard_map(), ShardMap::initial(1, 1, &[name.to_string()])?.encode(), None).await?;
        let placement = Placement::new(&dense_specs(), 1, 1 << 16)?
            .with_tables(vec![table_spec(dim, RowPolicy::default())])?;
        let options = PserverClientOptions {
            call_timeout: Duration::from_secs(30),
            retry: RetryPolicy { give_up_after: Duration::from_secs(60), ..RetryPolicy::default() },
            ..PserverClientOptions::new(keys.pserver(), "client")
        };
        let mut client = PserverClient::new(discovery, transport, Arc::new(placement), options);
        client.wait_for_servers(Duration::from_secs(60)).await?;
        let dense = ParamBuf::zeros(&dense_specs());
        let mut out = vec![Vec::new()];

        let (mut ref_rate, mut wall_rate, mut ratio, mut per_core, mut cores) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut pull_us, mut push_us, mut client_cpu) = (Vec::new(), Vec::new(), Vec::new());
        for (i, ids) in batches[..args.warmup].iter().enumerate() {
            reference.step(ids, &grads, &mut ref_out);
            client.forget_steps();
            client.pull_rows(&[(0, ids)], &mut out).await?;
            client.push_rows(&dense, &[TableGrads { table: 0, ids, grads: &grads }], 1.0).await?;
            if i == 0 && out[0].len() != ids.len() * dim {
                return Err(format!("pulled {} floats for {} rows", out[0].len(), ids.len()).into());
            }
        }
        for round in 0..args.rounds {
            let batches = &batches[args.warmup + round * args.steps..][..args.steps];
            let rows = (args.steps * args.batch) as f64;

            let started = Instant::now();
            for ids in batches {
                reference.step(ids, &grads, &mut ref_out);
            }
            let ref_secs = started.elapsed().as_secs_f64();

            let (mut pull, mut push) = (Duration::ZERO, Duration::ZERO);
            let ps_cpu = child_cpu(&mut ps)?;
            let my_cpu = cpu_seconds()?;
            let started = Instant::now();
            for ids in batches {
                let t = Instant::now();
                client.forget_steps();
                client.pull_rows(&[(0, ids)], &mut out).await?;
                let t2 = Instant::now();
                client.push_rows(&dense, &[TableGrads { table: 0, ids, grads: &grads }], 1.0).await?;
                pull += t2 - t;
                push += t2.elapsed();
            }
            let secs = started.elapsed().as_secs_f64();
            let ps_secs = child_cpu(&mut ps)? - ps_cpu;
            let my_secs = cpu_seconds()? - my_cpu;

            ref_rate.push(rows / ref_secs);
            wall_rate.push(rows / secs);
            ratio.push(ref_secs / secs);
            per_core.push(rows / ps_secs);
            cores.push(ps_secs / secs);
            pull_us.push(pull.as_secs_f64() * 1e6 / args.steps as f64);
            push_us.push(push.as_secs_f64() * 1e6 / args.steps as f64);
            client_cpu.push(my_secs * 1e6 / args.steps as f64);
            println!(
                "  dim {dim} round {round}: reference {} rows/s; pserver {} rows/s wall ({:.3} of the reference), \
                 {} rows per pserver CPU-s (pserver busy {:.2} cores), pull {:.0} us + push {:.0} us per step; \
                 table {} rows",
                millions(rows / ref_secs),
                millions(rows / secs),
                ref_secs / secs,
                millions(rows / ps_secs),
                ps_secs / secs,
                pull.as_secs_f64() * 1e6 / args.steps as f64,
                push.as_secs_f64() * 1e6 / args.steps as f64,
                reference.index.len(),
            );
        }
        Ok::<_, BoxError>(Throughput {
            dim,
            reference: median(&ref_rate),
            wall: median(&wall_rate),
            ratio: median(&ratio),
            per_core: median(&per_core),
            ps_cores: median(&cores),
            pull_us: median(&pull_us),
            push_us: median(&push_us),
            client_cpu_us: median(&client_cpu),
            draws_per_batch,
            table_rows: reference.index.len(),
        })
    });
    runtime.shutdown_timeout(Duration::from_secs(5));
    let result = result?;
    ps.finish()?;
    Ok(result)
}

struct MemoryRow {
    dim: usize,
    rows: usize,
    per_row: f64,
    raw: f64,
    estimate: usize,
    secs: f64,
}

fn memory_part(args: &Args, dim: usize, rows: usize) -> Result<MemoryRow, BoxError> {
    let child_args: Vec<String> = vec![
        "--role".into(),
        "memory".into(),
        "--dim".into(),
        dim.to_string(),
        "--rows".into(),
        rows.to_string(),
        "--batch".into(),
        args.batch.to_string(),
    ];
    let mut child = ChildProc::spawn(&format!("memory dim {dim}"), &child_args, TIMEOUT)?;
    let line = child.expect("mem ")?;
    child.finish()?;
    let f = fields(&line);
    let held: usize = get(&f, "rows")?;
    if held != rows {
        return Err(format!("the table holds {held} rows, {rows} pushed").into());
    }
    let (before, after): (u64, u64) = (get(&f, "before")?, get(&f, "after")?);
    let slots: usize = get(&f, "slots")?;
    Ok(MemoryRow {
        dim,
        rows,
        per_row: after.saturating_sub(before) as f64 / rows as f64,
        raw: (4 * dim * (1 + slots) + 8) as f64,
        estimate: get(&f, "bytes_per_row")?,
        secs: get(&f, "secs")?,
    })
}

struct CapRow {
    evict: Evict,
    draws: u64,
    batches: u64,
    pushed: u64,
    peak_rows: usize,
    violations: u64,
    rows: usize,
    admitted: u64,
    evicted: u64,
    peak_bytes: u64,
    final_bytes: u64,
    budget: u64,
    apply_rate: f64,
}

fn cap_part(args: &Args, evict: Evict) -> Result<CapRow, BoxError> {
    let child_args: Vec<String> = vec![
        "--role".into(),
        "cap".into(),
        "--evictions".into(),
        evict.name().into(),
        "--cap".into(),
        args.cap.to_string(),
        "--cap-dim".into(),
        args.cap_dim.to_string(),
        "--cap-draws".into(),
        args.cap_draws.to_string(),
        "--batch".into(),
        args.batch.to_string(),
        "--universe".into(),
        args.universe.to_string(),
        "--zipf-s".into(),
        args.zipf_s.to_string(),
        "--seed".into(),
        args.seed.to_string(),
    ];
    let mut child = ChildProc::spawn(&format!("cap {}", evict.name()), &child_args, TIMEOUT)?;
    let line = child.expect("cap ")?;
    child.finish()?;
    let f = fields(&line);
    let before: u64 = get(&f, "before")?;
    let pushed: u64 = get(&f, "pushed")?;
    let bytes_per_row: u64 = get(&f, "bytes_per_row")?;
    let apply_secs: f64 = get(&f, "apply_secs")?;
    Ok(CapRow {
        evict,
        draws: get(&f, "draws")?,
        batches: get(&f, "batches")?,
        pushed,
        peak_rows: get(&f, "peak_rows")?,
        violations: get(&f, "violations")?,
        rows: get(&f, "rows")?,
        admitted: get(&f, "admitted")?,
        evicted: get(&f, "evicted")?,
        peak_bytes: get::<u64>(&f, "peak_rss")?.saturating_sub(before),
        final_bytes: get::<u64>(&f, "after")?.saturating_sub(before),
        budget: args.cap as u64 * bytes_per_row,
        apply_rate: pushed as f64 / apply_secs,
    })
}

fn mb(bytes: f64) -> String {
    format!("{:.1} MB", bytes / 1e6)
}

fn parent(args: &Args) -> Result<(), BoxError> {
    if args.rounds == 0 || args.steps == 0 || args.dims.is_empty() {
        return Err("--rounds, --steps and --dims need at least one".into());
    }
    if args.parts.contains(&Part::Memory) && args.mem_rows.len() != args.dims.len() {
        return Err(format!("--mem-rows needs one value per --dims value ({})", args.dims.len()).into());
    }
    println!(
        "ids: Zipf(s={}) over {} ids, batches of {} distinct ids; optimizer Adam (2 slots per row); {}",
        args.zipf_s,
        args.universe,
        args.batch,
        common::load()
    );
    println!("{}", check_zipf(args.universe, args.zipf_s)?);
    let mut verdicts = Vec::new();

    if args.parts.contains(&Part::Throughput) {
        let dir = tempfile::tempdir()?;
        DevCa::new()?.write_files(dir.path(), &["pserver", "client"])?;
        println!(
            "\n1. throughput: one pserver (child process, one shard, async, QUIC on 127.0.0.1), \
             {} rounds of {} steps after {} warm-up steps; a step = pull_rows + push_rows of one batch",
            args.rounds, args.steps, args.warmup
        );
        let mut results = Vec::new();
        for &dim in &args.dims {
            results.push(throughput(args, dim, dir.path())?);
        }
        println!(
            "\nrows/s count a row pulled and pushed once ({} per step); medians over {} rounds",
            args.batch, args.rounds
        );
        println!(
            "\n| dim | reference rows/s (HashMap, 1 thread) | pserver rows/s (wall) | pserver / reference \
             | rows per pserver CPU-s | pserver busy (cores) | pull us/step | push us/step | client CPU us/step \
             | table rows at end |"
        );
        println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for r in &results {
            println!(
                "| {} | {} | {} | {:.3} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {} |",
                r.dim,
                millions(r.reference),
                millions(r.wall),
                r.ratio,
                millions(r.per_core),
                r.ps_cores,
                r.pull_us,
                r.push_us,
                r.client_cpu_us,
                r.table_rows
            );
        }
        if let Some(r) = results.first() {
            println!("(Zipf draws per batch of {} distinct ids: {:.0})", args.batch, r.draws_per_batch);
            let met = r.per_core >= args.target_rows;
            verdicts.push(format!(
                "throughput at dim {}: {} rows per pserver CPU-second, target >= {}: {}",
                r.dim,
                millions(r.per_core),
                millions(args.target_rows),
                if met { "MET" } else { "MISSED" }
            ));
        }
    }

    if args.parts.contains(&Part::Memory) {
        println!("\n2. memory per row: a SparseTable filled by Adam pushes, in a child process");
        let mut results = Vec::new();
        for (&dim, &rows) in args.dims.iter().zip(&args.mem_rows) {
            results.push(memory_part(args, dim, rows)?);
        }
        println!(
            "\n| dim | rows | resident B/row | raw B/row (4*dim*3 + 8) | resident / raw | \
             bytes_per_row() | estimate / raw | fill rows/s |"
        );
        println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for r in &results {
            println!(
                "| {} | {} | {:.1} | {:.0} | {:.2} | {} | {:.2} | {} |",
                r.dim,
                r.rows,
                r.per_row,
                r.raw,
                r.per_row / r.raw,
                r.estimate,
                r.estimate as f64 / r.raw,
                millions(r.rows as f64 / r.secs)
            );
            let met = r.per_row / r.raw <= args.target_mem;
            verdicts.push(format!(
                "memory at dim {}: {:.2}x raw, target <= {}x: {}",
                r.dim,
                r.per_row / r.raw,
                args.target_mem,
                if met { "MET" } else { "MISSED" }
            ));
        }
    }

    if args.parts.contains(&Part::Cap) {
        println!(
            "\n3. a capped table: max_rows {} (a cap in rows, per shard), dim {}, Adam, fed the Zipf stream \
             until {} ids were drawn",
            args.cap, args.cap_dim, args.cap_draws
        );
        let mut results = Vec::new();
        for &evict in &args.evictions {
            results.push(cap_part(args, evict)?);
        }
        println!(
            "\n| evict | draws | batches | rows pushed | peak rows | steps over the cap | rows at end | admitted \
             | evicted | resident peak | resident at end | cap x bytes_per_row | peak / budget | apply rows/s |"
        );
        println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for r in &results {
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {} |",
                r.evict.name(),
                r.draws,
                r.batches,
                r.pushed,
                r.peak_rows,
                r.violations,
                r.rows,
                r.admitted,
                r.evicted,
                mb(r.peak_bytes as f64),
                mb(r.final_bytes as f64),
                mb(r.budget as f64),
                r.peak_bytes as f64 / r.budget as f64,
                millions(r.apply_rate)
            );
            let met = r.violations == 0 && r.peak_rows <= args.cap;
            verdicts.push(format!(
                "cap ({}): peak {} rows of {} allowed, {} steps over: {}; resident peak {:.2}x cap x bytes_per_row",
                r.evict.name(),
                r.peak_rows,
                args.cap,
                r.violations,
                if met { "MET" } else { "MISSED" },
                r.peak_bytes as f64 / r.budget as f64
            ));
        }
    }

    println!("\n{}", common::load());
    for v in verdicts {
        println!("verdict: {v}");
    }
    Ok(())
}
