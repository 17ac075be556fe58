//! Durable pauses: a node of a cluster with an object store writes each
//! paused sandbox there (its record, VMM state, memory files and disk
//! layers), so that any node can resume it once its own is gone.
//!
//! Files go in content-addressed ([`sandfork_cluster::files`]): what many pauses
//! share (a template's memory and sealed layers, earlier pauses' memory)
//! is stored once, and a node remembers what it sent (by path, size and
//! modification time) so it does not read it again. The pause's
//! description, a [`Manifest`], goes under `sandboxes/<id>/<generation>.json`.
//!
//! A node taking a sandbox in fetches what it lacks: shared files into
//! `<data dir>/cluster-cache/<content digest>` (kept for the next sandbox
//! of the same template), the sandbox's own writable disk layer and state
//! into its directory. The copies name where they landed: each layer's
//! parent path is set to the copy below it (the raw image at the bottom is
//! the node's own, which must be the same image), and the state's memory
//! files to the cached copies.
//!
//! The object store's collector ([`sandfork_cluster::store_gc`]) deletes chunks no
//! manifest names: an upload that met one of its passes (it may have
//! deleted a chunk the upload found stored and did not send) checks its
//! chunks again once the pass is over, before its manifest is named
//! anywhere, and what the node remembers having sent holds only within the
//! collector's epoch it was sent in.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sandfork_cluster::files::{self, FileError, StoredFile};
use sandfork_cluster::{Cluster, DurablePause, GcEpoch, ObjectStore};
use serde::{Deserialize, Serialize};

use super::cache;
use super::guest_files::{GuestFiles, Known};
use crate::node::sandbox::{
    GuestPaths, Manager, PausedFiles, ROOT_LAYER, SandboxError, adopted_record,
};
use crate::node::store::SandboxRecord;

const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    #[error(transparent)]
    Files(#[from] FileError),
    #[error(transparent)]
    Store(#[from] sandfork_cluster::objects::ObjectError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error("recording it in the cluster: {0}")]
    Record(#[from] sandfork_cluster::ClusterError),
    #[error("the pause {0} is not in the object store")]
    NoManifest(String),
    #[error("a collection of the object store is still under way after {0:?}")]
    Collecting(Duration),
    #[error("{0}")]
    Incompatible(String),
    /// Booted under another CPU template than this node's (see [`super::cpu`]).
    #[error("{0}")]
    CpuTemplate(String),
    #[error("{what} {}: {reason}", path.display())]
    Relocate {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
}

/// A paused sandbox as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    /// The node that paused it.
    pub node_id: String,
    pub record: SandboxRecord,
    /// Its disk's top layer is its own writable one.
    #[serde(flatten)]
    pub files: GuestFiles,
}

pub fn manifest_key(id: &str, generation: u32) -> String {
    sandfork_cluster::store_gc::pause_manifest_key(id, generation)
}

/// How long an upload that met a pass of the store's collector waits for it
/// to end before it fails (it is tried again later, as a store that fails).
const COLLECTING_LIMIT: Duration = Duration::from_secs(600);

/// What the node remembers having sent of a file: its description, and the
/// collector's epoch it was sent (or found stored) in, None if a pass was
/// under way then (never trusted again).
type SentFile = (StoredFile, Option<i64>);

/// The epoch an upload may trust what was sent in: None while a pass is
/// under way.
fn trusted(epoch: GcEpoch) -> Option<i64> {
    (!epoch.under_way).then_some(epoch.last_pass)
}

#[derive(Debug)]
pub struct Durable {
    store: ObjectStore,
    node_id: String,
    cache_dir: PathBuf,
    /// Immutable files (memory files, sealed layers) already stored.
    sent: Known<SentFile>,
    /// The cluster's etcd, where the store's collector keeps its epoch;
    /// None: no collector runs on this store (tests).
    fence: Option<Cluster>,
    /// One cache fill at a time (two takes of one template share files).
    filling: tokio::sync::Mutex<()>,
    /// Templates being taken in ([`super::templates`]).
    takes: crate::node::keyed::KeyedLocks,
}

impl Durable {
    /// Fetched shared files go to `cache_dir`.
    pub fn new(store: ObjectStore, node_id: &str, cache_dir: PathBuf) -> Durable {
        Durable {
            store,
            node_id: node_id.to_owned(),
            cache_dir,
            sent: Known::default(),
            fence: None,
            filling: tokio::sync::Mutex::new(()),
            takes: Default::default(),
        }
    }

    /// Uploads follow the store collector's epoch in `cluster`.
    pub fn with_fence(mut self, cluster: Cluster) -> Durable {
        self.fence = Some(cluster);
        self
    }

    /// The collector's epoch as an upload starts (None without a fence).
    pub(super) async fn epoch(&self) -> Result<Option<GcEpoch>, DurableError> {
        match &self.fence {
            Some(c) => Ok(Some(c.store_gc_epoch().await?)),
            None => Ok(None),
        }
    }

    /// After an upload that started at `start` wrote its manifest: None if
    /// it met no pass of the collector; else the epoch once that pass is
    /// over, for the upload to check its chunks again in (sending what the
    /// pass deleted).
    pub(super) async fn met_a_pass(
        &self,
        start: Option<GcEpoch>,
    ) -> Result<Option<GcEpoch>, DurableError> {
        let (Some(fence), Some(start)) = (&self.fence, start) else {
            return Ok(None);
        };
        if !start.met_a_pass(&fence.store_gc_epoch().await?) {
            return Ok(None);
        }
        let settled = fence.store_gc_settled(COLLECTING_LIMIT).await?;
        if settled.under_way {
            return Err(DurableError::Collecting(COLLECTING_LIMIT));
        }
        Ok(Some(settled))
    }

    pub fn store(&self) -> &ObjectStore {
        &self.store
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    pub(super) fn takes(&self) -> &crate::node::keyed::KeyedLocks {
        &self.takes
    }

    /// Stores paused sandbox `id`, then has `record` note the stored pause
    /// in its route, all while the sandbox is held paused (a resume waits):
    /// no resume can come between the two and leave a running sandbox's
    /// route naming a stored pause another node could take in. Returns what
    /// `record` answered (false: the route is not this node's).
    pub async fn store_pause(
        &self,
        manager: &Manager,
        id: &str,
        record: impl AsyncFnOnce(DurablePause) -> Result<bool, sandfork_cluster::ClusterError>,
    ) -> Result<bool, DurableError> {
        manager
            .with_paused_files(id, async |files: &PausedFiles| {
                let pause = self.store_paused(id, files).await?;
                Ok(record(pause).await?)
            })
            .await?
    }

    async fn store_paused(
        &self,
        id: &str,
        files: &PausedFiles,
    ) -> Result<DurablePause, DurableError> {
        let started = Instant::now();
        let mut epoch = self.epoch().await?;
        let (manifest, sent) = self.store_files(files, epoch).await?;
        let pause = DurablePause {
            manifest: manifest_key(id, manifest.record.pause_generation),
            generation: manifest.record.pause_generation,
            cpu_template: manifest.record.cpu_template.clone(),
        };
        files::put_json(&self.store, &pause.manifest, &manifest).await?;
        // Before the route names it: its chunks are all there.
        while let Some(settled) = self.met_a_pass(epoch).await? {
            tracing::info!(
                "cluster: sandbox {id}: the pause met a collection; checking its chunks"
            );
            let (again, _) = self.store_files(files, Some(settled)).await?;
            if again.files != manifest.files {
                return Err(DurableError::Incompatible(format!(
                    "sandbox {id}'s files changed while they were stored"
                )));
            }
            epoch = Some(settled);
        }
        tracing::info!(
            "cluster: sandbox {id}: pause {} stored in {:.1} s ({} chunks, {} MiB sent)",
            pause.generation,
            started.elapsed().as_secs_f64(),
            sent.chunks,
            sent.bytes >> 20
        );
        Ok(pause)
    }

    async fn store_files(
        &self,
        files: &PausedFiles,
        epoch: Option<GcEpoch>,
    ) -> Result<(Manifest, files::Sent), DurableError> {
        // Its own top layer changes with every run.
        let (guest, sent) = self.store_guest(&files.guest, true, epoch).await?;
        let manifest = Manifest {
            version: MANIFEST_VERSION,
            node_id: self.node_id.clone(),
            record: files.record.clone(),
            files: guest,
        };
        Ok((manifest, sent))
    }

    /// Stores a frozen guest's files: each memory file and sealed layer
    /// once per node (see [`Known`]), the state and, when `own_top`, the
    /// top layer (a paused sandbox's own, which changes) every time.
    /// `epoch`: the collector's as the upload started.
    pub(super) async fn store_guest(
        &self,
        guest: &GuestPaths,
        own_top: bool,
        epoch: Option<GcEpoch>,
    ) -> Result<(GuestFiles, files::Sent), DurableError> {
        let mut total = files::Sent::default();
        let mut add = |s: files::Sent| {
            total.chunks += s.chunks;
            total.bytes += s.bytes;
        };
        let state = match &guest.state {
            Some(p) => {
                let (stored, sent) = files::upload(&self.store, p).await?;
                add(sent);
                Some(stored)
            }
            None => None,
        };
        let mut memory = Vec::new();
        for (p, ranges) in &guest.memory {
            let (stored, sent) = self.upload_immutable(p, ranges.as_deref(), epoch).await?;
            add(sent);
            memory.push(stored);
        }
        let mut disk = Vec::new();
        for (i, p) in guest.disk.iter().enumerate() {
            let used = disk_layers::used_ranges(p).map_err(|e| DurableError::Relocate {
                what: "reading the layer",
                path: p.clone(),
                reason: e.to_string(),
            })?;
            let (stored, sent) = if i == 0 && own_top {
                files::upload_ranges(&self.store, p, Some(&used)).await?
            } else {
                self.upload_immutable(p, Some(&used), epoch).await?
            };
            add(sent);
            disk.push(stored);
        }
        let files = GuestFiles {
            state,
            memory,
            disk,
            raw_base_size: guest.raw_base.as_ref().map(|(_, size)| *size),
        };
        Ok((files, total))
    }

    /// Uploads a file that does not change once written, unless this node
    /// stored it before (same path, size and modification time) in the
    /// collector's `epoch` (a pass since may have deleted its chunks).
    pub(super) async fn upload_immutable(
        &self,
        path: &Path,
        used: Option<&[(u64, u64)]>,
        epoch: Option<GcEpoch>,
    ) -> Result<(StoredFile, files::Sent), DurableError> {
        let mut sent = files::Sent::default();
        let now = epoch.and_then(trusted);
        let fenced = self.fence.is_some();
        let (stored, _) = self
            .sent
            .get_or_make_if(
                path,
                |(_, then)| !fenced || (then.is_some() && *then == now),
                async || {
                    let (stored, s) = files::upload_ranges(&self.store, path, used).await?;
                    sent = s;
                    Ok::<_, DurableError>((stored, now))
                },
            )
            .await?;
        Ok((stored, sent))
    }

    /// Takes in the paused sandbox `id` that `pause` describes: its files
    /// fetched and made to name their new places, its record kept paused.
    pub async fn take_in(
        &self,
        manager: &Manager,
        id: &str,
        pause: &DurablePause,
    ) -> Result<SandboxRecord, DurableError> {
        let started = Instant::now();
        let manifest: Manifest = files::get_json(&self.store, &pause.manifest)
            .await?
            .ok_or_else(|| DurableError::NoManifest(pause.manifest.clone()))?;
        if manifest.version != MANIFEST_VERSION || manifest.record.id != id {
            return Err(DurableError::Incompatible(format!(
                "{} is not a version {MANIFEST_VERSION} pause of sandbox {id}",
                pause.manifest
            )));
        }
        super::cpu::check_here(
            manager,
            &format!("sandbox {id}"),
            manifest.record.cpu_template.as_deref(),
        )?;
        let rootfs = manager.config().rootfs.clone();
        cache::same_raw_base(
            &rootfs,
            manifest.files.raw_base_size,
            &format!("sandbox {id}"),
        )?;
        std::fs::create_dir_all(&self.cache_dir).map_err(|e| FileError::Io {
            what: "creating",
            path: self.cache_dir.clone(),
            source: e,
        })?;
        let mut failure = None;
        let record = manager
            .adopt_paused(id, async |dir: &Path| {
                match self.place(&manifest, dir, &rootfs).await {
                    Ok(r) => Ok(r),
                    Err(e) => {
                        let shown = e.to_string();
                        failure = Some(e);
                        Err(SandboxError::Unavailable(shown))
                    }
                }
            })
            .await;
        let record = match (record, failure) {
            (Ok(r), _) => r,
            (Err(_), Some(e)) => return Err(e),
            (Err(e), None) => return Err(e.into()),
        };
        tracing::info!(
            "cluster: sandbox {id}: taken in from node {} (pause {}) in {:.1} s",
            manifest.node_id,
            pause.generation,
            started.elapsed().as_secs_f64()
        );
        Ok(record)
    }

    /// Writes the sandbox's files: shared ones into the cache, its own
    /// into `dir`; returns its record for this node.
    async fn place(
        &self,
        manifest: &Manifest,
        dir: &Path,
        rootfs: &Path,
    ) -> Result<SandboxRecord, DurableError> {
        let _filling = self.filling.lock().await;
        let guest = &manifest.files;
        // Its own layer into its directory, on the sealed ones' copies.
        let parent = guest
            .cache_layers(1, &self.cache_dir, &self.store, rootfs)
            .await?;
        let top = guest
            .disk
            .first()
            .ok_or_else(|| DurableError::Incompatible("the pause has no disk".into()))?;
        let root = dir.join(ROOT_LAYER);
        files::download(&self.store, top, &root).await?;
        cache::set_parent(&root, &parent)?;
        let generation = manifest.record.pause_generation;
        let state = dir.join(format!("pause-{generation}.state"));
        let state = guest
            .place_state(&self.cache_dir, &self.store, &state)
            .await?
            .map(|top_memory| (state, top_memory));
        Ok(adopted_record(manifest.record.clone(), dir, state))
    }
}
