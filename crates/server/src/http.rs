//! The node's HTTP face: E2B's control plane ([`api`]), the envd proxy
//! ([`proxy`]) and, for a cluster, the gateway ([`gateway`]). Errors of the
//! node and denials of the cluster become status codes here, and only here.

pub mod api;
mod cluster_routes;
mod console;
pub mod gateway;
pub(crate) mod proxy;
pub(crate) mod state;
pub mod tls;
