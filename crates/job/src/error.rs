//! The crate's error type.

/// Everything that can go wrong running a job's roles; each message names
/// what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An invalid job option or role option, named.
    #[error("bad config: {0}")]
    BadConfig(String),
    /// A value stored under a job key that does not decode.
    #[error("{key} holds no valid {what}: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// What it should hold.
        what: &'static str,
        /// Why it does not decode.
        reason: String,
    },
    /// From the trainer: the model, the readers, the loop.
    #[error(transparent)]
    Trainer(#[from] oar_trainer::Error),
    /// From the master service or its client.
    #[error(transparent)]
    TaskQueue(#[from] oar_task_queue::Error),
    /// From the pserver service or its client.
    #[error(transparent)]
    Pserver(#[from] oar_pserver::ServiceError),
    /// A discovery operation failed.
    #[error(transparent)]
    Discovery(#[from] oar_discovery::Error),
    /// Building the transport failed (certificates, sockets).
    #[error(transparent)]
    Transport(#[from] oar_transport::Error),
    /// A wait at start-up ran out of time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        after: std::time::Duration,
    },
    /// A trainer id already registered by a live trainer.
    #[error("trainer id {0:?} is held by another live trainer")]
    TrainerIdTaken(String),
    /// The job had already ended when this process joined it.
    #[error("job {job:?} is over ({state}); to train again, use a new job name or delete its keys")]
    JobOver {
        /// The job.
        job: String,
        /// How it ended.
        state: crate::report::JobEnd,
    },
    /// A close of a stream that is not one to close (no such job, a batch
    /// job, or one that ended): nothing was written.
    #[error("cannot close the stream of job {job:?}: {why}")]
    CannotCloseStream {
        /// The job named.
        job: String,
        /// Why not.
        why: String,
    },
    /// The run was stopped by its shutdown signal before the job ended.
    #[error("shut down before the job ended")]
    ShutDown,
    /// A role stopped serving (a lost lease: the job has given it up).
    #[error("stopped: {0}")]
    Stopped(String),
    /// A task of the runner panicked (a bug; the message says where).
    #[error("internal error: {0}")]
    Panicked(String),
}

impl From<oar_pserver::Error> for Error {
    fn from(e: oar_pserver::Error) -> Self {
        Error::Pserver(e.into())
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
