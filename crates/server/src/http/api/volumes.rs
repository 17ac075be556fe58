//! Volumes (see [`crate::node::volume`]): E2B's `POST/GET /volumes` and
//! `GET/DELETE /volumes/{id}`, each of the caller's team only: another
//! team's volume answers as an unknown one.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::extract::JsonBody;
use super::{ApiError, Shared};
use crate::node::tenants::Caller;
use crate::node::volume::VolumeRecord;
use crate::wire;

fn volume_json(v: &VolumeRecord) -> wire::Volume {
    wire::Volume {
        volume_id: v.id.clone(),
        name: v.name.clone(),
        size_mb: v.size_mb,
    }
}

fn with_token(v: &VolumeRecord) -> wire::VolumeAndToken {
    wire::VolumeAndToken {
        volume: volume_json(v),
        token: v.token.as_str().to_owned(),
    }
}

/// `POST /volumes`: 201 with the volume and its token.
pub async fn create(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    JsonBody(body): JsonBody<wire::NewVolume>,
) -> Result<Response, ApiError> {
    let name = body.name.unwrap_or_default();
    let v = state
        .manager
        .create_volume(&caller.team, &name, body.size_mb)
        .await?;
    Ok((StatusCode::CREATED, Json(with_token(&v))).into_response())
}

/// `GET /volumes`: the team's, oldest first.
pub async fn list(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<wire::Volume>>, ApiError> {
    let all = state.manager.volumes(&caller.team)?;
    Ok(Json(all.iter().map(volume_json).collect()))
}

pub async fn get(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<wire::VolumeAndToken>, ApiError> {
    Ok(Json(with_token(&state.manager.volume(&caller.team, &id)?)))
}

/// `DELETE /volumes/{id}`: 204; 409 while a sandbox mounts it.
pub async fn delete(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.manager.delete_volume(&caller.team, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
