//! A real agent in host mode and a small HTTP/1.1 client speaking Connect
//! framing, for the envd tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use envd_proto::envelope::{self, Envelope};

pub const AGENT: &str = env!("CARGO_BIN_EXE_sandfork-agent");

/// The agent, killed on drop.
pub struct Agent {
    child: Child,
    pub addr: String,
    log: Receiver<String>,
}

impl Agent {
    pub fn start() -> Self {
        let mut child = Command::new(AGENT)
            .args(["--listen-tcp", "127.0.0.1:0", "--no-vsock"])
            .env("RUST_LOG", "debug")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[agent] {line}");
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .expect("agent did not log its address");
            if let Some(i) = line.find("listening on tcp ") {
                break line[i + "listening on tcp ".len()..].trim().to_string();
            }
        };
        Agent {
            child,
            addr,
            log: rx,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the agent process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    /// One request with a body; the whole response.
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        let mut s = self.connect();
        write_request(&mut s, method, path, headers, body);
        read_response(&mut s)
    }

    /// A GET with `headers`; the whole response.
    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Resp {
        self.request("GET", path, headers, b"")
    }

    /// A POST of `body` as `content_type`; the whole response.
    pub fn post(&self, path: &str, content_type: &str, body: &[u8]) -> Resp {
        self.request("POST", path, &[("content-type", content_type)], body)
    }

    /// Unary Connect call with a JSON body.
    pub fn unary(&self, path: &str, headers: &[(&str, &str)], json: &serde_json::Value) -> Resp {
        let mut h = vec![
            ("content-type", "application/json"),
            ("connect-protocol-version", "1"),
        ];
        h.extend_from_slice(headers);
        self.request("POST", path, &h, json.to_string().as_bytes())
    }

    /// Server-stream Connect call: one envelope in, the response read fully.
    pub fn stream(&self, path: &str, headers: &[(&str, &str)], json: &serde_json::Value) -> Resp {
        let mut s = self.open_stream(path, headers, json);
        read_response(&mut s)
    }

    /// Starts a server-stream call and returns the socket, headers not yet read.
    pub fn open_stream(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        json: &serde_json::Value,
    ) -> TcpStream {
        let mut h = vec![
            ("content-type", "application/connect+json"),
            ("connect-protocol-version", "1"),
        ];
        h.extend_from_slice(headers);
        let body = envelope::encode(0, json.to_string().as_bytes());
        let mut s = self.connect();
        write_request(&mut s, "POST", path, &h, &body);
        s
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        while self.log.try_recv().is_ok() {}
    }
}

pub fn write_request(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
}

/// A response: status, lowercased headers, de-chunked body.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts the response is an error with `status` and the JSON `code`.
    pub fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(
            (self.status, self.json()["code"].as_str()),
            (status, Some(code)),
            "{self:?}"
        );
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn envelopes(&self) -> Vec<Envelope> {
        envelope::decode_all(&self.body, 1 << 24).unwrap()
    }

    /// The messages of a stream response as JSON, the end-stream last.
    pub fn messages(&self) -> Vec<serde_json::Value> {
        assert_eq!(self.status, 200, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/connect+json")
        );
        let envs = self.envelopes();
        let ends = envs.iter().filter(|e| e.is_end_stream()).count();
        assert_eq!(ends, 1, "exactly one end-stream envelope");
        assert!(
            envs.last().unwrap().is_end_stream(),
            "end-stream comes last"
        );
        envs.iter()
            .map(|e| serde_json::from_slice(&e.payload).unwrap())
            .collect()
    }
}

/// Reads the status line and headers.
pub fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    (status, headers)
}

pub fn read_response(s: &mut TcpStream) -> Resp {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let (status, headers) = read_head(&mut r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let len = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.parse::<usize>().unwrap());
    let mut body = Vec::new();
    if chunked {
        let mut chunks = ChunkReader::new(r);
        while let Some(c) = chunks.next_chunk() {
            body.extend_from_slice(&c);
        }
    } else if let Some(n) = len {
        body.resize(n, 0);
        r.read_exact(&mut body).unwrap();
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    Resp {
        status,
        headers,
        body,
    }
}

/// Reads a chunked body chunk by chunk, as it arrives.
pub struct ChunkReader {
    r: BufReader<TcpStream>,
    done: bool,
}

impl ChunkReader {
    pub fn new(r: BufReader<TcpStream>) -> Self {
        Self { r, done: false }
    }

    pub fn next_chunk(&mut self) -> Option<Vec<u8>> {
        if self.done {
            return None;
        }
        let mut size = String::new();
        if self.r.read_line(&mut size).unwrap_or(0) == 0 {
            self.done = true;
            return None;
        }
        let n = usize::from_str_radix(size.trim().split(';').next().unwrap(), 16).unwrap();
        if n == 0 {
            let mut crlf = String::new();
            let _ = self.r.read_line(&mut crlf);
            self.done = true;
            return None;
        }
        let mut buf = vec![0; n + 2];
        self.r.read_exact(&mut buf).unwrap();
        buf.truncate(n);
        Some(buf)
    }
}

/// Reads a stream response's envelopes one at a time as they arrive.
pub struct LiveStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    chunks: ChunkReader,
    decoder: envd_proto::Decoder,
    pub raw: TcpStream,
}

impl LiveStream {
    pub fn open(s: TcpStream) -> Self {
        let raw = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        let (status, headers) = read_head(&mut r);
        LiveStream {
            status,
            headers,
            chunks: ChunkReader::new(r),
            decoder: envd_proto::Decoder::new(1 << 24),
            raw,
        }
    }

    /// The next envelope, or None at the end of the body.
    pub fn next(&mut self) -> Option<Envelope> {
        loop {
            if let Some(e) = self.decoder.next_envelope().unwrap() {
                return Some(e);
            }
            let c = self.chunks.next_chunk()?;
            self.decoder.push(&c);
        }
    }

    /// The next message as JSON (the end-stream envelope too).
    pub fn next_json(&mut self) -> Option<(bool, serde_json::Value)> {
        self.next().map(|e| {
            (
                e.is_end_stream(),
                serde_json::from_slice(&e.payload).unwrap(),
            )
        })
    }
}

pub fn b64(data: &[u8]) -> String {
    envd_proto::json::b64_encode(data)
}

pub fn unb64(text: &str) -> Vec<u8> {
    envd_proto::json::b64_decode(text).unwrap()
}
