//! How much memory a lab that serves sandboxes gets: most of the host's,
//! leaving the host a margin for itself (its page cache, builds, QEMU's own
//! memory beside the machine's). QEMU allocates the machine's memory as it
//! is touched, so a large lab costs the host only what runs in it.

/// Kept for the host: the larger of this and [`HOST_MARGIN_PERCENT`].
pub const HOST_MARGIN_MIB: u64 = 2048;
pub const HOST_MARGIN_PERCENT: u64 = 15;
/// Never less than this, however small the host (the lab's own kernel,
/// init and tmpfs need some).
pub const MIN_LAB_MEMORY_MIB: u64 = 1024;

/// The lab's memory on this host, from `/proc/meminfo`'s `MemTotal`
/// (4096 MiB when it cannot be read).
pub fn host_sized_memory_mib() -> u32 {
    match host_mem::mem_total_mib() {
        Ok(total) => sized(total),
        Err(_) => 4096,
    }
}

/// `total` minus the host's margin, at least [`MIN_LAB_MEMORY_MIB`].
pub fn sized(total_mib: u64) -> u32 {
    let margin = HOST_MARGIN_MIB.max(total_mib * HOST_MARGIN_PERCENT / 100);
    let lab = total_mib.saturating_sub(margin).max(MIN_LAB_MEMORY_MIB);
    u32::try_from(lab).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lab_gets_most_of_the_host_and_leaves_a_margin() {
        // 24 GiB: 15 % (3686 MiB) kept.
        assert_eq!(sized(24 * 1024), 24 * 1024 - 3686);
        // 8 GiB: the 2 GiB floor of the margin.
        assert_eq!(sized(8192), 6144);
        // A tiny host still gets a usable lab.
        assert_eq!(sized(1500), 1024);
        assert_eq!(sized(0), 1024);
        let here = host_sized_memory_mib();
        assert!(here >= 1024, "{here}");
    }
}
