//! The sandbox manager: create (restore the template into a pooled VMM),
//! get, list, kill, timeouts. Records live in the store; running VMMs here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use disk_layers::LayeredDisk;
use vmm_api::{Drive, DriveOverride, SnapshotType};
use vmm_driver::agent_client::{AgentError, AgentInit};
use vmm_driver::process::{GuestSpec, ProcessError, Restore};

use crate::node::capacity::{Ask, Capacity, CapacityError, Reservation, Shortage};
use crate::node::clock::now_ms;
use crate::node::config::Config;
use crate::node::events::{Denial, Event, Hooks, Lifecycle, LifecycleKind, Permit, Told};
use crate::node::ids;
use crate::node::launch::{self, Guest, LaunchError, Launched, Plan, Ready};
use crate::node::net::SandboxNetwork;
use crate::node::pool::Pool;
use crate::node::store::{
    PauseReason, PausedSnapshot, SandboxRecord, SandboxState, Store, StoreError, TemplateRecord,
    VolumeMount,
};
use crate::node::volume;

/// A restored guest answers within this (lab times included).
const AGENT_TIMEOUT: Duration = Duration::from_secs(120);
/// How far a [`Manager::subscribe`]r may fall behind before it loses
/// events: a fork's 20 children and a reaper's round with room to spare.
pub const LIFECYCLE_BACKLOG: usize = 4096;
/// A cold boot in the lab takes tens of seconds.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a guest agent may take to flush the guest's disk before a
/// filesystem-only pause, or to answer before a pause that asks for it.
const GUEST_CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// A pause that asks for a healthy guest waits this long for its answer.
const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// An adopted VMM's guest answered before the restart: it gets less time.
const ADOPT_AGENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How often expired sandboxes are looked for.
const REAP_EVERY: Duration = Duration::from_millis(500);
pub const ROOT_LAYER: &str = "root.layer";

pub mod cache_bound;
mod child;
mod fork;
mod fork_stored;
mod gc;
mod history;
mod lineage;
mod live;
mod moved;
mod network;
mod observe;
mod pressure;
mod recover;
mod rollback;
mod snapshot;
#[cfg(test)]
pub(crate) mod tests;
mod volumes;
mod working_set;
pub use fork::{ForkTimes, Forked, Frozen};
pub use fork_stored::{CopiedFork, ForkResults, SnapshotForkParams};
pub use gc::{GcStats, TemplateWrite};
pub use live::Phase;
use live::{Registry, Sandbox};
pub use moved::{GuestPaths, PausedFiles, adopted_record};
pub use observe::{Level, LogLine, STUCK_AFTER, Sample};
pub use recover::reclaim_run_dir;
pub use snapshot::SnapshotParams;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("template {0} not found")]
    TemplateNotFound(String),
    /// `<template>:<buildID>` names a build that made no template (yet): 404.
    #[error("{0}")]
    BuildNotReady(String),
    #[error(
        "this node runs at most {max} sandboxes: {running} are running or starting, \
         {asked} more asked for"
    )]
    AtCapacity {
        running: usize,
        asked: usize,
        max: usize,
    },
    /// Not enough vCPUs, memory or disk (503; the count limit is 429).
    #[error(transparent)]
    OverCapacity(#[from] Shortage),
    /// The team's limit on sandboxes or memory (429, as E2B's concurrency limit).
    #[error("{0}")]
    TeamLimit(String),
    #[error("sandbox {id} is {state}")]
    Conflict { id: String, state: &'static str },
    #[error("template {id} is in use by {users}")]
    InUse { id: String, users: String },
    #[error("{0}")]
    Invalid(String),
    /// A memory resume of a sandbox paused while its guest agent did not
    /// answer (409, E2B's `sandbox_snapshot_guest_agent_unresponsive`).
    #[error(
        "sandbox {0} was paused while its guest agent did not answer; restoring its memory \
         would bring that back: resume it without memory (memory: false), which boots its disk"
    )]
    AgentUnresponsiveAtPause(String),
    #[error("a template or snapshot named {0} exists")]
    NameTaken(String),
    #[error("{0}")]
    Unavailable(String),
    /// A template the create names is being built; it may be asked again
    /// in about `retry_after_secs`.
    #[error(
        "template {name} is being built ({elapsed_secs} s so far); \
         ask again in {retry_after_secs} s"
    )]
    Building {
        name: String,
        elapsed_secs: u64,
        retry_after_secs: u32,
    },
    /// A create named an image that could not be made a template.
    #[error(transparent)]
    Image(#[from] crate::node::template::ImageError),
    /// What sits above the node (a cluster) said no; what the operation
    /// made is undone.
    #[error(transparent)]
    Denied(#[from] Denial),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the sandbox's disk: {0}")]
    Disk(#[from] disk_layers::Error),
    #[error("the sandbox's VMM: {0}")]
    Vmm(#[from] ProcessError),
    #[error("the sandbox's guest agent: {0}")]
    Agent(#[from] AgentError),
    #[error("a blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    /// Its network slot (out of slots: 503; a refused policy: 400).
    #[error("{0}")]
    Network(#[from] crate::node::net::NetError),
    #[error("the sandbox's cgroup: {0}")]
    Cgroup(#[from] cgroup::Error),
    /// A volume it mounts or would mount (unknown, in use, ...).
    #[error(transparent)]
    Volume(#[from] volume::VolumeError),
}

impl From<LaunchError> for SandboxError {
    fn from(e: LaunchError) -> SandboxError {
        match e {
            LaunchError::Vmm(e) => SandboxError::Vmm(e),
            LaunchError::Network(e) => SandboxError::Network(e),
            LaunchError::Cgroup(e) => SandboxError::Cgroup(e),
        }
    }
}

impl From<CapacityError> for SandboxError {
    fn from(e: CapacityError) -> SandboxError {
        match e {
            CapacityError::TooMany {
                running,
                asked,
                max,
            } => SandboxError::AtCapacity {
                running,
                asked,
                max,
            },
            CapacityError::Short(s) => SandboxError::OverCapacity(s),
            e @ (CapacityError::TeamSandboxes { .. } | CapacityError::TeamMemory { .. }) => {
                SandboxError::TeamLimit(e.to_string())
            }
            CapacityError::Disk { path, source } => SandboxError::Io {
                what: format!("reading the free space of {}", path.display()),
                source,
            },
        }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SandboxError {
    let what = what.into();
    move |source| SandboxError::Io { what, source }
}

/// The agent's init for a new guest of sandbox `record` (a cold boot, a
/// rollback): its own token and sandbox-wide environment.
fn agent_init(record: &SandboxRecord) -> Result<AgentInit, SandboxError> {
    let mut init = AgentInit::after_restore()?;
    init.access_token = record.access_token.clone().map(String::from);
    init.env_vars = Some(record.env_vars.clone());
    Ok(init)
}

/// fsyncs each of `files` (files or directories) off the async threads:
/// before a record names them, they must be on disk.
async fn sync_files(files: Vec<PathBuf>) -> Result<(), SandboxError> {
    tokio::task::spawn_blocking(move || -> Result<(), SandboxError> {
        for f in files {
            std::fs::File::open(&f)
                .and_then(|f| f.sync_all())
                .map_err(io(format!("syncing {}", f.display())))?;
        }
        Ok(())
    })
    .await?
}

/// What a create asks for (already validated by the API).
#[derive(Debug, Clone, Default)]
pub struct CreateParams {
    pub template_id: String,
    pub timeout: Duration,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// Give the sandbox an envd access token and have envd require it.
    pub secure: bool,
    pub auto_pause: bool,
    /// The timeout's pause keeps the memory (else the filesystem only).
    pub auto_pause_memory: bool,
    /// Its network policy (validated; no slot yet).
    pub network: SandboxNetwork,
    /// The team it belongs to (None: the default team).
    pub team: Option<String>,
    /// Volumes of the team to mount, by name (E2B's `volumeMounts`).
    pub volume_mounts: Vec<crate::wire::SandboxVolumeMount>,
    /// The snapshot a fork of it makes this sandbox from, and its branch.
    pub forked_from: Option<crate::node::store::ForkedFrom>,
}

/// What a pause keeps (E2B's pause `memory` and `autoPauseMemory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Memory and devices in a snapshot, the disk flushed: the resume
    /// continues where it stopped.
    Full,
    /// The disk only, flushed by the guest first: the resume cold-boots the
    /// kernel on it (processes and memory are gone).
    Filesystem,
}

/// How a resume brings a paused sandbox back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeMode {
    /// From its memory snapshot when it has one, else cold.
    Restore,
    /// Cold-boots from its disk, whatever memory it kept (E2B's connect
    /// with `memory: false`).
    Reboot,
}

#[derive(Debug)]
pub struct Manager {
    config: Config,
    store: Store,
    pool: Arc<Pool>,
    template: TemplateRecord,
    /// Every sandbox of this node, running or paused (see [`live`]).
    registry: Mutex<Registry>,
    /// vCPUs, memory and slots held by running sandboxes and by creates,
    /// resumes and fork children under way.
    capacity: Arc<Capacity>,
    /// Templates creates are restoring right now (not yet recorded in a
    /// sandbox): a delete waits for them to finish.
    pins: Mutex<HashMap<String, usize>>,
    /// Held shared by every change that writes files before its record says
    /// so; the garbage collector runs only when it can hold it alone.
    activity: tokio::sync::RwLock<()>,
    /// Sandboxes removed because their VMM exited by itself.
    vmm_exits: AtomicU64,
    /// What the memory pressure monitor saw and did.
    pressure: Mutex<crate::node::pressure::PressureStats>,
    /// Templates whose working set a sandbox is recording now.
    recording: Mutex<HashSet<String>>,
    /// Templates a build is writing under `templates/` outside
    /// [`Manager::activity`], until their records are committed (see
    /// [`Manager::writing_template`]).
    writing: Mutex<HashMap<String, usize>>,
    /// What sits above the node, asked and told about clients' operations
    /// (see [`crate::node::events`]); none on a lone node.
    hooks: std::sync::OnceLock<Arc<dyn Hooks>>,
    /// Where [`Lifecycle`] facts go, to every subscriber (see
    /// [`Manager::subscribe`]).
    lifecycle: tokio::sync::broadcast::Sender<Lifecycle>,
    /// Held by every change of a volume's record or of who mounts it, so
    /// that a name is taken once and a volume is not removed under a mount.
    volume_changes: tokio::sync::Mutex<()>,
    /// The node's Prometheus metrics (see [`crate::node::metrics`]).
    metrics: Arc<crate::node::metrics::Metrics>,
    /// This manager, for the tasks that watch its VMMs.
    me: Weak<Manager>,
}

impl Manager {
    /// A manager with the capacity `config` and the host allow.
    pub fn new(
        config: Config,
        store: Store,
        pool: Arc<Pool>,
        template: TemplateRecord,
    ) -> Arc<Manager> {
        let capacity = Capacity::for_config(&config);
        Manager::with_capacity(config, store, pool, capacity, template)
    }

    /// A manager whose sandboxes draw on `capacity` (shared with what
    /// launched guests before it, such as the base template's build).
    pub fn with_capacity(
        config: Config,
        store: Store,
        pool: Arc<Pool>,
        capacity: Arc<Capacity>,
        template: TemplateRecord,
    ) -> Arc<Manager> {
        let metrics = Arc::new(crate::node::metrics::Metrics::new());
        capacity.count_refusals_in(metrics.clone());
        Arc::new_cyclic(|me| Manager {
            config,
            store,
            pool,
            template,
            registry: Mutex::new(Registry::default()),
            capacity,
            pins: Mutex::new(HashMap::new()),
            activity: tokio::sync::RwLock::new(()),
            vmm_exits: AtomicU64::new(0),
            pressure: Mutex::default(),
            recording: Mutex::default(),
            writing: Mutex::default(),
            hooks: std::sync::OnceLock::new(),
            lifecycle: tokio::sync::broadcast::Sender::new(LIFECYCLE_BACKLOG),
            volume_changes: tokio::sync::Mutex::new(()),
            metrics,
            me: me.clone(),
        })
    }

    /// From now on `hooks` are asked and told about clients' operations.
    /// Set once, by the composition root before the node serves; a second
    /// call is refused (the first listener would miss what follows).
    pub fn listen(&self, hooks: Arc<dyn Hooks>) -> Result<(), SandboxError> {
        self.hooks
            .set(hooks)
            .map_err(|_| SandboxError::Invalid("the node's hooks were set twice".to_owned()))
    }

    /// From now on the returned receiver gets every [`Lifecycle`] fact, in
    /// the order the node recorded them; one that falls more than
    /// [`LIFECYCLE_BACKLOG`] behind loses the oldest (and is told how many).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Lifecycle> {
        self.lifecycle.subscribe()
    }

    /// Tells the subscribers that `record`'s sandbox was `kind` (just now,
    /// recorded already); `parent` names a fork child's parent.
    pub(crate) fn saw(&self, kind: LifecycleKind, record: &SandboxRecord, parent: Option<&str>) {
        let at_ms = now_ms();
        let id = ids::random_bytes(16)
            .map(|b| ids::hex(&b))
            // Unique enough without the kernel's RNG: one event per sandbox, kind and ms.
            .unwrap_or_else(|_| format!("{}-{}-{at_ms}", record.id, kind.as_str()));
        let event = Lifecycle {
            id,
            kind,
            sandbox_id: record.id.clone(),
            team: record.team().to_owned(),
            template_id: record.template_id.clone(),
            metadata: record.metadata.clone(),
            parent_id: parent.map(str::to_owned),
            run: record.pause_generation,
            started_at_ms: record.started_at_ms,
            cpu_count: record.cpu_count,
            memory_mb: record.memory_mb,
            at_ms,
        };
        self.metrics.saw(kind);
        // No subscriber is no error: a node without webhooks.
        let _ = self.lifecycle.send(event);
    }

    /// Asks the hooks before a client's operation takes room; the permit
    /// is held until the operation ends.
    pub(crate) async fn admit(
        &self,
        ask: crate::node::events::Ask<'_>,
    ) -> Result<Permit, SandboxError> {
        match self.hooks.get() {
            Some(hooks) => Ok(hooks
                .admit(ask)
                .await
                .inspect_err(|denial| self.metrics.refused(denial.refusal()))?),
            None => Ok(None),
        }
    }

    /// Tells the hooks what happened (after it is recorded, before the
    /// answer leaves).
    pub(crate) async fn tell(&self, event: Event<'_>) -> Result<Told, Denial> {
        match self.hooks.get() {
            Some(hooks) => hooks.told(event).await,
            None => Ok(Told::default()),
        }
    }

    /// Tells the hooks sandbox `id` of `team` runs here; a denial kills it
    /// again and is the create's error.
    pub(crate) async fn tell_created(&self, id: &str, team: &str) -> Result<(), SandboxError> {
        let Err(denial) = self.tell(Event::Created { id, team }).await else {
            return Ok(());
        };
        tracing::warn!("sandbox {id}: {denial}; killing it");
        if let Err(e) = self.kill_unannounced(id).await {
            tracing::warn!("sandbox {id}: killing it after its denial: {e}");
        }
        Err(denial.into())
    }

    /// Runs `fork`, a fork for `team`, once the hooks admit a create for
    /// that team (before it takes any room), then tells them of each child
    /// it made here ([`Manager::tell_created`]): a denied child's entry
    /// becomes its denial. `children` picks the children out of its answer.
    pub(crate) async fn announced_fork<T>(
        &self,
        team: &str,
        parent: &str,
        fork: impl Future<Output = Result<T, SandboxError>>,
        children: impl FnOnce(&mut T) -> &mut [Result<SandboxRecord, SandboxError>],
    ) -> Result<T, SandboxError> {
        let _permit = self
            .admit(crate::node::events::Ask::Create { team })
            .await?;
        let mut forked = fork.await?;
        for child in children(&mut forked).iter_mut() {
            let Ok(record) = child else { continue };
            match self.tell_created(&record.id, team).await {
                Ok(()) => self.saw(LifecycleKind::Forked, record, Some(parent)),
                Err(e) => *child = Err(e),
            }
        }
        Ok(forked)
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sandbox `id` of this node. One recorded but not registered yet
    /// (recorded by hand, or read before [`Manager::recover`] got to it) is
    /// registered in its recorded state, without a VMM: a kill removes the
    /// record before it leaves the registry, so none comes back this way.
    fn sandbox(&self, id: &str) -> Result<Arc<Sandbox>, SandboxError> {
        if let Some(sandbox) = self.registry().get(id) {
            return Ok(sandbox);
        }
        let record = self.get(id)?;
        let phase = match record.state {
            SandboxState::Running => Phase::Running,
            SandboxState::Paused => Phase::Paused,
        };
        let mut registry = self.registry();
        registry.insert(Sandbox::of_record(&record, phase));
        registry
            .get(id)
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn template(&self) -> &TemplateRecord {
        &self.template
    }

    pub fn capacity(&self) -> &Arc<Capacity> {
        &self.capacity
    }

    /// The node's Prometheus metrics.
    pub fn metrics(&self) -> &crate::node::metrics::Metrics {
        &self.metrics
    }

    /// Sandboxes removed since the start because their VMM exited by itself.
    pub fn vmm_exits(&self) -> u64 {
        self.vmm_exits.load(Ordering::Relaxed)
    }

    /// Puts `launched` in as `sandbox`'s running guest (by the holder of its
    /// `guest` lock) and watches its VMM process: one that ends while it is
    /// still this sandbox's guest died by itself (see [`Manager::vmm_exited`]).
    fn run_guest(
        &self,
        sandbox: &Sandbox,
        guest: &mut Option<Launched>,
        launched: Launched,
    ) -> Result<(), SandboxError> {
        let watch = launched.vm.exit_watch();
        let vmm = (launched.vm.pid(), launched.vm.dir().to_owned());
        sandbox.run(guest, launched)?;
        match watch {
            Ok(watch) => {
                let (me, id) = (self.me.clone(), sandbox.id.clone());
                tokio::spawn(async move {
                    if let Err(e) = watch.exited().await {
                        tracing::warn!("sandbox {id}: watching its VMM: {e}");
                        return;
                    }
                    if let Some(manager) = me.upgrade() {
                        manager.vmm_exited(&id, vmm.0, &vmm.1).await;
                    }
                });
            }
            Err(e) => tracing::warn!(
                "sandbox {}: its VMM is not watched ({e}): an exit goes unnoticed",
                sandbox.id
            ),
        }
        Ok(())
    }

    /// The VMM (`pid` in `dir`) of sandbox `id` ended. If it is still the
    /// sandbox's guest once no change holds the sandbox (a kill or pause
    /// takes it out before stopping it), it died by itself: the sandbox is
    /// removed as a kill would (record, capacity, files), as E2B's
    /// orchestrator removes a sandbox whose VM process ended, so the API
    /// answers 404 and the proxy 502 "not found" rather than a running
    /// sandbox nothing serves.
    async fn vmm_exited(&self, id: &str, pid: u32, dir: &Path) {
        let _busy = self.activity.read().await;
        let Some(sandbox) = self.registry().get(id) else {
            return;
        };
        // Not its VMM any more (a pause or kill stops the VMM after taking
        // it out): no need to wait for its lock. Taken here, if only for a
        // moment after the pause answers, it would turn its owner's next
        // change (a fork of the paused sandbox) into a 409.
        if sandbox
            .probe()
            .is_none_or(|p| p.pid() != pid || p.dir() != dir)
        {
            return;
        }
        let mut guest = sandbox.guest.lock().await;
        let Some(launched) = guest
            .as_mut()
            .filter(|l| l.vm.pid() == pid && l.vm.dir() == dir)
        else {
            return;
        };
        let status = match launched.vm.wait_exit(Duration::from_secs(1)).await {
            Ok(status) => status.to_string(),
            Err(_) => "status unknown".into(),
        };
        let log = launched.vm.vmm_log();
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        self.vmm_exits.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "sandbox {id}: its VMM (pid {pid}) exited by itself ({status}); removing the sandbox. \
             VMM log, last lines:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
        let record = self.store.sandbox(id).ok().flatten();
        match self.remove(id, Some(&sandbox), Some(guest)).await {
            Ok(()) => {
                if let Some(r) = record {
                    self.saw(LifecycleKind::Killed, &r, None);
                }
            }
            Err(e) => tracing::warn!("sandbox {id}: removing it after its VMM exited: {e}"),
        }
    }

    /// Sandboxes with a VMM up (running, or changing with one).
    pub fn live_count(&self) -> usize {
        self.registry()
            .all()
            .iter()
            .filter(|s| s.probe().is_some())
            .count()
    }

    /// The phase of sandbox `id` on this node.
    pub fn phase(&self, id: &str) -> Option<Phase> {
        self.registry().get(id).map(|s| s.phase())
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.config.sandboxes_dir().join(id)
    }

    /// Kills sandboxes whose time is up, every [`REAP_EVERY`].
    pub fn start_reaper(self: Arc<Self>) {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(REAP_EVERY).await;
                self.reap_expired().await;
            }
        });
    }

    pub async fn reap_expired(&self) {
        let now = now_ms();
        let all = match self.store.sandboxes() {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!("looking for expired sandboxes: {e}");
                return;
            }
        };
        // Paused by the node, not its owner: its clock ran on, and at its
        // end it gets what its timeout would have done.
        for s in all.iter().filter(|s| {
            s.state == SandboxState::Paused
                && s.pause_reason == Some(PauseReason::MemoryPressure)
                && s.end_at_ms <= now
        }) {
            self.timeout_while_paused_by_pressure(s).await;
        }
        let expired: Vec<(String, Option<PauseMode>)> = all
            .into_iter()
            .filter(|s| s.state == SandboxState::Running && s.end_at_ms <= now)
            .map(|s| {
                let mode = match s.auto_pause_memory {
                    true => PauseMode::Full,
                    false => PauseMode::Filesystem,
                };
                (s.id, s.auto_pause.then_some(mode))
            })
            .collect();
        for (id, auto_pause) in expired {
            if let Some(mode) = auto_pause {
                tracing::info!("sandbox {id}: timeout reached, pausing it ({mode:?})");
                match self.pause_for(&id, mode, PauseReason::Timeout).await {
                    Ok(paused) => {
                        self.saw(LifecycleKind::Paused, &paused, None);
                        continue;
                    }
                    Err(SandboxError::Conflict { .. }) => continue,
                    Err(e) => tracing::warn!("sandbox {id}: pausing at timeout: {e}; killing it"),
                }
            } else {
                tracing::info!("sandbox {id}: timeout reached, killing it");
            }
            if let Err(e) = self.kill_seen(&id).await {
                tracing::warn!("sandbox {id}: killing at timeout: {e}");
            }
        }
    }

    /// Launches `plan` as the guest of the new sandbox `id` (in the registry
    /// while it starts, so a kill waits for it) and records it with
    /// `record` once it is up: the one place a new sandbox comes to be
    /// (creates and fork children).
    async fn start_sandbox(
        &self,
        vmm: Option<launch::Taken>,
        plan: Plan,
        record: impl FnOnce(&Launched) -> SandboxRecord,
        token: Option<crate::node::ids::Token>,
        ingress: crate::node::ingress::Ingress,
        id: &str,
    ) -> Result<(SandboxRecord, launch::LaunchTimes), SandboxError> {
        let sandbox = Sandbox::new(id.to_owned(), token, ingress, Phase::Starting);
        let mut guest = sandbox.guest.lock().await;
        if !self.registry().insert(sandbox.clone()) {
            return Err(SandboxError::Invalid(format!("sandbox id {id} is taken")));
        }
        let started = async {
            let mut launched = launch::launch_in(&self.pool, vmm, plan).await?;
            let storing = std::time::Instant::now();
            let mut record = record(&launched);
            record.network.slot = launched.net_slot();
            self.store.put_sandbox(&record)?;
            launched.times.recorded = storing.elapsed();
            launched.settle_disk();
            Ok::<_, SandboxError>((launched, record))
        }
        .await;
        match started {
            Ok((launched, record)) => {
                let times = launched.times;
                self.run_guest(&sandbox, &mut guest, launched)?;
                Ok((record, times))
            }
            Err(e) => {
                self.registry().remove(id);
                sandbox.set_phase(Phase::Gone)?;
                Err(e)
            }
        }
    }

    /// A client's create: admitted by the hooks before it takes room, told
    /// to them once it runs (a denial then kills it again).
    pub async fn create(&self, params: CreateParams) -> Result<SandboxRecord, SandboxError> {
        let team = crate::node::tenants::team_or_default(params.team.as_deref()).to_owned();
        let _permit = self
            .admit(crate::node::events::Ask::Create { team: &team })
            .await?;
        let record = self.create_unannounced(params).await?;
        self.tell_created(&record.id, &team).await?;
        self.saw(LifecycleKind::Created, &record, None);
        Ok(record)
    }

    /// Restores the template into a pooled VMM with a fresh root layer,
    /// initialises its agent and records the sandbox as running. Neither
    /// asked nor told (a build's own sandbox; see [`Manager::create`]).
    pub async fn create_unannounced(
        &self,
        params: CreateParams,
    ) -> Result<SandboxRecord, SandboxError> {
        let _busy = self.activity.read().await;
        let (template, _pin) = self.pin_template(&params.template_id)?;
        let team = crate::node::tenants::team_or_default(params.team.as_deref());
        // Held until the record names its volumes (or its copies of a
        // snapshot's), so that no other create takes them and no delete
        // removes them meanwhile.
        let _mounting = self
            .volume_changes_if(
                !params.volume_mounts.is_empty() || !template.volume_mounts.is_empty(),
            )
            .await;
        let mounts = self.mounts_for(team, &template, &params)?;
        // Held before the slow restore; given back if the create fails.
        let hold = self.capacity.reserve_for(
            Ask::sandbox(u64::from(template.vcpus), template.mem_mib),
            "a sandbox",
            Some(team),
        )?;
        let id = ids::sandbox_id().map_err(io("generating a sandbox id"))?;
        let r = self
            .create_inner(&id, &template, params, &mounts, hold)
            .await;
        match &r {
            // A cold boot maps no memory file to learn a working set of.
            Ok(_) if template.filesystem_only => {}
            Ok(_) => self.record_working_set(&template, &id),
            Err(_) => {
                let _ = std::fs::remove_dir_all(self.sandbox_dir(&id));
            }
        }
        r
    }

    /// Creates sandbox `id` from `template` with `mounts` (resolved by
    /// [`Manager::mounts_for`]) in its slots, mounted in the guest before it
    /// is answered.
    async fn create_inner(
        &self,
        id: &str,
        template: &TemplateRecord,
        params: CreateParams,
        mounts: &[VolumeMount],
        hold: Reservation,
    ) -> Result<SandboxRecord, SandboxError> {
        if template.net_abi.is_some() && self.pool.net().is_none() {
            return Err(SandboxError::Unavailable(format!(
                "template {} was made with a network interface and this node runs without \
                 networking (--no-network): rebuild it here",
                template.id
            )));
        }
        let dir = self.sandbox_dir(id);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let root = dir.join(ROOT_LAYER);
        let (base, top) = (template.root_layer.clone(), root.clone());
        tokio::task::spawn_blocking(move || LayeredDisk::create(&base, &top).map(drop)).await??;
        // A snapshot's volumes: its own copy of each, in the snapshot's
        // slots (mounted already in the snapshot's memory).
        let copies = self.snapshot_copies(template, &dir).await?;
        let asked = mounts;
        let mounts = [asked, &copies[..]].concat();
        let mounts = &mounts[..];
        // Where its unused volume slots point (see `Manager::restore_onto`);
        // a base template built before volumes has none yet.
        let base_dir = self.template.dir.clone();
        tokio::task::spawn_blocking(move || volume::ensure_placeholder(&base_dir, volume::SLOTS))
            .await?
            .map_err(io("making the volume slots' placeholder"))?;
        // A filesystem-only snapshot's sandboxes boot on its disk (no
        // volumes: `mounts_for` refused them); the booted agent has no
        // token until its init.
        let (guest, token, timeout) = match template.filesystem_only {
            true => (
                self.boot_on(template.vcpus, template.mem_mib, &root),
                None,
                BOOT_TIMEOUT,
            ),
            false => (
                Guest::Restore(self.restore_onto(
                    &template.snapshot,
                    &template.mem,
                    &root,
                    working_set::file_of(template),
                    mounts,
                )),
                template.agent_token.clone(),
                AGENT_TIMEOUT,
            ),
        };

        let access_token = if params.secure {
            Some(ids::token().map_err(io("generating an access token"))?)
        } else {
            None
        };
        // A snapshot's environment stays; the create's own variables win.
        let mut env_vars = template.env_vars.clone();
        env_vars.extend(params.env_vars);
        let mut init = AgentInit::after_restore()?;
        init.access_token = access_token.clone().map(String::from);
        init.env_vars = Some(env_vars.clone());
        // Its volumes' files are its disk's too: its jail is handed them,
        // and the collector keeps them while it exists.
        let uses_dirs: Vec<PathBuf> = template
            .uses_dirs
            .iter()
            .cloned()
            .chain(self.volume_dirs(mounts)?)
            .collect();
        let plan = Plan {
            guest,
            // A snapshot's agent still holds its source's token until this init.
            ready: Ready::Init {
                init: Box::new(init),
                token,
            },
            hold,
            timeout,
            egress: params.network.policy.clone(),
            lineage: self.lineage(&dir, &uses_dirs, &template.uses_snapshots, &template.id),
        };

        let ingress = params.network.ingress.clone();
        let mut uses_snapshots = template.uses_snapshots.clone();
        // Its memory maps the template's file: only base is never deleted.
        if template.id != self.template.id {
            uses_snapshots.push(template.id.clone());
        }
        let record = |launched: &Launched| {
            let started = now_ms();
            SandboxRecord {
                id: id.to_owned(),
                template_id: template.id.clone(),
                alias: Some(template.names.first().unwrap_or(&template.id).clone()),
                metadata: params.metadata,
                env_vars,
                access_token: access_token.clone(),
                started_at_ms: started,
                end_at_ms: started + params.timeout.as_millis() as u64,
                state: SandboxState::Running,
                cpu_count: u32::from(template.vcpus),
                memory_mb: template.mem_mib,
                disk_size_mb: template.disk_size_mb,
                auto_pause: params.auto_pause,
                auto_pause_memory: params.auto_pause_memory,
                pause_generation: 0,
                local_pause: None,
                snapshot: None,
                cold_booted: template.filesystem_only,
                envd_unresponsive_at_pause: false,
                root_layer: None,
                has_dependents: false,
                uses_snapshots,
                uses_dirs: uses_dirs.iter().cloned().chain([dir.clone()]).collect(),
                vmm_dir: Some(launched.vm.dir().to_owned()),
                network: params.network,
                pause_reason: None,
                team: crate::node::tenants::stored_team(params.team.as_deref()),
                // A cold boot runs under this node's CPU template.
                cpu_template: match template.filesystem_only {
                    true => self.config.cpu_template_name(),
                    false => template.cpu_template.clone(),
                },
                volume_mounts: mounts.to_vec(),
                forked_from: params.forked_from,
            }
        };
        let (record, _) = self
            .start_sandbox(None, plan, record, access_token.clone(), ingress, id)
            .await?;
        if let Err(e) = self.mount_volumes(&record, asked).await {
            if let Err(k) = self.kill_unannounced(id).await {
                tracing::warn!("sandbox {id}: killing it after its volumes failed to mount: {k}");
            }
            return Err(e);
        }
        Ok(record)
    }

    /// A snapshot restored with `root` as the root disk, `mounts` in their
    /// slots, and `prefetch`, its working set, populated after the load.
    fn restore_onto(
        &self,
        state: &std::path::Path,
        mem: &std::path::Path,
        root: &std::path::Path,
        prefetch: Option<PathBuf>,
        mounts: &[VolumeMount],
    ) -> Restore {
        self.with_slots(
            Restore {
                state: state.to_owned(),
                mem: mem.to_owned(),
                drives: vec![DriveOverride::new(
                    self.template.root_drive_id.clone(),
                    root.display().to_string(),
                )],
                prefetch,
            },
            mounts,
        )
    }

    /// `restore` with `mounts` in their slots and every other volume slot
    /// it does not name read-only on the base template's placeholder
    /// ([`volume`]): a template's own may be gone (a build's scratch
    /// directory) or on another node, and a jailed VMM is handed only the
    /// disks a restore names. A snapshot without slots ignores them.
    pub(crate) fn with_slots(&self, mut restore: Restore, mounts: &[VolumeMount]) -> Restore {
        let attached: Vec<volume::Attached> = mounts
            .iter()
            .map(|m| volume::Attached {
                slot: m.slot,
                disk: m.disk.clone(),
                read_only: m.read_only,
            })
            .collect();
        let named = |id: &str| restore.drives.iter().any(|d| d.drive_id == id);
        let slots: Vec<_> = volume::restore_drives(&self.template.dir, volume::SLOTS, &attached)
            .into_iter()
            .filter(|d| !named(&d.drive_id))
            .collect();
        restore.drives.extend(slots);
        restore
    }

    /// Pauses a running sandbox. [`PauseMode::Full`]: its memory and devices
    /// into a snapshot in its directory (a diff over what it was restored
    /// from), its disk flushed; [`PauseMode::Filesystem`]: its guest flushes
    /// its disk, and nothing else is kept. Then its VMM stops; the store says
    /// `paused` once all is on disk.
    /// A client's pause: the hooks are asked first and told after; what
    /// they tell back (whether the pause is kept beyond this node) comes
    /// with the paused record. `kept_here`: the client asked that this
    /// pause stay on this node (recorded before the hooks are told).
    pub async fn pause(
        &self,
        id: &str,
        mode: PauseMode,
        kept_here: bool,
    ) -> Result<(SandboxRecord, Told), SandboxError> {
        let _permit = self.admit(crate::node::events::Ask::Pause { id }).await?;
        let mut record = self.pause_for(id, mode, PauseReason::Request).await?;
        if kept_here {
            let generation = record.pause_generation;
            record = self
                .store
                .update_sandbox(id, |r| r.local_pause = Some(generation))?
                .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
        }
        self.saw(LifecycleKind::Paused, &record, None);
        let told = self
            .tell(Event::Paused { id })
            .await
            .unwrap_or_else(|denial| {
                tracing::warn!("sandbox {id}: paused, but {denial}");
                Told::default()
            });
        Ok((record, told))
    }

    /// [`Manager::pause`] for `reason`. A pause for memory pressure gives
    /// way to a request that reached the sandbox meanwhile; a pause its
    /// owner asks for of a sandbox the node paused for memory pressure
    /// makes that pause the owner's (it stays paused, and no request
    /// resumes it by itself any more).
    async fn pause_for(
        &self,
        id: &str,
        mode: PauseMode,
        reason: PauseReason,
    ) -> Result<SandboxRecord, SandboxError> {
        let _busy = self.activity.read().await;
        let sandbox = self.sandbox(id)?;
        let Ok(mut guest) = sandbox.guest.try_lock() else {
            return Err(live::busy(id));
        };
        match sandbox.phase() {
            Phase::Running => {}
            Phase::Paused if reason == PauseReason::Request => {
                let mut taken = false;
                let record = self.store.update_sandbox(id, |s| {
                    if s.pause_reason == Some(PauseReason::MemoryPressure) {
                        s.pause_reason = Some(PauseReason::Request);
                        taken = true;
                    }
                })?;
                if let (true, Some(record)) = (taken, record) {
                    return Ok(record);
                }
                return Err(SandboxError::Conflict {
                    id: id.to_owned(),
                    state: "already paused",
                });
            }
            Phase::Paused => {
                return Err(SandboxError::Conflict {
                    id: id.to_owned(),
                    state: "already paused",
                });
            }
            other => return Err(other.refusal(id)),
        }
        let record = self.get(id)?;
        if mode == PauseMode::Filesystem && !record.volume_mounts.is_empty() {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "mounting volumes: a filesystem-only pause is refused, since its resume \
                        (a cold boot) does not attach volumes yet; pause it with its memory",
            });
        }
        let Some(launched) = guest.as_ref() else {
            return Err(Phase::Gone.refusal(id));
        };
        // A memory pause goes on without the agent (E2B's default), and says
        // so on the record; the node's own pause for memory pressure, which
        // the next request undoes by a memory resume, leaves such a guest.
        let agent_unresponsive = mode == PauseMode::Full && !self.guest_answers(id).await;
        if agent_unresponsive && reason == PauseReason::MemoryPressure {
            return Err(live::busy(id));
        }
        // The proxy answers "not found" while it pauses.
        sandbox.set_phase(Phase::Pausing)?;
        // Checked once no new request can reach it (the proxy counts a
        // request before it looks for the guest): one that came first wins.
        if reason == PauseReason::MemoryPressure && sandbox.in_flight() > 0 {
            sandbox.set_phase(Phase::Running)?;
            return Err(live::busy(id));
        }
        let dir = self.sandbox_dir(id);
        let generation = record.pause_generation + 1;
        let written = match mode {
            PauseMode::Full => self.write_memory(&record, launched, generation).await,
            PauseMode::Filesystem => self.flush_guest_disk(&record, launched).await,
        };
        let snapshot = match written {
            Ok(snapshot) => snapshot,
            Err(e) => {
                let _ = launched.vm.resume().await;
                sandbox.set_phase(Phase::Running)?;
                return Err(e);
            }
        };
        // The VMM stays (paused) until the record says paused: a pause that
        // cannot be committed resumes the sandbox instead of stranding it.
        let mut files = vec![self.root_layer(&record), dir.clone()];
        files.extend(record.volume_mounts.iter().map(|m| m.disk.clone()));
        if let Some(s) = &snapshot {
            files.extend([s.state.clone(), s.mem.clone()]);
        }
        let committed = match sync_files(files).await {
            Ok(()) => {
                crate::node::crash::point("pause.written");
                self.store
                    .update_sandbox(id, |s| {
                        s.state = SandboxState::Paused;
                        s.pause_reason = Some(reason);
                        s.pause_generation = generation;
                        s.snapshot = snapshot;
                        s.cold_booted = false;
                        s.envd_unresponsive_at_pause = agent_unresponsive;
                        s.vmm_dir = None;
                        // Its slot goes back with its VMM; a resume takes another.
                        s.network.slot = None;
                    })
                    .map_err(SandboxError::from)
            }
            Err(e) => Err(e),
        };
        match committed {
            Ok(Some(paused)) => {
                crate::node::crash::point("pause.committed");
                sandbox.set_phase(Phase::Paused)?;
                if let Some(launched) = guest.take() {
                    // Its last console lines, before the VMM's directory goes.
                    self.observed(&sandbox)
                        .follow(&launched.probe().console_path(), now_ms());
                    launched.stop().await;
                }
                Ok(paused)
            }
            Ok(None) => Err(SandboxError::NotFound(id.to_owned())),
            Err(e) => {
                tracing::warn!("sandbox {id}: pause not committed ({e}); resuming it");
                let _ = launched.vm.resume().await;
                sandbox.set_phase(Phase::Running)?;
                Err(e)
            }
        }
    }

    /// A full pause's snapshot of a running guest, which stays paused:
    /// pausing the devices flushes the root layer (see the VMM's block
    /// device), so disk and memory agree.
    async fn write_memory(
        &self,
        record: &SandboxRecord,
        launched: &Launched,
        generation: u32,
    ) -> Result<Option<PausedSnapshot>, SandboxError> {
        let dir = self.sandbox_dir(&record.id);
        // A pause that was not committed (the sandbox ran on, or the node
        // died before its record) wrote these names, and the running guest's
        // memory is mapped from that file: the next free names, never those.
        let snapshot = (generation..=u32::MAX)
            .map(|n| PausedSnapshot {
                state: dir.join(format!("pause-{n}.state")),
                mem: dir.join(format!("pause-{n}.mem")),
            })
            .find(|s| !s.state.exists() && !s.mem.exists())
            .ok_or_else(|| SandboxError::Invalid("no free name for a pause's files".into()))?;
        // A cold-booted guest's memory is in no file: all of it is written.
        let kind = match record.cold_booted {
            true => SnapshotType::Full,
            false => SnapshotType::Diff,
        };
        launched
            .vm
            .snapshot(kind, &snapshot.state, &snapshot.mem)
            .await?;
        Ok(Some(snapshot))
    }

    /// A filesystem-only pause: the guest writes back what its page cache
    /// holds (its agent must answer), then the VM stops; the VMM's pause
    /// flushes the root layer.
    async fn flush_guest_disk(
        &self,
        record: &SandboxRecord,
        launched: &Launched,
    ) -> Result<Option<PausedSnapshot>, SandboxError> {
        self.sync_guest(record, launched, "a filesystem-only pause")
            .await?;
        launched.vm.pause().await?;
        Ok(None)
    }

    /// Has the guest write back what its page cache holds (its agent must
    /// answer), for `what`, which keeps its disk and not its memory.
    async fn sync_guest(
        &self,
        record: &SandboxRecord,
        launched: &Launched,
        what: &str,
    ) -> Result<(), SandboxError> {
        let agent = launched
            .vm
            .agent()
            .with_access_token(record.access_token.as_deref())
            .with_timeout(GUEST_CHECK_TIMEOUT);
        let synced = agent.run_argv("/bin/sh", &["-c", "sync"]).await;
        match synced {
            Ok(out) if out.exit_code == 0 => {}
            Ok(out) => {
                return Err(SandboxError::Unavailable(format!(
                    "{what} needs the guest to flush its disk; `sync` exited {}: {}",
                    out.exit_code,
                    out.stderr.trim()
                )));
            }
            Err(e) => {
                return Err(SandboxError::Unavailable(format!(
                    "{what} needs the guest agent to answer: {e}"
                )));
            }
        }
        Ok(())
    }

    /// Resumes a paused sandbox for `timeout`; returns it and whether it was
    /// paused. A running sandbox only has its timeout extended (never
    /// shortened). A resume waits for a change under way, so two resumes
    /// restore once. One paused without memory, or resumed with
    /// [`ResumeMode::Reboot`], cold-boots on its disk.
    pub async fn resume(
        &self,
        id: &str,
        timeout: Duration,
        mode: ResumeMode,
    ) -> Result<(SandboxRecord, bool), SandboxError> {
        let before = self.get(id)?;
        let team = before.team().to_owned();
        let _permit = self
            .admit(crate::node::events::Ask::Resume { id, team: &team })
            .await?;
        let resumed = self.resume_unannounced(id, timeout, mode).await;
        // One the node paused for memory pressure ran all along for its owner.
        if let Ok((record, true)) = &resumed
            && before.pause_reason != Some(PauseReason::MemoryPressure)
        {
            self.saw(LifecycleKind::Resumed, record, None);
        }
        let event = match &resumed {
            Ok(_) => Event::Resumed { id },
            Err(_) => Event::NotResumed { id },
        };
        if let Err(denial) = self.tell(event).await {
            tracing::warn!("sandbox {id}: after its resume: {denial}");
        }
        resumed
    }

    /// [`Manager::resume`], neither asked nor told (a sandbox the node
    /// paused for memory pressure, resumed for a request that reached it).
    pub(crate) async fn resume_unannounced(
        &self,
        id: &str,
        timeout: Duration,
        mode: ResumeMode,
    ) -> Result<(SandboxRecord, bool), SandboxError> {
        let end = now_ms() + timeout.as_millis() as u64;
        let sandbox = self.sandbox(id)?;
        if sandbox.phase() == Phase::Running {
            return Ok((self.extend_to(id, end)?, false));
        }
        let _busy = self.activity.read().await;
        let mut guest = sandbox.guest.lock().await;
        match sandbox.phase() {
            Phase::Running => return Ok((self.extend_to(id, end)?, false)),
            Phase::Paused => {}
            other => return Err(other.refusal(id)),
        }
        let record = self.get(id)?;
        let restore = match mode {
            ResumeMode::Restore => record.snapshot.clone(),
            ResumeMode::Reboot => None,
        };
        if restore.is_some() && record.envd_unresponsive_at_pause {
            return Err(SandboxError::AgentUnresponsiveAtPause(id.to_owned()));
        }
        if restore.is_none() && !record.volume_mounts.is_empty() {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "mounting volumes: a resume from its disk alone (a cold boot) does not \
                        attach volumes yet; resume it with its memory",
            });
        }
        sandbox.set_phase(Phase::Resuming)?;
        let restored = async {
            let hold = self.capacity.reserve_for(
                Ask::sandbox(u64::from(record.cpu_count), record.memory_mb),
                &format!("resuming sandbox {id}"),
                Some(record.team()),
            )?;
            let root = self.root_layer(&record);
            let plan = match &restore {
                Some(snapshot) => Plan {
                    guest: Guest::Restore(self.restore_onto(
                        &snapshot.state,
                        &snapshot.mem,
                        &root,
                        None,
                        &record.volume_mounts,
                    )),
                    ready: Ready::Init {
                        init: Box::new(AgentInit::after_restore()?),
                        token: record.access_token.clone(),
                    },
                    hold,
                    timeout: AGENT_TIMEOUT,
                    egress: record.network.policy.clone(),
                    lineage: self.record_lineage(&record),
                },
                None => self.cold_boot(&record, &root, hold)?,
            };
            let mut launched = launch::launch(&self.pool, plan).await?;
            let r = self
                .store
                .update_sandbox(id, |s| {
                    s.state = SandboxState::Running;
                    s.pause_reason = None;
                    s.end_at_ms = end;
                    s.cold_booted = restore.is_none();
                    s.envd_unresponsive_at_pause = false;
                    if restore.is_none() {
                        // Booted afresh, under this node's CPU template.
                        s.cpu_template = self.config.cpu_template_name();
                    }
                    s.vmm_dir = Some(launched.vm.dir().to_owned());
                    s.network.slot = launched.net_slot();
                })?
                .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
            launched.settle_disk();
            Ok::<_, SandboxError>((launched, r))
        }
        .await;
        match restored {
            Ok((launched, r)) => {
                self.run_guest(&sandbox, &mut guest, launched)?;
                Ok((r, true))
            }
            Err(e) => {
                sandbox.set_phase(Phase::Paused)?;
                Err(e)
            }
        }
    }

    /// The plan that boots the node's kernel on a sandbox's disk: a fresh
    /// guest whose agent gets the sandbox's token and environment.
    fn cold_boot(
        &self,
        record: &SandboxRecord,
        root: &std::path::Path,
        hold: Reservation,
    ) -> Result<Plan, SandboxError> {
        let vcpus = u8::try_from(record.cpu_count)
            .map_err(|_| SandboxError::Invalid(format!("{} vCPUs", record.cpu_count)))?;
        let init = agent_init(record)?;
        Ok(Plan {
            guest: self.boot_on(vcpus, record.memory_mb, root),
            // A booted agent has no token until this init.
            ready: Ready::Init {
                init: Box::new(init),
                token: None,
            },
            hold,
            timeout: BOOT_TIMEOUT,
            egress: record.network.policy.clone(),
            lineage: self.record_lineage(record),
        })
    }

    /// The node's kernel booted with `vcpus` and `mem_mib` on the root
    /// disk `root` (a cold boot: a filesystem-only pause's resume, a
    /// filesystem-only snapshot's create).
    fn boot_on(&self, vcpus: u8, mem_mib: u64, root: &std::path::Path) -> Guest {
        Guest::Boot(GuestSpec {
            kernel: self.template.kernel.clone(),
            boot_args: Some(launch::BOOT_ARGS.into()),
            vcpus,
            mem_mib,
            drives: vec![Drive::new(
                self.template.root_drive_id.clone(),
                root.display().to_string(),
                true,
                false,
            )],
            vsock: true,
            // The node's, set by the launch.
            cpu_template: None,
        })
    }

    /// The writable layer of a sandbox's root disk.
    fn root_layer(&self, record: &SandboxRecord) -> PathBuf {
        record
            .root_layer
            .clone()
            .unwrap_or_else(|| self.sandbox_dir(&record.id).join(ROOT_LAYER))
    }

    pub fn get(&self, id: &str) -> Result<SandboxRecord, SandboxError> {
        self.store
            .sandbox(id)?
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))
    }

    pub fn list(&self) -> Result<Vec<SandboxRecord>, SandboxError> {
        Ok(self.store.sandboxes()?)
    }

    /// A client's kill: [`Manager::kill_unannounced`], then the hooks are
    /// told.
    pub async fn kill(&self, id: &str) -> Result<(), SandboxError> {
        self.kill_seen(id).await?;
        if let Err(denial) = self.tell(Event::Killed { id }).await {
            tracing::warn!("sandbox {id}: killed, but {denial}");
        }
        Ok(())
    }

    /// [`Manager::kill_unannounced`] of a sandbox ended for its owner (its
    /// kill, its timeout), which the subscribers are told.
    pub(crate) async fn kill_seen(&self, id: &str) -> Result<(), SandboxError> {
        // A store that cannot be read fails the kill below, not here.
        let record = self.store.sandbox(id).ok().flatten();
        self.kill_unannounced(id).await?;
        if let Some(record) = record {
            self.saw(LifecycleKind::Killed, &record, None);
        }
        Ok(())
    }

    /// Stops the sandbox's VMM and removes its files and record; waits for
    /// a change under way to end first. Not told (a timeout, memory
    /// pressure, a build's end, a copy the cluster gave to another node).
    pub async fn kill_unannounced(&self, id: &str) -> Result<(), SandboxError> {
        // The collector must not see the record and then miss its files.
        let _busy = self.activity.read().await;
        let sandbox = self.registry().get(id);
        let guest = match &sandbox {
            Some(s) => Some(s.guest.lock().await),
            None => None,
        };
        self.remove(id, sandbox.as_ref(), guest).await
    }

    /// What a kill does once it holds `sandbox`'s `guest` lock (and the
    /// activity lock shared): stops the VMM, removes record, registration
    /// and files.
    async fn remove(
        &self,
        id: &str,
        sandbox: Option<&Arc<Sandbox>>,
        mut guest: Option<tokio::sync::MutexGuard<'_, Option<Launched>>>,
    ) -> Result<(), SandboxError> {
        let mut launched = None;
        if let (Some(sandbox), Some(guest)) = (sandbox, guest.as_mut()) {
            if sandbox.phase() == Phase::Gone {
                return Err(SandboxError::NotFound(id.to_owned()));
            }
            sandbox.set_phase(Phase::Stopping)?;
            launched = guest.take();
        }
        let record = self.store.sandbox(id);
        let existed = self.store.remove_sandbox(id);
        if let Some(sandbox) = sandbox {
            self.registry().remove(id);
            sandbox.set_phase(Phase::Gone)?;
            // No more writes to its history: the observer may hold it still.
            sandbox.observed().close();
        }
        drop(guest);
        // Stopping the process first; then its files can go, unless forks
        // still read them.
        if let Some(launched) = launched {
            launched.stop().await;
        }
        let (record, existed) = (record?, existed?);
        if sandbox.is_none() && !existed {
            return Err(SandboxError::NotFound(id.to_owned()));
        }
        // Its logs and metrics go with it; its files stay while others
        // stack on them.
        let mut dirs = vec![self.config.observe_dir().join(id)];
        if !record.is_some_and(|r| r.has_dependents) {
            dirs.push(self.sandbox_dir(id));
        }
        tokio::task::spawn_blocking(move || {
            for dir in dirs {
                if let Err(e) = std::fs::remove_dir_all(&dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!("removing {}: {e}", dir.display());
                }
            }
        })
        .await?;
        Ok(())
    }

    /// Sets a running sandbox to end `timeout` from now (shorter or longer).
    /// A paused one is not found, as on E2B, whose timeout looks only among
    /// the sandboxes its nodes run; but one the node paused for memory
    /// pressure runs as far as its owner knows, and its clock runs on.
    pub fn set_timeout(&self, id: &str, timeout: Duration) -> Result<SandboxRecord, SandboxError> {
        let end = now_ms() + timeout.as_millis() as u64;
        let mut paused = false;
        let updated = self.store.update_sandbox(id, |s| {
            paused = s.state == SandboxState::Paused
                && s.pause_reason != Some(PauseReason::MemoryPressure);
            if !paused {
                s.end_at_ms = end;
            }
        })?;
        match updated {
            Some(record) if !paused => Ok(record),
            _ => Err(SandboxError::NotFound(id.to_owned())),
        }
    }

    /// Keeps a running sandbox alive at least `timeout` from now; a paused
    /// one is a conflict (it has no clock running).
    pub fn extend_timeout(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<SandboxRecord, SandboxError> {
        let record = self.get(id)?;
        if record.state != SandboxState::Running
            && record.pause_reason != Some(PauseReason::MemoryPressure)
        {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "paused",
            });
        }
        self.extend_to(id, now_ms() + timeout.as_millis() as u64)
    }

    /// Moves the sandbox's end to `end_ms` unless it ends later already.
    fn extend_to(&self, id: &str, end_ms: u64) -> Result<SandboxRecord, SandboxError> {
        self.store
            .update_sandbox(id, |s| s.end_at_ms = s.end_at_ms.max(end_ms))?
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))
    }

    /// Sandboxes taking traffic with an access token: (id, token), for the
    /// proxy's signed-URL fallback when a request names no sandbox.
    pub fn serving_tokens(&self) -> Vec<(String, String)> {
        self.registry()
            .all()
            .into_iter()
            .filter(|s| s.phase().serves())
            .filter_map(|s| Some((s.id.clone(), s.token.clone()?.into())))
            .collect()
    }

    /// The sandbox taking traffic whose access token is `token`.
    pub fn serving_by_token(&self, token: &str) -> Option<String> {
        let sandbox = self.registry().by_token(token)?;
        sandbox.phase().serves().then(|| sandbox.id.clone())
    }

    /// Whether a running sandbox's guest agent answers its health check now.
    pub async fn guest_answers(&self, id: &str) -> bool {
        let Some(vsock) = self.vsock_path(id) else {
            return false;
        };
        let probe =
            vmm_driver::vsock_connect::agent_health(&vsock, envd_proto::PORT, HEALTH_CHECK_TIMEOUT)
                .await;
        matches!(probe, Ok(204))
    }

    /// The vsock socket of a sandbox taking traffic, for the envd proxy.
    pub fn vsock_path(&self, id: &str) -> Option<PathBuf> {
        self.registry().get(id)?.serving_vsock()
    }

    /// What the port proxy demands of requests to sandbox `id`'s own ports.
    pub fn ingress(&self, id: &str) -> Option<crate::node::ingress::Ingress> {
        Some(self.registry().get(id)?.ingress.clone())
    }
}
