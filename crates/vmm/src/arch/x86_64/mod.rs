//! x86_64: the guest memory map, boot protocol, CPU setup (CPUID and CPU
//! templates) and MP table.

pub mod boot_params;
pub mod cpu_features;
pub mod cpu_template;
pub mod cpuid;
pub mod gdt;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod regs;
