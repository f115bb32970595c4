//! Members registered under a prefix: each member is a key `<prefix><name>`
//! put under the member's lease, so it vanishes when the member dies or
//! leaves. [`Departures`] follows them and names each one that goes.
//!
//! A service is told which prefix its members register under; this crate
//! knows nothing of what the members are (trainers of a job, say).

use crate::{Discovery, Result, WatchEvent, WatchStream};

/// The member name in `key`, if `key` is a member's key under `prefix`: the
/// rest of the key, non-empty and without `/`.
pub fn member_name<'a>(prefix: &str, key: &'a str) -> Option<&'a str> {
    key.strip_prefix(prefix).filter(|name| !name.is_empty() && !name.contains('/'))
}

/// Members leaving: yields the name of each member whose key under the
/// prefix is deleted (its lease expired or was revoked, or it was deleted),
/// from the moment the watch is created on.
pub struct Departures {
    prefix: String,
    watch: WatchStream,
    present: Vec<String>,
}

impl Departures {
    /// Start following the members under `prefix`.
    pub async fn watch(discovery: &dyn Discovery, prefix: &str) -> Result<Self> {
        let now = discovery.get_prefix(prefix).await?;
        let mut present: Vec<String> =
            now.kvs.iter().filter_map(|kv| member_name(prefix, &kv.key)).map(str::to_string).collect();
        present.sort();
        let watch = discovery.watch_prefix(prefix, now.revision + 1).await?;
        Ok(Self { prefix: prefix.to_string(), watch, present })
    }

    /// The members registered when the watch started, sorted. Anyone
    /// holding work who is not among them left before the watch began: a
    /// restarted service takes their work back with this, with no gap
    /// between the listing and the watch.
    pub fn present(&self) -> &[String] {
        &self.present
    }

    /// The next member that left; `None` when the watch ended, an error
    /// when it failed (the caller then relies on timeouts).
    pub async fn next(&mut self) -> Option<Result<String>> {
        loop {
            match self.watch.next().await? {
                Ok(WatchEvent::Delete { key, .. }) => {
                    if let Some(name) = member_name(&self.prefix, &key) {
                        return Some(Ok(name.to_string()));
                    }
                }
                Ok(WatchEvent::Put(_)) => {}
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDiscovery;
    use std::time::Duration;

    #[test]
    fn member_names_are_one_level_below_the_prefix() {
        assert_eq!(member_name("/j/trainer/", "/j/trainer/t1"), Some("t1"));
        assert_eq!(member_name("/j/trainer/", "/j/trainer/"), None);
        assert_eq!(member_name("/j/trainer/", "/j/trainer/t1/x"), None);
        assert_eq!(member_name("/j/trainer/", "/j/ps/1"), None);
    }

    #[tokio::test]
    async fn departures_name_members_whose_lease_ended_and_ignore_other_keys() {
        let d = MemDiscovery::new();
        let lease = d.grant_lease(Duration::from_secs(30)).await.unwrap();
        d.put("/j/trainer/t1", vec![], Some(lease)).await.unwrap();
        d.put("/j/trainer/t0", vec![], None).await.unwrap();
        let mut departures = Departures::watch(&d, "/j/trainer/").await.unwrap();
        assert_eq!(departures.present(), ["t0", "t1"]);
        d.put("/j/trainer/t2", vec![], None).await.unwrap();
        d.put("/j/ps/0", vec![], None).await.unwrap();
        d.delete("/j/ps/0").await.unwrap();
        d.revoke_lease(lease).await.unwrap();
        let name = tokio::time::timeout(Duration::from_secs(2), departures.next()).await.unwrap();
        assert_eq!(name.unwrap().unwrap(), "t1");
    }
}
