//! The node's world: what a sandfork node holds and does, with no HTTP and
//! no cluster in it. The floors above ([`crate::cluster`], [`crate::http`])
//! call into it; nothing here calls up.

pub mod capacity;
pub mod cgroups;
pub mod clock;
pub mod config;
pub mod crash;
pub mod events;
pub mod idempotent;
pub(crate) mod ids;
pub use ids::Token;
pub(crate) mod ingress;
pub mod jail;
pub mod keyed;
pub mod keys;
pub(crate) mod launch;
pub mod metrics;
pub mod net;
pub mod pool;
pub mod pressure;
pub mod sandbox;
pub mod store;
pub mod template;
pub mod tenants;
pub mod volume;
pub mod webhooks;
