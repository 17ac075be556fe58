//! Network namespaces for the networking lab tests: a sandbox "slot" (the
//! namespace a VMM runs in, with the tap `tap0` at the fixed gateway address) and
//! a "fake internet" with a web server on a TEST-NET address.
//!
//! No veth, routing or NAT (the lab kernel has no veth module and the lab no
//! `nft`): a slot reaches the internet through a userspace relay the test runs.
//! The internet's address is on the slot's `lo`, so the guest's packets to it go
//! through the tap as to any outside address; the relay accepts them in the slot
//! and connects on from the slot's own source address inside the internet
//! namespace, standing in for the per-slot SNAT of production.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;

/// The fixed addressing every sandbox has (the guest agent configures eth0).
pub const GUEST_IP: &str = "169.254.0.21";
pub const GATEWAY_IP: &str = "169.254.0.22";
pub const GUEST_MAC: &str = "02:fc:00:00:00:05";
pub const TAP_MAC: &str = "02:fc:00:00:00:06";
pub const TAP: &str = "tap0";
/// The fake internet's web server.
pub const SERVER_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);

/// A network namespace held by a descriptor; gone when dropped and unused.
pub struct NetNs {
    fd: OwnedFd,
}

impl NetNs {
    pub fn new() -> NetNs {
        let fd = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(NEWNET)");
            OwnedFd::from(std::fs::File::open("/proc/thread-self/ns/net").unwrap())
        })
        .join()
        .unwrap();
        let ns = NetNs { fd };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// A path naming the namespace for as long as this process holds it.
    pub fn path(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.fd.as_raw_fd()
        ))
    }

    /// Runs `f` on a thread inside the namespace: sockets it makes stay there.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(self.fd.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("setns");
                f()
            })
            .join()
            .unwrap()
        })
    }

    pub fn ip(&self, args: &[&str]) {
        let status = self.run(|| Command::new("ip").args(args).status().expect("running ip"));
        assert!(status.success(), "ip {}: {status}", args.join(" "));
    }

    pub fn listen(&self, addr: SocketAddr) -> TcpListener {
        self.run(|| TcpListener::bind(addr).unwrap())
    }
}

/// The fake internet: a namespace with a web server at [`SERVER_IP`]:80 that
/// answers every request with the address it came from.
pub struct Internet {
    pub ns: NetNs,
}

impl Internet {
    pub fn start() -> Internet {
        let ns = NetNs::new();
        ns.ip(&["addr", "add", &format!("{SERVER_IP}/32"), "dev", "lo"]);
        let server = ns.listen(SocketAddr::from((SERVER_IP, 80)));
        std::thread::spawn(move || {
            for conn in server.incoming() {
                let Ok(mut conn) = conn else { continue };
                std::thread::spawn(move || {
                    let peer = conn.peer_addr().unwrap().ip();
                    let mut req = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body = format!("hello {peer}\n");
                    let _ = write!(
                        conn,
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                });
            }
        });
        Internet { ns }
    }
}

/// A sandbox's namespace: `tap0` (fixed MAC, the gateway address, up) for its
/// VMM, and a relay to the internet from `source` (this slot's public address).
pub struct Slot {
    pub ns: NetNs,
    pub source: Ipv4Addr,
}

impl Slot {
    pub fn new(internet: &Internet, index: u8) -> Slot {
        let ns = NetNs::new();
        ns.ip(&["tuntap", "add", "dev", TAP, "mode", "tap"]);
        ns.ip(&["link", "set", "dev", TAP, "address", TAP_MAC]);
        ns.ip(&["addr", "add", &format!("{GATEWAY_IP}/30"), "dev", TAP]);
        ns.ip(&["link", "set", TAP, "up"]);
        // The internet's address, local in the slot, so the relay can take it.
        ns.ip(&["addr", "add", &format!("{SERVER_IP}/32"), "dev", "lo"]);
        let source = Ipv4Addr::new(198, 51, 100, index);
        internet
            .ns
            .ip(&["addr", "add", &format!("{source}/32"), "dev", "lo"]);
        let listener = ns.listen(SocketAddr::from((SERVER_IP, 80)));
        let internet_fd = internet.ns.fd.try_clone().unwrap();
        std::thread::spawn(move || {
            let internet = NetNs { fd: internet_fd };
            for conn in listener.incoming() {
                let Ok(inside) = conn else { continue };
                let Some(outside) = internet.run(|| connect_from(source)) else {
                    continue;
                };
                relay(inside, outside);
            }
        });
        Slot { ns, source }
    }
}

fn connect_from(source: Ipv4Addr) -> Option<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    sock.bind(&SocketAddr::from((source, 0)).into()).ok()?;
    sock.connect(&SocketAddr::from((SERVER_IP, 80)).into())
        .ok()?;
    Some(sock.into())
}

/// Copies both ways until each side has closed its half.
fn relay(a: TcpStream, b: TcpStream) {
    let pipe = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = to.shutdown(std::net::Shutdown::Write);
        })
    };
    pipe(a.try_clone().unwrap(), b.try_clone().unwrap());
    pipe(b, a);
}
