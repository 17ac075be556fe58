//! E2B's template and build answers (and sandfork's `POST /templates`).

use serde::{Deserialize, Serialize};

/// E2B's Template as `GET /templates` and `GET /v2/templates` list it, plus
/// sandfork's `kind` and `source`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Template {
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Its last build's id (its own id for a template made without a
    /// build record, as `base` and snapshots).
    #[serde(rename = "buildID")]
    pub build_id: String,
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
    /// A template does not change once made: its making.
    pub updated_at: String,
    /// No user accounts here: always null.
    pub created_by: Option<TeamUser>,
    /// Not counted here: null and 0.
    pub last_spawned_at: Option<String>,
    pub spawn_count: u64,
    pub build_count: u64,
    pub build_status: String,
    pub public: bool,
    /// One of the node's own (see `GET /default-templates`).
    pub is_default: bool,
    pub envd_version: String,
}

/// E2B's TeamUser.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TeamUser {
    pub id: String,
    pub email: Option<String>,
}

/// What names a build in each answer about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildNames {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub names: Vec<String>,
}

/// Sandfork's `POST /templates` 202: the build runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateBuildStarted {
    #[serde(flatten)]
    pub build: BuildNames,
    pub status: String,
}

/// E2B's TemplateRequestResponseV3 (`POST /v3/templates`; the SDK needs all
/// six).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRequested {
    #[serde(flatten)]
    pub build: BuildNames,
    pub public: bool,
    pub tags: Vec<String>,
    pub aliases: Vec<String>,
}

/// E2B's TemplateBuild (`GET /templates/{id}/builds/{buildID}/status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuild {
    #[serde(flatten)]
    pub build: BuildNames,
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

/// E2B's TemplateTagsCountResponse (`GET /templates/{id}/tags/count`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateTagsCount {
    pub total: usize,
}

/// E2B's TemplateTagExistsResponse (`GET /templates/{id}/tags/exists`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateTagExists {
    pub exists: bool,
    pub normalized_tag: String,
}

/// E2B's TemplateTagAssignment: a tag given to a build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateTagAssignment {
    pub assignment_id: String,
    pub build_id: String,
    pub assigned_at: String,
    pub build_created_at: String,
    pub build_finished_at: Option<String>,
}

/// E2B's TemplateTagGroup: a tag and its assignments, latest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateTagGroup {
    pub tag: String,
    pub assignments: Vec<TemplateTagAssignment>,
    pub has_more: bool,
}

/// E2B's TemplateTagGroupsResponse (`GET /templates/{id}/tags/groups`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateTagGroups {
    pub tags: Vec<TemplateTagGroup>,
    pub next_cursor: Option<String>,
}

/// E2B's TemplateTagAssignmentsResponse
/// (`GET /templates/{id}/tags/{tag}/assignments`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateTagAssignments {
    pub data: Vec<TemplateTagAssignment>,
    pub next_cursor: Option<String>,
}
