//! virtio-vsock: guest packets on the TX queue (headers, payloads, any
//! operation, credit and port) parsed and routed through the connection
//! table, connections to a host listener opened and driven, and the replies
//! put into the guest's RX buffers, by the device's real worker.
#![no_main]

use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::{Cursor, NoInterrupt, fill_data, guest_memory, queue_from, scratch_dir};
use vmm::devices::virtio::ActivatedQueue;
use vmm::devices::virtio::vsock::muxer::Muxer;
use vmm::devices::virtio::vsock::worker::Worker;
use vmm::devices::virtio::worker::StopSignal;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// The guest's CID; seeds send from it.
const GUEST_CID: u64 = 3;
/// A host port with a listener behind it (`<uds>_1024`), so guest connects succeed.
const LISTENED_PORT: u32 = 1024;

fn activated(queue: virtio_queue::Queue) -> ActivatedQueue {
    ActivatedQueue {
        queue,
        notify: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
    }
}

/// The host listener for guest-initiated connections.
fn peer_listener(uds: &std::path::Path) -> &'static UnixListener {
    static L: OnceLock<UnixListener> = OnceLock::new();
    L.get_or_init(|| {
        let path = vmm::devices::virtio::vsock::unix::port_path(uds, LISTENED_PORT);
        let l = UnixListener::bind(path).expect("peer listener");
        l.set_nonblocking(true).expect("nonblocking");
        l
    })
}

fuzz_target!(|data: &[u8]| {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = scratch_dir();
    let uds = dir.join("vsock");
    let peers = peer_listener(&uds);
    // Each input gets its own device socket; the connection table is new too.
    let dev_path = dir.join(format!("dev-{}", N.fetch_add(1, Ordering::Relaxed)));
    let listener = UnixListener::bind(&dev_path).expect("device socket");
    listener.set_nonblocking(true).expect("nonblocking");
    let _ = std::fs::remove_file(&dev_path);

    let mut c = Cursor::new(data);
    let mem = guest_memory();
    let rx = queue_from(&mut c, &mem, 0, 256);
    let tx = queue_from(&mut c, &mem, 1, 256);
    let event = queue_from(&mut c, &mem, 2, 256);
    fill_data(&mut c, &mem);

    let muxer = Muxer::new(GUEST_CID, uds, listener, Duration::from_secs(5)).expect("muxer");
    let stop = StopSignal::new().expect("stop signal");
    let mut worker = Worker::new(
        mem,
        Arc::new(NoInterrupt),
        [activated(rx), activated(tx), activated(event)],
        &stop,
        EventFd::new(EFD_NONBLOCK).expect("eventfd"),
        Arc::new(AtomicBool::new(false)),
        muxer,
    )
    .expect("worker");
    worker.process_queues(Instant::now());
    drop(worker);
    // Accept and close what the guest connected, so the backlog never fills.
    while let Ok((stream, _)) = peers.accept() {
        drop(stream);
    }
});
