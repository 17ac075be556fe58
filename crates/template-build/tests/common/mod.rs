//! Helpers shared by the test files (each is its own crate and uses some).
#![allow(dead_code)]

pub mod registry;
pub mod tls;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

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
