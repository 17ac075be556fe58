//! The KVM VM: memory slots, the in-kernel interrupt controllers and PIT.

use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VmFd};
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

/// A KVM VM with its memory registered and its interrupt controllers created.
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
            .map_err(|e| VmError::Kvm("CREATE_PIT2", e))
    }

    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }
}
