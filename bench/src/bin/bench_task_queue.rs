//! The task path: how fast the task-queue core and the master service hand
//! out and take back tasks, against references measured in the same run.
//!
//! ```text
//! cargo run --release -p oar-bench --features etcd --bin bench_task_queue -- [options]
//!   --tasks N      tasks in the queue                                    [100000]
//!   --runs R       timed runs of the core (median reported)              [5]
//!   --passes P     passes over the queue per core run                    [3]
//!   --ks a,b,c     trainers (tasks in flight) of the service runs        [1,8,64]
//!   --secs S       time limit of one service run (partial if reached)    [60]
//! ```
//!
//! (A) `TaskQueue::get_task` + `task_finished` pairs per second on one
//! thread (time passed in, one `Instant` per pass), against a `VecDeque`
//! pop plus `Vec` push per pair, and against that plus the copies the API
//! returns (a `TaskSpec` clone and the trainer's id as a `String`).
//!
//! (B) A real etcd (`EtcdServer`), a `Master` over `QuicTransport` (DevCa
//! identities, 127.0.0.1) and K trainers (`MasterClient`, one QUIC
//! transport each) looping get-task / task-finished over one pass. The
//! master's discovery is wrapped in an adapter that counts and times its
//! writes (journal records, snapshots and range deletes). Reference: the same
//! number of fenced puts of the run's mean write size straight to a fresh
//! etcd by one writer, with the
//! same compaction. Each service run gets its own etcd, dropped (data dir
//! removed) after it: etcd keeps every write in its WAL until its own
//! snapshot, and history is compacted every 100 writes.

use async_trait::async_trait;
use oar_discovery::{
    Discovery, EtcdDiscovery, EtcdServer, Fence, KeyValue, LeaseId, Listing, Revision, WatchStream,
};
use oar_task_queue::{
    chunk_files, tasks_from_chunks, GetTask, Master, MasterClient, MasterClientOptions, MasterKeys,
    MasterOptions, PassStats, QueueConfig, ReportReply, StoredState, TaskQueue, TaskReply, TaskSpec,
    TaskStats,
};
use oar_transport::{DevCa, QuicTransport, RetryPolicy, Transport};
use std::{
    collections::VecDeque,
    hint::black_box,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use oar_bench::BoxError;

const CORE_TARGET: f64 = 1_000_000.0;
const SERVICE_TARGET: f64 = 5_000.0;
/// etcd history is compacted after this many writes (a real deployment runs
/// etcd's auto-compaction; without it 100,000 states of ~0.3 MB fill etcd's
/// 2 GiB quota within seconds).
const COMPACT_EVERY: u64 = 100;
/// The master's keys, under `/bench/`.
fn keys() -> MasterKeys {
    MasterKeys {
        lock: "/bench/master/lock".into(),
        addr: "/bench/master/addr".into(),
        state: "/bench/master/state".into(),
        journal: "/bench/master/journal/".into(),
        config: "/bench/config".into(),
        members: "/bench/trainer/".into(),
    }
}

struct Args {
    tasks: usize,
    runs: usize,
    passes: u32,
    ks: Vec<usize>,
    secs: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { tasks: 100_000, runs: 5, passes: 3, ks: vec![1, 8, 64], secs: 60 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--tasks" => args.tasks = number(value()?)?.max(1) as usize,
            "--runs" => args.runs = number(value()?)?.max(1) as usize,
            "--passes" => args.passes = number(value()?)?.max(1) as u32,
            "--secs" => args.secs = number(value()?)?.max(1),
            "--ks" => {
                args.ks = value()?
                    .split(',')
                    .map(|s| s.parse::<usize>().map(|k| k.max(1)).map_err(|e| format!("--ks: {e}")))
                    .collect::<Result<_, _>>()?
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(args)
}

/// `n` tasks of one 1 MiB chunk each over files of 400 MiB, as
/// `chunk_files` cuts a real dataset (so the snapshot is as compact as in use).
fn make_tasks(n: usize) -> Result<Vec<TaskSpec>, BoxError> {
    let files: Vec<(String, u64)> =
        (0..n.div_ceil(400)).map(|i| (format!("/data/part-{i:05}.libsvm"), 400 << 20)).collect();
    let mut chunks = chunk_files(&files, 1 << 20)?;
    chunks.truncate(n);
    Ok(tasks_from_chunks(chunks, 1)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "MISS"
    }
}

// ---------------------------------------------------------------- (A) core

/// Pairs per second of the core over `passes` passes of a fresh queue.
fn core_run(tasks: &[TaskSpec], passes: u32) -> Result<f64, BoxError> {
    let config = QueueConfig { task_timeout: Duration::from_secs(600), max_failures: 3, passes };
    let mut queue = TaskQueue::new(tasks.to_vec(), config)?;
    let started = Instant::now();
    for _ in 0..passes {
        // One `now` per pass: the core reads no clock, the caller passes it in.
        let now = Instant::now();
        for _ in 0..tasks.len() {
            let GetTask::Assigned(a) = queue.get_task("trainer-0", now) else {
                return Err("the core had no task to hand out mid-pass".into());
            };
            black_box(queue.task_finished(a.task_ref, now));
        }
        black_box(queue.drain_events());
    }
    let elapsed = started.elapsed();
    if queue.get_task("trainer-0", Instant::now()) != GetTask::Done {
        return Err("the job is not done after the last pass".into());
    }
    let pairs = tasks.len() as u64 * passes as u64;
    Ok(pairs as f64 / elapsed.as_secs_f64())
}

/// Pairs per second of the plain bookkeeping: pop an index from a
/// `VecDeque`, push it into a `Vec`; with `copies`, also clone the task and
/// the trainer's id as the core's API returns them.
fn reference_run(tasks: &[TaskSpec], passes: u32, copies: bool) -> f64 {
    let mut todo: VecDeque<u64> = (0..tasks.len() as u64).collect();
    let mut done: Vec<u64> = Vec::with_capacity(tasks.len());
    let started = Instant::now();
    for _ in 0..passes {
        while let Some(i) = todo.pop_front() {
            if copies {
                black_box(tasks[i as usize].clone());
                black_box("trainer-0".to_string());
            }
            done.push(black_box(i));
        }
        todo.extend(done.drain(..));
    }
    let elapsed = started.elapsed();
    black_box(&todo);
    (tasks.len() as u64 * passes as u64) as f64 / elapsed.as_secs_f64()
}

fn part_a(args: &Args, tasks: &[TaskSpec]) -> Result<f64, BoxError> {
    println!(
        "(A) task-queue core: {} tasks, {} passes per run, {} runs, interleaved with the references",
        tasks.len(),
        args.passes,
        args.runs
    );
    let (mut core, mut plain, mut copies) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..args.runs {
        let c = core_run(tasks, args.passes)?;
        let p = reference_run(tasks, args.passes, false);
        let q = reference_run(tasks, args.passes, true);
        println!(
            "    run {run}: core {:.3} M pairs/s, VecDeque+Vec {:.1} M/s, +copies {:.2} M/s",
            c / 1e6,
            p / 1e6,
            q / 1e6
        );
        core.push(c);
        plain.push(p);
        copies.push(q);
    }
    let (c, p, q) = (median(core), median(plain), median(copies));
    println!(
        "    median: core {:.3} M pairs/s = {:.2}x the 1 M/s target: {}",
        c / 1e6,
        c / CORE_TARGET,
        verdict(c >= CORE_TARGET)
    );
    println!("    core / (VecDeque pop + Vec push, {:.1} M/s) = {:.3}", p / 1e6, c / p);
    println!("    core / (same + TaskSpec clone + trainer String, {:.2} M/s) = {:.3}", q / 1e6, c / q);
    Ok(c)
}

/// Time to build and encode the master's whole stored state mid-pass (half
/// the tasks done, 64 pending): the master builds it under its queue lock
/// whenever it writes a snapshot instead of a journal record.
fn encode_cost(tasks: &[TaskSpec]) -> Result<(f64, usize), BoxError> {
    let config = QueueConfig { task_timeout: Duration::from_secs(600), max_failures: 3, passes: 1 };
    let mut queue = TaskQueue::new(tasks.to_vec(), config)?;
    let now = Instant::now();
    for i in 0..tasks.len() / 2 + 64 {
        let GetTask::Assigned(a) = queue.get_task(&format!("trainer-{}", i % 64), now) else {
            return Err("expected an assignment".into());
        };
        if i < tasks.len() / 2 {
            queue.task_finished(a.task_ref, now);
        }
    }
    let passes =
        vec![PassStats { examples: 1 << 30, loss_sum: 1e6, tasks_finished: 50_000, skipped_lines: 0 }];
    let mut times = Vec::new();
    let mut bytes = 0;
    for _ in 0..11 {
        let started = Instant::now();
        let state = StoredState { queue: queue.snapshot(), passes: passes.clone(), discarded: Vec::new() };
        bytes = black_box(state.encode()).len();
        times.push(started.elapsed().as_secs_f64());
    }
    Ok((median(times), bytes))
}

// ------------------------------------------------------------- (B) service

/// Compacts etcd's history every [`COMPACT_EVERY`] writes, in the background.
struct Compactor {
    etcd: EtcdDiscovery,
    writes: AtomicU64,
    running: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Compactor {
    fn new(etcd: EtcdDiscovery) -> Self {
        Compactor { etcd, writes: AtomicU64::new(0), running: Mutex::new(Vec::new()) }
    }

    fn wrote(&self, revision: Revision) {
        if self.writes.fetch_add(1, Ordering::Relaxed) % COMPACT_EVERY == COMPACT_EVERY - 1 {
            let etcd = self.etcd.clone();
            let task = tokio::spawn(async move {
                if let Err(e) = etcd.compact(revision).await {
                    eprintln!("    (compaction to {revision} failed: {e})");
                }
            });
            let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
            running.retain(|t| !t.is_finished());
            running.push(task);
        }
    }

    /// Waits for the compactions under way, so that none outlives its server.
    async fn finish(&self) {
        let running = std::mem::take(&mut *self.running.lock().unwrap_or_else(PoisonError::into_inner));
        for task in running {
            let _ = task.await;
        }
    }
}

/// Forwards to etcd; counts, sizes and times `put_fenced` (the master's
/// state writes).
struct Counting {
    inner: EtcdDiscovery,
    compactor: Compactor,
    puts: AtomicU64,
    /// Puts of a whole snapshot (`master/state`), among `puts`.
    snapshots: AtomicU64,
    /// Fenced range deletes of covered journal records.
    deletes: AtomicU64,
    bytes: AtomicU64,
    put_nanos: AtomicU64,
    latencies: Mutex<Vec<f64>>,
}

impl Counting {
    fn new(inner: EtcdDiscovery) -> Self {
        Counting {
            compactor: Compactor::new(inner.clone()),
            inner,
            puts: AtomicU64::new(0),
            snapshots: AtomicU64::new(0),
            deletes: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            put_nanos: AtomicU64::new(0),
            latencies: Mutex::new(Vec::new()),
        }
    }

    /// (writes: puts and range deletes, snapshots, bytes put, seconds spent in puts) so far.
    fn totals(&self) -> (u64, u64, u64, f64) {
        (
            self.puts.load(Ordering::Relaxed) + self.deletes.load(Ordering::Relaxed),
            self.snapshots.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
            self.put_nanos.load(Ordering::Relaxed) as f64 / 1e9,
        )
    }

    fn take_latencies(&self) -> Vec<f64> {
        std::mem::take(&mut *self.latencies.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[async_trait]
impl Discovery for Counting {
    fn max_value_bytes(&self) -> Option<usize> {
        self.inner.max_value_bytes()
    }
    async fn grant_lease(&self, ttl: Duration) -> oar_discovery::Result<LeaseId> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> oar_discovery::Result<()> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> oar_discovery::Result<()> {
        self.inner.revoke_lease(lease).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> oar_discovery::Result<Revision> {
        self.inner.put(key, value, lease).await
    }
    async fn get(&self, key: &str) -> oar_discovery::Result<Option<KeyValue>> {
        self.inner.get(key).await
    }
    async fn get_prefix(&self, prefix: &str) -> oar_discovery::Result<Listing> {
        self.inner.get_prefix(prefix).await
    }
    async fn delete(&self, key: &str) -> oar_discovery::Result<bool> {
        self.inner.delete(key).await
    }
    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> oar_discovery::Result<Option<Revision>> {
        self.inner.create_if_absent(key, value, lease).await
    }
    async fn watch_prefix(
        &self,
        prefix: &str,
        from_revision: Revision,
    ) -> oar_discovery::Result<WatchStream> {
        self.inner.watch_prefix(prefix, from_revision).await
    }
    async fn put_fenced(&self, fence: &Fence, key: &str, value: Vec<u8>) -> oar_discovery::Result<Revision> {
        let len = value.len() as u64;
        let started = Instant::now();
        let revision = self.inner.put_fenced(fence, key, value).await?;
        let took = started.elapsed();
        self.puts.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(len, Ordering::Relaxed);
        if key.ends_with("/master/state") {
            self.snapshots.fetch_add(1, Ordering::Relaxed);
        }
        self.put_nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        self.latencies.lock().unwrap_or_else(PoisonError::into_inner).push(took.as_secs_f64());
        self.compactor.wrote(revision);
        Ok(revision)
    }
    async fn delete_fenced(&self, fence: &Fence, key: &str) -> oar_discovery::Result<bool> {
        self.inner.delete_fenced(fence, key).await
    }
    async fn delete_range_fenced(&self, fence: &Fence, start: &str, end: &str) -> oar_discovery::Result<()> {
        self.inner.delete_range_fenced(fence, start, end).await?;
        self.deletes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    async fn lock(
        &self,
        key: &str,
        holder: Vec<u8>,
        lease: LeaseId,
        timeout: Duration,
    ) -> oar_discovery::Result<Fence> {
        self.inner.lock(key, holder, lease, timeout).await
    }
}

/// What one service run measured.
struct ServiceRun {
    k: usize,
    finished: u64,
    stale: u64,
    complete: bool,
    secs: f64,
    writes: u64,
    snapshots: u64,
    write_bytes: u64,
    put_secs: f64,
    put_median: f64,
}

impl ServiceRun {
    fn rate(&self) -> f64 {
        self.finished as f64 / self.secs
    }
    fn writes_per_task(&self) -> f64 {
        self.writes as f64 / self.finished.max(1) as f64
    }
}

async fn service_run(
    k: usize,
    tasks: &[TaskSpec],
    ca: &DevCa,
    limit: Duration,
) -> Result<ServiceRun, BoxError> {
    let server = EtcdServer::start()?;
    let etcd = EtcdDiscovery::connect(&[server.endpoint()]).await?;
    let counting = Arc::new(Counting::new(etcd.clone()));
    let master_transport: Arc<dyn Transport> = Arc::new(QuicTransport::new(ca.tls_config("master")?)?);
    let options = MasterOptions {
        holder: "bench-master".into(),
        lease_ttl: Duration::from_secs(10),
        tick_interval: Duration::from_millis(20),
        ..MasterOptions::new(
            keys(),
            QueueConfig { task_timeout: Duration::from_secs(600), max_failures: 3, passes: 1 },
        )
    };
    let discovery: Arc<dyn Discovery> = counting.clone();
    let master = Master::start(discovery, master_transport, "127.0.0.1:0", tasks.to_vec(), options).await?;
    counting.take_latencies();

    let clients_discovery: Arc<dyn Discovery> = Arc::new(etcd);
    let mut clients = Vec::with_capacity(k);
    for i in 0..k {
        let transport: Arc<dyn Transport> =
            Arc::new(QuicTransport::new(ca.tls_config(&format!("trainer-{i}"))?)?);
        let options = MasterClientOptions {
            call_timeout: Duration::from_secs(20),
            retry: RetryPolicy { give_up_after: Duration::from_secs(30), ..RetryPolicy::default() },
            ..MasterClientOptions::new(keys().addr)
        };
        let client = MasterClient::new(clients_discovery.clone(), transport, options);
        // Connect (and read master/addr) before the clock starts.
        client.status().await?;
        clients.push(client);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let (writes0, snapshots0, bytes0, put_secs0) = counting.totals();
    let started = Instant::now();
    let mut handles = Vec::with_capacity(k);
    for (i, client) in clients.into_iter().enumerate() {
        let stop = stop.clone();
        handles.push(tokio::spawn(async move {
            let trainer = format!("trainer-{i}");
            let stats = TaskStats { examples: 1000, loss_sum: 500.0, skipped_lines: 0 };
            let (mut finished, mut stale, mut last) = (0u64, 0u64, started);
            while !stop.load(Ordering::Relaxed) {
                match client.get_task(&trainer).await? {
                    TaskReply::Assigned { task_ref, .. } => {
                        match client.task_finished(&trainer, task_ref, stats).await? {
                            ReportReply::Accepted => {
                                finished += 1;
                                last = Instant::now();
                            }
                            ReportReply::Stale => stale += 1,
                        }
                    }
                    TaskReply::Wait { retry_after_ms } => {
                        tokio::time::sleep(Duration::from_millis(retry_after_ms.min(20))).await
                    }
                    TaskReply::Done | TaskReply::Failed => break,
                }
            }
            Ok::<_, oar_task_queue::Error>((finished, stale, last))
        }));
    }
    let watchdog = {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            stop.store(true, Ordering::Relaxed);
        })
    };
    let (mut finished, mut stale, mut last) = (0, 0, started);
    for handle in handles {
        let (f, s, l) = handle.await??;
        finished += f;
        stale += s;
        last = last.max(l);
    }
    watchdog.abort();
    let complete = master.status().borrow().is_finished();
    if complete {
        // The final state is stored before `wait` returns.
        tokio::time::timeout(Duration::from_secs(30), master.wait()).await??;
    }
    let (writes1, snapshots1, bytes1, put_secs1) = counting.totals();
    let latencies = counting.take_latencies();
    master.shutdown().await?;
    counting.compactor.finish().await;
    drop(server);
    Ok(ServiceRun {
        k,
        finished,
        stale,
        complete,
        secs: (last - started).as_secs_f64(),
        writes: writes1 - writes0,
        snapshots: snapshots1 - snapshots0,
        write_bytes: bytes1 - bytes0,
        put_secs: put_secs1 - put_secs0,
        put_median: if latencies.is_empty() { f64::NAN } else { median(latencies) },
    })
}

/// `count` fenced puts of `bytes` by one writer to a fresh etcd, with the
/// same compaction as the service runs: (puts/s, median put seconds).
async fn raw_puts(count: u64, bytes: &[u8], limit: Duration) -> Result<(u64, f64, f64), BoxError> {
    let server = EtcdServer::start()?;
    let etcd = EtcdDiscovery::connect(&[server.endpoint()]).await?;
    let compactor = Compactor::new(etcd.clone());
    let lease = etcd.grant_lease(Duration::from_secs(30)).await?;
    let fence = etcd.lock("/oar/raw/master/lock", b"raw".to_vec(), lease, Duration::from_secs(5)).await?;
    let mut latencies = Vec::new();
    let started = Instant::now();
    let mut done = 0;
    while done < count && started.elapsed() < limit {
        let t = Instant::now();
        let revision = etcd.put_fenced(&fence, "/oar/raw/master/state", bytes.to_vec()).await?;
        latencies.push(t.elapsed().as_secs_f64());
        compactor.wrote(revision);
        done += 1;
        if done % 100 == 0 {
            etcd.keep_alive(lease).await?;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    compactor.finish().await;
    drop(server);
    Ok((done, done as f64 / secs, median(latencies)))
}

async fn part_b(args: &Args, tasks: &[TaskSpec]) -> Result<(), BoxError> {
    let (encode_secs, encoded_bytes) = encode_cost(tasks)?;
    println!(
        "(B) master service over QUIC with etcd, {} tasks, 1 pass, up to {} s per run",
        tasks.len(),
        args.secs
    );
    println!(
        "    a whole snapshot of the stored state (mid-pass): {:.2} ms to build and encode, {} bytes \
         (written at a pass's start and when the journal outgrows it)",
        encode_secs * 1e3,
        encoded_bytes,
    );
    let ca = DevCa::new()?;
    let mut runs = Vec::new();
    for &k in &args.ks {
        let run = service_run(k, tasks, &ca, Duration::from_secs(args.secs)).await?;
        let rate = run.rate();
        println!(
            "    K={:>3}: {} of {} finished{} in {:.1} s: {:.0} tasks/s = {:.2}x the 5,000/s target: {}",
            run.k,
            run.finished,
            tasks.len(),
            if run.complete { "" } else { " (time limit; partial)" },
            run.secs,
            rate,
            rate / SERVICE_TARGET,
            verdict(rate >= SERVICE_TARGET)
        );
        println!(
            "           etcd writes {} ({} snapshots) = {:.3} per finished task ({:.1} tasks per write), \
             {:.0} bytes per write, {:.2} MB/s to etcd, put median {:.2} ms; writer in put {:.0}% of the time{}",
            run.writes,
            run.snapshots,
            run.writes_per_task(),
            1.0 / run.writes_per_task(),
            run.write_bytes as f64 / run.writes.max(1) as f64,
            run.write_bytes as f64 / run.secs / 1e6,
            run.put_median * 1e3,
            100.0 * run.put_secs / run.secs,
            if run.stale > 0 { format!(", {} stale reports", run.stale) } else { String::new() }
        );
        runs.push(run);
    }
    let Some(widest) = runs.iter().max_by_key(|r| r.writes) else {
        return Ok(());
    };
    // The widest run's mean write: mostly journal records, a few snapshots.
    let state_bytes = (widest.write_bytes / widest.writes.max(1)) as usize;
    let state = vec![0x5au8; state_bytes];
    let (count, puts_per_s, put_median) =
        raw_puts(widest.writes.max(100), &state, Duration::from_secs(args.secs)).await?;
    println!(
        "    etcd alone: {count} fenced puts of {state_bytes} bytes (that run's mean write) by one writer: {puts_per_s:.0} puts/s \
         ({:.1} MB/s), put median {:.2} ms",
        puts_per_s * state_bytes as f64 / 1e6,
        put_median * 1e3
    );
    for run in &runs {
        let bound = puts_per_s / run.writes_per_task();
        println!(
            "    K={:>3}: persistence alone at {:.1} tasks per write allows {:.0} tasks/s; service / that = {:.2}; \
             at one write per {} tasks (all in flight) {:.0} tasks/s",
            run.k,
            1.0 / run.writes_per_task(),
            bound,
            run.rate() / bound,
            run.k,
            puts_per_s * run.k as f64
        );
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args = parse_args().map_err(|e| -> BoxError { format!("{e} (see the example's header)").into() })?;
    let tasks = make_tasks(args.tasks)?;
    println!("machine: {} cores; load average {}", num_cpus(), load_average());
    part_a(&args, &tasks)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(part_b(&args, &tasks))?;
    println!("machine after: load average {}", load_average());
    Ok(())
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
