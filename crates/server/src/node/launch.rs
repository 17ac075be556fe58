//! The one way a guest starts on this node: a VMM from the warm pool, the
//! guest loaded into it (a snapshot restore, or a cold boot for template
//! builds), its agent ready, and what the running guest holds. Creates,
//! resumes, fork children and template builds all launch through here, so a
//! resource every guest needs (a network slot, a cgroup) is added to [`Plan`]
//! and [`Launched`] and nowhere else.

use std::time::{Duration, Instant};

use sandfork_network::EgressPolicy;
use vmm_api::NetworkInterface;
use vmm_driver::agent_client::AgentInit;
use vmm_driver::process::{GuestSpec, Lineage, ProcessError, Restore, VmmProbe, VmmProcess};

use crate::node::capacity::Reservation;
use crate::node::cgroups::SandboxGroup;
use crate::node::net::{self, Lease, SlotRecord};
use crate::node::pool::Pool;

/// Why a launch failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Vmm(#[from] ProcessError),
    /// No network slot (out of slots is `Exhausted`, a 503).
    #[error("the sandbox's network: {0}")]
    Network(#[from] net::NetError),
    /// Its VMM could not be put in a cgroup of its own.
    #[error("the sandbox's cgroup: {0}")]
    Cgroup(#[from] cgroup::Error),
}

impl From<tokio::task::JoinError> for LaunchError {
    fn from(e: tokio::task::JoinError) -> LaunchError {
        LaunchError::Vmm(ProcessError::Io {
            what: "a blocking task",
            source: std::io::Error::other(e.to_string()),
        })
    }
}

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
        token: Option<crate::node::ids::Token>,
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
    /// The egress policy of its network slot (when the node networks its
    /// sandboxes; every launch then runs in a slot of its own).
    pub egress: EgressPolicy,
    /// Where the guest's files may lie: a jailed VMM is handed nothing else
    /// for it, whatever the state and layer headers VMMs wrote name.
    pub lineage: Lineage,
}

/// A started guest and what it holds; dropping it stops the VMM and gives
/// everything back (see [`Launched::stop`] in async code).
#[derive(Debug)]
pub struct Launched {
    pub vm: VmmProcess,
    /// Its cgroup, removed once the VMM is gone (fields drop in order).
    cgroup: Option<SandboxGroup>,
    /// Its network slot; dropped after `vm` (fields drop in order), so the
    /// slot goes back only once the VMM is gone.
    net: Option<Lease>,
    hold: Reservation,
    /// Where its launch's time went.
    pub times: LaunchTimes,
}

/// Where one launch's time went, step by step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchTimes {
    /// Its VMM taken from the pool (nothing when it was taken before).
    pub taken: Duration,
    /// Its VMM put in its cgroup.
    pub confined: Duration,
    /// The guest loaded into the VMM (a snapshot's state restored, or a
    /// kernel booted).
    pub loaded: Duration,
    /// Then until its agent was ready (answered its init or health check).
    pub ready: Duration,
    /// Then its sandbox's record stored (filled in by the sandbox manager,
    /// which stores it).
    pub recorded: Duration,
}

impl Launched {
    /// A VMM that was started before this process (adopted after a restart),
    /// holding `hold`.
    pub fn adopted(vm: VmmProcess, hold: Reservation) -> Launched {
        hold.track(vm.pid());
        Launched {
            vm,
            cgroup: None,
            net: None,
            hold,
            times: LaunchTimes::default(),
        }
    }

    /// With the cgroup it ran in before the restart.
    pub fn with_cgroup(mut self, cgroup: Option<SandboxGroup>) -> Launched {
        self.cgroup = cgroup;
        self
    }

    /// With the network slot it ran in before the restart.
    pub fn with_network(mut self, lease: Option<Lease>) -> Launched {
        self.net = lease;
        self
    }

    /// The network slot it runs in, for its record.
    pub fn net_slot(&self) -> Option<SlotRecord> {
        self.net.as_ref().map(Lease::record)
    }

    /// Takes its network slot out, to change its policy off the async
    /// threads (`PUT .../network`); put it back with [`Launched::put_net`].
    pub fn take_net(&mut self) -> Option<Lease> {
        self.net.take()
    }

    pub fn put_net(&mut self, lease: Lease) {
        self.net = Some(lease);
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
        let Launched {
            vm,
            cgroup,
            net,
            hold,
            ..
        } = self;
        vm.release();
        if let Some(group) = cgroup {
            group.keep();
        }
        if let Some(lease) = net {
            lease.keep();
        }
        drop(hold);
    }
}

/// Starts `plan`'s guest in a pooled VMM and waits until it is ready. A
/// VMM that fails to start its guest is stopped off the async threads.
pub async fn launch(pool: &Pool, plan: Plan) -> Result<Launched, LaunchError> {
    launch_in(pool, None, plan).await
}

/// A VMM taken from the pool (with its network slot) before its launch.
pub type Taken = (VmmProcess, Option<Lease>);

/// [`launch`] in `vmm` when one was taken from the pool already (a fork's
/// children get theirs before the parent freezes).
pub async fn launch_in(
    pool: &Pool,
    vmm: Option<Taken>,
    plan: Plan,
) -> Result<Launched, LaunchError> {
    let t0 = Instant::now();
    let (mut vm, net) = match vmm {
        Some(taken) => taken,
        None => pool.take_for(&plan.egress).await?,
    };
    let taken = t0.elapsed();
    vm.set_lineage(plan.lineage.clone());
    // From now on it is charged what its VMM really uses.
    plan.hold.track(vm.pid());
    // Limited before the guest runs a single instruction.
    let cgroup = match pool.cgroups().map(|c| c.confine(&vm, &plan.hold.held())) {
        None => None,
        Some(Ok(group)) => Some(group),
        Some(Err(e)) => {
            let _ = tokio::task::spawn_blocking(move || drop((vm, net))).await;
            return Err(e.into());
        }
    };
    let confined = t0.elapsed();
    match start(pool, &mut vm, net.is_some(), &plan).await {
        Ok((loaded, ready)) => {
            let times = LaunchTimes {
                taken,
                confined: confined.saturating_sub(taken),
                loaded,
                ready,
                recorded: Duration::ZERO,
            };
            // Where a launch's time goes (a create, a fork child), to tell
            // the node's part from the guest's when a launch is slow.
            tracing::debug!(
                "launch: VMM pid {} taken in {:.1} ms, confined in {:.1} ms, guest loaded in \
                 {:.1} ms, ready {:.1} ms after",
                vm.pid(),
                ms(times.taken),
                ms(times.confined),
                ms(times.loaded),
                ms(times.ready),
            );
            Ok(Launched {
                vm,
                cgroup,
                net,
                hold: plan.hold,
                times,
            })
        }
        Err(e) => {
            let _ = tokio::task::spawn_blocking(move || drop((vm, cgroup, net))).await;
            Err(e.into())
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Loads `plan`'s guest into `vm` and waits until it is ready: how long the
/// load took, then the wait.
async fn start(
    pool: &Pool,
    vm: &mut VmmProcess,
    networked: bool,
    plan: &Plan,
) -> Result<(Duration, Duration), ProcessError> {
    let t0 = Instant::now();
    match &plan.guest {
        // A snapshot names its interface's tap itself (`tap0`, found in the
        // slot's namespace the VMM runs in).
        Guest::Restore(restore) => pool.restore(vm, restore).await?,
        Guest::Boot(spec) => {
            if networked {
                // The fixed guest side of every slot: snapshots of this guest
                // (templates) carry it, and any slot fits them.
                let mac = net::GUEST_MAC.map(|b| format!("{b:02x}")).join(":");
                vm.api()
                    .put_network_interface(&NetworkInterface::new(
                        net::GUEST_IFACE,
                        net::TAP_NAME,
                        Some(&mac),
                    ))
                    .await?;
            }
            // Snapshots of this guest keep it: restores need nothing here.
            if let Some(balloon) = pool.balloon() {
                vm.api().put_balloon(balloon).await?;
            }
            // The node's CPU template, which its snapshots keep too.
            let spec = GuestSpec {
                cpu_template: pool.cpu_template(),
                ..spec.clone()
            };
            vm.boot(&spec).await?
        }
    }
    let loaded = t0.elapsed();
    let ready = match &plan.ready {
        Ready::Init { init, token } => vm.init_agent(init, token.as_deref(), plan.timeout).await,
        Ready::Health => vm.wait_for_agent(plan.timeout).await,
    }?;
    Ok((loaded, ready))
}
