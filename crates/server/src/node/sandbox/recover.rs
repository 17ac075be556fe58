//! Restarts: running sandboxes' VMMs outlive the server (each in its own
//! directory under the node's run dir, its identity recorded there), are
//! released at shutdown and adopted at the next start; VMMs no sandbox owns
//! are stopped.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use vmm_api::InstanceState;
use vmm_driver::process::{ProcessIdentity, VmmProcess};

use super::live::{Phase, Sandbox};
use super::{ADOPT_AGENT_TIMEOUT, Manager, SandboxError};
use crate::node::capacity::Ask;
use crate::node::launch::Launched;
use crate::node::store::{SandboxRecord, SandboxState, Store};

/// Stops and removes every VMM directory in `run_dir` that no sandbox
/// recorded as running owns. Run at start, before anything spawns there.
pub fn reclaim_run_dir(run_dir: &Path, store: &Store) {
    let owned: HashSet<PathBuf> = match store.sandboxes() {
        Ok(all) => all
            .into_iter()
            .filter(|s| s.state == SandboxState::Running)
            .filter_map(|s| s.vmm_dir)
            .collect(),
        Err(e) => {
            // Without the records nothing can be told apart: leave it all.
            tracing::warn!("reclaiming VMM directories: {e}");
            return;
        }
    };
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return;
    };
    for dir in entries.flatten().map(|e| e.path()) {
        if owned.contains(&dir) {
            continue;
        }
        // A VMM whose starter crashed before writing its identity file is
        // found by its socket argument.
        let recorded = ProcessIdentity::read(&dir).filter(|p| p.is_alive());
        let by_socket = ProcessIdentity::started_with_arg(dir.join("api.sock").as_os_str())
            .into_iter()
            .filter(|p| Some(*p) != recorded);
        for process in recorded.into_iter().chain(by_socket) {
            tracing::info!("stopping VMM pid {} left in {}", process.pid, dir.display());
            process.kill();
        }
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
}

impl Manager {
    /// After a restart: registers every sandbox recorded, adopting the VMM
    /// of each one recorded as running (resuming one a pause or fork left
    /// paused); a sandbox whose VMM is gone or does not answer is removed,
    /// as a kill would.
    pub async fn recover(&self) {
        let records = match self.store.sandboxes() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("recovering sandboxes: {e}");
                return;
            }
        };
        for r in records {
            if self.registry().contains(&r.id) {
                continue;
            }
            if r.state == SandboxState::Paused {
                let sandbox = Sandbox::of_record(&r, Phase::Paused);
                self.registry().insert(sandbox);
                continue;
            }
            match self.adopt(&r).await {
                Ok(vm) => {
                    tracing::info!("sandbox {}: adopted its VMM (pid {})", r.id, vm.pid());
                    let r = self.follow_vmm_disk(r, &vm).await;
                    // Already running: it holds its share whatever the limits are now.
                    let hold = self.capacity.hold_for(
                        Ask::sandbox(u64::from(r.cpu_count), r.memory_mb),
                        Some(r.team()),
                    );
                    let sandbox = Sandbox::of_record(&r, Phase::Starting);
                    let mut guest = sandbox.guest.lock().await;
                    // Its network slot was adopted with the pool (if still there).
                    let lease = r
                        .network
                        .slot
                        .and_then(|s| self.pool.net()?.claim_adopted(s.id));
                    if r.network.slot.is_some() && lease.is_none() {
                        tracing::warn!("sandbox {}: its network slot is gone", r.id);
                    }
                    // Its cgroup too; one started unconfined (by a server
                    // without cgroups) is confined now.
                    let cgroup = self
                        .pool
                        .cgroups()
                        .and_then(|c| c.adopt(&vm).or_else(|| c.confine(&vm, &hold.held()).ok()));
                    let launched = Launched::adopted(vm, hold)
                        .with_network(lease)
                        .with_cgroup(cgroup);
                    if let Err(e) = self.run_guest(&sandbox, &mut guest, launched) {
                        tracing::warn!("sandbox {}: {e}", r.id);
                    }
                    drop(guest);
                    self.registry().insert(sandbox);
                }
                Err(e) => {
                    tracing::warn!("sandbox {}: cannot adopt its VMM ({e}); removing it", r.id);
                    if self
                        .store
                        .remove_sandbox(&r.id)
                        .is_ok_and(|existed| existed)
                    {
                        // Gone for its owner, as a VMM that exits is.
                        self.saw(crate::node::events::LifecycleKind::Killed, &r, None);
                    }
                    let _ = std::fs::remove_dir_all(self.config.observe_dir().join(&r.id));
                    if let Some(dir) = &r.vmm_dir {
                        // It may run without answering: stop it first.
                        if let Some(process) = ProcessIdentity::read(dir) {
                            process.kill();
                        }
                        let _ = std::fs::remove_dir_all(dir);
                    }
                    if !r.has_dependents {
                        let _ = std::fs::remove_dir_all(self.sandbox_dir(&r.id));
                    }
                }
            }
        }
        // Slots of sandboxes that could not be adopted go back.
        if let Some(net) = self.pool.net() {
            net.release_unclaimed();
        }
    }

    /// A running sandbox's disk is where its VMM says: a fork or snapshot
    /// the server did not live to record moved it to a new top layer (the
    /// recorded one is sealed below it now). The record follows, keeping the
    /// new layer's directory (and a snapshot's memory, which the guest runs
    /// on), so the next pause restores the disk the guest wrote and the
    /// garbage collector keeps them.
    async fn follow_vmm_disk(&self, record: SandboxRecord, vm: &VmmProcess) -> SandboxRecord {
        let drives = match vm.drives().await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("sandbox {}: reading its VMM's drives: {e}", record.id);
                return record;
            }
        };
        let Some(live) = drives
            .into_iter()
            .find(|d| d.drive_id == self.template.root_drive_id)
            .map(|d| PathBuf::from(d.path_on_host))
        else {
            return record;
        };
        if live == self.root_layer(&record) {
            return record;
        }
        tracing::warn!(
            "sandbox {}: its disk is on {} (a fork or snapshot not recorded before the server \
             stopped); its record follows",
            record.id,
            live.display()
        );
        // The directory under sandboxes/ or forks/ that holds the layer.
        let holder = [
            self.config.sandboxes_dir(),
            self.config.data_dir.join("forks"),
        ]
        .iter()
        .find_map(|root| {
            let below = live.strip_prefix(root).ok()?;
            Some(root.join(below.components().next()?))
        });
        // A snapshot's: the guest's memory runs on that snapshot's memory
        // file now, unrecorded (a user the collector must see).
        let snapshot = self.snapshot_of_layer(&record.id, &live);
        let updated = self.store.update_sandbox(&record.id, |s| {
            s.root_layer = Some(live.clone());
            s.has_dependents = true;
            if let Some(snapshot) = &snapshot
                && !s.uses_snapshots.contains(snapshot)
            {
                s.uses_snapshots.push(snapshot.clone());
            }
            if let Some(dir) = &holder
                && !s.uses_dirs.contains(dir)
            {
                s.uses_dirs.push(dir.clone());
            }
        });
        match updated {
            Ok(Some(r)) => r,
            Ok(None) => record,
            Err(e) => {
                tracing::warn!("sandbox {}: recording its disk: {e}", record.id);
                record
            }
        }
    }

    async fn adopt(&self, record: &SandboxRecord) -> Result<VmmProcess, SandboxError> {
        let dir = record
            .vmm_dir
            .as_deref()
            .ok_or_else(|| SandboxError::Invalid("no VMM directory recorded".into()))?;
        let mut vm = VmmProcess::adopt(dir).await?;
        match vm.instance_state().await? {
            InstanceState::Running => {}
            InstanceState::Paused => vm.resume().await?,
            InstanceState::NotStarted => {
                return Err(SandboxError::Invalid("its VMM has no guest".into()));
            }
        }
        vm.wait_for_agent(ADOPT_AGENT_TIMEOUT).await?;
        Ok(vm)
    }

    /// At shutdown: lets running sandboxes' VMMs run on, for the next start
    /// to adopt, and stops the warm pool's. A sandbox in the middle of a
    /// change keeps its VMM until this process ends; the next start adopts
    /// or stops it by its record.
    pub fn shutdown(&self) {
        let all = self.registry().all();
        let mut kept = 0;
        for sandbox in all {
            if let Ok(mut guest) = sandbox.guest.try_lock()
                && let Some(launched) = guest.take()
            {
                launched.release();
                kept += 1;
            }
        }
        tracing::info!(
            "shutting down: {kept} running sandboxes keep running for the next start to adopt"
        );
        self.pool.close();
    }
}
