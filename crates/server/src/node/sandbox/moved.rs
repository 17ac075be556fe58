//! Paused sandboxes and templates moving between nodes: the files a paused
//! sandbox's resume (or a template's restore) reads, for a copy elsewhere,
//! and taking in a paused sandbox or a template whose files another node
//! wrote (placed by the caller, see the server's `crate::cluster::durable` and
//! `crate::cluster::templates`).

use std::path::{Path, PathBuf};

use super::live::Phase;
use super::{Manager, SandboxError, io, sync_files};
use crate::node::store::{SandboxRecord, SandboxState, TemplateRecord};

/// Everything a paused sandbox's resume reads.
#[derive(Debug, Clone)]
pub struct PausedFiles {
    pub record: SandboxRecord,
    pub guest: GuestPaths,
}

/// The files a frozen guest (a paused sandbox, a template) is restored from.
#[derive(Debug, Clone, Default)]
pub struct GuestPaths {
    /// Its VMM state (none for a sandbox paused without its memory).
    pub state: Option<PathBuf>,
    /// The memory files the state maps, base first, with the byte ranges
    /// it reads of each (None: all).
    pub memory: Vec<vmm_driver::snapshot_state::MemoryLayer>,
    /// Its root disk's layers, its own writable one first; the raw image
    /// below them is not among them (see `raw_base`).
    pub disk: Vec<PathBuf>,
    /// The raw image at the bottom of the disk, and its size.
    pub raw_base: Option<(PathBuf, u64)>,
}

impl Manager {
    /// Runs `with` on the files of paused sandbox `id`, which stays paused
    /// (a resume or kill waits) until it returns.
    pub async fn with_paused_files<R>(
        &self,
        id: &str,
        with: impl AsyncFnOnce(&PausedFiles) -> R,
    ) -> Result<R, SandboxError> {
        let _busy = self.activity.read().await;
        let sandbox = self.sandbox(id)?;
        let _guest = sandbox.guest.lock().await;
        if sandbox.phase() != Phase::Paused {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "not paused",
            });
        }
        let record = self.get(id)?;
        let top = self.root_layer(&record);
        let files = tokio::task::spawn_blocking(move || -> Result<PausedFiles, SandboxError> {
            let memory = match &record.snapshot {
                Some(s) => vmm_driver::snapshot_state::memory_layers(&s.state)
                    .map_err(|e| SandboxError::Unavailable(e.to_string()))?,
                None => Vec::new(),
            };
            let (disk, raw_base) = disk_files(&top)?;
            Ok(PausedFiles {
                guest: GuestPaths {
                    state: record.snapshot.as_ref().map(|s| s.state.clone()),
                    memory,
                    disk,
                    raw_base,
                },
                record,
            })
        })
        .await??;
        Ok(with(&files).await)
    }

    /// The files template `t` restores from: its state, the memory files
    /// the state maps and its sealed root layer with those below it.
    pub async fn template_files(&self, t: &TemplateRecord) -> Result<GuestPaths, SandboxError> {
        let (state, top, mem) = (t.snapshot.clone(), t.root_layer.clone(), t.mem.clone());
        tokio::task::spawn_blocking(move || {
            let mut memory = vmm_driver::snapshot_state::memory_layers(&state)
                .map_err(|e| SandboxError::Unavailable(e.to_string()))?;
            // A template booted in a scratch directory (`template::boot`, an
            // image's conversion too) has its state name its memory there;
            // the directory was renamed into the template's own since.
            if let Some(top) = memory.last_mut()
                && !top.0.exists()
            {
                top.0 = mem;
            }
            let (disk, raw_base) = disk_files(&top)?;
            Ok(GuestPaths {
                state: Some(state),
                memory,
                disk,
                raw_base,
            })
        })
        .await?
    }

    /// Takes in template `id` from another node, owned by `team` (None: the
    /// default team's): `place` writes its files into the directory it is
    /// given (the template's, new) and returns its record as this node
    /// keeps it. Refused if this node has a template `id`; on failure the
    /// directory goes.
    pub async fn adopt_template<E: From<SandboxError>>(
        &self,
        id: &str,
        team: Option<&str>,
        place: impl AsyncFnOnce(&Path) -> Result<TemplateRecord, E>,
    ) -> Result<TemplateRecord, E> {
        // Unrecorded until the end: the collector keeps off its directory.
        let _writing = self.writing_template(id);
        if self
            .store
            .template(id)
            .map_err(SandboxError::from)?
            .is_some()
        {
            return Err(
                SandboxError::Invalid(format!("template {id} is on this node already")).into(),
            );
        }
        let dir = self.config.templates_dir().join(id);
        // Left by an earlier take that did not finish: no record names it.
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io(format!("removing {}", dir.display())))?;
        }
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let placed = match place(&dir).await {
            Ok(t) if t.id == id && t.dir == dir => Ok(t),
            Ok(_) => Err(SandboxError::Invalid(format!(
                "template {id}: the moved record is not template {id} in {}",
                dir.display()
            ))
            .into()),
            Err(e) => Err(e),
        };
        let stored = async {
            let t = placed?;
            sync_files(vec![dir.clone(), self.config.templates_dir()]).await?;
            // Its owner before its record: no other team ever sees it unowned.
            let owner = crate::node::tenants::template_owner_key(id);
            self.store
                .set_owner(&owner, team)
                .map_err(SandboxError::from)?;
            self.store.put_template(&t).map_err(SandboxError::from)?;
            Ok::<_, E>(t)
        }
        .await;
        if stored.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
            if self.store.template(id).ok().flatten().is_none() {
                let _ = self
                    .store
                    .set_owner(&crate::node::tenants::template_owner_key(id), None);
            }
        }
        stored
    }

    /// Takes in paused sandbox `id` from another node: `place` writes its
    /// files into the directory it is given (the sandbox's, new) and
    /// returns its record as this node keeps it. Refused if this node has a
    /// sandbox `id` already. On failure the directory goes.
    pub async fn adopt_paused(
        &self,
        id: &str,
        place: impl AsyncFnOnce(&Path) -> Result<SandboxRecord, SandboxError>,
    ) -> Result<SandboxRecord, SandboxError> {
        let _busy = self.activity.read().await;
        if self.store.sandbox(id)?.is_some() || self.registry().get(id).is_some() {
            return Err(SandboxError::Invalid(format!(
                "sandbox {id} is on this node already"
            )));
        }
        let dir = self.sandbox_dir(id);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let placed = match place(&dir).await {
            Ok(r) if r.id == id && r.state == SandboxState::Paused => {
                sync_files(vec![dir.clone()]).await.map(|()| r)
            }
            Ok(_) => Err(SandboxError::Invalid(format!(
                "sandbox {id}: the moved record is not a paused sandbox {id}"
            ))),
            Err(e) => Err(e),
        };
        let stored = placed.and_then(|r| {
            self.store.put_sandbox(&r)?;
            Ok(r)
        });
        if stored.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        stored
    }
}

/// The layers of the disk whose top layer is `top`, it first, and the raw
/// image at the bottom with its size (not among the layers).
pub(super) fn disk_files(top: &Path) -> Result<DiskFiles, SandboxError> {
    let mut disk = disk_layers::chain_files(top)?;
    let mut raw_base = None;
    if let Some(last) = disk.last().cloned()
        && disk.len() > 1
        && !disk_layers::is_layer(&last)?
    {
        disk.pop();
        let size = std::fs::metadata(&last)
            .map_err(io(format!("reading the size of {}", last.display())))?
            .len();
        raw_base = Some((last, size));
    }
    Ok((disk, raw_base))
}

type DiskFiles = (Vec<PathBuf>, Option<(PathBuf, u64)>);

/// `record` as kept by a node that took it in, its files in `dir`: its
/// disk's writable layer `dir/root.layer`, its state `state` (None: paused
/// without memory) mapping `top_memory` last, nothing of the old node's
/// paths or links.
pub fn adopted_record(
    mut record: SandboxRecord,
    dir: &Path,
    state: Option<(PathBuf, PathBuf)>,
) -> SandboxRecord {
    record.state = SandboxState::Paused;
    record.root_layer = None;
    record.snapshot = state.map(|(state, mem)| crate::node::store::PausedSnapshot { state, mem });
    record.has_dependents = false;
    record.uses_snapshots = Vec::new();
    record.uses_dirs = vec![dir.to_owned()];
    record.vmm_dir = None;
    record.network.slot = None;
    record
}
