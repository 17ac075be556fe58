//! Where the cgroup2 file system is mounted, from `/proc/self/mountinfo`.

use std::path::PathBuf;

use crate::{Result, io_err, mountinfo};

/// The mount point of the first cgroup2 file system (on a unified host
/// `/sys/fs/cgroup`; on a hybrid one often `/sys/fs/cgroup/unified`).
pub fn cgroup2_mount() -> Result<Option<PathBuf>> {
    let path = std::path::Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(io_err("reading", path))?;
    Ok(find_cgroup2(&text))
}

fn find_cgroup2(text: &str) -> Option<PathBuf> {
    mountinfo::parse(text)
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| m.point)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_mount_among_v1_ones() {
        let hybrid = "\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
29 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
30 29 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
31 29 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
";
        assert_eq!(
            find_cgroup2(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";
        assert_eq!(find_cgroup2(unified), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(
            find_cgroup2("31 29 0:28 / /x rw - cgroup cgroup rw,memory\n"),
            None
        );
        assert_eq!(find_cgroup2("garbage\n\n - \n"), None);
    }

    #[test]
    fn escaped_mount_points_are_decoded() {
        let line = "30 29 0:27 / /mnt/my\\040cgroups rw shared:10 - cgroup2 cgroup2 rw\n";
        assert_eq!(find_cgroup2(line), Some(PathBuf::from("/mnt/my cgroups")));
    }
}
