//! `GET /metrics`: the node's Prometheus metrics in OpenMetrics text (see
//! [`crate::node::metrics`]), and the one layer over the control plane
//! that times each lifecycle operation a client asks for.
//!
//! A scrape takes the node's own key, as the admin routes do: the families
//! name every team and template of the node, which no team's key may list.
//! Prometheus sends it as a bearer token (`authorization: {credentials_file:
//! ...}` in its scrape config); `X-API-KEY` works too. A scrape is not
//! counted against the key's rate.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{ApiError, Shared};
use crate::node::keys::ApiKeys;
use crate::node::metrics::{CONTENT_TYPE, ForkChildren, Operation};
use crate::wire;

/// `GET /metrics`.
pub async fn scrape(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(refused) = require_admin(&state.keys, &headers) {
        return refused.into_response();
    }
    let text = state.manager.metrics().scrape(&state.manager);
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response()
}

/// The key a scrape sends: `Authorization: Bearer`, else `X-API-KEY`.
pub fn scrape_credential(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    bearer
        .or_else(|| {
            headers
                .get(wire::API_KEY_HEADER)
                .and_then(|v| v.to_str().ok())
        })
        .map(str::trim)
}

/// The node's own key (see [`scrape_credential`]).
fn require_admin(keys: &ApiKeys, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = scrape_credential(headers) else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing credentials: send the node's API key as a bearer token or in X-API-KEY",
        ));
    };
    match keys.authenticate(key) {
        Some(caller) if caller.admin => Ok(()),
        Some(_) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "the metrics take the node's own API key only",
        )),
        None => Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key")),
    }
}

/// The lifecycle operation a route is, if it is one.
fn operation(method: &Method, route: &str) -> Option<Operation> {
    Some(match (method, route) {
        (&Method::POST, "/sandboxes" | "/v2/sandboxes") => Operation::Create,
        (&Method::POST, "/sandboxes/{id}/fork" | "/snapshots/{id}/fork") => Operation::Fork,
        (&Method::POST, "/sandboxes/{id}/pause") => Operation::Pause,
        (&Method::POST, "/sandboxes/{id}/resume") => Operation::Resume,
        (&Method::POST, "/sandboxes/{id}/connect" | "/v2/sandboxes/{id}/connect") => {
            Operation::Connect
        }
        (&Method::POST, "/sandboxes/{id}/snapshots") => Operation::Snapshot,
        (&Method::POST, "/sandboxes/{id}/rollback") => Operation::Rollback,
        (&Method::DELETE, "/sandboxes/{id}") => Operation::Kill,
        _ => return None,
    })
}

/// Times the request if its route is a lifecycle operation (a route layer:
/// it runs after the key was checked, so refused keys are not counted).
pub async fn time_operations(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let op = req
        .extensions()
        .get::<MatchedPath>()
        .and_then(|p| operation(req.method(), p.as_str()));
    let Some(op) = op else {
        return next.run(req).await;
    };
    let started = Instant::now();
    let answer = next.run(req).await;
    let children = answer.extensions().get::<ForkChildren>().map(|c| c.0);
    state.manager.metrics().operation(
        op,
        started.elapsed().as_secs_f64(),
        answer.status().as_u16(),
        children,
    );
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_name_their_operations() {
        assert_eq!(
            operation(&Method::POST, "/v2/sandboxes"),
            Some(Operation::Create)
        );
        assert_eq!(
            operation(&Method::POST, "/snapshots/{id}/fork"),
            Some(Operation::Fork)
        );
        assert_eq!(
            operation(&Method::DELETE, "/sandboxes/{id}"),
            Some(Operation::Kill)
        );
        assert_eq!(operation(&Method::GET, "/sandboxes/{id}"), None);
    }
}
