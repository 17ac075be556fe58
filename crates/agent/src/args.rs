//! Command-line parsing.
//!
//! Hand-written rather than clap: as PID 1 the agent receives whatever words of the
//! kernel command line the kernel did not recognise, so unknown arguments must be
//! tolerated (reported, not fatal), and the parser must never exit the process.

use std::net::SocketAddr;

/// The vsock port envd listens on; the host's envd proxy connects here.
pub const DEFAULT_VSOCK_PORT: u32 = envd_proto::PORT;

pub const USAGE: &str = "\
usage: sandfork-agent [--listen-tcp ADDR:PORT] [--vsock-port PORT] [--no-vsock]

Guest agent of sandfork microVMs. As PID 1 it sets up the guest (mounts, hostname,
loopback), reaps every zombie and shuts the VM down on SIGINT/SIGTERM; in any mode it
serves E2B's envd protocol (/health, /init, /envs, process.Process) on vsock
and, if asked, on TCP.

  --listen-tcp ADDR:PORT  also serve HTTP on this TCP address (port 0: any free port)
  --vsock-port PORT       vsock port to serve on (default 49983)
  --no-vsock              do not listen on vsock
  -h, --help              print this help";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    pub listen_tcp: Option<SocketAddr>,
    /// `None` when vsock listening is turned off.
    pub vsock_port: Option<u32>,
    pub help: bool,
    /// Arguments that were not understood; logged, never fatal.
    pub ignored: Vec<String>,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            listen_tcp: None,
            vsock_port: Some(DEFAULT_VSOCK_PORT),
            help: false,
            ignored: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    #[error("{0} needs a value")]
    MissingValue(&'static str),
    #[error("invalid value {value:?} for {flag}")]
    InvalidValue { flag: &'static str, value: String },
}

impl Args {
    /// Parses arguments (without the program name). Errors are only for flags we
    /// know whose value is wrong; words we do not know go to `ignored`.
    pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Self, ArgsError> {
        let mut out = Self::default();
        let mut no_vsock = false;
        let mut iter = args.into_iter();
        while let Some(arg) = iter.next() {
            // Accept both `--flag value` and `--flag=value`.
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
                _ => (arg.clone(), None),
            };
            match flag.as_str() {
                "--listen-tcp" => {
                    let v = value(inline, &mut iter, "--listen-tcp")?;
                    let addr = v.parse().map_err(|_| ArgsError::InvalidValue {
                        flag: "--listen-tcp",
                        value: v,
                    })?;
                    out.listen_tcp = Some(addr);
                }
                "--vsock-port" => {
                    let v = value(inline, &mut iter, "--vsock-port")?;
                    let port = v.parse().map_err(|_| ArgsError::InvalidValue {
                        flag: "--vsock-port",
                        value: v,
                    })?;
                    out.vsock_port = Some(port);
                }
                "--no-vsock" if inline.is_none() => no_vsock = true,
                "-h" | "--help" if inline.is_none() => out.help = true,
                _ => out.ignored.push(arg),
            }
        }
        if no_vsock {
            out.vsock_port = None;
        }
        Ok(out)
    }
}

fn value(
    inline: Option<String>,
    iter: &mut impl Iterator<Item = String>,
    flag: &'static str,
) -> Result<String, ArgsError> {
    inline
        .or_else(|| iter.next())
        .ok_or(ArgsError::MissingValue(flag))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[&str]) -> Result<Args, ArgsError> {
        Args::parse(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn defaults_serve_vsock_on_envd_port() {
        let a = parse(&[]).unwrap();
        assert_eq!(a, Args::default());
        assert_eq!(a.vsock_port, Some(49983));
        assert_eq!(a.listen_tcp, None);
    }

    #[test]
    fn listen_tcp_both_spellings() {
        let a = parse(&["--listen-tcp", "127.0.0.1:8080"]).unwrap();
        assert_eq!(a.listen_tcp, Some("127.0.0.1:8080".parse().unwrap()));
        let b = parse(&["--listen-tcp=[::1]:0"]).unwrap();
        assert_eq!(b.listen_tcp, Some("[::1]:0".parse().unwrap()));
    }

    #[test]
    fn vsock_port_and_no_vsock() {
        assert_eq!(
            parse(&["--vsock-port", "1024"]).unwrap().vsock_port,
            Some(1024)
        );
        // --no-vsock wins regardless of order.
        assert_eq!(
            parse(&["--no-vsock", "--vsock-port=5"]).unwrap().vsock_port,
            None
        );
    }

    #[test]
    fn bad_values_are_errors() {
        assert_eq!(
            parse(&["--listen-tcp"]),
            Err(ArgsError::MissingValue("--listen-tcp"))
        );
        assert!(matches!(
            parse(&["--listen-tcp", "localhost:80"]),
            Err(ArgsError::InvalidValue { .. })
        ));
        assert!(matches!(
            parse(&["--vsock-port", "-1"]),
            Err(ArgsError::InvalidValue { .. })
        ));
    }

    #[test]
    fn unknown_words_from_the_kernel_are_kept_not_fatal() {
        let a = parse(&["quiet", "--weird", "--no-vsock=1", "-h"]).unwrap();
        assert_eq!(a.ignored, vec!["quiet", "--weird", "--no-vsock=1"]);
        assert!(a.help);
        assert_eq!(a.vsock_port, Some(DEFAULT_VSOCK_PORT));
    }
}
