//! Which pages of a file a process has in its page tables: the ranges of the
//! file (by offset) that process `pid` maps and has touched, from
//! `/proc/<pid>/maps` and `/proc/<pid>/pagemap`. For a VMM restored from a
//! memory file, these are the guest pages its vCPUs and devices reached: its
//! working set (read pages map the page cache, written ones a private copy;
//! both are present, and the written ones are told apart: a restore can then
//! populate them for writing, since a page populated for reading still
//! takes a copy-on-write fault when the guest writes it).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

const PAGE_SIZE: u64 = 4096;
const ENTRY_SIZE: u64 = 8;
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
/// A page-cache (or shared) page: absent on a private copy.
const FILE_OR_SHARED: u64 = 1 << 61;
/// Entries read per pagemap read (512 KiB of entries: 256 MiB of memory).
const ENTRIES_PER_READ: u64 = 64 * 1024;

/// One mapping of a `/proc/<pid>/maps` line: its addresses and the file
/// offset it starts at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
}

/// A file as `maps` names it: its device (major, minor) and inode. Not its
/// path: a process in another mount namespace (a jailed VMM, whose root is
/// its own) shows the path as its namespace has it, which need not be the
/// reader's (measured in the lab: `/host/tmp/...` for the node's `/tmp/...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    pub major: u64,
    pub minor: u64,
    pub inode: u64,
}

impl FileId {
    pub fn of(path: &Path) -> io::Result<FileId> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        let dev = meta.dev();
        // Linux's encoding of a device number (glibc's gnu_dev_major/minor).
        Ok(FileId {
            major: ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff),
            minor: ((dev >> 12) & 0xffff_ff00) | (dev & 0xff),
            inode: meta.ino(),
        })
    }

    /// From a `maps` line's device (`major:minor`, hex) and inode fields.
    fn parse(dev: &str, inode: &str) -> Option<FileId> {
        let (major, minor) = dev.split_once(':')?;
        Some(FileId {
            major: u64::from_str_radix(major, 16).ok()?,
            minor: u64::from_str_radix(minor, 16).ok()?,
            inode: inode.parse().ok()?,
        })
    }
}

/// The mappings of file `file` in a `maps` text.
pub fn mappings_of(maps: &str, file: FileId) -> Vec<Mapping> {
    maps.lines()
        .filter_map(|line| {
            let mut fields = line.split_ascii_whitespace();
            let range = fields.next()?;
            let _perms = fields.next()?;
            let offset = fields.next()?;
            let (dev, inode) = (fields.next()?, fields.next()?);
            if FileId::parse(dev, inode)? != file {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                offset: u64::from_str_radix(offset, 16).ok()?,
            })
        })
        .collect()
}

/// The pages of a file a process has in its mappings of it: byte ranges
/// `[start, end)` of the file, sorted and merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resident {
    /// Every page present (or swapped).
    pub present: Vec<(u64, u64)>,
    /// Those of them that are private copies: pages the process wrote
    /// through a private mapping.
    pub written: Vec<(u64, u64)>,
}

/// The pages of file `path` that process `pid` has in its mappings of it.
pub fn resident_file_ranges(pid: u32, path: &Path) -> io::Result<Resident> {
    let file = FileId::of(path)?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))?;
    let mut resident = Resident::default();
    for m in mappings_of(&maps, file) {
        present_pages(&pagemap, m, &mut resident)?;
    }
    resident.present.sort_unstable();
    resident.written.sort_unstable();
    Ok(Resident {
        present: merge(resident.present),
        written: merge(resident.written),
    })
}

/// Appends `start`'s page to `ranges`, joining it to the last range.
fn push_page(ranges: &mut Vec<(u64, u64)>, start: u64) {
    match ranges.last_mut() {
        Some(last) if last.1 == start => last.1 = start + PAGE_SIZE,
        _ => ranges.push((start, start + PAGE_SIZE)),
    }
}

/// Appends the file ranges of `m`'s present pages.
fn present_pages(pagemap: &File, m: Mapping, out: &mut Resident) -> io::Result<()> {
    let first = m.start / PAGE_SIZE;
    let pages = (m.end - m.start) / PAGE_SIZE;
    let mut buf = vec![0u8; (ENTRIES_PER_READ * ENTRY_SIZE) as usize];
    let mut page = 0;
    while page < pages {
        let count = (pages - page).min(ENTRIES_PER_READ);
        let bytes = &mut buf[..(count * ENTRY_SIZE) as usize];
        pagemap.read_exact_at(bytes, (first + page) * ENTRY_SIZE)?;
        for (i, raw) in bytes.chunks_exact(ENTRY_SIZE as usize).enumerate() {
            let entry = u64::from_ne_bytes(raw.try_into().unwrap_or_default());
            if entry & (PRESENT | SWAPPED) == 0 {
                continue;
            }
            let start = m.offset + (page + i as u64) * PAGE_SIZE;
            push_page(&mut out.present, start);
            // A swapped page of a private file mapping is a private copy:
            // page-cache pages are dropped, not swapped.
            if entry & SWAPPED != 0 || entry & FILE_OR_SHARED == 0 {
                push_page(&mut out.written, start);
            }
        }
        page += count;
    }
    Ok(())
}

/// Sorted ranges with touching or overlapping ones joined.
fn merge(sorted: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (start, end) in sorted {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// A process's page faults so far (`/proc/<pid>/stat`, all its threads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    pub minor: u64,
    pub major: u64,
}

impl Faults {
    pub fn of(pid: u32) -> io::Result<Faults> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        Faults::parse(&stat)
            .ok_or_else(|| io::Error::other(format!("/proc/{pid}/stat: unexpected format")))
    }

    /// From a `stat` line: fields 10 (minflt) and 12 (majflt), counted after
    /// the command name, which may hold spaces and parentheses.
    pub fn parse(stat: &str) -> Option<Faults> {
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // After the name: state is field 3, so field N is fields[N - 3].
        Some(Faults {
            minor: fields.get(7)?.parse().ok()?,
            major: fields.get(9)?.parse().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn mappings_of_a_file_are_found_by_its_device_and_inode() {
        let maps = "55d1faaa7000-55d1faaa9000 r--p 00000000 fe:00 247030                     /usr/bin/cat\n\
                    7f0000000000-7f0010000000 rw-p 00200000 00:2a 99   /host/data/templates/base/vm mem\n\
                    7f0020000000-7f0020001000 rw-p 00000000 00:00 0 \n";
        let mem = FileId {
            major: 0,
            minor: 0x2a,
            inode: 99,
        };
        assert_eq!(
            mappings_of(maps, mem),
            vec![Mapping {
                start: 0x7f00_0000_0000,
                end: 0x7f00_1000_0000,
                offset: 0x20_0000
            }]
        );
        let other = FileId { inode: 98, ..mem };
        assert!(mappings_of(maps, other).is_empty());
    }

    #[test]
    fn a_file_is_known_by_the_device_and_inode_maps_gives() {
        let path = std::env::current_exe().unwrap();
        let me = FileId::of(&path).unwrap();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(!mappings_of(&maps, me).is_empty(), "{me:?} not in {maps}");
    }

    #[test]
    fn touched_pages_of_a_mapped_file_are_its_resident_ranges() {
        let dir = std::env::temp_dir().join(format!("resident-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mem");
        let mut file = File::create(&path).unwrap();
        file.write_all(&[7u8; 16 * 4096]).unwrap();
        let file = File::open(&path).unwrap();
        // SAFETY: a fresh private mapping of a file we own,
        // checked for failure, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                16 * 4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let p = p.cast::<u8>();
        // SAFETY: offsets inside the 16-page mapping.
        unsafe {
            std::ptr::read_volatile(p.add(4096));
            std::ptr::read_volatile(p.add(2 * 4096 + 5));
            std::ptr::read_volatile(p.add(9 * 4096));
            std::ptr::write_volatile(p.add(12 * 4096 + 7), 1);
        }
        let resident = resident_file_ranges(std::process::id(), &path).unwrap();
        let ranges = &resident.present;
        // Readahead may map neighbours too; the touched pages are in.
        for page in [1u64, 2, 9, 12] {
            let at = page * 4096;
            assert!(
                ranges.iter().any(|(s, e)| *s <= at && at < *e),
                "page {page} not in {ranges:?}"
            );
        }
        assert!(ranges.iter().all(|(s, e)| s < e && *e <= 16 * 4096));
        // Only the written page is a private copy.
        assert_eq!(resident.written, vec![(12 * 4096, 13 * 4096)]);
        // SAFETY: the mapping made above, used no more.
        unsafe { libc::munmap(p.cast(), 16 * 4096) };
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn faults_are_read_after_the_command_name() {
        let stat =
            "1234 (a (b) c) S 1 1234 1234 0 -1 4194560 5321 0 17 0 3 1 0 0 20 0 1 0 100 1000 10";
        assert_eq!(
            Faults::parse(stat),
            Some(Faults {
                minor: 5321,
                major: 17
            })
        );
        assert_eq!(Faults::parse("garbage"), None);
        let mine = Faults::of(std::process::id()).unwrap();
        assert!(mine.minor > 0);
    }
}
