//! The device driven end to end as a guest driver would: real guest memory, a split
//! queue laid out in it, real EventFds, a worker thread and a real image file.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::testing::{Desc, Driver};
use super::{Block, BlockConfig, BlockError};
use crate::devices::virtio::{
    ActivateError, ActivatedQueue, VirtioDevice, VirtioInterrupt, VirtioInterruptType,
};

const SECTORS: u64 = 16;
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Delivers the interrupt through an EventFd, as a KVM irqfd does.
struct IrqFd {
    fd: EventFd,
    config_changes: AtomicU64,
}

impl VirtioInterrupt for IrqFd {
    fn trigger(&self, kind: VirtioInterruptType) -> std::io::Result<()> {
        if kind == VirtioInterruptType::Config {
            self.config_changes.fetch_add(1, Ordering::Relaxed);
        }
        self.fd.write(1)
    }
}

/// The byte at `offset` of the test image.
fn pattern(offset: u64) -> u8 {
    (offset % 251) as u8
}

fn image_bytes() -> Vec<u8> {
    (0..SECTORS * 512).map(pattern).collect()
}

struct Harness {
    driver: Driver,
    block: Block,
    image: tempfile::NamedTempFile,
    notify: EventFd,
    irq: Arc<IrqFd>,
    used_seen: u16,
    next_buf: u64,
}

impl Harness {
    fn new(id: &str, read_only: bool) -> Harness {
        Self::with_features(id, read_only, !(1 << VIRTIO_RING_F_EVENT_IDX))
    }

    /// Opens a fresh image and activates the device with `acked` features.
    fn with_features(id: &str, read_only: bool, acked: u64) -> Harness {
        let mut image = tempfile::NamedTempFile::new().unwrap();
        image.write_all(&image_bytes()).unwrap();
        image.flush().unwrap();
        let mut block = Block::new(BlockConfig {
            id: id.into(),
            path: image.path().to_owned(),
            read_only,
        })
        .unwrap();
        let acked = acked & block.avail_features();
        block.set_acked_features(acked);
        let irq = Arc::new(IrqFd {
            fd: EventFd::new(EFD_NONBLOCK).unwrap(),
            config_changes: AtomicU64::new(0),
        });
        let mut h = Harness {
            driver: Driver::new(),
            block,
            image,
            notify: EventFd::new(EFD_NONBLOCK).unwrap(),
            irq,
            used_seen: 0,
            next_buf: 0x10_0000,
        };
        h.activate();
        h
    }

    fn activate(&mut self) {
        let queue = ActivatedQueue {
            queue: self.driver.queue(),
            notify: self.notify.try_clone().unwrap(),
        };
        self.block
            .activate(self.driver.mem.clone(), self.irq.clone(), vec![queue])
            .unwrap();
    }

    /// A fresh guest buffer of `len` bytes, filled with 0xee.
    fn buf(&mut self, len: u32) -> u64 {
        let addr = self.next_buf;
        self.next_buf += u64::from(len).next_multiple_of(64);
        self.driver.write(addr, &vec![0xee; len as usize]);
        addr
    }

    /// Queues `header, data..., status` without kicking; returns the status address.
    fn queue_request(&mut self, request_type: u32, sector: u64, data: &[Desc]) -> u64 {
        let hdr = self.buf(16);
        self.driver.write_header(hdr, request_type, sector);
        let status = self.buf(1);
        let mut chain = vec![Desc::r(hdr, 16)];
        chain.extend_from_slice(data);
        chain.push(Desc::w(status, 1));
        self.driver.add_chain(&chain);
        status
    }

    fn kick(&self) {
        self.notify.write(1).unwrap();
    }

    /// Waits for `n` more used entries and returns them as (head, len).
    fn wait_used(&mut self, n: u16) -> Vec<(u32, u32)> {
        let target = self.used_seen.wrapping_add(n);
        let start = Instant::now();
        while self.driver.used_idx() != target {
            assert!(
                start.elapsed() < IO_TIMEOUT,
                "device completed {} of {n} requests",
                self.driver.used_idx().wrapping_sub(self.used_seen)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let used = (0..n)
            .map(|i| self.driver.used_elem(self.used_seen.wrapping_add(i)))
            .collect();
        self.used_seen = target;
        used
    }

    /// Runs one request to completion; returns (status byte, used length).
    fn run(&mut self, request_type: u32, sector: u64, data: &[Desc]) -> (u8, u32) {
        let status = self.queue_request(request_type, sector, data);
        self.kick();
        let used = self.wait_used(1);
        (self.driver.read(status, 1)[0], used[0].1)
    }

    /// Interrupts raised since the last call.
    fn interrupts(&self) -> u64 {
        self.irq.fd.read().unwrap_or(0)
    }

    fn file(&self) -> Vec<u8> {
        std::fs::read(self.image.path()).unwrap()
    }
}

/// Whether this process has a thread called `name`.
fn has_thread(name: &str) -> bool {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .any(|comm| comm.trim_end() == name)
}

/// Waits for a new thread to name itself (it does so once it runs).
fn wait_for_thread(name: &str) {
    let start = Instant::now();
    while !has_thread(name) {
        assert!(start.elapsed() < IO_TIMEOUT, "no thread {name}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn read_returns_the_image_bytes() {
    let mut h = Harness::new("read", false);
    let (a, b) = (h.buf(512), h.buf(1024));
    let (status, used) = h.run(VIRTIO_BLK_T_IN, 2, &[Desc::w(a, 512), Desc::w(b, 1024)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(used, 1536 + 1);
    let want: Vec<u8> = (2 * 512..5 * 512).map(pattern).collect();
    let mut got = h.driver.read(a, 512);
    got.extend(h.driver.read(b, 1024));
    assert_eq!(got, want);
    assert!(h.interrupts() >= 1);
    assert_eq!(h.irq.config_changes.load(Ordering::Relaxed), 0);
}

#[test]
fn write_reaches_the_file_and_reads_back() {
    let mut h = Harness::new("write", false);
    let data: Vec<u8> = (0..1024u32).map(|i| (i * 7 % 256) as u8).collect();
    let (a, b) = (h.buf(512), h.buf(512));
    h.driver.write(a, &data[..512]);
    h.driver.write(b, &data[512..]);
    let (status, used) = h.run(VIRTIO_BLK_T_OUT, 3, &[Desc::r(a, 512), Desc::r(b, 512)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(used, 1, "a write only writes its status byte");

    let file = h.file();
    let mut want = image_bytes();
    want[3 * 512..5 * 512].copy_from_slice(&data);
    assert_eq!(file, want);

    let back = h.buf(1024);
    let (status, _) = h.run(VIRTIO_BLK_T_IN, 3, &[Desc::w(back, 1024)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(h.driver.read(back, 1024), data);
}

#[test]
fn flush_succeeds() {
    let mut h = Harness::new("flush", false);
    let a = h.buf(512);
    h.driver.write(a, &[0x55; 512]);
    assert_eq!(h.run(VIRTIO_BLK_T_OUT, 0, &[Desc::r(a, 512)]).0, 0);
    let (status, used) = h.run(VIRTIO_BLK_T_FLUSH, 0, &[]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(used, 1);
    assert_eq!(&h.file()[..512], &[0x55; 512]);
}

#[test]
fn get_id_returns_the_drive_id() {
    let mut h = Harness::new("disk-id", false);
    let id = h.buf(20);
    let (status, used) = h.run(VIRTIO_BLK_T_GET_ID, 0, &[Desc::w(id, 20)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(used, 21);
    let mut want = b"disk-id".to_vec();
    want.resize(20, 0);
    assert_eq!(h.driver.read(id, 20), want);

    // Longer ids are cut to 20 bytes, with no terminator.
    let mut h = Harness::new("a-drive-id-longer-than-twenty", false);
    let id = h.buf(20);
    h.run(VIRTIO_BLK_T_GET_ID, 0, &[Desc::w(id, 20)]);
    assert_eq!(h.driver.read(id, 20), b"a-drive-id-longer-th");
}

#[test]
fn read_only_device_refuses_writes_and_leaves_the_file_untouched() {
    let mut h = Harness::new("ro", true);
    let modified = std::fs::metadata(h.image.path())
        .unwrap()
        .modified()
        .unwrap();
    let a = h.buf(512);
    h.driver.write(a, &[0x11; 512]);
    let (status, used) = h.run(VIRTIO_BLK_T_OUT, 0, &[Desc::r(a, 512)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_IOERR);
    assert_eq!(used, 1);
    assert_eq!(h.file(), image_bytes());
    assert_eq!(
        std::fs::metadata(h.image.path())
            .unwrap()
            .modified()
            .unwrap(),
        modified
    );

    // Reads and flushes still work.
    let b = h.buf(512);
    assert_eq!(h.run(VIRTIO_BLK_T_IN, 1, &[Desc::w(b, 512)]).0, 0);
    assert_eq!(
        h.driver.read(b, 512),
        (512..1024).map(pattern).collect::<Vec<_>>()
    );
    assert_eq!(h.run(VIRTIO_BLK_T_FLUSH, 0, &[]).0, 0);
}

#[test]
fn requests_beyond_the_capacity_fail() {
    let mut h = Harness::new("range", false);
    let a = h.buf(1024);
    // Starts inside, ends past the end: nothing is read.
    let (status, used) = h.run(VIRTIO_BLK_T_IN, SECTORS - 1, &[Desc::w(a, 1024)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_IOERR);
    assert_eq!(used, 1);
    assert_eq!(h.driver.read(a, 1024), vec![0xee; 1024]);

    for sector in [SECTORS, u64::MAX, u64::MAX / 512 + 1] {
        let b = h.buf(512);
        assert_eq!(
            u32::from(h.run(VIRTIO_BLK_T_OUT, sector, &[Desc::r(b, 512)]).0),
            VIRTIO_BLK_S_IOERR,
            "sector {sector}"
        );
    }
    assert_eq!(h.file(), image_bytes());

    // The last sector itself is fine.
    let c = h.buf(512);
    assert_eq!(h.run(VIRTIO_BLK_T_IN, SECTORS - 1, &[Desc::w(c, 512)]).0, 0);
}

#[test]
fn chain_without_status_is_returned_unanswered() {
    let mut h = Harness::new("nostatus", false);
    let hdr = h.buf(16);
    h.driver.write_header(hdr, VIRTIO_BLK_T_OUT, 0);
    let data = h.buf(512);
    let head = h.driver.add_chain(&[Desc::r(hdr, 16), Desc::r(data, 512)]);
    h.kick();
    assert_eq!(h.wait_used(1), vec![(u32::from(head), 0)]);
    assert_eq!(h.file(), image_bytes());

    // The device carries on with the next request.
    let b = h.buf(512);
    assert_eq!(h.run(VIRTIO_BLK_T_IN, 0, &[Desc::w(b, 512)]).0, 0);
}

#[test]
fn data_buffer_in_the_wrong_direction_is_an_error() {
    let mut h = Harness::new("direction", false);
    // A read whose buffer the device may not write.
    let a = h.buf(512);
    let (status, used) = h.run(VIRTIO_BLK_T_IN, 0, &[Desc::r(a, 512)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_IOERR);
    assert_eq!(used, 1);
    assert_eq!(h.driver.read(a, 512), vec![0xee; 512]);

    // A write whose buffer is marked device-writable.
    let b = h.buf(512);
    let (status, _) = h.run(VIRTIO_BLK_T_OUT, 0, &[Desc::w(b, 512)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_IOERR);
    assert_eq!(h.file(), image_bytes());
}

#[test]
fn buffers_outside_guest_memory_are_an_error() {
    let mut h = Harness::new("outside", false);
    let (status, used) = h.run(VIRTIO_BLK_T_IN, 0, &[Desc::w(Driver::MEM_SIZE - 512, 1024)]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_IOERR);
    assert_eq!(used, 1);
    assert_eq!(h.driver.read(Driver::MEM_SIZE - 512, 512), vec![0; 512]);
}

#[test]
fn unknown_request_type_is_unsupported() {
    let mut h = Harness::new("unsupp", false);
    let (status, used) = h.run(VIRTIO_BLK_T_DISCARD, 0, &[]);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_UNSUPP);
    assert_eq!(used, 1);
    assert_eq!(h.file(), image_bytes());
}

#[test]
fn a_batch_of_requests_completes_in_order() {
    let mut h = Harness::new("batch", false);
    let mut bufs = Vec::new();
    for sector in 0..SECTORS {
        let b = h.buf(512);
        h.queue_request(VIRTIO_BLK_T_IN, sector, &[Desc::w(b, 512)]);
        bufs.push(b);
    }
    h.kick();
    let used = h.wait_used(SECTORS as u16);
    for (i, (head, len)) in used.into_iter().enumerate() {
        // Each chain holds three descriptors.
        assert_eq!((head, len), (3 * i as u32, 513));
    }
    for (sector, b) in bufs.into_iter().enumerate() {
        let want: Vec<u8> = (sector as u64 * 512..(sector as u64 + 1) * 512)
            .map(pattern)
            .collect();
        assert_eq!(h.driver.read(b, 512), want, "sector {sector}");
    }
    assert_eq!(
        h.block.state().queue.map(|q| (q.next_avail, q.next_used)),
        Some((SECTORS as u16, SECTORS as u16))
    );
}

#[test]
fn event_idx_defers_the_interrupt_to_used_event() {
    let mut h = Harness::with_features("evidx", false, u64::MAX);
    assert!(h.block.state().queue.unwrap().event_idx_enabled);
    // Interrupt only once the used index moves past 1, i.e. after two requests.
    h.driver.set_used_event(1);
    let a = h.buf(512);
    assert_eq!(h.run(VIRTIO_BLK_T_IN, 0, &[Desc::w(a, 512)]).0, 0);
    // The interrupt, if any, follows the used-ring update closely.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.interrupts(), 0);

    let b = h.buf(512);
    assert_eq!(h.run(VIRTIO_BLK_T_IN, 1, &[Desc::w(b, 512)]).0, 0);
    let start = Instant::now();
    while h.irq.fd.read().is_err() {
        assert!(
            start.elapsed() < IO_TIMEOUT,
            "no interrupt after used_event"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn worker_thread_is_named_and_stopped_by_reset_and_drop() {
    let mut h = Harness::new("lifecycle", false);
    let name = "blk-lifecycle";
    assert!(h.block.is_activated());
    wait_for_thread(name);

    assert!(h.block.reset());
    assert!(!h.block.is_activated());
    // reset joins the thread, so it is gone when reset returns.
    assert!(!has_thread(name));
    assert_eq!(h.block.state().queue, None);
    assert_eq!(h.block.state().acked_features, 0);

    // The driver sets the device up again from scratch.
    h.driver = Driver::new();
    h.used_seen = 0;
    h.block.set_acked_features(h.block.avail_features());
    h.activate();
    wait_for_thread(name);
    let a = h.buf(512);
    assert_eq!(h.run(VIRTIO_BLK_T_IN, 0, &[Desc::w(a, 512)]).0, 0);

    drop(h);
    assert!(!has_thread(name));
}

#[test]
fn activation_checks_the_queues() {
    let mut h = Harness::new("activate", false);
    let err = h
        .block
        .activate(h.driver.mem.clone(), h.irq.clone(), Vec::new())
        .unwrap_err();
    assert!(matches!(err, ActivateError::Other(_)), "{err}");

    h.block.reset();
    let queue = || ActivatedQueue {
        queue: h.driver.queue(),
        notify: EventFd::new(0).unwrap(),
    };
    for (n, queues) in [(0, vec![]), (2, vec![queue(), queue()])] {
        let err = h
            .block
            .activate(h.driver.mem.clone(), h.irq.clone(), queues)
            .unwrap_err();
        assert!(
            matches!(err, ActivateError::QueueCount { expected: 1, got } if got == n),
            "{err}"
        );
    }
    assert!(!h.block.is_activated());
}

#[test]
fn missing_image_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("missing.img");
    let err = Block::new(BlockConfig {
        id: "missing".into(),
        path: path.clone(),
        read_only: true,
    })
    .err()
    .unwrap();
    assert!(
        matches!(&err, BlockError::NotFound { path: p } if *p == path),
        "{err}"
    );
}
