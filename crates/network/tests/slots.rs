//! Slots for real, in namespaces the tests make (see `common`). Skipped without root.

#![cfg(test)]

mod common;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use common::*;
use sandfork_network::nft::table_exists_in;
use sandfork_network::policy::ALL_TRAFFIC;
use sandfork_network::{EgressPolicy, Error, InUse, Pool};

fn policy(allow_internet: Option<bool>, allow: &[&str], deny: &[&str]) -> EgressPolicy {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    EgressPolicy::from_e2b(allow_internet, &s(allow), &s(deny)).unwrap()
}

#[test]
fn guest_reaches_internet_but_not_forbidden_targets() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(2, 8), &[]).unwrap();
    let slot = pool.take(&EgressPolicy::default()).unwrap();
    let other = pool.take(&EgressPolicy::default()).unwrap();
    let g = Guest::attach(&w, "g1", &slot);
    let _g2 = Guest::attach(&w, "g2", &other);
    // A service of the node, on every host address.
    let _node = Server::start(
        &w.host,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 80),
        "node",
    );

    let a = g.ask(WEB_A, "hi").expect("internet reachable");
    assert!(a.starts_with("203.0.113.10 hi 198.51.100.1:"), "{a}");
    assert_eq!(g.ask(PRIVATE, "x"), None, "private range reached");
    assert_eq!(g.ask(METADATA, "x"), None, "metadata address reached");
    assert_eq!(
        g.ask(HOST_UPLINK_IP, "x"),
        None,
        "the node's own address reached"
    );
    assert_eq!(
        g.ask(slot.addrs().veth_host_ip, "x"),
        None,
        "the node's veth end reached"
    );
    assert_eq!(
        g.ask(other.addrs().host_ip, "x"),
        None,
        "another sandbox reached"
    );
    assert_eq!(
        g.ask(sandfork_network::plan::GATEWAY_IP, "x"),
        None,
        "the slot namespace reached"
    );
    // Nobody but the node opens a connection to a guest: not the internet, even with a route.
    let _guest_srv = Server::start(
        &g.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 8080),
        "guest",
    );
    let host_ip = slot.addrs().host_ip;
    assert!(
        ask(&w.host, SocketAddrV4::new(host_ip, 8080), "n", None).is_some(),
        "node to guest"
    );
    ip(&w.inet_path, "route add 10.11.0.0/16 via 198.51.100.1");
    assert_eq!(
        ask(&w.inet, SocketAddrV4::new(host_ip, 8080), "i", None),
        None,
        "internet to guest"
    );
    drop(g);
    pool.release(slot);
    pool.release(other);
    pool.shutdown(true).unwrap();
}

#[test]
fn two_slots_with_the_same_guest_address_are_told_apart() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(2, 8), &[]).unwrap();
    let s1 = pool.take(&EgressPolicy::default()).unwrap();
    let s2 = pool.take(&EgressPolicy::default()).unwrap();
    let g1 = Guest::attach(&w, "g1", &s1);
    let g2 = Guest::attach(&w, "g2", &s2);

    // Egress: both at once to one server; each gets its own answer on its own connection.
    let (a1, a2) = std::thread::scope(|s| {
        let t1 = s.spawn(|| g1.ask(WEB_A, "one"));
        let t2 = s.spawn(|| g2.ask(WEB_A, "two"));
        (t1.join().unwrap(), t2.join().unwrap())
    });
    let (a1, a2) = (a1.expect("guest 1 online"), a2.expect("guest 2 online"));
    assert!(a1.starts_with("203.0.113.10 one "), "{a1}");
    assert!(a2.starts_with("203.0.113.10 two "), "{a2}");
    let peer = |a: &str| a.rsplit(' ').next().unwrap().to_string();
    assert_ne!(peer(&a1), peer(&a2));

    // Ingress: the node reaches each guest by its slot's host address.
    let _l1 = Server::start(
        &g1.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 49983),
        "guest1",
    );
    let _l2 = Server::start(
        &g2.ns,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 49983),
        "guest2",
    );
    let r1 = ask(
        &w.host,
        SocketAddrV4::new(s1.addrs().host_ip, 49983),
        "ping",
        None,
    )
    .expect("slot 1 ingress");
    let r2 = ask(
        &w.host,
        SocketAddrV4::new(s2.addrs().host_ip, 49983),
        "ping",
        None,
    )
    .expect("slot 2 ingress");
    assert!(r1.starts_with("guest1 ping"), "{r1}");
    assert!(r2.starts_with("guest2 ping"), "{r2}");
    drop((g1, g2));
    pool.release(s1);
    pool.release(s2);
    pool.shutdown(true).unwrap();
}

#[test]
fn every_rule_kind_and_live_replace() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(1, 4), &[]).unwrap();
    // A create with a policy: deny one IP.
    let mut slot = pool.take(&policy(None, &[], &["203.0.113.11"])).unwrap();
    let g = Guest::attach(&w, "g", &slot);
    let reach = |g: &Guest| (g.ask(WEB_A, "a").is_some(), g.ask(WEB_B, "b").is_some());
    assert_eq!(reach(&g), (true, false), "deny one IP");

    let cases: &[(EgressPolicy, (bool, bool), &str)] = &[
        (
            policy(None, &["203.0.113.10"], &["203.0.113.0/24"]),
            (true, false),
            "deny CIDR, allow IP wins",
        ),
        (
            policy(None, &["203.0.113.0/24"], &["203.0.113.11/32"]),
            (true, true),
            "allow CIDR beats deny IP",
        ),
        (
            policy(Some(false), &[], &[]),
            (false, false),
            "allow_internet_access=false",
        ),
        (
            policy(None, &[], &[ALL_TRAFFIC]),
            (false, false),
            "deny ALL_TRAFFIC",
        ),
        (
            policy(None, &["203.0.113.11"], &[ALL_TRAFFIC]),
            (false, true),
            "deny all, allow one",
        ),
        (
            policy(None, &["*.ok.test", "203.0.113.10"], &[ALL_TRAFFIC]),
            (true, false),
            "domain rules: an allowed CIDR stays on the kernel path, the rest goes to the \
             egress proxy (none runs here)",
        ),
        (EgressPolicy::default(), (true, true), "default"),
    ];
    for (p, want, what) in cases {
        pool.set_policy(&mut slot, p.clone()).unwrap();
        assert_eq!(reach(&g), *want, "{what}");
        assert_eq!(slot.policy(), p);
    }
    // No user rule opens always-deny.
    pool.set_policy(
        &mut slot,
        policy(None, &["192.168.77.10", "169.254.0.0/16", "0.0.0.0/0"], &[]),
    )
    .unwrap();
    assert_eq!(g.ask(PRIVATE, "x"), None);
    assert_eq!(g.ask(METADATA, "x"), None);
    assert!(g.ask(WEB_A, "x").is_some());
    drop(g);
    pool.release(slot);
    pool.shutdown(true).unwrap();
}

#[test]
fn guests_resolve_through_the_node_forwarder_per_policy() {
    use sandfork_network::dns::{AccessLookup, DnsAccess, DnsForwarder, FORWARDER_PORT};
    use sandfork_network::plan::GATEWAY_IP;
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(2, 4), &[]).unwrap();
    let mut slot = pool.take(&EgressPolicy::default()).unwrap();
    let other = pool.take(&EgressPolicy::default()).unwrap();
    // What the node keeps: each running slot's host address and its policy's DNS access.
    let access: Arc<RwLock<HashMap<Ipv4Addr, DnsAccess>>> = Arc::default();
    let set = |ip: Ipv4Addr, p: &EgressPolicy| {
        access.write().unwrap().insert(ip, DnsAccess::of(p));
    };
    set(slot.addrs().host_ip, slot.policy());
    let a2 = access.clone();
    let lookup: Arc<AccessLookup> = Arc::new(move |ip| a2.read().unwrap().get(&ip).cloned());
    // One socket in the host namespace for every slot, upstream the internet's server.
    let fwd = sandfork_network::run_in_netns(&w.host_path, || {
        DnsForwarder::start(
            SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, FORWARDER_PORT),
            SocketAddrV4::new(DNS_SERVER, 53),
            lookup,
            Arc::default(),
        )
    })
    .unwrap();
    let g = Guest::attach(&w, "g", &slot);
    let g2 = Guest::attach(&w, "g2", &other);

    assert_eq!(
        resolve(&g.ns, GATEWAY_IP, "pkg.example.test."),
        Ok(vec![DNS_ANSWER]),
        "the default policy resolves any name"
    );
    assert_eq!(
        resolve_tcp(&g.ns, GATEWAY_IP, "pkg.example.test."),
        Ok(vec![DNS_ANSWER]),
        "DNS over TCP (a truncated answer's retry)"
    );
    // A slot the node does not know (no sandbox's) is not answered.
    assert_eq!(
        resolve(&g2.ns, GATEWAY_IP, "pkg.example.test."),
        Err("timeout".into())
    );
    // The guest reaches the forwarder only by its gateway: the veth's host end, any port.
    assert_eq!(g.ask(slot.addrs().veth_host_ip, "x"), None);

    let deny_all = policy(Some(false), &[], &[]);
    pool.set_policy(&mut slot, deny_all.clone()).unwrap();
    set(slot.addrs().host_ip, &deny_all);
    assert_eq!(
        resolve(&g.ns, GATEWAY_IP, "pkg.example.test."),
        Err("Refused".into()),
        "allow_internet_access=false resolves nothing"
    );
    assert_eq!(
        resolve_tcp(&g.ns, GATEWAY_IP, "pkg.example.test."),
        Err("Refused".into())
    );
    // Nor does it get to any other DNS server directly.
    assert_eq!(
        resolve(&g.ns, DNS_SERVER, "pkg.example.test."),
        Err("timeout".into())
    );

    let domains = policy(None, &["*.ok.test"], &[ALL_TRAFFIC]);
    pool.set_policy(&mut slot, domains.clone()).unwrap();
    set(slot.addrs().host_ip, &domains);
    assert_eq!(
        resolve(&g.ns, GATEWAY_IP, "a.ok.test."),
        Ok(vec![DNS_ANSWER])
    );
    assert_eq!(
        resolve(&g.ns, GATEWAY_IP, "pkg.example.test."),
        Err("Refused".into())
    );

    // A policy that denies the private range the forwarder sits in still resolves.
    let deny_private = policy(None, &[], &["10.0.0.0/8"]);
    pool.set_policy(&mut slot, deny_private.clone()).unwrap();
    set(slot.addrs().host_ip, &deny_private);
    assert_eq!(
        resolve(&g.ns, GATEWAY_IP, "pkg.example.test."),
        Ok(vec![DNS_ANSWER])
    );
    drop(fwd);
    drop((g, g2));
    pool.release(slot);
    pool.release(other);
    pool.shutdown(true).unwrap();
}

#[test]
fn spoofed_source_address_or_mac_is_dropped() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(1, 4), &[]).unwrap();
    let slot = pool.take(&EgressPolicy::default()).unwrap();
    let g = Guest::attach(&w, "g", &slot);
    assert!(g.ask(WEB_A, "ok").is_some());

    // Another source address.
    ip(&g.path, "addr add 203.0.113.99/32 dev eth0");
    let spoofed = ask(
        &g.ns,
        SocketAddrV4::new(WEB_A, 80),
        "spoof",
        Some(Ipv4Addr::new(203, 0, 113, 99)),
    );
    assert_eq!(spoofed, None, "spoofed source address got out");

    // Another MAC; promiscuous, so only the slot's guard can be why nothing comes back.
    ip(&g.path, "link set eth0 promisc on");
    ip(&g.path, "link set eth0 address 02:fc:00:00:00:99");
    assert_eq!(g.ask(WEB_A, "spoof"), None, "spoofed MAC got out");
    ip(&g.path, "link set eth0 address 02:fc:00:00:00:05");
    assert!(
        g.ask(WEB_A, "ok").is_some(),
        "the guest's own MAC works again"
    );
    drop(g);
    pool.release(slot);
    pool.shutdown(true).unwrap();
}

#[test]
fn pool_refills_recycles_and_runs_out() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(2, 3), &[]).unwrap();
    assert!(
        pool.wait_ready(2, Duration::from_secs(10)),
        "{:?}",
        pool.last_error()
    );
    let a = pool.take(&EgressPolicy::default()).unwrap();
    let b = pool.take(&policy(Some(false), &[], &[])).unwrap();
    // The third is made on the spot or by the worker; then there are none.
    let c = pool.take(&EgressPolicy::default()).unwrap();
    match pool.take(&EgressPolicy::default()) {
        Err(Error::Exhausted(3)) => {}
        other => panic!("expected Exhausted, got {other:?}"),
    }
    let mut ids = vec![a.id(), b.id(), c.id()];
    ids.sort();
    assert_eq!(ids, vec![1, 2, 3]);
    assert_eq!(pool.counts(), (0, 3));

    // A released slot comes back reset: the deny-all policy is gone.
    let b_id = b.id();
    pool.release(b);
    assert!(pool.wait_ready(1, Duration::from_secs(10)));
    let again = pool.take(&EgressPolicy::default()).unwrap();
    assert_eq!(again.id(), b_id);
    assert_eq!(again.policy(), &EgressPolicy::default());
    let g = Guest::attach(&w, "g", &again);
    assert!(
        g.ask(WEB_A, "back").is_some(),
        "a recycled slot is online with the default policy"
    );
    drop(g);
    for s in [a, c, again] {
        pool.release(s);
    }
    pool.shutdown(true).unwrap();
}

#[test]
fn a_released_slot_rests_before_reuse() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let mut cfg = w.pool_config(1, 1);
    cfg.release_delay = Duration::from_millis(400);
    let (pool, _) = Pool::start(cfg, &[]).unwrap();
    let s = pool.take(&EgressPolicy::default()).unwrap();
    pool.release(s);
    assert!(matches!(
        pool.take(&EgressPolicy::default()),
        Err(Error::Exhausted(1))
    ));
    assert!(pool.wait_ready(1, Duration::from_secs(5)));
    let s = pool.take(&EgressPolicy::default()).unwrap();
    pool.release(s);
    pool.shutdown(true).unwrap();
}

#[test]
fn start_reclaims_stale_slots_and_adopts_running_ones() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(3, 8), &[]).unwrap();
    assert!(pool.wait_ready(3, Duration::from_secs(10)));
    let running = pool.take(&EgressPolicy::default()).unwrap();
    let running_id = running.id();
    let _leaked = pool.take(&EgressPolicy::default()).unwrap(); // its sandbox died in the crash
    // A crash: the process goes without cleaning anything, and its pool's
    // filler with it. A shutdown that removes nothing is that, once the
    // filler has stopped: it is joined, so a slot it was still making is
    // there for the restart below to find (forgetting the pool left the
    // filler running, and the slot it made after the restart had looked,
    // an extra sfv-6, failed a CI run).
    drop(running);
    assert!(pool.wait_ready(3, Duration::from_secs(10)));
    pool.shutdown(false).unwrap();
    assert!(w.anchors().len() >= 3);

    let stored = policy(Some(false), &[], &[]);
    let in_use = [
        InUse {
            id: running_id,
            policy: stored.clone(),
        },
        InUse {
            id: 7,
            policy: EgressPolicy::default(),
        },
    ];
    // A slot whose host end is gone cannot be adopted.
    let broken = w
        .anchors()
        .iter()
        .filter_map(|a| a.strip_prefix("sf-")?.parse::<u32>().ok())
        .find(|i| *i != running_id)
        .unwrap();
    ip(&w.host_path, &format!("link del sfv-{broken}"));
    let in_use = [
        in_use[0].clone(),
        in_use[1].clone(),
        InUse {
            id: broken,
            policy: EgressPolicy::default(),
        },
    ];
    let (pool, rec) = Pool::start(w.pool_config(0, 8), &in_use).unwrap();
    assert_eq!(rec.adopted.len(), 1);
    assert_eq!(rec.missing, vec![7, broken]);
    assert!(!rec.removed.contains(&running_id));
    assert!(rec.removed.len() >= 2, "{rec:?}");
    let sfv: Vec<String> = w
        .host_links()
        .into_iter()
        .filter(|l| l.starts_with("sfv-"))
        .collect();
    assert_eq!(sfv, vec![format!("sfv-{running_id}")]);
    assert_eq!(w.anchors(), vec![format!("sf-{running_id}")]);

    // The adopted slot works, with its stored policy.
    let mut slot = rec.adopted.into_iter().next().unwrap();
    assert_eq!(slot.policy(), &stored);
    let g = Guest::attach(&w, "g", &slot);
    assert_eq!(g.ask(WEB_A, "x"), None);
    pool.set_policy(&mut slot, EgressPolicy::default()).unwrap();
    assert!(g.ask(WEB_A, "x").is_some());
    drop(g);
    pool.release(slot);
    pool.shutdown(true).unwrap();
}

#[test]
fn nothing_is_left_after_a_clean_stop() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(4, 8), &[]).unwrap();
    assert!(pool.wait_ready(4, Duration::from_secs(10)));
    let s = pool.take(&EgressPolicy::default()).unwrap();
    let gone = pool.take(&EgressPolicy::default()).unwrap();
    pool.destroy(gone).unwrap();
    pool.release(s);
    assert!(table_exists_in(&w.host_path, "sf_host").unwrap());
    pool.shutdown(true).unwrap();
    assert!(
        w.host_links().iter().all(|l| !l.starts_with("sfv-")),
        "{:?}",
        w.host_links()
    );
    assert!(w.anchors().is_empty(), "{:?}", w.anchors());
    assert!(!table_exists_in(&w.host_path, "sf_host").unwrap());
    let routes = ip_out(&w.host_path, "route");
    assert!(
        !routes.contains("10.11.") && !routes.contains("10.12."),
        "{routes}"
    );
}

#[test]
fn start_refuses_a_clashing_route() {
    if !privileged() {
        return;
    }
    let w = World::new();
    ip(&w.host_path, "route add 10.0.0.0/8 via 198.51.100.2");
    let e = Pool::start(w.pool_config(0, 8), &[]).expect_err("clash refused");
    assert!(e.to_string().contains("10.0.0.0/8"), "{e}");
}

#[test]
fn a_child_process_started_in_the_slot_sees_its_tap() {
    if !privileged() {
        return;
    }
    use std::os::fd::AsFd;
    use std::os::unix::process::CommandExt;
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(1, 2), &[]).unwrap();
    let slot = pool.take(&EgressPolicy::default()).unwrap();
    let ns = slot.open_netns().unwrap();
    let mut cmd = std::process::Command::new("cat");
    cmd.arg("/proc/self/net/dev"); // follows the process's namespace (sysfs would not)
    // SAFETY: the closure only makes the setns system call.
    unsafe {
        let fd = ns.as_fd().try_clone_to_owned().unwrap();
        cmd.pre_exec(move || sandfork_network::netns::enter(fd.as_fd()));
    }
    let out = cmd.output().unwrap();
    let dev = String::from_utf8_lossy(&out.stdout);
    assert!(dev.contains("tap0:") && dev.contains("eth0:"), "{dev}");
    assert!(!dev.contains("up0:"), "{dev}");
    pool.release(slot);
    pool.shutdown(true).unwrap();
}

#[test]
fn tcp_mss_is_clamped_to_a_smaller_uplink_mtu() {
    if !privileged() {
        return;
    }
    let w = World::new();
    // The node's uplink takes 1400-byte packets, the guest and the internet 1500.
    ip(&w.host_path, &format!("link set {UPLINK} mtu 1400"));
    let (pool, _) = Pool::start(w.pool_config(1, 2), &[]).unwrap();
    let slot = pool.take(&EgressPolicy::default()).unwrap();
    let g = Guest::attach(&w, "g", &slot);
    let a = g.ask(WEB_A, "mss").expect("online");
    let mss: u32 = a
        .strip_prefix("mss=")
        .and_then(|m| m.parse().ok())
        .expect(&a);
    // 1400 - 40 bytes of headers, less TCP options; unclamped it would be 1448.
    assert!(mss <= 1360, "server sends segments of {mss} bytes");
    drop(g);
    pool.release(slot);
    pool.shutdown(true).unwrap();
}

#[test]
fn a_foreign_forward_drop_policy_is_reported() {
    if !privileged() {
        return;
    }
    use sandfork_network::nft::rules::{BaseChain, Chain, Hook, Table};
    let w = World::new();
    let docker_like = Table {
        name: "fw",
        chains: vec![Chain {
            name: "FORWARD",
            base: Some(BaseChain {
                hook: Hook::Forward,
                priority: 0,
                kind: "filter",
            }),
        }],
        rules: vec![],
    };
    sandfork_network::nft::install_table_in(&w.host_path, &docker_like, true).unwrap();
    let (pool, _) = Pool::start(w.pool_config(0, 2), &[]).unwrap();
    assert_eq!(pool.warnings().len(), 1, "{:?}", pool.warnings());
    assert!(
        pool.warnings()[0].contains("FORWARD"),
        "{:?}",
        pool.warnings()
    );
    pool.shutdown(true).unwrap();
    let (pool, _) = {
        sandfork_network::nft::install_table_in(&w.host_path, &docker_like, false).unwrap();
        Pool::start(w.pool_config(0, 2), &[]).unwrap()
    };
    assert!(pool.warnings().is_empty(), "{:?}", pool.warnings());
    pool.shutdown(true).unwrap();
}

/// `net_slot_setup_ms` and `net_policy_replace_ms`: run with `--ignored --nocapture`.
#[test]
#[ignore]
fn bench_net_slot_setup() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let n = 200;
    let (setup, replace) =
        sandfork_network::bench::slot_setup_times(&w.pool_config(0, n), n).unwrap();
    for (key, times) in [
        ("net_slot_setup_ms", setup),
        ("net_policy_replace_ms", replace),
    ] {
        let p = |q| sandfork_network::bench::percentile_ms(&times, q);
        println!(
            "{key} p50 {:.2} p99 {:.2} max {:.2} (n={n})",
            p(50),
            p(99),
            p(100)
        );
    }
}

/// Sends `bytes` from the guest to `addr` and returns all it answers before closing (empty
/// when the connection fails or is closed unanswered).
fn exchange(g: &Guest, addr: SocketAddrV4, bytes: Vec<u8>) -> Vec<u8> {
    use std::io::{Read, Write};
    sandfork_network::netns::run_in(&g.ns, move || {
        let Ok(mut s) =
            std::net::TcpStream::connect_timeout(&addr.into(), Duration::from_millis(2500))
        else {
            return Ok(Vec::new());
        };
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(&bytes);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        Ok(out)
    })
    .unwrap()
}

/// A stand-in TLS server on `addr` in the internet: reads a ClientHello and answers
/// `tls <sni>` (no handshake: only what reached it matters).
fn tls_server(w: &World, addr: SocketAddrV4) {
    use sandfork_network::egress::{Parse, sni};
    use std::io::{Read, Write};
    let l = sandfork_network::netns::run_in(&w.inet, || {
        std::net::TcpListener::bind(addr).map_err(|e| Error::Plan(e.to_string()))
    })
    .unwrap();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            std::thread::spawn(move || {
                c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while let Ok(n) = c.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    match sni::server_name(&buf) {
                        Parse::NeedMore => continue,
                        Parse::Done(name) => {
                            let _ = write!(c, "tls {}", name.unwrap_or_default());
                        }
                        Parse::Invalid => {}
                    }
                    break;
                }
            });
        }
    });
}

#[test]
fn domain_rules_pass_web_traffic_by_host_and_sni_through_the_egress_proxy() {
    use sandfork_network::egress::{EgressProxy, ProxyTarget, TargetLookup, sni};
    use sandfork_network::plan::{EGRESS_PROXY_HTTP_PORT, EGRESS_PROXY_TLS_PORT};
    use std::sync::atomic::Ordering;
    if !privileged() {
        return;
    }
    let w = World::new();
    tls_server(&w, SocketAddrV4::new(WEB_A, 443));
    let (pool, _) = Pool::start(w.pool_config(1, 4), &[]).unwrap();
    let domains = policy(None, &["allowed.test", "*.wild.test"], &[ALL_TRAFFIC]);
    let mut slot = pool.take(&domains).unwrap();
    let g = Guest::attach(&w, "g", &slot);
    // What the node keeps: each running slot's policy and namespace by its host address.
    let table: Arc<RwLock<HashMap<Ipv4Addr, ProxyTarget>>> = Arc::default();
    let set = |slot: &sandfork_network::Slot| {
        table.write().unwrap().insert(
            slot.addrs().host_ip,
            ProxyTarget {
                policy: slot.policy().clone(),
                netns: slot.anchor().to_owned(),
            },
        );
    };
    set(&slot);
    let t2 = table.clone();
    let lookup: Arc<TargetLookup> = Arc::new(move |ip| t2.read().unwrap().get(&ip).cloned());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _in_rt = rt.enter();
    // What the node's DNS forwarder told this sandbox (the guest resolves no name here).
    let answers = Arc::new(sandfork_network::dns::Answers::default());
    for name in ["allowed.test", "a.wild.test", "x.wild.test", "other.test"] {
        answers.note(
            slot.addrs().host_ip,
            name,
            &[WEB_A],
            Duration::from_secs(60),
        );
    }
    let proxy = EgressProxy::start(
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, EGRESS_PROXY_HTTP_PORT),
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, EGRESS_PROXY_TLS_PORT),
        lookup,
        sandfork_network::policy::always_deny(&[]),
        answers.clone(),
        Some(w.host_path.clone()),
    )
    .unwrap();

    let get = |host: &str| format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").into_bytes();
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    let web_a = SocketAddrV4::new(WEB_A, 80);
    let tls_a = SocketAddrV4::new(WEB_A, 443);
    // HTTP by Host: the server sees the request line, from the node's uplink address.
    let got = text(exchange(&g, web_a, get("allowed.test")));
    assert!(
        got.starts_with("203.0.113.10 GET / HTTP/1.1 198.51.100.1:"),
        "{got}"
    );
    let got = text(exchange(&g, web_a, get("a.wild.test:80")));
    assert!(got.starts_with("203.0.113.10 GET"), "{got}");
    for denied in ["other.test", "wild.test", "allowed.test.evil"] {
        let got = text(exchange(&g, web_a, get(denied)));
        assert!(got.starts_with("HTTP/1.1 403 Forbidden"), "{denied}: {got}");
    }
    // TLS by SNI, the ClientHello in one record or in many.
    assert_eq!(
        text(exchange(
            &g,
            tls_a,
            sni::client_hello(Some("allowed.test"), 16384)
        )),
        "tls allowed.test"
    );
    assert_eq!(
        text(exchange(
            &g,
            tls_a,
            sni::client_hello(Some("x.wild.test"), 50)
        )),
        "tls x.wild.test"
    );
    let alert = vec![21, 3, 3, 0, 2, 2, 112];
    assert_eq!(
        exchange(&g, tls_a, sni::client_hello(Some("other.test"), 16384)),
        alert
    );
    assert_eq!(exchange(&g, tls_a, sni::client_hello(None, 16384)), alert);
    // Garbage is closed unanswered; other ports stay on the kernel's rules (denied).
    assert!(exchange(&g, tls_a, b"GET / HTTP/1.1\r\n\r\n".to_vec()).is_empty());
    assert!(exchange(&g, web_a, vec![0; 64]).is_empty());
    assert_eq!(g.ask(WEB_B, "x").map(|_| ()), None);
    assert!(exchange(&g, SocketAddrV4::new(WEB_A, 8080), get("allowed.test")).is_empty());
    // An allowed name never opens a forbidden address.
    let got = text(exchange(
        &g,
        SocketAddrV4::new(PRIVATE, 80),
        get("allowed.test"),
    ));
    assert!(got.starts_with("HTTP/1.1 403"), "{got}");
    let got = text(exchange(
        &g,
        SocketAddrV4::new(METADATA, 80),
        get("allowed.test"),
    ));
    assert!(got.starts_with("HTTP/1.1 403"), "{got}");
    // Nor a public one its DNS did not give for the name (WEB_B serves port 80).
    let got = text(exchange(
        &g,
        SocketAddrV4::new(WEB_B, 80),
        get("allowed.test"),
    ));
    assert!(
        got.starts_with("HTTP/1.1 403") && got.contains("is not an address"),
        "{got}"
    );
    answers.note(
        slot.addrs().host_ip,
        "allowed.test",
        &[WEB_B],
        Duration::from_secs(60),
    );
    let got = text(exchange(
        &g,
        SocketAddrV4::new(WEB_B, 80),
        get("allowed.test"),
    ));
    assert!(got.starts_with("203.0.113.11 GET"), "{got}");
    // The guest cannot use the proxy's ports directly as a way out either.
    let direct = SocketAddrV4::new(slot.addrs().veth_host_ip, EGRESS_PROXY_HTTP_PORT);
    let got = text(exchange(&g, direct, get("allowed.test")));
    assert!(got.is_empty() || got.starts_with("HTTP/1.1 403"), "{got}");

    // What the proxy costs a connection (conntrack lookup, head read, dial): fetches by
    // name through it against the same fetches of an allowed address (kernel path).
    let timed = |g: &Guest, n: u32| {
        let t = std::time::Instant::now();
        for _ in 0..n {
            let got = text(exchange(g, web_a, get("allowed.test")));
            assert!(got.starts_with("203.0.113.10 GET"), "{got}");
        }
        t.elapsed().as_secs_f64() * 1e3 / f64::from(n)
    };
    let proxied_ms = timed(&g, 20);
    pool.set_policy(
        &mut slot,
        policy(None, &["allowed.test", "203.0.113.10"], &[ALL_TRAFFIC]),
    )
    .unwrap();
    set(&slot);
    let direct_ms = timed(&g, 20);
    eprintln!("HTTP fetch: {proxied_ms:.2} ms through the egress proxy, {direct_ms:.2} ms direct");

    // A policy replaced live: the new name passes, the old one no longer.
    let replaced = policy(None, &["other.test"], &[ALL_TRAFFIC]);
    pool.set_policy(&mut slot, replaced).unwrap();
    set(&slot);
    let got = text(exchange(&g, web_a, get("other.test")));
    assert!(got.starts_with("203.0.113.10 GET"), "{got}");
    let got = text(exchange(&g, web_a, get("allowed.test")));
    assert!(got.starts_with("HTTP/1.1 403"), "{got}");
    // Without domain rules the proxy is out of the path: the kernel's rules decide.
    pool.set_policy(&mut slot, policy(None, &[], &["203.0.113.11"]))
        .unwrap();
    set(&slot);
    assert!(g.ask(WEB_A, "plain").unwrap().contains("plain"));
    assert_eq!(g.ask(WEB_B, "plain"), None);
    let stats = proxy.stats();
    eprintln!(
        "proxy: {} allowed, {} denied, {} dropped, {} unreachable",
        stats.allowed.load(Ordering::Relaxed),
        stats.denied.load(Ordering::Relaxed),
        stats.dropped.load(Ordering::Relaxed),
        stats.unreachable.load(Ordering::Relaxed)
    );
    assert_eq!(stats.allowed.load(Ordering::Relaxed), 6 + 20);
    drop(proxy);
    drop(g);
    pool.release(slot);
    pool.shutdown(true).unwrap();
}
