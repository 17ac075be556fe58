//! A node in a cluster: keeps its etcd registration's load current and the
//! sandbox-to-node map in step with the sandboxes it holds. It listens to
//! the node through its hooks ([`Listener`], [`crate::node::events`]):
//! creates and fork children are claimed before their answer leaves the
//! node (so the next request, through any gateway, finds the sandbox),
//! kills released at once; a reconcile loop catches the rest (timeouts,
//! memory pressure, sandboxes recovered at start).
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
//! holds one of its team's slots in etcd ([`sandfork_cluster::quota`]), taken with its
//! route (create, fork child, resume) and given back with it (kill, pause).
//! A create or resume of a team at its limit answers 429 with
//! [`crate::wire::TEAM_LIMIT_HEADER`], and the gateway does not try another node.
//!
//! Teams and keys are the cluster's ([`follow_tenants`]).

pub mod cache;
pub mod cpu;
pub mod durable;
pub mod fork_across;
pub mod fork_children;
pub mod fork_files;
pub mod guest_files;
pub mod images;
pub mod templates;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandfork_cluster::{
    Claim, Cluster, ClusterError, NodeCapacity, NodeLoad, Registration, TeamQuota, TenantChange,
    Tenants,
};

use crate::node::capacity::Capacity;
use crate::node::config::ClusterConfig;
use crate::node::events::{Ask, BoxFuture, Denial, Event, Hooks, Permit, Told};
use crate::node::keys::{ApiKeys, SharedTenants, TenantUpdate};
use crate::node::sandbox::{Manager, SandboxError};
use crate::node::store::SandboxState;
use crate::node::tenants::{KeyRecord, TeamRecord, team_or_default};

/// How long after a failed store (the object store down) the reconciler
/// tries a pause again.
const STORE_RETRY: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct Node {
    pub registration: Registration,
    pub manager: Arc<Manager>,
    /// The object store pauses go to, if the cluster has one.
    pub durable: Option<durable::Durable>,
    /// Creates, pauses and resumes under way or made since the reconciler
    /// last listed the sandboxes: their team slots (and a new sandbox's
    /// route) are theirs to change.
    pub changing: Arc<Changing>,
    /// Resumes under way that took one of their team's slots (given back
    /// if the resume fails).
    pub resuming_with_slot: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Pauses the reconciler found unstored: being stored now (None), or
    /// when the last try failed.
    pub storing: std::sync::Mutex<std::collections::HashMap<String, Option<Instant>>>,
    /// Forks whose files this node serves to the nodes making their
    /// children ([`fork_across`]).
    pub forks: fork_files::Exports,
    /// How this node reaches the others' ports (fork requests, kills and
    /// fork files): TLS with its certificate in a cluster with TLS.
    pub dialer: sandfork_tls::Dialer,
    /// The IDs and names of the node's templates as last published: read
    /// again only when templates change and by the reconciler, not for each
    /// sandbox a fork of 100 makes.
    templates: std::sync::Mutex<Vec<String>>,
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
    fn start(self: &Arc<Self>, id: &str) -> ChangeUnderWay {
        *lock(&self.now).entry(id.to_owned()).or_default() += 1;
        lock(&self.since_list).insert(id.to_owned());
        ChangeUnderWay {
            changing: self.clone(),
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

struct ChangeUnderWay {
    changing: Arc<Changing>,
    id: String,
}

impl Drop for ChangeUnderWay {
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
    keys.share(Arc::new(EtcdTenants(cluster.clone())));
    let (keys, capacity) = (keys.clone(), capacity.clone());
    Tenants::start(cluster, move |change| {
        if let Some(update) = tenant_update(change) {
            keys.apply(update);
        }
        for team in keys.teams() {
            capacity.set_team_limits(&team.id, team.limits);
        }
    })
    .await
}

/// A change of etcd's teams and keys as the node takes it; a malformed
/// record is left out (with a warning).
fn tenant_update(change: TenantChange) -> Option<TenantUpdate> {
    Some(match change {
        TenantChange::Loaded(records) => TenantUpdate::Loaded {
            teams: records
                .teams
                .iter()
                .filter_map(|(id, bytes)| decoded(id, bytes))
                .collect(),
            keys: records
                .keys
                .iter()
                .filter_map(|(hex, bytes)| Some((hex.clone(), decoded(hex, bytes)?)))
                .collect(),
        },
        TenantChange::Team { id, record } => TenantUpdate::Team(decoded(&id, &record)?),
        TenantChange::Key { hash, record } => {
            let record = decoded(&hash, &record)?;
            TenantUpdate::Key { hash, record }
        }
        TenantChange::KeyRevoked { hash } => TenantUpdate::KeyRevoked { hash },
    })
}

fn decoded<T: serde::de::DeserializeOwned>(name: &str, bytes: &[u8]) -> Option<T> {
    serde_json::from_slice(bytes)
        .inspect_err(|e| tracing::warn!("cluster: team or key record {name}: {e}; ignored"))
        .ok()
}

/// The cluster's etcd as where the node's teams and keys are written.
struct EtcdTenants(Cluster);

impl SharedTenants for EtcdTenants {
    fn put_team<'a>(
        &'a self,
        team: &'a TeamRecord,
        new: bool,
    ) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            let record = serde_json::to_vec(team).map_err(|e| e.to_string())?;
            let quota = TeamQuota {
                max_sandboxes: team.limits.max_sandboxes,
            };
            if new {
                self.0
                    .create_team(&team.id, &team.name, &record, &quota)
                    .await
                    .map_err(|e| e.to_string())
            } else {
                self.0
                    .put_team(&team.id, &record, &quota)
                    .await
                    .map(|()| true)
                    .map_err(|e| e.to_string())
            }
        })
    }

    fn put_key<'a>(
        &'a self,
        hash: &'a str,
        record: &'a KeyRecord,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let record = serde_json::to_vec(record).map_err(|e| e.to_string())?;
            self.0
                .put_key(hash, &record)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn revoke_key<'a>(&'a self, hash: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.0
                .revoke_key(hash)
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        })
    }
}

/// Why a node could not join its cluster.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("{what}: {source}")]
    Etcd {
        what: &'static str,
        #[source]
        source: ClusterError,
    },
    #[error("the object store {url}: {source}")]
    ObjectStore {
        url: String,
        #[source]
        source: sandfork_cluster::objects::ObjectError,
    },
    #[error(transparent)]
    Hooks(#[from] SandboxError),
}

/// A node's membership, while it lasts: leave with [`Member::leave`].
#[derive(Debug)]
pub struct Member {
    pub node: Arc<Node>,
    /// The cluster's teams and keys, followed while this is held.
    _tenants: Tenants,
}

impl Member {
    /// Gives up the node's registration (its sandboxes stay mapped to it
    /// until its lease ends).
    pub async fn leave(&self) {
        self.node.registration.leave().await;
    }
}

/// Joins the cluster `config` names: the cluster's teams and keys replace
/// the node's own (before it is registered and gets requests), the node is
/// registered, told about clients' operations through its hooks, and its
/// sandboxes recovered at start are mapped before it answers.
pub async fn join(
    config: &ClusterConfig,
    manager: &Arc<Manager>,
    keys: &ApiKeys,
) -> Result<Member, JoinError> {
    let etcd = |what| move |source| JoinError::Etcd { what, source };
    let cluster = Cluster::connect_with(&config.etcd, config.tls.as_ref())
        .await
        .map_err(etcd("connecting to etcd"))?;
    let tenants = follow_tenants(cluster.clone(), keys, manager.capacity())
        .await
        .map_err(etcd("loading the cluster's teams and API keys"))?;
    let registration = Registration::start_with_cpu_template(
        cluster,
        &config.node_id,
        &config.advertise.to_string(),
        capacity(manager),
        manager.config().cpu_template_name(),
        config.lease_ttl.max(Duration::from_secs(2)),
    )
    .await
    .map_err(etcd("registering in etcd"))?;
    let durable = match &config.s3 {
        Some(url) => {
            let object_error = |source| JoinError::ObjectStore {
                url: url.clone(),
                source,
            };
            let store = sandfork_cluster::ObjectStore::from_url(url).map_err(object_error)?;
            store.ensure_bucket().await.map_err(object_error)?;
            let etcd = registration.cluster().clone();
            if let Some(every) = config.store_gc_every {
                sandfork_cluster::Collector::new(store.clone(), etcd.clone(), &config.node_id)
                    .start(every);
            }
            Some(
                durable::Durable::new(store, &config.node_id, manager.config().cluster_cache_dir())
                    .with_fence(etcd),
            )
        }
        None => None,
    };
    let node = Arc::new(Node {
        registration,
        manager: manager.clone(),
        durable,
        changing: Default::default(),
        resuming_with_slot: Default::default(),
        storing: Default::default(),
        forks: Default::default(),
        dialer: config
            .tls
            .as_ref()
            .map(|tls| tls.dialer())
            .unwrap_or_default(),
        templates: Default::default(),
    });
    manager.listen(Arc::new(Listener(Arc::downgrade(&node))))?;
    // Sandboxes recovered at start are mapped before the first request.
    node.reconcile().await;
    node.start_reconciler(Duration::from_secs(2));
    Ok(Member {
        node,
        _tenants: tenants,
    })
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
    /// Publishes the node's load and the templates it last listed (written
    /// if they changed).
    pub fn publish_load(&self) {
        let held = self.manager.capacity().held();
        self.registration.set_load(NodeLoad {
            sandboxes: held.sandboxes as u64,
            vcpus: held.vcpus,
            memory_mib: held.memory_mib,
            templates: lock(&self.templates).clone(),
        });
    }

    /// [`Node::publish_load`] after listing the templates again.
    pub fn publish_templates(&self) {
        *lock(&self.templates) = self.templates_here();
        self.publish_load();
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
        self.publish_templates();
        self.changing.listing();
        let local: Vec<sandfork_cluster::LocalSandbox> = match self.manager.list() {
            Ok(list) => list
                .into_iter()
                .map(|r| sandfork_cluster::LocalSandbox {
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

/// The cluster's side of the node's hooks ([`crate::node::events`]): the
/// node asks before a client's create, fork, pause or resume and tells
/// what happened before the answer leaves. Holds the node weakly: the
/// manager holds these hooks, and the node holds the manager.
#[derive(Debug)]
pub struct Listener(pub std::sync::Weak<Node>);

impl Hooks for Listener {
    fn admit<'a>(&'a self, ask: Ask<'a>) -> BoxFuture<'a, Result<Permit, Denial>> {
        Box::pin(async move {
            let Some(node) = self.0.upgrade() else {
                return Ok(None);
            };
            node.admit(ask).await
        })
    }

    fn told<'a>(&'a self, event: Event<'a>) -> BoxFuture<'a, Result<Told, Denial>> {
        Box::pin(async move {
            let Some(node) = self.0.upgrade() else {
                return Ok(Told::default());
            };
            node.told(event).await
        })
    }
}

impl Node {
    async fn admit(self: &Arc<Self>, ask: Ask<'_>) -> Result<Permit, Denial> {
        match ask {
            // Refused at once when the team already runs its quota (the
            // claim after it is what holds; this spares booting sandboxes
            // that could not be kept).
            Ask::Create { team } => match self.registration.cluster().team_full(team).await {
                Ok(None) => Ok(None),
                Ok(Some(limit)) => Err(Denial::TeamFull { limit }),
                Err(e) => Err(Denial::ClusterState(e.to_string())),
            },
            Ask::Pause { id } => Ok(Some(Box::new(self.changing.start(id)))),
            Ask::Resume { id, team } => {
                let under_way = self.changing.start(id);
                if start_running(self, id, team).await? {
                    lock(&self.resuming_with_slot).insert(id.to_owned());
                }
                Ok(Some(Box::new(under_way)))
            }
        }
    }

    async fn told(self: &Arc<Self>, event: Event<'_>) -> Result<Told, Denial> {
        match event {
            Event::Created { id, team } => {
                // Marked before its route is written: a reconcile pass
                // whose list lacks it must not release that route.
                let _under_way = self.changing.start(id);
                let claimed = claim(self, id, team).await;
                self.publish_load();
                claimed.map(|()| Told::default())
            }
            Event::Paused { id } => {
                stop_running(self, id).await;
                let durable = store_pause(self, id).await;
                Ok(Told {
                    durable: Some(durable),
                })
            }
            Event::Resumed { id } => {
                lock(&self.resuming_with_slot).remove(id);
                // Running again: what the store holds is out of date.
                if let Err(e) = self.registration.set_paused(id, None).await {
                    tracing::warn!("cluster: sandbox {id}: clearing its durable pause: {e}");
                }
                self.publish_load();
                Ok(Told::default())
            }
            Event::NotResumed { id } => {
                // Still paused: the slot taken for it goes back.
                if lock(&self.resuming_with_slot).remove(id) {
                    stop_running(self, id).await;
                }
                Ok(Told::default())
            }
            Event::Killed { id } => {
                if let Err(e) = self.registration.release(id).await {
                    // The reconciler retries; the sandbox is gone either way.
                    tracing::warn!("cluster: releasing {id}: {e}");
                }
                self.publish_load();
                Ok(Told::default())
            }
            Event::TemplateReady { id } => {
                self.store_template_in_background(id.to_owned());
                Ok(Told::default())
            }
            Event::TemplatesDeleted { ids } => {
                self.forget_templates(ids).await;
                Ok(Told::default())
            }
        }
    }
}

/// Stores a pause in the object store and records it in the sandbox's
/// route: whether it is stored. Without a store, or if storing fails (with
/// a warning), or when the pause asked to stay here (`"durable": false`),
/// the pause stays on this node only.
async fn store_pause(node: &Node, id: &str) -> bool {
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
    durable
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

impl Node {
    /// Before a resume (or connect) a gateway sent here because the
    /// sandbox's node is gone ([`crate::wire`]'s take-in header): takes
    /// paused sandbox `id` in from the object store and moves its route
    /// here. Already here: nothing to do.
    pub async fn take_in(&self, id: &str) -> Result<(), Denial> {
        // The reconciler must not judge the copy before its route is moved.
        let _under_way = self.changing.start(id);
        let seen = self
            .registration
            .cluster()
            .sandbox(id)
            .await
            .map_err(|e| Denial::ClusterState(e.to_string()))?
            .ok_or_else(|| Denial::NotFound(format!("sandbox {id} not found")))?;
        let me = self.registration.node_id();
        if seen.value.node_id == me && seen.value.incarnation == self.registration.incarnation() {
            return Ok(());
        }
        let Some(pause) = seen.value.paused.clone() else {
            return Err(Denial::Conflict(format!(
                "sandbox {id} is on node {} and not paused in the object store",
                seen.value.node_id
            )));
        };
        let Some(durable) = &self.durable else {
            return Err(Denial::Unavailable(format!(
                "sandbox {id} is paused in the object store and this node has none (--s3)"
            )));
        };
        // Before anything changes here: a pause made under another CPU
        // template is another node's to take (the manifest is checked again).
        cpu::check_here(
            &self.manager,
            &format!("sandbox {id}"),
            pause.cpu_template.as_deref(),
        )
        .map_err(|e| Denial::Unavailable(e.to_string()))?;
        // A copy from before (this node's earlier life) is out of date.
        if self.manager.get(id).is_ok() {
            tracing::info!(
                "cluster: sandbox {id}: dropping this node's old copy before taking it in"
            );
            if let Err(e) = self.manager.kill_unannounced(id).await {
                return Err(Denial::Unavailable(format!(
                    "sandbox {id}: dropping the old copy: {e}"
                )));
            }
        }
        durable
            .take_in(&self.manager, id, &pause)
            .await
            .map_err(|e| {
                Denial::Unavailable(format!(
                    "sandbox {id}: taking it in from the object store: {e}"
                ))
            })?;
        let moved = self.registration.take_over(id, &seen).await;
        match moved {
            Ok(true) => {
                tracing::info!(
                    "cluster: sandbox {id}: moved here from node {}",
                    seen.value.node_id
                );
                Ok(())
            }
            refused => {
                if let Err(e) = self.manager.kill_unannounced(id).await {
                    tracing::warn!("cluster: sandbox {id}: removing the copy not moved here: {e}");
                }
                Err(match refused {
                    Err(e) => Denial::ClusterState(e.to_string()),
                    _ => Denial::Conflict(format!(
                        "sandbox {id} moved meanwhile, or its node {} is back",
                        seen.value.node_id
                    )),
                })
            }
        }
    }
}

/// Before a resume of paused sandbox `id`: one of its team's slots (true),
/// or a denial. Nothing to do (false) for one that runs (a connect) or is
/// not here (the API answers for it).
async fn start_running(node: &Node, id: &str, team: &str) -> Result<bool, Denial> {
    let Ok(record) = node.manager.get(id) else {
        return Ok(false);
    };
    if record.state == SandboxState::Running {
        return Ok(false);
    }
    match node.registration.start_running(id, Some(team)).await {
        Ok(Claim::TeamFull { limit }) => Err(Denial::TeamFull { limit }),
        Ok(Claim::Claimed) => Ok(true),
        Ok(Claim::Refused) => match moved_to(node, id).await? {
            // Fenced: the copy here is stale and the reconciler removes it.
            Some(owner) => Err(Denial::Conflict(format!(
                "sandbox {id} moved to node {owner}: resume it through a gateway"
            ))),
            // Not mapped yet (the reconciler claims it), or this node's
            // earlier incarnation's whose lease has not ended yet: the
            // resume goes on.
            None => Ok(false),
        },
        Err(e) => Err(Denial::ClusterState(e.to_string())),
    }
}

/// The node `id`'s route names, when that is another node.
async fn moved_to(node: &Node, id: &str) -> Result<Option<String>, Denial> {
    let route = node
        .registration
        .cluster()
        .sandbox(id)
        .await
        .map_err(|e| Denial::ClusterState(e.to_string()))?;
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

/// Claims sandbox `id` of `team` before the answer that names it leaves
/// (the next request, through any gateway, finds it): refused (its team is
/// at its quota, the node lost its lease, or the ID is mapped elsewhere),
/// the node kills it and the create answers 429 or 503 (a gateway tries the
/// next node on a 503).
async fn claim(node: &Node, id: &str, team: &str) -> Result<(), Denial> {
    match node.registration.claim_in_team(id, Some(team)).await {
        Ok(Claim::Claimed) => Ok(()),
        Ok(Claim::TeamFull { limit }) => Err(Denial::TeamFull { limit }),
        Ok(Claim::Refused) => Err(Denial::Unavailable(
            "the cluster did not record the sandbox: the node's registration no longer holds \
             (or the ID is taken)"
                .to_owned(),
        )),
        Err(e) => Err(Denial::ClusterState(format!(
            "the sandbox was not recorded: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::capacity::{Limits, TeamLimits};
    use crate::node::store::Store;

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
        let etcd = sandfork_cluster::harness::Etcd::start().expect("etcd");
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
            Err(crate::node::keys::AuthError::TeamExists(_))
        ));
        // The node's capacity counts the team's limit (its local check).
        let ask = crate::node::capacity::Ask {
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
}
