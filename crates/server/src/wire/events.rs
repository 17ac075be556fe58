//! E2B's sandbox lifecycle events: the webhooks' registrations
//! (`/events/webhooks`), their deliveries, the event each delivery carries
//! and `GET /events/sandboxes` answers, and the headers a delivery is
//! signed with.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// E2B: on a delivery, the webhook it is for.
pub const WEBHOOK_ID_HEADER: &str = "e2b-webhook-id";
/// E2B: on a delivery, its own id (the same on each of its attempts).
pub const DELIVERY_ID_HEADER: &str = "e2b-delivery-id";
/// E2B: on a delivery, the signature's scheme ([`SIGNATURE_VERSION`]).
pub const SIGNATURE_VERSION_HEADER: &str = "e2b-signature-version";
/// E2B: on a delivery, base64 (unpadded) of SHA-256 of the webhook's
/// secret followed by the body.
pub const SIGNATURE_HEADER: &str = "e2b-signature";
pub const SIGNATURE_VERSION: &str = "v1";
/// E2B's version of the event's shape.
pub const EVENT_VERSION: &str = "v2";

/// `POST /events/webhooks` and `PATCH /events/webhooks/{id}`: a create
/// needs `url`, `events` and `signatureSecret`; an update changes what it
/// names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature_secret: Option<String>,
}

/// A webhook as answered (its secret never is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Webhook {
    pub id: String,
    #[serde(rename = "teamID")]
    pub team_id: String,
    pub name: String,
    pub created_at: String,
    pub enabled: bool,
    pub url: String,
    pub events: Vec<String>,
}

/// One event sent to one webhook: `GET /events/webhooks/{id}/deliveries`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookDelivery {
    pub id: String,
    #[serde(rename = "webhookID")]
    pub webhook_id: String,
    #[serde(rename = "eventID")]
    pub event_id: String,
    pub event_type: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// `pending` (attempts left), `delivered` (a 2xx) or `failed` (none left).
    pub status: String,
    pub attempts: u32,
    /// The receiver's status on the last attempt, if it answered.
    pub response_status: Option<u16>,
    /// Why the last attempt failed.
    pub error: Option<String>,
    pub created_at: String,
    pub last_attempt_at: Option<String>,
}

/// A lifecycle event: a delivery's body, and an entry of
/// `GET /events/sandboxes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxEvent {
    pub version: String,
    pub id: String,
    /// `sandbox.lifecycle.<created|killed|paused|resumed|forked>`.
    #[serde(rename = "type")]
    pub event_type: String,
    pub event_data: SandboxEventData,
    pub sandbox_build_id: String,
    pub sandbox_execution_id: String,
    pub sandbox_id: String,
    pub sandbox_team_id: String,
    pub sandbox_template_id: String,
    pub timestamp: String,
}

/// E2B spells these in snake case.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxEventData {
    pub sandbox_metadata: BTreeMap<String, String>,
    /// On `killed` and `paused`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution: Option<Execution>,
    /// Sandfork's, on `forked`: the sandbox (or snapshot) the child came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_sandbox_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Execution {
    pub started_at: String,
    pub vcpu_count: u32,
    pub memory_mb: u64,
    /// Milliseconds since `started_at`.
    pub execution_time: u64,
}

/// `GET /v1/sandboxes/{id}/lineage` (sandfork's): the fork tree the
/// sandbox is in, as far as the node's recent lifecycle events tell it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lineage {
    /// The oldest ancestor the events name (the sandbox itself when none).
    #[serde(rename = "rootID")]
    pub root_id: String,
    /// The sandbox asked about.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// The root first, then each generation, children in the order forked.
    pub nodes: Vec<LineageNode>,
}

/// One sandbox (or snapshot) of a [`Lineage`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineageNode {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// What it was forked from; null for the root.
    #[serde(rename = "parentID")]
    pub parent_id: Option<String>,
    /// Its place among its parent's children, from 0, in the order they
    /// were forked (across fork calls); null for the root.
    pub branch: Option<u32>,
    /// `running`, `paused`, `gone` (killed, or not on this node), or
    /// `snapshot` (a parent that is a snapshot, not a sandbox).
    pub state: String,
    /// Empty when no event named it.
    #[serde(rename = "templateID")]
    pub template_id: String,
}
