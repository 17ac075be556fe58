//! The snapshot state file: the header checks on the raw bytes, then (behind
//! a header with the right length and checksum, which a forged file has too)
//! the postcard decoding of the whole `MicrovmState`, and the restore of each
//! saved virtio transport's registers and queues onto a real device.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::snapshot::MicrovmState;
use vmm::snapshot::format::{self, FORMAT_VERSION};

/// `bytes` as the payload of a well-formed state file.
fn framed(payload: &[u8]) -> Vec<u8> {
    let mut out = b"SFRKSNAP".to_vec();
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fuzz_target!(|data: &[u8]| {
    let _ = format::decode::<MicrovmState>("fuzz", data);
    // Seeds are whole files: their payload is what follows the 24-byte header.
    let payload = if data.starts_with(b"SFRKSNAP") && data.len() >= 24 {
        &data[24..]
    } else {
        data
    };
    let Ok(state) = format::decode::<MicrovmState>("fuzz", &framed(payload)) else {
        return;
    };
    let _ = state.memory.size();
    for device in &state.devices {
        let _ = device.slot.cmdline_param();
        sandfork_fuzz::devices::restore_transport(&device.transport);
    }
});
