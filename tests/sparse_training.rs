//! Training over sparse tables, whole jobs in one process (master, 2
//! pservers, trainers; QUIC on 127.0.0.1): the built-in CTR model reaches
//! the dense softmax's accuracy on a1a, and every row gradient a trainer
//! pushes is applied exactly once, counted on the rows' values.

use crate::support;

use oar::{
    discovery::MemDiscovery,
    job::{config::JobConfig, local, JobContext},
    pserver::{sparse::TableSpec, Init, Mode, OptimizerConfig, ParamBuf, ParamSpec},
    trainer::{
        id_reader::{read_glob_ids, IdReaderOptions},
        CtrModelConfig, IdExample, ModelConfig, RowBatch, SparseModel,
    },
    transport::{DevCa, QuicTransport, Transport},
};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};
use support::{a1a_softmax, run_in_process, testdata};

fn quic() -> Arc<dyn Transport> {
    Arc::new(QuicTransport::new(DevCa::new().unwrap().tls_config("sparse").unwrap()).unwrap())
}

/// What `examples/ctr` runs by default: LR over a1a's feature ids, AdaGrad,
/// 10 passes, against softmax regression with `local`'s options.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctr_reaches_the_dense_softmax_accuracy_on_a1a() {
    for mode in [Mode::Sync, Mode::Async] {
        let mut dense = a1a_softmax(mode);
        dense.passes = 10;
        let dense = run_in_process(&dense, 2, quic(), "127.0.0.1:0", |_| {}).await.unwrap();
        let mut ctr = a1a_softmax(mode);
        ctr.model = ModelConfig::Ctr(CtrModelConfig::Lr { crosses: false });
        ctr.optimizer = OptimizerConfig::AdaGrad { lr: 0.1, eps: 1e-10 };
        ctr.passes = 10;
        let sparse = run_in_process(&ctr, 2, quic(), "127.0.0.1:0", |_| {}).await.unwrap();
        eprintln!("{mode:?}: softmax {}, ctr {}", dense.test_accuracy, sparse.test_accuracy);
        assert!(dense.is_done() && sparse.is_done());
        assert!(
            sparse.test_accuracy >= dense.test_accuracy,
            "{mode:?}: ctr {} < softmax {}",
            sparse.test_accuracy,
            dense.test_accuracy
        );
    }
}

/// A model that counts: each example adds 1 to the row of each of its ids
/// (SGD at lr 1 on a gradient of -1 per sighting, not averaged), and
/// whenever it predicts it records the values of the rows it was given.
/// The master's last scoring pulls every row after the last push.
#[derive(Default)]
struct Counter {
    seen: Mutex<HashMap<u64, f32>>,
}

impl SparseModel for Counter {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![ParamSpec::new("b", vec![1], Init::Zeros)]
    }
    fn table_specs(&self) -> Vec<TableSpec> {
        vec![TableSpec::new("count", 1, Init::Zeros)]
    }
    fn classes(&self) -> usize {
        2
    }
    fn batch_ids(&self, batch: &[IdExample], rows: &mut RowBatch) {
        rows.set_ids(0, batch.iter().flat_map(|e| e.ids.iter().map(|&(id, _)| id)).collect());
    }
    fn loss_and_grad(
        &self,
        _: &ParamBuf,
        _: &RowBatch,
        batch: &[IdExample],
        dense_grads: &mut ParamBuf,
        row_grads: &mut RowBatch,
    ) -> f32 {
        dense_grads.fill(0.0);
        row_grads.fill(0.0);
        for (id, _) in batch.iter().flat_map(|e| &e.ids) {
            if let Some(row) = row_grads.row_mut(0, *id) {
                row[0] -= 1.0;
            }
        }
        0.5
    }
    fn predict(&self, _: &ParamBuf, rows: &RowBatch, batch: &[IdExample], out: &mut Vec<u32>) -> f32 {
        self.seen.lock().unwrap().extend(rows.iter(0).map(|(id, row)| (id, row[0])));
        out.clear();
        out.extend(batch.iter().map(|_| 0));
        0.5
    }
}

/// Every row's value is the number of times its id occurs in the data,
/// times the passes: each example's row gradients were applied once per
/// pass, none lost, none twice. Async with 2 trainers (each push applied
/// as it comes), and sync with one (a step is that trainer's push).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_gradient_is_applied_exactly_once() {
    let data = read_glob_ids(&testdata("a1a"), &IdReaderOptions::default()).unwrap();
    for (mode, trainers) in [(Mode::Async, 2), (Mode::Sync, 1)] {
        let mut config =
            JobConfig::new(&testdata("a1a"), ModelConfig::Ctr(CtrModelConfig::Lr { crosses: false }));
        config.mode = mode;
        config.passes = 3;
        config.batch_size = 16;
        config.chunk_bytes = 8 << 10;
        config.optimizer = OptimizerConfig::Sgd { lr: 1.0 };
        let counter = Arc::new(Counter::default());
        let mut ctx = JobContext::new("count", Arc::new(MemDiscovery::new()), quic(), "127.0.0.1:0");
        ctx.plugins.sparse_model = Some(counter.clone());
        let options = local::LocalOptions { trainers, ..local::LocalOptions::default() };
        let report = local::run_local(&ctx, &config, &options, |_| {}).await.unwrap();
        assert!(report.is_done(), "{report:?}");
        let mut want: HashMap<u64, f32> = HashMap::new();
        for (id, _) in data.iter().flat_map(|e| &e.ids) {
            *want.entry(*id).or_default() += config.passes as f32;
        }
        let seen = counter.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), want.len(), "{mode:?}: every id scored");
        for (id, n) in &want {
            assert_eq!(seen.get(id), Some(n), "{mode:?}: row {id}");
        }
        let total: f32 = want.values().sum();
        eprintln!("{mode:?}: {} rows, {total} row updates, each once", want.len());
    }
}
