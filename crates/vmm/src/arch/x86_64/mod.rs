//! x86_64: the guest memory map, boot protocol, CPU setup and MP table.

pub mod boot_params;
pub mod cpuid;
pub mod gdt;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod regs;
