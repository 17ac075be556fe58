//! Garbage collection of files no sandbox or snapshot needs any more: the
//! directories of killed sandboxes and of forks whose every user is gone
//! (kept at kill time because others stacked on them), and, inside the
//! directories still used, disk layers no live chain reads (a killed fork
//! child's or parent's top layer), the logs and metrics of sandboxes
//! without a record, and directories under `templates/` without a record
//! that nothing uses (a snapshot or build a crash cut short, a deleted
//! template's files whose removal a crash cut short).
//!
//! Template builds write under `templates/` outside the activity lock (an
//! image build for minutes): each registers its template's id for as long
//! as its files lack a record ([`Manager::writing_template`]), and the
//! collector leaves those alone.
//!
//! What is used comes from the records: each sandbox and snapshot lists the
//! directories its memory and disk stack on (`uses_dirs`), and its current
//! root layer is the top of a disk chain. Pause generations inside a used
//! directory are left alone: which of them a diff snapshot still maps is only
//! in the VMM's state file.
//!
//! Each pass also keeps `cluster-cache/` within its bound (see
//! [`super::cache_bound`]), from the same records.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::MutexGuard;
use std::time::Duration;

use super::{Manager, SandboxError};

/// How often the collector looks.
pub const GC_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcStats {
    /// Whole directories removed.
    pub dirs: Vec<PathBuf>,
    /// Disk layers removed from directories still in use.
    pub layers: Vec<PathBuf>,
    /// Deleted templates whose last user went, removed with their files.
    pub templates: Vec<String>,
    /// Files evicted from the cluster cache (over its bound, unused).
    pub evicted: super::cache_bound::Evicted,
    /// Why nothing was collected, when nothing was.
    pub skipped: Option<&'static str>,
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// `*.layer` files in `dir` and its subdirectories (a snapshot's `snap-*`).
fn layers_in(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for p in entries(dir) {
        if p.is_dir() {
            out.extend(layers_in(&p));
        } else if p.extension().is_some_and(|e| e == "layer") {
            out.push(p);
        }
    }
    out
}

/// A template build's claim on `templates/<id>` and its scratch directories
/// there (`.<what>-<id>-…`) while they have no record: taken before its first
/// file is made, dropped after its record is committed (or its files removed).
#[derive(Debug)]
pub struct TemplateWrite<'a> {
    manager: &'a Manager,
    id: String,
}

impl Drop for TemplateWrite<'_> {
    fn drop(&mut self) {
        let mut writing = self.manager.writing();
        if let Some(n) = writing.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                writing.remove(&self.id);
            }
        }
    }
}

impl Manager {
    fn writing(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.writing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps the collector off template `id`'s files until the claim drops.
    pub fn writing_template(&self, id: &str) -> TemplateWrite<'_> {
        *self.writing().entry(id.to_owned()).or_default() += 1;
        TemplateWrite {
            manager: self,
            id: id.to_owned(),
        }
    }

    /// The directories under `templates/` that no template record (deleted
    /// ones included) names, no sandbox or template stacks on, and no build
    /// claims, each renamed aside (`.gc-<name>`) for removal. Decided under
    /// the claims' lock, with the records read under it: a build commits its
    /// record before it drops its claim, and cannot claim a name meanwhile.
    fn orphan_templates(&self) -> Result<Vec<PathBuf>, SandboxError> {
        let writing = self.writing();
        let mut used = BTreeSet::from([self.template.id.clone()]);
        for t in self
            .store
            .templates()?
            .into_iter()
            .chain(self.store.retired_templates()?)
        {
            used.extend(
                t.dir
                    .file_name()
                    .and_then(|n| n.to_str())
                    .map(str::to_owned),
            );
            used.insert(t.id);
            used.extend(t.uses_snapshots);
        }
        for s in self.store.sandboxes()? {
            used.insert(s.template_id);
            used.extend(s.uses_snapshots);
        }
        let parent = self.config.templates_dir();
        let mut orphans = Vec::new();
        for path in entries(&parent) {
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !path.is_dir() || used.contains(name) || writing.contains_key(name) {
                continue;
            }
            // Hidden ones are a build's scratch (`.build-<id>-…`, `.old-<id>-…`)
            // or were renamed aside by a pass a crash cut short.
            if let Some(hidden) = name.strip_prefix('.') {
                let claimed = hidden.split_once('-').is_some_and(|(_, rest)| {
                    writing.keys().any(|id| {
                        rest.strip_prefix(id.as_str())
                            .is_some_and(|r| r.starts_with('-'))
                    })
                });
                if !claimed {
                    orphans.push(path);
                }
                continue;
            }
            let aside = parent.join(format!(".gc-{name}"));
            match std::fs::rename(&path, &aside) {
                Ok(()) => orphans.push(aside),
                Err(e) => tracing::warn!("gc: moving {} aside: {e}", path.display()),
            }
        }
        Ok(orphans)
    }

    /// Collects every [`GC_EVERY`].
    pub fn start_gc(self: std::sync::Arc<Self>) {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(GC_EVERY).await;
                match self.collect_garbage().await {
                    Ok(s)
                        if !s.dirs.is_empty()
                            || !s.layers.is_empty()
                            || !s.templates.is_empty()
                            || !s.evicted.files.is_empty() =>
                    {
                        tracing::info!(
                            "gc: removed {} directories, {} disk layers and {} deleted templates; \
                             evicted {} files ({} MiB) from the cluster cache",
                            s.dirs.len(),
                            s.layers.len(),
                            s.templates.len(),
                            s.evicted.files.len(),
                            s.evicted.bytes >> 20
                        )
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("gc: {e}"),
                }
            }
        });
    }

    /// Removes what nothing uses; skipped while anything is changing.
    pub async fn collect_garbage(&self) -> Result<GcStats, SandboxError> {
        let Ok(_alone) = self.activity.try_write() else {
            return Ok(GcStats {
                skipped: Some("sandboxes are changing"),
                ..GcStats::default()
            });
        };
        let sandboxes = self.store.sandboxes()?;
        // Logs and metrics of sandboxes without a record (a crash between
        // the record's removal and theirs).
        let ids: BTreeSet<String> = sandboxes.iter().map(|s| s.id.clone()).collect();
        let observe = self.config.observe_dir();
        let histories = tokio::task::spawn_blocking(move || {
            let mut removed = Vec::new();
            for dir in entries(&observe) {
                let known = dir
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| ids.contains(n));
                if known || !dir.is_dir() {
                    continue;
                }
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => removed.push(dir),
                    Err(e) => tracing::warn!("gc: removing {}: {e}", dir.display()),
                }
            }
            removed
        })
        .await?;
        let mut templates = self.store.templates()?;
        // Deleted templates stay while something stacks on them; the rest
        // go now, and what they held is judged with them gone.
        let mut removed = Vec::new();
        for t in self.store.retired_templates()? {
            let unused = {
                let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
                self.template_users(&t.id, &pins)?.is_empty()
            };
            if unused {
                self.store.remove_retired_template(&t.id)?;
                crate::node::crash::point("gc.removing");
                self.remove_template_files(&t).await?;
                removed.push(t.id);
            } else {
                templates.push(t);
            }
        }
        // Records from before `uses_dirs` cannot say what they need.
        if sandboxes.iter().any(|s| s.uses_dirs.is_empty())
            || templates
                .iter()
                .any(|t| t.is_snapshot() && t.uses_dirs.is_empty())
        {
            return Ok(GcStats {
                skipped: Some("records from an older version"),
                templates: removed,
                dirs: histories,
                ..GcStats::default()
            });
        }
        // A volume's layers outlive the sandboxes that wrote them (a
        // fork's parent leaves the volume on a layer in the fork's directory).
        let volumes = self.store.volumes()?;
        let used: BTreeSet<PathBuf> = sandboxes
            .iter()
            .flat_map(|s| s.uses_dirs.iter())
            .chain(templates.iter().flat_map(|t| t.uses_dirs.iter()))
            .chain(volumes.iter().flat_map(|v| v.uses_dirs.iter()))
            .cloned()
            .collect();
        let mut tops: Vec<PathBuf> = sandboxes.iter().map(|s| self.root_layer(s)).collect();
        tops.extend(templates.iter().map(|t| t.root_layer.clone()));
        tops.extend(
            sandboxes
                .iter()
                .flat_map(|s| s.volume_mounts.iter().map(|m| m.disk.clone())),
        );
        tops.extend(volumes.iter().map(|v| v.disk.clone()));
        // A snapshot's sealed volume layers, which its sandboxes' copies
        // stack on (the source's copy of a volume may be gone with it).
        tops.extend(
            templates
                .iter()
                .flat_map(|t| t.volume_mounts.iter().map(|m| m.disk.clone())),
        );
        let cache = self.config.cluster_cache_dir();
        let cache_max = self
            .config
            .cluster_cache_max
            .or_else(|| super::cache_bound::default_bound(&self.config.data_dir));
        let cache_users = super::cache_bound::CacheUsers {
            tops: tops.clone(),
            dirs: used
                .iter()
                .cloned()
                .chain(sandboxes.iter().map(|s| self.sandbox_dir(&s.id)))
                .chain(templates.iter().map(|t| t.dir.clone()))
                .collect(),
            files: templates
                .iter()
                .flat_map(|t| [t.snapshot.clone(), t.mem.clone(), t.rootfs.clone()])
                .collect(),
        };
        let roots = [
            self.config.sandboxes_dir(),
            self.config.data_dir.join("forks"),
        ];
        let orphans = self.orphan_templates()?;
        tokio::task::spawn_blocking(move || -> Result<GcStats, SandboxError> {
            let mut stats = GcStats {
                templates: removed,
                dirs: histories,
                ..GcStats::default()
            };
            for dir in orphans {
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => stats.dirs.push(dir),
                    Err(e) => tracing::warn!("gc: removing {}: {e}", dir.display()),
                }
            }
            let mut kept = Vec::new();
            for dir in roots.iter().flat_map(|r| entries(r)) {
                if !dir.is_dir() || used.contains(&dir) {
                    kept.push(dir);
                    continue;
                }
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => stats.dirs.push(dir),
                    Err(e) => tracing::warn!("gc: removing {}: {e}", dir.display()),
                }
            }
            let candidates: Vec<PathBuf> = kept.iter().flat_map(|d| layers_in(d)).collect();
            // A top that is missing (its sandbox broken) would hide what its
            // chain uses: then no layer is judged unused.
            if let Some(missing) = tops.iter().find(|t| !t.is_file()) {
                tracing::warn!(
                    "gc: root layer {} is missing; keeping every layer",
                    missing.display()
                );
            } else {
                for layer in disk_layers::unreferenced(&candidates, &tops)? {
                    match std::fs::remove_file(&layer) {
                        Ok(()) => stats.layers.push(layer),
                        Err(e) => tracing::warn!("gc: removing {}: {e}", layer.display()),
                    }
                }
            }
            if let Some(max) = cache_max
                && cache.is_dir()
            {
                match super::cache_bound::bound(&cache, max, &cache_users) {
                    Ok(evicted) => stats.evicted = evicted,
                    Err(e) => tracing::warn!("gc: bounding {}: {e}", cache.display()),
                }
            }
            Ok(stats)
        })
        .await?
    }
}
