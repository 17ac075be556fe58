//! The sandbox manager: create (restore the template into a pooled VMM),
//! get, list, kill, timeouts. Records live in the store; running VMMs here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use disk_layers::LayeredDisk;
use vmm_api::agent_client::{AgentError, AgentInit};
use vmm_api::process::{ProcessError, VmmProcess};
use vmm_api::{DriveOverride, SnapshotLoadParams, SnapshotType, VsockOverride};

use crate::capacity::{Ask, Capacity, CapacityError, Limits, Reservation, Shortage};
use crate::config::Config;
use crate::ids;
use crate::pool::Pool;
use crate::store::{
    PausedSnapshot, SandboxRecord, SandboxState, Store, StoreError, TemplateRecord,
};
use crate::template::now_ms;

/// A restored guest answers within this (lab times included).
const AGENT_TIMEOUT: Duration = Duration::from_secs(120);
/// An adopted VMM's guest answered before the restart: it gets less time.
const ADOPT_AGENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How often expired sandboxes are looked for.
const REAP_EVERY: Duration = Duration::from_millis(500);
const ROOT_LAYER: &str = "root.layer";

mod fork;
mod gc;
mod observe;
mod recover;
mod snapshot;
#[cfg(test)]
mod tests;
pub use gc::GcStats;
pub use observe::{Level, LogLine, Sample};
pub use recover::reclaim_run_dir;
pub use snapshot::SnapshotParams;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("template {0} not found")]
    TemplateNotFound(String),
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
    #[error("sandbox {id} is {state}")]
    Conflict { id: String, state: &'static str },
    #[error("template {id} is in use by {users}")]
    InUse { id: String, users: String },
    #[error("{0}")]
    Invalid(String),
    #[error("a template or snapshot named {0} exists")]
    NameTaken(String),
    #[error("{0}")]
    Unavailable(String),
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
}

/// A running sandbox's VMM and the capacity it holds (given back when
/// this drops: kill, pause).
struct Live {
    vm: VmmProcess,
    _slot: Reservation,
}

pub struct Manager {
    config: Config,
    store: Store,
    pool: Arc<Pool>,
    template: TemplateRecord,
    live: Mutex<HashMap<String, Live>>,
    /// Sandboxes being paused or resumed: a second change waits its turn (409).
    changing: Mutex<HashSet<String>>,
    /// vCPUs, memory and slots held by running sandboxes and by creates,
    /// resumes and fork children under way.
    capacity: Arc<Capacity>,
    /// Templates creates are restoring right now (not yet recorded in a
    /// sandbox): a delete waits for them to finish.
    pins: Mutex<HashMap<String, usize>>,
    /// Metrics and console lines seen, per sandbox.
    observed: Mutex<HashMap<String, observe::Observed>>,
    /// Held shared by every change that writes files before its record says
    /// so; the garbage collector runs only when it can hold it alone.
    activity: tokio::sync::RwLock<()>,
}

impl Manager {
    pub fn new(
        config: Config,
        store: Store,
        pool: Arc<Pool>,
        template: TemplateRecord,
    ) -> Arc<Manager> {
        let limits = Limits::detect(&config.capacity, config.max_sandboxes);
        tracing::info!(
            "capacity: {} vCPUs, {} MiB of memory, {} sandboxes, {} MiB of disk kept free",
            limits.vcpus,
            limits.memory_mib,
            limits.sandboxes,
            limits.min_free_disk_mib
        );
        let capacity = Capacity::new(limits, config.data_dir.clone());
        Arc::new(Manager {
            config,
            store,
            pool,
            template,
            live: Mutex::new(HashMap::new()),
            changing: Mutex::new(HashSet::new()),
            capacity,
            pins: Mutex::new(HashMap::new()),
            observed: Mutex::new(HashMap::new()),
            activity: tokio::sync::RwLock::new(()),
        })
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
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

    /// Running sandboxes (VMMs up).
    pub fn live_count(&self) -> usize {
        self.live().len()
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
        let expired: Vec<(String, bool)> = match self.store.sandboxes() {
            Ok(all) => all
                .into_iter()
                .filter(|s| s.state == SandboxState::Running && s.end_at_ms <= now)
                .map(|s| (s.id, s.auto_pause))
                .collect(),
            Err(e) => {
                tracing::warn!("looking for expired sandboxes: {e}");
                return;
            }
        };
        for (id, auto_pause) in expired {
            if auto_pause {
                tracing::info!("sandbox {id}: timeout reached, pausing it");
                match self.pause(&id).await {
                    Ok(_) | Err(SandboxError::Conflict { .. }) => continue,
                    Err(e) => tracing::warn!("sandbox {id}: pausing at timeout: {e}; killing it"),
                }
            } else {
                tracing::info!("sandbox {id}: timeout reached, killing it");
            }
            if let Err(e) = self.kill(&id).await {
                tracing::warn!("sandbox {id}: killing at timeout: {e}");
            }
        }
    }

    /// Restores the template into a pooled VMM with a fresh root layer,
    /// initialises its agent and records the sandbox as running.
    pub async fn create(&self, params: CreateParams) -> Result<SandboxRecord, SandboxError> {
        let _busy = self.activity.read().await;
        let (template, _pin) = self.pin_template(&params.template_id)?;
        // Held before the slow restore; given back if the create fails.
        let slot = self.capacity.reserve(
            Ask::sandbox(u64::from(template.vcpus), template.mem_mib),
            "a sandbox",
        )?;
        let id = ids::sandbox_id().map_err(io("generating a sandbox id"));
        match id {
            Ok(id) => {
                let r = self.create_inner(&id, &template, params, slot).await;
                if r.is_err() {
                    let _ = std::fs::remove_dir_all(self.sandbox_dir(&id));
                }
                r
            }
            Err(e) => Err(e),
        }
    }

    async fn create_inner(
        &self,
        id: &str,
        template: &TemplateRecord,
        params: CreateParams,
        mut slot: Reservation,
    ) -> Result<SandboxRecord, SandboxError> {
        let dir = self.sandbox_dir(id);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let root = dir.join(ROOT_LAYER);
        let (base, top) = (template.root_layer.clone(), root.clone());
        tokio::task::spawn_blocking(move || LayeredDisk::create(&base, &top).map(drop)).await??;

        let vm = self
            .restore(&template.snapshot, &template.mem, &root, None)
            .await?;

        let access_token = if params.secure {
            Some(ids::token().map_err(io("generating an access token"))?)
        } else {
            None
        };
        // A snapshot's environment stays; the create's own variables win.
        let mut env_vars = template.env_vars.clone();
        env_vars.extend(params.env_vars);
        let mut init = AgentInit::after_restore()?;
        init.access_token = access_token.clone();
        init.env_vars = Some(env_vars.clone());
        // A snapshot's agent still holds its source's token until this init.
        vm.agent()
            .with_access_token(template.agent_token.as_deref())
            .init(&init)
            .await?;

        let mut uses_snapshots = template.uses_snapshots.clone();
        // Its memory maps the template's file: only base is never deleted.
        if template.id != self.template.id {
            uses_snapshots.push(template.id.clone());
        }
        let started = now_ms();
        let record = SandboxRecord {
            id: id.to_owned(),
            template_id: template.id.clone(),
            alias: Some(template.names.first().unwrap_or(&template.id).clone()),
            metadata: params.metadata,
            env_vars,
            access_token,
            started_at_ms: started,
            end_at_ms: started + params.timeout.as_millis() as u64,
            state: SandboxState::Running,
            cpu_count: u32::from(template.vcpus),
            memory_mb: template.mem_mib,
            disk_size_mb: template.disk_size_mb,
            auto_pause: params.auto_pause,
            pause_generation: 0,
            snapshot: None,
            root_layer: None,
            has_dependents: false,
            uses_snapshots,
            uses_dirs: template
                .uses_dirs
                .iter()
                .cloned()
                .chain([dir.clone()])
                .collect(),
            vmm_dir: Some(vm.dir().to_owned()),
        };
        self.store.put_sandbox(&record)?;
        slot.settle_disk();
        self.live().insert(id.to_owned(), Live { vm, _slot: slot });
        Ok(record)
    }

    /// Loads a snapshot into a pooled VMM with `root` as its root disk and
    /// waits for the agent; with `init`, initialises it, presenting the
    /// agent's current access token (else the caller does).
    async fn restore(
        &self,
        state: &std::path::Path,
        mem: &std::path::Path,
        root: &std::path::Path,
        init: Option<(&AgentInit, Option<&str>)>,
    ) -> Result<VmmProcess, SandboxError> {
        let mut vm = self.pool.take().await?;
        let mut load = SnapshotLoadParams::from_file(
            state.display().to_string(),
            mem.display().to_string(),
            true,
        );
        load.vsock_override = Some(VsockOverride {
            uds_path: vm.vsock_path().display().to_string(),
        });
        load.drive_overrides = vec![DriveOverride {
            drive_id: self.template.root_drive_id.clone(),
            path_on_host: root.display().to_string(),
        }];
        vm.api()
            .load_snapshot(&load)
            .await
            .map_err(ProcessError::from)?;
        vm.wait_for_agent(AGENT_TIMEOUT).await?;
        if let Some((init, token)) = init {
            vm.agent().with_access_token(token).init(init).await?;
        }
        Ok(vm)
    }

    /// Marks `id` as changing state for the guard's lifetime; a conflict when
    /// it already is.
    fn claim(&self, id: &str) -> Result<Claim<'_>, SandboxError> {
        let mut changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        changing
            .insert(id.to_owned())
            .then(|| Claim {
                manager: self,
                id: id.to_owned(),
            })
            .ok_or_else(|| SandboxError::Conflict {
                id: id.to_owned(),
                state: "changing state",
            })
    }

    /// Pauses a running sandbox: its memory and devices into a snapshot in
    /// its directory (a diff over what it was restored from), its disk
    /// flushed, its VMM stopped; the store says `paused` once all is on disk.
    pub async fn pause(&self, id: &str) -> Result<SandboxRecord, SandboxError> {
        let _busy = self.activity.read().await;
        // Read under the claim: a change that just ended has recorded its state.
        let _claim = self.claim(id)?;
        let record = self.get(id)?;
        if record.state == SandboxState::Paused {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "already paused",
            });
        }
        // Out of the map while pausing: the proxy answers "not found" meanwhile.
        let Some(live) = self.live().remove(id) else {
            return Err(SandboxError::NotFound(id.to_owned()));
        };
        let dir = self.sandbox_dir(id);
        let generation = record.pause_generation + 1;
        let snapshot = PausedSnapshot {
            state: dir.join(format!("pause-{generation}.state")),
            mem: dir.join(format!("pause-{generation}.mem")),
        };
        // Pausing the devices flushes the root layer (see the VMM's block
        // device), so disk and memory agree.
        if let Err(e) = live
            .vm
            .snapshot(SnapshotType::Diff, &snapshot.state, &snapshot.mem)
            .await
        {
            let _ = live.vm.api().resume().await;
            self.live().insert(id.to_owned(), live);
            return Err(e.into());
        }
        // The VMM stays (paused) until the record says paused: a pause that
        // cannot be committed resumes the sandbox instead of stranding it.
        let files = vec![
            snapshot.state.clone(),
            snapshot.mem.clone(),
            self.root_layer(&record),
            dir.clone(),
        ];
        let committed = match sync_files(files).await {
            Ok(()) => self
                .store
                .update_sandbox(id, |s| {
                    s.state = SandboxState::Paused;
                    s.pause_generation = generation;
                    s.snapshot = Some(snapshot);
                    s.vmm_dir = None;
                })
                .map_err(SandboxError::from),
            Err(e) => Err(e),
        };
        match committed {
            Ok(Some(paused)) => {
                drop(live);
                Ok(paused)
            }
            Ok(None) => Err(SandboxError::NotFound(id.to_owned())),
            Err(e) => {
                tracing::warn!("sandbox {id}: pause not committed ({e}); resuming it");
                let _ = live.vm.api().resume().await;
                self.live().insert(id.to_owned(), live);
                Err(e)
            }
        }
    }

    /// Resumes a paused sandbox for `timeout`; returns it and whether it was
    /// paused. A running sandbox only has its timeout extended (never shortened).
    pub async fn resume(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<(SandboxRecord, bool), SandboxError> {
        let end = now_ms() + timeout.as_millis() as u64;
        if self.get(id)?.state == SandboxState::Running {
            return Ok((self.extend_to(id, end)?, false));
        }
        let _busy = self.activity.read().await;
        let _claim = self.claim(id)?;
        // Read again under the claim: a resume that ran meanwhile has restored
        // it, and a second restore would run two VMMs on one root layer.
        let record = self.get(id)?;
        if record.state == SandboxState::Running {
            return Ok((self.extend_to(id, end)?, false));
        }
        let Some(snapshot) = record.snapshot.clone() else {
            return Err(SandboxError::NotFound(id.to_owned()));
        };
        let mut slot = self.capacity.reserve(
            Ask::sandbox(u64::from(record.cpu_count), record.memory_mb),
            &format!("resuming sandbox {id}"),
        )?;
        let restored = self
            .restore(
                &snapshot.state,
                &snapshot.mem,
                &self.root_layer(&record),
                Some((&AgentInit::after_restore()?, record.access_token.as_deref())),
            )
            .await;
        let vm = restored?;
        let r = self
            .store
            .update_sandbox(id, |s| {
                s.state = SandboxState::Running;
                s.end_at_ms = end;
                s.vmm_dir = Some(vm.dir().to_owned());
            })?
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
        slot.settle_disk();
        self.live().insert(id.to_owned(), Live { vm, _slot: slot });
        Ok((r, true))
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

    /// Stops the sandbox's VMM and removes its files and record.
    pub async fn kill(&self, id: &str) -> Result<(), SandboxError> {
        // The collector must not see the record and then miss its files.
        let _busy = self.activity.read().await;
        let live = self.live().remove(id);
        let record = self.store.sandbox(id)?;
        let existed = self.store.remove_sandbox(id)?;
        if live.is_none() && !existed {
            return Err(SandboxError::NotFound(id.to_owned()));
        }
        // Dropping the process kills it; then its files can go, unless forks
        // still read them.
        drop(live);
        self.forget_observed(id);
        if record.is_some_and(|r| r.has_dependents) {
            return Ok(());
        }
        let dir = self.sandbox_dir(id);
        tokio::task::spawn_blocking(move || {
            if let Err(e) = std::fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!("removing {}: {e}", dir.display());
            }
        })
        .await?;
        Ok(())
    }

    /// Sets the sandbox to end `timeout` from now (shorter or longer).
    pub fn set_timeout(&self, id: &str, timeout: Duration) -> Result<SandboxRecord, SandboxError> {
        let end = now_ms() + timeout.as_millis() as u64;
        self.store
            .update_sandbox(id, |s| s.end_at_ms = end)?
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))
    }

    /// Keeps a running sandbox alive at least `timeout` from now; a paused
    /// one is a conflict (it has no clock running).
    pub fn extend_timeout(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<SandboxRecord, SandboxError> {
        if self.get(id)?.state != SandboxState::Running {
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

    /// Running sandboxes with an access token: (id, token), for the proxy's
    /// fallbacks when a request names no sandbox.
    pub fn running_tokens(&self) -> Vec<(String, String)> {
        let live: HashSet<String> = self.live().keys().cloned().collect();
        self.store
            .sandboxes()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| live.contains(&r.id))
            .filter_map(|r| Some((r.id, r.access_token?)))
            .collect()
    }

    /// The vsock socket of a running sandbox, for the envd proxy.
    pub fn vsock_path(&self, id: &str) -> Option<PathBuf> {
        self.live().get(id).map(|l| l.vm.vsock_path())
    }
}

/// A sandbox marked as changing state; unmarked on drop.
struct Claim<'a> {
    manager: &'a Manager,
    id: String,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.manager
            .changing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}
