//! The filesystem operations behind the Filesystem RPCs, as plain blocking
//! functions. Callers run them through `as_user::run_as`, so every access check
//! and every created inode is the requesting user's.

use std::fs::DirBuilder;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use super::entry::{Names, entry_from_metadata, entry_info};
use super::error::{FsError, FsErrorKind};
use envd_proto::filesystem::EntryInfo;

pub fn stat(path: &Path) -> Result<EntryInfo, FsError> {
    entry_info(path, &mut Names::default()).map_err(|e| FsError::io("stat", path, &e))
}

/// Creates `path` and any missing parents (mode 0755 before umask).
pub fn make_dir(path: &Path) -> Result<EntryInfo, FsError> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => {
            return Err(FsError::new(
                FsErrorKind::AlreadyExists,
                format!("directory {} already exists", path.display()),
            ));
        }
        Ok(_) => {
            // A file (or a symlink, even to a directory) is in the way; the SDK
            // would read already_exists as "the directory is there".
            return Err(FsError::invalid(format!(
                "{} exists and is not a directory",
                path.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(FsError::io("stat", path, &e)),
    }
    create_dirs(path)?;
    stat(path)
}

/// `mkdir -p` with mode 0755.
pub fn create_dirs(path: &Path) -> Result<(), FsError> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(path)
        .map_err(|e| FsError::io("create directory", path, &e))
}

/// `mkdir -p` of `path` on behalf of a user whose own rights may not reach
/// it, as envd (root) does before a user's file write: each directory that
/// is missing is made (0755) and handed to `owner` (uid, gid), so the write
/// that follows, done with the user's own rights, may create its file there.
/// What exists already is left as it is. Without root (host-mode runs) the
/// directories stay the agent's.
pub fn create_dirs_for(path: &Path, owner: (u32, u32)) -> Result<(), FsError> {
    let mut missing = Vec::new();
    let mut at = Some(path);
    while let Some(dir) = at {
        match std::fs::symlink_metadata(dir) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing.push(dir),
            Err(e) => return Err(FsError::io("stat", dir, &e)),
        }
        at = dir.parent();
    }
    let root = nix::unistd::geteuid().is_root();
    for dir in missing.into_iter().rev() {
        match DirBuilder::new().mode(0o755).create(dir) {
            Ok(()) => {}
            // made meanwhile by another write: the same end
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(FsError::io("create directory", dir, &e)),
        }
        if root {
            std::os::unix::fs::lchown(dir, Some(owner.0), Some(owner.1))
                .map_err(|e| FsError::io("hand over directory", dir, &e))?;
        }
    }
    Ok(())
}

/// Renames `source` to `destination`, creating the destination's parents.
pub fn rename(source: &Path, destination: &Path) -> Result<EntryInfo, FsError> {
    std::fs::symlink_metadata(source).map_err(|e| FsError::io("stat", source, &e))?;
    if let Some(parent) = destination.parent() {
        create_dirs(parent)?;
    }
    std::fs::rename(source, destination)
        .map_err(|e| FsError::io(&format!("move {} to", source.display()), destination, &e))?;
    stat(destination)
}

/// Lists `path` down to `depth` levels (0 counts as 1). Symlinks are listed but
/// never followed below the top; unreadable subdirectories are skipped.
pub fn list_dir(path: &Path, depth: u32) -> Result<Vec<EntryInfo>, FsError> {
    // The top may be a symlink to a directory: that one is followed.
    let md = std::fs::metadata(path).map_err(|e| FsError::io("stat", path, &e))?;
    if !md.is_dir() {
        return Err(FsError::invalid(format!(
            "{} is not a directory",
            path.display()
        )));
    }
    let mut names = Names::default();
    let mut out = Vec::new();
    walk(path, depth.max(1), true, &mut names, &mut out)?;
    Ok(out)
}

fn walk(
    dir: &Path,
    levels: u32,
    top: bool,
    names: &mut Names,
    out: &mut Vec<EntryInfo>,
) -> Result<(), FsError> {
    let read = match std::fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) if top => return Err(FsError::io("list", dir, &e)),
        Err(e) => {
            log::debug!("list {}: {e}; skipped", dir.display());
            return Ok(());
        }
    };
    let mut children: Vec<PathBuf> = read.filter_map(|d| d.ok().map(|d| d.path())).collect();
    children.sort();
    for child in children {
        // The entry may vanish between readdir and lstat: skip it then.
        let Ok(md) = std::fs::symlink_metadata(&child) else {
            continue;
        };
        out.push(entry_from_metadata(&child, &md, names));
        if levels > 1 && md.is_dir() {
            walk(&child, levels - 1, false, names, out)?;
        }
    }
    Ok(())
}

/// Removes a file, a symlink (not its target) or a whole directory tree. A
/// path that is not there is removed already: E2B's envd (`os.RemoveAll`)
/// answers success, and clients rely on it to clean up unconditionally.
pub fn remove(path: &Path) -> Result<(), FsError> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(FsError::io("stat", path, &e)),
    };
    let removed = if md.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    removed.map_err(|e| FsError::io("remove", path, &e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use envd_proto::filesystem::FileType;

    #[test]
    fn make_dir_creates_parents_and_refuses_existing() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("a/b/c");
        let e = make_dir(&p).unwrap();
        assert_eq!(e.file_type, FileType::Directory);
        assert_eq!(e.name, "c");
        assert!(t.path().join("a/b").is_dir());
        assert_eq!(make_dir(&p).unwrap_err().kind, FsErrorKind::AlreadyExists);
        std::fs::write(t.path().join("f"), b"").unwrap();
        assert_eq!(
            make_dir(&t.path().join("f")).unwrap_err().kind,
            FsErrorKind::InvalidArgument
        );
        assert_eq!(
            make_dir(&t.path().join("f/sub")).unwrap_err().kind,
            FsErrorKind::InvalidArgument
        );
    }

    #[test]
    fn list_dir_depths_and_errors() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("d/e/f")).unwrap();
        std::fs::write(t.path().join("a.txt"), b"1").unwrap();
        std::fs::write(t.path().join("d/b.txt"), b"22").unwrap();
        std::os::unix::fs::symlink(t.path().join("d"), t.path().join("ln")).unwrap();
        let rel = |v: Vec<EntryInfo>| -> Vec<String> {
            v.iter()
                .map(|e| {
                    Path::new(&e.path)
                        .strip_prefix(t.path())
                        .unwrap()
                        .to_string_lossy()
                        .into_owned()
                })
                .collect()
        };
        assert_eq!(rel(list_dir(t.path(), 0).unwrap()), ["a.txt", "d", "ln"]);
        assert_eq!(rel(list_dir(t.path(), 1).unwrap()), ["a.txt", "d", "ln"]);
        // The symlink to d is listed, not followed.
        assert_eq!(
            rel(list_dir(t.path(), 2).unwrap()),
            ["a.txt", "d", "d/b.txt", "d/e", "ln"]
        );
        assert_eq!(rel(list_dir(t.path(), 9).unwrap()).len(), 6);
        // A symlink to a directory at the top is listed through.
        assert_eq!(list_dir(&t.path().join("ln"), 1).unwrap().len(), 2);
        assert_eq!(
            list_dir(&t.path().join("nope"), 1).unwrap_err().kind,
            FsErrorKind::NotFound
        );
        assert_eq!(
            list_dir(&t.path().join("a.txt"), 1).unwrap_err().kind,
            FsErrorKind::InvalidArgument
        );
    }

    #[test]
    fn rename_and_remove() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("a"), b"x").unwrap();
        let e = rename(&t.path().join("a"), &t.path().join("new/dir/b")).unwrap();
        assert_eq!(e.name, "b");
        assert_eq!(std::fs::read(t.path().join("new/dir/b")).unwrap(), b"x");
        assert_eq!(
            rename(&t.path().join("a"), &t.path().join("c"))
                .unwrap_err()
                .kind,
            FsErrorKind::NotFound
        );
        remove(&t.path().join("new")).unwrap();
        assert!(!t.path().join("new").exists());
        // Already gone is success, as on E2B.
        remove(&t.path().join("new")).unwrap();
        // Removing a symlink leaves its target.
        std::fs::write(t.path().join("target"), b"").unwrap();
        std::os::unix::fs::symlink(t.path().join("target"), t.path().join("l")).unwrap();
        remove(&t.path().join("l")).unwrap();
        assert!(t.path().join("target").exists());
    }
}
