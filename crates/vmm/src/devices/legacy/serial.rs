//! The 8250 UART console (COM1), on vm-superio's model.

use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};
use vm_superio::Serial;
use vm_superio::serial::SerialState;

use super::EventFdTrigger;
use crate::devices::bus::BusDevice;

/// What a guest prints when it panics; seen on the console, the VMM reports a
/// panic rather than a plain reboot when the guest then resets.
const PANIC_MARKER: &[u8] = b"Kernel panic - not syncing";

/// Passes console output through while watching it for a kernel panic.
pub struct ConsoleOutput {
    out: Box<dyn Write + Send>,
    matched: usize,
    panicked: Arc<AtomicBool>,
}

impl std::fmt::Debug for ConsoleOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleOutput")
            .field("matched", &self.matched)
            .field("panicked", &self.panicked)
            .finish_non_exhaustive()
    }
}

impl ConsoleOutput {
    pub fn new(out: Box<dyn Write + Send>, panicked: Arc<AtomicBool>) -> Self {
        ConsoleOutput {
            out,
            matched: 0,
            panicked,
        }
    }

    fn scan(&mut self, buf: &[u8]) {
        for &byte in buf {
            if byte == PANIC_MARKER[self.matched] {
                self.matched += 1;
                if self.matched == PANIC_MARKER.len() {
                    self.panicked.store(true, Ordering::SeqCst);
                    self.matched = 0;
                }
            } else {
                self.matched = usize::from(byte == PANIC_MARKER[0]);
            }
        }
    }
}

impl Write for ConsoleOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.scan(buf);
        // A console nobody reads must never stall the guest.
        let _ = self.out.write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// The UART registers and receive buffer, for snapshots (vm-superio's
/// `SerialState`, which is not serializable itself).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialDeviceState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl From<SerialState> for SerialDeviceState {
    fn from(s: SerialState) -> Self {
        SerialDeviceState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialDeviceState> for SerialState {
    fn from(s: &SerialDeviceState) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// The serial port as a port I/O bus device.
#[derive(Debug)]
pub struct SerialDevice {
    serial: Serial<EventFdTrigger, vm_superio::serial::NoEvents, ConsoleOutput>,
}

impl SerialDevice {
    pub fn new(interrupt: EventFdTrigger, out: ConsoleOutput) -> Self {
        SerialDevice {
            serial: Serial::new(interrupt, out),
        }
    }

    /// A serial port continuing from a saved state.
    pub fn from_state(
        state: &SerialDeviceState,
        interrupt: EventFdTrigger,
        out: ConsoleOutput,
    ) -> Result<Self, String> {
        let serial =
            Serial::from_state(&state.into(), interrupt, vm_superio::serial::NoEvents, out)
                .map_err(|e| format!("{e:?}"))?;
        Ok(SerialDevice { serial })
    }

    pub fn state(&self) -> SerialDeviceState {
        self.serial.state().into()
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(offset), [byte]) = (u8::try_from(offset), data) {
            *byte = self.serial.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(offset), [byte]) = (u8::try_from(offset), data)
            && let Err(e) = self.serial.write(offset, *byte)
        {
            crate::warn_limited!("serial write failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spots_a_panic_split_across_writes() {
        let flag = Arc::new(AtomicBool::new(false));
        let mut out = ConsoleOutput::new(Box::new(io::sink()), flag.clone());
        out.write_all(b"[ 1.0] KKernel pa").unwrap();
        assert!(!flag.load(Ordering::SeqCst));
        out.write_all(b"nic - not syncing: Attempted to kill init!")
            .unwrap();
        assert!(flag.load(Ordering::SeqCst));
    }

    #[test]
    fn ordinary_output_is_not_a_panic() {
        let flag = Arc::new(AtomicBool::new(false));
        let mut out = ConsoleOutput::new(Box::new(io::sink()), flag.clone());
        out.write_all(b"Kernel panic? no, Kernel command line: panic=1")
            .unwrap();
        assert!(!flag.load(Ordering::SeqCst));
    }
}
