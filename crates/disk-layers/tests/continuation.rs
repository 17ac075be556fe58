//! A fork in three steps: the parent's next layer made ahead of the seal,
//! the seal and switch, the children stacked on the sealed layer later.

#![cfg(test)]

mod common;

use std::path::PathBuf;

use common::{assert_content, fill, layer_on_base};
use disk_layers::LayeredDisk;

/// Children stacked after the seal see the disk as it was at the seal:
/// what the parent wrote before it (even after its next layer was made)
/// and nothing it wrote after, though their layers are made after those
/// writes; what a child writes reaches neither the parent nor its siblings.
#[test]
fn children_stacked_after_the_seal_see_the_disk_as_it_was_at_the_seal() {
    let (dir, parent, mut model) = layer_on_base("p0", 256 * 1024);
    let d = dir.path();
    fill(&parent, &mut model, 5_000, 10_000, 0xaa);
    let next = parent.prepare_continuation(&d.join("p1")).unwrap();
    assert_eq!(next.path(), d.join("p1"));
    // Written after the next layer was made and before the seal: in the
    // sealed layer, so the children see it.
    fill(&parent, &mut model, 30_000, 5_000, 0xbb);
    let sealed = parent.seal_and_continue(next).unwrap();
    assert_eq!(sealed.path, d.join("p0"));
    let at_seal = model.clone();
    let sealed_bytes = std::fs::read(d.join("p0")).unwrap();
    assert_eq!(parent.depth(), 2);
    assert_eq!(parent.chain_paths()[0], d.join("p1"));

    // The parent runs on, overwriting what the children must still see,
    // and flushes it, before any child's layer exists.
    let mut parent_model = model;
    fill(&parent, &mut parent_model, 4_096, 20_000, 0xcc);
    fill(&parent, &mut parent_model, 100_000, 3_000, 0xdd);
    parent.flush().unwrap();

    let kids: Vec<PathBuf> = (0..4).map(|i| d.join(format!("child{i}"))).collect();
    sealed.stack(&kids).unwrap();
    fill(&parent, &mut parent_model, 60_000, 1_000, 0xee);
    let children: Vec<LayeredDisk> = kids.iter().map(|k| LayeredDisk::open(k).unwrap()).collect();
    for (i, child) in children.iter().enumerate() {
        assert_eq!(child.depth(), 2);
        assert_content(child, &at_seal, &format!("child {i} as at the seal"));
    }
    assert_content(&parent, &parent_model, "the parent after the seal");

    // Each child writes its own byte; nobody else sees it.
    let mut models = vec![at_seal.clone(); children.len()];
    for (i, child) in children.iter().enumerate() {
        fill(child, &mut models[i], 8_192, 4_096, i as u8);
        child.flush().unwrap();
    }
    for (i, child) in children.iter().enumerate() {
        assert_content(child, &models[i], &format!("child {i} after diverging"));
    }
    assert_content(
        &parent,
        &parent_model,
        "the parent after the children wrote",
    );
    // The sealed layer was never written again.
    assert_eq!(std::fs::read(d.join("p0")).unwrap(), sealed_bytes);
    drop(children);
    drop(parent);
    let reopened = LayeredDisk::open(&d.join("p1")).unwrap();
    assert_content(&reopened, &parent_model, "the parent reopened");
    for (i, k) in kids.iter().enumerate() {
        let child = LayeredDisk::open(k).unwrap();
        assert_content(&child, &models[i], &format!("child {i} reopened"));
    }
}

/// A layer prepared for a top that was sealed meanwhile is refused and
/// removed, the disk left as it was; one dropped unused is removed too.
#[test]
fn a_continuation_is_only_for_the_top_it_was_made_on_and_never_left_behind() {
    let (dir, disk, mut model) = layer_on_base("p0", 64 * 1024);
    let d = dir.path();
    fill(&disk, &mut model, 0, 4_096, 0x11);
    let stale = disk.prepare_continuation(&d.join("stale")).unwrap();
    disk.seal_and_branch(&d.join("p1"), &[]).unwrap();
    assert!(disk.seal_and_continue(stale).is_err());
    assert!(!d.join("stale").exists());
    fill(&disk, &mut model, 8_192, 4_096, 0x22);
    assert_content(&disk, &model, "the disk after a refused switch");
    assert_eq!(disk.chain_paths()[0], d.join("p1"));

    drop(disk.prepare_continuation(&d.join("unused")).unwrap());
    assert!(!d.join("unused").exists());
    // A path taken is refused, and not removed.
    assert!(disk.prepare_continuation(&d.join("p0")).is_err());
    assert!(d.join("p0").exists());
    // Stacking children twice on one path is refused before anything is made.
    let next = disk.prepare_continuation(&d.join("p2")).unwrap();
    let sealed = disk.seal_and_continue(next).unwrap();
    let twice = [d.join("k"), d.join("k")];
    assert!(sealed.stack(&twice).is_err());
    assert!(!d.join("k").exists());
}
