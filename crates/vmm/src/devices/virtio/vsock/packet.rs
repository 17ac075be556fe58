//! Protocol constants and the owned form of a vsock packet header.

use virtio_vsock::packet::{PKT_HEADER_SIZE, VsockPacket};

/// The host's well-known CID.
pub const HOST_CID: u64 = 2;
/// The only socket type this device carries.
pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;
pub const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;

/// `virtio_vsock_event.id` of a transport reset.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

/// The largest payload accepted in, or put into, one packet (the Linux driver's limit).
pub const MAX_PKT_DATA: u32 = 64 * 1024;

/// Size of the packet header in guest memory.
pub const HEADER_SIZE: usize = PKT_HEADER_SIZE;

/// A packet header by value: read once from guest memory, so later checks cannot race
/// with a guest rewriting it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn from_packet(pkt: &VsockPacket<'_, ()>) -> Self {
        Self {
            src_cid: pkt.src_cid(),
            dst_cid: pkt.dst_cid(),
            src_port: pkt.src_port(),
            dst_port: pkt.dst_port(),
            len: pkt.len(),
            type_: pkt.type_(),
            op: pkt.op(),
            flags: pkt.flags(),
            buf_alloc: pkt.buf_alloc(),
            fwd_cnt: pkt.fwd_cnt(),
        }
    }

    /// Writes every field into the packet's header in guest memory.
    pub fn write_to(&self, pkt: &mut VsockPacket<'_, ()>) {
        pkt.set_src_cid(self.src_cid)
            .set_dst_cid(self.dst_cid)
            .set_src_port(self.src_port)
            .set_dst_port(self.dst_port)
            .set_len(self.len)
            .set_type(self.type_)
            .set_op(self.op)
            .set_flags(self.flags)
            .set_buf_alloc(self.buf_alloc)
            .set_fwd_cnt(self.fwd_cnt);
    }

    /// The RST answering `self`, addressed back to its sender.
    pub fn rst_reply(&self) -> Self {
        Self {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            type_: self.type_,
            op: OP_RST,
            ..Self::default()
        }
    }

    /// The little-endian wire form (used by the tests' guest driver).
    #[cfg(test)]
    pub fn to_bytes(self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    #[cfg(test)]
    pub fn from_bytes(b: &[u8; HEADER_SIZE]) -> Self {
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from(u32_at(o)) | (u64::from(u32_at(o + 4)) << 32);
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_through_packet_memory() {
        let h = Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 1024,
            dst_port: 52,
            len: 7,
            type_: TYPE_STREAM,
            op: OP_RW,
            flags: SHUTDOWN_SEND,
            buf_alloc: 4096,
            fwd_cnt: 99,
        };
        let mut raw = h.to_bytes();
        // SAFETY: `raw` outlives `pkt` and nothing else accesses it meanwhile.
        let mut pkt = unsafe { VsockPacket::new(&mut raw, None) }.unwrap();
        assert_eq!(Header::from_bytes(&h.to_bytes()), h);
        let mut other = h.rst_reply();
        other.write_to(&mut pkt);
        other.len = 0;
        assert_eq!(Header::from_bytes(&raw), other);
        assert_eq!(other.src_port, 52);
        assert_eq!(other.dst_cid, 3);
    }
}
