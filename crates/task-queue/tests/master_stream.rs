//! A streaming master end to end on the in-memory discovery and transport:
//! files arriving in a directory become tasks; a master that crashes (no
//! final write) is followed by one that resumes the source from the stored
//! mark; the close key ends the job once everything is trained, even with
//! its source failing, and reports what the source leaves out as its marker
//! would; every byte of every file is in exactly one accepted task.

use oar_discovery::{Discovery, MemDiscovery};
use oar_task_queue::{
    source::{DirSource, DirSourceOptions, FileSource, FileSourceOptions},
    Chunk, JobState, Master, MasterClient, MasterClientOptions, MasterKeys, MasterOptions, QueueConfig,
    ReportReply, StreamOptions, TaskReply, TaskStats,
};
use oar_transport::{MemNetwork, MemTransport, RetryPolicy, Transport};
use std::{collections::BTreeMap, path::Path, sync::Arc, time::Duration};

const CLOSE: &str = "/job/stream/close";

fn keys() -> MasterKeys {
    MasterKeys {
        lock: "/job/master/lock".into(),
        addr: "/job/master/addr".into(),
        state: "/job/master/state".into(),
        journal: "/job/master/journal/".into(),
        config: "/job/config".into(),
        members: "/job/trainer/".into(),
    }
}

fn options(holder: &str) -> MasterOptions {
    let mut o = MasterOptions::new(
        keys(),
        QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 2, passes: 1 },
    );
    o.holder = holder.into();
    o.lease_ttl = Duration::from_secs(1);
    o.tick_interval = Duration::from_millis(20);
    o
}

fn stream(dir: &Path) -> StreamOptions {
    let source = DirSource::new(DirSourceOptions::new(dir, 64));
    StreamOptions {
        poll_every: Duration::from_millis(20),
        close_key: Some(CLOSE.into()),
        ..StreamOptions::new(Box::new(source))
    }
}

/// A master streaming `file` (a FileSource in 64-byte chunks, closed by
/// [`CLOSE`]) on `discovery` and an in-memory transport, and a client of it.
async fn file_stream_master(discovery: &Arc<dyn Discovery>, file: &Path) -> (Master, MasterClient) {
    let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
    let dir = file.parent().expect("the file is in a directory");
    let stream =
        StreamOptions { source: Box::new(FileSource::new(FileSourceOptions::new(file, 64))), ..stream(dir) };
    let master = Master::start_stream(discovery.clone(), transport.clone(), "mem:0", stream, options("m1"))
        .await
        .unwrap();
    let client = MasterClient::new(
        discovery.clone(),
        transport,
        MasterClientOptions { call_timeout: Duration::from_secs(2), ..MasterClientOptions::new(keys().addr) },
    );
    (master, client)
}

/// Write `name` in `dir` as a writer should: under a temporary name, then renamed into place.
fn arrive(dir: &Path, name: &str, lines: usize) -> u64 {
    let body: String = (0..lines).map(|i| format!("{} 1:{i}\n", i % 2)).collect();
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, &body).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
    body.len() as u64
}

/// Take and finish tasks until the master says wait; the chunks finished
/// go to `finished`, and the tasks are counted.
/// Wait (at most 10 s) until `master` has cut files into tasks up to a
/// position starting with `files` ("2 files,") and has tasks to hand out
/// (appended tasks wait until they are stored). The master polls every
/// 20 ms, but on a loaded machine a poll may come much later.
async fn cut(master: &Master, files: &str) {
    let mut status = master.status();
    let wanted = |s: &oar_task_queue::MasterStatus| {
        s.queue.todo > 0 && s.stream.as_ref().is_some_and(|st| st.position.starts_with(files))
    };
    let seen = tokio::time::timeout(Duration::from_secs(10), status.wait_for(wanted)).await;
    assert!(matches!(seen, Ok(Ok(_))), "not cut up to {files}: {:?}", master.status().borrow());
}

async fn drain(client: &MasterClient, trainer: &str, finished: &mut Vec<Chunk>) -> usize {
    let mut tasks = 0;
    loop {
        match client.get_task(trainer).await.unwrap() {
            TaskReply::Assigned { task, task_ref, .. } => {
                let stats = TaskStats { examples: 1, loss_sum: 0.5, skipped_lines: 0 };
                assert_eq!(
                    client.task_finished(trainer, task_ref, stats).await.unwrap(),
                    ReportReply::Accepted
                );
                finished.extend(task.chunks);
                tasks += 1;
            }
            TaskReply::Wait { .. } | TaskReply::Done => return tasks,
            TaskReply::Failed => panic!("the job failed"),
        }
    }
}

/// Every byte of every file in `sizes` is in exactly one chunk of `chunks`.
fn covered_once(chunks: &[Chunk], sizes: &BTreeMap<String, u64>) {
    let mut by_file: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for c in chunks {
        by_file.entry(&c.path).or_default().push((c.start, c.end));
    }
    assert_eq!(by_file.len(), sizes.len(), "files trained: {:?}", by_file.keys());
    for (path, ranges) in &mut by_file {
        ranges.sort();
        let mut at = 0;
        for &(start, end) in ranges.iter() {
            assert_eq!(start, at, "{path}: a gap or an overlap at byte {at}: {ranges:?}");
            at = end;
        }
        assert_eq!(at, sizes[*path], "{path}: trained up to byte {at}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_survives_a_master_crash_and_ends_at_the_close() {
    let dir = tempfile::tempdir().unwrap();
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
    let start = |holder: &str| {
        Master::start_stream(
            discovery.clone(),
            transport.clone(),
            "mem:0",
            stream(dir.path()),
            options(holder),
        )
    };
    let client = MasterClient::new(
        discovery.clone(),
        transport.clone(),
        MasterClientOptions {
            call_timeout: Duration::from_secs(2),
            retry: RetryPolicy { give_up_after: Duration::from_secs(20), ..RetryPolicy::default() },
            ..MasterClientOptions::new(keys().addr)
        },
    );
    let mut sizes = BTreeMap::new();
    let mut finished = Vec::new();
    let path = |name: &str| dir.path().join(name).display().to_string();

    let first = start("m1").await.unwrap();
    assert!(matches!(client.get_task("t").await.unwrap(), TaskReply::Wait { .. }), "an empty stream waits");
    sizes.insert(path("a.libsvm"), arrive(dir.path(), "a.libsvm", 20));
    cut(&first, "1 file,").await;
    let tasks = drain(&client, "t", &mut finished).await;
    assert!(!finished.is_empty(), "the first file was trained");
    let status = first.status().borrow().clone();
    let stream_status = status.stream.clone().expect("a stream's status");
    assert!(stream_status.position.contains("1 file"), "{stream_status:?}");
    assert_eq!(stream_status.lag_count as usize, tasks);

    // A second file arrives and is handed out in part; then the master crashes.
    sizes.insert(path("b.libsvm"), arrive(dir.path(), "b.libsvm", 30));
    cut(&first, "2 files,").await;
    let TaskReply::Assigned { task: lost, .. } = client.get_task("t").await.unwrap() else {
        panic!("b's tasks")
    };
    drop(first);
    sizes.insert(path("c.libsvm"), arrive(dir.path(), "c.libsvm", 10));

    // The successor resumes from the stored mark: b's tasks and c, none of a again.
    let second = tokio::time::timeout(Duration::from_secs(10), start("m2")).await.unwrap().unwrap();
    cut(&second, "3 files,").await;
    let before = finished.len();
    drain(&client, "t2", &mut finished).await;
    assert!(
        finished[before..].iter().all(|c| !c.path.ends_with("a.libsvm")),
        "a was trained before the crash"
    );
    assert!(finished[before..].contains(&lost.chunks[0]), "the task lost in the crash is handed out again");

    // The close key: what is there is trained, then the job is done.
    sizes.insert(path("d.libsvm"), arrive(dir.path(), "d.libsvm", 5));
    discovery.put(CLOSE, b"closed".to_vec(), None).await.unwrap();
    let done = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            drain(&client, "t2", &mut finished).await;
            if second.status().borrow().queue.state == JobState::Done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(done.is_ok(), "the job did not end after the close: {:?}", second.status().borrow());
    assert_eq!(second.wait().await.unwrap(), JobState::Done);
    assert_eq!(client.get_task("t2").await.unwrap(), TaskReply::Done);
    covered_once(&finished, &sizes);
    // A file arriving after the close is not trained.
    arrive(dir.path(), "e.libsvm", 5);
    assert!(second.status().borrow().stream.as_ref().unwrap().closed);
}

/// A source that panics is a bug the stream cannot get past: the master
/// stops serving and says why, instead of waiting for data for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_panics_stops_the_master_and_says_why() {
    struct Broken;
    impl oar_task_queue::source::TaskSource for Broken {
        fn describe(&self) -> String {
            "the broken source".into()
        }
        fn poll(
            &mut self,
            _: &oar_task_queue::source::SourceMark,
        ) -> oar_task_queue::Result<oar_task_queue::source::Polled> {
            panic!("a bug in the source")
        }
        fn close(
            &mut self,
            mark: &oar_task_queue::source::SourceMark,
        ) -> oar_task_queue::Result<oar_task_queue::source::Polled> {
            self.poll(mark)
        }
    }
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
    let stream =
        StreamOptions { poll_every: Duration::from_millis(20), ..StreamOptions::new(Box::new(Broken)) };
    let master = Master::start_stream(discovery, transport, "mem:0", stream, options("m1")).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), master.wait()).await.expect("the master stops");
    let why = ended.unwrap_err().to_string();
    assert!(why.contains("the broken source") && why.contains("panicked"), "{why}");
}

/// A close asked while the source cannot be polled (its file removed after
/// some of it was trained) ends the job at the last good poll, and the
/// stream's problems say what was left out. The poll's error used to be
/// retried for ever: the job never ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_ends_a_stream_whose_source_fails_and_names_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("log.libsvm");
    std::fs::write(&file, "0 1:1\n1 1:2\n").unwrap();
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let (master, client) = file_stream_master(&discovery, &file).await;
    cut(&master, "byte 12").await;
    let mut finished = Vec::new();
    drain(&client, "t", &mut finished).await;
    assert_eq!(finished, [Chunk { path: file.display().to_string(), start: 0, end: 12 }]);

    std::fs::remove_file(&file).unwrap();
    discovery.put(CLOSE, b"closed".to_vec(), None).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), master.wait()).await;
    let status = master.status().borrow().clone();
    assert!(matches!(ended, Ok(Ok(JobState::Done))), "the job did not end: {ended:?} {status:?}");
    let stream = status.stream.expect("a stream's status");
    assert!(stream.closed, "{stream:?}");
    let named = stream.problems.iter().any(|p| {
        p.contains("closed while polling the source failed")
            && p.contains("gone")
            && p.contains("byte 12 of 12")
    });
    assert!(named, "the close names the error and where it stopped: {:?}", stream.problems);
    assert_eq!(client.get_task("t").await.unwrap(), TaskReply::Done);
}

/// The close key closes a FileSource as its marker does: a last line with
/// no newline is reported, not dropped in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_close_key_reports_a_last_line_without_its_newline() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("log.libsvm");
    std::fs::write(&file, "0 1:1\n1 1:2").unwrap();
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    discovery.put(CLOSE, b"closed".to_vec(), None).await.unwrap();
    let (master, client) = file_stream_master(&discovery, &file).await;
    let mut finished = Vec::new();
    let done = tokio::time::timeout(Duration::from_secs(10), async {
        while master.status().borrow().queue.state == JobState::Running {
            drain(&client, "t", &mut finished).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(done.is_ok(), "the job did not end: {:?}", master.status().borrow());
    assert_eq!(master.wait().await.unwrap(), JobState::Done);
    let path = file.display().to_string();
    assert_eq!(finished, [Chunk { path: path.clone(), start: 0, end: 6 }]);
    let stream = master.status().borrow().stream.clone().expect("a stream's status");
    assert_eq!(
        stream.problems,
        [format!("{path}: the last line (bytes 6..11) has no newline at the close; not trained")]
    );
}

/// A stream's state grows with the files present in its directory (the
/// mark remembers each): past 3/4 of the limit the master says so in the
/// stream's problems, files before it reaches the limit and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_nearing_its_limit_is_reported_before_the_master_stops() {
    let dir = tempfile::tempdir().unwrap();
    let discovery: Arc<dyn Discovery> = Arc::new(MemDiscovery::new());
    let transport: Arc<dyn Transport> = Arc::new(MemTransport::new(MemNetwork::new()));
    let mut options = options("m1");
    options.max_state_bytes = Some(3000);
    let master =
        Master::start_stream(discovery, transport, "mem:0", stream(dir.path()), options).await.unwrap();
    let warned = |status: &oar_task_queue::MasterStatus| {
        let problems = status.stream.as_ref().map(|s| s.problems.clone()).unwrap_or_default();
        problems
            .iter()
            .any(|p| p.contains("past 75% of its limit of 3000 bytes") && p.contains("remove files"))
    };
    let (mut first_warned, mut stopped) = (None, None);
    for i in 1..=300 {
        arrive(dir.path(), &format!("f{i:03}"), 2);
        let mut status = master.status();
        // "1 file, ...", "2 files, ...".
        let files = format!("{i} file");
        let cut = status.wait_for(|s| s.stream.as_ref().is_some_and(|st| st.position.starts_with(&files)));
        let outcome = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::select! {
                _ = cut => None,
                ended = master.wait() => Some(ended),
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!("file {i} is not cut, the master goes on: {:?}", master.status().borrow())
        });
        if first_warned.is_none() && warned(&master.status().borrow()) {
            first_warned = Some(i);
        }
        if let Some(ended) = outcome {
            stopped = Some((i, ended));
            break;
        }
    }
    let (at, ended) = stopped.expect("the master stops at its limit");
    let why = ended.expect_err("stopped, not ended").to_string();
    assert!(why.contains("over its limit of 3000"), "{why}");
    let warned_at = first_warned.expect("warned before it stopped");
    assert!(warned_at + 3 <= at, "warned files before the limit: at {warned_at}, stopped at {at}");
}
