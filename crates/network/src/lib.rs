//! Host side of sandfork sandbox networking.
//!
//! Every sandbox's VMM runs in its own network namespace (a *slot*) holding a tap of a fixed
//! name with a fixed gateway address and MAC, so every guest has the same address and MAC
//! (part of the snapshot ABI, [`plan`]) and restores and fork children just take another slot.
//! A veth joins the slot to the host; the slot NATs the guest to its own host address and
//! polices egress ([`policy`]); the host forwards slot veths to the uplink and masquerades.
//! Everything is programmed in process over netlink: links, addresses, routes and neighbours
//! with `netlink-packet-route` messages, nftables with a small encoder of our own ([`nft`]).
//! [`Pool`] keeps slots ready ahead of need.
//!
//! Guests' DNS goes to the node's forwarder ([`dns`]); with domain rules their web traffic
//! goes through the node's egress proxy ([`egress`]).
//!
//! Modules depend in one direction: `plan`, `policy` <- `nft` <- `host` <- `slot` <- `pool`.

pub mod bench;
pub mod conntrack;
pub mod dns;
pub mod egress;
mod error;
mod host;
mod netlink;
pub mod netns;
pub mod nft;
pub mod plan;
pub mod policy;
mod pool;
mod rtnl;
mod slot;
pub mod tap;

pub use error::{Error, Result};
pub use host::HostConfig;
pub use plan::{AddressPlan, Cidr4, SlotAddrs};
pub use policy::{DomainPattern, EgressPolicy};
pub use pool::{InUse, Pool, PoolConfig, Reclaimed};
pub use slot::Slot;

/// Locks `m`, recovering the data when a thread panicked while holding it: the pool's and the
/// host socket's state stay consistent between statements, so a panic elsewhere must not
/// take networking down with it.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs `f` on a thread inside the network namespace at `path` (tests and tools).
pub fn run_in_netns<T: Send>(
    path: &std::path::Path,
    f: impl FnOnce() -> Result<T> + Send,
) -> Result<T> {
    let ns = netns::open(path)?;
    netns::run_in(&ns, f)
}
