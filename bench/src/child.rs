//! A benchmark's child process (the same binary, started with other
//! arguments) driven by lines on its stdin and stdout, so that what the
//! child measures about itself (memory, CPU time) is not mixed with the
//! driver's.

use std::{
    io::{BufRead, Write},
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use crate::BoxError;

/// A child process and the lines it prints, read on a thread of their own.
/// Dropped while still running (the driver failed somewhere), it is killed.
pub struct ChildProc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    timeout: Duration,
}

impl ChildProc {
    /// Starts this binary again with `args`; `name` labels its lines and
    /// errors, and `timeout` bounds every wait for it.
    pub fn spawn(name: &str, args: &[String], timeout: Duration) -> Result<ChildProc, BoxError> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(ChildProc { name: name.to_string(), child, stdin, lines, timeout })
    }

    /// The name it was started with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Writes `line` to its stdin.
    pub fn send(&mut self, line: &str) -> Result<(), BoxError> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// The next line starting with `prefix`, without it (others are passed
    /// through to stdout).
    pub fn expect(&mut self, prefix: &str) -> Result<String, BoxError> {
        loop {
            let line = self.lines.recv_timeout(self.timeout).map_err(|e| {
                format!("{}: no {prefix:?} line ({e}); exit status {:?}", self.name, self.child.try_wait())
            })?;
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.trim().to_string());
            }
            println!("  [{}] {line}", self.name);
        }
    }

    /// Closes its stdin and waits for it to exit successfully, at most the
    /// timeout; kills it after that.
    pub fn finish(mut self) -> Result<(), BoxError> {
        drop(self.stdin.take());
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("{} exited with {status}", self.name).into())
                };
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                return Err(format!("{} did not exit in time", self.name).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        // Only a child still running here failed somewhere: do not leave it behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
