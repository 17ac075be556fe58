//! virtio-net (device ID 1) with a host tap device as its backend, as in Firecracker.
//!
//! The guest sees one receive and one transmit queue, Firecracker's features
//! ([`device::OFFERED_FEATURES`]: checksum and TCP/UDP segmentation offload both
//! ways, mergeable receive buffers, event index) and, when a MAC is configured,
//! `VIRTIO_NET_F_MAC`; no control queue. Every frame carries the 12-byte
//! `virtio_net_hdr_v1`, and the tap is opened with `IFF_VNET_HDR` and that header
//! size, so headers (and the offloads they describe) pass between guest and tap
//! unchanged; the tap's offloads (`TUNSETOFFLOAD`) follow what the driver acked,
//! set at every activation, so again on a restored VM's newly opened tap.
//!
//! - [`device`]: the device model, its features, configuration space and lifecycle.
//! - [`backend`]: the frame backend the worker moves frames to and from.
//! - [`metrics`]: its frame and drop counters.
//! - [`persist`]: what a snapshot saves of the interface, and its restore.
//! - [`tap`]: that backend on a Linux tap device.
//! - `used_batch`: returning a frame's receive chains to the guest at once.
//! - [`worker`]: the thread that services both queues and the backend (public
//!   for the fuzz targets, which drive it without the thread).

pub mod backend;
pub mod device;
pub mod metrics;
pub mod persist;
pub mod tap;
mod used_batch;
pub mod worker;

#[cfg(test)]
mod tests;

pub use backend::FrameBackend;
pub use device::{MacAddr, Net, NetConfig, NetError};
pub use metrics::NetCounters;
pub use persist::SavedNet;
pub use tap::{Tap, TapError};

/// The virtio-net header of a `VIRTIO_F_VERSION_1` device: `struct virtio_net_hdr_v1`.
pub const VNET_HDR_LEN: usize = 12;

/// The largest frame the device moves, header included: a 64 KiB IP packet in an
/// Ethernet frame with a VLAN tag (the largest the guest can send at its maximum MTU).
pub const MAX_FRAME_LEN: usize = VNET_HDR_LEN + 65550;
