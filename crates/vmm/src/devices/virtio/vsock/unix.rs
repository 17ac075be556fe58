//! The host side: the `CONNECT <port>\n` handshake on the device's Unix socket and
//! non-blocking connects to `<uds_path>_<port>` listeners.

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The longest handshake line accepted, newline included. `CONNECT 4294967295\n` is 19
/// bytes; a little slack allows extra spaces.
pub const HANDSHAKE_MAX: usize = 32;

/// What a host process has sent so far on a freshly accepted stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// No newline yet and still under the limit.
    Incomplete,
    /// A valid request for guest `port`; `consumed` bytes belong to the handshake, the
    /// rest is already payload for the guest.
    Connect { port: u32, consumed: usize },
    /// Anything else: the stream is closed.
    Invalid,
}

/// Parses `CONNECT <port>\n` (decimal port, ASCII whitespace between the words).
pub fn parse_connect(buf: &[u8]) -> Parsed {
    let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() >= HANDSHAKE_MAX {
            Parsed::Invalid
        } else {
            Parsed::Incomplete
        };
    };
    if nl >= HANDSHAKE_MAX {
        return Parsed::Invalid;
    }
    let Ok(line) = std::str::from_utf8(&buf[..nl]) else {
        return Parsed::Invalid;
    };
    let mut words = line.split_ascii_whitespace();
    let (Some("CONNECT"), Some(port), None) = (words.next(), words.next(), words.next()) else {
        return Parsed::Invalid;
    };
    // `u32::from_str` accepts a leading '+'; the protocol does not.
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return Parsed::Invalid;
    }
    match port.parse::<u32>() {
        Ok(port) => Parsed::Connect {
            port,
            consumed: nl + 1,
        },
        Err(_) => Parsed::Invalid,
    }
}

/// A host stream accepted on the device socket whose handshake line is still arriving.
#[derive(Debug)]
pub struct Handshake {
    pub stream: UnixStream,
    pub buf: Vec<u8>,
    pub deadline: Instant,
}

/// Result of reading more of a handshake.
#[derive(Debug)]
pub enum HandshakeStep {
    /// Wait for more bytes.
    Pending,
    /// Close the stream.
    Failed,
    Connect {
        port: u32,
        leftover: Vec<u8>,
    },
}

impl Handshake {
    pub fn new(stream: UnixStream, deadline: Instant) -> Self {
        Self {
            stream,
            buf: Vec::with_capacity(HANDSHAKE_MAX),
            deadline,
        }
    }

    /// Reads what is available, never more than the handshake limit.
    pub fn read_more(&mut self) -> HandshakeStep {
        let mut tmp = [0u8; HANDSHAKE_MAX];
        let want = HANDSHAKE_MAX - self.buf.len();
        match self.stream.read(&mut tmp[..want]) {
            Ok(0) => return HandshakeStep::Failed,
            Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                return HandshakeStep::Pending;
            }
            Err(_) => return HandshakeStep::Failed,
        }
        match parse_connect(&self.buf) {
            Parsed::Incomplete => HandshakeStep::Pending,
            Parsed::Invalid => HandshakeStep::Failed,
            Parsed::Connect { port, consumed } => HandshakeStep::Connect {
                port,
                leftover: self.buf[consumed..].to_vec(),
            },
        }
    }
}

/// `<uds_path>_<port>`: where a host service for guest-initiated connections to `port`
/// listens.
pub fn port_path(uds_path: &Path, port: u32) -> PathBuf {
    let mut s = OsString::from(uds_path.as_os_str());
    s.push(format!("_{port}"));
    PathBuf::from(s)
}

/// Connects without blocking the worker: a Unix stream connect either completes at once
/// or fails with `EAGAIN` when the listener's backlog is full, which is treated as a
/// refusal. Returns a non-blocking stream.
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    let mut addr = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "unusable Unix socket path",
        ));
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `addr` is a valid, NUL-terminated sockaddr_un of `len` bytes that lives
    // across the call; `fd` is a valid socket.
    let rc = unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            (&raw const addr).cast::<libc::sockaddr>(),
            len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixListener;

    #[test]
    fn parses_valid_requests() {
        assert_eq!(
            parse_connect(b"CONNECT 52\n"),
            Parsed::Connect {
                port: 52,
                consumed: 11
            }
        );
        assert_eq!(
            parse_connect(b"CONNECT  4294967295 \nabc"),
            Parsed::Connect {
                port: u32::MAX,
                consumed: 21
            }
        );
        assert_eq!(parse_connect(b"CONNECT 5"), Parsed::Incomplete);
        assert_eq!(parse_connect(b""), Parsed::Incomplete);
    }

    #[test]
    fn rejects_malformed_requests() {
        for bad in [
            &b"CONNECT\n"[..],
            b"CONNECT abc\n",
            b"CONNECT +5\n",
            b"CONNECT -5\n",
            b"CONNECT 4294967296\n",
            b"CONNECT 5 6\n",
            b"connect 5\n",
            b"LISTEN 5\n",
            b"\n",
            b"CONNECT \xff\n",
            &[b'x'; HANDSHAKE_MAX],
        ] {
            assert_eq!(
                parse_connect(bad),
                Parsed::Invalid,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn handshake_reads_in_pieces_and_keeps_leftover() {
        let (mut host, dev) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let mut hs = Handshake::new(dev, Instant::now());
        assert!(matches!(hs.read_more(), HandshakeStep::Pending));
        host.write_all(b"CONN").unwrap();
        assert!(matches!(hs.read_more(), HandshakeStep::Pending));
        host.write_all(b"ECT 7\nhi").unwrap();
        match hs.read_more() {
            HandshakeStep::Connect { port, leftover } => {
                assert_eq!(port, 7);
                assert_eq!(leftover, b"hi");
            }
            _ => panic!("expected a connect"),
        }
    }

    #[test]
    fn nonblocking_connect_reaches_listener_or_fails() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("v.sock");
        let path = port_path(&base, 80);
        assert_eq!(path, dir.path().join("v.sock_80"));
        assert!(connect_nonblocking(&path).is_err());
        let listener = UnixListener::bind(&path).unwrap();
        let mut s = connect_nonblocking(&path).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        s.write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        peer.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
    }
}
