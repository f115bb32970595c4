//! `Session`: a lease kept alive in the background, with loss reporting.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{Discovery, Error, LeaseId, Result};

/// Lease metrics of the process, registered on first use.
struct Metrics {
    renewals: oar_metrics::Counter,
    failures: oar_metrics::Counter,
    losses: oar_metrics::Counter,
}

fn metrics() -> &'static Metrics {
    static METRICS: std::sync::LazyLock<Metrics> = std::sync::LazyLock::new(|| {
        let m = Metrics {
            renewals: Default::default(),
            failures: Default::default(),
            losses: Default::default(),
        };
        oar_metrics::register("oar_lease_renewals", "Lease refreshes that succeeded.", m.renewals.clone());
        oar_metrics::register(
            "oar_lease_renewal_failures",
            "Lease refreshes that failed.",
            m.failures.clone(),
        );
        oar_metrics::register(
            "oar_leases_lost",
            "Leases found lost (expired, revoked, unrefreshed).",
            m.losses.clone(),
        );
        m
    });
    &METRICS
}

/// The shortest pause between refreshes, so that a tiny ttl cannot spin.
const MIN_REFRESH: Duration = Duration::from_millis(1);

/// A lease kept alive by a background task, as a process's membership in the
/// job: keys put with [`Session::lease`] live as long as the process does.
///
/// The lease is refreshed every ttl/3. It counts as **lost** (see
/// [`Session::lost`]) once the backend says it is gone, or once no refresh
/// has succeeded for a whole ttl counted from when the last good refresh was
/// *sent*, so the loss is reported no later than other processes could see
/// the lease expire. A lost session stays lost; start a new one.
///
/// A server must not act for the job once its lease may have expired, even
/// before the background task has noticed (a process paused by SIGSTOP, or
/// starved, wakes with its timers late): [`LeaseGuard::is_valid`] answers
/// from the clock alone, so a handler can check it before every action.
///
/// Dropping the session stops the refreshes (the lease then expires by
/// itself, and `lost` receivers see their channel closed); [`Session::close`]
/// also revokes it at once.
pub struct Session {
    discovery: Arc<dyn Discovery>,
    lease: LeaseId,
    ttl: Duration,
    lost: Arc<watch::Sender<bool>>,
    guard: LeaseGuard,
    task: JoinHandle<()>,
}

/// A cheap, cloneable view of a [`Session`]'s lease for request handlers.
#[derive(Clone, Debug)]
pub struct LeaseGuard {
    /// The lease is certainly alive until this instant: the last refresh
    /// that succeeded was sent at `valid_until - ttl`.
    valid_until: Arc<Mutex<Instant>>,
    lost: watch::Receiver<bool>,
}

impl LeaseGuard {
    /// Whether the lease is still certainly alive: not reported lost, and a
    /// refresh succeeded within the last ttl by this process's clock.
    pub fn is_valid(&self) -> bool {
        !*self.lost.borrow()
            && Instant::now() < *self.valid_until.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("lease", &self.lease)
            .field("ttl", &self.ttl)
            .field("lost", &*self.lost.borrow())
            .finish()
    }
}

impl Session {
    /// Grants a lease of `ttl` and keeps it alive in a background task
    /// (refresh every ttl/3). Needs a tokio runtime.
    pub async fn start(discovery: Arc<dyn Discovery>, ttl: Duration) -> Result<Session> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(Error::Backend(
                "a Session needs a tokio runtime for its keep-alive task".to_string(),
            ));
        };
        metrics(); // Registered from the start, at zero.
        let sent = Instant::now();
        let lease = discovery.grant_lease(ttl).await?;
        let lost = Arc::new(watch::channel(false).0);
        let valid_until =
            Arc::new(Mutex::new(sent.checked_add(ttl).unwrap_or(sent + Duration::from_secs(3600))));
        let guard = LeaseGuard { valid_until: valid_until.clone(), lost: lost.subscribe() };
        let task = runtime.spawn(keep_alive_loop(discovery.clone(), lease, ttl, lost.clone(), valid_until));
        Ok(Session { discovery, lease, ttl, lost, guard, task })
    }

    /// The session's lease, to attach keys to.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// The ttl the lease was asked for.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// A guard to check the lease from request handlers.
    pub fn guard(&self) -> LeaseGuard {
        self.guard.clone()
    }

    /// Whether the lease is known to be gone.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// A receiver that becomes `true` once the lease is gone (the backend
    /// reported it missing, or no refresh succeeded for a whole ttl).
    /// Copy the value out of a `borrow()`/`wait_for()` guard at once: a held
    /// guard blocks the session from publishing.
    pub fn lost(&self) -> watch::Receiver<bool> {
        self.lost.subscribe()
    }

    /// Completes once the lease is gone (or the session is dropped): what a
    /// server awaits to stop serving.
    pub fn lost_signal(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut lost = self.lost.subscribe();
        async move {
            // The guard is dropped at once; the result only says why we woke.
            let _ = lost.wait_for(|lost| *lost).await.map(|_| ());
        }
    }

    /// Stops refreshing and revokes the lease, deleting its keys. A lease
    /// that is already gone is not an error; `lost` becomes `true` either way.
    pub async fn close(self) -> Result<()> {
        self.task.abort();
        let revoked = self.discovery.revoke_lease(self.lease).await;
        self.lost.send_replace(true);
        match revoked {
            Ok(()) | Err(Error::LeaseNotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Refreshes `lease` every ttl/3 until it is lost.
async fn keep_alive_loop(
    discovery: Arc<dyn Discovery>,
    lease: LeaseId,
    ttl: Duration,
    lost: Arc<watch::Sender<bool>>,
    valid_until: Arc<Mutex<Instant>>,
) {
    let period = (ttl / 3).max(MIN_REFRESH);
    loop {
        tokio::time::sleep(period).await;
        let sent = Instant::now();
        let remaining =
            valid_until.lock().unwrap_or_else(PoisonError::into_inner).saturating_duration_since(sent);
        if remaining.is_zero() {
            tracing::warn!(lease, ?ttl, "lease not refreshed for a whole ttl; lost");
            metrics().losses.inc();
            lost.send_replace(true);
            return;
        }
        match tokio::time::timeout(remaining, discovery.keep_alive(lease)).await {
            Ok(Ok(())) => {
                metrics().renewals.inc();
                if let Some(until) = sent.checked_add(ttl) {
                    *valid_until.lock().unwrap_or_else(PoisonError::into_inner) = until;
                }
            }
            Ok(Err(Error::LeaseNotFound(_))) => {
                tracing::warn!(lease, "lease gone (expired or revoked); lost");
                metrics().losses.inc();
                lost.send_replace(true);
                return;
            }
            Ok(Err(e)) => {
                metrics().failures.inc();
                tracing::warn!(lease, error = %e, "lease refresh failed; will retry")
            }
            Err(_) => {
                tracing::warn!(lease, ?ttl, "lease refresh did not answer within the ttl; lost");
                metrics().losses.inc();
                lost.send_replace(true);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fence, KeyValue, Listing, MemDiscovery, Revision, WatchStream};
    use async_trait::async_trait;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A backend whose refreshes can be made to fail, wrapping `MemDiscovery`.
    struct Flaky {
        mem: MemDiscovery,
        failing: AtomicBool,
        refreshes: AtomicUsize,
    }

    #[async_trait]
    impl Discovery for Flaky {
        async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
            self.mem.grant_lease(ttl).await
        }
        async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
            self.refreshes.fetch_add(1, Ordering::SeqCst);
            if self.failing.load(Ordering::SeqCst) {
                return Err(Error::Backend("connection refused".to_string()));
            }
            self.mem.keep_alive(lease).await
        }
        async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
            self.mem.revoke_lease(lease).await
        }
        async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
            self.mem.put(key, value, lease).await
        }
        async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
            self.mem.get(key).await
        }
        async fn get_prefix(&self, prefix: &str) -> Result<Listing> {
            self.mem.get_prefix(prefix).await
        }
        async fn delete(&self, key: &str) -> Result<bool> {
            self.mem.delete(key).await
        }
        async fn create_if_absent(
            &self,
            key: &str,
            value: Vec<u8>,
            lease: Option<LeaseId>,
        ) -> Result<Option<Revision>> {
            self.mem.create_if_absent(key, value, lease).await
        }
        async fn watch_prefix(&self, prefix: &str, from: Revision) -> Result<WatchStream> {
            self.mem.watch_prefix(prefix, from).await
        }
        async fn put_fenced(&self, fence: &Fence, key: &str, value: Vec<u8>) -> Result<Revision> {
            self.mem.put_fenced(fence, key, value).await
        }
        async fn delete_fenced(&self, fence: &Fence, key: &str) -> Result<bool> {
            self.mem.delete_fenced(fence, key).await
        }
        async fn delete_range_fenced(&self, fence: &Fence, start: &str, end: &str) -> Result<()> {
            self.mem.delete_range_fenced(fence, start, end).await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn refreshes_keep_the_lease_and_failures_for_a_ttl_lose_it() {
        let flaky = Arc::new(Flaky {
            mem: MemDiscovery::new(),
            failing: AtomicBool::new(false),
            refreshes: AtomicUsize::new(0),
        });
        let ttl = Duration::from_secs(3);
        let session = Session::start(flaky.clone(), ttl).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(!session.is_lost());
        let refreshes = flaky.refreshes.load(Ordering::SeqCst);
        assert!((29..=30).contains(&refreshes), "{refreshes} refreshes in 30 periods");

        flaky.failing.store(true, Ordering::SeqCst);
        let mut lost = session.lost();
        let start = Instant::now();
        assert!(*lost.wait_for(|lost| *lost).await.unwrap());
        // Lost within one ttl (plus one period) of the last good refresh.
        assert!(start.elapsed() <= ttl + ttl / 3, "lost after {:?}", start.elapsed());
        assert!(session.is_lost());
        session.close().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_a_session_lets_its_lease_expire() {
        let mem = MemDiscovery::new();
        let session = Session::start(Arc::new(mem.clone()), Duration::from_secs(2)).await.unwrap();
        let lease = session.lease();
        mem.put("/drop/k", b"v".to_vec(), Some(lease)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(mem.get("/drop/k").await.unwrap().is_some());
        drop(session);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(mem.get("/drop/k").await.unwrap().is_none());
        assert_eq!(mem.keep_alive(lease).await, Err(Error::LeaseNotFound(lease)));
    }

    /// A process whose runtime is blocked (paused, starved) past the ttl
    /// must not act for the job when it wakes, before the refresh task runs.
    #[tokio::test(flavor = "current_thread")]
    async fn the_guard_turns_invalid_when_the_process_stalls_past_the_ttl() {
        let mem = MemDiscovery::new();
        let session = Session::start(Arc::new(mem), Duration::from_millis(200)).await.unwrap();
        let guard = session.guard();
        assert!(guard.is_valid());
        // Block the only runtime thread: the refresh task cannot run.
        std::thread::sleep(Duration::from_millis(300));
        assert!(!session.is_lost(), "the refresh task has not run yet");
        assert!(!guard.is_valid(), "but the lease may have expired: the guard says so");
        session.close().await.unwrap();
        assert!(!guard.is_valid());
    }

    #[tokio::test]
    async fn close_revokes_and_reports_lost() {
        let mem = MemDiscovery::new();
        let session = Session::start(Arc::new(mem.clone()), Duration::from_secs(60)).await.unwrap();
        let lease = session.lease();
        mem.put("/close/k", b"v".to_vec(), Some(lease)).await.unwrap();
        let lost = session.lost();
        session.close().await.unwrap();
        assert!(*lost.borrow());
        assert!(mem.get("/close/k").await.unwrap().is_none());
        assert!(Session::start(Arc::new(mem), Duration::ZERO).await.is_err());
    }
}
