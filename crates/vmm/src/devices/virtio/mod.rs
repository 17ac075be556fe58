//! Virtio devices and their MMIO transport.

pub mod block;
pub mod device;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod vsock;

pub use device::{
    ActivateError, ActivatedQueue, DiskBranch, VirtioDevice, VirtioInterrupt, VirtioInterruptType,
    read_config_space,
};
