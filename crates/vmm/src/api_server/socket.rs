//! Binding the API socket: replace a stale socket file, never a live one or a non-socket.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::ApiServerError;

/// A bound listener and the identity of the socket file it created, so shutdown removes
/// that file and not one a later process put at the same path.
#[derive(Debug)]
pub(super) struct BoundSocket {
    pub listener: UnixListener,
    pub path: PathBuf,
    file_id: (u64, u64),
}

pub(super) fn bind(path: &Path) -> Result<BoundSocket, ApiServerError> {
    let socket_error = |source: io::Error| ApiServerError::Socket {
        path: path.to_owned(),
        source,
    };
    match fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(ApiServerError::NotASocket {
                path: path.to_owned(),
            });
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => {
                return Err(ApiServerError::InUse {
                    path: path.to_owned(),
                });
            }
            // Nobody listens: a leftover of a process that died without cleaning up.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                fs::remove_file(path).map_err(socket_error)?;
            }
            Err(e) => return Err(socket_error(e)),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(socket_error(e)),
    }

    let listener = UnixListener::bind(path).map_err(socket_error)?;
    let meta = fs::metadata(path).map_err(socket_error)?;
    // The API controls the VM: only its owner may talk to it.
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(socket_error)?;
    listener.set_nonblocking(true).map_err(socket_error)?;
    Ok(BoundSocket {
        listener,
        path: path.to_owned(),
        file_id: (meta.dev(), meta.ino()),
    })
}

/// Removes the socket file if it is still the one [`bind`] created.
pub(super) fn remove(path: &Path, file_id: (u64, u64)) {
    if let Ok(meta) = fs::symlink_metadata(path)
        && (meta.dev(), meta.ino()) == file_id
        && let Err(e) = fs::remove_file(path)
    {
        tracing::warn!("cannot remove API socket {}: {e}", path.display());
    }
}

impl BoundSocket {
    pub fn file_id(&self) -> (u64, u64) {
        self.file_id
    }
}
