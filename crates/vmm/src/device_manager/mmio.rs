//! virtio-mmio devices: one 4 KiB window and one interrupt line each, named
//! to the guest kernel on its command line (`virtio_mmio.device=`).

use std::sync::{Arc, Mutex};

use kvm_ioctls::IoEventAddress;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::DeviceManagerError;
use crate::arch::x86_64::layout::{
    IRQ_BASE, IRQ_MAX, MMIO_DEVICE_SIZE, MMIO_DEVICES_MAX, MMIO_DEVICES_START,
};
use crate::devices::bus::Bus;
use crate::devices::virtio::VirtioDevice;
use crate::devices::virtio::mmio::{MmioInterrupt, MmioTransport, QUEUE_NOTIFY_OFFSET};
use crate::vstate::memory::GuestMemory;
use crate::vstate::vm::Vm;

/// Where one virtio device sits.
#[derive(Clone, Debug, PartialEq, Eq)]
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

#[derive(Default)]
pub struct MmioDeviceManager {
    slots: Vec<MmioSlot>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
}

impl MmioDeviceManager {
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
        mmio_bus.insert(transport.clone(), slot.base, MMIO_DEVICE_SIZE)?;
        self.slots.push(slot.clone());
        self.transports.push(transport);
        Ok(slot)
    }

    pub fn slots(&self) -> &[MmioSlot] {
        &self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_names_window_and_line() {
        let slot = MmioSlot {
            base: 0xd000_1000,
            irq: 6,
        };
        assert_eq!(slot.cmdline_param(), "virtio_mmio.device=4K@0xd0001000:6");
    }

    #[test]
    fn slots_run_out_with_the_ioapic_pins() {
        let mut manager = MmioDeviceManager::default();
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
