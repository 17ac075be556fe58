//! E2B's sandbox answers: the Sandbox of create and connect, the listed and
//! detailed sandbox, a fork's entries, metrics, logs and snapshots.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Error;

/// What names a sandbox in each E2B answer about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNames {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub alias: Option<String>,
    /// A node id the SDKs require and never use.
    #[serde(rename = "clientID")]
    pub client_id: String,
}

/// E2B's Sandbox: the answer of create, connect and resume, and a fork
/// child's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(flatten)]
    pub names: SandboxNames,
    pub envd_version: String,
    pub envd_access_token: Option<String>,
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

/// E2B's ListedSandbox (`GET /sandboxes`, `GET /v2/sandboxes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(flatten)]
    pub names: SandboxNames,
    /// RFC 3339.
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    /// `running` or `paused` (E2B's SDKs refuse anything else).
    pub state: String,
    pub envd_version: String,
    pub metadata: BTreeMap<String, String>,
    /// A paused sandbox whose memory pause was taken while its guest agent
    /// did not answer: only a resume with `memory: false` is allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envd_unresponsive_at_pause: Option<bool>,
    /// Its volumes, as the create named them (a fork child's: its copies
    /// of its parent's, named as the parent's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<super::SandboxVolumeMount>,
}

/// E2B's SandboxDetail (`GET /sandboxes/{id}`): the listed fields and more,
/// with sandfork's own at the end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(flatten)]
    pub listed: ListedSandbox,
    /// SDKs up to 2.5 and 1.x read it here after a resume.
    pub envd_access_token: Option<String>,
    pub domain: Option<String>,
    pub lifecycle: Lifecycle,
    /// As the create set it; `null` when never set.
    pub allow_internet_access: Option<bool>,
    pub network: NetworkDetail,
    /// What a paused sandbox's pause saved: `full` (memory and disk; a
    /// resume restores it) or `filesystem` (a resume cold-boots its disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<String>,
    /// Sandfork's: why a paused sandbox is paused (`memoryPressure`: the
    /// node paused it, and its next request resumes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_reason: Option<String>,
    /// Sandfork's: whether its guest stopped answering.
    #[serde(default)]
    pub guest_unresponsive: bool,
    /// Sandfork's: its VMM's page faults so far, while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm_page_faults: Option<PageFaults>,
}

/// E2B's SandboxLifecycle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    /// `kill` or `pause`.
    pub on_timeout: String,
    pub auto_resume: bool,
}

/// A detail's `network`: only what the create set (`{}` for none), as E2B's
/// API reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkDetail {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_public_traffic: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub https_ports: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageFaults {
    pub minor: u64,
    pub major: u64,
}

/// One entry of a fork's 201 (E2B's): a child made, or why it was not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ForkEntry {
    Sandbox(Sandbox),
    Error(Error),
}

impl ForkEntry {
    pub fn error(code: u16, message: impl Into<String>) -> ForkEntry {
        ForkEntry::Error(Error {
            code,
            message: message.into(),
            error_code: None,
        })
    }

    /// The child's id when it was made.
    pub fn sandbox_id(&self) -> Option<&str> {
        match self {
            ForkEntry::Sandbox(s) => Some(&s.names.sandbox_id),
            ForkEntry::Error(_) => None,
        }
    }
}

/// Sandfork's, in the [`FORK_PHASES_HEADER`](super::FORK_PHASES_HEADER)
/// of a running sandbox's fork answer (the body is E2B's list): where the
/// fork's time went, in milliseconds. The node's steps follow each other
/// and add up to `totalMs` but for the bookkeeping between them:
/// `admittedMs`, `vmmsTakenMs` (the children's VMMs from the pool, while
/// the parent runs), `forkCallMs` (the parent's VMM's fork, the pause in
/// it), `recordedMs`, `childrenMs` (until the last child was ready).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForkPhases {
    /// Children made on this node (the per-child figures are theirs).
    pub children: u32,
    pub admitted_ms: f64,
    pub vmms_taken_ms: f64,
    pub fork_call_ms: f64,
    /// How long the parent stood still (the VMM's measure, inside
    /// `forkCallMs`).
    pub parent_paused_ms: f64,
    pub recorded_ms: f64,
    pub children_ms: f64,
    pub total_ms: f64,
    /// The VMM's steps while the parent stood still (absent from a VMM
    /// that does not report them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm: Option<VmmForkPhases>,
    /// Each child's steps, over the children made here.
    pub child: ChildPhases,
}

/// The parent's VMM's steps in a fork, in the order they run, in
/// milliseconds (see [`ForkPhases`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmmForkPhases {
    /// Before the freeze: each writable disk's next layer (the parent's)
    /// made.
    #[serde(default)]
    pub disks_prepared_ms: f64,
    /// vCPUs parked and device threads held.
    pub freeze_ms: f64,
    /// vCPU, VM and device state read.
    pub state_saved_ms: f64,
    /// Guest memory frozen into the fork's layer.
    pub memory_ms: f64,
    pub memory_bytes: u64,
    /// Every writable disk sealed and switched to the parent's prepared
    /// layer.
    pub disks_ms: f64,
    /// Devices and vCPUs let go.
    pub resume_ms: f64,
    /// After the resume: each child's layers stacked on the sealed ones.
    #[serde(default)]
    pub children_disks_ms: f64,
    /// After the resume: the state file encoded and written.
    pub state_written_ms: f64,
}

/// Each fork child's steps in milliseconds, as the median and the slowest
/// child's (see [`ForkPhases`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChildPhases {
    /// Its VMM put in its cgroup.
    pub confined_ms: Spread,
    /// The fork's state restored in its VMM.
    pub loaded_ms: Spread,
    /// Then until its agent took its init.
    pub agent_ready_ms: Spread,
    /// Then its record stored.
    pub recorded_ms: Spread,
    /// When it was ready, counted from the start of `childrenMs`.
    pub ready_at_ms: Spread,
}

/// The median and the largest of one figure over a fork's children (both 0
/// with none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub median: f64,
    pub max: f64,
}

/// Sandfork's `GET /v1/unrouted/...` answer: the sandbox an envd request
/// that names none belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxOwner {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
}

// ---- Metrics and logs -----------------------------------------------------

/// E2B's SandboxMetric (all nine fields required by the SDKs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    pub timestamp: String,
    pub timestamp_unix: u64,
    pub cpu_count: u32,
    pub cpu_used_pct: f32,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// `GET /sandboxes/metrics`: the latest sample of each sandbox that has one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxesMetrics {
    pub sandboxes: BTreeMap<String, SandboxMetric>,
}

/// E2B's SandboxLogEntry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLogEntry {
    pub timestamp: String,
    pub level: String,
    pub message: String,
    pub fields: LogFields,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogFields {
    pub source: String,
}

/// E2B's SandboxLog: a line as text holding a [`LogLine`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLog {
    pub timestamp: String,
    pub line: String,
}

/// What a v1 log line's text holds, as E2B's log pipeline stores envd's
/// structured lines (the E2B CLI's `sandbox logs` reads `level`; `logger`
/// is what its `--loggers` filters).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    pub level: String,
    pub logger: String,
    pub message: String,
}

/// `GET /sandboxes/{id}/logs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxLogs {
    pub logs: Vec<SandboxLog>,
    pub log_entries: Vec<SandboxLogEntry>,
}

/// `GET /v2/sandboxes/{id}/logs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLogsV2 {
    pub logs: Vec<SandboxLogEntry>,
}

// ---- Snapshots ------------------------------------------------------------

/// E2B's SnapshotInfo, plus where it came from and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
    /// `null` when the sandbox is not known.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: Option<String>,
    pub created_at: String,
}
