//! Retrying calls to a peer that is away, with a deadline.

use std::{future::Future, time::Duration};

/// Errors that may go away by themselves (a peer restarting, a lost
/// connection) as opposed to errors that will repeat (a bad request).
pub trait Transient {
    /// Whether trying again later can succeed.
    fn is_transient(&self) -> bool;
}

impl Transient for crate::Error {
    fn is_transient(&self) -> bool {
        use crate::{Error, RemoteErrorKind};
        match self {
            Error::Unreachable { .. } | Error::Timeout { .. } | Error::Closed { .. } => true,
            Error::Remote { error, .. } => error.kind == RemoteErrorKind::Unavailable,
            _ => false,
        }
    }
}

/// The instant `after` from now; an `after` so long that it cannot be
/// represented (a "wait forever" option such as `u64::MAX` seconds) gives
/// an instant decades away instead of a panic.
pub fn deadline_in(after: std::time::Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(after).unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 24 * 3600))
}

/// How long and how often to retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Stop retrying once this much time has passed since the first attempt.
    pub give_up_after: Duration,
    /// Pause after the first failure; doubled after each further one.
    pub first_backoff: Duration,
    /// The longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            give_up_after: Duration::from_secs(60),
            first_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// Run `attempt` until it succeeds, fails with a non-transient error, or
    /// the policy's time is up; then return the last error.
    pub async fn run<T, E, F, Fut>(&self, mut attempt: F) -> Result<T, E>
    where
        E: Transient,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut retrying = self.start();
        loop {
            match attempt().await {
                Ok(v) => return Ok(v),
                Err(e) => {
                    if !retrying.again(&e).await {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// The policy's clock and backoff, for a caller that writes its own
    /// loop (say, because each attempt borrows something mutably): after
    /// each failure, [`Retrying::again`] says whether to try again.
    pub fn start(&self) -> Retrying {
        Retrying { policy: *self, started: tokio::time::Instant::now(), backoff: self.first_backoff }
    }
}

/// A retry loop in progress: see [`RetryPolicy::start`].
#[derive(Debug)]
pub struct Retrying {
    policy: RetryPolicy,
    started: tokio::time::Instant,
    backoff: Duration,
}

impl Retrying {
    /// After a failed attempt: `false` if `error` will not go away by
    /// itself or the policy's time is up (give up with it); otherwise waits
    /// the backoff, doubles it (up to the maximum) and returns `true`.
    pub async fn again<E: Transient>(&mut self, error: &E) -> bool {
        if !error.is_transient() {
            return false;
        }
        let elapsed = self.started.elapsed();
        if elapsed >= self.policy.give_up_after {
            return false;
        }
        let pause = self.backoff.min(self.policy.give_up_after - elapsed);
        tracing::debug!(?pause, "transient failure, retrying");
        tokio::time::sleep(pause).await;
        self.backoff = (self.backoff * 2).min(self.policy.max_backoff);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_deadline_too_far_to_represent_is_decades_away_not_a_panic() {
        let now = tokio::time::Instant::now();
        assert_eq!(deadline_in(Duration::from_secs(5)), now + Duration::from_secs(5));
        let forever = deadline_in(Duration::from_secs(u64::MAX));
        assert!(forever > now + Duration::from_secs(20 * 365 * 24 * 3600));
    }

    #[tokio::test(start_paused = true)]
    async fn retries_transient_errors_until_success() {
        let tries = AtomicU32::new(0);
        let got = RetryPolicy::default()
            .run(|| async {
                if tries.fetch_add(1, Ordering::SeqCst) < 3 {
                    Err(Error::Unreachable { addr: "x".into() })
                } else {
                    Ok(7)
                }
            })
            .await
            .unwrap();
        assert_eq!(got, 7);
        assert_eq!(tries.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_the_deadline_with_the_last_error() {
        let policy = RetryPolicy { give_up_after: Duration::from_secs(2), ..RetryPolicy::default() };
        let started = tokio::time::Instant::now();
        let err = policy.run(|| async { Err::<(), _>(Error::Unreachable { addr: "x".into() }) }).await;
        assert!(matches!(err, Err(Error::Unreachable { .. })));
        assert!(started.elapsed() >= Duration::from_secs(2));
        assert!(started.elapsed() < Duration::from_secs(4));
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_errors_are_not_retried() {
        let tries = AtomicU32::new(0);
        let err = RetryPolicy::default()
            .run(|| async {
                tries.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(Error::AddrInUse("a".into()))
            })
            .await;
        assert!(err.is_err());
        assert_eq!(tries.load(Ordering::SeqCst), 1);
    }
}
