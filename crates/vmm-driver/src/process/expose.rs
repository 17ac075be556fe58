//! Handing a running jailed VMM the files an API call names: each path that
//! lies in one of its staged directories (see [`Jail::staged`]) is
//! bind-mounted at its own path inside its jail, read-only unless the VMM
//! writes it.
//!
//! The binds are made in the VMM's mount namespace only, never on the host:
//! they end with the VMM (nothing to clean up or leak, a crashed server
//! included), an adopting server hands more the same way, and the host's
//! files stay deletable (a bind in another namespace does not pin them).
//! The server is multi-threaded and only a thread with a file-system
//! context of its own may join a mount namespace, so one thread of its own
//! leaves the server's (`unshare(CLONE_FS)`), joins the VMM's (`setns`),
//! moves the binds in and ends. The binds are cloned (`open_tree`) on the
//! host first.
//!
//! Paths are resolved without following symbolic links below a staged
//! directory, on the host and in the jail: the VMM writes some of the
//! directories it is handed (fork and snapshot destinations), and a link it
//! plants there must not lead the server to bind a file of its choosing.
//!
//! [`Jail::staged`]: super::Jail::staged

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::mount::{MoveMountFlags, OpenTreeFlags};

use super::jail::STAGED_SOURCE;

/// How a VMM may use a path it is handed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Access {
    Read,
    Write,
}

/// A jailed VMM's staged directories (see [`Jail::staged`](super::Jail::staged)), read from its
/// mount table (paths in its root, which are the host's).
pub(crate) struct Staged {
    dirs: Vec<PathBuf>,
    /// Each directory with links resolved: a disk's chain comes canonical,
    /// and a staged directory reached through a link of the host's is found
    /// by its target too.
    canonical: Vec<Option<PathBuf>>,
}

impl Staged {
    pub(crate) fn of(pid: u32) -> io::Result<Staged> {
        let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
        let dirs = parse_staged(&table);
        let canonical = dirs.iter().map(|d| d.canonicalize().ok()).collect();
        Ok(Staged { dirs, canonical })
    }

    /// Whether `path` lies in a staged directory (is exposed when handed).
    pub(crate) fn holds(&self, path: &Path) -> bool {
        self.locate(path).is_some()
    }

    /// The staged directory `p` lies in, and `p` by that directory's path.
    fn locate(&self, p: &Path) -> Option<(usize, PathBuf)> {
        if let Some(i) = self.dirs.iter().position(|d| p.starts_with(d) && p != d) {
            return Some((i, p.to_owned()));
        }
        self.canonical.iter().enumerate().find_map(|(i, c)| {
            let rest = p.strip_prefix(c.as_ref()?).ok()?;
            (!rest.as_os_str().is_empty()).then(|| (i, self.dirs[i].join(rest)))
        })
    }
}

/// Exposes into the jail of the VMM `pid` each of `paths` that lies in one
/// of its `staged` directories, shallow paths first; one visible already
/// (itself or through a directory exposed before) is skipped, and so is a
/// missing one (a destination the VMM creates in a directory it is handed).
/// Paths elsewhere are the jail's fixed binds' business and left alone.
pub(crate) fn expose(pid: u32, staged: &Staged, paths: &[(PathBuf, Access)]) -> io::Result<()> {
    let mut wanted: Vec<(&Path, PathBuf, Access)> = paths
        .iter()
        .filter(|(p, _)| p.components().all(|c| !matches!(c, Component::ParentDir)))
        .filter_map(|(p, access)| {
            let (i, path) = staged.locate(p)?;
            Some((staged.dirs[i].as_path(), path, *access))
        })
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    // Directories before what they hold; a path named twice, writable if
    // either asks for it (sorted so, the last of equals is kept).
    wanted.sort_by_key(|(_, p, access)| (p.components().count(), p.clone(), *access));
    wanted.reverse();
    wanted.dedup_by(|a, b| a.1 == b.1);
    wanted.reverse();
    let mut trees = Vec::with_capacity(wanted.len());
    for (dir, path, access) in wanted {
        if let Some(tree) = Tree::clone_of(dir, &path, access)? {
            trees.push(tree);
        }
    }
    let ns = rustix::fs::open(
        format!("/proc/{pid}/ns/mnt"),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // Its root, by which paths in the jail are resolved: joining the
    // namespace sets a thread's root to the namespace's first mount, which
    // is the jail's only when the host's root was mounted at `/` (in the lab
    // it is not).
    let root = rustix::fs::open(
        format!("/proc/{pid}/root"),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    std::thread::Builder::new()
        .name("vmm-expose".into())
        .spawn(move || bind_in(&ns, &root, &trees))?
        .join()
        .map_err(|_| io::Error::other("the thread exposing files to a VMM panicked"))?
}

/// A host file or directory cloned as a detached bind, ready to move into a
/// jail at `path`.
struct Tree {
    fd: OwnedFd,
    staged: PathBuf,
    path: PathBuf,
    dir: bool,
    dev: u64,
    ino: u64,
}

impl Tree {
    /// `path` (in staged directory `staged`) cloned, `access` applied; None
    /// if it does not exist.
    fn clone_of(staged: &Path, path: &Path, access: Access) -> io::Result<Option<Tree>> {
        let rel = path.strip_prefix(staged).map_err(io::Error::other)?;
        let base = match rustix::fs::open(
            staged,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let file = match rustix::fs::openat2(
            &base,
            rel,
            OFlags::PATH | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(with_path(e.into(), "opening", path)),
        };
        let stat = rustix::fs::fstat(&file)?;
        let kind = FileType::from_raw_mode(stat.st_mode);
        if !matches!(kind, FileType::RegularFile | FileType::Directory) {
            return Err(with_path(
                io::Error::other("neither a file nor a directory"),
                "exposing",
                path,
            ));
        }
        let fd = rustix::mount::open_tree(
            &file,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )
        .map_err(|e| with_path(e.into(), "cloning", path))?;
        set_attributes(&fd, access).map_err(|e| with_path(e, "hardening the bind of", path))?;
        Ok(Some(Tree {
            fd,
            staged: staged.to_owned(),
            path: path.to_owned(),
            dir: kind == FileType::Directory,
            dev: stat.st_dev,
            ino: stat.st_ino,
        }))
    }
}

/// `struct mount_attr` of `<linux/mount.h>` (not in the libc crate).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;
/// `MS_PRIVATE` as `mount_attr` takes it.
const MS_PRIVATE: u64 = 1 << 18;

/// Nothing in a bind is executed, set-id or a device; read-only unless
/// written; private, so that no mount made on either side ever propagates
/// to the other (the clone of a shared host mount would join its group).
fn set_attributes(tree: &OwnedFd, access: Access) -> io::Result<()> {
    let hardened = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
    let attr = MountAttr {
        attr_set: match access {
            Access::Read => hardened | MOUNT_ATTR_RDONLY,
            Access::Write => hardened,
        },
        attr_clr: match access {
            Access::Read => 0,
            Access::Write => MOUNT_ATTR_RDONLY,
        },
        propagation: MS_PRIVATE,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr(2) reads the struct it is given, of the size
    // passed, and the empty NUL-terminated path; it writes nothing.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            std::ptr::from_ref(&attr),
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The thread that joins the VMM's mount namespace: moves `trees` in.
fn bind_in(ns: &OwnedFd, root: &OwnedFd, trees: &[Tree]) -> io::Result<()> {
    // SAFETY: only the file-system context (root, working directory,
    // umask) is unshared, not the descriptor table: every thread keeps
    // seeing the same descriptors.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::FS) }?;
    rustix::thread::move_into_link_name_space(
        ns.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Mount),
    )?;
    for tree in trees {
        place(root, tree).map_err(|e| with_path(e, "exposing", &tree.path))?;
    }
    Ok(())
}

/// Binds `tree` at its path in the jail whose root is `root` (in this
/// thread's mount namespace), making the directories and the empty file or
/// directory it lands on.
fn place(root: &OwnedFd, tree: &Tree) -> io::Result<()> {
    let no_links = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS;
    let dir_flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    // The staged directory itself: a tmpfs the jail was built with.
    let staged = tree.staged.strip_prefix("/").map_err(io::Error::other)?;
    let mut dir = rustix::fs::openat2(root, staged, dir_flags, Mode::empty(), no_links)?;
    let rel = tree
        .path
        .strip_prefix(&tree.staged)
        .map_err(io::Error::other)?;
    let names: Vec<&OsStr> = rel.iter().collect();
    let Some((name, parents)) = names.split_last() else {
        return Ok(());
    };
    for part in parents {
        dir = match rustix::fs::openat2(&dir, *part, dir_flags, Mode::empty(), no_links) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => {
                match rustix::fs::mkdirat(&dir, *part, Mode::from_bits_truncate(0o755)) {
                    Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                rustix::fs::openat2(&dir, *part, dir_flags, Mode::empty(), no_links)?
            }
            Err(e) => return Err(e.into()),
        };
    }
    match rustix::fs::statat(&dir, *name, AtFlags::SYMLINK_NOFOLLOW) {
        // Visible already, itself or through its directory.
        Ok(st) if (st.st_dev, st.st_ino) == (tree.dev, tree.ino) => return Ok(()),
        Ok(st) => {
            let kind = FileType::from_raw_mode(st.st_mode);
            let fits = match tree.dir {
                true => kind == FileType::Directory,
                false => kind == FileType::RegularFile,
            };
            // An empty file or directory bound on before, or an older file
            // of that name: the new bind covers it.
            if !fits {
                return Err(io::Error::other(format!(
                    "a {kind:?} in the jail where it goes"
                )));
            }
        }
        // (Made meanwhile by a call handing it too: as good.)
        Err(rustix::io::Errno::NOENT) if tree.dir => {
            match rustix::fs::mkdirat(&dir, *name, Mode::from_bits_truncate(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Err(rustix::io::Errno::NOENT) => {
            rustix::fs::openat(
                &dir,
                *name,
                OFlags::CREATE | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_bits_truncate(0o644),
            )?;
        }
        Err(e) => return Err(e.into()),
    }
    rustix::mount::move_mount(
        &tree.fd,
        "",
        &dir,
        *name,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}

fn parse_staged(mountinfo: &str) -> Vec<PathBuf> {
    cgroup::mountinfo::parse(mountinfo)
        .into_iter()
        .filter(|m| m.fs_type == "tmpfs" && m.source.as_bytes() == STAGED_SOURCE.to_bytes())
        .map(|m| m.point)
        .collect()
}

fn with_path(e: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_staged_directories_in_a_mount_table() {
        let table = "\
22 1 0:21 / / ro,nosuid - tmpfs tmpfs ro,size=1024k\n\
23 22 0:22 / /data/sandboxes rw,nosuid,nodev,noexec - tmpfs sandfork-staged rw,size=64k\n\
24 22 0:23 / /data/my\\040forks rw,nosuid,nodev,noexec - tmpfs sandfork-staged rw\n\
25 22 8:1 /run/x /run/x rw - ext4 /dev/sda1 rw\n\
26 22 0:24 / /tmp rw - tmpfs tmpfs rw\n";
        assert_eq!(
            parse_staged(table),
            [
                PathBuf::from("/data/sandboxes"),
                PathBuf::from("/data/my forks")
            ]
        );
    }
}
