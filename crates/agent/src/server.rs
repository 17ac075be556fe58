//! Serving the agent's HTTP surface (the envd router, see `envd`) on any
//! listener: vsock and TCP.

use axum::Router;
use axum::serve::Listener;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;

/// Serves `router` on every connection the listener accepts, forever (the
/// listener retries failed accepts itself).
///
/// Not `axum::serve`: it cannot enable HTTP/1 half-close, and without it hyper
/// drops the response when a client shuts down its write side after sending the
/// request (as `socat` and byte-forwarding proxies do), which we saw on vsock.
pub async fn serve<L>(mut listener: L, what: String, router: Router)
where
    L: Listener,
    L::Addr: std::fmt::Debug,
{
    loop {
        let (io, peer) = listener.accept().await;
        log::trace!("{what}: connection from {peer:?}");
        let service = TowerToHyperService::new(router.clone());
        let what = what.clone();
        tokio::spawn(async move {
            let served = http1::Builder::new()
                .half_close(true)
                // Lets the default 30 s header-read timeout take effect, so idle
                // or stalled peers do not pin descriptors forever.
                .timer(TokioTimer::new())
                .serve_connection(TokioIo::new(io), service)
                .await;
            if let Err(e) = served {
                log::debug!("{what}: connection from {peer:?}: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    /// Hands axum one in-memory byte stream: the same raw-stream situation as a
    /// vsock connection forwarded by the VMM's Unix socket.
    struct OneStream(Option<DuplexStream>);

    impl Listener for OneStream {
        type Io = DuplexStream;
        type Addr = ();

        async fn accept(&mut self) -> (Self::Io, Self::Addr) {
            match self.0.take() {
                Some(s) => (s, ()),
                None => std::future::pending().await,
            }
        }

        fn local_addr(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn test_router() -> Router {
        crate::envd::router(crate::envd::Envd::new(false))
    }

    async fn roundtrip(request: &str) -> String {
        let (client, server) = tokio::io::duplex(4096);
        let task = tokio::spawn(serve(OneStream(Some(server)), "test".into(), test_router()));
        let mut client = client;
        client.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        // Connection: close makes hyper end the stream after the response.
        client.read_to_end(&mut out).await.unwrap();
        task.abort();
        String::from_utf8(out).unwrap()
    }

    #[tokio::test]
    async fn health_is_204_over_a_raw_stream() {
        let resp = roundtrip("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.1 204 No Content\r\n"), "{resp}");
    }

    /// The client shuts its write side right after the request, before the
    /// server has answered; the response must still arrive.
    #[tokio::test]
    async fn response_survives_client_half_close() {
        for _ in 0..20 {
            let (mut client, server) = tokio::io::duplex(4096);
            let task = tokio::spawn(serve(OneStream(Some(server)), "test".into(), test_router()));
            client
                .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            client.shutdown().await.unwrap();
            let mut out = Vec::new();
            client.read_to_end(&mut out).await.unwrap();
            task.abort();
            let resp = String::from_utf8(out).unwrap();
            assert!(resp.starts_with("HTTP/1.1 204 No Content\r\n"), "{resp:?}");
        }
    }

    #[tokio::test]
    async fn unknown_route_is_404_and_wrong_method_405() {
        let resp = roundtrip("GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.1 404 Not Found\r\n"), "{resp}");
        let resp = roundtrip(
            "POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 405 "), "{resp}");
    }
}
