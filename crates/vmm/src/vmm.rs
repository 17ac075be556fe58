//! A running microVM: its vCPU threads and devices, and what can be done to it.

use std::sync::atomic::Ordering;

use crate::device_manager::legacy::LegacyDevices;
use crate::device_manager::mmio::MmioDeviceManager;
use crate::vstate::memory::GuestMemory;
use crate::vstate::vcpu::{VcpuError, VcpuExitReason, VcpuHandle};
use crate::vstate::vm::Vm;

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

pub struct Vmm {
    // Field order is drop order: vCPUs stop before devices, devices before
    // the memory and the VM they use.
    vcpus: Vec<VcpuHandle>,
    mmio: MmioDeviceManager,
    legacy: LegacyDevices,
    mem: GuestMemory,
    vm: Vm,
    state: VmState,
}

impl Vmm {
    pub(crate) fn new(
        vm: Vm,
        mem: GuestMemory,
        mmio: MmioDeviceManager,
        legacy: LegacyDevices,
        vcpus: Vec<VcpuHandle>,
    ) -> Self {
        Vmm {
            vcpus,
            mmio,
            legacy,
            mem,
            vm,
            state: VmState::Running,
        }
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
        &self.mem
    }

    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    pub fn mmio_devices(&self) -> &MmioDeviceManager {
        &self.mmio
    }
}
