//! [`AnyModel`]: a dense [`Model`] or a [`SparseModel`], as a job trains
//! it, and the [`Examples`] each kind reads.
//!
//! The roles and the training loop take either kind: a dense model reads
//! [`Example`]s (features `0..features`), a sparse one [`IdExample`]s (open
//! ended `u64` ids) from the same files and formats.

use std::sync::Arc;

use oar_pserver::sparse::TableSpec;
use oar_pserver::ParamSpec;
use oar_task_queue::Chunk;

use crate::id_reader::{read_chunks_ids, read_glob_ids, read_sample_ids, IdExample, IdReaderOptions};
use crate::model::{Example, Model};
use crate::reader::{read_chunks, read_glob, read_sample, ReaderOptions};
use crate::sparse_model::SparseModel;
use crate::Result;

/// A model of either kind.
#[derive(Clone)]
pub enum AnyModel {
    /// Dense parameters only.
    Dense(Arc<dyn Model>),
    /// Sparse tables beside (small) dense parameters.
    Sparse(Arc<dyn SparseModel>),
}

impl From<Arc<dyn Model>> for AnyModel {
    fn from(model: Arc<dyn Model>) -> Self {
        AnyModel::Dense(model)
    }
}

impl From<Arc<dyn SparseModel>> for AnyModel {
    fn from(model: Arc<dyn SparseModel>) -> Self {
        AnyModel::Sparse(model)
    }
}

impl std::fmt::Debug for AnyModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tables: Vec<String> = self.table_specs().into_iter().map(|t| t.name).collect();
        f.debug_struct("AnyModel")
            .field("params", &self.param_specs().len())
            .field("tables", &tables)
            .finish()
    }
}

/// A task's or a data set's examples, as the model reads them.
#[derive(Clone, Debug, PartialEq)]
pub enum Examples {
    /// For a dense model.
    Dense(Vec<Example>),
    /// For a sparse model.
    Ids(Vec<IdExample>),
}

impl Examples {
    /// Number of examples.
    pub fn len(&self) -> usize {
        match self {
            Examples::Dense(e) => e.len(),
            Examples::Ids(e) => e.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl AnyModel {
    /// The dense parameters.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        match self {
            AnyModel::Dense(m) => m.param_specs(),
            AnyModel::Sparse(m) => m.param_specs(),
        }
    }

    /// The sparse tables (none for a dense model).
    pub fn table_specs(&self) -> Vec<TableSpec> {
        match self {
            AnyModel::Dense(_) => Vec::new(),
            AnyModel::Sparse(m) => m.table_specs(),
        }
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        match self {
            AnyModel::Dense(m) => m.classes(),
            AnyModel::Sparse(m) => m.classes(),
        }
    }

    /// No examples, of the kind this model reads.
    pub fn no_examples(&self) -> Examples {
        match self {
            AnyModel::Dense(_) => Examples::Dense(Vec::new()),
            AnyModel::Sparse(_) => Examples::Ids(Vec::new()),
        }
    }

    /// Reads a task's chunks, in order, as this model reads data: the
    /// examples and how many bad lines were skipped.
    pub fn read_chunks(&self, chunks: &[Chunk], opts: &ReaderOptions) -> Result<(Examples, usize)> {
        Ok(match self {
            AnyModel::Dense(_) => {
                let data = read_chunks(chunks, opts)?;
                (Examples::Dense(data.examples), data.skipped)
            }
            AnyModel::Sparse(_) => {
                let data = read_chunks_ids(chunks, &IdReaderOptions::from(opts))?;
                (Examples::Ids(data.examples), data.skipped)
            }
        })
    }

    /// Reads every file matching `pattern` whole (see
    /// [`read_glob`]).
    pub fn read_glob(&self, pattern: &str, opts: &ReaderOptions) -> Result<Examples> {
        Ok(match self {
            AnyModel::Dense(_) => Examples::Dense(read_glob(pattern, opts)?),
            AnyModel::Sparse(_) => Examples::Ids(read_glob_ids(pattern, &IdReaderOptions::from(opts))?),
        })
    }

    /// Reads the files matching `pattern`, or an evenly spread sample of
    /// `max_bytes` of them (see [`read_sample`]).
    pub fn read_sample(&self, pattern: &str, opts: &ReaderOptions, max_bytes: u64) -> Result<Examples> {
        Ok(match self {
            AnyModel::Dense(_) => Examples::Dense(read_sample(pattern, opts, max_bytes)?),
            AnyModel::Sparse(_) => {
                Examples::Ids(read_sample_ids(pattern, &IdReaderOptions::from(opts), max_bytes)?)
            }
        })
    }
}
