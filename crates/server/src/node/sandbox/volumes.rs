//! Volumes' records: made, read and removed for a team (see
//! [`crate::node::volume`] for what a volume is and how it reaches a
//! sandbox).

use std::path::{Path, PathBuf};

use super::Manager;
use crate::node::clock::now_ms;
use crate::node::ids;
use crate::node::volume::{self, VolumeError, VolumeRecord};

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
    /// (running or paused) mounts it.
    pub async fn delete_volume(&self, team: &str, id: &str) -> Result<(), VolumeError> {
        let _changes = self.volume_changes.lock().await;
        let v = self.volume(team, id)?;
        if let Some(sandbox) = self.volume_users(id)?.into_iter().next() {
            return Err(VolumeError::InUse {
                id: id.to_owned(),
                sandbox,
            });
        }
        self.store.remove_volume(id)?;
        // A directory a crash leaves here goes at the next start.
        remove_dir(v.dir).await;
        Ok(())
    }

    /// The sandboxes whose records mount volume `id`.
    fn volume_users(&self, id: &str) -> Result<Vec<String>, VolumeError> {
        Ok(self
            .store
            .sandboxes()?
            .into_iter()
            .filter(|s| s.volume_mounts.iter().any(|m| m.volume_id == id))
            .map(|s| s.id)
            .collect())
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
