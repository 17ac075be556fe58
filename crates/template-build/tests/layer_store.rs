//! Images stored once per layer (src/layer_store.rs): two images that share
//! a base layer, pushed to a real registry on loopback (Debian's
//! `docker-registry`), pulled, and converted into chains of disk layers in
//! one store. The base layer's bytes are stored once (the second image's
//! own layers take a small part of the first's), and each image's
//! filesystem, read back through its chain, has the files of every layer
//! with the whiteouts applied. Needs root (loop mounts), as builds do.

#![cfg(test)]

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::registry::{Blobs, Registry, layer, pull, write_index};
use common::{agent, debugfs, gzip};
use disk_layers::LayeredDisk;
use template_build::{Builder, LayeredTemplate};

const MIB: u64 = 1 << 20;

/// Bytes no compressor shrinks, from a seed.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A one-platform OCI layout of `layers` (blobs as given) under `dir`.
fn layout(dir: &Path, tag: &str, layers: &[Vec<u8>]) {
    let blobs = Blobs(dir.join("blobs/sha256"));
    fs::create_dir_all(&blobs.0).unwrap();
    let config = format!(
        r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["PATH=/usr/bin:/bin","IMAGE={tag}"],"WorkingDir":"/app"}},"rootfs":{{"type":"layers","diff_ids":[]}}}}"#
    );
    let (cd, cs) = blobs.put(config.as_bytes());
    let descs: Vec<String> = layers
        .iter()
        .map(|l| {
            let (d, s) = blobs.put(l);
            format!(
                r#"{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{d}","size":{s}}}"#
            )
        })
        .collect();
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{cd}","size":{cs}}},"layers":[{}]}}"#,
        descs.join(",")
    );
    let (m, size) = blobs.put(manifest.as_bytes());
    write_index(dir, "application/vnd.oci.image.manifest.v1+json", &m, size);
}

/// The filesystem a chain reads as, in a raw image debugfs can read.
fn read_back(top: &Path, raw: &Path) -> PathBuf {
    let disk = LayeredDisk::open(top).unwrap();
    let f = fs::File::create(raw).unwrap();
    f.set_len(disk.len()).unwrap();
    for (start, len) in disk.held_ranges() {
        let mut buf = vec![0u8; len as usize];
        disk.read_at(&mut buf, start).unwrap();
        f.write_all_at(&buf, start).unwrap();
    }
    raw.to_owned()
}

fn made_bytes(t: &LayeredTemplate) -> u64 {
    t.layers.iter().filter(|l| l.made).map(|l| l.bytes).sum()
}

#[test]
fn images_sharing_a_base_layer_store_it_once_and_read_back_whole() {
    let reg = Registry::start(None);
    let tmp = tempfile::tempdir().unwrap();
    // The base: 8 MiB of files in 16 and files the upper layers delete,
    // hide (an opaque directory) and replace.
    let big: Vec<(String, Vec<u8>)> = (0..16)
        .map(|n| (format!("base/big/{n}.bin"), noise(n, 512 << 10)))
        .collect();
    let mut files: Vec<(&str, &[u8])> = big
        .iter()
        .map(|(p, d)| (p.as_str(), d.as_slice()))
        .collect();
    files.extend([
        ("base/gone.txt", &b"deleted by image a\n"[..]),
        ("base/keep.txt", b"from the base\n"),
        ("base/opq/old.txt", b"hidden by image a\n"),
    ]);
    let base = gzip(&layer(&files));
    let a_top = gzip(&layer(&[
        ("app/a.txt", b"image a\n"),
        ("base/.wh.gone.txt", b""),
        ("base/opq/.wh..wh..opq", b""),
        ("base/opq/new.txt", b"image a's own\n"),
    ]));
    let b_top = gzip(&layer(&[
        ("app/b.txt", b"image b\n"),
        ("base/keep.txt", b"replaced by image b\n"),
    ]));
    let b_top2 = gzip(&layer(&[("app/b2.txt", b"image b, layer 3\n")]));
    layout(&tmp.path().join("a"), "a", &[base.clone(), a_top]);
    layout(&tmp.path().join("b"), "b", &[base, b_top, b_top2]);
    reg.push(&tmp.path().join("a"), "tasks/a:1");
    reg.push(&tmp.path().join("b"), "tasks/b:1");

    let cache = tmp.path().join("cache");
    let blobs = cache.join("images");
    let scratch = tmp.path().join("scratch");
    let builder = Builder::new(agent(tmp.path()))
        .cache_dir(&cache)
        .scratch_dir(&scratch)
        .layer_disk_size(256 * MIB);
    let convert = |name: &str| {
        let pulled = pull(&blobs, &format!("{}/{name}", reg.host()), None).unwrap();
        builder
            .build_layered(&blobs, &pulled.manifest_digest, &mut |l| eprintln!("{l}"))
            .unwrap()
    };
    let a = convert("tasks/a:1");
    let b = convert("tasks/b:1");

    // a: the empty filesystem, its two layers, its finish, all made.
    let what = |t: &LayeredTemplate| -> Vec<(String, bool)> {
        t.layers
            .iter()
            .map(|l| (l.what.split(':').next().unwrap().to_owned(), l.made))
            .collect()
    };
    let w = |s: &str, made| (s.to_owned(), made);
    assert_eq!(
        what(&a),
        [
            w("filesystem", true),
            w("layer sha256", true),
            w("layer sha256", true),
            w("finish", true)
        ]
    );
    // b: the filesystem and the base layer found in the store, the same files.
    assert_eq!(
        what(&b),
        [
            w("filesystem", false),
            w("layer sha256", false),
            w("layer sha256", true),
            w("layer sha256", true),
            w("finish", true)
        ]
    );
    for n in 0..2 {
        assert_eq!(a.layers[n].path, b.layers[n].path);
    }
    assert_eq!(b.template.rootfs, b.layers[4].path);
    assert_eq!(b.template.config.working_dir.as_deref(), Some("/app"));

    // Bytes on disk: the base layer holds the 8 MiB once; b's own layers
    // take a small part of what a's took.
    let base_bytes = a.layers[1].bytes;
    assert!(
        base_bytes >= 8 * MIB,
        "the base layer holds {base_bytes} bytes"
    );
    let (a_made, b_made) = (made_bytes(&a), made_bytes(&b));
    eprintln!("a made {a_made} bytes (base {base_bytes}), b made {b_made}");
    assert!(
        b_made * 10 < a_made,
        "b's own layers take {b_made} bytes, a's {a_made}"
    );
    let store: Vec<_> = fs::read_dir(builder.layers_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "layer"))
        .collect();
    assert_eq!(store.len(), 7, "4 layers of a, 3 more of b");
    let store_bytes: u64 = store
        .iter()
        .map(|e| std::os::unix::fs::MetadataExt::blocks(&e.metadata().unwrap()) * 512)
        .sum();
    assert!(
        store_bytes < 2 * base_bytes,
        "the store takes {store_bytes} bytes, the base {base_bytes}"
    );
    // Nothing left in the scratch directory; a build again is cached.
    assert_eq!(fs::read_dir(&scratch).unwrap().count(), 0);
    let again = convert("tasks/b:1");
    assert!(again.template.cached && again.layers.iter().all(|l| !l.made));

    // Each filesystem, read back through its chain.
    let fsck = |raw: &Path| {
        let out = std::process::Command::new("e2fsck")
            .args(["-fn"])
            .arg(raw)
            .output()
            .unwrap();
        assert!(out.status.success(), "e2fsck: {out:?}");
    };
    let ra = read_back(&a.template.rootfs, &tmp.path().join("a.raw"));
    let rb = read_back(&b.template.rootfs, &tmp.path().join("b.raw"));
    fsck(&ra);
    fsck(&rb);
    let cat = |raw: &Path, p: &str| debugfs(raw, &format!("cat {p}"));
    let ls = |raw: &Path, p: &str| debugfs(raw, &format!("ls {p}"));
    assert_eq!(cat(&ra, "/app/a.txt"), "image a\n");
    assert_eq!(cat(&ra, "/base/keep.txt"), "from the base\n");
    assert_eq!(cat(&ra, "/base/opq/new.txt"), "image a's own\n");
    assert!(!ls(&ra, "/base").contains("gone.txt"), "whiteout");
    assert!(
        !ls(&ra, "/base/opq").contains("old.txt"),
        "opaque directory"
    );
    assert!(!ls(&ra, "/app").contains("b.txt"));
    assert_eq!(cat(&rb, "/app/b.txt"), "image b\n");
    assert_eq!(cat(&rb, "/app/b2.txt"), "image b, layer 3\n");
    assert_eq!(cat(&rb, "/base/keep.txt"), "replaced by image b\n");
    assert_eq!(cat(&rb, "/base/gone.txt"), "deleted by image a\n");
    assert_eq!(cat(&rb, "/base/opq/old.txt"), "hidden by image a\n");
    assert!(!ls(&rb, "/app").contains("a.txt"));
    for raw in [&ra, &rb] {
        let out = tmp.path().join("15.bin");
        debugfs(raw, &format!("dump /base/big/15.bin {}", out.display()));
        assert!(
            fs::read(&out).unwrap() == noise(15, 512 << 10),
            "a base file"
        );
        fs::remove_file(&out).unwrap();
        // The finish: the agent as init, the journal added.
        assert!(ls(raw, "/usr/local/sbin").contains("sandfork-agent"));
        assert!(debugfs(raw, "stat /sbin/init").contains("Type: symlink"));
        assert!(debugfs(raw, "features").contains("has_journal"));
    }
}
