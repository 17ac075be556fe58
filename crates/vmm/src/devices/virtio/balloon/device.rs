//! The virtio-balloon device model: features, configuration space, the
//! state its worker and the VMM's API share, and the worker's lifecycle.

use std::any::Any;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
use virtio_queue::QueueState;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::request::PFN_SHIFT;
use super::worker::Worker;
use crate::devices::virtio::persist::SavedDevice;
use crate::devices::virtio::worker::{StopSignal, WorkerThread};
use crate::devices::virtio::{
    ActivateError, ActivatedQueue, VirtioDevice, VirtioInterrupt, VirtioInterruptType,
    read_config_space,
};
use crate::vstate::memory::GuestMemory;

/// Feature bits of virtio-balloon (virtio 1.2, 5.5.3); virtio-bindings has
/// no balloon header.
pub const F_STATS_VQ: u64 = 1;
pub const F_DEFLATE_ON_OOM: u64 = 2;
pub const F_REPORTING: u64 = 5;

/// Every queue's size; the reporting queue needs at least 32 (the guest's
/// `PAGE_REPORTING_CAPACITY`).
pub const QUEUE_SIZE: u16 = 256;

/// Statistic tags (virtio 1.2, 5.5.6.3), in the order of `guest_stats`.
pub const STAT_TAGS: usize = 10;

/// A balloon as the VM is built with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BalloonConfig {
    pub amount_mib: u32,
    pub deflate_on_oom: bool,
    /// 0: no statistics queue.
    pub stats_polling_interval_s: u16,
    pub free_page_reporting: bool,
}

/// What the device, its worker and the API share.
pub(super) struct Shared {
    /// `num_pages`: the balloon's target, in 4 KiB pages.
    pub target_pages: u32,
    /// `actual`: what the driver says the balloon holds.
    pub actual_pages: u32,
    pub stats_interval_s: u16,
    /// The guest's last statistics, by tag.
    pub guest_stats: [Option<u64>; STAT_TAGS],
    pub reported_bytes: u64,
    pub inflated_bytes: u64,
    /// The device's interrupt once the driver activated it.
    pub interrupt: Option<Arc<dyn VirtioInterrupt>>,
}

#[derive(Debug, thiserror::Error)]
pub enum BalloonError {
    #[error("balloon setup failed: {0}")]
    Setup(#[source] io::Error),
    #[error("the statistics interval cannot go from {from} to {to} s after boot")]
    StatsToggle { from: u16, to: u16 },
}

/// What the VMM's API holds to drive the balloon (`PATCH /balloon`, its
/// statistics); cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct BalloonHandle {
    config: BalloonConfig,
    shared: Arc<Mutex<Shared>>,
    wake: Arc<EventFd>,
}

impl std::fmt::Debug for BalloonHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BalloonHandle")
            .field("config", &self.config)
            .finish()
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn mib_to_pages(mib: u32) -> u32 {
    mib.saturating_mul(1 << (20 - PFN_SHIFT))
}

fn pages_to_mib(pages: u32) -> u32 {
    pages >> (20 - PFN_SHIFT)
}

impl BalloonHandle {
    /// The balloon as `GET /balloon` shows it: its current target.
    pub fn config(&self) -> vmm_api::Balloon {
        let s = lock(&self.shared);
        vmm_api::Balloon {
            amount_mib: pages_to_mib(s.target_pages),
            deflate_on_oom: self.config.deflate_on_oom,
            stats_polling_interval_s: s.stats_interval_s,
            free_page_reporting: self.config.free_page_reporting,
            free_page_hinting: false,
        }
    }

    /// Sets the balloon's target and tells the driver (a configuration
    /// change interrupt) if it runs.
    pub fn set_target_mib(&self, mib: u32) {
        let mut s = lock(&self.shared);
        s.target_pages = mib_to_pages(mib);
        if let Some(irq) = &s.interrupt
            && let Err(e) = irq.trigger(VirtioInterruptType::Config)
        {
            crate::warn_limited!("balloon: cannot interrupt the guest: {e}");
        }
    }

    /// Changes how often the guest's statistics are refreshed; they cannot
    /// be turned on or off after boot (the queue exists or not).
    pub fn set_stats_interval(&self, seconds: u16) -> Result<(), BalloonError> {
        let mut s = lock(&self.shared);
        if (s.stats_interval_s == 0) != (seconds == 0) {
            return Err(BalloonError::StatsToggle {
                from: s.stats_interval_s,
                to: seconds,
            });
        }
        s.stats_interval_s = seconds;
        drop(s);
        if let Err(e) = self.wake.write(1) {
            crate::warn_limited!("balloon: cannot wake the worker: {e}");
        }
        Ok(())
    }

    /// Whether the device has a statistics queue.
    pub fn stats_enabled(&self) -> bool {
        self.config.stats_polling_interval_s > 0
    }

    /// `GET /balloon/statistics`: the sizes, the guest's last statistics
    /// and what the VMM gave back.
    pub fn stats(&self) -> vmm_api::BalloonStats {
        let s = lock(&self.shared);
        let g = s.guest_stats;
        vmm_api::BalloonStats {
            target_pages: s.target_pages,
            actual_pages: s.actual_pages,
            target_mib: pages_to_mib(s.target_pages),
            actual_mib: pages_to_mib(s.actual_pages),
            swap_in: g[0],
            swap_out: g[1],
            major_faults: g[2],
            minor_faults: g[3],
            free_memory: g[4],
            total_memory: g[5],
            available_memory: g[6],
            disk_caches: g[7],
            hugetlb_allocations: g[8],
            hugetlb_failures: g[9],
            reported_bytes: s.reported_bytes,
            inflated_bytes: s.inflated_bytes,
        }
    }
}

/// A virtio-balloon device (ID 5): inflate and deflate queues, and when
/// configured a statistics queue and a free page reporting queue.
#[derive(Debug)]
pub struct Balloon {
    handle: BalloonHandle,
    queue_sizes: Vec<u16>,
    acked_features: u64,
    /// A statistics buffer the guest left with the device, carried over a
    /// restore until the worker starts with it.
    held_stats_desc: Option<u16>,
    worker: Option<WorkerThread<Worker>>,
}

impl Balloon {
    pub fn new(config: BalloonConfig) -> Result<Self, BalloonError> {
        let wake = EventFd::new(EFD_NONBLOCK).map_err(BalloonError::Setup)?;
        let queues = 2
            + usize::from(config.stats_polling_interval_s > 0)
            + usize::from(config.free_page_reporting);
        Ok(Balloon {
            handle: BalloonHandle {
                config,
                shared: Arc::new(Mutex::new(Shared {
                    target_pages: mib_to_pages(config.amount_mib),
                    actual_pages: 0,
                    stats_interval_s: config.stats_polling_interval_s,
                    guest_stats: [None; STAT_TAGS],
                    reported_bytes: 0,
                    inflated_bytes: 0,
                    interrupt: None,
                })),
                wake: Arc::new(wake),
            },
            queue_sizes: vec![QUEUE_SIZE; queues],
            acked_features: 0,
            held_stats_desc: None,
            worker: None,
        })
    }

    pub fn handle(&self) -> BalloonHandle {
        self.handle.clone()
    }

    pub fn config(&self) -> BalloonConfig {
        self.handle.config
    }

    pub(super) fn shared(&self) -> &Mutex<Shared> {
        &self.handle.shared
    }

    /// What the worker shares with the device and the API.
    pub(super) fn shared_parts(&self) -> (Arc<Mutex<Shared>>, Arc<EventFd>) {
        (self.handle.shared.clone(), self.handle.wake.clone())
    }

    /// The statistics buffer the device holds: the parked worker's, or the
    /// one a restore handed over.
    pub(super) fn held_stats_desc(&self) -> Option<u16> {
        match self.worker.as_ref() {
            Some(w) => w.parked().and_then(Worker::held_stats_desc),
            None => self.held_stats_desc,
        }
    }

    /// For a restore: the driver's sizes and the statistics buffer held.
    pub(super) fn restore_state(&mut self, target: u32, actual: u32, held: Option<u16>) {
        let mut s = lock(&self.handle.shared);
        s.target_pages = target;
        s.actual_pages = actual;
        drop(s);
        self.held_stats_desc = held;
    }

    fn stop_worker(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop();
        }
        lock(&self.handle.shared).interrupt = None;
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        let c = self.handle.config;
        let bit = |on: bool, b: u64| if on { 1 << b } else { 0 };
        (1 << VIRTIO_F_VERSION_1)
            | bit(c.deflate_on_oom, F_DEFLATE_ON_OOM)
            | bit(c.stats_polling_interval_s > 0, F_STATS_VQ)
            | bit(c.free_page_reporting, F_REPORTING)
    }

    fn set_acked_features(&mut self, acked: u64) {
        self.acked_features = acked & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let s = lock(&self.handle.shared);
        let mut space = [0u8; 8];
        space[..4].copy_from_slice(&s.target_pages.to_le_bytes());
        space[4..].copy_from_slice(&s.actual_pages.to_le_bytes());
        read_config_space(&space, offset, data);
    }

    /// The driver writes `actual` (bytes 4..8); `num_pages` is the device's.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let mut s = lock(&self.handle.shared);
        let mut actual = s.actual_pages.to_le_bytes();
        for (i, byte) in data.iter().enumerate() {
            let at = offset.saturating_add(i as u64);
            if (4..8).contains(&at) {
                actual[(at - 4) as usize] = *byte;
            }
        }
        s.actual_pages = u32::from_le_bytes(actual);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        if self.worker.as_ref().is_some_and(WorkerThread::is_alive) {
            return Err(ActivateError::Other(
                "the balloon device is already active".into(),
            ));
        }
        if queues.len() != self.queue_sizes.len() {
            return Err(ActivateError::QueueCount {
                expected: self.queue_sizes.len(),
                got: queues.len(),
            });
        }
        let stop = StopSignal::new().map_err(ActivateError::Worker)?;
        let worker = Worker::new(self, mem, interrupt.clone(), queues, &stop)
            .map_err(ActivateError::Worker)?;
        self.held_stats_desc = None;
        lock(&self.handle.shared).interrupt = Some(interrupt);
        let thread =
            WorkerThread::spawn("balloon".into(), stop, worker).map_err(ActivateError::Worker)?;
        self.worker = Some(thread);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.stop_worker();
        self.acked_features = 0;
        self.held_stats_desc = None;
        // The driver gave every page back before it let go of the device.
        lock(&self.handle.shared).actual_pages = 0;
        true
    }

    fn acked_features(&self) -> u64 {
        self.acked_features
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.worker
            .as_ref()
            .and_then(WorkerThread::parked)
            .map(Worker::queue_states)
            .unwrap_or_default()
    }

    fn snapshot(&self) -> Option<SavedDevice> {
        Some(SavedDevice::Balloon(self.save()))
    }

    fn pause(&mut self) {
        if let Some(worker) = &mut self.worker {
            worker.park();
        }
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        if let Some(worker) = &mut self.worker {
            worker.unpark().map_err(ActivateError::Worker)?;
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for Balloon {
    fn drop(&mut self) {
        self.stop_worker();
    }
}
