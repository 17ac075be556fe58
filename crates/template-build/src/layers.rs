//! Applies image layers (tar, optionally gzip) to a root tree in order, with
//! the OCI whiteout rules: `.wh.NAME` deletes NAME from the layers below, and
//! `.wh..wh..opq` in a directory hides everything the layers below put in it.
//! Owners, modes, times and xattrs are kept (the build runs as root).
//!
//! Everything stays inside the root: entry paths with `..` are refused, and
//! symlinks whose targets are absolute or climb above the root are rewritten
//! as relative links to the same place inside it, so that following any link
//! in the tree, here or in finish.sh, never reaches the host.

use std::collections::HashSet;
use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::fs::symlink;
use std::path::{Component, Path, PathBuf};

use flate2::read::GzDecoder;
use sha2::{Digest, Sha256};

use crate::error::{BuildError, Result};
use crate::scripts::hex;

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// One layer blob on disk, with the digest it must have when known.
#[derive(Debug)]
pub struct Layer {
    pub path: PathBuf,
    pub sha256: Option<String>,
}

/// Applies `layers` in order to `root` (an existing directory).
pub fn apply_layers(root: &Path, layers: &[Layer], log: &mut dyn FnMut(&str)) -> Result<()> {
    for (n, layer) in layers.iter().enumerate() {
        log(&format!(
            "layer {}/{}: {}",
            n + 1,
            layers.len(),
            layer.path.display()
        ));
        apply_layer(root, layer)?;
    }
    Ok(())
}

/// Counts bytes and hashes them as they are read, to check a blob's digest
/// without reading it twice.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// Applies one layer to `root` (whiteouts, owners, modes, times, xattrs).
pub(crate) fn apply_layer(root: &Path, layer: &Layer) -> Result<()> {
    let path = &layer.path;
    let file = fs::File::open(path).map_err(|e| BuildError::unreadable(path, e.to_string()))?;
    let mut hashing = BufReader::new(Hashing {
        inner: file,
        hash: Sha256::new(),
    });
    let magic = hashing
        .fill_buf()
        .map_err(|e| BuildError::unreadable(path, e.to_string()))?;
    let compressed = match magic {
        [0x1f, 0x8b, ..] => true,
        [0x28, 0xb5, 0x2f, 0xfd, ..] => {
            return Err(BuildError::UnsupportedImage {
                path: path.clone(),
                reason: "zstd-compressed layers are not supported".into(),
            });
        }
        _ => false,
    };
    let unreadable = |e: io::Error| BuildError::unreadable(path, format!("layer: {e}"));
    if compressed {
        let mut gz = GzDecoder::new(&mut hashing);
        unpack_tar(root, &mut gz, path)?;
        io::copy(&mut gz, &mut io::sink()).map_err(unreadable)?;
    } else {
        unpack_tar(root, &mut hashing, path)?;
    }
    // the digest covers the whole blob, padding included
    io::copy(&mut hashing, &mut io::sink()).map_err(unreadable)?;
    if let Some(want) = &layer.sha256 {
        let got = hex(&hashing.into_inner().hash.finalize());
        if &got != want {
            return Err(BuildError::unreadable(
                path,
                format!("layer digest is sha256:{got}, the manifest says sha256:{want}"),
            ));
        }
    }
    Ok(())
}

fn unpack_tar(root: &Path, reader: &mut dyn Read, layer: &Path) -> Result<()> {
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(true);
    archive.set_overwrite(true);
    let bad = |e: io::Error| BuildError::unreadable(layer, format!("layer tar: {e}"));
    // paths this layer put in place, and all their parents: an opaque
    // directory keeps these and hides the rest
    let mut touched: HashSet<PathBuf> = HashSet::new();
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let raw = entry.path().map_err(bad)?.into_owned();
        let Some(rel) = clean_relative(&raw)? else {
            continue; // the root itself
        };
        let name = rel
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parent = rel.parent().unwrap_or(Path::new("")).to_path_buf();
        if name == OPAQUE {
            ensure_dir(root, &parent)?;
            hide_lower(root, &parent, &touched)?;
            mark(&mut touched, &parent);
            continue;
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            ensure_dir(root, &parent)?;
            remove_any(&root.join(&parent).join(hidden))?;
            continue;
        }
        ensure_dir(root, &parent)?;
        let dst = root.join(&rel);
        let kind = entry.header().entry_type();
        let existing = fs::symlink_metadata(&dst).ok();
        let ctx = |what: &str| format!("{what} {}", dst.display());
        match kind {
            tar::EntryType::Directory => {
                if existing.is_some_and(|m| !m.is_dir()) {
                    remove_any(&dst)?;
                }
                entry
                    .unpack(&dst)
                    .map_err(|e| BuildError::io(ctx("unpacking"), e))?;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| {
                        BuildError::unreadable(layer, format!("symlink {raw:?} without target"))
                    })?
                    .into_owned();
                remove_any(&dst)?;
                let target = confine_link(&rel, &target);
                symlink(&target, &dst).map_err(|e| BuildError::io(ctx("creating symlink"), e))?;
                let h = entry.header();
                let (uid, gid) = (h.uid().map_err(bad)?, h.gid().map_err(bad)?);
                nix::unistd::fchownat(
                    nix::fcntl::AT_FDCWD,
                    &dst,
                    Some(nix::unistd::Uid::from_raw(uid as u32)),
                    Some(nix::unistd::Gid::from_raw(gid as u32)),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| BuildError::io(ctx("chown"), e.into()))?;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| {
                        BuildError::unreadable(layer, format!("hard link {raw:?} without target"))
                    })?
                    .into_owned();
                let Some(src) = clean_relative(&target)? else {
                    return Err(BuildError::UnsafePath(raw.display().to_string()));
                };
                remove_any(&dst)?;
                fs::hard_link(root.join(&src), &dst).map_err(|e| {
                    BuildError::io(ctx(&format!("linking {} to", src.display())), e)
                })?;
            }
            tar::EntryType::Regular
            | tar::EntryType::Continuous
            | tar::EntryType::Char
            | tar::EntryType::Block
            | tar::EntryType::Fifo => {
                if existing.is_some() {
                    remove_any(&dst)?;
                }
                entry
                    .unpack(&dst)
                    .map_err(|e| BuildError::io(ctx("unpacking"), e))?;
            }
            // pax and GNU headers are folded into the entries by `tar`
            _ => continue,
        }
        mark(&mut touched, &rel);
    }
    Ok(())
}

/// `path` relative to the root without `.` parts; None for the root itself.
/// A `..` part is refused: layers have no business leaving the tree.
pub(crate) fn clean_relative(path: &Path) -> Result<Option<PathBuf>> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(p) => out.push(p),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(BuildError::UnsafePath(path.display().to_string()));
            }
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

/// The target of a symlink at `link` (relative to the root) that reaches the
/// same place inside the guest but never above the root on the host.
pub(crate) fn confine_link(link: &Path, target: &Path) -> PathBuf {
    let dir = link.parent().unwrap_or(Path::new(""));
    // where the link points in the guest, `..` stopping at `/`
    let mut abs: Vec<&std::ffi::OsStr> = Vec::new();
    let mut escapes = target.is_absolute();
    if !target.is_absolute() {
        abs.extend(dir.components().map(|c| c.as_os_str()));
    }
    for c in target.components() {
        match c {
            Component::Normal(p) => abs.push(p),
            Component::ParentDir if abs.pop().is_none() => escapes = true,
            _ => {}
        }
    }
    if !escapes {
        return target.to_path_buf();
    }
    let from: Vec<_> = dir.components().map(|c| c.as_os_str()).collect();
    let common = from.iter().zip(&abs).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..from.len() {
        out.push("..");
    }
    for p in &abs[common..] {
        out.push(p);
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    out
}

fn mark(touched: &mut HashSet<PathBuf>, rel: &Path) {
    for a in rel.ancestors() {
        if a.as_os_str().is_empty() || !touched.insert(a.to_path_buf()) {
            break;
        }
    }
}

/// Makes `rel` (relative to the root) a directory, creating parents as
/// root-owned 0755 like container runtimes do for entries without parents.
fn ensure_dir(root: &Path, rel: &Path) -> Result<()> {
    let mut cur = root.to_path_buf();
    for c in rel.components() {
        cur.push(c);
        // following symlinks is safe: every link in the tree is confined
        match fs::metadata(&cur) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => remove_any(&cur)?,
            Err(_) if fs::symlink_metadata(&cur).is_ok() => remove_any(&cur)?, // dangling link
            Err(_) => {}
        }
        fs::create_dir(&cur)
            .map_err(|e| BuildError::io(format!("creating {}", cur.display()), e))?;
    }
    Ok(())
}

/// Removes everything under `dir` that the current layer did not put there.
fn hide_lower(root: &Path, dir: &Path, touched: &HashSet<PathBuf>) -> Result<()> {
    let full = root.join(dir);
    let entries = fs::read_dir(&full)
        .map_err(|e| BuildError::io(format!("reading {}", full.display()), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| BuildError::io(format!("reading {}", full.display()), e))?;
        let rel = dir.join(entry.file_name());
        if !touched.contains(&rel) {
            remove_any(&root.join(&rel))?;
        } else if entry.file_type().is_ok_and(|t| t.is_dir()) {
            hide_lower(root, &rel, touched)?;
        }
    }
    Ok(())
}

/// Removes a file, link or directory tree; a missing path is fine.
fn remove_any(path: &Path) -> Result<()> {
    let r = match fs::symlink_metadata(path) {
        Err(_) => return Ok(()),
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
    };
    r.map_err(|e| BuildError::io(format!("removing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_confined_to_the_root() {
        let c = |l: &str, t: &str| confine_link(Path::new(l), Path::new(t));
        // kept as written when already inside
        assert_eq!(c("usr/bin/hi", "hello"), Path::new("hello"));
        assert_eq!(c("lib", "usr/lib"), Path::new("usr/lib"));
        assert_eq!(c("a/b/c", "../x"), Path::new("../x"));
        // absolute: made relative to the link's directory
        assert_eq!(c("sbin", "/usr/sbin"), Path::new("usr/sbin"));
        assert_eq!(
            c("etc/localtime", "/usr/share/zoneinfo/UTC"),
            Path::new("../usr/share/zoneinfo/UTC")
        );
        assert_eq!(c("etc/x", "/etc/y"), Path::new("y"));
        assert_eq!(c("a/b", "/"), Path::new(".."));
        // climbing above the root stops there, as in the guest
        assert_eq!(
            c("a/b", "../../../../etc/passwd"),
            Path::new("../etc/passwd")
        );
        assert_eq!(c("top", "../../etc"), Path::new("etc"));
    }

    #[test]
    fn entry_paths_are_cleaned_and_parent_parts_refused() {
        assert_eq!(
            clean_relative(Path::new("./a/./b")).unwrap(),
            Some(PathBuf::from("a/b"))
        );
        assert_eq!(
            clean_relative(Path::new("/a")).unwrap(),
            Some(PathBuf::from("a"))
        );
        assert_eq!(clean_relative(Path::new("./")).unwrap(), None);
        assert!(matches!(
            clean_relative(Path::new("a/../../b")),
            Err(BuildError::UnsafePath(_))
        ));
    }
}
