//! HTTP/1.1 to the node: an endpoint parsed from its URL, connections over
//! plain TCP (or, to an `https://` node of a cluster with TLS, through the
//! cluster's dialer with the certificate `SANDFORK_TLS_CERT`, `_KEY` and
//! `_CA` name), and the body type every request uses (whole or streamed).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

use super::NodeError;

/// A request body: whole bytes or a stream (uploads).
pub type Body = BoxBody<Bytes, std::io::Error>;

/// How long connecting may take before the node counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

pub fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed()
}

/// Where the node listens: `http://host[:port][/prefix]`, or `https://`
/// for a cluster node's port under TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The URL as given, without a trailing `/` (for messages).
    pub url: String,
    /// `https://`: through the cluster's TLS.
    tls: bool,
    host: String,
    port: u16,
    /// A path prefix every route is under ("" for none).
    prefix: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UrlError {
    #[error(
        "{0:?} is not an http:// URL (or https:// for a cluster's node under TLS; a single node serves plain HTTP: put TLS in front of it and use its http URL here)"
    )]
    Scheme(String),
    #[error("{0:?} has no host")]
    NoHost(String),
    #[error("{0:?} has a bad port")]
    Port(String),
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, UrlError> {
        let trimmed = url.trim().trim_end_matches('/');
        let (rest, tls) = match (
            trimmed.strip_prefix("http://"),
            trimmed.strip_prefix("https://"),
        ) {
            (Some(rest), _) => (rest, false),
            (_, Some(rest)) => (rest, true),
            _ => return Err(UrlError::Scheme(url.to_owned())),
        };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        // [v6]:port, host:port or host
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| UrlError::NoHost(url.to_owned()))?;
            let port = match after.strip_prefix(':') {
                Some(p) => Some(p),
                None if after.is_empty() => None,
                None => return Err(UrlError::Port(url.to_owned())),
            };
            (h, port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(UrlError::NoHost(url.to_owned()));
        }
        let port = match port {
            Some(p) => p.parse().map_err(|_| UrlError::Port(url.to_owned()))?,
            None if tls => 443,
            None => 80,
        };
        Ok(Endpoint {
            url: trimmed.to_owned(),
            tls,
            host: host.to_owned(),
            port,
            prefix: prefix.to_owned(),
        })
    }

    /// The host name or address, without brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The `Host` header.
    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// A request to `path` (which starts with `/` and may carry a query).
    pub fn request(&self, method: &str, path: &str) -> hyper::http::request::Builder {
        Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header("host", self.authority())
    }

    /// A fresh connection; requests on it go one after another.
    pub async fn connect(&self) -> Result<Conn, NodeError> {
        let unreachable = |reason: String| NodeError::Unreachable {
            url: self.url.clone(),
            reason,
        };
        let dialer = if self.tls {
            cluster_dialer().map_err(unreachable)?
        } else {
            sandfork_tls::Dialer::plain()
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, dialer.connect(&self.authority()))
            .await
            .map_err(|_| unreachable(format!("no answer within {}s", CONNECT_TIMEOUT.as_secs())))?
            .map_err(|e| unreachable(io_reason(&e)))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        tokio::spawn(async move {
            // Errors surface on the request that was in flight.
            let _ = conn.await;
        });
        Ok(Conn {
            sender,
            url: self.url.clone(),
        })
    }

    /// One exchange on a fresh connection.
    pub async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, NodeError> {
        self.connect().await?.send(req).await
    }
}

/// The dialer of an `https://` node: the cluster's TLS with the part's
/// certificate from the environment, read once.
fn cluster_dialer() -> Result<sandfork_tls::Dialer, String> {
    static DIALER: std::sync::OnceLock<Result<sandfork_tls::Dialer, String>> =
        std::sync::OnceLock::new();
    DIALER
        .get_or_init(|| {
            let files = sandfork_tls::TlsFiles::from_env()
                .map_err(|e| e.to_string())?
                .ok_or_else(|| {
                    format!(
                        "an https:// node is a cluster's under TLS: name a certificate of its CA \
                         in {}, {} and {}",
                        sandfork_tls::CERT_ENV,
                        sandfork_tls::KEY_ENV,
                        sandfork_tls::CA_ENV
                    )
                })?;
            files
                .load()
                .map(|tls| tls.dialer())
                .map_err(|e| e.to_string())
        })
        .clone()
}

/// An open connection to the node.
pub struct Conn {
    sender: SendRequest<Body>,
    url: String,
}

impl Conn {
    pub async fn send(&mut self, req: Request<Body>) -> Result<Response<Incoming>, NodeError> {
        self.sender
            .ready()
            .await
            .map_err(|e| NodeError::Connection(self.url.clone(), e.to_string()))?;
        self.sender
            .send_request(req)
            .await
            .map_err(|e| NodeError::Connection(self.url.clone(), e.to_string()))
    }
}

/// A short reason, without the OS error number.
pub fn io_reason(e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => "connection refused".into(),
        ConnectionReset => "connection reset".into(),
        TimedOut => "timed out".into(),
        HostUnreachable => "host unreachable".into(),
        NetworkUnreachable => "network unreachable".into(),
        _ => e.to_string(),
    }
}

/// The most an answer read whole may hold: control-plane JSON and envd's
/// unary answers are far smaller; file contents are streamed, not read whole.
pub const MAX_BODY: usize = 64 << 20;

/// The whole body of an answer (at most [`MAX_BODY`]: some are proxied from
/// a guest, which may send without end).
pub async fn read_body(url: &str, response: Response<Incoming>) -> Result<Bytes, NodeError> {
    read_limited(url, response.into_body(), MAX_BODY).await
}

async fn read_limited<B>(url: &str, body: B, max: usize) -> Result<Bytes, NodeError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match http_body_util::Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(NodeError::Malformed {
            what: url.to_owned(),
            reason: format!("the answer is larger than {} MiB", max >> 20),
        }),
        Err(e) => Err(NodeError::Connection(url.to_owned(), e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn answers_are_read_whole_only_up_to_the_limit() {
        let small = full(vec![7u8; 1024]);
        assert_eq!(read_limited("u", small, 4096).await.unwrap().len(), 1024);
        let big = full(vec![7u8; 8192]);
        let err = read_limited("u", big, 4096).await.unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }

    #[test]
    fn parses_node_urls() {
        let e = Endpoint::parse("http://127.0.0.1:3000/").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.prefix.as_str()),
            ("127.0.0.1", 3000, "")
        );
        assert_eq!(e.url, "http://127.0.0.1:3000");
        assert_eq!(e.authority(), "127.0.0.1:3000");
        let e = Endpoint::parse("http://node.example/api").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.prefix.as_str()),
            ("node.example", 80, "/api")
        );
        let e = Endpoint::parse("http://[::1]:8080").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 8080));
        assert_eq!(e.authority(), "[::1]:8080");
        // https: a cluster's node under TLS (port 443 by default)
        let e = Endpoint::parse("https://x").unwrap();
        assert!(e.tls);
        assert_eq!(e.authority(), "x:443");
        assert!(!Endpoint::parse("http://x").unwrap().tls);
        assert!(matches!(
            Endpoint::parse("ftp://x"),
            Err(UrlError::Scheme(_))
        ));
        assert!(matches!(
            Endpoint::parse("127.0.0.1:3000"),
            Err(UrlError::Scheme(_))
        ));
        assert!(matches!(
            Endpoint::parse("http://:3000"),
            Err(UrlError::NoHost(_))
        ));
        assert!(matches!(
            Endpoint::parse("http://h:x"),
            Err(UrlError::Port(_))
        ));
        assert!(matches!(
            Endpoint::parse("http://h:70000"),
            Err(UrlError::Port(_))
        ));
    }
}
