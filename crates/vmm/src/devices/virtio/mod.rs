//! Virtio devices and their MMIO transport; [`worker`] is the thread helper
//! every device runs its queues on.

pub mod balloon;
pub mod block;
pub mod device;
pub mod handoff;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod vsock;
pub mod worker;

pub use device::{
    ActivateError, ActivatedQueue, DiskBranch, PreparedBranch, VirtioDevice, VirtioInterrupt,
    VirtioInterruptType, avail_ring_in_reach, read_config_space,
};
