//! EntryInfo from what the kernel says about a path: lstat (symlinks are not
//! followed, but a symlink reports its target's type), names of owner and group,
//! and the `user.e2b.*` extended attributes.

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::fs::Metadata;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use envd_proto::filesystem::{EntryInfo, FileType};

/// Prefix of the extended attributes that carry file metadata.
pub const XATTR_PREFIX: &str = "user.e2b.";

/// uid/gid → name, read once from /etc/passwd and /etc/group (not NSS: the
/// agent is static and the guest's users live in those files).
#[derive(Debug, Default)]
pub struct Names {
    users: Option<HashMap<u32, String>>,
    groups: Option<HashMap<u32, String>>,
}

impl Names {
    pub fn user(&mut self, uid: u32) -> String {
        let map = self
            .users
            .get_or_insert_with(|| id_names(Path::new("/etc/passwd")));
        map.get(&uid).cloned().unwrap_or_else(|| uid.to_string())
    }

    pub fn group(&mut self, gid: u32) -> String {
        let map = self
            .groups
            .get_or_insert_with(|| id_names(Path::new("/etc/group")));
        map.get(&gid).cloned().unwrap_or_else(|| gid.to_string())
    }
}

/// `name:x:id:...` lines → id → name (first name wins, as getpwuid does).
fn id_names(file: &Path) -> HashMap<u32, String> {
    let mut out = HashMap::new();
    let text = std::fs::read_to_string(file).unwrap_or_default();
    for line in text.lines() {
        let mut fields = line.split(':');
        let (Some(name), _, Some(id)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if let Ok(id) = id.parse() {
            out.entry(id).or_insert_with(|| name.to_string());
        }
    }
    out
}

/// The EntryInfo of `path` (absolute, as the client should see it).
pub fn entry_info(path: &Path, names: &mut Names) -> io::Result<EntryInfo> {
    let md = std::fs::symlink_metadata(path)?;
    Ok(entry_from_metadata(path, &md, names))
}

pub fn entry_from_metadata(path: &Path, md: &Metadata, names: &mut Names) -> EntryInfo {
    let is_symlink = md.file_type().is_symlink();
    let (file_type, symlink_target) = if is_symlink {
        // E2B's envd answers a link with its target's type and the target in
        // `symlinkTarget`; a dangling link stays FILE_TYPE_SYMLINK.
        let target_type = std::fs::metadata(path)
            .map(|t| kind(&t))
            .unwrap_or(FileType::Symlink);
        let target = std::fs::canonicalize(path)
            .or_else(|_| std::fs::read_link(path))
            .map(|t| t.to_string_lossy().into_owned())
            .ok();
        (target_type, target)
    } else {
        (kind(md), None)
    };
    EntryInfo {
        name: base_name(path),
        file_type,
        path: path.to_string_lossy().into_owned(),
        size: md.size() as i64,
        mode: md.mode() & 0o7777,
        permissions: permissions_string(md),
        owner: names.user(md.uid()),
        group: names.group(md.gid()),
        modified_time: Some(rfc3339(md.mtime(), md.mtime_nsec())),
        symlink_target,
        metadata: if is_symlink {
            BTreeMap::new()
        } else {
            read_metadata(path)
        },
        // E2B's envd never sets isSymlink (newer than its proto); an SDK that
        // sees it shows the link as SYMLINK instead of its target's type.
        is_symlink: false,
    }
}

fn kind(md: &Metadata) -> FileType {
    let t = md.file_type();
    if t.is_dir() {
        FileType::Directory
    } else if t.is_symlink() {
        FileType::Symlink
    } else {
        // Devices, fifos and sockets are files to the SDK (it drops UNSPECIFIED).
        FileType::File
    }
}

fn base_name(path: &Path) -> String {
    match path.file_name() {
        Some(n) => n.to_string_lossy().into_owned(),
        None => path.to_string_lossy().into_owned(),
    }
}

/// `ls -l` style: type letter, then rwx triplets with s/S/t/T for the special bits.
pub fn permissions_string(md: &Metadata) -> String {
    let t = md.file_type();
    let first = if t.is_dir() {
        'd'
    } else if t.is_symlink() {
        'l'
    } else if t.is_fifo() {
        'p'
    } else if t.is_socket() {
        's'
    } else if t.is_char_device() {
        'c'
    } else if t.is_block_device() {
        'b'
    } else {
        '-'
    };
    mode_string(first, md.mode())
}

fn mode_string(first: char, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(first);
    let special = [(0o4000, 's', 'S'), (0o2000, 's', 'S'), (0o1000, 't', 'T')];
    for (i, (bit, on, off)) in special.iter().enumerate() {
        let shift = 6 - 3 * i;
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        let x = bits & 1 != 0;
        s.push(match (mode & bit != 0, x) {
            (true, true) => *on,
            (true, false) => *off,
            (false, true) => 'x',
            (false, false) => '-',
        });
    }
    s
}

/// RFC 3339 in UTC, with 0, 3, 6 or 9 fractional digits like proto3 JSON.
pub fn rfc3339(secs: i64, nanos: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let mut s = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    let nanos = nanos.clamp(0, 999_999_999);
    if nanos != 0 {
        if nanos % 1_000_000 == 0 {
            s += &format!(".{:03}", nanos / 1_000_000);
        } else if nanos % 1_000 == 0 {
            s += &format!(".{:06}", nanos / 1_000);
        } else {
            s += &format!(".{nanos:09}");
        }
    }
    s.push('Z');
    s
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

/// The `user.e2b.*` attributes of `path`, prefix stripped. Unreadable or
/// unsupported attributes give an empty map: metadata is best effort on read.
pub fn read_metadata(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(cpath) = c_path(path) else {
        return out;
    };
    let Some(list) = xattr_call(|buf, len| {
        // SAFETY: cpath is NUL-terminated; buf/len describe a writable buffer
        // (or are null/0 to ask for the size).
        unsafe { libc::llistxattr(cpath.as_ptr(), buf.cast(), len) }
    }) else {
        return out;
    };
    for raw in list.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Some(key) = raw.strip_prefix(XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        let Ok(cname) = CString::new(raw) else {
            continue;
        };
        let value = xattr_call(|buf, len| {
            // SAFETY: as above; cname is a NUL-terminated attribute name.
            unsafe { libc::lgetxattr(cpath.as_ptr(), cname.as_ptr(), buf.cast(), len) }
        });
        if let Some(v) = value {
            out.insert(
                String::from_utf8_lossy(key).into_owned(),
                String::from_utf8_lossy(&v).into_owned(),
            );
        }
    }
    out
}

/// Size-then-fetch for the *xattr calls; retries when the value grew between.
fn xattr_call(mut f: impl FnMut(*mut u8, usize) -> isize) -> Option<Vec<u8>> {
    for _ in 0..4 {
        let n = f(std::ptr::null_mut(), 0);
        if n < 0 {
            return None;
        }
        let mut buf = vec![0u8; n as usize];
        let m = f(buf.as_mut_ptr(), buf.len());
        if m >= 0 {
            buf.truncate(m as usize);
            return Some(buf);
        }
        if io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE) {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn rfc3339_matches_known_instants() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400, 0), "2000-02-29T00:00:00Z");
        assert_eq!(
            rfc3339(1_700_000_000, 5_000_000),
            "2023-11-14T22:13:20.005Z"
        );
        assert_eq!(rfc3339(1_700_000_000, 5_000), "2023-11-14T22:13:20.000005Z");
        assert_eq!(rfc3339(1_700_000_000, 5), "2023-11-14T22:13:20.000000005Z");
        assert_eq!(rfc3339(-1, 0), "1969-12-31T23:59:59Z");
        assert_eq!(rfc3339(4_102_444_800, 0), "2100-01-01T00:00:00Z");
    }

    #[test]
    fn mode_strings_like_ls() {
        assert_eq!(mode_string('-', 0o644), "-rw-r--r--");
        assert_eq!(mode_string('d', 0o755), "drwxr-xr-x");
        assert_eq!(mode_string('-', 0o4755), "-rwsr-xr-x");
        assert_eq!(mode_string('-', 0o2644), "-rw-r-Sr--");
        assert_eq!(mode_string('d', 0o1777), "drwxrwxrwt");
        assert_eq!(mode_string('d', 0o1776), "drwxrwxrwT");
    }

    #[test]
    fn entries_of_file_dir_and_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.txt");
        std::fs::write(&f, b"hello").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let mut names = Names::default();
        let e = entry_info(&f, &mut names).unwrap();
        assert_eq!(e.name, "a.txt");
        assert_eq!(e.file_type, FileType::File);
        assert_eq!(e.path, f.to_str().unwrap());
        assert_eq!(e.size, 5);
        assert_eq!(e.mode, 0o640);
        assert_eq!(e.permissions, "-rw-r-----");
        assert!(!e.is_symlink && e.symlink_target.is_none());
        assert!(e.modified_time.unwrap().ends_with('Z'));
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        if uid == 0 {
            assert_eq!(e.owner, "root");
        }

        let d = entry_info(dir.path(), &mut names).unwrap();
        assert_eq!(d.file_type, FileType::Directory);
        assert!(d.permissions.starts_with('d'));

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        let l = entry_info(&link, &mut names).unwrap();
        // As E2B's envd: the target's type, the target, and no isSymlink.
        assert!(!l.is_symlink);
        assert_eq!(l.file_type, FileType::File);
        assert_eq!(l.name, "link");
        assert!(l.permissions.starts_with('l'));
        assert_eq!(
            l.symlink_target.as_deref(),
            Some(std::fs::canonicalize(&f).unwrap().to_str().unwrap())
        );

        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink("/nonexistent/x", &dangling).unwrap();
        let l = entry_info(&dangling, &mut names).unwrap();
        assert_eq!(l.file_type, FileType::Symlink);
        assert_eq!(l.symlink_target.as_deref(), Some("/nonexistent/x"));

        assert_eq!(
            entry_info(&dir.path().join("missing"), &mut names)
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn unknown_ids_are_numbers() {
        let mut names = Names::default();
        assert_eq!(names.user(4_000_000_001), "4000000001");
        assert_eq!(names.group(4_000_000_002), "4000000002");
    }
}
