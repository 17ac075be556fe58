//! `POST /files/compose`: concatenates source files into a destination file,
//! as the user, and answers the destination's EntryInfo. Not used by the SDKs.

use std::path::{Path, PathBuf};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use envd_proto::filesystem::{ComposeRequest, EntryInfo};

use super::{FilesQuery, fs_error, request_user};
use crate::envd::Envd;
use crate::envd::filesystem::as_user::{Creds, run_as};
use crate::envd::filesystem::error::FsError;
use crate::envd::filesystem::ops::{create_dirs, stat};
use crate::envd::response::json_error;

pub async fn compose(State(envd): State<Envd>, headers: HeaderMap, body: Bytes) -> Response {
    let req: ComposeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &format!("invalid body: {e}")),
    };
    if req.source_paths.is_empty() || req.destination.is_empty() {
        return json_error(
            StatusCode::BAD_REQUEST,
            "source_paths and destination are required",
        );
    }
    let q = FilesQuery {
        username: req.username.clone(),
        ..Default::default()
    };
    let user = match request_user(&envd, &headers, &q) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let sources: Vec<PathBuf> = req
        .source_paths
        .iter()
        .map(|p| user.resolve_path(p))
        .collect();
    let dest = user.resolve_path(&req.destination);
    if let Err(e) = super::upload::make_parents(&user, &dest).await {
        return e.into_response();
    }
    match run_as(&Creds::from(&user), move || concat(&sources, &dest)).await {
        Ok(entry) => Json(entry).into_response(),
        Err(e) => fs_error(&e).into_response(),
    }
}

/// Writes to a temporary file next to `dest` and renames it over: a source may
/// be the destination itself, which truncating first would destroy.
fn concat(sources: &[PathBuf], dest: &Path) -> Result<EntryInfo, FsError> {
    if let Some(parent) = dest.parent() {
        create_dirs(parent)?;
    }
    let dir = dest.parent().unwrap_or(Path::new("/"));
    let mut tmp = tempfile_in(dir)?;
    for src in sources {
        let mut f = std::fs::File::open(src).map_err(|e| FsError::io("open", src, &e))?;
        if f.metadata().is_ok_and(|m| m.is_dir()) {
            return Err(FsError::invalid(format!(
                "{} is a directory",
                src.display()
            )));
        }
        std::io::copy(&mut f, &mut tmp.1).map_err(|e| FsError::io("write", &tmp.0, &e))?;
    }
    std::fs::rename(&tmp.0, dest).map_err(|e| FsError::io("rename to", dest, &e))?;
    tmp.0 = PathBuf::new();
    stat(dest)
}

/// A new file in `dir`, removed on drop unless its path was cleared.
struct Temp(PathBuf, std::fs::File);

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn tempfile_in(dir: &Path) -> Result<Temp, FsError> {
    for i in 0..100u32 {
        let p = dir.join(format!(".compose-{}-{i}", std::process::id()));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&p)
        {
            Ok(f) => return Ok(Temp(p, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(FsError::io("create", &p, &e)),
        }
    }
    Err(FsError::io(
        "create temporary file in",
        dir,
        &std::io::Error::from_raw_os_error(libc::EEXIST),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envd::filesystem::error::FsErrorKind;

    #[test]
    fn concatenates_including_into_a_source() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        std::fs::write(&a, b"12").unwrap();
        std::fs::write(&b, b"34").unwrap();
        let e = concat(&[a.clone(), b.clone()], &t.path().join("out/c")).unwrap();
        assert_eq!(e.size, 4);
        assert_eq!(std::fs::read(t.path().join("out/c")).unwrap(), b"1234");
        concat(&[a.clone(), a.clone()], &a).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"1212");
        let err = concat(&[t.path().join("missing")], &b).unwrap_err();
        assert_eq!(err.kind, FsErrorKind::NotFound);
        assert_eq!(std::fs::read(&b).unwrap(), b"34");
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 3);
    }
}
