//! E2B's sandbox network API: the create body's `allow_internet_access` and
//! `network`, `PUT /sandboxes/{id}/network` (replaces the policy live), and
//! the network fields of the sandbox detail.

use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::Value;

use sandfork_network::EgressPolicy;

use super::extract::{JsonBody, SandboxId};

use super::{ApiError, Shared};
use crate::http::proxy::{Ingress, IngressError};
use crate::node::net::SandboxNetwork;
use crate::wire;

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
    https_ports: Option<Vec<u32>>,
}

/// `PUT /sandboxes/{id}/network`'s body: the same rules, replacing all.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct UpdateBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
    dns_servers: Option<Value>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// A field this node does not implement: refused (400) rather than ignored,
/// saying why.
fn unsupported(field: &str) -> ApiError {
    let why = match field {
        "rules" => {
            "header transforms need a proxy that terminates the guest's TLS with a CA the \
             guest trusts; this node's egress proxy only reads the SNI"
        }
        "egressProxy" => {
            "egress leaves through the node's own NAT and egress proxy, not through a SOCKS5 \
             proxy of yours (E2B's open-source runtime refuses it too)"
        }
        "dnsServers" => {
            "sandboxes resolve through the node's DNS forwarder (their gateway), which \
             follows the domain rules, and a name reaches only the addresses it answered; \
             no resolver needs opening"
        }
        _ => "not implemented",
    };
    ApiError::bad_request(format!(
        "network.{field} is not supported by this node: {why}"
    ))
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
        ..SandboxNetwork::default()
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
    ])?;
    let ingress = Ingress::new(n.allow_public_traffic, n.mask_request_host)
        .and_then(|i| i.with_https_ports(n.https_ports.unwrap_or_default()))
        .map_err(|e| match e {
            IngressError::Token(_) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
            }
            _ => ApiError::bad_request(e.to_string()),
        })?;
    let mut network = resolve(
        allow_internet_access,
        n.allow_out.unwrap_or_default(),
        n.deny_out.unwrap_or_default(),
    )?;
    network.ingress = ingress;
    Ok(network)
}

/// `network` of the sandbox detail, as E2B's API reports it: always an
/// object holding only what was set (no `allowPublicTraffic` unless given,
/// so `{}` for a sandbox created without network rules). Its
/// `allowInternetAccess` beside is null when never set.
pub(super) fn detail(n: &SandboxNetwork) -> wire::NetworkDetail {
    wire::NetworkDetail {
        allow_out: n.allow_out.clone(),
        deny_out: n.deny_out.clone(),
        allow_public_traffic: n.ingress.allow_public_traffic,
        mask_request_host: n.ingress.mask_request_host.clone(),
        https_ports: n.ingress.https_ports.clone(),
    }
}

pub async fn update(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
    JsonBody(req): JsonBody<UpdateBody>,
) -> Result<StatusCode, ApiError> {
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
    use crate::node::store::SandboxRecord;
    use serde_json::json;

    /// The sandbox detail as JSON.
    fn detail_of(r: &SandboxRecord) -> Value {
        serde_json::to_value(wire::SandboxDetail::from(r)).unwrap()
    }

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
            (
                r#"{"maskRequestHost":"a:b:c"}"#,
                "mask request host is not valid",
            ),
            (
                r#"{"rules":{"a.com":[]}}"#,
                "network.rules is not supported",
            ),
            (
                r#"{"egressProxy":{"address":"x"}}"#,
                "network.egressProxy is not supported",
            ),
            (
                r#"{"dnsServers":["8.8.8.8"]}"#,
                "network.dnsServers is not supported",
            ),
            (r#"{"httpsPorts":[49983]}"#, "httpsPorts: 49983"),
            (r#"{"httpsPorts":[0]}"#, "httpsPorts: 0"),
            (r#"{"httpsPorts":[70000]}"#, "httpsPorts: 70000"),
        ];
        for (json, says) in cases {
            let e = from_create(None, Some(body(json))).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{json}");
            assert!(e.message.contains(says), "{json}: {}", e.message);
        }
        // What E2B's SDKs send when the caller gave nothing.
        let public = from_create(None, Some(body(r#"{"allowPublicTraffic":true}"#))).unwrap();
        assert_eq!(public.ingress.traffic_access_token, None);
    }

    #[test]
    fn a_private_sandbox_has_a_token_and_its_detail_says_what_was_asked() {
        let n = from_create(
            None,
            Some(body(
                r#"{"allowPublicTraffic":false,"maskRequestHost":"${PORT}-app.test","httpsPorts":[8443,3000,8443]}"#,
            )),
        )
        .unwrap();
        assert!(n.ingress.traffic_access_token.is_some());
        assert!(n.ingress.is_https(8443) && n.ingress.is_https(3000));
        assert!(!n.ingress.is_https(80));
        let record = SandboxRecord {
            network: n,
            ..SandboxRecord::default()
        };
        let v = detail_of(&record);
        assert_eq!(v["allowInternetAccess"], Value::Null);
        assert_eq!(
            v["network"],
            json!({
                "allowPublicTraffic": false,
                "maskRequestHost": "${PORT}-app.test",
                "httpsPorts": [3000, 8443],
            })
        );
        // The token is the Sandbox object's, never the detail's.
        assert!(
            !v.to_string().contains(
                record
                    .network
                    .ingress
                    .traffic_access_token
                    .as_deref()
                    .unwrap()
            )
        );
        // Nothing set: an empty object, as E2B answers.
        let v = detail_of(&SandboxRecord::default());
        assert_eq!(v["network"], json!({}));
        let ruled = SandboxRecord {
            network: from_create(
                Some(true),
                Some(body(r#"{"allowOut":["1.1.1.1"],"denyOut":["0.0.0.0/0"]}"#)),
            )
            .unwrap(),
            ..SandboxRecord::default()
        };
        let v = detail_of(&ruled);
        assert_eq!(v["allowInternetAccess"], true);
        assert_eq!(
            v["network"],
            json!({"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]})
        );
    }
}
