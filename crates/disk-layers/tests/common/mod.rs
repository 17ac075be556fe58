//! Helpers shared by the integration tests: a deterministic PRNG, base images with
//! recognisable content, and a byte-for-byte model of a disk.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use disk_layers::LayeredDisk;

/// SplitMix64: tiny, deterministic, good enough to pick offsets.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// A raw base of `size` bytes whose every byte depends on its offset.
pub fn base_image(dir: &Path, name: &str, size: u64) -> (PathBuf, Vec<u8>) {
    let data: Vec<u8> = (0..size).map(|i| (i * 7 + i / 4096) as u8).collect();
    let path = dir.join(name);
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

/// A new directory with a layer `top` in it over a fresh [`base_image`] of
/// `size` bytes, and the model of the layer's content.
pub fn layer_on_base(top: &str, size: u64) -> (tempfile::TempDir, LayeredDisk, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let (base, model) = base_image(dir.path(), "base.img", size);
    let disk = LayeredDisk::create(&base, &dir.path().join(top)).unwrap();
    (dir, disk, model)
}

/// Writes `len` bytes of `byte` at `offset`, to the disk and to its model.
pub fn fill(disk: &LayeredDisk, model: &mut [u8], offset: usize, len: usize, byte: u8) {
    disk.write_at(&vec![byte; len], offset as u64).unwrap();
    model[offset..offset + len].fill(byte);
}

/// Reads the whole disk.
pub fn read_all(disk: &LayeredDisk) -> Vec<u8> {
    let mut buf = vec![0u8; disk.len() as usize];
    disk.read_at(&mut buf, 0).unwrap();
    buf
}

/// Asserts the disk holds exactly `model`, naming the first differing byte.
pub fn assert_content(disk: &LayeredDisk, model: &[u8], what: &str) {
    let got = read_all(disk);
    assert_eq!(got.len(), model.len(), "{what}: size");
    if let Some(i) = got.iter().zip(model).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} (cluster {}): disk {:#04x}, model {:#04x}",
            i / 4096,
            got[i],
            model[i]
        );
    }
}

/// Bytes the file really occupies on disk.
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}
