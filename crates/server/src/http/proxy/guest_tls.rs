//! TLS to a guest port listed in a sandbox's `httpsPorts` (E2B's): the
//! proxy ends the client's request and sends it on over TLS, accepting
//! whatever certificate the guest's server presents, as E2B's proxy does: a
//! server in a sandbox has a self-signed certificate, or one for a name the
//! node does not route by. The handshake's signatures are still checked
//! against the certificate's key, only not the certificate itself.

use std::sync::Arc;

use rustls::pki_types::ServerName;
use template_build::registry::NoVerify;
use tokio::net::UnixStream;
use tokio_rustls::client::TlsStream;

/// The name sent as SNI: the guest's server is reached on its own port,
/// under no name of the node's, and a self-signed certificate most often
/// names `localhost`.
const SERVER_NAME: &str = "localhost";

/// The client side of the proxy's TLS to guests (rustls on ring, as the
/// webhooks' client).
pub(super) fn client_config() -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NoVerify::new(provider)))
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
