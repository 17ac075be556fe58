//! OCI layouts written here, Debian's `docker-registry` (distribution)
//! serving them on a free loopback port (plain HTTP or TLS, with or without
//! htpasswd basic auth; images pushed with `skopeo copy`), and pulls.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use template_build::registry::{self, Credentials, PullOptions, Reference, RegistryError};

use super::tls::TestCa;
use super::{gzip, sha};

/// A layer tar of regular files (path, content) with their directories.
pub fn layer(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut dirs = std::collections::BTreeSet::new();
    for (path, data) in files {
        let mut parent = Path::new(path).parent();
        let mut chain = Vec::new();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            chain.push(p.to_path_buf());
            parent = p.parent();
        }
        for d in chain.into_iter().rev() {
            if dirs.insert(d.clone()) {
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(1_700_000_000);
                h.set_size(0);
                b.append_data(&mut h, format!("{}/", d.display()), &[][..])
                    .unwrap();
            }
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        b.append_data(&mut h, path, *data).unwrap();
    }
    b.into_inner().unwrap()
}

pub struct Blobs(pub PathBuf);

impl Blobs {
    pub fn put(&self, data: &[u8]) -> (String, usize) {
        let h = sha(data);
        fs::write(self.0.join(&h), data).unwrap();
        (format!("sha256:{h}"), data.len())
    }
}

/// An image manifest for `arch` with two layers naming it; returns the
/// manifest's digest and size.
pub fn image(blobs: &Blobs, arch: &str) -> (String, usize) {
    let config = format!(
        r#"{{"architecture":"{arch}","os":"linux","config":{{"Env":["PATH=/usr/bin:/bin","IMAGE_ARCH={arch}"],"WorkingDir":"/srv"}},"rootfs":{{"type":"layers","diff_ids":[]}}}}"#
    );
    let (cd, cs) = blobs.put(config.as_bytes());
    let l1 = layer(&[
        ("etc/image-arch", arch.as_bytes()),
        ("srv/hello.txt", b"hello from the registry\n"),
    ]);
    let l2 = gzip(&layer(&[(
        "srv/data/n.txt",
        format!("{arch} 2\n").as_bytes(),
    )]));
    let (d1, s1) = blobs.put(&l1);
    let (d2, s2) = blobs.put(&l2);
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{cd}","size":{cs}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{d1}","size":{s1}}},{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{d2}","size":{s2}}}]}}"#
    );
    blobs.put(manifest.as_bytes())
}

pub fn write_index(dir: &Path, media: &str, digest: &str, size: usize) {
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"{media}","digest":"{digest}","size":{size}}}]}}"#
        ),
    )
    .unwrap();
}

/// A one-platform OCI layout.
pub fn single_layout(dir: &Path) {
    let blobs = Blobs(dir.join("blobs/sha256"));
    fs::create_dir_all(&blobs.0).unwrap();
    let (m, size) = image(&blobs, "amd64");
    write_index(dir, "application/vnd.oci.image.manifest.v1+json", &m, size);
}

/// A layout whose image is an index of linux/arm64 and linux/amd64.
pub fn multi_layout(dir: &Path) {
    let blobs = Blobs(dir.join("blobs/sha256"));
    fs::create_dir_all(&blobs.0).unwrap();
    let (arm, arm_size) = image(&blobs, "arm64");
    let (amd, amd_size) = image(&blobs, "amd64");
    let index = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{arm}","size":{arm_size},"platform":{{"architecture":"arm64","os":"linux"}}}},{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{amd}","size":{amd_size},"platform":{{"architecture":"amd64","os":"linux"}}}}]}}"#
    );
    let (i, isize) = blobs.put(index.as_bytes());
    write_index(dir, "application/vnd.oci.image.index.v1+json", &i, isize);
}

/// A `docker-registry` serving a temporary directory on a free loopback
/// port; killed when dropped.
pub struct Registry {
    child: Child,
    pub port: u16,
    root: PathBuf,
    creds: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// A registry over plain HTTP.
    pub fn start(creds: Option<(&str, &str)>) -> Registry {
        Registry::serve(creds, None)
    }

    /// A registry over TLS, its certificate (for 127.0.0.1) signed by `ca`.
    pub fn start_tls(ca: &TestCa, creds: Option<(&str, &str)>) -> Registry {
        Registry::serve(creds, Some(ca))
    }

    fn serve(creds: Option<(&str, &str)>, ca: Option<&TestCa>) -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("storage");
        fs::create_dir_all(&root).unwrap();
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut auth = String::new();
        if let Some((user, pass)) = creds {
            let htpasswd = dir.path().join("htpasswd");
            let out = Command::new("htpasswd")
                .args(["-Bbn", user, pass])
                .output()
                .expect("htpasswd (apache2-utils; scripts/deps.sh installs it)");
            assert!(out.status.success(), "{out:?}");
            fs::write(&htpasswd, &out.stdout).unwrap();
            auth = format!(
                "auth:\n  htpasswd:\n    realm: sandfork-test\n    path: {}\n",
                htpasswd.display()
            );
        }
        let tls = match ca {
            Some(ca) => {
                let (cert, key) = ca.server(dir.path(), &["IP:127.0.0.1"]);
                format!(
                    "  tls:\n    certificate: {}\n    key: {}\n",
                    cert.display(),
                    key.display()
                )
            }
            None => String::new(),
        };
        let config = dir.path().join("config.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 http:\n  addr: 127.0.0.1:{port}\n{tls}{auth}",
                root.display()
            ),
        )
        .unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry (Debian's package; scripts/deps.sh installs it)");
        let r = Registry {
            child,
            port,
            root,
            creds: creds.map(|(u, p)| (u.to_owned(), p.to_owned())),
            _dir: dir,
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "docker-registry did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Pushes the layout's image (all platforms) as `name`; returns the
    /// digest of what the registry holds (skopeo may compress layers and so
    /// rewrite the manifest).
    pub fn push(&self, layout: &Path, name: &str) -> String {
        let digest_file = layout.join("pushed-digest");
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--quiet", "--all", "--dest-tls-verify=false"]);
        cmd.arg(format!("--digestfile={}", digest_file.display()));
        if let Some((u, p)) = &self.creds {
            cmd.arg(format!("--dest-creds={u}:{p}"));
        }
        let out = cmd
            .arg(format!("oci:{}", layout.display()))
            .arg(format!("docker://{}/{name}", self.host()))
            .output()
            .expect("skopeo (scripts/deps.sh installs it)");
        assert!(
            out.status.success(),
            "skopeo copy: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        fs::read_to_string(digest_file).unwrap().trim().to_owned()
    }

    /// Pushes a layout `write` makes (`single_layout`, `multi_layout`) in a
    /// new temporary directory as `name`; the directory, for the test's
    /// other files too, and the digest pushed.
    pub fn push_new(&self, write: fn(&Path), name: &str) -> (tempfile::TempDir, String) {
        let tmp = tempfile::tempdir().unwrap();
        let layout = tmp.path().join("layout");
        write(&layout);
        let digest = self.push(&layout, name);
        (tmp, digest)
    }

    /// The raw manifest (or index) the registry holds for `name`.
    pub fn raw(&self, name: &str) -> serde_json::Value {
        let out = Command::new("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false"])
            .arg(format!("docker://{}/{name}", self.host()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The registry's own file of a blob.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.root
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

pub fn pull(
    store: &Path,
    reference: &str,
    creds: Option<(&str, &str)>,
) -> Result<registry::Pulled, RegistryError> {
    let opts = PullOptions {
        credentials: creds.map(|(u, p)| Credentials {
            username: u.into(),
            password: p.into(),
        }),
        ..PullOptions::default()
    };
    pull_with(store, reference, &opts)
}

pub fn pull_with(
    store: &Path,
    reference: &str,
    opts: &PullOptions,
) -> Result<registry::Pulled, RegistryError> {
    let r = Reference::parse(reference).unwrap();
    rt().block_on(registry::pull(store, &r, opts, &mut |_| {}))
}

/// Nothing half-made: only whole blobs named by their digest.
pub fn assert_store_clean(store: &Path) {
    let blobs = store.join("blobs/sha256");
    for e in fs::read_dir(&blobs).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        assert!(!name.starts_with('.'), "left behind: {name}");
        assert_eq!(sha(&fs::read(e.path()).unwrap()), name, "blob {name}");
    }
}

/// Asserts `pulled` is `manifest` with all three of its blobs (config and two
/// layers) from the store.
pub fn assert_from_store(pulled: &registry::Pulled, manifest: &str) {
    assert_eq!(
        (pulled.manifest_digest.as_str(), pulled.stats.blobs_cached),
        (manifest, 3)
    );
}

/// Asserts `err` is a refusal for want of the right credentials, saying `why`.
pub fn assert_unauthorized(err: &RegistryError, why: &str) {
    assert!(
        matches!(err, RegistryError::Unauthorized { .. }) && err.to_string().contains(why),
        "{err}"
    );
}
