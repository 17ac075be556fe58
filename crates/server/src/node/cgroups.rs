//! Every guest's VMM in a cgroup v2 group of its own, limited to what its
//! sandbox asked for: CPU time of its vCPUs, its memory plus the VMM's own
//! overhead, a bounded number of threads, an equal share of disk time. The
//! node's groups live under `<parent>/<the node's run dir name>`, so two
//! nodes on one host never touch each other's.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cgroup::{Cgroups, Group, Limits};
use vmm_driver::process::VmmProcess;

use crate::node::capacity::Ask;

/// How the node confines its VMMs (`serve --cgroup-parent`, `--no-cgroups`).
#[derive(Debug, Clone)]
pub struct CgroupConfig {
    /// Under the cgroup2 mount.
    pub parent: PathBuf,
    /// Memory a VMM may use beyond its guest's (heap, device buffers, page
    /// tables of the guest mapping).
    pub vmm_overhead_mib: u64,
}

impl Default for CgroupConfig {
    fn default() -> CgroupConfig {
        CgroupConfig {
            parent: PathBuf::from("sandfork"),
            vmm_overhead_mib: 64,
        }
    }
}

/// The node's parent group.
#[derive(Debug)]
pub struct NodeCgroups {
    groups: Cgroups,
    overhead_mib: u64,
}

impl NodeCgroups {
    /// Opens the node's parent group and removes the empty groups a stopped
    /// server left (a running VMM's group is never empty). Without cgroup v2
    /// and its controllers, the node runs its VMMs unconfined and says so.
    pub fn open(config: &CgroupConfig, run_dir: &Path) -> Option<Arc<NodeCgroups>> {
        let node = run_dir
            .file_name()
            .map(Path::new)
            .unwrap_or(Path::new("node"));
        match Cgroups::open(&config.parent.join(node)) {
            Ok(groups) => {
                let node = NodeCgroups {
                    groups,
                    overhead_mib: config.vmm_overhead_mib,
                };
                let removed = node.remove_empty();
                tracing::info!(
                    "cgroups: each VMM in a group of its own under {} ({removed} empty ones removed)",
                    node.groups.path().display()
                );
                Some(Arc::new(node))
            }
            Err(e) => {
                tracing::warn!("cgroups: VMMs run without limits of their own: {e}");
                None
            }
        }
    }

    /// Puts `vm` in a new group limited to what `ask` holds.
    pub fn confine(&self, vm: &VmmProcess, ask: &Ask) -> Result<SandboxGroup, cgroup::Error> {
        let vcpus = u32::try_from(ask.vcpus).unwrap_or(u32::MAX);
        let limits = Limits::for_guest(vcpus, ask.memory_mib, self.overhead_mib);
        let group = self.groups.create(&group_name(vm), &limits)?;
        let group = SandboxGroup { group, keep: false };
        group.group.add_process(vm.pid())?;
        Ok(group)
    }

    /// The group of a VMM adopted after a restart.
    pub fn adopt(&self, vm: &VmmProcess) -> Option<SandboxGroup> {
        let group = self.groups.adopt(&group_name(vm))?;
        Some(SandboxGroup { group, keep: false })
    }

    fn remove_empty(&self) -> usize {
        let Ok(names) = self.groups.names() else {
            return 0;
        };
        names
            .iter()
            .filter_map(|name| self.groups.adopt(name))
            .filter(|g| g.processes().is_ok_and(|p| p.is_empty()))
            .filter(|g| g.remove(Duration::ZERO).is_ok())
            .count()
    }
}

/// A VMM's group is named as its directory is (unique on the node).
fn group_name(vm: &VmmProcess) -> String {
    vm.dir()
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("vmm")
        .to_owned()
}

/// A running guest's group: removed when dropped, which [`crate::node::launch::Launched`]
/// does after its VMM is gone.
#[derive(Debug)]
pub struct SandboxGroup {
    group: Group,
    keep: bool,
}

impl SandboxGroup {
    pub fn path(&self) -> &Path {
        self.group.path()
    }

    /// Leaves the group for a later server to adopt with its VMM.
    pub fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for SandboxGroup {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        if let Err(e) = self.group.remove(Duration::from_secs(2)) {
            tracing::warn!("cgroups: {e}");
        }
    }
}
