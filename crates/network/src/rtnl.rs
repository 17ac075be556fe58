//! Links, addresses, routes and neighbours over rtnetlink (messages from
//! `netlink-packet-route`), on a socket bound to one network namespace.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoVeth, LinkAttribute,
    LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use nix::sys::socket::SockProtocol;

use crate::error::{Error, Result};
use crate::netlink::NlSocket;
use crate::plan::Cidr4;

pub(crate) struct Rtnl {
    sock: NlSocket,
    /// Requests held for one send (see [`Rtnl::batch`]).
    pending: Option<(Vec<u8>, Vec<u32>)>,
}

/// A link as a dump lists it.
#[derive(Debug, Clone)]
pub(crate) struct Link {
    pub index: u32,
    pub name: String,
}

impl Rtnl {
    /// A socket in the calling thread's network namespace.
    pub fn open() -> Result<Self> {
        Ok(Rtnl {
            sock: NlSocket::open(SockProtocol::NetlinkRoute)?,
            pending: None,
        })
    }

    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16, what: &'static str) -> Result<()> {
        let seq = self.sock.next_seq();
        let bytes = encode(msg, flags | NLM_F_REQUEST | NLM_F_ACK, seq);
        if let Some((buf, acks)) = &mut self.pending {
            buf.extend_from_slice(&bytes);
            acks.push(seq);
            return Ok(());
        }
        self.sock.transact(&bytes, &[seq], what)
    }

    /// Sends the requests `f` makes in one datagram and waits for all their acks: the kernel
    /// runs them in order, one system call instead of one each. `f` may only make requests
    /// (no lookups), since answers come after it returns.
    pub fn batch(
        &mut self,
        what: &'static str,
        f: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        self.pending = Some((Vec::new(), Vec::new()));
        let r = f(self);
        let pending = self.pending.take();
        r?;
        // `None` only when `f` nested a batch (none does), which sent and took the buffer.
        let Some((buf, acks)) = pending else {
            return Ok(());
        };
        if acks.is_empty() {
            return Ok(());
        }
        self.sock.transact(&buf, &acks, what)
    }

    fn dump(
        &mut self,
        msg: RouteNetlinkMessage,
        what: &'static str,
    ) -> Result<Vec<RouteNetlinkMessage>> {
        let seq = self.sock.next_seq();
        let bytes = encode(msg, NLM_F_REQUEST | NLM_F_DUMP, seq);
        let mut out = Vec::new();
        for whole in self.sock.dump(&bytes, seq, what)? {
            // Messages this crate's version cannot parse are skipped, not fatal.
            if let Ok(m) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&whole)
                && let NetlinkPayload::InnerMessage(inner) = m.payload
            {
                out.push(inner);
            }
        }
        Ok(out)
    }

    /// A veth whose end `name` is made in this socket's namespace and whose peer `peer` is
    /// made directly in the namespace `peer_ns` (no move: a move waits for an RCU barrier).
    pub fn add_veth(
        &mut self,
        name: &str,
        peer: &str,
        peer_ns: BorrowedFd<'_>,
        mtu: u32,
    ) -> Result<()> {
        let mut peer_msg = LinkMessage::default();
        peer_msg.attributes = vec![
            LinkAttribute::IfName(peer.into()),
            LinkAttribute::Mtu(mtu),
            LinkAttribute::NetNsFd(peer_ns.as_raw_fd()),
        ];
        let mut msg = LinkMessage::default();
        msg.attributes = vec![
            LinkAttribute::IfName(name.into()),
            LinkAttribute::Mtu(mtu),
            LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Veth),
                LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_msg))),
            ]),
        ];
        self.request(
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_CREATE | NLM_F_EXCL,
            "create veth",
        )
    }

    /// Every link of the namespace.
    pub fn links(&mut self) -> Result<Vec<Link>> {
        let mut out = Vec::new();
        for m in self.dump(
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            "list links",
        )? {
            if let RouteNetlinkMessage::NewLink(l) = m {
                let name = l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                });
                if let Some(name) = name {
                    out.push(Link {
                        index: l.header.index,
                        name,
                    });
                }
            }
        }
        Ok(out)
    }

    /// The index of link `name`.
    pub fn index(&mut self, name: &str) -> Result<u32> {
        let mut msg = LinkMessage::default();
        msg.attributes = vec![LinkAttribute::IfName(name.into())];
        let seq = self.sock.next_seq();
        let bytes = encode(RouteNetlinkMessage::GetLink(msg), NLM_F_REQUEST, seq);
        // A GETLINK without DUMP answers one NEWLINK (then no ack); errors come as NLMSG_ERROR.
        let answers = self.sock.dump_one(&bytes, seq, "find link")?;
        let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&answers)
            .map_err(|e| Error::netlink("find link", std::io::Error::other(e.to_string())))?;
        match m.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => Ok(l.header.index),
            _ => Err(Error::netlink(
                "find link",
                std::io::Error::other("unexpected answer"),
            )),
        }
    }

    /// Sets a link up (and its MAC, when given).
    pub fn set_up(&mut self, index: u32, mac: Option<[u8; 6]>) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.header.flags = LinkFlags::Up;
        msg.header.change_mask = LinkFlags::Up;
        if let Some(mac) = mac {
            msg.attributes.push(LinkAttribute::Address(mac.to_vec()));
        }
        self.request(RouteNetlinkMessage::SetLink(msg), 0, "set link up")
    }

    /// No IPv6 addresses generated on link `index` (set before it goes up: no link-local).
    pub fn no_ipv6_addrs(&mut self, index: u32) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.attributes = vec![LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
            vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
        )])];
        self.request(RouteNetlinkMessage::SetLink(msg), 0, "addrgenmode none")
    }

    /// Deletes link `index` (a veth's peer goes with it).
    pub fn del_link(&mut self, index: u32) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        self.request(RouteNetlinkMessage::DelLink(msg), 0, "delete link")
    }

    /// Adds `ip/prefix` to link `index`; no broadcast (a /31 has none).
    pub fn add_addr(&mut self, index: u32, ip: Ipv4Addr, prefix: u8) -> Result<()> {
        let mut msg = AddressMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.prefix_len = prefix;
        msg.header.index = index;
        msg.attributes = vec![
            AddressAttribute::Local(IpAddr::V4(ip)),
            AddressAttribute::Address(IpAddr::V4(ip)),
        ];
        self.request(
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
            "add address",
        )
    }

    /// A route to `dst` out of link `oif`, via `gateway` when given (else on-link).
    pub fn add_route(&mut self, dst: Cidr4, gateway: Option<Ipv4Addr>, oif: u32) -> Result<()> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = AddressFamily::Inet;
        msg.header.destination_prefix_length = dst.prefix_len();
        msg.header.table = RouteHeader::RT_TABLE_MAIN;
        msg.header.protocol = RouteProtocol::Static;
        msg.header.kind = RouteType::Unicast;
        msg.header.scope = if gateway.is_some() {
            RouteScope::Universe
        } else {
            RouteScope::Link
        };
        if dst.prefix_len() > 0 {
            msg.attributes
                .push(RouteAttribute::Destination(RouteAddress::Inet(dst.addr())));
        }
        if let Some(gw) = gateway {
            msg.attributes
                .push(RouteAttribute::Gateway(RouteAddress::Inet(gw)));
        }
        msg.attributes.push(RouteAttribute::Oif(oif));
        self.request(
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
            "add route",
        )
    }

    /// Every IPv4 route destination in every table, with its output link.
    pub fn routes(&mut self) -> Result<Vec<(Cidr4, Option<u32>)>> {
        let mut req = RouteMessage::default();
        req.header.address_family = AddressFamily::Inet;
        let mut out = Vec::new();
        for m in self.dump(RouteNetlinkMessage::GetRoute(req), "list routes")? {
            let RouteNetlinkMessage::NewRoute(r) = m else {
                continue;
            };
            if r.header.kind != RouteType::Unicast {
                continue; // local, broadcast, ...: the host's own addresses, not networks
            }
            let mut dst = Ipv4Addr::UNSPECIFIED;
            let mut oif = None;
            for a in &r.attributes {
                match a {
                    RouteAttribute::Destination(RouteAddress::Inet(d)) => dst = *d,
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    _ => {}
                }
            }
            if let Ok(c) = Cidr4::new(dst, r.header.destination_prefix_length) {
                out.push((c, oif));
            }
        }
        Ok(out)
    }

    /// Every local IPv4 address of the namespace.
    pub fn addresses(&mut self) -> Result<Vec<Ipv4Addr>> {
        let mut req = AddressMessage::default();
        req.header.family = AddressFamily::Inet;
        let mut out = Vec::new();
        for m in self.dump(RouteNetlinkMessage::GetAddress(req), "list addresses")? {
            let RouteNetlinkMessage::NewAddress(a) = m else {
                continue;
            };
            for attr in &a.attributes {
                if let AddressAttribute::Local(IpAddr::V4(ip))
                | AddressAttribute::Address(IpAddr::V4(ip)) = attr
                    && !out.contains(ip)
                {
                    out.push(*ip);
                }
            }
        }
        Ok(out)
    }

    /// A permanent neighbour entry `ip -> mac` on link `index`: ARP can never change it and
    /// the first packet to the guest after a resume needs no resolution.
    pub fn add_permanent_neighbour(
        &mut self,
        index: u32,
        ip: Ipv4Addr,
        mac: [u8; 6],
    ) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.ifindex = index;
        msg.header.state = NeighbourState::Permanent;
        msg.attributes = vec![
            NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)),
            NeighbourAttribute::LinkLayerAddress(mac.to_vec()),
        ];
        self.request(
            RouteNetlinkMessage::NewNeighbour(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
            "add neighbour",
        )
    }
}

fn encode(msg: RouteNetlinkMessage, flags: u16, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut m = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
    m.finalize();
    let mut buf = vec![0; m.buffer_len()];
    m.serialize(&mut buf);
    buf
}
