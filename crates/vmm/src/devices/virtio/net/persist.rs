//! What a snapshot saves of a network interface, and the interface it restores.

use serde::{Deserialize, Serialize};

use super::device::{MacAddr, Net, NetConfig, NetError};
use crate::devices::virtio::persist::DeviceOverrides;

/// A network interface in a snapshot; the tap is opened again by name (or by
/// the restore's network override). The field order is the snapshot file's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedNet {
    pub iface_id: String,
    pub host_dev_name: String,
    pub guest_mac: Option<MacAddr>,
}

impl Net {
    /// What a snapshot records to attach this interface again.
    pub fn save(&self) -> SavedNet {
        let config = self.config();
        SavedNet {
            iface_id: config.iface_id.clone(),
            host_dev_name: config.host_dev_name.clone(),
            guest_mac: config.guest_mac,
        }
    }
}

impl SavedNet {
    /// Opens the interface's tap again, the restore's tap for it if it has one.
    pub fn restore(&self, overrides: &DeviceOverrides) -> Result<Net, NetError> {
        let host_dev_name = overrides
            .taps
            .iter()
            .find(|(iface, _)| *iface == self.iface_id)
            .map_or_else(|| self.host_dev_name.clone(), |(_, tap)| tap.clone());
        Net::new(NetConfig {
            iface_id: self.iface_id.clone(),
            host_dev_name,
            guest_mac: self.guest_mac,
        })
    }
}
