//! E2B's volumes: `POST /volumes` ([`NewVolume`]), the answers [`Volume`]
//! (`GET /volumes`) and [`VolumeAndToken`] (a create, `GET /volumes/{id}`),
//! and a sandbox create's `volumeMounts` ([`SandboxVolumeMount`]).

use serde::{Deserialize, Serialize};

/// `POST /volumes`: E2B's `NewVolume` (a name), and sandfork's size.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewVolume {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Sandfork's: the disk's size in MiB (E2B has none: its volumes are
    /// network filesystems). Absent: the node's default.
    #[serde(default, rename = "sizeMB", skip_serializing_if = "Option::is_none")]
    pub size_mb: Option<u64>,
}

/// E2B's `Volume`, with sandfork's size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
    #[serde(rename = "sizeMB")]
    pub size_mb: u64,
}

/// E2B's `VolumeAndToken`: a [`Volume`] and the token of E2B's volume
/// content API (`/volumecontent/...`, which this node does not serve yet).
/// `domain` is E2B's for a team on its own cluster, never sent here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeAndToken {
    #[serde(flatten)]
    pub volume: Volume,
    pub token: String,
}

/// E2B's `SandboxVolumeMount`, an item of a create's `volumeMounts` (the
/// SDKs send a volume by its name) and of a detail's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxVolumeMount {
    /// The volume's name, in the caller's team.
    pub name: String,
    /// Where the guest mounts it (absolute).
    pub path: String,
}
