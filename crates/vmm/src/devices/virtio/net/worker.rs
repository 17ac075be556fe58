//! The thread that moves frames: an epoll loop over both queues' notifications, the
//! backend and the stop signal.
//!
//! TX: every available chain is gathered into one frame and written to the backend.
//! RX: a frame is read from the backend only into a buffer of our own, and is held
//! there while the guest has no receive buffer; the backend is then taken out of the
//! epoll set until the guest notifies the RX queue, so a busy backend cannot spin
//! the thread (a failing one is taken out the same way). With mergeable buffers a
//! frame fills as many chains as it needs (`num_buffers` in its header), all
//! returned at once ([`super::used_batch`]); without, it must fit one chain. A chain
//! the device cannot use (device-readable buffers on RX, device-writable on TX, too
//! small, outside guest memory) costs its frame, which is counted, and the chain
//! goes back to the guest as used.
//!
//! With `VIRTIO_RING_F_EVENT_IDX` the worker tells the driver, before it sleeps,
//! which available index to notify at (re-checking the ring after, so a buffer
//! posted meanwhile is not missed), and interrupts only where the driver asked.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use virtio_queue::{DescriptorChain, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::backend::FrameBackend;
use super::metrics::NetCounters;
use super::used_batch::UsedBatch;
use super::{MAX_FRAME_LEN, VNET_HDR_LEN};
use crate::devices::virtio::worker::{DeviceWorker, StopSignal};
use crate::devices::virtio::{
    ActivatedQueue, VirtioInterrupt, VirtioInterruptType, avail_ring_in_reach,
};
use crate::vstate::memory::GuestMemory;

const TOKEN_RX: u64 = 0;
const TOKEN_TX: u64 = 1;
const TOKEN_BACKEND: u64 = 2;
const TOKEN_STOP: u64 = 3;

/// Offset of `num_buffers` in `virtio_net_hdr_v1`.
const NUM_BUFFERS_AT: usize = 10;

/// Everything the worker thread owns; it survives a stop, so a pause keeps the
/// backend, the queues and a frame waiting for a buffer.
pub struct Worker {
    mem: GuestMemory,
    interrupt: Arc<dyn VirtioInterrupt>,
    rx: ActivatedQueue,
    tx: ActivatedQueue,
    backend: Box<dyn FrameBackend>,
    counters: Arc<NetCounters>,
    /// `VIRTIO_NET_F_MRG_RXBUF` was negotiated.
    mergeable: bool,
    /// What the RX queue used, returned to the guest in one go per frame.
    rx_used: UsedBatch,
    /// The chains one frame fills: `(head, capacity)`, and what it wrote in each.
    rx_chains: Vec<(u16, usize)>,
    rx_written: Vec<(u16, u32)>,
    /// A frame read from the backend; `rx_len` bytes of it wait for a guest buffer.
    rx_frame: Vec<u8>,
    rx_len: usize,
    tx_frame: Vec<u8>,
    /// The descriptors of the chain being filled (reused to avoid allocations).
    segments: Vec<(GuestAddress, usize)>,
    /// Both queues' notifications, the backend (while watched) and the stop
    /// signal.
    epoll: Epoll,
    /// Whether the epoll set currently watches the backend.
    backend_watched: bool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("mem", &self.mem)
            .field("rx", &self.rx)
            .field("tx", &self.tx)
            .field("counters", &self.counters)
            .field("mergeable", &self.mergeable)
            .field("rx_used", &self.rx_used)
            .field("rx_chains", &self.rx_chains)
            .field("rx_written", &self.rx_written)
            .field("rx_len", &self.rx_len)
            .field("segments", &self.segments)
            .field("epoll", &self.epoll)
            .field("backend_watched", &self.backend_watched)
            .finish_non_exhaustive()
    }
}

/// Why a chain could not carry a frame.
#[derive(Debug)]
enum ChainError {
    /// A buffer goes the wrong way or lies outside guest memory.
    Malformed,
    /// The chain holds fewer bytes than the frame (RX), or more than a frame (TX).
    Size,
}

impl Worker {
    pub fn new(
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        [rx, tx]: [ActivatedQueue; 2],
        backend: Box<dyn FrameBackend>,
        mergeable: bool,
        counters: Arc<NetCounters>,
        stop: &StopSignal,
    ) -> io::Result<Worker> {
        let epoll = Epoll::new()?;
        let add = |fd: i32, token| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )
        };
        add(rx.notify.as_raw_fd(), TOKEN_RX)?;
        add(tx.notify.as_raw_fd(), TOKEN_TX)?;
        add(backend.as_raw_fd(), TOKEN_BACKEND)?;
        add(stop.as_raw_fd(), TOKEN_STOP)?;
        Ok(Worker {
            mem,
            interrupt,
            rx,
            tx,
            backend,
            counters,
            mergeable,
            rx_used: UsedBatch::new(),
            rx_chains: Vec::new(),
            rx_written: Vec::new(),
            rx_frame: vec![0; MAX_FRAME_LEN],
            rx_len: 0,
            tx_frame: vec![0; MAX_FRAME_LEN],
            segments: Vec::new(),
            epoll,
            backend_watched: true,
        })
    }

    pub fn into_backend(self) -> Box<dyn FrameBackend> {
        self.backend
    }

    /// The rx and tx queues' state, in that order.
    pub fn queue_states(&self) -> Vec<QueueState> {
        vec![self.rx.queue.state(), self.tx.queue.state()]
    }
}

impl DeviceWorker for Worker {
    /// Stops after the frame it is moving.
    fn run(mut self, _stop: &StopSignal) -> Self {
        let mut events = [EpollEvent::default(); 4];
        // The guest may have queued buffers before activation (or before a pause).
        self.process();
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("net: epoll_wait failed, stopping the device: {e}");
                    return self;
                }
            };
            for event in &events[..n] {
                match event.data() {
                    // Clearing the counter; an empty one is a spurious wake-up.
                    TOKEN_RX => drop(self.rx.notify.read()),
                    TOKEN_TX => drop(self.tx.notify.read()),
                    TOKEN_STOP => return self,
                    _ => {}
                }
            }
            self.process();
        }
    }
}

impl Worker {
    /// Moves frames both ways until neither side can go on, then interrupts the
    /// guest once if it used buffers.
    pub fn process(&mut self) {
        let tx_used = self.process_tx();
        let (rx_used, rx_stalled) = self.process_rx();
        self.watch_backend(!rx_stalled);
        // When in doubt, interrupt: a spurious one is harmless, a lost one hangs.
        let mut needed = tx_used && self.tx.queue.needs_notification(&self.mem).unwrap_or(true);
        needed |= rx_used && self.rx_used.needs_interrupt(&self.rx.queue, &self.mem);
        if needed && let Err(e) = self.interrupt.trigger(VirtioInterruptType::Queue) {
            crate::warn_limited!("net: cannot interrupt the guest: {e}");
        }
    }

    /// Adds the backend to the epoll set or takes it out. Out, not just masked:
    /// epoll reports errors and hang-ups even for an empty mask, and a tap whose
    /// interface was deleted reports an error for good.
    fn watch_backend(&mut self, watch: bool) {
        if watch == self.backend_watched {
            return;
        }
        let op = if watch {
            ControlOperation::Add
        } else {
            ControlOperation::Delete
        };
        match self.epoll.ctl(
            op,
            self.backend.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_BACKEND),
        ) {
            Ok(()) => self.backend_watched = watch,
            Err(e) => crate::error_limited!("net: cannot change the backend's epoll interest: {e}"),
        }
    }

    /// Sends every frame the guest queued. Returns whether any chain was used.
    fn process_tx(&mut self) -> bool {
        let mut used = false;
        loop {
            used |= self.drain_tx();
            // Re-arming the notification reports chains queued meanwhile.
            match self.tx.queue.enable_notification(&self.mem) {
                Ok(true) if avail_ring_in_reach(&mut self.tx.queue, &self.mem, "net: TX queue") => {
                    continue;
                }
                Ok(_) => return used,
                Err(e) => {
                    crate::warn_limited!("net: TX queue: {e}");
                    return used;
                }
            }
        }
    }

    fn drain_tx(&mut self) -> bool {
        let mut used = false;
        while let Some(chain) = self.tx.queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            match gather(&self.mem, chain, &mut self.tx_frame) {
                Ok(len) if len >= VNET_HDR_LEN => {
                    match self.backend.write_frame(&self.tx_frame[..len]) {
                        Ok(()) => {
                            NetCounters::add(&self.counters.tx_frames, 1);
                            NetCounters::add(&self.counters.tx_bytes, (len - VNET_HDR_LEN) as u64);
                        }
                        Err(e) => {
                            tracing::debug!("net: the backend refused a frame: {e}");
                            NetCounters::add(&self.counters.tx_dropped, 1);
                        }
                    }
                }
                Ok(_) | Err(_) => {
                    tracing::debug!("net: dropping a malformed TX chain");
                    NetCounters::add(&self.counters.tx_dropped, 1);
                }
            }
            if let Err(e) = self.tx.queue.add_used(&self.mem, head, 0) {
                crate::warn_limited!("net: TX add_used: {e}");
            }
            used = true;
        }
        used
    }

    /// Delivers frames from the backend while the guest has buffers. Returns whether
    /// any chain was used, and whether to stop watching the backend until the guest
    /// next notifies the RX queue: a frame waits for a buffer, or the backend failed
    /// (retrying at once would spin).
    fn process_rx(&mut self) -> (bool, bool) {
        let mut used = false;
        loop {
            if self.rx_len == 0 {
                match self.backend.read_frame(&mut self.rx_frame) {
                    Ok(n) if n >= VNET_HDR_LEN => self.rx_len = n,
                    Ok(_) => {
                        NetCounters::add(&self.counters.rx_dropped, 1);
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return (used, false),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        crate::warn_limited!("net: reading from the backend: {e}");
                        return (used, true);
                    }
                }
            }
            let delivered = if self.mergeable {
                self.deliver_mergeable()
            } else {
                self.deliver_whole()
            };
            match delivered {
                Ok(()) => used = true,
                Err(seen) => {
                    if self.rx_buffers_posted_since(seen) {
                        continue;
                    }
                    return (used, true);
                }
            }
        }
    }

    /// Asks the driver to notify once it posts past available index `seen`, and
    /// reports whether it already has. The chains a mergeable frame could not use
    /// are back in the ring, before `seen`: notifying from where the device
    /// resumes (what `enable_notification` asks) would ask for a notification the
    /// driver already passed.
    fn rx_buffers_posted_since(&mut self, seen: u16) -> bool {
        let resume_at = self.rx.queue.next_avail();
        self.rx.queue.set_next_avail(seen);
        let posted = self.rx.queue.enable_notification(&self.mem);
        self.rx.queue.set_next_avail(resume_at);
        match posted {
            Ok(posted) => {
                posted && avail_ring_in_reach(&mut self.rx.queue, &self.mem, "net: RX queue")
            }
            Err(e) => {
                crate::warn_limited!("net: RX queue: {e}");
                false
            }
        }
    }

    /// The waiting frame into one chain. `Err(seen)` when the guest has none
    /// posted, with the available index looked up to.
    fn deliver_whole(&mut self) -> Result<(), u16> {
        let Some(chain) = self.rx.queue.pop_descriptor_chain(&self.mem) else {
            return Err(self.rx.queue.next_avail());
        };
        let head = chain.head_index();
        let len = self.rx_len;
        self.rx_len = 0;
        self.rx_frame[NUM_BUFFERS_AT..VNET_HDR_LEN].copy_from_slice(&1u16.to_le_bytes());
        let written = match scatter(&self.mem, chain, &self.rx_frame[..len], &mut self.segments) {
            Ok(()) => {
                self.count_rx(len);
                // A frame is below 64 KiB + header.
                len as u32
            }
            Err(e) => {
                tracing::debug!("net: dropping a {len}-byte frame, RX chain unusable: {e:?}");
                NetCounters::add(&self.counters.rx_dropped, 1);
                0
            }
        };
        self.return_rx(&[(head, written)]);
        Ok(())
    }

    /// The waiting frame over as many chains as it needs. `Err(seen)`, every
    /// chain taken put back, when the guest has not posted enough yet.
    fn deliver_mergeable(&mut self) -> Result<(), u16> {
        let len = self.rx_len;
        let start = self.rx.queue.next_avail();
        self.rx_chains.clear();
        self.segments.clear();
        let mut capacity = 0usize;
        let mut malformed = false;
        while capacity < len {
            let Some(chain) = self.rx.queue.pop_descriptor_chain(&self.mem) else {
                let seen = self.rx.queue.next_avail();
                self.rx.queue.set_next_avail(start);
                return Err(seen);
            };
            let head = chain.head_index();
            let mut chain_capacity = 0usize;
            for desc in chain {
                if !desc.is_write_only() {
                    malformed = true;
                    break;
                }
                self.segments.push((desc.addr(), desc.len() as usize));
                chain_capacity = chain_capacity.saturating_add(desc.len() as usize);
            }
            self.rx_chains.push((head, chain_capacity));
            if malformed {
                break;
            }
            capacity = capacity.saturating_add(chain_capacity);
        }
        self.rx_len = 0;
        // At most one chain per queue entry: the count fits num_buffers.
        let buffers = self.rx_chains.len() as u16;
        self.rx_frame[NUM_BUFFERS_AT..VNET_HDR_LEN].copy_from_slice(&buffers.to_le_bytes());
        let wrote = !malformed && write_segments(&self.mem, &self.segments, &self.rx_frame[..len]);
        self.rx_written.clear();
        let mut rest = if wrote { len } else { 0 };
        for &(head, chain_capacity) in &self.rx_chains {
            let now = rest.min(chain_capacity);
            rest -= now;
            self.rx_written.push((head, now as u32));
        }
        if wrote {
            self.count_rx(len);
        } else {
            tracing::debug!("net: dropping a {len}-byte frame, an RX chain is unusable");
            NetCounters::add(&self.counters.rx_dropped, 1);
        }
        let written = std::mem::take(&mut self.rx_written);
        self.return_rx(&written);
        self.rx_written = written;
        Ok(())
    }

    fn count_rx(&self, len: usize) {
        NetCounters::add(&self.counters.rx_frames, 1);
        NetCounters::add(&self.counters.rx_bytes, (len - VNET_HDR_LEN) as u64);
    }

    fn return_rx(&mut self, used: &[(u16, u32)]) {
        if let Err(e) = self.rx_used.publish(&mut self.rx.queue, &self.mem, used) {
            crate::warn_limited!("net: RX used ring: {e}");
        }
    }
}

/// Copies a TX chain (device-readable buffers only) into `frame`; returns its length.
fn gather(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    frame: &mut [u8],
) -> Result<usize, ChainError> {
    let mut len = 0usize;
    for desc in chain {
        if desc.is_write_only() {
            return Err(ChainError::Malformed);
        }
        let n = desc.len() as usize;
        let end = len
            .checked_add(n)
            .filter(|end| *end <= frame.len())
            .ok_or(ChainError::Size)?;
        mem.read_slice(&mut frame[len..end], desc.addr())
            .map_err(|_| ChainError::Malformed)?;
        len = end;
    }
    Ok(len)
}

/// Writes `frame` into an RX chain (device-writable buffers only), all or nothing.
fn scatter(
    mem: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
    frame: &[u8],
    segments: &mut Vec<(GuestAddress, usize)>,
) -> Result<(), ChainError> {
    segments.clear();
    let mut capacity = 0usize;
    for desc in chain {
        if !desc.is_write_only() {
            return Err(ChainError::Malformed);
        }
        segments.push((desc.addr(), desc.len() as usize));
        capacity = capacity.saturating_add(desc.len() as usize);
    }
    if capacity < frame.len() {
        return Err(ChainError::Size);
    }
    if !write_segments(mem, segments, frame) {
        return Err(ChainError::Malformed);
    }
    Ok(())
}

/// Writes `frame` over `segments` in order (they hold at least its length);
/// false if one lies outside guest memory.
fn write_segments(mem: &GuestMemory, segments: &[(GuestAddress, usize)], frame: &[u8]) -> bool {
    let mut rest = frame;
    for &(addr, len) in segments {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(len.min(rest.len()));
        if mem.write_slice(now, addr).is_err() {
            return false;
        }
        rest = later;
    }
    true
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;
    use std::sync::mpsc;
    use std::time::Duration;

    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    use super::*;
    use crate::devices::virtio::device::NoIrq;
    use crate::devices::virtio::vsock::test_driver::GuestQueue;

    /// Runs one `process` of a worker whose driver published `rx_idx` and
    /// `tx_idx` as available indices (and no chains) on queues of 16, with a
    /// frame waiting in the backend; false if it has not returned in 10 s.
    fn process_returns(rx_idx: u16, tx_idx: u16, mergeable: bool) -> bool {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let mut rx = GuestQueue::new(&mem, 0x1_0000, 16);
        let mut tx = GuestQueue::new(&mem, 0x2_0000, 16);
        rx.set_avail_idx(rx_idx);
        tx.set_avail_idx(tx_idx);
        let (device_end, host) = UnixDatagram::pair().unwrap();
        device_end.set_nonblocking(true).unwrap();
        host.send(&[0u8; VNET_HDR_LEN + 60]).unwrap();
        let queue = |q: &GuestQueue| ActivatedQueue {
            queue: q.device_queue(),
            notify: EventFd::new(EFD_NONBLOCK).unwrap(),
        };
        let stop = StopSignal::new().unwrap();
        let mut worker = Worker::new(
            mem,
            Arc::new(NoIrq),
            [queue(&rx), queue(&tx)],
            Box::new(device_end),
            mergeable,
            Arc::default(),
            &stop,
        )
        .unwrap();
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            worker.process();
            let _ = done.send(());
        });
        finished.recv_timeout(Duration::from_secs(10)).is_ok()
    }

    /// Found by the `net_frames` fuzz target: a driver whose available index
    /// ran more than the queue size ahead had the worker spin for ever (no
    /// chain to pop, yet "more pending" each time notifications were
    /// re-enabled), on TX and on RX alike.
    #[test]
    fn an_available_index_beyond_the_queue_size_does_not_spin() {
        assert!(process_returns(0, 17, false), "TX spins");
        assert!(process_returns(17, 0, false), "RX spins");
        assert!(process_returns(17, 0, true), "mergeable RX spins");
    }
}
