//! The Linux x86 boot protocol's zero page: setup header fields and the e820
//! memory map, written where the kernel's 64-bit entry expects them.

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use vm_memory::GuestAddress;

use super::layout::{
    CMDLINE_START, EBDA_START, FIRST_ADDR_PAST_32BITS, HIMEM_START, MMIO_GAP_START, ZERO_PAGE_START,
};
use crate::vstate::memory::GuestMemory;

const E820_RAM: u32 = 1;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;

#[derive(Debug, thiserror::Error)]
pub enum BootParamsError {
    #[error("too many e820 entries")]
    TooManyE820Entries,
    #[error("writing the zero page: {0}")]
    Write(#[from] linux_loader::configurator::Error),
}

fn add_e820_entry(params: &mut boot_params, addr: u64, size: u64) -> Result<(), BootParamsError> {
    let index = params.e820_entries as usize;
    if index >= params.e820_table.len() {
        return Err(BootParamsError::TooManyE820Entries);
    }
    params.e820_table[index] = boot_e820_entry {
        addr,
        size,
        r#type: E820_RAM,
    };
    params.e820_entries += 1;
    Ok(())
}

/// Writes the zero page for a kernel whose command line of `cmdline_size`
/// bytes (NUL included) sits at [`CMDLINE_START`].
pub fn write_zero_page(
    mem: &GuestMemory,
    mem_size: u64,
    cmdline_size: usize,
) -> Result<(), BootParamsError> {
    let mut params = boot_params::default();
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_size as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;

    add_e820_entry(&mut params, 0, EBDA_START)?;
    if mem_size <= MMIO_GAP_START {
        add_e820_entry(&mut params, HIMEM_START, mem_size - HIMEM_START)?;
    } else {
        add_e820_entry(&mut params, HIMEM_START, MMIO_GAP_START - HIMEM_START)?;
        add_e820_entry(
            &mut params,
            FIRST_ADDR_PAST_32BITS,
            mem_size - MMIO_GAP_START,
        )?;
    }

    let boot = BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE_START));
    LinuxBootConfigurator::write_bootparams::<GuestMemory>(&boot, mem)?;
    Ok(())
}
