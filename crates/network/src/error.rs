//! The crate's error type.

use std::io;

/// What went wrong while planning, building or policing network slots.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address plan is unusable (bad ranges, too many slots, a clash with the host).
    #[error("network address plan: {0}")]
    Plan(String),
    /// A sandbox's network policy was refused; the text is E2B's where E2B has one (a 400).
    #[error("{0}")]
    InvalidPolicy(String),
    /// Every slot is taken (the server answers 503).
    #[error("no free network slot (all {0} in use)")]
    Exhausted(u32),
    /// A slot id outside the plan or not known to the pool.
    #[error("unknown network slot {0}")]
    UnknownSlot(u32),
    /// The kernel refused a netlink request.
    #[error("netlink {what}: {source}")]
    Netlink {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// A system call or file operation failed.
    #[error("{what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// This crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn sys(what: impl Into<String>, source: impl Into<io::Error>) -> Self {
        Error::Sys {
            what: what.into(),
            source: source.into(),
        }
    }

    pub(crate) fn netlink(what: &'static str, source: impl Into<io::Error>) -> Self {
        Error::Netlink {
            what,
            source: source.into(),
        }
    }

    /// The kernel's errno behind this error, if it came from one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Netlink { source, .. } | Error::Sys { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

impl From<nix::Error> for Error {
    fn from(e: nix::Error) -> Self {
        Error::sys("system call", io::Error::from(e))
    }
}
