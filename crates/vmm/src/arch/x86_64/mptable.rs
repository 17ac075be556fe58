//! The Intel MultiProcessor Specification 1.4 table that tells Linux how many
//! CPUs there are and how the ISA interrupt lines reach the IOAPIC. With no
//! ACPI in the guest, this is how SMP guests find their vCPUs.

use vm_memory::{Bytes, GuestAddress};

use super::layout::{APIC_START, EBDA_START, IOAPIC_START, IRQ_MAX};
use crate::vstate::memory::GuestMemory;

const MPC_SPEC_1_4: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
/// Family 6, model 0: any value is fine, Linux reads CPUID for the real one.
const CPU_SIGNATURE: u32 = 0x600;
/// FPU and APIC present.
const CPU_FEATURES: u32 = 0x201;

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_INTSRC: u8 = 3;
const ENTRY_LINTSRC: u8 = 4;

const IRQ_TYPE_INT: u8 = 0;
const IRQ_TYPE_NMI: u8 = 1;
const IRQ_TYPE_EXTINT: u8 = 3;
/// Polarity and trigger mode conform to the bus (ISA: active high, edge).
const IRQ_FLAG_DEFAULT: u16 = 0;

/// The largest vCPU count whose table fits in the EBDA, below 640 KiB.
pub const MAX_CPUS: u8 = 32;

#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("{0} vCPUs do not fit an MP table (at most {MAX_CPUS})")]
    TooManyCpus(u8),
    #[error("the MP table does not fit below 640 KiB")]
    TooLarge,
    #[error("writing the MP table: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |sum, b| sum.wrapping_sub(*b))
}

/// Builds the configuration table (header and entries) for `cpus` vCPUs.
fn config_table(cpus: u8) -> Vec<u8> {
    let ioapic_id = cpus + 1;
    let mut entries = Vec::new();
    let mut count: u16 = 0;

    for cpu in 0..cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 };
        entries.extend_from_slice(&[ENTRY_PROCESSOR, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;
    for irq in 0..=IRQ_MAX as u8 {
        entries.extend_from_slice(&[ENTRY_INTSRC, IRQ_TYPE_INT]);
        entries.extend_from_slice(&IRQ_FLAG_DEFAULT.to_le_bytes());
        entries.extend_from_slice(&[0, irq, ioapic_id, irq]);
        count += 1;
    }
    for (irq_type, dest_apic, lint) in [(IRQ_TYPE_EXTINT, 0, 0), (IRQ_TYPE_NMI, 0xff, 1)] {
        entries.extend_from_slice(&[ENTRY_LINTSRC, irq_type]);
        entries.extend_from_slice(&IRQ_FLAG_DEFAULT.to_le_bytes());
        entries.extend_from_slice(&[0, 0, dest_apic, lint]);
        count += 1;
    }

    let length = (44 + entries.len()) as u16;
    let mut table = Vec::with_capacity(length as usize);
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&length.to_le_bytes());
    table.push(MPC_SPEC_1_4);
    table.push(0); // checksum, below
    table.extend_from_slice(b"SANDFORK");
    table.extend_from_slice(b"000000000000");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    table.extend_from_slice(&[0; 4]); // extended table length, checksum, reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);
    table
}

/// The 16-byte floating pointer structure Linux scans for.
fn floating_pointer(table_addr: u32) -> [u8; 16] {
    let mut mpf = [0u8; 16];
    mpf[0..4].copy_from_slice(b"_MP_");
    mpf[4..8].copy_from_slice(&table_addr.to_le_bytes());
    mpf[8] = 1; // length in 16-byte units
    mpf[9] = MPC_SPEC_1_4;
    mpf[10] = checksum(&mpf);
    mpf
}

/// Writes the MP floating pointer and configuration table at [`EBDA_START`].
pub fn setup_mptable(mem: &GuestMemory, cpus: u8) -> Result<(), MpTableError> {
    if cpus == 0 || cpus > MAX_CPUS {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let table_addr = EBDA_START + 16;
    let table = config_table(cpus);
    if table_addr + table.len() as u64 > 0xa0000 {
        return Err(MpTableError::TooLarge);
    }
    mem.write_slice(
        &floating_pointer(table_addr as u32),
        GuestAddress(EBDA_START),
    )?;
    mem.write_slice(&table, GuestAddress(table_addr))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums_to_zero(bytes: &[u8]) -> bool {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b)) == 0
    }

    #[test]
    fn table_checksums_and_counts() {
        let table = config_table(4);
        assert!(sums_to_zero(&table));
        assert_eq!(
            u16::from_le_bytes([table[4], table[5]]) as usize,
            table.len()
        );
        let entries = u16::from_le_bytes([table[34], table[35]]);
        assert_eq!(entries, 4 + 1 + 1 + 24 + 2);
        assert!(sums_to_zero(&floating_pointer(0x9fc10)));
    }

    #[test]
    fn written_where_linux_scans() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        setup_mptable(&mem, 2).unwrap();
        let mut sig = [0u8; 4];
        mem.read_slice(&mut sig, GuestAddress(EBDA_START)).unwrap();
        assert_eq!(&sig, b"_MP_");
    }

    #[test]
    fn rejects_impossible_cpu_counts() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        assert!(setup_mptable(&mem, 0).is_err());
        assert!(setup_mptable(&mem, MAX_CPUS + 1).is_err());
        assert!(setup_mptable(&mem, MAX_CPUS).is_ok());
    }
}
