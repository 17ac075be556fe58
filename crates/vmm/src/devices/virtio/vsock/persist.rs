//! What a snapshot saves of the vsock device, and the device it restores.
//!
//! Connections do not survive a restore: the restored device tells the guest
//! to reset its sockets (`VirtioDevice::on_restored`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::device::{Vsock, VsockError};
use crate::devices::virtio::persist::DeviceOverrides;

/// The vsock device in a snapshot. The field order is the snapshot file's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedVsock {
    pub guest_cid: u64,
    pub uds_path: PathBuf,
}

impl Vsock {
    /// What a snapshot records to bind this device again.
    pub fn save(&self) -> SavedVsock {
        SavedVsock {
            guest_cid: self.guest_cid(),
            uds_path: self.uds_path().to_owned(),
        }
    }
}

impl SavedVsock {
    /// Binds the host socket again, at the restore's path if it has one.
    pub fn restore(&self, overrides: &DeviceOverrides) -> Result<Vsock, VsockError> {
        let uds = overrides
            .vsock_uds_path
            .clone()
            .unwrap_or_else(|| self.uds_path.clone());
        Vsock::new(self.guest_cid, uds)
    }
}
