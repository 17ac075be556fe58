//! What a snapshot records of virtio devices, in serializable form.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use virtio_queue::QueueState;

/// A virtqueue's state (virtio-queue's `QueueState`, which is not serializable).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub max_size: u16,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl From<QueueState> for QueueSnapshot {
    fn from(q: QueueState) -> Self {
        QueueSnapshot {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

impl From<&QueueSnapshot> for QueueState {
    fn from(q: &QueueSnapshot) -> Self {
        QueueState {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

/// What recreates a device model on restore: its configuration, not its
/// activity (queues and features are the transport's part of the state).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VirtioDeviceConfig {
    Block {
        id: String,
        path: PathBuf,
        read_only: bool,
    },
    Vsock {
        guest_cid: u64,
        uds_path: PathBuf,
    },
    /// The tap is opened again by name (or by the restore's network override).
    Net {
        iface_id: String,
        host_dev_name: String,
        guest_mac: Option<[u8; 6]>,
    },
}
