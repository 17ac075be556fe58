//! virtio-net: the guest's TX chains gathered into frames for the backend,
//! and frames from the backend (the network: any length, any header)
//! scattered into the guest's RX chains, whole or mergeable, by the device's
//! real worker.
#![no_main]

use std::os::unix::net::UnixDatagram;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::{Cursor, NoInterrupt, fill_data, guest_memory, queue_from};
use vmm::devices::virtio::ActivatedQueue;
use vmm::devices::virtio::net::NetCounters;
use vmm::devices::virtio::net::worker::Worker;
use vmm::devices::virtio::worker::StopSignal;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

fn activated(queue: virtio_queue::Queue) -> ActivatedQueue {
    ActivatedQueue {
        queue,
        notify: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let flags = c.u8();
    let mem = guest_memory();
    let rx = queue_from(&mut c, &mem, 0, 256);
    let tx = queue_from(&mut c, &mem, 1, 256);
    let (device_end, host_end) = UnixDatagram::pair().expect("socket pair");
    device_end.set_nonblocking(true).expect("nonblocking");
    host_end.set_nonblocking(true).expect("nonblocking");
    for _ in 0..(c.u8() % 8) {
        let len = usize::from(c.u16());
        let _ = host_end.send(c.bytes(len));
    }
    fill_data(&mut c, &mem);
    let stop = StopSignal::new().expect("stop signal");
    let mut worker = Worker::new(
        mem,
        Arc::new(NoInterrupt),
        [activated(rx), activated(tx)],
        Box::new(device_end),
        flags & 1 != 0,
        Arc::new(NetCounters::default()),
        &stop,
    )
    .expect("worker");
    worker.process();
    // A second pass, as after the guest's next notification.
    worker.process();
});
