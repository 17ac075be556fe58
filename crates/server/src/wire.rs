//! The HTTP contract, in one place: E2B's control-plane JSON as `serde` types
//! and every header name E2B's clients and sandfork's nodes exchange.
//!
//! The unmodified E2B SDKs and CLI parse these answers by name, so a field's
//! JSON name, and whether it is left out or sent as `null` when it has no
//! value, is part of the contract: `Option` fields without
//! `skip_serializing_if` are sent as `null` on purpose (E2B's SDKs declare
//! them nullable), those with it are left out (E2B's SDKs would parse a
//! present `null` as a value). The types derive `Deserialize` too, for the
//! clients of this contract (the gateway, a node asking another, the CLI).
//!
//! A leaf: nothing here imports from the node, the cluster or the HTTP floor.
//! Records become these types beside the handlers that answer them, in
//! `http/`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

// ---- Headers --------------------------------------------------------------

/// E2B: the API key of a control-plane request.
pub const API_KEY_HEADER: &str = "x-api-key";
/// E2B: a sandbox's envd access token, on envd requests.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// E2B: the next page's token of a list answer (absent or empty: none).
pub const NEXT_TOKEN_HEADER: &str = "x-next-token";
/// E2B: the sandbox an envd request is for (with [`SANDBOX_PORT_HEADER`]).
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// E2B: the guest port an envd request is for.
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";
/// E2B: a private sandbox's traffic token, on requests to its own ports.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Sandfork's, on a fork's answer: how long the parent's guest was stopped
/// for the freeze, in milliseconds. (`sdk_bench.py` spells it too.)
pub const PARENT_PAUSED_HEADER: &str = "sandfork-parent-paused-ms";
/// Sandfork's, on a 429 that is the caller's team's limit, not the node's: a
/// gateway answers it rather than trying the next node (the team's limit is
/// the same on every node).
pub const TEAM_LIMIT_HEADER: &str = "x-sandfork-team-limit";
/// Sandfork's, on a 503 because the cluster's state (etcd) could not be read
/// or written: a gateway answers it rather than trying the next node (every
/// node would wait for etcd as long).
pub const CLUSTER_STATE_HEADER: &str = "x-sandfork-cluster-state";
/// Sandfork's, set by a gateway on a resume or connect it sends to a node
/// other than the sandbox's, whose node is gone: take the sandbox in first.
pub const TAKE_IN_HEADER: &str = "x-sandfork-take-in";
/// Sandfork's, on a pause's answer: whether the pause is in the object store.
pub const DURABLE_HEADER: &str = "x-sandfork-durable";
/// Sandfork's, on a gateway's `/v1/unrouted` question to a node: the method
/// of the envd request it asks about.
pub const UNROUTED_METHOD_HEADER: &str = "x-sandfork-method";
/// Sandfork's, node to node: a frozen fork's token when fetching its chunks.
/// The cluster crate's client (`sandfork_cluster::peer`) sits below the
/// server and sends it under its own constant; a test below keeps the two
/// equal, so that this module stays free of the cluster crate.
pub const FORK_TOKEN_HEADER: &str = "x-sandfork-fork-token";

// ---- Errors ---------------------------------------------------------------

/// E2B's Error body: `{"code": <status>, "message": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Error {
    pub code: u16,
    pub message: String,
}

/// E2B's proxy answer for a request to a sandbox (envd or another guest
/// port) it cannot serve; the SDKs read "was not found" in `message` as "not
/// running", "port is not open" as "envd unreachable".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyError {
    #[serde(rename = "sandboxId")]
    pub sandbox_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u32>,
    pub message: String,
    pub code: u16,
}

// ---- Sandboxes ------------------------------------------------------------

/// E2B's Sandbox: the answer of create, connect and resume, and a fork
/// child's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub alias: Option<String>,
    /// A node id the SDKs require and never use.
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: String,
    pub envd_access_token: Option<String>,
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

/// E2B's ListedSandbox (`GET /sandboxes`, `GET /v2/sandboxes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub alias: Option<String>,
    #[serde(rename = "clientID")]
    pub client_id: String,
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
        })
    }

    /// The child's id when it was made.
    pub fn sandbox_id(&self) -> Option<&str> {
        match self {
            ForkEntry::Sandbox(s) => Some(&s.sandbox_id),
            ForkEntry::Error(_) => None,
        }
    }
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

// ---- Templates and builds -------------------------------------------------

/// E2B's Template as `GET /templates` and `GET /v2/templates` list it, plus
/// sandfork's `kind` and `source`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Template {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: Option<String>,
    pub names: Vec<String>,
    pub aliases: Vec<String>,
    /// `base`, `built` or `snapshot`.
    pub kind: String,
    pub source: Option<String>,
    pub cpu_count: u8,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub created_at: String,
    pub build_status: String,
    pub public: bool,
    pub envd_version: String,
}

/// Sandfork's `POST /templates` 202: the build runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateBuildStarted {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub names: Vec<String>,
    pub status: String,
}

/// E2B's TemplateRequestResponseV3 (`POST /v3/templates`; the SDK needs all
/// six).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRequested {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub public: bool,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    pub aliases: Vec<String>,
}

/// E2B's TemplateBuild (`GET /templates/{id}/builds/{buildID}/status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuild {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub names: Vec<String>,
    pub status: String,
    pub logs: Vec<String>,
    pub log_entries: Vec<BuildLogEntry>,
    pub started_at: String,
    pub finished_at: Option<String>,
    /// A failed build's; E2B's SDK parses a present `reason` as an object,
    /// so it is left out, not null, otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<BuildReason>,
}

/// E2B's BuildStatusReason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildReason {
    pub message: String,
    /// E2B's failing step: `base`, `1`... or `finalize`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

/// E2B's BuildLogEntry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildLogEntry {
    pub timestamp: String,
    /// `info` or `error`.
    pub level: String,
    pub message: String,
}

/// `PATCH /v2/templates/{id}`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateNames {
    pub names: Vec<String>,
}

/// E2B's TemplateBuildFileUpload (`GET /templates/{id}/files/{hash}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateBuildFileUpload {
    pub present: bool,
    pub url: String,
}

/// E2B's TemplateAliasResponse (`GET /templates/aliases/{alias}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateAlias {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub public: bool,
}

/// E2B's AssignedTemplateTags (`POST /templates/tags`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignedTemplateTags {
    pub tags: Vec<String>,
    #[serde(rename = "buildID")]
    pub build_id: String,
}

/// E2B's TemplateTag (`GET /templates/{id}/tags`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateTag {
    pub tag: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub created_at: String,
}

// ---- Node status (`GET /v1/node`, sandfork's) -----------------------------

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskUsage {
    pub total: u64,
    pub free: u64,
    pub min_free: u64,
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn the_fork_token_header_is_the_cluster_clients() {
        assert_eq!(FORK_TOKEN_HEADER, sandfork_cluster::peer::TOKEN_HEADER);
    }

    #[test]
    fn fork_entries_are_e2bs_two_shapes() {
        let made: ForkEntry = serde_json::from_value(json!({"sandbox": {
            "sandboxID": "a", "templateID": "base", "alias": null, "clientID": "c",
            "envdVersion": "0.5.7", "envdAccessToken": "t", "trafficAccessToken": null,
            "domain": null, "someFieldOfLater": 1,
        }}))
        .unwrap();
        assert_eq!(made.sandbox_id(), Some("a"));
        let failed = ForkEntry::error(503, "full");
        assert_eq!(
            serde_json::to_value(&failed).unwrap(),
            json!({"error": {"code": 503, "message": "full"}})
        );
        assert_eq!(failed.sandbox_id(), None);
    }

    #[test]
    fn nulls_are_sent_and_absent_fields_left_out_as_e2b_does() {
        let pressure = MemoryPressure {
            enabled: false,
            figures: None,
        };
        assert_eq!(
            serde_json::to_value(pressure).unwrap(),
            json!({"enabled": false})
        );
        let build = TemplateBuild {
            template_id: "t".into(),
            build_id: "b".into(),
            names: vec![],
            status: "building".into(),
            logs: vec![],
            log_entries: vec![],
            started_at: "x".into(),
            finished_at: None,
            reason: None,
        };
        let v = serde_json::to_value(build).unwrap();
        assert_eq!(v["finishedAt"], Value::Null);
        assert!(v.get("finishedAt").is_some() && v.get("reason").is_none());
        let error = ProxyError {
            sandbox_id: "s".into(),
            port: None,
            message: "m".into(),
            code: 502,
        };
        assert_eq!(
            serde_json::to_value(error).unwrap(),
            json!({"sandboxId": "s", "message": "m", "code": 502})
        );
    }
}
