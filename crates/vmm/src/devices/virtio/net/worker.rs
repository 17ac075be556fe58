//! The thread that moves frames: an epoll loop over both queues' notifications, the
//! backend and the stop signal.
//!
//! TX: every available chain is gathered into one frame and written to the backend.
//! RX: a frame is read from the backend only into a buffer of our own, and is held
//! there while the guest has no receive buffer; the backend is then taken out of the
//! epoll set until the guest notifies the RX queue, so a busy backend cannot spin
//! the thread (a failing one is taken out the same way). A chain the device cannot use (device-readable buffers on RX,
//! device-writable on TX, too small, outside guest memory) costs its frame, which is
//! counted, and the chain goes back to the guest as used.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use virtio_queue::{DescriptorChain, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::backend::FrameBackend;
use super::metrics::NetCounters;
use super::{MAX_FRAME_LEN, VNET_HDR_LEN};
use crate::devices::virtio::worker::{DeviceWorker, StopSignal};
use crate::devices::virtio::{ActivatedQueue, VirtioInterrupt, VirtioInterruptType};
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
        rx: ActivatedQueue,
        tx: ActivatedQueue,
        backend: Box<dyn FrameBackend>,
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
    fn process(&mut self) {
        let tx_used = self.process_tx();
        let (rx_used, rx_stalled) = self.process_rx();
        self.watch_backend(!rx_stalled);
        let mut needed = false;
        for (used, queue) in [(rx_used, &mut self.rx.queue), (tx_used, &mut self.tx.queue)] {
            // When in doubt, interrupt: a spurious one is harmless, a lost one hangs.
            needed |= used && queue.needs_notification(&self.mem).unwrap_or(true);
        }
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
            let Some(chain) = self.rx.queue.pop_descriptor_chain(&self.mem) else {
                return (used, true);
            };
            let head = chain.head_index();
            let len = self.rx_len;
            self.rx_len = 0;
            // No mergeable buffers: each frame fills exactly one chain.
            self.rx_frame[NUM_BUFFERS_AT..VNET_HDR_LEN].copy_from_slice(&1u16.to_le_bytes());
            let written = match scatter(&self.mem, chain, &self.rx_frame[..len], &mut self.segments)
            {
                Ok(()) => {
                    NetCounters::add(&self.counters.rx_frames, 1);
                    NetCounters::add(&self.counters.rx_bytes, (len - VNET_HDR_LEN) as u64);
                    // A frame is below 64 KiB + header.
                    len as u32
                }
                Err(e) => {
                    tracing::debug!("net: dropping a {len}-byte frame, RX chain unusable: {e:?}");
                    NetCounters::add(&self.counters.rx_dropped, 1);
                    0
                }
            };
            if let Err(e) = self.rx.queue.add_used(&self.mem, head, written) {
                crate::warn_limited!("net: RX add_used: {e}");
            }
            used = true;
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
    let mut rest = frame;
    for &(addr, len) in segments.iter() {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(len.min(rest.len()));
        mem.write_slice(now, addr)
            .map_err(|_| ChainError::Malformed)?;
        rest = later;
    }
    Ok(())
}
