//! Damaged, missing and swapped files are refused with the right error, and a crash
//! at any step leaves every layer readable and consistent.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test: a failure is a panic with its message"
)]

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::{assert_content, base_image, read_all};
use disk_layers::{Error, LayeredDisk, compact, compact_temp_path, unreferenced};

/// base.img <- s1 <- s2 <- top, with something written in each layer.
fn chain(d: &Path) -> (LayeredDisk, Vec<u8>) {
    let (base, mut model) = base_image(d, "base.img", 64 * 1024);
    let disk = LayeredDisk::create(&base, &d.join("s1")).unwrap();
    for (i, next) in ["s2", "top"].iter().enumerate() {
        let off = 1000 + i * 10_000;
        disk.write_at(&[i as u8 + 1; 6000], off as u64).unwrap();
        model[off..off + 6000].fill(i as u8 + 1);
        disk.seal_and_branch(&d.join(next), &[]).unwrap();
    }
    (disk, model)
}

fn poke(path: &Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

fn open_err(top: &Path) -> Error {
    LayeredDisk::open(top).expect_err("open should fail")
}

#[test]
fn both_header_slots_damaged_is_corrupt_header() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, _) = chain(d);
    drop(disk);
    poke(&d.join("s2"), 20, &[0xff; 4]);
    poke(&d.join("s2"), 4096 + 20, &[0xff; 4]);
    let err = open_err(&d.join("top"));
    assert!(
        matches!(&err, Error::CorruptHeader { path, reason } if path.ends_with("s2") && reason.contains("checksum")),
        "{err}"
    );
}

#[test]
fn one_damaged_slot_falls_back_to_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, model) = chain(d);
    drop(disk);
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
    let err = open_err(&base);
    assert!(
        matches!(&err, Error::CorruptHeader { reason, .. } if reason.contains("magic")),
        "{err}"
    );
    let err = open_err(&dir.path().join("nope"));
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
}

#[test]
fn truncated_layer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, _) = chain(d);
    drop(disk);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("s1"))
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 4096).unwrap();
    let err = open_err(&d.join("top"));
    assert!(
        matches!(&err, Error::Truncated { path, expected, actual } if path.ends_with("s1") && *expected == len && *actual == len - 4096),
        "{err}"
    );
    // Cut into the header itself.
    f.set_len(100).unwrap();
    let err = open_err(&d.join("top"));
    assert!(matches!(err, Error::CorruptHeader { .. }), "{err}");
}

#[test]
fn missing_parent_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, _) = chain(d);
    drop(disk);
    std::fs::rename(d.join("s1"), d.join("elsewhere")).unwrap();
    let err = open_err(&d.join("top"));
    assert!(
        matches!(&err, Error::MissingParent { layer, parent } if layer.ends_with("s2") && parent.ends_with("s1")),
        "{err}"
    );
    std::fs::rename(d.join("elsewhere"), d.join("s1")).unwrap();
    std::fs::remove_file(d.join("base.img")).unwrap();
    let err = open_err(&d.join("top"));
    assert!(
        matches!(&err, Error::MissingParent { layer, parent } if layer.ends_with("s1") && parent.ends_with("base.img")),
        "{err}"
    );
}

#[test]
fn swapped_parent_or_resized_base_is_a_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, _) = chain(d);
    drop(disk);
    // Another sealed layer of the same geometry put where s2 was.
    let other = LayeredDisk::create(&d.join("s1"), &d.join("other")).unwrap();
    other.seal_and_branch(&d.join("other-top"), &[]).unwrap();
    drop(other);
    std::fs::rename(d.join("other"), d.join("s2")).unwrap();
    let err = open_err(&d.join("top"));
    assert!(
        matches!(&err, Error::ParentMismatch { layer, .. } if layer.ends_with("top")),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, _) = chain(d);
    drop(disk);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("base.img"))
        .unwrap();
    f.set_len(128 * 1024).unwrap();
    let err = open_err(&d.join("top"));
    assert!(
        matches!(&err, Error::ParentMismatch { found, .. } if found.contains("131072")),
        "{err}"
    );
}

#[test]
fn flipped_bitmap_bit_in_a_sealed_layer_is_corrupt_bitmap() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, _) = chain(d);
    drop(disk);
    let f = std::fs::File::open(d.join("s2")).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 8192 + 1).unwrap();
    poke(&d.join("s2"), 8192 + 1, &[b[0] ^ 0x10]);
    let err = open_err(&d.join("top"));
    assert!(
        matches!(&err, Error::CorruptBitmap { path, reason } if path.ends_with("s2") && reason.contains("checksum")),
        "{err}"
    );
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
    disk.write_at(&[5; 10], 0).unwrap();
    model[..10].fill(5);
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
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (base, mut model) = base_image(d, "base.img", 64 * 1024);
    let disk = LayeredDisk::create(&base, &d.join("top")).unwrap();
    disk.write_at(&[1; 4 * 4096], 0).unwrap();
    model[..4 * 4096].fill(1);
    disk.flush().unwrap();
    let flushed = model.clone();
    // After the flush: overwrite flushed clusters, fill new ones, copy one up.
    disk.write_at(&[2; 4 * 4096], 2 * 4096).unwrap();
    model[2 * 4096..6 * 4096].fill(2);
    disk.write_at(&[3; 100], 8 * 4096 + 7).unwrap();
    model[8 * 4096 + 7..8 * 4096 + 107].fill(3);
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
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (base, mut model) = base_image(d, "base.img", 64 * 1024);
    let disk = LayeredDisk::create(&base, &d.join("top")).unwrap();
    disk.write_at(&[1; 5000], 3000).unwrap();
    model[3000..8000].fill(1);
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
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (base, _) = base_image(d, "base.img", 64 * 1024);
    let disk = LayeredDisk::create(&base, &d.join("top")).unwrap();
    disk.write_at(&[1; 5000], 3000).unwrap();
    let _ = disk.seal_and_branch(&d.join("next"), &[]).unwrap();
    let model = read_all(&disk);
    drop(disk);
    // The sealing header (generation 2, slot 0) half written.
    poke(&d.join("top"), 2000, &[0xab; 100]);
    let old = LayeredDisk::open(&d.join("top")).unwrap();
    assert!(!old.is_read_only());
    assert_content(&old, &model, "unsealed top after a torn seal");
    let err = open_err(&d.join("next"));
    assert!(matches!(err, Error::ParentNotSealed { .. }), "{err}");
}

#[test]
fn a_crash_during_compaction_leaves_the_chain_intact() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (disk, model) = chain(d);
    drop(disk);
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
