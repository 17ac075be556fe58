//! Sandfork's own answers: the node's status (`GET /v1/node`) and the admin
//! routes' teams and keys.

use serde::{Deserialize, Serialize};

// Node status.

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    pub vcpus: Usage,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Usage,
    #[serde(rename = "diskMB")]
    pub disk_mb: DiskUsage,
    pub sandboxes: SandboxCounts,
    pub memory_pressure: MemoryPressure,
    pub features: Features,
    pub version: String,
    pub envd_version: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub total: u64,
    pub used: u64,
    pub free: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskUsage {
    pub total: u64,
    pub free: u64,
    pub min_free: u64,
    /// In use, as `df` counts it (`usedPercent` of used plus available).
    #[serde(default)]
    pub used: u64,
    #[serde(default)]
    pub used_percent: f64,
    /// The image templates' bound on the same filesystem.
    #[serde(default)]
    pub images: ImageDisk,
}

/// Image templates on the node and their disk bound: conversions are
/// refused above `highWatermark` (percent used) and unused image templates
/// evicted down to `lowWatermark`; `evicted` and `refused` count since the
/// node started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageDisk {
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub templates: u64,
    pub evicted: u64,
    #[serde(rename = "evictedMB")]
    pub evicted_mb: u64,
    pub refused: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxCounts {
    pub running: u64,
    pub paused: u64,
    pub starting: u64,
    pub max: u64,
    pub vmm_exited: u64,
}

/// The memory pressure monitor: `{"enabled": false}` when off, else its
/// figures beside.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryPressure {
    pub enabled: bool,
    #[serde(flatten)]
    pub figures: Option<PressureFigures>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PressureFigures {
    /// `null` before the first reading.
    #[serde(rename = "availableMB")]
    pub available_mb: Option<u64>,
    pub psi_some_avg10: Option<f64>,
    pub psi_full_avg10: Option<f64>,
    #[serde(rename = "floorMB")]
    pub floor_mb: u64,
    pub max_full_avg10: f64,
    pub idle_seconds: u64,
    pub pausing: bool,
    pub paused_total: u64,
    pub paused_now: u64,
    pub failed_total: u64,
    pub nothing_to_pause_total: u64,
    pub recent_pauses: Vec<PressurePause>,
}

/// One pause the pressure monitor made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PressurePause {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub at_ms: u64,
    pub reason: String,
    #[serde(rename = "availableBeforeMB")]
    pub available_before_mb: u64,
    #[serde(rename = "availableAfterMB")]
    pub available_after_mb: u64,
    /// Its VMM's real use (Pss) just before.
    #[serde(rename = "vmmMB")]
    pub vmm_mb: Option<u64>,
    pub psi_full_avg10: Option<f64>,
    pub took_ms: u64,
}

/// What a client may branch from without probing routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Features {
    pub fork: bool,
    pub fork_paused: bool,
    pub fork_snapshot: bool,
    pub snapshots: bool,
    /// `POST /sandboxes/{id}/rollback` (to one of its own snapshots).
    #[serde(default)]
    pub rollback: bool,
    pub max_fork_count: i64,
}

// ---- Teams and keys (`/admin/...`, sandfork's) ----------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Team {
    #[serde(rename = "teamID")]
    pub team_id: String,
    pub name: String,
    pub created_at: String,
    pub limits: TeamLimits,
    /// `null`: the node's default.
    pub requests_per_second: Option<u32>,
    /// What its sandboxes hold (on this node; a gateway sums the nodes').
    pub usage: TeamUsage,
    /// How many keys it has.
    pub keys: u64,
}

/// A team's limits; a limit not set is left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TeamLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    #[serde(
        default,
        rename = "maxMemoryMB",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_memory_mb: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TeamUsage {
    pub sandboxes: u64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
}

/// A team's API key as the admin routes show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiKey {
    #[serde(rename = "keyID")]
    pub key_id: String,
    #[serde(rename = "teamID")]
    pub team_id: String,
    pub name: String,
    /// `e2b_` and the key's first and last 4 digits, for people.
    pub mask: String,
    pub created_at: String,
    /// The key itself: in its create's answer only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}
