//! `PUT /sandboxes/{id}/network`: a running sandbox's egress policy replaced
//! live, in one transaction on its slot, then in its record (which resumes
//! and fork children take it from).

use super::live::{self, Phase};
use super::{Manager, SandboxError};
use crate::node::net::SandboxNetwork;
use crate::node::store::SandboxRecord;

impl Manager {
    /// Replaces sandbox `id`'s network policy. Not found: 404; paused or in
    /// the middle of a change: 409 (E2B's answers).
    pub async fn update_network(
        &self,
        id: &str,
        network: SandboxNetwork,
    ) -> Result<SandboxRecord, SandboxError> {
        let sandbox = self.sandbox(id)?;
        let Ok(mut guest) = sandbox.guest.try_lock() else {
            return Err(live::busy(id));
        };
        if sandbox.phase() != Phase::Running {
            return Err(sandbox.phase().refusal(id));
        }
        let Some(launched) = guest.as_mut() else {
            return Err(Phase::Gone.refusal(id));
        };
        if let Some(mut lease) = launched.take_net() {
            let policy = network.policy.clone();
            let (lease, set) = tokio::task::spawn_blocking(move || {
                let r = lease.set_policy(policy);
                (lease, r)
            })
            .await?;
            launched.put_net(lease);
            set?;
        }
        self.store
            .update_sandbox(id, |s| {
                // Ingress is the create's alone (E2B's update has no such field).
                s.network = SandboxNetwork {
                    slot: s.network.slot,
                    ingress: std::mem::take(&mut s.network.ingress),
                    ..network
                };
            })?
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))
    }
}
