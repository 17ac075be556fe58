//! The bound on `<data dir>/cluster-cache`: the files a node fetched from
//! the object store or another node (see `crate::cluster::cache`) stay for the
//! next sandbox of the same template, until the cache holds more than its
//! bound ([`crate::node::config::Config::cluster_cache_max`], by default a quarter
//! of the data dir's file system). Then the local collector evicts the
//! files no sandbox or template uses, least recently used first, until it
//! fits again. A file is used when a disk chain of a sandbox or template
//! stacks on it or a VMM state under the directories they use maps it
//! (what a running, paused or forked sandbox may load or resume from), or
//! a template names it as its memory or raw image. Recency is the file's
//! access time: a fetch that finds the file cached marks it (the kernel
//! alone may not, on a `relatime` or `noatime` mount), and so does each
//! pass that finds it used; a file used less than [`MIN_IDLE`] ago is never
//! evicted (a take-in whose record is not written yet).

use std::collections::BTreeSet;
use std::fs::FileTimes;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// A cached file used this recently stays, over the bound or not.
pub const MIN_IDLE: Duration = Duration::from_secs(600);

/// What the cache's users are, from the node's records (gathered under the
/// collector's lock, read outside it).
pub(crate) struct CacheUsers {
    /// Top layers of every sandbox's and template's disk.
    pub tops: Vec<PathBuf>,
    /// Directories whose VMM states (`*.state`) may be loaded.
    pub dirs: Vec<PathBuf>,
    /// Files named directly (templates' memory and raw images, states).
    pub files: Vec<PathBuf>,
}

/// What one pass evicted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evicted {
    pub files: Vec<PathBuf>,
    /// Bytes on disk they held.
    pub bytes: u64,
}

/// Marks `path` as used now (its access time), for the bound's LRU order.
pub fn mark_used(path: &Path) {
    let marked = std::fs::File::open(path)
        .and_then(|f| f.set_times(FileTimes::new().set_accessed(SystemTime::now())));
    if let Err(e) = marked {
        tracing::debug!("cluster cache: marking {} used: {e}", path.display());
    }
}

/// The bound when none is configured: a quarter of the file system `dir`
/// is on (None if it cannot be read).
pub fn default_bound(dir: &Path) -> Option<u64> {
    let fs = rustix::fs::statvfs(dir).ok()?;
    Some(fs.f_blocks.saturating_mul(fs.f_frsize) / 4)
}

/// Evicts unused files of `cache` (LRU first) while it holds more than
/// `max` bytes on disk.
pub(crate) fn bound(cache: &Path, max: u64, users: &CacheUsers) -> std::io::Result<Evicted> {
    let mut cached = Vec::new();
    let mut total = 0u64;
    for entry in std::fs::read_dir(cache)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        // Fetches under way (`<digest>.fetching-…`) are not the cache's yet.
        let name = entry.file_name();
        if !meta.is_file() || name.to_string_lossy().contains('.') {
            continue;
        }
        let held = meta.blocks() * 512;
        total += held;
        let used_at = meta.accessed().ok().max(meta.modified().ok());
        cached.push((entry.path(), held, used_at));
    }
    let mut evicted = Evicted::default();
    if total <= max {
        return Ok(evicted);
    }
    let Some(used) = used_files(cache, users) else {
        tracing::warn!(
            "cluster cache: {} MiB over its bound of {} MiB, but what uses it is unknown; \
             nothing evicted",
            (total - max) >> 20,
            max >> 20
        );
        return Ok(evicted);
    };
    let now = SystemTime::now();
    let idle = |at: Option<SystemTime>| {
        at.and_then(|t| now.duration_since(t).ok())
            .is_some_and(|d| d >= MIN_IDLE)
    };
    let mut unused = Vec::new();
    for (path, held, used_at) in cached {
        if used.contains(&path) {
            mark_used(&path);
        } else if idle(used_at) {
            unused.push((used_at, path, held));
        }
    }
    unused.sort();
    for (_, path, held) in unused {
        if total <= max {
            break;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {
                total -= held;
                evicted.bytes += held;
                evicted.files.push(path);
            }
            Err(e) => tracing::warn!("cluster cache: evicting {}: {e}", path.display()),
        }
    }
    if total > max {
        tracing::warn!(
            "cluster cache: {} MiB over its bound of {} MiB with what is used or was used \
             in the last {} s",
            (total - max) >> 20,
            max >> 20,
            MIN_IDLE.as_secs()
        );
    }
    Ok(evicted)
}

/// The files of `cache` that `users` use; None when a chain or state cannot
/// be read (then what it uses is unknown).
fn used_files(cache: &Path, users: &CacheUsers) -> Option<BTreeSet<PathBuf>> {
    let mut used = BTreeSet::new();
    for top in &users.tops {
        match disk_layers::chain_files(top) {
            Ok(chain) => used.extend(chain),
            Err(e) => {
                tracing::warn!("cluster cache: the disk chain of {}: {e}", top.display());
                return None;
            }
        }
    }
    let mut states: Vec<PathBuf> = users.dirs.iter().flat_map(|d| states_in(d)).collect();
    states.extend(
        users
            .files
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "state"))
            .cloned(),
    );
    for state in states {
        match vmm_driver::snapshot_state::memory_files(&state) {
            Ok(memory) => used.extend(memory),
            // One removed since the records were read maps nothing.
            Err(_) if !state.exists() => {}
            Err(e) => {
                tracing::warn!(
                    "cluster cache: the memory files of {}: {e}",
                    state.display()
                );
                return None;
            }
        }
    }
    used.extend(users.files.iter().cloned());
    used.retain(|p| p.starts_with(cache));
    Some(used)
}

/// `*.state` files in `dir` and its subdirectories.
fn states_in(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(states_in(&p));
        } else if p.extension().is_some_and(|e| e == "state") {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use disk_layers::LayeredDisk;

    use super::*;
    use crate::node::store::{Store, TemplateRecord};

    const HOUR: Duration = Duration::from_secs(3600);

    /// A cached file of 1 MiB of data, last used `ago`.
    fn cached(cache: &Path, name: &str, ago: Duration) -> PathBuf {
        let path = cache.join(name);
        std::fs::write(&path, vec![0x5a; 1 << 20]).unwrap();
        used_at(&path, SystemTime::now() - ago);
        path
    }

    fn used_at(path: &Path, at: SystemTime) {
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_times(FileTimes::new().set_accessed(at).set_modified(at))
            .unwrap();
    }

    fn accessed(path: &Path) -> SystemTime {
        std::fs::metadata(path).unwrap().accessed().unwrap()
    }

    /// The node's collector, with the cache over its bound, evicts the
    /// unused files oldest first and stops once the cache fits, and never
    /// evicts a file a template's disk stacks on, its state maps or that
    /// it names as its memory, however old, nor one used a moment ago; the
    /// used ones are marked used.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_cache_bound_evicts_unused_files_oldest_first_and_never_a_used_one() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let raw = tmp.path().join("root.raw");
        std::fs::File::create(&raw)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let mut config = crate::node::sandbox::tests::offline_config(&data, raw.clone());
        let cache = config.cluster_cache_dir();
        std::fs::create_dir_all(&cache).unwrap();

        // Template `taken` as a take-in leaves it: its disk on a cached
        // sealed layer, its state mapping cached memory, all long unused.
        let (layer, mem, base_mem) = (
            cache.join("a1"),
            cache.join("a2"),
            cached(&cache, "a3", 9 * HOUR),
        );
        std::fs::write(&mem, vec![0x22; 1 << 20]).unwrap();
        let dir = config.templates_dir().join("taken");
        std::fs::create_dir_all(&dir).unwrap();
        let top = dir.join("root.layer");
        let disk = LayeredDisk::create(&raw, &layer).unwrap();
        disk.write_at(&[0xaa; 1 << 20], 0).unwrap();
        disk.seal_and_branch(&top, &[]).unwrap();
        drop(disk);
        let state = dir.join("vm.state");
        let mems = [base_mem.to_str().unwrap(), mem.to_str().unwrap()];
        vmm_driver::snapshot_state::test_support::state_file(&state, &mems).unwrap();
        for f in [&layer, &mem] {
            used_at(f, SystemTime::now() - 8 * HOUR);
        }
        // Unused: two old ones, one used a moment ago, a fetch under way.
        let older = cached(&cache, "b1", 3 * HOUR);
        let old = cached(&cache, "b2", 2 * HOUR);
        let recent = cached(&cache, "b3", Duration::from_secs(5));
        let fetching = cached(&cache, "b4.fetching-1-0", 5 * HOUR);

        let store = Store::open(&data.join("s.redb")).unwrap();
        store
            .put_template(&TemplateRecord {
                id: "taken".into(),
                dir: dir.clone(),
                snapshot: state,
                mem: mem.clone(),
                root_layer: top,
                root_drive_id: "rootfs".into(),
                rootfs: raw.clone(),
                vcpus: 1,
                mem_mib: 128,
                disk_size_mb: 8,
                ..Default::default()
            })
            .unwrap();
        let mut used = vec![layer.clone(), mem.clone(), base_mem.clone()];
        let total_held = |c: &Path| -> u64 {
            std::fs::read_dir(c)
                .unwrap()
                .flatten()
                .filter(|e| !e.file_name().to_string_lossy().contains('.'))
                .map(|e| e.metadata().unwrap().blocks() * 512)
                .sum()
        };
        // Room for all but one and a half of the old unused files: the
        // oldest goes, then the next, and then it fits.
        let held = std::fs::metadata(&older).unwrap().blocks() * 512;
        config.cluster_cache_max = Some(total_held(&cache) - held - held / 2);
        let manager = crate::node::sandbox::tests::with_store(config, store);

        let stats = manager.collect_garbage().await.unwrap();
        assert_eq!(stats.skipped, None);
        assert_eq!(stats.evicted.files, [older.clone(), old.clone()]);
        assert_eq!(stats.evicted.bytes, 2 * held);
        assert!(!older.exists() && !old.exists());
        used.extend([recent.clone(), fetching.clone()]);
        for f in &used {
            assert!(f.exists(), "{} was evicted", f.display());
        }
        // What is used is marked used now (and so is evicted last once
        // unused).
        let marked = SystemTime::now() - Duration::from_secs(60);
        assert!(accessed(&layer) > marked && accessed(&base_mem) > marked);

        // A bound of nothing: still nothing used, nor the recent one.
        let users = CacheUsers {
            tops: vec![dir.join("root.layer")],
            dirs: vec![dir.clone()],
            files: vec![mem.clone()],
        };
        let evicted = bound(&cache, 0, &users).unwrap();
        assert!(evicted.files.is_empty(), "{:?}", evicted.files);
        // Once unused (the template gone), all but the recent one go, the
        // least recently used first.
        let none = CacheUsers {
            tops: vec![],
            dirs: vec![],
            files: vec![],
        };
        for f in [&layer, &mem, &base_mem] {
            used_at(f, SystemTime::now() - HOUR);
        }
        used_at(&base_mem, SystemTime::now() - 2 * HOUR);
        let evicted = bound(&cache, 0, &none).unwrap();
        assert_eq!(evicted.files.first(), Some(&base_mem));
        assert_eq!(evicted.files.len(), 3);
        assert!(recent.exists() && fetching.exists());
    }
}
