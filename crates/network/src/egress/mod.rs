//! Domain rules for egress: the node's egress proxy and the two readers it needs. A slot
//! whose policy has domain rules DNATs its guest's TCP to ports 80 and 443 to the proxy on
//! the veth's host end (as DNS goes to the forwarder); the proxy knows the sandbox by the
//! slot host address the connection comes from, reads the HTTP `Host` ([`http`]) or the TLS
//! ClientHello's SNI ([`sni`]) without terminating TLS, finds the guest's intended
//! destination in the slot's conntrack ([`crate::conntrack`]), and splices the connection
//! to that address if the sandbox's current policy allows the name (or the address) and the
//! address is not always denied ([`crate::EgressPolicy::permits_named`]). A name counts
//! only at an address the node's DNS forwarder answered the sandbox for it
//! ([`crate::dns::Answers`]).

pub mod http;
mod proxy;
pub mod sni;

pub use proxy::{EgressProxy, ProxyStats, ProxyTarget, TargetLookup};

/// The outcome of reading the start of a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parse<T> {
    Done(T),
    /// Not enough bytes yet to tell.
    NeedMore,
    /// Not what was expected, or ambiguous: refused.
    Invalid,
}
