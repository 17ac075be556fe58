//! The balloon driven through its queues the way the guest driver drives
//! them, over real guest memory (a memfd, as a booted VM has).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::device::{F_DEFLATE_ON_OOM, F_REPORTING, F_STATS_VQ};
use super::worker::Worker;
use super::*;
use crate::devices::virtio::vsock::test_driver::GuestQueue;
use crate::devices::virtio::worker::StopSignal;
use crate::devices::virtio::{ActivatedQueue, VirtioDevice, VirtioInterrupt, VirtioInterruptType};
use crate::vstate::memory::GuestRam;

const MIB: u64 = 1 << 20;

/// Counts the interrupts a device raises, by kind.
#[derive(Default)]
struct Irqs(Mutex<Vec<VirtioInterruptType>>);

impl Irqs {
    fn count(&self, kind: VirtioInterruptType) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|k| **k == kind)
            .count()
    }
}

impl VirtioInterrupt for Irqs {
    fn trigger(&self, kind: VirtioInterruptType) -> std::io::Result<()> {
        self.0.lock().unwrap().push(kind);
        Ok(())
    }
}

fn everything() -> BalloonConfig {
    BalloonConfig {
        amount_mib: 2,
        deflate_on_oom: true,
        stats_polling_interval_s: 1,
        free_page_reporting: true,
    }
}

/// A device, its guest's queues (inflate, deflate, stats, reporting) over
/// 16 MiB of memfd-backed RAM, and a worker for them (not on a thread).
struct Rig {
    ram: GuestRam,
    device: Balloon,
    queues: Vec<GuestQueue>,
    irqs: Arc<Irqs>,
    worker: Worker,
    _stop: Arc<StopSignal>,
}

impl Rig {
    fn new(config: BalloonConfig) -> Rig {
        let ram = GuestRam::new(16 * MIB).unwrap();
        let mem = ram.guest_memory().clone();
        let device = Balloon::new(config).unwrap();
        let queues: Vec<GuestQueue> = (0..device.queue_max_sizes().len())
            .map(|i| GuestQueue::new(&mem, 0x1_0000 * (i as u64 + 1), 256))
            .collect();
        let activated = queues
            .iter()
            .map(|q| ActivatedQueue {
                queue: q.device_queue(),
                notify: EventFd::new(EFD_NONBLOCK).unwrap(),
            })
            .collect();
        let irqs = Arc::new(Irqs::default());
        let stop = StopSignal::new().unwrap();
        let worker = Worker::new(&device, mem, irqs.clone(), activated, &stop).unwrap();
        Rig {
            ram,
            device,
            queues,
            irqs,
            worker,
            _stop: stop,
        }
    }

    fn mem(&self) -> &crate::vstate::memory::GuestMemory {
        self.ram.guest_memory()
    }

    fn fill(&self, at: u64, len: u64, byte: u8) {
        self.mem()
            .write_slice(&vec![byte; len as usize], GuestAddress(at))
            .unwrap();
    }

    fn byte_at(&self, at: u64) -> u8 {
        self.mem().read_obj(GuestAddress(at)).unwrap()
    }
}

#[test]
fn features_and_queues_follow_the_configuration() {
    let all = Balloon::new(everything()).unwrap();
    assert_eq!(all.queue_max_sizes().len(), 4);
    let f = all.avail_features();
    for bit in [F_DEFLATE_ON_OOM, F_STATS_VQ, F_REPORTING, 32] {
        assert_ne!(f & (1 << bit), 0, "bit {bit}");
    }
    let bare = Balloon::new(BalloonConfig::default()).unwrap();
    assert_eq!(bare.queue_max_sizes().len(), 2);
    assert_eq!(bare.avail_features(), 1 << 32);
    let reporting_only = Balloon::new(BalloonConfig {
        free_page_reporting: true,
        ..BalloonConfig::default()
    })
    .unwrap();
    assert_eq!(reporting_only.queue_max_sizes().len(), 3);
}

#[test]
fn config_space_holds_the_target_and_the_drivers_actual() {
    let mut device = Balloon::new(everything()).unwrap();
    let mut space = [0u8; 8];
    device.read_config(0, &mut space);
    assert_eq!(space, [0, 2, 0, 0, 0, 0, 0, 0]); // 2 MiB: 512 pages
    // The driver writes `actual`; `num_pages` is not its to change.
    device.write_config(4, &300u32.to_le_bytes());
    device.write_config(0, &7u32.to_le_bytes());
    device.read_config(0, &mut space);
    assert_eq!(u32::from_le_bytes(space[4..].try_into().unwrap()), 300);
    assert_eq!(u32::from_le_bytes(space[..4].try_into().unwrap()), 512);
    let stats = device.handle().stats();
    assert_eq!((stats.target_mib, stats.actual_pages), (2, 300));
    // Past the end reads zeros.
    let mut past = [9u8; 4];
    device.read_config(8, &mut past);
    assert_eq!(past, [0; 4]);
}

#[test]
fn a_new_target_reaches_a_running_driver_as_a_config_interrupt() {
    let mem = GuestRam::new(16 * MIB).unwrap();
    let mut device = Balloon::new(BalloonConfig::default()).unwrap();
    let handle = device.handle();
    // Before the driver runs, nothing to interrupt.
    handle.set_target_mib(4);
    let queues: Vec<GuestQueue> = (0..2)
        .map(|i| GuestQueue::new(mem.guest_memory(), 0x1_0000 * (i + 1), 256))
        .collect();
    let irqs = Arc::new(Irqs::default());
    let activated = queues
        .iter()
        .map(|q| ActivatedQueue {
            queue: q.device_queue(),
            notify: EventFd::new(EFD_NONBLOCK).unwrap(),
        })
        .collect();
    device
        .activate(mem.guest_memory().clone(), irqs.clone(), activated)
        .unwrap();
    handle.set_target_mib(8);
    assert_eq!(irqs.count(VirtioInterruptType::Config), 1);
    assert_eq!(handle.config().amount_mib, 8);
    assert!(device.reset());
    handle.set_target_mib(1);
    assert_eq!(irqs.count(VirtioInterruptType::Config), 1);
}

#[test]
fn inflated_pages_go_back_to_the_host() {
    let mut rig = Rig::new(everything());
    rig.fill(4 * MIB, 64 * 1024, 7);
    // 16 PFNs from 4 MiB, out of order, one twice, and one past RAM.
    let mut pfns: Vec<u32> = (0..16).map(|i| (4 * MIB / 4096) as u32 + i).rev().collect();
    pfns.push(pfns[0]);
    pfns.push(0x10_0000);
    let buf = 0x8_0000;
    for (i, pfn) in pfns.iter().enumerate() {
        rig.mem()
            .write_obj(pfn.to_le(), GuestAddress(buf + 4 * i as u64))
            .unwrap();
    }
    let head = rig.queues[0].add(&[(buf, 4 * pfns.len() as u32, false)]);
    rig.worker.process_queues();
    assert_eq!(rig.queues[0].pop_used(), Some((head, 0)));
    assert_eq!(rig.byte_at(4 * MIB), 0);
    assert_eq!(rig.byte_at(4 * MIB + 64 * 1024 - 1), 0);
    assert_eq!(rig.device.handle().stats().inflated_bytes, 64 * 1024);
    assert_eq!(rig.irqs.count(VirtioInterruptType::Queue), 1);

    // Deflated pages need nothing but the buffer back.
    let head = rig.queues[1].add(&[(buf, 4, false)]);
    rig.worker.process_queues();
    assert_eq!(rig.queues[1].pop_used(), Some((head, 0)));
}

#[test]
fn reported_free_pages_go_back_to_the_host() {
    let mut rig = Rig::new(everything());
    rig.fill(4 * MIB, 8 * MIB, 1);
    // The bytes of pages that still hold the guest's data.
    let data = |rig: &Rig| {
        (0..16 * MIB / 4096)
            .filter(|p| rig.byte_at(p * 4096) != 0)
            .count() as u64
            * 4096
    };
    assert_eq!(data(&rig), 8 * MIB);
    let head = rig.queues[3].add(&[
        (4 * MIB, 4 * MIB as u32, true),
        (8 * MIB, 2 * MIB as u32, true),
    ]);
    rig.worker.process_queues();
    assert_eq!(rig.queues[3].pop_used(), Some((head, 0)));
    assert_eq!(data(&rig), 2 * MIB);
    assert_eq!(rig.device.handle().stats().reported_bytes, 6 * MIB);
    // A report outside RAM is used and skipped.
    let head = rig.queues[3].add(&[(1 << 40, 4096, true)]);
    rig.worker.process_queues();
    assert_eq!(rig.queues[3].pop_used(), Some((head, 0)));
    assert_eq!(rig.device.handle().stats().reported_bytes, 6 * MIB);
}

fn write_stats(rig: &Rig, at: u64, stats: &[(u16, u64)]) -> u32 {
    for (i, (tag, value)) in stats.iter().enumerate() {
        let mut raw = [0u8; 10];
        raw[..2].copy_from_slice(&tag.to_le_bytes());
        raw[2..].copy_from_slice(&value.to_le_bytes());
        rig.mem()
            .write_slice(&raw, GuestAddress(at + 10 * i as u64))
            .unwrap();
    }
    10 * stats.len() as u32
}

#[test]
fn statistics_are_recorded_and_their_buffer_held_until_due() {
    let mut rig = Rig::new(everything());
    let buf = 0x8_0000;
    let len = write_stats(
        &rig,
        buf,
        &[(4, 100 * MIB), (5, 256 * MIB), (6, 120 * MIB), (99, 1)],
    );
    let head = rig.queues[2].add(&[(buf, len, false)]);
    rig.worker.process_queues();
    let stats = rig.device.handle().stats();
    assert_eq!(stats.free_memory, Some(100 * MIB));
    assert_eq!(stats.total_memory, Some(256 * MIB));
    assert_eq!(stats.available_memory, Some(120 * MIB));
    assert_eq!(stats.swap_in, None);
    // Held: the guest gets it back only when fresh numbers are wanted.
    assert_eq!(rig.queues[2].pop_used(), None);
    assert_eq!(rig.worker.held_stats_desc(), Some(head));
    assert!(!rig.worker.refresh_stats(Instant::now()));
    assert!(
        rig.worker
            .refresh_stats(Instant::now() + Duration::from_secs(2))
    );
    assert_eq!(rig.queues[2].pop_used(), Some((head, 0)));
    assert_eq!(rig.worker.held_stats_desc(), None);

    // The interval changes only while statistics stay on.
    let handle = rig.device.handle();
    handle.set_stats_interval(5).unwrap();
    assert!(handle.set_stats_interval(0).is_err());
    let off = Balloon::new(BalloonConfig::default()).unwrap().handle();
    assert!(!off.stats_enabled());
    assert!(off.set_stats_interval(1).is_err());
}

#[test]
fn a_snapshot_keeps_the_sizes_and_the_held_statistics_buffer() {
    let mut rig = Rig::new(everything());
    let buf = 0x8_0000;
    let len = write_stats(&rig, buf, &[(4, 1)]);
    let head = rig.queues[2].add(&[(buf, len, false)]);
    rig.worker.process_queues();
    rig.device.write_config(4, &12u32.to_le_bytes());
    // The device reads the held buffer from its worker; here the worker is
    // not the device's, so hand it over as a restore would.
    let held = rig.worker.held_stats_desc();
    assert_eq!(held, Some(head));
    let mut saved = rig.device.save();
    assert_eq!(saved.stats_desc, None);
    saved.stats_desc = held;
    assert_eq!(
        saved,
        SavedBalloon {
            deflate_on_oom: true,
            stats_polling_interval_s: 1,
            free_page_reporting: true,
            target_pages: 512,
            actual_pages: 12,
            stats_desc: Some(head),
        }
    );
    let restored = saved.restore().unwrap();
    assert_eq!(restored.save(), saved);
    assert_eq!(restored.avail_features(), rig.device.avail_features());
    assert_eq!(restored.queue_max_sizes(), rig.device.queue_max_sizes());
}

#[test]
fn the_device_thread_serves_reports_and_parks_with_its_queues() {
    let mem = GuestRam::new(16 * MIB).unwrap();
    let mut device = Balloon::new(everything()).unwrap();
    let mut queues: Vec<GuestQueue> = (0..4)
        .map(|i| GuestQueue::new(mem.guest_memory(), 0x1_0000 * (i + 1), 256))
        .collect();
    let notifies: Vec<EventFd> = (0..4)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();
    let activated = queues
        .iter()
        .zip(&notifies)
        .map(|(q, n)| ActivatedQueue {
            queue: q.device_queue(),
            notify: n.try_clone().unwrap(),
        })
        .collect();
    let irqs = Arc::new(Irqs::default());
    device
        .activate(mem.guest_memory().clone(), irqs.clone(), activated)
        .unwrap();
    let head = queues[3].add(&[(4 * MIB, 4 * MIB as u32, true)]);
    notifies[3].write(1).unwrap();
    let start = Instant::now();
    let used = loop {
        if let Some(used) = queues[3].pop_used() {
            break used;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "report not used");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(used, (head, 0));
    assert_eq!(device.handle().stats().reported_bytes, 4 * MIB);
    device.pause();
    let states = device.queue_states();
    assert_eq!(states.len(), 4);
    assert_eq!(states[3].next_used, 1);
    assert!(matches!(
        device.snapshot(),
        Some(crate::devices::virtio::persist::SavedDevice::Balloon(_))
    ));
    device.resume().unwrap();
}

#[test]
fn pfns_past_the_cap_are_not_read() {
    let mut rig = Rig::new(everything());
    // One descriptor claiming far more PFNs than a driver ever sends.
    let head = rig.queues[0].add(&[(0x8_0000, u32::MAX, false)]);
    rig.worker.process_queues();
    assert_eq!(rig.queues[0].pop_used(), Some((head, 0)));
    assert_eq!(rig.device.handle().stats().inflated_bytes, 4096);
}
