//! The guest physical memory map, as named constants.
//!
//! ```text
//! 0x0000_0500  GDT                    0x0000_9000  PML4 / PDPT / PD (identity map)
//! 0x0000_0520  IDT                    0x0002_0000  kernel command line
//! 0x0000_7000  zero page (boot_params) 0x0009_fc00  MP table (EBDA)
//! 0x0000_8ff0  boot stack pointer     0x0010_0000  kernel, then RAM
//! 0xd000_0000  virtio-mmio devices .. 0xfec0_0000 IOAPIC, 0xfee0_0000 LAPIC
//! 0x1_0000_0000 RAM above the 32-bit gap
//! ```

/// Global descriptor table.
pub const BOOT_GDT_START: u64 = 0x500;
/// Interrupt descriptor table (empty: the kernel installs its own).
pub const BOOT_IDT_START: u64 = 0x520;
/// The Linux zero page (`struct boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page-map level 4 table of the boot identity map.
pub const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table of the boot identity map.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory of the boot identity map (2 MiB pages, first 1 GiB).
pub const PDE_START: u64 = 0xb000;
/// The kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Linux x86's COMMAND_LINE_SIZE, including the terminating NUL.
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area, where the MP table lives; RAM below it
/// is the only low memory the guest is told about.
pub const EBDA_START: u64 = 0x9fc00;
/// The kernel is loaded at or above 1 MiB.
pub const HIMEM_START: u64 = 0x10_0000;

/// Start of the 32-bit MMIO gap: RAM never overlaps [MMIO_GAP_START, 4 GiB).
pub const MMIO_GAP_START: u64 = 0xd000_0000;
/// First address past the 32-bit address space.
pub const FIRST_ADDR_PAST_32BITS: u64 = 1 << 32;
/// virtio-mmio device windows are allocated from here, one page each.
pub const MMIO_DEVICES_START: u64 = MMIO_GAP_START;
/// Size of one virtio-mmio device window.
pub const MMIO_DEVICE_SIZE: u64 = 0x1000;
/// How many virtio-mmio windows fit before the IOAPIC.
pub const MMIO_DEVICES_MAX: u64 = 256;

/// The IOAPIC's MMIO base.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// The local APIC's MMIO base.
pub const APIC_START: u64 = 0xfee0_0000;
/// KVM's three-page TSS region (required on Intel; harmless elsewhere).
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;

/// The first interrupt line handed to virtio devices: 0-4 belong to the PIT,
/// the keyboard controller, the cascade and the serial ports.
pub const IRQ_BASE: u32 = 5;
/// The last IOAPIC pin.
pub const IRQ_MAX: u32 = 23;

/// The legacy serial console (COM1) port and line.
pub const SERIAL_PORT: u16 = 0x3f8;
pub const SERIAL_IRQ: u32 = 4;
/// The i8042 keyboard controller's ports and line.
pub const I8042_DATA_PORT: u16 = 0x60;
pub const I8042_COMMAND_PORT: u16 = 0x64;
pub const I8042_IRQ: u32 = 1;

/// Guest RAM ranges for `mem_size` bytes, split around the 32-bit MMIO gap.
pub fn ram_ranges(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_GAP_START {
        vec![(0, mem_size)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (FIRST_ADDR_PAST_32BITS, mem_size - MMIO_GAP_START),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_memory_is_one_range() {
        assert_eq!(ram_ranges(128 << 20), vec![(0, 128 << 20)]);
    }

    #[test]
    fn large_memory_skips_the_mmio_gap() {
        let ranges = ram_ranges(4 << 30);
        assert_eq!(ranges[0], (0, MMIO_GAP_START));
        assert_eq!(ranges[1].0, FIRST_ADDR_PAST_32BITS);
        assert_eq!(ranges[0].1 + ranges[1].1, 4 << 30);
    }
}
