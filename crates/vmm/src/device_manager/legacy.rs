//! The legacy devices on the port I/O bus: the serial console and the i8042.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::DeviceManagerError;
use crate::arch::x86_64::layout::{I8042_DATA_PORT, I8042_IRQ, SERIAL_IRQ, SERIAL_PORT};
use crate::devices::bus::Bus;
use crate::devices::legacy::EventFdTrigger;
use crate::devices::legacy::i8042::{I8042Device, I8042State, PORT_RANGE_LEN};
use crate::devices::legacy::serial::{ConsoleOutput, SerialDevice, SerialDeviceState};
use crate::vstate::vm::Vm;

/// The eight registers of a 16550-compatible UART.
const SERIAL_PORT_RANGE_LEN: u64 = 8;

#[derive(Debug)]
pub struct LegacyDevices {
    pub serial: Arc<Mutex<SerialDevice>>,
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

/// The legacy devices' state in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegacyState {
    pub serial: SerialDeviceState,
    pub i8042: I8042State,
}

impl LegacyDevices {
    pub fn state(&self) -> LegacyState {
        LegacyState {
            serial: self
                .serial
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .state(),
            i8042: self.i8042.lock().unwrap_or_else(|e| e.into_inner()).state(),
        }
    }
}

/// Creates COM1 (output to `console`) and the i8042 (a reset calls `on_reset`),
/// fresh or continuing from `state`.
pub fn attach(
    vm: &Vm,
    io_bus: &mut Bus,
    console: Box<dyn std::io::Write + Send>,
    on_reset: Box<dyn Fn() + Send>,
    state: Option<&LegacyState>,
) -> Result<LegacyDevices, DeviceManagerError> {
    let guest_panicked = Arc::new(AtomicBool::new(false));
    let trigger = irq_trigger(vm, SERIAL_IRQ)?;
    let out = ConsoleOutput::new(console, guest_panicked.clone());
    let serial = match state {
        None => SerialDevice::new(trigger, out),
        Some(s) => {
            SerialDevice::from_state(&s.serial, trigger, out).map_err(DeviceManagerError::State)?
        }
    };
    let serial = Arc::new(Mutex::new(serial));
    io_bus.insert(
        serial.clone(),
        u64::from(SERIAL_PORT),
        SERIAL_PORT_RANGE_LEN,
    )?;

    let mut i8042 = I8042Device::new(irq_trigger(vm, I8042_IRQ)?, on_reset);
    if let Some(s) = state {
        i8042.restore(&s.i8042);
    }
    let i8042 = Arc::new(Mutex::new(i8042));
    io_bus.insert(i8042.clone(), u64::from(I8042_DATA_PORT), PORT_RANGE_LEN)?;
    Ok(LegacyDevices {
        serial,
        i8042,
        guest_panicked,
    })
}
