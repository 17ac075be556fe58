//! What the fuzz targets share: a cursor over the fuzzer's bytes, and split
//! virtqueues laid out in real guest memory from those bytes, the way a
//! (hostile) guest driver would lay them out.
//!
//! A queue's input is `[size_log2, flags, n_desc, n_desc × 16-byte
//! descriptors, n_avail, n_avail × le16 heads]`; the descriptors are written
//! raw into the descriptor table, so any address, length, flag and `next`
//! value reaches the device. [`QueueInput`] writes the same format, for the
//! seed corpora.

use std::sync::atomic::Ordering;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm::vstate::memory::GuestMemory;

/// Guest RAM of every device target: large enough for a few queues and
/// buffers, small enough to be cleared for each input.
pub const MEM_SIZE: u64 = 1 << 20;
/// Where queue `i`'s descriptor table starts: `QUEUE_BASE + i * QUEUE_STRIDE`;
/// its available ring is 4 KiB above it, its used ring 8 KiB above it.
pub const QUEUE_BASE: u64 = 0x1_0000;
pub const QUEUE_STRIDE: u64 = 0x4000;
/// Where the free-form bytes at the end of an input land (buffers).
pub const DATA_BASE: u64 = 0x4_0000;

/// Reads the fuzzer's bytes front to back; past the end every read is zero.
pub struct Cursor<'a> {
    data: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Cursor { data }
    }

    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        head
    }

    pub fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    pub fn u16(&mut self) -> u16 {
        let mut b = [0u8; 2];
        let got = self.bytes(2);
        b[..got.len()].copy_from_slice(got);
        u16::from_le_bytes(b)
    }

    pub fn u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        let got = self.bytes(4);
        b[..got.len()].copy_from_slice(got);
        u32::from_le_bytes(b)
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// Fresh, zeroed guest memory.
pub fn guest_memory() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).expect("guest memory")
}

/// Lays out queue `index` from the input (see the crate docs) with at most
/// `max_size` entries and returns it ready, as the transport would hand it to
/// the device. `event_idx` comes from the flags byte's bit 0.
pub fn queue_from(c: &mut Cursor<'_>, mem: &GuestMemory, index: u64, max_size: u16) -> Queue {
    let base = QUEUE_BASE + index * QUEUE_STRIDE;
    let (desc, avail, used) = (base, base + 0x1000, base + 0x2000);
    let size = (1u16 << (c.u8() % 9)).min(max_size);
    let flags = c.u8();
    let n_desc = usize::from(c.u8()).min(usize::from(size));
    let table = c.bytes(16 * n_desc);
    mem.write_slice(table, GuestAddress(desc))
        .expect("desc table");
    let n_avail = c.u8();
    for slot in 0..u16::from(n_avail) {
        let head = c.u16();
        let at = avail + 4 + 2 * u64::from(slot % size);
        mem.write_obj(head.to_le(), GuestAddress(at))
            .expect("avail ring");
    }
    // used_event, for event_idx: bit 1 picks "interrupt me at once".
    let used_event: u16 = if flags & 2 != 0 { 0 } else { u16::MAX };
    mem.write_obj(
        used_event.to_le(),
        GuestAddress(avail + 4 + 2 * u64::from(size)),
    )
    .expect("used_event");
    mem.store(
        u16::from(n_avail).to_le(),
        GuestAddress(avail + 2),
        Ordering::Release,
    )
    .expect("avail idx");

    let mut q = Queue::new(max_size).expect("queue");
    q.set_size(size);
    q.try_set_desc_table_address(GuestAddress(desc))
        .expect("desc address");
    q.try_set_avail_ring_address(GuestAddress(avail))
        .expect("avail address");
    q.try_set_used_ring_address(GuestAddress(used))
        .expect("used address");
    q.set_event_idx(flags & 1 != 0);
    q.set_ready(true);
    q
}

/// Copies what is left of the input into guest memory at [`DATA_BASE`].
pub fn fill_data(c: &mut Cursor<'_>, mem: &GuestMemory) {
    let rest = c.rest();
    let n = rest.len().min((MEM_SIZE - DATA_BASE) as usize);
    mem.write_slice(&rest[..n], GuestAddress(DATA_BASE))
        .expect("data");
}

/// One descriptor as a seed writes it.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;

/// The input bytes of one queue, for seeds.
#[derive(Clone, Debug, Default)]
pub struct QueueInput {
    pub size_log2: u8,
    pub flags: u8,
    pub descs: Vec<Desc>,
    pub heads: Vec<u16>,
}

impl QueueInput {
    /// A queue of 2^`size_log2` entries holding `chains`, each a list of
    /// `(addr, len, writable)` buffers linked in order.
    pub fn chains(size_log2: u8, chains: &[&[(u64, u32, bool)]]) -> QueueInput {
        let mut q = QueueInput {
            size_log2,
            ..Default::default()
        };
        for chain in chains {
            q.heads.push(q.descs.len() as u16);
            for (i, &(addr, len, writable)) in chain.iter().enumerate() {
                let index = q.descs.len() as u16;
                let mut flags = if writable { F_WRITE } else { 0 };
                if i + 1 < chain.len() {
                    flags |= F_NEXT;
                }
                q.descs.push(Desc {
                    addr,
                    len,
                    flags,
                    next: index + 1,
                });
            }
        }
        q
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        out.push(self.size_log2);
        out.push(self.flags);
        out.push(self.descs.len() as u8);
        for d in &self.descs {
            out.extend_from_slice(&d.addr.to_le_bytes());
            out.extend_from_slice(&d.len.to_le_bytes());
            out.extend_from_slice(&d.flags.to_le_bytes());
            out.extend_from_slice(&d.next.to_le_bytes());
        }
        out.push(self.heads.len() as u8);
        for h in &self.heads {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }
}

/// A device interrupt that only counts (the targets have no guest to tell).
#[derive(Default)]
pub struct NoInterrupt;

impl vmm::devices::virtio::VirtioInterrupt for NoInterrupt {
    fn trigger(&self, _kind: vmm::devices::virtio::VirtioInterruptType) -> std::io::Result<()> {
        Ok(())
    }
}

/// A private scratch directory for one fuzzing process (sockets, images),
/// under `$SANDFORK_FUZZ_TMP` (which scripts/fuzz.sh makes and removes: the
/// process exits without running destructors), else /dev/shm.
pub fn scratch_dir() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let base = std::env::var_os("SANDFORK_FUZZ_TMP").unwrap_or_else(|| "/dev/shm".into());
        tempfile::Builder::new()
            .prefix("sandfork-fuzz-")
            .tempdir_in(base)
            .or_else(|_| tempfile::tempdir())
            .expect("scratch dir")
    })
    .path()
}

/// Real devices behind a real MMIO transport, for the targets that need one.
pub mod devices {
    use std::os::unix::net::UnixDatagram;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use vmm::devices::virtio::VirtioDevice;
    use vmm::devices::virtio::block::{Block, BlockConfig};
    use vmm::devices::virtio::mmio::{MmioInterrupt, MmioTransport, MmioTransportState};
    use vmm::devices::virtio::net::{Net, NetConfig};
    use vmm::devices::virtio::vsock::Vsock;
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    use super::{guest_memory, scratch_dir};

    pub fn block() -> Box<dyn VirtioDevice> {
        let path = scratch_dir().join("mmio-block.img");
        if !path.exists() {
            std::fs::write(&path, vec![0u8; 64 * 512]).expect("image");
        }
        Box::new(
            Block::new(BlockConfig {
                id: "fuzz-drive".into(),
                path,
                read_only: false,
            })
            .expect("block device"),
        )
    }

    /// A net device whose backend is one end of a datagram pair (the other is dropped:
    /// frames the guest sends are refused, none arrive).
    pub fn net() -> Box<dyn VirtioDevice> {
        let (backend, _host) = UnixDatagram::pair().expect("socket pair");
        backend.set_nonblocking(true).expect("nonblocking");
        Box::new(Net::with_backend(
            NetConfig {
                iface_id: "eth0".into(),
                host_dev_name: "fuzz".into(),
                guest_mac: Some([2, 0, 0, 0, 0, 1]),
            },
            Box::new(backend),
        ))
    }

    /// A vsock device on a socket path of its own.
    pub fn vsock() -> Box<dyn VirtioDevice> {
        static N: AtomicU64 = AtomicU64::new(0);
        let path = scratch_dir().join(format!("v{}.sock", N.fetch_add(1, Ordering::Relaxed)));
        Box::new(Vsock::new(3, path).expect("vsock device"))
    }

    pub fn transport(device: Box<dyn VirtioDevice>) -> MmioTransport {
        let interrupt = Arc::new(MmioInterrupt::new(
            EventFd::new(EFD_NONBLOCK).expect("eventfd"),
        ));
        MmioTransport::new(device, guest_memory(), interrupt).expect("transport")
    }

    /// Restores a saved transport state onto a fresh device of each kind.
    pub fn restore_transport(state: &MmioTransportState) {
        for device in [block(), net(), vsock()] {
            let mut t = transport(device);
            let _ = t.restore(state);
        }
    }
}

/// What the seed corpora are made of (`make_seeds`).
pub mod seeds {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    use kvm_bindings::{kvm_cpuid_entry2, kvm_msr_entry, kvm_regs};
    use vmm::device_manager::legacy::LegacyState;
    use vmm::device_manager::mmio::{MmioDeviceState, MmioSlot};
    use vmm::devices::bus::BusDevice;
    use vmm::devices::legacy::EventFdTrigger;
    use vmm::devices::legacy::i8042::I8042Device;
    use vmm::devices::legacy::serial::{ConsoleOutput, SerialDevice};
    use vmm::devices::virtio::mmio::MmioTransport;
    use vmm::snapshot::MicrovmState;
    use vmm::vstate::memory::{MemoryLayer, MemoryState, RegionLayout};
    use vmm::vstate::vcpu_state::VcpuState;
    use vmm::vstate::vm::VmState;
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    use super::{QUEUE_BASE, QUEUE_STRIDE, devices};

    fn trigger() -> EventFdTrigger {
        EventFdTrigger(EventFd::new(EFD_NONBLOCK).expect("eventfd"))
    }

    /// A Linux driver's probe of a virtio-MMIO device: features (VERSION_1
    /// only), every queue at 16 entries in [`QUEUE_BASE`] + i × [`QUEUE_STRIDE`],
    /// then DRIVER_OK, which starts the device.
    pub fn probe(t: &mut MmioTransport, queues: u32) {
        let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
        for s in [0, 1, 3] {
            w(t, 0x70, s);
        }
        w(t, 0x24, 1);
        w(t, 0x20, 1);
        w(t, 0x70, 11);
        for q in 0..queues {
            let base = QUEUE_BASE + u64::from(q) * QUEUE_STRIDE;
            w(t, 0x30, q);
            w(t, 0x38, 16);
            w(t, 0x80, base as u32);
            w(t, 0x90, (base + 0x1000) as u32);
            w(t, 0xa0, (base + 0x2000) as u32);
            w(t, 0x44, 1);
        }
        w(t, 0x70, 15);
    }

    /// A state as a one-vCPU VM with a drive, a network interface and vsock
    /// saves it: devices probed and started for real, then paused and saved
    /// through their own snapshot code; the KVM parts (which need a VM) at
    /// their defaults with a few registers set.
    pub fn microvm_state() -> MicrovmState {
        let serial = SerialDevice::new(
            trigger(),
            ConsoleOutput::new(Box::new(std::io::sink()), Arc::new(AtomicBool::new(false))),
        )
        .state();
        let i8042 = I8042Device::new(trigger(), Box::new(|| {})).state();
        let mut saved = Vec::new();
        for (i, (device, queues)) in [
            (devices::block(), 1),
            (devices::net(), 2),
            (devices::vsock(), 3),
        ]
        .into_iter()
        .enumerate()
        {
            let mut t = devices::transport(device);
            probe(&mut t, queues);
            t.pause_device();
            saved.push(MmioDeviceState {
                slot: MmioSlot {
                    base: 0xd000_0000 + 0x1000 * i as u64,
                    irq: 5 + i as u32,
                },
                config: t.device().snapshot().expect("device state"),
                transport: t.state(),
            });
        }
        MicrovmState {
            vmm_version: "0.1.0".into(),
            vcpu_count: 1,
            mem_size_mib: 256,
            memory: MemoryState {
                regions: vec![RegionLayout {
                    guest_addr: 0,
                    len: 256 << 20,
                    file_offset: 0,
                }],
                layers: vec![
                    MemoryLayer {
                        path: "vm.mem".into(),
                        ranges: None,
                    },
                    MemoryLayer {
                        path: "vm.mem.1".into(),
                        ranges: Some(vec![(0x1000, 0x3000)]),
                    },
                ],
            },
            vm: VmState {
                pic_master: Default::default(),
                pic_slave: Default::default(),
                ioapic: Default::default(),
                pit: Default::default(),
                clock: Default::default(),
            },
            vcpus: vec![VcpuState {
                cpuid: vec![kvm_cpuid_entry2 {
                    function: 0,
                    eax: 0xd,
                    ebx: 0x6874_7541,
                    ..Default::default()
                }],
                msrs: vec![kvm_msr_entry {
                    index: 0x10,
                    data: 123_456_789,
                    ..Default::default()
                }],
                regs: kvm_regs {
                    rip: 0x100_0000,
                    rflags: 2,
                    ..Default::default()
                },
                sregs: Default::default(),
                xsave: Default::default(),
                xcrs: Default::default(),
                lapic: Default::default(),
                mp_state: Default::default(),
                events: Default::default(),
                debug_regs: Default::default(),
                tsc_khz: Some(2_000_000),
            }],
            legacy: LegacyState { serial, i8042 },
            devices: saved,
        }
    }
}

/// The disk_layer target's directory: a raw base image and a sealed layer
/// over it, made by the real code, which fuzzed layers name as parents.
pub mod layers {
    use std::path::{Path, PathBuf};

    pub const BASE_LEN: usize = 16 << 10;

    /// Makes `dir/base.img` and `dir/sealed.sfl` (a sealed layer over it) if
    /// missing; returns the path of `dir/child.sfl`, a layer over the sealed one.
    pub fn fixture(dir: &Path) -> PathBuf {
        let base = dir.join("base.img");
        let child = dir.join("child.sfl");
        if child.exists() {
            return child;
        }
        std::fs::create_dir_all(dir).expect("layer dir");
        std::fs::write(&base, vec![0xab; BASE_LEN]).expect("base image");
        let sealed = dir.join("sealed.sfl");
        let disk = disk_layers::LayeredDisk::create_with_cluster_size(&base, &sealed, 4096)
            .expect("layered disk");
        disk.write_at(&[1; 4096], 8192).expect("write");
        disk.seal_and_branch(&child, &[]).expect("seal");
        child
    }
}
