//! The server name a TLS client asks for: the `server_name` extension of its ClientHello,
//! read without terminating TLS. A hand-written reader (no TLS library parses a ClientHello
//! without pulling in a whole TLS stack): every length is checked against what is left, the
//! handshake message may span several records (post-quantum key shares make ClientHellos
//! large), and what does not follow RFC 8446/6066 is refused, never guessed at.

use super::Parse;

/// TLS record type of handshake messages.
const HANDSHAKE: u8 = 22;
const CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const NAME_TYPE_HOST: u8 = 0;
/// The largest plaintext record (RFC 8446 5.1).
const MAX_RECORD: usize = 1 << 14;
/// The largest ClientHello accepted (real ones are under 2 KiB; more is not a browser's).
pub const MAX_HELLO: usize = 16 * 1024;
/// The most bytes read before a ClientHello must be whole: the hello and the headers of up
/// to 64 records it spans (a hello cut into tiny records is refused by this bound).
pub const MAX_READ: usize = MAX_HELLO + 64 * 5;

/// A reader over a byte slice whose every take is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    /// A vector with a one-byte length prefix.
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }
    /// A vector with a two-byte length prefix.
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The SNI host name of the ClientHello at the start of `buf` (what a client sent first):
/// `Done(Some(name))`, `Done(None)` for a ClientHello without one, `NeedMore` while the
/// hello is incomplete, `Invalid` for anything else (not TLS, another message first, bad
/// lengths, a name that is not a host name, a hello over [`MAX_HELLO`]).
pub fn server_name(buf: &[u8]) -> Parse<Option<String>> {
    // Gather the handshake bytes of the leading handshake records.
    let mut hs = Vec::new();
    let mut rest = buf;
    loop {
        if rest.len() < 5 {
            break;
        }
        if rest[0] != HANDSHAKE || rest[1] != 3 {
            return Parse::Invalid;
        }
        let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
        if len == 0 || len > MAX_RECORD {
            return Parse::Invalid;
        }
        let Some(body) = rest.get(5..5 + len) else {
            // A partial record: take what is there, the message header may be in it.
            hs.extend_from_slice(&rest[5..]);
            break;
        };
        hs.extend_from_slice(body);
        rest = &rest[5 + len..];
        if hs.len() >= 4 && hs.len() >= 4 + hello_len(&hs) {
            break;
        }
        if hs.len() > MAX_HELLO + 4 {
            return Parse::Invalid;
        }
    }
    if hs.is_empty() {
        return Parse::NeedMore;
    }
    if hs[0] != CLIENT_HELLO {
        return Parse::Invalid;
    }
    if hs.len() < 4 {
        return Parse::NeedMore;
    }
    let len = hello_len(&hs);
    if len > MAX_HELLO {
        return Parse::Invalid;
    }
    let Some(body) = hs.get(4..4 + len) else {
        return Parse::NeedMore;
    };
    match hello_server_name(body) {
        Some(name) => Parse::Done(name),
        None => Parse::Invalid,
    }
}

fn hello_len(hs: &[u8]) -> usize {
    (usize::from(hs[1]) << 16) | (usize::from(hs[2]) << 8) | usize::from(hs[3])
}

/// The server name of a whole ClientHello body; None when malformed.
fn hello_server_name(body: &[u8]) -> Option<Option<String>> {
    let mut r = Reader(body);
    let version = r.u16()?;
    if version >> 8 != 3 {
        return None;
    }
    r.take(32)?; // random
    let session = r.vec8()?;
    if session.len() > 32 {
        return None;
    }
    let suites = r.vec16()?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return None;
    }
    if r.vec8()?.is_empty() {
        return None; // compression methods: at least "null"
    }
    if r.is_empty() {
        return Some(None); // no extensions at all
    }
    let mut exts = Reader(r.vec16()?);
    if !r.is_empty() {
        return None;
    }
    let mut name = None;
    let mut seen = Vec::new();
    while !exts.is_empty() {
        let kind = exts.u16()?;
        let data = exts.vec16()?;
        // Each extension at most once (RFC 8446 4.2): two names would be two answers.
        if seen.contains(&kind) {
            return None;
        }
        seen.push(kind);
        if kind == EXT_SERVER_NAME {
            name = Some(sni_extension(data)?);
        }
    }
    Some(name)
}

/// The host name of a `server_name` extension's data (RFC 6066 3): one `host_name` entry.
fn sni_extension(data: &[u8]) -> Option<String> {
    let mut r = Reader(data);
    let mut list = Reader(r.vec16()?);
    if !r.is_empty() {
        return None;
    }
    let mut host = None;
    while !list.is_empty() {
        let kind = list.u8()?;
        let name = list.vec16()?;
        if kind == NAME_TYPE_HOST {
            if host.is_some() {
                return None; // "MUST NOT contain more than one name of the same name_type"
            }
            host = Some(host_name(name)?);
        }
    }
    host
}

/// A DNS host name in ASCII (letters, digits, '-', '_', '.'), 1 to 253 bytes, with at most
/// a trailing dot; anything else is refused.
pub(super) fn host_name(name: &[u8]) -> Option<String> {
    let trimmed = name.strip_suffix(b".").unwrap_or(name);
    if trimmed.is_empty() || trimmed.len() > 253 {
        return None;
    }
    if !trimmed
        .iter()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return None;
    }
    if trimmed.split(|b| *b == b'.').any(|l| l.is_empty()) {
        return None;
    }
    Some(String::from_utf8_lossy(trimmed).to_ascii_lowercase())
}

/// A ClientHello naming `name` (tests and fuzz seeds), split into records of `record` bytes.
pub fn client_hello(name: Option<&str>, record: usize) -> Vec<u8> {
    let mut exts = Vec::new();
    // An unrelated extension first (supported_versions: TLS 1.3, 1.2).
    exts.extend_from_slice(&[0, 43, 0, 5, 4, 3, 4, 3, 3]);
    if let Some(n) = name {
        let n = n.as_bytes();
        let entry_len = 3 + n.len();
        exts.extend_from_slice(&EXT_SERVER_NAME.to_be_bytes());
        exts.extend_from_slice(&((entry_len + 2) as u16).to_be_bytes());
        exts.extend_from_slice(&(entry_len as u16).to_be_bytes());
        exts.push(NAME_TYPE_HOST);
        exts.extend_from_slice(&(n.len() as u16).to_be_bytes());
        exts.extend_from_slice(n);
    }
    let mut body = vec![3, 3];
    body.extend_from_slice(&[7; 32]);
    body.push(0); // no session id
    body.extend_from_slice(&[0, 2, 0x13, 0x01]); // TLS_AES_128_GCM_SHA256
    body.extend_from_slice(&[1, 0]); // null compression
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut hs = vec![CLIENT_HELLO];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut out = Vec::new();
    for chunk in hs.chunks(record.max(1)) {
        out.extend_from_slice(&[HANDSHAKE, 3, 1]);
        out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_name_in_one_or_many_records() {
        for record in [MAX_RECORD, 100, 7, 1] {
            let hello = client_hello(Some("Allowed.Test"), record);
            assert_eq!(
                server_name(&hello),
                Parse::Done(Some("allowed.test".into())),
                "records of {record}"
            );
        }
        assert_eq!(server_name(&client_hello(None, 1000)), Parse::Done(None));
    }

    #[test]
    fn every_truncation_asks_for_more_and_never_answers_early() {
        for record in [1000, 13] {
            let hello = client_hello(Some("a.example.test"), record);
            for cut in 0..hello.len() {
                assert_eq!(server_name(&hello[..cut]), Parse::NeedMore, "cut at {cut}");
            }
        }
    }

    #[test]
    fn garbage_and_lies_are_invalid() {
        assert_eq!(server_name(b"GET / HTTP/1.1\r\n\r\n"), Parse::Invalid);
        assert_eq!(server_name(&[22, 3, 1, 0, 0]), Parse::Invalid); // empty record
        assert_eq!(server_name(&[22, 3, 1, 0x40, 1, 1]), Parse::Invalid); // record too long
        assert_eq!(server_name(&[21, 3, 1, 0, 2, 2, 40]), Parse::Invalid); // an alert
        assert_eq!(server_name(&[22, 3, 1, 0, 4, 2, 0, 0, 0]), Parse::Invalid); // ServerHello
        // A hello that claims more than the limit.
        assert_eq!(server_name(&[22, 3, 1, 0, 4, 1, 1, 0, 0]), Parse::Invalid);
        // Bad names, two names, two SNI extensions.
        for bad in ["", "a..b", "exa mple.test", "ex\u{e9}.test", "a.test\0"] {
            let hello = client_hello(Some(bad), 1000);
            assert_eq!(server_name(&hello), Parse::Invalid, "{bad:?}");
        }
        let mut hello = client_hello(Some("x.test"), 10_000);
        // Corrupt the extensions' length: longer than what follows.
        let at = 5 + 4 + 2 + 32 + 1 + 4 + 2;
        hello[at] = 0xff;
        assert_eq!(server_name(&hello), Parse::Invalid);
        let twice = {
            let one = client_hello(Some("x.test"), 10_000);
            // Rebuild with the SNI extension repeated.
            let ext = &one[one.len() - 15..];
            let mut exts = Vec::from(&one[5 + 4 + 2 + 32 + 1 + 4 + 2 + 2..]);
            exts.extend_from_slice(ext);
            let mut body = Vec::from(&one[9..5 + 4 + 2 + 32 + 1 + 4 + 2]);
            body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
            body.extend_from_slice(&exts);
            let mut hs = vec![1];
            hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
            hs.extend_from_slice(&body);
            let mut rec = vec![22, 3, 1];
            rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
            rec.extend_from_slice(&hs);
            rec
        };
        assert_eq!(server_name(&twice), Parse::Invalid);
    }

    #[test]
    fn any_bytes_are_answered_without_panicking() {
        // A cheap stand-in for the fuzz target: mutate a real hello byte by byte.
        let hello = client_hello(Some("allowed.test"), 40);
        for i in 0..hello.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut h = hello.clone();
                h[i] = v;
                let _ = server_name(&h);
            }
        }
    }
}
