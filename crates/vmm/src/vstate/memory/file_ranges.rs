//! Byte ranges: which parts of a file hold data, and set arithmetic on them.

use std::fs::File;
use std::os::fd::AsRawFd;

/// A half-open byte range `[start, end)`.
pub type Range = (u64, u64);

/// The ranges of `file` within `[from, to)` that hold data, by `SEEK_DATA` and
/// `SEEK_HOLE` (a tmpfs or memfd page never touched is a hole).
pub fn data_ranges(file: &File, from: u64, to: u64) -> std::io::Result<Vec<Range>> {
    let fd = file.as_raw_fd();
    let mut ranges = Vec::new();
    let mut at = from;
    while at < to {
        // SAFETY: lseek on a descriptor we own; no memory is involved.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            // ENXIO: no data past `at`.
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(e);
        }
        let data = data as u64;
        if data >= to {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let end = (hole as u64).min(to);
        ranges.push((data, end));
        at = end;
    }
    Ok(ranges)
}

/// The sorted union of two sorted lists of ranges, merging touching ones.
pub fn union(a: &[Range], b: &[Range]) -> Vec<Range> {
    let mut all: Vec<Range> = a.iter().chain(b).copied().filter(|r| r.0 < r.1).collect();
    all.sort_unstable();
    let mut out: Vec<Range> = Vec::with_capacity(all.len());
    for (start, end) in all {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// Total bytes in a list of ranges.
pub fn total(ranges: &[Range]) -> u64 {
    ranges.iter().map(|(s, e)| e - s).sum()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    #[test]
    fn union_merges_overlapping_and_touching_ranges() {
        assert_eq!(
            union(
                &[(0, 10), (20, 30)],
                &[(5, 12), (30, 40), (50, 50), (60, 70)]
            ),
            vec![(0, 12), (20, 40), (60, 70)]
        );
        assert_eq!(union(&[], &[]), vec![]);
        assert_eq!(total(&[(0, 10), (20, 25)]), 15);
    }

    #[test]
    fn data_ranges_finds_written_blocks_of_a_sparse_file() {
        let f = tempfile::tempfile().unwrap();
        let mib = 1 << 20;
        f.set_len(16 * mib).unwrap();
        f.write_all_at(&[1u8; 4096], 2 * mib).unwrap();
        f.write_all_at(&[1u8; 4096], 9 * mib).unwrap();
        let ranges = data_ranges(&f, 0, 16 * mib).unwrap();
        // Filesystems allocate in blocks of their own size; each write must be
        // covered and the untouched bulk must not.
        assert!(
            ranges
                .iter()
                .any(|&(s, e)| s <= 2 * mib && e >= 2 * mib + 4096)
        );
        assert!(
            ranges
                .iter()
                .any(|&(s, e)| s <= 9 * mib && e >= 9 * mib + 4096)
        );
        assert!(total(&ranges) < 4 * mib, "{ranges:?}");
        // A window clips the ranges.
        let clipped = data_ranges(&f, 8 * mib, 16 * mib).unwrap();
        assert!(clipped.iter().all(|&(s, e)| s >= 8 * mib && e <= 16 * mib));
        assert_eq!(data_ranges(&f, 10 * mib, 16 * mib).unwrap(), vec![]);
    }
}
