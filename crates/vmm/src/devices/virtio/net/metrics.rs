//! The interface's frame and drop counters, shared by the device (which hands
//! them out) and its worker (which counts).

use std::sync::atomic::{AtomicU64, Ordering};

/// Frames and drops, for tests and logs.
#[derive(Debug, Default)]
pub struct NetCounters {
    pub rx_frames: AtomicU64,
    pub rx_bytes: AtomicU64,
    /// Frames from the backend no guest buffer could take (malformed or too small).
    pub rx_dropped: AtomicU64,
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// Guest frames not sent: a malformed chain or a backend error.
    pub tx_dropped: AtomicU64,
}

impl NetCounters {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    pub(super) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}
