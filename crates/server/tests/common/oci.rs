//! A small real OCI image layout for template builds: busybox (static, from
//! the host's busybox-static) as the whole userland, a marker file, and an
//! image config with Env and WorkingDir. One uncompressed layer, made with
//! tar(1).

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

pub const BUSYBOX: &str = "/bin/busybox";
pub const MARKER: &str = "made by the sandfork template test";
const APPLETS: &[&str] = &[
    "sh", "cat", "sleep", "grep", "tail", "mkdir", "ps", "echo", "ls", "pidof", "test", "true",
];

fn sha(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn blob(layout: &Path, data: &[u8]) -> String {
    let hex = sha(data);
    std::fs::write(layout.join("blobs/sha256").join(&hex), data).unwrap();
    format!("sha256:{hex}")
}

/// Writes the image layout into `dir/layout` and returns its path.
pub fn busybox_oci_layout(dir: &Path) -> PathBuf {
    let tree = dir.join("tree");
    for d in [
        "bin", "etc", "proc", "sys", "dev", "tmp", "root", "srv", "run",
    ] {
        std::fs::create_dir_all(tree.join(d)).unwrap();
    }
    std::fs::copy(BUSYBOX, tree.join("bin/busybox")).unwrap();
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(a)).unwrap();
    }
    std::fs::write(tree.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(tree.join("etc/group"), "root:x:0:\n").unwrap();
    std::fs::write(tree.join("etc/marker"), MARKER).unwrap();
    let layer_path = dir.join("layer.tar");
    let status = Command::new("tar")
        .arg("-C")
        .arg(&tree)
        .args(["--owner=0", "--group=0", "-cf"])
        .arg(&layer_path)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
    let layer = std::fs::read(&layer_path).unwrap();

    let layout = dir.join("layout");
    std::fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin", "GREETING=hello from the image"],
            "WorkingDir": "/srv",
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha(&layer))]},
    })
    .to_string();
    let config_digest = blob(&layout, config.as_bytes());
    let layer_digest = blob(&layout, &layer);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": layer.len()}],
    })
    .to_string();
    let manifest_digest = blob(&layout, manifest.as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": manifest.len()}],
    });
    std::fs::write(layout.join("index.json"), index.to_string()).unwrap();
    layout
}
