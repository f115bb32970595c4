//! Members registered under a prefix: each member is a key `<prefix><name>`
//! put under the member's lease, so it vanishes when the member dies or
//! leaves. [`Departures`] follows them and names each one that goes.
//!
//! A service is told which prefix its members register under; this crate
//! knows nothing of what the members are (trainers of a job, say).

use crate::{Discovery, Error, Result, Revision, WatchEvent, WatchStream};
use std::{collections::BTreeSet, sync::Arc, time::Duration};

/// The member name in `key`, if `key` is a member's key under `prefix`: the
/// rest of the key, non-empty and without `/`.
pub fn member_name<'a>(prefix: &str, key: &'a str) -> Option<&'a str> {
    key.strip_prefix(prefix).filter(|name| !name.is_empty() && !name.contains('/'))
}

/// Members seen departing ([`Departures`]), remembered so that one coming
/// back (a request of it on the way, or retried, past its lease) can be
/// checked: no departure would be named for it again. At most `1 << 16`
/// names are kept; past that the set starts afresh.
#[derive(Debug)]
pub struct DepartedMembers {
    /// Where the members register (`<prefix><name>`).
    prefix: String,
    names: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl DepartedMembers {
    const MAX: usize = 1 << 16;

    /// An empty set of the members registering under `prefix`.
    pub fn new(prefix: &str) -> Self {
        DepartedMembers { prefix: prefix.to_string(), names: Default::default() }
    }

    /// Note that `name` departed.
    pub fn remember(&self, name: &str) {
        let mut names = self.names.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if names.len() >= Self::MAX {
            names.clear();
        }
        names.insert(name.to_string());
    }

    /// Whether `name` was seen departing; forgets it (remember it again if
    /// a check finds it still gone).
    pub fn take(&self, name: &str) -> bool {
        self.names.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(name)
    }

    /// `name`, [taken](Self::take) from the set, came back: whether its
    /// key is still gone, read after it came back (a departure after the
    /// read is named by [`Departures`] as usual). Remembered again unless
    /// it registered anew; a read that fails counts as not gone.
    pub async fn still_gone(&self, discovery: &dyn Discovery, name: &str) -> bool {
        match discovery.get(&format!("{}{name}", self.prefix)).await {
            Ok(Some(_)) => {
                tracing::info!(member = name, "a member whose registration had ended is registered again");
                false
            }
            Ok(None) => {
                self.remember(name);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, member = name, "cannot check a returning member's registration");
                self.remember(name);
                false
            }
        }
    }
}

/// The first pause before watching again after a watch failed; it doubles
/// up to [`MAX_REWATCH_PAUSE`] while the backend stays unreachable.
const REWATCH_PAUSE: Duration = Duration::from_millis(100);
const MAX_REWATCH_PAUSE: Duration = Duration::from_secs(2);

/// Members leaving: yields the name of each member whose key under the
/// prefix is deleted (its lease expired or was revoked, or it was deleted),
/// from the moment the watch is created on.
///
/// A watch that fails (the backend restarted, a connection dropped, the
/// reader fell behind the kept history) is started again where it left
/// off, so no departure is missed. If that history is gone, the members are
/// listed again, and each one known before that the listing lacks is named
/// as gone; one that both joined and left during the gap is not seen at
/// all (it was never known to be present). While the backend stays
/// unreachable, [`Departures::next`] keeps trying, with pauses up to 2 s.
pub struct Departures {
    discovery: Arc<dyn Discovery>,
    prefix: String,
    watch: WatchStream,
    present: Vec<String>,
    /// The members now, as far as the events seen say.
    members: BTreeSet<String>,
    /// The revision the watch has delivered up to.
    seen: Revision,
    /// Members a new listing found gone, still to be named.
    gone: Vec<String>,
}

impl Departures {
    /// Start following the members under `prefix`.
    pub async fn watch(discovery: Arc<dyn Discovery>, prefix: &str) -> Result<Self> {
        let now = discovery.get_prefix(prefix).await?;
        let members: BTreeSet<String> =
            now.kvs.iter().filter_map(|kv| member_name(prefix, &kv.key)).map(str::to_string).collect();
        let watch = discovery.watch_prefix(prefix, now.revision + 1).await?;
        Ok(Self {
            discovery,
            prefix: prefix.to_string(),
            watch,
            present: members.iter().cloned().collect(),
            members,
            seen: now.revision,
            gone: Vec::new(),
        })
    }

    /// The members registered when the watch started, sorted. Anyone
    /// holding work who is not among them left before the watch began: a
    /// restarted service takes their work back with this, with no gap
    /// between the listing and the watch.
    pub fn present(&self) -> &[String] {
        &self.present
    }

    /// The next member that left; `None` when the watch ended (the backend
    /// was shut down), an error when following the members failed for a
    /// reason that trying again cannot mend (the caller then relies on
    /// timeouts).
    pub async fn next(&mut self) -> Option<Result<String>> {
        loop {
            if let Some(name) = self.gone.pop() {
                return Some(Ok(name));
            }
            match self.watch.next().await? {
                Ok(event) => {
                    self.seen = self.seen.max(event.revision());
                    let Some(name) = member_name(&self.prefix, event.key()) else { continue };
                    let name = name.to_string();
                    match event {
                        WatchEvent::Delete { .. } => {
                            self.members.remove(&name);
                            return Some(Ok(name));
                        }
                        WatchEvent::Put(_) => {
                            self.members.insert(name);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, prefix = %self.prefix, "member watch failed; watching again");
                    if let Err(e) = self.rewatch().await {
                        return Some(Err(e));
                    }
                }
            }
        }
    }

    /// Watch again from where the failed watch stopped, or from a new
    /// listing if that history is gone; pausing between tries while the
    /// backend is unreachable. Errs only on a failure that will repeat.
    async fn rewatch(&mut self) -> Result<()> {
        let mut pause = REWATCH_PAUSE;
        loop {
            let tried = match self.discovery.watch_prefix(&self.prefix, self.seen + 1).await {
                Err(Error::Compacted { .. }) => self.relist().await,
                other => other.map(|watch| self.watch = watch),
            };
            match tried {
                Ok(()) => return Ok(()),
                Err(e) if e.is_transient() || matches!(e, Error::Compacted { .. }) => {
                    tracing::debug!(error = %e, ?pause, "watching members again failed; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_REWATCH_PAUSE);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// List the members afresh: each known one the listing lacks left
    /// meanwhile. Then watch from the listing on.
    async fn relist(&mut self) -> Result<()> {
        let now = self.discovery.get_prefix(&self.prefix).await?;
        let watch = self.discovery.watch_prefix(&self.prefix, now.revision + 1).await?;
        let listed: BTreeSet<String> =
            now.kvs.iter().filter_map(|kv| member_name(&self.prefix, &kv.key)).map(str::to_string).collect();
        // Named in order: `gone` is popped from the end.
        let mut gone: Vec<String> = self.members.difference(&listed).cloned().collect();
        gone.reverse();
        self.gone.extend(gone);
        self.members = listed;
        self.seen = now.revision;
        self.watch = watch;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDiscovery;
    use std::time::Duration;

    #[test]
    fn departed_members_are_taken_once_and_bounded() {
        let departed = DepartedMembers::new("/j/trainer/");
        departed.remember("t1");
        assert!(departed.take("t1"));
        assert!(!departed.take("t1"), "taken once");
        for i in 0..DepartedMembers::MAX {
            departed.remember(&format!("t{i}"));
        }
        departed.remember("last");
        assert!(departed.take("last"));
        assert!(!departed.take("t0"), "the set started afresh at its bound");
    }

    #[test]
    fn member_names_are_one_level_below_the_prefix() {
        assert_eq!(member_name("/j/trainer/", "/j/trainer/t1"), Some("t1"));
        assert_eq!(member_name("/j/trainer/", "/j/trainer/"), None);
        assert_eq!(member_name("/j/trainer/", "/j/trainer/t1/x"), None);
        assert_eq!(member_name("/j/trainer/", "/j/ps/1"), None);
    }

    /// The next departure, within 5 s.
    async fn next(departures: &mut Departures) -> String {
        let next = tokio::time::timeout(Duration::from_secs(5), departures.next()).await;
        next.expect("a departure in time").expect("not ended").expect("no error")
    }

    #[tokio::test]
    async fn departures_outlive_a_failed_watch_and_name_who_left_meanwhile() {
        // Four events of history: a reader that falls further behind fails.
        let d = MemDiscovery::with_history_limit(4, 1 << 20);
        let (l1, l2) = (
            d.grant_lease(Duration::from_secs(30)).await.unwrap(),
            d.grant_lease(Duration::from_secs(30)).await.unwrap(),
        );
        d.put("/j/trainer/t1", vec![], Some(l1)).await.unwrap();
        d.put("/j/trainer/t2", vec![], Some(l2)).await.unwrap();
        let mut departures = Departures::watch(Arc::new(d.clone()), "/j/trainer/").await.unwrap();
        // Nobody reads while t3 joins, t1 leaves and many other writes
        // push those events out of the history.
        d.put("/j/trainer/t3", vec![], None).await.unwrap();
        for i in 0..10 {
            d.put("/j/other", vec![i], None).await.unwrap();
        }
        d.revoke_lease(l1).await.unwrap();
        for i in 0..10 {
            d.put("/j/other", vec![i], None).await.unwrap();
        }
        assert_eq!(next(&mut departures).await, "t1", "found gone by the new listing");
        // Followed again from the listing on: t2 and t3 are known.
        d.revoke_lease(l2).await.unwrap();
        assert_eq!(next(&mut departures).await, "t2");
        d.delete("/j/trainer/t3").await.unwrap();
        assert_eq!(next(&mut departures).await, "t3");
    }

    #[tokio::test]
    async fn departures_name_members_whose_lease_ended_and_ignore_other_keys() {
        let d = MemDiscovery::new();
        let lease = d.grant_lease(Duration::from_secs(30)).await.unwrap();
        d.put("/j/trainer/t1", vec![], Some(lease)).await.unwrap();
        d.put("/j/trainer/t0", vec![], None).await.unwrap();
        let mut departures = Departures::watch(Arc::new(d.clone()), "/j/trainer/").await.unwrap();
        assert_eq!(departures.present(), ["t0", "t1"]);
        d.put("/j/trainer/t2", vec![], None).await.unwrap();
        d.put("/j/ps/0", vec![], None).await.unwrap();
        d.delete("/j/ps/0").await.unwrap();
        d.revoke_lease(lease).await.unwrap();
        let name = tokio::time::timeout(Duration::from_secs(2), departures.next()).await.unwrap();
        assert_eq!(name.unwrap().unwrap(), "t1");
    }
}
