//! A minimal virtio driver for tests: a split queue laid out in real guest memory,
//! filled and read the way a guest kernel does.

use std::sync::atomic::Ordering;

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::vstate::memory::GuestMemory;

/// One descriptor as the driver sees it.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub writable: bool,
}

impl Desc {
    /// A buffer the device reads.
    pub fn r(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            writable: false,
        }
    }

    /// A buffer the device writes.
    pub fn w(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            writable: true,
        }
    }
}

pub struct Driver {
    pub mem: GuestMemory,
    next_desc: u16,
    avail_idx: u16,
}

impl Driver {
    pub const QUEUE_SIZE: u16 = 256;
    pub const MEM_SIZE: u64 = 0x40_0000;
    const DESC_TABLE: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;

    pub fn new() -> Driver {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), Self::MEM_SIZE as usize)]).unwrap();
        Driver {
            mem,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// The queue as the transport would hand it over after the driver set it up.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(Self::QUEUE_SIZE).unwrap();
        q.set_size(Self::QUEUE_SIZE);
        q.try_set_desc_table_address(GuestAddress(Self::DESC_TABLE))
            .unwrap();
        q.try_set_avail_ring_address(GuestAddress(Self::AVAIL))
            .unwrap();
        q.try_set_used_ring_address(GuestAddress(Self::USED))
            .unwrap();
        q.set_ready(true);
        assert!(q.is_valid(&self.mem));
        q
    }

    /// Writes a chain into the descriptor table and publishes it in the available
    /// ring; returns its head index.
    pub fn add_chain(&mut self, descs: &[Desc]) -> u16 {
        let head = self.next_desc;
        for (i, d) in descs.iter().enumerate() {
            let index = self.next_desc;
            self.next_desc = (self.next_desc + 1) % Self::QUEUE_SIZE;
            let mut flags = if d.writable { VRING_DESC_F_WRITE } else { 0 } as u16;
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let at = Self::DESC_TABLE + 16 * u64::from(index);
            self.mem
                .write_obj(d.addr.to_le(), GuestAddress(at))
                .unwrap();
            self.mem
                .write_obj(d.len.to_le(), GuestAddress(at + 8))
                .unwrap();
            self.mem
                .write_obj(flags.to_le(), GuestAddress(at + 12))
                .unwrap();
            self.mem
                .write_obj(self.next_desc.to_le(), GuestAddress(at + 14))
                .unwrap();
        }
        let slot = self.avail_idx % Self::QUEUE_SIZE;
        self.mem
            .write_obj(
                head.to_le(),
                GuestAddress(Self::AVAIL + 4 + 2 * u64::from(slot)),
            )
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        // Publish the ring entry before the index, as a driver's barrier does.
        self.mem
            .store(
                self.avail_idx.to_le(),
                GuestAddress(Self::AVAIL + 2),
                Ordering::Release,
            )
            .unwrap();
        head
    }

    /// Publishes `idx` as the available index without adding chains, as a
    /// broken or hostile driver may.
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.mem
            .store(
                idx.to_le(),
                GuestAddress(Self::AVAIL + 2),
                Ordering::Release,
            )
            .unwrap();
    }

    /// How many used entries the device has published.
    pub fn used_idx(&self) -> u16 {
        u16::from_le(
            self.mem
                .load(GuestAddress(Self::USED + 2), Ordering::Acquire)
                .unwrap(),
        )
    }

    /// The used entry at position `n`: (head index, bytes written).
    pub fn used_elem(&self, n: u16) -> (u32, u32) {
        let at = Self::USED + 4 + 8 * u64::from(n % Self::QUEUE_SIZE);
        let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
        (u32::from_le(id), u32::from_le(len))
    }

    /// Sets `used_event` (VIRTIO_RING_F_EVENT_IDX): interrupt me once the used
    /// index passes `idx`.
    pub fn set_used_event(&self, idx: u16) {
        let at = Self::AVAIL + 4 + 2 * u64::from(Self::QUEUE_SIZE);
        self.mem
            .store(idx.to_le(), GuestAddress(at), Ordering::Release)
            .unwrap();
    }

    /// Writes a virtio-blk request header.
    pub fn write_header(&self, addr: u64, request_type: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&request_type.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(addr)).unwrap();
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    pub fn write(&self, addr: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
    }
}
