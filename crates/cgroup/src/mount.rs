//! Where the cgroup2 file system is mounted, from `/proc/self/mountinfo`.

use std::path::PathBuf;

use crate::{Result, io_err};

/// The mount point of the first cgroup2 file system (on a unified host
/// `/sys/fs/cgroup`; on a hybrid one often `/sys/fs/cgroup/unified`).
pub fn cgroup2_mount() -> Result<Option<PathBuf>> {
    let path = std::path::Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(io_err("reading", path))?;
    Ok(find_cgroup2(&text))
}

/// `mountinfo` lines: `ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [TAGS...] - TYPE SOURCE SUPER-OPTIONS`.
fn find_cgroup2(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        let fs_type = fs.split_whitespace().next()?;
        let point = mount.split_whitespace().nth(4)?;
        (fs_type == "cgroup2").then(|| PathBuf::from(unescape(point)))
    })
}

/// The kernel writes space, tab, newline and backslash in paths as `\ooo`.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |v, b| v * 8 + u32::from(b - b'0'));
            if let Ok(b) = u8::try_from(v) {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
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
        assert_eq!(unescape("a\\134b\\0"), "a\\b\\0");
    }
}
