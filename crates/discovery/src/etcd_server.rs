//! `EtcdServer`: a throwaway single-member etcd on loopback, for tests.
//!
//! It runs Debian's etcd binary (`apt-get install -y etcd-server`) on free
//! loopback ports with a temporary data dir, and is meant to be shared by
//! the tests of one test binary (start it once, lazily, in a `OnceLock`) or
//! owned by one fault-injection test that stops, kills, pauses and restarts
//! it. Starting is synchronous, so it works from any thread or runtime.
//!
//! Nothing is left behind: `Drop` kills the process and removes the data
//! dir, and a small watchdog process (`sh`) does the same when the test
//! process dies without dropping it (a server in a `static` is never
//! dropped; a test process may be killed).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Where Debian's `etcd-server` package puts the binary.
pub const DEBIAN_ETCD: &str = "/usr/bin/etcd";
/// How long [`EtcdServer::start`] waits for etcd to answer.
pub const START_DEADLINE: Duration = Duration::from_secs(20);
/// How long [`EtcdServer::stop`] waits after SIGTERM before it kills.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Attempts with fresh ports when another process took a port first.
const START_ATTEMPTS: usize = 5;
/// Lines of etcd's stderr kept for error messages.
const STDERR_LINES: usize = 40;
/// Of which this many go into an error message.
const STDERR_SHOWN: usize = 12;
/// Longest stderr line kept, in bytes.
const STDERR_LINE_BYTES: usize = 600;
/// Signals used (Linux numbering).
const SIGTERM: i32 = 15;
const SIGCONT: i32 = 18;
const SIGSTOP: i32 = 19;

extern "C" {
    /// POSIX `kill(2)`, from the C library std already links.
    fn kill(pid: i32, sig: i32) -> i32;
}

/// A single-member etcd on `127.0.0.1`, killed and removed on drop.
///
/// ```
/// use oar_discovery::EtcdServer;
///
/// let server = EtcdServer::start()?;
/// assert!(server.endpoint().starts_with("http://127.0.0.1:"));
/// server.kill()?; // a crash; `restart` brings it back with its data
/// server.restart()?;
/// # Ok::<(), oar_discovery::Error>(())
/// ```
pub struct EtcdServer {
    binary: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// Declared before `data_dir`: the process dies before its dir goes.
    process: Mutex<Option<Running>>,
    data_dir: tempfile::TempDir,
}

impl std::fmt::Debug for EtcdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdServer")
            .field("endpoint", &self.endpoint())
            .field("data_dir", &self.data_dir.path())
            .field("pid", &self.pid())
            .finish()
    }
}

/// One incarnation of the etcd process.
struct Running {
    child: Child,
    /// Kills `child` and removes the data dir when this pipe closes.
    watchdog: Child,
    watchdog_pipe: Option<ChildStdin>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// Ends when etcd's stderr closes, that is when the process is gone.
    stderr_thread: Option<thread::JoinHandle<()>>,
}

impl Running {
    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(i32::MAX)
    }

    fn stderr_tail(&self) -> String {
        tail(&self.stderr)
    }

    fn signal(&mut self, signal: i32) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => {}
            Ok(Some(status)) => {
                return Err(Error::Server(format!("etcd (pid {}) has exited ({status})", self.child.id())))
            }
            Err(e) => {
                return Err(Error::Server(format!("cannot check on etcd (pid {}): {e}", self.child.id())))
            }
        }
        // SAFETY: kill(2) takes plain integers; the pid is our own child,
        // checked just above not to be reaped, so it names no other process.
        let status = unsafe { kill(self.pid(), signal) };
        if status != 0 {
            return Err(Error::Server(format!(
                "cannot send signal {signal} to etcd (pid {}): {}",
                self.pid(),
                std::io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// Kills the process (and its watchdog first, so that the watchdog cannot
    /// kill a reused pid) and reaps it.
    fn kill(mut self) -> Result<()> {
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        drop(self.watchdog_pipe.take());
        let _ = self.child.kill();
        let reaped = self.child.wait().map(drop).map_err(|e| {
            Error::Server(format!("cannot reap the killed etcd (pid {}): {e}", self.child.id()))
        });
        if let Some(thread) = self.stderr_thread.take() {
            let _ = thread.join();
        }
        reaped
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    fn stop(mut self, grace: Duration) -> Result<()> {
        // A paused process only handles SIGTERM once continued.
        let _ = self.signal(SIGCONT);
        if self.signal(SIGTERM).is_err() {
            return self.kill();
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(_)) => return self.kill(),
                Ok(None) => thread::sleep(Duration::from_millis(10)),
                Err(_) => break,
            }
        }
        tracing::warn!(pid = self.pid(), ?grace, "etcd did not stop after SIGTERM; killing it");
        self.kill()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Only reached when `kill`/`stop` were not called (a panic, or the
        // server dropped): never leave a process behind.
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if let Some(running) = self.process().take() {
            let _ = running.kill();
        }
    }
}

impl EtcdServer {
    /// Starts etcd from [`DEBIAN_ETCD`] (or `etcd` on the `PATH` if that file
    /// does not exist) and waits until it answers.
    pub fn start() -> Result<EtcdServer> {
        let binary =
            if Path::new(DEBIAN_ETCD).exists() { PathBuf::from(DEBIAN_ETCD) } else { PathBuf::from("etcd") };
        Self::start_with_binary(&binary)
    }

    /// Starts the etcd binary at `binary` on two free loopback ports (client
    /// and peer) with a fresh temporary data dir, and waits up to
    /// [`START_DEADLINE`] until it answers `/health`. Retries with new ports
    /// when one was taken between choosing and binding it. Environment
    /// variables starting with `ETCD_` are not passed on (etcd would read
    /// them as flags).
    pub fn start_with_binary(binary: &Path) -> Result<EtcdServer> {
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            let data_dir = tempfile::Builder::new()
                .prefix("oar-etcd-")
                .tempdir()
                .map_err(|e| Error::Server(format!("cannot create a temporary data dir for etcd: {e}")))?;
            let (client_port, peer_port) = free_ports()?;
            let server = EtcdServer {
                binary: binary.to_path_buf(),
                client_port,
                peer_port,
                process: Mutex::new(None),
                data_dir,
            };
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(Launch::PortTaken(e)) => last_error = Some(e),
                Err(Launch::Failed(e)) => return Err(e),
            }
        }
        Err(last_error.unwrap_or_else(|| Error::Server("etcd did not start".to_string())))
    }

    /// The client URL, `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The client address.
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.client_port))
    }

    /// The data dir (removed when the server is dropped).
    pub fn data_dir(&self) -> &Path {
        self.data_dir.path()
    }

    /// The process id while etcd runs.
    pub fn pid(&self) -> Option<u32> {
        self.process().as_ref().map(|running| running.child.id())
    }

    /// Whether the etcd process is running (it may be paused).
    pub fn is_running(&self) -> bool {
        let mut process = self.process();
        match process.as_mut().map(|running| running.child.try_wait()) {
            Some(Ok(None)) => true,
            Some(_) => false,
            None => false,
        }
    }

    /// The last lines etcd wrote to stderr (its log).
    pub fn stderr_tail(&self) -> String {
        self.process().as_ref().map(Running::stderr_tail).unwrap_or_default()
    }

    /// Stops etcd gracefully (SIGTERM; SIGKILL after 10 s) and waits for it.
    /// The data dir stays for [`EtcdServer::restart`]. Stopping a stopped
    /// server does nothing.
    pub fn stop(&self) -> Result<()> {
        match self.process().take() {
            Some(running) => running.stop(STOP_GRACE),
            None => Ok(()),
        }
    }

    /// Kills etcd at once (SIGKILL, as in a crash) and waits for it. The data
    /// dir stays for [`EtcdServer::restart`].
    pub fn kill(&self) -> Result<()> {
        match self.process().take() {
            Some(running) => running.kill(),
            None => Ok(()),
        }
    }

    /// Freezes etcd (SIGSTOP): connections stay open but nothing answers, as
    /// with a hung server or a partition. [`EtcdServer::resume`] undoes it.
    ///
    /// Returns once every thread of etcd is stopped (kill(2) returns before
    /// the stop takes effect, and a request sent meanwhile could still be
    /// answered).
    pub fn pause(&self) -> Result<()> {
        self.with_running(|running| running.signal(SIGSTOP))?;
        let pid = self.pid().unwrap_or_default();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !all_threads_stopped(pid) {
            if std::time::Instant::now() >= deadline {
                return Err(Error::Server(format!("etcd (pid {pid}) did not stop within 5 s of SIGSTOP")));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Lets a paused etcd run again (SIGCONT), and waits until it answers
    /// `/health` (at most [`START_DEADLINE`]), as [`EtcdServer::restart`]
    /// does: on a loaded machine a request sent the moment after SIGCONT
    /// could still time out while etcd gets going again, which is not the
    /// hiccup a test means to show.
    pub fn resume(&self) -> Result<()> {
        let addr = self.client_addr();
        let endpoint = self.endpoint();
        self.with_running(|running| {
            running.signal(SIGCONT)?;
            wait_until_healthy(running, addr)
                .map_err(|why| Error::Server(format!("etcd at {endpoint} after SIGCONT: {why}")))
        })
    }

    /// Starts a stopped or killed etcd again on the same ports with the same
    /// data (keys, revisions and leases survive), and waits until it answers.
    /// A running server is killed first.
    pub fn restart(&self) -> Result<()> {
        self.kill()?;
        match self.launch() {
            Ok(()) => Ok(()),
            Err(Launch::PortTaken(e) | Launch::Failed(e)) => Err(e),
        }
    }

    /// Fetches `http://127.0.0.1:<port><path>` from etcd's HTTP side (for
    /// instance `/metrics` or `/health`) and returns the body.
    pub fn http_get(&self, path: &str) -> Result<String> {
        http_get(self.client_addr(), path, Duration::from_secs(5))
            .map_err(|e| Error::Server(format!("GET {path} from etcd at {}: {e}", self.endpoint())))
    }

    /// The value of one Prometheus metric from `/metrics` (summed over its
    /// label sets), or `None` if etcd does not report it.
    pub fn metric(&self, name: &str) -> Result<Option<f64>> {
        let body = self.http_get("/metrics")?;
        let mut total = None;
        for line in body.lines() {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            if !(rest.starts_with(' ') || rest.starts_with('{')) {
                continue;
            }
            let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let Some(value) = value {
                total = Some(total.unwrap_or(0.0) + value);
            }
        }
        Ok(total)
    }

    fn process(&self) -> MutexGuard<'_, Option<Running>> {
        self.process.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn with_running(&self, f: impl FnOnce(&mut Running) -> Result<()>) -> Result<()> {
        match self.process().as_mut() {
            Some(running) => f(running),
            None => Err(Error::Server(format!("etcd at {} is not running", self.endpoint()))),
        }
    }

    /// Runs the process and waits until it answers.
    fn launch(&self) -> std::result::Result<(), Launch> {
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(&self.binary);
        command
            .arg("--name")
            .arg("oar-test")
            .arg("--data-dir")
            .arg(self.data_dir.path())
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("oar-test={peer_url}"), "--initial-cluster-state", "new"])
            // Healthy in about 0.1 s, and a 1 s lease ttl stands (etcd's
            // minimum ttl follows the election timeout).
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD_") {
                command.env_remove(&name);
            }
        }
        // etcd 3.4 refuses to run on arm64 unless told it may.
        if std::env::consts::ARCH == "aarch64" {
            command.env("ETCD_UNSUPPORTED_ARCH", "arm64");
        }
        let mut child = command.spawn().map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::NotFound => {
                    " (not installed? `apt-get install -y etcd-server` installs it as /usr/bin/etcd)"
                }
                _ => "",
            };
            Launch::Failed(Error::Server(format!("cannot run {}: {e}{hint}", self.binary.display())))
        })?;
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let mut stderr_thread = None;
        if let Some(pipe) = child.stderr.take() {
            let lines = stderr.clone();
            let spawned =
                thread::Builder::new().name("etcd-stderr".to_string()).spawn(move || drain(pipe, &lines));
            match spawned {
                Ok(thread) => stderr_thread = Some(thread),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let why = format!("cannot start a thread to read etcd's log: {e}");
                    return Err(Launch::Failed(Error::Server(why)));
                }
            }
        }
        let (watchdog, watchdog_pipe) = match spawn_watchdog(child.id(), self.data_dir.path()) {
            Ok(watchdog) => watchdog,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Launch::Failed(e));
            }
        };
        let mut running =
            Running { child, watchdog, watchdog_pipe: Some(watchdog_pipe), stderr, stderr_thread };
        match wait_until_healthy(&mut running, self.client_addr()) {
            Ok(()) => {
                *self.process() = Some(running);
                Ok(())
            }
            Err(why) => {
                let exited = matches!(running.child.try_wait(), Ok(Some(_)));
                let stderr = running.stderr.clone();
                // Also waits until the stderr thread has read the last lines.
                let _ = running.kill();
                let log = tail(&stderr);
                let message = format!(
                    "etcd ({} on {}) did not come up: {why}; its last log lines:\n{log}",
                    self.binary.display(),
                    self.endpoint()
                );
                let port_taken = exited && log.contains("address already in use");
                Err(if port_taken {
                    Launch::PortTaken(Error::Server(message))
                } else {
                    Launch::Failed(Error::Server(message))
                })
            }
        }
    }
}

/// Why a launch failed: a port race (try again with new ports) or anything else.
enum Launch {
    PortTaken(Error),
    Failed(Error),
}

/// Polls `/health` until etcd says it is healthy, the process exits, or
/// [`START_DEADLINE`] passes.
fn wait_until_healthy(running: &mut Running, addr: SocketAddr) -> std::result::Result<(), String> {
    let started = Instant::now();
    let mut last = String::from("no answer yet");
    while started.elapsed() < START_DEADLINE {
        match running.child.try_wait() {
            Ok(Some(status)) => return Err(format!("it exited with {status}")),
            Ok(None) => {}
            Err(e) => return Err(format!("cannot check on the process: {e}")),
        }
        match http_get(addr, "/health", Duration::from_secs(1)) {
            Ok(body) if body.contains("\"health\":\"true\"") => return Ok(()),
            Ok(body) => last = format!("/health answered {body:?}"),
            Err(e) => last = e,
        }
        thread::sleep(Duration::from_millis(20));
    }
    Err(format!("not healthy within {START_DEADLINE:?} (last check: {last})"))
}

/// Two ports that were free a moment ago (both bound at once, so distinct).
fn free_ports() -> Result<(u16, u16)> {
    let bind = || {
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|listener| listener.local_addr().map(|addr| (listener, addr.port())))
            .map_err(|e| Error::Server(format!("cannot find a free loopback port: {e}")))
    };
    let (_client, client_port) = bind()?;
    let (_peer, peer_port) = bind()?;
    Ok((client_port, peer_port))
}

/// Starts `sh`, which kills `pid` and removes `data_dir` once its stdin
/// closes: when we kill it first (normal cleanup) nothing happens; when this
/// process dies, the kernel closes the pipe and the watchdog cleans up.
fn spawn_watchdog(pid: u32, data_dir: &Path) -> Result<(Child, ChildStdin)> {
    let mut watchdog = Command::new("sh")
        .arg("-c")
        .arg("while read -r _; do :; done; kill -9 \"$1\" 2>/dev/null; rm -rf \"$2\"")
        .arg("oar-etcd-watchdog")
        .arg(pid.to_string())
        .arg(data_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Error::Server(format!("cannot start the watchdog shell for etcd: {e}")))?;
    match watchdog.stdin.take() {
        Some(pipe) => Ok((watchdog, pipe)),
        None => {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
            Err(Error::Server("the watchdog shell for etcd has no stdin".to_string()))
        }
    }
}

/// Keeps the last [`STDERR_LINES`] lines of etcd's stderr.
fn drain(pipe: impl Read, lines: &Mutex<VecDeque<String>>) {
    let mut reader = BufReader::new(pipe);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let end = buf.len().min(STDERR_LINE_BYTES);
                let line = String::from_utf8_lossy(&buf[..end]).trim_end().to_string();
                let mut lines = lines.lock().unwrap_or_else(PoisonError::into_inner);
                if lines.len() == STDERR_LINES {
                    lines.pop_front();
                }
                lines.push_back(line);
            }
        }
    }
}

fn tail(lines: &Mutex<VecDeque<String>>) -> String {
    let lines = lines.lock().unwrap_or_else(PoisonError::into_inner);
    let skip = lines.len().saturating_sub(STDERR_SHOWN);
    let shown: Vec<&str> = lines.iter().skip(skip).map(String::as_str).collect();
    if shown.is_empty() {
        "(nothing)".to_string()
    } else {
        shown.join("\n")
    }
}

/// A minimal HTTP/1.1 GET (etcd serves `/health` and `/metrics` on its
/// client port); returns the body of a 200 answer.
fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> std::result::Result<String, String> {
    let mut stream =
        TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect to {addr}: {e}"))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(|e| format!("send GET {path}: {e}"))?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).map_err(|e| format!("read the answer to GET {path}: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        return Err(format!("GET {path}: answer without a header end"));
    };
    let status = head.lines().next().unwrap_or_default();
    if !status.contains(" 200 ") {
        return Err(format!("GET {path}: {status}"));
    }
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Ok(dechunk(body));
    }
    Ok(body.to_string())
}

/// Joins the chunks of a chunked HTTP body (`/metrics` may be chunked).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(rest.get(..size).unwrap_or_default());
        body = rest.get(size..).unwrap_or_default().trim_start_matches("\r\n");
    }
    out
}

/// Whether every thread of process `pid` is stopped (state `T` in
/// `/proc/<pid>/task/*/stat`); false if that cannot be read.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    let mut any = false;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { return false };
        // `pid (comm) state ...`: the state follows the last ')'.
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
        if !matches!(state, Some('T' | 't')) {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunk_joins_chunks() {
        assert_eq!(dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
        assert_eq!(dechunk("zz\r\n"), "");
    }

    #[test]
    fn free_ports_are_distinct() {
        let (a, b) = free_ports().unwrap();
        assert_ne!(a, b);
        assert!(a > 0 && b > 0);
    }

    #[test]
    fn missing_binary_says_how_to_install() {
        let err = EtcdServer::start_with_binary(Path::new("/nonexistent/etcd")).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("apt-get install -y etcd-server"), "{message}");
        assert!(message.contains("/nonexistent/etcd"), "{message}");
    }

    #[test]
    fn stderr_tail_keeps_the_last_lines() {
        let lines = Mutex::new(VecDeque::new());
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        drain(text.as_bytes(), &lines);
        assert_eq!(lines.lock().unwrap().len(), STDERR_LINES);
        let shown = tail(&lines);
        assert!(shown.ends_with("line 99"), "{shown}");
        assert!(!shown.contains("line 87\n"), "{shown}");
        assert_eq!(tail(&Mutex::new(VecDeque::new())), "(nothing)");
    }
}
