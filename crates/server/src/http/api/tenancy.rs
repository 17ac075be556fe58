//! Tenancy on the HTTP surface (see [`crate::node::tenants`]): the API key check
//! with its rate limit, the ownership check of every route that names a
//! sandbox or a template in its path (another team's answers exactly as an
//! unknown one: 404), what a team may see in lists and name in bodies, and
//! the admin routes that make teams and keys.
//!
//! Admin routes (the node's own key only; 403 for a team's key):
//! `GET/POST /admin/teams`, `GET/PATCH /admin/teams/{team}` (id or name),
//! `GET/POST /admin/teams/{team}/keys`, `DELETE /admin/keys/{keyID}`.

use std::time::Duration;

use axum::Json;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::extract::{JsonBody, SandboxId};

use super::{ApiError, Shared};
use crate::node::capacity::TeamLimits;
use crate::node::keys::AuthError;
use crate::node::sandbox::SandboxError;
use crate::node::store::SandboxRecord;
use crate::node::tenants::{Caller, KeyRecord, TeamRecord, template_owner_key};
use crate::wire;

/// Route prefixes whose `{id}` is a sandbox.
const SANDBOX_ROUTES: &[&str] = &[
    "/sandboxes/{id}",
    "/v2/sandboxes/{id}",
    "/v1/sandboxes/{id}",
];
/// Route prefixes whose `{id}` is a template, snapshot or build.
const TEMPLATE_ROUTES: &[&str] = &["/templates/{id}", "/v2/templates/{id}", "/snapshots/{id}"];

/// In front of the control plane: the API key (401 without a known one),
/// its rate (429), the admin routes (403 but for the node's own key) and the
/// owner of what the path names (404 for another team's, as for an unknown
/// one). The caller goes on in the request's extensions.
pub async fn require_api_key(
    State(state): State<Shared>,
    mut req: Request,
    next: Next,
) -> Response {
    let key = match req.headers().get(wire::API_KEY_HEADER).map(|v| v.to_str()) {
        None => {
            return ApiError::new(StatusCode::UNAUTHORIZED, "missing X-API-KEY header")
                .into_response();
        }
        Some(Ok(key)) => key.to_owned(),
        Some(Err(_)) => return invalid_key(),
    };
    let Some(caller) = state.keys.authenticate(&key) else {
        return invalid_key();
    };
    // A fork's chunks, fetched by the nodes making its children, are parts
    // of one request already counted (the fork), not requests of their own.
    let chunk = req
        .extensions()
        .get::<MatchedPath>()
        .is_some_and(|p| p.as_str() == crate::http::cluster_routes::CHUNK_ROUTE);
    if !chunk && let Err(wait) = state.keys.admit(&key, &caller) {
        return rate_limited(wait);
    }
    if let Some(refused) = check_path(&state, &caller, &req) {
        return refused;
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

fn invalid_key() -> Response {
    ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key").into_response()
}

/// 429 with `Retry-After` (whole seconds, at least 1), which both SDKs honour.
fn rate_limited(wait: Duration) -> Response {
    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        format!("rate limit exceeded: too many requests with this API key; retry in {secs} s"),
    )
    .with_retry(super::error::Retry::After(
        u32::try_from(secs).unwrap_or(u32::MAX),
    ))
    .into_response()
}

/// The path segment of `path` where the route `template` has `{name}`,
/// percent-decoded as the handlers' `Path` reads it.
fn param(template: &str, path: &str, name: &str) -> Option<String> {
    let index = template.split('/').position(|s| s == name)?;
    let raw = path.split('/').nth(index)?;
    Some(
        percent_encoding::percent_decode_str(raw)
            .decode_utf8_lossy()
            .into_owned(),
    )
}

/// The refusal for a request whose path names what the caller may not use.
fn check_path(state: &Shared, caller: &Caller, req: &Request) -> Option<Response> {
    let template = req.extensions().get::<MatchedPath>()?.as_str();
    if template.starts_with("/admin/") {
        return (!caller.admin).then(|| {
            ApiError::new(
                StatusCode::FORBIDDEN,
                "the admin routes take the node's own API key only",
            )
            .into_response()
        });
    }
    let path = req.uri().path();
    if SANDBOX_ROUTES.iter().any(|p| template.starts_with(p)) {
        let id = SandboxId::parse(&param(template, path, "{id}")?).ok()?;
        let record = state.manager.get(&id).ok()?;
        return (!caller.owns(record.team.as_deref()))
            .then(|| ApiError::from(SandboxError::NotFound(id)).into_response());
    }
    if TEMPLATE_ROUTES.iter().any(|p| template.starts_with(p)) {
        let id = param(template, path, "{id}")?;
        let owner = template_owner(state, &id)?;
        return (!caller.owns(owner.as_deref())).then(|| template_not_found(template, path, &id));
    }
    None
}

/// What each template route answers for a template it does not know.
fn template_not_found(route: &str, path: &str, id: &str) -> Response {
    let message = if route == "/templates/{id}/files/{hash}" {
        format!("template {id} has no build waiting for files")
    } else if route == "/v2/templates/{id}/builds/{build_id}"
        && let Some(build_id) = param(route, path, "{build_id}")
    {
        format!("template {id} has no build {build_id}")
    } else {
        format!("template {id} not found")
    };
    ApiError::new(StatusCode::NOT_FOUND, message).into_response()
}

/// The owner of the template, snapshot or build `id_or_name` names: None
/// when there is none or it is public (`base`), Some(None) for the default
/// team's.
fn template_owner(state: &Shared, id_or_name: &str) -> Option<Option<String>> {
    let manager = &state.manager;
    let id = match manager.resolve_template(id_or_name) {
        Ok(t) if t.id == manager.template().id => return None,
        Ok(t) => t.id,
        Err(_) => match state.templates.status(id_or_name, usize::MAX) {
            Ok((build, _)) => build.template_id,
            Err(_)
                if manager.store().builds().is_ok_and(|builds| {
                    builds
                        .iter()
                        .any(|b| crate::node::template::e2b_build::e2b_template_id(b) == id_or_name)
                }) =>
            {
                id_or_name.to_owned()
            }
            Err(_) => return None,
        },
    };
    manager.store().owner(&template_owner_key(&id)).ok()
}

/// Whether the caller may use template `id_or_name` (its own, public, or
/// unknown: the handler answers for an unknown one). Another team's is
/// refused as an unknown one is.
pub fn check_template(state: &Shared, caller: &Caller, id_or_name: &str) -> Result<(), ApiError> {
    match template_owner(state, id_or_name) {
        Some(owner) if !caller.owns(owner.as_deref()) => Err(ApiError::from(
            SandboxError::TemplateNotFound(id_or_name.to_owned()),
        )),
        _ => Ok(()),
    }
}

/// Whether the caller may see template `id` in a list.
pub fn sees_template(state: &Shared, caller: &Caller, id: &str) -> bool {
    id == state.manager.template().id
        || caller.owns(
            state
                .manager
                .store()
                .owner(&template_owner_key(id))
                .ok()
                .flatten()
                .as_deref(),
        )
}

/// Whether the caller may use sandbox `id` (its own, or unknown); another
/// team's is refused as an unknown one is.
pub fn check_sandbox(state: &Shared, caller: &Caller, id: &str) -> Result<(), ApiError> {
    match state.manager.get(id) {
        Ok(r) if !caller.owns(r.team.as_deref()) => {
            Err(ApiError::from(SandboxError::NotFound(id.to_owned())))
        }
        _ => Ok(()),
    }
}

/// The caller's sandboxes among `all`.
pub fn own_sandboxes(caller: &Caller, all: Vec<SandboxRecord>) -> Vec<SandboxRecord> {
    all.into_iter()
        .filter(|r| caller.owns(r.team.as_deref()))
        .collect()
}

/// Records the caller's team as the owner of template `id` (before it
/// exists, so no other team ever sees it unowned).
pub fn own_template(state: &Shared, caller: &Caller, id: &str) -> Result<(), ApiError> {
    state
        .manager
        .store()
        .set_owner(&template_owner_key(id), caller.stored_team().as_deref())
        .map_err(|e| ApiError::from(SandboxError::Store(e)))
}

/// Forgets the owner of template `id` (it was never made).
pub fn disown_template(state: &Shared, id: &str) {
    let _ = state
        .manager
        .store()
        .set_owner(&template_owner_key(id), None);
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> ApiError {
        let status = match &e {
            AuthError::NoTeam(_) | AuthError::NoKey(_) => StatusCode::NOT_FOUND,
            AuthError::TeamExists(_) => StatusCode::CONFLICT,
            AuthError::Invalid(_) => StatusCode::BAD_REQUEST,
            AuthError::Shared(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

fn team_json(state: &Shared, t: &TeamRecord) -> wire::Team {
    let held = state.manager.capacity().team_held(&t.id);
    wire::Team {
        team_id: t.id.clone(),
        name: t.name.clone(),
        created_at: crate::node::clock::rfc3339(t.created_at_ms),
        limits: t.limits,
        requests_per_second: t.requests_per_second,
        usage: wire::TeamUsage {
            sandboxes: held.sandboxes as u64,
            memory_mb: held.memory_mib,
        },
        keys: state.keys.keys(Some(&t.id)).len() as u64,
    }
}

fn key_json(k: &KeyRecord) -> wire::ApiKey {
    wire::ApiKey {
        key_id: k.id.clone(),
        team_id: k.team.clone(),
        name: k.name.clone(),
        mask: k.mask.clone(),
        created_at: crate::node::clock::rfc3339(k.created_at_ms),
        key: None,
    }
}

/// A team's settings as `POST` and `PATCH /admin/teams` take them; in a
/// `PATCH`, a field left out stays, `null` removes the limit.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct TeamBody {
    name: Option<String>,
    #[serde(default, deserialize_with = "some")]
    max_sandboxes: Option<Option<u64>>,
    #[serde(default, rename = "maxMemoryMB", deserialize_with = "some")]
    max_memory_mb: Option<Option<u64>>,
    #[serde(default, deserialize_with = "some")]
    requests_per_second: Option<Option<u32>>,
}

/// A present field (even `null`) is `Some`.
fn some<'de, T: Deserialize<'de>, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

impl TeamBody {
    fn apply(&self, team: &mut TeamRecord) {
        if let Some(v) = self.max_sandboxes {
            team.limits.max_sandboxes = v;
        }
        if let Some(v) = self.max_memory_mb {
            team.limits.max_memory_mb = v;
        }
        if let Some(v) = self.requests_per_second {
            team.requests_per_second = v;
        }
    }
}

/// `GET /admin/teams`: every team, the default first, with its use.
pub async fn list_teams(State(state): State<Shared>) -> Json<Vec<wire::Team>> {
    let teams = state
        .keys
        .teams()
        .iter()
        .map(|t| team_json(&state, t))
        .collect();
    Json(teams)
}

/// `POST /admin/teams` `{name, maxSandboxes?, maxMemoryMB?, requestsPerSecond?}`: 201.
pub async fn create_team(
    State(state): State<Shared>,
    JsonBody(req): JsonBody<TeamBody>,
) -> Result<Response, ApiError> {
    let name = req
        .name
        .as_deref()
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    let limits = TeamLimits {
        max_sandboxes: req.max_sandboxes.flatten(),
        max_memory_mb: req.max_memory_mb.flatten(),
    };
    let rate = req.requests_per_second.flatten();
    let store = state.manager.store();
    let team = state.keys.create_team(store, name, limits, rate).await?;
    state
        .manager
        .capacity()
        .set_team_limits(&team.id, team.limits);
    Ok((StatusCode::CREATED, Json(team_json(&state, &team))).into_response())
}

fn team(state: &Shared, wanted: &str) -> Result<TeamRecord, ApiError> {
    state
        .keys
        .team(wanted)
        .ok_or_else(|| AuthError::NoTeam(wanted.to_owned()).into())
}

/// `GET /admin/teams/{team}`.
pub async fn get_team(
    State(state): State<Shared>,
    Path(wanted): Path<String>,
) -> Result<Json<wire::Team>, ApiError> {
    Ok(Json(team_json(&state, &team(&state, &wanted)?)))
}

/// `PATCH /admin/teams/{team}` `{maxSandboxes?, maxMemoryMB?, requestsPerSecond?}`:
/// the new settings (for creates, resumes and forks from now on).
pub async fn update_team(
    State(state): State<Shared>,
    Path(wanted): Path<String>,
    JsonBody(req): JsonBody<TeamBody>,
) -> Result<Json<wire::Team>, ApiError> {
    if req.name.is_some() {
        return Err(ApiError::bad_request("a team's name cannot change"));
    }
    let store = state.manager.store();
    let team = state
        .keys
        .update_team(store, &wanted, |t| req.apply(t))
        .await?;
    state
        .manager
        .capacity()
        .set_team_limits(&team.id, team.limits);
    Ok(Json(team_json(&state, &team)))
}

/// `GET /admin/teams/{team}/keys`: the keys (masked), oldest first.
pub async fn list_keys(
    State(state): State<Shared>,
    Path(wanted): Path<String>,
) -> Result<Json<Vec<wire::ApiKey>>, ApiError> {
    let team = team(&state, &wanted)?;
    let keys: Vec<wire::ApiKey> = state
        .keys
        .keys(Some(&team.id))
        .iter()
        .map(key_json)
        .collect();
    Ok(Json(keys))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KeyBody {
    name: Option<String>,
}

/// `POST /admin/teams/{team}/keys` `{name?}`: 201 with the key (`key`,
/// shown this once) and its record.
pub async fn create_key(
    State(state): State<Shared>,
    Path(wanted): Path<String>,
    JsonBody(req): JsonBody<KeyBody>,
) -> Result<Response, ApiError> {
    let store = state.manager.store();
    let (key, record) = state
        .keys
        .create_key(store, &wanted, req.name.as_deref().unwrap_or_default())
        .await?;
    let mut body = key_json(&record);
    body.key = Some(key);
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// `DELETE /admin/keys/{keyID}`: 204; the key's next request is 401.
pub async fn revoke_key(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.keys.revoke_key(state.manager.store(), &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_read_where_the_route_has_them() {
        assert_eq!(
            param("/sandboxes/{id}/pause", "/sandboxes/abc/pause", "{id}").as_deref(),
            Some("abc")
        );
        assert_eq!(
            param("/snapshots/{id}/fork", "/snapshots/n%2Fx/fork", "{id}").as_deref(),
            Some("n/x")
        );
        assert_eq!(param("/snapshots", "/snapshots", "{id}"), None);
    }
}
