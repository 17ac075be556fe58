//! Chunks fetched from another node of the cluster rather than the object
//! store: a node that forks a sandbox across nodes serves the frozen fork's
//! files (`GET {prefix}/{digest}` on its API, with the caller's API key and
//! the fork's own token), and the nodes making its children fetch them there
//! at once, before (or without) any upload.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

use crate::files::{ChunkSource, FileError};

/// One chunk may take this long (4 MiB on a slow link).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The header carrying the fork's token (besides the API key).
pub const TOKEN_HEADER: &str = "x-sandfork-fork-token";

/// Another node's files, as chunks by digest (cheap to clone).
#[derive(Clone)]
pub struct PeerChunks {
    /// `host:port` of the node's API.
    pub addr: String,
    /// The path the digest is appended to (`/internal/forks/{id}/chunks`).
    pub prefix: String,
    pub api_key: String,
    pub token: String,
    /// How the node's port is reached (TLS in a cluster with it).
    pub dialer: sandfork_tls::Dialer,
}

impl std::fmt::Debug for PeerChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerChunks({}{})", self.addr, self.prefix)
    }
}

impl PeerChunks {
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
        let stream = self
            .dialer
            .connect(&self.addr)
            .await
            .map_err(|e| self.error(format!("connecting: {e}")))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| self.error(format!("handshake: {e}")))?;
        tokio::spawn(conn);
        let req = Request::builder()
            .method(Method::GET)
            .uri(format!("{}/{digest}", self.prefix))
            .header(hyper::header::HOST, &self.addr)
            .header("x-api-key", &self.api_key)
            .header(TOKEN_HEADER, &self.token)
            .body(Empty::<Bytes>::new())
            .map_err(|e| self.error(e.to_string()))?;
        let answer = sender
            .send_request(req)
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
