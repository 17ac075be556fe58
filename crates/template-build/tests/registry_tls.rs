//! Pulls over TLS from registries on loopback: Debian's `docker-registry`
//! serving TLS with a certificate of a CA made per test, trusted through
//! [`PullOptions::ca_file`] (`SANDFORK_REGISTRY_CA`) or not, and tiny
//! HTTPS servers for a registry that redirects blob downloads to another
//! host, as hosted registries send them to a CDN.

#![cfg(test)]

mod common;

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use common::registry::{
    Registry, assert_from_store, assert_store_clean, assert_unauthorized, pull_with, single_layout,
};
use common::tls::{Seen, TestCa, TlsServer};
use template_build::registry::{Credentials, PullOptions, RegistryError};

fn opts(ca: Option<&Path>, creds: Option<(&str, &str)>) -> PullOptions {
    PullOptions {
        credentials: creds.map(|(u, p)| Credentials {
            username: u.into(),
            password: p.into(),
        }),
        ca_file: ca.map(Path::to_owned),
        ..PullOptions::default()
    }
}

#[test]
fn tls_registries_are_trusted_through_the_ca_file() {
    let ca = TestCa::new();
    let creds = ("alice", "tls-pw");
    let reg = Registry::start_tls(&ca, Some(creds));
    let (tmp, manifest) = reg.push_new(single_layout, "secure/img:v1");
    let store = tmp.path().join("images");
    let name = format!("{}/secure/img:v1", reg.host());

    // the system's roots alone do not know the test's CA
    let err = pull_with(&store, &name, &opts(None, Some(creds))).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, RegistryError::Tls { .. })
            && msg.contains(&format!("the certificate of {} is not trusted", reg.host()))
            && msg.contains("SANDFORK_REGISTRY_CA")
            && msg.contains("SANDFORK_INSECURE_REGISTRIES"),
        "{err}"
    );
    assert_store_clean(&store);

    // trusted: the pull goes over TLS with the credentials (the registry
    // answers only TLS: its first, plain-HTTP answer is not counted)
    let p = pull_with(&store, &name, &opts(Some(&ca.cert()), Some(creds))).unwrap();
    assert_eq!(p.manifest_digest, manifest);
    assert_eq!(p.stats.blobs_fetched, 3);
    assert_eq!(p.stats.requests, 5, "challenge, manifest, three blobs");
    assert_store_clean(&store);
    let err = pull_with(
        &store,
        &name,
        &opts(Some(&ca.cert()), Some(("alice", "no"))),
    )
    .unwrap_err();
    assert_unauthorized(&err, "refused");

    // a registry listed insecure is pulled from without checking its
    // certificate, as Docker does
    let insecure = PullOptions {
        insecure: vec![reg.host()],
        ..opts(None, Some(creds))
    };
    let again = pull_with(&store, &name, &insecure).unwrap();
    assert_from_store(&again, &manifest);

    // the certificate names 127.0.0.1, not localhost
    let err = pull_with(
        &store,
        &format!("localhost:{}/secure/img:v1", reg.port),
        &opts(Some(&ca.cert()), Some(creds)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("not valid for that name"), "{err}");

    // a CA file that is not one is named
    let junk = tmp.path().join("junk.pem");
    fs::write(&junk, "not a certificate\n").unwrap();
    for bad in [junk, tmp.path().join("missing.pem")] {
        let err = pull_with(&store, &name, &opts(Some(&bad), Some(creds))).unwrap_err();
        assert!(
            matches!(err, RegistryError::Tls { .. })
                && err.to_string().contains("SANDFORK_REGISTRY_CA")
                && err.to_string().contains(bad.to_str().unwrap()),
            "{err}"
        );
    }
}

#[test]
fn redirected_blobs_are_fetched_from_the_other_host_without_credentials() {
    let ca = TestCa::new();
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = ca.server(tmp.path(), &["IP:127.0.0.1", "IP:127.0.0.2"]);
    let layout = tmp.path().join("layout");
    single_layout(&layout);
    let blobs = layout.join("blobs/sha256");
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let manifest = index["manifests"][0]["digest"].as_str().unwrap().to_owned();

    // the "CDN": any blob by its hex, on another address
    let cdn = |cert: &Path, key: &Path| {
        let blobs = blobs.clone();
        TlsServer::start("127.0.0.2", cert, key, move |seen: &Seen| {
            let hex = seen
                .path
                .strip_prefix("/cdn/")
                .and_then(|p| p.split('?').next())
                .unwrap_or("");
            match fs::read(blobs.join(hex)) {
                Ok(data) if !hex.is_empty() => (200, vec![], data),
                _ => (404, vec![], vec![]),
            }
        })
    };
    let good_cdn = cdn(&cert, &key);
    // the registry: basic auth, the manifest served, blobs redirected to
    // the CDN on port `cdn_port`
    use base64::Engine as _;
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("carol:cdn-pw")
    );
    let cdn_port = Arc::new(AtomicU16::new(good_cdn.port));
    let to_cdn = cdn_port.clone();
    let manifest_bytes = fs::read(blobs.join(&manifest[7..])).unwrap();
    let reg = TlsServer::start("127.0.0.1", &cert, &key, move |seen: &Seen| {
        if seen.authorization.as_deref() != Some(basic.as_str()) {
            let challenge = ("WWW-Authenticate".into(), "Basic realm=\"test\"".into());
            return (401, vec![challenge], vec![]);
        }
        if seen.path == "/v2/redirected/img/manifests/v1" {
            let media = (
                "Content-Type".into(),
                "application/vnd.oci.image.manifest.v1+json".into(),
            );
            return (200, vec![media], manifest_bytes.clone());
        }
        if let Some(d) = seen.path.strip_prefix("/v2/redirected/img/blobs/sha256:") {
            let port = to_cdn.load(Ordering::Relaxed);
            let to = format!("https://127.0.0.2:{port}/cdn/{d}?signature=x");
            return (307, vec![("Location".into(), to)], vec![]);
        }
        (404, vec![], vec![])
    });
    let store = tmp.path().join("images");
    let name = format!("127.0.0.1:{}/redirected/img:v1", reg.port);
    let creds = Some(("carol", "cdn-pw"));

    let p = pull_with(&store, &name, &opts(Some(&ca.cert()), creds)).unwrap();
    assert_eq!(p.manifest_digest, manifest);
    assert_eq!(p.stats.blobs_fetched, 3);
    assert_store_clean(&store);
    let at_cdn = good_cdn.seen();
    assert_eq!(at_cdn.len(), 3, "{at_cdn:?}");
    assert!(
        at_cdn.iter().all(|s| s.authorization.is_none()),
        "credentials sent to the other host: {at_cdn:?}"
    );
    // the registry saw the credentials on every request after the challenge
    let at_reg = reg.seen();
    assert!(
        at_reg.iter().skip(1).all(|s| s.authorization.is_some()),
        "{at_reg:?}"
    );

    // a CDN whose certificate is not trusted fails the pull, named
    let other_ca = TestCa::new();
    let other = tmp.path().join("other");
    fs::create_dir(&other).unwrap();
    let (cert2, key2) = other_ca.server(&other, &["IP:127.0.0.2"]);
    let bad_cdn = cdn(&cert2, &key2);
    cdn_port.store(bad_cdn.port, Ordering::Relaxed);
    let err = pull_with(
        &tmp.path().join("images2"),
        &name,
        &opts(Some(&ca.cert()), creds),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "the certificate of 127.0.0.2:{} is not trusted",
            bad_cdn.port
        )),
        "{err}"
    );
}
