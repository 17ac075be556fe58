//! The cluster gateway: stateless, serves the E2B control plane and the
//! envd proxy for every node on one port. Each request goes to the node the
//! etcd map names for its sandbox; a create goes to the freest node, and on
//! to the next if that one refuses or lacks its template; a request naming a
//! snapshot or template goes to the first node not to answer 404 (the one
//! that made it, or, with an object store, one that takes it in from
//! there); a delete of one goes to every node (each may hold a copy); a
//! list gathers every node's, and a team's use is summed over them.
//!
//! Sandbox traffic is told from the control plane by the node's own rules
//! ([`crate::http::proxy::route`]); the owning node then routes it again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use sandfork_cluster::{Cluster, NodeRecord, SandboxRoute, Versioned, View, keyspace};

use crate::http::api::ApiError;
use crate::http::proxy::{self, Route};
use crate::wire;

mod metrics;
mod teams;

pub use metrics::GatewayMetrics;

/// Request bodies a create may carry (metadata, env vars).
const MAX_CREATE_BODY: usize = 1 << 20;
/// A node's list answer.
const MAX_LIST_ANSWER: usize = 64 << 20;

#[derive(Debug)]
pub struct Gateway {
    cluster: Cluster,
    /// Nodes and routes as a watch keeps them (etcd is asked when it
    /// lacks an answer).
    view: View,
    placements: Placements,
    /// Kept-alive connections to the nodes: most requests are small, and a
    /// connection per request cost each a handshake.
    nodes: NodeClient,
    metrics: GatewayMetrics,
    /// The hash of the key a scrape of `/metrics` takes (the cluster's
    /// admin key); None: scrapes are refused.
    metrics_key: Option<[u8; 32]>,
    /// The metadata key a create names a registry image under (the nodes'
    /// `serve --image-metadata-key`), for placing it.
    image_metadata_key: Option<String>,
}

/// How a gateway is set up beyond its etcd.
#[derive(Debug, Clone, Default)]
pub struct GatewayOptions {
    /// The key its `/metrics` takes (the cluster's admin key); None: it
    /// serves none.
    pub metrics_key: Option<String>,
    /// The nodes' `serve --image-metadata-key`: creates naming an image
    /// under it are placed where the image's template is.
    pub image_metadata_key: Option<String>,
    /// How the nodes' ports are reached (TLS with the gateway's
    /// certificate in a cluster with it).
    pub dialer: sandfork_tls::Dialer,
}

type NodeClient = hyper_util::client::legacy::Client<sandfork_tls::Dialer, Body>;

/// How long an idle connection to a node is kept (a node's own idle timeout
/// is longer).
const NODE_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The pool's connections are the cluster's dialer's (its connect timeout,
/// TLS when the cluster has it).
fn node_client(dialer: sandfork_tls::Dialer) -> NodeClient {
    dialer.pooled(NODE_IDLE_TIMEOUT)
}

/// How long a create this gateway placed counts against its node beyond
/// the load the node published (which follows its answer within moments).
const PLACED_COUNTS_FOR: Duration = Duration::from_secs(2);

/// The creates this gateway sent to each node and that its published load
/// may not show yet: those in flight, and those answered lately. Counted in
/// placement so that a burst through one gateway spreads over the nodes.
#[derive(Debug, Default)]
struct Placements {
    /// (node, when it answered; None while in flight)
    entries: Mutex<Vec<(String, Option<Instant>, u64)>>,
    next_ticket: std::sync::atomic::AtomicU64,
}

impl Placements {
    /// Adds this gateway's recent and in-flight creates to each node's
    /// sandbox count.
    fn count_into(&self, nodes: &mut [NodeRecord]) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|(_, answered, _)| answered.is_none_or(|t| t.elapsed() < PLACED_COUNTS_FOR));
        for node in nodes {
            let mine = entries
                .iter()
                .filter(|(n, _, _)| *n == node.node_id)
                .count();
            node.load.sandboxes += mine as u64;
        }
    }

    /// A create on its way to `node_id`.
    fn start(&self, node_id: &str) -> u64 {
        let ticket = self
            .next_ticket
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.push((node_id.to_owned(), None, ticket));
        ticket
    }

    /// The create `ticket` answered: kept for a while if it made a sandbox.
    fn finish(&self, ticket: u64, made: bool) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if made {
            if let Some(entry) = entries.iter_mut().find(|(_, _, t)| *t == ticket) {
                entry.1 = Some(Instant::now());
            }
        } else {
            entries.retain(|(_, _, t)| *t != ticket);
        }
    }
}

/// Serves the gateway on `listener` until `shutdown` completes (in a
/// runtime: it starts the etcd watch).
pub async fn serve(
    listener: tokio::net::TcpListener,
    cluster: Cluster,
    options: GatewayOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(cluster, options))
        .with_graceful_shutdown(shutdown)
        .await
}

pub fn router(cluster: Cluster, options: GatewayOptions) -> Router {
    let view = View::start(cluster.clone());
    Router::new()
        .merge(crate::http::console::routes())
        .fallback(handle)
        .with_state(Arc::new(Gateway {
            cluster,
            view,
            placements: Placements::default(),
            nodes: node_client(options.dialer),
            metrics: GatewayMetrics::new(),
            metrics_key: options.metrics_key.as_deref().map(crate::node::keys::hash),
            image_metadata_key: options.image_metadata_key.filter(|k| !k.is_empty()),
        }))
}

/// `answer`, gathered from every node but `unreachable`, naming those.
fn partial(mut answer: Response, unreachable: &[String]) -> Response {
    if let Ok(value) = axum::http::HeaderValue::from_str(&unreachable.join(","))
        && !unreachable.is_empty()
    {
        answer
            .headers_mut()
            .insert(wire::UNREACHABLE_NODES_HEADER, value);
    }
    answer
}

/// What a control-plane request is, for routing.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    Health,
    Create,
    List,
    /// A request about one sandbox: its owner answers.
    Sandbox(String),
    /// A list of node-local things (snapshots, templates): every node's.
    Gather,
    /// A request naming a snapshot or template: the node holding it.
    Holder,
    /// A delete of a snapshot or template: every node, each deletes its
    /// copy.
    DeleteEverywhere,
    /// New template builds, the node's own page: any node.
    AnyNode,
    /// Teams and their use: every node's use summed.
    TeamUse,
    /// Volumes: each node's own (its store, its disks), so no answer from
    /// one node would be the cluster's. Refused until they are placed.
    Volumes,
    /// The gateway's own metrics.
    Metrics,
}

impl Target {
    /// The `target` label of the gateway's request metrics.
    fn name(&self) -> &'static str {
        match self {
            Target::Health => "health",
            Target::Create => "create",
            Target::List => "list",
            Target::Sandbox(_) => "sandbox",
            Target::Gather => "gather",
            Target::Holder => "holder",
            Target::DeleteEverywhere => "delete_everywhere",
            Target::AnyNode => "any_node",
            Target::TeamUse => "team_use",
            Target::Volumes => "volumes",
            Target::Metrics => "metrics",
        }
    }
}

fn target(method: &Method, path: &str) -> Target {
    match (method, path) {
        (_, "/health") => Target::Health,
        (&Method::GET, "/metrics") => Target::Metrics,
        (&Method::POST, "/sandboxes" | "/v2/sandboxes") => Target::Create,
        (&Method::GET, "/sandboxes" | "/v2/sandboxes") => Target::List,
        (&Method::GET, "/snapshots" | "/templates") => Target::Gather,
        (&Method::GET, p) if teams::is_team_use(p) => Target::TeamUse,
        (_, p) if p == "/volumes" || p.starts_with("/volumes/") => Target::Volumes,
        (&Method::DELETE, p)
            if p.strip_prefix("/templates/")
                .is_some_and(|id| !id.is_empty() && !id.contains('/')) =>
        {
            Target::DeleteEverywhere
        }
        _ if ["/snapshots/", "/templates/", "/v2/templates/"]
            .iter()
            .any(|p| path.starts_with(p)) =>
        {
            Target::Holder
        }
        _ => {
            let rest = ["/sandboxes/", "/v2/sandboxes/", "/v1/sandboxes/"]
                .iter()
                .find_map(|p| path.strip_prefix(p));
            match rest.and_then(|r| r.split('/').next()) {
                // `/sandboxes/metrics` is the batch of many sandboxes' metrics.
                Some(id) if id != "metrics" && crate::node::ids::is_sandbox_id(id) => {
                    Target::Sandbox(id.to_owned())
                }
                _ => Target::AnyNode,
            }
        }
    }
}

async fn handle(State(gw): State<Arc<Gateway>>, mut req: Request) -> Response {
    // Only a gateway asks a node to take a sandbox in.
    req.headers_mut().remove(wire::TAKE_IN_HEADER);
    let started = Instant::now();
    let (name, answer) = match proxy::route(req.headers(), req.uri()) {
        Route::Sandbox { id, .. } => ("envd", gw.to_owner(&id, req, true).await),
        Route::ControlPlane if proxy::is_envd_path(req.uri().path()) => {
            ("envd_unrouted", gw.to_unrouted(req).await)
        }
        Route::ControlPlane => {
            let target = target(req.method(), req.uri().path());
            (target.name(), gw.control(target, req).await)
        }
    };
    let answer = answer.unwrap_or_else(IntoResponse::into_response);
    gw.metrics
        .request(name, answer.status().as_u16(), started.elapsed());
    answer
}

impl Gateway {
    async fn control(&self, target: Target, req: Request) -> Result<Response, ApiError> {
        let gw = self;
        match target {
            Target::Health => Ok(StatusCode::NO_CONTENT.into_response()),
            Target::Create => gw.create(req).await,
            Target::List => gw.list(req, None).await,
            Target::Gather => gw.list(req, Some(&["templateID", "snapshotID"])).await,
            Target::Holder => gw.to_holder(req).await,
            Target::DeleteEverywhere => gw.delete_everywhere(req).await,
            Target::Sandbox(id) => gw.to_owner(&id, req, false).await,
            Target::AnyNode => gw.to_any(req).await,
            Target::TeamUse => gw.team_use(req).await,
            Target::Volumes => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "volumes are not available through a cluster's gateway yet: each node \
                 keeps its own",
            )),
            Target::Metrics => gw.scrape(req.headers()),
        }
    }

    /// `GET /metrics` (see [`metrics`]).
    fn scrape(&self, headers: &HeaderMap) -> Result<Response, ApiError> {
        let Some(expected) = &self.metrics_key else {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "this gateway serves no metrics: start it with SANDFORK_API_KEY (the cluster's \
                 admin key), which a scrape then sends",
            ));
        };
        let key = crate::http::api::scrape_credential(headers).ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing credentials: send the cluster's admin key as a bearer token or in \
                 X-API-KEY",
            )
        })?;
        if !crate::node::keys::same_secret(&crate::node::keys::hash(key), expected) {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key"));
        }
        let text = self.metrics.scrape(&self.view);
        Ok((
            [(header::CONTENT_TYPE, crate::node::metrics::CONTENT_TYPE)],
            text,
        )
            .into_response())
    }

    /// The nodes: the watch's copy, else etcd's, else (etcd cannot answer)
    /// the copy as it last was.
    async fn nodes(&self) -> Result<Vec<NodeRecord>, ApiError> {
        if let Some(nodes) = self.view.nodes() {
            return Ok(nodes);
        }
        let known = Some(self.view.last_known_nodes()).filter(|n| !n.is_empty());
        self.or_last_known(known, "the nodes", self.cluster.nodes())
            .await
    }

    /// `id`'s route: the watch's copy, else etcd's (a claim made a moment
    /// ago through another gateway may not have reached the watch), else
    /// (etcd cannot answer, e.g. without a quorum) the copy's last: a
    /// running sandbox stays reachable, its node answers for it.
    async fn route(&self, id: &str) -> Result<Option<Versioned<SandboxRoute>>, ApiError> {
        if let Some(route) = self.view.sandbox(id) {
            self.metrics.route_from("watch");
            return Ok(Some(route));
        }
        let known = self.view.last_known_sandbox(id).map(Some);
        let what = format!("the route of {id}");
        let asked = self.cluster.sandbox(id);
        let mut from_etcd = false;
        let route = self
            .or_last_known(known, &what, async {
                let answer = asked.await;
                from_etcd = answer.is_ok();
                answer
            })
            .await;
        self.metrics.route_from(match &route {
            Ok(Some(_)) if from_etcd => "etcd",
            Ok(Some(_)) => "last_known",
            Ok(None) => "missing",
            Err(_) => "error",
        });
        route
    }

    /// What etcd answers (`ask`), unless it cannot: then `known` (`what`,
    /// as the watch's copy last had it), at once when that copy's own
    /// load already failed; without it, a 503.
    async fn or_last_known<T>(
        &self,
        known: Option<T>,
        what: &str,
        ask: impl std::future::Future<Output = Result<T, sandfork_cluster::ClusterError>>,
    ) -> Result<T, ApiError> {
        let known = match known {
            Some(known) if self.view.etcd_failed() => return Ok(known),
            other => other,
        };
        let asked = Instant::now();
        let answer = ask.await;
        self.metrics.etcd(answer.is_ok(), asked.elapsed());
        match (answer, known) {
            (Ok(answer), _) => Ok(answer),
            (Err(e), Some(known)) => {
                tracing::warn!("gateway: etcd: {e}; routing by {what} as last known");
                Ok(known)
            }
            (Err(e), None) => Err(ApiError::cluster_state(e)),
        }
    }

    async fn to_owner(&self, id: &str, req: Request, envd: bool) -> Result<Response, ApiError> {
        let route = self.route(id).await?;
        let Some(route) = route else {
            return Ok(if envd {
                // E2B's proxy answer (the SDKs read it as "not running").
                proxy::not_found(id)
            } else {
                ApiError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
                    .into_response()
            });
        };
        let owner = route.value.node_id.clone();
        let nodes = self.nodes().await?;
        let node = nodes.iter().find(|n| n.node_id == owner).cloned();
        let Some(node) = node else {
            if route.value.paused.is_some() && resumes(req.method(), req.uri().path()) {
                return self.resume_elsewhere(id, &route.value, nodes, req).await;
            }
            if !envd && req.method() == Method::DELETE && req.uri().path().ends_with(id) {
                // A kill of what its gone node held: its record goes, and
                // the node, if it comes back with it, removes its copy.
                return match self.cluster.kill_lost(id, &route).await {
                    Ok(true) => Ok(StatusCode::NO_CONTENT.into_response()),
                    Ok(false) => Err(ApiError::new(
                        StatusCode::CONFLICT,
                        format!("sandbox {id} changed meanwhile; try again"),
                    )),
                    Err(e) => Err(ApiError::cluster_state(e)),
                };
            }
            return Err(gone(id, &owner, route.value.paused.is_some(), envd));
        };
        self.forward(&node.api_addr, req)
            .await
            .map_err(|e| bad_gateway(&node, e))
    }

    /// Resumes a sandbox paused in the object store whose node is gone on
    /// the freest node that takes it in, of its CPU template first.
    async fn resume_elsewhere(
        &self,
        id: &str,
        route: &SandboxRoute,
        nodes: Vec<NodeRecord>,
        req: Request,
    ) -> Result<Response, ApiError> {
        let (parts, body) = req.into_parts();
        let body = axum::body::to_bytes(body, MAX_CREATE_BODY)
            .await
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut last = None;
        let cpu_template = route.paused.as_ref().and_then(|p| p.cpu_template.clone());
        for node in same_cpu_first(keyspace::placement_order(nodes), cpu_template.as_deref()) {
            let mut req = rebuild(&parts.method, &parts.uri, &parts.headers, body.clone());
            req.headers_mut()
                .insert(wire::TAKE_IN_HEADER, HeaderValue::from_static("1"));
            match self.forward(&node.api_addr, req).await {
                Ok(r) if cluster_wide(&r) => return Ok(r),
                Ok(r) if refused(r.status()) => {
                    self.metrics.took_in("refused");
                    tracing::info!(
                        "gateway: node {} did not take sandbox {id} in: {}",
                        node.node_id,
                        r.status()
                    );
                    last = Some(r);
                }
                Ok(r) => {
                    self.metrics.took_in("resumed");
                    tracing::info!("gateway: sandbox {id} resumed on node {}", node.node_id);
                    return Ok(r);
                }
                Err(e) => {
                    self.metrics.took_in("unreachable");
                    tracing::warn!("gateway: node {} unreachable: {e}", node.node_id)
                }
            }
        }
        last.ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no node in the cluster can resume sandbox {id}"),
            )
        })
    }

    /// Tries the nodes freest first, those that have the template counted
    /// freer (see `placement_order_for`); a node that refuses for capacity (429,
    /// 503), lacks the template (404) or cannot be reached passes the create
    /// on to the next. A team at its limit, or etcd failing, is answered at
    /// once: the same on every node.
    async fn create(&self, req: Request) -> Result<Response, ApiError> {
        let (parts, body) = req.into_parts();
        let body = axum::body::to_bytes(body, MAX_CREATE_BODY)
            .await
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut nodes = self.nodes().await?;
        self.placements.count_into(&mut nodes);
        // Read once for placement; a body that does not parse is the node's
        // to refuse.
        let named = serde_json::from_slice::<serde_json::Value>(&body).ok();
        let image = named
            .as_ref()
            .and_then(|b| create_image(b, self.image_metadata_key.as_deref()));
        let nodes = match &image {
            // Where its template is, else where it is being converted.
            Some(image) => {
                let converting = self.view.image_claim(image).map(|c| c.node_id);
                keyspace::placement_order_for_image(nodes, image, converting.as_deref())
            }
            None => {
                let template = named.as_ref().and_then(create_template);
                keyspace::placement_order_for(nodes, template.as_deref())
            }
        };
        let mut last = None;
        for node in &nodes {
            let req = rebuild(&parts.method, &parts.uri, &parts.headers, body.clone());
            let ticket = self.placements.start(&node.node_id);
            let answer = self.forward(&node.api_addr, req).await;
            let made = answer.as_ref().is_ok_and(|r| r.status().is_success());
            self.placements.finish(ticket, made);
            self.metrics.placed(match &answer {
                Ok(_) if made => "made",
                Ok(r) if refused(r.status()) || r.status() == StatusCode::NOT_FOUND => "refused",
                Ok(_) => "other",
                Err(_) => "unreachable",
            });
            match answer {
                Ok(r) if cluster_wide(&r) => return Ok(r),
                // The cluster's one conversion of the image is under way.
                Ok(r) if image.is_some() && r.headers().contains_key(wire::BUILDING_HEADER) => {
                    return Ok(r);
                }
                Ok(r) if refused(r.status()) || r.status() == StatusCode::NOT_FOUND => {
                    tracing::info!(
                        "gateway: node {} refused a create: {}",
                        node.node_id,
                        r.status()
                    );
                    last = Some(r);
                }
                Ok(r) => return Ok(r),
                Err(e) => {
                    tracing::warn!("gateway: node {} unreachable: {e}", node.node_id);
                }
            }
        }
        last.ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no node in the cluster can take a sandbox",
            )
        })
    }

    /// Every node's list, concatenated (a node that cannot answer is left
    /// out with a warning, not the whole list failed). Node pagination is
    /// not carried over: each node's first page. Items whose first present
    /// field of `unique_by` repeats an earlier one's are listed once (every
    /// node has the base template).
    async fn list(
        &self,
        req: Request,
        unique_by: Option<&'static [&'static str]>,
    ) -> Result<Response, ApiError> {
        let (answers, unreachable) = match self.every_node(req, "listing").await? {
            Ok(answers) => answers,
            Err(refusal) => return Ok(refusal),
        };
        let mut all = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (node, bytes) in answers {
            match serde_json::from_slice::<Vec<serde_json::Value>>(&bytes) {
                Ok(items) => {
                    for item in items {
                        let first = unique_by.and_then(|fields| unique_key(&item, fields));
                        if first.is_none_or(|key| seen.insert(key)) {
                            all.push(item);
                        }
                    }
                }
                Err(e) => tracing::warn!("gateway: node {}'s list: {e}", node.node_id),
            }
        }
        Ok(partial(axum::Json(all).into_response(), &unreachable))
    }

    /// `req` (without a body) sent to every node: each reachable node's
    /// answer and the ids of those that could not be reached (passed over
    /// with a warning about `what` was asked), or the first refusal (the
    /// key is the same on every node: its refusal is the answer).
    async fn every_node(
        &self,
        req: Request,
        what: &str,
    ) -> Result<Result<(Vec<(NodeRecord, Bytes)>, Vec<String>), Response>, ApiError> {
        let (parts, _) = req.into_parts();
        let mut answers = Vec::new();
        let mut unreachable = Vec::new();
        for node in self.nodes().await? {
            let req = rebuild(&parts.method, &parts.uri, &parts.headers, Bytes::new());
            let answer = match self.forward(&node.api_addr, req).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("gateway: {what} on node {}: {e}", node.node_id);
                    unreachable.push(node.node_id);
                    continue;
                }
            };
            if !answer.status().is_success() {
                return Ok(Err(answer));
            }
            let bytes = axum::body::to_bytes(answer.into_body(), MAX_LIST_ANSWER)
                .await
                .map_err(|e| bad_gateway(&node, e.to_string()))?;
            answers.push((node, bytes));
        }
        Ok(Ok((answers, unreachable)))
    }

    /// A team (or all) with its use summed over every node; the first
    /// node's answer gives the rest (the same on every node). A refusal
    /// (the key) is the answer; a node that cannot be reached is passed
    /// over, with a warning.
    async fn team_use(&self, req: Request) -> Result<Response, ApiError> {
        let (answers, unreachable) = match self.every_node(req, "teams' use").await? {
            Ok(answers) => answers,
            Err(refusal) => return Ok(refusal),
        };
        let mut total: Option<teams::TeamUse> = None;
        for (node, bytes) in answers {
            let used: teams::TeamUse =
                serde_json::from_slice(&bytes).map_err(|e| bad_gateway(&node, e.to_string()))?;
            match &mut total {
                Some(total) => teams::add_use(total, &used),
                None => total = Some(used),
            }
        }
        total
            .map(|t| partial(axum::Json(t).into_response(), &unreachable))
            .ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no node in the cluster"))
    }

    /// Asks the nodes in turn, those that have the snapshot or template it
    /// names first, then freest first, until one does not answer 404 or
    /// 503: a snapshot or template is on the node that made it and on
    /// those that took it in, and, with an object store, any node takes it
    /// in. A node that cannot be reached is passed over.
    async fn to_holder(&self, req: Request) -> Result<Response, ApiError> {
        let (parts, body) = req.into_parts();
        let body = axum::body::to_bytes(body, MAX_CREATE_BODY)
            .await
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let mut last = None;
        let nodes = self.nodes().await?;
        let nodes = match named_template(parts.uri.path()) {
            Some(named) => keyspace::holders_first(nodes, named),
            None => keyspace::placement_order(nodes),
        };
        for node in nodes {
            let req = rebuild(&parts.method, &parts.uri, &parts.headers, body.clone());
            match self.forward(&node.api_addr, req).await {
                // A node without it, or that could not take it in from
                // the object store (or has no room): the next may.
                Ok(r)
                    if r.status() == StatusCode::NOT_FOUND
                        || r.status() == StatusCode::SERVICE_UNAVAILABLE =>
                {
                    last = Some(r)
                }
                Ok(r) => return Ok(r),
                Err(e) => tracing::warn!("gateway: node {} unreachable: {e}", node.node_id),
            }
        }
        last.ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no node in the cluster"))
    }

    /// Sends a delete to every node: templates and snapshots made on one
    /// node may have been taken in by others, each holding a copy (the
    /// first to delete its copy removes the object store's too). A node
    /// that refuses (other than 404) is the answer, so the caller learns of
    /// a copy left; else a node that deleted; 404 only when none had it. A
    /// node that cannot be reached is passed over with a warning.
    async fn delete_everywhere(&self, req: Request) -> Result<Response, ApiError> {
        let (parts, body) = req.into_parts();
        let body = axum::body::to_bytes(body, MAX_CREATE_BODY)
            .await
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let (mut deleted, mut refused, mut not_found) = (None, None, None);
        for node in self.nodes().await? {
            let req = rebuild(&parts.method, &parts.uri, &parts.headers, body.clone());
            match self.forward(&node.api_addr, req).await {
                Ok(r) if r.status().is_success() => deleted = deleted.or(Some(r)),
                Ok(r) if r.status() == StatusCode::NOT_FOUND => not_found = not_found.or(Some(r)),
                Ok(r) => {
                    tracing::warn!(
                        "gateway: node {} refused {}: {}",
                        node.node_id,
                        parts.uri.path(),
                        r.status()
                    );
                    refused = refused.or(Some(r));
                }
                Err(e) => tracing::warn!("gateway: node {} unreachable: {e}", node.node_id),
            }
        }
        refused
            .or(deleted)
            .or(not_found)
            .ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no node in the cluster"))
    }

    /// An envd request that names no sandbox (a signed file URL under
    /// `E2B_SANDBOX_URL`, an older SDK's request after `connect`): the node
    /// holding the sandbox its token or signature belongs to answers it;
    /// when none does, any node gives its own answer (envd's "invalid
    /// signature").
    async fn to_unrouted(&self, req: Request) -> Result<Response, ApiError> {
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        let ask = format!("{}{target}", proxy::UNROUTED_PREFIX);
        let mut headers = HeaderMap::new();
        if let Some(token) = req.headers().get(wire::ACCESS_TOKEN_HEADER) {
            headers.insert(wire::ACCESS_TOKEN_HEADER, token.clone());
        }
        if let Ok(method) = HeaderValue::from_str(req.method().as_str()) {
            headers.insert(wire::UNROUTED_METHOD_HEADER, method);
        }
        let uri: Uri = ask
            .parse()
            .map_err(|_| ApiError::bad_request("a request target that cannot be forwarded"))?;
        for node in self.nodes().await? {
            let question = rebuild(&Method::GET, &uri, &headers, Bytes::new());
            let answer = match self.forward(&node.api_addr, question).await {
                Ok(answer) if answer.status() == StatusCode::OK => answer,
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!("gateway: node {} unreachable: {e}", node.node_id);
                    continue;
                }
            };
            let body = axum::body::to_bytes(answer.into_body(), 4096)
                .await
                .map_err(|e| bad_gateway(&node, e.to_string()))?;
            let owner = serde_json::from_slice::<wire::SandboxOwner>(&body)
                .ok()
                .map(|o| o.sandbox_id);
            if let Some(id) = owner.filter(|id| crate::node::ids::is_sandbox_id(id)) {
                return self.to_owner(&id, req, true).await;
            }
        }
        self.to_any(req).await
    }

    async fn to_any(&self, req: Request) -> Result<Response, ApiError> {
        let nodes = keyspace::placement_order(self.nodes().await?);
        let node = nodes.first().ok_or_else(|| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no node in the cluster")
        })?;
        self.forward(&node.api_addr, req)
            .await
            .map_err(|e| bad_gateway(node, e))
    }
}

/// An error with its causes ("client error (Connect): tcp connect error:
/// Connection refused"): the client's own message names only the stage.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// The value of the first of `fields` that `item` has, as a string.
fn unique_key(item: &serde_json::Value, fields: &[&str]) -> Option<String> {
    fields
        .iter()
        .find_map(|f| item.get(f))
        .and_then(|v| v.as_str())
        .map(str::to_owned)
}

/// A resume or connect (what brings a paused sandbox back).
fn resumes(method: &Method, path: &str) -> bool {
    *method == Method::POST && (path.ends_with("/resume") || path.ends_with("/connect"))
}

/// The answer for a sandbox whose node is gone: paused in the object store,
/// a resume brings it back elsewhere; otherwise it was running (or paused
/// only there) and is lost with its node.
fn gone(id: &str, owner: &str, durable: bool, envd: bool) -> ApiError {
    let message = if durable {
        format!(
            "sandbox {id} is paused and its node {owner} is gone: resume it to run it on another node"
        )
    } else {
        format!(
            "sandbox {id} is lost: its node {owner} left the cluster while it ran (or held its only pause)"
        )
    };
    let status = match (durable, envd) {
        // As for a paused sandbox on one node.
        (true, true) => StatusCode::BAD_GATEWAY,
        (true, false) => StatusCode::CONFLICT,
        (false, _) => StatusCode::GONE,
    };
    ApiError::new(status, message)
}

/// `nodes` with those that boot guests under CPU template `template` first
/// (in their order), then the others: a node of another template refuses a
/// pause made under this one (see `crate::cluster::cpu`), and says why.
fn same_cpu_first(nodes: Vec<NodeRecord>, template: Option<&str>) -> Vec<NodeRecord> {
    keyspace::first_those(nodes, |n| n.cpu_template.as_deref() == template)
}

/// The template or snapshot a path names (`/templates/{id}...`,
/// `/v2/templates/{id}...`, `/snapshots/{id}...`), as nodes list theirs.
fn named_template(path: &str) -> Option<&str> {
    let rest = ["/snapshots/", "/templates/", "/v2/templates/"]
        .iter()
        .find_map(|p| path.strip_prefix(p))?;
    let named = rest.split('/').next().filter(|n| !n.is_empty())?;
    Some(crate::node::ids::without_default_tag(named))
}

/// The template a create's body names, as nodes list theirs (the base one
/// when it names none).
fn create_template(body: &serde_json::Value) -> Option<String> {
    let named = match body.get("templateID") {
        Some(serde_json::Value::String(t)) if !t.is_empty() => t.as_str(),
        Some(serde_json::Value::String(_) | serde_json::Value::Null) | None => {
            crate::node::template::BASE
        }
        Some(_) => return None,
    };
    Some(crate::node::ids::without_default_tag(named).to_owned())
}

/// The registry image a create's body names (as its template id, or under
/// `metadata_key` in its metadata), normalised as nodes name its template;
/// None when it names none (or none that parses: the node refuses it).
fn create_image(body: &serde_json::Value, metadata_key: Option<&str>) -> Option<String> {
    let template = body.get("templateID").and_then(|t| t.as_str());
    let metadata: std::collections::BTreeMap<String, String> = body
        .get("metadata")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    let image =
        crate::node::template::image_of_create(template, &metadata, metadata_key).ok()??;
    crate::node::template::image_name(&image).ok()
}

/// An answer every node would give (the caller's team at its limit, etcd
/// failing): passed on, not tried on the next node.
fn cluster_wide(answer: &Response) -> bool {
    let headers = answer.headers();
    headers.contains_key(wire::TEAM_LIMIT_HEADER)
        || headers.contains_key(wire::CLUSTER_STATE_HEADER)
}

fn refused(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE
}

fn bad_gateway(node: &NodeRecord, e: String) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!("node {} at {}: {e}", node.node_id, node.api_addr),
    )
}

fn rebuild(method: &Method, uri: &Uri, headers: &HeaderMap, body: Bytes) -> Request {
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri.clone();
    *req.headers_mut() = headers.clone();
    req
}

impl Gateway {
    /// Sends `req` to the node at `addr` over a kept-alive connection,
    /// bodies streamed both ways. The Host header stays: the node routes
    /// `<port>-<id>.<domain>` names by it.
    async fn forward(&self, addr: &str, mut req: Request) -> Result<Response, String> {
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_else(|| "/".into());
        if !req.headers().contains_key(header::HOST)
            && let Some(host) = req
                .uri()
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            req.headers_mut().insert(header::HOST, host);
        }
        *req.uri_mut() = format!("http://{addr}{path}")
            .parse()
            .map_err(|e| format!("address {addr}: {e}"))?;
        crate::http::proxy::strip_hop_by_hop(req.headers_mut());
        let mut answer = self.nodes.request(req).await.map_err(|e| error_chain(&e))?;
        crate::http::proxy::strip_hop_by_hop(answer.headers_mut());
        Ok(answer.map(Body::new))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            incarnation: 1,
            api_addr: "127.0.0.1:1".into(),
            capacity: sandfork_cluster::NodeCapacity {
                max_sandboxes: 10,
                vcpus: 10,
                memory_mib: 10_000,
            },
            load: sandfork_cluster::NodeLoad::default(),
            cpu_template: None,
        }
    }

    #[test]
    fn a_stored_pause_goes_to_nodes_of_its_cpu_template_first() {
        let mut v3 = node("c");
        v3.cpu_template = Some("x86-64-v3".into());
        let ids = |nodes: Vec<NodeRecord>| nodes.into_iter().map(|n| n.node_id).collect::<Vec<_>>();
        let nodes = vec![node("a"), node("b"), v3];
        assert_eq!(
            ids(same_cpu_first(nodes.clone(), Some("x86-64-v3"))),
            ["c", "a", "b"]
        );
        assert_eq!(ids(same_cpu_first(nodes, None)), ["a", "b", "c"]);
    }

    #[test]
    fn requests_about_a_template_name_it() {
        assert_eq!(named_template("/snapshots/s1:default/fork"), Some("s1"));
        assert_eq!(named_template("/templates/base"), Some("base"));
        assert_eq!(named_template("/v2/templates/t1/builds/b"), Some("t1"));
        assert_eq!(named_template("/templates/"), None);
        assert_eq!(named_template("/sandboxes/x"), None);
    }

    #[test]
    fn a_create_names_its_template_as_nodes_list_theirs() {
        let named = |body: &[u8]| create_template(&serde_json::from_slice(body).ok()?);
        assert_eq!(
            named(br#"{"templateID":"t1:default"}"#).as_deref(),
            Some("t1")
        );
        assert_eq!(
            named(br#"{"templateID":"t1:v2"}"#).as_deref(),
            Some("t1:v2")
        );
        for base in [
            &br#"{}"#[..],
            br#"{"templateID":""}"#,
            br#"{"templateID":null}"#,
        ] {
            assert_eq!(named(base).as_deref(), Some("base"));
        }
        assert_eq!(named(b"not json"), None);
        assert_eq!(named(br#"{"templateID":7}"#), None);
    }

    #[test]
    fn a_create_names_its_image_as_nodes_name_its_template() {
        let image = |body: &[u8], key| create_image(&serde_json::from_slice(body).ok()?, key);
        // As its template id, normalised (a tag added).
        assert_eq!(
            image(br#"{"templateID":"127.0.0.1:5000/task/a"}"#, None).as_deref(),
            Some("127.0.0.1:5000/task/a:latest")
        );
        // Under the metadata key, with the base template or none.
        let md = br#"{"templateID":"base","metadata":{"image":"127.0.0.1:5000/b:v1"}}"#;
        assert_eq!(
            image(md, Some("image")).as_deref(),
            Some("127.0.0.1:5000/b:v1")
        );
        assert_eq!(image(md, None), None);
        assert_eq!(image(md, Some("other")), None);
        // Not images: a template, a name with its tag, no body.
        for body in [
            &br#"{"templateID":"t1:v2"}"#[..],
            br#"{}"#,
            b"not json",
            br#"{"templateID":"mine","metadata":{"image":"a.io/x:1"}}"#,
        ] {
            assert_eq!(image(body, Some("image")), None);
        }
    }

    #[test]
    fn creates_in_flight_and_just_placed_count_against_their_node() {
        let placements = Placements::default();
        let order = |placements: &Placements| {
            let mut nodes = vec![node("a"), node("b")];
            placements.count_into(&mut nodes);
            keyspace::placement_order(nodes)
                .into_iter()
                .map(|n| n.node_id)
                .collect::<Vec<_>>()
        };
        assert_eq!(order(&placements), ["a", "b"]);
        // One in flight to a: the next goes to b.
        let first = placements.start("a");
        assert_eq!(order(&placements), ["b", "a"]);
        // Answered with a sandbox: a still counts it for a while.
        placements.finish(first, true);
        assert_eq!(order(&placements), ["b", "a"]);
        // One refused counts no more.
        let refused = placements.start("b");
        placements.finish(refused, false);
        assert_eq!(order(&placements), ["b", "a"]);
        // After the window, the node's own figure is what counts.
        placements.entries.lock().unwrap()[0].1 =
            Some(Instant::now() - PLACED_COUNTS_FOR - Duration::from_millis(1));
        assert_eq!(order(&placements), ["a", "b"]);
    }

    #[test]
    fn control_requests_are_routed_by_what_they_name() {
        let id = "i4kfsx3gqznbsd6x0yhmw";
        assert!(crate::node::ids::is_sandbox_id(id));
        assert_eq!(target(&Method::GET, "/health"), Target::Health);
        assert_eq!(target(&Method::POST, "/sandboxes"), Target::Create);
        assert_eq!(target(&Method::POST, "/v2/sandboxes"), Target::Create);
        assert_eq!(target(&Method::GET, "/v2/sandboxes"), Target::List);
        for path in [
            format!("/sandboxes/{id}"),
            format!("/sandboxes/{id}/pause"),
            format!("/v2/sandboxes/{id}/connect"),
            format!("/v1/sandboxes/{id}/diagnostics"),
        ] {
            assert_eq!(
                target(&Method::POST, &path),
                Target::Sandbox(id.into()),
                "{path}"
            );
        }
        assert_eq!(target(&Method::GET, "/sandboxes/metrics"), Target::AnyNode);
        assert_eq!(target(&Method::GET, "/templates"), Target::Gather);
        assert_eq!(target(&Method::GET, "/snapshots"), Target::Gather);
        assert_eq!(target(&Method::POST, "/snapshots/s1/fork"), Target::Holder);
        assert_eq!(target(&Method::GET, "/templates/base"), Target::Holder);
        assert_eq!(
            target(&Method::DELETE, "/templates/s1"),
            Target::DeleteEverywhere
        );
        assert_eq!(target(&Method::DELETE, "/templates/s1/x"), Target::Holder);
        assert_eq!(
            target(&Method::POST, "/v2/templates/t1/builds/b1"),
            Target::Holder
        );
        assert_eq!(target(&Method::POST, "/templates"), Target::AnyNode);
        assert_eq!(target(&Method::POST, "/volumes"), Target::Volumes);
        assert_eq!(target(&Method::DELETE, "/volumes/v1"), Target::Volumes);
        assert_eq!(target(&Method::GET, "/volumesx"), Target::AnyNode);
        assert_eq!(target(&Method::POST, "/v3/templates"), Target::AnyNode);
        assert_eq!(target(&Method::GET, "/v1/node"), Target::AnyNode);
        assert_eq!(target(&Method::GET, "/admin/teams"), Target::TeamUse);
        assert_eq!(target(&Method::GET, "/admin/teams/t"), Target::TeamUse);
        assert_eq!(target(&Method::POST, "/admin/teams"), Target::AnyNode);
        assert_eq!(target(&Method::GET, "/admin/teams/t/keys"), Target::AnyNode);
    }
}
