//! Peak resident memory of a pserver and of a trainer (issue 6, item 5),
//! each in a process of its own, talking over QUIC on 127.0.0.1.
//!
//! ```sh
//! cargo run --release -p oar-bench --bin bench_memory
//! cargo run --release -p oar-bench --bin bench_memory -- --modes sync --trainers 2
//! # options: --params N [100000000] --optimizer NAME [adam] --modes sync,async
//! #   --trainers K [1] --block-size B [65536] --target X [1.3]
//! ```
//!
//! The example re-executes itself (`--role pserver`, `--role trainer`); the
//! parent only starts the children, drives them step by step over their
//! stdin, and reads the peak resident set (`VmHWM` in `/proc/self/status`)
//! each child reports after each step. Per mode:
//!
//! - **pserver child**: a real [`Pserver`] started with `Pserver::start` on
//!   its own `MemDiscovery` and a `QuicTransport` (certificates from a
//!   `DevCa` the parent wrote to a temporary directory), one shard holding
//!   every parameter: one `ParamSpec` "w" of `--params` elements (normal
//!   initialisation, so every parameter page is written at start), cut in
//!   `--block-size` blocks, with the optimizer (`--optimizer`, Adam: two slot
//!   arrays per element). It serves until the parent closes its stdin. Its
//!   figure therefore counts everything the service allocates: the store,
//!   the optimizer state (resident only once the first update writes it),
//!   the received push parts (the client sends a shard in parts of at most
//!   8 MiB, two in flight; their gradients are read in place, see
//!   `oar_pserver::Grad`), the pull replies' buffers (one per part), quinn's
//!   buffers, the runtime.
//! - **trainer child(ren)**: what the worker's loop (`oar::trainer::worker`)
//!   holds for a model of that size, and one step as it makes it: a
//!   `PserverClient` (its own `MemDiscovery` with `ps/0` pointing at the
//!   pserver child), `ParamBuf` params and grads (plus the async accumulator
//!   `sum` in async mode), then: pull; fill the gradient (standing in for
//!   `loss_and_grad`, which writes every element; no 100M-parameter model is
//!   built, so a model's own temporaries are not counted); push (async: the
//!   weighted accumulation and mean, as `async_step` and `flush` do); pull
//!   again (sync: waits for the step to be applied). In sync mode every
//!   trainer joins first, so with `--trainers K` the pserver buffers K
//!   gradients for the step.
//!
//! The ideal: pserver = parameters + optimizer state (100M x 4 B x 3 = 1.2 GB
//! with Adam); trainer = params + grads (+ the async accumulator) (0.8 GB,
//! 1.2 GB). PASS when peak / ideal <= `--target` (1.3). 1 GB = 1e9 B.

#[path = "../../../examples/common/mod.rs"]
mod common;
use common::ModeArg;
use oar_bench::child::ChildProc;

use clap::{Parser, ValueEnum};
use oar::{
    discovery::{Discovery, MemDiscovery},
    job::keys::JobKeys,
    pserver::{
        Coordinator, CoordinatorOptions, Init, OptimizerConfig, ParamBuf, ParamSpec, Placement, Pserver,
        PserverClient, PserverClientOptions, PserverOptions, ShardMap,
    },
    transport::{DevCa, QuicTransport, RetryPolicy, TlsConfig},
};
use std::{
    io::BufRead,
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::Duration,
};
use tokio::sync::mpsc::UnboundedReceiver;

use oar_bench::BoxError;

const JOB: &str = "mem";
/// Bound of every wait for a child (a step moves 400 MB over QUIC and may apply Adam to 100M elements).
const STEP_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Parser, Debug)]
#[command(about = "Peak resident memory of a pserver and a trainer, each in its own process")]
struct Args {
    /// float32 parameters of the model (all on one pserver).
    #[arg(long, default_value_t = 100_000_000)]
    params: usize,
    /// The pserver's optimizer.
    #[arg(long, default_value = "adam")]
    optimizer: String,
    /// Modes to measure, one pserver and its trainers each.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sync,async")]
    modes: Vec<ModeArg>,
    /// Trainer processes per mode.
    #[arg(long, default_value_t = 1)]
    trainers: u32,
    /// Largest parameter block, in floats.
    #[arg(long, default_value_t = 1 << 16)]
    block_size: usize,
    /// Largest peak / ideal ratio.
    #[arg(long, default_value_t = 1.3)]
    target: f64,
    /// Internal: the role of a child process.
    #[arg(long, value_enum, hide = true)]
    role: Option<Role>,
    /// Internal: the certificates' directory.
    #[arg(long, hide = true)]
    dir: Option<PathBuf>,
    /// Internal: the pserver's address (trainer children).
    #[arg(long, hide = true)]
    addr: Option<String>,
    /// Internal: the trainer's number.
    #[arg(long, hide = true, default_value_t = 0)]
    index: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Role {
    Pserver,
    Trainer,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.role {
        None => parent(&args),
        Some(Role::Pserver) => pserver_child(&args),
        Some(Role::Trainer) => trainer_child(&args),
    };
    oar_bench::exit_code(result, args.role)
}

/// The model: one parameter of `n` floats, drawn from a normal (so the
/// pserver writes every parameter page at start, as a real model's would).
fn specs(n: usize) -> Vec<ParamSpec> {
    vec![ParamSpec::new("w", vec![n], Init::Normal { mean: 0.0, std: 0.01 })]
}

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

/// Tell the parent this process's memory after `stage`.
fn report(stage: &str) {
    let (hwm, rss) = memory();
    println!("hwm {stage} {hwm} {rss}");
}

/// Lines of the parent's stdin, read on a thread of their own.
fn stdin_lines() -> UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next command from the parent, or `None` when its stdin closed.
async fn next_command(rx: &mut UnboundedReceiver<String>) -> Result<Option<String>, BoxError> {
    tokio::time::timeout(STEP_TIMEOUT, rx.recv())
        .await
        .map_err(|_| "no command from the parent in time".into())
}

/// Wait for the parent's "go" before the next stage.
async fn go(rx: &mut UnboundedReceiver<String>) -> Result<(), BoxError> {
    match next_command(rx).await? {
        Some(c) if c == "go" => Ok(()),
        other => Err(format!("expected go, got {other:?}").into()),
    }
}

fn tls(dir: &Path, name: &str) -> Result<TlsConfig, BoxError> {
    Ok(TlsConfig::from_pem_files(
        dir.join("ca.pem"),
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    )?)
}

fn child_mode(args: &Args) -> Result<ModeArg, BoxError> {
    args.modes.first().copied().ok_or_else(|| "a child needs one --modes".into())
}

/// A real pserver holding every parameter; reports its memory when asked.
fn pserver_child(args: &Args) -> Result<(), BoxError> {
    report("baseline");
    let dir = args.dir.clone().ok_or("--dir is required")?;
    let mode = child_mode(args)?;
    let mut commands = stdin_lines();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let transport = Arc::new(QuicTransport::new(tls(&dir, "pserver")?)?);
        let discovery = Arc::new(MemDiscovery::new());
        let optimizer = OptimizerConfig::parse(&args.optimizer, 1e-3)?;
        let options = PserverOptions {
            keys: JobKeys::new(JOB)?.pserver(),
            specs: specs(args.params),
            mode: mode.mode(),
            optimizer,
            block_size: args.block_size,
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
        report("started");
        while let Some(command) = next_command(&mut commands).await? {
            if let Some(stage) = command.strip_prefix("report ") {
                report(stage);
            }
        }
        server.shutdown().await?;
        Ok::<_, BoxError>(())
    })?;
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

/// The worker's buffers for the model and one step, stage by stage on the parent's "go".
fn trainer_child(args: &Args) -> Result<(), BoxError> {
    report("baseline");
    let dir = args.dir.clone().ok_or("--dir is required")?;
    let addr = args.addr.clone().ok_or("--addr is required")?;
    let mode = child_mode(args)?;
    let id = format!("trainer-{}", args.index);
    let mut commands = stdin_lines();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let transport = Arc::new(QuicTransport::new(tls(&dir, &id)?)?);
        let discovery = Arc::new(MemDiscovery::new());
        let keys = JobKeys::new(JOB)?;
        // The pserver's registration and the map it serves under, as in its process.
        let (name, addr) = addr.split_once('=').ok_or("--addr is name=address")?;
        discovery.put(&keys.ps(name), addr.as_bytes().to_vec(), None).await?;
        discovery
            .put(&keys.shard_map(), ShardMap::initial(1, 1, &[name.to_string()])?.encode(), None)
            .await?;
        let specs = specs(args.params);
        let placement = Arc::new(Placement::new(&specs, 1, args.block_size)?);
        let options = PserverClientOptions {
            call_timeout: STEP_TIMEOUT,
            retry: RetryPolicy { give_up_after: STEP_TIMEOUT, ..RetryPolicy::default() },
            ..PserverClientOptions::new(keys.pserver(), id.clone())
        };
        let mut client = PserverClient::new(discovery, transport, placement, options);
        client.wait_for_servers(Duration::from_secs(60)).await?;
        // What `worker::Loop` holds: params, grads and, async, the accumulator.
        let mut params = ParamBuf::zeros(&specs);
        let mut grads = ParamBuf::zeros(&specs);
        let mut sum = (mode == ModeArg::Async).then(|| ParamBuf::zeros(&specs));
        if mode == ModeArg::Sync {
            client.join().await?;
        }
        println!("ready");
        go(&mut commands).await?;
        client.forget_steps();
        client.pull(&mut params).await?;
        report("pull");

        go(&mut commands).await?;
        // `loss_and_grad` writes every element of the gradient.
        grads.fill(1e-3);
        let weight = 64.0f32;
        match sum.as_mut() {
            Some(sum) => {
                for (s, g) in sum.as_mut_slice().iter_mut().zip(grads.as_slice()) {
                    *s += weight * g;
                }
                sum.as_mut_slice().iter_mut().for_each(|s| *s /= weight);
                client.push(sum, weight).await?;
                sum.fill(0.0);
            }
            None => {
                client.push(&grads, weight).await?;
            }
        }
        report("push");

        go(&mut commands).await?;
        if mode == ModeArg::Async {
            client.forget_steps();
        }
        client.pull(&mut params).await?;
        report("pull-again");
        if mode == ModeArg::Sync {
            client.leave().await?;
        }
        Ok::<_, BoxError>(())
    })?;
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

/// The (stage, peak, current) of a child's next memory report.
fn child_memory(child: &mut ChildProc) -> Result<(String, u64, u64), BoxError> {
    let rest = child.expect("hwm ")?;
    let mut words = rest.split_whitespace();
    let (Some(stage), Some(hwm), Some(rss)) = (words.next(), words.next(), words.next()) else {
        return Err(format!("{}: bad report {rest:?}", child.name()).into());
    };
    Ok((stage.to_string(), hwm.parse()?, rss.parse()?))
}

/// Print a memory report; returns its peak.
fn show(who: &str, (stage, hwm, rss): (String, u64, u64)) -> u64 {
    println!("  {who:<10} after {stage:<10} peak {}  now {}", gb(hwm), gb(rss));
    hwm
}

fn gb(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

/// One row of the result.
struct Row {
    role: String,
    mode: ModeArg,
    peak: u64,
    ideal: u64,
    what: String,
}

fn parent(args: &Args) -> Result<(), BoxError> {
    if args.trainers == 0 || args.params == 0 {
        return Err("--trainers and --params must be at least 1".into());
    }
    let slots = OptimizerConfig::parse(&args.optimizer, 1e-3)?.build()?.state_slots() as u64;
    let param_bytes = args.params as u64 * 4;
    let dir = tempfile::tempdir()?;
    let names: Vec<String> = std::iter::once("pserver".to_string())
        .chain((0..args.trainers).map(|i| format!("trainer-{i}")))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    DevCa::new()?.write_files(dir.path(), &names)?;
    let dir_arg = dir.path().to_str().ok_or("temporary path is not UTF-8")?.to_string();
    println!(
        "{} float32 parameters ({}), optimizer {} ({slots} slots), block {} floats, {} trainer(s); {}",
        args.params,
        gb(param_bytes),
        args.optimizer,
        args.block_size,
        args.trainers,
        common::load()
    );
    let mut rows = Vec::new();
    for &mode in &args.modes {
        println!("\nmode {}:", mode.name());
        let common = vec![
            "--params".to_string(),
            args.params.to_string(),
            "--optimizer".into(),
            args.optimizer.clone(),
            "--modes".into(),
            mode.name().into(),
            "--block-size".into(),
            args.block_size.to_string(),
            "--dir".into(),
            dir_arg.clone(),
        ];
        let mut ps_args = common.clone();
        ps_args.extend(["--role".to_string(), "pserver".into()]);
        let mut ps = ChildProc::spawn("pserver", &ps_args, STEP_TIMEOUT)?;
        show("pserver", child_memory(&mut ps)?);
        let addr = ps.expect("addr ")?;
        show("pserver", child_memory(&mut ps)?);
        let mut trainers = Vec::new();
        for i in 0..args.trainers {
            let mut t_args = common.clone();
            t_args.extend([
                "--role".to_string(),
                "trainer".into(),
                "--addr".into(),
                addr.clone(),
                "--index".into(),
                i.to_string(),
            ]);
            let mut t = ChildProc::spawn(&format!("trainer-{i}"), &t_args, STEP_TIMEOUT)?;
            let report = child_memory(&mut t)?;
            show(t.name(), report);
            t.expect("ready")?;
            trainers.push(t);
        }
        let mut trainer_peak = 0;
        let mut ps_peak = 0;
        for stage in ["pull", "push", "pull-again"] {
            for t in &mut trainers {
                t.send("go")?;
            }
            for t in &mut trainers {
                let report = child_memory(t)?;
                trainer_peak = trainer_peak.max(show(t.name(), report));
            }
            ps.send(&format!("report {stage}"))?;
            ps_peak = ps_peak.max(show("pserver", child_memory(&mut ps)?));
        }
        for t in trainers {
            t.finish()?;
        }
        ps.finish()?;
        let buffers = if mode == ModeArg::Async { 3 } else { 2 };
        rows.push(Row {
            role: "pserver".into(),
            mode,
            peak: ps_peak,
            ideal: param_bytes * (1 + slots),
            what: format!("params + {slots} optimizer slots"),
        });
        rows.push(Row {
            role: format!("trainer (max of {})", args.trainers),
            mode,
            peak: trainer_peak,
            ideal: param_bytes * buffers,
            what: if mode == ModeArg::Async {
                "params + grads + accumulator".into()
            } else {
                "params + grads".into()
            },
        });
    }
    println!("\n{}", common::load());
    println!("\n| role | mode | peak RSS | ideal | ideal is | peak / ideal | peak / params | target |");
    println!("| --- | --- | ---: | ---: | --- | ---: | ---: | --- |");
    let mut all = true;
    for r in &rows {
        let ratio = r.peak as f64 / r.ideal as f64;
        let pass = ratio <= args.target;
        all &= pass;
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {} |",
            r.role,
            r.mode.name(),
            gb(r.peak),
            gb(r.ideal),
            r.what,
            ratio,
            r.peak as f64 / param_bytes as f64,
            if pass { "PASS" } else { "MISS" }
        );
    }
    println!("\nverdict (peak / ideal <= {}): {}", args.target, if all { "PASS" } else { "MISS" });
    Ok(())
}
