//! The envd HTTP surface of the real agent binary in host mode: /health,
//! /init, /envs, access-token enforcement, Connect framing errors.

#![cfg(test)]

mod common;

use common::Agent;
use serde_json::json;

/// The token the first /init sets, as its header.
const TOKEN: (&str, &str) = ("x-access-token", "tok_envd_secret");

#[test]
fn init_sets_envs_and_token_which_is_then_enforced() {
    let agent = Agent::start();
    assert_eq!(agent.get("/envs", &[]).status, 200);
    assert_eq!(agent.get("/envs", &[]).json(), json!({}));

    let init = json!({
        "accessToken": "tok_envd_secret",
        "envVars": {"A": "1", "B": "two"},
        "defaultUser": "root",
        "defaultWorkdir": "/tmp",
        "timestamp": "2026-01-01T00:00:00Z"
    });
    let r = agent.post("/init", "application/json", init.to_string().as_bytes());
    assert_eq!(r.status, 204, "{r:?}");

    // Now every route but /health (and /init, /files) needs the token.
    let r = agent.get("/envs", &[]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["code"], 401);
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("access token")
    );
    let r = agent.get("/envs", &[("x-access-token", "wrong")]);
    assert_eq!(r.status, 401);
    let r = agent.get("/envs", &[TOKEN]);
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"A": "1", "B": "two"}));
    assert_eq!(agent.get("/health", &[]).status, 204);
    let r = agent.unary("/process.Process/List", &[], &json!({}));
    assert_eq!(r.status, 401);

    // Re-init needs the old token; then env vars merge.
    let again = json!({"envVars": {"C": "3"}}).to_string();
    assert_eq!(
        agent.request("POST", "/init", &[], again.as_bytes()).status,
        401
    );
    let r = agent.request("POST", "/init", &[TOKEN], again.as_bytes());
    assert_eq!(r.status, 204);
    let r = agent.get("/envs", &[TOKEN]);
    assert_eq!(r.json(), json!({"A": "1", "B": "two", "C": "3"}));
}

#[test]
fn init_rejects_bad_json_and_accepts_an_empty_body() {
    let agent = Agent::start();
    assert_eq!(agent.request("POST", "/init", &[], b"{nope").status, 400);
    assert_eq!(agent.request("POST", "/init", &[], b"").status, 204);
    // The clock is only set as PID 1; a bad timestamp is only logged.
    let r = agent.request("POST", "/init", &[], br#"{"timestamp":"yesterday"}"#);
    assert_eq!(r.status, 204);
}
