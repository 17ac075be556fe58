//! The virtio-mmio transport (virtio 1.x, "modern" register layout): the
//! registers a driver programs to discover a device, negotiate features and
//! set up its queues. Queue notifications and interrupts bypass it: KVM turns
//! writes to QueueNotify into ioeventfd signals, and devices raise interrupts
//! through an irqfd, so the data path never takes this lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::device::{ActivatedQueue, VirtioDevice, VirtioInterrupt, VirtioInterruptType};
use super::handoff::DeviceHandoff;
use super::persist::QueueSnapshot;
use crate::devices::bus::BusDevice;
use crate::vstate::memory::GuestMemory;

const MMIO_MAGIC_VALUE: u32 = 0x7472_6976; // "virt"
const MMIO_VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4b52_4653; // "SFRK"

/// Register offsets of the virtio-mmio layout.
mod reg {
    pub const MAGIC_VALUE: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_AVAIL_LOW: u64 = 0x090;
    pub const QUEUE_AVAIL_HIGH: u64 = 0x094;
    pub const QUEUE_USED_LOW: u64 = 0x0a0;
    pub const QUEUE_USED_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// Offset of QueueNotify, where the device manager registers ioeventfds.
pub const QUEUE_NOTIFY_OFFSET: u64 = reg::QUEUE_NOTIFY;

/// A device's interrupt: the InterruptStatus bits plus the irqfd of its line.
#[derive(Debug)]
pub struct MmioInterrupt {
    status: AtomicU32,
    irqfd: EventFd,
}

impl MmioInterrupt {
    pub fn new(irqfd: EventFd) -> Self {
        MmioInterrupt {
            status: AtomicU32::new(0),
            irqfd,
        }
    }
}

impl VirtioInterrupt for MmioInterrupt {
    fn trigger(&self, kind: VirtioInterruptType) -> std::io::Result<()> {
        let bit = match kind {
            VirtioInterruptType::Queue => VIRTIO_MMIO_INT_VRING,
            VirtioInterruptType::Config => VIRTIO_MMIO_INT_CONFIG,
        };
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.irqfd.write(1)
    }
}

/// The transport's registers and queues in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioTransportState {
    pub queue_select: u32,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub driver_features: u64,
    pub acked_features: u64,
    pub status: u32,
    pub activated: bool,
    pub interrupt_status: u32,
    pub queues: Vec<QueueSnapshot>,
}

pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemory,
    interrupt: Arc<MmioInterrupt>,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    status: u32,
    activated: bool,
    /// Where the activated queues' rings are, kept for [`report`](Self::report)
    /// after the queues moved to the device.
    rings: Vec<Ring>,
    /// Where status writes that start or stop the device go, and this
    /// transport's index there; without one they apply at once.
    handoff: Option<(Arc<DeviceHandoff>, usize)>,
    /// Register writes waiting for the controller (see `handoff`), in order.
    handed_off: Vec<(u64, u32)>,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("mem", &self.mem)
            .field("interrupt", &self.interrupt)
            .field("queues", &self.queues)
            .field("queue_evts", &self.queue_evts)
            .field("queue_select", &self.queue_select)
            .field("device_features_select", &self.device_features_select)
            .field("driver_features_select", &self.driver_features_select)
            .field("driver_features", &self.driver_features)
            .field("status", &self.status)
            .field("activated", &self.activated)
            .field("rings", &self.rings)
            .field("handoff", &self.handoff)
            .field("handed_off", &self.handed_off)
            .finish_non_exhaustive()
    }
}

/// A queue's size and ring addresses in guest memory.
#[derive(Clone, Copy, Debug)]
struct Ring {
    size: u16,
    avail: u64,
    used: u64,
}

impl Ring {
    fn of(queue: &Queue) -> Ring {
        Ring {
            size: queue.size(),
            avail: queue.avail_ring(),
            used: queue.used_ring(),
        }
    }

    /// The indices and flags as guest memory holds them now (virtio 1.x
    /// split ring: flags, idx, ring[size], then the other side's event).
    fn report(&self, mem: &GuestMemory) -> vmm_api::QueueReport {
        let mut error = None;
        let mut read = |addr: u64| match mem.read_obj::<u16>(GuestAddress(addr)) {
            Ok(v) => Some(u16::from_le(v)),
            Err(e) => {
                error.get_or_insert_with(|| format!("{addr:#x}: {e}"));
                None
            }
        };
        let size = u64::from(self.size);
        vmm_api::QueueReport {
            size: self.size,
            avail_flags: read(self.avail),
            avail_idx: read(self.avail + 2),
            used_event: read(self.avail + 4 + 2 * size),
            used_flags: read(self.used),
            used_idx: read(self.used + 2),
            avail_event: read(self.used + 4 + 8 * size),
            error,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    #[error("creating a queue of size {0}: {1}")]
    Queue(u16, virtio_queue::Error),
    #[error("creating a queue notification eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error("restoring virtio device {device_type}: {reason}")]
    Restore { device_type: u32, reason: String },
}

fn new_queues(sizes: &[u16]) -> Result<Vec<Queue>, MmioError> {
    sizes
        .iter()
        .map(|&size| Queue::new(size).map_err(|e| MmioError::Queue(size, e)))
        .collect()
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemory,
        interrupt: Arc<MmioInterrupt>,
    ) -> Result<Self, MmioError> {
        let queues = new_queues(device.queue_max_sizes())?;
        let queue_evts = queues
            .iter()
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).map_err(MmioError::EventFd))
            .collect::<Result<_, _>>()?;
        Ok(MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            queue_evts,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            status: 0,
            activated: false,
            rings: Vec::new(),
            handoff: None,
            handed_off: Vec::new(),
        })
    }

    /// From now on, status writes that start or stop the device are
    /// applied by whoever runs `handoff` (the controller thread), not by the
    /// vCPU that makes them.
    pub fn set_handoff(&mut self, handoff: Arc<DeviceHandoff>, index: usize) {
        self.handoff = Some((handoff, index));
    }

    /// Applies the register writes queued for the controller, in order.
    pub fn apply_handed_off(&mut self) {
        for (offset, value) in std::mem::take(&mut self.handed_off) {
            self.apply_register_write(offset, value);
        }
    }

    /// Whether writing `value` to STATUS starts or stops the device's worker.
    fn starts_or_stops(&self, value: u32) -> bool {
        if self.activated {
            value == 0
        } else {
            value & VIRTIO_CONFIG_S_DRIVER_OK != 0
        }
    }

    /// The transport's interrupt status and each active queue's rings, as
    /// the driver sees them (`GET /devices`).
    pub fn report(&self) -> vmm_api::DeviceReport {
        let rings: Vec<Ring> = if self.activated {
            self.rings.clone()
        } else {
            self.queues
                .iter()
                .filter(|q| q.ready())
                .map(Ring::of)
                .collect()
        };
        vmm_api::DeviceReport {
            device_type: self.device.device_type(),
            activated: self.activated,
            interrupt_status: self.interrupt.status.load(Ordering::SeqCst),
            queues: rings.iter().map(|r| r.report(&self.mem)).collect(),
            drive: self.device.drive(),
        }
    }

    /// The registers and queues, for a snapshot; pause the device first.
    pub fn state(&self) -> MmioTransportState {
        let queues = if self.activated {
            self.device.queue_states()
        } else {
            self.queues.iter().map(Queue::state).collect()
        };
        MmioTransportState {
            queue_select: self.queue_select,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            driver_features: self.driver_features,
            acked_features: self.device.acked_features(),
            status: self.status,
            activated: self.activated,
            interrupt_status: self.interrupt.status.load(Ordering::SeqCst),
            queues: queues.into_iter().map(QueueSnapshot::from).collect(),
        }
    }

    /// Loads a saved state into a transport built for the same device, and
    /// activates the device if it was active, with its queues where they were.
    pub fn restore(&mut self, state: &MmioTransportState) -> Result<(), MmioError> {
        let device_type = self.device.device_type();
        let fail = |reason: String| MmioError::Restore {
            device_type,
            reason,
        };
        if state.queues.len() != self.queues.len() {
            return Err(fail(format!(
                "the snapshot has {} queues, the device {}",
                state.queues.len(),
                self.queues.len()
            )));
        }
        if state.acked_features & !self.device.avail_features() != 0 {
            return Err(fail(
                "the snapshot's features are not offered by this device".into(),
            ));
        }
        let mut queues = Vec::with_capacity(state.queues.len());
        for (saved, current) in state.queues.iter().zip(&self.queues) {
            if saved.max_size != current.max_size() {
                return Err(fail("a queue's maximum size differs".into()));
            }
            let queue = Queue::try_from(QueueState::from(saved))
                .map_err(|e| fail(format!("invalid queue: {e}")))?;
            queues.push(queue);
        }
        self.queues = queues;
        self.queue_select = state.queue_select;
        self.device_features_select = state.device_features_select;
        self.driver_features_select = state.driver_features_select;
        self.driver_features = state.driver_features;
        self.device.set_acked_features(state.acked_features);
        self.status = state.status;
        self.interrupt
            .status
            .store(state.interrupt_status, Ordering::SeqCst);
        if state.activated {
            self.activate();
            if !self.activated {
                return Err(fail(
                    "the device did not start with its saved queues".into(),
                ));
            }
        }
        Ok(())
    }

    /// Parks the device's worker (see `VirtioDevice::pause`).
    pub fn pause_device(&mut self) {
        self.device.pause();
    }

    pub fn resume_device(&mut self) -> Result<(), super::ActivateError> {
        self.device.resume()
    }

    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    /// One eventfd per queue, signalled when the driver notifies that queue.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    pub fn device_type(&self) -> u32 {
        self.device.device_type()
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        // The device is activated with the queues moved out; after that the
        // driver may not reprogram them.
        if self.activated {
            return None;
        }
        self.queues.get_mut(self.queue_select as usize)
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(queue) = self.selected_queue() {
            f(queue);
        }
    }

    fn has_status(&self, bits: u32) -> bool {
        self.status & bits == bits
    }

    fn set_status(&mut self, status: u32) {
        if status == 0 {
            self.reset();
            return;
        }
        // Features are fixed once the driver claims FEATURES_OK; refuse it when
        // the driver accepted something the device never offered.
        if status & VIRTIO_CONFIG_S_FEATURES_OK != 0
            && !self.has_status(VIRTIO_CONFIG_S_FEATURES_OK)
        {
            let offered = self.device.avail_features();
            if self.driver_features & !offered != 0 {
                self.status = status & !VIRTIO_CONFIG_S_FEATURES_OK;
                return;
            }
            self.device.set_acked_features(self.driver_features);
        }
        self.status = status;

        let ready = VIRTIO_CONFIG_S_ACKNOWLEDGE
            | VIRTIO_CONFIG_S_DRIVER
            | VIRTIO_CONFIG_S_FEATURES_OK
            | VIRTIO_CONFIG_S_DRIVER_OK;
        if !self.activated && self.has_status(ready) {
            self.activate();
        }
    }

    fn activate(&mut self) {
        let queues_valid = self
            .queues
            .iter()
            .all(|q| q.ready() && q.is_valid(&self.mem));
        if !queues_valid {
            crate::warn_limited!(
                "virtio device {}: driver set DRIVER_OK with invalid queues",
                self.device_type()
            );
            self.status |= VIRTIO_CONFIG_S_FAILED;
            return;
        }
        self.rings = self.queues.iter().map(Ring::of).collect();
        let mut activated = Vec::with_capacity(self.queues.len());
        for (queue, evt) in self.queues.drain(..).zip(self.queue_evts.iter()) {
            match evt.try_clone() {
                Ok(notify) => activated.push(ActivatedQueue { queue, notify }),
                Err(e) => {
                    crate::error_limited!("virtio device: cloning a queue eventfd: {e}");
                    self.status |= VIRTIO_CONFIG_S_FAILED;
                    return;
                }
            }
        }
        let interrupt: Arc<dyn VirtioInterrupt> = self.interrupt.clone();
        match self.device.activate(self.mem.clone(), interrupt, activated) {
            Ok(()) => self.activated = true,
            Err(e) => {
                crate::error_limited!(
                    "virtio device {}: activation failed: {e}",
                    self.device_type()
                );
                self.status |= VIRTIO_CONFIG_S_FAILED;
            }
        }
    }

    fn reset(&mut self) {
        if self.activated {
            if !self.device.reset() {
                crate::warn_limited!("virtio device {} cannot be reset", self.device_type());
                self.status |= VIRTIO_CONFIG_S_FAILED;
                return;
            }
            self.activated = false;
        }
        match new_queues(self.device.queue_max_sizes()) {
            Ok(queues) => self.queues = queues,
            Err(e) => {
                crate::error_limited!("virtio reset: {e}");
                self.status |= VIRTIO_CONFIG_S_FAILED;
                return;
            }
        }
        self.status = 0;
        self.queue_select = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.driver_features = 0;
        self.interrupt.status.store(0, Ordering::SeqCst);
    }

    fn read_register(&self, offset: u64) -> u32 {
        let queue = || self.queues.get(self.queue_select as usize);
        match offset {
            reg::MAGIC_VALUE => MMIO_MAGIC_VALUE,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_select {
                0 => self.device.avail_features() as u32,
                1 => (self.device.avail_features() >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => queue().map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => queue().map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.interrupt.status.load(Ordering::SeqCst),
            reg::STATUS => self.status,
            reg::CONFIG_GENERATION => 0,
            _ => 0,
        }
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        if let Some((handoff, index)) = &self.handoff
            && (!self.handed_off.is_empty()
                || (offset == reg::STATUS && self.starts_or_stops(value)))
        {
            self.handed_off.push((offset, value));
            handoff.request(*index);
            return;
        }
        self.apply_register_write(offset, value);
    }

    fn apply_register_write(&mut self, offset: u64, value: u32) {
        // Feature negotiation only before FEATURES_OK; queue setup only before
        // DRIVER_OK (the spec forbids later changes; ignoring them keeps a
        // confused driver from corrupting a running device).
        let negotiating = !self.has_status(VIRTIO_CONFIG_S_FEATURES_OK);
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_select = value,
            reg::DRIVER_FEATURES_SEL => self.driver_features_select = value,
            reg::DRIVER_FEATURES if negotiating => match self.driver_features_select {
                0 => {
                    self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(value)
                }
                1 => {
                    self.driver_features =
                        (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
                }
                _ => {}
            },
            reg::QUEUE_SEL => self.queue_select = value,
            reg::QUEUE_NUM => self.with_queue(|q| q.set_size(value as u16)),
            reg::QUEUE_READY => self.with_queue(|q| q.set_ready(value == 1)),
            reg::QUEUE_DESC_LOW => self.with_queue(|q| q.set_desc_table_address(Some(value), None)),
            reg::QUEUE_DESC_HIGH => {
                self.with_queue(|q| q.set_desc_table_address(None, Some(value)))
            }
            reg::QUEUE_AVAIL_LOW => {
                self.with_queue(|q| q.set_avail_ring_address(Some(value), None))
            }
            reg::QUEUE_AVAIL_HIGH => {
                self.with_queue(|q| q.set_avail_ring_address(None, Some(value)))
            }
            reg::QUEUE_USED_LOW => self.with_queue(|q| q.set_used_ring_address(Some(value), None)),
            reg::QUEUE_USED_HIGH => self.with_queue(|q| q.set_used_ring_address(None, Some(value))),
            // Normally KVM consumes these through the ioeventfd; this path
            // serves a transport used without KVM.
            reg::QUEUE_NOTIFY => {
                if let Some(evt) = self.queue_evts.get(value as usize) {
                    let _ = evt.write(1);
                }
            }
            reg::INTERRUPT_ACK => {
                self.interrupt.status.fetch_and(!value, Ordering::SeqCst);
            }
            reg::STATUS => self.set_status(value),
            _ => {}
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            self.device.read_config(offset - reg::CONFIG, data);
            return;
        }
        if let Ok(bytes) = <&mut [u8; 4]>::try_from(data) {
            *bytes = self.read_register(offset).to_le_bytes();
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            self.device.write_config(offset - reg::CONFIG, data);
            return;
        }
        if let Ok(bytes) = <[u8; 4]>::try_from(data) {
            self.write_register(offset, u32::from_le_bytes(bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::device::ActivateError;
    use std::sync::Mutex;
    use vm_memory::GuestAddress;

    #[derive(Default)]
    struct Probe {
        acked: u64,
        activated_with: Option<usize>,
        queues: Vec<QueueState>,
    }

    struct TestDevice(Arc<Mutex<Probe>>);

    impl VirtioDevice for TestDevice {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn avail_features(&self) -> u64 {
            (1 << 32) | 0b101
        }
        fn set_acked_features(&mut self, acked: u64) {
            self.0.lock().unwrap().acked = acked;
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8 + 0x10);
        }
        fn activate(
            &mut self,
            _mem: GuestMemory,
            _interrupt: Arc<dyn VirtioInterrupt>,
            queues: Vec<ActivatedQueue>,
        ) -> Result<(), ActivateError> {
            let mut probe = self.0.lock().unwrap();
            probe.activated_with = Some(queues.len());
            probe.queues = queues.iter().map(|q| q.queue.state()).collect();
            Ok(())
        }
        fn acked_features(&self) -> u64 {
            self.0.lock().unwrap().acked
        }
        fn queue_states(&self) -> Vec<QueueState> {
            self.0.lock().unwrap().queues.clone()
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    fn transport() -> (MmioTransport, Arc<Mutex<Probe>>) {
        let probe = Arc::new(Mutex::new(Probe::default()));
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let irq = Arc::new(MmioInterrupt::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        ));
        let t = MmioTransport::new(Box::new(TestDevice(probe.clone())), mem, irq).unwrap();
        (t, probe)
    }

    fn read(t: &mut MmioTransport, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        t.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn write(t: &mut MmioTransport, offset: u64, value: u32) {
        t.write(offset, &value.to_le_bytes());
    }

    fn setup_queue(t: &mut MmioTransport, index: u32, base: u32) {
        write(t, reg::QUEUE_SEL, index);
        write(t, reg::QUEUE_NUM, 16);
        write(t, reg::QUEUE_DESC_LOW, base);
        write(t, reg::QUEUE_AVAIL_LOW, base + 0x1000);
        write(t, reg::QUEUE_USED_LOW, base + 0x2000);
        write(t, reg::QUEUE_READY, 1);
    }

    #[test]
    fn identifies_itself() {
        let (mut t, _) = transport();
        assert_eq!(read(&mut t, reg::MAGIC_VALUE), MMIO_MAGIC_VALUE);
        assert_eq!(read(&mut t, reg::VERSION), 2);
        assert_eq!(read(&mut t, reg::DEVICE_ID), 42);
        write(&mut t, reg::DEVICE_FEATURES_SEL, 1);
        assert_eq!(read(&mut t, reg::DEVICE_FEATURES), 1);
        write(&mut t, reg::QUEUE_SEL, 1);
        assert_eq!(read(&mut t, reg::QUEUE_NUM_MAX), 16);
        write(&mut t, reg::QUEUE_SEL, 7);
        assert_eq!(read(&mut t, reg::QUEUE_NUM_MAX), 0);
        let mut cfg = [0u8; 2];
        t.read(reg::CONFIG + 3, &mut cfg);
        assert_eq!(cfg, [0x13, 0x13]);
    }

    #[test]
    fn negotiates_and_activates() {
        let (mut t, probe) = transport();
        write(
            &mut t,
            reg::STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        write(&mut t, reg::DRIVER_FEATURES_SEL, 0);
        write(&mut t, reg::DRIVER_FEATURES, 0b100);
        write(&mut t, reg::DRIVER_FEATURES_SEL, 1);
        write(&mut t, reg::DRIVER_FEATURES, 1);
        let features_ok =
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
        write(&mut t, reg::STATUS, features_ok);
        assert_eq!(read(&mut t, reg::STATUS), features_ok);
        assert_eq!(probe.lock().unwrap().acked, (1 << 32) | 0b100);
        setup_queue(&mut t, 0, 0x10000);
        setup_queue(&mut t, 1, 0x20000);
        write(&mut t, reg::STATUS, features_ok | VIRTIO_CONFIG_S_DRIVER_OK);
        assert_eq!(probe.lock().unwrap().activated_with, Some(2));
        assert_eq!(read(&mut t, reg::STATUS) & VIRTIO_CONFIG_S_FAILED, 0);
    }

    fn activate(t: &mut MmioTransport) {
        let features_ok =
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
        write(
            t,
            reg::STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        write(t, reg::DRIVER_FEATURES, 0b100);
        write(t, reg::STATUS, features_ok);
        setup_queue(t, 0, 0x10000);
        setup_queue(t, 1, 0x20000);
        write(t, reg::STATUS, features_ok | VIRTIO_CONFIG_S_DRIVER_OK);
    }

    /// As under a VMM: DRIVER_OK and a reset wait for the controller, and
    /// writes made meanwhile queue up behind them.
    #[test]
    fn status_writes_that_start_or_stop_the_device_are_handed_off_in_order() {
        let (t, probe) = transport();
        let t = Arc::new(Mutex::new(t));
        let woken = Arc::new(AtomicU32::new(0));
        let counter = woken.clone();
        let handoff = DeviceHandoff::new(Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        let index = handoff.register(&t);
        t.lock().unwrap().set_handoff(handoff.clone(), index);

        activate(&mut t.lock().unwrap());
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        assert!(handoff.busy());
        assert!(probe.lock().unwrap().activated_with.is_none());
        // Another vCPU sees the status from before the write, and its own
        // write waits behind it.
        assert_eq!(
            read(&mut t.lock().unwrap(), reg::STATUS) & VIRTIO_CONFIG_S_DRIVER_OK,
            0
        );
        // (The setup left queue 1 selected.)
        write(&mut t.lock().unwrap(), reg::QUEUE_SEL, 0);
        assert_eq!(t.lock().unwrap().state().queue_select, 1);

        let vcpu = {
            let handoff = handoff.clone();
            std::thread::spawn(move || handoff.wait())
        };
        handoff.run();
        vcpu.join().unwrap();
        assert!(!handoff.busy());
        assert_eq!(probe.lock().unwrap().activated_with, Some(2));
        let state = t.lock().unwrap().state();
        assert!(state.activated);
        assert_ne!(state.status & VIRTIO_CONFIG_S_DRIVER_OK, 0);
        assert_eq!(state.queue_select, 0);

        // Other writes apply at once; a reset is handed off (and fails: the
        // test device cannot be reset).
        write(&mut t.lock().unwrap(), reg::QUEUE_SEL, 1);
        assert_eq!(t.lock().unwrap().state().queue_select, 1);
        assert!(!handoff.busy());
        write(&mut t.lock().unwrap(), reg::STATUS, 0);
        assert!(handoff.busy());
        assert!(t.lock().unwrap().state().activated);
        handoff.run();
        handoff.wait();
        assert_ne!(
            read(&mut t.lock().unwrap(), reg::STATUS) & VIRTIO_CONFIG_S_FAILED,
            0
        );
    }

    #[test]
    fn an_active_transport_restores_into_a_new_one_and_reactivates_its_device() {
        let (mut t, probe) = transport();
        activate(&mut t);
        write(&mut t, reg::QUEUE_SEL, 1);
        t.interrupt.trigger(VirtioInterruptType::Queue).unwrap();
        let state = t.state();
        assert!(state.activated);
        assert_eq!(state.acked_features, 0b100);
        assert_eq!(state.queues.len(), 2);
        assert_eq!(state.queues[1].desc_table, 0x20000);

        let (mut restored, restored_probe) = transport();
        restored.restore(&state).unwrap();
        assert_eq!(restored_probe.lock().unwrap().activated_with, Some(2));
        assert_eq!(
            restored_probe.lock().unwrap().queues,
            probe.lock().unwrap().queues
        );
        assert_eq!(read(&mut restored, reg::STATUS), read(&mut t, reg::STATUS));
        assert_eq!(read(&mut restored, reg::INTERRUPT_STATUS), 1);
        assert_eq!(restored.state(), state);
    }

    #[test]
    fn a_report_reads_the_active_rings_from_guest_memory() {
        let (mut t, _) = transport();
        activate(&mut t);
        // Queue 1 (size 16): the driver made 7 buffers available, the device
        // used 5 and raised an interrupt the driver has not acknowledged.
        t.mem
            .write_obj(7u16.to_le(), GuestAddress(0x21000 + 2))
            .unwrap();
        t.mem
            .write_obj(5u16.to_le(), GuestAddress(0x22000 + 2))
            .unwrap();
        t.mem
            .write_obj(4u16.to_le(), GuestAddress(0x21000 + 4 + 2 * 16))
            .unwrap();
        t.interrupt.trigger(VirtioInterruptType::Queue).unwrap();
        let report = t.report();
        assert!(report.activated);
        assert_eq!(report.interrupt_status, 1);
        assert_eq!(report.queues.len(), 2);
        let q = &report.queues[1];
        assert_eq!((q.size, q.avail_idx, q.used_idx), (16, Some(7), Some(5)));
        assert_eq!(q.used_event, Some(4));
        assert_eq!(q.error, None);
    }

    #[test]
    fn an_inactive_transport_restores_its_registers_only() {
        let (mut t, _) = transport();
        write(&mut t, reg::STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        setup_queue(&mut t, 0, 0x30000);
        let state = t.state();
        let (mut restored, probe) = transport();
        restored.restore(&state).unwrap();
        assert_eq!(probe.lock().unwrap().activated_with, None);
        assert_eq!(restored.state(), state);
    }

    #[test]
    fn a_state_for_another_device_shape_is_refused() {
        let (mut t, _) = transport();
        activate(&mut t);
        let mut state = t.state();
        state.queues.pop();
        let (mut restored, _) = transport();
        assert!(matches!(
            restored.restore(&state),
            Err(MmioError::Restore { .. })
        ));
        let mut state = t.state();
        state.acked_features = 1 << 40;
        assert!(restored.restore(&state).is_err());
    }

    #[test]
    fn refuses_features_never_offered() {
        let (mut t, _) = transport();
        write(&mut t, reg::DRIVER_FEATURES, 0b010);
        write(&mut t, reg::STATUS, VIRTIO_CONFIG_S_FEATURES_OK);
        assert_eq!(read(&mut t, reg::STATUS) & VIRTIO_CONFIG_S_FEATURES_OK, 0);
    }

    #[test]
    fn driver_ok_with_unready_queues_fails_the_device() {
        let (mut t, probe) = transport();
        let features_ok =
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
        write(&mut t, reg::STATUS, features_ok);
        setup_queue(&mut t, 0, 0x10000);
        write(&mut t, reg::STATUS, features_ok | VIRTIO_CONFIG_S_DRIVER_OK);
        assert!(probe.lock().unwrap().activated_with.is_none());
        assert_ne!(read(&mut t, reg::STATUS) & VIRTIO_CONFIG_S_FAILED, 0);
    }

    #[test]
    fn interrupt_status_and_ack() {
        let (mut t, _) = transport();
        t.interrupt.trigger(VirtioInterruptType::Queue).unwrap();
        t.interrupt.trigger(VirtioInterruptType::Config).unwrap();
        assert_eq!(read(&mut t, reg::INTERRUPT_STATUS), 0b11);
        write(&mut t, reg::INTERRUPT_ACK, 0b01);
        assert_eq!(read(&mut t, reg::INTERRUPT_STATUS), 0b10);
    }

    #[test]
    fn odd_sized_register_access_is_ignored() {
        let (mut t, _) = transport();
        let mut two = [0xaau8; 2];
        t.read(reg::MAGIC_VALUE, &mut two);
        assert_eq!(two, [0xaa, 0xaa]);
        t.write(reg::STATUS, &[1]);
        assert_eq!(read(&mut t, reg::STATUS), 0);
    }
}
