//! A running microVM: its vCPU threads and devices, and what can be done to it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::device_manager::legacy::LegacyDevices;
use crate::device_manager::mmio::MmioDeviceManager;
use crate::snapshot::{
    ForkOutcome, ForkRequest, ForkSteps, MicrovmState, SnapshotError, SnapshotRequest,
    SnapshotStats, Stopwatch, format,
};
use crate::vstate::memory::{GuestMemory, GuestRam, MemorySnapshotKind};
use crate::vstate::vcpu::{VcpuError, VcpuExitReason, VcpuHandle};
use crate::vstate::vm::Vm;

/// How long a vCPU thread may take to answer a diagnostics kick: short, as
/// a thread that does not answer at once is what a report is for.
const VCPU_REPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// Why a VM must stop, reported from vCPU and device threads.
#[derive(Debug)]
pub enum VmEvent {
    VcpuExited {
        id: u8,
        reason: VcpuExitReason,
    },
    /// The guest pulsed the keyboard controller's reset line.
    ResetRequested,
}

/// How a microVM ended, and the VMM process's exit status for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    /// The guest rebooted or powered off: its normal way to end.
    GuestShutdown,
    /// The guest kernel panicked (seen on the console), then reset.
    GuestPanic,
    /// The vCPU triple-faulted; the text says where.
    TripleFault(String),
    /// KVM could not run the guest.
    Error(String),
}

impl VmExit {
    pub fn exit_code(&self) -> i32 {
        match self {
            VmExit::GuestShutdown => 0,
            VmExit::GuestPanic => 2,
            VmExit::TripleFault(_) => 3,
            VmExit::Error(_) => 4,
        }
    }

    pub fn message(&self) -> String {
        match self {
            VmExit::GuestShutdown => "the guest shut down or rebooted".into(),
            VmExit::GuestPanic => "the guest kernel panicked".into(),
            VmExit::TripleFault(state) => format!("the guest triple-faulted ({state})"),
            VmExit::Error(e) => format!("the VM failed: {e}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmState {
    Running,
    Paused,
}

/// What a fork took while the VM stood still.
struct Frozen {
    state: MicrovmState,
    memory_bytes: u64,
    branches: Vec<crate::devices::virtio::DiskBranch>,
    steps: ForkSteps,
}

/// The parts of a built VM, handed from the builder to [`Vmm::new`].
pub(crate) struct VmParts {
    pub vm: Vm,
    pub ram: GuestRam,
    pub mmio: MmioDeviceManager,
    pub legacy: LegacyDevices,
    pub vcpus: Vec<VcpuHandle>,
    pub mem_size_mib: u64,
    /// The MSRs a snapshot saves.
    pub msrs: Arc<Vec<u32>>,
    pub paused: bool,
}

#[derive(Debug)]
pub struct Vmm {
    // Field order is drop order: vCPUs stop before devices, devices before
    // the memory and the VM they use.
    vcpus: Vec<VcpuHandle>,
    mmio: MmioDeviceManager,
    legacy: LegacyDevices,
    ram: GuestRam,
    vm: Vm,
    state: VmState,
    mem_size_mib: u64,
    msrs: Arc<Vec<u32>>,
}

impl Vmm {
    pub(crate) fn new(parts: VmParts) -> Self {
        Vmm {
            vcpus: parts.vcpus,
            mmio: parts.mmio,
            legacy: parts.legacy,
            ram: parts.ram,
            vm: parts.vm,
            state: if parts.paused {
                VmState::Paused
            } else {
                VmState::Running
            },
            mem_size_mib: parts.mem_size_mib,
            msrs: parts.msrs,
        }
    }

    /// Writes a snapshot of the paused VM: its state file and its memory. The
    /// devices hold still meanwhile; the VM stays paused and can go on after.
    pub fn snapshot(&mut self, request: &SnapshotRequest) -> Result<SnapshotStats, SnapshotError> {
        if self.state != VmState::Paused {
            return Err(SnapshotError::NotPaused);
        }
        let watch = Stopwatch::start();
        self.mmio.pause();
        let taken = self
            .capture_and_write(request)
            .map_err(|e| self.in_doubt_if_moved(e, &request.mem_path));
        let resumed = self.mmio.resume();
        let stats = watch.stats(taken?);
        resumed.map_err(|e| SnapshotError::from(e).into_in_doubt())?;
        Ok(stats)
    }

    /// `e`, [`SnapshotError::InDoubt`] when the VM's memory already runs on
    /// `mem_path` (the point after which a snapshot or fork cannot be
    /// undone by removing its files).
    fn in_doubt_if_moved(&self, e: SnapshotError, mem_path: &std::path::Path) -> SnapshotError {
        let moved = self
            .ram
            .state()
            .layers
            .last()
            .is_some_and(|layer| layer.path == mem_path);
        if moved { e.into_in_doubt() } else { e }
    }

    /// Turns this VM into the parent of `request.children` forks: freezes its
    /// memory (writing only what changed since its last snapshot or fork),
    /// seals its writable disks and moves it onto new layers, and makes the
    /// children's layers and the state they load. A running VM runs on after.
    ///
    /// The VM stands still only for what must see it still: its state read,
    /// its memory frozen, its disks flushed, sealed and switched to layers
    /// made before the freeze. The children's layers and the state file are
    /// made after it runs again, from what was taken while it stood still:
    /// the children stack on the sealed layers, which the VM never writes
    /// again. If they cannot be made, the VM still forked (it runs on its
    /// new layers) and the outcome says why there are no children.
    ///
    /// A network interface is no obstacle: each child is its own VMM process and
    /// opens the tap the state names (`host_dev_name`) where it runs, so children
    /// started in separate network namespaces, each holding a tap of that name,
    /// get separate networks with the parent's guest address and MAC.
    pub fn fork(&mut self, request: &ForkRequest) -> Result<ForkOutcome, SnapshotError> {
        let watch = Stopwatch::start();
        let prepared = self
            .mmio
            .prepare_branches(&request.disk_dir, request.children)?;
        let disks_prepared = watch.elapsed();

        let watch = Stopwatch::start();
        let was_running = self.state == VmState::Running;
        if was_running {
            self.pause()?;
        }
        self.mmio.pause();
        let frozen = watch.elapsed();
        let taken = self
            .fork_paused(request, prepared)
            .map_err(|e| self.in_doubt_if_moved(e, &request.mem_path));
        let resuming = watch.elapsed();
        let devices = self.mmio.resume();
        let vcpus = if was_running { self.resume() } else { Ok(()) };
        let paused = watch.elapsed();
        let Frozen {
            state,
            memory_bytes,
            branches,
            mut steps,
        } = taken?;
        devices.map_err(|e| SnapshotError::from(e).into_in_doubt())?;
        vcpus.map_err(|e| SnapshotError::from(e).into_in_doubt())?;
        steps.disks_prepared = disks_prepared;
        steps.freeze = frozen;
        steps.resume = paused.saturating_sub(resuming);

        let children_failed = Self::make_children(request, &state, &branches, &mut steps)
            .err()
            .map(|e| {
                tracing::error!("the fork's children could not be made: {e}");
                e
            });
        let children = match children_failed {
            Some(_) => Vec::new(),
            None => (0..request.children)
                .map(|i| {
                    branches
                        .iter()
                        .map(|b| (b.drive_id.clone(), b.children[i].clone()))
                        .collect()
                })
                .collect(),
        };
        let parent = branches
            .into_iter()
            .map(|b| (b.drive_id, b.parent))
            .collect();
        Ok(ForkOutcome {
            parent,
            children,
            children_failed,
            paused,
            memory_bytes,
            steps,
        })
    }

    /// The fork's work while everything holds still: the state read, the
    /// memory frozen, the disks sealed and switched to the layers
    /// `prepared` made. The caller fills in how long freezing and resuming
    /// took.
    fn fork_paused(
        &mut self,
        request: &ForkRequest,
        prepared: Vec<(usize, crate::devices::virtio::PreparedBranch)>,
    ) -> Result<Frozen, SnapshotError> {
        // Fork from the last snapshot's layers when there are any: only the
        // pages written since then are new.
        let kind = if self.ram.state().layers.is_empty() {
            MemorySnapshotKind::Full
        } else {
            MemorySnapshotKind::Diff
        };
        let mut steps = ForkSteps::default();
        let (state, memory_bytes) = self.capture_timed(kind, &request.mem_path, &mut steps)?;
        let watch = Stopwatch::start();
        let branches = self.mmio.switch_disks(prepared)?;
        steps.disks = watch.elapsed();
        Ok(Frozen {
            state,
            memory_bytes,
            branches,
            steps,
        })
    }

    /// After the VM runs again: each child's layers stacked on the layers
    /// sealed at the freeze, then the state file. On failure nothing of
    /// them is left: the layers made and the state file are removed.
    fn make_children(
        request: &ForkRequest,
        state: &MicrovmState,
        branches: &[crate::devices::virtio::DiskBranch],
        steps: &mut ForkSteps,
    ) -> Result<(), String> {
        let watch = Stopwatch::start();
        // A drive whose stacking fails removes what it made itself; those
        // before it made all theirs.
        let mut made = 0;
        let stacked = branches
            .iter()
            .try_for_each(|b| {
                b.sealed.stack(&b.children)?;
                made += 1;
                Ok(())
            })
            .map_err(|e: disk_layers::Error| format!("stacking the children's disk layers: {e}"));
        steps.children_disks = watch.elapsed();
        let watch = Stopwatch::start();
        let written = stacked.and_then(|()| {
            format::encode(state)
                .and_then(|bytes| format::write_atomically(&request.state_path, &bytes))
                .map_err(|e| format!("writing the fork's state: {e}"))
        });
        steps.state_written = watch.elapsed();
        if written.is_err() {
            // `write_atomically` leaves no file when it fails.
            for layer in branches[..made].iter().flat_map(|b| &b.children) {
                let _ = std::fs::remove_file(layer);
            }
        }
        written
    }

    fn capture_and_write(&mut self, request: &SnapshotRequest) -> Result<u64, SnapshotError> {
        let (state, written) = self.capture(request.kind, &request.mem_path)?;
        format::write_atomically(&request.state_path, &format::encode(&state)?)?;
        Ok(written)
    }

    /// Captures the whole VM and writes its memory; devices must be paused.
    fn capture(
        &mut self,
        kind: MemorySnapshotKind,
        mem_path: &std::path::Path,
    ) -> Result<(MicrovmState, u64), SnapshotError> {
        self.capture_timed(kind, mem_path, &mut ForkSteps::default())
    }

    /// [`Vmm::capture`], timing its state and memory steps into `steps`.
    fn capture_timed(
        &mut self,
        kind: MemorySnapshotKind,
        mem_path: &std::path::Path,
        steps: &mut ForkSteps,
    ) -> Result<(MicrovmState, u64), SnapshotError> {
        let watch = Stopwatch::start();
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for vcpu in &self.vcpus {
            vcpus.push(vcpu.save_state(self.msrs.clone())?);
        }
        let vm = self.vm.save_state()?;
        let legacy = self.legacy.state();
        let devices = self.mmio.state()?;
        steps.state_saved = watch.elapsed();
        let watch = Stopwatch::start();
        let (memory, written) = self.ram.snapshot(kind, mem_path)?;
        steps.memory = watch.elapsed();
        let state = MicrovmState {
            vmm_version: env!("CARGO_PKG_VERSION").to_owned(),
            vcpu_count: self.vcpus.len() as u8,
            mem_size_mib: self.mem_size_mib,
            memory,
            vm,
            vcpus,
            legacy,
            devices,
        };
        Ok((state, written.bytes))
    }

    pub fn state(&self) -> VmState {
        self.state
    }

    /// Stops every vCPU; returns once all of them are parked.
    pub fn pause(&mut self) -> Result<(), VcpuError> {
        for vcpu in &self.vcpus {
            vcpu.pause()?;
        }
        self.state = VmState::Paused;
        Ok(())
    }

    pub fn resume(&mut self) -> Result<(), VcpuError> {
        for vcpu in &self.vcpus {
            vcpu.resume()?;
        }
        self.state = VmState::Running;
        Ok(())
    }

    /// Applies the device status writes vCPUs handed over (see
    /// `devices::virtio::handoff`); call it on the controller thread.
    pub fn run_device_handoff(&self) {
        self.mmio.handoff().run();
    }

    /// The balloon's handle, if the VM has one.
    pub fn balloon(&self) -> Option<crate::devices::virtio::balloon::BalloonHandle> {
        self.mmio.balloon()
    }

    /// Every virtio device's transport and rings (`GET /devices`).
    pub fn device_reports(&self) -> Vec<vmm_api::DeviceReport> {
        self.mmio.reports()
    }

    /// What every vCPU thread is doing (see [`VcpuHandle::report`]).
    pub fn vcpu_reports(&self) -> Vec<vmm_api::VcpuReport> {
        self.vcpus
            .iter()
            .map(|v| v.report(VCPU_REPORT_TIMEOUT))
            .collect()
    }

    /// Presses Ctrl+Alt+Del on the guest's keyboard.
    pub fn send_ctrl_alt_del(&self) {
        self.legacy
            .i8042
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .trigger_ctrl_alt_del();
    }

    /// Classifies a stop event into how the VM ended.
    pub fn exit_for(&self, event: &VmEvent) -> VmExit {
        let panicked = self.legacy.guest_panicked.load(Ordering::SeqCst);
        match event {
            VmEvent::ResetRequested
            | VmEvent::VcpuExited {
                reason: VcpuExitReason::Reset | VcpuExitReason::Shutdown,
                ..
            } if panicked => VmExit::GuestPanic,
            VmEvent::ResetRequested
            | VmEvent::VcpuExited {
                reason: VcpuExitReason::Reset | VcpuExitReason::Shutdown,
                ..
            } => VmExit::GuestShutdown,
            VmEvent::VcpuExited {
                reason: VcpuExitReason::TripleFault(state),
                ..
            } => VmExit::TripleFault(state.clone()),
            VmEvent::VcpuExited {
                id,
                reason: VcpuExitReason::Error(e),
            } => VmExit::Error(format!("vCPU {id}: {e}")),
        }
    }

    pub fn guest_memory(&self) -> &GuestMemory {
        self.ram.guest_memory()
    }

    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    pub fn mmio_devices(&self) -> &MmioDeviceManager {
        &self.mmio
    }
}
