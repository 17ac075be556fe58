//! TLS between a cluster's parts, with both sides authenticated: the one
//! owner of its set-up. Every part (gateway, node, etcd member) holds a
//! certificate and key signed by the cluster's private CA and trusts only
//! that CA:
//!
//! - a node's port ([`ClusterTls::server_config`]) asks every client for a
//!   certificate of the CA and answers nothing to one without;
//! - every client of a node's port (the gateway's pool, fork requests and
//!   kills between nodes, fork-file fetches, the CLI) dials through one
//!   [`Dialer`], which presents the part's certificate and accepts a server
//!   whose chain leads to the CA. Names are not checked: nodes are reached
//!   at the addresses etcd holds for them, which no certificate needs to
//!   list, and the CA signs the cluster's parts only;
//! - etcd is reached with the same certificate (`sandfork-cluster` makes
//!   its client options from [`ClusterTls::cert_pem`] and the others);
//!   etcd's own server certificate must name the address it is reached at.
//!
//! [`make_certs`] makes a CA and per-part certificates for a test or a small
//! deployment (`sandfork cluster certs`).

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The environment variables the three files may be named by (the flags'
/// own, and what the CLI reads for an `https://` node).
pub const CERT_ENV: &str = "SANDFORK_TLS_CERT";
pub const KEY_ENV: &str = "SANDFORK_TLS_KEY";
pub const CA_ENV: &str = "SANDFORK_TLS_CA";

/// How long a node's TCP connect may take (a gateway moves on to the next
/// node after it; a node cut off answers nothing).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the TLS handshake after it may take (two round trips and a
/// signature each way; far longer on a loaded, emulated host).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "TLS needs all three of --tls-cert, --tls-key and --tls-ca ({CERT_ENV}, {KEY_ENV}, {CA_ENV}); missing: {0}"
    )]
    Partial(String),
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("{what}: {reason}")]
    Pem { what: &'static str, reason: String },
    #[error("TLS set-up: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("TLS client verification: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("making certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{0}")]
    Names(String),
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The three files a part's TLS is made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The part's certificate (PEM; intermediates may follow it).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The cluster's CA certificate (PEM): the only one trusted.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// All three paths or none (None); one or two of them is an error that
    /// says which are missing.
    pub fn from_parts(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles { cert, key, ca })),
            (cert, key, ca) => {
                let missing: Vec<&str> = [
                    (cert.is_none(), "--tls-cert"),
                    (key.is_none(), "--tls-key"),
                    (ca.is_none(), "--tls-ca"),
                ]
                .into_iter()
                .filter_map(|(missing, flag)| missing.then_some(flag))
                .collect();
                Err(TlsError::Partial(missing.join(", ")))
            }
        }
    }

    /// From `SANDFORK_TLS_CERT`, `_KEY` and `_CA` (empty counts as unset).
    pub fn from_env() -> Result<Option<TlsFiles>, TlsError> {
        let var = |name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        TlsFiles::from_parts(var(CERT_ENV), var(KEY_ENV), var(CA_ENV))
    }

    /// Reads and checks the files.
    pub fn load(&self) -> Result<ClusterTls, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|e| TlsError::File {
                path: path.to_owned(),
                reason: e.to_string(),
            })
        };
        let (cert_pem, key_pem, ca_pem) = (read(&self.cert)?, read(&self.key)?, read(&self.ca)?);
        ClusterTls::from_pem(&cert_pem, &key_pem, &ca_pem).map_err(|e| match e {
            TlsError::Pem { what, reason } => TlsError::File {
                path: match what {
                    KEY => self.key.clone(),
                    CA => self.ca.clone(),
                    _ => self.cert.clone(),
                },
                reason,
            },
            e => e,
        })
    }
}

/// A part's TLS, loaded: what its node port serves with, what its clients
/// dial with, what it reaches etcd with (cheap to clone).
#[derive(Clone)]
pub struct ClusterTls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the key
        f.debug_struct("ClusterTls").finish_non_exhaustive()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

const CERT: &str = "the certificate";
const KEY: &str = "the key";
const CA: &str = "the CA";

fn pem_error(what: &'static str, e: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        what,
        reason: e.to_string(),
    }
}

impl ClusterTls {
    /// From the PEM text of the part's certificate (chain), key and CA.
    pub fn from_pem(
        cert_pem: &[u8],
        key_pem: &[u8],
        ca_pem: &[u8],
    ) -> Result<ClusterTls, TlsError> {
        let certs = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_error(CERT, e))?;
        if certs.is_empty() {
            return Err(pem_error(CERT, "no certificate in it"));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| pem_error(KEY, e))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_pem) {
            roots
                .add(ca.map_err(|e| pem_error(CA, e))?)
                .map_err(|e| pem_error(CA, e))?;
        }
        if roots.is_empty() {
            return Err(pem_error(CA, "no certificate in it"));
        }
        let roots = Arc::new(roots);
        let provider = provider();
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build()?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(certs.clone(), key.clone_key())?;
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainVerifier { roots, provider }))
            .with_client_auth_cert(certs, key)?;
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ClusterTls {
            server: Arc::new(server),
            client: Arc::new(client),
            cert_pem: cert_pem.to_vec(),
            key_pem: key_pem.to_vec(),
            ca_pem: ca_pem.to_vec(),
        })
    }

    /// What a node's port serves with: a client certificate of the CA is
    /// required.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        self.server.clone()
    }

    /// What clients of a node's port dial with.
    pub fn dialer(&self) -> Dialer {
        Dialer {
            tls: Some(self.client.clone()),
        }
    }

    /// The PEM text of this part's certificate (chain), for a client that
    /// takes PEM rather than rustls's configs (etcd's).
    pub fn cert_pem(&self) -> &[u8] {
        &self.cert_pem
    }

    /// The PEM text of this part's private key.
    pub fn key_pem(&self) -> &[u8] {
        &self.key_pem
    }

    /// The PEM text of the cluster's CA certificate.
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }
}

/// A server's certificate is good when its chain leads to the cluster's CA
/// (and it is valid now, for a server): whatever names it holds.
#[derive(Debug)]
struct ChainVerifier {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ChainVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// How every client reaches a node's port: plain TCP, or TLS with the
/// part's certificate (cheap to clone). Also the gateway pool's connector.
#[derive(Clone, Default)]
pub struct Dialer {
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.tls.is_some() {
            "Dialer(tls)"
        } else {
            "Dialer(plain)"
        })
    }
}

impl Dialer {
    /// Plain TCP (a cluster without TLS).
    pub fn plain() -> Dialer {
        Dialer::default()
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// A pooled client whose connections this dialer makes, each kept for
    /// `idle` between requests: the gateway's pool, a fork's chunk fetches.
    pub fn pooled<B>(&self, idle: Duration) -> Client<Dialer, B>
    where
        B: hyper::body::Body + Send,
        B::Data: Send,
    {
        Client::builder(TokioExecutor::new())
            .pool_idle_timeout(idle)
            .pool_timer(TokioTimer::new())
            .build(self.clone())
    }

    /// The scheme of a node's URL as this dialer reaches it.
    pub fn scheme(&self) -> &'static str {
        if self.is_tls() { "https" } else { "http" }
    }

    /// A connection to `addr` (`host:port`), through TLS when the dialer
    /// has it: TCP within [`CONNECT_TIMEOUT`], the handshake within
    /// [`HANDSHAKE_TIMEOUT`].
    pub async fn connect(&self, addr: &str) -> io::Result<NodeStream> {
        let timed_out = |what: &str, after: Duration| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} {addr}: no answer within {after:?}"),
            )
        };
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| timed_out("connecting to", CONNECT_TIMEOUT))??;
        let _ = tcp.set_nodelay(true);
        tokio::time::timeout(HANDSHAKE_TIMEOUT, self.over(addr, tcp))
            .await
            .map_err(|_| timed_out("TLS handshake with", HANDSHAKE_TIMEOUT))?
    }

    /// `tcp`, to `addr`, through TLS when the dialer has it.
    async fn over(&self, addr: &str, tcp: TcpStream) -> io::Result<NodeStream> {
        let Some(tls) = &self.tls else {
            return Ok(NodeStream::Plain(tcp));
        };
        // Any name does: the verifier checks the chain only.
        let host = match addr.rsplit_once(':') {
            Some((host, _)) => host.trim_start_matches('[').trim_end_matches(']'),
            None => addr,
        };
        let name = ServerName::try_from(host.to_owned())
            .or_else(|_| ServerName::try_from("sandfork-node"))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await?;
        Ok(NodeStream::Tls(Box::new(stream)))
    }
}

/// A connection to a node's port.
#[derive(Debug)]
pub enum NodeStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for NodeStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            NodeStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            NodeStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for NodeStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            NodeStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            NodeStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            NodeStream::Plain(s) => Pin::new(s).poll_flush(cx),
            NodeStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            NodeStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            NodeStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A [`NodeStream`] as hyper's pooled client takes it.
#[derive(Debug)]
pub struct NodeIo(TokioIo<NodeStream>);

impl NodeIo {
    pub fn new(stream: NodeStream) -> NodeIo {
        NodeIo(TokioIo::new(stream))
    }
}

impl hyper::rt::Read for NodeIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for NodeIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl Connection for NodeIo {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

type Connecting = Pin<Box<dyn Future<Output = io::Result<NodeIo>> + Send>>;

/// The dialer as the connector of hyper's pooled client: the URI's
/// authority is the node's `host:port`, whatever its scheme.
impl tower_service::Service<hyper::Uri> for Dialer {
    type Response = NodeIo;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        let dialer = self.clone();
        Box::pin(async move {
            let authority = uri.authority().ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("{uri}: no host"))
            })?;
            let addr = match authority.port_u16() {
                Some(_) => authority.as_str().to_owned(),
                None => format!("{}:80", authority.host()),
            };
            dialer.connect(&addr).await.map(NodeIo::new)
        })
    }
}

/// One part a certificate is made for: `NAME[/SAN...]` (`etcd/10.0.0.1`),
/// its files `NAME.pem` and `NAME-key.pem`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertName {
    pub name: String,
    /// Subject alternative names: IP addresses or DNS names (the name itself
    /// is one too when it is a DNS name).
    pub sans: Vec<String>,
}

/// `gw1,n1,etcd/10.0.0.1/127.0.0.1`: names of letters, digits, `-`, `_`
/// and `.`, each once, not `ca`.
pub fn parse_names(list: &str) -> Result<Vec<CertName>, TlsError> {
    let mut names: Vec<CertName> = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let mut parts = entry.split('/');
        let name = parts.next().unwrap_or_default().to_owned();
        let good = !name.is_empty()
            && name.len() <= 64
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !good || name == "ca" {
            return Err(TlsError::Names(format!(
                "{name:?}: a part's name is letters, digits, '-', '_' and '.' (and not \"ca\")"
            )));
        }
        if names.iter().any(|n| n.name == name) {
            return Err(TlsError::Names(format!("{name:?} is named twice")));
        }
        let mut sans = Vec::new();
        if name.parse::<std::net::IpAddr>().is_ok() || ServerName::try_from(name.as_str()).is_ok() {
            sans.push(name.clone());
        }
        for san in parts {
            if san.parse::<std::net::IpAddr>().is_err() && ServerName::try_from(san).is_err() {
                return Err(TlsError::Names(format!(
                    "{entry:?}: {san:?} is neither an IP address nor a DNS name"
                )));
            }
            if !sans.iter().any(|s| s == san) {
                sans.push(san.to_owned());
            }
        }
        names.push(CertName { name, sans });
    }
    if names.is_empty() {
        return Err(TlsError::Names("no names given".into()));
    }
    Ok(names)
}

/// Makes a private CA (`ca.pem`; its key is dropped after signing) and an
/// ECDSA P-256 key and certificate per name, valid `days` days, for both
/// server and client use, into `out` (made if missing): every file 0600,
/// all of them or none, never over an existing file. The paths written.
pub fn make_certs(out: &Path, names: &[CertName], days: u32) -> Result<Vec<PathBuf>, TlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    if days == 0 {
        return Err(TlsError::Names("--days must be at least 1".into()));
    }
    let mut files = vec![(out.join("ca.pem"), String::new())];
    for n in names {
        files.push((out.join(format!("{}.pem", n.name)), String::new()));
        files.push((out.join(format!("{}-key.pem", n.name)), String::new()));
    }
    if let Some((path, _)) = files.iter().find(|(p, _)| p.exists()) {
        return Err(TlsError::Write {
            path: path.clone(),
            source: io::Error::new(io::ErrorKind::AlreadyExists, "exists: nothing written"),
        });
    }
    let now = time::OffsetDateTime::now_utc();
    let not_before = now - time::Duration::hours(1);
    let not_after = now + time::Duration::days(i64::from(days));

    let ca_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "sandfork cluster CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca.self_signed(&ca_key)?;
    files[0].1 = ca_cert.pem();
    for (i, n) in names.iter().enumerate() {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::new(n.sans.clone())?;
        params.distinguished_name.push(DnType::CommonName, &n.name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // every part is a server (its port) and a client (of the others)
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = not_before;
        params.not_after = not_after;
        let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
        files[1 + 2 * i].1 = cert.pem();
        files[2 + 2 * i].1 = key.serialize_pem();
    }
    drop(ca_key);
    std::fs::create_dir_all(out).map_err(|source| TlsError::Write {
        path: out.to_owned(),
        source,
    })?;
    let mut written = Vec::new();
    for (path, text) in &files {
        if let Err(source) = write_new_private(path, text.as_bytes()) {
            for done in &written {
                let _ = std::fs::remove_file(done);
            }
            return Err(TlsError::Write {
                path: path.clone(),
                source,
            });
        }
        written.push(path.clone());
    }
    Ok(written)
}

/// A new file of mode 0600 (an existing one is an error).
fn write_new_private(path: &Path, data: &[u8]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    let written = file.write_all(data).and_then(|()| file.sync_all());
    if written.is_err() {
        let _ = std::fs::remove_file(path);
    }
    written
}
