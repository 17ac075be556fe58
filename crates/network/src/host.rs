//! The host side: the namespace the slot veths' host ends live in (the node's own, or a test's),
//! its sockets, the start-up checks, and the node-wide table.

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::netns;
use crate::nft::{Nft, host_table};
use crate::plan::{AddressPlan, Cidr4, HOST_VETH_PREFIX, slot_id_from_name};
use crate::policy::always_deny;
use crate::rtnl::Rtnl;

/// What the host side needs to know.
#[derive(Clone, Debug)]
pub struct HostConfig {
    pub plan: AddressPlan,
    /// Where slot anchors live (`<runtime dir>/netns`).
    pub anchor_dir: PathBuf,
    /// The host namespace; None: this process's.
    pub host_netns: Option<PathBuf>,
    /// The link toward the internet; None: the default route's.
    pub uplink: Option<String>,
    /// Always-deny additions (the operator's), on top of the fixed set and the node's addresses.
    pub extra_deny: Vec<Cidr4>,
    /// Node ports guests may open, (IP protocol, port): the DNS forwarder's and the egress
    /// proxy's by default.
    pub open_ports: Vec<(u8, u16)>,
}

impl HostConfig {
    pub fn new(anchor_dir: impl Into<PathBuf>) -> Self {
        HostConfig {
            plan: AddressPlan::default(),
            anchor_dir: anchor_dir.into(),
            host_netns: None,
            uplink: None,
            extra_deny: Vec::new(),
            open_ports: vec![
                (libc::IPPROTO_UDP as u8, crate::plan::DNS_FORWARDER_PORT),
                (libc::IPPROTO_TCP as u8, crate::plan::DNS_FORWARDER_PORT),
                (libc::IPPROTO_TCP as u8, crate::plan::EGRESS_PROXY_HTTP_PORT),
                (libc::IPPROTO_TCP as u8, crate::plan::EGRESS_PROXY_TLS_PORT),
            ],
        }
    }
}

pub(crate) struct Host {
    pub ns: OwnedFd,
    pub rtnl: Mutex<Rtnl>,
    pub plan: AddressPlan,
    pub always_deny: Vec<Cidr4>,
    pub anchor_dir: PathBuf,
    pub uplink: String,
    /// What the operator should know (someone else's forward chain with a drop policy).
    pub warnings: Vec<String>,
}

impl Host {
    /// Opens the host namespace, checks the plan against its routes, turns forwarding on and
    /// installs the host table.
    pub fn open(cfg: &HostConfig) -> Result<Host> {
        cfg.plan.validate()?;
        let ns = netns::open(
            cfg.host_netns
                .as_deref()
                .unwrap_or(Path::new("/proc/self/ns/net")),
        )?;
        let anchor_dir = netns::prepare_anchor_dir(&cfg.anchor_dir)?;
        let (rtnl, uplink, own, warnings) = netns::run_in(&ns, || {
            let mut rtnl = Rtnl::open()?;
            let links = rtnl.links()?;
            let ours: Vec<u32> = links
                .iter()
                .filter(|l| slot_id_from_name(&l.name, HOST_VETH_PREFIX).is_some())
                .map(|l| l.index)
                .collect();
            let routes = rtnl.routes()?;
            // Routes through our own (stale) veths are ours, not a clash.
            let foreign: Vec<Cidr4> = routes
                .iter()
                .filter(|(_, oif)| oif.is_none_or(|i| !ours.contains(&i)))
                .map(|(c, _)| *c)
                .collect();
            cfg.plan.check_routes(&foreign)?;
            let uplink = match &cfg.uplink {
                Some(u) => u.clone(),
                None => {
                    let oif = routes
                        .iter()
                        .find(|(c, _)| c.prefix_len() == 0)
                        .and_then(|(_, oif)| *oif)
                        .ok_or_else(|| {
                            Error::Plan("no default route: configure the uplink".into())
                        })?;
                    links
                        .iter()
                        .find(|l| l.index == oif)
                        .map(|l| l.name.clone())
                        .ok_or_else(|| Error::Plan("default route's link not found".into()))?
                }
            };
            let own: Vec<Ipv4Addr> = rtnl.addresses()?;
            netns::sysctl("net/ipv4/ip_forward", "1")?;
            let mut nft = Nft::open()?;
            let table = host_table::table(&uplink, cfg.plan.host_ips, &cfg.open_ports);
            nft.commit("host table", |b| {
                crate::nft::rules::replace_table(b, &table)
            })?;
            let warnings = nft
                .forward_drop_chains()?
                .into_iter()
                .map(|c| {
                    let family = if c.family == crate::nft::wire::NFPROTO_INET { "inet" } else { "ip" };
                    format!(
                        "the forward chain {} of table {family} {} drops by default: sandboxes are \
                         offline unless one of its rules accepts traffic from and to the sfv-* links",
                        c.chain, c.table
                    )
                })
                .collect::<Vec<String>>();
            Ok((rtnl, uplink, own, warnings))
        })?;
        let mut extra = cfg.extra_deny.clone();
        extra.extend(own.into_iter().map(Cidr4::host));
        Ok(Host {
            ns,
            rtnl: Mutex::new(rtnl),
            plan: cfg.plan.clone(),
            always_deny: always_deny(&extra),
            anchor_dir,
            uplink,
            warnings,
        })
    }

    /// Removes the host table (a clean stop with no slots left).
    pub fn remove_table(&self) -> Result<()> {
        netns::run_in(&self.ns, || {
            Nft::open()?.commit("remove host table", |b| {
                crate::nft::rules::delete_table(b, host_table::TABLE)
            })
        })
    }
}
