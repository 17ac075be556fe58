//! The i8042 keyboard controller, only as much of it as a microVM needs: the
//! guest resets the machine through it (`reboot=k`), and the host sends
//! Ctrl+Alt+Del through its keyboard port.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use vm_superio::Trigger;

use super::EventFdTrigger;
use crate::devices::bus::BusDevice;

/// Offsets from the data port 0x60: the status/command port is 0x64.
pub const DATA_OFFSET: u64 = 0;
pub const COMMAND_OFFSET: u64 = 4;
/// The bus range covering both ports.
pub const PORT_RANGE_LEN: u64 = 5;

const STATUS_OUTPUT_FULL: u8 = 0x01;
const STATUS_SYS_FLAG: u8 = 0x04;
const STATUS_LAST_WAS_COMMAND: u8 = 0x08;

const CTRL_KBD_INT: u8 = 0x01;
const CTRL_SYS_FLAG: u8 = 0x04;
const CTRL_KBD_DISABLED: u8 = 0x10;
const CTRL_AUX_DISABLED: u8 = 0x20;

const CMD_READ_CTRL: u8 = 0x20;
const CMD_WRITE_CTRL: u8 = 0x60;
const CMD_DISABLE_AUX: u8 = 0xa7;
const CMD_ENABLE_AUX: u8 = 0xa8;
const CMD_TEST_AUX: u8 = 0xa9;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_TEST_KBD: u8 = 0xab;
const CMD_DISABLE_KBD: u8 = 0xad;
const CMD_ENABLE_KBD: u8 = 0xae;
const CMD_WRITE_OUTPUT_PORT: u8 = 0xd1;
const CMD_WRITE_KBD_BUFFER: u8 = 0xd2;
const CMD_WRITE_AUX_BUFFER: u8 = 0xd3;
const CMD_WRITE_AUX: u8 = 0xd4;
const CMD_PULSE_RESET: u8 = 0xfe;

const SELF_TEST_OK: u8 = 0x55;
const KBD_ACK: u8 = 0xfa;
const KBD_RESET: u8 = 0xff;
const KBD_SELF_TEST_OK: u8 = 0xaa;
const KBD_GET_ID: u8 = 0xf2;
const KBD_ID: [u8; 2] = [0xab, 0x83];
/// Keyboard commands followed by one argument byte.
const KBD_COMMANDS_WITH_ARG: [u8; 3] = [0xed, 0xf0, 0xf3];

/// Ctrl, Alt, Del pressed then released, in scan code set 2.
const CTRL_ALT_DEL: [u8; 12] = [
    0x14, 0x11, 0xe0, 0x71, 0xe0, 0xf0, 0x71, 0xf0, 0x11, 0xf0, 0x14, 0x00,
];
const CTRL_ALT_DEL_LEN: usize = 11;

/// The bounded keyboard buffer: a guest that never reads cannot grow it.
const BUFFER_CAPACITY: usize = 64;

pub struct I8042Device {
    status: u8,
    control: u8,
    buffer: VecDeque<u8>,
    /// A controller command that waits for its data byte on the data port.
    pending_command: Option<u8>,
    /// The keyboard is waiting for the argument of its last command.
    kbd_expects_arg: bool,
    interrupt: EventFdTrigger,
    on_reset: Box<dyn Fn() + Send>,
}

impl std::fmt::Debug for I8042Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("I8042Device")
            .field("status", &self.status)
            .field("control", &self.control)
            .field("buffer", &self.buffer)
            .field("pending_command", &self.pending_command)
            .field("kbd_expects_arg", &self.kbd_expects_arg)
            .field("interrupt", &self.interrupt)
            .finish_non_exhaustive()
    }
}

/// The controller's registers and keyboard buffer, for snapshots.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042State {
    pub status: u8,
    pub control: u8,
    pub buffer: Vec<u8>,
    pub pending_command: Option<u8>,
    pub kbd_expects_arg: bool,
}

impl I8042Device {
    pub fn state(&self) -> I8042State {
        I8042State {
            status: self.status,
            control: self.control,
            buffer: self.buffer.iter().copied().collect(),
            pending_command: self.pending_command,
            kbd_expects_arg: self.kbd_expects_arg,
        }
    }

    /// Loads a saved state; the buffer is cut to its usual bound.
    pub fn restore(&mut self, state: &I8042State) {
        self.status = state.status;
        self.control = state.control;
        self.buffer = state.buffer.iter().copied().take(BUFFER_CAPACITY).collect();
        self.pending_command = state.pending_command;
        self.kbd_expects_arg = state.kbd_expects_arg;
    }

    pub fn new(interrupt: EventFdTrigger, on_reset: Box<dyn Fn() + Send>) -> Self {
        I8042Device {
            status: STATUS_SYS_FLAG,
            control: CTRL_KBD_INT | CTRL_SYS_FLAG,
            buffer: VecDeque::new(),
            pending_command: None,
            kbd_expects_arg: false,
            interrupt,
            on_reset,
        }
    }

    /// Types Ctrl+Alt+Del on the keyboard.
    pub fn trigger_ctrl_alt_del(&mut self) {
        self.push(&CTRL_ALT_DEL[..CTRL_ALT_DEL_LEN]);
    }

    fn push(&mut self, bytes: &[u8]) {
        let was_empty = self.buffer.is_empty();
        for &b in bytes {
            if self.buffer.len() < BUFFER_CAPACITY {
                self.buffer.push_back(b);
            }
        }
        if was_empty && !self.buffer.is_empty() {
            self.output_ready();
        }
    }

    fn output_ready(&mut self) {
        self.status |= STATUS_OUTPUT_FULL;
        if self.control & CTRL_KBD_INT != 0
            && let Err(e) = self.interrupt.trigger()
        {
            crate::warn_limited!("i8042 interrupt failed: {e}");
        }
    }

    fn pop(&mut self) -> u8 {
        let byte = self.buffer.pop_front().unwrap_or(0);
        if self.buffer.is_empty() {
            self.status &= !STATUS_OUTPUT_FULL;
        } else {
            self.output_ready();
        }
        byte
    }

    fn command(&mut self, cmd: u8) {
        self.status |= STATUS_LAST_WAS_COMMAND;
        match cmd {
            CMD_READ_CTRL => self.push(&[self.control]),
            CMD_WRITE_CTRL
            | CMD_WRITE_OUTPUT_PORT
            | CMD_WRITE_KBD_BUFFER
            | CMD_WRITE_AUX_BUFFER
            | CMD_WRITE_AUX => self.pending_command = Some(cmd),
            CMD_DISABLE_AUX => self.control |= CTRL_AUX_DISABLED,
            CMD_ENABLE_AUX => self.control &= !CTRL_AUX_DISABLED,
            // There is no aux port: report its clock line stuck low.
            CMD_TEST_AUX => self.push(&[0x01]),
            CMD_SELF_TEST => self.push(&[SELF_TEST_OK]),
            CMD_TEST_KBD => self.push(&[0x00]),
            CMD_DISABLE_KBD => self.control |= CTRL_KBD_DISABLED,
            CMD_ENABLE_KBD => self.control &= !CTRL_KBD_DISABLED,
            CMD_PULSE_RESET => (self.on_reset)(),
            _ => {}
        }
    }

    fn data(&mut self, byte: u8) {
        self.status &= !STATUS_LAST_WAS_COMMAND;
        if let Some(cmd) = self.pending_command.take() {
            match cmd {
                CMD_WRITE_CTRL => self.control = byte,
                CMD_WRITE_KBD_BUFFER => self.push(&[byte]),
                _ => {}
            }
            return;
        }
        if self.kbd_expects_arg {
            self.kbd_expects_arg = false;
            self.push(&[KBD_ACK]);
            return;
        }
        match byte {
            KBD_RESET => self.push(&[KBD_ACK, KBD_SELF_TEST_OK]),
            KBD_GET_ID => self.push(&[KBD_ACK, KBD_ID[0], KBD_ID[1]]),
            b if KBD_COMMANDS_WITH_ARG.contains(&b) => {
                self.kbd_expects_arg = true;
                self.push(&[KBD_ACK]);
            }
            _ => self.push(&[KBD_ACK]),
        }
    }
}

impl BusDevice for I8042Device {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let [byte] = data else { return };
        *byte = match offset {
            DATA_OFFSET => self.pop(),
            COMMAND_OFFSET => self.status,
            _ => 0,
        };
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let [byte] = data else { return };
        match offset {
            DATA_OFFSET => self.data(*byte),
            COMMAND_OFFSET => self.command(*byte),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    fn device() -> (I8042Device, Arc<AtomicBool>) {
        let reset = Arc::new(AtomicBool::new(false));
        let flag = reset.clone();
        let dev = I8042Device::new(
            EventFdTrigger(EventFd::new(EFD_NONBLOCK).unwrap()),
            Box::new(move || flag.store(true, Ordering::SeqCst)),
        );
        (dev, reset)
    }

    fn read(dev: &mut I8042Device, offset: u64) -> u8 {
        let mut b = [0u8];
        dev.read(offset, &mut b);
        b[0]
    }

    #[test]
    fn pulse_reset_resets_the_machine() {
        let (mut dev, reset) = device();
        dev.write(COMMAND_OFFSET, &[CMD_PULSE_RESET]);
        assert!(reset.load(Ordering::SeqCst));
    }

    #[test]
    fn self_test_and_control_byte() {
        let (mut dev, _) = device();
        dev.write(COMMAND_OFFSET, &[CMD_SELF_TEST]);
        assert_ne!(read(&mut dev, COMMAND_OFFSET) & STATUS_OUTPUT_FULL, 0);
        assert_eq!(read(&mut dev, DATA_OFFSET), SELF_TEST_OK);
        assert_eq!(read(&mut dev, COMMAND_OFFSET) & STATUS_OUTPUT_FULL, 0);
        dev.write(COMMAND_OFFSET, &[CMD_WRITE_CTRL]);
        dev.write(DATA_OFFSET, &[0x47]);
        dev.write(COMMAND_OFFSET, &[CMD_READ_CTRL]);
        assert_eq!(read(&mut dev, DATA_OFFSET), 0x47);
    }

    #[test]
    fn ctrl_alt_del_is_typed_and_interrupts() {
        let (mut dev, _) = device();
        dev.trigger_ctrl_alt_del();
        assert_eq!(dev.interrupt.0.read().unwrap(), 1);
        let typed: Vec<u8> = (0..CTRL_ALT_DEL_LEN)
            .map(|_| read(&mut dev, DATA_OFFSET))
            .collect();
        assert_eq!(typed, CTRL_ALT_DEL[..CTRL_ALT_DEL_LEN]);
        assert_eq!(read(&mut dev, COMMAND_OFFSET) & STATUS_OUTPUT_FULL, 0);
    }

    #[test]
    fn keyboard_commands_are_acknowledged() {
        let (mut dev, _) = device();
        dev.write(DATA_OFFSET, &[KBD_GET_ID]);
        assert_eq!(
            [read(&mut dev, 0), read(&mut dev, 0), read(&mut dev, 0)],
            [KBD_ACK, 0xab, 0x83]
        );
        dev.write(DATA_OFFSET, &[0xed]);
        dev.write(DATA_OFFSET, &[0x07]);
        assert_eq!([read(&mut dev, 0), read(&mut dev, 0)], [KBD_ACK, KBD_ACK]);
    }

    #[test]
    fn buffer_is_bounded() {
        let (mut dev, _) = device();
        for _ in 0..100 {
            dev.trigger_ctrl_alt_del();
        }
        assert_eq!(dev.buffer.len(), BUFFER_CAPACITY);
    }
}
