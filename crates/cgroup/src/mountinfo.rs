//! `/proc/<pid>/mountinfo`: each mount's point, file system type and source.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// One line of mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Where it is mounted, unescaped (byte for byte: a path need not be
    /// UTF-8).
    pub point: PathBuf,
    pub fs_type: String,
    /// What is mounted: a device, or the name a pseudo file system was
    /// given, unescaped.
    pub source: String,
}

/// The mounts of a mountinfo text, in its order (mount order). Lines are
/// `ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [TAGS...] - TYPE SOURCE SUPER-OPTIONS`;
/// a line without that shape is skipped.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            let mut fs = fs.split_whitespace();
            let fs_type = fs.next()?;
            let source = fs.next().unwrap_or_default();
            let point = mount.split_whitespace().nth(4)?;
            Some(Mount {
                point: PathBuf::from(OsString::from_vec(unescape(point))),
                fs_type: fs_type.to_owned(),
                source: String::from_utf8_lossy(&unescape(source)).into_owned(),
            })
        })
        .collect()
}

/// The kernel writes space, tab, newline and backslash in paths as `\ooo`;
/// anything else after a backslash is left as it is.
fn unescape(s: &str) -> Vec<u8> {
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
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_and_types_in_order_with_escapes() {
        let text = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:30 / /mnt/with\\040space rw - tmpfs tmpfs rw
41 22 0:31 / /mnt/back\\134slash rw - tmpfs tmpfs rw
garbage
";
        let mounts = parse(text);
        let points: Vec<&str> = mounts.iter().map(|m| m.point.to_str().unwrap()).collect();
        assert_eq!(points, ["/", "/mnt/with space", "/mnt/back\\slash"]);
        assert_eq!(mounts[0].fs_type, "ext4");
        assert_eq!(mounts[0].source, "/dev/vda");
    }

    #[test]
    fn malformed_escapes_are_left_alone() {
        assert_eq!(unescape("a\\09"), b"a\\09");
        assert_eq!(unescape("end\\04"), b"end\\04");
        assert_eq!(unescape("\\777x"), b"\\777x");
        assert_eq!(unescape("\\011"), b"\t");
        assert_eq!(unescape("a\\134b\\0"), b"a\\b\\0");
    }
}
