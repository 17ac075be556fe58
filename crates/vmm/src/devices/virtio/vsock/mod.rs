//! virtio-vsock with the Firecracker host-side model.
//!
//! The guest sees a virtio-vsock device (ID 19) with CID `guest_cid`; the host sees one
//! Unix socket per VM at `uds_path`:
//!
//! - host-initiated: connect to `uds_path`, send `CONNECT <guest_port>\n`, receive
//!   `OK <host_port>\n` when the guest accepts (the stream is closed if it refuses or
//!   does not answer in time), then exchange bytes;
//! - guest-initiated: a guest connection to CID 2 port `P` is relayed to a Unix
//!   listener at `<uds_path>_P` (the guest gets an RST if nothing listens there).
//!
//! Layout: [`device`] is the virtio device model, [`worker`] its epoll thread, [`muxer`]
//! the connection table, [`connection`] one connection's state machine and credit
//! accounting, [`unix`] the host-side handshake, [`packet`] protocol constants,
//! [`persist`] what a snapshot saves of the device.

pub mod connection;
pub mod device;
pub mod muxer;
pub mod packet;
pub mod persist;
pub mod unix;
pub mod worker;

#[cfg(test)]
pub(crate) mod test_driver;
#[cfg(test)]
mod tests;

pub use device::{DEFAULT_CONNECT_TIMEOUT, Vsock, VsockError};
pub use persist::SavedVsock;
