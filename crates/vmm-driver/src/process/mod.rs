//! One VMM process (sandfork-vmm, or a real Firecracker) driven through its
//! API socket: spawn it, configure and boot a guest, wait for the guest
//! agent, stop it. Shared by the CLI, benchmarks and the VMM's lab tests.

pub mod diagnostics;
mod exit;
mod expose;
mod identity;
mod jail;
pub mod kvm_trace;
mod lineage;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub use exit::ExitWatch;
use expose::Access;
pub use identity::ProcessIdentity;
pub use jail::{Jail, Limits as JailLimits};
pub use lineage::Lineage;

use vmm_api::{
    BootSource, CpuTemplate, Drive, DriveOverride, ForkInfo, ForkParams, InstanceState,
    MachineConfig, SnapshotCreateParams, SnapshotLoadParams, SnapshotType, Vsock, VsockOverride,
};

use crate::agent_client::{AgentClient, AgentError, AgentInit};
use crate::{ClientError, VmmClient};

/// The guest agent's vsock port (E2B's envd port, defined in `envd_proto`).
pub use envd_proto::PORT as AGENT_PORT;
/// How often a guest agent that is not up yet is asked again.
const READY_POLL: Duration = Duration::from_millis(5);
/// How long a new VMM has to listen on its API socket: natively a few
/// milliseconds, a margin for the emulated lab (20-50x slower) with both
/// host CPUs busy.
const API_SOCKET_WAIT: Duration = Duration::from_secs(30);
/// One attempt to reach a starting guest's agent.
const READY_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long `PUT /fork` into `children` may take: the VMM stacks a disk
/// layer per child and writes the frozen memory while the node may be busy
/// starting other guests (in the emulated lab a fork of 100 beside a few
/// dozen running guests took more than the 60 s of other requests), so the
/// bound grows with the children; a VMM that hangs is still given up.
pub fn fork_timeout(children: u32) -> Duration {
    crate::client::DEFAULT_REQUEST_TIMEOUT + Duration::from_secs(2) * children
}

/// The guest CID every VM gets: each VM has its own vsock device and socket.
const GUEST_CID: u32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("starting {binary}: {source}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Api(#[from] ClientError),
    #[error("the guest agent: {0}")]
    Agent(#[from] AgentError),
    #[error("no VMM to adopt in {dir}: {reason}")]
    NotAdoptable { dir: PathBuf, reason: &'static str },
    #[error("the VMM exited ({status}) before the guest agent answered\n{logs}")]
    ExitedEarly { status: ExitStatus, logs: String },
    #[error("{what} did not happen within {waited:?}\n{logs}")]
    Timeout {
        what: &'static str,
        waited: Duration,
        logs: String,
    },
    /// A fork's answer names a file other than the request's, or a disk
    /// layer outside the directory it gave: the caller records these paths,
    /// writes their headers and hands them to other VMMs.
    #[error("the VMM's fork answer names {}, not where it was asked to write", path.display())]
    NotAsked { path: PathBuf },
    /// A path a load or boot would hand a jailed VMM lies outside its
    /// guest's lineage: most such names come from files VMMs wrote, so
    /// this is what a VMM that was taken over would try.
    #[error(
        "{named_in} names {}, outside the directories of the guest's lineage: not handed to its VMM",
        path.display()
    )]
    OutsideLineage { path: PathBuf, named_in: String },
}

/// The guest to boot.
#[derive(Clone, Debug)]
pub struct GuestSpec {
    pub kernel: PathBuf,
    /// The kernel command line; `None` leaves the VMM's default.
    pub boot_args: Option<String>,
    pub vcpus: u8,
    pub mem_mib: u64,
    /// Drives in order; mark one as the root device.
    pub drives: Vec<Drive>,
    /// Give the guest a vsock device (socket in the process's directory).
    pub vsock: bool,
    /// The CPU template its CPUID is masked to (None: the host's CPU).
    pub cpu_template: Option<CpuTemplate>,
}

/// A snapshot to load into a fresh VMM: its state and memory files and the
/// disks to use instead of those it names (a sandbox's own root layer, a fork
/// child's layers). The guest's vsock socket always moves into the loading
/// VMM's directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restore {
    pub state: PathBuf,
    pub mem: PathBuf,
    pub drives: Vec<DriveOverride>,
    /// A working-set file the VMM populates after the load (sandfork's
    /// `prefetch_path`).
    pub prefetch: Option<PathBuf>,
}

impl Restore {
    /// Child `index` of `fork`, with its own disk layers.
    pub fn fork_child(fork: &ForkInfo, index: usize) -> Option<Restore> {
        Some(Restore {
            state: PathBuf::from(&fork.snapshot_path),
            mem: PathBuf::from(&fork.mem_file_path),
            drives: fork.children.get(index)?.clone(),
            prefetch: None,
        })
    }
}

/// What can be read of a VMM without owning its handle: its directory, pid
/// and API socket, for observers and diagnostics while another task drives
/// the VMM (pausing it, forking it).
#[derive(Clone, Debug)]
pub struct VmmProbe {
    dir: PathBuf,
    pid: u32,
    api: VmmClient,
}

impl VmmProbe {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn vsock_path(&self) -> PathBuf {
        self.dir.join(VSOCK_SOCKET)
    }

    pub fn console_path(&self) -> PathBuf {
        self.dir.join(CONSOLE_LOG)
    }

    /// A client of the VM's guest agent.
    pub fn agent(&self) -> AgentClient {
        AgentClient::new(&self.vsock_path())
    }

    /// See [`VmmProcess::diagnostics`].
    pub async fn diagnostics(&self) -> String {
        diagnostics::diagnose(&self.dir, self.pid, &self.api).await
    }
}

const VSOCK_SOCKET: &str = "vsock.sock";
const CONSOLE_LOG: &str = "console.log";

/// A running VMM process with its API socket, console and log in its own
/// directory. Dropping it kills the process (see [`VmmProcess::release`]).
#[derive(Debug)]
pub struct VmmProcess {
    process: Process,
    dir: VmDir,
    api: VmmClient,
    /// Set by [`VmmProcess::release`]: dropping leaves process and directory.
    released: bool,
    /// The uid and gid of a jailed VMM: the files and directories it is
    /// given to write become its own (see [`VmmProcess::give`]).
    owner: Option<(u32, u32)>,
    /// Where the files of the guest it loads or boots may lie (see
    /// [`Lineage`]; only a jailed VMM's are checked).
    lineage: Lineage,
}

/// The VMM as this process knows it: a child it started (jailed or not), or
/// one a previous server started and this one adopted (not a child: it
/// cannot be waited for).
#[derive(Debug)]
enum Process {
    Child(Child),
    Jailed(jail::JailedChild),
    Adopted(ProcessIdentity),
}

#[derive(Debug)]
enum VmDir {
    /// Removed with the handle.
    Temporary(tempfile::TempDir),
    /// Kept: the process may outlive this handle and be adopted from it.
    Kept(PathBuf),
}

impl VmDir {
    fn path(&self) -> &Path {
        match self {
            VmDir::Temporary(t) => t.path(),
            VmDir::Kept(p) => p,
        }
    }
}

impl VmmProcess {
    /// Starts `binary --api-sock <dir>/api.sock` in a private temporary
    /// directory and waits for its socket.
    pub async fn spawn(binary: &Path) -> Result<Self, ProcessError> {
        let dir = tempfile::tempdir().map_err(|source| ProcessError::Io {
            what: "creating the VM directory",
            source,
        })?;
        Self::start(binary, VmDir::Temporary(dir), None).await
    }

    /// As [`spawn`](Self::spawn), with the VMM in the network namespace `netns`
    /// (a `/proc/<pid>/ns/net` or a bind mount of one): the taps its network
    /// interfaces name (`host_dev_name`, e.g. `tap0`) are looked up there. That is
    /// how each sandbox, a restore and every fork child gets its own network with
    /// the same guest address: one namespace per VMM, each holding a tap of the
    /// snapshot's name.
    pub async fn spawn_in_netns(binary: &Path, netns: &Path) -> Result<Self, ProcessError> {
        let ns = open_netns(netns)?;
        let dir = tempfile::tempdir().map_err(|source| ProcessError::Io {
            what: "creating the VM directory",
            source,
        })?;
        Self::start(binary, VmDir::Temporary(dir), Some(ns)).await
    }

    /// Starts the VMM in `dir` (created; it must not exist), in its own
    /// process group so that signals to this process's group (a terminal's
    /// Ctrl+C) leave it running, and records its identity there so that a
    /// later process can [`adopt`](Self::adopt) it.
    pub async fn spawn_in(binary: &Path, dir: PathBuf) -> Result<Self, ProcessError> {
        Self::spawn_kept(binary, dir, None).await
    }

    /// [`spawn_in`](Self::spawn_in) in `jail` (see [`Jail`]), in the network
    /// namespace `netns` if given: a node's sandbox VMM.
    pub async fn spawn_jailed(
        binary: &Path,
        dir: PathBuf,
        netns: Option<&Path>,
        jail: &Jail,
    ) -> Result<Self, ProcessError> {
        let ns = netns.map(open_netns).transpose()?;
        std::fs::create_dir(&dir).map_err(|source| ProcessError::Io {
            what: "creating the VM directory",
            source,
        })?;
        let vm = Self::start_jailed(binary, dir.clone(), ns, jail.clone()).await;
        if vm.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        vm
    }

    async fn start_jailed(
        binary: &Path,
        dir: PathBuf,
        netns: Option<std::os::fd::OwnedFd>,
        jail: Jail,
    ) -> Result<Self, ProcessError> {
        let io = |what| move |source| ProcessError::Io { what, source };
        let api_sock = dir.join("api.sock");
        let stdout = File::create(dir.join(CONSOLE_LOG)).map_err(io("creating the console log"))?;
        let stderr = File::create(dir.join("vmm.log")).map_err(io("creating the VMM log"))?;
        let (bin, at, sock) = (binary.to_owned(), dir.clone(), api_sock.clone());
        let child = tokio::task::spawn_blocking(move || {
            jail::spawn(&jail, &bin, &at, &sock, netns, stdout, stderr)
                .map(|child| (child, jail.uid_base))
        })
        .await
        .map_err(|e| ProcessError::Io {
            what: "a blocking task",
            source: std::io::Error::other(e.to_string()),
        })?;
        let (child, uid_base) = child.map_err(|source| ProcessError::Spawn {
            binary: binary.display().to_string(),
            source,
        })?;
        let id = uid_base + child.id();
        let vm = VmmProcess {
            process: Process::Jailed(child),
            api: VmmClient::new(&api_sock),
            dir: VmDir::Kept(dir.clone()),
            released: false,
            owner: Some((id, id)),
            lineage: Lineage::default(),
        };
        let identity = ProcessIdentity::of(vm.pid()).ok_or(ProcessError::NotAdoptable {
            dir: dir.clone(),
            reason: "the VMM exited at once",
        })?;
        identity
            .write(&dir)
            .map_err(io("recording the VMM's identity"))?;
        vm.api.wait_for_socket(API_SOCKET_WAIT).await?;
        Ok(vm)
    }

    /// [`spawn_in`](Self::spawn_in) with the VMM in the network namespace
    /// `netns` (see [`spawn_in_netns`](Self::spawn_in_netns)): an adoptable
    /// sandbox VMM in its slot.
    pub async fn spawn_in_with_netns(
        binary: &Path,
        dir: PathBuf,
        netns: &Path,
    ) -> Result<Self, ProcessError> {
        let ns = open_netns(netns)?;
        Self::spawn_kept(binary, dir, Some(ns)).await
    }

    async fn spawn_kept(
        binary: &Path,
        dir: PathBuf,
        netns: Option<std::os::fd::OwnedFd>,
    ) -> Result<Self, ProcessError> {
        std::fs::create_dir(&dir).map_err(|source| ProcessError::Io {
            what: "creating the VM directory",
            source,
        })?;
        let vm = Self::start(binary, VmDir::Kept(dir.clone()), netns).await;
        if vm.is_err() {
            // A handle dropped half-started has killed the process already.
            let _ = std::fs::remove_dir_all(&dir);
        }
        vm
    }

    async fn start(
        binary: &Path,
        dir: VmDir,
        netns: Option<std::os::fd::OwnedFd>,
    ) -> Result<Self, ProcessError> {
        let io = |what| move |source| ProcessError::Io { what, source };
        let path = dir.path().to_owned();
        let api_sock = path.join("api.sock");
        let mut command = Command::new(binary);
        command
            .arg("--api-sock")
            .arg(&api_sock)
            .stdin(Stdio::null())
            .stdout(File::create(path.join(CONSOLE_LOG)).map_err(io("creating the console log"))?)
            .stderr(File::create(path.join("vmm.log")).map_err(io("creating the VMM log"))?);
        if matches!(dir, VmDir::Kept(_)) {
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
        }
        if let Some(ns) = netns {
            // The closure owns the descriptor, so it is open in the child.
            let hook = move || {
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            };
            // SAFETY: between fork and exec the hook makes one system call,
            // setns(2), which is async-signal-safe; it allocates nothing.
            unsafe { std::os::unix::process::CommandExt::pre_exec(&mut command, hook) };
        }
        let child = command.spawn().map_err(|source| ProcessError::Spawn {
            binary: binary.display().to_string(),
            source,
        })?;
        let kept = matches!(dir, VmDir::Kept(_));
        let vm = VmmProcess {
            process: Process::Child(child),
            api: VmmClient::new(&api_sock),
            dir,
            released: false,
            owner: None,
            lineage: Lineage::default(),
        };
        if kept {
            let identity = ProcessIdentity::of(vm.pid()).ok_or(ProcessError::NotAdoptable {
                dir: path.clone(),
                reason: "the VMM exited at once",
            })?;
            identity
                .write(&path)
                .map_err(io("recording the VMM's identity"))?;
        }
        vm.api.wait_for_socket(API_SOCKET_WAIT).await?;
        Ok(vm)
    }

    /// Takes over the VMM a previous process started in `dir` with
    /// [`spawn_in`](Self::spawn_in), if that very process still runs and
    /// answers on its API socket.
    pub async fn adopt(dir: &Path) -> Result<Self, ProcessError> {
        let not = |reason| ProcessError::NotAdoptable {
            dir: dir.to_owned(),
            reason,
        };
        let identity = ProcessIdentity::read(dir).ok_or_else(|| not("no identity file"))?;
        if !identity.is_alive() {
            return Err(not("its process is gone"));
        }
        let api =
            VmmClient::new(dir.join("api.sock")).with_request_timeout(Duration::from_secs(10));
        let vm = VmmProcess {
            process: Process::Adopted(identity),
            api,
            dir: VmDir::Kept(dir.to_owned()),
            released: false,
            owner: unprivileged_owner(identity.pid),
            lineage: Lineage::default(),
        };
        vm.api.get_instance_info().await?;
        Ok(vm)
    }

    /// Lets go of the VMM without stopping it: it keeps running and its
    /// directory stays, for a later [`adopt`](Self::adopt). A VMM in a
    /// temporary directory (from [`spawn`](Self::spawn)) cannot outlive its
    /// handle and is killed instead.
    pub fn release(mut self) {
        self.released = matches!(self.dir, VmDir::Kept(_));
    }

    pub fn api(&self) -> &VmmClient {
        &self.api
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> u32 {
        match &self.process {
            Process::Child(c) => c.id(),
            Process::Jailed(c) => c.id(),
            Process::Adopted(id) => id.pid,
        }
    }

    /// The uid and gid a jailed VMM runs as (None: it runs as this process).
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.owner
    }

    /// Hands a jailed VMM what an API call names, before the call: the
    /// paths it writes (files, directories it creates files in) become its
    /// own, as it runs with no capability to write the server's files, and
    /// every path is exposed into its jail (see [`Jail::staged`]). Missing
    /// paths are skipped (the VMM creates them); nothing happens for an
    /// unjailed VMM. What a load or boot hands is refused whole when a path
    /// lies outside the guest's [`Lineage`].
    async fn give(&self, handed: Handed) -> Result<(), ProcessError> {
        let Some((uid, gid)) = self.owner else {
            return Ok(());
        };
        let pid = self.pid();
        let lineage = self.lineage.clone();
        let given = tokio::task::spawn_blocking(move || {
            let staged = expose::Staged::of(pid).map_err(|source| ProcessError::Io {
                what: "reading the jailed VMM's mount table",
                source,
            })?;
            let paths = handed.resolve(&staged, &lineage)?;
            for (path, _) in paths.iter().filter(|(_, a)| *a == Access::Write) {
                match std::os::unix::fs::chown(path, Some(uid), Some(gid)) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    r => r.map_err(|source| ProcessError::Io {
                        what: "giving the jailed VMM a path it writes",
                        source,
                    })?,
                }
            }
            expose::expose(pid, &staged, &paths).map_err(|source| ProcessError::Io {
                what: "exposing files to the jailed VMM",
                source,
            })
        });
        given.await.map_err(|e| ProcessError::Io {
            what: "a blocking task",
            source: std::io::Error::other(e.to_string()),
        })?
    }

    /// Sets the lineage of the guest this VMM is to load or boot, whose
    /// files alone it is then handed for it (see [`Lineage`]).
    pub fn set_lineage(&mut self, lineage: Lineage) {
        self.lineage = lineage;
    }

    pub fn vsock_path(&self) -> PathBuf {
        self.dir.path().join(VSOCK_SOCKET)
    }

    pub fn console(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(CONSOLE_LOG)).unwrap_or_default()
    }

    /// A watch that resolves when this VMM process ends, however it ends
    /// (killed by this handle, or by itself): see [`ExitWatch`].
    pub fn exit_watch(&self) -> Result<ExitWatch, ProcessError> {
        let identity = match &self.process {
            // Not reaped before this handle is dropped: the pid stays its own.
            Process::Child(_) | Process::Jailed(_) => None,
            Process::Adopted(id) => Some(*id),
        };
        ExitWatch::of(self.pid(), identity).map_err(|source| ProcessError::Io {
            what: "watching the VMM process",
            source,
        })
    }

    /// A probe of this VMM for others to read it by.
    pub fn probe(&self) -> VmmProbe {
        VmmProbe {
            dir: self.dir().to_owned(),
            pid: self.pid(),
            api: self.api.clone(),
        }
    }

    pub fn vmm_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("vmm.log")).unwrap_or_default()
    }

    /// What the VMM and its host look like now, for a guest that stopped
    /// answering (see [`diagnostics`]).
    pub async fn diagnostics(&self) -> String {
        diagnostics::diagnose(self.dir(), self.pid(), &self.api).await
    }

    /// The guest console and the VMM's own log, for error messages.
    pub fn logs(&self) -> String {
        format!(
            "--- console ---\n{}\n--- vmm ---\n{}",
            self.console(),
            self.vmm_log()
        )
    }

    /// Configures the guest without starting it.
    pub async fn configure(&self, guest: &GuestSpec) -> Result<(), ProcessError> {
        let mut handed = Handed::for_guest().read(&guest.kernel);
        for d in &guest.drives {
            handed = handed.disk(&d.path_on_host, d.is_read_only != Some(true));
        }
        self.give(handed).await?;
        self.api
            .put_machine_config(&MachineConfig {
                cpu_template: guest.cpu_template,
                ..MachineConfig::new(guest.vcpus, guest.mem_mib)
            })
            .await?;
        self.api
            .put_boot_source(&BootSource {
                kernel_image_path: guest.kernel.display().to_string(),
                boot_args: guest.boot_args.clone(),
                initrd_path: None,
            })
            .await?;
        for drive in &guest.drives {
            self.api.put_drive(drive).await?;
        }
        if guest.vsock {
            self.api
                .put_vsock(&Vsock::new(
                    GUEST_CID,
                    self.vsock_path().display().to_string(),
                ))
                .await?;
        }
        Ok(())
    }

    /// Configures and starts the guest; returns once the VMM has started it.
    pub async fn boot(&self, guest: &GuestSpec) -> Result<(), ProcessError> {
        self.configure(guest).await?;
        self.api.instance_start().await?;
        Ok(())
    }

    /// Pauses the guest and writes a snapshot of it (`state`, `mem`); the guest
    /// stays paused.
    pub async fn snapshot(
        &self,
        kind: SnapshotType,
        state: &Path,
        mem: &Path,
    ) -> Result<(), ProcessError> {
        let handed = [state.parent(), mem.parent()]
            .into_iter()
            .flatten()
            .chain([state, mem])
            .fold(Handed::default(), Handed::write);
        self.give(handed).await?;
        self.api.pause().await?;
        self.api
            .create_snapshot(&SnapshotCreateParams {
                snapshot_type: kind,
                snapshot_path: state.display().to_string(),
                mem_file_path: mem.display().to_string(),
            })
            .await?;
        Ok(())
    }

    /// Loads a snapshot into this (fresh) VMM, with the guest's vsock socket
    /// moved into this process's directory; `resume` starts the guest at once.
    pub async fn load_snapshot(
        &self,
        state: &Path,
        mem: &Path,
        resume: bool,
    ) -> Result<(), ProcessError> {
        let plan = Restore {
            state: state.to_owned(),
            mem: mem.to_owned(),
            drives: Vec::new(),
            prefetch: None,
        };
        self.load(&plan, resume).await
    }

    /// Loads `plan` into this (fresh) VMM and starts the guest.
    pub async fn restore(&self, plan: &Restore) -> Result<(), ProcessError> {
        self.load(plan, true).await
    }

    async fn load(&self, plan: &Restore, resume: bool) -> Result<(), ProcessError> {
        let mut params = SnapshotLoadParams::from_file(
            plan.state.display().to_string(),
            plan.mem.display().to_string(),
            resume,
        );
        params.vsock_override = Some(VsockOverride {
            uds_path: self.vsock_path().display().to_string(),
        });
        params.drive_overrides = plan.drives.clone();
        params.prefetch_path = plan.prefetch.as_ref().map(|p| p.display().to_string());
        // A restored guest writes the disks it runs on (its own layers).
        let mut handed = Handed::for_guest().snapshot(&plan.state).read(&plan.mem);
        for d in &plan.drives {
            handed = handed.disk(&d.path_on_host, !d.read_only);
        }
        if let Some(prefetch) = &plan.prefetch {
            handed = handed.read(prefetch);
        }
        self.give(handed).await?;
        self.api.load_snapshot(&params).await?;
        Ok(())
    }

    /// Forks the VM (sandfork's `PUT /fork`) into `children`, with the state,
    /// the frozen memory and the new disk layers in `dir`.
    pub async fn fork(&self, dir: &Path, children: u32) -> Result<ForkInfo, ProcessError> {
        self.fork_with(&ForkParams {
            snapshot_path: dir.join("fork.state").display().to_string(),
            mem_file_path: dir.join("fork.mem").display().to_string(),
            disk_dir: dir.display().to_string(),
            children,
        })
        .await
    }

    /// Forks the VM with the files where `params` puts them.
    pub async fn fork_with(&self, params: &ForkParams) -> Result<ForkInfo, ProcessError> {
        let (state, mem) = (
            Path::new(&params.snapshot_path),
            Path::new(&params.mem_file_path),
        );
        let handed = [
            Some(Path::new(&params.disk_dir)),
            state.parent(),
            mem.parent(),
        ]
        .into_iter()
        .flatten()
        .fold(Handed::default(), Handed::write);
        self.give(handed).await?;
        let api = self
            .api
            .clone()
            .with_request_timeout(fork_timeout(params.children));
        let info = api.fork(params).await?;
        as_asked(params, &info)?;
        Ok(info)
    }

    /// Loads child `index` of a fork into this (fresh) VMM and resumes it.
    pub async fn load_fork_child(&self, fork: &ForkInfo, index: usize) -> Result<(), ProcessError> {
        let plan = Restore::fork_child(fork, index).unwrap_or_else(|| Restore {
            state: PathBuf::from(&fork.snapshot_path),
            mem: PathBuf::from(&fork.mem_file_path),
            drives: Vec::new(),
            prefetch: None,
        });
        self.restore(&plan).await
    }

    /// Stops the guest's vCPUs (the devices finish what they were given).
    pub async fn pause(&self) -> Result<(), ProcessError> {
        Ok(self.api.pause().await?)
    }

    /// Lets a paused guest run again.
    pub async fn resume(&self) -> Result<(), ProcessError> {
        Ok(self.api.resume().await?)
    }

    /// Whether the VMM has a guest and whether it runs.
    pub async fn instance_state(&self) -> Result<InstanceState, ProcessError> {
        Ok(self.api.get_instance_info().await?.state)
    }

    /// Each disk's drive ID and the file it is on now (a fork or snapshot
    /// moves a running guest's disk to a new top layer).
    pub async fn drives(&self) -> Result<Vec<vmm_api::DriveReport>, ProcessError> {
        let devices = self.api.get_devices().await?;
        Ok(devices.into_iter().filter_map(|d| d.drive).collect())
    }

    /// A client of this VM's guest agent.
    pub fn agent(&self) -> AgentClient {
        AgentClient::new(&self.vsock_path())
    }

    /// Polls the agent's health check until it answers 204; returns the time taken.
    pub async fn wait_for_agent(&mut self, timeout: Duration) -> Result<Duration, ProcessError> {
        let start = Instant::now();
        loop {
            let probe = crate::vsock_connect::agent_health(
                &self.vsock_path(),
                AGENT_PORT,
                Duration::from_secs(5),
            )
            .await;
            if let Ok(204) = probe {
                return Ok(start.elapsed());
            }
            self.still_waiting(start, timeout, "the guest agent's health check")
                .await?;
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// Initialises the guest agent with `init` (`POST /init`, presenting the
    /// agent's current access token `token`) as soon as it answers: the init
    /// is the readiness probe, one vsock connection where a health poll and
    /// then an init took two. Retried while the guest does not take the
    /// connection (it is still starting) or drops it before answering (a
    /// restored guest resets the connections it had, and one it accepted
    /// just then may be among them). An init that was applied before its
    /// answer was lost leaves the agent holding the new token: the retry
    /// refused for the old one presents the new one. Any other answer of the
    /// agent is final. Returns the time taken.
    pub async fn init_agent(
        &mut self,
        init: &AgentInit,
        token: Option<&str>,
        timeout: Duration,
    ) -> Result<Duration, ProcessError> {
        let start = Instant::now();
        let mut presented = token.map(str::to_owned);
        let mut maybe_applied = false;
        loop {
            let agent = self.agent().with_access_token(presented.as_deref());
            let connect = crate::vsock_connect::connect(agent.uds(), AGENT_PORT);
            if let Ok(Ok(stream)) = tokio::time::timeout(READY_CONNECT_TIMEOUT, connect).await {
                match agent.init_over(stream, &init.restamped()).await {
                    Ok(()) => return Ok(start.elapsed()),
                    Err(AgentError::Http(_) | AgentError::Timeout(_)) => maybe_applied = true,
                    Err(AgentError::Status { status: 401, .. })
                        if maybe_applied
                            && init.access_token.is_some()
                            && presented != init.access_token =>
                    {
                        presented.clone_from(&init.access_token);
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            self.still_waiting(start, timeout, "the guest agent's init")
                .await?;
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// Between two tries of a wait for the guest: an error once the VMM has
    /// exited or `timeout` has passed since `start` (with the VMM's
    /// diagnostics), else nothing.
    async fn still_waiting(
        &mut self,
        start: Instant,
        timeout: Duration,
        what: &'static str,
    ) -> Result<(), ProcessError> {
        if let Some(status) = self.try_wait()? {
            return Err(ProcessError::ExitedEarly {
                status,
                logs: self.logs(),
            });
        }
        if start.elapsed() > timeout {
            return Err(ProcessError::Timeout {
                what,
                waited: timeout,
                logs: self.diagnostics().await,
            });
        }
        Ok(())
    }

    /// The exit status once the VMM has ended; an adopted VMM's status is
    /// not ours to read, so it reports success once it is gone.
    fn try_wait(&mut self) -> Result<Option<ExitStatus>, ProcessError> {
        match &mut self.process {
            Process::Child(c) => c.try_wait().map_err(|source| ProcessError::Io {
                what: "checking the VMM process",
                source,
            }),
            Process::Jailed(c) => c.try_wait().map_err(|source| ProcessError::Io {
                what: "checking the VMM process",
                source,
            }),
            Process::Adopted(id) => Ok((!id.is_alive()).then(ExitStatus::default)),
        }
    }

    /// Whether the VMM process still runs.
    pub fn is_running(&mut self) -> bool {
        // After a SIGKILL the leader thread turns zombie before the other
        // threads are gone, and until then the child cannot be waited for:
        // a zombie leader already means dying.
        matches!(self.try_wait(), Ok(None)) && ProcessIdentity::of(self.pid()).is_some()
    }

    /// Waits for the VMM process to end by itself.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, ProcessError> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            if start.elapsed() > timeout {
                return Err(ProcessError::Timeout {
                    what: "the VMM's exit",
                    waited: timeout,
                    logs: self.diagnostics().await,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the guest with Ctrl+Alt+Del (the agent shuts it down cleanly);
    /// a VMM that does not end within `grace` is killed.
    pub async fn shutdown(mut self, grace: Duration) -> Result<(), ProcessError> {
        let _ = self.api.send_ctrl_alt_del().await;
        if self.wait_exit(grace).await.is_err() {
            self.kill();
        }
        Ok(())
    }

    fn kill(&mut self) {
        match &mut self.process {
            Process::Child(c) => {
                if let Ok(None) = c.try_wait() {
                    let _ = c.kill();
                    let pid = c.id();
                    reap_within(pid, || !matches!(c.try_wait(), Ok(None)), self.dir.path());
                }
            }
            Process::Jailed(c) => {
                if let Ok(None) = c.try_wait() {
                    c.kill();
                    let pid = c.id();
                    reap_within(pid, || !matches!(c.try_wait(), Ok(None)), self.dir.path());
                }
            }
            // Its parent (init or a subreaper) reaps it.
            Process::Adopted(id) => id.kill(),
        }
    }
}

/// Checks a fork's answer against its request: the state and memory files
/// it asked for, every new disk layer directly in its `disk_dir`. The
/// answer is the VMM's, which is not trusted.
fn as_asked(params: &ForkParams, info: &ForkInfo) -> Result<(), ProcessError> {
    let disk_dir = Path::new(&params.disk_dir);
    let not_asked = |path: &str| ProcessError::NotAsked { path: path.into() };
    if info.snapshot_path != params.snapshot_path {
        return Err(not_asked(&info.snapshot_path));
    }
    if info.mem_file_path != params.mem_file_path {
        return Err(not_asked(&info.mem_file_path));
    }
    for drive in info.parent.iter().chain(info.children.iter().flatten()) {
        let layer = Path::new(&drive.path_on_host);
        let in_dir = layer.parent() == Some(disk_dir)
            && layer.file_name().is_some_and(|n| n != "." && n != "..");
        if !in_dir {
            return Err(not_asked(&drive.path_on_host));
        }
    }
    Ok(())
}

/// What an API call hands a jailed VMM (see [`VmmProcess::give`]).
#[derive(Default)]
struct Handed {
    items: Vec<Item>,
    /// For a guest the VMM loads or boots: every path in a staged directory
    /// must lie in the guest's [`Lineage`].
    for_guest: bool,
}

enum Item {
    /// A file or directory, as is.
    Path(PathBuf, Access),
    /// A disk: its top layer, and read-only every layer below it (the VMM
    /// opens them by the paths their headers record).
    Disk(PathBuf, Access),
    /// A snapshot's state file, read-only with the memory files it maps
    /// (a snapshot's memory may stack on its template's files).
    Snapshot(PathBuf),
}

impl Handed {
    /// What a load or boot hands: checked against the guest's lineage.
    fn for_guest() -> Handed {
        Handed {
            items: Vec::new(),
            for_guest: true,
        }
    }

    fn read(mut self, path: impl AsRef<Path>) -> Handed {
        let path = path.as_ref().to_owned();
        self.items.push(Item::Path(path, Access::Read));
        self
    }

    fn write(mut self, path: impl AsRef<Path>) -> Handed {
        let path = path.as_ref().to_owned();
        self.items.push(Item::Path(path, Access::Write));
        self
    }

    fn disk(mut self, top: impl AsRef<Path>, writable: bool) -> Handed {
        let access = if writable {
            Access::Write
        } else {
            Access::Read
        };
        self.items.push(Item::Disk(top.as_ref().to_owned(), access));
        self
    }

    fn snapshot(mut self, state: impl AsRef<Path>) -> Handed {
        self.items.push(Item::Snapshot(state.as_ref().to_owned()));
        self
    }

    /// Every path handed: disks' chains and the memory files of state files
    /// read from their headers. One that cannot be read is handed alone:
    /// the VMM reports what it misses. For a guest, a path in a `staged`
    /// directory outside `lineage` is refused.
    fn resolve(
        self,
        staged: &expose::Staged,
        lineage: &Lineage,
    ) -> Result<Vec<(PathBuf, Access)>, ProcessError> {
        // Each path with the file that named it (None: the request).
        let mut out: Vec<(PathBuf, Access, Option<PathBuf>)> = Vec::new();
        for item in self.items {
            match item {
                Item::Path(path, access) => out.push((path, access, None)),
                Item::Disk(top, access) => {
                    if let Ok(true) = disk_layers::is_layer(&top)
                        && let Ok(chain) = disk_layers::chain_files(&top)
                    {
                        let below = chain.into_iter().skip(1);
                        out.extend(below.map(|p| (p, Access::Read, Some(top.clone()))));
                    }
                    out.push((top, access, None));
                }
                Item::Snapshot(state) => {
                    if let Ok(files) = crate::snapshot_state::memory_files(&state) {
                        out.extend(
                            files
                                .into_iter()
                                .map(|p| (p, Access::Read, Some(state.clone()))),
                        );
                    }
                    out.push((state, Access::Read, None));
                }
            }
        }
        let mut handed = Vec::with_capacity(out.len());
        for (path, access, named_in) in out {
            if self.for_guest && staged.holds(&path) && !lineage.holds(&path) {
                if path.symlink_metadata().is_ok() {
                    return Err(ProcessError::OutsideLineage {
                        path,
                        named_in: named_in
                            .map_or("the request".into(), |f| f.display().to_string()),
                    });
                }
                // A missing one binds nothing: dropped, so that it stays
                // unbound should it appear (a template's state names the
                // memory file of its build's scratch directory, renamed since).
                continue;
            }
            handed.push((path, access));
        }
        Ok(handed)
    }
}

/// How long a killed VMM may take to be gone before its caller stops
/// waiting for it (and says so): a process stuck in the kernel on its way
/// out must not hang whoever dropped its handle.
const KILL_REAP_TIMEOUT: Duration = Duration::from_secs(20);

/// Waits for killed child `pid` to end (`reaped` reaps it if it has), at
/// most [`KILL_REAP_TIMEOUT`]; a child that does not is reported on stderr,
/// with what its threads wait for, and left to be reaped when this process
/// ends.
fn reap_within(pid: u32, mut reaped: impl FnMut() -> bool, dir: &Path) {
    let start = Instant::now();
    let timeout = KILL_REAP_TIMEOUT;
    while start.elapsed() < timeout {
        if reaped() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "vmm-api: VMM {pid} ({}) still exists {timeout:?} after SIGKILL; its threads:\n{}\
         --- host kernel messages (tail) ---\n{}",
        dir.display(),
        diagnostics::threads(pid),
        diagnostics::kernel_messages(diagnostics::KERNEL_LINES),
    );
}

/// The uid and gid of running process `pid` when they are not root's: an
/// adopted VMM that a previous server jailed.
fn unprivileged_owner(pid: u32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let first = |key: &str| -> Option<u32> {
        let line = status.lines().find_map(|l| l.strip_prefix(key))?;
        line.split_whitespace().next()?.parse().ok()
    };
    let (uid, gid) = (first("Uid:")?, first("Gid:")?);
    (uid != 0).then_some((uid, gid))
}

/// Opens a network namespace file for `setns` in a VMM about to be spawned.
fn open_netns(path: &Path) -> Result<std::os::fd::OwnedFd, ProcessError> {
    File::open(path)
        .map(Into::into)
        .map_err(|source| ProcessError::Io {
            what: "opening the network namespace",
            source,
        })
}

impl Drop for VmmProcess {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.kill();
        if let VmDir::Kept(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_answer_names_only_what_was_asked() {
        let params = ForkParams {
            snapshot_path: "/data/forks/f1/fork.state".into(),
            mem_file_path: "/data/forks/f1/fork.mem".into(),
            disk_dir: "/data/forks/f1".into(),
            children: 2,
        };
        let drive = |path: &str| DriveOverride::new("rootfs", path);
        let answer = |state: &str, child: &str| ForkInfo {
            snapshot_path: state.into(),
            mem_file_path: params.mem_file_path.clone(),
            parent: vec![drive("/data/forks/f1/parent.layer")],
            children: vec![vec![drive("/data/forks/f1/c0.layer")], vec![drive(child)]],
            children_failed: None,
            paused_us: 1,
            phases: None,
        };
        let state = params.snapshot_path.as_str();
        as_asked(&params, &answer(state, "/data/forks/f1/c1.layer")).unwrap();
        for (state, child, named) in [
            (
                state,
                "/data/sandboxes/other/root.layer",
                "/data/sandboxes/other/root.layer",
            ),
            (
                state,
                "/data/forks/f1/../f2/c1.layer",
                "/data/forks/f1/../f2/c1.layer",
            ),
            (
                state,
                "/data/forks/f1/sub/c1.layer",
                "/data/forks/f1/sub/c1.layer",
            ),
            (state, "c1.layer", "c1.layer"),
            (
                "/data/sandboxes/other/vm.state",
                "/data/forks/f1/c1.layer",
                "/data/sandboxes/other/vm.state",
            ),
        ] {
            match as_asked(&params, &answer(state, child)) {
                Err(ProcessError::NotAsked { path }) => assert_eq!(path, Path::new(named)),
                other => panic!("{child}: {other:?}"),
            }
        }
    }

    /// A stand-in VMM: listens on its `--api-sock` (all `start` waits for) and
    /// records the network namespace it runs in.
    const FAKE_VMM: &str = "#!/bin/sh\n\
        readlink /proc/self/ns/net > \"$(dirname \"$2\")/netns\"\n\
        exec python3 -c 'import socket, sys, time\n\
s = socket.socket(socket.AF_UNIX)\n\
s.bind(sys.argv[1]); s.listen(1); time.sleep(60)' \"$2\"\n";

    /// Needs root (a new network namespace), as the tap tests do.
    #[tokio::test]
    async fn spawn_in_netns_starts_the_vmm_in_that_namespace() {
        let bin_dir = tempfile::tempdir().unwrap();
        let binary = bin_dir.path().join("fake-vmm");
        std::fs::write(&binary, FAKE_VMM).unwrap();
        std::fs::set_permissions(&binary, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        // A namespace held by a thread that made it, named by its /proc path.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let link = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
            let path = PathBuf::from(format!(
                "/proc/{}/task/{}/ns/net",
                std::process::id(),
                nix::unistd::gettid()
            ));
            tx.send((path, link)).unwrap();
            let _ = done_rx.recv();
        });
        let (path, link) = rx.recv().unwrap();
        let vm = VmmProcess::spawn_in_netns(&binary, &path).await.unwrap();
        let seen = std::fs::read_to_string(vm.dir().join("netns")).unwrap();
        assert_eq!(seen.trim(), link.to_str().unwrap());
        let here = std::fs::read_link("/proc/self/ns/net").unwrap();
        assert_ne!(seen.trim(), here.to_str().unwrap());
        drop(vm);
        let _ = done_tx.send(());
        holder.join().unwrap();

        let err = VmmProcess::spawn_in_netns(&binary, Path::new("/nonexistent/ns"))
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("network namespace"), "{err}");
    }
}
