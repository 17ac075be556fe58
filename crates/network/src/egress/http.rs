//! The host an HTTP/1 request names: its `Host` header (or the authority of an absolute-form
//! target, which a server prefers to the header, RFC 9112 3.2.2), read with `httparse`.

use super::Parse;
use super::sni::host_name;

/// The largest request head read (request line and headers).
pub const MAX_HEAD: usize = 16 * 1024;
/// Headers in a request head; more and it is refused.
const MAX_HEADERS: usize = 100;

/// The host the request at the start of `buf` is for, lower case and without a port:
/// `Done(Some(host))`; `Done(None)` for a request naming none (HTTP/1.0 without `Host`);
/// `NeedMore` while the head is incomplete; `Invalid` for what is not an HTTP/1 request,
/// two `Host` headers, a host that is not a host name, or an absolute-form target naming
/// another host than `Host`.
pub fn request_host(buf: &[u8]) -> Parse<Option<String>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Parse::NeedMore,
        _ => return Parse::Invalid,
    }
    let mut host = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return Parse::Invalid;
            }
            match authority_host(h.value) {
                Some(v) => host = Some(v),
                None => return Parse::Invalid,
            }
        }
    }
    let target = req.path.unwrap_or("");
    let absolute = ["http://", "https://"].iter().find_map(|scheme| {
        target
            .get(..scheme.len())
            .filter(|s| s.eq_ignore_ascii_case(scheme))
            .map(|_| &target[scheme.len()..])
    });
    if let Some(rest) = absolute {
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        let Some(from_target) = authority_host(authority.as_bytes()) else {
            return Parse::Invalid;
        };
        if host.as_ref().is_some_and(|h| *h != from_target) {
            return Parse::Invalid;
        }
        host = Some(from_target);
    }
    Parse::Done(host)
}

/// The host of an authority (`host[:port]`); None for user info, an IPv6 literal, a bad
/// port or a bad name (an IPv4 literal passes: it matches no domain rule but `*`).
fn authority_host(v: &[u8]) -> Option<String> {
    let v = v.trim_ascii();
    if v.contains(&b'@') || v.first() == Some(&b'[') {
        return None;
    }
    let (name, port) = match v.iter().position(|b| *b == b':') {
        Some(i) => (&v[..i], Some(&v[i + 1..])),
        None => (v, None),
    };
    if let Some(p) = port
        && (p.is_empty() || p.len() > 5 || !p.iter().all(u8::is_ascii_digit))
    {
        return None;
    }
    host_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(s: &str) -> Parse<Option<String>> {
        request_host(s.as_bytes())
    }

    #[test]
    fn the_host_header_or_the_absolute_target() {
        let some = |h: &str| Parse::Done(Some(h.to_owned()));
        assert_eq!(
            host("GET / HTTP/1.1\r\nHost: Allowed.Test\r\n\r\n"),
            some("allowed.test")
        );
        assert_eq!(
            host("GET /x HTTP/1.1\r\nUser-Agent: t\r\nhost:allowed.test:8080\r\n\r\n"),
            some("allowed.test")
        );
        assert_eq!(
            host("GET http://a.test/p?q HTTP/1.1\r\nHost: a.test\r\n\r\n"),
            some("a.test")
        );
        assert_eq!(
            host("GET http://a.test:80 HTTP/1.0\r\n\r\n"),
            some("a.test")
        );
        assert_eq!(host("GET / HTTP/1.0\r\n\r\n"), Parse::Done(None));
    }

    #[test]
    fn partial_heads_ask_for_more() {
        let full = "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
        for cut in 0..full.len() {
            assert_eq!(host(&full[..cut]), Parse::NeedMore, "cut at {cut}");
        }
        // ...but not for ever.
        let long = format!("GET / HTTP/1.1\r\nX: {}", "a".repeat(MAX_HEAD));
        assert_eq!(host(&long), Parse::Invalid);
    }

    #[test]
    fn ambiguity_and_garbage_are_invalid() {
        for bad in [
            "GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
            "GET http://b.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: user@a.test\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a.test:http\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a test\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: \r\n\r\n",
            "\x16\x03\x01\x00\x05hello",
            "GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        ] {
            assert_eq!(host(bad), Parse::Invalid, "{bad:?}");
        }
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "X: y\r\n".repeat(MAX_HEADERS + 1)
        );
        assert_eq!(host(&many), Parse::Invalid);
    }
}
