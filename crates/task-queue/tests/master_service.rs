//! The master shell end to end on the in-memory discovery and transport:
//! durability across a restart, standby takeover, fencing, trainers that
//! vanish, and bad requests.

use bytes::Bytes;
use oar_discovery::{Discovery, MemDiscovery};
use oar_task_queue::{
    Chunk, JobState, Master, MasterClient, MasterClientOptions, MasterKeys, MasterOptions, QueueConfig,
    ReportReply, TaskId, TaskReply, TaskSpec, TaskStats,
};
use oar_transport::{Frame, MemNetwork, MemTransport, RemoteErrorKind, RetryPolicy, Transport};
use std::{sync::Arc, time::Duration};

/// The master's keys, under `/job/`, and where trainers register.
fn keys() -> MasterKeys {
    MasterKeys {
        lock: "/job/master/lock".into(),
        addr: "/job/master/addr".into(),
        state: "/job/master/state".into(),
        journal: "/job/master/journal/".into(),
        config: "/job/config".into(),
        members: TRAINERS.into(),
    }
}

const TRAINERS: &str = "/job/trainer/";

fn trainer_key(id: &str) -> String {
    format!("{TRAINERS}{id}")
}

fn client_options(give_up_after: Duration) -> MasterClientOptions {
    MasterClientOptions {
        call_timeout: Duration::from_secs(2),
        retry: RetryPolicy { give_up_after, ..RetryPolicy::default() },
        ..MasterClientOptions::new(keys().addr)
    }
}

fn tasks(n: u64) -> Vec<TaskSpec> {
    (0..n)
        .map(|i| TaskSpec {
            id: TaskId(i),
            chunks: vec![Chunk { path: "data".into(), start: i * 10, end: i * 10 + 10 }],
        })
        .collect()
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

struct Env {
    discovery: Arc<dyn Discovery>,
    transport: Arc<dyn Transport>,
}

impl Env {
    fn new() -> Self {
        Env {
            discovery: Arc::new(MemDiscovery::new()),
            transport: Arc::new(MemTransport::new(MemNetwork::new())),
        }
    }
    async fn master(&self, holder: &str, n: u64) -> Master {
        Master::start(self.discovery.clone(), self.transport.clone(), "mem:0", tasks(n), options(holder))
            .await
            .unwrap()
    }
    fn client(&self) -> MasterClient {
        MasterClient::new(
            self.discovery.clone(),
            self.transport.clone(),
            client_options(Duration::from_secs(10)),
        )
    }
}

async fn take(client: &MasterClient, trainer: &str) -> (TaskSpec, oar_task_queue::TaskRef) {
    match client.get_task(trainer).await.unwrap() {
        TaskReply::Assigned { task, task_ref, .. } => (task, task_ref),
        other => panic!("expected a task, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_task_survives_a_master_restart_and_a_standby_takes_over() {
    let env = Env::new();
    let first = env.master("m1", 3).await;
    let client = env.client();
    let (task, task_ref) = take(&client, "t1").await;
    let stats = TaskStats { examples: 10, loss_sum: 5.0, skipped_lines: 0 };
    assert_eq!(client.task_finished("t1", task_ref, stats).await.unwrap(), ReportReply::Accepted);
    // A second report of the same assignment changes nothing.
    assert_eq!(client.task_finished("t1", task_ref, stats).await.unwrap(), ReportReply::Stale);

    // A standby waits for the lock while the first master holds it.
    let d = env.discovery.clone();
    let t = env.transport.clone();
    let standby = tokio::spawn(async move { Master::start(d, t, "mem:0", tasks(3), options("m2")).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!standby.is_finished(), "the standby must wait while the lock is held");

    first.shutdown().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(5), standby).await.unwrap().unwrap().unwrap();
    let status = second.status().borrow().clone();
    assert_eq!(status.queue.done, 1, "the finished task was restored as done: {status:?}");

    // The client follows the new master by itself; the finished task is not handed out again.
    let mut seen = Vec::new();
    for _ in 0..2 {
        let (t, r) = take(&client, "t1").await;
        assert_ne!(t.id, task.id);
        seen.push(t.id);
        client.task_finished("t1", r, stats).await.unwrap();
    }
    assert_eq!(client.get_task("t1").await.unwrap(), TaskReply::Done);
    assert_eq!(second.wait().await.unwrap(), JobState::Done);
    seen.sort();
    assert_eq!(seen.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_lost_its_lock_stops_writing_and_serving() {
    let env = Env::new();
    let master = env.master("m1", 3).await;
    let client = env.client();
    let keys = keys();
    assert!(env.discovery.get(&keys.state).await.unwrap().is_some(), "the state is stored at start");
    let (_, first) = take(&client, "t1").await;
    let (_, task_ref) = take(&client, "t1").await;
    // An acknowledged report is stored, with every change before it: nothing is left to write.
    assert_eq!(client.task_finished("t1", first, TaskStats::default()).await.unwrap(), ReportReply::Accepted);
    let before = env.discovery.get(&keys.state).await.unwrap().unwrap();

    // Someone else takes the lock: delete it and create it anew.
    env.discovery.delete(&keys.lock).await.unwrap();
    env.discovery.put(&keys.lock, b"intruder".to_vec(), None).await.unwrap();

    let transport_only = MasterClient::new(
        env.discovery.clone(),
        env.transport.clone(),
        client_options(Duration::from_millis(300)),
    );
    let err = transport_only.task_finished("t1", task_ref, TaskStats::default()).await.unwrap_err();
    assert!(err.to_string().contains("lock"), "{err}");
    let after = env.discovery.get(&keys.state).await.unwrap().unwrap();
    assert_eq!(before.mod_revision, after.mod_revision, "a fenced-out master must not write the state");
    assert!(master.wait().await.is_err(), "wait ends with the reason the master stopped");
    let err = transport_only.get_task("t2").await.unwrap_err();
    assert!(err.to_string().contains("not serving"), "{err}");
}

/// A state etcd would refuse (over `max_state_bytes`) is an error that
/// names the sizes: at start the master does not start; running, it stops
/// (it used to retry the write for ever, acknowledging nothing again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_over_the_limit_stops_the_master_with_an_error_naming_it() {
    let env = Env::new();
    let tiny = MasterOptions { max_state_bytes: Some(16), ..options("m1") };
    match Master::start(env.discovery.clone(), env.transport.clone(), "mem:0", tasks(3), tiny).await {
        Err(oar_task_queue::Error::StateTooLarge { bytes, max: 16, .. }) => assert!(bytes > 16),
        Err(e) => panic!("expected StateTooLarge, got {e}"),
        Ok(_) => panic!("a master started with a state over its limit"),
    }

    // The start state of 3 tasks fits in this limit; a discard's 500-byte
    // reason, listed in the next journal record, does not.
    let env = Env::new();
    let started = env.master("m2", 3).await;
    let start_bytes = env.discovery.get(&keys().state).await.unwrap().unwrap().value.len();
    started.shutdown().await.unwrap();
    let env = Env::new();
    let limited = MasterOptions { max_state_bytes: Some(start_bytes + 200), ..options("m3") };
    let master = Master::start(env.discovery.clone(), env.transport.clone(), "mem:0", tasks(3), limited)
        .await
        .unwrap();
    let client = MasterClient::new(
        env.discovery.clone(),
        env.transport.clone(),
        client_options(Duration::from_secs(3)),
    );
    let reason = "r".repeat(500);
    for _ in 0..4 {
        // max_failures is 2, and a failed task goes to the back: the
        // fourth failure discards the first task.
        let (_, task_ref) = take(&client, "t1").await;
        let _ = client.task_failed("t1", task_ref, &reason).await;
    }
    let err = tokio::time::timeout(Duration::from_secs(10), master.wait()).await.unwrap().unwrap_err();
    assert!(err.to_string().contains("over its limit"), "{err}");
    assert!(err.to_string().contains(&format!("limit of {}", start_bytes + 200)), "{err}");
}

/// Also when the trainer asks for a task after its departure was handled
/// (its request on the way, or retried, past its lease): it is handed one,
/// and the task goes back at once, where no departure would come for it
/// again and it would wait for its 60 s timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_trainer_s_tasks_return_to_todo_at_once() {
    let env = Env::new();
    let master = env.master("m1", 2).await;
    let lease = env.discovery.grant_lease(Duration::from_secs(30)).await.unwrap();
    env.discovery.put(&trainer_key("t1"), b"t1".to_vec(), Some(lease)).await.unwrap();
    let client = env.client();
    take(&client, "t1").await;
    assert_eq!(master.status().borrow().queue.pending, 1);

    env.discovery.revoke_lease(lease).await.unwrap();
    let mut status = master.status();
    tokio::time::timeout(
        Duration::from_secs(5),
        status.wait_for(|s| s.queue.pending == 0 && s.queue.todo == 2),
    )
    .await
    .expect("the task returns to todo long before its 60 s timeout")
    .unwrap();
    assert_eq!(master.status().borrow().queue.failures, 1);

    // t1 asks again after its departure was handled.
    take(&client, "t1").await;
    tokio::time::timeout(
        Duration::from_secs(5),
        status.wait_for(|s| s.queue.pending == 0 && s.queue.todo == 2),
    )
    .await
    .expect("a task handed out after the departure goes back long before its timeout")
    .unwrap();
    // A registered trainer keeps what it is handed.
    env.discovery.put(&trainer_key("t2"), b"t2".to_vec(), None).await.unwrap();
    take(&client, "t2").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(master.status().borrow().queue.pending, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_an_error_and_harm_nothing() {
    let env = Env::new();
    let master = env.master("m1", 2).await;
    let conn = env.transport.connect(master.addr()).await.unwrap();
    let garbage = Frame {
        method: oar_task_queue::protocol::MASTER_METHOD,
        meta: Bytes::from_static(&[0xff; 9]),
        payload: Bytes::new(),
    };
    match conn.call(garbage, Duration::from_secs(1)).await.unwrap_err() {
        oar_transport::Error::Remote { error, .. } => {
            assert_eq!(error.kind, RemoteErrorKind::BadRequest);
            assert!(error.message.contains("decode"), "{}", error.message);
        }
        other => panic!("expected a bad-request error, got {other}"),
    }
    let wrong_method = Frame { method: 7, ..Frame::default() };
    assert!(conn.call(wrong_method, Duration::from_secs(1)).await.is_err());
    // A report for a task that was never handed out is stale, not an error.
    let bogus = oar_task_queue::TaskRef { task: TaskId(99), pass: 0, attempt: 0 };
    let client = env.client();
    assert_eq!(client.task_finished("t1", bogus, TaskStats::default()).await.unwrap(), ReportReply::Stale);
    let refused = |e: oar_task_queue::Error, words: &str| match e {
        oar_task_queue::Error::Transport(oar_transport::Error::Remote { error, .. }) => {
            assert_eq!(error.kind, RemoteErrorKind::BadRequest);
            assert!(error.message.contains(words), "{:?} should say {words:?}", error.message);
        }
        other => panic!("expected a bad request about {words:?}, got {other}"),
    };
    // A trainer id of 2 MiB would go into the stored state with its task
    // and make every save too large for etcd.
    let huge = "t".repeat(2 << 20);
    refused(client.get_task(&huge).await.unwrap_err(), "trainer id of 2097152 bytes");
    refused(client.get_task("").await.unwrap_err(), "trainer id of 0 bytes");
    // A loss that is not a number is refused before the task counts as done.
    let (_, r) = take(&client, "t1").await;
    let nan = TaskStats { examples: 3, loss_sum: f64::NAN, skipped_lines: 0 };
    refused(client.task_finished("t1", r, nan).await.unwrap_err(), "loss sum of NaN");
    assert_eq!(master.status().borrow().queue.done, 0);
    // Counts that would overflow saturate (they panicked in a debug build,
    // after the task was marked done).
    let most = TaskStats { examples: u64::MAX, loss_sum: 1.0, skipped_lines: u64::MAX };
    assert_eq!(client.task_finished("t1", r, most).await.unwrap(), ReportReply::Accepted);
    let (_, r) = take(&client, "t1").await;
    let some = TaskStats { examples: 5, loss_sum: 1.0, skipped_lines: 2 };
    assert_eq!(client.task_finished("t1", r, some).await.unwrap(), ReportReply::Accepted);
    assert_eq!(master.wait().await.unwrap(), JobState::Done);
    let pass = master.status().borrow().passes[0];
    assert_eq!((pass.examples, pass.skipped_lines, pass.tasks_finished), (u64::MAX, u64::MAX, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_master_takes_back_the_tasks_of_trainers_gone_while_no_master_ran() {
    let env = Env::new();
    let lease = env.discovery.grant_lease(Duration::from_secs(30)).await.unwrap();
    for trainer in ["alive", "dead"] {
        env.discovery.put(&trainer_key(trainer), trainer.into(), Some(lease)).await.unwrap();
    }
    let first = env.master("m1", 3).await;
    let client = env.client();
    take(&client, "alive").await;
    take(&client, "dead").await;
    first.shutdown().await.unwrap();

    // "dead" leaves while no master runs: no watch sees it go.
    env.discovery.delete(&trainer_key("dead")).await.unwrap();
    let second = env.master("m2", 3).await;
    let status = second.status().borrow().clone();
    assert_eq!(
        (status.queue.pending, status.queue.todo),
        (1, 2),
        "only the live trainer keeps its task: {status:?}"
    );
    assert_eq!(status.queue.failures, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_are_journal_records_and_a_crashed_master_s_successor_replays_them() {
    let env = Env::new();
    let keys = keys();
    let two_passes = |holder: &str| {
        let mut o = options(holder);
        o.queue.passes = 2;
        o
    };
    let start = |holder: &str| {
        // Enough tasks that a few records stay smaller than a snapshot.
        Master::start(env.discovery.clone(), env.transport.clone(), "mem:0", tasks(200), two_passes(holder))
    };
    let first = start("m1").await.unwrap();
    let snapshot_revision = env.discovery.get(&keys.state).await.unwrap().unwrap().mod_revision;
    let client = env.client();
    let stats = TaskStats { examples: 10, loss_sum: 2.5, skipped_lines: 1 };
    for _ in 0..3 {
        let (_, r) = take(&client, "t1").await;
        assert_eq!(client.task_finished("t1", r, stats).await.unwrap(), ReportReply::Accepted);
    }
    let (_, failed) = take(&client, "t1").await;
    assert_eq!(client.task_failed("t1", failed, "bad disk").await.unwrap(), ReportReply::Accepted);
    let records = env.discovery.get_prefix(&keys.journal).await.unwrap().kvs;
    assert!(records.len() >= 4, "one record per acknowledged report at least: {}", records.len());
    assert!(records.iter().all(|kv| kv.value.len() < 200), "records are small");
    assert_eq!(
        env.discovery.get(&keys.state).await.unwrap().unwrap().mod_revision,
        snapshot_revision,
        "reports must not rewrite the snapshot"
    );
    let before = first.status().borrow().clone();
    assert_eq!((before.queue.done, before.queue.failures, before.passes[0].examples), (3, 1, 30));

    // A crash: no final write. The successor gets the lock when the lease ends.
    drop(first);
    let second = tokio::time::timeout(Duration::from_secs(10), start("m2")).await.unwrap().unwrap();
    assert_eq!(*second.status().borrow(), before, "snapshot + journal restore every report");
    assert!(
        env.discovery.get_prefix(&keys.journal).await.unwrap().kvs.is_empty(),
        "a starting master stores a snapshot and deletes the records it covers"
    );

    // Finishing pass 0 starts pass 1 with a snapshot; then records again.
    while second.status().borrow().queue.pass == 0 {
        let (_, r) = take(&client, "t2").await;
        assert_eq!(client.task_finished("t2", r, stats).await.unwrap(), ReportReply::Accepted);
    }
    let (_, r) = take(&client, "t2").await;
    assert_eq!(client.task_finished("t2", r, stats).await.unwrap(), ReportReply::Accepted);
    let records = env.discovery.get_prefix(&keys.journal).await.unwrap().kvs;
    assert!(
        !records.is_empty() && records.len() <= 2,
        "the pass's snapshot cleared the journal: {}",
        records.len()
    );
    let stored = oar_task_queue::master::load(&*env.discovery, &keys).await.unwrap().unwrap();
    assert_eq!(stored.status(two_passes("x").queue).unwrap(), *second.status().borrow());
}
