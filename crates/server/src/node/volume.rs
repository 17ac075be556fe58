//! Volumes' disks, and the spare drives they reach a sandbox through.
//!
//! A sandbox is a restore of its template's snapshot, whose device set is
//! fixed, and the guest kernel has no hot-plug for virtio-mmio. So every
//! template is booted with [`SLOTS`] spare drives (`vol0`, `vol1`, ...), all
//! on one sparse placeholder of [`SLOT_BYTES`] that nothing writes; a restore
//! points a slot at a volume's disk (the VMM reopens it there) and restores
//! every unused slot read-only, so no guest writes the shared placeholder.
//! The guest keeps the capacity it saw at the template's boot: a volume's
//! disk may be smaller than the slot, since its filesystem never reaches
//! past its own end.
//!
//! A volume's disk is layered ([`disk_layers`]): a sparse ext4 image made
//! on the host as its base, and a writable layer on it. A fork seals it and
//! gives the parent and each child a layer of its own, as for the root disk.
//!
//! A volume is a team's: its record ([`VolumeRecord`], in the node's store)
//! names its directory under the node's `volumes/` (see
//! [`Config::volumes_dir`](crate::node::config::Config::volumes_dir)), where
//! its disk is. The manager's `create_volume`, `volumes`, `volume` and
//! `delete_volume` (in `node::sandbox::volumes`) make, read and remove them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use disk_layers::LayeredDisk;
use serde::{Deserialize, Serialize};
use vmm_api::{Drive, DriveOverride};

use crate::node::ids::Token;
use crate::node::store::StoreError;

/// Spare drives per template. Each costs a restored guest a virtio-blk
/// device (a worker thread once the guest touches it, which an unused slot
/// never is).
pub const SLOTS: usize = 2;

/// The capacity a slot shows the guest: the largest volume.
pub const SLOT_BYTES: u64 = 64 << 30;

/// The smallest volume (ext4 needs room for its journal).
pub const MIN_VOLUME_BYTES: u64 = 64 << 20;

/// The placeholder's file name in a template's directory.
pub const PLACEHOLDER: &str = "volume-slot.img";

/// A volume's size when its create names none: sparse, so it costs the
/// host what is written (mkfs writes about 4 MiB of it).
pub const DEFAULT_VOLUME_MB: u64 = 10 << 10;

/// The longest volume name.
pub const MAX_NAME: usize = 63;

/// A volume as the node's store keeps it. Times are unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRecord {
    pub id: String,
    /// The team that owns it (each team sees only its own).
    pub team: String,
    /// Unique in its team.
    pub name: String,
    pub size_mb: u64,
    /// Its own directory (under the node's `volumes/`): its disk's base and
    /// layers.
    pub dir: PathBuf,
    /// Its disk's writable top layer, which a sandbox's slot is restored on.
    pub disk: PathBuf,
    /// Directories besides `dir` holding layers of its disk (the forks'
    /// whose parent mounted it: a fork gives the volume a new top layer
    /// there); the collector keeps them while the volume exists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uses_dirs: Vec<PathBuf>,
    /// E2B's token for the volume's content API (not served yet).
    pub token: Token,
    pub created_at_ms: u64,
}

/// Why a volume could not be made, read or removed.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// What the request asked cannot be a volume (a 400).
    #[error("{0}")]
    Invalid(String),
    /// No volume of the caller's team by that id.
    #[error("volume {0} not found")]
    NotFound(String),
    #[error("the team has a volume named {0:?} already")]
    NameTaken(String),
    #[error("volume {id} is mounted in sandbox {sandbox}: kill the sandbox first")]
    InUse { id: String, sandbox: String },
    /// A snapshot's sealed layer of it stacks on its files.
    #[error("volume {id} is kept by snapshot {snapshot}: delete the snapshot first")]
    Snapshotted { id: String, snapshot: String },
    /// The guest could not mount it (the create is undone).
    #[error("mounting a volume at {path} in the guest: {detail}")]
    Mount { path: String, detail: String },
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Checks a volume's name: 1 to [`MAX_NAME`] letters, digits, `-` and
/// `_`, starting with a letter or digit (it is no path, but a user reads
/// it in lists and mount specs).
pub fn check_name(name: &str) -> Result<(), VolumeError> {
    let ok = (1..=MAX_NAME).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        return Ok(());
    }
    Err(VolumeError::Invalid(if name.is_empty() {
        "name is required: a volume's name is 1 to 63 letters, digits, '-' and '_'".into()
    } else {
        format!(
            "invalid volume name {name:?}: 1 to {MAX_NAME} letters, digits, '-' and '_', \
             starting with a letter or digit"
        )
    }))
}

/// The longest mount path (Linux's `PATH_MAX`).
const MAX_PATH: usize = 4096;

/// Checks where a guest mounts a volume: an absolute path below `/`,
/// without `.` or `..` parts (the mount script makes what is missing).
pub fn check_mount_path(path: &str) -> Result<(), VolumeError> {
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    let ok = path.starts_with('/')
        && path.len() <= MAX_PATH
        && !path.contains('\0')
        && parts.iter().any(|p| !p.is_empty())
        && !parts.iter().any(|p| *p == "." || *p == "..");
    if ok {
        return Ok(());
    }
    Err(VolumeError::Invalid(format!(
        "volumeMounts: invalid path {path:?}: an absolute path below / without '.' or '..' parts"
    )))
}

/// A volume's size in bytes, from the MiB a create asked (none: the
/// default).
pub fn size_bytes(size_mb: Option<u64>) -> Result<u64, VolumeError> {
    let mb = size_mb.unwrap_or(DEFAULT_VOLUME_MB);
    let (min, max) = (MIN_VOLUME_BYTES >> 20, SLOT_BYTES >> 20);
    if !(min..=max).contains(&mb) {
        return Err(VolumeError::Invalid(format!(
            "sizeMB must be {min} to {max}, not {mb}"
        )));
    }
    Ok(mb << 20)
}

/// Why a volume's disk could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("mkfs.ext4 on {path}: {detail}")]
    Mkfs { path: PathBuf, detail: String },
    #[error("the volume's layer: {0}")]
    Layer(#[from] disk_layers::Error),
    #[error("a volume is {MIN_VOLUME_BYTES} to {SLOT_BYTES} bytes, not {0}")]
    Size(u64),
}

/// Slot `i`'s drive id.
pub fn slot_drive(i: usize) -> String {
    format!("vol{i}")
}

/// Makes the placeholder in `template_dir` unless it is there (a template
/// taken in from the cluster's store comes without) or the template has no
/// slots.
pub fn ensure_placeholder(template_dir: &Path, slots: usize) -> std::io::Result<()> {
    let placeholder = template_dir.join(PLACEHOLDER);
    if slots == 0 || placeholder.exists() {
        return Ok(());
    }
    // Made aside and renamed: creates of one template race here.
    static ASIDE: AtomicU64 = AtomicU64::new(0);
    let n = ASIDE.fetch_add(1, Ordering::Relaxed);
    let aside = template_dir.join(format!(".{PLACEHOLDER}.{}.{n}", std::process::id()));
    let made = std::fs::File::create(&aside).and_then(|f| f.set_len(SLOT_BYTES));
    made.and_then(|()| std::fs::rename(&aside, &placeholder))
        .inspect_err(|_| drop(std::fs::remove_file(&aside)))
}

/// The drives a template boots with after its root: every slot on the
/// placeholder in `template_dir`, writable so that a restore may make a
/// slot a volume's writable disk.
pub fn template_drives(template_dir: &Path) -> std::io::Result<Vec<Drive>> {
    ensure_placeholder(template_dir, SLOTS)?;
    let placeholder = template_dir.join(PLACEHOLDER);
    Ok((0..SLOTS)
        .map(|i| {
            Drive::new(
                slot_drive(i),
                placeholder.display().to_string(),
                false,
                false,
            )
        })
        .collect())
}

/// A volume attached to slot `slot` of a restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub slot: usize,
    /// The disk's writable top layer (or, read-only, any layer of it).
    pub disk: PathBuf,
    pub read_only: bool,
}

/// The overrides that restore a snapshot of template directory
/// `template_dir` with `attached` in their slots and every other slot
/// read-only on the placeholder. `slots`: how many the template has.
pub fn restore_drives(
    template_dir: &Path,
    slots: usize,
    attached: &[Attached],
) -> Vec<DriveOverride> {
    let placeholder = template_dir.join(PLACEHOLDER);
    (0..slots)
        .map(|i| match attached.iter().find(|a| a.slot == i) {
            Some(a) => DriveOverride {
                read_only: a.read_only,
                ..DriveOverride::new(slot_drive(i), a.disk.display().to_string())
            },
            None => DriveOverride {
                read_only: true,
                ..DriveOverride::new(slot_drive(i), placeholder.display().to_string())
            },
        })
        .collect()
}

/// Makes a volume's disk of `bytes` in `dir` (which exists): an empty ext4
/// image as its sealed-to-be base and a writable layer on it. Returns the
/// layer. Blocks (mkfs).
pub fn create_disk(dir: &Path, bytes: u64) -> Result<PathBuf, DiskError> {
    if !(MIN_VOLUME_BYTES..=SLOT_BYTES).contains(&bytes) {
        return Err(DiskError::Size(bytes));
    }
    let base = dir.join("base.ext4");
    let io = |what, path: &Path| {
        let path = path.to_owned();
        move |source| DiskError::Io { what, path, source }
    };
    std::fs::File::create(&base)
        .and_then(|f| f.set_len(bytes))
        .map_err(io("creating", &base))?;
    // No blocks reserved for root: the guest's `user` writes volumes too.
    // The file is new and sparse, so its journal reads as zeros unwritten:
    // zeroing it would write up to 256 MiB of a 64 GiB volume.
    let out = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
        ])
        .arg(&base)
        .output()
        .map_err(io("running mkfs.ext4 on", &base))?;
    if !out.status.success() {
        return Err(DiskError::Mkfs {
            path: base,
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    let top = dir.join("volume.layer");
    LayeredDisk::create(&base, &top)?;
    Ok(top)
}

/// The guest's script (run as root) that mounts slot `slot` at `path`:
/// the slot's device is found by its serial (the drive id); its page cache
/// is dropped first, since the guest read the placeholder's first sectors
/// when it probed the slot at the template's boot. A writable volume's root
/// directory is opened to every user, as E2B's are.
pub fn mount_script(slot: usize, path: &str, read_only: bool) -> String {
    let path = shell_quote(path);
    let (opts, open) = if read_only {
        ("ro,noload", String::new())
    } else {
        ("rw", format!(" && chmod 1777 {path}"))
    };
    format!(
        "set -e; d=$(grep -lx {id} /sys/block/vd*/serial | cut -d/ -f4); \
         test -n \"$d\"; blockdev --flushbufs /dev/$d; mkdir -p {path}; \
         mount -t ext4 -o {opts} /dev/$d {path}{open}",
        id = slot_drive(slot),
    )
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unused_slots_are_restored_read_only_on_the_placeholder() {
        let dir = Path::new("/t/base");
        let drives = restore_drives(
            dir,
            2,
            &[Attached {
                slot: 1,
                disk: "/v/a/volume.layer".into(),
                read_only: false,
            }],
        );
        assert_eq!(
            drives,
            vec![
                DriveOverride {
                    read_only: true,
                    ..DriveOverride::new("vol0", "/t/base/volume-slot.img")
                },
                DriveOverride::new("vol1", "/v/a/volume.layer"),
            ]
        );
        assert!(restore_drives(dir, 0, &[]).is_empty());
    }

    #[test]
    fn a_volume_disk_is_an_ext4_image_under_a_writable_layer() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            create_disk(dir.path(), MIN_VOLUME_BYTES - 1),
            Err(DiskError::Size(_))
        ));
        let top = create_disk(dir.path(), MIN_VOLUME_BYTES).unwrap();
        let disk = LayeredDisk::open(&top).unwrap();
        assert_eq!(disk.len(), MIN_VOLUME_BYTES);
        assert!(!disk.is_read_only());
        // ext4's superblock magic, 0xEF53 at byte 56 of the superblock at 1024.
        let mut magic = [0u8; 2];
        disk.read_at(&mut magic, 1024 + 56).unwrap();
        assert_eq!(u16::from_le_bytes(magic), 0xEF53);
    }

    #[test]
    fn mount_paths_are_absolute_and_below_the_root() {
        for ok in ["/data", "/mnt/vol/", "/home/user/it's here"] {
            assert!(check_mount_path(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/", "//", "data", "/a/../etc", "/a/./b", "/a\0b"] {
            assert!(
                matches!(check_mount_path(bad), Err(VolumeError::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_mount_script_quotes_the_path() {
        let s = mount_script(0, "/data/it's", false);
        assert!(s.contains("grep -lx vol0 "), "{s}");
        assert!(s.contains("mkdir -p '/data/it'\\''s'"), "{s}");
        assert!(s.ends_with("&& chmod 1777 '/data/it'\\''s'"), "{s}");
        assert!(mount_script(1, "/r", true).contains("-o ro,noload "));
    }
}
