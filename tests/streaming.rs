//! Streaming jobs in one process (master, pservers, trainers; QUIC on
//! 127.0.0.1, in-memory discovery): a1a arriving as files over time is
//! trained, every record once, to 82% on a1a.t; an appended file is read
//! by whole lines; bad input (a garbage file, a file deleted after it was
//! cut into tasks, one never completed, a truncated last line) is named and
//! the job goes on with the rest.

use crate::support;

use oar::{
    discovery::MemDiscovery,
    job::{
        config::{JobConfig, StreamSource},
        local::{run_local, LocalOptions},
        report::{JobReport, Progress, WindowReport},
        role::{self, RoleOptions},
        JobContext,
    },
    pserver::{Mode, OptimizerConfig},
    task_queue::StreamStatus,
    trainer::ModelConfig,
    transport::{DevCa, QuicTransport, Transport},
};
use std::{
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};
use support::testdata;
use tokio_util::sync::CancellationToken;

fn ctx(job: &str) -> JobContext {
    let transport: Arc<dyn Transport> =
        Arc::new(QuicTransport::new(DevCa::new().unwrap().tls_config("stream").unwrap()).unwrap());
    JobContext::new(job, Arc::new(MemDiscovery::new()), transport, "127.0.0.1:0")
}

/// Softmax regression on a stream, scored on a1a.t every 200 ms: AdaGrad
/// with small batches, as one pass over a1a needs to reach 82%.
fn config(source: StreamSource) -> JobConfig {
    let mut config = JobConfig::streaming(source, ModelConfig::Softmax { features: 123, classes: 2 });
    config.test_data = Some(testdata("a1a.t"));
    config.mode = Mode::Async;
    config.batch_size = 16;
    config.optimizer = OptimizerConfig::AdaGrad { lr: 0.3, eps: 1e-10 };
    config.pservers = 1;
    let stream = config.stream.as_mut().unwrap();
    stream.window = Duration::from_millis(200);
    config
}

/// What a job's progress showed: its windows and the stream's last status.
#[derive(Default)]
struct Seen {
    windows: Vec<WindowReport>,
    stream: Option<StreamStatus>,
}

async fn run(ctx: &JobContext, config: &JobConfig, seen: &Mutex<Seen>) -> JobReport {
    let options = LocalOptions { trainers: 2, ..LocalOptions::default() };
    run_local(ctx, config, &options, |event| {
        let mut seen = seen.lock().unwrap();
        match event {
            Progress::WindowEnded(w) => seen.windows.push(w.clone()),
            Progress::Status(s) => seen.stream = s.stream.clone().or(seen.stream.take()),
            Progress::PassEnded(_) => {}
        }
    })
    .await
    .unwrap()
}

/// Write `body` as `dir/name` the way a producer should: under a name the
/// source ignores, then renamed into place.
fn arrive(dir: &Path, name: &str, body: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

fn a1a_lines() -> Vec<String> {
    std::fs::read_to_string(testdata("a1a")).unwrap().lines().map(|l| format!("{l}\n")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1a_arriving_as_files_is_trained_once_to_82_percent() {
    let dir = tempfile::tempdir().unwrap();
    let lines = a1a_lines();
    let seen = std::sync::Arc::new(Mutex::new(Seen::default()));
    let writer = {
        let (dir, lines, seen) = (dir.path().to_path_buf(), lines.clone(), seen.clone());
        std::thread::spawn(move || {
            for (i, part) in lines.chunks(lines.len().div_ceil(8)).enumerate() {
                std::thread::sleep(Duration::from_millis(150));
                arrive(&dir, &format!("part-{i}.libsvm"), &part.concat());
                // The rest comes once the first part was trained and scored
                // in a window of its own: a job that started late on a
                // loaded machine would otherwise find several parts at once
                // and score its first window near the end's accuracy.
                let scored = || seen.lock().unwrap().windows.iter().any(|w| w.records > 0);
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                while i == 0 && !scored() && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            std::thread::sleep(Duration::from_millis(150));
            std::fs::write(dir.join("_CLOSED"), "").unwrap();
        })
    };
    let report =
        run(&ctx("stream-a1a"), &config(StreamSource::dir(dir.path().to_str().unwrap())), &seen).await;
    writer.join().unwrap();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    eprintln!("{}", report.to_json());
    assert!(report.is_done(), "{report:?}");
    assert_eq!(report.tasks_discarded, 0);
    // Every record once: the examples trained add up to the lines written.
    let trained: u64 = seen.windows.iter().map(|w| w.records).sum();
    assert_eq!(trained, lines.len() as u64, "records trained in the windows: {:?}", seen.windows);
    assert!(report.test_accuracy >= 0.82, "test accuracy {}", report.test_accuracy);
    // It learned as the data came: the first scored window was worse than the end.
    let first = seen.windows.iter().find(|w| w.records > 0).unwrap();
    assert!(
        first.records as usize <= lines.len().div_ceil(8),
        "the first window trained part 0 only: {first:?}"
    );
    assert!(first.test_accuracy < report.test_accuracy, "{:?} then {}", first, report.test_accuracy);
    let lags: Vec<f64> = seen.windows.iter().map(|w| w.lag_seconds).filter(|l| l.is_finite()).collect();
    assert!(!lags.is_empty() && lags.iter().all(|&l| l >= 0.0), "{lags:?}");
    let stream = seen.stream.expect("the stream's status");
    assert!(stream.closed && stream.position.starts_with("8 files"), "{stream:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_appended_file_is_read_by_whole_lines_and_a_truncated_last_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.libsvm");
    let lines = a1a_lines();
    let written = lines.len() / 2;
    let writer = {
        let (path, lines) = (path.clone(), lines.clone());
        std::thread::spawn(move || {
            use std::io::Write;
            let mut file = std::fs::File::create(&path).unwrap();
            for part in lines[..written].chunks(100) {
                // A line split across two writes: the source waits for its end.
                let text = part.concat();
                let (a, b) = text.split_at(text.len() - 7);
                file.write_all(a.as_bytes()).unwrap();
                file.flush().unwrap();
                std::thread::sleep(Duration::from_millis(60));
                file.write_all(b.as_bytes()).unwrap();
                file.flush().unwrap();
            }
            // A last line cut short, never completed; then the close.
            file.write_all(b"+1 3:1 7:").unwrap();
            file.flush().unwrap();
            std::thread::sleep(Duration::from_millis(200));
            std::fs::write(format!("{}.closed", path.display()), "").unwrap();
        })
    };
    // No held-out data: nothing to score, and the job still ends done.
    let mut config = config(StreamSource::file(path.to_str().unwrap()));
    config.test_data = None;
    let seen = Mutex::new(Seen::default());
    let report = run(&ctx("stream-file"), &config, &seen).await;
    writer.join().unwrap();
    let seen = seen.into_inner().unwrap();
    assert!(report.is_done(), "{report:?}");
    assert!(report.test_accuracy.is_nan(), "nothing scored: {report:?}");
    let trained: u64 = seen.windows.iter().map(|w| w.records).sum();
    assert_eq!(trained, written as u64, "every whole line once, the cut one not at all");
    let stream = seen.stream.expect("the stream's status");
    let named = stream.problems.iter().any(|p| p.contains("log.libsvm") && p.contains("no newline"));
    assert!(named, "the truncated last line is named: {:?}", stream.problems);
}

/// Garbage, a file deleted after it was cut into tasks, and one never
/// completed: each named, the rest trained. The deleted file is made
/// deterministic by running the master and the pserver first, with no
/// trainer, until the file is a task; then deleting it; then training.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_in_a_stream_is_named_and_the_rest_is_trained() {
    let dir = tempfile::tempdir().unwrap();
    let lines = a1a_lines();
    arrive(dir.path(), "good-0.libsvm", &lines[..400].concat());
    arrive(dir.path(), "doomed.libsvm", &lines[400..500].concat());
    arrive(dir.path(), "garbage.libsvm", "this is not libsvm\n\u{0}\u{1}binary junk\n");
    std::fs::write(dir.path().join("half-written.tmp"), lines[500..520].concat()).unwrap();
    let mut config = config(StreamSource::dir(dir.path().to_str().unwrap()));
    config.max_failures = 2;
    let ctx = ctx("stream-bad");
    let stop = CancellationToken::new();
    let pserver = {
        let ctx = ctx.clone();
        let stop = stop.clone();
        tokio::spawn(async move { role::pserver(&ctx, &RoleOptions::new("pserver-0"), stop).await })
    };
    let seen = Arc::new(Mutex::new(Seen::default()));
    let master = {
        let (ctx, config, seen, stop) = (ctx.clone(), config.clone(), seen.clone(), stop.clone());
        tokio::spawn(async move {
            role::master(&ctx, &config, &RoleOptions::new("master"), stop, move |event| {
                if let Progress::Status(s) = event {
                    let mut seen = seen.lock().unwrap();
                    seen.stream = s.stream.clone().or(seen.stream.take());
                }
            })
            .await
        })
    };
    let cut = support::wait_until(Duration::from_secs(20), || {
        seen.lock().unwrap().stream.as_ref().is_some_and(|s| s.position.starts_with("3 files"))
    });
    assert!(cut, "the files never became tasks");
    std::fs::remove_file(dir.path().join("doomed.libsvm")).unwrap();
    arrive(dir.path(), "good-1.libsvm", &lines[520..900].concat());
    let trainer = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            role::trainer(&ctx, &RoleOptions::new("trainer-0"), CancellationToken::new()).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::write(dir.path().join("_CLOSED"), "").unwrap();
    let report = master.await.unwrap().unwrap().expect("the job ends");
    trainer.await.unwrap().unwrap();
    stop.cancel();
    pserver.await.unwrap().unwrap();
    eprintln!("{}", report.to_json());
    assert!(report.is_done(), "a stream with bad files still ends done: {report:?}");
    let why =
        |name: &str| report.discarded.iter().find(|(_, why)| why.contains(name)).map(|(_, w)| w.clone());
    let garbage = why("garbage.libsvm").expect("the garbage file is named");
    assert!(garbage.contains("garbage.libsvm:1"), "{garbage}");
    let doomed = why("doomed.libsvm").expect("the deleted file is named");
    assert!(doomed.contains("No such file"), "{doomed}");
    assert_eq!(report.tasks_discarded, 2, "{:?}", report.discarded);
    let stream = seen.lock().unwrap().stream.clone().unwrap();
    assert!(
        stream.problems.iter().any(|p| p.contains("half-written.tmp") && p.contains("never completed")),
        "{:?}",
        stream.problems
    );
    // The good files were trained, all of them: 400 + 380 records.
    assert_eq!(report.tasks_done, 2);
    assert!(report.final_loss.is_finite());
}
