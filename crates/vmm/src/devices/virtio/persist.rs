//! What a snapshot records of virtio devices, in serializable form: the
//! queues (the transport's part) and which device each is, whose state and
//! restore live beside it (`block/persist.rs`, `net/persist.rs`,
//! `vsock/persist.rs`, `balloon/persist.rs`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use virtio_queue::QueueState;

use super::VirtioDevice;
use super::balloon::{BalloonError, SavedBalloon};
use super::block::{BlockError, SavedBlock};
use super::net::{NetError, SavedNet};
use super::vsock::{SavedVsock, VsockError};

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

/// Paths a restored VM uses instead of the snapshot's: its own vsock socket,
/// its own disk files (by drive id) and its own taps (by interface id).
#[derive(Clone, Debug, Default)]
pub struct DeviceOverrides {
    pub vsock_uds_path: Option<PathBuf>,
    pub drive_paths: Vec<DriveAt>,
    /// `(iface_id, host_dev_name)`.
    pub taps: Vec<(String, String)>,
}

/// A drive reopened elsewhere than its snapshot says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriveAt {
    pub id: String,
    pub path: PathBuf,
    /// Reopened read-only even if the snapshot had it writable.
    pub read_only: bool,
}

/// What recreates a device model on restore: its configuration, not its
/// activity (queues and features are the transport's part of the state).
/// Each kind's state and restore live beside the device (`<kind>/persist.rs`);
/// this only dispatches. The variant order is the snapshot file's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SavedDevice {
    Block(SavedBlock),
    Vsock(SavedVsock),
    Net(SavedNet),
    Balloon(SavedBalloon),
}

/// Why a device of a snapshot could not be recreated.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("drive {id}: {source}")]
    Block {
        id: String,
        /// Boxed: a block error is large, and this travels up every restore.
        #[source]
        source: Box<BlockError>,
    },
    #[error("vsock: {0}")]
    Vsock(#[source] VsockError),
    #[error(transparent)]
    Net(NetError),
    #[error("balloon: {0}")]
    Balloon(#[source] BalloonError),
}

impl SavedDevice {
    /// The network interface this is, if it is one.
    pub fn iface_id(&self) -> Option<&str> {
        match self {
            SavedDevice::Net(net) => Some(&net.iface_id),
            _ => None,
        }
    }

    /// Recreates the device, with the restore's paths where it gives them.
    pub fn restore(
        &self,
        overrides: &DeviceOverrides,
    ) -> Result<Box<dyn VirtioDevice>, RestoreError> {
        Ok(match self {
            SavedDevice::Block(b) => {
                Box::new(b.restore(overrides).map_err(|source| RestoreError::Block {
                    id: b.id.clone(),
                    source: Box::new(source),
                })?)
            }
            SavedDevice::Vsock(v) => Box::new(v.restore(overrides).map_err(RestoreError::Vsock)?),
            SavedDevice::Net(n) => Box::new(n.restore(overrides).map_err(RestoreError::Net)?),
            SavedDevice::Balloon(b) => Box::new(b.restore().map_err(RestoreError::Balloon)?),
        })
    }
}
