//! Forwards host connections to the guest's TCP ports (see
//! `envd_proto::tcp_forward`): how `<port>-<id>.<domain>` reaches a server a
//! sandbox runs, as E2B's proxy does over its network.

use std::io;

use axum::serve::Listener;
use envd_proto::tcp_forward::{self, Reply};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Forwards every connection the listener accepts, forever.
pub async fn serve<L>(mut listener: L)
where
    L: Listener,
    L::Addr: std::fmt::Debug,
{
    loop {
        let (io, peer) = listener.accept().await;
        tokio::spawn(async move {
            if let Err(e) = forward(io).await {
                log::debug!("tcp forward for {peer:?}: {e}");
            }
        });
    }
}

/// Reads the port, connects to it on loopback (IPv4, then IPv6: servers
/// bind one or the other), answers, then copies both ways until both ends
/// are done.
async fn forward<S>(mut host: S) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let line = read_line(&mut host).await?;
    let Some(port) = tcp_forward::parse_request(&line) else {
        let reply = Reply::Refused(format!("not a TCP port: {line:?}"));
        return host.write_all(reply.line().as_bytes()).await;
    };
    let guest = match TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(v4) => match TcpStream::connect(("::1", port)).await {
            Ok(s) => s,
            Err(_) => {
                let reply = Reply::Refused(format!("port {port}: {v4}"));
                return host.write_all(reply.line().as_bytes()).await;
            }
        },
    };
    host.write_all(Reply::Connected.line().as_bytes()).await?;
    let mut guest = guest;
    tokio::io::copy_bidirectional(&mut host, &mut guest).await?;
    Ok(())
}

/// One line, read a byte at a time: what follows it is the stream's and
/// must stay unread.
async fn read_line<S: AsyncRead + Unpin>(io: &mut S) -> io::Result<String> {
    let mut line = Vec::new();
    loop {
        let byte = io.read_u8().await?;
        if byte == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        if line.len() == tcp_forward::MAX_LINE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request line too long",
            ));
        }
        line.push(byte);
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncBufReadExt, BufReader, DuplexStream};
    use tokio::net::TcpListener;

    use super::*;

    /// A forwarding connection as the host sees it.
    fn connection() -> DuplexStream {
        let (host, agent) = tokio::io::duplex(64 * 1024);
        tokio::spawn(forward(agent));
        host
    }

    async fn reply(host: &mut DuplexStream) -> Reply {
        let mut line = String::new();
        // The agent sends nothing past its reply before the host speaks.
        BufReader::new(host).read_line(&mut line).await.unwrap();
        Reply::parse(&line).unwrap()
    }

    #[tokio::test]
    async fn forwards_both_ways_to_a_loopback_port() {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = server.accept().await.unwrap();
            let mut asked = [0u8; 4];
            s.read_exact(&mut asked).await.unwrap();
            s.write_all(&[asked, *b"pong"].concat()).await.unwrap();
        });
        let mut host = connection();
        host.write_all(tcp_forward::request(port).as_bytes())
            .await
            .unwrap();
        assert_eq!(reply(&mut host).await, Reply::Connected);
        host.write_all(b"ping").await.unwrap();
        let mut answer = Vec::new();
        host.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"pingpong");
    }

    #[tokio::test]
    async fn a_closed_port_or_a_bad_line_is_refused_in_one_line() {
        // Bound then dropped: nothing listens there now.
        let port = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut host = connection();
        host.write_all(tcp_forward::request(port).as_bytes())
            .await
            .unwrap();
        assert!(
            matches!(reply(&mut host).await, Reply::Refused(r) if r.contains(&port.to_string()))
        );

        let mut host = connection();
        host.write_all(b"http\n").await.unwrap();
        assert!(matches!(reply(&mut host).await, Reply::Refused(_)));
    }
}
