//! Filesystem failures, classified the way the SDKs branch on them.

use std::io;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsErrorKind {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    /// The disk (or quota) is full.
    NoSpace,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FsError {
    pub kind: FsErrorKind,
    pub message: String,
}

impl FsError {
    pub fn new(kind: FsErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(FsErrorKind::InvalidArgument, message)
    }

    /// Classifies an I/O error on `path`, naming the path in the message.
    pub fn io(what: &str, path: &Path, e: &io::Error) -> Self {
        let kind = match e.raw_os_error() {
            Some(libc::ENOENT) => FsErrorKind::NotFound,
            Some(libc::EEXIST) => FsErrorKind::AlreadyExists,
            Some(libc::EACCES | libc::EPERM | libc::EROFS) => FsErrorKind::PermissionDenied,
            Some(libc::ENOSPC | libc::EDQUOT) => FsErrorKind::NoSpace,
            Some(
                libc::ENOTDIR
                | libc::EISDIR
                | libc::EINVAL
                | libc::ELOOP
                | libc::ENAMETOOLONG
                | libc::ENOTEMPTY
                | libc::EXDEV
                | libc::ENXIO,
            ) => FsErrorKind::InvalidArgument,
            _ if e.kind() == io::ErrorKind::InvalidInput => FsErrorKind::InvalidArgument,
            _ => FsErrorKind::Internal,
        };
        Self::new(kind, format!("{what} {}: {e}", path.display()))
    }

    /// The HTTP status envd's plain HTTP routes use for this failure.
    pub fn http_status(&self) -> u16 {
        match self.kind {
            FsErrorKind::InvalidArgument => 400,
            FsErrorKind::NotFound => 404,
            FsErrorKind::AlreadyExists => 409,
            FsErrorKind::PermissionDenied => 403,
            FsErrorKind::NoSpace => 507,
            FsErrorKind::Internal => 500,
        }
    }
}

impl From<io::Error> for FsError {
    fn from(e: io::Error) -> Self {
        Self::io("filesystem", Path::new("operation"), &e)
    }
}

impl From<FsError> for envd_proto::ConnectError {
    fn from(e: FsError) -> Self {
        use envd_proto::Code;
        let code = match e.kind {
            FsErrorKind::InvalidArgument => Code::InvalidArgument,
            FsErrorKind::NotFound => Code::NotFound,
            FsErrorKind::AlreadyExists => Code::AlreadyExists,
            FsErrorKind::PermissionDenied => Code::PermissionDenied,
            FsErrorKind::NoSpace => Code::ResourceExhausted,
            FsErrorKind::Internal => Code::Internal,
        };
        envd_proto::ConnectError::new(code, e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_classes() {
        let p = Path::new("/x");
        let k = |errno| FsError::io("open", p, &io::Error::from_raw_os_error(errno)).kind;
        assert_eq!(k(libc::ENOENT), FsErrorKind::NotFound);
        assert_eq!(k(libc::EACCES), FsErrorKind::PermissionDenied);
        assert_eq!(k(libc::ENOSPC), FsErrorKind::NoSpace);
        assert_eq!(k(libc::ENOTDIR), FsErrorKind::InvalidArgument);
        assert_eq!(k(libc::EIO), FsErrorKind::Internal);
        let e = FsError::io("open", p, &io::Error::from_raw_os_error(libc::ENOENT));
        assert!(e.message.starts_with("open /x: "), "{}", e.message);
        assert_eq!(e.http_status(), 404);
    }
}
