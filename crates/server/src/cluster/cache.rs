//! `<data dir>/cluster-cache/<content digest>`: this node's copies of files
//! other nodes made and many sandboxes share (a template's memory and sealed
//! layers, a pause's or a fork's memory), fetched once from wherever they
//! come from (the object store, or the node holding them) and kept, within
//! a bound ([`crate::node::sandbox::cache_bound`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sandfork_cluster::files::{self, ChunkSource, FileError, StoredFile};

use super::durable::DurableError;

/// The cached copy of `stored` in `cache_dir`, fetched from `source` if
/// missing; a layer's copy names `parent` as its parent. Two fetches of one
/// file at once each write a copy of their own and the second rename wins
/// (the same content).
pub async fn cached<S: ChunkSource>(
    cache_dir: &Path,
    source: &S,
    stored: &StoredFile,
    parent: Option<&Path>,
) -> Result<PathBuf, DurableError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = cache_dir.join(stored.digest());
    if path.is_file() {
        // For the cache's bound: evicted least recently used first.
        crate::node::sandbox::cache_bound::mark_used(&path);
        return Ok(path);
    }
    std::fs::create_dir_all(cache_dir).map_err(|e| FileError::Io {
        what: "creating",
        path: cache_dir.to_owned(),
        source: e,
    })?;
    let fetching = path.with_extension(format!(
        "fetching-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let fetched = async {
        files::download(source, stored, &fetching).await?;
        if let Some(parent) = parent {
            set_parent(&fetching, parent)?;
        }
        std::fs::rename(&fetching, &path).map_err(|e| FileError::Io {
            what: "renaming",
            path: fetching.clone(),
            source: e,
        })?;
        Ok(path)
    }
    .await;
    if fetched.is_err() {
        let _ = std::fs::remove_file(&fetching);
    }
    fetched
}

pub fn set_parent(layer: &Path, parent: &Path) -> Result<(), DurableError> {
    disk_layers::set_parent_path(layer, parent).map_err(|e| DurableError::Relocate {
        what: "setting the parent of",
        path: layer.to_owned(),
        reason: e.to_string(),
    })
}

/// Checks that the raw image at the bottom of a moved disk, `size` bytes
/// where it was made, is this node's `rootfs` (nodes run the same image).
pub fn same_raw_base(rootfs: &Path, size: Option<u64>, what: &str) -> Result<(), DurableError> {
    let Some(size) = size else {
        return Ok(());
    };
    let here = std::fs::metadata(rootfs).map(|m| m.len()).ok();
    if here == Some(size) {
        return Ok(());
    }
    Err(DurableError::Incompatible(format!(
        "{what}'s disk stacks on a {size}-byte root image; this node's {} is {here:?} bytes \
         (nodes must run the same image)",
        rootfs.display()
    )))
}
