//! The one way a guest starts on this node: a VMM from the warm pool, the
//! guest loaded into it (a snapshot restore, or a cold boot for template
//! builds), its agent ready, and what the running guest holds. Creates,
//! resumes, fork children and template builds all launch through here, so a
//! resource every guest needs (a network slot, a cgroup) is added to [`Plan`]
//! and [`Launched`] and nowhere else.

use std::time::Duration;

use vmm_driver::agent_client::AgentInit;
use vmm_driver::process::{GuestSpec, ProcessError, Restore, VmmProbe, VmmProcess};

use crate::capacity::Reservation;
use crate::pool::Pool;

/// The kernel command line of every cold boot (template builds, resumes of
/// sandboxes paused without memory). Quiet console: its output costs boot time.
pub const BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux \
    i8042.nomux i8042.nopnp i8042.dumbkbd quiet";

/// What goes into the VMM.
#[derive(Debug)]
pub enum Guest {
    /// A snapshot, with the disks it runs on (a sandbox's own root layer, a
    /// fork child's layers).
    Restore(Restore),
    /// A kernel booted from scratch (template builds).
    Boot(GuestSpec),
}

/// How the guest counts as up.
#[derive(Debug)]
pub enum Ready {
    /// Its agent took this `POST /init`, presented with the agent's current
    /// access token (a snapshot's agent holds its source's until then).
    Init {
        init: Box<AgentInit>,
        token: Option<String>,
    },
    /// Its agent answers its health check (a cold boot, initialised later).
    Health,
}

/// Everything one launch needs.
#[derive(Debug)]
pub struct Plan {
    pub guest: Guest,
    pub ready: Ready,
    /// The capacity the guest holds while it runs (given back with it).
    pub hold: Reservation,
    /// How long the guest may take to be ready.
    pub timeout: Duration,
}

/// A started guest and what it holds; dropping it stops the VMM and gives
/// everything back (see [`Launched::stop`] in async code).
pub struct Launched {
    pub vm: VmmProcess,
    hold: Reservation,
    /// How long the guest took to be ready.
    pub ready_after: Duration,
}

impl Launched {
    /// A VMM that was started before this process (adopted after a restart),
    /// holding `hold`.
    pub fn adopted(vm: VmmProcess, hold: Reservation) -> Launched {
        hold.track(vm.pid());
        Launched {
            vm,
            hold,
            ready_after: Duration::ZERO,
        }
    }

    pub fn probe(&self) -> VmmProbe {
        self.vm.probe()
    }

    /// Its disk is written now: what it reserved for growth is settled.
    pub fn settle_disk(&mut self) {
        self.hold.settle_disk();
    }

    /// Stops the VMM and gives back what it held, off the async threads:
    /// killing and reaping a VMM and removing its directory block.
    pub async fn stop(self) {
        if let Err(e) = tokio::task::spawn_blocking(move || drop(self)).await {
            tracing::warn!("stopping a VMM: {e}");
        }
    }

    /// Leaves the VMM running for a later server to adopt (at shutdown).
    pub fn release(self) {
        self.vm.release();
    }
}

/// Starts `plan`'s guest in a pooled VMM and waits until it is ready. A
/// VMM that fails to start its guest is stopped off the async threads.
pub async fn launch(pool: &Pool, plan: Plan) -> Result<Launched, ProcessError> {
    let mut vm = pool.take().await?;
    // From now on it is charged what its VMM really uses.
    plan.hold.track(vm.pid());
    match start(&mut vm, &plan).await {
        Ok(ready_after) => Ok(Launched {
            vm,
            hold: plan.hold,
            ready_after,
        }),
        Err(e) => {
            let _ = tokio::task::spawn_blocking(move || drop(vm)).await;
            Err(e)
        }
    }
}

async fn start(vm: &mut VmmProcess, plan: &Plan) -> Result<Duration, ProcessError> {
    match &plan.guest {
        Guest::Restore(restore) => vm.restore(restore).await?,
        Guest::Boot(spec) => vm.boot(spec).await?,
    }
    match &plan.ready {
        Ready::Init { init, token } => vm.init_agent(init, token.as_deref(), plan.timeout).await,
        Ready::Health => vm.wait_for_agent(plan.timeout).await,
    }
}
