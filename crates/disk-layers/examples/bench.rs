//! Micro-benchmark of layered disks. Run with
//! `cargo run --release -p sandfork-disk-layers --example bench [DIR]`
//! (DIR defaults to a temporary directory; put it on the filesystem the VMM uses);
//! `... --example bench DIR fork` runs only the fork's disk steps.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark: a failure ends it with its message"
)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use disk_layers::{LayeredDisk, compact};

const MIB: u64 = 1 << 20;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A raw base of `size` bytes, every byte written (a realistic ext4 image is
/// mostly data where the guest reads).
fn base(dir: &Path, name: &str, size: u64) -> PathBuf {
    let path = dir.join(name);
    let chunk: Vec<u8> = (0..MIB).map(|i| (i * 13) as u8).collect();
    let mut data = Vec::with_capacity(size as usize);
    while (data.len() as u64) < size {
        data.extend_from_slice(&chunk);
    }
    data.truncate(size as usize);
    std::fs::write(&path, &data).unwrap();
    path
}

fn per_op(d: Duration, n: u64) -> String {
    format!("{:.2} us/op", d.as_secs_f64() * 1e6 / n as f64)
}

fn mbps(bytes: u64, d: Duration) -> String {
    format!("{:.0} MB/s", bytes as f64 / 1e6 / d.as_secs_f64())
}

fn random_reads(dir: &Path, base: &Path, depth: usize) {
    let size = std::fs::metadata(base).unwrap().len();
    let clusters = size / 4096;
    let mut rng = Rng(depth as u64);
    let disk = LayeredDisk::create(base, &dir.join(format!("r{depth}-0"))).unwrap();
    // Each layer holds a share of the clusters, so reads hit every depth.
    let per_layer = clusters / 2 / depth as u64;
    for n in 1..=depth {
        for _ in 0..per_layer {
            let c = rng.next() % clusters;
            disk.write_at(&[n as u8; 4096], c * 4096).unwrap();
        }
        if n < depth {
            disk.seal_and_branch(&dir.join(format!("r{depth}-{n}")), &[])
                .unwrap();
        }
    }
    disk.flush().unwrap();
    let mut buf = vec![0u8; 4096];
    let reads = 200_000u64;
    // Warm the page cache so the figure is the lookup path, not the device.
    for c in 0..clusters {
        disk.read_at(&mut buf, c * 4096).unwrap();
    }
    let t = Instant::now();
    for _ in 0..reads {
        let c = rng.next() % clusters;
        disk.read_at(&mut buf, c * 4096).unwrap();
    }
    println!(
        "random 4 KiB reads, chain depth {depth:2}: {}",
        per_op(t.elapsed(), reads)
    );
}

fn raw_reads(base: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(base).unwrap();
    let clusters = f.metadata().unwrap().len() / 4096;
    let mut rng = Rng(7);
    let mut buf = vec![0u8; 4096];
    let reads = 200_000u64;
    let t = Instant::now();
    for _ in 0..reads {
        let c = rng.next() % clusters;
        f.read_exact_at(&mut buf, c * 4096).unwrap();
    }
    println!(
        "random 4 KiB reads, raw file (baseline): {}",
        per_op(t.elapsed(), reads)
    );
}

fn sequential_writes(dir: &Path, base: &Path) {
    let disk = LayeredDisk::create(base, &dir.join("seq")).unwrap();
    let buf = vec![0x5a; MIB as usize];
    let total = disk.len() / MIB * MIB;
    let t = Instant::now();
    for off in (0..total).step_by(MIB as usize) {
        disk.write_at(&buf, off).unwrap();
    }
    let written = t.elapsed();
    disk.flush().unwrap();
    let all = t.elapsed();
    println!(
        "sequential 1 MiB writes, {} MiB to a fresh layer: {} ({} with the final flush)",
        total / MIB,
        mbps(total, written),
        mbps(total, all)
    );
    let t = Instant::now();
    for off in (0..total).step_by(MIB as usize) {
        disk.write_at(&buf, off).unwrap();
    }
    disk.flush().unwrap();
    println!(
        "sequential 1 MiB rewrites of the same layer, with flush: {}",
        mbps(total, t.elapsed())
    );
}

fn random_small_writes(dir: &Path, base: &Path, cluster: u64) {
    let disk =
        LayeredDisk::create_with_cluster_size(base, &dir.join(format!("w{cluster}")), cluster)
            .unwrap();
    let blocks = disk.len() / 4096;
    let mut rng = Rng(cluster);
    let n = 20_000u64;
    let buf = [0xc3u8; 4096];
    let t = Instant::now();
    for _ in 0..n {
        disk.write_at(&buf, (rng.next() % blocks) * 4096).unwrap();
    }
    disk.flush().unwrap();
    let d = t.elapsed();
    use std::os::unix::fs::MetadataExt;
    let used = std::fs::metadata(dir.join(format!("w{cluster}")))
        .unwrap()
        .blocks()
        * 512;
    println!(
        "random 4 KiB first writes, {:2} KiB clusters: {} (layer uses {} MiB for {} MiB written)",
        cluster / 1024,
        per_op(d, n),
        used / MIB,
        n * 4096 / MIB
    );
}

fn seal_with_children(dir: &Path) {
    let base = dir.join("sparse-2g");
    std::fs::File::create(&base)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let disk = LayeredDisk::create(&base, &dir.join("s-top")).unwrap();
    let mut rng = Rng(16);
    for _ in 0..10_000 {
        disk.write_at(&[1; 4096], (rng.next() % (1 << 19)) * 4096)
            .unwrap();
    }
    let t = Instant::now();
    disk.flush().unwrap();
    let flush = t.elapsed();
    let kids: Vec<PathBuf> = (0..16).map(|i| dir.join(format!("s-kid{i}"))).collect();
    let t = Instant::now();
    let children = disk.seal_and_branch(&dir.join("s-next"), &kids).unwrap();
    let seal = t.elapsed();
    assert_eq!(children.len(), 16);
    println!(
        "seal_and_branch, 2 GiB disk, 16 children + the parent: {:.1} ms (after a flush of 40 MiB of new clusters taking {:.1} ms)",
        seal.as_secs_f64() * 1e3,
        flush.as_secs_f64() * 1e3
    );
}

/// A fork's disk work for N children, all in one `seal_and_branch` (as
/// while the parent stood still before) against the three steps a fork
/// takes now: the parent's next layer before the freeze, the seal and
/// switch while it stands still, the children stacked after. 2 GiB sparse
/// disks with 1 MiB written, 3 samples each.
fn fork_in_steps(dir: &Path) {
    let base = dir.join("f-sparse-2g");
    std::fs::File::create(&base)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let ms = |d: Duration| format!("{:.2}", d.as_secs_f64() * 1e3);
    for n in [1usize, 16, 100] {
        let (mut whole, mut prepared, mut paused, mut stacked) = (vec![], vec![], vec![], vec![]);
        for sample in 0..3 {
            let at = |what: &str| dir.join(format!("f{n}-{sample}-{what}"));
            let kids = |what: &str| -> Vec<PathBuf> {
                (0..n).map(|i| at(&format!("{what}-kid{i}"))).collect()
            };
            let written = |disk: &LayeredDisk| {
                for i in 0..256u64 {
                    disk.write_at(&[1; 4096], i * 8 * 4096).unwrap();
                }
            };
            let one = LayeredDisk::create(&base, &at("a-top")).unwrap();
            written(&one);
            let t = Instant::now();
            drop(one.seal_and_branch(&at("a-next"), &kids("a")).unwrap());
            whole.push(t.elapsed());

            let three = LayeredDisk::create(&base, &at("b-top")).unwrap();
            written(&three);
            let t = Instant::now();
            let next = three.prepare_continuation(&at("b-next")).unwrap();
            prepared.push(t.elapsed());
            let t = Instant::now();
            let sealed = three.seal_and_continue(next).unwrap();
            paused.push(t.elapsed());
            let t = Instant::now();
            sealed.stack(&kids("b")).unwrap();
            stacked.push(t.elapsed());
        }
        let list = |v: &[Duration]| v.iter().map(|d| ms(*d)).collect::<Vec<_>>().join(", ");
        println!(
            "fork of {n}: seal_and_branch (all in the pause) {} ms; now: prepared {} ms, \
             in the pause (seal_and_continue) {} ms, stacked after {} ms",
            list(&whole),
            list(&prepared),
            list(&paused),
            list(&stacked)
        );
    }
}

fn compaction(dir: &Path, base: &Path) {
    let disk = LayeredDisk::create(base, &dir.join("c00")).unwrap();
    let size = disk.len();
    let mut rng = Rng(30);
    let chunk = vec![0x77u8; 64 * 1024];
    let per_layer = 100 * MIB / 30 / chunk.len() as u64;
    for n in 1..=30 {
        for _ in 0..per_layer {
            let off = (rng.next() % (size / chunk.len() as u64)) * chunk.len() as u64;
            disk.write_at(&chunk, off).unwrap();
        }
        disk.seal_and_branch(&dir.join(format!("c{n:02}")), &[])
            .unwrap();
    }
    let t = Instant::now();
    let stats = compact(&dir.join("c29"), usize::MAX).unwrap();
    let d = t.elapsed();
    disk.reload_chain().unwrap();
    // Timed the second time: the first one waits behind the compaction's writeback.
    let t = Instant::now();
    disk.reload_chain().unwrap();
    let reload = t.elapsed();
    println!(
        "compaction of a 30-layer chain ({} MiB written, {} MiB distinct): {:.0} ms, {}; reload_chain {:.1} ms",
        per_layer * 30 * chunk.len() as u64 / MIB,
        stats.bytes / MIB,
        d.as_secs_f64() * 1e3,
        mbps(stats.bytes, d),
        reload.as_secs_f64() * 1e3
    );
}

fn main() {
    let tmp;
    let dir = match std::env::args().nth(1) {
        Some(d) => PathBuf::from(d),
        None => {
            tmp = std::env::temp_dir().join(format!("disk-layers-bench-{}", std::process::id()));
            std::fs::create_dir_all(&tmp).unwrap();
            tmp.clone()
        }
    };
    // `bench DIR fork`: only the fork's steps.
    if std::env::args().nth(2).as_deref() == Some("fork") {
        fork_in_steps(&dir);
        return;
    }
    let base = base(&dir, "base.img", 256 * MIB);
    raw_reads(&base);
    for depth in [1, 5, 20] {
        random_reads(&dir, &base, depth);
    }
    sequential_writes(&dir, &base);
    random_small_writes(&dir, &base, 4096);
    random_small_writes(&dir, &base, 65536);
    seal_with_children(&dir);
    fork_in_steps(&dir);
    compaction(&dir, &base);
    if std::env::args().nth(1).is_none() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
