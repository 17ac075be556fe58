//! nf_tables over netlink, encoded by hand: attributes, the nfnetlink header, and batches.
//!
//! The constants are the kernel's uapi (`linux/netfilter/nf_tables.h`, `nfnetlink.h`); only
//! what the slot and host tables use is here. Integers in nf_tables attributes are big-endian.

use crate::netlink::align4;

pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub const NFNL_MSG_BATCH_END: u16 = 0x11;

pub const NFT_MSG_NEWTABLE: u16 = 0;
pub const NFT_MSG_DELTABLE: u16 = 2;
pub const NFT_MSG_NEWCHAIN: u16 = 3;
pub const NFT_MSG_NEWRULE: u16 = 6;
pub const NFT_MSG_DELRULE: u16 = 8;

pub const NFPROTO_INET: u8 = 1;
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

pub const NLA_F_NESTED: u16 = 0x8000;

/// Netlink attributes being written into one buffer; nests are closed by [`Attrs::end`].
#[derive(Default, Debug)]
pub struct Attrs {
    buf: Vec<u8>,
}

impl Attrs {
    pub fn new() -> Self {
        Attrs::default()
    }

    pub fn bytes(&mut self, kind: u16, value: &[u8]) -> &mut Self {
        let len = 4 + value.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.pad();
        self
    }

    pub fn be32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.bytes(kind, &v.to_be_bytes())
    }

    pub fn u8(&mut self, kind: u16, v: u8) -> &mut Self {
        self.bytes(kind, &[v])
    }

    /// A NUL-terminated string.
    pub fn str(&mut self, kind: u16, s: &str) -> &mut Self {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.bytes(kind, &v)
    }

    /// Opens a nested attribute; returns its offset for [`Attrs::end`].
    pub fn begin(&mut self, kind: u16) -> usize {
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0, 0]);
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        at
    }

    pub fn end(&mut self, at: usize) -> &mut Self {
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    /// A nested attribute holding what `f` writes.
    pub fn nest(&mut self, kind: u16, f: impl FnOnce(&mut Attrs)) -> &mut Self {
        let at = self.begin(kind);
        f(self);
        self.end(at)
    }

    fn pad(&mut self) {
        let n = align4(self.buf.len());
        self.buf.resize(n, 0);
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }
}

/// A batch of nf_tables messages, committed by the kernel as one transaction.
#[derive(Debug)]
pub struct Batch {
    buf: Vec<u8>,
    acks: Vec<u32>,
    seq: u32,
}

impl Batch {
    /// A batch whose messages are numbered from `first_seq`.
    pub fn new(first_seq: u32) -> Self {
        let mut b = Batch {
            buf: Vec::new(),
            acks: Vec::new(),
            seq: first_seq,
        };
        b.push_raw(NFNL_MSG_BATCH_BEGIN, 0, 0, NFNL_SUBSYS_NFTABLES, &[]);
        b
    }

    fn push_raw(&mut self, kind: u16, flags: u16, family: u8, res_id: u16, attrs: &[u8]) -> u32 {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let len = 16 + 4 + attrs.len();
        self.buf.extend_from_slice(&(len as u32).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf
            .extend_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        // nfgenmsg: family, version 0, resource id (big-endian)
        self.buf.push(family);
        self.buf.push(0);
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        self.buf.extend_from_slice(attrs);
        seq
    }

    /// Adds an nf_tables message (`NFT_MSG_*`), acked.
    pub fn push(&mut self, msg: u16, flags: u16, family: u8, attrs: Attrs) {
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | msg;
        let seq = self.push_raw(
            kind,
            flags | libc::NLM_F_ACK as u16,
            family,
            0,
            attrs.as_bytes(),
        );
        self.acks.push(seq);
    }

    /// Closes the batch: its bytes and the sequence numbers whose acks to await.
    pub fn finish(mut self) -> (Vec<u8>, Vec<u32>, u32) {
        self.push_raw(NFNL_MSG_BATCH_END, 0, 0, NFNL_SUBSYS_NFTABLES, &[]);
        (self.buf, self.acks, self.seq)
    }

    /// Number of nf_tables messages in the batch.
    pub fn len(&self) -> usize {
        self.acks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.acks.is_empty()
    }
}

/// The (type, value) pairs of a run of attributes; flags stripped from the type.
pub fn parse_attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            return None;
        }
        let value = &buf[4..len];
        buf = &buf[align4(len).min(buf.len())..];
        Some((kind, value))
    })
}

pub fn attr_str(v: &[u8]) -> Option<String> {
    let v = v.split(|b| *b == 0).next()?;
    String::from_utf8(v.to_vec()).ok()
}

pub fn attr_be32(v: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(v.get(0..4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nested() {
        let mut a = Attrs::new();
        a.str(1, "ab");
        a.nest(2, |a| {
            a.be32(1, 7);
        });
        let b = a.into_bytes();
        // "ab\0" -> len 7, padded to 8
        assert_eq!(&b[0..8], &[7, 0, 1, 0, b'a', b'b', 0, 0]);
        // nested: header 4 + inner 8 = 12, type with NLA_F_NESTED
        assert_eq!(&b[8..12], &[12, 0, 2, 0x80]);
        assert_eq!(&b[12..20], &[8, 0, 1, 0, 0, 0, 0, 7]);
    }

    #[test]
    fn attributes_parse_back() {
        let mut a = Attrs::new();
        a.str(1, "filter").nest(4, |a| {
            a.be32(1, 2);
        });
        let b = a.into_bytes();
        let v: Vec<(u16, &[u8])> = parse_attrs(&b).collect();
        assert_eq!(v.len(), 2);
        assert_eq!(attr_str(v[0].1).as_deref(), Some("filter"));
        assert_eq!(v[1].0, 4);
        let inner: Vec<_> = parse_attrs(v[1].1).collect();
        assert_eq!(attr_be32(inner[0].1), Some(2));
    }

    #[test]
    fn batch_is_framed() {
        let mut b = Batch::new(100);
        b.push(NFT_MSG_NEWTABLE, 0, NFPROTO_INET, Attrs::new());
        let (bytes, acks, next) = b.finish();
        assert_eq!(acks, vec![101]);
        assert_eq!(next, 103);
        assert_eq!(bytes.len(), 3 * 20);
        // begin: type 0x10, res_id = nftables subsystem, big-endian
        assert_eq!(
            u16::from_ne_bytes([bytes[4], bytes[5]]),
            NFNL_MSG_BATCH_BEGIN
        );
        assert_eq!(&bytes[18..20], &[0, 10]);
        // the table message: subsystem 10, message 0, family inet
        assert_eq!(u16::from_ne_bytes([bytes[24], bytes[25]]), 10 << 8);
        assert_eq!(bytes[36], NFPROTO_INET);
        assert_eq!(
            u16::from_ne_bytes([bytes[44], bytes[45]]),
            NFNL_MSG_BATCH_END
        );
    }
}
