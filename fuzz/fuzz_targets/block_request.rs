//! virtio-blk: a request queue laid out by the guest (any descriptors, chains,
//! indirect tables, available ring), serviced by the device's real worker
//! against a real image file: chain walking, request parsing, the I/O and the
//! status and used-ring writes.
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::{Cursor, NoInterrupt, fill_data, guest_memory, queue_from, scratch_dir};
use vmm::devices::virtio::block::QUEUE_SIZE;
use vmm::devices::virtio::block::disk::Disk;
use vmm::devices::virtio::block::worker::{Worker, drive_id};
use vmm::devices::virtio::worker::StopSignal;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

fn disk() -> Arc<Disk> {
    static DISK: OnceLock<Arc<Disk>> = OnceLock::new();
    DISK.get_or_init(|| {
        let path = scratch_dir().join("block.img");
        std::fs::write(&path, vec![0u8; 64 * 512]).expect("image");
        Arc::new(Disk::open(&path, false).expect("disk"))
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let mem = guest_memory();
    let queue = queue_from(&mut c, &mem, 0, QUEUE_SIZE);
    fill_data(&mut c, &mem);
    let stop = StopSignal::new().expect("stop signal");
    let worker = Worker::new(
        disk(),
        drive_id("fuzz-drive"),
        mem,
        Arc::new(Mutex::new(queue)),
        EventFd::new(EFD_NONBLOCK).expect("eventfd"),
        Arc::new(NoInterrupt),
        &stop,
    )
    .expect("worker");
    worker.process_queue(&stop);
});
