//! virtio-mmio devices: one 4 KiB window and one interrupt line each, named
//! to the guest kernel on its command line (`virtio_mmio.device=`).

use std::sync::{Arc, Mutex};

use kvm_ioctls::IoEventAddress;
use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::DeviceManagerError;
use crate::arch::x86_64::layout::{
    IRQ_BASE, IRQ_MAX, MMIO_DEVICE_SIZE, MMIO_DEVICES_MAX, MMIO_DEVICES_START,
};
use crate::devices::bus::Bus;
use crate::devices::virtio::balloon::{Balloon, BalloonHandle};
use crate::devices::virtio::handoff::DeviceHandoff;
use crate::devices::virtio::mmio::{
    MmioInterrupt, MmioTransport, MmioTransportState, QUEUE_NOTIFY_OFFSET,
};
use crate::devices::virtio::persist::SavedDevice;
pub use crate::devices::virtio::persist::{DeviceOverrides, DriveAt};
use crate::devices::virtio::{DiskBranch, PreparedBranch, VirtioDevice};
use crate::vstate::memory::GuestMemory;
use crate::vstate::vm::Vm;

/// Where one virtio device sits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioSlot {
    pub base: u64,
    pub irq: u32,
}

impl MmioSlot {
    /// The guest kernel parameter that declares this device.
    pub fn cmdline_param(&self) -> String {
        format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            MMIO_DEVICE_SIZE / 1024,
            self.base,
            self.irq
        )
    }
}

/// One virtio device in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioDeviceState {
    pub slot: MmioSlot,
    pub config: SavedDevice,
    pub transport: MmioTransportState,
}

#[derive(Debug)]
pub struct MmioDeviceManager {
    slots: Vec<MmioSlot>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    /// Where the transports hand the status writes that start and stop
    /// devices, for the controller thread to apply.
    handoff: Arc<DeviceHandoff>,
}

impl MmioDeviceManager {
    pub fn new(handoff: Arc<DeviceHandoff>) -> Self {
        MmioDeviceManager {
            slots: Vec::new(),
            transports: Vec::new(),
            handoff,
        }
    }

    pub fn handoff(&self) -> &Arc<DeviceHandoff> {
        &self.handoff
    }

    fn next_slot(&self) -> Result<MmioSlot, DeviceManagerError> {
        let index = self.slots.len() as u64;
        if index >= MMIO_DEVICES_MAX {
            return Err(DeviceManagerError::OutOfMmioSpace);
        }
        let irq = IRQ_BASE + index as u32;
        if irq > IRQ_MAX {
            return Err(DeviceManagerError::OutOfIrqs);
        }
        Ok(MmioSlot {
            base: MMIO_DEVICES_START + index * MMIO_DEVICE_SIZE,
            irq,
        })
    }

    /// Puts `device` behind a transport in the next free window, with its queue
    /// notifications as ioeventfds and its interrupt as an irqfd.
    pub fn attach(
        &mut self,
        vm: &Vm,
        mem: &GuestMemory,
        mmio_bus: &mut Bus,
        device: Box<dyn VirtioDevice>,
    ) -> Result<MmioSlot, DeviceManagerError> {
        let slot = self.next_slot()?;
        self.attach_at(vm, mem, mmio_bus, device, slot.clone())?;
        Ok(slot)
    }

    fn attach_at(
        &mut self,
        vm: &Vm,
        mem: &GuestMemory,
        mmio_bus: &mut Bus,
        device: Box<dyn VirtioDevice>,
        slot: MmioSlot,
    ) -> Result<Arc<Mutex<MmioTransport>>, DeviceManagerError> {
        let irqfd = EventFd::new(EFD_NONBLOCK).map_err(DeviceManagerError::EventFd)?;
        vm.fd()
            .register_irqfd(&irqfd, slot.irq)
            .map_err(|e| DeviceManagerError::Kvm("IRQFD", e))?;
        let transport =
            MmioTransport::new(device, mem.clone(), Arc::new(MmioInterrupt::new(irqfd)))?;
        for (index, evt) in transport.queue_evts().iter().enumerate() {
            vm.fd()
                .register_ioevent(
                    evt,
                    &IoEventAddress::Mmio(slot.base + QUEUE_NOTIFY_OFFSET),
                    index as u32,
                )
                .map_err(|e| DeviceManagerError::Kvm("IOEVENTFD", e))?;
        }
        let transport = Arc::new(Mutex::new(transport));
        let index = self.handoff.register(&transport);
        transport
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_handoff(self.handoff.clone(), index);
        mmio_bus.insert(transport.clone(), slot.base, MMIO_DEVICE_SIZE)?;
        self.slots.push(slot);
        self.transports.push(transport.clone());
        Ok(transport)
    }

    /// Recreates the devices of a snapshot in their windows, with their
    /// transport state; active devices start their workers (on the calling
    /// thread).
    pub fn restore(
        handoff: Arc<DeviceHandoff>,
        vm: &Vm,
        mem: &GuestMemory,
        mmio_bus: &mut Bus,
        states: &[MmioDeviceState],
        overrides: &DeviceOverrides,
    ) -> Result<Self, DeviceManagerError> {
        for (iface, _) in &overrides.taps {
            let known = states
                .iter()
                .any(|s| s.config.iface_id() == Some(iface.as_str()));
            if !known {
                return Err(DeviceManagerError::State(format!(
                    "network override for {iface}: the snapshot has no such network interface"
                )));
            }
        }
        let mut manager = MmioDeviceManager::new(handoff);
        for state in states {
            let valid_slot = state
                .slot
                .base
                .checked_sub(MMIO_DEVICES_START)
                .is_some_and(|o| {
                    o % MMIO_DEVICE_SIZE == 0 && o / MMIO_DEVICE_SIZE < MMIO_DEVICES_MAX
                })
                && (IRQ_BASE..=IRQ_MAX).contains(&state.slot.irq);
            if !valid_slot {
                return Err(DeviceManagerError::State(format!(
                    "device window {:#x} / line {} is not one this VMM uses",
                    state.slot.base, state.slot.irq
                )));
            }
            let t0 = std::time::Instant::now();
            let device = state
                .config
                .restore(overrides)
                .map_err(DeviceManagerError::Restore)?;
            let t1 = std::time::Instant::now();
            let transport = manager.attach_at(vm, mem, mmio_bus, device, state.slot.clone())?;
            let t2 = std::time::Instant::now();
            transport
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .restore(&state.transport)?;
            tracing::debug!(
                "device at {:#x}: opened {} us, attached {} us, activated {} us",
                state.slot.base,
                (t1 - t0).as_micros(),
                (t2 - t1).as_micros(),
                t2.elapsed().as_micros()
            );
        }
        Ok(manager)
    }

    /// Every device's state; pause them first.
    pub fn state(&self) -> Result<Vec<MmioDeviceState>, DeviceManagerError> {
        self.slots
            .iter()
            .zip(&self.transports)
            .map(|(slot, transport)| {
                let t = transport.lock().unwrap_or_else(|e| e.into_inner());
                let config = t.device().snapshot().ok_or_else(|| {
                    DeviceManagerError::State(format!(
                        "virtio device {} cannot be snapshotted",
                        t.device_type()
                    ))
                })?;
                Ok(MmioDeviceState {
                    slot: slot.clone(),
                    config,
                    transport: t.state(),
                })
            })
            .collect()
    }

    /// Every device's transport and rings as the driver sees them.
    pub fn reports(&self) -> Vec<vmm_api::DeviceReport> {
        self.transports
            .iter()
            .map(|t| t.lock().unwrap_or_else(|e| e.into_inner()).report())
            .collect()
    }

    /// Parks every device worker, so guest memory and queues hold still.
    pub fn pause(&self) {
        for t in &self.transports {
            t.lock().unwrap_or_else(|e| e.into_inner()).pause_device();
        }
    }

    pub fn resume(&self) -> Result<(), DeviceManagerError> {
        for t in &self.transports {
            t.lock()
                .unwrap_or_else(|e| e.into_inner())
                .resume_device()
                .map_err(|e| DeviceManagerError::State(e.to_string()))?;
        }
        Ok(())
    }

    /// For a fork, while the VM runs: every writable disk makes the layer it
    /// continues in after the seal under `dir` (see
    /// `VirtioDevice::prepare_branch`), each with its device's place. On
    /// failure, those made are removed (dropped). Each device's lock is held
    /// while its one layer is made (a create and a sync): a vCPU that
    /// notifies that disk meanwhile waits that long, the VM does not stop.
    pub fn prepare_branches(
        &self,
        dir: &std::path::Path,
        children: usize,
    ) -> Result<Vec<(usize, PreparedBranch)>, DeviceManagerError> {
        let mut prepared = Vec::new();
        for (i, t) in self.transports.iter().enumerate() {
            let t = t.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = t
                .device()
                .prepare_branch(dir, children)
                .map_err(DeviceManagerError::State)?
            {
                prepared.push((i, p));
            }
        }
        Ok(prepared)
    }

    /// Seals the disks [`MmioDeviceManager::prepare_branches`] prepared and
    /// moves each onto its new layer; pause first. A failure part-way
    /// leaves the disks before it moved (the caller reports the VM's disks
    /// in doubt) and removes the layers not used.
    pub fn switch_disks(
        &self,
        prepared: Vec<(usize, PreparedBranch)>,
    ) -> Result<Vec<DiskBranch>, DeviceManagerError> {
        let mut branches = Vec::with_capacity(prepared.len());
        for (i, p) in prepared {
            let t = self
                .transports
                .get(i)
                .ok_or_else(|| DeviceManagerError::State(format!("no device {i} to branch")))?;
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            branches.push(
                t.device_mut()
                    .switch_disk(p)
                    .map_err(DeviceManagerError::State)?,
            );
        }
        Ok(branches)
    }

    /// Tells every device that the VM was restored (vsock resets its connections).
    pub fn notify_restored(&self) {
        for t in &self.transports {
            t.lock()
                .unwrap_or_else(|e| e.into_inner())
                .device()
                .on_restored();
        }
    }

    /// The balloon's handle, if the VM has a balloon.
    pub fn balloon(&self) -> Option<BalloonHandle> {
        self.transports.iter().find_map(|t| {
            let t = t.lock().unwrap_or_else(|e| e.into_inner());
            t.device()
                .as_any()
                .downcast_ref::<Balloon>()
                .map(Balloon::handle)
        })
    }

    /// Whether any device is of virtio type `device_type`.
    pub fn has_device(&self, device_type: u32) -> bool {
        self.transports
            .iter()
            .any(|t| t.lock().unwrap_or_else(|e| e.into_inner()).device_type() == device_type)
    }

    pub fn slots(&self) -> &[MmioSlot] {
        &self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::balloon::SavedBalloon;
    use crate::devices::virtio::block::SavedBlock;
    use crate::devices::virtio::net::SavedNet;
    use crate::devices::virtio::vsock::SavedVsock;

    #[test]
    fn cmdline_names_window_and_line() {
        let slot = MmioSlot {
            base: 0xd000_1000,
            irq: 6,
        };
        assert_eq!(slot.cmdline_param(), "virtio_mmio.device=4K@0xd0001000:6");
    }

    /// One device of each kind, as a snapshot file stores them.
    fn sample_states() -> Vec<MmioDeviceState> {
        let transport = MmioTransportState {
            queue_select: 1,
            device_features_select: 0,
            driver_features_select: 1,
            driver_features: 1 << 32,
            acked_features: 1 << 32,
            status: 15,
            activated: true,
            interrupt_status: 1,
            queues: vec![crate::devices::virtio::persist::QueueSnapshot {
                max_size: 256,
                next_avail: 7,
                next_used: 7,
                event_idx_enabled: true,
                size: 256,
                ready: true,
                desc_table: 0x1000,
                avail_ring: 0x2000,
                used_ring: 0x3000,
            }],
        };
        let slot = |i: u64| MmioSlot {
            base: MMIO_DEVICES_START + i * MMIO_DEVICE_SIZE,
            irq: IRQ_BASE + i as u32,
        };
        vec![
            MmioDeviceState {
                slot: slot(0),
                config: SavedDevice::Block(SavedBlock {
                    id: "rootfs".into(),
                    path: "/r.ext4".into(),
                    read_only: true,
                }),
                transport: transport.clone(),
            },
            MmioDeviceState {
                slot: slot(1),
                config: SavedDevice::Vsock(SavedVsock {
                    guest_cid: 3,
                    uds_path: "/v.sock".into(),
                }),
                transport: transport.clone(),
            },
            MmioDeviceState {
                slot: slot(2),
                config: SavedDevice::Net(SavedNet {
                    iface_id: "eth0".into(),
                    host_dev_name: "tap0".into(),
                    guest_mac: Some([2, 0, 0, 0, 0, 1]),
                }),
                transport: transport.clone(),
            },
            MmioDeviceState {
                slot: slot(3),
                config: SavedDevice::Balloon(SavedBalloon {
                    deflate_on_oom: true,
                    stats_polling_interval_s: 5,
                    free_page_reporting: true,
                    target_pages: 1024,
                    actual_pages: 512,
                    stats_desc: Some(3),
                }),
                transport,
            },
        ]
    }

    /// The bytes snapshot files hold for these devices: a change to the
    /// device state types must keep them, or bump the format version. (The
    /// balloon came later as a new last variant: the bytes of the devices
    /// before it did not change, so older snapshots still load.)
    const SAMPLE_STATES_POSTCARD: &str = concat!(
        "04808080800d050006726f6f746673072f722e6578743401010001808080801080808080100f0101",
        "01800207070180020180208040806080a080800d060103072f762e736f636b010001808080801080",
        "808080100f010101800207070180020180208040806080c080800d07020465746830047461703001",
        "020000000001010001808080801080808080100f010101800207070180020180208040806080e080",
        "800d0803010501800880040103010001808080801080808080100f01010180020707018002018020",
        "80408060",
    );

    #[test]
    fn device_states_keep_their_snapshot_encoding() {
        let bytes = postcard::to_stdvec(&sample_states()).unwrap();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, SAMPLE_STATES_POSTCARD);
        let back: Vec<MmioDeviceState> = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, sample_states());
    }

    #[test]
    fn slots_run_out_with_the_ioapic_pins() {
        let mut manager = MmioDeviceManager::new(DeviceHandoff::unattended());
        for i in 0..=(IRQ_MAX - IRQ_BASE) {
            let slot = manager.next_slot().unwrap();
            assert_eq!(slot.irq, IRQ_BASE + i);
            manager.slots.push(slot);
        }
        assert!(matches!(
            manager.next_slot(),
            Err(DeviceManagerError::OutOfIrqs)
        ));
    }
}
