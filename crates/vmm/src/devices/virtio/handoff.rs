//! Device status writes handed from the vCPU that made them to the
//! controller (main) thread.
//!
//! A STATUS write that activates a device starts its worker: new
//! descriptors and a new thread, which inherits its parent's seccomp filter.
//! A reset stops the worker and may reconfigure the device's host side (a
//! tap's offloads). Neither belongs on a vCPU thread under the vCPU filter,
//! which allows little more than KVM's ioctls. So the transport queues such a
//! write, [`DeviceHandoff`] wakes the controller, which applies it, and the
//! vCPU that wrote it waits before it runs the guest again: to the guest the
//! write has completed by its next instruction, as when it was applied on
//! the vCPU. Other vCPUs meanwhile read the registers as they were before
//! the write, as of a write still on its way, and their own register writes
//! to that device queue up behind it, so the device sees them in order.
//!
//! No deadlock with a controller that waits for a vCPU: every wait of the
//! controller for a vCPU thread (pause, state, report, stop) runs the
//! handed-off work while it waits.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use super::mmio::MmioTransport;

/// After this long a waiting vCPU says so in the log (once per wait).
const SLOW_HANDOFF: Duration = Duration::from_secs(5);

/// The VM's queue of handed-off device register writes.
pub struct DeviceHandoff {
    state: Mutex<HandoffState>,
    done: Condvar,
    /// Wakes the controller's loop to call [`run`](Self::run).
    wake: Box<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for DeviceHandoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceHandoff")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct HandoffState {
    /// Every transport, by the index it was registered under.
    transports: Vec<Weak<Mutex<MmioTransport>>>,
    /// Transports with queued writes, by index (may repeat).
    pending: Vec<usize>,
    /// Requests made, and requests known applied: a vCPU waits until the
    /// second reaches what the first was when it asked.
    requested: u64,
    completed: u64,
}

impl DeviceHandoff {
    pub fn new(wake: Box<dyn Fn() + Send + Sync>) -> Arc<Self> {
        Arc::new(DeviceHandoff {
            state: Mutex::new(HandoffState::default()),
            done: Condvar::new(),
            wake,
        })
    }

    /// A handoff nobody runs but tests and callers that run it themselves.
    pub fn unattended() -> Arc<Self> {
        Self::new(Box::new(|| {}))
    }

    fn lock(&self) -> MutexGuard<'_, HandoffState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a transport; the index names it in [`request`](Self::request).
    pub(crate) fn register(&self, transport: &Arc<Mutex<MmioTransport>>) -> usize {
        let mut state = self.lock();
        state.transports.push(Arc::downgrade(transport));
        state.transports.len() - 1
    }

    /// Called by transport `index`, locked, after it queued a write.
    pub(crate) fn request(&self, index: usize) {
        {
            let mut state = self.lock();
            state.pending.push(index);
            state.requested += 1;
        }
        (self.wake)();
    }

    /// Whether writes are queued that [`run`](Self::run) has not applied.
    pub fn busy(&self) -> bool {
        let state = self.lock();
        state.completed < state.requested
    }

    /// Applies every queued write (on the controller thread). Cheap when
    /// nothing is queued.
    pub fn run(&self) {
        let (requested, transports) = {
            let mut state = self.lock();
            if state.pending.is_empty() {
                return;
            }
            let pending = std::mem::take(&mut state.pending);
            let transports: Vec<_> = pending
                .iter()
                .filter_map(|&i| state.transports.get(i).cloned())
                .collect();
            (state.requested, transports)
        };
        // A transport named twice applies its queue the first time. Not under our lock: a transport is locked before this queue.
        for transport in transports.iter().filter_map(Weak::upgrade) {
            transport
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .apply_handed_off();
        }
        let mut state = self.lock();
        state.completed = state.completed.max(requested);
        self.done.notify_all();
    }

    /// Blocks the calling vCPU until every write queued so far is applied.
    /// Returns at once when none is queued (after most MMIO writes).
    pub fn wait(&self) {
        let mut state = self.lock();
        let target = state.requested;
        let started = Instant::now();
        let mut warned = false;
        while state.completed < target {
            state = self
                .done
                .wait_timeout(state, Duration::from_millis(500))
                .unwrap_or_else(|e| e.into_inner())
                .0;
            if !warned && started.elapsed() > SLOW_HANDOFF {
                warned = true;
                crate::warn_limited!(
                    "a vCPU has waited {:?} for the controller to apply a device status write",
                    started.elapsed()
                );
            }
        }
    }
}
