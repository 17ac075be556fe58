//! Random reads and writes against an in-memory model, across seals, branches,
//! compactions, chain reloads, reopens and garbage collection.

#![cfg(test)]

mod common;

use std::path::{Path, PathBuf};

use common::{Rng, assert_content, base_image};
use disk_layers::{LayeredDisk, compact, unreferenced};

struct Member {
    disk: LayeredDisk,
    model: Vec<u8>,
    top: PathBuf,
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

fn run(seed: u64, size: u64, cluster: u64, ops: usize) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (base, data) = base_image(d, "base.img", size);
    let mut rng = Rng::new(seed);
    let mut names = 0u32;
    let fresh = |names: &mut u32| {
        *names += 1;
        d.join(format!("layer-{names}.sfl"))
    };
    let top = fresh(&mut names);
    let disk = LayeredDisk::create_with_cluster_size(&base, &top, cluster).unwrap();
    let mut family = vec![Member {
        disk,
        model: data,
        top,
    }];
    let mut counts = [0usize; 8];

    for step in 0..ops {
        let ctx = format!("seed {seed} step {step}");
        let i = rng.below(family.len() as u64) as usize;
        match rng.below(100) {
            0..40 => {
                counts[0] += 1;
                let m = &mut family[i];
                let off = rng.below(size);
                let max = if rng.below(10) == 0 {
                    16 * cluster
                } else {
                    3 * cluster
                };
                let len = (1 + rng.below(max)).min(size - off) as usize;
                let mut buf = vec![0u8; len];
                rng.fill(&mut buf);
                m.disk.write_at(&buf, off).unwrap();
                m.model[off as usize..off as usize + len].copy_from_slice(&buf);
            }
            40..65 => {
                counts[1] += 1;
                let m = &family[i];
                let off = rng.below(size);
                let len = (1 + rng.below(4 * cluster)).min(size - off) as usize;
                let mut buf = vec![0u8; len];
                m.disk.read_at(&mut buf, off).unwrap();
                assert!(
                    buf == m.model[off as usize..off as usize + len],
                    "{ctx}: read {len} at {off} differs"
                );
            }
            65..73 => {
                counts[2] += 1;
                family[i].disk.flush().unwrap();
            }
            73..80 => {
                counts[3] += 1;
                let n_children = if family.len() < 8 { rng.below(3) } else { 0 };
                let cont = fresh(&mut names);
                let kids: Vec<PathBuf> = (0..n_children).map(|_| fresh(&mut names)).collect();
                let m = &mut family[i];
                let disks = m.disk.seal_and_branch(&cont, &kids).unwrap();
                m.top = cont;
                let model = m.model.clone();
                for (disk, top) in disks.into_iter().zip(kids) {
                    family.push(Member {
                        disk,
                        model: model.clone(),
                        top,
                    });
                }
            }
            80..86 => {
                // Compact a random sealed layer of this disk's chain.
                let paths = family[i].disk.chain_paths();
                let sealed: Vec<&PathBuf> = paths[1..]
                    .iter()
                    .filter(|p| p.extension().is_some_and(|e| e == "sfl"))
                    .collect();
                if sealed.is_empty() {
                    continue;
                }
                counts[4] += 1;
                let target = sealed[rng.below(sealed.len() as u64) as usize].clone();
                let levels = match rng.below(3) {
                    0 => usize::MAX,
                    _ => 2 + rng.below(4) as usize,
                };
                compact(&target, levels).unwrap();
                for m in &family {
                    m.disk.reload_chain().unwrap();
                }
            }
            86..93 => {
                counts[5] += 1;
                let m = &mut family[i];
                // The old disk has no writes left to flush when it is dropped.
                m.disk.flush().unwrap();
                m.disk = LayeredDisk::open(&m.top).unwrap();
                assert_content(&m.disk, &m.model, &format!("{ctx}: after reopen"));
            }
            93..96 => {
                counts[6] += 1;
                let tops: Vec<PathBuf> = family.iter().map(|m| m.top.clone()).collect();
                for f in unreferenced(&files_in(d), &tops).unwrap() {
                    std::fs::remove_file(f).unwrap();
                }
            }
            _ => {
                counts[7] += 1;
                let m = &family[i];
                assert_content(&m.disk, &m.model, &ctx);
            }
        }
    }
    for (k, m) in family.iter().enumerate() {
        assert_content(
            &m.disk,
            &m.model,
            &format!("seed {seed}: disk {k} at the end"),
        );
    }
    let tops: Vec<PathBuf> = family.iter().map(|m| m.top.clone()).collect();
    let models: Vec<Vec<u8>> = family.iter().map(|m| m.model.clone()).collect();
    drop(family);
    for f in unreferenced(&files_in(d), &tops).unwrap() {
        std::fs::remove_file(f).unwrap();
    }
    for (k, (top, model)) in tops.iter().zip(&models).enumerate() {
        let disk = LayeredDisk::open(top).unwrap();
        assert_content(
            &disk,
            model,
            &format!("seed {seed}: disk {k} reopened at the end"),
        );
    }
    // Every kind of operation ran, or the test proves less than it claims.
    assert!(
        counts.iter().all(|&n| n > 0),
        "seed {seed}: op counts {counts:?}"
    );
}

#[test]
fn model_holds_with_4k_clusters() {
    for seed in 1..=6 {
        run(seed, 300 * 1024 + 123, 4096, 600);
    }
}

#[test]
fn model_holds_with_64k_clusters() {
    for seed in 11..=14 {
        run(seed, 1024 * 1024 + 5, 65536, 500);
    }
}
