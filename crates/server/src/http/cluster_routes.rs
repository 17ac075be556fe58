//! The routes nodes of a cluster ask each other for: the children of a
//! fork frozen on another node (`POST /internal/forks`) and that fork's
//! file chunks (`GET /internal/forks/{export}/chunks/{digest}`). A node
//! outside a cluster answers 404 to both.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use crate::cluster::fork_across::ChildrenRequest;
use crate::cluster::fork_children::ChildrenRefused;
use crate::cluster::fork_files::Refused;
use crate::http::api::{ApiError, MAX_FORK_COUNT, Shared, fork_answer};
use crate::node::tenants::Caller;

pub use crate::cluster::fork_files::CHUNK_ROUTE;

/// `POST /internal/forks`: children of a fork another node froze.
pub async fn make_children(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Json(req): Json<ChildrenRequest>,
) -> Result<Response, ApiError> {
    let node = state
        .cluster
        .as_ref()
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "no such route"))?;
    if req.count == 0 || i64::from(req.count) > MAX_FORK_COUNT {
        return Err(ApiError::bad_request(format!(
            "count must be from 1 to {MAX_FORK_COUNT}"
        )));
    }
    // Other nodes' files are fetched as the caller.
    let api_key = headers
        .get(crate::node::keys::HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let results =
        node.make_children(&caller, api_key, &req)
            .await
            .map_err(|refused| match refused {
                ChildrenRefused::NotTheCallersTeam => {
                    ApiError::new(StatusCode::FORBIDDEN, refused.to_string())
                }
                ChildrenRefused::Invalid(message) => ApiError::bad_request(message),
                ChildrenRefused::Denied(denial) => denial.into(),
                ChildrenRefused::Sandbox(e) => e.into(),
            })?;
    Ok(fork_answer(results, None))
}

/// `GET /internal/forks/{export}/chunks/{digest}`: a chunk of a fork this
/// node serves the files of.
pub async fn serve_chunk(
    State(state): State<Shared>,
    Path((export, digest)): Path<(String, String)>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, "no such fork or chunk");
    let node = state.cluster.as_ref().ok_or_else(not_found)?;
    let token = headers
        .get(crate::wire::FORK_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok());
    match node
        .forks
        .read_chunk(&export, token, &caller, &digest)
        .await
    {
        Ok(data) => Ok((StatusCode::OK, Body::from(data)).into_response()),
        Err(Refused::NotFound) => Err(not_found()),
        Err(Refused::Forbidden) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "missing or wrong fork token",
        )),
        Err(Refused::Unreadable(e)) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e)),
    }
}
