//! A small client of the guest agent (E2B's envd protocol) over a VM's vsock
//! socket: what the host itself needs from a guest, namely to initialise it
//! after a boot, restore or fork (wall clock, fresh entropy) and to run a
//! command and collect its output.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use envd_proto::envelope::{self, DEFAULT_MAX_MESSAGE, FLAG_NONE};
use envd_proto::process::{
    DataEvent, PATH_START, ProcessConfig, ProcessEvent, StartRequest, StartResponse,
};
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

use crate::vsock_connect::{self, VsockConnectError};

/// Random bytes handed to a guest on init, to reseed its kernel RNG.
pub const ENTROPY_BYTES: usize = 64;
/// The largest answer read from a guest agent: the guest is not trusted
/// with the host's memory.
pub const MAX_REPLY: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Vsock(#[from] VsockConnectError),
    #[error("HTTP exchange with the guest agent: {0}")]
    Http(#[from] hyper::Error),
    #[error("building the request: {0}")]
    Request(String),
    #[error("the guest agent answered {status} to {path}: {body}")]
    Status {
        path: String,
        status: u16,
        body: String,
    },
    #[error("the guest agent's answer to {path} is malformed: {reason}")]
    Malformed { path: String, reason: String },
    #[error("reading host entropy: {0}")]
    Entropy(#[source] std::io::Error),
    #[error("no answer from the guest agent within {0:?}")]
    Timeout(Duration),
    #[error("the guest agent's answer to {path} is larger than {max} bytes")]
    TooLarge { path: String, max: usize },
}

/// The `POST /init` body: E2B's fields plus sandfork's `entropy`. Its
/// `Debug` leaves out the token, the entropy and the environment's values.
#[derive(Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentInit {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// Base64 bytes the agent mixes into the kernel RNG before reseeding it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entropy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// Sandbox-wide environment variables (E2B's create `envVars`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub env_vars: Option<std::collections::BTreeMap<String, String>>,
    /// The user commands and file calls run as when a request names none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_user: Option<String>,
    /// Where commands run when a request names no directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_workdir: Option<String>,
}

impl std::fmt::Debug for AgentInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let env_names = self
            .env_vars
            .as_ref()
            .map(|env| env.keys().collect::<Vec<_>>());
        f.debug_struct("AgentInit")
            .field("timestamp", &self.timestamp)
            .field("entropy", &self.entropy.as_ref().map(|_| ".."))
            .field("access_token", &self.access_token.as_ref().map(|_| ".."))
            .field("env_vars (names)", &env_names)
            .field("default_user", &self.default_user)
            .field("default_workdir", &self.default_workdir)
            .finish()
    }
}

impl AgentInit {
    /// The host's wall clock now and fresh host entropy: what a restored or
    /// forked guest needs before it serves anything.
    pub fn after_restore() -> Result<Self, AgentError> {
        use base64::Engine;
        use std::io::Read;
        let mut entropy = [0u8; ENTROPY_BYTES];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut entropy))
            .map_err(AgentError::Entropy)?;
        Ok(AgentInit {
            timestamp: Some(humantime::format_rfc3339_nanos(SystemTime::now()).to_string()),
            entropy: Some(base64::engine::general_purpose::STANDARD.encode(entropy)),
            access_token: None,
            env_vars: None,
            default_user: None,
            default_workdir: None,
        })
    }

    /// This init with its clock read again, if it sets one: an init sent
    /// after a wait must not set the guest's clock to when it was made.
    pub fn restamped(&self) -> AgentInit {
        let mut init = self.clone();
        if init.timestamp.is_some() {
            init.timestamp = Some(humantime::format_rfc3339_nanos(SystemTime::now()).to_string());
        }
        init
    }
}

fn init_answer(status: u16, reply: &[u8]) -> Result<(), AgentError> {
    if (200..300).contains(&status) {
        return Ok(());
    }
    Err(AgentError::Status {
        path: "/init".into(),
        status,
        body: String::from_utf8_lossy(reply).into(),
    })
}

/// Percent-encodes a query value (everything but unreserved characters and `/`).
fn query_escape(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One reading of the guest's `GET /metrics` (envd's field names).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct AgentMetrics {
    /// Unix seconds, by the guest's clock.
    pub ts: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f32,
    /// Bytes.
    pub mem_total: u64,
    pub mem_used: u64,
    #[serde(default)]
    pub mem_cache: u64,
    /// Bytes of the root filesystem.
    #[serde(default)]
    pub disk_used: u64,
    #[serde(default)]
    pub disk_total: u64,
}

/// What a command did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandOutput {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Talks to the agent of the VM whose vsock socket is `uds`.
#[derive(Debug, Clone)]
pub struct AgentClient {
    uds: PathBuf,
    timeout: Duration,
    /// Sent as `X-Access-Token` (a secured agent asks for it, `/init` included).
    access_token: Option<String>,
    /// Who commands and file calls run as (envd's Basic-auth user name).
    user: String,
}

impl AgentClient {
    pub fn new(uds: &Path) -> Self {
        AgentClient {
            uds: uds.to_owned(),
            timeout: Duration::from_secs(60),
            access_token: None,
            user: "root".into(),
        }
    }

    /// Runs commands as `user` instead of root (file calls stay root's).
    pub fn with_user(mut self, user: &str) -> Self {
        self.user = user.to_owned();
        self
    }

    /// Presents `token` on every request (the agent's access token, once set).
    pub fn with_access_token(mut self, token: Option<&str>) -> Self {
        self.access_token = token.map(str::to_owned);
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn post(
        &self,
        path: &str,
        content_type: &str,
        body: Bytes,
    ) -> Result<(u16, Bytes), AgentError> {
        self.send(hyper::Method::POST, path, content_type, body)
            .await
    }

    async fn send(
        &self,
        method: hyper::Method,
        path: &str,
        content_type: &str,
        body: Bytes,
    ) -> Result<(u16, Bytes), AgentError> {
        let exchange = async {
            let stream = self.connect().await?;
            self.exchange(stream, method, path, content_type, body)
                .await
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| AgentError::Timeout(self.timeout))?
    }

    /// A stream to the agent, tried again while the guest does not take the
    /// connection: a guest busy on a loaded node (in the lab, a two-vCPU
    /// template build's) can miss the VMM's 5 s wait for its answer, and the
    /// VMM then closes the stream as for a refusal. Nothing was sent yet, so
    /// trying again is safe; the request's own timeout bounds the whole.
    async fn connect(&self) -> Result<tokio::net::UnixStream, VsockConnectError> {
        let mut pause = Duration::from_millis(100);
        loop {
            match vsock_connect::connect(&self.uds, envd_proto::PORT).await {
                Err(VsockConnectError::Refused(_)) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                other => return other,
            }
        }
    }

    /// One request on a stream already connected to the agent.
    async fn exchange(
        &self,
        stream: tokio::net::UnixStream,
        method: hyper::Method,
        path: &str,
        content_type: &str,
        body: Bytes,
    ) -> Result<(u16, Bytes), AgentError> {
        use base64::Engine;
        // envd takes the user from the Basic-auth user name.
        let basic = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{}:", self.user))
        );
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let mut request = Request::builder();
        if let Some(token) = &self.access_token {
            request = request.header("x-access-token", token);
        }
        let request = request
            .method(method)
            .uri(path)
            .header("host", "agent")
            .header("content-type", content_type)
            .header("connect-protocol-version", "1")
            .header("authorization", &basic)
            .body(Full::new(body))
            .map_err(|e| AgentError::Request(e.to_string()))?;
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), MAX_REPLY)
            .collect()
            .await
            .map_err(|e| match e.downcast::<hyper::Error>() {
                Ok(e) => AgentError::Http(*e),
                Err(_) => AgentError::TooLarge {
                    path: path.to_owned(),
                    max: MAX_REPLY,
                },
            })?
            .to_bytes();
        Ok((status, body))
    }

    /// Writes `bytes` to `path` in the guest (`POST /files`, octet-stream), as root.
    pub async fn write_file(&self, path: &str, bytes: Vec<u8>) -> Result<(), AgentError> {
        let route = format!("/files?username=root&path={}", query_escape(path));
        let (status, reply) = self
            .send(
                hyper::Method::POST,
                &route,
                "application/octet-stream",
                bytes.into(),
            )
            .await?;
        if status != 200 {
            return Err(AgentError::Status {
                path: route,
                status,
                body: String::from_utf8_lossy(&reply).into(),
            });
        }
        Ok(())
    }

    /// Reads `path` from the guest (`GET /files`), as root.
    pub async fn read_file(&self, path: &str) -> Result<Bytes, AgentError> {
        let route = format!("/files?username=root&path={}", query_escape(path));
        let (status, reply) = self
            .send(
                hyper::Method::GET,
                &route,
                "application/octet-stream",
                Bytes::new(),
            )
            .await?;
        if status != 200 {
            return Err(AgentError::Status {
                path: route,
                status,
                body: String::from_utf8_lossy(&reply).into(),
            });
        }
        Ok(reply)
    }

    /// `GET /metrics`: the guest's CPU, memory and root-disk use now.
    pub async fn metrics(&self) -> Result<AgentMetrics, AgentError> {
        let path = "/metrics";
        let (status, reply) = self
            .send(hyper::Method::GET, path, "application/json", Bytes::new())
            .await?;
        if status != 200 {
            return Err(AgentError::Status {
                path: path.into(),
                status,
                body: String::from_utf8_lossy(&reply).into(),
            });
        }
        serde_json::from_slice(&reply).map_err(|e| AgentError::Malformed {
            path: path.into(),
            reason: e.to_string(),
        })
    }

    /// `POST /init`.
    pub async fn init(&self, init: &AgentInit) -> Result<(), AgentError> {
        let body = serde_json::to_vec(init).map_err(|e| AgentError::Request(e.to_string()))?;
        let (status, reply) = self.post("/init", "application/json", body.into()).await?;
        init_answer(status, &reply)
    }

    /// `POST /init` on `stream`, already connected to the agent (see
    /// `VmmProcess::init_agent`, whose connection is the readiness probe).
    pub async fn init_over(
        &self,
        stream: tokio::net::UnixStream,
        init: &AgentInit,
    ) -> Result<(), AgentError> {
        let body = serde_json::to_vec(init).map_err(|e| AgentError::Request(e.to_string()))?;
        let exchange = self.exchange(
            stream,
            hyper::Method::POST,
            "/init",
            "application/json",
            body.into(),
        );
        let (status, reply) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| AgentError::Timeout(self.timeout))??;
        init_answer(status, &reply)
    }

    /// The vsock socket this client connects through.
    pub fn uds(&self) -> &Path {
        &self.uds
    }

    /// Runs `command` under `bash -c` as root (see [`Self::with_user`]) and waits for it to end.
    pub async fn run(&self, command: &str) -> Result<CommandOutput, AgentError> {
        self.run_argv("/bin/bash", &["-c", command]).await
    }

    /// Runs `cmd` with `args` as root (see [`Self::with_user`]) and waits for it to end (for images
    /// without bash: `run_argv("/bin/sh", &["-c", ...])`).
    pub async fn run_argv(&self, cmd: &str, args: &[&str]) -> Result<CommandOutput, AgentError> {
        let malformed = |reason: String| AgentError::Malformed {
            path: PATH_START.into(),
            reason,
        };
        let request = StartRequest {
            process: ProcessConfig {
                cmd: cmd.into(),
                args: args.iter().map(|a| (*a).to_owned()).collect(),
                ..Default::default()
            },
            stdin: Some(false),
            ..Default::default()
        };
        let body = envelope::encode(
            FLAG_NONE,
            &serde_json::to_vec(&request).map_err(|e| AgentError::Request(e.to_string()))?,
        );
        let (status, reply) = self
            .post(PATH_START, envd_proto::CONTENT_TYPE_STREAM, body)
            .await?;
        if status != 200 {
            return Err(AgentError::Status {
                path: PATH_START.into(),
                status,
                body: String::from_utf8_lossy(&reply).into(),
            });
        }
        let envelopes = envelope::decode_all(&reply, DEFAULT_MAX_MESSAGE)
            .map_err(|e| malformed(e.to_string()))?;
        let mut out = CommandOutput::default();
        let mut ended = false;
        for env in envelopes {
            if env.is_end_stream() {
                let text = String::from_utf8_lossy(&env.payload);
                if text.contains("\"error\"") {
                    return Err(malformed(format!("the stream ended with {text}")));
                }
                continue;
            }
            let message: StartResponse =
                serde_json::from_slice(&env.payload).map_err(|e| malformed(e.to_string()))?;
            match message.event {
                ProcessEvent::Data(DataEvent::Stdout(b)) => {
                    out.stdout.push_str(&String::from_utf8_lossy(&b.0))
                }
                ProcessEvent::Data(DataEvent::Stderr(b)) => {
                    out.stderr.push_str(&String::from_utf8_lossy(&b.0))
                }
                ProcessEvent::End(end) => {
                    out.exit_code = end.exit_code;
                    ended = true;
                }
                _ => {}
            }
        }
        if !ended {
            return Err(malformed("the stream has no end event".into()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_init_printed_shows_no_secret() {
        let init = AgentInit {
            access_token: Some("s3cret-token".into()),
            env_vars: Some([("KEY".to_owned(), "s3cret-value".to_owned())].into()),
            ..AgentInit::default()
        };
        let shown = format!("{init:?}");
        assert!(shown.contains("KEY"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }

    #[tokio::test]
    async fn an_endless_answer_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vsock.sock");
        crate::hostile_guest::serve(
            &uds,
            b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n",
        );
        let e = AgentClient::new(&uds).metrics().await.unwrap_err();
        assert!(matches!(e, AgentError::TooLarge { .. }), "{e}");
    }

    /// A guest that does not take its first connections (the VMM closes
    /// them after `CONNECT`, as for a refusal) gets the request once it
    /// takes one.
    #[tokio::test]
    async fn connections_the_guest_did_not_take_are_tried_again() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vsock.sock");
        let listener = tokio::net::UnixListener::bind(&uds).unwrap();
        async fn read_until(s: &mut tokio::net::UnixStream, end: &[u8]) {
            let (mut seen, mut byte) = (Vec::new(), [0u8; 1]);
            while !seen.ends_with(end) {
                s.read_exact(&mut byte).await.unwrap();
                seen.push(byte[0]);
            }
        }
        let vmm = tokio::spawn(async move {
            for accepted in 1.. {
                let (mut s, _) = listener.accept().await.unwrap();
                read_until(&mut s, b"\n").await;
                if accepted <= 3 {
                    continue; // dropped: closed unanswered
                }
                s.write_all(b"OK 1\n").await.unwrap();
                read_until(&mut s, b"\r\n\r\n").await;
                s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    .await
                    .unwrap();
                return accepted;
            }
            panic!("the listener ran out of connections")
        });
        let e = AgentClient::new(&uds).metrics().await.unwrap_err();
        assert!(matches!(e, AgentError::Status { status: 404, .. }), "{e}");
        assert_eq!(vmm.await.unwrap(), 4);
    }
}
