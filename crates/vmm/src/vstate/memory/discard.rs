//! Giving guest pages back to the host: the pages a guest put in its balloon
//! or reported free. Their contents are the guest's to lose.
//!
//! What frees a page depends on how it is mapped now, and a snapshot changes
//! that under a running VM (memfd first, the snapshot's file after):
//!
//! - a booted VM's memfd, mapped shared: `MADV_REMOVE` punches the page out of
//!   the memfd (as `fallocate(PUNCH_HOLE)` would); it reads as zeros after.
//! - a snapshot's file, mapped privately: the kernel refuses `MADV_REMOVE`
//!   there, and `MADV_DONTNEED` drops the VM's private copy. The page then
//!   reads the file again: the template's bytes, not zeros. For these pages
//!   that is right: a free or ballooned page's contents mean nothing to the
//!   guest (the driver only reports pages when it does not poison or zero
//!   free pages, and we offer no `PAGE_POISON`), and the page comes back as a
//!   page-cache page every VM of that snapshot shares, so the private copy is
//!   what is freed. It also keeps snapshots right: the page is no longer
//!   private, so a diff snapshot does not write it and a restore reads the
//!   same file bytes the VM would.
//!
//! Trying `MADV_REMOVE` first and falling back reads the mapping as it is at
//! the moment of the call, without the device tracking snapshots.

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use super::GuestMemory;

const PAGE: u64 = 4096;

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum DiscardError {
    #[error("guest range {start:#x}+{len:#x} is not in guest RAM")]
    NotRam { start: u64, len: u64 },
    #[error("releasing guest range {start:#x}+{len:#x}: {errno}")]
    Madvise { start: u64, len: u64, errno: i32 },
}

/// Returns the whole pages of guest range `[start, start + len)` to the host
/// (a partial page at either end is kept). Returns the bytes released; stops
/// at the first part that is not RAM.
pub fn discard(mem: &GuestMemory, start: u64, len: u64) -> Result<u64, DiscardError> {
    let Some(end) = start.checked_add(len) else {
        return Err(DiscardError::NotRam { start, len });
    };
    let mut at = start.next_multiple_of(PAGE);
    let end = end - end % PAGE;
    let mut released = 0;
    while at < end {
        let not_ram = DiscardError::NotRam {
            start: at,
            len: end - at,
        };
        let region = mem.find_region(GuestAddress(at)).ok_or(not_ram.clone())?;
        let offset = at - region.start_addr().0;
        let n = (end - at).min(region.len() - offset);
        let host = region
            .get_host_address(MemoryRegionAddress(offset))
            .map_err(|_| not_ram)?;
        release(host, n as usize).map_err(|errno| DiscardError::Madvise {
            start: at,
            len: n,
            errno,
        })?;
        released += n;
        at += n;
    }
    Ok(released)
}

/// `MADV_REMOVE` for a shared mapping, `MADV_DONTNEED` for a private one.
fn release(host: *mut u8, len: usize) -> Result<(), i32> {
    let advise = |advice| {
        // SAFETY: `host..host+len` is inside one guest memory mapping that
        // lives as long as the GuestMemory it came from; neither advice
        // changes the mapping, only what backs its pages, and the guest
        // gave these pages up.
        if unsafe { libc::madvise(host.cast(), len, advice) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        }
    };
    match advise(libc::MADV_REMOVE) {
        // EACCES: a private file mapping; EINVAL: anonymous memory (tests).
        Err(libc::EACCES | libc::EINVAL) => advise(libc::MADV_DONTNEED),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use vm_memory::Bytes;

    use super::super::{GuestRam, MemorySnapshotKind};
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Bytes of the memfd that hold data (tmpfs allocates per page).
    fn memfd_bytes(ram: &GuestRam) -> u64 {
        let super::super::Backing::Memfd(file) = &ram.backing else {
            panic!("not memfd-backed");
        };
        super::super::file_ranges::total(
            &super::super::file_ranges::data_ranges(file, 0, ram.size()).unwrap(),
        )
    }

    #[test]
    fn a_booted_vm_gives_pages_back_to_the_host_and_reads_zeros() {
        let ram = GuestRam::new(8 * MIB).unwrap();
        let mem = ram.guest_memory();
        mem.write_slice(&vec![7u8; 4 * MIB as usize], GuestAddress(MIB))
            .unwrap();
        assert!(memfd_bytes(&ram) >= 4 * MIB);
        // Partial pages at the ends are kept.
        let released = discard(mem, MIB - 100, 2 * MIB + 200).unwrap();
        assert_eq!(released, 2 * MIB);
        assert!(memfd_bytes(&ram) <= 2 * MIB + 8192, "{}", memfd_bytes(&ram));
        let mut page = [1u8; 4096];
        mem.read_slice(&mut page, GuestAddress(MIB + 4096)).unwrap();
        assert_eq!(page, [0u8; 4096]);
        mem.read_slice(&mut page, GuestAddress(3 * MIB)).unwrap();
        assert_eq!(page, [7u8; 4096]);
    }

    #[test]
    fn a_restored_vm_drops_its_private_copies_and_reads_the_file_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = GuestRam::new(8 * MIB).unwrap();
        ram.guest_memory()
            .write_slice(&[5u8; 4096], GuestAddress(MIB))
            .unwrap();
        let path = dir.path().join("mem");
        let (state, _) = ram.snapshot(MemorySnapshotKind::Full, &path).unwrap();
        drop(ram);
        let ram = GuestRam::restore(&state).unwrap();
        let mem = ram.guest_memory();
        mem.write_slice(&[9u8; 4096], GuestAddress(MIB)).unwrap();
        assert_eq!(ram.written_ranges().unwrap(), vec![(MIB, MIB + 4096)]);
        assert_eq!(discard(mem, MIB, 4096).unwrap(), 4096);
        // The private copy is gone: the page reads the file, and a diff
        // snapshot has nothing to write.
        let mut page = [0u8; 4096];
        mem.read_slice(&mut page, GuestAddress(MIB)).unwrap();
        assert_eq!(page, [5u8; 4096]);
        assert_eq!(ram.written_ranges().unwrap(), vec![]);
        let mut file_page = [0u8; 4096];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut file_page, MIB)
            .unwrap();
        assert_eq!(file_page, [5u8; 4096]);
    }

    #[test]
    fn ranges_outside_ram_are_refused() {
        let ram = GuestRam::new(8 * MIB).unwrap();
        let mem = ram.guest_memory();
        assert!(matches!(
            discard(mem, 16 * MIB, 4096),
            Err(DiscardError::NotRam { .. })
        ));
        assert!(matches!(
            discard(mem, u64::MAX - 10, 4096),
            Err(DiscardError::NotRam { .. })
        ));
        // A range running off the end releases what is RAM, then stops.
        assert!(matches!(
            discard(mem, 8 * MIB - 4096, 8192),
            Err(DiscardError::NotRam { start, .. }) if start == 8 * MIB
        ));
        assert_eq!(discard(mem, 0, 0).unwrap(), 0);
    }
}
