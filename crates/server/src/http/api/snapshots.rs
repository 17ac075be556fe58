//! Snapshot routes: `POST /sandboxes/{id}/snapshots`, `GET /snapshots`,
//! `POST /snapshots/{id}/fork` (deleting one is `DELETE /templates/{id}`, in
//! `templates.rs`).

use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;

use super::extract::{JsonBody, SandboxId};
use super::list::{MAX_LIMIT, parse_limit};
use super::sandboxes::{ForkBody, fork_answer, fork_request, made, remove_if_gone};
use super::{ApiError, ClientGone, Shared};
use crate::node::clock::rfc3339;
use crate::node::sandbox::{SnapshotForkParams, SnapshotParams};
use crate::node::store::TemplateRecord;
use crate::node::tenants::Caller;
use crate::wire;

/// E2B's SnapshotInfo (`snapshotID`, `names`), plus where it came from.
impl From<&TemplateRecord> for wire::SnapshotInfo {
    fn from(t: &TemplateRecord) -> wire::SnapshotInfo {
        wire::SnapshotInfo {
            snapshot_id: t.id.clone(),
            names: t.names.clone(),
            sandbox_id: t.source_sandbox.clone(),
            created_at: rfc3339(t.created_at_ms),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct NewSnapshot {
    name: Option<String>,
    /// `false`: a filesystem-only snapshot, whose sandboxes cold-boot.
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`: 201 with the SnapshotInfo; the sandbox
/// runs on. 404 unknown sandbox, 409 paused or changing state or name taken.
pub async fn create(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    SandboxId(id): SandboxId,
    JsonBody(req): JsonBody<NewSnapshot>,
) -> Result<Response, ApiError> {
    // Owned by the sandbox's team before it exists.
    let snapshot_id = crate::node::ids::sandbox_id()
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    super::tenancy::own_template(&state, &caller, &snapshot_id)?;
    let params = SnapshotParams {
        name: req.name.filter(|n| !n.is_empty()),
        id: Some(snapshot_id.clone()),
        filesystem_only: req.memory == Some(false),
    };
    let record = match state.manager.snapshot(&id, params).await {
        Ok(record) => record,
        Err(e) => {
            super::tenancy::disown_template(&state, &snapshot_id);
            return Err(e.into());
        }
    };
    state.templates.made_ready(&record.id).await;
    Ok((StatusCode::CREATED, Json(wire::SnapshotInfo::from(&record))).into_response())
}

/// `POST /snapshots/{id}/fork` (the shape of E2B's PR infra #3441): `count`
/// new sandboxes from the snapshot `id` (its id or name, URL-encoded), 201
/// with one `{"sandbox": ...}` or `{"error": ...}` per child as a sandbox's
/// fork answers. Body `{count, timeout, metadata}`, all optional; the count
/// and timeout are checked before the snapshot is looked up (404 unknown).
pub async fn fork(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    gone: ClientGone,
    JsonBody(req): JsonBody<ForkBody>,
) -> Result<Response, ApiError> {
    let (timeout, count) = fork_request(&state, &req)?;
    // Taken on another node of the cluster: taken in first (the owner
    // check in front of the routes passed it as unknown).
    if let Some(cluster) = &state.cluster {
        cluster.take_in_template_for(&caller, &id).await?;
    }
    super::tenancy::check_template(&state, &caller, &id)?;
    let params = SnapshotForkParams {
        timeout,
        metadata: req.metadata.unwrap_or_default(),
        team: caller.stored_team(),
    };
    let results = state.manager.fork_snapshot(&id, count, params).await?;
    remove_if_gone(&state, &gone, made(&results)).await?;
    Ok(fork_answer(results, None))
}

#[derive(Debug, Default, PartialEq, Eq)]
struct SnapshotQuery {
    sandbox: Option<String>,
    name: Option<String>,
    limit: usize,
    /// (created at, id) of the last snapshot of the previous page.
    next: Option<(u64, String)>,
}

fn parse_query(raw: Option<&str>) -> Result<SnapshotQuery, ApiError> {
    let mut q = SnapshotQuery {
        limit: MAX_LIMIT,
        ..SnapshotQuery::default()
    };
    for (key, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        if value.is_empty() {
            continue;
        }
        match key.as_ref() {
            wire::SANDBOX_ID_PARAM => q.sandbox = Some(value.into_owned()),
            "name" => q.name = Some(value.into_owned()),
            "limit" => q.limit = parse_limit(&value)?,
            "nextToken" => {
                q.next = Some(
                    value
                        .split_once('.')
                        .and_then(|(ms, id)| Some((ms.parse().ok()?, id.to_owned())))
                        .ok_or_else(|| ApiError::bad_request("nextToken is malformed"))?,
                )
            }
            _ => {}
        }
    }
    Ok(q)
}

/// `GET /snapshots`: newest first, `x-next-token` when more follow.
pub async fn list(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    uri: Uri,
) -> Result<Response, ApiError> {
    let q = parse_query(uri.query())?;
    let mut all = state
        .manager
        .snapshots(q.sandbox.as_deref(), q.name.as_deref())?;
    all.retain(|t| super::tenancy::sees_template(&state, &caller, &t.id));
    // The template builds' step cache is not anyone's snapshots.
    let cache = state.templates.cache_templates();
    all.retain(|t| !cache.contains(&t.id));
    all.reverse();
    if let Some((ms, id)) = &q.next {
        all.retain(|t| (t.created_at_ms, &t.id) < (*ms, id));
    }
    let next = (all.len() > q.limit).then(|| {
        let last = &all[q.limit - 1];
        format!("{}.{}", last.created_at_ms, last.id)
    });
    all.truncate(q.limit);
    let body: Vec<wire::SnapshotInfo> = all.iter().map(wire::SnapshotInfo::from).collect();
    Ok(super::list::page_answer(body, next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_is_parsed_and_checked() {
        let q = parse_query(Some("sandboxID=abc&name=n%2Fx&limit=5&nextToken=12.zz")).unwrap();
        assert_eq!(
            q,
            SnapshotQuery {
                sandbox: Some("abc".into()),
                name: Some("n/x".into()),
                limit: 5,
                next: Some((12, "zz".into())),
            }
        );
        assert_eq!(parse_query(None).unwrap().limit, MAX_LIMIT);
        assert_eq!(parse_query(Some("limit=")).unwrap().limit, MAX_LIMIT);
        for bad in ["limit=0", "limit=101", "limit=x", "nextToken=nodot"] {
            assert_eq!(
                parse_query(Some(bad)).unwrap_err().status,
                StatusCode::BAD_REQUEST,
                "{bad}"
            );
        }
    }
}
