//! HTTP/1 connections to guest ports, kept open between proxied requests:
//! each new one costs a vsock handshake through the VMM and an accept in the
//! guest, which an SDK would otherwise pay on every call.
//!
//! Connections are keyed by the VMM's vsock socket (not the sandbox id), so a
//! sandbox that was paused and resumed never gets its old VMM's connections.
//! A port in the sandbox's `httpsPorts` is spoken to over TLS
//! ([`super::guest_tls`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use vmm_driver::vsock_connect::{self, VsockConnectError};

/// Idle connections kept per guest port; more are closed when they finish.
const IDLE_PER_PORT: usize = 8;
/// Every this many kept connections, those of gone VMMs are forgotten.
const SWEEP_EVERY: u32 = 256;
/// How long a kept connection is used for after its last request started.
/// The guest agent closes connections idle for 30 s; a request sent as it
/// closes one would be lost, so ours are dropped well before.
const IDLE_LIMIT: Duration = Duration::from_secs(15);

/// The VMM's socket, the guest port, whether over TLS.
type Key = (PathBuf, u32, bool);

#[derive(Debug)]
struct Kept {
    sender: SendRequest<Body>,
    used: Instant,
}

impl Kept {
    fn usable(&self, limit: Duration) -> bool {
        !self.sender.is_closed() && self.used.elapsed() < limit
    }
}

#[derive(Debug)]
pub struct GuestConnections {
    idle: Mutex<HashMap<Key, Vec<Kept>>>,
    puts: AtomicU32,
    idle_limit: Duration,
    connect_patience: Duration,
    /// Made at the first request to an HTTPS port.
    tls: OnceLock<Result<Arc<rustls::ClientConfig>, String>>,
}

impl Default for GuestConnections {
    fn default() -> Self {
        Self::with_idle_limit(IDLE_LIMIT)
    }
}

/// How long a request tries new connections to a guest port that does not
/// take them (see [`transient`]): as long as the node waits before it calls
/// a silent guest unresponsive, so a slow guest is waited for and a stuck
/// one is not.
const CONNECT_PATIENCE: Duration = crate::node::sandbox::STUCK_AFTER;
/// The pause after the first failed try, doubled after each up to the
/// longest.
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(50);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// Why a request did not reach the guest.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(transparent)]
    Connect(#[from] VsockConnectError),
    #[error("{0}")]
    Http(#[from] hyper::Error),
    /// TLS to an HTTPS port (`httpsPorts`) failed.
    #[error("TLS to the guest port: {0}")]
    Tls(std::io::Error),
    /// New connections kept failing before the request went out.
    #[error("no connection taken in {waited:?} ({tries} tries; the last: {last})")]
    Gave {
        tries: u32,
        waited: Duration,
        last: Box<ForwardError>,
    },
}

/// What one try on a new connection came to.
enum Fresh {
    Answered(hyper::Response<hyper::body::Incoming>, SendRequest<Body>),
    /// The request did not reach the guest's server: it may go again.
    Unsent(Request, ForwardError),
    /// Final; with the request when it never went out.
    Failed(ForwardError, Option<Request>),
}

/// A request the guest did not answer: why, and the request itself when it
/// never went out (its body maybe not read yet: see `proxy::forward`).
#[derive(Debug)]
pub struct Unanswered {
    pub error: ForwardError,
    pub unsent: Option<Request>,
}

impl Unanswered {
    fn sent(error: ForwardError) -> Unanswered {
        Unanswered {
            error,
            unsent: None,
        }
    }
}

/// Whether a failed connect may succeed if tried again: the VMM closed the
/// stream after `CONNECT` (its guest answered neither yes nor no in time,
/// or refused while its backlog was full), the handshake broke, or the
/// VMM's socket was busy. A VMM that is gone (no socket, nobody listening)
/// and a guest port its agent reports closed are final.
fn transient(e: &VsockConnectError) -> bool {
    match e {
        VsockConnectError::Refused(_)
        | VsockConnectError::Io { .. }
        | VsockConnectError::Timeout(..) => true,
        VsockConnectError::Connect { source, .. } => {
            source.kind() == std::io::ErrorKind::WouldBlock
        }
        VsockConnectError::BadReply(_)
        | VsockConnectError::BadHttp(_)
        | VsockConnectError::TcpRefused { .. } => false,
    }
}

impl GuestConnections {
    fn with_idle_limit(idle_limit: Duration) -> Self {
        GuestConnections {
            idle: Mutex::default(),
            puts: AtomicU32::new(0),
            idle_limit,
            connect_patience: CONNECT_PATIENCE,
            tls: OnceLock::new(),
        }
    }

    /// Sends `req` to `port` behind the vsock socket `uds` (over TLS when
    /// `tls`), on an idle connection when one is ready, else on a new one.
    pub async fn send(
        &self,
        uds: &Path,
        port: u32,
        tls: bool,
        mut req: Request,
    ) -> Result<hyper::Response<hyper::body::Incoming>, Unanswered> {
        let key = (uds.to_owned(), port, tls);
        while let Some(mut sender) = self.take_idle(&key) {
            let replay = replayable(&req);
            match sender.try_send_request(req).await {
                Ok(response) => {
                    self.put_back(key, sender);
                    return Ok(response);
                }
                // The guest closed it as we took it. Not sent: safe to send
                // again, even a POST. Sent: only a request without effects
                // or body can go again; for the rest the guest may have
                // acted on it, and the caller gets the error.
                Err(mut e) => match (e.take_message(), replay) {
                    (Some(unsent), _) => req = unsent,
                    (None, Some(again)) => req = again,
                    (None, None) => return Err(Unanswered::sent(e.into_error().into())),
                },
            }
        }
        // A new connection. A guest still busy (a fork child among many
        // starting, a loaded node) may not take it in time, or may drop it
        // before reading the request: nothing reached the guest's server,
        // so the request is sent again on another, up to a bounded wait.
        let deadline = Instant::now() + self.connect_patience;
        let mut pause = FIRST_RETRY_PAUSE;
        let mut tries = 1u32;
        loop {
            let error = match self.send_fresh(uds, port, tls, req).await {
                Fresh::Answered(response, sender) => {
                    self.put_back(key, sender);
                    return Ok(response);
                }
                Fresh::Failed(error, unsent) => return Err(Unanswered { error, unsent }),
                Fresh::Unsent(unsent, e) => {
                    req = unsent;
                    e
                }
            };
            if Instant::now() + pause >= deadline {
                return Err(Unanswered {
                    error: ForwardError::Gave {
                        tries,
                        waited: self.connect_patience,
                        last: Box::new(error),
                    },
                    unsent: Some(req),
                });
            }
            tracing::debug!(
                "proxy: {} port {port}: try {tries} not taken ({error}); again in {pause:?}",
                uds.display()
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
            tries += 1;
        }
    }

    /// One try of `req` on a new connection.
    async fn send_fresh(&self, uds: &Path, port: u32, tls: bool, req: Request) -> Fresh {
        let stream = match open(uds, port).await {
            Ok(stream) => stream,
            Err(e) if transient(&e) => return Fresh::Unsent(req, e.into()),
            Err(e) => return Fresh::Failed(e.into(), Some(req)),
        };
        let handshake = match tls {
            false => handshake(stream).await,
            true => {
                let config = match self.tls_config() {
                    Ok(config) => config,
                    Err(e) => return Fresh::Failed(e, Some(req)),
                };
                match super::guest_tls::connect(config, stream).await {
                    Ok(stream) => handshake(stream).await,
                    // What rustls refused (a server speaking plain HTTP, no
                    // common cipher) is final; a connection the guest
                    // dropped before its answer may be tried again.
                    Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                        return Fresh::Failed(ForwardError::Tls(e), Some(req));
                    }
                    Err(e) => return Fresh::Unsent(req, ForwardError::Tls(e)),
                }
            }
        };
        let mut sender = match handshake {
            Ok(sender) => sender,
            Err(e) => return Fresh::Unsent(req, e.into()),
        };
        let replay = replayable(&req);
        match sender.try_send_request(req).await {
            Ok(response) => Fresh::Answered(response, sender),
            // Closed before the request went out (a guest resetting its
            // connections just after a restore): safe to send again.
            Err(mut e) => match (e.take_message(), replay) {
                (Some(unsent), _) => Fresh::Unsent(unsent, e.into_error().into()),
                (None, Some(again)) => Fresh::Unsent(again, e.into_error().into()),
                (None, None) => Fresh::Failed(e.into_error().into(), None),
            },
        }
    }

    fn tls_config(&self) -> Result<Arc<rustls::ClientConfig>, ForwardError> {
        self.tls
            .get_or_init(|| super::guest_tls::client_config().map_err(|e| e.to_string()))
            .clone()
            .map_err(|e| ForwardError::Tls(std::io::Error::other(e)))
    }

    /// A connection of `key` ready for a request. Busy ones (a response
    /// still streaming) stay; closed and stale ones go.
    fn take_idle(&self, key: &Key) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let kept = idle.get_mut(key)?;
        kept.retain(|k| k.usable(self.idle_limit));
        let ready = kept.iter().position(|k| k.sender.is_ready());
        let taken = ready.map(|i| kept.swap_remove(i).sender);
        if kept.is_empty() {
            idle.remove(key);
        }
        taken
    }

    /// Keeps `sender` for later requests (it becomes ready once the response
    /// it carries has been read to the end), and now and then forgets the
    /// connections of VMMs that are gone.
    fn put_back(&self, key: Key, sender: SendRequest<Body>) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if self
            .puts
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(SWEEP_EVERY)
        {
            idle.retain(|_, kept| {
                kept.retain(|k| k.usable(self.idle_limit));
                !kept.is_empty()
            });
        }
        let kept = idle.entry(key).or_default();
        if kept.len() < IDLE_PER_PORT {
            kept.push(Kept {
                sender,
                used: Instant::now(),
            });
        }
    }

    /// Connections kept, open or not (for tests).
    pub fn kept(&self) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.values().map(Vec::len).sum()
    }
}

/// A new stream to a guest port: envd's vsock port directly, any other
/// through the agent's TCP forwarder (servers in the guest listen on TCP).
/// HTTP/1 on a new connection, served on its own task.
async fn handshake<S>(stream: S) -> Result<SendRequest<Body>, hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        // With upgrades: a 101 answer hands the stream to the proxy
        // (WebSockets and the like) instead of closing it.
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!("proxied connection: {e}");
        }
    });
    Ok(sender)
}

async fn open(uds: &Path, port: u32) -> Result<tokio::net::UnixStream, VsockConnectError> {
    if port == envd_proto::PORT {
        return vsock_connect::connect(uds, port).await;
    }
    match u16::try_from(port) {
        Ok(tcp) => vsock_connect::connect_guest_tcp(uds, tcp).await,
        Err(_) => Err(VsockConnectError::TcpRefused {
            port,
            reason: "not a TCP port".into(),
        }),
    }
}

/// A copy of `req` to send again if a kept connection fails under it: only
/// for a safe method (RFC 9110) without a body.
fn replayable(req: &Request) -> Option<Request> {
    use hyper::body::Body as _;
    let safe = matches!(
        *req.method(),
        hyper::Method::GET | hyper::Method::HEAD | hyper::Method::OPTIONS
    );
    if !safe || req.body().size_hint().exact() != Some(0) {
        return None;
    }
    let mut copy = Request::new(Body::empty());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    use http_body_util::BodyExt;
    use hyper::service::service_fn;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    use tokio::net::UnixListener;
    use tokio::sync::Notify;

    use super::*;

    /// A VMM's vsock socket with an HTTP server behind the handshake that
    /// answers each request with its path; counts the connections, and ends
    /// them all (as a vsock reset does) when `reset` is notified.
    struct FakeGuest {
        uds: PathBuf,
        accepted: Arc<AtomicUsize>,
        reset: Arc<Notify>,
    }

    /// What the fake guest does with its first connections.
    #[derive(Clone, Copy)]
    enum Busy {
        /// Takes every connection.
        No,
        /// The VMM closes the first this many after `CONNECT` (a guest that
        /// did not answer its vsock request in time).
        Refuses(usize),
        /// The first this many are taken and closed before the request is
        /// read (a guest resetting its connections just after a restore).
        Drops(usize),
    }

    impl FakeGuest {
        fn start(dir: &Path) -> FakeGuest {
            Self::start_busy(dir, Busy::No)
        }

        fn start_busy(dir: &Path, busy: Busy) -> FakeGuest {
            let uds = dir.join("vsock.sock");
            let listener = UnixListener::bind(&uds).unwrap();
            let accepted = Arc::new(AtomicUsize::new(0));
            let reset = Arc::new(Notify::new());
            let (count, ends) = (accepted.clone(), reset.clone());
            tokio::spawn(async move {
                let mut seen = 0;
                while let Ok((stream, _)) = listener.accept().await {
                    seen += 1;
                    let refuse = matches!(busy, Busy::Refuses(n) if seen <= n);
                    let drop_it = matches!(busy, Busy::Drops(n) if seen <= n);
                    if !refuse {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                    let ends = ends.clone();
                    tokio::spawn(async move {
                        let mut stream = BufReader::new(stream);
                        let mut line = String::new();
                        stream.read_line(&mut line).await.unwrap();
                        assert_eq!(line, "CONNECT 49983\n");
                        if refuse {
                            return;
                        }
                        if drop_it {
                            let mut stream = stream.into_inner();
                            stream.write_all(b"OK 1073741824\n").await.unwrap();
                            return;
                        }
                        stream
                            .get_mut()
                            .write_all(b"OK 1073741824\n")
                            .await
                            .unwrap();
                        let serve = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream.into_inner()), service_fn(answer))
                            .with_upgrades();
                        tokio::select! {
                            _ = serve => {}
                            () = ends.notified() => {}
                        }
                    });
                }
            });
            FakeGuest {
                uds,
                accepted,
                reset,
            }
        }

        fn accepted(&self) -> usize {
            self.accepted.load(Ordering::SeqCst)
        }
    }

    /// The fake guest's answers: its path; `/slow` after 200 ms; `/echo`
    /// switches protocols and echoes what comes.
    async fn answer(
        mut req: hyper::Request<hyper::body::Incoming>,
    ) -> Result<hyper::Response<Body>, Infallible> {
        match req.uri().path() {
            "/slow" => tokio::time::sleep(Duration::from_millis(200)).await,
            "/stream" => return Ok(hyper::Response::new(Body::new(Ticks::new()))),
            "/echo" => {
                let upgrade = hyper::upgrade::on(&mut req);
                tokio::spawn(async move {
                    let mut io = TokioIo::new(upgrade.await.unwrap());
                    let mut buf = [0u8; 64];
                    while let Ok(n @ 1..) = io.read(&mut buf).await {
                        io.write_all(&buf[..n]).await.unwrap();
                    }
                });
                let switched = hyper::Response::builder()
                    .status(101)
                    .header("connection", "upgrade")
                    .header("upgrade", "echo")
                    .body(Body::empty())
                    .unwrap();
                return Ok(switched);
            }
            _ => {}
        }
        Ok(hyper::Response::new(Body::from(
            req.uri().path().to_owned(),
        )))
    }

    /// A response body of 10 chunks, one every 30 ms.
    struct Ticks {
        sent: u32,
        sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    }

    impl Ticks {
        fn new() -> Self {
            Ticks {
                sent: 0,
                sleep: Box::pin(tokio::time::sleep(Duration::from_millis(30))),
            }
        }
    }

    impl hyper::body::Body for Ticks {
        type Data = bytes::Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Infallible>>> {
            if self.sent == 10 {
                return std::task::Poll::Ready(None);
            }
            std::task::ready!(self.sleep.as_mut().poll(cx));
            self.sent += 1;
            let next = tokio::time::Instant::now() + Duration::from_millis(30);
            self.sleep.as_mut().reset(next);
            let tick = format!("tick{};", self.sent);
            std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(tick.into()))))
        }
    }

    fn get(path: &str) -> Request {
        Request::builder()
            .uri(path)
            .header("host", "guest")
            .body(Body::empty())
            .unwrap()
    }

    async fn fetch(guests: &GuestConnections, uds: &Path, path: &str) -> String {
        let response = guests.send(uds, 49983, false, get(path)).await.unwrap();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn sequential_requests_share_one_connection_and_concurrent_ones_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let guest = FakeGuest::start(dir.path());
        let guests = GuestConnections::default();
        for i in 0..3 {
            assert_eq!(
                fetch(&guests, &guest.uds, &format!("/r{i}")).await,
                format!("/r{i}")
            );
        }
        assert_eq!(guest.accepted(), 1);

        // A request waiting for its answer keeps its connection busy.
        let (slow, quick) = tokio::join!(
            fetch(&guests, &guest.uds, "/slow"),
            fetch(&guests, &guest.uds, "/quick")
        );
        assert_eq!((slow.as_str(), quick.as_str()), ("/slow", "/quick"));
        assert_eq!(guest.accepted(), 2);
        assert_eq!(guests.kept(), 2);
    }

    #[tokio::test]
    async fn connections_the_guest_ended_are_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let guest = FakeGuest::start(dir.path());
        let guests = GuestConnections::default();
        for round in 1..=20 {
            assert_eq!(fetch(&guests, &guest.uds, "/x").await, "/x");
            guest.reset.notify_waiters();
            // No pause: the next request may find the connection closing.
            assert_eq!(fetch(&guests, &guest.uds, "/y").await, "/y");
            assert_eq!(guest.accepted(), 2 * round);
            guest.reset.notify_waiters();
        }
    }

    /// A guest too busy to take its first connections (a fork child among
    /// many starting) gets the request once it takes one: not a "port is
    /// not open" for a port its agent listens on.
    #[tokio::test]
    async fn a_guest_slow_to_take_connections_is_waited_for() {
        for busy in [Busy::Refuses(3), Busy::Drops(3)] {
            let dir = tempfile::tempdir().unwrap();
            let guest = FakeGuest::start_busy(dir.path(), busy);
            let guests = GuestConnections::default();
            let post = Request::builder()
                .method("POST")
                .uri("/process.Process/Start")
                .header("host", "guest")
                .body(Body::from("a command"))
                .unwrap();
            let answer = guests.send(&guest.uds, 49983, false, post).await.unwrap();
            let bytes = answer.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&bytes[..], b"/process.Process/Start");
        }
    }

    /// A guest that never takes a connection ends the wait, with an error
    /// that says so.
    #[tokio::test]
    async fn a_guest_that_never_takes_a_connection_is_given_up() {
        let dir = tempfile::tempdir().unwrap();
        let guest = FakeGuest::start_busy(dir.path(), Busy::Refuses(usize::MAX));
        let guests = GuestConnections {
            connect_patience: Duration::from_millis(500),
            ..GuestConnections::default()
        };
        let started = Instant::now();
        let e = guests
            .send(&guest.uds, 49983, false, get("/x"))
            .await
            .unwrap_err();
        assert!(e.unsent.is_some());
        let e = e.error;
        assert!(started.elapsed() >= Duration::from_millis(300), "{e}");
        assert!(matches!(e, ForwardError::Gave { tries: 2.., .. }), "{e}");
        assert!(e.to_string().contains("nothing accepted"), "{e}");
        // A VMM that is gone is final at once.
        let started = Instant::now();
        let gone = dir.path().join("gone.sock");
        let e = guests
            .send(&gone, 49983, false, get("/x"))
            .await
            .unwrap_err()
            .error;
        assert!(matches!(
            e,
            ForwardError::Connect(VsockConnectError::Connect { .. })
        ));
        assert!(started.elapsed() < Duration::from_millis(300));
    }

    #[tokio::test]
    async fn stale_connections_are_not_reused() {
        let dir = tempfile::tempdir().unwrap();
        let guest = FakeGuest::start(dir.path());
        let guests = GuestConnections::with_idle_limit(Duration::from_millis(50));
        assert_eq!(fetch(&guests, &guest.uds, "/x").await, "/x");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(fetch(&guests, &guest.uds, "/y").await, "/y");
        assert_eq!(guest.accepted(), 2);
    }

    /// A response that streams for longer than the kept-connection limit is
    /// not cut when the pool forgets its connection meanwhile (other requests
    /// purge stale entries, dropping the busy connection's sender).
    #[tokio::test]
    async fn a_stream_outlives_the_idle_limit_of_its_connection() {
        let dir = tempfile::tempdir().unwrap();
        let guest = FakeGuest::start(dir.path());
        let guests = GuestConnections::with_idle_limit(Duration::from_millis(50));
        let stream = fetch(&guests, &guest.uds, "/stream");
        let others = async {
            for i in 0..5 {
                tokio::time::sleep(Duration::from_millis(60)).await;
                assert_eq!(
                    fetch(&guests, &guest.uds, &format!("/o{i}")).await,
                    format!("/o{i}")
                );
            }
        };
        let (streamed, ()) = tokio::join!(stream, others);
        let want: String = (1..=10).map(|i| format!("tick{i};")).collect();
        assert_eq!(streamed, want);
    }

    #[tokio::test]
    async fn an_upgraded_connection_carries_the_stream_and_is_not_reused() {
        let dir = tempfile::tempdir().unwrap();
        let guest = FakeGuest::start(dir.path());
        let guests = GuestConnections::default();
        let req = Request::builder()
            .uri("/echo")
            .header("host", "guest")
            .header("connection", "upgrade")
            .header("upgrade", "echo")
            .body(Body::empty())
            .unwrap();
        let mut switched = guests.send(&guest.uds, 49983, false, req).await.unwrap();
        assert_eq!(switched.status(), 101);
        let mut io = TokioIo::new(hyper::upgrade::on(&mut switched).await.unwrap());
        io.write_all(b"over the upgrade").await.unwrap();
        let mut echoed = [0u8; 16];
        io.read_exact(&mut echoed).await.unwrap();
        assert_eq!(&echoed, b"over the upgrade");
        // The next request needs a connection of its own.
        assert_eq!(fetch(&guests, &guest.uds, "/after").await, "/after");
        assert_eq!(guest.accepted(), 2);
    }

    /// The test certificate's server side (`testdata/`: self-signed for
    /// `localhost`, made with openssl for these tests).
    fn tls_acceptor() -> tokio_rustls::TlsAcceptor {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let cert =
            CertificateDer::from_pem_slice(include_bytes!("testdata/guest-tls.crt")).unwrap();
        let key = PrivateKeyDer::from_pem_slice(include_bytes!("testdata/guest-tls.key")).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }

    /// A port in `httpsPorts` is spoken to over TLS, its self-signed
    /// certificate taken, its connections kept as plain ones; TLS to a
    /// server that speaks plain HTTP fails at once, saying so.
    #[tokio::test]
    async fn an_https_port_is_reached_over_tls_whatever_its_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("tls.sock");
        let listener = UnixListener::bind(&uds).unwrap();
        let acceptor = tls_acceptor();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let mut stream = BufReader::new(stream);
                    let mut line = String::new();
                    stream.read_line(&mut line).await.unwrap();
                    stream
                        .get_mut()
                        .write_all(b"OK 1073741824\n")
                        .await
                        .unwrap();
                    // Nothing buffered past the line: TLS starts after it.
                    let Ok(tls) = acceptor.accept(stream.into_inner()).await else {
                        return;
                    };
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service_fn(answer))
                        .await;
                });
            }
        });
        let guests = GuestConnections::default();
        for path in ["/over-tls", "/again"] {
            let response = guests.send(&uds, 49983, true, get(path)).await.unwrap();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&bytes[..], path.as_bytes());
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);

        let plain = FakeGuest::start(dir.path());
        let started = Instant::now();
        let e = guests
            .send(&plain.uds, 49983, true, get("/x"))
            .await
            .unwrap_err();
        assert!(matches!(e.error, ForwardError::Tls(_)), "{}", e.error);
        assert!(e.unsent.is_some());
        assert!(started.elapsed() < Duration::from_secs(2), "{}", e.error);
    }
}
