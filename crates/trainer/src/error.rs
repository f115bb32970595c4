//! The crate's error type.

/// Everything that can go wrong in `oar-trainer`; each message names what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A data line that does not parse; `line` is 1-based (0 if it could not be determined).
    #[error("{path}:{line}: {reason}")]
    BadLine {
        /// The file holding the line.
        path: String,
        /// 1-based line number.
        line: u64,
        /// What was wrong with the line, naming the bad token.
        reason: String,
    },
    /// An invalid model, reader or generator configuration.
    #[error("bad config: {0}")]
    BadConfig(String),
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory the operation was on.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An error from reading a dataset chunk (or expanding a glob) through `oar-task-queue`.
    #[error("reading chunk: {0}")]
    Chunk(String),
    /// From `oar-task-queue`: master calls, the task queue.
    #[error(transparent)]
    TaskQueue(#[from] oar_task_queue::Error),
    /// The pservers' side: placement, optimizer, pserver calls.
    #[cfg(feature = "worker")]
    #[error(transparent)]
    Pserver(#[from] oar_pserver::ServiceError),
    /// This trainer's lease is gone: the job has given it up.
    #[error("the trainer's lease is lost; the master has taken its tasks back")]
    LeaseLost,
    /// A task of the runner panicked (a bug; the message says where).
    #[error("internal error: {0}")]
    Panicked(String),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(feature = "worker")]
impl From<oar_pserver::Error> for Error {
    fn from(e: oar_pserver::Error) -> Self {
        Error::Pserver(e.into())
    }
}
