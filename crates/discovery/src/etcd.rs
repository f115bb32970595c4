//! `EtcdDiscovery`: the [`Discovery`] trait on a real etcd cluster (v3 API,
//! through `etcd-client`).
//!
//! Every operation is one etcd request (two for a `delete_fenced` of a
//! missing key, and a watch from a past revision, which first checks that the
//! revision is not compacted), bounded by [`EtcdOptions::request_timeout`]:
//! an etcd that is down or hung gives [`Error::Timeout`] or
//! [`Error::Backend`] (both [`Error::is_transient`]), never a hang.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, CompactionOptions, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, KvClient,
    LeaseClient, PutOptions, Txn, TxnOp, TxnResponse, WatchClient, WatchOptions,
};
use tokio::sync::mpsc;

use crate::{
    check_key, Discovery, Error, Fence, KeyValue, LeaseId, Listing, Result, Revision, WatchEvent, WatchStream,
};

/// Default bound on establishing the connection in [`EtcdDiscovery::connect`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound on every etcd request.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest etcd answer accepted (a prefix listing or a batch of watch
/// events); tonic's default of 4 MiB is too small for big listings.
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;
/// Events buffered per watch before its task waits for the reader.
const WATCH_CHANNEL: usize = 64;
/// gRPC status codes (fixed by the gRPC spec) that etcd answers with.
mod code {
    pub const CANCELLED: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const NOT_FOUND: i32 = 5;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const ABORTED: i32 = 10;
    pub const OUT_OF_RANGE: i32 = 11;
    pub const INTERNAL: i32 = 13;
    pub const UNAVAILABLE: i32 = 14;
}

/// Timeouts of an [`EtcdDiscovery`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// Bound on connecting and on the first request that proves etcd answers.
    pub connect_timeout: Duration,
    /// Bound on every request (a watch's creation, not its lifetime).
    pub request_timeout: Duration,
    /// How often an HTTP/2 ping checks a connection that has a request or a
    /// watch open, so that a watch on a vanished server ends. etcd refuses
    /// pings more often than every 5 s (`--grpc-keepalive-min-time`).
    pub keep_alive_interval: Duration,
    /// How long a ping may go unanswered before the connection counts as dead.
    pub keep_alive_timeout: Duration,
    /// The server's request limit (`--max-request-bytes`, etcd's default
    /// 1.5 MiB): what [`Discovery::max_value_bytes`] derives from. Set it
    /// when the server's is set.
    pub max_request_bytes: usize,
}

/// etcd's default request limit (`--max-request-bytes`), 1.5 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 3 << 19;

/// Room left in a request for what is not the value: the key, a fenced
/// write's comparison, the message framing.
const REQUEST_OVERHEAD_BYTES: usize = 4096;

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
        }
    }
}

impl EtcdOptions {
    /// These options with another [`EtcdOptions::connect_timeout`].
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// These options with another [`EtcdOptions::request_timeout`].
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// These options with another HTTP/2 keep-alive interval and timeout.
    pub fn with_keep_alive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keep_alive_interval = interval;
        self.keep_alive_timeout = timeout;
        self
    }

    /// These options with another [`EtcdOptions::max_request_bytes`].
    pub fn with_max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes;
        self
    }
}

/// [`Discovery`] on an etcd cluster (etcd 3.4 or later).
///
/// Clones share one connection. Lease ttls are rounded up to whole seconds
/// (etcd's unit), and etcd raises them to its minimum ttl (about 2 s with
/// default server settings). A watch is one etcd watch on its own gRPC
/// stream, fed by a task; dropping the [`WatchStream`] cancels it on the
/// server. When the etcd watch ends (the server went away, or cancelled it)
/// the stream delivers one error and ends: watch again from the revision
/// after the last event seen.
///
/// ```
/// use oar_discovery::{Discovery, EtcdDiscovery, EtcdServer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> oar_discovery::Result<()> {
/// let server = EtcdServer::start()?; // a throwaway local etcd, for the example
/// let d = EtcdDiscovery::connect(&[server.endpoint()]).await?;
/// let revision = d.put("/oar/job/ps_desired", b"2".to_vec(), None).await?;
/// let kv = d.get("/oar/job/ps_desired").await?.expect("just written");
/// assert_eq!((kv.value, kv.mod_revision), (b"2".to_vec(), revision));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdDiscovery {
    /// Kept so that the connection's endpoint set stays managed.
    client: Client,
    kv: KvClient,
    watch: WatchClient,
    /// The endpoints, joined, for error messages.
    endpoints: Arc<str>,
    options: EtcdOptions,
}

impl fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.endpoints)
            .field("options", &self.options)
            .finish()
    }
}

/// What a request was doing, for error messages.
struct Op<'a> {
    verb: &'static str,
    key: &'a str,
    lease: Option<LeaseId>,
}

impl fmt::Display for Op<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.verb)?;
        if !self.key.is_empty() {
            write!(f, " {:?}", self.key)?;
        }
        if let Some(lease) = self.lease {
            write!(f, " (lease {lease})")?;
        }
        Ok(())
    }
}

fn op<'a>(verb: &'static str, key: &'a str, lease: Option<LeaseId>) -> Op<'a> {
    Op { verb, key, lease }
}

impl EtcdDiscovery {
    /// Connects to the etcd cluster at `endpoints` (`host:port` or
    /// `http://host:port`) with the default [`EtcdOptions`], and checks that
    /// it answers.
    pub async fn connect(endpoints: &[String]) -> Result<Self> {
        Self::connect_with(endpoints, EtcdOptions::default()).await
    }

    /// Connects with `options`; the connection and a first read must succeed
    /// within `options.connect_timeout`, or the error names the endpoints.
    pub async fn connect_with(endpoints: &[String], options: EtcdOptions) -> Result<Self> {
        if endpoints.is_empty() {
            return Err(Error::InvalidArgument("no etcd endpoints given".to_string()));
        }
        let joined: Arc<str> = endpoints.join(",").into();
        // Require a leader: a member cut off from its cluster's majority
        // otherwise keeps a watch open and silent (its HTTP/2 pings still
        // answer), and a watcher of departures or of the shard map sees
        // nothing until the partition heals; with it, etcd ends the watch
        // with an error and the watcher watches again.
        // Not covered by a test: it takes a cluster of three members, and
        // the tests' `EtcdServer` starts one.
        let connect_options = ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            .with_keep_alive(options.keep_alive_interval, options.keep_alive_timeout)
            .with_require_leader(true);
        let timeout = options.connect_timeout;
        let unreachable = |why: String| match why.is_empty() {
            true => Error::Timeout { what: format!("connecting to etcd at {joined}"), after: timeout },
            false => Error::Backend(format!("cannot connect to etcd at {joined}: {why}")),
        };
        let connected = tokio::time::timeout(timeout, async {
            let client = Client::connect(endpoints, Some(connect_options)).await?;
            // The connection is lazy: a read proves that etcd answers (and has a leader).
            let mut kv = client.kv_client();
            kv.get("health", Some(GetOptions::new().with_count_only())).await?;
            Ok::<_, etcd_client::Error>(client)
        })
        .await;
        let client = match connected {
            Err(_) => return Err(unreachable(String::new())),
            Ok(Err(etcd_client::Error::InvalidArgs(why))) => {
                return Err(Error::InvalidArgument(format!("etcd endpoints {joined}: {why}")))
            }
            Ok(Err(etcd_client::Error::InvalidUri(why))) => {
                return Err(Error::InvalidArgument(format!("etcd endpoints {joined}: {why}")))
            }
            Ok(Err(e)) => return Err(unreachable(e.to_string())),
            Ok(Ok(client)) => client,
        };
        let kv = client.kv_client().max_decoding_message_size(MAX_RESPONSE_BYTES);
        let watch = client.watch_client().max_decoding_message_size(MAX_RESPONSE_BYTES);
        Ok(EtcdDiscovery { client, kv, watch, endpoints: joined, options })
    }

    /// The endpoints this client talks to, comma-separated.
    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// The options in force.
    pub fn options(&self) -> &EtcdOptions {
        &self.options
    }

    /// Drops etcd's history before `revision` (etcd's compaction), so that it
    /// stops growing; watches that start earlier then fail with
    /// [`Error::Compacted`]. A revision already compacted or not yet written
    /// is [`Error::InvalidArgument`].
    pub async fn compact(&self, revision: Revision) -> Result<()> {
        let mut kv = self.kv.clone();
        let what = op("compact history up to revision", "", None);
        self.call(&what, kv.compact(revision, Some(CompactionOptions::new().with_physical()))).await?;
        Ok(())
    }

    fn lease_client(&self) -> LeaseClient {
        self.client.lease_client()
    }

    /// Runs one etcd request under the request timeout, mapping its failure.
    async fn call<T>(
        &self,
        what: &Op<'_>,
        request: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.options.request_timeout, request).await {
            Err(_) => Err(Error::Timeout {
                what: format!("etcd {what} at {}", self.endpoints),
                after: self.options.request_timeout,
            }),
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(self.map_error(what, e)),
        }
    }

    /// Maps an etcd-client failure: unreachable or overloaded servers are
    /// transient ([`Error::Backend`]), refusals are not.
    fn map_error(&self, what: &Op<'_>, e: etcd_client::Error) -> Error {
        use etcd_client::Error as E;
        let endpoints = &self.endpoints;
        match e {
            E::GRpcStatus(status) => {
                let message = status.message();
                match status.code() as i32 {
                    code::NOT_FOUND if message.contains("lease not found") => match what.lease {
                        Some(lease) => Error::LeaseNotFound(lease),
                        None => Error::Refused(format!("etcd {what}: {message}")),
                    },
                    code::CANCELLED
                    | code::UNKNOWN
                    | code::DEADLINE_EXCEEDED
                    | code::RESOURCE_EXHAUSTED
                    | code::ABORTED
                    | code::INTERNAL
                    | code::UNAVAILABLE => Error::Backend(format!(
                        "etcd {what} at {endpoints} failed: {:?}: {message}",
                        status.code()
                    )),
                    code::INVALID_ARGUMENT | code::OUT_OF_RANGE => {
                        Error::InvalidArgument(format!("etcd {what}: {message}"))
                    }
                    _ => {
                        Error::Refused(format!("etcd {what} at {endpoints}: {:?}: {message}", status.code()))
                    }
                }
            }
            E::LeaseKeepAliveError(message) if message == "lease not found" => match what.lease {
                Some(lease) => Error::LeaseNotFound(lease),
                None => Error::Refused(format!("etcd {what}: {message}")),
            },
            E::InvalidArgs(message) => Error::InvalidArgument(format!("etcd {what}: {message}")),
            E::Utf8Error(e) => Error::Unexpected(format!("etcd {what}: {e}")),
            other => Error::Backend(format!("etcd {what} at {endpoints} failed: {other}")),
        }
    }

    /// The store revision a response was answered at.
    fn revision_of(&self, what: &Op<'_>, header: Option<&etcd_client::ResponseHeader>) -> Result<Revision> {
        match header {
            Some(header) => Ok(header.revision()),
            None => Err(Error::Unexpected(format!("etcd answered {what} without a response header"))),
        }
    }

    /// Fails with [`Error::Compacted`] if a watch just created from
    /// `from_revision` is for compacted history. etcd says so on the watch
    /// only some time after creating it; a read at that revision tells at
    /// once, and the watch's cancellation then names the oldest revision kept.
    async fn check_not_compacted(
        &self,
        what: &Op<'_>,
        prefix: &str,
        from_revision: Revision,
        stream: &mut etcd_client::WatchStream,
    ) -> Result<()> {
        let check = op("read for the watch of prefix", prefix, None);
        let mut kv = self.kv.clone();
        let at = GetOptions::new().with_prefix().with_revision(from_revision).with_count_only();
        match tokio::time::timeout(self.options.request_timeout, kv.get(prefix, Some(at))).await {
            Err(_) => Err(Error::Timeout {
                what: format!("etcd {check} at {}", self.endpoints),
                after: self.options.request_timeout,
            }),
            Ok(Ok(_)) => Ok(()),
            // Watching from a revision not yet written is fine.
            Ok(Err(etcd_client::Error::GRpcStatus(status)))
                if status.message().contains("future revision") =>
            {
                Ok(())
            }
            Ok(Err(etcd_client::Error::GRpcStatus(status))) if status.message().contains("compacted") => {
                loop {
                    match self.call(what, stream.message()).await? {
                        Some(answer) if answer.compact_revision() > 0 => {
                            return Err(Error::Compacted {
                                requested: from_revision,
                                oldest: answer.compact_revision(),
                            })
                        }
                        Some(_) => {}
                        None => {
                            return Err(Error::Backend(format!(
                                "etcd at {} ended {what} from compacted revision {from_revision}",
                                self.endpoints
                            )))
                        }
                    }
                }
            }
            Ok(Err(e)) => Err(self.map_error(&check, e)),
        }
    }

    async fn txn(&self, what: &Op<'_>, txn: Txn) -> Result<TxnResponse> {
        let mut kv = self.kv.clone();
        self.call(what, kv.txn(txn)).await
    }
}

/// Converts one key-value from etcd.
fn key_value(kv: etcd_client::KeyValue) -> Result<KeyValue> {
    let (create_revision, mod_revision, lease) = (kv.create_revision(), kv.mod_revision(), kv.lease());
    let (key, value) = kv.into_key_value();
    Ok(KeyValue {
        key: utf8_key(key)?,
        value,
        create_revision,
        mod_revision,
        lease: (lease != 0).then_some(lease),
    })
}

fn utf8_key(key: Vec<u8>) -> Result<String> {
    String::from_utf8(key).map_err(|e| {
        Error::Unexpected(format!("etcd key {:?} is not UTF-8", String::from_utf8_lossy(e.as_bytes())))
    })
}

/// Converts one watch event. etcd marks a deletion by a key-value without a
/// `create_revision` (its own rule; the event's type field is redundant).
fn watch_event(event: &etcd_client::Event) -> Result<WatchEvent> {
    let Some(kv) = event.kv() else {
        return Err(Error::Unexpected("etcd watch event without a key-value".to_string()));
    };
    if kv.create_revision() == 0 {
        Ok(WatchEvent::Delete { key: utf8_key(kv.key().to_vec())?, mod_revision: kv.mod_revision() })
    } else {
        key_value(kv.clone()).map(WatchEvent::Put)
    }
}

/// `ttl` in whole seconds, rounded up; zero is refused.
fn ttl_seconds(ttl: Duration) -> Result<i64> {
    if ttl.is_zero() {
        return Err(Error::InvalidArgument("lease ttl must be positive".to_string()));
    }
    let seconds = ttl.as_secs().saturating_add(u64::from(ttl.subsec_nanos() > 0));
    Ok(i64::try_from(seconds).unwrap_or(i64::MAX))
}

#[async_trait]
impl Discovery for EtcdDiscovery {
    fn max_value_bytes(&self) -> Option<usize> {
        Some(self.options.max_request_bytes.saturating_sub(REQUEST_OVERHEAD_BYTES))
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let seconds = ttl_seconds(ttl)?;
        let what = op("grant lease", "", None);
        let mut lease = self.lease_client();
        let granted = self.call(&what, lease.grant(seconds, None)).await?;
        if !granted.error().is_empty() {
            return Err(Error::Refused(format!("etcd {what} of {seconds} s: {}", granted.error())));
        }
        Ok(granted.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        let what = op("keep alive", "", Some(lease));
        let mut client = self.lease_client();
        // etcd-client sends the first refresh and reads its answer before it
        // returns; a ttl of 0 in that answer (the lease is gone) is its
        // "lease not found" error. Dropping the keeper ends the stream.
        let (_keeper, _stream) = self.call(&what, client.keep_alive(lease)).await?;
        Ok(())
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        let what = op("revoke", "", Some(lease));
        let mut client = self.lease_client();
        self.call(&what, client.revoke(lease)).await?;
        Ok(())
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        check_key(key)?;
        let what = op("put", key, lease);
        let options = lease.map(|lease| PutOptions::new().with_lease(lease));
        let mut kv = self.kv.clone();
        let put = self.call(&what, kv.put(key, value, options)).await?;
        self.revision_of(&what, put.header())
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        check_key(key)?;
        let what = op("get", key, None);
        let mut kv = self.kv.clone();
        let mut got = self.call(&what, kv.get(key, None)).await?;
        got.take_kvs().into_iter().next().map(key_value).transpose()
    }

    async fn get_prefix(&self, prefix: &str) -> Result<Listing> {
        let what = op("get prefix", prefix, None);
        let mut kv = self.kv.clone();
        let mut got = self.call(&what, kv.get(prefix, Some(GetOptions::new().with_prefix()))).await?;
        let revision = self.revision_of(&what, got.header())?;
        let kvs = got.take_kvs().into_iter().map(key_value).collect::<Result<Vec<_>>>()?;
        Ok(Listing { kvs, revision })
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        let what = op("delete", key, None);
        let mut kv = self.kv.clone();
        let deleted = self.call(&what, kv.delete(key, None)).await?;
        Ok(deleted.deleted() > 0)
    }

    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Option<Revision>> {
        check_key(key)?;
        let what = op("create if absent", key, lease);
        let options = lease.map(|lease| PutOptions::new().with_lease(lease));
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, value, options)]);
        let answer = self.txn(&what, txn).await?;
        if !answer.succeeded() {
            return Ok(None);
        }
        self.revision_of(&what, answer.header()).map(Some)
    }

    async fn watch_prefix(&self, prefix: &str, from_revision: Revision) -> Result<WatchStream> {
        if from_revision < 0 {
            return Err(Error::InvalidArgument(format!(
                "watch of {prefix:?} from negative revision {from_revision}"
            )));
        }
        let what = op("watch prefix", prefix, None);
        let mut client = self.watch.clone();
        let options = WatchOptions::new().with_prefix().with_start_revision(from_revision);
        let mut stream = self.call(&what, client.watch(prefix, Some(options))).await?;
        let created = self.call(&what, stream.message()).await?;
        let (watch_id, now) = match created {
            Some(created) if created.created() && !created.canceled() => {
                (created.watch_id(), created.header().map_or(0, |header| header.revision()))
            }
            Some(refused) if refused.compact_revision() > 0 => {
                return Err(Error::Compacted { requested: from_revision, oldest: refused.compact_revision() })
            }
            Some(refused) if refused.canceled() => {
                return Err(Error::Refused(format!("etcd {what}: {}", refused.cancel_reason())))
            }
            Some(_) => return Err(Error::Unexpected(format!("etcd answered {what} before confirming it"))),
            None => {
                return Err(Error::Backend(format!(
                    "etcd at {} ended {what} before confirming it",
                    self.endpoints
                )))
            }
        };
        if from_revision > 0 {
            self.check_not_compacted(&what, prefix, from_revision, &mut stream).await?;
        }
        // The revision the next event will have at the earliest, for errors.
        let next = if from_revision == 0 { now + 1 } else { from_revision };
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL);
        tokio::spawn(forward_watch(stream, watch_id, tx, prefix.to_string(), next, self.endpoints.clone()));
        Ok(WatchStream::new(rx))
    }

    async fn put_fenced(&self, fence: &Fence, key: &str, value: Vec<u8>) -> Result<Revision> {
        check_key(key)?;
        let what = op("fenced put", key, None);
        let txn = Txn::new()
            .when([Compare::create_revision(fence.key.as_str(), CompareOp::Equal, fence.revision)])
            .and_then([TxnOp::put(key, value, None)]);
        let answer = self.txn(&what, txn).await?;
        if !answer.succeeded() {
            return Err(Error::FenceLost { key: fence.key.clone() });
        }
        self.revision_of(&what, answer.header())
    }

    async fn delete_range_fenced(&self, fence: &Fence, start: &str, end: &str) -> Result<()> {
        crate::check_range(start, end)?;
        let what = op("fenced range delete", start, None);
        let txn = Txn::new()
            .when([Compare::create_revision(fence.key.as_str(), CompareOp::Equal, fence.revision)])
            .and_then([TxnOp::delete(start, Some(DeleteOptions::new().with_range(end)))]);
        if self.txn(&what, txn).await?.succeeded() {
            Ok(())
        } else {
            Err(Error::FenceLost { key: fence.key.clone() })
        }
    }

    async fn delete_fenced(&self, fence: &Fence, key: &str) -> Result<bool> {
        check_key(key)?;
        let what = op("fenced delete", key, None);
        let holds = || Compare::create_revision(fence.key.as_str(), CompareOp::Equal, fence.revision);
        // Deletes only if the fence holds and the key exists, so that success
        // alone says "existed" (no need to read the transaction's op results).
        let txn = Txn::new()
            .when([holds(), Compare::version(key, CompareOp::Greater, 0)])
            .and_then([TxnOp::delete(key, None)]);
        if self.txn(&what, txn).await?.succeeded() {
            return Ok(true);
        }
        // Either the fence is lost or the key is missing. A fence that holds
        // now held at the first transaction too (a lock key's incarnation
        // never comes back), so "missing" is the first transaction's answer.
        let txn = Txn::new().when([holds()]);
        if self.txn(&what, txn).await?.succeeded() {
            Ok(false)
        } else {
            Err(Error::FenceLost { key: fence.key.clone() })
        }
    }
}

/// Feeds one etcd watch into a [`WatchStream`]'s channel until the reader
/// drops it (then cancels the watch on the server) or the etcd watch ends
/// (then delivers one error).
async fn forward_watch(
    mut stream: etcd_client::WatchStream,
    watch_id: i64,
    tx: mpsc::Sender<Result<WatchEvent>>,
    prefix: String,
    mut next: Revision,
    endpoints: Arc<str>,
) {
    let ended = loop {
        let message = tokio::select! {
            () = tx.closed() => break None,
            message = stream.message() => message,
        };
        match message {
            Ok(Some(answer)) => {
                if answer.compact_revision() > 0 {
                    break Some(Error::Compacted { requested: next, oldest: answer.compact_revision() });
                }
                if answer.canceled() {
                    break Some(Error::Backend(format!(
                        "etcd at {endpoints} cancelled the watch of {prefix:?}: {}",
                        answer.cancel_reason()
                    )));
                }
                let mut failed = None;
                for event in answer.events() {
                    match watch_event(event) {
                        Ok(event) => {
                            next = event.revision() + 1;
                            if tx.send(Ok(event)).await.is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                if failed.is_some() {
                    break failed;
                }
                if tx.is_closed() {
                    break None;
                }
            }
            Ok(None) => {
                break Some(Error::Backend(format!(
                    "etcd at {endpoints} closed the watch of {prefix:?} (next revision {next})"
                )))
            }
            Err(e) => {
                break Some(Error::Backend(format!(
                    "watch of {prefix:?} on etcd at {endpoints} failed (next revision {next}): {e}"
                )))
            }
        }
    };
    match ended {
        // The reader is gone: cancel on the server (dropping the stream
        // afterwards resets it, which would end the watch too).
        None => {
            let _ = tokio::time::timeout(Duration::from_secs(1), stream.cancel(watch_id)).await;
        }
        Some(error) => {
            tracing::debug!(prefix, %error, "etcd watch ended");
            let _ = tx.send(Err(error)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_seconds(Duration::from_millis(1)), Ok(1));
        assert_eq!(ttl_seconds(Duration::from_secs(1)), Ok(1));
        assert_eq!(ttl_seconds(Duration::from_millis(1001)), Ok(2));
        assert_eq!(ttl_seconds(Duration::from_secs(90)), Ok(90));
        assert_eq!(ttl_seconds(Duration::MAX), Ok(i64::MAX));
        assert!(matches!(ttl_seconds(Duration::ZERO), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn op_names_key_and_lease() {
        assert_eq!(op("put", "/a", Some(7)).to_string(), "put \"/a\" (lease 7)");
        assert_eq!(op("grant lease", "", None).to_string(), "grant lease");
    }

    #[test]
    fn non_utf8_keys_are_unexpected() {
        let err = utf8_key(vec![b'/', 0xff]).unwrap_err();
        assert!(matches!(&err, Error::Unexpected(m) if m.contains("not UTF-8")), "{err}");
        assert!(!err.is_transient());
        assert_eq!(utf8_key(b"/ok".to_vec()), Ok("/ok".to_string()));
    }
}
