//! The guest's pseudo-filesystems: what PID 1 mounts at boot and takes down at
//! shutdown, and a reader for /proc/self/mountinfo.

use std::path::Path;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// One filesystem PID 1 makes sure is mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountSpec {
    pub source: &'static str,
    pub target: &'static str,
    pub fstype: &'static str,
    pub flags: MsFlags,
    pub data: &'static str,
}

const NOSUID_NODEV: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV);
const NOSUID_NODEV_NOEXEC: MsFlags = NOSUID_NODEV.union(MsFlags::MS_NOEXEC);

/// In mount order: every target's parent is mounted before it.
pub const BOOT_MOUNTS: &[MountSpec] = &[
    MountSpec {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
    MountSpec {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
    MountSpec {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: MsFlags::MS_NOSUID,
        data: "mode=0755",
    },
    MountSpec {
        source: "devpts",
        target: "/dev/pts",
        fstype: "devpts",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NOEXEC),
        // gid 5 is Debian's "tty" group; ptmxmode lets unprivileged users open pts/ptmx.
        data: "gid=5,mode=620,ptmxmode=0666",
    },
    MountSpec {
        source: "shm",
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: "mode=1777",
    },
    MountSpec {
        source: "tmpfs",
        target: "/tmp",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: "mode=1777",
    },
    MountSpec {
        source: "tmpfs",
        target: "/run",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: "mode=0755",
    },
    MountSpec {
        source: "cgroup2",
        target: "/sys/fs/cgroup",
        fstype: "cgroup2",
        flags: NOSUID_NODEV_NOEXEC,
        data: "",
    },
];

/// Mount points listed in a mountinfo text, in the order they appear (mount order).
pub fn parse_mountinfo(text: &str) -> Vec<String> {
    cgroup::mountinfo::parse(text)
        .into_iter()
        .map(|m| m.point.to_string_lossy().into_owned())
        .collect()
}

/// Current mount points, or empty when /proc is not mounted yet.
pub fn current_mount_points() -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| parse_mountinfo(&t))
        .unwrap_or_default()
}

/// Mounts every entry of `BOOT_MOUNTS` that is not mounted yet. Failures are
/// logged and skipped: a guest missing /sys/fs/cgroup still wants its server.
pub fn mount_boot_filesystems() {
    for spec in BOOT_MOUNTS {
        // Re-read each time: mounting /proc makes mountinfo readable, and the
        // kernel may have mounted /dev itself (CONFIG_DEVTMPFS_MOUNT).
        if current_mount_points().iter().any(|m| m == spec.target) {
            log::debug!("{} already mounted", spec.target);
            continue;
        }
        if let Err(e) = std::fs::create_dir_all(spec.target) {
            log::warn!("cannot create {}: {e}", spec.target);
            continue;
        }
        let data = (!spec.data.is_empty()).then_some(spec.data);
        match mount(
            Some(spec.source),
            spec.target,
            Some(spec.fstype),
            spec.flags,
            data,
        ) {
            Ok(()) => log::debug!("mounted {} on {}", spec.fstype, spec.target),
            Err(e) => log::warn!("mount {} on {}: {e}", spec.fstype, spec.target),
        }
    }
}

/// At shutdown, after every other process is gone: unmounts everything but `/`,
/// innermost first, remounting read-only what cannot be unmounted, then remounts
/// `/` read-only so the root filesystem is clean when the VM ends.
///
/// Only call this in the initial PID namespace (a real VM): a superblock remount
/// made from a container would reach the host's filesystem.
pub fn unmount_all() {
    let points = current_mount_points();
    let (mut unmounted, mut read_only, mut failed) = (0, 0, 0);
    for point in points.iter().rev().filter(|p| p.as_str() != "/") {
        if umount2(Path::new(point), MntFlags::empty()).is_ok() {
            unmounted += 1;
        } else if remount_read_only(point).is_ok() {
            read_only += 1;
        } else {
            failed += 1;
        }
    }
    if let Err(e) = remount_read_only("/") {
        log::warn!("remount / read-only: {e}");
    }
    log::info!("unmounted {unmounted}, made read-only {read_only}, left {failed}");
}

fn remount_read_only(point: &str) -> nix::Result<()> {
    mount(
        None::<&str>,
        point,
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_mounts_come_after_the_mounts_they_sit_on() {
        for (i, spec) in BOOT_MOUNTS.iter().enumerate() {
            for (j, other) in BOOT_MOUNTS.iter().enumerate() {
                let nested = Path::new(spec.target).starts_with(other.target);
                if i != j && nested {
                    assert!(j < i, "{} mounted before {}", spec.target, other.target);
                }
            }
        }
        // The test has teeth: /sys/fs/cgroup sits on /sys, /dev/pts on /dev.
        let pos = |t: &str| BOOT_MOUNTS.iter().position(|s| s.target == t).unwrap();
        assert!(pos("/sys") < pos("/sys/fs/cgroup"));
        assert!(pos("/dev") < pos("/dev/pts"));
    }

    #[test]
    fn boot_mounts_have_the_promised_options() {
        let find = |t: &str| BOOT_MOUNTS.iter().find(|s| s.target == t).unwrap();
        assert!(find("/dev/pts").data.contains("ptmxmode=0666"));
        assert!(find("/dev/pts").data.contains("gid=5,mode=620"));
        assert_eq!(find("/tmp").data, "mode=1777");
        assert_eq!(find("/sys/fs/cgroup").fstype, "cgroup2");
        assert_eq!(find("/dev").fstype, "devtmpfs");
    }

    #[test]
    fn mountinfo_mount_points_in_order_with_escapes() {
        let text = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs devtmpfs rw,mode=755
40 22 0:30 / /mnt/with\\040space rw - tmpfs tmpfs rw
41 22 0:31 / /mnt/back\\134slash rw - tmpfs tmpfs rw
";
        assert_eq!(
            parse_mountinfo(text),
            vec!["/", "/dev", "/mnt/with space", "/mnt/back\\slash"]
        );
    }
}
