//! Lifecycle events (see [`crate::node::webhooks`]): E2B's
//! `POST/GET /events/webhooks`, `GET/PATCH/DELETE /events/webhooks/{id}`,
//! `GET /events/webhooks/{id}/deliveries`, and the node's last events,
//! `GET /events/sandboxes` and `GET /events/sandboxes/{id}`. All of the
//! caller's team only: another team's webhook answers as an unknown one.

use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::extract::{JsonBody, SandboxId};
use super::{ApiError, Shared};
use crate::node::clock::rfc3339;
use crate::node::events::Lifecycle;
use crate::node::tenants::Caller;
use crate::node::webhooks::{self, DeliveryRecord, WebhookRecord};
use crate::wire;

/// E2B's page of `GET /events/sandboxes`: 10 by default, 100 at most.
const DEFAULT_EVENTS: usize = 10;
const MAX_EVENTS: usize = 100;

fn webhook_json(w: &WebhookRecord) -> wire::Webhook {
    wire::Webhook {
        id: w.id.clone(),
        team_id: w.team.clone(),
        name: w.name.clone(),
        created_at: rfc3339(w.created_at_ms),
        enabled: w.enabled,
        url: w.url.clone(),
        events: w.events.clone(),
    }
}

fn delivery_json(d: &DeliveryRecord) -> wire::WebhookDelivery {
    wire::WebhookDelivery {
        id: d.id.clone(),
        webhook_id: d.webhook_id.clone(),
        event_id: d.event_id.clone(),
        event_type: d.event_type.clone(),
        sandbox_id: d.sandbox_id.clone(),
        status: d.status.as_str().to_owned(),
        attempts: d.attempts,
        response_status: d.response_status,
        error: d.error.clone(),
        created_at: rfc3339(d.created_at_ms),
        last_attempt_at: d.last_attempt_at_ms.map(rfc3339),
    }
}

/// `POST /events/webhooks`: 201 with the webhook.
pub async fn create(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    JsonBody(body): JsonBody<wire::WebhookBody>,
) -> Result<Response, ApiError> {
    let w = state.webhooks.create(&caller.team, body)?;
    Ok((StatusCode::CREATED, Json(webhook_json(&w))).into_response())
}

/// `GET /events/webhooks`: the team's, oldest first.
pub async fn list(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<wire::Webhook>>, ApiError> {
    let all = state.webhooks.list(&caller.team)?;
    Ok(Json(all.iter().map(webhook_json).collect()))
}

pub async fn get(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<wire::Webhook>, ApiError> {
    Ok(Json(webhook_json(&state.webhooks.get(&caller.team, &id)?)))
}

/// `PATCH /events/webhooks/{id}`: what the body names changes; 200 with
/// the webhook.
pub async fn update(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<wire::WebhookBody>,
) -> Result<Json<wire::Webhook>, ApiError> {
    Ok(Json(webhook_json(&state.webhooks.update(
        &caller.team,
        &id,
        body,
    )?)))
}

/// `DELETE /events/webhooks/{id}`: 200, its deliveries gone with it.
pub async fn delete(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.webhooks.delete(&caller.team, &id)?;
    Ok(StatusCode::OK)
}

/// `GET /events/webhooks/{id}/deliveries`: the last week's, newest first.
pub async fn deliveries(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Vec<wire::WebhookDelivery>>, ApiError> {
    let all = state.webhooks.deliveries(&caller.team, &id)?;
    Ok(Json(all.iter().map(delivery_json).collect()))
}

/// `limit` (1-100, 10), `offset`, `orderAsc` (false: newest first).
#[derive(Debug)]
struct EventsQuery {
    limit: usize,
    offset: usize,
    order_asc: bool,
}

fn events_query(uri: &Uri) -> Result<EventsQuery, ApiError> {
    let mut q = EventsQuery {
        limit: DEFAULT_EVENTS,
        offset: 0,
        order_asc: false,
    };
    let number = |k: &str, v: &str| {
        v.parse::<usize>()
            .map_err(|_| ApiError::bad_request(format!("{k} must be a whole number ≥ 0")))
    };
    for (k, v) in form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()) {
        match &*k {
            "limit" => q.limit = number("limit", &v)?,
            "offset" => q.offset = number("offset", &v)?,
            "orderAsc" => {
                q.order_asc = v
                    .parse()
                    .map_err(|_| ApiError::bad_request("orderAsc must be true or false"))?
            }
            _ => {}
        }
    }
    if !(1..=MAX_EVENTS).contains(&q.limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be 1 to {MAX_EVENTS}"
        )));
    }
    Ok(q)
}

/// `GET /events/sandboxes`: the team's last lifecycle events on this node.
pub async fn sandbox_events(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    uri: Uri,
) -> Result<Json<Vec<wire::SandboxEvent>>, ApiError> {
    let q = events_query(&uri)?;
    Ok(page(state.webhooks.recent(&caller.team, None), &q))
}

/// `GET /events/sandboxes/{id}`: those of one sandbox (of the team's: any
/// other has none).
pub async fn one_sandbox_events(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    SandboxId(id): SandboxId,
    uri: Uri,
) -> Result<Json<Vec<wire::SandboxEvent>>, ApiError> {
    let q = events_query(&uri)?;
    Ok(page(state.webhooks.recent(&caller.team, Some(&id)), &q))
}

fn page(mut events: Vec<Lifecycle>, q: &EventsQuery) -> Json<Vec<wire::SandboxEvent>> {
    if !q.order_asc {
        events.reverse();
    }
    Json(
        events
            .iter()
            .skip(q.offset)
            .take(q.limit)
            .map(webhooks::payload)
            .collect(),
    )
}
