//! Returning several receive chains to the guest at once.
//!
//! With mergeable buffers one frame fills several chains, and the driver reads
//! `num_buffers` from the first and takes the rest from the used ring at once: if
//! it saw the first before the others (virtio-queue's `add_used` publishes the used
//! index per chain), it would drop the frame as "buffers missing". So the RX path
//! writes the used elements first and publishes the index once, and keeps its own
//! count of what it added since the last interrupt for the event-index check.

use std::num::Wrapping;
use std::sync::atomic::{Ordering, fence};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::vstate::memory::GuestMemory;

/// `flags` and `idx` before the used ring's elements; `flags`, `idx` before the
/// available ring's (split virtqueue layout, virtio 1.x 2.7).
const RING_HEADER: u64 = 4;
const USED_ELEM: u64 = 8;
const AVAIL_ELEM: u64 = 2;

#[derive(Debug)]
pub struct UsedBatch {
    /// Chains published since the guest was last interrupted.
    added: Wrapping<u16>,
}

impl UsedBatch {
    pub fn new() -> UsedBatch {
        UsedBatch { added: Wrapping(0) }
    }

    /// Writes one used element per `(head, len)` and then the used index once.
    pub fn publish(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemory,
        used: &[(u16, u32)],
    ) -> Result<(), vm_memory::GuestMemoryError> {
        let size = queue.size();
        let ring = GuestAddress(queue.used_ring());
        let mut next = Wrapping(queue.next_used());
        for &(head, len) in used {
            let slot = u64::from(next.0 % size);
            let at = ring.unchecked_add(RING_HEADER + slot * USED_ELEM);
            mem.write_obj(u32::from(head).to_le(), at)?;
            mem.write_obj(len.to_le(), at.unchecked_add(4))?;
            next += Wrapping(1);
        }
        queue.set_next_used(next.0);
        // The elements before the index that makes them the driver's.
        mem.store(next.0.to_le(), ring.unchecked_add(2), Ordering::Release)?;
        self.added += Wrapping(used.len() as u16);
        Ok(())
    }

    /// Whether the guest wants an interrupt for what was published since the
    /// last one (virtio-queue's `needs_notification`, on this count).
    pub fn needs_interrupt(&mut self, queue: &Queue, mem: &GuestMemory) -> bool {
        let added = std::mem::replace(&mut self.added, Wrapping(0));
        if added.0 == 0 {
            return false;
        }
        if !queue.event_idx_enabled() {
            return true;
        }
        // The used index written before the driver's used_event is read.
        fence(Ordering::SeqCst);
        let at = GuestAddress(queue.avail_ring())
            .unchecked_add(RING_HEADER + u64::from(queue.size()) * AVAIL_ELEM);
        let Ok(used_event) = mem.load::<u16>(at, Ordering::Acquire) else {
            // When in doubt, interrupt.
            return true;
        };
        let used_event = Wrapping(u16::from_le(used_event));
        let new = Wrapping(queue.next_used());
        let old = new - added;
        // vring_need_event: the driver asked to hear once the index passes used_event.
        new - used_event - Wrapping(1) < new - old
    }
}
