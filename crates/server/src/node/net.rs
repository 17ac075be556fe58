//! Sandbox networking on the node: one pool of network slots (crate
//! `sandfork_network`: a namespace per sandbox with the tap every snapshot
//! names, NAT and egress policy) started with the node; every launch takes a
//! slot ([`crate::node::launch`]), its guest holds it as a [`Lease`] and gives it
//! back when its VMM is gone. After a restart the slots of adopted sandboxes
//! are adopted and the rest reclaimed. One DNS forwarder serves every slot's
//! guest (each slot DNATs its gateway's port 53 to it) and answers per the
//! policy of the lease it comes from. Likewise one egress proxy serves the
//! web traffic of every slot whose policy has domain rules.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use sandfork_network::dns::{AccessLookup, Answers, DnsAccess, DnsForwarder};
use sandfork_network::egress::{EgressProxy, ProxyTarget, TargetLookup};
use sandfork_network::{EgressPolicy, HostConfig, InUse, PoolConfig, Slot};
use serde::{Deserialize, Serialize};

pub use sandfork_network::Error as NetError;
pub use sandfork_network::plan::{GUEST_MAC, TAP_NAME};

use crate::node::store::{SandboxState, Store};

/// The guest's interface in every VMM (and so in every snapshot).
pub const GUEST_IFACE: &str = "eth0";

/// How the node networks its sandboxes.
#[derive(Debug, Clone)]
pub struct NetworkConfig {
    /// Slots kept ready ahead of need (a fork burst's worth).
    pub ready_slots: usize,
    /// The link toward the internet; None: the default route's.
    pub uplink: Option<String>,
    /// Where the guests' DNS forwarder sends queries; None: the first IPv4
    /// nameserver of the node's /etc/resolv.conf, port 53.
    pub dns_upstream: Option<SocketAddrV4>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            ready_slots: 32,
            uplink: None,
            dns_upstream: None,
        }
    }
}

/// The node's resolver from its /etc/resolv.conf, port 53.
fn default_dns_upstream() -> Option<SocketAddrV4> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    sandfork_network::dns::upstream_from_resolv_conf(&text).map(|ip| SocketAddrV4::new(ip, 53))
}

/// What each leased slot's guest may resolve and reach by name, by the slot's
/// host address (the source the forwarder and the egress proxy see).
type DnsTable = Arc<RwLock<HashMap<Ipv4Addr, Leased>>>;

#[derive(Debug, Clone)]
struct Leased {
    dns: DnsAccess,
    proxy: ProxyTarget,
}

/// The slot a running sandbox is in, as its record keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRecord {
    pub id: u32,
    /// Where the node reaches the guest.
    pub host_ip: Ipv4Addr,
}

/// A sandbox's network as E2B's API set it (create, `PUT .../network`),
/// resolved into the policy its slot enforces, and the slot it runs in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetwork {
    /// `allow_internet_access` as given (None: never set).
    #[serde(default)]
    pub allow_internet_access: Option<bool>,
    #[serde(default)]
    pub allow_out: Vec<String>,
    #[serde(default)]
    pub deny_out: Vec<String>,
    #[serde(default)]
    pub policy: EgressPolicy,
    /// Who may reach its guest's ports through the node's proxy, and as
    /// what host (set at create; `PUT .../network` leaves it).
    #[serde(default)]
    pub ingress: crate::node::ingress::Ingress,
    /// While it runs with networking.
    #[serde(default)]
    pub slot: Option<SlotRecord>,
}

/// Where a node keeps its slots' anchors: beside its run dir, not in it (the
/// run dir's entries are VMM directories, reclaimed by name at start).
pub fn anchor_dir(run_dir: &std::path::Path) -> PathBuf {
    let mut name = run_dir.as_os_str().to_owned();
    name.push("-netns");
    PathBuf::from(name)
}

/// The node's slot pool, shared by the warm VMM pool, every running guest's
/// lease and the manager (policy updates).
#[derive(Debug)]
pub struct Slots {
    /// None once shut down.
    pool: RwLock<Option<sandfork_network::Pool>>,
    /// Slots of sandboxes that ran before a restart, until recovery claims them.
    adopted: Mutex<HashMap<u32, Slot>>,
    dns: DnsTable,
    /// The addresses the forwarder gave each leased slot, per name: where the
    /// egress proxy lets a name go.
    answers: Arc<Answers>,
    /// None when it could not start (the node runs on, its guests resolve nothing).
    forwarder: Mutex<Option<DnsForwarder>>,
    /// None when it could not start (web traffic of domain rules is refused).
    egress: Mutex<Option<EgressProxy>>,
}

impl Slots {
    /// Starts the pool: the slots of the sandboxes `store` records as running
    /// are adopted (their VMMs may still run in them), every other slot of
    /// ours is removed, and the worker starts making ready ones.
    pub fn start(
        cfg: &NetworkConfig,
        run_dir: &std::path::Path,
        store: &Store,
    ) -> Result<Arc<Slots>, NetError> {
        let in_use: Vec<InUse> = store
            .sandboxes()
            .map_err(|e| NetError::Plan(format!("reading the sandboxes' slots: {e}")))?
            .into_iter()
            .filter(|s| s.state == SandboxState::Running)
            .filter_map(|s| {
                let slot = s.network.slot?;
                Some(InUse {
                    id: slot.id,
                    policy: s.network.policy,
                })
            })
            .collect();
        let mut host = HostConfig::new(anchor_dir(run_dir));
        host.uplink = cfg.uplink.clone();
        let mut pool_cfg = PoolConfig::new(host);
        pool_cfg.ready_target = cfg.ready_slots;
        let (pool, reclaimed) = sandfork_network::Pool::start(pool_cfg, &in_use)?;
        for w in pool.warnings() {
            tracing::warn!("networking: {w}");
        }
        tracing::info!(
            "networking: uplink {}, {} slots adopted, {} missing, {} stale removed",
            pool.uplink(),
            reclaimed.adopted.len(),
            reclaimed.missing.len(),
            reclaimed.removed.len()
        );
        let dns = DnsTable::default();
        let answers = Arc::new(Answers::default());
        let forwarder = start_forwarder(cfg, dns.clone(), answers.clone());
        let egress = start_egress_proxy(dns.clone(), pool.always_deny().to_vec(), answers.clone());
        Ok(Arc::new(Slots {
            pool: RwLock::new(Some(pool)),
            adopted: Mutex::new(reclaimed.adopted.into_iter().map(|s| (s.id(), s)).collect()),
            dns,
            answers,
            forwarder: Mutex::new(forwarder),
            egress: Mutex::new(egress),
        }))
    }

    fn lease(self: &Arc<Self>, slot: Slot) -> Lease {
        self.lease_dns(&slot);
        Lease {
            record: SlotRecord {
                id: slot.id(),
                host_ip: slot.addrs().host_ip,
            },
            netns: slot.anchor().to_owned(),
            slot: Some(slot),
            slots: self.clone(),
        }
    }

    fn forget_dns(&self, slot: &Slot) {
        let ip = slot.addrs().host_ip;
        self.dns
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ip);
        // The slot's next sandbox starts with no answers of this one's.
        self.answers.forget(ip);
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&sandfork_network::Pool) -> Result<T, NetError>,
    ) -> Result<T, NetError> {
        let pool = self.pool.read().unwrap_or_else(|p| p.into_inner());
        match pool.as_ref() {
            Some(p) => f(p),
            None => Err(NetError::Plan("networking is shut down".into())),
        }
    }

    /// A slot with `policy` in force; blocks (call it off the async threads).
    pub fn take(self: &Arc<Self>, policy: &EgressPolicy) -> Result<Lease, NetError> {
        let t0 = std::time::Instant::now();
        let slot = self.with(|p| p.take(policy))?;
        tracing::debug!(
            "network slot {} taken in {:.2} ms",
            slot.id(),
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(self.lease(slot))
    }

    /// The slot a sandbox had before the restart, if it was adopted.
    pub fn claim_adopted(self: &Arc<Self>, id: u32) -> Option<Lease> {
        let slot = self
            .adopted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)?;
        Some(self.lease(slot))
    }

    /// Gives back the adopted slots no sandbox claimed (after recovery).
    pub fn release_unclaimed(&self) {
        let left: Vec<Slot> = self
            .adopted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, s)| s)
            .collect();
        for slot in left {
            tracing::info!(
                "networking: slot {} of no adopted sandbox, released",
                slot.id()
            );
            self.release(slot);
        }
    }

    fn release(&self, slot: Slot) {
        self.forget_dns(&slot);
        let pool = self.pool.read().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pool.as_ref() {
            p.release(slot);
        }
    }

    /// (ready, in use).
    pub fn counts(&self) -> (usize, usize) {
        self.with(|p| Ok(p.counts())).unwrap_or((0, 0))
    }

    /// Stops the pool and removes the slots no sandbox uses (a clean stop);
    /// the slots of running sandboxes stay for the next start to adopt.
    pub fn shutdown(&self) {
        drop(
            self.forwarder
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        drop(self.egress.lock().unwrap_or_else(|p| p.into_inner()).take());
        let pool = self.pool.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(p) = pool
            && let Err(e) = p.shutdown(true)
        {
            tracing::warn!("networking: removing the ready slots: {e}");
        }
    }
}

impl Slots {
    fn lease_dns(&self, slot: &Slot) {
        self.dns.write().unwrap_or_else(|p| p.into_inner()).insert(
            slot.addrs().host_ip,
            Leased {
                dns: DnsAccess::of(slot.policy()),
                proxy: ProxyTarget {
                    policy: slot.policy().clone(),
                    netns: slot.anchor().to_owned(),
                },
            },
        );
    }
}

/// Starts the egress proxy on the node's side of every slot veth (all
/// addresses; only connections from a leased slot's host address are served).
/// A failure is logged, not fatal: domain rules then let no web traffic out.
fn start_egress_proxy(
    leases: DnsTable,
    always_deny: Vec<sandfork_network::Cidr4>,
    answers: Arc<Answers>,
) -> Option<EgressProxy> {
    use sandfork_network::plan::{EGRESS_PROXY_HTTP_PORT, EGRESS_PROXY_TLS_PORT};
    let lookup: Arc<TargetLookup> = Arc::new(move |ip| {
        leases
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip)
            .map(|l| l.proxy.clone())
    });
    let any = |port| SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port);
    match EgressProxy::start(
        any(EGRESS_PROXY_HTTP_PORT),
        any(EGRESS_PROXY_TLS_PORT),
        lookup,
        always_deny,
        answers,
        None,
    ) {
        Ok(p) => {
            tracing::info!(
                "networking: egress proxy for domain rules on ports {EGRESS_PROXY_HTTP_PORT} \
                 (HTTP) and {EGRESS_PROXY_TLS_PORT} (TLS)"
            );
            Some(p)
        }
        Err(e) => {
            tracing::warn!(
                "networking: the egress proxy cannot start ({e}): sandboxes with domain rules \
                 reach no web server by name"
            );
            None
        }
    }
}

/// Starts the guests' DNS forwarder on the node's side of every slot veth
/// (it listens on all addresses; only queries from a leased slot's host
/// address are answered). A failure is logged, not fatal: sandboxes still
/// reach addresses, not names.
fn start_forwarder(
    cfg: &NetworkConfig,
    dns: DnsTable,
    answers: Arc<Answers>,
) -> Option<DnsForwarder> {
    let Some(upstream) = cfg.dns_upstream.or_else(default_dns_upstream) else {
        tracing::warn!(
            "networking: no IPv4 nameserver in /etc/resolv.conf and no --dns-upstream: \
             sandboxes cannot resolve names"
        );
        return None;
    };
    let lookup: Arc<AccessLookup> = Arc::new(move |ip| {
        dns.read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip)
            .map(|l| l.dns.clone())
    });
    let listen = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, sandfork_network::dns::FORWARDER_PORT);
    match DnsForwarder::start(listen, upstream, lookup, answers) {
        Ok(f) => {
            tracing::info!("networking: guests' DNS forwarded to {upstream}");
            Some(f)
        }
        Err(e) => {
            tracing::warn!(
                "networking: the guests' DNS forwarder cannot start on {listen} ({e}): \
                 sandboxes cannot resolve names"
            );
            None
        }
    }
}

/// A slot held by a guest: given back to the pool when dropped, which
/// [`crate::node::launch::Launched`] does after its VMM is gone.
#[derive(Debug)]
pub struct Lease {
    /// `Some` until dropped or kept (which take it out).
    slot: Option<Slot>,
    /// The slot's id and address, and its namespace: fixed for its life.
    record: SlotRecord,
    netns: std::path::PathBuf,
    slots: Arc<Slots>,
}

impl Lease {
    pub fn record(&self) -> SlotRecord {
        self.record
    }

    /// The slot's namespace, to start the VMM in.
    pub fn netns(&self) -> &std::path::Path {
        &self.netns
    }

    /// The policy in force (`None` never while the lease is held).
    pub fn policy(&self) -> Option<&EgressPolicy> {
        self.slot.as_ref().map(Slot::policy)
    }

    /// Replaces the slot's policy in one transaction; blocks.
    pub fn set_policy(&mut self, policy: EgressPolicy) -> Result<(), NetError> {
        let slots = self.slots.clone();
        let Some(slot) = self.slot.as_mut() else {
            return Err(NetError::UnknownSlot(self.record.id));
        };
        slots.with(|p| p.set_policy(slot, policy))?;
        // After the rules: a name the new policy allows resolves once its
        // traffic may pass, never before.
        slots.lease_dns(slot);
        Ok(())
    }

    /// Keeps the slot in place for the next server (a VMM left running at
    /// shutdown): it is adopted at the next start.
    pub fn keep(mut self) {
        if let Some(slot) = self.slot.take() {
            self.slots.forget_dns(&slot);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.slots.release(slot);
        }
    }
}
