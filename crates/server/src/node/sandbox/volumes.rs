//! Volumes' records: made, read and removed for a team; and the mounts of a
//! sandbox: resolved for its create and mounted in its guest (see
//! [`crate::node::volume`] for what a volume is and how it reaches a
//! sandbox).

use std::path::{Path, PathBuf};
use std::time::Duration;

use disk_layers::LayeredDisk;

use super::live::Phase;
use super::{CreateParams, Manager, SandboxError};
use crate::node::clock::now_ms;
use crate::node::ids;
use crate::node::store::{SandboxRecord, TemplateRecord, VolumeMount};
use crate::node::volume::{self, VolumeError, VolumeRecord};

/// How long the guest may take to mount one volume.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(60);

fn io(what: String) -> impl FnOnce(std::io::Error) -> VolumeError {
    move |source| VolumeError::Io { what, source }
}

impl Manager {
    /// Makes volume `name` of `team`: its disk of `size_mb` MiB (none: the
    /// default) in its own directory, then its record.
    pub async fn create_volume(
        &self,
        team: &str,
        name: &str,
        size_mb: Option<u64>,
    ) -> Result<VolumeRecord, VolumeError> {
        volume::check_name(name)?;
        let bytes = volume::size_bytes(size_mb)?;
        let _changes = self.volume_changes.lock().await;
        if self
            .store
            .volumes()?
            .iter()
            .any(|v| v.team == team && v.name == name)
        {
            return Err(VolumeError::NameTaken(name.to_owned()));
        }
        let id = ids::random_uuid().map_err(io("generating a volume id".into()))?;
        let token = ids::token().map_err(io("generating a volume token".into()))?;
        let dir = self.config.volumes_dir().join(&id);
        let made = dir.clone();
        let disk = tokio::task::spawn_blocking(move || make_disk(&made, bytes))
            .await
            .map_err(|e| VolumeError::Io {
                what: "making a volume's disk".into(),
                source: std::io::Error::other(e),
            })??;
        let record = VolumeRecord {
            id,
            team: team.to_owned(),
            name: name.to_owned(),
            size_mb: bytes >> 20,
            dir,
            disk,
            uses_dirs: Vec::new(),
            token,
            created_at_ms: now_ms(),
        };
        if let Err(e) = self.store.put_volume(&record) {
            remove_dir(record.dir.clone()).await;
            return Err(e.into());
        }
        Ok(record)
    }

    /// `team`'s volumes, oldest first.
    pub fn volumes(&self, team: &str) -> Result<Vec<VolumeRecord>, VolumeError> {
        let mut all: Vec<VolumeRecord> = self
            .store
            .volumes()?
            .into_iter()
            .filter(|v| v.team == team)
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all)
    }

    /// `team`'s volume `id`; another team's is not found, as an unknown one.
    pub fn volume(&self, team: &str, id: &str) -> Result<VolumeRecord, VolumeError> {
        self.store
            .volume(id)?
            .filter(|v| v.team == team)
            .ok_or_else(|| VolumeError::NotFound(id.to_owned()))
    }

    /// Removes `team`'s volume `id`, record and disk, unless a sandbox
    /// (running or paused) mounts it or a copy of it, or a snapshot keeps it.
    pub async fn delete_volume(&self, team: &str, id: &str) -> Result<(), VolumeError> {
        let _changes = self.volume_changes.lock().await;
        let v = self.volume(team, id)?;
        if let Some(sandbox) = self.volume_users(id)?.into_iter().next() {
            return Err(VolumeError::InUse {
                id: id.to_owned(),
                sandbox,
            });
        }
        // A deleted snapshot (retired while sandboxes made from it live)
        // holds nothing of its own: those sandboxes' copies do.
        let snapshot = self
            .store
            .templates()?
            .into_iter()
            .find(|t| t.volume_mounts.iter().any(|m| m.volume_id == id));
        if let Some(t) = snapshot {
            return Err(VolumeError::Snapshotted {
                id: id.to_owned(),
                snapshot: t.id,
            });
        }
        self.store.remove_volume(id)?;
        // A directory a crash leaves here goes at the next start.
        remove_dir(v.dir).await;
        Ok(())
    }

    /// The sandboxes whose records mount volume `id`, or a copy of it.
    fn volume_users(&self, id: &str) -> Result<Vec<String>, VolumeError> {
        Ok(self
            .store
            .sandboxes()?
            .into_iter()
            .filter(|s| s.volume_mounts.iter().any(|m| m.volume_id == id))
            .map(|s| s.id)
            .collect())
    }

    /// The mounts `params` asks for on `template`, for `team`: each a
    /// volume of the team by name, in the slots in order. Refused (400)
    /// what cannot be mounted as asked, and (409) a volume another sandbox
    /// mounts: a layered disk has one writer. Called under
    /// `volume_changes`, held until the create's record names them.
    pub(super) fn mounts_for(
        &self,
        team: &str,
        template: &TemplateRecord,
        params: &CreateParams,
    ) -> Result<Vec<VolumeMount>, SandboxError> {
        let asked = &params.volume_mounts;
        if asked.is_empty() {
            return Ok(Vec::new());
        }
        let invalid = |m: String| Err(VolumeError::Invalid(m).into());
        if !template.volume_mounts.is_empty() {
            return invalid(format!(
                "volumeMounts: snapshot {} brings its own volumes' copies in its slots; more \
                 volumes in a sandbox made from it are not supported yet",
                template.id
            ));
        }
        if !params.auto_pause_memory {
            return invalid(
                "autoPauseMemory: false with volumeMounts: the resume of a filesystem-only \
                 pause (a cold boot) does not attach volumes yet"
                    .into(),
            );
        }
        if template.filesystem_only {
            return invalid(format!(
                "volumeMounts: {} is a filesystem-only snapshot, whose sandboxes cold-boot, and \
                 a cold boot does not attach volumes yet",
                template.id
            ));
        }
        if template.volume_slots == 0 {
            return invalid(format!(
                "volumeMounts: template {} was built before volumes and has no slots for \
                 them; rebuild it",
                template.id
            ));
        }
        if asked.len() > template.volume_slots {
            return invalid(format!(
                "volumeMounts: at most {} volumes in a sandbox of template {}, not {}",
                template.volume_slots,
                template.id,
                asked.len()
            ));
        }
        let volumes = self.store.volumes()?;
        let sandboxes = self.store.sandboxes()?;
        let mut mounts: Vec<VolumeMount> = Vec::with_capacity(asked.len());
        for (slot, m) in asked.iter().enumerate() {
            volume::check_mount_path(&m.path)?;
            let Some(v) = volumes.iter().find(|v| v.team == team && v.name == m.name) else {
                return invalid(format!(
                    "volumeMounts: no volume named {:?} (make it with POST /volumes)",
                    m.name
                ));
            };
            if mounts.iter().any(|other| other.volume_id == v.id) {
                return invalid(format!("volumeMounts: volume {:?} named twice", m.name));
            }
            let path = m.path.trim_end_matches('/');
            if mounts.iter().any(|other| other.path == path) {
                return invalid(format!("volumeMounts: two volumes at {path}"));
            }
            let user = sandboxes.iter().find(|s| {
                s.volume_mounts
                    .iter()
                    .any(|other| other.volume_id == v.id && !other.copy)
            });
            if let Some(user) = user {
                return Err(VolumeError::InUse {
                    id: v.id.clone(),
                    sandbox: user.id.clone(),
                }
                .into());
            }
            mounts.push(VolumeMount {
                volume_id: v.id.clone(),
                name: v.name.clone(),
                slot,
                path: path.to_owned(),
                read_only: false,
                disk: v.disk.clone(),
                copy: false,
            });
        }
        Ok(mounts)
    }

    /// After a fork (or a snapshot) of a sandbox whose mounts are now
    /// `mounts`, on new layers in `fork_dir` (the fork's directory, or the
    /// sandbox's own for a snapshot): each volume (not a copy) is on its
    /// new layer there, which the next sandbox to mount it writes, and
    /// keeps that directory.
    pub(super) fn volumes_moved(
        &self,
        mounts: &[VolumeMount],
        fork_dir: &Path,
    ) -> Result<(), SandboxError> {
        for m in mounts.iter().filter(|m| !m.copy) {
            let mut v = self
                .store
                .volume(&m.volume_id)?
                .ok_or_else(|| VolumeError::NotFound(m.volume_id.clone()))?;
            v.disk = m.disk.clone();
            if !v.uses_dirs.iter().any(|d| d == fork_dir) {
                v.uses_dirs.push(fork_dir.to_owned());
            }
            self.store.put_volume(&v)?;
        }
        Ok(())
    }

    /// The copies of snapshot `template`'s volumes for a sandbox made from
    /// it in `dir`: a new layer on each sealed one, in its slot at its path,
    /// the sandbox's own (its writes stay its own). Called under
    /// `volume_changes`, held until the sandbox's record names them (a
    /// deleted snapshot no longer keeps its volumes from a delete).
    pub(super) async fn snapshot_copies(
        &self,
        template: &TemplateRecord,
        dir: &Path,
    ) -> Result<Vec<VolumeMount>, SandboxError> {
        let copies = copies_in(&template.volume_mounts, dir);
        let made = copies.clone();
        tokio::task::spawn_blocking(move || {
            made.iter()
                .try_for_each(|(sealed, copy)| LayeredDisk::create(sealed, &copy.disk).map(drop))
        })
        .await??;
        Ok(copies.into_iter().map(|(_, copy)| copy).collect())
    }

    /// The volumes' lock when `needed` (a change touches some volume: a
    /// mount, a fork or snapshot of a sandbox with mounts, a copy of a
    /// snapshot's), else none: creates, deletes and moves of volumes are
    /// serialised on it.
    pub(super) async fn volume_changes_if(
        &self,
        needed: bool,
    ) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        match needed {
            true => Some(self.volume_changes.lock().await),
            false => None,
        }
    }

    /// Refuses (409) a change of `record`'s sandbox that would lose or
    /// split the volumes it mounts: `state` says which and why.
    pub(super) fn refuse_mounted(
        record: &SandboxRecord,
        state: &'static str,
    ) -> Result<(), SandboxError> {
        if record.volume_mounts.is_empty() {
            return Ok(());
        }
        Err(SandboxError::Conflict {
            id: record.id.clone(),
            state,
        })
    }

    /// The directories holding the disks of `mounts`' volumes (their own
    /// and the forks' that gave them new layers): a sandbox mounting them
    /// stacks on these.
    pub(super) fn volume_dirs(&self, mounts: &[VolumeMount]) -> Result<Vec<PathBuf>, SandboxError> {
        let mut dirs = Vec::new();
        for m in mounts {
            let v = self
                .store
                .volume(&m.volume_id)?
                .ok_or_else(|| VolumeError::NotFound(m.volume_id.clone()))?;
            dirs.push(v.dir);
            dirs.extend(v.uses_dirs);
        }
        Ok(dirs)
    }

    /// Mounts `mounts` (of `record`'s) in its running guest, as root
    /// through its agent ([`volume::mount_script`]).
    pub(super) async fn mount_volumes(
        &self,
        record: &SandboxRecord,
        mounts: &[VolumeMount],
    ) -> Result<(), SandboxError> {
        if mounts.is_empty() {
            return Ok(());
        }
        let sandbox = self.sandbox(&record.id)?;
        let guest = sandbox.guest.lock().await;
        let Some(launched) = guest.as_ref() else {
            return Err(Phase::Gone.refusal(&record.id));
        };
        let agent = launched
            .vm
            .agent()
            .with_access_token(record.access_token.as_deref())
            .with_timeout(MOUNT_TIMEOUT);
        for m in mounts {
            let script = volume::mount_script(m.slot, &m.path, m.read_only);
            let out = agent.run_argv("/bin/sh", &["-c", &script]).await?;
            if out.exit_code != 0 {
                return Err(VolumeError::Mount {
                    path: m.path.clone(),
                    detail: format!("exit {}: {}", out.exit_code, out.stderr.trim()),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Removes what is under the node's `volumes/` without a record (a
    /// create or delete a crash cut short). At start, before the node
    /// serves; returns what went.
    pub fn forget_unrecorded_volumes(&self) -> Result<Vec<PathBuf>, VolumeError> {
        let recorded: Vec<PathBuf> = self.store.volumes()?.into_iter().map(|v| v.dir).collect();
        let Ok(entries) = std::fs::read_dir(self.config.volumes_dir()) else {
            return Ok(Vec::new());
        };
        let mut removed = Vec::new();
        for path in entries.flatten().map(|e| e.path()) {
            if recorded.contains(&path) {
                continue;
            }
            let gone = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match gone {
                Ok(()) => removed.push(path),
                Err(e) => tracing::warn!("removing {}: {e}", path.display()),
            }
        }
        Ok(removed)
    }
}

/// Each of a snapshot's sealed `mounts` with the copy a sandbox made from it
/// in `dir` gets (`vol<slot>.layer` there, over the sealed layer).
fn copies_in(mounts: &[VolumeMount], dir: &Path) -> Vec<(PathBuf, VolumeMount)> {
    mounts
        .iter()
        .map(|m| {
            let copy = VolumeMount {
                disk: dir.join(format!("{}.layer", volume::slot_drive(m.slot))),
                copy: true,
                ..m.clone()
            };
            (m.disk.clone(), copy)
        })
        .collect()
}

/// Makes `dir` and a volume's disk of `bytes` in it; on failure, nothing.
fn make_disk(dir: &Path, bytes: u64) -> Result<PathBuf, VolumeError> {
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    volume::create_disk(dir, bytes).map_err(|e| {
        drop(std::fs::remove_dir_all(dir));
        e.into()
    })
}

async fn remove_dir(dir: PathBuf) {
    let removed = tokio::task::spawn_blocking(move || {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("removing {}: {e}", dir.display()))
    })
    .await;
    match removed {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("volumes: {e}"),
        Err(e) => tracing::warn!("volumes: removing a directory: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(slot: usize, disk: &str, copy: bool) -> VolumeMount {
        VolumeMount {
            volume_id: format!("v{slot}"),
            name: format!("name{slot}"),
            slot,
            path: format!("/data{slot}"),
            read_only: false,
            disk: disk.into(),
            copy,
        }
    }

    /// A sandbox made from a snapshot gets, per sealed volume layer, its own
    /// layer in its directory (one per slot), a copy at the same path under
    /// the same name, whatever the source's mount was.
    #[test]
    fn a_snapshots_copies_are_the_new_sandboxs_own() {
        let sealed = [
            mount(0, "/d/volumes/v0/volume.layer", false),
            mount(1, "/d/forks/f/vol1-child0.layer", true),
        ];
        let copies = copies_in(&sealed, Path::new("/d/sandboxes/s"));
        assert_eq!(copies.len(), 2);
        for ((under, copy), m) in copies.iter().zip(&sealed) {
            assert_eq!(under, &m.disk);
            assert_eq!(
                copy,
                &VolumeMount {
                    disk: PathBuf::from(format!("/d/sandboxes/s/vol{}.layer", m.slot)),
                    copy: true,
                    ..m.clone()
                }
            );
        }
    }
}
