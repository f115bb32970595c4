//! What the pserver benchmarks share.

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
