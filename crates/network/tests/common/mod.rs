//! A private test world, all in namespaces the test makes: a "host" namespace (the pool's
//! host side) with an uplink to a fake "internet" namespace on TEST-NET addresses (web
//! servers on 203.0.113.10/.11, "forbidden" servers on 192.168.77.10 and 169.254.169.254), and
//! guest stand-ins: namespaces whose `eth0` is a tap bridged frame by frame to a slot's real
//! `tap0`, as a VMM would. Nothing touches the machine's own network.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use sandfork_network::dns::{read_framed, write_framed};
use sandfork_network::netns;
use sandfork_network::plan::{GATEWAY_IP, GUEST_IP, GUEST_MAC, TAP_NAME};
use sandfork_network::{HostConfig, PoolConfig, Slot};

pub const WEB_A: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const WEB_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 10);
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// The internet's DNS server (UDP 53): every A query is answered with [`DNS_ANSWER`].
pub const DNS_SERVER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
pub const DNS_ANSWER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const UPLINK: &str = "up0";
pub const HOST_UPLINK_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

/// Whether this process may make namespaces and program them; prints why a test is skipped.
pub fn privileged() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let need = (1u64 << 12) | (1u64 << 21); // CAP_NET_ADMIN, CAP_SYS_ADMIN
    if eff & need != need || !Path::new("/dev/net/tun").exists() {
        eprintln!("skipped: needs CAP_NET_ADMIN and CAP_SYS_ADMIN and /dev/net/tun (run as root)");
        return false;
    }
    // The scaffolding (not the code under test) sets up the test world with iproute2.
    let have = |tool: &str| Command::new(tool).arg("-V").output().is_ok();
    if !have("ip") || !have("nsenter") {
        eprintln!("skipped: the test world needs `ip` (iproute2) and `nsenter` (util-linux)");
        return false;
    }
    true
}

/// Runs `ip ARGS` inside the namespace anchored at `ns` (test scaffolding only).
fn nsenter_ip(ns: &Path, args: &str) -> std::process::Output {
    Command::new("nsenter")
        .arg(format!("--net={}", ns.display()))
        .arg("ip")
        .args(args.split_whitespace())
        .output()
        .expect("run nsenter ip")
}

/// `ip ARGS` inside the namespace anchored at `ns`, which must succeed.
pub fn ip(ns: &Path, args: &str) {
    let out = nsenter_ip(ns, args);
    assert!(
        out.status.success(),
        "ip {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What `ip ARGS` inside the namespace anchored at `ns` prints.
pub fn ip_out(ns: &Path, args: &str) -> String {
    String::from_utf8_lossy(&nsenter_ip(ns, args).stdout).into_owned()
}

fn new_ns(path: &Path) -> OwnedFd {
    netns::create_anchored(path, |_| Ok(()))
        .expect("make namespace")
        .1
}

/// A TCP server in a namespace: answers each connection's first line with
/// `"<name> <line> <peer>"`.
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    pub fn start(ns: &OwnedFd, addr: SocketAddrV4, name: &str) -> Server {
        let listener = netns::run_in(ns, || {
            TcpListener::bind(addr)
                .map_err(|e| sandfork_network::Error::Plan(format!("bind {addr}: {e}")))
        })
        .expect("listen");
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let name = name.to_string();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((c, peer)) => {
                        let name = name.clone();
                        std::thread::spawn(move || {
                            c.set_nonblocking(false).unwrap();
                            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                            let mut line = String::new();
                            let mut r = BufReader::new(&c);
                            if r.read_line(&mut line).is_ok() {
                                let mut answer = format!("{name} {} {peer}\n", line.trim());
                                if line.starts_with("mss") {
                                    // The MSS this end sends with: the peer's SYN decided it.
                                    let mss = nix::sys::socket::getsockopt(
                                        &c,
                                        nix::sys::socket::sockopt::TcpMaxSeg,
                                    )
                                    .unwrap_or(0);
                                    answer = format!("mss={mss}");
                                }
                                let _ = (&c).write_all(answer.as_bytes());
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Server {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sends `token` to `addr` from namespace `ns` and returns the answer, or None when the
/// connection fails or times out.
pub fn ask(
    ns: &OwnedFd,
    addr: SocketAddrV4,
    token: &str,
    source: Option<Ipv4Addr>,
) -> Option<String> {
    let token = token.to_string();
    netns::run_in(ns, move || {
        let s = match source {
            None => TcpStream::connect_timeout(&SocketAddr::V4(addr), Duration::from_millis(2500)),
            Some(src) => connect_from(src, addr),
        };
        let Ok(mut s) = s else { return Ok(None) };
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        if s.write_all(format!("{token}\n").as_bytes()).is_err() {
            return Ok(None);
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        Ok((!out.is_empty()).then(|| out.trim().to_string()))
    })
    .unwrap()
}

fn connect_from(src: Ipv4Addr, dst: SocketAddrV4) -> std::io::Result<TcpStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, socket};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(SocketAddrV4::new(src, 0)))?;
    let s = TcpStream::from(fd);
    // connect with a timeout: nonblocking connect, then wait for writability
    s.set_nonblocking(true)?;
    let r = nix::sys::socket::connect(s.as_raw_fd(), &SockaddrIn::from(dst));
    if let Err(e) = r
        && e != nix::Error::EINPROGRESS
    {
        return Err(e.into());
    }
    let mut fds = [nix::poll::PollFd::new(
        s.as_fd(),
        nix::poll::PollFlags::POLLOUT,
    )];
    let n = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(2500u16))?;
    if n == 0 {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    if let Some(e) = s.take_error()? {
        return Err(e);
    }
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Copies frames between two tap fds until stopped, as a VMM's virtio-net would.
struct Bridge {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Bridge {
    fn start(a: OwnedFd, b: OwnedFd) -> Bridge {
        let a = Arc::new(a);
        let b = Arc::new(b);
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for (from, to) in [(Arc::clone(&a), Arc::clone(&b)), (b, a)] {
            let stop = Arc::clone(&stop);
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    let mut fds = [nix::poll::PollFd::new(
                        from.as_fd(),
                        nix::poll::PollFlags::POLLIN,
                    )];
                    if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(50u8)).unwrap_or(0)
                        == 0
                    {
                        continue;
                    }
                    match nix::unistd::read(from.as_fd(), &mut buf) {
                        Ok(n) if n > 0 => {
                            let _ = nix::unistd::write(to.as_fd(), &buf[..n]);
                        }
                        _ => {}
                    }
                }
            }));
        }
        Bridge { stop, threads }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The answer of the test's DNS server to `query`: one A record, [`DNS_ANSWER`].
fn dns_answer(query: &[u8]) -> Option<Vec<u8>> {
    use hickory_proto::op::{Message, MessageType};
    use hickory_proto::rr::{RData, Record, rdata::A};
    let q = Message::from_vec(query).ok()?;
    let mut r = Message::new();
    r.set_id(q.id()).set_message_type(MessageType::Response);
    r.add_queries(q.queries().to_vec());
    let q0 = q.queries().first()?;
    r.add_answer(Record::from_rdata(
        q0.name().clone(),
        60,
        RData::A(A(DNS_ANSWER)),
    ));
    r.to_vec().ok()
}

/// A DNS server on `ip`:53 (UDP and TCP) in `ns` answering every query with one A record,
/// [`DNS_ANSWER`]; it lives as long as the test process (its threads block on the sockets).
pub fn dns_server(ns: &OwnedFd, ip: Ipv4Addr) {
    let err = |e: std::io::Error| sandfork_network::Error::Plan(format!("bind DNS: {e}"));
    let (sock, tcp) = netns::run_in(ns, || {
        Ok((
            std::net::UdpSocket::bind((ip, 53)).map_err(err)?,
            TcpListener::bind((ip, 53)).map_err(err)?,
        ))
    })
    .expect("test DNS server");
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, from)) = sock.recv_from(&mut buf) {
            if let Some(a) = dns_answer(&buf[..n]) {
                let _ = sock.send_to(&a, from);
            }
        }
    });
    std::thread::spawn(move || {
        for mut c in tcp.incoming().flatten() {
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            while let Some(q) = read_framed(&mut c) {
                let Some(a) = dns_answer(&q) else { break };
                if write_framed(&mut c, &a).is_err() {
                    break;
                }
            }
        }
    });
}

/// Resolves `name` (an A query, over UDP or TCP) from namespace `ns` through `server`:53:
/// the addresses answered, Err(response code) for an error answer, Err("timeout") for none.
pub fn resolve(ns: &OwnedFd, server: Ipv4Addr, name: &str) -> Result<Vec<Ipv4Addr>, String> {
    resolve_over(ns, server, name, false)
}

pub fn resolve_tcp(ns: &OwnedFd, server: Ipv4Addr, name: &str) -> Result<Vec<Ipv4Addr>, String> {
    resolve_over(ns, server, name, true)
}

fn resolve_over(
    ns: &OwnedFd,
    server: Ipv4Addr,
    name: &str,
    tcp: bool,
) -> Result<Vec<Ipv4Addr>, String> {
    use hickory_proto::op::{Message, Query, ResponseCode};
    use hickory_proto::rr::{Name, RData, RecordType};
    use std::str::FromStr;
    let mut m = Message::new();
    m.set_id(0x5f5f).set_recursion_desired(true);
    m.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
    let query = m.to_vec().unwrap();
    netns::run_in(ns, move || {
        let answer = if tcp {
            let to = SocketAddr::from((server, 53));
            TcpStream::connect_timeout(&to, Duration::from_secs(3))
                .ok()
                .and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                    write_framed(&mut s, &query).ok()?;
                    read_framed(&mut s)
                })
        } else {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            s.send_to(&query, (server, 53)).unwrap();
            let mut buf = [0u8; 1500];
            s.recv(&mut buf).ok().map(|n| buf[..n].to_vec())
        };
        let Some(answer) = answer else {
            return Ok(Err("timeout".to_string()));
        };
        let r = Message::from_vec(&answer).unwrap();
        assert_eq!(r.id(), 0x5f5f);
        if r.response_code() != ResponseCode::NoError {
            return Ok(Err(format!("{:?}", r.response_code())));
        }
        Ok(Ok(r
            .answers()
            .iter()
            .filter_map(|a| match a.data() {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect()))
    })
    .unwrap()
}

/// A guest stand-in: a namespace with `eth0` (a tap) at the guest address and MAC, bridged to
/// the slot's `tap0`.
pub struct Guest {
    pub path: PathBuf,
    pub ns: OwnedFd,
    _bridge: Bridge,
}

impl Guest {
    pub fn attach(world: &World, name: &str, slot: &Slot) -> Guest {
        let path = world.dir.path().join(name);
        let ns = new_ns(&path);
        let own =
            netns::run_in(&ns, || sandfork_network::tap::open_tap("eth0")).expect("guest tap");
        let mac = GUEST_MAC
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":");
        ip(&path, "link set lo up");
        ip(&path, &format!("link set eth0 address {mac}"));
        ip(&path, &format!("addr add {GUEST_IP}/30 dev eth0"));
        ip(&path, "link set eth0 up");
        ip(&path, &format!("route add default via {GATEWAY_IP}"));
        let slot_tap = slot
            .run_in(|| sandfork_network::tap::open_tap(TAP_NAME))
            .expect("slot tap");
        Guest {
            path,
            ns,
            _bridge: Bridge::start(own, slot_tap),
        }
    }

    pub fn ask(&self, ip: Ipv4Addr, token: &str) -> Option<String> {
        ask(&self.ns, SocketAddrV4::new(ip, 80), token, None)
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = netns::remove_anchor(&self.path);
    }
}

/// The host and internet namespaces, and the servers.
pub struct World {
    pub dir: tempfile::TempDir,
    pub host_path: PathBuf,
    pub host: OwnedFd,
    pub inet_path: PathBuf,
    pub inet: OwnedFd,
    _servers: Vec<Server>,
}

impl World {
    pub fn new() -> World {
        let dir = tempfile::Builder::new().prefix("sfnet-").tempdir().unwrap();
        let host_path = dir.path().join("host");
        let inet_path = dir.path().join("inet");
        let host = new_ns(&host_path);
        let inet = new_ns(&inet_path);
        ip(&host_path, "link set lo up");
        ip(&inet_path, "link set lo up");
        ip(
            &host_path,
            &format!(
                "link add {UPLINK} type veth peer name inet0 netns {}",
                inet_path.display()
            ),
        );
        ip(
            &host_path,
            &format!("addr add {HOST_UPLINK_IP}/24 dev {UPLINK}"),
        );
        ip(&host_path, &format!("link set {UPLINK} up"));
        ip(&host_path, "route add default via 198.51.100.2");
        ip(&inet_path, "addr add 198.51.100.2/24 dev inet0");
        ip(&inet_path, "link set inet0 up");
        for a in [WEB_A, WEB_B, PRIVATE, METADATA, DNS_SERVER] {
            ip(&inet_path, &format!("addr add {a}/32 dev lo"));
        }
        dns_server(&inet, DNS_SERVER);
        let servers = [WEB_A, WEB_B, PRIVATE, METADATA]
            .iter()
            .map(|a| Server::start(&inet, SocketAddrV4::new(*a, 80), &a.to_string()))
            .collect();
        World {
            dir,
            host_path,
            host,
            inet_path,
            inet,
            _servers: servers,
        }
    }

    pub fn anchor_dir(&self) -> PathBuf {
        self.dir.path().join("netns")
    }

    pub fn pool_config(&self, ready: usize, slots: u32) -> PoolConfig {
        let mut host = HostConfig::new(self.anchor_dir());
        host.host_netns = Some(self.host_path.clone());
        host.uplink = None; // found from the default route: up0
        host.plan.slots = slots;
        PoolConfig {
            host,
            ready_target: ready,
            release_delay: Duration::ZERO,
        }
    }

    /// Names of the host namespace's links.
    pub fn host_links(&self) -> Vec<String> {
        ip_out(&self.host_path, "-o link show")
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap().to_string())
            .collect()
    }

    /// Anchors left in the anchor directory.
    pub fn anchors(&self) -> Vec<String> {
        std::fs::read_dir(self.anchor_dir())
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Anything a failed test left: unmount every anchor below the directory.
        for e in std::fs::read_dir(self.anchor_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = netns::remove_anchor(&e.path());
        }
        let _ = nix::mount::umount2(&self.anchor_dir(), nix::mount::MntFlags::MNT_DETACH);
        let _ = netns::remove_anchor(&self.host_path);
        let _ = netns::remove_anchor(&self.inet_path);
    }
}
