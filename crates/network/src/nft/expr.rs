//! The nf_tables expressions the rulesets use, as values (so rule generation is testable
//! without a kernel) and their netlink encoding.

use super::wire::Attrs;

// Registers: the verdict register and the first 16-byte data register.
const NFT_REG_VERDICT: u32 = 0;
pub const NFT_REG_1: u32 = 1;
/// The second 16-byte data register (a NAT's port).
pub const NFT_REG_2: u32 = 2;

// Verdicts (netfilter.h / nf_tables.h).
pub const NF_DROP: i32 = 0;
pub const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;

/// `meta` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaKey {
    IifName = 6,
    OifName = 7,
    IifType = 8,
    NfProto = 15,
    L4Proto = 16,
}

/// Where a `payload` load starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    Link = 0,
    Network = 1,
    Transport = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    Eq = 0,
    Neq = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NatKind {
    Snat = 0,
    Dnat = 1,
}

/// Verdicts a rule can end with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Drop,
    Jump(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    /// Load a `meta` key into register 1.
    Meta(MetaKey),
    /// Load `len` bytes at `offset` of `base` into register 1.
    Payload {
        base: Base,
        offset: u32,
        len: u32,
    },
    /// Register 1 = (register 1 & mask) ^ xor over `mask.len()` bytes.
    Bitwise {
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    /// Compare register 1 to `data`.
    Cmp {
        op: CmpOp,
        data: Vec<u8>,
    },
    /// Load the conntrack state bits (host-endian u32) into register 1.
    CtState,
    /// Put `data` into register 1.
    Load(Vec<u8>),
    /// Put a port (network order) into register 2, for [`Expr::NatPort`].
    LoadPort(u16),
    /// End the rule with a verdict.
    Verdict(Verdict),
    /// Source or destination NAT of IPv4 to the address in register 1.
    Nat(NatKind),
    /// NAT to the address in register 1 and the port in register 2 (the rule must match
    /// the layer-4 protocol: a port means nothing without one).
    NatPort(NatKind),
    Masquerade,
    /// Reject with ICMP(v6) "administratively prohibited" (`icmpx`).
    RejectAdminProhibited,
    /// Register 1 = the route's TCP MSS (then byte-swapped to network order, 2 bytes).
    RtTcpMss,
    /// Write register 1's 2 bytes into the TCP MSS option.
    SetTcpMss,
    Counter,
}

impl Expr {
    fn name(&self) -> &'static str {
        match self {
            Expr::Meta(_) => "meta",
            Expr::Payload { .. } => "payload",
            Expr::Bitwise { .. } => "bitwise",
            Expr::Cmp { .. } => "cmp",
            Expr::CtState => "ct",
            Expr::Load(_) | Expr::LoadPort(_) | Expr::Verdict(_) => "immediate",
            Expr::Nat(_) | Expr::NatPort(_) => "nat",
            Expr::Masquerade => "masq",
            Expr::RejectAdminProhibited => "reject",
            Expr::RtTcpMss => "rt",
            Expr::SetTcpMss => "exthdr",
            Expr::Counter => "counter",
        }
    }

    /// Appends this expression as an `NFTA_LIST_ELEM`; `RtTcpMss` becomes two (rt + byteorder).
    pub fn encode(&self, a: &mut Attrs) {
        const LIST_ELEM: u16 = 1;
        const EXPR_NAME: u16 = 1;
        const EXPR_DATA: u16 = 2;
        a.nest(LIST_ELEM, |a| {
            a.str(EXPR_NAME, self.name());
            a.nest(EXPR_DATA, |a| self.data(a));
        });
        if let Expr::RtTcpMss = self {
            // byteorder: reg1 = htons(reg1), len 2, size 2
            a.nest(LIST_ELEM, |a| {
                a.str(EXPR_NAME, "byteorder");
                a.nest(EXPR_DATA, |a| {
                    a.be32(1, NFT_REG_1) // SREG
                        .be32(2, NFT_REG_1) // DREG
                        .be32(3, 1) // OP = HTON
                        .be32(4, 2) // LEN
                        .be32(5, 2); // SIZE
                });
            });
        }
    }

    fn data(&self, a: &mut Attrs) {
        match self {
            Expr::Meta(key) => {
                a.be32(1, NFT_REG_1).be32(2, *key as u32); // DREG, KEY
            }
            Expr::Payload { base, offset, len } => {
                a.be32(1, NFT_REG_1) // DREG
                    .be32(2, *base as u32)
                    .be32(3, *offset)
                    .be32(4, *len);
            }
            Expr::Bitwise { mask, xor } => {
                a.be32(1, NFT_REG_1) // SREG
                    .be32(2, NFT_REG_1) // DREG
                    .be32(3, mask.len() as u32); // LEN
                a.nest(4, |a| value(a, mask)); // MASK
                a.nest(5, |a| value(a, xor)); // XOR
            }
            Expr::Cmp { op, data } => {
                a.be32(1, NFT_REG_1).be32(2, *op as u32); // SREG, OP
                a.nest(3, |a| value(a, data)); // DATA
            }
            Expr::CtState => {
                a.be32(1, NFT_REG_1).be32(2, 0); // DREG, KEY = STATE
            }
            Expr::Load(data) => {
                a.be32(1, NFT_REG_1);
                a.nest(2, |a| value(a, data));
            }
            Expr::LoadPort(port) => {
                a.be32(1, NFT_REG_2);
                a.nest(2, |a| value(a, &port.to_be_bytes()));
            }
            Expr::Verdict(v) => {
                a.be32(1, NFT_REG_VERDICT);
                a.nest(2, |a| {
                    a.nest(2, |a| {
                        // DATA_VERDICT { CODE, CHAIN }
                        let code = match v {
                            Verdict::Accept => NF_ACCEPT,
                            Verdict::Drop => NF_DROP,
                            Verdict::Jump(_) => NFT_JUMP,
                        };
                        a.be32(1, code as u32);
                        if let Verdict::Jump(chain) = v {
                            a.str(2, chain);
                        }
                    });
                });
            }
            Expr::Nat(kind) => {
                a.be32(1, *kind as u32) // TYPE
                    .be32(2, u32::from(super::wire::NFPROTO_IPV4)) // FAMILY
                    .be32(3, NFT_REG_1); // REG_ADDR_MIN
            }
            Expr::NatPort(kind) => {
                const NF_NAT_RANGE_MAP_IPS: u32 = 1;
                const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
                a.be32(1, *kind as u32) // TYPE
                    .be32(2, u32::from(super::wire::NFPROTO_IPV4)) // FAMILY
                    .be32(3, NFT_REG_1) // REG_ADDR_MIN
                    .be32(5, NFT_REG_2) // REG_PROTO_MIN
                    .be32(7, NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED); // FLAGS
            }
            Expr::Masquerade => {}
            Expr::RejectAdminProhibited => {
                a.be32(1, 2).u8(2, 3); // TYPE = ICMPX_UNREACH, ICMP_CODE = ADMIN_PROHIBITED
            }
            Expr::RtTcpMss => {
                a.be32(1, NFT_REG_1).be32(2, 3); // DREG, KEY = NFT_RT_TCPMSS
            }
            Expr::SetTcpMss => {
                a.u8(2, 2) // TYPE = TCPOPT_MAXSEG
                    .be32(3, 2) // OFFSET
                    .be32(4, 2) // LEN
                    .be32(6, 1) // OP = TCPOPT
                    .be32(7, NFT_REG_1); // SREG
            }
            Expr::Counter => {}
        }
    }
}

fn value(a: &mut Attrs, data: &[u8]) {
    a.bytes(1, data); // NFTA_DATA_VALUE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmp_encodes_register_op_and_value() {
        let mut a = Attrs::new();
        Expr::Cmp {
            op: CmpOp::Neq,
            data: vec![0, 0, 0, 0],
        }
        .encode(&mut a);
        let b = a.into_bytes();
        // LIST_ELEM(nested) { NAME "cmp\0", DATA(nested) { SREG 1, OP 1, DATA { VALUE 0x00000000 } } }
        let expect: Vec<u8> = [
            vec![44, 0, 1, 0x80],
            vec![8, 0, 1, 0, b'c', b'm', b'p', 0],
            vec![32, 0, 2, 0x80],
            vec![8, 0, 1, 0, 0, 0, 0, 1],
            vec![8, 0, 2, 0, 0, 0, 0, 1],
            vec![12, 0, 3, 0x80, 8, 0, 1, 0, 0, 0, 0, 0],
        ]
        .concat();
        assert_eq!(b, expect);
    }

    #[test]
    fn jump_carries_chain_name() {
        let mut a = Attrs::new();
        Expr::Verdict(Verdict::Jump("user".into())).encode(&mut a);
        let b = a.into_bytes();
        let code = (NFT_JUMP as u32).to_be_bytes();
        assert!(b.windows(4).any(|w| w == code));
        assert!(b.windows(5).any(|w| w == b"user\0"));
    }

    #[test]
    fn nat_to_a_port_names_both_registers_and_the_flag() {
        let mut a = Attrs::new();
        Expr::LoadPort(5353).encode(&mut a);
        let b = a.into_bytes();
        // DREG 2, then DATA { VALUE 0x14e9 } (2 bytes, padded to 4)
        assert!(b.windows(8).any(|w| w == [8, 0, 1, 0, 0, 0, 0, 2]));
        assert!(b.windows(6).any(|w| w == [6, 0, 1, 0, 0x14, 0xe9]));
        let mut a = Attrs::new();
        Expr::NatPort(NatKind::Dnat).encode(&mut a);
        let b = a.into_bytes();
        assert!(b.windows(8).any(|w| w == [8, 0, 5, 0, 0, 0, 0, 2])); // REG_PROTO_MIN = 2
        assert!(b.windows(8).any(|w| w == [8, 0, 7, 0, 0, 0, 0, 3])); // FLAGS
    }

    #[test]
    fn rt_mss_adds_byteorder() {
        let mut a = Attrs::new();
        Expr::RtTcpMss.encode(&mut a);
        let b = a.into_bytes();
        assert!(b.windows(3).any(|w| w == b"rt\0"));
        assert!(b.windows(10).any(|w| w == b"byteorder\0"));
    }
}
