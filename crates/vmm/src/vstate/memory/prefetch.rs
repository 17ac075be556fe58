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
    /// once. The thread holds the memory mappings until it is done.
    pub fn prefetch(&self, ranges: &[Range]) {
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
        if let Err(e) = spawned {
            tracing::warn!("prefetch: starting its thread: {e}");
        }
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
