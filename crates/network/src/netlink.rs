//! A small synchronous netlink socket: send a request (or a batch), wait for its acks, or
//! collect a dump. A netlink socket belongs to the network namespace of the thread that opened
//! it, which is how the slot code talks to a slot's namespace without staying in it.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, sockopt,
};
use nix::sys::time::TimeVal;

use crate::error::{Error, Result};

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// How long to wait for the kernel's answer before calling it lost.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

/// One netlink message as read from the socket.
pub(crate) struct RawMsg<'a> {
    pub kind: u16,
    pub seq: u32,
    /// The whole message, header included (what `netlink-packet-core` deserialises).
    pub whole: &'a [u8],
    /// The payload after the 16-byte header.
    pub payload: &'a [u8],
}

/// Splits a datagram into its netlink messages.
pub(crate) fn split(mut buf: &[u8]) -> Vec<RawMsg<'_>> {
    let mut out = Vec::new();
    // `nlmsghdr`: length (4), type (2), flags (2), sequence number (4), port id (4).
    while let Some(&[l0, l1, l2, l3, k0, k1, _, _, s0, s1, s2, s3, ..]) =
        buf.first_chunk::<NLMSG_HDRLEN>()
    {
        let len = u32::from_ne_bytes([l0, l1, l2, l3]) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            break;
        }
        out.push(RawMsg {
            kind: u16::from_ne_bytes([k0, k1]),
            seq: u32::from_ne_bytes([s0, s1, s2, s3]),
            whole: &buf[..len],
            payload: &buf[NLMSG_HDRLEN..len],
        });
        buf = &buf[align4(len).min(buf.len())..];
    }
    out
}

pub(crate) fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The errno of an `NLMSG_ERROR` payload: 0 for an ack.
fn error_code(payload: &[u8]) -> i32 {
    payload
        .first_chunk::<4>()
        .map_or(-libc::EPROTO, |b| i32::from_ne_bytes(*b))
}

pub(crate) struct NlSocket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl std::fmt::Debug for NlSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the 64 KiB receive buffer.
        f.debug_struct("NlSocket")
            .field("fd", &self.fd)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl NlSocket {
    /// A socket in the calling thread's network namespace.
    pub fn open(proto: SockProtocol) -> Result<Self> {
        let fd = socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            proto,
        )
        .map_err(|e| Error::netlink("socket", e))?;
        socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))
            .map_err(|e| Error::netlink("bind", e))?;
        let tv = TimeVal::new(RECV_TIMEOUT.as_secs() as _, 0);
        socket::setsockopt(&fd, sockopt::ReceiveTimeout, &tv)
            .map_err(|e| Error::netlink("timeout", e))?;
        // Batches of a few hundred acks must not overflow the default buffer.
        let _ = socket::setsockopt(&fd, sockopt::RcvBuf, &(1 << 20));
        Ok(NlSocket {
            fd,
            seq: 1,
            buf: vec![0; 64 * 1024],
        })
    }

    /// The next sequence number for a message of a request.
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    fn send(&self, bytes: &[u8], what: &'static str) -> Result<()> {
        let n = socket::send(self.fd.as_raw_fd(), bytes, MsgFlags::empty())
            .map_err(|e| Error::netlink(what, e))?;
        if n != bytes.len() {
            return Err(Error::netlink(what, io::Error::other("short send")));
        }
        Ok(())
    }

    fn recv(&mut self, what: &'static str) -> Result<usize> {
        loop {
            match socket::recv(self.fd.as_raw_fd(), &mut self.buf, MsgFlags::empty()) {
                Ok(n) => return Ok(n),
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(Error::netlink(what, e)),
            }
        }
    }

    /// Sends `bytes` (one message or a batch) and waits until every sequence number in `acks`
    /// was answered; the first error wins.
    pub fn transact(&mut self, bytes: &[u8], acks: &[u32], what: &'static str) -> Result<()> {
        self.send(bytes, what)?;
        let mut pending: Vec<u32> = acks.to_vec();
        // Errors for the batch's begin/end messages (just outside the acked ones) count too;
        // answers to older requests are skipped.
        let lo = acks.iter().min().copied().unwrap_or(0).saturating_sub(1);
        let hi = acks.iter().max().copied().unwrap_or(0).saturating_add(1);
        let mut first_err = None;
        while !pending.is_empty() {
            let n = self.recv(what)?;
            for m in split(&self.buf[..n]) {
                if m.kind != NLMSG_ERROR {
                    continue;
                }
                if m.seq < lo || m.seq > hi {
                    continue;
                }
                let code = error_code(m.payload);
                if code != 0 && first_err.is_none() {
                    first_err = Some(io::Error::from_raw_os_error(-code));
                }
                pending.retain(|s| *s != m.seq);
            }
            if first_err.is_some() {
                // The kernel answers every acked message of a failed batch; don't wait on
                // messages it skipped.
                break;
            }
        }
        match first_err {
            Some(e) => Err(Error::netlink(what, e)),
            None => Ok(()),
        }
    }

    /// Sends a dump request with sequence `seq` and returns each answer message, whole.
    pub fn dump(&mut self, bytes: &[u8], seq: u32, what: &'static str) -> Result<Vec<Vec<u8>>> {
        self.send(bytes, what)?;
        let mut out = Vec::new();
        loop {
            let n = self.recv(what)?;
            for m in split(&self.buf[..n]) {
                if m.seq != seq {
                    continue;
                }
                match m.kind {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = error_code(m.payload);
                        return Err(Error::netlink(what, io::Error::from_raw_os_error(-code)));
                    }
                    _ => out.push(m.whole.to_vec()),
                }
            }
        }
    }
}

impl NlSocket {
    /// Sends a request answered by one message (a GET without DUMP) and returns it whole; an
    /// error answer is an error.
    pub fn dump_one(&mut self, bytes: &[u8], seq: u32, what: &'static str) -> Result<Vec<u8>> {
        self.send(bytes, what)?;
        loop {
            let n = self.recv(what)?;
            for m in split(&self.buf[..n]) {
                if m.seq != seq {
                    continue;
                }
                if m.kind == NLMSG_ERROR {
                    let code = error_code(m.payload);
                    if code == 0 {
                        continue; // the ack after the answer
                    }
                    return Err(Error::netlink(what, io::Error::from_raw_os_error(-code)));
                }
                return Ok(m.whole.to_vec());
            }
        }
    }
}

impl NlSocket {
    /// Continues numbering after a batch that used sequence numbers up to `next - 1`.
    pub fn set_seq(&mut self, next: u32) {
        self.seq = next;
    }
}
