//! A node in a cluster: keeps its etcd registration's load current and the
//! sandbox-to-node map in step with the sandboxes it holds. Creates are
//! claimed before their answer leaves the node (so the next request, through
//! any gateway, finds the sandbox), kills released at once; a reconcile loop
//! catches the rest (fork children, timeouts, sandboxes recovered at start).
//!
//! With an object store ([`durable`]), a pause through the API is stored
//! there before it answers and its route says so; one made without the API
//! (at a timeout, for memory pressure) or whose store failed is stored by
//! the reconcile loop, and a sandbox that runs again without the API loses
//! its stored pause on its next pass; a resume (or connect)
//! that the gateway marks with [`TAKE_IN_HEADER`] first takes the paused
//! sandbox in from the store, moving its route to this node in a
//! transaction that holds only if its old node is gone.
//!
//! A team's `max_sandboxes` holds across the cluster: a sandbox that runs
//! holds one of its team's slots in etcd ([`cluster::quota`]), taken with its
//! route (create, fork child, resume) and given back with it (kill, pause).
//! A create or resume of a team at its limit answers 429 with
//! [`crate::api::TEAM_LIMIT_HEADER`], and the gateway does not try another node.
//!
//! Teams and keys are the cluster's ([`follow_tenants`]).

pub mod cache;
pub mod cpu;
pub mod durable;
pub mod fork_across;
pub mod fork_children;
pub mod fork_files;
pub mod guest_files;
pub mod templates;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use cluster::{Claim, Cluster, ClusterError, NodeCapacity, NodeLoad, Registration, Tenants};

use crate::api::ApiError;
use crate::auth::ApiKeys;
use crate::capacity::Capacity;
use crate::sandbox::{Manager, SandboxError};
use crate::store::SandboxState;
use crate::tenants::team_or_default;

/// Set by a gateway on a resume or connect it sends to a node other than
/// the sandbox's, whose node is gone: take the sandbox in first.
pub const TAKE_IN_HEADER: &str = "x-sandfork-take-in";
/// On a pause's answer: whether the pause is in the object store.
pub const DURABLE_HEADER: &str = "x-sandfork-durable";

/// How long after a failed store (the object store down) the reconciler
/// tries a pause again.
const STORE_RETRY: Duration = Duration::from_secs(30);

/// A create's answer is a small JSON object; anything larger is not one.
const MAX_CREATE_ANSWER: usize = 1 << 20;

#[derive(Debug)]
pub struct Node {
    pub registration: Registration,
    pub manager: Arc<Manager>,
    /// The API key (taking a sandbox in is checked before the API's own
    /// check runs).
    pub keys: ApiKeys,
    /// The object store pauses go to, if the cluster has one.
    pub durable: Option<durable::Durable>,
    /// Pauses and resumes under way or made since the reconciler last
    /// listed the sandboxes: their team slots are theirs to change.
    pub changing: Changing,
    /// Pauses the reconciler found unstored: being stored now (None), or
    /// when the last try failed.
    pub storing: std::sync::Mutex<std::collections::HashMap<String, Option<Instant>>>,
    /// Forks whose files this node serves to the nodes making their
    /// children ([`fork_across`]).
    pub forks: fork_files::Exports,
}

/// Sandboxes whose running state an API request is changing (pause,
/// resume), so the reconciler does not fix their slots from a list taken
/// before that change.
#[derive(Default, Debug)]
pub struct Changing {
    /// Requests under way, by sandbox.
    now: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    /// Sandboxes changed since the reconciler's last list.
    since_list: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Changing {
    fn start(&self, id: &str) -> ChangeUnderWay<'_> {
        *lock(&self.now).entry(id.to_owned()).or_default() += 1;
        lock(&self.since_list).insert(id.to_owned());
        ChangeUnderWay {
            changing: self,
            id: id.to_owned(),
        }
    }

    /// Called as the reconciler lists the sandboxes.
    fn listing(&self) {
        lock(&self.since_list).clear();
    }

    fn contains(&self, id: &str) -> bool {
        lock(&self.now).contains_key(id) || lock(&self.since_list).contains(id)
    }
}

struct ChangeUnderWay<'a> {
    changing: &'a Changing,
    id: String,
}

impl Drop for ChangeUnderWay<'_> {
    fn drop(&mut self) {
        let mut now = lock(&self.changing.now);
        if let Some(count) = now.get_mut(&self.id) {
            *count -= 1;
            if *count == 0 {
                now.remove(&self.id);
            }
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// From now on the node's teams and keys are the cluster's: loaded before
/// it returns, then followed (with each team's limits given to the node's
/// capacity); admin changes are written to etcd.
pub async fn follow_tenants(
    cluster: Cluster,
    keys: &ApiKeys,
    capacity: &Arc<Capacity>,
) -> Result<Tenants, ClusterError> {
    keys.join_cluster(cluster.clone());
    let (keys, capacity) = (keys.clone(), capacity.clone());
    Tenants::start(cluster, move |change| {
        keys.apply(change);
        for team in keys.teams() {
            capacity.set_team_limits(&team.id, team.limits);
        }
    })
    .await
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
    /// Publishes the node's load and templates (written if they changed).
    pub fn publish_load(&self) {
        self.registration.set_load(self.load());
    }

    fn load(&self) -> NodeLoad {
        let held = self.manager.capacity().held();
        NodeLoad {
            sandboxes: held.sandboxes as u64,
            vcpus: held.vcpus,
            memory_mib: held.memory_mib,
            templates: self.templates_here(),
        }
    }

    /// The IDs and names of the node's templates, sorted, for placement
    /// (none, with a warning, if the store cannot be read: placement then
    /// goes by free capacity alone).
    fn templates_here(&self) -> Vec<String> {
        let records = match self.manager.store().templates() {
            Ok(records) => records,
            Err(e) => {
                tracing::warn!("cluster: listing templates for placement: {e}");
                return Vec::new();
            }
        };
        let base = self.manager.template().id.clone();
        let mut here: Vec<String> = records
            .into_iter()
            .flat_map(|t| std::iter::once(t.id).chain(t.names))
            .chain([base])
            .collect();
        here.sort_unstable();
        here.dedup();
        here
    }

    /// One pass: the load and the map brought up to date.
    pub async fn reconcile(self: &Arc<Self>) {
        self.publish_load();
        self.changing.listing();
        let local: Vec<cluster::LocalSandbox> = match self.manager.list() {
            Ok(list) => list
                .into_iter()
                .map(|r| cluster::LocalSandbox {
                    running: r.state == SandboxState::Running,
                    pause_generation: r.pause_generation,
                    kept_local: r.local_pause == Some(r.pause_generation),
                    team: team_or_default(r.team.as_deref()).to_owned(),
                    id: r.id,
                })
                .collect(),
            Err(e) => return tracing::warn!("cluster: listing sandboxes: {e}"),
        };
        let changing = |id: &str| self.changing.contains(id);
        let done = match self.registration.reconcile(&local, changing).await {
            Ok(done) => done,
            Err(e) => return tracing::warn!("cluster: reconciling the sandbox map: {e}"),
        };
        if done.claimed + done.released > 0 {
            tracing::info!(
                "cluster: reconciled the sandbox map: {} claimed, {} released",
                done.claimed,
                done.released
            );
        }
        lock(&self.storing).retain(|id, failed| failed.is_none() || done.unstored.contains(id));
        for id in done.unstored {
            self.store_in_background(id);
        }
        for (id, owner) in done.moved {
            self.drop_copy(&id, &format!("is node {owner}'s now")).await;
        }
        for id in done.killed {
            if self
                .drop_copy(&id, "was killed through a gateway while this node was away")
                .await
                && let Err(e) = self.registration.cluster().clear_killed(&id).await
            {
                tracing::warn!("cluster: sandbox {id}: forgetting its kill: {e}");
            }
        }
    }

    /// Stores a pause made without the API (at a sandbox's timeout, for
    /// memory pressure) or whose store failed (the object store was down),
    /// once at a time per sandbox; a resume meanwhile waits for it.
    fn store_in_background(self: &Arc<Self>, id: String) {
        if self.durable.is_none() {
            return;
        }
        {
            let mut storing = lock(&self.storing);
            match storing.get(&id) {
                Some(None) => return,
                Some(Some(failed)) if failed.elapsed() < STORE_RETRY => return,
                _ => {}
            }
            storing.insert(id.clone(), None);
        }
        let node = self.clone();
        tokio::spawn(async move {
            let stored = store_and_record(&node, &id).await;
            let mut storing = lock(&node.storing);
            if stored {
                tracing::info!("cluster: sandbox {id}: a pause made without the API is stored");
                storing.remove(&id);
            } else {
                storing.insert(id, Some(Instant::now()));
            }
        });
    }

    /// Removes this node's copy of a sandbox the cluster no longer gives it
    /// (another node took it, or it was killed, while this one was cut off
    /// from etcd): only the owner's copy may serve, a killed one none. The
    /// VMM (if any), record and local files go; the route and what the
    /// object store holds are not this node's. True once the copy is gone.
    async fn drop_copy(&self, id: &str, why: &str) -> bool {
        // A take-in here started since the reconciler looked.
        if self.changing.contains(id) {
            return false;
        }
        tracing::warn!("cluster: sandbox {id} {why}; removing this node's stale copy");
        let gone = match self.manager.kill(id).await {
            Ok(()) | Err(SandboxError::NotFound(_)) => true,
            Err(e) => {
                tracing::warn!("cluster: sandbox {id}: removing the stale copy: {e}");
                false
            }
        };
        self.publish_load();
        gone
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
    /// A fork of a sandbox or a snapshot: its children are claimed.
    Fork,
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
        (&Method::POST, p) if p.starts_with("/snapshots/") && p.ends_with("/fork") => Change::Fork,
        // Children of a fork frozen on another node.
        (&Method::POST, "/internal/forks") => Change::Fork,
        (&Method::POST, p) => {
            let Some(rest) = p
                .strip_prefix("/sandboxes/")
                .or_else(|| p.strip_prefix("/v2/sandboxes/"))
            else {
                return Change::None;
            };
            match rest.split_once('/') {
                Some((id, "fork")) if !id.is_empty() => Change::Fork,
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
    if matches!(change, Change::None) {
        return next.run(req).await;
    }
    // The caller's team (an unknown key: the API's own check answers).
    let team = req
        .headers()
        .get(crate::auth::HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|k| node.keys.authenticate(k))
        .map(|caller| caller.team);
    let Some(team) = team else {
        if matches!(change, Change::Resume(_)) && req.headers().contains_key(TAKE_IN_HEADER) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid X-API-KEY header",
            )
            .into_response();
        }
        return next.run(req).await;
    };
    let _under_way = match &change {
        Change::Pause(id) | Change::Resume(id) => Some(node.changing.start(id)),
        _ => None,
    };
    // Whether this resume took a team slot (given back if it fails).
    let mut took_slot = false;
    if let Change::Resume(id) = &change {
        if req.headers().contains_key(TAKE_IN_HEADER)
            && let Err(e) = take_in(&node, id).await
        {
            return e.into_response();
        }
        match start_running(&node, id, &team).await {
            Ok(took) => took_slot = took,
            Err(e) => return e.into_response(),
        }
    }
    if matches!(change, Change::Create | Change::Fork)
        && let Err(e) = team_has_room(&node, &team).await
    {
        return e.into_response();
    }
    let response = next.run(req).await;
    if !response.status().is_success() {
        if let Change::Resume(id) = &change
            && took_slot
        {
            // Still paused: the slot taken for it goes back.
            stop_running(&node, id).await;
        }
        return response;
    }
    match change {
        Change::Pause(id) => {
            stop_running(&node, &id).await;
            store_pause(&node, &id, response).await
        }
        Change::Resume(id) => {
            // Running again: what the store holds is out of date.
            match node.registration.set_paused(&id, None).await {
                Ok(_) => {}
                Err(e) => tracing::warn!("cluster: sandbox {id}: clearing its durable pause: {e}"),
            }
            node.publish_load();
            response
        }
        Change::Create => claim_created(&node, &team, response).await,
        Change::Fork => claim_children(&node, &team, response).await,
        Change::Kill(id) => {
            if let Err(e) = node.registration.release(&id).await {
                // The reconciler retries; the sandbox is gone either way.
                tracing::warn!("cluster: releasing {id}: {e}");
            }
            node.publish_load();
            response
        }
        Change::None => response,
    }
}

/// Stores a pause in the object store and records it in the sandbox's
/// route; without a store, or if storing fails (with a warning), or when
/// the pause asked to stay here (`"durable": false`), the pause stays on
/// this node only. The answer says which in [`DURABLE_HEADER`].
async fn store_pause(node: &Node, id: &str, mut response: Response) -> Response {
    let kept_local = node
        .manager
        .get(id)
        .is_ok_and(|r| r.local_pause == Some(r.pause_generation));
    let durable = if kept_local {
        tracing::info!("cluster: sandbox {id}: paused on this node only, as asked");
        false
    } else {
        store_and_record(node, id).await
    };
    node.publish_load();
    response.headers_mut().insert(
        DURABLE_HEADER,
        axum::http::HeaderValue::from_static(if durable { "true" } else { "false" }),
    );
    response
}

/// Stores paused sandbox `id` in the object store and records it in its
/// route: true if both were done; false (with a warning) without a store, or
/// if either failed, and the pause stays on this node only (the reconciler
/// tries again).
async fn store_and_record(node: &Node, id: &str) -> bool {
    let Some(durable) = &node.durable else {
        return false;
    };
    let record = async |pause| node.registration.set_paused(id, Some(pause)).await;
    match durable.store_pause(&node.manager, id, record).await {
        Ok(true) => true,
        Ok(false) => {
            tracing::warn!("cluster: sandbox {id}: stored, but its route is not this node's");
            false
        }
        Err(e) => {
            tracing::warn!(
                "cluster: sandbox {id}: its pause is not in the object store ({e}); it stays on this node only for now"
            );
            false
        }
    }
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
        .map_err(ApiError::cluster_state)?
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
    // Before anything changes here: a pause made under another CPU template
    // is another node's to take (the manifest is checked again).
    cpu::check_here(
        &node.manager,
        &format!("sandbox {id}"),
        pause.cpu_template.as_deref(),
    )
    .map_err(|e| unavailable(e.to_string()))?;
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
                Err(e) => ApiError::cluster_state(e),
                _ => conflict(format!(
                    "sandbox {id} moved meanwhile, or its node {} is back",
                    seen.value.node_id
                )),
            })
        }
    }
}

/// The answer for a team at its quota across the cluster (E2B's 429).
fn team_full(limit: u64) -> ApiError {
    ApiError::team_limit(format!(
        "you have reached the maximum number of concurrent sandboxes ({limit}) of your team \
         across the cluster"
    ))
}

/// Refuses a create or fork at once when `team` already runs its quota
/// (the claim after it is what holds; this spares booting sandboxes that
/// could not be kept).
async fn team_has_room(node: &Node, team: &str) -> Result<(), ApiError> {
    match node.registration.cluster().team_full(team).await {
        Ok(None) => Ok(()),
        Ok(Some(limit)) => Err(team_full(limit)),
        Err(e) => Err(ApiError::cluster_state(e)),
    }
}

/// Before a resume of paused sandbox `id`: one of its team's slots (true),
/// or 429. Nothing to do (false) for one that runs (a connect) or is not
/// here (the API answers for it).
async fn start_running(node: &Node, id: &str, caller_team: &str) -> Result<bool, ApiError> {
    let Ok(record) = node.manager.get(id) else {
        return Ok(false);
    };
    if record.state == SandboxState::Running {
        return Ok(false);
    }
    // Another team's sandbox: the API answers 404 for it.
    if team_or_default(record.team.as_deref()) != caller_team {
        return Ok(false);
    }
    match node.registration.start_running(id, Some(caller_team)).await {
        Ok(Claim::TeamFull { limit }) => Err(team_full(limit)),
        Ok(Claim::Claimed) => Ok(true),
        Ok(Claim::Refused) => match moved_to(node, id).await? {
            // Fenced: the copy here is stale and the reconciler removes it.
            Some(owner) => Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("sandbox {id} moved to node {owner}: resume it through a gateway"),
            )),
            // Not mapped yet (the reconciler claims it), or this node's
            // earlier incarnation's whose lease has not ended yet: the
            // resume goes on.
            None => Ok(false),
        },
        Err(e) => Err(ApiError::cluster_state(e)),
    }
}

/// The node `id`'s route names, when that is another node.
async fn moved_to(node: &Node, id: &str) -> Result<Option<String>, ApiError> {
    let route = node
        .registration
        .cluster()
        .sandbox(id)
        .await
        .map_err(ApiError::cluster_state)?;
    let me = node.registration.node_id();
    Ok(route
        .map(|seen| seen.value.node_id)
        .filter(|owner| *owner != me))
}

/// `id` stopped running (paused, or its resume failed): its team's slot
/// goes back (the reconciler retries what fails here).
async fn stop_running(node: &Node, id: &str) {
    if let Err(e) = node.registration.stop_running(id).await {
        tracing::warn!("cluster: sandbox {id}: giving back its team's slot: {e}");
    }
}

/// Claims sandbox `id` of `team`: None if it is the node's now, else why
/// not (and it is killed).
async fn claim_or_kill(node: &Node, id: &str, team: &str) -> Option<ApiError> {
    let refused = match node.registration.claim_in_team(id, Some(team)).await {
        Ok(Claim::Claimed) => return None,
        Ok(Claim::TeamFull { limit }) => team_full(limit),
        Ok(Claim::Refused) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the cluster did not record the sandbox: the node's registration no longer holds \
             (or the ID is taken)",
        ),
        Err(e) => ApiError::cluster_state(format!("the sandbox was not recorded: {e}")),
    };
    tracing::warn!("cluster: claiming {id}: {}; killing it", refused.message);
    if let Err(e) = node.manager.kill(id).await {
        tracing::warn!("cluster: killing unclaimed {id}: {e}");
    }
    Some(refused)
}

/// A create's or fork's answer, read whole (it is small).
async fn read_answer(
    response: Response,
) -> Result<(axum::http::response::Parts, axum::body::Bytes), ApiError> {
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_CREATE_ANSWER)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok((parts, bytes))
}

/// Claims the sandbox a create answered with before the answer leaves:
/// refused (its team is at its quota, the node lost its lease, or the ID
/// is mapped elsewhere), the sandbox is killed and the create answers 429
/// or 503 (a gateway tries the next node on a 503).
async fn claim_created(node: &Node, team: &str, response: Response) -> Response {
    let (parts, bytes) = match read_answer(response).await {
        Ok(read) => read,
        Err(e) => return e.into_response(),
    };
    let id = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("sandboxID")?.as_str().map(str::to_owned));
    let Some(id) = id else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    let refused = claim_or_kill(node, &id, team).await;
    node.publish_load();
    match refused {
        None => Response::from_parts(parts, Body::from(bytes)),
        Some(e) => e.into_response(),
    }
}

/// Claims each child a fork answered with before the answer leaves (the
/// next request, through any gateway, finds it); a child its team has no
/// slot for is killed and its entry becomes the error, as a child that
/// failed to start is. Children another node made (a fork across nodes)
/// were claimed by that node before it answered.
async fn claim_children(node: &Node, team: &str, response: Response) -> Response {
    let (parts, bytes) = match read_answer(response).await {
        Ok(read) => read,
        Err(e) => return e.into_response(),
    };
    let Ok(mut children) = serde_json::from_slice::<Vec<serde_json::Value>>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    for child in &mut children {
        let Some(id) = child
            .pointer("/sandbox/sandboxID")
            .and_then(|v| v.as_str())
            .map(str::to_owned)
        else {
            continue;
        };
        // A child on another node (a fork across nodes) is that node's to claim.
        if node.manager.get(&id).is_err() {
            continue;
        }
        if let Some(e) = claim_or_kill(node, &id, team).await {
            *child =
                serde_json::json!({"error": {"code": e.status.as_u16(), "message": e.message}});
        }
    }
    node.publish_load();
    let body = serde_json::to_vec(&children).unwrap_or_else(|_| bytes.to_vec());
    let mut parts = parts;
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::{Limits, TeamLimits};
    use crate::store::Store;

    async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !check() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Two nodes of one cluster: a team and key made through one are
    /// accepted by the other, a name is unique across them, a revocation
    /// through one reaches both, and each node's capacity has the team's
    /// limits. Neither node's store holds them.
    #[tokio::test]
    async fn teams_and_keys_made_on_one_node_work_on_every_node() {
        let etcd = cluster::harness::Etcd::start().expect("etcd");
        let dir = tempfile::tempdir().unwrap();
        let mut nodes = Vec::new();
        for name in ["a", "b"] {
            let store = Store::open(&dir.path().join(format!("{name}.redb"))).unwrap();
            let keys = ApiKeys::for_key("e2b_admin");
            let capacity = Capacity::new(
                Limits {
                    vcpus: 8,
                    memory_mib: 8192,
                    memory_headroom_mib: 0,
                    sandboxes: 10,
                    min_free_disk_mib: 0,
                },
                dir.path().to_owned(),
            );
            let cluster = Cluster::connect(&etcd.endpoints()).await.unwrap();
            let follower = follow_tenants(cluster, &keys, &capacity).await.unwrap();
            nodes.push((store, keys, capacity, follower));
        }
        let (store_a, keys_a, _, _) = &nodes[0];
        let (store_b, keys_b, capacity_b, _) = &nodes[1];
        let limits = TeamLimits {
            max_sandboxes: Some(2),
            max_memory_mb: None,
        };
        let team = keys_a
            .create_team(store_a, "red", limits, None)
            .await
            .unwrap();
        let (key, record) = keys_a.create_key(store_a, "red", "ci").await.unwrap();
        eventually("node b accepts the key", || keys_b.accepts(&key)).await;
        assert_eq!(&*keys_b.authenticate(&key).unwrap().team, team.id.as_str());
        assert_eq!(keys_b.team("red"), Some(team.clone()));
        assert!(matches!(
            keys_b.create_team(store_b, "red", limits, None).await,
            Err(crate::auth::AuthError::TeamExists(_))
        ));
        // The node's capacity counts the team's limit (its local check).
        let ask = crate::capacity::Ask {
            sandboxes: 3,
            ..Default::default()
        };
        assert!(capacity_b.reserve_for(ask, "test", Some(&team.id)).is_err());
        keys_b.revoke_key(store_b, &record.id).await.unwrap();
        eventually("node a refuses the revoked key", || !keys_a.accepts(&key)).await;
        for store in [store_a, store_b] {
            assert!(store.teams().unwrap().is_empty());
            assert!(store.keys().unwrap().is_empty());
        }
        // A limit changed on b reaches a.
        keys_b
            .update_team(store_b, "red", |t| t.limits.max_sandboxes = Some(5))
            .await
            .unwrap();
        eventually("node a sees the new limit", || {
            keys_a.team("red").unwrap().limits.max_sandboxes == Some(5)
        })
        .await;
    }

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
        assert!(matches!(
            change(&Method::POST, "/sandboxes/abc/fork"),
            Change::Fork
        ));
        assert!(matches!(
            change(&Method::POST, "/snapshots/s1/fork"),
            Change::Fork
        ));
        assert!(matches!(
            change(&Method::POST, "/internal/forks"),
            Change::Fork
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
            (Method::POST, "/snapshots/s1"),
            (Method::DELETE, "/templates/x"),
        ] {
            assert!(matches!(change(&m, p), Change::None), "{m} {p}");
        }
    }
}
