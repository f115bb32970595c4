//! The master role: the task queue, the per-pass scores, the job's report.
//!
//! The master scores the model on the held-out data at the end of each pass
//! by pulling the parameters like any client. Trainers keep training
//! meanwhile, so the parameters scored at the end of pass p may already
//! include a few updates of pass p+1. The final report's train accuracy is
//! measured on the training data if it holds at most [`TRAIN_SAMPLE_BYTES`],
//! else on an evenly spread sample of that size, so the master's memory
//! does not grow with the dataset.
//!
//! **Divergence.** After each pass the scored model is checked: a
//! non-finite parameter, a non-finite train or test loss, or a test loss
//! above [`DIVERGED_FACTOR`] times the initial model's (computed here from
//! the job's seed, as the pservers initialise it) ends the job as failed
//! at once (`Master::abort`), with a reason that names the learning rate;
//! training on would only waste the machines. A job that fails otherwise
//! (every task of a pass discarded) reports the first discard's reason.

use super::{unless_shut_down, RoleOptions};
use crate::{
    config::{JobConfig, StreamConfig},
    context::JobContext,
    keys::JobKeys,
    report::{read_result, JobEnd, JobReport, PassReport, Progress, WindowReport},
    Error, Result,
};
use oar_discovery::ChangeSignal;
use oar_pserver::{
    Coordinator, CoordinatorOptions, OptimizerConfig, ParamBuf, PserverClient, PserverClientOptions,
};
use oar_task_queue::{
    auto_chunk_bytes, chunk_files, glob_files, tasks_from_chunks, JobState, Master, MasterOptions,
    MasterStatus, StreamOptions,
};
use oar_trainer::{
    eval::{evaluate, evaluate_sparse, init_rows, Evaluation},
    reader::ReaderOptions,
    worker::score_sparse,
    AnyModel, Examples,
};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};
use tokio_util::{sync::CancellationToken, task::AbortOnDropHandle};
use tracing::Instrument;

/// The most training data the master reads to score the final model's
/// train accuracy (and, without held-out data, each pass): above it, an
/// evenly spread sample of this size.
pub const TRAIN_SAMPLE_BYTES: u64 = 64 << 20;

/// A test loss this many times the initial model's means training diverged.
pub const DIVERGED_FACTOR: f32 = 100.0;

/// Run the master of a job with options `config`: take the lock (waiting as
/// a standby while another master holds it), publish the options, serve the
/// task queue, tell `on_progress` of every change of the queue and of each
/// pass as it ends (scored), and when the job
/// ends write and return its report. `None` if `shutdown` stopped it first
/// (a standby, if any, takes over at once). Errors if the master loses its
/// lock or lease (it stops serving first).
pub async fn master(
    ctx: &JobContext,
    config: &JobConfig,
    options: &RoleOptions,
    shutdown: CancellationToken,
    on_progress: impl FnMut(Progress<'_>),
) -> Result<Option<JobReport>> {
    let span = tracing::info_span!("master", job = %ctx.job, id = %options.id);
    run_master(ctx, config, options, shutdown, on_progress).instrument(span).await
}

async fn run_master(
    ctx: &JobContext,
    config: &JobConfig,
    options: &RoleOptions,
    shutdown: CancellationToken,
    mut on_progress: impl FnMut(Progress<'_>),
) -> Result<Option<JobReport>> {
    config.validate()?;
    let started = Instant::now();
    let keys = JobKeys::new(&ctx.job)?;
    if let Some(kv) = ctx.discovery.get(&keys.config()).await? {
        let published = JobConfig::decode(&kv.value)?;
        let differ = published.differences(config);
        if !differ.is_empty() {
            return Err(Error::BadConfig(format!(
                "job {:?} was started with other options ({}); give the same options, or use a new job name",
                ctx.job,
                differ.join(", ")
            )));
        }
    } else {
        // A new job: its run id, before the options are published, so a
        // pserver that read them finds it (kept if a master starting at
        // the same time made it). A job whose options are there already
        // keeps what it has: one started by an oar before run ids has
        // none, and its checkpoints stay where its pservers wrote them.
        ctx.discovery.create_if_absent(&keys.instance(), super::new_instance_id().into_bytes(), None).await?;
    }
    let model = ctx.model(config)?;
    let placement = Arc::new(config.placement_for(&model)?);
    // Scoring skips bad lines; training reports them through its tasks.
    let scoring = ReaderOptions { skip_bad_lines: true, ..config.reader() };
    // The training set is read for the final report's train accuracy only
    // (unless it is also the test set): read it while the job trains, not
    // before the master serves, and a sample of it only if it is large.
    // (A stream's data is not kept: it has no train sample.)
    let train_read = config.stream.is_none().then(|| {
        AbortOnDropHandle::new({
            let (data, scoring, model) = (config.data.clone(), scoring.clone(), model.clone());
            tokio::task::spawn_blocking(move || model.read_sample(&data, &scoring, TRAIN_SAMPLE_BYTES))
        })
    });
    let (test_set, train_read) = match (&config.test_data, train_read) {
        (Some(glob), train_read) => (model.read_glob(glob, &scoring)?, train_read),
        (None, Some(train_read)) => (joined(train_read).await??, None),
        (None, None) => (model.no_examples(), None),
    };
    let master_options = MasterOptions {
        holder: options.id.clone(),
        lease_ttl: options.lease_ttl,
        lock_timeout: options.standby_timeout,
        config: Some(config.encode()?),
        ..MasterOptions::new(keys.master(), config.queue())
    };
    let (discovery, transport) = (ctx.discovery.clone(), ctx.transport.clone());
    let start = match &config.stream {
        None => {
            let files = glob_files(&config.data)?;
            let chunk_bytes = match config.chunk_bytes {
                0 => auto_chunk_bytes(files.iter().map(|(_, len)| len).sum()),
                bytes => bytes,
            };
            let tasks = tasks_from_chunks(chunk_files(&files, chunk_bytes)?, config.chunks_per_task)?;
            if tasks.is_empty() {
                return Err(Error::BadConfig(format!(
                    "no training data: the {} file(s) of {:?} are empty",
                    files.len(),
                    config.data
                )));
            }
            tracing::info!(chunk_bytes, tasks = tasks.len(), "tasks cut");
            unless_shut_down(
                &shutdown,
                Master::start(discovery, transport, &ctx.listen, tasks, master_options),
            )
            .await
        }
        Some(stream) => {
            let source = stream.source.open(config.stream_chunk_bytes());
            tracing::info!(source = source.describe(), "streaming");
            let stream = StreamOptions {
                chunks_per_task: config.chunks_per_task,
                close_key: Some(keys.stream_close()),
                ..StreamOptions::new(source)
            };
            unless_shut_down(
                &shutdown,
                Master::start_stream(discovery, transport, &ctx.listen, stream, master_options),
            )
            .await
        }
    };
    let Some(master) = start else {
        tracing::info!("shut down while waiting for the lock");
        return Ok(None);
    };
    let master = master?;
    // The passes to report start from the one the master started at: a
    // master taking over reports from its journal's pass on, a first one
    // from pass 0. Taken now, before the pservers are waited for: trainers
    // may work through a small job's first pass meanwhile, and a pass read
    // later would go unreported.
    let mut status = master.status();
    let mut reported = status.borrow().queue.pass;
    // The shard map's one writer runs with the master, through its fence.
    let coordinator_options = CoordinatorOptions {
        keys: keys.pserver(),
        shards: config.shards,
        replicas: config.replicas,
        pservers: config.pservers,
        rebalance: config.rebalance,
        query_timeout: options.call_timeout.min(Duration::from_secs(1)),
        ..CoordinatorOptions::default()
    };
    // A job's first master waits for its pservers at most the start-up
    // timeout (one taking over a running job has them, or their failover).
    let first_map = ctx.discovery.get(&keys.pserver().shard_map).await?.is_none();
    let mut coordinator =
        Coordinator::start(ctx.discovery.clone(), ctx.transport.clone(), master.fence(), coordinator_options)
            .await?;
    if let Some(report) = read_result(&*ctx.discovery, &ctx.job).await? {
        tracing::info!(state = ?report.state, "the job had ended before this master started");
        master.shutdown().await?;
        return Ok(Some(report));
    }

    let client_options = PserverClientOptions {
        call_timeout: options.call_timeout,
        retry: options.retry(),
        ..PserverClientOptions::new(keys.pserver(), format!("{}-evaluator", options.id))
    };
    let mut evaluator =
        PserverClient::new(ctx.discovery.clone(), ctx.transport.clone(), placement, client_options);
    if first_map {
        let up = evaluator.wait_for_servers(options.startup_timeout);
        match while_coordinating(&mut coordinator, unless_shut_down(&shutdown, up)).await {
            Ok(Some(Ok(()))) => {}
            Ok(None) => {
                master.shutdown().await?;
                return Ok(None);
            }
            Ok(Some(Err(missing))) => {
                tracing::error!(error = %missing, "the job's pservers did not come up; this master stops");
                master.shutdown().await?;
                return Err(missing.into());
            }
            Err(stopped) => {
                master.shutdown().await?;
                return Err(stopped.into());
            }
        }
    }
    let mut params = ParamBuf::zeros(&model.param_specs());
    // The loss before any training, from the initial values the pservers
    // start from: what a diverged loss is measured against.
    let initial_loss = initial_loss(&model, config.seed, &test_set)?;
    let mut aborted = None;

    let state = match &config.stream {
        Some(stream) => {
            let followed = follow_stream(
                &master,
                stream,
                Scoring {
                    evaluator: &mut evaluator,
                    params: &mut params,
                    model: &model,
                    test_set: &test_set,
                },
                initial_loss,
                config,
                &keys,
                &mut aborted,
                &mut on_progress,
            );
            while_coordinating(&mut coordinator, unless_shut_down(&shutdown, followed)).await
        }
        None => {
            // Report each pass as it ends, until the job ends, the master stops or
            // it is shut down.
            let followed = async {
                let ended = master.wait();
                tokio::pin!(ended);
                let mut over = false;
                loop {
                    let current = status.borrow_and_update().clone();
                    on_progress(Progress::Status(&current));
                    let passes_over =
                        if current.is_finished() { current.queue.pass + 1 } else { current.queue.pass };
                    while reported < passes_over.min(config.passes) {
                        let eval = score(&mut evaluator, &mut params, &model, &test_set).await?;
                        let pass = pass_report(reported, &current, &eval);
                        on_progress(Progress::PassEnded(&pass));
                        reported += 1;
                        if let Some(why) =
                            diverged(&pass, &params, initial_loss, config).filter(|_| aborted.is_none())
                        {
                            tracing::error!(reason = %why, "training diverged; the job fails");
                            if master.abort(&why) {
                                aborted = Some(why);
                            }
                        }
                    }
                    if over || current.is_finished() {
                        // Returns at once now: the end is stored, or the master stopped.
                        break Ok::<_, Error>(master.wait().await?);
                    }
                    tokio::select! {
                        state = &mut ended => {
                            state?;
                            over = true;
                        }
                        changed = status.changed() => over = changed.is_err(),
                    }
                }
            };
            while_coordinating(&mut coordinator, unless_shut_down(&shutdown, followed)).await
        }
    };
    let state = match state {
        Ok(state) => state,
        Err(stopped) => {
            // Without its coordinator no shard would fail over or move: step
            // down, so that a standby master (with a coordinator of its own)
            // takes over, and say why.
            tracing::error!(error = %stopped, "the shard coordinator stopped; this master steps down");
            master.shutdown().await?;
            return Err(stopped.into());
        }
    };
    let Some(state) = state else {
        tracing::info!("shut down: storing the state and handing over");
        master.shutdown().await?;
        return Ok(None);
    };
    let state = state?;
    let last = master.status().borrow().clone();
    let training_seconds = started.elapsed().as_secs_f64();

    let test = score(&mut evaluator, &mut params, &model, &test_set).await?;
    let train = match train_read {
        Some(read) => evaluate_pulled(&mut evaluator, &params, &model, &joined(read).await??).await?,
        None if config.stream.is_some() => Evaluation { loss: f32::NAN, accuracy: f32::NAN, examples: 0 },
        None => test,
    };
    // The final model too: a job that ended before its divergence was seen
    // fails. (Without held-out data, as a stream may be, the loss of the
    // empty set is 0: nothing to judge by.)
    let last_pass = PassReport {
        pass: last.queue.pass,
        train_loss: last.passes.last().map_or(f64::NAN, |p| p.mean_loss()),
        test_loss: test.loss,
        test_accuracy: test.accuracy,
        tasks_done: last.passes.iter().map(|p| p.tasks_finished).sum(),
        tasks_discarded: last.queue.discarded,
    };
    if aborted.is_none() {
        aborted = diverged(&last_pass, &params, initial_loss, config);
    }
    // No held-out data: nothing was scored, which the report says as null.
    let test = match test.examples {
        0 => Evaluation { loss: f32::NAN, accuracy: f32::NAN, examples: 0 },
        _ => test,
    };
    let reason = match (state, aborted) {
        (_, Some(why)) => Some(why),
        (JobState::Done, None) => None,
        (_, None) => Some(failure_reason(&last, config)),
    };
    let report = JobReport {
        state: if reason.is_none() { JobEnd::Done } else { JobEnd::Failed },
        reason,
        passes: last.passes.iter().filter(|p| p.tasks_finished > 0).count() as u32,
        final_loss: last.passes.last().filter(|p| p.examples > 0).map_or(f64::NAN, |p| p.mean_loss()),
        train_accuracy: train.accuracy,
        test_accuracy: test.accuracy,
        examples_per_second: last.passes.iter().map(|p| p.examples).sum::<u64>() as f64 / training_seconds,
        tasks_done: last.passes.iter().map(|p| p.tasks_finished).sum(),
        tasks_failed: last.queue.failures,
        tasks_discarded: last.queue.discarded,
        discarded: last.discarded.clone(),
        skipped_lines: last.passes.iter().map(|p| p.skipped_lines).sum(),
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    // The coordinator runs until the model is scored, so that the shards of
    // a pserver that dies as the job ends still get a new home for the
    // final pulls (else those pulls wait out the retry window). The
    // pservers leave once the report is written: their shards then need
    // no new home, and the coordinator writes no map after it.
    coordinator.stop().await;
    master.put_fenced(&keys.result(), report.to_json().into_bytes()).await?;
    tracing::info!(state = ?report.state, "job report written");

    // Keep answering `Done` until the trainers are gone, for a while. The
    // report is written: a read that fails now (etcd away for a moment)
    // only means looking again, never a failed job.
    let deadline = oar_transport::deadline_in(options.linger);
    let mut changed = ChangeSignal::new(&*ctx.discovery, &keys.trainers()).await;
    while tokio::time::Instant::now() < deadline && !shutdown.is_cancelled() {
        match ctx.discovery.get_prefix(&keys.trainers()).await {
            Ok(listing) if listing.kvs.is_empty() => break,
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot list the trainers while lingering; looking again"),
        }
        let _ = unless_shut_down(&shutdown, changed.wait(Duration::from_millis(100))).await;
    }
    master.shutdown().await?;
    Ok(Some(report))
}

/// The output of a blocking task, or why it has none.
async fn joined<T>(task: AbortOnDropHandle<T>) -> Result<T> {
    task.await.map_err(|e| Error::Panicked(format!("reading the data: {e}")))
}

/// Pull the dense parameters into `params` and score the model on `examples`.
async fn score(
    client: &mut PserverClient,
    params: &mut ParamBuf,
    model: &AnyModel,
    examples: &Examples,
) -> Result<Evaluation> {
    client.pull(params).await?;
    evaluate_pulled(client, params, model, examples).await
}

/// Score the model with the dense parameters pulled: a sparse model's rows
/// are pulled batch by batch.
async fn evaluate_pulled(
    client: &mut PserverClient,
    params: &ParamBuf,
    model: &AnyModel,
    examples: &Examples,
) -> Result<Evaluation> {
    match (model, examples) {
        (AnyModel::Dense(m), Examples::Dense(e)) => Ok(evaluate(&**m, params, e, SCORE_BATCH)),
        (AnyModel::Sparse(m), Examples::Ids(e)) => {
            Ok(score_sparse(client, &**m, params, e, SCORE_BATCH).await?)
        }
        _ => Err(Error::Panicked("examples read for another kind of model".into())),
    }
}

/// The initial model's loss on `examples`, from the job's seed, as the
/// pservers initialise parameters and rows.
fn initial_loss(model: &AnyModel, seed: u64, examples: &Examples) -> Result<f32> {
    let params = ParamBuf::init(&model.param_specs(), seed);
    match (model, examples) {
        (AnyModel::Dense(m), Examples::Dense(e)) => Ok(evaluate(&**m, &params, e, SCORE_BATCH).loss),
        (AnyModel::Sparse(m), Examples::Ids(e)) => {
            let tables = m.table_specs();
            Ok(evaluate_sparse(&**m, &params, e, SCORE_BATCH, |rows| init_rows(&tables, seed, rows)).loss)
        }
        _ => Err(Error::Panicked("examples read for another kind of model".into())),
    }
}

/// Examples per batch when scoring.
const SCORE_BATCH: usize = 1024;

/// What scoring the model needs: a client for the pservers, a buffer for
/// the dense parameters, the model and the held-out examples.
struct Scoring<'a> {
    evaluator: &'a mut PserverClient,
    params: &'a mut ParamBuf,
    model: &'a AnyModel,
    test_set: &'a Examples,
}

/// A streaming job: report every window (records trained, loss, lag, the
/// source's position; the test set scored), publish the source's status
/// under `stream/status`, export the model every `export_every`, until the
/// job ends (its source closed and everything trained) or the master stops.
#[allow(clippy::too_many_arguments)]
async fn follow_stream(
    master: &Master,
    stream: &StreamConfig,
    scoring: Scoring<'_>,
    initial_loss: f32,
    config: &JobConfig,
    keys: &JobKeys,
    aborted: &mut Option<String>,
    on_progress: &mut impl FnMut(Progress<'_>),
) -> Result<JobState> {
    let Scoring { evaluator, params, model, test_set } = scoring;
    let mut status = master.status();
    let ended = master.wait();
    tokio::pin!(ended);
    let start = tokio::time::Instant::now();
    let mut next_window = start + stream.window;
    let mut next_export = start + stream.export_every;
    let mut window = 0u32;
    // Totals at the last window's end: records, loss sum, lags.
    let mut last = (0u64, 0f64, 0u64, 0f64);
    loop {
        let over = tokio::select! {
            state = &mut ended => Some(state?),
            changed = status.changed() => {
                if changed.is_err() {
                    return Ok(master.wait().await?);
                }
                on_progress(Progress::Status(&status.borrow_and_update().clone()));
                None
            }
            () = tokio::time::sleep_until(next_window) => None,
            () = tokio::time::sleep_until(next_export), if stream.export_dir.is_some() => {
                next_export += stream.export_every;
                evaluator.pull(params).await?;
                if let Some(dir) = &stream.export_dir {
                    export_model(dir, &model.param_specs(), params, window)?;
                }
                continue;
            }
        };
        if over.is_none() && tokio::time::Instant::now() < next_window {
            continue;
        }
        next_window += stream.window;
        let current = master.status().borrow().clone();
        let stats = current.passes.first().copied().unwrap_or_default();
        let source = current.stream.clone().unwrap_or_default();
        let records = stats.examples - last.0;
        let lags = source.lag_count - last.2;
        let eval = score(evaluator, params, model, test_set).await?;
        let nan_if_none = |e: f32| if eval.examples == 0 { f32::NAN } else { e };
        let report = WindowReport {
            window,
            records,
            train_loss: (stats.loss_sum - last.1) / records as f64,
            lag_seconds: (source.lag_sum_seconds - last.3) / lags as f64,
            backlog: source.backlog,
            position: source.position.clone(),
            test_loss: nan_if_none(eval.loss),
            test_accuracy: nan_if_none(eval.accuracy),
            tasks_done: stats.tasks_finished,
            tasks_discarded: current.queue.discarded,
        };
        last = (stats.examples, stats.loss_sum, source.lag_count, source.lag_sum_seconds);
        on_progress(Progress::WindowEnded(&report));
        window += 1;
        if let Ok(json) = serde_json::to_vec(&source) {
            if let Err(e) = master.put_fenced(&keys.stream_status(), json).await {
                tracing::warn!(error = %e, "publishing the stream's status failed");
            }
        }
        let as_pass = PassReport {
            pass: report.window,
            train_loss: report.train_loss,
            test_loss: eval.loss,
            test_accuracy: eval.accuracy,
            tasks_done: records.min(1),
            tasks_discarded: report.tasks_discarded,
        };
        if let Some(why) = diverged(&as_pass, params, initial_loss, config).filter(|_| aborted.is_none()) {
            tracing::error!(reason = %why, "training diverged; the job fails");
            if master.abort(&why) {
                *aborted = Some(why);
            }
        }
        if let Some(state) = over {
            // The last status too: the close's problems come with it.
            on_progress(Progress::Status(&current));
            if let Some(dir) = &stream.export_dir {
                export_model(dir, &model.param_specs(), params, window)?;
            }
            return Ok(state);
        }
    }
}

/// Close streaming job `job`'s source: its master polls the source once
/// more, trains everything it holds, and ends the job (done). Works from
/// any process that reaches the job's discovery; closing twice, while the
/// job has not ended, is harmless.
///
/// Refused ([`Error::CannotCloseStream`], nothing written) unless `job` is
/// a streaming job that has not ended: its master published its options,
/// they are a stream's, and no report is written. The close key outlives
/// the job, so one left under a mistyped name or a batch job's would close
/// a later streaming job of that name at its first poll, and the caller
/// would have been told the close worked.
pub async fn close_stream(discovery: &dyn oar_discovery::Discovery, job: &str) -> Result<()> {
    let keys = JobKeys::new(job)?;
    let refuse = |why: String| Error::CannotCloseStream { job: job.to_string(), why };
    let Some(published) = discovery.get(&keys.config()).await? else {
        return Err(refuse(format!(
            "{} is not set: no master has published the job's options (no such job, or its master has \
             not started yet)",
            keys.config()
        )));
    };
    let config = JobConfig::decode(&published.value)
        .map_err(|e| refuse(format!("the options under {} do not decode: {e}", keys.config())))?;
    if config.stream.is_none() {
        return Err(refuse(format!(
            "it is a batch job (data {:?}), not a streaming one: it ends when its passes are trained",
            config.data
        )));
    }
    if let Some(report) = read_result(discovery, job).await? {
        return Err(refuse(format!("it has already ended ({})", report.state)));
    }
    discovery.put(&keys.stream_close(), b"closed".to_vec(), None).await?;
    Ok(())
}

/// First bytes of an exported model file.
pub const EXPORT_MAGIC: &[u8; 4] = b"OARX";

/// The file [`export_model`] writes in its directory.
pub const EXPORT_FILE: &str = "model.params";

/// Write the dense parameters to `dir/model.params`, atomically (a
/// temporary file, synced, then renamed over the last export), so a reader
/// sees the previous export or this one, never a mix. Layout: `OARX`, a
/// little-endian u32 length, that many bytes of JSON (`{"window": n,
/// "unix_seconds": t, "params": [{"name", "shape"}...]}`), then the
/// parameters as little-endian f32 in the specs' order. A sparse model's
/// tables are not exported: their rows live in the pservers' checkpoints.
pub fn export_model(
    dir: &str,
    specs: &[oar_pserver::ParamSpec],
    params: &ParamBuf,
    window: u32,
) -> Result<()> {
    use std::io::Write;
    let io = |what: &str, e: std::io::Error| {
        Error::BadConfig(format!("exporting the model to {dir:?}: {what}: {e}"))
    };
    let header = serde_json::json!({
        "window": window,
        "unix_seconds": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        "params": specs.iter().map(|s| serde_json::json!({"name": s.name, "shape": s.shape})).collect::<Vec<_>>(),
    })
    .to_string();
    std::fs::create_dir_all(dir).map_err(|e| io("create the directory", e))?;
    let tmp = std::path::Path::new(dir).join(format!(".{EXPORT_FILE}.tmp"));
    let mut file = std::fs::File::create(&tmp).map_err(|e| io("create", e))?;
    file.write_all(EXPORT_MAGIC).map_err(|e| io("write", e))?;
    file.write_all(&(header.len() as u32).to_le_bytes()).map_err(|e| io("write", e))?;
    file.write_all(header.as_bytes()).map_err(|e| io("write", e))?;
    file.write_all(&oar_transport::f32s_as_le_bytes(params.as_slice())).map_err(|e| io("write", e))?;
    file.sync_all().map_err(|e| io("sync", e))?;
    std::fs::rename(&tmp, std::path::Path::new(dir).join(EXPORT_FILE)).map_err(|e| io("rename", e))?;
    Ok(())
}

/// Why training looks diverged after `pass` (see the module docs), if it does.
fn diverged(pass: &PassReport, params: &ParamBuf, initial_loss: f32, config: &JobConfig) -> Option<String> {
    if pass.tasks_done == 0 {
        // Nothing trained in the pass: no loss to judge by.
        return None;
    }
    let n = pass.pass + 1;
    let what = if let Some(i) = params.as_slice().iter().position(|x| !x.is_finite()) {
        format!("parameter {i} is {}", params.as_slice()[i])
    } else if !pass.test_loss.is_finite() {
        // (Not the train loss: a pass whose tasks hold no example has none.
        // A trainer fails a task whose loss is not finite.)
        format!("the test loss is {}", pass.test_loss)
    } else if initial_loss.is_finite()
        && pass.test_loss > DIVERGED_FACTOR * initial_loss.max(f32::MIN_POSITIVE)
    {
        format!(
            "the test loss is {:.4e}, {DIVERGED_FACTOR}x more than the initial model's {initial_loss:.4}",
            pass.test_loss
        )
    } else {
        return None;
    };
    Some(format!(
        "training diverged in pass {n}: {what}; the learning rate ({}) is likely too high",
        learning_rate(&config.optimizer)
    ))
}

/// The learning rate of a built-in optimizer.
fn learning_rate(optimizer: &OptimizerConfig) -> f32 {
    match *optimizer {
        OptimizerConfig::Sgd { lr }
        | OptimizerConfig::Momentum { lr, .. }
        | OptimizerConfig::AdaGrad { lr, .. }
        | OptimizerConfig::Adam { lr, .. } => lr,
    }
}

/// Why a job failed that this master did not abort: aborted by the master
/// before it (the reason is in the discarded tasks), or a pass ended with
/// every task discarded.
fn failure_reason(status: &MasterStatus, config: &JobConfig) -> String {
    const ABORTED: &str = "the job was aborted: ";
    if status.queue.state == JobState::Aborted {
        let why = status.discarded.iter().find_map(|(_, why)| why.strip_prefix(ABORTED));
        return why.unwrap_or("the job was aborted").to_string();
    }
    let pass = status.queue.pass + 1;
    let Some((task, why)) = status.discarded.first() else {
        return format!("every task of pass {pass} was discarded");
    };
    let hint = match why.contains("bad data") && !config.skip_bad_lines {
        true => "; to skip bad lines and train on the rest, set skip_bad_lines (--skip-bad-lines)",
        false => "",
    };
    format!(
        "every task of pass {pass} was discarded ({} in all); task {task}: {why}{hint}",
        status.queue.discarded
    )
}

fn pass_report(pass: u32, status: &MasterStatus, eval: &Evaluation) -> PassReport {
    let stats = status.passes.get(pass as usize).copied().unwrap_or_default();
    PassReport {
        pass,
        train_loss: stats.mean_loss(),
        test_loss: eval.loss,
        test_accuracy: eval.accuracy,
        tasks_done: stats.tasks_finished,
        tasks_discarded: status.queue.discarded,
    }
}

/// `run`, unless the shard coordinator stops first (it lost its fence, or
/// met an error that trying again cannot mend): that error then.
async fn while_coordinating<T>(
    coordinator: &mut Coordinator,
    run: impl std::future::Future<Output = T>,
) -> std::result::Result<T, oar_pserver::ServiceError> {
    tokio::select! {
        out = run => Ok(out),
        stopped = coordinator.stopped() => Err(stopped),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StreamSource;
    use oar_discovery::{Discovery, MemDiscovery};
    use oar_trainer::ModelConfig;

    const MODEL: ModelConfig = ModelConfig::Softmax { features: 4, classes: 2 };

    /// Publishes `config` as job `job`'s master does.
    async fn publish(discovery: &MemDiscovery, job: &str, config: &JobConfig) {
        let key = JobKeys::new(job).unwrap().config();
        discovery.put(&key, config.encode().unwrap(), None).await.unwrap();
    }

    async fn close_key_set(discovery: &MemDiscovery, job: &str) -> bool {
        discovery.get(&JobKeys::new(job).unwrap().stream_close()).await.unwrap().is_some()
    }

    /// Only a streaming job that has not ended is closed: a close key left
    /// under another name would close a later stream of that name at once.
    #[tokio::test]
    async fn close_stream_refuses_what_is_not_a_running_stream_and_writes_nothing() {
        let discovery = MemDiscovery::new();
        publish(&discovery, "batch", &JobConfig::new("data/*.libsvm", MODEL)).await;
        publish(&discovery, "stream", &JobConfig::streaming(StreamSource::dir("/data/in"), MODEL)).await;
        publish(&discovery, "ended", &JobConfig::streaming(StreamSource::dir("/data/in"), MODEL)).await;
        let report = JobReport {
            state: JobEnd::Done,
            reason: None,
            passes: 1,
            final_loss: 0.5,
            train_accuracy: f32::NAN,
            test_accuracy: f32::NAN,
            examples_per_second: 1.0,
            tasks_done: 1,
            tasks_failed: 0,
            tasks_discarded: 0,
            discarded: Vec::new(),
            skipped_lines: 0,
            wall_seconds: 1.0,
        };
        let result = JobKeys::new("ended").unwrap().result();
        discovery.put(&result, report.to_json().into_bytes(), None).await.unwrap();

        for (job, why) in [
            ("strem", "no master has published the job's options"),
            ("batch", "it is a batch job (data \"data/*.libsvm\")"),
            ("ended", "it has already ended (done)"),
        ] {
            let err = close_stream(&discovery, job).await.unwrap_err();
            assert!(matches!(err, Error::CannotCloseStream { .. }), "{job}: {err:?}");
            let msg = err.to_string();
            assert!(msg.contains(&format!("job {job:?}")) && msg.contains(why), "{job}: {msg}");
            assert!(!close_key_set(&discovery, job).await, "{job}: the close key was written");
        }
        close_stream(&discovery, "stream").await.unwrap();
        assert!(close_key_set(&discovery, "stream").await);
        close_stream(&discovery, "stream").await.expect("closing twice is harmless");
    }
}
