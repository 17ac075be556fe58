//! The node's DNS forwarder for guests: one UDP socket for the whole node (no per-slot cost:
//! each slot only DNATs its gateway's port 53 to it), which knows a sandbox by the slot host
//! address its queries arrive from, answers per the sandbox's policy ([`DnsAccess`]) and relays
//! what it allows to the node's resolver. Messages are parsed with `hickory-proto`; anything
//! that does not parse is dropped, never answered from. The same port serves DNS over TCP
//! (what a resolver retries with when a UDP answer comes back truncated), relayed over TCP.
//!
//! Every IPv4 address it relays to a sandbox is kept in [`Answers`] under the name the
//! sandbox asked for: the egress proxy lets an allowed name reach only those addresses,
//! so a guest cannot present an allowed Host or SNI to an address of its own choosing.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::RData;

use crate::error::{Error, Result};
use crate::policy::{DomainPattern, EgressPolicy};

/// The forwarder's port on the host side (the slot DNATs the gateway's :53 here).
pub use crate::plan::DNS_FORWARDER_PORT as FORWARDER_PORT;
/// How long a relayed query waits for the upstream's answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Relays in flight at once; past it queries are dropped (the guest's resolver retries).
const MAX_IN_FLIGHT: usize = 256;
/// The largest UDP DNS message (EDNS may go past 512).
const MAX_MESSAGE: usize = 4096;
/// TCP connections from guests served at once; past it new ones are closed.
const MAX_TCP: usize = 64;
/// How long a guest's TCP connection may sit idle.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// How long an answered address stays usable at least, whatever its TTL: programs keep
/// what they resolved longer than the TTL says (connection pools, their own caches).
const ANSWER_KEEP_MIN: Duration = Duration::from_secs(15 * 60);
/// And at most.
const ANSWER_KEEP_MAX: Duration = Duration::from_secs(24 * 3600);
/// Names kept per sandbox; past it the one expiring first goes.
const ANSWER_MAX_NAMES: usize = 4096;
/// Addresses kept per name (the latest answers').
const ANSWER_MAX_ADDRS: usize = 64;

/// The IPv4 addresses the forwarder answered each sandbox (by its slot's host address),
/// per name asked: what a name may reach through the egress proxy. Shared by the
/// forwarder (which fills it before the guest sees the answer) and the proxy.
#[derive(Debug, Default)]
pub struct Answers {
    by_source: Mutex<HashMap<Ipv4Addr, AnswersOf>>,
}

/// One sandbox's answers: by name, each address with when it stops counting.
type AnswersOf = HashMap<String, Vec<(Ipv4Addr, Instant)>>;

/// A name as the table keys it: lower case, no final dot.
fn answer_key(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

impl Answers {
    /// Keeps `addrs` as answers to `source` for `name`, for `ttl` (bounded by
    /// [`ANSWER_KEEP_MIN`] and [`ANSWER_KEEP_MAX`]).
    pub fn note(&self, source: Ipv4Addr, name: &str, addrs: &[Ipv4Addr], ttl: Duration) {
        if addrs.is_empty() {
            return;
        }
        let now = Instant::now();
        let until = now + ttl.clamp(ANSWER_KEEP_MIN, ANSWER_KEEP_MAX);
        let mut all = self.by_source.lock().unwrap_or_else(|p| p.into_inner());
        let names = all.entry(source).or_default();
        let key = answer_key(name);
        if !names.contains_key(&key) && names.len() >= ANSWER_MAX_NAMES {
            names.retain(|_, v| {
                v.retain(|(_, t)| *t > now);
                !v.is_empty()
            });
            if names.len() >= ANSWER_MAX_NAMES {
                let first = names
                    .iter()
                    .min_by_key(|(_, v)| v.iter().map(|(_, t)| *t).max())
                    .map(|(k, _)| k.clone());
                if let Some(k) = first {
                    names.remove(&k);
                }
            }
        }
        let kept = names.entry(key).or_default();
        kept.retain(|(ip, t)| *t > now && !addrs.contains(ip));
        kept.extend(addrs.iter().map(|ip| (*ip, until)));
        let over = kept.len().saturating_sub(ANSWER_MAX_ADDRS);
        kept.drain(..over);
    }

    /// Keeps the A records of `answer`, the upstream's response to `query` relayed to
    /// `source`, under the name asked (when the answer is to that one question);
    /// anything else is ignored.
    fn note_message(&self, source: Ipv4Addr, query: &[u8], answer: &[u8]) {
        let (Ok(query), Ok(msg)) = (Message::from_vec(query), Message::from_vec(answer)) else {
            return;
        };
        let ([asked], [q]) = (query.queries(), msg.queries()) else {
            return;
        };
        if msg.message_type() != MessageType::Response
            || answer_key(&asked.name().to_ascii()) != answer_key(&q.name().to_ascii())
        {
            return;
        }
        let mut ttl = u32::MAX;
        let addrs: Vec<Ipv4Addr> = msg
            .answers()
            .iter()
            .filter_map(|r| match r.data() {
                RData::A(a) => {
                    ttl = ttl.min(r.ttl());
                    Some(a.0)
                }
                _ => None,
            })
            .collect();
        self.note(
            source,
            &q.name().to_ascii(),
            &addrs,
            Duration::from_secs(u64::from(ttl)),
        );
    }

    /// Whether the forwarder answered `source` with `ip` for `name`, still in time.
    pub fn answered(&self, source: Ipv4Addr, name: &str, ip: Ipv4Addr) -> bool {
        let now = Instant::now();
        let all = self.by_source.lock().unwrap_or_else(|p| p.into_inner());
        all.get(&source)
            .and_then(|names| names.get(&answer_key(name)))
            .is_some_and(|v| v.iter().any(|(a, t)| *a == ip && *t > now))
    }

    /// Forgets what `source` was answered (its slot was given back).
    pub fn forget(&self, source: Ipv4Addr) {
        self.by_source
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&source);
    }
}

/// Which names a sandbox may resolve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DnsAccess {
    /// Any name (the sandbox may reach the internet).
    Any,
    /// Only names a domain rule matches (all other traffic denied).
    Domains(Vec<DomainPattern>),
    /// None (everything denied, no domain rule).
    Nothing,
}

impl DnsAccess {
    /// What `policy` lets a guest resolve: everything unless all traffic is denied, then only
    /// the names its domain rules allow.
    pub fn of(policy: &EgressPolicy) -> Self {
        let denies_all = policy.deny.iter().any(|c| c.prefix_len() == 0);
        match (denies_all, policy.allow_domains.is_empty()) {
            (false, _) => DnsAccess::Any,
            (true, true) => DnsAccess::Nothing,
            (true, false) => DnsAccess::Domains(policy.allow_domains.clone()),
        }
    }

    fn permits(&self, name: &str) -> bool {
        match self {
            DnsAccess::Any => true,
            DnsAccess::Nothing => false,
            DnsAccess::Domains(d) => d.iter().any(|p| p.matches(name)),
        }
    }
}

/// Maps a query's source (a slot's host address) to its sandbox's access; None: not a
/// sandbox's, dropped.
pub type AccessLookup = dyn Fn(Ipv4Addr) -> Option<DnsAccess> + Send + Sync;

/// The first IPv4 `nameserver` of a resolv.conf text (the default upstream).
pub fn upstream_from_resolv_conf(text: &str) -> Option<Ipv4Addr> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<Ipv4Addr>().ok())
        .next()
}

/// What the forwarder does with one datagram.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Relay these bytes unchanged to the upstream.
    Relay,
    /// Answer with this message (a refusal).
    Answer(Vec<u8>),
    /// Not a query we can read: drop it.
    Drop,
}

/// Decides on a datagram `bytes` from a sandbox with `access`. Only a single-question query
/// is relayed (the name checked is the one the upstream answers for).
fn decide(bytes: &[u8], access: &DnsAccess) -> Verdict {
    let Ok(msg) = Message::from_vec(bytes) else {
        return Verdict::Drop;
    };
    if msg.message_type() != MessageType::Query {
        return Verdict::Drop;
    }
    let allowed = match msg.queries() {
        [q] => access.permits(&q.name().to_ascii()),
        _ => false,
    };
    if allowed {
        return Verdict::Relay;
    }
    // REFUSED, as a resolver answers what its policy does not serve; echo the question.
    let mut refusal = Message::error_msg(msg.id(), msg.op_code(), ResponseCode::Refused);
    refusal.add_queries(msg.queries().to_vec());
    refusal.set_recursion_desired(msg.recursion_desired());
    match refusal.to_vec() {
        Ok(v) => Verdict::Answer(v),
        Err(_) => Verdict::Drop,
    }
}

/// A running forwarder; stops (and joins its thread) when dropped.
#[derive(Debug)]
pub struct DnsForwarder {
    local: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl DnsForwarder {
    /// Binds `listen` and relays allowed queries to `upstream`, keeping the addresses
    /// it answers in `answers`.
    pub fn start(
        listen: SocketAddrV4,
        upstream: SocketAddrV4,
        lookup: Arc<AccessLookup>,
        answers: Arc<Answers>,
    ) -> Result<Self> {
        let sock = UdpSocket::bind(listen).map_err(|e| Error::sys("bind DNS forwarder", e))?;
        // Wakes the loop now and then to see whether it should stop.
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| Error::sys("DNS forwarder timeout", e))?;
        let local = sock
            .local_addr()
            .map_err(|e| Error::sys("DNS forwarder address", e))?;
        // TCP on the same port (the one UDP got, when asked for port 0).
        let tcp =
            TcpListener::bind(local).map_err(|e| Error::sys("bind DNS forwarder (TCP)", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut fwd = DnsForwarder {
            local,
            stop: stop.clone(),
            threads: Vec::new(),
        };
        let (stop2, lookup2, answers2) = (stop.clone(), lookup.clone(), answers.clone());
        fwd.threads.push(
            std::thread::Builder::new()
                .name("dns-forwarder".into())
                .spawn(move || serve(sock, upstream, lookup, answers, stop))
                .map_err(|e| Error::sys("spawn DNS forwarder", e))?,
        );
        fwd.threads.push(
            std::thread::Builder::new()
                .name("dns-forwarder-tcp".into())
                .spawn(move || serve_tcp(tcp, upstream, lookup2, answers2, stop2))
                .map_err(|e| Error::sys("spawn DNS forwarder", e))?,
        );
        Ok(fwd)
    }

    /// Where it listens (the port, when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for DnsForwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve(
    sock: UdpSocket,
    upstream: SocketAddrV4,
    lookup: Arc<AccessLookup>,
    answers: Arc<Answers>,
    stop: Arc<AtomicBool>,
) {
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut buf = [0u8; MAX_MESSAGE];
    while !stop.load(Ordering::Relaxed) {
        let (n, from) = match sock.recv_from(&mut buf) {
            Ok(r) => r,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => {
                tracing_warn(&format!("DNS forwarder receive: {e}"));
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let SocketAddr::V4(from) = from else { continue };
        let Some(access) = lookup(*from.ip()) else {
            continue;
        };
        match decide(&buf[..n], &access) {
            Verdict::Drop => {}
            Verdict::Answer(a) => {
                let _ = sock.send_to(&a, from);
            }
            Verdict::Relay => {
                if in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let Ok(reply_sock) = sock.try_clone() else {
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                    continue;
                };
                let query = buf[..n].to_vec();
                let counter = in_flight.clone();
                let answers = answers.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name("dns-relay".into())
                        .spawn(move || {
                            if let Some(answer) = relay(&query, upstream) {
                                // Kept before the guest can use it.
                                answers.note_message(*from.ip(), &query, &answer);
                                let _ = reply_sock.send_to(&answer, from);
                            }
                            counter.fetch_sub(1, Ordering::AcqRel);
                        });
                if spawned.is_err() {
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }
}

fn serve_tcp(
    listener: TcpListener,
    upstream: SocketAddrV4,
    lookup: Arc<AccessLookup>,
    answers: Arc<Answers>,
    stop: Arc<AtomicBool>,
) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let open = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::Relaxed) {
        // Waits at most 200 ms for a connection, to see whether it should stop.
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        if !matches!(poll(&mut fds, PollTimeout::from(200u16)), Ok(n) if n > 0) {
            continue;
        }
        let Ok((conn, SocketAddr::V4(from))) = listener.accept() else {
            continue;
        };
        let Some(access) = lookup(*from.ip()) else {
            continue; // not a sandbox's: closed unanswered
        };
        if open.fetch_add(1, Ordering::AcqRel) >= MAX_TCP {
            open.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let counter = open.clone();
        let answers = answers.clone();
        let spawned = std::thread::Builder::new()
            .name("dns-tcp".into())
            .spawn(move || {
                serve_tcp_conn(conn, *from.ip(), upstream, &access, &answers);
                counter.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Answers the length-prefixed queries of one guest connection until it closes, idles or
/// sends what is not a query.
fn serve_tcp_conn(
    mut conn: TcpStream,
    source: Ipv4Addr,
    upstream: SocketAddrV4,
    access: &DnsAccess,
    answers: &Answers,
) {
    if conn.set_read_timeout(Some(TCP_IDLE)).is_err() {
        return;
    }
    while let Some(query) = read_framed(&mut conn) {
        let answer = match decide(&query, access) {
            Verdict::Drop => return,
            Verdict::Answer(a) => a,
            Verdict::Relay => match relay_tcp(&query, upstream) {
                Some(a) => {
                    answers.note_message(source, &query, &a);
                    a
                }
                None => return,
            },
        };
        if write_framed(&mut conn, &answer).is_err() {
            return;
        }
    }
}

/// One DNS-over-TCP message (a 2-byte length, then the message).
pub fn read_framed(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len).ok()?;
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut msg).ok()?;
    Some(msg)
}

/// Sends `msg` as one DNS-over-TCP message (refused past 65 535 bytes).
pub fn write_framed(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<()> {
    let len = u16::try_from(msg.len()).map_err(|_| std::io::ErrorKind::InvalidData)?;
    let mut out = Vec::with_capacity(msg.len() + 2);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(msg);
    s.write_all(&out)
}

/// `query` to `upstream` over TCP; its answer, if it has the query's id and parses.
fn relay_tcp(query: &[u8], upstream: SocketAddrV4) -> Option<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::V4(upstream), UPSTREAM_TIMEOUT).ok()?;
    s.set_read_timeout(Some(UPSTREAM_TIMEOUT)).ok()?;
    write_framed(&mut s, query).ok()?;
    let answer = read_framed(&mut s)?;
    (answer.get(..2) == query.get(..2) && Message::from_vec(&answer).is_ok()).then_some(answer)
}

/// Sends `query` to `upstream` from a fresh port and returns the answer with the query's id.
fn relay(query: &[u8], upstream: SocketAddrV4) -> Option<Vec<u8>> {
    let id = query.get(..2)?;
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    s.connect(upstream).ok()?;
    s.set_read_timeout(Some(UPSTREAM_TIMEOUT)).ok()?;
    s.send(query).ok()?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let n = s.recv(&mut buf).ok()?;
        // Only the answer to this query (a connected socket only hears the upstream).
        if buf.get(..2) == Some(id) && Message::from_vec(&buf[..n]).is_ok() {
            buf.truncate(n);
            return Some(buf);
        }
    }
}

// The crate does not depend on `tracing`; the forwarder's only complaint goes to stderr.
fn tracing_warn(msg: &str) {
    eprintln!("sandfork-network: {msg}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::{Name, RData, Record, RecordType, rdata::A};
    use std::str::FromStr;

    fn query(id: u16, name: &str) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(id).set_recursion_desired(true);
        m.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
        m.to_vec().unwrap()
    }

    fn domains(d: &[&str]) -> DnsAccess {
        DnsAccess::Domains(d.iter().map(|s| DomainPattern::parse(s).unwrap()).collect())
    }

    #[test]
    fn access_follows_policy() {
        assert_eq!(DnsAccess::of(&EgressPolicy::default()), DnsAccess::Any);
        assert_eq!(DnsAccess::of(&EgressPolicy::deny_all()), DnsAccess::Nothing);
        let p = EgressPolicy::from_e2b(None, &["*.ok.test".into()], &["0.0.0.0/0".into()]).unwrap();
        assert_eq!(DnsAccess::of(&p), domains(&["*.ok.test"]));
    }

    #[test]
    fn decide_relays_allowed_and_refuses_the_rest() {
        let a = domains(&["allowed.test", "*.ok.test"]);
        assert_eq!(decide(&query(1, "allowed.test."), &a), Verdict::Relay);
        assert_eq!(decide(&query(1, "ALLOWED.test"), &a), Verdict::Relay);
        assert_eq!(decide(&query(1, "a.ok.test."), &a), Verdict::Relay);
        for name in ["blocked.test.", "ok.test.", "allowed.test.evil."] {
            let Verdict::Answer(r) = decide(&query(7, name), &a) else {
                panic!("{name} not refused");
            };
            let r = Message::from_vec(&r).unwrap();
            assert_eq!(r.id(), 7);
            assert_eq!(r.response_code(), ResponseCode::Refused);
            assert_eq!(r.queries().len(), 1);
        }
        assert!(matches!(
            decide(&query(1, "x.test."), &DnsAccess::Nothing),
            Verdict::Answer(_)
        ));
        assert_eq!(
            decide(&query(1, "x.test."), &DnsAccess::Any),
            Verdict::Relay
        );
    }

    #[test]
    fn malformed_and_non_queries_are_dropped() {
        let q = query(3, "allowed.test.");
        for n in 0..q.len() {
            // Every truncation: no panic, and never a relay of a cut message.
            assert_ne!(decide(&q[..n], &DnsAccess::Any), Verdict::Relay, "len {n}");
        }
        let mut resp = Message::from_vec(&q).unwrap();
        resp.set_message_type(MessageType::Response);
        assert_eq!(
            decide(&resp.to_vec().unwrap(), &DnsAccess::Any),
            Verdict::Drop
        );
        // A pointer loop in the name.
        let mut looped = q[..12].to_vec();
        looped.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
        assert_eq!(decide(&looped, &DnsAccess::Any), Verdict::Drop);
        assert_eq!(decide(&[0xff; 600], &DnsAccess::Any), Verdict::Drop);
    }

    #[test]
    fn resolv_conf_upstream() {
        let t = "# x\nsearch lan\nnameserver ::1\nnameserver 127.0.0.53\nnameserver 1.2.3.4\n";
        assert_eq!(
            upstream_from_resolv_conf(t),
            Some(Ipv4Addr::new(127, 0, 0, 53))
        );
        assert_eq!(upstream_from_resolv_conf("search x\n"), None);
    }

    /// A one-record DNS server on loopback: answers every A query with 203.0.113.10.
    fn fake_upstream() -> (SocketAddrV4, JoinHandle<()>) {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let SocketAddr::V4(addr) = s.local_addr().unwrap() else {
            panic!("bound to an IPv4 address")
        };
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = s.recv_from(&mut buf) {
                let q = Message::from_vec(&buf[..n]).unwrap();
                let mut r = Message::new();
                r.set_id(q.id()).set_message_type(MessageType::Response);
                r.add_queries(q.queries().to_vec());
                let name = q.queries()[0].name().clone();
                r.add_answer(Record::from_rdata(
                    name,
                    60,
                    RData::A(A::new(203, 0, 113, 10)),
                ));
                s.send_to(&r.to_vec().unwrap(), from).unwrap();
            }
        });
        (addr, t)
    }

    #[test]
    fn forwards_over_loopback_per_source_policy() {
        let (up, _t) = fake_upstream();
        // 127.0.0.1 stands for a slot with domain rules; other sources are nobody's.
        let lookup: Arc<AccessLookup> = Arc::new(|ip: Ipv4Addr| {
            (ip == Ipv4Addr::LOCALHOST).then(|| domains(&["allowed.test"]))
        });
        let answers = Arc::new(Answers::default());
        let fwd = DnsForwarder::start("127.0.0.1:0".parse().unwrap(), up, lookup, answers.clone())
            .unwrap();
        let c = UdpSocket::bind("127.0.0.1:0").unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.connect(fwd.local_addr()).unwrap();
        let mut buf = [0u8; 4096];

        c.send(&[0u8; 3]).unwrap(); // garbage first: the forwarder must live on
        c.send(&query(11, "allowed.test.")).unwrap();
        let n = c.recv(&mut buf).unwrap();
        let r = Message::from_vec(&buf[..n]).unwrap();
        assert_eq!(r.id(), 11);
        assert_eq!(r.response_code(), ResponseCode::NoError);
        let RData::A(a) = r.answers()[0].data() else {
            panic!("{r:?}")
        };
        assert_eq!(a.0, Ipv4Addr::new(203, 0, 113, 10));
        // What the egress proxy will let the name reach: that address, for this source.
        let web = Ipv4Addr::new(203, 0, 113, 10);
        assert!(answers.answered(Ipv4Addr::LOCALHOST, "Allowed.Test.", web));
        assert!(!answers.answered(
            Ipv4Addr::LOCALHOST,
            "allowed.test",
            Ipv4Addr::new(203, 0, 113, 11)
        ));
        assert!(!answers.answered(Ipv4Addr::new(10, 11, 0, 3), "allowed.test", web));

        c.send(&query(12, "blocked.test.")).unwrap();
        let n = c.recv(&mut buf).unwrap();
        let r = Message::from_vec(&buf[..n]).unwrap();
        assert_eq!((r.id(), r.response_code()), (12, ResponseCode::Refused));
        assert!(r.answers().is_empty());

        // TCP: a refusal answered by the forwarder itself, then the connection still serves.
        let mut t = TcpStream::connect(fwd.local_addr()).unwrap();
        t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write_framed(&mut t, &query(13, "blocked.test.")).unwrap();
        let r = Message::from_vec(&read_framed(&mut t).unwrap()).unwrap();
        assert_eq!((r.id(), r.response_code()), (13, ResponseCode::Refused));
        write_framed(&mut t, &[1, 2, 3]).unwrap(); // not a query: the connection closes
        assert!(read_framed(&mut t).is_none());
        assert!(!answers.answered(Ipv4Addr::LOCALHOST, "blocked.test", web));
        drop(fwd);
    }

    #[test]
    fn answers_are_kept_per_source_and_name_within_bounds() {
        let a = Answers::default();
        let (s1, s2) = (Ipv4Addr::new(10, 11, 0, 1), Ipv4Addr::new(10, 11, 0, 2));
        let ip = |n: u8| Ipv4Addr::new(203, 0, 113, n);
        a.note(s1, "Web.Test.", &[ip(1), ip(2)], Duration::ZERO);
        assert!(a.answered(s1, "web.test", ip(1)));
        assert!(a.answered(s1, "WEB.test.", ip(2)));
        assert!(!a.answered(s1, "web.test", ip(3)));
        assert!(!a.answered(s1, "other.test", ip(1)));
        assert!(!a.answered(s2, "web.test", ip(1)));
        // A later answer adds to the earlier ones, up to a bound (the oldest go).
        for n in 0..=u8::try_from(ANSWER_MAX_ADDRS).unwrap() {
            a.note(
                s1,
                "web.test",
                &[Ipv4Addr::new(198, 51, 100, n)],
                Duration::ZERO,
            );
        }
        assert!(!a.answered(s1, "web.test", ip(1)));
        assert!(a.answered(s1, "web.test", Ipv4Addr::new(198, 51, 100, 1)));
        // Names per source are bounded too.
        for n in 0..ANSWER_MAX_NAMES + 10 {
            a.note(s2, &format!("n{n}.test"), &[ip(9)], Duration::from_secs(60));
        }
        let names = a.by_source.lock().unwrap().get(&s2).map(HashMap::len);
        assert_eq!(names, Some(ANSWER_MAX_NAMES));
        assert!(a.answered(s2, &format!("n{}.test", ANSWER_MAX_NAMES + 9), ip(9)));
        a.forget(s1);
        assert!(!a.answered(s1, "web.test", Ipv4Addr::new(198, 51, 100, 1)));
        assert!(a.answered(s2, &format!("n{}.test", ANSWER_MAX_NAMES + 9), ip(9)));
    }

    #[test]
    fn only_an_answer_to_the_question_asked_is_kept() {
        let a = Answers::default();
        let src = Ipv4Addr::new(10, 11, 0, 1);
        let answer = |name: &str| {
            let mut r = Message::new();
            r.set_id(1).set_message_type(MessageType::Response);
            r.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
            // A CNAME chain's addresses belong to the name asked.
            r.add_answer(Record::from_rdata(
                Name::from_str("cdn.example.").unwrap(),
                30,
                RData::A(A::new(203, 0, 113, 7)),
            ));
            r.to_vec().unwrap()
        };
        let web = Ipv4Addr::new(203, 0, 113, 7);
        a.note_message(src, &query(1, "other.test."), &answer("allowed.test."));
        assert!(!a.answered(src, "allowed.test", web));
        assert!(!a.answered(src, "other.test", web));
        a.note_message(src, &query(1, "allowed.TEST."), &answer("allowed.test."));
        assert!(a.answered(src, "allowed.test", web));
        // Garbage, or a query where the answer should be: nothing kept.
        a.note_message(src, &query(1, "x.test."), &query(1, "x.test."));
        a.note_message(src, &query(1, "y.test."), &[0xff; 40]);
        assert!(!a.answered(src, "x.test", web) && !a.answered(src, "y.test", web));
    }
}
