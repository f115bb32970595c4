//! A bad data line fails its task with an error naming the file and line;
//! the task is discarded after the failure threshold and the rest of the job
//! trains on. With `skip_bad_lines` the line is skipped and counted instead.

use crate::support;

use oar::{
    job::{config::JobConfig, report::JobReport},
    trainer::ModelConfig,
    transport::{MemNetwork, MemTransport},
};
use std::{io::Write, sync::Arc};

fn config_with_bad_line() -> (tempfile::TempDir, JobConfig) {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(format!("{}/testdata/a1a", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let path = dir.path().join("a1a-bad");
    let mut f = std::fs::File::create(&path).unwrap();
    for (i, line) in good.lines().enumerate() {
        if i == 99 {
            writeln!(f, "+1 3:1 oops:1").unwrap();
        } else {
            writeln!(f, "{line}").unwrap();
        }
    }
    let mut config =
        JobConfig::new(path.to_str().unwrap(), ModelConfig::Softmax { features: 123, classes: 2 });
    config.test_data = Some(format!("{}/testdata/a1a.t", env!("CARGO_MANIFEST_DIR")));
    config.chunk_bytes = 8 << 10;
    config.passes = 2;
    config.max_failures = 2;
    (dir, config)
}

async fn run(config: &JobConfig) -> JobReport {
    let transport = Arc::new(MemTransport::new(MemNetwork::new()));
    support::run_in_process(config, 2, transport, "mem:0", |_| {}).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_line_discards_its_task_with_the_file_and_line_and_the_job_goes_on() {
    let (_dir, config) = config_with_bad_line();
    let bad_path = config.data.clone();
    let err = oar::trainer::reader::read_glob(&bad_path, &config.reader()).unwrap_err().to_string();
    assert!(err.contains(&format!("{bad_path}:100")), "{err}");

    // Training data is read per task, so only the task holding line 100 fails.
    let report = run(&config).await;
    assert!(report.is_done());
    assert_eq!(report.tasks_discarded, 1, "{report:?}");
    assert_eq!(report.tasks_failed, 2, "two failures reach the threshold of 2");
    let (_, reason) = &report.discarded[0];
    assert!(reason.contains(&format!("{bad_path}:100")) && reason.contains("oops"), "{reason}");
    assert!(report.test_accuracy > 0.75, "the other tasks still train: {report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_bad_lines_skips_and_counts() {
    let (_dir, mut config) = config_with_bad_line();
    config.skip_bad_lines = true;
    let report = run(&config).await;
    assert!(report.is_done());
    assert_eq!(report.tasks_discarded, 0);
    assert_eq!(report.skipped_lines, 2, "the bad line is skipped once per pass");
}
