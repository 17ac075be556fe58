//! A virtqueue as a snapshot restores it (sandfork's `QueueSnapshot`, any
//! addresses, sizes and indices) over guest memory the guest filled: every
//! chain popped and walked, its buffers read and written, returned used, and
//! the notification checks a device makes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::{Cursor, MEM_SIZE, guest_memory};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm::devices::virtio::persist::QueueSnapshot;

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let flags = c.u8();
    // Ring addresses mostly inside guest memory, where chains can be found;
    // sometimes raw.
    let addr = |c: &mut Cursor<'_>| {
        let a = c.u64();
        if flags & 0x80 != 0 { a } else { a % MEM_SIZE }
    };
    let snap = QueueSnapshot {
        max_size: 256,
        next_avail: c.u16(),
        next_used: c.u16(),
        event_idx_enabled: flags & 1 != 0,
        size: c.u16(),
        ready: flags & 2 == 0,
        desc_table: addr(&mut c),
        avail_ring: addr(&mut c),
        used_ring: addr(&mut c),
    };
    let mem = guest_memory();
    let rest = c.rest();
    let n = rest.len().min(MEM_SIZE as usize);
    mem.write_slice(&rest[..n], GuestAddress(0))
        .expect("memory");

    let Ok(mut queue) = Queue::try_from(QueueState::from(&snap)) else {
        return;
    };
    if !queue.is_valid(&mem) {
        return;
    }
    let mut buf = [0u8; 64];
    for _ in 0..512 {
        let Some(chain) = queue.pop_descriptor_chain(&mem) else {
            break;
        };
        let head = chain.head_index();
        let mut written = 0u32;
        for desc in chain {
            let n = (desc.len() as usize).min(buf.len());
            if desc.is_write_only() {
                if mem.write_slice(&buf[..n], desc.addr()).is_ok() {
                    written = written.saturating_add(n as u32);
                }
            } else {
                let _ = mem.read_slice(&mut buf[..n], desc.addr());
            }
        }
        let _ = queue.add_used(&mem, head, written);
    }
    let _ = queue.needs_notification(&mem);
    let _ = queue.enable_notification(&mem);
    let _ = QueueSnapshot::from(queue.state());
});
