//! The disk image templates may use: templates converted from registry
//! images (on a create that names one, [`super::image_create`], or as the
//! base of an E2B build, [`super::image`]) are caches, made again by the
//! next create that needs them. They are collected by last use under two
//! watermarks of the data dir's filesystem use (`df`'s percentage, read
//! from the same `statvfs` as `GET /v1/node`'s `diskMB`; see
//! [`ImageDiskWatermarks`]):
//!
//! - above the **high** one, the unused image templates are evicted, least
//!   recently used first, until the use is at most the **low** one (or none
//!   is left to evict); a new conversion is refused
//!   ([`super::ImageError::NoRoom`], 503 with `Retry-After`) while the use
//!   stays above the high one after that;
//! - a template in use is never evicted: a sandbox (running or paused), a
//!   fork child or a snapshot stacking on it, a create restoring it (all as
//!   `Manager::evict_template` judges them, under the lock a delete takes),
//!   and one used in the last [`MIN_IDLE`] (a create that found it and is
//!   about to restore it). A conversion under way has no template record
//!   yet, so it is never a candidate.
//!
//! An evicted template's directory goes, with its build record, and so does
//! its root filesystem in the build cache (`<cache>/templates/<key>/`, the
//! bulk of an image's bytes) when no other template of the node stacks on
//! it and no build is under way (one may be about to boot that entry). The
//! build cache is the node's own: another node sharing it would lose
//! entries. An image converted into stored layers
//! (`template_build::layer_store`, `<cache>/layers`) counts the layers no
//! other template's chain has; after a pass evicted any, the layers no
//! template's chain uses go too (when no conversion is under way). The
//! pulled blobs (`<cache>/images`) are not collected yet.
//!
//! Last use is the template's state file's access time, as the cluster
//! cache's bound keeps it (`cache_bound::mark_used`): marked by every
//! create that names the image and by each pass that finds the template in
//! use. Each pass runs before a conversion, after one, and every
//! [`EVERY`]; it is logged, and counted in `GET /v1/node`'s
//! `diskMB.images`.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::node::capacity::{ImageDiskWatermarks, used_percent};
use crate::node::sandbox::SandboxError;
use crate::node::sandbox::cache_bound::mark_used;

use super::build::Templates;

/// An image template used this recently is kept: a create that found it
/// restores it a moment later (and pins it then).
pub const MIN_IDLE: Duration = Duration::from_secs(10);
/// How often the bound is checked without a conversion asking.
pub const EVERY: Duration = Duration::from_secs(60);
/// What a refused conversion's `Retry-After` says: each retry runs a pass,
/// which evicts what became unused since (a sandbox of another image
/// ended); the SDKs retry three times within their request's timeout.
pub const RETRY_SECS: u32 = 10;

/// An image template as a pass weighs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: String,
    /// Its last use, ms since the epoch.
    pub last_used_ms: u64,
    /// What evicting it frees on the data dir's filesystem.
    pub bytes: u64,
    /// Used, or used in the last [`MIN_IDLE`]: never evicted.
    pub in_use: bool,
}

/// What a pass does: evicts `evict`, in order; `above_high` says whether the
/// filesystem would still be above the high watermark after.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub evict: Vec<String>,
    pub above_high: bool,
}

/// The policy: nothing at or below the high watermark; above it, the unused
/// candidates least recently used first (then by id) until the use is at
/// most the low one.
pub fn plan(
    used: u64,
    available: u64,
    marks: ImageDiskWatermarks,
    candidates: &[Candidate],
) -> Plan {
    if used_percent(used, available) <= marks.high_percent {
        return Plan {
            evict: Vec::new(),
            above_high: false,
        };
    }
    let mut unused: Vec<&Candidate> = candidates.iter().filter(|c| !c.in_use).collect();
    unused.sort_by(|a, b| (a.last_used_ms, &a.id).cmp(&(b.last_used_ms, &b.id)));
    let (mut used, mut available) = (used, available);
    let mut evict = Vec::new();
    for c in unused {
        if used_percent(used, available) <= marks.low_percent {
            break;
        }
        let freed = c.bytes.min(used);
        used -= freed;
        available = available.saturating_add(freed);
        evict.push(c.id.clone());
    }
    Plan {
        evict,
        above_high: used_percent(used, available) > marks.high_percent,
    }
}

/// What the passes did since the node started.
#[derive(Debug, Default)]
pub struct Counters {
    evicted: AtomicU64,
    evicted_bytes: AtomicU64,
    refused: AtomicU64,
}

/// The figures of `GET /v1/node`'s `diskMB.images`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageDiskReport {
    pub marks: ImageDiskWatermarks,
    pub used_percent: f64,
    /// Image templates on the node now.
    pub templates: u64,
    pub evicted: u64,
    pub evicted_bytes: u64,
    pub refused: u64,
}

/// Bytes on disk of the files under `path` (or of `path`) on device `dev`.
fn bytes_on(path: &Path, dev: u64) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if meta.is_dir() {
        std::fs::read_dir(path)
            .map(|rd| rd.flatten().map(|e| bytes_on(&e.path(), dev)).sum())
            .unwrap_or(0)
    } else if meta.dev() == dev {
        meta.blocks() * 512
    } else {
        0
    }
}

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Templates {
    /// A pass (see the module's documentation): evicts what the policy
    /// says; returns whether the filesystem is still above the high
    /// watermark, and its use.
    pub async fn bound_image_disk(&self) -> Result<(bool, f64), SandboxError> {
        let _one = self.image_disk_pass.lock().await;
        let manager = self.manager();
        let marks = manager.config().capacity.image_disk;
        let disk = manager.capacity().disk()?;
        if disk.used_percent() <= marks.high_percent {
            return Ok((false, disk.used_percent()));
        }
        let store = manager.store();
        let templates = store.templates()?;
        let mut all = templates.clone();
        all.extend(store.retired_templates()?);
        let data_dev = std::fs::metadata(&manager.config().data_dir)
            .map(|m| m.dev())
            .map_err(|source| SandboxError::Io {
                what: "reading the data dir".into(),
                source,
            })?;
        let now = SystemTime::now();
        let layers = self.image_layers_of(&all);
        let mut candidates = Vec::new();
        for t in templates.iter().filter(|t| t.image.is_some()) {
            let in_use = manager.template_in_use(&t.id)?;
            if in_use {
                mark_used(&t.snapshot);
            }
            let used_at = std::fs::metadata(&t.snapshot)
                .ok()
                .and_then(|m| m.accessed().ok().max(m.modified().ok()))
                .unwrap_or(UNIX_EPOCH);
            let recent = now.duration_since(used_at).map_or(true, |d| d < MIN_IDLE);
            let shared = self.rootfs_shared(t, &all);
            let mut bytes = bytes_on(&t.dir, data_dev);
            if !shared && let Some(entry) = self.rootfs_entry(t) {
                bytes += bytes_on(&entry, data_dev);
            }
            // The image layers no other template's chain has.
            let others: HashSet<&PathBuf> = layers
                .iter()
                .filter(|(id, _)| *id != &t.id)
                .flat_map(|(_, chain)| chain)
                .collect();
            if let Some(mine) = layers.get(&t.id) {
                bytes += mine
                    .iter()
                    .filter(|l| !others.contains(l))
                    .map(|l| bytes_on(l, data_dev))
                    .sum::<u64>();
            }
            candidates.push(Candidate {
                id: t.id.clone(),
                last_used_ms: ms(used_at),
                bytes,
                in_use: in_use || recent,
            });
        }
        let planned = plan(
            disk.used_mib << 20,
            disk.available_mib << 20,
            marks,
            &candidates,
        );
        for id in &planned.evict {
            let bytes = candidates
                .iter()
                .find(|c| &c.id == id)
                .map_or(0, |c| c.bytes);
            self.evict_image_template(id, bytes, &disk).await?;
        }
        if !planned.evict.is_empty() && self.running().is_empty() {
            self.collect_image_layers().await;
        }
        let disk = manager.capacity().disk()?;
        let above = disk.used_percent() > marks.high_percent;
        if above {
            tracing::warn!(
                "images: the data dir's filesystem is {:.1} % used, above the high watermark of \
                 {} %, with {} image templates in use or just used",
                disk.used_percent(),
                marks.high_percent,
                candidates.iter().filter(|c| c.in_use).count()
            );
        }
        Ok((above, disk.used_percent()))
    }

    /// Evicts image template `id` (when still unused) with its build
    /// record and its root filesystem's cache entry (when unshared).
    async fn evict_image_template(
        &self,
        id: &str,
        bytes: u64,
        disk: &crate::node::capacity::DiskSpace,
    ) -> Result<(), SandboxError> {
        let manager = self.manager();
        let store = manager.store();
        let Some(t) = manager.evict_template(id).await? else {
            return Ok(());
        };
        store.remove_build(id)?;
        let mut all = store.templates()?;
        all.extend(store.retired_templates()?);
        let building = !self.running().is_empty();
        let mut freed_rootfs = false;
        if !building
            && !self.rootfs_shared(&t, &all)
            && let Some(entry) = self.rootfs_entry(&t)
        {
            let removed =
                tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&entry)).await?;
            match removed {
                Ok(()) => freed_rootfs = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!("images: removing the root filesystem of {id}: {e}"),
            }
        }
        let after = manager.capacity().disk()?;
        self.image_disk.evicted.fetch_add(1, Ordering::Relaxed);
        self.image_disk
            .evicted_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        tracing::info!(
            "images: evicted template {id} ({}){}, {} MiB: the data dir's filesystem was {:.1} % \
             used at the pass's start, now {:.1} %",
            t.image.as_deref().unwrap_or_default(),
            if freed_rootfs {
                " and its root filesystem"
            } else {
                ""
            },
            bytes >> 20,
            disk.used_percent(),
            after.used_percent(),
        );
        Ok(())
    }

    /// Template `t`'s root filesystem's entry in this node's build cache,
    /// if it is one.
    fn rootfs_entry(&self, t: &crate::node::store::TemplateRecord) -> Option<std::path::PathBuf> {
        let cache = self.manager().config().build_cache_dir();
        let entry = t.rootfs.parent()?;
        (entry.parent()? == template_build::templates_in(&cache)).then(|| entry.to_owned())
    }

    /// Whether a template of `all` other than `t` stacks on `t`'s root
    /// filesystem's cache entry.
    fn rootfs_shared(
        &self,
        t: &crate::node::store::TemplateRecord,
        all: &[crate::node::store::TemplateRecord],
    ) -> bool {
        let Some(entry) = t.rootfs.parent() else {
            return true;
        };
        all.iter()
            .any(|o| o.id != t.id && (o.rootfs.starts_with(entry) || o.rootfs == t.rootfs))
    }

    /// The image layers (in the build cache's layer store) of each
    /// template's root disk chain, by template id; a chain that cannot be
    /// read has none.
    fn image_layers_of(
        &self,
        all: &[crate::node::store::TemplateRecord],
    ) -> HashMap<String, Vec<PathBuf>> {
        let store = self.layer_store();
        let Ok(store) = store.canonicalize() else {
            return HashMap::new();
        };
        all.iter()
            .filter_map(|t| {
                let chain = disk_layers::chain_files(&t.root_layer).ok()?;
                let mine: Vec<PathBuf> = chain
                    .into_iter()
                    .filter(|p| p.starts_with(&store))
                    .collect();
                (!mine.is_empty()).then(|| (t.id.clone(), mine))
            })
            .collect()
    }

    fn layer_store(&self) -> PathBuf {
        template_build::layer_store::layers_in(&self.manager().config().build_cache_dir())
    }

    /// Removes the stored image layers that no template's chain uses (the
    /// caller makes sure no conversion is under way, which may be about to
    /// stack on one). A chain that cannot be read keeps every layer.
    async fn collect_image_layers(&self) {
        let store = self.layer_store();
        let mut tops: Vec<PathBuf> = Vec::new();
        let db = self.manager().store();
        for t in db
            .templates()
            .into_iter()
            .chain(db.retired_templates())
            .flatten()
        {
            tops.push(t.root_layer);
        }
        let collected = tokio::task::spawn_blocking(move || -> Result<(usize, u64), String> {
            let candidates: Vec<PathBuf> = match std::fs::read_dir(&store) {
                Ok(rd) => rd
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "layer"))
                    .collect(),
                Err(_) => return Ok((0, 0)),
            };
            let unused =
                disk_layers::unreferenced(&candidates, &tops).map_err(|e| e.to_string())?;
            let mut freed = 0;
            for p in &unused {
                let bytes = std::fs::metadata(p).map_or(0, |m| m.blocks() * 512);
                std::fs::remove_file(p).map_err(|e| format!("{}: {e}", p.display()))?;
                freed += bytes;
            }
            Ok((unused.len(), freed))
        })
        .await;
        match collected {
            Ok(Ok((0, _))) => {}
            Ok(Ok((n, freed))) => {
                tracing::info!(
                    "images: removed {n} unused image layers, {} MiB",
                    freed >> 20
                )
            }
            Ok(Err(e)) => tracing::warn!("images: collecting image layers: {e}"),
            Err(e) => tracing::warn!("images: collecting image layers: {e}"),
        }
    }

    /// A conversion refused for want of disk: counted.
    pub(super) fn count_refusal(&self) {
        self.image_disk.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// The figures for `GET /v1/node`.
    pub fn image_disk_report(&self) -> Result<ImageDiskReport, SandboxError> {
        let manager = self.manager();
        let disk = manager.capacity().disk()?;
        let templates = manager
            .store()
            .templates()?
            .iter()
            .filter(|t| t.image.is_some())
            .count() as u64;
        Ok(ImageDiskReport {
            marks: manager.config().capacity.image_disk,
            used_percent: disk.used_percent(),
            templates,
            evicted: self.image_disk.evicted.load(Ordering::Relaxed),
            evicted_bytes: self.image_disk.evicted_bytes.load(Ordering::Relaxed),
            refused: self.image_disk.refused.load(Ordering::Relaxed),
        })
    }

    /// Runs a pass every [`EVERY`] until the node stops.
    pub fn start_image_disk_bound(self: &std::sync::Arc<Self>) {
        let weak = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(EVERY).await;
                let Some(templates) = weak.upgrade() else {
                    return;
                };
                if let Err(e) = templates.bound_image_disk().await {
                    tracing::warn!("images: bounding their disk: {e}");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::fs::FileTimes;

    use super::*;
    use crate::node::store::{SandboxRecord, Store, TemplateRecord};

    const MIB: u64 = 1 << 20;

    fn c(id: &str, last_used_ms: u64, mib: u64, in_use: bool) -> Candidate {
        Candidate {
            id: id.into(),
            last_used_ms,
            bytes: mib * MIB,
            in_use,
        }
    }

    fn marks(high: f64, low: f64) -> ImageDiskWatermarks {
        ImageDiskWatermarks {
            high_percent: high,
            low_percent: low,
        }
    }

    #[test]
    fn nothing_goes_at_or_below_the_high_watermark() {
        let all = [c("a", 1, 100, false)];
        // 85 of 100 MiB used: at the high watermark, not above.
        let p = plan(85 * MIB, 15 * MIB, marks(85.0, 80.0), &all);
        assert_eq!(
            p,
            Plan {
                evict: vec![],
                above_high: false
            }
        );
    }

    #[test]
    fn the_least_recently_used_go_first_down_to_the_low_watermark() {
        // 90 of 100 used; low 80: 10 MiB must go.
        let all = [
            c("newest", 30, 6, false),
            c("oldest", 10, 6, false),
            c("middle", 20, 6, false),
        ];
        let p = plan(90 * MIB, 10 * MIB, marks(85.0, 80.0), &all);
        assert_eq!(p.evict, ["oldest", "middle"]);
        assert!(!p.above_high);
        // One large one is enough.
        let all = [
            c("old", 1, 1, false),
            c("big", 2, 50, false),
            c("new", 3, 1, false),
        ];
        let p = plan(90 * MIB, 10 * MIB, marks(85.0, 80.0), &all);
        assert_eq!(p.evict, ["old", "big"]);
        // Equal last uses: by id, so that a pass is repeatable.
        let all = [c("b", 5, 20, false), c("a", 5, 20, false)];
        assert_eq!(
            plan(90 * MIB, 10 * MIB, marks(85.0, 80.0), &all).evict,
            ["a"]
        );
    }

    #[test]
    fn a_template_in_use_is_never_evicted_however_old() {
        let all = [c("used", 1, 50, true), c("unused", 9, 5, false)];
        let p = plan(90 * MIB, 10 * MIB, marks(85.0, 80.0), &all);
        assert_eq!(p.evict, ["unused"]);
        // 85 of 100 after: not above the high watermark, though above the low.
        assert!(!p.above_high);
        let p = plan(95 * MIB, 5 * MIB, marks(85.0, 80.0), &all);
        assert_eq!(p.evict, ["unused"]);
        assert!(p.above_high, "90 % used with only used templates left");
        let p = plan(
            95 * MIB,
            5 * MIB,
            marks(85.0, 80.0),
            &[c("used", 1, 90, true)],
        );
        assert_eq!(
            p,
            Plan {
                evict: vec![],
                above_high: true
            }
        );
    }

    #[test]
    fn watermarks_are_dfs_percentage_of_used_and_available() {
        // Blocks reserved for root are neither: 40 used + 40 available is 50 %.
        let p = plan(
            40 * MIB,
            40 * MIB,
            marks(49.0, 10.0),
            &[c("a", 1, 40, false)],
        );
        assert_eq!(p.evict, ["a"]);
        assert!(!p.above_high);
        assert_eq!(used_percent(0, 0), 0.0);
        // A high watermark of 100 % never refuses nor evicts.
        let p = plan(100 * MIB, 0, marks(100.0, 90.0), &[c("a", 1, 40, false)]);
        assert_eq!(
            p,
            Plan {
                evict: vec![],
                above_high: false
            }
        );
    }

    /// Template `id` as a build leaves it: its directory (a state file of
    /// 1 MiB, last used `ago`), its root filesystem in the build cache's
    /// entry `key`.
    fn template(
        data: &Path,
        cache: &Path,
        id: &str,
        image: Option<&str>,
        key: &str,
        ago: Duration,
    ) -> TemplateRecord {
        let dir = data.join("templates").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("vm.state");
        std::fs::write(&state, vec![7u8; 1 << 20]).unwrap();
        let at = SystemTime::now() - ago;
        std::fs::File::options()
            .write(true)
            .open(&state)
            .unwrap()
            .set_times(FileTimes::new().set_accessed(at).set_modified(at))
            .unwrap();
        let entry = template_build::templates_in(cache).join(key);
        std::fs::create_dir_all(&entry).unwrap();
        std::fs::write(entry.join("rootfs.ext4"), vec![1u8; 1 << 20]).unwrap();
        TemplateRecord {
            id: id.into(),
            snapshot: state,
            mem: dir.join("vm.mem"),
            root_layer: dir.join("root.layer"),
            dir,
            root_drive_id: "rootfs".into(),
            rootfs: entry.join("rootfs.ext4"),
            vcpus: 1,
            mem_mib: 128,
            image: image.map(str::to_owned),
            ..Default::default()
        }
    }

    /// A real pass over a node's records and files, its disk always above
    /// a high watermark of 0 %: the unused image templates go (the least
    /// recently used first), with their build cache entries once no other
    /// template stacks on them; one a sandbox uses, one used a moment ago
    /// and a template not from an image stay; the pass reports the disk
    /// still above, and the counters count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_evicts_the_unused_image_templates_and_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let (data, cache) = (tmp.path().join("data"), tmp.path().join("cache"));
        std::fs::create_dir_all(&data).unwrap();
        let mut config =
            crate::node::sandbox::tests::offline_config(&data, tmp.path().join("base.raw"));
        config.build_cache = Some(cache.clone());
        config.capacity.image_disk = marks(0.0, 0.0);
        let store = Store::open(&data.join("s.redb")).unwrap();
        let hour = Duration::from_secs(3600);
        let t = |id, image, key, ago| template(&data, &cache, id, image, key, ago);
        let records = [
            t("old", Some("r.example/a:1"), "k1", 2 * hour),
            // The same content under another tag: the same cache entry.
            t("twin", Some("r.example/a:2"), "k1", hour),
            t("fresh", Some("r.example/b:1"), "k2", Duration::from_secs(1)),
            t("busy", Some("r.example/c:1"), "k3", 3 * hour),
            t("plain", None, "k4", 5 * hour),
        ];
        for r in &records {
            store.put_template(r).unwrap();
        }
        store
            .put_sandbox(&SandboxRecord {
                id: "isandboxofbusy".into(),
                template_id: "busy".into(),
                uses_snapshots: vec!["busy".into()],
                ..Default::default()
            })
            .unwrap();
        let manager = crate::node::sandbox::tests::with_store(config, store);
        let templates = Templates::new(manager.clone());

        let (above, _) = templates.bound_image_disk().await.unwrap();
        assert!(above, "a high watermark of 0 % is never met");
        let store = manager.store();
        for gone in ["old", "twin"] {
            assert_eq!(store.template(gone).unwrap(), None, "{gone}");
            assert!(!data.join("templates").join(gone).exists(), "{gone}");
        }
        for kept in ["fresh", "busy", "plain"] {
            assert!(store.template(kept).unwrap().is_some(), "{kept}");
            assert!(data.join("templates").join(kept).is_dir(), "{kept}");
        }
        let entries = template_build::templates_in(&cache);
        assert!(
            !entries.join("k1").exists(),
            "the evicted pair's root filesystem"
        );
        for key in ["k2", "k3", "k4"] {
            assert!(entries.join(key).join("rootfs.ext4").is_file(), "{key}");
        }
        let report = templates.image_disk_report().unwrap();
        assert_eq!((report.templates, report.evicted), (2, 2));
        assert!(report.evicted_bytes >= 2 << 20, "{report:?}");
        // In use, so marked used by the pass: the next one keeps it too.
        let (above, _) = templates.bound_image_disk().await.unwrap();
        assert!(above);
        assert!(store.template("busy").unwrap().is_some());
    }

    /// A stored image layer (`template_build::layer_store`): 1 MiB of
    /// `byte` over `parent` (nothing: a blank chain of 4 MiB), sealed shared.
    fn stored_layer(path: &Path, parent: Option<&Path>, byte: u8) {
        let disk = match parent {
            Some(p) => disk_layers::LayeredDisk::create(p, path),
            None => disk_layers::LayeredDisk::create_blank(path, 4 * MIB),
        }
        .unwrap();
        let at = u64::from(byte) * MIB % (4 * MIB);
        disk.write_at(&vec![byte; MIB as usize], at).unwrap();
        disk.seal_shared().unwrap();
    }

    /// Two image templates whose chains share a base layer in the layer
    /// store, each with a layer of its own: evicting the unused one counts
    /// and frees its own layer; the base and the other's layer stay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_evicted_image_template_frees_its_own_layers_and_no_shared_one() {
        let tmp = tempfile::tempdir().unwrap();
        let (data, cache) = (tmp.path().join("data"), tmp.path().join("cache"));
        std::fs::create_dir_all(&data).unwrap();
        let mut config =
            crate::node::sandbox::tests::offline_config(&data, tmp.path().join("base.raw"));
        config.build_cache = Some(cache.clone());
        config.capacity.image_disk = marks(0.0, 0.0);
        let layers = template_build::layer_store::layers_in(&cache);
        std::fs::create_dir_all(&layers).unwrap();
        let (base, a, b) = (
            layers.join("base.layer"),
            layers.join("a.layer"),
            layers.join("b.layer"),
        );
        stored_layer(&base, None, 1);
        stored_layer(&a, Some(&base), 2);
        stored_layer(&b, Some(&base), 3);
        let store = Store::open(&data.join("s.redb")).unwrap();
        let hour = Duration::from_secs(3600);
        for (id, top) in [("ta", &a), ("tb", &b)] {
            let mut t = template(&data, &cache, id, Some(id), id, 2 * hour);
            t.rootfs = top.clone();
            drop(disk_layers::LayeredDisk::create(top, &t.root_layer).unwrap());
            store.put_template(&t).unwrap();
        }
        store
            .put_sandbox(&SandboxRecord {
                id: "isandboxoftb".into(),
                template_id: "tb".into(),
                uses_snapshots: vec!["tb".into()],
                ..Default::default()
            })
            .unwrap();
        let manager = crate::node::sandbox::tests::with_store(config, store);
        let templates = Templates::new(manager.clone());

        templates.bound_image_disk().await.unwrap();
        assert_eq!(manager.store().template("ta").unwrap(), None);
        assert!(manager.store().template("tb").unwrap().is_some());
        assert!(!a.exists(), "the evicted template's own layer");
        assert!(
            base.is_file() && b.is_file(),
            "the shared base, the other's layer"
        );
        let report = templates.image_disk_report().unwrap();
        assert_eq!(report.evicted, 1);
        // Its directory (a 1 MiB state file) and its own layer (1 MiB).
        assert!(report.evicted_bytes >= 2 * MIB, "{report:?}");
        assert!(
            report.evicted_bytes < 3 * MIB,
            "the shared base is not counted: {report:?}"
        );
    }
}
