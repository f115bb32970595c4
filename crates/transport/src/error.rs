use std::time::Duration;

/// Result of transport operations.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong with a call or an endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// The bytes do not start with the frame magic: not an oar peer, or a corrupted stream.
    #[error("not an oar frame: magic {got:02x?}, expected {expected:02x?}")]
    BadMagic {
        /// The magic this side expects.
        expected: [u8; 4],
        /// The first four bytes received.
        got: [u8; 4],
    },
    /// The peer speaks another version of the wire protocol.
    #[error(
        "wire protocol version mismatch: this side speaks version {ours}, the peer sent version {theirs}"
    )]
    VersionMismatch {
        /// The version this build speaks.
        ours: u16,
        /// The version in the received header.
        theirs: u16,
    },
    /// A frame of a kind that does not belong here (unknown, or a request where a response was due).
    #[error("frame kind {got} where {expected} was expected")]
    BadKind {
        /// What was acceptable here.
        expected: &'static str,
        /// The kind byte received.
        got: u8,
    },
    /// A header's flags byte held a reserved bit, or a reply carried a request's flag.
    #[error("frame header flags {got:#04x}, expected 0 (or 0x01, keep the stream, on a request)")]
    BadFlags {
        /// The flags byte received.
        got: u8,
    },
    /// A frame whose declared size exceeds the configured maximum; refused before allocating.
    #[error("frame declares {claimed} bytes ({meta} metadata + {payload} payload), more than the maximum of {max}")]
    TooLarge {
        /// Metadata bytes declared.
        meta: u64,
        /// Payload bytes declared.
        payload: u64,
        /// Total declared (saturating).
        claimed: u64,
        /// The configured maximum message size.
        max: u64,
    },
    /// The stream ended before the frame was complete.
    #[error("frame truncated in its {part}: expected {expected} bytes, got {got}")]
    Truncated {
        /// "header", "metadata" or "payload".
        part: &'static str,
        /// Bytes the header declared (or the header's size).
        expected: u64,
        /// Bytes received before the end.
        got: u64,
    },
    /// A buffer of the declared (allowed) size could not be allocated.
    #[error("cannot allocate {bytes} bytes for a frame")]
    OutOfMemory {
        /// The size asked for.
        bytes: u64,
    },
    /// More bytes followed a complete frame on a stream that carries exactly one.
    #[error("{extra} unexpected bytes after a complete frame")]
    TrailingData {
        /// How many extra bytes arrived (at least).
        extra: u64,
    },
    /// A stream sent nothing for too long (a stalled or malicious peer).
    #[error("stream from {addr} sent nothing for {after:?}")]
    Stalled {
        /// The peer's address.
        addr: String,
        /// The per-stream idle deadline that expired.
        after: std::time::Duration,
    },
    /// The TLS handshake failed: a certificate the job's CA did not sign, or none.
    #[error("TLS handshake with {addr} refused: {reason}")]
    Refused {
        /// The peer's address.
        addr: String,
        /// What TLS said.
        reason: String,
    },
    /// Certificates, keys or TLS settings that cannot be used.
    #[error("TLS configuration: {0}")]
    Tls(String),
    /// A socket or file operation failed.
    #[error("cannot {what}: {source}")]
    Io {
        /// What was being done (which file, which address).
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The peer broke the QUIC protocol or the connection failed for a reason not covered above.
    #[error("connection to {addr} failed: {reason}")]
    Protocol {
        /// The peer's address.
        addr: String,
        /// What quinn reported.
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
            Error::Codec { .. }
            | Error::PayloadLength { .. }
            | Error::BadMagic { .. }
            | Error::VersionMismatch { .. }
            | Error::BadKind { .. }
            | Error::BadFlags { .. }
            | Error::TooLarge { .. }
            | Error::Truncated { .. }
            | Error::TrailingData { .. }
            | Error::Stalled { .. } => RemoteError::bad_request(e),
            other => RemoteError::internal(other),
        }
    }
}

impl Error {
    /// A short name of the error's kind, for metrics (`oar_transport_errors_total{kind}`).
    pub fn kind_name(&self) -> &'static str {
        match self {
            Error::Unreachable { .. } => "unreachable",
            Error::Timeout { .. } => "timeout",
            Error::Closed { .. } => "closed",
            Error::Remote { error, .. } => match error.kind {
                RemoteErrorKind::BadRequest => "remote_bad_request",
                RemoteErrorKind::Unavailable => "remote_unavailable",
                RemoteErrorKind::Internal => "remote_internal",
            },
            Error::Stalled { .. } => "stalled",
            Error::Refused { .. } => "refused",
            Error::AddrInUse(_) | Error::InvalidAddress { .. } => "address",
            _ => "bad_frame",
        }
    }
}
