//! The device's I/O thread: one epoll loop over the queue notifications, the device
//! socket, every host stream, the transport-reset request and the stop signal.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use virtio_queue::{QueueOwnedT, QueueT};
use virtio_vsock::packet::VsockPacket;
use vm_memory::Bytes;
use vmm_sys_util::epoll::{ControlOperation, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::muxer::{Muxer, TOKEN_FD_BASE, TOKEN_LISTENER};
use super::packet::{EVENT_TRANSPORT_RESET, Header, MAX_PKT_DATA};
use crate::devices::virtio::worker::{DeviceWorker, StopSignal};
use crate::devices::virtio::{ActivatedQueue, VirtioInterrupt, VirtioInterruptType};
use crate::vstate::memory::GuestMemory;

const TOKEN_RX: u64 = 0;
const TOKEN_TX: u64 = 1;
const TOKEN_EVENT: u64 = 2;
const TOKEN_STOP: u64 = 3;
const TOKEN_RESET: u64 = 4;
/// The longest packets to the guest wait for it to take in a transport
/// reset (see [`Worker::reset_hold`]): a guest kicks its event queue once
/// it has reset its connections, within a millisecond on hardware.
const RESET_ACK_WAIT: Duration = Duration::from_millis(500);

pub struct Worker {
    pub mem: GuestMemory,
    pub interrupt: Arc<dyn VirtioInterrupt>,
    pub rx: ActivatedQueue,
    pub tx: ActivatedQueue,
    pub event: ActivatedQueue,
    pub reset_evt: EventFd,
    pub reset_requested: Arc<AtomicBool>,
    pub muxer: Muxer,
    /// A transport reset event waits for a buffer in the event queue.
    event_pending: bool,
    /// Until then (or until the guest, having taken in the reset event,
    /// kicks its event queue), nothing goes to the guest's RX queue. A
    /// guest resets every connected socket when it handles the event, and
    /// the RX and event queues are handled by separate guest work items in
    /// no set order: a host connection it accepted just before would be
    /// reset, and its client would have to connect again (measured after
    /// restores in the lab: about one in two first connections lost).
    reset_hold: Option<Instant>,
    tx_data: Vec<u8>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("mem", &self.mem)
            .field("rx", &self.rx)
            .field("tx", &self.tx)
            .field("event", &self.event)
            .field("reset_evt", &self.reset_evt)
            .field("reset_requested", &self.reset_requested)
            .field("muxer", &self.muxer)
            .field("event_pending", &self.event_pending)
            .field("reset_hold", &self.reset_hold)
            .finish_non_exhaustive()
    }
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        [rx, tx, event]: [ActivatedQueue; 3],
        stop: &StopSignal,
        reset_evt: EventFd,
        reset_requested: Arc<AtomicBool>,
        muxer: Muxer,
    ) -> io::Result<Self> {
        let add = |fd: &EventFd, token| {
            muxer.epoll.ctl(
                ControlOperation::Add,
                fd.as_raw_fd(),
                EpollEvent::new(EventSet::IN, token),
            )
        };
        add(&rx.notify, TOKEN_RX)?;
        add(&tx.notify, TOKEN_TX)?;
        add(&event.notify, TOKEN_EVENT)?;
        add(&reset_evt, TOKEN_RESET)?;
        muxer.epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_STOP),
        )?;
        Ok(Self {
            mem,
            interrupt,
            rx,
            tx,
            event,
            reset_evt,
            reset_requested,
            muxer,
            event_pending: false,
            reset_hold: None,
            tx_data: vec![0; MAX_PKT_DATA as usize],
        })
    }

    /// The rx, tx and event queues' state.
    pub fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        [&self.rx, &self.tx, &self.event]
            .iter()
            .map(|q| q.queue.state())
            .collect()
    }
}

impl DeviceWorker for Worker {
    /// Serves until stopped; returns itself, connections and queues intact,
    /// so the device can start it again.
    fn run(mut self, _stop: &StopSignal) -> Self {
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            let deadline = match (self.muxer.next_deadline(), self.reset_hold) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let timeout = match deadline {
                None => -1,
                Some(d) => {
                    let ms = d.saturating_duration_since(Instant::now()).as_millis();
                    // Round up so the deadline has passed when we wake.
                    i32::try_from(ms + 1).unwrap_or(i32::MAX)
                }
            };
            let n = match self.muxer.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("vsock: epoll_wait failed, stopping the device: {e}");
                    return self;
                }
            };
            let now = Instant::now();
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_RX => drain(&self.rx.notify),
                    TOKEN_TX => drain(&self.tx.notify),
                    TOKEN_EVENT => {
                        drain(&self.event.notify);
                        // The guest refilled its event queue: it has handled
                        // the reset we delivered.
                        if !self.event_pending {
                            self.reset_hold = None;
                        }
                    }
                    TOKEN_STOP => return self,
                    TOKEN_RESET => {
                        drain(&self.reset_evt);
                        if self.reset_requested.swap(false, Ordering::SeqCst) {
                            self.muxer.reset_connections();
                            self.event_pending = true;
                            self.reset_hold = Some(now + RESET_ACK_WAIT);
                        }
                    }
                    TOKEN_LISTENER => self.muxer.accept(now),
                    token if token >= TOKEN_FD_BASE => {
                        let fd = (token - TOKEN_FD_BASE) as i32;
                        self.muxer.stream_event(fd, ev.event_set(), now);
                    }
                    _ => {}
                }
            }
            self.muxer.expire(now);
            self.process_queues(now);
        }
    }
}

impl Worker {
    /// Runs the queues until neither makes progress, then interrupts the guest once.
    pub fn process_queues(&mut self, now: Instant) {
        let mut used = false;
        if self.reset_hold.is_some_and(|until| now >= until) {
            self.reset_hold = None;
        }
        let hold_rx = self.reset_hold.is_some();
        loop {
            let tx = self.process_tx(now);
            let rx = !hold_rx && self.process_rx(now);
            used |= tx | rx;
            if !tx && !rx {
                break;
            }
        }
        used |= self.process_event();
        if used {
            self.signal();
        }
    }

    fn signal(&mut self) {
        let mut needed = false;
        for q in [&mut self.rx, &mut self.tx, &mut self.event] {
            needed |= q.queue.needs_notification(&self.mem).unwrap_or(true);
        }
        if needed && let Err(e) = self.interrupt.trigger(VirtioInterruptType::Queue) {
            crate::warn_limited!("vsock: cannot interrupt the guest: {e}");
        }
    }

    /// Takes guest packets off the TX queue. Returns whether any buffer was used.
    fn process_tx(&mut self, now: Instant) -> bool {
        let mut used = false;
        while !self.muxer.control_full() {
            let Some(mut chain) = self.tx.queue.pop_descriptor_chain(&self.mem) else {
                break;
            };
            let head = chain.head_index();
            match VsockPacket::from_tx_virtq_chain(&self.mem, &mut chain, MAX_PKT_DATA) {
                Ok(pkt) => {
                    let hdr = Header::from_packet(&pkt);
                    let len = match pkt.data_slice() {
                        Some(s) => s.copy_to(&mut self.tx_data[..]),
                        None => 0,
                    };
                    self.muxer.guest_packet(&hdr, &self.tx_data[..len], now);
                }
                Err(e) => tracing::debug!("vsock: dropping a malformed TX packet: {e}"),
            }
            if let Err(e) = self.tx.queue.add_used(&self.mem, head, 0) {
                crate::warn_limited!("vsock: TX add_used: {e}");
            }
            used = true;
        }
        used
    }

    /// Fills the guest's RX buffers with queued packets. Returns whether any was used.
    fn process_rx(&mut self, now: Instant) -> bool {
        let mut used = false;
        while self.muxer.has_rx() {
            let Some(mut chain) = self.rx.queue.pop_descriptor_chain(&self.mem) else {
                break;
            };
            let head = chain.head_index();
            let len = match VsockPacket::from_rx_virtq_chain(&self.mem, &mut chain, MAX_PKT_DATA) {
                Ok(mut pkt) => match self.muxer.fill_rx(&mut pkt, now) {
                    Some(len) => len,
                    None => {
                        // Nothing fits after all: leave the buffer to the guest.
                        self.rx.queue.go_to_previous_position();
                        break;
                    }
                },
                Err(e) => {
                    tracing::debug!("vsock: unusable RX buffer: {e}");
                    0
                }
            };
            if let Err(e) = self.rx.queue.add_used(&self.mem, head, len) {
                crate::warn_limited!("vsock: RX add_used: {e}");
            }
            used = true;
        }
        used
    }

    /// Delivers a pending transport reset event. Returns whether a buffer was used.
    fn process_event(&mut self) -> bool {
        if !self.event_pending {
            return false;
        }
        let Some(mut chain) = self.event.queue.pop_descriptor_chain(&self.mem) else {
            return false;
        };
        let head = chain.head_index();
        let mut len = 0;
        if let Some(desc) = chain.next()
            && desc.is_write_only()
            && desc.len() >= 4
            && self
                .mem
                .write_obj(EVENT_TRANSPORT_RESET.to_le(), desc.addr())
                .is_ok()
        {
            len = 4;
            self.event_pending = false;
        }
        if let Err(e) = self.event.queue.add_used(&self.mem, head, len) {
            crate::warn_limited!("vsock: event queue add_used: {e}");
        }
        true
    }
}

/// Clears an eventfd's counter; a spurious wakeup leaves it empty, which is fine.
fn drain(evt: &EventFd) {
    let _ = evt.read();
}
