//! Snapshots of a microVM: what is captured, the file format, and taking one.
//! Restoring lives with the builder, which assembles VMs either way.

pub mod format;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::device_manager::legacy::LegacyState;
use crate::device_manager::mmio::MmioDeviceState;
use crate::vstate::memory::{MemorySnapshotKind, MemoryState};
use crate::vstate::vcpu_state::VcpuState;
use crate::vstate::vm::VmState;

/// Everything needed to rebuild a running microVM, except guest memory and
/// disk contents, which stay in their own files.
#[derive(Debug, Serialize, Deserialize)]
pub struct MicrovmState {
    /// The VMM version that wrote it, for messages.
    pub vmm_version: String,
    pub vcpu_count: u8,
    pub mem_size_mib: u64,
    pub memory: MemoryState,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    pub legacy: LegacyState,
    pub devices: Vec<MmioDeviceState>,
}

/// A request to snapshot a paused VM.
#[derive(Clone, Debug)]
pub struct SnapshotRequest {
    pub kind: MemorySnapshotKind,
    pub state_path: PathBuf,
    pub mem_path: PathBuf,
}

/// A request to fork a VM into `children` children.
#[derive(Clone, Debug)]
pub struct ForkRequest {
    pub state_path: PathBuf,
    pub mem_path: PathBuf,
    pub disk_dir: PathBuf,
    pub children: usize,
}

/// What a fork made: the VM's own new disks and each child's, and how long
/// the VM stood still.
#[derive(Clone, Debug)]
pub struct ForkOutcome {
    /// (drive id, layer) the forked VM writes to from now on.
    pub parent: Vec<(String, PathBuf)>,
    /// Per child: (drive id, layer) it loads with; none when
    /// `children_failed`.
    pub children: Vec<Vec<(String, PathBuf)>>,
    /// Why the children's layers or state could not be made after the VM
    /// resumed: the VM forked all the same (it is on `parent`), but no
    /// child can load, and nothing of theirs was left.
    pub children_failed: Option<String>,
    pub paused: Duration,
    pub memory_bytes: u64,
    /// Where `paused` went.
    pub steps: ForkSteps,
}

/// How long each step of a fork took, in the order they run: before the
/// freeze, while the VM stood still (`freeze` to `resume`), after it ran
/// again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForkSteps {
    /// Before the freeze: each writable disk's next layer made.
    pub disks_prepared: Duration,
    /// vCPUs parked, device threads held.
    pub freeze: Duration,
    /// vCPU, VM and device state read.
    pub state_saved: Duration,
    /// Guest memory written into the layer file.
    pub memory: Duration,
    /// Disks sealed and switched to their prepared layers.
    pub disks: Duration,
    /// Devices and vCPUs let go.
    pub resume: Duration,
    /// After the resume: each child's layers stacked on the sealed ones.
    pub children_disks: Duration,
    /// After the resume: the state file encoded and written.
    pub state_written: Duration,
}

/// What taking a snapshot did, for logs and benchmarks.
#[derive(Clone, Copy, Debug, Default)]
pub struct SnapshotStats {
    pub total: Duration,
    pub memory_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("the VM must be paused before a snapshot is taken")]
    NotPaused,
    #[error("{0}")]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    #[error("{0}")]
    Vm(#[from] crate::vstate::vm::VmError),
    #[error("{0}")]
    Devices(#[from] crate::device_manager::DeviceManagerError),
    #[error("{0}")]
    Memory(#[from] crate::vstate::memory::MemoryError),
    #[error("{0}")]
    Format(#[from] format::FormatError),
    /// It failed after the VM's memory moved onto the file it wrote (or
    /// while the VM resumed): the VM is not as it was, and the files it
    /// wrote are its own now.
    #[error("{0} (after the microVM's memory moved onto the new files: its state is in doubt)")]
    InDoubt(Box<SnapshotError>),
}

impl SnapshotError {
    /// Whether the VM changed before the failure ([`SnapshotError::InDoubt`]).
    pub fn in_doubt(&self) -> bool {
        matches!(self, SnapshotError::InDoubt(_))
    }

    pub(crate) fn into_in_doubt(self) -> SnapshotError {
        match self {
            SnapshotError::InDoubt(_) => self,
            e => SnapshotError::InDoubt(Box::new(e)),
        }
    }
}

/// Times a snapshot.
pub(crate) struct Stopwatch(Instant);

impl Stopwatch {
    pub fn start() -> Self {
        Stopwatch(Instant::now())
    }

    pub fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    pub fn stats(&self, memory_bytes: u64) -> SnapshotStats {
        SnapshotStats {
            total: self.0.elapsed(),
            memory_bytes,
        }
    }
}
