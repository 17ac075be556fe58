//! The jail the node's VMMs run in (see `vmm_driver::process::Jail`): what
//! of the host each VMM sees. Paths are exposed at their own paths, so the
//! paths the server names in API calls, snapshot state files and disk layer
//! headers hold inside the jail too. The data directories start empty in
//! every jail: a VMM sees there only the files and directories the calls it
//! was sent named (its disk's layers, the snapshot it loads and the memory
//! files that names, its snapshot and fork destinations), not its
//! neighbours'.

use std::path::{Path, PathBuf};

use vmm_driver::process::Jail;

use crate::node::config::Config;
use crate::node::store::Store;

/// How the node jails its VMMs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JailConfig {
    /// A VMM runs as uid and gid `uid_base` + its host pid: a range as wide
    /// as the host's `pid_max` that no other user of the host should use.
    pub uid_base: u32,
}

/// Far above the ids distributions hand out and the subordinate ranges
/// rootless containers use (100000 up), below 2^31.
pub const DEFAULT_UID_BASE: u32 = 1_500_000_000;

impl Default for JailConfig {
    fn default() -> JailConfig {
        JailConfig {
            uid_base: DEFAULT_UID_BASE,
        }
    }
}

/// The directories under the data dir a VMM works in (created at start):
/// sandboxes' layers and pauses, templates and snapshots, forks' files,
/// resumed pauses fetched from the cluster, volumes' disks. Not the store
/// or the API key.
pub fn data_dirs(config: &Config) -> [PathBuf; 5] {
    [
        config.sandboxes_dir(),
        config.templates_dir(),
        config.data_dir.join("forks"),
        config.cluster_cache_dir(),
        config.volumes_dir(),
    ]
}

/// The jail of this node's VMMs: the data directories they work in, staged
/// (each VMM sees in them what it is handed, read-only unless it writes
/// it, which is given to it before the call that names it), and read-only
/// the directories of the kernels and root images that templates boot from
/// or stack their layers on (the node's and those its templates recorded),
/// the build cache's root images and image layers, and the VMM's shared
/// libraries.
pub fn vmm_jail(jail: &JailConfig, config: &Config, store: &Store) -> Jail {
    let mut read_only: Vec<PathBuf> = Vec::new();
    let mut add_parent = |file: &Path| {
        if let Some(dir) = absolute(file).parent()
            && dir != Path::new("/")
            && !read_only.iter().any(|d| d == dir)
        {
            read_only.push(dir.to_owned());
        }
    };
    add_parent(&config.kernel);
    add_parent(&config.rootfs);
    for t in store.templates().unwrap_or_default() {
        add_parent(&t.kernel);
        add_parent(&t.rootfs);
    }
    let cache = config.build_cache_dir();
    // The root images builds make, and the layers images are stored as.
    for built in [
        template_build::templates_in(&cache),
        template_build::layer_store::layers_in(&cache),
    ] {
        let built = absolute(&built);
        // A jail binds what exists when its VMM starts, and the pool's VMMs
        // start before a fresh node's first image build makes this directory.
        if let Err(e) = std::fs::create_dir_all(&built) {
            tracing::warn!(
                "making {}: {e} (VMMs started before it exists cannot boot the templates built \
                 there)",
                built.display()
            );
        }
        read_only.push(built);
    }
    let staged = data_dirs(config).iter().map(|d| absolute(d)).collect();
    Jail::new(jail.uid_base, Vec::new(), read_only, &config.vmm).with_staged(staged)
}

/// Whether this process may build jails (it must be root); if not, one
/// warning, and the VMMs run unjailed as this process's user.
pub fn can_jail() -> bool {
    let root = rustix::process::geteuid().is_root();
    if !root {
        tracing::warn!("not root: VMMs run unjailed (pass --no-jail to say so)");
    }
    root
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}
