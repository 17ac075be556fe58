//! The balloon's thread: one epoll loop over its queues' notifications, the
//! API's wake-ups and the stop signal, with the statistics deadline as its
//! timeout (no timer descriptor, so no timer system calls under seccomp).

use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use virtio_queue::{QueueState, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::device::{Balloon, Shared};
use super::request;
use crate::devices::virtio::worker::{DeviceWorker, StopSignal};
use crate::devices::virtio::{ActivatedQueue, VirtioInterrupt, VirtioInterruptType};
use crate::vstate::memory::{GuestMemory, discard};

const TOKEN_INFLATE: u64 = 0;
const TOKEN_DEFLATE: u64 = 1;
const TOKEN_STATS: u64 = 2;
const TOKEN_REPORTING: u64 = 3;
const TOKEN_STOP: u64 = 4;
const TOKEN_WAKE: u64 = 5;

pub struct Worker {
    mem: GuestMemory,
    interrupt: Arc<dyn VirtioInterrupt>,
    inflate: ActivatedQueue,
    deflate: ActivatedQueue,
    stats: Option<ActivatedQueue>,
    reporting: Option<ActivatedQueue>,
    shared: Arc<Mutex<Shared>>,
    wake: Arc<EventFd>,
    epoll: Epoll,
    /// The statistics buffer the guest left with the device: given back (used)
    /// when fresh statistics are wanted, and the guest refills it.
    stats_desc: Option<u16>,
    stats_due: Option<Instant>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("mem", &self.mem)
            .field("inflate", &self.inflate)
            .field("deflate", &self.deflate)
            .field("stats", &self.stats)
            .field("reporting", &self.reporting)
            .field("wake", &self.wake)
            .field("epoll", &self.epoll)
            .field("stats_desc", &self.stats_desc)
            .field("stats_due", &self.stats_due)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker for `device`'s `queues`, in the device's order: inflate,
    /// deflate, then statistics and reporting when it has them. Public for
    /// the fuzz target; the device starts it on its thread when activated.
    pub fn new(
        device: &Balloon,
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
        stop: &StopSignal,
    ) -> io::Result<Self> {
        let has_stats = device.config().stats_polling_interval_s > 0;
        let (shared, wake) = device.shared_parts();
        let stats_desc = device.held_stats_desc();
        let mut queues = queues.into_iter();
        let missing = || io::Error::other("the balloon needs its inflate and deflate queues");
        let inflate = queues.next().ok_or_else(missing)?;
        let deflate = queues.next().ok_or_else(missing)?;
        let stats = if has_stats { queues.next() } else { None };
        let reporting = queues.next();
        let epoll = Epoll::new()?;
        let add = |fd: i32, token| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )
        };
        add(inflate.notify.as_raw_fd(), TOKEN_INFLATE)?;
        add(deflate.notify.as_raw_fd(), TOKEN_DEFLATE)?;
        if let Some(q) = &stats {
            add(q.notify.as_raw_fd(), TOKEN_STATS)?;
        }
        if let Some(q) = &reporting {
            add(q.notify.as_raw_fd(), TOKEN_REPORTING)?;
        }
        add(stop.as_raw_fd(), TOKEN_STOP)?;
        add(wake.as_raw_fd(), TOKEN_WAKE)?;
        let mut worker = Worker {
            mem,
            interrupt,
            inflate,
            deflate,
            stats,
            reporting,
            shared,
            wake,
            epoll,
            stats_desc: stats_desc.filter(|_| has_stats),
            stats_due: None,
        };
        worker.schedule_stats(Instant::now());
        Ok(worker)
    }

    /// Every queue's state, in the device's order.
    pub fn queue_states(&self) -> Vec<QueueState> {
        [&self.inflate, &self.deflate]
            .into_iter()
            .chain(&self.stats)
            .chain(&self.reporting)
            .map(|q| q.queue.state())
            .collect()
    }

    pub fn held_stats_desc(&self) -> Option<u16> {
        self.stats_desc
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the held statistics buffer goes back, from `now`.
    fn schedule_stats(&mut self, now: Instant) {
        let interval = self.shared().stats_interval_s;
        self.stats_due = (self.stats_desc.is_some() && interval > 0)
            .then(|| now + Duration::from_secs(u64::from(interval)));
    }

    fn timeout_ms(&self) -> i32 {
        match self.stats_due {
            None => -1,
            Some(due) => {
                let ms = due.saturating_duration_since(Instant::now()).as_millis();
                // Round up so the deadline has passed when we wake.
                i32::try_from(ms + 1).unwrap_or(i32::MAX)
            }
        }
    }

    /// Services every queue once; raises the interrupt if any buffer was used.
    pub fn process_queues(&mut self) {
        let mut used = self.process_inflate();
        used |= drain_unread(&mut self.deflate, &self.mem, "deflate");
        used |= self.process_reporting();
        used |= self.process_stats();
        if used {
            self.signal();
        }
    }

    /// Pages the guest put in the balloon go back to the host.
    fn process_inflate(&mut self) -> bool {
        let mut used = false;
        while let Some(chain) = self.inflate.queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            let mut bytes = 0;
            for (start, len) in request::pfn_ranges(&self.mem, chain) {
                bytes += release(&self.mem, start, len);
            }
            self.shared().inflated_bytes += bytes;
            add_used(&mut self.inflate, &self.mem, head, "inflate");
            used = true;
        }
        used
    }

    /// Pages the guest reports free go back to the host.
    fn process_reporting(&mut self) -> bool {
        let Some(q) = &mut self.reporting else {
            return false;
        };
        let mut used = false;
        let mut bytes = 0;
        while let Some(chain) = q.queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            for (start, len) in request::reported_ranges(chain) {
                bytes += release(&self.mem, start, len);
            }
            add_used(q, &self.mem, head, "reporting");
            used = true;
        }
        if bytes > 0 {
            self.shared().reported_bytes += bytes;
        }
        used
    }

    /// Takes a new statistics buffer: records what it says and holds it
    /// until the next refresh is due.
    fn process_stats(&mut self) -> bool {
        let Some(q) = &mut self.stats else {
            return false;
        };
        let mut used = false;
        while let Some(chain) = q.queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            let stats = request::stats(&self.mem, chain);
            // A driver sends one buffer at a time; an earlier one goes back.
            if let Some(old) = self.stats_desc.replace(head) {
                add_used(q, &self.mem, old, "stats");
                used = true;
            }
            let mut s = self.shared.lock().unwrap_or_else(|e| e.into_inner());
            for (tag, value) in stats {
                if let Some(slot) = s.guest_stats.get_mut(usize::from(tag)) {
                    *slot = Some(value);
                }
            }
        }
        if self.stats_due.is_none() {
            self.schedule_stats(Instant::now());
        }
        used
    }

    /// Gives the held statistics buffer back once it is due, so the guest
    /// sends fresh numbers. Returns whether it did.
    pub fn refresh_stats(&mut self, now: Instant) -> bool {
        if self.stats_due.is_none_or(|due| now < due) {
            return false;
        }
        self.stats_due = None;
        match (self.stats_desc.take(), &mut self.stats) {
            (Some(head), Some(q)) => {
                add_used(q, &self.mem, head, "stats");
                true
            }
            _ => false,
        }
    }

    fn signal(&mut self) {
        let mut needed = false;
        let queues = [&mut self.inflate, &mut self.deflate]
            .into_iter()
            .chain(self.stats.as_mut())
            .chain(self.reporting.as_mut());
        for q in queues {
            needed |= q.queue.needs_notification(&self.mem).unwrap_or(true);
        }
        if needed && let Err(e) = self.interrupt.trigger(VirtioInterruptType::Queue) {
            crate::warn_limited!("balloon: cannot interrupt the guest: {e}");
        }
    }
}

impl DeviceWorker for Worker {
    fn run(mut self, _stop: &StopSignal) -> Self {
        let mut events = [EpollEvent::default(); 8];
        // Buffers queued while the worker was parked (or before a restore).
        self.process_queues();
        loop {
            let n = match self.epoll.wait(self.timeout_ms(), &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("balloon: epoll_wait failed, stopping the device: {e}");
                    return self;
                }
            };
            for ev in &events[..n] {
                let evt = match ev.data() {
                    TOKEN_STOP => return self,
                    TOKEN_INFLATE => &self.inflate.notify,
                    TOKEN_DEFLATE => &self.deflate.notify,
                    TOKEN_STATS => match &self.stats {
                        Some(q) => &q.notify,
                        None => continue,
                    },
                    TOKEN_REPORTING => match &self.reporting {
                        Some(q) => &q.notify,
                        None => continue,
                    },
                    TOKEN_WAKE => {
                        let _ = self.wake.read();
                        // The interval changed: the next refresh counts from now.
                        self.schedule_stats(Instant::now());
                        continue;
                    }
                    _ => continue,
                };
                // A spurious wakeup leaves it empty, which is fine.
                let _ = evt.read();
            }
            let refreshed = self.refresh_stats(Instant::now());
            self.process_queues();
            if refreshed {
                self.signal();
            }
        }
    }
}

/// Returns a guest range to the host; a bad range is the guest's problem
/// and is skipped. Returns the bytes released.
fn release(mem: &GuestMemory, start: u64, len: u64) -> u64 {
    match discard(mem, start, len) {
        Ok(bytes) => bytes,
        Err(e) => {
            crate::warn_limited!("balloon: {e}");
            0
        }
    }
}

fn add_used(q: &mut ActivatedQueue, mem: &GuestMemory, head: u16, name: &str) {
    if let Err(e) = q.queue.add_used(mem, head, 0) {
        crate::warn_limited!("balloon: {name} queue add_used: {e}");
    }
}

/// Uses every buffer of a queue whose content the device does not need.
fn drain_unread(q: &mut ActivatedQueue, mem: &GuestMemory, name: &str) -> bool {
    let mut used = false;
    while let Some(chain) = q.queue.pop_descriptor_chain(mem) {
        add_used(q, mem, chain.head_index(), name);
        used = true;
    }
    used
}
