//! A sandbox's limits and the files they are written to.

/// The period `cpu.max` quotas are counted in, in microseconds (the kernel's
/// default).
pub const CPU_PERIOD_US: u64 = 100_000;

/// What one sandbox's VMM may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// CPUs' worth of time per period: its vCPUs, so a guest spinning on
    /// every vCPU takes that much of the host and no more.
    pub cpus: u32,
    /// `memory.max`: twice the guest's memory plus what the VMM itself
    /// needs: while a snapshot is written the guest's memory is held twice
    /// (its memory file and the snapshot's pages in the page cache, which on
    /// tmpfs cannot be reclaimed).
    pub memory_bytes: u64,
    /// `pids.max`: the VMM's threads (vCPUs, device workers, API) with room.
    pub pids: u32,
    /// `io.weight` (1-10000, the kernel's default 100): each sandbox's share
    /// of disk time against the others'.
    pub io_weight: u16,
}

impl Limits {
    /// The limits of a guest of `vcpus` and `mem_mib`, with `overhead_mib`
    /// for the VMM process (its own heap, device buffers, page tables).
    pub fn for_guest(vcpus: u32, mem_mib: u64, overhead_mib: u64) -> Limits {
        Limits {
            cpus: vcpus.max(1),
            memory_bytes: mem_mib
                .saturating_mul(2)
                .saturating_add(overhead_mib)
                .saturating_mul(1 << 20),
            pids: 64 + 2 * vcpus,
            io_weight: 100,
        }
    }

    /// The files and values that set these limits; `io.weight` only where
    /// the io controller is on.
    pub(crate) fn files(&self, io: bool) -> Vec<(&'static str, String)> {
        let mut files = vec![
            (
                "cpu.max",
                format!("{} {CPU_PERIOD_US}", u64::from(self.cpus) * CPU_PERIOD_US),
            ),
            ("memory.max", self.memory_bytes.to_string()),
            // The VMM is one unit: an out-of-memory kill takes all of it,
            // never a device thread alone.
            ("memory.oom.group", "1".to_owned()),
            ("pids.max", self.pids.to_string()),
        ];
        if io {
            files.push((
                "io.weight",
                format!("default {}", self.io_weight.clamp(1, 10_000)),
            ));
        }
        files
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_of_two_vcpus_and_512_mib() {
        let l = Limits::for_guest(2, 512, 64);
        assert_eq!(
            l.files(true),
            vec![
                ("cpu.max", "200000 100000".to_owned()),
                ("memory.max", (1088u64 << 20).to_string()),
                ("memory.oom.group", "1".to_owned()),
                ("pids.max", "68".to_owned()),
                ("io.weight", "default 100".to_owned()),
            ]
        );
        assert_eq!(l.files(false).len(), 4);
    }

    #[test]
    fn extreme_inputs_do_not_overflow() {
        let l = Limits::for_guest(0, u64::MAX, u64::MAX);
        assert_eq!(l.cpus, 1);
        assert_eq!(l.memory_bytes, u64::MAX);
        let w = Limits { io_weight: 0, ..l };
        assert!(
            w.files(true)
                .contains(&("io.weight", "default 1".to_owned()))
        );
    }
}
