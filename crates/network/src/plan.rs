//! The address plan: the guest-facing constants every slot shares (a snapshot ABI: a template
//! snapshot carries them, so they never change once templates exist) and the per-slot host-side
//! addresses and names.
//!
//! The guest agent and the VMM use the constants from here; nothing else in the workspace
//! should spell these numbers.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Version of the guest-facing constants below; recorded in template metadata so a change can
/// never silently meet an old snapshot.
pub const NET_ABI_VERSION: u32 = 1;
/// The guest's address on its `eth0` (every guest, every slot).
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
/// The guest's gateway: the slot-side tap's address.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
/// Prefix length of the guest link (169.254.0.20/30).
pub const GUEST_PREFIX_LEN: u8 = 30;
/// The guest NIC's MAC (the VMM's `guest_mac`).
pub const GUEST_MAC: [u8; 6] = [0x02, 0xfc, 0x00, 0x00, 0x00, 0x05];
/// The tap's MAC, fixed so a resumed or forked guest's cached gateway entry stays valid.
pub const TAP_MAC: [u8; 6] = [0x02, 0xfc, 0x00, 0x00, 0x00, 0x06];
/// The tap's name inside every slot namespace (the VMM's `host_dev_name`).
pub const TAP_NAME: &str = "tap0";
/// The slot end of the veth, inside the slot namespace.
pub const SLOT_VETH_NAME: &str = "eth0";
/// Prefix of the host ends of slot veths (`sfv-<i>`), also what reclaim looks for.
pub const HOST_VETH_PREFIX: &str = "sfv-";
/// Prefix of slot namespace anchors (`sf-<i>`) in the runtime directory.
pub const ANCHOR_PREFIX: &str = "sf-";
/// The port guests send DNS queries to (on the gateway).
pub const GUEST_DNS_PORT: u16 = 53;
/// The node's DNS forwarder's port on the slot veths' host ends: each slot DNATs its
/// gateway's DNS port there, so one socket in the host namespace serves every slot.
/// In IANA's dynamic range (never assigned, so no mDNS clash as 5353 had) and above
/// Linux's default ephemeral ports (32768-60999), so no outgoing socket holds it.
pub const DNS_FORWARDER_PORT: u16 = 61053;
/// The node's egress proxy ports on the host side: the slot of a sandbox with domain rules
/// DNATs the guest's TCP to port 80 to the first (HTTP, checked by Host) and to port 443 to
/// the second (TLS, checked by SNI).
pub const EGRESS_PROXY_HTTP_PORT: u16 = 15080;
pub const EGRESS_PROXY_TLS_PORT: u16 = 15443;
/// The guest ports whose TCP goes through the egress proxy, and the proxy port of each.
pub const PROXIED_PORTS: [(u16, u16); 2] =
    [(80, EGRESS_PROXY_HTTP_PORT), (443, EGRESS_PROXY_TLS_PORT)];
/// Guest MTU the tap and veths use.
pub const MTU: u32 = 1500;

/// An IPv4 network in CIDR notation, normalised (host bits cleared).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr4 {
    addr: Ipv4Addr,
    len: u8,
}

impl Cidr4 {
    /// `addr/len` with the host bits of `addr` cleared.
    pub fn new(addr: Ipv4Addr, len: u8) -> Result<Self> {
        if len > 32 {
            return Err(Error::Plan(format!("prefix length {len} > 32")));
        }
        Ok(Cidr4 {
            addr: Ipv4Addr::from(u32::from(addr) & mask(len)),
            len,
        })
    }

    /// `addr/len` for constants, in a `const` item or block: a length over 32 then
    /// fails the build rather than a run ([`Cidr4::new`] for what is read at run time).
    pub const fn fixed(addr: Ipv4Addr, len: u8) -> Self {
        assert!(len <= 32, "prefix length > 32");
        Cidr4 {
            addr: Ipv4Addr::from_bits(addr.to_bits() & mask(len)),
            len,
        }
    }

    /// A single address as a /32.
    pub fn host(addr: Ipv4Addr) -> Self {
        Cidr4 { addr, len: 32 }
    }

    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    /// The netmask as 4 network-order bytes.
    pub fn mask_octets(&self) -> [u8; 4] {
        mask(self.len).to_be_bytes()
    }

    /// Number of addresses (2^(32-len)), as u64 so /0 fits.
    pub fn size(&self) -> u64 {
        1u64 << (32 - self.len)
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & mask(self.len) == u32::from(self.addr)
    }

    /// Whether the two networks share any address.
    pub fn overlaps(&self, other: &Cidr4) -> bool {
        let len = self.len.min(other.len);
        u32::from(self.addr) & mask(len) == u32::from(other.addr) & mask(len)
    }

    /// The `n`-th address of the network.
    fn nth(&self, n: u64) -> Option<Ipv4Addr> {
        (n < self.size()).then(|| Ipv4Addr::from(u32::from(self.addr) + n as u32))
    }
}

const fn mask(len: u8) -> u32 {
    if len == 0 { 0 } else { u32::MAX << (32 - len) }
}

impl FromStr for Cidr4 {
    type Err = Error;

    /// `a.b.c.d/len` or a bare `a.b.c.d` (a /32). Host bits must be zero, as E2B's Go parser
    /// normalises them we do too.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Plan(format!("{s:?} is not an IPv4 address or CIDR"));
        match s.split_once('/') {
            Some((a, l)) => {
                let addr: Ipv4Addr = a.parse().map_err(|_| bad())?;
                let len: u8 = l.parse().map_err(|_| bad())?;
                if len > 32 || l.starts_with('+') {
                    return Err(bad());
                }
                Cidr4::new(addr, len)
            }
            None => Ok(Cidr4::host(s.parse().map_err(|_| bad())?)),
        }
    }
}

impl fmt::Display for Cidr4 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl fmt::Debug for Cidr4 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl TryFrom<String> for Cidr4 {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<Cidr4> for String {
    fn from(c: Cidr4) -> String {
        c.to_string()
    }
}

/// Where the per-slot host-side addresses come from; checked against the host's routes at start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressPlan {
    /// Slot i's host address is this network's i-th address (i >= 1; 0 is the network).
    pub host_ips: Cidr4,
    /// Slot i's veth /31 is the i-th pair of this network: host end 2i, slot end 2i+1.
    pub veth_ips: Cidr4,
    /// Number of slots, ids 1..=slots.
    pub slots: u32,
}

impl Default for AddressPlan {
    fn default() -> Self {
        AddressPlan {
            host_ips: const { Cidr4::fixed(Ipv4Addr::new(10, 11, 0, 0), 16) },
            veth_ips: const { Cidr4::fixed(Ipv4Addr::new(10, 12, 0, 0), 16) },
            slots: 1024,
        }
    }
}

/// The addresses and names of one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotAddrs {
    pub id: u32,
    /// The address the host (proxy, masquerade) knows this slot's guest by.
    pub host_ip: Ipv4Addr,
    /// The host end of the veth.
    pub veth_host_ip: Ipv4Addr,
    /// The slot end of the veth (`eth0` in the slot namespace).
    pub veth_slot_ip: Ipv4Addr,
    /// The host end's name, `sfv-<id>`.
    pub host_veth: String,
    /// The anchor's file name, `sf-<id>`.
    pub anchor: String,
}

impl AddressPlan {
    /// Checks the ranges are usable and can hold `slots` slots.
    pub fn validate(&self) -> Result<()> {
        if self.slots == 0 {
            return Err(Error::Plan("slots must be at least 1".into()));
        }
        // Host ids: 1..=slots, the last address of the range stays unused (broadcast-like).
        if u64::from(self.slots) + 2 > self.host_ips.size() {
            return Err(Error::Plan(format!(
                "{} slots do not fit host range {}",
                self.slots, self.host_ips
            )));
        }
        if (u64::from(self.slots) + 1) * 2 > self.veth_ips.size() {
            return Err(Error::Plan(format!(
                "{} slots do not fit veth range {}",
                self.slots, self.veth_ips
            )));
        }
        if self.host_ips.overlaps(&self.veth_ips) {
            return Err(Error::Plan(format!(
                "host range {} overlaps veth range {}",
                self.host_ips, self.veth_ips
            )));
        }
        let guest = Cidr4::new(GUEST_IP, GUEST_PREFIX_LEN)?;
        for r in [self.host_ips, self.veth_ips] {
            if r.overlaps(&guest) {
                return Err(Error::Plan(format!("{r} overlaps the guest link {guest}")));
            }
        }
        // Host veth names must fit IFNAMSIZ (15 characters).
        if HOST_VETH_PREFIX.len() + self.slots.to_string().len() > 15 {
            return Err(Error::Plan("slot ids too long for interface names".into()));
        }
        Ok(())
    }

    /// The addresses of slot `id` (1..=slots).
    pub fn slot(&self, id: u32) -> Result<SlotAddrs> {
        if id == 0 || id > self.slots {
            return Err(Error::UnknownSlot(id));
        }
        let host_ip = self
            .host_ips
            .nth(u64::from(id))
            .ok_or(Error::UnknownSlot(id))?;
        let veth_host_ip = self
            .veth_ips
            .nth(2 * u64::from(id))
            .ok_or(Error::UnknownSlot(id))?;
        let veth_slot_ip = self
            .veth_ips
            .nth(2 * u64::from(id) + 1)
            .ok_or(Error::UnknownSlot(id))?;
        Ok(SlotAddrs {
            id,
            host_ip,
            veth_host_ip,
            veth_slot_ip,
            host_veth: format!("{HOST_VETH_PREFIX}{id}"),
            anchor: format!("{ANCHOR_PREFIX}{id}"),
        })
    }

    /// Refuses to start when the host already routes into one of our ranges; `routes` are the
    /// host's IPv4 route destinations (any table) other than ours.
    pub fn check_routes(&self, routes: &[Cidr4]) -> Result<()> {
        for r in routes {
            if r.prefix_len() == 0 {
                continue; // a default route covers everything and clashes with nothing
            }
            for (what, ours) in [("host", self.host_ips), ("veth", self.veth_ips)] {
                if r.overlaps(&ours) {
                    return Err(Error::Plan(format!(
                        "the host routes {r}, which overlaps sandfork's slot {what} range {ours}; \
                         configure another range"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Parses a slot id out of a name with `prefix` (`sfv-12`, `sf-12`).
pub fn slot_id_from_name(name: &str, prefix: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_plan_matches_e2b_numbers() {
        let plan = AddressPlan::default();
        plan.validate().unwrap();
        let s = plan.slot(1).unwrap();
        assert_eq!(s.host_ip, Ipv4Addr::new(10, 11, 0, 1));
        assert_eq!(s.veth_host_ip, Ipv4Addr::new(10, 12, 0, 2));
        assert_eq!(s.veth_slot_ip, Ipv4Addr::new(10, 12, 0, 3));
        assert_eq!(s.host_veth, "sfv-1");
        assert_eq!(s.anchor, "sf-1");
        let s = plan.slot(300).unwrap();
        assert_eq!(s.host_ip, Ipv4Addr::new(10, 11, 1, 44));
        assert_eq!(s.veth_host_ip, Ipv4Addr::new(10, 12, 2, 88));
        assert!(plan.slot(0).is_err());
        assert!(plan.slot(1025).is_err());
    }

    #[test]
    fn guest_constants_are_one_link() {
        let link = Cidr4::new(GUEST_IP, GUEST_PREFIX_LEN).unwrap();
        assert!(link.contains(GATEWAY_IP));
        assert_eq!(link.to_string(), "169.254.0.20/30");
        assert_ne!(GUEST_MAC, TAP_MAC);
    }

    #[test]
    fn validate_refuses_bad_plans() {
        let d = AddressPlan::default;
        assert!(
            AddressPlan {
                slots: 70000,
                ..d()
            }
            .validate()
            .is_err()
        );
        let p = AddressPlan {
            veth_ips: "10.11.128.0/17".parse().unwrap(),
            ..d()
        };
        assert!(p.validate().unwrap_err().to_string().contains("overlaps"));
        let p = AddressPlan {
            host_ips: "169.254.0.0/16".parse().unwrap(),
            ..d()
        };
        assert!(p.validate().is_err());
        let p = AddressPlan {
            host_ips: "10.11.0.0/24".parse().unwrap(),
            veth_ips: "10.12.0.0/24".parse().unwrap(),
            slots: 127,
        };
        p.validate().unwrap();
        assert!(AddressPlan { slots: 128, ..p }.validate().is_err());
    }

    #[test]
    fn route_clash_is_reported() {
        let p = AddressPlan::default();
        p.check_routes(&[
            "0.0.0.0/0".parse().unwrap(),
            "192.168.1.0/24".parse().unwrap(),
        ])
        .unwrap();
        let e = p
            .check_routes(&["10.0.0.0/8".parse().unwrap()])
            .unwrap_err();
        assert!(e.to_string().contains("10.0.0.0/8"), "{e}");
        assert!(p.check_routes(&["10.12.5.7/32".parse().unwrap()]).is_err());
    }

    #[test]
    fn cidr_parsing() {
        let c: Cidr4 = "10.1.2.3/8".parse().unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert_eq!(
            "1.2.3.4".parse::<Cidr4>().unwrap().to_string(),
            "1.2.3.4/32"
        );
        for bad in [
            "",
            "1.2.3",
            "1.2.3.4/33",
            "1.2.3.4/",
            "example.com",
            "::1",
            "1.2.3.4/+8",
        ] {
            assert!(bad.parse::<Cidr4>().is_err(), "{bad}");
        }
        let all: Cidr4 = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(Ipv4Addr::new(8, 8, 8, 8)));
        assert_eq!(all.mask_octets(), [0, 0, 0, 0]);
        assert_eq!(c.mask_octets(), [255, 0, 0, 0]);
    }

    #[test]
    fn slot_names_parse() {
        assert_eq!(slot_id_from_name("sfv-12", HOST_VETH_PREFIX), Some(12));
        assert_eq!(slot_id_from_name("sf-3", ANCHOR_PREFIX), Some(3));
        for bad in ["sfv-", "sfv-01", "sfv-1a", "eth0", "sf-x"] {
            assert_eq!(slot_id_from_name(bad, HOST_VETH_PREFIX), None, "{bad}");
        }
    }
}
