//! A node in a cluster: keeps its etcd registration's load current and the
//! sandbox-to-node map in step with the sandboxes it holds. Creates are
//! claimed before their answer leaves the node (so the next request, through
//! any gateway, finds the sandbox), kills released at once; a reconcile loop
//! catches the rest (fork children, timeouts, sandboxes recovered at start).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use cluster::{NodeCapacity, NodeLoad, Registration};

use crate::api::ApiError;
use crate::sandbox::Manager;

/// A create's answer is a small JSON object; anything larger is not one.
const MAX_CREATE_ANSWER: usize = 1 << 20;

pub struct Node {
    pub registration: Registration,
    pub manager: Arc<Manager>,
}

/// What the node offers the cluster, from its capacity limits.
pub fn capacity(manager: &Manager) -> NodeCapacity {
    let limits = manager.capacity().limits();
    NodeCapacity {
        max_sandboxes: limits.sandboxes as u64,
        vcpus: limits.vcpus,
        memory_mib: limits.memory_mib,
    }
}

impl Node {
    fn load(&self) -> NodeLoad {
        let held = self.manager.capacity().held();
        NodeLoad {
            sandboxes: held.sandboxes as u64,
            vcpus: held.vcpus,
            memory_mib: held.memory_mib,
        }
    }

    /// One pass: the load and the map brought up to date.
    pub async fn reconcile(&self) {
        self.registration.set_load(self.load());
        let ids: Vec<String> = match self.manager.list() {
            Ok(list) => list.into_iter().map(|r| r.id).collect(),
            Err(e) => return tracing::warn!("cluster: listing sandboxes: {e}"),
        };
        match self.registration.reconcile(&ids).await {
            Ok((0, 0)) => {}
            Ok((claimed, released)) => tracing::info!(
                "cluster: reconciled the sandbox map: {claimed} claimed, {released} released"
            ),
            Err(e) => tracing::warn!("cluster: reconciling the sandbox map: {e}"),
        }
    }

    pub fn start_reconciler(self: &Arc<Self>, every: Duration) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                node.reconcile().await;
            }
        });
    }
}

/// The node's routes with the map kept on create and kill.
pub fn layer(router: Router, node: Arc<Node>) -> Router {
    router.layer(middleware::from_fn_with_state(node, track))
}

enum Change {
    Create,
    Kill(String),
    None,
}

fn change(method: &Method, path: &str) -> Change {
    match (method, path) {
        (&Method::POST, "/sandboxes" | "/v2/sandboxes") => Change::Create,
        (&Method::DELETE, p) => match p.strip_prefix("/sandboxes/") {
            Some(id) if !id.is_empty() && !id.contains('/') => Change::Kill(id.to_owned()),
            _ => Change::None,
        },
        _ => Change::None,
    }
}

async fn track(State(node): State<Arc<Node>>, req: Request, next: Next) -> Response {
    let change = change(req.method(), req.uri().path());
    let response = next.run(req).await;
    if !response.status().is_success() {
        return response;
    }
    match change {
        Change::Create => claim_created(&node, response).await,
        Change::Kill(id) => {
            if let Err(e) = node.registration.release(&id).await {
                // The reconciler retries; the sandbox is gone either way.
                tracing::warn!("cluster: releasing {id}: {e}");
            }
            node.registration.set_load(node.load());
            response
        }
        Change::None => response,
    }
}

/// Claims the sandbox a create answered with before the answer leaves:
/// refused (the node lost its lease, or the ID is mapped elsewhere), the
/// sandbox is killed and the create answers 503 so a gateway tries the next
/// node.
async fn claim_created(node: &Node, response: Response) -> Response {
    let (parts, body) = response.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_CREATE_ANSWER).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
        }
    };
    let id = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("sandboxID")?.as_str().map(str::to_owned));
    let Some(id) = id else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    let refused = match node.registration.claim(&id).await {
        Ok(true) => None,
        Ok(false) => Some("the node's registration no longer holds (or the ID is taken)".into()),
        Err(e) => Some(e.to_string()),
    };
    node.registration.set_load(node.load());
    match refused {
        None => Response::from_parts(parts, Body::from(bytes)),
        Some(why) => {
            tracing::warn!("cluster: claiming {id}: {why}; killing it");
            if let Err(e) = node.manager.kill(&id).await {
                tracing::warn!("cluster: killing unclaimed {id}: {e}");
            }
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the cluster did not record the sandbox: {why}"),
            )
            .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_and_kills_are_told_from_the_rest() {
        assert!(matches!(
            change(&Method::POST, "/sandboxes"),
            Change::Create
        ));
        assert!(matches!(
            change(&Method::POST, "/v2/sandboxes"),
            Change::Create
        ));
        assert!(
            matches!(change(&Method::DELETE, "/sandboxes/abc"), Change::Kill(id) if id == "abc")
        );
        for (m, p) in [
            (Method::DELETE, "/sandboxes/"),
            (Method::DELETE, "/sandboxes/a/b"),
            (Method::GET, "/sandboxes"),
            (Method::POST, "/sandboxes/abc/pause"),
            (Method::DELETE, "/templates/x"),
        ] {
            assert!(matches!(change(&m, p), Change::None), "{m} {p}");
        }
    }
}
