//! The sandfork node server: one listener serving E2B's control plane (create,
//! get, list, kill, timeout, ...) and proxying envd traffic to each sandbox's
//! guest agent over its vsock socket.
//!
//! Three floors, each importing only from those below it:
//!
//! - [`node`]: the node's world (records, config, capacity, the pool, launch,
//!   sandboxes, templates, keys and teams); it knows nothing of HTTP or the
//!   cluster.
//! - [`cluster`]: the node's part in a cluster (etcd and the object store).
//! - [`http`]: every route, the envd proxy and the gateway.
//!
//! Beside them, [`wire`]: E2B's JSON and every header, a leaf all may use.
//!
//! Start with [`Server::start`]; [`http::api::router`] is the whole HTTP surface.

mod cluster;
pub mod http;
pub mod node;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use http::api;
pub use node::config::Config;
use node::{capacity, cgroups, config, jail, keys, net, pool, sandbox, store, template};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Auth(#[from] keys::AuthError),
    #[error(transparent)]
    Template(#[from] template::TemplateError),
    #[error("sandbox networking cannot start on this host ({0}); run without it with --no-network")]
    Network(#[from] net::NetError),
    #[error("joining the cluster: {0}")]
    Cluster(#[from] cluster::JoinError),
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A running node: the store, the base template, the warm pool and the
/// sandbox manager, ready to be served.
#[derive(Debug)]
pub struct Server {
    pub state: Arc<api::AppState>,
    /// The node's membership of its cluster, if it is in one.
    pub member: Option<cluster::Member>,
    /// Where the generated API key was written (None when it came from the environment).
    pub api_key_file: Option<PathBuf>,
    /// The port's TLS, in a cluster with it: clients without a certificate
    /// of the cluster's CA get nothing.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl Server {
    /// Opens the store, sets up the API key, builds the `base` template if it
    /// is missing (boots a microVM: slow the first time), starts the pool.
    pub async fn start(config: Config) -> Result<Server, ServerError> {
        for dir in [
            config.data_dir.clone(),
            config.sandboxes_dir(),
            config.run_dir(),
        ]
        .into_iter()
        .chain(jail::data_dirs(&config))
        {
            std::fs::create_dir_all(&dir).map_err(|source| ServerError::Io {
                what: "creating",
                path: dir.clone(),
                source,
            })?;
        }
        let store = store::Store::open(&config.data_dir.join("sandfork.redb"))?;
        let env_key = std::env::var("SANDFORK_API_KEY")
            .ok()
            .filter(|k| !k.is_empty());
        let (keys, api_key_file) = keys::setup(&store, &config.data_dir, env_key.as_deref())?;
        let keys = keys.with_rate_limit(config.key_rate_limit);
        // Before the pool starts VMMs there: what no running sandbox owns is
        // from a server that stopped (its pool, a create it did not finish).
        sandbox::reclaim_run_dir(&config.run_dir(), &store);
        // Before the pool takes slots for its VMMs: the slots of sandboxes
        // still running are adopted, the rest reclaimed.
        let net = match &config.network {
            Some(n) => Some(net::Slots::start(n, &config.run_dir(), &store)?),
            None => None,
        };
        let cgroups = config
            .cgroups
            .as_ref()
            .and_then(|c| cgroups::NodeCgroups::open(c, &config.run_dir()));
        let pool = pool::Pool::start_with_network(
            config.vmm.clone(),
            config.run_dir(),
            config.pool_size,
            net,
            cgroups,
            pool::BootConfig {
                balloon: config.balloon.then(config::node_balloon),
                cpu_template: config.cpu_template,
            },
            config
                .jail
                .as_ref()
                .filter(|_| jail::can_jail())
                .map(|j| jail::vmm_jail(j, &config, &store)),
        );
        let capacity = capacity::Capacity::for_config(&config);
        let template = template::ensure_base(&config, &store, &pool, &capacity).await?;
        for team in keys.teams() {
            capacity.set_team_limits(&team.id, team.limits);
        }
        let manager =
            sandbox::Manager::with_capacity(config.clone(), store, pool, capacity, template);
        // Subscribed before recovery: a sandbox whose VMM is gone ends there.
        let webhooks = node::webhooks::Webhooks::start(
            &manager,
            node::webhooks::Policy {
                destinations: node::webhooks::Destinations {
                    allowed: config.webhook_allow_nets.clone(),
                },
                ..Default::default()
            },
        );
        manager.recover().await;
        match manager.forget_unrecorded_volumes() {
            Ok(gone) if !gone.is_empty() => {
                tracing::info!("removed {} volume directories without a record", gone.len())
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("volumes at start: {e}"),
        }
        let templates = template::Templates::new(manager.clone());
        if let Err(e) = templates.recover().await {
            tracing::warn!("recovering template builds: {e}");
        }
        if config.build_code_interpreter {
            let builder = templates.clone();
            tokio::spawn(async move {
                let name = node::template::code_interpreter::NAME;
                match builder.ensure_builtin(name).await {
                    Ok(()) | Err(node::sandbox::SandboxError::Building { .. }) => {}
                    Err(e) => tracing::warn!("building the {name} template at start: {e}"),
                }
            });
        }
        match manager.collect_garbage().await {
            Ok(s) => tracing::info!(
                "gc at start: removed {} directories and {} disk layers",
                s.dirs.len(),
                s.layers.len()
            ),
            Err(e) => tracing::warn!("gc at start: {e}"),
        }
        manager.clone().start_gc();
        templates.start_image_disk_bound();
        manager.clone().start_reaper();
        manager.clone().start_observer();
        manager.clone().start_pressure_monitor();
        // Idempotency keys are kept a day: the expired ones are forgotten at
        // start and hourly.
        let kept = manager.clone();
        tokio::spawn(async move {
            let mut hourly = tokio::time::interval(std::time::Duration::from_secs(3600));
            loop {
                hourly.tick().await;
                node::idempotent::collect(kept.store(), node::clock::now_ms());
            }
        });
        let member = match &config.cluster {
            Some(c) => Some(cluster::join(c, &manager, &keys).await?),
            None => None,
        };
        Ok(Server {
            state: Arc::new(api::AppState {
                manager,
                templates,
                keys,
                guests: Default::default(),
                cluster: member.as_ref().map(|m| m.node.clone()),
                creates: Default::default(),
                webhooks,
            }),
            member,
            api_key_file,
            tls: config
                .cluster
                .as_ref()
                .and_then(|c| c.tls.as_ref())
                .map(|tls| tls.server_config()),
        })
    }

    /// Serves on `listener` until `shutdown` completes; running sandboxes
    /// then keep running for the next start to adopt, and a node of a
    /// cluster leaves it.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let manager = self.state.manager.clone();
        let routes = api::run_changes_to_end(api::router(self.state));
        let served = match self.tls {
            Some(tls) => {
                let listener = http::tls::TlsListener::new(listener, tls)?;
                axum::serve(listener, routes)
                    .with_graceful_shutdown(shutdown)
                    .await
            }
            None => {
                axum::serve(listener, routes)
                    .with_graceful_shutdown(shutdown)
                    .await
            }
        };
        manager.shutdown();
        if let Some(member) = &self.member {
            member.leave().await;
        }
        served
    }
}
