//! Node capacity: how many vCPUs, how much memory and disk sandboxes may use,
//! and the reservations running sandboxes hold against it.
//!
//! - **vCPUs**: host CPUs (or `vcpus`) × `vcpu_overcommit`. Idle sandboxes
//!   use next to no CPU, so the default ratio is generous.
//! - **Memory**: by real use ([`memory`]). The node's ceiling is the host's
//!   `MemTotal` minus a reserve for the host (or `memory_mib`). Each running
//!   sandbox is charged what its VMM process really uses (Pss, sampled every
//!   [`memory::SAMPLE_EVERY`]) plus `memory_headroom_mib` for growth, at
//!   most its `memoryMB` beyond what the VMM itself uses; a create, resume
//!   or fork child under way is charged the headroom until its first
//!   sample. Restored sandboxes and fork children share the template's or
//!   the parent's pages copy-on-write, so a fork of N children asks for N
//!   headrooms, not N guests. A guest never uses more than its `memoryMB`
//!   (the VMM gives it no more).
//! - **Disk**: not reserved (a sandbox's disk use is not known in advance)
//!   but checked: an operation that starts or snapshots sandboxes needs room
//!   for one memory snapshot per sandbox (its memory size: what a pause or a
//!   snapshot writes at most) beyond `min_free_disk_mib`, counting what the
//!   operations under way asked for too.
//!
//! Each running sandbox, and each create, resume or fork child under way,
//! holds a [`Reservation`] of its vCPUs and memory (and one of the node's
//! `max_sandboxes` slots): taken before the slow restore, given back when it
//! drops (failure, kill, pause). Paused sandboxes hold nothing.
//!
//! A reservation made for a team ([`Capacity::reserve_for`]) also counts
//! against that team's limits ([`TeamLimits`]: running sandboxes and their
//! `memoryMB`, as asked, not as used), checked under the same lock.

pub mod memory;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::Serialize;

pub use memory::DEFAULT_MEMORY_HEADROOM_MIB;

/// Memory kept for the host when no reserve is configured: the larger of
/// this and [`DEFAULT_RESERVE_PERCENT`] of `MemTotal`.
pub const DEFAULT_RESERVE_MEMORY_MIB: u64 = 1024;
pub const DEFAULT_RESERVE_PERCENT: u64 = 10;
/// Idle sandboxes use next to no CPU, and a one-CPU lab must fit a fork of
/// 100 one-vCPU children (plus their parent and others).
pub const DEFAULT_VCPU_OVERCOMMIT: f64 = 128.0;
pub const DEFAULT_MIN_FREE_DISK_MIB: u64 = 1024;
/// The data dir's filesystem use (percent, as `df` counts it) above which
/// no image is converted and unused image templates are evicted, and the
/// one they are evicted down to (kubelet's image collection thresholds).
pub const DEFAULT_IMAGE_DISK_HIGH_PERCENT: f64 = 85.0;
pub const DEFAULT_IMAGE_DISK_LOW_PERCENT: f64 = 80.0;

/// Where the data dir's filesystem use bounds image templates (see
/// `crate::node::template::image_disk`): percentages of it, `low <= high`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageDiskWatermarks {
    /// Above it a new conversion is refused (once the unused image
    /// templates are evicted and it is still above) and unused image
    /// templates are evicted.
    pub high_percent: f64,
    /// What eviction goes down to.
    pub low_percent: f64,
}

impl Default for ImageDiskWatermarks {
    fn default() -> ImageDiskWatermarks {
        ImageDiskWatermarks {
            high_percent: DEFAULT_IMAGE_DISK_HIGH_PERCENT,
            low_percent: DEFAULT_IMAGE_DISK_LOW_PERCENT,
        }
    }
}

/// How the node's capacity is set (the `serve` flags).
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityConfig {
    /// The node's memory ceiling for sandboxes in MiB, instead of the
    /// host's `MemTotal` minus the reserve.
    pub memory_mib: Option<u64>,
    /// Memory kept for the host (default: the larger of 1 GiB and 10 %).
    pub reserve_memory_mib: Option<u64>,
    /// Memory charged per sandbox beyond what it uses, for its growth until
    /// the next sample (and all a starting one is charged).
    pub memory_headroom_mib: u64,
    /// vCPUs before overcommit, instead of the host's CPUs.
    pub vcpus: Option<u64>,
    pub vcpu_overcommit: f64,
    /// Disk space on the data directory's filesystem no sandbox may use.
    pub min_free_disk_mib: u64,
    /// The bounds of that filesystem's use that image templates are
    /// collected under.
    pub image_disk: ImageDiskWatermarks,
}

impl Default for CapacityConfig {
    fn default() -> CapacityConfig {
        CapacityConfig {
            memory_mib: None,
            reserve_memory_mib: None,
            memory_headroom_mib: DEFAULT_MEMORY_HEADROOM_MIB,
            vcpus: None,
            vcpu_overcommit: DEFAULT_VCPU_OVERCOMMIT,
            min_free_disk_mib: DEFAULT_MIN_FREE_DISK_MIB,
            image_disk: ImageDiskWatermarks::default(),
        }
    }
}

/// What the node lets sandboxes use, computed once at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    pub vcpus: u64,
    /// The ceiling of what sandboxes are charged (see [`memory`]).
    pub memory_mib: u64,
    pub memory_headroom_mib: u64,
    pub sandboxes: usize,
    pub min_free_disk_mib: u64,
}

impl Limits {
    /// From the host (`/proc/meminfo`, the CPUs this process may run on)
    /// and the overrides in `config`.
    pub fn detect(config: &CapacityConfig, max_sandboxes: usize) -> Limits {
        let memory = config
            .memory_mib
            .unwrap_or_else(|| match host_memory_mib() {
                Ok(total) => {
                    let reserve = config.reserve_memory_mib.unwrap_or_else(|| {
                        DEFAULT_RESERVE_MEMORY_MIB.max(total * DEFAULT_RESERVE_PERCENT / 100)
                    });
                    total.saturating_sub(reserve)
                }
                Err(e) => {
                    // Without it nothing can be promised; refuse nothing either.
                    tracing::warn!("reading /proc/meminfo: {e}; memory is not limited");
                    u64::MAX
                }
            });
        let cpus = config
            .vcpus
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64));
        Limits {
            vcpus: scale(cpus, config.vcpu_overcommit),
            memory_mib: memory,
            memory_headroom_mib: config.memory_headroom_mib,
            sandboxes: max_sandboxes,
            min_free_disk_mib: config.min_free_disk_mib,
        }
    }

    /// The memory `ask` is charged before its first sample.
    fn memory_charge(&self, ask: &Ask) -> u64 {
        memory::charge(
            ask.memory_mib,
            ask.sandboxes as u64,
            None,
            self.memory_headroom_mib,
        )
    }
}

/// `value × ratio`, rounded down; a ratio that is not a positive number is 1.
fn scale(value: u64, ratio: f64) -> u64 {
    if value == u64::MAX {
        return value;
    }
    let ratio = if ratio.is_finite() && ratio > 0.0 {
        ratio
    } else {
        tracing::warn!("overcommit ratio {ratio} is not a positive number; using 1");
        1.0
    };
    // `as` saturates: a huge product is u64::MAX, not a wrap.
    (value as f64 * ratio).floor() as u64
}

/// The host's `MemTotal` in MiB.
pub fn host_memory_mib() -> std::io::Result<u64> {
    host_mem::mem_total_mib()
}

/// Descriptors the server is expected to hold per running sandbox (its VMM's
/// API socket and pipes, the agent's vsock connections, proxied clients):
/// only to warn when the open-files limit would run out before
/// `max_sandboxes` do.
pub const FDS_PER_SANDBOX: u64 = 16;

/// Raises this process's soft limit of open files to its hard limit (the
/// soft default, often 1024, is a few dozen sandboxes' worth). Returns the
/// new soft limit (`None`: unlimited).
pub fn raise_open_files_limit() -> std::io::Result<Option<u64>> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        setrlimit(Resource::Nofile, limit).map_err(std::io::Error::from)?;
    }
    Ok(getrlimit(Resource::Nofile).current)
}

/// The data directory's filesystem, in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DiskSpace {
    pub total_mib: u64,
    /// Available to unprivileged users (`f_bavail`).
    pub available_mib: u64,
    /// In use (`f_blocks - f_bfree`).
    pub used_mib: u64,
}

impl DiskSpace {
    pub fn of(path: &std::path::Path) -> std::io::Result<DiskSpace> {
        let st = rustix::fs::statvfs(path).map_err(std::io::Error::from)?;
        let mib = |blocks: u64| blocks.saturating_mul(st.f_frsize) / (1024 * 1024);
        Ok(DiskSpace {
            total_mib: mib(st.f_blocks),
            available_mib: mib(st.f_bavail),
            used_mib: mib(st.f_blocks.saturating_sub(st.f_bfree)),
        })
    }

    /// The percentage in use as `df` counts it: of what is used and what
    /// users may still use (blocks reserved for root are neither).
    pub fn used_percent(&self) -> f64 {
        used_percent(self.used_mib, self.available_mib)
    }
}

/// `used` of `used + available`, in percent (0 for an empty filesystem).
pub fn used_percent(used: u64, available: u64) -> f64 {
    let all = used.saturating_add(available);
    if all == 0 {
        0.0
    } else {
        used as f64 * 100.0 / all as f64
    }
}

/// An amount of each resource: asked for, held, or in use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ask {
    /// Slots counted against `max_sandboxes`.
    pub sandboxes: usize,
    pub vcpus: u64,
    /// Asked for: the guests' memory size (what they may touch at most).
    /// Held ([`Capacity::held`]): the memory they are charged (see [`memory`]).
    pub memory_mib: u64,
    /// Disk the operation needs free while it runs (not held after).
    pub disk_mib: u64,
}

impl Ask {
    /// One sandbox of `vcpus` and `memory_mib`, with room for its memory snapshot.
    pub fn sandbox(vcpus: u64, memory_mib: u64) -> Ask {
        Ask {
            sandboxes: 1,
            vcpus,
            memory_mib,
            disk_mib: memory_mib,
        }
    }

    /// `n` of these.
    pub fn times(self, n: u64) -> Ask {
        Ask {
            sandboxes: self.sandboxes.saturating_mul(n as usize),
            vcpus: self.vcpus.saturating_mul(n),
            memory_mib: self.memory_mib.saturating_mul(n),
            disk_mib: self.disk_mib.saturating_mul(n),
        }
    }

    fn add(&mut self, o: Ask) {
        self.sandboxes = self.sandboxes.saturating_add(o.sandboxes);
        self.vcpus = self.vcpus.saturating_add(o.vcpus);
        self.memory_mib = self.memory_mib.saturating_add(o.memory_mib);
        self.disk_mib = self.disk_mib.saturating_add(o.disk_mib);
    }

    fn sub(&mut self, o: Ask) {
        self.sandboxes = self.sandboxes.saturating_sub(o.sandboxes);
        self.vcpus = self.vcpus.saturating_sub(o.vcpus);
        self.memory_mib = self.memory_mib.saturating_sub(o.memory_mib);
        self.disk_mib = self.disk_mib.saturating_sub(o.disk_mib);
    }

    /// Each resource of `self`, at most `o`'s.
    fn min(self, o: Ask) -> Ask {
        Ask {
            sandboxes: self.sandboxes.min(o.sandboxes),
            vcpus: self.vcpus.min(o.vcpus),
            memory_mib: self.memory_mib.min(o.memory_mib),
            disk_mib: self.disk_mib.min(o.disk_mib),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Vcpus,
    Memory,
    Disk,
}

impl Resource {
    fn unit(self) -> &'static str {
        match self {
            Resource::Vcpus => "vCPUs",
            Resource::Memory | Resource::Disk => "MiB",
        }
    }
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Resource::Vcpus => "vCPUs",
            Resource::Memory => "memory",
            Resource::Disk => "disk space",
        })
    }
}

/// Not enough of one resource for an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shortage {
    pub resource: Resource,
    /// What is asked for: "a sandbox", "a fork of 4 children", ...
    pub what: String,
    pub asked: u64,
    pub free: u64,
    pub total: u64,
}

impl std::fmt::Display for Shortage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Shortage {
            resource,
            what,
            asked,
            free,
            total,
        } = self;
        let unit = resource.unit();
        write!(
            f,
            "node over capacity: not enough {resource} for {what}: it needs {asked} {unit}"
        )?;
        if *resource == Resource::Disk {
            write!(
                f,
                " free (room for its memory snapshots), {free} {unit} are free \
                 of {total} {unit} beyond what the node keeps free"
            )
        } else {
            write!(
                f,
                ", {free} {unit} of the node's {total} {unit} are free; \
                 kill or pause sandboxes to make room"
            )
        }
    }
}

impl std::error::Error for Shortage {}

/// A team's share of the node (see [`crate::node::tenants`]): how many sandboxes
/// it may run at once and how much memory (the sum of their `memoryMB`) they
/// may have; None: no limit beyond the node's. Stored as the admin API
/// names them, so the wire owns the shape.
pub use crate::wire::TeamLimits;

#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    /// The team's count limit (E2B's concurrency limit: 429).
    #[error(
        "you have reached the maximum number of concurrent sandboxes ({max}) of your team: \
         {running} are running or starting, {asked} more asked for"
    )]
    TeamSandboxes {
        running: usize,
        asked: usize,
        max: u64,
    },
    /// The team's memory limit (429 too: the team's, not the node's).
    #[error(
        "you have reached the memory limit of your team ({max} MiB): its running sandboxes \
         have {held} MiB, {asked} MiB more asked for"
    )]
    TeamMemory { held: u64, asked: u64, max: u64 },
    /// The node's count limit (`max_sandboxes`).
    #[error(
        "this node runs at most {max} sandboxes: {running} are running or starting, \
         {asked} more asked for"
    )]
    TooMany {
        running: usize,
        asked: usize,
        max: usize,
    },
    #[error(transparent)]
    Short(#[from] Shortage),
    #[error("reading the free space of {path}: {source}")]
    Disk {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl CapacityError {
    /// The refusal this is, as the metrics name it (None: no refusal, the
    /// disk could not be read).
    pub fn refusal(&self) -> Option<crate::node::metrics::Refusal> {
        use crate::node::metrics::Refusal;
        Some(match self {
            CapacityError::TeamSandboxes { .. } => Refusal::TeamSandboxes,
            CapacityError::TeamMemory { .. } => Refusal::TeamMemory,
            CapacityError::TooMany { .. } => Refusal::NodeSandboxes,
            CapacityError::Short(s) => match s.resource {
                Resource::Vcpus => Refusal::Vcpus,
                Resource::Memory => Refusal::Memory,
                Resource::Disk => Refusal::Disk,
            },
            CapacityError::Disk { .. } => return None,
        })
    }
}

/// One reservation's share: what it asked for, and what its VMM was last
/// seen using once one runs for it.
#[derive(Debug, Clone)]
struct Entry {
    ask: Ask,
    pid: Option<u32>,
    used_kib: Option<u64>,
    /// The team it counts against, if any.
    team: Option<Arc<str>>,
}

impl Entry {
    fn memory_charge(&self, headroom_mib: u64) -> u64 {
        memory::charge(
            self.ask.memory_mib,
            self.ask.sandboxes as u64,
            self.used_kib.map(host_mem::kib_to_mib),
            headroom_mib,
        )
    }
}

#[derive(Debug, Default)]
struct Held {
    entries: HashMap<u64, Entry>,
    next_id: u64,
}

impl Held {
    fn insert(&mut self, ask: Ask, team: Option<Arc<str>>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(
            id,
            Entry {
                ask,
                pid: None,
                used_kib: None,
                team,
            },
        );
        id
    }

    /// What `team`'s entries asked for (memory: the guests' size).
    fn of_team(&self, team: &str) -> Ask {
        let mut total = Ask::default();
        for e in self.entries.values() {
            if e.team.as_deref() == Some(team) {
                total.add(e.ask);
            }
        }
        total
    }

    /// The sum of every entry, memory as charged.
    fn total(&self, headroom_mib: u64) -> Ask {
        let mut total = Ask::default();
        for e in self.entries.values() {
            total.add(Ask {
                memory_mib: e.memory_charge(headroom_mib),
                ..e.ask
            });
        }
        total
    }
}

/// The node's limits and what reservations hold of them.
#[derive(Debug)]
pub struct Capacity {
    limits: Limits,
    /// Its filesystem is where snapshots and disk layers go.
    data_dir: PathBuf,
    held: Mutex<Held>,
    /// Teams' limits (a team not here has none).
    teams: Mutex<HashMap<String, TeamLimits>>,
    /// Where refusals are counted, once the node's metrics exist.
    metrics: std::sync::OnceLock<Arc<crate::node::metrics::Metrics>>,
}

impl Capacity {
    /// The node's capacity; nothing samples its memory use until
    /// [`Capacity::start_sampler`] (the tests call [`Capacity::sample`]).
    pub fn new(limits: Limits, data_dir: PathBuf) -> Arc<Capacity> {
        Arc::new(Capacity {
            limits,
            data_dir,
            held: Mutex::new(Held::default()),
            teams: Mutex::default(),
            metrics: std::sync::OnceLock::new(),
        })
    }

    /// The node's capacity as `config` and the host allow (logged), its
    /// memory use sampled.
    pub fn for_config(config: &crate::node::config::Config) -> Arc<Capacity> {
        let limits = Limits::detect(&config.capacity, config.max_sandboxes);
        tracing::info!(
            "capacity: {} vCPUs, {} MiB of memory (each sandbox charged what it uses plus \
             {} MiB), {} sandboxes, {} MiB of disk kept free",
            limits.vcpus,
            limits.memory_mib,
            limits.memory_headroom_mib,
            limits.sandboxes,
            limits.min_free_disk_mib
        );
        let capacity = Capacity::new(limits, config.data_dir.clone());
        capacity.start_sampler(memory::SAMPLE_EVERY);
        capacity
    }

    /// Samples the VMMs' memory every `every`, on a thread of its own (the
    /// reads are blocking), until the capacity is dropped.
    pub fn start_sampler(self: &Arc<Self>, every: std::time::Duration) {
        let weak: Weak<Capacity> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("memory-sampler".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(every);
                    match weak.upgrade() {
                        Some(capacity) => capacity.sample(),
                        None => return,
                    }
                }
            });
        if let Err(e) = spawned {
            // Admission still works, on headrooms alone (never too generous
            // for long: nothing sampled is charged at least the headroom).
            tracing::warn!("starting the memory sampler: {e}; sandboxes' memory is not sampled");
        }
    }

    /// Reads the memory every tracked VMM uses now. A VMM that cannot be
    /// read (it just exited) keeps its last figure.
    pub fn sample(&self) {
        self.sample_with(memory::pss_kib);
    }

    /// [`Capacity::sample`] with `read` giving a process's use in KiB.
    fn sample_with(&self, read: impl Fn(u32) -> std::io::Result<u64>) {
        let pids: Vec<(u64, u32)> = self
            .held_lock()
            .entries
            .iter()
            .filter_map(|(id, e)| Some((*id, e.pid?)))
            .collect();
        // Read outside the lock: a smaps walk of a large VMM takes a while.
        let read: Vec<(u64, u64)> = pids
            .into_iter()
            .filter_map(|(id, pid)| match read(pid) {
                Ok(kib) => Some((id, kib)),
                Err(e) => {
                    tracing::debug!("reading the memory of VMM {pid}: {e}");
                    None
                }
            })
            .collect();
        let mut held = self.held_lock();
        for (id, kib) in read {
            if let Some(e) = held.entries.get_mut(&id) {
                e.used_kib = Some(kib);
            }
        }
    }

    fn held_lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// What all reservations hold now: memory as charged (real use plus
    /// headroom), `disk_mib` asked by operations under way.
    pub fn held(&self) -> Ask {
        self.held_lock().total(self.limits.memory_headroom_mib)
    }

    pub fn disk(&self) -> Result<DiskSpace, CapacityError> {
        DiskSpace::of(&self.data_dir).map_err(|source| CapacityError::Disk {
            path: self.data_dir.clone(),
            source,
        })
    }

    /// Sets `team`'s limits (for reservations from now on).
    pub fn set_team_limits(&self, team: &str, limits: TeamLimits) {
        let mut teams = self.teams.lock().unwrap_or_else(|p| p.into_inner());
        teams.insert(team.to_owned(), limits);
    }

    /// What `team`'s reservations hold: sandboxes and their memory as asked.
    pub fn team_held(&self, team: &str) -> Ask {
        self.held_lock().of_team(team)
    }

    /// From now on each refused reservation is counted in `metrics` (set
    /// once, by the manager that owns them).
    pub fn count_refusals_in(&self, metrics: Arc<crate::node::metrics::Metrics>) {
        let _ = self.metrics.set(metrics);
    }

    /// The proportional set size of every VMM as last sampled, summed.
    pub fn pss_kib(&self) -> u64 {
        self.held_lock()
            .entries
            .values()
            .filter_map(|e| e.used_kib)
            .sum()
    }

    /// Reserves `ask` for `what` (named in the error), all or nothing.
    pub fn reserve(self: &Arc<Self>, ask: Ask, what: &str) -> Result<Reservation, CapacityError> {
        self.reserve_for(ask, what, None)
    }

    /// [`Capacity::reserve`], counted against `team`'s limits too.
    pub fn reserve_for(
        self: &Arc<Self>,
        ask: Ask,
        what: &str,
        team: Option<&str>,
    ) -> Result<Reservation, CapacityError> {
        let team_limits = team.and_then(|t| {
            let teams = self.teams.lock().unwrap_or_else(|p| p.into_inner());
            teams.get(t).copied()
        });
        // Read outside the lock: it is a syscall, on a network filesystem in the lab.
        let disk = if ask.disk_mib > 0 {
            Some(self.disk()?)
        } else {
            None
        };
        let mut held = self.held_lock();
        check(
            &self.limits,
            &held.total(self.limits.memory_headroom_mib),
            &ask,
            disk,
            what,
        )
        .and_then(|()| match (team, team_limits) {
            (Some(team), Some(limits)) => check_team(&limits, &held.of_team(team), &ask),
            _ => Ok(()),
        })
        .inspect_err(|e| {
            if let (Some(metrics), Some(why)) = (self.metrics.get(), e.refusal()) {
                metrics.refused(why);
            }
        })?;
        let id = held.insert(ask, team.map(Arc::from));
        Ok(Reservation {
            capacity: self.clone(),
            id,
        })
    }

    /// Holds `ask` without checking the limits: for sandboxes that already
    /// run (adopted after a restart), which must be counted even when the
    /// node's limits shrank. No disk room is held (nothing is being written).
    pub fn hold(self: &Arc<Self>, ask: Ask) -> Reservation {
        self.hold_for(ask, None)
    }

    /// [`Capacity::hold`], counted as `team`'s (never refused).
    pub fn hold_for(self: &Arc<Self>, ask: Ask, team: Option<&str>) -> Reservation {
        let ask = Ask { disk_mib: 0, ..ask };
        let id = self.held_lock().insert(ask, team.map(Arc::from));
        Reservation {
            capacity: self.clone(),
            id,
        }
    }
}

/// Whether `ask` fits in a team's `limits` beside what it `held`.
fn check_team(limits: &TeamLimits, held: &Ask, ask: &Ask) -> Result<(), CapacityError> {
    if let Some(max) = limits.max_sandboxes
        && (held.sandboxes.saturating_add(ask.sandboxes)) as u64 > max
    {
        return Err(CapacityError::TeamSandboxes {
            running: held.sandboxes,
            asked: ask.sandboxes,
            max,
        });
    }
    if let Some(max) = limits.max_memory_mb
        && held.memory_mib.saturating_add(ask.memory_mib) > max
    {
        return Err(CapacityError::TeamMemory {
            held: held.memory_mib,
            asked: ask.memory_mib,
            max,
        });
    }
    Ok(())
}

/// Whether `ask` fits beside `held` (memory as charged); the first resource
/// short, else.
fn check(
    limits: &Limits,
    held: &Ask,
    ask: &Ask,
    disk: Option<DiskSpace>,
    what: &str,
) -> Result<(), CapacityError> {
    if held.sandboxes.saturating_add(ask.sandboxes) > limits.sandboxes {
        return Err(CapacityError::TooMany {
            running: held.sandboxes,
            asked: ask.sandboxes,
            max: limits.sandboxes,
        });
    }
    let short = |resource, asked: u64, held: u64, total: u64| {
        let free = total.saturating_sub(held);
        (asked > free).then(|| Shortage {
            resource,
            what: what.to_owned(),
            asked,
            free,
            total,
        })
    };
    let shortage = short(Resource::Vcpus, ask.vcpus, held.vcpus, limits.vcpus)
        .or_else(|| {
            short(
                Resource::Memory,
                limits.memory_charge(ask),
                held.memory_mib,
                limits.memory_mib,
            )
        })
        .or_else(|| {
            let disk = disk?;
            let usable = disk.available_mib.saturating_sub(limits.min_free_disk_mib);
            short(Resource::Disk, ask.disk_mib, held.disk_mib, usable).map(|mut s| {
                s.total = disk.total_mib.saturating_sub(limits.min_free_disk_mib);
                s
            })
        });
    match shortage {
        Some(s) => Err(s.into()),
        None => Ok(()),
    }
}

/// Resources held for a sandbox (or an operation); given back on drop.
#[derive(Debug)]
pub struct Reservation {
    capacity: Arc<Capacity>,
    /// Its entry in the capacity's [`Held`].
    id: u64,
}

impl Reservation {
    /// What it asked for (memory: the guests' size).
    pub fn held(&self) -> Ask {
        self.capacity
            .held_lock()
            .entries
            .get(&self.id)
            .map_or_else(Ask::default, |e| e.ask)
    }

    /// Its memory is what VMM process `pid` uses, from the next sample on.
    pub fn track(&self, pid: u32) {
        if let Some(e) = self.capacity.held_lock().entries.get_mut(&self.id) {
            e.pid = Some(pid);
        }
    }

    /// Moves `part` (at most what this holds) into a reservation of its own
    /// (not tracked: the VMM, if any, stays with this one).
    pub fn split(&mut self, part: Ask) -> Reservation {
        let mut held = self.capacity.held_lock();
        let (part, team) = match held.entries.get_mut(&self.id) {
            Some(e) => {
                let part = part.min(e.ask);
                e.ask.sub(part);
                (part, e.team.clone())
            }
            None => (Ask::default(), None),
        };
        let id = held.insert(part, team);
        Reservation {
            capacity: self.capacity.clone(),
            id,
        }
    }

    /// Gives back the disk room asked for: the operation's files are written.
    pub fn settle_disk(&mut self) {
        if let Some(e) = self.capacity.held_lock().entries.get_mut(&self.id) {
            e.ask.disk_mib = 0;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.capacity.held_lock().entries.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Headroom as large as any guest: every sandbox is charged its whole
    /// size, so what these tests count is plain sums.
    fn limits(vcpus: u64, memory_mib: u64, sandboxes: usize) -> Limits {
        Limits {
            vcpus,
            memory_mib,
            memory_headroom_mib: u64::MAX,
            sandboxes,
            min_free_disk_mib: 0,
        }
    }

    fn node(vcpus: u64, memory_mib: u64, sandboxes: usize) -> Arc<Capacity> {
        let dir = std::env::temp_dir();
        Capacity::new(limits(vcpus, memory_mib, sandboxes), dir)
    }

    /// A sandbox that asks for no disk room (the tests of disk give it).
    fn guest(vcpus: u64, memory_mib: u64) -> Ask {
        Ask {
            disk_mib: 0,
            ..Ask::sandbox(vcpus, memory_mib)
        }
    }

    fn shortage(e: CapacityError) -> Shortage {
        match e {
            CapacityError::Short(s) => s,
            other => panic!("not a shortage: {other}"),
        }
    }

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit() {
        use rustix::process::{Resource, getrlimit};
        let hard = getrlimit(Resource::Nofile).maximum;
        assert_eq!(raise_open_files_limit().unwrap(), hard);
        assert_eq!(getrlimit(Resource::Nofile).current, hard);
    }

    #[test]
    fn limits_apply_overrides_and_ratios() {
        let config = CapacityConfig {
            memory_mib: Some(600),
            vcpus: Some(2),
            vcpu_overcommit: 1.5,
            memory_headroom_mib: 8,
            ..CapacityConfig::default()
        };
        let l = Limits::detect(&config, 7);
        assert_eq!(
            (l.vcpus, l.memory_mib, l.memory_headroom_mib, l.sandboxes),
            (3, 600, 8, 7)
        );
        // From the host: MemTotal minus the default reserve.
        let host = host_memory_mib().unwrap();
        let l = Limits::detect(&CapacityConfig::default(), 64);
        let reserve = DEFAULT_RESERVE_MEMORY_MIB.max(host / 10);
        assert_eq!(l.memory_mib, host.saturating_sub(reserve));
        assert_eq!(l.memory_headroom_mib, DEFAULT_MEMORY_HEADROOM_MIB);
        let cpus = std::thread::available_parallelism().unwrap().get() as u64;
        assert_eq!(l.vcpus, cpus * 128);
        let l = Limits::detect(
            &CapacityConfig {
                reserve_memory_mib: Some(0),
                ..CapacityConfig::default()
            },
            64,
        );
        assert_eq!(l.memory_mib, host);
        assert_eq!(scale(10, f64::NAN), 10);
        assert_eq!(scale(10, 0.25), 2);
        assert_eq!(scale(u64::MAX, 2.0), u64::MAX);
    }

    #[test]
    fn reservations_are_given_back_on_drop() {
        let cap = node(4, 600, 10);
        let a = cap.reserve(guest(1, 256), "a sandbox").unwrap();
        let b = cap.reserve(guest(1, 256), "a sandbox").unwrap();
        let e = shortage(cap.reserve(guest(1, 256), "a sandbox").unwrap_err());
        assert_eq!(
            (e.resource, e.asked, e.free, e.total),
            (Resource::Memory, 256, 88, 600)
        );
        assert_eq!(cap.held().memory_mib, 512);
        drop(a);
        assert_eq!(cap.held().memory_mib, 256);
        let c = cap.reserve(guest(1, 256), "a sandbox").unwrap();
        drop((b, c));
        assert_eq!(cap.held(), Ask::default());
    }

    #[test]
    fn the_count_limit_comes_first_and_is_its_own_error() {
        let cap = node(1, 100, 1);
        let _a = cap.reserve(guest(1, 100), "a sandbox").unwrap();
        match cap.reserve(guest(1, 100), "a sandbox").unwrap_err() {
            CapacityError::TooMany {
                running: 1,
                asked: 1,
                max: 1,
            } => {}
            other => panic!("{other}"),
        }
    }

    #[test]
    fn vcpus_are_checked() {
        let cap = node(2, 10_000, 10);
        let _a = cap.reserve(guest(2, 1), "a sandbox").unwrap();
        let e = shortage(cap.reserve(guest(1, 1), "a sandbox").unwrap_err());
        assert_eq!(
            (e.resource, e.asked, e.free, e.total),
            (Resource::Vcpus, 1, 0, 2)
        );
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_limit() {
        let cap = node(1000, 1000, 1000);
        let granted = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..50 {
                        if let Ok(r) = cap.reserve(guest(1, 7), "a sandbox") {
                            assert!(cap.held().memory_mib <= 1000);
                            granted.lock().unwrap().push(r);
                        }
                    }
                });
            }
        });
        let granted = granted.into_inner().unwrap();
        // 1000 / 7: exactly as many as fit, never one more.
        assert_eq!(granted.len(), 142);
        assert_eq!(cap.held().memory_mib, 142 * 7);
        // Released from many threads too.
        std::thread::scope(|s| {
            let mut granted = granted;
            while !granted.is_empty() {
                let chunk: Vec<_> = granted.drain(..granted.len().min(20)).collect();
                s.spawn(move || drop(chunk));
            }
        });
        assert_eq!(cap.held(), Ask::default());
    }

    #[test]
    fn a_fork_is_reserved_whole_and_split_per_child() {
        let cap = node(100, 1000, 100);
        let _parent = cap.reserve(guest(1, 256), "a sandbox").unwrap();
        // 4 × 256 does not fit beside the parent: nothing is taken.
        let e = shortage(
            cap.reserve(guest(1, 256).times(4), "a fork of 4 children")
                .unwrap_err(),
        );
        assert_eq!((e.asked, e.free), (1024, 744));
        assert_eq!(cap.held().memory_mib, 256);
        let mut all = cap
            .reserve(guest(1, 256).times(2), "a fork of 2 children")
            .unwrap();
        let one = all.split(guest(1, 256));
        let two = all.split(guest(1, 256));
        assert_eq!(all.held(), Ask::default());
        drop(all);
        assert_eq!(cap.held().memory_mib, 768);
        // A child that fails gives its share back; the other keeps it.
        drop(one);
        assert_eq!(cap.held().memory_mib, 512);
        assert_eq!(cap.held().sandboxes, 2);
        drop(two);
        // Splitting more than is held takes only what is there.
        let mut r = cap.reserve(guest(1, 10), "a sandbox").unwrap();
        let big = r.split(guest(5, 500));
        assert_eq!(big.held(), guest(1, 10));
    }

    #[test]
    fn disk_needs_room_beyond_the_minimum_and_the_operations_under_way() {
        let l = Limits {
            min_free_disk_mib: 1000,
            ..limits(10, 10_000, 10)
        };
        let disk = Some(DiskSpace {
            total_mib: 10_000,
            available_mib: 1600,
            used_mib: 8400,
        });
        let ask = Ask::sandbox(1, 256);
        check(&l, &Ask::default(), &ask, disk, "a sandbox").unwrap();
        let under_way = Ask {
            disk_mib: 400,
            ..Ask::default()
        };
        let e = shortage(check(&l, &under_way, &ask, disk, "a sandbox").unwrap_err());
        assert_eq!(
            (e.resource, e.asked, e.free, e.total),
            (Resource::Disk, 256, 200, 9000)
        );
        // No disk asked for: no disk read, no disk check.
        check(&l, &under_way, &guest(1, 256), None, "a sandbox").unwrap();
    }

    #[test]
    fn disk_room_is_held_only_while_the_operation_runs() {
        let cap = node(10, 10_000, 10);
        let mut r = cap.reserve(Ask::sandbox(1, 256), "a sandbox").unwrap();
        assert_eq!(cap.held().disk_mib, 256);
        r.settle_disk();
        assert_eq!(cap.held().disk_mib, 0);
        assert_eq!(cap.held().memory_mib, 256);
        // The real filesystem answers.
        let d = cap.disk().unwrap();
        assert!(d.total_mib > 0 && d.available_mib <= d.total_mib);
    }

    #[test]
    fn messages_say_what_how_much_and_what_is_free() {
        let cap = node(16, 600, 10);
        let _a = cap.reserve(guest(1, 512), "a sandbox").unwrap();
        let e = cap
            .reserve(guest(1, 256).times(2), "a fork of 2 children")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "node over capacity: not enough memory for a fork of 2 children: it needs 512 MiB, \
             88 MiB of the node's 600 MiB are free; kill or pause sandboxes to make room"
        );
        let disk = Shortage {
            resource: Resource::Disk,
            what: "a sandbox".into(),
            asked: 256,
            free: 10,
            total: 9000,
        }
        .to_string();
        assert!(
            disk.contains("not enough disk space for a sandbox: it needs 256 MiB free"),
            "{disk}"
        );
        assert!(disk.contains("10 MiB are free of 9000 MiB"), "{disk}");
    }

    #[test]
    fn hold_counts_without_checking() {
        let cap = node(1, 100, 1);
        let a = cap.hold(Ask::sandbox(4, 400));
        assert_eq!(cap.held().vcpus, 4);
        assert_eq!(cap.held().disk_mib, 0);
        assert!(cap.reserve(guest(1, 1), "a sandbox").is_err());
        drop(a);
        cap.reserve(guest(1, 1), "a sandbox").unwrap();
    }

    /// A node charging real use plus `headroom` MiB per sandbox.
    fn measured_node(memory_mib: u64, headroom: u64) -> Arc<Capacity> {
        let l = Limits {
            memory_headroom_mib: headroom,
            ..limits(1000, memory_mib, 1000)
        };
        Capacity::new(l, std::env::temp_dir())
    }

    /// Samples as if VMM `pid` used `mib[pid]` MiB (absent: unreadable).
    fn sample_fake(cap: &Capacity, mib: &[(u32, u64)]) {
        cap.sample_with(|pid| {
            mib.iter()
                .find(|(p, _)| *p == pid)
                .map(|(_, m)| m * 1024)
                .ok_or_else(|| std::io::Error::other("gone"))
        });
    }

    #[test]
    fn memory_is_charged_by_real_use_plus_headroom() {
        let cap = measured_node(1000, 32);
        let a = cap.reserve(guest(1, 256), "a sandbox").unwrap();
        // Starting: the headroom alone.
        assert_eq!(cap.held().memory_mib, 32);
        a.track(10);
        assert_eq!(cap.held().memory_mib, 32, "nothing sampled yet");
        sample_fake(&cap, &[(10, 6)]);
        assert_eq!(cap.held().memory_mib, 38);
        // It grows: use plus headroom, at most its size; beyond its size
        // only what the VMM really uses.
        sample_fake(&cap, &[(10, 240)]);
        assert_eq!(cap.held().memory_mib, 256);
        sample_fake(&cap, &[(10, 270)]);
        assert_eq!(cap.held().memory_mib, 270);
        // Unreadable (exiting): its last figure stays.
        sample_fake(&cap, &[]);
        assert_eq!(cap.held().memory_mib, 270);
        // What it asked for is unchanged; its share goes with it.
        assert_eq!(a.held(), guest(1, 256));
        drop(a);
        assert_eq!(cap.held(), Ask::default());
    }

    #[test]
    fn many_idle_sandboxes_fit_where_their_sizes_would_not() {
        // 600 MiB holds two 256 MiB guests counted whole; idle ones using
        // 6 MiB each with 10 MiB of headroom: 37 of them.
        let cap = measured_node(600, 10);
        let mut running = Vec::new();
        for pid in 0.. {
            match cap.reserve(guest(1, 256), "a sandbox") {
                Ok(r) => {
                    r.track(pid);
                    running.push(r);
                }
                Err(e) => {
                    let e = shortage(e);
                    assert_eq!((e.resource, e.asked), (Resource::Memory, 10));
                    break;
                }
            }
            let all: Vec<(u32, u64)> = (0..=pid).map(|p| (p, 6)).collect();
            sample_fake(&cap, &all);
        }
        assert_eq!(running.len(), 37);
        assert_eq!(cap.held().memory_mib, 37 * 16);
    }

    #[test]
    fn a_fork_asks_for_a_headroom_per_child() {
        let cap = measured_node(600, 32);
        let parent = cap.reserve(guest(1, 256), "a sandbox").unwrap();
        parent.track(1);
        sample_fake(&cap, &[(1, 100)]);
        assert_eq!(cap.held().memory_mib, 132);
        // 16 children: 16 headrooms, not 16 guests of 256 MiB.
        let e = cap
            .reserve(guest(1, 256).times(16), "a fork of 16 children")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "node over capacity: not enough memory for a fork of 16 children: it needs 512 MiB, \
             468 MiB of the node's 600 MiB are free; kill or pause sandboxes to make room"
        );
        let mut fork = cap
            .reserve(guest(1, 256).times(14), "a fork of 14 children")
            .unwrap();
        assert_eq!(cap.held().memory_mib, 132 + 14 * 32);
        // Each child takes its share; what is not split yet keeps its own.
        let child = fork.split(guest(1, 256));
        child.track(2);
        sample_fake(&cap, &[(1, 60), (2, 40)]);
        assert_eq!(cap.held().memory_mib, 92 + 72 + 13 * 32);
        drop(fork);
        assert_eq!(cap.held().memory_mib, 92 + 72);
        drop((parent, child));
        assert_eq!(cap.held(), Ask::default());
    }

    #[test]
    fn a_template_build_is_charged_its_whole_size() {
        let cap = measured_node(1000, 32);
        let _room = cap
            .reserve(
                Ask {
                    sandboxes: 0,
                    ..guest(1, 512)
                },
                "a template build",
            )
            .unwrap();
        assert_eq!(cap.held().memory_mib, 512);
        let e = shortage(
            cap.reserve(
                Ask {
                    sandboxes: 0,
                    ..guest(1, 512)
                },
                "a template build",
            )
            .unwrap_err(),
        );
        assert_eq!((e.asked, e.free), (512, 488));
    }

    #[test]
    fn the_sampler_reads_real_processes_and_stops_with_the_capacity() {
        let cap = measured_node(100_000, 1);
        let r = cap.reserve(guest(1, 100_000), "a sandbox").unwrap();
        r.track(std::process::id());
        cap.start_sampler(std::time::Duration::from_millis(10));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while cap.held().memory_mib <= 1 {
            assert!(std::time::Instant::now() < deadline, "never sampled");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let own = host_mem::kib_to_mib(memory::pss_kib(std::process::id()).unwrap());
        let charged = cap.held().memory_mib;
        assert!(
            charged > own / 2 && charged < own * 2 + 2,
            "{charged} vs {own}"
        );
        // The sampler holds it only while it samples: the capacity goes.
        let weak = Arc::downgrade(&cap);
        drop((r, cap));
        while weak.upgrade().is_some() {
            assert!(std::time::Instant::now() < deadline, "the sampler keeps it");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn team_limits_count_only_the_teams_reservations_and_splits_keep_the_team() {
        let cap = node(100, 100_000, 100);
        cap.set_team_limits(
            "a",
            TeamLimits {
                max_sandboxes: Some(3),
                max_memory_mb: Some(1000),
            },
        );
        // Another team's and untyped reservations do not count against a.
        let _others = cap
            .reserve_for(guest(1, 256).times(10), "b's", Some("b"))
            .unwrap();
        let _build = cap.reserve(guest(1, 256), "a build").unwrap();
        let mut fork = cap
            .reserve_for(guest(1, 256).times(2), "a fork of 2 children", Some("a"))
            .unwrap();
        let child = fork.split(guest(1, 256));
        drop(fork);
        // The child still counts as a's: one more fits, not two.
        assert_eq!(cap.team_held("a").sandboxes, 1);
        let one = cap
            .reserve_for(guest(1, 256), "a sandbox", Some("a"))
            .unwrap();
        match cap
            .reserve_for(guest(1, 256).times(2), "a fork", Some("a"))
            .unwrap_err()
        {
            CapacityError::TeamSandboxes {
                running,
                asked,
                max,
            } => assert_eq!((running, asked, max), (2, 2, 3)),
            other => panic!("{other}"),
        }
        // Memory: 512 held, 600 more is over 1000.
        match cap
            .reserve_for(guest(1, 600), "a sandbox", Some("a"))
            .unwrap_err()
        {
            CapacityError::TeamMemory { held, asked, max } => {
                assert_eq!((held, asked, max), (512, 600, 1000))
            }
            other => panic!("{other}"),
        }
        // Nothing was held by the refusals; what goes gives room back.
        assert_eq!(cap.team_held("a").memory_mib, 512);
        drop((one, child));
        assert_eq!(cap.team_held("a"), Ask::default());
        let _again = cap
            .reserve_for(guest(1, 256).times(3), "3", Some("a"))
            .unwrap();
        // Held whatever the limits (adopted after a restart), and counted.
        let _adopted = cap.hold_for(guest(1, 256), Some("a"));
        assert_eq!(cap.team_held("a").sandboxes, 4);
    }
}
