//! One stream connection between a guest port and a host Unix stream: its state
//! machine, its buffers and the credit accounting of both directions.
//!
//! Credit (virtio spec 5.10.6.3): each side advertises `buf_alloc` (its receive buffer)
//! and `fwd_cnt` (bytes it has consumed); a sender may have at most
//! `buf_alloc - (sent - fwd_cnt)` bytes in flight. Both buffers here are bounded:
//! host-to-guest data is read only as far as the guest's credit allows (and at most
//! [`TO_GUEST_CAP`]), and a guest exceeding the credit we advertised is reset.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, VolatileSlice};
use vmm_sys_util::epoll::EventSet;

use super::packet::{
    HOST_CID, Header, MAX_PKT_DATA, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE,
    OP_RST, OP_RW, OP_SHUTDOWN, SHUTDOWN_BOTH, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};

/// Receive buffer advertised to the guest: the most guest data we hold for a host peer
/// that does not read.
pub const BUF_ALLOC: u32 = 256 * 1024;
/// The most host data held for the guest (it is also limited by the guest's credit).
pub const TO_GUEST_CAP: usize = 64 * 1024;
/// Tell the guest about freed buffer space once its view of our free space drops below
/// this and we have freed at least as much (or everything).
pub const CREDIT_UPDATE_THRESHOLD: u32 = 64 * 1024;
/// How long a fully shut down connection waits for its last RST or buffer flush.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection's identity: host-side port and guest-side port (the guest CID is fixed).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct ConnKey {
    pub local_port: u32,
    pub peer_port: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Host-initiated: REQUEST queued or sent, waiting for the guest's RESPONSE.
    AwaitingResponse,
    Established,
    /// We sent SHUTDOWN with both flags and wait for the guest's RST.
    Closing,
}

/// What the connection table must do with a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// Remove it; send the guest an RST first if `rst`.
    Kill {
        rst: bool,
    },
}

#[derive(Debug)]
pub struct Connection {
    pub stream: UnixStream,
    pub key: ConnKey,
    pub state: State,
    deadline: Option<Instant>,

    // Control packets owed to the guest.
    send_request: bool,
    send_response: bool,
    credit_update_wanted: bool,
    credit_requested: bool,

    // Host side.
    host_eof: bool,
    host_gone: bool,
    host_write_shut: bool,

    // SHUTDOWN flags received from, and sent to, the guest.
    peer_shut: u32,
    sent_shut: u32,

    to_host: VecDeque<u8>,
    to_guest: VecDeque<u8>,

    // Guest -> host accounting.
    rx_cnt: Wrapping<u32>,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    // Host -> guest accounting.
    tx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,

    /// Interest currently registered with the worker's epoll (`None`: not registered).
    pub registered: Option<EventSet>,
    /// Whether the connection is already listed in the muxer's RX queue.
    pub in_rx_queue: bool,
}

impl Connection {
    fn new(stream: UnixStream, key: ConnKey, state: State) -> Self {
        Self {
            stream,
            key,
            state,
            deadline: None,
            send_request: false,
            send_response: false,
            credit_update_wanted: false,
            credit_requested: false,
            host_eof: false,
            host_gone: false,
            host_write_shut: false,
            peer_shut: 0,
            sent_shut: 0,
            to_host: VecDeque::new(),
            to_guest: VecDeque::new(),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            tx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            registered: None,
            in_rx_queue: false,
        }
    }

    /// A host process asked for guest port `key.peer_port`; `early` is payload it sent
    /// right after its handshake line.
    pub fn new_local(stream: UnixStream, key: ConnKey, early: &[u8], deadline: Instant) -> Self {
        let mut c = Self::new(stream, key, State::AwaitingResponse);
        c.send_request = true;
        c.deadline = Some(deadline);
        c.to_guest.extend(early);
        c
    }

    /// The guest's REQUEST `hdr` reached a host listener over `stream`.
    pub fn new_peer(stream: UnixStream, key: ConnKey, hdr: &Header) -> Self {
        let mut c = Self::new(stream, key, State::Established);
        c.send_response = true;
        c.update_peer_credit(hdr);
        c
    }

    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The host stream hung up or failed: nothing more can be written to it.
    pub fn set_host_gone(&mut self) {
        self.host_gone = true;
    }

    fn update_peer_credit(&mut self, hdr: &Header) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if self.peer_free() > 0 {
            self.credit_requested = false;
        }
    }

    /// Bytes the guest can still take. A bogus `fwd_cnt` ahead of what we sent makes
    /// the in-flight count wrap to a huge value, which yields no credit rather than a lot.
    fn peer_free(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// How many more bytes may be read from the host stream now.
    fn read_room(&self) -> usize {
        if self.state != State::Established || self.host_eof || self.peer_shut & SHUTDOWN_RCV != 0 {
            return 0;
        }
        let limit = TO_GUEST_CAP.min(self.peer_free() as usize);
        limit.saturating_sub(self.to_guest.len())
    }

    /// Handles a packet the guest sent on this connection; `data` is its payload.
    pub fn on_guest_packet(&mut self, hdr: &Header, data: &[u8], now: Instant) -> Verdict {
        if hdr.op == OP_RST {
            return Verdict::Kill { rst: false };
        }
        self.update_peer_credit(hdr);
        match (self.state, hdr.op) {
            (State::AwaitingResponse, OP_RESPONSE) => {
                tracing::debug!("vsock: the guest accepted port {}", self.key.peer_port);
                let ok = format!("OK {}\n", self.key.local_port);
                // A fresh stream's send buffer is empty, so a short write means a dead peer.
                match self.stream.write(ok.as_bytes()) {
                    Ok(n) if n == ok.len() => {
                        self.state = State::Established;
                        self.deadline = None;
                        Verdict::Keep
                    }
                    _ => Verdict::Kill { rst: true },
                }
            }
            (State::AwaitingResponse, _) => Verdict::Kill { rst: true },
            (_, OP_RW) => self.on_guest_data(data),
            (_, OP_SHUTDOWN) => {
                self.peer_shut |= hdr.flags & SHUTDOWN_BOTH;
                if self.peer_shut & SHUTDOWN_RCV != 0 {
                    self.to_guest.clear();
                }
                if self.peer_shut == SHUTDOWN_BOTH && self.deadline.is_none() {
                    self.deadline = Some(now + CLOSE_TIMEOUT);
                }
                Verdict::Keep
            }
            (_, OP_CREDIT_UPDATE) => Verdict::Keep,
            (_, OP_CREDIT_REQUEST) => {
                self.credit_update_wanted = true;
                Verdict::Keep
            }
            // REQUEST or RESPONSE on a live connection, or an unknown op.
            _ => Verdict::Kill { rst: true },
        }
    }

    fn on_guest_data(&mut self, data: &[u8]) -> Verdict {
        if self.peer_shut & SHUTDOWN_SEND != 0 || self.sent_shut & SHUTDOWN_RCV != 0 {
            return Verdict::Kill { rst: true };
        }
        let len = data.len() as u32;
        self.rx_cnt += len;
        if self.host_gone {
            // Nobody will read it; count it consumed so the guest's credit keeps flowing
            // until it sees our SHUTDOWN.
            self.fwd_cnt += len;
            return Verdict::Keep;
        }
        if self.to_host.len() + data.len() > BUF_ALLOC as usize {
            // The guest sent beyond the credit we gave it.
            return Verdict::Kill { rst: true };
        }
        if self.to_host.is_empty() {
            let n = self.write_host(data);
            self.to_host.extend(&data[n..]);
        } else {
            self.to_host.extend(data);
        }
        Verdict::Keep
    }

    /// Writes to the host stream what it takes now; returns the byte count.
    fn write_host(&mut self, data: &[u8]) -> usize {
        let (n, gone) = write_nonblocking(&mut self.stream, data);
        self.host_gone |= gone;
        self.fwd_cnt += n as u32;
        n
    }

    /// Moves data between the host stream and the buffers as far as possible without
    /// blocking, and applies the guest's half-close to the host stream.
    pub fn service(&mut self, scratch: &mut [u8]) {
        while !self.to_host.is_empty() && !self.host_gone {
            let (head, _) = self.to_host.as_slices();
            let (n, gone) = write_nonblocking(&mut self.stream, head);
            let whole = n == head.len();
            self.host_gone |= gone;
            self.fwd_cnt += n as u32;
            self.to_host.drain(..n);
            if !whole {
                break;
            }
        }
        if self.host_gone && !self.to_host.is_empty() {
            self.fwd_cnt += self.to_host.len() as u32;
            self.to_host.clear();
        }
        if self.peer_shut & SHUTDOWN_SEND != 0
            && self.to_host.is_empty()
            && !self.host_write_shut
            && !self.host_gone
        {
            // Half-close: the host reader sees EOF and may still write back.
            let _ = self.stream.shutdown(Shutdown::Write);
            self.host_write_shut = true;
        }
        loop {
            let room = self.read_room().min(scratch.len());
            if room == 0 {
                break;
            }
            match self.stream.read(&mut scratch[..room]) {
                Ok(0) => self.host_eof = true,
                Ok(n) => self.to_guest.extend(&scratch[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.host_eof = true;
                    self.host_gone = true;
                }
            }
        }
    }

    /// Decides whether the connection lives on.
    pub fn verdict(&self, now: Instant) -> Verdict {
        let expired = self.deadline.is_some_and(|d| now >= d);
        match self.state {
            State::AwaitingResponse if self.host_gone => Verdict::Kill {
                rst: !self.send_request,
            },
            State::AwaitingResponse | State::Closing if expired => Verdict::Kill { rst: true },
            State::Established
                if self.peer_shut == SHUTDOWN_BOTH
                    && (self.to_host.is_empty() || self.host_gone || expired) =>
            {
                Verdict::Kill { rst: true }
            }
            _ => Verdict::Keep,
        }
    }

    /// The epoll interest the host stream needs. `None` once the host hung up: a hang-up
    /// is reported whatever the interest, so the stream must leave the epoll set (its
    /// remaining data is then read when credit allows, without readiness events).
    pub fn wanted_events(&self) -> Option<EventSet> {
        if self.host_gone {
            return None;
        }
        let mut ev = EventSet::empty();
        if self.read_room() > 0 {
            ev |= EventSet::IN;
        }
        if !self.to_host.is_empty() {
            ev |= EventSet::OUT;
        }
        Some(ev)
    }

    /// SHUTDOWN flags we owe the guest: SEND once all host data has been delivered
    /// after the host's EOF, RCV once the host can no longer take data.
    fn local_shut(&self) -> u32 {
        let mut f = 0;
        if self.host_eof && self.to_guest.is_empty() {
            f |= SHUTDOWN_SEND;
        }
        if self.host_gone {
            f |= SHUTDOWN_RCV;
        }
        f
    }

    fn needs_credit_update(&self) -> bool {
        if self.state != State::Established {
            return false;
        }
        if self.credit_update_wanted {
            return true;
        }
        let unacked = (self.rx_cnt - self.last_fwd_cnt_sent).0;
        if BUF_ALLOC.saturating_sub(unacked) >= CREDIT_UPDATE_THRESHOLD {
            return false;
        }
        let gained = (self.fwd_cnt - self.last_fwd_cnt_sent).0;
        gained >= CREDIT_UPDATE_THRESHOLD || (gained > 0 && self.fwd_cnt == self.rx_cnt)
    }

    fn wants_credit_request(&self) -> bool {
        self.state == State::Established
            && !self.host_eof
            && self.peer_shut & SHUTDOWN_RCV == 0
            && self.peer_free() == 0
            && !self.credit_requested
    }

    fn can_send_data(&self) -> bool {
        self.state == State::Established && !self.to_guest.is_empty() && self.peer_free() > 0
    }

    /// Whether the connection has a packet for the guest.
    pub fn has_pending_rx(&self) -> bool {
        self.send_request
            || self.send_response
            || self.can_send_data()
            || (self.state == State::Established && self.local_shut() & !self.sent_shut != 0)
            || self.needs_credit_update()
            || self.wants_credit_request()
    }

    /// Builds the next packet for the guest, copying any payload into `data` (the RX
    /// buffer's data area). `None` if there is nothing to send in this buffer.
    pub fn next_packet(
        &mut self,
        guest_cid: u64,
        data: Option<&VolatileSlice<'_, ()>>,
        now: Instant,
    ) -> Option<Header> {
        let mut hdr = Header {
            src_cid: HOST_CID,
            dst_cid: guest_cid,
            src_port: self.key.local_port,
            dst_port: self.key.peer_port,
            type_: TYPE_STREAM,
            ..Header::default()
        };
        if self.send_request {
            self.send_request = false;
            hdr.op = OP_REQUEST;
        } else if self.send_response {
            self.send_response = false;
            hdr.op = OP_RESPONSE;
        } else if let Some(slice) = data.filter(|_| self.can_send_data()) {
            let n = self
                .to_guest
                .len()
                .min(self.peer_free() as usize)
                .min(slice.len())
                .min(MAX_PKT_DATA as usize);
            if n == 0 {
                return None;
            }
            let (a, b) = self.to_guest.as_slices();
            let first = a.len().min(n);
            // Cannot fail: `n` is at most the slice's length.
            if slice.write_slice(&a[..first], 0).is_err()
                || slice.write_slice(&b[..n - first], first).is_err()
            {
                return None;
            }
            self.to_guest.drain(..n);
            self.tx_cnt += n as u32;
            hdr.op = OP_RW;
            hdr.len = n as u32;
        } else if self.state == State::Established && self.local_shut() & !self.sent_shut != 0 {
            self.sent_shut |= self.local_shut();
            hdr.op = OP_SHUTDOWN;
            hdr.flags = self.sent_shut;
            if self.sent_shut == SHUTDOWN_BOTH {
                self.state = State::Closing;
                self.deadline = Some(now + CLOSE_TIMEOUT);
            }
        } else if self.needs_credit_update() {
            hdr.op = OP_CREDIT_UPDATE;
        } else if self.wants_credit_request() {
            self.credit_requested = true;
            hdr.op = OP_CREDIT_REQUEST;
        } else {
            return None;
        }
        // Every packet carries our credit, so it also serves as a credit update.
        hdr.buf_alloc = BUF_ALLOC;
        hdr.fwd_cnt = self.fwd_cnt.0;
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.credit_update_wanted = false;
        Some(hdr)
    }
}

/// Writes what the stream takes without blocking; returns the count and whether the
/// peer is gone.
fn write_nonblocking(stream: &mut UnixStream, data: &[u8]) -> (usize, bool) {
    let mut done = 0;
    while done < data.len() {
        match stream.write(&data[done..]) {
            Ok(0) => return (done, true),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(_) => return (done, true),
        }
    }
    (done, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guest_hdr(op: u16, len: u32, buf_alloc: u32, fwd_cnt: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 1000,
            dst_port: 52,
            len,
            type_: TYPE_STREAM,
            op,
            buf_alloc,
            fwd_cnt,
            ..Header::default()
        }
    }

    fn key() -> ConnKey {
        ConnKey {
            local_port: 52,
            peer_port: 1000,
        }
    }

    /// Fills the device-side stream's send buffer so the host "does not read".
    fn fill_kernel_buffer(s: &mut UnixStream) {
        let junk = [0u8; 4096];
        loop {
            match s.write(&junk) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn guest_exceeding_our_credit_is_reset_and_memory_stays_bounded() {
        let (dev, _host) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let now = Instant::now();
        let mut c = Connection::new_peer(dev, key(), &guest_hdr(OP_REQUEST, 0, 4096, 0));
        fill_kernel_buffer(&mut c.stream);
        let chunk = vec![7u8; 4096];
        let mut sent = 0usize;
        loop {
            let v = c.on_guest_packet(&guest_hdr(OP_RW, 4096, 4096, 0), &chunk, now);
            if v != Verdict::Keep {
                assert_eq!(v, Verdict::Kill { rst: true });
                break;
            }
            sent += chunk.len();
            assert!(c.to_host.len() <= BUF_ALLOC as usize);
        }
        assert_eq!(sent, BUF_ALLOC as usize);
    }

    #[test]
    fn host_reads_are_limited_by_guest_credit() {
        let (dev, mut host) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let now = Instant::now();
        let mut c = Connection::new_peer(dev, key(), &guest_hdr(OP_REQUEST, 0, 1000, 0));
        host.write_all(&[1u8; 5000]).unwrap();
        let mut scratch = vec![0u8; 64 * 1024];
        c.service(&mut scratch);
        assert_eq!(c.to_guest.len(), 1000);
        // RESPONSE first, then data, then a credit request once credit is used up.
        let mut mem = vec![0u8; 4096];
        let slice = VolatileSlice::from(&mut mem[..]);
        assert_eq!(c.next_packet(3, Some(&slice), now).unwrap().op, OP_RESPONSE);
        let h = c.next_packet(3, Some(&slice), now).unwrap();
        assert_eq!((h.op, h.len), (OP_RW, 1000));
        c.service(&mut scratch);
        assert!(c.to_guest.is_empty());
        assert_eq!(
            c.next_packet(3, Some(&slice), now).unwrap().op,
            OP_CREDIT_REQUEST
        );
        assert!(!c.has_pending_rx());
        // The guest consumed 600 bytes: exactly that much more is read.
        assert_eq!(
            c.on_guest_packet(&guest_hdr(OP_CREDIT_UPDATE, 0, 1000, 600), &[], now),
            Verdict::Keep
        );
        c.service(&mut scratch);
        assert_eq!(c.to_guest.len(), 600);
    }

    #[test]
    fn credit_update_sent_when_guest_view_runs_low() {
        let (dev, mut host) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let now = Instant::now();
        let mut c = Connection::new_peer(dev, key(), &guest_hdr(OP_REQUEST, 0, 4096, 0));
        let mut mem = vec![0u8; 4096];
        let slice = VolatileSlice::from(&mut mem[..]);
        assert_eq!(c.next_packet(3, Some(&slice), now).unwrap().op, OP_RESPONSE);
        let chunk = vec![1u8; 64 * 1024];
        // 192 KiB written and forwarded: the guest still sees 64 KiB free, no update.
        for _ in 0..3 {
            c.on_guest_packet(&guest_hdr(OP_RW, chunk.len() as u32, 4096, 0), &chunk, now);
            let mut sink = vec![0u8; chunk.len()];
            host.read_exact(&mut sink).unwrap();
        }
        assert!(!c.needs_credit_update());
        c.on_guest_packet(&guest_hdr(OP_RW, 1, 4096, 0), &[1], now);
        assert!(c.needs_credit_update());
        let h = c.next_packet(3, None, now).unwrap();
        assert_eq!(
            (h.op, h.fwd_cnt, h.buf_alloc),
            (OP_CREDIT_UPDATE, 3 * 64 * 1024 + 1, BUF_ALLOC)
        );
        assert!(!c.needs_credit_update());
    }

    #[test]
    fn shutdown_from_both_sides_ends_in_rst() {
        let (dev, host) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let now = Instant::now();
        let mut c = Connection::new_peer(dev, key(), &guest_hdr(OP_REQUEST, 0, 4096, 0));
        let mut scratch = vec![0u8; 1024];
        assert_eq!(c.next_packet(3, None, now).unwrap().op, OP_RESPONSE);
        drop(host);
        c.set_host_gone();
        c.service(&mut scratch);
        let h = c.next_packet(3, None, now).unwrap();
        assert_eq!((h.op, h.flags), (OP_SHUTDOWN, SHUTDOWN_BOTH));
        assert_eq!(c.state, State::Closing);
        assert_eq!(c.verdict(now), Verdict::Keep);
        assert_eq!(c.verdict(now + CLOSE_TIMEOUT), Verdict::Kill { rst: true });
        assert_eq!(
            c.on_guest_packet(&guest_hdr(OP_RST, 0, 0, 0), &[], now),
            Verdict::Kill { rst: false }
        );
    }
}
