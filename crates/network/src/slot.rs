//! One slot: its namespace, veth, tap and table; made, re-policed, reset and removed.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::host::Host;
use crate::netns;
use crate::nft::{Nft, rules, slot_table};
use crate::plan::{
    Cidr4, GATEWAY_IP, GUEST_IP, GUEST_MAC, GUEST_PREFIX_LEN, MTU, SLOT_VETH_NAME, SlotAddrs,
    TAP_MAC, TAP_NAME,
};
use crate::policy::EgressPolicy;
use crate::rtnl::Rtnl;

/// A ready network slot. Dropping it leaves the slot in place (it is anchored); give it back to
/// the pool to recycle or remove it.
#[derive(Debug)]
pub struct Slot {
    addrs: SlotAddrs,
    anchor: PathBuf,
    policy: EgressPolicy,
}

impl Slot {
    pub fn id(&self) -> u32 {
        self.addrs.id
    }

    /// Addresses and names of the slot; `host_ip` is where the node reaches the guest.
    pub fn addrs(&self) -> &SlotAddrs {
        &self.addrs
    }

    /// Opens the slot's network namespace: `setns(fd, CLONE_NEWNET)` before spawning the
    /// VMM. Slots keep no fd open (thousands of sandboxes, thousands of fds); the anchor is
    /// opened when needed.
    pub fn open_netns(&self) -> Result<OwnedFd> {
        netns::open(&self.anchor)
    }

    /// The anchor file (the namespace for `nsenter --net=`).
    pub fn anchor(&self) -> &std::path::Path {
        &self.anchor
    }

    /// The policy in force.
    pub fn policy(&self) -> &EgressPolicy {
        &self.policy
    }

    /// Runs `f` on a thread inside the slot namespace (opening its tap, for one).
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        netns::run_in(&self.open_netns()?, f)
    }
}

/// Makes slot `id` with the default policy.
pub(crate) fn create(host: &Host, id: u32) -> Result<Slot> {
    let addrs = host.plan.slot(id)?;
    let anchor = host.anchor_dir.join(&addrs.anchor);
    let policy = EgressPolicy::default();
    let ((), _ns) = netns::create_anchored(&anchor, |_own| {
        // IPv6 off for every link made from here on, before any is made.
        if std::path::Path::new("/proc/sys/net/ipv6").exists() {
            netns::sysctl("net/ipv6/conf/all/disable_ipv6", "1")?;
            netns::sysctl("net/ipv6/conf/default/disable_ipv6", "1")?;
        }
        netns::sysctl("net/ipv4/ip_forward", "1")?;
        let mut rt = Rtnl::open()?;
        rt.add_veth(SLOT_VETH_NAME, &addrs.host_veth, host.ns.as_fd(), MTU)?;
        crate::tap::create_persistent_tap(TAP_NAME)?;
        // The host end's MAC is resolved once per slot life; a lost ARP then costs 100 ms,
        // not a second (the guest side needs none: its entry is permanent).
        netns::sysctl(
            &format!("net/ipv4/neigh/{SLOT_VETH_NAME}/retrans_time_ms"),
            "100",
        )?;
        // Index lookups by ioctl: cheaper than a netlink GETLINK with all its attributes.
        let eth0 = nix::net::if_::if_nametoindex(SLOT_VETH_NAME)
            .map_err(|e| Error::sys("eth0 index", e))?;
        let tap =
            nix::net::if_::if_nametoindex(TAP_NAME).map_err(|e| Error::sys("tap0 index", e))?;
        rt.batch("configure slot links", |rt| {
            rt.set_up(1, None)?; // lo is always index 1 in a new namespace
            rt.add_addr(eth0, addrs.veth_slot_ip, 31)?;
            rt.set_up(eth0, None)?;
            rt.add_route(
                Cidr4::new(std::net::Ipv4Addr::UNSPECIFIED, 0)?,
                Some(addrs.veth_host_ip),
                eth0,
            )?;
            address_tap(rt, tap)
        })?;

        let table = slot_table::table(
            addrs.host_ip,
            addrs.veth_host_ip,
            &host.always_deny,
            &policy,
        );
        Nft::open()?.commit("slot table", |b| rules::add_table(b, &table))?;

        // The host end, from this thread through the host namespace's socket.
        let mut hr = crate::lock(&host.rtnl);
        let veth = hr.index(&addrs.host_veth)?;
        let v6 = hr.no_ipv6_addrs(veth);
        // A host without IPv6 has nothing to turn off.
        if let Err(e) = v6
            && e.errno() != Some(libc::EAFNOSUPPORT)
        {
            return Err(e);
        }
        hr.batch("configure host veth", |hr| {
            hr.add_addr(veth, addrs.veth_host_ip, 31)?;
            hr.set_up(veth, None)?;
            hr.add_route(Cidr4::host(addrs.host_ip), Some(addrs.veth_slot_ip), veth)
        })?;
        Ok(())
    })?;
    Ok(Slot {
        addrs,
        anchor,
        policy,
    })
}

/// The guest side of a slot on link `tap` (requests only, for a batch): the gateway's
/// address, the link up with its MAC, and the guest's neighbour entry.
pub(crate) fn address_tap(rt: &mut Rtnl, tap: u32) -> Result<()> {
    rt.add_addr(tap, GATEWAY_IP, GUEST_PREFIX_LEN)?;
    rt.set_up(tap, Some(TAP_MAC))?;
    rt.add_permanent_neighbour(tap, GUEST_IP, GUEST_MAC)
}

/// Takes over a slot that exists since before a restart; its table is rewritten with
/// `policy` (the stored one), so nothing older survives.
pub(crate) fn adopt(host: &Host, id: u32, policy: EgressPolicy) -> Result<Slot> {
    let addrs = host.plan.slot(id)?;
    let anchor = host.anchor_dir.join(&addrs.anchor);
    let ns = netns::open(&anchor)?;
    // Without its host end the slot is no use (the caller then removes what is left).
    crate::lock(&host.rtnl).index(&addrs.host_veth)?;
    let table = slot_table::table(
        addrs.host_ip,
        addrs.veth_host_ip,
        &host.always_deny,
        &policy,
    );
    netns::run_in(&ns, || {
        Nft::open()?.commit("slot table", |b| rules::replace_table(b, &table))
    })?;
    Ok(Slot {
        addrs,
        anchor,
        policy,
    })
}

/// Adds to `b`: the slot's user and proxy chains replaced with `policy`'s.
fn replace_policy(b: &mut crate::nft::wire::Batch, addrs: &SlotAddrs, policy: &EgressPolicy) {
    let user = slot_table::user_rules(policy);
    let proxy = slot_table::proxy_rules(policy, addrs.veth_host_ip);
    rules::replace_chain(b, slot_table::TABLE, slot_table::USER_CHAIN, &user);
    rules::replace_chain(b, slot_table::TABLE, slot_table::PROXY_CHAIN, &proxy);
}

/// Replaces the slot's policy (user rules, proxy redirects) in one transaction.
pub(crate) fn set_policy(slot: &mut Slot, policy: EgressPolicy) -> Result<()> {
    let addrs = slot.addrs.clone();
    netns::run_in(&slot.open_netns()?, || {
        Nft::open()?.commit("replace policy", |b| replace_policy(b, &addrs, &policy))
    })?;
    slot.policy = policy;
    Ok(())
}

/// Resets a returned slot for its next sandbox: default policy, no conntrack state.
pub(crate) fn reset(slot: &mut Slot) -> Result<()> {
    let addrs = slot.addrs.clone();
    netns::run_in(&slot.open_netns()?, || {
        let mut nft = Nft::open()?;
        nft.commit("reset policy", |b| {
            replace_policy(b, &addrs, &EgressPolicy::default())
        })?;
        nft.flush_conntrack()
    })?;
    slot.policy = EgressPolicy::default();
    Ok(())
}

/// Removes the slot: host veth (its peer and routes go with it), then the anchor; the
/// namespace is freed when its last user (a VMM still in it) is gone.
pub(crate) fn remove(host: &Host, slot: Slot) -> Result<()> {
    remove_parts(host, &slot.addrs)
}

/// Removes whatever of slot `addrs` exists: used for stale slots found at start too.
pub(crate) fn remove_parts(host: &Host, addrs: &SlotAddrs) -> Result<()> {
    {
        let mut hr = crate::lock(&host.rtnl);
        match hr.index(&addrs.host_veth) {
            Ok(i) => hr.del_link(i)?,
            Err(e) if e.errno() == Some(libc::ENODEV) => {}
            Err(e) => return Err(e),
        }
    }
    netns::remove_anchor(&host.anchor_dir.join(&addrs.anchor))
}
