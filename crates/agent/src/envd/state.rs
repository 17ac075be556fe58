//! Sandbox-wide state shared by every envd handler, set by `POST /init` and
//! read by `GET /envs`, the auth layer and the services.

use std::collections::BTreeMap;
use std::sync::RwLock;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::Envd;
use super::auth;
use super::response::json_error;

/// What `/init` configures. Read often, written rarely.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// Sandbox-wide environment variables, given to every process.
    pub env_vars: BTreeMap<String, String>,
    /// User for requests without `Authorization`.
    pub default_user: Option<String>,
    /// Working directory for processes started without `cwd`.
    pub default_workdir: Option<String>,
    /// When set, every request but the excluded ones must carry it.
    pub access_token: Option<String>,
}

#[derive(Debug, Default)]
pub struct SandboxState {
    settings: RwLock<Settings>,
}

impl SandboxState {
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of the current settings (cheap: a few small strings).
    pub fn settings(&self) -> Settings {
        self.settings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn access_token(&self) -> Option<String> {
        self.settings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .access_token
            .clone()
    }

    pub fn update(&self, f: impl FnOnce(&mut Settings)) {
        f(&mut self.settings.write().unwrap_or_else(|p| p.into_inner()));
    }
}

/// The body of `POST /init` (camelCase as the orchestrator sends it; snake_case
/// accepted too). Fields we do not act on (volume mounts, CA bundle) are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitRequest {
    #[serde(default, alias = "access_token")]
    pub access_token: Option<String>,
    #[serde(default, alias = "env_vars")]
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(default, alias = "default_user")]
    pub default_user: Option<String>,
    #[serde(default, alias = "default_workdir")]
    pub default_workdir: Option<String>,
    /// RFC 3339; sets the guest clock when the agent is PID 1.
    #[serde(default)]
    pub timestamp: Option<String>,
    /// sandfork extension: base64 host entropy to reseed the kernel RNG with
    /// (sent after a restore or fork, when every copy has the same RNG state).
    #[serde(default)]
    pub entropy: Option<envd_proto::json::B64>,
}

/// `POST /init`: 204 on success. Once a token is set, a later `/init` must
/// present it in `X-Access-Token` (the node may re-init after restoring a
/// snapshot; nobody else may).
pub async fn init(
    State(envd): State<Envd>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(token) = envd.sandbox.access_token()
        && !auth::header_token_matches(&headers, &token)
    {
        return auth::unauthorized("access token required to re-initialise");
    }
    let req: InitRequest = if body.iter().all(u8::is_ascii_whitespace) {
        InitRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return json_error(StatusCode::BAD_REQUEST, &format!("invalid /init body: {e}"));
            }
        }
    };
    if let Some(ts) = &req.timestamp {
        match super::clock::parse_rfc3339(ts) {
            Some(when) if envd.pid1 => super::clock::set_if_off(when),
            Some(_) => {}
            None => log::warn!("/init: ignoring unparsable timestamp {ts:?}"),
        }
    }
    if let Some(entropy) = &req.entropy
        && let Err(e) = super::entropy::reseed(&entropy.0)
    {
        log::warn!("/init: cannot reseed the kernel RNG: {e}");
    }
    envd.sandbox.update(|s| {
        if let Some(vars) = req.env_vars {
            s.env_vars.extend(vars);
        }
        if let Some(u) = req.default_user.filter(|u| !u.is_empty()) {
            s.default_user = Some(u);
        }
        if let Some(w) = req.default_workdir.filter(|w| !w.is_empty()) {
            s.default_workdir = Some(w);
        }
        if let Some(t) = req.access_token.filter(|t| !t.is_empty()) {
            s.access_token = Some(t);
        }
    });
    log::info!("/init applied");
    StatusCode::NO_CONTENT.into_response()
}

/// `GET /envs`: the sandbox-wide environment variables as a JSON object.
pub async fn envs(State(envd): State<Envd>) -> Json<BTreeMap<String, String>> {
    Json(envd.sandbox.settings().env_vars)
}
