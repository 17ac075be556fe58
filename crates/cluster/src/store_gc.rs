//! Garbage collection of the object store: chunks no manifest names, and
//! the manifests of stored pauses no node can resume from any more.
//!
//! The store holds manifests (`templates/<id>.json`, a stored template or
//! snapshot, removed when it is deleted; `sandboxes/<id>/<generation>.json`,
//! a durable pause) and the chunks they name (`chunks/<sha256>`, shared by
//! every file of every node that holds the same 4 MiB). A pause's manifest
//! can be resumed from only while its sandbox's route in etcd names it
//! (`paused`): a resume clears that, a later pause names a new generation,
//! a kill removes the route (a kill through a gateway of a sandbox lost with
//! its node leaves a `killed/` tombstone and no route), and a take-in on
//! another node reads the manifest the route names. So a pause manifest
//! that no route names is garbage, once it is older than the grace: a node
//! writes the manifest first and names it in the route a moment later.
//!
//! A pass ([`Collector::pass`]), on one node of the cluster at a time (it
//! holds `store-gc/pass` under a lease of its own, taken only if no other
//! node holds it): reads the routes, lists the store, removes the pause
//! manifests no route names, reads the rest and gathers every chunk digest
//! they name, and deletes the chunks none names that are older than the
//! grace. The grace is for uploads under way: an upload writes its chunks
//! before its manifest, and a chunk written less than the grace ago may be
//! one of them (the pass listed the manifests before that upload's was
//! written). An upload of a pause or template takes seconds to minutes,
//! so an hour ([`DEFAULT_GRACE`]) leaves such chunks alone with a wide
//! margin against slow links and clocks apart.
//!
//! The grace does not cover chunks an upload finds already stored and does
//! not send again (content another file shares, a template's files a node
//! remembers having sent): those can be old and named by no manifest (their
//! template was deleted, the pause that named them resumed), and a pass
//! could delete them between the upload's look and its manifest. Uploads
//! guard against that with the pass's epoch ([`Cluster::store_gc_epoch`]):
//! each pass moves it as it starts, so an upload that sees it unchanged and
//! no pass under way both before its first look and after its manifest was
//! written met no pass; one that met a pass checks its chunks again once the
//! pass is over (sending what is missing), and what a node remembers having
//! sent holds only within the epoch it was sent or checked in.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;

use crate::objects::{Listed, ObjectError, ObjectStore};
use crate::{Cluster, ClusterError, keyspace};

/// Where chunks are (`chunks/<sha256>`).
pub const CHUNKS: &str = "chunks/";
/// Where stored pauses' manifests are (`sandboxes/<id>/<generation>.json`).
pub const PAUSES: &str = "sandboxes/";
/// How old an unnamed chunk or pause manifest must be to be removed.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3600);
/// The pass's lease: a node that stops refreshing it (stopped, cut off)
/// lets another pass start this long after.
const PASS_TTL_SECS: i64 = 30;
/// Objects read or deleted at once.
const PARALLEL: usize = 8;

/// The manifest of sandbox `id`'s stored pause `generation`.
pub fn pause_manifest_key(id: &str, generation: u32) -> String {
    format!("{PAUSES}{id}/{generation}.json")
}

/// The sandbox a pause manifest's key names (None for any other key).
fn paused_sandbox(key: &str) -> Option<&str> {
    let (id, file) = key.strip_prefix(PAUSES)?.split_once('/')?;
    let generation = file.strip_suffix(".json")?;
    (!id.is_empty() && generation.parse::<u32>().is_ok()).then_some(id)
}

#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error(transparent)]
    Store(#[from] ObjectError),
    #[error("manifest {key}: {reason} (nothing is collected while it cannot be read)")]
    Manifest { key: String, reason: String },
    #[error("the pass lost its lease in etcd; stopped before deleting more")]
    LeaseLost,
    #[error("a blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// What one pass removed and kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Pause manifests no route names.
    pub manifests: Vec<String>,
    /// Chunks removed, and their bytes.
    pub chunks: usize,
    pub bytes: u64,
    /// Chunks named by no manifest but younger than the grace.
    pub young: usize,
    /// Chunks left (named, or young), and their bytes.
    pub kept: usize,
    pub kept_bytes: u64,
}

/// Where the store's collection stands, as an upload sees it (see the
/// module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcEpoch {
    /// Moves when a pass starts (the mod revision of `store-gc/last`; 0: no
    /// pass ever ran).
    pub last_pass: i64,
    /// A pass holds `store-gc/pass` now.
    pub under_way: bool,
}

impl GcEpoch {
    /// Whether a pass may have deleted chunks between `self` (before an
    /// upload's first look at the store) and `now` (after its manifest).
    pub fn met_a_pass(&self, now: &GcEpoch) -> bool {
        self.under_way || now.under_way || self.last_pass != now.last_pass
    }
}

/// `store-gc/last`: who started the last pass, and when.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LastPass {
    node_id: String,
    started_at_ms: u64,
}

impl Cluster {
    /// The store collection's epoch (see [`GcEpoch`]).
    pub async fn store_gc_epoch(&self) -> Result<GcEpoch, ClusterError> {
        let answer = self.get_prefix(keyspace::STORE_GC).await?;
        let mut epoch = GcEpoch {
            last_pass: 0,
            under_way: false,
        };
        for kv in answer.kvs() {
            match kv.key() {
                k if k == keyspace::STORE_GC_PASS.as_bytes() => epoch.under_way = true,
                k if k == keyspace::STORE_GC_LAST.as_bytes() => epoch.last_pass = kv.mod_revision(),
                _ => {}
            }
        }
        Ok(epoch)
    }

    /// Waits until no pass is under way (at most `limit`): the epoch then.
    pub async fn store_gc_settled(&self, limit: Duration) -> Result<GcEpoch, ClusterError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let epoch = self.store_gc_epoch().await?;
            if !epoch.under_way || tokio::time::Instant::now() >= deadline {
                return Ok(epoch);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// The collector of one node.
#[derive(Clone, Debug)]
pub struct Collector {
    store: ObjectStore,
    cluster: Cluster,
    node_id: String,
    grace: Duration,
}

impl Collector {
    pub fn new(store: ObjectStore, cluster: Cluster, node_id: &str) -> Collector {
        Collector {
            store,
            cluster,
            node_id: node_id.to_owned(),
            grace: DEFAULT_GRACE,
        }
    }

    /// Another grace than [`DEFAULT_GRACE`] (tests).
    pub fn with_grace(mut self, grace: Duration) -> Collector {
        self.grace = grace;
        self
    }

    /// Runs a pass every `every` (first after one `every`), unless another
    /// node's pass started less than half of it ago: with every node of the
    /// cluster looking, about one pass runs per `every`.
    pub fn start(self, every: Duration) {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                match self.last_pass_age().await {
                    Ok(Some(age)) if age < every / 2 => continue,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!("store gc: {e}");
                        continue;
                    }
                }
                match self.pass().await {
                    Ok(_) => {}
                    Err(e) => tracing::warn!("store gc: {e}"),
                }
            }
        });
    }

    /// How long ago the last pass (of any node) started; None: never.
    async fn last_pass_age(&self) -> Result<Option<Duration>, GcError> {
        let answer = self.cluster.get_prefix(keyspace::STORE_GC_LAST).await?;
        let Some(kv) = answer.kvs().first() else {
            return Ok(None);
        };
        let last: LastPass = crate::decode(kv.key(), kv.value())?;
        let now = now_ms();
        Ok(Some(Duration::from_millis(
            now.saturating_sub(last.started_at_ms),
        )))
    }

    /// One pass, if no other node's is under way (None then).
    pub async fn pass(&self) -> Result<Option<Swept>, GcError> {
        let mut client = self.cluster.client();
        let lease = crate::retried(|| {
            let mut client = client.clone();
            async move { client.lease_grant(PASS_TTL_SECS, None).await }
        })
        .await?
        .id();
        let last = LastPass {
            node_id: self.node_id.clone(),
            started_at_ms: now_ms(),
        };
        let take = Txn::new()
            .when([Compare::create_revision(
                keyspace::STORE_GC_PASS,
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(
                    keyspace::STORE_GC_PASS,
                    self.node_id.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::put(
                    keyspace::STORE_GC_LAST,
                    crate::encode(keyspace::STORE_GC_LAST, &last)?,
                    None,
                ),
            ]);
        if !crate::send_txn(&mut client, take).await? {
            let _ = client.lease_revoke(lease).await;
            tracing::debug!("store gc: another node's pass is under way");
            return Ok(None);
        }
        let lost = Arc::new(AtomicBool::new(false));
        let keeper = tokio::spawn(keep_lease(client.clone(), lease, lost.clone()));
        let swept = self.sweep(&lost).await;
        keeper.abort();
        // Revoking drops `store-gc/pass`: the next pass may start.
        if let Err(e) = client.lease_revoke(lease).await {
            tracing::warn!("store gc: revoking the pass's lease {lease:x}: {e}");
        }
        let swept = swept?;
        tracing::info!(
            "store gc: removed {} pause manifests and {} chunks ({} MiB); kept {} chunks \
             ({} MiB, {} of them unnamed but younger than {} s)",
            swept.manifests.len(),
            swept.chunks,
            swept.bytes >> 20,
            swept.kept,
            swept.kept_bytes >> 20,
            swept.young,
            self.grace.as_secs()
        );
        Ok(Some(swept))
    }

    async fn sweep(&self, lost: &AtomicBool) -> Result<Swept, GcError> {
        // Before anything is read: a chunk or manifest written since is
        // younger than `older_than`, whatever the listing shows.
        let older_than = SystemTime::now()
            .checked_sub(self.grace)
            .unwrap_or(UNIX_EPOCH);
        // The routes before the listing: a pause named since was written
        // since, so it is young.
        let mut named = BTreeMap::new();
        for (id, route) in self.cluster.sandboxes().await? {
            named.insert(id, route.value.paused.map(|p| p.manifest));
        }
        let (chunks, manifests): (Vec<Listed>, Vec<Listed>) = self
            .store
            .list("")
            .await?
            .into_iter()
            .partition(|o| o.key.starts_with(CHUNKS));
        let mut swept = Swept::default();
        let mut read = Vec::new();
        for m in manifests {
            let unnamed = paused_sandbox(&m.key).is_some_and(|id| {
                named
                    .get(id)
                    .is_none_or(|paused| paused.as_deref() != Some(m.key.as_str()))
            });
            if unnamed && m.last_modified < older_than {
                swept.manifests.push(m.key);
            } else {
                read.push(m.key);
            }
        }
        let mut referenced = self.referenced(read).await?;
        for key in &swept.manifests {
            check(lost)?;
            self.store.delete(key).await?;
        }
        let mut doomed = Vec::new();
        for c in chunks {
            let digest = &c.key[CHUNKS.len()..];
            if referenced.remove(digest) {
                swept.kept += 1;
                swept.kept_bytes += c.size;
            } else if c.last_modified >= older_than {
                swept.young += 1;
                swept.kept += 1;
                swept.kept_bytes += c.size;
            } else {
                doomed.push(c);
            }
        }
        if !referenced.is_empty() {
            tracing::warn!(
                "store gc: {} chunks that manifests name are not in the store (e.g. {})",
                referenced.len(),
                referenced.first().map(String::as_str).unwrap_or_default()
            );
        }
        let mut tasks: JoinSet<Result<u64, ObjectError>> = JoinSet::new();
        for c in doomed {
            while tasks.len() >= PARALLEL {
                if let Some(done) = tasks.join_next().await {
                    swept.bytes += done??;
                    swept.chunks += 1;
                }
            }
            check(lost)?;
            let store = self.store.clone();
            tasks.spawn(async move { store.delete(&c.key).await.map(|()| c.size) });
        }
        while let Some(done) = tasks.join_next().await {
            swept.bytes += done??;
            swept.chunks += 1;
        }
        Ok(swept)
    }

    /// Every chunk digest the manifests under `keys` name.
    async fn referenced(&self, keys: Vec<String>) -> Result<BTreeSet<String>, GcError> {
        let mut names = BTreeSet::new();
        let mut tasks: JoinSet<Result<Vec<String>, GcError>> = JoinSet::new();
        let mut keys = keys.into_iter();
        loop {
            while tasks.len() < PARALLEL
                && let Some(key) = keys.next()
            {
                let store = self.store.clone();
                tasks.spawn(async move { read_names(&store, key).await });
            }
            match tasks.join_next().await {
                Some(done) => names.extend(done??),
                None => return Ok(names),
            }
        }
    }
}

/// The chunk digests the manifest at `key` names: every string in it that
/// is a sha256 in hex, wherever it stands (so a manifest of a kind this
/// collector does not know still keeps its chunks). One gone since the
/// listing names none.
async fn read_names(store: &ObjectStore, key: String) -> Result<Vec<String>, GcError> {
    let Some(bytes) = store.get(&key).await? else {
        return Ok(Vec::new());
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| GcError::Manifest {
            key: key.clone(),
            reason: format!("not JSON: {e}"),
        })?;
    let mut names = Vec::new();
    let mut stack = vec![&value];
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::String(s) if is_digest(s) => names.push(s.clone()),
            serde_json::Value::Array(a) => stack.extend(a),
            serde_json::Value::Object(o) => stack.extend(o.values()),
            _ => {}
        }
    }
    Ok(names)
}

fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn check(lost: &AtomicBool) -> Result<(), GcError> {
    if lost.load(Ordering::Relaxed) {
        return Err(GcError::LeaseLost);
    }
    Ok(())
}

/// Refreshes the pass's lease three times per TTL; sets `lost` when it
/// cannot (the pass stops deleting: another may have started).
async fn keep_lease(mut client: etcd_client::Client, lease: i64, lost: Arc<AtomicBool>) {
    let every = Duration::from_secs((PASS_TTL_SECS / 3) as u64);
    let kept = async {
        let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
        loop {
            keeper.keep_alive().await?;
            match stream.message().await? {
                Some(r) if r.ttl() > 0 => {}
                _ => return Ok::<(), etcd_client::Error>(()),
            }
            tokio::time::sleep(every).await;
        }
    };
    if let Err(e) = kept.await {
        tracing::warn!("store gc: keeping the pass's lease {lease:x}: {e}");
    }
    lost.store(true, Ordering::Relaxed);
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_manifest_keys_name_their_sandbox_and_digests_are_told_apart() {
        let key = pause_manifest_key("iabc", 3);
        assert_eq!(key, "sandboxes/iabc/3.json");
        assert_eq!(paused_sandbox(&key), Some("iabc"));
        for other in [
            "templates/iabc.json",
            "sandboxes/iabc/x.json",
            "sandboxes//3.json",
            "sandboxes/iabc/3",
            "chunks/00",
        ] {
            assert_eq!(paused_sandbox(other), None, "{other}");
        }
        assert!(is_digest(&"0a".repeat(32)));
        assert!(!is_digest(&"0A".repeat(32)));
        assert!(!is_digest(&"0a".repeat(31)));
    }
}
