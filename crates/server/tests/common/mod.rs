//! What the lab tests share: the binaries, one HTTP exchange with a node,
//! a command run through its envd proxy.
#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;

use bytes::Bytes;
use envd_proto::envelope::{self, DEFAULT_MAX_MESSAGE, FLAG_NONE};
use envd_proto::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest, StartResponse};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;

mod oci;
mod serve;
#[allow(unused_imports)] // each test binary uses its own part
pub use oci::{BUSYBOX, MARKER, busybox_oci_layout};
#[allow(unused_imports)] // each test binary uses its own part
pub use serve::ServeProcess;

pub fn vmm_binary() -> PathBuf {
    if let Ok(p) = std::env::var("SANDFORK_VMM") {
        return p.into();
    }
    // target/debug/deps/<test> -> target/debug/sandfork-vmm
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("sandfork-vmm")
}

/// A node's config for the lab: the kernel and image from the environment
/// (`SANDFORK_KERNEL`, `SANDFORK_ROOTFS`), its data in `data`, `pool_size`
/// warm VMMs.
pub fn lab_config(
    listen: std::net::SocketAddr,
    data: &std::path::Path,
    pool_size: usize,
) -> server::node::config::Config {
    let env = |name| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let mut config = server::node::config::Config::new(
        listen,
        env("SANDFORK_KERNEL").into(),
        env("SANDFORK_ROOTFS").into(),
        vmm_binary(),
    );
    config.data_dir = data.to_owned();
    config.pool_size = pool_size;
    config
}

pub struct Answer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{}: {e}: {:?}", self.status, self.body))
    }
}

/// One HTTP/1.1 exchange with the server on a fresh connection.
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = Request::builder().method(method).uri(path);
    let mut has_host = false;
    for (k, v) in headers {
        has_host |= k.eq_ignore_ascii_case("host");
        req = req.header(*k, *v);
    }
    if !has_host {
        req = req.header("host", addr.to_string());
    }
    let response = sender
        .send_request(req.body(Full::new(body.into())).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body,
    }
}

/// `POST /sandboxes/{id}/{action}` with an empty JSON body: pause, connect,
/// resume, fork (of one), refreshes.
pub async fn on_sandbox(
    addr: std::net::SocketAddr,
    auth: &[(&str, &str)],
    id: &str,
    action: &str,
) -> Answer {
    http(
        addr,
        "POST",
        &format!("/sandboxes/{id}/{action}"),
        auth,
        "{}",
    )
    .await
}

/// `DELETE /sandboxes/{id}`.
pub async fn kill(addr: std::net::SocketAddr, auth: &[(&str, &str)], id: &str) -> Answer {
    http(addr, "DELETE", &format!("/sandboxes/{id}"), auth, "").await
}

/// `GET /sandboxes/{id}`: the sandbox's detail.
pub async fn detail(addr: std::net::SocketAddr, auth: &[(&str, &str)], id: &str) -> Answer {
    http(addr, "GET", &format!("/sandboxes/{id}"), auth, "").await
}

/// Runs `command` through `POST /process.Process/Start` with `routing`
/// headers; returns (exit code, stdout).
pub async fn run(
    addr: std::net::SocketAddr,
    routing: &[(&str, &str)],
    command: &str,
) -> (i32, String) {
    run_in(addr, routing, "/bin/bash", command).await
}

/// [`run`] under `shell` (images without bash have `/bin/sh`).
pub async fn run_in(
    addr: std::net::SocketAddr,
    routing: &[(&str, &str)],
    shell: &str,
    command: &str,
) -> (i32, String) {
    let start = StartRequest {
        process: ProcessConfig {
            cmd: shell.into(),
            args: vec!["-c".into(), command.into()],
            ..Default::default()
        },
        stdin: Some(false),
        ..Default::default()
    };
    let body = envelope::encode(FLAG_NONE, &serde_json::to_vec(&start).unwrap());
    let mut headers = vec![
        ("content-type", "application/connect+json"),
        ("connect-protocol-version", "1"),
        ("authorization", "Basic cm9vdDo="),
    ];
    headers.extend_from_slice(routing);
    let a = http(addr, "POST", "/process.Process/Start", &headers, body).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.headers["content-type"], "application/connect+json");
    let envelopes = envelope::decode_all(&a.body, DEFAULT_MAX_MESSAGE).unwrap();
    assert!(
        envelopes.last().unwrap().is_end_stream(),
        "no end of stream"
    );
    let (mut code, mut out) = (None, String::new());
    for env in envelopes.iter().filter(|e| !e.is_end_stream()) {
        let msg: StartResponse = serde_json::from_slice(&env.payload).unwrap();
        match msg.event {
            ProcessEvent::Data(DataEvent::Stdout(b)) => {
                out.push_str(&String::from_utf8_lossy(&b.0))
            }
            ProcessEvent::End(end) => code = Some(end.exit_code),
            _ => {}
        }
    }
    (code.expect("no end event"), out)
}

/// A sandbox a test created: the create's answer, and what routes envd
/// requests to it through the node's proxy.
#[derive(Clone)]
pub struct Created {
    pub id: String,
    pub token: String,
    pub answer: Value,
}

impl Created {
    pub fn routing(&self) -> [(&'static str, &str); 2] {
        [
            ("e2b-sandbox-id", self.id.as_str()),
            ("x-access-token", self.token.as_str()),
        ]
    }
}

/// The children of a fork's answer (201, one sandbox per entry).
pub fn forked(answer: Answer) -> Vec<Created> {
    assert_eq!(answer.status, 201, "{:?}", answer.body);
    let json = answer.json();
    json.as_array()
        .unwrap()
        .iter()
        .map(|c| Created {
            id: c["sandbox"]["sandboxID"]
                .as_str()
                .unwrap_or_else(|| panic!("a child failed: {c} (of {json})"))
                .to_owned(),
            token: c["sandbox"]["envdAccessToken"].as_str().unwrap().to_owned(),
            answer: c.clone(),
        })
        .collect()
}

/// `POST /v2/sandboxes` with `body`; the create must succeed.
pub async fn create(addr: std::net::SocketAddr, auth: &[(&str, &str)], body: Value) -> Created {
    let made = http(addr, "POST", "/v2/sandboxes", auth, body.to_string()).await;
    assert_eq!(made.status, 201, "{:?}", made.body);
    let answer = made.json();
    Created {
        id: answer["sandboxID"].as_str().unwrap().to_owned(),
        token: answer["envdAccessToken"].as_str().unwrap().to_owned(),
        answer,
    }
}
