//! TLS to a guest port listed in a sandbox's `httpsPorts` (E2B's): the
//! proxy ends the client's request and sends it on over TLS, accepting
//! whatever certificate the guest's server presents, as E2B's proxy does: a
//! server in a sandbox has a self-signed certificate, or one for a name the
//! node does not route by. The handshake's signatures are still checked
//! against the certificate's key, only not the certificate itself.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::net::UnixStream;
use tokio_rustls::client::TlsStream;

/// The name sent as SNI: the guest's server is reached on its own port,
/// under no name of the node's, and a self-signed certificate most often
/// names `localhost`.
const SERVER_NAME: &str = "localhost";

/// A verifier that takes every certificate.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
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
        verify_tls12_signature(
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
        verify_tls13_signature(
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

/// The client side of the proxy's TLS to guests (rustls on ring, as the
/// webhooks' client).
pub(super) fn client_config() -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Unchecked(provider)))
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// TLS over a stream to a guest port.
pub(super) async fn connect(
    config: Arc<rustls::ClientConfig>,
    stream: UnixStream,
) -> std::io::Result<TlsStream<UnixStream>> {
    let name = ServerName::try_from(SERVER_NAME)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    tokio_rustls::TlsConnector::from(config)
        .connect(name, stream)
        .await
}
