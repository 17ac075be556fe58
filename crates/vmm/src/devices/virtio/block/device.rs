//! The virtio-blk device model: features, configuration space, activation.

use std::mem::offset_of;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX,
    virtio_blk_config,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueState, QueueT};

use super::disk::{BlockError, Disk, SECTOR_SIZE};
use super::worker::{self, Worker};
use crate::devices::virtio::persist::SavedDevice;
use crate::devices::virtio::worker::{StopSignal, WorkerThread};
use crate::devices::virtio::{
    ActivateError, ActivatedQueue, DiskBranch, PreparedBranch, VirtioDevice, VirtioInterrupt,
    read_config_space,
};
use crate::vstate::memory::GuestMemory;

/// Size of the one request queue.
pub const QUEUE_SIZE: u16 = 256;
const QUEUE_SIZES: [u16; 1] = [QUEUE_SIZE];

/// Segments per request the driver may use: the queue minus header and status.
const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;

const CAPACITY_AT: usize = offset_of!(virtio_blk_config, capacity);
const SEG_MAX_AT: usize = offset_of!(virtio_blk_config, seg_max);
const BLK_SIZE_AT: usize = offset_of!(virtio_blk_config, blk_size);

/// The configuration space we expose: `struct virtio_blk_config` up to and including
/// `blk_size`. Fields after it belong to features we do not offer and read as 0.
pub const CONFIG_SPACE_LEN: usize = BLK_SIZE_AT + 4;

/// What a drive is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockConfig {
    /// The drive's name; also its GET_ID answer (first 20 bytes) and thread name.
    pub id: String,
    /// A raw image file or a host block device.
    pub path: PathBuf,
    pub read_only: bool,
}

/// What a snapshot needs of the device besides its disk contents. The queue is
/// present while the device is active.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockState {
    pub avail_features: u64,
    pub acked_features: u64,
    pub queue: Option<QueueState>,
}

/// A virtio-blk device with one request queue.
#[derive(Debug)]
pub struct Block {
    config: BlockConfig,
    disk: Arc<Disk>,
    avail_features: u64,
    acked_features: u64,
    config_space: [u8; CONFIG_SPACE_LEN],
    /// Shared with the worker while active, so the queue state stays readable.
    queue: Option<Arc<Mutex<Queue>>>,
    worker: Option<WorkerThread<Worker>>,
}

impl Block {
    /// Opens the drive's backing file. Its capacity is its size in whole 512-byte
    /// sectors: a size that is not a multiple of 512 is rounded down.
    pub fn new(config: BlockConfig) -> Result<Block, BlockError> {
        let disk = Disk::open(&config.path, config.read_only)?;

        let mut avail_features = (1u64 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE);
        if config.read_only {
            avail_features |= 1 << VIRTIO_BLK_F_RO;
        }

        let mut config_space = [0u8; CONFIG_SPACE_LEN];
        config_space[CAPACITY_AT..CAPACITY_AT + 8].copy_from_slice(&disk.capacity().to_le_bytes());
        config_space[SEG_MAX_AT..SEG_MAX_AT + 4].copy_from_slice(&SEG_MAX.to_le_bytes());
        // SECTOR_SIZE is 512 and fits in u32.
        config_space[BLK_SIZE_AT..BLK_SIZE_AT + 4]
            .copy_from_slice(&(SECTOR_SIZE as u32).to_le_bytes());

        Ok(Block {
            config,
            disk: Arc::new(disk),
            avail_features,
            acked_features: 0,
            config_space,
            queue: None,
            worker: None,
        })
    }

    pub fn id(&self) -> &str {
        &self.config.id
    }

    pub fn path(&self) -> &Path {
        &self.config.path
    }

    pub fn read_only(&self) -> bool {
        self.config.read_only
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.disk.capacity()
    }

    pub fn is_activated(&self) -> bool {
        self.worker.as_ref().is_some_and(WorkerThread::is_alive)
    }

    fn worker_name(&self) -> String {
        format!("blk-{}", self.config.id)
    }

    /// The device state a snapshot records. Read it with the vCPUs paused: the
    /// worker may otherwise be between requests.
    pub fn state(&self) -> BlockState {
        BlockState {
            avail_features: self.avail_features,
            acked_features: self.acked_features,
            queue: self
                .queue
                .as_ref()
                .map(|q| q.lock().unwrap_or_else(|e| e.into_inner()).state()),
        }
    }

    fn stop_worker(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.stop();
        }
        self.queue = None;
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn set_acked_features(&mut self, acked: u64) {
        // A driver cannot accept what was not offered.
        self.acked_features = acked & self.avail_features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config_space, offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        mut queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        if self.is_activated() {
            return Err(ActivateError::Other(format!(
                "block device {} is already active",
                self.config.id
            )));
        }
        let got = queues.len();
        let ActivatedQueue { mut queue, notify } = match (queues.pop(), queues.is_empty()) {
            (Some(q), true) => q,
            _ => {
                return Err(ActivateError::QueueCount {
                    expected: QUEUE_SIZES.len(),
                    got,
                });
            }
        };
        if !queue.is_valid(&mem) {
            return Err(ActivateError::Other(format!(
                "block device {}: the request queue does not fit in guest memory",
                self.config.id
            )));
        }
        queue.set_event_idx(self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0);

        let queue = Arc::new(Mutex::new(queue));
        let stop = StopSignal::new().map_err(ActivateError::Worker)?;
        let worker = Worker::new(
            self.disk.clone(),
            worker::drive_id(&self.config.id),
            mem,
            queue.clone(),
            notify,
            interrupt,
            &stop,
        )
        .map_err(ActivateError::Worker)?;
        let thread =
            WorkerThread::spawn(self.worker_name(), stop, worker).map_err(ActivateError::Worker)?;
        self.queue = Some(queue);
        self.worker = Some(thread);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.stop_worker();
        self.acked_features = 0;
        true
    }

    fn acked_features(&self) -> u64 {
        self.acked_features
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.state().queue.into_iter().collect()
    }

    fn prepare_branch(
        &self,
        dir: &Path,
        children: usize,
    ) -> Result<Option<PreparedBranch>, String> {
        if self.config.read_only {
            return Ok(None);
        }
        if !self.disk.is_layered() {
            return Err(BlockError::NotLayered(self.config.id.clone()).to_string());
        }
        let layer = |n: usize| dir.join(format!("{}.{n}.layer", self.config.id));
        let next = self
            .disk
            .prepare_continuation(&layer(0))
            .map_err(|e| e.to_string())?;
        Ok(Some(PreparedBranch {
            drive_id: self.config.id.clone(),
            next,
            children: (1..=children).map(layer).collect(),
        }))
    }

    fn switch_disk(&mut self, prepared: PreparedBranch) -> Result<DiskBranch, String> {
        let PreparedBranch {
            drive_id,
            next,
            children,
        } = prepared;
        if drive_id != self.config.id {
            return Err(format!(
                "a layer prepared for drive {drive_id} offered to drive {}",
                self.config.id
            ));
        }
        let parent = next.path().to_owned();
        let sealed = self.disk.switch(next).map_err(|e| e.to_string())?;
        self.config.path = parent.clone();
        // Forks of forks stack layers; keep this disk's chain short.
        drop(self.disk.compact_in_background());
        Ok(DiskBranch {
            drive_id,
            parent,
            sealed,
            children,
        })
    }

    fn snapshot(&self) -> Option<SavedDevice> {
        Some(SavedDevice::Block(Block::save(self)))
    }

    fn pause(&mut self) {
        if let Some(worker) = &mut self.worker {
            worker.park();
        }
        // A snapshot taken now must find on disk every write the guest saw
        // complete (a layered disk records its new clusters only on flush),
        // or a restore would pair memory with an older disk.
        if !self.config.read_only
            && let Err(e) = self.disk.flush()
        {
            tracing::warn!("flushing drive {} at pause: {e}", self.config.id);
        }
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        if let Some(worker) = &mut self.worker {
            worker.unpark().map_err(ActivateError::Worker)?;
        }
        Ok(())
    }

    fn drive(&self) -> Option<vmm_api::DriveReport> {
        Some(vmm_api::DriveReport {
            drive_id: self.config.id.clone(),
            path_on_host: self.config.path.display().to_string(),
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn block(size: usize, read_only: bool) -> (tempfile::NamedTempFile, Block) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&vec![0u8; size]).unwrap();
        let b = Block::new(BlockConfig {
            id: "disk0".into(),
            path: f.path().to_owned(),
            read_only,
        })
        .unwrap();
        (f, b)
    }

    fn config_u32(b: &Block, at: u64) -> u32 {
        let mut v = [0u8; 4];
        b.read_config(at, &mut v);
        u32::from_le_bytes(v)
    }

    #[test]
    fn config_space_follows_virtio_blk_config() {
        let (_f, b) = block(1024 * 1024 + 100, false);
        assert_eq!(b.device_type(), 2);
        let mut cap = [0u8; 8];
        b.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 2048);
        assert_eq!(b.capacity(), 2048);
        // The high half of the capacity, read on its own as a 32-bit driver does.
        assert_eq!(config_u32(&b, 4), 0);
        assert_eq!(config_u32(&b, 0), 2048);
        assert_eq!(config_u32(&b, 12), 254);
        assert_eq!(config_u32(&b, 20), 512);
        // size_max and geometry are not offered.
        assert_eq!(config_u32(&b, 8), 0);
        assert_eq!(config_u32(&b, 16), 0);
    }

    #[test]
    fn config_space_past_its_end_reads_zero() {
        let (_f, b) = block(4096, false);
        let mut v = [0xffu8; 8];
        b.read_config(20, &mut v);
        assert_eq!(v, [0, 2, 0, 0, 0, 0, 0, 0]);
        let mut v = [0xffu8; 4];
        b.read_config(u64::MAX - 1, &mut v);
        assert_eq!(v, [0; 4]);
    }

    #[test]
    fn config_space_ignores_writes() {
        let (_f, mut b) = block(4096, false);
        b.write_config(0, &[0xff; 8]);
        assert_eq!(config_u32(&b, 0), 8);
    }

    #[test]
    fn features_depend_on_read_only() {
        let (_f, rw) = block(4096, false);
        let (_g, ro) = block(4096, true);
        for b in [&rw, &ro] {
            let f = b.avail_features();
            assert_ne!(f & (1 << VIRTIO_F_VERSION_1), 0);
            assert_ne!(f & (1 << VIRTIO_BLK_F_FLUSH), 0);
            assert_ne!(f & (1 << VIRTIO_BLK_F_SEG_MAX), 0);
            assert_ne!(f & (1 << VIRTIO_BLK_F_BLK_SIZE), 0);
        }
        assert_eq!(rw.avail_features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(ro.avail_features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert!(ro.read_only());
        assert!(!rw.read_only());
    }

    #[test]
    fn acked_features_are_limited_to_the_offer() {
        let (_f, mut b) = block(4096, false);
        b.set_acked_features(u64::MAX);
        assert_eq!(b.state().acked_features, b.avail_features());
        assert!(b.reset());
        assert_eq!(b.state().acked_features, 0);
    }

    #[test]
    fn accessors_report_the_config() {
        let (f, b) = block(4096, true);
        assert_eq!(b.id(), "disk0");
        assert_eq!(b.path(), f.path());
        assert_eq!(b.queue_max_sizes(), &[256]);
        assert!(!b.is_activated());
        assert_eq!(b.state().queue, None);
    }
}
