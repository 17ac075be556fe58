//! Prefetching a restored guest's working set: the flat memory ranges its
//! first commands touched (recorded by the node from this process's page
//! tables on an earlier restore of the same snapshot) are populated in the
//! background right after the restore, so the vCPUs find them mapped
//! instead of taking a page fault each. Reads only (`MADV_POPULATE_READ`):
//! a page the guest writes is still copied on its write.

use std::path::Path;

use super::{GuestMemory, GuestRam, MemoryError, Range};

/// `MADV_POPULATE_READ` (Linux 5.14); older kernels answer `EINVAL` and
/// the pages are touched one by one instead.
const MADV_POPULATE_READ: libc::c_int = 22;
const PAGE_SIZE: u64 = 4096;

/// Reads a working-set file: a JSON array of `[start, end)` flat ranges.
pub fn read_ranges(path: &Path) -> Result<Vec<Range>, MemoryError> {
    let text = std::fs::read(path).map_err(super::file_err(path))?;
    serde_json::from_slice(&text)
        .map_err(|e| MemoryError::Layout(format!("working set {}: {e}", path.display())))
}

impl GuestRam {
    /// Populates `ranges` of guest memory on a thread of its own; returns at
    /// once (with the thread, unless it could not start). The thread holds
    /// the memory mappings until it is done.
    pub fn prefetch(&self, ranges: &[Range]) -> Option<std::thread::JoinHandle<()>> {
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
        let mem: GuestMemory = self.mem.clone();
        let spawned = std::thread::Builder::new()
            .name("prefetch".into())
            .spawn(move || {
                // It touches guest memory and logs: a subset of what a
                // device worker may do.
                crate::seccomp::apply_or_exit(crate::seccomp::ThreadKind::Device);
                let started = std::time::Instant::now();
                let bytes: u64 = host.iter().map(|(_, len)| len).sum();
                for (ptr, len) in host {
                    populate(ptr as *mut u8, len);
                }
                tracing::info!(
                    "prefetched {} MiB of the working set in {} ms",
                    bytes >> 20,
                    started.elapsed().as_millis()
                );
                drop(mem);
            });
        spawned
            .map_err(|e| tracing::warn!("prefetch: starting its thread: {e}"))
            .ok()
    }
}

/// Maps `len` bytes at `ptr` (inside guest memory) into the page tables.
fn populate(ptr: *mut u8, len: u64) {
    // SAFETY: `ptr..ptr+len` lies inside a guest memory mapping that the
    // calling thread keeps alive (its GuestMemory clone); madvise only
    // faults pages in for reading and changes no content.
    let r = unsafe { libc::madvise(ptr.cast(), len as usize, MADV_POPULATE_READ) };
    if r == 0 {
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
        let (state, _) = ram
            .snapshot(MemorySnapshotKind::Full, &dir.path().join("mem"))
            .unwrap();
        let restored = GuestRam::restore(&state).unwrap();
        let set = dir.path().join("working-set.json");
        // Unaligned ends are widened to whole pages.
        std::fs::write(&set, b"[[8192, 12289], [1048576, 1052672]]").unwrap();
        let ranges = read_ranges(&set).unwrap();
        restored.prefetch(&ranges).unwrap().join().unwrap();
        let at = |offset| restored.host_range(offset).unwrap().0;
        for page in [2u64, 3, 256] {
            assert!(present(at(page * PAGE_SIZE)), "page {page}");
        }
        // Far from them (a read fault maps the cached pages of its 64 KiB
        // around it too), nothing.
        for page in [100u64, 1000, 3000] {
            assert!(!present(at(page * PAGE_SIZE)), "page {page}");
        }
        std::fs::write(&set, b"not json").unwrap();
        assert!(read_ranges(&set).is_err());
    }
}
