//! The virtio-MMIO transport as the guest's accesses reach it: register reads
//! and writes of any offset and width (feature negotiation, queue setup,
//! status changes, activation, notifications, reset) and config-space reads
//! and writes, on a real block, net or vsock device.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::{Cursor, devices};
use vmm::devices::bus::BusDevice;

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let device = match c.u8() % 3 {
        0 => devices::block(),
        1 => devices::net(),
        _ => devices::vsock(),
    };
    let mut transport = devices::transport(device);
    let ops = usize::from(c.u8());
    for _ in 0..ops {
        let op = c.u8();
        // Registers end at 0x100, config space follows; widths 1 to 8, and
        // now and then any offset at all.
        let offset = if op & 0x80 != 0 {
            c.u64()
        } else {
            u64::from(c.u16() % 0x200)
        };
        let width = usize::from((op >> 2) & 7) + 1;
        let width = if op & 0x40 != 0 { 4 } else { width };
        if op & 1 == 0 {
            let mut buf = [0u8; 8];
            transport.read(offset, &mut buf[..width]);
        } else {
            let value = c.bytes(width);
            transport.write(offset, value);
        }
    }
    let _ = transport.state();
});
