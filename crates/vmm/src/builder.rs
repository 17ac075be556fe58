//! Assembles a microVM from a [`MicrovmSpec`]: the one place that wires guest
//! memory, the kernel, devices and vCPUs together.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::{Elf, KernelLoader, load_cmdline};
use vm_memory::GuestAddress;

use crate::arch::x86_64::cpu_template::{CpuTemplate, TemplateUnsupported};
use crate::arch::x86_64::layout::{CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START};
use crate::arch::x86_64::{boot_params, cpu_features, mptable, regs};
use crate::device_manager::mmio::DeviceOverrides;
use crate::device_manager::mmio::MmioDeviceManager;
use crate::device_manager::{DeviceManagerError, legacy};
use crate::devices::bus::Bus;
use crate::devices::virtio::balloon::{Balloon, BalloonConfig};
use crate::devices::virtio::block::{Block, BlockConfig};
use crate::devices::virtio::handoff::DeviceHandoff;
use crate::devices::virtio::net::{Net, NetConfig};
use crate::devices::virtio::vsock::Vsock;
use crate::snapshot::MicrovmState;
use crate::vmm::{VmEvent, VmParts, Vmm};
use crate::vstate::memory::{GuestMemory, GuestRam};
use crate::vstate::vcpu::{self, Vcpu, VcpuExitReason};
use crate::vstate::vcpu_state;
use crate::vstate::vm::Vm;

/// Everything needed to build and boot one microVM.
pub struct MicrovmSpec {
    pub kernel: PathBuf,
    /// The kernel command line as the user gave it; init arguments may follow `--`.
    pub cmdline: String,
    /// Kernel parameters the VMM adds (the root device); they and the
    /// virtio-mmio device declarations go before any init arguments.
    pub extra_kernel_args: Vec<String>,
    pub vcpu_count: u8,
    pub mem_size_mib: u64,
    pub drives: Vec<BlockConfig>,
    pub vsock: Option<VsockSpec>,
    /// Network interfaces, in order (the first is the guest's eth0).
    pub nets: Vec<NetConfig>,
    pub balloon: Option<BalloonConfig>,
    /// The CPU template the guest's CPUID is masked to; None: the host's.
    pub cpu_template: Option<&'static CpuTemplate>,
    /// Where the guest's serial console goes.
    pub console: Box<dyn Write + Send>,
    /// A VM made ahead (see [`Vm::with_irqchip`]), or None to make one.
    pub vm: Option<Vm>,
}

impl std::fmt::Debug for MicrovmSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicrovmSpec")
            .field("kernel", &self.kernel)
            .field("cmdline", &self.cmdline)
            .field("extra_kernel_args", &self.extra_kernel_args)
            .field("vcpu_count", &self.vcpu_count)
            .field("mem_size_mib", &self.mem_size_mib)
            .field("drives", &self.drives)
            .field("vsock", &self.vsock)
            .field("nets", &self.nets)
            .field("balloon", &self.balloon)
            .field("cpu_template", &self.cpu_template)
            .field("vm", &self.vm)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub struct VsockSpec {
    pub guest_cid: u64,
    pub uds_path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{0}")]
    Vm(#[from] crate::vstate::vm::VmError),
    #[error("{0}")]
    Memory(#[from] crate::vstate::memory::MemoryError),
    #[error("cannot open kernel image {path}: {source}")]
    KernelOpen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load kernel image {path} (an uncompressed ELF vmlinux is required): {source}")]
    KernelLoad {
        path: PathBuf,
        #[source]
        source: linux_loader::loader::Error,
    },
    #[error("kernel command line: {0}")]
    Cmdline(String),
    #[error("{0}")]
    Devices(#[from] DeviceManagerError),
    #[error("drive: {0}")]
    Block(#[from] crate::devices::virtio::block::BlockError),
    #[error("vsock: {0}")]
    Vsock(#[from] crate::devices::virtio::vsock::VsockError),
    #[error("{0}")]
    Net(#[from] crate::devices::virtio::net::NetError),
    #[error("{0}")]
    Balloon(#[from] crate::devices::virtio::balloon::BalloonError),
    #[error("boot parameters: {0}")]
    BootParams(#[from] boot_params::BootParamsError),
    #[error("boot page tables: {0}")]
    Regs(#[from] regs::RegsError),
    #[error("{0}")]
    MpTable(#[from] mptable::MpTableError),
    #[error("vCPU: {0}")]
    Vcpu(#[from] vcpu::VcpuError),
    #[error("vCPU state: {0}")]
    VcpuState(#[from] vcpu_state::VcpuStateError),
    #[error("the snapshot is inconsistent: {0}")]
    Snapshot(String),
    #[error("{0}")]
    CpuTemplate(#[from] TemplateUnsupported),
    #[error("{0}")]
    SnapshotCpu(#[from] cpu_features::SnapshotCpuError),
}

/// The full kernel command line: the user's kernel parameters, then the
/// VMM's (root device, virtio-mmio devices), then whatever followed `--`
/// (arguments for init, which must stay last or the kernel hands ours to init).
fn kernel_cmdline(user: &str, ours: impl Iterator<Item = String>) -> Result<Cmdline, BuildError> {
    let err = |e: linux_loader::cmdline::Error| BuildError::Cmdline(e.to_string());
    let (kernel_args, init_args) = match user.split_once(" -- ") {
        Some((kernel, init)) => (kernel, Some(init)),
        None => (user.strip_suffix(" --").unwrap_or(user), None),
    };
    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(err)?;
    cmdline.insert_str(kernel_args.trim()).map_err(err)?;
    for arg in ours {
        cmdline.insert_str(arg).map_err(err)?;
    }
    if let Some(init) = init_args {
        cmdline.insert_init_args(init.trim()).map_err(err)?;
    }
    Ok(cmdline)
}

/// Builds the microVM and starts its vCPUs. `on_event` is called (from vCPU
/// or device threads) when the VM must stop; the caller runs `handoff`
/// (see its module) on the thread that called this.
pub fn build_and_boot(
    spec: MicrovmSpec,
    on_event: Arc<dyn Fn(VmEvent) + Send + Sync>,
    handoff: Arc<DeviceHandoff>,
) -> Result<Vmm, BuildError> {
    if spec.vcpu_count == 0 || spec.vcpu_count > mptable::MAX_CPUS {
        return Err(mptable::MpTableError::TooManyCpus(spec.vcpu_count).into());
    }
    vcpu::register_kick_signal()?;

    let vm = match spec.vm {
        Some(vm) => vm,
        None => Vm::with_irqchip()?,
    };
    let supported = vm.supported_cpuid()?;
    if let Some(template) = spec.cpu_template {
        template.check_host(supported.as_slice())?;
    }
    let ram = GuestRam::new(spec.mem_size_mib << 20)?;
    let mem: &GuestMemory = ram.guest_memory();
    vm.register_memory(mem)?;

    let mut kernel = File::open(&spec.kernel).map_err(|source| BuildError::KernelOpen {
        path: spec.kernel.clone(),
        source,
    })?;
    let loaded =
        Elf::load(mem, None, &mut kernel, Some(GuestAddress(HIMEM_START))).map_err(|source| {
            BuildError::KernelLoad {
                path: spec.kernel.clone(),
                source,
            }
        })?;

    let mut io_bus = Bus::new();
    let mut mmio_bus = Bus::new();
    let reset_event = on_event.clone();
    let legacy = legacy::attach(
        &vm,
        &mut io_bus,
        spec.console,
        Box::new(move || reset_event(VmEvent::ResetRequested)),
        None,
    )?;

    let mut mmio = MmioDeviceManager::new(handoff.clone());
    for drive in spec.drives {
        let block = Block::new(drive)?;
        mmio.attach(&vm, mem, &mut mmio_bus, Box::new(block))?;
    }
    if let Some(vsock) = spec.vsock {
        let device = Vsock::new(vsock.guest_cid, vsock.uds_path)?;
        mmio.attach(&vm, mem, &mut mmio_bus, Box::new(device))?;
    }
    // After the others, so adding a network leaves their windows and lines as they were.
    for net in spec.nets {
        mmio.attach(&vm, mem, &mut mmio_bus, Box::new(Net::new(net)?))?;
    }
    if let Some(balloon) = spec.balloon {
        mmio.attach(&vm, mem, &mut mmio_bus, Box::new(Balloon::new(balloon)?))?;
    }

    let cmdline = kernel_cmdline(
        &spec.cmdline,
        spec.extra_kernel_args
            .iter()
            .cloned()
            .chain(mmio.slots().iter().map(|s| s.cmdline_param())),
    )?;
    let cmdline_size = cmdline
        .as_cstring()
        .map_err(|e| BuildError::Cmdline(e.to_string()))?
        .as_bytes_with_nul()
        .len();
    load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline)
        .map_err(|e| BuildError::Cmdline(e.to_string()))?;
    let mem_size = spec.mem_size_mib << 20;
    boot_params::write_zero_page(mem, mem_size, cmdline_size)?;
    regs::write_boot_tables(mem)?;
    mptable::setup_mptable(mem, spec.vcpu_count)?;

    let buses = (Arc::new(io_bus), Arc::new(mmio_bus));
    let vcpus = create_vcpus(
        &vm,
        spec.vcpu_count,
        buses,
        &handoff,
        on_event,
        |vcpu, _| {
            Ok(vcpu.configure(
                &supported,
                spec.cpu_template,
                spec.vcpu_count,
                loaded.kernel_load.0,
            )?)
        },
    )?;
    let msrs = Arc::new(vcpu_state::saveable_msrs(vm.kvm(), vcpus[0].fd())?);
    let mut handles = Vec::with_capacity(vcpus.len());
    for vcpu in vcpus {
        handles.push(vcpu.start(false)?);
    }
    Ok(Vmm::new(VmParts {
        vm,
        ram,
        mmio,
        legacy,
        vcpus: handles,
        mem_size_mib: spec.mem_size_mib,
        msrs,
        paused: false,
    }))
}

/// Creates `count` vCPUs on the VM's buses, each set up by `set_up` (boot
/// registers, or a snapshot's state) before the next; `on_event` hears of
/// each one's exit.
fn create_vcpus(
    vm: &Vm,
    count: u8,
    (io_bus, mmio_bus): (Arc<Bus>, Arc<Bus>),
    handoff: &Arc<DeviceHandoff>,
    on_event: Arc<dyn Fn(VmEvent) + Send + Sync>,
    mut set_up: impl FnMut(&Vcpu, u8) -> Result<(), BuildError>,
) -> Result<Vec<Vcpu>, BuildError> {
    let on_exit: vcpu::ExitCallback =
        Arc::new(move |id, reason: VcpuExitReason| on_event(VmEvent::VcpuExited { id, reason }));
    let mut vcpus = Vec::with_capacity(usize::from(count));
    for id in 0..count {
        let vcpu = Vcpu::new(
            vm,
            id,
            io_bus.clone(),
            mmio_bus.clone(),
            handoff.clone(),
            on_exit.clone(),
        )?;
        set_up(&vcpu, id)?;
        vcpus.push(vcpu);
    }
    Ok(vcpus)
}

/// Where a restore's time went, phase by phase (logged).
struct Phases {
    last: std::time::Instant,
    done: Vec<(&'static str, std::time::Duration)>,
}

impl Phases {
    fn start() -> Self {
        Phases {
            last: std::time::Instant::now(),
            done: Vec::new(),
        }
    }

    fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, took)) in self.done.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{name} {} us", took.as_micros())?;
        }
        Ok(())
    }
}

/// How to restore a snapshot.
pub struct RestoreSpec {
    pub state: MicrovmState,
    /// The memory file to use for the snapshot's top memory layer (the one
    /// written last), if it moved since.
    pub mem_path: Option<PathBuf>,
    pub overrides: DeviceOverrides,
    pub resume: bool,
    /// Move the guest clock on by the time since the snapshot.
    pub advance_clock: bool,
    pub console: Box<dyn Write + Send>,
    /// A working-set file: guest memory populated in the background after
    /// the restore (see `vstate::memory::prefetch`).
    pub prefetch: Option<PathBuf>,
    /// A VM made ahead (see [`Vm::with_irqchip`]), or None to make one.
    pub vm: Option<Vm>,
}

impl std::fmt::Debug for RestoreSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreSpec")
            .field("state", &self.state)
            .field("mem_path", &self.mem_path)
            .field("overrides", &self.overrides)
            .field("resume", &self.resume)
            .field("advance_clock", &self.advance_clock)
            .field("prefetch", &self.prefetch)
            .field("vm", &self.vm)
            .finish_non_exhaustive()
    }
}

/// Rebuilds a microVM from a snapshot: maps its memory copy-on-write, loads
/// the VM, device and vCPU state, and starts the vCPUs (paused unless
/// `resume`). Nothing of guest memory is read here.
pub fn restore(
    spec: RestoreSpec,
    on_event: Arc<dyn Fn(VmEvent) + Send + Sync>,
    handoff: Arc<DeviceHandoff>,
) -> Result<Vmm, BuildError> {
    let RestoreSpec {
        mut state,
        mem_path,
        overrides,
        resume,
        advance_clock,
        console,
        prefetch,
        vm,
    } = spec;
    let count = state.vcpu_count;
    if count == 0 || count > mptable::MAX_CPUS || state.vcpus.len() != usize::from(count) {
        return Err(BuildError::Snapshot(format!(
            "{} vCPU states for {count} vCPUs",
            state.vcpus.len()
        )));
    }
    if state.memory.size() != state.mem_size_mib << 20 {
        return Err(BuildError::Snapshot(
            "the memory layout does not match the memory size".into(),
        ));
    }
    if let (Some(path), Some(top)) = (mem_path, state.memory.layers.last_mut()) {
        top.path = path;
    }
    vcpu::register_kick_signal()?;

    let mut took = Phases::start();
    let vm = match vm {
        Some(vm) => vm,
        None => Vm::with_irqchip()?,
    };
    // Before anything is mapped: a guest offered what this host lacks
    // would run until its first such instruction, and die there.
    let supported = vm.supported_cpuid()?;
    for vcpu in &state.vcpus {
        cpu_features::check_snapshot(&vcpu.cpuid, supported.as_slice())?;
    }
    took.mark("vm");
    let ram = GuestRam::restore(&state.memory)?;
    // A working set that cannot be read costs speed, not the restore.
    match prefetch
        .as_deref()
        .map(crate::vstate::memory::read_working_set)
    {
        Some(Ok(ranges)) => drop(ram.prefetch(&ranges)),
        Some(Err(e)) => tracing::warn!("not prefetching: {e}"),
        None => {}
    }
    let mem = ram.guest_memory();
    vm.register_memory(mem)?;
    took.mark("memory");

    let mut io_bus = Bus::new();
    let mut mmio_bus = Bus::new();
    let reset_event = on_event.clone();
    let legacy = legacy::attach(
        &vm,
        &mut io_bus,
        console,
        Box::new(move || reset_event(VmEvent::ResetRequested)),
        Some(&state.legacy),
    )?;
    let mmio = MmioDeviceManager::restore(
        handoff.clone(),
        &vm,
        mem,
        &mut mmio_bus,
        &state.devices,
        &overrides,
    )?;
    took.mark("devices");
    vm.restore_state(&state.vm, advance_clock)?;
    took.mark("vm_state");

    let buses = (Arc::new(io_bus), Arc::new(mmio_bus));
    let vcpus = create_vcpus(&vm, count, buses, &handoff, on_event, |vcpu, id| {
        Ok(vcpu.restore(&state.vcpus[usize::from(id)])?)
    })?;
    took.mark("vcpus");
    let msrs = Arc::new(state.vcpus[0].msrs.iter().map(|e| e.index).collect());
    let mut handles = Vec::with_capacity(vcpus.len());
    for vcpu in vcpus {
        handles.push(vcpu.start(!resume)?);
    }
    mmio.notify_restored();
    took.mark("start");
    tracing::info!("restored: {took}");
    Ok(Vmm::new(VmParts {
        vm,
        ram,
        mmio,
        legacy,
        vcpus: handles,
        mem_size_mib: state.mem_size_mib,
        msrs,
        paused: !resume,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(user: &str) -> String {
        let devices = ["virtio_mmio.device=4K@0xd0000000:5".to_string()].into_iter();
        kernel_cmdline(user, devices)
            .unwrap()
            .as_cstring()
            .unwrap()
            .into_string()
            .unwrap()
    }

    #[test]
    fn devices_go_before_init_arguments() {
        assert_eq!(
            line("console=ttyS0 init=/bin/sh -- -c \"echo hi\""),
            "console=ttyS0 init=/bin/sh virtio_mmio.device=4K@0xd0000000:5 -- -c \"echo hi\""
        );
        assert_eq!(
            line("console=ttyS0"),
            "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5"
        );
    }

    #[test]
    fn an_overlong_command_line_is_an_error() {
        let long = "x".repeat(CMDLINE_MAX_SIZE + 1);
        assert!(matches!(
            kernel_cmdline(&long, std::iter::empty()),
            Err(BuildError::Cmdline(_))
        ));
    }
}
