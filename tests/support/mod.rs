//! Test support for end-to-end tests: the example binaries as real
//! processes (output captured line by line, killed on drop) and a job
//! around a real etcd started for the test.
#![allow(dead_code)] // Each test module uses a part (and without `etcd` some are left out).

use std::{
    io::{BufRead, BufReader, Read},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicI32, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

/// An example binary: `cargo test` builds the examples next to the test
/// binaries' `deps/` directory.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/..");
    let path = dir.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(path.exists(), "the {name} example was not built at {}", path.display());
    path
}

/// The repository's `testdata/` file `name`.
pub fn testdata(name: &str) -> String {
    format!("{}/testdata/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Softmax regression on a1a, scored on a1a.t, with 2 pservers and 8 KiB
/// tasks (15 per pass); callers set the rest.
pub fn a1a_softmax(mode: oar::pserver::Mode) -> oar::job::config::JobConfig {
    let model = oar::trainer::ModelConfig::Softmax { features: 123, classes: 2 };
    let mut config = oar::job::config::JobConfig::new(&testdata("a1a"), model);
    config.test_data = Some(testdata("a1a.t"));
    config.mode = mode;
    config.pservers = 2;
    config.chunk_bytes = 8 << 10;
    config
}

/// Run `config` in this process (master, pservers, `trainers` trainers) on
/// the in-memory discovery and `transport`, listening at `listen`; every
/// pass's report goes to `on_pass`.
pub async fn run_in_process(
    config: &oar::job::config::JobConfig,
    trainers: u32,
    transport: std::sync::Arc<dyn oar::transport::Transport>,
    listen: &str,
    on_pass: impl FnMut(&oar::job::report::PassReport),
) -> oar::job::Result<oar::job::report::JobReport> {
    use oar::job::{local, JobContext};
    let discovery = std::sync::Arc::new(oar::discovery::MemDiscovery::new());
    let ctx = JobContext::new("local", discovery, transport, listen);
    let options = local::LocalOptions { trainers, ..local::LocalOptions::default() };
    let mut on_pass = on_pass;
    local::run_local(&ctx, config, &options, |event| {
        if let oar::job::report::Progress::PassEnded(pass) = event {
            on_pass(pass)
        }
    })
    .await
}

/// Poll `cond` until it holds (true) or `timeout` passes (false).
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cond()
}

/// The address a process printed as "metrics at http://ADDR/metrics".
pub fn metrics_addr(proc: &Proc) -> Option<String> {
    let err = proc.stderr();
    let line = err.lines().find(|l| l.starts_with("metrics at http://"))?;
    Some(line.trim_start_matches("metrics at http://").trim_end_matches("/metrics").to_string())
}

/// One scrape of the Prometheus endpoint at `addr`.
pub fn scrape(addr: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    std::io::Write::write_all(&mut stream, b"GET /metrics HTTP/1.1\r\nHost: oar\r\n\r\n").unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut stream, &mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out
}

/// The value of the sample `name` (with its labels, if any) in a scrape.
pub fn metric_value(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{scrape}"))
}

/// A small deterministic generator for kill schedules (tests print the
/// seed and take it from an environment variable to replay a run).
pub struct Lcg(pub u64);

impl Lcg {
    /// A number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// The seed in environment variable `var`, or one from the clock.
pub fn seed_from(var: &str) -> u64 {
    std::env::var(var).ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    })
}

/// The time a log line was written (its leading RFC 3339 UTC timestamp,
/// as the binaries log), in seconds since the Unix epoch.
pub fn log_time(line: &str) -> Option<f64> {
    let stamp = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut ymd = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let mut hms = time.split(':');
    let (h, min): (f64, f64) = (hms.next()?.parse().ok()?, hms.next()?.parse().ok()?);
    let sec: f64 = hms.next()?.parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Some(days as f64 * 86400.0 + h * 3600.0 + min * 60.0 + sec)
}

/// Now, in seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// A running process with its stdout and stderr collected as they come.
pub struct Proc {
    pub name: String,
    child: Child,
    stdout: Capture,
    stderr: Capture,
    status: Option<ExitStatus>,
}

/// The state letter (R, S, T...) of the thread whose `/proc` directory is
/// `task`, if it still exists.
fn thread_state(task: &Path) -> Option<char> {
    let stat = std::fs::read_to_string(task.join("stat")).ok()?;
    // "tid (comm) S ...": the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// One output stream of a process, read line by line by a thread of its
/// own. What a test reads of it is what that thread has taken so far, so
/// a test that must see everything written waits until the thread has
/// caught up: [`Capture::finished`] once the process exited,
/// [`Capture::caught_up`] while it is stopped (a fixed sleep is not enough
/// on a loaded machine, where the thread may not run for a while).
struct Capture {
    text: Arc<Mutex<String>>,
    reader: JoinHandle<()>,
    /// The reader thread's id, to see whether it is blocked in read(2).
    reader_tid: Arc<AtomicI32>,
    /// A second descriptor of the pipe, to ask how many bytes wait in it.
    pipe: Option<OwnedFd>,
}

impl Capture {
    fn start<S: Read + AsFd + Send + 'static>(stream: S) -> Capture {
        let pipe = stream.as_fd().try_clone_to_owned().ok();
        let text = Arc::<Mutex<String>>::default();
        let reader_tid = Arc::new(AtomicI32::new(0));
        let (into, tid) = (Arc::clone(&text), Arc::clone(&reader_tid));
        let reader = std::thread::spawn(move || {
            // SAFETY: gettid(2) has no preconditions.
            tid.store(unsafe { libc::gettid() }, Ordering::SeqCst);
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { return };
                let mut text = into.lock().unwrap();
                text.push_str(&line);
                text.push('\n');
            }
        });
        Capture { text, reader, reader_tid, pipe }
    }

    fn text(&self) -> String {
        self.text.lock().unwrap().clone()
    }

    /// The stream ended (the process exited) and every line was taken.
    fn finished(&self) -> bool {
        self.reader.is_finished()
    }

    /// Nothing waits in the pipe and the reader thread is blocked reading
    /// it: every complete line written so far was taken. Only meaningful
    /// while the writer is stopped, and while this test holds no lock the
    /// reader takes (it would then be blocked on the lock, not the pipe).
    fn caught_up(&self) -> bool {
        if self.finished() {
            return true;
        }
        let Some(pipe) = &self.pipe else { return false };
        let mut waiting: libc::c_int = 0;
        // SAFETY: FIONREAD on a pipe writes one c_int through the pointer.
        let asked = unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut waiting) };
        let tid = self.reader_tid.load(Ordering::SeqCst);
        if asked != 0 || waiting != 0 || tid == 0 {
            return false;
        }
        // An interruptible sleep, which for this thread is read(2) on the
        // empty pipe.
        thread_state(Path::new(&format!("/proc/self/task/{tid}"))) == Some('S')
    }
}

/// A trainer's log line once the first push of the task in hand is
/// acknowledged (`oar_trainer::worker`).
const FIRST_APPLIED: &str = "first gradients of the task applied";
const BATCH_TRAINED: &str = "batch trained";

impl Proc {
    /// Start `command` as the process called `name`.
    pub fn spawn(name: &str, mut command: Command) -> Proc {
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = command.spawn().unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdout = Capture::start(child.stdout.take().unwrap());
        let stderr = Capture::start(child.stderr.take().unwrap());
        Proc { name: name.to_string(), child, stdout, stderr, status: None }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stdout(&self) -> String {
        self.stdout.text()
    }

    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Its output, for a failure message.
    pub fn dump(&self) -> String {
        // OAR_TEST_DUMP_LINES=N shows more (or less) of each process's output.
        let lines = std::env::var("OAR_TEST_DUMP_LINES").ok().and_then(|n| n.parse().ok()).unwrap_or(150);
        let tail = |s: String| {
            s.lines().rev().take(lines).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
        };
        format!(
            "--- {} (pid {}) stdout:\n{}\n--- {} stderr:\n{}\n",
            self.name,
            self.pid(),
            tail(self.stdout()),
            self.name,
            tail(self.stderr())
        )
    }

    /// SIGKILL, reap it, and read its output to the end.
    pub fn kill(&mut self) {
        self.kill_and_reap();
        self.read_to_end();
    }

    fn kill_and_reap(&mut self) {
        let _ = self.child.kill();
        self.status = self.child.wait().ok();
    }

    /// Send `signal` ("STOP", "CONT", "TERM") to the process.
    pub fn signal(&self, signal: &str) {
        let number = match signal {
            "STOP" => libc::SIGSTOP,
            "CONT" => libc::SIGCONT,
            "TERM" => libc::SIGTERM,
            "INT" => libc::SIGINT,
            other => panic!("no signal {other:?} here"),
        };
        let pid = libc::pid_t::try_from(self.pid()).expect("a pid fits pid_t");
        // SAFETY: kill(2) on our own child's pid, with a valid signal number.
        let sent = unsafe { libc::kill(pid, number) };
        assert_eq!(
            sent,
            0,
            "kill -{signal} {} ({}): {}",
            self.pid(),
            self.name,
            std::io::Error::last_os_error()
        );
    }

    /// SIGSTOP, and wait until every thread of the process is stopped:
    /// kill(2) returns before the signal lands, so without the wait a file
    /// the process was renaming may still appear after the "stop".
    pub fn stop(&self) {
        self.signal("STOP");
        let stopped = wait_until(Duration::from_secs(10), || self.all_threads_stopped());
        assert!(stopped, "{} ({}) did not stop", self.name, self.pid());
    }

    /// Whether every thread of the process is in the stopped state (`T`).
    fn all_threads_stopped(&self) -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid())) else { return false };
        tasks.flatten().all(|task| thread_state(&task.path()) == Some('T'))
    }

    /// Wait until a stdout line satisfies `wanted`; the line, or `None` at
    /// the deadline or when the process exits first.
    pub fn wait_for_line(&mut self, timeout: Duration, wanted: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.stdout().lines().find(|l| wanted(l)) {
                return Some(line.to_string());
            }
            if Instant::now() >= deadline || self.try_status().is_some() {
                // One last look: the line may have come with the exit.
                if self.try_status().is_some() {
                    self.read_to_end();
                }
                return self.stdout().lines().find(|l| wanted(l)).map(str::to_string);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Whether its last task event is "got task": it is training (a
    /// trainer logs "reporting task" before it sends a report).
    pub fn mid_task(&self) -> bool {
        self.last_of(&["got task", "reporting task"]) == Some("got task")
    }

    /// Whether its log says it is in the middle of a task some of whose
    /// gradients the pservers acknowledged.
    pub fn mid_task_pushed(&self) -> bool {
        self.last_of(&["got task", "reporting task", FIRST_APPLIED]) == Some(FIRST_APPLIED)
    }

    /// Whether its log says the batch it is training is not its task's
    /// last: it got the task and trained no batch of it yet (a task of
    /// several batches has batches left then), or its last
    /// "batch trained" (logged at debug: start it with
    /// `OAR_LOG=info,oar_trainer::worker=debug`) is batch `k` of `n` with
    /// `k + 2 <= n`. Stopped there with no grace, it hands its task back
    /// with batches untrained; a first-batch window alone is a sync step
    /// long (well under a millisecond when the others wait for it) and
    /// may never be caught.
    pub fn mid_task_with_batches_left(&self) -> bool {
        let err = self.stderr();
        let last = err
            .lines()
            .rev()
            .find(|l| ["got task", "reporting task", BATCH_TRAINED].iter().any(|m| l.contains(m)));
        match last {
            Some(l) if l.contains("got task") => true,
            Some(l) if l.contains(BATCH_TRAINED) => {
                let field = |name: &str| -> Option<u64> {
                    let at = l.find(&format!(" {name}="))? + name.len() + 2;
                    l[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
                };
                matches!((field("batch"), field("of")), (Some(k), Some(n)) if k + 2 <= n)
            }
            _ => false,
        }
    }

    /// Which of `marks` its log shows last.
    fn last_of<'a>(&self, marks: &[&'a str]) -> Option<&'a str> {
        let err = self.stderr();
        err.lines().rev().find_map(|l| marks.iter().find(|m| l.contains(*m)).copied())
    }

    /// Leave this trainer stopped (SIGSTOP) in the middle of a task: stop
    /// it, look, let it run a little if it was between tasks, try again;
    /// panics if it exits or is never caught within `timeout`.
    pub fn stop_mid_task(&mut self, timeout: Duration) {
        self.stop_when(timeout, Self::mid_task)
    }

    /// [`stop_mid_task`](Self::stop_mid_task), caught in a batch that is
    /// not its task's last (see
    /// [`mid_task_with_batches_left`](Self::mid_task_with_batches_left)).
    pub fn stop_mid_task_with_batches_left(&mut self, timeout: Duration) {
        self.stop_when(timeout, Self::mid_task_with_batches_left)
    }

    /// [`stop_mid_task`](Self::stop_mid_task), caught once some of the
    /// task's gradients were applied.
    pub fn stop_mid_task_pushed(&mut self, timeout: Duration) {
        self.stop_when(timeout, Self::mid_task_pushed)
    }

    /// [`stop_mid_task_pushed`](Self::stop_mid_task_pushed) that answers
    /// whether it was caught within `timeout` instead of panicking, for a
    /// test that can give the trainer more work and try again; if not, the
    /// trainer is left running.
    pub fn try_stop_mid_task_pushed(&mut self, timeout: Duration) -> bool {
        self.try_stop_when(timeout, Self::mid_task_pushed)
    }

    fn stop_when(&mut self, timeout: Duration, state: fn(&Self) -> bool) {
        let caught = self.try_stop_when(timeout, state);
        assert!(caught, "{} was never caught mid-task\n{}", self.name, self.dump());
    }

    fn try_stop_when(&mut self, timeout: Duration, state: fn(&Self) -> bool) -> bool {
        // The trainer runs between looks for a while of varied length, most
        // shorter than a task: with one fixed while, a task shorter than it
        // (tens of ms on a fast machine) could start and end inside every
        // one, and never be caught.
        const RUN_MS: [u64; 5] = [37, 7, 23, 3, 13];
        let mut looks = 0;
        wait_until(timeout, || {
            assert!(self.wait(Duration::ZERO).is_none(), "{} ended first\n{}", self.name, self.dump());
            self.stop();
            self.read_what_was_written();
            let caught = state(self);
            if !caught {
                self.signal("CONT");
                std::thread::sleep(Duration::from_millis(RUN_MS[looks % RUN_MS.len()]));
                looks += 1;
            }
            caught
        })
    }

    /// Wait for it to exit; `None` at the deadline (it keeps running).
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                self.read_to_end();
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// After its exit: wait until the reader threads took the last lines.
    fn read_to_end(&self) {
        // Both streams end with the process (nothing it starts outlives it).
        let ended = wait_until(Duration::from_secs(10), || self.stdout.finished() && self.stderr.finished());
        assert!(ended, "{}'s output did not end within 10 s of its exit", self.name);
    }

    /// While it is stopped: wait until the reader threads took every line
    /// it wrote before the stop.
    fn read_what_was_written(&self) {
        let caught_up =
            wait_until(Duration::from_secs(10), || self.stdout.caught_up() && self.stderr.caught_up());
        assert!(caught_up, "the output {} wrote before its stop was not read within 10 s", self.name);
    }

    /// The last stdout line parsed as JSON.
    pub fn last_json(&self) -> serde_json::Value {
        let out = self.stdout();
        let line =
            out.lines().last().unwrap_or_else(|| panic!("{} printed nothing\n{}", self.name, self.dump()));
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: {e}: {line:?}\n{}", self.name, self.dump()))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            // A stopped process must be continued to die promptly.
            if let Ok(pid) = libc::pid_t::try_from(self.pid()) {
                // SAFETY: kill(2) on our own child's pid, with a valid signal number.
                unsafe { libc::kill(pid, libc::SIGCONT) };
            }
            self.kill_and_reap();
        }
    }
}

#[cfg(feature = "etcd")]
#[allow(unused_imports)] // Not every test binary runs a cluster.
pub use cluster::*;

#[cfg(feature = "etcd")]
mod cluster {
    use super::{example, testdata, wait_until, Proc};
    use oar::{discovery::EtcdServer, transport::DevCa};
    use std::collections::BTreeMap;
    use std::{process::Command, time::Duration};

    /// A job's surroundings: a real etcd started for the test on free
    /// loopback ports, certificates, and a directory for checkpoints.
    pub struct Cluster {
        pub etcd: EtcdServer,
        pub dir: tempfile::TempDir,
        pub job: String,
        /// Lease TTL given to every process, in seconds.
        pub lease_ttl: u64,
    }

    /// How long a replicated job's steps may take.
    pub const LONG: Duration = Duration::from_secs(120);

    /// Shards holding the model: a1a's 123×2 weights and 2 biases in 128-float
    /// blocks.
    pub const DATA_SHARDS: usize = 3;

    /// A job that runs until it is stopped: `pservers` pservers, `replicas`
    /// replicas of each of 8 shards, the model in blocks of 128 floats.
    pub fn replicated_job(mode: &str, replicas: u32, pservers: u32) -> Vec<String> {
        replicated_job_in_blocks(mode, replicas, pservers, 128)
    }

    /// [`replicated_job`] with blocks of `block_size` floats.
    pub fn replicated_job_in_blocks(
        mode: &str,
        replicas: u32,
        pservers: u32,
        block_size: u32,
    ) -> Vec<String> {
        let mut job = a1a_job();
        let more = [
            "--chunk-bytes",
            "4096",
            "--task-timeout",
            "600",
            "--passes",
            "100000",
            "--shards",
            "8",
            "--block-size",
            &block_size.to_string(),
            "--mode",
            mode,
            "--replicas",
            &replicas.to_string(),
            "--pservers",
            &pservers.to_string(),
        ];
        job.extend(more.map(String::from));
        job
    }

    /// A running replicated job: its processes, the live pservers last.
    pub struct ReplicatedJob {
        pub cluster: Cluster,
        pub master: Proc,
        pub trainers: Vec<Proc>,
        /// Every pserver started, killed ones kept for their logs.
        pub pservers: Vec<Proc>,
        /// Indices into `pservers` of the live ones.
        pub live: Vec<usize>,
        pub pserver_flags: Vec<&'static str>,
        /// `OAR_LOG` for every pserver, if set.
        pub pserver_log: Option<&'static str>,
        /// Seconds between the pservers' checkpoints (60 unless set).
        pub checkpoint_interval: f64,
        /// Shards holding a part of the model.
        pub data_shards: usize,
        /// `sync` or `async`.
        pub mode: String,
        /// Trainers stopped before the end (SIGTERM), kept for their logs.
        pub stopped_trainers: Vec<Proc>,
    }

    /// How a [`ReplicatedJob`] starts.
    #[derive(Clone, Debug)]
    pub struct JobShape {
        /// `sync` or `async`.
        pub mode: &'static str,
        pub replicas: u32,
        pub pservers: u32,
        pub trainers: u32,
        /// More flags for every pserver.
        pub pserver_flags: Vec<&'static str>,
        /// More job options for the master.
        pub job_flags: Vec<&'static str>,
        /// Floats per block: 128 puts a1a's model over 3 of the 8 shards,
        /// 32 over all 8.
        pub block_size: u32,
        /// `OAR_LOG` for every pserver, if set.
        pub pserver_log: Option<&'static str>,
    }

    impl Default for JobShape {
        /// Async, one replica, one pserver, one trainer, blocks of 128.
        fn default() -> Self {
            JobShape {
                mode: "async",
                replicas: 1,
                pservers: 1,
                trainers: 1,
                pserver_flags: Vec::new(),
                job_flags: Vec::new(),
                block_size: 128,
                pserver_log: None,
            }
        }
    }

    impl ReplicatedJob {
        pub fn start(
            name: &str,
            mode: &'static str,
            replicas: u32,
            pservers: u32,
            trainers: u32,
        ) -> ReplicatedJob {
            Self::launch(name, JobShape { mode, replicas, pservers, trainers, ..JobShape::default() })
        }

        /// Start a job of `shape` and wait until it is healthy.
        pub fn launch(name: &str, shape: JobShape) -> ReplicatedJob {
            let JobShape {
                mode,
                replicas,
                pservers,
                trainers,
                pserver_flags,
                job_flags,
                block_size,
                pserver_log,
            } = shape;
            let cluster = Cluster::start(name);
            let mut options = replicated_job_in_blocks(mode, replicas, pservers, block_size);
            options.extend(job_flags.iter().map(|f| f.to_string()));
            // a1a's 246 weights and 2 biases, placed by size over 8 shards.
            let data_shards = if block_size >= 128 { DATA_SHARDS } else { 8 };
            let mut job = ReplicatedJob {
                master: cluster.master("master", &options),
                trainers: (0..trainers)
                    .map(|i| cluster.trainer_with(&format!("trainer-{i}"), &["--stop-grace", "0"]))
                    .collect(),
                pservers: Vec::new(),
                live: Vec::new(),
                pserver_flags,
                pserver_log,
                checkpoint_interval: 60.0,
                data_shards,
                mode: mode.to_string(),
                stopped_trainers: Vec::new(),
                cluster,
            };
            for _ in 0..pservers {
                job.add_pserver();
            }
            let started = job.master.wait_for_line(LONG, |l| l.starts_with("pass 1/"));
            assert!(started.is_some(), "no pass ended\n{}", job.dump());
            job.wait_healthy();
            job
        }

        pub fn add_pserver(&mut self) {
            let name = format!("pserver-{}", self.pservers.len());
            let etcd = self.cluster.etcd.endpoint();
            let interval = self.checkpoint_interval;
            let env: Vec<(&str, &str)> = self.pserver_log.iter().map(|log| ("OAR_LOG", *log)).collect();
            let pserver = self.cluster.pserver_with_env(&name, interval, &etcd, &self.pserver_flags, &env);
            self.pservers.push(pserver);
            self.live.push(self.pservers.len() - 1);
        }

        pub fn everyone(&self) -> Vec<&Proc> {
            let all = [&self.master].into_iter().chain(&self.trainers).chain(&self.stopped_trainers);
            all.chain(&self.pservers).collect()
        }

        /// Start one more trainer.
        pub fn add_trainer(&mut self) {
            let id = format!("trainer-{}", self.trainers.len() + self.stopped_trainers.len());
            self.trainers.push(self.cluster.trainer_with(&id, &["--stop-grace", "0"]));
        }

        /// SIGTERM the trainer at `index` (of the running ones) and wait
        /// until it exits 0; it is kept, with its report, for the count.
        pub fn stop_trainer(&mut self, index: usize) {
            let mut trainer = self.trainers.remove(index);
            trainer.signal("TERM");
            let others: Vec<&Proc> = self.pservers.iter().chain([&self.master]).collect();
            assert!(
                exits(&mut trainer, LONG, &others),
                "{} did not exit 0\n{}",
                trainer.name,
                trainer.dump()
            );
            self.stopped_trainers.push(trainer);
        }

        /// `status --set-pservers count`: its stdout, or its stderr if it
        /// failed (exit 2 with the reason; any other exit fails the test).
        pub fn scale(&self, count: u32) -> Result<String, String> {
            let out = Command::new(super::example("status"))
                .args(["--etcd", &self.cluster.etcd.endpoint(), "--job", &self.cluster.job])
                .args(["--set-pservers", &count.to_string()])
                .output()
                .unwrap();
            match out.status.code() {
                Some(0) => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
                Some(2) => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
                _ => panic!("status --set-pservers {count} failed: {out:?}"),
            }
        }

        /// Wait until the live pserver at `index` exits 0 as released (its
        /// report says so) and forget it.
        pub fn wait_released(&mut self, index: usize) {
            let pserver = &mut self.pservers[index];
            assert!(exits(pserver, LONG, &[]), "{} was not released\n{}", pserver.name, pserver.dump());
            let out = pserver.last_json();
            assert_eq!(out["released"], true, "{}: {out}", pserver.name);
            assert!(out["primaries"].as_object().is_some_and(|p| p.is_empty()), "released holding: {out}");
            self.live.retain(|&i| i != index);
        }

        pub fn dump(&self) -> String {
            format!("{}{}", self.cluster.status(), dump(&self.everyone()))
        }

        /// Wait until every shard has all its replicas caught up.
        pub fn wait_healthy(&mut self) {
            let healthy = wait_until(LONG, || self.cluster.status().contains("cluster OK"));
            assert!(healthy, "the cluster never became healthy\n{}", self.dump());
            assert!(self.master.wait(Duration::ZERO).is_none(), "the job ended\n{}", self.dump());
        }

        /// The index in `pservers` of the live pserver registered as `name`.
        pub fn live_named(&self, name: &str) -> usize {
            *self
                .live
                .iter()
                .find(|&&i| is_named(&self.pservers[i], name))
                .unwrap_or_else(|| panic!("no live {name}"))
        }

        /// Seconds from `since` (Unix time) to the first call a trainer had
        /// answered by a new primary of `shard` after it: how long the
        /// shard was away.
        pub fn away_since(&self, shard: u32, since: f64) -> Option<f64> {
            let shard = shard.to_string();
            self.trainers
                .iter()
                .flat_map(|t| {
                    let log = t.stderr();
                    log.lines()
                        .filter(|l| l.contains("following the shard's new primary"))
                        .filter(|l| log_field(l, "shard") == Some(shard.as_str()))
                        .filter_map(super::log_time)
                        .collect::<Vec<_>>()
                })
                .filter(|&t| t >= since)
                .map(|t| t - since)
                .reduce(f64::min)
        }

        /// SIGKILL the primary of `shard`, start a new pserver, and wait
        /// until the dead one has left the map and every shard has all its
        /// replicas again. Its name, and the Unix time of the kill.
        pub fn kill_primary(&mut self, shard: u32) -> (String, f64) {
            let victim = self.cluster.primary_of(shard);
            let index = self.live_named(&victim);
            let killed_at = super::unix_now();
            self.kill(index);
            self.add_pserver();
            let moved = wait_until(LONG, || !self.cluster.status().contains(&victim));
            assert!(moved, "{victim} is still in the map\n{}", self.dump());
            self.wait_healthy();
            (victim, killed_at)
        }

        /// SIGKILL the pserver at `index` and forget it.
        pub fn kill(&mut self, index: usize) {
            self.pservers[index].kill();
            self.live.retain(|&i| i != index);
        }

        /// Stop trainers, master and pservers in that order with SIGTERM, and
        /// check that every shard holding the model applied exactly one update
        /// per push (or step) the trainers saw acknowledged.
        pub fn finish_and_count(&mut self) -> u64 {
            let mut acknowledged = 0;
            // Sparse models: the row gradients in those pushes.
            let mut pushed_rows = 0;
            // Per shard, the pushes the trainers saw it take.
            let mut shard_acknowledged: BTreeMap<String, u64> = BTreeMap::new();
            for trainer in &mut self.trainers {
                trainer.signal("TERM");
            }
            for t in 0..self.trainers.len() {
                let others: Vec<&Proc> = self.pservers.iter().chain([&self.master]).collect();
                let trainer = &mut self.trainers[t];
                assert!(exits(trainer, LONG, &others), "{} did not exit 0\n{}", trainer.name, trainer.dump());
            }
            for trainer in self.trainers.iter().chain(&self.stopped_trainers) {
                let out = trainer.last_json();
                assert_eq!(out["pushed_examples"], out["examples"], "gradients left unpushed: {out}");
                assert!(!trainer.stderr().contains("gave up pushing"), "{}", trainer.dump());
                acknowledged += out["pushes"].as_u64().expect("pushes");
                pushed_rows += out["pushed_rows"].as_u64().expect("pushed_rows");
                for (shard, n) in out["shard_pushes"].as_object().unwrap_or_else(|| panic!("{out}")) {
                    *shard_acknowledged.entry(shard.clone()).or_default() += n.as_u64().unwrap();
                }
            }
            assert!(acknowledged > 0, "no push acknowledged\n{}", self.dump());
            // The master first, so that no shard moves while the pservers stop.
            self.master.signal("TERM");
            assert!(
                exits(&mut self.master, LONG, &[]),
                "the master did not stop well\n{}",
                self.master.dump()
            );
            for &i in &self.live {
                self.pservers[i].signal("TERM");
            }
            let mut steps: BTreeMap<String, Vec<u64>> = BTreeMap::new();
            let mut pushes: BTreeMap<String, Vec<u64>> = BTreeMap::new();
            // Row updates the shards' final primaries hold, over every shard.
            let mut row_updates = 0;
            for &i in &self.live {
                let pserver = &mut self.pservers[i];
                assert!(exits(pserver, LONG, &[]), "{} did not stop well\n{}", pserver.name, pserver.dump());
                let out = pserver.last_json();
                for (shard, step) in out["primaries"].as_object().unwrap_or_else(|| panic!("{out}")) {
                    steps.entry(shard.clone()).or_default().push(step.as_u64().unwrap());
                    let applied = out["pushes"][shard].as_u64().unwrap_or_else(|| panic!("{out}"));
                    pushes.entry(shard.clone()).or_default().push(applied);
                }
                for rows in out["row_updates"].as_object().unwrap_or_else(|| panic!("{out}")).values() {
                    row_updates += rows.as_u64().unwrap();
                }
            }
            let with_data: Vec<_> = steps.iter().filter(|(_, s)| s.iter().any(|&s| s > 0)).collect();
            assert_eq!(with_data.len(), self.data_shards, "shards that applied updates: {steps:?}");
            let one_push_one_step =
                self.trainers.len() + self.stopped_trainers.len() == 1 || self.mode == "async";
            for (shard, applied) in with_data {
                if one_push_one_step {
                    assert!(
                        applied.iter().all(|&a| a == acknowledged),
                        "shard {shard} applied {applied:?} updates; the trainers saw {acknowledged} acknowledged\n{}",
                        dump(&self.everyone())
                    );
                }
                let want = shard_acknowledged.get(shard).copied().unwrap_or(0);
                assert!(
                    pushes[shard].iter().all(|&p| p == want),
                    "shard {shard} applied {:?} pushes; the trainers saw it take {want}\n{}",
                    pushes[shard],
                    dump(&self.everyone())
                );
            }
            if one_push_one_step {
                assert_eq!(
                    row_updates,
                    pushed_rows,
                    "the shards hold {row_updates} row updates; the trainers saw {pushed_rows} acknowledged\n{}",
                    dump(&self.everyone())
                );
            }
            eprintln!(
                "{acknowledged} acknowledged, each applied once on every shard; {pushed_rows} row updates"
            );
            self.assert_tasks_once();
            acknowledged
        }

        /// No (task, pass) was accepted twice, and each pass the master
        /// finished had every task accepted once (the trainers' logs, the
        /// stopped ones' included).
        fn assert_tasks_once(&self) {
            let cut = self.master.stderr().lines().find(|l| l.contains("tasks cut")).map(str::to_string);
            let tasks: u64 = cut
                .as_deref()
                .and_then(|l| log_field(l, "tasks"))
                .and_then(|t| t.parse().ok())
                .unwrap_or_else(|| panic!("no task count in the master's log\n{}", self.master.dump()));
            let passes = self.master.stdout().lines().filter(|l| l.starts_with("pass ")).count() as u32;
            let trainers: Vec<&Proc> = self.trainers.iter().chain(&self.stopped_trainers).collect();
            let accepted = accepted_once(&trainers);
            for pass in 0..passes {
                let n = accepted.iter().filter(|(_, p)| *p == pass).count() as u64;
                assert_eq!(
                    n, tasks,
                    "pass {pass} of {passes} finished: {n} of its {tasks} tasks accepted once"
                );
            }
            eprintln!("{passes} passes of {tasks} tasks, each task accepted once per pass");
        }
    }

    /// The a1a job's options.
    pub fn a1a_job() -> Vec<String> {
        ["--data", &testdata("a1a"), "--test-data", &testdata("a1a.t"), "--features", "123", "--classes", "2"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    impl Cluster {
        pub fn start(job: &str) -> Cluster {
            let etcd = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd for the test: {e}"));
            let dir = tempfile::tempdir().unwrap();
            DevCa::new()
                .unwrap()
                .write_files(dir.path().join("certs"), &["master", "pserver", "trainer"])
                .unwrap();
            Cluster { etcd, dir, job: job.to_string(), lease_ttl: 2 }
        }

        /// The connection flags of role `cert` (a certificate name).
        pub fn conn(&self, cert: &str) -> Vec<String> {
            self.conn_via(cert, &self.etcd.endpoint())
        }

        /// The connection flags of role `cert`, reaching etcd at `etcd`.
        pub fn conn_via(&self, cert: &str, etcd: &str) -> Vec<String> {
            let certs = self.dir.path().join("certs");
            let path = |ext: &str| certs.join(format!("{cert}.{ext}")).display().to_string();
            vec![
                "--etcd".into(),
                etcd.to_string(),
                "--job".into(),
                self.job.clone(),
                "--ca".into(),
                certs.join("ca.pem").display().to_string(),
                "--cert".into(),
                path("pem"),
                "--key".into(),
                path("key"),
                "--lease-ttl".into(),
                self.lease_ttl.to_string(),
                "--verbose".into(),
            ]
        }

        fn spawn(&self, name: &str, binary: &str, cert: &str, extra: &[String]) -> Proc {
            self.spawn_via(name, binary, cert, &self.etcd.endpoint(), extra)
        }

        fn spawn_via(&self, name: &str, binary: &str, cert: &str, etcd: &str, extra: &[String]) -> Proc {
            self.spawn_via_env(name, binary, cert, etcd, extra, &[])
        }

        fn spawn_via_env(
            &self,
            name: &str,
            binary: &str,
            cert: &str,
            etcd: &str,
            extra: &[String],
            env: &[(&str, &str)],
        ) -> Proc {
            let mut command = Command::new(example(binary));
            command.args(self.conn_via(cert, etcd)).args(extra);
            command.envs(env.iter().copied());
            Proc::spawn(name, command)
        }

        pub fn master(&self, name: &str, job_options: &[String]) -> Proc {
            let mut extra = vec!["--id".to_string(), name.to_string()];
            extra.extend_from_slice(job_options);
            self.spawn(name, "master", "master", &extra)
        }

        pub fn pserver(&self, name: &str, checkpoint_interval: f64) -> Proc {
            self.pserver_via(name, checkpoint_interval, &self.etcd.endpoint())
        }

        /// The checkpoint directory of shard `shard`: under the job's one
        /// run (`<dir>/<job>/<instance>/`; a path that does not exist
        /// before the first pserver made it).
        pub fn checkpoints(&self, shard: u32) -> std::path::PathBuf {
            let job_dir = self.dir.path().join("checkpoints").join(&self.job);
            let runs: Vec<_> = std::fs::read_dir(&job_dir)
                .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
                .unwrap_or_default();
            assert!(runs.len() <= 1, "one run of the job: {runs:?}");
            runs.into_iter().next().unwrap_or_else(|| job_dir.join("none-yet")).join(format!("shard-{shard}"))
        }

        /// A pserver reaching etcd at `etcd` (a [`Proxy`], say).
        pub fn pserver_via(&self, name: &str, checkpoint_interval: f64, etcd: &str) -> Proc {
            self.pserver_with(name, checkpoint_interval, etcd, &[])
        }

        /// A pserver reaching etcd at `etcd`, with more flags.
        pub fn pserver_with(&self, name: &str, checkpoint_interval: f64, etcd: &str, flags: &[&str]) -> Proc {
            self.pserver_with_env(name, checkpoint_interval, etcd, flags, &[])
        }

        /// As [`Cluster::pserver_with`], with `env` set for the process
        /// (e.g. `OAR_LOG` to see more of what it does).
        pub fn pserver_with_env(
            &self,
            name: &str,
            checkpoint_interval: f64,
            etcd: &str,
            flags: &[&str],
            env: &[(&str, &str)],
        ) -> Proc {
            let dir = self.dir.path().join("checkpoints").display().to_string();
            let interval = checkpoint_interval.to_string();
            let mut extra = vec![
                "--id".to_string(),
                name.to_string(),
                "--checkpoint-dir".into(),
                dir,
                "--checkpoint-interval".into(),
                interval,
            ];
            extra.extend(flags.iter().map(|f| f.to_string()));
            self.spawn_via_env(name, "pserver", "pserver", etcd, &extra, env)
        }

        pub fn trainer(&self, id: &str) -> Proc {
            self.trainer_with(id, &[])
        }

        /// A trainer reaching etcd at `etcd` (a [`Proxy`], say).
        pub fn trainer_via(&self, id: &str, etcd: &str) -> Proc {
            self.spawn_via(id, "trainer", "trainer", etcd, &["--id".to_string(), id.to_string()])
        }

        /// A trainer with more flags.
        pub fn trainer_with(&self, id: &str, flags: &[&str]) -> Proc {
            self.trainer_with_env(id, flags, &[])
        }

        /// A trainer with more flags and `env` set for the process.
        pub fn trainer_with_env(&self, id: &str, flags: &[&str], env: &[(&str, &str)]) -> Proc {
            let mut extra = vec!["--id".to_string(), id.to_string()];
            extra.extend(flags.iter().map(|f| f.to_string()));
            self.spawn_via_env(id, "trainer", "trainer", &self.etcd.endpoint(), &extra, env)
        }

        /// The name of shard `shard`'s primary, once a pserver has
        /// published that it serves it (waits up to 30 s).
        pub fn primary_of(&self, shard: u32) -> String {
            let mut status = String::new();
            let mut primary = None;
            super::wait_until(Duration::from_secs(30), || {
                status = self.status();
                primary = primary_in(&status, shard);
                primary.is_some()
            });
            primary.unwrap_or_else(|| panic!("shard {shard} has no primary in:\n{status}"))
        }

        /// What `status` prints now.
        pub fn status(&self) -> String {
            let out = Command::new(example("status"))
                .args(["--etcd", &self.etcd.endpoint(), "--job", &self.job])
                .output()
                .unwrap();
            assert!(out.status.code().is_some_and(|c| c <= 1), "status failed: {out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    }

    /// Shard `shard`'s primary in a `status` output.
    pub fn primary_in(status: &str, shard: u32) -> Option<String> {
        let prefix = format!("shard {shard}:");
        let line = status.lines().map(str::trim_start).find(|l| l.starts_with(&prefix))?;
        let mut words = line[prefix.len()..].split_whitespace();
        let name = words.next()?;
        (words.next() == Some("primary")).then(|| name.to_string())
    }

    /// Whether `proc` is the pserver registered as `name` (`<id>.<lease>`).
    pub fn is_named(proc: &Proc, name: &str) -> bool {
        name.strip_prefix(proc.name.as_str()).is_some_and(|rest| rest.starts_with('.'))
    }

    /// A TCP proxy in front of etcd that a test can cut: a network
    /// partition between one process and etcd, on loopback.
    pub struct Proxy {
        addr: std::net::SocketAddr,
        cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
        streams: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    }

    impl Proxy {
        pub fn start(target: std::net::SocketAddr) -> Proxy {
            use std::{net::TcpListener, sync::atomic::Ordering};
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let streams = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let (cut2, streams2) = (cut.clone(), streams.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    let Ok(client) = client else { continue };
                    if cut2.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let Ok(server) = std::net::TcpStream::connect(target) else { continue };
                    let mut kept = streams2.lock().unwrap();
                    kept.push(client.try_clone().unwrap());
                    kept.push(server.try_clone().unwrap());
                    for (mut from, mut to) in
                        [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                    {
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut from, &mut to);
                            let _ = to.shutdown(std::net::Shutdown::Both);
                        });
                    }
                }
            });
            Proxy { addr, cut, streams }
        }

        pub fn url(&self) -> String {
            format!("http://{}", self.addr)
        }

        /// Close every connection through the proxy and refuse new ones.
        pub fn cut(&self) {
            self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
            for stream in self.streams.lock().unwrap().drain(..) {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// The value of `name=` among a log line's event fields (quotes
    /// stripped). The fields follow the last `": "` of the line, after the
    /// spans (`task{task=3 pass=0}:`) and the target, so a span's field of the
    /// same name is not taken for the event's.
    pub fn log_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
        let event = &line[line.rfind(": ").map_or(0, |i| i + 2)..];
        let start = event.find(&format!(" {name}="))? + name.len() + 2;
        let value = event[start..].split(' ').next()?;
        Some(value.trim_matches('"'))
    }

    /// The (task, pass) of every report a master accepted, from the trainers' logs.
    pub fn accepted_reports(trainers: &[&Proc]) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        for trainer in trainers {
            for line in trainer.stderr().lines().filter(|l| l.contains("task reported")) {
                if log_field(line, "accepted") == Some("true") {
                    let task = log_field(line, "task").and_then(|t| t.parse().ok());
                    let pass = log_field(line, "pass").and_then(|p| p.parse().ok());
                    out.push((task.expect("task= in the log"), pass.expect("pass= in the log")));
                }
            }
        }
        out
    }

    /// The (task, pass) of every report the trainers saw accepted, sorted,
    /// checked to hold none twice.
    pub fn accepted_once(trainers: &[&Proc]) -> Vec<(u64, u32)> {
        let mut accepted = accepted_reports(trainers);
        accepted.sort();
        let total = accepted.len();
        accepted.dedup();
        assert_eq!(accepted.len(), total, "some (task, pass) was accepted twice");
        accepted
    }

    /// Every task of every pass was finished exactly once: the master's
    /// report counts `tasks_per_pass` finished tasks in each of `passes`
    /// passes, and no (task, pass) was accepted twice by any trainer (dead
    /// ones included). A trainer's own count of a pass may be lower: a report
    /// the master stored just before it died is answered `Stale` by its
    /// successor, which already has the task done.
    pub fn assert_each_task_once(
        trainers: &[&Proc],
        report: &serde_json::Value,
        passes: u32,
        tasks_per_pass: u64,
    ) {
        assert_eq!(report["passes"], passes, "{report}");
        assert_eq!(report["tasks_done"].as_u64(), Some(tasks_per_pass * passes as u64), "{report}");
        let accepted = accepted_once(trainers);
        for pass in 0..passes {
            let n = accepted.iter().filter(|(_, p)| *p == pass).count() as u64;
            assert!(n <= tasks_per_pass, "pass {pass}: {n} tasks accepted, more than {tasks_per_pass}");
        }
    }

    /// Every process's output, for a failure message.
    pub fn dump(procs: &[&Proc]) -> String {
        procs.iter().map(|p| p.dump()).collect()
    }

    /// Wait for `proc` to exit within `timeout`, and return whether it
    /// succeeded; panics with everyone's output if it did not exit.
    pub fn exits(proc: &mut Proc, timeout: Duration, all: &[&Proc]) -> bool {
        match proc.wait(timeout) {
            Some(status) => status.success(),
            None => panic!("{} did not exit within {timeout:?}\n{}{}", proc.name, proc.dump(), dump(all)),
        }
    }
}
