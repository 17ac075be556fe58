//! Pulls from a real registry on loopback over plain HTTP: Debian's
//! `docker-registry` (distribution) started per test on a free port,
//! without auth and with htpasswd basic auth, images pushed with `skopeo
//! copy` from OCI layouts written here (tests/common/registry.rs); TLS is
//! tests/registry_tls.rs. Checks references, platform selection, digests, the blob
//! cache, errors, and that a pulled image builds into a template.

#![cfg(test)]

mod common;

use std::fs;
use std::net::TcpListener;

use common::registry::{
    Registry, assert_from_store, assert_store_clean, assert_unauthorized, multi_layout, pull, rt,
    single_layout,
};
use common::{agent, debugfs};
use template_build::registry::{self, PullOptions, Reference, RegistryError};
use template_build::{Builder, Source};

#[test]
fn an_image_over_the_bound_is_refused_before_its_layers_are_fetched() {
    let reg = Registry::start(None);
    let (tmp, _) = reg.push_new(single_layout, "sandfork/img:v1");
    let store = tmp.path().join("cache/images");
    let name = format!("{}/sandfork/img:v1", reg.host());
    let bounded = |max| PullOptions {
        max_bytes: Some(max),
        ..PullOptions::default()
    };
    let err = common::registry::pull_with(&store, &name, &bounded(10)).unwrap_err();
    assert!(
        matches!(err, RegistryError::TooLarge { max: 10, bytes, .. } if bytes > 10),
        "{err}"
    );
    // only the manifest is stored
    let blobs = fs::read_dir(store.join("blobs/sha256")).unwrap().count();
    assert_eq!(blobs, 1);
    let pulled = common::registry::pull_with(&store, &name, &bounded(1 << 30)).unwrap();
    assert_eq!(pulled.stats.blobs_fetched, 3);
}

#[test]
fn anonymous_pulls_verify_cache_and_build() {
    let reg = Registry::start(None);
    let (tmp, manifest) = reg.push_new(single_layout, "sandfork/img:v1");
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
    assert_from_store(&via, &manifest);
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
    let (tmp, index) = reg.push_new(multi_layout, "multi:latest");
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
    let (tmp, manifest) = reg.push_new(single_layout, "private/img:v1");
    let store = tmp.path().join("images");
    let name = format!("{}/private/img:v1", reg.host());

    let err = pull(&store, &name, None).unwrap_err();
    assert_unauthorized(&err, "needs credentials");
    let err = pull(&store, &name, Some(("alice", "wrong"))).unwrap_err();
    assert_unauthorized(&err, "refused");
    assert!(!err.to_string().contains("wrong"), "no password in {err}");
    let p = pull(&store, &name, Some(("alice", "s3cret-pw"))).unwrap();
    assert_eq!(p.manifest_digest, manifest);
    assert_eq!(p.stats.blobs_fetched, 3);
    assert_store_clean(&store);
}

#[test]
fn failures_are_named_and_leave_nothing_half_made() {
    let reg = Registry::start(None);
    let (tmp, _) = reg.push_new(single_layout, "img:v1");
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
    let (tmp, manifest) = reg.push_new(single_layout, "gated/img:v1");
    let gate = TokenGate::start(reg.port, "bob", "pw-of-bob");
    let store = tmp.path().join("images");
    let name = format!("127.0.0.1:{}/gated/img:v1", gate.port);

    let err = pull(&store, &name, None).unwrap_err();
    assert_unauthorized(&err, "bad credentials");
    let err = pull(&store, &name, Some(("bob", "nope"))).unwrap_err();
    assert!(err.to_string().contains("refused the credentials"), "{err}");
    let p = pull(&store, &name, Some(("bob", "pw-of-bob"))).unwrap();
    assert_eq!(p.manifest_digest, manifest);
    assert_eq!(p.stats.blobs_fetched, 3);
    // challenge, token, manifest, then three blobs with the token kept
    assert_eq!(p.stats.requests, 6);
    assert_store_clean(&store);
}

#[test]
fn resolving_names_the_platform_manifest_and_fetches_no_layer() {
    let reg = Registry::start(None);
    let (tmp, index) = reg.push_new(multi_layout, "multi:v1");
    let store = tmp.path().join("images");
    let resolve = |name: &str| {
        let r = Reference::parse(name).unwrap();
        rt().block_on(registry::resolve(
            &store,
            &r,
            &PullOptions::default(),
            &mut |_| {},
        ))
    };
    let tag = format!("{}/multi:v1", reg.host());
    let resolved = resolve(&tag).unwrap();
    // the index and the amd64 manifest, nothing else
    let stored = fs::read_dir(store.join("blobs/sha256")).unwrap().count();
    assert_eq!(stored, 2);
    assert!(store.join("blobs/sha256").join(&index[7..]).is_file());
    // a pull of the same tag names the same image
    let pulled = pull(&store, &tag, None).unwrap();
    assert_eq!(pulled.manifest_digest, resolved.manifest_digest);
    assert!(resolved.requests >= 2, "{resolved:?}");
    // by the index's digest, once stored: nothing asked
    let by_digest = format!("{}/multi@{index}", reg.host());
    drop(reg);
    let again = resolve(&by_digest).unwrap();
    assert_eq!(again.manifest_digest, resolved.manifest_digest);
    assert_eq!(again.requests, 0);
    // a tag must be asked for: with the registry gone, that is the error
    let err = resolve(&tag).unwrap_err();
    assert!(matches!(err, RegistryError::Transport { .. }), "{err}");
}
