//! The trainers' side of the master protocol.

use crate::{
    protocol::{MasterRequest, MasterStatus, ReportReply, TaskReply, TaskStats, MASTER_METHOD},
    Error, Result, TaskRef,
};
use bytes::Bytes;
use oar_discovery::{Discovery, JobKeys};
use oar_transport::{Connection, RetryPolicy, Transport};
use serde::de::DeserializeOwned;
use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

/// Calls the job's master, wherever it is: the address is read from
/// `master/addr` and read again after a failure, so the client follows a
/// standby that took over. A master that is away is retried until the
/// policy's deadline, then the last error is returned.
pub struct MasterClient {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
    keys: JobKeys,
    conn: Mutex<Option<Arc<dyn Connection>>>,
    call_timeout: Duration,
    retry: RetryPolicy,
}

impl MasterClient {
    /// A client of job `job`'s master. `call_timeout` bounds each attempt,
    /// `retry` the whole call.
    pub fn new(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        job: &str,
        call_timeout: Duration,
        retry: RetryPolicy,
    ) -> Result<Self> {
        Ok(Self {
            discovery,
            transport,
            keys: JobKeys::new(job)?,
            conn: Mutex::new(None),
            call_timeout,
            retry,
        })
    }

    async fn connection(&self) -> Result<Arc<dyn Connection>> {
        if let Some(conn) = self.conn.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(conn);
        }
        let kv = self
            .discovery
            .get(&self.keys.master_addr())
            .await?
            .ok_or_else(|| Error::NoMaster { key: self.keys.master_addr() })?;
        let addr = String::from_utf8(kv.value)
            .map_err(|_| Error::NoMaster { key: format!("{} (not UTF-8)", self.keys.master_addr()) })?;
        let conn = self.transport.connect(&addr).await?;
        *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    async fn request<T: DeserializeOwned>(&self, request: &MasterRequest) -> Result<T> {
        self.retry
            .run(|| async {
                let conn = self.connection().await?;
                let result: Result<(T, Bytes)> = oar_transport::call(
                    conn.as_ref(),
                    MASTER_METHOD,
                    request,
                    Bytes::new(),
                    self.call_timeout,
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

    /// The job's status.
    pub async fn status(&self) -> Result<MasterStatus> {
        self.request(&MasterRequest::Status).await
    }
}
