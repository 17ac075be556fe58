//! The device driven as a guest driver would: real guest memory with split queues in
//! it, real EventFds and worker thread, and a datagram socket as the host network.

use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::device::OFFERED_FEATURES;
use super::{FrameBackend, MacAddr, Net, NetConfig, NetCounters, NetError, VNET_HDR_LEN};
use crate::devices::virtio::persist::SavedDevice;
use crate::devices::virtio::vsock::test_driver::GuestQueue;
use crate::devices::virtio::{ActivatedQueue, VirtioDevice, VirtioInterrupt, VirtioInterruptType};
use crate::vstate::memory::GuestMemory;

const WAIT: Duration = Duration::from_secs(10);
const MAC: MacAddr = [0x06, 0x00, 0xac, 0x10, 0x00, 0x02];
const RX_BASE: u64 = 0x1000;
const TX_BASE: u64 = 0x8000;

struct CountingIrq(AtomicU64);

impl VirtioInterrupt for CountingIrq {
    fn trigger(&self, kind: VirtioInterruptType) -> std::io::Result<()> {
        assert_eq!(kind, VirtioInterruptType::Queue);
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

struct Harness {
    mem: GuestMemory,
    net: Net,
    /// The host network's end of the backend.
    host: UnixDatagram,
    rx: GuestQueue,
    tx: GuestQueue,
    rx_kick: EventFd,
    tx_kick: EventFd,
    irq: Arc<CountingIrq>,
    counters: Arc<NetCounters>,
    next_buf: u64,
}

fn config(mac: Option<MacAddr>) -> NetConfig {
    NetConfig {
        iface_id: "eth0".into(),
        host_dev_name: "tap0".into(),
        guest_mac: mac,
    }
}

/// A frame as it crosses the backend: a zero header (no offloads) and the payload.
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f.extend_from_slice(payload);
    f
}

fn payload(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

/// A datagram backend that records the offloads the device sets.
struct Recording {
    socket: UnixDatagram,
    offloads: Arc<std::sync::Mutex<Vec<libc::c_uint>>>,
}

impl std::os::fd::AsRawFd for Recording {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.socket.as_raw_fd()
    }
}

impl FrameBackend for Recording {
    fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.socket.read_frame(buf)
    }

    fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<()> {
        self.socket.write_frame(frame)
    }

    fn set_offloads(&mut self, tun_flags: libc::c_uint) -> std::io::Result<()> {
        self.offloads.lock().unwrap().push(tun_flags);
        Ok(())
    }
}

/// What a driver without mergeable buffers and event index acks: each frame in
/// one chain, an interrupt for every use.
const PLAIN: u64 =
    OFFERED_FEATURES & !(1 << VIRTIO_NET_F_MRG_RXBUF) & !(1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_NET_F_MAC);

impl Harness {
    fn new() -> Harness {
        Self::with_features(PLAIN).0
    }

    /// The device with `acked` features accepted; also the offloads it set.
    fn with_features(acked: u64) -> (Harness, Arc<std::sync::Mutex<Vec<libc::c_uint>>>) {
        let (device_end, host) = UnixDatagram::pair().unwrap();
        device_end.set_nonblocking(true).unwrap();
        host.set_read_timeout(Some(WAIT)).unwrap();
        let offloads = Arc::default();
        let backend = Recording {
            socket: device_end,
            offloads: Arc::clone(&offloads),
        };
        let mut net = Net::with_backend(config(Some(MAC)), Box::new(backend));
        net.set_acked_features(acked);
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap();
        let counters = net.counters();
        let mut h = Harness {
            rx: GuestQueue::new(&mem, RX_BASE, 256),
            tx: GuestQueue::new(&mem, TX_BASE, 256),
            mem,
            net,
            host,
            rx_kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            tx_kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            irq: Arc::new(CountingIrq(AtomicU64::new(0))),
            counters,
            next_buf: 0x10_0000,
        };
        h.activate();
        (h, offloads)
    }

    fn activate(&mut self) {
        let queues = vec![
            ActivatedQueue {
                queue: self.rx.device_queue(),
                notify: self.rx_kick.try_clone().unwrap(),
            },
            ActivatedQueue {
                queue: self.tx.device_queue(),
                notify: self.tx_kick.try_clone().unwrap(),
            },
        ];
        self.net
            .activate(self.mem.clone(), self.irq.clone(), queues)
            .unwrap();
    }

    fn buf(&mut self, bytes: &[u8], len: u32) -> u64 {
        let addr = self.next_buf;
        self.next_buf += u64::from(len).next_multiple_of(64).max(64);
        self.mem
            .write_slice(&vec![0xee; len as usize], GuestAddress(addr))
            .unwrap();
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        addr
    }

    fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    /// Queues a frame for transmission as header + payload descriptors and kicks.
    fn send(&mut self, payload: &[u8]) -> u16 {
        let hdr = self.buf(&[0; VNET_HDR_LEN], VNET_HDR_LEN as u32);
        let data = self.buf(payload, payload.len() as u32);
        let head = self.tx.add(&[
            (hdr, VNET_HDR_LEN as u32, false),
            (data, payload.len() as u32, false),
        ]);
        self.tx_kick.write(1).unwrap();
        head
    }

    /// Posts one receive buffer of `len` bytes; returns its address.
    fn post_rx(&mut self, len: u32) -> (u16, u64) {
        let addr = self.buf(&[], len);
        let head = self.rx.add(&[(addr, len, true)]);
        self.rx_kick.write(1).unwrap();
        (head, addr)
    }

    fn host_recv(&self) -> Vec<u8> {
        let mut buf = vec![0u8; 70_000];
        let n = self.host.recv(&mut buf).expect("a frame reaches the host");
        buf.truncate(n);
        buf
    }

    fn counter(&self, pick: fn(&NetCounters) -> &AtomicU64) -> u64 {
        NetCounters::get(pick(&self.counters))
    }
}

fn wait_used(q: &mut GuestQueue) -> (u16, u32) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(used) = q.pop_used() {
            return used;
        }
        assert!(Instant::now() < deadline, "the device did not use a buffer");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Gives the worker time to do something it must not do.
fn assert_unused(q: &mut GuestQueue) {
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(q.pop_used(), None);
}

#[test]
fn features_and_config_space_follow_the_mac() {
    let (a, _b) = UnixDatagram::pair().unwrap();
    let with = Net::with_backend(config(Some(MAC)), Box::new(a));
    assert_eq!(with.device_type(), 1);
    assert_eq!(with.queue_max_sizes(), &[256, 256]);
    assert_eq!(
        with.avail_features(),
        OFFERED_FEATURES | (1 << VIRTIO_NET_F_MAC)
    );
    let mut mac = [0u8; 6];
    with.read_config(0, &mut mac);
    assert_eq!(mac, MAC);
    // Read in pieces, as a driver does, and past the end.
    let mut tail = [0xffu8; 4];
    with.read_config(4, &mut tail);
    assert_eq!(tail, [0x00, 0x02, 0, 0]);
    with.read_config(u64::MAX - 1, &mut tail);
    assert_eq!(tail, [0; 4]);

    let (a, _b) = UnixDatagram::pair().unwrap();
    let mut without = Net::with_backend(config(None), Box::new(a));
    assert_eq!(without.avail_features(), OFFERED_FEATURES);
    without.set_acked_features(u64::MAX);
    assert_eq!(without.acked_features(), OFFERED_FEATURES);
    assert_eq!(
        without.snapshot(),
        Some(SavedDevice::Net(super::SavedNet {
            iface_id: "eth0".into(),
            host_dev_name: "tap0".into(),
            guest_mac: None,
        }))
    );
}

#[test]
fn a_bad_tap_name_is_an_error_naming_the_interface() {
    let err = Net::new(NetConfig {
        iface_id: "eth0".into(),
        host_dev_name: "bad/name".into(),
        guest_mac: None,
    })
    .err()
    .unwrap();
    assert!(matches!(err, NetError::Tap { .. }));
    assert!(err.to_string().contains("eth0"), "{err}");
}

#[test]
fn transmits_a_gathered_chain_as_one_frame() {
    let mut h = Harness::new();
    let data = payload(1000, 1);
    let head = h.send(&data);
    assert_eq!(h.host_recv(), frame(&data));
    assert_eq!(wait_used(&mut h.tx), (head, 0));
    assert!(h.irq.0.load(Ordering::SeqCst) >= 1);
    assert_eq!(h.counter(|c| &c.tx_frames), 1);
    assert_eq!(h.counter(|c| &c.tx_bytes), 1000);

    // A frame in one descriptor, header included, is as good.
    let whole = frame(&payload(60, 2));
    let addr = h.buf(&whole, whole.len() as u32);
    h.tx.add(&[(addr, whole.len() as u32, false)]);
    h.tx_kick.write(1).unwrap();
    assert_eq!(h.host_recv(), whole);
    wait_used(&mut h.tx);
}

#[test]
fn receives_a_frame_into_a_posted_buffer() {
    let mut h = Harness::new();
    let (head, addr) = h.post_rx(1526);
    let data = payload(1514, 3);
    h.host.send(&frame(&data)).unwrap();
    let (used, len) = wait_used(&mut h.rx);
    assert_eq!((used, len as usize), (head, VNET_HDR_LEN + data.len()));
    let got = h.read(addr, len as usize);
    // num_buffers is 1: without mergeable buffers a frame fills one chain.
    assert_eq!(&got[..10], &[0; 10]);
    assert_eq!(&got[10..12], &[1, 0]);
    assert_eq!(&got[VNET_HDR_LEN..], &data[..]);
    assert_eq!(h.counter(|c| &c.rx_frames), 1);
    assert_eq!(h.counter(|c| &c.rx_bytes), 1514);
    assert!(h.irq.0.load(Ordering::SeqCst) >= 1);
}

#[test]
fn a_frame_spans_a_chain_of_small_buffers() {
    let mut h = Harness::new();
    let a = h.buf(&[], 12);
    let b = h.buf(&[], 100);
    let c = h.buf(&[], 100);
    h.rx.add(&[(a, 12, true), (b, 100, true), (c, 100, true)]);
    let data = payload(150, 4);
    h.host.send(&frame(&data)).unwrap();
    let (_, len) = wait_used(&mut h.rx);
    assert_eq!(len, 162);
    let mut got = h.read(b, 100);
    got.extend(h.read(c, 50));
    assert_eq!(got, data);
}

#[test]
fn frames_wait_for_guest_buffers_and_arrive_in_order() {
    let mut h = Harness::new();
    let frames: Vec<Vec<u8>> = (0..3).map(|i| payload(100 + i, i as u8)).collect();
    for f in &frames {
        h.host.send(&frame(f)).unwrap();
    }
    assert_unused(&mut h.rx);
    assert_eq!(h.counter(|c| &c.rx_dropped), 0);
    let mut bufs = Vec::new();
    for _ in 0..3 {
        bufs.push(h.post_rx(1526));
    }
    for (f, (head, addr)) in frames.iter().zip(bufs) {
        let (used, len) = wait_used(&mut h.rx);
        assert_eq!((used, len as usize), (head, VNET_HDR_LEN + f.len()));
        assert_eq!(h.read(addr + VNET_HDR_LEN as u64, f.len()), *f);
    }
    assert_eq!(h.counter(|c| &c.rx_frames), 3);
}

#[test]
fn malformed_tx_chains_are_dropped_and_counted() {
    let mut h = Harness::new();
    // A device-writable buffer in a TX chain.
    let hdr = h.buf(&[0; VNET_HDR_LEN], VNET_HDR_LEN as u32);
    let w = h.buf(&[], 64);
    let bad1 =
        h.tx.add(&[(hdr, VNET_HDR_LEN as u32, false), (w, 64, true)]);
    // A buffer outside guest memory.
    let bad2 = h.tx.add(&[(0x1_0000_0000, 64, false)]);
    // Shorter than the header.
    let short = h.buf(&[0; 4], 4);
    let bad3 = h.tx.add(&[(short, 4, false)]);
    // Longer than any frame.
    let big = h.buf(&[], 0x1_0000);
    let bad4 = h.tx.add(&[(big, 0x1_0000, false), (big, 0x1_0000, false)]);
    let data = payload(64, 5);
    let good = h.send(&data);
    assert_eq!(h.host_recv(), frame(&data));
    for want in [bad1, bad2, bad3, bad4, good] {
        assert_eq!(wait_used(&mut h.tx), (want, 0));
    }
    assert_eq!(h.counter(|c| &c.tx_dropped), 4);
    assert_eq!(h.counter(|c| &c.tx_frames), 1);
}

#[test]
fn unusable_rx_chains_cost_the_frame_not_the_device() {
    let mut h = Harness::new();
    // Device-readable: malformed. Too small: cannot take the frame.
    let r = h.buf(&[], 2000);
    let bad1 = h.rx.add(&[(r, 2000, false)]);
    let small = h.buf(&[], 64);
    let bad2 = h.rx.add(&[(small, 64, true)]);
    let outside = h.rx.add(&[(0x1_0000_0000, 2000, true)]);
    let (good, addr) = h.post_rx(2000);
    for i in 0..4 {
        h.host.send(&frame(&payload(1000, i))).unwrap();
    }
    for want in [bad1, bad2, outside] {
        assert_eq!(wait_used(&mut h.rx), (want, 0));
    }
    assert_eq!(wait_used(&mut h.rx), (good, 1012));
    assert_eq!(h.read(addr + 12, 1000), payload(1000, 3));
    assert_eq!(h.counter(|c| &c.rx_dropped), 3);
    assert_eq!(h.counter(|c| &c.rx_frames), 1);
}

#[test]
fn pause_keeps_queues_and_frames_and_resume_goes_on() {
    let mut h = Harness::new();
    let data = payload(200, 6);
    h.send(&data);
    assert_eq!(h.host_recv(), frame(&data));
    wait_used(&mut h.tx);
    assert!(h.net.queue_states().is_empty(), "only read while paused");

    h.net.pause();
    let states = h.net.queue_states();
    assert_eq!(states.len(), 2);
    assert_eq!(states[1].next_avail, 1);
    assert_eq!(states[1].next_used, 1);
    assert_eq!(states[0].next_avail, 0);
    // Nothing moves while paused.
    h.host.send(&frame(&payload(300, 7))).unwrap();
    let (_, addr) = h.post_rx(1526);
    assert_unused(&mut h.rx);

    h.net.resume().unwrap();
    let (_, len) = wait_used(&mut h.rx);
    assert_eq!(len, 312);
    assert_eq!(h.read(addr + 12, 300), payload(300, 7));
}

#[test]
fn reset_keeps_the_backend_for_a_new_activation() {
    let mut h = Harness::new();
    assert!(h.net.is_activated());
    assert!(h.net.reset());
    assert!(!h.net.is_activated());
    assert_eq!(h.net.acked_features(), 0);
    // The driver sets the queues up afresh.
    h.rx = GuestQueue::new(&h.mem, RX_BASE, 256);
    h.tx = GuestQueue::new(&h.mem, TX_BASE, 256);
    h.activate();
    let data = payload(80, 8);
    h.send(&data);
    assert_eq!(h.host_recv(), frame(&data));
}

#[test]
fn a_vanished_host_end_costs_frames_not_the_worker() {
    let mut h = Harness::new();
    // The peer closes: writes fail, reads find nothing.
    drop(std::mem::replace(
        &mut h.host,
        UnixDatagram::unbound().unwrap(),
    ));
    h.post_rx(1526);
    let head = h.send(&payload(64, 9));
    assert_eq!(wait_used(&mut h.tx), (head, 0));
    assert_eq!(h.counter(|c| &c.tx_dropped), 1);
    assert_unused(&mut h.rx);
    // The worker still answers (it is not stuck in a read loop).
    h.net.pause();
    assert_eq!(h.net.queue_states().len(), 2);
}

#[test]
fn runt_frames_from_the_host_are_dropped() {
    let mut h = Harness::new();
    h.host.send(&[]).unwrap();
    h.host.send(&[0; VNET_HDR_LEN - 1]).unwrap();
    let data = payload(100, 10);
    h.host.send(&frame(&data)).unwrap();
    let (_, addr) = h.post_rx(1526);
    assert_eq!(wait_used(&mut h.rx).1 as usize, VNET_HDR_LEN + 100);
    assert_eq!(h.read(addr + VNET_HDR_LEN as u64, 100), data);
    assert_eq!(h.counter(|c| &c.rx_dropped), 2);
}

#[test]
fn activation_sets_the_tap_offloads_the_driver_acked_and_reset_clears_them() {
    let (mut h, offloads) = Harness::with_features(OFFERED_FEATURES);
    let all = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_UFO;
    assert_eq!(*offloads.lock().unwrap(), [all]);
    assert!(h.net.reset());
    assert_eq!(*offloads.lock().unwrap(), [all, 0]);
    // A driver that takes no offloads gets a tap that sends it none.
    h.net
        .set_acked_features(PLAIN & !(1 << virtio_bindings::virtio_net::VIRTIO_NET_F_GUEST_CSUM));
    h.rx = GuestQueue::new(&h.mem, RX_BASE, 256);
    h.tx = GuestQueue::new(&h.mem, TX_BASE, 256);
    h.activate();
    assert_eq!(*offloads.lock().unwrap(), [all, 0, 0]);
}

/// Receive buffers of `len` bytes each, one per chain, as Linux posts them with
/// mergeable buffers (page-sized there).
fn post_rx_buffers(h: &mut Harness, n: usize, len: u32) -> Vec<(u16, u64)> {
    (0..n).map(|_| h.post_rx(len)).collect()
}

#[test]
fn a_mergeable_frame_fills_as_many_chains_as_it_needs_published_at_once() {
    let (mut h, _) = Harness::with_features(OFFERED_FEATURES | (1 << VIRTIO_NET_F_MAC));
    let bufs = post_rx_buffers(&mut h, 4, 1000);
    // A TSO-sized frame: header + 2488 bytes over three 1000-byte chains.
    let data = payload(2488, 11);
    h.host.send(&frame(&data)).unwrap();
    let used: Vec<(u16, u32)> = (0..3).map(|_| wait_used(&mut h.rx)).collect();
    assert_eq!(
        used,
        [(bufs[0].0, 1000), (bufs[1].0, 1000), (bufs[2].0, 500)]
    );
    let first = h.read(bufs[0].1, 1000);
    assert_eq!(&first[10..12], &3u16.to_le_bytes(), "num_buffers");
    let mut got = first[VNET_HDR_LEN..].to_vec();
    got.extend(h.read(bufs[1].1, 1000));
    got.extend(h.read(bufs[2].1, 500));
    assert_eq!(got, data);
    // A small frame takes one chain, the fourth.
    h.host.send(&frame(&payload(60, 12))).unwrap();
    assert_eq!(wait_used(&mut h.rx), (bufs[3].0, 72));
    assert_eq!(&h.read(bufs[3].1, 12)[10..12], &1u16.to_le_bytes());
    assert_eq!(h.counter(|c| &c.rx_frames), 2);
}

#[test]
fn a_mergeable_frame_waits_until_enough_chains_are_posted() {
    let (mut h, _) = Harness::with_features(OFFERED_FEATURES);
    let first = h.post_rx(1000);
    let data = payload(1500, 13);
    h.host.send(&frame(&data)).unwrap();
    // One chain is not enough: it stays the guest's, nothing dropped.
    assert_unused(&mut h.rx);
    assert_eq!(h.counter(|c| &c.rx_dropped), 0);
    // The device asked to hear of the next buffer past the one it looked at
    // (avail_event, after the used ring's elements).
    let avail_event_at = h.rx.used_ring() + 4 + 8 * 256;
    let avail_event: u16 = h.mem.read_obj(GuestAddress(avail_event_at)).unwrap();
    assert_eq!(u16::from_le(avail_event), 1);
    let second = h.post_rx(1000);
    assert_eq!(wait_used(&mut h.rx), (first.0, 1000));
    assert_eq!(wait_used(&mut h.rx), (second.0, 512));
    let mut got = h.read(first.1 + VNET_HDR_LEN as u64, 1000 - VNET_HDR_LEN);
    got.extend(h.read(second.1, 512));
    assert_eq!(got, data);
}

#[test]
fn an_unusable_chain_costs_a_mergeable_frame_and_returns_every_chain_taken() {
    let (mut h, _) = Harness::with_features(OFFERED_FEATURES);
    let good = h.post_rx(1000);
    let r = h.buf(&[], 1000);
    let bad = h.rx.add(&[(r, 1000, false)]);
    h.host.send(&frame(&payload(1500, 14))).unwrap();
    assert_eq!(wait_used(&mut h.rx), (good.0, 0));
    assert_eq!(wait_used(&mut h.rx), (bad, 0));
    assert_eq!(h.counter(|c| &c.rx_dropped), 1);
    // The device goes on with the next frame.
    let next = h.post_rx(1000);
    h.host.send(&frame(&payload(100, 15))).unwrap();
    assert_eq!(wait_used(&mut h.rx), (next.0, 112));
}

#[test]
fn with_event_index_the_device_interrupts_only_where_the_driver_asks() {
    let (mut h, _) = Harness::with_features(OFFERED_FEATURES);
    // used_event = 2: interrupt once the third buffer is used.
    h.rx.set_used_event(2);
    let bufs = post_rx_buffers(&mut h, 3, 1526);
    for i in 0..2 {
        h.host.send(&frame(&payload(100, i))).unwrap();
        wait_used(&mut h.rx);
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.irq.0.load(Ordering::SeqCst), 0);
    h.host.send(&frame(&payload(100, 2))).unwrap();
    assert_eq!(wait_used(&mut h.rx).0, bufs[2].0);
    let deadline = Instant::now() + WAIT;
    while h.irq.0.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no interrupt at used_event");
        std::thread::sleep(Duration::from_millis(1));
    }
    // TX with event index still sends and uses every chain.
    let data = payload(64, 16);
    let head = h.send(&data);
    assert_eq!(h.host_recv(), frame(&data));
    assert_eq!(wait_used(&mut h.tx), (head, 0));
}
