//! A node in a cluster: keeps its etcd registration's load current and the
//! sandbox-to-node map in step with the sandboxes it holds. Creates are
//! claimed before their answer leaves the node (so the next request, through
//! any gateway, finds the sandbox), kills released at once; a reconcile loop
//! catches the rest (fork children, timeouts, sandboxes recovered at start).
//!
//! With an object store ([`durable`]), a pause through the API is stored
//! there before it answers and its route says so; a resume (or connect)
//! that the gateway marks with [`TAKE_IN_HEADER`] first takes the paused
//! sandbox in from the store, moving its route to this node in a
//! transaction that holds only if its old node is gone.

pub mod durable;

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
use crate::auth::ApiKeys;
use crate::sandbox::Manager;

/// Set by a gateway on a resume or connect it sends to a node other than
/// the sandbox's, whose node is gone: take the sandbox in first.
pub const TAKE_IN_HEADER: &str = "x-sandfork-take-in";
/// On a pause's answer: whether the pause is in the object store.
pub const DURABLE_HEADER: &str = "x-sandfork-durable";

/// A create's answer is a small JSON object; anything larger is not one.
const MAX_CREATE_ANSWER: usize = 1 << 20;

pub struct Node {
    pub registration: Registration,
    pub manager: Arc<Manager>,
    /// The API key (taking a sandbox in is checked before the API's own
    /// check runs).
    pub keys: ApiKeys,
    /// The object store pauses go to, if the cluster has one.
    pub durable: Option<durable::Durable>,
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
    Pause(String),
    /// A resume or connect.
    Resume(String),
    None,
}

fn change(method: &Method, path: &str) -> Change {
    match (method, path) {
        (&Method::POST, "/sandboxes" | "/v2/sandboxes") => Change::Create,
        (&Method::DELETE, p) => match p.strip_prefix("/sandboxes/") {
            Some(id) if !id.is_empty() && !id.contains('/') => Change::Kill(id.to_owned()),
            _ => Change::None,
        },
        (&Method::POST, p) => {
            let Some(rest) = p
                .strip_prefix("/sandboxes/")
                .or_else(|| p.strip_prefix("/v2/sandboxes/"))
            else {
                return Change::None;
            };
            match rest.split_once('/') {
                Some((id, "pause")) if !id.is_empty() => Change::Pause(id.to_owned()),
                Some((id, "resume" | "connect")) if !id.is_empty() => Change::Resume(id.to_owned()),
                _ => Change::None,
            }
        }
        _ => Change::None,
    }
}

async fn track(State(node): State<Arc<Node>>, req: Request, next: Next) -> Response {
    let change = change(req.method(), req.uri().path());
    if let Change::Resume(id) = &change
        && req.headers().contains_key(TAKE_IN_HEADER)
    {
        let key = req
            .headers()
            .get(crate::auth::HEADER)
            .and_then(|v| v.to_str().ok());
        if !key.is_some_and(|k| node.keys.accepts(k)) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid X-API-KEY header",
            )
            .into_response();
        }
        if let Err(e) = take_in(&node, id).await {
            return e.into_response();
        }
    }
    let response = next.run(req).await;
    if !response.status().is_success() {
        return response;
    }
    match change {
        Change::Pause(id) => store_pause(&node, &id, response).await,
        Change::Resume(id) => {
            // Running again: what the store holds is out of date.
            match node.registration.set_paused(&id, None).await {
                Ok(_) => {}
                Err(e) => tracing::warn!("cluster: sandbox {id}: clearing its durable pause: {e}"),
            }
            node.registration.set_load(node.load());
            response
        }
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

/// Stores a pause in the object store and records it in the sandbox's
/// route; without a store, or if storing fails (with a warning), the pause
/// stays on this node only. The answer says which in [`DURABLE_HEADER`].
async fn store_pause(node: &Node, id: &str, mut response: Response) -> Response {
    let durable = match &node.durable {
        Some(d) => match d.store_pause(&node.manager, id).await {
            Ok(pause) => match node.registration.set_paused(id, Some(pause)).await {
                Ok(true) => true,
                Ok(false) => {
                    tracing::warn!(
                        "cluster: sandbox {id}: stored, but its route is not this node's"
                    );
                    false
                }
                Err(e) => {
                    tracing::warn!("cluster: sandbox {id}: recording its stored pause: {e}");
                    false
                }
            },
            Err(e) => {
                tracing::warn!(
                    "cluster: sandbox {id}: its pause is not in the object store ({e}); it stays on this node only"
                );
                false
            }
        },
        None => false,
    };
    node.registration.set_load(node.load());
    response.headers_mut().insert(
        DURABLE_HEADER,
        axum::http::HeaderValue::from_static(if durable { "true" } else { "false" }),
    );
    response
}

/// Takes paused sandbox `id` in from the object store and moves its route
/// here. Already here: nothing to do.
async fn take_in(node: &Node, id: &str) -> Result<(), ApiError> {
    let conflict = |m: String| ApiError::new(StatusCode::CONFLICT, m);
    let unavailable = |m: String| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m);
    let seen = node
        .registration
        .cluster()
        .sandbox(id)
        .await
        .map_err(|e| unavailable(format!("cluster state: {e}")))?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found")))?;
    let me = node.registration.node_id();
    if seen.value.node_id == me && seen.value.incarnation == node.registration.incarnation() {
        return Ok(());
    }
    let Some(pause) = seen.value.paused.clone() else {
        return Err(conflict(format!(
            "sandbox {id} is on node {} and not paused in the object store",
            seen.value.node_id
        )));
    };
    let Some(durable) = &node.durable else {
        return Err(unavailable(format!(
            "sandbox {id} is paused in the object store and this node has none (--s3)"
        )));
    };
    // A copy from before (this node's earlier life) is out of date.
    if node.manager.get(id).is_ok() {
        tracing::info!("cluster: sandbox {id}: dropping this node's old copy before taking it in");
        if let Err(e) = node.manager.kill(id).await {
            return Err(unavailable(format!(
                "sandbox {id}: dropping the old copy: {e}"
            )));
        }
    }
    durable
        .take_in(&node.manager, id, &pause)
        .await
        .map_err(|e| {
            unavailable(format!(
                "sandbox {id}: taking it in from the object store: {e}"
            ))
        })?;
    let moved = node.registration.take_over(id, &seen).await;
    match moved {
        Ok(true) => {
            tracing::info!(
                "cluster: sandbox {id}: moved here from node {}",
                seen.value.node_id
            );
            Ok(())
        }
        refused => {
            if let Err(e) = node.manager.kill(id).await {
                tracing::warn!("cluster: sandbox {id}: removing the copy not moved here: {e}");
            }
            Err(match refused {
                Err(e) => unavailable(format!("cluster state: {e}")),
                _ => conflict(format!(
                    "sandbox {id} moved meanwhile, or its node {} is back",
                    seen.value.node_id
                )),
            })
        }
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
        assert!(
            matches!(change(&Method::POST, "/sandboxes/abc/pause"), Change::Pause(id) if id == "abc")
        );
        assert!(
            matches!(change(&Method::POST, "/sandboxes/abc/resume"), Change::Resume(id) if id == "abc")
        );
        assert!(
            matches!(change(&Method::POST, "/v2/sandboxes/abc/connect"), Change::Resume(id) if id == "abc")
        );
        for (m, p) in [
            (Method::DELETE, "/sandboxes/"),
            (Method::DELETE, "/sandboxes/a/b"),
            (Method::GET, "/sandboxes"),
            (Method::POST, "/sandboxes/abc/fork"),
            (Method::DELETE, "/templates/x"),
        ] {
            assert!(matches!(change(&m, p), Change::None), "{m} {p}");
        }
    }
}
