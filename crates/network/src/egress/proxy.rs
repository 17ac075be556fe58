//! The egress proxy: one pair of listeners for the whole node (HTTP and TLS), async on the
//! server's tokio runtime. Every connection gets a bounded head read (size and time), one
//! policy decision, and then a byte splice to the guest's original destination. A name
//! counts only at an address the node's DNS forwarder gave this sandbox for it
//! ([`Answers`]), so an allowed Host or SNI does not open any other address.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinHandle;

use super::{Parse, http, sni};
use crate::dns::Answers;
use crate::error::{Error, Result};
use crate::plan::Cidr4;
use crate::policy::EgressPolicy;

/// How long a guest has to send its request head or ClientHello.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the proxy tries to reach the destination.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections through the proxy at once, per sandbox; past it new ones are closed.
const MAX_PER_SANDBOX: usize = 256;

/// What the proxy needs to know about the sandbox behind a slot host address.
#[derive(Clone, Debug)]
pub struct ProxyTarget {
    /// Its policy now.
    pub policy: EgressPolicy,
    /// Its slot's namespace anchor (where its conntrack is).
    pub netns: PathBuf,
}

/// Maps a connection's source (a slot's host address) to its sandbox; None: not a
/// sandbox's, closed.
pub type TargetLookup = dyn Fn(Ipv4Addr) -> Option<ProxyTarget> + Send + Sync;

/// Counters, for the log and tests.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Connections spliced to their destination.
    pub allowed: AtomicU64,
    /// Connections refused by the policy or the always-deny list.
    pub denied: AtomicU64,
    /// Connections closed for what they sent (not HTTP/TLS, too big, too slow), for not
    /// being a sandbox's, or for an unknown original destination.
    pub dropped: AtomicU64,
    /// Allowed connections whose destination could not be reached.
    pub unreachable: AtomicU64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Http,
    Tls,
}

struct Shared {
    lookup: Arc<TargetLookup>,
    always_deny: Vec<Cidr4>,
    /// What the DNS forwarder answered each sandbox.
    answers: Arc<Answers>,
    /// Where outgoing connections are made; None: the process's namespace.
    netns: Option<PathBuf>,
    stats: Arc<ProxyStats>,
    open: Mutex<HashMap<Ipv4Addr, usize>>,
    /// Whether a conntrack failure was reported already.
    warned: std::sync::atomic::AtomicBool,
}

/// A running proxy; its listeners close when it is dropped (spliced connections run on to
/// their end).
#[derive(Debug)]
pub struct EgressProxy {
    http: SocketAddr,
    tls: SocketAddr,
    stats: Arc<ProxyStats>,
    tasks: Vec<JoinHandle<()>>,
}

impl EgressProxy {
    /// Listens on `http` and `tls` and serves on the current tokio runtime; a name reaches
    /// only the addresses `answers` holds for it and the sandbox. `netns`: the namespace
    /// to listen and connect in (tests); None: the process's.
    pub fn start(
        http: SocketAddrV4,
        tls: SocketAddrV4,
        lookup: Arc<TargetLookup>,
        always_deny: Vec<Cidr4>,
        answers: Arc<Answers>,
        netns: Option<PathBuf>,
    ) -> Result<EgressProxy> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::sys("egress proxy: no tokio runtime", std::io::Error::other(e)))?;
        let bind = |addr: SocketAddrV4| -> Result<std::net::TcpListener> {
            let listen = move || {
                std::net::TcpListener::bind(addr)
                    .map_err(|e| Error::sys(format!("bind egress proxy {addr}"), e))
            };
            let l = match &netns {
                Some(ns) => crate::run_in_netns(ns, listen)?,
                None => listen()?,
            };
            l.set_nonblocking(true)
                .map_err(|e| Error::sys("egress proxy nonblocking", e))?;
            Ok(l)
        };
        let (lh, lt) = (bind(http)?, bind(tls)?);
        let local = |l: &std::net::TcpListener| {
            l.local_addr()
                .map_err(|e| Error::sys("egress proxy address", e))
        };
        let (http, tls) = (local(&lh)?, local(&lt)?);
        let stats = Arc::new(ProxyStats::default());
        let shared = Arc::new(Shared {
            lookup,
            always_deny,
            answers,
            netns,
            stats: stats.clone(),
            open: Mutex::new(HashMap::new()),
            warned: Default::default(),
        });
        let _enter = runtime.enter();
        let mut tasks = Vec::new();
        for (l, kind) in [(lh, Kind::Http), (lt, Kind::Tls)] {
            let l = TcpListener::from_std(l).map_err(|e| Error::sys("egress proxy listener", e))?;
            tasks.push(runtime.spawn(accept_loop(l, kind, shared.clone())));
        }
        Ok(EgressProxy {
            http,
            tls,
            stats,
            tasks,
        })
    }

    /// Where it listens for HTTP (the port, when started on port 0).
    pub fn http_addr(&self) -> SocketAddr {
        self.http
    }

    pub fn tls_addr(&self) -> SocketAddr {
        self.tls
    }

    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn accept_loop(l: TcpListener, kind: Kind, shared: Arc<Shared>) {
    loop {
        let (conn, peer) = match l.accept().await {
            Ok(c) => c,
            Err(_) => {
                // Out of fds, most likely: wait rather than spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (SocketAddr::V4(peer), Ok(SocketAddr::V4(local))) = (peer, conn.local_addr()) else {
            continue;
        };
        let Some(slot) = Held::take(&shared, *peer.ip()) else {
            shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            serve(conn, peer, local, kind, &shared).await;
            drop(slot);
        });
    }
}

/// One of a sandbox's connection slots, given back when dropped.
struct Held {
    shared: Arc<Shared>,
    ip: Ipv4Addr,
}

impl Held {
    fn take(shared: &Arc<Shared>, ip: Ipv4Addr) -> Option<Held> {
        let mut open = shared.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_default();
        if *n >= MAX_PER_SANDBOX {
            return None;
        }
        *n += 1;
        Some(Held {
            shared: shared.clone(),
            ip,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut open = self.shared.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// What the proxy made of one connection.
enum Outcome {
    Allowed,
    Denied,
    Dropped,
    Unreachable,
}

async fn serve(
    mut conn: TcpStream,
    peer: SocketAddrV4,
    local: SocketAddrV4,
    kind: Kind,
    shared: &Shared,
) {
    let outcome = decide_and_splice(&mut conn, peer, local, kind, shared).await;
    let counter = match outcome {
        Outcome::Allowed => &shared.stats.allowed,
        Outcome::Denied => &shared.stats.denied,
        Outcome::Dropped => &shared.stats.dropped,
        Outcome::Unreachable => &shared.stats.unreachable,
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

async fn decide_and_splice(
    conn: &mut TcpStream,
    peer: SocketAddrV4,
    local: SocketAddrV4,
    kind: Kind,
    shared: &Shared,
) -> Outcome {
    let Some(target) = (shared.lookup)(*peer.ip()) else {
        return Outcome::Dropped;
    };
    // The guest's intended destination, from its slot's conntrack: the reply direction
    // runs from this socket's address to the slot's host address.
    let netns = target.netns.clone();
    let original =
        tokio::task::spawn_blocking(move || crate::conntrack::tcp_original_in(&netns, local, peer))
            .await;
    let dst = match original {
        Ok(Ok((_, dst))) => dst,
        Ok(Err(e)) => {
            // Once: without ctnetlink (module nf_conntrack_netlink) no connection can pass.
            if !shared.warned.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "sandfork-network: egress proxy: no original destination from the slot's \
                     conntrack ({e}); is nf_conntrack_netlink loaded?"
                );
            }
            return Outcome::Dropped;
        }
        Err(_) => return Outcome::Dropped,
    };
    let head = tokio::time::timeout(HEAD_TIMEOUT, read_head(conn, kind)).await;
    let Ok(Some((head, host))) = head else {
        return Outcome::Dropped;
    };
    // The name counts only where the forwarder sent this sandbox for it.
    let answered = host
        .as_deref()
        .filter(|h| shared.answers.answered(*peer.ip(), h, *dst.ip()));
    if !target
        .policy
        .permits_named(*dst.ip(), answered, &shared.always_deny)
    {
        let elsewhere = answered.is_none()
            && target
                .policy
                .permits_named(*dst.ip(), host.as_deref(), &shared.always_deny);
        let why = match (&host, elsewhere) {
            (Some(h), true) => Refused::NotAnswered(h, *dst.ip()),
            (h, _) => Refused::Name(h.as_deref()),
        };
        let _ = conn.write_all(&refusal(kind, why)).await;
        let _ = conn.shutdown().await;
        return Outcome::Denied;
    }
    let upstream = tokio::time::timeout(CONNECT_TIMEOUT, dial(dst, shared.netns.clone())).await;
    let Ok(Ok(mut upstream)) = upstream else {
        return Outcome::Unreachable;
    };
    let _ = upstream.set_nodelay(true);
    let _ = conn.set_nodelay(true);
    if upstream.write_all(&head).await.is_err() {
        return Outcome::Unreachable;
    }
    let _ = tokio::io::copy_bidirectional(conn, &mut upstream).await;
    Outcome::Allowed
}

/// Reads until the request head or ClientHello is whole: (the bytes read, the name they
/// carry); None for EOF, an error, or what the readers refuse.
async fn read_head(conn: &mut TcpStream, kind: Kind) -> Option<(Vec<u8>, Option<String>)> {
    let max = match kind {
        Kind::Http => http::MAX_HEAD,
        Kind::Tls => sni::MAX_READ,
    };
    let mut buf = Vec::with_capacity(2048);
    loop {
        if buf.len() >= max {
            return None;
        }
        let mut chunk = [0u8; 4096];
        let want = chunk.len().min(max - buf.len());
        let n = conn.read(&mut chunk[..want]).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        let parsed = match kind {
            Kind::Http => http::request_host(&buf),
            Kind::Tls => sni::server_name(&buf),
        };
        match parsed {
            Parse::Done(host) => return Some((buf, host)),
            Parse::NeedMore => {}
            Parse::Invalid => return None,
        }
    }
}

/// Why a connection is refused.
enum Refused<'a> {
    /// The rules do not allow the name (or there is none).
    Name(Option<&'a str>),
    /// They do, but the node's DNS never gave this sandbox that address for it.
    NotAnswered(&'a str, Ipv4Addr),
}

/// What a refused client is told: a 403 over HTTP, a fatal `unrecognized_name` alert over
/// TLS.
fn refusal(kind: Kind, why: Refused<'_>) -> Vec<u8> {
    match kind {
        Kind::Http => {
            let body = match why {
                Refused::Name(host) => format!(
                    "sandfork: this sandbox's network rules do not allow {}\n",
                    host.unwrap_or("this destination")
                ),
                Refused::NotAnswered(host, ip) => format!(
                    "sandfork: {host} is allowed, but {ip} is not an address this sandbox's DNS \
                     gave for it\n"
                ),
            };
            format!(
                "HTTP/1.1 403 Forbidden\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
        Kind::Tls => vec![21, 3, 3, 0, 2, 2, 112],
    }
}

/// A TCP connection to `dst`, its socket made in `netns` when given.
async fn dial(dst: SocketAddrV4, netns: Option<PathBuf>) -> std::io::Result<TcpStream> {
    let socket = match netns {
        None => TcpSocket::new_v4()?,
        Some(ns) => {
            let std = tokio::task::spawn_blocking(move || {
                crate::run_in_netns(&ns, || {
                    let fd = nix::sys::socket::socket(
                        nix::sys::socket::AddressFamily::Inet,
                        nix::sys::socket::SockType::Stream,
                        nix::sys::socket::SockFlag::SOCK_CLOEXEC
                            | nix::sys::socket::SockFlag::SOCK_NONBLOCK,
                        None,
                    )
                    .map_err(|e| Error::sys("socket", e))?;
                    Ok(std::net::TcpStream::from(fd))
                })
            })
            .await
            .map_err(std::io::Error::other)?
            .map_err(std::io::Error::other)?;
            TcpSocket::from_std_stream(std)
        }
    };
    socket.connect(SocketAddr::V4(dst)).await
}
