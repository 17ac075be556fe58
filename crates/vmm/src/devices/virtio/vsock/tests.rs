//! The device driven as a guest driver drives it: real guest memory, split queues in it,
//! real eventfds, a real worker thread and real Unix sockets.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::connection::BUF_ALLOC;
use super::muxer::LOCAL_PORT_BASE;
use super::packet::*;
use super::test_driver::GuestQueue;
use super::unix::port_path;
use super::{Vsock, VsockError};
use crate::devices::virtio::{ActivatedQueue, VirtioDevice, VirtioInterrupt, VirtioInterruptType};
use crate::vstate::memory::GuestMemory;

const CID: u64 = 3;
const WAIT: Duration = Duration::from_secs(5);
/// The receive buffer the test guest advertises unless a test says otherwise.
const GUEST_BUF: u32 = 64 * 1024;
const RX_DATA: u32 = 4096;

#[derive(Default)]
struct CountingIrq(AtomicU64);

impl VirtioInterrupt for CountingIrq {
    fn trigger(&self, kind: VirtioInterruptType) -> io::Result<()> {
        assert_eq!(kind, VirtioInterruptType::Queue);
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// The guest side: its memory, its three queues and the buffers it posted.
struct Guest {
    mem: GuestMemory,
    rx: GuestQueue,
    tx: GuestQueue,
    ev: GuestQueue,
    kicks: [EventFd; 3],
    rx_bufs: HashMap<u16, u64>,
    tx_bufs: HashMap<u16, u64>,
    tx_free: Vec<u64>,
    ev_bufs: HashMap<u16, u64>,
    irq: Arc<CountingIrq>,
}

const RX_BASE: u64 = 0x10_0000;
const TX_BASE: u64 = 0x20_0000;
const TX_SLOT: u64 = 0x1_1000;
const EV_BASE: u64 = 0x70_0000;

impl Guest {
    fn activate(dev: &mut Vsock) -> Guest {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x80_0000)]).unwrap();
        let rx = GuestQueue::new(&mem, 0x1_0000, 256);
        let tx = GuestQueue::new(&mem, 0x2_0000, 256);
        let ev = GuestQueue::new(&mem, 0x3_0000, 256);
        let kicks = [(); 3].map(|_| EventFd::new(EFD_NONBLOCK).unwrap());
        let queues = [&rx, &tx, &ev]
            .iter()
            .zip(&kicks)
            .map(|(q, k)| ActivatedQueue {
                queue: q.device_queue(),
                notify: k.try_clone().unwrap(),
            })
            .collect();
        let irq = Arc::new(CountingIrq::default());
        dev.activate(mem.clone(), irq.clone(), queues).unwrap();
        Guest {
            mem,
            rx,
            tx,
            ev,
            kicks,
            rx_bufs: HashMap::new(),
            tx_bufs: HashMap::new(),
            tx_free: (0..32).map(|i| TX_BASE + i * TX_SLOT).collect(),
            ev_bufs: HashMap::new(),
            irq,
        }
    }

    /// Posts `n` RX buffers laid out as header and data descriptors.
    fn post_rx(&mut self, n: u64) {
        for i in 0..n {
            let base = RX_BASE + (self.rx_bufs.len() as u64 + i) * 0x2000;
            self.repost_rx(base);
        }
        self.kicks[0].write(1).unwrap();
    }

    fn repost_rx(&mut self, base: u64) {
        let head = self.rx.add(&[
            (base, HEADER_SIZE as u32, true),
            (base + 0x100, RX_DATA, true),
        ]);
        self.rx_bufs.insert(head, base);
    }

    fn post_events(&mut self, n: u64) {
        for i in 0..n {
            let at = EV_BASE + i * 0x10;
            let head = self.ev.add(&[(at, 4, true)]);
            self.ev_bufs.insert(head, at);
        }
        self.kicks[2].write(1).unwrap();
    }

    fn reclaim_tx(&mut self) {
        while let Some((head, _)) = self.tx.pop_used() {
            let base = self.tx_bufs.remove(&head).unwrap();
            self.tx_free.push(base);
        }
    }

    /// Sends a packet, with the payload in its own descriptor (or after the header in
    /// the same descriptor if `single`).
    fn send_with(&mut self, mut hdr: Header, data: &[u8], single: bool) {
        self.reclaim_tx();
        let base = self.tx_free.pop().expect("no free TX slot");
        hdr.len = data.len() as u32;
        self.mem
            .write_slice(&hdr.to_bytes(), GuestAddress(base))
            .unwrap();
        let head = if single {
            self.mem
                .write_slice(data, GuestAddress(base + HEADER_SIZE as u64))
                .unwrap();
            self.tx
                .add(&[(base, (HEADER_SIZE + data.len()) as u32, false)])
        } else if data.is_empty() {
            self.tx.add(&[(base, HEADER_SIZE as u32, false)])
        } else {
            self.mem
                .write_slice(data, GuestAddress(base + 0x100))
                .unwrap();
            self.tx.add(&[
                (base, HEADER_SIZE as u32, false),
                (base + 0x100, data.len() as u32, false),
            ])
        };
        self.tx_bufs.insert(head, base);
        self.kicks[1].write(1).unwrap();
    }

    fn send(&mut self, hdr: Header, data: &[u8]) {
        self.send_with(hdr, data, false);
    }

    fn try_recv(&mut self, timeout: Duration) -> Option<(Header, Vec<u8>)> {
        let end = Instant::now() + timeout;
        loop {
            if let Some((head, len)) = self.rx.pop_used() {
                let base = self.rx_bufs.remove(&head).unwrap();
                let mut raw = [0u8; HEADER_SIZE];
                self.mem.read_slice(&mut raw, GuestAddress(base)).unwrap();
                let hdr = Header::from_bytes(&raw);
                assert_eq!(len, HEADER_SIZE as u32 + hdr.len, "used length");
                let mut data = vec![0u8; hdr.len as usize];
                self.mem
                    .read_slice(&mut data, GuestAddress(base + 0x100))
                    .unwrap();
                self.repost_rx(base);
                self.kicks[0].write(1).unwrap();
                return Some((hdr, data));
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn recv(&mut self) -> (Header, Vec<u8>) {
        self.try_recv(WAIT).expect("the device sent nothing")
    }

    fn assert_silent(&mut self, d: Duration) {
        if let Some(p) = self.try_recv(d) {
            panic!("unexpected packet {p:?}");
        }
    }

    fn recv_event(&mut self) -> u32 {
        let end = Instant::now() + WAIT;
        loop {
            if let Some((head, len)) = self.ev.pop_used() {
                assert_eq!(len, 4);
                let at = self.ev_bufs.remove(&head).unwrap();
                return u32::from_le(self.mem.read_obj(GuestAddress(at)).unwrap());
            }
            assert!(Instant::now() < end, "no event");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A packet from the guest's port `src` to host port `dst`.
fn gpkt(op: u16, src: u32, dst: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port: src,
        dst_port: dst,
        type_: TYPE_STREAM,
        op,
        buf_alloc: GUEST_BUF,
        ..Header::default()
    }
}

/// The guest's answer on the connection `to` belongs to.
fn answer(to: &Header, op: u16) -> Header {
    gpkt(op, to.dst_port, to.src_port)
}

fn device(dir: &tempfile::TempDir) -> (Vsock, PathBuf) {
    let path = dir.path().join("v.sock");
    (Vsock::new(CID, path.clone()).unwrap(), path)
}

fn host_connect(path: &PathBuf, line: &[u8]) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(line).unwrap();
    s
}

fn read_line(s: &mut UnixStream) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while out.last() != Some(&b'\n') {
        assert_eq!(
            s.read(&mut b).unwrap(),
            1,
            "stream closed before a full line"
        );
        out.push(b[0]);
    }
    String::from_utf8(out).unwrap()
}

/// Reads until the device closes the stream; fails on a timeout. Closing a Unix stream
/// with unread bytes in it shows as a reset rather than EOF, which is as good.
fn assert_eof(s: &mut UnixStream) {
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("stream not closed in time: {e}"),
    }
}

/// Host-initiated connection accepted by the guest; returns the guest's view (REQUEST).
fn establish_host_conn(g: &mut Guest, path: &PathBuf, port: u32) -> (UnixStream, Header) {
    let mut host = host_connect(path, format!("CONNECT {port}\n").as_bytes());
    let (req, _) = g.recv();
    assert_eq!(req.op, OP_REQUEST);
    g.send(answer(&req, OP_RESPONSE), &[]);
    assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port));
    (host, req)
}

#[test]
fn host_connect_exchanges_data_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(16);

    let mut host = host_connect(&path, b"CONNECT 1234\n");
    let (req, _) = g.recv();
    assert_eq!(
        (req.op, req.type_, req.src_cid, req.dst_cid),
        (OP_REQUEST, TYPE_STREAM, HOST_CID, CID)
    );
    assert_eq!(req.dst_port, 1234);
    assert!(req.src_port >= LOCAL_PORT_BASE);
    assert_eq!(req.buf_alloc, BUF_ALLOC);
    g.send(answer(&req, OP_RESPONSE), &[]);
    assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port));

    host.write_all(b"ping").unwrap();
    let (h, d) = g.recv();
    assert_eq!(
        (h.op, h.src_port, h.dst_port, d.as_slice()),
        (OP_RW, req.src_port, 1234, &b"ping"[..])
    );
    g.send(answer(&req, OP_RW), b"pong");
    g.send_with(answer(&req, OP_RW), b"!", true);
    let mut buf = [0u8; 5];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong!");
    assert!(g.irq.0.load(Ordering::SeqCst) > 0);

    // A second host connection gets a different local port.
    let (_host2, req2) = establish_host_conn(&mut g, &path, 1234);
    assert_ne!(req2.src_port, req.src_port);

    // The host closes: the guest is told both directions are done, and answers RST.
    drop(host);
    let (h, _) = g.recv();
    assert_eq!(
        (h.op, h.flags, h.src_port),
        (OP_SHUTDOWN, SHUTDOWN_BOTH, req.src_port)
    );
    g.send(answer(&req, OP_RST), &[]);
    g.assert_silent(Duration::from_millis(100));
}

#[test]
fn guest_rst_closes_host_stream() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(4);
    let mut host = host_connect(&path, b"CONNECT 9\n");
    let (req, _) = g.recv();
    g.send(answer(&req, OP_RST), &[]);
    assert_eof(&mut host);
    g.assert_silent(Duration::from_millis(50));
}

#[test]
fn guest_connect_to_host_listener_with_half_close() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let listener = UnixListener::bind(port_path(&path, 5000)).unwrap();
    let mut g = Guest::activate(&mut dev);
    g.post_rx(8);

    g.send(gpkt(OP_REQUEST, 7777, 5000), &[]);
    let (resp, _) = g.recv();
    assert_eq!(
        (resp.op, resp.src_port, resp.dst_port, resp.dst_cid),
        (OP_RESPONSE, 5000, 7777, CID)
    );
    let (mut host, _) = listener.accept().unwrap();
    host.set_read_timeout(Some(WAIT)).unwrap();

    g.send(gpkt(OP_RW, 7777, 5000), b"hello");
    let mut buf = [0u8; 5];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    host.write_all(b"world").unwrap();
    let (h, d) = g.recv();
    assert_eq!((h.op, d.as_slice()), (OP_RW, &b"world"[..]));

    // Guest half-closes: the host reads EOF but can still send.
    g.send(
        Header {
            flags: SHUTDOWN_SEND,
            ..gpkt(OP_SHUTDOWN, 7777, 5000)
        },
        &[],
    );
    let mut rest = Vec::new();
    host.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    host.write_all(b"after").unwrap();
    let (h, d) = g.recv();
    assert_eq!((h.op, d.as_slice()), (OP_RW, &b"after"[..]));

    // Full shutdown from the guest: the device finishes with an RST.
    g.send(
        Header {
            flags: SHUTDOWN_BOTH,
            ..gpkt(OP_SHUTDOWN, 7777, 5000)
        },
        &[],
    );
    let (h, _) = g.recv();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RST, 5000, 7777));
}

#[test]
fn guest_connect_without_listener_gets_rst() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, _path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(4);
    g.send(gpkt(OP_REQUEST, 1111, 6000), &[]);
    let (h, _) = g.recv();
    assert_eq!(
        (h.op, h.src_cid, h.dst_cid, h.src_port, h.dst_port),
        (OP_RST, HOST_CID, CID, 6000, 1111)
    );
}

#[test]
fn malformed_handshakes_close_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    dev.set_connect_timeout(Duration::from_millis(300));
    let mut g = Guest::activate(&mut dev);
    g.post_rx(4);
    for bad in [
        &b"HELLO\n"[..],
        b"CONNECT abc\n",
        b"CONNECT +5\n",
        b"CONNECT 99999999999\n",
        b"CONNECT 5 6\n",
        &[b'A'; 40],
        b"",
    ] {
        let mut s = host_connect(&path, bad);
        let t = Instant::now();
        assert_eof(&mut s);
        // The empty handshake is closed by the timeout, the rest at once.
        assert!(t.elapsed() < Duration::from_secs(2));
    }
    let mut s = host_connect(&path, b"CONN");
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eof(&mut s);
    g.assert_silent(Duration::from_millis(50));
    // The device still works.
    let (_host, req) = establish_host_conn(&mut g, &path, 42);
    assert_eq!(req.dst_port, 42);
}

#[test]
fn unanswered_request_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    dev.set_connect_timeout(Duration::from_millis(300));
    let mut g = Guest::activate(&mut dev);
    g.post_rx(4);
    let mut host = host_connect(&path, b"CONNECT 77\n");
    let (req, _) = g.recv();
    let t = Instant::now();
    assert_eof(&mut host);
    assert!(t.elapsed() < Duration::from_secs(2));
    let (h, _) = g.recv();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RST, req.src_port, 77));
    // A late answer gets an RST too.
    g.send(answer(&req, OP_RESPONSE), &[]);
    assert_eq!(g.recv().0.op, OP_RST);
}

#[test]
fn guest_credit_limits_a_fast_host_sender() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(32);
    let mut host = host_connect(&path, b"CONNECT 8\n");
    let (req, _) = g.recv();
    let small = Header {
        buf_alloc: 8192,
        ..answer(&req, OP_RESPONSE)
    };
    g.send(small, &[]);
    assert!(read_line(&mut host).starts_with("OK "));
    let mut writer = host.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let data: Vec<u8> = (0..1_000_000u32).map(|i| i as u8).collect();
        let _ = writer.write_all(&data);
    });

    let mut got = Vec::new();
    for round in 1..=2u32 {
        loop {
            let (h, d) = g.recv();
            if h.op == OP_CREDIT_REQUEST {
                break;
            }
            assert_eq!(h.op, OP_RW);
            got.extend(d);
        }
        assert_eq!(
            got.len() as u32,
            8192 * round,
            "sent beyond the guest's credit"
        );
        g.assert_silent(Duration::from_millis(100));
        // The guest consumed everything: a credit update lets the next 8 KiB through.
        g.send(
            Header {
                fwd_cnt: got.len() as u32,
                ..Header {
                    op: OP_CREDIT_UPDATE,
                    ..small
                }
            },
            &[],
        );
    }
    assert!(got.iter().enumerate().all(|(i, &b)| b == i as u8));
    drop(dev);
    sender.join().unwrap();
}

#[test]
fn transport_reset_event_drops_connections() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(8);
    g.post_events(2);
    let (mut host, _) = establish_host_conn(&mut g, &path, 30);
    dev.send_transport_reset();
    assert_eq!(g.recv_event(), EVENT_TRANSPORT_RESET);
    assert_eof(&mut host);
    g.assert_silent(Duration::from_millis(50));
    // New connections work after the reset (once the guest has taken it in:
    // it refills its event queue).
    g.post_events(1);
    establish_host_conn(&mut g, &path, 30);
}

#[test]
fn host_connections_wait_until_the_guest_has_taken_in_a_reset() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(8);
    g.post_events(2);
    dev.send_transport_reset();
    assert_eq!(g.recv_event(), EVENT_TRANSPORT_RESET);
    // Had the guest accepted this one before resetting its sockets, the
    // reset would drop it: it waits.
    let mut host = host_connect(&path, b"CONNECT 30\n");
    g.assert_silent(Duration::from_millis(100));
    // The guest refills its event queue once it has reset its sockets.
    g.post_events(1);
    let (req, _) = g.recv();
    assert_eq!(req.op, OP_REQUEST);
    g.send(answer(&req, OP_RESPONSE), &[]);
    assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port));
}

#[test]
fn a_guest_that_never_takes_in_a_reset_is_not_waited_for_long() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(8);
    // No event buffer: the reset cannot even be delivered.
    dev.send_transport_reset();
    let started = Instant::now();
    establish_host_conn(&mut g, &path, 30);
    assert!(started.elapsed() < WAIT);
}

#[test]
fn invalid_guest_packets_are_dropped_or_reset() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let listener = UnixListener::bind(port_path(&path, 5000)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut g = Guest::activate(&mut dev);
    g.post_rx(8);

    // Spoofed source CID: dropped without a connection attempt.
    g.send(
        Header {
            src_cid: 9,
            ..gpkt(OP_REQUEST, 1, 5000)
        },
        &[],
    );
    g.assert_silent(Duration::from_millis(100));
    assert!(listener.accept().is_err());
    // Unknown destination CID and a non-stream type: RST.
    g.send(
        Header {
            dst_cid: 7,
            ..gpkt(OP_REQUEST, 1, 5000)
        },
        &[],
    );
    let (h, _) = g.recv();
    assert_eq!((h.op, h.src_cid, h.dst_cid), (OP_RST, 7, CID));
    g.send(
        Header {
            type_: 2,
            ..gpkt(OP_REQUEST, 1, 5000)
        },
        &[],
    );
    assert_eq!(g.recv().0.op, OP_RST);
    // Data for no connection: RST; an RST for no connection: nothing.
    g.send(gpkt(OP_RW, 1, 5000), b"x");
    assert_eq!(g.recv().0.op, OP_RST);
    g.send(gpkt(OP_RST, 1, 5000), &[]);
    g.assert_silent(Duration::from_millis(50));
    // A descriptor too short to hold a header, a length beyond the limit, a payload
    // longer than its descriptor, and a device-writable TX buffer: all dropped.
    g.reclaim_tx();
    let base = g.tx_free.pop().unwrap();
    for (len, desc_len, flags_write) in [
        (0, 20, false),
        (MAX_PKT_DATA + 1, HEADER_SIZE as u32 + 16, false),
        (100, HEADER_SIZE as u32 + 16, false),
        (0, HEADER_SIZE as u32, true),
    ] {
        let hdr = Header {
            len,
            ..gpkt(OP_REQUEST, 1, 5000)
        };
        g.mem
            .write_slice(&hdr.to_bytes(), GuestAddress(base))
            .unwrap();
        let head = g.tx.add(&[(base, desc_len, flags_write)]);
        g.kicks[1].write(1).unwrap();
        let end = Instant::now() + WAIT;
        while g.tx.pop_used().map(|(h, _)| h) != Some(head) {
            assert!(Instant::now() < end, "TX buffer not returned");
        }
    }
    g.tx_free.push(base);
    g.assert_silent(Duration::from_millis(50));
    assert!(listener.accept().is_err());
    // The device still serves the guest.
    g.send(gpkt(OP_REQUEST, 2, 5000), &[]);
    assert_eq!(g.recv().0.op, OP_RESPONSE);
}

#[test]
fn guest_exceeding_credit_is_reset() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let listener = UnixListener::bind(port_path(&path, 5000)).unwrap();
    let mut g = Guest::activate(&mut dev);
    g.post_rx(8);
    g.send(gpkt(OP_REQUEST, 3, 5000), &[]);
    assert_eq!(g.recv().0.op, OP_RESPONSE);
    let (_host, _) = listener.accept().unwrap(); // never reads
    // The kernel buffers some of it, and the device says so in credit updates; a guest
    // that keeps sending regardless overruns BUF_ALLOC and is reset.
    let chunk = vec![0u8; 60 * 1024];
    let mut sent = 0usize;
    let mut fwd_cnt = 0u32;
    loop {
        g.send(gpkt(OP_RW, 3, 5000), &chunk);
        sent += chunk.len();
        assert!(sent < 4 * 1024 * 1024, "never reset");
        while let Some((h, _)) = g.try_recv(Duration::from_millis(1)) {
            if h.op == OP_RST {
                assert!(sent - fwd_cnt as usize > BUF_ALLOC as usize);
                return;
            }
            assert_eq!(h.op, OP_CREDIT_UPDATE);
            fwd_cnt = h.fwd_cnt;
        }
    }
}

#[test]
fn reset_reactivate_and_drop() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    assert!(matches!(
        Vsock::new(CID, path.clone()),
        Err(VsockError::Bind { .. })
    ));
    assert!(matches!(
        Vsock::new(2, dir.path().join("x")),
        Err(VsockError::InvalidCid(2))
    ));
    assert!(matches!(
        Vsock::new(u64::from(u32::MAX), dir.path().join("x")),
        Err(VsockError::InvalidCid(_))
    ));
    assert_eq!(dev.device_type(), 19);
    assert_eq!(dev.queue_max_sizes(), &[256, 256, 256]);
    assert_eq!(dev.avail_features(), 1 << 32);
    let mut cfg = [0xffu8; 12];
    dev.read_config(0, &mut cfg);
    assert_eq!(cfg, [3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let mut hi = [0xffu8; 4];
    dev.read_config(4, &mut hi);
    assert_eq!(hi, [0; 4]);

    let mut g = Guest::activate(&mut dev);
    g.post_rx(4);
    let (mut host, _) = establish_host_conn(&mut g, &path, 1);
    assert!(dev.reset());
    assert_eof(&mut host);
    let queues = Vec::new();
    let irq = Arc::new(CountingIrq::default());
    assert!(dev.activate(g.mem.clone(), irq, queues).is_err());

    let mut g = Guest::activate(&mut dev);
    g.post_rx(4);
    let (_host, _) = establish_host_conn(&mut g, &path, 1);
    drop(dev);
    assert!(!path.exists());
}

#[test]
fn bulk_transfer_both_ways_keeps_data_intact() {
    const TOTAL: usize = 4 * 1024 * 1024;
    let pattern = |i: usize| (i % 251) as u8;
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, path) = device(&dir);
    let mut g = Guest::activate(&mut dev);
    g.post_rx(64);
    let (host, req) = establish_host_conn(&mut g, &path, 2000);

    // Host to guest; the guest returns credit as it consumes, like the Linux driver.
    let mut writer = host.try_clone().unwrap();
    let t = Instant::now();
    let sender = std::thread::spawn(move || {
        let data: Vec<u8> = (0..TOTAL).map(pattern).collect();
        writer.write_all(&data).unwrap();
    });
    let mut got = 0usize;
    let mut credited = 0usize;
    while got < TOTAL {
        let (h, d) = g.recv();
        match h.op {
            OP_RW => {
                assert!(d.iter().enumerate().all(|(i, &b)| b == pattern(got + i)));
                got += d.len();
            }
            OP_CREDIT_REQUEST => credited = 0,
            op => panic!("unexpected op {op}"),
        }
        if got - credited >= 64 * 1024 || credited == 0 {
            g.send(
                Header {
                    fwd_cnt: got as u32,
                    ..answer(&req, OP_CREDIT_UPDATE)
                },
                &[],
            );
            credited = got;
        }
    }
    sender.join().unwrap();
    let h2g = t.elapsed();

    // Guest to host within the device's credit; the host checks every byte.
    let mut reader = host.try_clone().unwrap();
    reader.set_read_timeout(Some(WAIT)).unwrap();
    let t = Instant::now();
    let receiver = std::thread::spawn(move || {
        let mut buf = vec![0u8; TOTAL];
        reader.read_exact(&mut buf).unwrap();
        assert!(buf.iter().enumerate().all(|(i, &b)| b == pattern(i)));
    });
    let data: Vec<u8> = (0..TOTAL).map(pattern).collect();
    let (mut sent, mut dev_fwd) = (0usize, 0usize);
    while sent < TOTAL {
        let n = (TOTAL - sent).min(32 * 1024);
        if sent + n - dev_fwd <= BUF_ALLOC as usize {
            g.send(answer(&req, OP_RW), &data[sent..sent + n]);
            sent += n;
        }
        let wait = if sent + n - dev_fwd > BUF_ALLOC as usize {
            WAIT
        } else {
            Duration::ZERO
        };
        if let Some((h, _)) = g.try_recv(wait) {
            // Every device packet carries its credit.
            dev_fwd = h.fwd_cnt as usize;
            match h.op {
                OP_CREDIT_UPDATE => {}
                OP_CREDIT_REQUEST => g.send(
                    Header {
                        fwd_cnt: got as u32,
                        ..answer(&req, OP_CREDIT_UPDATE)
                    },
                    &[],
                ),
                op => panic!("unexpected op {op}"),
            }
        }
    }
    receiver.join().unwrap();
    let g2h = t.elapsed();
    eprintln!("vsock bulk: 4 MiB host->guest in {h2g:?}, guest->host in {g2h:?}");
}
