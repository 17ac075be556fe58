//! sandfork's own way to a guest's TCP ports (not part of envd): E2B routes
//! `<port>-<id>.<domain>` to any port a sandbox listens on, and sandfork's
//! host reaches the guest only over vsock. The host connects to the agent's
//! forwarding vsock port and writes the TCP port as one line; the agent
//! connects to it on the guest's loopback and answers one line, `OK` or
//! `ERR <reason>`; after `OK` the connection carries the TCP stream.

/// The agent's forwarding vsock port (envd is on 49983).
pub const VSOCK_PORT: u32 = 49982;

/// The longest line either side sends; a longer one is refused.
pub const MAX_LINE: usize = 256;

/// The host's request line for `port`.
pub fn request(port: u16) -> String {
    format!("{port}\n")
}

/// The TCP port a request line (without its newline) names.
pub fn parse_request(line: &str) -> Option<u16> {
    line.trim().parse().ok().filter(|p| *p != 0)
}

/// The agent's answer, as the host reads it (without its newline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Connected,
    Refused(String),
}

impl Reply {
    pub fn parse(line: &str) -> Option<Reply> {
        match line.trim_end() {
            "OK" => Some(Reply::Connected),
            other => other
                .strip_prefix("ERR ")
                .map(|reason| Reply::Refused(reason.to_owned())),
        }
    }

    /// The line the agent sends, newline included.
    pub fn line(&self) -> String {
        match self {
            Reply::Connected => "OK\n".to_owned(),
            // One line: a reason with a newline would end the answer early.
            Reply::Refused(reason) => format!("ERR {}\n", reason.replace(['\n', '\r'], " ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        assert_eq!(parse_request(request(8000).trim_end()), Some(8000));
        assert_eq!(parse_request("0"), None);
        assert_eq!(parse_request("70000"), None);
        assert_eq!(parse_request("x"), None);
        for reply in [
            Reply::Connected,
            Reply::Refused("connection refused".into()),
        ] {
            assert_eq!(Reply::parse(&reply.line()), Some(reply));
        }
        assert_eq!(
            Reply::parse(&Reply::Refused("a\nb".into()).line()),
            Some(Reply::Refused("a b".into()))
        );
        assert_eq!(Reply::parse("HTTP/1.1 200 OK"), None);
    }
}
