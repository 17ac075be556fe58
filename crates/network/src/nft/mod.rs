//! nftables programmed in process over netlink (no libnftnl/libmnl, no `nft` binary): the
//! wire encoding, the expressions used, and the two tables (slot and host).

pub mod expr;
pub mod host_table;
pub mod rules;
pub mod slot_table;
pub mod wire;

use nix::sys::socket::SockProtocol;

use crate::error::Result;
use crate::netlink::NlSocket;
use wire::Batch;

/// An nf_tables netlink socket in one network namespace.
pub(crate) struct Nft {
    sock: NlSocket,
}

impl Nft {
    /// A socket in the calling thread's network namespace.
    pub fn open() -> Result<Self> {
        Ok(Nft {
            sock: NlSocket::open(SockProtocol::NetlinkNetFilter)?,
        })
    }

    /// Commits what `fill` adds as one transaction: all of it or, on an error, none of it.
    pub fn commit(&mut self, what: &'static str, fill: impl FnOnce(&mut Batch)) -> Result<()> {
        let mut batch = Batch::new(self.sock.next_seq());
        fill(&mut batch);
        let (bytes, acks, next) = batch.finish();
        self.sock.set_seq(next);
        self.sock.transact(&bytes, &acks, what)
    }
}

impl Nft {
    /// Deletes every conntrack entry of the namespace (a recycled slot keeps no state of the
    /// sandbox before it).
    pub fn flush_conntrack(&mut self) -> Result<()> {
        const NFNL_SUBSYS_CTNETLINK: u16 = 1;
        const IPCTNL_MSG_CT_DELETE: u16 = 2;
        let seq = self.sock.next_seq();
        let mut m = Vec::with_capacity(20);
        m.extend_from_slice(&20u32.to_ne_bytes());
        m.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE).to_ne_bytes());
        m.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[libc::AF_INET as u8, 0, 0, 0]);
        match self.sock.transact(&m, &[seq], "flush conntrack") {
            // No conntrack module loaded or nothing tracked yet.
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }
}

impl Nft {
    /// Whether table `inet <name>` exists in the namespace.
    pub fn table_exists(&mut self, name: &str) -> Result<bool> {
        let seq = self.sock.next_seq();
        let mut a = wire::Attrs::new();
        a.str(1, name); // NFTA_TABLE_NAME
        let attrs = a.into_bytes();
        let mut m = Vec::new();
        m.extend_from_slice(&((20 + attrs.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&((wire::NFNL_SUBSYS_NFTABLES << 8) | 1).to_ne_bytes()); // GETTABLE
        m.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[wire::NFPROTO_INET, 0, 0, 0]);
        m.extend_from_slice(&attrs);
        match self.sock.dump_one(&m, seq, "get table") {
            Ok(_) => Ok(true),
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Whether table `inet <name>` exists in the namespace at `netns` (tests, diagnostics).
pub fn table_exists_in(netns: &std::path::Path, name: &str) -> Result<bool> {
    crate::run_in_netns(netns, || Nft::open()?.table_exists(name))
}

/// A base chain of someone else's on the forward hook whose policy is drop (Docker's
/// `FORWARD DROP` through iptables-nft, a firewalld zone): forwarded slot traffic dies there
/// unless one of its rules accepts it, whatever our table says. iptables-legacy chains are
/// not visible here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForwardDrop {
    pub family: u8,
    pub table: String,
    pub chain: String,
}

impl Nft {
    /// Base chains on the forward hook with a drop policy, ours excluded.
    pub fn forward_drop_chains(&mut self) -> Result<Vec<ForwardDrop>> {
        let seq = self.sock.next_seq();
        let mut m = Vec::new();
        m.extend_from_slice(&20u32.to_ne_bytes());
        m.extend_from_slice(&((wire::NFNL_SUBSYS_NFTABLES << 8) | 4).to_ne_bytes()); // GETCHAIN
        m.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[0, 0, 0, 0]); // every family
        let mut out = Vec::new();
        for whole in self.sock.dump(&m, seq, "list chains")? {
            let Some(family) = whole.get(16).copied() else {
                continue;
            };
            if family != wire::NFPROTO_INET && family != wire::NFPROTO_IPV4 {
                continue;
            }
            let (mut table, mut chain, mut hook, mut policy) = (None, None, None, None);
            for (kind, value) in wire::parse_attrs(&whole[20.min(whole.len())..]) {
                match kind {
                    1 => table = wire::attr_str(value),
                    3 => chain = wire::attr_str(value),
                    4 => {
                        hook = wire::parse_attrs(value)
                            .find(|(k, _)| *k == 1)
                            .and_then(|(_, v)| wire::attr_be32(v))
                    }
                    5 => policy = wire::attr_be32(value),
                    _ => {}
                }
            }
            let ours = matches!(
                table.as_deref(),
                Some(host_table::TABLE) | Some(slot_table::TABLE)
            );
            if !ours
                && hook == Some(rules::Hook::Forward as u32)
                && policy == Some(expr::NF_DROP as u32)
            {
                out.push(ForwardDrop {
                    family,
                    table: table.unwrap_or_default(),
                    chain: chain.unwrap_or_default(),
                });
            }
        }
        Ok(out)
    }
}

/// Installs `table` (replacing one of its name) in the namespace at `netns` (tests, tools).
pub fn install_table_in(
    netns: &std::path::Path,
    table: &rules::Table,
    policy_drop: bool,
) -> Result<()> {
    crate::run_in_netns(netns, || {
        Nft::open()?.commit("install table", |b| {
            rules::replace_table_with_policy(b, table, policy_drop)
        })
    })
}

/// The forward-drop chains of the namespace at `netns`.
pub fn forward_drop_chains_in(netns: &std::path::Path) -> Result<Vec<ForwardDrop>> {
    crate::run_in_netns(netns, || Nft::open()?.forward_drop_chains())
}
