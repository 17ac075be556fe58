//! Prefetching a restored guest's working set: the flat memory ranges its
//! first commands touched (recorded by the node from this process's page
//! tables on an earlier restore of the same snapshot) are populated in the
//! background right after the restore, so the vCPUs find them mapped
//! instead of taking a page fault each. The pages that were written are
//! populated for writing (`MADV_POPULATE_WRITE`: copied at once, as the
//! guest's write would have): populated for reading, a page of a private
//! mapping is mapped read-only and the guest's first write to it still
//! faults, and those write faults are most of a first command's (read
//! faults map a whole cached 64 KiB around them at once). The rest is
//! populated for reading (`MADV_POPULATE_READ`).

use std::path::Path;

use vmm_api::WorkingSet;

use super::{GuestMemory, GuestRam, MemoryError};

/// `MADV_POPULATE_READ` and `_WRITE` (Linux 5.14); older kernels answer
/// `EINVAL`: read pages are then touched one by one, written ones left to
/// the guest (a write from here could race the guest's own).
const MADV_POPULATE_READ: libc::c_int = 22;
const MADV_POPULATE_WRITE: libc::c_int = 23;
const PAGE_SIZE: u64 = 4096;

/// Reads a working-set file (see [`WorkingSet`]).
pub fn read_ranges(path: &Path) -> Result<WorkingSet, MemoryError> {
    let text = std::fs::read(path).map_err(super::file_err(path))?;
    serde_json::from_slice(&text)
        .map_err(|e| MemoryError::Layout(format!("working set {}: {e}", path.display())))
}

/// Host ranges: address and length.
type HostRanges = Vec<(usize, u64)>;

impl GuestRam {
    /// Populates `set` of guest memory on a thread of its own, its written
    /// pages first; returns at once (with the thread, unless it could not
    /// start). The thread holds the memory mappings until it is done.
    pub fn prefetch(&self, set: &WorkingSet) -> Option<std::thread::JoinHandle<()>> {
        let written = self.host_ranges(&set.written);
        let present = self.host_ranges(&set.present);
        let mem: GuestMemory = self.mem.clone();
        let spawned = std::thread::Builder::new()
            .name("prefetch".into())
            .spawn(move || {
                // It touches guest memory and logs: a subset of what a
                // device worker may do.
                crate::seccomp::apply_or_exit(crate::seccomp::ThreadKind::Device);
                let started = std::time::Instant::now();
                let bytes = |r: &HostRanges| r.iter().map(|(_, len)| len).sum::<u64>();
                for &(ptr, len) in &written {
                    populate(ptr as *mut u8, len, Access::Write);
                }
                let wrote = started.elapsed();
                for &(ptr, len) in &present {
                    populate(ptr as *mut u8, len, Access::Read);
                }
                tracing::info!(
                    "prefetched {} KiB of the working set in {} ms ({} KiB written in {} ms)",
                    bytes(&present) >> 10,
                    started.elapsed().as_millis(),
                    bytes(&written) >> 10,
                    wrote.as_millis()
                );
                drop(mem);
            });
        spawned
            .map_err(|e| tracing::warn!("prefetch: starting its thread: {e}"))
            .ok()
    }

    /// The host ranges of flat `ranges`, widened to whole pages and split at
    /// region ends; what lies outside guest memory is left out.
    fn host_ranges(&self, ranges: &[(u64, u64)]) -> HostRanges {
        let mut host = Vec::new();
        for &(start, end) in ranges {
            let mut at = start - start % PAGE_SIZE;
            while at < end {
                let Some((ptr, left)) = self.host_range(at) else {
                    break;
                };
                let len = left.min(end - at).div_ceil(PAGE_SIZE) * PAGE_SIZE;
                host.push((ptr as usize, len.min(left)));
                at += len;
            }
        }
        host
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

/// Maps `len` bytes at `ptr` (inside guest memory) into the page tables,
/// for reading or writing.
fn populate(ptr: *mut u8, len: u64, access: Access) {
    let advice = match access {
        Access::Read => MADV_POPULATE_READ,
        Access::Write => MADV_POPULATE_WRITE,
    };
    // SAFETY: `ptr..ptr+len` lies inside a guest memory mapping that the
    // calling thread keeps alive (its GuestMemory clone); populating faults
    // pages in (a write populate copies a private page as a write would)
    // and changes no content.
    let r = unsafe { libc::madvise(ptr.cast(), len as usize, advice) };
    if r == 0 || access == Access::Write {
        return;
    }
    let mut at = 0;
    while at < len {
        // SAFETY: inside the same live mapping; a volatile read of one byte
        // per page faults it in without changing it.
        unsafe { std::ptr::read_volatile(ptr.add(at as usize)) };
        at += PAGE_SIZE;
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use vm_memory::{Bytes, GuestAddress};

    use super::super::MemorySnapshotKind;
    use super::*;

    /// Whether the page at `host` is in this process's page tables.
    fn present(host: *const u8) -> bool {
        let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut entry = [0u8; 8];
        pagemap
            .read_exact_at(&mut entry, host as u64 / PAGE_SIZE * 8)
            .unwrap();
        u64::from_ne_bytes(entry) & (1 << 63) != 0
    }

    #[test]
    fn a_working_set_is_populated_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = GuestRam::new(16 << 20).unwrap();
        ram.guest_memory()
            .write_slice(b"kept", GuestAddress(3 * PAGE_SIZE + 8))
            .unwrap();
        let (state, _) = ram
            .snapshot(MemorySnapshotKind::Full, &dir.path().join("mem"))
            .unwrap();
        let restored = GuestRam::restore(&state).unwrap();
        let set = dir.path().join("working-set.json");
        // Unaligned ends are widened to whole pages.
        std::fs::write(
            &set,
            b"{\"present\": [[8192, 12289], [1048576, 1052672]], \"written\": [[12288, 16384]]}",
        )
        .unwrap();
        let ranges = read_ranges(&set).unwrap();
        restored.prefetch(&ranges).unwrap().join().unwrap();
        let at = |offset| restored.host_range(offset).unwrap().0;
        for page in [2u64, 3, 256] {
            assert!(present(at(page * PAGE_SIZE)), "page {page}");
        }
        // The written page is a private copy already, with the file's content.
        assert_eq!(
            restored.written_ranges().unwrap(),
            vec![(3 * PAGE_SIZE, 4 * PAGE_SIZE)]
        );
        let mut kept = [0u8; 4];
        restored
            .guest_memory()
            .read_slice(&mut kept, GuestAddress(3 * PAGE_SIZE + 8))
            .unwrap();
        assert_eq!(&kept, b"kept");
        // Far from them (a read fault maps the cached pages of its 64 KiB
        // around it too), nothing.
        for page in [100u64, 1000, 3000] {
            assert!(!present(at(page * PAGE_SIZE)), "page {page}");
        }
        std::fs::write(&set, b"not json").unwrap();
        assert!(read_ranges(&set).is_err());
    }
}
