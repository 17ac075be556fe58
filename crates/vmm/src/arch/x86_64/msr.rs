//! Model-specific registers a vCPU starts with.

use kvm_bindings::{Msrs, kvm_msr_entry};

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;

const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back: without this Linux maps all
/// memory uncached and boots very slowly.
const MTRR_ENABLE_WRITEBACK: u64 = (1 << 11) | 6;

/// The MSR values of a vCPU at boot.
pub fn boot_msrs() -> Result<Msrs, vmm_sys_util::fam::Error> {
    let entry = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    Msrs::from_entries(&[
        entry(MSR_IA32_SYSENTER_CS, 0),
        entry(MSR_IA32_SYSENTER_ESP, 0),
        entry(MSR_IA32_SYSENTER_EIP, 0),
        entry(MSR_STAR, 0),
        entry(MSR_CSTAR, 0),
        entry(MSR_KERNEL_GS_BASE, 0),
        entry(MSR_SYSCALL_MASK, 0),
        entry(MSR_LSTAR, 0),
        entry(MSR_IA32_TSC, 0),
        entry(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        entry(MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WRITEBACK),
    ])
}
