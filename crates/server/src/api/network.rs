//! E2B's sandbox network API: the create body's `allow_internet_access` and
//! `network`, `PUT /sandboxes/{id}/network` (replaces the policy live), and
//! the network fields of the sandbox detail.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use sandfork_network::EgressPolicy;

use super::sandboxes::{check_id, parse_body};
use super::{ApiError, Shared};
use crate::net::SandboxNetwork;
use crate::store::SandboxRecord;

/// `SandboxNetworkConfig` as the SDKs send it (camelCase).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct NetworkBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    allow_public_traffic: Option<bool>,
    mask_request_host: Option<String>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
    dns_servers: Option<Value>,
    https_ports: Option<Value>,
}

/// `PUT /sandboxes/{id}/network`'s body: the same rules, replacing all.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct UpdateBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
    dns_servers: Option<Value>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// A field this node does not implement yet: refused rather than ignored.
fn unsupported(field: &str) -> ApiError {
    ApiError::bad_request(format!("network.{field} is not supported by this node yet"))
}

fn refuse_set(fields: &[(&str, &Option<Value>)]) -> Result<(), ApiError> {
    for (name, value) in fields {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported(name));
        }
    }
    Ok(())
}

/// Validates E2B's rules into the policy a slot enforces (E2B's 400 texts).
fn resolve(
    allow_internet_access: Option<bool>,
    allow_out: Vec<String>,
    deny_out: Vec<String>,
) -> Result<SandboxNetwork, ApiError> {
    // Domain names pass too (with all traffic denied): the egress proxy enforces them.
    let policy = EgressPolicy::from_e2b(allow_internet_access, &allow_out, &deny_out)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(SandboxNetwork {
        allow_internet_access,
        allow_out,
        deny_out,
        policy,
        slot: None,
    })
}

/// The network of a create body.
pub(super) fn from_create(
    allow_internet_access: Option<bool>,
    network: Option<NetworkBody>,
) -> Result<SandboxNetwork, ApiError> {
    let n = network.unwrap_or_default();
    refuse_set(&[
        ("rules", &n.rules),
        ("egressProxy", &n.egress_proxy),
        ("dnsServers", &n.dns_servers),
        ("httpsPorts", &n.https_ports),
    ])?;
    // Public URLs behind a traffic token need the token's check in the
    // proxy; a private sandbox must not be served openly meanwhile.
    if n.allow_public_traffic == Some(false) {
        return Err(unsupported("allowPublicTraffic=false"));
    }
    if n.mask_request_host.is_some() {
        return Err(unsupported("maskRequestHost"));
    }
    resolve(
        allow_internet_access,
        n.allow_out.unwrap_or_default(),
        n.deny_out.unwrap_or_default(),
    )
}

/// `allowInternetAccess` and `network` of the sandbox detail.
pub(super) fn detail(r: &SandboxRecord, v: &mut Value) {
    let n = &r.network;
    v["allowInternetAccess"] = json!(n.allow_internet_access);
    v["network"] = json!({
        "allowOut": n.allow_out,
        "denyOut": n.deny_out,
        "allowPublicTraffic": true,
    });
}

pub async fn update(
    State(state): State<Shared>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let id = check_id(&id)?;
    let req: UpdateBody = parse_body(&body)?;
    refuse_set(&[
        ("rules", &req.rules),
        ("egressProxy", &req.egress_proxy),
        ("dnsServers", &req.dns_servers),
    ])?;
    let network = resolve(
        req.allow_internet_access,
        req.allow_out.unwrap_or_default(),
        req.deny_out.unwrap_or_default(),
    )?;
    state.manager.update_network(&id, network).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str) -> NetworkBody {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn e2b_rules_resolve_and_bad_input_is_a_400_that_says_why() {
        let n = from_create(Some(false), None).unwrap();
        assert_eq!(n.policy, EgressPolicy::deny_all());
        assert_eq!(n.allow_internet_access, Some(false));
        let n = from_create(
            None,
            Some(body(r#"{"allowOut":["1.1.1.1"],"denyOut":["0.0.0.0/0"]}"#)),
        )
        .unwrap();
        assert_eq!(n.policy.allow.len(), 1);
        assert_eq!(n.deny_out, ["0.0.0.0/0"]);
        let n = from_create(
            None,
            Some(body(
                r#"{"allowOut":["allowed.test","*.wild.test"],"denyOut":["0.0.0.0/0"]}"#,
            )),
        )
        .unwrap();
        assert_eq!(n.policy.allow_domains.len(), 2);
        assert!(n.policy.proxied());
        let cases = [
            (r#"{"denyOut":["nonsense/99"]}"#, "invalid denied CIDR"),
            (r#"{"allowOut":["example.com"]}"#, "ALL_TRAFFIC"),
            (
                r#"{"allowOut":["example.com"],"denyOut":["10.0.0.0/8"]}"#,
                "ALL_TRAFFIC",
            ),
            (
                r#"{"allowOut":["0.0.0.0/0"],"denyOut":["example.com"]}"#,
                "IP addresses and CIDRs only",
            ),
            (r#"{"allowPublicTraffic":false}"#, "allowPublicTraffic"),
            (r#"{"maskRequestHost":"${PORT}-x"}"#, "maskRequestHost"),
            (r#"{"rules":{"a.com":[]}}"#, "rules"),
            (r#"{"egressProxy":{"address":"x"}}"#, "egressProxy"),
        ];
        for (json, says) in cases {
            let e = from_create(None, Some(body(json))).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{json}");
            assert!(e.message.contains(says), "{json}: {}", e.message);
        }
        // What E2B's SDKs send when the caller gave nothing.
        assert!(from_create(None, Some(body(r#"{"allowPublicTraffic":true}"#))).is_ok());
    }
}
