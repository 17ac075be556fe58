//! The host side of a Firecracker-style vsock device: connect to the VM's
//! Unix socket, ask for a guest port with `CONNECT <port>\n`, and get a plain
//! byte stream once the VMM answers `OK <host port>\n`.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use envd_proto::tcp_forward;

#[derive(Debug, thiserror::Error)]
pub enum VsockConnectError {
    #[error("connecting to vsock socket {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("vsock handshake for guest port {port}: {source}")]
    Io {
        port: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("nothing accepted the connection on guest port {0}")]
    Refused(u32),
    #[error("unexpected vsock handshake reply {0:?}")]
    BadReply(String),
    #[error("no answer from guest port {0} within {1:?}")]
    Timeout(u32, Duration),
    #[error("malformed HTTP answer from the guest agent: {0:?}")]
    BadHttp(String),
    #[error("the guest's TCP {port} is not open: {reason}")]
    TcpRefused { port: u32, reason: String },
}

/// Opens a stream to `port` in the guest behind the vsock socket `uds_path`.
pub async fn connect(uds_path: &Path, port: u32) -> Result<UnixStream, VsockConnectError> {
    let mut stream =
        UnixStream::connect(uds_path)
            .await
            .map_err(|source| VsockConnectError::Connect {
                path: uds_path.display().to_string(),
                source,
            })?;
    let io = |source| VsockConnectError::Io { port, source };
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(io)?;
    // Read the reply byte by byte: anything past the newline belongs to the
    // guest's stream and must stay unread.
    let mut reply = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        match stream.read(&mut byte).await.map_err(io)? {
            0 => return Err(VsockConnectError::Refused(port)),
            _ if byte[0] == b'\n' => break,
            _ if reply.len() > 64 => {
                return Err(VsockConnectError::BadReply(
                    String::from_utf8_lossy(&reply).into(),
                ));
            }
            _ => reply.push(byte[0]),
        }
    }
    let reply = String::from_utf8_lossy(&reply).into_owned();
    match reply.strip_prefix("OK ").map(|p| p.trim().parse::<u32>()) {
        Some(Ok(_)) => Ok(stream),
        _ => Err(VsockConnectError::BadReply(reply)),
    }
}

/// Opens a stream to TCP `port` on the guest's loopback, through the guest
/// agent's forwarder (see `envd_proto::tcp_forward`).
pub async fn connect_guest_tcp(
    uds_path: &Path,
    port: u16,
) -> Result<UnixStream, VsockConnectError> {
    let vsock_port = tcp_forward::VSOCK_PORT;
    let mut stream = connect(uds_path, vsock_port).await?;
    let io = |source| VsockConnectError::Io {
        port: vsock_port,
        source,
    };
    stream
        .write_all(tcp_forward::request(port).as_bytes())
        .await
        .map_err(io)?;
    let mut line = Vec::new();
    loop {
        match stream.read_u8().await.map_err(io)? {
            b'\n' => break,
            _ if line.len() == tcp_forward::MAX_LINE => {
                return Err(VsockConnectError::BadReply(
                    String::from_utf8_lossy(&line).into(),
                ));
            }
            byte => line.push(byte),
        }
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    match tcp_forward::Reply::parse(&line) {
        Some(tcp_forward::Reply::Connected) => Ok(stream),
        Some(tcp_forward::Reply::Refused(reason)) => Err(VsockConnectError::TcpRefused {
            port: port.into(),
            reason,
        }),
        None => Err(VsockConnectError::BadReply(line)),
    }
}

/// The longest status line read from a health check.
const MAX_STATUS_LINE: u64 = 256;

/// Asks the guest agent on `port` for `GET /health` and returns the HTTP
/// status code it answered with.
pub async fn agent_health(
    uds_path: &Path,
    port: u32,
    timeout: Duration,
) -> Result<u16, VsockConnectError> {
    let exchange = async {
        let mut stream = connect(uds_path, port).await?;
        let io = |source| VsockConnectError::Io { port, source };
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
            .await
            .map_err(io)?;
        let mut status_line = String::new();
        // A guest that never ends its line must not fill the host's memory.
        BufReader::new(stream.take(MAX_STATUS_LINE))
            .read_line(&mut status_line)
            .await
            .map_err(io)?;
        status_line
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or(VsockConnectError::BadHttp(status_line))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| VsockConnectError::Timeout(port, timeout))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_health_answer_without_a_line_end_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vsock.sock");
        crate::hostile_guest::serve(&uds, b"HTTP/1.1 200");
        let e = agent_health(&uds, 1, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(e, VsockConnectError::BadHttp(_)), "{e}");
    }
}
