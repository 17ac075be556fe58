//! `PUT /snapshot/create` and `PUT /snapshot/load`.

use serde::{Deserialize, Serialize};

use crate::fork::DriveOverride;
use crate::network_interface::validate_host_dev_name;
use crate::validation::{ValidationError, validate_path, validate_resource_id};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotType {
    #[default]
    Full,
    /// Only the pages dirtied since the last snapshot (needs `track_dirty_pages`).
    Diff,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreateParams {
    #[serde(default)]
    pub snapshot_type: SnapshotType,
    /// Where the VM state (vCPUs, devices) is written.
    pub snapshot_path: String,
    /// Where guest memory is written.
    pub mem_file_path: String,
}

impl SnapshotCreateParams {
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_path("snapshot_path", &self.snapshot_path)?;
        validate_path("mem_file_path", &self.mem_file_path)?;
        if self.snapshot_path == self.mem_file_path {
            return Err(ValidationError::new(
                "snapshot_path and mem_file_path must be different files",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemBackendType {
    /// `backend_path` is the memory file written by snapshot create.
    File,
    /// `backend_path` is a Unix socket of a userfaultfd page-fault handler.
    Uffd,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemBackend {
    pub backend_type: MemBackendType,
    pub backend_path: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkOverride {
    pub iface_id: String,
    pub host_dev_name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockOverride {
    pub uds_path: String,
}

/// Optional flags are skipped on the wire when false or empty, so the body is accepted by
/// Firecracker versions that predate them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotLoadParams {
    pub snapshot_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_backend: Option<MemBackend>,
    /// Deprecated form of `mem_backend` with `backend_type: File`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_file_path: Option<String>,
    /// Deprecated alias of `track_dirty_pages`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub enable_diff_snapshots: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub track_dirty_pages: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub resume_vm: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_overrides: Vec<NetworkOverride>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_override: Option<VsockOverride>,
    /// sandfork extension: disks to use instead of the snapshot's, by drive id
    /// (a fork child's own disk layers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drive_overrides: Vec<DriveOverride>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub clock_realtime: bool,
    /// sandfork extension: a working-set file ([`WorkingSet`]) populated in
    /// the background after the load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch_path: Option<String>,
}

/// A working-set file (`prefetch_path`): `[start, end)` flat memory ranges
/// a restore populates. Written as an object; a plain array of ranges (the
/// first format) is read as `present` alone.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "WorkingSetFile")]
pub struct WorkingSet {
    /// Every page the recorded sandbox had mapped: populated for reading.
    pub present: Vec<(u64, u64)>,
    /// Those it wrote: populated for writing (copied at once), since a page
    /// populated for reading still faults when the guest first writes it.
    #[serde(default)]
    pub written: Vec<(u64, u64)>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WorkingSetFile {
    Ranges(Vec<(u64, u64)>),
    Split {
        present: Vec<(u64, u64)>,
        #[serde(default)]
        written: Vec<(u64, u64)>,
    },
}

impl From<WorkingSetFile> for WorkingSet {
    fn from(file: WorkingSetFile) -> Self {
        match file {
            WorkingSetFile::Ranges(present) => WorkingSet {
                present,
                written: Vec::new(),
            },
            WorkingSetFile::Split { present, written } => WorkingSet { present, written },
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl SnapshotLoadParams {
    /// A load from a memory file, in the current (`mem_backend`) form.
    pub fn from_file(
        snapshot_path: impl Into<String>,
        mem_file_path: impl Into<String>,
        resume_vm: bool,
    ) -> Self {
        Self {
            snapshot_path: snapshot_path.into(),
            mem_backend: Some(MemBackend {
                backend_type: MemBackendType::File,
                backend_path: mem_file_path.into(),
            }),
            mem_file_path: None,
            enable_diff_snapshots: false,
            track_dirty_pages: false,
            resume_vm,
            network_overrides: Vec::new(),
            vsock_override: None,
            drive_overrides: Vec::new(),
            clock_realtime: false,
            prefetch_path: None,
        }
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_path("snapshot_path", &self.snapshot_path)?;
        match (&self.mem_backend, &self.mem_file_path) {
            (Some(_), Some(_)) => {
                return Err(ValidationError::new(
                    "give either mem_backend or mem_file_path, not both",
                ));
            }
            (None, None) => {
                return Err(ValidationError::new(
                    "one of mem_backend or mem_file_path is required",
                ));
            }
            (Some(b), None) => validate_path("mem_backend.backend_path", &b.backend_path)?,
            (None, Some(p)) => validate_path("mem_file_path", p)?,
        }
        if let Some(p) = &self.prefetch_path {
            validate_path("prefetch_path", p)?;
        }
        for (i, o) in self.network_overrides.iter().enumerate() {
            validate_resource_id("network_overrides.iface_id", &o.iface_id)?;
            validate_host_dev_name("network_overrides.host_dev_name", &o.host_dev_name)?;
            if self.network_overrides[..i]
                .iter()
                .any(|p| p.iface_id == o.iface_id)
            {
                return Err(ValidationError::new(format!(
                    "network_overrides: {} is named twice",
                    o.iface_id
                )));
            }
        }
        if let Some(v) = &self.vsock_override {
            validate_path("vsock_override.uds_path", &v.uds_path)?;
        }
        for d in &self.drive_overrides {
            validate_resource_id("drive_overrides.drive_id", &d.drive_id)?;
            validate_path("drive_overrides.path_on_host", &d.path_on_host)?;
        }
        Ok(())
    }

    /// The memory source, with the deprecated `mem_file_path` form folded in.
    /// `None` only when [`validate`](Self::validate) would fail.
    pub fn memory_backend(&self) -> Option<MemBackend> {
        self.mem_backend.clone().or_else(|| {
            self.mem_file_path.as_ref().map(|p| MemBackend {
                backend_type: MemBackendType::File,
                backend_path: p.clone(),
            })
        })
    }

    /// Whether dirty-page tracking is requested, by either spelling.
    pub fn dirty_tracking(&self) -> bool {
        self.track_dirty_pages || self.enable_diff_snapshots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn working_sets_are_read_in_both_formats() {
        let old: WorkingSet = serde_json::from_str("[[0, 4096], [8192, 16384]]").unwrap();
        assert_eq!(old.present, vec![(0, 4096), (8192, 16384)]);
        assert!(old.written.is_empty());
        let set = WorkingSet {
            present: vec![(0, 8192)],
            written: vec![(4096, 8192)],
        };
        let text = serde_json::to_string(&set).unwrap();
        assert_eq!(serde_json::from_str::<WorkingSet>(&text).unwrap(), set);
        assert!(serde_json::from_str::<WorkingSet>(r#"{"written": []}"#).is_err());
    }

    #[test]
    fn create_params() {
        let p: SnapshotCreateParams = serde_json::from_str(
            r#"{"snapshot_type": "Diff", "snapshot_path": "/s/vm.state", "mem_file_path": "/s/vm.mem"}"#,
        )
        .unwrap();
        assert_eq!(p.snapshot_type, SnapshotType::Diff);
        p.validate().unwrap();
        let p: SnapshotCreateParams =
            serde_json::from_str(r#"{"snapshot_path": "/a", "mem_file_path": "/b"}"#).unwrap();
        assert_eq!(p.snapshot_type, SnapshotType::Full);
        let err = serde_json::from_str::<SnapshotCreateParams>(
            r#"{"snapshot_path": "/a", "mem_file_path": "/b", "version": "1.0"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `version`"), "{err}");
        let same = SnapshotCreateParams {
            snapshot_type: SnapshotType::Full,
            snapshot_path: "/a".into(),
            mem_file_path: "/a".into(),
        };
        assert!(same.validate().is_err());
    }

    #[test]
    fn load_params_both_forms() {
        let p: SnapshotLoadParams = serde_json::from_str(
            r#"{"snapshot_path": "/s", "mem_backend": {"backend_type": "Uffd", "backend_path": "/uffd.sock"},
                "enable_diff_snapshots": true, "resume_vm": true}"#,
        )
        .unwrap();
        p.validate().unwrap();
        assert_eq!(
            p.memory_backend().unwrap().backend_type,
            MemBackendType::Uffd
        );
        assert!(p.dirty_tracking() && p.resume_vm);

        let p: SnapshotLoadParams =
            serde_json::from_str(r#"{"snapshot_path": "/s", "mem_file_path": "/m"}"#).unwrap();
        p.validate().unwrap();
        assert_eq!(
            p.memory_backend(),
            Some(MemBackend {
                backend_type: MemBackendType::File,
                backend_path: "/m".into()
            })
        );
        assert!(!p.dirty_tracking() && !p.resume_vm);

        let p: SnapshotLoadParams = serde_json::from_str(
            r#"{"snapshot_path": "/s", "mem_file_path": "/m", "track_dirty_pages": true, "clock_realtime": true,
                "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap1"}],
                "vsock_override": {"uds_path": "/v.sock"}}"#,
        )
        .unwrap();
        p.validate().unwrap();
        assert!(p.dirty_tracking() && p.clock_realtime);
    }

    #[test]
    fn load_params_rejections() {
        let both: SnapshotLoadParams = serde_json::from_str(
            r#"{"snapshot_path": "/s", "mem_file_path": "/m", "mem_backend": {"backend_type": "File", "backend_path": "/m"}}"#,
        )
        .unwrap();
        assert!(
            both.validate()
                .unwrap_err()
                .to_string()
                .contains("not both")
        );
        let none: SnapshotLoadParams = serde_json::from_str(r#"{"snapshot_path": "/s"}"#).unwrap();
        assert!(
            none.validate()
                .unwrap_err()
                .to_string()
                .contains("required")
        );
        assert!(
            serde_json::from_str::<SnapshotLoadParams>(
                r#"{"snapshot_path": "/s", "mem_file_path": "/m", "x": 1}"#
            )
            .is_err()
        );
        assert!(serde_json::from_str::<SnapshotLoadParams>(
            r#"{"snapshot_path": "/s", "mem_backend": {"backend_type": "Tmpfs", "backend_path": "/m"}}"#
        )
        .is_err());
        let mut p = SnapshotLoadParams::from_file("/s", "/m", false);
        let over = |iface: &str, tap: &str| NetworkOverride {
            iface_id: iface.into(),
            host_dev_name: tap.into(),
        };
        p.network_overrides = vec![over("eth0", "tap1"), over("eth0", "tap2")];
        assert!(p.validate().unwrap_err().to_string().contains("twice"));
        p.network_overrides = vec![over("eth0", "tap/1")];
        assert!(
            p.validate()
                .unwrap_err()
                .to_string()
                .contains("host_dev_name")
        );
    }

    #[test]
    fn load_params_wire_form_is_minimal() {
        let p = SnapshotLoadParams::from_file("/s", "/m", true);
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            serde_json::json!({
                "snapshot_path": "/s",
                "mem_backend": {"backend_type": "File", "backend_path": "/m"},
                "resume_vm": true
            })
        );
    }
}
