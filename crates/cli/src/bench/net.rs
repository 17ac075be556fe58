//! `net_slot_setup_ms` and `net_policy_replace_ms`: network slots made one
//! after another (namespace, veth, tap, addresses, routes, nftables table),
//! then one policy replace on each, in a private host namespace the bench
//! makes (loopback its only link, so nothing of the machine's network is
//! touched). Needs CAP_NET_ADMIN and CAP_SYS_ADMIN, as `sandfork serve` does.

use anyhow::{Context, Result};
use sandfork_network::bench::{percentile_ms, slot_setup_times};
use sandfork_network::{HostConfig, PoolConfig, netns};
use serde_json::{Value, json};

/// Slots made per run: a fork burst's worth.
const SLOTS: u32 = 32;

/// The figures, measured off the async threads.
pub async fn measure() -> Result<Value> {
    tokio::task::spawn_blocking(measure_blocking).await?
}

fn measure_blocking() -> Result<Value> {
    let dir = tempfile::Builder::new()
        .prefix("sandfork-bench-net-")
        .tempdir()?;
    let host_ns = dir.path().join("host");
    netns::create_anchored(&host_ns, |_| Ok(()))
        .context("making the bench's host namespace (needs root)")?;
    let mut host = HostConfig::new(dir.path().join("netns"));
    host.host_netns = Some(host_ns.clone());
    // No route out is needed to make slots; loopback stands for the uplink.
    host.uplink = Some("lo".into());
    host.plan.slots = SLOTS;
    let measured = slot_setup_times(&PoolConfig::new(host), SLOTS);
    let _ = netns::remove_anchor(&host_ns);
    let (setup, replace) = measured.context("making network slots")?;
    eprintln!(
        "bench: {} network slots: setup p50 {:.2} ms, policy replace p50 {:.2} ms",
        setup.len(),
        percentile_ms(&setup, 50),
        percentile_ms(&replace, 50)
    );
    Ok(json!({
        "net_slot_setup_ms": {"p50": percentile_ms(&setup, 50), "p99": percentile_ms(&setup, 99)},
        "net_policy_replace_ms": {"p50": percentile_ms(&replace, 50), "p99": percentile_ms(&replace, 99)},
        "net_slots_measured": setup.len(),
    }))
}

#[cfg(test)]
mod tests {
    /// Makes 32 slots in namespaces of its own: run as root with `--ignored`.
    #[tokio::test]
    #[ignore = "needs root: makes network namespaces"]
    async fn slot_figures_are_measured_in_a_private_namespace() {
        let v = super::measure().await.unwrap();
        assert_eq!(v["net_slots_measured"], super::SLOTS);
        let p50 = v["net_slot_setup_ms"]["p50"].as_f64().unwrap();
        let p99 = v["net_slot_setup_ms"]["p99"].as_f64().unwrap();
        assert!(p50 > 0.0 && p99 >= p50, "{v}");
    }
}
