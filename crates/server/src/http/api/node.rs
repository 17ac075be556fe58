//! `GET /v1/node` (a sandfork extension): the node's capacity and what is
//! in use, for `sandfork status` and for operators.
//!
//! ```json
//! {"vcpus": {"total": 32, "used": 2, "free": 30},
//!  "memoryMB": {"total": 3000, "used": 512, "free": 2488},
//!  "diskMB": {"total": 250000, "free": 30000, "minFree": 1024},
//!  "sandboxes": {"running": 2, "paused": 1, "starting": 0, "max": 64, "vmmExited": 0},
//!  "memoryPressure": {"enabled": true, "availableMB": 2100, "psiSomeAvg10": 0.0,
//!    "psiFullAvg10": 0.0, "floorMB": 1000, "pausing": false, "pausedTotal": 3,
//!    "pausedNow": 1, "recentPauses": [...], ...},
//!  "features": {"fork": true, "forkPaused": true, "forkSnapshot": true,
//!               "snapshots": true, "maxForkCount": 63},
//!  "version": "0.1.0", "envdVersion": "0.5.7"}
//! ```
//!
//! `used` counts running sandboxes and those starting (create, resume, fork
//! children under way); paused ones hold none. `starting` is what holds
//! capacity without a VMM serving yet (and, for a moment, a sandbox being
//! paused). Memory is in MiB (E2B's
//! `memoryMB` means MiB too). `diskMB.free` is what the data directory's
//! filesystem has available beyond `minFree`, which sandboxes never use.
//! `vmmExited` counts the sandboxes removed since the node started because
//! their VMM process ended by itself (a crash, a kill from outside).
//! `memoryPressure` is the pressure monitor's last reading of the host and
//! the idle sandboxes it paused (see [`crate::node::pressure`]).
//!
//! `features` says what a client may branch from, so that it need not probe
//! routes: `fork` (`POST /sandboxes/{id}/fork` of a running sandbox),
//! `forkPaused` (the same route on a paused one), `forkSnapshot`
//! (`POST /snapshots/{id}/fork`), `snapshots` (`POST
//! /sandboxes/{id}/snapshots`), and `maxForkCount`, the most children one
//! fork call may ask for here (E2B's 100, and fewer than the node's sandbox
//! limit: the parent keeps its place). The Python package reads it
//! (`Capabilities`); a server without it is probed instead.

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use super::sandboxes::MAX_FORK_COUNT;
use super::{ApiError, Shared};
use crate::node::store::SandboxState;

pub async fn node(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    let manager = &state.manager;
    let capacity = manager.capacity();
    let limits = capacity.limits();
    let held = capacity.held();
    let disk = capacity
        .disk()
        .map_err(crate::node::sandbox::SandboxError::from)?;
    let records = manager.list()?;
    let count = |s: SandboxState| records.iter().filter(|r| r.state == s).count();
    let live = manager.live_count();
    Ok(Json(json!({
        "vcpus": {
            "total": limits.vcpus,
            "used": held.vcpus,
            "free": limits.vcpus.saturating_sub(held.vcpus),
        },
        "memoryMB": {
            "total": limits.memory_mib,
            "used": held.memory_mib,
            "free": limits.memory_mib.saturating_sub(held.memory_mib),
        },
        "diskMB": {
            "total": disk.total_mib,
            "free": disk.available_mib.saturating_sub(limits.min_free_disk_mib),
            "minFree": limits.min_free_disk_mib,
        },
        "sandboxes": {
            "running": count(SandboxState::Running),
            "paused": count(SandboxState::Paused),
            "starting": held.sandboxes.saturating_sub(live),
            "max": limits.sandboxes,
            "vmmExited": manager.vmm_exits(),
        },
        "memoryPressure": manager.pressure_json(),
        "features": features(limits.sandboxes),
        "version": env!("CARGO_PKG_VERSION"),
        "envdVersion": envd_proto::ENVD_VERSION,
    })))
}

/// What this node can branch from (see the module's documentation).
fn features(max_sandboxes: usize) -> Value {
    let below_limit = i64::try_from(max_sandboxes.saturating_sub(1)).unwrap_or(i64::MAX);
    json!({
        "fork": true,
        "forkPaused": true,
        "forkSnapshot": true,
        "snapshots": true,
        "maxForkCount": MAX_FORK_COUNT.min(below_limit),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fork_count_offered_leaves_the_parent_its_place() {
        assert_eq!(features(1024)["maxForkCount"], 100);
        assert_eq!(features(64)["maxForkCount"], 63);
        assert_eq!(features(1)["maxForkCount"], 0);
        assert_eq!(features(64)["forkPaused"], true);
    }
}
