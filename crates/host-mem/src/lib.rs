//! The host's memory as `/proc` reports it, read in one place for the node
//! server (admission, its pressure monitor), the lab (its size) and the
//! bench (memory per sandbox): `MemTotal`, `MemAvailable`, the kernel's
//! memory pressure ([`pressure`]) and what a process really uses.
//!
//! A process's real use is its proportional set size (Pss,
//! `/proc/<pid>/smaps_rollup`): its private pages whole plus each shared
//! page divided among the processes mapping it, so the template pages that
//! restored sandboxes and fork children share copy-on-write count once over
//! all of them.

use std::io;

pub mod pressure;
pub mod resident;

/// The host's `MemTotal` in MiB.
pub fn mem_total_mib() -> io::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    parse_mem_total_mib(&text).ok_or_else(|| io::Error::other("no MemTotal line in /proc/meminfo"))
}

/// `MemTotal` of a `/proc/meminfo` text, in MiB (rounded down).
pub fn parse_mem_total_mib(meminfo: &str) -> Option<u64> {
    kib_field(meminfo, "MemTotal:").map(|kib| kib / 1024)
}

/// The host's `MemAvailable` in MiB: what the kernel estimates can be
/// allocated without swapping (free pages plus the reclaimable caches).
pub fn mem_available_mib() -> io::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    parse_mem_available_mib(&text)
        .ok_or_else(|| io::Error::other("no MemAvailable line in /proc/meminfo"))
}

/// `MemAvailable` of a `/proc/meminfo` text, in MiB (rounded down).
pub fn parse_mem_available_mib(meminfo: &str) -> Option<u64> {
    kib_field(meminfo, "MemAvailable:").map(|kib| kib / 1024)
}

/// The value in KiB of the line `name` (with its colon) of a `/proc` text
/// of `Name:   1234 kB` lines. `name` must match the line's whole key:
/// `Pss:` is not `Pss_Anon:`.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// What a process's mappings hold in RAM, in KiB (`smaps_rollup`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Proportional set size: private pages plus a share of shared ones.
    pub pss_kib: u64,
    /// `Private_Clean` plus `Private_Dirty`: the pages no other process maps.
    pub private_kib: u64,
    /// `Shared_Clean` plus `Shared_Dirty`: resident pages other processes map too.
    pub shared_kib: u64,
}

impl ProcessMemory {
    /// Process `pid`'s memory now.
    pub fn of(pid: u32) -> io::Result<ProcessMemory> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))?;
        ProcessMemory::parse(&text)
            .ok_or_else(|| io::Error::other(format!("no Pss line in /proc/{pid}/smaps_rollup")))
    }

    /// From a `smaps_rollup` text; `None` without its `Pss:` line. Absent
    /// private or shared lines are 0 (older kernels omit none of them, but
    /// nothing here depends on it).
    pub fn parse(rollup: &str) -> Option<ProcessMemory> {
        let field = |name| kib_field(rollup, name).unwrap_or(0);
        Some(ProcessMemory {
            pss_kib: kib_field(rollup, "Pss:")?,
            private_kib: field("Private_Clean:") + field("Private_Dirty:"),
            shared_kib: field("Shared_Clean:") + field("Shared_Dirty:"),
        })
    }
}

/// KiB to MiB, rounded up: a process using anything uses something.
pub fn kib_to_mib(kib: u64) -> u64 {
    kib.div_ceil(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_total_is_read_in_mib() {
        let text = "MemFree:  100 kB\nMemTotal:       24592684 kB\n";
        assert_eq!(parse_mem_total_mib(text), Some(24016));
        assert_eq!(parse_mem_total_mib("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total_mib("MemTotal: lots kB\n"), None);
        // The real file agrees with what the kernel says of itself.
        let total = mem_total_mib().unwrap();
        let info = first_line_total_mib();
        assert!(total > 0 && total.abs_diff(info) <= 1, "{total} vs {info}");
    }

    #[test]
    fn mem_available_is_read_in_mib() {
        let text = "MemTotal: 24592684 kB\nMemFree: 1000 kB\nMemAvailable:   2097152 kB\n";
        assert_eq!(parse_mem_available_mib(text), Some(2048));
        assert_eq!(parse_mem_available_mib("MemTotal: 1 kB\n"), None);
        let available = mem_available_mib().unwrap();
        assert!(available > 0 && available <= mem_total_mib().unwrap());
    }

    /// `MemTotal` by another reading of the same file's line, as bytes, so
    /// the test does not check the parser against itself.
    fn first_line_total_mib() -> u64 {
        let text = std::fs::read_to_string("/proc/meminfo").unwrap();
        let line = text.lines().next().unwrap();
        assert!(line.starts_with("MemTotal:"), "{line}");
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap();
        kib / 1024
    }

    #[test]
    fn process_memory_is_read_from_smaps_rollup() {
        let text = "55d0c0000000-7ffd00000000 ---p 00000000 00:00 0  [rollup]\n\
                    Rss:                5120 kB\n\
                    Pss:                3071 kB\n\
                    Pss_Anon:           1000 kB\n\
                    Pss_File:           2071 kB\n\
                    Shared_Clean:       2048 kB\n\
                    Shared_Dirty:          0 kB\n\
                    Private_Clean:      1024 kB\n\
                    Private_Dirty:      2048 kB\n";
        assert_eq!(
            ProcessMemory::parse(text),
            Some(ProcessMemory {
                pss_kib: 3071,
                private_kib: 3072,
                shared_kib: 2048,
            })
        );
        assert_eq!(ProcessMemory::parse("Pss_Anon: 10 kB\n"), None);
        assert_eq!(ProcessMemory::parse("Pss: many kB\n"), None);
        assert_eq!((kib_to_mib(0), kib_to_mib(1), kib_to_mib(2048)), (0, 1, 2));
    }

    #[test]
    fn a_real_process_has_pss_between_its_private_and_resident_memory() {
        // This very process: it touches a MiB of its own, so Pss (which
        // counts those pages whole) is at least that.
        let mine = vec![1u8; 1 << 20];
        std::hint::black_box(&mine);
        let m = ProcessMemory::of(std::process::id()).unwrap();
        assert!(m.private_kib >= 1024, "{m:?}");
        assert!(
            m.pss_kib >= m.private_kib && m.pss_kib <= m.private_kib + m.shared_kib,
            "{m:?}"
        );
        assert!(ProcessMemory::of(u32::MAX).is_err());
    }
}
