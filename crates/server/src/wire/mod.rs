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
//! `http/`. Here: the headers and the error bodies; the sandboxes' answers
//! in [`sandboxes`], the templates' in [`templates`], sandfork's node status
//! and admin answers in [`admin`], the volumes' in [`volumes`], all
//! re-exported at this level.

use serde::{Deserialize, Serialize};

pub mod admin;
pub mod events;
pub mod sandboxes;
pub mod templates;
pub mod volumes;

pub use admin::*;
pub use events::*;
pub use sandboxes::*;
pub use templates::*;
pub use volumes::*;

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

/// E2B: a create's idempotency key (`[a-z0-9-]{1,255}`), on
/// `POST /v2/sandboxes`: a retry with it answers the first create's sandbox.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// E2B: on a refusal, whether the SDKs should retry it (`true`/`false`);
/// when present it decides, whatever the status.
pub const SHOULD_RETRY_HEADER: &str = "should-retry";
/// HTTP's, on a refusal: seconds to wait before retrying, which the SDKs
/// honour.
pub const RETRY_AFTER_HEADER: &str = "retry-after";

/// Sandfork's, on a fork's answer: how long the parent's guest was stopped
/// for the freeze, in milliseconds. (`sdk_bench.py` spells it too.)
pub const PARENT_PAUSED_HEADER: &str = "sandfork-parent-paused-ms";
/// Sandfork's, on a running sandbox's fork answer: where the fork's time
/// went, a JSON [`ForkPhases`] (the body is E2B's list, so it goes beside
/// it). (`sdk_bench.py` spells it too.)
pub const FORK_PHASES_HEADER: &str = "sandfork-fork-phases";
/// Sandfork's, on a 429 that is the caller's team's limit, not the node's: a
/// gateway answers it rather than trying the next node (the team's limit is
/// the same on every node).
pub const TEAM_LIMIT_HEADER: &str = "x-sandfork-team-limit";
/// Sandfork's, on a 503 because the cluster's state (etcd) could not be read
/// or written: a gateway answers it rather than trying the next node (every
/// node would wait for etcd as long).
pub const CLUSTER_STATE_HEADER: &str = "x-sandfork-cluster-state";
/// Sandfork's, on a 503 because the template a create names is being built
/// (a registry image's conversion, the code interpreter's build): a
/// gateway answers it for a create of an image rather than trying the next
/// node (the cluster converts an image once; every node would wait for that
/// conversion as long).
pub const BUILDING_HEADER: &str = "x-sandfork-building";
/// Sandfork's, set by a gateway on a resume or connect it sends to a node
/// other than the sandbox's, whose node is gone: take the sandbox in first.
pub const TAKE_IN_HEADER: &str = "x-sandfork-take-in";
/// Sandfork's, on a gateway's answer gathered from every node (a list, a
/// team's use): the nodes that did not answer, comma-separated, whose part
/// is missing from it. Absent when every node answered.
pub const UNREACHABLE_NODES_HEADER: &str = "x-sandfork-unreachable-nodes";
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

/// E2B's query parameter of `GET /snapshots` naming the sandbox whose
/// snapshots are listed.
pub const SANDBOX_ID_PARAM: &str = "sandboxID";

/// A header map of `pairs`, for the tests of what reads these headers.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn header_map(pairs: &[(&str, &str)]) -> axum::http::HeaderMap {
    let mut h = axum::http::HeaderMap::new();
    for (k, v) in pairs {
        h.insert(
            axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    h
}

// ---- Errors ---------------------------------------------------------------

/// E2B's Error body: `{"code": <status>, "message": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Error {
    pub code: u16,
    pub message: String,
    /// E2B's machine-readable kind of some errors (`idempotency_request_mismatch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
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
            build: BuildNames {
                template_id: "t".into(),
                build_id: "b".into(),
                names: vec![],
            },
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
