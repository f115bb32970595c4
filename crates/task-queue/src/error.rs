//! The crate's one error type.

/// Everything `oar-task-queue` can fail with; each message names what was wrong
/// (which file and byte offset, which task, which config field, expected vs got).
///
/// Marked `#[non_exhaustive]` so that the master service can add its own
/// variants (transport, discovery) without breaking matches downstream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A [`QueueConfig`](crate::QueueConfig) field out of range.
    #[error("invalid queue config: {0}")]
    BadConfig(String),
    /// A bad argument to a dataset function (for instance a chunk size of 0).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A task queue was built from an empty task list.
    #[error("no tasks: a task queue needs at least one task")]
    NoTasks,
    /// Two tasks share one id.
    #[error("duplicate task id {0}")]
    DuplicateTask(u64),
    /// A chunk whose byte range is reversed.
    #[error("bad chunk {path:?}: start {start} is past end {end}")]
    BadChunk {
        /// The chunk's file.
        path: String,
        /// Its first byte.
        start: u64,
        /// One past its last byte.
        end: u64,
    },
    /// A glob pattern that does not parse.
    #[error("invalid glob pattern {pattern:?}: {reason}")]
    BadPattern {
        /// The pattern as given.
        pattern: String,
        /// What the glob parser objected to.
        reason: String,
    },
    /// A glob pattern that matches no regular file.
    #[error("glob pattern {pattern:?} matches no file")]
    NoMatch {
        /// The pattern as given.
        pattern: String,
    },
    /// A dataset path that is not valid UTF-8 (chunks name their file as a `String`).
    #[error("path {0:?} is not valid UTF-8")]
    NonUtf8Path(String),
    /// An I/O error on a named file.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file the operation was on.
        path: String,
        /// What was being done ("open", "read", "seek", "stat").
        op: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A line that is not valid UTF-8.
    #[error("{path}: invalid UTF-8 at byte offset {offset} (in the line starting at byte {line_start})")]
    InvalidUtf8 {
        /// The file holding the line.
        path: String,
        /// Byte offset of the first invalid byte in the file.
        offset: u64,
        /// Byte offset at which the line starts.
        line_start: u64,
    },
    /// A line longer than [`MAX_LINE_BYTES`](crate::MAX_LINE_BYTES): no
    /// record of a line format, more likely a file that is not line data.
    #[error("{path}: the line starting at byte {offset} is longer than {max} bytes; not line data?")]
    LineTooLong {
        /// The file holding the line.
        path: String,
        /// Byte offset at which the line starts.
        offset: u64,
        /// The longest line read.
        max: usize,
    },
    /// An offset beyond the end of a file (in [`line_number_at`](crate::line_number_at)).
    #[error("{path}: byte offset {offset} is past the end of the file ({len} bytes)")]
    OffsetPastEnd {
        /// The file.
        path: String,
        /// The offset asked for.
        offset: u64,
        /// The file's length.
        len: u64,
    },
    /// A snapshot that cannot be decoded or is inconsistent, or that does not fit the config.
    #[error("bad task-queue snapshot: {0}")]
    BadSnapshot(String),
    /// No master has published its address (none is running, or it is restarting).
    #[error("no master: {key} is not set")]
    NoMaster {
        /// The discovery key read.
        key: String,
    },
    /// The job's published options differ from the ones this master was given.
    #[error("{key} holds different job options than this master was given: run the job with the options it started with, or use a new job name")]
    ConfigMismatch {
        /// The discovery key holding the published options.
        key: String,
    },
    /// The master's state (or a journal record) is larger than it may
    /// write: etcd would refuse it.
    #[error(
        "the master's state for {key} is {bytes} bytes, over its limit of {max} \
         (MasterOptions::max_state_bytes, by default the discovery backend's: etcd's \
         --max-request-bytes, 1.5 MiB by default): make fewer, larger tasks, or raise etcd's \
         limit and EtcdOptions::max_request_bytes together"
    )]
    StateTooLarge {
        /// The key it was to be written under.
        key: String,
        /// Its encoded size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// The master stopped serving (lost its lease or its lock).
    #[error("master stopped: {0}")]
    Stopped(String),
    /// A discovery operation failed.
    #[cfg(feature = "service")]
    #[error(transparent)]
    Discovery(#[from] oar_discovery::Error),
    /// A call failed.
    #[cfg(feature = "service")]
    #[error(transparent)]
    Transport(#[from] oar_transport::Error),
    /// A streaming data source that cannot go on from the mark given (its
    /// file replaced, truncated or rewritten, or a mark it did not return);
    /// the message names the source and the byte offset.
    #[error("{0}")]
    Source(String),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// [`Error::InvalidUtf8`] for the line of `path` starting at byte
    /// `line_start`, whose bytes failed as `e` says.
    pub fn invalid_utf8(path: &str, line_start: u64, e: &std::str::Utf8Error) -> Error {
        Error::InvalidUtf8 { path: path.to_string(), offset: line_start + e.valid_up_to() as u64, line_start }
    }

    /// Wraps an I/O error with the file and the operation.
    pub(crate) fn io<'a>(path: &'a str, op: &'static str) -> impl FnOnce(std::io::Error) -> Error + 'a {
        move |source| Error::Io { path: path.to_string(), op, source }
    }
}

#[cfg(feature = "service")]
impl oar_transport::Transient for Error {
    fn is_transient(&self) -> bool {
        match self {
            Error::Transport(e) => e.is_transient(),
            Error::NoMaster { .. } => true,
            Error::Discovery(e) => e.is_transient(),
            _ => false,
        }
    }
}
