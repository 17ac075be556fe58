//! `GET /v1/node` (a sandfork extension): the node's capacity and what is
//! in use, for `sandfork status` and for operators.
//!
//! ```json
//! {"vcpus": {"total": 32, "used": 2, "free": 30},
//!  "memoryMB": {"total": 3000, "used": 512, "free": 2488},
//!  "diskMB": {"total": 250000, "free": 30000, "minFree": 1024, "used": 190000,
//!    "usedPercent": 86.4, "images": {"highWatermark": 85.0, "lowWatermark": 80.0,
//!    "templates": 12, "evicted": 3, "evictedMB": 9100, "refused": 0}},
//!  "sandboxes": {"running": 2, "paused": 1, "starting": 0, "max": 64, "vmmExited": 0},
//!  "memoryPressure": {"enabled": true, "availableMB": 2100, "psiSomeAvg10": 0.0,
//!    "psiFullAvg10": 0.0, "floorMB": 1000, "pausing": false, "pausedTotal": 3,
//!    "pausedNow": 1, "recentPauses": [...], ...},
//!  "features": {"fork": true, "forkPaused": true, "forkSnapshot": true,
//!               "snapshots": true, "rollback": true, "maxForkCount": 63},
//!  "version": "0.1.0", "envdVersion": "0.5.7"}
//! ```
//!
//! `used` counts running sandboxes and those starting (create, resume, fork
//! children under way); paused ones hold none. `starting` is what holds
//! capacity without a VMM serving yet (and, for a moment, a sandbox being
//! paused). Memory is in MiB (E2B's
//! `memoryMB` means MiB too). `diskMB.free` is what the data directory's
//! filesystem has available beyond `minFree`, which sandboxes never use;
//! `used` and `usedPercent` are its use as `df` counts it, which the image
//! templates' watermarks bound (`images`, see
//! [`crate::node::template::image_disk`]).
//! `vmmExited` counts the sandboxes removed since the node started because
//! their VMM process ended by itself (a crash, a kill from outside).
//! `memoryPressure` is the pressure monitor's last reading of the host and
//! the idle sandboxes it paused (see [`crate::node::pressure`]).
//!
//! `features` says what a client may branch from, so that it need not probe
//! routes: `fork` (`POST /sandboxes/{id}/fork` of a running sandbox),
//! `forkPaused` (the same route on a paused one), `forkSnapshot`
//! (`POST /snapshots/{id}/fork`), `snapshots` (`POST
//! /sandboxes/{id}/snapshots`), `rollback` (`POST
//! /sandboxes/{id}/rollback` to one of its own snapshots), and
//! `maxForkCount`, the most children one
//! fork call may ask for here (E2B's 100, and fewer than the node's sandbox
//! limit: the parent keeps its place). The Python package reads it
//! (`Capabilities`); a server without it is probed instead.

use axum::Json;
use axum::extract::State;

use super::sandboxes::MAX_FORK_COUNT;
use super::{ApiError, Shared};
use crate::node::pressure::{PressurePause, PressureReport};
use crate::node::store::SandboxState;
use crate::wire;

pub async fn node(State(state): State<Shared>) -> Result<Json<wire::NodeStatus>, ApiError> {
    let manager = &state.manager;
    let capacity = manager.capacity();
    let limits = capacity.limits();
    let held = capacity.held();
    let disk = capacity
        .disk()
        .map_err(crate::node::sandbox::SandboxError::from)?;
    let images = state.templates.image_disk_report()?;
    let records = manager.list()?;
    let count = |s: SandboxState| records.iter().filter(|r| r.state == s).count() as u64;
    let live = manager.live_count();
    Ok(Json(wire::NodeStatus {
        vcpus: wire::Usage {
            total: limits.vcpus,
            used: held.vcpus,
            free: limits.vcpus.saturating_sub(held.vcpus),
        },
        memory_mb: wire::Usage {
            total: limits.memory_mib,
            used: held.memory_mib,
            free: limits.memory_mib.saturating_sub(held.memory_mib),
        },
        disk_mb: wire::DiskUsage {
            total: disk.total_mib,
            free: disk.available_mib.saturating_sub(limits.min_free_disk_mib),
            min_free: limits.min_free_disk_mib,
            used: disk.used_mib,
            used_percent: disk.used_percent(),
            images: wire::ImageDisk {
                high_watermark: images.marks.high_percent,
                low_watermark: images.marks.low_percent,
                templates: images.templates,
                evicted: images.evicted,
                evicted_mb: images.evicted_bytes >> 20,
                refused: images.refused,
            },
        },
        sandboxes: wire::SandboxCounts {
            running: count(SandboxState::Running),
            paused: count(SandboxState::Paused),
            starting: held.sandboxes.saturating_sub(live) as u64,
            max: limits.sandboxes as u64,
            vmm_exited: manager.vmm_exits(),
        },
        memory_pressure: memory_pressure(manager.pressure_report()),
        features: features(limits.sandboxes),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        envd_version: envd_proto::ENVD_VERSION.to_owned(),
    }))
}

/// The pressure monitor's figures (`{"enabled": false}` when it is off).
fn memory_pressure(report: Option<PressureReport>) -> wire::MemoryPressure {
    let figures = report.map(|r| wire::PressureFigures {
        available_mb: r.last.map(|l| l.available_mib),
        psi_some_avg10: r.last.and_then(|l| l.some_avg10()),
        psi_full_avg10: r.last.and_then(|l| l.full_avg10()),
        floor_mb: r.floor_mib,
        max_full_avg10: r.max_full_avg10,
        idle_seconds: r.idle.as_secs(),
        pausing: r.pausing,
        paused_total: r.paused_total,
        paused_now: r.paused_now as u64,
        failed_total: r.failed_total,
        nothing_to_pause_total: r.nothing_to_pause_total,
        recent_pauses: r.recent.into_iter().map(pressure_pause).collect(),
    });
    wire::MemoryPressure {
        enabled: figures.is_some(),
        figures,
    }
}

fn pressure_pause(p: PressurePause) -> wire::PressurePause {
    wire::PressurePause {
        sandbox_id: p.id,
        at_ms: p.at_ms,
        reason: p.reason,
        available_before_mb: p.available_before_mib,
        available_after_mb: p.available_after_mib,
        vmm_mb: p.vmm_mib,
        psi_full_avg10: p.psi_full_avg10,
        took_ms: p.took_ms,
    }
}

/// What this node can branch from (see the module's documentation).
fn features(max_sandboxes: usize) -> wire::Features {
    let below_limit = i64::try_from(max_sandboxes.saturating_sub(1)).unwrap_or(i64::MAX);
    wire::Features {
        fork: true,
        fork_paused: true,
        fork_snapshot: true,
        snapshots: true,
        rollback: true,
        max_fork_count: MAX_FORK_COUNT.min(below_limit),
    }
}

#[cfg(test)]
mod tests {
    /// The features as JSON.
    fn features(max_sandboxes: usize) -> serde_json::Value {
        serde_json::to_value(super::features(max_sandboxes)).unwrap()
    }

    #[test]
    fn the_fork_count_offered_leaves_the_parent_its_place() {
        assert_eq!(features(1024)["maxForkCount"], 100);
        assert_eq!(features(64)["maxForkCount"], 63);
        assert_eq!(features(1)["maxForkCount"], 0);
        assert_eq!(features(64)["forkPaused"], true);
        assert_eq!(features(64)["rollback"], true);
    }
}
