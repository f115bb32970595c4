//! A job as separate OS processes (the `master`, `pserver` and `trainer`
//! examples) around a real etcd that the test starts: training `a1a` end to
//! end, a standby master taking over from a killed one, and fencing of a
//! master that lost its lock. Fails (never skips) when etcd cannot start:
//! `scripts/test.sh` installs it.
#![cfg(feature = "etcd")]

use crate::support;

use oar::{
    discovery::{Discovery, EtcdDiscovery},
    job::keys::JobKeys,
    task_queue::{
        protocol::{MasterRequest, MASTER_METHOD},
        tasks_from_chunks, Chunk, Error as QueueError, Master, MasterClient, MasterClientOptions,
        MasterOptions, QueueConfig, TaskReply,
    },
    transport::{call, MemNetwork, MemTransport, Transport},
};
use std::{sync::Arc, time::Duration};
use support::{a1a_job, dump, exits, Cluster};

const LONG: Duration = Duration::from_secs(120);

#[test]
fn a_job_of_separate_processes_trains_a1a() {
    let cluster = Cluster::start("a1a");
    // Pservers and trainers first: they wait for the master's options.
    // One pserver with a fixed MTU for peers off this host (on loopback the
    // loopback tuning applies): the flag reaches the transport and harms nothing.
    let mut pservers = vec![
        cluster.pserver("pserver-0", 1.0),
        cluster.pserver_with("pserver-1", 1.0, &cluster.etcd.endpoint(), &["--mtu", "8952"]),
    ];
    let mut trainers: Vec<_> = (0..3).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let mut master = cluster.master("master", &a1a_job());

    let everyone: Vec<_> = pservers.iter().chain(&trainers).collect();
    assert!(exits(&mut master, LONG, &everyone), "the master failed\n{}{}", master.dump(), dump(&everyone));
    let out = master.stdout();
    assert_eq!(out.lines().filter(|l| l.starts_with("pass ")).count(), 5, "{out}");
    let report = master.last_json();
    assert_eq!(report["state"], "done", "{report}");
    assert_eq!(report["passes"], 5, "{report}");
    let accuracy = report["test_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.82, "test accuracy {accuracy} on a1a.t is below 82%\n{report}");

    let mut trained = 0;
    for trainer in &mut trainers {
        let name = trainer.name.clone();
        assert!(exits(trainer, LONG, &[]), "{name} failed\n{}", trainer.dump());
        trained += trainer.last_json()["tasks_finished"].as_u64().unwrap();
        // Piped, a trainer prints a line for every pass, however short.
        let out = trainer.stdout();
        for pass in 1..=5 {
            assert!(out.contains(&format!("pass {pass}/5: tasks done")), "pass {pass} missing:\n{out}");
        }
    }
    assert_eq!(Some(trained), report["tasks_done"].as_u64(), "the trainers' tasks add up to the job's");
    // The shards are spread over both pservers, each primary of its own.
    let mut primaries: Vec<u64> = Vec::new();
    for pserver in &mut pservers {
        let name = pserver.name.clone();
        assert!(exits(pserver, LONG, &[]), "{name} failed\n{}", pserver.dump());
        let out = pserver.last_json();
        let held = out["primaries"].as_object().unwrap_or_else(|| panic!("{out}"));
        assert!(!held.is_empty(), "{name} is primary of no shard: {out}");
        primaries.extend(held.keys().map(|k| k.parse::<u64>().unwrap()));
    }
    primaries.sort();
    assert_eq!(primaries, (0..64).collect::<Vec<_>>(), "each of the 64 shards has one primary");

    let status = cluster.status();
    for wanted in [
        "job a1a",
        "ended: done",
        "shard map version",
        "shard 0: pserver-",
        "checkpoint at step",
        "pass 5: 8 tasks finished",
    ] {
        assert!(status.contains(wanted), "status lacks {wanted:?}:\n{status}");
    }
    // The coordinator stopped before the report was written: the pservers
    // leaving afterwards are not mapped as shards without a replica.
    assert!(!status.contains("UNHEALTHY"), "a finished job's cluster is called unhealthy:\n{status}");

    // A trainer started once the job is over says so at once, instead of
    // waiting out its start-up timeout (120 s) for pservers that are gone.
    let started = std::time::Instant::now();
    let mut late = cluster.trainer("trainer-late");
    assert!(!exits(&mut late, Duration::from_secs(60), &[]), "a late trainer must fail\n{}", late.dump());
    assert!(late.stderr().contains("is over (done)"), "{}", late.dump());
    assert!(started.elapsed() < Duration::from_secs(60), "it waited {:?}", started.elapsed());
}

#[test]
fn a_standby_master_takes_over_when_the_first_is_killed() {
    let cluster = Cluster::start("standby");
    // A job long enough to kill the master in the middle: small tasks, many passes.
    let mut job = a1a_job();
    job.extend(["--passes", "12", "--chunk-bytes", "4096"].map(String::from));
    let mut first = cluster.master("master-a", &job);
    let holds = support::wait_until(LONG, || cluster.status().contains("master: master-a at"));
    assert!(holds, "the first master did not take the lock\n{}", first.dump());
    let pservers: Vec<_> = (0..2).map(|i| cluster.pserver(&format!("pserver-{i}"), 1.0)).collect();
    let trainers: Vec<_> = (0..2).map(|i| cluster.trainer(&format!("trainer-{i}"))).collect();
    let mut standby = cluster.master("master-b", &job);
    let everyone: Vec<_> = pservers.iter().chain(&trainers).collect();

    let line = first.wait_for_line(LONG, |l| l.starts_with("pass 2/"));
    assert!(line.is_some(), "the first master did not reach pass 2\n{}{}", first.dump(), dump(&everyone));
    assert!(standby.stdout().is_empty(), "the standby must not serve while the first holds the lock");
    first.kill();

    assert!(
        exits(&mut standby, LONG, &everyone),
        "the standby failed\n{}{}",
        standby.dump(),
        dump(&everyone)
    );
    let report = standby.last_json();
    assert_eq!(report["state"], "done", "{report}");
    assert_eq!(report["passes"], 12, "the passes before the takeover count: {report}");
    let tasks = report["tasks_done"].as_u64().unwrap();
    assert_eq!(tasks % 12, 0, "every pass finished the same number of tasks: {report}");
    assert!(tasks >= 12 * 25, "a1a in 4 KiB chunks is over 25 tasks a pass: {report}");
    assert!(report["test_accuracy"].as_f64().unwrap() >= 0.8, "{report}");
    assert!(standby.stderr().contains("restored the task queue"), "{}", standby.dump());
}

#[test]
fn an_mtu_out_of_range_is_refused_by_name() {
    for (mtu, why) in [("100", "1200..=65527"), ("70000", "1200..=65527"), ("jumbo", "invalid digit")] {
        let out = std::process::Command::new(support::example("pserver"))
            .args(["--etcd", "http://127.0.0.1:1", "--job", "j", "--ca", "ca", "--cert", "c", "--key", "k"])
            .args(["--mtu", mtu])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("--mtu") && stderr.contains(why), "--mtu {mtu}: {stderr}");
    }
}

#[test]
fn a_master_given_other_options_refuses_to_start() {
    let cluster = Cluster::start("options");
    let mut first = cluster.master("master-a", &a1a_job());
    let trainer = cluster.trainer("trainer-0");
    let pserver = cluster.pserver("pserver-0", 1.0);
    let other = cluster.pserver("pserver-1", 1.0);
    assert!(exits(&mut first, LONG, &[&trainer, &pserver, &other]), "{}", first.dump());

    let mut job = a1a_job();
    job.extend(["--passes", "3"].map(String::from));
    let mut second = cluster.master("master-b", &job);
    let status = second.wait(LONG).expect("the second master exits");
    assert_eq!(status.code(), Some(2), "{}", second.dump());
    assert!(second.stderr().contains("passes: 5 vs 3"), "the error names the option\n{}", second.dump());
}

/// A master whose lock is taken over cannot store the job's state or hand
/// out tasks, and stops by itself.
#[tokio::test]
async fn a_deposed_master_cannot_write_the_job_state() {
    let cluster = Cluster::start("fencing");
    let etcd: Arc<dyn Discovery> =
        Arc::new(EtcdDiscovery::connect(&[cluster.etcd.endpoint()]).await.unwrap());
    let keys = JobKeys::new("fencing").unwrap();
    let network = MemNetwork::new();
    let transport = Arc::new(MemTransport::new(network.clone()));
    let chunks = (0..4).map(|i| Chunk { path: format!("/data/{i}"), start: 0, end: 10 }).collect();
    let tasks = tasks_from_chunks(chunks, 1).unwrap();
    let config = QueueConfig { task_timeout: Duration::from_secs(60), max_failures: 3, passes: 1 };
    let options = |holder: &str| MasterOptions {
        holder: holder.into(),
        lease_ttl: Duration::from_secs(2),
        ..MasterOptions::new(keys.master(), config.clone())
    };
    let first =
        Master::start(etcd.clone(), transport.clone(), "mem:0", tasks.clone(), options("a")).await.unwrap();

    // A standby waits for the lock; the first master's lease is revoked
    // (as when it stalls past its TTL), and the standby takes over.
    let standby = {
        let (etcd, transport, tasks, options) =
            (etcd.clone(), transport.clone(), tasks.clone(), options("b"));
        tokio::spawn(async move { Master::start(etcd, transport, "mem:0", tasks, options).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!standby.is_finished(), "the standby must wait while the first master holds the lock");
    let lock = etcd.get(&keys.master_lock()).await.unwrap().expect("the lock is held");
    etcd.revoke_lease(lock.lease.expect("the lock is under the master's lease")).await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), standby).await.unwrap().unwrap().unwrap();

    // The first master's fenced writes fail...
    let err = first.put_fenced(&keys.master_state(), b"stale".to_vec()).await.unwrap_err();
    assert!(matches!(err, QueueError::Discovery(oar::discovery::Error::FenceLost { .. })), "{err}");
    let stored = etcd.get(&keys.master_state()).await.unwrap().unwrap();
    assert_ne!(stored.value, b"stale", "the deposed master's write must not land");
    // ... it stops by itself, and refuses trainers.
    let stopped = tokio::time::timeout(Duration::from_secs(10), first.wait()).await.expect("it stops");
    assert!(matches!(stopped, Err(QueueError::Stopped(_))), "{stopped:?}");
    let conn = transport.connect(first.addr()).await.unwrap();
    let request = MasterRequest::GetTask { trainer: "t".into() };
    let refused =
        call::<_, TaskReply>(&*conn, MASTER_METHOD, &request, Default::default(), Duration::from_secs(2))
            .await
            .unwrap_err();
    assert!(refused.to_string().contains("not serving"), "{refused}");
    let old =
        MasterClient::new(etcd.clone(), transport.clone(), MasterClientOptions::new(keys.master_addr()));
    // The client follows master/addr, which now names the second master.
    assert!(matches!(old.get_task("t").await.unwrap(), TaskReply::Assigned { .. }));
    assert_eq!(etcd.get(&keys.master_addr()).await.unwrap().unwrap().value, second.addr().as_bytes());
    second.shutdown().await.unwrap();
}
