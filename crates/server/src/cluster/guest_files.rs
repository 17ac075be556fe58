//! A frozen guest's files as they leave their node, content-addressed
//! ([`sandfork_cluster::files`]): a durable pause's in the object store, a fork's
//! served to the nodes making its other children. Both are described the
//! same way and placed the same way on the node that takes them: shared
//! files (sealed layers, memory files) into the cluster cache, the VMM
//! state beside the guest, made to name the cached copies.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use sandfork_cluster::files::{self, ChunkSource, FileError, StoredFile};
use serde::{Deserialize, Serialize};

use super::cache;
use super::durable::DurableError;

/// What a guest frozen on one node is made of.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestFiles {
    pub state: Option<StoredFile>,
    /// Base first.
    pub memory: Vec<StoredFile>,
    /// Top layer first.
    pub disk: Vec<StoredFile>,
    /// The size of the raw image below the layers (the node's root image).
    pub raw_base_size: Option<u64>,
}

impl GuestFiles {
    /// Fetches the layers below the top `skip` into the cache, bottom up,
    /// each naming the copy below it (the lowest this node's `rootfs`, which
    /// must be the image they were made on). Returns the highest copy.
    pub async fn cache_layers<S: ChunkSource>(
        &self,
        skip: usize,
        cache_dir: &Path,
        source: &S,
        rootfs: &Path,
    ) -> Result<PathBuf, DurableError> {
        let mut below = rootfs.to_owned();
        for stored in self.disk.iter().skip(skip).rev() {
            below = cache::cached(cache_dir, source, stored, Some(&below)).await?;
        }
        Ok(below)
    }

    /// Fetches the memory files into the cache and the VMM state to
    /// `state`, made to name the cached copies. Returns the top memory
    /// file; None when there is no state.
    pub async fn place_state<S: ChunkSource>(
        &self,
        cache_dir: &Path,
        source: &S,
        state: &Path,
    ) -> Result<Option<PathBuf>, DurableError> {
        let Some(stored) = &self.state else {
            return Ok(None);
        };
        let mut memory = Vec::new();
        for stored in &self.memory {
            memory.push(cache::cached(cache_dir, source, stored, None).await?);
        }
        let top = memory.last().cloned().ok_or_else(|| {
            DurableError::Incompatible("the frozen guest's state maps no memory".into())
        })?;
        let fetched = state.with_extension("moved");
        files::download(source, stored, &fetched).await?;
        let relocated = vmm_driver::snapshot_state::relocate(&fetched, state, &memory);
        let _ = std::fs::remove_file(&fetched);
        relocated.map_err(|e| DurableError::Relocate {
            what: "relocating the state",
            path: state.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Some(top))
    }

    /// Fetches a frozen guest that new sandboxes stack on (a fork's, a
    /// template's): every layer into the cache (see
    /// [`GuestFiles::cache_layers`]) and the state to `state` (see
    /// [`GuestFiles::place_state`]). Returns the copies of the sealed top
    /// layer and of the top memory file.
    pub async fn place_sealed<S: ChunkSource>(
        &self,
        cache_dir: &Path,
        source: &S,
        rootfs: &Path,
        state: &Path,
    ) -> Result<(PathBuf, PathBuf), DurableError> {
        if self.disk.is_empty() {
            return Err(DurableError::Incompatible(
                "the frozen guest has no disk".into(),
            ));
        }
        let sealed = self.cache_layers(0, cache_dir, source, rootfs).await?;
        let mem = self
            .place_state(cache_dir, source, state)
            .await?
            .ok_or_else(|| DurableError::Incompatible("the frozen guest has no state".into()))?;
        Ok((sealed, mem))
    }
}

/// What was made of files that do not change once written (memory files,
/// sealed layers), by path: a template's are read once, not at every pause
/// or fork. An entry holds while the file keeps the size and modification
/// time it had.
pub struct Known<T> {
    made: Mutex<HashMap<PathBuf, Made<T>>>,
}

impl<T> std::fmt::Debug for Known<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Known").finish_non_exhaustive()
    }
}

/// What was made of a file, and its size and modification time then.
struct Made<T> {
    len: u64,
    modified: Option<SystemTime>,
    made: T,
}

impl<T> Default for Known<T> {
    fn default() -> Self {
        Known {
            made: Mutex::new(HashMap::new()),
        }
    }
}

impl<T: Clone> Known<T> {
    /// What `make` made of `path` before, or what it makes now.
    pub async fn get_or_make<E: From<FileError>>(
        &self,
        path: &Path,
        make: impl AsyncFnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        self.get_or_make_if(path, |_| true, make).await
    }

    /// [`Known::get_or_make`], where what was made before counts only if
    /// `holds` says it still holds.
    pub async fn get_or_make_if<E: From<FileError>>(
        &self,
        path: &Path,
        holds: impl Fn(&T) -> bool,
        make: impl AsyncFnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let meta = std::fs::metadata(path).map_err(|e| FileError::Io {
            what: "reading",
            path: path.to_owned(),
            source: e,
        })?;
        let (len, modified) = (meta.len(), meta.modified().ok());
        if let Some(known) = self.lock().get(path)
            && known.len == len
            && known.modified == modified
            && holds(&known.made)
        {
            return Ok(known.made.clone());
        }
        let made = make().await?;
        self.lock().insert(
            path.to_owned(),
            Made {
                len,
                modified,
                made: made.clone(),
            },
        );
        Ok(made)
    }

    #[cfg(test)]
    pub fn knows(&self, path: &Path) -> bool {
        self.lock().contains_key(path)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Made<T>>> {
        self.made.lock().unwrap_or_else(|p| p.into_inner())
    }
}
