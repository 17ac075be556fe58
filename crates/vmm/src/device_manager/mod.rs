//! Owns the VM's devices: places them on the buses, gives them interrupt
//! lines and MMIO windows, and wires their notifications into KVM.

pub mod legacy;
pub mod mmio;

use crate::devices::bus::BusError;

#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    #[error("placing a device on the bus: {0}")]
    Bus(#[from] BusError),
    #[error("creating an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error("KVM ioctl {0} failed: {1}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    #[error("no interrupt lines left for another virtio device")]
    OutOfIrqs,
    #[error("no MMIO windows left for another virtio device")]
    OutOfMmioSpace,
    #[error("restoring device state: {0}")]
    State(String),
    /// Not a `#[source]`: the message already holds the device's error, as
    /// the `State` text it replaces did.
    #[error("restoring device state: {0}")]
    Restore(crate::devices::virtio::persist::RestoreError),
    #[error("setting up the virtio-mmio transport: {0}")]
    Transport(#[from] crate::devices::virtio::mmio::MmioError),
}
