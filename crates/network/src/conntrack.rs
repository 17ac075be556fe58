//! Where a connection NATed in a slot was really going: the slot's conntrack entry, asked
//! over ctnetlink by the tuple the node sees. The slot DNATs guest web traffic to the node's
//! egress proxy, so the proxy's socket shows only its own address; `SO_ORIGINAL_DST` would
//! answer from the node's conntrack, which never saw that NAT. The slot's entry has the
//! guest's intended destination in its original tuple and the proxy's view in its reply
//! tuple (proxy address -> the slot's host address, after the slot's SNAT).

use std::net::{Ipv4Addr, SocketAddrV4};

use nix::sys::socket::SockProtocol;

use crate::error::{Error, Result};
use crate::netlink::NlSocket;
use crate::nft::wire::{self, Attrs};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

/// A ctnetlink socket in the calling thread's network namespace.
#[derive(Debug)]
pub struct Conntrack {
    sock: NlSocket,
}

impl Conntrack {
    pub fn open() -> Result<Self> {
        Ok(Conntrack {
            sock: NlSocket::open(SockProtocol::NetlinkNetFilter)?,
        })
    }

    /// The original (source, destination) of the TCP connection whose reply direction goes
    /// from `reply_src` to `reply_dst`.
    pub fn tcp_original(
        &mut self,
        reply_src: SocketAddrV4,
        reply_dst: SocketAddrV4,
    ) -> Result<(SocketAddrV4, SocketAddrV4)> {
        let seq = self.sock.next_seq();
        let mut a = Attrs::new();
        a.nest(CTA_TUPLE_REPLY, |a| {
            a.nest(CTA_TUPLE_IP, |a| {
                a.bytes(CTA_IP_V4_SRC, &reply_src.ip().octets())
                    .bytes(CTA_IP_V4_DST, &reply_dst.ip().octets());
            });
            a.nest(CTA_TUPLE_PROTO, |a| {
                a.u8(CTA_PROTO_NUM, libc::IPPROTO_TCP as u8)
                    .bytes(CTA_PROTO_SRC_PORT, &reply_src.port().to_be_bytes())
                    .bytes(CTA_PROTO_DST_PORT, &reply_dst.port().to_be_bytes());
            });
        });
        let attrs = a.into_bytes();
        let mut m = Vec::with_capacity(20 + attrs.len());
        m.extend_from_slice(&((20 + attrs.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET).to_ne_bytes());
        m.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[libc::AF_INET as u8, 0, 0, 0]);
        m.extend_from_slice(&attrs);
        let answer = self.sock.dump_one(&m, seq, "conntrack get")?;
        parse_original(&answer).ok_or_else(|| {
            Error::netlink(
                "conntrack get",
                std::io::Error::other("answer without an original tuple"),
            )
        })
    }
}

/// The original tuple's TCP addresses of a ctnetlink answer (header included).
fn parse_original(msg: &[u8]) -> Option<(SocketAddrV4, SocketAddrV4)> {
    let attrs = msg.get(20..)?;
    let (_, orig) = wire::parse_attrs(attrs).find(|(k, _)| *k == CTA_TUPLE_ORIG)?;
    let (mut src, mut dst, mut sport, mut dport, mut proto) = (None, None, None, None, None);
    for (k, v) in wire::parse_attrs(orig) {
        match k {
            CTA_TUPLE_IP => {
                for (k, v) in wire::parse_attrs(v) {
                    let ip = <[u8; 4]>::try_from(v).ok().map(Ipv4Addr::from);
                    match k {
                        CTA_IP_V4_SRC => src = ip,
                        CTA_IP_V4_DST => dst = ip,
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (k, v) in wire::parse_attrs(v) {
                    let port = v.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]]));
                    match k {
                        CTA_PROTO_NUM => proto = v.first().copied(),
                        CTA_PROTO_SRC_PORT => sport = port,
                        CTA_PROTO_DST_PORT => dport = port,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    if proto != Some(libc::IPPROTO_TCP as u8) {
        return None;
    }
    Some((
        SocketAddrV4::new(src?, sport?),
        SocketAddrV4::new(dst?, dport?),
    ))
}

/// [`Conntrack::tcp_original`] in the namespace anchored at `netns` (a slot's).
pub fn tcp_original_in(
    netns: &std::path::Path,
    reply_src: SocketAddrV4,
    reply_dst: SocketAddrV4,
) -> Result<(SocketAddrV4, SocketAddrV4)> {
    crate::run_in_netns(netns, || {
        Conntrack::open()?.tcp_original(reply_src, reply_dst)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_original_tuple_is_read_from_an_answer() {
        let mut a = Attrs::new();
        a.nest(CTA_TUPLE_ORIG, |a| {
            a.nest(CTA_TUPLE_IP, |a| {
                a.bytes(CTA_IP_V4_SRC, &[169, 254, 0, 21])
                    .bytes(CTA_IP_V4_DST, &[203, 0, 113, 10]);
            });
            a.nest(CTA_TUPLE_PROTO, |a| {
                a.u8(CTA_PROTO_NUM, 6)
                    .bytes(CTA_PROTO_SRC_PORT, &40000u16.to_be_bytes())
                    .bytes(CTA_PROTO_DST_PORT, &443u16.to_be_bytes());
            });
        });
        let mut msg = vec![0u8; 20];
        msg.extend_from_slice(&a.into_bytes());
        assert_eq!(
            parse_original(&msg),
            Some((
                "169.254.0.21:40000".parse().unwrap(),
                "203.0.113.10:443".parse().unwrap()
            ))
        );
        assert_eq!(parse_original(&msg[..30]), None);
        assert_eq!(parse_original(&[]), None);
    }
}
