//! The legacy devices on the port I/O bus: the serial console and the i8042.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::DeviceManagerError;
use crate::arch::x86_64::layout::{I8042_DATA_PORT, I8042_IRQ, SERIAL_IRQ, SERIAL_PORT};
use crate::devices::bus::Bus;
use crate::devices::legacy::EventFdTrigger;
use crate::devices::legacy::i8042::{I8042Device, PORT_RANGE_LEN};
use crate::devices::legacy::serial::{ConsoleOutput, SerialDevice};
use crate::vstate::vm::Vm;

/// The eight registers of a 16550-compatible UART.
const SERIAL_PORT_RANGE_LEN: u64 = 8;

pub struct LegacyDevices {
    pub i8042: Arc<Mutex<I8042Device>>,
    /// Set when the console showed a kernel panic.
    pub guest_panicked: Arc<AtomicBool>,
}

fn irq_trigger(vm: &Vm, irq: u32) -> Result<EventFdTrigger, DeviceManagerError> {
    let evt = EventFd::new(EFD_NONBLOCK).map_err(DeviceManagerError::EventFd)?;
    vm.fd()
        .register_irqfd(&evt, irq)
        .map_err(|e| DeviceManagerError::Kvm("IRQFD", e))?;
    Ok(EventFdTrigger(evt))
}

/// Creates COM1 (output to `console`) and the i8042 (a reset calls `on_reset`).
pub fn attach(
    vm: &Vm,
    io_bus: &mut Bus,
    console: Box<dyn std::io::Write + Send>,
    on_reset: Box<dyn Fn() + Send>,
) -> Result<LegacyDevices, DeviceManagerError> {
    let guest_panicked = Arc::new(AtomicBool::new(false));
    let serial = SerialDevice::new(
        irq_trigger(vm, SERIAL_IRQ)?,
        ConsoleOutput::new(console, guest_panicked.clone()),
    );
    io_bus.insert(
        Arc::new(Mutex::new(serial)),
        u64::from(SERIAL_PORT),
        SERIAL_PORT_RANGE_LEN,
    )?;

    let i8042 = Arc::new(Mutex::new(I8042Device::new(
        irq_trigger(vm, I8042_IRQ)?,
        on_reset,
    )));
    io_bus.insert(i8042.clone(), u64::from(I8042_DATA_PORT), PORT_RANGE_LEN)?;
    Ok(LegacyDevices {
        i8042,
        guest_panicked,
    })
}
