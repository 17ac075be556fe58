//! Which pages of a private file mapping this process has written, from
//! `/proc/self/pagemap`. A written page of a `MAP_PRIVATE` file mapping is a
//! private anonymous copy; an unwritten one is absent or a page-cache page.
//! This sees writes by vCPUs and by device threads alike, without KVM dirty
//! logging (which write-protects guest memory and costs a fault per page).

use std::fs::File;
use std::os::unix::fs::FileExt;

use super::file_ranges::Range;

const PAGE_SIZE: u64 = 4096;
const ENTRY_SIZE: u64 = 8;
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
/// The page is a page-cache or shared-anonymous page (not a private copy).
const FILE_OR_SHARED: u64 = 1 << 61;
/// Entries read per pagemap read: 512 KiB covers 256 MiB of memory.
const ENTRIES_PER_READ: usize = 64 * 1024;

/// Whether a pagemap entry is a page this process owns privately.
fn is_private_copy(entry: u64) -> bool {
    (entry & PRESENT != 0 && entry & FILE_OR_SHARED == 0) || entry & SWAPPED != 0
}

/// The private (written) pages of the mapping at `host` of `len` bytes, as byte
/// ranges relative to `host`, merged where contiguous.
pub fn private_pages(host: *const u8, len: u64) -> std::io::Result<Vec<Range>> {
    let pagemap = File::open("/proc/self/pagemap")?;
    let first_page = host as u64 / PAGE_SIZE;
    let pages = len.div_ceil(PAGE_SIZE);
    let mut ranges: Vec<Range> = Vec::new();
    let mut buf = vec![0u8; ENTRIES_PER_READ * ENTRY_SIZE as usize];
    let mut page = 0;
    while page < pages {
        let count = (pages - page).min(ENTRIES_PER_READ as u64);
        let bytes = &mut buf[..(count * ENTRY_SIZE) as usize];
        pagemap.read_exact_at(bytes, (first_page + page) * ENTRY_SIZE)?;
        for (i, raw) in bytes.chunks_exact(ENTRY_SIZE as usize).enumerate() {
            let entry = u64::from_ne_bytes(raw.try_into().unwrap_or_default());
            if !is_private_copy(entry) {
                continue;
            }
            let start = (page + i as u64) * PAGE_SIZE;
            let end = (start + PAGE_SIZE).min(len);
            match ranges.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => ranges.push((start, end)),
            }
        }
        page += count;
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    /// Maps `pages` pages of `file` privately.
    fn map_private(file: &File, pages: u64) -> *mut u8 {
        // SAFETY: a fresh mapping of a file we own; checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                (pages * PAGE_SIZE) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    #[test]
    fn only_written_pages_of_a_private_file_mapping_count() {
        let file = tempfile::tempfile().unwrap();
        file.write_all_at(&[7u8; 16 * 4096], 0).unwrap();
        let p = map_private(&file, 16);
        // SAFETY: all offsets are inside the 16-page mapping made above.
        unsafe {
            // Reads map page-cache pages: not private.
            assert_eq!(p.add(4096).read_volatile(), 7);
            p.add(3 * 4096).write_volatile(1);
            p.add(4 * 4096 + 100).write_volatile(1);
            p.add(10 * 4096).write_volatile(1);
        }
        let dirty = private_pages(p, 16 * PAGE_SIZE).unwrap();
        assert_eq!(dirty, vec![(3 * 4096, 5 * 4096), (10 * 4096, 11 * 4096)]);
        // SAFETY: unmapping the mapping made above, used no more.
        unsafe { libc::munmap(p.cast(), (16 * PAGE_SIZE) as usize) };
    }
}
