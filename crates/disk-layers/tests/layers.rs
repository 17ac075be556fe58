//! Branching to many children, long chains and their compaction, space use.

#![cfg(test)]

mod common;

use std::path::PathBuf;

use common::{Rng, allocated_bytes, assert_content, base_image, fill, layer_on_base};
use disk_layers::{LayeredDisk, chain_files, compact, unreferenced};

#[test]
fn sixteen_children_share_a_sealed_layer_and_diverge() {
    let (dir, parent, mut model) = layer_on_base("p0", 256 * 1024);
    let d = dir.path();
    fill(&parent, &mut model, 5_000, 10_000, 0xaa);

    let kids: Vec<PathBuf> = (0..16).map(|i| d.join(format!("child{i}"))).collect();
    let children = parent.seal_and_branch(&d.join("p1"), &kids).unwrap();
    assert_eq!(children.len(), 16);
    let sealed = std::fs::read(d.join("p0")).unwrap();

    // Every child and the parent start from the same content, then each writes
    // its own number over the same range plus a range of its own.
    let mut models = vec![model.clone(); 17];
    let all: Vec<&LayeredDisk> = std::iter::once(&parent).chain(&children).collect();
    for (i, disk) in all.iter().enumerate() {
        assert_content(
            disk,
            &models[i],
            &format!("disk {i} right after the branch"),
        );
        assert_eq!(disk.depth(), 2);
        fill(disk, &mut models[i], 8192, 4096, i as u8);
        let own = 20_000 + i as u64 * 9_000;
        fill(disk, &mut models[i], own as usize, 100, 0x40 + i as u8);
    }
    for (i, disk) in all.iter().enumerate() {
        assert_content(disk, &models[i], &format!("disk {i} after diverging"));
        disk.flush().unwrap();
    }
    // Nobody wrote to the shared sealed layer.
    assert_eq!(std::fs::read(d.join("p0")).unwrap(), sealed);
    drop(children);
    for (i, top) in kids.iter().enumerate() {
        let disk = LayeredDisk::open(top).unwrap();
        assert_content(&disk, &models[i + 1], &format!("child {i} reopened"));
    }
}

#[test]
fn thirty_layers_compact_to_one_with_the_same_content() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (base, mut model) = base_image(d, "base.img", 512 * 1024 + 17);
    let mut rng = Rng::new(30);
    let disk = LayeredDisk::create(&base, &d.join("l00")).unwrap();
    // A sibling branched off half-way keeps using the lower half of the chain.
    let mut sibling = None;
    for n in 1..=30 {
        for _ in 0..5 {
            let off = rng.below(model.len() as u64 - 6000);
            let mut buf = vec![0u8; 1 + rng.below(6000) as usize];
            rng.fill(&mut buf);
            disk.write_at(&buf, off).unwrap();
            model[off as usize..off as usize + buf.len()].copy_from_slice(&buf);
        }
        let kids = if n == 15 { vec![d.join("sib")] } else { vec![] };
        let mut out = disk
            .seal_and_branch(&d.join(format!("l{n:02}")), &kids)
            .unwrap();
        if n == 15 {
            sibling = Some((out.remove(0), model.clone()));
        }
    }
    assert_eq!(disk.depth(), 31);
    assert_content(&disk, &model, "30-layer chain");
    let (sibling, sibling_model) = sibling.unwrap();

    // Compact the topmost sealed layer with everything under it.
    let stats = compact(&d.join("l29"), usize::MAX).unwrap();
    assert_eq!(stats.merged_layers, 30);
    assert!(stats.clusters > 0);
    // Open disks still read through the old files until they reload.
    assert_content(&disk, &model, "before reload");
    disk.reload_chain().unwrap();
    assert_eq!(disk.depth(), 2);
    assert_content(&disk, &model, "after compaction and reload");
    sibling.reload_chain().unwrap();
    assert_eq!(sibling.depth(), 16, "the sibling's chain is untouched");
    assert_content(&sibling, &sibling_model, "sibling after reload");

    // l00..l28 are now used only by the sibling's chain, for l00..l14.
    let files: Vec<PathBuf> = (0..=30).map(|n| d.join(format!("l{n:02}"))).collect();
    let tops = [d.join("l30"), d.join("sib")];
    let garbage = unreferenced(&files, &tops).unwrap();
    let expected: Vec<PathBuf> = (15..=28).map(|n| d.join(format!("l{n:02}"))).collect();
    assert_eq!(garbage, expected);
    for f in &garbage {
        std::fs::remove_file(f).unwrap();
    }
    assert_eq!(chain_files(&d.join("l30")).unwrap().len(), 3);
    drop(disk);
    drop(sibling);
    let disk = LayeredDisk::open(&d.join("l30")).unwrap();
    assert_eq!(disk.depth(), 2);
    assert_content(&disk, &model, "reopened after GC");
    let sibling = LayeredDisk::open(&d.join("sib")).unwrap();
    assert_content(&sibling, &sibling_model, "sibling reopened after GC");

    // Compacting a few levels keeps the layers below.
    let stats = compact(&d.join("l14"), 4).unwrap();
    assert_eq!(stats.merged_layers, 4);
    sibling.reload_chain().unwrap();
    assert_eq!(sibling.depth(), 13);
    assert_content(
        &sibling,
        &sibling_model,
        "sibling after a partial compaction",
    );
}

#[test]
fn compacting_a_writable_layer_is_refused() {
    let (dir, _disk, _) = layer_on_base("top", 8192);
    let top = dir.path().join("top");
    let err = compact(&top, 2).unwrap_err();
    assert!(matches!(err, disk_layers::Error::NotSealed { .. }), "{err}");
}

#[test]
fn only_written_clusters_cost_space_over_a_2_gib_base() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = d.join("base.ext4");
    let f = std::fs::File::create(&base).unwrap();
    f.set_len(2 << 30).unwrap();
    drop(f);
    let top = d.join("top");
    let disk = LayeredDisk::create(&base, &top).unwrap();
    assert_eq!(disk.len(), 2 << 30);
    let empty = allocated_bytes(&top);
    assert!(empty <= 64 * 1024, "an empty layer costs {empty} bytes");

    // 10 clusters scattered over the disk, one of them written in part.
    for i in 0..10u64 {
        disk.write_at(&[i as u8 + 1; 4096], (i * 200) << 20)
            .unwrap();
    }
    disk.write_at(&[9; 100], (1 << 30) + 50).unwrap();
    disk.flush().unwrap();
    let used = allocated_bytes(&top) - empty;
    // 11 data clusters, the 11 bitmap pages their bits live in, and a little
    // slack for the host filesystem's extent blocks.
    assert!(
        used <= 11 * 4096 + 11 * 4096 + 16384,
        "{used} bytes for 11 clusters"
    );
    assert_eq!(std::fs::metadata(&top).unwrap().len() >> 30, 2);

    let mut buf = vec![0u8; 4196];
    disk.read_at(&mut buf, (1 << 30) - 4096 + 50).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0));
    assert!(buf[4096..].iter().all(|&b| b == 9));
    let mut last = [1u8; 512];
    disk.read_at(&mut last, (2 << 30) - 512).unwrap();
    assert_eq!(last, [0; 512]);

    // Sealing and compacting keep the layer as sparse.
    disk.seal_and_branch(&d.join("top2"), &[]).unwrap();
    disk.write_at(&[7; 8192], 4096).unwrap();
    disk.seal_and_branch(&d.join("top3"), &[]).unwrap();
    compact(&d.join("top2"), usize::MAX).unwrap();
    disk.reload_chain().unwrap();
    let compacted = allocated_bytes(&d.join("top2"));
    assert!(compacted <= 64 * 1024 + 14 * 4096, "{compacted}");
    let mut got = vec![0u8; 4096 * 3];
    disk.read_at(&mut got, 0).unwrap();
    assert!(got[..4096].iter().all(|&b| b == 1));
    assert!(got[4096..].iter().all(|&b| b == 7));
}

#[test]
fn threads_read_write_and_flush_one_disk_at_once() {
    let region = 96 * 1024u64;
    let (dir, disk, model) = layer_on_base("top", 4 * region);
    let d = dir.path();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let models: Vec<Vec<u8>> = std::thread::scope(|s| {
        let flusher = s.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                disk.flush().unwrap();
                n += 1;
            }
            n
        });
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let disk = &disk;
                let start = t * region;
                let mut mine = model[start as usize..(start + region) as usize].to_vec();
                s.spawn(move || {
                    let mut rng = Rng::new(100 + t);
                    for _ in 0..2000 {
                        let off = rng.below(region - 1);
                        let len = 1 + rng.below((region - off).min(10_000)) as usize;
                        if rng.below(2) == 0 {
                            let mut buf = vec![0u8; len];
                            rng.fill(&mut buf);
                            disk.write_at(&buf, start + off).unwrap();
                            mine[off as usize..off as usize + len].copy_from_slice(&buf);
                        } else {
                            let mut buf = vec![0u8; len];
                            disk.read_at(&mut buf, start + off).unwrap();
                            assert!(buf == mine[off as usize..off as usize + len], "thread {t}");
                        }
                    }
                    mine
                })
            })
            .collect();
        let out = workers.into_iter().map(|w| w.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(flusher.join().unwrap() > 0);
        out
    });
    let whole = models.concat();
    assert_content(&disk, &whole, "after the threads");
    // A crash now keeps everything: the last flush came after the last write.
    disk.flush().unwrap();
    std::mem::forget(disk);
    let disk = LayeredDisk::open(&d.join("top")).unwrap();
    assert_content(&disk, &whole, "reopened after a crash");
}

/// A chain with no raw base (an image's layers): a blank bottom layer,
/// sealed in place, a layer stacked on it; what the chain holds is listed
/// as ranges, and the rest reads as zeros.
#[test]
fn a_blank_chain_seals_in_place_and_lists_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (bottom, upper) = (dir.path().join("a.layer"), dir.path().join("b.layer"));
    let size = 1 << 20;
    let disk = LayeredDisk::create_blank(&bottom, size).unwrap();
    disk.write_at(&[1; 8192], 0).unwrap();
    disk.write_at(&[2; 100], 40_000).unwrap();
    assert_eq!(disk.held_ranges(), [(0, 8192), (36_864, 4096)]);
    disk.seal().unwrap();
    assert!(disk.is_read_only());
    assert!(disk.write_at(&[3; 4096], 0).is_err(), "sealed");
    drop(disk);
    let disk = LayeredDisk::create(&bottom, &upper).unwrap();
    assert_eq!(disk.len(), size);
    disk.write_at(&[4; 4096], 8192).unwrap();
    disk.seal().unwrap();
    drop(disk);
    let disk = LayeredDisk::open(&upper).unwrap();
    assert!(disk.is_read_only() && disk.depth() == 2);
    assert_eq!(disk.held_ranges(), [(0, 12_288), (36_864, 4096)]);
    let mut buf = vec![0u8; 16_384];
    disk.read_at(&mut buf, 0).unwrap();
    assert!(buf[..8192].iter().all(|&b| b == 1));
    assert!(buf[8192..12_288].iter().all(|&b| b == 4));
    assert!(buf[12_288..].iter().all(|&b| b == 0));
    assert_eq!(chain_files(&upper).unwrap().len(), 2);
    assert!(LayeredDisk::create_blank(&dir.path().join("c"), 0).is_err());
}

/// Layers sealed shared (an image's) are never folded: compacting a chain
/// over them folds only the layers above, which keep reading the same.
#[test]
fn compaction_stops_above_a_shared_base() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: usize| dir.path().join(format!("{n}.layer"));
    let disk = LayeredDisk::create_blank(&p(0), 1 << 20).unwrap();
    disk.write_at(&[1; 4096], 0).unwrap();
    disk.seal_shared().unwrap();
    drop(disk);
    let disk = LayeredDisk::create(&p(0), &p(1)).unwrap();
    disk.write_at(&[2; 4096], 4096).unwrap();
    disk.seal_shared().unwrap();
    drop(disk);
    let disk = LayeredDisk::create(&p(1), &p(2)).unwrap();
    for n in 2..5 {
        disk.write_at(&[n as u8 + 1; 4096], n as u64 * 4096)
            .unwrap();
        disk.seal_and_branch(&p(n + 1), &[]).unwrap();
    }
    // 0 and 1 shared; 2, 3, 4 sealed; 5 the top.
    assert_eq!((disk.depth(), disk.foldable_depth()), (6, 4));
    drop(disk);
    let stats = compact(&p(4), usize::MAX).unwrap();
    assert_eq!(stats.merged_layers, 3);
    let files = chain_files(&p(5)).unwrap();
    assert_eq!(files.len(), 4, "{files:?}");
    let disk = LayeredDisk::open(&p(5)).unwrap();
    assert_eq!(disk.foldable_depth(), 2);
    let mut buf = vec![0u8; 5 * 4096];
    disk.read_at(&mut buf, 0).unwrap();
    for n in 0..5 {
        assert!(
            buf[n * 4096..(n + 1) * 4096]
                .iter()
                .all(|&b| b == n as u8 + 1),
            "{n}"
        );
    }
    // A shared layer itself folds nothing.
    assert_eq!(compact(&p(1), usize::MAX).unwrap().merged_layers, 1);
}
