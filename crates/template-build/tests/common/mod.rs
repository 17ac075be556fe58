//! Helpers shared by the test files (each is its own crate and uses some).
#![allow(dead_code)]

pub mod registry;
pub mod tls;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use template_build::{Builder, Source, Template};

/// Lowercase hex SHA-256 of `data`.
pub fn sha(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    g.write_all(data).unwrap();
    g.finish().unwrap()
}

/// What debugfs (e2fsprogs) prints for `request` on an ext4 image.
pub fn debugfs(image: &Path, request: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(request)
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs {request}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A stand-in agent: any executable; the image only has to carry it.
pub fn agent(dir: &Path) -> PathBuf {
    let p = dir.join("agent");
    fs::write(&p, b"#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// A builder with a cache of its own in `dir` (so templates are built, not
/// found from an earlier run) whose base is the machine's, made by
/// images/rootfs/build.sh, and scratch in `scratch`.
pub fn base_builder(dir: &Path, scratch: &Path) -> Builder {
    let shared = std::env::var_os("SANDFORK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sandfork"));
    let cache = dir.join("cache");
    fs::create_dir(&cache).unwrap();
    std::os::unix::fs::symlink(shared.join("rootfs-base"), cache.join("rootfs-base")).unwrap();
    Builder::new(agent(dir))
        .cache_dir(cache)
        .scratch_dir(scratch)
}

/// Builds `source`, echoing its log; the template and the log's lines.
pub fn build_logged(b: &Builder, source: &Source) -> (Template, Vec<String>) {
    let mut lines = Vec::new();
    let t = b
        .build(source, &mut |l| {
            eprintln!("{l}");
            lines.push(l.to_owned())
        })
        .unwrap();
    (t, lines)
}

/// Builds `source` again: `built`, from the cache.
pub fn assert_cached(b: &Builder, source: &Source, built: &Template) {
    let again = b.build(source, &mut |_| {}).unwrap();
    assert!(again.cached && again.key == built.key, "{again:?}");
}
