//! What can go wrong in a template build, typed so the server can map it to
//! an answer (a missing package is the user's mistake, no space is ours).

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("package {0:?} is not a valid Debian package name")]
    InvalidPackageName(String),
    #[error("package {0:?} was not found in the Debian archive")]
    MissingPackage(String),
    #[error("image {path}: {reason}")]
    UnreadableImage { path: PathBuf, reason: String },
    #[error("image {path}: {reason}")]
    UnsupportedImage { path: PathBuf, reason: String },
    #[error("image layer entry {0:?} leaves the root filesystem")]
    UnsafePath(String),
    #[error("no space left on device while {0}")]
    NoSpace(String),
    #[error("{what} failed ({status}); last output:\n{tail}")]
    Command {
        what: String,
        status: String,
        tail: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl BuildError {
    /// Wraps an I/O error with what was being done, turning ENOSPC into
    /// [`BuildError::NoSpace`] so callers need not dig into `io::Error`.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        let context = context.into();
        if source.raw_os_error() == Some(libc::ENOSPC)
            || source.kind() == io::ErrorKind::StorageFull
        {
            return BuildError::NoSpace(context);
        }
        BuildError::Io { context, source }
    }

    pub(crate) fn unreadable(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        BuildError::UnreadableImage {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = BuildError> = std::result::Result<T, E>;
