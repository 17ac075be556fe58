//! What every request handler shares: the sandbox manager, template builds,
//! the accepted API key and the proxy's guest connections. Below both the
//! control plane ([`crate::http::api`]) and the envd proxy ([`crate::http::proxy`]).

use std::sync::Arc;

use crate::http::proxy::GuestConnections;
use crate::node::keys::ApiKeys;
use crate::node::sandbox::Manager;
use crate::node::template::Templates;

#[derive(Debug)]
pub struct AppState {
    pub manager: Arc<Manager>,
    pub templates: Arc<Templates>,
    pub keys: ApiKeys,
    /// Open connections to guests' ports, reused by the envd proxy.
    pub guests: GuestConnections,
    /// The node's part in a cluster, if it is in one (a fork across nodes,
    /// templates and pauses taken in, the routes other nodes ask for).
    pub cluster: Option<Arc<crate::cluster::Node>>,
    /// The creates under way with an `Idempotency-Key`.
    pub creates: crate::node::idempotent::Creates,
    /// Lifecycle webhooks and the last events.
    pub webhooks: Arc<crate::node::webhooks::Webhooks>,
}

pub type Shared = Arc<AppState>;
