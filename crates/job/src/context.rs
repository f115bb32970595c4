//! Where a role runs: the job's name, its discovery, its transport, the
//! address to serve at, and any user-defined parts.

use crate::{config::JobConfig, Result};
use oar_discovery::Discovery;
use oar_pserver::OptimizerFactory;
use oar_trainer::{model::Model, AnyModel, SparseModel};
use oar_transport::Transport;
use std::sync::Arc;

/// User-defined parts that replace the built-in ones the job's options
/// name, without any change to oar. Every process of a job must be given the
/// same ones (the model decides the parameters, which the placement's
/// fingerprint checks).
#[derive(Clone, Default)]
pub struct Plugins {
    /// Replaces the model of [`JobConfig::model`] on every role: trainers
    /// train it, pservers hold its parameters, the master scores it.
    /// `JobConfig::model` still gives the data's features and classes to the
    /// readers.
    pub model: Option<Arc<dyn Model>>,
    /// Replaces the model of [`JobConfig::model`] with a model over sparse
    /// tables, on every role (as `model` does; at most one of the two).
    pub sparse_model: Option<Arc<dyn SparseModel>>,
    /// Replaces [`JobConfig::optimizer`] on the pservers.
    pub optimizer: Option<OptimizerFactory>,
}

/// Where a role runs: the job, its discovery, the transport, and the
/// address to listen at (`"127.0.0.1:0"` picks a free port; `"mem:0"` for
/// the in-process transport).
#[derive(Clone)]
pub struct JobContext {
    /// The job's name: its keys live under `/oar/<job>/`.
    pub job: String,
    /// Where the processes of the job find each other.
    pub discovery: Arc<dyn Discovery>,
    /// How they talk.
    pub transport: Arc<dyn Transport>,
    /// The address this role serves at (the master and pservers).
    pub listen: String,
    /// User-defined parts, if any.
    pub plugins: Plugins,
}

impl JobContext {
    /// A context with no plugins.
    pub fn new(
        job: impl Into<String>,
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        listen: impl Into<String>,
    ) -> Self {
        Self { job: job.into(), discovery, transport, listen: listen.into(), plugins: Plugins::default() }
    }

    /// The job's model: the plugin's, or the one `config` names.
    pub(crate) fn model(&self, config: &JobConfig) -> Result<AnyModel> {
        match (&self.plugins.model, &self.plugins.sparse_model) {
            (Some(_), Some(_)) => Err(crate::Error::BadConfig(
                "plugins: a model and a sparse model were both given; give one".into(),
            )),
            (Some(model), None) => Ok(AnyModel::Dense(model.clone())),
            (None, Some(model)) => Ok(AnyModel::Sparse(model.clone())),
            (None, None) => Ok(config.model.build_any()?),
        }
    }
}

#[cfg(feature = "etcd")]
pub use cluster::ConnectOptions;

#[cfg(feature = "etcd")]
mod cluster {
    use super::JobContext;
    use crate::Result;
    use oar_discovery::EtcdDiscovery;
    use oar_transport::{QuicOptions, QuicTransport, TlsConfig};
    use std::{path::PathBuf, sync::Arc};

    /// How a process of a cluster job connects: etcd, the job's name, where
    /// to serve, and its certificates (PEM files signed by the job's CA).
    #[derive(Clone, Debug, Default)]
    pub struct ConnectOptions {
        /// etcd endpoints (`http://127.0.0.1:2379`).
        pub etcd: Vec<String>,
        /// The job's name.
        pub job: String,
        /// Address to serve at; port 0 picks a free one.
        pub listen: String,
        /// The job's CA certificate.
        pub ca: PathBuf,
        /// This process's certificate, signed by the CA.
        pub cert: PathBuf,
        /// This process's private key.
        pub key: PathBuf,
        /// The QUIC transport's tuning and limits, e.g. a fixed MTU for a
        /// network with jumbo frames (`network.mtu`).
        pub quic: QuicOptions,
    }

    impl JobContext {
        /// Connect to etcd and build a QUIC transport with mutual TLS from
        /// the PEM files (feature `etcd`).
        pub async fn connect(options: &ConnectOptions) -> Result<JobContext> {
            let tls = TlsConfig::from_pem_files(&options.ca, &options.cert, &options.key)?;
            let transport = Arc::new(QuicTransport::with_options(tls, options.quic.clone())?);
            let discovery = Arc::new(EtcdDiscovery::connect(&options.etcd).await?);
            Ok(JobContext::new(options.job.clone(), discovery, transport, options.listen.clone()))
        }
    }
}
