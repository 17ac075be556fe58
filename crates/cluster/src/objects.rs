//! The cluster's object store: an S3-compatible bucket (SeaweedFS, MinIO,
//! AWS S3, ...) reached over plain HTTP with path-style URLs. Requests are
//! signed with SigV4 query parameters by `rusty-s3` (sans-IO: it signs, the
//! hyper already in the tree sends) when credentials are given; without them
//! they go unsigned (a store that allows anonymous access).
//!
//! Configured as `http://HOST:PORT/BUCKET`, credentials from
//! `SANDFORK_S3_ACCESS_KEY` / `SANDFORK_S3_SECRET_KEY`, the region from
//! `SANDFORK_S3_REGION` (default `us-east-1`).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};

/// How long a signed URL is valid (it is used at once).
const SIGNED_FOR: Duration = Duration::from_secs(600);
/// One request may take this long (a 4 MiB chunk on a slow link).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object store URL {url:?}: {reason}")]
    Config { url: String, reason: String },
    #[error("object store {url}: {reason}")]
    Http { url: String, reason: String },
    #[error("object store listing {prefix:?}: {reason}")]
    Listing { prefix: String, reason: String },
    #[error("object store {method} {url}: HTTP {status}: {body}")]
    Status {
        method: Method,
        url: String,
        status: StatusCode,
        body: String,
    },
}

/// An object as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub size: u64,
    /// When it was last written, by the store's clock.
    pub last_modified: SystemTime,
}

/// A bucket of the cluster's object store (cheap to clone).
#[derive(Clone)]
pub struct ObjectStore {
    bucket: Bucket,
    credentials: Option<Credentials>,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectStore({})", self.bucket.base_url())
    }
}

impl ObjectStore {
    /// `url` is `http://host:port/bucket`; credentials and region from the
    /// environment (see the module's documentation).
    pub fn from_url(url: &str) -> Result<ObjectStore, ObjectError> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let credentials = match (env("SANDFORK_S3_ACCESS_KEY"), env("SANDFORK_S3_SECRET_KEY")) {
            (Some(key), Some(secret)) => Some(Credentials::new(key, secret)),
            _ => None,
        };
        let region = env("SANDFORK_S3_REGION").unwrap_or_else(|| "us-east-1".into());
        ObjectStore::new(url, credentials, region)
    }

    pub fn new(
        url: &str,
        credentials: Option<Credentials>,
        region: String,
    ) -> Result<ObjectStore, ObjectError> {
        let bad = |reason: &str| ObjectError::Config {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let parsed = url::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
        if parsed.scheme() != "http" {
            return Err(bad(
                "only http:// is supported (a store on the cluster's network)",
            ));
        }
        let name = parsed.path().trim_matches('/').to_owned();
        if name.is_empty() || name.contains('/') {
            return Err(bad(
                "give the bucket as the URL's path: http://host:port/bucket",
            ));
        }
        let mut endpoint = parsed.clone();
        endpoint.set_path("/");
        let bucket =
            Bucket::new(endpoint, UrlStyle::Path, name, region).map_err(|e| bad(&e.to_string()))?;
        Ok(ObjectStore {
            bucket,
            credentials,
        })
    }

    /// Creates the bucket unless it exists.
    pub async fn ensure_bucket(&self) -> Result<(), ObjectError> {
        let url = match &self.credentials {
            Some(c) => self.bucket.create_bucket(c).sign(SIGNED_FOR),
            None => self.bucket.base_url().clone(),
        };
        match send(Method::PUT, &url, Bytes::new()).await {
            Ok(_) => Ok(()),
            // Ours already, or someone else's name: the next request tells.
            Err(ObjectError::Status { status, .. }) if status == StatusCode::CONFLICT => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub async fn put(&self, key: &str, body: Bytes) -> Result<(), ObjectError> {
        let url = self
            .bucket
            .put_object(self.credentials.as_ref(), key)
            .sign(SIGNED_FOR);
        send(Method::PUT, &url, body).await.map(drop)
    }

    /// Every object whose key starts with `prefix`, in key order, page after
    /// page (S3 answers at most 1000 keys a request: the listing follows its
    /// continuation token to the end). An entry the store lists without a
    /// size or time fails the listing: a collector must not guess.
    pub async fn list(&self, prefix: &str) -> Result<Vec<Listed>, ObjectError> {
        let bad = |reason: String| ObjectError::Listing {
            prefix: prefix.to_owned(),
            reason,
        };
        let mut listed = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut action = self.bucket.list_objects_v2(self.credentials.as_ref());
            action.with_prefix(prefix);
            if let Some(t) = &token {
                action.with_continuation_token(t.as_str());
            }
            let url = action.sign(SIGNED_FOR);
            let body = send(Method::GET, &url, Bytes::new()).await?;
            let text = std::str::from_utf8(&body).map_err(|e| bad(format!("not UTF-8: {e}")))?;
            let page = rusty_s3::actions::ListObjectsV2::parse_response(text)
                .map_err(|e| bad(format!("parsing the answer: {e}")))?;
            for c in page.contents {
                let (Some(size), Some(at)) = (c.size, c.last_modified.as_deref()) else {
                    return Err(bad(format!("{} is listed without its size or time", c.key)));
                };
                let last_modified =
                    parse_iso8601(at).ok_or_else(|| bad(format!("{}: time {at:?}", c.key)))?;
                listed.push(Listed {
                    key: c.key,
                    size,
                    last_modified,
                });
            }
            match page.next_continuation_token {
                Some(next) if token.as_ref() != Some(&next) => token = Some(next),
                Some(_) => return Err(bad("the store repeated its continuation token".into())),
                None => return Ok(listed),
            }
        }
    }

    /// The object's bytes; None if there is no such object.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, ObjectError> {
        let url = self
            .bucket
            .get_object(self.credentials.as_ref(), key)
            .sign(SIGNED_FOR);
        match send(Method::GET, &url, Bytes::new()).await {
            Ok(body) => Ok(Some(body)),
            Err(ObjectError::Status { status, .. }) if status == StatusCode::NOT_FOUND => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes the object; one that is not there is no error (S3 answers
    /// a delete of a missing key as done).
    pub async fn delete(&self, key: &str) -> Result<(), ObjectError> {
        let url = self
            .bucket
            .delete_object(self.credentials.as_ref(), key)
            .sign(SIGNED_FOR);
        match send(Method::DELETE, &url, Bytes::new()).await {
            Ok(_) => Ok(()),
            Err(ObjectError::Status { status, .. }) if status == StatusCode::NOT_FOUND => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub async fn exists(&self, key: &str) -> Result<bool, ObjectError> {
        let url = self
            .bucket
            .head_object(self.credentials.as_ref(), key)
            .sign(SIGNED_FOR);
        match send(Method::HEAD, &url, Bytes::new()).await {
            Ok(_) => Ok(true),
            Err(ObjectError::Status { status, .. }) if status == StatusCode::NOT_FOUND => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// An S3 listing's time (`2026-12-05T11:17:44.000Z`, ISO 8601 in UTC).
fn parse_iso8601(at: &str) -> Option<SystemTime> {
    let t: jiff::Timestamp = at.parse().ok()?;
    Some(SystemTime::from(t))
}

/// One request on its own connection; the body of a 2xx answer, else an
/// error with the status and the start of the body.
async fn send(method: Method, url: &url::Url, body: Bytes) -> Result<Bytes, ObjectError> {
    let shown = || {
        // The signature is in the query: not for logs.
        let mut u = url.clone();
        u.set_query(None);
        u.to_string()
    };
    let http = |reason: String| ObjectError::Http {
        url: shown(),
        reason,
    };
    let exchange = async {
        let host = url.host_str().ok_or_else(|| http("no host".into()))?;
        let port = url.port_or_known_default().unwrap_or(80);
        let stream = tokio::net::TcpStream::connect((host, port))
            .await
            .map_err(|e| http(format!("connecting: {e}")))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| http(format!("handshake: {e}")))?;
        tokio::spawn(conn);
        let target = match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        };
        let authority = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_owned(),
        };
        let req = Request::builder()
            .method(method.clone())
            .uri(target)
            .header(hyper::header::HOST, authority)
            .header(hyper::header::CONTENT_LENGTH, body.len())
            .body(Full::new(body))
            .map_err(|e| http(e.to_string()))?;
        let answer = sender
            .send_request(req)
            .await
            .map_err(|e| http(format!("request: {e}")))?;
        let status = answer.status();
        let bytes = answer
            .into_body()
            .collect()
            .await
            .map_err(|e| http(format!("reading the answer: {e}")))?
            .to_bytes();
        if status.is_success() {
            Ok(bytes)
        } else {
            Err(ObjectError::Status {
                method: method.clone(),
                url: shown(),
                status,
                body: String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned(),
            })
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(http(format!("no answer within {REQUEST_TIMEOUT:?}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_bucket_on_an_http_endpoint() {
        let s = ObjectStore::new("http://127.0.0.1:8333/snaps", None, "us-east-1".into()).unwrap();
        assert_eq!(s.bucket.name(), "snaps");
        for bad in [
            "https://h/b",
            "http://h/",
            "http://h/a/b",
            "ftp://h/b",
            "not a url",
        ] {
            assert!(ObjectStore::new(bad, None, "r".into()).is_err(), "{bad}");
        }
    }
}
