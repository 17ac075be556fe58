//! A guest's lineage: the directories whose files its VMM may be handed
//! when it loads or boots the guest (its sandbox's own, the forks and
//! sandboxes its disk and memory stack on, its templates).
//!
//! Most of what a load hands over is named by files VMMs wrote: a state
//! file names its memory files, a layer header its parent, a fork's answer
//! its children's layers. A VMM is not trusted (its guest may have taken it
//! over), and one that named another sandbox's layer in a header it wrote
//! would have the next VMM handed that layer, and its guest read it. So a
//! jailed VMM is handed a file for a guest only inside the guest's lineage,
//! which the server derives from its own records.

use std::path::{Component, Path, PathBuf};

/// The directories a guest's files may lie in. Empty: none (a jailed VMM
/// is then handed nothing in its staged directories for a guest).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lineage {
    dirs: Vec<PathBuf>,
}

impl Lineage {
    pub fn new(dirs: impl IntoIterator<Item = PathBuf>) -> Lineage {
        let mut lineage = Lineage::default();
        for dir in dirs {
            if !lineage.dirs.contains(&dir) {
                lineage.dirs.push(dir);
            }
        }
        lineage
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Whether `path` lies inside one of its directories, as named or with
    /// links resolved on either side (disk chains are read canonical; a
    /// data dir may be reached through a link). A path that climbs (`..`)
    /// never does.
    pub fn holds(&self, path: &Path) -> bool {
        if path.components().any(|c| c == Component::ParentDir) {
            return false;
        }
        let inside = |p: &Path, dir: &Path| p != dir && p.starts_with(dir);
        // As named first: links are resolved (file system calls, on every
        // load) only for a path no directory holds by name.
        if self.dirs.iter().any(|dir| inside(path, dir)) {
            return true;
        }
        let canonical = path.canonicalize().ok();
        self.dirs.iter().any(|dir| {
            let dir_canonical = dir.canonicalize().ok();
            [Some(path), canonical.as_deref()]
                .into_iter()
                .flatten()
                .any(|p| inside(p, dir) || dir_canonical.as_deref().is_some_and(|d| inside(p, d)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_lies_below_its_directories_only() {
        let base = tempfile::tempdir().unwrap();
        let real = base.path().join("real");
        std::fs::create_dir_all(real.join("sandboxes/mine")).unwrap();
        std::fs::create_dir_all(real.join("sandboxes/theirs")).unwrap();
        std::fs::write(real.join("sandboxes/mine/root.layer"), "").unwrap();
        std::os::unix::fs::symlink("real", base.path().join("data")).unwrap();
        let lineage = Lineage::new([
            base.path().join("data/sandboxes/mine"),
            base.path().join("data/sandboxes/mine"),
        ]);
        assert_eq!(lineage.dirs().len(), 1);

        assert!(lineage.holds(&base.path().join("data/sandboxes/mine/root.layer")));
        // The same file by its canonical path (as a chain is read).
        assert!(lineage.holds(&real.join("sandboxes/mine/root.layer")));
        assert!(lineage.holds(&base.path().join("data/sandboxes/mine/snap-1/vm.mem")));
        // Not the directory itself, a neighbour, a prefix of a name, or a climb.
        assert!(!lineage.holds(&base.path().join("data/sandboxes/mine")));
        assert!(!lineage.holds(&base.path().join("data/sandboxes/theirs/root.layer")));
        assert!(!lineage.holds(&base.path().join("data/sandboxes/mine2/root.layer")));
        assert!(!lineage.holds(&base.path().join("data/sandboxes/mine/../theirs/root.layer")));
        assert!(!Lineage::default().holds(&real.join("sandboxes/mine/root.layer")));
    }
}
