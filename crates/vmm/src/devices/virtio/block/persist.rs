//! What a snapshot saves of a drive, and the drive it restores.
//!
//! Its activity (features, queue) is the transport's part of the snapshot;
//! here is what reopens the backing file.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::device::{Block, BlockConfig};
use super::disk::BlockError;
use crate::devices::virtio::persist::DeviceOverrides;

/// A drive in a snapshot. The field order is the snapshot file's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedBlock {
    pub id: String,
    pub path: PathBuf,
    pub read_only: bool,
}

impl Block {
    /// What a snapshot records to reopen this drive.
    pub fn save(&self) -> SavedBlock {
        SavedBlock {
            id: self.id().to_owned(),
            path: self.path().to_owned(),
            read_only: self.read_only(),
        }
    }
}

impl SavedBlock {
    /// Reopens the drive, at the restore's path for it if it has one, and
    /// read-only if it was or the restore says so. A guest that saw the
    /// drive writable keeps thinking so; its writes fail.
    pub fn restore(&self, overrides: &DeviceOverrides) -> Result<Block, BlockError> {
        let at = overrides.drive_paths.iter().find(|d| d.id == self.id);
        Block::new(BlockConfig {
            id: self.id.clone(),
            path: at.map_or_else(|| self.path.clone(), |d| d.path.clone()),
            read_only: self.read_only || at.is_some_and(|d| d.read_only),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::path::Path;

    use super::*;
    use crate::devices::virtio::persist::DriveAt;
    use crate::devices::virtio::persist::SavedDevice;

    #[test]
    fn restore_reopens_the_drive_at_its_override() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[0u8; 4096]).unwrap();
        let saved = SavedBlock {
            id: "disk0".into(),
            path: "/no/such/disk".into(),
            read_only: true,
        };
        let overrides = DeviceOverrides {
            drive_paths: vec![
                at("other", Path::new("/no/such/other"), false),
                at("disk0", f.path(), false),
            ],
            ..DeviceOverrides::default()
        };
        let block = saved.restore(&overrides).unwrap();
        assert_eq!(block.path(), f.path());
        assert_eq!(
            block.save(),
            SavedBlock {
                path: f.path().to_owned(),
                ..saved.clone()
            }
        );

        let err = SavedDevice::Block(saved)
            .restore(&DeviceOverrides::default())
            .err()
            .unwrap();
        assert!(err.to_string().starts_with("drive disk0: "), "{err}");
    }

    fn at(id: &str, path: &Path, read_only: bool) -> DriveAt {
        DriveAt {
            id: id.into(),
            path: path.to_owned(),
            read_only,
        }
    }

    #[test]
    fn a_restore_may_make_a_writable_drive_read_only_never_the_reverse() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[0u8; 4096]).unwrap();
        let saved = |read_only| SavedBlock {
            id: "vol0".into(),
            path: "/no/such/placeholder".into(),
            read_only,
        };
        let restored = |saved: SavedBlock, read_only| {
            let overrides = DeviceOverrides {
                drive_paths: vec![at("vol0", f.path(), read_only)],
                ..DeviceOverrides::default()
            };
            saved.restore(&overrides).unwrap().read_only()
        };
        assert!(!restored(saved(false), false));
        assert!(restored(saved(false), true));
        assert!(restored(saved(true), false));
    }
}
