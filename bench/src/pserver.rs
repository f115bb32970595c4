//! What the pserver benchmarks share (each uses some of it).

/// Running `rustc` processes and the 1-minute load average, from /proc.
pub fn machine_load() -> String {
    let rustc = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("comm"))
                        .map(|c| c.trim() == "rustc")
                        .unwrap_or(false)
                })
                .count()
        })
        .unwrap_or(0);
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into());
    format!("rustc running: {rustc}, load average (1 min): {load}")
}

pub use service::*;

/// The pieces for benches that run pservers.
mod service {
    use oar_discovery::Discovery;
    use oar_pserver::{Coordinator, CoordinatorOptions, PserverKeys};
    use oar_transport::Transport;
    use std::{sync::Arc, time::Duration};

    /// Where the benches' pservers register and find their map, under `/bench/`.
    pub fn keys() -> PserverKeys {
        PserverKeys {
            pservers: "/bench/ps/".into(),
            shard_map: "/bench/shard_map".into(),
            replicas: "/bench/pshards/".into(),
            checkpoints: "/bench/shard_checkpoint/".into(),
            cluster_status: "/bench/pserver_cluster_status".into(),
            members: "/bench/trainer/".into(),
            desired: "/bench/ps_desired".into(),
        }
    }

    /// The shard map's writer for `pservers` pservers holding `shards` shards
    /// with `replicas` replicas each, as a job's master runs it.
    pub async fn coordinator(
        discovery: Arc<dyn Discovery>,
        transport: Arc<dyn Transport>,
        shards: u32,
        replicas: u32,
        pservers: u32,
    ) -> Coordinator {
        let lease = discovery.grant_lease(Duration::from_secs(3600)).await.expect("lease");
        let fence = discovery
            .lock("/bench/coordinator", Vec::new(), lease, Duration::from_secs(5))
            .await
            .expect("lock");
        let options = CoordinatorOptions { keys: keys(), shards, replicas, pservers, ..Default::default() };
        Coordinator::start(discovery, transport, fence, options).await.expect("coordinator")
    }
}
