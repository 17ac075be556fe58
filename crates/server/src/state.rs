//! What every request handler shares: the sandbox manager, template builds,
//! the accepted API key and the proxy's guest connections. Below both the
//! control plane ([`crate::api`]) and the envd proxy ([`crate::proxy`]).

use std::sync::Arc;

use crate::auth::ApiKeys;
use crate::proxy::GuestConnections;
use crate::sandbox::Manager;
use crate::template::Templates;

#[derive(Debug)]
pub struct AppState {
    pub manager: Arc<Manager>,
    pub templates: Arc<Templates>,
    pub keys: ApiKeys,
    /// Open connections to guests' ports, reused by the envd proxy.
    pub guests: GuestConnections,
    /// The node's part in a cluster, once it has joined one (a fork across
    /// nodes, and the routes other nodes ask for one).
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::Node>>,
}

pub type Shared = Arc<AppState>;
