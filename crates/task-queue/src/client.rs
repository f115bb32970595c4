//! The trainers' side of the master protocol.

use crate::{
    protocol::{MasterRequest, MasterStatus, ReportReply, TaskReply, TaskStats, MASTER_METHOD},
    Error, Result, TaskRef,
};
use bytes::Bytes;
use oar_discovery::Discovery;
use oar_transport::{Connection, RetryPolicy, Transport};
use serde::de::DeserializeOwned;
use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

/// Calls the job's master, wherever it is: the address is read from the
/// master's address key ([`MasterKeys::addr`](crate::MasterKeys::addr)) and
/// read again after a failure, so the client follows a standby that took
/// over. A master that is away is retried until the policy's deadline,
/// then the last error is returned.
pub struct MasterClient {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    options: MasterClientOptions,
    conn: Mutex<Option<Arc<dyn Connection>>>,
}

/// How a [`MasterClient`] finds and calls the master.
#[derive(Clone, Debug)]
pub struct MasterClientOptions {
    /// The key the serving master publishes its address under.
    pub addr_key: String,
    /// Bound of one attempt of a call.
    pub call_timeout: Duration,
    /// How long, and how often, a master that is away is retried.
    pub retry: RetryPolicy,
}

impl MasterClientOptions {
    /// Options for the master publishing at `addr_key`: 10 s calls, the
    /// default retry policy.
    pub fn new(addr_key: impl Into<String>) -> Self {
        Self {
            addr_key: addr_key.into(),
            call_timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
        }
    }
}

impl MasterClient {
    /// A client of the master that publishes its address at `options.addr_key`.
    pub fn new(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        options: MasterClientOptions,
    ) -> Self {
        Self { discovery, transport, options, conn: Mutex::new(None) }
    }

    async fn connection(&self) -> Result<Arc<dyn Connection>> {
        if let Some(conn) = self.conn.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(conn);
        }
        let key = &self.options.addr_key;
        let kv = self.discovery.get(key).await?.ok_or_else(|| Error::NoMaster { key: key.clone() })?;
        let addr =
            String::from_utf8(kv.value).map_err(|_| Error::NoMaster { key: format!("{key} (not UTF-8)") })?;
        let conn = self.transport.connect(&addr).await?;
        *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    async fn request<T: DeserializeOwned>(&self, request: &MasterRequest) -> Result<T> {
        self.options
            .retry
            .run(|| async {
                let conn = self.connection().await?;
                let result: Result<(T, Bytes)> = oar_transport::call(
                    conn.as_ref(),
                    MASTER_METHOD,
                    request,
                    Bytes::new(),
                    self.options.call_timeout,
                )
                .await
                .map_err(Error::from);
                if result.is_err() {
                    // Look the master up again next time: it may have moved.
                    *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = None;
                }
                result.map(|(reply, _)| reply)
            })
            .await
    }

    /// Ask for a task for `trainer`.
    pub async fn get_task(&self, trainer: &str) -> Result<TaskReply> {
        self.request(&MasterRequest::GetTask { trainer: trainer.to_string() }).await
    }

    /// Report a task trained on completely; `Accepted` means it is durable.
    pub async fn task_finished(
        &self,
        trainer: &str,
        task_ref: TaskRef,
        stats: TaskStats,
    ) -> Result<ReportReply> {
        self.request(&MasterRequest::TaskFinished { trainer: trainer.to_string(), task_ref, stats }).await
    }

    /// Report a task that could not be trained on, and why.
    pub async fn task_failed(&self, trainer: &str, task_ref: TaskRef, reason: &str) -> Result<ReportReply> {
        self.request(&MasterRequest::TaskFailed {
            trainer: trainer.to_string(),
            task_ref,
            reason: reason.into(),
        })
        .await
    }

    /// Hand a task back unfinished (the trainer is stopping): it goes to
    /// the front of todo without counting as a failure.
    pub async fn task_returned(&self, trainer: &str, task_ref: TaskRef) -> Result<ReportReply> {
        self.request(&MasterRequest::TaskReturned { trainer: trainer.to_string(), task_ref }).await
    }

    /// The job's status.
    pub async fn status(&self) -> Result<MasterStatus> {
        self.request(&MasterRequest::Status).await
    }
}
