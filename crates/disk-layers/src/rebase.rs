//! Pointing a layer at a copy of its parent in another place: a chain copied
//! to another host (a paused sandbox moving between nodes) keeps every
//! layer's content and identity, only the recorded parent path changes.

use std::path::Path;

use crate::error::Result;
use crate::format::Parent;
use crate::layer::{LayerFile, record_parent};

/// Records `parent` as the parent of the layer at `layer`, keeping the
/// identity it expects (layer id, or raw size): the next open still refuses
/// a parent that is not the same one. The header goes to the other slot, so
/// a crash leaves the old path. Works on sealed layers too (only the header
/// changes; their bitmap and data stay as sealed).
pub fn set_parent_path(layer: &Path, parent: &Path) -> Result<()> {
    let mut file = LayerFile::open(layer, true)?;
    let recorded = record_parent(layer, parent)?;
    let mut header = file.header.clone();
    header.parent = match header.parent {
        Parent::None => return Ok(()),
        Parent::Raw { size, .. } => Parent::Raw {
            path: recorded,
            size,
        },
        Parent::Layer { id, .. } => Parent::Layer { path: recorded, id },
    };
    file.write_header(header)
}

/// The byte ranges of the layer file at `layer` that its content is in:
/// the headers and bitmap, and each allocated cluster (adjacent ones
/// merged). The rest is never read, so a copy may leave it out (zeros).
pub fn used_ranges(layer: &Path) -> Result<Vec<(u64, u64)>> {
    let file = LayerFile::open(layer, false)?;
    let layout = file.layout;
    let mut ranges: Vec<(u64, u64)> = vec![(0, layout.data_start)];
    for (w, word) in file.bitmap.iter().enumerate() {
        let mut bits = *word;
        while bits != 0 {
            let bit = u64::from(bits.trailing_zeros());
            bits &= bits - 1;
            let cluster = w as u64 * 64 + bit;
            let start = layout.cluster_offset(cluster);
            let end = start + layout.cluster_size;
            match ranges.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => ranges.push((start, end)),
            }
        }
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LayeredDisk;

    #[test]
    fn a_chain_moved_elsewhere_opens_after_its_parents_are_set() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let raw = a.join("base.raw");
        std::fs::write(&raw, vec![7u8; 1 << 20]).unwrap();
        let disk = LayeredDisk::create(&raw, &a.join("l1")).unwrap();
        disk.write_at(&[1; 4096], 8192).unwrap();
        disk.flush().unwrap();
        let branched = disk.seal_and_branch(&a.join("l2"), &[]).unwrap();
        drop(branched);
        drop(disk);
        // Copy every file elsewhere, under other names.
        for (from, to) in [
            ("base.raw", "raw-copy"),
            ("l1", "sealed-copy"),
            ("l2", "top"),
        ] {
            std::fs::copy(a.join(from), b.join(to)).unwrap();
        }
        std::fs::remove_dir_all(&a).unwrap();
        assert!(LayeredDisk::open(&b.join("top")).is_err());
        set_parent_path(&b.join("top"), &b.join("sealed-copy")).unwrap();
        set_parent_path(&b.join("sealed-copy"), &b.join("raw-copy")).unwrap();
        let moved = LayeredDisk::open(&b.join("top")).unwrap();
        let mut buf = [0u8; 4096];
        moved.read_at(&mut buf, 8192).unwrap();
        assert_eq!(buf, [1; 4096]);
        moved.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [7; 4096]);
        drop(moved);
        // Only the header, bitmap and written cluster matter.
        let used = used_ranges(&b.join("top")).unwrap();
        assert_eq!(used.len(), 1);
        let sealed = used_ranges(&b.join("sealed-copy")).unwrap();
        assert_eq!(sealed.len(), 2);
        assert_eq!(sealed[1].1 - sealed[1].0, 4096);
        // A parent of another identity is still refused.
        std::fs::write(b.join("other.raw"), vec![0u8; 2 << 20]).unwrap();
        set_parent_path(&b.join("sealed-copy"), &b.join("other.raw")).unwrap();
        assert!(LayeredDisk::open(&b.join("top")).is_err());
    }
}
