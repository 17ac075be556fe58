//! A small guest-side virtio driver for the tests: split queues laid out in real guest
//! memory and filled the way a guest driver fills them.

use std::collections::HashMap;
use std::sync::atomic::{Ordering, fence};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::vstate::memory::GuestMemory;

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;

pub struct GuestQueue {
    mem: GuestMemory,
    size: u16,
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    free: Vec<u16>,
    chains: HashMap<u16, Vec<u16>>,
    avail_idx: u16,
    used_seen: u16,
}

impl GuestQueue {
    pub fn new(mem: &GuestMemory, base: u64, size: u16) -> Self {
        let n = u64::from(size);
        let desc = base;
        let avail = desc + 16 * n;
        let used = (avail + 6 + 2 * n + 3) & !3;
        let end = used + 6 + 8 * n;
        mem.write_slice(&vec![0u8; (end - base) as usize], GuestAddress(base))
            .unwrap();
        Self {
            mem: mem.clone(),
            size,
            desc: GuestAddress(desc),
            avail: GuestAddress(avail),
            used: GuestAddress(used),
            free: (0..size).rev().collect(),
            chains: HashMap::new(),
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// The device-side view, as the transport would configure it.
    pub fn device_queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.set_size(self.size);
        let split = |a: GuestAddress| (Some(a.0 as u32), Some((a.0 >> 32) as u32));
        let (lo, hi) = split(self.desc);
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(self.avail);
        q.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(self.used);
        q.set_used_ring_address(lo, hi);
        q.set_ready(true);
        assert!(q.is_valid(&self.mem));
        q
    }

    /// Makes a chain of `(address, length, device-writable)` buffers available.
    pub fn add(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        assert!(self.free.len() >= bufs.len(), "guest queue full");
        let ids: Vec<u16> = (0..bufs.len()).map(|_| self.free.pop().unwrap()).collect();
        for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
            let mut flags = if writable { DESC_F_WRITE } else { 0 };
            let mut next = 0;
            if let Some(&n) = ids.get(i + 1) {
                flags |= DESC_F_NEXT;
                next = n;
            }
            let at = self.desc.0 + 16 * u64::from(ids[i]);
            self.mem.write_obj(addr.to_le(), GuestAddress(at)).unwrap();
            self.mem
                .write_obj(len.to_le(), GuestAddress(at + 8))
                .unwrap();
            self.mem
                .write_obj(flags.to_le(), GuestAddress(at + 12))
                .unwrap();
            self.mem
                .write_obj(next.to_le(), GuestAddress(at + 14))
                .unwrap();
        }
        let head = ids[0];
        let slot = self.avail.0 + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.mem
            .write_obj(head.to_le(), GuestAddress(slot))
            .unwrap();
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx.to_le(), GuestAddress(self.avail.0 + 2))
            .unwrap();
        fence(Ordering::SeqCst);
        self.chains.insert(head, ids);
        head
    }

    /// Publishes `idx` as the available index without adding chains, as a
    /// broken or hostile driver may.
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.mem
            .write_obj(idx.to_le(), GuestAddress(self.avail.0 + 2))
            .unwrap();
        fence(Ordering::SeqCst);
    }

    /// Where the used ring starts in guest memory.
    pub fn used_ring(&self) -> u64 {
        self.used.0
    }

    /// VIRTIO_RING_F_EVENT_IDX: interrupt me once the used index passes `idx`.
    pub fn set_used_event(&mut self, idx: u16) {
        let at = self.avail.0 + 4 + 2 * u64::from(self.size);
        self.mem.write_obj(idx.to_le(), GuestAddress(at)).unwrap();
        fence(Ordering::SeqCst);
    }

    /// The next used chain: its head and the length the device wrote.
    pub fn pop_used(&mut self) -> Option<(u16, u32)> {
        fence(Ordering::SeqCst);
        let idx = u16::from_le(self.mem.read_obj(GuestAddress(self.used.0 + 2)).unwrap());
        if idx == self.used_seen {
            return None;
        }
        fence(Ordering::SeqCst);
        let at = self.used.0 + 4 + 8 * u64::from(self.used_seen % self.size);
        let id = u32::from_le(self.mem.read_obj(GuestAddress(at)).unwrap()) as u16;
        let len = u32::from_le(self.mem.read_obj(GuestAddress(at + 4)).unwrap());
        self.used_seen = self.used_seen.wrapping_add(1);
        let ids = self
            .chains
            .remove(&id)
            .expect("device used an unknown chain");
        self.free.extend(ids);
        Some((id, len))
    }
}
