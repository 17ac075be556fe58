//! Executes API actions: gathers the VM's resources before boot, builds and
//! boots it on `InstanceStart`, then pauses, resumes and signals it, and
//! reports how it ended.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use vmm_api::{
    Balloon, BootSource, Drive, DriveOverride, ForkInfo, ForkParams, ForkPhases, InstanceInfo,
    InstanceState, MachineConfig, MemBackendType, NetworkInterface, SnapshotCreateParams,
    SnapshotLoadParams, SnapshotType, VmConfig, VmmAction, VmmActionError, VmmData, Vsock,
};

use crate::arch::x86_64::cpu_template;
use crate::builder::{self, MicrovmSpec, RestoreSpec, VsockSpec};
use crate::device_manager::mmio::{DeviceOverrides, DriveAt};
use crate::devices::virtio::balloon::{BalloonConfig, BalloonHandle};
use crate::devices::virtio::block::BlockConfig;
use crate::devices::virtio::handoff::DeviceHandoff;
use crate::devices::virtio::net::{NetConfig, Tap};
use crate::snapshot::{ForkRequest, MicrovmState, SnapshotError, SnapshotRequest, format};
use crate::vmm::{VmEvent, VmExit, VmState, Vmm};
use crate::vstate::memory::MemorySnapshotKind;
use crate::vstate::vm::{Vm, VmError, supported_cpuid};

/// The kernel command line when the user gives none: a serial console, reboot
/// through the keyboard controller, a panic reboots (and so ends the VM), and
/// no probing for hardware a microVM does not have.
pub const DEFAULT_BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule \
    i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd";

const NOT_AFTER_START: &str =
    "The requested operation is not supported after starting the microVM.";
const NOT_BEFORE_START: &str =
    "The requested operation is not supported before starting the microVM.";
const NO_BALLOON: &str = "No balloon device found.";

/// The console output, shared so that a start or load that fails does not
/// use it up.
#[derive(Clone)]
struct SharedConsole(Arc<Mutex<Box<dyn Write + Send>>>);

impl Write for SharedConsole {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).flush()
    }
}

pub type Reply = Box<dyn FnOnce(Result<VmmData, VmmActionError>) + Send>;

/// What the controller's loop waits for.
pub enum ControllerEvent {
    Action(VmmAction, Reply),
    Vm(VmEvent),
    /// A vCPU handed over a device status write (see
    /// `devices::virtio::handoff`): apply it.
    DeviceHandoff,
    /// The API server is gone; with no VM running there is nothing left to do.
    ApiClosed,
}

impl std::fmt::Debug for ControllerEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // The reply is a closure.
            ControllerEvent::Action(action, _) => f.debug_tuple("Action").field(action).finish(),
            ControllerEvent::Vm(event) => f.debug_tuple("Vm").field(event).finish(),
            ControllerEvent::DeviceHandoff => f.write_str("DeviceHandoff"),
            ControllerEvent::ApiClosed => f.write_str("ApiClosed"),
        }
    }
}

pub struct Controller {
    id: String,
    config: VmConfig,
    vmm: Option<Vmm>,
    events: Sender<ControllerEvent>,
    console: SharedConsole,
    /// The KVM VM, made before any request (see [`Controller::prepare_vm`]).
    prepared_vm: Option<Vm>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("id", &self.id)
            .field("config", &self.config)
            .field("vmm", &self.vmm)
            .field("events", &self.events)
            .field("prepared_vm", &self.prepared_vm)
            .finish_non_exhaustive()
    }
}

/// Microseconds, as the API counts them.
fn us(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn bad(message: impl Into<String>) -> VmmActionError {
    VmmActionError::bad_request(message)
}

/// A snapshot or fork that failed: a 400 when the VM runs on as it was
/// (its caller may remove what it wrote), a 500 when the VM's state is in
/// doubt ([`SnapshotError::InDoubt`]: its memory is on the files written).
fn refused_or_failed(message: String, e: &SnapshotError) -> VmmActionError {
    if e.in_doubt() {
        VmmActionError::internal(message)
    } else {
        bad(message)
    }
}

/// Refuses a path that cannot be opened as `what` needs it (read-only, or
/// read-write), so a bad path fails its PUT rather than the later start.
fn check_openable(what: &str, path: &str, writable: bool) -> Result<(), VmmActionError> {
    let meta =
        std::fs::metadata(path).map_err(|e| bad(format!("{what} {path} cannot be opened: {e}")))?;
    if meta.is_dir() {
        return Err(bad(format!("{what} {path} is a directory")));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .open(path)
        .map_err(|e| {
            let mode = if writable { " for writing" } else { "" };
            bad(format!("{what} {path} cannot be opened{mode}: {e}"))
        })?;
    Ok(())
}

impl Controller {
    pub fn new(
        id: String,
        events: Sender<ControllerEvent>,
        console: Box<dyn Write + Send>,
    ) -> Self {
        Controller {
            id,
            config: VmConfig::default(),
            vmm: None,
            events,
            console: SharedConsole(Arc::new(Mutex::new(console))),
            prepared_vm: None,
        }
    }

    /// Makes the KVM VM (with its interrupt controllers and PIT) now, while
    /// the VMM waits for its first request (in a pool, say): a load or boot
    /// then starts from it, the same for any snapshot or configuration. A
    /// VM that cannot be made now is made (and its error reported) then.
    pub fn prepare_vm(&mut self) {
        match Vm::with_irqchip() {
            Ok(vm) => self.prepared_vm = Some(vm),
            Err(e) => tracing::debug!("the VM is made at start: {e}"),
        }
    }

    fn started(&self) -> bool {
        self.vmm.is_some()
    }

    /// Refuses a CPU template this host's KVM cannot offer, when the
    /// configuration is given rather than at start. A KVM that cannot be
    /// asked now is asked (and its error reported) at start.
    fn check_cpu_template(&self, machine: &MachineConfig) -> Result<(), VmmActionError> {
        let Some(template) = machine.cpu_template.and_then(cpu_template::for_api) else {
            return Ok(());
        };
        let supported = match &self.prepared_vm {
            Some(vm) => vm.supported_cpuid(),
            None => kvm_ioctls::Kvm::new()
                .map_err(VmError::OpenKvm)
                .and_then(|kvm| supported_cpuid(&kvm)),
        };
        match supported {
            Ok(cpuid) => template
                .check_host(cpuid.as_slice())
                .map_err(|e| bad(e.to_string())),
            Err(e) => {
                tracing::debug!("the CPU template is checked at start: {e}");
                Ok(())
            }
        }
    }

    fn machine_config(&self) -> MachineConfig {
        self.config.machine_config_or_default()
    }

    /// Serves events until the VM ends (or the API goes away before a start).
    pub fn run(mut self, events: &Receiver<ControllerEvent>) -> Option<VmExit> {
        while let Ok(event) = events.recv() {
            match event {
                ControllerEvent::Action(action, reply) => reply(self.handle(action)),
                ControllerEvent::DeviceHandoff => {
                    if let Some(vmm) = &self.vmm {
                        vmm.run_device_handoff();
                    }
                }
                ControllerEvent::Vm(event) => {
                    let vmm = self.vmm.take()?;
                    let exit = vmm.exit_for(&event);
                    drop(vmm);
                    return Some(exit);
                }
                ControllerEvent::ApiClosed if !self.started() => return None,
                ControllerEvent::ApiClosed => {}
            }
        }
        None
    }

    /// Applies a whole config file, then boots.
    pub fn apply_config(&mut self, config: VmConfig) -> Result<(), VmmActionError> {
        config.validate()?;
        if let Some(machine) = config.machine_config.clone() {
            self.handle(VmmAction::PutMachineConfig(machine))?;
        }
        if let Some(boot) = config.boot_source.clone() {
            self.handle(VmmAction::PutBootSource(boot))?;
        }
        for drive in config.drives.iter().cloned() {
            self.handle(VmmAction::PutDrive(drive))?;
        }
        if let Some(vsock) = config.vsock.clone() {
            self.handle(VmmAction::PutVsock(vsock))?;
        }
        for net in config.network_interfaces.iter().cloned() {
            self.handle(VmmAction::PutNetworkInterface(net))?;
        }
        if let Some(balloon) = config.balloon.clone() {
            self.handle(VmmAction::PutBalloon(balloon))?;
        }
        self.handle(VmmAction::InstanceStart).map(|_| ())
    }

    pub fn handle(&mut self, action: VmmAction) -> Result<VmmData, VmmActionError> {
        match action {
            VmmAction::GetInstanceInfo => Ok(VmmData::InstanceInfo(self.instance_info())),
            VmmAction::GetMachineConfig => Ok(VmmData::MachineConfig(self.machine_config())),
            VmmAction::GetVmConfig => {
                let mut config = self.config.clone();
                config.machine_config = Some(self.machine_config());
                if let Some(vmm) = &self.vmm {
                    config.balloon = vmm.balloon().map(|b| b.config());
                }
                Ok(VmmData::VmConfig(Box::new(config)))
            }
            VmmAction::PutMachineConfig(machine) => {
                self.pre_boot()?;
                machine.validate()?;
                self.check_cpu_template(&machine)?;
                self.config.machine_config = Some(machine);
                Ok(VmmData::Empty)
            }
            VmmAction::PatchMachineConfig(update) => {
                self.pre_boot()?;
                let machine = self.machine_config().patched(&update)?;
                machine.validate()?;
                self.check_cpu_template(&machine)?;
                self.config.machine_config = Some(machine);
                Ok(VmmData::Empty)
            }
            VmmAction::PutBootSource(boot) => {
                self.pre_boot()?;
                self.put_boot_source(boot)
            }
            VmmAction::PutDrive(drive) => {
                self.pre_boot()?;
                self.put_drive(drive)
            }
            VmmAction::PatchDrive(_) => Err(bad("updating a drive is not supported")),
            VmmAction::PutVsock(vsock) => {
                self.pre_boot()?;
                self.put_vsock(vsock)
            }
            VmmAction::PutNetworkInterface(net) => {
                self.pre_boot()?;
                self.put_network_interface(net)
            }
            VmmAction::InstanceStart => {
                self.pre_boot()?;
                let started = self.start()?;
                filter_main_thread();
                Ok(started)
            }
            VmmAction::SendCtrlAltDel => {
                self.running_vmm()?.send_ctrl_alt_del();
                Ok(VmmData::Empty)
            }
            VmmAction::FlushMetrics => Ok(VmmData::Empty),
            VmmAction::Pause => {
                self.running_vmm()?
                    .pause()
                    .map_err(|e| VmmActionError::internal(format!("pausing the VM: {e}")))?;
                Ok(VmmData::Empty)
            }
            VmmAction::Resume => {
                self.running_vmm()?
                    .resume()
                    .map_err(|e| VmmActionError::internal(format!("resuming the VM: {e}")))?;
                Ok(VmmData::Empty)
            }
            VmmAction::GetVcpus => Ok(VmmData::Vcpus(self.running_vmm()?.vcpu_reports())),
            VmmAction::GetDevices => Ok(VmmData::Devices(self.running_vmm()?.device_reports())),
            VmmAction::PutBalloon(balloon) => {
                self.pre_boot()?;
                balloon.validate()?;
                self.check_balloon_size(balloon.amount_mib)?;
                self.config.balloon = Some(balloon);
                Ok(VmmData::Empty)
            }
            VmmAction::GetBalloon => match &self.vmm {
                Some(_) => Ok(VmmData::Balloon(self.balloon()?.config())),
                None => self
                    .config
                    .balloon
                    .clone()
                    .map(VmmData::Balloon)
                    .ok_or_else(|| bad(NO_BALLOON)),
            },
            VmmAction::PatchBalloon(update) => {
                let balloon = self.balloon()?;
                self.check_balloon_size(update.amount_mib)?;
                balloon.set_target_mib(update.amount_mib);
                Ok(VmmData::Empty)
            }
            VmmAction::GetBalloonStats => {
                let balloon = self.balloon()?;
                if !balloon.stats_enabled() {
                    return Err(bad("Statistics for the balloon device are not enabled."));
                }
                Ok(VmmData::BalloonStats(Box::new(balloon.stats())))
            }
            VmmAction::PatchBalloonStats(update) => {
                self.balloon()?
                    .set_stats_interval(update.stats_polling_interval_s)
                    .map_err(|e| bad(e.to_string()))?;
                Ok(VmmData::Empty)
            }
            VmmAction::CreateSnapshot(params) => self.create_snapshot(&params),
            VmmAction::Fork(params) => self.fork(&params),
            VmmAction::LoadSnapshot(params) => {
                self.pre_boot()?;
                let loaded = self.load_snapshot(&params)?;
                filter_main_thread();
                Ok(loaded)
            }
        }
    }

    fn instance_info(&self) -> InstanceInfo {
        let state = match self.vmm.as_ref().map(Vmm::state) {
            None => InstanceState::NotStarted,
            Some(VmState::Running) => InstanceState::Running,
            Some(VmState::Paused) => InstanceState::Paused,
        };
        InstanceInfo {
            id: self.id.clone(),
            state,
            vmm_version: env!("CARGO_PKG_VERSION").into(),
            app_name: "sandfork-vmm".into(),
        }
    }

    fn pre_boot(&self) -> Result<(), VmmActionError> {
        if self.started() {
            return Err(bad(NOT_AFTER_START));
        }
        Ok(())
    }

    fn running_vmm(&mut self) -> Result<&mut Vmm, VmmActionError> {
        self.vmm.as_mut().ok_or_else(|| bad(NOT_BEFORE_START))
    }

    /// The running VM's balloon.
    fn balloon(&mut self) -> Result<BalloonHandle, VmmActionError> {
        self.running_vmm()?.balloon().ok_or_else(|| bad(NO_BALLOON))
    }

    /// A balloon cannot ask for more than the guest's memory.
    fn check_balloon_size(&self, amount_mib: u32) -> Result<(), VmmActionError> {
        if u64::from(amount_mib) > self.machine_config().mem_size_mib {
            return Err(bad(format!(
                "Amount of pages requested is too large: {amount_mib} MiB for a guest of {} MiB.",
                self.machine_config().mem_size_mib
            )));
        }
        Ok(())
    }

    fn put_boot_source(&mut self, boot: BootSource) -> Result<VmmData, VmmActionError> {
        boot.validate()?;
        check_openable("kernel image", &boot.kernel_image_path, false)?;
        if let Some(initrd) = &boot.initrd_path {
            check_openable("initrd", initrd, false)?;
            return Err(bad("initrd_path is not supported: boot from a root drive"));
        }
        self.config.boot_source = Some(boot);
        Ok(VmmData::Empty)
    }

    fn put_drive(&mut self, drive: Drive) -> Result<VmmData, VmmActionError> {
        drive.validate()?;
        check_openable("drive", &drive.path_on_host, !drive.read_only())?;
        let drives = &mut self.config.drives;
        if drive.is_root_device
            && drives
                .iter()
                .any(|d| d.is_root_device && d.drive_id != drive.drive_id)
        {
            return Err(bad("A root block device already exists!"));
        }
        match drives.iter_mut().find(|d| d.drive_id == drive.drive_id) {
            Some(existing) => *existing = drive,
            None => drives.push(drive),
        }
        Ok(VmmData::Empty)
    }

    fn put_vsock(&mut self, vsock: Vsock) -> Result<VmmData, VmmActionError> {
        vsock.validate()?;
        let parent = Path::new(&vsock.uds_path)
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !parent.is_dir() {
            return Err(bad(format!(
                "vsock uds_path {}: directory {} does not exist",
                vsock.uds_path,
                parent.display()
            )));
        }
        self.config.vsock = Some(vsock);
        Ok(VmmData::Empty)
    }

    fn put_network_interface(&mut self, net: NetworkInterface) -> Result<VmmData, VmmActionError> {
        net.validate()?;
        let nets = &mut self.config.network_interfaces;
        if nets
            .iter()
            .any(|n| n.host_dev_name == net.host_dev_name && n.iface_id != net.iface_id)
        {
            return Err(bad(format!(
                "tap {} is already used by another network interface",
                net.host_dev_name
            )));
        }
        // Attach once now, so a tap that cannot be used fails this request
        // rather than the start; the device attaches again at start.
        Tap::open(&net.host_dev_name)
            .map_err(|e| bad(format!("network interface {}: {e}", net.iface_id)))?;
        match nets.iter_mut().find(|n| n.iface_id == net.iface_id) {
            Some(existing) => *existing = net,
            None => nets.push(net),
        }
        Ok(VmmData::Empty)
    }

    /// Kernel parameters for the root drive, if there is one.
    fn root_args(&self) -> Vec<String> {
        let Some(root) = self.config.drives.iter().find(|d| d.is_root_device) else {
            return Vec::new();
        };
        let device = match &root.partuuid {
            Some(partuuid) => format!("root=PARTUUID={partuuid}"),
            None => "root=/dev/vda".to_string(),
        };
        let mode = if root.read_only() { "ro" } else { "rw" };
        vec![device, mode.to_string()]
    }

    fn create_snapshot(
        &mut self,
        params: &SnapshotCreateParams,
    ) -> Result<VmmData, VmmActionError> {
        params.validate()?;
        let request = SnapshotRequest {
            kind: match params.snapshot_type {
                SnapshotType::Full => MemorySnapshotKind::Full,
                SnapshotType::Diff => MemorySnapshotKind::Diff,
            },
            state_path: PathBuf::from(&params.snapshot_path),
            mem_path: PathBuf::from(&params.mem_file_path),
        };
        let stats = self
            .running_vmm()?
            .snapshot(&request)
            .map_err(|e| refused_or_failed(format!("Cannot create the snapshot: {e}"), &e))?;
        tracing::info!(
            "snapshot {} written in {:?} ({} bytes of memory)",
            params.snapshot_path,
            stats.total,
            stats.memory_bytes
        );
        Ok(VmmData::Empty)
    }

    fn fork(&mut self, params: &ForkParams) -> Result<VmmData, VmmActionError> {
        params.validate()?;
        let disk_dir = PathBuf::from(&params.disk_dir);
        if !disk_dir.is_dir() {
            return Err(bad(format!(
                "disk_dir {} is not a directory",
                params.disk_dir
            )));
        }
        let request = ForkRequest {
            state_path: PathBuf::from(&params.snapshot_path),
            mem_path: PathBuf::from(&params.mem_file_path),
            disk_dir,
            children: params.children as usize,
        };
        let outcome = self
            .running_vmm()?
            .fork(&request)
            .map_err(|e| refused_or_failed(format!("Cannot fork the microVM: {e}"), &e))?;
        tracing::info!(
            "forked into {} children; paused {:?} ({:?}), {} bytes of memory written",
            params.children,
            outcome.paused,
            outcome.steps,
            outcome.memory_bytes
        );
        let overrides = |drives: Vec<(String, PathBuf)>| -> Vec<DriveOverride> {
            drives
                .into_iter()
                .map(|(drive_id, path)| DriveOverride::new(drive_id, path.display().to_string()))
                .collect()
        };
        Ok(VmmData::Fork(ForkInfo {
            snapshot_path: params.snapshot_path.clone(),
            mem_file_path: params.mem_file_path.clone(),
            parent: overrides(outcome.parent),
            children: outcome.children.into_iter().map(overrides).collect(),
            children_failed: outcome.children_failed,
            paused_us: us(outcome.paused),
            phases: Some(ForkPhases {
                disks_prepared_us: us(outcome.steps.disks_prepared),
                freeze_us: us(outcome.steps.freeze),
                state_saved_us: us(outcome.steps.state_saved),
                memory_us: us(outcome.steps.memory),
                memory_bytes: outcome.memory_bytes,
                disks_us: us(outcome.steps.disks),
                resume_us: us(outcome.steps.resume),
                children_disks_us: us(outcome.steps.children_disks),
                state_written_us: us(outcome.steps.state_written),
            }),
        }))
    }

    fn load_snapshot(&mut self, params: &SnapshotLoadParams) -> Result<VmmData, VmmActionError> {
        params.validate()?;
        if self.config.boot_source.is_some()
            || !self.config.drives.is_empty()
            || self.config.vsock.is_some()
            || !self.config.network_interfaces.is_empty()
            || self.config.balloon.is_some()
        {
            return Err(bad(
                "Loading a microVM snapshot not allowed after configuring boot-specific resources.",
            ));
        }
        let backend = params
            .memory_backend()
            .ok_or_else(|| bad("one of mem_backend or mem_file_path is required"))?;
        if backend.backend_type == MemBackendType::Uffd {
            return Err(bad(
                "the Uffd memory backend is not supported: use File (memory is mapped copy-on-write)",
            ));
        }
        let started = std::time::Instant::now();
        let state: MicrovmState = format::read(Path::new(&params.snapshot_path))
            .map_err(|e| bad(format!("Cannot load the snapshot: {e}")))?;
        let read = started.elapsed();
        let machine = MachineConfig::new(state.vcpu_count, state.mem_size_mib);
        let spec = RestoreSpec {
            state,
            mem_path: Some(PathBuf::from(&backend.backend_path)),
            overrides: DeviceOverrides {
                vsock_uds_path: params
                    .vsock_override
                    .as_ref()
                    .map(|v| PathBuf::from(&v.uds_path)),
                drive_paths: params
                    .drive_overrides
                    .iter()
                    .map(|d| DriveAt {
                        id: d.drive_id.clone(),
                        path: PathBuf::from(&d.path_on_host),
                        read_only: d.read_only,
                    })
                    .collect(),
                taps: params
                    .network_overrides
                    .iter()
                    .map(|n| (n.iface_id.clone(), n.host_dev_name.clone()))
                    .collect(),
            },
            resume: params.resume_vm,
            advance_clock: params.clock_realtime,
            console: Box::new(self.console.clone()),
            prefetch: params.prefetch_path.as_ref().map(PathBuf::from),
            vm: self.prepared_vm.take(),
        };
        let vmm = builder::restore(spec, self.on_event(), self.device_handoff())
            .map_err(|e| bad(format!("Cannot load the snapshot: {e}")))?;
        tracing::info!(
            "snapshot loaded in {} us (its state read in {} us)",
            started.elapsed().as_micros(),
            read.as_micros()
        );
        self.config.machine_config = Some(machine);
        self.vmm = Some(vmm);
        Ok(VmmData::Empty)
    }

    /// The VM's device handoff, which wakes this controller's loop.
    fn device_handoff(&self) -> Arc<DeviceHandoff> {
        let events = self.events.clone();
        DeviceHandoff::new(Box::new(move || {
            let _ = events.send(ControllerEvent::DeviceHandoff);
        }))
    }

    fn on_event(&self) -> Arc<dyn Fn(crate::vmm::VmEvent) + Send + Sync> {
        let events = self.events.clone();
        Arc::new(move |event| {
            let _ = events.send(ControllerEvent::Vm(event));
        })
    }

    fn start(&mut self) -> Result<VmmData, VmmActionError> {
        let boot = self
            .config
            .boot_source
            .clone()
            .ok_or_else(|| bad("Cannot start microvm without kernel configuration."))?;
        let machine = self.machine_config();
        // The root drive comes first, so it is /dev/vda.
        let mut drives = self.config.drives.clone();
        drives.sort_by_key(|d| !d.is_root_device);
        let spec = MicrovmSpec {
            kernel: PathBuf::from(&boot.kernel_image_path),
            cmdline: boot
                .boot_args
                .clone()
                .unwrap_or_else(|| DEFAULT_BOOT_ARGS.to_string()),
            extra_kernel_args: self.root_args(),
            vcpu_count: machine.vcpu_count,
            mem_size_mib: machine.mem_size_mib,
            drives: drives
                .iter()
                .map(|d| BlockConfig {
                    id: d.drive_id.clone(),
                    path: PathBuf::from(&d.path_on_host),
                    read_only: d.read_only(),
                })
                .collect(),
            vsock: self.config.vsock.as_ref().map(|v| VsockSpec {
                guest_cid: u64::from(v.guest_cid),
                uds_path: PathBuf::from(&v.uds_path),
            }),
            nets: self
                .config
                .network_interfaces
                .iter()
                .map(|n| NetConfig {
                    iface_id: n.iface_id.clone(),
                    host_dev_name: n.host_dev_name.clone(),
                    guest_mac: n.mac(),
                })
                .collect(),
            balloon: self.config.balloon.as_ref().map(balloon_config),
            cpu_template: machine.cpu_template.and_then(cpu_template::for_api),
            console: Box::new(self.console.clone()),
            vm: self.prepared_vm.take(),
        };
        let vmm = builder::build_and_boot(spec, self.on_event(), self.device_handoff())
            .map_err(|e| bad(format!("Failed to start the microVM: {e}")))?;
        self.vmm = Some(vmm);
        Ok(VmmData::Empty)
    }
}

/// Once the VM exists, the controller (the main thread, which calls
/// `handle`) is filtered too: what is left to do is the running VM's.
fn filter_main_thread() {
    crate::seccomp::apply_or_exit(crate::seccomp::ThreadKind::Main);
}

fn balloon_config(b: &Balloon) -> BalloonConfig {
    BalloonConfig {
        amount_mib: b.amount_mib,
        deflate_on_oom: b.deflate_on_oom,
        stats_polling_interval_s: b.stats_polling_interval_s,
        free_page_reporting: b.free_page_reporting,
    }
}
