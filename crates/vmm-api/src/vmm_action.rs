//! The interface between the API server and the VMM controller: one action per request,
//! answered with data or an error.

use crate::balloon::{Balloon, BalloonStats, BalloonStatsUpdate, BalloonUpdate};
use crate::boot_source::BootSource;
use crate::devices::DeviceReport;
use crate::drive::{Drive, PartialDrive};
use crate::fork::{ForkInfo, ForkParams};
use crate::instance_info::InstanceInfo;
use crate::machine_config::{MachineConfig, MachineConfigUpdate};
use crate::network_interface::NetworkInterface;
use crate::snapshot::{SnapshotCreateParams, SnapshotLoadParams};
use crate::validation::ValidationError;
use crate::vcpus::VcpuReport;
use crate::vm_config::VmConfig;
use crate::vsock::Vsock;

/// What the API asks the VMM to do. Bodies arrive already parsed and checked with their
/// `validate` method; checks that depend on VM state (pre-boot only, file exists, ...)
/// are the controller's.
#[derive(Debug, Clone, PartialEq)]
pub enum VmmAction {
    /// `GET /`
    GetInstanceInfo,
    /// `GET /machine-config`
    GetMachineConfig,
    /// `GET /vm/config`
    GetVmConfig,
    /// `PUT /machine-config`
    PutMachineConfig(MachineConfig),
    /// `PATCH /machine-config`; the controller applies it with [`MachineConfig::patched`].
    PatchMachineConfig(MachineConfigUpdate),
    /// `PUT /boot-source`
    PutBootSource(BootSource),
    /// `PUT /drives/{drive_id}` (path id already checked to equal `drive_id`)
    PutDrive(Drive),
    /// `PATCH /drives/{drive_id}`
    PatchDrive(PartialDrive),
    /// `PUT /vsock`
    PutVsock(Vsock),
    /// `PUT /network-interfaces/{iface_id}` (path id already checked to equal `iface_id`)
    PutNetworkInterface(NetworkInterface),
    /// `PUT /actions` `InstanceStart`
    InstanceStart,
    /// `PUT /actions` `SendCtrlAltDel`
    SendCtrlAltDel,
    /// `PUT /actions` `FlushMetrics`
    FlushMetrics,
    /// `PATCH /vm` `Paused`
    Pause,
    /// `PATCH /vm` `Resumed`
    Resume,
    /// `PUT /snapshot/create`
    CreateSnapshot(SnapshotCreateParams),
    /// `PUT /snapshot/load`
    LoadSnapshot(SnapshotLoadParams),
    /// `PUT /fork` (sandfork extension)
    Fork(ForkParams),
    /// `GET /vcpus` (sandfork extension)
    GetVcpus,
    /// `GET /devices` (sandfork extension)
    GetDevices,
    /// `PUT /balloon` (before boot)
    PutBalloon(Balloon),
    /// `GET /balloon`
    GetBalloon,
    /// `PATCH /balloon`: a new target (after boot)
    PatchBalloon(BalloonUpdate),
    /// `GET /balloon/statistics`
    GetBalloonStats,
    /// `PATCH /balloon/statistics`
    PatchBalloonStats(BalloonStatsUpdate),
}

/// A successful answer. `Empty` becomes `204 No Content`, the others `200` with JSON.
#[derive(Debug, Clone, PartialEq)]
pub enum VmmData {
    Empty,
    InstanceInfo(InstanceInfo),
    MachineConfig(MachineConfig),
    VmConfig(Box<VmConfig>),
    Fork(ForkInfo),
    Vcpus(Vec<VcpuReport>),
    Devices(Vec<DeviceReport>),
    Balloon(Balloon),
    BalloonStats(Box<BalloonStats>),
}

/// How a failed action maps onto HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmErrorKind {
    /// The request is wrong for the input or the VM's state: `400`, as Firecracker answers.
    BadRequest,
    /// The VMM failed on a valid request (I/O error, KVM error, controller gone): `500`.
    Internal,
}

impl VmmErrorKind {
    pub fn status_code(self) -> u16 {
        match self {
            Self::BadRequest => 400,
            Self::Internal => 500,
        }
    }
}

/// A failed action; `message` becomes the response's `fault_message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct VmmActionError {
    pub kind: VmmErrorKind,
    pub message: String,
}

impl VmmActionError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            kind: VmmErrorKind::BadRequest,
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            kind: VmmErrorKind::Internal,
            message: message.into(),
        }
    }

    pub fn status_code(&self) -> u16 {
        self.kind.status_code()
    }
}

impl From<ValidationError> for VmmActionError {
    fn from(e: ValidationError) -> Self {
        Self::bad_request(e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_kinds() {
        let e: VmmActionError = ValidationError::new("bad vcpu").into();
        assert_eq!((e.status_code(), e.to_string().as_str()), (400, "bad vcpu"));
        assert_eq!(VmmActionError::internal("kvm").status_code(), 500);
    }
}
