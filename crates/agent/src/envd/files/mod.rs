//! envd's plain-HTTP file routes (spec §3.5): `GET /files` streams a file out,
//! `POST /files` streams files in, `POST /files/compose` concatenates files.
//! Errors are `{"code": <status>, "message"}`.

pub mod compose;
pub mod download;
pub mod negotiate;
pub mod signature;
pub mod upload;

use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use super::Envd;
use super::auth;
use super::filesystem::error::FsError;
use super::response::json_error;
use super::user::{self, User};
use signature::Operation;

pub fn router() -> Router<Envd> {
    Router::new()
        .route("/files", get(download::get_file).post(upload::post_files))
        .route("/files/compose", post(compose::compose))
}

/// The query of `/files`.
#[derive(Debug, Default, Deserialize)]
pub struct FilesQuery {
    pub path: Option<String>,
    pub username: Option<String>,
    pub signature: Option<String>,
    pub signature_expiration: Option<String>,
}

/// Parses the query string; unknown keys are ignored.
pub fn parse_query(raw: Option<&str>) -> Result<FilesQuery, HttpErr> {
    serde_urlencoded::from_str(raw.unwrap_or(""))
        .map_err(|e| HttpErr::new(StatusCode::BAD_REQUEST, &format!("invalid query: {e}")))
}

/// Lets the request through if the sandbox has no token, if the header token
/// was present (the auth layer has already compared it), or if the URL carries
/// a valid signature for this path, operation and user.
pub fn authorize(
    envd: &Envd,
    headers: &HeaderMap,
    q: &FilesQuery,
    op: Operation,
) -> Result<(), HttpErr> {
    let Some(token) = envd.sandbox.access_token() else {
        return Ok(());
    };
    // A non-empty header was checked by the middleware already.
    if auth::header_present(headers) {
        return Ok(());
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    signature::verify(
        q.path.as_deref().unwrap_or(""),
        op,
        q.username.as_deref().unwrap_or(""),
        &token,
        q.signature.as_deref(),
        q.signature_expiration.as_deref(),
        now,
    )
    .map_err(|e| HttpErr::new(StatusCode::UNAUTHORIZED, &e.to_string()))
}

/// The user of a file request: the `username` parameter, else the Basic-auth
/// user, else the default user.
pub fn request_user(envd: &Envd, headers: &HeaderMap, q: &FilesQuery) -> Result<User, HttpErr> {
    let found = match q.username.as_deref().filter(|u| !u.is_empty()) {
        Some(name) => user::lookup(name),
        None => user::resolve(headers, envd.sandbox.settings().default_user.as_deref()),
    };
    found.map_err(|e| HttpErr::new(StatusCode::UNAUTHORIZED, &e.to_string()))
}

/// A filesystem failure as envd's JSON error.
pub fn fs_error(e: &FsError) -> HttpErr {
    let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    HttpErr::new(status, &e.message)
}

/// An error answer of the file routes: `{"code": <status>, "message"}`.
#[derive(Debug)]
pub struct HttpErr {
    pub status: StatusCode,
    pub message: String,
}

impl HttpErr {
    pub fn new(status: StatusCode, message: &str) -> Self {
        Self {
            status,
            message: message.to_string(),
        }
    }
}

impl IntoResponse for HttpErr {
    fn into_response(self) -> Response {
        json_error(self.status, &self.message)
    }
}
