//! TLS to registries, token realms and the hosts blobs are redirected to:
//! rustls on the ring provider, trusting the system's roots (as OpenSSL
//! finds them: `SSL_CERT_FILE` and `SSL_CERT_DIR` are honoured) plus the
//! CA certificates of [`super::PullOptions::ca_file`] for private
//! registries. Certificates are not checked for registries listed insecure,
//! as Docker does for them.

use std::io;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::RegistryError;

/// The variable naming a PEM file of extra CA certificates.
pub const CA_VAR: &str = "SANDFORK_REGISTRY_CA";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The system's CA certificates, read once per process.
fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    // Unreadable files among the system's certificates are skipped, as
    // OpenSSL skips them; none at all shows as untrusted certificates.
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

/// Client configurations: one verifying certificates, one (for insecure
/// registries) not; each made when first needed.
pub(super) struct Tls {
    ca_file: Option<std::path::PathBuf>,
    verified: Option<Arc<ClientConfig>>,
    unverified: Option<Arc<ClientConfig>>,
}

impl Tls {
    pub(super) fn new(ca_file: Option<&Path>) -> Tls {
        Tls {
            ca_file: ca_file.map(Path::to_owned),
            verified: None,
            unverified: None,
        }
    }

    fn config(&mut self, verify: bool) -> Result<Arc<ClientConfig>, RegistryError> {
        let slot = if verify {
            &mut self.verified
        } else {
            &mut self.unverified
        };
        if let Some(c) = slot {
            return Ok(c.clone());
        }
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| RegistryError::Tls {
                what: "setting up TLS".into(),
                reason: e.to_string(),
            })?;
        let mut config = if verify {
            let mut roots = RootCertStore::empty();
            roots.add_parsable_certificates(system_roots().iter().cloned());
            if let Some(file) = &self.ca_file {
                for cert in extra_cas(file)? {
                    roots.add(cert).map_err(|e| RegistryError::Tls {
                        what: format!("{CA_VAR} ({})", file.display()),
                        reason: format!("a certificate is not usable as a CA: {e}"),
                    })?;
                }
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        } else {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerify(provider())))
                .with_no_client_auth()
        };
        // HTTP/1.1 is all the client speaks.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        *slot = Some(config.clone());
        Ok(config)
    }

    /// The TLS handshake with `host` (the name certificates are checked
    /// against) over `stream`; `authority` names it in errors, `verify`
    /// says whether its certificate is checked.
    pub(super) async fn connect(
        &mut self,
        stream: TcpStream,
        host: &str,
        authority: &str,
        verify: bool,
        what: &str,
    ) -> Result<TlsStream<TcpStream>, RegistryError> {
        let config = self.config(verify)?;
        let name = ServerName::try_from(host.to_owned()).map_err(|_| RegistryError::Tls {
            what: what.to_owned(),
            reason: format!("{host:?} is not a name TLS can check a certificate against"),
        })?;
        TlsConnector::from(config)
            .connect(name, stream)
            .await
            .map_err(|e| RegistryError::Tls {
                what: what.to_owned(),
                reason: explain(&e, authority),
            })
    }
}

/// The certificates of the extra CA file.
fn extra_cas(file: &Path) -> Result<Vec<CertificateDer<'static>>, RegistryError> {
    let what = || format!("{CA_VAR} ({})", file.display());
    let bytes = std::fs::read(file).map_err(|e| RegistryError::Tls {
        what: what(),
        reason: format!("reading it: {e}"),
    })?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RegistryError::Tls {
            what: what(),
            reason: format!("not a PEM file of certificates: {e}"),
        })?;
    if certs.is_empty() {
        return Err(RegistryError::Tls {
            what: what(),
            reason: "no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into(),
        });
    }
    Ok(certs)
}

/// A failed handshake with `authority`, in words that say what to do.
fn explain(e: &io::Error, authority: &str) -> String {
    let host = super::bare_host(authority);
    let Some(tls) = e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) else {
        return match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => format!(
                "{authority} closed the connection during the TLS handshake (does it speak \
                 TLS on that port?)"
            ),
            _ => format!("TLS with {authority}: {e}"),
        };
    };
    match tls {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!("the certificate of {authority} is not valid for that name ({tls})")
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                format!("the certificate of {authority} has expired ({tls})")
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                format!("the certificate of {authority} is not valid yet ({tls})")
            }
            _ => format!(
                "the certificate of {authority} is not trusted ({tls}): if the registry's \
                 certificate is signed by a private CA, give that CA's certificate (PEM) in \
                 {CA_VAR}; to pull without checking it, list {host} in \
                 SANDFORK_INSECURE_REGISTRIES"
            ),
        },
        rustls::Error::InvalidMessage(_) => format!(
            "{authority} does not speak TLS (its answer is not TLS): a registry served over \
             plain HTTP must be listed in SANDFORK_INSECURE_REGISTRIES"
        ),
        _ => format!("the TLS handshake with {authority} failed: {tls}"),
    }
}

/// Accepts any certificate (insecure registries; the node's proxy to a
/// guest's `httpsPorts`), still checking that the handshake is signed by the
/// key of the certificate presented.
#[derive(Debug)]
pub struct NoVerify(Arc<CryptoProvider>);

impl NoVerify {
    /// Checks handshake signatures with `provider`'s algorithms.
    pub fn new(provider: Arc<CryptoProvider>) -> NoVerify {
        NoVerify(provider)
    }
}

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
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
            &self.0.signature_verification_algorithms,
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
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
