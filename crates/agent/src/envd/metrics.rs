//! `GET /metrics`: the guest's CPU, memory and root-disk use, in envd's field
//! names (spec §3.5).

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metrics {
    /// Unix seconds.
    pub ts: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f32,
    /// Bytes.
    pub mem_total: u64,
    pub mem_used: u64,
    pub mem_cache: u64,
    pub mem_total_mib: u64,
    pub mem_used_mib: u64,
    /// Bytes of the root filesystem.
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Aggregate CPU jiffies from the `cpu ` line of /proc/stat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    pub busy: u64,
    pub total: u64,
}

pub fn parse_cpu_times(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    if v.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal [guest guest_nice]; guest
    // time is already inside user/nice.
    let total: u64 = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some(CpuTimes {
        busy: total - idle,
        total,
    })
}

/// Percent busy between two samples.
pub fn cpu_percent(a: CpuTimes, b: CpuTimes) -> f32 {
    let total = b.total.saturating_sub(a.total);
    if total == 0 {
        return 0.0;
    }
    let busy = b.busy.saturating_sub(a.busy).min(total);
    (busy as f64 * 100.0 / total as f64) as f32
}

/// (total, used, cache) in bytes from /proc/meminfo; used = total - available.
pub fn parse_meminfo(text: &str) -> (u64, u64, u64) {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    let total = field("MemTotal:").unwrap_or(0);
    let available = field("MemAvailable:")
        .unwrap_or_else(|| field("MemFree:").unwrap_or(0) + field("Cached:").unwrap_or(0));
    let cache = field("Cached:").unwrap_or(0) + field("Buffers:").unwrap_or(0);
    (total, total.saturating_sub(available), cache)
}

fn disk_usage(path: &str) -> (u64, u64) {
    match nix::sys::statvfs::statvfs(path) {
        Ok(s) => {
            let frsize = s.fragment_size();
            let total = s.blocks() * frsize;
            let used = (s.blocks() - s.blocks_free()) * frsize;
            (used, total)
        }
        Err(e) => {
            log::debug!("statvfs {path}: {e}");
            (0, 0)
        }
    }
}

/// The previous CPU sample, so each reading covers the time since the last one.
static LAST_CPU: Mutex<Option<(Instant, CpuTimes)>> = Mutex::new(None);

async fn cpu_times() -> Option<CpuTimes> {
    parse_cpu_times(&tokio::fs::read_to_string("/proc/stat").await.ok()?)
}

/// CPU use since the previous call; a short fresh measurement when there is
/// none or it is too recent to mean anything.
async fn cpu_used_pct() -> f32 {
    let Some(now) = cpu_times().await else {
        return 0.0;
    };
    let prev = *LAST_CPU.lock().unwrap_or_else(|p| p.into_inner());
    let (from, to) = match prev {
        Some((at, t)) if at.elapsed() >= Duration::from_millis(100) => (t, now),
        _ => {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let Some(later) = cpu_times().await else {
                return 0.0;
            };
            (now, later)
        }
    };
    *LAST_CPU.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), to));
    cpu_percent(from, to)
}

pub async fn collect() -> Metrics {
    let cpu_used_pct = cpu_used_pct().await;
    let meminfo = tokio::fs::read_to_string("/proc/meminfo")
        .await
        .unwrap_or_default();
    let (mem_total, mem_used, mem_cache) = parse_meminfo(&meminfo);
    let (disk_used, disk_total) = disk_usage("/");
    Metrics {
        ts: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0),
        cpu_count: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        cpu_used_pct,
        mem_total,
        mem_used,
        mem_cache,
        mem_total_mib: mem_total / (1024 * 1024),
        mem_used_mib: mem_used / (1024 * 1024),
        disk_used,
        disk_total,
    }
}

pub async fn handler() -> axum::Json<Metrics> {
    axum::Json(collect().await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_deltas() {
        let a = parse_cpu_times("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4\n").unwrap();
        assert_eq!(
            a,
            CpuTimes {
                busy: 200,
                total: 1000
            }
        );
        let b = parse_cpu_times("cpu  150 0 150 800 100 0 0 0 0 0\n").unwrap();
        assert_eq!(cpu_percent(a, b), 50.0);
        assert_eq!(cpu_percent(a, a), 0.0);
        assert_eq!(parse_cpu_times("intr 1 2\n"), None);
    }

    #[test]
    fn meminfo_fields() {
        let m = "MemTotal:       2048 kB\nMemFree:         512 kB\nMemAvailable:   1024 kB\n\
                 Buffers:          16 kB\nCached:          256 kB\n";
        assert_eq!(parse_meminfo(m), (2048 * 1024, 1024 * 1024, 272 * 1024));
    }

    #[tokio::test]
    async fn live_values_are_sane() {
        let m = collect().await;
        assert!(m.cpu_count >= 1);
        assert!((0.0..=100.0).contains(&m.cpu_used_pct));
        assert!(m.mem_total > 0 && m.mem_used <= m.mem_total);
        assert_eq!(m.mem_total_mib, m.mem_total >> 20);
        assert!(m.disk_total > 0 && m.disk_used <= m.disk_total);
        let v = serde_json::to_value(&m).unwrap();
        for k in [
            "ts",
            "cpu_count",
            "cpu_used_pct",
            "mem_total",
            "mem_used",
            "mem_cache",
            "mem_total_mib",
            "mem_used_mib",
            "disk_used",
            "disk_total",
        ] {
            assert!(v.get(k).is_some(), "{k}");
        }
    }
}
