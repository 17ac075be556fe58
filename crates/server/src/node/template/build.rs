//! Template builds (`POST /templates`): a root filesystem from Debian
//! packages or a local OCI image (`template-build`, blocking, so on the
//! blocking pool), booted into a template with its start and ready commands
//! ([`super::boot`]); or a running sandbox snapshotted after its start and
//! ready commands ran in it.
//!
//! A build from an image holds its VM's vCPUs and memory (and disk room for
//! its memory snapshot) in the node's capacity from the request until the
//! template is snapshotted: a build that does not fit is refused with 503
//! like a sandbox, and one accepted is not starved by creates while its root
//! filesystem is made. It is not a sandbox: it takes none of `max_sandboxes`.
//!
//! A build is recorded (`building`) before it starts; the template's record
//! is written with the build's `ready` in one transaction, so a crash
//! leaves no half-registered template. A build a restart interrupted is
//! marked `error` at start and its scratch files removed.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use vmm_driver::agent_client::AgentClient;

use super::boot::{self, BootSpec, Prepare};
use super::code_interpreter;
use super::e2b_build::{BUILD_SANDBOX_KEY, E2bState, Failure, StepsPlan};
use crate::node::capacity::{Ask, Reservation};
use crate::node::clock::now_ms;
use crate::node::events::Event;
use crate::node::ids;
use crate::node::sandbox::{Manager, SandboxError, SnapshotParams};
use crate::node::store::{BuildRecord, BuildStatus, SandboxState, TemplateRecord};

/// Longest template name.
pub const MAX_NAME: usize = 64;
pub const MAX_VCPUS: u8 = 16;
pub const MIN_MEM_MIB: u64 = 128;
pub const MAX_MEM_MIB: u64 = 65536;
/// Lines of a build's log kept (the oldest go first).
const LOG_LINES: usize = 5000;

/// What a template is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildSource {
    DebianPackages(Vec<String>),
    OciLayout(PathBuf),
    DockerArchive(PathBuf),
    /// A running sandbox, snapshotted.
    Sandbox(String),
    /// E2B's build steps, run in a sandbox of a template ([`super::e2b_build`]).
    Steps(StepsPlan),
    /// The code interpreter sandfork ships ([`super::code_interpreter`]).
    CodeInterpreter,
}

impl BuildSource {
    /// The names a template built from this source called `name` gets.
    fn names(&self, name: &str) -> Vec<String> {
        match self {
            BuildSource::CodeInterpreter => code_interpreter::names(name),
            _ => vec![name.to_owned()],
        }
    }

    fn describe(&self) -> String {
        match self {
            BuildSource::DebianPackages(p) => format!("debian packages {}", p.join(" ")),
            BuildSource::OciLayout(p) => format!("oci layout {}", p.display()),
            BuildSource::DockerArchive(p) => format!("docker archive {}", p.display()),
            BuildSource::Sandbox(id) => format!("sandbox {id}"),
            BuildSource::Steps(p) => match &p.pull {
                Some(i) => format!("image {} and {} steps", i.image, p.steps.len()),
                None => format!("template {} and {} steps", p.base, p.steps.len()),
            },
            BuildSource::CodeInterpreter => format!("builtin {}", code_interpreter::NAME),
        }
    }
}

/// What a build asks for (parsed by the API, checked here).
#[derive(Debug, Clone)]
pub struct BuildParams {
    pub name: String,
    pub source: BuildSource,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    pub vcpus: Option<u8>,
    pub mem_mib: Option<u64>,
    /// The waiting E2B build this starts (`POST /v3/templates` recorded it,
    /// with its ids and tags, before the build starts).
    pub e2b: Option<BuildRecord>,
    /// The template and build ids of a build that is not an E2B one, when
    /// already handed out (its owner is recorded before the build is seen).
    pub ids: Option<(String, String)>,
}

/// One template as listed: built, base, snapshot, or a build without a
/// template yet (building, or failed).
#[derive(Debug, Clone)]
pub struct TemplateInfo {
    pub id: String,
    pub build_id: Option<String>,
    pub names: Vec<String>,
    /// `base`, `built` or `snapshot`.
    pub kind: &'static str,
    pub source: Option<String>,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub disk_size_mb: u64,
    pub created_at_ms: u64,
    pub status: BuildStatus,
}

/// A build's log lines, numbered from its first line even after old ones go.
#[derive(Debug, Default)]
pub(super) struct BuildLog {
    inner: Mutex<(usize, VecDeque<String>)>,
}

impl BuildLog {
    pub(super) fn push(&self, line: &str) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.1.len() == LOG_LINES {
            g.1.pop_front();
            g.0 += 1;
        }
        g.1.push_back(line.to_owned());
    }

    /// The kept lines numbered `offset` and later.
    pub(super) fn lines_from(&self, offset: usize) -> Vec<String> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.1.iter()
            .skip(offset.saturating_sub(g.0))
            .cloned()
            .collect()
    }
}

/// Names: lowercase letters, digits, `-`, `_`, `.`, starting with a letter
/// or digit, as E2B's template aliases.
pub fn check_name(name: &str) -> Result<(), SandboxError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(SandboxError::Invalid(format!(
            "template name {name:?} must be 1 to {MAX_NAME} lowercase letters, digits, '-', '_' \
             or '.', starting with a letter or digit"
        )))
    }
}

/// When a create refused for a build under way is told to ask again.
pub const BUILTIN_RETRY_SECS: u32 = 20;

/// A build's record, `building` from now: its template id and E2B's build
/// UUID as given, else new ones; `size` is (vCPUs, MiB).
pub(super) fn new_build(
    ids: Option<(String, String)>,
    name: &str,
    source: String,
    size: (u8, u64),
) -> Result<BuildRecord, SandboxError> {
    let (template_id, build_id) = match ids {
        Some(ids) => ids,
        None => (
            ids::sandbox_id().map_err(|source| SandboxError::Io {
                what: "generating a template id".into(),
                source,
            })?,
            uuid()?,
        ),
    };
    Ok(BuildRecord {
        template_id,
        build_id,
        name: name.to_owned(),
        source,
        vcpus: size.0,
        mem_mib: size.1,
        status: BuildStatus::Building,
        reason: None,
        started_at_ms: now_ms(),
        finished_at_ms: None,
        log: Vec::new(),
        reason_step: None,
        e2b: None,
    })
}

pub fn uuid() -> Result<String, SandboxError> {
    ids::random_uuid().map_err(|source| SandboxError::Io {
        what: "generating a build id".into(),
        source,
    })
}

fn nonempty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.trim().is_empty())
}

/// The node's template builds.
#[derive(Debug)]
pub struct Templates {
    manager: Arc<Manager>,
    /// Builds under way, by template id: their live logs.
    running: Mutex<HashMap<String, Arc<BuildLog>>>,
    /// E2B's waiting builds and uploads.
    e2b: E2bState,
    /// Conversions of images creates named, under way.
    pub(super) images: super::image_create::Flights,
    /// One pass of the image templates' disk bound at a time.
    pub(super) image_disk_pass: tokio::sync::Mutex<()>,
    pub(super) image_disk: super::image_disk::Counters,
    /// Image templates being made, by manifest digest: two references to
    /// one new image boot one template.
    pub(super) image_boots: crate::node::keyed::KeyedLocks,
}

impl Templates {
    pub fn new(manager: Arc<Manager>) -> Arc<Templates> {
        let e2b = E2bState::new(&manager.config().data_dir);
        Arc::new(Templates {
            manager,
            running: Mutex::new(HashMap::new()),
            e2b,
            images: Mutex::default(),
            image_disk_pass: tokio::sync::Mutex::new(()),
            image_disk: Default::default(),
            image_boots: Default::default(),
        })
    }

    /// Template `id` is ready for use: the node's hooks are told (a
    /// cluster stores it in its object store, in the background).
    pub async fn made_ready(&self, id: &str) {
        if let Err(denial) = self.manager.tell(Event::TemplateReady { id }).await {
            tracing::warn!("template {id}: ready, but {denial}");
        }
    }

    /// Templates `ids` were deleted: the node's hooks are told (a cluster
    /// removes them from its object store).
    pub(super) async fn told_deleted(&self, ids: &[String]) {
        if let Err(denial) = self.manager.tell(Event::TemplatesDeleted { ids }).await {
            tracing::warn!("templates {}: deleted, but {denial}", ids.join(", "));
        }
    }

    pub(super) fn manager(&self) -> &Arc<Manager> {
        &self.manager
    }

    pub fn e2b(&self) -> &E2bState {
        &self.e2b
    }

    pub(super) fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<BuildLog>>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After a restart: builds still `building` were interrupted (or had
    /// recorded their template just before): marked accordingly, and the
    /// sandboxes of builds left behind removed (their scratch files are
    /// the collector's: see
    /// [`crate::node::sandbox::Manager::collect_garbage`]).
    pub async fn recover(&self) -> Result<(), SandboxError> {
        let store = self.manager.store();
        // Nothing builds yet: a build's sandbox (adopted, running on for
        // hours otherwise) is no one's.
        for s in store.sandboxes()? {
            if s.metadata.contains_key(BUILD_SANDBOX_KEY) {
                tracing::info!("sandbox {}: a template build's, left by a restart", s.id);
                match self.manager.kill_unannounced(&s.id).await {
                    Ok(()) | Err(SandboxError::NotFound(_)) => {}
                    Err(e) => tracing::warn!("killing build sandbox {}: {e}", s.id),
                }
            }
        }
        let templates_dir = self.manager.config().templates_dir();
        for mut b in store.builds()? {
            if b.status != BuildStatus::Building {
                continue;
            }
            if let Some(mut t) = store.template(&b.template_id)? {
                b.status = BuildStatus::Ready;
                // Its tags may not have moved yet.
                if b.e2b.is_some() {
                    t.names = self.names_of(&b);
                    self.take_names(&t)?;
                    store.put_template(&t)?;
                }
            } else {
                tracing::info!(
                    "template {}: its build was interrupted by a restart",
                    b.template_id
                );
                b.status = BuildStatus::Error;
                b.reason = Some("the build was interrupted by a restart of the node".into());
                let _ = std::fs::remove_dir_all(templates_dir.join(&b.template_id));
            }
            b.finished_at_ms = Some(now_ms());
            store.put_build(&b)?;
        }
        // Scratch directories left behind go with the collector's pass at
        // start: nothing builds yet, so nothing claims them.
        Ok(())
    }

    /// Checks `params`, records the build and starts it in the background.
    pub fn start(self: &Arc<Self>, mut params: BuildParams) -> Result<BuildRecord, SandboxError> {
        check_name(&params.name)?;
        params.start_cmd = nonempty(params.start_cmd.take());
        params.ready_cmd = nonempty(params.ready_cmd.take());
        let config = self.manager.config();
        match &mut params.source {
            BuildSource::DebianPackages(packages) => {
                if packages.is_empty() {
                    return Err(SandboxError::Invalid(
                        "debian_packages must name at least one package".into(),
                    ));
                }
                *packages = template_build::normalize_packages(packages)
                    .map_err(|e| SandboxError::Invalid(e.to_string()))?;
            }
            BuildSource::OciLayout(path) => {
                check_path(path, "oci_layout")?;
                if !path.join("index.json").is_file() {
                    return Err(SandboxError::Invalid(format!(
                        "oci_layout {}: not an OCI image layout (no index.json)",
                        path.display()
                    )));
                }
            }
            BuildSource::DockerArchive(path) => {
                check_path(path, "docker_archive")?;
                if !path.is_file() {
                    return Err(SandboxError::Invalid(format!(
                        "docker_archive {}: not a file",
                        path.display()
                    )));
                }
            }
            BuildSource::Steps(plan) if plan.pull.is_some() => {
                if config.agent.is_none() {
                    return Err(SandboxError::Unavailable(
                        "this node has no guest agent binary to build images with \
                         (SANDFORK_AGENT)"
                            .into(),
                    ));
                }
            }
            BuildSource::Steps(plan) => {
                let base = self.manager.resolve_template(&plan.base)?;
                plan.base = base.id;
            }
            BuildSource::CodeInterpreter => {
                if params.start_cmd.is_some() || params.ready_cmd.is_some() {
                    return Err(SandboxError::Invalid(format!(
                        "the builtin {} template has its own start and ready commands",
                        code_interpreter::NAME
                    )));
                }
                params.start_cmd = Some(code_interpreter::start_cmd());
                params.ready_cmd = Some(code_interpreter::ready_cmd());
                params.mem_mib = Some(
                    params
                        .mem_mib
                        .unwrap_or(config.mem_mib.max(code_interpreter::MIN_MEM_MIB)),
                );
            }
            BuildSource::Sandbox(id) => {
                let s = self.manager.get(id)?;
                if s.state != SandboxState::Running {
                    return Err(SandboxError::Conflict {
                        id: id.clone(),
                        state: s.state.as_str(),
                    });
                }
                if params.vcpus.is_some() || params.mem_mib.is_some() {
                    return Err(SandboxError::Invalid(
                        "a template from a sandbox keeps the sandbox's vCPUs and memory".into(),
                    ));
                }
            }
        }
        if !matches!(
            params.source,
            BuildSource::Sandbox(_) | BuildSource::Steps(_)
        ) && config.agent.is_none()
        {
            return Err(SandboxError::Unavailable(
                "this node has no guest agent binary to build templates with (SANDFORK_AGENT)"
                    .into(),
            ));
        }
        let vcpus = params.vcpus.unwrap_or(config.vcpus);
        if !(1..=MAX_VCPUS).contains(&vcpus) {
            return Err(SandboxError::Invalid(format!(
                "vcpus must be 1 to {MAX_VCPUS}"
            )));
        }
        let mem_mib = params.mem_mib.unwrap_or(config.mem_mib);
        if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&mem_mib) {
            return Err(SandboxError::Invalid(format!(
                "memory_mb must be {MIN_MEM_MIB} to {MAX_MEM_MIB}"
            )));
        }
        let (mem_mib, vcpus) = match &params.source {
            BuildSource::Sandbox(id) => {
                let s = self.manager.get(id)?;
                (s.memory_mb, u8::try_from(s.cpu_count).unwrap_or(vcpus))
            }
            // The base's machine unless the E2B request asked for another
            // (made by booting the base image so: `e2b_build::sized_base`);
            // an image's template gets the node's default one.
            BuildSource::Steps(plan) if plan.pull.is_none() => {
                let t = self.manager.resolve_template(&plan.base)?;
                (
                    params.mem_mib.unwrap_or(t.mem_mib),
                    params.vcpus.unwrap_or(t.vcpus),
                )
            }
            _ => (mem_mib, vcpus),
        };
        // The VM an image build boots; a build from a sandbox boots none (its
        // snapshot reserves its own disk room).
        let room = match &params.source {
            BuildSource::Sandbox(_) | BuildSource::Steps(_) => None,
            _ => Some(self.manager.capacity().reserve(
                Ask {
                    sandboxes: 0,
                    ..Ask::sandbox(u64::from(vcpus), mem_mib)
                },
                "a template build",
            )?),
        };

        let record = {
            // Held across the name check and the record: one name, one build.
            let mut running = self.running();
            let store = self.manager.store();
            let building = store
                .builds()?
                .into_iter()
                .find(|b| b.name == params.name && b.status == BuildStatus::Building);
            if let (Some(b), Some(_)) = (&building, &params.e2b) {
                return Err(super::e2b_build::in_flight(&params.name, b));
            }
            // An E2B build of a name rebuilds it (its tags move when ready).
            let taken = if params.e2b.is_some() {
                None
            } else {
                params
                    .source
                    .names(&params.name)
                    .iter()
                    .find(|n| self.manager.resolve_template(n).is_ok())
                    .cloned()
            };
            if building.is_some() || taken.is_some() {
                return Err(SandboxError::NameTaken(
                    taken.unwrap_or_else(|| params.name.clone()),
                ));
            }
            let record = match params.e2b.clone() {
                Some(waiting) => BuildRecord {
                    source: params.source.describe(),
                    vcpus,
                    mem_mib,
                    status: BuildStatus::Building,
                    started_at_ms: now_ms(),
                    ..waiting
                },
                None => new_build(
                    params.ids.clone(),
                    &params.name,
                    params.source.describe(),
                    (vcpus, mem_mib),
                )?,
            };
            store.put_build(&record)?;
            running.insert(record.template_id.clone(), Arc::default());
            record
        };
        tracing::info!(
            "template {} ({}): building from {}",
            record.template_id,
            record.name,
            record.source
        );
        tokio::spawn(self.clone().run(record.clone(), params, room));
        Ok(record)
    }

    async fn run(
        self: Arc<Self>,
        mut record: BuildRecord,
        params: BuildParams,
        room: Option<Reservation>,
    ) {
        let id = record.template_id.clone();
        // Its files lack a record until the end: the collector keeps off.
        let _writing = self.manager.writing_template(&id);
        let log = self.running().get(&id).cloned().unwrap_or_default();
        let started = std::time::Instant::now();
        let result: Result<_, Failure> = match &params.source {
            BuildSource::Sandbox(sandbox) => self
                .build_from_sandbox(&record, sandbox, &params, &log)
                .await
                .map_err(Failure::from),
            BuildSource::Steps(plan) => {
                self.build_from_steps(
                    &record,
                    plan,
                    params.start_cmd.clone(),
                    params.ready_cmd.clone(),
                    &log,
                )
                .await
            }
            _ => self
                .build_from_image(&record, &params, &log)
                .await
                .map_err(Failure::from),
        };
        // The build's VM is gone (snapshotted or failed).
        drop(room);
        record.finished_at_ms = Some(now_ms());
        let store = self.manager.store();
        let mut untagged = Vec::new();
        let written = match result {
            Ok(template) => {
                crate::node::crash::point("template.written");
                log.push(&format!(
                    "template ready in {:.1} s",
                    started.elapsed().as_secs_f64()
                ));
                record.status = BuildStatus::Ready;
                record.log = log.lines_from(0);
                match template {
                    // An E2B build's names (its tags) leave the builds that had them.
                    Some(t) if record.e2b.is_some() => self
                        .take_names(&t)
                        .and_then(|emptied| {
                            untagged = emptied;
                            store.finish_build(&t, &record)
                        })
                        .map_err(SandboxError::from),
                    // Unrecorded, its files would be no one's until a restart.
                    Some(t) => store
                        .finish_build(&t, &record)
                        .inspect_err(|_| {
                            let _ = std::fs::remove_dir_all(&t.dir);
                        })
                        .map_err(SandboxError::from),
                    None => store.put_build(&record).map_err(SandboxError::from),
                }
            }
            Err(Failure {
                step,
                message: reason,
            }) => {
                log.push(&format!("error: {reason}"));
                record.status = BuildStatus::Error;
                record.reason = Some(reason);
                record.reason_step = step;
                record.log = log.lines_from(0);
                store.put_build(&record).map_err(SandboxError::from)
            }
        };
        self.drop_untagged(untagged).await;
        if written.is_ok() && record.status == BuildStatus::Ready {
            self.made_ready(&id).await;
        }
        match written {
            Ok(()) => tracing::info!(
                "template {id} ({}): {} after {:.1} s{}",
                record.name,
                record.status.as_str(),
                started.elapsed().as_secs_f64(),
                record
                    .reason
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
            Err(e) => {
                tracing::error!("template {id}: recording its build: {e}");
                // Say so in the build's status if the store takes anything.
                record.status = BuildStatus::Error;
                record.reason = Some(format!("recording the build: {e}"));
                let _ = store.put_build(&record);
            }
        }
        self.running().remove(&id);
    }

    /// Builds the root filesystem and boots it; returns the template to
    /// record (its files in place, its record not yet written).
    async fn build_from_image(
        &self,
        record: &BuildRecord,
        params: &BuildParams,
        log: &Arc<BuildLog>,
    ) -> Result<Option<TemplateRecord>, String> {
        let config = self.manager.config();
        let agent = config.agent.clone().ok_or("no guest agent binary")?;
        let mut builder = template_build::Builder::new(agent);
        if let Some(dir) = &config.build_cache {
            builder = builder.cache_dir(dir);
        }
        let source = match &params.source {
            BuildSource::DebianPackages(p) => template_build::Source::DebianPackages(p.clone()),
            BuildSource::OciLayout(p) => template_build::Source::OciLayout(p.clone()),
            BuildSource::DockerArchive(p) => template_build::Source::DockerArchive(p.clone()),
            BuildSource::CodeInterpreter => {
                template_build::Source::PythonVenv(code_interpreter::source())
            }
            BuildSource::Sandbox(_) | BuildSource::Steps(_) => {
                return Err("not an image source".into());
            }
        };
        log.push(&format!(
            "building the root filesystem from {}",
            record.source
        ));
        let blocking_log = log.clone();
        let built = tokio::task::spawn_blocking(move || {
            builder.build(&source, &mut |line| blocking_log.push(line))
        })
        .await
        .map_err(|e| format!("the build task failed: {e}"))?
        .map_err(|e| e.to_string())?;
        log.push(&format!(
            "root filesystem {}{}",
            built.rootfs.display(),
            if built.cached { " (cached)" } else { "" }
        ));
        let spec = BootSpec {
            rootfs: built.rootfs.clone(),
            vcpus: record.vcpus,
            mem_mib: record.mem_mib,
            prepare: Prepare {
                start_cmd: params.start_cmd.clone(),
                ready_cmd: params.ready_cmd.clone(),
                ..Prepare::from_image(&built.config)
            },
        };
        let push = |line: &str| log.push(line);
        let mut template = boot::build_on(&self.manager, &record.template_id, &spec, &push)
            .await
            .map_err(|e| e.to_string())?;
        template.names = params.source.names(&record.name);
        // A snapshot may have taken a name meanwhile.
        if let Some(taken) = template
            .names
            .iter()
            .find(|n| self.manager.resolve_template(n).is_ok())
        {
            let taken = taken.clone();
            let _ = std::fs::remove_dir_all(&template.dir);
            return Err(format!(
                "the name {taken} was taken while the template was built"
            ));
        }
        Ok(Some(template))
    }

    /// Runs the start and ready commands in a running sandbox, then takes a
    /// snapshot of it as the template (recorded by the snapshot itself).
    async fn build_from_sandbox(
        &self,
        record: &BuildRecord,
        sandbox: &str,
        params: &BuildParams,
        log: &Arc<BuildLog>,
    ) -> Result<Option<TemplateRecord>, String> {
        let s = self.manager.get(sandbox).map_err(|e| e.to_string())?;
        let vsock = self
            .manager
            .vsock_path(sandbox)
            .ok_or_else(|| format!("sandbox {sandbox} is not running"))?;
        let agent = AgentClient::new(&vsock).with_access_token(s.access_token.as_deref());
        let prepare = Prepare {
            start_cmd: params.start_cmd.clone(),
            ready_cmd: params.ready_cmd.clone(),
            ..Prepare::default()
        };
        let push = |line: &str| log.push(line);
        prepare
            .run(&agent, &push)
            .await
            .map_err(|e| e.to_string())?;
        log.push(&format!("snapshotting sandbox {sandbox}"));
        self.manager
            .snapshot(
                sandbox,
                SnapshotParams {
                    name: Some(record.name.clone()),
                    id: Some(record.template_id.clone()),
                    filesystem_only: false,
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        Ok(None)
    }

    /// Before a create of `name`: a builtin template ([`code_interpreter`])
    /// that is missing is built (or its build under way awaited, for up to
    /// `Config::builtin_wait`: then [`SandboxError::Building`]). Other names, and
    /// templates that exist, return at once.
    pub async fn ensure_builtin(self: &Arc<Self>, name: &str) -> Result<(), SandboxError> {
        if !code_interpreter::is_name(name) || self.manager.resolve_template(name).is_ok() {
            return Ok(());
        }
        let under_way = |t: &Self| -> Result<Option<String>, SandboxError> {
            Ok(t.find_build(code_interpreter::NAME)?
                .filter(|b| b.status == BuildStatus::Building)
                .map(|b| b.template_id))
        };
        let template_id = match under_way(self)? {
            Some(id) => id,
            None => {
                tracing::info!(
                    "template {}: building it for a create of {name}",
                    code_interpreter::NAME
                );
                let params = BuildParams {
                    name: code_interpreter::NAME.to_owned(),
                    source: BuildSource::CodeInterpreter,
                    start_cmd: None,
                    ready_cmd: None,
                    vcpus: None,
                    mem_mib: None,
                    e2b: None,
                    ids: None,
                };
                match self.start(params) {
                    Ok(b) => b.template_id,
                    // Another create started it meanwhile.
                    Err(SandboxError::NameTaken(_)) => match under_way(self)? {
                        Some(id) => id,
                        None => return Ok(()),
                    },
                    Err(e) => return Err(e),
                }
            }
        };
        let waited = std::time::Instant::now();
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let b = self
                .manager
                .store()
                .build(&template_id)?
                .ok_or_else(|| SandboxError::TemplateNotFound(name.to_owned()))?;
            match b.status {
                // A build takes minutes (pip); a client gives up on a request
                // after one (the SDKs' default is 60 s): told to come back.
                BuildStatus::Building | BuildStatus::Waiting
                    if waited.elapsed() >= self.manager.config().builtin_wait =>
                {
                    let elapsed_secs = now_ms().saturating_sub(b.started_at_ms) / 1000;
                    return Err(SandboxError::Building {
                        name: code_interpreter::NAME.to_owned(),
                        elapsed_secs,
                        retry_after_secs: BUILTIN_RETRY_SECS,
                    });
                }
                BuildStatus::Building | BuildStatus::Waiting => continue,
                BuildStatus::Ready => return Ok(()),
                BuildStatus::Error => {
                    return Err(SandboxError::Unavailable(format!(
                        "building the {} template failed: {}",
                        code_interpreter::NAME,
                        b.reason.unwrap_or_default()
                    )));
                }
            }
        }
    }

    /// The build of template `id_or_name` (its id, or the name of its newest
    /// build) and its log lines from `offset`.
    pub fn status(
        &self,
        id_or_name: &str,
        offset: usize,
    ) -> Result<(BuildRecord, Vec<String>), SandboxError> {
        let record = self
            .find_build(id_or_name)?
            .ok_or_else(|| SandboxError::TemplateNotFound(id_or_name.to_owned()))?;
        Ok(self.status_of(record, offset))
    }

    /// A build's record and its log lines from `offset` (live while it runs).
    pub fn status_of(&self, record: BuildRecord, offset: usize) -> (BuildRecord, Vec<String>) {
        let live = self.running().get(&record.template_id).cloned();
        let lines = match live {
            Some(log) if record.status == BuildStatus::Building => log.lines_from(offset),
            _ => record.log.iter().skip(offset).cloned().collect(),
        };
        (record, lines)
    }

    fn find_build(&self, id_or_name: &str) -> Result<Option<BuildRecord>, SandboxError> {
        let store = self.manager.store();
        if let Some(b) = store.build(id_or_name)? {
            return Ok(Some(b));
        }
        Ok(store
            .builds()?
            .into_iter()
            .filter(|b| b.name == id_or_name)
            .max_by_key(|b| b.started_at_ms))
    }

    /// Every template: base, built, snapshots, and builds without a template.
    pub fn list(&self) -> Result<Vec<TemplateInfo>, SandboxError> {
        let store = self.manager.store();
        let builds: HashMap<String, BuildRecord> = store
            .builds()?
            .into_iter()
            .map(|b| (b.template_id.clone(), b))
            .collect();
        let base = self.manager.template().clone();
        let mut out = vec![info(&base, None, "base")];
        // The step cache's snapshots are no one's templates.
        let cache = self.cache_templates();
        for t in store.templates()? {
            if t.id == base.id || cache.contains(&t.id) {
                continue;
            }
            let build = builds.get(&t.id);
            let kind = if t.is_snapshot() && build.is_none() {
                "snapshot"
            } else {
                "built"
            };
            out.push(info(&t, build, kind));
        }
        let recorded: std::collections::HashSet<String> =
            store.templates()?.into_iter().map(|t| t.id).collect();
        // A ready build without its template is an old one removed (see
        // `e2b_build`'s `drop_untagged`): no template to list.
        for b in builds
            .values()
            .filter(|b| !recorded.contains(&b.template_id) && b.status != BuildStatus::Ready)
        {
            out.push(TemplateInfo {
                id: super::e2b_build::e2b_template_id(b).to_owned(),
                build_id: Some(b.build_id.clone()),
                names: vec![b.name.clone()],
                kind: "built",
                source: Some(b.source.clone()),
                vcpus: b.vcpus,
                mem_mib: b.mem_mib,
                disk_size_mb: 0,
                created_at_ms: b.started_at_ms,
                status: b.status,
            });
        }
        out[1..].sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(out)
    }

    /// Deletes a template (built or snapshot) or a failed build; refused for
    /// `base`, while it builds, and while anything uses it. On a node of a
    /// cluster the deleted templates leave its object store too.
    pub async fn delete(&self, id_or_name: &str) -> Result<(), SandboxError> {
        let deleted = self.delete_here(id_or_name).await?;
        self.told_deleted(&deleted).await;
        Ok(())
    }

    /// [`Templates::delete`] on this node: returns the ids of the templates
    /// deleted.
    async fn delete_here(&self, id_or_name: &str) -> Result<Vec<String>, SandboxError> {
        // An E2B template (by id or alias): every build of it.
        let store = self.manager.store();
        let e2b: Vec<BuildRecord> = store
            .builds()?
            .into_iter()
            .filter(|b| {
                b.e2b.is_some()
                    && (b.name == id_or_name || super::e2b_build::e2b_template_id(b) == id_or_name)
            })
            .collect();
        if !e2b.is_empty() {
            if let Some(b) = e2b.iter().find(|b| b.status == BuildStatus::Building) {
                return Err(SandboxError::InUse {
                    id: b.template_id.clone(),
                    users: "its build, still running".into(),
                });
            }
            let mut deleted = Vec::new();
            for b in e2b {
                match self.manager.delete_template(&b.template_id).await {
                    Ok(id) => deleted.push(id),
                    Err(SandboxError::TemplateNotFound(_)) => {}
                    Err(e) => return Err(e),
                }
                store.remove_build(&b.template_id)?;
            }
            return Ok(deleted);
        }
        if self.manager.resolve_template(id_or_name).is_err() {
            let store = self.manager.store();
            let build = self.find_build(id_or_name)?;
            return match build {
                Some(b) if b.status == BuildStatus::Building => Err(SandboxError::InUse {
                    id: b.template_id,
                    users: "its build, still running".into(),
                }),
                Some(b) => {
                    store.remove_build(&b.template_id)?;
                    Ok(Vec::new())
                }
                None => Err(SandboxError::TemplateNotFound(id_or_name.to_owned())),
            };
        }
        let id = self.manager.delete_template(id_or_name).await?;
        self.manager.store().remove_build(&id)?;
        Ok(vec![id])
    }
}

fn check_path(path: &Path, what: &str) -> Result<(), SandboxError> {
    if !path.is_absolute() {
        return Err(SandboxError::Invalid(format!(
            "{what} must be an absolute path on the node, not {}",
            path.display()
        )));
    }
    if !path.exists() {
        return Err(SandboxError::Invalid(format!(
            "{what} {}: no such file or directory on the node",
            path.display()
        )));
    }
    Ok(())
}

fn info(t: &TemplateRecord, build: Option<&BuildRecord>, kind: &'static str) -> TemplateInfo {
    TemplateInfo {
        // An E2B build's template is E2B's template (shared by its builds).
        id: build.map_or_else(
            || t.id.clone(),
            |b| super::e2b_build::e2b_template_id(b).to_owned(),
        ),
        build_id: build.map(|b| b.build_id.clone()),
        names: t.names.clone(),
        kind,
        source: build
            .map(|b| b.source.clone())
            .or_else(|| t.source_sandbox.as_ref().map(|s| format!("sandbox {s}"))),
        vcpus: t.vcpus,
        mem_mib: t.mem_mib,
        disk_size_mb: t.disk_size_mb,
        created_at_ms: t.created_at_ms,
        status: BuildStatus::Ready,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for good in ["jq", "my-template_1.0", "0day"] {
            check_name(good).unwrap();
        }
        for bad in [
            "",
            "-x",
            "My",
            "a b",
            "a/b",
            "a:b",
            &"a".repeat(MAX_NAME + 1),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_log_keeps_its_numbering_when_old_lines_go() {
        let log = BuildLog::default();
        for i in 0..LOG_LINES + 3 {
            log.push(&i.to_string());
        }
        assert_eq!(log.lines_from(0).len(), LOG_LINES);
        assert_eq!(log.lines_from(0)[0], "3");
        assert_eq!(
            log.lines_from(LOG_LINES + 1),
            vec![(LOG_LINES + 1).to_string(), (LOG_LINES + 2).to_string()]
        );
        assert!(log.lines_from(LOG_LINES + 3).is_empty());
    }

    #[test]
    fn build_ids_look_like_uuids() {
        let id = uuid().unwrap();
        assert_eq!(id.len(), 36);
        assert_eq!(id.matches('-').count(), 4);
    }
}
