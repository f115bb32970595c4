use std::time::Duration;

/// Result of transport operations.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong with a call or an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Nothing listens at the address (or the peer is down).
    #[error("no endpoint at {addr}")]
    Unreachable {
        /// The address called.
        addr: String,
    },
    /// The peer did not answer within the call's timeout.
    #[error("call to {addr} timed out after {after:?}")]
    Timeout {
        /// The address called.
        addr: String,
        /// The timeout that expired.
        after: Duration,
    },
    /// The peer went away while the call was in flight.
    #[error("connection to {addr} closed during the call")]
    Closed {
        /// The address called.
        addr: String,
    },
    /// The peer answered with an error.
    #[error("{addr} refused the call: {error}")]
    Remote {
        /// The address called.
        addr: String,
        /// What the peer said.
        error: RemoteError,
    },
    /// Metadata could not be encoded or decoded.
    #[error("cannot {action} {what}: {reason}")]
    Codec {
        /// "encode" or "decode".
        action: &'static str,
        /// The type or part of the message.
        what: &'static str,
        /// The codec's explanation.
        reason: String,
    },
    /// A tensor payload whose length does not fit the expected floats.
    #[error("payload of {got} bytes, expected {expected}")]
    PayloadLength {
        /// Bytes expected (a multiple of 4).
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// The address is already served by another listener.
    #[error("address {0} is already in use")]
    AddrInUse(String),
    /// The address cannot be parsed for this transport.
    #[error("invalid address {addr:?}: {reason}")]
    InvalidAddress {
        /// The address given.
        addr: String,
        /// Why it is not valid.
        reason: String,
    },
}

/// The kind of failure a handler reports to its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RemoteErrorKind {
    /// The request was malformed or invalid; retrying it unchanged will fail again.
    BadRequest,
    /// The server cannot serve now (starting, stopping, lost its lease); retry later.
    Unavailable,
    /// The server failed for its own reasons.
    Internal,
}

/// An error a [`crate::Handler`] returns instead of a response.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct RemoteError {
    /// The kind, which tells the caller whether to retry.
    pub kind: RemoteErrorKind,
    /// What was wrong, for people.
    pub message: String,
}

impl RemoteError {
    /// A request the server will never accept.
    pub fn bad_request(message: impl std::fmt::Display) -> Self {
        Self { kind: RemoteErrorKind::BadRequest, message: message.to_string() }
    }
    /// The server cannot serve right now.
    pub fn unavailable(message: impl std::fmt::Display) -> Self {
        Self { kind: RemoteErrorKind::Unavailable, message: message.to_string() }
    }
    /// The server failed.
    pub fn internal(message: impl std::fmt::Display) -> Self {
        Self { kind: RemoteErrorKind::Internal, message: message.to_string() }
    }
}

impl From<Error> for RemoteError {
    /// A transport error while decoding a request is the caller's fault.
    fn from(e: Error) -> Self {
        match e {
            Error::Codec { .. } | Error::PayloadLength { .. } => RemoteError::bad_request(e),
            other => RemoteError::internal(other),
        }
    }
}
