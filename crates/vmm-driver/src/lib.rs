//! The host side of sandfork's VMM and guest agent: a client of the VMM's
//! API socket (ours or a real Firecracker), one VMM process driven through
//! it ([`process::VmmProcess`]: spawn, boot, restore, fork, readiness,
//! diagnostics, adoption), the host side of vsock, and a client of the guest
//! agent. The API's types are `vmm_api`'s, which the VMM itself uses without
//! any of this.

pub mod agent_client;
mod client;
#[cfg(test)]
mod hostile_guest;
pub mod process;
pub mod snapshot_state;
pub mod vsock_connect;

pub use client::{ClientError, RawResponse, VmmClient};

/// Re-exported so callers of [`VmmClient::request`] need not depend on hyper.
pub use hyper::Method;
