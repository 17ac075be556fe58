//! Lab test: sandbox networking through the real server. The test makes its
//! own "internet": a network namespace on TEST-NET addresses with two web
//! servers (203.0.113.10, .11) and a stand-in metadata server
//! (169.254.169.254), joined to the lab's root namespace (the node's host)
//! by a veth the node uses as its uplink. Nothing leaves the lab machine.
//!
//! Sandboxes created through the API reach it by default, not with
//! `allow_internet_access: false`; `denyOut` is enforced, `PUT .../network`
//! changes it live, fork children keep the policy and both get out, the guest
//! reaches neither the node's API nor the metadata address, a paused and
//! resumed sandbox keeps its policy, and a clean stop leaves no slot behind.
//!
//! Needs what `lab_serve` needs, and `ip` (iproute2) for the test world.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Created, http, run, vmm_binary};
use serde_json::json;
use server::config::Config;

const WEB_A: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const WEB_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
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
        for ip in [WEB_A, WEB_B, METADATA] {
            inside(&format!("addr add {ip}/32 dev lo"));
        }
        inside(&format!("route add default via {UPLINK_IP}"));
        let internet = Internet {
            anchor: anchor.to_owned(),
        };
        for (ip, name) in [(WEB_A, "a"), (WEB_B, "b"), (METADATA, "metadata")] {
            internet.serve(ip, name);
        }
        internet
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

async fn reaches(node: SocketAddr, sandbox: &Created, ip: Ipv4Addr) -> bool {
    let got = fetch(node, sandbox, ip, 80).await;
    assert!(got.is_empty() || got.starts_with("hello"), "{got}");
    !got.is_empty()
}

fn lab_config(data: &Path) -> Config {
    let env = |name| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let mut config = Config::new(
        "0.0.0.0:0".parse().unwrap(),
        env("SANDFORK_KERNEL").into(),
        env("SANDFORK_ROOTFS").into(),
        vmm_binary(),
    );
    config.data_dir = data.to_owned();
    config.pool_size = 2;
    config.network = Some(server::net::NetworkConfig {
        ready_slots: 4,
        uplink: Some(UPLINK.into()),
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
    for (ip, port) in [
        (UPLINK_IP, port),
        (METADATA, 80),
        (Ipv4Addr::new(10, 0, 2, 15), port),
    ] {
        let got = fetch(node.addr, &open, ip, port).await;
        assert_eq!(got, "", "the guest reached {ip}:{port}");
    }
    let detail = http(
        node.addr,
        "GET",
        &format!("/sandboxes/{}", open.id),
        &node.auth(),
        "",
    )
    .await
    .json();
    assert_eq!(
        detail["allowInternetAccess"],
        serde_json::Value::Null,
        "{detail}"
    );
    assert_eq!(detail["network"]["denyOut"], json!([]), "{detail}");

    let closed = node
        .create(json!({"templateID": "base", "timeout": 600, "allow_internet_access": false}))
        .await;
    assert!(!reaches(node.addr, &closed, WEB_A).await);
    let detail = http(
        node.addr,
        "GET",
        &format!("/sandboxes/{}", closed.id),
        &node.auth(),
        "",
    )
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
    let forked = http(
        node.addr,
        "POST",
        &format!("/sandboxes/{}/fork", open.id),
        &node.auth(),
        r#"{"count":2,"timeout":600}"#,
    )
    .await;
    assert_eq!(forked.status, 201, "{:?}", forked.body);
    eprintln!("fork of 2 with networking answered in {:?}", t.elapsed());
    let children: Vec<Created> = forked
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Created {
            id: c["sandbox"]["sandboxID"].as_str().unwrap().to_owned(),
            token: c["sandbox"]["envdAccessToken"].as_str().unwrap().to_owned(),
            answer: c.clone(),
        })
        .collect();
    assert_eq!(children.len(), 2);
    for child in &children {
        assert!(reaches(node.addr, child, WEB_A).await, "{}", child.id);
        assert!(!reaches(node.addr, child, WEB_B).await, "{}", child.id);
    }
    for c in &children {
        let gone = http(
            node.addr,
            "DELETE",
            &format!("/sandboxes/{}", c.id),
            &node.auth(),
            "",
        )
        .await;
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

    for s in [&open, &closed, &partial] {
        let gone = http(
            node.addr,
            "DELETE",
            &format!("/sandboxes/{}", s.id),
            &node.auth(),
            "",
        )
        .await;
        assert_eq!(gone.status, 204);
    }
    node.stop().await;
    // A clean stop with nothing running leaves no slot behind.
    let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains("sfv-"), "{links}");
}
