//! Chunks fetched from another node of the cluster rather than the object
//! store: a node that forks a sandbox across nodes serves the frozen fork's
//! files (`GET {prefix}/{digest}` on its API, with the caller's API key and
//! the fork's own token), and the nodes making its children fetch them there
//! at once, before (or without) any upload.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;

use crate::files::{ChunkSource, FileError};

/// One chunk may take this long (4 MiB on a slow link).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a connection to the node is kept between chunks.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The header carrying the fork's token (besides the API key).
pub const TOKEN_HEADER: &str = "x-sandfork-fork-token";

/// Another node's files, as chunks by digest (cheap to clone: the clones
/// share one pool of connections to the node, so a file of many chunks
/// costs a connection, and under TLS a handshake, per concurrent fetch
/// rather than per chunk).
#[derive(Clone)]
pub struct PeerChunks {
    /// `host:port` of the node's API.
    addr: String,
    /// The path the digest is appended to (`/internal/forks/{id}/chunks`).
    prefix: String,
    api_key: String,
    token: String,
    client: Client<sandfork_tls::Dialer, Empty<Bytes>>,
}

impl std::fmt::Debug for PeerChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerChunks({}{})", self.addr, self.prefix)
    }
}

impl PeerChunks {
    /// The chunks node `addr` (`host:port`) serves under `prefix`, asked
    /// for with `api_key` and the fork's `token`, over connections `dialer`
    /// makes (TLS in a cluster with it).
    pub fn new(
        addr: String,
        prefix: String,
        api_key: String,
        token: String,
        dialer: sandfork_tls::Dialer,
    ) -> PeerChunks {
        PeerChunks {
            addr,
            prefix,
            api_key,
            token,
            client: dialer.pooled(IDLE_TIMEOUT),
        }
    }

    fn error(&self, reason: String) -> FileError {
        FileError::Peer {
            node: self.addr.clone(),
            reason,
        }
    }

    async fn get(&self, digest: &str) -> Result<Option<Bytes>, FileError> {
        // A digest is hex: nothing else goes into the request's path.
        if digest.is_empty() || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(self.error(format!("not a chunk digest: {digest:?}")));
        }
        // The dialer takes the authority whatever the scheme (TLS is its).
        let req = Request::builder()
            .method(Method::GET)
            .uri(format!("http://{}{}/{digest}", self.addr, self.prefix))
            .header("x-api-key", &self.api_key)
            .header(TOKEN_HEADER, &self.token)
            .body(Empty::<Bytes>::new())
            .map_err(|e| self.error(e.to_string()))?;
        let answer = self
            .client
            .request(req)
            .await
            .map_err(|e| self.error(format!("request: {e}")))?;
        let status = answer.status();
        let bytes = answer
            .into_body()
            .collect()
            .await
            .map_err(|e| self.error(format!("reading the answer: {e}")))?
            .to_bytes();
        match status {
            s if s.is_success() => Ok(Some(bytes)),
            StatusCode::NOT_FOUND => Ok(None),
            s => Err(self.error(format!(
                "HTTP {s}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            ))),
        }
    }
}

impl ChunkSource for PeerChunks {
    async fn chunk(&self, digest: &str) -> Result<Option<Bytes>, FileError> {
        tokio::time::timeout(REQUEST_TIMEOUT, self.get(digest))
            .await
            .unwrap_or_else(|_| Err(self.error(format!("no answer within {REQUEST_TIMEOUT:?}"))))
    }
}
