//! A disk layer file as the VMM opens it: the two header slots, the layout,
//! the bitmap checks, the parent chain, then reads and a write through the
//! opened disk.
#![no_main]

use std::path::Component;

use disk_layers::LayeredDisk;
use disk_layers::format::{Header, Parent};
use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::layers::BASE_LEN;
use sandfork_fuzz::scratch_dir;

const SEALED: &[u8] = include_bytes!("../seeds/disk_layer/sealed-over-raw");

fuzz_target!(|data: &[u8]| {
    let dir = scratch_dir().join("disk");
    let path = dir.join("top.sfl");
    if !path.exists() {
        // The parents seeds name: the raw base and the sealed layer over it
        // that `make_seeds` wrote with them (its id is in the child seed).
        std::fs::create_dir_all(&dir).expect("layer dir");
        std::fs::write(dir.join("base.img"), vec![0xab; BASE_LEN]).expect("base");
        std::fs::write(dir.join("sealed.sfl"), SEALED).expect("sealed layer");
    }
    let _ = Header::decode_slots(data, &path);
    // Parents are named relative to the layer; the target opens only those
    // inside its own directory (an absolute or `..` path would open whatever
    // the host holds, a FIFO among them, and hang the fuzzer rather than the
    // code under test).
    if let Ok(header) = Header::decode_slots(data, &path) {
        let outside = match &header.parent {
            Parent::None => false,
            p => p.path().is_none_or(|p| {
                p.components()
                    .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
            }),
        };
        if outside {
            return;
        }
    }
    std::fs::write(&path, data).expect("layer file");
    let Ok(disk) = LayeredDisk::open(&path) else {
        return;
    };
    let len = disk.len();
    let mut buf = vec![0u8; 4096];
    for offset in [0, len / 2, len.saturating_sub(4096)] {
        let n = (len - offset.min(len)).min(4096) as usize;
        let _ = disk.read_at(&mut buf[..n], offset);
    }
    if !disk.is_read_only() && len >= 512 {
        let _ = disk.write_at(&[0x5a; 512], len - 512);
    }
    let _ = disk.flush();
});
