//! Lab test: sandbox networking through the real server. The test makes its
//! own "internet": a network namespace on TEST-NET addresses with two web
//! servers (203.0.113.10, .11) and a stand-in metadata server
//! (169.254.169.254) and a DNS server (203.0.113.53, the node's
//! `dns_upstream`: every `*.sandfork.test` name is web server a), joined to the
//! lab's root namespace (the node's host) by a veth the node uses as its
//! uplink. Nothing leaves the lab machine.
//!
//! Sandboxes resolve names through the node's forwarder (their gateway), not
//! with `allow_internet_access: false`, and again once `PUT .../network`
//! opens it.
//!
//! Sandboxes created through the API reach it by default, not with
//! `allow_internet_access: false`; `denyOut` is enforced, `PUT .../network`
//! changes it live, fork children keep the policy and both get out (so do
//! the fork children of a named snapshot and of a paused sandbox), the guest
//! reaches neither the node's API nor the metadata address, a paused and
//! resumed sandbox keeps its policy, and a clean stop leaves no slot behind.
//!
//! A second test runs `sandfork serve` as a process (it restarts it): a guest
//! sending from another address or MAC gets nothing through, nor reaches
//! another sandbox, the node on any of its addresses or the metadata address;
//! after a restart both sandboxes are adopted and still online (and guarded),
//! and after their kills and a clean stop the host has no slot veth, anchor
//! or nftables table more than before.
//!
//! Domain rules (`allowOut` names with all else denied) go through the node's
//! egress proxy: a TLS server in the same internet (openssl's certificate,
//! the host's Python) tells which SNI reached it; names are allowed by Host
//! and SNI, wildcards too, refused otherwise (and at an address the node's
//! DNS did not give for the name), replaced live, kept by a fork.
//!
//! Needs what `lab_serve` needs, and `ip` (iproute2) for the test world.

#![cfg(test)]

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Created, http, run};
use serde_json::json;
use server::node::config::Config;

const WEB_A: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const WEB_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
const DNS_SERVER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
/// The zone the test's DNS server answers (with [`WEB_A`]); other names: NXDOMAIN.
const ZONE: &str = ".sandfork.test";
const UPLINK: &str = "sft-up0";
const UPLINK_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const INTERNET_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test's internet: a namespace anchored at `anchor`, its web servers
/// answering `hello <name> <peer>`.
struct Internet {
    anchor: PathBuf,
}

impl Internet {
    fn make(anchor: &Path) -> Internet {
        sandfork_network::netns::create_anchored(anchor, |_| Ok(())).expect("internet namespace");
        let ns = format!("--net={}", anchor.display());
        let inside = |cmd: &str| {
            let mut args = vec!["nsenter", ns.as_str(), "ip"];
            args.extend(cmd.split_whitespace());
            sh(&args);
        };
        let _ = Command::new("ip").args(["link", "del", UPLINK]).output();
        sh(&[
            "ip", "link", "add", UPLINK, "type", "veth", "peer", "name", "sft-in0",
        ]);
        sh(&[
            "ip",
            "link",
            "set",
            "sft-in0",
            "netns",
            &anchor.display().to_string(),
        ]);
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{UPLINK_IP}/24"),
            "dev",
            UPLINK,
        ]);
        sh(&["ip", "link", "set", UPLINK, "up"]);
        for net in ["203.0.113.0/24", "169.254.169.254/32"] {
            sh(&["ip", "route", "add", net, "via", &INTERNET_IP.to_string()]);
        }
        inside("link set lo up");
        inside(&format!("addr add {INTERNET_IP}/24 dev sft-in0"));
        inside("link set sft-in0 up");
        for ip in [WEB_A, WEB_B, METADATA, DNS_SERVER] {
            inside(&format!("addr add {ip}/32 dev lo"));
        }
        inside(&format!("route add default via {UPLINK_IP}"));
        let internet = Internet {
            anchor: anchor.to_owned(),
        };
        for (ip, name) in [(WEB_A, "a"), (WEB_B, "b"), (METADATA, "metadata")] {
            internet.serve(ip, name);
        }
        internet.serve_dns();
        internet
    }

    /// A minimal authoritative server on DNS_SERVER:53 (UDP): an A query
    /// for a name in ZONE gets WEB_A, anything else NXDOMAIN (no AAAA, so a
    /// resolver asking both still gets its answer quickly).
    fn serve_dns(&self) {
        let sock = sandfork_network::run_in_netns(&self.anchor, || {
            std::net::UdpSocket::bind((DNS_SERVER, 53))
                .map_err(|e| sandfork_network::Error::Plan(format!("bind DNS: {e}")))
        })
        .expect("DNS server in the internet");
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = sock.recv_from(&mut buf) {
                if let Some(answer) = dns_answer(&buf[..n]) {
                    let _ = sock.send_to(&answer, from);
                }
            }
        });
    }

    fn serve(&self, ip: Ipv4Addr, name: &'static str) {
        let listener = sandfork_network::run_in_netns(&self.anchor, || {
            TcpListener::bind((ip, 80))
                .map_err(|e| sandfork_network::Error::Plan(format!("bind {ip}: {e}")))
        })
        .expect("listen in the internet");
        std::thread::spawn(move || {
            for mut c in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
                    let mut buf = [0u8; 1024];
                    let _ = c.read(&mut buf);
                    let peer = c
                        .peer_addr()
                        .map(|p| p.ip().to_string())
                        .unwrap_or_default();
                    let _ = write!(c, "HTTP/1.0 200 OK\r\n\r\nhello {name} {peer}\n");
                });
            }
        });
    }
}

/// The answer to one DNS query (header, one question), or None for what is
/// not one.
fn dns_answer(q: &[u8]) -> Option<Vec<u8>> {
    if q.len() < 12 || q[2] & 0x80 != 0 || u16::from_be_bytes([q[4], q[5]]) != 1 {
        return None;
    }
    // The question's name, label by label, then type and class.
    let mut name = String::new();
    let mut i = 12;
    loop {
        let len = usize::from(*q.get(i)?);
        i += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        name.push_str(std::str::from_utf8(q.get(i..i + len)?).ok()?);
        name.push('.');
        i += len;
    }
    let qtype = u16::from_be_bytes([*q.get(i)?, *q.get(i + 1)?]);
    let question_end = i + 4;
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let known = name.ends_with(ZONE);
    let mut r = q.get(..question_end)?.to_vec();
    r[2] = 0x84 | (q[2] & 0x01); // a response, authoritative, RD echoed
    r[3] = if known { 0 } else { 3 }; // NOERROR or NXDOMAIN
    r[10..12].copy_from_slice(&[0, 0]); // no additional records (drop EDNS)
    if known && qtype == 1 {
        r[6..8].copy_from_slice(&1u16.to_be_bytes());
        // name: pointer to the question's; A, IN, TTL 60, 4 bytes
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        r.extend_from_slice(&WEB_A.octets());
    }
    Some(r)
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", UPLINK]).output();
        let _ = sandfork_network::netns::remove_anchor(&self.anchor);
    }
}

/// Whether the lab root (the node's host) reaches `addr`: what the guest is
/// refused must exist, or its refusal proves nothing.
fn host_reaches(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_secs(5)).is_ok()
}

/// What `ip:port` answers the guest over plain TCP (`GET /`), or "" when the
/// guest cannot connect.
async fn fetch(node: SocketAddr, sandbox: &Created, ip: Ipv4Addr, port: u16) -> String {
    let routing = sandbox.routing();
    let script = format!(
        "timeout 20 bash -c 'exec 3<>/dev/tcp/{ip}/{port} && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3' 2>/dev/null | tail -n 1; true"
    );
    let (code, out) = run(node, &routing, &script).await;
    assert_eq!(code, 0, "{out}");
    out.trim().to_owned()
}

/// The IPv4 address `name` resolves to in the guest (through its
/// /etc/resolv.conf, so through the node's forwarder), or "" when it does not.
async fn resolve(node: SocketAddr, sandbox: &Created, name: &str) -> String {
    let routing = sandbox.routing();
    let script = format!("getent ahostsv4 {name} | head -n 1 | cut -d' ' -f1; true");
    let (code, out) = run(node, &routing, &script).await;
    assert_eq!(code, 0, "{out}");
    out.trim().to_owned()
}

async fn reaches(node: SocketAddr, sandbox: &Created, ip: Ipv4Addr) -> bool {
    let got = fetch(node, sandbox, ip, 80).await;
    assert!(got.is_empty() || got.starts_with("hello"), "{got}");
    !got.is_empty()
}

fn lab_config(data: &Path) -> Config {
    let mut config = common::lab_config("0.0.0.0:0".parse().unwrap(), data, 2);
    config.network = Some(server::node::net::NetworkConfig {
        ready_slots: 4,
        uplink: Some(UPLINK.into()),
        dns_upstream: Some(std::net::SocketAddrV4::new(DNS_SERVER, 53)),
    });
    config
}

struct Node {
    addr: SocketAddr,
    key: String,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Node {
    async fn start(config: Config) -> Node {
        let node = server::Server::start(config)
            .await
            .expect("starting the server");
        let key = std::fs::read_to_string(node.api_key_file.clone().unwrap())
            .unwrap()
            .trim()
            .to_owned();
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(node.serve(listener, async move {
            let _ = stopped.await;
        }));
        Node {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            key,
            stop,
            served,
        }
    }

    fn auth(&self) -> [(&'static str, &str); 2] {
        [
            ("x-api-key", self.key.as_str()),
            ("content-type", "application/json"),
        ]
    }

    async fn create(&self, body: serde_json::Value) -> Created {
        common::create(self.addr, &self.auth(), body).await
    }

    async fn put_network(&self, id: &str, body: serde_json::Value) -> u16 {
        http(
            self.addr,
            "PUT",
            &format!("/sandboxes/{id}/network"),
            &self.auth(),
            body.to_string(),
        )
        .await
        .status
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.served.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab: boots microVMs, makes network namespaces"]
async fn sandboxes_reach_the_internet_as_their_policy_says() {
    let world = tempfile::tempdir().unwrap();
    let _internet = Internet::make(&world.path().join("internet"));
    let data = tempfile::tempdir().unwrap();
    let config = lab_config(data.path());
    let t = Instant::now();
    let node = Node::start(config).await;
    eprintln!("server up (template built) in {:?}", t.elapsed());
    let port = node.addr.port();
    // The guest must not reach what the host reaches.
    let node_on_uplink = SocketAddr::from((UPLINK_IP, port));
    for addr in [node_on_uplink, SocketAddr::from((METADATA, 80))] {
        assert!(host_reaches(addr), "the host does not reach {addr}");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    let t = Instant::now();
    let open = node
        .create(json!({"templateID": "base", "timeout": 600}))
        .await;
    let created = t.elapsed();
    assert_eq!(
        fetch(node.addr, &open, WEB_A, 80).await,
        format!("hello a {UPLINK_IP}")
    );
    eprintln!(
        "networked create answered in {created:?}, first fetch done {:?} after the create",
        t.elapsed()
    );
    assert!(reaches(node.addr, &open, WEB_B).await);
    // Names resolve through the node's forwarder to the test's DNS server,
    // and a name resolved is a server reached.
    assert_eq!(
        resolve(node.addr, &open, &format!("web{ZONE}")).await,
        WEB_A.to_string()
    );
    let by_name = format!(
        "timeout 20 bash -c 'exec 3<>/dev/tcp/web{ZONE}/80 && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3' 2>&1 | tail -n 1"
    );
    let (_, got) = run(node.addr, &open.routing(), &by_name).await;
    assert_eq!(got.trim(), format!("hello a {UPLINK_IP}"));
    assert_eq!(resolve(node.addr, &open, "elsewhere.invalid").await, "");
    for (ip, port) in [
        (UPLINK_IP, port),
        (METADATA, 80),
        (Ipv4Addr::new(10, 0, 2, 15), port),
    ] {
        let got = fetch(node.addr, &open, ip, port).await;
        assert_eq!(got, "", "the guest reached {ip}:{port}");
    }
    let detail = common::detail(node.addr, &node.auth(), &open.id)
        .await
        .json();
    assert_eq!(
        detail["allowInternetAccess"],
        serde_json::Value::Null,
        "{detail}"
    );
    // As E2B's: only what was set.
    assert_eq!(detail["network"], json!({}), "{detail}");

    let closed = node
        .create(json!({"templateID": "base", "timeout": 600, "allow_internet_access": false}))
        .await;
    assert!(!reaches(node.addr, &closed, WEB_A).await);
    assert_eq!(
        resolve(node.addr, &closed, &format!("web{ZONE}")).await,
        "",
        "a sandbox without internet access resolved a name"
    );
    let detail = common::detail(node.addr, &node.auth(), &closed.id)
        .await
        .json();
    assert_eq!(detail["allowInternetAccess"], false, "{detail}");

    // A denied CIDR at create; then replaced live, both ways.
    let partial = node
        .create(json!({"templateID": "base", "timeout": 600,
                       "network": {"denyOut": [format!("{WEB_B}/32")]}}))
        .await;
    assert!(reaches(node.addr, &partial, WEB_A).await);
    assert!(!reaches(node.addr, &partial, WEB_B).await);
    let t = Instant::now();
    assert_eq!(node.put_network(&closed.id, json!({})).await, 204);
    eprintln!("PUT /network answered in {:?}", t.elapsed());
    assert!(reaches(node.addr, &closed, WEB_A).await);
    assert_eq!(
        resolve(node.addr, &closed, &format!("web{ZONE}")).await,
        WEB_A.to_string(),
        "PUT /network opened the internet but not DNS"
    );
    assert_eq!(
        node.put_network(
            &open.id,
            json!({"allowOut": [WEB_A.to_string()], "denyOut": ["0.0.0.0/0"]})
        )
        .await,
        204
    );
    assert!(reaches(node.addr, &open, WEB_A).await);
    assert!(!reaches(node.addr, &open, WEB_B).await);
    // Bad input and unknown sandboxes answer as E2B's API does.
    assert_eq!(
        node.put_network(&open.id, json!({"denyOut": ["0.0.0.0"]}))
            .await,
        400
    );
    assert_eq!(node.put_network("nosuchsandbox0", json!({})).await, 404);

    // Fork children: each in its own slot with the parent's policy.
    let t = Instant::now();
    let fork = |path: String| {
        let auth = node.auth();
        async move {
            common::forked(
                http(
                    node.addr,
                    "POST",
                    &path,
                    &auth,
                    r#"{"count":1,"timeout":600}"#,
                )
                .await,
            )
        }
    };
    let mut children = common::forked(
        http(
            node.addr,
            "POST",
            &format!("/sandboxes/{}/fork", open.id),
            &node.auth(),
            r#"{"count":2,"timeout":600}"#,
        )
        .await,
    );
    eprintln!("fork of 2 with networking answered in {:?}", t.elapsed());
    assert_eq!(children.len(), 2);
    // A named snapshot's fork children: the policy its source had.
    let snap = http(
        node.addr,
        "POST",
        &format!("/sandboxes/{}/snapshots", open.id),
        &node.auth(),
        r#"{"name":"net-snap"}"#,
    )
    .await;
    assert_eq!(snap.status, 201, "{:?}", snap.body);
    children.extend(fork("/snapshots/net-snap/fork".into()).await);
    for child in &children {
        assert!(reaches(node.addr, child, WEB_A).await, "{}", child.id);
        assert!(!reaches(node.addr, child, WEB_B).await, "{}", child.id);
    }
    let detail = common::detail(node.addr, &node.auth(), &children[2].id)
        .await
        .json();
    assert_eq!(
        detail["network"]["allowOut"],
        json!([WEB_A.to_string()]),
        "{detail}"
    );
    for c in &children {
        let gone = common::kill(node.addr, &node.auth(), &c.id).await;
        assert_eq!(gone.status, 204);
    }

    // A paused sandbox: 409; resumed into another slot, with its policy.
    let paused = http(
        node.addr,
        "POST",
        &format!("/sandboxes/{}/pause", partial.id),
        &node.auth(),
        "",
    )
    .await;
    assert_eq!(paused.status, 204, "{:?}", paused.body);
    assert_eq!(node.put_network(&partial.id, json!({})).await, 409);
    // A paused sandbox's fork child keeps its policy too.
    let from_paused = fork(format!("/sandboxes/{}/fork", partial.id)).await;
    assert!(reaches(node.addr, &from_paused[0], WEB_A).await);
    assert!(!reaches(node.addr, &from_paused[0], WEB_B).await);
    let resumed = http(
        node.addr,
        "POST",
        &format!("/sandboxes/{}/connect", partial.id),
        &node.auth(),
        r#"{"timeout":600}"#,
    )
    .await;
    assert!(
        resumed.status == 201 || resumed.status == 200,
        "{:?}",
        resumed.body
    );
    assert!(reaches(node.addr, &partial, WEB_A).await);
    assert!(!reaches(node.addr, &partial, WEB_B).await);

    for s in [&open, &closed, &partial, &from_paused[0]] {
        let gone = common::kill(node.addr, &node.auth(), &s.id).await;
        assert_eq!(gone.status, 204);
    }
    node.stop().await;
    // A clean stop with nothing running leaves no slot behind.
    let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains("sfv-"), "{links}");
}

/// Whether the guest gets an answer from `ip:port` over TCP (`GET /`), its
/// socket bound to `from` when given (an address the guest added itself).
async fn connects(
    node: SocketAddr,
    sandbox: &Created,
    from: Option<Ipv4Addr>,
    ip: Ipv4Addr,
    port: u16,
) -> bool {
    let from = from.map(|f| f.to_string()).unwrap_or_default();
    let python = [
        "import socket, sys",
        "s = socket.socket()",
        "s.settimeout(5)",
        "try:",
        "    if sys.argv[1]:",
        "        s.bind((sys.argv[1], 0))",
        "    s.connect((sys.argv[2], int(sys.argv[3])))",
        "    s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')",
        "    print('answered' if s.recv(64) else '')",
        "except OSError:",
        "    print('')",
    ]
    .join("\n");
    let script = format!("python3 - '{from}' {ip} {port} <<'PY'\n{python}\nPY");
    let (code, out) = run(node, &sandbox.routing(), &script).await;
    assert_eq!(code, 0, "{out}");
    out.trim() == "answered"
}

/// What networking leaves on the host: slot veths, our namespace anchors
/// (bind mounts and their files), named namespaces, the node's nft table.
fn host_network_state(anchors: &Path) -> (Vec<String>, Vec<String>, String, bool) {
    let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
    let links = String::from_utf8_lossy(&links.stdout)
        .lines()
        .filter_map(|l| l.split(':').nth(1).map(|n| n.trim().to_owned()))
        .filter(|n| n.starts_with("sfv-"))
        .collect();
    // The anchor directory itself stays a private bind mount of itself
    // once made (as `ip netns` leaves /run/netns): one per node, not per slot.
    let inside = format!("{}/", anchors.display());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&inside)))
        .map(str::to_owned)
        .chain(
            std::fs::read_dir(anchors)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path().display().to_string()),
        )
        .collect();
    let netns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let netns = String::from_utf8_lossy(&netns.stdout).into_owned();
    let table = sandfork_network::nft::table_exists_in(
        Path::new("/proc/self/ns/net"),
        sandfork_network::nft::host_table::TABLE,
    )
    .unwrap();
    (links, mounts, netns, table)
}

/// What `ip -4 -o ARGS` prints in the node's host namespace.
fn ip4(args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["-4", "-o"])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The slot host addresses routed on the node (10.11.0.0/16, one a slot).
fn slot_host_ips() -> Vec<Ipv4Addr> {
    ip4(&["route"])
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<Ipv4Addr>().ok())
        .filter(|ip| ip.octets()[..2] == [10, 11])
        .collect()
}

/// Every IPv4 address of the node's host namespace.
fn host_ips() -> Vec<Ipv4Addr> {
    ip4(&["addr"])
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "inet")?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .collect()
}

/// `sandfork serve` as a process with the test internet as its uplink, on
/// every address of the host, as a node would be.
struct Served(common::ServeProcess);

impl std::ops::Deref for Served {
    type Target = common::ServeProcess;
    fn deref(&self) -> &common::ServeProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Served {
    fn deref_mut(&mut self) -> &mut common::ServeProcess {
        &mut self.0
    }
}

impl Served {
    fn new(data: &Path) -> Served {
        Served(common::ServeProcess::new(
            data,
            &format!("e2b_{}", "6b".repeat(16)),
        ))
    }

    async fn start(&mut self) {
        let args = [
            "--pool-size",
            "2",
            "--ready-slots",
            "4",
            "--uplink",
            UPLINK,
            "--dns-upstream",
            &DNS_SERVER.to_string(),
            "--listen",
            &format!("0.0.0.0:{}", self.addr.port()),
        ]
        .map(str::to_owned);
        self.spawn(&args, &[]);
        self.wait_up().await;
    }

    async fn create(&self, body: serde_json::Value) -> Created {
        common::create(self.addr, &self.auth(), body).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab: boots microVMs, makes network namespaces, restarts the node"]
async fn guests_cannot_spoof_or_reach_the_node_or_each_other_and_keep_their_network_over_a_restart()
{
    let world = tempfile::tempdir().unwrap();
    let _internet = Internet::make(&world.path().join("internet"));
    let data = tempfile::tempdir().unwrap();
    let anchors = server::node::net::anchor_dir(&lab_config(data.path()).run_dir());
    let before = host_network_state(&anchors);
    let t = Instant::now();
    let mut node = Served::new(data.path());
    node.start().await;
    eprintln!("server up in {:?}", t.elapsed());
    let port = node.addr.port();
    let body = json!({"templateID": "base", "timeout": 600});
    let a = node.create(body.clone()).await;
    let b = node.create(body).await;
    assert!(connects(node.addr, &a, None, WEB_A, 80).await);

    // Another source address, inside the guest's /30 or out of it (a slot's
    // host address, an internet one): dropped before conntrack sees it.
    let t = Instant::now();
    for spoof in [
        Ipv4Addr::new(169, 254, 0, 25),
        Ipv4Addr::new(10, 11, 0, 200),
        Ipv4Addr::new(198, 51, 100, 77),
    ] {
        let (code, out) = run(
            node.addr,
            &a.routing(),
            &format!("ip addr add {spoof}/32 dev eth0"),
        )
        .await;
        assert_eq!(code, 0, "{out}");
        assert!(
            !connects(node.addr, &a, Some(spoof), WEB_A, 80).await,
            "the guest sent from {spoof}"
        );
        run(
            node.addr,
            &a.routing(),
            &format!("ip addr del {spoof}/32 dev eth0"),
        )
        .await;
    }
    // Another MAC: every frame from it dropped; its own again, all well.
    let (code, out) = run(
        node.addr,
        &a.routing(),
        "ip link set dev eth0 address 02:fc:00:00:00:99",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(
        !connects(node.addr, &a, None, WEB_A, 80).await,
        "the guest sent with a forged MAC"
    );
    run(
        node.addr,
        &a.routing(),
        "ip link set dev eth0 address 02:fc:00:00:00:05",
    )
    .await;
    assert!(connects(node.addr, &a, None, WEB_A, 80).await);
    eprintln!("spoofing checks in {:?}", t.elapsed());

    // Another sandbox: b serves on 8000, the node reaches it at its slot's
    // host address, a does not.
    let (code, out) = run(
        node.addr,
        &b.routing(),
        "mkdir -p /tmp/www && echo b > /tmp/www/index.html && \
         setsid python3 -m http.server 8000 --directory /tmp/www </dev/null >/dev/null 2>&1 & \
         for i in $(seq 300); do (echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; sleep 0.2; done; exit 1",
    )
    .await;
    assert_eq!(code, 0, "b's server never listened: {out}");
    let served: Vec<Ipv4Addr> = slot_host_ips()
        .into_iter()
        .filter(|ip| host_reaches(SocketAddr::from((*ip, 8000))))
        .collect();
    let routes = Command::new("ip")
        .args(["-4", "-o", "route"])
        .output()
        .unwrap();
    assert_eq!(
        served.len(),
        1,
        "b's server from the node: {served:?}; slot addresses {:?}; routes:\n{}",
        slot_host_ips(),
        String::from_utf8_lossy(&routes.stdout)
    );
    assert!(
        !connects(node.addr, &a, None, served[0], 8000).await,
        "a reached b at {}",
        served[0]
    );
    // The node: its API on each of its addresses (the veths' host ends
    // included), and the metadata address.
    let mut targets: Vec<(Ipv4Addr, u16)> = host_ips().into_iter().map(|ip| (ip, port)).collect();
    targets.push((METADATA, 80));
    for (ip, p) in targets {
        if !ip.is_loopback() {
            assert!(
                !connects(node.addr, &a, None, ip, p).await,
                "the guest reached {ip}:{p}"
            );
        }
    }

    // A restart with both running: adopted, still online, still guarded.
    node.stop();
    let t = Instant::now();
    node.start().await;
    eprintln!("server restarted (sandboxes adopted) in {:?}", t.elapsed());
    for s in [&a, &b] {
        assert!(
            connects(node.addr, s, None, WEB_A, 80).await,
            "{} lost its network in the restart",
            s.id
        );
        assert_eq!(
            resolve(node.addr, s, &format!("web{ZONE}")).await,
            WEB_A.to_string()
        );
    }
    run(
        node.addr,
        &a.routing(),
        "ip addr add 169.254.0.25/32 dev eth0",
    )
    .await;
    assert!(
        !connects(
            node.addr,
            &a,
            Some(Ipv4Addr::new(169, 254, 0, 25)),
            WEB_A,
            80
        )
        .await
    );

    for s in [&a, &b] {
        let gone = common::kill(node.addr, &node.auth(), &s.id).await;
        assert_eq!(gone.status, 204);
    }
    node.stop();
    // Kills and a clean stop: the host as it was.
    assert_eq!(host_network_state(&anchors), before);
}

/// A TLS server in the test's internet on `ip`:443 with a certificate for
/// every name of [`ZONE`] (made by `openssl`, served by the host's Python):
/// answers any request with `hello tls <the SNI it was sent>`. Killed when
/// dropped.
struct TlsServer(std::process::Child);

impl TlsServer {
    const SCRIPT: &'static str = r#"
import socket, ssl, sys, threading
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
seen = {}
ctx.sni_callback = lambda s, name, c: seen.__setitem__(id(s), name)
srv = socket.create_server((sys.argv[3], 443))
def serve(c):
    try:
        with ctx.wrap_socket(c, server_side=True) as t:
            t.settimeout(10)
            t.recv(4096)
            body = "hello tls %s\n" % seen.pop(id(t), None)
            t.sendall(("HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
    except Exception:
        pass
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

    fn start(internet: &Internet, ip: Ipv4Addr, dir: &Path) -> TlsServer {
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        sh(&[
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN=sandfork{ZONE}"),
            "-addext",
            &format!("subjectAltName=DNS:*{ZONE},DNS:*.wild{ZONE}"),
            "-keyout",
            &key.display().to_string(),
            "-out",
            &cert.display().to_string(),
        ]);
        let child = Command::new("nsenter")
            .arg(format!("--net={}", internet.anchor.display()))
            .args(["/usr/bin/python3", "-c", Self::SCRIPT])
            .arg(&cert)
            .arg(&key)
            .arg(ip.to_string())
            .spawn()
            .expect("the TLS server");
        let server = TlsServer(child);
        let t = Instant::now();
        while !host_reaches(SocketAddr::from((ip, 443))) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the TLS server did not start"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What `curl` in the guest gets from `url` (body only, certificate not
/// checked), "" when it fails; `to` pins the name to an address instead of
/// the guest's DNS (which refuses names the rules do not allow).
async fn curl(node: SocketAddr, sandbox: &Created, url: &str, to: Option<Ipv4Addr>) -> String {
    let pin = to
        .map(|ip| {
            let rest = url.split("://").nth(1).unwrap_or("");
            let host = rest.split('/').next().unwrap_or("");
            let port = if url.starts_with("https") { 443 } else { 80 };
            format!("--resolve {host}:{port}:{ip}")
        })
        .unwrap_or_default();
    let script = format!("curl -sk --max-time 20 {pin} {url} 2>/dev/null; true");
    let (code, out) = run(node, &sandbox.routing(), &script).await;
    assert_eq!(code, 0, "{out}");
    out.trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab: boots microVMs, makes network namespaces"]
async fn domain_rules_let_web_traffic_out_by_host_and_sni() {
    let world = tempfile::tempdir().unwrap();
    let internet = Internet::make(&world.path().join("internet"));
    let _tls = TlsServer::start(&internet, WEB_A, world.path());
    let data = tempfile::tempdir().unwrap();
    let node = Node::start(lab_config(data.path())).await;
    let name = |n: &str| format!("{n}{ZONE}");
    let (allowed, other) = (name("allowed"), name("other"));
    let sbx = node
        .create(json!({"templateID": "base", "timeout": 600, "network": {
            "allowOut": [allowed, format!("*.wild{ZONE}")],
            "denyOut": ["0.0.0.0/0"]}}))
        .await;
    let t = Instant::now();
    assert_eq!(
        curl(node.addr, &sbx, &format!("https://{allowed}/"), None).await,
        format!("hello tls {allowed}")
    );
    eprintln!(
        "first HTTPS fetch through the egress proxy in {:?}",
        t.elapsed()
    );
    assert_eq!(
        curl(node.addr, &sbx, &format!("http://{allowed}/"), None).await,
        format!("hello a {UPLINK_IP}")
    );
    let wild = name("x.wild");
    assert_eq!(
        curl(node.addr, &sbx, &format!("https://{wild}/"), None).await,
        format!("hello tls {wild}")
    );
    // Names the rules do not allow: not resolved, and refused by name even
    // at an address that serves an allowed one.
    assert_eq!(resolve(node.addr, &sbx, &other).await, "");
    for denied in [other.as_str(), &name("wild")] {
        let https = curl(node.addr, &sbx, &format!("https://{denied}/"), Some(WEB_A)).await;
        assert_eq!(https, "", "{denied} over TLS");
        let http_ = curl(node.addr, &sbx, &format!("http://{denied}/"), Some(WEB_A)).await;
        assert!(
            http_.contains("do not allow"),
            "{denied} over HTTP: {http_}"
        );
    }
    // An allowed name at an address the node's DNS did not give for it:
    // refused (the guest cannot take an allowed name anywhere).
    let elsewhere = curl(node.addr, &sbx, &format!("http://{allowed}/"), Some(WEB_B)).await;
    assert!(
        elsewhere.contains("is not an address"),
        "{allowed} at {WEB_B}: {elsewhere}"
    );
    // A request naming no host is refused too.
    let nameless = fetch(node.addr, &sbx, WEB_B, 80).await;
    assert!(nameless.contains("do not allow"), "{nameless}");
    let detail = common::detail(node.addr, &node.auth(), &sbx.id)
        .await
        .json();
    assert_eq!(
        detail["network"]["allowOut"],
        json!([allowed, format!("*.wild{ZONE}")]),
        "{detail}"
    );

    // Replaced live: the other name passes, the first no longer.
    assert_eq!(
        node.put_network(
            &sbx.id,
            json!({"allowOut": [other], "denyOut": ["0.0.0.0/0"]})
        )
        .await,
        204
    );
    assert_eq!(
        curl(node.addr, &sbx, &format!("https://{other}/"), None).await,
        format!("hello tls {other}")
    );
    assert_eq!(
        curl(node.addr, &sbx, &format!("https://{allowed}/"), Some(WEB_A)).await,
        ""
    );
    // A fork child keeps the rules in its own slot.
    let forked = http(
        node.addr,
        "POST",
        &format!("/sandboxes/{}/fork", sbx.id),
        &node.auth(),
        r#"{"count":1,"timeout":600}"#,
    )
    .await;
    let child = common::forked(forked).remove(0);
    assert_eq!(
        curl(node.addr, &child, &format!("https://{other}/"), None).await,
        format!("hello tls {other}")
    );
    assert_eq!(
        curl(
            node.addr,
            &child,
            &format!("http://{allowed}/"),
            Some(WEB_A)
        )
        .await,
        format!("sandfork: this sandbox's network rules do not allow {allowed}")
    );
    for s in [&child, &sbx] {
        let gone = common::kill(node.addr, &node.auth(), &s.id).await;
        assert_eq!(gone.status, 204);
    }
    node.stop().await;
}
