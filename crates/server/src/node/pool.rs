//! A warm pool of started `sandfork-vmm` processes waiting on their API
//! socket, so a create only pays for the snapshot load, not the process start.
//! Every VMM gets its own directory under the node's run dir, where a later
//! server can find (and adopt or stop) it. With networking, each waits in a
//! network slot of its own (see [`crate::node::net`]), so a launch only sets the
//! slot's policy.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandfork_network::EgressPolicy;
use tokio::sync::{Notify, Semaphore};
use vmm_driver::process::{Jail, ProcessError, Restore, VmmProcess};

use crate::node::cgroups::NodeCgroups;
use crate::node::launch::{LaunchError, Taken};
use crate::node::net::{Lease, Slots};

/// A pooled VMM and the slot it waits in. Fields drop in order: the VMM
/// first, then its slot goes back.
#[derive(Debug)]
struct Warm {
    vm: VmmProcess,
    net: Option<Lease>,
}

/// How many VMM starts, and how many guest loads, run at once: a few per
/// host CPU. A burst (a fork of 100, many creates at once) all started or
/// loaded together on a small (or emulated) host has every one miss its own
/// deadline, while the same work in waves finishes.
pub fn burst_width() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (2 * cpus).max(4)
}

/// What every guest the node cold-boots gets, and so every snapshot of one,
/// templates included.
#[derive(Clone, Debug, Default)]
pub struct BootConfig {
    /// Its balloon; None: `--no-balloon`.
    pub balloon: Option<vmm_api::Balloon>,
    /// Its CPU template (`--cpu-template`); None: the host's CPU.
    pub cpu_template: Option<vmm_api::CpuTemplate>,
}

#[derive(Debug)]
pub struct Pool {
    binary: PathBuf,
    run_dir: PathBuf,
    size: usize,
    idle: Mutex<Vec<Warm>>,
    wake: Notify,
    closed: AtomicBool,
    net: Option<Arc<Slots>>,
    /// Where launched VMMs are confined, when the node confines them.
    cgroups: Option<Arc<NodeCgroups>>,
    /// What every cold-booted guest gets.
    boot: BootConfig,
    /// The jail every VMM starts in, when the node jails them.
    jail: Option<Jail>,
    /// Guest loads under way at once ([`burst_width`]).
    loads: Semaphore,
}

impl Pool {
    /// Creates the pool and starts filling it in the background.
    pub fn start(binary: PathBuf, run_dir: PathBuf, size: usize) -> Arc<Pool> {
        Pool::start_with_network(
            binary,
            run_dir,
            size,
            None,
            None,
            BootConfig::default(),
            None,
        )
    }

    /// [`Pool::start`] with every VMM in a slot of `net`, started in `jail`,
    /// every VMM it launches confined in a cgroup of its own under `cgroups`,
    /// and every guest it boots given what `boot` says.
    pub fn start_with_network(
        binary: PathBuf,
        run_dir: PathBuf,
        size: usize,
        net: Option<Arc<Slots>>,
        cgroups: Option<Arc<NodeCgroups>>,
        boot: BootConfig,
        jail: Option<Jail>,
    ) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            binary,
            run_dir,
            size,
            idle: Mutex::new(Vec::new()),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            net,
            cgroups,
            boot,
            jail,
            loads: Semaphore::new(burst_width()),
        });
        if size > 0 {
            tokio::spawn(pool.clone().refill());
        }
        pool
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Warm>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn idle_count(&self) -> usize {
        self.idle().len()
    }

    /// The node's cgroups, when it confines its VMMs.
    pub fn cgroups(&self) -> Option<&Arc<NodeCgroups>> {
        self.cgroups.as_ref()
    }

    /// The balloon a booted guest gets, when the node gives guests one.
    pub fn balloon(&self) -> Option<&vmm_api::Balloon> {
        self.boot.balloon.as_ref()
    }

    /// The CPU template a booted guest gets; None: the host's CPU.
    pub fn cpu_template(&self) -> Option<vmm_api::CpuTemplate> {
        self.boot.cpu_template
    }

    /// The node's network slots, when it networks its sandboxes.
    pub fn net(&self) -> Option<&Arc<Slots>> {
        self.net.as_ref()
    }

    /// A started VMM with nothing loaded and outside any network slot.
    pub async fn take(&self) -> Result<VmmProcess, ProcessError> {
        if self.net.is_some() {
            return self.spawn(None).await;
        }
        match self.take_for(&EgressPolicy::default()).await {
            Ok((vm, _)) => Ok(vm),
            Err(LaunchError::Vmm(e)) => Err(e),
            Err(LaunchError::Cgroup(e)) => Err(ProcessError::Io {
                what: "confining the VMM in its cgroup",
                source: std::io::Error::other(e.to_string()),
            }),
            Err(LaunchError::Network(e)) => Err(ProcessError::Io {
                what: "taking a network slot",
                source: std::io::Error::other(e.to_string()),
            }),
        }
    }

    /// A started VMM with nothing loaded, in a network slot with `policy`
    /// when the node networks its sandboxes: from the pool, or started now
    /// when the pool is empty. Out of slots is [`sandfork_network::Error::Exhausted`].
    pub async fn take_for(
        &self,
        policy: &EgressPolicy,
    ) -> Result<(VmmProcess, Option<Lease>), LaunchError> {
        loop {
            let pooled = self.idle().pop();
            self.wake.notify_one();
            let Some(mut warm) = pooled else {
                let t0 = std::time::Instant::now();
                let lease = match &self.net {
                    Some(net) => {
                        let (net, policy) = (net.clone(), policy.clone());
                        Some(tokio::task::spawn_blocking(move || net.take(&policy)).await??)
                    }
                    None => None,
                };
                let vm = self.spawn(lease.as_ref()).await?;
                tracing::debug!(
                    "warm pool empty: VMM pid {} started for a launch in {:.1} ms",
                    vm.pid(),
                    t0.elapsed().as_secs_f64() * 1e3
                );
                return Ok((vm, lease));
            };
            if !warm.vm.is_running() {
                // Dropping it removes its directory and gives its slot back.
                tracing::warn!("warm pool: VMM pid {} had exited; dropped", warm.vm.pid());
                continue;
            }
            if let Some(mut lease) = warm.net.take_if(|l| l.policy() != Some(policy)) {
                let policy = policy.clone();
                let (lease, set) = tokio::task::spawn_blocking(move || {
                    let r = lease.set_policy(policy);
                    (lease, r)
                })
                .await?;
                warm.net = Some(lease);
                set?;
            }
            let Warm { vm, net } = warm;
            return Ok((vm, net));
        }
    }

    /// `n` started VMMs for `policy` at once (a fork's children): those the
    /// pool holds, the rest started in parallel rather than one after
    /// another, so a fork of many does not wait for N process starts in a
    /// row. One result per VMM asked for; a failure fails that one only.
    pub async fn take_many(
        self: &Arc<Self>,
        n: usize,
        policy: &EgressPolicy,
    ) -> Vec<Result<Taken, LaunchError>> {
        let starts = Arc::new(Semaphore::new(burst_width()));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..n {
            let (pool, policy, starts) = (self.clone(), policy.clone(), starts.clone());
            tasks.spawn(async move {
                let _start = starts.acquire_owned().await;
                (i, pool.take_for(&policy).await)
            });
        }
        let mut taken: Vec<Option<Result<_, LaunchError>>> = (0..n).map(|_| None).collect();
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok((i, r)) => taken[i] = Some(r),
                Err(e) => tracing::error!("warm pool: a VMM start task failed: {e}"),
            }
        }
        taken
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(LaunchError::Vmm(ProcessError::Io {
                        what: "starting a VMM",
                        source: std::io::Error::other("its task ended early"),
                    }))
                })
            })
            .collect()
    }

    /// Loads `restore` into `vm`, at most [`Pool::load_limit`] loads at
    /// once on this node: a fork's hundred children (or many creates) load
    /// in waves, each within its own deadline, instead of all together
    /// past theirs. What follows a load (the guest resuming, its agent's
    /// init) is not bounded.
    pub async fn restore(&self, vm: &VmmProcess, restore: &Restore) -> Result<(), ProcessError> {
        // Never closed: a permit always comes.
        let _load = self.loads.acquire().await.ok();
        vm.restore(restore).await
    }

    /// How many guests load at once.
    pub fn load_limit(&self) -> usize {
        burst_width()
    }

    async fn spawn(&self, net: Option<&Lease>) -> Result<VmmProcess, ProcessError> {
        let name = crate::node::ids::random_bytes(8).map_err(|source| ProcessError::Io {
            what: "naming a VMM directory",
            source,
        })?;
        std::fs::create_dir_all(&self.run_dir).map_err(|source| ProcessError::Io {
            what: "creating the run directory",
            source,
        })?;
        let dir = self
            .run_dir
            .join(format!("vmm-{}", crate::node::ids::hex(&name)));
        let netns = net.map(Lease::netns);
        match (&self.jail, netns) {
            (Some(jail), netns) => VmmProcess::spawn_jailed(&self.binary, dir, netns, jail).await,
            (None, Some(ns)) => VmmProcess::spawn_in_with_netns(&self.binary, dir, ns).await,
            (None, None) => VmmProcess::spawn_in(&self.binary, dir).await,
        }
    }

    async fn spawn_warm(&self) -> Result<Warm, LaunchError> {
        let net = match &self.net {
            Some(net) => {
                let net = net.clone();
                let policy = EgressPolicy::default();
                Some(tokio::task::spawn_blocking(move || net.take(&policy)).await??)
            }
            None => None,
        };
        let vm = self.spawn(net.as_ref()).await?;
        Ok(Warm { vm, net })
    }

    /// Stops the idle VMMs and refilling (at shutdown), and networking:
    /// the slots of sandboxes left running stay for the next start.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.wake.notify_one();
        self.idle().clear();
        if let Some(net) = &self.net {
            net.shutdown();
        }
    }

    async fn refill(self: Arc<Self>) {
        while !self.closed.load(Ordering::SeqCst) {
            while self.idle().len() < self.size && !self.closed.load(Ordering::SeqCst) {
                match self.spawn_warm().await {
                    // Closed meanwhile: dropping it stops it.
                    Ok(warm) if self.closed.load(Ordering::SeqCst) => drop(warm),
                    Ok(warm) => self.idle().push(warm),
                    Err(e) => {
                        tracing::warn!("warm pool: starting a VMM: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            self.wake.notified().await;
        }
    }
}
