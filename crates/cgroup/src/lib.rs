//! A cgroup v2 group for every sandbox's VMM, under one parent group the node
//! owns (`<cgroup2 mount>/sandfork` by default): the guest's vCPUs, memory
//! and processes are limited where the kernel enforces them, so a guest (or a
//! VMM bug it triggers) cannot starve the node or its neighbours.
//!
//! Plain files under the cgroup2 mount: find the mount, enable the
//! controllers from its root down to the parent, make a group per VMM, write
//! its limits, move the VMM in, remove the group once the VMM is gone.

use std::io;
use std::path::{Path, PathBuf};

mod group;
mod limits;
mod mount;
pub mod mountinfo;

pub use group::{Group, Usage};
pub use limits::Limits;
pub use mount::cgroup2_mount;

/// The controllers a sandbox's group is limited by; `io` only where the
/// kernel has it (the others are required).
pub const REQUIRED_CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];
pub const OPTIONAL_CONTROLLERS: [&str; 1] = ["io"];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no cgroup2 file system is mounted (cgroup v1 hosts are not supported)")]
    NoCgroup2,
    #[error("the {0} controller is not available in {1}")]
    MissingController(&'static str, PathBuf),
    #[error(
        "cannot enable the controllers in {path}: {source} (a group with processes cannot \
         delegate: run the node in the root group or in a delegated group of its own)"
    )]
    Delegate {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("not a group name: {0:?}")]
    BadName(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Error {
    let path = path.to_owned();
    move |source| Error::Io { what, path, source }
}

/// The node's parent group, with the controllers delegated to its children.
#[derive(Debug, Clone)]
pub struct Cgroups {
    parent: PathBuf,
    io: bool,
}

impl Cgroups {
    /// `parent` (a path relative to the cgroup2 mount, e.g. `sandfork`) made
    /// ready for sandbox groups, under the host's cgroup2 mount.
    pub fn open(parent: &Path) -> Result<Cgroups> {
        let mount = cgroup2_mount()?.ok_or(Error::NoCgroup2)?;
        Cgroups::open_at(&mount, parent)
    }

    /// [`Cgroups::open`] under the cgroup2 file system mounted at `mount`.
    pub fn open_at(mount: &Path, parent: &Path) -> Result<Cgroups> {
        let mut at = mount.to_owned();
        let mut io = true;
        // Every level from the mount's root down to the parent hands the
        // controllers on to the next (cgroup v2's top-down delegation).
        let mut levels = vec![at.clone()];
        for part in parent.components() {
            at.push(part);
            levels.push(at.clone());
        }
        for level in &levels {
            std::fs::create_dir_all(level).map_err(io_err("creating", level))?;
            let available = read_words(&level.join("cgroup.controllers"))?;
            for c in REQUIRED_CONTROLLERS {
                if !available.iter().any(|a| a == c) {
                    return Err(Error::MissingController(c, level.clone()));
                }
            }
            io &= available.iter().any(|a| a == "io");
            let mut wanted: Vec<&str> = REQUIRED_CONTROLLERS.to_vec();
            if io {
                wanted.extend(OPTIONAL_CONTROLLERS);
            }
            enable(level, &wanted)?;
        }
        Ok(Cgroups { parent: at, io })
    }

    /// The parent group's directory.
    pub fn path(&self) -> &Path {
        &self.parent
    }

    /// A new group `name` with `limits` (an existing one of that name,
    /// left by an earlier process, is reused and its limits rewritten).
    pub fn create(&self, name: &str, limits: &Limits) -> Result<Group> {
        let path = self.child(name)?;
        match std::fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("creating", &path)(e)),
        }
        let group = Group::new(path);
        group.set_limits(limits, self.io)?;
        Ok(group)
    }

    /// The existing group `name` (a VMM adopted after a restart).
    pub fn adopt(&self, name: &str) -> Option<Group> {
        let path = self.child(name).ok()?;
        path.is_dir().then(|| Group::new(path))
    }

    /// The names of the groups under the parent (to remove those of VMMs
    /// that no longer exist at start).
    pub fn names(&self) -> Result<Vec<String>> {
        let entries = std::fs::read_dir(&self.parent).map_err(io_err("listing", &self.parent))?;
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("listing", &self.parent))?;
            if entry.file_type().is_ok_and(|t| t.is_dir())
                && let Some(name) = entry.file_name().to_str()
            {
                names.push(name.to_owned());
            }
        }
        names.sort();
        Ok(names)
    }

    fn child(&self, name: &str) -> Result<PathBuf> {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name != "."
            && name != ".."
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !ok || name.starts_with("cgroup.") {
            return Err(Error::BadName(name.to_owned()));
        }
        Ok(self.parent.join(name))
    }
}

fn read_words(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(io_err("reading", path))?;
    Ok(text.split_whitespace().map(str::to_owned).collect())
}

/// Enables `controllers` for `level`'s children, skipping those already on.
fn enable(level: &Path, controllers: &[&str]) -> Result<()> {
    let file = level.join("cgroup.subtree_control");
    let on = read_words(&file)?;
    let missing: Vec<String> = controllers
        .iter()
        .filter(|c| !on.iter().any(|o| o == *c))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    std::fs::write(&file, missing.join(" ")).map_err(|source| Error::Delegate {
        path: level.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory laid out as a cgroup2 level: the kernel's files as plain
    /// files (enabling is a write the test reads back).
    fn fake_level(dir: &Path, controllers: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("cgroup.controllers"), controllers).unwrap();
        std::fs::write(dir.join("cgroup.subtree_control"), "").unwrap();
    }

    #[test]
    fn names_that_could_leave_the_parent_are_refused() {
        let c = Cgroups {
            parent: "/sys/fs/cgroup/sandfork".into(),
            io: true,
        };
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../x",
            "cgroup.procs",
            &"x".repeat(65),
        ] {
            assert!(matches!(c.child(bad), Err(Error::BadName(_))), "{bad:?}");
        }
        assert_eq!(
            c.child("vmm-0a1b").unwrap(),
            Path::new("/sys/fs/cgroup/sandfork/vmm-0a1b")
        );
    }

    #[test]
    fn a_missing_required_controller_is_named() {
        let root = tempfile::tempdir().unwrap();
        fake_level(root.path(), "cpu pids io");
        let e = Cgroups::open_at(root.path(), Path::new("sandfork")).unwrap_err();
        assert!(
            matches!(e, Error::MissingController("memory", ref p) if p == root.path()),
            "{e}"
        );
    }

    #[test]
    fn controllers_are_enabled_from_the_root_down() {
        let root = tempfile::tempdir().unwrap();
        fake_level(root.path(), "cpuset cpu io memory pids");
        fake_level(&root.path().join("sandfork"), "cpu io memory pids");
        let c = Cgroups::open_at(root.path(), Path::new("sandfork")).unwrap();
        assert!(c.io);
        for level in [root.path().to_owned(), root.path().join("sandfork")] {
            let written = std::fs::read_to_string(level.join("cgroup.subtree_control")).unwrap();
            assert_eq!(written, "+cpu +memory +pids +io", "{level:?}");
        }
    }
}
