//! Guest physical memory, backed by a memfd so that later work can snapshot it
//! and share it copy-on-write between VMs.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{FileOffset, GuestAddress};

use crate::arch::x86_64::layout::ram_ranges;

/// Guest memory as every part of the VMM sees it.
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("creating the guest memory file: {0}")]
    Memfd(#[source] std::io::Error),
    #[error("sizing the guest memory file to {size} bytes: {source}")]
    Resize {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("mapping guest memory: {0}")]
    Map(#[from] vm_memory::mmap::FromRangesError),
}

/// Allocates `size` bytes of guest RAM in one memfd, mapped shared.
pub fn create_guest_memory(size: u64) -> Result<GuestMemory, MemoryError> {
    const NAME: &CStr = c"sandfork-guest-mem";
    // SAFETY: the name is a valid NUL-terminated string; the returned fd is
    // checked before use and owned by the File below.
    let fd = unsafe { libc::memfd_create(NAME.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a freshly created, valid descriptor nobody else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|source| MemoryError::Resize { size, source })?;

    let mut offset = 0;
    let mut ranges = Vec::new();
    for (start, len) in ram_ranges(size) {
        let file_offset = FileOffset::new(file.try_clone().map_err(MemoryError::Memfd)?, offset);
        ranges.push((GuestAddress(start), len as usize, Some(file_offset)));
        offset += len;
    }
    Ok(GuestMemory::from_ranges_with_files(ranges)?)
}
