//! `PUT /fork`: sandfork's extension that turns one running VM into many.
//!
//! The VMM freezes the VM's memory into a layer file (only the pages written
//! since its last snapshot or fork; everything the first time a booted VM is
//! forked), writes the VM state next to it, seals every layered disk and stacks
//! a fresh writable layer on it for the VM itself and for each child, and lets
//! the VM go on. Each child is then a `PUT /snapshot/load` of that state in a
//! fresh VMM process, with the child's own disk layers and vsock socket.

use serde::{Deserialize, Serialize};

use crate::validation::{ValidationError, validate_path};

/// The most children one fork makes.
pub const MAX_FORK_CHILDREN: u32 = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkParams {
    /// Where the VM state for the children is written.
    pub snapshot_path: String,
    /// Where the frozen memory layer is written (a tmpfs keeps forks fast).
    pub mem_file_path: String,
    /// Where the new disk layers go: `<drive_id>.<n>.layer`, n = 0 for this VM.
    pub disk_dir: String,
    pub children: u32,
}

impl ForkParams {
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_path("snapshot_path", &self.snapshot_path)?;
        validate_path("mem_file_path", &self.mem_file_path)?;
        validate_path("disk_dir", &self.disk_dir)?;
        if self.snapshot_path == self.mem_file_path {
            return Err(ValidationError::new(
                "snapshot_path and mem_file_path must be different files",
            ));
        }
        if self.children == 0 || self.children > MAX_FORK_CHILDREN {
            return Err(ValidationError::new(format!(
                "children must be between 1 and {MAX_FORK_CHILDREN}"
            )));
        }
        Ok(())
    }
}

/// A disk a child (or a restored VM) uses instead of the snapshot's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriveOverride {
    pub drive_id: String,
    pub path_on_host: String,
    /// sandfork extension: reopen this drive read-only whatever the snapshot
    /// says (a snapshot's writable spare drive left unused, a volume shared
    /// read-only); writes then fail in the guest. False keeps the snapshot's.
    #[serde(default, skip_serializing_if = "is_false")]
    pub read_only: bool,
}

impl DriveOverride {
    /// Drive `drive_id` on `path`, as writable as the snapshot had it.
    pub fn new(drive_id: impl Into<String>, path_on_host: impl Into<String>) -> DriveOverride {
        DriveOverride {
            drive_id: drive_id.into(),
            path_on_host: path_on_host.into(),
            read_only: false,
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The answer to `PUT /fork`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkInfo {
    pub snapshot_path: String,
    pub mem_file_path: String,
    /// The disks the forked VM itself writes to from now on (its old layers
    /// are sealed under every child): the caller records these, never
    /// re-derives their names.
    pub parent: Vec<DriveOverride>,
    /// Per child, in order: the disks to load it with (none when
    /// `children_failed`).
    pub children: Vec<Vec<DriveOverride>>,
    /// Why no child can load: the children's layers and the state file are
    /// made after the VM resumed, and they could not be. The VM forked all
    /// the same (it writes to `parent` now); nothing of the children's was
    /// left behind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub children_failed: Option<String>,
    /// How long the VM was stopped, in microseconds.
    pub paused_us: u64,
    /// Where the fork's time went, step by step (absent from a VMM that
    /// does not report it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<ForkPhases>,
}

/// The steps of one `PUT /fork`, in microseconds, in the order they run:
/// `disks_prepared_us` before the VM stops; `freeze_us` to `resume_us`
/// while it stands still (together they make up `paused_us` but for the
/// bookkeeping between them); `children_disks_us` and `state_written_us`
/// after it runs again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPhases {
    /// Before the freeze: each writable disk's next layer made (the one the
    /// VM continues in).
    #[serde(default)]
    pub disks_prepared_us: u64,
    /// Every vCPU parked and the devices' threads held still.
    pub freeze_us: u64,
    /// The vCPUs', the VM's and the devices' state read.
    pub state_saved_us: u64,
    /// Guest memory frozen into the layer file (only pages written since
    /// the last snapshot or fork, after the first).
    pub memory_us: u64,
    /// Bytes of memory written for it.
    pub memory_bytes: u64,
    /// Every writable disk sealed and switched to its prepared layer.
    pub disks_us: u64,
    /// The devices and the vCPUs let go again.
    pub resume_us: u64,
    /// After the resume: each child's layers stacked on the sealed ones.
    #[serde(default)]
    pub children_disks_us: u64,
    /// After the resume: the state file encoded and written.
    pub state_written_us: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(children: u32) -> ForkParams {
        ForkParams {
            snapshot_path: "/f/state".into(),
            mem_file_path: "/f/mem".into(),
            disk_dir: "/f".into(),
            children,
        }
    }

    #[test]
    fn child_count_is_bounded() {
        params(1).validate().unwrap();
        params(MAX_FORK_CHILDREN).validate().unwrap();
        assert!(params(0).validate().is_err());
        assert!(params(MAX_FORK_CHILDREN + 1).validate().is_err());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_str::<ForkParams>(
            r#"{"snapshot_path":"/a","mem_file_path":"/b","disk_dir":"/c","children":2,"x":1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `x`"), "{err}");
    }

    /// An answer from a VMM that reports no phases still reads, and one
    /// that does keeps them.
    #[test]
    fn phases_are_optional_in_the_answer() {
        let old = r#"{"snapshot_path":"/s","mem_file_path":"/m","parent":[],"children":[[]],"paused_us":7}"#;
        let info: ForkInfo = serde_json::from_str(old).unwrap();
        assert_eq!((info.paused_us, info.phases), (7, None));
        assert_eq!(info.children_failed, None);
        // Phases from a VMM that made every layer inside the pause.
        let before: ForkPhases = serde_json::from_str(
            r#"{"freeze_us":1,"state_saved_us":2,"memory_us":3,"memory_bytes":4,"disks_us":5,"state_written_us":6,"resume_us":7}"#,
        )
        .unwrap();
        assert_eq!((before.disks_prepared_us, before.children_disks_us), (0, 0));
        let phases = ForkPhases {
            disks_prepared_us: 2,
            freeze_us: 1,
            memory_us: 3,
            memory_bytes: 4096,
            children_disks_us: 5,
            ..ForkPhases::default()
        };
        let back: ForkInfo = serde_json::from_str(
            &serde_json::to_string(&ForkInfo {
                phases: Some(phases),
                ..info
            })
            .unwrap(),
        )
        .unwrap();
        assert_eq!(back.phases, Some(phases));
    }
}
