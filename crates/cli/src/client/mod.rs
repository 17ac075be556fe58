//! The CLI's client of a sandfork node: its control plane (E2B's routes and
//! sandfork's own, `X-API-KEY`) and, through the node's envd proxy, the agent
//! inside each sandbox.

pub mod config;
pub mod envd;
pub mod http;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use server::wire;

use http::{Body, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot reach the node at {url}: {reason}; is `sandfork serve` running?")]
    Unreachable { url: String, reason: String },
    #[error("connection to the node at {0} failed: {1}")]
    Connection(String, String),
    #[error("the node at {0} refused the API key; check `sandfork auth status`")]
    Unauthorized(String),
    #[error("no sandbox {0}; `sandfork ls` lists them")]
    NoSandbox(String),
    #[error("{message}")]
    Api { status: u16, message: String },
    #[error("the node's answer to {what} is not what was expected: {reason}")]
    Malformed { what: String, reason: String },
    #[error(
        "no API key: run `sandfork auth login --url URL --key KEY` (the key is in the node's \
         <data-dir>/api-key) or set SANDFORK_API_KEY"
    )]
    NoKey,
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("the node URL {0}")]
    Url(#[from] http::UrlError),
}

impl NodeError {
    pub fn status(&self) -> Option<u16> {
        match self {
            NodeError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A node and the key to its control plane.
#[derive(Debug, Clone)]
pub struct Node {
    pub endpoint: Endpoint,
    key: String,
}

/// One answer, read whole.
pub struct Answer {
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

/// What the CLI uses of a sandbox (`GET /sandboxes/{id}`).
#[derive(Debug, Clone, Deserialize)]
pub struct SandboxInfo {
    #[serde(rename = "sandboxID")]
    pub id: String,
    #[serde(default)]
    pub state: String,
    #[serde(rename = "envdAccessToken", default)]
    pub access_token: Option<String>,
}

impl Node {
    /// The node and key from the environment and the config file.
    pub fn from_config() -> Result<Node, NodeError> {
        let resolved = config::resolve()?;
        let (key, _) = resolved.key.ok_or(NodeError::NoKey)?;
        Node::new(&resolved.url, key)
    }

    pub fn new(url: &str, key: String) -> Result<Node, NodeError> {
        Ok(Node {
            endpoint: Endpoint::parse(url)?,
            key,
        })
    }

    pub fn url(&self) -> &str {
        &self.endpoint.url
    }

    /// One control-plane exchange; non-2xx answers become errors (401 and
    /// the node's `{"code", "message"}` bodies made readable).
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Answer, NodeError> {
        let mut req = self
            .endpoint
            .request(method, path)
            .header(wire::API_KEY_HEADER, &self.key)
            .header("accept", "application/json");
        let body: Body = match body {
            Some(v) => {
                req = req.header("content-type", "application/json");
                http::full(v.to_string())
            }
            None => http::empty(),
        };
        let req = req.body(body).map_err(|e| NodeError::Malformed {
            what: path.to_owned(),
            reason: e.to_string(),
        })?;
        let response = self.endpoint.send(req).await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = http::read_body(self.url(), response).await?;
        if status == 401 {
            return Err(NodeError::Unauthorized(self.url().to_owned()));
        }
        if !(200..300).contains(&status) {
            return Err(NodeError::Api {
                status,
                message: error_message(status, &body),
            });
        }
        Ok(Answer { headers, body })
    }

    /// `call` and parse the JSON answer.
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<T, NodeError> {
        let answer = self.call(method, path, body).await?;
        parse(path, &answer.body)
    }

    /// `call` on a sandbox's route: its 404 says which sandbox is unknown.
    pub async fn sandbox_call(
        &self,
        id: &str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Answer, NodeError> {
        self.call(method, path, body)
            .await
            .map_err(|e| match e.status() {
                Some(404) => NodeError::NoSandbox(id.to_owned()),
                _ => e,
            })
    }

    /// The sandbox's details (state, envd access token).
    pub async fn sandbox(&self, id: &str) -> Result<SandboxInfo, NodeError> {
        check_id(id)?;
        let path = format!("/sandboxes/{id}");
        let answer = self.sandbox_call(id, "GET", &path, None).await?;
        parse(&path, &answer.body)
    }

    /// Every sandbox matching `query` (`GET /v2/sandboxes`, all pages).
    pub async fn list_sandboxes(&self, query: &str) -> Result<Vec<Value>, NodeError> {
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut q = form_urlencoded::Serializer::new(query.to_owned());
            q.append_pair("limit", "100");
            if let Some(t) = &token {
                q.append_pair("nextToken", t);
            }
            let path = format!("/v2/sandboxes?{}", q.finish());
            let answer = self.call("GET", &path, None).await?;
            let page: Vec<Value> = parse(&path, &answer.body)?;
            all.extend(page);
            // A gateway's list lacks the sandboxes of nodes that did not answer.
            if let Some(nodes) = answer
                .headers
                .get(wire::UNREACHABLE_NODES_HEADER)
                .and_then(|v| v.to_str().ok())
            {
                eprintln!(
                    "sandfork: warning: node(s) {nodes} did not answer: their sandboxes are not listed"
                );
            }
            token = answer
                .headers
                .get(wire::NEXT_TOKEN_HEADER)
                .and_then(|v| v.to_str().ok())
                .filter(|t| !t.is_empty())
                .map(str::to_owned);
            if token.is_none() {
                return Ok(all);
            }
        }
    }
}

/// Sandbox ids are lowercase letters and digits: anything else cannot name
/// one (and must not reach a URL path unescaped).
pub fn check_id(id: &str) -> Result<(), NodeError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(NodeError::NoSandbox(id.to_owned()))
    }
}

pub fn parse<T: DeserializeOwned>(what: &str, body: &[u8]) -> Result<T, NodeError> {
    serde_json::from_slice(body).map_err(|e| NodeError::Malformed {
        what: what.to_owned(),
        reason: e.to_string(),
    })
}

/// The `message` of an error body, else the body itself on one line.
pub fn error_message(status: u16, body: &[u8]) -> String {
    let from_json = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_owned));
    let text = from_json.unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.is_empty() {
        format!("the node answered {status}")
    } else {
        format!("{text} ({status})")
    }
}

/// Percent-encodes a path segment or query part.
pub fn escape(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_become_one_line() {
        assert_eq!(
            error_message(409, br#"{"code":409,"message":"sandbox x is paused"}"#),
            "sandbox x is paused (409)"
        );
        assert_eq!(error_message(502, b"bad\ngateway"), "bad gateway (502)");
        assert_eq!(error_message(500, b""), "the node answered 500");
    }

    #[test]
    fn ids_are_checked_before_they_reach_a_path() {
        assert!(check_id("abc123").is_ok());
        for bad in ["", "../x", "ABC", "a b", "a/b"] {
            assert!(
                matches!(check_id(bad), Err(NodeError::NoSandbox(_))),
                "{bad}"
            );
        }
    }
}
