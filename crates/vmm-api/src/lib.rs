//! Firecracker-compatible API types, the action interface between sandfork's API server
//! and its VMM controller, and a client that drives sandfork's VMM or a real Firecracker
//! over the API socket.
//!
//! JSON field names follow Firecracker's API exactly. Request bodies reject unknown
//! fields, as Firecracker does; fields Firecracker accepts but sandfork does not
//! implement are parsed and then refused (or ignored where harmless) by each type's
//! `validate`, so the message names the field.

mod action;
pub mod agent_client;
mod boot_source;
mod client;
mod drive;
mod error;
mod fork;
#[cfg(test)]
mod hostile_guest;
mod instance_info;
mod machine_config;
mod network_interface;
pub mod process;
mod snapshot;
mod validation;
mod vcpus;
mod vm_config;
mod vm_state;
mod vmm_action;
mod vsock;
pub mod vsock_connect;

pub use action::{ActionType, InstanceActionInfo};
pub use boot_source::BootSource;
pub use client::{ClientError, RawResponse, VmmClient};
pub use drive::{CacheType, Drive, IoEngine, PartialDrive};
pub use error::ApiError;
pub use fork::{DriveOverride, ForkInfo, ForkParams, MAX_FORK_CHILDREN};
pub use instance_info::{InstanceInfo, InstanceState};
pub use machine_config::{
    CpuTemplate, DEFAULT_MEM_SIZE_MIB, HugePages, MAX_MEM_SIZE_MIB, MAX_VCPUS, MachineConfig,
    MachineConfigUpdate,
};
pub use network_interface::{NetworkInterface, parse_mac};
pub use snapshot::{
    MemBackend, MemBackendType, NetworkOverride, SnapshotCreateParams, SnapshotLoadParams,
    SnapshotType, VsockOverride,
};
pub use validation::{ValidationError, validate_resource_id};
pub use vcpus::{VcpuPhase, VcpuReport};
pub use vm_config::VmConfig;
pub use vm_state::{Vm, VmState};
pub use vmm_action::{VmmAction, VmmActionError, VmmData, VmmErrorKind};
pub use vsock::Vsock;

/// Re-exported so callers of [`VmmClient::request`] need not depend on hyper.
pub use hyper::Method;
