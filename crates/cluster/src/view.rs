//! A live copy of the cluster's nodes and sandbox map, kept by one etcd
//! watch, so a gateway routes a request without asking etcd each time.
//!
//! It loads everything under [`keyspace::PREFIX`] at one revision, then
//! applies the watch's events from the next revision on. While it is not in
//! step (starting, or after the watch broke, until it has loaded again) it
//! answers "unknown" and callers ask etcd directly; callers also ask etcd
//! on a miss, since a claim made a moment ago through another gateway may
//! not have reached this watch yet. When etcd cannot answer (no quorum), the
//! last copy is still there to route by ([`View::last_known_sandbox`]):
//! sandboxes stay reachable, since each node answers for its own.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use etcd_client::{EventType, KeyValue};
use tokio::task::JoinHandle;

use crate::keyspace::{self, ImageClaim, NodeRecord, SandboxRoute};
use crate::{Cluster, ClusterError, Versioned};

/// Pause before loading again after etcd failed.
const RETRY_AFTER: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
struct State {
    in_step: bool,
    /// The last load failed: etcd could not answer then.
    load_failed: bool,
    nodes: BTreeMap<String, NodeRecord>,
    sandboxes: HashMap<String, Versioned<SandboxRoute>>,
    /// Conversions of registry images under way, by their key.
    images: HashMap<String, ImageClaim>,
}

/// The watch's copy; dropping the last handle stops its task.
#[derive(Debug)]
pub struct View {
    state: Arc<RwLock<State>>,
    task: JoinHandle<()>,
}

impl View {
    /// Starts loading and watching in a task of the current runtime.
    pub fn start(cluster: Cluster) -> View {
        let state = Arc::new(RwLock::new(State::default()));
        let task = tokio::spawn(keep(cluster, state.clone()));
        View { state, task }
    }

    /// The registered nodes, by ID; None while the copy is not in step.
    pub fn nodes(&self) -> Option<Vec<NodeRecord>> {
        let state = self.read();
        state
            .in_step
            .then(|| state.nodes.values().cloned().collect())
    }

    /// `id`'s route if the copy has it; None if it has not, or is not in
    /// step (ask etcd then).
    pub fn sandbox(&self, id: &str) -> Option<Versioned<SandboxRoute>> {
        let state = self.read();
        state.in_step.then(|| state.sandboxes.get(id).cloned())?
    }

    /// Whether the copy follows etcd now.
    pub fn in_step(&self) -> bool {
        self.read().in_step
    }

    /// Whether the copy's last load from etcd failed (etcd is out of reach
    /// or without a quorum until a load succeeds): asking etcd now would
    /// likely wait for its timeout.
    pub fn etcd_failed(&self) -> bool {
        self.read().load_failed
    }

    /// `id`'s route as the copy last had it, in step or not: for a caller
    /// that cannot ask etcd. It may be out of date (a pause moved since is
    /// answered for by the node that has it no longer).
    pub fn last_known_sandbox(&self, id: &str) -> Option<Versioned<SandboxRoute>> {
        self.read().sandboxes.get(id).cloned()
    }

    /// The claim on the conversion of `image` (a normalised reference),
    /// if the copy has one: the node converting it. None too while the
    /// copy is not in step (a create is then placed as any other).
    pub fn image_claim(&self, image: &str) -> Option<ImageClaim> {
        let state = self.read();
        let claim = state.images.get(&keyspace::image_key(image));
        state.in_step.then(|| claim.cloned())?
    }

    /// How many nodes and sandbox routes the copy holds now.
    pub fn sizes(&self) -> (usize, usize) {
        let state = self.read();
        (state.nodes.len(), state.sandboxes.len())
    }

    /// The nodes as the copy last had them, in step or not.
    pub fn last_known_nodes(&self) -> Vec<NodeRecord> {
        self.read().nodes.values().cloned().collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for View {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep(cluster: Cluster, state: Arc<RwLock<State>>) {
    loop {
        if let Err(e) = follow(&cluster, &state).await {
            tracing::warn!("cluster view: {e}; loading again");
        }
        state.write().unwrap_or_else(|p| p.into_inner()).in_step = false;
        tokio::time::sleep(RETRY_AFTER).await;
    }
}

/// Loads the keyspace, then applies its changes until the watch ends.
async fn follow(cluster: &Cluster, state: &RwLock<State>) -> Result<(), ClusterError> {
    let loaded = match cluster.get_prefix_once(keyspace::PREFIX).await {
        Ok(loaded) => loaded,
        Err(e) => {
            state.write().unwrap_or_else(|p| p.into_inner()).load_failed = true;
            return Err(e.into());
        }
    };
    let revision = loaded.revision();
    let mut fresh = State {
        in_step: true,
        ..State::default()
    };
    for kv in loaded.kvs() {
        put(&mut fresh, kv);
    }
    *state.write().unwrap_or_else(|p| p.into_inner()) = fresh;

    crate::follow_prefix(
        cluster,
        keyspace::PREFIX,
        revision + 1,
        "cluster view",
        |kind, kv| {
            let mut state = state.write().unwrap_or_else(|p| p.into_inner());
            match kind {
                EventType::Put => put(&mut state, kv),
                EventType::Delete => delete(&mut state, kv.key()),
            }
        },
    )
    .await
}

fn put(state: &mut State, kv: &KeyValue) {
    let key = String::from_utf8_lossy(kv.key());
    if let Some(id) = keyspace::sandbox_id(kv.key()) {
        match serde_json::from_slice::<SandboxRoute>(kv.value()) {
            Ok(value) => {
                let route = Versioned {
                    value,
                    mod_revision: kv.mod_revision(),
                };
                state.sandboxes.insert(id.to_owned(), route);
            }
            Err(e) => tracing::warn!("cluster view: {key}: {e}"),
        }
    } else if let Some(node_id) = key.strip_prefix(keyspace::NODES) {
        match serde_json::from_slice::<NodeRecord>(kv.value()) {
            Ok(record) => {
                state.nodes.insert(node_id.to_owned(), record);
            }
            Err(e) => tracing::warn!("cluster view: {key}: {e}"),
        }
    } else if key.starts_with(keyspace::IMAGES) {
        match serde_json::from_slice::<ImageClaim>(kv.value()) {
            Ok(claim) => {
                state.images.insert(key.into_owned(), claim);
            }
            Err(e) => tracing::warn!("cluster view: {key}: {e}"),
        }
    }
}

fn delete(state: &mut State, key: &[u8]) {
    if let Some(id) = keyspace::sandbox_id(key) {
        state.sandboxes.remove(id);
    } else if let Some(node_id) = std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(keyspace::NODES))
    {
        state.nodes.remove(node_id);
    } else if let Ok(key) = std::str::from_utf8(key)
        && key.starts_with(keyspace::IMAGES)
    {
        state.images.remove(key);
    }
}
