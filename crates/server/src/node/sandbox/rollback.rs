//! Rollback in place (`POST /sandboxes/{id}/rollback`): a running sandbox
//! goes back to one of its own checkpoints (a snapshot taken of it) and keeps
//! its id, access token, metadata and timeout. A tree search steps back
//! without a create, and nothing that names the sandbox changes.
//!
//! The checkpoint's memory is restored into a new VMM on a fresh layer over
//! the checkpoint's sealed disk, as a create from the snapshot would; only
//! once that guest answers does it take the old one's place, so a rollback
//! that fails leaves the sandbox running as it was.

use disk_layers::LayeredDisk;

use super::live::{self, Phase};
use super::{AGENT_TIMEOUT, Manager, SandboxError, agent_init, working_set};
use crate::node::capacity::Ask;
use crate::node::clock::now_ms;
use crate::node::launch::{self, Guest, Plan, Ready};
use crate::node::store::SandboxRecord;

impl Manager {
    /// Returns running sandbox `id` to `checkpoint` (a snapshot's id or
    /// name), which must have been taken of `id`. 404 for an unknown
    /// sandbox or snapshot, 409 for a snapshot of another sandbox or a
    /// sandbox that is not running.
    pub async fn rollback(
        &self,
        id: &str,
        checkpoint: &str,
    ) -> Result<SandboxRecord, SandboxError> {
        let _busy = self.activity.read().await;
        let sandbox = self.sandbox(id)?;
        let Ok(mut guest) = sandbox.guest.try_lock() else {
            return Err(live::busy(id));
        };
        if sandbox.phase() != Phase::Running {
            return Err(sandbox.phase().refusal(id));
        }
        let (template, _pin) = self.pin_template(checkpoint)?;
        if template.source_sandbox.as_deref() != Some(id) {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "not the source of that snapshot (a sandbox rolls back only to its own \
                        checkpoints; a create from the snapshot starts a new one)",
            });
        }
        if template.filesystem_only {
            return Err(SandboxError::Invalid(format!(
                "snapshot {} is filesystem-only: a rollback restores memory, and it has none \
                 to restore (create a sandbox from it instead: it cold-boots on its disk)",
                template.id
            )));
        }
        let record = self.get(id)?;
        // The checkpoint's memory has the volumes mounted as they were at
        // the snapshot: restored over their current layers, the guest's
        // cached view of them would disagree with their disks.
        Manager::refuse_mounted(
            &record,
            "mounting volumes: a rollback does not take volumes back yet (the checkpoint's \
             memory would meet their later disks); create a sandbox from the snapshot instead",
        )?;
        // Its new root layer beside the old one; the old goes once the new
        // guest runs (a snapshot or fork moves a sandbox to a new layer, so
        // its current one is its own).
        let dir = self.sandbox_dir(id);
        let root = dir.join(format!("root.rollback-{}.layer", now_ms()));
        let (base, top) = (template.root_layer.clone(), root.clone());
        tokio::task::spawn_blocking(move || LayeredDisk::create(&base, &top).map(drop)).await??;

        // Room for the second guest while both exist; not counted against
        // the team, whose sandbox this stays.
        let hold = match self.capacity.reserve_for(
            Ask::sandbox(u64::from(record.cpu_count), record.memory_mb),
            &format!("rolling sandbox {id} back"),
            None,
        ) {
            Ok(hold) => hold,
            Err(e) => {
                let _ = std::fs::remove_file(&root);
                return Err(e.into());
            }
        };
        let init = agent_init(&record)?;
        let plan = Plan {
            guest: Guest::Restore(self.restore_onto(
                &template.snapshot,
                &template.mem,
                &root,
                working_set::file_of(&template),
                &record.volume_mounts,
            )),
            // The checkpoint's agent holds the sandbox's own token.
            ready: Ready::Init {
                init: Box::new(init),
                token: template.agent_token.clone(),
            },
            hold,
            timeout: AGENT_TIMEOUT,
            egress: record.network.policy.clone(),
            lineage: self.record_lineage(&record),
        };
        sandbox.set_phase(Phase::RollingBack)?;
        let launched = async {
            let mut launched = launch::launch(&self.pool, plan).await?;
            let r = self
                .store
                .update_sandbox(id, |s| {
                    s.root_layer = Some(root.clone());
                    // The memory it runs on is the checkpoint's; the last
                    // pause's files describe a guest that is gone.
                    s.snapshot = None;
                    s.cold_booted = false;
                    if !s.uses_snapshots.contains(&template.id) {
                        s.uses_snapshots.push(template.id.clone());
                    }
                    s.vmm_dir = Some(launched.vm.dir().to_owned());
                    s.network.slot = launched.net_slot();
                })?
                .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
            launched.settle_disk();
            Ok::<_, SandboxError>((launched, r))
        }
        .await;
        let (launched, rolled_back) = match launched {
            Ok(done) => done,
            Err(e) => {
                let _ = std::fs::remove_file(&root);
                sandbox.set_phase(Phase::Running)?;
                return Err(e);
            }
        };
        let old = guest.take();
        self.run_guest(&sandbox, &mut guest, launched)?;
        drop(guest);
        // The old guest ends after the answer: nothing reaches it any more.
        let old_root = self.root_layer(&record);
        let keep = template.root_layer.clone();
        let id = id.to_owned();
        tokio::spawn(async move {
            if let Some(old) = old {
                old.stop().await;
            }
            if old_root != keep
                && let Err(e) = std::fs::remove_file(&old_root)
            {
                tracing::warn!("sandbox {id}: removing {}: {e}", old_root.display());
            }
        });
        Ok(rolled_back)
    }
}
