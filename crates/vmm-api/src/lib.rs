//! Firecracker-compatible API types and the action interface between sandfork's API
//! server and its VMM controller: what the VMM needs. The host side (a client, a VMM
//! process, vsock, the guest agent's client) is `vmm_driver`.
//!
//! JSON field names follow Firecracker's API exactly. Request bodies reject unknown
//! fields, as Firecracker does; fields Firecracker accepts but sandfork does not
//! implement are parsed and then refused (or ignored where harmless) by each type's
//! `validate`, so the message names the field.

mod action;
mod balloon;
mod boot_source;
mod devices;
mod drive;
mod error;
mod fork;
mod instance_info;
mod machine_config;
mod network_interface;
mod snapshot;
mod validation;
mod vcpus;
mod vm_config;
mod vm_state;
mod vmm_action;
mod vsock;

pub use action::{ActionType, InstanceActionInfo};
pub use balloon::{Balloon, BalloonStats, BalloonStatsUpdate, BalloonUpdate};
pub use boot_source::BootSource;
pub use devices::{DeviceReport, DriveReport, QueueReport};
pub use drive::{CacheType, Drive, IoEngine, PartialDrive};
pub use error::ApiError;
pub use fork::{DriveOverride, ForkInfo, ForkParams, ForkPhases, MAX_FORK_CHILDREN};
pub use instance_info::{InstanceInfo, InstanceState};
pub use machine_config::{
    CpuTemplate, DEFAULT_MEM_SIZE_MIB, HugePages, MAX_MEM_SIZE_MIB, MAX_VCPUS, MachineConfig,
    MachineConfigUpdate,
};
pub use network_interface::{NetworkInterface, parse_mac};
pub use snapshot::{
    MemBackend, MemBackendType, NetworkOverride, SnapshotCreateParams, SnapshotLoadParams,
    SnapshotType, VsockOverride, WorkingSet,
};
pub use validation::{ValidationError, validate_resource_id};
pub use vcpus::{VcpuPhase, VcpuReport};
pub use vm_config::VmConfig;
pub use vm_state::{Vm, VmState};
pub use vmm_action::{VmmAction, VmmActionError, VmmData, VmmErrorKind};
pub use vsock::Vsock;
