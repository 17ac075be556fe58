//! Pulls from a real registry on loopback: Debian's `docker-registry`
//! (distribution) started per test on a free port, without auth and with
//! htpasswd basic auth, images pushed with `skopeo copy` from OCI layouts
//! written here. Checks references, platform selection, digests, the blob
//! cache, errors, and that a pulled image builds into a template.

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use template_build::registry::{self, Credentials, PullOptions, Reference, RegistryError};
use template_build::{Builder, Source};

fn sha(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A layer tar of regular files (path, content) with their directories.
fn layer(files: &[(&str, &[u8])]) -> Vec<u8> {
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

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    g.write_all(data).unwrap();
    g.finish().unwrap()
}

struct Blobs(PathBuf);

impl Blobs {
    fn put(&self, data: &[u8]) -> (String, usize) {
        let h = sha(data);
        fs::write(self.0.join(&h), data).unwrap();
        (format!("sha256:{h}"), data.len())
    }
}

/// An image manifest for `arch` with two layers naming it; returns the
/// manifest's digest and size.
fn image(blobs: &Blobs, arch: &str) -> (String, usize) {
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

fn write_index(dir: &Path, media: &str, digest: &str, size: usize) {
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
fn single_layout(dir: &Path) {
    let blobs = Blobs(dir.join("blobs/sha256"));
    fs::create_dir_all(&blobs.0).unwrap();
    let (m, size) = image(&blobs, "amd64");
    write_index(dir, "application/vnd.oci.image.manifest.v1+json", &m, size);
}

/// A layout whose image is an index of linux/arm64 and linux/amd64.
fn multi_layout(dir: &Path) {
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
struct Registry {
    child: Child,
    port: u16,
    root: PathBuf,
    creds: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Registry {
    fn start(creds: Option<(&str, &str)>) -> Registry {
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
        let config = dir.path().join("config.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 http:\n  addr: 127.0.0.1:{port}\n{auth}",
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

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Pushes the layout's image (all platforms) as `name`; returns the
    /// digest of what the registry holds (skopeo may compress layers and so
    /// rewrite the manifest).
    fn push(&self, layout: &Path, name: &str) -> String {
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

    /// The raw manifest (or index) the registry holds for `name`.
    fn raw(&self, name: &str) -> serde_json::Value {
        let out = Command::new("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false"])
            .arg(format!("docker://{}/{name}", self.host()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The registry's own file of a blob.
    fn blob_file(&self, digest: &str) -> PathBuf {
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

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn pull(
    store: &Path,
    reference: &str,
    creds: Option<(&str, &str)>,
) -> Result<registry::Pulled, RegistryError> {
    let r = Reference::parse(reference).unwrap();
    let opts = PullOptions {
        credentials: creds.map(|(u, p)| Credentials {
            username: u.into(),
            password: p.into(),
        }),
        insecure: vec![],
        loopback_via: None,
    };
    rt().block_on(registry::pull(store, &r, &opts, &mut |_| {}))
}

/// Nothing half-made: only whole blobs named by their digest.
fn assert_store_clean(store: &Path) {
    let blobs = store.join("blobs/sha256");
    for e in fs::read_dir(&blobs).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        assert!(!name.starts_with('.'), "left behind: {name}");
        assert_eq!(sha(&fs::read(e.path()).unwrap()), name, "blob {name}");
    }
}

fn agent(dir: &Path) -> PathBuf {
    let p = dir.join("agent");
    fs::write(&p, b"#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn debugfs(image: &Path, request: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(request)
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs {request}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn anonymous_pulls_verify_cache_and_build() {
    let reg = Registry::start(None);
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    single_layout(&layout);
    let manifest = reg.push(&layout, "sandfork/img:v1");
    let store = tmp.path().join("cache/images");

    let first = pull(&store, &format!("{}/sandfork/img:v1", reg.host()), None).unwrap();
    assert_eq!(first.manifest_digest, manifest);
    assert_eq!(
        (first.stats.blobs_fetched, first.stats.blobs_cached),
        (3, 0),
        "config and two layers"
    );
    assert!(first.stats.bytes_fetched > 0);
    assert_store_clean(&store);

    // the same tag again: the manifest is asked for, no blob downloaded
    let again = pull(&store, &format!("{}/sandfork/img:v1", reg.host()), None).unwrap();
    assert_eq!(again.manifest_digest, manifest);
    assert_eq!(
        (again.stats.blobs_fetched, again.stats.bytes_fetched),
        (0, 0)
    );
    assert_eq!((again.stats.blobs_cached, again.stats.requests), (3, 1));

    // a loopback registry reached through another address (a node in the
    // KVM lab reaches its host's loopback through the lab's gateway)
    let r = Reference::parse(&format!("127.0.0.9:{}/sandfork/img:v1", reg.port)).unwrap();
    let opts = PullOptions {
        loopback_via: Some("127.0.0.1".into()),
        ..PullOptions::default()
    };
    let via = rt()
        .block_on(registry::pull(&store, &r, &opts, &mut |_| {}))
        .unwrap();
    assert_eq!(
        (via.manifest_digest.as_str(), via.stats.blobs_cached),
        (manifest.as_str(), 3)
    );
    let err = pull(
        &store,
        &format!("127.0.0.9:{}/sandfork/img:v1", reg.port),
        None,
    )
    .unwrap_err();
    assert!(matches!(err, RegistryError::Transport { .. }), "{err}");

    // by digest, with the registry gone: nothing asked at all
    let by_digest = format!("{}/sandfork/img@{manifest}", reg.host());
    drop(reg);
    let cached = pull(&store, &by_digest, None).unwrap();
    assert_eq!(cached.stats.requests, 0);
    assert_eq!(cached.manifest_digest, manifest);

    // and it builds as a local image does
    let builder = Builder::new(agent(tmp.path()))
        .cache_dir(tmp.path().join("cache"))
        .image_size(64 << 20);
    assert_eq!(builder.images_dir(), store);
    let t = builder
        .build(
            &Source::OciBlobs {
                dir: store.clone(),
                manifest: manifest.clone(),
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(t.config.working_dir.as_deref(), Some("/srv"));
    assert!(
        t.config
            .env
            .contains(&("IMAGE_ARCH".to_owned(), "amd64".to_owned()))
    );
    assert_eq!(
        debugfs(&t.rootfs, "cat /srv/hello.txt"),
        "hello from the registry\n"
    );
    assert_eq!(debugfs(&t.rootfs, "cat /srv/data/n.txt"), "amd64 2\n");
    let again = builder
        .build(
            &Source::OciBlobs {
                dir: store,
                manifest,
            },
            &mut |_| {},
        )
        .unwrap();
    assert!(again.cached);
    assert_eq!(again.key, t.key);
}

#[test]
fn indexes_resolve_to_linux_amd64() {
    let reg = Registry::start(None);
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    multi_layout(&layout);
    let index = reg.push(&layout, "multi:latest");
    let pushed = reg.raw("multi:latest");
    let amd64 = pushed["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["platform"]["architecture"] == "amd64")
        .unwrap()["digest"]
        .as_str()
        .unwrap()
        .to_owned();
    let store = tmp.path().join("images");
    // no tag means latest
    let p = pull(&store, &format!("{}/multi", reg.host()), None).unwrap();
    assert_eq!(p.manifest_digest, amd64);
    assert_eq!(p.stats.blobs_fetched, 3, "only amd64's blobs");
    assert!(store.join("blobs/sha256").join(&index[7..]).is_file());
    // by the index's digest, from the store
    let again = pull(&store, &format!("{}/multi@{index}", reg.host()), None).unwrap();
    assert_eq!(
        (again.manifest_digest.as_str(), again.stats.requests),
        (amd64.as_str(), 0)
    );
    assert_store_clean(&store);
}

#[test]
fn basic_auth_needs_the_right_credentials() {
    let reg = Registry::start(Some(("alice", "s3cret-pw")));
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    single_layout(&layout);
    let manifest = reg.push(&layout, "private/img:v1");
    let store = tmp.path().join("images");
    let name = format!("{}/private/img:v1", reg.host());

    let err = pull(&store, &name, None).unwrap_err();
    assert!(
        matches!(err, RegistryError::Unauthorized { .. })
            && err.to_string().contains("needs credentials"),
        "{err}"
    );
    let err = pull(&store, &name, Some(("alice", "wrong"))).unwrap_err();
    assert!(
        matches!(err, RegistryError::Unauthorized { .. }) && err.to_string().contains("refused"),
        "{err}"
    );
    assert!(!err.to_string().contains("wrong"), "no password in {err}");
    let p = pull(&store, &name, Some(("alice", "s3cret-pw"))).unwrap();
    assert_eq!(p.manifest_digest, manifest);
    assert_eq!(p.stats.blobs_fetched, 3);
    assert_store_clean(&store);
}

#[test]
fn failures_are_named_and_leave_nothing_half_made() {
    let reg = Registry::start(None);
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    single_layout(&layout);
    reg.push(&layout, "img:v1");
    let store = tmp.path().join("images");

    for missing in ["img:v2", "nothing/here:v1"] {
        let err = pull(&store, &format!("{}/{missing}", reg.host()), None).unwrap_err();
        assert!(
            matches!(err, RegistryError::NotFound { .. }) && err.to_string().contains(missing),
            "{missing}: {err}"
        );
    }
    let unknown = format!("sha256:{}", "0".repeat(64));
    let err = pull(&store, &format!("{}/img@{unknown}", reg.host()), None).unwrap_err();
    assert!(matches!(err, RegistryError::NotFound { .. }), "{err}");

    // a layer the registry serves corrupted (same size, other bytes)
    let m = reg.raw("img:v1");
    let layer = m["layers"][1]["digest"].as_str().unwrap().to_owned();
    let file = reg.blob_file(&layer);
    let mut bytes = fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&file, &bytes).unwrap();
    let err = pull(&store, &format!("{}/img:v1", reg.host()), None).unwrap_err();
    assert!(
        matches!(err, RegistryError::DigestMismatch { .. }) && err.to_string().contains(&layer),
        "{err}"
    );
    assert!(!store.join("blobs/sha256").join(&layer[7..]).exists());
    assert_store_clean(&store);

    // nothing listening
    let port = reg.port;
    drop(reg);
    let err = pull(&store, &format!("127.0.0.1:{port}/img:v1"), None).unwrap_err();
    assert!(
        matches!(err, RegistryError::Transport { .. }) && err.to_string().contains("connecting"),
        "{err}"
    );
    // HTTPS registries are refused by name, before any connection
    let err = pull(&store, "registry.invalid/img:v1", None).unwrap_err();
    assert!(err.to_string().contains("TLS"), "{err}");
    assert_store_clean(&store);
}

/// A token service in front of a registry, as Docker Hub and most hosted
/// registries have one: `/v2/` answers 401 with a Bearer challenge naming
/// `/token`, which hands a token for the right basic credentials; requests
/// with that token are passed to the registry. One request per connection.
struct TokenGate {
    port: u16,
}

const TOKEN: &str = "tok-0123456789";

impl TokenGate {
    fn start(upstream: u16, user: &'static str, pass: &'static str) -> TokenGate {
        use std::io::{Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let path = text.split_whitespace().nth(1).unwrap_or("").to_owned();
                let auth = text
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("authorization")
                            .then(|| v.trim().to_owned())
                    })
                    .unwrap_or_default();
                let answer = |conn: &mut std::net::TcpStream,
                              status: &str,
                              extra: &str,
                              body: &str| {
                    let _ = write!(
                        conn,
                        "HTTP/1.1 {status}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                };
                if path.starts_with("/token?") {
                    use base64::Engine as _;
                    let basic = format!(
                        "Basic {}",
                        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
                    );
                    let scoped = path.contains("scope=repository%3Agated%2Fimg%3Apull")
                        && path.contains("service=gate");
                    if auth == basic && scoped {
                        answer(
                            &mut conn,
                            "200 OK",
                            "",
                            &format!(r#"{{"token":"{TOKEN}"}}"#),
                        );
                    } else {
                        answer(
                            &mut conn,
                            "401 Unauthorized",
                            "",
                            r#"{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}"#,
                        );
                    }
                } else if auth == format!("Bearer {TOKEN}") {
                    let Ok(mut up) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
                        continue;
                    };
                    let head = text.replacen("\r\n", "\r\nConnection: close\r\n", 1);
                    let _ = up.write_all(head.as_bytes());
                    let _ = std::io::copy(&mut up, &mut conn);
                } else {
                    let challenge = format!(
                        "WWW-Authenticate: Bearer realm=\"http://127.0.0.1:{port}/token\",service=\"gate\",scope=\"repository:gated/img:pull\"\r\n"
                    );
                    answer(
                        &mut conn,
                        "401 Unauthorized",
                        &challenge,
                        r#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#,
                    );
                }
            }
        });
        TokenGate { port }
    }
}

#[test]
fn the_token_flow_gets_a_bearer_token_with_the_credentials() {
    let reg = Registry::start(None);
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    single_layout(&layout);
    let manifest = reg.push(&layout, "gated/img:v1");
    let gate = TokenGate::start(reg.port, "bob", "pw-of-bob");
    let store = tmp.path().join("images");
    let name = format!("127.0.0.1:{}/gated/img:v1", gate.port);

    let err = pull(&store, &name, None).unwrap_err();
    assert!(
        matches!(err, RegistryError::Unauthorized { .. })
            && err.to_string().contains("bad credentials"),
        "{err}"
    );
    let err = pull(&store, &name, Some(("bob", "nope"))).unwrap_err();
    assert!(err.to_string().contains("refused the credentials"), "{err}");
    let p = pull(&store, &name, Some(("bob", "pw-of-bob"))).unwrap();
    assert_eq!(p.manifest_digest, manifest);
    assert_eq!(p.stats.blobs_fetched, 3);
    // challenge, token, manifest, then three blobs with the token kept
    assert_eq!(p.stats.requests, 6);
    assert_store_clean(&store);
}
