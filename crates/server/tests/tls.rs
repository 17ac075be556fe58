//! TLS between a cluster's parts on real listeners: a node's port (the
//! server's own TLS listener) answers a client with a certificate of the
//! cluster's CA and nobody else; a client of another cluster rejects the
//! node; a gateway reaches a node through TLS, with etcd (a real member)
//! under TLS too. Certificates are `sandfork cluster certs`'s.

#![cfg(test)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use sandfork_tls::{self as tls, ClusterTls, Dialer, TlsFiles};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn certs(dir: &Path, names: &str) -> Vec<std::path::PathBuf> {
    tls::make_certs(dir, &tls::parse_names(names).unwrap(), 30).unwrap()
}

fn part(dir: &Path, name: &str) -> TlsFiles {
    TlsFiles {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}-key.pem")),
        ca: dir.join("ca.pem"),
    }
}

fn load(dir: &Path, name: &str) -> ClusterTls {
    part(dir, name).load().unwrap()
}

/// A node's port under `tls` (the server's listener), answering
/// `/health` and a list of one sandbox; how many requests reached it.
async fn node_port(tls: &ClusterTls) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(AtomicUsize::new(0));
    let counted = seen.clone();
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/sandboxes",
            get(|| async { axum::Json(serde_json::json!([{"sandboxID": "behind-tls"}])) }),
        )
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                counted.fetch_add(1, Ordering::SeqCst);
                next.run(req)
            },
        ));
    let listener = server::http::tls::TlsListener::new(listener, tls.server_config()).unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

/// `GET /health` through `dialer`: the body, or why it failed.
async fn health(dialer: &Dialer, addr: &str) -> Result<String, String> {
    let stream = dialer.connect(addr).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::get("/health")
        .header("host", addr)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let answer = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let body = answer
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
}

#[tokio::test]
async fn a_node_port_answers_its_clusters_parts_only() {
    let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    certs(ours.path(), "gw1,n1");
    certs(theirs.path(), "gw1,n1");
    let (addr, seen) = node_port(&load(ours.path(), "n1")).await;

    // A part of the cluster: answered.
    let gateway = load(ours.path(), "gw1").dialer();
    assert_eq!(health(&gateway, &addr).await.unwrap(), "ok");
    assert_eq!(seen.load(Ordering::SeqCst), 1);

    // A certificate of another CA: refused.
    let stranger = load(theirs.path(), "gw1").dialer();
    let refused = health(&stranger, &addr).await;
    assert!(
        refused.is_err(),
        "another CA's client was answered: {refused:?}"
    );

    // No certificate at all (the server's certificate trusted): refused.
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read(ours.path().join("ca.pem")).unwrap();
    for cert in rustls_pemfile_free(&ca) {
        roots.add(cert).unwrap();
    }
    let anonymous = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("n1").unwrap();
    let answered = async {
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(anonymous))
            .connect(name, tcp)
            .await?;
        tls.write_all(b"GET /health HTTP/1.1\r\nhost: n1\r\nconnection: close\r\n\r\n")
            .await?;
        let mut got = Vec::new();
        tls.read_to_end(&mut got).await?;
        std::io::Result::Ok(got)
    }
    .await;
    match answered {
        Ok(got) => assert!(
            !String::from_utf8_lossy(&got).contains("HTTP/1.1"),
            "a client without a certificate was answered: {}",
            String::from_utf8_lossy(&got)
        ),
        Err(e) => assert!(e.to_string().contains("Certificate"), "{e}"),
    }

    // Plain HTTP: no HTTP answer.
    let mut plain = tokio::net::TcpStream::connect(&addr).await.unwrap();
    plain
        .write_all(b"GET /health HTTP/1.1\r\nhost: n1\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), plain.read_to_end(&mut got)).await;
    assert!(
        !String::from_utf8_lossy(&got).contains("HTTP/1.1"),
        "plain HTTP was answered: {}",
        String::from_utf8_lossy(&got)
    );
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "only the cluster's request got through"
    );
}

/// The CA's certificates in a PEM text.
fn rustls_pemfile_free(pem: &[u8]) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .map(Result::unwrap)
        .collect()
}

#[tokio::test]
async fn a_client_of_another_cluster_rejects_the_node() {
    let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    certs(ours.path(), "gw1");
    certs(theirs.path(), "n1");
    let (addr, seen) = node_port(&load(theirs.path(), "n1")).await;
    let refused = health(&load(ours.path(), "gw1").dialer(), &addr).await;
    let Err(why) = refused else {
        panic!("the node of another cluster was trusted: {refused:?}");
    };
    assert!(why.contains("certificate"), "{why}");
    assert_eq!(seen.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_gateway_reaches_nodes_through_tls_and_etcd_under_tls() {
    let dir = tempfile::tempdir().unwrap();
    certs(dir.path(), "gw1,n1,etcd/127.0.0.1");
    let etcd =
        sandfork_cluster::harness::Etcd::start_members_tls(1, part(dir.path(), "etcd")).unwrap();
    assert!(etcd.endpoints()[0].starts_with("https://"));
    etcd.elected(Duration::from_secs(30)).await.unwrap();

    // etcd refuses a client without the cluster's TLS.
    let plain = sandfork_cluster::Cluster::connect(&etcd.endpoints()).await;
    if let Ok(plain) = plain {
        assert!(plain.nodes().await.is_err(), "etcd answered a plain client");
    }

    let node_tls = load(dir.path(), "n1");
    let (addr, seen) = node_port(&node_tls).await;
    let node_etcd = sandfork_cluster::Cluster::connect_with(&etcd.endpoints(), Some(&node_tls))
        .await
        .unwrap();
    let capacity = sandfork_cluster::NodeCapacity {
        max_sandboxes: 4,
        vcpus: 2,
        memory_mib: 1024,
    };
    let _registration = sandfork_cluster::Registration::start(
        node_etcd,
        "n1",
        &addr,
        capacity,
        Duration::from_secs(10),
    )
    .await
    .unwrap();

    let gw_tls = load(dir.path(), "gw1");
    let list = |dialer: Dialer| {
        let endpoints = etcd.endpoints();
        let gw_tls = gw_tls.clone();
        async move {
            let cluster = sandfork_cluster::Cluster::connect_with(&endpoints, Some(&gw_tls))
                .await
                .unwrap();
            let options = server::http::gateway::GatewayOptions {
                dialer,
                ..Default::default()
            };
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let gateway = listener.local_addr().unwrap().to_string();
            let app = server::http::gateway::router(cluster, options);
            tokio::spawn(async move { axum::serve(listener, app).await });
            // The gateway's own port is plain HTTP.
            let (answer, body) = get_plain(&gateway, "/sandboxes").await;
            (answer, body)
        }
    };
    let (headers, body) = list(gw_tls.dialer()).await;
    assert!(body.contains("behind-tls"), "{body}");
    assert!(
        !headers.contains("x-sandfork-unreachable-nodes"),
        "{headers}"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 1);

    // A gateway without TLS does not reach the node.
    let (headers, body) = list(Dialer::plain()).await;
    assert!(!body.contains("behind-tls"), "{body}");
    assert!(
        headers.contains("x-sandfork-unreachable-nodes: n1"),
        "{headers}"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 1);
}

/// A plain HTTP GET with an API key: the answer's head and body.
async fn get_plain(addr: &str, path: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req =
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nx-api-key: k\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (head.to_ascii_lowercase(), body.to_owned())
}

#[test]
fn certs_are_private_all_or_none_and_never_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tls");
    let written = certs(&out, "gw1,n1,etcd/10.0.0.1/127.0.0.1");
    assert_eq!(written.len(), 7, "{written:?}");
    for path in &written {
        let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", path.display());
    }
    // every part loads; the CA's key is nowhere
    for name in ["gw1", "n1", "etcd"] {
        load(&out, name);
    }
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with("ca-key")), "{names:?}");

    // Another run naming one existing file writes nothing.
    let before = std::fs::read(out.join("n1.pem")).unwrap();
    let again = tls::make_certs(&out, &tls::parse_names("n2,n1").unwrap(), 30);
    assert!(again.is_err());
    assert!(!out.join("n2.pem").exists());
    assert_eq!(std::fs::read(out.join("n1.pem")).unwrap(), before);

    for bad in ["", "ca", "n1,n1", "../x", "n1/not an address"] {
        assert!(tls::parse_names(bad).is_err(), "{bad:?}");
    }
    // all three files or none
    let one = TlsFiles::from_parts(Some("c".into()), None, Some("a".into()));
    let why = one.unwrap_err().to_string();
    assert!(why.ends_with("missing: --tls-key"), "{why}");
    assert_eq!(TlsFiles::from_parts(None, None, None).unwrap(), None);
}
