//! The KVM VM: memory slots, the in-kernel interrupt controllers and PIT.

use kvm_bindings::{
    CpuId, KVM_CLOCK_REALTIME, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY, KVMIO, kvm_clock_data, kvm_irqchip,
    kvm_pit_config, kvm_pit_state2, kvm_reinject_control, kvm_userspace_memory_region,
};
use kvm_ioctls::{Kvm, VmFd};
use serde::{Deserialize, Serialize};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::memory::GuestMemory;
use crate::arch::x86_64::layout::KVM_TSS_ADDRESS;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm: {0}")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("KVM API version {0} is not supported (need 12)")]
    ApiVersion(i32),
    #[error("KVM lacks a required capability: {0}")]
    MissingCapability(&'static str),
    #[error("KVM ioctl {0} failed: {1}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    #[error("guest memory region has no host mapping")]
    NoHostAddress,
}

/// What KVM keeps for the VM as a whole: interrupt controllers, PIT, clock.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

fn irqchip(chip_id: u32) -> kvm_irqchip {
    kvm_irqchip {
        chip_id,
        ..Default::default()
    }
}

/// A KVM VM with its memory registered and its interrupt controllers created.
#[derive(Debug)]
pub struct Vm {
    kvm: Kvm,
    fd: VmFd,
}

impl Vm {
    /// Creates the VM. `/dev/kvm` is opened here, so a missing or unusable
    /// KVM surfaces as a clear error before anything else is built.
    pub fn new() -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let version = kvm.get_api_version();
        if version != kvm_bindings::KVM_API_VERSION as i32 {
            return Err(VmError::ApiVersion(version));
        }
        use kvm_ioctls::Cap;
        for (cap, name) in [
            (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
            (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
            (Cap::Irqfd, "KVM_CAP_IRQFD"),
            (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
            (Cap::Pit2, "KVM_CAP_PIT2"),
            (Cap::ReinjectControl, "KVM_CAP_REINJECT_CONTROL"),
            // The vCPUs are offered the TSC-deadline LAPIC timer (cpuid.rs).
            (Cap::TscDeadlineTimer, "KVM_CAP_TSC_DEADLINE_TIMER"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(VmError::MissingCapability(name));
            }
        }
        let fd = kvm.create_vm().map_err(|e| VmError::Kvm("CREATE_VM", e))?;
        fd.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(|e| VmError::Kvm("SET_TSS_ADDR", e))?;
        Ok(Vm { kvm, fd })
    }

    /// A VM with its interrupt controllers and PIT: what every VM needs
    /// before memory and vCPUs, whatever it runs.
    pub fn with_irqchip() -> Result<Self, VmError> {
        let vm = Vm::new()?;
        vm.create_irqchip_and_pit()?;
        Ok(vm)
    }

    /// Registers every region of `mem` as a KVM memory slot.
    pub fn register_memory(&self, mem: &GuestMemory) -> Result<(), VmError> {
        for (slot, region) in mem.iter().enumerate() {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|_| VmError::NoHostAddress)?;
            let region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the region is a live mapping owned by `mem`, which the
            // caller keeps alive for as long as the VM exists.
            unsafe { self.fd.set_user_memory_region(region) }
                .map_err(|e| VmError::Kvm("SET_USER_MEMORY_REGION", e))?;
        }
        Ok(())
    }

    /// Creates the in-kernel PIC, IOAPIC and LAPICs, and the PIT.
    pub fn create_irqchip_and_pit(&self) -> Result<(), VmError> {
        self.fd
            .create_irq_chip()
            .map_err(|e| VmError::Kvm("CREATE_IRQCHIP", e))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.fd
            .create_pit2(pit)
            .map_err(|e| VmError::Kvm("CREATE_PIT2", e))?;
        self.discard_lost_pit_ticks()
    }

    /// Turns off KVM's re-injection of PIT ticks the guest missed: a guest
    /// that ticks from the PIT and falls behind (its vCPU descheduled on a
    /// busy host) otherwise gets the missed ticks back to back as fast as it
    /// acknowledges them, and does nothing else. Linux keeps time from its
    /// clocksource, not by counting ticks, so a lost tick costs it nothing
    /// (QEMU's `lost_tick_policy=discard`). Seen in the lab: a booting guest
    /// taking PIT interrupts every millisecond for minutes.
    fn discard_lost_pit_ticks(&self) -> Result<(), VmError> {
        vmm_sys_util::ioctl_io_nr!(KVM_REINJECT_CONTROL, KVMIO, 0x71);
        let control = kvm_reinject_control {
            pit_reinject: 0,
            ..Default::default()
        };
        // SAFETY: KVM_REINJECT_CONTROL reads one kvm_reinject_control, which
        // lives on this stack for the call, from a VM fd we own.
        let ret = unsafe {
            vmm_sys_util::ioctl::ioctl_with_ref(&self.fd, KVM_REINJECT_CONTROL(), &control)
        };
        if ret < 0 {
            return Err(VmError::Kvm(
                "REINJECT_CONTROL",
                vmm_sys_util::errno::Error::last(),
            ));
        }
        Ok(())
    }

    /// Captures the interrupt controllers, PIT and clock; the vCPUs must be paused.
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let chip = |id| {
            let mut chip = irqchip(id);
            self.fd
                .get_irqchip(&mut chip)
                .map_err(|e| VmError::Kvm("GET_IRQCHIP", e))?;
            Ok::<_, VmError>(chip)
        };
        Ok(VmState {
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
            pit: self
                .fd
                .get_pit2()
                .map_err(|e| VmError::Kvm("GET_PIT2", e))?,
            clock: self
                .fd
                .get_clock()
                .map_err(|e| VmError::Kvm("GET_CLOCK", e))?,
        })
    }

    /// Loads a saved state into this VM, after `create_irqchip_and_pit`. With
    /// `advance_clock`, the guest clock moves on by the wall time that passed
    /// since the save; otherwise it continues where it stopped (the guest agent
    /// then sets the wall clock, and guest timers do not all fire at once).
    pub fn restore_state(&self, state: &VmState, advance_clock: bool) -> Result<(), VmError> {
        self.fd
            .set_pit2(&state.pit)
            .map_err(|e| VmError::Kvm("SET_PIT2", e))?;
        let mut clock = state.clock;
        clock.flags = if advance_clock {
            state.clock.flags & KVM_CLOCK_REALTIME
        } else {
            0
        };
        self.fd
            .set_clock(&clock)
            .map_err(|e| VmError::Kvm("SET_CLOCK", e))?;
        for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
            self.fd
                .set_irqchip(chip)
                .map_err(|e| VmError::Kvm("SET_IRQCHIP", e))?;
        }
        Ok(())
    }

    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// What this host's KVM can offer a guest (`KVM_GET_SUPPORTED_CPUID`).
    pub fn supported_cpuid(&self) -> Result<CpuId, VmError> {
        supported_cpuid(&self.kvm)
    }
}

/// `KVM_GET_SUPPORTED_CPUID` of `kvm`.
pub fn supported_cpuid(kvm: &Kvm) -> Result<CpuId, VmError> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| VmError::Kvm("GET_SUPPORTED_CPUID", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_gets_its_interrupt_controllers_and_a_pit_that_drops_lost_ticks() {
        if !std::path::Path::new("/dev/kvm").exists() {
            eprintln!("no /dev/kvm: skipped");
            return;
        }
        let vm = Vm::new().unwrap();
        vm.create_irqchip_and_pit().unwrap();
        // A wrong ioctl number or argument would fail here (ENOTTY, EINVAL).
        vm.discard_lost_pit_ticks().unwrap();
    }
}
