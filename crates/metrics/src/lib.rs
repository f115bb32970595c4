//! oar's metrics: one Prometheus registry per process, filled by every oar
//! crate (task queue, pservers, leases, transport), and a small HTTP
//! endpoint that serves it in the Prometheus text format
//! ([`serve`]; the example binaries' `--metrics ADDR`).
//!
//! The metrics are process-wide, like a process's log: a process running
//! several pservers (the local example) reports their sum. Each crate
//! registers its metrics when its service starts ([`register`]), so a
//! scrape shows them from then on, at zero until something happens; the
//! exposition is `prometheus-client`'s.
//!
//! ```
//! use oar_metrics::{encode, register, Counter};
//!
//! let pushes = Counter::<u64>::default();
//! register("oar_doc_pushes", "Pushes taken.", pushes.clone());
//! pushes.inc();
//! assert!(encode().contains("oar_doc_pushes_total 1"));
//! ```
#![warn(missing_docs)]

pub use prometheus_client::metrics::{
    counter::Counter,
    family::Family,
    gauge::Gauge,
    histogram::{exponential_buckets, Histogram},
};
use prometheus_client::registry::{Metric, Registry};
use std::{
    net::SocketAddr,
    sync::{LazyLock, Mutex, PoisonError},
    time::Duration,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

/// Add `metric` to the process's registry under `name` (without the
/// `_total` suffix a counter gets in the exposition).
pub fn register(name: &str, help: &str, metric: impl Metric) {
    // The exposition ends the help with a period of its own.
    let help = help.trim_end_matches('.');
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner).register(name, help, metric);
}

/// Every registered metric in the Prometheus text format.
pub fn encode() -> String {
    let mut out = String::new();
    let registry = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// Latency buckets from 100 µs to about 100 s.
pub fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-4, 4.0, 11))
}

/// A running metrics endpoint; dropping it stops serving.
pub struct MetricsServer {
    addr: SocketAddr,
    /// Aborted when the server is dropped.
    _task: tokio_util::task::AbortOnDropHandle<()>,
}

impl MetricsServer {
    /// The address bound (port 0 picks a free one).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// How long a scraper has to send its request, and then to take the reply.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest request head read.
const MAX_REQUEST: usize = 8 << 10;

/// Serve `GET /metrics` at `addr` (HTTP/1.1, one request per connection).
/// Anything else gets 404 (another path) or 400 (not a GET); a client that
/// sends nothing for 5 s is dropped; none of it disturbs the process.
pub async fn serve(addr: &str) -> std::io::Result<MetricsServer> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(async move {
                        if let Err(e) = answer(stream).await {
                            tracing::debug!(error = %e, "metrics request failed");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint cannot accept; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    tracing::info!(%addr, "metrics serving");
    Ok(MetricsServer { addr, _task: tokio_util::task::AbortOnDropHandle::new(task) })
}

async fn answer(mut stream: TcpStream) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read_head = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    if tokio::time::timeout(REQUEST_TIMEOUT, read_head).await.is_err() {
        return Ok(());
    }
    let line = head.split(|&b| b == b'\r' || b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (status, body) = match (parts.next(), parts.next()) {
        (Some("GET"), Some("/metrics")) => ("200 OK", encode()),
        (Some("GET"), Some(_)) => ("404 Not Found", "only /metrics is served here\n".to_string()),
        _ => ("400 Bad Request", "send GET /metrics\n".to_string()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // A scraper that stops reading must not hold the connection forever.
    let reply = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(REQUEST_TIMEOUT, reply).await.unwrap_or(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: SocketAddr, request: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_the_registry_and_refuses_other_requests() {
        let counter = Counter::<u64>::default();
        register("oar_test_things", "Things.", counter.clone());
        counter.inc_by(3);
        let server = serve("127.0.0.1:0").await.unwrap();
        let ok = get(server.addr(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.contains("oar_test_things_total 3"), "{ok}");
        let missing = get(server.addr(), "GET /other HTTP/1.1\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let bad = get(server.addr(), "BREW /metrics\r\n\r\n").await;
        assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
        // Still serving after the bad ones.
        assert!(get(server.addr(), "GET /metrics HTTP/1.1\r\n\r\n").await.contains("200 OK"));
    }
}
