//! A job's options: everything the master, the pservers and the trainers
//! must agree on, published once by the master under `/oar/<job>/config`.

use crate::{Error, Result};
use oar_pserver::{Mode, OptimizerConfig, Placement};
use oar_task_queue::QueueConfig;
use oar_trainer::{
    reader::{Format, ReaderOptions},
    AnyModel, ModelConfig,
};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The default number of logical shards: well above any pserver count a
/// job is likely to use, small enough that a shard's calls stay large.
pub const DEFAULT_SHARDS: u32 = 64;

/// The most logical shards a job may have. Every pserver keeps a slot per
/// shard and the shard map a row per shard, rewritten whole at each
/// change: far more shards than pservers cost at every map change and buy
/// nothing (a count of billions, a typo, made the master allocate tens of
/// GB and abort). 4,096 is far above any pserver count.
pub const MAX_SHARDS: u32 = 4096;

/// A streaming job's chunk size when `chunk_bytes` is 0: a stream's size
/// is not known up front, and small tasks keep the lag from arrival to
/// training short (64 KiB is about 1,000 a1a lines).
pub const STREAM_CHUNK_BYTES: u64 = 64 << 10;

/// The longest a streaming job's window or export interval may be (a
/// year): the master adds them to the clock, which a value near
/// `Duration::MAX` would overflow. A job that wants no export leaves
/// `export_dir` unset instead.
pub const MAX_STREAM_INTERVAL: Duration = Duration::from_secs(365 * 86_400);

/// Where a streaming job's data comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamSource {
    /// A directory that grows: each file renamed into place is trained
    /// once; names starting with `.` or ending in `.tmp` are being written.
    /// The file `closed_marker` appearing in it closes the stream.
    Dir {
        /// The directory.
        dir: String,
        /// The marker's name (`_CLOSED`).
        closed_marker: String,
    },
    /// An appended file, read by byte offset, whole lines only. The file
    /// `closed_marker` appearing closes the stream.
    File {
        /// The file.
        path: String,
        /// The marker's path (the file's path with `.closed` appended).
        closed_marker: String,
    },
}

impl StreamSource {
    /// A directory closed by `_CLOSED` in it.
    pub fn dir(dir: &str) -> Self {
        StreamSource::Dir {
            dir: dir.to_string(),
            closed_marker: oar_task_queue::source::DEFAULT_CLOSED_MARKER.into(),
        }
    }

    /// An appended file closed by `<path>.closed`.
    pub fn file(path: &str) -> Self {
        StreamSource::File { path: path.to_string(), closed_marker: format!("{path}.closed") }
    }

    /// The source, cutting data into chunks of `chunk_bytes`.
    pub fn open(&self, chunk_bytes: u64) -> Box<dyn oar_task_queue::source::TaskSource> {
        use oar_task_queue::source::{DirSource, DirSourceOptions, FileSource, FileSourceOptions};
        match self {
            StreamSource::Dir { dir, closed_marker } => Box::new(DirSource::new(DirSourceOptions {
                closed_marker: closed_marker.clone(),
                ..DirSourceOptions::new(dir, chunk_bytes)
            })),
            StreamSource::File { path, closed_marker } => Box::new(FileSource::new(FileSourceOptions {
                closed_marker: closed_marker.into(),
                ..FileSourceOptions::new(path, chunk_bytes)
            })),
        }
    }
}

/// A streaming job: where the data comes from, how often progress is
/// reported (and the test set scored), and where the model is exported.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamConfig {
    /// The source.
    pub source: StreamSource,
    /// Progress is reported, and the test set scored, every window (at
    /// most [`MAX_STREAM_INTERVAL`]).
    pub window: Duration,
    /// Export the model's dense parameters to this directory every
    /// `export_every`, written atomically (see [`crate::role::master`]).
    pub export_dir: Option<String>,
    /// How often the model is exported (at most [`MAX_STREAM_INTERVAL`]).
    pub export_every: Duration,
}

impl StreamConfig {
    /// `source`, windows of 10 s, no export.
    pub fn new(source: StreamSource) -> Self {
        Self {
            source,
            window: Duration::from_secs(10),
            export_dir: None,
            export_every: Duration::from_secs(60),
        }
    }
}

/// The options of one training job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobConfig {
    /// Training data: a glob of files (unused by a streaming job).
    pub data: String,
    /// Held-out data for evaluation, read whole by the master: a glob of
    /// files (none: evaluate on the training data, or on a sample of it,
    /// see [`crate::role::TRAIN_SAMPLE_BYTES`]).
    pub test_data: Option<String>,
    /// How lines are parsed.
    pub format: Format,
    /// Skip and count bad lines (that do not parse, or are not UTF-8)
    /// instead of failing their task.
    pub skip_bad_lines: bool,
    /// The model.
    pub model: ModelConfig,
    /// The update rule, run on the pservers.
    pub optimizer: OptimizerConfig,
    /// Sync barrier or async updates.
    pub mode: Mode,
    /// Passes over the data.
    pub passes: u32,
    /// Examples per mini-batch.
    pub batch_size: usize,
    /// Async: push the accumulated gradient every this many mini-batches
    /// (with overlap, a push due while one is in flight waits for it and
    /// carries the batches since; see `oar_trainer::worker`).
    pub push_every: u32,
    /// Async: pull the parameters every this many mini-batches.
    pub pull_every: u32,
    /// Async: let each exchange with the pservers travel while the next
    /// batches train (models up to `oar_trainer::worker::OVERLAP_MAX_BYTES`).
    /// Off, every exchange is waited for and the push and pull cadences hold
    /// exactly; with momentum, off trains a little better (each batch then
    /// trains on parameters one exchange fresher).
    pub overlap: bool,
    /// Number of pservers: the first shard map waits for this many.
    pub pservers: u32,
    /// Logical shards the model is cut into (fixed for the job's life;
    /// well above the pserver count, so shards can be spread and moved).
    pub shards: u32,
    /// Replicas of each shard, on distinct pservers (1: no replication;
    /// at most `pservers`).
    pub replicas: u32,
    /// Move replicas while the job runs so that every pserver kept holds
    /// its share: a pserver started mid-job (after a scale-out, or in
    /// place of one that died) takes shards over
    /// (`oar_pserver::ShardMap::rebalance`). On by default; off, only a
    /// scale-in (draining) moves replicas.
    pub rebalance: bool,
    /// Largest parameter block, in floats.
    pub block_size: usize,
    /// Bytes of data per chunk; 0 (the default) sizes chunks from the
    /// data with [`oar_task_queue::auto_chunk_bytes`]: about 32 per pass,
    /// 16 KiB to 8 MiB each.
    pub chunk_bytes: u64,
    /// Chunks per task.
    pub chunks_per_task: usize,
    /// A task not reported within this time goes back to todo.
    pub task_timeout: Duration,
    /// Failures after which a task is discarded for the pass.
    pub max_failures: u32,
    /// Seed of the initial parameters.
    pub seed: u64,
    /// A streaming job's source (then `data` is unused and `passes` must
    /// be 1: a stream has no passes, it runs until its source is closed).
    pub stream: Option<StreamConfig>,
}

impl JobConfig {
    /// Defaults for data at `data` and a model.
    pub fn new(data: &str, model: ModelConfig) -> Self {
        Self {
            data: data.to_string(),
            test_data: None,
            format: Format::Libsvm,
            skip_bad_lines: false,
            model,
            optimizer: OptimizerConfig::Sgd { lr: 0.1 },
            mode: Mode::Sync,
            passes: 5,
            batch_size: 64,
            push_every: 1,
            pull_every: 1,
            overlap: true,
            pservers: 2,
            shards: DEFAULT_SHARDS,
            replicas: 1,
            rebalance: true,
            block_size: 1 << 16,
            chunk_bytes: 0,
            chunks_per_task: 1,
            task_timeout: Duration::from_secs(60),
            max_failures: 3,
            seed: 1,
            stream: None,
        }
    }

    /// A streaming job on `source` (one "pass": the stream), with the
    /// defaults of [`new`](Self::new) otherwise.
    pub fn streaming(source: StreamSource, model: ModelConfig) -> Self {
        Self { passes: 1, stream: Some(StreamConfig::new(source)), ..Self::new("", model) }
    }

    /// The chunk size tasks are cut to: `chunk_bytes`, or when 0
    /// [`STREAM_CHUNK_BYTES`] for a stream (a fixed glob sizes it from the data).
    pub fn stream_chunk_bytes(&self) -> u64 {
        match self.chunk_bytes {
            0 => STREAM_CHUNK_BYTES,
            bytes => bytes,
        }
    }

    /// Check every option, naming the first that is wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::BadConfig(what.to_string()));
        match &self.stream {
            None if self.data.is_empty() => return bad("data: a glob of training files is required"),
            Some(_) if self.passes != 1 => {
                return bad("passes: a streaming job has no passes (it runs until its source is closed); passes must be 1")
            }
            Some(stream) if stream.window.is_zero() || stream.export_every.is_zero() => {
                return bad("stream: the window and the export interval must be positive")
            }
            Some(stream) if stream.window > MAX_STREAM_INTERVAL || stream.export_every > MAX_STREAM_INTERVAL => {
                return bad(&format!(
                    "stream: the window ({:?}) and the export interval ({:?}) must be at most {} days",
                    stream.window,
                    stream.export_every,
                    MAX_STREAM_INTERVAL.as_secs() / 86_400
                ))
            }
            _ => {}
        }
        if self.passes == 0 {
            return bad("passes must be at least 1");
        }
        if self.batch_size == 0 {
            return bad("batch size must be at least 1");
        }
        if self.push_every == 0 || self.pull_every == 0 {
            return bad("push-every and pull-every must be at least 1");
        }
        if self.mode == Mode::Sync && (self.push_every != 1 || self.pull_every != 1) {
            return bad("push-every and pull-every apply to async mode only; sync mode pushes and pulls every mini-batch");
        }
        if self.pservers == 0 {
            return bad("pservers must be at least 1");
        }
        if self.shards == 0 || self.shards > MAX_SHARDS {
            return bad(&format!("shards must be from 1 to {MAX_SHARDS}, got {}", self.shards));
        }
        if self.replicas == 0 || self.replicas > self.pservers {
            return bad(&format!(
                "replicas must be from 1 to the pserver count ({}), got {}",
                self.pservers, self.replicas
            ));
        }
        if self.chunks_per_task == 0 {
            return bad("chunks per task must be at least 1");
        }
        if self.task_timeout.is_zero() || self.max_failures == 0 {
            return bad("task timeout and max failures must be positive");
        }
        if matches!(self.model, ModelConfig::Ctr(_)) && (self.push_every != 1 || self.pull_every != 1) {
            return bad(
                "a sparse model (ctr) pushes and pulls every mini-batch: push-every and pull-every must be 1",
            );
        }
        self.model.build_any()?;
        self.optimizer.build()?;
        self.placement()?;
        Ok(())
    }

    /// How the data lines are read.
    pub fn reader(&self) -> ReaderOptions {
        ReaderOptions {
            format: self.format,
            features: self.model.features(),
            classes: self.model.classes(),
            skip_bad_lines: self.skip_bad_lines,
        }
    }

    /// The task queue's options.
    pub fn queue(&self) -> QueueConfig {
        QueueConfig { task_timeout: self.task_timeout, max_failures: self.max_failures, passes: self.passes }
    }

    /// Where each parameter block lives; the same on every process.
    pub fn placement(&self) -> Result<Placement> {
        self.placement_for(&self.model.build_any()?)
    }

    /// Where each parameter block and table row of `model` (the job's
    /// model or a plugin's) lives.
    pub fn placement_for(&self, model: &AnyModel) -> Result<Placement> {
        let placement = Placement::new(&model.param_specs(), self.shards, self.block_size)?;
        Ok(placement.with_tables(model.table_specs())?)
    }

    /// The options that differ between `self` (published) and `other`
    /// (given), as `name: published vs given`.
    pub fn differences(&self, other: &JobConfig) -> Vec<String> {
        let mut out = Vec::new();
        macro_rules! compare {
            ($($field:ident),*) => {
                // Naming every field here makes a new field a compile error until it is compared.
                let JobConfig { $($field),* } = self;
                $(if *$field != other.$field {
                    out.push(format!("{}: {:?} vs {:?}", stringify!($field), $field, other.$field));
                })*
            };
        }
        compare!(
            data,
            test_data,
            format,
            skip_bad_lines,
            model,
            optimizer,
            mode,
            passes,
            batch_size,
            push_every,
            pull_every,
            overlap,
            pservers,
            shards,
            replicas,
            rebalance,
            block_size,
            chunk_bytes,
            chunks_per_task,
            task_timeout,
            max_failures,
            seed,
            stream
        );
        out
    }

    /// Encoded for `/oar/<job>/config`.
    pub fn encode(&self) -> Result<Vec<u8>> {
        postcard::to_allocvec(self)
            .map_err(|e| Error::BadConfig(format!("cannot encode the job config: {e}")))
    }

    /// Decoded from `/oar/<job>/config`.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let config: Self = postcard::from_bytes(bytes)
            .map_err(|e| Error::BadConfig(format!("cannot decode the job config: {e}")))?;
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> JobConfig {
        JobConfig::new("data/*.libsvm", ModelConfig::Softmax { features: 4, classes: 2 })
    }

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = config();
        c.validate().unwrap();
        assert_eq!(JobConfig::decode(&c.encode().unwrap()).unwrap(), c);
    }

    #[test]
    fn each_bad_option_is_named() {
        type Change = fn(&mut JobConfig);
        let cases: [(Change, &str); 8] = [
            (|c| c.passes = 0, "passes"),
            (|c| c.batch_size = 0, "batch size"),
            (|c| c.push_every = 2, "async mode only"),
            (|c| c.pservers = 0, "pservers"),
            (|c| c.shards = 0, "shards must be from 1 to 4096, got 0"),
            (|c| c.shards = 4_000_000_000, "shards must be from 1 to 4096, got 4000000000"),
            (|c| c.replicas = 3, "replicas must be from 1 to the pserver count (2), got 3"),
            (|c| c.data.clear(), "data"),
        ];
        for (change, word) in cases {
            let mut c = config();
            change(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(word), "{err:?} should mention {word:?}");
        }
    }

    #[test]
    fn a_stream_interval_the_clock_cannot_hold_is_named() {
        let streaming = |change: fn(&mut StreamConfig)| {
            let mut c = JobConfig::streaming(StreamSource::dir("in"), config().model);
            c.stream.iter_mut().for_each(change);
            c
        };
        streaming(|s| s.window = MAX_STREAM_INTERVAL).validate().unwrap();
        let err = streaming(|s| s.window = Duration::MAX).validate().unwrap_err().to_string();
        assert!(err.contains("window") && err.contains("365 days"), "{err}");
        let c = streaming(|s| s.export_every = MAX_STREAM_INTERVAL + Duration::from_secs(1));
        assert!(c.validate().unwrap_err().to_string().contains("export interval"));
    }

    #[test]
    fn differences_name_the_options() {
        let mut other = config();
        assert!(config().differences(&other).is_empty());
        other.passes = 9;
        other.seed = 4;
        assert_eq!(
            config().differences(&other),
            vec!["passes: 5 vs 9".to_string(), "seed: 1 vs 4".to_string()]
        );
    }

    #[test]
    fn garbage_config_bytes_are_an_error() {
        assert!(JobConfig::decode(&[0xff; 7]).is_err());
    }
}
