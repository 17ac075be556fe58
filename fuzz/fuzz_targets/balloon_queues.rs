//! virtio-balloon: the inflate, deflate, statistics and free page reporting
//! queues laid out by the guest (any descriptors, chains, PFN arrays,
//! statistics and reported ranges), serviced by the device's real worker:
//! chain walking, the parsing, the release of guest pages (madvise on the
//! target's own guest memory) and the used-ring writes, then a statistics
//! refresh.
#![no_main]

use std::sync::Arc;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::{Cursor, NoInterrupt, fill_data, guest_memory, queue_from};
use vmm::devices::virtio::ActivatedQueue;
use vmm::devices::virtio::balloon::device::QUEUE_SIZE;
use vmm::devices::virtio::balloon::worker::Worker;
use vmm::devices::virtio::balloon::{Balloon, BalloonConfig};
use vmm::devices::virtio::worker::StopSignal;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let mem = guest_memory();
    let device = Balloon::new(BalloonConfig {
        amount_mib: 0,
        deflate_on_oom: true,
        stats_polling_interval_s: 1,
        free_page_reporting: true,
    })
    .expect("balloon");
    let queues = (0..4)
        .map(|i| ActivatedQueue {
            queue: queue_from(&mut c, &mem, i, QUEUE_SIZE),
            notify: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
        })
        .collect();
    fill_data(&mut c, &mem);
    let stop = StopSignal::new().expect("stop signal");
    let mut worker =
        Worker::new(&device, mem, Arc::new(NoInterrupt), queues, &stop).expect("worker");
    worker.process_queues();
    worker.refresh_stats(Instant::now() + Duration::from_secs(2));
    worker.process_queues();
});
