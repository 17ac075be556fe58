//! What a sandbox is charged against the node's memory: what its VMM process
//! really uses (its proportional set size, read from /proc by a sampler, not
//! per request) plus a headroom for growth, never more than its guest can
//! touch (its `memoryMB`) once the real use is counted.
//!
//! Pss counts each page a process maps divided by the number of processes
//! mapping it: the template's memory that restored sandboxes and fork
//! children share copy-on-write is counted once over all of them, and a
//! private page whole.

use std::time::Duration;

/// Headroom per sandbox when none is configured: room for what an idle
/// sandbox grows by when it is used (a shell, a small interpreter) before
/// the next sample counts it.
pub const DEFAULT_MEMORY_HEADROOM_MIB: u64 = 32;
/// How often the sampler reads the VMM processes' memory.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// The memory charged for `guests` guests of `size_mib` in all, whose VMMs
/// were last seen using `used_mib` together (`None`: not sampled yet, as
/// while one starts).
///
/// A reservation of no sandbox (a template build's room) is charged its
/// whole size: its guest's use is not sampled.
pub fn charge(size_mib: u64, guests: u64, used_mib: Option<u64>, headroom_mib: u64) -> u64 {
    if guests == 0 {
        return size_mib;
    }
    let headroom = headroom_mib.saturating_mul(guests);
    match used_mib {
        // The guest cannot grow past its size, but what its VMM uses is
        // counted even when it is more (the VMM's own pages).
        Some(used) => used.max(used.saturating_add(headroom).min(size_mib)),
        None => headroom.min(size_mib),
    }
}

/// The proportional set size of process `pid` in KiB
/// (`/proc/<pid>/smaps_rollup`).
pub fn pss_kib(pid: u32) -> std::io::Result<u64> {
    host_mem::ProcessMemory::of(pid).map(|m| m.pss_kib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_is_charged_its_use_plus_headroom_up_to_its_size() {
        // Not sampled yet: the headroom alone, at most its size.
        assert_eq!(charge(256, 1, None, 32), 32);
        assert_eq!(charge(16, 1, None, 32), 16);
        // Sampled: use plus headroom, capped at its size.
        assert_eq!(charge(256, 1, Some(6), 32), 38);
        assert_eq!(charge(256, 1, Some(240), 32), 256);
        // A VMM using more than its guest's size is charged what it uses.
        assert_eq!(charge(256, 1, Some(300), 32), 300);
        // A fork of 16 children asks for 16 headrooms, not 16 guests.
        assert_eq!(charge(16 * 256, 16, None, 32), 512);
        // A template build's room: its whole size.
        assert_eq!(charge(1024, 0, None, 32), 1024);
        assert_eq!(charge(1024, 0, Some(5), 32), 1024);
        // Headroom as large as a guest: the old model, every guest whole.
        assert_eq!(charge(256, 1, Some(6), u64::MAX), 256);
    }
}
