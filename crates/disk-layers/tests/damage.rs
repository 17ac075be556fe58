//! Damaged, missing and swapped files are refused with the right error, and a crash
//! at any step leaves every layer readable and consistent.

#![cfg(test)]

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::{assert_content, base_image, fill, layer_on_base, read_all};
use disk_layers::{Error, LayeredDisk, compact, compact_temp_path, unreferenced};

/// base.img <- s1 <- s2 <- top, with something written in each layer.
fn chain(d: &Path) -> (LayeredDisk, Vec<u8>) {
    let (base, mut model) = base_image(d, "base.img", 64 * 1024);
    let disk = LayeredDisk::create(&base, &d.join("s1")).unwrap();
    for (i, next) in ["s2", "top"].iter().enumerate() {
        let off = 1000 + i * 10_000;
        fill(&disk, &mut model, off, 6000, i as u8 + 1);
        disk.seal_and_branch(&d.join(next), &[]).unwrap();
    }
    (disk, model)
}

/// [`chain`] in a new directory, closed: its files and the model of its content.
fn closed_chain() -> (tempfile::TempDir, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let (_, model) = chain(dir.path());
    (dir, model)
}

fn open_rw(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new().write(true).open(path).unwrap()
}

fn poke(path: &Path, at: u64, bytes: &[u8]) {
    open_rw(path).write_all_at(bytes, at).unwrap();
}

fn open_err(top: &Path) -> Error {
    LayeredDisk::open(top).expect_err("open should fail")
}

/// Asserts that opening `path` fails with an error matching the pattern.
macro_rules! assert_open_err {
    ($path:expr, $($pattern:tt)+) => {{
        let err = open_err($path);
        assert!(matches!(&err, $($pattern)+), "{err}");
    }};
}

#[test]
fn both_header_slots_damaged_is_corrupt_header() {
    let (dir, _) = closed_chain();
    let d = dir.path();
    poke(&d.join("s2"), 20, &[0xff; 4]);
    poke(&d.join("s2"), 4096 + 20, &[0xff; 4]);
    assert_open_err!(&d.join("top"), Error::CorruptHeader { path, reason } if path.ends_with("s2") && reason.contains("checksum"));
}

#[test]
fn one_damaged_slot_falls_back_to_the_other() {
    let (dir, model) = closed_chain();
    let d = dir.path();
    // s2 was created in slot 1 (generation 1) and sealed in slot 0 (generation 2):
    // the older, unsealed slot is the one damaged, so nothing changes.
    poke(&d.join("s2"), 4096 + 20, &[0xff; 4]);
    let disk = LayeredDisk::open(&d.join("top")).unwrap();
    assert_content(&disk, &model, "with a damaged old slot");
}

#[test]
fn a_not_a_layer_file_or_no_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _) = base_image(dir.path(), "base.img", 64 * 1024);
    assert_open_err!(&base, Error::CorruptHeader { reason, .. } if reason.contains("magic"));
    assert_open_err!(&dir.path().join("nope"), Error::NotFound { .. });
}

#[test]
fn truncated_layer_is_refused() {
    let (dir, _) = closed_chain();
    let d = dir.path();
    let f = open_rw(&d.join("s1"));
    let len = f.metadata().unwrap().len();
    f.set_len(len - 4096).unwrap();
    assert_open_err!(&d.join("top"), Error::Truncated { path, expected, actual } if path.ends_with("s1") && *expected == len && *actual == len - 4096);
    // Cut into the header itself.
    f.set_len(100).unwrap();
    assert_open_err!(&d.join("top"), Error::CorruptHeader { .. });
}

#[test]
fn missing_parent_is_named() {
    let (dir, _) = closed_chain();
    let d = dir.path();
    std::fs::rename(d.join("s1"), d.join("elsewhere")).unwrap();
    assert_open_err!(&d.join("top"), Error::MissingParent { layer, parent } if layer.ends_with("s2") && parent.ends_with("s1"));
    std::fs::rename(d.join("elsewhere"), d.join("s1")).unwrap();
    std::fs::remove_file(d.join("base.img")).unwrap();
    assert_open_err!(&d.join("top"), Error::MissingParent { layer, parent } if layer.ends_with("s1") && parent.ends_with("base.img"));
}

#[test]
fn swapped_parent_or_resized_base_is_a_mismatch() {
    let (dir, _) = closed_chain();
    let d = dir.path();
    // Another sealed layer of the same geometry put where s2 was.
    let other = LayeredDisk::create(&d.join("s1"), &d.join("other")).unwrap();
    other.seal_and_branch(&d.join("other-top"), &[]).unwrap();
    drop(other);
    std::fs::rename(d.join("other"), d.join("s2")).unwrap();
    assert_open_err!(&d.join("top"), Error::ParentMismatch { layer, .. } if layer.ends_with("top"));

    let (dir, _) = closed_chain();
    let d = dir.path();
    let f = open_rw(&d.join("base.img"));
    f.set_len(128 * 1024).unwrap();
    assert_open_err!(&d.join("top"), Error::ParentMismatch { found, .. } if found.contains("131072"));
}

#[test]
fn flipped_bitmap_bit_in_a_sealed_layer_is_corrupt_bitmap() {
    let (dir, _) = closed_chain();
    let d = dir.path();
    let f = std::fs::File::open(d.join("s2")).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 8192 + 1).unwrap();
    poke(&d.join("s2"), 8192 + 1, &[b[0] ^ 0x10]);
    assert_open_err!(&d.join("top"), Error::CorruptBitmap { path, reason } if path.ends_with("s2") && reason.contains("checksum"));
}

#[test]
fn bounds_and_read_only_and_bad_arguments_are_typed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, model) = chain(d);
    let size = disk.len();
    let mut buf = [0u8; 10];
    assert!(matches!(
        disk.read_at(&mut buf, size - 5),
        Err(Error::OutOfBounds { offset, len: 10, .. }) if offset == size - 5
    ));
    assert!(matches!(
        disk.write_at(&buf, u64::MAX - 2),
        Err(Error::OutOfBounds { .. })
    ));
    disk.read_at(&mut [], size).unwrap();

    // A sealed layer opens read-only and can still be branched from.
    let sealed = LayeredDisk::open(&d.join("s2")).unwrap();
    assert!(sealed.is_read_only());
    assert!(matches!(
        sealed.write_at(&[1], 0),
        Err(Error::ReadOnly { path }) if path.ends_with("s2")
    ));
    let kids = sealed
        .seal_and_branch(&d.join("s2-a"), &[d.join("s2-b")])
        .unwrap();
    assert!(!sealed.is_read_only());
    sealed.write_at(&[0xee; 3], 0).unwrap();
    // s2 holds everything written (the top had no writes yet).
    assert_content(&kids[0], &model, "a child of a sealed layer");
    let mut own = model.clone();
    own[..3].fill(0xee);
    assert_content(&sealed, &own, "the reopened sealed layer, continued");

    assert!(matches!(
        LayeredDisk::create(&d.join("base.img"), &d.join("top")),
        Err(Error::Exists { .. })
    ));
    let r = LayeredDisk::create(&d.join("top"), &d.join("x"));
    assert!(matches!(r, Err(Error::ParentNotSealed { .. })), "{r:?}");
    assert!(matches!(
        LayeredDisk::create_with_cluster_size(&d.join("s1"), &d.join("y"), 65536),
        Err(Error::Geometry { .. })
    ));
    assert!(matches!(
        LayeredDisk::create_with_cluster_size(&d.join("base.img"), &d.join("z"), 3000),
        Err(Error::InvalidArgument(_))
    ));
    assert!(!d.join("x").exists() && !d.join("y").exists() && !d.join("z").exists());
}

#[test]
fn a_failed_branch_leaves_the_disk_writable_and_no_new_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, mut model) = chain(d);
    std::fs::write(d.join("taken"), b"x").unwrap();
    let err = disk
        .seal_and_branch(&d.join("next"), &[d.join("kid"), d.join("taken")])
        .unwrap_err();
    assert!(matches!(err, Error::Exists { .. }), "{err}");
    assert!(!d.join("next").exists() && !d.join("kid").exists());
    fill(&disk, &mut model, 0, 10, 5);
    drop(disk);
    let disk = LayeredDisk::open(&d.join("top")).unwrap();
    assert!(!disk.is_read_only());
    assert_content(&disk, &model, "after a failed branch");
}

/// Per cluster, the content after a crash must be the flushed one or the latest one.
fn assert_between(got: &[u8], flushed: &[u8], latest: &[u8], what: &str) {
    for (i, ((g, f), l)) in got
        .chunks(4096)
        .zip(flushed.chunks(4096))
        .zip(latest.chunks(4096))
        .enumerate()
    {
        assert!(
            g == f || g == l,
            "{what}: cluster {i} is neither flushed nor latest"
        );
    }
}

#[test]
fn a_crash_keeps_everything_flushed() {
    let (dir, disk, mut model) = layer_on_base("top", 64 * 1024);
    let d = dir.path();
    fill(&disk, &mut model, 0, 4 * 4096, 1);
    disk.flush().unwrap();
    let flushed = model.clone();
    // After the flush: overwrite flushed clusters, fill new ones, copy one up.
    fill(&disk, &mut model, 2 * 4096, 4 * 4096, 2);
    fill(&disk, &mut model, 8 * 4096 + 7, 100, 3);
    assert_content(&disk, &model, "before the crash");
    // A crash: the process dies without flushing or closing.
    std::mem::forget(disk);
    let disk = LayeredDisk::open(&d.join("top")).unwrap();
    assert_between(&read_all(&disk), &flushed, &model, "after the crash");
    // The new clusters' bits never reached the file, so they read as before.
    let got = read_all(&disk);
    assert_eq!(got[4 * 4096..], flushed[4 * 4096..]);
}

#[test]
fn a_crash_before_the_seal_header_leaves_the_old_top_writable() {
    let (dir, disk, mut model) = layer_on_base("top", 64 * 1024);
    let d = dir.path();
    fill(&disk, &mut model, 3000, 5000, 1);
    disk.flush().unwrap();
    let before_seal = std::fs::read(d.join("top")).unwrap();
    let _kids = disk
        .seal_and_branch(&d.join("next"), &[d.join("kid")])
        .unwrap();
    disk.write_at(&[9; 10], 0).unwrap();
    std::mem::forget(disk);
    // The new layers were made, but the sealing header never reached the disk.
    std::fs::write(d.join("top"), &before_seal).unwrap();
    for p in ["next", "kid"] {
        let err = open_err(&d.join(p));
        assert!(matches!(err, Error::ParentNotSealed { .. }), "{p}: {err}");
    }
    let disk = LayeredDisk::open(&d.join("top")).unwrap();
    assert!(!disk.is_read_only());
    assert_content(&disk, &model, "old top after the crash");
    let files = [
        d.join("base.img"),
        d.join("top"),
        d.join("next"),
        d.join("kid"),
    ];
    let garbage = unreferenced(&files, &[d.join("top")]).unwrap();
    assert_eq!(garbage, vec![d.join("next"), d.join("kid")]);
}

#[test]
fn a_torn_seal_header_falls_back_to_the_unsealed_one() {
    let (dir, disk, _) = layer_on_base("top", 64 * 1024);
    let d = dir.path();
    disk.write_at(&[1; 5000], 3000).unwrap();
    let _ = disk.seal_and_branch(&d.join("next"), &[]).unwrap();
    let model = read_all(&disk);
    drop(disk);
    // The sealing header (generation 2, slot 0) half written.
    poke(&d.join("top"), 2000, &[0xab; 100]);
    let old = LayeredDisk::open(&d.join("top")).unwrap();
    assert!(!old.is_read_only());
    assert_content(&old, &model, "unsealed top after a torn seal");
    assert_open_err!(&d.join("next"), Error::ParentNotSealed { .. });
}

#[test]
fn a_crash_during_compaction_leaves_the_chain_intact() {
    let (dir, model) = closed_chain();
    let d = dir.path();
    // A compaction that died half-way through writing its temporary file.
    let tmp = compact_temp_path(&d.join("s2"));
    let half = std::fs::read(d.join("s1")).unwrap();
    std::fs::write(&tmp, &half[..half.len() / 2]).unwrap();
    let disk = LayeredDisk::open(&d.join("top")).unwrap();
    assert_content(&disk, &model, "with a stale temporary file");
    let listed = unreferenced(&[tmp.clone(), d.join("s1")], &[d.join("top")]).unwrap();
    assert_eq!(listed, vec![tmp.clone()]);
    // A later compaction replaces the leftover and completes.
    let stats = compact(&d.join("s2"), usize::MAX).unwrap();
    assert_eq!(stats.merged_layers, 2);
    assert!(!tmp.exists());
    disk.reload_chain().unwrap();
    assert_eq!(disk.depth(), 2);
    assert_content(&disk, &model, "after the compaction");
    let reopened = LayeredDisk::open(&d.join("top")).unwrap();
    assert_content(&reopened, &model, "reopened after the compaction");
}
