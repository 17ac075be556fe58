//! `GET /files`: a file's bytes streamed from disk (never whole in memory),
//! optionally gzip-encoded, with single-range requests.

use std::io::SeekFrom;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use async_compression::Level;
use async_compression::tokio::bufread::GzipEncoder;
use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::io::{AsyncReadExt, AsyncSeekExt, BufReader};
use tokio_util::io::ReaderStream;

use super::negotiate::{Coding, RangeRequest, choose_coding, content_disposition, parse_range};
use super::signature::Operation;
use super::{HttpErr, authorize, fs_error, parse_query, request_user};
use crate::envd::Envd;
use crate::envd::filesystem::as_user::{Creds, run_as};
use crate::envd::filesystem::error::FsError;

/// Read size per chunk of the response body.
const CHUNK: usize = 256 * 1024;

pub async fn get_file(
    State(envd): State<Envd>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    match serve(&envd, &headers, raw.as_deref()).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn serve(envd: &Envd, headers: &HeaderMap, raw: Option<&str>) -> Result<Response, HttpErr> {
    let q = parse_query(raw)?;
    authorize(envd, headers, &q, Operation::Read)?;
    let user = request_user(envd, headers, &q)?;
    let Some(raw_path) = q.path.as_deref().filter(|p| !p.is_empty()) else {
        return Err(HttpErr::new(StatusCode::BAD_REQUEST, "path is required"));
    };
    let path = user.resolve_path(raw_path);
    let accept = headers
        .get(header::ACCEPT_ENCODING)
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    let Some(mut coding) = choose_coding(accept) else {
        return Err(HttpErr::new(
            StatusCode::NOT_ACCEPTABLE,
            &format!("unsupported Accept-Encoding {:?}", accept.unwrap_or("")),
        ));
    };

    let p = path.clone();
    let (file, size) = run_as(&Creds::from(&user), move || open_for_read(&p))
        .await
        .map_err(|e| fs_error(&e))?;
    let mut file = tokio::fs::File::from_std(file);

    let range = parse_range(
        headers.get(header::RANGE).and_then(|v| v.to_str().ok()),
        size,
    );
    if range != RangeRequest::Full {
        // Byte ranges address the file itself, so a ranged answer is identity.
        coding = Coding::Identity;
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut resp = Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::VARY, "Accept-Encoding");
    if let Ok(v) = HeaderValue::from_str(&content_disposition(&name)) {
        resp = resp.header(header::CONTENT_DISPOSITION, v);
    }
    let (status, body) = match range {
        RangeRequest::Unsatisfiable => {
            let r = resp
                .status(StatusCode::RANGE_NOT_SATISFIABLE)
                .header(header::CONTENT_RANGE, format!("bytes */{size}"))
                .body(Body::empty());
            return Ok(r.unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()));
        }
        RangeRequest::Partial { start, end } => {
            file.seek(SeekFrom::Start(start))
                .await
                .map_err(|e| fs_error(&FsError::io("seek", &path, &e)))?;
            let len = end - start + 1;
            resp = resp
                .header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{size}"))
                .header(header::CONTENT_LENGTH, len);
            let stream = ReaderStream::with_capacity(file.take(len), CHUNK);
            (StatusCode::PARTIAL_CONTENT, Body::from_stream(stream))
        }
        RangeRequest::Full => match coding {
            Coding::Identity => {
                resp = resp.header(header::CONTENT_LENGTH, size);
                let stream = ReaderStream::with_capacity(file, CHUNK);
                (StatusCode::OK, Body::from_stream(stream))
            }
            Coding::Gzip => {
                resp = resp.header(header::CONTENT_ENCODING, "gzip");
                let gz = GzipEncoder::with_quality(
                    BufReader::with_capacity(CHUNK, file),
                    Level::Fastest,
                );
                let stream = ReaderStream::with_capacity(gz, CHUNK);
                (StatusCode::OK, Body::from_stream(stream))
            }
        },
    };
    Ok(resp
        .status(status)
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

/// Opens `path` for reading as the calling thread's user. Only regular files
/// are served: directories are refused here rather than failing mid-stream,
/// and FIFOs or devices could block or never end. O_NONBLOCK keeps the open
/// itself from waiting on a FIFO's writer.
fn open_for_read(path: &Path) -> Result<(std::fs::File, u64), FsError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| FsError::io("open", path, &e))?;
    let md = file.metadata().map_err(|e| FsError::io("stat", path, &e))?;
    if md.is_dir() {
        return Err(FsError::invalid(format!(
            "{} is a directory",
            path.display()
        )));
    }
    if !md.is_file() {
        return Err(FsError::invalid(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    Ok((file, md.len()))
}
