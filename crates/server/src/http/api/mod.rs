//! The HTTP surface: E2B's control plane (authenticated by `X-API-KEY`, each
//! key a team's: see [`tenancy`]) and,
//! in front of it, the envd proxy (see [`crate::http::proxy`]).

mod detach;
mod error;
mod extract;
mod lineage;
mod list;
mod metrics;
mod network;
mod node;
mod observe;
mod sandboxes;
mod snapshots;
mod template_tags;
mod templates;
mod templates_e2b;
mod tenancy;
mod volumes;
mod webhooks;

use axum::Router;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{any, delete, get, patch, post, put};

pub use detach::ClientGone;
pub use error::{ApiError, Retry};
pub use list::{ListQuery, decode_metadata_filter};
pub use metrics::scrape_credential;
pub use sandboxes::MAX_FORK_COUNT;
pub(crate) use sandboxes::fork_answer;

pub use crate::http::state::{AppState, Shared};

/// Every route of the node on one listener.
pub fn router(state: Shared) -> Router {
    let control = Router::new()
        .route(
            "/sandboxes",
            post(sandboxes::create::<false>).get(sandboxes::list::<false>),
        )
        .route(
            "/v2/sandboxes",
            post(sandboxes::create::<true>).get(sandboxes::list::<true>),
        )
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get_one).delete(sandboxes::kill),
        )
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(sandboxes::refresh))
        .route("/sandboxes/metrics", get(observe::metrics_batch))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/sandboxes/{id}/rollback", post(sandboxes::rollback))
        // Node to node in a cluster: a fork across nodes (404 elsewhere).
        .route(
            "/internal/forks",
            post(crate::http::cluster_routes::make_children),
        )
        .route(
            crate::http::cluster_routes::CHUNK_ROUTE,
            get(crate::http::cluster_routes::serve_chunk),
        )
        .route("/sandboxes/{id}/network", put(network::update))
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/snapshots", get(snapshots::list))
        .route("/snapshots/{id}/fork", post(snapshots::fork))
        .route("/sandboxes/{id}/metrics", get(observe::metrics))
        .route("/sandboxes/{id}/logs", get(observe::logs_v1))
        .route("/v2/sandboxes/{id}/logs", get(observe::logs_v2))
        .route("/v1/node", get(node::node))
        .route("/v1/sandboxes/{id}/lineage", get(lineage::lineage))
        .route("/v1/sandboxes/{id}/diagnostics", get(observe::diagnostics))
        .route("/templates", post(templates::create).get(templates::list))
        .route("/default-templates", get(templates::defaults))
        .route(
            "/templates/{id}",
            get(templates::get_one).delete(templates::delete),
        )
        .route(
            "/templates/{id}/builds/{build_id}/status",
            get(templates::build_status),
        )
        .route("/v3/templates", post(templates_e2b::request_build))
        .route(
            "/templates/{id}/files/{hash}",
            get(templates_e2b::file_link),
        )
        .route(
            "/v2/templates/{id}/builds/{build_id}",
            post(templates_e2b::start_build),
        )
        .route(
            "/admin/teams",
            get(tenancy::list_teams).post(tenancy::create_team),
        )
        .route(
            "/admin/teams/{team}",
            get(tenancy::get_team).patch(tenancy::update_team),
        )
        .route(
            "/admin/teams/{team}/keys",
            get(tenancy::list_keys).post(tenancy::create_key),
        )
        .route("/admin/keys/{key_id}", delete(tenancy::revoke_key))
        .route("/v2/templates", get(templates_e2b::list_v2))
        .route("/templates/aliases/{alias}", get(templates_e2b::alias))
        .route(
            "/templates/tags",
            post(template_tags::assign_tags).delete(template_tags::remove_tags),
        )
        .route("/templates/{id}/tags", get(template_tags::tags))
        .route("/templates/{id}/tags/count", get(template_tags::count))
        .route("/templates/{id}/tags/exists", get(template_tags::exists))
        .route("/templates/{id}/tags/groups", get(template_tags::groups))
        .route(
            "/templates/{id}/tags/{tag}/assignments",
            get(template_tags::assignments),
        )
        .route(
            "/events/webhooks",
            post(webhooks::create).get(webhooks::list),
        )
        .route(
            "/events/webhooks/{webhook_id}",
            get(webhooks::get)
                .patch(webhooks::update)
                .delete(webhooks::delete),
        )
        .route(
            "/events/webhooks/{webhook_id}/deliveries",
            get(webhooks::deliveries),
        )
        .route("/events/sandboxes", get(webhooks::sandbox_events))
        .route(
            "/events/sandboxes/{sandbox_id}",
            get(webhooks::one_sandbox_events),
        )
        .route("/v2/templates/{id}", patch(templates::update_v2))
        .route("/volumes", post(volumes::create).get(volumes::list))
        .route(
            "/volumes/{volume_id}",
            get(volumes::get).delete(volumes::delete),
        )
        .route("/secrets", any(secrets_unavailable))
        .route("/secrets/{*rest}", any(secrets_unavailable))
        // Inside the key's check: a refused key is no operation.
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            metrics::time_operations,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            tenancy::require_api_key,
        ));
    Router::new()
        .route("/health", get(health))
        // The node's own key, as a bearer token too (see `metrics`).
        .route("/metrics", get(metrics::scrape))
        // An upload link carries its own credential (no API key).
        .route(
            "/e2b-files/{token}",
            put(templates_e2b::upload).layer(axum::extract::DefaultBodyLimit::max(
                crate::node::template::e2b_build::MAX_UPLOAD,
            )),
        )
        .route(
            &format!("{}/{{*rest}}", crate::http::proxy::UNROUTED_PREFIX),
            get(crate::http::proxy::unrouted_owner),
        )
        // Static files only: every call the page makes takes the key.
        .merge(crate::http::console::routes())
        .merge(control)
        .fallback(unknown_route)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::http::proxy::dispatch,
        ))
        .with_state(state)
}

/// `router` (the node's routes) with every
/// change run to its end when its client goes away (see [`detach`]).
pub fn run_changes_to_end(router: Router) -> Router {
    router.layer(middleware::from_fn(detach::run_to_end))
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// E2B features this node lacks answer as E2B answers a team without
/// them (403, saying so), not with a 404 that reads as "no such secret".
async fn secrets_unavailable() -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "secrets are not available on this node: pass values in envVars",
    )
}

async fn unknown_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such route")
}
