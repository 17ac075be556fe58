//! A throwaway CA and the server certificates it signs (made with the
//! `openssl` CLI), and a tiny HTTPS server on loopback for cases a real
//! registry cannot be made to show (redirects to another host).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl CLI");
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

/// `openssl req` with a new P-256 key, unencrypted, written to `key`; then `args`.
fn new_key_req(dir: &Path, key: &str, args: &[&str]) {
    let mut all = vec![
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key,
    ];
    all.extend_from_slice(args);
    openssl(dir, &all);
}

/// A CA made for one test: `ca.crt` and its key in a temporary directory.
pub struct TestCa {
    dir: tempfile::TempDir,
}

impl TestCa {
    pub fn new() -> TestCa {
        let dir = tempfile::tempdir().unwrap();
        new_key_req(
            dir.path(),
            "ca.key",
            &[
                "-x509",
                "-out",
                "ca.crt",
                "-days",
                "2",
                "-subj",
                "/CN=sandfork test CA",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        );
        TestCa { dir }
    }

    /// The CA's certificate (PEM).
    pub fn cert(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// A server certificate for `names` (`IP:127.0.0.1`, `DNS:x`) and its
    /// key, written into `out`.
    pub fn server(&self, out: &Path, names: &[&str]) -> (PathBuf, PathBuf) {
        let ca = self.dir.path();
        let (cert, key, csr, ext) = (
            out.join("server.crt"),
            out.join("server.key"),
            out.join("server.csr"),
            out.join("server.ext"),
        );
        std::fs::write(
            &ext,
            format!(
                "subjectAltName={}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
                names.join(",")
            ),
        )
        .unwrap();
        let s = |p: &Path| p.to_str().unwrap().to_owned();
        new_key_req(
            out,
            &s(&key),
            &["-out", &s(&csr), "-subj", "/CN=sandfork test registry"],
        );
        openssl(
            out,
            &[
                "x509",
                "-req",
                "-in",
                &s(&csr),
                "-CA",
                &s(&ca.join("ca.crt")),
                "-CAkey",
                &s(&ca.join("ca.key")),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &s(&ext),
                "-out",
                &s(&cert),
            ],
        );
        (cert, key)
    }
}

/// What a [`TlsServer`] answers: status, extra headers, body.
pub type Answer = (u16, Vec<(String, String)>, Vec<u8>);

/// One request as a [`TlsServer`] saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub authorization: Option<String>,
}

/// An HTTPS server on `ip` (a loopback address) answering each request
/// (one per connection) with a handler; it records what it was asked.
pub struct TlsServer {
    pub port: u16,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl TlsServer {
    pub fn start(
        ip: &str,
        cert: &Path,
        key: &Path,
        handler: impl Fn(&Seen) -> Answer + Send + Sync + 'static,
    ) -> TlsServer {
        let certs = CertificateDer::pem_file_iter(cert)
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(key).unwrap();
        let config = Arc::new(
            rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap(),
        );
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handler = Arc::new(handler);
        let log = seen.clone();
        std::thread::spawn(move || {
            for tcp in listener.incoming() {
                let Ok(tcp) = tcp else { continue };
                let (config, handler, log) = (config.clone(), handler.clone(), log.clone());
                std::thread::spawn(move || {
                    let _ = serve_one(tcp, config, &*handler, &log);
                });
            }
        });
        TlsServer { port, seen }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn serve_one(
    tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
    handler: &(dyn Fn(&Seen) -> Answer + Send + Sync),
    log: &Mutex<Vec<Seen>>,
) -> std::io::Result<()> {
    let conn = rustls::ServerConnection::new(config).map_err(std::io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tls.read(&mut byte)? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let seen = Seen {
        path: text.split_whitespace().nth(1).unwrap_or("").to_owned(),
        authorization: text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("authorization")
                .then(|| v.trim().to_owned())
        }),
    };
    log.lock().unwrap().push(seen.clone());
    let (status, headers, body) = handler(&seen);
    let mut out = format!(
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    tls.write_all(out.as_bytes())?;
    tls.write_all(&body)?;
    tls.conn.send_close_notify();
    tls.flush()
}
