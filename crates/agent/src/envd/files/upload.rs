//! `POST /files`: multipart/form-data (one `file` part per file, the filename
//! being the full target path unless the `path` query names it) or a raw
//! `application/octet-stream` body, gzip Content-Encoding allowed for either.
//! Bodies are streamed to disk chunk by chunk.
//!
//! Existing files are truncated and rewritten in place rather than replaced by
//! a temporary file and a rename: that is the SDK's documented semantics, and it
//! keeps the inode, its owner, mode, hard links and open readers (as `>` in a
//! shell does). The cost: a failed upload leaves a partial file behind.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::pin::Pin;

use async_compression::tokio::bufread::GzipDecoder;
use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use envd_proto::filesystem::WrittenFile;
use futures_util::{Stream, StreamExt, TryStreamExt};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio_util::io::{ReaderStream, StreamReader};

use super::signature::Operation;
use super::{HttpErr, authorize, fs_error, parse_query, request_user};
use crate::envd::Envd;
use crate::envd::filesystem::as_user::{Creds, run_as};
use crate::envd::filesystem::entry::XATTR_PREFIX;
use crate::envd::filesystem::error::FsError;
use crate::envd::filesystem::ops::{create_dirs, create_dirs_for};
use crate::envd::user::User;

/// Buffer between the network and the disk, per file being written.
const WRITE_BUFFER: usize = 1024 * 1024;

/// How much of a body left unread after the answer is known (a multipart
/// epilogue, the chunked terminator, the rest of a refused upload) is still
/// read before answering, for at most `DRAIN_TIME`. Past either the
/// connection closes with data unread.
const DRAIN_LIMIT: usize = 1024 * 1024;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

type RawBody = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;
type ByteStream<'a> = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send + 'a>>;

pub async fn post_files(
    State(envd): State<Envd>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Body,
) -> Response {
    let mut body: RawBody = Box::pin(body.into_data_stream().map_err(io::Error::other));
    let received = receive(&envd, &headers, raw.as_deref(), &mut body).await;
    // The multipart parser stops at the closing boundary, before the body's
    // end (for a chunked body, its terminating chunk). Answering then makes
    // hyper close a connection with bytes still unread, which the kernel turns
    // into a reset: a client still sending its last bytes gets EPIPE or loses
    // the answer. So the rest is read first, within a bound.
    if tokio::time::timeout(DRAIN_TIME, drain(&mut body, DRAIN_LIMIT))
        .await
        .is_err()
    {
        log::debug!("upload: the body did not end within {DRAIN_TIME:?} of the answer");
    }
    match received {
        Ok(written) => Json(written).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Reads and drops `body` to its end, or until more than `limit` bytes or an
/// error came.
async fn drain(body: &mut RawBody, limit: usize) {
    let mut left = limit;
    while let Some(Ok(chunk)) = body.next().await {
        match left.checked_sub(chunk.len()) {
            Some(l) => left = l,
            None => {
                log::debug!("upload: more than {limit} bytes unread after the answer");
                return;
            }
        }
    }
}

async fn receive(
    envd: &Envd,
    headers: &HeaderMap,
    raw: Option<&str>,
    body: &mut RawBody,
) -> Result<Vec<WrittenFile>, HttpErr> {
    let q = parse_query(raw)?;
    authorize(envd, headers, &q, Operation::Write)?;
    let user = request_user(envd, headers, &q)?;
    let metadata = metadata_headers(headers)?;
    let query_path = q.path.filter(|p| !p.is_empty());
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let media = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let data = decoded_body(headers, body)?;
    match media.as_str() {
        "multipart/form-data" => {
            let boundary = multer::parse_boundary(content_type).map_err(|e| {
                HttpErr::new(StatusCode::BAD_REQUEST, &format!("invalid multipart: {e}"))
            })?;
            let mut parts = multer::Multipart::new(data, boundary);
            let mut written = Vec::new();
            loop {
                let field = parts.next_field().await.map_err(|e| {
                    HttpErr::new(StatusCode::BAD_REQUEST, &format!("invalid multipart: {e}"))
                })?;
                let Some(field) = field else { break };
                if field.name() != Some("file") {
                    continue;
                }
                // The query path wins; else the part's filename is the path.
                let target = match (&query_path, field.file_name()) {
                    (Some(p), _) => p.clone(),
                    (None, Some(f)) if !f.is_empty() => f.to_string(),
                    _ => {
                        return Err(HttpErr::new(
                            StatusCode::BAD_REQUEST,
                            "a file part has no filename and there is no path parameter",
                        ));
                    }
                };
                let resolved = user.resolve_path(&target);
                if let Some(e) = duplicate(&written, &resolved.to_string_lossy()) {
                    return Err(e);
                }
                written.push(write_one(&user, &target, field, &metadata).await?);
            }
            if written.is_empty() {
                return Err(HttpErr::new(
                    StatusCode::BAD_REQUEST,
                    "no \"file\" part in the multipart body",
                ));
            }
            Ok(written)
        }
        "application/octet-stream" => {
            let Some(target) = query_path else {
                return Err(HttpErr::new(
                    StatusCode::BAD_REQUEST,
                    "path is required for an octet-stream upload",
                ));
            };
            Ok(vec![write_one(&user, &target, data, &metadata).await?])
        }
        other => Err(HttpErr::new(
            StatusCode::BAD_REQUEST,
            &format!(
                "unsupported Content-Type {other:?}; use multipart/form-data or application/octet-stream"
            ),
        )),
    }
}

/// envd's refusal of a second part for `path` in one upload (400, after the
/// parts before it were written), worded as envd words it.
fn duplicate(written: &[WrittenFile], path: &str) -> Option<HttpErr> {
    if !written.iter().any(|w| w.path == path) {
        return None;
    }
    let mut message = format!(
        "you cannot upload multiple files to the same path '{path}' in one upload request, \
         only the first specified file was uploaded"
    );
    let others: Vec<&str> = written
        .iter()
        .map(|w| w.path.as_str())
        .filter(|p| *p != path)
        .collect();
    // envd lists the others only when there are two or more.
    if others.len() > 1 {
        message.push_str(&format!(
            ", also the following files were uploaded: {}",
            others.join(", ")
        ));
    }
    Some(HttpErr::new(StatusCode::BAD_REQUEST, &message))
}

/// `X-Metadata-<Key>: value` → key (lowercased) → value.
fn metadata_headers(headers: &HeaderMap) -> Result<BTreeMap<String, String>, HttpErr> {
    let mut out = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        if key.is_empty() {
            continue;
        }
        let value = value.to_str().map_err(|_| {
            HttpErr::new(
                StatusCode::BAD_REQUEST,
                &format!("metadata {key:?} is not visible ASCII"),
            )
        })?;
        out.insert(key.to_string(), value.to_string());
    }
    Ok(out)
}

/// The request body as a byte stream, gunzipped when Content-Encoding says so.
fn decoded_body<'a>(headers: &HeaderMap, raw: &'a mut RawBody) -> Result<ByteStream<'a>, HttpErr> {
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    match encoding.as_deref() {
        None | Some("") | Some("identity") => Ok(Box::pin(raw)),
        Some("gzip") | Some("x-gzip") => {
            let mut gz = GzipDecoder::new(StreamReader::new(raw));
            gz.multiple_members(true);
            Ok(Box::pin(ReaderStream::with_capacity(gz, 256 * 1024)))
        }
        Some(other) => Err(HttpErr::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            &format!("unsupported Content-Encoding {other:?}"),
        )),
    }
}

async fn write_one<S, E>(
    user: &User,
    raw_path: &str,
    mut data: S,
    metadata: &BTreeMap<String, String>,
) -> Result<WrittenFile, HttpErr>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let path = user.resolve_path(raw_path);
    make_parents(user, &path).await?;
    let (p, md) = (path.clone(), metadata.clone());
    let (file, truncate) = run_as(&Creds::from(user), move || open_for_write(&p, &md))
        .await
        .map_err(|e| fs_error(&e))?;
    let (p, owner) = (path.clone(), (user.uid, user.gid));
    let file = tokio::task::spawn_blocking(move || {
        take_for_user(&file, truncate, owner, &p).map(|()| file)
    })
    .await
    .map_err(|e| fs_error(&FsError::io("open", &path, &io::Error::other(e))))?
    .map_err(|e| fs_error(&e))?;
    let mut out = BufWriter::with_capacity(WRITE_BUFFER, tokio::fs::File::from_std(file));
    let write_err = |e: io::Error| fs_error(&FsError::io("write", &path, &e));
    while let Some(chunk) = data.next().await {
        let chunk = chunk.map_err(|e| {
            HttpErr::new(
                StatusCode::BAD_REQUEST,
                &format!("reading the request body: {e}"),
            )
        })?;
        out.write_all(&chunk).await.map_err(write_err)?;
    }
    // Also waits for the last background write, so a full disk shows up here.
    out.flush().await.map_err(write_err)?;
    Ok(WrittenFile {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        file_type: "file".into(),
        path: path.to_string_lossy().into_owned(),
        metadata: (!metadata.is_empty()).then(|| metadata.clone()),
    })
}

/// The missing parents of `path`, made as envd makes them: by root, handed
/// to the writing user (E2B's SDKs write `/0/x.txt` as `user` and expect it
/// to work).
pub(crate) async fn make_parents(user: &User, path: &Path) -> Result<(), HttpErr> {
    let Some(parent) = path.parent().map(Path::to_owned) else {
        return Ok(());
    };
    let owner = (user.uid, user.gid);
    let at = parent.clone();
    tokio::task::spawn_blocking(move || create_dirs_for(&at, owner))
        .await
        .map_err(|e| {
            fs_error(&FsError::io(
                "create directory",
                &parent,
                &io::Error::other(e),
            ))
        })?
        .map_err(|e| fs_error(&e))
}

/// Creates the parents, then opens `path` for writing, as the calling
/// thread's user, so only what the user may write is opened; replaces the
/// file's metadata set. An existing regular file is not truncated yet: the
/// second value says it is to be, once it has changed hands (see
/// [`take_for_user`]).
fn open_for_write(
    path: &Path,
    metadata: &BTreeMap<String, String>,
) -> Result<(std::fs::File, bool), FsError> {
    if let Some(parent) = path.parent() {
        create_dirs(parent)?;
    }
    let existing = std::fs::metadata(path).ok();
    if existing.as_ref().is_some_and(|m| m.is_dir()) {
        return Err(FsError::invalid(format!(
            "{} is a directory",
            path.display()
        )));
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .mode(0o644)
        // Never wait in open(2) for a FIFO's reader; blocking I/O after.
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| FsError::io("open", path, &e))?;
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    replace_metadata(&file, metadata).map_err(|e| FsError::io("store metadata on", path, &e))?;
    let truncate = existing.is_some_and(|m| m.is_file());
    Ok((file, truncate))
}

/// Gives the opened file to `owner` (uid, gid) with the agent's own (root)
/// credentials, then truncates it if it is to be: envd, running as root,
/// makes an uploaded file the writing user's, even one the user could not
/// chown (a root-owned file the user may write). The descriptor was opened as
/// the user, so only a file the user may write changes hands; only a regular
/// file does (never a device such as /dev/null). Chowning before the truncate
/// and the writes keeps envd's watch events: chmod, then the writes.
fn take_for_user(
    file: &std::fs::File,
    truncate: bool,
    (uid, gid): (u32, u32),
    path: &Path,
) -> Result<(), FsError> {
    let regular = file.metadata().is_ok_and(|m| m.is_file());
    if regular && let Err(e) = std::os::unix::fs::fchown(file, Some(uid), Some(gid)) {
        log::debug!("chown {}: {e}", path.display());
    }
    if truncate {
        file.set_len(0)
            .map_err(|e| FsError::io("truncate", path, &e))?;
    }
    Ok(())
}

/// Removes the file's `user.e2b.*` attributes and sets the given ones. When
/// none are given, a filesystem without user xattrs is not an error.
fn replace_metadata(file: &std::fs::File, metadata: &BTreeMap<String, String>) -> io::Result<()> {
    let fd = file.as_raw_fd();
    match list_xattrs(fd) {
        Ok(names) => {
            for name in names {
                if name.as_bytes().starts_with(XATTR_PREFIX.as_bytes()) {
                    // SAFETY: fd is open; name is NUL-terminated.
                    if unsafe { libc::fremovexattr(fd, name.as_ptr()) } < 0 {
                        let e = io::Error::last_os_error();
                        if e.raw_os_error() != Some(libc::ENODATA) {
                            return Err(e);
                        }
                    }
                }
            }
        }
        Err(_) if metadata.is_empty() => return Ok(()),
        Err(e) => return Err(e),
    }
    for (key, value) in metadata {
        let name = CString::new(format!("{XATTR_PREFIX}{key}"))
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in metadata key"))?;
        // SAFETY: fd is open; name is NUL-terminated; value points to len bytes.
        let r =
            unsafe { libc::fsetxattr(fd, name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn list_xattrs(fd: i32) -> io::Result<Vec<CString>> {
    for _ in 0..4 {
        // SAFETY: a null buffer of size 0 asks for the needed size.
        let n = unsafe { libc::flistxattr(fd, std::ptr::null_mut(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: buf is writable for buf.len() bytes.
        let m = unsafe { libc::flistxattr(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if m < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ERANGE) {
                continue;
            }
            return Err(e);
        }
        buf.truncate(m as usize);
        return Ok(buf
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .filter_map(|n| CString::new(n).ok())
            .collect());
    }
    Err(io::Error::from_raw_os_error(libc::ERANGE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envd::filesystem::entry::read_metadata;
    use crate::envd::filesystem::error::FsErrorKind;

    #[test]
    fn metadata_is_replaced_as_a_set() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("f");
        let md = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let f = open_for_write(&p, &md(&[("a", "1"), ("b", "2")]));
        match f {
            Err(e) if e.message.contains("Operation not supported") => {
                eprintln!("SKIPPED: {} has no user xattrs: {e}", t.path().display());
                return;
            }
            other => drop(other.unwrap()),
        }
        assert_eq!(read_metadata(&p), md(&[("a", "1"), ("b", "2")]));
        drop(open_for_write(&p, &md(&[("c", "3")])).unwrap());
        assert_eq!(read_metadata(&p), md(&[("c", "3")]));
        drop(open_for_write(&p, &md(&[])).unwrap());
        assert!(read_metadata(&p).is_empty());
    }

    #[test]
    fn directories_are_not_files() {
        let t = tempfile::tempdir().unwrap();
        let e = open_for_write(t.path(), &BTreeMap::new()).unwrap_err();
        assert_eq!(e.kind, FsErrorKind::InvalidArgument);
        let p = t.path().join("deep/er/f");
        drop(open_for_write(&p, &BTreeMap::new()).unwrap());
        assert!(p.is_file());
    }
}
