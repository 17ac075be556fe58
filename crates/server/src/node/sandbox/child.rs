//! A fork's child, whichever fork made it: of a running sandbox (its memory
//! the fork's file) or of a paused one (its memory the parent's pause
//! files). Both start the same way from the parent's record; only where the
//! guest's memory and root disk come from differs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmm_driver::agent_client::AgentInit;

use super::{AGENT_TIMEOUT, Manager, SandboxError, io};
use crate::node::capacity::Reservation;
use crate::node::clock::now_ms;
use crate::node::ids;
use crate::node::launch::{Guest, LaunchTimes, Launched, Plan, Ready, Taken};
use crate::node::net::SandboxNetwork;
use crate::node::store::{ForkedFrom, SandboxRecord, SandboxState, VolumeMount};

/// Where a child's guest comes from.
#[derive(Debug)]
pub(super) struct ChildGuest {
    /// The restore of the parent's memory onto the child's disk.
    pub guest: Guest,
    /// The child's writable root layer when it is not `ROOT_LAYER` in its
    /// own directory (a running parent's fork makes it beside the memory).
    pub root_layer: Option<PathBuf>,
    /// A VMM already started for it (from the pool), or None for a new one.
    pub vmm: Option<Taken>,
    /// Its copies of the parent's volumes, in the slots the guest mounted
    /// them in (on the child's own layers).
    pub volume_mounts: Vec<VolumeMount>,
    /// Its place among the fork's children, from 0.
    pub branch: u32,
}

impl Manager {
    /// Starts the child `id` of `parent` in `dir`, with its own access token
    /// when the parent has one, its own traffic token when the parent's
    /// traffic is private (E2B derives its from the sandbox id), and the
    /// parent's network, egress policy, metadata and template (E2B's
    /// children keep them). `dir` goes when the child does not start. Its
    /// record, and where its launch's time went.
    pub(super) async fn start_child(
        &self,
        parent: &SandboxRecord,
        id: &str,
        dir: &Path,
        from: ChildGuest,
        timeout: Duration,
        hold: Reservation,
    ) -> Result<(SandboxRecord, LaunchTimes), SandboxError> {
        let result = async {
            let access_token = match parent.access_token {
                Some(_) => Some(ids::token().map_err(io("generating an access token"))?),
                None => None,
            };
            let network = SandboxNetwork {
                ingress: parent
                    .network
                    .ingress
                    .for_child()
                    .map_err(io("generating a traffic access token"))?,
                ..parent.network.clone()
            };
            let ingress = network.ingress.clone();
            let mut init = AgentInit::after_restore()?;
            init.access_token = access_token.clone().map(String::from);
            let plan = Plan {
                guest: from.guest,
                // The restored agent holds the parent's token until this init.
                ready: Ready::Init {
                    init: Box::new(init),
                    token: parent.access_token.clone(),
                },
                hold,
                timeout: AGENT_TIMEOUT,
                egress: parent.network.policy.clone(),
                lineage: self.lineage(
                    dir,
                    &parent.uses_dirs,
                    &parent.uses_snapshots,
                    &parent.template_id,
                ),
            };
            let (root_layer, volume_mounts) = (from.root_layer, from.volume_mounts);
            let forked_from = ForkedFrom {
                parent_id: parent.id.clone(),
                branch: from.branch,
            };
            let record = |launched: &Launched| {
                let started = now_ms();
                SandboxRecord {
                    id: id.to_owned(),
                    access_token: access_token.clone(),
                    started_at_ms: started,
                    end_at_ms: started + timeout.as_millis() as u64,
                    state: SandboxState::Running,
                    pause_generation: 0,
                    snapshot: None,
                    // Its memory is a file it maps, whatever the parent's was.
                    cold_booted: false,
                    envd_unresponsive_at_pause: false,
                    root_layer,
                    has_dependents: false,
                    // The parent's directories hold the memory and layers
                    // below the child's...
                    uses_dirs: parent
                        .uses_dirs
                        .iter()
                        .cloned()
                        .chain([dir.to_owned()])
                        .collect(),
                    vmm_dir: Some(launched.vm.dir().to_owned()),
                    network,
                    volume_mounts,
                    forked_from: Some(forked_from.clone()),
                    // ...as its `uses_snapshots` do.
                    ..parent.clone()
                }
            };
            self.start_sandbox(from.vmm, plan, record, access_token.clone(), ingress, id)
                .await
        }
        .await;
        if result.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        result
    }
}
