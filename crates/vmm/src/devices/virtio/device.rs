//! The contract between a virtio device model and its transport.
//!
//! The transport (virtio-mmio here) owns the guest-visible registers; a device
//! owns its configuration space and, once the driver sets DRIVER_OK, a worker
//! thread that services its queues. Queue notifications arrive on one `EventFd`
//! per queue (a KVM ioeventfd), and the device raises interrupts through
//! [`VirtioInterrupt`], so neither side blocks a vCPU.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueState};
use vmm_sys_util::eventfd::EventFd;

use super::persist::SavedDevice;
use crate::vstate::memory::GuestMemory;

/// Copies `data.len()` bytes of a configuration space from `offset`; bytes
/// past its end (or an offset no slice can reach) read as 0, as the virtio
/// spec has a driver see fields of features not offered.
pub fn read_config_space(space: &[u8], offset: u64, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = offset
            .checked_add(i as u64)
            .and_then(|at| usize::try_from(at).ok())
            .and_then(|at| space.get(at).copied())
            .unwrap_or(0);
    }
}

/// Whether the driver's available index is within reach: at most the queue
/// size ahead of the device's. One further ahead is a broken or hostile
/// driver; virtio-queue then hands out no chain at all, while
/// `enable_notification` keeps answering that chains are pending, so a
/// device that retried on that answer would spin for ever. Devices check
/// this before retrying, and wait for the next notification instead.
pub fn avail_ring_in_reach(queue: &mut Queue, mem: &GuestMemory, device: &str) -> bool {
    match queue.iter(mem) {
        Ok(_) => true,
        Err(e) => {
            crate::warn_limited!("{device}: the driver's available ring is unusable: {e}");
            false
        }
    }
}

/// The reason a device raises its interrupt line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VirtioInterruptType {
    /// The device used buffers in one of its queues.
    Queue,
    /// The device changed its configuration space.
    Config,
}

/// Raises a device's interrupt in the guest.
pub trait VirtioInterrupt: Send + Sync {
    fn trigger(&self, kind: VirtioInterruptType) -> std::io::Result<()>;
}

/// A queue handed to a device when the driver activates it.
#[derive(Debug)]
pub struct ActivatedQueue {
    pub queue: Queue,
    /// Signalled when the driver writes this queue's index to QueueNotify.
    pub notify: EventFd,
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("the driver configured {got} queues, the device needs {expected}")]
    QueueCount { expected: usize, got: usize },
    #[error("could not start the device worker: {0}")]
    Worker(#[source] std::io::Error),
    #[error("device activation failed: {0}")]
    Other(String),
}

/// A drive's layers for a fork, made before the VM stops: the one it
/// continues in after the seal, and the paths its children's will have.
#[derive(Debug)]
pub struct PreparedBranch {
    pub drive_id: String,
    pub next: disk_layers::Continuation,
    /// One path per child, in order; nothing is made there yet.
    pub children: Vec<PathBuf>,
}

/// The disk layers a fork made for one drive: while the VM stood still its
/// top was sealed and it moved to `parent`; the children's layers are
/// stacked on `sealed` after it runs again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskBranch {
    pub drive_id: String,
    /// The layer the VM itself writes to from now on.
    pub parent: PathBuf,
    /// The layer sealed at the fork, which every child stacks on.
    pub sealed: disk_layers::SealedLayer,
    /// One writable layer per child, in order (made by
    /// [`disk_layers::SealedLayer::stack`]).
    pub children: Vec<PathBuf>,
}

/// A virtio device model, independent of its transport.
pub trait VirtioDevice: Send {
    /// The virtio device ID (`virtio_bindings::virtio_ids::VIRTIO_ID_*`).
    fn device_type(&self) -> u32;

    /// The maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];

    /// Feature bits the device offers, including `VIRTIO_F_VERSION_1`.
    fn avail_features(&self) -> u64;

    /// The subset of features the driver accepted, before activation.
    fn set_acked_features(&mut self, acked: u64);

    /// Reads from the device configuration space; bytes past its end read as 0.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Writes to the device configuration space; most devices ignore this.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    /// Starts servicing the queues. Called once, when the driver sets DRIVER_OK.
    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError>;

    /// Stops the worker and returns the device to its pre-activation state, so the
    /// driver can set it up again. Returns false if the device cannot be reset.
    fn reset(&mut self) -> bool {
        false
    }

    /// The features the driver accepted.
    fn acked_features(&self) -> u64;

    /// The queues' state while the device is active (empty otherwise). Read
    /// it paused, or it may change under the reader.
    fn queue_states(&self) -> Vec<QueueState> {
        Vec::new()
    }

    /// What a snapshot saves to recreate this device on restore (see its
    /// `persist.rs`); `None` if it cannot be snapshotted.
    fn snapshot(&self) -> Option<SavedDevice> {
        None
    }

    /// Parks the worker between requests, so neither guest memory nor the
    /// queues change; connections and open files are kept. No-op if inactive.
    fn pause(&mut self) {}

    /// For a fork, while the VM still runs: a writable disk makes the layer
    /// it continues in after the seal under `dir`, and names one per child
    /// there (made later). Devices without a writable disk answer `None`.
    fn prepare_branch(
        &self,
        _dir: &Path,
        _children: usize,
    ) -> Result<Option<PreparedBranch>, String> {
        Ok(None)
    }

    /// For a fork, with the device paused: seals the disk and continues in
    /// the layer [`VirtioDevice::prepare_branch`] made. No file is made.
    fn switch_disk(&mut self, prepared: PreparedBranch) -> Result<DiskBranch, String> {
        Err(format!(
            "device {} has no disk to branch",
            prepared.drive_id
        ))
    }

    /// Called once the VM it belongs to was restored from a snapshot.
    fn on_restored(&self) {}

    /// A disk's drive ID and the file it reads and writes now (its top
    /// layer, which a fork or snapshot moves on); `None` for other devices.
    fn drive(&self) -> Option<vmm_api::DriveReport> {
        None
    }

    /// Restarts a worker parked by `pause`.
    fn resume(&mut self) -> Result<(), ActivateError> {
        Ok(())
    }

    /// The device as its own type, for the VMM parts that drive one kind
    /// (the API's balloon handle).
    fn as_any(&self) -> &dyn Any;
}

/// An interrupt line nobody listens to, for worker tests that only look at
/// the rings.
#[cfg(test)]
#[derive(Debug)]
pub struct NoIrq;

#[cfg(test)]
impl VirtioInterrupt for NoIrq {
    fn trigger(&self, _kind: VirtioInterruptType) -> std::io::Result<()> {
        Ok(())
    }
}
