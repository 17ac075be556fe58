//! The slot's table `inet sf`, inside its namespace: anti-spoofing on the tap, NAT between the
//! guest address and the slot's host address, the egress policy, and no access to the slot
//! namespace itself.

use std::net::Ipv4Addr;

use super::expr::NatKind;
use super::rules::*;
use crate::plan::{
    Cidr4, DNS_FORWARDER_PORT, GATEWAY_IP, GUEST_DNS_PORT, GUEST_IP, GUEST_MAC, PROXIED_PORTS,
    SLOT_VETH_NAME, TAP_NAME,
};
use crate::policy::EgressPolicy;

pub const TABLE: &str = "sf";
/// The regular chain holding the user's allow and deny rules; a policy replace rewrites it.
pub const USER_CHAIN: &str = "user";
/// The regular (NAT) chain sending web traffic to the egress proxy when the policy has
/// domain rules; a policy replace rewrites it with the user chain.
pub const PROXY_CHAIN: &str = "web_proxy";
const ALWAYS_DENY_CHAIN: &str = "always_deny";

/// The whole slot table for host address `host_ip` and veth host end `veth_host_ip` (where
/// the node's DNS forwarder listens), with `policy`.
pub fn table(
    host_ip: Ipv4Addr,
    veth_host_ip: Ipv4Addr,
    always_deny: &[Cidr4],
    policy: &EgressPolicy,
) -> Table {
    let chains = vec![
        // Before conntrack (-200): a spoofed frame never creates state.
        Chain::base("guard", Hook::Prerouting, -300, "filter"),
        Chain::base("pre_nat", Hook::Prerouting, -100, "nat"),
        Chain::base("egress", Hook::Forward, 0, "filter"),
        Chain::base("to_slot", Hook::Input, 0, "filter"),
        Chain::base("post_nat", Hook::Postrouting, 100, "nat"),
        Chain {
            name: ALWAYS_DENY_CHAIN,
            base: None,
        },
        Chain {
            name: USER_CHAIN,
            base: None,
        },
        Chain {
            name: PROXY_CHAIN,
            base: None,
        },
    ];
    const UDP: u8 = libc::IPPROTO_UDP as u8;
    const TCP: u8 = libc::IPPROTO_TCP as u8;
    // The DNATed DNS queries pass before the always-deny list (the forwarder is on a private
    // address) and under any user policy (the forwarder applies it to names).
    let to_forwarder = |proto| {
        Rule::new(
            "egress",
            [
                iif(TAP_NAME),
                ip_daddr(veth_host_ip),
                dport(proto, DNS_FORWARDER_PORT),
            ],
            accept(),
        )
    };
    let to_proxy = |port| {
        Rule::new(
            "egress",
            [iif(TAP_NAME), ip_daddr(veth_host_ip), dport(TCP, port)],
            accept(),
        )
    };
    let mut rules = vec![
        // Only the guest's MAC and IPv4 address may leave the tap; no IPv6 at all.
        Rule::new("guard", [iif(TAP_NAME), ether_saddr_not(GUEST_MAC)], drop()),
        Rule::new("guard", [iif(TAP_NAME), ipv6()], drop()),
        Rule::new("guard", [iif(TAP_NAME), ip_saddr_not(GUEST_IP)], drop()),
        Rule::new("guard", [ipv6()], drop()),
        Rule::new(
            "pre_nat",
            [iif(SLOT_VETH_NAME), ip_daddr(host_ip)],
            nat_to(NatKind::Dnat, GUEST_IP),
        ),
        Rule::new(
            "post_nat",
            [oif(SLOT_VETH_NAME), ip_saddr_in(Cidr4::host(GUEST_IP))],
            nat_to(NatKind::Snat, host_ip),
        ),
        // Egress: only what the guest starts is policed; answers to it pass.
        Rule::new("egress", [not_iif(TAP_NAME)], accept()),
        Rule::new("egress", [established()], accept()),
        to_forwarder(UDP),
        to_forwarder(TCP),
        // Likewise the connections the proxy chain DNATed to the egress proxy (it applies the
        // policy and the always-deny list to their original destinations).
        to_proxy(crate::plan::EGRESS_PROXY_HTTP_PORT),
        to_proxy(crate::plan::EGRESS_PROXY_TLS_PORT),
        Rule::new("egress", [], jump(ALWAYS_DENY_CHAIN)),
        Rule::new("egress", [], jump(USER_CHAIN)),
        // The guest may answer but not connect to anything in the slot namespace.
        Rule::new("to_slot", [iif(TAP_NAME), established()], accept()),
        Rule::new("to_slot", [iif(TAP_NAME)], drop()),
    ];
    // The guest's resolver (its gateway) is the node's forwarder, over UDP and TCP.
    for proto in [UDP, TCP] {
        rules.push(Rule::new(
            "pre_nat",
            [
                iif(TAP_NAME),
                ip_daddr(GATEWAY_IP),
                dport(proto, GUEST_DNS_PORT),
            ],
            nat_to_port(NatKind::Dnat, veth_host_ip, DNS_FORWARDER_PORT),
        ));
    }
    rules.push(Rule::new("pre_nat", [iif(TAP_NAME)], jump(PROXY_CHAIN)));
    for c in always_deny {
        rules.push(Rule::new(ALWAYS_DENY_CHAIN, [ip_daddr_in(*c)], reject()));
    }
    rules.extend(user_rules(policy));
    rules.extend(proxy_rules(policy, veth_host_ip));
    Table {
        name: TABLE,
        chains,
        rules,
    }
}

/// The user chain's rules: allows first (allow beats deny), then denies; the rest falls
/// through to the egress chain's accept.
pub fn user_rules(policy: &EgressPolicy) -> Vec<Rule> {
    let mut v = Vec::new();
    for c in &policy.allow {
        v.push(Rule::new(USER_CHAIN, [ip_daddr_in(*c)], accept()));
    }
    for c in &policy.deny {
        v.push(Rule::new(USER_CHAIN, [ip_daddr_in(*c)], reject()));
    }
    v
}

/// The proxy chain's rules: empty without domain rules; with them, allowed CIDRs keep the
/// kernel path and the guest's other TCP to ports 80 and 443 is DNATed to the egress proxy
/// on the veth's host end (the first packet of a connection only: NAT chains see no other).
pub fn proxy_rules(policy: &EgressPolicy, veth_host_ip: Ipv4Addr) -> Vec<Rule> {
    if !policy.proxied() {
        return Vec::new();
    }
    let mut v = Vec::new();
    for c in &policy.allow {
        v.push(Rule::new(PROXY_CHAIN, [ip_daddr_in(*c)], accept()));
    }
    for (guest_port, proxy_port) in PROXIED_PORTS {
        v.push(Rule::new(
            PROXY_CHAIN,
            [dport(libc::IPPROTO_TCP as u8, guest_port)],
            nat_to_port(NatKind::Dnat, veth_host_ip, proxy_port),
        ));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::expr::{Expr, Verdict};
    use super::*;
    use crate::policy::{ALL_TRAFFIC, always_deny};

    #[test]
    fn egress_order_is_always_deny_then_user() {
        let t = table(
            "10.11.0.1".parse().unwrap(),
            "10.12.0.2".parse().unwrap(),
            &always_deny(&[]),
            &EgressPolicy::default(),
        );
        let egress: Vec<&Rule> = t.rules.iter().filter(|r| r.chain == "egress").collect();
        assert_eq!(egress.len(), 8);
        // the DNS forwarder (a private address), UDP and TCP, and the egress proxy's two
        // ports, before the always-deny list
        for r in &egress[2..6] {
            assert!(r.exprs.contains(&Expr::Cmp {
                op: super::super::expr::CmpOp::Eq,
                data: vec![10, 12, 0, 2]
            }));
            assert_eq!(r.exprs.last(), Some(&Expr::Verdict(Verdict::Accept)));
        }
        assert_eq!(
            egress[6].exprs.last(),
            Some(&Expr::Verdict(Verdict::Jump(ALWAYS_DENY_CHAIN.into())))
        );
        assert_eq!(
            egress[7].exprs.last(),
            Some(&Expr::Verdict(Verdict::Jump(USER_CHAIN.into())))
        );
        assert_eq!(
            t.rules
                .iter()
                .filter(|r| r.chain == ALWAYS_DENY_CHAIN)
                .count(),
            10
        );
        assert_eq!(t.rules.iter().filter(|r| r.chain == USER_CHAIN).count(), 0);
        assert_eq!(t.rules.iter().filter(|r| r.chain == PROXY_CHAIN).count(), 0);
    }

    #[test]
    fn domain_rules_send_web_ports_to_the_proxy_but_not_allowed_cidrs() {
        let p = EgressPolicy::from_e2b(
            None,
            &["allowed.test".into(), "203.0.113.10".into()],
            &[ALL_TRAFFIC.into()],
        )
        .unwrap();
        let veth: Ipv4Addr = "10.12.0.2".parse().unwrap();
        let r = proxy_rules(&p, veth);
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].exprs.last(), Some(&Expr::Verdict(Verdict::Accept)));
        for (rule, (guest, proxy)) in r[1..].iter().zip(PROXIED_PORTS) {
            assert!(rule.exprs.contains(&Expr::Cmp {
                op: super::super::expr::CmpOp::Eq,
                data: guest.to_be_bytes().to_vec()
            }));
            assert!(rule.exprs.ends_with(&[
                Expr::Load(veth.octets().to_vec()),
                Expr::LoadPort(proxy),
                Expr::NatPort(NatKind::Dnat)
            ]));
        }
        // the user chain still rejects the rest: allow, then deny all
        assert_eq!(user_rules(&p).len(), 2);
    }

    #[test]
    fn user_rules_put_allow_before_deny() {
        let p =
            EgressPolicy::from_e2b(None, &["203.0.113.10".into()], &[ALL_TRAFFIC.into()]).unwrap();
        let r = user_rules(&p);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].exprs.last(), Some(&Expr::Verdict(Verdict::Accept)));
        assert_eq!(r[1].exprs.last(), Some(&Expr::RejectAdminProhibited));
    }

    #[test]
    fn nat_uses_slot_host_ip() {
        let t = table(
            "10.11.0.7".parse().unwrap(),
            "10.12.0.14".parse().unwrap(),
            &[],
            &EgressPolicy::default(),
        );
        let snat = t.rules.iter().find(|r| r.chain == "post_nat").unwrap();
        assert!(snat.exprs.contains(&Expr::Load(vec![10, 11, 0, 7])));
        let dnat: Vec<&Rule> = t.rules.iter().filter(|r| r.chain == "pre_nat").collect();
        assert!(
            dnat[0]
                .exprs
                .contains(&Expr::Load(GUEST_IP.octets().to_vec()))
        );
        // the gateway's DNS port goes to the forwarder on the veth's host end, then the jump
        // to the proxy chain
        assert_eq!(dnat.len(), 4);
        for r in &dnat[1..3] {
            assert!(r.exprs.ends_with(&[
                Expr::Load(vec![10, 12, 0, 14]),
                Expr::LoadPort(DNS_FORWARDER_PORT),
                Expr::NatPort(NatKind::Dnat)
            ]));
        }
    }
}
