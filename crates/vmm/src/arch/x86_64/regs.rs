//! Initial vCPU register state for the Linux 64-bit boot protocol: long mode
//! with an identity map of the first GiB, the boot GDT loaded, and `rsi`
//! pointing at the zero page.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use super::gdt::{BOOT_GDT, kvm_segment_from_gdt};
use super::layout::{
    BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER, PDE_START, PDPTE_START, PML4_START,
    ZERO_PAGE_START,
};
use crate::vstate::memory::GuestMemory;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;
/// Page table entry flags: present, writable; PS marks a 2 MiB page.
const PTE_PRESENT_RW: u64 = 0x3;
const PTE_PAGE_SIZE: u64 = 0x80;

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("writing boot tables to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("KVM vCPU ioctl {0} failed: {1}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
}

/// General purpose registers of the boot vCPU.
pub fn setup_regs(vcpu: &VcpuFd, entry: u64) -> Result<(), RegsError> {
    let regs = kvm_regs {
        rflags: 0x2, // bit 1 is reserved and always set
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    };
    vcpu.set_regs(&regs)
        .map_err(|e| RegsError::Kvm("SET_REGS", e))
}

/// x87 and SSE control words as after FINIT, so the kernel starts from a sane FPU.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(|e| RegsError::Kvm("SET_FPU", e))
}

/// Writes the boot GDT, IDT and identity page tables into guest memory. Done
/// once per VM; every vCPU's special registers point at them.
pub fn write_boot_tables(mem: &GuestMemory) -> Result<(), RegsError> {
    for (index, entry) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(BOOT_GDT_START + 8 * index as u64))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))?;

    mem.write_obj(PDPTE_START | PTE_PRESENT_RW, GuestAddress(PML4_START))?;
    mem.write_obj(PDE_START | PTE_PRESENT_RW, GuestAddress(PDPTE_START))?;
    for i in 0..512u64 {
        mem.write_obj(
            (i << 21) | PTE_PRESENT_RW | PTE_PAGE_SIZE,
            GuestAddress(PDE_START + i * 8),
        )?;
    }
    Ok(())
}

/// Special registers: long mode, paging on the identity map, flat segments.
pub fn setup_sregs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut sregs: kvm_sregs = vcpu
        .get_sregs()
        .map_err(|e| RegsError::Kvm("GET_SREGS", e))?;

    let code = kvm_segment_from_gdt(BOOT_GDT[1], 1);
    let data = kvm_segment_from_gdt(BOOT_GDT[2], 2);
    let tss = kvm_segment_from_gdt(BOOT_GDT[3], 3);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&BOOT_GDT) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = (std::mem::size_of::<u64>() - 1) as u16;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;

    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.efer |= EFER_LME | EFER_LMA;

    vcpu.set_sregs(&sregs)
        .map_err(|e| RegsError::Kvm("SET_SREGS", e))
}

/// Local APIC LVT registers and the delivery modes Linux expects from a PC:
/// LINT0 carries the PIC's ExtINT, LINT1 the NMI.
pub fn setup_lint(vcpu: &VcpuFd) -> Result<(), RegsError> {
    const APIC_LVT0: usize = 0x350;
    const APIC_LVT1: usize = 0x360;
    const APIC_MODE_NMI: u32 = 0x4;
    const APIC_MODE_EXTINT: u32 = 0x7;

    fn get(regs: &[std::os::raw::c_char], offset: usize) -> u32 {
        let bytes: [u8; 4] = std::array::from_fn(|i| regs[offset + i] as u8);
        u32::from_le_bytes(bytes)
    }
    fn set(regs: &mut [std::os::raw::c_char], offset: usize, value: u32) {
        for (i, byte) in value.to_le_bytes().into_iter().enumerate() {
            regs[offset + i] = byte as std::os::raw::c_char;
        }
    }
    fn with_mode(reg: u32, mode: u32) -> u32 {
        (reg & !0x700) | (mode << 8)
    }

    let mut lapic = vcpu
        .get_lapic()
        .map_err(|e| RegsError::Kvm("GET_LAPIC", e))?;
    let lvt0 = get(&lapic.regs, APIC_LVT0);
    set(
        &mut lapic.regs,
        APIC_LVT0,
        with_mode(lvt0, APIC_MODE_EXTINT),
    );
    let lvt1 = get(&lapic.regs, APIC_LVT1);
    set(&mut lapic.regs, APIC_LVT1, with_mode(lvt1, APIC_MODE_NMI));
    vcpu.set_lapic(&lapic)
        .map_err(|e| RegsError::Kvm("SET_LAPIC", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    #[test]
    fn boot_tables_identity_map_the_first_gib() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        write_boot_tables(&mem).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4, PDPTE_START | 0x3);
        let last: u64 = mem.read_obj(GuestAddress(PDE_START + 511 * 8)).unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
        let code: u64 = mem.read_obj(GuestAddress(BOOT_GDT_START + 8)).unwrap();
        assert_eq!(code, BOOT_GDT[1]);
    }
}
