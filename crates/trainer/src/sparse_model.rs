//! The [`SparseModel`] trait and the [`RowBatch`] it reads and writes: what a
//! user implements to train a model over sparse embedding tables (the
//! built-in ones are named by [`CtrModelConfig`](crate::ctr::CtrModelConfig)).
//!
//! A sparse model has two kinds of state: a small dense part (a
//! [`ParamBuf`], as a [`Model`](crate::model::Model) has) and rows of
//! sparse tables, keyed by `u64` id and created on first touch on the
//! pservers. A mini-batch never sees a whole table: the trainer asks the
//! model which ids the batch touches ([`SparseModel::batch_ids`]), pulls
//! those rows into a [`RowBatch`], and gets back row-sparse gradients in a
//! second `RowBatch` with the same ids.

use std::collections::HashMap;

use oar_pserver::sparse::{IdHash, TableSpec};
use oar_pserver::{ParamBuf, ParamSpec};

use crate::id_reader::IdExample;

/// The rows of one batch: per table, the batch's unique ids (sorted) and
/// their values (`ids.len() * dim`, row-major), plus a hash index from id to
/// position so a model finds an example's rows in O(1).
///
/// Table numbers `t` are the positions in the model's
/// [`table_specs`](SparseModel::table_specs); a `t` out of range is a
/// programming error and panics, like slice indexing. Ids never are: an id
/// that is not in the batch is `None`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowBatch {
    tables: Vec<Rows>,
}

/// One table's rows in a [`RowBatch`].
#[derive(Clone, Debug, PartialEq)]
struct Rows {
    dim: usize,
    ids: Vec<u64>,
    values: Vec<f32>,
    index: HashMap<u64, usize, IdHash>,
}

impl Rows {
    fn row_range(&self, pos: usize) -> std::ops::Range<usize> {
        pos * self.dim..(pos + 1) * self.dim
    }
}

impl RowBatch {
    /// An empty batch for tables of these row widths (no ids yet).
    pub fn new(dims: &[usize]) -> Self {
        let tables = dims
            .iter()
            .map(|&dim| Rows { dim, ids: Vec::new(), values: Vec::new(), index: HashMap::default() })
            .collect();
        RowBatch { tables }
    }

    /// An empty batch laid out for `specs` (a model's
    /// [`table_specs`](SparseModel::table_specs)).
    pub fn for_tables(specs: &[TableSpec]) -> Self {
        let dims: Vec<usize> = specs.iter().map(|s| s.dim).collect();
        Self::new(&dims)
    }

    /// Number of tables.
    pub fn tables(&self) -> usize {
        self.tables.len()
    }

    /// Row width of table `t`.
    pub fn dim(&self, t: usize) -> usize {
        self.tables[t].dim
    }

    /// Number of rows (unique ids) of table `t` in this batch.
    pub fn rows(&self, t: usize) -> usize {
        self.tables[t].ids.len()
    }

    /// The unique ids of table `t`, ascending.
    pub fn ids(&self, t: usize) -> &[u64] {
        &self.tables[t].ids
    }

    /// The values of table `t`: row `i` (of `ids(t)[i]`) is
    /// `values[i * dim..(i + 1) * dim]`.
    pub fn values(&self, t: usize) -> &[f32] {
        &self.tables[t].values
    }

    /// The values of table `t`, mutable (a pull writes them in id order).
    pub fn values_mut(&mut self, t: usize) -> &mut [f32] {
        &mut self.tables[t].values
    }

    /// Position of `id` in `ids(t)`, if the batch holds it.
    pub fn position(&self, t: usize, id: u64) -> Option<usize> {
        self.tables[t].index.get(&id).copied()
    }

    /// The row of `id` in table `t`, if the batch holds it.
    pub fn row(&self, t: usize, id: u64) -> Option<&[f32]> {
        let rows = &self.tables[t];
        let pos = *rows.index.get(&id)?;
        Some(&rows.values[rows.row_range(pos)])
    }

    /// The row of `id` in table `t`, mutable, if the batch holds it.
    pub fn row_mut(&mut self, t: usize, id: u64) -> Option<&mut [f32]> {
        let rows = &mut self.tables[t];
        let pos = *rows.index.get(&id)?;
        let range = rows.row_range(pos);
        Some(&mut rows.values[range])
    }

    /// `(id, row)` of table `t`, in id order (what a push sends).
    pub fn iter(&self, t: usize) -> impl Iterator<Item = (u64, &[f32])> + '_ {
        let rows = &self.tables[t];
        rows.ids.iter().enumerate().map(move |(pos, &id)| (id, &rows.values[rows.row_range(pos)]))
    }

    /// Sets the ids of table `t`: sorted, duplicates removed, every value
    /// zero. Reuses the table's allocations.
    pub fn set_ids(&mut self, t: usize, mut ids: Vec<u64>) {
        ids.sort_unstable();
        ids.dedup();
        let rows = &mut self.tables[t];
        rows.values.clear();
        rows.values.resize(ids.len() * rows.dim, 0.0);
        rows.index.clear();
        rows.index.extend(ids.iter().enumerate().map(|(pos, &id)| (id, pos)));
        rows.ids = ids;
    }

    /// The same tables and ids with every value zero (a gradient buffer for
    /// these rows).
    pub fn zeros_like(&self) -> Self {
        let mut out = self.clone();
        out.fill(0.0);
        out
    }

    /// Sets every value of every table to `v` (e.g. zero a gradient buffer).
    pub fn fill(&mut self, v: f32) {
        for rows in &mut self.tables {
            rows.values.fill(v);
        }
    }
}

/// A differentiable classifier over sparse tables plus a dense part.
///
/// Like [`Model`](crate::model::Model), a sparse model holds only its shape,
/// never its parameters, so one value can be shared by threads while rows and
/// parameters travel to and from the pservers. `dense` and `dense_grads` must
/// be built from [`param_specs`](Self::param_specs) and `rows` from
/// [`table_specs`](Self::table_specs) (see [`new_rows`](Self::new_rows)); a
/// mismatch is a programming error and panics.
///
/// Data never makes a model panic: an id missing from `rows` reads as a zero
/// row and its gradient is dropped (also when `row_grads` lacks it), and
/// examples whose label is `>= classes()` contribute nothing to the loss and
/// the gradients (though they count in the batch size).
pub trait SparseModel: Send + Sync + 'static {
    /// The dense parameters, in the order of the flat buffer (may be tiny:
    /// a bias).
    fn param_specs(&self) -> Vec<ParamSpec>;
    /// The sparse tables; table `t` of a [`RowBatch`] is `table_specs()[t]`.
    fn table_specs(&self) -> Vec<TableSpec>;
    /// Number of classes.
    fn classes(&self) -> usize;
    /// Sets, for each table, the unique ids the batch touches (through
    /// [`RowBatch::set_ids`], so the values are zero): the rows to pull.
    fn batch_ids(&self, batch: &[IdExample], rows: &mut RowBatch);
    /// Mean loss over the batch; writes the MEAN gradient over the batch into
    /// `dense_grads` and `row_grads` (both overwritten). `row_grads` should
    /// have `rows`' ids (see [`RowBatch::zeros_like`]); a row's gradient sums
    /// every example's contribution to that id, divided by the batch size.
    /// An empty batch has loss 0 and zero gradients.
    fn loss_and_grad(
        &self,
        dense: &ParamBuf,
        rows: &RowBatch,
        batch: &[IdExample],
        dense_grads: &mut ParamBuf,
        row_grads: &mut RowBatch,
    ) -> f32;
    /// Predicted class per example (written to `out`, replacing its
    /// contents), and the mean loss.
    fn predict(&self, dense: &ParamBuf, rows: &RowBatch, batch: &[IdExample], out: &mut Vec<u32>) -> f32;

    /// An empty [`RowBatch`] laid out for this model's tables.
    fn new_rows(&self) -> RowBatch {
        RowBatch::for_tables(&self.table_specs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_ids_sorts_dedups_and_indexes() {
        let mut rows = RowBatch::new(&[2, 1]);
        assert_eq!(rows.tables(), 2);
        rows.set_ids(0, vec![9, u64::MAX, 3, 9, 3]);
        assert_eq!(rows.ids(0), &[3, 9, u64::MAX]);
        assert_eq!(rows.values(0), &[0.0; 6]);
        assert_eq!(rows.rows(1), 0);
        rows.values_mut(0).copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(rows.row(0, 9), Some(&[3.0, 4.0][..]));
        assert_eq!(rows.row(0, 4), None);
        assert_eq!(rows.position(0, u64::MAX), Some(2));
        rows.row_mut(0, 3).unwrap()[1] = -1.0;
        let listed: Vec<(u64, Vec<f32>)> = rows.iter(0).map(|(id, r)| (id, r.to_vec())).collect();
        assert_eq!(listed, vec![(3, vec![1.0, -1.0]), (9, vec![3.0, 4.0]), (u64::MAX, vec![5.0, 6.0])]);

        let zeros = rows.zeros_like();
        assert_eq!(zeros.ids(0), rows.ids(0));
        assert_eq!(zeros.values(0), &[0.0; 6]);
        assert_eq!(zeros.row(0, 9), Some(&[0.0, 0.0][..]));

        // Resetting the ids forgets the old rows.
        rows.set_ids(0, vec![4]);
        assert_eq!((rows.ids(0), rows.values(0)), (&[4u64][..], &[0.0f32, 0.0][..]));
        assert_eq!(rows.row(0, 9), None);
    }

    #[test]
    fn zero_width_rows_are_harmless() {
        let mut rows = RowBatch::new(&[0]);
        rows.set_ids(0, vec![1, 2]);
        assert_eq!(rows.row(0, 2), Some(&[][..]));
        assert_eq!(rows.iter(0).count(), 2);
    }
}
