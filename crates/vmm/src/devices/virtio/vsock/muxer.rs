//! The connection table: routes guest packets to connections, accepts host streams on
//! the device socket, and queues what the guest must be told.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use virtio_vsock::packet::VsockPacket;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::connection::{ConnKey, Connection, Verdict};
use super::packet::{HOST_CID, Header, OP_REQUEST, OP_RST, TYPE_STREAM};
use super::unix::{Handshake, HandshakeStep, connect_nonblocking, port_path};

/// Epoll token of the device's listening socket.
pub const TOKEN_LISTENER: u64 = 5;
/// Epoll tokens of host streams are this plus the file descriptor.
pub const TOKEN_FD_BASE: u64 = 1 << 32;

/// Host ports handed to host-initiated connections start at or above this.
pub const LOCAL_PORT_BASE: u32 = 1 << 30;

/// Where this process starts numbering host ports: a random point in the
/// upper range. A VM restored from a snapshot may still hold connections
/// that the VMM which took it opened; if a new VMM numbered from the same
/// start, its first connections would reuse those tuples and the guest would
/// refuse them until it had closed the old sockets.
fn first_local_port() -> u32 {
    use std::io::Read;
    let mut b = [0u8; 4];
    let random = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map(|()| u32::from_le_bytes(b))
        .unwrap_or_else(|_| std::process::id().wrapping_mul(2_654_435_761));
    LOCAL_PORT_BASE + (random % (1 << 29))
}
/// Live connections at most; more are refused (RST or closed stream).
pub const MAX_CONNECTIONS: usize = 512;
/// Host streams still sending their handshake line at most.
pub const MAX_HANDSHAKES: usize = 64;
/// RST packets for unknown connections waiting for RX buffers before the TX queue is
/// no longer processed (back-pressure on a guest that does not take its RX).
pub const MAX_CONTROL_PACKETS: usize = 256;

enum RxItem {
    /// A packet not tied to a live connection (RST replies).
    Control(Header),
    /// A connection that may have packets for the guest.
    Conn(ConnKey),
}

pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    connect_timeout: Duration,
    pub epoll: Epoll,
    listener: UnixListener,
    conns: HashMap<ConnKey, Connection>,
    handshakes: HashMap<RawFd, Handshake>,
    conn_fds: HashMap<RawFd, ConnKey>,
    rx_items: VecDeque<RxItem>,
    control_count: usize,
    next_local_port: u32,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Muxer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Muxer")
            .field("guest_cid", &self.guest_cid)
            .field("uds_path", &self.uds_path)
            .field("connect_timeout", &self.connect_timeout)
            .field("epoll", &self.epoll)
            .field("listener", &self.listener)
            .field("conns", &self.conns)
            .field("handshakes", &self.handshakes)
            .field("conn_fds", &self.conn_fds)
            .field("control_count", &self.control_count)
            .field("next_local_port", &self.next_local_port)
            .finish_non_exhaustive()
    }
}

impl Muxer {
    pub fn new(
        guest_cid: u64,
        uds_path: PathBuf,
        listener: UnixListener,
        connect_timeout: Duration,
    ) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
        )?;
        Ok(Self {
            guest_cid,
            uds_path,
            connect_timeout,
            epoll,
            listener,
            conns: HashMap::new(),
            handshakes: HashMap::new(),
            conn_fds: HashMap::new(),
            rx_items: VecDeque::new(),
            control_count: 0,
            next_local_port: first_local_port(),
            scratch: vec![0; 64 * 1024],
        })
    }

    /// Whether TX processing must wait for the guest to take queued RX packets.
    pub fn control_full(&self) -> bool {
        self.control_count >= MAX_CONTROL_PACKETS
    }

    pub fn has_rx(&self) -> bool {
        !self.rx_items.is_empty()
    }

    #[cfg(test)]
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    fn push_control(&mut self, hdr: Header) {
        self.control_count += 1;
        self.rx_items.push_back(RxItem::Control(hdr));
    }

    /// Accepts every pending host stream on the device socket.
    pub fn accept(&mut self, now: Instant) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    crate::warn_limited!("vsock: accept on {}: {e}", self.uds_path.display());
                    return;
                }
            };
            if self.handshakes.len() >= MAX_HANDSHAKES || self.conns.len() >= MAX_CONNECTIONS {
                crate::warn_limited!("vsock: too many host connections, refusing one");
                continue;
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let fd = stream.as_raw_fd();
            let ev = EpollEvent::new(EventSet::IN, TOKEN_FD_BASE + fd as u64);
            if let Err(e) = self.epoll.ctl(ControlOperation::Add, fd, ev) {
                crate::warn_limited!("vsock: cannot watch a host stream: {e}");
                continue;
            }
            self.handshakes
                .insert(fd, Handshake::new(stream, now + self.connect_timeout));
        }
    }

    /// Readiness of a host stream (handshake or connection).
    pub fn stream_event(&mut self, fd: RawFd, events: EventSet, now: Instant) {
        if self.handshakes.contains_key(&fd) {
            self.handshake_event(fd, now);
        } else if let Some(&key) = self.conn_fds.get(&fd) {
            if events.intersects(EventSet::HANG_UP | EventSet::ERROR)
                && let Some(conn) = self.conns.get_mut(&key)
            {
                conn.set_host_gone();
            }
            self.update(key, now);
        }
    }

    fn drop_handshake(&mut self, fd: RawFd) {
        if let Some(hs) = self.handshakes.remove(&fd) {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            drop(hs);
        }
    }

    fn handshake_event(&mut self, fd: RawFd, now: Instant) {
        let Some(hs) = self.handshakes.get_mut(&fd) else {
            return;
        };
        let (port, leftover) = match hs.read_more() {
            HandshakeStep::Pending => return,
            HandshakeStep::Failed => {
                tracing::debug!("vsock: malformed or abandoned host handshake");
                self.drop_handshake(fd);
                return;
            }
            HandshakeStep::Connect { port, leftover } => (port, leftover),
        };
        tracing::debug!("vsock: host connects to guest port {port}");
        if self.conns.len() >= MAX_CONNECTIONS {
            self.drop_handshake(fd);
            return;
        }
        let Some(hs) = self.handshakes.remove(&fd) else {
            return;
        };
        let key = ConnKey {
            local_port: self.alloc_local_port(),
            peer_port: port,
        };
        let mut conn = Connection::new_local(hs.stream, key, &leftover, now + self.connect_timeout);
        // The stream stays in the epoll set under the same token.
        conn.registered = Some(EventSet::IN);
        self.conn_fds.insert(fd, key);
        self.conns.insert(key, conn);
        self.update(key, now);
    }

    /// A host port unique among live connections.
    fn alloc_local_port(&mut self) -> u32 {
        loop {
            let port = self.next_local_port;
            self.next_local_port = port.checked_add(1).unwrap_or(LOCAL_PORT_BASE);
            if !self.conns.keys().any(|k| k.local_port == port) {
                return port;
            }
        }
    }

    /// Routes one packet from the guest's TX queue.
    pub fn guest_packet(&mut self, hdr: &Header, data: &[u8], now: Instant) {
        if hdr.src_cid != self.guest_cid {
            tracing::debug!(
                "vsock: dropping a guest packet with source CID {}",
                hdr.src_cid
            );
            return;
        }
        if hdr.dst_cid != HOST_CID || hdr.type_ != TYPE_STREAM {
            if hdr.op != OP_RST {
                self.push_control(hdr.rst_reply());
            }
            return;
        }
        let key = ConnKey {
            local_port: hdr.dst_port,
            peer_port: hdr.src_port,
        };
        let Some(conn) = self.conns.get_mut(&key) else {
            match hdr.op {
                OP_REQUEST => self.guest_connect(key, hdr, now),
                OP_RST => {}
                _ => self.push_control(hdr.rst_reply()),
            }
            return;
        };
        let verdict = if hdr.op == OP_REQUEST {
            // A second REQUEST for a live connection: the guest lost track of it.
            Verdict::Kill { rst: true }
        } else {
            conn.on_guest_packet(hdr, data, now)
        };
        match verdict {
            Verdict::Keep => self.update(key, now),
            Verdict::Kill { rst } => self.kill(key, rst),
        }
    }

    fn guest_connect(&mut self, key: ConnKey, hdr: &Header, now: Instant) {
        if self.conns.len() >= MAX_CONNECTIONS {
            crate::warn_limited!(
                "vsock: too many connections, refusing guest port {}",
                key.peer_port
            );
            self.push_control(hdr.rst_reply());
            return;
        }
        let path = port_path(&self.uds_path, key.local_port);
        let stream = match connect_nonblocking(&path) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("vsock: guest connect to {}: {e}", path.display());
                self.push_control(hdr.rst_reply());
                return;
            }
        };
        let fd = stream.as_raw_fd();
        self.conn_fds.insert(fd, key);
        self.conns
            .insert(key, Connection::new_peer(stream, key, hdr));
        self.update(key, now);
    }

    /// Brings a connection up to date: moves data, applies its verdict, fixes its epoll
    /// interest and queues it for RX if it has something for the guest.
    fn update(&mut self, key: ConnKey, now: Instant) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        conn.service(&mut self.scratch);
        if let Verdict::Kill { rst } = conn.verdict(now) {
            self.kill(key, rst);
            return;
        }
        let wanted = conn.wanted_events();
        if wanted != conn.registered {
            let fd = conn.stream.as_raw_fd();
            let op = match (conn.registered, wanted) {
                (None, _) => ControlOperation::Add,
                (Some(_), Some(_)) => ControlOperation::Modify,
                (Some(_), None) => ControlOperation::Delete,
            };
            let ev = EpollEvent::new(
                wanted.unwrap_or(EventSet::empty()),
                TOKEN_FD_BASE + fd as u64,
            );
            if let Err(e) = self.epoll.ctl(op, fd, ev) {
                crate::warn_limited!("vsock: epoll update for port {}: {e}", key.local_port);
                self.kill(key, true);
                return;
            }
            conn.registered = wanted;
        }
        if !conn.in_rx_queue && conn.has_pending_rx() {
            conn.in_rx_queue = true;
            self.rx_items.push_back(RxItem::Conn(key));
        }
    }

    /// Removes a connection, closing its host stream; queues an RST for the guest if asked.
    fn kill(&mut self, key: ConnKey, rst: bool) {
        let Some(conn) = self.conns.remove(&key) else {
            return;
        };
        let fd = conn.stream.as_raw_fd();
        if conn.registered.is_some() {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        }
        self.conn_fds.remove(&fd);
        if rst {
            let hdr = Header {
                src_cid: HOST_CID,
                dst_cid: self.guest_cid,
                src_port: key.local_port,
                dst_port: key.peer_port,
                type_: TYPE_STREAM,
                op: OP_RST,
                ..Header::default()
            };
            self.push_control(hdr);
        }
    }

    /// Fills one RX buffer. Returns the bytes written (header plus payload), or `None` if
    /// nothing could use this buffer.
    pub fn fill_rx(&mut self, pkt: &mut VsockPacket<'_, ()>, now: Instant) -> Option<u32> {
        // Bounded: a connection re-queues itself when it still has data it could not
        // fit (e.g. a header-only buffer), and must not be retried forever.
        for _ in 0..self.rx_items.len() {
            let item = self.rx_items.pop_front()?;
            let hdr = match item {
                RxItem::Control(hdr) => {
                    self.control_count -= 1;
                    Some(hdr)
                }
                RxItem::Conn(key) => {
                    let Some(conn) = self.conns.get_mut(&key) else {
                        continue;
                    };
                    conn.in_rx_queue = false;
                    let hdr = conn.next_packet(self.guest_cid, pkt.data_slice(), now);
                    self.update(key, now);
                    hdr
                }
            };
            if let Some(hdr) = hdr {
                hdr.write_to(pkt);
                return Some(super::packet::HEADER_SIZE as u32 + hdr.len);
            }
        }
        None
    }

    /// The earliest handshake or connection deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        let conns = self.conns.values().filter_map(Connection::deadline);
        let handshakes = self.handshakes.values().map(|h| h.deadline);
        conns.chain(handshakes).min()
    }

    /// Closes what has timed out.
    pub fn expire(&mut self, now: Instant) {
        let late: Vec<RawFd> = self
            .handshakes
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(&fd, _)| fd)
            .collect();
        for fd in late {
            tracing::debug!("vsock: host handshake timed out");
            self.drop_handshake(fd);
        }
        let late: Vec<ConnKey> = self
            .conns
            .values()
            .filter(|c| c.deadline().is_some_and(|d| d <= now))
            .map(|c| c.key)
            .collect();
        for key in late {
            // The host side then sees its stream closed, as for a refusal:
            // said here, as the guest's silence is what tells them apart.
            if self
                .conns
                .get(&key)
                .is_some_and(|c| c.state == super::connection::State::AwaitingResponse)
            {
                crate::warn_limited!(
                    "vsock: the guest did not answer a host connection to its port {} within {:?}",
                    key.peer_port,
                    self.connect_timeout
                );
            }
            self.update(key, now);
        }
    }

    /// Drops every connection without telling the guest (it resets its side itself on
    /// a transport reset event). Streams still in their handshake are kept.
    pub fn reset_connections(&mut self) {
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for key in keys {
            self.kill(key, false);
        }
        self.rx_items.clear();
        self.control_count = 0;
    }
}
