//! E2B's envd protocol (spec: /work/shared/reference/e2b-protocol.md §3): the
//! Connect services and the plain HTTP endpoints, as one axum Router.
//!
//! Each service is a sub-router of `Router<Envd>` merged here; every handler
//! gets the shared [`Envd`] as axum state.

pub mod auth;
pub mod clock;
pub mod connect;
pub mod entropy;
pub mod files;
pub mod filesystem;
pub mod metrics;
pub mod process;
pub mod response;
pub mod state;
pub mod user;

use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};

use process::ProcessTable;
use state::SandboxState;

/// State shared by every envd handler. Cheap to clone.
#[derive(Clone)]
pub struct Envd {
    pub sandbox: Arc<SandboxState>,
    pub processes: Arc<ProcessTable>,
    /// Whether the agent is PID 1 (a guest), which allows setting the clock.
    pub pid1: bool,
    /// Watchers polled with `GetWatcherEvents`.
    pub watchers: filesystem::watch::Watchers,
}

impl Envd {
    pub fn new(pid1: bool) -> Self {
        Self {
            sandbox: Arc::new(SandboxState::new()),
            processes: Arc::new(ProcessTable::default()),
            pid1,
            watchers: Default::default(),
        }
    }
}

/// Routes served on vsock and TCP alike. Unknown routes get axum's 404.
pub fn router(envd: Envd) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/init", post(state::init))
        .route("/envs", get(state::envs))
        .route("/metrics", get(metrics::handler))
        .merge(filesystem::rpc::router())
        .merge(files::router())
        .merge(process::router())
        .layer(middleware::from_fn_with_state(
            envd.clone(),
            auth::require_token,
        ))
        .with_state(envd)
}

/// envd answers a bare 204 once it is ready to serve.
async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}
