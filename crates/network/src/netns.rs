//! Network namespaces: made on a thread with `unshare`, anchored by a bind mount in sandfork's
//! runtime directory (not `/run/netns`) so they outlive the process that made them and can be
//! found again after a restart; entered by short-lived threads.

use std::fs::{self, File, OpenOptions};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::thread;

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};

use crate::error::{Error, Result};

/// Runs `f` on a new thread that has entered the namespace `ns`: the calling thread's own
/// namespace never changes.
pub fn run_in<T: Send>(ns: &OwnedFd, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    thread::scope(|s| {
        s.spawn(|| {
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| Error::sys("setns", e))?;
            f()
        })
        .join()
        .unwrap_or_else(|_| {
            Err(Error::sys(
                "namespace thread",
                std::io::Error::other("panicked"),
            ))
        })
    })
}

/// Runs `f` on a new thread in a new network namespace, which `f` may configure; the namespace
/// is then bind-mounted on `anchor`. Returns `f`'s value and the namespace's fd. On an error the
/// namespace goes away with the thread (nothing anchors it).
pub fn create_anchored<T: Send>(
    anchor: &Path,
    f: impl FnOnce(&OwnedFd) -> Result<T> + Send,
) -> Result<(T, OwnedFd)> {
    thread::scope(|s| {
        s.spawn(|| {
            unshare(CloneFlags::CLONE_NEWNET)
                .map_err(|e| Error::sys("unshare(CLONE_NEWNET)", e))?;
            let own: OwnedFd = File::open("/proc/thread-self/ns/net")
                .map_err(|e| Error::sys("open own netns", e))?
                .into();
            let value = f(&own)?;
            OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(anchor)
                .map_err(|e| Error::sys(format!("create {}", anchor.display()), e))?;
            mount(
                Some("/proc/thread-self/ns/net"),
                anchor,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| {
                let _ = fs::remove_file(anchor);
                Error::sys(format!("bind mount {}", anchor.display()), e)
            })?;
            Ok((value, own))
        })
        .join()
        .unwrap_or_else(|_| {
            Err(Error::sys(
                "namespace thread",
                std::io::Error::other("panicked"),
            ))
        })
    })
}

/// Opens an anchored namespace.
pub fn open(anchor: &Path) -> Result<OwnedFd> {
    Ok(File::open(anchor)
        .map_err(|e| Error::sys(format!("open {}", anchor.display()), e))?
        .into())
}

/// Drops the anchor: the namespace goes once no process or fd holds it.
pub fn remove_anchor(anchor: &Path) -> Result<()> {
    match umount2(anchor, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
        Err(e) => return Err(Error::sys(format!("unmount {}", anchor.display()), e)),
    }
    match fs::remove_file(anchor) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::sys(format!("remove {}", anchor.display()), e)),
    }
}

/// Makes `dir` a private mount of itself (once), as `ip netns` does for `/run/netns`: anchors
/// mounted in it then do not propagate into other mount namespaces, where they would keep
/// namespaces alive after their removal here.
pub fn prepare_anchor_dir(dir: &Path) -> Result<PathBuf> {
    fs::create_dir_all(dir).map_err(|e| Error::sys(format!("create {}", dir.display()), e))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| Error::sys(format!("resolve {}", dir.display()), e))?;
    if !is_mount_point(&dir)? {
        mount(
            Some(&dir),
            &dir,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| Error::sys(format!("bind mount {}", dir.display()), e))?;
    }
    mount(
        None::<&str>,
        &dir,
        None::<&str>,
        MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| Error::sys(format!("make {} private", dir.display()), e))?;
    Ok(dir)
}

fn is_mount_point(dir: &Path) -> Result<bool> {
    let info =
        fs::read_to_string("/proc/self/mountinfo").map_err(|e| Error::sys("read mountinfo", e))?;
    let want = dir.to_string_lossy();
    Ok(info.lines().any(|l| l.split(' ').nth(4) == Some(&want)))
}

/// Writes a sysctl of the calling thread's network namespace (`/proc/sys/net/...` resolves
/// to the namespace of the thread that opens it).
pub fn sysctl(path: &str, value: &str) -> Result<()> {
    fs::write(format!("/proc/sys/{path}"), value)
        .map_err(|e| Error::sys(format!("sysctl {path}"), e))
}

/// Moves the calling thread into the network namespace `ns`. Meant for a child between fork
/// and exec (`CommandExt::pre_exec`): the VMM then starts inside the slot and finds `tap0`
/// there. Only a system call: safe in a forked child.
pub fn enter(ns: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    setns(ns, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
}
