//! The agent inside a sandbox, reached through the node's envd proxy
//! (`E2b-Sandbox-Id`, `E2b-Sandbox-Port`, `X-Access-Token`): envd's
//! `process.Process` over Connect (JSON codec) and `GET`/`POST /files`.

use std::collections::VecDeque;

use base64::Engine;
use envd_proto::envelope::{self, DEFAULT_MAX_MESSAGE, Decoder};
use envd_proto::process::{ProcessEvent, StartRequest, StartResponse};
use envd_proto::{CONTENT_TYPE_STREAM, CONTENT_TYPE_UNARY, ConnectError, EndStream};
use http_body_util::BodyExt;
use hyper::Response;
use hyper::body::Incoming;
use serde::Serialize;
use serde::de::DeserializeOwned;
use server::wire;

use super::http::{Body, Conn, full, read_body};
use super::{Node, NodeError, SandboxInfo, escape};

/// A running sandbox's agent.
#[derive(Clone)]
pub struct Sandbox {
    node: Node,
    pub id: String,
    token: Option<String>,
    /// The guest user commands and file calls run as (None: the sandbox's default).
    user: Option<String>,
}

impl Sandbox {
    /// Looks the sandbox up; a paused one is refused with what to do.
    pub async fn open(node: &Node, id: &str, user: Option<String>) -> Result<Sandbox, NodeError> {
        let info: SandboxInfo = node.sandbox(id).await?;
        if info.state == "paused" {
            return Err(NodeError::Api {
                status: 409,
                message: format!("sandbox {id} is paused; `sandfork resume {id}` first"),
            });
        }
        Ok(Sandbox {
            node: node.clone(),
            id: info.id,
            token: info.access_token,
            user,
        })
    }

    fn request(&self, method: &str, path: &str) -> hyper::http::request::Builder {
        let mut req = self
            .node
            .endpoint
            .request(method, path)
            .header(wire::SANDBOX_ID_HEADER, &self.id)
            .header(wire::SANDBOX_PORT_HEADER, envd_proto::PORT.to_string());
        if let Some(token) = &self.token {
            req = req.header(wire::ACCESS_TOKEN_HEADER, token);
        }
        if let Some(user) = &self.user {
            // envd takes the user from Basic auth with an empty password.
            let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
            req = req.header("authorization", format!("Basic {basic}"));
        }
        req
    }

    fn build(
        &self,
        builder: hyper::http::request::Builder,
        body: Body,
    ) -> Result<hyper::Request<Body>, NodeError> {
        builder.body(body).map_err(|e| NodeError::Malformed {
            what: "a request to the sandbox".into(),
            reason: e.to_string(),
        })
    }

    /// An error answer of the proxy or the agent, as one line.
    fn refusal(&self, status: u16, body: &[u8]) -> NodeError {
        let text = String::from_utf8_lossy(body);
        if status == 502 && text.contains("not found") {
            return NodeError::NoSandbox(self.id.clone());
        }
        if status == 401 {
            return NodeError::Api {
                status,
                message: format!(
                    "the sandbox refused the request: {}",
                    super::error_message(status, body)
                ),
            };
        }
        NodeError::Api {
            status,
            message: format!(
                "sandbox {}: {}",
                self.id,
                super::error_message(status, body)
            ),
        }
    }

    /// `process.Process/Start`: the process's events as they come.
    pub async fn start(&self, start: &StartRequest) -> Result<ProcessStream, NodeError> {
        let body = envelope::encode_message(start).map_err(|e| NodeError::Malformed {
            what: "the start request".into(),
            reason: e.to_string(),
        })?;
        let req = self.build(
            self.request("POST", envd_proto::process::PATH_START)
                .header("content-type", CONTENT_TYPE_STREAM)
                .header("connect-protocol-version", "1"),
            full(body),
        )?;
        let response = self.node.endpoint.send(req).await?;
        let status = response.status().as_u16();
        if status != 200 {
            let body = read_body(self.node.url(), response).await?;
            return Err(self.refusal(status, &body));
        }
        Ok(ProcessStream {
            url: self.node.url().to_owned(),
            id: self.id.clone(),
            body: response.into_body(),
            decoder: Decoder::new(DEFAULT_MAX_MESSAGE),
            ready: VecDeque::new(),
            done: false,
        })
    }

    /// A connection for a series of unary calls (input, resizes).
    pub async fn connect(&self) -> Result<Conn, NodeError> {
        self.node.endpoint.connect().await
    }

    /// A unary Connect call (`SendInput`, `Update`, ...) on `conn`.
    pub async fn unary<Q: Serialize, R: DeserializeOwned>(
        &self,
        conn: &mut Conn,
        path: &str,
        request: &Q,
    ) -> Result<R, NodeError> {
        let json = serde_json::to_vec(request).map_err(|e| NodeError::Malformed {
            what: path.to_owned(),
            reason: e.to_string(),
        })?;
        let req = self.build(
            self.request("POST", path)
                .header("content-type", CONTENT_TYPE_UNARY)
                .header("connect-protocol-version", "1"),
            full(json),
        )?;
        let response = conn.send(req).await?;
        let status = response.status().as_u16();
        let body = read_body(self.node.url(), response).await?;
        if status != 200 {
            return Err(self.refusal(status, &body));
        }
        super::parse(path, &body)
    }

    fn files_path(&self, path: &str) -> String {
        let mut q = format!("/files?path={}", escape(path));
        if let Some(user) = &self.user {
            q.push_str(&format!("&username={}", escape(user)));
        }
        q
    }

    /// `GET /files`: the file's bytes as a stream.
    pub async fn download(&self, path: &str) -> Result<Response<Incoming>, NodeError> {
        let req = self.build(
            self.request("GET", &self.files_path(path))
                .header("accept-encoding", "identity"),
            super::http::empty(),
        )?;
        let response = self.node.endpoint.send(req).await?;
        let status = response.status().as_u16();
        if status != 200 {
            let body = read_body(self.node.url(), response).await?;
            return Err(self.refusal(status, &body));
        }
        Ok(response)
    }

    /// `POST /files` with an octet-stream body: writes `path` (parents made).
    /// Without a length the body goes chunked.
    pub async fn upload(&self, path: &str, body: Body, len: Option<u64>) -> Result<(), NodeError> {
        let mut req = self
            .request("POST", &self.files_path(path))
            .header("content-type", "application/octet-stream");
        if let Some(len) = len {
            req = req.header("content-length", len.to_string());
        }
        let req = self.build(req, body)?;
        let response = self.node.endpoint.send(req).await?;
        let status = response.status().as_u16();
        let body = read_body(self.node.url(), response).await?;
        if status != 200 {
            return Err(self.refusal(status, &body));
        }
        Ok(())
    }
}

/// The events of a `Start` stream, decoded as bytes arrive.
pub struct ProcessStream {
    url: String,
    id: String,
    body: Incoming,
    decoder: Decoder,
    ready: VecDeque<ProcessEvent>,
    done: bool,
}

impl ProcessStream {
    /// The next event; None after the stream ended cleanly.
    pub async fn next(&mut self) -> Result<Option<ProcessEvent>, NodeError> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Ok(Some(event));
            }
            if self.done {
                return Ok(None);
            }
            let malformed = |reason: String| NodeError::Malformed {
                what: "the process stream".into(),
                reason,
            };
            while let Some(env) = self
                .decoder
                .next_envelope()
                .map_err(|e| malformed(e.to_string()))?
            {
                if env.is_end_stream() {
                    let end: EndStream = serde_json::from_slice(&env.payload)
                        .map_err(|e| malformed(e.to_string()))?;
                    self.done = true;
                    if let Some(error) = end.error {
                        return Err(self.stream_error(error));
                    }
                    break;
                }
                let msg: StartResponse =
                    serde_json::from_slice(&env.payload).map_err(|e| malformed(e.to_string()))?;
                self.ready.push_back(msg.event);
            }
            if !self.ready.is_empty() || self.done {
                continue;
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.decoder.push(data);
                    }
                }
                Some(Err(e)) => {
                    return Err(NodeError::Connection(self.url.clone(), e.to_string()));
                }
                None => {
                    return Err(malformed(
                        "it ended without an end-of-stream message (the sandbox may have stopped)"
                            .into(),
                    ));
                }
            }
        }
    }

    fn stream_error(&self, error: ConnectError) -> NodeError {
        NodeError::Api {
            status: error.http_status(),
            message: format!("sandbox {}: {error}", self.id),
        }
    }
}
