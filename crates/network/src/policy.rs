//! Egress policy: E2B's `allow_internet_access` and `network.allowOut` / `denyOut`, validated
//! with E2B's error texts, resolved into the CIDR lists the slot's egress chain enforces.

use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::plan::Cidr4;

/// E2B's `ALL_TRAFFIC`.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// Destinations no user rule can open: "this network", private ranges, CGNAT, loopback,
/// link-local (the metadata address 169.254.169.254 and the guest link included), IETF
/// protocol assignments, benchmarking, multicast and reserved. Covers the slot ranges
/// (10.11/16, 10.12/16), so one sandbox can never reach another.
pub const ALWAYS_DENY: [Cidr4; 10] = [
    Cidr4::fixed(Ipv4Addr::new(0, 0, 0, 0), 8),
    Cidr4::fixed(Ipv4Addr::new(10, 0, 0, 0), 8),
    Cidr4::fixed(Ipv4Addr::new(100, 64, 0, 0), 10),
    Cidr4::fixed(Ipv4Addr::new(127, 0, 0, 0), 8),
    Cidr4::fixed(Ipv4Addr::new(169, 254, 0, 0), 16),
    Cidr4::fixed(Ipv4Addr::new(172, 16, 0, 0), 12),
    Cidr4::fixed(Ipv4Addr::new(192, 0, 0, 0), 24),
    Cidr4::fixed(Ipv4Addr::new(192, 168, 0, 0), 16),
    Cidr4::fixed(Ipv4Addr::new(198, 18, 0, 0), 15),
    Cidr4::fixed(Ipv4Addr::new(224, 0, 0, 0), 3),
];

/// E2B's 400 when domains are allowed without denying everything else.
pub const ERR_DOMAINS_NEED_ALL_TRAFFIC: &str = "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' in deny out to block all other traffic.";

/// A domain rule of `allowOut`: exact (case-insensitive), `*` (any), or `*.suffix`
/// (subdomains, not the apex). Kept for the egress proxy; not enforced by the kernel rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainPattern(String);

impl DomainPattern {
    pub fn parse(s: &str) -> Option<Self> {
        let d = s.trim_end_matches('.').to_ascii_lowercase();
        if d == "*" {
            return Some(DomainPattern(d));
        }
        let host = d.strip_prefix("*.").unwrap_or(&d);
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        (host.len() <= 253 && host.split('.').all(label_ok)).then_some(DomainPattern(d))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `host` (a Host header or SNI name) matches this pattern.
    pub fn matches(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        match self.0.as_str() {
            "*" => true,
            p => match p.strip_prefix("*.") {
                Some(suffix) => host
                    .strip_suffix(suffix)
                    .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.')),
                None => host == p,
            },
        }
    }
}

/// A sandbox's egress policy, resolved and valid. The default allows all but always-deny.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressPolicy {
    /// Allowed networks: beat `deny`, never always-deny.
    pub allow: Vec<Cidr4>,
    pub deny: Vec<Cidr4>,
    /// Domain rules (only with `0.0.0.0/0` denied): the slot sends the guest's TCP to ports
    /// 80 and 443 through the node's egress proxy, which checks the request's Host or the
    /// TLS SNI against them ([`EgressPolicy::permits_named`]).
    pub allow_domains: Vec<DomainPattern>,
}

enum Entry {
    V4(Cidr4),
    /// IPv6 rules are accepted as E2B does, but slots carry no IPv6: all of it is dropped.
    V6,
    Domain(DomainPattern),
}

fn classify(s: &str) -> Option<Entry> {
    let s = s.trim();
    if let Ok(c) = s.parse::<Cidr4>() {
        return Some(Entry::V4(c));
    }
    let (addr, len) = s.split_once('/').unwrap_or((s, "128"));
    if let Ok(IpAddr::V6(_)) = addr.parse::<IpAddr>() {
        return len
            .parse::<u8>()
            .ok()
            .filter(|l| *l <= 128)
            .map(|_| Entry::V6);
    }
    if s.contains('/')
        || s.parse::<IpAddr>().is_ok()
        || s.bytes().all(|b| b.is_ascii_digit() || b == b'.')
    {
        return None; // a malformed address, not a domain
    }
    DomainPattern::parse(s).map(Entry::Domain)
}

impl EgressPolicy {
    /// Everything denied (`allow_internet_access = false`).
    pub fn deny_all() -> Self {
        EgressPolicy {
            deny: vec![const { Cidr4::fixed(Ipv4Addr::UNSPECIFIED, 0) }],
            ..Default::default()
        }
    }

    /// The policy of a create or `PUT /network` body, E2B's rules: `allow_internet_access =
    /// false` replaces `denyOut` with all traffic; domains may only be allowed with all
    /// traffic denied; deny entries are addresses or CIDRs, `0.0.0.0` alone is refused.
    /// Errors are the 400's message.
    pub fn from_e2b(
        allow_internet_access: Option<bool>,
        allow_out: &[String],
        deny_out: &[String],
    ) -> Result<Self> {
        let mut p = EgressPolicy::default();
        let mut denies_all = false;
        for d in deny_out {
            match classify(d) {
                Some(Entry::V4(c)) => {
                    if c.prefix_len() == 32 && c.addr().is_unspecified() {
                        return Err(Error::InvalidPolicy(format!(
                            "invalid denied CIDR {d}: the address must be specified"
                        )));
                    }
                    denies_all |= c.prefix_len() == 0;
                    p.deny.push(c);
                }
                Some(Entry::V6) => {}
                Some(Entry::Domain(_)) => {
                    return Err(Error::InvalidPolicy(format!(
                        "invalid denied CIDR {d}: deny out takes IP addresses and CIDRs only"
                    )));
                }
                None => {
                    return Err(Error::InvalidPolicy(format!("invalid denied CIDR {d}")));
                }
            }
        }
        for a in allow_out {
            match classify(a) {
                Some(Entry::V4(c)) => p.allow.push(c),
                Some(Entry::V6) => {}
                Some(Entry::Domain(d)) => p.allow_domains.push(d),
                None => return Err(Error::InvalidPolicy(format!("invalid allowed entry {a}"))),
            }
        }
        if !p.allow_domains.is_empty() && !denies_all {
            return Err(Error::InvalidPolicy(ERR_DOMAINS_NEED_ALL_TRAFFIC.into()));
        }
        if allow_internet_access == Some(false) {
            p.deny = EgressPolicy::deny_all().deny;
        }
        p.allow.sort();
        p.allow.dedup();
        p.deny.sort();
        p.deny.dedup();
        Ok(p)
    }

    /// Whether the kernel rules let a new connection to `ip` out, given the always-deny set.
    /// The reference semantics the egress chain implements (tests compare the two).
    pub fn permits(&self, ip: Ipv4Addr, always_deny: &[Cidr4]) -> bool {
        if always_deny.iter().any(|c| c.contains(ip)) {
            return false;
        }
        if self.allow.iter().any(|c| c.contains(ip)) {
            return true;
        }
        !self.deny.iter().any(|c| c.contains(ip))
    }
}

impl EgressPolicy {
    /// Whether the slot sends web traffic through the egress proxy (it has domain rules).
    pub fn proxied(&self) -> bool {
        !self.allow_domains.is_empty()
    }

    /// The egress proxy's decision for a connection to `dst` whose request names `host` (the
    /// HTTP Host or the TLS SNI; None when it names none): never an always-deny address;
    /// an allowed CIDR or a matching domain rule lets it through (allow beats deny); else
    /// the deny rules decide, as for any other traffic.
    pub fn permits_named(&self, dst: Ipv4Addr, host: Option<&str>, always_deny: &[Cidr4]) -> bool {
        if always_deny.iter().any(|c| c.contains(dst)) {
            return false;
        }
        if self.allow.iter().any(|c| c.contains(dst)) {
            return true;
        }
        if let Some(h) = host
            && self.allow_domains.iter().any(|p| p.matches(h))
        {
            return true;
        }
        !self.deny.iter().any(|c| c.contains(dst))
    }
}

/// The always-deny set: the fixed list plus the operator's extras and the node's own
/// addresses.
pub fn always_deny(extra: &[Cidr4]) -> Vec<Cidr4> {
    let mut v: Vec<Cidr4> = ALWAYS_DENY.to_vec();
    for c in extra {
        if !v
            .iter()
            .any(|d| d.prefix_len() <= c.prefix_len() && d.contains(c.addr()))
        {
            v.push(*c);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn default_allows_public_only() {
        let p = EgressPolicy::from_e2b(None, &[], &[]).unwrap();
        let ad = always_deny(&[]);
        assert!(p.permits("203.0.113.10".parse().unwrap(), &ad));
        for ip in [
            "169.254.169.254",
            "192.168.77.10",
            "10.11.0.2",
            "127.0.0.1",
            "100.64.1.1",
            "224.0.0.1",
            "255.255.255.255",
            "0.1.2.3",
        ] {
            assert!(!p.permits(ip.parse().unwrap(), &ad), "{ip}");
        }
    }

    #[test]
    fn allow_beats_deny_and_always_deny_beats_allow() {
        let p = EgressPolicy::from_e2b(
            None,
            &s(&["203.0.113.10", "192.168.0.0/16"]),
            &s(&[ALL_TRAFFIC]),
        )
        .unwrap();
        let ad = always_deny(&[]);
        assert!(p.permits("203.0.113.10".parse().unwrap(), &ad));
        assert!(!p.permits("203.0.113.11".parse().unwrap(), &ad));
        assert!(!p.permits("192.168.77.10".parse().unwrap(), &ad));
    }

    #[test]
    fn internet_access_false_denies_all() {
        let p = EgressPolicy::from_e2b(Some(false), &s(&["8.8.8.8"]), &s(&["1.1.1.1"])).unwrap();
        assert_eq!(p.deny, EgressPolicy::deny_all().deny);
        assert!(p.permits("8.8.8.8".parse().unwrap(), &[]));
        assert!(!p.permits("1.1.1.1".parse().unwrap(), &[]));
    }

    #[test]
    fn e2b_validation_texts() {
        let e = EgressPolicy::from_e2b(None, &s(&["example.com"]), &[]).unwrap_err();
        assert_eq!(e.to_string(), ERR_DOMAINS_NEED_ALL_TRAFFIC);
        let e = EgressPolicy::from_e2b(None, &s(&["example.com"]), &s(&["1.0.0.0/8"])).unwrap_err();
        assert_eq!(e.to_string(), ERR_DOMAINS_NEED_ALL_TRAFFIC);
        let p = EgressPolicy::from_e2b(
            None,
            &s(&["Example.com", "*.ok.test", "*"]),
            &s(&[ALL_TRAFFIC]),
        )
        .unwrap();
        assert_eq!(p.allow_domains.len(), 3);
        assert!(EgressPolicy::from_e2b(None, &[], &s(&["0.0.0.0"])).is_err());
        assert!(EgressPolicy::from_e2b(None, &[], &s(&["example.com"])).is_err());
        assert!(EgressPolicy::from_e2b(None, &[], &s(&["1.2.3.4/40"])).is_err());
        assert!(EgressPolicy::from_e2b(None, &s(&["300.1.1.1"]), &[]).is_err());
        assert!(EgressPolicy::from_e2b(None, &s(&["bad domain!"]), &s(&[ALL_TRAFFIC])).is_err());
        // IPv6 rules are valid and inert
        let p = EgressPolicy::from_e2b(None, &s(&["2001:db8::/32"]), &s(&["::1"])).unwrap();
        assert_eq!(p, EgressPolicy::default());
    }

    #[test]
    fn domain_patterns() {
        let exact = DomainPattern::parse("Allowed.Test").unwrap();
        assert!(exact.matches("allowed.test"));
        assert!(exact.matches("ALLOWED.test."));
        assert!(!exact.matches("a.allowed.test"));
        let wild = DomainPattern::parse("*.ok.test").unwrap();
        assert!(wild.matches("a.ok.test"));
        assert!(wild.matches("b.a.ok.test"));
        assert!(!wild.matches("ok.test"));
        assert!(!wild.matches("notok.test"));
        assert!(
            DomainPattern::parse("*")
                .unwrap()
                .matches("anything.example")
        );
        assert!(DomainPattern::parse("-bad.test").is_none());
        assert!(DomainPattern::parse("a..b").is_none());
    }

    #[test]
    fn the_proxy_decides_by_name_address_and_always_deny() {
        let p = EgressPolicy::from_e2b(
            None,
            &s(&["allowed.test", "*.wild.test", "198.51.100.7"]),
            &s(&[ALL_TRAFFIC]),
        )
        .unwrap();
        assert!(p.proxied());
        assert!(!EgressPolicy::default().proxied());
        let ad = always_deny(&[]);
        let public: Ipv4Addr = "203.0.113.10".parse().unwrap();
        assert!(p.permits_named(public, Some("allowed.test"), &ad));
        assert!(p.permits_named(public, Some("a.wild.test"), &ad));
        assert!(!p.permits_named(public, Some("wild.test"), &ad));
        assert!(!p.permits_named(public, Some("other.test"), &ad));
        assert!(!p.permits_named(public, None, &ad));
        // An allowed address needs no name; an always-denied one is never reached by name.
        assert!(p.permits_named("198.51.100.7".parse().unwrap(), None, &ad));
        for ip in ["10.11.0.3", "169.254.169.254", "127.0.0.1", "192.168.1.1"] {
            assert!(
                !p.permits_named(ip.parse().unwrap(), Some("allowed.test"), &ad),
                "{ip}"
            );
        }
        // `*` allows any name, still not the forbidden ranges.
        let any = EgressPolicy::from_e2b(None, &s(&["*"]), &s(&[ALL_TRAFFIC])).unwrap();
        assert!(any.permits_named(public, Some("whatever.example"), &ad));
        assert!(!any.permits_named(public, None, &ad));
    }

    #[test]
    fn extras_join_always_deny() {
        let ad = always_deny(&[
            "198.51.100.1/32".parse().unwrap(),
            "10.1.2.3/32".parse().unwrap(),
        ]);
        assert_eq!(ad.len(), ALWAYS_DENY.len() + 1); // 10.1.2.3 is inside 10/8 already
    }
}
