//! Templates and snapshots in the object store: a node of a cluster with one
//! stores each template a build makes ready and each snapshot taken through
//! the API, its files content-addressed as a durable pause's
//! ([`super::guest_files`]: memory files and sealed layers once per node)
//! and described by a [`TemplateManifest`] under `templates/<id>.json`,
//! written last, so no node finds a template whose files are not all
//! stored. A node asked for a template it lacks takes it in from there:
//! its layers and memory files into the cluster cache (each layer naming
//! the copy below it, the raw image at the bottom this node's own unless
//! the template brought its own), its state into `templates/<id>/` naming
//! the cached memory, its record and owning team registered.
//!
//! Its names (a build's alias and tags, a snapshot's name) point at it
//! through `template-names/<name>.json`, written after its manifest, so a
//! node takes a template in by a name as well as by its id. A node's names
//! are one namespace, as on one node: the last template stored under a name
//! holds it (a rebuild's), and a template stored again (its tags changed)
//! lets go of the names it no longer has.
//!
//! A template converted from a registry image for a create (its record's
//! `image`, a normalised reference, which no name key may hold) is found by
//! that image through `template-images/<sha256 of the reference>.json`,
//! written after its manifest, so a node asked for the image takes its
//! template in instead of pulling and converting it again
//! ([`super::images`]); and by the image's manifest digest through
//! `template-image-digests/<hex>.json`, so a node asked for another tag of
//! the same image, which only the registry can tell it is, takes that
//! template in too.
//!
//! Deleting a template removes its manifest and the names pointing at it;
//! the store's collector ([`sandfork_cluster::store_gc`]) deletes its chunks that
//! nothing else names.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use sandfork_cluster::files::{self, StoredFile};
use serde::{Deserialize, Serialize};

use super::durable::{Durable, DurableError};
use super::guest_files::GuestFiles;
use super::{Node, cache};
use crate::node::events::Denial;
use crate::node::sandbox::{Manager, SandboxError};
use crate::node::store::TemplateRecord;
use crate::node::tenants::{Caller, template_owner_key};

const MANIFEST_VERSION: u32 = 1;
/// The state file of a taken-in template, in its directory.
const STATE: &str = "vm.state";

pub fn manifest_key(id: &str) -> String {
    format!("templates/{id}.json")
}

/// Where name `name` points, if it may name a key: what template names and
/// tags are made of (letters, digits, `-`, `_`, `.`, `:`), so no request
/// bends a key.
fn name_key(name: &str) -> Option<String> {
    let ok = !name.is_empty()
        && name.len() <= 256
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    ok.then(|| format!("template-names/{name}.json"))
}

/// Where the template of registry image `image` (a normalised reference)
/// is found: its SHA-256, so any reference names one key.
fn image_key(image: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(image.as_bytes());
    format!("template-images/{}.json", crate::node::ids::hex(&digest))
}

/// Where an image template of manifest digest `digest` is found, if it is
/// a sha256 digest.
fn image_digest_key(digest: &str) -> Option<String> {
    let hex = digest.strip_prefix("sha256:")?;
    let ok = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| format!("template-image-digests/{hex}.json"))
}

/// What a name points at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct NameEntry {
    id: String,
    /// The template's team (None: the default team), so a node refuses
    /// another team's name without reading its manifest.
    team: Option<String>,
}

/// A template (or snapshot) as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateManifest {
    pub version: u32,
    /// The node that made it.
    pub node_id: String,
    /// Its record there (its paths are that node's: none is used here).
    pub record: TemplateRecord,
    /// The team that owns it (None: the default team).
    pub team: Option<String>,
    /// Its disk's top layer is the sealed one every sandbox stacks on.
    #[serde(flatten)]
    pub files: GuestFiles,
    /// The raw image below its layers when that is not the node's root
    /// image (an image build's own); None: the node's.
    #[serde(default)]
    pub raw_base: Option<StoredFile>,
}

/// Whether `id` may name a stored template: what builds and snapshots
/// make (letters, digits, `-`, `_`, `.`), so no request bends a key.
fn storable_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// Whether `a` and `b` are one file (the raw image a template stacks on,
/// and the node's).
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

impl Durable {
    /// Stores template `id` of `manager`'s: its files, then its manifest.
    /// One deleted meanwhile loses its manifest again.
    pub async fn store_template(&self, manager: &Manager, id: &str) -> Result<(), DurableError> {
        let started = Instant::now();
        let db = manager.store();
        let record = db
            .template(id)
            .map_err(SandboxError::from)?
            .ok_or_else(|| SandboxError::TemplateNotFound(id.to_owned()))?;
        // Its sealed volume layers stack on this node's volumes: another
        // node taking it in would have the layers' names and not the files.
        if !record.volume_mounts.is_empty() {
            return Err(SandboxError::Invalid(format!(
                "snapshot {id} keeps volumes, which are this node's"
            ))
            .into());
        }
        let team = db
            .owner(&template_owner_key(id))
            .map_err(SandboxError::from)?;
        let guest = manager.template_files(&record).await?;
        let rootfs = &manager.config().rootfs;
        let mut epoch = self.epoch().await?;
        let (stored, raw_base, sent) = self.store_template_files(&guest, rootfs, epoch).await?;
        let manifest = TemplateManifest {
            version: MANIFEST_VERSION,
            node_id: self.node_id().to_owned(),
            record,
            team,
            files: stored,
            raw_base,
        };
        let key = manifest_key(id);
        let before = files::get_json::<TemplateManifest>(self.store(), &key).await?;
        files::put_json(self.store(), &key, &manifest).await?;
        // A take-in that comes meanwhile may miss a chunk (and answers 503).
        while let Some(settled) = self.met_a_pass(epoch).await? {
            tracing::info!(
                "cluster: template {id}: the store met a collection; checking its chunks"
            );
            let (again, raw_again, _) = self
                .store_template_files(&guest, rootfs, Some(settled))
                .await?;
            if again != manifest.files || raw_again != manifest.raw_base {
                return Err(DurableError::Incompatible(format!(
                    "template {id}'s files changed while they were stored"
                )));
            }
            epoch = Some(settled);
        }
        let entry = NameEntry {
            id: id.to_owned(),
            team: manifest.team.clone(),
        };
        for name in &manifest.record.names {
            if let Some(name_key) = name_key(name) {
                files::put_json(self.store(), &name_key, &entry).await?;
            }
        }
        for image in manifest.record.image_references() {
            files::put_json(self.store(), &image_key(image), &entry).await?;
        }
        if let Some(key) = manifest
            .record
            .image_digest
            .as_deref()
            .and_then(image_digest_key)
        {
            files::put_json(self.store(), &key, &entry).await?;
        }
        let dropped = before.map(|b| b.record.names).unwrap_or_default();
        let dropped: Vec<_> = dropped
            .into_iter()
            .filter(|n| !manifest.record.names.contains(n))
            .collect();
        self.let_go_of_names(id, &dropped).await?;
        if db.template(id).ok().flatten().is_none() {
            self.forget_template(id).await?;
            tracing::info!("cluster: template {id} was deleted while it was stored");
            return Ok(());
        }
        tracing::info!(
            "cluster: template {id} stored in {:.1} s ({} chunks, {} MiB sent)",
            started.elapsed().as_secs_f64(),
            sent.chunks,
            sent.bytes >> 20
        );
        Ok(())
    }

    /// A template's files (and its raw image when it is not the node's
    /// `rootfs`) stored.
    async fn store_template_files(
        &self,
        guest: &crate::node::sandbox::GuestPaths,
        rootfs: &Path,
        epoch: Option<sandfork_cluster::GcEpoch>,
    ) -> Result<(GuestFiles, Option<StoredFile>, files::Sent), DurableError> {
        let (stored, mut sent) = self.store_guest(guest, false, epoch).await?;
        let raw_base = match &guest.raw_base {
            Some((path, _)) if !same_file(path, rootfs) => {
                let (image, s) = self.upload_immutable(path, None, epoch).await?;
                sent.chunks += s.chunks;
                sent.bytes += s.bytes;
                Some(image)
            }
            _ => None,
        };
        Ok((stored, raw_base, sent))
    }

    /// Template `id_or_name` (an id or one of its names, either with E2B's
    /// `:default`), taken in from the object store when this node lacks
    /// it: None when the store has none or `may_use` refuses its team
    /// (nothing is fetched then). Concurrent takes of one template fetch it
    /// once.
    pub async fn take_in_template(
        &self,
        manager: &Manager,
        id_or_name: &str,
        may_use: impl Fn(Option<&str>) -> bool,
    ) -> Result<Option<TemplateRecord>, DurableError> {
        let wanted = crate::node::ids::without_default_tag(id_or_name);
        if storable_id(wanted)
            && let Some(t) = self.take_in_one(manager, wanted, &may_use).await?
        {
            return Ok(Some(t));
        }
        let Some(key) = name_key(wanted) else {
            return Ok(None);
        };
        let Some(mut t) = self.take_in_indexed(manager, &key, &may_use).await? else {
            return Ok(None);
        };
        // Its manifest may predate the name (its index gave it since), or it
        // was here already under other names: it answers to this one too,
        // which no template here has.
        if !t.names.iter().any(|n| n == wanted) && manager.resolve_template(wanted).is_err() {
            t.names.push(wanted.to_owned());
            manager
                .store()
                .put_template(&t)
                .map_err(SandboxError::from)?;
        }
        Ok(Some(t))
    }

    /// The template of registry image `image` (a normalised reference)
    /// that a node converted and stored, taken in from the object store:
    /// None when the store has none or `may_use` refuses its team (nothing
    /// is fetched then).
    pub async fn take_in_image(
        &self,
        manager: &Manager,
        image: &str,
        may_use: impl Fn(Option<&str>) -> bool,
    ) -> Result<Option<TemplateRecord>, DurableError> {
        self.take_in_indexed(manager, &image_key(image), &may_use)
            .await
    }

    /// The template of the registry image whose manifest digest is
    /// `digest` (whichever reference it was converted by), taken in from
    /// the object store: None as [`Durable::take_in_image`].
    pub async fn take_in_image_digest(
        &self,
        manager: &Manager,
        digest: &str,
        may_use: impl Fn(Option<&str>) -> bool,
    ) -> Result<Option<TemplateRecord>, DurableError> {
        let Some(key) = image_digest_key(digest) else {
            return Ok(None);
        };
        self.take_in_indexed(manager, &key, &may_use).await
    }

    /// The template an index entry at `key` (a name's or an image's) names,
    /// taken in: None when there is no entry or `may_use` refuses its team.
    async fn take_in_indexed(
        &self,
        manager: &Manager,
        key: &str,
        may_use: &impl Fn(Option<&str>) -> bool,
    ) -> Result<Option<TemplateRecord>, DurableError> {
        let Some(entry) = files::get_json::<NameEntry>(self.store(), key).await? else {
            return Ok(None);
        };
        if !storable_id(&entry.id) || !may_use(entry.team.as_deref()) {
            return Ok(None);
        }
        self.take_in_one(manager, &entry.id, may_use).await
    }

    /// Template `id` taken in, once at a time.
    async fn take_in_one(
        &self,
        manager: &Manager,
        id: &str,
        may_use: &impl Fn(Option<&str>) -> bool,
    ) -> Result<Option<TemplateRecord>, DurableError> {
        let _one = self.takes().lock(id).await;
        self.take_in_alone(manager, id, may_use).await
    }

    async fn take_in_alone(
        &self,
        manager: &Manager,
        id: &str,
        may_use: &impl Fn(Option<&str>) -> bool,
    ) -> Result<Option<TemplateRecord>, DurableError> {
        // Taken by the take this one waited for.
        if let Some(t) = manager.store().template(id).map_err(SandboxError::from)? {
            return Ok(Some(t));
        }
        let key = manifest_key(id);
        let Some(manifest) = files::get_json::<TemplateManifest>(self.store(), &key).await? else {
            return Ok(None);
        };
        if manifest.version != MANIFEST_VERSION || manifest.record.id != id {
            return Err(DurableError::Incompatible(format!(
                "{key} is not a version {MANIFEST_VERSION} manifest of template {id}"
            )));
        }
        if !may_use(manifest.team.as_deref()) {
            return Ok(None);
        }
        super::cpu::check_here(
            manager,
            &format!("template {id}"),
            manifest.record.cpu_template.as_deref(),
        )?;
        let started = Instant::now();
        let cache_dir = manager.config().cluster_cache_dir();
        let rootfs = match &manifest.raw_base {
            Some(stored) => cache::cached(&cache_dir, self.store(), stored, None).await?,
            None => {
                let rootfs = manager.config().rootfs.clone();
                let what = format!("template {id}");
                cache::same_raw_base(&rootfs, manifest.files.raw_base_size, &what)?;
                rootfs
            }
        };
        let kernel = manager.template().kernel.clone();
        let names = names_here(manager, &manifest.record.names)?;
        let record = manager
            .adopt_template(id, manifest.team.as_deref(), async |dir: &Path| {
                let state = dir.join(STATE);
                let (sealed, mem) = manifest
                    .files
                    .place_sealed(&cache_dir, self.store(), &rootfs, &state)
                    .await?;
                // What it stacks on is in the cache now, not in other
                // snapshots' or sandboxes' directories.
                Ok::<_, DurableError>(TemplateRecord {
                    dir: dir.to_owned(),
                    snapshot: state,
                    mem,
                    root_layer: sealed,
                    kernel,
                    rootfs: rootfs.clone(),
                    uses_snapshots: Vec::new(),
                    uses_dirs: Vec::new(),
                    names: names.clone(),
                    ..manifest.record.clone()
                })
            })
            .await?;
        tracing::info!(
            "cluster: template {id} taken in from node {} (through the object store) in {:.1} s",
            manifest.node_id,
            started.elapsed().as_secs_f64()
        );
        Ok(Some(record))
    }

    /// Removes template `id`'s manifest and the names pointing at it (the
    /// store's collector deletes its chunks that nothing else names).
    pub async fn forget_template(&self, id: &str) -> Result<(), DurableError> {
        if !storable_id(id) {
            return Ok(());
        }
        let key = manifest_key(id);
        if let Some(manifest) = files::get_json::<TemplateManifest>(self.store(), &key).await? {
            self.let_go_of_names(id, &manifest.record.names).await?;
            for image in manifest.record.image_references() {
                self.let_go_of_key(id, &image_key(image)).await?;
            }
            if let Some(key) = manifest
                .record
                .image_digest
                .as_deref()
                .and_then(image_digest_key)
            {
                self.let_go_of_key(id, &key).await?;
            }
        }
        self.store().delete(&key).await?;
        Ok(())
    }

    /// Removes those of `names` that point at template `id` (a name another
    /// template took since points there and stays).
    async fn let_go_of_names(&self, id: &str, names: &[String]) -> Result<(), DurableError> {
        for name in names {
            if let Some(key) = name_key(name) {
                self.let_go_of_key(id, &key).await?;
            }
        }
        Ok(())
    }

    /// Removes the name or image entry at `key` if it points at template `id`.
    async fn let_go_of_key(&self, id: &str, key: &str) -> Result<(), DurableError> {
        let entry = files::get_json::<NameEntry>(self.store(), key).await?;
        if entry.is_some_and(|e| e.id == id) {
            self.store().delete(key).await?;
        }
        Ok(())
    }

    /// The team owning stored template `id` (None: the default team's), if
    /// the store has it.
    pub async fn stored_team(&self, id: &str) -> Result<Option<Option<String>>, DurableError> {
        if !storable_id(id) {
            return Ok(None);
        }
        let manifest = files::get_json::<TemplateManifest>(self.store(), &manifest_key(id)).await?;
        Ok(manifest.map(|m| m.team))
    }
}

/// The names a template taken in keeps on this node: its own but those a
/// template here has (the node's names are one namespace, and the one here
/// was there first).
fn names_here(manager: &Manager, names: &[String]) -> Result<Vec<String>, SandboxError> {
    let taken: std::collections::HashSet<String> = manager
        .store()
        .templates()?
        .into_iter()
        .flat_map(|t| t.names)
        .collect();
    Ok(names
        .iter()
        .filter(|n| !taken.contains(*n))
        .cloned()
        .collect())
}

fn unavailable(id: &str, e: impl std::fmt::Display) -> Denial {
    Denial::Unavailable(format!("template {id}: the object store: {e}"))
}

impl Node {
    /// Before a request that uses template `id_or_name` (a create, a
    /// snapshot's fork): on a node of a cluster with an object store that
    /// lacks it, the template is taken in from there (by its id or a name)
    /// if the caller's team owns it. Otherwise nothing happens: the handler
    /// answers as before (404 for one no node stored, or another team's).
    pub async fn take_in_template_for(
        &self,
        caller: &Caller,
        id_or_name: &str,
    ) -> Result<(), Denial> {
        if self.manager.resolve_template(id_or_name).is_ok() {
            return Ok(());
        }
        let Some(durable) = &self.durable else {
            return Ok(());
        };
        durable
            .take_in_template(&self.manager, id_or_name, |team| caller.owns(team))
            .await
            .map_err(|e| unavailable(id_or_name, format!("taking it in: {e}")))?;
        // The next create of it is placed here.
        self.publish_templates();
        Ok(())
    }

    /// A delete of template `id` that this node does not have: removed from
    /// the object store if it is there and the caller's team's (true).
    pub async fn delete_stored_template(&self, caller: &Caller, id: &str) -> Result<bool, Denial> {
        let Some(durable) = &self.durable else {
            return Ok(false);
        };
        let id = crate::node::ids::without_default_tag(id);
        match durable.stored_team(id).await {
            Ok(Some(team)) if caller.owns(team.as_deref()) => {}
            Ok(_) => return Ok(false),
            Err(e) => return Err(unavailable(id, e)),
        }
        durable
            .forget_template(id)
            .await
            .map_err(|e| unavailable(id, e))?;
        tracing::info!("cluster: template {id}: deleted from the object store (no copy here)");
        Ok(true)
    }
}

impl Node {
    /// Stores template `id` (a build made it ready, or a snapshot was
    /// taken) in the object store, if the cluster has one, in the
    /// background: a failure is a warning, and the template stays on this
    /// node only (a gateway still finds it here).
    pub fn store_template_in_background(self: &Arc<Self>, id: String) {
        // Gateways send requests about it here first once they see it.
        self.publish_templates();
        if self.durable.is_none() {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let Some(durable) = &node.durable else {
                return;
            };
            let record = node.manager.store().template(&id).ok().flatten();
            if let Err(e) = durable.store_template(&node.manager, &id).await {
                tracing::warn!(
                    "cluster: template {id} is not in the object store ({e}); it stays on this \
                     node only"
                );
            }
            // An image's conversion claimed here ends with its store, stored
            // or not: nodes waiting for it take it in, or convert it
            // themselves. A second tag of an image here was given its
            // template: that tag's claim ends too.
            for image in record.iter().flat_map(|t| t.image_references()) {
                node.release_image(image).await;
            }
        });
    }

    /// After templates `ids` were deleted here: their manifests go too.
    pub async fn forget_templates(&self, ids: &[String]) {
        self.publish_templates();
        let Some(durable) = &self.durable else {
            return;
        };
        for id in ids {
            if let Err(e) = durable.forget_template(id).await {
                tracing::warn!("cluster: template {id}: removing it from the object store: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use std::collections::BTreeSet;

    use disk_layers::LayeredDisk;
    use sandfork_cluster::ObjectStore;
    use sandfork_cluster::harness::SeaweedFs;

    use super::*;
    use crate::node::store::Store;

    const TEAM: &str = "team_0123456789abcdef";

    /// A node's manager on `data`, whose root image is `rootfs` (no VMM
    /// runs: the files are only stored and placed).
    fn manager(data: &Path, rootfs: &Path) -> Arc<Manager> {
        let config = crate::node::sandbox::tests::offline_config(data, rootfs.to_owned());
        std::fs::create_dir_all(data).unwrap();
        let store = Store::open(&data.join("s.redb")).unwrap();
        crate::node::sandbox::tests::with_store(config, store)
    }

    /// A raw image of 8 MiB with data at its start and end.
    fn raw_image(path: &Path, fill: u8) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let f = std::fs::File::create(path).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[fill; 4096], 0).unwrap();
        f.write_all_at(&[fill; 4096], (8 << 20) - 4096).unwrap();
    }

    /// A file of `len` bytes of `fill`.
    fn filled(path: &Path, len: usize, fill: u8) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, vec![fill; len]).unwrap();
    }

    /// Template `id` on the node of `manager`, as a snapshot leaves one:
    /// its state mapping the base template's memory and its own, its
    /// sealed root layer in `layers_dir` over another sealed one over
    /// `raw`, owned by `TEAM`.
    fn template_on(manager: &Manager, id: &str, raw: &Path, layers_dir: &Path) -> TemplateRecord {
        let config = manager.config();
        let dir = config.templates_dir().join(id);
        let base_mem = config.templates_dir().join("base/vm.mem");
        filled(&base_mem, 64 << 10, 0x11);
        filled(&dir.join("vm.mem"), 64 << 10, 0x22);
        let state = dir.join("vm.state");
        let mem = dir.join("vm.mem");
        let mems = [base_mem.to_str().unwrap(), mem.to_str().unwrap()];
        vmm_driver::snapshot_state::test_support::state_file(&state, &mems).unwrap();
        std::fs::create_dir_all(layers_dir).unwrap();
        let (l1, l2, l3) = (
            layers_dir.join("1.layer"),
            layers_dir.join("2.layer"),
            layers_dir.join("3.layer"),
        );
        let disk = LayeredDisk::create(raw, &l1).unwrap();
        disk.write_at(&[0xaa; 4096], 1 << 20).unwrap();
        disk.seal_and_branch(&l2, &[]).unwrap();
        disk.write_at(&[0xbb; 4096], 2 << 20).unwrap();
        disk.seal_and_branch(&l3, &[]).unwrap();
        let record = TemplateRecord {
            id: id.into(),
            snapshot: state,
            mem,
            dir,
            root_layer: l2,
            root_drive_id: "rootfs".into(),
            kernel: config.kernel.clone(),
            rootfs: raw.to_owned(),
            vcpus: 1,
            mem_mib: 128,
            disk_size_mb: 8,
            created_at_ms: 7,
            source_sandbox: Some("isource".into()),
            names: vec![format!("{id}-name")],
            uses_snapshots: vec!["iolder".into()],
            uses_dirs: vec![layers_dir.to_owned()],
            ..Default::default()
        };
        let db = manager.store();
        db.set_owner(&template_owner_key(id), Some(TEAM)).unwrap();
        db.put_template(&record).unwrap();
        record
    }

    /// The whole disk whose top layer is `top`, read through its chain.
    fn disk_bytes(top: &Path) -> Vec<u8> {
        let disk = LayeredDisk::open(top).unwrap();
        let mut buf = vec![0u8; disk.len() as usize];
        disk.read_at(&mut buf, 0).unwrap();
        buf
    }

    fn durable(weed: &SeaweedFs, node: &str, data: &Path) -> Durable {
        let store = ObjectStore::new(&weed.url, None, "us-east-1".into()).unwrap();
        Durable::new(store, node, data.join("cluster-cache"))
    }

    /// A snapshot stored by one node is taken in on another's data dir:
    /// its memory's and disk's bytes as they were, its layers' parents and
    /// its state's memory files in that node's cluster cache (in the
    /// lineage its sandboxes are handed files in), the raw image at the
    /// bottom that node's own, its record and team registered; a template
    /// on a raw image of its own (an image build's) brings that image. Two
    /// takes at once fetch it once; another team's caller is not given it,
    /// and a deleted one is gone from the store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_template_stored_by_one_node_is_taken_in_by_another() {
        let weed = SeaweedFs::start().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        // Each node's own copy of the same root image, outside its data dir.
        let (raw_a, raw_b) = (
            tmp.path().join("img-a/root.raw"),
            tmp.path().join("img-b/root.raw"),
        );
        raw_image(&raw_a, 0x5a);
        raw_image(&raw_b, 0x5a);
        let node_a = manager(&a, &raw_a);
        let node_b = manager(&b, &raw_b);
        let snap = template_on(&node_a, "isnap1", &raw_a, &a.join("sandboxes/isource"));
        // An image build's template: its raw image is its own.
        let image_raw = a.join("build-cache/img.raw");
        raw_image(&image_raw, 0x77);
        let mut image = template_on(&node_a, "image-k1", &image_raw, &a.join("sandboxes/ibuild"));
        // Converted from a registry image: found by its digest too.
        let digest = format!("sha256:{}", "ab".repeat(32));
        image.image = Some("r.example/img:v1".into());
        image.image_digest = Some(digest.clone());
        node_a.store().put_template(&image).unwrap();
        // One booted under a CPU template node b does not run.
        let mut v3 = template_on(&node_a, "iv3", &raw_a, &a.join("sandboxes/iv3"));
        v3.cpu_template = Some("x86-64-v3".into());
        node_a.store().put_template(&v3).unwrap();

        let store_a = durable(&weed, "a", &a);
        store_a.store().ensure_bucket().await.unwrap();
        store_a.store_template(&node_a, "isnap1").await.unwrap();
        store_a.store_template(&node_a, "image-k1").await.unwrap();
        store_a.store_template(&node_a, "iv3").await.unwrap();

        let store_b = durable(&weed, "b", &b);
        let others = |team: Option<&str>| team == Some("team_fedcba9876543210");
        let refused = store_b.take_in_template(&node_b, "isnap1", others).await;
        assert!(refused.unwrap().is_none());
        assert!(!b.join("templates/isnap1").exists());
        let mine = |team: Option<&str>| team == Some(TEAM);
        let missing = store_b.take_in_template(&node_b, "inothere", mine).await;
        assert!(missing.unwrap().is_none());

        // Two takes at once: one fetch, one record.
        let (one, two) = tokio::join!(
            store_b.take_in_template(&node_b, "isnap1", mine),
            store_b.take_in_template(&node_b, "isnap1:default", mine)
        );
        let taken = one.unwrap().unwrap();
        assert_eq!(two.unwrap().unwrap(), taken);
        assert_eq!(
            node_b.store().template("isnap1").unwrap(),
            Some(taken.clone())
        );
        assert_eq!(
            node_b
                .store()
                .owner(&template_owner_key("isnap1"))
                .unwrap()
                .as_deref(),
            Some(TEAM)
        );
        let cache = b.join("cluster-cache");
        assert_eq!(taken.dir, b.join("templates/isnap1"));
        assert_eq!(taken.snapshot, taken.dir.join(STATE));
        assert!(taken.uses_snapshots.is_empty() && taken.uses_dirs.is_empty());
        assert_eq!(taken.rootfs, raw_b);
        assert_eq!(
            (taken.source_sandbox.as_deref(), &taken.names[..]),
            (Some("isource"), &["isnap1-name".to_owned()][..])
        );
        // Memory: the cached copies, bytes as on node a.
        let mems = vmm_driver::snapshot_state::memory_files(&taken.snapshot).unwrap();
        let mems_a = vmm_driver::snapshot_state::memory_files(&snap.snapshot).unwrap();
        assert_eq!(mems.len(), 2);
        assert_eq!(taken.mem, mems[1]);
        for (here, there) in mems.iter().zip(&mems_a) {
            assert!(here.starts_with(&cache), "{}", here.display());
            assert_eq!(std::fs::read(here).unwrap(), std::fs::read(there).unwrap());
        }
        // Disk: the sealed layers in the cache, over node b's image.
        let chain = disk_layers::chain_files(&taken.root_layer).unwrap();
        assert_eq!(chain.len(), 3);
        assert!(chain[..2].iter().all(|l| l.starts_with(&cache)));
        assert_eq!(chain[2], raw_b);
        assert_eq!(disk_bytes(&taken.root_layer), disk_bytes(&snap.root_layer));
        // What its sandboxes' VMMs are handed lies in their lineage.
        let own = node_b.config().sandboxes_dir().join("inew");
        let lineage = node_b.lineage(&own, &[], &[], "isnap1");
        for f in mems.iter().chain(&chain[..2]).chain([&taken.snapshot]) {
            assert!(lineage.holds(f), "{}", f.display());
        }

        // The image build's template brings its image into the cache.
        let image_b = store_b
            .take_in_template(&node_b, "image-k1", mine)
            .await
            .unwrap()
            .unwrap();
        assert!(image_b.rootfs.starts_with(&cache));
        assert_eq!(
            std::fs::read(&image_b.rootfs).unwrap(),
            std::fs::read(&image_raw).unwrap()
        );
        assert_eq!(
            disk_bytes(&image_b.root_layer),
            disk_bytes(&image.root_layer)
        );

        // Booted under another CPU template: refused, by name, before any fetch.
        let other_cpu = store_b.take_in_template(&node_b, "iv3", mine).await;
        match other_cpu {
            Err(DurableError::CpuTemplate(msg)) => {
                assert!(
                    msg.contains("template iv3 was booted under CPU template x86-64-v3"),
                    "{msg}"
                )
            }
            other => panic!("expected a CPU template refusal, got {other:?}"),
        }
        assert!(!b.join("templates/iv3").exists());

        // Deleted: its manifest is gone; a third node finds nothing.
        assert_eq!(
            store_b.stored_team("isnap1").await.unwrap(),
            Some(Some(TEAM.into()))
        );
        store_b.forget_template("isnap1").await.unwrap();
        assert_eq!(store_b.stored_team("isnap1").await.unwrap(), None);
        let c = tmp.path().join("c");
        let node_c = manager(&c, &raw_b);
        let store_c = durable(&weed, "c", &c);
        let gone = store_c.take_in_template(&node_c, "isnap1", mine).await;
        assert!(gone.unwrap().is_none());
        // Another tag of the image: found by its digest, and only by it.
        let by_digest = store_c.take_in_image_digest(&node_c, &digest, mine).await;
        assert_eq!(by_digest.unwrap().unwrap().id, "image-k1");
        let other = format!("sha256:{}", "cd".repeat(32));
        for not_it in [other.as_str(), "sha256:../../x", "md5:ab"] {
            let none = store_c.take_in_image_digest(&node_c, not_it, mine).await;
            assert!(none.unwrap().is_none(), "{not_it}");
        }
        let digest_key = image_digest_key(&digest).unwrap();
        store_b.forget_template("image-k1").await.unwrap();
        let entry = files::get_json::<NameEntry>(store_b.store(), &digest_key).await;
        assert!(
            entry.unwrap().is_none(),
            "{digest_key} outlived its template"
        );
        // Ids that cannot name a manifest are not looked up.
        for bad in ["", "../x", "a/b", ".hidden"] {
            assert!(!storable_id(bad), "{bad}");
        }
    }

    /// The chunk digests stored template `id`'s manifest names.
    async fn named(store: &ObjectStore, id: &str) -> BTreeSet<String> {
        let m: TemplateManifest = files::get_json(store, &manifest_key(id))
            .await
            .unwrap()
            .unwrap();
        let f = &m.files;
        f.state
            .iter()
            .chain(&f.memory)
            .chain(&f.disk)
            .chain(&m.raw_base)
            .flat_map(|s| s.chunks.iter().flatten().cloned())
            .collect()
    }

    async fn chunks(store: &ObjectStore) -> BTreeSet<String> {
        let listed = store
            .list(sandfork_cluster::store_gc::CHUNKS)
            .await
            .unwrap();
        listed
            .into_iter()
            .map(|o| o.key[sandfork_cluster::store_gc::CHUNKS.len()..].to_owned())
            .collect()
    }

    /// Two snapshots of one base template stored (sharing its memory), one
    /// deleted: a pass of the store's collector deletes the chunks only the
    /// deleted one named and keeps those the other names. An upload that
    /// meets a pass (one under way, deleting a chunk the upload found
    /// stored) checks its chunks again once it is over and sends what went;
    /// and a file the node remembers having sent before a pass is checked
    /// again after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_collector_keeps_what_stored_templates_share() {
        let etcd = sandfork_cluster::harness::Etcd::start().unwrap();
        let weed = SeaweedFs::start().unwrap();
        let etcd_cluster = sandfork_cluster::Cluster::connect(&etcd.endpoints())
            .await
            .unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let a = tmp.path().join("a");
        let raw = tmp.path().join("img/root.raw");
        raw_image(&raw, 0x5a);
        let node = manager(&a, &raw);
        // All made first: each rewrites the base template's memory file,
        // which would make the node forget it sent it.
        for i in 1..=4 {
            let id = format!("isnap{i}");
            template_on(&node, &id, &raw, &a.join(format!("sandboxes/i{i}")));
        }
        let stored = durable(&weed, "a", &a).with_fence(etcd_cluster.clone());
        let store = stored.store().clone();
        store.ensure_bucket().await.unwrap();
        stored.store_template(&node, "isnap1").await.unwrap();
        stored.store_template(&node, "isnap2").await.unwrap();
        let (one, two) = (named(&store, "isnap1").await, named(&store, "isnap2").await);
        assert!(
            !one.is_disjoint(&two),
            "the base template's memory is shared"
        );
        assert!(!one.is_subset(&two));
        stored.forget_template("isnap1").await.unwrap();

        let grace = std::time::Duration::from_secs(1);
        tokio::time::sleep(grace * 2).await;
        let collector = sandfork_cluster::Collector::new(store.clone(), etcd_cluster.clone(), "a")
            .with_grace(grace);
        let swept = collector.pass().await.unwrap().unwrap();
        let left = chunks(&store).await;
        assert_eq!(left, two);
        assert_eq!(swept.chunks, one.difference(&two).count());

        // A pass under way (another node's) while a snapshot is stored: it
        // deletes a chunk the upload found stored, after the upload looked.
        let elsewhere = sandfork_cluster::harness::ForeignPass::start(&etcd_cluster, "b")
            .await
            .unwrap();
        let storing = tokio::spawn({
            let node = node.clone();
            async move {
                stored.store_template(&node, "isnap3").await.unwrap();
                stored
            }
        });
        while store.get(&manifest_key("isnap3")).await.unwrap().is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let three = named(&store, "isnap3").await;
        let shared = three.intersection(&two).next().unwrap().clone();
        store.delete(&files::chunk_key(&shared)).await.unwrap();
        assert!(!storing.is_finished(), "the upload waits for the pass");
        elsewhere.end().await.unwrap();
        let stored = storing.await.unwrap();
        assert!(three.is_subset(&chunks(&store).await));

        // After a pass, what the node remembers having sent is checked
        // again: all of isnap2 and isnap3 go, then isnap4 (which shares
        // their base template's memory) is stored whole.
        stored.forget_template("isnap2").await.unwrap();
        stored.forget_template("isnap3").await.unwrap();
        tokio::time::sleep(grace * 2).await;
        collector.pass().await.unwrap().unwrap();
        assert!(chunks(&store).await.is_empty());
        stored.store_template(&node, "isnap4").await.unwrap();
        let four = named(&store, "isnap4").await;
        assert!(four.contains(&shared));
        assert_eq!(four, chunks(&store).await);
    }

    /// Template `id` on `manager`'s node (as [`template_on`]) with `names`.
    fn template_named(manager: &Manager, id: &str, raw: &Path, names: &[&str]) -> TemplateRecord {
        let dir = manager.config().sandboxes_dir().join(format!("src-{id}"));
        let mut t = template_on(manager, id, raw, &dir);
        t.names = names.iter().map(|n| n.to_string()).collect();
        manager.store().put_template(&t).unwrap();
        t
    }

    /// A node takes a template in by one of its names (a build's alias or
    /// tag), which points at the template stored last under it (a
    /// rebuild's); another team's name is not given (nothing fetched); a
    /// name a template of the node has already stays that one's; a template
    /// stored again without a name lets go of it, and a deleted one of all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_template_is_taken_in_by_a_name_its_last_build_holds() {
        let weed = SeaweedFs::start().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let raw = tmp.path().join("img/root.raw");
        raw_image(&raw, 0x5a);
        let (a, b, c) = (
            tmp.path().join("a"),
            tmp.path().join("b"),
            tmp.path().join("c"),
        );
        let (node_a, node_b, node_c) = (manager(&a, &raw), manager(&b, &raw), manager(&c, &raw));
        let (store_a, store_b, store_c) = (
            durable(&weed, "a", &a),
            durable(&weed, "b", &b),
            durable(&weed, "c", &c),
        );
        store_a.store().ensure_bucket().await.unwrap();
        let mine = |team: Option<&str>| team == Some(TEAM);
        let others = |team: Option<&str>| team == Some("team_fedcba9876543210");

        // The first build of "py-env" with a tag, then its rebuild takes
        // the alias (the tag stays the first one's).
        let mut first = template_named(&node_a, "ibuild1", &raw, &["py-env", "py-env:v1"]);
        store_a.store_template(&node_a, "ibuild1").await.unwrap();
        first.names = vec!["py-env:v1".into()];
        node_a.store().put_template(&first).unwrap();
        template_named(&node_a, "ibuild2", &raw, &["py-env", "shared"]);
        store_a.store_template(&node_a, "ibuild2").await.unwrap();
        store_a.store_template(&node_a, "ibuild1").await.unwrap();

        // Another team: nothing.
        let refused = store_b.take_in_template(&node_b, "py-env", others).await;
        assert!(refused.unwrap().is_none());
        assert!(!b.join("templates/ibuild2").exists());
        // A name no template has, or that cannot name a key: nothing.
        for missing in ["no-such", "py-env:v9", "a/../b", ""] {
            let none = store_b.take_in_template(&node_b, missing, mine).await;
            assert!(none.unwrap().is_none(), "{missing}");
        }

        // Node b has a template of its own called "shared".
        template_named(&node_b, "ilocal", &raw, &["shared"]);
        let rebuilt = store_b
            .take_in_template(&node_b, "py-env:default", mine)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rebuilt.id, "ibuild2");
        assert_eq!(rebuilt.names, ["py-env"]);
        assert_eq!(node_b.resolve_template("py-env").unwrap().id, "ibuild2");
        assert_eq!(node_b.resolve_template("shared").unwrap().id, "ilocal");
        let tagged = store_b
            .take_in_template(&node_b, "py-env:v1", mine)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (tagged.id.as_str(), &tagged.names[..]),
            ("ibuild1", &["py-env:v1".to_owned()][..])
        );

        // Stored again without its tag: the name goes with it.
        first.names.clear();
        node_a.store().put_template(&first).unwrap();
        store_a.store_template(&node_a, "ibuild1").await.unwrap();
        let untagged = store_c.take_in_template(&node_c, "py-env:v1", mine).await;
        assert!(untagged.unwrap().is_none());
        assert!(!c.join("templates/ibuild1").exists());

        // Known here under other names: it answers to the asked one too.
        let mut renamed = node_a.store().template("ibuild2").unwrap().unwrap();
        renamed.names.push("py-env:v2".into());
        node_a.store().put_template(&renamed).unwrap();
        store_a.store_template(&node_a, "ibuild2").await.unwrap();
        let again = store_b
            .take_in_template(&node_b, "py-env:v2", mine)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(again.names, ["py-env", "py-env:v2"]);
        assert_eq!(node_b.resolve_template("py-env:v2").unwrap().id, "ibuild2");

        // Deleted: none of its names finds it.
        store_a.forget_template("ibuild2").await.unwrap();
        for name in ["py-env", "shared", "py-env:v2"] {
            let gone = store_c.take_in_template(&node_c, name, mine).await;
            assert!(gone.unwrap().is_none(), "{name}");
        }
    }
}
