//! The node-wide table `inet sf_host` in the host namespace, created once with a constant
//! rule count (slot veths are matched by name prefix, so adding a slot touches no rule):
//! forward slot veths to and from the uplink only, masquerade the slots' host range out of
//! the uplink, clamp the TCP MSS to the route's MTU, and keep new guest connections away
//! from the node itself except on the ports given.

use super::rules::*;
use crate::plan::{Cidr4, HOST_VETH_PREFIX};

pub const TABLE: &str = "sf_host";

/// The host table for uplink `uplink`, slot host range `host_ips`, and the node ports
/// (protocol, port) guests may open (a DNS forwarder, later).
pub fn table(uplink: &str, host_ips: Cidr4, open_ports: &[(u8, u16)]) -> Table {
    let chains = vec![
        Chain::base("forward", Hook::Forward, 0, "filter"),
        Chain::base("input", Hook::Input, 0, "filter"),
        Chain::base("post_nat", Hook::Postrouting, 100, "nat"),
    ];
    let mut rules = vec![
        Rule::new(
            "forward",
            [iif_prefix(HOST_VETH_PREFIX), tcp_syn()],
            clamp_mss(),
        ),
        Rule::new(
            "forward",
            [oif_prefix(HOST_VETH_PREFIX), tcp_syn()],
            clamp_mss(),
        ),
        Rule::new(
            "forward",
            [iif_prefix(HOST_VETH_PREFIX), oif(uplink)],
            accept(),
        ),
        Rule::new(
            "forward",
            [iif(uplink), oif_prefix(HOST_VETH_PREFIX), established()],
            accept(),
        ),
        // Nothing else between slots, or from elsewhere into them.
        Rule::new("forward", [iif_prefix(HOST_VETH_PREFIX)], drop()),
        Rule::new("forward", [oif_prefix(HOST_VETH_PREFIX)], drop()),
        Rule::new(
            "input",
            [iif_prefix(HOST_VETH_PREFIX), established()],
            accept(),
        ),
    ];
    for (proto, port) in open_ports {
        rules.push(Rule::new(
            "input",
            [iif_prefix(HOST_VETH_PREFIX), dport(*proto, *port)],
            accept(),
        ));
    }
    rules.push(Rule::new("input", [iif_prefix(HOST_VETH_PREFIX)], drop()));
    rules.push(Rule::new(
        "post_nat",
        [oif(uplink), ip_saddr_in(host_ips)],
        vec![super::expr::Expr::Masquerade],
    ));
    Table {
        name: TABLE,
        chains,
        rules,
    }
}

#[cfg(test)]
mod tests {
    use super::super::expr::{Expr, Verdict};
    use super::*;

    #[test]
    fn constant_rules_with_masquerade_and_clamp() {
        let t = table("up0", "10.11.0.0/16".parse().unwrap(), &[(17, 53)]);
        let fwd: Vec<&Rule> = t.rules.iter().filter(|r| r.chain == "forward").collect();
        // clamps first (no verdict), then the accepts, then the drops
        assert!(fwd[0].exprs.ends_with(&[Expr::RtTcpMss, Expr::SetTcpMss]));
        assert_eq!(fwd[2].exprs.last(), Some(&Expr::Verdict(Verdict::Accept)));
        assert_eq!(fwd[5].exprs.last(), Some(&Expr::Verdict(Verdict::Drop)));
        let input: Vec<&Rule> = t.rules.iter().filter(|r| r.chain == "input").collect();
        assert_eq!(input.len(), 3); // established, the open port, drop
        let nat = t.rules.iter().find(|r| r.chain == "post_nat").unwrap();
        assert_eq!(nat.exprs.last(), Some(&Expr::Masquerade));
        assert!(nat.exprs.contains(&Expr::Bitwise {
            mask: vec![255, 255, 0, 0],
            xor: vec![0; 4]
        }));
        // slots are matched by prefix: the rule count does not grow with them
        assert_eq!(t.rules.len(), 10);
    }
}
